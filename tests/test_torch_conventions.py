"""embstore.torch follows torch.nn.Embedding / EmbeddingBag's conventions
(checked against them, forward and SparseAdam-trained backward), round-trips
through state_dict bitwise, reads missing ids as a default in eval mode, and
refuses tensors it cannot use with the argument's name."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import embstore
import embstore.torch as et
from embstore import optim
from tests._kjt import FakeKJT

DIM, VOCAB = 6, 40


def pair(seed: int = 0) -> tuple[embstore.Table, torch.nn.Parameter]:
    """An Adam table and a torch weight holding the same initial rows (keys 0..VOCAB)."""
    table = embstore.Table(DIM, optimizer=optim.Adam(lr=0.05), seed=seed)
    weight = nn.Parameter(torch.from_numpy(table.lookup(np.arange(VOCAB), insert=False)))
    return table, weight


def train_both(
    ours: Callable[[], torch.Tensor],
    theirs: Callable[[], torch.Tensor],
    table: embstore.Table,
    weight: nn.Parameter,
    steps: int = 5,
) -> None:
    opt = torch.optim.SparseAdam([weight], lr=0.05)
    for _ in range(steps):
        a, b = ours(), theirs()
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6)
        g = torch.linspace(-1, 1, a.numel()).reshape(a.shape)
        (a * g).sum().backward()
        opt.zero_grad()
        (b * g).sum().backward()
        opt.step()
    keys, rows = table.export()
    np.testing.assert_allclose(rows, weight.detach().numpy()[keys], rtol=1e-5, atol=1e-6)


def test_embedding_takes_ids_of_any_shape() -> None:
    table, weight = pair()
    ref = nn.Embedding.from_pretrained(weight, freeze=False, sparse=True)
    ref.weight = weight
    mod = et.Embedding(table)
    ids = torch.tensor([[1, 5, 5], [7, 1, 39]])
    assert mod(ids).shape == (2, 3, DIM)
    train_both(lambda: mod(ids), lambda: ref(ids), table, weight)
    assert mod(torch.tensor(3)).shape == (DIM,)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("include_last_offset", [False, True])
def test_embedding_bag_csr_matches_torch(mode: str, include_last_offset: bool) -> None:
    table, weight = pair(1)
    ref = nn.EmbeddingBag(
        VOCAB, DIM, mode=mode, sparse=True, include_last_offset=include_last_offset
    )
    ref.weight = weight
    mod = et.EmbeddingBag(table, mode=mode, include_last_offset=include_last_offset)
    ids = torch.tensor([3, 4, 4, 9, 1, 30, 30])
    offsets = torch.tensor([0, 3, 3, 5] + ([7] if include_last_offset else []))
    out = mod(ids, offsets)
    assert out.shape == (4, DIM)
    train_both(lambda: mod(ids, offsets), lambda: ref(ids, offsets), table, weight)


def test_embedding_bag_2d_bags_and_per_sample_weights_match_torch() -> None:
    table, weight = pair(2)
    ref = nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=True)
    ref.weight = weight
    mod = et.EmbeddingBag(table, mode="sum")
    ids = torch.tensor([[1, 2, 3], [3, 3, 8]])
    w = torch.tensor([[0.5, 1.0, 2.0], [1.0, -1.0, 0.25]])
    train_both(
        lambda: mod(ids, per_sample_weights=w),
        lambda: ref(ids, per_sample_weights=w),
        table,
        weight,
    )


def test_embedding_bag_defaults_are_torchs() -> None:
    mod = et.EmbeddingBag(embstore.Table(DIM))
    ref = nn.EmbeddingBag(VOCAB, DIM)
    assert mod.mode == ref.mode == "mean"
    assert mod.include_last_offset is ref.include_last_offset is False


def model(seed: int) -> nn.Module:
    """Two embstore modules, a Collection module and a dense layer."""
    torch.manual_seed(seed)
    user = embstore.Table(DIM, optimizer=optim.Adam(lr=0.02), seed=11)
    item = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1), seed=12)
    hist = embstore.Table(DIM, optimizer=optim.RowWiseAdagrad(lr=0.1), seed=13)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.user = et.Embedding(user)
            self.item = et.EmbeddingBag(item, mode="mean")
            self.coll = et.EmbeddingBagCollection(
                embstore.Collection({"h1": hist, "h2": hist, "u": user})
            )
            self.head = nn.Linear(5 * DIM, 1)

        def forward(self, b: dict[str, Any]) -> torch.Tensor:
            e = torch.cat(
                [
                    self.user(b["u"]),
                    self.item(b["i"]),
                    self.coll({"h1": b["u"], "h2": b["u"] % 7, "u": b["u"]}),
                ],
                dim=1,
            )
            return self.head(e).squeeze(1)

    return M()


def batches(n: int) -> list[dict[str, torch.Tensor]]:
    rng = np.random.default_rng(5)
    return [
        {
            "u": torch.from_numpy(rng.integers(0, 500, 16)),
            "i": torch.from_numpy(rng.integers(0, 500, (16, 3))),
            "y": torch.from_numpy((rng.random(16) < 0.3).astype(np.float32)),
        }
        for _ in range(n)
    ]


def train(m: nn.Module, opt: torch.optim.Optimizer, data: list[dict[str, torch.Tensor]]) -> None:
    for b in data:
        loss = nn.functional.binary_cross_entropy_with_logits(m(b), b["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()


def tables_of(m: nn.Module) -> list[tuple[np.ndarray, ...]]:
    out = []
    for t in (m.user.table, m.item.table, m.coll.collection.tables["h1"]):
        out.append((*t.export(with_state=True), np.array([t.step, t.seed])))
    return out


def test_state_dict_round_trip_trains_on_bitwise() -> None:
    """20 steps, torch.save(state_dict), load into a fresh model, 20 more
    steps == 40 uninterrupted steps, bit for bit (rows, optimizer state,
    steps, dense weights)."""
    data = batches(40)
    straight = model(0)
    opt = torch.optim.Adam(straight.head.parameters(), lr=0.01)
    train(straight, opt, data)

    first = model(0)
    opt1 = torch.optim.Adam(first.head.parameters(), lr=0.01)
    train(first, opt1, data[:20])
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    assert {"user.table.keys", "item.table.rows", "coll.h1.state", "coll.u.step"} <= set(
        saved["model"]
    )

    resumed = model(1)  # other dense init, fresh tables: everything comes from the file
    resumed.load_state_dict(saved["model"])
    opt2 = torch.optim.Adam(resumed.head.parameters(), lr=0.01)
    opt2.load_state_dict(saved["opt"])
    train(resumed, opt2, data[20:])

    for a, b in zip(tables_of(straight), tables_of(resumed), strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)


def test_state_dict_without_optimizer_state_and_strict_loading() -> None:
    m = model(0)
    train(m, torch.optim.SGD(m.head.parameters(), lr=0.1), batches(2))
    m.user.state_dict_optimizer = False
    sd = m.state_dict()
    assert "user.table.state" not in sd
    assert "item.table.state" in sd
    fresh = model(0)
    fresh.load_state_dict(sd)
    np.testing.assert_array_equal(fresh.user.table.export()[1], m.user.table.export()[1])
    del sd["item.table.rows"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*item\.table\.rows"):
        model(0).load_state_dict(sd)


def test_eval_mode_reads_missing_ids_as_the_default() -> None:
    table = embstore.Table(DIM, optimizer=optim.SGD(lr=0.1))
    table.assign([1], np.ones((1, DIM)))
    emb = et.Embedding(table, default="zeros").eval()
    out = emb(torch.tensor([1, 2]))
    assert out[0].tolist() == [1.0] * DIM
    assert out[1].tolist() == [0.0] * DIM
    bag = et.EmbeddingBag(table, mode="sum", default=np.full(DIM, 0.5)).eval()
    assert bag(torch.tensor([[1, 2]]))[0].tolist() == [1.5] * DIM
    coll = et.EmbeddingBagCollection(embstore.Collection({"f": table}), default="zeros").eval()
    assert coll({"f": torch.tensor([2])}).abs().sum().item() == 0.0
    assert len(table) == 1


def test_table_methods_take_tensors_and_give_tensors() -> None:
    table = embstore.Table(DIM, optimizer=optim.SGD(lr=0.1))
    keys = torch.tensor([3, 4, 3])
    rows = table.lookup(keys)
    assert isinstance(rows, torch.Tensor)
    assert rows.shape == (3, DIM)
    assert rows.dtype == torch.float32
    table.apply_gradients(keys, torch.ones(3, DIM))
    pooled = table.lookup_pooled(keys, torch.tensor([0, 1, 3]))
    assert isinstance(pooled, torch.Tensor)
    assert table.contains(torch.tensor([3, 9])).tolist() == [True, False]
    assert isinstance(table.lookup(np.array([3])), np.ndarray)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda t: t.lookup(torch.tensor([1], device="meta")),
            "keys: a meta tensor; .* keys.cpu()",
        ),
        (
            lambda t: t.apply_gradients([1], torch.ones(1, DIM, requires_grad=True)),
            r"grads: a tensor that requires grad; .* grads.detach\(\)",
        ),
        (lambda t: t.lookup(torch.tensor([1.5])), "keys: expected an integer array"),
        (
            lambda t: et.EmbeddingBag(t)(
                torch.tensor([[1, 2]]), per_sample_weights=torch.ones(1, 2, requires_grad=True)
            ),
            "per_sample_weights: a tensor that requires grad",
        ),
        (
            lambda t: et.EmbeddingBag(t, include_last_offset=True)(
                torch.tensor([1, 2]), torch.tensor([0, 1])
            ),
            "offsets: with include_last_offset=True the last offset is len",
        ),
        (lambda t: et.EmbeddingBag(t)(torch.tensor([1, 2])), "input: expected a 2-D"),
        (lambda t: et.EmbeddingBag(t, mode="max"), 'mode: embstore pools with "sum"'),
    ],
)
def test_unusable_tensors_are_refused_naming_the_argument(
    call: Callable[[embstore.Table], object], match: str
) -> None:
    t = embstore.Table(DIM, optimizer=optim.SGD(lr=0.1))
    with pytest.raises((TypeError, ValueError), match=match):
        call(t)
    assert len(t) == 0


def test_embedding_bag_collection_takes_keyed_jagged_input() -> None:
    """KJT layout: lengths feature-major ([f0 sample0, f0 sample1, ..., f1
    sample0, ...]); values in the same order. Output: a KeyedTensor of the
    collection's features, equal to the same module given the bags as a mapping."""

    def make() -> embstore.Collection:
        a = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1), seed=1)
        b = embstore.Table(3, optimizer=optim.Adagrad(lr=0.1), seed=2)
        return embstore.Collection({"item": a, "user": b, "hist": a}, combiner="sum")

    # features in the input's order: user, hist, item, extra (ignored); batch 2
    kjt = FakeKJT(
        ["user", "hist", "item", "extra"],
        torch.tensor([10, 11, 5, 6, 7, 8, 20, 21, 99]),
        torch.tensor([1, 1, 3, 1, 1, 1, 0, 1]),
        torch.tensor([1.0, 1.0, 0.5, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    )
    bags = {
        "user": (np.array([10, 11]), np.array([0, 1, 2]), np.array([1.0, 1.0])),
        "hist": (np.array([5, 6, 7, 8]), np.array([0, 3, 4]), np.array([0.5, 2.0, 1.0, 1.0])),
        "item": (np.array([20, 21]), np.array([0, 1, 2]), np.array([1.0, 1.0])),
    }
    ebc, ref = et.EmbeddingBagCollection(make()), et.EmbeddingBagCollection(make())
    for _ in range(3):
        kt = ebc(kjt)
        want = ref(bags)
        assert kt.keys() == ["item", "user", "hist"]
        assert kt.length_per_key() == [DIM, 3, DIM]
        assert torch.equal(kt.values(), want)
        assert torch.equal(kt.to_dict()["user"], want[:, DIM : DIM + 3])
        g = torch.linspace(-1, 1, want.numel()).reshape(want.shape)
        (kt.values() * g).sum().backward()
        (want * g).sum().backward()
    for name in ("item", "user"):
        ka, ra = ebc.collection.tables[name].export()
        kb, rb = ref.collection.tables[name].export()
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(ra, rb)
    with pytest.raises(ValueError, match=r"features: missing keys \['item'\]"):
        ebc(FakeKJT(["user", "hist"], torch.tensor([1, 2]), torch.tensor([1, 0, 1, 0])))
    with pytest.raises(TypeError, match="features: expected a torchrec KeyedJaggedTensor"):
        ebc([torch.tensor([1])])
    with pytest.raises(ValueError, match=r"batch: expected features .*missing \['user', 'hist'\]"):
        ebc({"item": torch.tensor([1])})


@pytest.mark.parametrize(
    ("kjt", "match"),
    [
        # lengths cover 3 of the 4 ids: the trailing id would be dropped
        (
            FakeKJT(["item", "user"], torch.tensor([1, 2, 3, 4]), torch.tensor([1, 1, 1, 0])),
            "lengths sum to 3 ids but values.. holds 4",
        ),
        # lengths claim more ids than there are
        (
            FakeKJT(["item", "user"], torch.tensor([1, 2]), torch.tensor([1, 1, 1, 0])),
            "lengths sum to 3 ids but values.. holds 2",
        ),
        # a key named twice: its second bags would replace the first's
        (
            FakeKJT(
                ["item", "user", "item"], torch.tensor([1, 2, 3]), torch.tensor([1, 0, 1, 0, 0, 1])
            ),
            "feature 'item' appears twice",
        ),
        (
            FakeKJT(["item", "user"], torch.tensor([1, 2]), torch.tensor([1, 2, -1, 0])),
            "feature 'user' has a negative length",
        ),
    ],
)
def test_a_keyed_jagged_tensor_that_does_not_describe_its_values_is_refused(
    kjt: FakeKJT, match: str
) -> None:
    a = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.1))
    ebc = et.EmbeddingBagCollection(embstore.Collection({"item": a, "user": a}))
    with pytest.raises(ValueError, match=match):
        ebc(kjt)
    assert len(a) == 0, "a refused batch stored rows"


def test_the_ops_and_load_state_dict_name_junk_inputs() -> None:
    """At 7e7142d the custom op given no inputs raised IndexError, a module
    called on meta tensors a NotImplementedError from inside NumPy's copy,
    and load_state_dict of meta tensors did not name the entry."""
    table = embstore.Table(4, optimizer=optim.SGD(lr=0.1))
    module = et.Embedding(table)
    with pytest.raises(ValueError, match=r"^inputs: expected the ids tensor first"):
        torch.ops.embstore.lookup(torch.empty(0), [], module._handle, True, "")
    with pytest.raises(ValueError, match=r"^inputs\[0\]: a meta tensor holds no values"):
        module(torch.empty(3, dtype=torch.int64, device="meta"))
    module(torch.tensor([1, 2]))
    meta = {k: torch.empty_like(v, device="meta") for k, v in module.state_dict().items()}
    before = table.export()
    with pytest.raises(RuntimeError, match=r"table\.keys: a meta tensor holds no values"):
        module.load_state_dict(meta)
    for a, b in zip(before, table.export(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_collections_tables_are_read_only() -> None:
    """At 7e7142d assigning into collection.tables changed a copy, silently."""
    a, b = (embstore.Table(4, optimizer=optim.SGD(lr=0.1)) for _ in range(2))
    coll = embstore.Collection({"f": a})
    with pytest.raises(TypeError):
        coll.tables["f"] = b  # type: ignore[index]
    assert coll.tables["f"] is a
    assert dict(coll.tables) == {"f": a}
