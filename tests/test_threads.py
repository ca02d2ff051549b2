"""Concurrency: many Python threads calling one table lose no update, never
see a half-updated row, and the GIL is released during native calls."""

from __future__ import annotations

import functools
import pathlib
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import embstore
from embstore import init, optim
from tests._concurrent import run_concurrently

from . import _child


@pytest.mark.timeout(120)
def test_concurrent_sgd_loses_no_update() -> None:
    table = embstore.Table(8, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    n_threads, calls, n = 6, 40, 2000
    batches = [np.random.default_rng(s).integers(0, 500, size=(calls, n)) for s in range(n_threads)]

    def work(b: np.ndarray) -> None:
        for keys in b:
            table.apply_gradients(keys, -np.ones((n, 8), np.float32))

    with ThreadPoolExecutor(n_threads) as ex:
        list(ex.map(work, batches))
    counts = np.bincount(np.concatenate([b.ravel() for b in batches]), minlength=500)
    keys, rows = table.export()
    np.testing.assert_array_equal(rows, np.repeat(counts[keys][:, None], 8, axis=1))
    assert table.step == n_threads * calls


@pytest.mark.timeout(120)
def test_readers_never_see_torn_rows() -> None:
    dim = 512
    table = embstore.Table(dim, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros(), num_shards=2)
    keys = np.arange(64)
    table.lookup(keys)
    stop = threading.Event()
    torn: list[np.ndarray] = []

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            k = rng.choice(keys, 32)
            # Every column of a row moves by the same amount, so a row whose
            # columns differ was read in the middle of an update.
            table.apply_gradients(k, np.repeat(rng.integers(-3, 4, (32, 1)), dim, axis=1))

    def reader() -> None:
        for _ in range(300):
            rows = table.lookup(keys, insert=False)
            bad = rows[(rows != rows[:, :1]).any(axis=1)]
            if len(bad):
                torn.append(bad)

    writers = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
    for w in writers:
        w.start()
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda _: reader(), range(2)))
    stop.set()
    for w in writers:
        w.join()
    assert not torn, f"{len(torn)} reads saw half-updated rows"
    assert table.step > 0


@pytest.mark.timeout(120)
def test_other_python_thread_progresses_during_a_long_call() -> None:
    table = embstore.Table(64)
    keys = np.arange(1_000_000)
    inside = threading.Event()

    def long_call() -> None:
        inside.set()
        for _ in range(2):
            table.lookup(keys)
            table.remove(keys)

    worker = threading.Thread(target=long_call)
    worker.start()
    inside.wait()
    ticks = 0
    while worker.is_alive():
        ticks += 1
    worker.join()
    # Holding the GIL through the native calls would leave this loop almost
    # no turns (a switch only at call boundaries); released, it spins freely.
    assert ticks > 10_000, f"main thread made only {ticks} iterations"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_forked_child_can_use_the_table() -> None:
    """The parent's worker threads do not exist after fork(); the child must
    get its own pool instead of waiting on them forever (DataLoader workers,
    multiprocessing with the fork start method)."""

    script = (
        "import os, numpy as np, embstore\n"
        "from embstore import optim\n"
        "t = embstore.Table(8, optimizer=optim.Adam())\n"
        "t.lookup(np.arange(100_000))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    t.apply_gradients(np.arange(100_000), np.ones((100_000, 8)))\n"
        "    ok = t.lookup(np.arange(100_000)).shape == (100_000, 8) and t.step == 1\n"
        "    os._exit(0 if ok else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "assert os.waitstatus_to_exitcode(status) == 0, status\n"
        "assert t.step == 0\n"
        "t.apply_gradients(np.arange(10), np.ones((10, 8)))\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


@pytest.mark.timeout(120)
def test_policies_under_concurrent_calls_keep_their_bounds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Lookups, steps, assigns, evictions and saves from 5 threads on a table
    with admission, TTL and capacity: no error, no deadlock, never more than
    capacity rows once the calls are done, and the saved table loads whole."""
    cap = 3_000
    table = embstore.Table(
        8,
        optimizer=embstore.optim.Adagrad(lr=0.1),
        admission=embstore.policy.CountFilter(2, width=1 << 16),
        ttl_steps=5,
        capacity=cap,
        eviction="lru",
    )

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for i in range(60):
            keys = rng.integers(0, 20_000, 2_000)
            table.lookup(keys)
            table.apply_gradients(keys, np.ones((keys.size, 8), np.float32))
            if i % 10 == seed % 10:
                table.assign(keys[:50], np.zeros((50, 8), np.float32))
            if i % 15 == 0:
                table.evict(with_rows=True)

    def saver() -> None:
        for _ in range(5):
            table.save(tmp_path / "c")

    errors = run_concurrently(*(functools.partial(worker, s) for s in range(4)), saver)
    assert not errors, errors
    assert len(table) <= cap
    s = table.stats()
    assert s["rows"] == len(table)
    assert s["inserts"] - s["evicted"] == len(table)
    loaded = embstore.Table.load(tmp_path / "c")
    assert len(loaded) <= cap


@pytest.mark.timeout(120)
@pytest.mark.parametrize("eviction", ["lfu", "lru"])
def test_a_full_cache_evicting_a_row_a_call_from_many_threads(eviction: str) -> None:
    """One- and few-row inserts from 4 threads into a full cache, which
    evicts from the rows its last scan kept (`table::lowest`) while other
    threads touch, remove and evict: no error, no deadlock, capacity held,
    and every insert either held or counted evicted."""
    cap = 2_000
    table = embstore.Table(8, capacity=cap, eviction=eviction)
    table.assign(np.arange(cap), np.ones((cap, 8), np.float32))
    removed: list[int] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for i in range(1_500):
            key = 1_000_000 * (seed + 1) + i
            table.assign([key], np.full((1, 8), seed, np.float32))
            table.lookup(rng.integers(0, 1_000_000 * 5, 3), insert=i % 2 == 0)
            if i % 100 == seed:
                removed.append(table.remove(rng.integers(0, cap, 20)))
            if i % 250 == seed:
                table.evict()

    errors = run_concurrently(*(functools.partial(worker, s) for s in range(4)))
    assert not errors, errors
    assert len(table) <= cap
    s = table.stats()
    assert s["rows"] == len(table)
    assert s["inserts"] - s["evicted"] - sum(removed) == len(table)
    assert s["evicted"] > 4_000


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_export_while_reserve_runs_does_not_hang() -> None:
    _child.ok(
        """
        import threading, time
        t = embstore.Table(16, optimizer=optim.SGD(lr=0.1))
        t.lookup(np.arange(200_000))
        stop = time.monotonic() + 4
        def exporter():
            while time.monotonic() < stop:
                t.export()
        def reserver():
            k = 1
            while time.monotonic() < stop:
                t.reserve(10_000 * k)
                t.lookup(np.arange(200_000 * k, 200_000 * k + 20_000))
                k += 1
        ths = [threading.Thread(target=f) for f in (exporter, exporter, reserver, reserver)]
        for th in ths: th.start()
        for th in ths: th.join()
        """,
        timeout=90,
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_collections_sharing_tables_in_every_order_with_export_and_save(
    tmp_path: pathlib.Path,
) -> None:
    # Three tables shared by six Collections (every feature order), trained
    # from 8 threads while each table is exported and saved: with the gates
    # taken in feature order this hung 2 of 2 runs within 10 s.
    _child.ok(
        f"""
        import itertools, random, threading, time
        T = [embstore.Table(4, optimizer=optim.SGD(lr=0.1), num_shards=2) for _ in range(3)]
        colls = [embstore.Collection({{f"f{{i}}": T[i] for i in p}})
                 for p in itertools.permutations(range(3))]
        n = 16
        stop = time.monotonic() + 8
        def trainer(k):
            rng = random.Random(k)
            while time.monotonic() < stop:
                c = rng.choice(colls)
                batch = {{f: (np.arange(n), np.arange(n + 1)) for f in c.features}}
                c.apply_pooled_gradients(batch, np.ones((n, 12), np.float32))
        def snapshots(i):
            while time.monotonic() < stop:
                T[i].export()
                if i == 0:
                    T[i].save({str(tmp_path / "ck")!r})
        ths = [threading.Thread(target=trainer, args=(k,)) for k in range(8)]
        ths += [threading.Thread(target=snapshots, args=(i,)) for i in range(3)]
        for th in ths: th.start()
        for th in ths: th.join()
        embstore.Table.load({str(tmp_path / "ck")!r})
        """,
        timeout=90,
    )


@pytest.mark.slow
def test_the_child_helper_reports_a_hang() -> None:
    with pytest.raises(AssertionError, match="the child hung"):
        _child.run("import time; time.sleep(30)", timeout=2)
