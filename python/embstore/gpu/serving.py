"""ServingCache: the hottest rows of a read-only table (a followed
:class:`embstore.MappedTable`) in device arrays, for serving lookups.

The cache's rows live on the device; which key each row (slot) holds lives
on the host, in a native slot map (``embstore._core.SlotMap``: buckets of
32 slots, 1-byte digests compared at once, HierarchicalKV's eviction of the
lowest-scoring slot of a full bucket). A lookup (keys on the host, as a
server receives them) finds every key's slot in one native call, reads the
misses' rows from the table in one host call, chooses their slots there
(the lowest-scoring rows of full buckets making room, never a row the
running call reads), and sends the device the slots, the misses' rows and
the admissions in one pinned copy; one kernel then writes every output row
(hits from the cached rows, misses from the rows sent), the hit mask, and
the admitted rows into their slots. Nothing is read back from the device,
so a call is one copy in and one launch, with no wait in between (the
output is ready when the stream reaches it). Keys already on the device are
copied to the host first.

Freshness: the cache reads the table's ``version`` at the start of every
call. When a refresh (its own :meth:`ServingCache.refresh`, or the table's
background ``follow``) has swapped a new publish in, the call first reads
every cached key's row again from the table (a key the table no longer holds
leaves the cache), so no call that starts after a refresh returns is served
a row of the version before. That costs one table lookup of the cached keys
per publish (``stats()["revalidate_seconds"]``).

On CuPy the output rows, the hit mask and the admissions are one kernel
(``serve_rows8`` in ``_cuda_tiles.py``); on NumPy, array-api-strict and
torch the same steps run with array operations and give the same rows,
masks and slots.
"""

from __future__ import annotations

import threading
import time
import warnings
from types import ModuleType
from typing import Any

import array_api_compat
import numpy as np

from embstore._convert import Default, as_keys, check_bool, check_default, to_host
from embstore._core import MappedTable as _NativeMapped
from embstore._core import SlotMap, staging_bytes
from embstore._latency import timed
from embstore.gpu import _xp as X
from embstore.gpu._fork import LIVE
from embstore.protocol import cache_metrics

Array = Any

#: Cached rows a revalidation reads and sends at a time.
REVALIDATE_BLOCK = 1 << 14


class ServingCache:
    """A device cache of ``rows`` rows of the read-only ``table`` (see the
    module's docs).

    Parameters
    ----------
    table:
        A read-only tier with a ``version`` (an :class:`embstore.MappedTable`,
        following its publisher or refreshed by :meth:`refresh`).
    rows:
        Rows the cache holds (>= 1), rounded up to whole buckets of 32.
    xp:
        The device's array namespace (default CuPy when a GPU is usable,
        else NumPy).
    policy:
        Which cached row makes room in a full bucket: "lfu" or "lru".
    admit_batch:
        Deprecated: missed keys are admitted in the call that misses them.
        Given, missed keys are queued and admitted ``admit_batch`` at a
        time, as before (with a DeprecationWarning).
    """

    def __init__(
        self,
        table: Any,
        rows: int,
        *,
        xp: ModuleType | None = None,
        policy: str = "lfu",
        admit_batch: int | None = None,
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
        if admit_batch is not None:
            if isinstance(admit_batch, bool) or not isinstance(admit_batch, int) or admit_batch < 1:
                raise ValueError(f"admit_batch: expected an int >= 1, got {admit_batch!r}")
            warnings.warn(
                "ServingCache(admit_batch=...) is deprecated: missed keys are admitted in "
                "the call that misses them (no read back from the device); leave it out",
                DeprecationWarning,
                stacklevel=2,
            )
        self.xp = X.namespace(xp)
        self._table = table
        self.policy = policy
        self.admit_batch = admit_batch
        self._slots = SlotMap(rows, policy)
        # An embstore.MappedTable's native table: a call's slots, misses'
        # rows and admissions in one native call (partitions in parallel).
        native = getattr(table, "_inner", None)
        self._native = native if isinstance(native, _NativeMapped) else None
        self.dim = int(table.dim)
        self._rows = self.xp.zeros((self._slots.capacity, self.dim), dtype=self.xp.float32)
        self._cupy = bool(array_api_compat.is_cupy_namespace(self.xp))
        #: Whether CuPy runs the serve kernel (False: array operations).
        self.kernels = self._cupy
        self._cuda: Any = None
        self._fancy = X.supports_fancy_setitem(self.xp)
        self._tick = 0
        self._version = int(table.version)
        self._queue_keys: list[np.ndarray] = []
        self._queue_rows: list[np.ndarray] = []
        self._queued = 0
        self._n = {"lookups": 0, "hits": 0, "admissions": 0, "admitted": 0, "revalidations": 0}
        self._n_revalidated = 0
        self._revalidate_s = 0.0
        self._staging: list[np.ndarray] = []  # pinned
        self._device: list[Any] = []
        self._copied: list[Any] = []  # CUDA events: the last call of each staging pair done
        self._turn = 0
        self._stream: Any = None  # the stream of the last call
        self._lock = threading.Lock()
        LIVE.add(self)

    @property
    def capacity(self) -> int:
        """Rows the cache can hold (``rows`` rounded up to whole buckets)."""
        return int(self._slots.capacity)

    @property
    def table(self) -> Any:
        """The table behind the cache."""
        return self._table

    def cached_keys(self) -> np.ndarray:
        """The keys the cache holds (host int64, in slot order)."""
        with self._lock:
            return self._slots.items()[0]

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
        self._queue_keys, self._queue_rows, self._queued = [], [], 0
        keys, slots = self._slots.items()
        # In blocks, so that the staging buffers stay the size of a call's
        # (a whole cache's rows at once would keep that much pinned).
        for at in range(0, int(keys.shape[0]), REVALIDATE_BLOCK):
            k, sl = keys[at : at + REVALIDATE_BLOCK], slots[at : at + REVALIDATE_BLOCK]
            rows, found = self._table.lookup(k, default="zeros", return_found=True)
            found = np.asarray(found, dtype=bool)
            self._put(sl[found], rows[found])
            self._slots.remove(k[~found])
        self._version = v
        self._n["revalidations"] += 1
        self._n_revalidated += int(keys.shape[0])
        self._revalidate_s += time.perf_counter() - t0

    def _put(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Cached rows ``slots`` (host) set to ``rows`` (host)."""
        if not slots.shape[0]:
            return
        xp = self.xp
        if self._fast:
            k = slots.shape[0]
            s, r = self._up([slots.astype(np.int32), np.ascontiguousarray(rows, np.float32)])
            self._kernels().serve8(self._rows, (0, 0), None, r, None, (s, 0, k))
            self._sent()
            return
        pos = xp.asarray(slots.astype(np.int64))
        self._rows = X.scatter_rows(xp, self._fancy, self._rows, pos, X.to_device(xp, rows))

    # -- lookups -------------------------------------------------------------------

    @timed
    def lookup(self, keys: Any, *, default: Default = "init", return_found: bool = False) -> Any:
        """Rows of ``keys (n,)`` (int64, on the host or in ``xp``) as a
        float32 ``(n, dim)`` ``xp`` array; a key the table lacks reads as
        ``default`` (as :meth:`embstore.MappedTable.lookup`). With
        ``return_found=True``, ``(rows, found)``, ``found`` a bool ``xp``
        array (hits from the cached rows, misses from the table)."""
        with_found = check_bool("return_found", return_found)
        xp = self.xp
        if not isinstance(keys, np.ndarray) and _in_namespace(xp, keys):
            if keys.dtype != xp.int64:
                raise TypeError(f"keys: expected an int64 array, got dtype {keys.dtype}")
            if keys.ndim != 1:
                raise ValueError(f"keys: expected a 1-D array, got shape {tuple(keys.shape)}")
            kh = to_host(xp, keys)
        else:
            kh = as_keys(keys)
        with self._lock:
            self._current()
            self._tick += 1
            tick = self._tick
            if self._fast and self._native is not None and self.admit_batch is None:
                return self._lookup_staged(kh, tick, default, with_found)
            if self._native is not None and self.admit_batch is None:
                mode, row = check_default(default, self.dim)
                src, mk, mpos, rows_m, found_m, adm_slot, adm_row = self._slots.serve(
                    kh, tick, self._native, mode, row
                )
                m = int(mk.shape[0])
                self._admitted(int(adm_slot.shape[0]))
            else:
                src, mk, mpos = self._slots.find(kh, tick)
                m = int(mk.shape[0])
                rows_m = np.empty((0, self.dim), np.float32)
                found_m = np.zeros((0,), bool)
                adm_slot = adm_row = np.zeros((0,), np.int32)
                if m:
                    rows_m, found_m = self._table.lookup(mk, default=default, return_found=True)
                    found_m = np.asarray(found_m, dtype=bool)
                    if self.admit_batch is None:
                        held = np.flatnonzero(found_m).astype(np.int32)
                        got, _ = self._slots.admit(mk[held], tick, tick)
                        ok = got >= 0
                        adm_slot, adm_row = got[ok], held[ok]
                        self._admitted(int(adm_slot.shape[0]))
                    else:
                        self._queue(mk[found_m], rows_m[found_m])
            out, found = self._serve(src, rows_m, found_m, mpos, adm_slot, adm_row, with_found)
            self._n["lookups"] += int(kh.shape[0])
            self._n["hits"] += int(kh.shape[0]) - m
            if self.admit_batch is not None and self._queued >= self.admit_batch:
                self._admit_queue(tick)
        return (out, found) if with_found else out

    def _admitted(self, rows: int) -> None:
        """Counts a call that admitted ``rows`` rows (none: not counted)."""
        if rows:
            self._n["admissions"] += 1
            self._n["admitted"] += rows

    @property
    def _fast(self) -> bool:
        """CuPy with the serve kernel: pinned copies, one launch a call."""
        return bool(self._cupy and self.kernels)

    def _kernels(self) -> Any:
        if self._cuda is None:
            from embstore.gpu import _cuda

            self._cuda = _cuda.Kernels()
        return self._cuda

    def _serve(
        self,
        src: np.ndarray,
        rows_m: np.ndarray,
        found_m: np.ndarray,
        mpos: np.ndarray,
        adm_slot: np.ndarray,
        adm_row: np.ndarray,
        with_found: bool,
    ) -> tuple[Array, Array]:
        """Output rows (cached row ``src[i]``, or miss row ``-1 - src[i]``),
        the hit mask, and the admitted misses' rows into their slots."""
        xp = self.xp
        n = int(src.shape[0])
        if self._fast:
            k = self._kernels()
            parts = [src, adm_slot, adm_row, rows_m] + ([found_m] if with_found else [])
            s_p, as_p, ar_p, rm_p, *fm_p = self._up(parts)
            out = k.cp.empty((n, self.dim), dtype=k.cp.float32)
            found = k.cp.empty((n,), dtype=k.cp.bool_) if with_found else None
            flags = (fm_p[0], found) if with_found else None
            k.serve8(self._rows, (s_p, n), out, rm_p, flags, (as_p, ar_p, int(adm_slot.shape[0])))
            self._sent()
            return out, found
        s_d = xp.asarray(src.astype(np.int64))
        hit = s_d >= 0
        out = xp.take(self._rows, xp.where(hit, s_d, xp.zeros_like(s_d)), axis=0)
        found = hit if with_found else None
        if mpos.shape[0]:
            pos = xp.asarray(mpos)
            out = X.scatter_rows(xp, self._fancy, out, pos, X.to_device(xp, rows_m))
            if with_found:
                found = X.scatter_values(xp, self._fancy, found, pos, xp.asarray(found_m))
        if adm_slot.shape[0]:
            self._put(adm_slot, rows_m[adm_row])
        return out, found

    def _stage(self, nbytes: int) -> tuple[np.ndarray, int, Any]:
        """One of two pinned staging buffers and the address of its device
        buffer, each of at least ``nbytes`` (used in turn: a pair is
        written again only once the call that last used it is done,
        :meth:`_sent`), and the current stream."""
        import cupy  # type: ignore[import-not-found, unused-ignore]

        stream = cupy.cuda.get_current_stream()
        if not self._copied:
            self._copied = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(2)]
            self._staging = [np.empty((0,), np.uint8)] * 2
            self._device = [cupy.empty((0,), np.uint8)] * 2
        elif self._stream != stream.ptr:
            # A call on another stream than the last: it waits for the last
            # call's work (whose admissions wrote rows it may read).
            stream.wait_event(self._copied[self._turn ^ 1])
        self._stream = stream.ptr
        turn = self._turn
        self._copied[turn].synchronize()
        if self._staging[turn].shape[0] < nbytes:
            size = max(nbytes, 1 << 16) * 2
            self._staging[turn] = X.host_buffer(self.xp, (size,), np.uint8)
            self._device[turn] = cupy.empty((size,), dtype=cupy.uint8)
        return self._staging[turn], int(self._device[turn].data.ptr), stream

    def _up(self, parts: list[np.ndarray]) -> list[int]:
        """Host arrays on the device in one asynchronous copy through
        :meth:`_stage`; the device address of each (16-byte aligned)."""
        import cupy  # type: ignore[import-not-found, unused-ignore]

        sizes = [(int(a.nbytes) + 15) & ~15 for a in parts]
        total = max(sum(sizes), 16)
        host, base, stream = self._stage(total)
        at = 0
        for a, size in zip(parts, sizes, strict=True):
            host[at : at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            at += size
        cupy.cuda.runtime.memcpyAsync(base, host.ctypes.data, total, 1, stream.ptr)
        out, at = [], 0
        for size in sizes:
            out.append(base + at)
            at += size
        return out

    def _lookup_staged(self, kh: np.ndarray, tick: int, default: Default, with_found: bool) -> Any:
        """Under the lock, on CuPy in front of an embstore.MappedTable: the
        native call writes the slots, misses' rows and admissions straight
        into the pinned staging buffer; one copy in, one kernel."""
        import cupy  # type: ignore[import-not-found, unused-ignore]

        assert self._native is not None  # the caller's condition
        mode, row = check_default(default, self.dim)
        n = int(kh.shape[0])
        host, base, stream = self._stage(staging_bytes(n, self.dim))
        m, a, slot_at, row_at, rows_at, found_at, total = self._slots.serve_into(
            kh, tick, self._native, host, mode, row, with_found
        )
        cupy.cuda.runtime.memcpyAsync(base, host.ctypes.data, max(total, 16), 1, stream.ptr)
        k = self._kernels()
        out = cupy.empty((n, self.dim), dtype=cupy.float32)
        found = cupy.empty((n,), dtype=cupy.bool_) if with_found else None
        flags = (base + found_at, found) if with_found else None
        k.serve8(
            self._rows, (base, n), out, base + rows_at, flags, (base + slot_at, base + row_at, a)
        )
        self._sent()
        self._admitted(a)
        self._n["lookups"] += n
        self._n["hits"] += n - m
        return (out, found) if with_found else out

    def _sent(self) -> None:
        """After a call's launches: its staging pair free once they are done."""
        self._copied[self._turn].record()
        self._turn ^= 1

    def _queue(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """(Deprecated ``admit_batch``) missed keys the table holds, with
        their rows, to admit later."""
        if keys.shape[0]:
            self._queue_keys.append(keys)
            self._queue_rows.append(rows)
            self._queued += int(keys.shape[0])

    def _admit_queue(self, tick: int) -> None:
        """Under the lock: the queued keys (each once, its last row) into
        the cache, the running call's rows kept."""
        keys = np.concatenate(self._queue_keys)
        rows = np.concatenate(self._queue_rows)
        self._queue_keys, self._queue_rows, self._queued = [], [], 0
        rk, first = np.unique(keys[::-1], return_index=True)
        pick = keys.shape[0] - 1 - first  # each key's last place in the queue
        got, _ = self._slots.admit(rk, tick, tick)
        ok = got >= 0
        self._put(got[ok], rows[pick[ok]])
        self._n["admissions"] += 1  # a call that admitted the queue, as before
        self._n["admitted"] += int(ok.sum())

    #: The mapped table's figures with this cache's own (:mod:`embstore.metrics`).
    metrics = cache_metrics

    def stats(self) -> dict[str, Any]:
        """Counters: ``lookups`` (keys looked up), ``hits``, ``hit_rate``,
        ``rows_cached``, ``capacity``, ``bytes`` (the cache's rows on the
        device), ``host_bytes`` (the slot map), ``admissions`` (calls that
        admitted rows), ``admitted`` (rows admitted), ``queued`` (missed
        keys waiting, with the deprecated ``admit_batch``; else 0),
        ``revalidations`` (publishes the cache followed),
        ``revalidated_rows`` and ``revalidate_seconds`` (their cost),
        ``version`` (the table's version the rows are of)."""
        with self._lock:
            n = dict(self._n)
            return {
                **n,
                "hit_rate": n["hits"] / n["lookups"] if n["lookups"] else 0.0,
                "rows_cached": len(self._slots),
                "capacity": self.capacity,
                "bytes": int(self.capacity * self.dim * 4),
                "host_bytes": int(self._slots.nbytes()),
                "queued": self._queued,
                "revalidated_rows": self._n_revalidated,
                "revalidate_seconds": self._revalidate_s,
                "version": self._version,
            }

    def __len__(self) -> int:
        return len(self._slots)

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
