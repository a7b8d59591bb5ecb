"""Every bad input to the turnip command is one `error:` line on stderr and exit status 1 or 2, with no
traceback (unless --debug) and no output file; plus the scale guard's estimate, atomic writes and the
progress display."""

import io
import json
import os
import shlex

import numpy as np
import pytest

from tests.clicall import call
from turnip.cli import CliError, as_cli_error, main

pytestmark = pytest.mark.unit


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A working directory with a good plan, a corrupt one, bad profile and config files and report dirs."""
    monkeypatch.chdir(tmp_path)
    assert call(["compile", "--model", "llama-tiny", "--seq", "32", "--budget", "64KiB", "-o", "plan.tplan"])[0] == 0
    data = (tmp_path / "plan.tplan").read_bytes()
    (tmp_path / "corrupt.tplan").write_bytes(data[: len(data) // 2])
    (tmp_path / "warp.toml").write_text("warp_speed = 9\n")
    (tmp_path / "broken.toml").write_text("= = =\n")
    (tmp_path / "badvalue.toml").write_text("[machine]\nn_gpus = 'four'\n")
    (tmp_path / "cfg_unknown.toml").write_text("[ablate]\nseqz = [64]\n")
    (tmp_path / "cfg_badseq.toml").write_text("[ablate]\nseqs = [0]\n")
    (tmp_path / "garbage.safetensors").write_text("not a safetensors file")
    (tmp_path / "emptyrep").mkdir()
    (tmp_path / "emptyrep" / "runs.csv").write_text("")
    (tmp_path / "otherrep").mkdir()
    (tmp_path / "otherrep" / "runs.csv").write_text("a,b\n1,2\n")
    (tmp_path / "afile").write_text("x")
    return tmp_path


BAD = [
    # the table
    "compile --model llama-tiny --tile t=0 -o x.tplan",
    "compile --model llama-tiny --tile q=5 -o x.tplan",
    "compile --model llama-tiny -o /nonexist/dir/x.tplan",
    "simulate plan.tplan --runs 0",
    "simulate plan.tplan --profile nosuch",
    "simulate corrupt.tplan",
    "compile --model llama-7b --seq 10000000 --budget 6GiB -o x.tplan",
    # compile
    "compile --model llama-tiny --tile t=-1 -o x.tplan",
    "compile --model llama-tiny --tile t=abc -o x.tplan",
    "compile --model llama-tiny --tile t -o x.tplan",
    "compile --model llama-tiny --tile t=4 --tile kv=6 -o x.tplan",
    "compile --model llama-tiny --tile d=64 -o x.tplan",
    "compile --model paper-matmul --tile t=8 -o x.tplan",
    "compile --model llama-tiny --seq 0 -o x.tplan",
    "compile --model llama-tiny --seq -3 -o x.tplan",
    "compile --model llama-tiny --gpus 0 -o x.tplan",
    "compile --model llama-tiny --gpus 9 -o x.tplan",
    "compile --model llama-tiny --budget 0B -o x.tplan",
    "compile --model llama-tiny --budget garbage -o x.tplan",
    "compile --model llama-tiny --budget 1e999GiB -o x.tplan",
    "compile --model llama-tiny --budget 1KiB -o x.tplan",
    "compile --model llama-tiny --lookahead 0 -o x.tplan",
    "compile --model llama-tiny --lookahead-bytes lots -o x.tplan",
    "compile --model llama-tiny --resident lots -o x.tplan",
    "compile --model llama-tiny --workspace lots -o x.tplan",
    "compile --model llama-tiny --layers 0 -o x.tplan",
    "compile --model llama-tiny --layers 3 -o x.tplan",
    "compile --model random --layers 1 -o x.tplan",
    "compile --model random --seed -1 -o x.tplan",
    "compile --model random --gpus 12 -o x.tplan",
    "compile --model llama-tiny --dtype fp64 -o x.tplan",
    "compile --model gpt-5 -o x.tplan",
    "compile --model llama-tiny --bogus -o x.tplan",
    "compile --model llama-tiny -o .",
    "compile --model llama-tiny -o afile/x.tplan",
    # verify
    "verify missing.tplan",
    "verify corrupt.tplan",
    "verify emptyrep",
    # simulate
    "simulate missing.tplan --csv x.csv",
    "simulate llama-tiny:abc:1:1MiB --csv x.csv",
    "simulate llama-tiny:64:9:1MiB --csv x.csv",
    "simulate llama-tiny:64:1:zz --csv x.csv",
    "simulate llama-tiny:64:1:1KiB --csv x.csv",
    "simulate gpt:64:1:1MiB --csv x.csv",
    "simulate llama-tiny:64:1 --csv x.csv",
    "simulate llama-7b:10000000:1:6GiB --csv x.csv",
    "simulate plan.tplan --seed -1 --csv x.csv",
    "simulate plan.tplan --runs -2 --csv x.csv",
    "simulate plan.tplan --policy fastest --csv x.csv",
    "simulate plan.tplan --profile warp.toml --csv x.csv",
    "simulate plan.tplan --profile broken.toml --csv x.csv",
    "simulate plan.tplan --profile badvalue.toml --csv x.csv",
    "simulate plan.tplan --trace /nonexist/t.json",
    "simulate plan.tplan --csv /nonexist/t.csv",
    "simulate plan.tplan --host-factor 0 --csv x.csv",
    "simulate plan.tplan --host-factor slow --csv x.csv",
    "simulate plan.tplan --link-factor 0 --csv x.csv",
    "simulate plan.tplan --link-factor -2 --csv x.csv",
    # ablate
    "ablate --config missing.toml --out rep",
    "ablate --config broken.toml --out rep",
    "ablate --config cfg_unknown.toml --out rep",
    "ablate --config cfg_badseq.toml --out rep",
    "ablate --seqs 0 --out rep",
    "ablate --gpus 9 --out rep",
    "ablate --seeds 0 --out rep",
    "ablate --jobs 0 --out rep",
    "ablate --budgets tight --out rep",
    "ablate --budgets tight=lots --out rep",
    "ablate --budgets tight=0B --out rep",
    "ablate --models gpt-5 --out rep",
    "ablate --policies fastest --out rep",
    "ablate --models llama-tiny --seqs 64 --profile nosuch --out rep",
    "ablate --models llama-7b --seqs 10000000 --out rep",
    "ablate --out afile",
    "ablate --models llama-tiny --seqs 64 --gpus 1 --budgets x=1KiB --seeds 1 --jobs 1 --out rep",
    # report
    "report missing",
    "report emptyrep",
    "report otherrep",
    # run
    "run --model llama-tiny --seq 32 --streams 0 --csv x.csv",
    "run --model llama-tiny --seq 32 --repeat 0 --csv x.csv",
    "run --model llama-tiny --seq 32 --warmup -1 --csv x.csv",
    "run --model llama-tiny --seq 32 --seed -1 --csv x.csv",
    "run --model llama-tiny --seq 32 --chaos 1.5 --csv x.csv",
    "run --model llama-tiny --seq 32 --stall-s 0 --csv x.csv",
    "run --model llama-tiny --seq 32 --tile q=1 --csv x.csv",
    "run --model llama-tiny --seq 32 --budget 1KiB --csv x.csv",
    "run --model llama-tiny --seq 32 --budget 1e3GiB --csv x.csv",
    "run --model llama-tiny --seq 32 --profile nosuch --csv x.csv",
    "run --model llama-tiny --seq 32 --weights missing.safetensors --csv x.csv",
    "run --model llama-tiny --seq 32 --weights garbage.safetensors --csv x.csv",
    "run --model llama-tiny --seq 32 --trace /nonexist/t.json",
    "run --model llama-tiny --seq 32 --csv /nonexist/t.csv",
    "run missing.tplan --csv x.csv",
    "run corrupt.tplan --csv x.csv",
    "run plan.tplan --tile t=8 --csv x.csv",
    "run --model llama-tiny --backend tpu --csv x.csv",
]


@pytest.mark.parametrize("cmd", BAD)
def test_bad_input_is_one_error_line(work, cmd):
    before = set(os.listdir(work))
    rc, out, err = call(shlex.split(cmd))
    assert rc in (1, 2), (cmd, rc, err)
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), (cmd, err)
    assert "Traceback" not in err, err
    assert ";" in lines[-1], f"an error says what to do: {lines[-1]}"
    created = set(os.listdir(work)) - before - {"rep"}  # ablate may create its (empty) output directory
    assert not created, (cmd, created)
    for d in ("rep",):
        if (work / d).exists():
            assert not any(p.is_file() and not p.name.endswith(".tplan") for p in (work / d).rglob("*")), cmd


def test_cuda_backend_without_a_driver(work, monkeypatch):
    import ctypes

    real = ctypes.CDLL

    def cdll(name, *a, **k):
        if "libcuda" in str(name):
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")
        return real(name, *a, **k)

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    rc, _, err = call(["run", "--model", "llama-tiny", "--backend", "cuda", "--csv", "x.csv"])
    assert rc == 1 and err.strip().splitlines()[-1].startswith("error: --backend cuda needs")
    assert "--backend cpu" in err and "Traceback" not in err and not (work / "x.csv").exists()


def test_exit_codes_follow_the_design(work):
    assert call(["compile", "--model", "llama-tiny", "--tile", "q=5"])[0] == 2  # bad argument
    assert call(["compile", "--model", "llama-tiny", "--budget", "1KiB"])[0] == 1  # infeasible budget
    assert call(["verify", "corrupt.tplan"])[0] == 2  # a named input file that is not a plan
    assert call(["simulate", "plan.tplan", "--runs", "0"])[0] == 2  # argparse
    assert call(["compile", "--model", "llama-7b", "--seq", "10000000"])[0] == 1  # too large without --force


def test_debug_shows_the_traceback_then_the_error(work):
    rc, _, err = call(["--debug", "simulate", "corrupt.tplan"])
    assert rc == 2 and "Traceback" in err and "PlanFormatError" in err
    assert err.strip().splitlines()[-1].startswith("error: ")


def test_a_bug_says_so_and_keeps_its_traceback(work, monkeypatch):
    import turnip.cli.compile_cmds as cc

    def boom(a):
        raise ZeroDivisionError("a real bug")

    monkeypatch.setattr(cc, "cmd_verify", boom)
    with pytest.raises(ZeroDivisionError):
        call(["verify", "plan.tplan"])


def test_bug_line_is_printed(work, monkeypatch, capsys):
    import turnip.cli.compile_cmds as cc

    monkeypatch.setattr(cc, "cmd_verify", lambda a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        main(["verify", "plan.tplan"])
    assert "internal error: this is a bug in turnip" in capsys.readouterr().err


def test_ctrl_c_exits_130(work, monkeypatch):
    import turnip.cli.compile_cmds as cc

    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.setattr(cc, "cmd_verify", interrupted)
    rc, _, err = call(["verify", "plan.tplan"])
    assert rc == 130 and "interrupted" in err


def test_exception_mapping():
    from turnip.memgraph.build import BudgetError
    from turnip.runtime._cudadrv import CudaError
    from turnip.runtime.errors import BackendError, RuntimeStall

    assert as_cli_error(BudgetError("x")).code == 1
    assert as_cli_error(BackendError("no device")).code == 1
    stall = as_cli_error(RuntimeStall(5.0, ["a", "b"], 1, 9))
    assert "\n" not in str(stall) and "--stall-s" in str(stall)
    assert "cupy" in str(as_cli_error(ModuleNotFoundError("No module named 'cupy'", name="cupy")))
    assert as_cli_error(ModuleNotFoundError("No module named 'turnip.x'", name="turnip.x")) is None  # a bug
    assert as_cli_error(CudaError("cuInit: CUDA_ERROR_NO_DEVICE")).code == 1
    assert as_cli_error(OSError("libcuda.so.1: cannot open shared object file")).code == 1
    assert as_cli_error(MemoryError()).code == 1
    assert as_cli_error(CliError("x", 2)).code == 2
    assert as_cli_error(ZeroDivisionError()) is None and as_cli_error(KeyError("k")) is None


def test_random_model_takes_a_seed(work):
    def plan(seed, name):
        assert call(["compile", "--model", "random", "--seed", str(seed), "--json", "-o", name])[0] == 0
        from turnip.memgraph.io import load_plan

        return load_plan(name)[1]

    a, b, c = plan(1, "a.tplan"), plan(2, "b.tplan"), plan(1, "c.tplan")
    assert a.shape != b.shape and a.shape == c.shape


def test_profile_names_list_every_preset_and_file(work):
    rc, _, err = call(["simulate", "plan.tplan", "--profile", "nosuch"])
    assert rc == 2 and "h100" in err and "h100-measured" in err


def test_ablate_config_unknown_keys_list_the_known_ones(work):
    rc, _, err = call(["ablate", "--config", "cfg_unknown.toml", "--out", "rep"])
    assert rc == 2 and "seqz" in err and all(k in err for k in ("models", "seqs", "budgets", "policies", "trace"))


def test_large_compile_refused_fast_with_a_way_out(work):
    import time

    t0 = time.perf_counter()
    rc, _, err = call(["compile", "--model", "llama-7b", "--seq", "10000000", "--budget", "6GiB"])
    assert rc == 1 and time.perf_counter() - t0 < 5
    line = err.strip().splitlines()[-1]
    assert "vertices" in line and " s to compile" in line and "host memory" in line
    assert "--tile t=" in line and "--force" in line


# the estimate against the real taskgraph (it counts blocks per op as turnip/graph_lower.py lowers them)
CONFIGS = [
    ("llama-tiny", 64, 1, None, None, "64KiB"),
    ("llama-tiny", 100, 3, {"t": 32}, None, None),
    ("llama-tiny", 97, 2, {"t": 8, "h": 1, "f": 40}, 1, None),
    ("llama-tiny", 64, 5, {"t": 8, "kv": 16}, None, None),
    ("llama-tiny", 130, 4, {"t": 16, "h": 3, "f": 33, "kv": 48}, 2, "1MiB"),
    ("llama-tiny", 64, 7, {"t": 3, "h": 1, "f": 1}, 1, None),
    ("llama-7b", 4096, 1, None, None, "6GiB"),
    ("llama-7b", 4096, 4, None, None, "1GiB"),
    ("llama-7b", 30000, 3, {"t": 1024, "kv": 4096}, 2, "2GiB"),
    ("llama-13b", 8192, 2, {"t": 512}, 1, "2GiB"),
    ("llama-65b", 2048, 8, None, 2, "4GiB"),
    ("llama-tiny-gqa", 100, 3, {"t": 16, "v": 30}, None, None),
    ("paper-matmul", 1, 1, None, None, None),
]


HEAD_CASES = [(*c, "none") for c in CONFIGS] + [
    (*c, h) for c in CONFIGS for h in ("last", "all") if c[0].startswith("llama") and c[1] <= 8192
]


@pytest.mark.parametrize("model,seq,gpus,tiles,layers,budget,head", HEAD_CASES)
def test_estimate_matches_the_taskgraph(model, seq, gpus, tiles, layers, budget, head):
    from turnip.compile import estimate, make_taskgraph, parse_nbytes

    b = parse_nbytes(budget) if budget else None
    est = estimate(model, seq, gpus, "fp16", tiles, layers, b, head=head)
    tg = make_taskgraph(model, seq, gpus, "fp16", tiles, n_layers=layers, budget_nbytes=b, head=head, fold=False)
    assert est.vertices == tg.n if model.startswith("llama") else abs(est.vertices - tg.n) <= 0.10 * tg.n
    if model.startswith("llama"):
        assert est.tiles == tg.meta["tiles"]


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    from turnip.fileio import atomic_write

    p = tmp_path / "x.csv"
    p.write_text("old")
    for exc in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(exc), atomic_write(p) as f:
            f.write("half")
            raise exc()
        assert p.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["x.csv"]
    with atomic_write(p) as f:
        f.write("new")
    assert p.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["x.csv"]
    mask = os.umask(0)
    os.umask(mask)
    assert (p.stat().st_mode & 0o777) == 0o666 & ~mask


def test_trace_and_plan_writes_are_atomic(tmp_path, monkeypatch):
    import turnip.trace as trace_mod
    from turnip.memgraph.build import build_memgraph
    from turnip.memgraph.io import save_plan
    from turnip.models import matmul_example

    tg = matmul_example()
    mg = build_memgraph(tg, 5 * 256)
    save_plan(tmp_path / "p.tplan", mg, tg)
    spans = {k: np.zeros(0, dtype=np.int64) for k in trace_mod.SPAN_COLUMNS}
    tr = trace_mod.Trace(spans)
    tr.write_chrome(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"] is not None
    monkeypatch.setattr(trace_mod.json, "dumps", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        tr.write_chrome(tmp_path / "u.json")
    assert sorted(os.listdir(tmp_path)) == ["p.tplan", "t.json"]


def test_output_checks():
    from turnip.fileio import output_dir_problem, output_file_problem

    assert output_file_problem("/nonexist/x.csv") and output_file_problem("/") and output_file_problem("")
    assert output_dir_problem("/etc/passwd") and output_dir_problem("/etc/passwd/sub")
    assert output_file_problem("x.csv") is None and output_dir_problem("new/deeper/dir") is None


def test_run_streams_weights_unless_check(tmp_path):
    """`turnip run` writes the weights one tensor at a time; --check keeps them to evaluate the reference,
    and both give the same outputs."""
    for extra in ([], ["--check"]):
        assert main(["run", "--model", "llama-tiny", "--seq", "32", "--budget", "1MiB", "--repeat", "1",
                     "--csv", str(tmp_path / f"r{len(extra)}.csv"), *extra]) == 0  # fmt: skip


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_and_heartbeat_on_a_terminal():
    import time

    from turnip.progress import Heartbeat, Progress

    s = _Tty()
    with Progress(10, "work", delay_s=0, stream=s) as bar:
        bar.last = -1.0
        bar.update(5)
    assert "work [" in s.getvalue() and "10/10" in s.getvalue() and s.getvalue().endswith("\n")
    s = _Tty()
    with Heartbeat("lowering", estimate_s=10, delay_s=0, stream=s):
        time.sleep(0.3)
    assert "lowering [" in s.getvalue() and "estimated" in s.getvalue() and s.getvalue().endswith("\n")
    s = io.StringIO()  # not a terminal: nothing
    with Progress(10, "work", delay_s=0, stream=s) as bar, Heartbeat("x", 1, delay_s=0, stream=s):
        bar.update(5)
        time.sleep(0.05)
    assert s.getvalue() == ""


def test_calibrate_without_a_gpu_is_one_error_line(tmp_path, monkeypatch):
    import ctypes

    def no_driver(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    rc, _out, err = call(["calibrate", "-o", str(tmp_path / "p.json")])
    assert rc == 1 and err.count("\n") == 1 and "turnip calibrate needs an NVIDIA GPU" in err
    assert "--profile h100-calibrated" in err and not (tmp_path / "p.json").exists()
