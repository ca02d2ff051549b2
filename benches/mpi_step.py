"""Step time and bytes moved by a sharded Collection step on N ranks, for the
demo's batch (26 fields sharing one table, one id per field, row dim 9).

    mpirun --oversubscribe -n N python benches/mpi_step.py [--batch 4096] [--steps 20]

Rank 0 prints one JSON line: median step seconds, and the bytes each rank
sent and received per step (from ShardedTable.stats), with the cost model's
prediction for the same batch.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

from embstore import _core, optim
from embstore.demo import FIELDS, make_data
from embstore.distributed import ShardedCollection, ShardedTable


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    dim = 9
    table = ShardedTable(dim, optimizer=optim.Adagrad(lr=0.05))
    coll = ShardedCollection({f"C{f}": table for f in range(FIELDS)})
    data = make_data(a.batch * a.steps, seed=100 + rank)  # each rank its own samples
    offsets = np.arange(a.batch + 1, dtype=np.int64)
    times, sent, received, model = [], [], [], []
    for s in range(a.steps):
        keys = data.keys[s * a.batch : (s + 1) * a.batch]
        batch = {f"C{f}": (np.ascontiguousarray(keys[:, f]), offsets) for f in range(FIELDS)}
        comm.Barrier()
        t0 = time.perf_counter()
        out = coll.lookup_pooled(batch)
        fwd = dict(table.last_call)
        coll.apply_pooled_gradients(batch, np.full(out.shape, 1e-3, np.float32))
        comm.Barrier()
        times.append(time.perf_counter() - t0)
        sent.append(fwd["sent_bytes"] + table.last_call["sent_bytes"])
        received.append(fwd["received_bytes"] + table.last_call["received_bytes"])
        # Cost model (README): per call 8 B of counts to each other rank; the
        # lookup sends 8 B per distinct key owned elsewhere ("remote") and
        # returns 4*dim B per row other ranks asked of this one ("asked");
        # the apply sends 8 + 4*dim B per remote key.
        uniq = np.unique(keys)
        remote = int((_core.partition_owners(uniq, size) != rank).sum())
        asked = sum(
            int((_core.partition_owners(u, size) == rank).sum())
            for r, u in enumerate(comm.allgather(uniq))
            if r != rank
        )
        model.append(2 * 8 * (size - 1) + remote * (8 + 8 + 4 * dim) + asked * 4 * dim)
    everyone = comm.gather(
        {
            "sent": float(np.mean(sent)),
            "received": float(np.mean(received)),
            "model_sent": float(np.mean(model)),
        },
        root=0,
    )
    if rank == 0:
        print(
            json.dumps(
                {
                    "ranks": size,
                    "batch": a.batch,
                    "fields": FIELDS,
                    "dim": dim,
                    "median_step_s": float(np.median(times[2:])),
                    "per_rank": everyone,
                    "rows": len(table.local),
                }
            )
        )


if __name__ == "__main__":
    main()
