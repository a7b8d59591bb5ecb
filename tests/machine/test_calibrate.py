"""``turnip calibrate``'s bookkeeping on synthetic runs (the measurements themselves need a GPU)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from turnip.calibrate import (
    HostProbe,
    _kernel_rows,
    copy_fields,
    handed_back,
    host_fields,
    host_samples,
    kernel_plans,
    p2p_fields,
    probe_fields,
    start_latencies,
)
from turnip.compile import build_with_resident, make_taskgraph
from turnip.machine.costs import vertex_work
from turnip.machine.profile import load_profile
from turnip.memgraph.plan import KIND_KERNEL

pytestmark = pytest.mark.unit


def serial_runs(mg, ns_of, gap_ns: int, n: int = 2):
    """Runs where kernels execute one after another in index order, each ``gap_ns`` after the last."""
    runs = []
    for r in range(n):
        start, end, t = np.zeros(mg.n, np.int64), np.zeros(mg.n, np.int64), 0
        for v in range(mg.n):
            if mg.kind[v] != KIND_KERNEL:
                continue
            t += gap_ns
            start[v], end[v] = t, t + ns_of(v, r)
            t = end[v]
        runs.append(SimpleNamespace(start_ns=start, end_ns=end))
    return runs


@pytest.fixture(scope="module")
def plan():
    tg = make_taskgraph("llama-tiny", 32, 1, "fp32", {"t": 8})
    return build_with_resident(tg, 1 << 24, None, str(1 << 23))


def test_kernel_rows_group_by_op_shape_and_work(plan):
    mg = plan
    w = vertex_work(mg)
    rows = _kernel_rows(mg, serial_runs(mg, lambda v, r: 1000 + 10 * r + int(w[v] % 7), 500))
    kernels = np.flatnonzero(mg.kind == KIND_KERNEL)
    assert sum(r["n"] for r in rows) == 2 * len(kernels)  # every kernel of every run, once
    for r in rows:
        assert r["ns_sd"] >= 0 and r["ns_mean"] >= 1000 and (r["match"] == "*") == (r["op"] != "einsum")
    keys = {(r["op"], r["match"], r["dtype"], r["work"]) for r in rows}
    assert len(keys) == len(rows)


def test_start_latencies_count_kernels_issued_to_an_idle_gpu(plan):
    runs = serial_runs(plan, lambda v, r: 2000, 7000)
    for r in runs:  # issued 1500 ns before the device starts each kernel: the GPU had finished the one before
        r.issue_ns = np.where(r.start_ns > 0, r.start_ns - 1500, 0)
    lat = start_latencies(plan, runs)
    n_attn = sum(op == "sdpa" for op, k in zip(plan.op, plan.kind, strict=True) if k == KIND_KERNEL)
    assert lat and len(lat) == 2 * (int((plan.kind == KIND_KERNEL).sum()) - n_attn)  # attention left out
    assert set(lat) == {1500}
    for r in runs:  # issued while the kernel before still ran: not a launch on an idle GPU
        r.issue_ns = np.where(r.start_ns > 0, np.maximum(r.start_ns - 8000, 0), 0)
    assert len(start_latencies(plan, runs)) == 2  # only each run's first kernel


def test_host_samples_and_fields(plan):
    runs = serial_runs(plan, lambda v, r: 2000, 7000)
    kern = plan.kind == KIND_KERNEL
    for r in runs:
        r.host_start_ns = np.where(r.start_ns > 0, r.start_ns - 5000, 0)
        r.issue_ns = np.where(kern, r.host_start_ns + np.where(np.asarray(plan.op) == "einsum", 4000, 3000), 0)
        r.done_ns = np.where(kern, r.end_ns + 700, 0)
        r.handle_ns = np.where(kern, 900, 0)
        r.end_ns = np.where(kern, r.end_ns, 0)
    h = host_samples(plan, runs, {})
    f = host_fields(h)
    assert f["gemm_launch_ns"] == 4000 and f["kernel_launch_ns"] == 3000 and f["attn_launch_ns"] == 3000
    assert f["completion_ns"] == 700 and f["handle_ns"] == 900 and f["copy_launch_ns"] == 0  # resident: no copies
    assert f["handle_per_cmd_ns"] == 0  # every completion took as long
    assert len(h["poll"]) == 2 * int(kern.sum())


def test_the_handling_line_is_read_back_from_runs_that_charged_it():
    """Simulated runs of a streamed plan charged 3000 ns per completion plus 2000 per command it hands back:
    ``handed_back`` finds every command's completion from the timestamps alone, and the fitted
    ``handle_ns`` / ``handle_per_cmd_ns`` are the two charged."""
    from sim.engine import simulate
    from turnip.machine.profile import h100

    tg = make_taskgraph("llama-tiny", 64, 1, "fp16", {"t": 16}, budget_nbytes=1 << 20)
    mg = build_with_resident(tg, 1 << 20, None, "0")
    prof = h100().replace(handle_ns=3000, handle_per_cmd_ns=2000, host_excess_sd=0.0)
    runs = [simulate(mg, prof, pol, seed=s) for pol in ("nondet", "det") for s in range(3)]
    for r in runs:
        nb = handed_back(r)
        sent = r.issue_ns > 0
        first = int((r.host_start_ns[sent] < r.done_ns[sent].min()).sum())  # issued at the start
        assert nb.sum() == sent.sum() - first and (nb[~sent] == 0).all()
        assert (r.handle_ns[sent] == 3000 + 2000 * nb[sent]).all()
    assert np.bincount(np.concatenate([handed_back(r) for r in runs])).size >= 3  # 0, 1, 2 commands seen
    f = host_fields(host_samples(mg, runs, {}))
    assert (f["handle_ns"], f["handle_per_cmd_ns"]) == (3000, 2000)
    assert f["copy_launch_ns"] == prof.copy_launch_ns and f["gemm_launch_ns"] == prof.gemm_launch_ns


def test_handed_back_when_completions_are_seen_at_once():
    """With no handling time of its own, a completion that hands back nothing is seen at the same instant as
    the next one: the commands go to the completion handled last (the simulator's charges are the check)."""
    from sim.engine import simulate
    from turnip.machine.profile import h100
    from turnip.sched.testing import random_memgraph

    prof = h100().replace(handle_ns=0, handle_per_cmd_ns=3000, host_excess_sd=0.0)
    ties = 0
    for seed in range(12):
        mg = random_memgraph(np.random.default_rng(seed), 80, 1 + seed % 3, p_edge=0.05)
        for pol in ("nondet", "det"):
            r = simulate(mg, prof, pol, seed, groups=False)  # calibration runs issue every vertex alone
            sent = r.issue_ns > 0
            assert (r.handle_ns[sent] == 3000 * handed_back(r)[sent]).all(), (seed, pol)
            d = np.sort(r.done_ns[sent])
            ties += int((d[1:] == d[:-1]).sum())
    assert ties > 0  # the case arose


def test_a_runs_link_rate_is_per_link():
    """Two GPUs loading at once over their own links: the rate of one link, not their sum; behind the h100
    host (104 GB/s for two GPUs) each link's share while both copy, its own rate in the 13 us it copies alone."""
    from sim.engine import simulate
    from turnip.calibrate import run_link_gbps
    from turnip.machine.profile import h100
    from turnip.sched.testing import make_memgraph

    mg = make_memgraph(["input", "input"], [[], []], n_gpus=2, gpus=[0, 1], src_gpus=[-1, -1],
                       nbytes=[1 << 24, 1 << 24])  # fmt: skip
    prof = h100().replace(copy_latency_ns=0, h2d_excess_mean=0.0, stall_prob=0.0)
    own = prof.replace(host_h2d_total_bytes_per_s=(), host_d2h_total_bytes_per_s=(), host_both_total_bytes_per_s=())
    assert run_link_gbps(mg, simulate(mg, own, mean_only=True)) == pytest.approx(prof.h2d_bytes_per_s / 1e9, rel=1e-3)
    shared = run_link_gbps(mg, simulate(mg, prof, mean_only=True))
    assert prof.host_h2d_total_bytes_per_s[1] / 2e9 < shared < prof.h2d_bytes_per_s / 1e9


def test_copy_fields_and_a_written_profile_loads(tmp_path, plan):
    copies = [{"kind": k, "contended": c, "nbytes": n, "ns_mean": n / (40 if c else 50) + 5000.0, "ns_sd": 10.0,
               "n": 5} for k in ("h2d", "d2h") for c in (False, True) for n in (1 << 16, 1 << 24)]  # fmt: skip
    f = copy_fields(copies)
    assert f["copy_latency_ns"] == int((1 << 16) / 50 + 5000)
    assert 49e9 < f["h2d_bytes_per_s"] < 50e9 and f["pcie_both_bytes_per_s"] > f["h2d_bytes_per_s"]
    rows = _kernel_rows(plan, serial_runs(plan, lambda v, r: 3000 + r, 1000))
    doc = {"format": "turnip-profile", "version": 1, "machine": {"name": "synthetic"} | f, "kernels": rows,
           "copies": copies, "calibration": {"device": "none"}}  # fmt: skip
    p = tmp_path / "synthetic.json"
    p.write_text(json.dumps(doc))
    prof = load_profile(p)
    assert prof.name == "synthetic" and prof.h2d_bytes_per_s == f["h2d_bytes_per_s"]


def test_peer_copies_set_the_p2p_fields_and_drive_a_two_gpu_plan(tmp_path):
    """Peer copy rows give the p2p rate (largest copy) and latency (smallest), leave the host link's latency
    alone, and a 2-GPU plan's transfers take the table's times."""
    from sim.engine import simulate
    from turnip.compile import build_with_resident
    from turnip.models import llama_prefill

    host = [{"kind": k, "contended": c, "nbytes": n, "ns_mean": n / 50 + 5000.0, "ns_sd": 10.0, "n": 5}
            for k in ("h2d", "d2h") for c in (False, True) for n in (1 << 16, 1 << 24)]  # fmt: skip
    assert p2p_fields(host) == {}
    peer = [{"kind": "p2p", "contended": False, "nbytes": n, "ns_mean": n / 100 + 30000.0, "ns_sd": 10.0, "n": 5}
            for n in (1 << 12, 1 << 20, 1 << 28)]  # fmt: skip
    f = copy_fields(host + peer) | p2p_fields(host + peer)
    assert f["copy_latency_ns"] == int((1 << 16) / 50 + 5000)  # the host link's smallest copy, not a peer copy
    assert f["p2p_latency_ns"] == int((1 << 12) / 100 + 30000) and 98e9 < f["p2p_bytes_per_s"] < 100e9
    tg = llama_prefill("tiny", seq=64, n_gpus=2, dtype="fp16")
    mg = build_with_resident(tg, 1 << 20, None, "auto")
    t = np.flatnonzero(mg.kind == 2)
    assert len(t)
    ends = {}
    for name, rows in (("fast", [r | {"ns_mean": r["ns_mean"] / 10} for r in peer]), ("slow", peer)):
        doc = {"format": "turnip-profile", "version": 1, "machine": {"name": name, "n_gpus": 2} | f,
               "copies": host + rows}  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
        r = simulate(mg, load_profile(tmp_path / f"{name}.json"), "det", seed=0, mean_only=True)
        ends[name] = float(np.mean(r.end_ns[t] - r.start_ns[t]))
    assert ends["slow"] > 5 * ends["fast"]


def test_calibration_plans_are_not_the_validation_grid():
    grid = {1024, 4096, 8192, 16384, 32768}
    plans = kernel_plans()
    assert plans and not {p.seq for p in plans} & grid
    assert all(p.layers <= 8 for p in plans)


def test_copy_rows_time_each_copy_between_its_events_and_keep_the_median_pass():
    """The copy table's rows (host link and peer copies alike): one event pair around each copy, the stream
    synchronised before the times are read; of several sweeps each point keeps its median one."""
    from turnip.calibrate import _median_passes, _timed_copies

    class Drv:
        def __init__(self):
            self.calls = []

        def check(self, r, what):
            assert r == 0, what

        def cuEventRecord(self, e, stream):  # noqa: N802 - the driver's name
            self.calls.append(("record", e, stream))
            return 0

        def cuStreamSynchronize(self, stream):  # noqa: N802
            self.calls.append(("sync", stream))
            return 0

        def elapsed_ms(self, a, b):
            assert self.calls[-1] == ("sync", 7)  # read only after the stream is done
            return (b - a) / 1000

    drv = Drv()
    row = _timed_copies(drv, [(1, 3), (10, 14)], 7, "p2p", False, 4096, lambda: drv.calls.append(("copy",)))
    assert [c[0] for c in drv.calls] == ["record", "copy", "record", "record", "copy", "record", "sync"]
    assert row == {"kind": "p2p", "contended": False, "nbytes": 4096, "ns_mean": 3000.0,
                   "ns_sd": pytest.approx(1414.2136), "n": 2}  # fmt: skip
    passes = {"a": [{"ns_mean": 5.0}, {"ns_mean": 1.0}, {"ns_mean": 3.0}], "b": [{"ns_mean": 2.0}, {"ns_mean": 4.0}]}
    assert _median_passes(passes) == [{"ns_mean": 3.0}, {"ns_mean": 2.0}]


def test_probe_fields_recover_the_spread_and_correlation_of_host_and_link():
    """Samples from a known host and link wander (log issue time and log of 1/link rate: sd 0.15 and 0.05,
    correlation 0.6) give those figures back; a host that is slow while the link is slow: > 0."""
    rng = np.random.default_rng(0)
    z = rng.multivariate_normal([0, 0], [[1, 0.6], [0.6, 1]], size=4000)
    samples = [{"t_s": i, "issue_ns": int(8000 * np.exp(0.15 * a)), "link_gbps": 54 * np.exp(-0.05 * b)}
               for i, (a, b) in enumerate(z)]  # fmt: skip
    f = probe_fields(samples)
    assert f["host_excess_sd"] == pytest.approx(0.15, rel=0.05)
    assert f["link_excess_sd"] == pytest.approx(0.05, rel=0.05)
    assert f["host_link_corr"] == pytest.approx(0.6, abs=0.05)
    # unusable samples (no kernel issued, no link rate) are left out; too few: no fields at all
    bad = [{"t_s": 0, "issue_ns": 0, "link_gbps": 50.0}, {"t_s": 0, "issue_ns": 9000, "link_gbps": float("nan")}]
    assert probe_fields(samples[:4] + bad) == {}
    steady = [{"t_s": i, "issue_ns": 8000 + 100 * i, "link_gbps": 54.0} for i in range(6)]
    assert probe_fields(steady)["host_link_corr"] == 0.0 and probe_fields(steady)["link_excess_sd"] == 0.0


def test_the_host_probe_samples_its_plan_between_stages():
    """``HostProbe`` on the CPU backend with a tiny streamed plan: each ``sample`` is one run, timed from the
    probe's start, with its kernels' median issue time and its host link rate; closed on leaving."""
    tg = make_taskgraph("llama-tiny", 64, 1, "fp32", n_layers=2, budget_nbytes=1 << 20)
    mg = build_with_resident(tg, 1 << 20, None, "0")  # every weight streamed in, nothing offloaded
    with HostProbe(backend="cpu", plan=(tg, mg)) as probe:
        for _ in range(3):
            probe.sample()
        r = probe.run(7)
        assert r.makespan_ns > 0
        assert len(probe.host_runs(2)) == 2  # runs back to back, for their host costs only: no samples
    assert probe._be is None and len(probe.samples) == 4
    t = [s["t_s"] for s in probe.samples]
    assert t == sorted(t) and all(s["issue_ns"] > 0 and s["link_gbps"] > 0 for s in probe.samples)
