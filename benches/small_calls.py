"""Small calls: microseconds per lookup / Adam step at 1 to 16,384 keys
(100,000-row Adam table, dim 64, default shards; best of 5), and calls/s of
128-key serving lookups from 1, 2 and 4 Python threads. For before/after
comparisons run it against two builds (PYTHONPATH=<old tree>/python).
``python -m embstore bench`` reports the same measures with peers.

    python benches/small_calls.py
"""

from __future__ import annotations

import json
from functools import partial

import numpy as np

import embstore
from embstore import optim
from embstore.bench._timing import _per_call_us
from embstore.bench.small import serving_calls_per_s


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
            "lookup_us": round(_per_call_us(partial(table.lookup, keys), reps), 1),
            "adam_step_us": round(
                _per_call_us(partial(table.apply_gradients, keys, grads), reps), 1
            ),
        }
    keys = rng.integers(0, 100_000, 128)
    threads_out = {n: round(serving_calls_per_s(table, keys, n, 4000)) for n in (1, 2, 4)}
    print(json.dumps({"per_call": per_call, "serving_calls_per_s": threads_out}, indent=1))


if __name__ == "__main__":
    main()
