"""The engine's shortcuts give the runs the plain event loop gives: a command issued at once when no pending
event comes first (``Simulation.EAGER``) and a plan's tables and schedulers built once per timing model
(``sim.engine.PlanData``)."""

import numpy as np
import pytest

from sim import Simulation, TimingModel, fastest_run, simulate
from turnip.machine.profile import HOST_TOTALS, h100, load_profile
from turnip.memgraph.build import BudgetError, build_memgraph
from turnip.models import random_dag
from turnip.sched import POLICIES

pytestmark = pytest.mark.sim

FIELDS = ("issue_ns", "start_ns", "end_ns", "done_ns", "stream", "handle_ns", "order")
FAST = 1e18  # bytes per s: a copy takes its latency alone
# every duration a multiple of 100 ns: events of a run often fall on the same ns, where their order matters
ROUND = h100().replace(
    kernel_launch_ns=1000, gemm_launch_ns=None, attn_launch_ns=None, copy_launch_ns=1000, completion_ns=500,
    completion_per_inflight_ns=100, copy_latency_ns=500, p2p_latency_ns=500, kernel_min_ns=1500,
    kernel_overlap_short=1.0, kernel_overlap_long=1.0, kernel_excess_mean=0.0, kernel_contended_excess_mean=0.0,
    kernel_slowdown_with_copies=2.0, h2d_excess_mean=0.0, h2d_contended_excess_mean=0.0, d2h_excess_mean=0.0,
    d2h_contended_excess_mean=0.0, p2p_excess_mean=0.0, stall_prob=0.0, h2d_bytes_per_s=FAST, d2h_bytes_per_s=FAST,
    pcie_both_bytes_per_s=FAST, p2p_bytes_per_s=FAST, **dict.fromkeys(HOST_TOTALS, ()),
)  # fmt: skip


def plans():
    out = []
    for seed in range(12):
        tg = random_dag(np.random.default_rng(seed), n_kernels=40, n_gpus=1 + seed % 4)
        try:
            out.append(build_memgraph(tg, (6, 12, 1024)[seed % 3] * 1024))
        except BudgetError:
            continue
    return out


PROFILES = {
    "round": ROUND,
    "round, slow host link": ROUND.replace(h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, pcie_both_bytes_per_s=1.5e9),
    "host caps, spreads": h100().replace(link_excess_sd=0.1, host_excess_sd=0.2),
    "no caps": h100().replace(**dict.fromkeys(HOST_TOTALS, ())),
    "power bucket": h100().replace(power_duty=0.7),
    "calibrated": load_profile("h100-calibrated"),
}


def runs(mg, prof, mean_only):
    """Every policy's run of ``mg`` (det-replay: the fastest of two nondet orders), two seeds each."""
    tm = TimingModel(mg, prof)
    order = fastest_run(mg, prof, range(2), mean_only, tm).order
    out = []
    for policy in POLICIES:
        for seed in range(2):
            out.append(simulate(mg, prof, policy, seed, mean_only, tm, order if policy == "det-replay" else None))
    return out


def same(a, b):
    assert a.makespan_ns == b.makespan_ns
    for f in FIELDS:
        assert (getattr(a, f) == getattr(b, f)).all(), f


@pytest.mark.parametrize("name", PROFILES)
def test_issuing_at_once_gives_the_heaps_order(name, monkeypatch):
    prof = PROFILES[name]
    for mg in plans():
        for mean_only in (True, False):
            fast = runs(mg, prof, mean_only)
            monkeypatch.setattr(Simulation, "EAGER", False)
            slow = runs(mg, prof, mean_only)
            monkeypatch.undo()
            for a, b in zip(fast, slow, strict=True):
                same(a, b)


def test_runs_sharing_a_timing_model_repeat_runs_on_their_own():
    """Scheduler tables and per-vertex lists kept on the timing model between runs leave nothing of one run in
    the next: each run equals the same run with a timing model of its own, whatever ran before it."""
    prof = PROFILES["host caps, spreads"]
    for mg in plans()[:6]:
        tm = TimingModel(mg, prof)
        for policy in ("nondet", "nondet-cp", "det", "det-kernels"):
            for seed in (3, 4, 3):
                same(simulate(mg, prof, policy, seed, tm=tm), simulate(mg, prof, policy, seed))
                same(simulate(mg, prof, policy, seed, tm=tm, ordered_sums=False),
                     simulate(mg, prof, policy, seed, ordered_sums=False))  # fmt: skip
