"""Session-scoped workloads for the pytest-benchmark suites.

Sizes default to small (the suites also run, once each, inside the test
suite with --benchmark-disable); set EMBSTORE_BENCH_VOCAB / _IDS for the
issue's sizes, e.g. ``make bench``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import embstore
from embstore import optim
from embstore.bench._timing import machine_facts

VOCAB = int(os.environ.get("EMBSTORE_BENCH_VOCAB", 100_000))
IDS = int(os.environ.get("EMBSTORE_BENCH_IDS", 65_536))
DIM = 64


@dataclass
class Workload:
    ids: np.ndarray
    grads: np.ndarray
    table: embstore.Table


@pytest.fixture(scope="session")
def workload() -> Workload:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, IDS)
    grads = rng.standard_normal((IDS, DIM), dtype=np.float32)
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=1e-3))
    table.lookup(np.arange(VOCAB))
    return Workload(ids, grads, table)


def attach(benchmark: Any, table: Any) -> None:
    """Record ``table``'s stats (rows, bytes, dtype, SIMD backend, counters)
    in the benchmark's result (``extra_info["table"]``), read after the
    timed calls."""
    benchmark.extra_info["table"] = table.stats()


@pytest.fixture(autouse=True)
def _facts(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every benchmark's result carries the machine's facts, and the stats of
    the table it ran on: one it attached itself (:func:`attach`), else the
    session workload's."""
    if "benchmark" not in request.fixturenames:
        yield
        return
    # Asked for first, so that it is torn down after this fixture's end.
    benchmark = request.getfixturevalue("benchmark")
    yield
    benchmark.extra_info.update(machine_facts())
    if "table" not in benchmark.extra_info and "workload" in request.fixturenames:
        attach(benchmark, request.getfixturevalue("workload").table)
