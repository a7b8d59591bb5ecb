"""Library calls on a numba stream outside the runtime (tests, benchmarks, a launcher called as
``launcher(stream, out, ins)``): ``standalone_context(stream, ws_nbytes, lib)``, a ``StreamContext`` of its own.

It owns one cache, {id(stream): (stream, context, workspace)}: a stream's context is made on first need and
replaced by a larger one when a call needs more workspace; a library handle (cuDNN, cuBLASLt) is created on
first need and bound to that stream. The builders that run library calls standalone (``cuda_kernels.kernels``,
``cuda_kernels.attn_bwd``) import it from here, so neither imports the other for it. Importing this module
needs numpy only: numba and the libraries are imported on first call.
"""

from __future__ import annotations

import numpy as np

_STANDALONE_CTX: dict = {}


def standalone_context(stream, ws_nbytes: int, lib: str | None = None):
    """A ``StreamContext`` for library calls on a numba stream outside the runtime (tests and benchmarks):
    a workspace of its own and, when ``lib`` names one, that library's handle bound to the stream; cached
    per stream."""
    from cuda_kernels._numba import cuda
    from cuda_kernels.launch import StreamContext

    hit = _STANDALONE_CTX.get(id(stream))
    if hit is None or hit[0] is not stream or hit[1].ws_nbytes < ws_nbytes:
        ws = cuda().device_array(max(256, ws_nbytes), dtype=np.uint8)
        ctx = StreamContext(int(stream.handle), ws.device_ctypes_pointer.value or 0, ws.size, {}, stream)
        hit = _STANDALONE_CTX[id(stream)] = (stream, ctx, ws)
    ctx = hit[1]
    if lib == "cudnn" and "cudnn" not in ctx.handles:
        from cuda_kernels import cudnn_sdpa

        ctx.handles["cudnn"] = cudnn_sdpa.create_handle(int(stream.handle))
    elif lib == "cublaslt" and "cublaslt" not in ctx.handles:
        from cuda_kernels.cublaslt import lt_handle_create

        ctx.handles["cublaslt"] = lt_handle_create()
    return ctx
