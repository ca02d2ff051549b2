"""Saves and loads of one checkpoint directory from several threads and
processes at once: every load gets a whole checkpoint, two savers leave one
whole checkpoint, a failed save leaves nothing behind."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore import optim

from . import _child
from ._crafted import saved_sgd_table

SAVER = """
import sys, numpy as np, embstore
from embstore import optim
path, tag, rounds, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
t = embstore.Table(8, optimizer=optim.SGD(lr=0.5), num_shards=16)
t.assign(np.arange(n), np.full((n, 8), float(tag), np.float32))
for _ in range(rounds):
    t.save(path)
print("saved")
"""


def _saver(path: pathlib.Path, tag: int, rounds: int, n: int = 2000) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SAVER, str(path), str(tag), str(rounds), str(n)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _assert_whole(path: pathlib.Path, tags: set[float], n: int = 2000) -> float:
    """The checkpoint loads and is one saver's table, whole."""
    t = embstore.Table.load(path)
    keys, rows = t.export()
    np.testing.assert_array_equal(keys, np.arange(n))
    vals = set(np.unique(rows).tolist())
    assert len(vals) == 1, vals
    assert vals <= tags, vals
    return vals.pop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_saving_to_one_path_leave_one_whole_checkpoint(
    tmp_path: pathlib.Path,
) -> None:
    for trial in range(5):
        path = tmp_path / f"ck{trial}"
        procs = [_saver(path, tag, 6) for tag in (1, 2)]
        for p in procs:
            _out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
        _assert_whole(path, {1.0, 2.0})
        # Nothing but the winner's files (and the lock) stays behind.
        m = json.loads((path / "manifest.json").read_text())
        named = {f["name"] for link in m["chain"] for f in link["files"]}
        assert set(os.listdir(path)) == named | {"manifest.json", ".embstore-lock"}


@pytest.mark.timeout(300)
def test_two_threads_with_two_tables_saving_to_one_path(tmp_path: pathlib.Path) -> None:
    from ._concurrent import run_concurrently

    path = tmp_path / "ck"
    tables = []
    for tag in (3, 4):
        t = embstore.Table(8, optimizer=optim.SGD(lr=0.5), num_shards=4)
        t.assign(np.arange(2000), np.full((2000, 8), float(tag), np.float32))
        tables.append(t)

    def saves(t: embstore.Table) -> None:
        for _ in range(10):
            t.save(path)

    assert run_concurrently(*(lambda t=t: saves(t) for t in tables)) == []
    _assert_whole(path, {3.0, 4.0})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_loads_while_another_process_saves_always_get_a_whole_checkpoint(
    tmp_path: pathlib.Path,
) -> None:
    # 300,000 rows: a load (two passes over the files) outlasts a save, so
    # saves publish while loads read (before the readers' lock, 10 of 148
    # loads failed here with "missing or unreadable").
    path, n = tmp_path / "ck", 300_000
    first = _saver(path, 1, 1, n)
    first.communicate(timeout=120)
    assert first.returncode == 0
    saver = _saver(path, 2, 80, n)
    loads, seen = 0, set()
    try:
        while saver.poll() is None:
            seen.add(_assert_whole(path, {1.0, 2.0}, n))
            loads += 1
    finally:
        _, err = saver.communicate(timeout=120)
    assert saver.returncode == 0, err[-2000:]
    seen.add(_assert_whole(path, {1.0, 2.0}, n))
    assert loads >= 3, loads
    assert seen == {1.0, 2.0}


def test_a_load_without_the_lock_file_retries_when_the_manifest_changes(
    tmp_path: pathlib.Path,
) -> None:
    # A checkpoint of an older writer has no lock file; its files vanish
    # only when a newer manifest replaced them: the load reads the new one.
    t = saved_sgd_table(tmp_path / "ck")
    (tmp_path / "ck" / ".embstore-lock").unlink()
    assert len(embstore.Table.load(tmp_path / "ck")) == len(t)


@pytest.mark.slow
def test_a_failed_save_removes_its_files_and_the_next_save_works(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "ck"
    t = saved_sgd_table(path)
    before = set(os.listdir(path))
    # A save that fails half way, in a child: RLIMIT_FSIZE makes the writes
    # past a size fail (EFBIG), as a full disk would, after some files of
    # the new checkpoint were written.
    out = _child.run(
        f"""
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        t = embstore.Table.load({str(path)!r})
        t.lookup(np.arange(50_000))
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
        try:
            t.save({str(path)!r})
        except embstore.CheckpointError as e:
            print("refused:", e)
        """
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "refused:" in out.stdout, out.stdout
    assert set(os.listdir(path)) == before, "the failed save left files behind"
    assert len(embstore.Table.load(path)) == 200
    t.save(path)
    assert len(embstore.Table.load(path)) == len(t)
