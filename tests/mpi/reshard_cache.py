"""Run on 4 ranks by tests/test_mpi.py: a ShardedTable whose parts are
DeviceCaches (xp=numpy: the cache's own code on the host) over Tables,
trained so that the newest rows live only in the caches, resharded online
from 2 ranks to 4; then a reshard to 2 whose put fails on one rank raises
on every rank and leaves every part as it was. The caches are flushed first: every row the old parts
held, as trained, is in the new parts bit for bit; each new part is a
DeviceCache of the old one's settings; lookups then serve what one Table
trained on the same global batches serves, to float summation order."""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import embstore
from embstore import optim
from embstore.distributed import ShardedTable, reshard
from embstore.gpu import DeviceCache

DIM = 6
WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
assert WORLD.Get_size() == 4, "run on 4 ranks"


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    keys = rng.integers(0, 400, 96) * 1_009
    return keys, rng.normal(size=(96, DIM)).astype(np.float32)


def cached(seed: int) -> DeviceCache:
    table = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1), seed=seed)
    return DeviceCache(table, rows=128, xp=np, policy="lru")


two = WORLD.Split(0 if RANK < 2 else MPI.UNDEFINED, RANK)
old = ShardedTable(DIM, comm=two, local=cached, seed=9) if RANK < 2 else None
single = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1), seed=9)
for s in range(6):
    keys, grads = global_batch(s)
    single.lookup(keys)
    single.apply_gradients(keys, grads)
    if old is not None:
        mine = slice(old.rank, None, old.size)
        old.lookup(keys[mine])
        old.apply_gradients(keys[mine], grads[mine])

if old is not None:
    # Rows trained in the cache and not yet written back: the table under
    # it is behind (the reshard must flush, or these steps are lost).
    assert isinstance(old.local, DeviceCache)
    keys = single.export()[0]
    keys = keys[old.partitioning.owners(keys) == old.rank]
    behind = old.local.table.lookup(keys, insert=False)
    assert not np.array_equal(behind, single.lookup(keys, insert=False))

# What the old parts serve (their rows as trained, in the caches), before
# the reshard: a process that stays keeps its Table, which the reshard
# changes.
held = None
if old is not None:
    held_keys = old.local.table.export()[0]
    held = (held_keys, np.asarray(old.local.lookup(held_keys, insert=False)))
every_old = [h for h in WORLD.allgather(held) if h is not None]

new = reshard(old, WORLD, via=WORLD)
assert new is not None
assert isinstance(new.local, DeviceCache), type(new.local)
assert (new.local.capacity, new.local.policy) == (128, "lru")

# Every row the old parts held, as trained (flushed by the reshard), is in
# the new parts' tables bit for bit.
new.local.flush()
every_new = WORLD.allgather(new.local.table.export())
order_old = np.argsort(np.concatenate([h[0] for h in every_old]))
order_new = np.argsort(np.concatenate([h[0] for h in every_new]))
for field, name in ((0, "keys"), (1, "rows")):
    a = np.concatenate([h[field] for h in every_old])[order_old]
    b = np.concatenate([h[field] for h in every_new])[order_new]
    assert np.array_equal(a, b), name
assert len(order_old) == len(single)

keys, rows = single.export()
np.testing.assert_allclose(new.lookup(keys, insert=False), rows, rtol=1e-5, atol=1e-6)

# A put that fails on one rank (4 -> 2, rank 0's put refused): every rank
# raises, and each part is as it was: rank 1 took back the rows it got,
# ranks 2 and 3 (leaving) still hold theirs.
# The module (the package's attribute of that name is the function).
resharding = sys.modules["embstore.distributed.reshard"]

new.local.flush()
was = new.local.table.export(with_state=True)
if RANK == 0:

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("rows: refused for the test")

    resharding.restore_stored = refuse  # type: ignore[assignment]
two = WORLD.Split(0 if RANK < 2 else MPI.UNDEFINED, RANK)
failed = ""
try:
    reshard(new, two if RANK < 2 else None, via=WORLD)
except RuntimeError as e:
    failed = str(e)
assert "rank 0: rows: refused for the test" in failed, failed
assert "nothing moved" in failed, failed
now = new.local.table.export(with_state=True)
for a, b in zip(was, now, strict=True):
    assert np.array_equal(a, b)
WORLD.Barrier()
print(f"rank {RANK}: cache reshard passed", flush=True)
