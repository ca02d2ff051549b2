"""TorchRec's table configurations, and collections built from them.

:class:`EmbeddingBagConfig` and :class:`EmbeddingConfig` carry the fields of
``torchrec.EmbeddingBagConfig`` / ``torchrec.EmbeddingConfig`` that an
embstore table uses; torchrec's own config objects work as well (read by
attribute, so torchrec need not be installed for these). A config makes one
table serving its ``feature_names``:

- ``embedding_dim`` -> the table's dim; ``data_type`` FP32, FP16 or BF16 ->
  its row dtype;
- ``weight_init_min`` / ``weight_init_max`` -> a Uniform initializer, with
  TorchRec's defaults ``-/+ sqrt(1 / num_embeddings)``; an ``init_fn`` other
  than torchrec's default (uniform over those bounds) is refused;
- ``num_embeddings`` sets only those defaults: an embstore table grows with
  the ids it meets, any int64 (bound it with ``table_options={"capacity":
  ...}``);
- ``pooling`` SUM or MEAN -> the features' combiner (EmbeddingBagConfig).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from embstore import init
from embstore.collection import Collection
from embstore.optim import Optimizer
from embstore.store import Table

__all__ = ["EmbeddingBagConfig", "EmbeddingConfig", "collection_from_configs"]

_DTYPES = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16"}
_POOLING = {"SUM": "sum", "MEAN": "mean", "NONE": None}


@dataclass
class EmbeddingConfig:
    """One table of an unpooled :class:`embstore.torch.EmbeddingCollection`
    (torchrec.EmbeddingConfig's fields)."""

    num_embeddings: int
    embedding_dim: int
    name: str = ""
    data_type: str = "FP32"
    feature_names: list[str] = field(default_factory=list)
    weight_init_max: float | None = None
    weight_init_min: float | None = None
    init_fn: Any = None
    need_pos: bool = False
    pooling: str = "NONE"


@dataclass
class EmbeddingBagConfig(EmbeddingConfig):
    """One table of an :class:`embstore.torch.EmbeddingBagCollection`
    (torchrec.EmbeddingBagConfig's fields); ``pooling`` "SUM" (TorchRec's
    default) or "MEAN"."""

    pooling: str = "SUM"


def _name_of(value: Any) -> str:
    """An enum member (torchrec's DataType, PoolingType) or a string, as its
    upper-case name."""
    name = getattr(value, "name", value)
    return str(name).upper()


def _default_init(config: Any) -> bool:
    """Whether a config's ``init_fn`` is unset or torchrec's default (its
    ``__post_init__`` fills in ``partial(torch.nn.init.uniform_, a=min,
    b=max)`` of the weight_init bounds), which the Uniform initializer
    equals."""
    fn = getattr(config, "init_fn", None)
    if fn is None:
        return True
    import torch

    return (
        isinstance(fn, functools.partial)
        and fn.func is torch.nn.init.uniform_
        and not fn.args
        and set(fn.keywords) == {"a", "b"}
    )


def _table_of(
    config: Any,
    where: str,
    optimizer: Optimizer | Mapping[str, Optimizer] | None,
    table_options: Mapping[str, Any],
) -> tuple[str, Table, list[str], str | None]:
    """``(name, table, feature names, pooling)`` of one config."""
    try:
        name = str(config.name)
        dim = int(config.embedding_dim)
        rows = int(config.num_embeddings)
        features = list(config.feature_names)
    except AttributeError as e:
        raise TypeError(
            f"{where}: expected an EmbeddingBagConfig or EmbeddingConfig (name, embedding_dim, "
            f"num_embeddings, feature_names), got {type(config).__name__}"
        ) from e
    if not name:
        raise ValueError(f"{where}.name: expected the table's name")
    if not features:
        raise ValueError(f"{where}.feature_names: empty; name the features table {name!r} serves")
    if rows < 1:
        raise ValueError(f"{where}.num_embeddings: expected >= 1, got {rows}")
    if not _default_init(config):
        raise ValueError(
            f"{where}.init_fn: not supported (an embstore row's first value is a pure function "
            "of the seed and key); use weight_init_min / weight_init_max"
        )
    if getattr(config, "need_pos", False):
        raise ValueError(f"{where}.need_pos: position weighting is not supported")
    dtype = _DTYPES.get(_name_of(getattr(config, "data_type", "FP32")))
    if dtype is None:
        raise ValueError(
            f"{where}.data_type: expected FP32, FP16 or BF16, got {config.data_type!r}"
        )
    pooling_name = _name_of(getattr(config, "pooling", "NONE"))
    if pooling_name not in _POOLING:
        raise ValueError(f"{where}.pooling: expected SUM, MEAN or NONE, got {config.pooling!r}")
    bound = math.sqrt(1.0 / rows)
    high = getattr(config, "weight_init_max", None)
    low = getattr(config, "weight_init_min", None)
    fn = getattr(config, "init_fn", None)
    if fn is not None:  # torchrec's default: the bounds it holds
        low, high = fn.keywords["a"], fn.keywords["b"]
    initializer = init.Uniform(
        low=-bound if low is None else float(low), high=bound if high is None else float(high)
    )
    opt: Optimizer | None = optimizer  # type: ignore[assignment]
    if isinstance(optimizer, Mapping):
        if name not in optimizer:
            raise ValueError(f"optimizer: no optimizer for table {name!r}")
        opt = optimizer[name]
    table = Table(dim, optimizer=opt, initializer=initializer, dtype=dtype, **table_options)
    return name, table, features, _POOLING[pooling_name]


def collection_from_configs(
    tables: Sequence[Any],
    *,
    pooled: bool,
    optimizer: Optimizer | Mapping[str, Optimizer] | None = None,
    table_options: Mapping[str, Any] | None = None,
) -> Collection:
    """A :class:`embstore.Collection` with one new table per config, each
    serving its config's features (in the configs' order).

    ``optimizer``: one optimizer for every table, a mapping from table name
    to optimizer, or None (tables only read and assigned).
    ``table_options``: further :class:`embstore.Table` arguments for every
    table (``capacity``, ``eviction``, ``ttl_steps``, ``num_shards``, ...).
    """
    if isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence) or not tables:
        raise ValueError("tables: expected a non-empty list of embedding configs")
    if optimizer is not None and not isinstance(optimizer, (Optimizer, Mapping)):
        raise TypeError(
            f"optimizer: expected an embstore.optim optimizer, a mapping of table name to "
            f"optimizer, or None, got {type(optimizer).__name__}"
        )
    options = dict(table_options or {})
    taken = {"dim", "optimizer", "initializer", "dtype"} & set(options)
    if taken:
        raise ValueError(f"table_options: {sorted(taken)} come from the configs")
    features: dict[str, Table] = {}
    combiners: dict[str, str] = {}
    names: set[str] = set()
    for i, config in enumerate(tables):
        where = f"tables[{i}]"
        name, table, feature_names, pooling = _table_of(config, where, optimizer, options)
        if name in names:
            raise ValueError(f"{where}.name: {name!r} names two tables")
        names.add(name)
        if pooled and pooling is None:
            raise ValueError(
                f"{where}.pooling: NONE; an EmbeddingBagCollection pools (SUM or MEAN), "
                "an EmbeddingCollection does not"
            )
        for feature in feature_names:
            if feature in features:
                raise ValueError(f"{where}.feature_names: {feature!r} is served by two tables")
            features[feature] = table
            if pooled and pooling is not None:
                combiners[feature] = pooling
    return Collection(features, combiners=combiners)
