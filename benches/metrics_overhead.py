"""What counting costs: lookup throughput of this build against a build
without the latency histogram (another install, given as a directory on
``--baseline``), the two run in turn, each in its own process.

    python benches/metrics_overhead.py --baseline /tmp/oldpkg

Each round runs every case once in each build (order alternated by round);
reported: the median keys/s of each build and their ratio. Cases: serving
lookups (``insert=False``) of 1, 128 and 2,000 keys in a 200,000-key dim-64
table, 128-key lookups of the same table mapped, and 26-id pooled bags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np
    import embstore

    path = sys.argv[1]
    t = embstore.Table.load(path)
    m = embstore.MappedTable(path)
    rng = np.random.default_rng(0)
    n = len(t)
    out = {}

    def run(name, fn, keys_per_call, budget=0.4):
        fn()
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < budget:
            for _ in range(20):
                fn()
            calls += 20
        out[name] = calls * keys_per_call / (time.perf_counter() - t0)

    for b in (1, 128, 2000):
        k = rng.integers(0, n, b)
        run(f"lookup {b}", lambda k=k: t.lookup(k, insert=False), b)
    k = rng.integers(0, n, 128)
    run("mapped lookup 128", lambda: m.lookup(k), 128)
    ids = rng.integers(0, n, 26 * 64)
    offsets = np.arange(0, ids.size + 1, 26)
    run("pooled 64 bags of 26", lambda: t.lookup_pooled(ids, offsets, insert=False), ids.size)
    print(json.dumps(out))
    """
)


def child(pythonpath: str | None, path: str) -> dict[str, float]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, path],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
        cwd=tempfile.gettempdir(),
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="site directory of the build to compare")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import numpy as np

    import embstore

    with tempfile.TemporaryDirectory() as d:
        t = embstore.Table(64, seed=1)
        t.lookup(np.arange(200_000) * 7919)
        t.save(os.path.join(d, "t"))
        del t
        path = os.path.join(d, "t")
        here = os.path.dirname(os.path.dirname(embstore.__file__))
        builds = {"this build": here, "baseline": args.baseline}
        runs: dict[str, list[dict[str, float]]] = {b: [] for b in builds}
        for r in range(args.rounds):
            order = list(builds) if r % 2 == 0 else list(builds)[::-1]
            for b in order:
                runs[b].append(child(builds[b], path))
    cases = list(runs["this build"][0])
    print(
        f"{'case':<24} {'this build':>14} {'baseline':>14} {'ratio':>7}  "
        "(keys/s, medians; then the median and range of the rounds' own ratios)"
    )
    for c in cases:
        a = statistics.median(x[c] for x in runs["this build"])
        b = statistics.median(x[c] for x in runs["baseline"])
        paired = sorted(
            x[c] / y[c] for x, y in zip(runs["this build"], runs["baseline"], strict=True)
        )
        print(
            f"{c:<24} {a:>14,.0f} {b:>14,.0f} {a / b:>7.3f}  "
            f"{statistics.median(paired):.3f} [{paired[0]:.3f}, {paired[-1]:.3f}]"
        )


if __name__ == "__main__":
    main()
