"""Gradients of causal fused attention (``sdpa_bwd``): the portable numba kernels, and the builder that
takes cuDNN (``cuda_kernels.cudnn_sdpa.CudnnSdpaBwd``) where it can.

Layout (``turnip.reference``): q, o, do (t, h, dh) (grouped-query tiles (t, hk, r, dh) are viewed so), k, v
(t, hk, dh); the output (t, hk, (r + 2) dh) holds, per token and key/value head kh, one ``dh`` slot of dq per
query head kh r + g (g < r), then dk, then dv. Query row i sees key j iff j <= i + diag (diag = q_off - k_off;
not causal: every key).

Portable path: three kernels on one stream that recompute the scores rather than store them (memory linear in
t; one thread per row: correct, not fast):

1. ``stats`` thread (query row i, head hh): the row's log-sum-exp L (online softmax over its visible keys) and
   D = rowsum(do * o), float32, written into the first 8 bytes of the row's own dq slot.
2. ``dkv``   thread (key row j, key/value head kh): over the group's r heads and the rows i that see j,
   P = exp(scale q_i . k_j - L_i), dv += P do_i, dk += P (do_i . v_j - D_i) q_i; writes the dk and dv slots.
3. ``dq``    thread (i, hh): reads L and D from its own slot first, then writes dq = scale sum_j dS_ij k_j there.

Scratch, without a workspace: L and D live in the dq slots, which kernel 2 only reads and which each thread of
kernel 3 reads before overwriting; no thread touches another thread's slot. It needs a dq slot to start on a
4-byte boundary and hold 8 bytes: dh * itemsize a multiple of 4 and at least 8 (dh even and >= 4 in half
precision). No memory beyond the output, so every plan can run it (the cuDNN path needs a large workspace).
"""

from __future__ import annotations

import warnings

import numpy as np

from cuda_kernels import codegen as cg
from cuda_kernels._numba import Compiled, array_type, scalar_type
from cuda_kernels.launch import LibCall, launch_raw
from cuda_kernels.standalone import standalone_context

_CONSTS = "    ZERO = np.float32(0.0)\n    NEG_INF = np.float32(-math.inf)"
_KERNEL_DTYPE = {"fp16": np.float16, "fp32": np.float32, "bf16": np.uint16}  # bf16 as its bits
_ITEMSIZE = {"fp16": 2, "fp32": 4, "bf16": 2}


def _row(axis: str, dh: int, names: tuple[str, ...], arrays: tuple[str, ...], bf16: bool) -> list[str]:
    """Lines (8-space indent) loading row ``axis`` of each array into a float32 local array of ``dh``."""
    L = [f"        {n} = cuda.local.array({dh}, np.float32)" for n in names]
    L.append(f"        for d in range({dh}):")
    L += [f"            {n}[d] = {cg.ld(a.format(axis), bf16)}" for n, a in zip(names, arrays, strict=True)]
    return L


def stats_source(dh: int, group: int, slot: int, bf16: bool = False) -> str:
    """Kernel 1, ``kern(sc, q, k, o, do, scale, diag)``, grid (ceil(t / block), h): L and D of row i, head hh
    into ``sc[i, kh, g slot]`` and ``sc[i, kh, g slot + 1]`` (``sc`` the output viewed as float32, ``slot``
    its float32 per dq slot)."""
    L = ["def kern(sc, q, k, o, do, scale, diag):", _CONSTS,
         "    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x", "    hh = cuda.blockIdx.y",
         f"    kh = hh // {group}", f"    c = (hh % {group}) * {slot}", "    t = q.shape[0]", "    if i < t:",
         *_row("i", dh, ("qi",), ("q[{}, hh, d]",), bf16),
         "        nvis = min(diag + 1 + i, t)", "        m = NEG_INF", "        l = ZERO",
         "        for j in range(nvis):", "            s = ZERO", f"            for d in range({dh}):",
         f"                s += qi[d] * {cg.ld('k[j, kh, d]', bf16)}", "            s = s * scale",
         "            if s > m:", "                l = l * math.exp(m - s)", "                m = s",
         "            l += math.exp(s - m)", "        dd = ZERO", f"        for d in range({dh}):",
         f"            dd += {cg.ld('do[i, hh, d]', bf16)} * {cg.ld('o[i, hh, d]', bf16)}",
         "        lse = NEG_INF", "        if l > ZERO:", "            lse = m + math.log(l)",
         "        sc[i, kh, c] = lse", "        sc[i, kh, c + 1] = dd"]  # fmt: skip
    return "\n".join(L) + "\n"


def dkv_source(dh: int, group: int, slot: int, bf16: bool = False) -> str:
    """Kernel 2, ``kern(out, sc, q, k, v, do, scale, diag)``, grid (ceil(t / block), hk): dk and dv of key
    row j, key/value head kh, summed over the group's query heads and the rows i >= j - diag."""
    L = ["def kern(out, sc, q, k, v, do, scale, diag):", _CONSTS,
         "    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x", "    kh = cuda.blockIdx.y",
         "    t = q.shape[0]", "    if j < t:",
         *_row("j", dh, ("kj", "vj"), ("k[{}, kh, d]", "v[{}, kh, d]"), bf16),
         f"        dk = cuda.local.array({dh}, np.float32)", f"        dv = cuda.local.array({dh}, np.float32)",
         f"        for d in range({dh}):", "            dk[d] = ZERO", "            dv[d] = ZERO",
         "        i0 = j - diag", "        if i0 < 0:", "            i0 = 0",
         f"        for g in range({group}):", f"            hh = kh * {group} + g", f"            c = g * {slot}",
         "            for i in range(i0, t):", "                s = ZERO", "                dp = ZERO",
         f"                for d in range({dh}):", f"                    s += {cg.ld('q[i, hh, d]', bf16)} * kj[d]",
         f"                    dp += {cg.ld('do[i, hh, d]', bf16)} * vj[d]",
         "                p = math.exp(s * scale - sc[i, kh, c])", "                ds = p * (dp - sc[i, kh, c + 1])",
         f"                for d in range({dh}):", f"                    dv[d] += p * {cg.ld('do[i, hh, d]', bf16)}",
         f"                    dk[d] += ds * {cg.ld('q[i, hh, d]', bf16)}",
         f"        for d in range({dh}):", f"            out[j, kh, {group * dh} + d] = {cg.st('dk[d] * scale', bf16)}",
         f"            out[j, kh, {(group + 1) * dh} + d] = {cg.st('dv[d]', bf16)}"]  # fmt: skip
    return "\n".join(L) + "\n"


def dq_source(dh: int, group: int, slot: int, bf16: bool = False) -> str:
    """Kernel 3, ``kern(out, sc, q, k, v, do, scale, diag)``, grid (ceil(t / block), h): dq of row i, head hh,
    over the keys it sees, into the slot that held its L and D (read first)."""
    L = ["def kern(out, sc, q, k, v, do, scale, diag):", _CONSTS,
         "    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x", "    hh = cuda.blockIdx.y",
         f"    kh = hh // {group}", f"    g = hh % {group}", "    t = q.shape[0]", "    if i < t:",
         f"        lse = sc[i, kh, g * {slot}]", f"        dd = sc[i, kh, g * {slot} + 1]",
         *_row("i", dh, ("qi", "doi"), ("q[{}, hh, d]", "do[{}, hh, d]"), bf16),
         f"        acc = cuda.local.array({dh}, np.float32)", f"        for d in range({dh}):",
         "            acc[d] = ZERO", "        nvis = min(diag + 1 + i, t)", "        for j in range(nvis):",
         "            s = ZERO", "            dp = ZERO", f"            for d in range({dh}):",
         f"                s += qi[d] * {cg.ld('k[j, kh, d]', bf16)}",
         f"                dp += doi[d] * {cg.ld('v[j, kh, d]', bf16)}",
         "            ds = math.exp(s * scale - lse) * (dp - dd)", f"            for d in range({dh}):",
         f"                acc[d] += ds * {cg.ld('k[j, kh, d]', bf16)}", f"        for d in range({dh}):",
         f"            out[i, kh, g * {dh} + d] = {cg.st('acc[d] * scale', bf16)}"]  # fmt: skip
    return "\n".join(L) + "\n"


def dims(in_shapes, out_shape) -> tuple[int, int, int, int]:
    """(t, hk, r, dh) of an ``sdpa_bwd`` instance; ``ValueError`` names the shapes that do not match."""
    if len(in_shapes) != 5 or len(in_shapes[0]) not in (3, 4) or len(in_shapes[1]) != 3:
        raise ValueError(f"sdpa_bwd takes q, k, v, o, do (q (t, h, dh) or (t, hk, r, dh), k (t, hk, dh)), got "
                         f"{in_shapes}")
    qs, ks = tuple(in_shapes[0]), tuple(in_shapes[1])
    t, hk, dh = ks
    h = int(np.prod(qs[1:-1], dtype=np.int64))
    r = h // hk if hk > 0 else 0
    ok = (r > 0 and r * hk == h and qs[0] == t and qs[-1] == dh and (len(qs) == 3 or qs[1] == hk)
          and tuple(in_shapes[2]) == ks and tuple(in_shapes[3]) == qs == tuple(in_shapes[4]))  # fmt: skip
    if not ok or tuple(out_shape) != (t, hk, (r + 2) * dh) or t <= 0:
        raise ValueError(f"sdpa_bwd: q {qs}, k {ks}, v {in_shapes[2]}, o {in_shapes[3]}, do {in_shapes[4]} -> "
                         f"{out_shape}: expected as many keys as queries and output (t, hk, (r + 2) dh)")
    return t, hk, r, dh


def build(in_shapes, out_shape, dtype: str, params: dict, opts: dict):
    """``(path, run, flops, bind)`` of one ``sdpa_bwd`` (``cuda_kernels.kernels.prepare``'s builder): cuDNN
    for fp16 / bf16 where it supports the shape and its workspace fits ``opts["ws_nbytes"]``, else the
    portable kernels."""
    t, hk, r, dh = dims(in_shapes, out_shape)
    scale = float(params["scale"])
    g = _cudnn(t, hk, r, dh, dtype, scale, params, opts)
    if g is not None:

        def bind(out, ins):
            return g.bind(_ptr(out), *(_ptr(x) for x in ins))

        def run(stream, out, ins):
            bind(out, ins)(standalone_context(stream, g.ws_nbytes, "cudnn"))

        return "cudnn", run, 0, bind
    return ("kernel", *_portable(t, hk, r, dh, dtype, scale, params))


def _cudnn(t, hk, r, dh, dtype, scale, params, opts):
    """The cuDNN backward for this instance, or None (not supported here, failed to build, or its workspace
    is larger than the plan's per-slot workspace)."""
    from cuda_kernels import cudnn_sdpa

    if not cudnn_sdpa.supports_bwd(t, hk * r, dh, dtype, params, hk):
        return None
    try:
        g = cudnn_sdpa.CudnnSdpaBwd(t, hk, r, dh, dtype, scale, cudnn_sdpa.mask_mode(t, t, params))
    except Exception as e:  # noqa: BLE001 - a graph cuDNN will not build: the portable kernels, said loudly
        warnings.warn(f"sdpa_bwd t={t} hk={hk} r={r} dh={dh} {dtype}: cuDNN graph failed ({e!r}); using the "
                      "portable kernels (slow)", stacklevel=3)  # fmt: skip
        return None
    return g if g.ws_nbytes <= opts["ws_nbytes"] else None


def _portable(t, hk, r, dh, dtype, scale, params):
    """(run, flops, bind) of the three numba kernels (module doc)."""
    isz = _ITEMSIZE[dtype]
    if (dh * isz) % 4 or dh * isz < 8:
        raise ValueError(f"sdpa_bwd's portable kernels keep float32 scratch in dq slots of {dh * isz} bytes: need "
                         "a multiple of 4, at least 8")  # fmt: skip
    h, slot, bf = hk * r, dh * isz // 4, dtype == "bf16"
    width = (r + 2) * slot  # float32 per (token, key/value head) of the output
    causal = bool(params.get("causal", True))
    diag = int(params["q_off"]) - int(params["k_off"]) if causal else t
    a3, f3 = array_type(_KERNEL_DTYPE[dtype], 3), array_type(np.float32, 3)
    f4, i8 = scalar_type("f4"), scalar_type("i8")
    blk = cg.block_for(t, 128)
    rows = -(-t // blk)
    k1 = Compiled(cg.jit(stats_source(dh, r, slot, bf)), [f3, a3, a3, a3, a3, f4, i8], (rows, h), (blk,))
    k2 = Compiled(cg.jit(dkv_source(dh, r, slot, bf)), [a3, f3, a3, a3, a3, a3, f4, i8], (rows, hk), (blk,))
    k3 = Compiled(cg.jit(dq_source(dh, r, slot, bf)), [a3, f3, a3, a3, a3, a3, f4, i8], (rows, h), (blk,))
    s32, d64 = np.float32(scale), np.int64(diag)
    n = t * hk * (r + 2) * dh

    def args_of(out, ins):
        q, k, v, o, do = (_bits(x) for x in ins)
        q, o, do = (x.reshape(t, h, dh) for x in (q, o, do))
        ob = _bits(out)
        sc = ob.reshape(n).view(np.float32).reshape(t, hk, width)
        return ((k1, (sc, q, k, o, do, s32, d64)), (k2, (ob, sc, q, k, v, do, s32, d64)),
                (k3, (ob, sc, q, k, v, do, s32, d64)))  # fmt: skip

    def run(stream, out, ins):
        for kern, args in args_of(out, ins):
            kern.launch(stream, args)

    def bind(out, ins):
        raws = [kern.bind(args) for kern, args in args_of(out, ins)]

        def launch(ctx) -> None:
            for raw in raws:
                err = launch_raw(raw, ctx.stream)
                if err:
                    raise RuntimeError(f"cuLaunchKernel (sdpa_bwd): CUDA error {err}")

        return LibCall(launch, 0, "sdpa-bwd-kernels", capturable=True)

    return run, 0, bind


def _bits(a):
    """A bf16 device array as its uint16 bits (how numba kernels take bf16); others as they are."""
    return a.view(np.uint16) if np.dtype(a.dtype).name == "bfloat16" else a


def _ptr(a) -> int:
    return a.device_ctypes_pointer.value or 0
