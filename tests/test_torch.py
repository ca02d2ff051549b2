"""embstore.torch modules train a model to the same embedding rows and dense
weights as the same model built on torch.nn.EmbeddingBag(sparse=True) +
torch.optim.SparseAdam."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import embstore
import embstore.torch as et
from embstore import optim
from tests.conftest import key_pool

DIM = 8
POOL = 200
BATCH = 32
STEPS = 20


def make_batches(rng: np.random.Generator, pool: np.ndarray) -> list[dict[str, np.ndarray]]:
    out = []
    for _ in range(STEPS):
        b: dict[str, np.ndarray] = {}
        for f in ("user", "item"):
            sizes = rng.integers(0, 4, BATCH)
            b[f + "_offsets"] = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            b[f + "_ids"] = rng.choice(pool, int(sizes.sum())).astype(np.int64)
        b["dense"] = rng.normal(size=(BATCH, 3)).astype(np.float32)
        b["label"] = (rng.random(BATCH) < 0.4).astype(np.float32)
        out.append(b)
    return out


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(2 * DIM + 3, 1)

    def forward(self, emb: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([emb, dense], dim=1)).squeeze(1)


def dense_index(pool: np.ndarray, keys: np.ndarray) -> np.ndarray:
    order = np.argsort(pool)
    return order[np.searchsorted(pool[order], keys)]


def reference(pool: np.ndarray, batches: list, init_rows: dict[str, np.ndarray]) -> tuple:
    bags = {
        f: nn.EmbeddingBag(POOL, DIM, mode="sum", include_last_offset=True, sparse=True)
        for f in ("user", "item")
    }
    for f, bag in bags.items():
        with torch.no_grad():
            bag.weight.copy_(torch.from_numpy(init_rows[f]))
    head = Head()
    sparse = torch.optim.SparseAdam([b.weight for b in bags.values()], lr=0.05)
    dense = torch.optim.Adam(head.parameters(), lr=0.01)
    for b in batches:
        emb = torch.cat(
            [
                bags[f](
                    torch.from_numpy(dense_index(pool, b[f + "_ids"])),
                    torch.from_numpy(b[f + "_offsets"]),
                )
                for f in bags
            ],
            dim=1,
        )
        loss = nn.functional.binary_cross_entropy_with_logits(
            head(emb, torch.from_numpy(b["dense"])), torch.from_numpy(b["label"])
        )
        sparse.zero_grad()
        dense.zero_grad()
        loss.backward()
        sparse.step()
        dense.step()
    return {f: bag.weight.detach().numpy() for f, bag in bags.items()}, head


@pytest.mark.parametrize("style", ["embedding_bag", "collection"])
def test_torch_model_trains_like_embedding_bag_and_sparse_adam(
    rng: np.random.Generator, style: str
) -> None:
    pool = key_pool(rng, POOL)
    batches = make_batches(rng, pool)
    tables = {
        f: embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=s)
        for s, f in enumerate(("user", "item"))
    }
    init_rows = {f: t.lookup(pool, insert=False) for f, t in tables.items()}
    ref_rows, ref_head = reference(pool, batches, init_rows)

    head = Head()
    dense = torch.optim.Adam(head.parameters(), lr=0.01)
    modules = {
        f: et.EmbeddingBag(t, mode="sum", include_last_offset=True) for f, t in tables.items()
    }
    coll = et.EmbeddingBagCollection(embstore.Collection(tables))
    for b in batches:
        if style == "embedding_bag":
            emb = torch.cat(
                [
                    modules[f](torch.from_numpy(b[f + "_ids"]), torch.from_numpy(b[f + "_offsets"]))
                    for f in modules
                ],
                dim=1,
            )
        else:
            emb = coll({f: (b[f + "_ids"], b[f + "_offsets"]) for f in tables})
        assert emb.requires_grad
        loss = nn.functional.binary_cross_entropy_with_logits(
            head(emb, torch.from_numpy(b["dense"])), torch.from_numpy(b["label"])
        )
        dense.zero_grad()
        loss.backward()
        dense.step()
    for f, t in tables.items():
        keys, rows = t.export()
        np.testing.assert_allclose(rows, ref_rows[f][dense_index(pool, keys)], rtol=1e-5, atol=1e-6)
        assert t.step == STEPS
    for p, q in zip(head.parameters(), ref_head.parameters(), strict=True):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_embedding_module_rows_and_gradient_step() -> None:
    table = embstore.Table(4, optimizer=optim.SGD(lr=1.0))
    module = et.Embedding(table)
    ids = torch.tensor([3, 5, 3])
    before = table.lookup([3, 5], insert=False)
    out = module(ids)
    assert out.shape == (3, 4)
    assert out.requires_grad
    out.sum().backward()
    np.testing.assert_allclose(table.lookup([3, 5]), before - np.array([[2.0], [1.0]]), rtol=1e-6)
    assert "dim=4" in repr(module)


def test_modules_refuse_wrong_arguments() -> None:
    with pytest.raises(TypeError, match=r"^table: expected an embstore tier"):
        et.Embedding("t")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r'^mode: embstore pools with "sum", "mean" or "sqrtn"'):
        et.EmbeddingBag(embstore.Table(2), combiner="max")
    with pytest.raises(ValueError, match=r"^combiner: expected one of"):
        et.EmbeddingBag(embstore.Table(2), mode="median")
    with pytest.raises(TypeError, match=r"^collection: expected an embstore.Collection"):
        et.EmbeddingBagCollection({})  # type: ignore[arg-type]


def test_a_model_deep_copies_and_saves_whole_with_its_tables(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """copy.deepcopy(model) (EMA, SWA, keep-the-best snapshots) and
    torch.save(model) / torch.load(weights_only=False) copy the tables by
    value: the copy's forward equals the original's, and training the copy
    leaves the original's tables as they were."""
    import copy

    table = embstore.Table(4, optimizer=optim.Adagrad(lr=0.1), seed=3)
    model = nn.Sequential(et.Embedding(table), nn.Flatten(), nn.Linear(8, 1))
    ids = torch.tensor([[1, 2], [3, 1]])
    model(ids).sum().backward()  # one step: the table holds trained rows
    saved = tmp_path / "model.pt"
    torch.save(model, saved)
    copies = [copy.deepcopy(model), torch.load(saved, weights_only=False)]
    model.eval()
    want = model(ids).detach()
    for c in copies:
        c.eval()
        torch.testing.assert_close(c(ids).detach(), want, rtol=0, atol=0)
        assert c[0].table is not table
    before = table.state_dict()
    copies[0].train()
    copies[0](ids).sum().backward()  # trains the copy's table only
    for name, a in table.state_dict().items():
        np.testing.assert_array_equal(before[name], a, err_msg=name)
    assert copies[0][0].table.step == table.step + 1
    import pickle

    torch.save(table, tmp_path / "table.pt")
    with pytest.raises(pickle.UnpicklingError, match="_restore_table"):
        torch.load(tmp_path / "table.pt", weights_only=True)  # no constructor runs


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_padding_idx_pools_as_nothing_as_torch_does(mode: str) -> None:
    """padding_idx against torch.nn.EmbeddingBag / nn.Embedding with the
    same rows and SGD: outputs and one training step equal; the padding id
    is never stored; embedding_dim and num_embeddings read the table."""
    pad = 0
    ids = torch.tensor([3, 0, 5, 0, 0, 7, 3, 0])
    offsets = torch.tensor([0, 2, 5, 7])  # bags [3, 0], [5, 0, 0], [7, 3], [0]
    table = embstore.Table(4, optimizer=optim.SGD(lr=0.5), seed=2)
    ours = et.EmbeddingBag(table, mode=mode, padding_idx=pad)
    ref = nn.EmbeddingBag(10, 4, mode=mode, padding_idx=pad)
    with torch.no_grad():
        ref.weight.zero_()
        ref.weight[[3, 5, 7]] = torch.from_numpy(table.lookup([3, 5, 7], insert=False))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    got, want = ours(ids, offsets), ref(ids, offsets)
    torch.testing.assert_close(got, want)
    g = torch.arange(16, dtype=torch.float32).reshape(4, 4) / 10
    (got * g).sum().backward()
    (want * g).sum().backward()
    opt.step()
    assert sorted(table.export()[0].tolist()) == [3, 5, 7]  # no row for the padding id
    torch.testing.assert_close(
        torch.from_numpy(table.lookup([3, 5, 7], insert=False)), ref.weight[[3, 5, 7]].detach()
    )
    assert (ours.embedding_dim, ours.num_embeddings) == (4, 3)
    emb = et.Embedding(table, padding_idx=pad)
    out = emb(torch.tensor([[3, 0], [0, 5]]))
    assert out[0, 1].abs().sum() == 0  # padding: zeros where the table holds no row
    assert out[1, 0].abs().sum() == 0
    torch.testing.assert_close(out[0, 0], torch.from_numpy(table.lookup([3], insert=False))[0])


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"max_norm": 0.0}, "max_norm"),
        ({"max_norm": "1"}, "max_norm"),
        ({"norm_type": -1.0}, "norm_type"),
        ({"scale_grad_by_freq": True}, "scale_grad_by_freq"),
        ({"sparse": "yes"}, "sparse"),
        ({"padding_idx": 1.5}, "padding_idx"),
    ],
)
def test_unsupported_nn_arguments_are_refused_by_name(kwargs: dict, arg: str) -> None:
    table = embstore.Table(4)
    for cls in (et.Embedding, et.EmbeddingBag):
        with pytest.raises((TypeError, ValueError), match=rf"^{arg}\b"):
            cls(table, **kwargs)
    assert et.EmbeddingBag(table, sparse=True).sparse  # accepted: updates are row-wise


def test_a_forward_without_gradients_stores_nothing() -> None:
    """A torch.no_grad() validation pass in train mode stores no row (as
    eval mode), for every module; with gradients it stores the new ids."""
    table = embstore.Table(4, optimizer=optim.SGD(lr=0.1))
    coll = embstore.Collection({"a": table})
    modules = [
        (et.Embedding(table), (torch.tensor([1, 2]),)),
        (et.EmbeddingBag(table, mode="sum"), (torch.tensor([3, 4]), torch.tensor([0, 1]))),
        (et.EmbeddingBagCollection(coll), ({"a": np.array([5, 6])},)),
    ]
    for module, args in modules:
        module.train()
        with torch.no_grad():
            module(*args)
        assert len(table) == 0, type(module).__name__
    for module, args in modules:
        module(*args)
    assert len(table) == 6


def test_gradient_reduction_is_checked_and_changes_nothing_over_one_process() -> None:
    """Over tables of one process "mean" and "sum" step alike, with no
    warning (the choice matters over N ranks: tests/torchrun/gloo_suite.py
    trains N ranks of batch b as one process of batch N*b)."""
    with pytest.raises(ValueError, match=r'^gradient_reduction: expected "mean" or "sum"'):
        et.EmbeddingBag(embstore.Table(4), gradient_reduction="avg")
    with pytest.raises(ValueError, match=r"^gradient_reduction"):
        et.EmbeddingBagCollection(
            embstore.Collection({"a": embstore.Table(4)}), gradient_reduction=1
        )
    rows = []
    for reduction in ("mean", "sum", None):
        table = embstore.Table(4, optimizer=optim.SGD(lr=0.5), seed=3)
        bag = et.EmbeddingBag(table, mode="sum", gradient_reduction=reduction)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no DeprecationWarning over one process
            bag(torch.tensor([[1, 2], [2, 3]])).sum().backward()
        rows.append(table.lookup([1, 2, 3], insert=False))
    np.testing.assert_array_equal(rows[0], rows[1])
    np.testing.assert_array_equal(rows[0], rows[2])
