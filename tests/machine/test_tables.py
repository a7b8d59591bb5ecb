"""Profiles with measured kernel and copy tables: loading and its one-line errors, the interpolation, and
the floors, spread and contention the simulator takes from them."""

import json
import subprocess
import sys

import numpy as np
import pytest

from sim import simulate
from sim.timing import TimingModel
from turnip.machine.bound import lower_bound
from turnip.machine.costs import ENG_D2H, ENG_H2D, ENG_KERNEL, VertexCosts, link_rates, vertex_work, work_of
from turnip.machine.profile import dump_json, h100, load_profile
from turnip.machine.tables import Curve, parse_tables
from turnip.sched.testing import make_memgraph, random_memgraph

pytestmark = pytest.mark.unit

GEMM = "td,hed->the"
KERNELS = [  # einsum by subscripts, einsum for any subscripts, rmsnorm: works and means by hand
    {"op": "einsum", "match": GEMM, "dtype": "fp16", "work": 1e9, "ns_mean": 20_000.0, "ns_sd": 2_000.0, "n": 20,
     "shape": "1024x4096 @ 32x128x4096"},
    {"op": "einsum", "match": GEMM, "dtype": "fp16", "work": 1e10, "ns_mean": 50_000.0, "ns_sd": 1_000.0, "n": 20},
    {"op": "einsum", "match": GEMM, "dtype": "fp16", "work": 1e11, "ns_mean": 300_000.0, "ns_sd": 3_000.0, "n": 20},
    {"op": "einsum", "match": "*", "dtype": "fp16", "work": 1e9, "ns_mean": 40_000.0, "ns_sd": 400.0, "n": 5},
    {"op": "rmsnorm", "match": "*", "dtype": "fp16", "work": 1e6, "ns_mean": 8_000.0, "ns_sd": 80.0, "n": 5},
]  # fmt: skip
COPIES = [
    {"kind": k, "contended": c, "nbytes": nb, "ns_mean": t * (1.5 if c else 1.0), "ns_sd": t * (0.1 if c else 0.01),
     "n": 10}
    for k in ("h2d", "d2h") for c in (False, True) for nb, t in ((1 << 20, 40_000.0), (1 << 26, 1_300_000.0))
] + [{"kind": "p2p", "contended": False, "nbytes": 1 << 20, "ns_mean": 12_000.0, "ns_sd": 120.0, "n": 10}]  # fmt: skip
# no noise means, no stalls, small fixed costs: the table's numbers come through unchanged
QUIET = {"kernel_excess_mean": 0.0, "kernel_contended_excess_mean": 0.0, "h2d_excess_mean": 0.0,
         "h2d_contended_excess_mean": 0.0, "d2h_excess_mean": 0.0, "d2h_contended_excess_mean": 0.0,
         "p2p_excess_mean": 0.0, "stall_prob": 0.0, "copy_latency_ns": 1000, "kernel_min_ns": 1000}  # fmt: skip


def doc(machine=None, kernels=KERNELS, copies=COPIES, **extra) -> dict:
    return {"format": "turnip-profile", "version": 1, "machine": {"name": "tab"} | (machine or {}),
            "kernels": kernels, "copies": copies} | extra  # fmt: skip


def write(tmp_path, d, name="tab.json"):
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


# ------------------------------------------------------------------------------------------------ loading
def test_table_profile_loads_and_round_trips(tmp_path):
    p = write(tmp_path, doc({"n_gpus": 2, "h2d_bytes_per_s": 25e9}, calibration={"device": "H100"}))
    prof = load_profile(p)
    assert prof.n_gpus == 2 and prof.h2d_bytes_per_s == 25e9 and prof.fp16_flops_per_s == h100().fp16_flops_per_s
    assert len(prof.tables.kernels) == 5 and len(prof.tables.copies) == 9
    assert prof.tables.kernels[0].shape.startswith("1024x4096")
    q = tmp_path / "again.json"
    q.write_text(dump_json(prof))
    assert load_profile(q) == prof
    assert load_profile(p) != prof.replace(tables=None)
    # scalar-only JSON and TOML keep working, by path and by name in the profiles directory
    assert load_profile(write(tmp_path, {"machine": {"n_gpus": 3}}, "s.json")).tables is None
    assert load_profile("h100-measured").kernel_calibration == "h100-kernels.csv"


def _bad(rows_k=None, rows_c=None, **top):
    d = doc(kernels=rows_k if rows_k is not None else KERNELS, copies=rows_c if rows_c is not None else COPIES)
    return d | top


def _kern(i, **kw):
    rows = [dict(r) for r in KERNELS]
    rows[i].update(kw)
    return [{k: v for k, v in r.items() if v is not None} for r in rows]


def _copy(i, **kw):
    rows = [dict(r) for r in COPIES]
    rows[i].update(kw)
    return [{k: v for k, v in r.items() if v is not None} for r in rows]


BAD = [  # (document, words the one-line message must hold)
    (_bad(_kern(1, ns_mean=None)), ["kernels[1]", "missing field 'ns_mean'"]),
    (_bad(_kern(2, work=-1.0)), ["kernels[2]", "'work'", "-1.0", "> 0"]),
    (_bad(_kern(0, ns_mean=float("nan"))), ["kernels[0]", "'ns_mean'", "nan"]),
    (_bad(_kern(0, ns_mean=float("inf"))), ["kernels[0]", "'ns_mean'", "inf"]),
    (_bad(_kern(3, n=0)), ["kernels[3]", "'n'", "whole number >= 1"]),
    (_bad(_kern(4, op="matmul")), ["kernels[4]", "'op'", "matmul", "unknown op", "einsum"]),
    (_bad(_kern(4, dtype="fp8")), ["kernels[4]", "'dtype'", "fp8"]),
    (_bad(_kern(4, match="td->t")), ["kernels[4]", "'match'", "only einsum"]),
    (_bad(_kern(0, wrok=3)), ["kernels[0]", "unknown field 'wrok'"]),
    (_bad(KERNELS + [dict(KERNELS[1], ns_mean=1.0)]), ["kernels[5]", "duplicate of kernels[1]", GEMM]),
    (_bad(rows_c=_copy(2, kind="h2h")), ["copies[2]", "'kind'", "h2h", "unknown kind", "p2p"]),
    (_bad(rows_c=_copy(0, nbytes=1.5)), ["copies[0]", "'nbytes'", "whole number"]),
    (_bad(rows_c=_copy(0, contended="no")), ["copies[0]", "'contended'", "true or false"]),
    (_bad(rows_c=_copy(1, ns_sd=-1.0)), ["copies[1]", "'ns_sd'", ">= 0"]),
    (_bad(rows_c=COPIES + [dict(COPIES[0], ns_mean=9.0)]), ["copies[9]", "duplicate of copies[0]"]),
    (_bad(rows_c={"kind": "h2d"}), ["copies must be a list"]),
    (_bad(rows_c=[[1, 2]]), ["copies[0]", "object"]),
    (_bad(format="other"), ["format", "turnip-profile"]),
    (_bad(version=2), ["version 2"]),
    (_bad(kernal=[]), ["unknown top-level keys", "kernal"]),
    (_bad() | {"machine": {"warp_speed": 9}}, ["warp_speed"]),
]  # fmt: skip


@pytest.mark.parametrize("d,words", BAD, ids=[w[0] for _, w in BAD])
def test_bad_rows_are_one_line_errors_naming_the_problem(tmp_path, d, words):
    p = write(tmp_path, d, "bad.json")
    with pytest.raises(ValueError) as e:
        load_profile(p)
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg
    for w in words:
        assert w in msg, (w, msg)


def test_cli_shows_a_bad_table_as_one_error_line(tmp_path, monkeypatch):
    from tests.test_cli_errors import call

    monkeypatch.chdir(tmp_path)
    assert call(["compile", "--model", "llama-tiny", "--seq", "32", "--budget", "64KiB", "-o", "plan.tplan"])[0] == 0
    write(tmp_path, _bad(_kern(2, work=0)), "bad.json")
    rc, out, err = call(["simulate", "plan.tplan", "--profile", "bad.json"])
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error:") and "kernels[2]" in lines[0], err
    write(tmp_path, doc(), "good.json")
    assert call(["simulate", "plan.tplan", "--profile", "good.json", "--runs", "2"])[0] == 0


# ------------------------------------------------------------------------------------------ interpolation
def test_curve_exact_at_points_monotone_between_proportional_beyond():
    x, m = np.array([1e3, 1e4, 1e5, 1e6]), np.array([10.0, 40.0, 300.0, 2000.0])
    c = Curve(x[::-1], m[::-1], 0.1 * m[::-1])  # any order in, sorted inside
    assert np.allclose(c.mean_ns(x), m, rtol=1e-12)
    grid = np.geomspace(1e3, 1e6, 2001)
    assert (np.diff(c.mean_ns(grid)) >= 0).all()
    # between two points: linear in log-log
    assert np.isclose(c.mean_ns(np.sqrt(1e3 * 1e4))[0], np.sqrt(10.0 * 40.0))
    # beyond the largest: the last point's throughput
    assert np.allclose(c.mean_ns([2e6, 1e7]), [4000.0, 20000.0])
    # below the smallest: proportional, but never below half the smallest point's mean
    assert np.allclose(c.mean_ns([800.0, 500.0, 100.0, 0.0]), [8.0, 5.0, 5.0, 5.0])
    assert np.allclose(c.cv_at([1e2, 1e3, 3e3, 1e6, 1e9]), 0.1)


def test_curve_interpolates_the_spread_between_points():
    c = Curve([1e3, 1e5], [10.0, 1000.0], [1.0, 10.0])  # cv 0.1 then 0.01
    assert np.allclose(c.cv_at([1e3, 1e4, 1e5, 1e7]), [0.1, 0.055, 0.01, 0.01])


def test_lookup_by_subscripts_then_star_then_none():
    t = parse_tables("x", KERNELS, [])
    assert t.kernel_curve("einsum", GEMM, "fp16").mean[0] == 20_000.0
    assert t.kernel_curve("einsum", "ab,bc->ac", "fp16").mean[0] == 40_000.0
    assert t.kernel_curve("einsum", GEMM, "fp32") is None and t.kernel_curve("silu", "*", "fp16") is None
    assert parse_tables("x", [], []) is None


def test_work_is_flops_for_gemm_and_attention_and_bytes_for_the_rest():
    assert work_of("einsum") == work_of("sdpa") == "flops" and work_of("rmsnorm") == "io_nbytes"
    mg = make_memgraph(["kernel", "kernel"], [[], [0]], flops=[5e9, 7.0], nbytes=[1000, 1000],
                       ops=["einsum", "rmsnorm"])  # fmt: skip
    assert vertex_work(mg).tolist() == [5e9, 2000.0]  # rmsnorm reads 1000 B and writes 1000 B


# ---------------------------------------------------------------------------------------- in the simulator
def kernel_plan():
    """One kernel per table point (and one between points, one of an op without a table: it borrows the
    rmsnorm table, the only memory-bound one), no dependencies."""
    works = [1e9, 1e10, 1e11, 3e10, 1e9, 1e9]
    mg = make_memgraph(["kernel"] * 6, [[]] * 6, flops=works, nbytes=[1 << 10] * 6,
                       ops=["einsum"] * 5 + ["silu"])  # fmt: skip
    for v in range(4):
        mg.params[v] = {"subscripts": GEMM}
    mg.params[4] = {"subscripts": "ab,bc->ac"}
    return mg


def test_kernel_floors_equal_the_table_at_measured_works(tmp_path):
    mg = kernel_plan()
    prof = load_profile(write(tmp_path, doc(QUIET)))
    tm = TimingModel(mg, prof)
    between = np.exp(np.interp(np.log(3e10), np.log([1e10, 1e11]), np.log([50_000.0, 300_000.0])))
    # silu writes 1 KiB: far below rmsnorm's only point (1 MB, 8 us), so half of that point's time
    assert tm.kernel_ns.tolist() == [20_000, 50_000, 300_000, round(between), 40_000, 4_000]
    assert tm.borrowed.tolist() == [False] * 5 + [True] and tm.covered.all()
    r = simulate(mg, prof, mean_only=True)
    assert (r.end_ns - r.start_ns).tolist() == tm.kernel_ns.tolist()
    # with a mean excess the floor sits below the table so that the mean is the table's
    prof2 = prof.replace(kernel_excess_mean=0.05)
    tm2 = TimingModel(mg, prof2)
    assert tm2.kernel_ns[0] == round(20_000 / 1.05) and abs(tm2.mean_ns()[0] - 20_000) <= 1


def test_tables_fall_back_to_the_calibration_csv_and_the_roofline(tmp_path):
    cal = tmp_path / "cal.csv"
    cal.write_text("op,match,dtype,efficiency\nsilu,*,fp16,0.25\n")
    mg = kernel_plan()
    prof = load_profile(write(tmp_path, doc(QUIET)))
    with_csv = TimingModel(mg, prof.replace(kernel_calibration=str(cal)))
    plain = TimingModel(mg, prof)
    assert with_csv.kernel_ns[:5].tolist() == plain.kernel_ns[:5].tolist()
    # silu's own calibration entry beats borrowing the rmsnorm table
    assert with_csv.kernel_ns[5] > plain.kernel_ns[5] and not with_csv.borrowed[5] and plain.borrowed[5]


def test_kernel_min_ns_under_a_table(tmp_path):
    mg = make_memgraph(["kernel"], [[]], flops=[1.0], nbytes=[1 << 10])
    mg.params[0] = {"subscripts": GEMM}
    prof = load_profile(write(tmp_path, doc(QUIET | {"kernel_min_ns": 15_000})))
    assert TimingModel(mg, prof).kernel_ns.tolist() == [15_000]  # the table alone says 10 us (half of 20)


def test_spread_is_the_tables_per_shape(tmp_path):
    """Two shapes with cv 10% and 1%: the draws' cv follows each, their mean stays the table's."""
    n = 4000
    mg = make_memgraph(["kernel"] * 2 * n, [[]] * 2 * n, flops=[1e9] * n + [1e11] * n, nbytes=[1 << 10] * 2 * n)
    for v in range(2 * n):
        mg.params[v] = {"subscripts": GEMM}
    # a mean excess of 20% over the floor (a 2% mean with a 10% sd is a lognormal too heavy-tailed for
    # 4000 draws to show its sd)
    prof = load_profile(write(tmp_path, doc({"kernel_excess_mean": 0.2})))
    tm = TimingModel(mg, prof)
    d = tm.kernel_ns * tm.draws(np.random.default_rng(0)).factor
    for sel, mean, cv in ((slice(0, n), 20_000, 0.1), (slice(n, 2 * n), 300_000, 0.01)):
        assert abs(d[sel].mean() / mean - 1) < 0.01
        assert abs(d[sel].std() / d[sel].mean() / cv - 1) < 0.15
        assert d[sel].min() >= tm.kernel_ns[sel][0]  # no draw below the floor


def test_a_run_wide_factor_spreads_makespans_and_keeps_the_tables_means(tmp_path):
    """Per-vertex jitter averages out over a chain of kernels; a run-wide factor does not. The floors sit
    below the table by both mean excesses, so the mean duration is still the table's, and no draw is below
    its floor."""
    n = 400
    mg = make_memgraph(["kernel"] * n, [[]] + [[v] for v in range(n - 1)], flops=[1e10] * n, nbytes=[1 << 10] * n)
    for v in range(n):
        mg.params[v] = {"subscripts": GEMM}
    base = load_profile(write(tmp_path, doc(QUIET | {"kernel_excess_mean": 0.02})))
    wide = base.replace(run_excess_mean=0.03, run_excess_sd=0.03)

    def cv_and_mean(prof):
        ms = np.array([simulate(mg, prof, seed=s).makespan_ns for s in range(40)], dtype=float)
        return ms.std() / ms.mean(), TimingModel(mg, prof)

    cv0, tm0 = cv_and_mean(base)
    cv1, tm1 = cv_and_mean(wide)
    assert cv0 < 0.005 < 0.01 < cv1  # the chain's own jitter averages out; the run-wide factor does not
    assert abs(tm1.mean_ns()[0] - 50_000) <= 2 and tm1.kernel_ns[0] == round(50_000 / 1.02 / 1.03)
    d = tm1.kernel_ns * tm1.draws(np.random.default_rng(3)).factor
    assert (d >= tm1.kernel_ns).all() and np.ptp(d / tm1.kernel_ns) > 0
    assert (TimingModel(mg, base).kernel_ns == tm0.kernel_ns).all()


def copy_plan():
    """An h2d and a d2h of each measured size on one GPU, and a P2P transfer."""
    kinds = ["input", "input", "kernel", "offload", "offload", "transfer"]
    mg = make_memgraph(kinds, [[], [], [0, 1], [2], [2], [2]], n_gpus=2, gpus=[0, 0, 0, 0, 0, 1],
                       src_gpus=[0, 0, 0, 0, 0, 0], flops=[0, 0, 1e9, 0, 0, 0],
                       nbytes=[1 << 20, 1 << 26, 1 << 20, 1 << 20, 1 << 26, 1 << 20])  # fmt: skip
    mg.params[2] = {"subscripts": GEMM}
    return mg


def test_copy_floors_and_contention_come_from_the_tables(tmp_path):
    mg = copy_plan()
    prof = load_profile(write(tmp_path, doc(QUIET)))
    tm = TimingModel(mg, prof)
    assert tm.floor_ns().tolist() == [40_000, 1_300_000, 20_000, 40_000, 1_300_000, 12_000]
    assert (tm.mean_ns() == tm.floor_ns()).all()
    d = tm.draws(None)
    solo, shared = link_rates(prof)
    nb = tm.nbytes.astype(float)
    lat = prof.copy_latency_ns
    for v, direction in ((0, 0), (1, 0), (3, 1), (4, 1)):
        # alone: the bytes x factor at the solo rate plus the latency take the table's time
        assert np.isclose(nb[v] * d.factor[v] / solo[direction] + lat, tm.floor_ns()[v])
        # contended from the start: the contended table's time (1.5x) at the shared rate
        assert np.isclose(nb[v] * d.factor_contended[v] / shared[direction] + lat, 1.5 * tm.floor_ns()[v])
    r = simulate(mg, prof, mean_only=True)  # one copy at a time per direction here: the tables' times
    assert (r.end_ns - r.start_ns).tolist() == tm.floor_ns().tolist()
    # an offload that starts while a large input streams the other way is slowed, at most 1.5x
    mg = make_memgraph(["input", "kernel", "offload", "input"], [[], [0], [1], []], flops=[0, 1e9, 0, 0],
                       nbytes=[1 << 20, 1 << 26, 1 << 26, 1 << 26])  # fmt: skip
    mg.params[1] = {"subscripts": GEMM}
    r = simulate(mg, prof, mean_only=True)
    dur = (r.end_ns - r.start_ns).tolist()
    assert r.start_ns[3] < r.start_ns[2] < r.end_ns[3]
    assert 1_300_000 < dur[2] <= 1.5 * 1_300_000 and 1_300_000 < dur[3] <= 1.5 * 1_300_000


def test_contention_never_faster_than_the_shared_link(tmp_path):
    """A contended table faster than the profile's shared link: the link's share wins (floor semantics)."""
    fast = [dict(r, ns_mean=r["ns_mean"] / 1.5) if r["contended"] else r for r in COPIES]
    prof = load_profile(write(tmp_path, doc(QUIET, copies=fast)))
    tm = TimingModel(copy_plan(), prof)
    d = tm.draws(None)
    assert (d.factor_contended[tm.eng == ENG_H2D] * tm.nbytes[tm.eng == ENG_H2D] >=
            tm.link_nbytes[tm.eng == ENG_H2D] - 1e-6).all()  # fmt: skip


def test_no_run_below_the_floor_or_the_bound_with_tables(tmp_path):
    rows = [dict(r, work=r["work"] / 1e3) for r in KERNELS if r["op"] == "einsum"]
    prof = load_profile(write(tmp_path, doc({}, kernels=rows)))
    for seed in range(4):
        mg = random_memgraph(np.random.default_rng(seed), 150, 2, p_edge=0.03)
        tm = TimingModel(mg, prof)
        assert tm.covered[tm.eng == ENG_KERNEL].all() and tm.covered[(tm.eng == ENG_D2H) & (tm.nbytes > 0)].all()
        floor = tm.floor_ns()
        for s in range(3):
            r = simulate(mg, prof, "nondet", seed=s, tm=tm)
            assert (r.end_ns - r.start_ns >= floor).all()
            assert r.makespan_ns >= r.lower_bound_ns == lower_bound(VertexCosts(mg, prof))["lower_bound_ns"]


def test_runtime_imports_nothing_from_sim():
    code = ("import turnip.runtime.driver, turnip.cli.run_cmds, turnip.machine, sys; "
            "bad = [m for m in sys.modules if m == 'sim' or m.startswith('sim.')]; assert not bad, bad")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)
