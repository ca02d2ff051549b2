"""Live updates of a mapped table: ``refresh()`` serves a trainer's
incremental publishes, a new full save and a compacted chain, equal to the
trainer's table each time; a lookup sees one published version whole while
refreshes swap versions under it; a damaged publish is refused and the old
version served on; ``follow=`` refreshes in the background, across
processes. Also: a trainer's incremental publishes to one path and
checkpoints to another each keep their own chain."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import embstore
from embstore.exceptions import CheckpointError

from .test_mapped import DIM, assert_reads_equal, row_files, trained

KEYS_SEEN = np.arange(-600, 2_600, 3)


def opened(
    tmp_path: pathlib.Path,
) -> tuple[embstore.Table, pathlib.Path, embstore.MappedTable, np.ndarray, set[str]]:
    """A trained table saved for serving and mapped: the table, the path,
    the mapped table, what it serves for KEYS_SEEN and its files' names."""
    t = trained()
    path = tmp_path / "serve"
    t.save(path, with_optimizer=False)
    mapped = embstore.Table.load(path, mmap=True)
    return t, path, mapped, mapped.lookup(KEYS_SEEN), {p.name for p in row_files(path)}


def publish(t: embstore.Table, path: pathlib.Path) -> dict:
    """A serving publish: rows only, incremental."""
    return t.save(path, incremental=True, with_optimizer=False)


def churn(t: embstore.Table, rng: np.random.Generator) -> None:
    """Trains some rows, removes some, inserts new ones."""
    k = rng.integers(-500, 2_500, 200)
    t.lookup(k)
    t.apply_gradients(k, rng.standard_normal((k.size, DIM)).astype(np.float32))
    t.remove(rng.integers(-500, 2_000, 30))


def test_refresh_serves_each_publish_and_reports_whether_one_came(tmp_path) -> None:
    t = trained()
    path = tmp_path / "serve"
    t.save(path, with_optimizer=False)
    mapped = embstore.Table.load(path, mmap=True)
    assert mapped.refresh() is False
    rng = np.random.default_rng(1)
    kinds = []
    for _ in range(12):
        churn(t, rng)
        before = mapped.lookup(KEYS_SEEN)
        m = publish(t, path)
        kinds.append((m["chain"][-1]["kind"], len(m["chain"])))
        # Not served before the refresh...
        np.testing.assert_array_equal(mapped.lookup(KEYS_SEEN), before)
        assert mapped.refresh() is True
        assert mapped.refresh() is False
        # ...and equal to the trainer's table after it.
        assert_reads_equal(t, mapped)
    # The chain was compacted on the way (never more than 9 links).
    assert max(n for _, n in kinds) <= 9
    assert any(n == 2 for _, n in kinds[8:]), kinds


def test_a_new_full_save_becomes_the_new_base(tmp_path) -> None:
    t, path, mapped, before, old = opened(tmp_path)
    churn(t, np.random.default_rng(2))
    t.save(path, with_optimizer=False)
    # The save deleted the old files (no reader holds the directory); the
    # mapped table still serves its version from its maps until it refreshes.
    assert not old & {p.name for p in row_files(path)}
    np.testing.assert_array_equal(mapped.lookup(KEYS_SEEN), before)
    assert mapped.refresh() is True
    assert_reads_equal(t, mapped)


def test_a_damaged_publish_is_refused_and_the_old_version_served(tmp_path) -> None:
    t, path, mapped, before, old = opened(tmp_path)
    churn(t, np.random.default_rng(3))
    publish(t, path)
    new = [p for p in row_files(path) if p.name not in old]
    assert new
    data = bytearray(new[0].read_bytes())
    data[-20] ^= 0x10
    new[0].write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        mapped.refresh()
    np.testing.assert_array_equal(mapped.lookup(KEYS_SEEN), before)


def test_a_lookup_sees_one_version_whole_while_refreshes_swap_them(tmp_path) -> None:
    """Every row of version v holds v in every column; the trainer publishes
    v + 1 for every key (deltas, compactions and full saves) while a thread
    refreshes and readers look up: each call's rows hold one value."""
    keys = np.arange(5_000, dtype=np.int64)
    t = embstore.Table(8, num_shards=4)
    t.assign(keys, np.zeros((keys.size, 8), np.float32))
    path = tmp_path / "serve"
    t.save(path, with_optimizer=False)
    mapped = embstore.Table.load(path, mmap=True)
    stop = threading.Event()
    errors: list[str] = []
    seen: set[float] = set()

    def refresher() -> None:
        while not stop.is_set():
            mapped.refresh()

    def reader(n: int) -> None:
        rng = np.random.default_rng(n)
        while not stop.is_set():
            k = keys if n == 0 else rng.choice(keys, n)
            rows = mapped.lookup(k)
            values = np.unique(rows)
            seen.update(values.tolist())
            if values.size != 1:
                errors.append(f"one call read versions {values[:4]}")
                return

    threads = [threading.Thread(target=refresher)]
    threads += [threading.Thread(target=reader, args=(n,)) for n in (0, 16, 1_000)]
    for th in threads:
        th.start()
    try:
        for v in range(1, 25):
            t.assign(keys, np.full((keys.size, 8), v, np.float32))
            publish(t, path)
            time.sleep(0.01)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=60)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    assert len(seen) > 3, seen  # readers did see versions change


def test_follow_serves_a_publish_from_another_process_within_a_second(tmp_path) -> None:
    t = embstore.Table(4, num_shards=2)
    t.assign(np.arange(100), np.zeros((100, 4), np.float32))
    path = tmp_path / "serve"
    t.save(path, with_optimizer=False)
    child = textwrap.dedent(
        f"""
        import sys, time, embstore
        m = embstore.Table.load({str(path)!r}, mmap=True, follow=1.0)
        print("ready", flush=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if m.lookup([7])[0, 0] == 1.0:
                print("served", time.time(), flush=True)
                sys.exit(0)
            time.sleep(0.005)
        sys.exit(1)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with subprocess.Popen(
        [sys.executable, "-c", child], stdout=subprocess.PIPE, text=True, env=env
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            t.assign([7], np.ones((1, 4), np.float32))
            publish(t, path)
            published = time.time()
            line = proc.stdout.readline().split()
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()
    assert line[0] == "served"
    assert float(line[1]) - published < 1.0


def test_follow_is_checked_and_stops_with_close(tmp_path) -> None:
    t = embstore.Table(4)
    t.assign([1], np.ones((1, 4), np.float32))
    t.save(tmp_path / "c")
    for bad, err in (
        (0, ValueError),
        (-1.0, ValueError),
        (float("nan"), ValueError),
        ("1", TypeError),
    ):
        with pytest.raises(err, match="follow"):
            embstore.Table.load(tmp_path / "c", mmap=True, follow=bad)
    with pytest.raises(ValueError, match="follow"):
        embstore.Table.load(tmp_path / "c", follow=1.0)
    m = embstore.Table.load(tmp_path / "c", mmap=True, follow=0.05)
    assert m.follow == 0.05
    m.close()
    assert m.follow is None
    # A refresh that fails in the background is kept, and serving goes on.
    m = embstore.Table.load(tmp_path / "c", mmap=True, follow=0.05)
    (tmp_path / "c" / "manifest.json").write_text("{}")
    deadline = time.monotonic() + 10
    while m.follow_error is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert isinstance(m.follow_error, CheckpointError)
    np.testing.assert_array_equal(m.lookup([1]), np.ones((1, 4), np.float32))
    m.close()


def test_publishes_and_checkpoints_to_two_paths_are_both_incremental(tmp_path) -> None:
    """The issue's report: a save to a second path broke the incremental
    chain at the first. Each path now keeps its own."""
    t = trained()
    rng = np.random.default_rng(5)
    serve, train = tmp_path / "serve", tmp_path / "train"
    t.save(serve, with_optimizer=False)
    t.save(train)
    for i in range(4):
        k = rng.integers(-500, 2_500, 40)
        t.apply_gradients(k, rng.standard_normal((k.size, DIM)).astype(np.float32))
        t.remove(rng.integers(-500, 2_000, 5))
        assert publish(t, serve)["chain"][-1]["kind"] == "delta"
        served = embstore.Table.load(serve)
        np.testing.assert_array_equal(served.export()[1], t.export()[1])
        if i % 2:
            assert t.save(train, incremental=True)["chain"][-1]["kind"] == "delta"
            back = embstore.Table.load(train)
            assert back.state_dict()["keys"].tolist() == t.state_dict()["keys"].tolist()
            np.testing.assert_array_equal(
                back.lookup_with_state(KEYS_SEEN, insert=False)[1],
                t.lookup_with_state(KEYS_SEEN, insert=False)[1],
            )
