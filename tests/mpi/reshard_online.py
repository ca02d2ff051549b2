"""Run on 4 ranks by tests/test_mpi.py: a ShardedTable trained on 2 ranks,
resharded online to 4 (embstore.distributed.reshard), trained, resharded
to 3, trained, equals the same table moved offline (saved on the old ranks,
loaded on the new) bit for bit (each rank's rows, optimizer state and touch
metadata), and one Table fed the same global batches to float summation
order; each reshard reports its pause and sends exactly the rows whose
owner changed, and under "bucket" at most 1.1x the rows that must move.

With EMBSTORE_RESHARD_TIER=disk every part is a disk table with memory
for a few hundred rows (the reshard moves them in rounds, never all in
memory at once; the offline path loads as disk tables too).

With EMBSTORE_RESHARD_TRANSPORT=torch it runs under torchrun instead
(torch.distributed over gloo; tests/test_torchrun.py).

    EMBSTORE_RESHARD_DTYPE=int8 EMBSTORE_RESHARD_PARTITION=bucket mpirun -n 4 ...
    EMBSTORE_RESHARD_TRANSPORT=torch torchrun --nproc_per_node=4 ...
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import numpy as np

import embstore
from embstore import optim
from embstore.distributed import ShardedTable, reshard

DIM = 5
#: The tables' row dtype (int8 rows move as stored: bit for bit).
DTYPE = os.environ.get("EMBSTORE_RESHARD_DTYPE", "float32")
#: The partition kind.
KIND = os.environ.get("EMBSTORE_RESHARD_PARTITION", "hash")
#: "memory" or "disk": each rank's part a Table in memory or on disk.
TIER = os.environ.get("EMBSTORE_RESHARD_TIER", "memory")
#: A disk part's memory: about 300 rows of dim 5 with Adam.
MEMORY = 300 * (4 * 3 * DIM + 40)
#: Keys every table holds from the start (enough rows for 1.1x to measure).
BULK = np.arange(20_000, dtype=np.int64) * 7_919
#: "mpi" (mpirun) or "torch" (torchrun, gloo).
TRANSPORT = os.environ.get("EMBSTORE_RESHARD_TRANSPORT", "mpi")


class TorchWorld:
    """The few collectives of an mpi4py communicator this script uses, over
    torch.distributed's default group."""

    def __init__(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        self.dist = dist

    def Get_rank(self) -> int:
        return int(self.dist.get_rank())

    def Get_size(self) -> int:
        return int(self.dist.get_world_size())

    def allgather(self, obj: object) -> list[object]:
        out: list[object] = [None] * self.Get_size()
        self.dist.all_gather_object(out, obj)
        return out

    def bcast(self, obj: object, root: int = 0) -> object:
        box = [obj]
        self.dist.broadcast_object_list(box, src=root)
        return box[0]

    def Barrier(self) -> None:
        self.dist.barrier()


if TRANSPORT == "torch":
    WORLD: Any = TorchWorld()
    #: What a ShardedTable and reshard take for every process.
    COMM: Any = "torch"
else:
    from mpi4py import MPI

    WORLD = MPI.COMM_WORLD
    COMM = WORLD
RANK = WORLD.Get_rank()
assert WORLD.Get_size() == 4, "run on 4 ranks"


def group(n: int) -> Any:
    """The communicator of ranks 0..n-1 (None on the others); every rank calls it."""
    if TRANSPORT == "torch":
        g = WORLD.dist.new_group(list(range(n)))
        return g if n > RANK else None
    comm = WORLD.Split(0 if n > RANK else MPI.UNDEFINED, RANK)
    return comm if n > RANK else None


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    keys = rng.integers(-500, 500, 120) * 1_000_003
    return keys, rng.normal(size=(120, DIM)).astype(np.float32)


def train(t: ShardedTable | None, steps: range) -> None:
    if t is None:
        return
    for s in steps:
        keys, grads = global_batch(s)
        mine = slice(t.rank, None, t.size)
        t.lookup(keys[mine])
        t.apply_gradients(keys[mine], grads[mine])


def disk() -> dict[str, object]:
    """A disk part's settings (none in memory): a directory of this rank's."""
    if TIER != "disk":
        return {}
    return {"disk": tempfile.mkdtemp(prefix=f"reshard-{RANK}-"), "memory_bytes": MEMORY}


def build(comm: Any) -> ShardedTable:
    t = ShardedTable(
        DIM,
        comm=comm,
        optimizer=optim.Adam(lr=0.05),
        seed=4,
        ttl_steps=1000,
        dtype=DTYPE,
        partition=KIND,
        **disk(),  # type: ignore[arg-type]
    )
    t.lookup(BULK[t.rank :: t.size])
    return t


def held(t: ShardedTable | None) -> np.ndarray | None:
    """The keys this rank's part holds (before a reshard: a rank that stays
    keeps its table, which the reshard changes)."""
    return None if t is None else t.local.export()[0]


def check_moved(
    old: ShardedTable | None, keys: np.ndarray | None, new: ShardedTable | None, size: int
) -> None:
    """Rows sent = rows whose owner changed (``keys``: those the old part
    held); "bucket": at most 1.1x the rows that must move (a leaving
    rank's, and a staying rank's beyond an even share; ranks keep their
    numbers here: WORLD's 0.. in every group)."""
    rows = len(keys) if keys is not None else 0
    sent = new.last_reshard["sent_rows"] if new is not None and new.last_reshard else 0
    if old is not None and new is not None:
        assert keys is not None
        assert sent == int((new.partitioning.owners(keys) != old.rank).sum()), sent
    elif old is not None:
        sent = rows  # a leaving rank sends all it held
    every = WORLD.allgather((rows, sent, size > RANK))
    total = sum(r for r, _, _ in every)
    must = sum(r if not stays else max(0.0, r - total / size) for r, _, stays in every)
    moved = sum(s for _, s, _ in every)
    if RANK == 0:
        print(f"{KIND}: moved {moved} rows, {must:.0f} must move", flush=True)
    if KIND == "bucket":
        assert moved <= 1.1 * must, (moved, must)


two = group(2)
three = group(3)
where = WORLD.bcast(tempfile.mkdtemp() if RANK == 0 else None, root=0)

online = build(two) if RANK < 2 else None
offline = build(two) if RANK < 2 else None
single = embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=4, ttl_steps=1000, dtype=DTYPE)
single.lookup(BULK)
train(online, range(0, 4))
train(offline, range(0, 4))

# 2 -> 4
before, before_keys = online, held(online)
online = reshard(online, COMM, via=COMM)
check_moved(before, before_keys, online, 4)
if offline is not None:
    offline.save(os.path.join(where, "two"))
WORLD.Barrier()
offline = ShardedTable.load(os.path.join(where, "two"), comm=COMM, **disk())  # type: ignore[arg-type]
assert online is not None
assert online.partitioning == offline.partitioning
stats = online.stats()["reshard"]
assert stats["seconds"] > 0, stats
if TIER == "disk":
    # A disk part: rows moved in rounds, each bringing at most a quarter of
    # memory_bytes into a process; the new parts are disk tables within
    # their bound.
    row = 8 + 4 * (online.local._inner.weight_words() + online.local.state_len) + 32
    assert stats["rounds"] >= 10, stats
    assert online.local.table_config.disk is not None
    assert online.local.stats()["memory_rows"] * row <= 2 * MEMORY, online.local.stats()
else:
    assert stats["rounds"] == 1, stats
train(online, range(4, 8))
train(offline, range(4, 8))

# 4 -> 3 (rank 3 leaves)
before, before_keys = online, held(online)
online = reshard(online, three, via=COMM)
check_moved(before, before_keys, online, 3)
offline.save(os.path.join(where, "four"))
offline = (
    ShardedTable.load(os.path.join(where, "four"), comm=three, **disk())  # type: ignore[arg-type]
    if RANK < 3
    else None
)
assert (online is None) == (RANK == 3)
train(online, range(8, 12))
train(offline, range(8, 12))

single.lookup(np.arange(0))
for s in range(12):
    keys, grads = global_batch(s)
    single.lookup(keys)
    single.apply_gradients(keys, grads)

if online is not None:
    assert offline is not None
    assert online.partitioning == offline.partitioning
    a, b = online.state_dict(), offline.state_dict()
    for field in ("keys", "rows", "state", "meta", "step", "seed"):
        assert np.array_equal(a[field], b[field]), field
    keys, rows = single.export()
    got = online.lookup(keys, insert=False)
    # 8-bit rows: a sum in another order may round a code the other way.
    tol = {"atol": 0.02} if DTYPE == "int8" else {"rtol": 1e-5, "atol": 1e-6}
    np.testing.assert_allclose(got, rows, **tol)
    assert len(online) == len(single)
# A checkpoint after the reshards records the new partition (the buckets'
# ranks): it loads on any number of ranks, and into one Table, to the rows
# the resharded table serves.
if online is not None:
    saved = online.save(os.path.join(where, "after"))
    assert saved["partition"]["world_size"] == 3
    if KIND == "bucket":
        assert saved["partition"]["buckets"] == list(online.partitioning.buckets)
WORLD.Barrier()
keys = single.export()[0]
served = online.lookup(keys, insert=False) if online is not None else None  # collective
want = WORLD.bcast(served, root=0)
again = ShardedTable.load(os.path.join(where, "after"), comm=COMM)
assert again.partitioning.world_size == 4
np.testing.assert_array_equal(again.lookup(keys, insert=False), want)
np.testing.assert_array_equal(
    embstore.Table.load(os.path.join(where, "after")).lookup(keys, insert=False), want
)
# The sharded load takes the constructor's config (its num_shards and dtype
# the load's, the rest checked against the checkpoint): float32 rows of an
# int8 checkpoint are its dequantized rows, and a config of another
# optimizer is refused on every rank.
config = embstore.TableConfig(
    DIM, optimizer=optim.Adam(lr=0.05), seed=4, ttl_steps=1000, dtype="float32", num_shards=3
)
by_config = ShardedTable.load(os.path.join(where, "after"), comm=COMM, config=config)
assert (by_config.local.num_shards, by_config.local.dtype) == (3, "float32")
np.testing.assert_array_equal(by_config.lookup(keys, insert=False), want)
refused = ""
try:
    ShardedTable.load(
        os.path.join(where, "after"),
        comm=COMM,
        config=embstore.TableConfig(DIM, optimizer=optim.Adagrad(lr=0.05), ttl_steps=1000),
    )
except ValueError as e:
    refused = str(e)
assert "config.optimizer" in refused, refused
WORLD.Barrier()
print(f"rank {RANK}: online reshard passed", flush=True)
