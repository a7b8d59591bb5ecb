"""``analysis.overlay`` and ``turnip report --overlay``: a simulated and a real trace of one plan, overlaid."""


import numpy as np
import pandas as pd
import pytest

from analysis.overlay import COLUMNS, PlanMismatch, format_overlay, overlay_table, write_overlay
from sim.engine import simulate
from tests.test_cli_errors import call
from turnip.compile import compile_model
from turnip.machine.profile import h100
from turnip.trace import Trace, TraceFormatError, read_chrome

pytestmark = pytest.mark.sim
TIME_COLUMNS = ("host_start_ns", "issue_ns", "start_ns", "end_ns", "done_ns")


@pytest.fixture(scope="module")
def plans():
    """{gpus: (memgraph, simulated trace)}: llama-tiny at 64 tokens, 1 GPU with offloads, 2 GPUs with links."""
    out = {}
    for gpus, budget in ((1, "64KiB"), (2, "64KiB")):
        mg = compile_model("llama-tiny", seq=64, gpus=gpus, budget=budget)[1]
        out[gpus] = mg, simulate(mg, h100(), "nondet", seed=0).trace(mg, {"model": "llama-tiny"})
    return out


def _retimed(tr: Trace, scale: int = 1, shift_ns: int = 0) -> Trace:
    s = dict(tr.spans)
    for c in TIME_COLUMNS:
        s[c] = s[c] * scale + shift_ns
    return Trace(s, {}, {})


def test_chrome_trace_reads_back_exactly(plans, tmp_path):
    for _, tr in plans.values():
        tr.write_chrome(tmp_path / "t.json")
        back = read_chrome(tmp_path / "t.json")
        for c, x in tr.spans.items():
            assert np.array_equal(back.spans[c], x) and back.spans[c].dtype == x.dtype, c
        for c, x in tr.memory.items():
            assert np.array_equal(back.memory[c], x), c
        assert back.meta["model"] == "llama-tiny" and back.meta["policy"] == "nondet"


def test_read_chrome_rejects_other_files(tmp_path):
    for text in ("not json", "[1, 2]", '{"traceEvents": []}', '{"traceEvents": [{"ph": "X", "args": {}}]}'):
        (tmp_path / "x.json").write_text(text)
        with pytest.raises(TraceFormatError):
            read_chrome(tmp_path / "x.json")


def test_trace_against_itself_has_no_error(plans):
    mg, tr = plans[2]
    t = overlay_table(tr, tr)
    assert list(t.columns) == list(COLUMNS)
    res = t[t.section == "resource"]
    assert res.name.tolist() == ["host launch", "gpu 0 compute", "gpu 0 h2d", "gpu 0 p2p to gpu 1", "gpu 1 compute",
                                 "gpu 1 h2d", "gpu 1 p2p to gpu 0"]  # fmt: skip
    assert (t.busy_err.dropna() == 0).all() and (t.end_err == 0).all()
    ops = t[t.section == "op"]
    assert ops.spans.sum() == mg.n and {"einsum", "sdpa", "input", "transfer"} <= set(ops.name)
    assert t[t.name == "makespan"].real_end_ns.item() == tr.spans["done_ns"].max()
    assert "+0.0%" in format_overlay(t) and "makespan" in format_overlay(t)


def test_known_scale_and_shift(plans):
    _, sim = plans[1]
    t = overlay_table(sim, _retimed(sim, scale=2))  # the real run took twice as long everywhere
    assert np.allclose(t.busy_err.dropna().astype(float), -0.5) and np.allclose(t.end_err.astype(float), -0.5)
    d = 1_000_000
    t = overlay_table(sim, _retimed(sim, shift_ns=d))  # ... or started 1 ms late
    base = overlay_table(sim, sim)
    assert (t.busy_err.dropna() == 0).all() and (t.real_end_ns == base.sim_end_ns + d).all()
    assert np.allclose(t.end_err, -d / (base.sim_end_ns + d))
    res = t[t.section == "resource"]
    assert res.name.tolist() == ["host launch", "gpu 0 compute", "gpu 0 h2d", "gpu 0 d2h"]


def test_different_plans_are_refused(plans):
    (_, one), (_, two) = plans[1], plans[2]
    with pytest.raises(PlanMismatch, match="vertices"):
        overlay_table(one, two)
    s = dict(one.spans)
    s["op"] = s["op"].copy()
    i = int(np.flatnonzero(s["op"] == "einsum")[3])
    s["op"][i] = "sdpa"
    with pytest.raises(PlanMismatch, match=f"vertex {i} is einsum .* but sdpa"):
        overlay_table(one, Trace(s, {}, {}))


def test_write_overlay_files(plans, tmp_path):
    _, sim = plans[2]
    t = write_overlay(sim, _retimed(sim, scale=3), tmp_path / "ov")
    png, csv = tmp_path / "ov" / "overlay.png", tmp_path / "ov" / "overlay.csv"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    back = pd.read_csv(csv)
    assert list(back.columns) == list(COLUMNS) and len(back) == len(t)
    assert back[back.name == "makespan"].end_err.item() == pytest.approx(-2 / 3)
    assert not list((tmp_path / "ov").glob(".*.tmp"))


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and ";" in lines[0] and "Traceback" not in err, err
    return lines[0]


@pytest.mark.cpu_runtime
def test_cli_overlays_a_cpu_run_on_its_simulation(tmp_path):
    plan, sim, real, out = (str(tmp_path / x) for x in ("plan.tplan", "sim.json", "real.json", "ov"))
    assert call(["compile", "--model", "llama-tiny", "--seq", "64", "--budget", "64KiB", "--dtype", "fp32",
                 "-o", plan])[0] == 0  # fmt: skip
    assert call(["simulate", plan, "--runs", "1", "--trace", sim])[0] == 0
    assert call(["run", plan, "--backend", "cpu", "--repeat", "1", "--warmup", "0", "--trace", real])[0] == 0
    rc, text, err = call(["report", "--overlay", sim, real, "--out", out])
    assert rc == 0, err
    for what in ("host launch", "gpu 0 compute", "gpu 0 h2d", "gpu 0 d2h", "makespan", "einsum"):
        assert what in text
    t = pd.read_csv(tmp_path / "ov" / "overlay.csv")
    assert (tmp_path / "ov" / "overlay.png").stat().st_size > 0
    assert t[t.name == "makespan"].real_end_ns.item() == read_chrome(real).spans["done_ns"].max()
    rc, _, err = call(["report", "--overlay", sim, sim, "--out", out])
    assert rc == 0 and (pd.read_csv(tmp_path / "ov" / "overlay.csv").end_err == 0).all()


def test_cli_errors_are_one_line(plans, tmp_path):
    (_, one), (_, two) = plans[1], plans[2]
    one.write_chrome(tmp_path / "one.json")
    two.write_chrome(tmp_path / "two.json")
    (tmp_path / "bad.json").write_text('{"traceEvents": 3}')
    a, b, bad = (str(tmp_path / x) for x in ("one.json", "two.json", "bad.json"))
    rc, _, err = call(["report", "--overlay", a, b, "--out", str(tmp_path / "ov")])
    assert rc == 2 and "different plans" in _one_error_line(err) and not (tmp_path / "ov" / "overlay.png").exists()
    for argv, what in ((["--overlay", a, str(tmp_path / "nope.json")], "REAL_TRACE"),
                       (["--overlay", bad, a], "not a turnip trace"), ([], "DIR or --overlay"),
                       ([str(tmp_path), "--overlay", a, a], "pass one of them"),
                       ([str(tmp_path), "--out", str(tmp_path)], "--out applies"),
                       (["--overlay", a, a, "--out", str(tmp_path / "missing" / "deeper" / "x")], None)):  # fmt: skip
        rc, _, err = call(["report", *argv])
        if what is None:  # a directory that can be created is fine
            assert rc == 0, err
            continue
        assert rc == 2 and what in _one_error_line(err), (argv, err)
