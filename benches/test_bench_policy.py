"""The memory policies' bookkeeping: lookup and Adam step on a full table
with each policy configured (nothing evicted or refused), next to the table
without policies (the "none" case, each group's peer); and a DeviceCache
training step next to the table's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import embstore
from benches.conftest import DIM, VOCAB, Workload, attach
from embstore import optim
from embstore.bench import POLICIES
from embstore.gpu import DeviceCache


def full_table(**kwargs: Any) -> embstore.Table:
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=1e-3), **kwargs)
    keys = np.arange(VOCAB)
    table.apply_gradients(keys, np.zeros((VOCAB, DIM), np.float32))
    return table


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.benchmark(group="policy-lookup")
def test_lookup_under_policy(benchmark, workload: Workload, name: str) -> None:  # type: ignore[no-untyped-def]
    table = full_table(**POLICIES[name])
    rows = benchmark(table.lookup, workload.ids)
    attach(benchmark, table)
    assert rows.shape == (workload.ids.size, DIM)
    assert len(table) == VOCAB  # nothing evicted, nothing added


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.benchmark(group="policy-adam-step")
def test_adam_step_under_policy(benchmark, workload: Workload, name: str) -> None:  # type: ignore[no-untyped-def]
    table = full_table(**POLICIES[name])
    before = table.step
    benchmark(table.apply_gradients, workload.ids, workload.grads)
    attach(benchmark, table)
    assert table.step > before
    assert len(table) == VOCAB


@pytest.mark.benchmark(group="device-cache-step")
def test_table_step_without_a_cache(benchmark, workload: Workload) -> None:  # type: ignore[no-untyped-def]
    """The peer of the cached step: the same step on the table alone."""
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=1e-3))

    def step() -> None:
        table.lookup(workload.ids)
        table.apply_gradients(workload.ids, workload.grads)

    benchmark(step)
    attach(benchmark, table)
    assert table.step >= 1


@pytest.mark.benchmark(group="device-cache-step")
def test_device_cache_step_numpy(benchmark, workload: Workload) -> None:  # type: ignore[no-untyped-def]
    cache = DeviceCache(embstore.Table(DIM, optimizer=optim.Adam(lr=1e-3)), VOCAB // 10, xp=np)

    def step() -> None:
        cache.lookup(workload.ids)
        cache.apply_gradients(workload.ids, workload.grads)

    benchmark(step)
    attach(benchmark, cache)
    # Full: every slot of its whole buckets (at least the rows asked for).
    assert cache.stats()["rows_cached"] == cache.capacity >= VOCAB // 10
