"""One Adam step on a batch, embstore against torch.optim.SparseAdam; and
inserting new keys, embstore against a dict of rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benches.conftest import VOCAB, Workload, attach


@pytest.mark.benchmark(group="adam-step")
def test_embstore_adam(benchmark, workload: Workload) -> None:  # type: ignore[no-untyped-def]
    before = workload.table.step
    benchmark(workload.table.apply_gradients, workload.ids, workload.grads)
    assert workload.table.step > before


@pytest.mark.benchmark(group="adam-step")
def test_torch_sparse_adam(benchmark, workload: Workload) -> None:  # type: ignore[no-untyped-def]
    param = torch.nn.Parameter(torch.zeros(VOCAB, 64))
    opt = torch.optim.SparseAdam([param], lr=1e-3)
    ids = torch.from_numpy(workload.ids)[None, :]
    grads = torch.from_numpy(workload.grads)

    def step() -> None:
        param.grad = torch.sparse_coo_tensor(ids, grads, param.shape, check_invariants=False)
        opt.step()

    benchmark(step)
    assert float(param.detach().abs().sum()) > 0


@pytest.mark.benchmark(group="insert")
def test_embstore_insert_new_keys(benchmark, workload: Workload) -> None:  # type: ignore[no-untyped-def]
    import embstore

    keys = np.unique(workload.ids) + 10 * VOCAB
    values = np.zeros((keys.size, 64), np.float32)

    def insert() -> embstore.Table:
        table = embstore.Table(64)
        table.assign(keys, values)
        assert len(table) == keys.size
        return table

    attach(benchmark, benchmark(insert))


@pytest.mark.benchmark(group="insert")
def test_dict_insert_new_keys(benchmark, workload: Workload) -> None:  # type: ignore[no-untyped-def]
    """The peer: a dict of NumPy rows, filled with the same keys."""
    keys = (np.unique(workload.ids) + 10 * VOCAB).tolist()
    values = np.zeros((len(keys), 64), np.float32)

    def insert() -> None:
        rows = dict(zip(keys, values, strict=True))
        assert len(rows) == len(keys)

    benchmark(insert)
