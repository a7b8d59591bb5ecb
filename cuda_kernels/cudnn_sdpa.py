"""Fused attention through cuDNN's SDPA (``nvidia-cudnn-frontend``) on raw device pointers.

One cuDNN graph per distinct (query rows, key rows, key rows allocated, query heads, key/value heads, head
dim, dtype, mask, stats), built once per process (first build ~1 s, later ones ~0.05 s) and cached. Tiles
are in turnip's (tokens, heads, head dim) layout: cuDNN sees dims (1, h, s, d) with strides (s*h*d, d,
h*d, 1), so a key range is read in place, its first ``tk`` rows only. Grouped-query attention: K and V
have ``hk`` heads (h a multiple of hk), which cuDNN shares among consecutive query heads (query head i
reads key/value head i // (h / hk), turnip's order); a query tile (t, hk, r, dh) is (t, h, dh) in memory.
fp16 and bf16 tensors, float32 accumulation. Masks: ``none`` (every key visible to every query) and
``bottom_right`` (query i sees keys j <= i + tk - tq: the key range ends where the query block ends).
Log-sum-exp statistics (float32, (h, tq)) are written only for partial outputs.

Execution goes through ``LibCall``: the runtime calls it with the stream slot's ``StreamContext``, whose
``handles["cudnn"]`` is a cuDNN handle bound to that slot's stream and whose workspace lies in the plan's
arena (cuDNN asks for a few hundred bytes).
"""

from __future__ import annotations

import atexit
import math

from cuda_kernels import _numba
from cuda_kernels.launch import LibCall

DTYPES = {"fp16": "HALF", "bf16": "BFLOAT16"}  # turnip dtype -> cudnn.data_type member
_GRAPHS: dict = {}
_BUILD_HANDLE = None


def release() -> None:
    """Drop the cached graphs and destroy the build handle (registered with ``atexit``: cuDNN objects
    must not outlive the CUDA driver at interpreter shutdown)."""
    global _BUILD_HANDLE
    _GRAPHS.clear()
    if _BUILD_HANDLE is not None:
        import cudnn

        cudnn.destroy_handle(_BUILD_HANDLE)
        _BUILD_HANDLE = None


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


def mask_mode(tq: int, tk: int, params: dict) -> str | None:
    """'none', 'bottom_right', or None when cuDNN's masks cannot express this tile's causal mask."""
    diag = params.get("q_off", 0) - params.get("k_off", 0)
    if not params.get("causal", True) or diag >= tk - 1:
        return "none"
    if diag == tk - tq and tk >= tq:
        return "bottom_right"
    return None


def create_handle(stream: int):
    """A cuDNN handle on the current device, bound to ``stream`` (a CUstream as an int)."""
    import cudnn

    h = cudnn.create_handle()
    cudnn.set_stream(handle=h, stream=stream)
    return h


def _build_handle():
    global _BUILD_HANDLE
    if _BUILD_HANDLE is None:
        import cudnn

        _BUILD_HANDLE = cudnn.create_handle()
    return _BUILD_HANDLE


class CudnnSdpa:
    """A built SDPA graph for one tile shape; ``bind`` fixes the pointers."""

    def __init__(self, tq: int, tk: int, tk_alloc: int, h: int, dh: int, dtype: str, scale: float, mode: str,
                 stats: bool, hk: int | None = None):  # fmt: skip
        key = (tq, tk, tk_alloc, h, dh, dtype, float(scale), mode, stats, h if hk is None else int(hk))
        hit = _GRAPHS.get(key)
        if hit is None:
            hit = _GRAPHS[key] = _build(*key)
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
            g.execute(pack, ctx.ws_ptr, handle=ctx.handles["cudnn"])

        return LibCall(run, self.ws_nbytes, "cudnn-sdpa", lib="cudnn")


def _build(tq, tk, tk_alloc, h, dh, dtype, scale, mode, stats, hk):
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
