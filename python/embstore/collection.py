"""Grouped pooled lookups: many features in one native call."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from embstore import _core, ops
from embstore._convert import (
    as_bags,
    as_keys,
    as_rows,
    check_bool,
    check_combiner,
    check_default,
    ready_i64,
    ready_rows,
    to_numpy,
)
from embstore.exceptions import ReadOnlyError
from embstore.protocol import BatchTier, ReadTier, TableFigures, observed, takes_default
from embstore.store import Table

__all__ = ["Collection"]

#: Feature name -> ``ids`` (1-D, one id per sample), ``(ids, offsets)`` or
#: ``(ids, offsets, weights)`` (CSR bags as :meth:`Table.lookup_pooled`).
Batch = Mapping[str, Any]


def feature_entry(name: str, entry: Any) -> tuple[Any, ...]:
    """One feature of a batch as ``(ids, offsets[, weights])``: plain ids
    (any 1-D array or list, not a tuple) mean one id per sample, offsets
    ``0, 1, ..., n``."""
    if not isinstance(entry, tuple):
        one = as_keys(entry, f"batch[{name!r}] ids")
        return one, np.arange(one.shape[0] + 1, dtype=np.int64)
    if len(entry) not in (2, 3):
        raise ValueError(
            f"batch[{name!r}]: expected ids (one per sample), (ids, offsets) or "
            "(ids, offsets, weights)"
        )
    return entry


class Collection:
    """Feature names mapped to tables, served together.

    Like TorchRec's EmbeddingBagCollection: one call pools every feature's
    bags and returns them side by side as ``(batch, sum of dims)`` in the
    collection's feature order. Features may share a table (e.g. "item" and
    "hist"); a shared table takes one optimizer step per
    :meth:`apply_pooled_gradients` call over all its features' gradients.

    Parameters
    ----------
    features:
        Feature name -> tier, in output order: a :class:`Table` (Tables'
        features run in one native call), or any other tier of
        :class:`embstore.protocol.ReadTier` (a DeviceCache, a ShardedTable,
        each pooled and stepped by its tier; a read-only
        :class:`MappedTable`, ``Table.load(path, mmap=True)``, for a
        collection that serves: ``lookup_pooled(insert=False)``).
    combiner:
        Default combiner of every feature ("sum", "mean" or "sqrtn").
    combiners:
        Per-feature combiners overriding the default.
    """

    def __init__(
        self,
        features: Mapping[str, ReadTier],
        *,
        combiner: str = "sum",
        combiners: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(features, Mapping) or not features:
            raise ValueError("features: expected a non-empty mapping of name -> Table")
        for name, table in features.items():
            if not isinstance(table, ReadTier):
                raise TypeError(
                    "features: expected embstore tiers (Table, MappedTable, DeviceCache, "
                    f"ShardedTable: embstore.protocol.ReadTier), got {type(table).__name__} "
                    f"for {name!r}"
                )
        combiners = dict(combiners or {})
        unknown = set(combiners) - set(features)
        if unknown:
            raise ValueError(f"combiners: names not in features: {sorted(unknown)}")
        self._features = dict(features)
        self._combiners = {n: check_combiner(combiners.get(n, combiner)) for n in self._features}
        self._combiner_list = list(self._combiners.values())
        self._names = list(self._features)
        self._dim = sum(t.dim for t in self._features.values())
        self._untrained = [n for n, t in self._features.items() if t.optimizer is None]
        self._no_weights: list[npt.NDArray[np.float32] | None] = [None] * len(self._features)
        #: The features whose tier is not a Table (pooled and stepped by
        #: their tiers, one by one, not in the Tables' one native call).
        self._apart = [n for n, t in self._features.items() if not isinstance(t, Table)]
        #: The features over tiers that store no rows and take no step.
        self._read_only = [n for n, t in self._features.items() if not t.writable]

    @property
    def features(self) -> list[str]:
        """Feature names in output order."""
        return list(self._features)

    def metrics(self) -> dict[str, TableFigures]:
        """Each table's figures for :mod:`embstore.metrics`, by feature
        (a table shared by several features under each)."""
        out: dict[str, TableFigures] = {}
        for feature, table in self.tables.items():
            for sub, figures in observed(table, f"tables[{feature!r}]").items():
                out[f"{feature}.{sub}" if sub else feature] = figures
        return out

    @property
    def tables(self) -> Mapping[str, ReadTier]:
        """Feature name -> table, read-only (a collection's features are
        fixed when it is made: assigning an entry raises TypeError instead
        of changing a copy)."""
        return types.MappingProxyType(self._features)

    @property
    def dims(self) -> list[int]:
        """Each feature's width in the output."""
        return [t.dim for t in self._features.values()]

    @property
    def dim(self) -> int:
        """Width of the output: the sum of the features' dims."""
        return self._dim

    def _args(self, batch: Batch) -> tuple[list[Any], list[Any], list[Any], list[Any], int]:
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"batch: expected a mapping of feature -> ids or (ids, offsets[, weights]), "
                f"got {type(batch).__name__}"
            )
        missing = [n for n in self._features if n not in batch]
        extra = [n for n in batch if n not in self._features]
        if missing or extra:
            raise ValueError(
                f"batch: expected features {self.features}; missing {missing}, unknown {extra}"
            )
        ids, offsets, weights = [], [], []
        size = None
        for name in self._features:
            entry = feature_entry(name, batch[name])
            i, o, w, _ = as_bags(
                entry[0],
                entry[1],
                entry[2] if len(entry) == 3 else None,
                self._combiners[name],
                prefix=f"batch[{name!r}] ",
            )
            if size is None:
                size = o.shape[0] - 1
            elif o.shape[0] - 1 != size:
                raise ValueError(
                    f"batch[{name!r}] offsets: expected batch size {size} like the "
                    f"first feature, got {o.shape[0] - 1}"
                )
            ids.append(i)
            offsets.append(o)
            weights.append(w)
        return ids, offsets, weights, self._combiner_list, size or 0

    def _split(self, batch: Batch) -> tuple[list[Any], list[Any], int] | None:
        """The ids, offsets and batch size of a batch that needs no
        conversion: a dict of exactly the features, each an ``(ids,
        offsets)`` pair of 1-D C-contiguous int64 arrays, every feature of
        one batch size. None for any other form, which :meth:`_args`
        converts and checks: a small step pays for no conversion it does not
        need, and each call still has one path."""
        if type(batch) is not dict or batch.keys() != self._features.keys():
            return None
        ids, offsets = [], []
        size = -1
        for name in self._features:  # the features' order, not the batch's
            e = batch[name]
            if not (type(e) is tuple and len(e) == 2 and ready_i64(e[0]) and ready_i64(e[1])):
                return None
            n = e[1].shape[0]
            if n == 0 or (size >= 0 and n - 1 != size):
                return None
            size = n - 1
            ids.append(e[0])
            offsets.append(e[1])
        return ids, offsets, size

    def _inners(self) -> list[Any]:
        return [cast(Table, t)._inner for t in self._features.values()]

    def lookup_pooled(
        self, batch: Batch, *, insert: bool = True, default: str = "init"
    ) -> npt.NDArray[np.float32]:
        """Pooled rows of every feature: float32 ``(batch, sum of dims)``.

        ``batch`` maps each feature name to its ids, 1-D with one id per
        sample (a plain array or list), or to ``(ids, offsets)`` or
        ``(ids, offsets, weights)`` in the CSR form of
        :meth:`Table.lookup_pooled`; every feature has the same batch size.
        ``default`` is what an id without a row pools as: "init" (the
        initializer's row) or "zeros".
        """
        mode, _ = check_default(default, None)
        flag = check_bool("insert", insert)
        if self._apart:
            return self._lookup_each(batch, flag, mode)
        split = self._split(batch)
        if split is not None:
            return _core.collection_lookup_pooled(
                self._inners(),
                split[0],
                split[1],
                self._no_weights,
                self._combiner_list,
                flag,
                self._names,
                mode,
            )
        ids, offsets, weights, combiners, _ = self._args(batch)
        return _core.collection_lookup_pooled(
            self._inners(), ids, offsets, weights, combiners, flag, self._names, mode
        )

    def _lookup_each(self, batch: Batch, insert: bool, mode: str) -> npt.NDArray[np.float32]:
        """:meth:`lookup_pooled` of a collection with tiers other than
        Tables: each feature pooled by its tier, side by side (a read-only
        tier refuses ``insert=True``)."""
        if insert and self._read_only:
            name = self._read_only[0]
            raise ReadOnlyError(
                f"lookup_pooled(insert=True): the table of feature {name!r} is read-only "
                f"(a {type(self._features[name]).__name__}); pass insert=False to serve"
            )
        ids, offsets, weights, combiners, size = self._args(batch)
        out = np.empty((size, self._dim), np.float32)
        at = 0
        for name, i, o, w, c in zip(self._features, ids, offsets, weights, combiners, strict=True):
            table = self._features[name]
            if takes_default(table):
                rows = cast(Any, table).lookup_pooled(
                    i, o, combiner=c, weights=w, insert=insert, default=mode
                )
            elif mode == "init":
                rows = table.lookup_pooled(i, o, combiner=c, weights=w, insert=insert)
            else:
                raise ValueError(
                    f"default: the table of feature {name!r} (a {type(table).__name__}) reads "
                    'a missing id as its initializer\'s row; expected default="init"'
                )
            out[:, at : at + table.dim] = to_numpy(rows)
            at += table.dim
        return out

    def _step_each(self, batch: Batch, grads: Any) -> None:
        """:meth:`apply_pooled_gradients` of a collection with tiers other
        than Tables: one step per distinct tier (its features' gradients
        spread to their ids and summed), the tiers one after another."""
        ids, offsets, weights, combiners, size = self._args(batch)
        g = as_rows(grads, size, self._dim, "grads")
        if not np.isfinite(g).all():
            raise ValueError("grads: expected only finite values")
        steps: dict[int, tuple[BatchTier, list[Any], list[Any]]] = {}
        at = 0
        for name, i, o, w, c in zip(self._features, ids, offsets, weights, combiners, strict=True):
            table = cast(BatchTier, self._features[name])
            keys, inverse = ops.unique_inverse(i)
            part = ops.spread_pooled(
                np.ascontiguousarray(g[:, at : at + table.dim]), inverse, o, keys.shape[0], w, c
            )
            entry = steps.setdefault(id(table), (table, [], []))
            entry[1].append(keys)
            entry[2].append(part)
            at += table.dim
        for tier, tier_keys, tier_grads in steps.values():
            tier.apply_gradients(np.concatenate(tier_keys), np.concatenate(tier_grads))

    def apply_pooled_gradients(self, batch: Batch, grads: Any) -> None:
        """Backward of :meth:`lookup_pooled` (``grads`` has its output's
        layout) and one optimizer step per distinct table."""
        if self._read_only:
            name = self._read_only[0]
            raise ReadOnlyError(
                f"apply_pooled_gradients: the table of feature {name!r} is read-only "
                f"(a {type(self._features[name]).__name__})"
            )
        if self._untrained:
            raise ValueError(
                f"optimizer: the table of feature {self._untrained[0]!r} has no optimizer"
            )
        if self._apart:
            self._step_each(batch, grads)
            return
        split = self._split(batch)
        if split is not None and ready_rows(grads, split[2], self._dim):
            _core.collection_apply_pooled_gradients(
                self._inners(),
                split[0],
                split[1],
                self._no_weights,
                self._combiner_list,
                grads,
                self._names,
            )
            return
        ids, offsets, weights, combiners, size = self._args(batch)
        g = as_rows(grads, size, self._dim, "grads")
        _core.collection_apply_pooled_gradients(
            self._inners(), ids, offsets, weights, combiners, g, self._names
        )

    def __repr__(self) -> str:
        return f"Collection({', '.join(f'{n}: dim {t.dim}' for n, t in self._features.items())})"
