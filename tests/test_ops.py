"""embstore.ops for rows pooled elsewhere, written in place: pooling into a
feature's columns of a shared output, and spreading a feature's columns of
shared gradients into a shared sum, equal the separate calls (and a NumPy
reference), and leave everything else as it was."""

from __future__ import annotations

import numpy as np
import pytest

from embstore import ops


def _bags(rng: np.random.Generator, batch: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    sizes = rng.integers(0, 5, batch)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return rng.integers(0, n, int(offsets[-1])).astype(np.int64), offsets


def test_pooling_into_columns_equals_pooling_alone_and_touches_no_other_column() -> None:
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((50, 4), dtype=np.float32)
    idx, offsets = _bags(rng, 30, 50)
    w = rng.random(idx.size, dtype=np.float32)
    out = np.full((30, 10), 7.0, np.float32)
    ops.pool_rows_into(rows, idx, offsets, out, 3, w, "mean")
    np.testing.assert_array_equal(out[:, 3:7], ops.pool_rows(rows, idx, offsets, w, "mean"))
    assert (out[:, :3] == 7.0).all()
    assert (out[:, 7:] == 7.0).all()
    with pytest.raises(ValueError, match="col"):
        ops.pool_rows_into(rows, idx, offsets, out, 7, w, "mean")  # columns 7..11 of 10


def test_spreading_from_columns_adds_what_spreading_alone_returns() -> None:
    rng = np.random.default_rng(4)
    grads = rng.standard_normal((30, 10), dtype=np.float32)
    idx, offsets = _bags(rng, 30, 50)
    start = rng.standard_normal((50, 4), dtype=np.float32)
    out = start.copy()
    ops.spread_pooled_add(grads, 6, idx, offsets, out, None, "sqrtn")
    alone = ops.spread_pooled(np.ascontiguousarray(grads[:, 6:10]), idx, offsets, 50, None, "sqrtn")
    np.testing.assert_allclose(out, start + alone, rtol=1e-6, atol=1e-6)
    # Refused whole: a non-finite value in the columns read changes nothing.
    grads[0, 7] = np.inf
    before = out.copy()
    with pytest.raises(ValueError, match="grads"):
        ops.spread_pooled_add(grads, 6, idx, offsets, out, None, "sqrtn")
    np.testing.assert_array_equal(out, before)
