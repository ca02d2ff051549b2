"""Lookup of existing keys: embstore against torch.index_select and a dict."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benches.conftest import VOCAB, Workload


@pytest.mark.benchmark(group="lookup")
def test_embstore_lookup(benchmark, workload: Workload) -> None:  # type: ignore[no-untyped-def]
    out = benchmark(workload.table.lookup, workload.ids)
    benchmark.extra_info["correct"] = bool(
        np.array_equal(out, workload.table.lookup(workload.ids, insert=False))
    )
    assert out.shape == (workload.ids.size, 64)


@pytest.mark.benchmark(group="lookup")
def test_torch_index_select(benchmark, workload: Workload) -> None:  # type: ignore[no-untyped-def]
    weight = torch.from_numpy(workload.table.lookup(np.arange(VOCAB), insert=False))
    ids = torch.from_numpy(workload.ids)
    out = benchmark(torch.index_select, weight, 0, ids)
    np.testing.assert_array_equal(out.numpy(), workload.table.lookup(workload.ids))


@pytest.mark.benchmark(group="lookup")
def test_dict_of_rows_stack(benchmark, workload: Workload) -> None:  # type: ignore[no-untyped-def]
    rows = dict(enumerate(workload.table.lookup(np.arange(VOCAB), insert=False)))
    keys = workload.ids.tolist()
    out = benchmark(lambda: np.stack([rows[k] for k in keys]))
    np.testing.assert_array_equal(out, workload.table.lookup(workload.ids))
