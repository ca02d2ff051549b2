"""DeviceCache on every array backend here (NumPy, array-api-strict, torch;
CuPy where a GPU exists): training through a cache far smaller than the key set
equals training on the table, for every optimizer, plain and pooled; the
transfer budget per call; bad input changes nothing."""

from __future__ import annotations

import sys
from types import ModuleType

import numpy as np
import pytest

import embstore
from embstore import optim
from embstore.gpu import DeviceCache
from embstore.gpu import _xp as X
from tests.conftest import GPU_OK, assert_same, snapshot

OPTIMIZERS = [
    optim.SGD(lr=0.1),
    optim.Adagrad(lr=0.1, initial_accumulator_value=0.1),
    optim.RowWiseAdagrad(lr=0.1),
    optim.Adam(lr=0.05),
    optim.AdamW(lr=0.05, weight_decay=0.1),
    optim.Ftrl(lr=0.1, l1=0.01, l2=0.01, beta=0.5),
    # coupled weight decay (g + weight_decay * w) on every optimizer that has it
    optim.SGD(lr=0.1, weight_decay=0.2),
    optim.Adagrad(lr=0.1, initial_accumulator_value=0.1, weight_decay=0.2),
    optim.RowWiseAdagrad(lr=0.1, weight_decay=0.2),
    optim.Adam(lr=0.05, weight_decay=0.2),
    optim.Ftrl(lr=0.1, l1=0.01, l2=0.01, beta=0.5, weight_decay=0.2),
]
DIM = 5


def host(cache: DeviceCache, a: object) -> np.ndarray:
    return X.to_host(cache.xp, a)


def pooled_batch(rng: np.random.Generator, n_bags: int) -> tuple[np.ndarray, ...]:
    sizes = rng.integers(0, 4, n_bags)  # empty, one-id and repeated-id bags
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    ids = rng.integers(-30, 30, int(offsets[-1])) * 7919
    weights = rng.uniform(0.5, 2.0, len(ids)).astype(np.float32)
    grads = rng.standard_normal((n_bags, DIM)).astype(np.float32)
    return ids, offsets, weights, grads


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("pooled", [False, True], ids=["plain", "pooled"])
def test_training_through_the_cache_equals_the_table(
    xp: ModuleType, opt: optim.Optimizer, pooled: bool
) -> None:
    behind = embstore.Table(DIM, optimizer=opt, seed=3)
    direct = embstore.Table(DIM, optimizer=opt, seed=3)
    cache = DeviceCache(behind, 8, xp=xp)  # 60 keys in play: evictions every step
    rng = np.random.default_rng(11)
    combiner = "sqrtn" if isinstance(opt, optim.Ftrl) else "mean"
    for step in range(25):
        if pooled:
            ids, offsets, weights, grads = pooled_batch(rng, 12)
            got = cache.lookup_pooled(ids, offsets, weights=weights, combiner=combiner)
            want = direct.lookup_pooled(ids, offsets, weights=weights, combiner=combiner)
            np.testing.assert_allclose(host(cache, got), want, rtol=1e-5, atol=1e-6)
            cache.apply_pooled_gradients(ids, offsets, grads, weights=weights, combiner=combiner)
            direct.apply_pooled_gradients(ids, offsets, grads, weights=weights, combiner=combiner)
        else:
            keys = rng.integers(-30, 30, 16) * 7919
            grads = rng.standard_normal((16, DIM)).astype(np.float32)
            got = cache.lookup(keys)
            np.testing.assert_allclose(host(cache, got), direct.lookup(keys), rtol=1e-5, atol=1e-6)
            cache.apply_gradients(keys, grads)
            direct.apply_gradients(keys, grads)
        assert behind.step == direct.step == step + 1
    s = cache.stats()
    assert s["evictions"] > 0
    assert s["write_backs"] == s["evictions"]
    # Cached rows on the device equal the table trained directly...
    keys, rows, state = direct.export(with_state=True)
    np.testing.assert_allclose(
        host(cache, cache.lookup(keys, insert=False)), rows, rtol=1e-5, atol=1e-6
    )
    # ...and after flush() the table alone equals it, rows and state.
    cache.flush()
    k2, r2, s2 = behind.export(with_state=True)
    np.testing.assert_array_equal(k2, keys)
    np.testing.assert_allclose(r2, rows, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s2, state, rtol=1e-5, atol=1e-5)


def test_admit_after_and_overflow_train_in_the_table(xp: ModuleType) -> None:
    opt = optim.Adam(lr=0.05)
    behind = embstore.Table(DIM, optimizer=opt, seed=1)
    direct = embstore.Table(DIM, optimizer=opt, seed=1)
    cache = DeviceCache(behind, 6, xp=xp, admit_after=2, policy="lru")
    rng = np.random.default_rng(2)
    for _ in range(15):
        keys = rng.integers(0, 40, 20)  # more distinct keys than rows: overflow
        grads = rng.standard_normal((20, DIM)).astype(np.float32)
        np.testing.assert_allclose(
            host(cache, cache.lookup(keys)), direct.lookup(keys), rtol=1e-5, atol=1e-6
        )
        cache.apply_gradients(keys, grads)
        direct.apply_gradients(keys, grads)
    assert cache.stats()["rows_cached"] <= 6
    cache.flush()
    assert_same(
        tuple(np.round(a, 5) for a in snapshot(behind)),
        tuple(np.round(a, 5) for a in snapshot(direct)),
    )


def test_each_call_makes_at_most_one_copy_each_way(xp: ModuleType) -> None:
    cache = DeviceCache(embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1)), 10, xp=xp)
    rng = np.random.default_rng(0)
    for _ in range(10):
        keys = rng.integers(0, 50, 30)
        before = cache.stats()
        cache.lookup(keys)
        cache.apply_gradients(keys, np.ones((30, DIM), np.float32))
        after = cache.stats()
        assert after["h2d_copies"] - before["h2d_copies"] <= 2  # one per call
        assert after["d2h_copies"] - before["d2h_copies"] <= 2
    s = cache.stats()
    # Device-to-host: evicted rows with their state, and the gradients of
    # keys the cache could not hold (trained in the table); nothing else.
    assert s["table_updates"] > 0
    assert s["d2h_bytes"] == 4 * (s["write_backs"] * 2 * DIM + s["table_updates"] * DIM)
    assert 0.0 < s["hit_rate"] < 1.0
    assert s["rows_cached"] == 10


def test_lookup_without_insert_stores_nothing(xp: ModuleType) -> None:
    table = embstore.Table(DIM, optimizer=optim.SGD(lr=1.0))
    cache = DeviceCache(table, 4, xp=xp)
    out = cache.lookup([1, 2, 3], insert=False)
    np.testing.assert_array_equal(host(cache, out), table.lookup([1, 2, 3], insert=False))
    assert len(table) == 0
    assert cache.stats()["rows_cached"] == 0
    assert host(cache, cache.contains([1])).tolist() == [False]
    cache.lookup([1])
    assert host(cache, cache.contains([1, 2])).tolist() == [True, False]


def test_save_flushes_then_saves(xp: ModuleType, tmp_path) -> None:  # type: ignore[no-untyped-def]
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=0.1))
    cache = DeviceCache(table, 4, xp=xp)
    cache.apply_gradients([1, 2], np.ones((2, DIM), np.float32))
    cache.save(tmp_path / "c")
    loaded = embstore.Table.load(tmp_path / "c")
    np.testing.assert_array_equal(
        loaded.lookup([1, 2], insert=False), host(cache, cache.lookup([1, 2], insert=False))
    )
    assert loaded.step == 1


def test_bad_input_changes_nothing(xp: ModuleType) -> None:
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=0.1))
    cache = DeviceCache(table, 4, xp=xp)
    cache.apply_gradients([1, 2, 3], np.ones((3, DIM), np.float32))
    before = (snapshot(table), cache.stats(), host(cache, cache._rows).copy())
    bad = [
        (lambda: cache.lookup({1: 2}), TypeError, "keys"),  # no array
        (lambda: cache.lookup(xp.asarray([1.0, 2.0])), TypeError, "keys"),  # device floats
        (lambda: cache.apply_gradients([1], xp.ones((2, DIM))), ValueError, "grads"),
        (lambda: cache.lookup(np.array([1.5])), TypeError, "keys"),
        (lambda: cache.lookup(np.array([[1, 2]])), ValueError, "keys"),
        (lambda: cache.apply_gradients([1, 2], np.ones((3, DIM))), ValueError, "grads"),
        (lambda: cache.apply_gradients([1], np.full((1, DIM), np.nan)), ValueError, "grads"),
        (lambda: cache.lookup_pooled([1, 2], [0, 3]), ValueError, "offsets"),
    ]
    for call, exc, arg in bad:
        with pytest.raises(exc, match=rf"^{arg}\b"):
            call()
    after = (snapshot(table), cache.stats(), host(cache, cache._rows))
    assert_same(before[0], after[0])
    assert before[1] == after[1]
    np.testing.assert_array_equal(before[2], after[2])


def test_another_librarys_arrays_come_in_and_go_out_by_dlpack(xp: ModuleType) -> None:
    """torch tensors into a cache of another namespace (on its device: CPU
    tensors for NumPy, CUDA ones for CuPy) are shared by DLPack, and results
    come back as torch tensors, equal to the same calls with the cache's own
    arrays."""
    import torch

    if xp.__name__.startswith("torch") or "strict" in xp.__name__:
        pytest.skip("torch is this cache's own namespace / array-api-strict has no DLPack import")
    device = "cuda" if "cupy" in xp.__name__ else "cpu"
    opt = optim.Adagrad(lr=0.1)
    a = DeviceCache(embstore.Table(DIM, optimizer=opt, seed=2), 4, xp=xp)
    b = DeviceCache(embstore.Table(DIM, optimizer=opt, seed=2), 4, xp=xp)
    rng = np.random.default_rng(4)
    for _ in range(5):
        keys = rng.integers(0, 12, 9)
        grads = rng.standard_normal((9, DIM)).astype(np.float32)
        got = a.lookup(torch.as_tensor(keys, device=device))
        assert isinstance(got, torch.Tensor)
        assert got.device.type == device
        np.testing.assert_array_equal(got.cpu().numpy(), host(b, b.lookup(keys)))
        a.apply_gradients(
            torch.as_tensor(keys, device=device), torch.as_tensor(grads, device=device)
        )
        b.apply_gradients(keys, grads)
        offsets = torch.as_tensor([0, 4, 4, 9], device=device)
        pooled = a.lookup_pooled(torch.as_tensor(keys, device=device), offsets, combiner="mean")
        assert isinstance(pooled, torch.Tensor)
        np.testing.assert_allclose(
            pooled.cpu().numpy(),
            host(b, b.lookup_pooled(keys, [0, 4, 4, 9], combiner="mean")),
            rtol=1e-6,
            atol=1e-7,
        )
    a.flush()
    b.flush()
    assert_same(snapshot(a.table), snapshot(b.table))


def test_device_arrays_never_reach_the_host_on_hits(xp: ModuleType) -> None:
    """A call whose keys are all cached copies nothing either way; a call
    with misses copies once each way; keys and gradients given as device
    arrays are taken as they are."""
    cache = DeviceCache(embstore.Table(DIM, optimizer=optim.Adam(lr=0.1)), 16, xp=xp)
    keys = xp.asarray(np.arange(10, dtype=np.int64))
    g = xp.ones((10, DIM), dtype=xp.float32)
    cache.apply_gradients(keys, g)  # admits all ten
    s0 = cache.stats()
    assert s0["h2d_copies"] == 1  # the fetched rows in
    assert s0["d2h_copies"] == 1  # the missing keys out
    cache.lookup(keys)
    cache.apply_gradients(keys, g)
    cache.lookup_pooled(keys, xp.asarray(np.array([0, 5, 10], dtype=np.int64)))
    s1 = cache.stats()
    for k in ("h2d_copies", "d2h_copies", "index_bytes"):
        assert s1[k] == s0[k], k
    assert s1["hits"] - s0["hits"] == 20


def test_prefetch_brings_the_next_batch_in_and_keeps_the_current_one(xp: ModuleType) -> None:
    """After prefetch(next), a lookup of next is all hits; the rows of the
    batch looked up just before stay cached (the batch still training);
    training through prefetches equals the table; a failed prefetch hands
    its error to the future and changes nothing."""
    opt = optim.Adam(lr=0.05)
    cache = DeviceCache(embstore.Table(DIM, optimizer=opt, seed=6), 8, xp=xp)
    direct = embstore.Table(DIM, optimizer=opt, seed=6)
    rng = np.random.default_rng(3)
    batches = [rng.choice(40, 4, replace=False) for _ in range(12)]
    # Every key has a row first: a prefetch brings rows in, it never makes one.
    cache.table.lookup(np.arange(40))
    direct.lookup(np.arange(40))
    cache.lookup(batches[0])
    direct.lookup(batches[0])
    for i, keys in enumerate(batches):
        nxt = batches[(i + 1) % len(batches)]
        fut = cache.prefetch(nxt)
        g = rng.standard_normal((4, DIM)).astype(np.float32)
        cache.apply_gradients(keys, g)  # after the prefetch: all hits
        direct.apply_gradients(keys, g)
        fut.result(timeout=30)
        before = cache.stats()["misses"]
        np.testing.assert_allclose(
            host(cache, cache.lookup(nxt)), direct.lookup(nxt), rtol=1e-5, atol=1e-6
        )
        assert cache.stats()["misses"] == before, "the prefetched batch missed"
    assert cache.stats()["table_updates"] == 0
    cache.flush()
    ka, ra, sa = cache.table.export(with_state=True)
    kb, rb, sb = direct.export(with_state=True)
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_allclose(ra, rb, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sa, sb, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match=r"^keys\b"):
        cache.prefetch([1.5])


def test_a_prefetch_fetches_and_never_inserts(xp: ModuleType) -> None:
    """At 7e7142d a prefetch of keys the table lacked created their rows
    (found=True and the table grew after a prefetch alone)."""
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=6)
    table.lookup(np.arange(10))
    cache = DeviceCache(table, 8, xp=xp)
    cache.prefetch(np.array([3, 4, 100, 101])).result(timeout=30)
    assert len(table) == 10
    _, found = cache.lookup(np.array([3, 100, 101]), insert=False, return_found=True)
    np.testing.assert_array_equal(np.asarray(host(cache, found)), [True, False, False])
    np.testing.assert_array_equal(np.asarray(host(cache, cache.contains([100]))), [False])
    assert len(table) == 10
    # The held keys it fetched are hits now.
    before = cache.stats()["misses"]
    cache.lookup(np.array([4]))
    assert cache.stats()["misses"] == before


@pytest.mark.parametrize(
    ("kwargs", "exc", "arg"),
    [
        ({"rows": 0}, ValueError, "rows"),
        ({"rows": 2.5}, TypeError, "rows"),
        ({"rows": 4, "policy": "fifo"}, ValueError, "policy"),
        ({"rows": 4, "admit_after": 0}, ValueError, "admit_after"),
        ({"rows": 4, "xp": "numpy"}, TypeError, "xp"),
    ],
)
def test_bad_construction(kwargs: dict, exc: type, arg: str) -> None:
    table = embstore.Table(DIM, optimizer=optim.SGD(lr=1.0))
    with pytest.raises(exc, match=rf"^{arg}\b"):
        DeviceCache(table, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"ttl_steps": 5}, {"ttl_seconds": 60}, {"capacity": 100}, {"capacity_bytes": 1 << 20}],
)
def test_a_table_that_drops_rows_is_refused(kwargs: dict) -> None:
    table = embstore.Table(DIM, optimizer=optim.SGD(lr=1.0), **kwargs)
    with pytest.raises(ValueError, match=r"^table\b"):
        DeviceCache(table, 4, xp=np)


@pytest.mark.parametrize(
    "admission",
    [embstore.policy.CountFilter(2, width=1 << 16), embstore.policy.ProbabilityFilter(0.4)],
    ids=["count", "probability"],
)
def test_the_tables_admission_filter_keeps_its_meaning(xp: ModuleType, admission) -> None:  # type: ignore[no-untyped-def]
    opt = optim.Adagrad(lr=0.1)
    behind = embstore.Table(DIM, optimizer=opt, seed=5, admission=admission)
    direct = embstore.Table(DIM, optimizer=opt, seed=5, admission=admission)
    cache = DeviceCache(behind, 6, xp=xp)
    rng = np.random.default_rng(8)
    for _ in range(20):
        keys = rng.integers(0, 30, 12)
        grads = rng.standard_normal((12, DIM)).astype(np.float32)
        np.testing.assert_allclose(
            host(cache, cache.lookup(keys)), direct.lookup(keys), rtol=1e-5, atol=1e-6
        )
        cache.apply_gradients(keys, grads)
        direct.apply_gradients(keys, grads)
    assert cache.stats()["admissions"] > 0
    cache.flush()
    a, b = snapshot(behind), snapshot(direct)
    np.testing.assert_array_equal(a[0], b[0])  # the same keys were admitted
    for x, y in zip(a[1:], b[1:], strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    assert behind.stats()["admitted"] == direct.stats()["admitted"]


def test_default_namespace_is_cupy_only_with_a_gpu() -> None:
    cache = DeviceCache(embstore.Table(DIM), 4)
    assert X.is_numpy(cache.xp) != GPU_OK


def test_the_cache_says_which_namespace_it_runs_on() -> None:
    cache = DeviceCache(embstore.Table(4, optimizer=optim.SGD(lr=0.1)), rows=8, xp=np)
    assert cache.stats()["xp"] == cache.xp.__name__
    assert f"xp={cache.xp.__name__}" in repr(cache)


def test_cupy_without_a_usable_gpu_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    fake = types.ModuleType("cupy")

    def no_device() -> int:
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_device))  # type: ignore[attr-defined]
    fake.asarray = np.asarray  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(
        RuntimeError, match=r"^xp: cupy was asked for, but CuPy finds no usable GPU"
    ):
        DeviceCache(embstore.Table(4, optimizer=optim.SGD(lr=0.1)), rows=8, xp=fake)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("opt", ["Adam", "Adagrad", "SGD"])
def test_training_through_the_cache_equals_the_table_bit_for_bit_with_repeats(
    dtype: str, opt: str
) -> None:
    """Batches that repeat keys many times (Zipf) and pooled bags with
    weights, on every row format: the cache's rows, written back, equal a
    table trained directly, bit for bit (the repeats summed in float32 in
    batch order as the table sums them; 16-bit rows rounded as the table
    rounds them after every step)."""
    make = {
        "Adam": lambda: optim.Adam(lr=0.01),
        "Adagrad": lambda: optim.Adagrad(lr=0.05),
        "SGD": lambda: optim.SGD(lr=0.1),
    }[opt]
    direct = embstore.Table(8, optimizer=make(), dtype=dtype, seed=4)
    backing = embstore.Table(8, optimizer=make(), dtype=dtype, seed=4)
    cache = DeviceCache(backing, rows=64, xp=np)
    rng = np.random.default_rng(5)
    for step in range(12):
        keys = (rng.zipf(1.3, 300) % 90).astype(np.int64)
        g = rng.normal(size=(300, 8)).astype(np.float32) * np.float32(0.3)
        if step % 3 == 2:  # pooled, weighted, with repeats inside bags
            offsets = np.arange(0, 301, 5)
            w = rng.uniform(0.5, 2.0, 300).astype(np.float32)
            bg = g[:60]
            cache.lookup_pooled(keys, offsets, weights=w, combiner="mean")
            direct.lookup_pooled(keys, offsets, weights=w, combiner="mean")
            cache.apply_pooled_gradients(keys, offsets, bg, weights=w, combiner="mean")
            direct.apply_pooled_gradients(keys, offsets, bg, weights=w, combiner="mean")
        else:
            cache.lookup(keys)
            direct.lookup(keys)
            cache.apply_gradients(keys, g)
            direct.apply_gradients(keys, g)
    cache.flush()
    kd, rd, sd = direct.export(with_state=True)
    kb, rb, sb = backing.export(with_state=True)
    np.testing.assert_array_equal(kd, kb)
    np.testing.assert_array_equal(rd, rb)
    np.testing.assert_array_equal(sd, sb)


def test_a_refused_step_leaves_the_cache_and_table_as_they_were() -> None:
    from embstore.gpu import DeviceCache

    t = embstore.Table(4, optimizer=optim.SGD(lr=1e30), num_shards=2)
    cache = DeviceCache(t, rows=4, xp=np)
    cache.apply_gradients([1, 2, 3, 4], np.ones((4, 4)))  # fills the cache
    cache.flush()
    before = snapshot(t), cache.lookup([1, 2, 3, 4]).copy()
    # A step that would make cached rows inf (lr 1e30 x gradient 1e10).
    with pytest.raises(ValueError, match=r"^grads: this step would make a cached row non-finite"):
        cache.apply_gradients([1, 5], np.full((2, 4), 1e10))
    cache.flush()
    assert np.isfinite(cache.lookup([1, 2, 3, 4, 5])).all()
    after = snapshot(t)
    # Nothing trained: rows as before (key 5 may now be cached or stored; its
    # row is its initializer row either way), step unchanged.
    np.testing.assert_array_equal(cache.lookup([1, 2, 3, 4]), before[1])
    assert after[-1][0] == before[0][-1][0]


@pytest.mark.parametrize("thread", [False, True], ids=["in-line", "on-a-thread"])
def test_a_failed_write_back_loses_no_evicted_row(
    thread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write-back in line, and on a thread of its own beside the fetch
    of misses: its error reaches the caller before any slot changes."""
    from embstore.gpu import DeviceCache
    from embstore.gpu import cache as cache_mod

    monkeypatch.setattr(cache_mod, "WRITE_BACK_THREAD_MIN", 1 if thread else 1 << 30)
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.5), num_shards=2)
    cache = DeviceCache(t, rows=2, xp=np)
    cache.apply_gradients([1, 2], np.ones((2, 4)))
    trained = cache.lookup([1, 2]).copy()
    # The next admission evicts 1 or 2; its write-back to the table fails.
    inner = t._inner

    def failing(*args: object) -> None:
        raise MemoryError("keys: simulated")

    t._inner = _Proxy(inner, assign=failing)  # type: ignore[assignment]
    with pytest.raises(MemoryError):
        cache.lookup([3])
    t._inner = inner
    # Both trained rows survive (the cache kept the one it could not write back).
    np.testing.assert_array_equal(cache.lookup([1, 2]), trained)
    cache.flush()
    np.testing.assert_array_equal(t.lookup([1, 2]), trained)


class _Proxy:
    """A native table with some methods replaced (fault injection)."""

    def __init__(self, inner: object, **replace: object) -> None:
        self.inner = inner
        self._replace = replace

    def __getattr__(self, name: str) -> object:
        if name in self._replace:
            return self._replace[name]
        return getattr(self.inner, name)


@pytest.mark.parametrize("opt", [optim.Adam(lr=0.05), optim.Ftrl(lr=0.1, l1=0.01)], ids=str)
def test_a_write_back_on_a_thread_trains_as_one_in_line(
    opt: optim.Optimizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evicted rows written back on a thread of their own while the misses
    are fetched (every call here, the threshold set to 1) leave the cache,
    the table and every output as the in-line write-back does, bit for
    bit (both against one table trained directly, as in the test above)."""
    from embstore.gpu import cache as cache_mod

    outs: dict[int, list[np.ndarray]] = {}
    for least in (1 << 30, 1):
        monkeypatch.setattr(cache_mod, "WRITE_BACK_THREAD_MIN", least)
        behind = embstore.Table(DIM, optimizer=opt, seed=3)
        cache = DeviceCache(behind, 8, xp=np)
        rng = np.random.default_rng(5)
        got = []
        for _ in range(20):
            keys = rng.integers(-30, 30, 16) * 7919
            got.append(np.asarray(cache.lookup(keys)).copy())
            cache.apply_gradients(keys, rng.standard_normal((16, DIM)).astype(np.float32))
        assert cache.stats()["write_backs"] > 0
        cache.flush()
        k, rows, state = behind.export(with_state=True)
        order = np.argsort(k)
        outs[least] = [*got, k[order], rows[order], state[order]]
    for a, b in zip(outs[1 << 30], outs[1], strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_cache_takes_its_step_number_from_the_table() -> None:
    from embstore.gpu import DeviceCache

    t = embstore.Table(4, optimizer=optim.Adam(lr=0.1), num_shards=2, seed=0)
    cache = DeviceCache(t, rows=2, xp=np)
    cache.apply_gradients([1], np.ones((1, 4)))
    t.apply_gradients([100], np.ones((1, 4)))  # the table, directly, in between
    cache.apply_gradients([1, 7, 8], np.ones((3, 4)))
    assert t.step == 3
    assert cache.stats()["step"] == 3
    ref = embstore.Table(4, optimizer=optim.Adam(lr=0.1), num_shards=2, seed=0)
    ref.apply_gradients([1], np.ones((1, 4)))
    ref.apply_gradients([100], np.ones((1, 4)))
    ref.apply_gradients([1, 7, 8], np.ones((3, 4)))
    cache.flush()
    for k in ([1], [7], [8], [100]):
        np.testing.assert_allclose(t.lookup(k), ref.lookup(k), rtol=1e-6)
