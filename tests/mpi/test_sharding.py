"""Under mpirun: N ranks produce the same rows (1e-5) as one Table fed with
the union of all ranks' batches, for every partition, plain and pooled, with
Adam and Adagrad; bad input on one rank raises on every rank; the bytes a
call moves equal the cost model's count."""

from __future__ import annotations

import importlib
import os
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import embstore
from embstore import optim
from embstore.distributed import ShardedCollection, ShardedTable
from embstore.gpu import DeviceCache

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
# The device caches' namespace: NumPy here; cupy on a GPU (tests/test_mpi.py).
XP = importlib.import_module(os.environ.get("EMBSTORE_TEST_XP", "numpy"))
DIM = 6
STEPS = 20
KEY_SPACE = 5000


def batch_of(step: int, rank: int, pooled: bool) -> tuple[np.ndarray, ...]:
    """Rank ``rank``'s batch at ``step`` (any rank can compute any rank's)."""
    rng = np.random.default_rng(1000 * step + rank)
    n = 40
    keys = rng.integers(0, KEY_SPACE // 10, n) * 7 % KEY_SPACE  # repeats across ranks
    if not pooled:
        return keys, rng.normal(size=(n, DIM)).astype(np.float32)
    sizes = rng.integers(0, 4, 16)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    ids = rng.choice(keys, int(offsets[-1]))
    weights = rng.uniform(0.5, 2.0, len(ids)).astype(np.float32)
    grads = rng.normal(size=(16, DIM)).astype(np.float32)
    return ids, offsets, weights, grads


def union(step: int, pooled: bool) -> tuple[np.ndarray, ...]:
    parts = [batch_of(step, r, pooled) for r in range(SIZE)]
    if not pooled:
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    ids = np.concatenate([p[0] for p in parts])
    offs, base = [np.zeros(1, np.int64)], 0
    for p in parts:
        offs.append(p[1][1:] + base)
        base += p[1][-1]
    return (
        ids,
        np.concatenate(offs),
        np.concatenate([p[2] for p in parts]),
        np.concatenate([p[3] for p in parts]),
    )


def step_both(
    sharded: ShardedTable,
    single: embstore.Table,
    mine: tuple[np.ndarray, ...],
    every: tuple[np.ndarray, ...],
    pooled: bool,
    combiner: str = "sum",
) -> None:
    """One training step: this rank's batch through the ShardedTable (its
    forward checked against the single table's rows), the union of every
    rank's batch through the single Table."""
    if pooled:
        got = sharded.lookup_pooled(mine[0], mine[1], weights=mine[2], combiner=combiner)
        expect = single.lookup_pooled(
            mine[0], mine[1], weights=mine[2], combiner=combiner, insert=False
        )
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-6)
        sharded.apply_pooled_gradients(
            mine[0], mine[1], mine[3], weights=mine[2], combiner=combiner
        )
        single.apply_pooled_gradients(
            every[0], every[1], every[3], weights=every[2], combiner=combiner
        )
    else:
        got = sharded.lookup(mine[0])
        np.testing.assert_allclose(got, single.lookup(mine[0], insert=False), rtol=1e-5, atol=1e-6)
        sharded.apply_gradients(*mine)
        single.apply_gradients(*every)


@pytest.mark.parametrize("partition", ["hash", "mod", "div"])
@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize(
    "opt", [optim.Adam(lr=0.05), optim.Adagrad(lr=0.1)], ids=["adam", "adagrad"]
)
def test_sharded_training_equals_one_table_on_the_union(
    partition: str, pooled: bool, opt: optim.Optimizer
) -> None:
    sharded = ShardedTable(
        DIM,
        optimizer=opt,
        seed=9,
        partition=partition,
        key_space=KEY_SPACE if partition == "div" else None,
    )
    single = embstore.Table(DIM, optimizer=opt, seed=9)
    combiner = "mean" if isinstance(opt, optim.Adagrad) else "sum"
    for step in range(STEPS):
        mine = batch_of(step, RANK, pooled)
        every = union(step, pooled)
        step_both(sharded, single, mine, every, pooled, combiner)
    keys, rows = single.export()
    np.testing.assert_allclose(sharded.lookup(keys, insert=False), rows, rtol=1e-5, atol=1e-6)
    assert len(sharded) == len(single)
    assert sharded.step == single.step == STEPS
    stats = sharded.stats()
    assert sum(stats["rows_per_rank"]) == len(single)
    owners = embstore._core.partition_owners(
        keys, SIZE, partition, KEY_SPACE if partition == "div" else None
    )
    assert stats["rows_per_rank"] == np.bincount(owners, minlength=SIZE).tolist()
    assert sharded.contains(keys).all()


def test_sharded_int8_training_equals_one_int8_table() -> None:
    """dtype="int8" reaches every rank's table; each row's stochastic
    rounding is drawn from (seed, key, step) alone, so the sharded rows equal
    one table's trained on the union: every row within one code step, and
    nearly all bit for bit (a gradient summed across ranks in another order
    may round its last bit otherwise and move a code)."""
    opt = optim.Adam(lr=0.05)
    sharded = ShardedTable(DIM, optimizer=opt, seed=9, dtype="int8")
    single = embstore.Table(DIM, optimizer=opt, seed=9, dtype="int8")
    for step in range(STEPS):
        sharded.apply_gradients(*batch_of(step, RANK, False))
        single.apply_gradients(*union(step, False))
    keys, rows = single.export()
    got = sharded.lookup(keys, insert=False)
    code = (rows.max(axis=1) - rows.min(axis=1)) / 255
    assert np.all(np.abs(got - rows) <= code[:, None] * 1.001 + 1e-7)
    assert np.mean(np.all(got == rows, axis=1)) > 0.99


def test_collection_over_shared_sharded_tables_steps_once() -> None:
    users = ShardedTable(4, optimizer=optim.Adam(lr=0.05), seed=1)
    items = ShardedTable(3, optimizer=optim.Adagrad(lr=0.1), seed=2)
    coll = ShardedCollection(
        {"user": users, "item": items, "hist": items}, combiners={"hist": "mean"}
    )
    ref_u = embstore.Table(4, optimizer=optim.Adam(lr=0.05), seed=1)
    ref_i = embstore.Table(3, optimizer=optim.Adagrad(lr=0.1), seed=2)
    for step in range(5):
        rng = np.random.default_rng(step * 100 + RANK)
        off = np.arange(9, dtype=np.int64)
        b = {
            "user": (rng.integers(0, 50, 8), off),
            "item": (rng.integers(0, 50, 8), off),
            "hist": (rng.integers(0, 50, 16), np.arange(0, 17, 2, dtype=np.int64)),
        }
        out = coll.lookup_pooled(b)
        assert out.shape == (8, 10)
        ref_coll = embstore.Collection(
            {"user": ref_u, "item": ref_i, "hist": ref_i}, combiners={"hist": "mean"}
        )
        np.testing.assert_allclose(
            out, ref_coll.lookup_pooled(b, insert=False), rtol=1e-5, atol=1e-6
        )
        g = np.random.default_rng(step).normal(size=(8, 10)).astype(np.float32)
        coll.apply_pooled_gradients(b, g)
        # The same step on plain tables, over every rank's bags at once.
        all_b = [COMM.allgather(b[f]) for f in ("user", "item", "hist")]

        def cat(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
            ids = np.concatenate([p[0] for p in parts])
            offs, base = [np.zeros(1, np.int64)], 0
            for p in parts:
                offs.append(p[1][1:] + base)
                base += p[1][-1]
            return ids, np.concatenate(offs)

        gs = COMM.allgather(g)
        ref_coll.apply_pooled_gradients(
            {"user": cat(all_b[0]), "item": cat(all_b[1]), "hist": cat(all_b[2])},
            np.concatenate(gs),
        )
    for sharded, ref_t in ((users, ref_u), (items, ref_i)):
        keys, rows = ref_t.export()
        np.testing.assert_allclose(sharded.lookup(keys, insert=False), rows, rtol=1e-5, atol=1e-6)
        assert sharded.step == ref_t.step == 5


def test_a_step_on_the_lookups_batch_moves_only_gradients() -> None:
    """ShardedCollection.apply_pooled_gradients on the batch of the lookup
    just before (the backward) reuses that lookup's plan and routes: it
    sends 4*dim bytes per distinct remote key and nothing else. Where one
    rank changed its ids in place since, every rank routes anew (full cost
    model), and training still equals one Table on the union."""
    dim = 5
    t = ShardedTable(dim, optimizer=optim.SGD(lr=0.1), seed=4)
    ref = embstore.Table(dim, optimizer=optim.SGD(lr=0.1), seed=4)
    coll = ShardedCollection({"a": t, "b": t})
    for changed in (False, True):
        rng = np.random.default_rng(50 * changed + RANK)
        off = np.arange(13, dtype=np.int64)
        b = {"a": (rng.integers(0, 200, 12), off), "b": (rng.integers(100, 300, 12), off)}
        coll.lookup_pooled(b)
        if changed and RANK == 0:
            b["a"][0][:] = rng.integers(300, 400, 12)  # in place: not the same batch
        uniq = np.unique(np.concatenate([b["a"][0], b["b"][0]]))
        remote = int((embstore._core.partition_owners(uniq, SIZE) != RANK).sum())
        every = COMM.allgather(uniq)
        asked = sum(
            int((embstore._core.partition_owners(u, SIZE) == RANK).sum())
            for r, u in enumerate(every)
            if r != RANK
        )
        g = np.random.default_rng(RANK).normal(size=(12, 2 * dim)).astype(np.float32)
        coll.apply_pooled_gradients(b, g)
        counts = 8 * (SIZE - 1)
        if not changed:
            assert t.last_call["sent_bytes"] == 4 * dim * remote
            assert t.last_call["received_bytes"] == 4 * dim * asked
        else:
            assert t.last_call["sent_bytes"] == counts + (8 + 4 * dim) * remote
            assert t.last_call["received_bytes"] == counts + (8 + 4 * dim) * asked
        # The same step on one Table over every rank's batch: the two
        # features' gradients (their columns of g) in one step.
        gs = COMM.allgather(g)
        ids = np.concatenate([np.concatenate(COMM.allgather(b[f][0])) for f in ("a", "b")])
        grads = np.concatenate([np.concatenate([x[:, c : c + dim] for x in gs]) for c in (0, dim)])
        ref.apply_gradients(ids, grads)
    keys, rows = ref.export()
    np.testing.assert_allclose(t.lookup(keys, insert=False), rows, rtol=1e-5, atol=1e-6)


def test_bad_input_on_one_rank_raises_on_every_rank_and_changes_nothing() -> None:
    t = ShardedTable(4, optimizer=optim.SGD(lr=1.0))
    t.apply_gradients(np.arange(10), np.ones((10, 4)))
    before = t.lookup(np.arange(10), insert=False)
    grads = np.ones((10, 4), np.float32)
    if RANK == SIZE - 1:
        grads[3, 2] = np.nan
    with pytest.raises(ValueError, match=r"grads: expected only finite values|refused its input"):
        t.apply_gradients(np.arange(10), grads)
    np.testing.assert_array_equal(t.lookup(np.arange(10), insert=False), before)
    assert t.step == 1
    bad_keys = np.array([1.5]) if RANK == 0 else np.arange(3)
    with pytest.raises((TypeError, ValueError)):
        t.lookup(bad_keys)
    assert len(t) == 10


def test_mismatched_configuration_is_refused_on_every_rank() -> None:
    with pytest.raises(ValueError, match=r"configuration differs across ranks in \['dim'\]"):
        ShardedTable(4 if RANK == 0 else 5, optimizer=optim.SGD(lr=1.0))
    with pytest.raises(ValueError, match=r"differs across ranks in \['optimizer'\]"):
        ShardedTable(4, optimizer=optim.SGD(lr=1.0 + (RANK > 0)))
    with pytest.raises(ValueError, match="partition"):
        ShardedTable(4, partition="hash" if RANK else "banana")
    with pytest.raises(ValueError, match=r"keys: expected keys in \[0, 100\)"):
        ShardedTable(4, partition="div", key_space=100).lookup([5, 100 + RANK])


def test_bytes_moved_equal_the_cost_model() -> None:
    """Per call a rank sends 8 bytes of count to each other rank, 8 bytes per
    distinct key owned elsewhere, and 4*dim bytes per row it returns to (or
    gradient it sends to) another rank; a step on the batch of the lookup
    before sends its gradients only."""
    dim = 5
    t = ShardedTable(dim, optimizer=optim.SGD(lr=0.1))
    rng = np.random.default_rng(RANK)
    keys = rng.integers(0, 300, 200)
    uniq = np.unique(keys)
    owners = embstore._core.partition_owners(uniq, SIZE)
    remote = int((owners != RANK).sum())
    every = COMM.allgather(uniq)
    asked_of_me = sum(
        int((embstore._core.partition_owners(u, SIZE) == RANK).sum())
        for r, u in enumerate(every)
        if r != RANK
    )
    counts = 8 * (SIZE - 1)
    t.lookup(keys)
    assert t.last_call["sent_bytes"] == counts + 8 * remote + 4 * dim * asked_of_me
    assert t.last_call["received_bytes"] == counts + 8 * asked_of_me + 4 * dim * remote
    # A step on the lookup's batch: the owners hold its keys, only
    # gradients move.
    t.apply_gradients(keys, np.ones((len(keys), dim)))
    assert t.last_call["sent_bytes"] == 4 * dim * remote
    assert t.last_call["received_bytes"] == 4 * dim * asked_of_me
    # Another batch (the same keys reordered): the keys go too.
    t.apply_gradients(keys[::-1], np.ones((len(keys), dim)))
    assert t.last_call["sent_bytes"] == counts + (8 + 4 * dim) * remote
    assert t.last_call["received_bytes"] == counts + (8 + 4 * dim) * asked_of_me


@pytest.mark.parametrize(
    "admission",
    [embstore.policy.ProbabilityFilter(0.5), embstore.policy.CountFilter(3, width=1 << 16)],
    ids=["probability", "count"],
)
def test_ttl_and_admission_mean_the_same_when_sharded(admission: embstore.policy.Admission) -> None:
    """Admission (per key and call) and TTL decide the same whether one Table
    or N ranks hold the rows, though each rank deduplicates its batch."""
    kwargs = dict(
        optimizer=optim.Adagrad(lr=0.1),
        seed=4,
        admission=admission,
        ttl_steps=3,
    )
    sharded = ShardedTable(DIM, **kwargs)  # type: ignore[arg-type]
    single = embstore.Table(DIM, **kwargs)  # type: ignore[arg-type]
    for step in range(STEPS):
        mine = batch_of(step, RANK, False)
        every = union(step, False)
        sharded.apply_gradients(*mine)
        single.apply_gradients(*every)
        evicted = np.concatenate(COMM.allgather(sharded.evict()))
        assert np.sort(evicted).tolist() == single.evict().tolist()
    keys, rows = single.export()
    assert len(sharded) == len(single) > 0
    assert sharded.contains(keys).all()
    np.testing.assert_allclose(sharded.lookup(keys, insert=False), rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("stack", ["cache", "cache-factory", "table"])
def test_stacked_tiers_train_to_the_rows_of_one_table(pooled: bool, stack: str) -> None:
    """ShardedTable(local=DeviceCache(Table)) (NumPy device arrays here), the
    same built by a factory of the agreed seed, and ShardedTable(local=Table):
    with far fewer cache rows than keys, training equals one Table; and the
    stacked tier saves a checkpoint one Table loads."""
    opt = optim.Adam(lr=0.05)
    if stack == "cache":
        local: object = DeviceCache(embstore.Table(DIM, optimizer=opt, seed=9), 16, xp=XP)
    elif stack == "cache-factory":
        local = lambda seed: DeviceCache(  # noqa: E731
            embstore.Table(DIM, optimizer=opt, seed=seed), 16, xp=XP
        )
    else:
        local = embstore.Table(DIM, optimizer=opt, seed=9)
    sharded = ShardedTable(DIM, local=local, **({"seed": 9} if stack == "cache-factory" else {}))
    single = embstore.Table(DIM, optimizer=opt, seed=9)
    for step in range(STEPS):
        mine = batch_of(step, RANK, pooled)
        every = union(step, pooled)
        step_both(sharded, single, mine, every, pooled)
    stats = sharded.stats()
    if stack != "table":
        assert stats["evictions"] > 0
        print(f"device cache on {XP.__name__}")
    keys, rows = single.export()
    np.testing.assert_allclose(sharded.lookup(keys, insert=False), rows, rtol=1e-5, atol=1e-6)
    assert len(sharded) == len(single)
    path = COMM.bcast(tempfile.mkdtemp() if RANK == 0 else None)
    sharded.save(path)
    loaded = embstore.Table.load(path)
    np.testing.assert_allclose(loaded.lookup(keys, insert=False), rows, rtol=1e-5, atol=1e-6)


def test_default_seeds_agree_across_ranks_and_differ_between_tables() -> None:
    """Without seed=, every rank uses rank 0's draw of the seed sequence:
    rows equal one Table of that seed; a second table gets another seed."""
    # Ranks may have built different numbers of tables before: skew them.
    for _ in range(RANK):
        embstore.Table(2)
    users = ShardedTable(DIM, optimizer=optim.SGD(lr=0.1))
    items = ShardedTable(DIM, optimizer=optim.SGD(lr=0.1))
    seeds = COMM.allgather((users.local.seed, items.local.seed))
    assert len(set(seeds)) == 1, seeds
    assert users.local.seed != items.local.seed
    keys = np.arange(50, dtype=np.int64)
    ref = embstore.Table(DIM, seed=users.local.seed).lookup(keys, insert=False)
    np.testing.assert_array_equal(users.lookup(keys), ref)
    assert not np.array_equal(users.lookup(keys[5:6]), items.lookup(keys[5:6]))


def test_found_masks_come_from_each_keys_owner() -> None:
    """lookup(insert=False, return_found=True): rows and flags equal one
    Table holding the same rows (every rank inserted its share), for keys
    held on any rank and keys held nowhere; refused with insert=True on
    every rank."""
    sharded = ShardedTable(DIM, optimizer=optim.SGD(lr=0.1), seed=7)
    single = embstore.Table(DIM, optimizer=optim.SGD(lr=0.1), seed=7)
    held = np.arange(0, 400, 3)
    sharded.lookup(held[RANK::SIZE])
    single.lookup(held)
    keys = np.random.default_rng(RANK).integers(0, 600, 64)
    got_rows, got_found = sharded.lookup(keys, insert=False, return_found=True)
    want_rows, want_found = single.lookup(keys, insert=False, return_found=True)
    np.testing.assert_array_equal(got_found, want_found)
    np.testing.assert_array_equal(got_found, np.isin(keys, held))
    np.testing.assert_allclose(got_rows, want_rows, rtol=1e-6)
    with pytest.raises(ValueError, match=r"^return_found: needs insert=False"):
        sharded.lookup(keys, return_found=True)
    assert len(sharded) == held.shape[0]  # rows on all ranks


def test_metrics_read_this_ranks_shard_without_a_collective() -> None:
    """A scrape on one rank alone (the others busy elsewhere) reads this
    rank's shard: it must not wait for the other ranks."""
    metrics = pytest.importorskip("embstore.metrics")
    st = ShardedTable(DIM, optimizer=optim.SGD(lr=0.1), seed=5)
    keys = np.arange(100, dtype=np.int64) + 100 * RANK
    st.lookup(keys)
    st.lookup_pooled(keys[:10], np.array([0, 5, 10]))
    COMM.Barrier()
    if RANK == 0:
        f = metrics.read({"t": st})["t"]
        assert f.rows == len(st.local)
        assert f.counters["inserts"] == len(st.local)
        assert sum(f.latency[1]) == 2  # this rank's two calls
    COMM.Barrier()


def test_a_step_reuses_the_lookups_route_only_where_every_rank_can() -> None:
    """Rank 0 steps on its lookup's batch, the others on another batch: no
    rank reuses the route (a vote), and the rows equal one Table's; then
    every rank steps on its lookup's batch and they still do."""
    sharded = ShardedTable(DIM, optimizer=optim.Adam(lr=0.05), seed=12)
    single = embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=12)
    for step in range(4):
        keys, grads = batch_of(step, RANK, False)
        sharded.lookup(keys)
        for r in range(SIZE):
            single.lookup(batch_of(step, r, False)[0])
        mixed = step % 2 == 0 and RANK != 0
        mine = (keys[::-1], grads) if mixed else (keys, grads)
        sharded.apply_gradients(*mine)
        every_k, every_g = [], []
        for r in range(SIZE):
            k, g = batch_of(step, r, False)
            every_k.append(k[::-1] if step % 2 == 0 and r != 0 else k)
            every_g.append(g)
        single.apply_gradients(np.concatenate(every_k), np.concatenate(every_g))
    keys, rows = single.export()
    np.testing.assert_allclose(sharded.lookup(keys, insert=False), rows, rtol=1e-5, atol=1e-6)
