"""Sweeps on a Dask cluster (``turnip ablate --scheduler``, ``run_sweep(pool=sim.cluster.ClusterSweep(...))``):
the same rows as on local processes, runs of a killed worker run again, nothing half-written when workers
keep dying, one-line errors for a bad address or dask missing, and dask never imported by a sweep that does
not ask for it."""

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sim.cluster import ClusterSweep, chunks
from sim.sweep import TIMING_COLUMNS, SweepConfig, run_sweep
from tests.clicall import call

pytestmark = pytest.mark.sim

# two plans (one of 2 GPUs), det-replay: the fastest nondet run picked from results in any order
CFG = SweepConfig(models=("llama-tiny",), seqs=(16,), gpus=(1, 2), budgets={"s": "96KiB"},
                  policies=("nondet", "det", "det-replay"), seeds=2,
                  trace={"model": "llama-tiny", "seq": 16, "gpus": 1, "budget": "s"})  # fmt: skip
SAME_FILES = ("summary.csv", "config.json", "traces/nondet.spans.csv", "traces/det.memory.csv", "traces/meta.json")


def rows(out: Path) -> list[list[str]]:
    """runs.csv's cells as written, the timing columns left out."""
    with open(out / "runs.csv", newline="") as f:
        table = list(csv.reader(f))
    keep = [i for i, c in enumerate(table[0]) if c not in TIMING_COLUMNS]
    return [[r[i] for i in keep] for r in table]


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    """The sweep run on local processes (the default)."""
    out = tmp_path_factory.mktemp("local")
    run_sweep(CFG, out, jobs=2, quiet=True)
    return out


def assert_same_results(out: Path, local: Path) -> None:
    assert len(rows(out)) == 1 + 2 * 3 * 3  # header, plans x policies x (2 seeds + 1 noise-free)
    assert rows(out) == rows(local)
    for name in SAME_FILES:
        assert (out / name).read_bytes() == (local / name).read_bytes(), name


def test_a_sweep_on_a_local_cluster_writes_the_rows_of_local_processes(tmp_path, local):
    pytest.importorskip("distributed")
    argv = ["ablate", "--models", "llama-tiny", "--seqs", "16", "--gpus", "1", "2", "--budgets", "s=96KiB",
            "--policies", "nondet", "det", "det-replay", "--seeds", "2", "--scheduler", "local:2", "--out",
            str(tmp_path)]  # fmt: skip
    rc, out, err = call(argv)  # CFG, through the command line
    assert rc == 0, err
    assert "on 2 Dask workers of a local Dask cluster" in out
    assert_same_results(tmp_path, local)
    assert sorted(os.listdir(tmp_path / "plans")) == sorted(os.listdir(local / "plans"))


def kill_cluster(marker: Path, once: bool):
    """A LocalCluster of 2 worker processes (restarted by their nannies when they die) whose workers SIGKILL
    themselves when a task of sweep runs starts executing on them (the first such task only when ``once``);
    ``marker`` is created just before, so the test knows a worker died."""
    import distributed
    from distributed.diagnostics.plugin import WorkerPlugin

    class Kill(WorkerPlugin):  # defined here: pickled by value, the workers need not import the tests
        def transition(self, key, start, finish, **kwargs):
            if finish != "executing" or not str(key).startswith("ablate-runs"):
                return
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                if once:
                    return
            os.kill(os.getpid(), signal.SIGKILL)

    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0")
    with distributed.Client(cluster) as client:
        client.register_plugin(Kill(), name="kill")
    return cluster


def test_runs_of_a_killed_worker_run_again(tmp_path, local):
    pytest.importorskip("distributed")
    marker = tmp_path / "killed"
    with kill_cluster(marker, once=True) as cluster:
        run_sweep(CFG, tmp_path / "out", quiet=True, pool=ClusterSweep(cluster.scheduler_address, CFG.profile))
    assert marker.exists()  # a worker died running sweep runs
    assert_same_results(tmp_path / "out", local)


def test_workers_that_keep_dying_fail_the_sweep_leaving_no_results(tmp_path):
    pytest.importorskip("distributed")
    import dask

    from sim.cluster import ClusterError
    from turnip.memgraph.io import load_plan

    out = tmp_path / "out"
    with dask.config.set({"distributed.scheduler.allowed-failures": 1}), kill_cluster(tmp_path / "k", False) as c:
        with pytest.raises(ClusterError, match="workers kept dying"):
            run_sweep(CFG, out, quiet=True, pool=ClusterSweep(c.scheduler_address, CFG.profile))
    assert sorted(p.name for p in out.iterdir()) == ["plans", "traces"]  # no runs.csv, summary, config
    assert not list((out / "traces").iterdir())
    plans = list((out / "plans").iterdir())
    assert len(plans) == 2 and all(load_plan(p)[0].n > 0 for p in plans)  # compiled before the runs: whole


def test_runs_are_grouped_by_plan_into_tasks_that_keep_every_worker_busy():
    names = ["a"] * 10 + ["b"] * 3
    assert chunks(names, 1) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9], [10, 11, 12]]  # 13 // 4 = 3 per task
    assert chunks(names, 8) == [[i] for i in range(13)]
    assert [len(g) for g in chunks(["a"] * 1000, 1)] == [32] * 31 + [8]  # RUNS_PER_TASK at most
    assert sorted(i for g in chunks(names, 2) for i in g) == list(range(13))


ABLATE = ["ablate", "--models", "llama-tiny", "--seqs", "16", "--gpus", "1", "--budgets", "s=96KiB", "--seeds", "1"]


@pytest.mark.parametrize(
    "flags, code, said",
    [
        (["--scheduler", "local:0"], 2, "local:N takes a number of worker processes >= 1"),
        (["--scheduler", "myhost"], 2, "is not a scheduler address; pass tcp://HOST:PORT"),
        (["--scheduler", "local:2", "--jobs", "2"], 2, "drop --jobs"),
    ],
)
def test_a_bad_scheduler_is_a_one_line_usage_error(tmp_path, flags, code, said):
    rc, _, err = call([*ABLATE, "--out", str(tmp_path / "r"), *flags])
    assert rc == code and said in err and err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_an_unreachable_scheduler_is_a_one_line_error(tmp_path, monkeypatch):
    pytest.importorskip("distributed")
    import socket

    import sim.cluster

    monkeypatch.setattr(sim.cluster, "CONNECT_TIMEOUT_S", 1)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, _, err = call([*ABLATE, "--out", str(tmp_path / "r"), "--scheduler", f"tcp://127.0.0.1:{port}"])
    assert rc == 1 and err.startswith(f"error: cannot reach the Dask scheduler at tcp://127.0.0.1:{port}")
    assert err.count("\n") == 1 and not (tmp_path / "r" / "runs.csv").exists()


def test_without_dask_the_scheduler_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed raises ImportError
    rc, _, err = call([*ABLATE, "--out", str(tmp_path / "r"), "--scheduler", "local:2"])
    assert rc == 1 and "pip install 'turnip[cluster]'" in err and err.count("\n") == 1


def test_a_sweep_on_local_processes_does_not_import_dask(tmp_path):
    code = ("import sys; from turnip.cli import main; "
            f"rc = main({[*ABLATE, '--jobs', '1', '--out', str(tmp_path / 'r')]!r}); "
            "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed')))")  # fmt: skip
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[2])
    assert res.stdout.splitlines()[-1] == "0 []", res.stderr
    assert (tmp_path / "r" / "runs.csv").exists()
