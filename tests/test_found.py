"""Hit masks: ``lookup(keys, insert=False, return_found=True)`` returns
``(rows, found)`` on the Table and the DeviceCache (the ShardedTable's are
in tests/mpi/test_sharding.py), checked against a dict model, and atomic
with removals by other threads: a key read as found has its row, a key read
as missing has the default, never one with the other."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import embstore
from embstore.gpu import DeviceCache


def model_table(rng: np.random.Generator) -> tuple[embstore.Table, dict[int, np.ndarray]]:
    table = embstore.Table(5, seed=3)
    keys = rng.choice(10_000, 600, replace=False)
    rows = rng.normal(size=(600, 5)).astype(np.float32)
    table.assign(keys, rows)
    return table, {int(k): r for k, r in zip(keys, rows, strict=True)}


@pytest.mark.parametrize("default", ["zeros", "init", "row"])
def test_rows_and_flags_equal_a_dict_model(default: str) -> None:
    rng = np.random.default_rng(0)
    table, model = model_table(rng)
    given: str | np.ndarray = np.full(5, 7.0, np.float32) if default == "row" else default
    keys = rng.integers(0, 10_000, 2_000)
    rows, found = table.lookup(keys, insert=False, default=given, return_found=True)
    assert found.dtype == np.bool_
    assert found.shape == (2_000,)
    np.testing.assert_array_equal(found, [int(k) in model for k in keys])
    plain = table.lookup(keys, insert=False, default=given)
    np.testing.assert_array_equal(rows, plain)
    for k, r, f in zip(keys, rows, found, strict=True):
        if f:
            np.testing.assert_array_equal(r, model[int(k)])
    assert len(table) == 600  # nothing stored


def test_tensor_keys_give_tensors_and_bad_arguments_are_refused() -> None:
    table = embstore.Table(3)
    table.assign([1], [[1.0, 2.0, 3.0]])
    rows, found = table.lookup(torch.tensor([1, 2]), insert=False, return_found=True)
    assert isinstance(rows, torch.Tensor)
    assert isinstance(found, torch.Tensor)
    assert found.tolist() == [True, False]
    with pytest.raises(ValueError, match=r"^return_found: needs insert=False"):
        table.lookup([1, 2], return_found=True)
    with pytest.raises(TypeError, match="return_found"):
        table.lookup([1], insert=False, return_found="yes")  # type: ignore[call-overload]
    rows, found = table.lookup(np.zeros(0, np.int64), insert=False, return_found=True)
    assert rows.shape == (0, 3)
    assert found.shape == (0,)
    assert len(table) == 1


def test_found_is_atomic_with_removal_by_other_threads() -> None:
    """Rows hold their key's value in every column; a remover thread takes
    keys out and puts them back while readers look them up: every found
    row is its key's row, every missing one reads zeros."""
    table = embstore.Table(16, seed=1)
    keys = np.arange(1, 2_001, dtype=np.int64)
    values = np.repeat(keys.astype(np.float32)[:, None], 16, axis=1)
    table.assign(keys, values)
    stop = threading.Event()
    errors: list[str] = []

    def churn() -> None:
        rng = np.random.default_rng(1)
        while not stop.is_set():
            some = rng.choice(keys, 300, replace=False)
            table.remove(some)
            table.assign(some, values[some - 1])

    def read(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(300):
            k = rng.choice(keys, 512)
            rows, found = table.lookup(k, insert=False, default="zeros", return_found=True)
            want = np.where(found[:, None], k[:, None].astype(np.float32), 0.0)
            if not np.array_equal(rows, np.broadcast_to(want, rows.shape)):
                errors.append("a row disagrees with its flag")
                return

    writer = threading.Thread(target=churn)
    readers = [threading.Thread(target=read, args=(s,)) for s in range(2)]
    writer.start()
    for t in readers:
        t.start()
    for t in readers:
        t.join(timeout=120)
    stop.set()
    writer.join(timeout=120)
    assert not writer.is_alive()
    assert not any(t.is_alive() for t in readers)
    assert errors == []


def test_the_device_cache_tells_cached_table_held_and_absent_keys() -> None:
    rng = np.random.default_rng(2)
    table, model = model_table(rng)
    cache = DeviceCache(table, rows=256, xp=np)
    cached = np.array(list(model)[:100])
    cache.lookup(cached)  # into the cache
    keys = np.concatenate([cached[:50], np.array(list(model)[300:350]), [10_001, 10_002, 10_001]])
    rows, found = cache.lookup(keys, insert=False, return_found=True)
    want_rows, want_found = table.lookup(keys, insert=False, return_found=True)
    np.testing.assert_array_equal(found, want_found)
    assert found.tolist() == [True] * 100 + [False] * 3
    np.testing.assert_array_equal(rows[:100], want_rows[:100])
    assert len(table) == 600
    with pytest.raises(ValueError, match=r"^return_found: needs insert=False"):
        cache.lookup(keys, return_found=True)
