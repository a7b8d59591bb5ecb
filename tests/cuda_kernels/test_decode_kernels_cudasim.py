"""Every kernel instance of a decode step (``turnip.decode``) under the CUDA simulator against the float64
reference: the merges and writes of the cache (einsums), attention over cache blocks with the batch in the
head axis (``sdpa`` without a causal mask, partials, ``attn_combine``), the widened rows' adds and
``cols``. The CUDA backend builds its launchers with the same ``prepare``."""

import pytest

from tests.cuda_kernels.cases import DTYPES, TOLERANCE, Case

pytestmark = pytest.mark.cudasim


def decode_cases(dtype: str) -> list[Case]:
    """One case per distinct (op, operand shapes, output shape, params) of a small decode step."""
    import json

    from turnip.decode import DecodeShape, decode_step
    from turnip.models import LLAMA

    tg = decode_step(LLAMA["tiny-gqa"], DecodeShape(2, 2, 4), 1, dtype)
    seen, cases = set(), []
    for v in range(tg.n):
        if tg.kind[v] != 1:  # kernels only (KIND_KERNEL)
            continue
        ins = tuple(tuple(tg.shape[a]) for a in tg.args(v))
        key = (tg.op[v], ins, tuple(tg.shape[v]), json.dumps(tg.params[v], sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        kinds = ("partial",) * len(ins) if tg.op[v] == "attn_combine" else ()
        cases.append(Case(tg.name[v], tg.op[v], ins, tuple(tg.shape[v]), dict(tg.params[v]), kinds))
    return cases


def test_the_decode_step_has_the_ops_checked_here():
    ops = {c.op for c in decode_cases("fp32")}
    assert {"einsum", "sdpa", "attn_combine", "add_n", "cols", "rmsnorm", "silu_mul", "sum_into"} <= ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_kernels_match_reference(dtype, rng):
    from tests.cuda_kernels.harness import check

    for case in decode_cases(dtype):
        err, _ = check(case, dtype, rng)
        assert err <= TOLERANCE[dtype], f"{case.name} ({case.op}) {dtype}: relative error {err:.3g}"
