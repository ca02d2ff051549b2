"""Batch operations on rows a caller already holds, for a tier that fetches
rows from elsewhere (the ranks of a ShardedTable): a batch's distinct keys,
which rank owns a key, the checks of CSR bags, pooling fetched rows into
bags and spreading pooled gradients back to the rows. The same native code
as a Table's pooled calls.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from embstore import _core

__all__ = [
    "check_bags",
    "partition_owners",
    "plan_exchange",
    "pool_rows",
    "pool_rows_into",
    "spread_pooled",
    "spread_pooled_add",
    "unique_inverse",
]


def partition_owners(
    keys: npt.NDArray[np.int64], size: int, partition: str = "hash", key_space: int | None = None
) -> npt.NDArray[np.int32]:
    """The rank (``0 <= rank < size``) that owns each of ``keys`` under
    ``partition`` ("hash", "mod", or "div" over ``key_space`` keys)."""
    return _core.partition_owners(keys, size, partition, key_space)


def unique_inverse(
    keys: npt.NDArray[np.int64],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The distinct values of ``keys`` (1-D int64) in the order they first
    occur, and each position's index among them (``uniq[inverse] == keys``):
    ``np.unique(keys, return_inverse=True)`` without its sort, by hashing in
    one native pass."""
    return _core.unique_inverse(keys)


def plan_exchange(
    keys: npt.NDArray[np.int64],
    size: int,
    partition: str = "hash",
    key_space: int | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """What a sharded call over ``size`` ranks sends, in one native pass: the
    distinct values of ``keys`` grouped by owner rank (rank 0's first, each
    rank's in first-occurrence order), so that they are the send buffer as
    they are; each position's index among them (``uniq[inverse] == keys``);
    and how many each rank owns (int64 ``(size,)``). A key outside a "div"
    key space raises ValueError naming ``keys``."""
    return _core.plan_exchange(keys, size, partition, key_space)


def check_bags(
    ids: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    weights: npt.NDArray[np.float32] | None = None,
    combiner: str = "sum",
) -> int:
    """Checks CSR bags as a pooled call does (offsets from 0, never
    decreasing, ending at ``len(ids)``; a weight per id; a known combiner);
    returns the batch size."""
    return _core.check_bags(ids, offsets, weights, combiner)


def pool_rows(
    rows: npt.NDArray[np.float32],
    idx: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    weights: npt.NDArray[np.float32] | None = None,
    combiner: str = "sum",
) -> npt.NDArray[np.float32]:
    """Pooled rows of bags whose id ``i`` uses row ``idx[i]`` of ``rows``
    (``(n, dim)``): float32 ``(batch, dim)``, as ``Table.lookup_pooled``."""
    return _core.pool_rows(rows, idx, offsets, weights, combiner)


def spread_pooled(
    grads: npt.NDArray[np.float32],
    idx: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    n: int,
    weights: npt.NDArray[np.float32] | None = None,
    combiner: str = "sum",
) -> npt.NDArray[np.float32]:
    """The backward of :func:`pool_rows`: float32 ``(n, dim)``, row ``r``
    the sum of ``c_i * grads[bag(i)]`` over the ids with ``idx[i] == r``."""
    return _core.spread_pooled(grads, idx, offsets, n, weights, combiner)


def pool_rows_into(
    rows: npt.NDArray[np.float32],
    idx: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    out: npt.NDArray[np.float32],
    col: int,
    weights: npt.NDArray[np.float32] | None = None,
    combiner: str = "sum",
) -> None:
    """:func:`pool_rows` written in place into columns ``col:col + dim`` of
    ``out`` (float32 ``(batch, width)``, C-contiguous): several features'
    pooled rows side by side with no copy to join them."""
    _core.pool_rows_into(rows, idx, offsets, out, col, weights, combiner)


def spread_pooled_add(
    grads: npt.NDArray[np.float32],
    col: int,
    idx: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    out: npt.NDArray[np.float32],
    weights: npt.NDArray[np.float32] | None = None,
    combiner: str = "sum",
) -> None:
    """:func:`spread_pooled` of columns ``col:col + dim`` of ``grads``
    (``(batch, width)``), added in place to ``out`` (float32 ``(n, dim)``,
    C-contiguous): the features of one table sum into one array with no
    copy of their columns."""
    _core.spread_pooled_add(grads, col, idx, offsets, out, weights, combiner)
