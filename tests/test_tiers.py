"""The tiers stack through embstore.protocol alone: each implements its
protocol, a DeviceCache refuses a tier that lacks what it needs, and a
DeviceCache and other threads share one table safely: the table's step
counter and rows equal a serial replay of the same calls."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import embstore
from embstore import optim
from embstore.gpu import DeviceCache
from embstore.protocol import BatchTier, LocalTier, StateTier
from tests._concurrent import run_concurrently

DIM = 8


def test_each_tier_implements_its_protocol() -> None:
    table = embstore.Table(DIM, optimizer=optim.Adam())
    cache = DeviceCache(table, 16, xp=np)
    assert isinstance(table, StateTier)
    assert isinstance(cache, LocalTier)
    assert isinstance(cache, BatchTier)
    assert not isinstance(cache, StateTier), "a cache does not hand out optimizer state"
    with pytest.raises(TypeError, match="table: expected a tier with rows and optimizer state"):
        DeviceCache(cache, 8, xp=np)  # type: ignore[arg-type]
    assert len(cache) == len(table)
    assert cache.config()["cache"] == {"rows": 16, "policy": "lfu", "admit_after": 1}


def test_save_part_and_publish_parts_make_one_loadable_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    a = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1), seed=3)
    b = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1), seed=3)
    a.apply_gradients(np.arange(10), np.ones((10, DIM), np.float32))
    b.apply_gradients(np.arange(10, 25), np.ones((15, DIM), np.float32))
    ckpt = embstore._core.new_checkpoint_id()
    parts = [a.save_part(tmp_path, f"{ckpt}-a"), b.save_part(tmp_path, f"{ckpt}-b")]
    manifest = a.publish_parts(tmp_path, ckpt, parts, len(a) + len(b))
    assert manifest["rows"] == 25
    loaded = embstore.Table.load(tmp_path)
    keys, rows, state = loaded.export(with_state=True)
    np.testing.assert_array_equal(keys, np.arange(25))
    np.testing.assert_array_equal(rows[:10], a.export()[1])
    np.testing.assert_array_equal(state[10:], b.export(with_state=True)[2])
    with pytest.raises(embstore.CheckpointError):
        a.publish_parts(tmp_path, ckpt, parts, 10**6)  # more rows than the files hold


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt", [optim.Adam(lr=0.05), optim.RowWiseAdagrad(lr=0.1)], ids=repr)
def test_a_cache_and_a_thread_on_its_table_equal_a_serial_replay(opt: optim.Optimizer) -> None:
    """Thread A trains through a DeviceCache (distinct keys of 0..39 per call,
    all of which the cache holds once seen; the cache sums a call's
    duplicate keys in float64, the table in float32, so duplicates would
    differ in the last bit); thread B calls apply_gradients and lookup on the
    table below on other keys. Every call is one step: the step numbers A
    took (recorded from take_step) and the rest (B's, in order) replayed
    serially on a fresh table give the same step and, bit for bit, the same
    rows and optimizer state."""
    steps_a, steps_b = 60, 60
    table = embstore.Table(DIM, optimizer=opt, seed=11)
    cache = DeviceCache(table, 64, xp=np)
    rng = np.random.default_rng(5)
    batches_a = [
        (rng.choice(40, 24, replace=False), rng.normal(size=(24, DIM)).astype(np.float32))
        for _ in range(steps_a)
    ]
    batches_b = [
        (1000 + rng.integers(0, 100, 32), rng.normal(size=(32, DIM)).astype(np.float32))
        for _ in range(steps_b)
    ]
    taken: list[int] = []
    take_step = table.take_step

    def recording_take_step() -> int:
        t = take_step()
        taken.append(t)
        return t

    table.take_step = recording_take_step  # type: ignore[method-assign]
    start = threading.Barrier(2)

    def a() -> None:
        start.wait()
        for keys, grads in batches_a:
            cache.apply_gradients(keys, grads)
            cache.lookup(keys)

    def b() -> None:
        start.wait()
        for keys, grads in batches_b:
            table.apply_gradients(keys, grads)
            table.lookup(keys[::2] + 1)

    assert run_concurrently(a, b) == []
    assert len(taken) == steps_a
    assert table.step == steps_a + steps_b
    cache.flush()

    replay = embstore.Table(DIM, optimizer=opt, seed=11)
    own_a = dict(zip(taken, batches_a, strict=True))
    rest = iter(batches_b)
    for t in range(1, steps_a + steps_b + 1):
        assert replay.take_step() == t
        if t in own_a:
            keys, grads = own_a[t]
            replay.apply_gradients(keys, grads, step=t)
        else:
            keys, grads = next(rest)
            replay.apply_gradients(keys, grads, step=t)
            replay.lookup(keys[::2] + 1)
    got, want = table.export(with_state=True), replay.export(with_state=True)
    assert replay.step == table.step
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
