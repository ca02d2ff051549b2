"""8-bit rows against float32 (issue 48's figures), in one command:

1. memory: a table of ``--memory-keys`` keys at dim 64 (rows only, no
   optimizer state), each dtype in a child process of its own: the table's
   ``stats()["bytes"]`` and the process's resident memory grown by it;
2. speed: tables of ``--keys`` keys at dim 64 with Adam, float32 and int8
   (and float16 beside them), the same 1.7M ids (26 fields x 65,536
   samples) each: a lookup, a pooled lookup (26 ids a bag) and an Adam
   step, the dtypes taken in turn, their order alternating each round;
   medians and ratios to float32.

    python benches/int8_rows.py [--keys N] [--rounds R] [--memory-keys N] [--json F]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import numpy as np

import embstore
from embstore import optim
from embstore.bench._timing import machine_facts

DIM = 64
DTYPES = ("float32", "int8", "float16")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_child(dtype: str, keys: int) -> dict[str, Any]:
    """In a child: a rows-only table of ``keys`` keys; its bytes and RSS growth."""
    before = rss_bytes()
    t = embstore.Table(DIM, dtype=dtype, seed=1)
    t.reserve(keys)
    step = 1 << 20
    for a in range(0, keys, step):
        t.lookup(np.arange(a, min(keys, a + step), dtype=np.int64))
    # The lookups' outputs return to embstore's pool of output buffers
    # when freed (a 1M-row output is 256 MB): given back, so that the
    # growth is the table's.
    embstore.free_output_buffers()
    s = t.stats()
    return {
        "dtype": dtype,
        "keys": keys,
        "stats_bytes": int(s["bytes"]),
        "weights_bytes": int(s["weights_bytes"]),
        "index_bytes": int(s["index_bytes"]),
        "row_cost": int(s["row_cost"]),
        "rss_growth": rss_bytes() - before,
    }


def memory(keys: int) -> list[dict[str, Any]]:
    out = []
    for dt in ("float32", "int8"):
        code = (
            "import json, sys; sys.path.insert(0, 'benches'); import int8_rows; "
            f"print(json.dumps(int8_rows.memory_child({dt!r}, {keys})))"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
    f, i = out
    print(
        f"memory at {keys:,} keys, dim {DIM}, rows only: stats bytes float32 "
        f"{f['stats_bytes'] / 1e9:.2f} GB, int8 {i['stats_bytes'] / 1e9:.2f} GB "
        f"({f['stats_bytes'] / i['stats_bytes']:.2f}x; a row {f['row_cost']} vs {i['row_cost']} "
        f"bytes with the per-key index, {4 * DIM} vs {DIM + 8} without); resident growth "
        f"{f['rss_growth'] / 1e9:.2f} vs {i['rss_growth'] / 1e9:.2f} GB "
        f"({f['rss_growth'] / max(i['rss_growth'], 1):.2f}x); of the stats bytes, the rows' "
        f"weights {f['weights_bytes'] / 1e9:.2f} vs {i['weights_bytes'] / 1e9:.2f} GB "
        f"({f['weights_bytes'] / i['weights_bytes']:.2f}x), the index {f['index_bytes'] / 1e9:.2f} "
        f"GB in both",
        flush=True,
    )
    return out


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def speed(keys: int, rounds: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    n = 26 * 65_536
    ids = rng.integers(0, keys, n).astype(np.int64)
    offsets = np.arange(0, n + 1, 26, dtype=np.int64)
    grads = (rng.standard_normal((n, DIM)) * 0.01).astype(np.float32)
    tables = {}
    for dt in DTYPES:
        t = embstore.Table(DIM, dtype=dt, optimizer=optim.Adam(lr=1e-3), seed=2)
        t.reserve(keys)
        for a in range(0, keys, 1 << 20):
            t.lookup(np.arange(a, min(keys, a + (1 << 20)), dtype=np.int64))
        tables[dt] = t
    times: dict[str, dict[str, list[float]]] = {
        dt: {"lookup": [], "pooled": [], "adam": []} for dt in DTYPES
    }
    for r in range(rounds):
        order = DTYPES if r % 2 == 0 else DTYPES[::-1]
        for dt in order:
            t = tables[dt]
            times[dt]["lookup"].append(timed(lambda t=t: t.lookup(ids, insert=False)))
            times[dt]["pooled"].append(
                timed(lambda t=t: t.lookup_pooled(ids, offsets, insert=False))
            )
            times[dt]["adam"].append(timed(lambda t=t: t.apply_gradients(ids, grads)))
    res: dict[str, Any] = {"keys": keys, "ids": n, "rounds": rounds, "simd": tables["int8"].simd}
    for dt in DTYPES:
        res[dt] = {k: float(np.median(v)) for k, v in times[dt].items()}
    for dt in DTYPES[1:]:
        res[f"{dt}_ratio"] = {k: res[dt][k] / res["float32"][k] for k in res[dt]}
    for dt in DTYPES:
        m = res[dt]
        ratio = res.get(f"{dt}_ratio")
        rs = (
            f" (to float32: {ratio['lookup']:.2f}x, {ratio['pooled']:.2f}x, {ratio['adam']:.2f}x)"
            if ratio
            else ""
        )
        print(
            f"{dt:>8}: lookup {m['lookup'] * 1e3:.1f} ms, pooled {m['pooled'] * 1e3:.1f} ms, "
            f"Adam step {m['adam'] * 1e3:.1f} ms{rs}",
            flush=True,
        )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory-keys", type=int, default=10_000_000)
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    # The machine the figures are of: CPU model, SIMD backend, THP mode.
    out: dict[str, Any] = {"machine": machine_facts()}
    if args.memory_keys:
        out["memory"] = memory(args.memory_keys)
    out["speed"] = speed(args.keys, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
