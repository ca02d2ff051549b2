"""Run under mpirun by tests/test_mpi.py: the last rank fails between two
collectives and never calls the next one; the others' watchdog must end the
job (EMBSTORE_MPI_TIMEOUT seconds) instead of waiting forever. With the
argument "reshard", the collective it never calls is a reshard (its own
``timeout=5``)."""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI

from embstore import optim
from embstore.distributed import ShardedTable, reshard

t = ShardedTable(4, optimizer=optim.SGD(lr=1.0))
t.apply_gradients(np.arange(10), np.ones((10, 4)))
if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
    try:
        raise RuntimeError("simulated failure on the last rank")
    except RuntimeError:
        time.sleep(120)  # stuck: never reaches the next collective
if sys.argv[1:] == ["reshard"]:
    reshard(t, MPI.COMM_WORLD, via=MPI.COMM_WORLD, timeout=5)
else:
    t.apply_gradients(np.arange(10), np.ones((10, 4)))
print("unreachable: the collective completed without the failed rank", flush=True)
