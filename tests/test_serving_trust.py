"""Trust in the serving tier: crafted or damaged checkpoint directories,
another process holding the readers' lock, forks and changed working
directories must never make a mapped table lie, hang or read outside its
directory. Each test reproduces a failure of 7e7142d (issue 45) and checks
its fix; where a load and a mapped open are both asked, both must refuse or
both serve the same rows."""

from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import pathlib
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import save_file

import embstore
from embstore import optim

from ._crafted import crc32c, rewrite_manifest

DIM = 4


def saved(path: pathlib.Path, n: int = 60, num_shards: int = 2) -> embstore.Table:
    t = embstore.Table(DIM, optimizer=optim.SGD(lr=0.5), num_shards=num_shards, seed=3)
    t.lookup(np.arange(n))
    t.save(path)
    return t


def manifest(path: pathlib.Path) -> dict[str, object]:
    m: dict[str, object] = json.loads((path / "manifest.json").read_text())
    return m


def row_files(path: pathlib.Path) -> list[str]:
    chain = manifest(path)["chain"]
    assert isinstance(chain, list)
    return [f["name"] for f in chain[0]["files"]]


def rewrite_file(path: pathlib.Path, name: str, edit: object) -> None:
    """Applies ``edit(tensors, metadata)`` to the shard file ``name`` and
    writes it back with a valid size and checksum in the manifest: a
    crafted file, not a damaged one."""
    f = path / name
    with safe_open(str(f), framework="np") as s:
        meta = dict(s.metadata() or {})
        tensors = {k: s.get_tensor(k) for k in s.keys()}  # noqa: SIM118
    edit(tensors, meta)  # type: ignore[operator]
    f.unlink()
    save_file(tensors, str(f), metadata=meta)
    data = f.read_bytes()

    def fix(m: dict[str, object]) -> None:
        for link in m["chain"]:  # type: ignore[attr-defined]
            for e in link["files"]:
                if e["name"] == name:
                    e["bytes"] = len(data)
                    e["crc32c"] = crc32c(data)

    rewrite_manifest(path, fix)


def both(path: pathlib.Path) -> tuple[str | None, str | None]:
    """What a load and a mapped open plus a full read say: each the
    CheckpointError's message, or None where it served; where both served,
    they served the same rows. One refusing where the other serves fails.
    The third loader, a load as a disk table (its files adopted as its
    segments, almost every row on disk), must refuse or serve as the load
    does too."""
    loaded: embstore.Table | None = None
    try:
        loaded = embstore.Table.load(path)
        load_err = None
    except embstore.CheckpointError as e:
        load_err = str(e)
    disk_err = _disk_load_agrees(path, loaded)
    assert (load_err is None) == (disk_err is None), (load_err, disk_err)
    try:
        mapped = embstore.Table.load(path, mmap=True)
        keys, rows = mapped.export()
        probe = np.arange(-5, 200)
        got, found = mapped.lookup(probe, return_found=True)
        map_err = None
    except embstore.CheckpointError as e:
        map_err = str(e)
    if loaded is not None and map_err is None:
        want_keys, want_rows = loaded.export()
        np.testing.assert_array_equal(keys, want_keys)
        np.testing.assert_array_equal(rows, want_rows)
        want, want_found = loaded.lookup(probe, insert=False, return_found=True)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(found, want_found)
        assert len(mapped) == len(loaded)
    assert (load_err is None) == (map_err is None), (load_err, map_err)
    return load_err, map_err


def _disk_load_agrees(path: pathlib.Path, loaded: embstore.Table | None) -> str | None:
    """A load of ``path`` as a disk table with memory for about a row a
    shard: its CheckpointError's message, or None where it served, then
    every row and its state as ``loaded`` holds them (and a training step
    on both leaves them equal)."""
    import uuid

    spill = path.parent / f"spill-{uuid.uuid4().hex}"
    try:
        disk = embstore.Table.load(path, disk=spill, memory_bytes=4096)
    except embstore.CheckpointError as e:
        return str(e)
    try:
        assert loaded is not None
        assert disk.stats()["disk_rows"] > 0 or len(disk) <= 2
        want_keys, want_rows = loaded.export()
        keys, rows = disk.export()
        np.testing.assert_array_equal(keys, want_keys)
        np.testing.assert_array_equal(rows, want_rows)
        step = np.sort(want_keys)[:8]
        if len(step):
            # A step from what each holds (on a second load: ``loaded`` is
            # the callers' to compare) leaves the same finite rows.
            again = embstore.Table.load(path)
            g = np.ones((len(step), again.dim), np.float32)
            again.apply_gradients(step, g)
            disk.apply_gradients(step, g)
            got = disk.lookup(step, insert=False)
            np.testing.assert_array_equal(got, again.lookup(step, insert=False))
            assert np.isfinite(got).all()
    finally:
        del disk
        import shutil

        shutil.rmtree(spill, ignore_errors=True)
    return None


def assert_refused(err: str | None, says: str) -> None:
    """``err`` is a refusal whose message holds ``says``."""
    assert err is not None, f"served where it must refuse ({says})"
    assert says in err, err


# -- names outside the directory ---------------------------------------------


@pytest.mark.parametrize("outside", ["../x.safetensors", "ABS"])
def test_a_manifest_naming_a_file_outside_the_directory_is_refused_by_every_reader(
    tmp_path: pathlib.Path, outside: str
) -> None:
    ckpt = tmp_path / "ckpt"
    saved(ckpt)
    first = row_files(ckpt)[0]
    target = tmp_path / "x.safetensors"
    target.write_bytes((ckpt / first).read_bytes())
    name = str(target) if outside == "ABS" else outside

    def rename(m: dict[str, object]) -> None:
        m["chain"][0]["files"][0]["name"] = name  # type: ignore[index]

    rewrite_manifest(ckpt, rename)
    load_err, map_err = both(ckpt)
    assert_refused(load_err, "not a plain file name")
    assert_refused(map_err, "not a plain file name")
    # `python -m embstore inspect` refuses it too.
    with pytest.raises(embstore.CheckpointError, match="not a plain file name"):
        embstore._core.checkpoint_report(str(ckpt))


def test_errors_never_describe_a_file_outside_the_directory(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    saved(ckpt)
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 1221)

    def rename(m: dict[str, object]) -> None:
        m["chain"][0]["files"][0]["name"] = f"../{secret.name}"  # type: ignore[index]

    rewrite_manifest(ckpt, rename)
    for mmap in (False, True):
        with pytest.raises(embstore.CheckpointError) as e:
            embstore.Table.load(ckpt, mmap=mmap)
        assert "1221" not in str(e.value), str(e.value)


# -- crafted files (valid checksums) -----------------------------------------


def test_an_index_slot_naming_another_keys_row_is_refused_not_served(
    tmp_path: pathlib.Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    saved(ckpt, num_shards=1)
    name = row_files(ckpt)[0]

    def swap(t: dict[str, np.ndarray], meta: dict[str, str]) -> None:
        keys, index = t["keys"], t["index"].copy()
        r7, r8 = int(np.flatnonzero(keys == 7)[0]), int(np.flatnonzero(keys == 8)[0])
        index[index[:, 0] == 7, 1] = r8 + 1
        assert r7 != r8
        t["index"] = index

    rewrite_file(ckpt, name, swap)
    load_err, map_err = both(ckpt)
    assert_refused(load_err, "index")
    assert_refused(map_err, "index")


def test_files_with_swapped_shard_numbers_are_refused_by_both(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    saved(ckpt, num_shards=2)
    a, b = row_files(ckpt)

    def shard(n: str) -> object:
        def edit(t: dict[str, np.ndarray], meta: dict[str, str]) -> None:
            meta["shard"] = n

        return edit

    rewrite_file(ckpt, a, shard("1"))
    rewrite_file(ckpt, b, shard("0"))
    load_err, map_err = both(ckpt)
    assert_refused(load_err, "shard")
    assert_refused(map_err, "shard")


def test_a_link_whose_files_disagree_on_the_shard_count_is_refused_by_both(
    tmp_path: pathlib.Path,
) -> None:
    # Shard 0 of 2 relabelled "shard 0 of 1": the file alone is consistent
    # (every key is of shard 0 of 1), the link is not (found by the
    # crafted-files property test: the load served it, the mapped read
    # refused it).
    ckpt = tmp_path / "ckpt"
    saved(ckpt, num_shards=2)
    a, _ = row_files(ckpt)

    def one_shard(t: dict[str, np.ndarray], meta: dict[str, str]) -> None:
        meta["num_shards"] = "1"

    rewrite_file(ckpt, a, one_shard)
    load_err, map_err = both(ckpt)
    assert_refused(load_err, "its link's other files")
    assert_refused(map_err, "its link's other files")


def test_a_manifest_understating_its_rows_is_refused_by_both(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    saved(ckpt)

    def understate(m: dict[str, object]) -> None:
        m["rows"] = 3

    rewrite_manifest(ckpt, understate)
    load_err, map_err = both(ckpt)
    assert_refused(load_err, "replays to 60 rows")
    assert_refused(map_err, "replays to 60 rows")


def test_a_manifest_understating_a_chains_rows_is_refused_by_both(
    tmp_path: pathlib.Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    t = saved(ckpt, n=200)
    t.remove(np.arange(10))
    t.lookup(np.arange(300, 320))
    t.save(ckpt, incremental=True)
    assert len(manifest(ckpt)["chain"]) == 2  # type: ignore[arg-type]
    assert both(ckpt) == (None, None)

    def understate(m: dict[str, object]) -> None:
        m["rows"] = 205

    rewrite_manifest(ckpt, understate)
    load_err, map_err = both(ckpt)
    assert_refused(load_err, "replays to 210 rows")
    assert_refused(map_err, "replays to 210 rows")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_rows_are_refused_by_the_mapped_reader(
    tmp_path: pathlib.Path, bad: float
) -> None:
    ckpt = tmp_path / "ckpt"
    saved(ckpt)
    name = row_files(ckpt)[0]

    def poison(t: dict[str, np.ndarray], meta: dict[str, str]) -> None:
        rows = t["rows"].copy()
        rows[0, 1] = bad
        t["rows"] = rows

    rewrite_file(ckpt, name, poison)
    load_err, map_err = both(ckpt)
    assert_refused(load_err, "NaN or inf")
    assert_refused(map_err, "NaN or inf")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("tensor", ["rows", "state"])
def test_a_non_finite_value_deep_in_a_large_file_is_refused_by_a_load_naming_it(
    tmp_path: pathlib.Path, bad: float, tensor: str
) -> None:
    """A load finds rows and state finite in the pass that measures their
    magnitudes, block by block on every core: a NaN or inf past the first
    blocks, in the rows or in Adagrad's accumulator, is refused, the tensor
    and the value's flat index named."""
    ckpt = tmp_path / "ckpt"
    t = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1), num_shards=1, seed=3)
    t.lookup(np.arange(20_000))
    t.save(ckpt)
    (name,) = row_files(ckpt)
    row, col = 17_321, 2
    width = DIM

    def poison(ts: dict[str, np.ndarray], meta: dict[str, str]) -> None:
        a = ts[tensor].copy()
        a[row, col] = bad
        ts[tensor] = a

    rewrite_file(ckpt, name, poison)
    with pytest.raises(embstore.CheckpointError) as e:
        embstore.Table.load(ckpt)
    assert f'tensor "{tensor}" holds NaN or inf at flat index {row * width + col}' in str(e.value)


def test_bit_rot_in_an_index_is_damage_for_hits_and_misses_alike(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    saved(ckpt, num_shards=1)
    name = row_files(ckpt)[0]
    data = bytearray((ckpt / name).read_bytes())
    # Zero the index slot of key 7 in place (no checksum fixed: bit rot).
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    start, end = header["index"]["data_offsets"]
    base = 8 + header_len + start
    index = np.frombuffer(bytes(data[base : 8 + header_len + end]), dtype="<i8").reshape(-1, 2)
    slot = int(np.flatnonzero(index[:, 0] == 7)[0])
    data[base + 16 * slot : base + 16 * slot + 16] = bytes(16)
    (ckpt / name).write_bytes(bytes(data))
    for call in (
        lambda t: t.lookup(np.array([7]), return_found=True),
        lambda t: t.contains(np.array([7])),
        lambda t: t.lookup(np.array([10_000])),
    ):
        mapped = embstore.Table.load(ckpt, mmap=True)
        with pytest.raises(embstore.CheckpointError, match="checksum"):
            call(mapped)


# -- the readers' lock held by another process --------------------------------


def _hold_exclusively(path: str, seconds: float, ready: object) -> None:
    with open(path, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        ready.set()  # type: ignore[attr-defined]
        time.sleep(seconds)


def test_a_held_readers_lock_never_holds_up_fork_and_the_follower_reports_it(
    tmp_path: pathlib.Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    t = saved(ckpt)
    follower = embstore.Table.load(ckpt, mmap=True, follow=0.2)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_exclusively, args=(str(ckpt / ".embstore-lock"), 2.5, ready))
    holder.start()
    try:
        assert ready.wait(30)
        t.lookup(np.arange(500, 510))
        t.save(ckpt)  # publishes (its cleanup leaves old files: the lock is held)
        # A load waits for the lock, outside the call lock...
        result: list[object] = []
        loader = threading.Thread(
            target=lambda: result.append(embstore.Table.load(ckpt, mmap=True)), daemon=True
        )
        loader.start()
        time.sleep(0.3)
        # ...so a fork meanwhile goes ahead at once.
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        forked_in = time.monotonic() - start
        os.waitpid(pid, 0)
        assert forked_in < 1.0, f"fork waited {forked_in:.1f} s for a held readers' lock"
        # The follower cannot get the lock within its period: it says so.
        deadline = time.monotonic() + 3
        while follower.follow_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(follower.follow_error, embstore.CheckpointError)
        assert "readers' lock" in str(follower.follow_error)
    finally:
        holder.join(30)
    loader.join(30)
    assert len(result) == 1
    assert len(result[0]) == 70  # type: ignore[arg-type]
    # Once the lock is free, the follower serves the publish and clears its error.
    deadline = time.monotonic() + 10
    while (len(follower) != 70 or follower.follow_error is not None) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert len(follower) == 70
    assert follower.follow_error is None
    follower.close()


def test_a_refresh_gives_up_on_a_held_lock_after_its_wait(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    t = saved(ckpt)
    mapped = embstore.Table.load(ckpt, mmap=True)
    with open(ckpt / ".embstore-lock", "rb") as f:
        # Another open file description: an flock here excludes this process too.
        fcntl.flock(f, fcntl.LOCK_EX)
        # Nothing published since the open: a refresh reads no file and
        # takes no lock, so the held lock keeps nothing out.
        start = time.monotonic()
        assert mapped._inner.refresh(0.3) is False
        assert time.monotonic() - start < 0.25
        # A publish (written past the lock, as a writer's rename goes past
        # it): now a refresh must read, and gives up on the lock in time.
        fcntl.flock(f, fcntl.LOCK_UN)
        t.lookup(np.arange(1000, 1010))
        t.save(ckpt, incremental=True)
        fcntl.flock(f, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(embstore.CheckpointError, match="readers' lock"):
            mapped._inner.refresh(0.3)
        assert time.monotonic() - start < 5
    assert mapped.refresh() is True
    assert mapped.refresh() is False


def test_a_file_where_a_directory_is_expected_says_so(tmp_path: pathlib.Path) -> None:
    f = tmp_path / "model.pt"
    f.write_bytes(b"x")
    for mmap in (False, True):
        with pytest.raises(embstore.CheckpointError, match="expected a checkpoint directory"):
            embstore.Table.load(f, mmap=mmap)


# -- paths and forks -----------------------------------------------------------


def test_a_relative_path_is_resolved_once_at_open(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "ckpt").parent.mkdir()
    (b / "ckpt").parent.mkdir()
    ta = saved(a / "ckpt", n=10)
    saved(b / "ckpt", n=30)
    monkeypatch.chdir(a)
    mapped = embstore.Table.load("ckpt", mmap=True)
    assert mapped.path == str(a / "ckpt")
    monkeypatch.chdir(b)
    assert mapped.refresh() is False
    assert len(mapped) == 10
    ta.lookup(np.arange(10, 15))
    ta.save(a / "ckpt")
    assert mapped.refresh() is True
    assert len(mapped) == 15
    import pickle

    assert len(pickle.loads(pickle.dumps(mapped))) == 15


def test_a_forked_follower_goes_on_following(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    t = saved(ckpt)
    follower = embstore.Table.load(ckpt, mmap=True, follow=0.1)
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: waits for the parent's publish, then must serve it
        code = 1
        try:
            os.read(go_r, 1)
            deadline = time.monotonic() + 10
            while len(follower) != 80 and time.monotonic() < deadline:
                time.sleep(0.02)
            ok = len(follower) == 80 and follower.follow == 0.1
            code = 0 if ok else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    t.lookup(np.arange(100, 120))
    t.save(ckpt)
    os.write(go_w, b"x")
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"\x00", f"the forked follower did not serve the publish (code {got!r})"
    follower.close()


# -- pooled outputs -------------------------------------------------------------


def test_every_pooled_path_refuses_an_overflow_naming_weights(tmp_path: pathlib.Path) -> None:
    """At 7e7142d the mapped table's, a Collection's and an EmbeddingBag's
    pooling over a mapped table, and the helper ShardedTable pools with,
    returned inf where Table.lookup_pooled refuses."""
    import torch

    import embstore.torch as et

    ckpt = tmp_path / "ckpt"
    t = embstore.Table(DIM, optimizer=optim.SGD(lr=0.5))
    t.assign(np.array([1, 2]), np.full((2, DIM), 1e38, np.float32))
    t.save(ckpt)
    mapped = embstore.Table.load(ckpt, mmap=True)
    ids, offsets = np.array([1, 2]), np.array([0, 2])
    weights = np.array([3.0, 3.0], np.float32)
    with pytest.raises(ValueError, match=r"^weights: "):
        t.lookup_pooled(ids, offsets, weights=weights, insert=False)
    with pytest.raises(ValueError, match=r"^weights: "):
        mapped.lookup_pooled(ids, offsets, weights=weights)
    coll = embstore.Collection({"f": mapped})
    with pytest.raises(ValueError, match=r"^weights: "):
        coll.lookup_pooled({"f": (ids, offsets, weights)}, insert=False)
    bag = et.EmbeddingBag(mapped, mode="sum")
    with pytest.raises(ValueError, match=r"^weights: "):
        bag(torch.tensor([1, 2]), torch.tensor([0]), per_sample_weights=torch.tensor([3.0, 3.0]))
    rows = np.full((2, DIM), 1e38, np.float32)
    with pytest.raises(ValueError, match=r"^weights: "):
        embstore.ops.pool_rows(rows, np.array([0, 1]), offsets, weights)
    # Finite pooling still serves, equal to the live table's.
    ok = np.array([0.5, 0.25], np.float32)
    np.testing.assert_array_equal(
        mapped.lookup_pooled(ids, offsets, weights=ok),
        t.lookup_pooled(ids, offsets, weights=ok, insert=False),
    )


# -- the property: a load and a mapped read agree on any crafted directory ------


@st.composite
def crafts(draw: st.DrawFn) -> list[tuple[str, int, int, float]]:
    """Edits of a saved chain's tensors (written back with valid checksums):
    (tensor, file, flat position, value)."""
    n = draw(st.integers(1, 3))
    return [
        (
            draw(st.sampled_from(["keys", "index", "rows", "meta-shard", "meta-num_shards"])),
            draw(st.integers(0, 7)),
            draw(st.integers(0, 10_000)),
            draw(st.sampled_from([0.0, 1.0, -1.0, 7.0, 1e38, np.nan, np.inf, 2.0**40])),
        )
        for _ in range(n)
    ]


def _craft(what: str, at: int, value: float) -> object:
    """An edit for :func:`rewrite_file`: tensor ``what``'s flat position
    ``at`` set to ``value``, or a header count (``meta-<name>``)."""

    def edit(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> None:
        if what.startswith("meta-"):
            meta[what[5:]] = str(int(min(value, 2.0**40)) if np.isfinite(value) else 0)
            return
        a = tensors[what].copy()
        flat = a.reshape(-1)
        if flat.size:
            whole = int(np.clip(np.nan_to_num(value), -(2.0**62), 2.0**62))
            flat[at % flat.size] = value if a.dtype.kind == "f" else whole
        tensors[what] = a

    return edit


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(edits=crafts())
def test_a_load_and_a_mapped_read_agree_on_crafted_files(
    tmp_path: pathlib.Path, edits: list[tuple[str, int, int, float]]
) -> None:
    import shutil
    import uuid

    ckpt = tmp_path / uuid.uuid4().hex
    t = saved(ckpt, n=80, num_shards=2)
    t.remove(np.arange(5))
    t.lookup(np.arange(100, 110))
    t.save(ckpt, incremental=True)
    chain = manifest(ckpt)["chain"]
    names = [f["name"] for link in chain for f in link["files"]]  # type: ignore[attr-defined]
    for what, fi, at, value in edits:
        rewrite_file(ckpt, names[fi % len(names)], _craft(what, at, value))
    both(ckpt)  # asserts: both refuse, or both serve the same rows
    shutil.rmtree(ckpt)


# -- values: every loader runs the same check ---------------------------------


def patch_bytes(path: pathlib.Path, name: str, tensor: str, at: int, value: bytes) -> None:
    """Writes ``value`` at byte ``at`` of tensor ``tensor`` of the shard file
    ``name`` (any dtype: the header read as safetensors lays it out), with a
    valid size and checksum in the manifest: a crafted file."""
    f = path / name
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    start = 8 + n + json.loads(data[8 : 8 + n])[tensor]["data_offsets"][0]
    data[start + at : start + at + len(value)] = value
    f.unlink()
    f.write_bytes(bytes(data))

    def fix(m: dict[str, object]) -> None:
        for link in m["chain"]:  # type: ignore[attr-defined]
            for e in link["files"]:
                if e["name"] == name:
                    e["bytes"] = len(data)
                    e["crc32c"] = crc32c(bytes(data))

    rewrite_manifest(path, fix)


_VALUES = {
    "float32 row NaN": ("float32", "rows", np.nan),
    "float32 row inf": ("float32", "rows", np.inf),
    "bfloat16 row NaN": ("bfloat16", "rows", np.nan),
    "bfloat16 row inf": ("bfloat16", "rows", -np.inf),
    "int8 scale NaN": ("int8", "scale", np.nan),
    "int8 scale to inf": ("int8", "scale", 3e38),
    "int8 offset inf": ("int8", "offset", np.inf),
    "adagrad state -5": ("float32", "state", -5.0),
    "adagrad state NaN": ("float32", "state", np.nan),
}


@pytest.mark.parametrize("case", list(_VALUES))
def test_every_loader_refuses_values_no_step_could_write(tmp_path: pathlib.Path, case: str) -> None:
    """Rows that are NaN or inf (float32, bfloat16, int8 whose scale or
    offset decode to them) and Adagrad state below zero or NaN, in files
    with valid checksums: a load, a mapped read and a load as a disk table
    (whose files would be adopted as its segments) all refuse them; before
    0306b22's fix the disk load served them and its next step wrote a
    non-finite row."""
    dtype, where, bad = _VALUES[case]
    ckpt = tmp_path / "ckpt"
    t = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1), dtype=dtype, num_shards=2, seed=3)
    t.lookup(np.arange(300))
    t.apply_gradients(np.arange(300), np.ones((300, DIM), np.float32))
    t.save(ckpt)
    name = row_files(ckpt)[0]
    codes = -(-DIM // 4) * 4  # an int8 row's codes fill whole words
    if where == "rows" and dtype == "bfloat16":
        bits = np.float32(bad).view(np.uint32) >> 16  # a bfloat16's bits
        patch_bytes(ckpt, name, "rows", 2, np.uint16(bits).tobytes())
    elif where in ("scale", "offset"):
        at = codes + (4 if where == "offset" else 0)
        patch_bytes(ckpt, name, "rows", at, np.float32(bad).tobytes())
    else:  # float32 rows, Adagrad's state: row 0, column 1
        patch_bytes(ckpt, name, where, 4, np.float32(bad).tobytes())
    load_err, map_err = both(ckpt)  # the disk load must refuse as the load does
    assert_refused(load_err, "damaged")
    assert_refused(map_err, "damaged")
    with pytest.raises(embstore.CheckpointError, match="damaged"):
        embstore.Table.load(ckpt, disk=tmp_path / "spill", memory_bytes=4096)
    # Nothing of the refused load stays on disk.
    assert not [p for p in (tmp_path / "spill").iterdir() if p.name.startswith("embstore-disk")]
