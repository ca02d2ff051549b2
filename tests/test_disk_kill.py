"""A disk table trained and saved incrementally, SIGKILLed at random moments
20 times: each time its checkpoint reopens whole at its last save, and
equals the same training replayed in memory to that step (the oracle); the
next run opens it as a disk table and trains on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import embstore
from embstore import optim

pytestmark = pytest.mark.slow

DIM, KEYS = 8, 3000

CHILD = r"""
import os, sys
import numpy as np
import embstore
from embstore import optim
ck, disk, memory = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, os.path.dirname(sys.argv[4]))
from test_disk_kill import batch
if os.path.exists(os.path.join(ck, "manifest.json")):
    t = embstore.Table.load(ck, disk=disk, memory_bytes=memory)
else:
    t = embstore.Table(8, optimizer=optim.Adam(lr=0.05), seed=3, disk=disk, memory_bytes=memory)
saved = os.path.exists(os.path.join(ck, "manifest.json"))
while True:
    step = t.step + 1
    keys, grads = batch(step)
    t.lookup(keys)
    t.apply_gradients(keys, grads)
    if step % 3 == 0:
        t.save(ck, incremental=saved)
        saved = True
"""


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    keys = rng.zipf(1.2, 256) % KEYS
    return keys.astype(np.int64), rng.standard_normal((256, DIM)).astype(np.float32)


def test_a_killed_disk_table_reopens_whole_at_its_last_save(tmp_path: Path) -> None:
    ck, disk = tmp_path / "ck", tmp_path / "disk"
    oracle = embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=3)
    memory = 200 * oracle.stats()["row_cost"] * 2
    rng = np.random.default_rng(20261126)
    seen = []
    for round_ in range(20):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(ck), str(disk), str(memory), __file__],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(float(rng.uniform(0.6, 1.6)))
        child.send_signal(signal.SIGKILL)
        _, err = child.communicate(timeout=30)
        assert child.returncode == -signal.SIGKILL, err.decode()
        if not (ck / "manifest.json").exists():
            continue
        back = embstore.Table.load(ck)
        assert back.step % 3 == 0, f"round {round_}: a save is at a step of 3"
        assert back.step >= (seen[-1] if seen else 0), "never older than an earlier save"
        while oracle.step < back.step:
            keys, grads = batch(oracle.step + 1)
            oracle.lookup(keys)
            oracle.apply_gradients(keys, grads)
        want, got = oracle.state_dict(), back.state_dict()
        for name in ("keys", "rows", "state", "step"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"round {round_}")
        seen.append(back.step)
    assert len(seen) >= 15, seen
    assert seen[-1] > seen[0], seen
    # The killed runs' directories are gone: the next table made there
    # removed them, and this one's went with it.
    embstore.Table(DIM, disk=disk, memory_bytes=memory)
    assert os.listdir(disk) == []
