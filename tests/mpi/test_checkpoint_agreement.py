"""Under mpirun: sharded checkpoints and other processes. While another
process keeps publishing checkpoints to the same directory, every
ShardedTable.load has all ranks load one and the same checkpoint (the same
step, the rows of one save), and every ShardedTable.save publishes."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

import embstore
from embstore import optim
from embstore.distributed import ShardedTable

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()

# Another process: saves two different tables to argv[1] in turn (rows all
# 1.0 at step 10, or all 2.0 at step 20) for argv[2] seconds.
SAVER = """
import sys, time, numpy as np, embstore
from embstore import optim
path, seconds = sys.argv[1], float(sys.argv[2])
tables = []
for value, step in ((1.0, 10), (2.0, 20)):
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.1), num_shards=2)
    t.assign(np.arange(400), np.full((400, 4), value, np.float32))
    for _ in range(step):  # zero gradients: the rows stay, the step counts
        t.apply_gradients(np.arange(400), np.zeros((400, 4), np.float32))
    tables.append(t)
tables[0].save(path)
print("ready", flush=True)
end, i = time.monotonic() + seconds, 0
while time.monotonic() < end:
    tables[i % 2].save(path)
    i += 1
"""


def start_saver(path: str, seconds: float) -> subprocess.Popen[str] | None:
    """On rank 0, the other process (once it has saved a first checkpoint);
    every rank returns after it is ready."""
    saver = None
    if RANK == 0:
        saver = subprocess.Popen(
            [sys.executable, "-c", SAVER, path, str(seconds)], stdout=subprocess.PIPE, text=True
        )
        assert saver.stdout is not None
        assert saver.stdout.readline().strip() == "ready"
    COMM.Barrier()
    return saver


def test_ranks_load_one_checkpoint_while_another_process_publishes() -> None:
    path = COMM.bcast(tempfile.mkdtemp() + "/ck" if RANK == 0 else None)
    saver = start_saver(path, 6)
    mixed = 0
    loads = 0
    deadline = time.monotonic() + 4
    while COMM.bcast(time.monotonic() < deadline if RANK == 0 else None):
        t = ShardedTable.load(path)
        local = t.local.export()[1]
        values = np.unique(local).tolist()
        seen = COMM.allgather((t.step, values))
        steps = {s for s, _ in seen}
        vals = {v for _, vs in seen for v in vs}
        want = {10: {1.0}, 20: {2.0}}
        if len(steps) != 1 or vals - want.get(next(iter(steps)), set()):
            mixed += 1
        assert len(t) == 400
        loads += 1
    if saver is not None:
        saver.communicate(timeout=60)
    assert loads >= 5, loads
    assert mixed == 0, f"{mixed} of {loads} loads left the ranks on different checkpoints"


def test_sharded_saves_publish_while_another_process_saves() -> None:
    path = COMM.bcast(tempfile.mkdtemp() + "/ck" if RANK == 0 else None)
    saver = start_saver(path, 6)
    t = ShardedTable(4, optimizer=optim.SGD(lr=0.1), seed=5)
    t.lookup(np.arange(300))
    failed = 0
    for _ in range(20):
        try:
            t.save(path)
        except embstore.CheckpointError:
            failed += 1
    if saver is not None:
        saver.communicate(timeout=60)
    assert failed == 0, f"{failed} of 20 sharded saves failed"
