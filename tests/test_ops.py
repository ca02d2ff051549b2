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


@pytest.mark.parametrize("partition", ["hash", "mod", "div"])
def test_plan_exchange_groups_distinct_keys_by_owner_as_numpy_would(partition: str) -> None:
    """plan_exchange against NumPy: the distinct keys (first-occurrence
    order, as np.unique's return_index sorted) grouped by owner with a
    stable sort, the counts per rank, and uniq[inverse] == keys; a key
    outside a "div" key space is refused naming keys."""
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 1000, 5000)
    space = 1000 if partition == "div" else None
    uniq, inverse, counts = ops.plan_exchange(keys, 3, partition, space)
    _, first = np.unique(keys, return_index=True)
    in_order = keys[np.sort(first)]
    owners = ops.partition_owners(in_order, 3, partition, space)
    np.testing.assert_array_equal(uniq, in_order[np.argsort(owners, kind="stable")])
    np.testing.assert_array_equal(counts, np.bincount(owners, minlength=3))
    np.testing.assert_array_equal(uniq[inverse], keys)
    if partition == "div":
        with pytest.raises(ValueError, match=r"^keys\b"):
            ops.plan_exchange(np.array([5, 1000]), 3, "div", 1000)
