"""Fast CUDA C++ kernels (``cuda_kernels.fast``).

``unit`` tests (no GPU, no CuPy): coverage decisions, kernel variant and geometry choice, parameter packing
against the C signatures in the source. ``gpu`` tests: every op in fp16, bf16 and fp32 at LLaMA-7B tiles
(and LLaMA-3 rotary tiles: grouped-query q, rope scaling, positions past 32768) and at awkward shapes,
launched through ``launch_raw(fast_kernel(...).bind(...), stream)`` on a non-blocking CuPy stream; fresh
random inputs, NaN-poisoned outputs, relative error against the float64 reference (bit-exact against
``turnip.reference`` where the op is one fp32 operation per element), and misaligned pointers (one element
off: 2 bytes in fp16 and bf16) through the scalar variants.
"""

from __future__ import annotations

import ctypes
import math
import re

import numpy as np
import pytest

from cuda_kernels import fast
from tests.cuda_kernels.cases import LLAMA3_ROPE, NP_DTYPE, TOLERANCE, Case, make_inputs, reference_f64, rel_error
from turnip import reference

DTYPES = tuple(NP_DTYPE)  # fp16, fp32 and bf16 (with ml_dtypes)
INNER = (1, 7, 130, 4100)
T = 4096  # tokens of the LLaMA-7B tiles
EXACT = frozenset({"mul", "scale", "add_n", "sum_into", "embed"})  # one fp32 op per element (or a copy)
_CT = {"p": ctypes.c_void_p, "q": ctypes.c_int64, "f": ctypes.c_float, "d": ctypes.c_double}


def _ew(name, op, shape, nin, params=None):
    return Case(name, op, (shape,) * nin, shape, params or {})


def tile_cases(t: int = T) -> list[Case]:
    """The 7B tiles of the benchmark (and the remaining elementwise ops at 7B widths)."""
    return [
        Case("rmsnorm_7b", "rmsnorm", ((t, 4096), (4096,)), (t, 4096), {"eps": 1e-5}),
        Case("rotary_7b", "rotary", ((t, 16, 128),), (t, 16, 128), {"pos_off": t, "theta": 10000.0}),
        Case("rotary_llama3_q", "rotary", ((t, 8, 4, 128),), (t, 8, 4, 128), {"pos_off": 32768} | LLAMA3_ROPE),
        Case("rotary_llama3_k", "rotary", ((t, 8, 128),), (t, 8, 128), {"pos_off": 32768} | LLAMA3_ROPE),
        _ew("silu_mul_7b", "silu_mul", (t, 5504), 2),
        _ew("add_n_7b", "add_n", (t, 4096), 2),
        Case("embed_7b", "embed", ((t,), (32000, 4096)), (t, 4096), {}, ("ids:32000", "normal")),
        _ew("silu_7b", "silu", (t, 5504), 1),
        _ew("mul_7b", "mul", (t, 5504), 2),
        _ew("scale_7b", "scale", (t, 4096), 1, {"alpha": -0.7}),
        _ew("add_n3_7b", "add_n", (t // 4, 4096), 3),
        _ew("add_n4_7b", "add_n", (t // 4, 4096), 4),
        _ew("sum_into_7b", "sum_into", (t, 4096), 2),
    ]


def awkward_cases() -> list[Case]:
    cases = []
    for n in INNER:
        for op, nin, p in (("silu_mul", 2, {}), ("silu", 1, {}), ("mul", 2, {}), ("scale", 1, {"alpha": 1.5}),
                           ("add_n", 2, {}), ("add_n", 3, {}), ("add_n", 4, {}), ("sum_into", 2, {})):
            cases.append(_ew(f"{op}{nin}_{n}", op, (5, n), nin, p))
        cases.append(Case(f"embed_{n}", "embed", ((9,), (50, n)), (9, n), {}, ("ids:50", "normal")))
    for d in sorted({*INNER, 64, 100, 4096, 8192, 16384, 20000}):
        rows = 37 if d <= 8192 else 5
        cases.append(Case(f"rmsnorm_{d}", "rmsnorm", ((rows, d), (d,)), (rows, d), {"eps": 1e-5}))
    cases.append(Case("rmsnorm_3d", "rmsnorm", ((2, 3, 64), (64,)), (2, 3, 64), {"eps": 1e-6}))
    for shape, pos in (((5, 3, 2), 0), ((7, 2, 130), 17), ((3, 2, 4100), 5), ((37, 3, 16), 1000),
                       ((9, 40, 256), 123457), ((33, 1, 64), 4096)):
        cases.append(Case(f"rotary_{'x'.join(map(str, shape))}", "rotary", (shape,), shape,
                          {"pos_off": pos, "theta": 10000.0}))
    cases.append(Case("rotary_theta5e5", "rotary", ((65, 8, 128),), (65, 8, 128), {"pos_off": 8000, "theta": 5e5}))
    cases.append(Case("rotary_default_theta", "rotary", ((6, 2, 32),), (6, 2, 32), {"pos_off": 2}))
    for shape, pos in (((7, 2, 3, 130), 32700), ((5, 1, 4, 16), 0), ((9, 3, 64), 100000)):
        cases.append(Case(f"rotary_rope_{'x'.join(map(str, shape))}", "rotary", (shape,), shape,
                          {"pos_off": pos} | LLAMA3_ROPE))
    cases.append(Case("rotary_rope_factor_0", "rotary", ((5, 2, 32),), (5, 2, 32),
                      {"pos_off": 9, "theta": 10000.0, "rope_factor": 0, "rope_low": 1.0}))
    return cases


def misaligned_cases() -> list[Case]:
    return [
        _ew("silu_mul", "silu_mul", (64, 1000), 2),
        _ew("silu", "silu", (64, 1000), 1),
        _ew("mul", "mul", (64, 1000), 2),
        _ew("scale", "scale", (64, 1000), 1, {"alpha": 0.3}),
        _ew("add_n3", "add_n", (33, 130), 3),
        _ew("sum_into", "sum_into", (64, 1000), 2),
        Case("rmsnorm_64", "rmsnorm", ((37, 64), (64,)), (37, 64), {"eps": 1e-5}),
        Case("rmsnorm_4096", "rmsnorm", ((37, 4096), (4096,)), (37, 4096), {"eps": 1e-5}),
        Case("rotary", "rotary", ((37, 4, 128),), (37, 4, 128), {"pos_off": 3, "theta": 10000.0}),
        Case("rotary_llama3", "rotary", ((37, 2, 4, 128),), (37, 2, 4, 128), {"pos_off": 32768} | LLAMA3_ROPE),
        Case("embed", "embed", ((9,), (50, 4096)), (9, 4096), {}, ("ids:50", "normal")),
    ]


def _ids(cases):
    return [c.name for c in cases]


# ---------------------------------------------------------------- GPU


class _Buf:
    """A device copy of ``host`` starting ``offset`` bytes into a fresh CuPy allocation (256-byte aligned)."""

    def __init__(self, cp, host: np.ndarray, offset: int = 0):
        host = np.ascontiguousarray(host)
        self.cp, self.shape, self.dtype, self.nbytes, self.offset = cp, host.shape, host.dtype, host.nbytes, offset
        self.raw = cp.empty(host.nbytes + 256, dtype=cp.uint8)
        assert self.raw.data.ptr % 256 == 0
        if host.nbytes:
            self.raw[offset:offset + host.nbytes] = cp.asarray(host.reshape(-1).view(np.uint8))
        self.ptr = self.raw.data.ptr + offset

    def get(self) -> np.ndarray:
        b = self.cp.asnumpy(self.raw[self.offset:self.offset + self.nbytes])
        return b.view(self.dtype).reshape(self.shape)


def _run(case: Case, dtype: str, rng, offset: int = 0):
    """(kernel output, host inputs, plan) of one launch on a non-blocking CuPy stream."""
    cp = pytest.importorskip("cupy")
    from cuda_kernels.launch import launch_raw

    fk = fast.fast_kernel(case.op, list(case.in_shapes), case.out_shape, dtype, case.params)
    assert fk is not None, f"{case.name} {dtype}: not covered or unavailable ({fast.last_error()})"
    xs = make_inputs(case, dtype, rng)
    ins = [_Buf(cp, x, 0 if x.dtype == np.int32 else offset) for x in xs]
    if case.op == "sum_into":
        out = ins[0]
    else:
        out = _Buf(cp, np.full(case.out_shape, np.nan, dtype=NP_DTYPE[dtype]), offset)
    plan = fk.plan(out.ptr, [b.ptr for b in ins])
    raw = fk.bind(out.ptr, [b.ptr for b in ins])
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()  # uploads and NaN fill ran on the null stream
    assert launch_raw(raw, stream.ptr) == 0
    stream.synchronize()
    return out.get(), xs, plan


def _verify(case: Case, dtype: str, got: np.ndarray, xs: list) -> None:
    assert got.shape == tuple(case.out_shape) and got.dtype == NP_DTYPE[dtype]
    assert not np.isnan(got).any(), f"{case.name} {dtype}: {int(np.isnan(got).sum())} elements not written"
    if case.op in EXACT:
        want = reference.run_reference(case.op, [x.copy() for x in xs], case.params)
        np.testing.assert_array_equal(got, want, err_msg=f"{case.name} {dtype}")
    if case.op != "embed":  # embed is checked exactly (and its table in float64 would be 1 GB)
        err = rel_error(got, reference_f64(case, xs))
        assert err <= TOLERANCE[dtype], f"{case.name} {dtype}: relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", tile_cases(), ids=_ids(tile_cases()))
def test_tiles_match_reference(case, dtype, rng):
    got, xs, plan = _run(case, dtype, rng)
    assert plan.vector, f"{case.name} {dtype}: aligned 7B tile took {plan.name}"
    _verify(case, dtype, got, xs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", awkward_cases(), ids=_ids(awkward_cases()))
def test_awkward_shapes_match_reference(case, dtype, rng):
    got, xs, _ = _run(case, dtype, rng)
    _verify(case, dtype, got, xs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", misaligned_cases(), ids=_ids(misaligned_cases()))
def test_misaligned_pointers_take_scalar_path(case, dtype, rng):
    """Every float pointer one element past a 256-byte boundary (2 bytes in fp16, 4 in fp32)."""
    off = np.dtype(NP_DTYPE[dtype]).itemsize
    got, xs, plan = _run(case, dtype, rng, offset=off)
    assert not plan.vector, f"{case.name} {dtype}: misaligned pointers took {plan.name}"
    _verify(case, dtype, got, xs)


@pytest.mark.gpu
def test_repeated_launches_and_two_streams_agree(rng):
    """One bound launch issued on two streams and twice: same bits (no state carried between launches)."""
    cp = pytest.importorskip("cupy")
    from cuda_kernels.launch import launch_raw

    case = Case("rmsnorm", "rmsnorm", ((300, 4096), (4096,)), (300, 4096), {"eps": 1e-5})
    fk = fast.fast_kernel(case.op, list(case.in_shapes), case.out_shape, "fp16", case.params)
    assert fk is not None, fast.last_error()
    xs = make_inputs(case, "fp16", rng)
    ins = [_Buf(cp, x) for x in xs]
    outs = [_Buf(cp, np.full(case.out_shape, np.nan, np.float16)) for _ in range(2)]
    raws = [fk.bind(o.ptr, [b.ptr for b in ins]) for o in outs]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(2)]
    cp.cuda.Device().synchronize()
    for _ in range(2):
        for raw, s in zip(raws, streams, strict=True):
            assert launch_raw(raw, s.ptr) == 0
    for s in streams:
        s.synchronize()
    a, b = (o.get() for o in outs)
    np.testing.assert_array_equal(a, b)
    _verify(case, "fp16", a, xs)


@pytest.mark.gpu
def test_fast_kernel_available_on_gpu():
    pytest.importorskip("cupy")
    fk = fast.fast_kernel("silu", [(4, 4)], (4, 4), "fp16", {})
    assert fk is not None, fast.last_error()
    assert fast.fast_kernel("rotary", [(4, 2, 7)], (4, 2, 7), "fp16", {"pos_off": 0}) is None


# ---------------------------------------------------------------- unit (CPU, no CuPy)


def _signatures_in_source() -> dict[str, str]:
    sig = {}
    pat = re.compile(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\)", re.S)
    for name, params in pat.findall(fast._SOURCE):
        codes = ""
        for prm in params.split(","):
            prm = " ".join(prm.split())
            if "*" in prm:
                codes += "p"
            elif prm.startswith("long long"):
                codes += "q"
            elif prm.startswith("double"):
                codes += "d"
            elif prm.startswith("float"):
                codes += "f"
            else:
                raise AssertionError(f"{name}: unexpected parameter {prm!r}")
        sig[name] = codes
    return sig


@pytest.fixture
def fake_device(monkeypatch):
    """132 SMs and fake function handles: ``plan``/``bind`` run without CuPy."""
    monkeypatch.setattr(fast, "_STATE", {"module": object(), "error": None, "sms": 132, "modules": {}, "funcs": {}})
    monkeypatch.setattr(fast, "_function", lambda name: 0x1000 + fast.kernel_names().index(name))


def _plan_all(cases, dtype, offset=0):
    for c in cases:
        fk = fast._build(c.op, c.in_shapes, c.out_shape, dtype, c.params)
        assert fk is not None, (c.name, dtype)
        base = 1 << 30
        ptrs = [base + (k + 1) * (1 << 28) + (0 if len(s) == 1 and c.op == "embed" else offset)
                for k, s in enumerate(c.in_shapes)]
        yield c, fk, fk.plan(base + offset, ptrs), (base + offset, ptrs)


@pytest.mark.unit
def test_signatures_match_source():
    assert _signatures_in_source() == fast.SIGNATURES


@pytest.mark.unit
@pytest.mark.parametrize("dtype", DTYPES)
def test_plans_pack_the_c_signature(dtype, fake_device):
    names = set(fast.kernel_names())
    for offset in (0, np.dtype(NP_DTYPE[dtype]).itemsize):
        for c, fk, plan, (out_ptr, in_ptrs) in _plan_all(tile_cases() + awkward_cases() + misaligned_cases(),
                                                          dtype, offset):
            assert plan.name in names, (c.name, plan.name)
            sig = fast.SIGNATURES[plan.name.split("<")[0]]
            assert [type(a) for a in plan.args] == [_CT[k] for k in sig], (c.name, plan.name)
            assert 1 <= plan.grid[0] <= 132 * max(fast.BLOCKS_PER_SM, fast.ROW_BLOCKS_PER_SM)
            assert plan.block[0] % 32 == 0 and plan.block[0] <= 512
            assert plan.shmem <= fast.SMEM_LIMIT
            raw = fk.bind(out_ptr, in_ptrs)
            assert raw.func == 0x1000 + fast.kernel_names().index(plan.name) and len(raw.keep) == len(sig)


@pytest.mark.unit
def test_tile_plans(fake_device):
    g = {c.name: (fk, p) for c, fk, p, _ in _plan_all(tile_cases(), "fp16")}
    fk, p = g["rmsnorm_7b"]
    assert p.name == "rms_block<unsigned short, 4>" and p.block == (128,) and p.vector
    assert [a.value for a in p.args[3:5]] == [T, 4096] and p.args[5].value == pytest.approx(1e-5)
    fk, p = g["rotary_7b"]
    assert p.name == "rotary_kernel<unsigned short, 8>" and p.vector
    t, h, half, tb, pos = (a.value for a in p.args[2:7])
    assert (t, h, half, tb, pos) == (T, 16, 64, fast.ROTARY_PAIRS_PER_BLOCK // 128, T)
    assert p.args[7].value == pytest.approx(2 * math.log2(10000.0) / 128)
    assert p.shmem == 8 * tb * 64 and p.grid == (T // tb,)
    fk, p = g["silu_mul_7b"]
    assert p.name == "ew_kernel<unsigned short, 8, 0, 2>" and p.args[5].value == T * 5504
    assert p.args[4].value is None  # unused input pointers are NULL
    fk, p = g["embed_7b"]
    assert p.name == "embed_kernel<uint4>" and [a.value for a in p.args[3:]] == [T, 4096 * 2 // 16, 32000]
    fk, p = g["sum_into_7b"]
    assert p.name == "ew_kernel<unsigned short, 8, 4, 2>"
    fk, p = g["scale_7b"]
    assert p.args[6].value == pytest.approx(-0.7)
    assert fk.nbytes() == 2 * T * 4096 * 2


@pytest.mark.unit
def test_elementwise_grid_is_balanced(fake_device):
    fk = fast._build("silu_mul", [(T, 5504)] * 2, (T, 5504), "fp16", {})
    p = fk.plan(1 << 30, [2 << 30, 3 << 30])
    nv = T * 5504 // 8
    k = nv / (fast.THREADS * fast.UNROLL * p.grid[0])  # unrolled iterations per thread
    assert p.grid[0] <= 132 * fast.BLOCKS_PER_SM and math.ceil(k) - k < 0.05


@pytest.mark.unit
@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_pointers_choose_scalar_variants(dtype, fake_device):
    isz = np.dtype(NP_DTYPE[dtype]).itemsize
    for c, _, plan, _ in _plan_all(misaligned_cases(), dtype, offset=isz):
        assert not plan.vector, (c.name, plan.name)
    for c, _, plan, _ in _plan_all(misaligned_cases(), dtype, offset=0):
        assert plan.vector, (c.name, plan.name)


@pytest.mark.unit
def test_element_misaligned_pointer_is_rejected(fake_device):
    fk = fast._build("mul", [(8, 8)] * 2, (8, 8), "fp32", {})
    with pytest.raises(ValueError, match="aligned"):
        fk.plan(1 << 30, [(2 << 30) + 2, 3 << 30])
    with pytest.raises(ValueError, match="input pointers"):
        fk.plan(1 << 30, [2 << 30])


@pytest.mark.unit
def test_bind_packs_params(fake_device):
    fk = fast._build("rotary", [(37, 3, 16)], (37, 3, 16), "fp32", {"pos_off": 5, "theta": 500000.0})
    raw = fk.bind(0x7000_0000, [0x7100_0000])
    p = fk.plan(0x7000_0000, [0x7100_0000])
    assert raw.func == 0x1000 + fast.kernel_names().index(p.name)
    assert (raw.gx, raw.gy, raw.gz, raw.bx, raw.by, raw.bz, raw.shmem) == (*p.grid, 1, 1, *p.block, 1, 1, p.shmem)
    sig = fast.SIGNATURES["rotary_kernel"]
    vals = [ctypes.cast(raw.params[i], ctypes.POINTER(_CT[k]))[0] for i, k in enumerate(sig)]
    vals = [v.value if isinstance(v, ctypes.c_void_p) else v for v in vals]
    assert vals == [0x7000_0000, 0x7100_0000, 37, 3, 8, p.args[5].value, 5, 2 * math.log2(500000.0) / 16,
                    fast.fastdiv(8 // 4), fast.fastdiv(3), 0.0, 0.0, 0.0, 0.0]


@pytest.mark.unit
def test_rotary_grouped_tile_and_rope_scaling_params(fake_device):
    """A (t, hk, r, dh) tile is planned as (t, hk * r, dh); rope scaling parameters are packed last."""
    fk = fast._build("rotary", [(37, 2, 4, 16)], (37, 2, 4, 16), "bf16", {"pos_off": 32768} | LLAMA3_ROPE)
    p = fk.plan(0x7000_0000, [0x7100_0000])
    assert p.name == "rotary_kernel<fk_bf16, 8>" and p.vector
    assert [a.value for a in p.args[2:5]] == [37, 8, 8] and p.args[6].value == 32768
    assert p.args[7].value == pytest.approx(2 * math.log2(500000.0) / 16)
    assert [a.value for a in p.args[10:]] == [8.0, 1.0, 4.0, 8192.0]
    plain = fast._build("rotary", [(37, 8, 16)], (37, 8, 16), "bf16", {"pos_off": 32768, "theta": 500000.0})
    assert [a.value for a in plain.plan(0x7000_0000, [0x7100_0000]).args[:10]] == [a.value for a in p.args[:10]]


@pytest.mark.unit
def test_fastdiv_matches_integer_division():
    rnd = np.random.default_rng(7)
    divisors = [*range(1, 3000), *(int(d) for d in rnd.integers(1, 2**31, 2000)), *(2**k for k in range(31)),
                *(2**k - 1 for k in range(2, 32)), *(2**k + 1 for k in range(1, 31))]
    for d in divisors:
        md = fast.fastdiv(d)
        m, s = md & 0xFFFFFFFF, md >> 32
        assert (m == 0) == (d == 1) and (d == 1 or 2**31 <= m < 2**32)
        ns = [0, 1, d - 1, d, d + 1, 2**31 - 2, 2**31 - 1, *(int(n) for n in rnd.integers(0, 2**31, 50)),
              *(k * d + o for k in (2, 3, 999, (2**31 - 1) // d) for o in (-1, 0, 1))]
        for n in ns:
            if 0 <= n < 2**31:
                assert (((n * m) >> 32) >> s if m else n) == n // d, (n, d)


@pytest.mark.unit
def test_coverage():
    b = fast._build
    assert b("rmsnorm", [(4, 64), (64,)], (4, 64), "fp16", {}) is not None
    assert b("rmsnorm", [(4, 64), (4, 64)], (4, 64), "fp16", {}) is None  # w must be (d,)
    assert b("rotary", [(4, 2, 7)], (4, 2, 7), "fp16", {"pos_off": 0}) is None  # odd dh
    assert b("rotary", [(4, 2, 1)], (4, 2, 1), "fp32", {"pos_off": 0}) is None
    assert b("rotary", [(4, 2, 8)], (4, 2, 8), "fp32", {"pos_off": 0}) is not None
    assert b("rotary", [(4, 2, 12290)], (4, 2, 12290), "fp32", {"pos_off": 0}) is None  # table > 48 KB
    assert b("mul", [(4, 8), (8,)], (4, 8), "fp32", {}) is None  # broadcast
    assert b("add_n", [(4, 8)] * 5, (4, 8), "fp32", {}) is None
    assert b("add_n", [(4, 8)], (4, 8), "fp32", {}) is None
    assert b("scale", [(4, 8)], (4, 8), "fp32", {}) is None  # alpha missing
    assert b("silu", [(4, 8)], (4, 8), "bf16", {}) is not None
    assert b("silu", [(4, 8)], (4, 8), "fp8", {}) is None
    assert b("rotary", [(4, 2, 3, 8)], (4, 2, 3, 8), "bf16", {"pos_off": 0}) is not None  # grouped-query q
    assert b("rotary", [(4, 8)], (4, 8), "fp32", {"pos_off": 0}) is None  # no head axis
    assert b("rotary", [(4, 2, 8)], (4, 2, 8), "fp32", {"pos_off": 0, "rope_factor": 8.0}) is None  # no rope_low..
    assert b("silu", [(0, 8)], (0, 8), "fp16", {}) is None
    assert b("einsum", [(4, 8), (8, 4)], (4, 4), "fp16", {"subscripts": "ij,jk->ik"}) is None
    assert b("embed", [(9,), (50, 8)], (9, 8), "fp16", {}) is not None
    assert b("embed", [(9,), (50, 8)], (9, 9), "fp16", {}) is None


@pytest.mark.unit
def test_none_without_cupy_or_under_simulator(monkeypatch):
    from cuda_kernels import _numba

    def no_cupy():
        raise ImportError("no cupy here")

    monkeypatch.setattr(fast, "_STATE", {"module": None, "error": None, "sms": None, "funcs": {}})
    monkeypatch.setattr(fast, "_cupy", no_cupy)
    monkeypatch.setattr(_numba, "simulating", lambda: False)
    assert fast.fast_kernel("silu", [(4, 8)], (4, 8), "fp16", {}) is None
    assert "cupy" in fast.last_error()
    monkeypatch.setattr(fast, "_STATE", {"module": object(), "error": None, "sms": 132, "modules": {}, "funcs": {}})
    assert fast.fast_kernel("silu", [(4, 8)], (4, 8), "fp16", {}) is not None
    monkeypatch.setattr(_numba, "simulating", lambda: True)
    assert fast.fast_kernel("silu", [(4, 8)], (4, 8), "fp16", {}) is None


@pytest.mark.unit
def test_real_environment_without_cupy_gives_none():
    try:
        import cupy  # noqa: F401
    except Exception:  # noqa: BLE001
        assert fast.fast_kernel("silu", [(4, 8)], (4, 8), "fp16", {}) is None
    else:
        pytest.skip("CuPy is importable here")
