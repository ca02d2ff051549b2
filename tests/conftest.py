"""Shared helpers: key pools with the awkward keys every test should include."""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np
import pytest

import embstore
from embstore.gpu import _xp as X

I64 = np.iinfo(np.int64)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("embstore")
    group.addoption(
        "--chaos-seconds",
        type=float,
        default=float(os.environ.get("EMBSTORE_CHAOS_SECONDS", 60)),
        help="length of the chaos test (default 60, or EMBSTORE_CHAOS_SECONDS)",
    )
    group.addoption(
        "--chaos-seed",
        default=os.environ.get("EMBSTORE_CHAOS_SEED", "random"),
        help="seed of the chaos test: an integer (CI fixes one) or 'random' (the default, "
        "or EMBSTORE_CHAOS_SEED); the seed is printed either way",
    )


def key_pool(rng: np.random.Generator, size: int) -> np.ndarray:
    """Distinct keys: small, negative, huge and the int64 extremes."""
    special = np.array([0, -1, 1, I64.min, I64.max, I64.min + 1, I64.max - 1, 2**62, -(2**62)])
    rest = rng.integers(-(2**40), 2**40, size=size * 2)
    pool = np.unique(np.concatenate([special, rest]))
    rng.shuffle(pool)
    return pool[:size].astype(np.int64)


def batch(rng: np.random.Generator, pool: np.ndarray, n: int) -> np.ndarray:
    """A batch drawn from ``pool`` with repeats (a few keys drawn often)."""
    hot = pool[: max(1, len(pool) // 10)]
    picks = np.where(rng.random(n) < 0.3, rng.choice(hot, n), rng.choice(pool, n))
    return picks.astype(np.int64)


def snapshot(table: embstore.Table) -> tuple[np.ndarray, ...]:
    """Everything observable about a table, to check that a refused call changed nothing."""
    if table.optimizer is None:
        keys, rows = table.export()
        return keys, rows, np.array([table.step])
    keys, rows, state = table.export(with_state=True)
    return keys, rows, state, np.array([table.step])


def assert_same(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(params=embstore._core.simd_backends())
def simd(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each SIMD backend this CPU supports, forced through EMBSTORE_SIMD."""
    monkeypatch.setenv("EMBSTORE_SIMD", request.param)
    return str(request.param)


GPU_OK, GPU_WHY = X.gpu_usable()


@pytest.fixture(
    params=[
        "numpy",
        "array_api_strict",
        "torch",
        pytest.param(
            "cupy",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not GPU_OK, reason=f"no GPU for CuPy: {GPU_WHY}"),
            ],
        ),
    ]
)
def xp(request: pytest.FixtureRequest) -> ModuleType:
    """The array namespaces a DeviceCache runs on here, as modules (CuPy
    where a GPU is usable); a test module may define its own ``xp``."""
    if request.param == "numpy":
        return np
    if request.param == "array_api_strict":
        import array_api_strict

        return array_api_strict
    if request.param == "torch":
        import torch

        return torch
    import cupy  # type: ignore[import-not-found, unused-ignore]

    return cupy  # type: ignore[no-any-return, unused-ignore]
