"""Partitions of a sharded table: "hash" balances sequential keys, keys that
share their low bits and Zipf keys within 1.1x of the mean; "mod" and "div"
follow their definitions. (No MPI needed: ownership is a pure function.)"""

from __future__ import annotations

import numpy as np
import pytest

from embstore import _core


def imbalance(keys: np.ndarray, size: int) -> float:
    counts = np.bincount(_core.partition_owners(np.unique(keys), size), minlength=size)
    return float(counts.max() / counts.mean())


@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_hash_partition_balances_hard_key_sets(size: int) -> None:
    rng = np.random.default_rng(size)
    sets = {
        "sequential": np.arange(200_000),
        "shared low bits": np.arange(200_000) << 20,
        "shared low bits, negative": -(np.arange(200_000) << 32) - 1,
        "zipf": (rng.zipf(1.1, 2_000_000) * 2654435761) % (1 << 40),
    }
    for name, keys in sets.items():
        assert imbalance(keys.astype(np.int64), size) <= 1.1, name


def test_mod_and_div_partitions() -> None:
    keys = np.array([-1, 0, 1, 2, 5, 7], np.int64)
    assert _core.partition_owners(keys, 3, "mod").tolist() == [2, 0, 1, 2, 2, 1]
    div = _core.partition_owners(np.arange(10, dtype=np.int64), 3, "div", 10)
    assert div.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    with pytest.raises(ValueError, match=r"keys: expected keys in \[0, 10\)"):
        _core.partition_owners(np.array([3, 10], np.int64), 3, "div", 10)
    with pytest.raises(ValueError, match="key_space"):
        _core.partition_owners(keys, 3, "div")
    with pytest.raises(ValueError, match="partition"):
        _core.partition_owners(keys, 3, "random")


def test_owner_does_not_depend_on_anything_but_key_and_size() -> None:
    keys = np.random.default_rng(0).integers(-(2**62), 2**62, 10_000)
    a = _core.partition_owners(keys, 5)
    b = _core.partition_owners(keys[::-1].copy(), 5)[::-1]
    np.testing.assert_array_equal(a, b)


def test_unique_inverse_agrees_with_numpy_unique_on_awkward_keys() -> None:
    """ops.unique_inverse, the sharded tier's dedup: the same distinct keys as
    np.unique (in first-occurrence order instead of sorted), and every
    position maps back to its key."""
    from embstore import ops

    from .conftest import batch, key_pool

    rng = np.random.default_rng(7)
    for n in (0, 1, 17, 100_000):
        keys = batch(rng, key_pool(rng, max(1, n // 3)), n)
        uniq, inverse = ops.unique_inverse(keys)
        assert uniq.dtype == np.int64
        assert inverse.dtype == np.int64
        np.testing.assert_array_equal(np.sort(uniq), np.unique(keys))
        np.testing.assert_array_equal(uniq[inverse], keys)
        # First-occurrence order: each distinct key appears where it first occurs.
        first = np.unique(keys, return_index=True)[1]
        np.testing.assert_array_equal(uniq, keys[np.sort(first)])
