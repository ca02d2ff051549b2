"""The pause of an online reshard across hosts: 4 hosts in network
namespaces joined by links of a given rate (``scripts/netlab.py``; root
only), torch.distributed gloo over TCP or MPI (``--transport mpi``:
Open MPI's TCP transport, ``Hosts.mpirun``). A dim-64 Adam table of ``--rows``
rows (a step taken, so every row has its state) on ranks 0-1 moves to all
4 (``embstore.distributed.reshard``), then to ranks 0-2 (rank 3 leaving);
each reshard's pause (the slowest rank's ``stats()["reshard"]["seconds"]``)
against the bytes the busiest link carries at the link's rate (the most a
rank sent or received)::

    python benches/reshard_hosts.py [--rows 200000] [--rate 1gbit] [--partition bucket]
        [--transport gloo|mpi]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args: argparse.Namespace) -> None:
    import netlab

    from embstore import optim
    from embstore.distributed import ShardedTable, reshard

    if args.transport == "mpi":
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        rank = world.Get_rank()
        via: Any = world
        groups = [world.Split(0 if rank < n else MPI.UNDEFINED, rank) for n in (2, 3)]
        two, three = (g if rank < n else None for g, n in zip(groups, (2, 3), strict=True))
        barrier = world.Barrier
        # Every pair of ranks connected before the clock starts (Open MPI's
        # TCP transport connects a pair at its first message).
        world.alltoall(list(range(world.Get_size())))

    else:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, via, barrier = dist.get_rank(), "torch", dist.barrier
        g2, g3 = dist.new_group([0, 1]), dist.new_group([0, 1, 2])
        size = dist.get_world_size()
        dist.all_to_all_single(torch.zeros(size), torch.arange(float(size)))
        two, three = (g2 if rank < 2 else None), (g3 if rank < 3 else None)
    maxall = netlab.maxall(args.transport)

    table = None
    if rank < 2:
        table = ShardedTable(
            64, comm=two, partition=args.partition, optimizer=optim.Adam(lr=0.01), seed=1
        )
        keys = np.arange(args.rows, dtype=np.int64)[rank::2] * 7919
        for lo in range(0, len(keys), 1 << 16):
            k = keys[lo : lo + (1 << 16)]
            table.apply_gradients(k, np.full((len(k), 64), 0.01, np.float32))
    out = []
    for label, comm in (("2 -> 4", via), ("4 -> 3", three)):
        barrier()
        t0 = time.perf_counter()
        before = table
        table = reshard(table, comm, via=via)
        wall = time.perf_counter() - t0
        held = table if table is not None else before
        r = held.last_reshard if held is not None else None
        sent = 0 if r is None else r["sent_bytes"]
        per_row = 0 if r is None or not r["sent_rows"] else r["sent_bytes"] / r["sent_rows"]
        received = 0 if r is None else r["received_rows"] * per_row
        figures = maxall(np.array([wall, float(sent), float(received)], np.float64))
        out.append([label, *figures.tolist()])
    if rank == 0:
        print(json.dumps(out), flush=True)
    if args.transport != "mpi":
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--partition", default="bucket")
    p.add_argument("--transport", choices=["gloo", "mpi"], default="gloo")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    if args.worker:
        worker(args)
        return
    import netlab

    why = netlab.available()
    if why:
        sys.exit(f"benches/reshard_hosts.py: the harness {why}")
    rate = netlab.rate_bytes(args.rate)
    with netlab.Hosts(4, args.rate) as net:
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--rows",
                str(args.rows), "--partition", args.partition, "--transport",
                args.transport]  # fmt: skip
        threads = {"RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        procs = net.launch(args.transport, argv, 29556, threads, stdout=subprocess.PIPE, text=True)
        outs = [p.communicate(timeout=1200)[0] for p in procs]
    rows = json.loads(next(ln for ln in outs[0].splitlines() if ln.startswith("[")))
    for label, wall, sent, received in rows:
        link = max(sent, received) / rate
        print(
            f"{args.transport}, {args.partition}, {args.rows} rows, {args.rate}, {label}: "
            f"pause {wall:.3f} s; "
            f"the busiest link {max(sent, received) / 1e6:.1f} MB ({link:.3f} s at the rate): "
            f"{wall / (1.5 * link + 0.1):.2f}x (1.5 x link + 100 ms)",
            flush=True,
        )


if __name__ == "__main__":
    main()
