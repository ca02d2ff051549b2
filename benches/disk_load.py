"""A checkpoint larger than memory, opened as a disk table:
``python benches/disk_load.py``.

Makes a checkpoint of ``--keys`` rows of dim ``--dim`` with Adam state (in
memory, without a limit; kept between runs at ``--checkpoint``), then, in
a process under a cgroup v1 memory limit of ``--limit-mb`` that counts the
page cache, loads it with ``Table.load(path, disk=..., memory_bytes=...)``,
trains ``--steps`` steps of Zipf(1.05) batches and saves incrementally.
Prints the load's rate (checkpoint bytes over seconds), the disk's
sequential read rate (``dd`` of the checkpoint's files with O_DIRECT), and
the process's peak memory. ``--quick`` checks the script at a small size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

CGROUP = Path("/sys/fs/cgroup/memory/embstore-disk-load")


def make(args: argparse.Namespace) -> dict[str, Any]:
    import embstore
    from embstore import optim

    t = embstore.Table(args.dim, optimizer=optim.Adam(lr=1e-3), seed=1)
    t0 = time.perf_counter()
    for start in range(0, args.keys, 1 << 18):
        keys = np.arange(start, min(args.keys, start + (1 << 18)), dtype=np.int64)
        t.lookup(keys)
    made = time.perf_counter() - t0
    t.save(args.checkpoint)
    return {"made_s": made, "saved_s": time.perf_counter() - t0 - made}


def hwm_mb() -> float:
    """The process's peak resident memory so far (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def load(args: argparse.Namespace) -> dict[str, Any]:
    import embstore

    if args.limit_mb:
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
    size = sum(f.stat().st_size for f in Path(args.checkpoint).iterdir())
    t0 = time.perf_counter()
    t = embstore.Table.load(args.checkpoint, disk=args.disk, memory_bytes=args.memory_mb << 20)
    loaded = time.perf_counter() - t0
    hwm_load = hwm_mb()
    st = t.stats()
    rng = np.random.default_rng(0)
    grads = rng.standard_normal((args.batch, args.dim)).astype(np.float32) * 0.01
    steps = []
    for _ in range(args.steps):
        batch = (rng.zipf(1.05, args.batch) % args.keys).astype(np.int64)
        s = time.perf_counter()
        t.lookup(batch)
        t.apply_gradients(batch, grads)
        steps.append(time.perf_counter() - s)
    s = time.perf_counter()
    t.save(args.checkpoint, incremental=True)
    saved = time.perf_counter() - s
    full = None
    if args.full_save:
        # Every row written again (most read from the checkpoint's own
        # files), in the same process under the same limit.
        import shutil

        shutil.rmtree(args.full_save, ignore_errors=True)
        s = time.perf_counter()
        t.save(args.full_save)
        full = time.perf_counter() - s
        shutil.rmtree(args.full_save, ignore_errors=True)
    out = {
        "checkpoint_bytes": size,
        "load_s": loaded,
        "load_mb_per_s": size / loaded / 2**20,
        "rows": st["rows"],
        "memory_rows": st["memory_rows"],
        "disk_rows": st["disk_rows"],
        "disk_index_bytes": st["disk_index_bytes"],
        "step_ms_median": 1000 * float(np.median(steps)),
        "incremental_save_s": saved,
        "full_save_s": full,
        "peak_resident_mb_load": hwm_load,
        "peak_resident_mb": hwm_mb(),
    }
    peak = CGROUP / "memory.max_usage_in_bytes"
    if args.limit_mb and peak.exists():
        out["cgroup_peak_mb"] = int(peak.read_text()) / 2**20
    return out


def sequential_rate(path: Path) -> float:
    """MB/s reading the checkpoint's files with O_DIRECT (dd)."""
    total, t0 = 0, time.perf_counter()
    for f in sorted(path.iterdir()):
        if f.suffix == ".safetensors":
            subprocess.run(
                ["dd", f"if={f}", "of=/dev/null", "bs=4M", "iflag=direct"],
                check=True,
                capture_output=True,
            )
            total += f.stat().st_size
    return total / (time.perf_counter() - t0) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=13_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--limit-mb", type=int, default=2048)
    p.add_argument("--memory-mb", type=int, default=512)
    p.add_argument("--batch", type=int, default=65_536)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--checkpoint", default="/tmp/embstore-big-checkpoint")
    p.add_argument("--disk", default="/tmp/embstore-big-disk")
    p.add_argument("--full-save", default=None, help="also time a full save to this directory")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--part", choices=["make", "load"], default=None)
    args = p.parse_args()
    if args.quick:
        args.keys, args.limit_mb, args.memory_mb, args.steps = 200_000, 0, 16, 3
        args.batch = 4096
        args.checkpoint += "-quick"
    if args.part == "make":
        print(json.dumps(make(args)))
        return
    if args.part == "load":
        print(json.dumps(load(args)))
        return
    base = [sys.executable, __file__, *sys.argv[1:]]
    made = None
    if not (Path(args.checkpoint) / "manifest.json").exists():
        made = json.loads(
            subprocess.run(
                [*base, "--part", "make"], check=True, capture_output=True, text=True
            ).stdout
        )
    if args.limit_mb:
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "memory.limit_in_bytes").write_text(str(args.limit_mb << 20))
        (CGROUP / "memory.max_usage_in_bytes").write_text("0")
    run = subprocess.run([*base, "--part", "load"], capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"the load failed ({run.returncode})")
    out = {
        "args": vars(args),
        "made": made,
        "load": json.loads(run.stdout),
        "sequential_mb_per_s": sequential_rate(Path(args.checkpoint)),
    }
    out["load_over_sequential"] = out["load"]["load_mb_per_s"] / out["sequential_mb_per_s"]
    out["checkpoint_over_limit"] = (
        out["load"]["checkpoint_bytes"] / (args.limit_mb << 20) if args.limit_mb else None
    )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
