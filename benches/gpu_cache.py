"""The device cache on a GPU, in one command (issue 35's figures):

1. index rates: find (slots and rows) and insert_or_assign of 1M keys a
   call at dims 32, 64 and 128, in an index of 32M slots filled to load 0.5,
   0.75 and 1.0, in B keys/s, for the kernels of each variant (finds by 8
   lanes a key and insert_or_assign in two kernels; a warp a key and four);
2. scaling: a 4,096-key training call with 10% new keys through a cache of
   20k rows and of 2M rows (the ratio says whether a call's cost grows with
   the cache);
3. serving: 2,000-key lookups through a ServingCache of 10% of a mapped
   table's 4M keys (dim 64, Zipf 1.05): latency p50 / p99 and hit rate, the
   mapped table alone beside it, and the refresh after a publish;
4. a DLRM-shaped step: 26 features x 65,536 samples, dim 64, Adam, Zipf(1.05)
   ids over 10M keys, a cache of 10% of the rows (and of 15%, where LFU's hit
   rate passes 90%: 10% of the rows hold 90.6% of the ids at best), against
   torch.nn.EmbeddingBag
   on CUDA with SparseAdam holding the whole table on the GPU; the hit rate,
   and the misses' transfer rate against a pinned copy's peak; with
   ``--dtypes float32,int8`` each cache size with the table's rows in each
   dtype (8-bit rows held on the device as stored: 18 words a row, not 64;
   the serving part then also serves an 8-bit checkpoint, its rows held on
   the device decoded); with ``--dense-ms M``, the step with a model's
   dense part of M ms between lookup and gradients, the next batch's
   misses fetched during it (``DeviceCache.prefetch``) or not.

    python benches/gpu_cache.py [--json out.json] [--quick] [--dtypes float32,int8]

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


#: The index's kernels compared (lanes a key for finds, insert_or_assign
#: fused): finds by tiles of 8, 4, 2 lanes a key, or by the rows' width (the
#: default), with insert_or_assign in three kernels; a warp a key and
#: insert_or_assign in five kernels (before).
VARIANTS = {
    "tile8": (8, True),
    "tile4": (4, True),
    "tile2": (2, True),
    "auto": (None, True),
    "warp": (0, False),
}


def gpu_seconds(xp: Any, fn: Any, reps: int, setup: Any = None) -> float:
    """Median seconds between CUDA events around ``fn()`` (``setup()``
    before each, outside them); host clock elsewhere."""
    if "cupy" not in xp.__name__:
        return timed(xp, fn, reps, setup)
    import cupy  # type: ignore[import-not-found, unused-ignore]

    out = []
    for _ in range(reps + 1):
        if setup is not None:
            setup()
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(cupy.cuda.get_elapsed_time(a, b) / 1e3)
    return float(np.median(out[1:]))


def rates_at(
    index: BucketIndex, rows: Any, batch: int, reps: int, rng: np.random.Generator, tick: int
) -> dict[str, float]:
    """Seconds of a find (slots and rows) of ``batch`` held keys and of an
    insert_or_assign of ``batch`` new ones (the index restored before each),
    for each of :data:`VARIANTS`."""
    xp = index.xp
    held = index.keys[index.slots_in_use()]
    probe = xp.take(held, xp.asarray(rng.integers(0, int(held.shape[0]), batch)))
    names = ("keys", "digest", "count", "last")
    saved = [getattr(index, a) for a in names]
    used = index.used
    new = xp.asarray(rng.integers(-(2**62), 2**62, batch, dtype=np.int64))
    vals = xp.ones((batch, int(rows.shape[1])), dtype=xp.float32)

    def restore() -> None:
        for a, v in zip(names, saved, strict=True):
            setattr(index, a, xp.asarray(v, copy=True))
        index.used = used

    res: dict[str, float] = {}
    cuda = index._cuda
    for name, (tile, fused) in VARIANTS.items() if index.kernels else [("array", (0, 0))]:
        if index.kernels:
            cuda.tile, index.fused = tile, fused
            res[f"find_{name}_s"] = gpu_seconds(
                xp,
                lambda: cuda.find_rows(
                    probe, index.keys, index.digest, index.buckets, index.bucket_size, rows
                ),
                reps,
            )
        else:
            res[f"find_{name}_s"] = gpu_seconds(
                xp, lambda: xp.take(rows, index.find(probe), axis=0), reps
            )
        if name in ("auto", "warp", "array"):  # every tile inserts alike
            res[f"insert_{name}_s"] = gpu_seconds(
                xp, lambda: insert(index, rows, new, vals, tick + 1), reps, restore
            )
            restore()
        if index.kernels and name != "warp":  # slots alone, no rows
            res[f"slots_{name}_s"] = gpu_seconds(xp, lambda: index.find(probe), reps)
    restore()
    if index.kernels:
        index._cuda.tile, index.fused = VARIANTS["auto"]
    return res


def fill_to(index: BucketIndex, rows: Any, load: float, batch: int, rng: Any, tick: int) -> int:
    """Random new keys inserted until ``load`` of the slots hold one (at
    load 1.0, until every slot does or twice the slots were inserted: a
    key whose bucket is full evicts); the last call's number."""
    xp = index.xp
    target, inserted = int(load * index.capacity), 0
    while index.used < target and inserted < 2 * index.capacity:
        n = batch if load >= 1.0 else max(min(batch, target - index.used), 1)
        keys = xp.asarray(rng.integers(-(2**62), 2**62, n, dtype=np.int64))
        tick += 1
        insert(index, rows, keys, xp.ones((n, int(rows.shape[1])), dtype=xp.float32), tick)
        inserted += n
    return tick


def index_rates(
    xp: Any, slots: int, batch: int, reps: int, dims: tuple[int, ...], loads: tuple[float, ...]
) -> list[dict[str, Any]]:
    """Find and insert_or_assign rates (B keys/s) at each load and dim, for
    each kernel variant; one index filled load after load, rows of each dim
    beside it."""
    rng = np.random.default_rng(0)
    out = []
    index = BucketIndex(xp, slots)
    rows = {d: xp.zeros((index.capacity, d), dtype=xp.float32) for d in dims}
    tick = 0
    for load in loads:
        tick = fill_to(index, rows[dims[0]], load, batch, rng, tick)
        for dim in dims:
            r = rates_at(index, rows[dim], batch, reps, rng, tick)
            row: dict[str, Any] = {
                "dim": dim,
                "load": load,
                "load_reached": index.used / index.capacity,
                "slots": index.capacity,
                "batch": batch,
            }
            for k, v in r.items():
                row[k.replace("_s", "_bkeys_s")] = batch / v / 1e9
            out.append(row)
            figs = ", ".join(
                f"{k.replace('_bkeys_s', '')} {v:.3g}" for k, v in row.items() if "bkeys" in k
            )
            print(
                f"index dim {dim} load {load} ({row['load_reached']:.4f}): {figs} B keys/s",
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


_SPIN: Any = None


def dense_work(xp: Any, ms: float) -> None:
    """Stands for a model's dense part of ``ms`` milliseconds: on CuPy a
    kernel that spins for that long on the current stream (queued, as a
    model's kernels are: the host goes on); elsewhere a sleep of the
    calling thread (the GIL released, as native dense work would)."""
    global _SPIN
    if ms <= 0:
        return
    if "cupy" not in xp.__name__:
        time.sleep(ms / 1e3)
        return
    import cupy  # type: ignore[import-not-found, unused-ignore]

    if _SPIN is None:
        _SPIN = cupy.RawKernel(
            r"""extern "C" __global__ void spin(long long cycles) {
                long long t0 = clock64();
                while (clock64() - t0 < cycles) {}
            }""",
            "spin",
        )
    khz = cupy.cuda.Device().attributes["ClockRate"]
    _SPIN((1,), (1,), (np.int64(int(ms * khz)),))


def cached_steps(
    xp: Any,
    ids: list[Any],
    grads: Any,
    rows: int,
    warm: int,
    profile: bool,
    dtype: str = "float32",
    dense_ms: float = 0.0,
    prefetch: bool = False,
) -> dict[str, Any]:
    """Median seconds of ``lookup`` + ``apply_gradients`` through a cache of
    ``rows`` rows (after ``warm`` steps) over a table of ``dtype`` rows,
    and the cache's figures. With ``dense_ms``, a model's dense part of
    that many milliseconds runs between the two (:func:`dense_work`); with
    ``prefetch``, the next batch's misses are fetched meanwhile
    (``DeviceCache.prefetch``: the host half of the next step overlapped
    with the dense part of this one)."""
    dim = int(grads.shape[1])
    table = embstore.Table(dim, optimizer=optim.Adam(lr=1e-3), dtype=dtype)
    cache = DeviceCache(table, rows, xp=xp)

    def step(i: int) -> None:
        cache.lookup(ids[i])
        ahead = cache.prefetch(ids[i + 1]) if prefetch and i + 1 < len(ids) else None
        dense_work(xp, dense_ms)
        cache.apply_gradients(ids[i], grads)
        if ahead is not None:
            ahead.result()  # its error, if any

    for i in range(warm):
        step(i)
    import cProfile
    import pstats

    # The timed steps profiled (fresh batches, each ended by a sync: time
    # the device takes lands in the sync).
    prof = cProfile.Profile() if profile else None
    s0 = cache.stats()
    times = []
    # With a dense part, the last batch only serves as the one fetched ahead.
    for i in range(warm, len(ids) - (1 if dense_ms > 0 else 0)):
        sync(xp)
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        step(i)
        sync(xp)
        times.append(time.perf_counter() - t0)
        if prof is not None:
            prof.disable()
    if prof is not None:
        print(f"DLRM, {dtype} rows: {len(times)} timed steps profiled (cProfile, by own time)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(26)
    s1 = cache.stats()
    d = {k: s1[k] - s0[k] for k in s1 if isinstance(s1[k], (int, float))}
    steps = len(times)
    return {
        "dtype": dtype,
        "dense_ms": dense_ms,
        "prefetch": prefetch,
        "cache_rows": cache.capacity,
        "cache_bytes": s1["bytes"] - s1["table"]["bytes"],
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
    dtypes: tuple[str, ...] = ("float32",),
    dense_ms: float = 0.0,
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
    for frac, dtype in ((f, d) for f in fractions for d in dtypes):
        res = {"keys": keys, "ids_per_step": n, "cache_fraction": frac}
        res.update(cached_steps(xp, ids_dev, grads, int(frac * keys), warm, profile, dtype))
        res["torch_step_s"] = torch_s
        res["ratio_to_torch"] = res["step_s"] / torch_s
        if peak is not None:
            res["pinned_peak_h2d_gb_s"], res["pinned_peak_d2h_gb_s"] = peak
        print(
            f"DLRM step ({features} x {batch}, dim {dim}, Adam, Zipf 1.05 over {keys:,} keys, "
            f"cache {res['cache_rows']:,} {dtype} rows, {res['cache_bytes'] / 2**30:.2f} GiB): "
            f"{res['step_s'] * 1e3:.1f} ms vs torch "
            f"EmbeddingBag+SparseAdam {torch_s * 1e3:.1f} ms "
            f"({res['ratio_to_torch']:.2f}x); hit rate {res['hit_rate']:.3f}; misses "
            f"{res['h2d_mb_per_step']:.0f} MB in at {res['misses_h2d_gb_s']:.1f} GB/s, "
            f"{res['d2h_mb_per_step']:.0f} MB out at {res['misses_d2h_gb_s']:.1f} GB/s"
            + (f" (pinned peak {peak[0]:.1f} / {peak[1]:.1f} GB/s)" if peak else ""),
            flush=True,
        )
        out.append(res)
    if dense_ms > 0:
        out += overlapped(xp, ids_dev, grads, [int(f * keys) for f in fractions], warm, dense_ms)
    return out


def overlapped(
    xp: Any, ids: list[Any], grads: Any, caches: list[int], warm: int, dense_ms: float
) -> list[dict[str, Any]]:
    """The step with a model's dense part of ``dense_ms`` between lookup
    and gradients, the next batch's misses fetched during it
    (``prefetch``) or not, in turn, through each cache size."""
    alone = []
    for _ in range(5):
        sync(xp)
        t0 = time.perf_counter()
        dense_work(xp, dense_ms)
        sync(xp)
        alone.append(time.perf_counter() - t0)
    dense_s = float(np.median(alone))
    out = []
    for rows in caches:
        got = {
            ahead: cached_steps(xp, ids, grads, rows, warm, False, "float32", dense_ms, ahead)
            for ahead in (False, True)
        }
        for r in got.values():
            r["dense_s"] = dense_s
            out.append(r)
        a, b = got[False]["step_s"], got[True]["step_s"]
        print(
            f"DLRM step with a dense part of {dense_s * 1e3:.1f} ms (cache {rows:,} rows, hit "
            f"rate {got[True]['hit_rate']:.3f}): {a * 1e3:.1f} ms, {b * 1e3:.1f} ms with the "
            f"next batch's misses fetched during the dense part ({(a - b) * 1e3:.1f} ms "
            f"overlapped; the step beyond the dense part {(a - dense_s) * 1e3:.1f} -> "
            f"{(b - dense_s) * 1e3:.1f} ms)",
            flush=True,
        )
    return out


def serving(
    xp: Any, keys: int, cache_rows: int, calls: int, warm: int, dtype: str = "float32"
) -> dict[str, Any]:
    """2,000-key lookups (host keys, Zipf 1.05 over ``keys``) through a
    ServingCache of ``cache_rows`` in front of a mapped table of dim 64
    saved in ``dtype`` (an 8-bit checkpoint's rows are held on the device
    decoded, as float32): per-call latency (output ready on the device)
    p50 / p99 and hit rate, against the mapped table's own host lookups of
    the same calls; then a publish of 1% of the rows and the refresh that
    follows it."""
    import tempfile

    from embstore.gpu import ServingCache

    dim, n = 64, 2_000
    t = embstore.Table(dim, seed=5, dtype=dtype)
    every = np.arange(keys, dtype=np.int64)
    for a in range(0, keys, 1 << 20):
        t.lookup(every[a : a + (1 << 20)])
    batches = zipf_batches(keys, n, warm + calls + 300, 1.05, 3)
    profiled = batches[warm + calls :]  # fresh calls, for the profile
    batches = batches[: warm + calls]
    res: dict[str, Any] = {"keys": keys, "dim": dim, "batch": n, "dtype": dtype}
    with tempfile.TemporaryDirectory() as d:
        t.save(d, with_optimizer=False)
        mapped = embstore.MappedTable(d)
        cache = ServingCache(mapped, cache_rows, xp=xp)
        for b in batches[:warm]:
            cache.lookup(b)
        sync(xp)
        s0 = cache.stats()
        lat, host, admitting = [], [], []
        for b in batches[warm:]:
            a0 = cache._n["admissions"]
            t0 = time.perf_counter()
            out = cache.lookup(b)
            sync(xp)
            lat.append(time.perf_counter() - t0)
            admitting.append(cache._n["admissions"] > a0)
            t0 = time.perf_counter()
            mapped.lookup(b)
            host.append(time.perf_counter() - t0)
        del out
        s1 = cache.stats()
        hits = (s1["hits"] - s0["hits"]) / (s1["lookups"] - s0["lookups"])
        us = np.array(lat) * 1e6
        adm = np.array(admitting)
        p = np.percentile(us, [50, 99])
        h = np.percentile(np.array(host) * 1e6, [50, 99])
        res.update(
            cache_rows=cache.capacity,
            hit_rate=hits,
            p50_us=float(p[0]),
            p99_us=float(p[1]),
            host_p50_us=float(h[0]),
            host_p99_us=float(h[1]),
            calls_admitting=float(adm.mean()),
            p50_admitting_us=float(np.median(us[adm])) if adm.any() else None,
            p50_not_admitting_us=float(np.median(us[~adm])) if (~adm).any() else None,
        )
        # Calls of cached keys alone (no miss): the device path's floor.
        held = cache.cached_keys()
        rng = np.random.default_rng(9)
        only = []
        for _ in range(500):
            b = held[rng.integers(0, held.size, n)]
            t0 = time.perf_counter()
            cache.lookup(b)
            sync(xp)
            only.append(time.perf_counter() - t0)
        q = np.percentile(np.array(only) * 1e6, [50, 99])
        res.update(hits_only_p50_us=float(q[0]), hits_only_p99_us=float(q[1]))
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for b in profiled:
            cache.lookup(b)
            sync(xp)
        prof.disable()
        print("serving: 300 calls profiled (cProfile, cumulative):", flush=True)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(24)
        ch = every[:: max(1, keys // (keys // 100))]
        t.assign(ch, np.full((ch.size, dim), 0.5, dtype=np.float32))
        t.save(d, incremental=True, with_optimizer=False)
        t0 = time.perf_counter()
        cache.refresh()
        res["refresh_s"] = time.perf_counter() - t0
        res["rows_revalidated"] = cache.stats()["revalidated_rows"]
        got = to_np(cache.lookup(ch[:n]))
        res["fresh_after_refresh"] = bool((got == 0.5).all())
    print(
        f"serving: 2,000-key lookups through a {res['cache_rows']:,}-row cache of "
        f"{keys:,} {dtype} keys: p50 {res['p50_us']:.0f} us, p99 {res['p99_us']:.0f} us, hit rate "
        f"{hits:.3f} (the mapped table alone on the host: p50 {res['host_p50_us']:.0f}, "
        f"p99 {res['host_p99_us']:.0f} us); {res['calls_admitting']:.1%} of calls admit "
        f"rows (p50 {res['p50_admitting_us'] or 0:.0f} us, others "
        f"{res['p50_not_admitting_us'] or 0:.0f} us); cached keys alone: p50 "
        f"{res['hits_only_p50_us']:.0f}, p99 {res['hits_only_p99_us']:.0f} us; "
        f"refresh after a publish of 1% of the rows "
        f"{res['refresh_s'] * 1e3:.1f} ms ({res['rows_revalidated']:,} rows read again), "
        f"fresh after it: {res['fresh_after_refresh']}",
        flush=True,
    )
    return res


def to_np(a: Any) -> np.ndarray:
    return np.asarray(embstore.gpu.to_numpy(a))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    ap.add_argument("--xp", default=None, help="array namespace (default: cupy on a GPU)")
    ap.add_argument("--parts", default="index,serving,scaling,dlrm")
    ap.add_argument("--warm", type=int, default=20, help="DLRM steps before the timed ones")
    ap.add_argument("--profile", action="store_true", help="profile the DLRM timed steps")
    ap.add_argument(
        "--write-back-thread-min",
        type=int,
        default=None,
        help="DLRM: evicted rows from which a call writes them back on a thread of its own "
        "(default: the cache's, off)",
    )
    ap.add_argument(
        "--cache-fractions", default="0.10,0.15", help="DLRM cache sizes, fractions of the keys"
    )
    ap.add_argument(
        "--dense-ms",
        type=float,
        default=0.0,
        help="DLRM: also steps with a dense part of this many ms, the next batch prefetched "
        "during it or not",
    )
    ap.add_argument(
        "--dtypes",
        default="float32",
        help="DLRM and serving: the table's (the checkpoint's) row dtypes, in turn",
    )
    args = ap.parse_args(argv)
    import faulthandler
    import importlib
    import signal

    # A run stopped by `timeout` (SIGTERM) says where every thread was, and a
    # native crash where it happened (scripts/gpu_check.sh reads both).
    faulthandler.enable()
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

    if args.write_back_thread_min is not None:
        import embstore.gpu.cache as gpu_cache

        gpu_cache.WRITE_BACK_THREAD_MIN = args.write_back_thread_min
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
            xp,
            1 << (16 if q else 25),
            1 << (12 if q else 20),
            3 if q else 7,
            (32, 64, 128),
            (0.5, 0.75, 1.0),
        )
    if "serving" in parts:
        for dtype in args.dtypes.split(","):
            print(f"serving: starting ({dtype} rows)", flush=True)
            out["serving" if dtype == "float32" else f"serving_{dtype}"] = (
                serving(xp, 200_000, 20_000, 200, 50, dtype)
                if q
                else serving(xp, 4_000_000, 400_000, 3_000, 500, dtype)
            )
    if "scaling" in parts:
        out["scaling"] = scaling(xp, 20_000, 200_000 if q else 2_000_000, 10 if q else 30)
    if "dlrm" in parts:
        dtypes = tuple(args.dtypes.split(","))
        out["dlrm"] = (
            dlrm(xp, 100_000, 1024, 26, 3, 3, fractions, args.profile, dtypes, args.dense_ms)
            if q
            else dlrm(
                xp,
                10_000_000,
                65_536,
                26,
                args.warm,
                8,
                fractions,
                args.profile,
                dtypes,
                args.dense_ms,
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
