"""Fused attention through cuDNN's SDPA (``nvidia-cudnn-frontend``) on raw device pointers.

One cuDNN graph per distinct (query rows, key rows, key rows allocated, query heads, key/value heads, head
dim, dtype, mask, stats), built once per process (first build ~1 s, later ones ~0.05 s) and cached. Tiles
are in turnip's (tokens, heads, head dim) layout: cuDNN sees dims (1, h, s, d) with strides (s*h*d, d,
h*d, 1), so a key range is read in place, its first ``tk`` rows only. Grouped-query attention: K and V
have ``hk`` heads (h a multiple of hk), which cuDNN shares among consecutive query heads (query head i
reads key/value head i // (h / hk), turnip's order); a query tile (t, hk, r, dh) is (t, h, dh) in memory.
fp16 and bf16 tensors, float32 accumulation. Masks: ``none`` (every key visible to every query),
``bottom_right`` (query i sees keys j <= i + tk - tq: the key range ends where the query block ends) and
``band`` (bottom_right within a sliding window: also j > i + tk - tq - window; cuDNN's diagonal band with a
left bound, bottom-right aligned).
Log-sum-exp statistics (float32, (h, tq)) are written only for partial outputs.

Execution goes through ``LibCall``: the runtime calls it with the stream slot's ``StreamContext``, whose
``handles["cudnn"]`` is a cuDNN handle bound to that slot's stream and whose workspace lies in the plan's
arena (cuDNN asks for a few hundred bytes). The calls are capturable: captured on another stream
(``cuda_kernels.launch.capture``), the handle is bound to the capture stream for the call and back after
it, and the graph then replays cuDNN's kernels with one ``cuGraphLaunch`` (a direct ``execute`` costs the
host about 70 µs; the backward's two, about 200).

Backward (``CudnnSdpaBwd``, op ``sdpa_bwd``, as many keys as queries): cuDNN's ``sdpa_backward`` needs the
forward's log-sum-exp, so one call runs the forward with stats first (O into the output buffer, which the
backward then overwrites; the stats, float32 (h, t), at the start of the slot's workspace), then the backward,
writing dQ, dK, dV with strides straight into turnip's packed (t, hk, (r + 2) dh) output. Grouped-query tiles
are seen as hk batches of r query heads over one key/value head (a (b, h, s, d) stride cannot step over the
dK, dV columns between key/value heads). The backward's workspace is large (the frontend accumulates dQ in
float32: h t dh 4 bytes, plus h t 4); the launcher falls back to the portable kernels when the plan's
per-slot workspace is smaller.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os

from cuda_kernels import _numba
from cuda_kernels.launch import LibCall

DTYPES = {"fp16": "HALF", "bf16": "BFLOAT16"}  # turnip dtype -> cudnn.data_type member
_GRAPHS: dict = {}  # (device, tile shape...) -> built graph: a graph's plans belong to the device built on
_BUILD_HANDLES: dict = {}  # device -> the handle graphs are built with there


def release() -> None:
    """Drop the cached graphs and destroy the build handles (registered with ``atexit``: cuDNN objects
    must not outlive the CUDA driver at interpreter shutdown)."""
    _GRAPHS.clear()
    if _BUILD_HANDLES:
        import cudnn

        for h in _BUILD_HANDLES.values():
            cudnn.destroy_handle(h)
        _BUILD_HANDLES.clear()


atexit.register(release)


def usable() -> bool:
    """cuDNN's frontend imports and a real device is present (never under the simulator)."""
    if _numba.simulating():
        return False
    try:
        import cudnn  # noqa: F401
    except Exception:
        return False
    return True


BAND_SWITCH = "TURNIP_CUDNN_WINDOW"  # "0": windowed tiles run the portable kernel instead of cuDNN's band


def band_enabled() -> bool:
    """cuDNN's diagonal band for sliding-window tiles, on unless ``TURNIP_CUDNN_WINDOW=0`` (then those tiles
    run the portable kernel). Checked on an H100 against transformers (Mistral-style and Phi-3-style windows:
    top-1 equal, logits within 2.1e-3 of HF fp16, as the portable kernel) and 30-35x faster per prefill there
    (``benchmarks/results/hf_window_band_h100.md``)."""
    return os.environ.get(BAND_SWITCH, "1") != "0"


def mask_mode(tq: int, tk: int, params: dict, band: bool | None = None) -> str | None:
    """'none', 'bottom_right', 'band', or None when cuDNN's masks cannot express this tile's causal mask and
    sliding window (``window`` param; a window that reaches past the tile's first key for every query is
    no mask at all). ``band``: whether cuDNN's band may take a window (default: ``band_enabled()``)."""
    diag = params.get("q_off", 0) - params.get("k_off", 0)
    causal = params.get("causal", True)
    window = int(params.get("window", 0)) if causal else 0
    if window and diag + tq <= window:  # the last query's window starts at or before key 0
        window = 0
    if window and not (band_enabled() if band is None else band):
        return None
    if not causal or diag >= tk - 1:
        return None if window else "none"
    if diag == tk - tq and tk >= tq:
        return "band" if window else "bottom_right"
    return None


def create_handle(stream: int):
    """A cuDNN handle on the current device, bound to ``stream`` (a CUstream as an int)."""
    import cudnn

    h = cudnn.create_handle()
    cudnn.set_stream(handle=h, stream=stream)
    return h


@contextlib.contextmanager
def _on_stream(handle, ctx):
    """``handle`` bound to ``ctx.stream`` for the block (a capture stream), then back to ``ctx.handle_stream``."""
    import cudnn

    cudnn.set_stream(handle=handle, stream=ctx.stream)
    try:
        yield
    finally:
        cudnn.set_stream(handle=handle, stream=ctx.handle_stream)


def _device() -> int:
    from cuda_kernels.launch import current_device

    return current_device()


def _build_handle():
    """The current device's build handle (created once per device)."""
    dev = _device()
    h = _BUILD_HANDLES.get(dev)
    if h is None:
        import cudnn

        h = _BUILD_HANDLES[dev] = cudnn.create_handle()
    return h


class CudnnSdpa:
    """A built SDPA graph for one tile shape; ``bind`` fixes the pointers."""

    def __init__(self, tq: int, tk: int, tk_alloc: int, h: int, dh: int, dtype: str, scale: float, mode: str,
                 stats: bool, hk: int | None = None, window: int = 0):  # fmt: skip
        if (mode == "band") != (window > 0):
            raise ValueError(f"cuDNN SDPA: mask {mode!r} with window {window}")
        key = (_device(), tq, tk, tk_alloc, h, dh, dtype, float(scale), mode, stats, h if hk is None else int(hk),
               int(window))  # fmt: skip
        hit = _GRAPHS.get(key)
        if hit is None:
            hit = _GRAPHS[key] = _build(*key[1:])
        self.graph, self.tensors = hit
        self.ws_nbytes = int(self.graph.get_workspace_size())
        self.stats = stats

    def bind(self, o_ptr: int, lse_ptr: int, q_ptr: int, k_ptr: int, v_ptr: int) -> LibCall:
        Q, K, V, O, S = self.tensors
        pack = {Q: q_ptr, K: k_ptr, V: v_ptr, O: o_ptr}
        if self.stats:
            pack[S] = lse_ptr
        g = self.graph

        def run(ctx) -> None:
            h = ctx.handles["cudnn"]
            if ctx.handle_stream and ctx.handle_stream != ctx.stream:  # captured: the handle moves to the capture
                with _on_stream(h, ctx):
                    g.execute(pack, ctx.ws_ptr, handle=h)
            else:
                g.execute(pack, ctx.ws_ptr, handle=h)

        return LibCall(run, self.ws_nbytes, "cudnn-sdpa", capturable=True, lib="cudnn")


def _build(tq, tk, tk_alloc, h, dh, dtype, scale, mode, stats, hk, window=0):
    import cudnn

    if dtype not in DTYPES:
        raise ValueError(f"cuDNN SDPA path is {'/'.join(DTYPES)} only, not {dtype}")
    if h % hk:
        raise ValueError(f"cuDNN SDPA: {h} query heads are not a multiple of {hk} key/value heads")
    dt = getattr(cudnn.data_type, DTYPES[dtype])
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=_build_handle())  # fmt: skip

    def tile(name, s, alloc, heads):
        return g.tensor(name=name, dim=[1, heads, s, dh], stride=[alloc * heads * dh, dh, heads * dh, 1],
                        data_type=dt)

    Q, K, V = tile("Q", tq, tq, h), tile("K", tk, tk_alloc, hk), tile("V", tk, tk_alloc, hk)
    kw = {"name": "sdpa", "q": Q, "k": K, "v": V, "attn_scale": float(scale), "generate_stats": stats}
    if mode == "bottom_right":
        kw["use_causal_mask_bottom_right"] = True
    elif mode == "band":  # query i sees keys i + tk - tq - window < j <= i + tk - tq
        kw |= {"diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT, "diagonal_band_left_bound": int(window),
               "diagonal_band_right_bound": 0}  # fmt: skip
    O, S = g.sdpa(**kw)
    O.set_output(True).set_dim([1, h, tq, dh]).set_stride([tq * h * dh, dh, h * dh, 1])
    if stats:
        S.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, (Q, K, V, O, S if stats else None)


def supports(tq: int, tk: int, h: int, dh: int, dtype: str, params: dict, hk: int | None = None) -> bool:
    """Whether this tile can take the cuDNN path (fp16 or bf16, head dim a multiple of 8 up to 256, key/value
    heads dividing the query heads, a cuDNN mask)."""
    return (usable() and dtype in DTYPES and dh % 8 == 0 and dh <= 256 and tq > 0 and tk > 0
            and (hk is None or 0 < hk and h % hk == 0)
            and mask_mode(tq, tk, params) is not None and math.isfinite(params.get("scale", 1.0)))  # fmt: skip


def supports_bwd(t: int, h: int, dh: int, dtype: str, params: dict, hk: int) -> bool:
    """Whether an ``sdpa_bwd`` tile (t queries and keys) can take the cuDNN path: fp16 or bf16, head dim a
    multiple of 8 up to 128 (every architecture's backward limit), t > 1, a causal mask cuDNN expresses."""
    return (usable() and dtype in DTYPES and dh % 8 == 0 and dh <= 128 and t > 1 and 0 < hk and h % hk == 0
            and mask_mode(t, t, params) in ("none", "bottom_right")
            and math.isfinite(params.get("scale", 1.0)))  # fmt: skip


def bwd_layout(t: int, hk: int, r: int, dh: int) -> dict[str, tuple[list[int], list[int]]]:
    """(dim, stride) in elements of the backward's tensors over turnip's buffers: ``q`` (also o, dO) in
    (t, hk, r, dh), ``kv`` in (t, hk, dh), ``stats`` float32 (h, t), ``dq`` and ``dkv`` (dK, dV, each from
    its own column offset) in the packed output (t, hk, (r + 2) dh). Multi-head (r = 1): one batch of hk
    heads; grouped-query: hk batches of r query heads and one key/value head."""
    h, row = hk * r, hk * (r + 2) * dh
    if r == 1:
        b, hq, hv, qb, kb, ob, oh = 1, hk, hk, t * h * dh, t * hk * dh, t * row, 3 * dh
    else:
        b, hq, hv, qb, kb, ob, oh = hk, r, 1, r * dh, dh, (r + 2) * dh, dh
    return {
        "q": ([b, hq, t, dh], [qb, dh, h * dh, 1]),
        "kv": ([b, hv, t, dh], [kb, dh, hk * dh, 1]),
        "stats": ([b, hq, t, 1], [hq * t, t, 1, 1]),
        "dq": ([b, hq, t, dh], [ob, oh, row, 1]),
        "dkv": ([b, hv, t, dh], [ob, oh, row, 1]),
    }


class CudnnSdpaBwd:
    """cuDNN forward (for its stats) then backward of one ``sdpa_bwd`` tile shape; ``bind`` fixes the
    pointers. ``ws_nbytes``: the stats (rounded up to 256 bytes) plus the larger of the two graphs'
    workspaces, which share one range after them."""

    def __init__(self, t: int, hk: int, r: int, dh: int, dtype: str, scale: float, mode: str):
        if mode not in ("none", "bottom_right"):
            raise ValueError(f"cuDNN SDPA backward: mask {mode!r} not supported")
        self.fwd = CudnnSdpa(t, t, t, hk * r, dh, dtype, scale, mode, True, hk)
        key = (_device(), "bwd", t, hk, r, dh, dtype, float(scale), mode)
        hit = _GRAPHS.get(key)
        if hit is None:
            hit = _GRAPHS[key] = _build_bwd(*key[2:])
        self.graph, self.tensors = hit
        self.stats_nbytes = -(-hk * r * t * 4 // 256) * 256
        self.ws_nbytes = self.stats_nbytes + max(self.fwd.ws_nbytes, int(self.graph.get_workspace_size()))
        self.r, self.dh = r, dh

    def bind(self, out_ptr: int, q_ptr: int, k_ptr: int, v_ptr: int, o_ptr: int, do_ptr: int) -> LibCall:
        fg, (fQ, fK, fV, fO, fS) = self.fwd.graph, self.fwd.tensors
        g, (Q, K, V, O, dO, S, dQ, dK, dV) = self.graph, self.tensors
        col = self.dh * 2  # bytes of one dh slot (fp16 / bf16)
        dk_ptr, dv_ptr = out_ptr + self.r * col, out_ptr + (self.r + 1) * col
        skip = self.stats_nbytes

        def both(ctx) -> None:
            stats, ws, h = ctx.ws_ptr, ctx.ws_ptr + skip, ctx.handles["cudnn"]
            fg.execute({fQ: q_ptr, fK: k_ptr, fV: v_ptr, fO: out_ptr, fS: stats}, ws, handle=h)
            g.execute({Q: q_ptr, K: k_ptr, V: v_ptr, O: o_ptr, dO: do_ptr, S: stats, dQ: out_ptr, dK: dk_ptr,
                       dV: dv_ptr}, ws, handle=h)  # fmt: skip

        def run(ctx) -> None:
            if ctx.handle_stream and ctx.handle_stream != ctx.stream:  # captured: the handle moves to the capture
                with _on_stream(ctx.handles["cudnn"], ctx):
                    both(ctx)
            else:
                both(ctx)

        return LibCall(run, self.ws_nbytes, "cudnn-sdpa-bwd", capturable=True, lib="cudnn")


def _build_bwd(t, hk, r, dh, dtype, scale, mode):
    import cudnn

    if dtype not in DTYPES:
        raise ValueError(f"cuDNN SDPA backward is {'/'.join(DTYPES)} only, not {dtype}")
    dt, f32 = getattr(cudnn.data_type, DTYPES[dtype]), cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=f32, compute_data_type=f32, handle=_build_handle())
    lay = bwd_layout(t, hk, r, dh)

    def tensor(name, part, data_type=dt):
        dim, stride = lay[part]
        return g.tensor(name=name, dim=dim, stride=stride, data_type=data_type)

    Q, K, V, O, dO = (tensor(n, p) for n, p in (("Q", "q"), ("K", "kv"), ("V", "kv"), ("O", "q"), ("dO", "q")))
    S = tensor("Stats", "stats", f32)
    dQ, dK, dV = g.sdpa_backward(name="sdpa_backward", q=Q, k=K, v=V, o=O, dO=dO, stats=S, attn_scale=float(scale),
                                 use_causal_mask=mode == "bottom_right")  # square tile: top-left = bottom-right
    for x, part in ((dQ, "dq"), (dK, "dkv"), (dV, "dkv")):
        x.set_output(True).set_dim(lay[part][0]).set_stride(lay[part][1]).set_data_type(dt)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, (Q, K, V, O, dO, S, dQ, dK, dV)
