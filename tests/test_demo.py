"""The main job: a short run of the CTR demo learns the planted model."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore import demo


def test_short_demo_reaches_auc_and_torch_version_agrees() -> None:
    ours = demo.run(200_000, 4096, 8, use_torch=False, seed=0, quiet=True, test_samples=50_000)
    assert ours["test_auc"] >= 0.75, ours
    assert ours["test_auc"] < ours["planted_auc"]
    assert ours["step"] == 49
    theirs = demo.run(200_000, 4096, 8, use_torch=True, seed=0, quiet=True, test_samples=50_000)
    # Same model, same data: the torch module path trains to the same result.
    assert theirs["test_auc"] == pytest.approx(ours["test_auc"], abs=2e-3)
    assert theirs["rows"] == ours["rows"], "eval-mode lookups must not insert rows"


def test_auc_matches_pairwise_definition() -> None:
    rng = np.random.default_rng(0)
    label = (rng.random(300) < 0.3).astype(np.float32)
    score = np.round(rng.normal(size=300) + label, 1)  # with ties
    pos, neg = score[label > 0.5], score[label < 0.5]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert demo.auc(label, score) == pytest.approx(pairs, abs=1e-12)


def test_demo_publishes_what_it_trained_for_serving_and_checkpoints_it(tmp_path) -> None:
    """--publish DIR: the table's rows, rows only, served mapped; --checkpoint
    DIR2: with optimizer state, loadable to train on."""
    pub, ckpt = str(tmp_path / "pub"), str(tmp_path / "ckpt")
    r = demo.run(100_000, 4096, 8, False, 0, True, 10_000, publish=pub, checkpoint=ckpt)
    served = embstore.Table.load(pub, mmap=True)
    assert len(served) == r["rows"]
    keys, rows = served.export()
    back = embstore.Table.load(ckpt)
    assert back.optimizer is not None
    assert back.step == r["step"]
    # Both paths hold the trained table's final rows (each its own chain).
    back_keys, back_rows = back.export()
    np.testing.assert_array_equal(back_keys, keys)
    np.testing.assert_array_equal(back_rows, rows)
    assert np.abs(rows).max() > 0.05  # trained away from the N(0, 0.01) init


@pytest.mark.slow
def test_demo_command_prints_its_report() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "embstore", "demo", "--samples", "50000", "--test-samples", "20000"],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    for what in ("held-out AUC", "samples/s", "table:", "train loss"):
        assert what in out.stdout
    # stderr is a pipe here: phase lines, no bar (tests/test_cli.py)
    assert "training: 13 steps of 4,096 samples" in out.stderr
    assert "\r" not in out.stderr


@pytest.mark.slow
def test_demo_draws_its_progress_bar_on_a_terminal() -> None:
    """On a terminal (a pseudo-terminal here) the demo draws its bar."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    # A terminal's size, as a real one has (tqdm draws to its width).
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "embstore",
                "demo",
                "--samples",
                "50000",
                "--test-samples",
                "20000",
            ],
            stdout=subprocess.PIPE,
            stderr=follower,
            text=True,
            timeout=300,
            check=True,
        )
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not data:
                break
            chunks.append(data)
    finally:
        if follower >= 0:
            os.close(follower)
        os.close(leader)
    tty_err = b"".join(chunks).decode()
    assert "held-out AUC" in proc.stdout
    # tqdm's bar (a test dependency): the label, the count, the last loss.
    assert "training: 100%" in tty_err, tty_err[-500:]
    assert "13/13" in tty_err
    assert "loss 0." in tty_err
