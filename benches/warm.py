"""2,000-key lookups of a large mapped table: saved by ``save``, copied by
``shutil.copytree`` (the page cache then holds the copy in 4 KiB pages),
and the same copy opened with ``warm=True``:

    python benches/warm.py [--rows 10000000] [--dim 64] [--rounds 2] [--dir DIR]

A table of ``--rows`` rows is saved under ``--dir`` once (kept there and
reused). Each round runs the three cases in turn, each in a fresh process
(a fresh copy for each copy case): open, read every row once, then
2,000-key lookups of keys spread over the table for 3 s. Prints per case
the open's seconds, the share of the map on 2 MiB pages
(``FilePmdMapped`` over ``Rss`` in ``/proc/self/smaps``), p50 and p99 of a
call, and JSON of every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

import embstore
from embstore.bench._timing import machine_facts

CALL_KEYS = 2_000


def huge_share(path: str) -> float:
    """Of this process's resident pages of files under ``path``, the share
    mapped with 2 MiB pages."""
    rss = pmd = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith(".safetensors") and path in line
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1])
            elif inside and line.startswith("FilePmdMapped:"):
                pmd += int(line.split()[1])
    return pmd / rss if rss else 0.0


def child(path: str, rows: int, warm: bool, seconds: float) -> dict[str, float]:
    t0 = time.perf_counter()
    table = embstore.MappedTable(path, warm=warm)
    opened = time.perf_counter() - t0
    for lo in range(0, rows, 1 << 20):
        table.lookup(np.arange(lo, min(rows, lo + (1 << 20))))
    rng = np.random.default_rng(100)
    calls = [rng.integers(0, rows, CALL_KEYS) for _ in range(1024)]
    lat = []
    end = time.perf_counter() + seconds
    i = 0
    while (t := time.perf_counter()) < end:
        table.lookup(calls[i % len(calls)])
        lat.append(time.perf_counter() - t)
        i += 1
    p50, p99 = np.percentile(np.asarray(lat) * 1e6, [50, 99])
    return {
        "open_s": opened,
        "huge_share": huge_share(os.path.realpath(path)),
        "p50_us": float(p50),
        "p99_us": float(p99),
        "calls": i,
    }


def run_case(path: str, rows: int, warm: bool) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", path, "--rows", str(rows)]
    if warm:
        cmd.append("--warm")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default="/tmp/embstore-warm-bench")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.rows, a.warm, 3.0)))
        return 0
    saved = os.path.join(a.dir, f"saved-{a.rows}-{a.dim}")
    if not os.path.exists(os.path.join(saved, "manifest.json")):
        t = embstore.Table(a.dim, seed=1)
        for lo in range(0, a.rows, 1 << 20):
            t.lookup(np.arange(lo, min(a.rows, lo + (1 << 20))))
        t.save(saved, with_optimizer=False)
        del t
    copy = os.path.join(a.dir, "copy")
    cases: dict[str, list[dict[str, float]]] = {"saved": [], "copy": [], "copy, warm=True": []}
    for _ in range(a.rounds):
        for name in cases:
            shutil.rmtree(copy, ignore_errors=True)
            path = saved
            if name != "saved":
                shutil.copytree(saved, copy)
                path = copy
            cases[name].append(run_case(path, a.rows, name.endswith("warm=True")))
    shutil.rmtree(copy, ignore_errors=True)
    m = machine_facts()
    print(
        f"Machine: {m['cpu']}, {m['cores']} cores, SIMD {m['simd']}, THP {m['thp']}; "
        f"{a.rows:,} rows of dim {a.dim}, {CALL_KEYS:,}-key lookups, {a.rounds} rounds"
    )
    for name, runs in cases.items():
        cells = ", ".join(
            f"open {r['open_s']:.2f} s, 2 MiB pages {r['huge_share']:.2f}, "
            f"p50 {r['p50_us']:.0f} us, p99 {r['p99_us']:.0f} us"
            for r in runs
        )
        print(f"{name:>16}: {cells}")
    print(json.dumps({"machine": m, "rows": a.rows, "dim": a.dim, "cases": cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
