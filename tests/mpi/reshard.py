"""Run under mpirun by tests/test_mpi.py: load a checkpoint (or start fresh)
on this many ranks, train steps [first, last) of the global batches, save.

    python reshard.py LOAD_OR_- SAVE FIRST LAST [DISK]

With DISK, each rank loads its part as a disk table under DISK with memory
for 30 rows, and checks that most of its rows are on disk.

Batch of step s is the same for any number of ranks: rank r takes every
size-th key of it, so the union over ranks never changes.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from embstore import optim
from embstore.distributed import ShardedTable

DIM = 5


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    keys = rng.integers(-500, 500, 120) * 1_000_003
    return keys, rng.normal(size=(120, DIM)).astype(np.float32)


def main() -> None:
    load, save, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    disk = sys.argv[5] if len(sys.argv) > 5 else None
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if load == "-":
        table = ShardedTable(DIM, optimizer=optim.Adam(lr=0.05), seed=4)
    elif disk is None:
        table = ShardedTable.load(load)
    else:
        probe = ShardedTable(DIM, optimizer=optim.Adam(lr=0.05), disk=disk, memory_bytes=1 << 20)
        cost = probe.local.stats()["row_cost"]
        table = ShardedTable.load(load, disk=disk, memory_bytes=30 * cost)
        st = table.local.stats()
        assert st["memory_rows"] <= 30, st
        assert st["disk_rows"] > 100, st
    for step in range(first, last):
        keys, grads = global_batch(step)
        table.apply_gradients(keys[rank::size], grads[rank::size])
    table.save(save)


if __name__ == "__main__":
    main()
