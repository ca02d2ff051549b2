"""A gradient call on exactly the keys of the last lookup (the backward of a
training step) reuses the rows that lookup found instead of probing the
index again. These tests pit that path against the same calls with the
reuse defeated (another lookup in between), through removals, evictions,
assignments and lookups that stored nothing; and a torch oracle covers it
in tests/test_torch.py (forward, then backward, each step)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest

import embstore
from embstore import optim
from tests._concurrent import run_concurrently

Op = Callable[[embstore.Table, np.ndarray], object]


def _pair(**kwargs: object) -> tuple[embstore.Table, embstore.Table]:
    def make() -> embstore.Table:
        return embstore.Table(6, optimizer=optim.Adam(lr=0.05), seed=9, num_shards=4, **kwargs)  # type: ignore[arg-type]

    return make(), make()


def _same(a: embstore.Table, b: embstore.Table) -> None:
    for x, y in zip(a.export(with_state=True), b.export(with_state=True), strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.step == b.step


BETWEEN: dict[str, Op] = {
    "nothing": lambda t, k: None,
    "remove some keys (rows move)": lambda t, k: t.remove(k[::3]),
    "remove other keys": lambda t, k: t.remove(np.arange(10_000, 10_400)),
    "assign (state reset)": lambda t, k: t.assign(k[:50], np.ones((50, t.dim), np.float32)),
    "apply other keys": lambda t, k: t.apply_gradients(
        np.arange(20_000, 20_300), np.ones((300, t.dim), np.float32)
    ),
}


@pytest.mark.parametrize("between", list(BETWEEN))
@pytest.mark.parametrize("forward", ["lookup", "lookup_pooled", "lookup_serving"])
def test_backward_after_forward_equals_backward_with_fresh_probes(
    between: str, forward: str
) -> None:
    rng = np.random.default_rng(7)
    ours, ref = _pair()
    warm = np.concatenate([np.arange(10_000, 10_400), rng.integers(0, 3_000, 2_000)])
    for t in (ours, ref):
        t.lookup(warm)
    for _ in range(8):
        keys = rng.integers(0, 3_000, 4_000)  # repeats, some new keys
        grads = rng.standard_normal((len(keys), 6)).astype(np.float32)
        offsets = np.arange(len(keys) + 1)
        for t, defeat in ((ours, False), (ref, True)):
            if forward == "lookup":
                t.lookup(keys)
            elif forward == "lookup_pooled":
                t.lookup_pooled(keys, offsets)
            else:
                t.lookup(keys, insert=False)  # stores nothing: the step inserts
            if defeat:
                t.lookup(np.array([123_456_789]), insert=False)  # other keys
            BETWEEN[between](t, keys)
            if forward == "lookup_pooled":
                t.apply_pooled_gradients(keys, offsets, grads)
            else:
                t.apply_gradients(keys, grads)
        _same(ours, ref)


def test_capacity_evictions_after_the_forward_invalidate_the_reuse() -> None:
    rng = np.random.default_rng(3)
    ours, ref = _pair(capacity=1_500, eviction="lru")
    for _ in range(10):
        keys = rng.integers(0, 5_000, 3_000)  # more distinct keys than capacity
        grads = rng.standard_normal((len(keys), 6)).astype(np.float32)
        ours.lookup(keys)  # inserts, then evicts down to capacity
        ref.lookup(keys)
        ref.lookup(np.empty(0, np.int64))  # defeat the reuse
        ours.apply_gradients(keys, grads)
        ref.apply_gradients(keys, grads)
        keys_o, rows_o, state_o = ours.export(with_state=True)
        keys_r, rows_r, state_r = ref.export(with_state=True)
        np.testing.assert_array_equal(keys_o, keys_r)
        np.testing.assert_array_equal(rows_o, rows_r)
        np.testing.assert_array_equal(state_o, state_r)


def test_collection_step_reuses_its_forward_and_equals_per_call_steps() -> None:
    rng = np.random.default_rng(5)
    t_ours, t_ref = _pair()
    coll = embstore.Collection({"a": t_ours, "b": t_ours})
    ref = embstore.Collection({"a": t_ref, "b": t_ref})
    for _ in range(6):
        ka, kb = rng.integers(0, 2_000, 1_000), rng.integers(0, 2_000, 1_000)
        one = np.arange(1_001)
        feed = {"a": (ka, one), "b": (kb, one)}
        g = rng.standard_normal((1_000, 12)).astype(np.float32)
        coll.lookup_pooled(feed)
        ref.lookup_pooled(feed)
        t_ref.remove(ka[:100])  # rows move in t_ref, and in t_ours too:
        t_ours.remove(ka[:100])
        coll.apply_pooled_gradients(feed, g)
        ref.lookup_pooled({"a": (kb, one), "b": (ka, one)})  # defeat in ref
        ref.apply_pooled_gradients(feed, g)
    _same(t_ours, t_ref)


def test_the_kept_rows_count_in_stats_bytes_until_the_step_takes_them() -> None:
    t = embstore.Table(8, optimizer=optim.SGD(lr=0.1), num_shards=4)
    keys = np.arange(100_000)
    t.assign(keys, np.zeros((len(keys), 8), np.float32))
    base = t.stats()["bytes"]
    t.lookup(keys)
    kept = t.stats()["bytes"] - base
    # 16 bytes per key: its hash, its place in the plan and its row.
    assert 16 * len(keys) <= kept <= 16 * len(keys) + 4096, kept
    t.apply_gradients(keys, np.ones((len(keys), 8), np.float32))
    assert t.stats()["bytes"] == base, "the step took the kept rows"


def test_threads_stepping_their_own_keys_while_rows_move_lose_no_update() -> None:
    t = embstore.Table(
        4, optimizer=optim.SGD(lr=1.0), initializer=embstore.init.Zeros(), num_shards=4
    )
    steps = 30

    def trainer(w: int) -> None:
        keys = np.arange(w * 10_000, w * 10_000 + 3_000).repeat(2)  # each key twice
        for _ in range(steps):
            t.lookup(keys)
            t.apply_gradients(keys, np.ones((len(keys), 4), np.float32))

    # Rows stored before the trainers' keys: removing them moves the
    # shards' last rows, the trainers' ones, into the holes.
    early = np.arange(800_000, 808_000)
    t.assign(early, np.ones((len(early), 4), np.float32))

    def mover() -> None:
        for chunk in np.array_split(early, 80):
            t.remove(chunk)

    errors = run_concurrently(*(functools.partial(trainer, w) for w in range(3)), mover)
    assert not errors, errors
    keys, rows = t.export()
    assert len(keys) == 3 * 3_000
    # Every step subtracted 2 (one per occurrence) from each of its keys' columns.
    np.testing.assert_array_equal(rows, np.full((len(keys), 4), -2.0 * steps, np.float32))


def test_bulk_lookups_keep_nothing() -> None:
    t = embstore.Table(1, num_shards=2)
    t.lookup(np.arange(10))
    base = t.stats()["bytes"]
    t.lookup(np.arange(10, (1 << 22) + 11))  # more ids than a step keeps
    rows = len(t)
    small = embstore.Table(1, num_shards=2)
    small.assign(np.arange(rows), np.zeros((rows, 1), np.float32))
    # Only rows and index grew: no memo of the 4M-id lookup, and the one of
    # the 10-id lookup before it is gone.
    assert t.stats()["bytes"] - base < small.stats()["bytes"]
    assert t.stats()["bytes"] <= small.stats()["bytes"] + 4096


def test_ids_modified_in_place_after_the_forward_do_not_move_the_gradient() -> None:
    torch = pytest.importorskip("torch", reason="torch is needed for embstore.torch")
    import embstore.torch as et

    t = embstore.Table(4, optimizer=optim.SGD(lr=1.0), num_shards=2)
    emb = et.Embedding(t)
    ids = torch.tensor([1, 2])
    before = t.lookup([1, 2, 3, 4]).copy()
    out = emb(ids)
    ids.add_(2)  # the loader reuses its buffer for the next batch
    out.sum().backward()
    after = t.lookup([1, 2, 3, 4])
    np.testing.assert_allclose(after[:2], before[:2] - 1.0, rtol=1e-6)
    np.testing.assert_array_equal(after[2:], before[2:])
