"""Large outputs come from recycled buffers: a reused buffer never shows old
values or aliases a live array, and free_output_buffers() releases them."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import embstore
from embstore import optim

DIM = 32
N = 50_000  # 50,000 x 32 floats = 6.4 MB: above the 4 MiB pooling threshold


def _rows(table: embstore.Table, keys: np.ndarray) -> np.ndarray:
    """The oracle: the same rows fetched in small calls (not pooled)."""
    return np.concatenate([table.lookup(keys[i : i + 1000]) for i in range(0, len(keys), 1000)])


def test_reused_buffer_holds_the_new_rows_and_live_arrays_are_not_reused() -> None:
    embstore.free_output_buffers()
    t = embstore.Table(DIM, optimizer=optim.SGD(lr=0.5), seed=3)
    a_keys = np.arange(N, dtype=np.int64)
    b_keys = np.arange(N, 2 * N, dtype=np.int64) * 7
    t.lookup(np.concatenate([a_keys, b_keys]))
    a = t.lookup(a_keys)
    a_copy = a.copy()
    b = t.lookup(b_keys)  # `a` is alive: its buffer must not serve `b`
    assert not np.shares_memory(a, b)
    np.testing.assert_array_equal(a, a_copy)
    np.testing.assert_array_equal(b, _rows(t, b_keys))
    b_ptr = b.__array_interface__["data"][0]
    del b
    gc.collect()
    # The freed buffer serves the next call of that size, with its rows only.
    c = t.lookup(a_keys[::-1].copy())
    assert c.__array_interface__["data"][0] == b_ptr, "the freed buffer is reused"
    np.testing.assert_array_equal(c, a_copy[::-1])
    assert c.flags.c_contiguous
    assert c.flags.writeable
    assert c.dtype == np.float32
    assert c.shape == (N, DIM)
    c[:] = 0  # the caller owns it: writing does not touch the table
    np.testing.assert_array_equal(t.lookup(a_keys[:5]), a_copy[:5])
    del a, c
    gc.collect()
    freed = embstore.free_output_buffers()
    assert freed >= 2 * N * DIM * 4, freed
    assert embstore.free_output_buffers() == 0


def test_pooled_and_collection_outputs_are_fully_written_over_old_values() -> None:
    embstore.free_output_buffers()
    t = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1), seed=5)
    # Fill the pool with a buffer of large values.
    junk = t.lookup(np.arange(N, dtype=np.int64))
    junk[:] = 1e30
    del junk
    gc.collect()
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4, N)  # empty bags included
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = rng.integers(0, 5000, int(offsets[-1])).astype(np.int64)
    pooled = t.lookup_pooled(ids, offsets, combiner="mean")
    assert np.abs(pooled).max() < 1.0, "no old value survives"
    expect = np.stack(
        [
            t.lookup(ids[offsets[b] : offsets[b + 1]]).mean(0)
            if lengths[b]
            else np.zeros(DIM, np.float32)
            for b in range(N)
        ]
    )
    np.testing.assert_allclose(pooled, expect, rtol=1e-5, atol=1e-7)
    del pooled
    gc.collect()
    # A wide output past 8 MiB (larger than the caches), with two
    # features sharing table t (served in one pass) and one-id bags.
    u = embstore.Table(DIM // 2, seed=6)
    coll = embstore.Collection({"a": t, "b": u, "c": t})
    one = np.arange(N + 1, dtype=np.int64)
    wide = coll.lookup_pooled(
        {"a": (ids[:N], one), "b": (ids[:N] + 1, one), "c": (ids[:N] + 7, one)}
    )
    assert wide.shape == (N, 2 * DIM + DIM // 2)
    assert wide.nbytes > 8 << 20
    np.testing.assert_array_equal(wide[:, :DIM], t.lookup(ids[:N]))
    np.testing.assert_array_equal(wide[:, DIM : DIM + DIM // 2], u.lookup(ids[:N] + 1))
    np.testing.assert_array_equal(wide[:, DIM + DIM // 2 :], t.lookup(ids[:N] + 7))
    embstore.free_output_buffers()


def test_small_outputs_are_plain_numpy_arrays() -> None:
    t = embstore.Table(4)
    out = t.lookup(np.arange(10, dtype=np.int64))
    assert out.flags.owndata, "small outputs are NumPy's own allocation"
    embstore.free_output_buffers()
    big = t.lookup(np.arange(N * 8, dtype=np.int64))
    assert not big.flags.owndata
    assert big.base is not None


def test_lookup_with_state_writes_into_a_given_buffer() -> None:
    """lookup_with_state(out=buf) writes the rows, then the state, into buf
    (a transfer buffer) and returns views of it equal to the call without
    out; a buffer too small, read-only or strided is refused, naming out."""
    t = embstore.Table(3, optimizer=embstore.optim.Adam(lr=0.1), seed=1)
    t.apply_gradients([1, 2, 3], np.ones((3, 3), np.float32))
    want = t.lookup_with_state([3, 1, 9], insert=False)
    buf = np.full(3 * (3 + 6) + 5, -7.0, np.float32)
    rows, state = t.lookup_with_state([3, 1, 9], insert=False, out=buf)
    np.testing.assert_array_equal(rows, want[0])
    np.testing.assert_array_equal(state, want[1])
    assert np.shares_memory(rows, buf)
    assert np.shares_memory(state, buf)
    np.testing.assert_array_equal(buf[:9], want[0].ravel())
    assert (buf[27:] == -7.0).all()  # nothing past n * (dim + state_len)
    ro = np.zeros(27, np.float32)
    ro.flags.writeable = False
    for bad, exc in [
        (np.zeros(26, np.float32), ValueError),
        (ro, ValueError),
        (np.zeros(54, np.float32)[::2], ValueError),
        (np.zeros(27, np.float64), TypeError),
    ]:
        with pytest.raises(exc, match=r"^out\b"):
            t.lookup_with_state([3, 1, 9], insert=False, out=bad)
