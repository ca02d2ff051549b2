"""The memory a disk table uses, against the formula the README gives:
``python benches/disk_memory.py [--threads 1 2 8] [--limit]``.

Each run is a process of its own (``RAYON_NUM_THREADS`` pool threads) in a
cgroup v1 memory group (root; it counts the page cache) that goes through a
disk table's life: inserts, one lookup of 4x ``memory_bytes`` of rows,
training, a full and an incremental save, ``export``, and a load of the
checkpoint as a disk table that trains on. The group's peak
(``memory.max_usage_in_bytes``) is reported beside the formula

    baseline + memory_bytes + index + call + overhead

where ``baseline`` is the process before its first table (Python, NumPy,
embstore), ``index`` is ``stats()["bytes"] - memory rows' bytes +
stats()["disk_index_bytes"]`` at its largest, ``call`` the largest call's
own inputs and outputs (here ``export``'s keys and rows), and ``overhead``
the fixed part (README: "The memory a disk table uses"). With ``--limit``
the group's limit is the formula itself, so a run that passes it is killed
(the test ``tests/test_disk_memory.py`` runs this way). Prints one JSON
object per run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
DIM = 64
MIB = 1 << 20


def overhead(threads: int) -> int:
    """The fixed overhead of a disk table's calls (README): 48 MiB, and
    24 MiB a pool thread (a save's write piece, a file's keys and index;
    a load's file read whole)."""
    return 48 * MIB + threads * 24 * MIB


INDEX_ROW = 64  # bytes a row of the indexes, in memory and on disk, at most


def sizes(memory_mb: int, rows: int, cost: int, batch: int = 65_536) -> dict[str, int]:
    """The run's figures the formula needs, from its settings alone: rows
    in all, the largest call's inputs and outputs (``export``: its keys and
    rows), and the output buffers the binding keeps for reuse (the four
    largest outputs: the 4x call, ``export``'s rows, two lookups)."""
    mem = memory_mb * MIB
    big = 4 * mem // cost
    total = rows + big
    lookup = max(65_536, batch) * DIM * 4  # the inserts' calls and the steps'
    kept = sorted([big * DIM * 4, total * DIM * 4, lookup, lookup])[-4:]
    return {"big": big, "total": total, "call": total * (8 + DIM * 4), "kept": sum(kept)}


def formula(
    baseline: int, memory_mb: int, rows: int, cost: int, threads: int, batch: int = 65_536
) -> int:
    """``baseline + memory_bytes + index + call + kept + overhead``."""
    z = sizes(memory_mb, rows, cost, batch)
    index = z["total"] * INDEX_ROW
    return baseline + memory_mb * MIB + index + z["call"] + z["kept"] + overhead(threads)


def child(args: argparse.Namespace) -> None:
    import embstore
    from embstore import optim

    work = Path(args.dir)
    baseline = _rss()
    settings: dict[str, Any] = {"optimizer": optim.Adam(lr=0.01), "seed": 1}
    t = embstore.Table(DIM, disk=work / "spill", memory_bytes=args.memory_mb * MIB, **settings)
    cost = t.stats()["row_cost"]
    mem = args.memory_mb * MIB
    index = 0

    def note(phase: str = "") -> None:
        nonlocal index
        s = t.stats()
        print(
            f"{phase} rss {_rss() / MIB:.0f} MiB, bytes {s['bytes'] / MIB:.0f} MiB, "
            f"memory rows {s['memory_rows']}, disk index {s['disk_index_bytes'] / MIB:.0f} MiB",
            file=sys.stderr,
            flush=True,
        )
        index = max(index, s["bytes"] - s["memory_rows"] * cost + s["disk_index_bytes"])

    rng = np.random.default_rng(3)
    for at in range(0, args.rows, 65_536):
        t.lookup(np.arange(at, min(at + 65_536, args.rows)))
    note("inserts")
    big = sizes(args.memory_mb, args.rows, cost)["big"]  # 4x memory_bytes of rows, all new
    t.lookup(np.arange(args.rows, args.rows + big))
    note("big call")
    total = args.rows + big
    for _ in range(args.steps):
        keys = rng.integers(0, total, args.batch)
        t.lookup(keys)
        t.apply_gradients(keys, np.ones((len(keys), DIM), np.float32))
    note("training")
    t.save(work / "ckpt")
    note("full save")
    for _ in range(args.steps):
        keys = rng.integers(0, total, args.batch)
        t.lookup(keys)
        t.apply_gradients(keys, np.ones((len(keys), DIM), np.float32))
    t.save(work / "ckpt", incremental=True)
    note("incremental save")
    keys, rows = t.export()
    call = keys.nbytes + rows.nbytes
    note("export")
    del keys, rows
    del t
    t = embstore.Table.load(work / "ckpt", disk=work / "spill2", memory_bytes=mem)
    for _ in range(2):
        keys = rng.integers(0, total, args.batch)
        t.lookup(keys)
        t.apply_gradients(keys, np.ones((len(keys), DIM), np.float32))
    note("load and train")
    print(
        json.dumps(
            {
                "baseline": baseline,
                "memory_bytes": mem,
                "index": index,
                "call": call,
                "rows": total,
                "row_cost": cost,
            }
        )
    )


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def baseline_and_cost() -> tuple[int, int]:
    """A process's resident bytes once Python, NumPy and embstore are in,
    and the row cost of the run's table (a process of its own)."""
    here, spill = str(Path(__file__).parent), tempfile.gettempdir()
    code = (
        f"import numpy, embstore, sys; sys.path.insert(0, {here!r}); "
        "import disk_memory as d; from embstore import optim; rss = d._rss(); "
        f"t = embstore.Table(d.DIM, optimizer=optim.Adam(), disk={spill!r}, "
        "memory_bytes=1 << 20); print(rss, t.stats()['row_cost'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    rss, cost = out.stdout.split()
    return int(rss), int(cost)


def run(threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run in a fresh cgroup; its figures and the group's peak."""
    group = CGROUP_ROOT / f"embstore-disk-memory-{os.getpid()}-{threads}"
    work = Path(tempfile.mkdtemp(prefix="embstore-disk-memory-", dir=args.tmp))
    base, cost = baseline_and_cost()
    limit = formula(base, args.memory_mb, args.rows, cost, threads, args.batch)
    group.mkdir()
    try:
        if args.limit:
            # The formula, from the settings alone: what a user computes.
            (group / "memory.limit_in_bytes").write_text(str(limit))
        cmd = [sys.executable, __file__, "--child", "--dir", str(work)]
        cmd += ["--memory-mb", str(args.memory_mb), "--rows", str(args.rows)]
        cmd += ["--steps", str(args.steps), "--batch", str(args.batch)]
        env = {**os.environ, "RAYON_NUM_THREADS": str(threads)}
        start = time.monotonic()
        proc = subprocess.Popen(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        out, err = proc.communicate(timeout=args.timeout)
        peak = int((group / "memory.max_usage_in_bytes").read_text())
        failcnt = int((group / "memory.failcnt").read_text())
        result: dict[str, Any] = {
            "threads": threads,
            "rc": proc.returncode,
            "peak_mib": round(peak / MIB, 1),
            "formula_mib": round(limit / MIB, 1),
            "peak_over_formula": round(peak / limit, 3),
            "limited": bool(args.limit),
            "limit_hits": failcnt,
            "seconds": round(time.monotonic() - start, 1),
            "phases": [line for line in err.splitlines() if " rss " in line],
        }
        if proc.returncode != 0:
            result["stderr"] = err[-2000:]
            return result
        got = json.loads(out.strip().splitlines()[-1])
        result.update(
            {k: v if k in ("rows", "row_cost") else round(v / MIB, 1) for k, v in got.items()}
        )
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--memory-mb", type=int, default=64)
    p.add_argument("--rows", type=int, default=400_000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=65_536, help="ids a training step")
    p.add_argument("--limit", action="store_true", help="the group's limit is the formula")
    p.add_argument("--tmp", default=None, help="where the spill and checkpoint go")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    for n in args.threads:
        print(json.dumps(run(n, args)), flush=True)


if __name__ == "__main__":
    main()
