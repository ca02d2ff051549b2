"""Under mpirun: ShardedTable(wire_dtype=...) moves rows and gradients
encoded (embstore.distributed.wire) and trains as one Table whose looked-up
rows and per-rank summed gradients are rounded the same way (to float
summation order); the bytes it moves follow the cost model at the wire's
row size; float32 is the exchange of before, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import embstore
from embstore import optim
from embstore.distributed import ShardedCollection, ShardedTable, wire

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
DIM = 8


def _batch(step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(77 * step + rank)
    keys = rng.integers(0, 400, 60)
    return keys, rng.normal(size=(60, DIM)).astype(np.float32)


def _rounded(rows: np.ndarray, w: str) -> np.ndarray:
    return wire.decode(wire.encode(rows, w), w, rows.shape[1])


@pytest.mark.parametrize("w", ["bfloat16", "float16"])
def test_training_over_a_compressed_wire_equals_one_table_rounding_alike(w: str) -> None:
    sharded = ShardedTable(DIM, optimizer=optim.Adam(lr=0.05), seed=3, wire_dtype=w)
    single = embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=3)
    for step in range(8):
        keys, grads = _batch(step, RANK)
        np.testing.assert_allclose(
            sharded.lookup(keys), _rounded(single.lookup(keys), w), rtol=1e-5, atol=1e-6
        )
        sharded.apply_gradients(keys, grads)
        # One Table: each rank's gradients summed per key, rounded for the
        # wire, then summed across ranks by the owner's step.
        all_keys, all_grads = [], []
        for r in range(SIZE):
            k, g = _batch(step, r)
            u, inv = np.unique(k, return_inverse=True)
            summed = np.zeros((len(u), DIM), np.float32)
            np.add.at(summed, inv, g)
            all_keys.append(u)
            all_grads.append(_rounded(summed, w))
        single.apply_gradients(np.concatenate(all_keys), np.concatenate(all_grads))
    keys, rows = single.export()
    got = sharded.lookup(keys, insert=False)
    np.testing.assert_allclose(got, _rounded(rows, w), rtol=1e-5, atol=1e-6)


def test_int8_wire_trains_close_to_float32_and_found_flags_travel() -> None:
    a = ShardedTable(DIM, optimizer=optim.SGD(lr=0.1), seed=5, wire_dtype="int8")
    b = ShardedTable(DIM, optimizer=optim.SGD(lr=0.1), seed=5)
    keys, _ = _batch(0, RANK)
    ra, rb = a.lookup(keys), b.lookup(keys)  # the same rows, sent in 8 bits
    spread = rb.max(axis=1) - rb.min(axis=1)
    assert (np.abs(ra - rb) <= spread[:, None] / 510 * 1.001 + 1e-9).all()
    for step in range(5):
        keys, grads = _batch(step, RANK)
        a.lookup(keys)
        b.lookup(keys)
        a.apply_gradients(keys, grads)
        b.apply_gradients(keys, grads)
    probe = np.arange(0, 800, 3)
    rows_a, found_a = a.lookup(probe, insert=False, return_found=True)
    rows_b, found_b = b.lookup(probe, insert=False, return_found=True)
    np.testing.assert_array_equal(found_a, found_b)
    np.testing.assert_allclose(rows_a, rows_b, atol=0.02)


def test_bytes_moved_follow_the_cost_model_at_the_wires_row_size() -> None:
    dim = 64
    rng = np.random.default_rng(RANK)
    keys = rng.integers(0, 3000, 2000)
    uniq = np.unique(keys)
    remote = int((embstore._core.partition_owners(uniq, SIZE) != RANK).sum())
    every = COMM.allgather(uniq)
    asked = sum(
        int((embstore._core.partition_owners(u, SIZE) == RANK).sum())
        for r, u in enumerate(every)
        if r != RANK
    )
    sent = {}
    for w in wire.WIRE_DTYPES:
        t = ShardedTable(dim, optimizer=optim.SGD(lr=0.1), wire_dtype=w)
        t.lookup(keys)
        row = wire.row_bytes(w, dim)
        counts = 8 * (SIZE - 1)
        assert t.last_call["sent_bytes"] == counts + 8 * remote + row * asked
        lookup_sent = t.last_call["sent_bytes"]
        t.apply_gradients(keys, np.ones((len(keys), dim)))
        assert t.last_call["sent_bytes"] == row * remote  # the lookup's route
        sent[w] = lookup_sent + t.last_call["sent_bytes"]
    total = COMM.allreduce(np.array([sent[w] for w in wire.WIRE_DTYPES]))
    bf16, f32 = total[1], total[0]
    assert bf16 <= 0.55 * f32


def test_float32_wire_is_the_exchange_of_before_bit_for_bit() -> None:
    a = ShardedTable(DIM, optimizer=optim.Adam(lr=0.05), seed=8)
    b = ShardedTable(DIM, optimizer=optim.Adam(lr=0.05), seed=8, wire_dtype="float32")
    c = ShardedCollection({"x": a})
    d = ShardedCollection({"x": b})
    for step in range(4):
        keys, grads = _batch(step, RANK)
        offsets = np.arange(len(keys) + 1)
        np.testing.assert_array_equal(
            c.lookup_pooled({"x": (keys, offsets)}), d.lookup_pooled({"x": (keys, offsets)})
        )
        c.apply_pooled_gradients({"x": (keys, offsets)}, grads)
        d.apply_pooled_gradients({"x": (keys, offsets)}, grads)
    keys = np.arange(400)
    np.testing.assert_array_equal(a.lookup(keys, insert=False), b.lookup(keys, insert=False))


def test_a_wire_dtype_that_differs_across_ranks_is_refused_everywhere() -> None:
    with pytest.raises(ValueError, match="wire_dtype"):
        ShardedTable(DIM, wire_dtype="bfloat16" if RANK == 0 else "float16")
    with pytest.raises(ValueError, match="wire_dtype"):
        ShardedTable(DIM, wire_dtype="fp8")
