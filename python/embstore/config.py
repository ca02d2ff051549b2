"""How a :class:`embstore.Table` is built: :class:`TableConfig`, one frozen
value that the constructor, ``config()``, pickling, state dicts, loading
and the sharded tier all go through.

Its fields are those of the core's ``TableConfig`` and memory ``Policy``
(rust/embstore-core/src/policy.rs, whose serde form a checkpoint's manifest
holds): the native table is built from :meth:`TableConfig._to_core`'s JSON
and a loaded table's config is read back with :meth:`TableConfig._from_core`,
field by field with no list of names in between. A new setting is a field
here (with its check) and one in the core's spec; nothing else names it.
"""

from __future__ import annotations

import json
import os
from dataclasses import KW_ONLY, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from embstore import init, optim, policy
from embstore._convert import NativeConfig, check_int, check_name
from embstore.init import Initializer, Uniform
from embstore.optim import Optimizer
from embstore.policy import Admission

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["TableConfig", "TableSettings"]

_U64_MAX = 2**64 - 1


def _opt_int(name: str, value: Any) -> int | None:
    """None, or an integer of at least 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int or None, got {type(value).__name__}")
    return check_int(name, value, 1, _U64_MAX)


def _named(kind: type[NativeConfig], what: str) -> Callable[[str, Any], Any]:
    """The check of a field holding a ``kind`` (or None)."""

    def check(name: str, value: Any) -> Any:
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name}: expected {what} or None, got {type(value).__name__}")
        return value

    return check


def _seed(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int or None, got {type(value).__name__}")
    if not 0 <= value < 2**64:
        raise ValueError(f"{name}: expected 0 <= seed < 2**64, got {value}")
    return int(value)


def _path(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a path or None, got {type(value).__name__}")
    path = os.fspath(value)
    if not path:
        # "" would name the current directory: a mistake, never a choice.
        raise ValueError(f"{name}: expected the path of a directory, got an empty string")
    return path


def _initializer(name: str, value: Any) -> Initializer:
    if value is None:
        return Uniform()
    if not isinstance(value, Initializer):
        raise TypeError(
            f"{name}: expected an embstore.init initializer, got {type(value).__name__}"
        )
    return value


def _optimizer_of(name: str, params: dict[str, float]) -> Optimizer:
    cls: type[Optimizer] = getattr(optim, name)
    return cls(**params)


def _initializer_of(name: str, params: dict[str, float]) -> Initializer:
    cls: type[Initializer] = getattr(init, name)
    return cls(**params)


def _admission_of(name: str, params: dict[str, float]) -> Admission | None:
    if name == "always":
        return None
    cls: type[Admission] = next(
        c for c in (policy.CountFilter, policy.ProbabilityFilter) if c._name == name
    )
    return cls(**params)


@dataclass(frozen=True)
class TableConfig:
    """Everything that builds an empty :class:`embstore.Table`, as one
    frozen value (as TorchRec's ``EmbeddingBagConfig``): ``Table(dim,
    **settings)`` builds one from its arguments, ``Table.from_config(c)``
    takes one, and ``table.table_config`` gives a table's own (its seed and
    shard count as drawn).

    Parameters
    ----------
    dim:
        Columns per row (>= 1).
    optimizer:
        An :mod:`embstore.optim` optimizer, or None for a table that is only
        read and assigned (then ``apply_gradients`` raises ValueError).
    initializer:
        An :mod:`embstore.init` initializer; default ``Uniform(-0.05, 0.05)``.
    seed:
        Seed of the initializer (0 <= seed < 2**64): a key's first row is a
        pure function of (seed, key, column). Without one, tables get the
        seeds 0, 1, 2, ... in the order the process builds them
        (:func:`embstore.manual_seed` restarts the sequence), so two tables
        do not start "user 5" and "item 5" as the same vector, and a program
        that builds its tables in the same order gets the same rows every
        run. The seed is saved in checkpoints and state dicts.
    num_shards:
        Number of shards; default four per core, a power of two.
    dtype:
        Row storage dtype: "float32", or "float16"/"bfloat16" for rows in 16
        bits (half the row memory; optimizer state and math stay float32, and
        a row is rounded to nearest even when written; lookups return float32),
        or "int8": 8-bit codes with a float32 scale and offset per row (72
        bytes at dim 64, 3.6x fewer than float32), rounded to nearest when
        assigned or created and stochastically, by a stream of (seed, key,
        step), by every optimizer step. Checkpoints keep an int8 table's
        codes, scales and offsets as they are (a load, a mapped table and a
        disk table read them without re-quantizing).
    admission:
        An :mod:`embstore.policy` filter (CountFilter, ProbabilityFilter)
        deciding which keys a gradient may give a row; None admits all.
    ttl_steps:
        ``evict()`` removes rows not touched (looked up, assigned or
        trained) for this many optimizer steps. Needs an optimizer.
    ttl_seconds:
        ``evict()`` removes rows not touched for more than this many
        seconds of wall-clock time (whole seconds: a row goes up to a second
        late, never early); at most one of ``ttl_steps`` and ``ttl_seconds``.
        Works on a table without an optimizer (a pure cache).
    capacity:
        Most rows: after every call that inserts, the lowest-scoring rows
        beyond ``capacity`` are evicted.
    capacity_bytes:
        Most bytes of rows, each row counted at its weights, optimizer
        state, 16 bytes of metadata, an 8-byte tag and 43 bytes of index
        (``stats()["row_cost"]``): the table keeps at most
        ``capacity_bytes // row_cost`` rows, evicting as ``capacity`` does
        (with both set, the lower bound holds), and fewer where what it
        holds in all (``stats()["bytes"]``: its indexes as they are, its
        own structures) would pass ``capacity_bytes``.
    eviction:
        Scores for capacity eviction: "lfu" (fewest touches go first, then
        least recent, then smallest key) or "lru" (least recent first, then
        fewest touches, then smallest key). Every occurrence of a key in a
        lookup, assign or gradient call is a touch; recency is the number of
        the last call that touched it. Touch counts and recency are kept
        per row (16 bytes) only when a TTL or a capacity is set, and survive
        save/load.
    disk:
        A directory (created if missing): with ``memory_bytes``, a disk
        table that keeps at most ``memory_bytes`` of rows in memory and the
        rest in files of its own under ``disk`` (removed when the table
        goes; a killed process's are removed by the next disk table made
        there). Every call gives what a table in memory gives; the rows
        each call needs are read from disk first, by many threads at once,
        and after it the rows touched least (``eviction``'s order) go back
        to disk. ``ttl_steps``, ``ttl_seconds`` and ``capacity`` evict rows
        wherever they are (scored by touch counts kept in memory for the
        rows on disk, 16 bytes and a map entry a row); not with
        ``capacity_bytes`` (``memory_bytes`` bounds the memory). Checkpoints
        of a disk table are plain checkpoints; ``Table.load(path,
        disk=..., memory_bytes=...)`` opens one as a disk table.
    memory_bytes:
        A disk table's memory for rows, each counted at
        ``stats()["row_cost"]`` (weights, state, 16 bytes of touch counts,
        tag and index slot); the index of the rows on disk takes about 40
        more bytes a row (``stats()["disk_index_bytes"]``).

    Each field is checked when the config is made (TypeError or ValueError
    naming it); the native table checks what depends on several (a TTL in
    steps needs an optimizer, a capacity of fewer bytes than one row).
    """

    dim: int = field(metadata={"check": lambda n, v: check_int(n, v, 1, 1 << 20)})
    _: KW_ONLY
    # Each field's metadata: "check" (called with its name and value, it
    # returns the value kept or raises naming the field) and, for a named
    # configuration, "of" (the object a core {"name", "params"} stands for).
    optimizer: Optimizer | None = field(
        default=None,
        metadata={"check": _named(Optimizer, "an embstore.optim optimizer"), "of": _optimizer_of},
    )
    initializer: Initializer = field(
        default_factory=Uniform, metadata={"check": _initializer, "of": _initializer_of}
    )
    seed: int | None = field(default=None, metadata={"check": _seed})
    num_shards: int | None = field(default=None, metadata={"check": _opt_int})
    dtype: str = field(
        default="float32", metadata={"check": lambda n, v: check_name(n, "dtypes", v)}
    )
    admission: Admission | None = field(
        default=None,
        metadata={"check": _named(Admission, "an embstore.policy filter"), "of": _admission_of},
    )
    ttl_steps: int | None = field(default=None, metadata={"check": _opt_int})
    ttl_seconds: int | None = field(default=None, metadata={"check": _opt_int})
    capacity: int | None = field(default=None, metadata={"check": _opt_int})
    capacity_bytes: int | None = field(default=None, metadata={"check": _opt_int})
    eviction: str = field(
        default="lfu", metadata={"check": lambda n, v: check_name(n, "evictions", v)}
    )
    disk: str | os.PathLike[str] | None = field(default=None, metadata={"check": _path})
    memory_bytes: int | None = field(default=None, metadata={"check": _opt_int})

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))

    def _to_core(self) -> str:
        """The JSON the native ``Table`` is built from (the core's
        ``TableConfig::from_json``): every field that is set, a named
        configuration as ``{"name", "params"}``."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, NativeConfig):
                name, params = value._native()
                value = {"name": name, "params": params}
            if value is not None:
                out[f.name] = value
        return json.dumps(out)

    @classmethod
    def _from_core(cls, text: str) -> TableConfig:
        """The inverse of :meth:`_to_core`, from the JSON a native table
        gives (``config_json()``)."""
        given = json.loads(text)
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            value = given.pop(f.name, None)
            if "of" in f.metadata and value is not None:
                value = f.metadata["of"](value["name"], value["params"])
            kwargs[f.name] = value
        if given:
            raise TypeError(f"TableConfig has no fields {sorted(given)} (a newer core?)")
        return cls(**kwargs)

    @staticmethod
    def _plain(text: str) -> dict[str, Any]:
        """A native table's config as ``Table.config()`` gives it: plain
        values, a named configuration as ``(name, {param: value})`` (None
        for admitting every key), without ``num_shards``, ``disk`` and
        ``memory_bytes`` (each copy's own)."""
        given = json.loads(text)
        out: dict[str, Any] = {}
        for f in fields(TableConfig):
            value = given.get(f.name)
            if "of" in f.metadata and value is not None:
                value = None if value["name"] == "always" else (value["name"], value["params"])
            out[f.name] = value
        # Where and how a table keeps its rows is each copy's own (ranks of
        # a ShardedTable may spill to different disks).
        for own in ("num_shards", "disk", "memory_bytes"):
            del out[own]
        return out


class TableSettings(TypedDict, total=False):
    """The keyword arguments of ``Table(dim, **settings)``: every
    :class:`TableConfig` field but ``dim`` (a test keeps the two equal)."""

    optimizer: Optimizer | None
    initializer: Initializer | None
    seed: int | None
    num_shards: int | None
    dtype: str
    admission: Admission | None
    ttl_steps: int | None
    ttl_seconds: int | None
    capacity: int | None
    capacity_bytes: int | None
    eviction: str
    disk: str | os.PathLike[str] | None
    memory_bytes: int | None
