"""DeviceCache: the hottest rows and their optimizer state in device arrays.

The owner rule (docs/ARCHITECTURE.md): a cached row is trained on the device by the
table's own optimizer formulas, and the table's copy of it is stale until the
cache writes it back (on eviction, :meth:`DeviceCache.flush` or
:meth:`DeviceCache.save`). A key is owned by exactly one tier at a time, so
training through the cache equals training on the table.

Per call, misses are fetched from the table in one native call and moved to
the device in one copy; evicted rows (with their state), and the gradients of
keys the cache cannot hold, go back to the host in one copy. The cache
reaches its table only through :class:`embstore.protocol.StateTier`; a step
number comes from the table (``take_step``), so other threads may train the
table at the same time.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import array_api_compat
import numpy as np

from embstore import _convert, _core
from embstore._convert import to_host
from embstore.gpu import _optim
from embstore.gpu import _xp as X
from embstore.protocol import StateTier

Array = Any

# The most a key's summed gradient may reach (the table's MAX_GRAD_SUM).
_MAX_GRAD_SUM = 1e18


@dataclass
class _Resolved:
    """Where a call's distinct keys are, after admissions."""

    uniq: Array  # the call's distinct keys, ascending
    inv: Array  # position in ``uniq`` of each key of the call
    slot: Array  # cache slot of each distinct key; -1: served by the table
    served_pos: Array  # positions in ``uniq`` of the table-served keys
    served_keys: np.ndarray  # those keys, on the host
    evicted_keys: np.ndarray  # keys evicted for the admissions (already written back)
    served_rows: Array | None = None  # rows of the table-served keys (lookups)


#: Every DeviceCache alive, for the fork handlers below.
_LIVE: weakref.WeakSet[DeviceCache] = weakref.WeakSet()
#: The locks the forking thread holds from before the fork until after it.
_HELD: list[threading.Lock] = []


def _before_fork() -> None:
    """Waits until no DeviceCache call is running, and holds every cache's
    lock across the fork: a child forked while another thread was inside a
    call would otherwise inherit that lock held, by a thread that does not
    exist there, and its first call would wait forever (the native tier
    does the same for its own calls). Taken in one order (by id)."""
    for cache in sorted(list(_LIVE), key=id):
        cache._lock.acquire()
        _HELD.append(cache._lock)


def _after_fork() -> None:
    while _HELD:
        _HELD.pop().release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork
    )


class DeviceCache:
    """A cache of ``rows`` rows of ``table`` (and their optimizer state) on a device.

    Parameters
    ----------
    table:
        The tier behind the cache (a :class:`embstore.protocol.StateTier`:
        an :class:`embstore.Table`), without ``ttl_steps`` or ``capacity``
        (it must not drop rows the cache owns). The cache reaches it only
        through that protocol. Its admission
        filter keeps its meaning: the cache only takes keys the table has
        admitted, and the table trains (and counts) the others.
    rows:
        Rows the cache holds (>= 1).
    xp:
        The array namespace of the device arrays (``cupy``, ``numpy``,
        ``array_api_strict``, ``torch``...); default CuPy when a GPU is
        usable, else NumPy.
    policy:
        Which cached row makes room for a new one: "lfu" (fewest accesses,
        then least recent) or "lru" (least recent, then fewest accesses).
        Every occurrence of a key in a call is an access, as in the Table.
    admit_after:
        A missing key enters the cache once it has been seen in this many
        calls; before that it is served and trained by the table.

    The batch protocol is the Table's (lookup, lookup_pooled, apply_gradients,
    apply_pooled_gradients, contains, stats), taking ``xp`` or NumPy arrays and
    returning ``xp`` arrays. Calls are serialized by a lock.
    """

    def __init__(
        self,
        table: StateTier,
        rows: int,
        *,
        xp: ModuleType | None = None,
        policy: str = "lfu",
        admit_after: int = 1,
    ) -> None:
        if not isinstance(table, StateTier):
            raise TypeError(
                "table: expected a tier with rows and optimizer state (an embstore.Table), "
                f"got {type(table).__name__}"
            )
        if table.ttl_steps is not None or table.capacity is not None:
            raise ValueError(
                "table: expected a table without ttl_steps or capacity (the table "
                "must not drop rows the cache owns)"
            )
        for name, value in (("rows", rows), ("admit_after", admit_after)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name}: expected {name} >= 1, got {value}")
        _convert.check_name("policy", "evictions", policy)
        self.table = table
        self.xp = X.namespace(xp)
        self.policy = policy
        self.admit_after = int(admit_after)
        self.capacity = int(rows)
        self._fancy = X.supports_fancy_setitem(self.xp)
        self._lock = threading.Lock()
        self._dtype = str(table.dtype)
        _LIVE.add(self)
        xp_ = self.xp
        m, dim, sl = self.capacity, table.dim, table.state_len
        self._rows = xp_.zeros((m, dim), dtype=xp_.float32)
        self._state = xp_.zeros((m, sl), dtype=xp_.float32)
        self._count = xp_.zeros((m,), dtype=xp_.int64)
        self._last = xp_.zeros((m,), dtype=xp_.int64)
        self._used = xp_.zeros((m,), dtype=xp_.bool)
        self._key = xp_.zeros((m,), dtype=xp_.int64)
        # Sorted keys of the cached rows and their slots (the index).
        self._idx_keys = xp_.zeros((0,), dtype=xp_.int64)
        self._idx_slots = xp_.zeros((0,), dtype=xp_.int64)
        # Calls seen so far of keys not yet admitted (admit_after > 1).
        self._pend_keys = xp_.zeros((0,), dtype=xp_.int64)
        self._pend_counts = xp_.zeros((0,), dtype=xp_.int64)
        self._tick = 0
        self._stats = dict.fromkeys(
            [
                "lookups",
                "hits",
                "misses",
                "admissions",
                "evictions",
                "write_backs",
                "h2d_copies",
                "h2d_bytes",
                "d2h_copies",
                "d2h_bytes",
                "index_bytes",
                "table_updates",
            ],
            0,
        )

    # -- the tier's figures (the protocol's properties) ----------------------------

    @property
    def dim(self) -> int:
        """Columns per row."""
        return self.table.dim

    @property
    def step(self) -> int:
        """Optimizer steps taken (the table's counter)."""
        return self.table.step

    @property
    def optimizer(self) -> Any:
        """The table's optimizer."""
        return self.table.optimizer

    def config(self) -> dict[str, Any]:
        """The table's configuration and the cache's (rows, policy, admit_after)."""
        return {
            **self.table.config(),
            "cache": {
                "rows": self.capacity,
                "policy": self.policy,
                "admit_after": self.admit_after,
            },
        }

    def _require_optimizer(self) -> None:
        if self.table.optimizer is None:
            raise ValueError(
                "optimizer: the cache's table was built with optimizer=None; "
                "pass an optimizer to train it"
            )

    # -- input ------------------------------------------------------------------

    def _host(self, a: Any, arg: str) -> np.ndarray:
        """A NumPy view of an input that is NumPy, a list, or an ``xp`` array."""
        if isinstance(a, (np.ndarray, list, tuple, np.generic, int, float)):
            return np.asarray(a)
        try:
            ns = array_api_compat.array_namespace(a)
        except TypeError:
            raise TypeError(
                f"{arg}: expected an array of the cache's namespace or NumPy, "
                f"got {type(a).__name__}"
            ) from None
        if ns is not self.xp and not X.is_numpy(ns):
            raise TypeError(
                f"{arg}: expected an array of the cache's namespace ({self.xp.__name__}) "
                f"or NumPy, got one of {ns.__name__}"
            )
        return to_host(self.xp, a)

    def _keys(self, keys: Any, arg: str = "keys") -> tuple[np.ndarray, Array]:
        k = _convert.as_keys(self._host(keys, arg), arg)
        return k, self.xp.asarray(k)

    def _rows_in(self, a: Any, n: int, arg: str) -> Array:
        g = _convert.as_rows(self._host(a, arg), n, self.table.dim, arg)
        if not np.isfinite(g).all():
            bad = int(np.flatnonzero(~np.isfinite(g.ravel()))[0])
            raise ValueError(
                f"{arg}: expected finite values, got a non-finite one at flat index {bad}"
            )
        return self.xp.asarray(g)

    # -- transfers ----------------------------------------------------------------

    def _h2d(self, a: np.ndarray) -> Array:
        self._stats["h2d_copies"] += 1
        self._stats["h2d_bytes"] += int(a.nbytes)
        return X.to_device(self.xp, a)

    def _d2h(self, a: Array) -> np.ndarray:
        out = to_host(self.xp, a)
        self._stats["d2h_copies"] += 1
        self._stats["d2h_bytes"] += int(out.nbytes)
        return out

    # -- the index ---------------------------------------------------------------

    def _find(self, uniq: Array) -> Array:
        """Slot of each key of ``uniq`` (sorted, distinct), -1 if not cached."""
        xp = self.xp
        n = int(self._idx_keys.shape[0])
        if n == 0:
            return xp.full(uniq.shape, -1, dtype=xp.int64)
        pos = xp.minimum(xp.searchsorted(self._idx_keys, uniq), n - 1)
        hit = xp.take(self._idx_keys, pos) == uniq
        return xp.where(hit, xp.take(self._idx_slots, pos), -1)

    def _reindex(self) -> None:
        xp = self.xp
        slots = xp.nonzero(self._used)[0]
        keys = xp.take(self._key, slots)
        order = xp.argsort(keys)
        self._idx_keys = xp.take(keys, order)
        self._idx_slots = xp.astype(xp.take(slots, order), xp.int64)

    def _admit_filter(self, miss: Array) -> Array:
        """Which of the missing keys ``miss`` (sorted, distinct) may enter now."""
        xp = self.xp
        if self.admit_after == 1 or int(miss.shape[0]) == 0:
            return xp.ones(miss.shape, dtype=xp.bool)
        n = int(self._pend_keys.shape[0])
        seen = xp.zeros(miss.shape, dtype=xp.int64)
        if n:
            pos = xp.minimum(xp.searchsorted(self._pend_keys, miss), n - 1)
            hit = xp.take(self._pend_keys, pos) == miss
            seen = xp.where(hit, xp.take(self._pend_counts, pos), 0)
        seen = seen + 1
        ok = seen >= self.admit_after
        # Keep the counts of the keys still waiting (at most 8 x rows of them).
        keep_old = xp.ones((n,), dtype=xp.bool)
        if n:
            idx = xp.minimum(xp.searchsorted(miss, self._pend_keys), int(miss.shape[0]) - 1)
            keep_old = xp.take(miss, idx) != self._pend_keys
        keys = xp.concat([self._pend_keys[keep_old], miss[~ok]])
        counts = xp.concat([self._pend_counts[keep_old], seen[~ok]])
        limit = 8 * self.capacity
        if int(keys.shape[0]) > limit:
            top = xp.argsort(-counts, stable=True)[:limit]
            keys, counts = xp.take(keys, top), xp.take(counts, top)
        order = xp.argsort(keys)
        self._pend_keys, self._pend_counts = xp.take(keys, order), xp.take(counts, order)
        return ok

    # -- the core of every call -----------------------------------------------------

    def _resolve(self, keys_d: Array, admit: bool, lookup: bool) -> _Resolved:
        """Brings the call's keys into the cache as far as it can.

        ``admit``: misses may enter the cache (and the table creates rows
        for missing keys); ``lookup``: the caller needs the rows of the keys
        the table serves, and the call counts as lookups in the stats.
        Evicted rows go back to the table (with their state) before their
        slots take the admitted rows, so nothing is lost if the call fails.
        """
        xp = self.xp
        self._tick += 1
        # unique_inverse, and counts from the sorted keys (unique_all is not
        # available on every backend, torch's among them).
        u = xp.unique_inverse(keys_d)
        uniq, inv = u.values, xp.reshape(u.inverse_indices, (-1,))
        ks = xp.sort(keys_d)
        counts = xp.searchsorted(ks, uniq, side="right") - xp.searchsorted(ks, uniq, side="left")
        slot = self._find(uniq)
        hit = slot >= 0
        if lookup:
            # A missing key misses once; its further occurrences in the call
            # find it in place (as one access after another would).
            n = int(keys_d.shape[0])
            misses = int(uniq.shape[0]) - int(xp.sum(xp.astype(hit, xp.int64)))
            self._stats["lookups"] += n
            self._stats["hits"] += n - misses
            self._stats["misses"] += misses

        none = xp.zeros((0,), dtype=xp.int64)
        adm_pos, new_slots, evicted = none, none, none
        miss_pos = xp.nonzero(~hit)[0]
        if admit and int(miss_pos.shape[0]):
            adm_pos, new_slots, evicted = self._plan_admissions(uniq, slot, hit, miss_pos)
        served_pos = miss_pos
        if int(adm_pos.shape[0]):
            is_adm = X.scatter_values(
                xp, self._fancy, xp.zeros(hit.shape, dtype=xp.bool), adm_pos, True
            )
            served_pos = xp.nonzero(~hit & ~is_adm)[0]
        res = _Resolved(
            uniq=uniq,
            inv=inv,
            slot=slot,
            served_pos=served_pos,
            served_keys=self._index_to_host(xp.take(uniq, served_pos)),
            evicted_keys=self._index_to_host(xp.take(self._key, evicted)),
        )
        if int(evicted.shape[0]):
            # Rows and state of the evicted slots go back to the table before
            # anything else changes: a call that fails after this point has
            # lost nothing (the table holds them; the slots still do too).
            self._write_back(
                res.evicted_keys,
                xp.concat(
                    [xp.take(self._rows, evicted, axis=0), xp.take(self._state, evicted, axis=0)],
                    axis=1,
                ),
            )

        # One native fetch and one host-to-device copy for every miss.
        n_adm = int(adm_pos.shape[0])
        want = lookup and int(served_pos.shape[0]) > 0
        adm_keys = self._index_to_host(xp.take(uniq, adm_pos))
        fetch = np.concatenate([adm_keys, res.served_keys]) if want else adm_keys
        if fetch.size:
            if admit:
                rows_h, state_h = self.table.lookup_with_state(fetch, insert=True)
                dev = self._h2d(np.concatenate([rows_h, state_h], axis=1))
            else:
                dev = self._h2d(np.asarray(self.table.lookup(fetch, insert=False)))
            dim = self.table.dim
            if n_adm:
                self._install(new_slots, xp.take(uniq, adm_pos), dev[:n_adm, :])
                res.slot = X.scatter_values(xp, self._fancy, res.slot, adm_pos, new_slots)
                self._stats["admissions"] += n_adm
                self._stats["evictions"] += int(evicted.shape[0])
            if want:
                res.served_rows = dev[n_adm:, :dim]

        # Accesses: every occurrence counts, as in the Table.
        cached = xp.nonzero(res.slot >= 0)[0]
        if int(cached.shape[0]):
            cs = xp.take(res.slot, cached)
            counts_now = xp.take(self._count, cs) + xp.take(counts, cached)
            self._count = X.scatter_values(xp, self._fancy, self._count, cs, counts_now)
            self._last = X.scatter_values(xp, self._fancy, self._last, cs, self._tick)
        return res

    def _plan_admissions(
        self, uniq: Array, slot: Array, hit: Array, miss_pos: Array
    ) -> tuple[Array, Array, Array]:
        """Which misses enter (their uniq positions), the slots they get (free
        ones first), and the slots evicted for them: the lowest-scoring cached
        rows that this call does not use."""
        xp = self.xp
        miss_keys = xp.take(uniq, miss_pos)
        ok = self._admit_filter(miss_keys)
        if self.table.admission is not None:
            # Only keys the table's filter has admitted (they have a row).
            held = np.asarray(self.table.contains(self._index_to_host(miss_keys)))
            ok = ok & xp.asarray(held)
        cand = xp.take(miss_pos, xp.nonzero(ok)[0])
        free = xp.astype(xp.nonzero(~self._used)[0], xp.int64)
        hit_slots = xp.take(slot, xp.nonzero(hit)[0])
        in_call = X.scatter_values(
            xp, self._fancy, xp.zeros((self.capacity,), dtype=xp.bool), hit_slots, True
        )
        evictable = self._used & ~in_call
        n_free = int(free.shape[0])
        room = n_free + int(xp.sum(xp.astype(evictable, xp.int64)))
        take = min(int(cand.shape[0]), room)
        n_vict = max(0, take - n_free)
        evicted = xp.zeros((0,), dtype=xp.int64)
        if n_vict:
            # Lexicographic (primary, secondary) order by two stable sorts;
            # rows this call uses sort last.
            big = xp.asarray(np.iinfo(np.int64).max, dtype=xp.int64)
            first, second = (
                (self._count, self._last) if self.policy == "lfu" else (self._last, self._count)
            )
            order = xp.argsort(xp.where(evictable, second, big), stable=True)
            by_first = xp.argsort(xp.take(xp.where(evictable, first, big), order), stable=True)
            evicted = xp.astype(xp.take(order, by_first)[:n_vict], xp.int64)
        return cand[:take], xp.concat([free[: take - n_vict], evicted]), evicted

    def _install(self, slots: Array, keys: Array, packed: Array) -> None:
        """Puts fetched rows+state (``packed``) of ``keys`` into ``slots``."""
        xp, fancy, dim = self.xp, self._fancy, self.table.dim
        self._rows = X.scatter_rows(xp, fancy, self._rows, slots, packed[:, :dim])
        self._state = X.scatter_rows(xp, fancy, self._state, slots, packed[:, dim:])
        self._key = X.scatter_values(xp, fancy, self._key, slots, keys)
        self._used = X.scatter_values(xp, fancy, self._used, slots, True)
        self._count = X.scatter_values(xp, fancy, self._count, slots, 0)
        self._reindex()

    def _index_to_host(self, keys: Array) -> np.ndarray:
        """Keys the table must see (misses, evictions) on the host: index
        traffic, counted apart from the row copies."""
        out = to_host(self.xp, keys)
        self._stats["index_bytes"] += int(out.nbytes)
        return np.ascontiguousarray(out, dtype=np.int64)

    def _write_back(self, keys: np.ndarray, packed: Array) -> None:
        """Writes cached rows+state ``packed`` of ``keys`` back to the table,
        in one device-to-host copy."""
        dim = self.table.dim
        block = self._d2h(packed)
        self.table.write_back(
            keys,
            np.ascontiguousarray(block[:, :dim]),
            np.ascontiguousarray(block[:, dim:]),
        )
        self._stats["write_backs"] += len(keys)

    # -- batch protocol --------------------------------------------------------------

    def lookup(self, keys: Any, *, insert: bool = True) -> Array:
        """Rows of ``keys (n,)``: ``xp`` float32 ``(n, dim)``. Misses are fetched
        from the table and (``insert=True``) enter the cache; ``insert=False``
        serves them from the table without storing anything."""
        _, keys_d = self._keys(keys)
        with self._lock:
            rows_u = self._gather(keys_d, _convert.check_bool("insert", insert))
            return self.xp.take(rows_u[0], rows_u[1], axis=0)

    def _gather(self, keys_d: Array, insert: bool) -> tuple[Array, Array]:
        """Rows of the call's distinct keys and the inverse map."""
        xp = self.xp
        r = self._resolve(keys_d, admit=insert, lookup=True)
        rows_u = xp.take(self._rows, xp.maximum(r.slot, 0), axis=0)
        if r.served_rows is not None:
            rows_u = X.scatter_rows(xp, self._fancy, rows_u, r.served_pos, r.served_rows)
        return rows_u, r.inv

    def contains(self, keys: Any) -> Array:
        """Whether each key has a row (in the cache or in the table): ``xp`` bool."""
        keys_h, keys_d = self._keys(keys)
        with self._lock:
            xp = self.xp
            u = xp.unique_inverse(keys_d)
            cached = xp.take(self._find(u.values) >= 0, xp.reshape(u.inverse_indices, (-1,)))
            return cached | xp.asarray(np.asarray(self.table.contains(keys_h)))

    def apply_gradients(self, keys: Any, grads: Any) -> None:
        """One optimizer step (duplicates summed), on the device for the keys
        the cache holds and in the table for the others."""
        self._require_optimizer()
        keys_h, keys_d = self._keys(keys)
        g = self._rows_in(grads, keys_h.shape[0], "grads")
        with self._lock:
            self._apply(keys_d, g)

    def _apply(self, keys_d: Array, g: Array) -> None:
        """One step: gradients ``g`` (one row per key of ``keys_d``, finite).
        Everything that can refuse the call is checked before a row
        changes; the step number comes from the table, so that the table
        counts one step per call whatever other threads do with it."""
        xp = self.xp
        opt = self.table.optimizer
        assert opt is not None
        n = int(keys_d.shape[0])
        if n and float(xp.max(xp.abs(g))) * n > _MAX_GRAD_SUM:
            # As the table: no key's summed gradient beyond 1e18.
            u = xp.unique_inverse(keys_d)
            ng = int(u.values.shape[0])
            inv = xp.reshape(u.inverse_indices, (-1,))
            bound = X.segment_sum(xp, inv, xp.max(xp.abs(g), axis=1, keepdims=True), ng)
            if float(xp.max(bound)) > _MAX_GRAD_SUM:
                raise ValueError(
                    "grads: the gradients of a key sum to more than 1e18 in magnitude (the "
                    "optimizer state would overflow float32); nothing changed"
                )
        r = self._resolve(keys_d, admit=True, lookup=False)
        slot, served_pos = r.slot, r.served_pos
        # Summed as the table sums them (float32, batch order): bit for bit.
        gsum = X.segment_sum_in_order(xp, r.inv, g, int(r.uniq.shape[0]))
        cached = xp.nonzero(slot >= 0)[0]
        cs = xp.take(slot, cached)

        def device_step(t: int) -> tuple[Array, Array]:
            # (On NumPy an overflow warns; it is refused just below.)
            with np.errstate(over="ignore", invalid="ignore"):
                w, st = _optim.step(
                    xp,
                    opt,
                    xp.take(self._rows, cs, axis=0),
                    xp.take(self._state, cs, axis=0),
                    xp.take(gsum, cached, axis=0),
                    t,
                )
                # A 16-bit table saturates and rounds its rows after each
                # step; the cache keeps exactly what the table would hold.
                w = X.round_to_format(xp, w, self._dtype)
            if not (bool(xp.all(xp.isfinite(w))) and bool(xp.all(xp.isfinite(st)))):
                raise ValueError(
                    "grads: this step would make a cached row non-finite; nothing changed"
                )
            return w, st

        has_cached = int(cached.shape[0]) > 0
        guess = self.table.step + 1
        new = device_step(guess) if has_cached else None
        t = self.table.take_step()
        if has_cached:
            if t != guess:  # another thread stepped the table meanwhile
                new = device_step(t)
            assert new is not None
            self._rows = X.scatter_rows(xp, self._fancy, self._rows, cs, new[0])
            self._state = X.scatter_rows(xp, self._fancy, self._state, cs, new[1])
        if int(served_pos.shape[0]):
            host = np.ascontiguousarray(self._d2h(xp.take(gsum, served_pos, axis=0)))
            self.table.apply_gradients(r.served_keys, host, step=t)
            self._stats["table_updates"] += int(host.shape[0])

    def lookup_pooled(
        self,
        ids: Any,
        offsets: Any,
        *,
        combiner: str = "sum",
        weights: Any = None,
        insert: bool = True,
    ) -> Array:
        """Pooled rows of CSR bags, as :meth:`embstore.Table.lookup_pooled`: ``xp`` (batch, dim)."""
        ids_d, bag_of, coef, batch = self._bags(ids, offsets, weights, combiner)
        with self._lock:
            xp = self.xp
            rows_u, inv = self._gather(ids_d, _convert.check_bool("insert", insert))
            x = xp.take(rows_u, inv, axis=0)
            out = X.segment_sum(xp, bag_of, xp.reshape(coef, (-1, 1)) * x, batch)
            if not bool(xp.all(xp.isfinite(out))):
                raise ValueError("weights: pooling with these weights overflows float32")
            return out

    def apply_pooled_gradients(
        self,
        ids: Any,
        offsets: Any,
        grads: Any,
        *,
        combiner: str = "sum",
        weights: Any = None,
    ) -> None:
        """Backward of :meth:`lookup_pooled` and one optimizer step."""
        self._require_optimizer()
        ids_d, bag_of, coef, batch = self._bags(ids, offsets, weights, combiner)
        g = self._rows_in(grads, batch, "grads")
        with self._lock:
            xp = self.xp
            c = xp.reshape(coef, (-1, 1))
            per_id = c * xp.take(g, bag_of, axis=0)
            # The table adds a scaled gradient to a zero sum (0 + c * g), so a
            # -0.0 there is +0.0: the same here, bit for bit.
            per_id = xp.where(c != 1.0, per_id + xp.zeros((1, 1), dtype=xp.float32), per_id)
            if not bool(xp.all(xp.isfinite(per_id))):
                raise ValueError(
                    "weights: these weights times grads overflow float32; nothing changed"
                )
            self._apply(ids_d, per_id)

    def _bags(
        self, ids: Any, offsets: Any, weights: Any, combiner: str
    ) -> tuple[Array, Array, Array, int]:
        """Checked CSR input; each id's bag and coefficient on the device."""
        xp = self.xp
        i, o, w, c = _convert.as_bags(
            self._host(ids, "ids"),
            self._host(offsets, "offsets"),
            None if weights is None else self._host(weights, "weights"),
            combiner,
        )
        # Each id's bag and coefficient w_i / d_bag: the core's own (checked
        # there), so the cache pools with the table's coefficients exactly.
        bag_of_h, coef_h = _core.bag_coefficients(i, o, w, c)
        batch = max(0, int(o.shape[0]) - 1)
        ids_d, bag_of, coef = xp.asarray(i), xp.asarray(bag_of_h), xp.asarray(coef_h)
        return ids_d, bag_of, coef, batch

    # -- write-back and checkpoints -----------------------------------------------------

    def flush(self) -> None:
        """Write every cached row and its optimizer state back to the table (one
        device-to-host copy); the rows stay cached."""
        with self._lock:
            xp = self.xp
            slots = xp.nonzero(self._used)[0]
            if int(slots.shape[0]):
                keys = to_host(xp, xp.take(self._key, slots))
                packed = xp.concat(
                    [xp.take(self._rows, slots, axis=0), xp.take(self._state, slots, axis=0)],
                    axis=1,
                )
                self._write_back(keys, packed)

    def save(self, path: str | os.PathLike[str], **kwargs: Any) -> dict[str, Any]:
        """:meth:`flush`, then the table's :meth:`embstore.Table.save`."""
        self.flush()
        manifest: dict[str, Any] = self.table.save(path, **kwargs)
        return manifest

    def save_part(
        self, path: str | os.PathLike[str], part: str, *, with_optimizer: bool = True
    ) -> str:
        """:meth:`flush`, then the table's :meth:`embstore.Table.save_part`."""
        self.flush()
        return self.table.save_part(path, part, with_optimizer=with_optimizer)

    def new_checkpoint_id(self) -> str:
        """The table's :meth:`embstore.Table.new_checkpoint_id`."""
        return self.table.new_checkpoint_id()

    def remove_part(self, path: str | os.PathLike[str], part: str) -> None:
        """The table's :meth:`embstore.Table.remove_part`."""
        self.table.remove_part(path, part)

    def publish_parts(
        self,
        path: str | os.PathLike[str],
        checkpoint_id: str,
        parts: list[str],
        rows: int,
        *,
        with_optimizer: bool = True,
    ) -> dict[str, Any]:
        """The table's :meth:`embstore.Table.publish_parts`."""
        manifest: dict[str, Any] = self.table.publish_parts(
            path, checkpoint_id, parts, rows, with_optimizer=with_optimizer
        )
        return manifest

    def evict(self, *, with_rows: bool = False) -> Any:
        """The table under a cache has no TTL or capacity: nothing to evict
        (empty keys, and rows with ``with_rows``), as the table would return."""
        return self.table.evict(with_rows=with_rows)

    def stats(self) -> dict[str, Any]:
        """hits, misses and hit_rate (per id of lookup calls; a key missing at
        the start of a call is one miss, its other occurrences hits), admissions,
        evictions, write_backs (rows), h2d/d2h copies and bytes of rows and
        state, index_bytes (keys moved to the host for the table),
        table_updates (rows the cache could not hold, trained in the table),
        rows_cached, capacity, xp (the array namespace the cache runs on);
        and as every tier's stats, ``rows`` (the table's) and ``bytes`` (the
        table's and the cache's arrays), with the table's own under
        ``table``."""
        with self._lock:
            s: dict[str, Any] = dict(self._stats)
            s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
            s["rows_cached"] = int(self._idx_keys.shape[0])
            table = self.table.stats()
            s["table"] = table
            s["rows"] = table["rows"]
            # Rows and state (float32), count, last and key (int64), used (bool).
            per_slot = 4 * (self.table.dim + self.table.state_len) + 3 * 8 + 1
            s["bytes"] = table["bytes"] + self.capacity * per_slot
            s["capacity"] = self.capacity
            s["policy"] = self.policy
            s["step"] = self.table.step
            s["xp"] = self.xp.__name__
            return s

    def __len__(self) -> int:
        """Rows this tier holds: the table's (a cached row is one of them);
        ``stats()["rows_cached"]`` counts the cached ones."""
        return len(self.table)

    def __repr__(self) -> str:
        return (
            f"DeviceCache(rows={self.capacity}, cached={int(self._idx_keys.shape[0])}, "
            f"xp={self.xp.__name__}, "
            f"policy={self.policy!r}, table={self.table!r})"
        )
