"""DeviceCache hit rates on a Zipf stream, against a static cache of the
truly most frequent keys and against the cache-curve prediction.

    python benches/cache_hit_rate.py [--keys 10000000] [--accesses 20000000]
        [--batch 16384] [--alpha 1.05]

Prints a table and, with --json, the figures. The cache runs on NumPy (the
same array-API code runs on CuPy where there is a GPU); a lookup-only table
of dim 4 stands behind it, since only hits and misses are measured.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import numpy.typing as npt

import embstore
from embstore.gpu import DeviceCache, cache_curve


def zipf_stream(n_keys: int, n: int, alpha: float, seed: int) -> npt.NDArray[np.int64]:
    """``n`` accesses to ``n_keys`` keys, key of rank r drawn with probability
    proportional to r**-alpha; ranks are scattered over the key space."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, n_keys + 1, dtype=np.float64) ** -alpha)
    cdf /= cdf[-1]
    ranks = np.searchsorted(cdf, rng.random(n))
    return rng.permutation(n_keys)[ranks].astype(np.int64)


def measure(keys: npt.NDArray[np.int64], rows: int, policy: str, batch: int) -> float:
    cache = DeviceCache(embstore.Table(4), rows, xp=np, policy=policy)
    for i in range(0, keys.shape[0], batch):
        cache.lookup(keys[i : i + batch])
    return float(cache.stats()["hit_rate"])


def run(n_keys: int, n: int, batch: int, alpha: float, fractions: list[float]) -> dict:
    keys = zipf_stream(n_keys, n, alpha, 0)
    sizes = [max(1, int(n_keys * f)) for f in fractions]
    t0 = time.perf_counter()
    curve = cache_curve(keys, sizes)
    curve_s = time.perf_counter() - t0
    out: dict = {"keys": n_keys, "accesses": n, "batch": batch, "alpha": alpha, "curve_s": curve_s}
    rows = []
    for c, lru_pred, static in zip(sizes, curve.lru, curve.static, strict=True):
        t0 = time.perf_counter()
        lfu = measure(keys, c, "lfu", batch)
        lru = measure(keys, c, "lru", batch)
        rows.append(
            {
                "rows": c,
                "lfu": lfu,
                "static": float(static),
                "lfu_over_static": lfu / float(static),
                "lru": lru,
                "lru_predicted": float(lru_pred),
                "lru_error_points": 100 * abs(lru - float(lru_pred)),
                "seconds": time.perf_counter() - t0,
            }
        )
    out["sizes"] = rows
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--keys", type=int, default=10_000_000)
    p.add_argument("--accesses", type=int, default=20_000_000)
    p.add_argument("--batch", type=int, default=16_384)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.005, 0.01, 0.02])
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    r = run(a.keys, a.accesses, a.batch, a.alpha, a.fractions)
    if a.json:
        print(json.dumps(r))
        return
    print(
        f"Zipf({r['alpha']}) over {r['keys']:,} keys, {r['accesses']:,} accesses in batches "
        f"of {r['batch']:,}; cache-curve took {r['curve_s']:.1f} s"
    )
    print("| rows | LFU hit | static top-k | LFU / static | LRU hit | LRU predicted | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in r["sizes"]:
        print(
            f"| {s['rows']:,} | {s['lfu']:.4f} | {s['static']:.4f} | {s['lfu_over_static']:.3f} "
            f"| {s['lru']:.4f} | {s['lru_predicted']:.4f} | {s['lru_error_points']:.2f} pt |"
        )


if __name__ == "__main__":
    main()
