"""Gradient accumulation in the torch modules, against torch's own: a
module with ``accumulate=k`` steps its tables once every k backward calls
with the calls' gradients summed, as ``nn.Embedding(sparse=True)`` /
``nn.EmbeddingBag`` with torch.optim.SparseAdam stepped after k backwards;
the default (``accumulate=1``) steps at every backward, as TorchRec's fused
tables, which torch matches by stepping after each backward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import embstore
import embstore.torch as et
from embstore import optim

DIM, VOCAB = 4, 30


def pair(seed: int = 0) -> tuple[embstore.Table, nn.Parameter]:
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=seed)
    weight = nn.Parameter(torch.from_numpy(table.lookup(np.arange(VOCAB), insert=False)))
    return table, weight


def id_batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(rng.integers(0, VOCAB, (3, 5))) for _ in range(n)]


def loss_of(rows: torch.Tensor, i: int) -> torch.Tensor:
    w = torch.linspace(-1.0, 1.0, rows.shape[-1]) * (i + 1)
    return (rows * w).sum() + (rows**2).sum() * 0.1


@pytest.mark.parametrize("k", [1, 3])
def test_embedding_steps_once_every_k_backwards_as_torch_accumulates(k: int) -> None:
    table, weight = pair()
    module = et.Embedding(table, accumulate=k)
    opt = torch.optim.SparseAdam([weight], lr=0.05)
    for i, ids in enumerate(id_batches(6)):
        loss_of(module(ids), i).backward()
        loss_of(nn.functional.embedding(ids, weight, sparse=True), i).backward()
        if (i + 1) % k == 0:
            opt.step()
            opt.zero_grad()
    assert table.step == 6 // k
    assert module.pending_backwards == 0
    keys = np.arange(VOCAB)
    np.testing.assert_allclose(
        table.lookup(keys, insert=False), weight.detach().numpy(), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_accumulates_as_torch(mode: str) -> None:
    table, weight = pair(1)
    bag = et.EmbeddingBag(table, mode=mode, accumulate=2)
    ref = nn.EmbeddingBag(VOCAB, DIM, mode=mode, sparse=True)
    ref.weight = weight
    opt = torch.optim.SparseAdam([weight], lr=0.05)
    rng = np.random.default_rng(2)
    for i in range(4):
        ids = torch.from_numpy(rng.integers(0, VOCAB, 9))
        offsets = torch.tensor([0, 2, 2, 7])
        psw = torch.from_numpy(rng.random(9).astype(np.float32)) if mode == "sum" else None
        loss_of(bag(ids, offsets, psw), i).backward()
        loss_of(ref(ids, offsets, per_sample_weights=psw), i).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
    assert table.step == 2
    np.testing.assert_allclose(
        table.lookup(np.arange(VOCAB), insert=False), weight.detach().numpy(), rtol=1e-5, atol=1e-6
    )


def test_collections_accumulate_per_table_as_one_step() -> None:
    """A table shared by two features of an EmbeddingBagCollection, and a
    table of an EmbeddingCollection: k backwards, one step each, equal to
    the same gradients applied by hand as one apply_gradients call."""
    shared = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1), seed=3)
    twin = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1), seed=3)
    ebc = et.EmbeddingBagCollection(
        embstore.Collection({"a": shared, "b": shared}, combiner="sum"), accumulate=2
    )
    batches = [
        {"a": torch.tensor([1, 2, 3]), "b": torch.tensor([3, 4, 4])},
        {"a": torch.tensor([5, 1, 1]), "b": torch.tensor([2, 2, 9])},
    ]
    keys, grads = [], []
    for i, b in enumerate(batches):
        out = ebc(b)
        g = torch.full_like(out, float(i + 1))
        out.backward(g)
        for name in ("a", "b"):  # a sum of one id per sample: the id gets its sample's grad
            keys.append(b[name].numpy())
            grads.append(np.full((3, DIM), float(i + 1), np.float32))
    assert shared.step == 1
    twin.apply_gradients(np.concatenate(keys), np.concatenate(grads))
    np.testing.assert_allclose(shared.export()[1], twin.export()[1], rtol=1e-6)
    np.testing.assert_array_equal(shared.export()[0], twin.export()[0])

    table = embstore.Table(DIM, optimizer=optim.SGD(lr=1.0), seed=4)
    ec = et.EmbeddingCollection(embstore.Collection({"q": table}), accumulate=3)
    before = table.lookup([7, 8], insert=False)
    for _ in range(3):
        ec({"q": (torch.tensor([7, 8, 7]), torch.tensor([0, 2, 3]))})["q"].values().sum().backward()
    assert table.step == 1
    np.testing.assert_allclose(table.lookup([7, 8]), before - np.array([[6.0], [3.0]]), rtol=1e-6)


def test_flush_discard_and_a_refused_backward() -> None:
    table = embstore.Table(DIM, optimizer=optim.SGD(lr=1.0), seed=5)
    module = et.Embedding(table, accumulate=4)
    before = table.lookup([1], insert=False)
    module(torch.tensor([1])).sum().backward()
    module(torch.tensor([1])).sum().backward()
    assert (module.pending_backwards, table.step) == (2, 0)
    assert module.flush_gradients() is True  # the two, now, as one step
    assert (module.pending_backwards, table.step) == (0, 1)
    np.testing.assert_allclose(table.lookup([1]), before - 2.0, rtol=1e-6)
    assert module.flush_gradients() is False
    module(torch.tensor([1])).sum().backward()
    module.discard_gradients()
    assert module.flush_gradients() is False
    assert table.step == 1
    # A non-finite gradient is refused whole: nothing joins the pending ones.
    with pytest.raises(ValueError, match="non-finite"):
        (module(torch.tensor([1])) * float("inf")).sum().backward()
    assert module.pending_backwards == 0
    with pytest.raises(ValueError, match=r"^accumulate: expected an int >= 1"):
        et.Embedding(table, accumulate=0)
    with pytest.raises(TypeError, match=r"^accumulate: expected an int"):
        et.Embedding(table, accumulate=1.5)  # type: ignore[arg-type]


def test_a_refused_flush_moves_no_table_and_keeps_its_gradients() -> None:
    """Two tables of one collection, accumulate=2: the second table's
    summed gradients overflow float32 (each backward's alone is finite), so
    the flush is refused; the first table must not have stepped and both
    backwards stay pending (at 7e7142d the first table stepped and every
    pending gradient was dropped)."""
    first = embstore.Table(DIM, optimizer=optim.SGD(lr=1.0), seed=6)
    second = embstore.Table(DIM, optimizer=optim.SGD(lr=1.0), seed=7)
    ebc = et.EmbeddingBagCollection(
        embstore.Collection({"a": first, "b": second}, combiner="sum"), accumulate=2
    )
    batch = {"a": torch.tensor([1, 2]), "b": torch.tensor([3, 4])}
    out = ebc(batch)
    before = (first.export(), second.export())
    huge = torch.zeros_like(out)
    huge[:, DIM:] = 3e38
    huge[:, :DIM] = 1.0
    small = torch.ones_like(out)
    out.backward(huge)
    with pytest.raises(ValueError, match="grads"):
        ebc(batch).backward(huge)
    assert (first.step, second.step) == (0, 0)
    assert ebc.pending_backwards == 2
    for (k0, r0), (k1, r1) in zip(before, (first.export(), second.export()), strict=True):
        np.testing.assert_array_equal(k0, k1)
        np.testing.assert_array_equal(r0, r1)
    ebc.discard_gradients()
    ebc(batch).backward(small)
    ebc(batch).backward(small)
    assert (first.step, second.step) == (1, 1)
