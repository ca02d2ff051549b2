"""Checkpoints under concurrency, repeated (issue 13):

1. two processes saving different tables to one path at once, N trials:
   after each, the directory loads whole and is one of the two tables;
2. a process loading in a loop while another saves in a loop, N trials:
   every load succeeds and gets one whole checkpoint, old or new.

    python benches/checkpoint_trials.py [--trials 20] [--rows 300000]

Prints one line per trial and the totals; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import embstore

SAVER = """
import sys, numpy as np, embstore
from embstore import optim
path, tag, rounds, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t = embstore.Table(8, optimizer=optim.SGD(lr=0.5), num_shards=16)
t.assign(np.arange(n), np.full((n, 8), float(tag), np.float32))
for _ in range(rounds):
    t.save(path)
"""


def saver(path: Path, tag: int, rounds: int, n: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", SAVER, str(path), str(tag), str(rounds), str(n)])


def whole(path: Path, n: int, tags: set[float]) -> float:
    keys, rows = embstore.Table.load(path).export()
    if not np.array_equal(keys, np.arange(n)):
        raise AssertionError(f"{path}: {len(keys)} keys, expected {n}")
    vals = set(np.unique(rows).tolist())
    if len(vals) != 1 or not vals <= tags:
        raise AssertionError(f"{path}: rows mix {sorted(vals)}")
    return vals.pop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--rows", type=int, default=300_000)
    args = ap.parse_args()
    n, failures = args.rows, 0
    root = Path(tempfile.mkdtemp(prefix="embstore-trials-"))
    try:
        for trial in range(args.trials):
            path = root / f"two-savers-{trial}"
            procs = [saver(path, tag, 5, n) for tag in (1, 2)]
            rcs = [p.wait(timeout=600) for p in procs]
            try:
                winner = whole(path, n, {1.0, 2.0})
                head = f"two savers, trial {trial + 1}"
                print(f"{head}: exit codes {rcs}, loads whole (table {winner:g})")
                failures += any(rcs)
            except Exception as e:  # reported and counted
                print(f"two savers, trial {trial + 1}: FAILED: {e}")
                failures += 1
        for trial in range(args.trials):
            path = root / f"load-while-save-{trial}"
            first = saver(path, 1, 1, n)
            first.wait(timeout=600)
            p = saver(path, 2, 10, n)
            loads, errors, seen = 0, 0, set()
            t0 = time.monotonic()
            while p.poll() is None:
                try:
                    seen.add(whole(path, n, {1.0, 2.0}))
                    loads += 1
                except Exception as e:  # reported and counted
                    errors += 1
                    print(f"  load failed: {e}")
            rc = p.wait()
            try:
                seen.add(whole(path, n, {1.0, 2.0}))
            except Exception as e:
                errors += 1
                print(f"  final load failed: {e}")
            print(
                f"load while saving, trial {trial + 1}: {loads} loads in "
                f"{time.monotonic() - t0:.1f} s, {errors} failed, saver exit {rc}, "
                f"saw tables {sorted(seen)}"
            )
            failures += errors + (rc != 0)
            shutil.rmtree(path, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"total: {2 * args.trials} trials, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
