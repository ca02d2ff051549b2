"""A DeviceCache over a table of 8-bit rows (``dtype="int8"``): rows held on
the device as the table stores them, trained there by the table's formula
(stochastic rounding by the stream of (seed, key, step)), and moved between
the two as stored. Training through a cache far smaller than the key set
leaves the table's stored rows equal to training on the table alone, on
every array backend here; ``Table.lookup_with_state(stored=True)`` and
``write_back(stored=True)`` round-trip rows bit for bit and refuse bad
rows without changing anything; a ServingCache over a mapped 8-bit
checkpoint (the other form: rows decoded on the device) serves its rows."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import ModuleType

import numpy as np
import pytest

import embstore
from embstore import optim
from embstore.gpu import DeviceCache
from embstore.gpu import _xp as X
from embstore.gpu._int8 import words
from tests.conftest import GPU_OK, GPU_WHY, assert_same, snapshot

DIM = 10  # three words of codes (two bytes of padding), then scale and offset


def stored(t: embstore.Table, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows, state = t.lookup_with_state(keys, insert=False, stored=True)
    return rows, state


OPTIMIZERS = [optim.SGD(lr=0.5), optim.Adam(lr=0.02), optim.RowWiseAdagrad(lr=0.1)]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("pooled", [False, True], ids=["plain", "pooled"])
def test_training_int8_rows_through_the_cache_equals_the_table(
    xp: ModuleType, opt: optim.Optimizer, pooled: bool
) -> None:
    """60 keys through an 8-row cache (evictions every step), 20 steps: each
    lookup equals the table trained alone (a pooled one to float rounding:
    the device sums in its own order), and after a flush every stored
    row (codes, scale, offset) and its state are the same bytes.

    On the host namespaces (NumPy, array-api-strict) the arithmetic is the
    core's, so the bytes are equal. torch's and CuPy's float32 steps may
    differ from the core's by an ulp (torch's vectorized division, the
    GPU's fused multiply-adds, a pooled gradient summed in another order),
    and where an ulp crosses a stochastic rounding point a code moves by
    one step of its row: there rows agree within 3 steps of their row's
    scale and at most 2% of the codes differ (rounding to nearest instead
    of the table's stream moves about half of them)."""
    behind = embstore.Table(DIM, dtype="int8", optimizer=opt, seed=3)
    direct = embstore.Table(DIM, dtype="int8", optimizer=opt, seed=3)
    cache = DeviceCache(behind, 8, xp=xp)
    name = getattr(cache.xp, "__name__", "")
    exact = "numpy" in name or "array_api_strict" in name
    rng = np.random.default_rng(5)

    def steps(keys: np.ndarray) -> np.ndarray:
        """Each key's row's quantization step (its scale), as a column."""
        w, _ = stored(direct, keys)
        return np.ascontiguousarray(w[:, -8:-4]).view(np.float32)

    def same(got: np.ndarray, want: np.ndarray, keys: np.ndarray) -> None:
        if exact:
            np.testing.assert_array_equal(got, want)
        else:
            assert (np.abs(got - want) <= 3 * steps(keys) + 1e-6).all(), (got, want)

    for _ in range(20):
        if pooled:
            offsets = np.concatenate([[0], np.cumsum(rng.integers(1, 4, 12))]).astype(np.int64)
            ids = rng.integers(-30, 30, int(offsets[-1])) * 7919
            grads = rng.standard_normal((12, DIM)).astype(np.float32)
            got = X.to_host(cache.xp, cache.lookup_pooled(ids, offsets))
            # Summed on the device in another order than the core's: to float
            # rounding (the rows summed are the same, as the end checks).
            want = direct.lookup_pooled(ids, offsets)
            if exact:
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
            else:  # each bag within 3 steps of each of its rows
                bag = np.add.reduceat(3 * steps(ids)[:, 0], offsets[:-1])[:, None]
                assert (np.abs(got - want) <= bag + 1e-5).all(), (got, want)
            cache.apply_pooled_gradients(ids, offsets, grads)
            direct.apply_pooled_gradients(ids, offsets, grads)
        else:
            keys = rng.integers(-30, 30, 16) * 7919
            grads = rng.standard_normal((16, DIM)).astype(np.float32)
            same(X.to_host(cache.xp, cache.lookup(keys)), direct.lookup(keys), keys)
            cache.apply_gradients(keys, grads)
            direct.apply_gradients(keys, grads)
    assert cache.stats()["evictions"] > 0
    cache.flush()
    keys = np.arange(-30, 30) * 7919
    (wa, sa), (wb, sb) = stored(behind, keys), stored(direct, keys)
    assert wa.shape == (keys.size, 4 * words(DIM))
    if exact:
        np.testing.assert_array_equal(wa, wb)
        np.testing.assert_array_equal(sa, sb)
    else:
        same(behind.lookup(keys, insert=False), direct.lookup(keys, insert=False), keys)
        moved = (wa[:, :DIM] != wb[:, :DIM]).mean()
        assert moved <= 0.02, f"{moved:.1%} of the codes differ"
        np.testing.assert_allclose(sa, sb, rtol=1e-5, atol=1e-6)
    assert behind.step == direct.step == 20


def test_the_cache_holds_int8_rows_in_their_stored_bytes() -> None:
    """An int8 cache's arrays hold words(dim) float32 words a row (18 at dim
    64, against 64 for float32 rows), as its stats count them."""
    f32 = DeviceCache(embstore.Table(64, optimizer=optim.SGD(lr=0.1)), 256, xp=np)
    i8 = DeviceCache(embstore.Table(64, dtype="int8", optimizer=optim.SGD(lr=0.1)), 256, xp=np)
    assert words(64) == 18
    saved = f32.stats()["bytes"] - i8.stats()["bytes"]
    # Row memory of the tables themselves (empty) differs by nothing.
    assert saved == f32.capacity * 4 * (64 - 18), saved


def test_rounding_to_nearest_in_the_process_is_the_caches_too() -> None:
    """With EMBSTORE_INT8_ROUNDING=nearest (read once per process) the
    table's steps round to nearest, and so do the cache's: the two stay
    equal."""
    code = textwrap.dedent(
        """
        import numpy as np, embstore
        from embstore import optim, _core
        from embstore.gpu import DeviceCache
        assert not _core.int8_stochastic_steps()
        a = embstore.Table(6, dtype="int8", optimizer=optim.Adam(lr=0.05), seed=1)
        b = embstore.Table(6, dtype="int8", optimizer=optim.Adam(lr=0.05), seed=1)
        c = DeviceCache(a, 4, xp=np)
        rng = np.random.default_rng(0)
        for _ in range(10):
            k = rng.integers(0, 20, 8)
            g = rng.standard_normal((8, 6)).astype(np.float32)
            c.apply_gradients(k, g)
            b.apply_gradients(k, g)
        c.flush()
        k = np.arange(20)
        assert (a.lookup(k, insert=False) == b.lookup(k, insert=False)).all()
        print("ok")
        """
    )
    env = {**os.environ, "EMBSTORE_INT8_ROUNDING": "nearest"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok", out.stdout


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_stored_rows_round_trip_bit_for_bit(dtype: str) -> None:
    """Rows read as stored and written back into another table are the same
    bytes there, and read the same floats, for every row format."""
    t = embstore.Table(7, dtype=dtype, optimizer=optim.Adam(lr=0.1), seed=2)
    keys = np.arange(40) * 31
    t.apply_gradients(keys, np.random.default_rng(1).standard_normal((40, 7)).astype(np.float32))
    rows, state = t.lookup_with_state(keys, insert=False, stored=True)
    assert rows.dtype == np.uint8
    u = embstore.Table(7, dtype=dtype, optimizer=optim.Adam(lr=0.1), seed=2)
    u.write_back(keys, rows, state, stored=True)
    again, st2 = u.lookup_with_state(keys, insert=False, stored=True)
    np.testing.assert_array_equal(again, rows)
    np.testing.assert_array_equal(st2, state)
    np.testing.assert_array_equal(u.lookup(keys), t.lookup(keys))
    # Into a transfer buffer: the same bytes as float32 words.
    width = rows.shape[1] // 4
    buf = np.zeros(40 * (width + state.shape[1]), np.float32)
    w, _ = t.lookup_with_state(keys, insert=False, stored=True, out=buf)
    np.testing.assert_array_equal(w.view(np.uint8), rows)


def test_bad_stored_rows_are_refused_and_change_nothing() -> None:
    t = embstore.Table(8, dtype="int8", optimizer=optim.SGD(lr=0.1), seed=2)
    keys = np.arange(3)
    t.lookup(keys)
    rows, state = t.lookup_with_state(keys, stored=True)
    before = snapshot(t)
    scale_at = 4 * (words(8) - 2)
    bad_scale = rows.copy()
    bad_scale[1, scale_at : scale_at + 4] = np.array([-1.0], np.float32).view(np.uint8)
    with pytest.raises(ValueError, match=r"^rows: expected an 8-bit row's scale"):
        t.write_back(keys, bad_scale, state, stored=True)
    bad_offset = rows.copy()
    bad_offset[2, scale_at + 4 : scale_at + 8] = np.array([np.inf], np.float32).view(np.uint8)
    with pytest.raises(ValueError, match=r"^rows: expected an 8-bit row's scale"):
        t.write_back(keys, bad_offset, state, stored=True)
    with pytest.raises(ValueError, match=r"^rows: expected stored rows"):
        t.write_back(keys, rows[:, :-1], state, stored=True)
    with pytest.raises(ValueError, match=r"^rows: expected 3 rows"):
        t.write_back(keys, rows[:2], state, stored=True)
    assert_same(before, snapshot(t))


def test_a_serving_cache_over_an_int8_mapped_table_serves_its_decoded_rows(
    xp: ModuleType, tmp_path: object
) -> None:
    """The serving form: a ServingCache in front of a mapped checkpoint of
    8-bit rows holds them decoded (float32 on the device) and serves what
    the mapped table reads, bit for bit, repeats and unknown keys
    included, from its own rows once they are cached."""
    import pathlib

    from embstore.gpu import ServingCache

    path = pathlib.Path(str(tmp_path)) / "int8"
    t = embstore.Table(DIM, dtype="int8", optimizer=optim.Adam(lr=0.05), seed=4)
    keys = np.arange(500, dtype=np.int64) * 3
    rng = np.random.default_rng(2)
    t.apply_gradients(keys, rng.standard_normal((500, DIM)).astype(np.float32))
    t.save(path, with_optimizer=False)
    mapped = embstore.MappedTable(path)
    cache = ServingCache(mapped, 128, xp=X.namespace(xp))
    for _ in range(20):
        k = np.concatenate([rng.choice(keys, 60), [7, 7, -1]]).astype(np.int64)
        np.testing.assert_array_equal(X.to_host(cache.xp, cache.lookup(k)), mapped.lookup(k))
    np.testing.assert_array_equal(mapped.lookup(keys), t.lookup(keys))
    assert cache.stats()["hits"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_OK, reason=f"no GPU for CuPy: {GPU_WHY}")
@pytest.mark.parametrize("dim", [1, 10, 64, 129])
@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
def test_the_cuda_kernels_equal_the_array_code_bit_for_bit(dim: int, stochastic: bool) -> None:
    """On CuPy the cache decodes and encodes 8-bit rows with the kernels of
    gpu/_cuda_int8.py: their bytes equal the array code's (which equals the
    table's), for rows of every sign and scale, a constant row, a row with
    one weight, codes padded to whole words, both rounding modes."""
    import cupy  # type: ignore[import-not-found, unused-ignore]

    from embstore.gpu._int8 import Int8Rows

    xp = X.namespace(cupy)
    fast, ref = Int8Rows(xp, dim, 11), Int8Rows(xp, dim, 11, kernels=False)
    assert fast.kernels is not None
    assert ref.kernels is None
    fast.stochastic = ref.stochastic = stochastic
    rng = np.random.default_rng(dim)
    w = rng.standard_normal((3000, dim)).astype(np.float32)
    w *= np.float32(10.0) ** rng.integers(-6, 6, (3000, 1)).astype(np.float32)
    w[7] = 0.25  # a constant row
    keys = rng.integers(-(2**62), 2**62, 3000)
    wd, kd = cupy.asarray(w), cupy.asarray(keys)
    for step in (1, 2, 977):
        a = cupy.asnumpy(fast.encode_step(wd, kd, step))
        b = cupy.asnumpy(ref.encode_step(wd, keys, step))
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    stored_d = cupy.asarray(a)
    slots = cupy.asarray(rng.integers(0, 3000, 5000))
    np.testing.assert_array_equal(
        cupy.asnumpy(fast.decode_at(stored_d, slots)), cupy.asnumpy(ref.decode_at(stored_d, slots))
    )
    np.testing.assert_array_equal(
        cupy.asnumpy(fast.decode(stored_d)), cupy.asnumpy(ref.decode(stored_d))
    )
