"""Pooled lookups and their backward against torch.nn.EmbeddingBag followed
by torch.optim.SparseAdam / Adagrad, "sqrtn" against NumPy, and the
Collection against per-table calls."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
import torch

import embstore
from embstore import optim
from tests.conftest import assert_same, key_pool, snapshot

DIM = 8
POOL = 120
BATCH = 24
STEPS = 20


def random_bags(
    rng: np.random.Generator, pool: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bags of 0 to 5 ids (empty and one-id bags, repeats inside a bag)."""
    sizes = rng.integers(0, 6, BATCH)
    sizes[:3] = [0, 1, 4]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    ids = rng.choice(pool[: POOL // 3], offsets[-1])  # a small hot set: repeats
    if offsets[-1] >= 6:
        ids[offsets[2] + 1] = ids[offsets[2]]  # a repeat inside one bag
    weights = rng.uniform(0.2, 2.0, offsets[-1]).astype(np.float32)
    return ids.astype(np.int64), offsets, weights


def dense_index(pool: np.ndarray, keys: np.ndarray) -> np.ndarray:
    order = np.argsort(pool)
    return order[np.searchsorted(pool[order], keys)]


@pytest.mark.parametrize(("mode", "weighted"), [("sum", False), ("sum", True), ("mean", False)])
@pytest.mark.parametrize("opt_name", ["adam", "adagrad"])
def test_pooled_matches_torch_embedding_bag(
    rng: np.random.Generator, mode: str, weighted: bool, opt_name: str
) -> None:
    pool = key_pool(rng, POOL)
    ours_opt: optim.Optimizer
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    if opt_name == "adam":
        ours_opt = optim.Adam(lr=0.05)
        make = partial(torch.optim.SparseAdam, lr=0.05)
    else:
        ours_opt = optim.Adagrad(lr=0.1, initial_accumulator_value=0.1)
        make = partial(torch.optim.Adagrad, lr=0.1, initial_accumulator_value=0.1)
    table = embstore.Table(DIM, optimizer=ours_opt, seed=3, num_shards=5)
    bag = torch.nn.EmbeddingBag(POOL, DIM, mode=mode, include_last_offset=True, sparse=True)
    with torch.no_grad():
        bag.weight.copy_(torch.from_numpy(table.lookup(pool, insert=False)))
    topt = make(list(bag.parameters()))
    touched: set[int] = set()
    for _ in range(STEPS):
        ids, offsets, weights = random_bags(rng, pool)
        w = weights if weighted else None
        ours = table.lookup_pooled(ids, offsets, combiner=mode, weights=w)
        tin = torch.from_numpy(dense_index(pool, ids))
        tw = torch.from_numpy(weights) if weighted else None
        theirs = bag(tin, torch.from_numpy(offsets), per_sample_weights=tw)
        np.testing.assert_allclose(ours, theirs.detach().numpy(), rtol=1e-5, atol=1e-6)
        upstream = rng.normal(size=(BATCH, DIM)).astype(np.float32)
        table.apply_pooled_gradients(ids, offsets, upstream, combiner=mode, weights=w)
        topt.zero_grad()
        (theirs * torch.from_numpy(upstream)).sum().backward()
        topt.step()
        touched |= set(ids.tolist())
    keys, rows = table.export()
    assert set(keys.tolist()) == touched
    expect = bag.weight.detach().numpy()[dense_index(pool, keys)]
    np.testing.assert_allclose(rows, expect, rtol=1e-5, atol=1e-6)
    assert table.step == STEPS


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_pooling_in_several_spans_matches_torch_embedding_bag(
    rng: np.random.Generator, mode: str
) -> None:
    """Rows of dim 1024 make a pooled call's span (4 MiB of gathered rows,
    1,024 ids) smaller than its input, so the bags are pooled span by span
    (with one-id, empty and long bags among them, and repeated ids across
    spans): forward and SparseAdam steps must still equal torch's."""
    dim, batch, pool_size = 1024, 700, 400
    pool = key_pool(rng, pool_size)
    table = embstore.Table(dim, optimizer=optim.Adam(lr=0.05), seed=5, num_shards=3)
    bag = torch.nn.EmbeddingBag(pool_size, dim, mode=mode, include_last_offset=True, sparse=True)
    with torch.no_grad():
        bag.weight.copy_(torch.from_numpy(table.lookup(pool, insert=False)))
    topt = torch.optim.SparseAdam(list(bag.parameters()), lr=0.05)
    for step in range(3):
        sizes = rng.integers(0, 8, batch)
        sizes[[5, 300]] = [1500, 0]  # a bag longer than a span, an empty one
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        ids = rng.choice(pool, offsets[-1]).astype(np.int64)
        assert offsets[-1] > 3 * 1024, "spans: several"
        ours = table.lookup_pooled(ids, offsets, combiner=mode)
        tin = torch.from_numpy(dense_index(pool, ids))
        theirs = bag(tin, torch.from_numpy(offsets))
        np.testing.assert_allclose(ours, theirs.detach().numpy(), rtol=1e-5, atol=1e-5)
        upstream = rng.normal(size=(batch, dim)).astype(np.float32)
        table.apply_pooled_gradients(ids, offsets, upstream, combiner=mode)
        topt.zero_grad()
        (theirs * torch.from_numpy(upstream)).sum().backward()
        topt.step()
        keys, rows = table.export()
        expect = bag.weight.detach().numpy()[dense_index(pool, keys)]
        # An id repeated across many bags sums hundreds of float32 terms in
        # another order than torch; Adam's m / sqrt(v) magnifies that where
        # the sum nearly cancels (seen: 1.2e-5 on one of 409,600 values).
        np.testing.assert_allclose(rows, expect, rtol=1e-5, atol=1e-4, err_msg=f"step {step}")


def numpy_pool(
    rows: np.ndarray, offsets: np.ndarray, weights: np.ndarray, combiner: str
) -> tuple[np.ndarray, np.ndarray]:
    """Pooled rows and each id's coefficient, from the formulas of DESIGN.md."""
    out = np.zeros((len(offsets) - 1, rows.shape[1]))
    coef = np.zeros(len(rows))
    for b in range(len(offsets) - 1):
        s, e = offsets[b], offsets[b + 1]
        w = weights[s:e].astype(np.float64)
        denom = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}[combiner]
        if e > s and denom > 0:
            coef[s:e] = w / denom
            out[b] = (coef[s:e, None] * rows[s:e]).sum(axis=0)
    return out, coef


@pytest.mark.parametrize("combiner", ["sqrtn", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_matches_numpy_reference(
    rng: np.random.Generator, combiner: str, weighted: bool
) -> None:
    pool = key_pool(rng, POOL)
    table = embstore.Table(DIM, optimizer=optim.SGD(lr=0.5), seed=2)
    for _ in range(5):
        ids, offsets, weights = random_bags(rng, pool)
        if not weighted:
            weights = np.ones_like(weights)
        before = table.lookup(ids, insert=False)
        expect, _ = numpy_pool(before, offsets, weights, combiner)
        got = table.lookup_pooled(
            ids, offsets, combiner=combiner, weights=weights if weighted else None
        )
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)
        # Train a little so later rounds pool rows that moved.
        upstream = rng.normal(size=(BATCH, DIM)).astype(np.float32)
        table.apply_pooled_gradients(
            ids, offsets, upstream, combiner=combiner, weights=weights if weighted else None
        )


@pytest.mark.parametrize("combiner", ["sqrtn", "mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
def test_a_pooled_output_past_8_mib_matches_numpy(
    rng: np.random.Generator, combiner: str, weighted: bool
) -> None:
    """An output larger than the caches (more than 8 MiB: until 2026-11-27
    written with non-temporal stores, each bag summed in a scratch row).
    Every bag (empty, one id, several, repeats) must equal NumPy's pooling
    of the same rows, with weights and every combiner."""
    dim, batch = 64, 40_000
    assert batch * dim * 4 > 8 << 20, "the output is past 8 MiB"
    pool = key_pool(rng, 3_000)
    table = embstore.Table(dim, seed=3)
    sizes = rng.integers(0, 6, batch)
    sizes[:4] = [0, 1, 5, 0]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    ids = rng.choice(pool, offsets[-1]).astype(np.int64)
    ids[offsets[2] + 1] = ids[offsets[2]]  # a repeat inside one bag
    weights = rng.uniform(0.2, 2.0, ids.size).astype(np.float32)
    if not weighted:
        weights = np.ones_like(weights)
    rows = table.lookup(ids).astype(np.float64)
    bag_of = np.repeat(np.arange(batch), sizes)
    w = weights.astype(np.float64)
    denom = {
        "sum": np.ones(batch),
        "mean": np.bincount(bag_of, w, batch),
        "sqrtn": np.sqrt(np.bincount(bag_of, w * w, batch)),
    }[combiner]
    expect = np.zeros((batch, dim))
    np.add.at(expect, bag_of, (w / denom[bag_of])[:, None] * rows)
    got = table.lookup_pooled(
        ids, offsets, combiner=combiner, weights=weights if weighted else None
    )
    assert got.shape == (batch, dim)
    np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)
    assert not got[sizes == 0].any(), "empty bags pool to zeros"


def test_pooled_backward_equals_numpy_spread_with_sgd(rng: np.random.Generator) -> None:
    pool = key_pool(rng, POOL)
    for combiner in ("sum", "mean", "sqrtn"):
        table = embstore.Table(DIM, optimizer=optim.SGD(lr=0.5), seed=2)
        ids, offsets, weights = random_bags(rng, pool)
        uniq, inv = np.unique(ids, return_inverse=True)
        start = table.lookup(uniq, insert=False).astype(np.float64)
        _, coef = numpy_pool(start[inv], offsets, weights, combiner)
        upstream = rng.normal(size=(BATCH, DIM)).astype(np.float32)
        table.apply_pooled_gradients(ids, offsets, upstream, combiner=combiner, weights=weights)
        bag_of = np.repeat(np.arange(BATCH), np.diff(offsets))
        g = np.zeros((len(uniq), DIM))
        np.add.at(g, inv, coef[:, None] * upstream[bag_of])
        np.testing.assert_allclose(
            table.lookup(uniq, insert=False), start - 0.5 * g, rtol=1e-5, atol=1e-6
        )
        assert table.step == 1


def test_empty_bags_pool_to_zeros_and_serving_stores_nothing() -> None:
    table = embstore.Table(4, seed=1)
    out = table.lookup_pooled([5, 6], [0, 0, 2, 2], combiner="mean", insert=False)
    np.testing.assert_array_equal(out[0], 0)
    np.testing.assert_array_equal(out[2], 0)
    np.testing.assert_allclose(out[1], table.lookup([5, 6], insert=False).mean(axis=0), rtol=1e-6)
    assert len(table) == 0
    table.lookup_pooled([5, 6], [0, 0, 2, 2])
    assert len(table) == 2
    assert table.lookup_pooled([], [0]).shape == (0, 4)


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([1, 2, 4], r"^offsets: expected offsets\[0\] == 0"),
        ([0, 3, 2, 4], r"^offsets: expected non-decreasing offsets"),
        ([0, 2, 5], r"^offsets: expected the last offset to equal len\(ids\) = 4"),
        ([0, 2, 3], r"^offsets: expected the last offset to equal len\(ids\) = 4"),
        ([], r"^offsets: expected batch \+ 1 >= 1 offsets"),
    ],
)
def test_bad_offsets_are_refused_and_change_nothing(offsets: list[int], match: str) -> None:
    table = embstore.Table(4, optimizer=optim.Adam())
    table.lookup([1, 2])
    before = snapshot(table)
    ids = [1, 2, 3, 4]
    grads = np.ones((max(len(offsets) - 1, 0), 4))
    with pytest.raises(ValueError, match=match):
        table.lookup_pooled(ids, offsets)
    with pytest.raises(ValueError, match=match):
        table.apply_pooled_gradients(ids, offsets, grads)
    assert_same(before, snapshot(table))


@pytest.mark.parametrize(
    ("weights", "err", "match"),
    [
        ([1.0, 2.0], ValueError, r"^weights: expected shape \(4,\)"),
        ([1.0, np.nan, 1.0, 1.0], ValueError, r"^weights: expected only finite values"),
        ([1.0, np.inf, 1.0, 1.0], ValueError, r"^weights: expected only finite values"),
        (["a", "b", "c", "d"], TypeError, r"^weights: expected a float array"),
    ],
)
def test_bad_weights_are_refused_and_change_nothing(
    weights: list[object], err: type[Exception], match: str
) -> None:
    table = embstore.Table(4, optimizer=optim.Adam())
    table.lookup([1, 2])
    before = snapshot(table)
    with pytest.raises(err, match=match):
        table.lookup_pooled([1, 2, 3, 4], [0, 2, 4], weights=weights)
    with pytest.raises(err, match=match):
        table.apply_pooled_gradients([1, 2, 3, 4], [0, 2, 4], np.ones((2, 4)), weights=weights)
    assert_same(before, snapshot(table))


def test_bad_pooled_grads_and_combiner_are_refused() -> None:
    table = embstore.Table(4, optimizer=optim.Adam())
    table.lookup([1, 2])
    before = snapshot(table)
    with pytest.raises(ValueError, match=r"^grads: expected shape \(2, 4\)"):
        table.apply_pooled_gradients([1, 2], [0, 1, 2], np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"^grads: expected only finite values"):
        table.apply_pooled_gradients([1, 2], [0, 1, 2], np.full((2, 4), np.nan))
    with pytest.raises(ValueError, match=r"^combiner: expected one of"):
        table.lookup_pooled([1, 2], [0, 1, 2], combiner="max")
    assert_same(before, snapshot(table))


# -- Collection ----------------------------------------------------------------


def feature_batch(rng: np.random.Generator, pool: np.ndarray) -> tuple:
    ids, offsets, weights = random_bags(rng, pool)
    return ids, offsets, weights


def test_collection_equals_per_table_calls_and_steps_shared_tables_once(
    rng: np.random.Generator,
) -> None:
    pool = key_pool(rng, POOL)

    def tables() -> tuple[embstore.Table, embstore.Table]:
        return (
            embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=1),
            embstore.Table(4, optimizer=optim.Adagrad(lr=0.1), seed=2),
        )

    user, item = tables()
    coll = embstore.Collection(
        {"user": user, "item": item, "hist": item}, combiners={"hist": "mean"}
    )
    assert coll.dims == [DIM, 4, 4]
    ref_user, ref_item = tables()
    for _ in range(6):
        b = {n: feature_batch(rng, pool) for n in ("user", "item", "hist")}
        b["item"] = b["item"][:2]  # unweighted
        out = coll.lookup_pooled(b)
        assert out.shape == (BATCH, DIM + 8)
        ru = ref_user.lookup_pooled(b["user"][0], b["user"][1], weights=b["user"][2])
        ri = ref_item.lookup_pooled(*b["item"])
        rh = ref_item.lookup_pooled(
            b["hist"][0], b["hist"][1], combiner="mean", weights=b["hist"][2]
        )
        np.testing.assert_allclose(out, np.concatenate([ru, ri, rh], axis=1), rtol=1e-5, atol=1e-6)
        g = rng.normal(size=out.shape).astype(np.float32)
        coll.apply_pooled_gradients(b, g)
        ref_user.apply_pooled_gradients(
            b["user"][0], b["user"][1], g[:, :DIM], weights=b["user"][2]
        )
        # The shared table: one step over both features' ids and gradients.
        ids = np.concatenate([b["item"][0], b["hist"][0]])
        n_item = len(b["item"][1]) - 1
        offsets = np.concatenate([b["item"][1], b["hist"][1][1:] + b["item"][1][-1]])
        grads_cat = np.concatenate([g[:, DIM : DIM + 4], g[:, DIM + 4 :]])
        # item bags are plain sums, hist bags weighted means: as sum-combiner
        # weights w / (sum of the bag's w), one call equals the shared step.
        w_item = np.ones(len(b["item"][0]), np.float32)
        sizes = np.diff(b["hist"][1])
        hw = b["hist"][2]
        bag_sums = np.add.reduceat(hw, b["hist"][1][:-1]) if len(hw) else np.array([])
        bag_sums = np.where(sizes > 0, bag_sums[: len(sizes)] if len(bag_sums) else 0, 1.0)
        w_hist = hw / np.repeat(bag_sums, sizes)
        ref_item.apply_pooled_gradients(
            ids, offsets, grads_cat, weights=np.concatenate([w_item, w_hist])
        )
        assert n_item == BATCH
    for ours, ref in ((user, ref_user), (item, ref_item)):
        a, b_ = ours.export(with_state=True), ref.export(with_state=True)
        np.testing.assert_array_equal(a[0], b_[0])
        np.testing.assert_allclose(a[1], b_[1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a[2], b_[2], rtol=1e-5, atol=1e-6)
    assert item.step == 6, "a shared table takes one step per call"
    assert user.step == 6


def test_collection_bad_input_changes_nothing(rng: np.random.Generator) -> None:
    t = embstore.Table(4, optimizer=optim.Adam())
    coll = embstore.Collection({"a": t, "b": t})
    t.lookup([1, 2, 3])
    before = snapshot(t)
    good = ([1, 2], [0, 1, 2])
    with pytest.raises(ValueError, match=r"^batch: expected features \['a', 'b'\]"):
        coll.lookup_pooled({"a": good})
    with pytest.raises(ValueError, match=r"expected batch size 2 like the first feature"):
        coll.apply_pooled_gradients({"a": good, "b": ([1], [0, 1])}, np.ones((2, 8)))
    with pytest.raises(ValueError, match=r"offsets: expected non-decreasing offsets"):
        coll.apply_pooled_gradients({"a": good, "b": ([1, 2], [0, 2, 1])}, np.ones((2, 8)))
    with pytest.raises(ValueError, match=r"^grads: expected shape \(2, 8\)"):
        coll.apply_pooled_gradients({"a": good, "b": good}, np.ones((2, 4)))
    with pytest.raises(ValueError, match=r"^grads: expected only finite values"):
        coll.apply_pooled_gradients({"a": good, "b": good}, np.full((2, 8), np.inf))
    with pytest.raises(TypeError, match=r"^features: expected embstore tiers"):
        embstore.Collection({"a": "t"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"^combiner: expected one of"):
        embstore.Collection({"a": t}, combiner="max")
    assert_same(before, snapshot(t))


def test_collection_arrays_taken_as_given_or_converted_give_the_same_results() -> None:
    """A batch of (ids, offsets) int64 arrays goes to the native call as it
    is; arrays it cannot read as they are (int32, strided) are converted
    and give the same rows; bad arrays raise what the checked path raises
    and change nothing."""
    results = []
    for form in ("ready", "int32", "strided"):
        t = embstore.Table(4, optimizer=optim.Adam(lr=0.1), seed=1)
        coll = embstore.Collection({"a": t, "b": t}, combiner="mean")
        ids = np.array([5, 6, 7, 5], np.int64)
        offsets = np.array([0, 1, 4], np.int64)
        if form == "int32":
            ids = ids.astype(np.int32)
        elif form == "strided":
            ids = np.repeat(ids, 2)[::2]
            assert not ids.flags.c_contiguous
        batch = {"a": (ids, offsets), "b": (ids[::-1].copy(), offsets)}
        out = coll.lookup_pooled(batch)
        coll.apply_pooled_gradients(batch, np.ones((2, 8), np.float32))
        results.append((out, snapshot(t)))
    for out, snap in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        assert_same(snap, results[0][1])
    t = embstore.Table(4, optimizer=optim.Adam())
    coll = embstore.Collection({"a": t, "b": t})
    t.lookup([1, 2, 3])
    before = snapshot(t)
    good = (np.array([1, 2]), np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"expected batch size 2 like the first feature"):
        coll.lookup_pooled({"a": good, "b": (np.array([1]), np.array([0, 1]))})
    with pytest.raises(ValueError, match=r"offsets: expected non-decreasing offsets"):
        coll.apply_pooled_gradients(
            {"a": good, "b": (np.array([1, 2]), np.array([0, 2, 1]))}, np.ones((2, 8), np.float32)
        )
    with pytest.raises(ValueError, match=r"^grads: expected shape \(2, 8\)"):
        coll.apply_pooled_gradients({"a": good, "b": good}, np.ones((2, 4), np.float32))
    with pytest.raises(ValueError, match=r"^grads: expected only finite values"):
        coll.apply_pooled_gradients({"a": good, "b": good}, np.full((2, 8), np.inf, np.float32))
    assert_same(before, snapshot(t))


def test_collection_plain_ids_mean_one_id_per_sample() -> None:
    """A feature given as 1-D ids equals (ids, arange(n + 1)): forward and step."""
    from embstore import optim

    def make() -> embstore.Collection:
        user = embstore.Table(4, optimizer=optim.Adagrad(lr=0.1), seed=1)
        item = embstore.Table(4, optimizer=optim.Adagrad(lr=0.1), seed=2)
        return embstore.Collection({"user": user, "item": item, "hist": item})

    users, items = np.array([1, 2, 2]), [7, 8, 9]
    hist = (np.array([7, 7, 5, 9]), np.array([0, 2, 3, 4]))
    csr = {"user": (users, np.arange(4)), "item": (np.array(items), np.arange(4)), "hist": hist}
    plain = {"user": users, "item": items, "hist": hist}
    a, b = make(), make()
    np.testing.assert_array_equal(a.lookup_pooled(csr), b.lookup_pooled(plain))
    g = np.linspace(-1, 1, 36, dtype=np.float32).reshape(3, 12)
    a.apply_pooled_gradients(csr, g)
    b.apply_pooled_gradients(plain, g)
    for name in ("user", "item"):
        ka, ra = a.tables[name].export()
        kb, rb = b.tables[name].export()
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(ra, rb)
    with pytest.raises(ValueError, match=r"batch\['user'\] ids: expected a 1-D"):
        b.lookup_pooled({**plain, "user": np.ones((3, 2), np.int64)})
    with pytest.raises(ValueError, match=r"batch\['item'\] offsets: expected batch size 2"):
        b.lookup_pooled({**plain, "user": [1, 2]})  # the first feature sets the batch size


def test_table_arrays_taken_as_given_or_converted_give_the_same_results() -> None:
    """lookup, apply_gradients, lookup_pooled and apply_pooled_gradients
    pass NumPy arrays to the native call as they are; arrays it cannot read
    as they are (int32, strided, float64 gradients) are converted and give
    the same rows; bad arguments raise what the checked path raises and
    change nothing."""
    results = []
    for form in ("ready", "int32", "strided", "float64"):
        t = embstore.Table(4, optimizer=optim.Adam(lr=0.1), seed=1)
        keys = np.array([5, 6, 7, 5], np.int64)
        offsets = np.array([0, 1, 4], np.int64)
        grads = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)
        bag_grads = grads[:2].copy()
        if form == "int32":
            keys, offsets = keys.astype(np.int32), offsets.astype(np.int32)
        elif form == "strided":
            keys, grads = np.repeat(keys, 2)[::2], np.repeat(grads, 2, axis=0)[::2]
            assert not keys.flags.c_contiguous
            assert not grads.flags.c_contiguous
        elif form == "float64":
            grads, bag_grads = grads.astype(np.float64), bag_grads.astype(np.float64)
        out = [t.lookup(keys), t.lookup(keys, insert=np.bool_(False))]
        t.apply_gradients(keys, grads)
        out.append(t.lookup_pooled(keys, offsets, combiner="mean"))
        t.apply_pooled_gradients(keys, offsets, bag_grads, combiner="mean")
        out.append(t.lookup(keys, insert=False, default="zeros"))
        results.append((out, snapshot(t)))
    for out, snap in results[1:]:
        for a, b in zip(out, results[0][0], strict=True):
            np.testing.assert_array_equal(a, b)
        assert_same(snap, results[0][1])
    t = embstore.Table(4, optimizer=optim.Adam())
    keys = np.array([1, 2], np.int64)
    t.lookup(keys)
    before = snapshot(t)
    with pytest.raises(ValueError, match=r"^grads: expected shape \(2, 4\), got \(4, 2\)"):
        t.apply_gradients(keys, np.ones((4, 2), np.float32))
    with pytest.raises(ValueError, match=r"^grads: expected only finite values"):
        t.apply_gradients(keys, np.full((2, 4), np.inf, np.float32))
    with pytest.raises(TypeError, match=r"^insert: expected True or False, got str"):
        t.lookup(np.array([9], np.int64), insert="no")
    with pytest.raises(ValueError, match=r"^default: expected \"init\", \"zeros\" or a row"):
        t.lookup(np.array([9], np.int64), default="row")
    with pytest.raises(TypeError, match=r"^keys: expected an integer array, got dtype float64"):
        t.lookup(np.array([9.0]))
    with pytest.raises(ValueError, match=r"^combiner: expected one of"):
        t.lookup_pooled(keys, np.array([0, 2], np.int64), combiner="max")
    with pytest.raises(ValueError, match=r"^offsets: expected batch \+ 1 >= 1 offsets"):
        t.lookup_pooled(keys, np.array([], np.int64))
    with pytest.raises(ValueError, match=r"^grads: expected shape \(1, 4\), got \(2, 4\)"):
        t.apply_pooled_gradients(keys, np.array([0, 2], np.int64), np.ones((2, 4), np.float32))
    assert_same(before, snapshot(t))


def test_a_collection_batch_in_another_order_than_its_features_trains_each_feature() -> None:
    """The batch dict's order is not the features' order: each feature's ids
    and gradients still go to its own table (the inline path of native-ready
    arrays once took them in the dict's order)."""

    def sgd() -> embstore.Table:
        return embstore.Table(
            4, optimizer=optim.SGD(lr=1.0), initializer=embstore.init.Zeros(), num_shards=2
        )

    a, b = sgd(), sgd()
    coll = embstore.Collection({"y": b, "x": a})
    x, y = np.array([1, 2, 3], np.int64), np.array([7, 8, 9], np.int64)
    off = np.arange(4, dtype=np.int64)
    batch = {"x": (x, off), "y": (y, off)}
    coll.lookup_pooled(batch)
    grads = np.concatenate([np.full((3, 4), 2.0, np.float32), np.ones((3, 4), np.float32)], 1)
    coll.apply_pooled_gradients(batch, grads)  # columns: y's 4, then x's 4
    np.testing.assert_array_equal(a.lookup(x, insert=False), np.full((3, 4), -1.0, np.float32))
    np.testing.assert_array_equal(b.lookup(y, insert=False), np.full((3, 4), -2.0, np.float32))
    assert not a.contains(y).any()
    assert not b.contains(x).any()
