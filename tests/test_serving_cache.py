"""ServingCache (embstore.gpu.serving): a device cache in front of a mapped,
followed table. Its rows and hit masks equal the mapped table's own lookups
bit for bit on every namespace (CuPy's kernels too, on a GPU); it admits the
keys it misses and then serves them from the device; after a refresh (its
own, or the table's background follow) no lookup returns a row of the
version before; bad arguments are refused by name."""

from __future__ import annotations

import importlib
import pathlib
import time
from types import ModuleType

import numpy as np
import pytest

import embstore
from embstore.gpu import ServingCache
from embstore.gpu import _xp as X

from .test_mapped import DIM
from .test_mapped_refresh import churn, publish

GPU_OK, GPU_WHY = X.gpu_usable()


def namespaces() -> list[object]:
    out: list[object] = ["numpy", "array_api_strict", "torch"]
    out.append(
        pytest.param(
            "cupy",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=f"no GPU: {GPU_WHY}")],
        )
    )
    return out


@pytest.fixture(params=namespaces())
def xp(request: pytest.FixtureRequest) -> ModuleType:
    return X.namespace(importlib.import_module(request.param))


def served(tmp_path: pathlib.Path, follow: float | None = None, dim: int = DIM) -> tuple:
    """A trained table of 2,000 keys published at a path, and the path mapped."""
    t = embstore.Table(dim, optimizer=embstore.optim.Adagrad(lr=0.1), seed=3)
    rng = np.random.default_rng(0)
    k = np.arange(2_000, dtype=np.int64) * 7 - 3_000
    t.lookup(k)
    t.apply_gradients(k, rng.standard_normal((k.size, dim)).astype(np.float32))
    path = tmp_path / "serve"
    t.save(path, with_optimizer=False)
    return t, path, embstore.MappedTable(path, follow=follow)


def host(xp: ModuleType, a: object) -> np.ndarray:
    return np.asarray(embstore.gpu.to_numpy(a))


def zipf_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    """Keys of the table (ranks by Zipf 1.1 over 2,000) and a tenth unknown."""
    r = np.minimum(rng.zipf(1.1, n), 2_000) - 1
    k = r * 7 - 3_000
    unknown = rng.random(n) < 0.1
    return np.where(unknown, rng.integers(10**6, 10**7, n), k).astype(np.int64)


def test_rows_and_masks_equal_the_mapped_tables_and_hits_come_from_the_device(
    xp: ModuleType, tmp_path: pathlib.Path
) -> None:
    """100 lookups of 300 Zipf keys (repeats and unknown keys included)
    through a cache of a fifth of the rows: each call's rows and found mask
    equal the mapped table's (default "init" and "zeros"); the cache fills,
    and its hits are most of the keys once it has."""
    _, _, mapped = served(tmp_path)
    cache = ServingCache(mapped, 400, xp=xp)
    rng = np.random.default_rng(1)
    for i in range(100):
        keys = zipf_keys(rng, 300)
        default = "zeros" if i % 2 else "init"
        want, want_found = mapped.lookup(keys, default=default, return_found=True)
        arg = xp.asarray(keys) if i % 3 == 0 else keys  # device and host keys
        got, found = cache.lookup(arg, default=default, return_found=True)
        np.testing.assert_array_equal(host(xp, got), want)
        np.testing.assert_array_equal(host(xp, found), want_found)
    s = cache.stats()
    assert s["lookups"] == 30_000
    assert s["rows_cached"] > 0.9 * cache.capacity
    assert s["admitted"] >= s["rows_cached"]
    assert s["queued"] == 0
    # The cached rows on the device are the table's rows of the keys the
    # slot map says they hold.
    keys, slots = cache._slots.items()
    np.testing.assert_array_equal(host(xp, cache._rows)[slots], mapped.lookup(keys))
    late = cache.stats()["hits"]
    for _ in range(20):
        cache.lookup(zipf_keys(rng, 300))
    assert (cache.stats()["hits"] - late) / 6_000 > 0.6


@pytest.mark.parametrize("how", ["refresh", "follow"])
def test_no_row_is_served_stale_after_a_refresh(
    xp: ModuleType, tmp_path: pathlib.Path, how: str
) -> None:
    """The trainer publishes 6 times (rows trained, removed, new ones):
    after each refresh returns (the cache's own, or the table's background
    follow seen through its version), every lookup through the cache equals
    the published table: no cached row of a version before, a removed key
    not found."""
    t, path, mapped = served(tmp_path, follow=0.05 if how == "follow" else None)
    cache = ServingCache(mapped, 4_000, xp=xp)
    every = np.arange(2_600, dtype=np.int64) * 7 - 3_000
    rng = np.random.default_rng(2)
    for _ in range(3):
        cache.lookup(every)
    assert cache.stats()["rows_cached"] == 2_000  # every key the table holds
    for r in range(6):
        churn_keys = np.arange(-3_000, 15_200, 7, dtype=np.int64)
        churn(t, rng)
        t.remove(churn_keys[r * 40 : r * 40 + 40])
        v = mapped.version
        publish(t, path)
        if how == "refresh":
            assert cache.refresh() is True
        else:
            deadline = time.monotonic() + 20
            while mapped.version == v:
                assert time.monotonic() < deadline, "the follow thread never refreshed"
                time.sleep(0.01)
        want, want_found = t.lookup(every, insert=False, default="zeros", return_found=True)
        got, found = cache.lookup(every, default="zeros", return_found=True)
        np.testing.assert_array_equal(host(xp, found), want_found)
        np.testing.assert_array_equal(host(xp, got), want)
    s = cache.stats()
    assert s["revalidations"] == 6
    assert s["version"] == mapped.version
    mapped.close()


def test_a_refresh_reads_the_cached_rows_again_in_blocks(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With revalidation blocks of 64 rows (2,000 cached): after publishes
    that change, remove and add rows, every lookup equals the table, and a
    removed key leaves the cache."""
    from embstore.gpu import serving

    monkeypatch.setattr(serving, "REVALIDATE_BLOCK", 64)
    t, path, mapped = served(tmp_path)
    cache = ServingCache(mapped, 4_000, xp=np)
    every = np.arange(2_600, dtype=np.int64) * 7 - 3_000
    cache.lookup(every)
    cache.lookup(every)
    rng = np.random.default_rng(7)
    for r in range(3):
        churn(t, rng)
        gone = every[r * 50 : r * 50 + 50]
        t.remove(gone)
        publish(t, path)
        assert cache.refresh() is True
        assert not np.isin(gone, cache.cached_keys()).any()
        want, want_found = t.lookup(every, insert=False, default="zeros", return_found=True)
        got, found = cache.lookup(every, default="zeros", return_found=True)
        np.testing.assert_array_equal(found, want_found)
        np.testing.assert_array_equal(got, want)


class ReadOnlyTier:
    """A read-only tier of the user's own (not an embstore.MappedTable):
    its lookups are the mapped table's, through Python."""

    writable = False

    def __init__(self, mapped: embstore.MappedTable) -> None:
        self._m = mapped
        self.dim = mapped.dim

    @property
    def version(self) -> int:
        return int(self._m.version)

    def refresh(self) -> bool:
        return bool(self._m.refresh())

    def lookup(self, keys: np.ndarray, *, default: object = "init", return_found: bool = False):
        return self._m.lookup(keys, default=default, return_found=return_found)


def test_a_tier_of_the_users_own_is_served_through_python(tmp_path: pathlib.Path) -> None:
    """A read-only tier that is not an embstore.MappedTable (the slots and
    admissions chosen by separate native calls, the misses from its own
    lookup): rows and masks equal the table's, misses admitted, hits
    served from the cache."""
    _, _, mapped = served(tmp_path)
    cache = ServingCache(ReadOnlyTier(mapped), 400, xp=np)
    assert cache._native is None
    rng = np.random.default_rng(8)
    for i in range(40):
        keys = zipf_keys(rng, 300)
        default = "zeros" if i % 2 else "init"
        want, want_found = mapped.lookup(keys, default=default, return_found=True)
        got, found = cache.lookup(keys, default=default, return_found=True)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(found, want_found)
    s = cache.stats()
    assert s["admitted"] >= s["rows_cached"] > 0.9 * cache.capacity
    assert s["hit_rate"] > 0.4


def test_bad_arguments_are_refused_by_name(tmp_path: pathlib.Path) -> None:
    t, _, mapped = served(tmp_path)
    with pytest.raises(TypeError, match="table: expected a read-only table"):
        ServingCache(t, 10)
    with pytest.raises(ValueError, match="rows: expected an int >= 1"):
        ServingCache(mapped, 0)
    with pytest.raises(ValueError, match="policy: expected 'lfu' or 'lru'"):
        ServingCache(mapped, 10, policy="fifo")
    with pytest.raises(ValueError, match="admit_batch: expected an int >= 1"):
        ServingCache(mapped, 10, admit_batch=0)
    cache = ServingCache(mapped, 10, xp=np)
    with pytest.raises(ValueError, match="keys: expected a 1-D array"):
        cache.lookup(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(TypeError, match="keys: expected an integer array"):
        cache.lookup(np.zeros(2, dtype=np.float32))
    with pytest.raises(TypeError, match="return_found"):
        cache.lookup(np.zeros(2, dtype=np.int64), return_found="yes")  # type: ignore[arg-type]
    assert cache.stats()["lookups"] == 0


def test_serve_into_writes_what_serve_returns_into_the_staging_bytes(
    tmp_path: pathlib.Path,
) -> None:
    """The native call of the CuPy path (``SlotMap.serve_into``) writes into
    a byte buffer exactly what ``SlotMap.serve`` returns for the same calls
    (slots, admissions, the misses' rows and found flags), at the offsets
    it names; a buffer too small is refused by name, the map unchanged."""
    from embstore._core import SlotMap, staging_bytes

    _, _, mapped = served(tmp_path)
    a, b = SlotMap(300), SlotMap(300)
    rng = np.random.default_rng(6)
    for tick in range(1, 30):
        keys = zipf_keys(rng, 700 if tick % 2 else 100)  # partitions in parallel, then not
        src, _, _, rows, found, slot, row = a.serve(keys, tick, mapped._inner, "zeros")
        buf = np.zeros(staging_bytes(keys.size, DIM), np.uint8)
        m, n_adm, slot_at, row_at, rows_at, found_at, total = b.serve_into(
            keys, tick, mapped._inner, buf, "zeros", None, True
        )
        assert (m, n_adm) == (rows.shape[0], slot.size)
        assert total <= buf.size
        np.testing.assert_array_equal(buf[: src.nbytes].view(np.int32), src)
        np.testing.assert_array_equal(buf[slot_at : slot_at + slot.nbytes].view(np.int32), slot)
        np.testing.assert_array_equal(buf[row_at : row_at + row.nbytes].view(np.int32), row)
        np.testing.assert_array_equal(
            buf[rows_at : rows_at + rows.nbytes].view(np.float32).reshape(rows.shape), rows
        )
        np.testing.assert_array_equal(buf[found_at : found_at + m].view(bool), found)
    assert len(a) == len(b) > 250
    keys = np.arange(100, dtype=np.int64)
    before = b.items()
    with pytest.raises(ValueError, match="staging: expected at least"):
        b.serve_into(keys, 99, mapped._inner, np.zeros(10, np.uint8))
    np.testing.assert_array_equal(b.items()[0], before[0])


def test_admit_batch_is_deprecated_and_still_admits_in_batches(tmp_path: pathlib.Path) -> None:
    """The deprecated ``admit_batch`` warns, and still queues missed keys
    and admits them a batch at a time, rows equal to the table's."""
    _, _, mapped = served(tmp_path)
    with pytest.warns(DeprecationWarning, match="admit_batch"):
        cache = ServingCache(mapped, 400, xp=np, admit_batch=500)
    rng = np.random.default_rng(5)
    for _ in range(12):
        keys = zipf_keys(rng, 300)
        got, found = cache.lookup(keys, return_found=True)
        want, want_found = mapped.lookup(keys, return_found=True)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(found, want_found)
        s = cache.stats()
        assert 0 <= s["queued"] < 500
        assert s["rows_cached"] <= s["admitted"]
    assert 1 <= cache.stats()["admissions"] < 12


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_OK, reason=f"no GPU for CuPy: {GPU_WHY}")
def test_the_kernel_path_equals_the_array_path_on_cupy(tmp_path: pathlib.Path) -> None:
    """The same stream through a cache using the serve_rows8 kernel and one
    using array operations on CuPy (rows of 8 floats: float4 copies; keys
    on the host and on the device): equal rows, masks, slots and cached
    rows."""
    import cupy  # type: ignore[import-not-found, unused-ignore]

    _, _, mapped = served(tmp_path, dim=8)
    a = ServingCache(mapped, 300, xp=cupy)
    b = ServingCache(mapped, 300, xp=cupy)
    b.kernels = False
    rng = np.random.default_rng(4)
    for i in range(60):
        keys = zipf_keys(rng, 500)
        arg = cupy.asarray(keys) if i % 4 == 0 else keys
        ra, fa = a.lookup(arg, return_found=True)
        rb, fb = b.lookup(keys, return_found=True)
        cupy.testing.assert_array_equal(ra, rb)
        cupy.testing.assert_array_equal(fa, fb)
        np.testing.assert_array_equal(host(cupy, ra), mapped.lookup(keys))
    ka, sa = a._slots.items()
    kb, sb = b._slots.items()
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_array_equal(sa, sb)
    cupy.testing.assert_array_equal(a._rows, b._rows)
    assert a.stats() == b.stats()
