"""Device probe: the launch paths and fused attention options the CUDA backend can build on.

Checks and times, on one GPU: cuDNN SDPA through ``nvidia-cudnn-frontend`` on raw pointers in turnip's
(tokens, heads, head dim) tile layout (non-causal with stats, causal, bottom-right causal with fewer
queries than keys), host cost of its ``execute``; driver-level launches (``cuLaunchKernel`` through ctypes)
of a numba kernel and of an NVRTC kernel compiled by CuPy; cuBLAS ``cublasGemmEx`` through ctypes on a
handle bound to a stream, with workspaces of several sizes; event record/query costs. Prints one line per
check; ``--out`` writes them as JSON.

    PYTHONPATH=. python benchmarks/probe_launch.py --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import time
import traceback

import numpy as np

RESULTS: dict = {}


def section(name):
    def wrap(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                r = fn(*a, **k)
                RESULTS[name] = {"ok": True, **(r or {})}
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                RESULTS[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
            print(f"[{name}] {json.dumps(RESULTS[name])} ({time.perf_counter() - t0:.1f} s)", flush=True)

        return run

    return wrap


def host_us(fn, n=2000):
    ts = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t)
    return float(np.median(ts)) / 1e3


@section("cudnn_sdpa")
def probe_cudnn():
    import cudnn
    import cupy as cp
    import torch

    out = {"frontend": cudnn.__version__, "backend": cudnn.backend_version()}
    handle = cudnn.create_handle()
    stream = cp.cuda.Stream(non_blocking=True)
    cudnn.set_stream(handle=handle, stream=stream.ptr)
    h, d = 16, 128

    def build(sq, skv, mode, stats):
        g = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        def t(name, s):
            return g.tensor(name=name, dim=[1, h, s, d], stride=[s * h * d, d, h * d, 1],
                            data_type=cudnn.data_type.HALF)
        Q, K, V = t("Q", sq), t("K", skv), t("V", skv)
        kw = dict(name="sdpa", q=Q, k=K, v=V, attn_scale=1.0 / math.sqrt(d), generate_stats=stats)
        if mode == "causal":
            kw["use_causal_mask"] = True
        elif mode == "bottom_right":
            kw["use_causal_mask_bottom_right"] = True
        O, S = g.sdpa(**kw)
        O.set_output(True).set_dim([1, h, sq, d]).set_stride([sq * h * d, d, h * d, 1])
        if stats:
            S.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g, Q, K, V, O, S

    def ref(q, k, v, mode):
        tq, tk, tv = (torch.as_tensor(x, device="cuda").float().permute(1, 0, 2)[None] for x in (q, k, v))
        sq, skv = q.shape[0], k.shape[0]
        s = (tq @ tk.transpose(-1, -2)) / math.sqrt(d)
        if mode != "none":
            off = skv - sq if mode == "bottom_right" else 0
            mask = torch.arange(skv, device="cuda")[None, :] > (torch.arange(sq, device="cuda")[:, None] + off)
            s = s.masked_fill(mask, float("-inf"))
        lse = torch.logsumexp(s, -1)
        o = torch.softmax(s, -1) @ tv
        return o[0].permute(1, 0, 2), lse[0]

    for sq, skv, mode in ((4096, 4096, "none"), (4096, 4096, "causal"), (2048, 8192, "bottom_right"),
                          (8192, 32768, "bottom_right"), (4096, 4096, "bottom_right"), (1000, 3000, "bottom_right")):
        key = f"{mode}_{sq}x{skv}"
        try:
            t0 = time.perf_counter()
            g, Q, K, V, O, S = build(sq, skv, mode, True)
            tb = time.perf_counter() - t0
            q = cp.random.standard_normal((sq, h, d), dtype=cp.float32).astype(cp.float16)
            k, v = (cp.random.standard_normal((skv, h, d), dtype=cp.float32).astype(cp.float16) for _ in range(2))
            o = cp.full((sq, h, d), cp.nan, dtype=cp.float16)
            lse = cp.full((h, sq), cp.nan, dtype=cp.float32)
            ws = cp.empty(max(1, g.get_workspace_size()), dtype=cp.uint8)
            pack = {Q: q.data.ptr, K: k.data.ptr, V: v.data.ptr, O: o.data.ptr, S: lse.data.ptr}
            g.execute(pack, ws.data.ptr, handle=handle)
            stream.synchronize()
            if sq * skv <= 4096 * 8192:
                ro, rl = ref(q, k, v, mode)
                go = torch.as_tensor(o, device="cuda").float()
                err = float((go - ro).norm() / ro.norm())
                lerr = float((torch.as_tensor(lse, device="cuda") - rl).abs().max())
            else:
                err = lerr = -1.0
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            for _ in range(10):
                g.execute(pack, ws.data.ptr, handle=handle)
            e1.record(stream)
            e1.synchronize()
            ms = cp.cuda.get_elapsed_time(e0, e1) / 10
            frac = 1.0 if mode == "none" else (0.5 if mode == "causal" else
                                                 (skv - sq + sq / 2) / skv)
            fl = 4 * h * sq * skv * d * frac
            hus = host_us(lambda: g.execute(pack, ws.data.ptr, handle=handle), 200)  # noqa: B023
            stream.synchronize()
            out[key] = {"ms": round(ms, 4), "tflops": round(fl / ms / 1e9, 1), "rel_err": err, "lse_max_abs_err": lerr,
                        "ws_bytes": int(g.get_workspace_size()), "build_s": round(tb, 2), "execute_host_us": hus,
                        "nan_out": bool(cp.isnan(o).any())}
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            out[key] = f"{type(e).__name__}: {e}"[:300]
        print(key, out[key], flush=True)
    # inference (no stats) variant for the non-partial case
    try:
        g, Q, K, V, O, S = build(4096, 8192, "bottom_right", False)
        out["no_stats_ok"] = True
    except Exception as e:  # noqa: BLE001
        out["no_stats_ok"] = f"{type(e).__name__}: {e}"[:300]
    return out


@section("numba_bound_launch")
def probe_numba():
    from cuda_kernels._numba import cuda as get_cuda

    cuda = get_cuda()

    @cuda.jit
    def add1(out, x):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = x[i] + np.float32(1.0)

    n = 1 << 20
    x = cuda.to_device(np.arange(n, dtype=np.float32))
    y = cuda.device_array(n, dtype=np.float32)
    from numba.core import types

    k = add1.compile((types.Array(types.float32, 1, "C"), types.Array(types.float32, 1, "C")))
    cuf = k._codelibrary.get_cufunc()
    attrs = {a: repr(getattr(cuf, a, None))[:80] for a in ("handle", "kernel", "name")}
    kern = cuf.kernel
    cand = {}
    for a in ("_handle", "handle"):
        if hasattr(kern, a):
            cand[a] = repr(getattr(kern, a))[:80]
    h = getattr(kern, "_handle", None) or getattr(cuf, "handle", None)
    hv = int(h) if not hasattr(h, "value") else int(h.value)
    lib = ctypes.CDLL("libcuda.so.1")
    P = ctypes.c_void_p
    f = lib.cuLaunchKernel
    f.argtypes = [P, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                  ctypes.c_uint, P, P, P]
    f.restype = ctypes.c_int

    def pack_array(a):
        vals = [0, 0, a.size, a.dtype.itemsize, a.device_ctypes_pointer.value, *a.shape, *a.strides]
        return [ctypes.c_int64(v) for v in vals]

    args = pack_array(y) + pack_array(x)
    params = (P * len(args))(*[ctypes.addressof(c) for c in args])
    s = cuda.stream()
    sh = int(s.handle)
    grid = (n + 255) // 256
    r = f(hv, grid, 1, 1, 256, 1, 1, 0, sh, params, None)
    s.synchronize()
    ok = bool(np.array_equal(y.copy_to_host(), np.arange(n, dtype=np.float32) + 1)) and r == 0
    us_bound = host_us(lambda: f(hv, grid, 1, 1, 256, 1, 1, 0, sh, params, None))
    s.synchronize()
    from cuda_kernels._numba import _launch_stream

    ls = _launch_stream(s)
    us_numba = host_us(lambda: k.launch((y, x), (grid, 1, 1), (256, 1, 1), ls, 0), 500)
    s.synchronize()
    # kernel handle kind: CUkernel needs cuKernelGetFunction?
    return {"ok_result": ok, "rc": r, "attrs": attrs, "kernel_attrs": cand, "bound_launch_us": us_bound,
            "numba_launch_us": us_numba}


@section("nvrtc_bound_launch")
def probe_nvrtc():
    import cupy as cp

    src = r"""
    #include <cuda_fp16.h>
    extern "C" __global__ void add8(half* __restrict__ out, const half* __restrict__ a, const half* __restrict__ b,
                                     long long n8) {
        long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
        for (; i < n8; i += (long long)gridDim.x * blockDim.x) {
            uint4 x = reinterpret_cast<const uint4*>(a)[i];
            uint4 y = reinterpret_cast<const uint4*>(b)[i];
            half2* xh = reinterpret_cast<half2*>(&x);
            const half2* yh = reinterpret_cast<const half2*>(&y);
            #pragma unroll
            for (int k = 0; k < 4; ++k) {
                float2 fx = __half22float2(xh[k]), fy = __half22float2(yh[k]);
                xh[k] = __floats2half2_rn(fx.x + fy.x, fx.y + fy.y);
            }
            reinterpret_cast<uint4*>(out)[i] = x;
        }
    }
    """
    t0 = time.perf_counter()
    mod = cp.RawModule(code=src, options=("-std=c++17",))
    fn = mod.get_function("add8")
    tc = time.perf_counter() - t0
    n = 64 << 20
    a = cp.random.standard_normal(n, dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal(n, dtype=cp.float32).astype(cp.float16)
    o = cp.empty_like(a)
    lib = ctypes.CDLL("libcuda.so.1")
    P = ctypes.c_void_p
    f = lib.cuLaunchKernel
    f.argtypes = [P, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                  ctypes.c_uint, P, P, P]
    f.restype = ctypes.c_int
    vals = [ctypes.c_void_p(o.data.ptr), ctypes.c_void_p(a.data.ptr), ctypes.c_void_p(b.data.ptr),
            ctypes.c_int64(n // 8)]
    params = (P * 4)(*[ctypes.addressof(c) for c in vals])
    s = cp.cuda.Stream(non_blocking=True)
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    grid = sms * 8
    r = f(fn.ptr, grid, 1, 1, 256, 1, 1, 0, s.ptr, params, None)
    s.synchronize()
    ok = bool(cp.allclose(o.astype(cp.float32), (a.astype(cp.float32) + b.astype(cp.float32)), rtol=1e-2, atol=1e-2))
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(s)
    for _ in range(20):
        f(fn.ptr, grid, 1, 1, 256, 1, 1, 0, s.ptr, params, None)
    e1.record(s)
    e1.synchronize()
    ms = cp.cuda.get_elapsed_time(e0, e1) / 20
    gbs = 3 * n * 2 / ms / 1e6
    e0.record(s)
    for _ in range(20):
        cp.cuda.runtime.memcpyAsync(o.data.ptr, a.data.ptr, n * 2, 3, s.ptr)
    e1.record(s)
    e1.synchronize()
    cms = cp.cuda.get_elapsed_time(e0, e1) / 20
    us = host_us(lambda: f(fn.ptr, 1, 1, 1, 32, 1, 1, 0, s.ptr, params, None))
    s.synchronize()
    return {"ok_result": ok, "rc": r, "compile_s": round(tc, 2), "fp16_add_gbs": round(gbs, 1),
            "d2d_copy_gbs": round(2 * n * 2 / cms / 1e6, 1), "launch_us": us, "fn_ptr_type": type(fn.ptr).__name__}


@section("cublas_ctypes")
def probe_cublas():
    import cupy as cp

    found = None
    for name in ("libcublas.so.13", "libcublas.so.12", "libcublas.so"):
        try:
            lib = ctypes.CDLL(name)
            found = name
            break
        except OSError:
            continue
    if found is None:
        import glob
        import os

        import nvidia

        paths = []
        for p in nvidia.__path__:
            paths += glob.glob(os.path.join(p, "**", "libcublas.so*"), recursive=True)
        paths = sorted(x for x in paths if "Lt" not in os.path.basename(x))
        lib = ctypes.CDLL(paths[0])
        found = paths[0]
    P, I = ctypes.c_void_p, ctypes.c_int
    h = P()
    assert lib.cublasCreate_v2(ctypes.byref(h)) == 0
    s = cp.cuda.Stream(non_blocking=True)
    assert lib.cublasSetStream_v2(h, P(s.ptr)) == 0
    gemm = lib.cublasGemmEx
    gemm.restype = I
    gemm.argtypes = [P, I, I, I, I, I, P, P, I, I, P, I, I, P, P, I, I, I, I]
    out = {"lib": found}
    for ws_mib in (0, 4, 32):
        if ws_mib:
            ws = cp.empty(ws_mib << 20, dtype=cp.uint8)
            r = lib.cublasSetWorkspace_v2(h, P(ws.data.ptr), ctypes.c_size_t(ws_mib << 20))
            assert r == 0, r
        for (m, n, k) in ((4096, 4096, 4096), (4096, 5504, 4096), (4096, 4096, 5504), (8192, 2048, 4096)):
            a = cp.random.standard_normal((k, m), dtype=cp.float32).astype(cp.float16)
            b = cp.random.standard_normal((n, k), dtype=cp.float32).astype(cp.float16)
            c = cp.empty((n, m), dtype=cp.float16)
            al, be = np.ones(1, np.float32), np.zeros(1, np.float32)
            args = (h, 0, 0, m, n, k, al.ctypes.data, a.data.ptr, 2, m, b.data.ptr, 2, k, be.ctypes.data,
                    c.data.ptr, 2, m, 68, -1)
            assert gemm(*args) == 0
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            for _ in range(20):
                gemm(*args)
            e1.record(s)
            e1.synchronize()
            ms = cp.cuda.get_elapsed_time(e0, e1) / 20
            out[f"ws{ws_mib}_{m}x{n}x{k}_tflops"] = round(2 * m * n * k / ms / 1e9, 1)
            ref = (a.astype(cp.float32).T @ b.astype(cp.float32).T).T
            out[f"ws{ws_mib}_{m}x{n}x{k}_err"] = float(cp.linalg.norm(c.astype(cp.float32) - ref) / cp.linalg.norm(ref))
        out[f"ws{ws_mib}_host_us"] = host_us(lambda: gemm(*args), 300)  # noqa: B023
        s.synchronize()
    return out


@section("events")
def probe_events():
    import cupy as cp

    lib = ctypes.CDLL("libcuda.so.1")
    P = ctypes.c_void_p
    e = P()
    lib.cuEventCreate(ctypes.byref(e), 2)  # CU_EVENT_DISABLE_TIMING
    e2 = P()
    lib.cuEventCreate(ctypes.byref(e2), 0)
    s = cp.cuda.Stream(non_blocking=True)
    rec, q = lib.cuEventRecord, lib.cuEventQuery
    rec.argtypes, q.argtypes = [P, P], [P]
    ev, ev2, sp = e.value, e2.value, s.ptr
    r1 = host_us(lambda: rec(ev, sp))
    r2 = host_us(lambda: rec(ev2, sp))
    s.synchronize()
    q1 = host_us(lambda: q(ev))
    return {"record_notiming_us": r1, "record_timing_us": r2, "query_us": q1}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    a = ap.parse_args()
    from cuda_kernels._numba import apply_numpy_shim

    apply_numpy_shim()
    probe_cudnn()
    probe_numba()
    probe_nvrtc()
    probe_cublas()
    probe_events()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
