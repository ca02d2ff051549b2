"""Grouped pooled features over sharded tables (:class:`ShardedCollection`):
each distinct table makes one exchange per call."""

from __future__ import annotations

import time
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

from embstore import ops
from embstore._convert import (
    as_bags,
    as_rows,
    check_bool,
    check_combiner,
)
from embstore._latency import histogram
from embstore.collection import feature_entry
from embstore.distributed import ahead
from embstore.distributed.table import ShardedTable, _snapshot
from embstore.protocol import TableFigures

__all__ = ["ShardedCollection"]


class ShardedCollection:
    """Grouped pooled features over sharded tables (features may share one).

    Each distinct table makes one exchange per call (its features' ids
    deduplicated together) and, in :meth:`apply_pooled_gradients`, one
    optimizer step. Collective.
    """

    def __init__(
        self,
        features: Mapping[str, ShardedTable],
        *,
        combiner: str = "sum",
        combiners: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(features, Mapping) or not features:
            raise ValueError("features: expected a non-empty mapping of name -> ShardedTable")
        for name, t in features.items():
            if not isinstance(t, ShardedTable):
                raise TypeError(
                    f"features: expected ShardedTable values, got {type(t).__name__} for {name!r}"
                )
        combiners = dict(combiners or {})
        self._features = dict(features)
        self._combiners = {n: check_combiner(combiners.get(n, combiner)) for n in features}
        groups: dict[int, list[str]] = {}
        for name, t in self._features.items():
            groups.setdefault(id(t), []).append(name)
        self._groups = list(groups.values())
        # The last lookup's batch (copies), plan and routes: a step on the same
        # batch (the backward of that lookup) reuses them instead of
        # deduplicating and routing the ids again.
        self._last: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None = None

    @property
    def features(self) -> list[str]:
        return list(self._features)

    def metrics(self) -> dict[str, TableFigures]:
        """This rank's shard of each table, by feature, for
        :mod:`embstore.metrics` (a table shared by several features under
        the first; nothing collective runs)."""
        out: dict[str, TableFigures] = {}
        seen: set[int] = set()
        for feature, table in self._features.items():
            if id(table) not in seen:
                seen.add(id(table))
                for sub, figures in table.metrics().items():
                    out[f"{feature}.{sub}" if sub else feature] = figures
        return out

    @property
    def tables(self) -> Mapping[str, ShardedTable]:
        """Feature name -> sharded table, read-only."""
        return types.MappingProxyType(self._features)

    @property
    def dims(self) -> list[int]:
        """Each feature's width in the output."""
        return [t.dim for t in self._features.values()]

    @property
    def dim(self) -> int:
        return sum(t.dim for t in self._features.values())

    def _prep(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        if set(batch) != set(self._features):
            raise ValueError(f"batch: expected features {self.features}, got {sorted(batch)}")
        out: dict[str, Any] = {}
        size = None
        for group in self._groups:
            table = self._features[group[0]]
            parts = {}
            for name in group:
                entry = feature_entry(name, batch[name])
                w = entry[2] if len(entry) == 3 else None
                i, o, w_, c = as_bags(entry[0], entry[1], w, self._combiners[name])
                b = ops.check_bags(i, o, w_, c)
                if size is None:
                    size = b
                elif b != size:
                    raise ValueError(
                        f"batch[{name!r}] offsets: expected batch size {size}, got {b}"
                    )
                parts[name] = (i, o, w_, c)
            # One dedup per table over all its features' ids (not one per
            # feature), and one owners' check of the distinct keys.
            ids = np.concatenate([p[0] for p in parts.values()])
            uniq, inv, counts = table._plan(ids)
            cuts = np.cumsum([0] + [len(p[0]) for p in parts.values()])
            out[group[0]] = (
                uniq,
                counts,
                {n: (inv[cuts[j] : cuts[j + 1]], *parts[n][1:]) for j, n in enumerate(parts)},
            )
        out["__batch__"] = size or 0
        return out

    def _same_batch(self, batch: Mapping[str, Any]) -> bool:
        """Whether ``batch`` holds the ids, offsets and weights of the last
        lookup's (compared with copies kept then, so an array changed in
        place since does not count as the same)."""
        if self._last is None or set(batch) != set(self._features):
            return False
        kept = self._last[0]
        for name in self._features:
            entry = feature_entry(name, batch[name])
            w = entry[2] if len(entry) == 3 else None
            i, o, w_, _ = as_bags(entry[0], entry[1], w, self._combiners[name])
            ki, ko, kw = kept[name]
            if not (np.array_equal(i, ki) and np.array_equal(o, ko)):
                return False
            if (w_ is None) != (kw is None) or (w_ is not None and not np.array_equal(w_, kw)):
                return False
        return True

    def _keep(self, batch: Mapping[str, Any], prep: dict[str, Any], routes: dict[str, Any]) -> None:
        """Keeps what a step on the same batch reuses (copies of the arrays)."""
        kept: dict[str, Any] = {}
        for name in self._features:
            entry = feature_entry(name, batch[name])
            w = entry[2] if len(entry) == 3 else None
            i, o, w_, _ = as_bags(entry[0], entry[1], w, self._combiners[name])
            kept[name] = (i.copy(), o.copy(), None if w_ is None else w_.copy())
        self._last = (kept, prep, routes)

    def _any(self) -> ShardedTable:
        return next(iter(self._features.values()))

    def _ids(self) -> str:
        """The agreed ids of the tables, feature by feature (named in the
        agreement of every call: two collections over other tables differ)."""
        return ", ".join(f"{n}: table {t._id}" for n, t in self._features.items())

    def lookup_pooled_async(
        self, batch: Mapping[str, tuple[Any, ...]], *, insert: bool = True
    ) -> ahead.Pending[np.ndarray]:
        """:meth:`lookup_pooled` started ahead (see
        :meth:`ShardedTable.lookup_async`): ``.wait()`` returns the pooled
        rows; a step on the same batch after it reuses its plan as usual."""
        snap: Any = batch
        if isinstance(batch, Mapping):
            snap = {
                n: tuple(_snapshot(x) for x in v) if isinstance(v, tuple) else v
                for n, v in batch.items()
            }
        first = self._any()
        first._ahead(lambda: None)  # refuses a communicator without thread support
        return ahead.start(
            first.comm,
            "ShardedCollection.lookup_pooled",
            lambda: self.lookup_pooled(snap, insert=insert),
        )

    def lookup_pooled(
        self, batch: Mapping[str, tuple[Any, ...]], *, insert: bool = True, default: str = "init"
    ) -> np.ndarray:
        """Every feature's pooled rows side by side, ``(batch, dim)``: as
        :meth:`embstore.Collection.lookup_pooled`, a missing id reading as
        its initial row (``default="init"``, the only default a sharded
        table takes). Collective."""
        if default != "init":
            raise ValueError(
                f"default: a ShardedCollection reads a missing id as its initial row; "
                f'expected "init", got {default!r}'
            )
        t0 = time.perf_counter()
        out = self._lookup_pooled(batch, insert)
        # Each table's histogram counts the call that read it.
        took = time.perf_counter() - t0
        for t in {id(t): t for t in self._features.values()}.values():
            histogram(t).record(took)
        return out

    def _lookup_pooled(self, batch: Mapping[str, tuple[Any, ...]], insert: bool) -> np.ndarray:
        first = self._any()
        for t in {id(t): t for t in self._features.values()}.values():
            t._begin()
        ins, prep = first._prepare(
            f"ShardedCollection({self._ids()}).lookup_pooled",
            lambda: (check_bool("insert", insert), self._prep(batch)),
            lambda r: (("insert", r[0]),),
        )
        cols = self._columns()
        self._last = None
        # Every feature's pooled rows are written in place into its columns.
        out = np.empty((prep["__batch__"], self.dim), np.float32)
        routes: dict[str, Any] = {}
        with first._watch("Collection.lookup_pooled"):
            for group in self._groups:
                table = self._features[group[0]]
                uniq, counts, parts = prep[group[0]]
                rows, routes[group[0]] = table._fetch_unique(uniq, counts, ins)
                for name, (inv, o, w, c) in parts.items():
                    ops.pool_rows_into(rows, inv, o, out, cols[name][0], w, c)
        self._keep(batch, prep, routes)
        return out

    def _columns(self) -> dict[str, tuple[int, int]]:
        """Each feature's columns in the pooled output (features in order)."""
        cols: dict[str, tuple[int, int]] = {}
        c0 = 0
        for name, t in self._features.items():
            cols[name] = (c0, c0 + t.dim)
            c0 += t.dim
        return cols

    def apply_pooled_gradients(self, batch: Mapping[str, tuple[Any, ...]], grads: Any) -> None:
        first = self._any()
        for t in {id(t): t for t in self._features.values()}.values():
            t._begin()

        def prep() -> tuple[dict[str, Any], np.ndarray, bool]:
            for name, t in self._features.items():
                if t.local.optimizer is None:
                    raise ValueError(f"optimizer: the table of feature {name!r} has no optimizer")
            # The backward of the last lookup (the same batch) reuses its
            # plan: no second dedup of the ids.
            same = self._same_batch(batch)
            p = self._last[1] if same and self._last is not None else self._prep(batch)
            g = as_rows(grads, p["__batch__"], self.dim, "grads")
            if not np.isfinite(g).all():
                raise ValueError("grads: expected only finite values")
            return p, g, same

        (p, g, _), every = first._prepare_voted(
            f"ShardedCollection({self._ids()}).apply_pooled_gradients", prep, vote=lambda r: r[2]
        )
        # Where every rank steps on its last lookup's batch, the owners hold
        # the keys from that lookup: only the gradients move.
        routes = self._last[2] if every and self._last is not None else {}
        cols = self._columns()
        with first._watch("Collection.apply_pooled_gradients"):
            for group in self._groups:
                table = self._features[group[0]]
                uniq, counts, parts = p[group[0]]
                # The features of one table add their gradients into one
                # array, each read from its own columns of g (no copies).
                summed = np.zeros((len(uniq), table.dim), np.float32)
                for name, (inv, o, w, c) in parts.items():
                    ops.spread_pooled_add(g, cols[name][0], inv, o, summed, w, c)
                table._push_unique(uniq, counts, summed, routes.get(group[0]))
