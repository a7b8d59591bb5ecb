"""Fast memory-bound kernels in CUDA C++ (compiled at run time by CuPy's NVRTC), bound as ``RawLaunch``.

``fast_kernel(op, in_shapes, out_shape, dtype, params)`` returns a ``FastKernel`` for the ops and shapes
covered here, or None (CuPy not importable, no usable device, the numba CUDA simulator, or an op/shape
not covered: the caller then falls back to the numba kernels of ``cuda_kernels.kernels``).
``FastKernel.bind(out_ptr, in_ptrs)`` chooses the kernel variant for those pointers (16-byte vector
accesses when every pointer is 16-byte aligned and the extents allow it, else the scalar variant),
computes grid/block once and packs the parameters: the returned ``RawLaunch`` is issued with
``cuda_kernels.launch.launch_raw(raw, stream)``.

Ops (semantics of ``turnip.reference``; fp16 = IEEE half, bf16 = bfloat16, fp32 = float; C-contiguous
arrays; computed in fp32 and rounded once (to nearest even) to the output dtype):

  rmsnorm   x (..., d), w (d,) -> x / sqrt(mean(x^2) + eps) * w   (params: eps, default 1e-5)
  rotary    x (t, h, dh) or (t, ..., dh) (middle axes are heads), dh even, rotate-half, angle
            (pos_off + token) * inv_freq_i, inv_freq_i = theta^(-2i/dh) with LLaMA-3 scaling when rope_factor
            is set (params: pos_off, theta default 10000, rope_factor, rope_low, rope_high, rope_orig;
            not ``inverse``, rotary's backward: None, the numba kernel runs it)
  silu_mul  (gate, up) -> silu(gate) * up;   silu (x);   mul (a, b);   scale (x; params: alpha)
  add_n     2..4 same-shaped inputs -> sum (in input order);   sum_into (acc, x): acc += x in place
  embed     ids (t,) int32, table (V, d) -> out[i, :] = table[ids[i], :]
            (a negative id counts from the end, as in numpy; ids out of range are clamped)

Kernel design (all in ``_SOURCE``; one module per process, compiled on first use for the device current
then, and cached; CuPy also caches the binary on disk). Element types: ``float``, ``unsigned short`` (fp16
bits) and ``fk_bf16`` (bf16 bits in a struct of its own, so templates tell it from fp16):

* Elementwise (``ew_kernel<T, V, OP, NIN>``): the arrays are flat; a grid-stride loop over 16-byte vectors
  (V = 8 halves or 4 floats) with ``FK_U`` = 4 independent vectors per input in flight per thread
  (``__ldg``: ld.global.nc), a scalar tail for the last n % V elements, V = 1 for the scalar variant.
  The grid is sized to the GPU (at most ``BLOCKS_PER_SM`` blocks of 256 threads per SM; more blocks than
  fit at once, so blocks finishing at different times overlap their loads and stores) and so that every
  thread runs the same number of unrolled iterations. ``sum_into`` is ``add`` with out == in[0]
  (no ``__restrict__`` there: each thread reads its elements before it writes them).
* rmsnorm: row kept in registers (x read once, w loaded once per thread and kept across rows): one warp
  per row while d / V <= 128 (``rms_warp<T, VPT>``, 8 rows per 256-thread block), else one block of
  128/256/512 threads per row (``rms_block<T, VPT>``; warp shuffles, then a double-buffered shared
  array of warp sums: one barrier per row). Rows whose length is not a multiple of V, misaligned
  pointers and rows too long for registers (d / V > 4096) take ``rms_generic<T>`` (warp per row, scalar
  loads, x read twice).
* rotary (``rotary_kernel<T, V>``): a block of ``ROTARY_THREADS`` takes a chunk of ``tb`` tokens
  (tb * h * half / V <= ``ROTARY_PAIRS_PER_BLOCK`` pair vectors: 2 per thread, 4 at most in flight);
  it issues its loads of x1 and x2 (16 bytes each) first, then builds the chunk's cos/sin table in shared
  memory (a thread per V consecutive frequencies of a token: inv_freq = exp2(-i * 2 log2(theta) / dh),
  then a running product, rope scaling applied to each (``fk_rope_scale``), and the angle in double; the
  angle reduced to [-pi, pi] in double, then ``sincosf``), one barrier, then rotates and stores. In-chunk
  indices are 32-bit, divided by multiply-high constants from the host (``fastdiv``). The vector variant
  needs half % V == 0. A 4-D tile (t, hk, r, dh) is (t, hk * r, dh) in memory.
* embed (``embed_kernel<E>``): one block per gathered row (grid-stride over rows), row copied with the
  widest word E in {16, 8, 4, 2} bytes that divides the row and both pointers, 4 words in flight.

Importing this module needs numpy only (through the package's ``__init__``); CuPy and numba are imported
lazily, by ``fast_kernel``.
"""

from __future__ import annotations

import ctypes
import math
import warnings
from dataclasses import dataclass, field

from cuda_kernels.launch import RawLaunch, raw_launch

__all__ = ["FastKernel", "Plan", "fast_kernel", "last_error", "OPS"]

OPS = ("rmsnorm", "rotary", "silu_mul", "silu", "mul", "scale", "add_n", "sum_into", "embed")
DTYPES = {"fp16": ("unsigned short", 2), "fp32": ("float", 4), "bf16": ("fk_bf16", 2)}
THREADS = 256  # block size of the elementwise and warp-per-row kernels
UNROLL = 4  # FK_U in the source: independent 16-byte accesses per thread (and per input) in flight
BLOCKS_PER_SM = 32  # elementwise grid-stride grids: at most this many 256-thread blocks per SM
ROW_BLOCKS_PER_SM = 32  # rmsnorm (block per row) and embed: at most this many blocks per SM
ROTARY_THREADS = 128
ROTARY_PAIRS_PER_BLOCK = 2 * ROTARY_THREADS  # tokens per chunk: as many as fit this many pair vectors
SMEM_LIMIT = 48 * 1024  # dynamic shared memory without cuFuncSetAttribute
RMS_WARP_MAX_VEC = 32 * 4  # rmsnorm: one warp per row up to this many vectors per row
RMS_BLOCK_MAX_VEC = 512 * 8  # rmsnorm: one block per row up to this; beyond, the generic kernel

# elementwise ops: op -> (OP code in the source, number of inputs; None: 2..4)
_EW = {"silu_mul": (0, 2), "silu": (1, 1), "mul": (2, 2), "scale": (3, 1), "add_n": (4, None), "sum_into": (4, 2)}
_EW_VARIANTS = ((0, 2), (1, 1), (2, 2), (3, 1), (4, 2), (4, 3), (4, 4))
_EMBED_WORDS = ((16, "uint4"), (8, "uint2"), (4, "unsigned int"), (2, "unsigned short"))

_SOURCE = r"""
// Fast memory-bound kernels of cuda_kernels/fast.py. No headers: fp16 is carried as its bit pattern
// (unsigned short) and converted with cvt, bf16 as its bit pattern in fk_bf16 (shift to float, cvt.rn back);
// everything else is an NVRTC builtin.
#define FK_U 4

struct fk_bf16 {
  unsigned short b;
};

__device__ __forceinline__ float fk_h2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short fk_f2h(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__device__ __forceinline__ float fk_b2f(unsigned short b) { return __uint_as_float((unsigned int)b << 16); }
__device__ __forceinline__ unsigned short fk_f2b(float f) {  // round to nearest even, NaN stays NaN
#if __CUDA_ARCH__ >= 800
  unsigned short b;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
  return b;
#else
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

template <class T> struct Cvt;
template <> struct Cvt<float> {
  static __device__ __forceinline__ float get(float v) { return v; }
  static __device__ __forceinline__ float put(float f) { return f; }
};
template <> struct Cvt<unsigned short> {
  static __device__ __forceinline__ float get(unsigned short v) { return fk_h2f(v); }
  static __device__ __forceinline__ unsigned short put(float f) { return fk_f2h(f); }
};
template <> struct Cvt<fk_bf16> {
  static __device__ __forceinline__ float get(fk_bf16 v) { return fk_b2f(v.b); }
  static __device__ __forceinline__ fk_bf16 put(float f) {
    fk_bf16 r;
    r.b = fk_f2b(f);
    return r;
  }
};

// V consecutive elements of T held in one register pack: a 16-byte uint4 (V = 16 / sizeof(T)) or one T.
template <class T, int V> struct Vec;
template <class T> struct Vec<T, 1> {
  typedef T raw;
  static __device__ __forceinline__ raw ld(const T* p) { return __ldg(p); }
  static __device__ __forceinline__ void st(T* p, raw v) { *p = v; }
  static __device__ __forceinline__ void unpack(raw v, float* f) { f[0] = Cvt<T>::get(v); }
  static __device__ __forceinline__ raw pack(const float* f) { return Cvt<T>::put(f[0]); }
};
template <> struct Vec<float, 4> {
  typedef uint4 raw;
  static __device__ __forceinline__ raw ld(const float* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
  static __device__ __forceinline__ void st(float* p, raw v) { *reinterpret_cast<uint4*>(p) = v; }
  static __device__ __forceinline__ void unpack(raw v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
  static __device__ __forceinline__ raw pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};
template <> struct Vec<unsigned short, 8> {
  typedef uint4 raw;
  static __device__ __forceinline__ raw ld(const unsigned short* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
  static __device__ __forceinline__ void st(unsigned short* p, raw v) { *reinterpret_cast<uint4*>(p) = v; }
  static __device__ __forceinline__ void unpack2(unsigned int w, float* f) {
    f[0] = fk_h2f((unsigned short)(w & 0xffffu));
    f[1] = fk_h2f((unsigned short)(w >> 16));
  }
  static __device__ __forceinline__ unsigned int pack2(const float* f) {
    return (unsigned int)fk_f2h(f[0]) | ((unsigned int)fk_f2h(f[1]) << 16);
  }
  static __device__ __forceinline__ void unpack(raw v, float* f) {
    unpack2(v.x, f); unpack2(v.y, f + 2); unpack2(v.z, f + 4); unpack2(v.w, f + 6);
  }
  static __device__ __forceinline__ raw pack(const float* f) {
    return make_uint4(pack2(f), pack2(f + 2), pack2(f + 4), pack2(f + 6));
  }
};
template <> struct Vec<fk_bf16, 1> {  // __ldg has no overload for the struct: load its bits
  typedef fk_bf16 raw;
  static __device__ __forceinline__ raw ld(const fk_bf16* p) {
    fk_bf16 r;
    r.b = __ldg(reinterpret_cast<const unsigned short*>(p));
    return r;
  }
  static __device__ __forceinline__ void st(fk_bf16* p, raw v) { *p = v; }
  static __device__ __forceinline__ void unpack(raw v, float* f) { f[0] = fk_b2f(v.b); }
  static __device__ __forceinline__ raw pack(const float* f) { return Cvt<fk_bf16>::put(f[0]); }
};
template <> struct Vec<fk_bf16, 8> {
  typedef uint4 raw;
  static __device__ __forceinline__ raw ld(const fk_bf16* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
  static __device__ __forceinline__ void st(fk_bf16* p, raw v) { *reinterpret_cast<uint4*>(p) = v; }
  static __device__ __forceinline__ void unpack2(unsigned int w, float* f) {
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
  }
  static __device__ __forceinline__ unsigned int pack2(const float* f) {
    return (unsigned int)fk_f2b(f[0]) | ((unsigned int)fk_f2b(f[1]) << 16);
  }
  static __device__ __forceinline__ void unpack(raw v, float* f) {
    unpack2(v.x, f); unpack2(v.y, f + 2); unpack2(v.z, f + 4); unpack2(v.w, f + 6);
  }
  static __device__ __forceinline__ raw pack(const float* f) {
    return make_uint4(pack2(f), pack2(f + 2), pack2(f + 4), pack2(f + 6));
  }
};

__device__ __forceinline__ long long fk_min(long long a, long long b) { return a < b ? a : b; }

__device__ __forceinline__ float fk_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---------------------------------------------------------------- elementwise

__device__ __forceinline__ float fk_silu(float g) { return g / (1.0f + expf(-g)); }

// OP: 0 silu_mul, 1 silu, 2 mul, 3 scale, 4 add (NIN inputs, summed in order)
template <int OP, int NIN>
__device__ __forceinline__ float ew_apply(const float* v, float alpha) {
  if constexpr (OP == 0) {
    return fk_silu(v[0]) * v[1];
  } else if constexpr (OP == 1) {
    return fk_silu(v[0]);
  } else if constexpr (OP == 2) {
    return v[0] * v[1];
  } else if constexpr (OP == 3) {
    return v[0] * alpha;
  } else {
    float acc = v[0] + v[1];
    if constexpr (NIN > 2) acc += v[2];
    if constexpr (NIN > 3) acc += v[3];
    return acc;
  }
}

template <class T, int V, int OP, int NIN>
__device__ __forceinline__ void ew_one(T* out, const T* const* in, long long e, float alpha) {
  typedef Vec<T, V> W;
  typename W::raw r[NIN];
#pragma unroll
  for (int q = 0; q < NIN; ++q) r[q] = W::ld(in[q] + e);
  float f[NIN][V];
#pragma unroll
  for (int q = 0; q < NIN; ++q) W::unpack(r[q], f[q]);
  float o[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int q = 0; q < NIN; ++q) v[q] = f[q][j];
    o[j] = ew_apply<OP, NIN>(v, alpha);
  }
  W::st(out + e, W::pack(o));
}

// out[i] = op(a0[i], ..); n elements; V = 16 / sizeof(T) (every pointer 16-byte aligned) or 1.
// No __restrict__: sum_into runs with out == a0 (each thread reads its elements before writing them).
template <class T, int V, int OP, int NIN>
__global__ void __launch_bounds__(256) ew_kernel(T* out, const T* a0, const T* a1, const T* a2, const T* a3,
                                                 long long n, float alpha) {
  typedef Vec<T, V> W;
  const T* in[4] = {a0, a1, a2, a3};
  const long long nv = n / V;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long i = tid;
  for (; i + (FK_U - 1) * stride < nv; i += FK_U * stride) {
    typename W::raw r[NIN][FK_U];
#pragma unroll
    for (int k = 0; k < FK_U; ++k)
#pragma unroll
      for (int q = 0; q < NIN; ++q) r[q][k] = W::ld(in[q] + (i + k * stride) * V);
#pragma unroll
    for (int k = 0; k < FK_U; ++k) {
      float f[NIN][V];
#pragma unroll
      for (int q = 0; q < NIN; ++q) W::unpack(r[q][k], f[q]);
      float o[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int q = 0; q < NIN; ++q) v[q] = f[q][j];
        o[j] = ew_apply<OP, NIN>(v, alpha);
      }
      W::st(out + (i + k * stride) * V, W::pack(o));
    }
  }
  for (; i < nv; i += stride) ew_one<T, V, OP, NIN>(out, in, i * V, alpha);
  if constexpr (V > 1) {
    for (long long e = nv * V + tid; e < n; e += stride) ew_one<T, 1, OP, NIN>(out, in, e, alpha);
  }
}

// ---------------------------------------------------------------- rmsnorm

// One warp per row, row in registers: VPT vectors of V = 16 / sizeof(T) elements per lane (d % V == 0,
// d / V <= 32 * VPT, x, w, out 16-byte aligned).
template <class T, int VPT>
__global__ void __launch_bounds__(256) rms_warp(T* __restrict__ out, const T* __restrict__ x,
                                                const T* __restrict__ w, long long rows, long long d, float eps) {
  constexpr int V = 16 / sizeof(T);
  typedef Vec<T, V> W;
  typedef typename W::raw R;
  const int lane = threadIdx.x & 31;
  const long long nvec = d / V;
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarp = ((long long)gridDim.x * blockDim.x) >> 5;
  R wr[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const long long j = lane + 32 * k;
    if (j < nvec) wr[k] = W::ld(w + j * V);
  }
  for (long long r = warp; r < rows; r += nwarp) {
    const T* xr = x + r * d;
    T* orow = out + r * d;
    R xv[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const long long j = lane + 32 * k;
      if (j < nvec) xv[k] = W::ld(xr + j * V);
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const long long j = lane + 32 * k;
      if (j < nvec) {
        float f[V];
        W::unpack(xv[k], f);
#pragma unroll
        for (int e = 0; e < V; ++e) ss = fmaf(f[e], f[e], ss);
      }
    }
    ss = fk_warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const long long j = lane + 32 * k;
      if (j < nvec) {
        float f[V], g[V];
        W::unpack(xv[k], f);
        W::unpack(wr[k], g);
#pragma unroll
        for (int e = 0; e < V; ++e) f[e] = f[e] * inv * g[e];
        W::st(orow + j * V, W::pack(f));
      }
    }
  }
}

// One block (a multiple of 32 threads, <= 512) per row, row in registers: VPT vectors per thread.
template <class T, int VPT>
__global__ void __launch_bounds__(512) rms_block(T* __restrict__ out, const T* __restrict__ x,
                                                 const T* __restrict__ w, long long rows, long long d, float eps) {
  constexpr int V = 16 / sizeof(T);
  typedef Vec<T, V> W;
  typedef typename W::raw R;
  __shared__ float red[2][32];
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
  const long long nvec = d / V;
  R wr[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const long long j = tid + (long long)blockDim.x * k;
    if (j < nvec) wr[k] = W::ld(w + j * V);
  }
  int par = 0;
  for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    T* orow = out + r * d;
    R xv[VPT];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const long long j = tid + (long long)blockDim.x * k;
      if (j < nvec) xv[k] = W::ld(xr + j * V);
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const long long j = tid + (long long)blockDim.x * k;
      if (j < nvec) {
        float f[V];
        W::unpack(xv[k], f);
#pragma unroll
        for (int e = 0; e < V; ++e) ss = fmaf(f[e], f[e], ss);
      }
    }
    ss = fk_warp_sum(ss);
    if (lane == 0) red[par][wid] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int q = 0; q < nw; ++q) tot += red[par][q];
    par ^= 1;  // the next row writes the other buffer: no second barrier needed
    const float inv = 1.0f / sqrtf(tot / (float)d + eps);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const long long j = tid + (long long)blockDim.x * k;
      if (j < nvec) {
        float f[V], g[V];
        W::unpack(xv[k], f);
        W::unpack(wr[k], g);
#pragma unroll
        for (int e = 0; e < V; ++e) f[e] = f[e] * inv * g[e];
        W::st(orow + j * V, W::pack(f));
      }
    }
  }
}

// Any d, any (element-aligned) pointers: one warp per row, scalar loads, x read twice.
template <class T>
__global__ void __launch_bounds__(256) rms_generic(T* out, const T* x, const T* w, long long rows, long long d,
                                                   float eps) {
  const int lane = threadIdx.x & 31;
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long nwarp = ((long long)gridDim.x * blockDim.x) >> 5;
  for (long long r = warp; r < rows; r += nwarp) {
    const T* xr = x + r * d;
    T* orow = out + r * d;
    float ss = 0.f;
    for (long long j = lane; j < d; j += 32) {
      const float f = Cvt<T>::get(Vec<T, 1>::ld(xr + j));
      ss = fmaf(f, f, ss);
    }
    ss = fk_warp_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (long long j = lane; j < d; j += 32) {
      const float f = Cvt<T>::get(Vec<T, 1>::ld(xr + j));
      orow[j] = Cvt<T>::put(f * inv * Cvt<T>::get(Vec<T, 1>::ld(w + j)));
    }
  }
}

// ---------------------------------------------------------------- rotary

// n / d for n < 2^31 by multiply-high and shift (md = m | shift << 32 from the host; m == 0: d == 1).
__device__ __forceinline__ unsigned fk_div(unsigned n, unsigned long long md) {
  const unsigned m = (unsigned)md;
  return m ? (__umulhi(n, m) >> (unsigned)(md >> 32)) : n;
}

// LLaMA-3 rope scaling of one frequency (turnip.reference.rope_inv_freq), in double: wavelengths longer than
// orig / low divided by factor, shorter than orig / high kept, those between blended.
__device__ __forceinline__ double fk_rope_scale(double inv, double factor, double low, double high, double orig) {
  const double wl = 6.283185307179586 / inv;
  if (wl > orig / low) return inv / factor;
  if (wl < orig / high) return inv;
  const double smooth = (orig / wl - low) / (high - low);
  return (1.0 - smooth) * inv / factor + smooth * inv;
}

// x, out (ntok, nh, 2 * half). A block takes tb tokens at a time; pair vector p (V elements of x1 and
// the matching V of x2) -> q = p / hv = token-in-chunk * nh + head, iv = p % hv. Dynamic shared memory:
// the chunk's cos[tb * half] and sin[tb * half] (float). A thread builds V consecutive entries of one
// token: inv_freq_i0 = theta^(-2 i0 / dh) = exp2(-i0 * step) (step = 2 log2(theta) / dh, from the host),
// the next ones times exp2(-step), all in double; angle in double, reduced to [-pi, pi] in double, then
// sincosf. div_hv, div_nh: fk_div constants of hv = half / V and nh. rope_factor != 0: each inv_freq goes
// through fk_rope_scale (rope_low, rope_high, rope_orig) before it multiplies the position.
template <class T, int V>
__global__ void __launch_bounds__(256) rotary_kernel(T* out, const T* x, long long ntok, long long nh, long long half,
                                                     long long tb, long long pos_off, double step, long long div_hv,
                                                     long long div_nh, double rope_factor, double rope_low,
                                                     double rope_high, double rope_orig) {
  typedef Vec<T, V> W;
  typedef typename W::raw R;
  extern __shared__ float rot_smem[];
  float* s_cos = rot_smem;
  float* s_sin = rot_smem + tb * half;
  // in-chunk indices are 32-bit: the host keeps tb * nh * dh < 2^31
  const unsigned tid = threadIdx.x, nthr = blockDim.x;
  const unsigned uhalf = (unsigned)half, dh = 2u * uhalf, hv = uhalf / V;
  const unsigned per_tok = (unsigned)nh * hv;
  const unsigned long long dhv = (unsigned long long)div_hv, dnh = (unsigned long long)div_nh;
  const double ratio = exp2(-step);
  const long long nchunk = (ntok + tb - 1) / tb;
  for (long long c = blockIdx.x; c < nchunk; c += gridDim.x) {
    const long long t0 = c * tb;
    const unsigned ntc = (unsigned)fk_min(tb, ntok - t0);
    const unsigned npair = ntc * per_tok;
    const T* xc = x + t0 * nh * (long long)dh;
    T* oc = out + t0 * nh * (long long)dh;
    R a[FK_U], b[FK_U];
    unsigned off[FK_U], tix[FK_U];
    auto load = [&](unsigned p0) {
#pragma unroll
      for (int k = 0; k < FK_U; ++k) {
        const unsigned p = p0 + tid + k * nthr;
        if (p < npair) {
          const unsigned q = fk_div(p, dhv);
          const unsigned iv = p - q * hv;
          off[k] = p * V + q * uhalf;  // q * dh + iv * V
          tix[k] = fk_div(q, dnh) * uhalf + iv * V;
          a[k] = W::ld(xc + off[k]);
          b[k] = W::ld(xc + off[k] + uhalf);
        }
      }
    };
    load(0);  // loads in flight while the table is built
    for (unsigned g = tid; g < ntc * hv; g += nthr) {
      const unsigned tk = fk_div(g, dhv);
      const unsigned i0 = (g - tk * hv) * V;
      const double pos = (double)(pos_off + t0 + tk);
      double inv = exp2(-(double)i0 * step);
      float cs[V], sn[V];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const double ang =
            pos * (rope_factor != 0.0 ? fk_rope_scale(inv, rope_factor, rope_low, rope_high, rope_orig) : inv);
        const double kq = rint(ang * 0.15915494309189535);  // 1 / (2 pi)
        double rr = fma(-kq, 6.283185307179586, ang);       // 2 pi = hi + lo (Cody-Waite)
        rr = fma(-kq, 2.4492935982947064e-16, rr);
        sincosf((float)rr, &sn[e], &cs[e]);
        inv *= ratio;
      }
      float* pc = s_cos + tk * uhalf + i0;
      float* ps = s_sin + tk * uhalf + i0;
      if constexpr (V % 4 == 0) {
#pragma unroll
        for (int e = 0; e < V; e += 4) {
          *reinterpret_cast<float4*>(pc + e) = make_float4(cs[e], cs[e + 1], cs[e + 2], cs[e + 3]);
          *reinterpret_cast<float4*>(ps + e) = make_float4(sn[e], sn[e + 1], sn[e + 2], sn[e + 3]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) {
          pc[e] = cs[e];
          ps[e] = sn[e];
        }
      }
    }
    __syncthreads();
    for (unsigned p0 = 0; p0 < npair; p0 += FK_U * nthr) {
      if (p0 > 0) load(p0);
#pragma unroll
      for (int k = 0; k < FK_U; ++k) {
        const unsigned p = p0 + tid + k * nthr;
        if (p < npair) {
          float f1[V], f2[V], o1[V], o2[V], cs[V], sn[V];
          W::unpack(a[k], f1);
          W::unpack(b[k], f2);
          if constexpr (V % 4 == 0) {  // 16-byte shared loads (tix and tb * half are multiples of V)
#pragma unroll
            for (int e = 0; e < V; e += 4) {
              const float4 c4 = *reinterpret_cast<const float4*>(s_cos + tix[k] + e);
              const float4 s4 = *reinterpret_cast<const float4*>(s_sin + tix[k] + e);
              cs[e] = c4.x; cs[e + 1] = c4.y; cs[e + 2] = c4.z; cs[e + 3] = c4.w;
              sn[e] = s4.x; sn[e + 1] = s4.y; sn[e + 2] = s4.z; sn[e + 3] = s4.w;
            }
          } else {
#pragma unroll
            for (int e = 0; e < V; ++e) {
              cs[e] = s_cos[tix[k] + e];
              sn[e] = s_sin[tix[k] + e];
            }
          }
#pragma unroll
          for (int e = 0; e < V; ++e) {
            o1[e] = f1[e] * cs[e] - f2[e] * sn[e];
            o2[e] = f2[e] * cs[e] + f1[e] * sn[e];
          }
          W::st(oc + off[k], W::pack(o1));
          W::st(oc + off[k] + uhalf, W::pack(o2));
        }
      }
    }
    __syncthreads();  // the table is rewritten by the next chunk
  }
}

// ---------------------------------------------------------------- embed

// out[r, :] = table[ids[r], :], rows of n words E (E divides the row's bytes and both pointers).
template <class E>
__global__ void __launch_bounds__(256) embed_kernel(E* __restrict__ out, const int* __restrict__ ids,
                                                    const E* __restrict__ table, long long t, long long n,
                                                    long long vocab) {
  const long long bs = blockDim.x;
  for (long long r = blockIdx.x; r < t; r += gridDim.x) {
    long long id = __ldg(ids + r);
    if (id < 0) id += vocab;
    id = id < 0 ? 0 : (id >= vocab ? vocab - 1 : id);
    const E* src = table + id * n;
    E* dst = out + r * n;
    long long j = threadIdx.x;
    for (; j + 3 * bs < n; j += 4 * bs) {
      const E v0 = __ldg(src + j), v1 = __ldg(src + j + bs), v2 = __ldg(src + j + 2 * bs),
              v3 = __ldg(src + j + 3 * bs);
      dst[j] = v0;
      dst[j + bs] = v1;
      dst[j + 2 * bs] = v2;
      dst[j + 3 * bs] = v3;
    }
    for (; j < n; j += bs) dst[j] = __ldg(src + j);
  }
}
"""

# C parameter lists of the kernels above, as the ctypes each bound launch packs ('p' pointer, 'q' int64,
# 'f' float, 'd' double); tests check these against the source.
SIGNATURES = {
    "ew_kernel": "pppppqf",
    "rms_warp": "pppqqf",
    "rms_block": "pppqqf",
    "rms_generic": "pppqqf",
    "rotary_kernel": "ppqqqqqdqqdddd",
    "embed_kernel": "pppqqq",
}


def _vec(dtype: str) -> int:
    return 16 // DTYPES[dtype][1]


def kernel_names() -> list[str]:
    """Every instantiation the module compiles (its name expressions)."""
    names = []
    for dtype, (t, _) in DTYPES.items():
        v = _vec(dtype)
        for code, nin in _EW_VARIANTS:
            names += [f"ew_kernel<{t}, {vv}, {code}, {nin}>" for vv in (v, 1)]
        names += [f"rms_warp<{t}, {k}>" for k in (1, 2, 4)]
        names += [f"rms_block<{t}, {k}>" for k in (1, 2, 4, 8)]
        names += [f"rms_generic<{t}>", f"rotary_kernel<{t}, {v}>", f"rotary_kernel<{t}, 1>"]
    names += [f"embed_kernel<{e}>" for _, e in _EMBED_WORDS]
    return names


# ---------------------------------------------------------------- module (one per device)

# "module": compiled once (whether the kernels are available at all); "modules" and "funcs": per device, since
# a function handle is valid in its own device's context only (one module object per device, whatever CuPy
# caches per device itself)
_STATE: dict = {"module": None, "error": None, "sms": None, "modules": {}, "funcs": {}}


def last_error() -> str | None:
    """Why the fast kernels are unavailable (import or compile error), if they are."""
    return _STATE["error"]


def _cupy():
    import cupy

    return cupy


def _new_module(cp):
    """The kernels' CuPy module (compiled on first use; loaded on the device current when first used)."""
    return cp.RawModule(code=_SOURCE, options=("-std=c++17",), name_expressions=kernel_names())


def _ensure_module() -> bool:
    """Compile the module (once) and read the SM count; False (reason in ``last_error()``) if impossible."""
    if _STATE["module"] is not None:
        return True
    if _STATE["error"] is not None:
        return False
    try:
        cp = _cupy()
    except Exception as e:  # noqa: BLE001 - any import failure means: no fast kernels
        _STATE["error"] = f"cupy not importable: {e!r}"
        return False
    try:
        sms = int(cp.cuda.Device().attributes["MultiProcessorCount"])
        mod = _new_module(cp)
        mod.compile()
        from cuda_kernels.launch import current_device

        dev = current_device()
    except Exception as e:  # noqa: BLE001 - no device, no NVRTC, or a compile error
        _STATE["error"] = f"fast kernels unavailable: {type(e).__name__}: {e}"
        warnings.warn(_STATE["error"], stacklevel=3)
        return False
    _STATE["module"], _STATE["sms"] = mod, sms
    _STATE["modules"][dev] = mod
    return True


def _function(name: str) -> int:
    """CUfunction handle (int) of one instantiation on the current device (a module of its own per device,
    made there on first use)."""
    from cuda_kernels.launch import current_device

    dev = current_device()
    f = _STATE["funcs"].get((dev, name))
    if f is None:
        mods = _STATE["modules"]
        if dev not in mods:
            mods[dev] = _new_module(_cupy())
        f = int(mods[dev].get_function(name).kernel.ptr)
        _STATE["funcs"][(dev, name)] = f
    return f


def _sm_count() -> int:
    return int(_STATE["sms"] or 132)


# ---------------------------------------------------------------- planning (pure: no CuPy)


@dataclass(frozen=True)
class Plan:
    """One bound launch before packing: kernel name, geometry and typed arguments."""

    name: str
    grid: tuple
    block: tuple
    shmem: int
    args: tuple  # ctypes values in the kernel's parameter order
    vector: bool  # the 16-byte variant (embed: words wider than one element)


def _p(ptr: int) -> ctypes.c_void_p:
    return ctypes.c_void_p(int(ptr))


def _q(v: int) -> ctypes.c_int64:
    return ctypes.c_int64(int(v))


def _pow2ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass
class FastKernel:
    """A covered op instance; ``bind`` fixes the pointers and returns a ``RawLaunch``."""

    op: str
    in_shapes: list
    out_shape: tuple
    dtype: str
    params: dict = field(default_factory=dict)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def ctype(self) -> str:
        return DTYPES[self.dtype][0]

    def nbytes(self) -> int:
        """Bytes moved by one launch: every input once (embed: ids + gathered rows) + the output."""
        out = math.prod(self.out_shape) * self.itemsize
        if self.op == "embed":
            return self.in_shapes[0][0] * 4 + 2 * out
        return out + sum(math.prod(s) for s in self.in_shapes) * self.itemsize

    def bind(self, out_ptr: int, in_ptrs: list[int]) -> RawLaunch:
        p = self.plan(out_ptr, in_ptrs)
        return raw_launch(_function(p.name), p.grid, p.block, list(p.args), p.shmem)

    def plan(self, out_ptr: int, in_ptrs: list[int]) -> Plan:
        """Variant, geometry and arguments for these device pointers (no device access)."""
        in_ptrs = [int(x) for x in in_ptrs]
        out_ptr = int(out_ptr)
        if len(in_ptrs) != len(self.in_shapes):
            raise ValueError(f"{self.op}: {len(in_ptrs)} input pointers for {len(self.in_shapes)} inputs")
        isz = self.itemsize
        data = [out_ptr] + (in_ptrs[1:] if self.op == "embed" else in_ptrs)
        if any(x % isz for x in data) or (self.op == "embed" and in_ptrs[0] % 4):
            raise ValueError(f"{self.op}: pointers must be aligned to their element size")
        return getattr(self, f"_plan_{'ew' if self.op in _EW else self.op}")(out_ptr, in_ptrs)

    # --- per op

    def _plan_ew(self, out_ptr, in_ptrs) -> Plan:
        code = _EW[self.op][0]
        nin = len(in_ptrs)
        n = math.prod(self.out_shape)
        vec = all(x % 16 == 0 for x in [out_ptr, *in_ptrs])
        v = _vec(self.dtype) if vec else 1
        nv = n // v
        chunks = max(1, math.ceil(nv / (THREADS * UNROLL)))  # blocks if each thread did one U-iteration
        cap = _sm_count() * BLOCKS_PER_SM
        iters = math.ceil(chunks / cap)
        grid = max(1, math.ceil(chunks / iters))
        ptrs = (in_ptrs + [0] * 4)[:4]
        args = (_p(out_ptr), *map(_p, ptrs), _q(n), ctypes.c_float(float(self.params.get("alpha", 1.0))))
        return Plan(f"ew_kernel<{self.ctype}, {v}, {code}, {nin}>", (grid,), (THREADS,), 0, args, vec)

    def _plan_rmsnorm(self, out_ptr, in_ptrs) -> Plan:
        d = self.out_shape[-1]
        rows = math.prod(self.out_shape[:-1])
        v = _vec(self.dtype)
        nvec = d // v
        vec = d % v == 0 and nvec <= RMS_BLOCK_MAX_VEC and all(x % 16 == 0 for x in [out_ptr, *in_ptrs])
        args = (_p(out_ptr), _p(in_ptrs[0]), _p(in_ptrs[1]), _q(rows), _q(d),
                ctypes.c_float(float(self.params.get("eps", 1e-5))))
        sms = _sm_count()
        warps_per_block = THREADS // 32
        if vec and nvec <= RMS_WARP_MAX_VEC:
            vpt = _pow2ceil(math.ceil(nvec / 32))
            grid = min(math.ceil(rows / warps_per_block), sms * BLOCKS_PER_SM)
            return Plan(f"rms_warp<{self.ctype}, {vpt}>", (grid,), (THREADS,), 0, args, True)
        if vec:
            bs = 128 if nvec <= 512 else 256 if nvec <= 1024 else 512
            vpt = _pow2ceil(math.ceil(nvec / bs))
            grid = min(rows, sms * ROW_BLOCKS_PER_SM)
            return Plan(f"rms_block<{self.ctype}, {vpt}>", (grid,), (bs,), 0, args, True)
        grid = min(math.ceil(rows / warps_per_block), sms * BLOCKS_PER_SM)
        return Plan(f"rms_generic<{self.ctype}>", (grid,), (THREADS,), 0, args, False)

    def _plan_rotary(self, out_ptr, in_ptrs) -> Plan:
        t, h, dh = self.out_shape[0], math.prod(self.out_shape[1:-1]), self.out_shape[-1]
        half = dh // 2
        vec = half % _vec(self.dtype) == 0 and out_ptr % 16 == 0 and in_ptrs[0] % 16 == 0
        v = _vec(self.dtype) if vec else 1
        per_tok = h * (half // v)
        tb = max(1, min(t, ROTARY_PAIRS_PER_BLOCK // per_tok, _rotary_tb_smem(half)))
        shmem = 8 * tb * half
        nchunk = math.ceil(t / tb)
        grid = min(nchunk, _sm_count() * BLOCKS_PER_SM)  # one block per chunk on 7B tiles
        args = (_p(out_ptr), _p(in_ptrs[0]), _q(t), _q(h), _q(half), _q(tb), _q(int(self.params.get("pos_off", 0))),
                ctypes.c_double(2.0 * math.log2(float(self.params.get("theta", 10000.0))) / dh),
                _q(fastdiv(half // v)), _q(fastdiv(h)), *map(ctypes.c_double, rope_params(self.params)))
        return Plan(f"rotary_kernel<{self.ctype}, {v}>", (grid,), (ROTARY_THREADS,), shmem, args, vec)

    def _plan_embed(self, out_ptr, in_ptrs) -> Plan:
        t = self.in_shapes[0][0]
        vocab, d = self.in_shapes[1]
        row = d * self.itemsize
        wb, word = next((b, w) for b, w in _EMBED_WORDS if row % b == 0 and out_ptr % b == 0 and in_ptrs[1] % b == 0)
        n = row // wb
        bs = min(THREADS, max(32, _pow2ceil(math.ceil(n / UNROLL))))
        grid = min(t, _sm_count() * ROW_BLOCKS_PER_SM)
        args = (_p(out_ptr), _p(in_ptrs[0]), _p(in_ptrs[1]), _q(t), _q(n), _q(vocab))
        return Plan(f"embed_kernel<{word}>", (grid,), (bs,), 0, args, wb > self.itemsize)


def fastdiv(d: int) -> int:
    """Constants of ``fk_div`` (n // d for 0 <= n < 2**31): multiplier | shift << 32; 0 for d == 1."""
    if d == 1:
        return 0
    p = 31 + (d - 1).bit_length()  # 31 + ceil(log2 d)
    return ((1 << p) + d - 1) // d | (p - 32) << 32


def rope_params(params: dict) -> tuple[float, float, float, float]:
    """(factor, low, high, orig) of LLaMA-3 rope scaling (``turnip.reference.rope_inv_freq``: params
    ``rope_factor``, ``rope_low``, ``rope_high``, ``rope_orig``); all 0 when ``rope_factor`` is absent or
    falsy (plain theta^(-2i/dh)). ``KeyError`` if a factor comes without the other three."""
    factor = params.get("rope_factor")
    if not factor:
        return (0.0, 0.0, 0.0, 0.0)
    return (float(factor), float(params["rope_low"]), float(params["rope_high"]), float(params["rope_orig"]))


def _rotary_tb_smem(half: int) -> int:
    """Most tokens per chunk whose cos/sin table fits in SMEM_LIMIT (0: not even one)."""
    return SMEM_LIMIT // (8 * half)


def _build(op: str, in_shapes, out_shape, dtype: str, params: dict | None) -> FastKernel | None:
    """Shape and parameter checks only (no CuPy): the ``FastKernel`` or None where not covered."""
    params = dict(params or {})
    try:
        in_shapes = [tuple(int(e) for e in s) for s in in_shapes]
        out_shape = tuple(int(e) for e in out_shape)
    except (TypeError, ValueError):
        return None
    if op not in OPS or dtype not in DTYPES or not in_shapes or math.prod(out_shape) == 0:
        return None
    if any(e < 0 for s in [out_shape, *in_shapes] for e in s):
        return None
    fk = FastKernel(op, in_shapes, out_shape, dtype, params)
    if op in _EW:
        nin = _EW[op][1]
        if not (2 <= len(in_shapes) <= 4 if nin is None else len(in_shapes) == nin):
            return None
        if any(s != out_shape for s in in_shapes):
            return None
        if op == "scale" and "alpha" not in params:
            return None
        return fk
    if op == "rmsnorm":  # weights offset (Gemma's 1 + w): the numba row kernel takes it
        ok = (len(in_shapes) == 2 and len(out_shape) >= 1 and in_shapes[0] == out_shape
              and in_shapes[1] == (out_shape[-1],) and not params.get("offset"))
        return fk if ok else None
    if op == "rotary":
        if params.get("inverse", False):  # rotary's backward (minus the angle): the numba kernel takes it
            return None
        try:
            rope_params(params)
        except (KeyError, TypeError, ValueError):
            return None
        ok = (len(in_shapes) == 1 and len(out_shape) >= 3 and in_shapes[0] == out_shape
              and out_shape[-1] % 2 == 0 and _rotary_tb_smem(out_shape[-1] // 2) >= 1
              and math.prod(out_shape[1:]) * ROTARY_PAIRS_PER_BLOCK < 2**31)  # 32-bit in-chunk indices
        return fk if ok else None
    if op == "embed":
        ok = (len(in_shapes) == 2 and len(in_shapes[0]) == 1 and len(in_shapes[1]) == 2 and in_shapes[1][0] > 0
              and out_shape == (in_shapes[0][0], in_shapes[1][1]))
        return fk if ok else None
    return None


def fast_kernel(op: str, in_shapes: list[tuple], out_shape: tuple, dtype: str, params: dict) -> FastKernel | None:
    """The fast kernel of one op instance, or None (no CuPy / device, simulator, or not covered)."""
    from cuda_kernels import _numba

    if _numba.simulating():
        return None
    fk = _build(op, in_shapes, out_shape, dtype, params)
    if fk is None or not _ensure_module():
        return None
    return fk
