"""Resident-memory growth of a table of N rows against its stats()["bytes"].
Prints JSON. Run as its own process (tests/test_policy_memory.py)."""

from __future__ import annotations

import gc
import json
import sys

import numpy as np

import embstore
from embstore import optim


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def huge() -> int:
    """Bytes of anonymous memory in transparent huge pages."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main(n: int, dim: int, dtype: str, capacity: bool, adagrad: bool) -> None:
    b = 1_000_000
    base = np.arange(b, dtype=np.int64)
    keys = np.empty(b, np.int64)  # one key buffer, so that no batch allocates

    def fill(t: embstore.Table, start: int) -> None:
        for i in range(start, start + n, b):
            np.add(base, i, out=keys)
            t.lookup(keys[: min(b, start + n - i)])

    kwargs = dict(
        optimizer=optim.Adagrad(lr=0.1) if adagrad else None,
        dtype=dtype,
        capacity=n + 1 if capacity else None,
    )
    # Warm-up: calls of the same size on a table of few rows, kept alive, so
    # the allocator holds a call's temporaries before the baseline is taken
    # and no freed table memory is there to be reused.
    warm = embstore.Table(dim, **kwargs)  # type: ignore[arg-type]
    np.remainder(base, 1000, out=keys)
    for _ in range(2):
        warm.lookup(keys)
    gc.collect()
    t = embstore.Table(dim, **kwargs)  # type: ignore[arg-type]
    before = t.stats()["bytes"]
    r0, h0 = rss(), huge()
    fill(t, 0)
    growth = rss() - r0
    huge_growth = huge() - h0
    s = t.stats()
    json.dump(
        {
            "rows": s["rows"],
            "bytes": s["bytes"] - before,
            "rss_growth": growth,
            "huge_growth": huge_growth,
            "num_shards": s["num_shards"],
            "columns": 2 if adagrad else 1,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", sys.argv[5] == "1")
