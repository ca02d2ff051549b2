"""embstore.torch.EmbeddingBagCollection against TorchRec's own
EmbeddingBagCollection: a real KeyedJaggedTensor in, the same pooled values
out, and after Adagrad steps the same rows (torchrec's tables trained by
torch.optim.Adagrad, whose zero gradient leaves untouched rows as they are).

TorchRec and fbgemm-gpu-cpu pin their own torch version, so they are not in
the test extra; this file runs where they are installed (e.g. a venv with
``pip install torchrec fbgemm-gpu-cpu``) and is skipped, saying so, where
they are not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import embstore
import embstore.torch as et
from embstore import optim

try:
    from torchrec.modules.embedding_configs import (
        EmbeddingBagConfig,
        EmbeddingConfig,
        PoolingType,
    )
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor
except Exception as e:  # ImportError, or fbgemm's operators failing to load
    pytest.skip(
        f"torchrec is not installed here ({type(e).__name__}: {e}); it pins its own torch: "
        "pip install torchrec fbgemm-gpu-cpu in a separate venv to run this file",
        allow_module_level=True,
    )

DIM, VOCAB, BATCH = 8, 100, 16


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_same_pooled_values_and_trained_rows_as_torchrec(pooling: str) -> None:
    rng = np.random.default_rng(0)
    configs = [
        EmbeddingBagConfig(
            name="t_user",
            embedding_dim=DIM,
            num_embeddings=VOCAB,
            feature_names=["user"],
            pooling=PoolingType[pooling.upper()],
        ),
        EmbeddingBagConfig(
            name="t_item",
            embedding_dim=DIM,
            num_embeddings=VOCAB,
            feature_names=["item", "hist"],
            pooling=PoolingType[pooling.upper()],
        ),
    ]
    theirs = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    user = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1, eps=1e-10), seed=1)
    item = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1, eps=1e-10), seed=2)
    with torch.no_grad():  # the same initial rows on both sides
        theirs.embedding_bags["t_user"].weight.copy_(
            torch.from_numpy(user.lookup(np.arange(VOCAB), insert=False))
        )
        theirs.embedding_bags["t_item"].weight.copy_(
            torch.from_numpy(item.lookup(np.arange(VOCAB), insert=False))
        )
    ours = et.EmbeddingBagCollection(
        embstore.Collection({"user": user, "item": item, "hist": item}, combiner=pooling)
    )
    opt = torch.optim.Adagrad(theirs.parameters(), lr=0.1, eps=1e-10)
    for _ in range(10):
        lengths = np.concatenate(
            [np.ones(BATCH, np.int64), np.ones(BATCH, np.int64), rng.integers(1, 5, BATCH)]
        )
        values = rng.integers(0, VOCAB, int(lengths.sum()))
        kjt = KeyedJaggedTensor(
            keys=["user", "item", "hist"],
            values=torch.from_numpy(values),
            lengths=torch.from_numpy(lengths),
        )
        kt_theirs = theirs(kjt)
        kt_ours = ours(kjt)
        assert isinstance(kt_ours, KeyedTensor)
        assert kt_ours.keys() == kt_theirs.keys() == ["user", "item", "hist"]
        for k in ("user", "item", "hist"):
            torch.testing.assert_close(kt_ours[k], kt_theirs[k], rtol=1e-5, atol=1e-6)
        g = torch.from_numpy(rng.normal(size=kt_ours.values().shape).astype(np.float32))
        (kt_ours.values() * g).sum().backward()
        opt.zero_grad()
        (kt_theirs.values() * g).sum().backward()
        opt.step()
    for table, name in ((user, "t_user"), (item, "t_item")):
        keys, rows = table.export()
        w = theirs.embedding_bags[name].weight.detach().numpy()
        np.testing.assert_allclose(rows, w[keys], rtol=1e-5, atol=1e-6)
        untouched = np.setdiff1d(np.arange(VOCAB), keys)
        np.testing.assert_array_equal(w[untouched], table.lookup(untouched, insert=False))


def test_modules_built_from_torchrecs_own_configs() -> None:
    """torchrec's EmbeddingBagConfig objects (enums for pooling and data
    type) build the same collection as embstore's configs do."""
    configs = [
        EmbeddingBagConfig(
            name="t_user", embedding_dim=DIM, num_embeddings=VOCAB, feature_names=["user"]
        ),
        EmbeddingBagConfig(
            name="t_item",
            embedding_dim=4,
            num_embeddings=VOCAB,
            feature_names=["item", "hist"],
            pooling=PoolingType.MEAN,
        ),
    ]
    ebc = et.EmbeddingBagCollection(tables=configs, optimizer=optim.Adagrad(lr=0.1))
    assert ebc.collection.features == ["user", "item", "hist"]
    assert ebc.collection.dims == [DIM, 4, 4]
    assert ebc.collection._combiners == {"user": "sum", "item": "mean", "hist": "mean"}
    bound = (1 / VOCAB) ** 0.5
    rows = ebc.collection.tables["user"].lookup(np.arange(1000), insert=False)
    assert np.abs(rows).max() <= bound
    ec = et.EmbeddingCollection(
        tables=[
            EmbeddingConfig(
                name="t_seq", embedding_dim=DIM, num_embeddings=VOCAB, feature_names=["q"]
            )
        ],
        optimizer=optim.SGD(lr=0.1),
    )
    kjt = KeyedJaggedTensor(
        keys=["q"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 0, 1])
    )
    out = ec(kjt)
    assert isinstance(out["q"], JaggedTensor)


def test_unpooled_rows_and_training_equal_torchrecs_embedding_collection() -> None:
    """TorchRec's EmbeddingCollection (SGD over its weights) and embstore's,
    from the same initial rows: the same JaggedTensors out, the same rows
    after five steps; and a variable-stride KJT (a batch size per feature)."""
    rng = np.random.default_rng(1)
    configs = [
        EmbeddingConfig(
            name="t_words", embedding_dim=DIM, num_embeddings=VOCAB, feature_names=["q", "d"]
        )
    ]
    theirs = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
    ours = et.EmbeddingCollection(tables=configs, optimizer=optim.SGD(lr=0.1))
    table = ours.collection.tables["q"]
    with torch.no_grad():
        theirs.embeddings["t_words"].weight.copy_(
            torch.from_numpy(table.lookup(np.arange(VOCAB), insert=False))
        )
    opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    for _ in range(5):
        lengths = rng.integers(0, 4, 2 * BATCH)
        kjt = KeyedJaggedTensor(
            keys=["q", "d"],
            values=torch.from_numpy(rng.integers(0, VOCAB, int(lengths.sum()))),
            lengths=torch.from_numpy(lengths),
        )
        a, b = ours(kjt), theirs(kjt)
        loss_a = loss_b = torch.zeros(())
        for k in ("q", "d"):
            assert torch.equal(a[k].lengths(), b[k].lengths())
            torch.testing.assert_close(a[k].values(), b[k].values(), rtol=1e-6, atol=1e-7)
            g = torch.from_numpy(rng.normal(size=a[k].values().shape).astype(np.float32))
            loss_a = loss_a + (a[k].values() * g).sum()
            loss_b = loss_b + (b[k].values() * g).sum()
        loss_a.backward()
        opt.zero_grad()
        loss_b.backward()
        opt.step()
    keys, rows = table.export()
    w = theirs.embeddings["t_words"].weight.detach().numpy()
    np.testing.assert_allclose(rows, w[keys], rtol=1e-5, atol=1e-6)
    vkjt = KeyedJaggedTensor(
        keys=["q", "d"],
        values=torch.tensor([1, 2, 3, 4, 5]),
        lengths=torch.tensor([2, 1, 0, 2]),
        stride_per_key_per_rank=[[1], [3]],
    )
    out = ours(vkjt)
    assert out["q"].lengths().tolist() == [2]
    assert out["d"].lengths().tolist() == [1, 0, 2]
    np.testing.assert_array_equal(
        out["d"].values().detach().numpy(), table.lookup([3, 4, 5], insert=False)
    )
    with pytest.raises(ValueError, match="variable-stride"):
        et.EmbeddingBagCollection(ours.collection)(vkjt)
