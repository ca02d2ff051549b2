"""The device cache's index: a bucketed open-addressing hash table from key to
slot, whose slot is also the row of the cached key (no second map).

Layout (as HierarchicalKV's): ``buckets`` buckets of ``bucket_size`` slots
(at most 128); a key lives in any slot of the one bucket its hash picks.
Per slot: the key (int64), a 1-byte digest of its hash (0: the slot is
empty), and the two scores the eviction policies read, ``count`` (accesses)
and ``last`` (the call that last touched it). A find compares a bucket's
digests first and a key only where its digest matches; an insert takes an
empty slot of the key's bucket, else evicts the bucket's lowest-scoring slot
that the running call does not use. Every operation costs O(keys of the
call x bucket_size), whatever the number of slots.

Two implementations with the same results, bit for bit: array-API
operations (NumPy, array-api-strict, torch, and CuPy when asked), and CUDA
kernels (``_cuda.py``) that CuPy uses by default: a warp per key for finds,
a warp per bucket for the admission plan. The plan is deterministic: a
bucket's free slots are handed out empty ones first, then by (first score,
second score, slot) ascending, to the bucket's misses in the order they come.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import array_api_compat

from embstore.gpu import _xp as X

Array = Any

#: The most slots a bucket has (one warp reads 128 digests in 4 rounds).
MAX_BUCKET = 128

# splitmix64's finalizer constants, as int64 (the arithmetic wraps).
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_LOW63 = (1 << 63) - 1


def shape_for(rows: int) -> tuple[int, int]:
    """(buckets, bucket_size) for a cache of at least ``rows`` slots: as few
    buckets of at most 128 slots as hold them, equally sized (so the slots
    exceed ``rows`` by fewer than ``buckets``)."""
    buckets = math.ceil(rows / MAX_BUCKET)
    return buckets, math.ceil(rows / buckets)


def _lsr(xp: ModuleType, z: Array, s: int) -> Array:
    """Logical right shift of int64 ``z`` (the arithmetic shift, masked)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def hash_keys(xp: ModuleType, keys: Array, buckets: int) -> tuple[Array, Array]:
    """Each key's bucket (int64) and digest (uint8, 1..255), from splitmix64's
    finalizer in wrapping int64 arithmetic (the kernels' uint64 bits)."""
    z = keys
    z = (z ^ _lsr(xp, z, 30)) * xp.asarray(_M1, dtype=xp.int64)
    z = (z ^ _lsr(xp, z, 27)) * xp.asarray(_M2, dtype=xp.int64)
    z = z ^ _lsr(xp, z, 31)
    bucket = (z & _LOW63) % buckets
    digest = xp.astype(1 + _lsr(xp, z, 56) % 255, xp.uint8)
    return bucket, digest


class BucketIndex:
    """Key -> slot for ``capacity`` slots (see the module's docstring)."""

    def __init__(self, xp: ModuleType, rows: int, *, kernels: bool | None = None) -> None:
        xp = X.namespace(xp)
        self.xp = xp
        self.buckets, self.bucket_size = shape_for(rows)
        self.capacity = self.buckets * self.bucket_size
        self._fancy = X.supports_fancy_setitem(xp)
        c = self.capacity
        self.keys = xp.zeros((c,), dtype=xp.int64)
        self.digest = xp.zeros((c,), dtype=xp.uint8)
        self.count = xp.zeros((c,), dtype=xp.int64)
        self.last = xp.zeros((c,), dtype=xp.int64)
        #: Slots in use (kept on the host: no device read to count them).
        self.used = 0
        is_cupy = bool(array_api_compat.is_cupy_namespace(xp))
        if kernels and not is_cupy:
            raise ValueError("kernels: the CUDA kernels need the cupy namespace")
        self.kernels = is_cupy if kernels is None else bool(kernels)
        #: Kernels plan without sorting the misses (linked per bucket) where
        #: no bucket has more than 64 of them.
        self.sort_free = True
        #: insert_or_assign in three kernels (``upsert_find8``, ``upsert_plan``,
        #: ``put_rows8``) where rows are float32; False: the find, touch, plan,
        #: install and put_rows kernels (kept to compare, benches/gpu_cache.py).
        self.fused = True
        self._cuda: Any = None
        if self.kernels:
            from embstore.gpu import _cuda

            self._cuda = _cuda.Kernels()

    # -- reads -------------------------------------------------------------------

    def hash(self, keys: Array) -> tuple[Array, Array]:
        """Bucket and digest of each key."""
        if self.kernels:
            out: tuple[Array, Array] = self._cuda.hash(keys, self.buckets)
            return out
        return hash_keys(self.xp, keys, self.buckets)

    def find(self, keys: Array) -> Array:
        """Slot of each key (int64), -1 where the key is not held."""
        xp = self.xp
        n = int(keys.shape[0])
        if n == 0:
            return xp.zeros((0,), dtype=xp.int64)
        if self.kernels:
            found: Array = self._cuda.find(
                keys, self.keys, self.digest, self.buckets, self.bucket_size
            )
            return found
        bucket, digest = hash_keys(xp, keys, self.buckets)
        width = self.bucket_size
        # Digests of every slot of each key's bucket: (n, width) bytes.
        base = bucket * width
        cand = xp.reshape(base, (-1, 1)) + xp.reshape(xp.arange(width, dtype=xp.int64), (1, -1))
        flat = xp.reshape(cand, (-1,))
        dmatch = xp.reshape(xp.take(self.digest, flat), (n, width)) == xp.reshape(digest, (-1, 1))
        # Keys only where a digest matches (about n * (1 + width / 255) of them).
        pos = xp.nonzero(xp.reshape(dmatch, (-1,)))[0]
        slot = xp.take(flat, pos)
        row = pos // width
        ok = xp.take(self.keys, slot) == xp.take(keys, row)
        # A key is in at most one slot: scatter the matching slot to its row.
        out = xp.full((n,), -1, dtype=xp.int64)
        good = xp.nonzero(ok)[0]
        return X.scatter_values(xp, self._fancy, out, xp.take(row, good), xp.take(slot, good))

    # -- writes ------------------------------------------------------------------

    def touch(self, slots: Array, counts: Array, tick: int) -> None:
        """Slots ``slots`` (distinct, in use) were accessed ``counts`` times in
        call ``tick``."""
        xp, fancy = self.xp, self._fancy
        if int(slots.shape[0]) == 0:
            return
        self.count = X.scatter_values(
            xp, fancy, self.count, slots, xp.take(self.count, slots) + counts
        )
        self.last = X.scatter_values(xp, fancy, self.last, slots, tick)

    def plan(self, keys: Array, protect_from: int, policy: str) -> tuple[Array, Array]:
        """Slots for missing keys ``keys`` (distinct, not held): each key's slot
        (-1: its bucket has no slot to give) and whether that slot is taken
        from a held key (an eviction). Slots whose ``last`` is at least
        ``protect_from`` (used by the running calls) are never given. Changes
        nothing: :meth:`install` takes the slots."""
        xp = self.xp
        m = int(keys.shape[0])
        if m == 0:
            z = xp.zeros((0,), dtype=xp.int64)
            return z, xp.zeros((0,), dtype=xp.bool)
        lru = policy == "lru"
        if self.kernels and self.sort_free:
            linked = self._linked(keys, protect_from, lru)
            if linked is not None:
                return linked
        return self._plan_sorted(keys, protect_from, lru)

    def _plan_sorted(self, keys: Array, protect_from: int, lru: bool) -> tuple[Array, Array]:
        """:meth:`plan` with the misses sorted by bucket."""
        xp = self.xp
        m = int(keys.shape[0])
        bucket, _ = self.hash(keys)
        # Buckets fit 32 bits: a radix sort of half the passes on a GPU.
        narrow = xp.astype(bucket, xp.int32) if self.buckets < 2**31 else bucket
        order = xp.argsort(narrow, stable=True)
        sb = xp.take(bucket, order)
        if self.kernels:
            out: tuple[Array, Array] = self._cuda.plan(
                sb,
                order,
                self.bucket_size,
                self.digest,
                self.count,
                self.last,
                protect_from,
                lru,
            )
            return out
        first = xp.concat([xp.ones((1,), dtype=xp.bool), sb[1:] != sb[:-1]])
        starts = xp.nonzero(first)[0]
        gb = xp.take(sb, starts)
        group = xp.cumulative_sum(xp.astype(first, xp.int64)) - 1
        rank = xp.arange(m, dtype=xp.int64) - xp.take(starts, group)
        slot_s, evict_s = self._plan_arrays(gb, group, rank, protect_from, lru)
        back = X.scatter_values(
            xp,
            self._fancy,
            xp.zeros((m,), dtype=xp.int64),
            order,
            xp.arange(m, dtype=xp.int64),
        )  # the inverse permutation of ``order``
        return xp.take(slot_s, back), xp.take(evict_s, back)

    def _linked(
        self, keys: Array, protect_from: int, lru: bool, found: Array = None
    ) -> tuple[Array, Array] | None:
        """The CUDA plan without a sort (None where a bucket overflows)."""
        out: tuple[Array, Array] | None = self._cuda.plan_linked(
            keys,
            self.buckets,
            self.bucket_size,
            self.digest,
            self.count,
            self.last,
            protect_from,
            lru,
            found=found,
        )
        return out

    def _plan_arrays(
        self, gb: Array, group: Array, rank: Array, protect_from: int, lru: bool
    ) -> tuple[Array, Array]:
        """The plan by sorting: every slot of the involved buckets ordered by
        (bucket, class, first score, second score, slot), where class is 0
        for an empty slot, 1 for an evictable one, 2 for a protected one; a
        bucket's r-th miss takes its r-th slot if that one's class is below 2."""
        xp = self.xp
        width = self.bucket_size
        ng = int(gb.shape[0])
        j = xp.reshape(xp.arange(width, dtype=xp.int64), (1, -1))
        cand = xp.reshape(xp.reshape(gb * width, (-1, 1)) + j, (-1,))
        grp = xp.reshape(xp.reshape(xp.arange(ng, dtype=xp.int64), (-1, 1)) + 0 * j, (-1,))
        empty = xp.take(self.digest, cand) == 0
        last = xp.take(self.last, cand)
        count = xp.take(self.count, cand)
        zero = xp.zeros_like(last)
        one, two = zero + 1, zero + 2
        cls = xp.where(empty, zero, xp.where(last >= protect_from, two, one))
        f = xp.where(empty, zero, last if lru else count)
        s = xp.where(empty, zero, count if lru else last)
        o = xp.arange(ng * width, dtype=xp.int64)  # already by (group, slot)
        for key in (s, f, cls, grp):
            o = xp.take(o, xp.argsort(xp.take(key, o), stable=True))
        cand_o, cls_o = xp.take(cand, o), xp.take(cls, o)
        avail = xp.sum(xp.reshape(xp.astype(cls < 2, xp.int64), (ng, width)), axis=1)
        pos = xp.minimum(group * width + rank, ng * width - 1)
        ok = rank < xp.take(avail, group)
        slot = xp.where(ok, xp.take(cand_o, pos), xp.asarray(-1, dtype=xp.int64))
        evict = ok & (xp.take(cls_o, pos) == 1)
        return slot, evict

    def install(self, slots: Array, keys: Array, counts: Array, tick: int, evicted: int) -> None:
        """Keys ``keys`` take slots ``slots`` (distinct, from :meth:`plan`),
        with ``counts`` accesses in call ``tick``; ``evicted`` of the slots
        held another key."""
        xp, fancy = self.xp, self._fancy
        n = int(slots.shape[0])
        if n == 0:
            return
        self.used += n - int(evicted)
        if self.kernels:
            self._cuda.install(
                slots,
                keys,
                counts,
                self.buckets,
                tick,
                self.keys,
                self.digest,
                self.count,
                self.last,
            )
            return
        _, digest = self.hash(keys)
        self.keys = X.scatter_values(xp, fancy, self.keys, slots, keys)
        self.digest = X.scatter_values(xp, fancy, self.digest, slots, digest)
        self.count = X.scatter_values(xp, fancy, self.count, slots, counts)
        self.last = X.scatter_values(xp, fancy, self.last, slots, tick)

    def remove(self, slots: Array) -> None:
        """Slots ``slots`` (distinct, in use) emptied: their keys are no
        longer found, and a plan gives them first."""
        xp, fancy = self.xp, self._fancy
        n = int(slots.shape[0])
        if n == 0:
            return
        self.used -= n
        for name in ("keys", "digest", "count", "last"):
            setattr(self, name, X.scatter_values(xp, fancy, getattr(self, name), slots, 0))

    def put_rows(self, dst: Array, slots: Array, src: Array, rows_of: Array = None) -> Array:
        """``dst`` (rows by slot) with rows ``slots`` (distinct) set to ``src``,
        or to ``src``'s rows ``rows_of`` (in place where the namespace allows)."""
        xp = self.xp
        if self.kernels and dst.dtype == xp.float32:
            self._cuda.put_rows(dst, slots, src, rows_of)
            return dst
        if rows_of is not None:
            src = xp.take(src, rows_of, axis=0)
        return X.scatter_rows(xp, self._fancy, dst, slots, src)

    def insert_or_assign(
        self, keys: Array, values: Array, rows: Array, tick: int, policy: str = "lfu"
    ) -> tuple[Array, Array, Array]:
        """Rows ``values`` of ``keys`` (distinct) into ``rows`` (rows by slot):
        held keys' rows overwritten, others admitted as :meth:`plan` and
        :meth:`install` admit them (evicting where a bucket is full), with one
        access each in call ``tick`` (held keys count as used by the call: no
        admission evicts them); returns ``rows`` (changed in place where the
        namespace allows), each key's slot (-1: its bucket had none to give)
        and whether it evicted a held key. The index's own
        insert (HierarchicalKV's insert_or_assign), in a few kernels on CuPy
        (no compaction of the misses)."""
        xp = self.xp
        n = int(keys.shape[0])
        fused = self.kernels and self.fused and self.sort_free and n > 0
        if fused and rows.dtype == xp.float32 and values.dtype == xp.float32:
            return self._upsert(keys, values, rows, tick, policy == "lru")
        found = self.find(keys)
        touched = False
        if self.kernels and self.sort_free and n:
            self._cuda.touch(found, tick, self.count, self.last)
            touched = True
            planned = self._linked(keys, tick, policy == "lru", found)
            if planned is not None:
                new, evict = planned
                dst = xp.where(found >= 0, found, new)
                got, ev = (
                    int(v)
                    for v in xp.stack(
                        [xp.sum(xp.astype(new >= 0, xp.int64)), xp.sum(xp.astype(evict, xp.int64))]
                    ).get()
                )
                self._cuda.install(
                    new,
                    keys,
                    xp.ones((n,), dtype=xp.int64),
                    self.buckets,
                    tick,
                    self.keys,
                    self.digest,
                    self.count,
                    self.last,
                )
                self._cuda.put_rows(rows, dst, values)
                self.used += got - ev
                return rows, dst, evict
        hit = xp.nonzero(found >= 0)[0]
        held = xp.take(found, hit)
        if not touched:
            self.touch(held, xp.ones(hit.shape, dtype=xp.int64), tick)
        rows = self.put_rows(rows, held, values, hit)
        miss = xp.nonzero(found < 0)[0]
        slots, evict = self.plan(xp.take(keys, miss), tick, policy)
        ok = xp.nonzero(slots >= 0)[0]
        got = xp.take(slots, ok)
        self.install(
            got,
            xp.take(xp.take(keys, miss), ok),
            xp.ones(ok.shape, dtype=xp.int64),
            tick,
            int(xp.sum(xp.astype(xp.take(evict, ok), xp.int64))),
        )
        rows = self.put_rows(rows, got, values, xp.take(miss, ok))
        dst = X.scatter_values(xp, self._fancy, found, miss, slots)
        ev = X.scatter_values(xp, self._fancy, xp.zeros((n,), dtype=xp.bool), miss, evict)
        return rows, dst, ev

    def _upsert(
        self, keys: Array, values: Array, rows: Array, tick: int, lru: bool
    ) -> tuple[Array, Array, Array]:
        """:meth:`insert_or_assign` in three kernels; the buckets of over 64
        misses (slot -2) planned after, by sorting (buckets are planned
        independently, so the result is the same)."""
        xp = self.xp
        slot, evict, got, ev, left = self._cuda.upsert(
            keys,
            values,
            rows,
            self.buckets,
            self.bucket_size,
            tick,
            lru,
            (self.keys, self.digest, self.count, self.last),
        )
        self.used += got - ev
        if left:
            pend = xp.nonzero(slot == -2)[0]
            pk = xp.take(keys, pend)
            s2, e2 = self._plan_sorted(pk, tick, lru)
            ok = xp.nonzero(s2 >= 0)[0]
            got2 = xp.take(s2, ok)
            self.install(
                got2,
                xp.take(pk, ok),
                xp.ones(ok.shape, dtype=xp.int64),
                tick,
                int(xp.sum(xp.astype(xp.take(e2, ok), xp.int64))),
            )
            rows = self.put_rows(rows, got2, values, xp.take(pend, ok))
            slot = X.scatter_values(xp, self._fancy, slot, pend, s2)
            evict = X.scatter_values(xp, self._fancy, evict, pend, e2)
        return rows, slot, evict

    def slots_in_use(self) -> Array:
        """Every slot that holds a key."""
        xp = self.xp
        return xp.astype(xp.nonzero(self.digest != 0)[0], xp.int64)

    def nbytes(self) -> int:
        """Bytes of the index's arrays (key 8, digest 1, count 8, last 8 a slot)."""
        return self.capacity * 25
