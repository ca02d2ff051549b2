"""Session-scoped workloads for the pytest-benchmark suites.

Sizes default to small (the suites also run, once each, inside the test
suite with --benchmark-disable); set EMBSTORE_BENCH_VOCAB / _IDS for the
issue's sizes, e.g. ``make bench``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest

import embstore
from embstore import optim

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
