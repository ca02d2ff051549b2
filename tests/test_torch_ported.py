"""PyTorch's own tests of nn.Embedding and nn.EmbeddingBag
(test/nn/test_embedding.py in pytorch/pytorch), ported to embstore's modules
wherever they apply on a CPU float32 table, rewritten here.

How a port reads a gradient: the table trains with SGD(lr=1), so the step a
backward takes, ``rows before - rows after``, is the gradient torch puts in
``weight.grad`` (its sparse gradient made dense).

Where embstore differs on purpose (the README's torch section says so), the
port checks embstore's documented behaviour instead:
- ids are keys of a growing table, not indices: there is no out-of-range
  id (torch raises for ``-1`` or ``num_embeddings``; embstore creates the
  row), and a negative ``padding_idx`` is the id it names, not an index
  from the end;
- the backward is the table's optimizer step (fused), so two backwards are
  two steps unless the module accumulates (``accumulate=2`` sums them, as
  torch's ``.grad`` does);
- padding ids are never stored or trained; a padding id reads the row
  the table holds for it (a pretrained one, as torch reads its weight's
  row), else zeros;
- ``per_sample_weights`` are constants and apply in every mode ("mean" is
  the weighted mean, sum of w*x over sum of w), where torch trains them and
  allows them only with "sum";
- ``scale_grad_by_freq`` and ``mode="max"`` are refused (``max_norm`` and
  ``norm_type`` renormalize rows as torch does);
- with ``include_last_offset=True`` the last offset must be ``len(input)``.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import embstore
import embstore.torch as et
from embstore import optim


def twin(weight: torch.Tensor) -> embstore.Table:
    """An SGD(lr=1) table holding ``weight``'s rows as ids 0..n-1."""
    table = embstore.Table(weight.shape[1], optimizer=optim.SGD(lr=1.0))
    table.assign(np.arange(weight.shape[0]), weight.detach().float().numpy())
    return table


def rows(table: embstore.Table, n: int) -> np.ndarray:
    return table.lookup(np.arange(n), insert=False)


def step_of(table: embstore.Table, before: np.ndarray) -> np.ndarray:
    """The gradient the last backward applied to ids 0..n-1."""
    return before - rows(table, before.shape[0])


def test_embedding_backward_touches_only_the_ids_looked_up() -> None:
    weight = torch.randn(10, 20, requires_grad=True)
    table = twin(weight)
    before = rows(table, 10)
    ids = torch.tensor([[0, 2, 4, 5], [4, 3, 0, 9]])
    et.Embedding(table)(ids).sum().backward()
    F.embedding(ids, weight, sparse=True).sum().backward()
    assert weight.grad is not None
    np.testing.assert_allclose(step_of(table, before), weight.grad.to_dense().numpy(), atol=1e-6)
    assert len(table) == 10  # nothing but the ten rows


def test_an_empty_lookup_has_no_rows_and_a_harmless_backward() -> None:
    table = embstore.Table(20, optimizer=optim.SGD(lr=1.0))
    emb = et.Embedding(table)
    out = emb(torch.tensor([], dtype=torch.int64))
    assert out.shape == (0, 20)
    out.sum().backward()
    assert len(table) == 0


def test_padding_idx_reads_zeros_and_is_never_stored_or_trained() -> None:
    table = embstore.Table(20, optimizer=optim.SGD(lr=1.0))
    emb = et.Embedding(table, padding_idx=0)
    out = emb(torch.tensor([[0, 2, 4, 5], [4, 3, 0, 9]]))
    assert out[0][0].abs().sum() == 0
    assert out[1][2].abs().sum() == 0
    # A negative padding_idx is the id it names (no index from the end).
    neg = et.Embedding(embstore.Table(20), padding_idx=-2)
    out = neg(torch.tensor([[0, 2, -2, 5], [4, -2, 0, 9]]))
    assert out[0][2].abs().sum() == 0
    assert out[1][1].abs().sum() == 0
    assert out[0][0].abs().sum() > 0  # id 0 is an ordinary id there
    # Many padding ids next to others: the others train, padding stays absent.
    for n in (1, 2, 1000):
        for others in ([], [1, 3], [2]):
            emb(torch.tensor(others + [0] * n)).sum().backward()
            assert not table.contains([0])[0]


def bag_reference(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    psw: torch.Tensor | None,
    include_last_offset: bool,
) -> torch.Tensor:
    """torch's reference pooling of test_embedding.py (rows times weights,
    summed or averaged per bag; an empty bag is zeros), with embstore's
    weighted mean (sum of w*x over sum of w)."""
    w = torch.ones(ids.shape, dtype=weight.dtype) if psw is None else psw
    starts = offsets.tolist()
    ends = starts[1:] if include_last_offset else [*starts[1:], len(ids)]
    if include_last_offset:
        starts = starts[:-1]
    out = []
    for a, b in zip(starts, ends, strict=True):
        if b == a:
            out.append(torch.zeros(weight.shape[1], dtype=weight.dtype))
            continue
        x = weight[ids[a:b].long()] * w[a:b, None]
        out.append(x.sum(0) / (w[a:b].sum() if mode == "mean" else 1))
    return torch.stack(out)


@pytest.mark.parametrize(
    ("id_dtype", "off_dtype"), list(itertools.product([torch.int32, torch.int64], repeat=2))
)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_the_known_bags_example(mode: str, id_dtype: torch.dtype, off_dtype: torch.dtype) -> None:
    """Rows 1..10 as a 5 x 2 table; bags [], [3, 1, 1], [], [1, 4, 0], []."""
    weight = torch.arange(1, 11, dtype=torch.float32).view(5, 2)
    table = twin(weight)
    before = rows(table, 5)
    bag = et.EmbeddingBag(table, mode=mode)
    ids = torch.tensor([3, 1, 1, 1, 4, 0], dtype=id_dtype)
    offsets = torch.tensor([0, 0, 3, 3, 6], dtype=off_dtype)
    den = 1 if mode == "sum" else 3
    out = bag(ids, offsets)
    expected = torch.tensor([[0, 0], [13, 16], [0, 0], [13, 16], [0, 0]]) / den
    torch.testing.assert_close(out, expected.float())
    out.backward(torch.tensor([99, 99, 1, 2, 99, 99, 3, 4, 99, 99.0]).view(5, 2))
    grad = np.array([[3, 4], [5, 8], [0, 0], [1, 2], [3, 4]], np.float32) / den
    np.testing.assert_allclose(step_of(table, before), grad, rtol=1e-6)
    # The same bags as 2-D (2 x 3) input.
    table = twin(weight)
    out = et.EmbeddingBag(table, mode=mode)(ids.view(2, 3))
    torch.testing.assert_close(out, (torch.tensor([[13, 16], [13, 16]]) / den).float())
    out.backward(torch.tensor([[1, 2], [3, 4.0]]))
    np.testing.assert_allclose(step_of(table, before), grad, rtol=1e-6)
    # All bags empty: zeros out, no row moves.
    table = twin(weight)
    empty = et.EmbeddingBag(table, mode=mode)(
        torch.tensor([], dtype=id_dtype), torch.tensor([0, 0, 0, 0], dtype=off_dtype)
    )
    assert torch.equal(empty, torch.zeros(4, 2))
    empty.sum().backward()
    np.testing.assert_array_equal(rows(table, 5), before)


def test_bad_bag_input_is_refused() -> None:
    bag = et.EmbeddingBag(embstore.Table(20), mode="sum")
    ids = torch.ones(3, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^offsets: given with 2-D input"):
        bag(ids, torch.arange(0, 3))
    with pytest.raises(ValueError, match=r"^input: expected a 2-D"):
        bag(ids.view(-1))
    with pytest.raises(ValueError, match=r"^offsets: given with 5-D input"):
        bag(torch.full((2, 0, 0, 6, 6), 2), torch.full((2, 0, 0, 6, 6), 0))
    with pytest.raises(ValueError, match=r"^offsets: expected a 1-D integer array"):
        bag(torch.full((2,), 1), torch.full((2, 2), 0))
    for off in ([1, 1, 2], [0, 1, 100]):  # not from 0; past the end
        with pytest.raises(ValueError, match="offsets"):
            bag(ids.view(-1), torch.tensor(off))
    assert len(bag.table) == 0


@pytest.mark.parametrize(
    ("id_dtype", "off_dtype"), list(itertools.product([torch.int32, torch.int64], repeat=2))
)
def test_empty_input_pools_to_zeros(id_dtype: torch.dtype, off_dtype: torch.dtype) -> None:
    bag = et.EmbeddingBag(embstore.Table(3), mode="mean")
    x = torch.tensor([], dtype=id_dtype)
    assert torch.equal(bag(x, torch.tensor([0], dtype=off_dtype)), torch.zeros(1, 3))
    assert torch.equal(bag(x, torch.tensor([0, 0], dtype=off_dtype)), torch.zeros(2, 3))


@pytest.mark.parametrize("include_last_offset", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_per_sample_weights_and_offsets_match_the_reference(
    mode: str, weighted: bool, include_last_offset: bool
) -> None:
    weight = torch.arange(1, 11, dtype=torch.float32).view(5, 2).requires_grad_()
    table = twin(weight)
    before = rows(table, 5)
    ids = torch.tensor([3, 1, 1, 1, 4, 0])
    offsets = torch.tensor([0, 0, 3, 3, 6] + ([6] if include_last_offset else []))
    psw = torch.rand(6) + 0.1 if weighted else None
    bag = et.EmbeddingBag(table, mode=mode, include_last_offset=include_last_offset)
    out = bag(ids, offsets, psw)
    want = bag_reference(weight, ids, offsets, mode, psw, include_last_offset)
    torch.testing.assert_close(out, want.detach())
    g = torch.randn_like(want)
    out.backward(g)
    want.backward(g)
    assert weight.grad is not None
    np.testing.assert_allclose(step_of(table, before), weight.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_per_sample_weights_of_another_shape_or_trainable_are_refused() -> None:
    bag = et.EmbeddingBag(embstore.Table(2), mode="sum")
    ids = torch.tensor([3, 1, 1, 1, 4, 0])
    offsets = torch.tensor([0, 0, 3, 3, 6])
    with pytest.raises(ValueError, match=r"^per_sample_weights: expected the shape of input"):
        bag(ids, offsets, torch.randn(5))
    with pytest.raises(ValueError, match=r"^per_sample_weights: expected the shape of input"):
        bag(torch.randint(5, (7, 3)), None, torch.randn(7 * 3))
    with pytest.raises(TypeError, match=r"^per_sample_weights: a tensor that requires grad"):
        bag(ids, offsets, torch.rand(6, requires_grad=True))
    assert len(bag.table) == 0


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize(
    ("n", "d", "b", "length"), [(2, 3, 5, 7), (2, 5, 53, 23), (101, 5, 3, 7), (2, 101, 3, 7)]
)
def test_embedding_bag_equals_embedding_then_pooling(
    mode: str, n: int, d: int, b: int, length: int
) -> None:
    """Bags of equal length: EmbeddingBag's output and step equal
    Embedding's rows summed or averaged per bag, on twin tables."""
    weight = torch.randn(n, d)
    bag_table, emb_table = twin(weight), twin(weight)
    before = rows(bag_table, n)
    ids = torch.randint(n, (b, length))
    offsets = torch.arange(0, b) * length
    g = torch.rand(b, d)
    out = et.EmbeddingBag(bag_table, mode=mode)(ids.view(-1), offsets)
    rows_ = et.Embedding(emb_table)(ids)
    ref = rows_.sum(1) if mode == "sum" else rows_.mean(1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.backward(g)
    ref.backward(g)
    np.testing.assert_allclose(
        step_of(bag_table, before), step_of(emb_table, before), rtol=1e-5, atol=1e-5
    )


def one_d_bags(
    include_last_offset: bool, allpad: bool, num_bags: int = 10, most: int = 10, words: int = 100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 1-D bags, one of them full and one empty."""
    empty = random.randrange(num_bags)
    full = random.choice([i for i in range(num_bags) if i != empty])
    ids: list[int] = []
    offsets = []
    for i in range(num_bags):
        offsets.append(len(ids))
        size = most if i == full else 0 if i == empty else random.randint(1, most - 1)
        ids += [1 if allpad else random.randrange(words) for _ in range(size)]
    if include_last_offset:
        offsets.append(len(ids))
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(offsets)


@pytest.mark.parametrize(
    ("mode", "include_last_offset", "allpad"),
    list(itertools.product(["sum", "mean"], [False, True], [False, True])),
)
def test_1d_bags_with_padding_equal_torch(
    mode: str, include_last_offset: bool, allpad: bool
) -> None:
    random.seed(0)
    ids, offsets = one_d_bags(include_last_offset, allpad)
    for padding in [*sorted(set(ids.tolist())), None]:
        weight = torch.randn(101, 3, requires_grad=True)
        table = twin(weight)
        before = rows(table, 101)
        bag = et.EmbeddingBag(
            table, mode=mode, include_last_offset=include_last_offset, padding_idx=padding
        )
        out = bag(ids, offsets)
        want = F.embedding_bag(
            ids,
            weight,
            offsets,
            mode=mode,
            include_last_offset=include_last_offset,
            padding_idx=padding,
        )
        torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-6)
        out.sum().backward()
        want.sum().backward()
        assert weight.grad is not None
        np.testing.assert_allclose(
            step_of(table, before), weight.grad.numpy(), rtol=1e-5, atol=1e-6
        )


@pytest.mark.parametrize(
    ("mode", "allpad", "rows_"), list(itertools.product(["sum", "mean"], [False, True], [1, 10]))
)
def test_2d_bags_with_padding_equal_torch(mode: str, allpad: bool, rows_: int) -> None:
    torch.manual_seed(1)
    ids = torch.ones(rows_, 10, dtype=torch.int64) if allpad else torch.randint(0, 10, (rows_, 10))
    if not allpad and rows_ > 1:
        ids[3] = ids[3][0]  # a bag of one id repeated: all padding for that id
    for padding in sorted(set(ids.flatten().tolist())):
        weight = torch.randn(10, 3, requires_grad=True)
        table = twin(weight)
        before = rows(table, 10)
        out = et.EmbeddingBag(table, mode=mode, padding_idx=padding)(ids)
        want = F.embedding_bag(ids, weight, mode=mode, padding_idx=padding)
        torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-6)
        out.sum().backward()
        want.sum().backward()
        assert weight.grad is not None
        np.testing.assert_allclose(
            step_of(table, before), weight.grad.numpy(), rtol=1e-5, atol=1e-6
        )


def test_include_last_offset_with_padding() -> None:
    """pytorch/pytorch#89677's case: bags [0, 1, 2] and [3] with padding 61."""
    weight = torch.randn(100, 3)
    bag = et.EmbeddingBag(twin(weight), mode="mean", include_last_offset=True, padding_idx=61)
    ids = torch.tensor([0, 1, 2, 3])
    want = torch.stack([weight[0:3].mean(0), weight[3]])
    torch.testing.assert_close(bag(ids, torch.tensor([0, 3, 4])), want)
    # torch reads a last offset short of len(input) as len(input); embstore refuses it.
    with pytest.raises(
        ValueError, match=r"^offsets: with include_last_offset=True the last offset"
    ):
        bag(ids, torch.tensor([0, 3, 3]))


def test_non_contiguous_ids_read_as_their_values() -> None:
    table = embstore.Table(4)
    bag = et.EmbeddingBag(table, mode="sum", default="init")
    base = torch.tensor([[0, 9, 1, 9], [2, 9, 3, 9]])
    view = base[:, ::2]
    assert not view.is_contiguous()
    torch.testing.assert_close(bag.eval()(view), bag(view.contiguous()))


@pytest.mark.parametrize("cls", [et.Embedding, et.EmbeddingBag])
def test_from_pretrained(cls: type) -> None:
    a = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    module = cls.from_pretrained(a)
    ids = torch.tensor([0, 1])
    out = module(ids) if cls is et.Embedding else module(ids, torch.arange(2))
    assert torch.equal(out, a)
    out.sum().backward()  # frozen: nothing moves, nothing is stored
    module(torch.tensor([7])) if cls is et.Embedding else module(torch.tensor([[7]]))
    assert len(module.table) == 2
    np.testing.assert_array_equal(rows(module.table, 2), a.numpy())
    trained = cls.from_pretrained(a, freeze=False, optimizer=optim.SGD(lr=1.0))
    out = trained(ids) if cls is et.Embedding else trained(ids, torch.arange(2))
    out.sum().backward()
    np.testing.assert_allclose(rows(trained.table, 2), a.numpy() - 1.0)
    with pytest.raises(ValueError, match=r"^optimizer: freeze=False trains the rows"):
        cls.from_pretrained(a, freeze=False)
    with pytest.raises(ValueError, match=r"^embeddings: expected a 2-D"):
        cls.from_pretrained(torch.ones(3))


def test_two_backwards_are_two_steps_or_one_accumulated() -> None:
    """torch sums two backwards into one sparse grad; embstore steps at each
    backward by default, and with accumulate=2 applies the sum once."""
    weight = torch.randn(10, 3, requires_grad=True)
    ids = torch.tensor([[7, 1, 3]])
    F.embedding(ids[0], weight, sparse=True).sum().backward()
    F.embedding(ids[0], weight, sparse=True).sum().backward()
    assert weight.grad is not None
    torch_grad = weight.grad.to_dense().numpy()
    table = twin(weight)
    before = rows(table, 10)
    emb = et.Embedding(table, accumulate=2)
    emb(ids[0]).sum().backward()
    assert table.step == 0
    emb(ids[0]).sum().backward()
    assert table.step == 1
    np.testing.assert_allclose(step_of(table, before), torch_grad, rtol=1e-6)
    each = twin(weight)
    eager = et.Embedding(each)
    eager(ids[0]).sum().backward()
    eager(ids[0]).sum().backward()
    assert each.step == 2
    np.testing.assert_allclose(step_of(each, before), torch_grad, rtol=1e-6)  # SGD: the same sum
    # Ids changed in place after the forward: the backward uses the forward's.
    table = twin(weight)
    buf = torch.tensor([7, 1, 3])
    out = et.Embedding(table)(buf)
    buf[0] = 8
    out.sum().backward()
    moved = np.flatnonzero(np.abs(step_of(table, before)).sum(1))
    assert moved.tolist() == [1, 3, 7]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale_grad_by_freq": True}, r"^scale_grad_by_freq: not supported"),
        ({"mode": "max"}, r'^mode: embstore pools with "sum", "mean" or "sqrtn"'),
    ],
)
def test_what_embstore_does_not_implement_is_refused_by_name(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        et.EmbeddingBag(embstore.Table(5), **kwargs)
    if "mode" not in kwargs:
        with pytest.raises(ValueError, match=match):
            et.Embedding(embstore.Table(5), **kwargs)


def test_ids_out_of_torchs_range_are_new_rows() -> None:
    """torch raises for id -1 or num_embeddings; an embstore id is a key."""
    table = embstore.Table(2)
    out = et.EmbeddingBag(table, mode="sum")(torch.tensor([[-1, 1], [11, 8]]))
    assert out.shape == (2, 2)
    assert table.contains([-1, 11]).all()


# -- max_norm, pretrained padding rows, per_sample_weights' dtype ------------------


def test_embedding_max_norm() -> None:
    """torch's test_embedding_max_norm: repeated ids read the same row and
    every row read is within max_norm, to float32's rounding of torch's own
    scale (``max_norm / (norm + 1e-7)``, which leaves some rows at 1 + 1
    ulp: the table's seed is fixed, where the process's table count chose
    it and some seeds gave such a row)."""
    table = embstore.Table(
        5, optimizer=optim.SGD(lr=0.1), initializer=embstore.init.Normal(3.0), seed=11
    )
    emb = et.Embedding(table, max_norm=1.0)
    out = emb(torch.tensor([2, 8, 8, 6]))
    assert torch.equal(out[1], out[2])
    assert out.norm(p=2, dim=1).le(1 + 2e-7).all()
    assert (out.norm(p=2, dim=1) > 0.99).all()  # N(0, 9) rows all exceeded: scaled to 1


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("max_norm", [0.5, 2.0])
def test_max_norm_forward_weight_and_training_equal_torch(
    max_norm: float, norm_type: float
) -> None:
    """nn.Embedding(max_norm=...) and ours from the same rows, trained by SGD
    over five batches of repeating unsorted ids: every output, and the rows
    after each step (torch renormalizes its weight in the forward), equal."""
    torch.manual_seed(0)
    weight = torch.randn(20, 6) * 2
    ref = nn.Embedding.from_pretrained(
        weight.clone(), freeze=False, max_norm=max_norm, norm_type=norm_type
    )
    sgd = torch.optim.SGD(ref.parameters(), lr=0.3)
    table = embstore.Table(6, optimizer=optim.SGD(lr=0.3))
    table.assign(np.arange(20), weight.numpy())
    ours = et.Embedding(table, max_norm=max_norm, norm_type=norm_type)
    rng = np.random.default_rng(1)
    for _ in range(5):
        ids = torch.from_numpy(rng.integers(0, 20, 12))
        target = torch.from_numpy(rng.standard_normal((12, 6)).astype(np.float32))
        want, got = ref(ids), ours(ids)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        ((want - target) ** 2).sum().backward()
        sgd.step()
        sgd.zero_grad()
        ((got - target) ** 2).sum().backward()
        torch.testing.assert_close(
            torch.from_numpy(rows(table, 20)), ref.weight.detach(), rtol=1e-5, atol=1e-6
        )


def test_max_norm_unsorted_repeating_indices() -> None:
    """torch's test of the same name (there CUDA against the CPU): 4,000
    repeats of two ids read as torch's CPU module reads them."""
    torch.manual_seed(0)
    ref = nn.Embedding(20, 64, max_norm=1.0)
    ours = et.Embedding(twin(ref.weight), max_norm=1.0)
    ix = torch.arange(2).repeat(2000)
    torch.testing.assert_close(ours(ix), ref(ix), rtol=1e-6, atol=1e-7)


def test_max_norm_in_eval_mode_renormalizes_the_output_only() -> None:
    weight = torch.randn(10, 4) * 3
    table = twin(weight)
    emb = et.Embedding(table, max_norm=1.0).eval()
    out = emb(torch.tensor([1, 2, 3, 42]))
    want = F.embedding(torch.tensor([1, 2, 3]), weight.clone(), max_norm=1.0)
    torch.testing.assert_close(out[:3], want)
    np.testing.assert_array_equal(rows(table, 10), weight.numpy())  # nothing written
    assert not table.contains([42])[0]


# torch takes per_sample_weights with mode="sum" only.
@pytest.mark.parametrize(("mode", "weighted"), [("sum", False), ("sum", True), ("mean", False)])
def test_embedding_bag_max_norm_equals_torch(mode: str, weighted: bool) -> None:
    torch.manual_seed(2)
    weight = torch.randn(15, 5) * 2
    ref = nn.EmbeddingBag.from_pretrained(weight.clone(), freeze=False, max_norm=1.5, mode=mode)
    table = embstore.Table(5, optimizer=optim.SGD(lr=1.0))
    table.assign(np.arange(15), weight.numpy())
    ours = et.EmbeddingBag(table, mode=mode, max_norm=1.5)
    ids = torch.tensor([3, 1, 1, 14, 4, 0, 7, 7, 7])
    offsets = torch.tensor([0, 0, 3, 6])
    w = torch.rand(9) if weighted else None
    want = ref(ids, offsets, per_sample_weights=w)
    got = ours(ids, offsets, per_sample_weights=w)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.from_numpy(rows(table, 15)), ref.weight.detach())
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(
        torch.from_numpy(rows(table, 15)), ref.weight.detach() - ref.weight.grad.to_dense()
    )


@pytest.mark.parametrize("cls", ["Embedding", "EmbeddingBag"])
def test_from_pretrained_padding_idx(cls: str) -> None:
    """torch's test_embedding(_bag)_from_pretrained_padding_idx: the padding
    row reads as given; it is never trained."""
    padding_idx = 2
    padding_vec = torch.ones(3) * 7
    embeddings = torch.rand(4, 3)
    embeddings[padding_idx] = padding_vec
    ours = getattr(et, cls).from_pretrained(
        embeddings, padding_idx=padding_idx, freeze=False, optimizer=optim.SGD(lr=1.0)
    )
    ref = getattr(nn, cls).from_pretrained(embeddings, padding_idx=padding_idx, freeze=False)
    np.testing.assert_array_equal(
        ours.table.lookup([padding_idx], insert=False)[0], padding_vec.numpy()
    )
    ids = torch.tensor([[0, 2, 3], [2, 2, 1]])
    want, got = ref(ids), ours(ids)
    torch.testing.assert_close(got, want)
    if cls == "Embedding":
        torch.testing.assert_close(got[1, 0], padding_vec)  # read as given
    got.sum().backward()
    np.testing.assert_array_equal(
        ours.table.lookup([padding_idx], insert=False)[0], padding_vec.numpy()
    )


def test_embedding_bag_per_sample_weights_of_another_dtype_are_refused() -> None:
    """torch's test_embedding_bag_per_sample_weights_failures, failure 1."""
    ids = torch.tensor([3, 1, 1, 1, 4, 0])
    offsets = torch.tensor([0, 0, 3, 3, 6])
    w = torch.randn(6, dtype=torch.double)
    with pytest.raises(RuntimeError, match="have the same type as"):
        nn.EmbeddingBag(5, 2, mode="sum")(ids, offsets, w)
    table = embstore.Table(2)
    with pytest.raises(TypeError, match=r"^per_sample_weights: expected float32"):
        et.EmbeddingBag(table, mode="sum")(ids, offsets, w)
    assert len(table) == 0  # refused before anything was stored
