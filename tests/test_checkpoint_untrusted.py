"""A checkpoint directory is untrusted input: loading, inspecting and saving
never block on, follow, create or read anything but regular files inside
the directory. Each case runs in a child process under a timeout, so a
hang fails the test instead of hanging the suite."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import embstore

from . import _child

TIMEOUT = 60


def _saved(path: pathlib.Path) -> list[str]:
    t = embstore.Table(4, num_shards=2)
    t.lookup(np.arange(100))
    t.save(path)
    return sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))


def _child_refusal(body: str) -> str:
    src = "from embstore.exceptions import CheckpointError\ntry:\n"
    src += "".join(f"    {line}\n" for line in body.strip().splitlines())
    src += "except CheckpointError as e:\n    print('REFUSED', e)\nelse:\n    print('ACCEPTED')\n"
    return _child.ok(src, timeout=TIMEOUT)


def _fifo(path: pathlib.Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


@pytest.mark.parametrize("which", ["manifest", "shard"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_without_blocking(
    tmp_path: pathlib.Path, which: str
) -> None:
    ck = tmp_path / "ck"
    shards = _saved(ck)
    _fifo(ck / ("manifest.json" if which == "manifest" else shards[0]))
    out = _child_refusal(f"embstore.Table.load({str(ck)!r})")
    assert "REFUSED" in out, out
    assert "regular file" in out, out
    # inspect makes the same checks and exits non-zero, naming the file.
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "embstore", "inspect", str(ck)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"inspect hung on a FIFO {which} file")
    assert proc.returncode != 0, proc
    assert "regular file" in proc.stdout + proc.stderr, proc


def test_a_fifo_lock_file_is_refused_by_load_and_save_without_blocking(
    tmp_path: pathlib.Path,
) -> None:
    ck = tmp_path / "ck"
    _saved(ck)
    _fifo(ck / ".embstore-lock")
    out = _child_refusal(f"embstore.Table.load({str(ck)!r})")
    assert "REFUSED" in out, out
    assert ".embstore-lock" in out, out
    out = _child_refusal(f"t = embstore.Table(4); t.lookup(np.arange(5)); t.save({str(ck)!r})")
    assert "REFUSED" in out, out
    assert ".embstore-lock" in out, out


def test_a_symlinked_lock_file_never_creates_its_target(tmp_path: pathlib.Path) -> None:
    ck = tmp_path / "ck"
    _saved(ck)
    (ck / ".embstore-lock").unlink()
    target = tmp_path / "outside-file"
    os.symlink(target, ck / ".embstore-lock")
    t = embstore.Table(4)
    t.lookup(np.arange(5))
    with pytest.raises(embstore.CheckpointError, match="embstore-lock"):
        t.save(ck)
    assert not target.exists(), "save created a file outside the checkpoint directory"
    with pytest.raises(embstore.CheckpointError, match="embstore-lock"):
        embstore.Table.load(ck)


def test_a_shard_file_symlinked_to_a_file_outside_is_not_read(tmp_path: pathlib.Path) -> None:
    ck, other = tmp_path / "ck", tmp_path / "other"
    shards = _saved(ck)
    _saved(other)
    # The same bytes behind a link: every check would pass if it were followed.
    real = other / "moved.bin"
    os.replace(ck / shards[0], real)
    os.symlink(real, ck / shards[0])
    with pytest.raises(embstore.CheckpointError, match="symbolic link"):
        embstore.Table.load(ck)
    with pytest.raises(embstore.CheckpointError, match="symbolic link"):
        embstore.Table.load(ck, num_shards=1)
