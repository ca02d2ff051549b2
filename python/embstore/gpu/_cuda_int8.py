"""CUDA kernels of a device cache's 8-bit rows (``gpu/_int8.py``), compiled
by CuPy at run time (NVRTC). Each equals the array code of ``_int8.py``
bit for bit (tests/test_device_cache_int8.py checks it on a GPU): every
float operation is an explicit round-to-nearest intrinsic, so the compiler
fuses no multiply-add the array code does not.

- ``int8_decode``: rows at slots (or all rows) as float32 weights, a thread
  a weight: ``offset + scale * code``, read from the stored row in place
  (the gather and the decode in one pass; the lookup's dequantization).
- ``int8_encode``: updated weights as stored rows, a warp a row: the row's
  range by shuffles, the rounding draws of each (key, step) made in the
  kernel from the key (the core's ``rounding_stream`` and
  ``rounding_draw``), the codes, scale and offset written in one pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Array = Any

_SOURCE = r"""
typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
#define FULL 0xffffffffu

__device__ __forceinline__ u64 mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

// Row r's weights as float32: out[i, c] = offset + scale * code, where r is
// slot[i] (or i where has_slot is 0). width: float32 words a stored row.
extern "C" __global__ void int8_decode(const float* __restrict__ rows,
                                       const i64* __restrict__ slot, int has_slot, i64 n,
                                       int dim, int width, float* __restrict__ out) {
    i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n * (i64)dim) return;
    i64 i = t / dim;
    int c = (int)(t - i * dim);
    i64 r = has_slot ? slot[i] : i;
    const float* w = rows + r * (i64)width;
    const unsigned char* codes = (const unsigned char*)w;
    int cw = width - 2;
    out[t] = __fadd_rn(w[cw + 1], __fmul_rn(w[cw], (float)codes[c]));
}

// Weights w (n, dim) as stored rows out (n, width): a warp a row. Draws
// u = lowbias32(base + c * 0x9E3779B9) >> 8, times 2^-24, with base the
// key's stream at this step (seedmix: the seed's mix; stepmix: step times
// the golden ratio); 0.5 everywhere where stochastic is 0.
extern "C" __global__ void int8_encode(const float* __restrict__ w,
                                       const i64* __restrict__ keys, i64 n, int dim,
                                       int width, u64 seedmix, u64 stepmix, int stochastic,
                                       float* __restrict__ out) {
    i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (row >= n) return;  // whole warps leave together
    const float* x = w + row * (i64)dim;
    float lo = x[0], hi = x[0];
    for (int c = lane; c < dim; c += 32) {
        lo = fminf(lo, x[c]);
        hi = fmaxf(hi, x[c]);
    }
    for (int s = 16; s; s >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(FULL, lo, s));
        hi = fmaxf(hi, __shfl_xor_sync(FULL, hi, s));
    }
    float scale = __fdiv_rn(__fsub_rn(hi, lo), 255.0f);
    bool flat = scale == 0.0f;
    float inv = __fdiv_rn(1.0f, flat ? 1.0f : scale);
    u32 base = 0;
    if (stochastic) {
        u64 st = mix(mix(seedmix ^ (u64)keys[row]) ^ stepmix);
        base = (u32)(st >> 32) ^ (u32)st;
    }
    float* o = out + row * (i64)width;
    unsigned char* codes = (unsigned char*)o;
    int cw = width - 2;
    for (int c = lane; c < 4 * cw; c += 32) {
        unsigned char q = 0;
        if (c < dim && !flat) {
            float u = 0.5f;
            if (stochastic) {
                u32 h = base + (u32)c * 0x9E3779B9u;
                h ^= h >> 16; h *= 0x7FEB352Du; h ^= h >> 15; h *= 0x846CA68Bu; h ^= h >> 16;
                u = (float)(h >> 8) * 5.9604644775390625e-08f;
            }
            float f = floorf(__fadd_rn(__fmul_rn(__fsub_rn(x[c], lo), inv), u));
            if (!(f >= 0.0f)) f = 0.0f;
            if (f > 255.0f) f = 255.0f;
            q = (unsigned char)f;
        }
        codes[c] = q;
    }
    if (lane == 0) {
        o[cw] = scale;
        o[cw + 1] = lo;
    }
}
"""

_THREADS = 256


class Int8Kernels:
    """The kernels, compiled once per process on first use."""

    _mod: Any = None

    def __init__(self) -> None:
        import cupy  # type: ignore[import-not-found, unused-ignore]

        if Int8Kernels._mod is None:
            Int8Kernels._mod = cupy.RawModule(code=_SOURCE, options=("--std=c++14",))
        self.cp = cupy
        self._decode = Int8Kernels._mod.get_function("int8_decode")
        self._encode = Int8Kernels._mod.get_function("int8_encode")

    def decode(self, rows: Array, slot: Array | None, dim: int) -> Array:
        """float32 ``(n, dim)``: ``rows[slot]`` (or all of ``rows``) decoded."""
        cp = self.cp
        rows = cp.ascontiguousarray(rows, dtype=cp.float32)
        n = int(rows.shape[0]) if slot is None else int(slot.shape[0])
        out = cp.empty((n, dim), dtype=cp.float32)
        total = n * dim
        if total:
            has = slot is not None
            s = cp.ascontiguousarray(slot if has else cp.empty((1,), cp.int64), dtype=cp.int64)
            grid = ((total + _THREADS - 1) // _THREADS,)
            width = np.int32(rows.shape[1])
            args = (rows, s, np.int32(has), np.int64(n), np.int32(dim), width, out)
            self._decode(grid, (_THREADS,), args)
        return out

    def encode(
        self, w: Array, keys: Array, width: int, seedmix: int, stepmix: int, stochastic: bool
    ) -> Array:
        """Stored rows ``(n, width)`` of the float32 weights ``w`` of ``keys``."""
        cp = self.cp
        w = cp.ascontiguousarray(w, dtype=cp.float32)
        n, dim = int(w.shape[0]), int(w.shape[1])
        out = cp.empty((n, width), dtype=cp.float32)
        if n:
            k = cp.ascontiguousarray(keys, dtype=cp.int64)
            grid = ((n * 32 + _THREADS - 1) // _THREADS,)
            args = (
                w,
                k,
                np.int64(n),
                np.int32(dim),
                np.int32(width),
                np.uint64(seedmix),
                np.uint64(stepmix),
                np.int32(int(stochastic)),
                out,
            )
            self._encode(grid, (_THREADS,), args)
        return out
