"""CSR bags whose ids and offsets are on the device (a
:class:`embstore.gpu.DeviceCache`'s pooled calls): checked there, and each
id's bag and coefficient ``w_i / d_bag`` computed there (equal to the core's
to float rounding)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from embstore.gpu import _xp as X

Array = Any


def bags_on_device(
    xp: ModuleType, ids_d: Array, off: Array, weights: Any, combiner: str
) -> tuple[Array, Array, Array, int]:
    """Checked ``off`` (int64 offsets of ``ids_d``, batch + 1 of them) and
    ``weights``; each id's bag, its coefficient under ``combiner`` (checked
    by the caller), and the batch."""
    n, nb = int(ids_d.shape[0]), int(off.shape[0])
    if nb == 0:
        raise ValueError(
            "offsets: expected batch + 1 >= 1 offsets (include_last_offset=True), "
            "got an empty array"
        )
    if int(off[0]) != 0 or int(off[-1]) != n or (nb > 1 and bool(xp.any(off[1:] < off[:-1]))):
        raise ValueError(f"offsets: expected non-decreasing offsets from 0 to len(ids) = {n}")
    w = None if weights is None else weights_on_device(xp, weights, n)
    batch = nb - 1
    bag_of = xp.searchsorted(off[1:], xp.arange(n, dtype=xp.int64), side="right")
    one = xp.ones((n,), dtype=xp.float32)
    wv = one if w is None else w
    if combiner == "sum":
        coef = wv
    else:
        sq = wv if combiner == "mean" else wv * wv
        denom = X.segment_sum(xp, bag_of, xp.reshape(sq, (-1, 1)), batch)[:, 0]
        if combiner == "sqrtn":
            denom = xp.sqrt(denom)
        d = xp.take(denom, bag_of)
        coef = xp.where(d == 0, xp.zeros_like(wv), wv / xp.where(d == 0, one, d))
    return ids_d, xp.astype(bag_of, xp.int64), coef, batch


def weights_on_device(xp: ModuleType, weights: Any, n: int) -> Array:
    """``weights`` as ``n`` finite float32 values on the device, checked."""
    w = weights if not isinstance(weights, np.ndarray) else xp.asarray(weights)
    if tuple(w.shape) != (n,) or not xp.isdtype(w.dtype, "real floating"):
        raise ValueError(f"weights: expected a float array of shape ({n},)")
    w = xp.astype(w, xp.float32)
    if not bool(xp.all(xp.isfinite(w))):
        raise ValueError("weights: expected finite values")
    return w
