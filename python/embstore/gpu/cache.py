"""DeviceCache: the hottest rows and their optimizer state in device arrays.

The owner rule (docs/ARCHITECTURE.md): a cached row is trained on the device by the
table's own optimizer formulas, and the table's copy of it is stale until the
cache writes it back (on eviction, :meth:`DeviceCache.flush` or
:meth:`DeviceCache.save`). A key is owned by exactly one tier at a time, so
training through the cache equals training on the table.

The index is a bucketed hash table on the device (:mod:`embstore.gpu.index`):
a call costs O(its keys), whatever the cache's size. Keys, gradients and rows
of the cache's namespace (or another library's, shared by DLPack) stay on the
device: hits never reach the host. Per call, what the table must see (the
keys of misses and evictions, evicted rows with their state, gradients of
keys the cache cannot hold) goes to the host in one copy, and the fetched
misses come back in one copy (pinned host buffers on CuPy).
:meth:`DeviceCache.prefetch` brings the next batch's misses in while the
current one trains. The cache reaches its table only through
:class:`embstore.protocol.StateTier`; a step number comes from the table
(``take_step``), so other threads may train the table at the same time.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Mapping
from types import ModuleType
from typing import Any, cast

import array_api_compat
import numpy as np

from embstore import _convert, _core
from embstore._convert import to_host
from embstore._latency import timed
from embstore.gpu import _optim
from embstore.gpu import _xp as X
from embstore.gpu._bags import bags_on_device
from embstore.gpu._fork import LIVE
from embstore.gpu._int8 import Int8Rows, decoded, rows_at
from embstore.gpu._resolved import WRITE_BACK_THREAD_MIN, Resolved, WriteBack
from embstore.gpu.index import BucketIndex
from embstore.protocol import StateTier, cache_metrics

Array = Any

# The most a key's summed gradient may reach (the table's MAX_GRAD_SUM).
_MAX_GRAD_SUM = 1e18


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
        admitted, and the table trains (and counts) the others. 8-bit rows (an
        embstore.Table's) are held as stored and stepped as the table would.
    rows:
        Rows the cache holds (>= 1), rounded up to whole buckets of the
        index (by fewer than ``rows / 128``; ``capacity`` says how many).
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

    Eviction is per bucket, as HierarchicalKV's: a key admitted to a full
    bucket (at most 128 slots) takes the slot of that bucket's lowest-scoring
    row that no running call uses.

    The batch protocol is the Table's (lookup, lookup_pooled, apply_gradients,
    apply_pooled_gradients, contains, stats), taking ``xp`` arrays, NumPy
    arrays, or another library's arrays on the same device (a torch CUDA
    tensor on a CuPy cache, shared by DLPack without a copy), and returning
    ``xp`` arrays (or, for another library's input, that library's).
    Calls are serialized by a lock.
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
        policies = (table.ttl_steps, table.ttl_seconds, table.capacity, table.capacity_bytes)
        if any(p is not None for p in policies):
            raise ValueError(
                "table: expected a table without ttl_steps, ttl_seconds, capacity or "
                "capacity_bytes (the table must not drop rows the cache owns)"
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
        self._fancy = X.supports_fancy_setitem(self.xp)
        self._lock = threading.Lock()
        self._dtype = str(table.dtype)
        #: 8-bit rows are held as the table stores them (see _int8).
        self._int8 = Int8Rows.of(self.xp, table)
        LIVE.add(self)
        xp_ = self.xp
        #: Key -> slot; a cached key's row and state sit at its slot.
        self._index = BucketIndex(xp_, int(rows))
        self.capacity = self._index.capacity
        m, dim, sl = self.capacity, table.dim, table.state_len
        self._width = dim if self._int8 is None else self._int8.width
        self._as_stored = {} if self._int8 is None else {"stored": True}
        self._rows = xp_.zeros((m, self._width), dtype=xp_.float32)
        self._state = xp_.zeros((m, sl), dtype=xp_.float32)
        # Calls seen so far of keys not yet admitted (admit_after > 1).
        self._pend_keys = xp_.zeros((0,), dtype=xp_.int64)
        self._pend_counts = xp_.zeros((0,), dtype=xp_.int64)
        #: Host buffers of the copies each way, reused (pinned on CuPy).
        self._staging: dict[str, np.ndarray] = {}
        #: Seconds spent in copies each way (stats' h2d_seconds, d2h_seconds).
        self._seconds = {"h2d": 0.0, "d2h": 0.0}
        # The call of the last lookup or step: a prefetch leaves its rows.
        self._last_call = 0
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
    def writable(self) -> bool:
        """Whether the cache stores rows and takes steps: True (see
        :class:`embstore.protocol.ReadTier`)."""
        return True

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

    # -- input and output -----------------------------------------------------------

    def _adopt(self, a: Any, arg: str) -> tuple[Any, ModuleType | None]:
        """An input as NumPy (host data) or an array of the cache's namespace
        (device data, not copied), and the namespace to give results back in
        (None: the cache's). Another library's array (a torch tensor on the
        cache's device) is taken by DLPack, without a copy."""
        if isinstance(a, (np.ndarray, list, tuple, np.generic, int, float)):
            return np.asarray(a), None
        try:
            ns = array_api_compat.array_namespace(a)
        except TypeError:
            raise TypeError(
                f"{arg}: expected an array (of the cache's namespace, NumPy, or one "
                f"DLPack can share), got {type(a).__name__}"
            ) from None
        if ns is self.xp:
            return a, None
        if X.is_numpy(ns):
            return np.asarray(a), None
        try:
            return self.xp.from_dlpack(a), ns
        except Exception as e:  # the library says why (device, dtype, no DLPack)
            raise TypeError(
                f"{arg}: expected an array of the cache's namespace ({self.xp.__name__}) "
                f"or one on its device that DLPack can share; this {ns.__name__} array "
                f"cannot be ({type(e).__name__}: {e})"
            ) from None

    def _keys(self, keys: Any, arg: str = "keys") -> tuple[Array, ModuleType | None]:
        """Checked keys as a 1-D int64 array of the cache's namespace."""
        a, ns = self._adopt(keys, arg)
        xp = self.xp
        if isinstance(a, np.ndarray):
            return xp.asarray(_convert.as_keys(a, arg)), ns
        dt = a.dtype
        if xp.isdtype(dt, "bool") or not xp.isdtype(dt, "integral"):
            raise TypeError(f"{arg}: expected an integer array, got dtype {dt}")
        if a.ndim != 1:
            raise ValueError(f"{arg}: expected a 1-D array, got shape {tuple(a.shape)}")
        if dt == xp.uint64 and int(a.shape[0]) and int(xp.max(a)) > np.iinfo(np.int64).max:
            raise ValueError(f"{arg}: expected keys <= 2**63-1, got a uint64 value above it")
        return (a if dt == xp.int64 else xp.astype(a, xp.int64)), ns

    def _keys_host(self, keys_d: Array) -> np.ndarray:
        """Keys the table must see, on the host (counted as index traffic)."""
        out = to_host(self.xp, keys_d)
        self._stats["index_bytes"] += int(out.nbytes)
        return np.ascontiguousarray(out, dtype=np.int64)

    def _rows_in(self, a: Any, n: int, arg: str) -> Array:
        """Checked, finite float32 rows (n, dim) of the cache's namespace."""
        h, _ = self._adopt(a, arg)
        xp, dim = self.xp, self.table.dim
        if isinstance(h, np.ndarray):
            g = _convert.as_rows(h, n, dim, arg)
            if not np.isfinite(g).all():
                bad = int(np.flatnonzero(~np.isfinite(g.ravel()))[0])
                raise ValueError(
                    f"{arg}: expected finite values, got a non-finite one at flat index {bad}"
                )
            return xp.asarray(g)
        if not xp.isdtype(h.dtype, "real floating"):
            raise TypeError(f"{arg}: expected a float array, got dtype {h.dtype}")
        if tuple(h.shape) != (n, dim):
            raise ValueError(f"{arg}: expected shape ({n}, {dim}), got {tuple(h.shape)}")
        g = h if h.dtype == xp.float32 else xp.astype(h, xp.float32)
        if not bool(xp.all(xp.isfinite(g))):
            raise ValueError(f"{arg}: expected finite values, got a non-finite one")
        return g

    @staticmethod
    def _out(a: Array, ns: ModuleType | None) -> Array:
        """A result in the namespace the input came in (by DLPack, no copy)."""
        return a if ns is None else ns.from_dlpack(a)

    # -- transfers ----------------------------------------------------------------

    def _buffer(self, way: str, nbytes: int) -> np.ndarray:
        """The host buffer of copies ``way`` ("h2d", "d2h"): at least
        ``nbytes`` bytes, grown by doubling, reused by later calls."""
        buf = self._staging.get(way)
        if buf is None or buf.nbytes < nbytes:
            size = max(nbytes, 2 * (0 if buf is None else buf.nbytes), 1 << 16)
            buf = X.host_buffer(self.xp, (size,), np.uint8)
            self._staging[way] = buf
        return buf

    def _h2d(self, a: np.ndarray) -> Array:
        t0 = time.perf_counter()
        out = X.to_device(self.xp, a)
        X.synchronize(self.xp)
        self._seconds["h2d"] += time.perf_counter() - t0
        self._stats["h2d_copies"] += 1
        self._stats["h2d_bytes"] += int(a.nbytes)
        return out

    def _d2h(self, ints: Array, floats: list[Array]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Keys ``ints`` (1-D int64) and float32 blocks to the host in one copy."""
        if int(ints.shape[0]) == 0 and not any(int(f.shape[0]) for f in floats):
            return np.zeros(0, np.int64), [np.zeros(tuple(f.shape), np.float32) for f in floats]
        t0 = time.perf_counter()
        keys, blocks = X.pack_to_host(
            self.xp, ints, floats, lambda nbytes: self._buffer("d2h", nbytes)
        )
        self._seconds["d2h"] += time.perf_counter() - t0
        self._stats["d2h_copies"] += 1
        self._stats["index_bytes"] += int(keys.nbytes)
        self._stats["d2h_bytes"] += sum(int(b.nbytes) for b in blocks)
        return keys, blocks

    # -- admissions ----------------------------------------------------------------

    def _admit_filter(self, miss: Array) -> Array:
        """Which of the missing keys ``miss`` (distinct) may enter now."""
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
            ms = xp.sort(miss)
            idx = xp.minimum(xp.searchsorted(ms, self._pend_keys), int(miss.shape[0]) - 1)
            keep_old = xp.take(ms, idx) != self._pend_keys
        keys = xp.concat([self._pend_keys[keep_old], miss[~ok]])
        counts = xp.concat([self._pend_counts[keep_old], seen[~ok]])
        limit = 8 * self.capacity
        if int(keys.shape[0]) > limit:
            top = xp.argsort(-counts, stable=True)[:limit]
            keys, counts = xp.take(keys, top), xp.take(counts, top)
        order = xp.argsort(keys)
        self._pend_keys, self._pend_counts = xp.take(keys, order), xp.take(counts, order)
        return ok

    def _plan_admissions(
        self, uniq: Array, miss_pos: Array, protect_from: int
    ) -> tuple[Array, Array, Array]:
        """Which misses enter (their positions in ``uniq``), the slots they
        get, and which of those slots held a key (evictions): empty slots of
        a key's bucket first, then its lowest-scoring rows that no running
        call uses."""
        xp = self.xp
        miss_keys = xp.take(uniq, miss_pos)
        ok = self._admit_filter(miss_keys)
        if self.table.admission is not None:
            # Only keys the table's filter has admitted (they have a row).
            held = np.asarray(self.table.contains(self._keys_host(miss_keys)))
            ok = ok & xp.asarray(held)
        cand = xp.take(miss_pos, xp.nonzero(ok)[0])
        slots, evict = self._index.plan(xp.take(uniq, cand), protect_from, self.policy)
        got = xp.nonzero(slots >= 0)[0]
        return xp.take(cand, got), xp.take(slots, got), xp.take(evict, got)

    # -- the core of every call -----------------------------------------------------

    def _resolve(
        self,
        keys_d: Array,
        admit: bool,
        lookup: bool,
        *,
        grads: Array | None = None,
        prefetch: bool = False,
        unique: tuple[Array, Array, Array] | None = None,
        found: bool = False,
    ) -> Resolved:
        """Brings the call's keys into the cache as far as it can.

        ``admit``: misses may enter the cache (and the table creates rows
        for missing keys); ``lookup``: the caller needs the rows of the keys
        the table serves, and the call counts as lookups in the stats;
        ``grads``: summed gradients of the call's distinct keys (in
        ``unique_inverse`` order), whose table-served rows come back in
        ``served_grads``; ``prefetch``: the rows of the last lookup or step
        stay (the batch that may still be training); ``unique``: the keys'
        :func:`embstore.gpu._xp.unique_counts`, if the caller has them;
        ``found`` (without ``admit``): the table also says which served keys
        it holds (``served_found``). Evicted rows go back to
        the table (with their state) before their slots take the admitted
        rows, so nothing is lost if the call fails.
        """
        xp = self.xp
        self._tick += 1
        tick = self._tick
        protect_from = self._last_call if prefetch else tick
        if not prefetch:
            self._last_call = tick
        uniq, inv, counts = unique if unique is not None else X.unique_counts(xp, keys_d)
        slot = self._index.find(uniq)
        hit = slot >= 0
        hit_pos = xp.nonzero(hit)[0]
        self._index.touch(xp.take(slot, hit_pos), xp.take(counts, hit_pos), tick)
        n_miss = int(uniq.shape[0]) - int(hit_pos.shape[0])
        if lookup:
            # A missing key misses once; its further occurrences in the call
            # find it in place (as one access after another would).
            n = int(keys_d.shape[0])
            self._stats["lookups"] += n
            self._stats["hits"] += n - n_miss
            self._stats["misses"] += n_miss

        none = xp.zeros((0,), dtype=xp.int64)
        adm_pos, new_slots, evict = none, none, xp.zeros((0,), dtype=xp.bool)
        miss_pos = xp.nonzero(~hit)[0]
        if prefetch and n_miss:
            # A prefetch fetches, it never inserts: only keys the table
            # holds come in (a key no call then looks up leaves no row).
            held = np.asarray(self.table.contains(self._keys_host(xp.take(uniq, miss_pos))))
            miss_pos = xp.take(miss_pos, xp.asarray(np.flatnonzero(held)))
            n_miss = int(miss_pos.shape[0])
        if admit and n_miss:
            adm_pos, new_slots, evict = self._plan_admissions(uniq, miss_pos, protect_from)
        served_pos = miss_pos
        n_adm = int(adm_pos.shape[0])
        if n_adm:
            is_adm = X.scatter_values(
                xp, self._fancy, xp.zeros(hit.shape, dtype=xp.bool), adm_pos, True
            )
            served_pos = xp.nonzero(~hit & ~is_adm)[0]
        evicted = xp.take(new_slots, xp.nonzero(evict)[0])
        n_ev, n_served = int(evicted.shape[0]), int(served_pos.shape[0])

        # One copy to the host: the keys the table must see, evicted rows with
        # their state, and the table-served keys' gradients.
        floats = [xp.take(self._rows, evicted, axis=0), xp.take(self._state, evicted, axis=0)]
        if grads is not None:
            floats.append(xp.take(grads, served_pos, axis=0))
        adm_keys = xp.take(uniq, adm_pos)
        ints = xp.concat([adm_keys, xp.take(uniq, served_pos), xp.take(self._index.keys, evicted)])
        keys_h, blocks = self._d2h(ints, floats)
        adm_h = keys_h[:n_adm]
        res = Resolved(
            uniq=uniq,
            inv=inv,
            slot=slot,
            served_pos=served_pos,
            served_keys=keys_h[n_adm : n_adm + n_served],
            served_grads=blocks[2] if grads is not None else None,
        )
        # Rows and state of the evicted slots go back to the table before
        # any slot changes: a call that fails before the install below has
        # lost nothing (the table holds them; the slots still do too). From
        # WRITE_BACK_THREAD_MIN rows (off by default) a write-back runs on a
        # thread of its own while the misses are fetched (native calls, the
        # GIL released; the keys of the two are disjoint: an evicted key was
        # cached, a missed one was not), waited for before the install.
        ev_keys = keys_h[n_adm + n_served :]
        writing = (
            self._write_back_started(ev_keys, blocks[0], blocks[1])
            if n_ev >= WRITE_BACK_THREAD_MIN
            else None
        )
        if n_ev and writing is None:
            self._write_back(ev_keys, blocks[0], blocks[1])
        try:
            self._fetch_misses(
                res,
                uniq,
                counts,
                (adm_pos, adm_keys, adm_h, new_slots),
                tick,
                (n_adm, n_ev),
                (lookup, admit, found),
                writing,
            )
        except BaseException:
            if writing is not None:
                writing.wait()  # the call's own error is the one raised
            raise
        if writing is not None:
            writing.join()  # its error, where no admission waited for it
        return res

    def _fetch_misses(
        self,
        res: Resolved,
        uniq: Array,
        counts: Array,
        admitted: tuple[Array, Array, np.ndarray, Array],
        tick: int,
        sizes: tuple[int, int],
        how: tuple[bool, bool, bool],
        writing: WriteBack | None,
    ) -> None:
        """:meth:`_resolve`'s second half: the misses' rows fetched from the
        table and copied in, the admitted ones (positions, keys on the
        device and the host, slots) installed after the write-back
        ``writing``, if any, has ended well. ``sizes``: admitted and
        evicted counts; ``how``: lookup, admit, found as given to it."""
        xp = self.xp
        adm_pos, adm_keys, adm_h, new_slots = admitted
        n_adm, n_ev = sizes
        lookup, admit, found = how
        n_served = len(res.served_keys)
        # One native fetch and one host-to-device copy for every miss.
        want = lookup and n_served > 0
        fetch = np.concatenate([adm_h, res.served_keys]) if want else adm_h
        if fetch.size:
            sl, nf, rw = self.table.state_len, int(fetch.shape[0]), self._width
            if admit:
                # Rows (8-bit ones as stored), then state, written by the table
                # straight into the transfer buffer; one copy of both to the device.
                buf = self._buffer("h2d", 4 * nf * (rw + sl)).view(np.float32)[: nf * (rw + sl)]
                self.table.lookup_with_state(fetch, insert=True, out=buf, **self._as_stored)
                flat = self._h2d(buf)
                rows_d = xp.reshape(flat[: nf * rw], (nf, rw))
                state_d = xp.reshape(flat[nf * rw :], (nf, sl))
            elif found:
                rows_h, res.served_found = self.table.lookup(fetch, insert=False, return_found=True)
                rows_d, state_d = self._h2d(np.asarray(rows_h)), None
            else:
                rows_d = self._h2d(np.asarray(self.table.lookup(fetch, insert=False)))
                state_d = None
            if n_adm:
                assert state_d is not None
                if writing is not None:
                    writing.join()  # raises the write-back's error: no slot changed
                self._install(
                    new_slots,
                    adm_keys,
                    xp.take(counts, adm_pos),
                    tick,
                    n_ev,
                    rows_d[:n_adm, :],
                    state_d[:n_adm, :],
                )
                res.slot = X.scatter_values(xp, self._fancy, res.slot, adm_pos, new_slots)
                self._stats["admissions"] += n_adm
                self._stats["evictions"] += n_ev
            if want:
                rest = rows_d[n_adm:, :]
                res.served_rows = decoded(self._int8, rest) if admit else rest

    def _write_back_started(
        self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray
    ) -> WriteBack:
        """:meth:`_write_back` on a thread of its own, started."""
        w = WriteBack(lambda: self._write_back(keys, rows, state))
        w.start()
        return w

    def _install(
        self,
        slots: Array,
        keys: Array,
        counts: Array,
        tick: int,
        evicted: int,
        rows: Array,
        state: Array,
    ) -> None:
        """Puts fetched ``rows`` and ``state`` of ``keys`` into ``slots``."""
        self._rows = self._index.put_rows(self._rows, slots, rows)
        if int(state.shape[1]):
            self._state = self._index.put_rows(self._state, slots, state)
        self._index.install(slots, keys, counts, tick, evicted)

    def _write_back(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """Writes cached rows and state (on the host) of ``keys`` back to the
        table."""
        cast(Any, self.table).write_back(keys, rows, state, **self._as_stored)
        self._stats["write_backs"] += len(keys)

    # -- batch protocol --------------------------------------------------------------

    @timed
    def lookup(self, keys: Any, *, insert: bool = True, return_found: bool = False) -> Any:
        """Rows of ``keys (n,)``: ``xp`` float32 ``(n, dim)``. Misses are fetched
        from the table and (``insert=True``) enter the cache; ``insert=False``
        serves them from the table without storing anything.
        ``return_found=True`` (with ``insert=False``) returns ``(rows,
        found)``, ``found`` bool ``(n,)``: cached, or held by the table (as
        :meth:`embstore.Table.lookup`'s)."""
        keys_d, ns = self._keys(keys)
        insert = _convert.check_bool("insert", insert)
        if _convert.check_bool("return_found", return_found):
            if insert:
                raise ValueError(
                    "return_found: needs insert=False (a lookup that inserts finds every key)"
                )
            with self._lock:
                xp = self.xp
                r = self._resolve(keys_d, admit=False, lookup=True, found=True)
                rows_u = rows_at(self._int8, xp, self._rows, xp.maximum(r.slot, 0))
                found_u = r.slot >= 0
                if r.served_rows is not None:
                    rows_u = X.scatter_rows(xp, self._fancy, rows_u, r.served_pos, r.served_rows)
                    held = X.to_device(xp, np.asarray(r.served_found))
                    found_u = X.scatter_values(xp, self._fancy, found_u, r.served_pos, held)
                return (
                    self._out(xp.take(rows_u, r.inv, axis=0), ns),
                    self._out(xp.take(found_u, r.inv, axis=0), ns),
                )
        with self._lock:
            rows_u, inv = self._gather(keys_d, insert)
            return self._out(self.xp.take(rows_u, inv, axis=0), ns)

    def _gather(self, keys_d: Array, insert: bool) -> tuple[Array, Array]:
        """Rows of the call's distinct keys and the inverse map."""
        xp = self.xp
        r = self._resolve(keys_d, admit=insert, lookup=True)
        rows_u = rows_at(self._int8, xp, self._rows, xp.maximum(r.slot, 0))
        if r.served_rows is not None:
            rows_u = X.scatter_rows(xp, self._fancy, rows_u, r.served_pos, r.served_rows)
        return rows_u, r.inv

    def prefetch(self, keys: Any) -> concurrent.futures.Future[None]:
        """Starts bringing the rows of ``keys`` (the next batch's) into the cache
        in the background, on a stream of its own on CuPy, while the current
        batch trains; the rows of the last lookup or step stay cached. Later
        calls wait for it (they take the cache's lock after it). Returns a
        future that holds the prefetch's error, if any: a failed prefetch
        changes nothing a later call relies on (its misses are fetched then)."""
        keys_d, _ = self._keys(keys)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        started = threading.Event()

        def run() -> None:
            try:
                with self._lock:
                    started.set()
                    with X.side_stream(self.xp):
                        self._resolve(keys_d, admit=True, lookup=False, prefetch=True)
                done.set_result(None)
            except BaseException as e:  # handed to the caller through the future
                started.set()
                done.set_exception(e)

        threading.Thread(target=run, name="embstore-prefetch", daemon=True).start()
        started.wait()  # the prefetch holds the lock: calls after this come after it
        return done

    def contains(self, keys: Any) -> Array:
        """Whether each key has a row (in the cache or in the table): ``xp`` bool."""
        keys_d, ns = self._keys(keys)
        with self._lock:
            xp = self.xp
            cached = self._index.find(keys_d) >= 0
            held = xp.asarray(np.asarray(self.table.contains(self._keys_host(keys_d))))
            return self._out(cached | held, ns)

    def apply_gradients(self, keys: Any, grads: Any) -> None:
        """One optimizer step (duplicates summed), on the device for the keys
        the cache holds and in the table for the others."""
        self._require_optimizer()
        keys_d, _ = self._keys(keys)
        g = self._rows_in(grads, int(keys_d.shape[0]), "grads")
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
        unique = X.unique_counts(xp, keys_d)
        ng, inv = int(unique[0].shape[0]), unique[1]
        if n and float(xp.max(xp.abs(g))) * n > _MAX_GRAD_SUM:
            # As the table: no key's summed gradient beyond 1e18.
            bound = X.segment_sum(xp, inv, xp.max(xp.abs(g), axis=1, keepdims=True), ng)
            if float(xp.max(bound)) > _MAX_GRAD_SUM:
                raise ValueError(
                    "grads: the gradients of a key sum to more than 1e18 in magnitude (the "
                    "optimizer state would overflow float32); nothing changed"
                )
        # Summed as the table sums them (float32, batch order: bit for bit)
        # where that is cheap; on CuPy by one sorted pass (to float rounding).
        gsum = X.segment_sum_fast(xp, inv, g, ng)
        r = self._resolve(keys_d, admit=True, lookup=False, grads=gsum, unique=unique)
        slot = r.slot
        cached = xp.nonzero(slot >= 0)[0]
        cs = xp.take(slot, cached)

        def device_step(t: int) -> tuple[Array, Array]:
            # (On NumPy an overflow warns; it is refused just below.)
            with np.errstate(over="ignore", invalid="ignore"):
                w, st = _optim.step(
                    xp,
                    opt,
                    rows_at(self._int8, xp, self._rows, cs),
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
            if self._int8 is not None:
                # Encoded by the table's formula, rounded by each key's stream.
                keys_c = xp.take(r.uniq, cached)
                w = self._int8.encode_step(w, keys_c, t, self._keys_host)
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
        if r.served_grads is not None and r.served_grads.shape[0]:
            host = np.ascontiguousarray(r.served_grads)
            self.table.apply_gradients(r.served_keys, host, step=t)
            self._stats["table_updates"] += int(host.shape[0])

    @timed
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
        ids_d, bag_of, coef, batch, ns = self._bags(ids, offsets, weights, combiner)
        insert = _convert.check_bool("insert", insert)
        with self._lock:
            xp = self.xp
            rows_u, inv = self._gather(ids_d, insert)
            x = xp.take(rows_u, inv, axis=0)
            out = X.segment_sum(xp, bag_of, xp.reshape(coef, (-1, 1)) * x, batch)
            if not bool(xp.all(xp.isfinite(out))):
                raise ValueError("weights: pooling with these weights overflows float32")
            return self._out(out, ns)

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
        ids_d, bag_of, coef, batch, _ = self._bags(ids, offsets, weights, combiner)
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
    ) -> tuple[Array, Array, Array, int, ModuleType | None]:
        """Checked CSR input; each id's bag and coefficient on the device, and
        the namespace to give results back in."""
        xp = self.xp
        i_a, ns = self._adopt(ids, "ids")
        o_a, _ = self._adopt(offsets, "offsets")
        w_a = None if weights is None else self._adopt(weights, "weights")[0]
        host = all(a is None or isinstance(a, np.ndarray) for a in (i_a, o_a, w_a))
        if not host:
            c = _convert.check_combiner(combiner)
            ids_d, _ = self._keys(i_a, "ids")
            off, _ = self._keys(o_a, "offsets")
            return (*bags_on_device(self.xp, ids_d, off, w_a, c), ns)
        i, o, w, c = _convert.as_bags(i_a, o_a, w_a, combiner)
        # Each id's bag and coefficient w_i / d_bag: the core's own (checked
        # there), so the cache pools with the table's coefficients exactly.
        bag_of_h, coef_h = _core.bag_coefficients(i, o, w, c)
        batch = max(0, int(o.shape[0]) - 1)
        return xp.asarray(i), xp.asarray(bag_of_h), xp.asarray(coef_h), batch, ns

    # -- write-back and checkpoints -----------------------------------------------------

    def flush(self) -> None:
        """Write every cached row and its optimizer state back to the table (one
        device-to-host copy); the rows stay cached."""
        with self._lock:
            xp = self.xp
            slots = self._index.slots_in_use()
            if int(slots.shape[0]):
                keys, blocks = self._d2h(
                    xp.take(self._index.keys, slots),
                    [xp.take(self._rows, slots, axis=0), xp.take(self._state, slots, axis=0)],
                )
                self._write_back(keys, blocks[0], blocks[1])

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
        partition: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The table's :meth:`embstore.Table.publish_parts`."""
        manifest: dict[str, Any] = self.table.publish_parts(
            path, checkpoint_id, parts, rows, with_optimizer=with_optimizer, partition=partition
        )
        return manifest

    def evict(self, *, with_rows: bool = False) -> Any:
        """The table under a cache has no TTL or capacity: nothing to evict
        (empty keys, and rows with ``with_rows``), as the table would return."""
        return self.table.evict(with_rows=with_rows)

    #: The table's figures with this cache's own (:mod:`embstore.metrics`).
    metrics = cache_metrics

    def stats(self) -> dict[str, Any]:
        """hits, misses and hit_rate (per id of lookup calls; a key missing at
        the start of a call is one miss, its other occurrences hits), admissions,
        evictions, write_backs (rows), h2d/d2h copies, bytes and seconds
        (the copies alone, waited for) of rows, state and gradients,
        index_bytes (keys moved to the host for the table),
        table_updates (rows the cache could not hold, trained in the table),
        rows_cached, capacity, xp (the array namespace the cache runs on);
        and as every tier's stats, ``rows`` (the table's) and ``bytes`` (the
        table's and the cache's arrays), with the table's own under
        ``table``."""
        with self._lock:
            s: dict[str, Any] = dict(self._stats)
            s["hit_rate"] = s["hits"] / s["lookups"] if s["lookups"] else 0.0
            s["h2d_seconds"], s["d2h_seconds"] = self._seconds["h2d"], self._seconds["d2h"]
            s["rows_cached"] = self._index.used
            table = self.table.stats()
            s["table"] = table
            s["rows"] = table["rows"]
            # Rows and state (float32), and the index's key, digest and scores.
            per_slot = 4 * (self._width + self.table.state_len)
            s["bytes"] = table["bytes"] + self.capacity * per_slot + self._index.nbytes()
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
            f"DeviceCache(rows={self.capacity}, cached={self._index.used}, "
            f"xp={self.xp.__name__}, "
            f"policy={self.policy!r}, table={self.table!r})"
        )
