"""The host half of a ServingCache call: ``SlotMap.serve_into`` (a call's
slots, its misses' rows from the mapped table and their admissions, written
into the staging buffer the device copy reads) on the sizes of
``benches/gpu_cache.py``'s serving part: 2,000-key calls over a mapped
4M-key dim-64 table, a slot map of 400,000 rows. Its keys are NumPy's
unbounded Zipf 1.05 ranks clipped at the last one (which so takes the
tail's mass) and scattered by a permutation: hit rate 0.910, where
gpu_cache.py's bounded Zipf gives 0.856. No GPU needed; the figures of
"The serving call's host half" in RESULTS.md:

    python benches/slot_serve.py [--baseline DIR] [--rounds 3] [--threads 1,2]

Each build (this one, and the embstore under ``--baseline DIR`` when given)
runs in a fresh process per round and per rayon thread count, the builds in
turn. Per run: p50 / p99 of 3,000 Zipf calls after 500, of 1,000 calls of
cached keys alone (uniform over the held keys), and the mapped table's own
lookup of the same Zipf calls.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

CHILD = r"""
import json, sys, time
import numpy as np
import embstore
from embstore._core import SlotMap, staging_bytes

keys, dim, n, rows = int(sys.argv[1]), 64, 2_000, 400_000
t = embstore.Table(dim, seed=5)
every = np.arange(keys, dtype=np.int64)
for a in range(0, keys, 1 << 20):
    t.lookup(every[a : a + (1 << 20)])
d = sys.argv[2]  # the parent's temporary directory
t.save(d, with_optimizer=False)
del t
mapped = embstore.MappedTable(d)
sm = SlotMap(rows, "lfu")
host = np.empty(staging_bytes(n, dim), np.uint8)
rng = np.random.default_rng(3)
ranks = np.minimum(rng.zipf(1.05, (3_500, n)), keys) - 1
perm = rng.permutation(keys)
batches = [perm[r].astype(np.int64) for r in ranks]
tick = 0

def call(b):
    global tick
    tick += 1
    return sm.serve_into(b, tick, mapped._inner, host, "zeros", None, False)

def pcts(lat):
    us = np.array(lat) * 1e6
    return [float(np.percentile(us, 50)), float(np.percentile(us, 99))]

for b in batches[:500]:
    call(b)
lat, misses = [], 0
for b in batches[500:]:
    t0 = time.perf_counter()
    misses += call(b)[0]
    lat.append(time.perf_counter() - t0)
held = sm.items()[0]
only = []
for _ in range(1_000):
    b = held[rng.integers(0, held.size, n)]
    t0 = time.perf_counter()
    call(b)
    only.append(time.perf_counter() - t0)
alone = []
for b in batches[500:1_500]:
    t0 = time.perf_counter()
    mapped.lookup(b)
    alone.append(time.perf_counter() - t0)
print(json.dumps({"serve": pcts(lat), "hit_rate": 1 - misses / (3_000 * n),
                  "cached_only": pcts(only), "mapped_alone": pcts(alone)}))
"""


def child(pythonpath: str | None, threads: int, keys: int) -> dict[str, Any]:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # The run's 1 GB checkpoint, removed however the run ends.
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(keys), d],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
    if out.returncode != 0:
        raise SystemExit(f"slot_serve: a run exited with {out.returncode}:\n{out.stderr}")
    return dict(json.loads(out.stdout))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="directory holding the other embstore")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="rayon thread counts, comma-separated")
    ap.add_argument("--keys", type=int, default=4_000_000, help="keys of the mapped table")
    args = ap.parse_args()
    builds: dict[str, str | None] = {"this": None}
    if args.baseline:
        builds["baseline"] = args.baseline
    for threads in (int(x) for x in args.threads.split(",")):
        for r in range(args.rounds):
            order = list(builds) if r % 2 == 0 else list(reversed(builds))
            for b in order:
                got = child(builds[b], threads, args.keys)
                s, c, m = got["serve"], got["cached_only"], got["mapped_alone"]
                print(
                    f"{threads} thread(s), round {r + 1}, {b}: serve p50 {s[0]:.1f} p99 "
                    f"{s[1]:.1f} us (hit rate {got['hit_rate']:.3f}); cached keys alone p50 "
                    f"{c[0]:.1f} p99 {c[1]:.1f}; the mapped table alone p50 {m[0]:.1f} "
                    f"p99 {m[1]:.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
