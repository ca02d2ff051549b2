"""The optimizers on device arrays, bit for bit the native kernels'.

The formulas are those of rust/embstore-core/src/simd/kernels.rs, written
as the same float32 operations in the same order (no fused multiply-add,
row sums accumulated column by column as the kernel's loop does), and the
per-step constants are the core's own (``_core.optimizer_constants``, the
float32 values of ``Optimizer::step_consts``). So on NumPy a cached row
equals the table's bit for bit (tests/test_device_optim.py, rtol=0, every
optimizer); other array libraries follow IEEE float32 the same way.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from embstore import _core, optim

Array = Any


def constants(opt: optim.Optimizer, t: int) -> dict[str, float]:
    """The core's float32 constants of step ``t`` of ``opt``."""
    name, params = opt._native()
    return _core.optimizer_constants(name, params, max(1, int(t)))


def step(
    xp: ModuleType, opt: optim.Optimizer, w: Array, st: Array, g: Array, t: int
) -> tuple[Array, Array]:
    """One step on rows ``w`` (n, dim) with state ``st`` (n, state_len) and
    summed gradients ``g`` (n, dim) at optimizer step ``t``; new (w, st)."""
    dim = int(w.shape[1])
    c = {k: xp.asarray(v, dtype=xp.float32) for k, v in constants(opt, t).items()}

    if float(c["weight_decay"]) != 0.0:  # coupled L2, as the core: g + weight_decay * w
        g = g + c["weight_decay"] * w
    if isinstance(opt, optim.SGD):
        return w - c["lr"] * g, st
    if isinstance(opt, optim.RowWiseAdagrad):
        # The kernel's loop: sq += g_j * g_j, column by column.
        sq = xp.zeros((int(w.shape[0]), 1), dtype=xp.float32)
        for j in range(dim):
            gj = g[:, j : j + 1]
            sq = sq + gj * gj
        h = st[:, 0:1] + sq / xp.asarray(dim, dtype=xp.float32)
        s = c["lr"] / (xp.sqrt(h) + c["eps"])
        return w - s * g, h
    if isinstance(opt, optim.Adagrad):
        h = st + g * g
        return w + (-c["lr"]) * (g / (xp.sqrt(h) + c["eps"])), h
    if isinstance(opt, optim.AdamW):
        m, v = st[:, :dim], st[:, dim:]
        w = w * c["decay"]
        m = m + (g - m) * c["one_minus_b1"]
        v = v * c["b2"] + c["one_minus_b2"] * (g * g)
        w = w + (-c["step_size"]) * (m / (xp.sqrt(v) / c["bc2_sqrt"] + c["eps"]))
        return w, xp.concat([m, v], axis=1)
    if isinstance(opt, optim.Adam):
        m, v = st[:, :dim], st[:, dim:]
        m = m + (g - m) * c["one_minus_b1"]
        v = v + (g * g - v) * c["one_minus_b2"]
        return w + (-c["step_size"]) * (m / (xp.sqrt(v) + c["eps"])), xp.concat([m, v], axis=1)
    if isinstance(opt, optim.Ftrl):
        lr, l1 = c["lr"], c["l1"]
        z, n = st[:, :dim], st[:, dim:]
        n_new = n + g * g
        sq = xp.sqrt(n_new)
        z = z + (g - (sq - xp.sqrt(n)) / lr * w)
        quadratic = sq / lr + c["l2_total"]
        signed_l1 = xp.where(z < 0, -l1, l1)
        w = xp.where(xp.abs(z) > l1, (signed_l1 - z) / quadratic, xp.asarray(0.0, dtype=xp.float32))
        return w, xp.concat([z, n_new], axis=1)
    raise TypeError(f"optimizer: {type(opt).__name__} has no device implementation")
