"""A chaos run: many threads calling every public method of Table,
Collection (two Collections sharing tables in opposite orders) and
DeviceCache, with save/load/export/reserve/evict, at random, for a bounded
time, under a watchdog. Then the exact totals: every trained table uses SGD
(lr=1) from zero rows with gradients of ones, so a key's row must be exactly
minus the number of gradients it received, whatever the interleaving (on
the table of 8-bit rows too: a row of equal weights is stored exactly, as
its offset). And every table's checkpoint must load and equal it.

``python -m tests.chaos --seconds 600 --threads 8 [--seed N]`` runs it from
the command line (prints the figures); tests/test_chaos.py runs it for a
minute. The seed is printed first, so a failure reproduces the same choices
(the interleaving itself is up to the OS).
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import embstore
from embstore import init, optim
from embstore.gpu import DeviceCache

DIM = 8
TRAIN_KEYS = 4000  # keys 0..3999 of A and B are trained
CACHE_KEYS = (10_000, 12_000)  # trained through the cache only
DIRECT_KEYS = (20_000, 22_000)  # trained directly on the cache's table
SCRATCH_KEYS = (-5000, -1)  # assigned and removed, never trained


@dataclass
class Figures:
    calls: collections.Counter[str] = field(default_factory=collections.Counter)
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, calls: collections.Counter[str], refused: collections.Counter[str]) -> None:
        with self.lock:
            self.calls.update(calls)
            self.refused.update(refused)


class World:
    """The tables, their expected totals, and the operations on them."""

    def __init__(self, root: Path) -> None:
        def sgd_table(**kw: Any) -> embstore.Table:
            return embstore.Table(
                DIM, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros(), num_shards=8, **kw
            )

        self.root = root
        self.a, self.b, self.c = sgd_table(), sgd_table(), sgd_table()
        self.d = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1), capacity=3000, ttl_steps=50)
        self.ab = embstore.Collection({"x": self.a, "y": self.b})
        self.ba = embstore.Collection({"y": self.b, "x": self.a})
        self.cache = DeviceCache(self.c, rows=512, xp=np)
        self.cache_lock = threading.Lock()  # one cache thread at a time keeps its keys its own
        # The same over a table of 8-bit rows (held in the cache as stored).
        self.e = sgd_table(dtype="int8")
        self.cache8 = DeviceCache(self.e, rows=256, xp=np)
        self.cache8_lock = threading.Lock()
        # Expected gradient counts per table and key.
        self.counts = {name: collections.Counter[int]() for name in "abce"}
        self.count_lock = threading.Lock()

    def credit(self, name: str, keys: np.ndarray) -> None:
        with self.count_lock:
            self.counts[name].update(keys.tolist())

    # -- operations: each takes a random generator; returns its name ----------------------

    def ops(self) -> list[Any]:
        return [
            self.train_table,
            self.train_pooled,
            self.train_collection,
            self.serve,
            self.train_cache,
            self.train_direct_c,
            self.scratch,
            self.snapshot,
            self.save_load,
            self.reserve_evict,
        ]

    def _table(self, rng: random.Random) -> tuple[str, embstore.Table]:
        return rng.choice([("a", self.a), ("b", self.b)])

    def _keys(self, rng: random.Random, lo: int, hi: int, n: int) -> np.ndarray:
        nprng = np.random.default_rng(rng.getrandbits(32))
        return nprng.integers(lo, hi, n).astype(np.int64)

    def train_table(self, rng: random.Random) -> str:
        name, t = self._table(rng)
        keys = self._keys(rng, 0, TRAIN_KEYS, rng.choice([1, 16, 500, 5000]))
        if rng.random() < 0.5:
            t.lookup(keys)
        t.apply_gradients(keys, np.ones((len(keys), DIM), np.float32))
        self.credit(name, keys)
        return "Table.apply_gradients"

    def train_pooled(self, rng: random.Random) -> str:
        name, t = self._table(rng)
        keys = self._keys(rng, 0, TRAIN_KEYS, rng.choice([4, 300, 3000]))
        offsets = np.arange(len(keys) + 1)  # one id per bag: each id gets grad 1
        t.lookup_pooled(keys, offsets, combiner=rng.choice(["sum", "mean", "sqrtn"]))
        t.apply_pooled_gradients(keys, offsets, np.ones((len(keys), DIM), np.float32))
        self.credit(name, keys)
        return "Table.apply_pooled_gradients"

    def train_collection(self, rng: random.Random) -> str:
        coll = rng.choice([self.ab, self.ba])
        n = rng.choice([8, 256, 2048])
        x, y = self._keys(rng, 0, TRAIN_KEYS, n), self._keys(rng, 0, TRAIN_KEYS, n)
        batch = {"x": (x, np.arange(n + 1)), "y": (y, np.arange(n + 1))}
        out = coll.lookup_pooled(batch)
        coll.apply_pooled_gradients(batch, np.ones_like(out))
        self.credit("a", x)
        self.credit("b", y)
        return "Collection.step"

    def serve(self, rng: random.Random) -> str:
        _, t = self._table(rng)
        keys = self._keys(rng, -100, TRAIN_KEYS + 100, rng.choice([1, 64, 4096]))
        rows = t.lookup(keys, insert=False)
        assert np.isfinite(rows).all()
        t.contains(keys)
        self.ab.lookup_pooled(
            {"x": (keys, np.arange(len(keys) + 1)), "y": (keys, [0] * len(keys) + [len(keys)])},
            insert=False,
        )
        return "serve"

    def _cached(self, rng: random.Random) -> tuple[str, DeviceCache, threading.Lock]:
        if rng.random() < 0.5:
            return "c", self.cache, self.cache_lock
        return "e", self.cache8, self.cache8_lock

    def train_cache(self, rng: random.Random) -> str:
        name, cache, lock = self._cached(rng)
        with lock:
            keys = self._keys(rng, *CACHE_KEYS, rng.choice([1, 64, 1024]))
            if rng.random() < 0.3:
                cache.lookup(keys)
            if rng.random() < 0.3:
                offsets = np.arange(len(keys) + 1)
                cache.apply_pooled_gradients(keys, offsets, np.ones((len(keys), DIM)))
            else:
                cache.apply_gradients(keys, np.ones((len(keys), DIM), np.float32))
            self.credit(name, keys)
            if rng.random() < 0.1:
                cache.flush()
            cache.contains(keys[:10])
            cache.stats()
        return "DeviceCache.step"

    def train_direct_c(self, rng: random.Random) -> str:
        name, cache, _ = self._cached(rng)
        keys = self._keys(rng, *DIRECT_KEYS, rng.choice([1, 256]))
        cache.table.apply_gradients(keys, np.ones((len(keys), DIM), np.float32))
        self.credit(name, keys)
        cache.table.lookup(keys, insert=False)
        return "Table(cache's).apply_gradients"

    def scratch(self, rng: random.Random) -> str:
        _, t = self._table(rng)
        keys = self._keys(rng, *SCRATCH_KEYS, rng.choice([1, 100]))
        t.assign(keys, np.full((len(keys), DIM), rng.random(), np.float32))
        if rng.random() < 0.5:
            t.remove(keys[: len(keys) // 2])
        # Refused calls change nothing (and must not hang either).
        try:
            t.apply_gradients(keys[:1], np.full((1, DIM), np.nan, np.float32))
        except ValueError:
            pass
        else:
            raise AssertionError("a NaN gradient was accepted")
        return "assign/remove/refused"

    def snapshot(self, rng: random.Random) -> str:
        _, t = self._table(rng)
        keys, rows = t.export()
        assert np.isfinite(rows).all()
        assert (np.diff(keys) > 0).all()
        t.stats()
        len(t)
        embstore.output_buffers()
        return "export/stats"

    def save_load(self, rng: random.Random) -> str:
        name, t = self._table(rng)
        path = self.root / name
        t.save(path)
        loaded = embstore.Table.load(path)
        assert np.isfinite(loaded.export()[1]).all()
        if rng.random() < 0.2:
            self.cache.save(self.root / "c")  # flushes under the cache's own lock
        if rng.random() < 0.2:
            self.cache8.save(self.root / "e")
        return "save/load"

    def reserve_evict(self, rng: random.Random) -> str:
        t = self.d
        keys = self._keys(rng, 0, 20_000, 500)
        t.apply_gradients(keys, np.ones((len(keys), DIM), np.float32))
        t.reserve(rng.choice([0, 1000, 50_000]))
        if rng.random() < 0.5:
            t.evict(with_rows=rng.random() < 0.5)
        t.admission_counts(keys[:5])
        if rng.random() < 0.3:
            self.a.reserve(rng.choice([100, 10_000]))
        return "reserve/evict"

    # -- the check ----------------------------------------------------------------------

    def check(self) -> int:
        """Exact totals and loadable checkpoints; returns the rows checked."""
        self.cache.flush()
        self.cache8.flush()
        checked = 0
        for name, t in (("a", self.a), ("b", self.b), ("c", self.c), ("e", self.e)):
            counts = self.counts[name]
            keys = np.array(sorted(counts), np.int64)
            got = t.lookup(keys, insert=False)
            want = -np.array([counts[k] for k in keys.tolist()], np.float32)[:, None]
            bad = np.flatnonzero((got != want).any(axis=1))
            assert bad.size == 0, (
                f"table {name}: {bad.size} rows off; key {keys[bad[0]]}: got {got[bad[0]]}, "
                f"want {want[bad[0], 0]} (lost or doubled updates)"
            )
            t.save(self.root / f"final-{name}")
            back = embstore.Table.load(self.root / f"final-{name}")
            k1, r1 = t.export()
            k2, r2 = back.export()
            np.testing.assert_array_equal(k1, k2)
            np.testing.assert_array_equal(r1, r2)
            checked += len(keys)
        return checked


def run(seconds: float, threads: int, seed: int, root: Path) -> dict[str, Any]:
    """Runs the chaos for ``seconds`` on ``threads`` threads; raises on any
    error, hang (a thread alive 120 s past the end) or lost update."""
    print(f"chaos: seed {seed}, {threads} threads, {seconds:g} s", flush=True)
    world = World(root)
    figures = Figures()
    errors: list[BaseException] = []
    deadline = time.monotonic() + seconds

    def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        calls: collections.Counter[str] = collections.Counter()
        refused: collections.Counter[str] = collections.Counter()
        ops = world.ops()
        try:
            while time.monotonic() < deadline:
                calls[rng.choice(ops)(rng)] += 1
        except BaseException as e:
            errors.append(e)
        figures.add(calls, refused)

    ths = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(threads)]
    t0 = time.monotonic()
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout=max(0.0, deadline - time.monotonic()) + 120)
    hung = [th.name for th in ths if th.is_alive()]
    if hung:
        faulthandler.dump_traceback(file=sys.stderr)
        raise AssertionError(f"chaos: {len(hung)} threads hung (seed {seed})")
    if errors:
        raise AssertionError(f"chaos: a call failed (seed {seed}): {errors[0]!r}") from errors[0]
    elapsed = time.monotonic() - t0
    checked = world.check()
    result = {
        "seed": seed,
        "threads": threads,
        "seconds": round(elapsed, 1),
        "calls": sum(figures.calls.values()),
        "by_op": dict(figures.calls),
        "hangs": 0,
        "lost_updates": 0,
        "rows_checked": checked,
        "gradients": {k: sum(v.values()) for k, v in world.counts.items()},
    }
    print(f"chaos: {result}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().getrandbits(31)
    with tempfile.TemporaryDirectory() as d:
        run(args.seconds, args.threads, seed, Path(d))


if __name__ == "__main__":
    main()
