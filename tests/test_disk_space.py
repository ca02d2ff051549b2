"""The disk a disk table needs, and what it does when the disk is full: on
a file system of its own (a tmpfs of a fixed size), a table whose rows move
in and out for many rounds keeps its dead records bounded (its active
segment is closed once half dead and compacted like any other file), a
write that fails for want of space closes the active segment and starts a
compaction, and once space returns the table is back within its memory
bound, every row as a table in memory holds it. At 0306b22 the
active segment kept every dead record until it reached 64 MiB, so a disk
with room for the live rows filled, writes failed for good and every row
stayed in memory."""

from __future__ import annotations

import gc
import os
import pathlib
import subprocess
import time
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

import embstore
from embstore import optim

DIM = 64
ROWS = 12_000
MEMORY_ROWS = 1_428


@pytest.fixture
def small_disk(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """A 40 MiB tmpfs (root only: mount), unmounted however the test ends."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    got = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {got.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _train(tables: list[embstore.Table], rng: np.random.Generator, rounds: int) -> None:
    for _ in range(rounds):
        keys = rng.integers(0, ROWS, 2_000).astype(np.int64)
        grads = rng.standard_normal((len(keys), DIM)).astype(np.float32)
        for t in tables:
            t.lookup(keys)
            t.apply_gradients(keys, grads)


def test_a_full_disk_is_reclaimed_and_the_memory_bound_comes_back(
    small_disk: pathlib.Path,
) -> None:
    settings = {"optimizer": optim.Adam(lr=0.01), "seed": 9, "num_shards": 2}
    ram = embstore.Table(DIM, **settings)
    probe = embstore.Table(DIM, disk=small_disk / "probe", memory_bytes=1 << 20, **settings)
    cost = probe.stats()["row_cost"]
    del probe
    disk = embstore.Table(
        DIM, disk=small_disk / "spill", memory_bytes=MEMORY_ROWS * cost, **settings
    )
    bound = MEMORY_ROWS + 2 * 2_000  # the bound, and a call's rows on top
    for at in range(0, ROWS, 3_000):
        ram.lookup(np.arange(at, at + 3_000))
        disk.lookup(np.arange(at, at + 3_000))
    rng = np.random.default_rng(4)
    # About 130 MB of records written over the rounds, on a 40 MiB disk
    # whose live rows take about 10 MB: only reclaimed dead records fit.
    for _ in range(8):
        _train([ram, disk], rng, 10)
        st = disk.stats()
        assert st["disk_error"] is None, st
        assert st["memory_rows"] <= bound, st
    assert disk.stats()["disk_rows_compacted"] > 0

    # The disk fills with another file: writes fail, rows stay in memory,
    # the failure is reported (to the next call, and in stats()).
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    # The next call after a failed round is told, as a warning: training
    # goes on.
    with pytest.warns(RuntimeWarning, match="could not move rows out of memory") as told:
        _train([ram, disk], rng, 6)
    assert "No space left on device" in str(told[0].message), told[0].message
    assert disk.stats()["disk_error"] is not None
    # Space returns: within a few rounds the bound holds again (the next
    # calls may still be told of the rounds and compaction jobs that failed
    # while the disk was full).
    filler.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(20):
            _train([ram, disk], rng, 1)
            if disk.stats()["memory_rows"] <= bound:
                break
        st = disk.stats()
        assert st["memory_rows"] <= bound, st
        assert st["memory_rows"] + st["disk_rows"] == st["rows"] == len(ram) == ROWS
        # Every row and its state as the table in memory holds them.
        keys = np.arange(ROWS)
        rows, state = disk.lookup_with_state(keys, insert=False)
    want_rows, want_state = ram.lookup_with_state(keys, insert=False)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(state, want_state)
    used = sum(p.stat().st_size for p in (small_disk / "spill").rglob("*") if p.is_file())
    assert used < 40 << 20, used
    del disk
    gc.collect()
    # Its files go with it (once a compaction job running then has ended).
    deadline = time.monotonic() + 30
    while os.listdir(small_disk / "spill") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.listdir(small_disk / "spill")
