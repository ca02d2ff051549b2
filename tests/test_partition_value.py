"""The partition value (embstore.distributed.Partition): checked when made,
the owners the native partitioner gives, and recorded in a sharded
checkpoint's manifest (version 2, refused by name when crafted), which
every reader still loads. ShardedTable's save and load of it run on gloo
ranks in tests/torchrun/gloo_suite.py."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

import embstore
from embstore import ops, optim
from embstore.distributed import Partition
from tests._crafted import rewrite_manifest


def test_a_partition_is_checked_when_made_naming_the_field() -> None:
    with pytest.raises(ValueError, match="partition"):
        Partition("range", 2)
    with pytest.raises(ValueError, match="key_space"):
        Partition("div", 2)
    with pytest.raises(ValueError, match="world_size"):
        Partition("hash", 0)
    with pytest.raises(ValueError, match="version"):
        Partition("hash", 2, version=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Partition().kind = "mod"  # type: ignore[misc]


@pytest.mark.parametrize(
    "p", [Partition("hash", 3), Partition("mod", 4), Partition("div", 5, key_space=1000)]
)
def test_owners_and_plans_are_the_native_partitioners(p: Partition) -> None:
    keys = np.random.default_rng(1).integers(0, 1000, 500).astype(np.int64)
    np.testing.assert_array_equal(
        p.owners(keys), ops.partition_owners(keys, p.world_size, p.kind, p.key_space)
    )
    for got, want in zip(
        p.plan(keys), ops.plan_exchange(keys, p.world_size, p.kind, p.key_space), strict=True
    ):
        np.testing.assert_array_equal(got, want)
    assert Partition.from_record(p.to_record()) == p
    assert p.resized(7).world_size == 7
    assert p.resized(7).kind == p.kind


def _published(path: pathlib.Path, partition: Partition | None) -> dict[str, object]:
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.1), seed=2)
    t.lookup(np.arange(30))
    ckpt = t.new_checkpoint_id()
    part = t.save_part(path, f"{ckpt}-r0000")
    return t.publish_parts(
        path, ckpt, [part], 30, partition=None if partition is None else partition.to_record()
    )


def test_a_sharded_checkpoint_records_its_partition_and_loads_everywhere(
    tmp_path: pathlib.Path,
) -> None:
    p = Partition("div", 3, key_space=64)
    m = _published(tmp_path / "a", p)
    assert m["version"] == 2
    assert Partition.from_record(m["partition"]) == p  # type: ignore[arg-type]
    on_disk = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert on_disk["partition"] == p.to_record()
    assert len(embstore.Table.load(tmp_path / "a")) == 30
    assert embstore.Table.load(tmp_path / "a", mmap=True).contains(np.arange(30)).all()
    # Without a partition the manifest stays version 1 (older builds read it).
    plain = _published(tmp_path / "b", None)
    assert plain["version"] == 1
    assert "partition" not in plain


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        ({"kind": "range"}, "partition"),
        ({"kind": "div", "key_space": None}, "key_space"),
        ({"world_size": 0}, "world_size"),
        ({"version": 9}, "version 9"),
    ],
)
def test_a_crafted_partition_record_is_refused_by_every_reader(
    tmp_path: pathlib.Path, edit: dict[str, object], says: str
) -> None:
    _published(tmp_path, Partition("div", 2, key_space=64))

    def craft(m: dict[str, object]) -> None:
        record = dict(m["partition"])  # type: ignore[call-overload]
        record.update(edit)
        m["partition"] = {k: v for k, v in record.items() if v is not None}

    rewrite_manifest(tmp_path, craft)
    for load in (
        lambda: embstore.Table.load(tmp_path),
        lambda: embstore.Table.load(tmp_path, mmap=True),
    ):
        with pytest.raises(embstore.CheckpointError, match=says):
            load()


def test_publish_parts_refuses_a_bad_partition_naming_it(tmp_path: pathlib.Path) -> None:
    t = embstore.Table(4)
    t.lookup(np.arange(3))
    ckpt = t.new_checkpoint_id()
    part = t.save_part(tmp_path, f"{ckpt}-r0000")
    with pytest.raises(ValueError, match="partition"):
        t.publish_parts(tmp_path, ckpt, [part], 3, partition={"kind": "hash"})
    assert not (tmp_path / "manifest.json").exists()


def test_a_bucket_partition_moves_whole_buckets_no_more_than_it_must() -> None:
    two = Partition("bucket", 2)
    assert len(two.buckets) == 1024
    assert np.bincount(two.buckets).tolist() == [512, 512]
    keys = np.arange(100_000, dtype=np.int64) * 7919
    # A key's rank is its bucket's: the bucket its "hash" owner among 1,024.
    bucket = embstore._core.partition_owners(keys, 1024, "hash", None)
    np.testing.assert_array_equal(two.owners(keys), np.asarray(two.buckets)[bucket])
    uniq, inv, counts = two.plan(np.concatenate([keys, keys[:7]]))
    np.testing.assert_array_equal(uniq[inv], np.concatenate([keys, keys[:7]]))
    np.testing.assert_array_equal(two.owners(uniq), np.repeat(np.arange(2), counts))
    four = two.resized(4)  # ranks 0 and 1 go on: half the buckets move
    assert sum(a != b for a, b in zip(two.buckets, four.buckets, strict=True)) == 512
    assert np.bincount(four.buckets).tolist() == [256] * 4
    three = four.resized(3)  # rank 3 leaves: its buckets only
    assert sum(a != b for a, b in zip(four.buckets, three.buckets, strict=True)) == 256
    assert sorted(np.bincount(three.buckets).tolist()) == [341, 341, 342]
    # Another mapping of old ranks to new: rank 1 becomes rank 0.
    swapped = two.resized(2, keep={1: 0, 0: 1})
    assert all(a != b for a, b in zip(two.buckets, swapped.buckets, strict=True))
    assert Partition.from_record(three.to_record()) == three
    with pytest.raises(ValueError, match="buckets"):
        Partition("bucket", 2, buckets=(0, 2))
    with pytest.raises(ValueError, match="buckets"):
        Partition("hash", 2, buckets=(0, 1))
