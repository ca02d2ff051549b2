"""What asking for transparent huge pages buys: the same build with its
advice on and off (``EMBSTORE_HUGE_PAGES=0``), in turn, each run in a
fresh process.

    python benches/huge_pages.py [--rows 2000000] [--rounds 5]

Per run: inserting fresh keys into an empty dim-64 Adam table (lookups
that insert, 65,536 keys a call), ``reserve`` of the same count then the
inserts into the room reserved, lookups of 1,024 and of 1,000,000 random
existing keys, pooled lookups of 26-id bags, and the process's
``AnonHugePages`` (``/proc/self/smaps_rollup``). Reported: medians per
setting and their ratio, with the kernel's THP mode and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import embstore
    from embstore import optim
    from embstore.bench._timing import _best as best

    n = int(sys.argv[1])
    rng = np.random.default_rng(0)
    keys = rng.permutation(np.arange(n, dtype=np.int64) * 7919)
    out = {}

    t = embstore.Table(64, optimizer=optim.Adam(lr=1e-3))
    t0 = time.perf_counter()
    for i in range(0, n, 65536):
        t.lookup(keys[i : i + 65536])
    out["insert_rows_per_s"] = n / (time.perf_counter() - t0)
    r = embstore.Table(64, optimizer=optim.Adam(lr=1e-3))
    t0 = time.perf_counter()
    r.reserve(n)
    out["reserve_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, n, 65536):
        r.lookup(keys[i : i + 65536])
    out["insert_reserved_rows_per_s"] = n / (time.perf_counter() - t0)
    del r
    small = rng.choice(keys, 1024)
    big = rng.choice(keys, 1_000_000)
    out["lookup_1024_us"] = 1e6 * best(lambda: t.lookup(small, insert=False), 200)
    out["lookup_1m_ms"] = 1e3 * best(lambda: t.lookup(big, insert=False), 5)
    ids = rng.choice(keys, 26 * 65536)
    offsets = np.arange(0, ids.size + 1, 26)
    out["pooled_26_ms"] = 1e3 * best(lambda: t.lookup_pooled(ids, offsets, insert=False), 5)
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                out["anon_huge_mib"] = int(line.split()[1]) / 1024
    print(json.dumps(out))
    """
)


def run(rows: int, on: bool) -> dict[str, float]:
    env = {**os.environ, "EMBSTORE_HUGE_PAGES": "1" if on else "0"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(rows)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from embstore.bench._timing import machine_facts

    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            runs[on].append(run(args.rows, on))
    m = machine_facts()
    print(f"{m['cpu']}, {m['cores']} cores, {m['simd']}, THP mode {m['thp']}; {args.rows:,} rows")
    print(f"{'measure':<28} {'advice on':>14} {'off':>14} {'on / off':>9}")
    for key in runs[True][0]:
        a = statistics.median(x[key] for x in runs[True])
        b = statistics.median(x[key] for x in runs[False])
        print(f"{key:<28} {a:>14,.2f} {b:>14,.2f} {a / b if b else float('nan'):>9.3f}")


if __name__ == "__main__":
    main()
