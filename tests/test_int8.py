"""Tables of 8-bit rows (``dtype="int8"``): rows as a NumPy reference of
the same formula gives them (codes to nearest when assigned, stochastic
rounding by a stream of (seed, key, step) when trained), on every SIMD
backend; the same results whatever the shard and thread counts; pooled
lookups against torch's EmbeddingBag over the rows; the row bytes; and what
is refused (checkpoints). Device caches over 8-bit rows:
tests/test_device_cache_int8.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import embstore
from embstore import optim

U64 = np.uint64
MASK = (1 << 64) - 1
GOLDEN = U64(0x9E3779B97F4A7C15)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 (wrapping), as the core's hash.rs."""
    z = (z ^ (z >> U64(30))) * U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> U64(27))) * U64(0x94D049BB133111EB)
    return z ^ (z >> U64(31))


def rounding_stream(seed: int, key: int, step: int) -> np.ndarray:
    """The core's ``rounding_stream(seed, key, step)``."""
    with np.errstate(over="ignore"):
        s = mix64(U64(seed ^ 0xB7E151628AED2A6B) ^ U64(0x6A09E667F3BCC909))
        row = mix64(s ^ U64(key & MASK))
        return mix64(row ^ (U64(step) * GOLDEN))


def mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32 on uint32 (wrapping), as the core's kernels.rs."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def draws(stream: np.ndarray, dim: int) -> np.ndarray:
    """u_c in [0, 1): 24 bits of mix32(base + c * 0x9E3779B9), base the
    stream's two 32-bit halves xored."""
    base = np.uint32((int(stream) >> 32) ^ (int(stream) & 0xFFFFFFFF))
    c = np.arange(dim, dtype=np.uint32)
    with np.errstate(over="ignore"):
        bits = mix32(base + c * np.uint32(0x9E3779B9))
    return (bits >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)


def quantize(x: np.ndarray, u: np.ndarray | float) -> np.ndarray:
    """The 8-bit row of float32 ``x`` read back as float32: offset the
    smallest weight, scale the span over 255, code floor((x - lo) * (1 /
    scale) + u) clamped to 0..255 (u = 0.5: to nearest), weight lo + scale *
    code."""
    x = x.astype(np.float32)
    lo, hi = x.min(), x.max()
    scale = np.float32((hi - lo) / np.float32(255.0))
    if scale == 0:
        return np.full_like(x, lo)
    inv = np.float32(1.0) / scale
    q = np.clip(np.floor((x - lo) * inv + np.float32(u)), 0, 255).astype(np.uint8)
    return lo + scale * q.astype(np.float32)


@pytest.mark.parametrize("dim", [1, 7, 64])
def test_assigned_and_trained_rows_equal_the_numpy_reference_on_every_backend(
    simd: str, dim: int
) -> None:
    """Rows assigned, then 4 SGD steps (keys repeated in a batch): after each,
    every row equals the reference: to nearest when assigned, then each step
    w - lr * g in float32 rounded stochastically by the draws of (seed, key,
    step), bit for bit."""
    rng = np.random.default_rng(dim)
    seed, lr = 11, np.float32(0.05)
    t = embstore.Table(dim, dtype="int8", optimizer=optim.SGD(lr=float(lr)), seed=seed)
    assert t.simd == simd
    keys = np.array([3, -8, 2**40, 17, 0], dtype=np.int64)
    x = rng.standard_normal((keys.size, dim)).astype(np.float32) * 0.1
    t.assign(keys, x)
    want = np.stack([quantize(r, 0.5) for r in x])
    np.testing.assert_array_equal(t.lookup(keys), want)
    for step in range(1, 5):
        batch = np.concatenate([keys, keys[:2]])
        g = rng.standard_normal((batch.size, dim)).astype(np.float32)
        t.apply_gradients(batch, g)
        gsum = g[: keys.size].copy()
        gsum[:2] += g[keys.size :]  # a key's gradients summed in batch order
        for i, k in enumerate(keys.tolist()):
            w = want[i] - lr * gsum[i]
            want[i] = quantize(w, draws(rounding_stream(seed, k, step), dim))
        np.testing.assert_array_equal(t.lookup(keys), want, err_msg=f"step {step}")


def test_stochastic_rounding_keeps_small_updates_that_nearest_loses() -> None:
    """Updates far below a code's step: with stochastic rounding the row
    moves by their sum on average; rounded to nearest it would stay put."""
    t = embstore.Table(16, dtype="int8", optimizer=optim.SGD(lr=1.0), seed=2)
    keys = np.arange(200, dtype=np.int64)
    x = np.tile(np.linspace(-1, 1, 16, dtype=np.float32), (200, 1))
    t.assign(keys, x)
    before = t.lookup(keys)
    g = np.zeros((200, 16), np.float32)
    g[:, 5] = -1e-3  # a code's step is 2 / 255 = 7.8e-3
    for _ in range(50):
        t.apply_gradients(keys, g)
    moved = float((t.lookup(keys)[:, 5] - before[:, 5]).mean())
    assert 0.04 < moved < 0.06, moved  # 50 steps of 1e-3
    nudged = before[0].copy()
    nudged[5] += np.float32(1e-3)
    assert quantize(nudged, 0.5)[5] == before[0, 5]  # to nearest: lost


def train_digest(shards: int) -> str:
    """Adam on 2,000 keys over 5 batches with repeats, as a digest."""
    import hashlib

    t = embstore.Table(24, dtype="int8", optimizer=optim.Adam(lr=0.01), seed=5, num_shards=shards)
    rng = np.random.default_rng(9)
    for _ in range(5):
        k = rng.integers(0, 2_000, 6_000)
        t.apply_gradients(k, rng.standard_normal((k.size, 24)).astype(np.float32))
    keys, rows = t.export()
    order = np.argsort(keys)
    return hashlib.sha256(keys[order].tobytes() + rows[order].tobytes()).hexdigest()


def test_results_do_not_depend_on_shard_or_thread_counts() -> None:
    """The same training on 1 and 16 shards, and with 1 and 2 threads (a
    child process each), leaves the same rows bit for bit."""
    digest = train_digest(1)
    assert train_digest(16) == digest
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_int8 import train_digest
        print(train_digest(8))
        """
    )
    for threads in ("1", "2"):
        env = dict(os.environ, RAYON_NUM_THREADS=threads)
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == digest, (threads, out.stderr[-2000:])


def test_pooled_lookups_equal_torch_embedding_bag_over_the_rows() -> None:
    torch = pytest.importorskip("torch")
    t = embstore.Table(32, dtype="int8", seed=4)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 500, 3_000)
    offsets = np.arange(0, 3_001, 30, dtype=np.int64)  # CSR: n + 1 offsets
    for combiner in ("sum", "mean"):
        got = t.lookup_pooled(ids, offsets, combiner=combiner)
        keys = np.arange(500, dtype=np.int64)
        bag = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(t.lookup(keys)), mode=combiner)
        want = bag(torch.from_numpy(ids), torch.from_numpy(offsets[:-1])).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_int8_row_costs_72_bytes_at_dim_64() -> None:
    """64 codes, a float32 scale and offset: 3.6x fewer row bytes than
    float32's 256; the table's bytes count them (and the same per-key
    overhead as a float32 table's), and `stats()` gives its parts."""
    n = 50_000
    a, b = embstore.Table(64), embstore.Table(64, dtype="int8")
    for t in (a, b):
        t.lookup(np.arange(n))
    sa, sb = a.stats(), b.stats()
    assert sa["row_cost"] - sb["row_cost"] == 256 - 72
    assert sa["bytes"] - sb["bytes"] == n * (256 - 72)
    # The parts of `bytes`: the rows' weights as stored differ, the index
    # and the rest (an 8-byte tag a row, the last lookup's kept rows) not.
    assert (sa["weights_bytes"], sb["weights_bytes"]) == (n * 256, n * 72)
    assert sa["index_bytes"] == sb["index_bytes"] >= n * 16
    assert sa["state_bytes"] == sb["state_bytes"] == 0
    for s in (sa, sb):
        rest = s["bytes"] - s["index_bytes"] - s["weights_bytes"] - s["state_bytes"]
        assert rest >= n * 8, s
    adam = embstore.Table(64, dtype="int8", optimizer=optim.Adam(lr=0.01))
    adam.lookup(np.arange(n))
    assert adam.stats()["state_bytes"] == n * 2 * 64 * 4
    # A byte budget counts an int8 row at its own cost (with the 16 bytes of
    # touch counts a capacity keeps).
    c8 = embstore.Table(64, dtype="int8", capacity_bytes=1 << 20).stats()
    c32 = embstore.Table(64, capacity_bytes=1 << 20).stats()
    assert c32["row_cost"] - c8["row_cost"] == 256 - 72
    assert c8["capacity_rows"] == (1 << 20) // c8["row_cost"]


def trained_int8(seed: int = 3) -> embstore.Table:
    t = embstore.Table(9, dtype="int8", optimizer=optim.Adam(lr=0.01), seed=seed)
    rng = np.random.default_rng(seed)
    k = rng.integers(0, 3_000, 12_000)
    t.apply_gradients(k, rng.standard_normal((k.size, 9)).astype(np.float32))
    return t


def sorted_export(t: object) -> tuple[np.ndarray, np.ndarray]:
    keys, rows = t.export()  # type: ignore[attr-defined]
    o = np.argsort(keys)
    return keys[o], rows[o]


def test_checkpoints_keep_int8_rows_and_state_bit_for_bit(tmp_path) -> None:
    """A save and a load give the same rows (their stored bytes: the next
    step on both tables gives equal rows too), incremental saves chain, and
    the mapped reader serves the same rows, before and after a publish."""
    t = trained_int8()
    path = tmp_path / "c"
    t.save(path)
    saved = sorted_export(t)
    back = embstore.Table.load(path)
    assert back.dtype == "int8"
    for a, b in zip(saved, sorted_export(back), strict=True):
        np.testing.assert_array_equal(a, b)
    k = np.arange(0, 3_000, 7)
    g = np.ones((k.size, 9), np.float32)
    t.apply_gradients(k, g)
    back.apply_gradients(k, g)
    np.testing.assert_array_equal(t.lookup(k), back.lookup(k))
    mapped = embstore.Table.load(path, mmap=True)
    np.testing.assert_array_equal(mapped.lookup(saved[0]), saved[1])
    t.save(path, incremental=True, with_optimizer=True)
    assert mapped.refresh()
    np.testing.assert_array_equal(mapped.lookup(k), t.lookup(k))
    again = embstore.Table.load(path)
    for a, b in zip(sorted_export(t), sorted_export(again), strict=True):
        np.testing.assert_array_equal(a, b)


def test_state_dicts_and_dtype_conversions_at_save_and_load(tmp_path) -> None:
    """A state dict round trip keeps an int8 table's rows and next step;
    ``Table.load(path, dtype="float32")`` gives an int8 checkpoint's rows
    as float32 (equal to the int8 table's reads); a float32 trainer's
    ``save(path, with_optimizer=False, dtype="int8")`` publishes rows within
    half a code step of its own, served by a mapped reader; an incremental
    save refuses another dtype by name."""
    t = trained_int8(seed=6)
    keys, rows = sorted_export(t)
    u = embstore.Table(9, dtype="int8", optimizer=optim.Adam(lr=0.01), seed=6)
    u.load_state_dict(t.state_dict())
    np.testing.assert_array_equal(u.lookup(keys), rows)
    g = np.ones((keys.size, 9), np.float32)
    t.apply_gradients(keys, g)
    u.apply_gradients(keys, g)
    np.testing.assert_array_equal(u.lookup(keys), t.lookup(keys))
    t.save(tmp_path / "i8")
    f = embstore.Table.load(tmp_path / "i8", dtype="float32")
    assert (f.dtype, f.step, f.seed) == ("float32", t.step, t.seed)
    np.testing.assert_array_equal(f.lookup(keys, insert=False), t.lookup(keys))
    # A float32 trainer publishes int8 rows.
    f.apply_gradients(keys, g)
    f.save(tmp_path / "pub", with_optimizer=False, dtype="int8")
    served = embstore.Table.load(tmp_path / "pub", mmap=True)
    assert served.dtype == "int8"
    want = f.lookup(keys, insert=False)
    got = served.lookup(keys)
    span = want.max(axis=1) - want.min(axis=1)
    assert np.all(np.abs(got - want) <= (span / 255 / 2 * 1.001 + 1e-7)[:, None])
    with pytest.raises(ValueError, match="dtype: an incremental save"):
        f.save(tmp_path / "pub", incremental=True, dtype="int8")
    with pytest.raises(ValueError, match="dtype: expected"):
        embstore.Table.load(tmp_path / "i8", dtype="int4")
