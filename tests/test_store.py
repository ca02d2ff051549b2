"""The Table's batch protocol against a dict model, and the determinism of
initial rows across shard counts, insertion orders and thread counts."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import embstore
from embstore import init, optim
from tests.conftest import key_pool


def test_lookup_insert_and_serving_mode(rng: np.random.Generator) -> None:
    table = embstore.Table(8, seed=3)
    keys = key_pool(rng, 50)
    served = table.lookup(keys, insert=False)
    assert served.shape == (50, 8)
    assert served.dtype == np.float32
    assert len(table) == 0, "insert=False must not store rows"
    stored = table.lookup(keys)
    np.testing.assert_array_equal(stored, served)
    assert len(table) == 50
    assert table.contains(keys).all()
    assert not table.contains([123456789012]).any()


def test_assign_overwrites_and_last_duplicate_wins() -> None:
    table = embstore.Table(2, optimizer=optim.Adagrad(lr=0.1, initial_accumulator_value=0.5))
    table.apply_gradients([1], [[1.0, 1.0]])
    table.assign([1, 2, 1], [[1, 1], [2, 2], [3, 3]])
    keys, rows, state = table.export(with_state=True)
    np.testing.assert_array_equal(keys, [1, 2])
    np.testing.assert_array_equal(rows, [[3, 3], [2, 2]])
    # optimizer state reset to initial_accumulator_value
    np.testing.assert_array_equal(state, np.full((2, 2), 0.5, np.float32))


def test_remove_counts_present_keys_once() -> None:
    table = embstore.Table(3)
    table.lookup([1, 2, 3, 4])
    assert table.remove([2, 2, 9, 4]) == 2
    np.testing.assert_array_equal(table.export()[0], [1, 3])
    assert len(table) == 2


def test_export_sorted_and_stats(rng: np.random.Generator) -> None:
    table = embstore.Table(4, optimizer=optim.Adam(), num_shards=5)
    keys = key_pool(rng, 1000)
    table.apply_gradients(keys, np.ones((1000, 4)))
    out_keys, rows, state = table.export(with_state=True)
    np.testing.assert_array_equal(out_keys, np.sort(keys))
    assert rows.shape == (1000, 4)
    assert state.shape == (1000, 8)
    stats = table.stats()
    assert stats["rows"] == 1000 == len(table)
    assert sum(stats["shard_rows"]) == 1000
    assert len(stats["shard_rows"]) == 5
    assert stats["step"] == 1
    # payload: 8-byte key + (4 + 8) floats per row, plus the index.
    assert 1000 * (8 + 12 * 4) <= stats["bytes"] <= 1000 * (8 + 12 * 4) * 3


def test_random_operations_match_dict_model(rng: np.random.Generator) -> None:
    table = embstore.Table(3, optimizer=optim.SGD(lr=0.25), seed=9, num_shards=3)
    fresh = embstore.Table(3, seed=9)
    model: dict[int, np.ndarray] = {}
    pool = key_pool(rng, 60)
    for _ in range(300):
        keys = rng.choice(pool, size=int(rng.integers(0, 20)))
        op = rng.integers(0, 4)
        if op == 0:
            got = table.lookup(keys)
            for k, row in zip(keys.tolist(), got, strict=True):
                model.setdefault(k, fresh.lookup([k], insert=False)[0])
                np.testing.assert_array_equal(row, model[k])
        elif op == 1:
            vals = rng.integers(-5, 5, size=(len(keys), 3)).astype(np.float32)
            table.assign(keys, vals)
            for k, v in zip(keys.tolist(), vals, strict=True):
                model[k] = v.copy()
        elif op == 2:
            n = table.remove(keys)
            assert n == sum(model.pop(k, None) is not None for k in set(keys.tolist()))
        else:
            grads = rng.integers(-3, 3, size=(len(keys), 3)).astype(np.float32)
            table.apply_gradients(keys, grads)
            for k in set(keys.tolist()):
                g = grads[keys == k].sum(axis=0)
                base = model.get(k, fresh.lookup([k], insert=False)[0])
                model[k] = base - np.float32(0.25) * g
        assert len(table) == len(model)
    keys, rows = table.export()
    assert keys.tolist() == sorted(model)
    for k, row in zip(keys.tolist(), rows, strict=True):
        np.testing.assert_allclose(row, model[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "initializer",
    [
        init.Uniform(-0.1, 0.2),
        init.Normal(0.0, 0.5),
        init.TruncatedNormal(1.0, 0.1),
        init.Zeros(),
        init.Constant(0.25),
    ],
)
def test_initial_rows_identical_across_shards_and_orders(
    rng: np.random.Generator, initializer: init.Initializer
) -> None:
    keys = key_pool(rng, 3000)
    rows = []
    for num_shards, order in [(1, keys), (4, keys[::-1]), (64, rng.permutation(keys))]:
        table = embstore.Table(16, initializer=initializer, seed=77, num_shards=num_shards)
        for chunk in np.array_split(order, 7):
            table.lookup(chunk)
        rows.append(table.export()[1])
    for r in rows[1:]:
        np.testing.assert_array_equal(r.view(np.uint32), rows[0].view(np.uint32))


@pytest.mark.slow
def test_initial_rows_identical_across_thread_counts(tmp_path: os.PathLike[str]) -> None:
    script = (
        "import numpy as np, embstore, sys\n"
        "t = embstore.Table(32, seed=4)\n"
        "t.lookup(np.arange(-50000, 50000) * 7919)\n"
        "np.save(sys.argv[1], t.export()[1])\n"
    )
    outs = []
    for threads in (1, 2, 5):
        out = f"{tmp_path}/rows{threads}.npy"
        env = {**os.environ, "RAYON_NUM_THREADS": str(threads)}
        subprocess.run([sys.executable, "-c", script, out], check=True, env=env, timeout=120)
        outs.append(np.load(out))
    for o in outs[1:]:
        np.testing.assert_array_equal(o.view(np.uint32), outs[0].view(np.uint32))


def test_initializer_distributions() -> None:
    keys = np.arange(20000)
    # Seed 101 draws, at key 15269, a value that rounds up to 3.0 as float32
    # unless the initializer keeps [low, high) half-open.
    u = embstore.Table(8, initializer=init.Uniform(-1, 3), seed=101).lookup(keys, insert=False)
    assert u.min() >= -1
    assert u.max() < 3
    assert abs(u.mean() - 1.0) < 0.02
    n = embstore.Table(8, initializer=init.Normal(0.5, 2.0)).lookup(keys, insert=False)
    assert abs(n.mean() - 0.5) < 0.03
    assert abs(n.std() - 2.0) < 0.03
    tn = embstore.Table(8, initializer=init.TruncatedNormal(0.0, 1.0)).lookup(keys, insert=False)
    assert np.abs(tn).max() <= 2.0
    assert (embstore.Table(8, initializer=init.Constant(0.25)).lookup(keys[:5]) == 0.25).all()


def test_default_initializer_and_properties() -> None:
    table = embstore.Table(6, optimizer=optim.Ftrl(lr=0.1))
    assert table.initializer == init.Uniform(-0.05, 0.05)
    assert table.dim == 6
    assert table.step == 0
    assert table.dtype == "float32"
    assert table.optimizer == optim.Ftrl(lr=0.1)
    assert table.state_len == 12
    assert table.state_names == ["linear", "accumulator"]
    assert table.simd in embstore._core.simd_backends()
    assert "Table(dim=6" in repr(table)


def test_integer_key_dtypes_are_widened() -> None:
    table = embstore.Table(2, seed=1)
    ref = table.lookup(np.array([1, 2, 3], dtype=np.int64), insert=False)
    for dt in (np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32, np.uint64):
        np.testing.assert_array_equal(table.lookup(np.array([1, 2, 3], dtype=dt)), ref)
    np.testing.assert_array_equal(table.lookup([1, 2, 3]), ref)
    assert table.lookup([]).shape == (0, 2)
    # A non-contiguous view is accepted.
    np.testing.assert_array_equal(table.lookup(np.array([1, 9, 2, 9, 3])[::2]), ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dim", [1, 3, 64])
def test_lookup_copies_each_row_to_its_position(
    dim: int, dtype: str, rng: np.random.Generator
) -> None:
    """Every row copy the lookup has (a one-float row, a short row, a long
    row; float32 and a 16-bit format): present keys read their own row at
    their batch position, absent ones the default, for batches on the
    calling thread's small path and on the ordinary one (a dict model)."""
    t = embstore.Table(dim, seed=5, num_shards=8, dtype=dtype)
    stored = rng.choice(10_000, 500, replace=False)
    # Values every format holds exactly (small integers).
    vals = rng.integers(-100, 100, (500, dim)).astype(np.float32)
    t.assign(stored, vals)
    model = {int(k): v for k, v in zip(stored, vals, strict=True)}
    for n in (1, 7, 128, 1_500):
        keys = rng.choice(20_000, n)
        want = np.stack([model.get(int(k), np.zeros(dim, np.float32)) for k in keys])
        np.testing.assert_array_equal(t.lookup(keys, insert=False, default="zeros"), want)
        present = keys[np.isin(keys, stored)]
        np.testing.assert_array_equal(
            t.lookup(present), np.array([model[int(k)] for k in present]).reshape(-1, dim)
        )
    assert len(t) == 500


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_missing_keys_read_as_the_given_default(dtype: str) -> None:
    """default= of non-inserting lookups: "init" (the initializer's row),
    "zeros" or a given row; present keys read their own row; nothing stored."""
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.5), seed=3, dtype=dtype)
    t.assign([1], np.full((1, 4), 2.0))
    keys = np.array([1, 99, 1, 77])
    init_rows = embstore.Table(4, seed=3, dtype=dtype).lookup([99, 77], insert=False)
    got = t.lookup(keys, insert=False)
    np.testing.assert_array_equal(got[[1, 3]], init_rows)
    zeros = t.lookup(keys, insert=False, default="zeros")
    np.testing.assert_array_equal(zeros[[0, 2]], np.full((2, 4), 2.0))
    np.testing.assert_array_equal(zeros[[1, 3]], np.zeros((2, 4)))
    row = np.array([0.5, -1.0, 0.25, 3.0])
    given = t.lookup(keys, insert=False, default=row)
    np.testing.assert_array_equal(given[[1, 3]], np.stack([row, row]))
    assert len(t) == 1
    assert t.stats()["inserts"] == 1
    # pooled: a missing id pools as the default (sum of 2.0-row and the default)
    pooled = t.lookup_pooled([1, 99], [0, 2], insert=False, default=row)
    np.testing.assert_array_equal(pooled[0], 2.0 + row)
    pooled0 = t.lookup_pooled([1, 99], [0, 2], insert=False, default="zeros", combiner="mean")
    np.testing.assert_array_equal(pooled0[0], np.full(4, 1.0))
    # a Collection takes "init" or "zeros"
    c = embstore.Collection({"a": t, "b": t})
    out = c.lookup_pooled({"a": [1, 99], "b": [99, 1]}, insert=False, default="zeros")
    np.testing.assert_array_equal(out, [[2, 2, 2, 2, 0, 0, 0, 0], [0, 0, 0, 0, 2, 2, 2, 2]])
    assert len(t) == 1


@pytest.mark.parametrize(
    ("default", "error", "match"),
    [
        ("mean", ValueError, 'default: expected "init", "zeros" or a row'),
        ([1.0, 2.0], ValueError, "default: expected .* a row of 4 floats, got shape \\(2,\\)"),
        ([1.0, 2.0, np.nan, 0.0], ValueError, "default: expected finite values"),
        (["a", "b", "c", "d"], ValueError, "default: .* got dtype <U1"),
    ],
)
def test_bad_default_is_refused(default: object, error: type[Exception], match: str) -> None:
    t = embstore.Table(4)
    with pytest.raises(error, match=match):
        t.lookup([1], insert=False, default=default)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError), match="default"):
        embstore.Collection({"a": t}).lookup_pooled({"a": [1]}, default=np.zeros(4))  # type: ignore[arg-type]
    assert len(t) == 0


def test_default_seeds_differ_between_tables_and_repeat_under_manual_seed() -> None:
    """Tables built without seed= take 0, 1, 2, ... of a process-wide
    sequence: two of them start key 5 differently; manual_seed restarts
    the sequence; an explicit seed gives the same rows every time."""
    embstore.manual_seed(100)
    a, b = embstore.Table(8), embstore.Table(8)
    assert (a.seed, b.seed) == (100, 101)
    assert not np.array_equal(a.lookup([5], insert=False), b.lookup([5], insert=False))
    embstore.manual_seed(100)
    again = embstore.Table(8)
    np.testing.assert_array_equal(again.lookup([5]), a.lookup([5]))
    np.testing.assert_array_equal(
        embstore.Table(8, seed=7).lookup([5]), embstore.Table(8, seed=7).lookup([5])
    )
    with pytest.raises(ValueError, match="dim"):
        embstore.Table(0)  # refused before drawing: the sequence does not move
    assert embstore.Table(8).seed == 101  # after "again" took 100; seed=7 tables took none
    with pytest.raises(ValueError, match="seed"):
        embstore.manual_seed(-1)
