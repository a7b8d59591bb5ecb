"""LoRA training steps in the simulator: every policy runs a tiny step under a tight budget, no run beats
the plan's lower bound, and an ablation sweep reports the training step next to the prefill."""

import numpy as np
import pandas as pd
import pytest

from sim import simulate
from sim.sweep import SweepConfig, plan_path, run_sweep
from sim.timing import TimingModel
from turnip.machine.bound import lower_bound
from turnip.machine.profile import load_profile
from turnip.memgraph.plan import KIND_OFFLOAD
from turnip.sched import POLICIES

pytestmark = pytest.mark.sim

TRAIN_OPS = {"rmsnorm_bwd", "silu_mul_dg", "sdpa_bwd", "xent", "xent_bwd", "adam_m", "adam_v", "adam_p"}


@pytest.fixture(scope="module")
def step():
    """llama-tiny, 2 sequences of 16 tokens, 96 KiB per GPU: activations offloaded and reloaded."""
    from turnip.compile import compile_model
    from turnip.train import TrainSpec

    return compile_model("llama-tiny", 16, 1, 96 << 10, train=TrainSpec(2))[1]


def test_the_step_has_the_training_ops_and_offloads(step):
    assert TRAIN_OPS <= set(step.op) and step.count(KIND_OFFLOAD) > 0


@pytest.mark.parametrize("profile", ["h100", "h100-measured", "h100-calibrated"])
def test_every_policy_runs_the_step_above_its_lower_bound(step, profile):
    prof = load_profile(profile)
    tm = TimingModel(step, prof)
    bound = lower_bound(tm)["lower_bound_ns"]
    order = simulate(step, prof, "nondet", 0, tm=tm).order
    for policy in POLICIES:
        for seed in (0, 1):
            o = order if policy == "det-replay" else None
            r = simulate(step, prof, policy, seed, tm=tm, order=o)
            assert 0 < r.lower_bound_ns < r.makespan_ns, (policy, seed)  # the run's own (its host factor's)
            assert (r.end_ns >= r.start_ns).all() and np.isfinite(r.makespan_ns)
        r = simulate(step, prof, policy, 0, mean_only=True, tm=tm, order=o)  # host factor 1: the plan's bound
        assert r.lower_bound_ns == bound < r.makespan_ns, policy
    kern = tm.eng == 0
    assert (tm.kernel_ns[kern] >= prof.kernel_min_ns).all()


def test_attention_backward_costs_like_attention(step):
    prof = load_profile("h100")
    tm = TimingModel(step, prof)
    op = np.array(step.op)
    assert (tm.launch_ns[op == "sdpa_bwd"] == prof.attn_launch_ns).all()
    fwd, bwd = (np.median(tm.kernel_ns[op == o]) for o in ("sdpa", "sdpa_bwd"))
    assert bwd >= fwd


def test_ablate_reports_training_next_to_prefill(tmp_path):
    cfg = SweepConfig(models=("llama-tiny",), seqs=(16,), gpus=(1,), budgets={"tight": "96KiB"},
                      policies=("nondet", "det"), seeds=2, workloads=("prefill", "lora"), train_batch=2,
                      trace={"model": "llama-tiny", "seq": 16, "gpus": 1, "budget": "tight"})  # fmt: skip
    text = run_sweep(cfg, tmp_path, jobs=1, quiet=True)
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert summary.workload.tolist() == ["prefill", "lora"]  # one configuration, side by side
    assert (summary.nondet_over_det > 0).all() and summary.lower_bound_ms.is_unique
    runs = pd.read_csv(tmp_path / "runs.csv")
    assert set(runs.workload) == {"prefill", "lora"} and (runs.makespan_ns >= runs.lower_bound_ns).all()
    assert runs.groupby("workload").n_vertices.first()["lora"] > runs.groupby("workload").n_vertices.first()["prefill"]
    assert "workload" in text and "lora:" in text
    names = {plan_path(tmp_path, p).name for p in cfg.plans()}
    assert len(names) == 2 and any("_lora-b2_" in n for n in names)
    assert {p.name for p in (tmp_path / "plans").iterdir()} == names
