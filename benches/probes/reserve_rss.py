"""Resident memory around Table.reserve: the reservation maps its memory
up front, and inserting the reserved rows afterwards maps little more.
Prints JSON. Run as its own process (tests/test_reserve.py)."""

from __future__ import annotations

import json
import sys

import numpy as np

import embstore
from embstore import optim


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main(n: int, dim: int) -> None:
    keys = np.arange(n, dtype=np.int64) * 7 + 3
    grads = np.zeros((100_000, dim), np.float32)
    t = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3))
    # Warm-up on another table: the calls' temporaries are allocated once.
    warm = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3))
    for i in range(0, n, 100_000):
        warm.apply_gradients(keys[i : i + 100_000] % 1000, grads[: len(keys[i : i + 100_000])])
    b0, r0 = t.stats()["bytes"], rss()
    t.reserve(n)
    b1, r1 = t.stats()["bytes"], rss()
    for i in range(0, n, 100_000):
        k = keys[i : i + 100_000]
        t.apply_gradients(k, grads[: len(k)])
    b2, r2 = t.stats()["bytes"], rss()
    json.dump(
        {
            "rows": len(t),
            "reserve_bytes": b1 - b0,
            "reserve_rss": r1 - r0,
            "insert_bytes": b2 - b1,
            "insert_rss": r2 - r1,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
