"""Under mpirun: lookups started ahead (lookup_async, lookup_pooled_async,
ShardedCollection.lookup_pooled_async) return what the calls made in turn
return, train bit for bit as they do when the next batch's lookup starts
after this batch's step, keep the order of collective calls across tables
of one communicator, copy the caller's arrays, and raise bad input from
wait() on every rank, changing nothing."""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest
from mpi4py import MPI

from embstore import optim
from embstore.distributed import ShardedCollection, ShardedTable

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
DIM = 6


def _batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(31 * step + RANK)
    return rng.integers(0, 500, 50), rng.normal(size=(50, DIM)).astype(np.float32)


def test_a_pipelined_loop_trains_bit_for_bit_as_calls_in_turn() -> None:
    plain = ShardedTable(DIM, optimizer=optim.Adam(lr=0.05), seed=2)
    piped = ShardedTable(DIM, optimizer=optim.Adam(lr=0.05), seed=2)
    keys, grads = _batch(0)
    pending = piped.lookup_async(keys)
    for step in range(6):
        keys, grads = _batch(step)
        want = plain.lookup(keys)
        plain.apply_gradients(keys, grads * want)
        rows = pending.wait()
        np.testing.assert_array_equal(rows, want)
        piped.apply_gradients(keys, grads * rows)
        # The next batch's lookup starts now, after this batch's step.
        pending = piped.lookup_async(_batch(step + 1)[0])
    pending.wait()
    probe = np.arange(500)
    got, want = piped.lookup(probe, insert=False), plain.lookup(probe, insert=False)
    np.testing.assert_array_equal(got, want)


def test_pooled_and_collection_forms_and_two_tables_in_order() -> None:
    a = ShardedTable(DIM, optimizer=optim.SGD(lr=0.1), seed=4)
    b = ShardedTable(DIM, optimizer=optim.SGD(lr=0.1), seed=5)
    coll = ShardedCollection({"x": a, "y": b})
    keys, _ = _batch(1)
    offsets = np.arange(0, len(keys) + 1, 5)
    batch = {"x": (keys, offsets), "y": (keys[::-1].copy(), offsets)}
    want = coll.lookup_pooled(batch)
    p1 = coll.lookup_pooled_async(batch)
    p2 = a.lookup_pooled_async(keys, offsets, combiner="mean")
    direct = b.lookup(keys)  # a call in turn on the same communicator meanwhile
    np.testing.assert_array_equal(p1.wait(), want)
    np.testing.assert_array_equal(p2.wait(), a.lookup_pooled(keys, offsets, combiner="mean"))
    np.testing.assert_array_equal(direct, b.lookup(keys))


def test_the_callers_arrays_are_copied_when_the_call_starts() -> None:
    t = ShardedTable(DIM, seed=6)
    keys, _ = _batch(2)
    want = t.lookup(keys)
    buf = keys.copy()
    pending = t.lookup_async(buf)
    buf[:] = 999_999  # the caller reuses its buffer at once
    np.testing.assert_array_equal(pending.wait(), want)


def test_bad_input_raises_from_wait_on_every_rank_and_changes_nothing() -> None:
    t = ShardedTable(DIM, optimizer=optim.SGD(lr=0.1), seed=7)
    t.lookup(np.arange(10))
    before = len(t)
    bad = np.array([1.5, 2.5]) if RANK == 0 else np.arange(5)
    pending = t.lookup_async(bad)
    with pytest.raises((TypeError, ValueError)):
        pending.wait()
    assert len(t) == before


def test_a_table_dropped_after_its_lookups_ahead_is_freed() -> None:
    """The exchange thread keeps nothing of a call it finished: a table the
    program drops after waiting for its last lookup started ahead is freed
    at once (it held the table until the next call started ahead, and a
    new table beside it paid fresh memory)."""
    t = ShardedTable(DIM, optimizer=optim.SGD(lr=0.1), seed=8)
    t.lookup_async(_batch(3)[0]).wait()
    gone = weakref.ref(t)
    del t
    deadline = time.monotonic() + 5
    while gone() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert gone() is None
