"""A checkpoint written in parts (one per rank of a ShardedTable: save_part,
then publish_parts) while other saves publish to the same directory: no
save deletes the files of a part save that has not published yet, and
every publish succeeds with a whole checkpoint."""

from __future__ import annotations

import pathlib
import threading

import numpy as np
import pytest

import embstore
from embstore import _core, optim


@pytest.mark.slow
def test_part_saves_survive_concurrent_saves_to_the_same_directory(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "ck"
    parted = embstore.Table(4, optimizer=optim.SGD(lr=0.1), seed=1)
    parted.lookup(np.arange(300))
    other = embstore.Table(4, optimizer=optim.SGD(lr=0.1), seed=1)
    other.lookup(np.arange(300, 600))
    whole = embstore.Table(4, optimizer=optim.SGD(lr=0.1), seed=2)
    whole.lookup(np.arange(200))
    whole.save(path)
    stop = threading.Event()
    failures: list[str] = []
    saves = [0]

    def saver() -> None:
        while not stop.is_set():
            whole.save(path)
            saves[0] += 1

    th = threading.Thread(target=saver)
    th.start()
    try:
        for _ in range(60):
            ckpt = _core.new_checkpoint_id()
            try:
                a = parted.save_part(path, f"{ckpt}-r0000")
                b = other.save_part(path, f"{ckpt}-r0001")
                parted.publish_parts(path, ckpt, [a, b], 600)
            except embstore.CheckpointError as e:
                failures.append(str(e))
    finally:
        stop.set()
        th.join()
    assert saves[0] > 0
    assert not failures, f"{len(failures)} of 60 part saves failed: {failures[0]}"
    # Whatever was published last loads whole.
    t = embstore.Table.load(path)
    assert len(t) in (200, 600)
