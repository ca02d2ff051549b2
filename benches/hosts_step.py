"""The sharded step across hosts: N ranks in N network namespaces joined by
links of a given rate (``scripts/netlab.py``; root only), over
torch.distributed (gloo over TCP) or MPI (``--transport mpi``: Open MPI's
TCP transport, ``Hosts.mpirun``), each rank's step a lookup and an Adam
step of its own 65,536 Zipf(1.1) ids over 1M keys at dim 64. Each rank also
times the same batch on a local Table (the two alternating); rank 0 prints
the median sharded step against (the bytes a rank puts on its link at the
link's rate + the local step), per wire dtype::

    python benches/hosts_step.py [--ranks 2] [--rate 1gbit] [--wire float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args: argparse.Namespace) -> None:
    import netlab

    from embstore import Table, optim
    from embstore.distributed import ShardedTable

    if args.transport == "mpi":
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        comm: Any = world
        rank, size = world.Get_rank(), world.Get_size()
        barrier = world.Barrier

    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        comm, rank, size = "torch", dist.get_rank(), dist.get_world_size()
        barrier = dist.barrier
    maxall = netlab.maxall(args.transport)

    dim, n = 64, args.batch
    rng = np.random.default_rng(100 + rank)
    batches = [
        (rng.zipf(1.1, n) % 1_000_000).astype(np.int64) for _ in range(args.steps + args.warmup)
    ]
    grads = rng.standard_normal((n, dim), dtype=np.float32) * 0.01
    # A pass not timed: the first tables of a process pay its page faults.
    warm = ShardedTable(dim, comm=comm, optimizer=optim.Adam(lr=0.01), seed=1)
    warm_local = Table(dim, optimizer=optim.Adam(lr=0.01), seed=1)
    for keys in batches:
        warm.lookup(keys)
        warm.apply_gradients(keys, grads)
        warm_local.lookup(keys)
        warm_local.apply_gradients(keys, grads)
    del warm, warm_local
    out = {}
    for i, wire in enumerate(args.wire):
        t = ShardedTable(dim, comm=comm, optimizer=optim.Adam(lr=0.01), seed=1, wire_dtype=wire)
        local = Table(dim, optimizer=optim.Adam(lr=0.01), seed=1)
        steps, local_steps, sent = [], [], []
        for s, keys in enumerate(batches):
            t0 = time.perf_counter()
            local.lookup(keys)
            local.apply_gradients(keys, grads)
            t1 = time.perf_counter()
            barrier()
            t2 = time.perf_counter()
            t.lookup(keys)
            moved = t.last_call["sent_bytes"]
            t.apply_gradients(keys, grads)
            moved += t.last_call["sent_bytes"]
            t3 = time.perf_counter()
            if s >= args.warmup:
                local_steps.append(t1 - t0)
                steps.append(t3 - t2)
                sent.append(moved)
        med = np.array(
            [np.median(steps), np.median(local_steps), np.median(sent)], dtype=np.float64
        )
        out[f"{wire} #{i + 1}"] = maxall(med).tolist()
        for kind in args.overlap:
            out[f"{wire} #{i + 1} overlap {kind}"] = _overlap(t, batches, barrier, maxall, kind)
    if rank == 0:
        print(json.dumps({"ranks": size, "steps": out}), flush=True)
    if args.transport != "mpi":
        dist.destroy_process_group()


def _overlap(
    t: Any, batches: list[np.ndarray], barrier: Any, maxall: Any, kind: str
) -> list[float]:
    """The next batch's lookup started ahead of a dense compute (a float32
    matmul chain sized to take about as long as the lookup alone), against
    the two alone: [lookup, compute, lookup_async + compute + wait, the
    lookup's CPU time] medians, the largest of the ranks'. The CPU time
    (this process's user + system time over a lookup alone: its own
    threads, gloo's or Open MPI's, the kernel's TCP work charged to it) is
    what a compute on the same core cannot hide. ``kind`` "device": the
    compute is a wait as long (a dense step on an accelerator, the host's
    core free meanwhile)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 512), dtype=np.float32)

    def matmuls(reps: int) -> None:
        x = a
        for _ in range(reps):
            x = np.tanh(x @ a * 0.01)

    def compute(reps: int) -> None:
        if kind == "device":
            time.sleep(reps * per_rep)
        else:
            matmuls(reps)

    lookups, computes, both, cpu = [], [], [], []
    t0 = time.perf_counter()
    matmuls(10)
    per_rep = (time.perf_counter() - t0) / 10
    for keys in batches[:3]:
        barrier()
        t0 = time.perf_counter()
        t.lookup(keys)
        lookups.append(time.perf_counter() - t0)
    reps = max(1, int(np.median(lookups) / per_rep))
    for keys in batches:
        barrier()
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        t.lookup(keys)
        t1 = time.perf_counter()
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime)
        compute(reps)
        t2 = time.perf_counter()
        barrier()
        t3 = time.perf_counter()
        pending = t.lookup_async(keys)
        compute(reps)
        pending.wait()
        t4 = time.perf_counter()
        lookups.append(t1 - t0)
        computes.append(t2 - t1)
        both.append(t4 - t3)
    med = np.array([np.median(lookups), np.median(computes), np.median(both), np.median(cpu)])
    return [float(x) for x in maxall(med)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--wire", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--transport", choices=["gloo", "mpi"], default="gloo")
    p.add_argument(
        "--overlap",
        nargs="*",
        choices=["cpu", "device"],
        help="also a lookup started ahead of a dense compute as long as it: on the "
        "rank's core (cpu, the default) or a wait as long (device: an accelerator's step)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.overlap == []:
        args.overlap = ["cpu"]
    args.overlap = args.overlap or []
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    if args.worker:
        worker(args)
        return
    import netlab

    why = netlab.available()
    if why:
        sys.exit(f"benches/hosts_step.py: the harness {why}")
    worker_args = ["--batch", str(args.batch), "--steps", str(args.steps), "--warmup",
                   str(args.warmup), "--transport", args.transport,
                   *(["--overlap", *args.overlap] if args.overlap else []),
                   "--wire", *args.wire]  # fmt: skip
    threads = {
        "RAYON_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.ranks)),
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }
    with netlab.Hosts(args.ranks, args.rate) as net:
        argv = [sys.executable, os.path.abspath(__file__), "--worker", *worker_args]
        procs = net.launch(args.transport, argv, 29555, threads, stdout=subprocess.PIPE, text=True)
        outs = [p.communicate(timeout=1200)[0] for p in procs]
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("{"))
    result = json.loads(line)
    rate = netlab.rate_bytes(args.rate)
    for wire, figures in result["steps"].items():
        if " overlap " in wire:
            lookup, compute, both, cpu = figures
            longer = max(lookup, compute)
            print(
                f"{args.transport}, ranks {args.ranks}, {args.rate}, {wire}: "
                f"lookup {lookup * 1e3:.0f} ms ({cpu * 1e3:.0f} ms of CPU), "
                f"compute {compute * 1e3:.0f} ms, lookup_async + compute + wait "
                f"{both * 1e3:.0f} ms: {both / longer:.2f}x the longer"
                + (
                    f" (at best {max(longer, compute + cpu) / longer:.2f}x on a shared core)"
                    if wire.endswith("cpu")
                    else ""
                ),
                flush=True,
            )
            continue
        step, local, sent = figures
        link = sent / rate
        print(
            f"{args.transport}, ranks {args.ranks}, {args.rate}, wire {wire:<11}: "
            f"step {step * 1e3:.0f} ms, "
            f"{sent / 1e6:.2f} MB sent a rank ({link * 1e3:.0f} ms at the link's rate), "
            f"local step {local * 1e3:.0f} ms: {step / (link + local):.2f}x (link + local)",
            flush=True,
        )


if __name__ == "__main__":
    main()
