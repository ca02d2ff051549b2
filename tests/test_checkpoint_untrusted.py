"""A checkpoint directory is untrusted input: loading, inspecting and saving
never block on, follow, create or read anything but regular files inside
the directory. Each case runs in a child process under a timeout, so a
hang fails the test instead of hanging the suite."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import embstore
from embstore import optim
from embstore.exceptions import CheckpointError

from . import _child
from ._crafted import crc32c, load_refusal, rewrite_manifest, saved_sgd_table
from .conftest import assert_same, snapshot

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


@pytest.mark.slow
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


def test_crafted_checksum_helper_reproduces_the_writers_checksum(tmp_path: pathlib.Path) -> None:
    saved_sgd_table(tmp_path / "ck")
    rewrite_manifest(tmp_path / "ck", lambda m: None)
    assert len(embstore.Table.load(tmp_path / "ck")) == 200


@pytest.mark.slow
@pytest.mark.parametrize("rows", [10**15, 10**9])
def test_a_crafted_row_count_is_refused_before_anything_is_allocated(
    tmp_path: pathlib.Path, rows: int
) -> None:
    path = tmp_path / "ck"
    saved_sgd_table(path)
    rewrite_manifest(path, lambda m: m.update(rows=rows))
    assert "more than its files hold" in load_refusal(path, 512 << 20)


def test_rows_a_manifest_claims_and_its_files_lack_commit_no_memory(
    tmp_path: pathlib.Path,
) -> None:
    """A load sizes its index from the manifest before any file is read;
    that index must not be mapped in before the files confirm the count (a
    lie of 50M rows would make 1 GiB of it resident, then be refused)."""
    path = tmp_path / "ck"
    saved_sgd_table(path)
    per = 25_000_000

    def lie(m: dict) -> None:
        m["rows"] = 2 * per
        for e in m["chain"][0]["files"]:
            e["rows"], e["bytes"] = per, per * 64

    rewrite_manifest(path, lie)
    out = _child.ok(
        f"""
        import resource
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            embstore.Table.load({str(path)!r})
        except embstore.CheckpointError as e:
            print("refused:", e)
        print("grew", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
        """,
        timeout=60,
    )
    assert "refused:" in out, out
    assert "truncated or replaced" in out, out
    grew_kib = int(out.split("grew")[-1])
    assert grew_kib < 100 << 10, out


@pytest.mark.slow
def test_a_manifest_that_is_a_link_to_dev_zero_is_refused_at_once(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "ck"
    saved_sgd_table(path)
    (path / "manifest.json").unlink()
    os.symlink("/dev/zero", path / "manifest.json")
    assert "symbolic link" in load_refusal(path, None)


@pytest.mark.slow
def test_a_huge_manifest_is_refused_without_reading_it(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ck"
    saved_sgd_table(path)
    with open(path / "manifest.json", "r+b") as f:
        f.truncate(216 << 20)  # sparse: no disk used
    assert "bytes, more than the" in load_refusal(path, 128 << 20)


def test_load_does_not_parse_the_manifest_in_python() -> None:
    from embstore import store

    def consts(code: object) -> list[object]:
        out: list[object] = []
        for c in code.co_consts:  # type: ignore[attr-defined]
            out += consts(c) if hasattr(c, "co_consts") else [c]
        return out

    assert "manifest.json" not in consts(store.Table.load.__func__.__code__)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_crafted_checkpoint_with_nan_rows_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ck"
    saved_sgd_table(path, n=8)
    m = json.loads((path / "manifest.json").read_text())
    entry = m["chain"][0]["files"][0]
    f = path / entry["name"]
    data = bytearray(f.read_bytes())
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])
    start = 8 + hlen + header["rows"]["data_offsets"][0]
    data[start : start + 4] = struct.pack("<f", float("nan"))
    f.write_bytes(bytes(data))

    def fix(m: dict) -> None:  # type: ignore[type-arg]
        for e in m["chain"][0]["files"]:
            if e["name"] == entry["name"]:
                e["crc32c"] = crc32c(bytes(data))

    rewrite_manifest(path, fix)
    with pytest.raises(CheckpointError, match=r'tensor "rows" holds NaN or inf'):
        embstore.Table.load(path)
    proc = subprocess.run(
        [sys.executable, "-m", "embstore", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "all ok" not in proc.stdout
    assert "NaN or inf" in proc.stdout + proc.stderr


def test_a_step_beyond_the_counter_is_refused_not_wrapped(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ck"
    saved_sgd_table(path, n=8)
    rewrite_manifest(path, lambda m: m.update(step=2**64 - 1))
    with pytest.raises(CheckpointError, match=r"step 18446744073709551615 out of range"):
        embstore.Table.load(path)
    rewrite_manifest(path, lambda m: m.update(step=2**63 - 1))
    t = embstore.Table.load(path)
    before = snapshot(t)
    with pytest.raises(ValueError, match=r"^step: the table is at step"):
        t.apply_gradients([1], np.ones((1, 4)))
    assert_same(before, snapshot(t))


def test_manifest_rows_check_keeps_valid_chains(tmp_path: pathlib.Path) -> None:
    # Incremental chains (rows removed and re-added) still load.
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.5))
    t.lookup(np.arange(100))
    t.save(tmp_path / "ck")
    t.remove(np.arange(50))
    t.lookup(np.arange(200, 260))
    t.save(tmp_path / "ck", incremental=True)
    assert_same(snapshot(embstore.Table.load(tmp_path / "ck")), snapshot(t))


if __name__ == "__main__":  # pragma: no cover
    print(textwrap.dedent(__doc__ or ""))
