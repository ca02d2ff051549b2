"""One test per row of the bad-input list: each names the argument in its
message and leaves the table exactly as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import embstore
from embstore import optim
from tests.conftest import assert_same, snapshot

from . import _child

DIM = 4


@pytest.fixture
def table() -> embstore.Table:
    t = embstore.Table(DIM, optimizer=optim.Adam(lr=0.1), num_shards=3)
    t.apply_gradients([1, 2, 3], np.ones((3, DIM)))
    return t


CALLS: dict[str, Callable[[embstore.Table, Any], Any]] = {
    "lookup": lambda t, k: t.lookup(k),
    "lookup_serving": lambda t, k: t.lookup(k, insert=False),
    "contains": lambda t, k: t.contains(k),
    "remove": lambda t, k: t.remove(k),
    "assign": lambda t, k: t.assign(k, np.zeros((np.asarray(k).size, DIM))),
    "apply_gradients": lambda t, k: t.apply_gradients(k, np.zeros((np.asarray(k).size, DIM))),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize(
    ("keys", "what"),
    [
        (np.array([1.0, 2.0]), "float64"),
        (np.array([1.5], dtype=np.float32), "float32"),
        (np.array([True, False]), "bool"),
        (np.array([1, "a"], dtype=object), "object"),
        (np.array(["1"]), "<U1"),
    ],
)
def test_non_integer_keys_are_a_type_error(
    table: embstore.Table, call: str, keys: np.ndarray, what: str
) -> None:
    before = snapshot(table)
    with pytest.raises(TypeError, match=r"^keys: expected an integer array"):
        CALLS[call](table, keys)
    assert_same(before, snapshot(table))


@pytest.mark.parametrize("call", CALLS)
def test_uint64_above_int64_max_is_a_value_error(table: embstore.Table, call: str) -> None:
    before = snapshot(table)
    keys = np.array([5, 2**63], dtype=np.uint64)
    with pytest.raises(ValueError, match=r"^keys: expected keys <= 2\*\*63-1"):
        CALLS[call](table, keys)
    assert_same(before, snapshot(table))


@pytest.mark.parametrize("call", CALLS)
def test_keys_not_1d_are_a_value_error(table: embstore.Table, call: str) -> None:
    before = snapshot(table)
    with pytest.raises(ValueError, match=r"^keys: expected a 1-D array, got shape \(2, 2\)"):
        CALLS[call](table, np.array([[1, 2], [3, 4]]))
    with pytest.raises(ValueError, match=r"^keys: expected a 1-D array, got shape \(\)"):
        CALLS[call](table, np.int64(7))
    assert_same(before, snapshot(table))


@pytest.mark.parametrize(
    ("shape", "n_keys"), [((3, DIM + 1), 3), ((2, DIM), 3), ((3 * DIM,), 3), ((3, 1, DIM), 3)]
)
@pytest.mark.parametrize("method", ["apply_gradients", "assign"])
def test_wrong_value_shapes_are_a_value_error(
    table: embstore.Table, shape: tuple[int, ...], n_keys: int, method: str
) -> None:
    before = snapshot(table)
    arg = "grads" if method == "apply_gradients" else "values"
    with pytest.raises(ValueError, match=rf"^{arg}: expected shape \({n_keys}, {DIM}\)"):
        getattr(table, method)(np.arange(n_keys), np.zeros(shape, np.float32))
    assert_same(before, snapshot(table))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_gradients_are_a_value_error(table: embstore.Table, bad: float) -> None:
    before = snapshot(table)
    grads = np.ones((3, DIM), np.float32)
    grads[2, 1] = bad
    with pytest.raises(ValueError, match=r"^grads: expected only finite values.*index 9"):
        table.apply_gradients([1, 7, 8], grads)
    assert_same(before, snapshot(table))
    assert table.step == 1


def test_float64_gradient_overflowing_float32_is_refused(table: embstore.Table) -> None:
    before = snapshot(table)
    with pytest.raises(ValueError, match=r"^grads: expected only finite values"):
        table.apply_gradients([1], np.full((1, DIM), 1e300))
    assert_same(before, snapshot(table))


def test_non_finite_values_in_assign_are_refused(table: embstore.Table) -> None:
    before = snapshot(table)
    with pytest.raises(ValueError, match=r"^values: expected only finite values"):
        table.assign([1, 9], np.array([[0.0] * DIM, [np.nan] * DIM]))
    assert_same(before, snapshot(table))


def test_non_numeric_gradients_are_a_type_error(table: embstore.Table) -> None:
    before = snapshot(table)
    with pytest.raises(TypeError, match=r"^grads: expected a float array"):
        table.apply_gradients([1], np.full((1, DIM), True))
    assert_same(before, snapshot(table))


@pytest.mark.parametrize("dim", [0, -3])
def test_dim_below_one_is_a_value_error(dim: int) -> None:
    with pytest.raises(ValueError, match=r"^dim: expected dim >= 1"):
        embstore.Table(dim)


def test_bad_constructor_arguments() -> None:
    with pytest.raises(TypeError, match=r"^dim: expected an int"):
        embstore.Table(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^num_shards: expected num_shards >= 1"):
        embstore.Table(2, num_shards=0)
    with pytest.raises(ValueError, match=r"^num_shards: expected 1 <= num_shards <= 65536"):
        embstore.Table(2, num_shards=1 << 20)
    with pytest.raises(ValueError, match=r"^seed: expected 0 <= seed < 2\*\*64"):
        embstore.Table(2, seed=-1)
    with pytest.raises(ValueError, match=r"^dtype: expected one of"):
        embstore.Table(2, dtype="int4")
    with pytest.raises(TypeError, match=r"^optimizer: expected an embstore.optim optimizer"):
        embstore.Table(2, optimizer="adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^high: expected high >= low"):
        embstore.init.Uniform(1.0, 0.0)
    with pytest.raises(ValueError, match=r"^std: expected std >= 0"):
        embstore.init.Normal(0.0, -1.0)


def test_apply_without_optimizer_is_a_value_error() -> None:
    table = embstore.Table(2)
    table.lookup([1])
    before = snapshot(table)
    with pytest.raises(ValueError, match=r"^optimizer: this table was built with optimizer=None"):
        table.apply_gradients([1], np.ones((1, 2)))
    assert_same(before, snapshot(table))


def test_unknown_simd_backend_is_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBSTORE_SIMD", "sse9")
    with pytest.raises(ValueError, match=r"^EMBSTORE_SIMD: expected one of scalar"):
        embstore.Table(2)


def test_a_default_row_that_requires_grad_is_refused_naming_default() -> None:
    torch = pytest.importorskip("torch")
    t = embstore.Table(4)
    with pytest.raises(ValueError, match=r"default: .*detach"):
        t.lookup([1, 2], insert=False, default=torch.ones(4, requires_grad=True))
    rows = t.lookup([1, 2], insert=False, default=torch.full((4,), 2.0))
    np.testing.assert_array_equal(rows, np.full((2, 4), 2.0, np.float32))
    assert len(t) == 0


@pytest.mark.slow
def test_a_collection_call_beyond_memory_is_a_memory_error() -> None:
    """The feature-naming check of a Collection call keeps the error's type:
    out of memory is MemoryError (it was ValueError), in a child under RLIMIT_AS."""

    out = _child.ok(
        """
        t = embstore.Table(4, optimizer=optim.SGD(lr=0.1))
        c = embstore.Collection({"a": t, "b": t})
        n = 3_000_000
        ids, off = np.arange(n), np.arange(n + 1)
        g = np.ones((n, 8), np.float32)
        limit_memory(64 << 20)
        for f in (lambda: c.lookup_pooled({"a": (ids, off), "b": (ids, off)}),
                  lambda: c.apply_pooled_gradients({"a": (ids, off), "b": (ids, off)}, g)):
            try:
                f()
                print("done")
            except MemoryError as e:
                print("memory:", e)
        print("rows", len(t))
        """
    )
    assert out.count('memory: batch["a"]') == 2, out
    assert "rows 0" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("value", ["", "soon", "nan", "inf", "0"])
def test_a_bad_timeout_variable_names_itself(value: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import embstore.distributed.mpi"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "EMBSTORE_MPI_TIMEOUT": value},
    )
    assert proc.returncode != 0
    assert "EMBSTORE_MPI_TIMEOUT: expected" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda t: t.reserve(2**70), ValueError, r"^rows: expected rows <= "),
        (lambda t: embstore.Table(2**70), ValueError, r"^dim: expected dim <= "),
        (lambda t: embstore.Table(4, capacity=2**70), ValueError, r"^capacity: expected capacity"),
        (lambda t: embstore.Table(4, num_shards=2**70), ValueError, r"^num_shards: expected"),
        (lambda t: optim.SGD(lr=2**1100), ValueError, r"^lr: expected a number finite"),
        (lambda t: t.lookup([1], insert="no"), TypeError, r"^insert: expected True or False"),
        (lambda t: t.export(with_state="yes"), TypeError, r"^with_state: expected True or"),
    ],
)
def test_bad_arguments_raise_value_or_type_errors_naming_them(
    call: object, exc: type, match: str
) -> None:
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.1))
    t.lookup([5])
    before = snapshot(t)
    with pytest.raises(exc, match=match):
        call(t)  # type: ignore[operator]
    assert_same(before, snapshot(t))


def test_collection_offset_errors_name_the_feature() -> None:
    a = embstore.Table(4, optimizer=optim.SGD(lr=0.1))
    coll = embstore.Collection({"user": a, "hist": a})
    batch = {"user": ([1, 2], [0, 1, 2]), "hist": ([1, 2], [0, 2, 1])}
    with pytest.raises(ValueError, match=r"""^batch\["hist"\] offsets: expected non-decreasing"""):
        coll.lookup_pooled(batch)
    with pytest.raises(ValueError, match=r"""^batch\["hist"\] offsets: expected non-decreasing"""):
        coll.apply_pooled_gradients(batch, np.ones((2, 8)))
    assert len(a) == 0
