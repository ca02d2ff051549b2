"""Front ends over any tier of the read protocol (embstore.protocol.ReadTier):
a torch EmbeddingBag and Embedding over a DeviceCache train as torch's own
modules with torch.optim.SGD do (the oracle), a Collection mixing a
DeviceCache and a Table trains as one over Tables, and what a tier cannot
do is refused by name. (Over a ShardedTable: tests/torchrun/gloo_suite.py.)"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import embstore  # noqa: E402
import embstore.torch as et  # noqa: E402
from embstore import optim  # noqa: E402
from embstore.gpu import DeviceCache  # noqa: E402
from embstore.protocol import ReadTier  # noqa: E402

DIM, VOCAB, LR = 4, 40, 0.3


def _batches(seed: int, n: int = 6, bags: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lens = rng.integers(0, 4, bags)
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        out.append((rng.integers(0, VOCAB, int(offsets[-1])).astype(np.int64), offsets))
    return out


def _initial_rows(seed: int) -> np.ndarray:
    return embstore.Table(DIM, seed=seed).lookup(np.arange(VOCAB), insert=False)


def test_every_tier_satisfies_the_read_protocol_and_says_whether_it_is_writable(
    tmp_path: object,
) -> None:
    t = embstore.Table(DIM, optimizer=optim.SGD(lr=LR))
    t.lookup(np.arange(3))
    t.save(str(tmp_path))
    m = embstore.Table.load(str(tmp_path), mmap=True)
    c = DeviceCache(embstore.Table(DIM, optimizer=optim.SGD(lr=LR)), 8, xp=np)
    for tier, writable in ((t, True), (m, False), (c, True)):
        assert isinstance(tier, ReadTier)
        assert tier.writable is writable


def _trains_as_torchs(
    ours: torch.nn.Module,
    ref: torch.nn.Module,
    cache: DeviceCache,
    seed: int,
    inputs: list[tuple[torch.Tensor, ...]],
) -> None:
    """Steps ``ours`` (over ``cache``) and torch's ``ref`` (its weight the
    table's initial rows, torch.optim.SGD) on the same inputs and upstream
    gradients: outputs and, after a flush, every row equal."""
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(_initial_rows(seed)))
    sgd = torch.optim.SGD(ref.parameters(), lr=LR)
    rng = np.random.default_rng(seed)
    for args in inputs:
        out, want = ours(*args), ref(*args)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        up = torch.from_numpy(rng.normal(size=tuple(out.shape)).astype(np.float32))
        (out * up).sum().backward()
        sgd.zero_grad()
        (want * up).sum().backward()
        sgd.step()
    cache.flush()
    torch.testing.assert_close(
        torch.from_numpy(cache.table.lookup(np.arange(VOCAB), insert=False)),
        ref.weight.detach(),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_an_embedding_bag_over_a_device_cache_trains_as_torchs_with_sgd(combiner: str) -> None:
    cache = DeviceCache(embstore.Table(DIM, optimizer=optim.SGD(lr=LR), seed=11), 6, xp=np)
    _trains_as_torchs(
        et.EmbeddingBag(cache, mode=combiner, include_last_offset=True),
        torch.nn.EmbeddingBag(VOCAB, DIM, mode=combiner, include_last_offset=True),
        cache,
        11,
        [(torch.from_numpy(i), torch.from_numpy(o)) for i, o in _batches(3)],
    )


def test_an_embedding_over_a_device_cache_trains_as_torchs_with_sgd() -> None:
    cache = DeviceCache(embstore.Table(DIM, optimizer=optim.SGD(lr=LR), seed=4), 5, xp=np)
    rng = np.random.default_rng(8)
    _trains_as_torchs(
        et.Embedding(cache),
        torch.nn.Embedding(VOCAB, DIM),
        cache,
        4,
        [(torch.from_numpy(rng.integers(0, VOCAB, (3, 4))),) for _ in range(5)],
    )


def test_a_collection_mixing_a_device_cache_and_a_table_trains_as_one_over_tables() -> None:
    def tiers(cached: bool) -> tuple[dict[str, object], list[embstore.Table]]:
        a = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.2), seed=1)
        b = embstore.Table(DIM, optimizer=optim.Adagrad(lr=0.2), seed=2)
        front = DeviceCache(a, 6, xp=np) if cached else a
        # Features "x" and "z" share one tier: one step of it per call.
        return {"x": front, "y": b, "z": front}, [a, b]

    mixed_features, (ma, mb) = tiers(True)
    plain_features, (pa, pb) = tiers(False)
    mixed = embstore.Collection(mixed_features)  # type: ignore[arg-type]
    plain = embstore.Collection(plain_features)  # type: ignore[arg-type]
    rng = np.random.default_rng(2)
    for (ix, ox), (iy, oy), (iz, oz) in zip(_batches(1), _batches(2), _batches(3), strict=True):
        batch = {"x": (ix, ox), "y": (iy, oy), "z": (iz, oz)}
        np.testing.assert_allclose(
            mixed.lookup_pooled(batch), plain.lookup_pooled(batch), rtol=1e-5, atol=1e-6
        )
        g = rng.normal(size=(ox.shape[0] - 1, 3 * DIM)).astype(np.float32)
        mixed.apply_pooled_gradients(batch, g)
        plain.apply_pooled_gradients(batch, g)
    assert mixed_features["x"].step == pa.step  # type: ignore[attr-defined]
    mixed_features["x"].flush()  # type: ignore[attr-defined]
    for got, want in ((ma, pa), (mb, pb)):
        keys = np.arange(VOCAB)
        np.testing.assert_allclose(
            got.lookup(keys, insert=False), want.lookup(keys, insert=False), rtol=1e-5, atol=1e-6
        )


def test_what_a_tier_cannot_do_is_refused_by_name(tmp_path: object) -> None:
    cache = DeviceCache(embstore.Table(DIM, optimizer=optim.SGD(lr=LR)), 4, xp=np)
    with pytest.raises(ValueError, match="default"):
        et.EmbeddingBag(cache, default="zeros")
    module = et.EmbeddingBag(cache, include_last_offset=True)
    with pytest.raises(TypeError, match="DeviceCache, which has no state_dict"):
        module.state_dict()
    with pytest.raises(TypeError, match="ReadTier"):
        et.Embedding(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ReadTier"):
        embstore.Collection({"a": object()})  # type: ignore[dict-item]
    coll = embstore.Collection({"a": cache})
    with pytest.raises(ValueError, match="default"):
        coll.lookup_pooled({"a": np.arange(3)}, default="zeros")
    # A read-only tier: its module is frozen, its collection refuses steps.
    t = embstore.Table(DIM, optimizer=optim.SGD(lr=LR))
    t.lookup(np.arange(5))
    t.save(str(tmp_path))
    mapped = embstore.Table.load(str(tmp_path), mmap=True)
    assert et.Embedding(mapped).frozen
    with pytest.raises(embstore.ReadOnlyError, match="feature 'm'"):
        embstore.Collection({"m": mapped, "a": cache}).apply_pooled_gradients(
            {"m": np.arange(2), "a": np.arange(2)}, np.zeros((2, 2 * DIM), np.float32)
        )
