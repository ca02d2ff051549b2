"""The device cache's array-API optimizers and pooling coefficients equal the
core's bit for bit (rtol=0) on NumPy and array-api-strict, for all six
optimizers, with and without weight decay, at early and late steps."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest

import embstore
from embstore import _core, optim
from embstore.gpu import _optim

try:
    import array_api_strict
except ImportError:  # pragma: no cover - the test extra installs it
    array_api_strict = None

NAMESPACES = [np] + ([array_api_strict] if array_api_strict is not None else [])
DIM = 37  # odd: the kernels' vector loops have a tail

OPTIMIZERS = [
    optim.SGD(lr=0.3),
    optim.SGD(lr=0.3, weight_decay=0.01),
    optim.Adagrad(lr=0.1, initial_accumulator_value=0.2),
    optim.Adagrad(lr=0.1, weight_decay=0.05),
    optim.RowWiseAdagrad(lr=0.2),
    optim.RowWiseAdagrad(lr=0.2, eps=1e-6, weight_decay=0.02),
    optim.Adam(lr=0.01),
    optim.Adam(lr=0.01, beta1=0.8, weight_decay=0.1),
    optim.AdamW(lr=0.01),
    optim.AdamW(lr=0.02, beta2=0.99, weight_decay=0.3),
    optim.Ftrl(lr=0.05, l1=0.001, l2=0.01, beta=0.5),
    optim.Ftrl(lr=0.05, weight_decay=0.01),
]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("xp", NAMESPACES, ids=lambda m: m.__name__)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("t", [1, 2, 17, 1000])
def test_device_step_equals_the_core_bit_for_bit(
    xp: ModuleType, opt: optim.Optimizer, t: int
) -> None:
    rng = np.random.default_rng(t)
    n = 50
    keys = np.arange(n, dtype=np.int64) * 3 + 1
    table = embstore.Table(DIM, optimizer=opt, seed=4)
    w = rng.normal(0, 0.5, (n, DIM)).astype(np.float32)
    state = np.abs(rng.normal(0, 0.3, (n, table.state_len))).astype(np.float32)
    if isinstance(opt, optim.Ftrl):  # linear may be negative; the accumulator not
        state[:, :DIM] -= 0.2
        state[:, DIM:] += 0.1
    g = rng.normal(0, 1.0, (n, DIM)).astype(np.float32)
    g[::7] *= 1e-3  # small gradients: rounding matters most
    table.write_back(keys, w, state)
    while table.step < t - 1:
        table.take_step()
    step = table.take_step()
    assert step == t
    table.apply_gradients(keys, g, step=t)
    _, w_core, st_core = table.export(with_state=True)

    w_dev, st_dev = _optim.step(xp, opt, xp.asarray(w), xp.asarray(state), xp.asarray(g), t)
    np.testing.assert_array_equal(bits(np.asarray(w_dev)), bits(w_core))
    np.testing.assert_array_equal(bits(np.asarray(st_dev)), bits(st_core))


def test_every_optimizer_of_the_core_is_covered() -> None:
    names = {type(o).__name__ for o in OPTIMIZERS}
    assert names == set(embstore._convert.VOCABULARY["optimizers"])


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooling_coefficients_are_the_cores(combiner: str, weighted: bool) -> None:
    """The cache pools with the core's coefficients: pooled rows of a
    DeviceCache (whose rows are all cached) equal the table's bit for bit
    for one id per bag, and the coefficients equal w / denominator."""
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 5, 30)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    ids = rng.integers(0, 40, int(offsets[-1])).astype(np.int64)
    weights = rng.uniform(0.1, 3.0, len(ids)).astype(np.float32) if weighted else None
    bag_of, coef = _core.bag_coefficients(ids, offsets, weights, combiner)
    wt = np.ones(len(ids), np.float32) if weights is None else weights
    for b in range(len(sizes)):
        sel = bag_of == b
        assert sel.sum() == sizes[b]
        if not sel.any():
            continue
        if combiner == "sum":
            denom = np.float32(1)
        elif combiner == "mean":
            denom = np.float32(0)
            for v in wt[sel]:
                denom = np.float32(denom + v)
        else:
            denom = np.float32(0)
            for v in wt[sel]:
                denom = np.float32(denom + v * v)
            denom = np.sqrt(denom)
        np.testing.assert_array_equal(coef[sel], wt[sel] / denom)
    table = embstore.Table(4, optimizer=optim.Adam(), seed=1)
    cache = embstore.gpu.DeviceCache(table, 64, xp=np)
    one = np.arange(len(ids) + 1, dtype=np.int64)
    w1 = None if weights is None else weights
    np.testing.assert_array_equal(
        bits(cache.lookup_pooled(ids, one, combiner=combiner, weights=w1)),
        bits(table.lookup_pooled(ids, one, combiner=combiner, weights=w1, insert=False)),
    )
