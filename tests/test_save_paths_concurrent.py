"""Saves to several checkpoint paths from several threads, beside assigns,
inserts and removals: every checkpoint published loads, and once the
writers stop, one more incremental save at each path loads (mapped and
not) to exactly the table. At 7e7142d a full save at one path that
finished while another path's first save was between its snapshot and its
mark dropped removals the latter's next delta needed (a checkpoint that
Table.load refused, or a mapped read serving removed keys)."""

from __future__ import annotations

import pathlib
import threading
import time

import numpy as np

import embstore
from embstore import optim


def test_interleaved_saves_to_four_paths_lose_no_removal(tmp_path: pathlib.Path) -> None:
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.1), num_shards=4, seed=2)
    t.lookup(np.arange(2_000))
    paths = [tmp_path / f"p{i}" for i in range(4)]
    stop = threading.Event()
    errors: list[BaseException] = []
    saves = [0] * len(paths)

    def mutate() -> None:
        rng = np.random.default_rng(1)
        try:
            while not stop.is_set():
                t.lookup(rng.integers(0, 4_000, 64))
                t.remove(rng.integers(0, 4_000, 32))
                k = rng.integers(0, 4_000, 16)
                t.assign(k, rng.standard_normal((16, 4)).astype(np.float32))
        except BaseException as e:
            errors.append(e)

    def save(i: int) -> None:
        rng = np.random.default_rng(10 + i)
        try:
            t.save(paths[i])
            while not stop.is_set():
                # Mostly publishes; now and then a full save (the case that
                # trimmed another path's removals).
                t.save(paths[i], incremental=bool(rng.random() < 0.7))
                saves[i] += 1
                embstore.Table.load(paths[i])  # every published checkpoint loads
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=mutate)] + [
        threading.Thread(target=save, args=(i,)) for i in range(len(paths))
    ]
    for th in threads:
        th.start()
    time.sleep(2.5)
    stop.set()
    for th in threads:
        th.join(60)
        assert not th.is_alive(), "a saver or the writer hung"
    assert not errors, errors
    assert min(saves) > 3, saves
    want_keys, want_rows = t.export()
    for p in paths:
        t.save(p, incremental=True)
        got_keys, got_rows = embstore.Table.load(p).export()
        np.testing.assert_array_equal(got_keys, want_keys)
        np.testing.assert_array_equal(got_rows, want_rows)
        mk, mr = embstore.Table.load(p, mmap=True).export()
        np.testing.assert_array_equal(mk, want_keys)
        np.testing.assert_array_equal(mr, want_rows)
