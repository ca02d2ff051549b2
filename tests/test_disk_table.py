"""A disk table (``Table(dim, disk=PATH, memory_bytes=N)``): at most N bytes
of rows in memory, the rest in files under PATH. The oracle is the same
table in memory: every call, in a random mix, gives the same results bit
for bit while the disk table holds most of its rows on disk; the torch
modules, a Collection and a DeviceCache over one train as over a table in
memory; its checkpoints are plain checkpoints, loaded into memory, mapped,
or opened as a disk table with less memory still."""

from __future__ import annotations

import gc
import json
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import embstore
from embstore import optim
from embstore.gpu import DeviceCache

DIM = 6


def _pair(tmp: Path, rows: int, **settings: Any) -> tuple[embstore.Table, embstore.Table]:
    """The same table in memory and on disk with memory for ``rows`` rows."""
    settings = {"optimizer": optim.Adam(lr=0.05), "seed": 5, "num_shards": 4, **settings}
    ram = embstore.Table(DIM, **settings)
    cost = embstore.Table(DIM, disk=tmp / "probe", memory_bytes=1 << 20, **settings).stats()[
        "row_cost"
    ]
    disk = embstore.Table(DIM, disk=tmp / "disk", memory_bytes=rows * cost, **settings)
    return ram, disk


def _same(a: Any, b: Any) -> None:
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if isinstance(a, np.ndarray) and a.dtype == np.float32:
            assert a.view(np.uint32).tolist() == np.asarray(b).view(np.uint32).tolist()


def test_every_call_on_a_disk_table_gives_what_the_table_in_memory_gives(tmp_path: Path) -> None:
    ram, disk = _pair(tmp_path, 60)
    rng = np.random.default_rng(3)
    calls = [
        lambda t, k, g: t.lookup(k),
        lambda t, k, g: t.apply_gradients(k, g),
        lambda t, k, g: t.lookup(k, insert=False, default="zeros", return_found=True),
        lambda t, k, g: t.contains(k),
        lambda t, k, g: (t.assign(k[:5], g[:5]), t.remove(k[5:8]), len(t)),
        lambda t, k, g: t.lookup_with_state(k[:10], insert=False),
        lambda t, k, g: t.write_back(k[:4], g[:4], np.abs(g[:4].repeat(2, 1)) + 0.1),
        lambda t, k, g: (
            t.lookup_pooled(k, np.arange(0, len(k) + 1, 6), combiner="mean"),
            t.apply_pooled_gradients(
                k, np.arange(0, len(k) + 1, 6), g[: len(k) // 6], combiner="mean"
            ),
        ),
    ]
    for step in range(240):
        keys = rng.integers(-30, 700, 48).astype(np.int64)
        grads = rng.standard_normal((48, DIM)).astype(np.float32)
        call = calls[step % len(calls)]
        _same(call(ram, keys, grads), call(disk, keys, grads))
        st = disk.stats()
        assert st["memory_rows"] <= 60 + 48, st
        assert st["memory_rows"] + st["disk_rows"] == st["rows"] == len(ram)
    st = disk.stats()
    assert st["disk_rows"] > 400, st
    assert 0 < st["overall_hit_rate"] < 0.6, st
    assert st["disk_error"] is None
    for name, value in ram.state_dict().items():
        _same(disk.state_dict()[name], value)


def test_torch_modules_and_a_collection_over_a_disk_table_train_as_over_memory(
    tmp_path: Path,
) -> None:
    torch = pytest.importorskip("torch")
    import embstore.torch as et

    ram, disk = _pair(tmp_path, 30)
    bags = [et.EmbeddingBag(t, mode="sum") for t in (ram, disk)]
    other = [embstore.Table(3, optimizer=optim.SGD(lr=0.1), seed=1) for _ in range(2)]
    cols = [
        embstore.Collection({"a": t, "b": o}, combiners={"a": "mean", "b": "sum"})
        for t, o in zip((ram, disk), other, strict=True)
    ]
    rng = np.random.default_rng(8)
    for _ in range(12):
        ids = torch.from_numpy(rng.integers(0, 400, 64).astype(np.int64))
        offsets = torch.arange(0, 65, 8)
        outs = [b(ids, offsets) for b in bags]
        _same(outs[0].detach().numpy(), outs[1].detach().numpy())
        for out in outs:
            (out * torch.arange(DIM)).sum().backward()
        feats = {"a": (ids.numpy(), offsets.numpy()), "b": (ids.numpy() % 50, offsets.numpy())}
        pooled = [c.lookup_pooled(feats) for c in cols]
        _same(pooled[0], pooled[1])
        for c, p in zip(cols, pooled, strict=True):
            c.apply_pooled_gradients(feats, np.ones_like(p) * 0.01)
    for name, value in ram.state_dict().items():
        _same(disk.state_dict()[name], value)


def test_a_collection_over_two_disk_tables_trains_as_over_memory_from_many_threads(
    tmp_path: Path,
) -> None:
    """A Collection call stands each of its disk tables on its floor, in
    table order, with the one plan of that table's ids, and releases every
    floor before any rows move out: two disk tables with memory for 30 of
    about 400 rows each (one serving two features) and a table in memory
    train as their twins in memory, bit for bit; then four threads mixing
    the Collection's calls with each disk table's own finish under a
    watchdog, and each disk table is back within its bound."""
    ram_a, disk_a = _pair(tmp_path / "a", 30)
    ram_b, disk_b = _pair(tmp_path / "b", 30, seed=7)
    mem = [embstore.Table(3, optimizer=optim.SGD(lr=0.1), seed=1) for _ in range(2)]
    cols = [
        embstore.Collection({"a": a, "a2": a, "b": b, "m": m})
        for a, b, m in ((ram_a, ram_b, mem[0]), (disk_a, disk_b, mem[1]))
    ]
    rng = np.random.default_rng(21)

    def feats(r: np.random.Generator) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        ids = r.integers(0, 400, 64).astype(np.int64)
        off = np.arange(0, 65, 8)
        return {
            "a": (ids, off),
            "a2": (ids % 97, off),
            "b": (ids[::-1].copy(), off),
            "m": (ids % 50, off),
        }

    for _ in range(15):
        f = feats(rng)
        pooled = [c.lookup_pooled(f) for c in cols]
        _same(pooled[0], pooled[1])
        grads = (rng.standard_normal(pooled[0].shape) * 0.01).astype(np.float32)
        for c in cols:
            c.apply_pooled_gradients(f, grads)
    keys = np.arange(400)
    for ram, disk in ((ram_a, disk_a), (ram_b, disk_b)):
        _same(disk.lookup_with_state(keys, insert=False), ram.lookup_with_state(keys, insert=False))
        st = disk.stats()
        assert st["disk_rows"] > 200, st
        assert st["memory_rows"] <= 30, st

    failed: list[BaseException] = []

    def work(seed: int) -> None:
        r = np.random.default_rng(seed)
        try:
            for i in range(25):
                f = feats(r)
                p = cols[1].lookup_pooled(f)
                cols[1].apply_pooled_gradients(f, np.full_like(p, 0.01))
                t = (disk_a, disk_b)[i % 2]
                t.apply_gradients(f["a"][0], np.full((64, DIM), 0.01, np.float32))
                t.lookup(f["b"][0])
        except BaseException as e:
            failed.append(e)

    threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert failed == []
    for disk in (disk_a, disk_b):
        disk.lookup(np.arange(4))
        st = disk.stats()
        assert st["memory_rows"] <= 30, st
        assert st["memory_rows"] + st["disk_rows"] == st["rows"] == len(disk)
        assert st["disk_error"] is None


def test_a_device_cache_over_a_disk_table_trains_as_over_memory(tmp_path: Path) -> None:
    ram, disk = _pair(tmp_path, 30)
    caches = [DeviceCache(t, 16, xp=np) for t in (ram, disk)]
    rng = np.random.default_rng(2)
    for _ in range(20):
        keys = rng.integers(0, 300, 40).astype(np.int64)
        grads = rng.standard_normal((40, DIM)).astype(np.float32)
        _same(caches[0].lookup(keys), caches[1].lookup(keys))
        for c in caches:
            c.apply_gradients(keys, grads)
    for c in caches:
        c.flush()
    for name, value in ram.state_dict().items():
        _same(disk.state_dict()[name], value)


def test_a_disk_tables_checkpoints_are_plain_and_open_as_disk_tables(tmp_path: Path) -> None:
    ram, disk = _pair(tmp_path, 40)
    rng = np.random.default_rng(4)

    def train(n: int) -> None:
        for _ in range(n):
            keys = rng.integers(0, 500, 64).astype(np.int64)
            grads = rng.standard_normal((64, DIM)).astype(np.float32)
            for t in (ram, disk):
                t.lookup(keys)
                t.apply_gradients(keys, grads)

    train(20)
    disk.save(tmp_path / "ck")
    train(5)
    disk.remove(np.arange(0, 500, 7))
    ram.remove(np.arange(0, 500, 7))
    disk.save(tmp_path / "ck", incremental=True)
    keys = np.arange(-5, 505)
    want = ram.lookup(keys, insert=False)
    _same(embstore.Table.load(tmp_path / "ck").lookup(keys, insert=False), want)
    _same(embstore.Table.load(tmp_path / "ck", mmap=True).lookup(keys), want)
    cost = disk.stats()["row_cost"]
    back = embstore.Table.load(tmp_path / "ck", disk=tmp_path / "d2", memory_bytes=25 * cost)
    assert back.table_config.memory_bytes == 25 * cost
    assert back.stats()["disk_rows"] > 300
    _same(back.lookup(keys, insert=False), want)
    # Where a copy keeps its rows is its own: config() (what ranks compare)
    # leaves it out.
    assert back.config() == ram.config()
    # A pickle is a disk table of its own, beside the first.
    again = pickle.loads(pickle.dumps(disk))
    assert again.table_config.disk == disk.table_config.disk
    _same(again.lookup(keys, insert=False), want)


def test_prefetch_moves_the_next_batch_in_and_keeps_it_there(tmp_path: Path) -> None:
    ram, disk = _pair(tmp_path, 40)
    keys = np.arange(400, dtype=np.int64)
    for t in (ram, disk):
        t.lookup(keys)
    batch = np.arange(0, 400, 10, dtype=np.int64)
    before = disk.stats()
    disk.prefetch(batch)
    import time

    deadline = time.monotonic() + 10
    while disk.stats()["disk_rows_read"] < before["disk_rows_read"] + 30:
        assert time.monotonic() < deadline, "the prefetch read nothing"
        time.sleep(0.01)
    mid = disk.stats()
    _same(disk.lookup(batch), ram.lookup(batch))
    after = disk.stats()
    # The batch was in memory: its lookup read (almost) nothing more.
    assert after["disk_rows_read"] - mid["disk_rows_read"] <= 4, (mid, after)
    ram.prefetch(batch)  # a table in memory: nothing to do


@pytest.mark.parametrize(
    "policy",
    [{"capacity": 150, "eviction": "lru"}, {"ttl_steps": 3, "capacity": 200}],
)
def test_eviction_policies_on_a_disk_table_evict_what_they_evict_in_memory(
    tmp_path: Path, policy: dict[str, Any]
) -> None:
    ram, disk = _pair(tmp_path, 20, **policy)
    rng = np.random.default_rng(8)
    for step in range(40):
        keys = rng.integers(0, 400, 64).astype(np.int64)
        grads = rng.standard_normal((64, DIM)).astype(np.float32)
        _same(disk.lookup(keys), ram.lookup(keys))
        for t in (ram, disk):
            t.apply_gradients(keys, grads)
        if step % 5 == 4:
            _same(disk.evict(with_rows=True), ram.evict(with_rows=True))
        assert len(disk) == len(ram)
    assert disk.stats()["disk_rows"] > 50
    _same(disk.export(), ram.export())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
def test_a_forked_child_neither_uses_nor_deletes_its_parents_disk_table(tmp_path: Path) -> None:
    """A fork()ed child (a DataLoader worker) holds a copy of the parent's
    disk table, whose files are the parent's: a call there is refused by
    name, and the child dropping its copy deletes nothing of the parent's."""
    ram, disk = _pair(tmp_path, 20)
    keys = np.arange(400)
    want = ram.lookup(keys)
    _same(disk.lookup(keys), want)
    assert disk.stats()["disk_rows"] > 300
    files = sorted(p.name for p in (tmp_path / "disk").rglob("*"))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports by its exit code
        code = 3
        try:
            try:
                disk.lookup(keys[:5])
                code = 1
            except ValueError as e:
                code = 0 if "fork()ed child" in str(e) else 2
            # What the README says works there: reads that move no row.
            k, rows = disk.export()
            ok = disk.contains(keys).all() and len(disk) == 400 and len(k) == 400
            if code == 0 and not (ok and np.array_equal(rows[np.argsort(k)], want)):
                code = 4
            del disk
            gc.collect()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sorted(p.name for p in (tmp_path / "disk").rglob("*")) == files
    _same(disk.lookup(keys, insert=False), want)


def test_bad_disk_settings_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk: expected memory_bytes"):
        embstore.Table(4, disk=tmp_path)
    with pytest.raises(ValueError, match="memory_bytes: expected disk"):
        embstore.Table(4, memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="memory_bytes: expected room"):
        embstore.Table(4, disk=tmp_path, memory_bytes=10)
    with pytest.raises(ValueError, match="disk: expected a table without capacity_bytes"):
        embstore.Table(4, disk=tmp_path, memory_bytes=1 << 20, capacity_bytes=1 << 20)
    with pytest.raises(TypeError, match="disk: expected a path"):
        embstore.Table(4, disk=3, memory_bytes=1 << 20)  # type: ignore[arg-type]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"disk: expected a directory, .*file is a file"):
        embstore.Table(4, disk=tmp_path / "file", memory_bytes=1 << 20)
    assert (tmp_path / "file").read_text() == "x"
    # "" would be the current directory: refused, nothing made there.
    before = sorted(os.listdir("."))
    with pytest.raises(ValueError, match="disk: expected the path of a directory, got an empty"):
        embstore.Table(4, disk="", memory_bytes=1 << 20)
    assert sorted(os.listdir(".")) == before
    with pytest.raises(ValueError, match="mmap=True"):
        embstore.Table.load(tmp_path, mmap=True, disk=tmp_path, memory_bytes=1)


def test_a_disk_tables_files_go_with_it_and_a_dead_ones_with_the_next(tmp_path: Path) -> None:
    t = embstore.Table(4, disk=tmp_path, memory_bytes=4000, num_shards=2)
    t.assign(np.arange(500), np.ones((500, 4), np.float32))
    t.stats()  # settled: the rows over the bound are on disk
    mine = [p for p in tmp_path.iterdir() if p.name.startswith("embstore-disk-")]
    assert len(mine) == 1
    assert any(f.suffix == ".seg" for f in mine[0].iterdir())
    # A killed process's directory: its lock file is not held.
    dead = tmp_path / "embstore-disk-999999999-0"
    dead.mkdir()
    (dead / "lock").touch()
    (dead / "s0000-00000000.seg").write_bytes(b"x" * 100)
    other = embstore.Table(4, disk=tmp_path, memory_bytes=4000, num_shards=2)
    assert not dead.exists()
    assert mine[0].exists(), "a live table's directory stays"
    del t, other
    assert [p.name for p in tmp_path.iterdir()] == []
    assert os.listdir(tmp_path) == []


def test_a_planted_fifo_or_link_beside_the_disk_tables_never_hangs_or_is_followed(
    tmp_path: Path,
) -> None:
    fifo_dir = tmp_path / "embstore-disk-999999998-0"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "lock")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "lock").touch()
    (elsewhere / "keep").write_text("x")
    os.symlink(elsewhere, tmp_path / "embstore-disk-999999997-0")
    # Opening the FIFO for reading would block: the table is made at once.
    t = embstore.Table(4, disk=tmp_path, memory_bytes=4000, num_shards=2)
    t.assign(np.arange(50), np.ones((50, 4), np.float32))
    assert fifo_dir.exists(), "not a lock file: left alone"
    assert (elsewhere / "keep").exists(), "a link is not followed"


def test_a_checkpoint_opened_as_a_disk_table_serves_its_own_files_and_outlives_them(
    tmp_path: Path,
) -> None:
    """At the checkpoint's shard count the load rewrites no row: its files
    are linked into the table's directory and read from there, each row
    checked against the CRC its load took; deleting the checkpoint changes
    nothing, and a byte changed in its file afterwards reads as an error."""
    ram = embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=5, num_shards=4)
    keys = np.arange(2000)
    ram.lookup(keys)
    ram.save(tmp_path / "ck")
    saved = ram.lookup(keys, insert=False)
    cost = ram.stats()["row_cost"]
    back = embstore.Table.load(tmp_path / "ck", disk=tmp_path / "d", memory_bytes=100 * cost)
    st = back.stats()
    assert (st["memory_rows"], st["disk_rows"]) == (0, 2000)
    assert len(list((tmp_path / "d").glob("*/*.base"))) == 4
    assert list((tmp_path / "d").glob("*/*.seg")) == []
    _same(back.lookup(keys, insert=False), ram.lookup(keys, insert=False))
    rng = np.random.default_rng(1)
    for _ in range(10):
        batch = rng.integers(0, 2000, 256)
        grads = rng.standard_normal((256, DIM)).astype(np.float32)
        for t in (ram, back):
            t.apply_gradients(batch, grads)
    _same(back.lookup(keys, insert=False), ram.lookup(keys, insert=False))
    # A row on disk, changed in place in the checkpoint's file (the link is
    # the same file): refused, never served; its neighbours serve.
    again = embstore.Table.load(tmp_path / "ck", disk=tmp_path / "d", memory_bytes=100 * cost)
    f = sorted((tmp_path / "ck").glob("*.safetensors"))[0]
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    file_keys = np.frombuffer(
        raw[8 + n + header["keys"]["data_offsets"][0] : 8 + n + header["keys"]["data_offsets"][1]],
        np.int64,
    )
    row = 3
    at = 8 + n + header["rows"]["data_offsets"][0] + row * DIM * 4
    with open(f, "r+b") as fh:
        fh.seek(at)
        fh.write(bytes([raw[at] ^ 0xFF]))
    with pytest.raises(embstore.CheckpointError, match=f"key {file_keys[row]} is damaged"):
        again.lookup(file_keys[row : row + 1], insert=False)
    others = np.delete(file_keys, row)
    _same(again.lookup(others, insert=False), saved[others])
    for p in (tmp_path / "ck").iterdir():
        p.unlink()
    (tmp_path / "ck").rmdir()
    assert back.lookup(keys[:1], insert=False).shape == (1, DIM)


def test_a_damaged_checkpoint_opened_as_a_disk_table_is_refused_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.1), num_shards=2)
    t.assign(np.arange(3000), np.ones((3000, 4), np.float32))
    t.save(tmp_path / "ck")
    files = sorted((tmp_path / "ck").glob("*.safetensors"))
    last = files[-1]
    data = bytearray(last.read_bytes())
    data[-100] ^= 1
    last.write_bytes(bytes(data))
    spill = tmp_path / "spill"
    with pytest.raises(embstore.CheckpointError, match=r"checksum|CRC|crc"):
        embstore.Table.load(tmp_path / "ck", disk=spill, memory_bytes=100 * 83)
    assert [p for p in spill.iterdir()] == [], "the refused table's files went with it"
    # The same directory loads into memory only when whole, too.
    with pytest.raises(embstore.CheckpointError):
        embstore.Table.load(tmp_path / "ck")


_SAME_PID_CHILD = r"""
import os, sys, time, pathlib
import numpy as np
import embstore
from embstore import optim
spill, name, role = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
assert os.getpid() == 1, os.getpid()  # pid 1 in a namespace of its own
settings = dict(optimizer=optim.Adam(lr=0.1), seed=1, num_shards=2)
cost = embstore.Table(8, disk=spill.parent / name, memory_bytes=1 << 20, **settings)
cost = cost.stats()["row_cost"]
t = embstore.Table(8, disk=spill, memory_bytes=2_000 * cost, **settings)
for at in range(0, 6_000, 2_000):
    t.lookup(np.arange(at, at + 2_000))
mine = [p for p in spill.iterdir() if p.name.startswith("embstore-disk-")]
if role == "first":
    (dir_,) = mine
    files = {p.name: p.stat().st_ino for p in dir_.iterdir()}
    assert len(files) > 1, files  # its lock and segments
(spill.parent / f"{name}.ready").touch()
if role == "first":
    while not (spill.parent / "second.ready").exists():
        time.sleep(0.01)
    # Its directory and files are where they were, the second's elsewhere.
    assert {p.name: p.stat().st_ino for p in dir_.iterdir()} == files
    assert len([p for p in spill.iterdir() if p.name.startswith("embstore-disk-")]) == 2
    for r in range(12):
        keys = np.arange(r * 1_000, r * 1_000 + 2_000) % 12_000
        t.lookup(keys)
        t.apply_gradients(keys, np.ones((len(keys), 8), np.float32))
    st = t.stats()
    assert st["disk_error"] is None, st["disk_error"]
    assert st["memory_rows"] <= 2_000 + 2 * 2_000, st["memory_rows"]
    assert st["rows"] == 12_000, st["rows"]
    print("ok", st["memory_rows"], st["disk_rows"])
else:
    while not (spill.parent / "done").exists():
        time.sleep(0.01)
"""


@pytest.mark.slow
def test_two_processes_of_the_same_pid_share_a_spill_directory(tmp_path: Path) -> None:
    """Two trainers in containers of their own (each pid 1, in a pid
    namespace of its own: ``unshare --pid``) spill into one directory: the
    second's table never removes the first's live files (before 0306b22's
    fix it did, and the first kept every row in memory with only
    ``stats()["disk_error"]`` to say so)."""
    import subprocess
    import sys

    spill = tmp_path / "spill"
    spill.mkdir()
    code = tmp_path / "child.py"
    code.write_text(_SAME_PID_CHILD)

    def start(name: str, role: str) -> subprocess.Popen[str]:
        cmd = ["unshare", "--pid", "--fork", "--kill-child", sys.executable, str(code)]
        return subprocess.Popen(
            [*cmd, str(spill), name, role],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no pid namespaces here (unshare --pid needs root)")
    first = start("first", "first")
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "first.ready").exists():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        second = start("second", "second")
        try:
            out, err = first.communicate(timeout=120)
            assert first.returncode == 0, err
            assert out.startswith("ok"), (out, err)
        finally:
            (tmp_path / "done").touch()
            second.communicate(timeout=60)
        assert second.returncode == 0
    finally:
        first.kill()
    assert not [p for p in spill.iterdir() if p.name.startswith("embstore-disk-")]


def test_a_disk_load_at_another_dtype_converts_each_file_as_a_load_in_memory_does(
    tmp_path: Path,
) -> None:
    """``Table.load(dtype=..., disk=...)`` converts each file's rows as it
    loads (it was refused; the core converts, streamed): rows and state
    equal a load in memory at that dtype bit for bit, most rows on disk,
    and a step on both gives the same rows."""
    t = embstore.Table(DIM, seed=1, optimizer=optim.Adam(lr=0.01))
    keys = np.arange(3_000, dtype=np.int64) * 7
    t.lookup(keys)
    t.apply_gradients(keys, np.full((keys.size, DIM), 0.25, np.float32))
    t.save(tmp_path / "ckpt")
    grads = np.random.default_rng(0).normal(size=(keys.size, DIM)).astype(np.float32)
    for dtype in ("bfloat16", "int8"):
        mem = embstore.Table.load(tmp_path / "ckpt", dtype=dtype)
        disk = embstore.Table.load(
            tmp_path / "ckpt", dtype=dtype, disk=tmp_path / "spill", memory_bytes=40_000
        )
        assert (disk.dtype, mem.dtype) == (dtype, dtype)
        assert disk.stats()["disk_rows"] > len(disk) // 2, disk.stats()
        for a, b in zip(mem.export(with_state=True), disk.export(with_state=True), strict=True):
            np.testing.assert_array_equal(a, b)
        for table in (mem, disk):
            table.apply_gradients(keys, grads)
        np.testing.assert_array_equal(
            mem.lookup(keys, insert=False), disk.lookup(keys, insert=False)
        )


def test_a_lookup_larger_than_memory_runs_in_pieces_as_one_call_in_memory(
    tmp_path: Path,
) -> None:
    """A call of 20,000 keys (duplicates in different pieces, keys old and
    new) on a disk table with memory for 100 rows runs in pieces of 4,096
    keys: every output, found flag and state equals one call on the table
    in memory, and memory never held more than a piece beyond the bound."""
    ram, disk = _pair(tmp_path, 100)
    rng = np.random.default_rng(8)
    for t in (ram, disk):
        t.lookup(np.arange(0, 3_000))
    keys = rng.integers(-2_000, 12_000, 20_000)
    keys[15_000:] = keys[:5_000]  # the same keys again, pieces later
    _same(disk.lookup(keys), ram.lookup(keys))
    assert disk.stats()["memory_rows"] <= 100 + 4_096, disk.stats()
    probe = rng.integers(-20_000, 20_000, 18_000)
    _same(
        disk.lookup(probe, insert=False, default="zeros", return_found=True),
        ram.lookup(probe, insert=False, default="zeros", return_found=True),
    )
    _same(disk.lookup_with_state(probe, insert=False), ram.lookup_with_state(probe, insert=False))
    g = rng.standard_normal((len(keys), DIM)).astype(np.float32)
    ram.apply_gradients(keys, g)
    disk.apply_gradients(keys, g)
    _same(disk.export(), ram.export())
    assert len(disk) == len(ram)
