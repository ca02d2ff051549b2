"""A Collection step (pooled forward + backward + Adam) against
torch.nn.EmbeddingBag + SparseAdam, 26 features, one id per feature."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import embstore
from benches.conftest import DIM, IDS, VOCAB, attach
from embstore import optim

FIELDS = 26
BATCH = max(1, IDS // FIELDS)


@pytest.fixture(scope="module")
def feed() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    keys = rng.integers(0, VOCAB, (FIELDS, BATCH))
    offsets = np.arange(BATCH + 1, dtype=np.int64)
    upstream = rng.standard_normal((BATCH, FIELDS * DIM), dtype=np.float32)
    return keys, offsets, upstream


@pytest.mark.benchmark(group="collection-step")
def test_embstore_collection_step(benchmark, feed) -> None:  # type: ignore[no-untyped-def]
    keys, offsets, upstream = feed
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=1e-3))
    table.lookup(np.arange(VOCAB))
    coll = embstore.Collection({f"f{f}": table for f in range(FIELDS)})
    batch = {f"f{f}": (keys[f], offsets) for f in range(FIELDS)}

    def step() -> None:
        coll.lookup_pooled(batch)
        coll.apply_pooled_gradients(batch, upstream)

    benchmark(step)
    attach(benchmark, table)
    assert table.step >= 1


@pytest.mark.benchmark(group="collection-step")
def test_torch_shared_embedding_bag_step(benchmark, feed) -> None:  # type: ignore[no-untyped-def]
    keys, _, upstream = feed
    bag = torch.nn.EmbeddingBag(VOCAB, DIM, mode="sum", include_last_offset=True, sparse=True)
    opt = torch.optim.SparseAdam([bag.weight], lr=1e-3)
    ids = torch.from_numpy(np.ascontiguousarray(keys.T).ravel())
    offsets = torch.arange(ids.numel() + 1)
    up = torch.from_numpy(upstream)

    def step() -> None:
        opt.zero_grad()
        (bag(ids, offsets).view(BATCH, -1) * up).sum().backward()
        opt.step()

    benchmark(step)
