"""TorchRec's collection modules over an :class:`embstore.Collection`:
:class:`EmbeddingBagCollection` (pooled, ``KeyedJaggedTensor`` in,
``KeyedTensor`` out) and :class:`EmbeddingCollection` (unpooled, a
``JaggedTensor`` per feature out), built from a Collection or from TorchRec
table configs (:mod:`embstore.torch.configs`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from embstore._convert import check_default, to_numpy
from embstore.collection import Collection
from embstore.optim import Optimizer
from embstore.protocol import BatchTier, ReadTier, takes_default
from embstore.torch._ops import call
from embstore.torch.configs import collection_from_configs

if TYPE_CHECKING:
    from embstore.distributed.collection import ShardedCollection
from embstore.torch.module import (
    Parts,
    _stores,
    _TableState,
    as_input,
    check_parts,
    grad_rows,
    host,
    spread,
)

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection", "JaggedTensor", "KeyedTensor"]


class KeyedTensor:
    """What :class:`EmbeddingBagCollection` returns when torchrec is not
    installed: TorchRec's ``KeyedTensor`` accessors over one ``(batch, sum of
    dims)`` tensor (``keys()``, ``values()``, ``length_per_key()``,
    ``offset_per_key()``, ``to_dict()``, ``__getitem__``)."""

    def __init__(self, keys: list[str], length_per_key: list[int], values: torch.Tensor) -> None:
        self._keys, self._lengths, self._values = list(keys), list(length_per_key), values

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return list(self._lengths)

    def offset_per_key(self) -> list[int]:
        return [0, *np.cumsum(self._lengths).tolist()]

    def to_dict(self) -> dict[str, torch.Tensor]:
        cuts = self.offset_per_key()
        return {k: self._values[:, cuts[i] : cuts[i + 1]] for i, k in enumerate(self._keys)}

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.to_dict()[key]


class JaggedTensor:
    """What :class:`EmbeddingCollection` returns per feature when torchrec is
    not installed: TorchRec's ``JaggedTensor`` accessors over the rows of a
    feature's ids (``values()`` ``(ids, dim)``, ``lengths()`` per sample,
    ``offsets()``, ``weights_or_none()``, ``to_dense()`` a tensor per
    sample, ``to_padded_dense()``)."""

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        self._values, self._lengths = values, lengths

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        zero = self._lengths.new_zeros(1)
        return torch.cat([zero, torch.cumsum(self._lengths, 0)])

    def weights_or_none(self) -> None:
        return None

    def to_dense(self) -> list[torch.Tensor]:
        return list(torch.split(self._values, self._lengths.tolist()))

    def to_padded_dense(
        self, desired_length: int | None = None, padding_value: float = 0.0
    ) -> torch.Tensor:
        """``(samples, length, dim)``: each sample's rows, cut or padded to
        ``desired_length`` (default: the longest sample's)."""
        parts = self.to_dense()
        length = desired_length if desired_length is not None else max(map(len, parts), default=0)
        out = self._values.new_full((len(parts), length, self._values.shape[1]), padding_value)
        for i, p in enumerate(parts):
            out[i, : min(length, len(p))] = p[:length]
        return out


# A call's layout travels to the ops as one string ("spec"), built here
# with joins that torch.compile traces as constants (json does not trace):
# a kind, then one record per feature, fields split by _FIELD.
_RECORD, _FIELD = "\x1f", "\x1e"


def _encode(kind: str, records: list[list[str]]) -> str:
    for record in records:
        if any(_RECORD in f or _FIELD in f for f in record):
            raise ValueError(f"features: a feature name holds a control character: {record[0]!r}")
    return _RECORD.join([kind, *(_FIELD.join(r) for r in records)])


def _decode(spec: str) -> tuple[str, list[list[str]]]:
    kind, *records = spec.split(_RECORD)
    return kind, [r.split(_FIELD) for r in records]


@functools.cache
def _output_types() -> tuple[Any, Any]:
    """TorchRec's KeyedTensor and JaggedTensor where torchrec imports, else
    this module's. Resolved when a module is built, not inside a forward
    (torch.compile cannot trace an import)."""
    try:
        from torchrec.sparse.jagged_tensor import (  # type: ignore[import-not-found, unused-ignore]
            JaggedTensor as TorchRecJaggedTensor,
        )
        from torchrec.sparse.jagged_tensor import (  # type: ignore[import-not-found, unused-ignore]
            KeyedTensor as TorchRecKeyedTensor,
        )
    except Exception:  # ImportError, or fbgemm's operators failing to load
        return KeyedTensor, JaggedTensor
    return TorchRecKeyedTensor, TorchRecJaggedTensor


class _Kjt:
    """The parts of a KeyedJaggedTensor (torchrec's, or any object with its
    accessors) as the ops take them."""

    def __init__(self, features: Any, variable: bool) -> None:
        try:
            self.names = [str(k) for k in features.keys()]  # noqa: SIM118 (a KJT, not a dict)
            values, lengths = features.values(), features.lengths()
            weights = features.weights_or_none()
        except AttributeError as e:
            raise TypeError(
                "features: expected a torchrec KeyedJaggedTensor (keys(), values(), lengths(), "
                f"weights_or_none(), stride()) or a mapping, got {type(features).__name__}"
            ) from e
        seen: set[str] = set()
        for name in self.names:
            if name in seen:
                raise ValueError(
                    f"features: feature {name!r} appears twice among the keys (each key "
                    "names one feature of the batch)"
                )
            seen.add(name)
        self.values = as_input(values, "features.values()")
        self.lengths = as_input(lengths, "features.lengths()")
        self.weights = None if weights is None else as_input(weights, "features.weights()")
        if self.lengths.dim() != 1 or self.values.dim() != 1:
            raise ValueError("features: expected 1-D values() and lengths()")
        if self.weights is not None and self.weights.shape != self.values.shape:
            raise ValueError(
                f"features: weights() holds {self.weights.shape[0]} values for "
                f"{self.values.shape[0]} ids"
            )
        per_key = getattr(features, "variable_stride_per_key", None)
        self.strides: list[int] | None = None
        if per_key is not None and per_key():
            if not variable:
                raise ValueError(
                    "features: a variable-stride KeyedJaggedTensor (a batch size per feature) "
                    "cannot be pooled into one (batch, sum of dims) tensor; give every feature "
                    "the same stride, or look it up with EmbeddingCollection"
                )
            self.strides = [int(s) for s in features.stride_per_key()]
            expected = sum(self.strides)
        else:
            stride = int(features.stride()) if len(self.names) else 0
            expected = len(self.names) * stride
        if self.lengths.shape[0] != expected:
            raise ValueError(
                f"features: expected {len(self.names)} keys x stride lengths ({expected}), got "
                f"{self.lengths.shape[0]}"
            )


def _feature_ranges(
    names: list[str], lengths: np.ndarray, strides: list[int] | None, n_values: int
) -> dict[str, tuple[int, int, int, int]]:
    """Each feature's ``(first id, end, first length, end)`` in a KJT's
    values and lengths, checked against the values held."""
    if strides is None:
        stride = lengths.shape[0] // max(len(names), 1)
        strides = [stride] * len(names)
    if (lengths < 0).any():
        first = int(np.flatnonzero(lengths < 0)[0])
        j = int(np.searchsorted(np.cumsum(strides), first, side="right"))
        raise ValueError(f"features: feature {names[j]!r} has a negative length")
    starts = np.concatenate([[0], np.cumsum(lengths)])
    if int(starts[-1]) != n_values:
        raise ValueError(
            f"features: the lengths sum to {int(starts[-1])} ids but values() holds "
            f"{n_values}; nothing looked up"
        )
    out: dict[str, tuple[int, int, int, int]] = {}
    at = 0
    for name, s in zip(names, strides, strict=True):
        out[name] = (int(starts[at]), int(starts[at + s]), at, at + s)
        at += s
    return out


def _is_sharded_collection(obj: Any) -> bool:
    """Whether ``obj`` is an ``embstore.distributed.ShardedCollection``
    (imported only when one could be: it needs no MPI to import)."""
    from embstore.distributed.collection import ShardedCollection

    return isinstance(obj, ShardedCollection)


class _CollectionModule(_TableState):
    """A module over an :class:`embstore.Collection`, given or built from
    TorchRec table configs."""

    _pooled: bool

    def __init__(
        self,
        collection: Collection | ShardedCollection | Sequence[Any] | None = None,
        *,
        tables: Sequence[Any] | None = None,
        optimizer: Optimizer | Mapping[str, Optimizer] | None = None,
        default: str = "init",
        accumulate: int = 1,
        gradient_reduction: str | None = None,
        table_options: Mapping[str, Any] | None = None,
        is_weighted: bool = False,
        device: Any = None,
    ) -> None:
        if collection is not None and tables is not None:
            raise ValueError("tables: give a collection or table configs, not both")
        if collection is not None and _is_sharded_collection(collection):
            if accumulate != 1:
                raise ValueError(
                    "accumulate: a ShardedCollection steps at every backward (its steps are "
                    f"collective); expected 1, got {accumulate!r}"
                )
        elif collection is not None and not isinstance(collection, Collection):
            if isinstance(collection, Sequence) and not isinstance(collection, (str, bytes)):
                tables, collection = collection, None
            else:
                raise TypeError(
                    "collection: expected an embstore.Collection or a ShardedCollection (or "
                    f"tables=[...] configs), got {type(collection).__name__}"
                )
        if collection is None:
            if tables is None:
                raise TypeError("collection: expected an embstore.Collection or tables=[...]")
            collection = collection_from_configs(
                tables, pooled=self._pooled, optimizer=optimizer, table_options=table_options
            )
        elif optimizer is not None or table_options is not None:
            raise ValueError(
                "optimizer: the collection's tables have theirs; optimizer and table_options "
                "go with tables=[...] configs"
            )
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(
                f"device: embstore tables live in host memory (device 'cpu'), got {device!r}; "
                "outputs follow the inputs' device"
            )
        if not isinstance(is_weighted, bool):
            raise TypeError("is_weighted: expected a bool")
        check_default(default, None)
        super().__init__(accumulate, gradient_reduction)
        # A ShardedCollection offers every call the module makes of a
        # Collection (features, dims, tables, lookup_pooled,
        # apply_pooled_gradients); typed as the one it stands in for.
        self.collection: Collection = cast(Collection, collection)
        self.default = default
        self.is_weighted = is_weighted
        self._keyed_tensor, self._jagged_tensor = _output_types()

    def _tables(self) -> dict[str, ReadTier]:
        # One entry per distinct table, named by its first feature.
        out: dict[str, ReadTier] = {}
        seen: set[int] = set()
        for name, table in self.collection.tables.items():
            if id(table) not in seen:
                seen.add(id(table))
                out[name] = table
        return out

    def extra_repr(self) -> str:
        return ", ".join(
            f"{n}: {d}" for n, d in zip(self.collection.features, self.collection.dims, strict=True)
        )


class EmbeddingBagCollection(_CollectionModule):
    """TorchRec's ``EmbeddingBagCollection`` over an :class:`embstore.Collection`
    (or ``tables=[EmbeddingBagConfig(...), ...]`` with an ``optimizer``).

    ``forward(features)`` takes a ``KeyedJaggedTensor`` (torchrec's, or any
    object with its accessors ``keys()``, ``values()``, ``lengths()``,
    ``weights_or_none()``, ``stride()``) and returns a torchrec
    ``KeyedTensor`` (this module's :class:`KeyedTensor` without torchrec) of
    the pooled features in the collection's order; features of the input
    that the collection does not serve are ignored. A variable-stride KJT
    is refused (no one batch size to pool into). ``forward`` also takes
    a mapping from each feature to its ids, ``(ids, offsets)`` or ``(ids,
    offsets, weights)`` (as :meth:`embstore.Collection.lookup_pooled`) and
    then returns the ``(batch, sum of dims)`` tensor itself.

    Backward steps each distinct table's optimizer once (a fused backward,
    as TorchRec's FBGEMM tables), or once in ``accumulate`` backwards. In
    eval mode, and under ``torch.no_grad()``, nothing is stored and a
    missing id pools as ``default`` ("init" or "zeros").
    """

    _pooled = True

    def forward(self, features: Any) -> Any:
        store = _stores(self)
        if isinstance(features, Mapping):
            inputs: list[torch.Tensor | None] = []
            layout = []
            for name, entry in features.items():
                parts = entry if isinstance(entry, tuple) else (entry,)
                if len(parts) not in (1, 2, 3):
                    raise ValueError(
                        f"batch[{name!r}]: expected ids (one per sample), (ids, offsets) or "
                        "(ids, offsets, weights)"
                    )
                inputs.extend(as_input(p, f"batch[{name!r}]") for p in parts)
                layout.append([str(name), str(len(parts)), "t" if isinstance(entry, tuple) else ""])
            missing = [f for f in self.collection.features if f not in features]
            extra = [f for f in features if f not in self.collection.tables]
            if missing or extra:
                raise ValueError(
                    f"batch: expected features {self.collection.features}; missing {missing}, "
                    f"unknown {extra}"
                )
            return call(self, inputs, store, _encode("batch", layout))
        kjt = _Kjt(features, variable=False)
        missing = [f for f in self.collection.features if f not in kjt.names]
        if missing:
            raise ValueError(f"features: missing keys {missing} (the collection serves them)")
        spec = _encode("kjt", [[n] for n in kjt.names])
        out = call(self, [kjt.values, kjt.lengths, kjt.weights], store, spec)
        return self._keyed_tensor(
            keys=self.collection.features, length_per_key=self.collection.dims, values=out
        )

    def _batch(self, inputs: list[torch.Tensor | None], spec: str) -> dict[str, Any]:
        """The call's features as a :class:`embstore.Collection` batch."""
        kind, records = _decode(spec)
        if kind == "batch":
            batch: dict[str, Any] = {}
            at = 0
            for name, n, is_tuple in records:
                parts = [host(t) for t in inputs[at : at + int(n)] if t is not None]
                at += int(n)
                batch[name] = tuple(parts) if is_tuple else parts[0]
            return batch
        names = [r[0] for r in records]
        values, lengths, weights = inputs
        assert values is not None
        assert lengths is not None
        vals, lens = host(values), host(lengths).astype(np.int64)
        w = None if weights is None else host(weights)
        ranges = _feature_ranges(names, lens, None, vals.shape[0])
        starts = np.concatenate([[0], np.cumsum(lens)])
        bags: dict[str, Any] = {}
        for name in self.collection.features:
            lo, hi, first, end = ranges[name]
            offsets = starts[first : end + 1] - lo
            ids = vals[lo:hi]
            bags[name] = (ids, offsets) if w is None else (ids, offsets, w[lo:hi])
        return bags

    def _run(self, inputs: list[torch.Tensor | None], store: bool, spec: str) -> torch.Tensor:
        batch = self._batch(inputs, spec)
        out = self.collection.lookup_pooled(
            batch, insert=store, default="init" if store else self.default
        )
        device = next(t.device for t in inputs if t is not None)
        return torch.from_numpy(out).to(device)

    def _empty(self, inputs: list[torch.Tensor | None], spec: str) -> torch.Tensor:
        kind, records = _decode(spec)
        first = next(t for t in inputs if t is not None)
        if kind == "kjt":
            lengths = inputs[1]
            assert lengths is not None
            b = lengths.shape[0] // max(len(records), 1)
        else:
            at, b = 0, 0
            for name, n, _ in records:
                if name == self.collection.features[0]:
                    part = inputs[at] if n == "1" else inputs[at + 1]
                    assert part is not None
                    b = part.shape[0] - (0 if n == "1" else 1)
                    break
                at += int(n)
        return first.new_empty((b, self.collection.dim), dtype=torch.float32)

    def _backward(self, inputs: list[torch.Tensor | None], grad: torch.Tensor, spec: str) -> None:
        batch = self._batch(inputs, spec)
        g = self._reduce(grad_rows(grad, grad.shape[0], self.collection.dim))

        def parts() -> Parts:
            ids, offsets, weights, combiners, _ = self.collection._args(batch)
            out: Parts = []
            col = 0
            for name, i, o, w, c in zip(
                self.collection.features, ids, offsets, weights, combiners, strict=True
            ):
                table = self.collection.tables[name]
                cols = np.ascontiguousarray(g[:, col : col + table.dim])
                out.append(spread(table, i, o, w, c, cols))
                col += table.dim
            return out

        self._finish(lambda: self.collection.apply_pooled_gradients(batch, g), parts)


class EmbeddingCollection(_CollectionModule):
    """TorchRec's unpooled ``EmbeddingCollection`` over an
    :class:`embstore.Collection` (or ``tables=[EmbeddingConfig(...), ...]``
    with an ``optimizer``): ``forward(features)`` returns a dict from each
    feature the collection serves to a torchrec ``JaggedTensor`` (this
    module's :class:`JaggedTensor` without torchrec) of its ids' rows,
    ``values()`` ``(ids, dim)`` with the input's ``lengths()``, for sequence
    features. ``features`` is a ``KeyedJaggedTensor`` (variable-stride ones
    too: each feature keeps its own batch size) or a mapping from each
    feature to its ids (one per sample) or ``(ids, offsets)``; weights are
    ignored (nothing is pooled). Every table has one ``dim``, as TorchRec's.

    Backward steps each distinct table once with its features' gradients
    (or once in ``accumulate`` backwards). In eval mode, and under
    ``torch.no_grad()``, nothing is stored and a missing id reads as
    ``default`` ("init" or "zeros").
    """

    _pooled = False

    def __init__(self, collection: Any = None, **kwargs: Any) -> None:
        super().__init__(collection, **kwargs)
        dims = set(self.collection.dims)
        if len(dims) != 1:
            raise ValueError(
                f"tables: an EmbeddingCollection's tables share one embedding_dim (as "
                f"TorchRec's), got {sorted(dims)}"
            )
        self.embedding_dim = dims.pop()

    def forward(self, features: Any) -> dict[str, Any]:
        if isinstance(features, Mapping):
            features = self._as_kjt(features)
        kjt = _Kjt(features, variable=True)
        missing = [f for f in self.collection.features if f not in kjt.names]
        if missing:
            raise ValueError(f"features: missing keys {missing} (the collection serves them)")
        strides = kjt.strides
        if strides is None:
            spec = _encode("kjt", [[n] for n in kjt.names])
        else:
            spec = _encode("vkjt", [[n, str(s)] for n, s in zip(kjt.names, strides, strict=True)])
        rows = call(self, [kjt.values, kjt.lengths], _stores(self), spec)
        # Each feature's rows and lengths: its share of the KJT's.
        strides = strides or [kjt.lengths.shape[0] // max(len(kjt.names), 1)] * len(kjt.names)
        lengths = torch.split(kjt.lengths, strides)
        counts = [int(x.sum()) for x in lengths]
        values = torch.split(rows, counts)
        served = set(self.collection.features)
        out = {
            name: self._jagged_tensor(values=v, lengths=ln)
            for name, v, ln in zip(kjt.names, values, lengths, strict=True)
            if name in served
        }
        return {name: out[name] for name in self.collection.features}

    def _as_kjt(self, batch: Mapping[str, Any]) -> Any:
        """A mapping batch as a KJT-like object: each feature's ids, one per
        sample or ``(ids, offsets)`` with a last offset."""
        names, values, lengths = [], [], []
        for name, entry in batch.items():
            if isinstance(entry, tuple):
                if len(entry) != 2:
                    raise ValueError(
                        f"batch[{name!r}]: expected ids (one per sample) or (ids, offsets)"
                    )
                ids = as_input(entry[0], f"batch[{name!r}] ids")
                off = as_input(entry[1], f"batch[{name!r}] offsets").to(torch.int64)
                if off.dim() != 1 or off.shape[0] < 1:
                    raise ValueError(
                        f"batch[{name!r}] offsets: expected 1-D offsets with a last entry"
                    )
                lens = off[1:] - off[:-1]
            else:
                ids = as_input(entry, f"batch[{name!r}] ids")
                lens = torch.ones(ids.shape[0], dtype=torch.int64)
            names.append(str(name))
            values.append(ids.reshape(-1))
            lengths.append(lens)
        strides = [x.shape[0] for x in lengths]
        return _Batch(names, torch.cat(values), torch.cat(lengths), strides)

    def _positions(
        self, inputs: list[torch.Tensor | None], spec: str
    ) -> tuple[np.ndarray, dict[int, tuple[ReadTier, np.ndarray]]]:
        """The call's ids and, per distinct table, the positions in them of
        its features' ids."""
        kind, records = _decode(spec)
        names = [r[0] for r in records]
        strides = [int(r[1]) for r in records] if kind == "vkjt" else None
        values, lengths = inputs
        assert values is not None
        assert lengths is not None
        vals, lens = host(values), host(lengths).astype(np.int64)
        ranges = _feature_ranges(names, lens, strides, vals.shape[0])
        by_table: dict[int, tuple[ReadTier, list[np.ndarray]]] = {}
        for name in self.collection.features:
            table = self.collection.tables[name]
            lo, hi, _, _ = ranges[name]
            by_table.setdefault(id(table), (table, []))[1].append(np.arange(lo, hi))
        return vals, {k: (t, np.concatenate(p)) for k, (t, p) in by_table.items()}

    def _run(self, inputs: list[torch.Tensor | None], store: bool, spec: str) -> torch.Tensor:
        vals, by_table = self._positions(inputs, spec)
        rows = np.zeros((vals.shape[0], self.embedding_dim), np.float32)
        default = "init" if store else self.default
        for table, at in by_table.values():
            kw: dict[str, Any] = {"default": default} if takes_default(table) else {}
            rows[at] = to_numpy(table.lookup(vals[at], insert=store, **kw))
        values = inputs[0]
        assert values is not None
        return torch.from_numpy(rows).to(values.device)

    def _empty(self, inputs: list[torch.Tensor | None], spec: str) -> torch.Tensor:
        values = inputs[0]
        assert values is not None
        return values.new_empty((values.shape[0], self.embedding_dim), dtype=torch.float32)

    def _backward(self, inputs: list[torch.Tensor | None], grad: torch.Tensor, spec: str) -> None:
        vals, by_table = self._positions(inputs, spec)
        g = self._reduce(grad_rows(grad, vals.shape[0], self.embedding_dim))
        calls: Parts = [(t, np.ascontiguousarray(vals[at]), g[at]) for t, at in by_table.values()]
        check_parts(calls)  # every table, before any steps

        def step() -> None:
            for table, keys, grads in calls:
                cast(BatchTier, table).apply_gradients(keys, grads)

        self._finish(step, lambda: list(calls))


class _Batch:
    """A mapping batch in a KeyedJaggedTensor's accessors."""

    def __init__(
        self, names: list[str], values: torch.Tensor, lengths: torch.Tensor, strides: list[int]
    ) -> None:
        self._names, self._values, self._lengths, self._strides = names, values, lengths, strides

    def keys(self) -> list[str]:
        return self._names

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def weights_or_none(self) -> None:
        return None

    def variable_stride_per_key(self) -> bool:
        return len(set(self._strides)) > 1

    def stride_per_key(self) -> list[int]:
        return self._strides

    def stride(self) -> int:
        return self._strides[0] if self._strides else 0
