"""One config: :class:`embstore.TableConfig` is what every way of making a
table goes through (the constructor, ``from_config``, loading, pickling,
state dicts, the torch configs), and it matches the core's spec field by
field (the JSON the native table is built from and gives back)."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path
from typing import Any, get_type_hints

import numpy as np
import pytest

import embstore
from embstore import _core, init, optim, policy
from embstore.config import TableConfig, TableSettings
from embstore.store import _restore_table

#: Every setting away from its default (each a value the core accepts).
EVERY = [
    dict(
        optimizer=optim.Adam(lr=0.01, weight_decay=0.1),
        initializer=init.Normal(std=0.2),
        seed=2**64 - 1,
        num_shards=4,
        dtype="bfloat16",
        admission=policy.CountFilter(min_count=2, width=1024, depth=2),
        ttl_seconds=60,
        capacity=500,
        capacity_bytes=1 << 20,
        eviction="lru",
    ),
    dict(
        optimizer=optim.RowWiseAdagrad(lr=0.5),
        initializer=init.Constant(value=0.25),
        seed=7,
        num_shards=1,
        dtype="float16",
        admission=policy.ProbabilityFilter(p=0.5),
        ttl_steps=9,
    ),
    dict(initializer=init.Zeros(), seed=0, ttl_seconds=5),
]


def test_the_constructors_keywords_are_the_configs_fields() -> None:
    fields = [f.name for f in dataclasses.fields(TableConfig)]
    assert fields[0] == "dim"
    assert list(get_type_hints(TableSettings)) == fields[1:]


@pytest.mark.parametrize("settings", EVERY, ids=["adam", "rowwise", "cache"])
def test_a_tables_config_is_what_built_it_and_what_its_core_holds(
    settings: dict[str, Any], tmp_path: Path
) -> None:
    table = embstore.Table(6, **settings)
    config = TableConfig(6, **{"num_shards": table.num_shards, **settings})
    assert table.table_config == config
    assert embstore.Table.from_config(config).table_config == config
    # The core's spec, read back field by field, is the same config.
    assert TableConfig._from_core(table._inner.config_json()) == config
    # Every copy of the table keeps it: a checkpoint (its manifest), a
    # pickle, a deep copy, a state dict loaded into a table of the config.
    keys = np.arange(50, dtype=np.int64)
    table.assign(keys, np.full((50, 6), 0.5, np.float32))
    table.save(tmp_path / "ck")
    loaded = embstore.Table.load(tmp_path / "ck", num_shards=4)
    assert loaded.table_config == dataclasses.replace(config, num_shards=4)
    for other in (pickle.loads(pickle.dumps(table)), copy.deepcopy(table)):
        assert other.table_config == config
        np.testing.assert_array_equal(other.lookup(keys), table.lookup(keys))
    fresh = embstore.Table.from_config(dataclasses.replace(config, seed=1))
    fresh.load_state_dict(table.state_dict())
    assert fresh.table_config == config  # the state dict's seed
    # config() is the plain form every rank of a ShardedTable compares.
    plain = table.config()
    assert plain["seed"] == config.seed
    assert "num_shards" not in plain
    assert plain["ttl_seconds"] == config.ttl_seconds
    assert plain["capacity_bytes"] == config.capacity_bytes


def test_the_default_config_draws_its_seed_and_shards_when_a_table_is_built() -> None:
    embstore.manual_seed(40)
    config = TableConfig(3)
    assert (config.seed, config.num_shards, config.initializer) == (None, None, init.Uniform())
    a, b = embstore.Table.from_config(config), embstore.Table(3)
    assert (a.seed, b.seed) == (40, 41)
    assert a.table_config.num_shards == a.num_shards >= 1
    assert json.loads(config._to_core()) == {
        "dim": 3,
        "initializer": {"name": "Uniform", "params": {"low": -0.05, "high": 0.05}},
        "dtype": "float32",
        "eviction": "lfu",
    }


@pytest.mark.parametrize(
    ("settings", "error", "named"),
    [
        ({"ttl_steps": "9"}, TypeError, "ttl_steps: expected an int or None"),
        ({"capacity": 0}, ValueError, "capacity: expected capacity >= 1"),
        ({"capacity_bytes": True}, TypeError, "capacity_bytes"),
        ({"seed": -1}, ValueError, "seed: expected 0 <= seed < 2**64"),
        ({"num_shards": 0}, ValueError, "num_shards"),
        ({"dtype": "int4"}, ValueError, "dtype: expected one of"),
        ({"eviction": "fifo"}, ValueError, "eviction: expected one of"),
        ({"optimizer": "adam"}, TypeError, "optimizer: expected an embstore.optim"),
        ({"initializer": 0.1}, TypeError, "initializer: expected an embstore.init"),
        ({"admission": 3}, TypeError, "admission: expected an embstore.policy filter"),
    ],
)
def test_a_bad_setting_is_refused_by_name_by_the_config_and_the_constructor(
    settings: dict[str, Any], error: type[Exception], named: str
) -> None:
    for make in (lambda: TableConfig(4, **settings), lambda: embstore.Table(4, **settings)):
        with pytest.raises(error, match=named.replace("*", r"\*")):
            make()


def test_an_unknown_setting_is_refused_by_the_config_and_by_the_core() -> None:
    with pytest.raises(TypeError, match="made_up"):
        embstore.Table(4, made_up=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="config: unknown field `made_up`"):
        _core.Table(json.dumps({"dim": 4, "made_up": 1}))
    with pytest.raises(TypeError, match=r"config: expected an embstore\.TableConfig"):
        embstore.Table.from_config({"dim": 4})  # type: ignore[arg-type]
    # What depends on several settings is the core's to check.
    with pytest.raises(ValueError, match="ttl_steps: expected a table with an optimizer"):
        embstore.Table.from_config(TableConfig(4, ttl_steps=3))


def test_a_pickle_made_before_the_config_still_loads() -> None:
    # Pickles made before TableConfig hold the constructor's keywords.
    table = embstore.Table(4, optimizer=optim.SGD(lr=0.1), seed=5)
    table.assign([1, 2], np.ones((2, 4), np.float32))
    kwargs = {"dim": 4, "optimizer": optim.SGD(lr=0.1), "seed": 5, "eviction": "lfu"}
    restored = _restore_table(kwargs, table.state_dict())
    assert restored.table_config == dataclasses.replace(table.table_config)
    np.testing.assert_array_equal(restored.lookup([1, 2]), table.lookup([1, 2]))


def test_a_load_takes_the_constructors_config(tmp_path: Path) -> None:
    """``Table.load(path, config=...)``: the config's num_shards, dtype,
    disk and memory_bytes are the load's (equal to the loose arguments);
    any other setting must be the checkpoint's (ValueError naming the
    first that is not); a config beside a loose argument, or a config that
    is not one, is refused by name."""
    cfg = TableConfig(8, optimizer=optim.Adam(lr=0.01), seed=3)
    t = embstore.Table.from_config(cfg)
    keys = np.arange(500, dtype=np.int64)
    t.lookup(keys)
    t.apply_gradients(keys, np.ones((keys.size, 8), np.float32))
    t.save(tmp_path / "ck")
    again = embstore.Table.load(
        tmp_path / "ck", config=dataclasses.replace(cfg, num_shards=3, dtype="int8")
    )
    loose = embstore.Table.load(tmp_path / "ck", num_shards=3, dtype="int8")
    assert (again.num_shards, again.dtype, again.step) == (3, "int8", t.step)
    for a, b in zip(again.export(with_state=True), loose.export(with_state=True), strict=True):
        np.testing.assert_array_equal(a, b)
    on_disk = embstore.Table.load(
        tmp_path / "ck",
        config=dataclasses.replace(cfg, disk=tmp_path / "spill", memory_bytes=10_000),
    )
    assert on_disk.stats()["disk_rows"] > 0
    np.testing.assert_array_equal(on_disk.lookup(keys, insert=False), t.lookup(keys, insert=False))
    # A seed of None matches any.
    assert len(embstore.Table.load(tmp_path / "ck", config=dataclasses.replace(cfg, seed=None)))
    with pytest.raises(ValueError, match=r"config\.optimizer: the checkpoint at .* has Adam"):
        embstore.Table.load(
            tmp_path / "ck", config=dataclasses.replace(cfg, optimizer=optim.Adagrad(lr=0.1))
        )
    with pytest.raises(ValueError, match=r"config\.dim: the checkpoint at .* has 8"):
        embstore.Table.load(tmp_path / "ck", config=dataclasses.replace(cfg, dim=9))
    with pytest.raises(ValueError, match="num_shards: expected it in config= or on its own"):
        embstore.Table.load(tmp_path / "ck", config=cfg, num_shards=2)
    with pytest.raises(TypeError, match=r"config: expected an embstore\.TableConfig, got dict"):
        embstore.Table.load(tmp_path / "ck", config={"dim": 8})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="config: a table loaded with mmap=True"):
        embstore.Table.load(tmp_path / "ck", config=cfg, mmap=True)  # type: ignore[call-overload]
