"""Decode steps through ``turnip simulate --decode`` and ``turnip ablate --workloads ... decode``: the plan
``turnip generate`` runs for a context, verified and simulated; a cache larger than the budget crossing the
host link; decode rows of nondet and det in runs.csv and summary.csv, the same on local processes and Dask."""

import csv
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim import simulate
from sim.sweep import TIMING_COLUMNS
from tests.clicall import call
from turnip import decode as dec
from turnip.machine.profile import load_profile
from turnip.models import LLAMA
from turnip.plancache import decode_plan

pytestmark = pytest.mark.sim

TINY = LLAMA["tiny"]


def test_a_context_takes_the_bucket_generate_runs_it_in():
    assert [dec.context_blocks(n, 8) for n in (1, 8, 9, 16, 17)] == [1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="context"):
        dec.context_blocks(0, 8)


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_vertex_count_of_a_decode_step_is_known_without_building_it(gpus):
    for nb in (1, 2, 5):
        tg = dec.decode_step(TINY, dec.DecodeShape(3, nb, 4), gpus, "fp16", 24_000)
        assert dec.decode_vertices(TINY, nb, gpus, "fp16", 24_000) == tg.n


def test_a_cache_larger_than_the_budget_crosses_the_host_link_and_one_that_fits_stays():
    prof = load_profile("h100")
    moved = {}
    for budget in (24_000, 4 << 20):
        tg, mg = decode_plan(TINY, 48, 4, 1, budget, block=8, verify=True)  # the verifier passes it
        assert tg.meta["decode"]["n_blocks"] == 6
        r = simulate(mg, prof, "nondet", 0)
        assert 0 < r.lower_bound_ns < r.makespan_ns
        sp = r.trace(mg, {}).spans
        cache = set(dec.state_inputs(tg))
        read = [k == "input" and int(mg.tensor[v]) in cache for k, v in zip(sp["kind"], sp["v"], strict=True)]
        link = np.isin(sp["kind"], ["input", "offload", "reload"])
        moved[budget] = int(np.asarray(sp["nbytes"])[read].sum()), int(np.asarray(sp["nbytes"])[link].sum())
    assert dec.cache_nbytes(tg) > 24_000 * 4
    assert moved[24_000][0] >= dec.cache_nbytes(tg)  # every block from the host, at least once
    assert moved[4 << 20] == (0, 0)  # cache and weights resident: nothing crosses


def test_simulate_decode_reports_the_step_tokens_per_s_and_nondet_against_det(tmp_path):
    out_csv = tmp_path / "d.csv"
    rc, out, err = call(["simulate", "llama-tiny:40:1:40KiB", "--decode", "--batch", "2", "--block", "16",
                         "--runs", "2", "--csv", str(out_csv)])  # fmt: skip
    assert rc == 0, err
    assert "one decode step of 2 sequences over a cache of 48 slots (16 per block" in out
    assert "tokens/s (2 sequences x 1 token)" in out and "nondet/det " in out and "lower bound" in out
    t = pd.read_csv(out_csv)
    assert sorted(t.policy) == ["det", "det", "nondet", "nondet"] and set(t.workload) == {"decode"}
    assert np.allclose(t.tokens_per_s, 2e9 / t.makespan_ns)
    rc, _, err = call(["simulate", "llama-tiny:40:1:40KiB", "--block", "16"])
    assert rc == 2 and "--block applies to --decode only" in err
    rc, _, err = call(["simulate", "random:40:1:40KiB", "--decode"])
    assert rc == 2 and "LLaMA-family" in err


def test_simulate_decode_on_two_gpus_split_by_layers_or_tensor(tmp_path):
    """``--split layers`` / ``tensor`` on ``--decode``: the step split so (the CSV's split column says which); a
    layers step has the vertices of a one-GPU step; ``--split data`` is refused in one line."""
    n = {}
    for split in ("layers", "tensor"):
        out_csv = tmp_path / f"{split}.csv"
        rc, out, err = call(["simulate", "llama-tiny:40:2:4MiB", "--decode", "--batch", "2", "--block", "16",
                             "--split", split, "--runs", "1", "--csv", str(out_csv)])  # fmt: skip
        assert rc == 0, err
        t = pd.read_csv(out_csv)
        assert set(t.split) == {split}
        n[split] = int(out.split(" vertices")[0].split()[-1].replace(",", ""))
    assert n["layers"] < n["tensor"]
    rc, _, err = call(["simulate", "llama-tiny:40:2:4MiB", "--decode", "--split", "data"])
    assert rc == 2 and "--split data: a decode step is split by tensor blocks or by layers" in err


def runs(out: Path) -> list[list[str]]:
    with open(out / "runs.csv", newline="") as f:
        table = list(csv.reader(f))
    keep = [i for i, c in enumerate(table[0]) if c not in TIMING_COLUMNS]
    return [[r[i] for i in keep] for r in table]


ABLATE = ["ablate", "--models", "llama-tiny", "--seqs", "40", "--gpus", "1", "2", "--budgets", "s=40KiB",
          "--workloads", "prefill", "decode", "--decode-batch", "2", "--decode-block", "16", "--policies", "nondet",
          "det", "--seeds", "2"]  # fmt: skip


def test_ablate_reports_decode_rows_of_nondet_and_det_on_processes_and_dask(tmp_path):
    rc, out, err = call([*ABLATE, "--jobs", "2", "--out", str(tmp_path / "p")])
    assert rc == 0, err
    t = pd.read_csv(tmp_path / "p" / "runs.csv")
    d = t[t.workload == "decode"]
    assert len(d) == 2 * 2 * 3  # GPU counts x policies x (2 seeds + 1 noise-free)
    assert set(d.policy) == {"nondet", "det"} and set(d.gpus) == {1, 2}
    assert (d.batch == 2).all() and (d.cache_slots == 48).all() and (d.cache_nbytes > 40 << 10).all()
    assert np.allclose(d.tokens_per_s, 2e9 / d.makespan_ns)
    assert (t[t.workload == "prefill"].cache_nbytes == 0).all()
    s = pd.read_csv(tmp_path / "p" / "summary.csv")
    assert list(s.workload) == ["prefill", "decode"] * 2
    assert s.nondet_over_det.notna().all() and (s.nondet_tokens_per_s > 0).all()
    assert "decode:" in out and "nondet/det" in out
    assert all((tmp_path / "p" / "figures" / f"{f}.png").exists() for f in ("speedup", "efficiency", "offload_volume"))
    pytest.importorskip("distributed")
    rc, out, err = call([*ABLATE, "--scheduler", "local:2", "--out", str(tmp_path / "d")])
    assert rc == 0, err
    assert runs(tmp_path / "d") == runs(tmp_path / "p")


def test_ablate_refuses_decode_of_a_model_it_cannot_decode_and_bad_decode_settings(tmp_path):
    rc, _, err = call(["ablate", "--models", "random", "--workloads", "decode", "--out", str(tmp_path)])
    assert rc == 2 and "decode steps need a LLaMA-family model" in err
    cfg = tmp_path / "c.toml"
    cfg.write_text('[ablate]\nmodels = ["llama-tiny"]\nworkloads = ["decode"]\ndecode_batch = 0\n')
    rc, _, err = call(["ablate", "--config", str(cfg), "--out", str(tmp_path)])
    assert rc == 2 and "decode_batch is 0" in err
