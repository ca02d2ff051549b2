"""The device cache on a GPU, in one command (issue 35's figures):

1. index rates: find (slots and rows) and insert (plan, install, rows) of
   1M keys a call at dim 32 and 64, in an index of 32M slots filled to load
   0.5 and 0.9, in B keys/s;
2. scaling: a 4,096-key training call with 10% new keys through a cache of
   20k rows and of 2M rows (the ratio says whether a call's cost grows with
   the cache);
3. a DLRM-shaped step: 26 features x 65,536 samples, dim 64, Adam, Zipf(1.05)
   ids over 10M keys, a cache of 10% of the rows (and of 15%, where LFU's hit
   rate passes 90%: 10% of the rows hold 90.6% of the ids at best), against
   torch.nn.EmbeddingBag
   on CUDA with SparseAdam holding the whole table on the GPU; the hit rate,
   and the misses' transfer rate against a pinned copy's peak.

    python benches/gpu_cache.py [--json out.json] [--quick]

``--quick`` runs small sizes (seconds, any machine; with ``--xp numpy`` no
GPU is needed). Without CuPy and a GPU the index and DLRM parts say so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np

import embstore
from embstore import optim
from embstore.gpu import DeviceCache
from embstore.gpu import _xp as X
from embstore.gpu.index import BucketIndex


def sync(xp: Any) -> None:
    if "cupy" in xp.__name__:
        import cupy  # type: ignore[import-not-found, unused-ignore]

        cupy.cuda.Device().synchronize()


def timed(xp: Any, fn: Any, reps: int, setup: Any = None) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (``setup()`` untimed before each)."""
    out = []
    for _ in range(reps):
        if setup is not None:
            setup()
        sync(xp)
        t0 = time.perf_counter()
        fn()
        sync(xp)
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def insert(index: BucketIndex, rows: Any, keys: Any, values: Any, tick: int) -> None:
    """The index's insert_or_assign: find, admit (evicting where a bucket is
    full), keys and rows written."""
    index.insert_or_assign(keys, values, rows, tick)


def rates_at(
    index: BucketIndex, rows: Any, batch: int, reps: int, rng: np.random.Generator, tick: int
) -> tuple[float, float]:
    """Seconds of a find (slots and rows) of ``batch`` held keys, and of an
    insert of ``batch`` new ones (the index restored after each)."""
    xp = index.xp
    held = index.keys[index.slots_in_use()]
    probe = xp.take(held, xp.asarray(rng.integers(0, int(held.shape[0]), batch)))
    if index.kernels:
        cuda = index._cuda
        find_s = timed(
            xp,
            lambda: cuda.find_rows(
                probe, index.keys, index.digest, index.buckets, index.bucket_size, rows
            ),
            reps,
        )
    else:
        find_s = timed(xp, lambda: xp.take(rows, index.find(probe), axis=0), reps)
    names = ("keys", "digest", "count", "last")
    saved = [getattr(index, a) for a in names]
    used = index.used
    new = xp.asarray(rng.integers(-(2**62), 2**62, batch, dtype=np.int64))
    vals = xp.ones((batch, int(rows.shape[1])), dtype=xp.float32)

    def restore() -> None:
        for a, v in zip(names, saved, strict=True):
            setattr(index, a, xp.asarray(v, copy=True))
        index.used = used

    insert_s = timed(xp, lambda: insert(index, rows, new, vals, tick + 1), reps, restore)
    restore()
    if index.kernels:  # where an insert's time goes
        f = timed(xp, lambda: index.find(new), reps)
        p = timed(xp, lambda: index.plan(new, tick + 2, "lfu"), reps)
        index.sort_free = False
        ps = timed(xp, lambda: index.plan(new, tick + 2, "lfu"), reps)
        index.sort_free = True
        slots, _ = index.plan(new, tick + 2, "lfu")
        ok = xp.nonzero(slots >= 0)[0]
        got, kk = xp.take(slots, ok), xp.take(new, ok)
        one = xp.ones(ok.shape, dtype=xp.int64)
        i = timed(xp, lambda: index.install(got, kk, one, tick + 2, 0), reps, restore)
        from cupyx.profiler import benchmark  # type: ignore[import-not-found, unused-ignore]

        cpu, gpu = [], []
        for _ in range(reps):  # each insert on the restored index (new keys again)
            restore()
            b = benchmark(insert, (index, rows, new, vals, tick + 1), n_repeat=1, n_warmup=0)
            cpu.append(float(b.cpu_times[0]))
            gpu.append(float(b.gpu_times[0][0]))
        restore()
        print(
            f"  insert: {np.median(cpu) * 1e3:.2f} ms on the host's clock, "
            f"{np.median(gpu) * 1e3:.2f} ms of GPU time",
            flush=True,
        )
        vv = xp.take(vals, ok, axis=0)
        r = timed(xp, lambda: index.put_rows(rows, got, vv), reps)
        restore()
        print(
            f"  insert's parts: find {f * 1e3:.2f}, plan {p * 1e3:.2f} (sorted {ps * 1e3:.2f}), "
            f"install {i * 1e3:.2f}, rows {r * 1e3:.2f} ms (all {insert_s * 1e3:.2f} ms)",
            flush=True,
        )
    return find_s, insert_s


def index_rates(xp: Any, slots: int, batch: int, reps: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    out = []
    for dim in (32, 64):
        index = BucketIndex(xp, slots)
        rows = xp.zeros((index.capacity, dim), dtype=xp.float32)
        tick = 0
        for load in (0.5, 0.9):
            while index.used < int(load * index.capacity):
                n = min(batch, int(load * index.capacity) - index.used)
                keys = xp.asarray(rng.integers(-(2**62), 2**62, n, dtype=np.int64))
                tick += 1
                insert(index, rows, keys, xp.ones((n, dim), dtype=xp.float32), tick)
            find_s, insert_s = rates_at(index, rows, batch, reps, rng, tick)
            out.append(
                {
                    "dim": dim,
                    "load": load,
                    "slots": index.capacity,
                    "batch": batch,
                    "find_bkeys_s": batch / find_s / 1e9,
                    "insert_bkeys_s": batch / insert_s / 1e9,
                }
            )
            print(
                f"index dim {dim} load {load}: find {out[-1]['find_bkeys_s']:.3g}, "
                f"insert {out[-1]['insert_bkeys_s']:.3g} B keys/s",
                flush=True,
            )
    return out


def scaling(xp: Any, small: int, large: int, calls: int) -> dict[str, Any]:
    """Median seconds of a 4,096-key Adam call with 10% new keys, per cache size."""
    res: dict[str, Any] = {}
    for rows in (small, large):
        cache = DeviceCache(embstore.Table(32, optimizer=optim.Adam(lr=0.01)), rows, xp=xp)
        rng = np.random.default_rng(0)
        nxt = 0
        while cache.stats()["rows_cached"] < int(0.9 * cache.capacity):
            k = np.arange(nxt, nxt + min(262_144, cache.capacity), dtype=np.int64)
            nxt += len(k)
            cache.apply_gradients(xp.asarray(k), xp.zeros((len(k), 32), dtype=xp.float32))
        times = []
        for _ in range(calls):
            old = rng.integers(max(0, nxt - rows // 2), nxt, 3686)
            k = np.concatenate([old, np.arange(nxt, nxt + 410)]).astype(np.int64)
            nxt += 410
            kd, g = xp.asarray(k), xp.ones((len(k), 32), dtype=xp.float32)
            sync(xp)
            t0 = time.perf_counter()
            cache.apply_gradients(kd, g)
            sync(xp)
            times.append(time.perf_counter() - t0)
        res[str(rows)] = float(np.median(times))
        del cache
    res["ratio"] = res[str(large)] / res[str(small)]
    print(
        f"4,096-key call, 10% new: {res[str(small)] * 1e3:.2f} ms at {small} rows, "
        f"{res[str(large)] * 1e3:.2f} ms at {large} rows ({res['ratio']:.2f}x)",
        flush=True,
    )
    return res


def zipf_batches(keys: int, n: int, steps: int, s: float, seed: int) -> list[np.ndarray]:
    """``steps`` batches of ``n`` ids drawn from Zipf(s) over ``keys`` ranks,
    ranks scattered over the key space (hot keys are not neighbours)."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, keys + 1, dtype=np.float64) ** -s)
    cdf /= cdf[-1]
    perm = rng.permutation(keys).astype(np.int64)
    return [perm[np.searchsorted(cdf, rng.random(n))] for _ in range(steps)]


def pinned_peak(nbytes: int) -> tuple[float, float]:
    """GB/s of one pinned host-to-device and device-to-host copy of ``nbytes``."""
    import cupy  # type: ignore[import-not-found, unused-ignore]

    host = X.host_buffer(cupy, (nbytes,), np.uint8)
    host[:] = 1
    dev = cupy.empty((nbytes,), dtype=cupy.uint8)
    h2d = timed(cupy, lambda: dev.set(host), 5)
    d2h = timed(cupy, lambda: dev.get(out=host), 5)
    return nbytes / h2d / 1e9, nbytes / d2h / 1e9


def cached_steps(
    xp: Any, ids: list[Any], grads: Any, rows: int, warm: int, profile: bool
) -> dict[str, Any]:
    """Median seconds of ``lookup`` + ``apply_gradients`` through a cache of
    ``rows`` rows (after ``warm`` steps), and the cache's figures."""
    dim = int(grads.shape[1])
    cache = DeviceCache(embstore.Table(dim, optimizer=optim.Adam(lr=1e-3)), rows, xp=xp)

    def step(i: int) -> None:
        cache.lookup(ids[i])
        cache.apply_gradients(ids[i], grads)

    for i in range(warm):
        step(i)
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for i in range(warm - 3, warm):
            step(i)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    s0 = cache.stats()
    times = []
    for i in range(warm, len(ids)):
        sync(xp)
        t0 = time.perf_counter()
        step(i)
        sync(xp)
        times.append(time.perf_counter() - t0)
    s1 = cache.stats()
    d = {k: s1[k] - s0[k] for k in s1 if isinstance(s1[k], (int, float))}
    steps = len(times)
    return {
        "cache_rows": cache.capacity,
        "step_s": float(np.median(times)),
        "hit_rate": d["hits"] / d["lookups"],
        "misses_h2d_gb_s": d["h2d_bytes"] / max(d["h2d_seconds"], 1e-12) / 1e9,
        "misses_d2h_gb_s": d["d2h_bytes"] / max(d["d2h_seconds"], 1e-12) / 1e9,
        "h2d_mb_per_step": d["h2d_bytes"] / steps / 1e6,
        "d2h_mb_per_step": d["d2h_bytes"] / steps / 1e6,
        "admissions_per_step": d["admissions"] / steps,
        "table_updates_per_step": d["table_updates"] / steps,
    }


def dlrm(
    xp: Any,
    keys: int,
    batch: int,
    features: int,
    warm: int,
    steps: int,
    fractions: list[float],
    profile: bool = False,
) -> list[dict[str, Any]]:
    import torch

    dim = 64
    n = batch * features
    batches = zipf_batches(keys, n, warm + steps, 1.05, 1)
    rng = np.random.default_rng(2)
    grads = xp.asarray(rng.standard_normal((n, dim)).astype(np.float32) * 0.01)
    ids_dev = [xp.asarray(b) for b in batches]

    dev = "cuda" if "cupy" in xp.__name__ else "cpu"
    emb = torch.nn.EmbeddingBag(keys, dim, mode="sum", sparse=True, device=dev)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-3)
    offsets = torch.arange(n, device=dev)
    tg = torch.from_dlpack(grads) if dev == "cuda" else torch.as_tensor(np.asarray(grads))
    tids = [torch.as_tensor(b, device=dev) for b in batches]

    def theirs(i: int) -> None:
        out = emb(tids[i], offsets)
        out.backward(tg)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(min(warm, 3)):
        theirs(i)
    t_torch = []
    for i in range(warm, warm + steps):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        theirs(i)
        if dev == "cuda":
            torch.cuda.synchronize()
        t_torch.append(time.perf_counter() - t0)
    torch_s = float(np.median(t_torch))
    peak = pinned_peak(256 << 20) if dev == "cuda" else None
    out = []
    for frac in fractions:
        res = {"keys": keys, "ids_per_step": n, "cache_fraction": frac}
        res.update(cached_steps(xp, ids_dev, grads, int(frac * keys), warm, profile))
        res["torch_step_s"] = torch_s
        res["ratio_to_torch"] = res["step_s"] / torch_s
        if peak is not None:
            res["pinned_peak_h2d_gb_s"], res["pinned_peak_d2h_gb_s"] = peak
        print(
            f"DLRM step ({features} x {batch}, dim {dim}, Adam, Zipf 1.05 over {keys:,} keys, "
            f"cache {res['cache_rows']:,} rows): {res['step_s'] * 1e3:.1f} ms vs torch "
            f"EmbeddingBag+SparseAdam {torch_s * 1e3:.1f} ms "
            f"({res['ratio_to_torch']:.2f}x); hit rate {res['hit_rate']:.3f}; misses "
            f"{res['h2d_mb_per_step']:.0f} MB in at {res['misses_h2d_gb_s']:.1f} GB/s, "
            f"{res['d2h_mb_per_step']:.0f} MB out at {res['misses_d2h_gb_s']:.1f} GB/s"
            + (f" (pinned peak {peak[0]:.1f} / {peak[1]:.1f} GB/s)" if peak else ""),
            flush=True,
        )
        out.append(res)
        profile = False
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    ap.add_argument("--xp", default=None, help="array namespace (default: cupy on a GPU)")
    ap.add_argument("--parts", default="index,scaling,dlrm")
    ap.add_argument("--warm", type=int, default=20, help="DLRM steps before the timed ones")
    ap.add_argument("--profile", action="store_true", help="profile 3 DLRM steps (cProfile)")
    ap.add_argument(
        "--cache-fractions", default="0.10,0.15", help="DLRM cache sizes, fractions of the keys"
    )
    args = ap.parse_args(argv)
    import importlib

    gpu, why = X.gpu_usable()
    xp = X.namespace(importlib.import_module(args.xp) if args.xp else None)
    parts = set(args.parts.split(","))
    out: dict[str, Any] = {"xp": xp.__name__, "gpu": gpu}
    if gpu and "cupy" in xp.__name__:
        import cupy  # type: ignore[import-not-found, unused-ignore]

        out["device"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    else:
        print(f"no GPU ({why}): running on {xp.__name__}", flush=True)
    q = args.quick
    fractions = [float(f) for f in args.cache_fractions.split(",")]
    if "index" in parts:
        out["index"] = index_rates(
            xp, 1 << (16 if q else 25), 1 << (12 if q else 20), 3 if q else 7
        )
    if "scaling" in parts:
        out["scaling"] = scaling(xp, 20_000, 200_000 if q else 2_000_000, 10 if q else 30)
    if "dlrm" in parts:
        out["dlrm"] = (
            dlrm(xp, 100_000, 1024, 26, 3, 3, fractions, args.profile)
            if q
            else dlrm(xp, 10_000_000, 65_536, 26, args.warm, 8, fractions, args.profile)
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
