"""Table.state_dict / load_state_dict: a round trip rebuilds the table
exactly (rows, optimizer state, step, seed, and the touch metadata that
LFU/LRU/TTL decide by), and what comes in is checked like a checkpoint:
finite values, optimizer state that some sequence of steps could have
produced, errors naming the state-dict entry."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import embstore
from embstore import optim
from embstore.exceptions import CheckpointError

from ._crafted import crc32c


def _trained(eviction: str, **kw: object) -> embstore.Table:
    t = embstore.Table(4, optimizer=optim.Adagrad(lr=0.1), seed=3, eviction=eviction, **kw)
    rng = np.random.default_rng(0)
    for _ in range(30):
        keys = rng.zipf(1.3, 64) % 200
        t.lookup(keys)
        t.apply_gradients(keys, np.ones((64, 4), np.float32))
    return t


@pytest.mark.parametrize(
    ("eviction", "kw"),
    [("lfu", {"capacity": 120}), ("lru", {"capacity": 120}), ("lru", {"ttl_steps": 5})],
)
def test_a_state_dict_round_trip_keeps_eviction_decisions(
    eviction: str, kw: dict[str, int]
) -> None:
    """Training on from load_state_dict evicts the same rows as training on
    from the original (touch counts and recency travel in ``meta``)."""
    a = _trained(eviction, **kw)
    b = embstore.Table(4, optimizer=optim.Adagrad(lr=0.1), seed=99, eviction=eviction, **kw)
    sd = a.state_dict()
    assert sd["meta"].shape == (len(a), 3)
    b.load_state_dict(sd)
    rng = np.random.default_rng(1)
    for _ in range(20):
        keys = rng.integers(150, 400, 48)
        for t in (a, b):
            t.lookup(keys)
            t.apply_gradients(keys, np.full((48, 4), 0.5, np.float32))
    ka, ra, sa = a.export(with_state=True)
    kb, rb, sb = b.export(with_state=True)
    np.testing.assert_array_equal(ka, kb)
    np.testing.assert_array_equal(ra, rb)
    np.testing.assert_array_equal(sa, sb)
    np.testing.assert_array_equal(a.evict(), b.evict())


def test_a_table_without_a_policy_has_no_meta_entry() -> None:
    t = embstore.Table(4, optimizer=optim.SGD(lr=0.1))
    t.lookup([1, 2])
    assert "meta" not in t.state_dict()


# Parameters that are sums of powers of two, so that the manifest's JSON
# spells them the same from Python and from the native writer (the crafted
# checkpoint's checksum must hold, leaving the state as the only damage).
ADAM = {"lr": 0.5, "beta1": 0.5, "beta2": 0.75, "eps": 0.25}
NEGATIVE_STATE = {
    # optimizer, state_len(dim=4), column that accumulates squares
    "Adagrad": (optim.Adagrad(lr=0.5, eps=0.25), 4, 0),
    "RowWiseAdagrad": (optim.RowWiseAdagrad(lr=0.5, eps=0.25), 1, 0),
    "Adam": (optim.Adam(**ADAM), 8, 4),
    "AdamW": (optim.AdamW(**ADAM, weight_decay=0.5), 8, 4),
    "Ftrl": (optim.Ftrl(lr=0.5, initial_accumulator_value=0.5), 8, 4),
}


@pytest.mark.parametrize("name", sorted(NEGATIVE_STATE))
def test_state_no_optimizer_can_produce_is_refused_everywhere(
    name: str, tmp_path: pathlib.Path
) -> None:
    """A negative accumulator (Adagrad's sum, Adam's exp_avg_sq, FTRL's
    accumulator) makes the next step NaN: load_state_dict, write_back and
    a checkpoint refuse it, and nothing changes."""
    opt, sl, col = NEGATIVE_STATE[name]
    t = embstore.Table(4, optimizer=opt)
    t.lookup([1, 2, 3])
    sd = t.state_dict()
    sd["state"] = sd["state"].copy()
    sd["state"][1, col] = -1.0
    before = t.state_dict()
    with pytest.raises(ValueError, match=r"state\['state'\]: row 1"):
        t.load_state_dict(sd)
    with pytest.raises(ValueError, match="state: row 1"):
        t.write_back(sd["keys"], sd["rows"], sd["state"])
    after = t.state_dict()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    # The same state in a checkpoint (re-checksummed, so only the values are wrong).
    ck = tmp_path / "ck"
    t.save(ck)
    _poke_state(ck, row=1, col=col, value=-1.0, state_len=sl)
    with pytest.raises(CheckpointError, match="negative"):
        embstore.Table.load(ck)


def _poke_state(ck: pathlib.Path, row: int, col: int, value: float, state_len: int) -> None:
    """Writes ``value`` into the state tensor of the file holding key 2 and
    fixes the file's and the manifest's checksums."""
    import json
    import struct

    from ._crafted import rewrite_manifest

    m = json.loads((ck / "manifest.json").read_text())
    for f in m["chain"][0]["files"]:
        raw = bytearray((ck / f["name"]).read_bytes())
        (hlen,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + hlen])
        base = 8 + hlen
        ks, ke = header["keys"]["data_offsets"]
        keys = np.frombuffer(bytes(raw[base + ks : base + ke]), np.int64)
        hit = np.flatnonzero(keys == 2)
        if hit.size == 0:
            continue
        ss, _ = header["state"]["data_offsets"]
        at = base + ss + 4 * (int(hit[0]) * state_len + col)
        raw[at : at + 4] = struct.pack("<f", value)
        (ck / f["name"]).write_bytes(bytes(raw))
        crc = crc32c(bytes(raw))

        def edit(man: dict[str, object], name: str = f["name"], crc: int = crc) -> None:
            for link in man["chain"]:  # type: ignore[attr-defined]
                for e in link["files"]:
                    if e["name"] == name:
                        e["crc32c"] = crc

        rewrite_manifest(ck, edit)
        return
    raise AssertionError("key 2 not found")


def test_load_state_dict_names_the_entry_that_is_not_finite() -> None:
    t = embstore.Table(4, optimizer=optim.Adam(lr=0.1))
    t.lookup([1, 2])
    sd = t.state_dict()
    bad = dict(sd, rows=sd["rows"].copy())
    bad["rows"][0, 0] = np.nan
    with pytest.raises(ValueError, match=r"state\['rows'\]"):
        t.load_state_dict(bad)
    bad = dict(sd, state=sd["state"].copy())
    bad["state"][1, 2] = np.inf
    with pytest.raises(ValueError, match=r"state\['state'\]"):
        t.load_state_dict(bad)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize(
    "kw",
    [{}, {"capacity": 40, "eviction": "lru"}, {"ttl_steps": 3, "dtype": "bfloat16"}],
    ids=["plain", "capacity-lru", "ttl-bf16"],
)
def test_a_copy_is_an_independent_table_that_trains_on_alike(how: str, kw: dict) -> None:
    """pickle and copy.deepcopy copy a Table by value: the copy has the
    rows, optimizer state, step, seed and policy metadata; training the copy
    leaves the original as it was; training both on equals, bit for bit."""
    import copy
    import pickle

    t = embstore.Table(4, optimizer=optim.Adam(lr=0.05), seed=11, **kw)
    rng = np.random.default_rng(1)
    for _ in range(5):
        k = rng.integers(0, 60, 30)
        t.apply_gradients(k, rng.normal(size=(30, 4)).astype(np.float32))
    c = pickle.loads(pickle.dumps(t)) if how == "pickle" else copy.deepcopy(t)
    assert c is not t
    assert (c.step, c.seed, c.config()) == (t.step, t.seed, t.config())
    for name, a in t.state_dict().items():
        np.testing.assert_array_equal(c.state_dict()[name], a, err_msg=name)
    before = t.state_dict()
    k = rng.integers(0, 60, 30)
    g = rng.normal(size=(30, 4)).astype(np.float32)
    c.apply_gradients(k, g)
    for name, a in before.items():  # the original did not move
        np.testing.assert_array_equal(t.state_dict()[name], a, err_msg=name)
    t.apply_gradients(k, g)
    for name, a in t.state_dict().items():
        np.testing.assert_array_equal(c.state_dict()[name], a, err_msg=name)
