"""Inserts into a cache of text embeddings (dim 768, ``capacity_bytes`` and
``ttl_seconds`` set, no ``reserve()``: every row lands on fresh memory)
against a dict of NumPy rows and NumPy writing the same bytes into a fresh
array, each case in a fresh process, the cases in turn:

    python benches/text_cache.py [--rows 400000] [--batches 1,64,1024] [--rounds 3]
        [--baseline DIR] [--no-full | --full-only]

A case inserts ``--rows`` new keys in calls of ``batch`` rows: embstore by
``Table.assign``, the dict by ``d[key] = row.copy()`` for each row, NumPy by
``a[i:i + batch] = rows`` into ``np.empty((rows, 768))`` (the memory
speed: what the kernel's fresh pages and a copy cost). Prints the median
rows/s of each and embstore's ratio to the dict's (each case after a
process that touched and freed 1.25x its bytes: see ``prime``); ``--baseline DIR`` adds
another embstore install (its directory on ``PYTHONPATH``) in the same turns.
Then the same inserts into a full cache (``--no-full`` leaves them out): a
quarter of the rows fit (embstore's ``capacity_bytes`` of that many rows'
cost, LRU), so three inserts in four evict the least recently used row;
the peer an ``OrderedDict`` used as an LRU cache (``popitem(last=False)``
past the same count); ``--full-only`` runs these alone. A baseline built
before 9612e0e scores every row for each eviction (hours a case at the
default size): compare it with ``--no-full``, or with ``--rows 40000``.
OpenBLAS threads are held to one (NumPy's idle BLAS thread otherwise spins on
a core of two).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

from embstore.bench._timing import machine_facts

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np

    mode, rows, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dim = 768
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**62, rows, dtype=np.int64)
    src = rng.standard_normal((batch, dim), dtype=np.float32)
    full = mode.endswith("-full")
    fits = rows // 4 if full else rows
    if mode.startswith("embstore"):
        import embstore

        kw = {"capacity_bytes": 64 << 30}
        if full:
            cost = embstore.Table(dim, ttl_seconds=3600, eviction="lru").stats()["row_cost"]
            kw = {"capacity_bytes": fits * cost, "eviction": "lru"}
        t = embstore.Table(dim, ttl_seconds=3600, **kw)
        t0 = time.perf_counter()
        for s in range(0, rows, batch):
            k = keys[s : s + batch]
            t.assign(k, src[: len(k)])
        dt = time.perf_counter() - t0
        assert len(t) <= fits and len(t) >= fits * 0.99, (len(t), fits)
    elif mode.startswith("dict"):
        from collections import OrderedDict

        d = OrderedDict() if full else {}
        t0 = time.perf_counter()
        for s in range(0, rows, batch):
            for k, r in zip(keys[s : s + batch].tolist(), src):
                d[k] = r.copy()
                if full and len(d) > fits:
                    d.popitem(last=False)
        dt = time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        a = np.empty((rows, dim), np.float32)
        for s in range(0, rows, batch):
            n = min(batch, rows - s)
            a[s : s + n] = src[:n]
        dt = time.perf_counter() - t0
    print(json.dumps(rows / dt))
    """
)


def child(mode: str, rows: int, batch: int, pythonpath: str | None) -> float:
    """Rows/s of one case in a fresh process."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(rows), str(batch)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=600,
    )
    return float(json.loads(out.stdout))


def prime(nbytes: int) -> None:
    """Touches and frees ``nbytes`` in a process of its own, so that the
    next case's fresh pages are ones the guest kernel has used before: on a
    VM, a first touch of memory the host has not backed yet costs the host's
    fault too, and which case met such memory depended on the order of the
    cases (NumPy's fill ran at 0.6M or 2.1M rows/s by its place in a round)."""
    subprocess.run(
        [sys.executable, "-c", f"import numpy as np; np.ones({nbytes}, np.uint8)"],
        check=True,
        timeout=600,
        env=dict(os.environ, OPENBLAS_NUM_THREADS="1"),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--batches", default="1,64,1024")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", help="directory holding another embstore")
    ap.add_argument("--no-full", action="store_true", help="leave out the full caches")
    ap.add_argument("--full-only", action="store_true", help="the full caches alone")
    args = ap.parse_args()
    cases: dict[str, str | None] = {"embstore": None}
    if args.baseline:
        cases["baseline"] = args.baseline
    cases.update({"dict": None, "numpy": None})
    full: dict[str, str | None] = {"embstore-full": None}
    if args.baseline:
        full["baseline-full"] = args.baseline
    full["dict-full"] = None
    m = machine_facts()
    print(
        f"{m['cpu']}, {m['cores']} cores, SIMD {m['simd']}, THP {m['thp']}; "
        f"{args.rows:,} new rows of dim 768 a case, {args.rounds} rounds",
        flush=True,
    )
    batches = [int(b) for b in args.batches.split(",")]
    groups = [] if args.full_only else [("", cases)]
    if not args.no_full:
        groups.append(("full cache, ", full))
    for kind, group in groups:
        peer = "dict-full" if kind else "dict"
        for batch in batches:
            got = run_cases(group, args.rows, batch, args.rounds)
            med = {c: statistics.median(v) for c, v in got.items()}
            line = ", ".join(
                f"{c} {med[c] / 1e6:.3f}M ({' / '.join(f'{x / 1e6:.2f}' for x in got[c])})"
                for c in group
            )
            ratios = ", ".join(f"{c}/{peer} {med[c] / med[peer]:.2f}x" for c in group if c != peer)
            print(f"{kind}batch {batch}: rows/s {line}; {ratios}", flush=True)


def run_cases(
    group: dict[str, str | None], rows: int, batch: int, rounds: int
) -> dict[str, list[float]]:
    """Rows/s of each case in ``group`` (name: its PYTHONPATH), ``rounds``
    fresh processes each, the cases in turn (the order reversed every other
    round)."""
    got: dict[str, list[float]] = {c: [] for c in group}
    for r in range(rounds):
        order = list(group) if r % 2 == 0 else list(reversed(group))
        for c in order:
            mode = c.replace("baseline", "embstore")
            prime(rows * 768 * 4 * 5 // 4)
            got[c].append(child(mode, rows, batch, group[c]))
    return got


if __name__ == "__main__":
    main()
