"""Full-size compiles, each verified. Marked slow; they still run in CI (~20 s)."""

import pytest

from turnip.compile import compile_model
from turnip.memgraph.verify import verify

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "model,seq,gpus,budget,tiles",
    [
        ("llama-7b", 4096, 1, "6GiB", None),
        ("llama-7b", 32768, 1, "8GiB", None),
        ("llama-7b", 4096, 4, "4GiB", None),
        ("llama-65b", 4096, 8, "20GiB", None),
        ("llama-7b", 32768, 1, "8GiB", {"t": 2048}),  # 68K vertices: the verifier at scale
    ],
)
def test_compile_and_verify(model, seq, gpus, budget, tiles):
    tg, mg = compile_model(model, seq=seq, gpus=gpus, budget=budget, tiles=tiles)
    assert verify(mg, tg) == []
    assert max(mg.stats["peak_nbytes_per_gpu"]) <= mg.budget_nbytes[0]
    assert mg.count(0) + mg.count(1) + mg.count(2) == tg.n
