"""ServingCache: the hottest rows of a read-only table (a followed
:class:`embstore.MappedTable`) in device arrays, for serving lookups.

A lookup finds its keys in the device index (:mod:`embstore.gpu.index`);
hits are read on the device, with their hit mask, and the misses' rows come
from the table in one host call and one copy in. Missed keys the table holds
are queued and admitted ``admit_batch`` at a time (one insert_or_assign of
the queue, the lowest-scoring rows of full buckets making room, never a row
the running call reads), so most calls launch no admission of their own
(HugeCTR's hierarchical parameter server inserts misses asynchronously too).

Freshness: the cache reads the table's ``version`` at the start of every
call. When a refresh (its own :meth:`ServingCache.refresh`, or the table's
background ``follow``) has swapped a new publish in, the call first reads
every cached key's row again from the table (a key the table no longer holds
leaves the cache) and drops the queue, so no call that starts after a
refresh returns is served a row of the version before. That costs one table
lookup of the cached keys per publish (``stats()["revalidate_seconds"]``).

On CuPy the find, the hit rows' copy, the access counts and the list of
misses are one kernel (``find8``, ``find4`` or ``find2`` in ``_cuda_tiles.py``); on NumPy,
array-api-strict and torch the same lookups run with array operations and
give the same rows, masks and admissions.
"""

from __future__ import annotations

import threading
import time
from types import ModuleType
from typing import Any

import array_api_compat
import numpy as np

from embstore._convert import Default, as_keys, check_bool, to_host
from embstore._latency import timed
from embstore.gpu import _xp as X
from embstore.gpu._fork import LIVE
from embstore.gpu.index import BucketIndex

Array = Any


class ServingCache:
    """A device cache of ``rows`` rows of the read-only ``table`` (see the
    module's docs).

    Parameters
    ----------
    table:
        A read-only tier with a ``version`` (an :class:`embstore.MappedTable`,
        following its publisher or refreshed by :meth:`refresh`).
    rows:
        Rows the cache holds (>= 1), rounded up to whole buckets.
    xp:
        The device's array namespace (default CuPy when a GPU is usable,
        else NumPy).
    policy:
        Which cached row makes room in a full bucket: "lfu" or "lru".
    admit_batch:
        Missed keys queued before they are admitted in one call (>= 1).
    """

    def __init__(
        self,
        table: Any,
        rows: int,
        *,
        xp: ModuleType | None = None,
        policy: str = "lfu",
        admit_batch: int = 2048,
    ) -> None:
        if getattr(table, "writable", True) or not hasattr(table, "version"):
            raise TypeError(
                "table: expected a read-only table with a version (an embstore.MappedTable), "
                f"got {type(table).__name__}; a table that trains is cached by DeviceCache"
            )
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows: expected an int >= 1, got {rows!r}")
        if policy not in ("lfu", "lru"):
            raise ValueError(f"policy: expected 'lfu' or 'lru', got {policy!r}")
        if isinstance(admit_batch, bool) or not isinstance(admit_batch, int) or admit_batch < 1:
            raise ValueError(f"admit_batch: expected an int >= 1, got {admit_batch!r}")
        self.xp = X.namespace(xp)
        self._table = table
        self.policy = policy
        self.admit_batch = admit_batch
        self._index = BucketIndex(self.xp, rows)
        self.dim = int(table.dim)
        self._rows = self.xp.zeros((self._index.capacity, self.dim), dtype=self.xp.float32)
        self._cupy = bool(array_api_compat.is_cupy_namespace(self.xp))
        self._tick = 0
        self._version = int(table.version)
        self._queue_keys: list[np.ndarray] = []
        self._queue_rows: list[Any] = []
        self._queued = 0
        self._n = {"lookups": 0, "hits": 0, "admissions": 0, "revalidations": 0}
        self._n_revalidated = 0
        self._revalidate_s = 0.0
        self._staging: np.ndarray | None = None
        self._copied: Any = None  # a CUDA event: the last copy out of _staging
        self._lock = threading.Lock()
        LIVE.add(self)

    @property
    def capacity(self) -> int:
        """Rows the cache can hold (``rows`` rounded up to whole buckets)."""
        return int(self._index.capacity)

    @property
    def table(self) -> Any:
        """The table behind the cache."""
        return self._table

    # -- freshness -----------------------------------------------------------------

    def refresh(self) -> bool:
        """Refreshes the table (serving what was published since) and the
        cache with it; returns whether anything was published. After it
        returns, no lookup is served a row of an earlier version."""
        changed = bool(self._table.refresh())
        with self._lock:
            self._current()
        return changed

    def _current(self) -> None:
        """Under the lock: the cached rows read again where the table's
        version moved since they were read, and the queue dropped."""
        v = int(self._table.version)
        if v == self._version:
            return
        t0 = time.perf_counter()
        xp, ix = self.xp, self._index
        self._queue_keys, self._queue_rows, self._queued = [], [], 0
        slots = ix.slots_in_use()
        keys = to_host(xp, xp.take(ix.keys, slots))
        if keys.shape[0]:
            rows, found = self._table.lookup(keys, default="zeros", return_found=True)
            found = np.asarray(found, dtype=bool)
            keep = xp.asarray(np.flatnonzero(found))
            gone = xp.asarray(np.flatnonzero(~found))
            self._rows = ix.put_rows(self._rows, xp.take(slots, keep), X.to_device(xp, rows[found]))
            ix.remove(xp.take(slots, gone))
        self._version = v
        self._n["revalidations"] += 1
        self._n_revalidated += int(keys.shape[0])
        self._revalidate_s += time.perf_counter() - t0

    # -- lookups -------------------------------------------------------------------

    @timed
    def lookup(self, keys: Any, *, default: Default = "init", return_found: bool = False) -> Any:
        """Rows of ``keys (n,)`` (int64, on the host or in ``xp``) as a
        float32 ``(n, dim)`` ``xp`` array; a key the table lacks reads as
        ``default`` (as :meth:`embstore.MappedTable.lookup`). With
        ``return_found=True``, ``(rows, found)``, ``found`` a bool ``xp``
        array (hits from the device, misses from the table)."""
        with_found = check_bool("return_found", return_found)
        xp = self.xp
        on_device = not isinstance(keys, np.ndarray) and _in_namespace(xp, keys)
        if on_device:
            if keys.dtype != xp.int64:
                raise TypeError(f"keys: expected an int64 array, got dtype {keys.dtype}")
            if keys.ndim != 1:
                raise ValueError(f"keys: expected a 1-D array, got shape {tuple(keys.shape)}")
            kh = None
            kd = keys
        else:
            kh = as_keys(keys)
            kd = None
        with self._lock:
            self._current()
            self._tick += 1
            if kh is not None:
                kd = self._up([kh])[0] if self._fast else X.to_device(xp, kh)
            n = int(kd.shape[0])
            out, slot, miss = self._find(kd, n)
            found = slot >= 0 if with_found else None
            if miss.shape[0]:
                mk = kh[miss] if kh is not None else to_host(xp, xp.take(kd, xp.asarray(miss)))
                rows_m, found_m = self._table.lookup(mk, default=default, return_found=True)
                found_m = np.asarray(found_m, dtype=bool)
                if self._fast:  # one copy in of positions, rows and masks; one kernel
                    parts = [miss, rows_m] + ([found_m] if with_found else [])
                    pos, rows_d, *fm = self._up(parts)
                    flags = (fm[0], found) if found is not None else None
                    self._index._cuda.put8(out, pos, rows_d, flags)
                    # Queued on the device: the rows need not go up again.
                    self._queue(mk[found_m], rows_d, np.flatnonzero(found_m))
                else:
                    self._queue(mk[found_m], rows_m[found_m])
                    pos = xp.asarray(miss)
                    fancy = self._index._fancy
                    out = X.scatter_rows(xp, fancy, out, pos, X.to_device(xp, rows_m))
                    if with_found:
                        found = X.scatter_values(xp, fancy, found, pos, xp.asarray(found_m))
            self._n["lookups"] += n
            self._n["hits"] += n - int(miss.shape[0])
            if self._queued >= self.admit_batch:
                self._admit()
        return (out, found) if with_found else out

    @property
    def _fast(self) -> bool:
        """CuPy with the index's kernels: pinned copies and the tile find kernels."""
        return bool(self._cupy and self._index.kernels)

    def _up(self, parts: list[np.ndarray]) -> list[Array]:
        """Host arrays on the device in one asynchronous copy from a pinned
        staging buffer (reused: the next call's read back waits for the copy
        first), as views of one device buffer."""
        import cupy  # type: ignore[import-not-found, unused-ignore]

        sizes = [(int(a.nbytes) + 15) & ~15 for a in parts]
        total = sum(sizes)
        if self._copied is None:
            self._copied = cupy.cuda.Event(block=False, disable_timing=True)
        else:  # the last copy out of the buffer is done before it is written
            self._copied.synchronize()
        if self._staging is None or self._staging.shape[0] < total:
            self._staging = X.host_buffer(self.xp, (max(total, 1 << 16) * 2,), np.uint8)
        host = self._staging
        at = 0
        for a, size in zip(parts, sizes, strict=True):
            host[at : at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            at += size
        dev = cupy.empty((total,), dtype=cupy.uint8)
        dev.set(host[:total], stream=cupy.cuda.get_current_stream())
        self._copied.record()
        out, at = [], 0
        for a, size in zip(parts, sizes, strict=True):
            out.append(dev[at : at + a.nbytes].view(a.dtype).reshape(a.shape))
            at += size
        return out

    def _find(self, kd: Array, n: int) -> tuple[Array, Array, np.ndarray]:
        """Rows of the held keys (others' rows to be filled), each key's
        slot, and the positions of the misses (ascending, on the host); an
        access counted for each hit in this call."""
        xp, ix = self.xp, self._index
        if self._fast:
            import cupy  # type: ignore[import-not-found, unused-ignore]

            kd = cupy.ascontiguousarray(kd)
            out = cupy.empty((n, self.dim), dtype=cupy.float32)
            slot = cupy.empty((n,), dtype=cupy.int64)
            buf = cupy.zeros((n + 1,), dtype=cupy.int64)  # miss positions, then their count
            if n:
                ix._cuda.find_tiles(
                    kd,
                    ix.keys,
                    ix.digest,
                    ix.buckets,
                    ix.bucket_size,
                    slot,
                    self._rows,
                    out,
                    touch=(ix.count, ix.last, self._tick),
                    miss=(buf, buf[n:].view(cupy.int32)),
                )
            h = buf.get()
            m = int(h[n:].view(np.int32)[0])
            return out, slot, np.sort(h[:m])
        slot = ix.find(kd)
        hit = xp.nonzero(slot >= 0)[0]
        if int(hit.shape[0]):
            u, _, counts = X.unique_counts(xp, xp.take(slot, hit))
            ix.touch(u, counts, self._tick)
        out = xp.take(self._rows, xp.where(slot >= 0, slot, xp.zeros_like(slot)), axis=0)
        miss = to_host(xp, xp.nonzero(slot < 0)[0]).astype(np.int64)
        return out, slot, miss

    def _queue(self, keys: np.ndarray, rows: Array, of: np.ndarray | None = None) -> None:
        """Missed keys the table holds, to admit: host ``keys`` with their
        ``rows`` (on the host; or on the device, ``keys[i]``'s row being
        ``rows[of[i]]``)."""
        if keys.shape[0]:
            self._queue_keys.append(keys)
            self._queue_rows.append(rows if of is None else (rows, of))
            self._queued += int(keys.shape[0])

    def _admit(self) -> None:
        """Under the lock: the queued keys (each once, its last row) into
        the cache in one insert_or_assign, the running call's rows kept."""
        xp = self.xp
        keys = np.concatenate(self._queue_keys)
        queued = self._queue_rows
        self._queue_keys, self._queue_rows, self._queued = [], [], 0
        rk, first = np.unique(keys[::-1], return_index=True)
        pick = keys.shape[0] - 1 - first  # each key's last place in the queue
        if self._fast:
            import cupy  # type: ignore[import-not-found, unused-ignore]

            # Places in the joined device rows of the queued ones.
            at, where = 0, []
            for rows_d, of in queued:
                where.append(of + at)
                at += int(rows_d.shape[0])
            kd, sel = self._up([rk, np.concatenate(where)[pick]])
            rd = cupy.concatenate([r for r, _ in queued])[sel]
        else:
            rr = np.concatenate(queued)[pick]
            kd, rd = X.to_device(xp, rk), X.to_device(xp, rr)
        self._rows, _, _ = self._index.insert_or_assign(kd, rd, self._rows, self._tick, self.policy)
        self._n["admissions"] += 1

    def stats(self) -> dict[str, Any]:
        """Counters: ``lookups`` (keys looked up), ``hits``, ``hit_rate``,
        ``rows_cached``, ``capacity``, ``bytes`` (the cache's arrays on
        the device), ``queued`` (missed keys waiting to be
        admitted), ``admissions`` (calls that admitted the queue),
        ``revalidations`` (publishes the cache
        followed), ``revalidated_rows`` and ``revalidate_seconds`` (their
        cost), ``version`` (the table's version the rows are of)."""
        with self._lock:
            n = dict(self._n)
            return {
                **n,
                "hit_rate": n["hits"] / n["lookups"] if n["lookups"] else 0.0,
                "rows_cached": int(self._index.used),
                "capacity": self.capacity,
                # The cached rows (float32) and the index's arrays.
                "bytes": int(self.capacity * self.dim * 4 + self._index.nbytes()),
                "queued": self._queued,
                "revalidated_rows": self._n_revalidated,
                "revalidate_seconds": self._revalidate_s,
                "version": self._version,
            }

    def __len__(self) -> int:
        return int(self._index.used)

    def __repr__(self) -> str:
        return (
            f"ServingCache({self._table!r}, rows={self.capacity}, xp={self.xp.__name__}, "
            f"cached={len(self)})"
        )


def _in_namespace(xp: ModuleType, a: Any) -> bool:
    """Whether ``a`` is an array of namespace ``xp``."""
    try:
        return bool(array_api_compat.array_namespace(a) is xp)
    except TypeError:
        return False
