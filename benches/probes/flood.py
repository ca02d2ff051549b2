"""A flood of one-off keys through CountFilter(min_count=2): resident memory
growth, early admissions and the sketch's error bound. Prints JSON.

Run as its own process (tests/test_policy_memory.py) so that the heap of a
test session does not blur the resident-memory figures.
"""

from __future__ import annotations

import gc
import json
import math
import sys

import numpy as np

import embstore
from embstore import optim, policy


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main(n: int, width: int, depth: int) -> None:
    b = 1_000_000
    grads = np.ones((b, 8), np.float32)
    base = np.arange(b, dtype=np.int64)
    keys = np.empty(b, np.int64)
    # Warm-up: the same calls on a table whose sketch never admits (kept
    # alive), so the allocator holds a call's temporaries before the baseline.
    warm = embstore.Table(
        8, optimizer=optim.SGD(lr=0.1), admission=policy.CountFilter(255, width=1024, depth=depth)
    )
    for i in range(2):
        np.add(base, (1 << 50) + i * b, out=keys)
        warm.apply_gradients(keys, grads)
    gc.collect()

    t = embstore.Table(
        8, optimizer=optim.SGD(lr=0.1), admission=policy.CountFilter(2, width=width, depth=depth)
    )
    r0 = rss()
    for i in range(n // b):
        np.add(base, i * b, out=keys)
        t.apply_gradients(keys, grads)
    growth = rss() - r0
    s = t.stats()

    # Fresh keys seen once, then twice.
    fresh = np.arange(200_000, dtype=np.int64) + (1 << 40)
    t.apply_gradients(fresh, grads[: len(fresh)])
    est = t.admission_counts(fresh)
    present = t.contains(fresh)
    t.apply_gradients(fresh, grads[: len(fresh)])
    present2 = t.contains(fresh)
    shards = t.num_shards
    per_shard_width = math.ceil(width / shards)
    sightings_per_shard = (n + len(fresh)) / shards
    bound = math.e * sightings_per_shard / per_shard_width
    json.dump(
        {
            "rows": len(t) - int(present2.sum()),
            "flood_rows": s["rows"],
            "bytes": s["bytes"],
            "sketch_bytes": s["sketch_bytes"],
            "rss_growth": growth,
            "rejected": s["rejected"],
            "admitted": s["admitted"],
            "decided_by_sketch": bool(np.array_equal(present, est >= 2)),
            "early_fraction": float(present.mean()),
            "all_admitted_on_second": bool(present2.all()),
            "overcount_bound": bound,
            "over_bound_fraction": float(np.mean(est.astype(np.float64) - 1 > bound)),
            "theory_early": (1 - math.exp(-n / width)) ** depth,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
