"""Launch groups under way share their GPU (``Simulation.INTERLEAVE``): a kernel issued while a group runs starts
at the next kernel boundary, two groups take turns, and no two kernels of one GPU overlap."""

import numpy as np
import pytest

from sim.engine import Simulation
from turnip.compile import compile_model
from turnip.machine.costs import ENG_KERNEL
from turnip.machine.profile import load_profile

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def data_split():
    """LLaMA-7B, a 16K prompt split by tokens over 4 GPUs, no budget: groups of 11-13 kernels per token tile."""
    return compile_model("llama-7b", seq=16384, gpus=4, budget="60GiB", resident="auto", split="data")[1]


def run(mg, policy: str, interleave: bool, monkeypatch):
    monkeypatch.setattr(Simulation, "INTERLEAVE", interleave)
    s = Simulation(mg, load_profile("h100-calibrated"), policy, 0, True)
    return s, s.run()


def kernel_spans(s, g: int):
    eng, gpu = np.array(s.eng), np.array(s.gpu)
    k = np.flatnonzero((eng == ENG_KERNEL) & (gpu == g))
    st, en = np.array(s.start)[k], np.array(s.end)[k]
    o = np.argsort(st, kind="stable")
    return k[o], st[o], en[o]


@pytest.mark.parametrize("policy", ["nondet", "det"])
def test_kernels_of_a_gpu_never_overlap_and_all_run(data_split, policy, monkeypatch):
    s, r = run(data_split, policy, True, monkeypatch)
    assert r.lower_bound_ns <= r.makespan_ns
    for g in range(4):
        k, st, en = kernel_spans(s, g)
        assert (en > st).all() and (st[1:] >= en[:-1]).all()


def test_a_kernel_issued_behind_a_group_runs_before_the_group_ends(data_split, monkeypatch):
    """Some kernel not in a group starts before the end of a group issued before it, and two groups' members
    alternate; without interleaving neither happens (kernels run in issue order)."""
    from turnip.sched.groups import launch_groups

    members = launch_groups(data_split).members
    head_of = {u: h for h, ms in members.items() for u in ms if len(ms) > 1}
    for interleave in (True, False):
        s, _ = run(data_split, "det", interleave, monkeypatch)
        issue = np.array(s.issue)
        jumped = alternated = False
        for g in range(4):
            k, st, _ = kernel_spans(s, g)
            heads = [head_of.get(int(v), -1) for v in k]
            for i in range(1, len(k) - 1):
                h = heads[i - 1]
                if h >= 0 and heads[i] != h and heads[i + 1] == h:  # a group's members around another kernel
                    later = issue[k[i]] > issue[h]
                    jumped |= later and heads[i] < 0
                    alternated |= later and heads[i] >= 0
        assert (jumped and alternated) == interleave, (interleave, jumped, alternated)


def test_det_runs_of_a_prompt_split_by_tokens_keep_their_gpus_busy(data_split, monkeypatch):
    """Measured on four H100s: det 147.0 ms against nondet 127.9 (0.87). Kernels queued behind whole groups
    left the det lanes idle (simulated 0.65); taking turns, det stays within 15% of nondet."""
    _, det = run(data_split, "det", True, monkeypatch)
    _, nondet = run(data_split, "nondet", True, monkeypatch)
    _, det_fifo = run(data_split, "det", False, monkeypatch)
    assert nondet.makespan_ns / det.makespan_ns > 0.85
    assert det_fifo.makespan_ns > 1.2 * det.makespan_ns
