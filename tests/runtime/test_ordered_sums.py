"""Ordered sums on the CPU backend: a LLaMA plan whose contractions are split over 4 GPUs (3 partials summed
into each accumulator) gives bitwise equal outputs run after run under chaos delays, and different bits
without ordered sums (so the equality is not an accident of the plan)."""

import numpy as np
import pytest

from tests.runtime.helpers import reference
from turnip.compile import compile_model
from turnip.memgraph.verify import verify
from turnip.runtime import execute, open_backend

pytestmark = pytest.mark.cpu_runtime

RUNS = 6


@pytest.fixture(scope="module", params=[64 * 1024, 32 * 1024], ids=["fits", "offloads"])
def plan(request):
    # one key-value head and a quarter of the FFN per block: 4 partials per contraction over 4 GPUs
    tg, mg = compile_model("llama-tiny", seq=64, gpus=4, budget=request.param, dtype="fp32", tiles={"h": 1, "f": 40})
    assert verify(mg, tg) == []
    lock = mg.lock_group[mg.lock_group >= 0]
    sizes = np.bincount(lock)
    assert (sizes >= 3).sum() >= 8, f"the plan should sum 3+ partials into its accumulators, got {sizes[sizes > 0]}"
    return tg, mg


def _outputs(tg, mg, ordered_sums: bool) -> list[dict]:
    inputs, ref = reference(tg)
    outs = []
    with open_backend("cpu", mg, 3, chaos=0.5, chaos_max_s=0.0005, poison=True) as be:
        be.write_inputs(inputs)
        for seed in range(RUNS):
            execute(mg, be, "nondet", 3, seed=seed, ordered_sums=ordered_sums)
            out = be.read_outputs()
            for t, x in out.items():
                np.testing.assert_allclose(x, ref[t], rtol=1e-4, atol=1e-4, err_msg=f"run {seed}, tensor {t}")
            outs.append(out)
    return outs


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[t], b[t]) for t in a)


def test_ordered_sums_are_bitwise_reproducible(plan):
    outs = _outputs(*plan, ordered_sums=True)
    assert all(_same(o, outs[0]) for o in outs[1:])


def test_unordered_sums_differ_between_runs(plan):
    outs = _outputs(*plan, ordered_sums=False)
    assert not all(_same(o, outs[0]) for o in outs[1:]), "chaos should add the partials in different orders"


@pytest.mark.parametrize("cmd", ["run", "train"])
def test_cli_takes_unordered_sums(cmd):
    from tests.clicall import call

    extra = ["--repeat", "1", "--warmup", "0", "--check"] if cmd == "run" else ["--steps", "1"]
    rc, out, err = call([cmd, "--model", "llama-tiny", "--gpus", "4", "--budget", "1MiB", "--dtype", "fp32",
                         "--unordered-sums", *extra])  # fmt: skip
    assert rc == 0, out + err
