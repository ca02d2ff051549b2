"""torch.compile over models with embstore modules: the modules' forward and
backward are registered custom ops (embstore::lookup, embstore::step), so
dynamo traces none of their NumPy code. Five compiled training steps equal
five eager ones, with and without ``fullgraph=True``: bit for bit in the
tables and the dense layer with aot_eager (the dense layers run the same
kernels), to float rounding with inductor (which fuses the dense layers'
backward into kernels of its own, so the gradients reaching the tables
round differently)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import embstore
import embstore.torch as et
from embstore import optim
from tests._kjt import FakeKJT as KJT

torch._dynamo.config.cache_size_limit = 64


class Model(nn.Module):
    """Every embstore module in one DLRM-style model: an Embedding with
    padding, a mean EmbeddingBag with per-sample weights, and an
    EmbeddingBagCollection fed a mapping and a KJT, over tables of
    different optimizers."""

    def __init__(self) -> None:
        super().__init__()
        self.user = et.Embedding(
            embstore.Table(8, optimizer=optim.Adam(lr=0.05), seed=1), padding_idx=0
        )
        self.item = et.EmbeddingBag(
            embstore.Table(8, optimizer=optim.Adagrad(lr=0.1), seed=2),
            mode="mean",
            include_last_offset=True,
        )
        shared = embstore.Table(8, optimizer=optim.SGD(lr=0.1), seed=3)
        self.pair = et.EmbeddingBagCollection(embstore.Collection({"a": shared, "b": shared}))
        self.seq = et.EmbeddingBagCollection(
            embstore.Collection(
                {"hist": embstore.Table(4, optimizer=optim.RowWiseAdagrad(lr=0.1), seed=4)}
            )
        )
        torch.manual_seed(0)
        self.head = nn.Linear(36, 1)

    def forward(self, b: dict[str, Any]) -> torch.Tensor:
        e = torch.cat(
            [
                self.user(b["user"]),
                self.item(b["ids"], b["offsets"], b["weights"]),
                self.pair({"a": b["a"], "b": b["b"]}),
                self.seq(b["kjt"]).values(),
            ],
            dim=1,
        )
        out: torch.Tensor = self.head(torch.relu(e)).squeeze(1)
        return out

    def tables(self) -> list[embstore.Table]:
        return [
            self.user.table,
            self.item.table,
            self.pair.collection.tables["a"],
            self.seq.collection.tables["hist"],
        ]


def batches(n: int = 5, size: int = 16) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        bag = rng.integers(0, 4, size)
        hist = rng.integers(0, 3, size)
        out.append(
            {
                "user": torch.from_numpy(rng.integers(0, 20, size)),  # 0 pads
                "ids": torch.from_numpy(rng.integers(0, 30, int(bag.sum()))),
                "offsets": torch.from_numpy(np.concatenate([[0], np.cumsum(bag)])),
                "weights": torch.from_numpy(rng.random(int(bag.sum())).astype(np.float32)),
                "a": torch.from_numpy(rng.integers(0, 50, size)),
                "b": torch.from_numpy(rng.integers(0, 50, size)),
                "kjt": KJT(
                    ["hist"],
                    torch.from_numpy(rng.integers(0, 40, int(hist.sum()))),
                    torch.from_numpy(hist),
                ),
                "y": torch.from_numpy(rng.random(size).astype(np.float32)),
            }
        )
    return out


def train(compile_args: dict[str, Any] | None) -> Model:
    torch._dynamo.reset()
    model = Model()
    run = model if compile_args is None else torch.compile(model, **compile_args)
    opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
    for b in batches():
        loss = nn.functional.mse_loss(run(b), b["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@pytest.mark.parametrize(
    "compile_args",
    [
        {"backend": "aot_eager", "fullgraph": True},
        {"backend": "aot_eager"},
        {"backend": "inductor", "fullgraph": True},
    ],
    ids=["aot_eager-fullgraph", "aot_eager", "inductor-fullgraph"],
)
def test_compiled_training_equals_eager(compile_args: dict[str, Any]) -> None:
    eager, compiled = train(None), train(compile_args)
    exact = compile_args["backend"] == "aot_eager"
    for a, b in zip(eager.tables(), compiled.tables(), strict=True):
        ka, ra = a.export()
        kb, rb = b.export()
        np.testing.assert_array_equal(ka, kb)
        if exact:
            np.testing.assert_array_equal(ra, rb)
        else:
            np.testing.assert_allclose(ra, rb, rtol=1e-5, atol=1e-7)
        assert a.step == b.step == 5
    if exact:
        assert torch.equal(eager.head.weight, compiled.head.weight)
    else:
        torch.testing.assert_close(eager.head.weight, compiled.head.weight)
    assert 0 not in eager.user.table.export()[0]  # padding is never stored


def test_a_compiled_model_under_no_grad_or_in_eval_stores_nothing() -> None:
    torch._dynamo.reset()
    model = Model()
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    b = batches(1)[0]
    with torch.no_grad():
        run(b)
    model.eval()
    run(b)
    assert all(len(t) == 0 for t in model.tables())
    model.train()
    run(b)
    assert all(len(t) > 0 for t in model.tables())


def test_the_unpooled_collection_compiles_and_trains_as_eager() -> None:
    """EmbeddingCollection's split of the rows per feature depends on the
    lengths' values, so dynamo breaks the graph there (no fullgraph); the
    lookup and its backward are still the ops."""

    def run(compiled: bool) -> embstore.Table:
        torch._dynamo.reset()
        table = embstore.Table(4, optimizer=optim.Adam(lr=0.1), seed=5)
        ec = et.EmbeddingCollection(embstore.Collection({"q": table, "d": table}))

        def step(kjt: KJT) -> torch.Tensor:
            out = ec(kjt)
            return (out["q"].values().sum(0) * out["d"].values().mean(0)).sum()

        f = torch.compile(step, backend="aot_eager") if compiled else step
        rng = np.random.default_rng(1)
        for _ in range(5):
            lengths = torch.from_numpy(rng.integers(0, 4, 6))
            kjt = KJT(["q", "d"], torch.from_numpy(rng.integers(0, 9, int(lengths.sum()))), lengths)
            f(kjt).backward()
        return table

    a, b = run(False), run(True)
    np.testing.assert_array_equal(a.export()[1], b.export()[1])
    assert a.step == b.step == 5


def test_the_ops_pass_torchs_opcheck() -> None:
    """torch.library.opcheck: the schema, the fake (shape-only) forward
    against the real one, the autograd registration, and AOT dispatch with
    dynamic shapes, for each module kind's inputs."""
    from embstore.torch import _ops

    table = embstore.Table(4, optimizer=optim.SGD(lr=0.1), seed=0)
    bag = et.EmbeddingBag(table, mode="sum", padding_idx=3)
    emb = et.Embedding(table)
    ebc = et.EmbeddingBagCollection(embstore.Collection({"a": table, "b": table}))
    ec = et.EmbeddingCollection(embstore.Collection({"a": table}))
    cases = [
        (bag, [torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]), torch.rand(4)], ""),
        (bag, [torch.tensor([[1, 2], [3, 4]]), None, None], ""),
        (emb, [torch.tensor([[1, 2], [3, 9]])], ""),
        (ebc, [torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1, 0]), None], "kjt\x1fa\x1fb"),
        (ec, [torch.tensor([5, 6, 7]), torch.tensor([1, 2])], "kjt\x1fa"),
    ]
    for module, inputs, spec in cases:
        result = torch.library.opcheck(
            torch.ops.embstore.lookup.default, (_ops._ANCHOR, inputs, module._handle, True, spec)
        )
        assert set(result.values()) == {"SUCCESS"}, (module, result)
