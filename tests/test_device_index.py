"""The device cache's bucketed hash index (embstore.gpu.index): its hash
against Python's own integer arithmetic, finds and plans against a dict
model, its cost independent of its size, and (on a GPU) the CUDA kernels
against the array-API implementation, bit for bit."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

from embstore.gpu import _xp as X
from embstore.gpu.index import BucketIndex, hash_keys, shape_for

GPU_OK, GPU_WHY = X.gpu_usable()
MASK = (1 << 64) - 1


def splitmix_finalizer(k: int) -> int:
    """splitmix64's finalizer on Python ints (mod 2**64): the oracle."""
    z = k & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


@pytest.fixture(params=["numpy", "array_api_strict", "torch"])
def xp(request: pytest.FixtureRequest) -> ModuleType:
    import importlib

    # The namespace the cache itself would use (array-api-compat's for torch).
    return X.namespace(importlib.import_module(request.param))


def test_hash_equals_python_integer_arithmetic(xp: ModuleType) -> None:
    keys = [0, 1, -1, 2**63 - 1, -(2**63), 123456789, -987654321, 7 * 2**40]
    bucket, digest = hash_keys(xp, xp.asarray(np.array(keys, dtype=np.int64)), 1000)
    bucket, digest = X.to_host(xp, bucket), X.to_host(xp, digest)
    for i, k in enumerate(keys):
        h = splitmix_finalizer(k)
        assert int(bucket[i]) == (h & ((1 << 63) - 1)) % 1000
        assert int(digest[i]) == 1 + (h >> 56) % 255


@pytest.mark.parametrize(
    ("rows", "shape"),
    [(1, (1, 1)), (128, (1, 128)), (200, (2, 100)), (1001, (8, 126)), (2_000_000, (15625, 128))],
)
def test_buckets_hold_at_least_the_rows_asked_for(rows: int, shape: tuple[int, int]) -> None:
    assert shape_for(rows) == shape
    b, w = shape
    assert rows <= b * w < rows + b


def fill(index: BucketIndex, keys: np.ndarray, tick: int, policy: str = "lfu") -> np.ndarray:
    """Plans and installs ``keys`` (distinct, missing) as the cache does; the
    slots they got (-1: none)."""
    xp = index.xp
    kd = xp.asarray(keys)
    slots, evict = index.plan(kd, tick, policy)
    s, e = X.to_host(xp, slots), X.to_host(xp, evict)
    got = np.flatnonzero(s >= 0)
    index.install(
        xp.asarray(s[got]),
        xp.asarray(keys[got]),
        xp.ones((len(got),), dtype=xp.int64),
        tick,
        int(e[got].sum()),
    )
    return s


def test_finds_and_plans_follow_a_dict_model(xp: ModuleType) -> None:
    """Random admissions into a 300-slot index: find returns each held key's
    slot and -1 for others; a plan gives a bucket's empty slots first, then
    evicts its least-used unprotected row; the slots never overlap."""
    rng = np.random.default_rng(1)
    index = BucketIndex(xp, 300)
    model: dict[int, int] = {}  # key -> slot
    owner: dict[int, int] = {}  # slot -> key
    for tick in range(1, 40):
        cand = np.unique(rng.integers(-(2**62), 2**62, 60))
        probe = np.concatenate([cand, np.array(list(model)[:30], dtype=np.int64)])
        found = X.to_host(xp, index.find(xp.asarray(probe)))
        for k, s in zip(probe.tolist(), found.tolist(), strict=True):
            assert s == model.get(k, -1)
        last_before = X.to_host(xp, index.last).copy()
        digest_before = X.to_host(xp, index.digest).copy()
        missing = np.array([k for k in cand.tolist() if k not in model], dtype=np.int64)
        slots = fill(index, missing, tick)
        taken = slots[slots >= 0]
        assert len(set(taken.tolist())) == len(taken)
        b, _ = hash_keys(np, missing, index.buckets)
        for k, s, bk in zip(missing.tolist(), slots.tolist(), b.tolist(), strict=True):
            if s < 0:
                continue
            assert s // index.bucket_size == bk  # its own bucket
            if digest_before[s] != 0:  # an eviction: of a row no running call uses
                assert last_before[s] < tick
                del model[owner[s]]
            model[k] = s
            owner[s] = k
        # A bucket's empty slots go before any eviction in it.
        width = index.bucket_size
        for bk in np.unique(b[slots >= 0]).tolist():
            mine = slots[(b == bk) & (slots >= 0)]
            empty_before = int((digest_before[bk * width : (bk + 1) * width] == 0).sum())
            assert int((digest_before[mine] == 0).sum()) == min(len(mine), empty_before)
        assert index.used == len(model)


def test_a_full_bucket_evicts_its_lowest_scoring_row_and_protects_the_running_call(
    xp: ModuleType,
) -> None:
    """One bucket of 4 slots (LFU): a fifth key takes the slot of the row
    with the fewest accesses; rows used by the running call (last >= tick)
    are never given, and with none left the key gets no slot."""
    index = BucketIndex(xp, 4)
    keys = np.array([10, 20, 30, 40], dtype=np.int64)
    assert sorted(fill(index, keys, 1).tolist()) == [0, 1, 2, 3]
    slot = dict(
        zip(keys.tolist(), X.to_host(xp, index.find(xp.asarray(keys))).tolist(), strict=True)
    )
    # 20 and 40 get more accesses; 10 is the least used, then 30.
    index.touch(xp.asarray([slot[20], slot[40], slot[30]]), xp.asarray([5, 5, 1]), 2)
    got = fill(index, np.array([50], dtype=np.int64), 3)
    assert got.tolist() == [slot[10]]
    # Call 4 uses 30 and 50, the least used (protected): 60 takes the slot of
    # 20 or 40 (5 accesses each since call 2; the tie goes to the lower slot).
    index.touch(xp.asarray([slot[30], slot[10]]), xp.asarray([1, 1]), 4)
    got = fill(index, np.array([60], dtype=np.int64), 4)
    assert got.tolist() == [min(slot[20], slot[40])]
    # Every row used by call 5: nothing to give.
    index.touch(xp.asarray(np.arange(4)), xp.ones((4,), dtype=xp.int64), 5)
    assert fill(index, np.array([70], dtype=np.int64), 5).tolist() == [-1]


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_OK, reason=f"no GPU for CuPy: {GPU_WHY}")
@pytest.mark.parametrize("policy", ["lfu", "lru"])
@pytest.mark.parametrize(
    "variant",
    ["tile8-fused", "tile4-fused-by-key", "tile2-linked", "warp-linked", "warp-sorted"],
)
@pytest.mark.parametrize(
    ("rows", "dim"),
    [(5000, 3), (300, 3), (4096, 8)],
    ids=["buckets-40-of-125", "buckets-3-of-100", "buckets-32-of-128"],
)
def test_the_cuda_kernels_equal_the_array_implementation(
    policy: str, variant: str, rows: int, dim: int
) -> None:
    """The same admissions, finds and touches through the CUDA kernels
    (finds by tiles of 8, 4 or 2 lanes or a warp a key; insert_or_assign in
    three kernels, planning by a warp a bucket or a key, or in five;
    planning with misses linked per bucket, or sorted; with 3 buckets the
    linked plans overflow and fall back to sorting;
    buckets of 128 slots read digests 16 bytes at a time, and rows of 8
    floats are copied as float4) and through the array-API code on CuPy
    leave equal arrays and return equal results, bit for bit (ties broken
    by slot in both)."""
    import cupy  # type: ignore[import-not-found, unused-ignore]

    rng = np.random.default_rng(7)
    a = BucketIndex(cupy, rows, kernels=True)
    a._cuda.tile = int(variant[4]) if variant.startswith("tile") else 0
    a.fused = "fused" in variant
    a._cuda.by_bucket = False if variant.endswith("by-key") else None
    a.sort_free = not variant.endswith("sorted")
    b = BucketIndex(cupy, rows, kernels=False)
    table = cupy.asarray(rng.standard_normal((a.capacity, dim)).astype(np.float32))
    held: list[int] = []
    for tick in range(1, 30):
        new = np.unique(rng.integers(-(2**63), 2**63 - 1, 800, dtype=np.int64))
        old = np.array(held[-300:], dtype=np.int64)
        probe = cupy.asarray(np.concatenate([new, old]))
        fa, fb = a.find(probe), b.find(probe)
        cupy.testing.assert_array_equal(fa, fb)
        # A find that copies rows: the rows of the found slots, zeros elsewhere.
        sr, rr = a._cuda.find_rows(probe, a.keys, a.digest, a.buckets, a.bucket_size, table)
        cupy.testing.assert_array_equal(sr, fb)
        want = cupy.where((fb >= 0)[:, None], table[cupy.maximum(fb, 0)], 0.0)
        cupy.testing.assert_array_equal(rr, want)
        ha, hb = a.hash(probe), b.hash(probe)
        cupy.testing.assert_array_equal(ha[0], hb[0])
        cupy.testing.assert_array_equal(ha[1], hb[1])
        hit = cupy.nonzero(fa >= 0)[0]
        counts = cupy.asarray(rng.integers(1, 4, int(hit.shape[0])))
        a.touch(fa[hit], counts, tick)
        b.touch(fb[hit], counts, tick)
        miss = probe[fa < 0]
        sa, ea = a.plan(miss, tick, policy)
        sb, eb = b.plan(miss, tick, policy)
        cupy.testing.assert_array_equal(sa, sb)
        cupy.testing.assert_array_equal(ea, eb)
        ok = cupy.nonzero(sa >= 0)[0]
        for ix in (a, b):
            ix.install(
                sa[ok], miss[ok], cupy.ones(ok.shape, dtype=cupy.int64), tick, int(ea[ok].sum())
            )
        held += cupy.asnumpy(miss[ok]).tolist()
        # insert_or_assign's kernels (no compaction) equal its array code.
        extra = cupy.asarray(np.unique(rng.integers(-(2**63), 2**63 - 1, 200, dtype=np.int64)))
        both = cupy.concatenate([extra, probe[:50]])
        vals = cupy.asarray(rng.standard_normal((int(both.shape[0]), dim)).astype(np.float32))
        za, zb = (
            cupy.zeros((a.capacity, dim), cupy.float32),
            cupy.zeros((b.capacity, dim), cupy.float32),
        )
        ra, da, ea = a.insert_or_assign(both, vals, za, tick)
        rb, db, eb = b.insert_or_assign(both, vals, zb, tick)
        for x, y in ((ra, rb), (da, db), (ea, eb)):
            cupy.testing.assert_array_equal(x, y)
        held += cupy.asnumpy(both[da >= 0]).tolist()
        for name in ("keys", "digest", "count", "last"):
            cupy.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert a.used == b.used
    assert a.used > 0.8 * rows  # full buckets: evictions happened


def test_insert_or_assign_overwrites_held_keys_and_admits_the_others(xp: ModuleType) -> None:
    """insert_or_assign: a held key's row is overwritten in its slot, a new
    key takes a slot and its row, and no admission evicts a key of the same
    call (they count as used by it), on a 2-bucket index past full."""
    index = BucketIndex(xp, 200)
    rows = xp.zeros((index.capacity, 2), dtype=xp.float32)
    model: dict[int, float] = {}
    rng = np.random.default_rng(5)
    for tick in range(1, 12):
        keys = np.unique(rng.integers(0, 500, 60))
        keys = np.concatenate([keys, np.array(list(model)[:20], dtype=np.int64)])
        keys = np.unique(keys)
        vals = rng.standard_normal(len(keys)).astype(np.float32)
        rows, slot, _ = index.insert_or_assign(
            xp.asarray(keys), xp.asarray(np.repeat(vals[:, None], 2, axis=1)), rows, tick
        )
        slot = X.to_host(xp, slot)
        held_before = [k in model for k in keys.tolist()]
        for k, s, v, was in zip(
            keys.tolist(), slot.tolist(), vals.tolist(), held_before, strict=True
        ):
            if was:
                assert s >= 0  # a held key is never refused nor moved out
            if s >= 0:
                model[k] = v
        # Every key the index holds has the row last written for it.
        held = X.to_host(xp, index.keys)[X.to_host(xp, index.digest) != 0]
        got = X.to_host(xp, xp.take(rows, index.find(xp.asarray(held)), axis=0))
        for k, r in zip(held.tolist(), got.tolist(), strict=True):
            assert r[0] == r[1] == model[k]
        for k in set(model) - set(held.tolist()):
            del model[k]  # evicted
        assert index.used == len(model) == len(held)
