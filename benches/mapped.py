"""The mapped table (``Table.load(path, mmap=True)``) against a loaded one:

    python benches/mapped.py [--rows 1000000] [--open-rows 10000000] [--procs 8]

1. Sharing: ``--procs`` processes open one ``--rows`` x 64 checkpoint and
   read every row (in batches of 65,536, outputs dropped), then, while all
   of them still hold it, read their private memory from
   /proc/self/smaps_rollup (Private_Clean + Private_Dirty, after minus
   before opening, kept output buffers freed). The same with ``Table.load``. Reported as a share of
   the rows' bytes.
2. Opening: the seconds to open a ``--open-rows`` x 64 checkpoint mapped,
   and to ``Table.load`` it (each in a fresh process, the files in the page
   cache).
3. Lookups: serving lookups of 1, 16, 128 and 1,024 keys (mean of 3,000
   calls, best of 5) and of 1.7M ids (best of 3) on the ``--rows`` table,
   mapped and loaded, in one process, alternated.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

import embstore

DIM = 64


def private_bytes() -> int:
    """This process's private memory (clean + dirty), from smaps_rollup."""
    total = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def save_table(path: str, rows: int) -> None:
    t = embstore.Table(DIM, seed=0)
    for lo in range(0, rows, 1 << 20):
        t.lookup(np.arange(lo, min(rows, lo + (1 << 20))))
    t.save(path, with_optimizer=False)


def reader(path: str, mmap: bool, rows: int, barrier: Any, out: Any) -> None:
    before = private_bytes()
    table = embstore.Table.load(path, mmap=mmap)
    for lo in range(0, rows, 65_536):
        table.lookup(np.arange(lo, min(rows, lo + 65_536)), insert=False)
    # Outputs are dropped; the pool keeps large output buffers for reuse
    # (embstore.free_output_buffers), which are not the table's memory.
    embstore.free_output_buffers()
    barrier.wait()  # every process holds its table now
    out.put(private_bytes() - before)
    barrier.wait()


def sharing(path: str, rows: int, procs: int, mmap: bool) -> list[int]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs)
    out = ctx.Queue()
    ps = [ctx.Process(target=reader, args=(path, mmap, rows, barrier, out)) for _ in range(procs)]
    for p in ps:
        p.start()
    got = [out.get(timeout=600) for _ in ps]
    for p in ps:
        p.join(timeout=600)
        if p.exitcode != 0:
            raise RuntimeError(f"a reader process ended with exit code {p.exitcode}")
    return got


def open_seconds(path: str, mmap: bool) -> float:
    code = (
        "import time, embstore; t0 = time.perf_counter(); "
        f"t = embstore.Table.load({path!r}, mmap={mmap}); "
        "print(time.perf_counter() - t0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def mean_us(f: Any, calls: int = 3000) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls * 1e6


def best_ms(f: Any, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def lookups(path: str, rows: int) -> dict[str, Any]:
    live = embstore.Table.load(path)
    mapped = embstore.Table.load(path, mmap=True)
    rng = np.random.default_rng(0)
    big = rng.integers(0, rows, 1_700_000)
    np.testing.assert_array_equal(mapped.lookup(big), live.lookup(big, insert=False))
    res: dict[str, Any] = {}
    for n in (1, 16, 128, 1024):
        keys = rng.integers(0, rows, n)
        for name, t in (("loaded", live), ("mapped", mapped), ("loaded", live), ("mapped", mapped)):
            us = min(mean_us(lambda t=t, k=keys: t.lookup(k, insert=False)) for _ in range(5))
            res.setdefault(f"{n}_keys_us", {}).setdefault(name, []).append(round(us, 2))
    for name, t in (("loaded", live), ("mapped", mapped), ("loaded", live), ("mapped", mapped)):
        ms = best_ms(lambda t=t: t.lookup(big, insert=False))
        res.setdefault("1.7M_ids_ms", {}).setdefault(name, []).append(round(ms, 1))
    for v in res.values():
        v["ratio"] = round(min(v["mapped"]) / min(v["loaded"]), 2)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--open-rows", type=int, default=10_000_000)
    p.add_argument("--procs", type=int, default=8)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        small = os.path.join(d, "small")
        save_table(small, args.rows)
        row_bytes = args.rows * DIM * 4
        res: dict[str, Any] = {"rows": args.rows, "dim": DIM, "procs": args.procs}
        for mmap in (True, False):
            got = sharing(small, args.rows, args.procs, mmap)
            res["private_share_" + ("mapped" if mmap else "loaded")] = [
                round(b / row_bytes, 3) for b in got
            ]
        res["lookups"] = lookups(small, args.rows)
        large = os.path.join(d, "large")
        save_table(large, args.open_rows)
        res["open_rows"] = args.open_rows
        res["open_s"] = {
            "mapped": [open_seconds(large, True) for _ in range(3)],
            "loaded": [open_seconds(large, False) for _ in range(2)],
        }
        res["open_ratio"] = round(min(res["open_s"]["mapped"]) / min(res["open_s"]["loaded"]), 4)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
