"""Small calls: microseconds per lookup / Adam step at 1 to 16,384 keys
(100,000-row Adam table, dim 64, default shards; best of 5), and calls/s of
128-key serving lookups from 1, 2 and 4 Python threads. For before/after
comparisons run it against two builds (PYTHONPATH=<old tree>/python).

    python benches/small_calls.py
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import numpy as np

import embstore
from embstore import optim


def best_us(f: Callable[[], object], reps: int) -> float:
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            f()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def main() -> None:
    table = embstore.Table(64, optimizer=optim.Adam(lr=1e-3), seed=0)
    table.lookup(np.arange(100_000))
    rng = np.random.default_rng(0)
    per_call = {}
    for n in [1, 16, 128, 512, 1024, 2048, 4096, 16384]:
        keys = rng.integers(0, 100_000, n)
        grads = np.ones((n, 64), np.float32)
        reps = max(5, 20_000 // n)
        per_call[n] = {
            "lookup_us": round(best_us(lambda k=keys: table.lookup(k), reps), 1),
            "adam_step_us": round(
                best_us(lambda k=keys, g=grads: table.apply_gradients(k, g), reps), 1
            ),
        }
    keys = rng.integers(0, 100_000, 128)

    def serve(calls: int) -> None:
        for _ in range(calls):
            table.lookup(keys, insert=False)

    threads_out = {}
    for threads in (1, 2, 4):
        best = 1e9
        for _ in range(3):
            ts = [threading.Thread(target=serve, args=(4000,)) for _ in range(threads)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            best = min(best, time.perf_counter() - t0)
        threads_out[threads] = round(threads * 4000 / best)
    print(json.dumps({"per_call": per_call, "serving_calls_per_s": threads_out}, indent=1))


if __name__ == "__main__":
    main()
