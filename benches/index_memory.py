"""Memory a key and lookup speed of the shard index: this build against
another install (``--baseline DIR``), in turn, each case in a fresh process.

    python benches/index_memory.py --baseline /tmp/oldpkg [--rounds 2]

Cases (dim 16, no optimizer, keys ``i * 7919``): a table grown by ``assign``
in calls of 1M keys (the bench's memory figure), one sized by
``reserve`` first, one loaded from a checkpoint; for each, bytes a key over
the payload by ``stats()["bytes"]`` and by resident memory; and for grown
tables of 2M, 10M and 12.5M keys the index's load (keys / slots) and the
median time of lookups of 1.7M ids and the best of three passes of 300
lookups of 1,024 ids (``insert=False``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import json, os, sys, tempfile, time
    import numpy as np
    import embstore

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    case, rows = sys.argv[1], int(sys.argv[2])
    dim, chunk = 16, 1_000_000
    v = np.zeros((chunk, dim), np.float32)
    payload = rows * dim * 4

    def fill(t):
        for s in range(0, rows, chunk):
            n = min(chunk, rows - s)
            t.assign(np.arange(s, s + n) * 7919, v[:n])

    out = {}
    before = rss()
    if case == "loaded":
        t = embstore.Table(dim)
        fill(t)
        with tempfile.TemporaryDirectory() as d:
            t.save(d, with_optimizer=False)
            del t
            before = rss()
            t = embstore.Table.load(d)
    else:
        t = embstore.Table(dim)
        if case == "reserved":
            t.reserve(rows)
        fill(t)
    out["stats_b_key"] = (t.stats()["bytes"] - payload) / rows
    out["rss_b_key"] = (rss() - before - payload) / rows
    if case == "grown":
        # The index's slots: what stats counts beyond rows (64 + 6 bytes: the
        # tag, 8 bytes before 2026-11-28, makes older builds' loads read low).
        out["load"] = rows / ((t.stats()["bytes"] - rows * (dim * 4 + 6)) / 16)
        rng = np.random.default_rng(1)
        ids = rng.integers(0, rows, 1_700_000) * 7919
        small = [rng.integers(0, rows, 1024) * 7919 for _ in range(300)]
        t.lookup(ids, insert=False)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            t.lookup(ids, insert=False)
            ts.append(time.perf_counter() - t0)
        out["lookup_1_7m_ms"] = float(np.median(ts)) * 1e3
        best = []
        for _ in range(3):
            t0 = time.perf_counter()
            for k in small:
                t.lookup(k, insert=False)
            best.append((time.perf_counter() - t0) / len(small) * 1e6)
        out["lookup_1024_us"] = min(best)
    print(json.dumps(out))
    """
)

CASES = [
    ("grown", 2_000_000),
    ("grown", 10_000_000),
    ("grown", 12_500_000),
    ("reserved", 10_000_000),
    ("loaded", 10_000_000),
]


def child(pythonpath: str | None, case: str, rows: int) -> dict[str, float]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, "-c", CHILD, case, str(rows)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=600,
    )
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="directory holding the other embstore")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    builds = {"this": None, "baseline": args.baseline}
    for case, rows in CASES:
        got: dict[str, list[dict[str, float]]] = {b: [] for b in builds}
        for r in range(args.rounds):
            order = list(builds) if r % 2 == 0 else list(reversed(builds))
            for b in order:
                got[b].append(child(builds[b], case, rows))
        for b, runs in got.items():
            figs = ", ".join(f"{k} " + " / ".join(f"{run[k]:.3g}" for run in runs) for k in runs[0])
            print(f"{case} {rows:,} keys, {b}: {figs}", flush=True)


if __name__ == "__main__":
    main()
