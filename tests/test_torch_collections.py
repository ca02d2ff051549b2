"""TorchRec's shapes without torchrec: collections built from
EmbeddingBagConfig / EmbeddingConfig, the unpooled EmbeddingCollection
(a JaggedTensor per feature, checked against torch.nn.functional.embedding
and trained as nn.Embedding with SparseAdam), and variable-stride KJTs
(accepted unpooled, refused pooled). tests/test_torchrec.py checks the same
against real torchrec in its own venv."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import embstore
import embstore.torch as et
from embstore import optim
from tests._kjt import FakeKJT


def test_a_bag_collection_from_configs_has_the_configs_tables() -> None:
    configs = [
        et.EmbeddingBagConfig(
            name="t_user", embedding_dim=4, num_embeddings=100, feature_names=["user"]
        ),
        et.EmbeddingBagConfig(
            name="t_item",
            embedding_dim=6,
            num_embeddings=400,
            feature_names=["item", "hist"],
            pooling="MEAN",
            weight_init_min=0.5,
            weight_init_max=0.75,
            data_type="FP16",
        ),
    ]
    ebc = et.EmbeddingBagCollection(
        tables=configs, optimizer=optim.Adagrad(lr=0.1), table_options={"capacity": 1000}
    )
    coll = ebc.collection
    assert coll.features == ["user", "item", "hist"]
    assert coll.dims == [4, 6, 6]
    assert coll.tables["item"] is coll.tables["hist"]
    assert coll._combiners == {"user": "sum", "item": "mean", "hist": "mean"}
    user, item = coll.tables["user"], coll.tables["item"]
    assert (user.dtype, item.dtype) == ("float32", "float16")
    assert user.capacity == item.capacity == 1000
    assert isinstance(user.optimizer, optim.Adagrad)
    # TorchRec's default initial rows: uniform in +-sqrt(1 / num_embeddings).
    rows = user.lookup(np.arange(2000), insert=False)
    assert np.abs(rows).max() <= math.sqrt(1 / 100)
    assert np.abs(rows).max() > 0.9 * math.sqrt(1 / 100)
    rows = item.lookup(np.arange(2000), insert=False)
    assert rows.min() >= 0.5
    assert rows.max() <= 0.75
    out = ebc(
        {"user": torch.tensor([1, 2]), "item": torch.tensor([3, 4]), "hist": torch.tensor([5, 6])}
    )
    assert out.shape == (2, 16)
    # Given positionally, as TorchRec's EmbeddingBagCollection(tables).
    assert et.EmbeddingBagCollection(configs).collection.features == ["user", "item", "hist"]


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"feature_names": []}, ValueError, r"^tables\[0\].feature_names: empty"),
        ({"pooling": "NONE"}, ValueError, r"^tables\[0\].pooling: NONE"),
        ({"pooling": "MAX"}, ValueError, r"^tables\[0\].pooling: expected SUM, MEAN or NONE"),
        ({"data_type": "INT8"}, ValueError, r"^tables\[0\].data_type: expected FP32, FP16"),
        ({"init_fn": lambda w: w}, ValueError, r"^tables\[0\].init_fn: not supported"),
        ({"need_pos": True}, ValueError, r"^tables\[0\].need_pos"),
        ({"name": ""}, ValueError, r"^tables\[0\].name"),
        ({"num_embeddings": 0}, ValueError, r"^tables\[0\].num_embeddings"),
    ],
)
def test_bad_configs_are_refused_by_field(
    change: dict[str, Any], error: type[Exception], match: str
) -> None:
    fields: dict[str, Any] = {
        "name": "t",
        "embedding_dim": 4,
        "num_embeddings": 10,
        "feature_names": ["f"],
    }
    fields.update(change)
    with pytest.raises(error, match=match):
        et.EmbeddingBagCollection(tables=[et.EmbeddingBagConfig(**fields)])


def test_collection_arguments_are_refused_by_name() -> None:
    config = et.EmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"]
    )
    twin = et.EmbeddingBagConfig(name="u", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    with pytest.raises(ValueError, match=r"^tables\[1\].feature_names: 'f' is served by two"):
        et.EmbeddingBagCollection(tables=[config, twin])
    with pytest.raises(ValueError, match=r"^tables\[1\].name: 't' names two tables"):
        et.EmbeddingBagCollection(
            tables=[config, et.EmbeddingBagConfig(4, 4, "t", feature_names=["g"])]
        )
    with pytest.raises(ValueError, match=r"^optimizer: no optimizer for table 't'"):
        et.EmbeddingBagCollection(tables=[config], optimizer={"u": optim.SGD(lr=0.1)})
    with pytest.raises(ValueError, match=r"^table_options: \['dim'\] come from the configs"):
        et.EmbeddingBagCollection(tables=[config], table_options={"dim": 3})
    with pytest.raises(ValueError, match=r"^device: embstore tables live in host memory"):
        et.EmbeddingBagCollection(tables=[config], device="meta")
    with pytest.raises(TypeError, match=r"^tables\[0\]: expected an EmbeddingBagConfig"):
        et.EmbeddingBagCollection(tables=[object()])
    coll = embstore.Collection({"f": embstore.Table(4)})
    with pytest.raises(ValueError, match=r"^optimizer: the collection's tables have theirs"):
        et.EmbeddingBagCollection(coll, optimizer=optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match=r"^tables: an EmbeddingCollection's tables share one"):
        et.EmbeddingCollection(
            embstore.Collection({"a": embstore.Table(4), "b": embstore.Table(3)})
        )
    # An unpooled config in a pooled collection, and the other way round.
    seq = et.EmbeddingConfig(name="s", embedding_dim=4, num_embeddings=10, feature_names=["q"])
    with pytest.raises(ValueError, match=r"^tables\[0\].pooling: NONE"):
        et.EmbeddingBagCollection(tables=[seq])
    assert et.EmbeddingCollection(tables=[seq]).embedding_dim == 4


def test_the_unpooled_collection_returns_each_features_rows_and_trains_as_nn_embedding() -> None:
    """Two features of one table and one of another; per feature a
    JaggedTensor whose values are F.embedding of its ids and whose lengths
    are the KJT's; five SparseAdam steps equal nn.Embedding's (a shared
    table steps once per backward with both features' gradients)."""
    vocab, dim = 20, 4
    configs = [
        et.EmbeddingConfig(
            name="words", embedding_dim=dim, num_embeddings=vocab, feature_names=["q", "d"]
        ),
        et.EmbeddingConfig(
            name="users", embedding_dim=dim, num_embeddings=vocab, feature_names=["u"]
        ),
    ]
    ec = et.EmbeddingCollection(tables=configs, optimizer=optim.Adam(lr=0.05))
    words, users = ec.collection.tables["q"], ec.collection.tables["u"]
    w_words = nn.Parameter(torch.from_numpy(words.lookup(np.arange(vocab), insert=False)))
    w_users = nn.Parameter(torch.from_numpy(users.lookup(np.arange(vocab), insert=False)))
    opt = torch.optim.SparseAdam([w_words, w_users], lr=0.05)
    rng = np.random.default_rng(0)
    for step in range(5):
        lengths = torch.from_numpy(rng.integers(0, 4, 9))  # 3 features x 3 samples
        values = torch.from_numpy(rng.integers(0, vocab, int(lengths.sum())))
        # keys in an order of their own, and one the collection does not serve
        kjt = FakeKJT(["d", "u", "q"], values, lengths)
        out = ec(kjt)
        assert list(out) == ["q", "d", "u"]
        cut = np.concatenate([[0], np.cumsum(lengths.numpy())])
        per = {
            "d": (values[cut[0] : cut[3]], lengths[0:3], w_words),
            "u": (values[cut[3] : cut[6]], lengths[3:6], w_users),
            "q": (values[cut[6] : cut[9]], lengths[6:9], w_words),
        }
        loss = torch.zeros(())
        ref = torch.zeros(())
        for j, (name, (ids, lens, weight)) in enumerate(per.items()):
            jt = out[name]
            assert torch.equal(jt.lengths(), lens)
            want = nn.functional.embedding(ids, weight, sparse=True)
            torch.testing.assert_close(jt.values(), want.detach(), rtol=1e-6, atol=1e-7)
            assert [len(x) for x in jt.to_dense()] == lens.tolist()
            g = torch.linspace(-1, 1, dim) * (j + 1 + step)
            loss = loss + (jt.values() * g).sum()
            ref = ref + (want * g).sum()
        loss.backward()
        ref.backward()
        opt.step()
        opt.zero_grad()
    assert words.step == users.step == 5
    for table, weight in ((words, w_words), (users, w_users)):
        keys, rows = table.export()
        np.testing.assert_allclose(rows, weight.detach().numpy()[keys], rtol=1e-5, atol=1e-6)


def test_variable_stride_kjt_unpooled_yes_pooled_no() -> None:
    table = embstore.Table(3, optimizer=optim.SGD(lr=0.1), seed=1)
    ec = et.EmbeddingCollection(embstore.Collection({"a": table, "b": table}))
    # "a" for 2 samples, "b" for 3: lengths 2 + 3 entries.
    kjt = FakeKJT(
        ["a", "b"],
        torch.tensor([1, 2, 3, 4, 5, 6]),
        torch.tensor([1, 2, 0, 2, 1]),
        stride_per_key=[2, 3],
    )
    out = ec(kjt)
    assert out["a"].lengths().tolist() == [1, 2]
    assert out["b"].lengths().tolist() == [0, 2, 1]
    np.testing.assert_array_equal(
        out["b"].values().detach().numpy(), table.lookup([4, 5, 6], insert=False)
    )
    padded = out["b"].to_padded_dense()
    assert padded.shape == (3, 2, 3)
    assert padded[0].abs().sum() == 0
    ebc = et.EmbeddingBagCollection(embstore.Collection({"a": table, "b": table}))
    with pytest.raises(ValueError, match=r"^features: a variable-stride KeyedJaggedTensor"):
        ebc(kjt)
    with pytest.raises(ValueError, match=r"^features: expected 2 keys x stride lengths"):
        ec(FakeKJT(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 2, 0])))
