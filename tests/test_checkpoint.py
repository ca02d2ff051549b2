"""Checkpoints: resume equals uninterrupted training (bitwise), crash safety
under SIGKILL, damage and fuzzing refused with CheckpointError, incremental
deltas, resharding, serving exports and files readable without embstore."""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embstore
from embstore import CheckpointError, init, optim
from tests.conftest import assert_same, key_pool, snapshot

DIM = 6

OPTIMIZERS = [
    optim.SGD(lr=0.1),
    optim.Adagrad(lr=0.1, initial_accumulator_value=0.1),
    optim.RowWiseAdagrad(lr=0.1),
    optim.Adam(lr=0.01),
    optim.AdamW(lr=0.01, weight_decay=0.1),
    optim.Ftrl(lr=0.1, l1=0.01, l2=0.01),
]


def train(table: embstore.Table, seed: int, steps: int, pool: np.ndarray) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        keys = rng.choice(pool, 64)
        table.apply_gradients(keys, rng.normal(size=(64, DIM)).astype(np.float32))


def bits_equal(a: embstore.Table, b: embstore.Table) -> None:
    for x, y in zip(a.export(with_state=True), b.export(with_state=True), strict=True):
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
    assert a.step == b.step


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_resume_equals_uninterrupted_training_bitwise(
    tmp_path: pathlib.Path, rng: np.random.Generator, opt: optim.Optimizer
) -> None:
    pool = key_pool(rng, 400)
    straight = embstore.Table(DIM, optimizer=opt, seed=7, num_shards=4)
    train(straight, 1, 10, pool)
    train(straight, 2, 10, pool)

    first = embstore.Table(DIM, optimizer=opt, seed=7, num_shards=4)
    train(first, 1, 10, pool)
    first.save(tmp_path / "ck")
    resumed = embstore.Table.load(tmp_path / "ck", num_shards=3)
    assert resumed.optimizer == opt
    assert resumed.initializer == first.initializer
    assert resumed.num_shards == 3
    train(resumed, 2, 10, pool)
    bits_equal(resumed, straight)
    # New keys after the load get the same initial rows too (seed restored).
    np.testing.assert_array_equal(resumed.lookup([10**15]), straight.lookup([10**15]))


def test_incremental_chain_replays_and_writes_about_the_changed_share(
    tmp_path: pathlib.Path,
) -> None:
    n = 100_000
    table = embstore.Table(16, optimizer=optim.Adam(lr=0.01), seed=1)
    keys = np.arange(n) * 3
    table.apply_gradients(keys, np.ones((n, 16), np.float32))
    full = table.save(tmp_path / "ck")
    full_bytes = sum(f["bytes"] for f in full["chain"][0]["files"])
    touched = keys[: n // 100]
    table.apply_gradients(touched, np.ones((len(touched), 16), np.float32))
    removed = keys[-50:]
    assert table.remove(removed) == 50
    delta = table.save(tmp_path / "ck", incremental=True)
    link = delta["chain"][1]
    assert link["kind"] == "delta"
    assert sum(f["rows"] for f in link["files"]) == len(touched)
    assert link["removed"]["rows"] == 50
    delta_bytes = sum(f["bytes"] for f in link["files"]) + link["removed"]["bytes"]
    ratio = delta_bytes / full_bytes
    assert 0.008 < ratio < 0.015, f"delta is {ratio:.2%} of a full save"
    # A second delta on top, then load: base + deltas equal the live table.
    table.assign([10**12], np.zeros((1, 16)))
    table.save(tmp_path / "ck", incremental=True)
    loaded = embstore.Table.load(tmp_path / "ck")
    bits_equal(loaded, table)
    # Continuing from the loaded table is allowed (it knows its base).
    loaded.apply_gradients([3], np.ones((1, 16)))
    assert len(loaded.save(tmp_path / "ck", incremental=True)["chain"]) == 4
    bits_equal(embstore.Table.load(tmp_path / "ck"), loaded)


def test_incremental_needs_a_base_at_that_path(tmp_path: pathlib.Path) -> None:
    a = embstore.Table(4, optimizer=optim.SGD(lr=1.0))
    a.lookup([1, 2])
    with pytest.raises(CheckpointError, match="needs an earlier save"):
        a.save(tmp_path / "x", incremental=True)
    b = embstore.Table(4, optimizer=optim.SGD(lr=1.0))
    b.lookup([3])
    b.save(tmp_path / "x")
    with pytest.raises(CheckpointError, match="needs an earlier save"):
        a.save(tmp_path / "x", incremental=True)  # the manifest there is b's
    assert embstore.Table.load(tmp_path / "x").export()[0].tolist() == [3]


def test_serving_export_is_smaller_and_loads_with_fresh_state(tmp_path: pathlib.Path) -> None:
    table = embstore.Table(8, optimizer=optim.Adam(lr=0.1), seed=2)
    table.apply_gradients(np.arange(5000), np.ones((5000, 8)))
    full = table.save(tmp_path / "full")
    serving = table.save(tmp_path / "serving", with_optimizer=False)
    size = lambda m: sum(f["bytes"] for link in m["chain"] for f in link["files"])  # noqa: E731
    # What a serving export drops is the optimizer state: Adam's 16 floats
    # a row (the keys, rows and file index stay).
    assert size(full) - size(serving) >= 5000 * 16 * 4
    loaded = embstore.Table.load(tmp_path / "serving")
    np.testing.assert_array_equal(loaded.export()[1], table.export()[1])
    assert not loaded.export(with_state=True)[2].any()


def test_shard_files_read_without_embstore(tmp_path: pathlib.Path) -> None:
    from safetensors.numpy import load_file

    table = embstore.Table(4, optimizer=optim.Adagrad(lr=0.1), seed=5)
    table.apply_gradients(np.arange(300), np.ones((300, 4)))
    m = table.save(tmp_path / "ck")
    keys, rows, state = [], [], []
    for f in m["chain"][0]["files"]:
        t = load_file(str(tmp_path / "ck" / f["name"]))
        keys.append(t["keys"])
        rows.append(t["rows"])
        state.append(t["state"])
    k = np.concatenate(keys)
    order = np.argsort(k)
    ek, er, es = table.export(with_state=True)
    np.testing.assert_array_equal(k[order], ek)
    np.testing.assert_array_equal(np.concatenate(rows)[order], er)
    np.testing.assert_array_equal(np.concatenate(state)[order], es)
    with open(tmp_path / "ck" / "manifest.json") as fh:
        manifest = json.load(fh)
    assert manifest["optimizer"]["name"] == "Adagrad"


def test_refuses_to_write_into_a_foreign_directory(tmp_path: pathlib.Path) -> None:
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(CheckpointError, match="no embstore manifest"):
        embstore.Table(2).save(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "precious"


def test_old_files_are_removed_after_a_new_full_save(tmp_path: pathlib.Path) -> None:
    table = embstore.Table(2)
    table.lookup(np.arange(100))
    table.save(tmp_path / "ck")
    table.save(tmp_path / "ck")
    m = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    names = {f["name"] for f in m["chain"][0]["files"]} | {"manifest.json", ".embstore-lock"}
    assert set(os.listdir(tmp_path / "ck")) == names


@pytest.mark.timeout(300)
def test_snapshot_is_consistent_while_other_threads_train(tmp_path: pathlib.Path) -> None:
    """Every step moves every row by exactly 1: a consistent snapshot has all
    rows equal to -step. (Also a deadlock regression test: saves racing
    trainer threads once hung when whole calls ran as pool jobs.)"""
    table = embstore.Table(4, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    keys = np.arange(20_000)
    table.lookup(keys)
    stop = threading.Event()

    def trainer() -> None:
        while not stop.is_set():
            table.apply_gradients(keys, np.ones((len(keys), 4), np.float32))

    threads = [threading.Thread(target=trainer) for _ in range(2)]
    for th in threads:
        th.start()
    try:
        for i in range(15):
            time.sleep(0.02)
            m = table.save(tmp_path / f"ck{i}")
            loaded = embstore.Table.load(tmp_path / f"ck{i}")
            rows = loaded.export()[1]
            assert (rows == -float(m["step"])).all(), f"torn snapshot at step {m['step']}"
    finally:
        stop.set()
        for th in threads:
            th.join()


# -- damage ---------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: pathlib.Path) -> tuple[pathlib.Path, embstore.Table]:
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=0.01), seed=3, num_shards=3)
    table.apply_gradients(np.arange(2000), np.ones((2000, DIM)))
    table.save(tmp_path / "ck")
    table.remove([1, 2, 3])
    table.apply_gradients([5, 6], np.ones((2, DIM)))
    table.save(tmp_path / "ck", incremental=True)
    return tmp_path / "ck", table


def files_of(path: pathlib.Path) -> list[pathlib.Path]:
    # The readers' lock file holds no data (an empty file that only locks).
    return sorted(p for p in path.iterdir() if p.name != ".embstore-lock")


def test_intact_checkpoint_loads(saved: tuple[pathlib.Path, embstore.Table]) -> None:
    path, table = saved
    bits_equal(embstore.Table.load(path), table)


def test_every_flipped_byte_position_kind_is_refused(
    saved: tuple[pathlib.Path, embstore.Table],
) -> None:
    path, _ = saved
    r = random.Random(0)
    for f in files_of(path):
        original = f.read_bytes()
        for pos in {0, 8, len(original) // 2, len(original) - 1, r.randrange(len(original))}:
            damaged = bytearray(original)
            damaged[pos] ^= 0x20
            f.write_bytes(bytes(damaged))
            error = ""
            try:
                embstore.Table.load(path)
            except CheckpointError as e:
                error = str(e)
            finally:
                f.write_bytes(original)
            if error:
                assert f.name in error or "manifest" in error
            else:
                # Only a manifest change that leaves its JSON meaning intact
                # (e.g. whitespace) may load, and then it loads the same.
                assert f.name == "manifest.json"


def test_truncated_missing_and_garbage_files_are_refused(
    saved: tuple[pathlib.Path, embstore.Table],
) -> None:
    path, _ = saved
    shard = next(f for f in files_of(path) if f.suffix == ".safetensors")
    original = shard.read_bytes()
    shard.write_bytes(original[:-10])
    with pytest.raises(CheckpointError, match=r"expected \d+ bytes, found \d+"):
        embstore.Table.load(path)
    shard.write_bytes(os.urandom(len(original)))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        embstore.Table.load(path)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing or unreadable"):
        embstore.Table.load(path)
    (path / "manifest.json").write_bytes(os.urandom(300))
    with pytest.raises(CheckpointError, match="not valid JSON"):
        embstore.Table.load(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest"):
        embstore.Table.load(path)


def test_newer_format_version_is_refused(saved: tuple[pathlib.Path, embstore.Table]) -> None:
    path, _ = saved
    m = json.loads((path / "manifest.json").read_text())
    m["version"] = 99
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="format version 99 was written by a newer embstore"):
        embstore.Table.load(path)
    m["version"] = 1
    m["format"] = "something-else"
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="not an embstore checkpoint"):
        embstore.Table.load(path)


def test_edited_manifest_fails_its_checksum(saved: tuple[pathlib.Path, embstore.Table]) -> None:
    path, _ = saved
    m = json.loads((path / "manifest.json").read_text())
    m["step"] += 1
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="manifest checksum mismatch"):
        embstore.Table.load(path)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzzed_files_give_checkpoint_error_or_the_same_table(
    saved: tuple[pathlib.Path, embstore.Table], data: st.DataObject
) -> None:
    path, table = saved
    files = files_of(path)
    f = data.draw(st.sampled_from(files))
    original = f.read_bytes()
    mutation = data.draw(st.sampled_from(["flip", "truncate", "splice", "replace"]))
    b = bytearray(original)
    if mutation == "flip":
        for pos in data.draw(st.lists(st.integers(0, len(b) - 1), min_size=1, max_size=4)):
            b[pos] ^= data.draw(st.integers(1, 255))
    elif mutation == "truncate":
        b = b[: data.draw(st.integers(0, len(b) - 1))]
    elif mutation == "splice":
        pos = data.draw(st.integers(0, len(b)))
        b[pos:pos] = data.draw(st.binary(min_size=1, max_size=64))
    else:
        b = bytearray(data.draw(st.binary(max_size=2048)))
    f.write_bytes(bytes(b))
    try:
        loaded = embstore.Table.load(path)
    except CheckpointError:
        pass
    else:
        bits_equal(loaded, table)
    finally:
        f.write_bytes(original)


# -- crash safety ----------------------------------------------------------------

CHILD = """
import sys, numpy as np, embstore
from embstore import optim
t = embstore.Table(32, optimizer=optim.Adam(lr=0.01), seed=11)
t.assign(np.arange(300_000) * 7, np.full((300_000, 32), float(sys.argv[2]), np.float32))
print("ready", flush=True)
for i in range(1000):
    t.save(sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_during_save_leaves_the_previous_checkpoint_whole(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "ck"
    before = embstore.Table(32, optimizer=optim.Adam(lr=0.01), seed=11)
    before.assign(np.arange(1000), np.ones((1000, 32), np.float32))
    before.save(path)
    expected = snapshot(embstore.Table.load(path))
    r = random.Random(1)
    outcomes = {"old": 0, "new": 0}
    last_value = 1.0
    for trial in range(12):
        value = 2.0 + trial
        with subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), str(value)], stdout=subprocess.PIPE, text=True
        ) as child:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            time.sleep(r.uniform(0.0, 0.6))
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)
        loaded = embstore.Table.load(path)  # never raises: always one whole checkpoint
        if len(loaded) == 1000:
            assert_same(snapshot(loaded), expected)
            outcomes["old"] += 1
        else:
            rows = loaded.export()[1]
            assert len(loaded) == 300_000
            assert (rows == rows[0, 0]).all(), "rows from two different saves"
            assert rows[0, 0] in (value, last_value), "a checkpoint nobody wrote last"
            last_value = float(rows[0, 0])
            expected = snapshot(loaded)
            outcomes["new"] += 1
        leftovers = [p.name for p in path.iterdir() if ".tmp-" in p.name]
        assert len(leftovers) <= 1
    assert sum(outcomes.values()) == 12


@pytest.mark.parametrize("drawer", ["tqdm", "own"])
def test_progress_bar_for_slow_saves_and_loads(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    drawer: str,
) -> None:
    """A bar of the bytes saved, loaded and exported, by tqdm where it is installed
    and by embstore's own line where not; none when asked for none."""
    from embstore import _progress

    monkeypatch.setattr(_progress, "DELAY_S", 0.0)
    if drawer == "own":
        monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    else:
        pytest.importorskip("tqdm")
    table = embstore.Table(64, optimizer=optim.Adam())
    table.lookup(np.arange(400_000))
    table.save(tmp_path / "ck", progress=True)
    loaded = embstore.Table.load(tmp_path / "ck", progress=True)
    keys, rows, state = loaded.export(with_state=True, progress=True)
    assert state.shape == (400_000, loaded.state_len)
    live = loaded.export(consistent=False, progress=True)
    assert keys.shape == (400_000,)
    np.testing.assert_array_equal(live[1], rows)
    err = capsys.readouterr().err
    if drawer == "own":
        assert "save: [" in err
        assert "load: [" in err
        assert "export: [" in err
        assert err.count("done in") == 4
    else:
        assert "save: 100%" in err
        assert "load: 100%" in err
        assert err.count("export: 100%") >= 2  # each export draws its end (tqdm may redraw it)
        assert "B/s" in err
    table.save(tmp_path / "ck2", progress=False)
    assert capsys.readouterr().err == ""
    # Unasked, a terminal gets a bar and EMBSTORE_PROGRESS=0 takes it away.
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert _progress.wanted(None)
    monkeypatch.setenv("EMBSTORE_PROGRESS", "0")
    assert not _progress.wanted(None)
    assert _progress.wanted(True)


@pytest.mark.slow
def test_inspect_command_reports_and_detects_damage(tmp_path: pathlib.Path) -> None:
    table = embstore.Table(4, optimizer=optim.Adam())
    table.lookup(np.arange(1000))
    table.save(tmp_path / "ck")
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "embstore", "inspect", str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    ok = run()
    assert ok.returncode == 0, ok.stderr
    assert "rows: 1,000" in ok.stdout
    assert "Adam(" in ok.stdout
    assert "checksums: all ok" in ok.stdout
    shard = next(p for p in (tmp_path / "ck").iterdir() if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    bad = run()
    assert bad.returncode == 1
    assert "BAD: " in bad.stdout
    assert "1 of" in bad.stdout


def test_save_refuses_a_missing_parent_directory(tmp_path: pathlib.Path) -> None:
    table = embstore.Table(2)
    table.lookup(np.arange(10))
    with pytest.raises(CheckpointError, match=r"the parent directory .*typo does not exist"):
        table.save(tmp_path / "typo" / "ck")
    assert not (tmp_path / "typo").exists()
    table.save(tmp_path / "ck")  # a missing directory itself is created
    assert len(embstore.Table.load(tmp_path / "ck")) == 10


def _drop_from_page_cache(root: pathlib.Path) -> None:
    """Asks the kernel to drop every file under ``root`` from the page cache
    (written back first)."""
    for f in root.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def test_a_cold_load_equals_the_saved_table_and_refuses_a_damaged_cold_file(
    tmp_path: pathlib.Path,
) -> None:
    """Files of more than 1 MiB out of the page cache are read straight from
    the disk (``O_DIRECT`` where the file system takes it, each link's
    files by a reader thread one file ahead of the loading threads): the
    loaded table equals the saved one bit for bit; a byte flipped in the
    middle of a cold file is refused by its checksum, naming the file."""
    t = embstore.Table(64, optimizer=optim.Adam(lr=0.01), seed=2, num_shards=4)
    keys = np.arange(40_000, dtype=np.int64)
    t.lookup(keys)
    t.apply_gradients(
        keys, np.random.default_rng(3).standard_normal((keys.size, 64)).astype(np.float32)
    )
    ck = tmp_path / "ck"
    t.save(ck, progress=False)
    files = sorted((f for f in ck.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    assert files[-1].stat().st_size > 1 << 20, "the largest file is read directly when cold"
    _drop_from_page_cache(ck)
    assert_same(snapshot(embstore.Table.load(ck, progress=False)), snapshot(t))
    victim = files[-1]
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    _drop_from_page_cache(ck)
    with pytest.raises(CheckpointError, match=victim.name):
        embstore.Table.load(ck, progress=False)
