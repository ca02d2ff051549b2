"""A mapped table (``Table.load(path, mmap=True)``) behind a Collection and
the torch modules: serving reads equal the same reads of the live table
that saved it; every path that would write raises ReadOnlyError; a module
over a mapped table is frozen, keeps no table state in its state dict, and
deep-copies and pickles by reopening the checkpoint."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import embstore
from embstore import optim
from embstore.exceptions import ReadOnlyError

torch = pytest.importorskip("torch")
import embstore.torch as et  # noqa: E402


def tables(tmp_path) -> tuple[dict[str, embstore.Table], dict[str, embstore.MappedTable]]:
    """Two trained tables (one shared by two features), saved and mapped."""
    rng = np.random.default_rng(0)
    live = {
        "user": embstore.Table(4, optimizer=optim.Adam(lr=0.05), seed=1),
        "item": embstore.Table(6, optimizer=optim.Adagrad(lr=0.1), seed=2, dtype="bfloat16"),
    }
    for t in live.values():
        k = rng.integers(0, 500, 2_000)
        t.lookup(k)
        t.apply_gradients(k, rng.standard_normal((k.size, t.dim)).astype(np.float32))
    mapped = {}
    for name, t in live.items():
        t.save(tmp_path / name, with_optimizer=False)
        mapped[name] = embstore.Table.load(tmp_path / name, mmap=True)
    return live, mapped


def bags(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    lengths = rng.integers(0, 4, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return rng.integers(0, 700, int(offsets[-1])), offsets


def test_a_collection_of_mapped_tables_serves_as_the_live_one(tmp_path) -> None:
    live, mapped = tables(tmp_path)

    def coll(t: dict) -> embstore.Collection:
        return embstore.Collection(
            {"user": t["user"], "item": t["item"], "hist": t["item"]},
            combiners={"hist": "mean", "user": "sqrtn"},
        )

    a, b = coll(live), coll(mapped)
    rng = np.random.default_rng(1)
    batch = {name: bags(rng, 64) for name in ("user", "item", "hist")}
    for default in ("init", "zeros"):
        np.testing.assert_array_equal(
            b.lookup_pooled(batch, insert=False, default=default),
            a.lookup_pooled(batch, insert=False, default=default),
        )
    with pytest.raises(ReadOnlyError, match="insert=True"):
        b.lookup_pooled(batch)
    with pytest.raises(ReadOnlyError, match="read-only"):
        b.apply_pooled_gradients(batch, np.ones((64, b.dim), np.float32))


def test_modules_over_a_mapped_table_serve_as_over_the_live_one(tmp_path) -> None:
    live, mapped = tables(tmp_path)
    rng = np.random.default_rng(2)
    ids = torch.from_numpy(rng.integers(0, 700, (8, 5)))
    ids_b, offsets = (torch.from_numpy(x) for x in bags(rng, 16))
    for mod in (et.Embedding, et.EmbeddingBag):
        served = mod(mapped["user"], default="zeros").eval()
        want = mod(live["user"], default="zeros").eval()
        with torch.no_grad():
            if mod is et.Embedding:
                got, exp = served(ids), want(ids)
            else:
                got, exp = served(ids_b, offsets), want(ids_b, offsets)
        assert torch.equal(got, exp)
        # Frozen: a training-mode forward and backward store and step nothing.
        assert served.frozen
        served.train()
        out = served(ids) if mod is et.Embedding else served(ids_b, offsets)
        out.sum().backward()
        assert len(mapped["user"]) == len(live["user"])
    ebc_live = et.EmbeddingBagCollection(
        embstore.Collection({"user": live["user"], "item": live["item"]})
    ).eval()
    ebc = et.EmbeddingBagCollection(
        embstore.Collection({"user": mapped["user"], "item": mapped["item"]})
    ).eval()
    batch = {"user": torch.tensor([1, 2, 600]), "item": torch.tensor([3, 4, 5])}
    with torch.no_grad():
        assert torch.equal(ebc(batch), ebc_live(batch))
    ebc.train()
    with pytest.raises(ReadOnlyError):
        ebc(batch)


def test_a_module_over_a_mapped_table_copies_by_reopening_it(tmp_path) -> None:
    _, mapped = tables(tmp_path)
    m = et.Embedding(mapped["item"]).eval()
    assert not any(k.startswith("item") for k in m.state_dict())
    assert m.state_dict() == {}
    ids = torch.tensor([1, 2, 3, 999])
    for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert twin.table is not m.table
        assert twin.table.path == m.table.path
        with torch.no_grad():
            assert torch.equal(twin(ids), m(ids))
    # A state dict with rows for a mapped table is refused by name.
    live = et.Embedding(embstore.Table(6, seed=2, dtype="bfloat16"))
    live.table.lookup(np.arange(5))
    with pytest.raises(RuntimeError, match="read-only"):
        m.load_state_dict(live.state_dict())
