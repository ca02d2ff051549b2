"""Nothing makes a row or its optimizer state NaN or inf, whatever settings
a table accepts: parameters that let a zero gradient divide 0 by 0 are
refused, and a step whose result would be non-finite is refused whole
(nothing changes, not even the step counter), in the Table as in the
DeviceCache."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import embstore
from embstore import init, optim

from .conftest import assert_same
from .conftest import snapshot as table_snapshot


def snapshot(t: embstore.Table) -> tuple[Any, ...]:
    if t.state_len:
        k, r, s = t.export(with_state=True)
    else:
        (k, r), s = t.export(), None
    return t.step, k, r, s


def assert_unchanged(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert a[0] == b[0], "the step counter moved"
    for x, y in zip(a[1:], b[1:], strict=True):
        if x is not None:
            np.testing.assert_array_equal(x, y)


def all_finite(t: embstore.Table) -> bool:
    _, _, r, s = snapshot(t)
    return bool(np.isfinite(r).all() and (s is None or np.isfinite(s).all()))


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.Adagrad(lr=0.1, eps=0.0),
        lambda: optim.RowWiseAdagrad(lr=0.1, eps=0.0),
        lambda: optim.Adam(eps=0.0),
        lambda: optim.AdamW(eps=0.0),
        lambda: optim.Adam(eps=1e-50),  # 0 as float32
    ],
)
def test_an_eps_that_lets_zero_gradients_divide_zero_by_zero_is_refused(make: Any) -> None:
    with pytest.raises(ValueError, match=r"^eps: expected a finite eps > 0"):
        embstore.Table(4, optimizer=make())


def test_adagrad_without_eps_is_accepted_when_its_accumulator_starts_above_zero() -> None:
    t = embstore.Table(4, optimizer=optim.Adagrad(lr=0.1, eps=0.0, initial_accumulator_value=0.1))
    t.lookup([1, 2])
    t.apply_gradients([1, 2], np.zeros((2, 4), np.float32))  # padding rows: 0 / sqrt(0.1)
    assert all_finite(t)


def test_weight_decay_that_diverges_is_refused_at_the_step_that_would_overflow() -> None:
    """SGD(lr=1, weight_decay=1e10) on zero gradients multiplies rows by
    about -1e10 a step: the step that would reach inf is refused, every
    earlier one applied."""
    t = embstore.Table(4, optimizer=optim.SGD(lr=1.0, weight_decay=1e10))
    t.lookup([1, 2])
    refused = None
    for _ in range(8):
        before = snapshot(t)
        try:
            t.apply_gradients([1, 2], np.zeros((2, 4), np.float32))
        except ValueError as e:
            refused = str(e)
            assert_unchanged(before, snapshot(t))
            break
    assert refused is not None, "no step was refused"
    assert refused.startswith("grads: this step would make"), refused
    assert all_finite(t)
    assert t.step >= 2


@pytest.mark.parametrize(
    ("opt", "grad", "start"),
    [
        (optim.SGD(lr=1e21), 1e18, None),  # lr * g = 1e39
        (optim.Ftrl(lr=1e-30), 1e10, None),  # sqrt(n) / lr = 1e40
        (optim.Adam(lr=1e38), -1.0, 3e38),  # the step adds about lr to 3e38
        (optim.AdamW(lr=1e38, weight_decay=0.0), -1.0, 3e38),
        (optim.Adagrad(lr=1e38), -1.0, 3e38),
        (optim.RowWiseAdagrad(lr=1e38), -1.0, 3e38),
    ],
)
def test_a_step_that_would_overflow_is_refused_whole(
    opt: Any, grad: float, start: float | None
) -> None:
    t = embstore.Table(4, optimizer=opt)
    t.lookup(np.arange(50))
    if start is not None:
        t.assign(np.arange(50), np.full((50, 4), start, np.float32))
    before = snapshot(t)
    with pytest.raises(ValueError, match=r"^grads: this step would make the (row|optimizer state)"):
        t.apply_gradients(np.arange(60), np.full((60, 4), grad, np.float32))
    assert_unchanged(before, snapshot(t))
    assert len(t) == 50, "new keys of a refused step were inserted"


def test_one_row_that_would_overflow_refuses_the_whole_batch() -> None:
    """99 rows would step to finite values, one (holding 3e38) past float32's
    largest: nothing changes, the rows that would have been fine included."""
    t = embstore.Table(4, optimizer=optim.SGD(lr=1e21))
    t.lookup(np.arange(100))
    t.assign([7], np.full((1, 4), 3e38, np.float32))
    before = snapshot(t)
    with pytest.raises(ValueError, match="key 7"):
        t.apply_gradients(np.arange(100), np.full((100, 4), -1e17, np.float32))
    assert_unchanged(before, snapshot(t))
    # Without key 7 the same step applies (the rows reach about 1e38).
    t.apply_gradients(np.arange(7), np.full((7, 4), -1e17, np.float32))
    assert t.step == 1
    assert all_finite(t)


def test_pooled_and_collection_steps_refuse_overflow_whole() -> None:
    t = embstore.Table(4, optimizer=optim.SGD(lr=1e21))
    t.lookup(np.arange(10))
    t.assign([3], np.full((1, 4), 3e38, np.float32))
    before = snapshot(t)
    ids, offsets = np.array([1, 3, 5, 3]), np.array([0, 2, 4])
    g = np.full((2, 4), -1e17, np.float32)
    with pytest.raises(ValueError, match="key 3"):
        t.apply_pooled_gradients(ids, offsets, g)
    assert_unchanged(before, snapshot(t))
    c = embstore.Collection({"a": t, "b": t})
    with pytest.raises(ValueError, match="key 3"):
        c.apply_pooled_gradients({"a": (ids, offsets), "b": (ids, offsets)}, np.hstack([g, g]))
    assert_unchanged(before, snapshot(t))


def test_sixteen_bit_rows_saturate_and_their_state_stays_finite() -> None:
    t = embstore.Table(4, optimizer=optim.RowWiseAdagrad(lr=3e38), dtype="bfloat16")
    t.lookup([1, 2])
    refusals = []
    for _ in range(4):
        try:
            t.apply_gradients([1, 2], np.ones((2, 4), np.float32))
        except ValueError as e:
            refusals.append(str(e))
    assert all(r.startswith("grads: this step would make") for r in refusals), refusals
    assert all_finite(t)


def test_ordinary_training_is_untouched_by_the_checks() -> None:
    """Settings a model uses keep stepping for thousands of steps (the
    bounds' predictions stay far from overflow), equal to a NumPy SGD."""
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.1, weight_decay=0.01), seed=1)
    rows = t.lookup(np.arange(8)).astype(np.float64)
    g = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
    for _ in range(2000):
        t.apply_gradients(np.arange(8), g)
        rows = (rows - np.float32(0.1) * (g + np.float32(0.01) * rows)).astype(np.float32)
    np.testing.assert_allclose(t.lookup(np.arange(8), insert=False), rows, rtol=1e-4, atol=1e-5)
    assert t.step == 2000


def test_duplicate_gradients_whose_sum_overflows_are_refused() -> None:
    t = embstore.Table(4, optimizer=optim.SGD(lr=1.0))
    t.lookup([1, 2])
    before = table_snapshot(t)
    g = np.full((2, 4), 3e38, np.float32)
    with pytest.raises(ValueError, match=r"^grads: the gradients of key 1 sum to"):
        t.apply_gradients([1, 1], g)
    assert_same(before, table_snapshot(t))


def test_huge_weights_are_refused_in_the_forward_and_the_backward() -> None:
    t = embstore.Table(4, optimizer=optim.SGD(lr=1.0))
    t.assign([1, 2], np.full((2, 4), 10.0, np.float32))
    before = table_snapshot(t)
    ids, offsets, w = np.array([1, 2]), np.array([0, 2]), np.array([1e38, 1e38], np.float32)
    with pytest.raises(ValueError, match=r"^weights: pooling with these weights overflows"):
        t.lookup_pooled(ids, offsets, weights=w)
    with pytest.raises(ValueError, match=r"^grads: the gradients of key 1"):
        t.apply_pooled_gradients([1, 1], offsets, np.full((1, 4), 10.0), weights=w)
    assert_same(before, table_snapshot(t))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: init.Constant(1e300), r"^value: expected a number finite as float32"),
        (lambda: init.Uniform(-1e300, 1e300), r"^low: expected a number finite as float32"),
        (lambda: init.Uniform(-3e38, 3e38), r"^high: expected high - low finite as float32"),
        (lambda: optim.SGD(lr=1e300), r"^lr: expected a finite lr > 0 \(finite as float32\)"),
        (lambda: optim.Adam(lr=10**400), r"^lr: expected a number finite as float32"),
    ],
)
def test_parameters_beyond_float32_are_refused(make: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()  # type: ignore[operator]


def test_a_16_bit_table_refuses_values_it_cannot_hold() -> None:
    t = embstore.Table(4, optimizer=optim.SGD(lr=1.0), dtype="float16")
    t.assign([1], np.ones((1, 4)))
    before = table_snapshot(t)
    with pytest.raises(ValueError, match=r"^values: expected values that float16 rows hold"):
        t.assign([1, 2], np.full((2, 4), 1e5))
    assert_same(before, table_snapshot(t))
    with pytest.raises(ValueError, match=r"^initializer: expected values that float16 rows"):
        embstore.Table(4, dtype="float16", initializer=init.Constant(1e5))
    # Training saturates a 16-bit row at its largest value instead of inf.
    t.apply_gradients([1], np.full((1, 4), -1e6, np.float32))
    assert np.isfinite(t.lookup([1])).all()


@pytest.mark.parametrize(
    ("dtype", "fits", "beyond"),
    [
        ("float16", 65519.0, 65520.0),  # 65519 rounds to 65504, 65520 to inf
        ("bfloat16", 3.3895e38, np.finfo(np.float32).max),
        ("int8", np.finfo(np.float32).max / 2, np.finfo(np.float32).max),
    ],
)
def test_the_largest_value_a_format_holds_is_found_in_large_batches(
    dtype: str, fits: float, beyond: float
) -> None:
    """A batch of more than 64 Ki values (scanned in blocks on the pool)
    holding the largest value a format stores finitely is taken; one
    value beyond it, anywhere, refuses the whole batch naming it."""
    t = embstore.Table(64, dtype=dtype)
    keys = np.arange(2048)
    rows = np.random.default_rng(0).standard_normal((2048, 64)).astype(np.float32)
    rows[1500, 7] = fits
    t.assign(keys, rows)
    before = table_snapshot(t)
    rows[1700, 3] = -beyond
    with pytest.raises(ValueError, match=rf"^values: expected values that {dtype} rows hold"):
        t.assign(keys, rows)
    assert_same(before, table_snapshot(t))
