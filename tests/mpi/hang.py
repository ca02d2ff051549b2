"""Run under mpirun by tests/test_mpi.py: the last rank fails between two
collectives and never calls the next one; the others' watchdog must end the
job (EMBSTORE_MPI_TIMEOUT seconds) instead of waiting forever."""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from embstore import optim
from embstore.distributed import ShardedTable

t = ShardedTable(4, optimizer=optim.SGD(lr=1.0))
t.apply_gradients(np.arange(10), np.ones((10, 4)))
if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
    try:
        raise RuntimeError("simulated failure on the last rank")
    except RuntimeError:
        time.sleep(120)  # stuck: never reaches the next collective
t.apply_gradients(np.arange(10), np.ones((10, 4)))
print("unreachable: the collective completed without the failed rank", flush=True)
