"""cuBLASLt through ctypes (``cuda_kernels.cublaslt.LtGemm``) vs the CuPy cuBLAS path (``CublasGemm``).

LLaMA-7B tile GEMMs at t tokens (default 4096): ``td,df->tf`` (d=4096, f=5504), ``tf,fd->td``,
``td,dhe->the`` (h=16, e=128) and ``the,hed->td``. For each, in the same run and on the same stream and
buffers: host microseconds per launch (median of 2000 launches, timed one by one in chunks of 100; before
each chunk a sleep kernel keeps the GPU busy so the launches only queue, and the chunk is drained before the
next so the launch queue never fills), TFLOP/s (CUDA events around 20 back-to-back launches queued behind
a sleep kernel), and the ratios. The two paths' outputs are compared (relative Frobenius difference).
Also the bound call captured once into a CUDA graph (``cuda_kernels.launch.capture``, replayed with
``cuGraphLaunch``): host us, TFLOP/s, and whether its output is bitwise the plain call's.

    PYTHONPATH=. python benchmarks/cublaslt_speed.py [--tokens 4096] [--dtype fp16] [--out lt.csv]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time

import numpy as np

from cuda_kernels import cublaslt
from cuda_kernels._numba import cuda
from cuda_kernels.gemm import CublasGemm, cublas_layout, plan_einsum
from cuda_kernels.launch import StreamContext, capture, capture_stream, driver

NP_DTYPE = {"fp16": np.float16, "fp32": np.float32}


def llama_gemms(t: int, d: int = 4096, f: int = 5504, h: int = 16, e: int = 128):
    return [
        ("ffn_in", "td,df->tf", (t, d), (d, f), (t, f)),
        ("ffn_out", "tf,fd->td", (t, f), (f, d), (t, d)),
        ("qkv_proj", "td,dhe->the", (t, d), (d, h, e), (t, h, e)),
        ("attn_out", "the,hed->td", (t, h, e), (h, e, d), (t, d)),
    ]


class Pad:
    """A one-thread kernel that sleeps about ``us`` microseconds (``cuda.nanosleep`` loop, calibrated)."""

    def __init__(self, c, stream):
        self.c, self.stream = c, stream

        @c.jit
        def sleep(n):
            for _ in range(n):
                c.nanosleep(1000)

        self.kern = sleep
        self.kern[1, 1, stream](10)
        stream.synchronize()
        e0, e1 = c.event(), c.event()
        n = 2000
        e0.record(stream)
        self.kern[1, 1, stream](n)
        e1.record(stream)
        e1.synchronize()
        self.us_per_iter = max(c.event_elapsed_time(e0, e1) * 1e3 / n, 0.05)

    def __call__(self, us: float) -> None:
        self.kern[1, 1, self.stream](max(1, int(us / self.us_per_iter)))


def host_us(c, fn, pad: Pad, stream, n: int = 2000, chunk: int = 100, guess_us: float = 60.0):
    """(median, p90) host microseconds of ``fn()`` over ``n`` calls, and the fraction of chunks that ended
    while the pad kernel still held the GPU (1.0: the launches never waited on the GPU)."""
    ts: list[int] = []
    busy = 0
    ev = c.event(timing=False)
    for _ in range(max(1, n // chunk)):
        pad(chunk * guess_us * 2)
        ev.record(stream)
        for _ in range(chunk):
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
        busy += not ev.query()
        stream.synchronize()
    ts.sort()
    return statistics.median(ts) / 1e3, ts[int(0.9 * len(ts))] / 1e3, busy / max(1, n // chunk)


def tflops(c, fn, pad: Pad, stream, flops: int, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    stream.synchronize()
    pad(2000.0)  # the launches below queue behind it, so the events time only the GEMMs
    e0, e1 = c.event(), c.event()
    e0.record(stream)
    for _ in range(reps):
        fn()
    e1.record(stream)
    e1.synchronize()
    ms = c.event_elapsed_time(e0, e1) / reps
    return flops / ms / 1e9


def explore(c, stream, pad, handle, dtype: str, ws_mib: int, t: int, calls: int) -> list[dict]:
    """Where the host time of one cuBLASLt launch goes, on the ffn_in GEMM: the ctypes floor (the same
    16-argument call with a NULL handle, which cuBLASLt rejects at once) and the heuristic's first choices
    (host us and TFLOP/s each)."""
    name, subs, a_shape, b_shape, out_shape = llama_gemms(t)[0]
    plan = plan_einsum(subs, a_shape, b_shape, out_shape)
    lay = cublas_layout(plan)
    dt = NP_DTYPE[dtype]
    rng = np.random.default_rng()
    x = c.to_device(rng.standard_normal(a_shape, dtype=np.float32).astype(dt))
    y = c.to_device(rng.standard_normal(b_shape, dtype=np.float32).astype(dt))
    o = c.device_array(out_shape, dt)
    ws = c.device_array(ws_mib << 20, np.uint8)
    sh = int(stream.handle)
    ctx = StreamContext(stream=sh, ws_ptr=ws.device_ctypes_pointer.value, ws_nbytes=ws_mib << 20,
                        handles={"cublaslt": handle})
    ptrs = (o.device_ctypes_pointer.value, x.device_ctypes_pointer.value, y.device_ctypes_pointer.value)
    out = []
    lib = cublaslt.load()
    ver = lib.cublasLtGetVersion
    h, _, _ = host_us(c, ver, pad, stream, calls)
    out.append({"what": "ctypes: cublasLtGetVersion()", "host_us": h})
    g0 = cublaslt.LtGemm(lay, dtype, 1.0, ws_mib << 20)
    pre, matmul, wp, wn = g0.bind(*ptrs).fn.args, lib.cublasLtMatmul, ctx.ws_ptr, ctx.ws_nbytes
    assert matmul(0, *pre, wp, wn, sh) != 0

    def rejected():
        matmul(0, *pre, wp, wn, sh)

    h, _, _ = host_us(c, rejected, pad, stream, calls)
    out.append({"what": "ctypes: cublasLtMatmul(NULL handle), rejected by cuBLASLt", "host_us": h})
    for i in range(8):
        try:
            g = cublaslt.LtGemm(lay, dtype, 1.0, ws_mib << 20, algo_index=i)
        except cublaslt.CublasLtError:
            break
        lc = g.bind(*ptrs)
        try:
            lc(ctx)
        except cublaslt.CublasLtError as e:
            out.append({"what": f"algo #{i}", "error": str(e)})
            continue
        h, p90, busy = host_us(c, lambda lc=lc: lc(ctx), pad, stream, calls)
        tf = tflops(c, lambda lc=lc: lc(ctx), pad, stream, plan.flops())
        out.append({"what": f"algo #{i} ws={g.ws_nbytes}", "host_us": h, "p90_us": p90, "tflops": tf, "busy": busy})
        g.close()
    for r in out:
        print("  explore:", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    g0.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="fp16", choices=sorted(NP_DTYPE))
    ap.add_argument("--ws-mib", type=int, default=32, help="max workspace for the cuBLASLt heuristic")
    ap.add_argument("--calls", type=int, default=2000, help="launches timed for host cost")
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--out", help="CSV path")
    ap.add_argument("--explore", action="store_true",
                    help="also: the ctypes floor and the host cost of the heuristic's first 8 algorithms")
    a = ap.parse_args(argv)
    c = cuda()
    stream = c.stream()
    rng = np.random.default_rng()
    pad = Pad(c, stream)
    dt = NP_DTYPE[a.dtype]
    print(f"cuBLASLt {cublaslt.version()} from {cublaslt.library_path()}; {c.get_current_device().name}; "
          f"dtype {a.dtype}, t={a.tokens}, pad {pad.us_per_iter:.2f} us/iter", flush=True)
    handle = cublaslt.lt_handle_create()
    rows = []
    try:
        for name, subs, a_shape, b_shape, out_shape in llama_gemms(a.tokens):
            plan = plan_einsum(subs, a_shape, b_shape, out_shape)
            lay = cublas_layout(plan)
            assert lay is not None, subs
            x = c.to_device(rng.standard_normal(a_shape, dtype=np.float32).astype(dt))
            y = c.to_device(rng.standard_normal(b_shape, dtype=np.float32).astype(dt))
            o_lt = c.to_device(np.full(out_shape, np.nan, dt))
            o_cb = c.to_device(np.full(out_shape, np.nan, dt))
            t0 = time.perf_counter()
            lt = cublaslt.LtGemm(lay, a.dtype, a.alpha, a.ws_mib << 20)
            build_ms = (time.perf_counter() - t0) * 1e3
            ws = c.device_array(max(lt.ws_nbytes, 1), np.uint8)
            ctx = StreamContext(stream=int(stream.handle), ws_ptr=ws.device_ctypes_pointer.value,
                                ws_nbytes=lt.ws_nbytes, handles={"cublaslt": handle}, numba_stream=stream)
            call = lt.bind(o_lt.device_ctypes_pointer.value, x.device_ctypes_pointer.value,
                           y.device_ctypes_pointer.value)
            cb = CublasGemm(lay, a.dtype, a.alpha)

            gexec = capture(call, ctx, capture_stream())  # what the runtime does at plan load
            graph_launch = driver().cuGraphLaunch

            def run_lt(call=call, ctx=ctx):
                call(ctx)

            def run_graph(ex=gexec, ctx=ctx, graph_launch=graph_launch):
                graph_launch(ex, ctx.stream)

            def run_cb(cb=cb, o=o_cb, x=x, y=y):
                cb(stream, o, x, y)

            run_lt()
            run_cb()
            stream.synchronize()
            r_lt, r_cb = o_lt.copy_to_host().astype(np.float64), o_cb.copy_to_host().astype(np.float64)
            diff = float(np.linalg.norm(r_lt - r_cb) / np.linalg.norm(r_cb))
            finite = bool(np.isfinite(r_lt).all())
            flops = plan.flops()
            tf_lt = tflops(c, run_lt, pad, stream, flops)
            tf_cb = tflops(c, run_cb, pad, stream, flops)
            tf_g = tflops(c, run_graph, pad, stream, flops)
            guess = 60.0
            h_lt, p90_lt, busy_lt = host_us(c, run_lt, pad, stream, a.calls, guess_us=guess)
            h_cb, p90_cb, busy_cb = host_us(c, run_cb, pad, stream, a.calls, guess_us=guess)
            h_g, p90_g, busy_g = host_us(c, run_graph, pad, stream, a.calls, guess_us=guess)
            stream.synchronize()
            graph_same = bool(np.array_equal(o_lt.copy_to_host().astype(np.float64), r_lt))  # graph wrote last
            row = {
                "gemm": name, "einsum": subs, "dtype": a.dtype, "m": lay[3], "n": lay[4], "k": lay[5],
                "batch": lay[12], "lt_ws_bytes": lt.ws_nbytes, "lt_build_ms": round(build_ms, 2),
                "lt_host_us": round(h_lt, 2), "cublas_host_us": round(h_cb, 2),
                "host_ratio_cublas_over_lt": round(h_cb / h_lt, 2),
                "lt_host_p90_us": round(p90_lt, 2), "cublas_host_p90_us": round(p90_cb, 2),
                "lt_tflops": round(tf_lt, 1), "cublas_tflops": round(tf_cb, 1),
                "tflops_ratio_lt_over_cublas": round(tf_lt / tf_cb, 3),
                "lt_graph_host_us": round(h_g, 2), "lt_graph_host_p90_us": round(p90_g, 2),
                "lt_graph_tflops": round(tf_g, 1), "lt_graph_equal": graph_same,
                "lt_vs_cublas_rel_diff": f"{diff:.2e}", "lt_all_written": finite,
                "gpu_busy_frac": round(min(busy_lt, busy_cb, busy_g), 2),
            }
            rows.append(row)
            print(f"{name:9s} {subs:13s} m={row['m']} n={row['n']} k={row['k']} ws={lt.ws_nbytes >> 10} KiB | "
                  f"host us: lt {h_lt:.2f} cublas {h_cb:.2f} (x{h_cb / h_lt:.2f}) | "
                  f"TFLOP/s: lt {tf_lt:.1f} cublas {tf_cb:.1f} (x{tf_lt / tf_cb:.3f}) | "
                  f"lt graph: host {h_g:.2f} us, {tf_g:.1f} TFLOP/s, same {graph_same} | "
                  f"diff {diff:.1e} busy {row['gpu_busy_frac']}", flush=True)
            lt.close()
        if a.explore:
            explore(c, stream, pad, handle, a.dtype, a.ws_mib, a.tokens, a.calls)
    finally:
        cublaslt.lt_handle_destroy(handle)
    if a.out and rows:
        with open(a.out, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
