"""The optimizers of DESIGN.md on device arrays: the same float32 formulas,
in the same order of operations, as the native kernels
(rust/embstore-core/src/simd/kernels.rs), with the same float64 step
constants rounded to float32."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

from embstore import optim

Array = Any


def step(
    xp: ModuleType, opt: optim.Optimizer, w: Array, st: Array, g: Array, t: int
) -> tuple[Array, Array]:
    """One step on rows ``w`` (n, dim) with state ``st`` (n, state_len) and
    summed gradients ``g`` (n, dim) at optimizer step ``t``; new (w, st)."""
    dim = int(w.shape[1])

    def f32(x: float) -> Array:
        return xp.asarray(x, dtype=xp.float32)

    t = min(t, 2**31 - 1)
    decay = 0.0 if isinstance(opt, optim.AdamW) else float(getattr(opt, "weight_decay", 0.0))
    if decay != 0.0:  # coupled L2, as the core: g + weight_decay * w
        g = g + f32(decay) * w
    if isinstance(opt, optim.SGD):
        return w - f32(opt.lr) * g, st
    if isinstance(opt, optim.RowWiseAdagrad):
        h = st[:, 0:1] + xp.sum(g * g, axis=1, keepdims=True) / f32(dim)
        s = f32(opt.lr) / (xp.sqrt(h) + f32(opt.eps))
        return w - s * g, h
    if isinstance(opt, optim.Adagrad):
        h = st + g * g
        return w + (-f32(opt.lr)) * (g / (xp.sqrt(h) + f32(opt.eps))), h
    if isinstance(opt, optim.AdamW):
        bc1 = 1.0 - opt.beta1**t
        bc2 = 1.0 - opt.beta2**t
        m, v = st[:, :dim], st[:, dim:]
        w = w * f32(1.0 - opt.lr * opt.weight_decay)
        m = m + (g - m) * f32(1.0 - opt.beta1)
        v = v * f32(opt.beta2) + f32(1.0 - opt.beta2) * (g * g)
        w = w + (-f32(opt.lr / bc1)) * (m / (xp.sqrt(v) / f32(math.sqrt(bc2)) + f32(opt.eps)))
        return w, xp.concat([m, v], axis=1)
    if isinstance(opt, optim.Adam):
        bc1 = 1.0 - opt.beta1**t
        bc2 = 1.0 - opt.beta2**t
        m, v = st[:, :dim], st[:, dim:]
        m = m + (g - m) * f32(1.0 - opt.beta1)
        v = v + (g * g - v) * f32(1.0 - opt.beta2)
        size = f32(opt.lr * math.sqrt(bc2) / bc1)
        return w + (-size) * (m / (xp.sqrt(v) + f32(opt.eps))), xp.concat([m, v], axis=1)
    if isinstance(opt, optim.Ftrl):
        lr, l1 = f32(opt.lr), f32(opt.l1)
        z, n = st[:, :dim], st[:, dim:]
        n_new = n + g * g
        sq = xp.sqrt(n_new)
        z = z + g - (sq - xp.sqrt(n)) / lr * w
        quadratic = sq / lr + f32(2.0 * opt.l2 + opt.beta / opt.lr)
        signed_l1 = xp.where(z < 0, -l1, l1)
        w = xp.where(xp.abs(z) > l1, (signed_l1 - z) / quadratic, f32(0.0))
        return w, xp.concat([z, n_new], axis=1)
    raise TypeError(f"optimizer: {type(opt).__name__} has no device implementation")
