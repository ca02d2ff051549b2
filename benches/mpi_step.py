"""Step time and bytes moved by a sharded Collection step on N ranks, for the
demo's batch (26 fields sharing one table, one id per field, row dim 9).

    mpirun --oversubscribe -n N python benches/mpi_step.py [--batch 4096] [--steps 20]
        [--ids demo|zipf] [--local]

``--ids zipf``: Zipf(1.1) ids over 1M keys per field instead of the demo's.
``--local`` (1 rank): the same batches through the local
``embstore.Collection`` as well, the two alternating step by step, and their
ratio. Rank 0 prints one JSON line: median step seconds, and the bytes each
rank sent and received per step (from ShardedTable.stats), with the cost
model's prediction for the same batch.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

from embstore import Collection, Table, _core, optim
from embstore.demo import FIELDS, make_data
from embstore.distributed import ShardedCollection, ShardedTable


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--ids", choices=["demo", "zipf"], default="demo")
    p.add_argument("--local", action="store_true", help="also the local Collection (1 rank)")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    dim = 9
    table = ShardedTable(dim, optimizer=optim.Adagrad(lr=0.05))
    coll = ShardedCollection({f"C{f}": table for f in range(FIELDS)})
    if a.ids == "demo":
        all_keys = make_data(a.batch * a.steps, seed=100 + rank).keys  # each rank its own
    else:
        rng = np.random.default_rng(100 + rank)
        ranks = rng.zipf(1.1, (a.batch * a.steps, FIELDS)) % 1_000_000
        all_keys = (ranks + np.arange(FIELDS) * 1_000_000).astype(np.int64)
    local = local_coll = None
    if a.local:
        if size != 1:
            raise SystemExit("--local: run with 1 rank")
        local = Table(dim, optimizer=optim.Adagrad(lr=0.05))
        local_coll = Collection({f"C{f}": local for f in range(FIELDS)})
    offsets = np.arange(a.batch + 1, dtype=np.int64)
    times, local_times, sent, received, model, exchange = [], [], [], [], [], []
    for s in range(a.steps):
        keys = all_keys[s * a.batch : (s + 1) * a.batch]
        batch = {f"C{f}": (np.ascontiguousarray(keys[:, f]), offsets) for f in range(FIELDS)}
        if local_coll is not None:
            t0 = time.perf_counter()
            lout = local_coll.lookup_pooled(batch)
            local_coll.apply_pooled_gradients(batch, np.full(lout.shape, 1e-3, np.float32))
            local_times.append(time.perf_counter() - t0)
        comm.Barrier()
        t0 = time.perf_counter()
        out = coll.lookup_pooled(batch)
        fwd = dict(table.last_call)
        fwd_x = table.last_exchange_seconds
        coll.apply_pooled_gradients(batch, np.full(out.shape, 1e-3, np.float32))
        comm.Barrier()
        times.append(time.perf_counter() - t0)
        exchange.append(fwd_x + table.last_exchange_seconds)
        sent.append(fwd["sent_bytes"] + table.last_call["sent_bytes"])
        received.append(fwd["received_bytes"] + table.last_call["received_bytes"])
        # Cost model (README): the lookup sends 8 B of counts to each other
        # rank, 8 B per distinct key owned elsewhere ("remote") and returns
        # 4*dim B per row other ranks asked of this one ("asked"); the step on
        # the same batch (the backward) reuses the lookup's routes and sends
        # only 4*dim B per remote key.
        uniq = np.unique(keys)
        remote = int((_core.partition_owners(uniq, size) != rank).sum())
        asked = sum(
            int((_core.partition_owners(u, size) == rank).sum())
            for r, u in enumerate(comm.allgather(uniq))
            if r != rank
        )
        model.append(8 * (size - 1) + remote * (8 + 4 * dim) + asked * 4 * dim)
    everyone = comm.gather(
        {
            "sent": float(np.mean(sent)),
            "received": float(np.mean(received)),
            "model_sent": float(np.mean(model)),
            "exchange_s": float(np.median(exchange[2:])),
            "step_s": float(np.median(times[2:])),
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
                    "ids": a.ids,
                    **(
                        {
                            "local_step_s": float(np.median(local_times[2:])),
                            "ratio_to_local": float(np.median(times[2:]))
                            / float(np.median(local_times[2:])),
                        }
                        if local_times
                        else {}
                    ),
                }
            )
        )


if __name__ == "__main__":
    main()
