"""Table.load(path, mmap=True): a read-only table over a checkpoint's mapped
files. Reads equal the live table that saved (through chains of incremental
saves with removals, every row format, every default, hit masks, calls on
one thread and spread over the pool); writes are refused and change
nothing; a damaged file is refused when first read, and a crafted index
cannot hang or misdirect a reader; a checkpoint saved without file indexes
is refused with the way to convert it."""

from __future__ import annotations

import json
import pathlib
import struct
from collections.abc import Callable

import numpy as np
import pytest

import embstore
from embstore import optim

from ._crafted import crc32c, rewrite_manifest

DIM = 6


def trained(dtype: str = "float32", num_shards: int = 4) -> embstore.Table:
    t = embstore.Table(DIM, optimizer=optim.Adam(lr=0.01), dtype=dtype, num_shards=num_shards)
    rng = np.random.default_rng(0)
    for _ in range(3):
        k = rng.integers(-500, 2_000, 600)
        t.lookup(k)
        t.apply_gradients(k, rng.standard_normal((k.size, DIM)).astype(np.float32))
    return t


KEYS = np.concatenate([np.arange(-600, 2_100, 7), [2**62, -(2**62), 0, 5, 3_000, 1_049]])


def assert_reads_equal(
    live: embstore.Table, mapped: embstore.MappedTable, also: np.ndarray | None = None
) -> None:
    keys = KEYS if also is None else np.concatenate([KEYS, also])
    assert len(mapped) == len(live)
    assert mapped.dim == live.dim
    assert mapped.dtype == live.dtype
    for default in ("init", "zeros", np.linspace(-1, 1, DIM).astype(np.float32)):
        np.testing.assert_array_equal(
            mapped.lookup(keys, default=default), live.lookup(keys, insert=False, default=default)
        )
    rows, found = mapped.lookup(keys, return_found=True)
    want_rows, want_found = live.lookup(keys, insert=False, return_found=True)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(found, want_found)
    np.testing.assert_array_equal(mapped.contains(keys), live.contains(keys))
    # Calls about the lookup pipeline's depths (a row copied 8 keys after
    # it is located, slots prefetched 16 ahead, from 33 keys a call).
    for n in (0, 1, 7, 8, 9, 16, 17, 24, 25, 32, 33, 41, 100):
        got = mapped.lookup(keys[-n:] if n else keys[:0], return_found=True)
        want = live.lookup(keys[-n:] if n else keys[:0], insert=False, return_found=True)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    # A call spread over the pool (more than 4,096 keys), with repeats.
    many = np.tile(keys, 20)
    np.testing.assert_array_equal(mapped.lookup(many), live.lookup(many, insert=False))
    # Pooled: bags of 0 to 5 ids (repeats included), every combiner, weights.
    rng = np.random.default_rng(3)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 6, 300))])
    ids = rng.choice(keys, offsets[-1])
    weights = rng.random(ids.size).astype(np.float32)
    for combiner in ("sum", "mean", "sqrtn"):
        for w in (None, weights):
            np.testing.assert_array_equal(
                mapped.lookup_pooled(ids, offsets, combiner=combiner, weights=w),
                live.lookup_pooled(ids, offsets, combiner=combiner, weights=w, insert=False),
            )
    for got, want in zip(mapped.export(), live.export(), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_mapped_reads_equal_the_live_table_through_a_chain(tmp_path, dtype: str) -> None:
    t = trained(dtype)
    path = tmp_path / "c"
    t.save(path)
    assert_reads_equal(t, embstore.Table.load(path, mmap=True))
    # Deltas: changed rows, removed keys, a removed key inserted again,
    # saved by a table with another shard count.
    held = t.export()[0]
    back = held[(held >= 0) & (held < 300)][:2]  # removed, then inserted again
    assert back.size == 2
    t.remove(np.arange(0, 300))
    t.assign(np.array([*back, 3_000]), np.full((3, DIM), 0.5, np.float32))
    assert t.contains(back).all()
    t.apply_gradients(np.arange(900, 1_000), np.ones((100, DIM), np.float32))
    t.save(path, incremental=True)
    assert_reads_equal(t, embstore.Table.load(path, mmap=True), back)
    u = embstore.Table.load(path, num_shards=3)
    u.remove(np.arange(1_000, 1_050))
    u.save(path, incremental=True)
    assert_reads_equal(u, embstore.Table.load(path, mmap=True))


def test_contains_equals_a_set_of_the_saved_keys_at_every_call_size(tmp_path) -> None:
    """contains() of a live table and of its mapped chain (a full save and a
    delta with removals: answers from the base files and the overlay)
    against a Python set, for calls below, at and past the probe
    pipeline's depths (index lines prefetched 16 keys ahead, from 33 keys a
    call; 64 keys a shard for a live table) and past a call's pool split
    (1,024 keys), keys present and absent interleaved."""
    t = embstore.Table(DIM, num_shards=2)
    held = set(range(0, 40_000, 3))
    t.assign(np.array(sorted(held)), np.ones((len(held), DIM), np.float32))
    path = tmp_path / "c"
    t.save(path)
    gone = np.arange(0, 6_000, 3)
    t.remove(gone)
    held -= set(gone.tolist())
    t.assign(np.array([1, 40_001]), np.ones((2, DIM), np.float32))
    held |= {1, 40_001}
    t.save(path, incremental=True)
    mapped = embstore.MappedTable(path)
    rng = np.random.default_rng(5)
    for n in (1, 15, 16, 17, 32, 33, 34, 63, 64, 65, 200, 1_023, 1_024, 1_025, 5_000, 30_000):
        keys = rng.integers(-100, 41_000, n)
        want = np.array([k in held for k in keys.tolist()])
        np.testing.assert_array_equal(t.contains(keys), want, err_msg=f"live, {n} keys")
        np.testing.assert_array_equal(mapped.contains(keys), want, err_msg=f"mapped, {n} keys")


def test_an_empty_checkpoint_maps_to_an_empty_table(tmp_path) -> None:
    t = embstore.Table(DIM)
    t.save(tmp_path / "c")
    m = embstore.Table.load(tmp_path / "c", mmap=True)
    assert len(m) == 0
    np.testing.assert_array_equal(m.lookup(KEYS), t.lookup(KEYS, insert=False))


def test_every_write_is_refused_and_changes_nothing(tmp_path) -> None:
    t = trained()
    t.save(tmp_path / "c")
    m = embstore.Table.load(tmp_path / "c", mmap=True)
    before = m.lookup(KEYS)
    files = {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()}
    g = np.ones((2, DIM), np.float32)
    writes = [
        lambda: m.lookup([1, 2], insert=True),
        lambda: m.lookup_pooled([1, 2], [0, 2], insert=True),
        lambda: m.assign([1, 2], g),
        lambda: m.apply_gradients([1, 2], g),
        lambda: m.apply_pooled_gradients([1, 2], [0, 2], g[:1]),
        lambda: m.remove([1]),
        lambda: m.reserve(10),
        lambda: m.evict(),
        lambda: m.load_state_dict({}),
    ]
    for write in writes:
        with pytest.raises(embstore.ReadOnlyError, match=r"read-only .*Table\.load"):
            write()
    np.testing.assert_array_equal(m.lookup(KEYS), before)
    assert {p.name: p.read_bytes() for p in (tmp_path / "c").iterdir()} == files


def row_files(path: pathlib.Path) -> list[pathlib.Path]:
    m = json.loads((path / "manifest.json").read_text())
    return [path / f["name"] for link in m["chain"] for f in link["files"]]


def header(data: bytes) -> tuple[int, dict]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def file_keys(data: bytes) -> np.ndarray:
    n, h = header(data)
    lo, hi = h["keys"]["data_offsets"]
    return np.frombuffer(data[8 + n + lo : 8 + n + hi], np.int64)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_a_shard_files_index_and_rows_start_on_cache_lines(tmp_path, dtype: str) -> None:
    """The two tensors a mapped reader reads at random are 64-byte aligned
    in the file (a misaligned 256-byte row spans 5 cache lines, not 4)."""
    t = embstore.Table(64, dtype=dtype, num_shards=3)
    t.lookup(np.arange(1_001))
    t.save(tmp_path / "c")
    for f in row_files(tmp_path / "c"):
        n, h = header(f.read_bytes())
        assert (8 + n) % 64 == 0, n
        assert h["index"]["data_offsets"][0] == 0
        assert h["rows"]["data_offsets"][0] % 64 == 0, h["rows"]
    m = embstore.Table.load(tmp_path / "c", mmap=True)
    keys = np.arange(-5, 1_010)
    np.testing.assert_array_equal(m.lookup(keys), t.lookup(keys, insert=False))


def test_a_damaged_file_is_refused_when_first_read_and_the_others_serve(tmp_path) -> None:
    t = trained(num_shards=2)
    path = tmp_path / "c"
    t.save(path)
    bad, good = row_files(path)
    data = bytearray(bad.read_bytes())
    n, h = header(bytes(data))
    start = 8 + n + h["rows"]["data_offsets"][0]
    data[start + 5] ^= 0x40  # one bit of one stored row
    bad.write_bytes(bytes(data))
    m = embstore.Table.load(path, mmap=True)  # opening reads no rows
    bad_keys, good_keys = file_keys(bytes(data)), file_keys(good.read_bytes())
    np.testing.assert_array_equal(m.lookup(good_keys), t.lookup(good_keys, insert=False))
    for _ in range(2):  # refused every time, never served
        with pytest.raises(embstore.CheckpointError, match="checksum mismatch"):
            m.lookup(bad_keys[:1])
    # A first call large enough for the pipelined lookup (which skips the
    # per-key check once every file has passed) checks the files too.
    fresh = embstore.Table.load(path, mmap=True)
    for _ in range(2):
        with pytest.raises(embstore.CheckpointError, match="checksum mismatch"):
            fresh.lookup(np.concatenate([good_keys, bad_keys]))


def test_a_crafted_index_with_a_valid_checksum_cannot_hang_or_misdirect(tmp_path) -> None:
    t = embstore.Table(DIM, num_shards=1)
    t.assign(np.arange(50), np.ones((50, DIM), np.float32))
    path = tmp_path / "c"
    t.save(path)
    (f,) = row_files(path)
    # Every slot taken by another key (no empty one to end a probe); every
    # slot naming the probed key at a row past the file's rows.
    for key, row in ((7, 1), (10_000, 1_000)):
        data = bytearray(f.read_bytes())
        n, h = header(bytes(data))
        lo, hi = h["index"]["data_offsets"]
        data[8 + n + lo : 8 + n + hi] = struct.pack("<qq", key, row) * ((hi - lo) // 16)
        f.write_bytes(bytes(data))

        def fix(m: dict, size: int = len(data), crc: int = crc32c(bytes(data))) -> None:
            m["chain"][0]["files"][0]["bytes"] = size
            m["chain"][0]["files"][0]["crc32c"] = crc

        rewrite_manifest(path, fix)
        m = embstore.Table.load(path, mmap=True)
        with pytest.raises(embstore.CheckpointError, match="index"):
            m.lookup(np.array([10_000]))


def one_file_with_its_header_edited(path: pathlib.Path, edit: Callable[[dict], None]) -> None:
    """Saves a one-shard table of 50 rows at ``path``, has ``edit`` change
    its shard file's header (a dict, in place), and writes the file and the
    manifest back with valid sizes and checksums."""
    t = embstore.Table(DIM, num_shards=1)
    t.assign(np.arange(50), np.ones((50, DIM), np.float32))
    t.save(path)
    (f,) = row_files(path)
    data = f.read_bytes()
    n, h = header(data)
    edit(h)
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    crafted = struct.pack("<Q", len(text)) + text + data[8 + n :]
    f.write_bytes(crafted)

    def fix(m: dict) -> None:
        m["chain"][0]["files"][0]["bytes"] = len(crafted)
        m["chain"][0]["files"][0]["crc32c"] = crc32c(crafted)

    rewrite_manifest(path, fix)


@pytest.mark.parametrize("num_shards", ["1000000000000000000", "0", "x"])
def test_a_crafted_shard_count_is_refused_on_open(tmp_path, num_shards: str) -> None:
    path = tmp_path / "c"
    one_file_with_its_header_edited(
        path, lambda h: h["__metadata__"].__setitem__("num_shards", num_shards)
    )
    with pytest.raises(embstore.CheckpointError, match=r"shard|num_shards"):
        embstore.Table.load(path, mmap=True)


def test_an_index_tensor_whose_header_does_not_name_it_is_refused_by_load_and_map(
    tmp_path,
) -> None:
    """A file holding its index tensor but whose header metadata lost the
    key naming the index's format (checksums valid) is damaged, not an
    older file (those hold neither): Table.load refuses it as a mapped
    read does, where it loaded it as an older file while the mapped read
    refused it (a fuzz case)."""

    def rename_the_format_key(h: dict) -> None:
        h["__metadata__"]["inZex"] = h["__metadata__"].pop("index")
        assert "index" in h  # the tensor stays

    path = tmp_path / "c"
    one_file_with_its_header_edited(path, rename_the_format_key)
    for mmap in (False, True):
        with pytest.raises(embstore.CheckpointError, match="index tensor"):
            embstore.Table.load(path, mmap=mmap)


def test_a_checkpoint_without_file_indexes_is_refused_with_the_way_to_convert_it(
    tmp_path,
) -> None:
    """As a checkpoint saved before file indexes: the index tensor and the
    header metadata gone, checksums valid. Table.load still loads it, and
    saving it again gives a checkpoint that maps."""
    # SGD(lr=0.5): parameters whose JSON spelling is the same in Python and
    # in the native writer, so the rewritten manifest's checksum matches.
    t = embstore.Table(DIM, optimizer=optim.SGD(lr=0.5), num_shards=2)
    t.lookup(np.arange(-300, 700))
    path = tmp_path / "c"
    t.save(path)
    sizes = {}
    for f in row_files(path):
        data = f.read_bytes()
        n, h = header(data)
        lo, hi = h.pop("index")["data_offsets"]
        h.pop("__metadata__")
        # The other tensors' bytes without the index's, their offsets moved.
        body = data[8 + n : 8 + n + lo] + data[8 + n + hi :]
        for v in h.values():
            v["data_offsets"] = [o - (hi - lo) if o >= hi else o for o in v["data_offsets"]]
        text = json.dumps(h, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        old = struct.pack("<Q", len(text)) + text + body
        f.write_bytes(old)
        sizes[f.name] = (len(old), crc32c(old))

    def fix(m: dict) -> None:
        for link in m["chain"]:
            for e in link["files"]:
                e["bytes"], e["crc32c"] = sizes[e["name"]]

    rewrite_manifest(path, fix)
    with pytest.raises(embstore.CheckpointError, match=r"Table\.load and save it again"):
        embstore.Table.load(path, mmap=True)
    loaded = embstore.Table.load(path)
    loaded.save(tmp_path / "again")
    assert_reads_equal(t, embstore.Table.load(tmp_path / "again", mmap=True))


def test_tensor_keys_give_tensors(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    t = trained()
    t.save(tmp_path / "c")
    m = embstore.Table.load(tmp_path / "c", mmap=True)
    rows, found = m.lookup(torch.tensor([1, 2, 99_999]), return_found=True)
    assert isinstance(rows, torch.Tensor)
    assert found.tolist() == t.contains([1, 2, 99_999]).tolist()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_processes_that_map_one_checkpoint_share_its_rows(tmp_path) -> None:
    """Three processes read every row of one mapped checkpoint at once: each
    holds under 10% of the rows' bytes as private memory (smaps_rollup),
    where each that loads it holds more than all of them. Measured by the
    bench's own function (benches/mapped.py)."""
    from benches.mapped import save_table, sharing

    rows = 200_000
    save_table(str(tmp_path / "c"), rows)
    row_bytes = rows * 64 * 4
    mapped = sharing(str(tmp_path / "c"), rows, 3, mmap=True)
    loaded = sharing(str(tmp_path / "c"), rows, 3, mmap=False)
    assert max(mapped) < 0.1 * row_bytes, mapped
    assert min(loaded) > row_bytes, loaded
