"""Table.export(consistent=False): each row whole while a writer changes,
inserts and removes rows; equal to the snapshot on a quiet table."""

from __future__ import annotations

import threading

import numpy as np

import embstore
from embstore import optim


def test_a_live_export_equals_the_snapshot_on_a_quiet_table() -> None:
    t = embstore.Table(8, optimizer=optim.Adam(lr=0.01), num_shards=4)
    keys = np.arange(-500, 1500, dtype=np.int64) * 31
    t.lookup(keys)
    t.apply_gradients(keys[::3], np.ones((len(keys[::3]), 8), np.float32))
    t.remove(keys[:10])
    want = t.export(with_state=True)
    got = t.export(with_state=True, consistent=False)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_live_exports_see_every_row_whole_while_a_writer_changes_and_removes_rows() -> None:
    dim = 64
    t = embstore.Table(dim, num_shards=4)
    keys = np.arange(4_000, dtype=np.int64)
    t.assign(keys, np.repeat(keys.astype(np.float32)[:, None], dim, axis=1))
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        rng = np.random.default_rng(1)
        step = 0
        try:
            while not stop.is_set():
                step += 1
                k = rng.choice(6_000, 300, replace=False).astype(np.int64)
                t.assign(k, np.full((len(k), dim), float(step), np.float32))
                t.remove(rng.choice(6_000, 100, replace=False).astype(np.int64))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    try:
        for _ in range(30):
            k, rows = t.export(consistent=False)
            assert np.all(np.diff(k) > 0), "keys ascending, each once"
            torn = np.flatnonzero(~np.all(rows == rows[:, :1], axis=1))
            assert torn.size == 0, f"rows not whole: keys {k[torn[:5]]}"
    finally:
        stop.set()
        th.join(timeout=60)
    assert not th.is_alive(), "the writer finished"
    assert not errors, errors
