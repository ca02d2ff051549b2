"""String keys: embstore.hash_keys against a hashlib loop (what users wrote
by hand) on the same strings. Size: EMBSTORE_BENCH_STRINGS (default 100,000;
RESULTS.md quotes 1,000,000)."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

import embstore

N = int(os.environ.get("EMBSTORE_BENCH_STRINGS", 100_000))


@pytest.fixture(scope="module")
def strings() -> list[str]:
    rng = np.random.default_rng(0)
    return [f"user:{i}:{c}" for i, c in enumerate(rng.integers(0, 10**6, N))]


def hashlib_loop(values: list[str]) -> np.ndarray:
    return np.array(
        [
            int.from_bytes(
                hashlib.blake2b(v.encode(), digest_size=8).digest(), "little", signed=True
            )
            for v in values
        ],
        dtype=np.int64,
    )


@pytest.mark.benchmark(group="hash_keys")
def test_hash_keys_list(benchmark, strings: list[str]) -> None:  # type: ignore[no-untyped-def]
    keys = benchmark(embstore.hash_keys, strings)
    assert keys.shape == (N,)
    assert np.unique(keys).size == N


@pytest.mark.benchmark(group="hash_keys")
def test_hash_keys_numpy_unicode(benchmark, strings: list[str]) -> None:  # type: ignore[no-untyped-def]
    arr = np.array(strings)
    keys = benchmark(embstore.hash_keys, arr)
    assert keys.tolist() == embstore.hash_keys(strings).tolist()


@pytest.mark.benchmark(group="hash_keys")
def test_hashlib_blake2b_loop(benchmark, strings: list[str]) -> None:  # type: ignore[no-untyped-def]
    keys = benchmark(hashlib_loop, strings)
    assert np.unique(keys).size == N
