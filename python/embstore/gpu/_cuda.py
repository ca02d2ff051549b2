"""CUDA kernels of the device index (index.py), compiled by CuPy at run time
(NVRTC). Their results equal the array-API implementation's bit for bit
(tests/test_device_index.py checks it on a GPU).

- ``hash_keys``: each key's bucket and digest (splitmix64's finalizer).
- ``find_slots``: a warp per key; each round the 32 lanes compare 32 of the
  bucket's digests, a ballot picks the lanes whose digest matches, and only
  those compare the 8-byte key.
- ``find_rows``: the same, and the warp copies the found row (a find that
  returns values, as HierarchicalKV's ``find``).
- ``plan_slots``: a warp per miss (misses sorted by bucket); the warp of
  a bucket's first miss plans the bucket: each lane holds 4 of its slots'
  (class, first score, second score, slot), and for each miss of the bucket
  in turn a butterfly reduction picks the smallest free one, written at the
  miss's own position (no count of the buckets first: no host sync).
- ``link_misses`` and ``plan_linked``: the same plan without sorting the
  misses: each is linked into its bucket's list by an atomic exchange, and
  the warp of the list's head takes the bucket's misses in ascending
  position (at most 64 a bucket, else the caller sorts).
- ``install_slots``: key, digest, count and last call of installed keys in
  one pass; ``put_rows``: rows into their slots, a warp per row.
"""

from __future__ import annotations

from typing import Any

from embstore.gpu._cuda_tiles import _THREADS, TILE_SOURCE, TileLaunchers, tile_for

__all__ = ["Kernels", "tile_for"]

Array = Any

_SOURCE = r"""
typedef long long i64;
typedef unsigned long long u64;
#define FULL 0xffffffffu

__device__ __forceinline__ u64 mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

__device__ __forceinline__ void place(i64 k, i64 nb, i64* bucket,
                                      unsigned char* digest) {
    u64 h = mix((u64)k);
    *bucket = (i64)((h & 0x7fffffffffffffffULL) % (u64)nb);
    *digest = (unsigned char)(1 + (h >> 56) % 255);
}

extern "C" __global__ void hash_keys(const i64* __restrict__ keys, i64 n, i64 nb,
                                     i64* __restrict__ bucket, unsigned char* __restrict__ digest) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    place(keys[i], nb, &bucket[i], &digest[i]);
}

// The slot of key k in its bucket, or -1; the same in every lane of the warp.
__device__ __forceinline__ i64 probe(i64 k, const i64* __restrict__ tkeys,
                                     const unsigned char* __restrict__ dig, i64 nb, int B,
                                     int lane) {
    i64 b; unsigned char d;
    place(k, nb, &b, &d);
    i64 base = b * (i64)B;
    for (int j0 = 0; j0 < B; j0 += 32) {
        int j = j0 + lane;
        bool m = false;
        if (j < B && dig[base + j] == d) m = tkeys[base + j] == k;
        unsigned ball = __ballot_sync(FULL, m);
        if (ball) return base + j0 + __ffs(ball) - 1;
    }
    return -1;
}

extern "C" __global__ void find_slots(const i64* __restrict__ keys, i64 n,
                                      const i64* __restrict__ tkeys,
                                      const unsigned char* __restrict__ dig, i64 nb, int B,
                                      i64* __restrict__ out) {
    i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= n) return;
    i64 s = probe(keys[w], tkeys, dig, nb, B, lane);
    if (lane == 0) out[w] = s;
}

extern "C" __global__ void find_rows(const i64* __restrict__ keys, i64 n,
                                     const i64* __restrict__ tkeys,
                                     const unsigned char* __restrict__ dig, i64 nb, int B,
                                     const float* __restrict__ rows, int dim,
                                     i64* __restrict__ out_slot, float* __restrict__ out_rows) {
    i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= n) return;
    i64 s = probe(keys[w], tkeys, dig, nb, B, lane);
    if (lane == 0) out_slot[w] = s;
    float* o = out_rows + w * (i64)dim;
    if (s >= 0) {
        const float* r = rows + s * (i64)dim;
        for (int c = lane; c < dim; c += 32) o[c] = r[c];
    } else {
        for (int c = lane; c < dim; c += 32) o[c] = 0.0f;
    }
}

__device__ __forceinline__ bool before(int c, i64 f, i64 s, int j, int c2, i64 f2, i64 s2, int j2) {
    if (c != c2) return c < c2;
    if (f != f2) return f < f2;
    if (s != s2) return s < s2;
    return j < j2;
}

// The bucket's empty slots as 4 ballots (word t, bit lane: slot 32t+lane)
// and their number; reading only the digests.
__device__ __forceinline__ int empties(const unsigned char* __restrict__ dig, i64 base, int B,
                                       int lane, unsigned* emp) {
    int n = 0;
    for (int t = 0; t < 4; ++t) {
        int j = lane + 32 * t;
        emp[t] = __ballot_sync(FULL, j < B && dig[base + j] == 0);
        n += __popc(emp[t]);
    }
    return n;
}

// The next empty slot of the ballots (in slot order), cleared from them.
__device__ __forceinline__ int take_empty(unsigned* emp) {
    for (int t = 0; t < 4; ++t) {
        if (emp[t]) {
            int bit = __ffs(emp[t]) - 1;
            emp[t] &= emp[t] - 1;
            return 32 * t + bit;
        }
    }
    return -1;
}

// This lane's 4 slots of the bucket at base: (class, first score, second
// score), class 0 empty, 1 evictable, 2 used by a running call, 3 none.
__device__ __forceinline__ void load_scores(const unsigned char* __restrict__ dig,
                                            const i64* __restrict__ cnt,
                                            const i64* __restrict__ last, i64 base, int B,
                                            int lane, i64 protect_from, int lru, int* cls,
                                            i64* f, i64* s) {
    for (int t = 0; t < 4; ++t) {
        int j = lane + 32 * t;
        cls[t] = 3; f[t] = 0; s[t] = 0;
        if (j < B) {
            i64 i = base + j;
            if (dig[i] == 0) {
                cls[t] = 0;
            } else {
                i64 l = last[i], c = cnt[i];
                cls[t] = l >= protect_from ? 2 : 1;
                f[t] = lru ? l : c;
                s[t] = lru ? c : l;
            }
        }
    }
}

// The bucket's smallest free slot by (class, first, second, slot), taken
// (marked class 3 in its lane); -1 when none is free. The same in every
// lane; *evict: the slot held a key.
__device__ __forceinline__ int take_best(int* cls, i64* f, i64* s, int lane, bool* evict) {
    int bc = 3; i64 bf = 0, bs = 0; int bj = 1 << 30;
    for (int t = 0; t < 4; ++t) {
        int j = lane + 32 * t;
        if (before(cls[t], f[t], s[t], j, bc, bf, bs, bj)) {
            bc = cls[t]; bf = f[t]; bs = s[t]; bj = j;
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        int oc = __shfl_xor_sync(FULL, bc, off);
        i64 of = __shfl_xor_sync(FULL, bf, off);
        i64 os = __shfl_xor_sync(FULL, bs, off);
        int oj = __shfl_xor_sync(FULL, bj, off);
        if (before(oc, of, os, oj, bc, bf, bs, bj)) {
            bc = oc; bf = of; bs = os; bj = oj;
        }
    }
    if (bc >= 2) return -1;
    if ((bj & 31) == lane) {
        int t = bj >> 5;
        for (int u = 0; u < 4; ++u) if (u == t) cls[u] = 3;
    }
    *evict = bc == 1;
    return bj;
}

extern "C" __global__ void plan_slots(const i64* __restrict__ sb,
                                      const i64* __restrict__ order, i64 m, int B,
                                      const unsigned char* __restrict__ dig,
                                      const i64* __restrict__ cnt, const i64* __restrict__ last,
                                      i64 protect_from, int lru,
                                      i64* __restrict__ out_slot, bool* __restrict__ out_evict) {
    // A warp per miss (sorted by bucket); the warp of a bucket's first miss
    // plans the bucket, the others return at once.
    i64 p0 = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (p0 >= m) return;
    i64 bucket = sb[p0];
    if (p0 > 0 && sb[p0 - 1] == bucket) return;
    i64 p1 = p0 + 1;
    while (p1 < m && sb[p1] == bucket) ++p1;
    i64 base = bucket * (i64)B;
    unsigned emp[4];
    if (empties(dig, base, B, lane, emp) >= p1 - p0) {
        // Empty slots for every miss: they come first in the order, so the
        // scores need not be read.
        for (i64 p = p0; p < p1; ++p) {
            int j = take_empty(emp);
            if (lane == 0) { out_slot[order[p]] = base + j; out_evict[order[p]] = false; }
        }
        return;
    }
    int cls[4]; i64 f[4]; i64 s[4];
    load_scores(dig, cnt, last, base, B, lane, protect_from, lru, cls, f, s);
    for (i64 p = p0; p < p1; ++p) {
        bool ev = false;
        int bj = take_best(cls, f, s, lane, &ev);
        if (bj < 0) {
            for (i64 q = p + lane; q < p1; q += 32) {
                out_slot[order[q]] = -1;
                out_evict[order[q]] = false;
            }
            break;
        }
        if (lane == 0) { out_slot[order[p]] = base + bj; out_evict[order[p]] = ev; }
    }
}

// Links each miss into its bucket's list: next[i] is the miss linked
// before it, head[b] the last one (exactly one miss of each bucket is a head).
// With found (a find's slots), keys already held are left out (bucket -1).
extern "C" __global__ void link_misses(const i64* __restrict__ keys, i64 m, i64 nb,
                                       const i64* __restrict__ found,
                                       i64* __restrict__ bucket, i64* __restrict__ head,
                                       i64* __restrict__ next) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m) return;
    if (found && found[i] >= 0) { bucket[i] = -1; next[i] = -1; return; }
    i64 b; unsigned char d;
    place(keys[i], nb, &b, &d);
    bucket[i] = b;
    next[i] = (i64)atomicExch((unsigned long long*)&head[b], (unsigned long long)i);
}

// plan_slots for linked misses: the warp of a bucket's head takes the
// bucket's misses in ascending position (as the sorted plan does), each
// the smallest free slot; more than LINK_CAP misses in a bucket sets
// *overflow (the caller then plans by sorting) and changes nothing else.
#define LINK_CAP 64
extern "C" __global__ void plan_linked(const i64* __restrict__ bucket,
                                       const i64* __restrict__ head,
                                       const i64* __restrict__ next, i64 m, int B,
                                       const unsigned char* __restrict__ dig,
                                       const i64* __restrict__ cnt,
                                       const i64* __restrict__ last, i64 protect_from, int lru,
                                       i64* __restrict__ out_slot, bool* __restrict__ out_evict,
                                       int* __restrict__ overflow) {
    i64 me = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (me >= m) return;
    i64 b = bucket[me];
    if (b < 0) {  // held already: no slot to plan
        if (lane == 0) { out_slot[me] = -1; out_evict[me] = false; }
        return;
    }
    if (head[b] != me) return;
    int k = 0;
    for (i64 j = me; j >= 0; j = next[j]) {
        if (++k > LINK_CAP) { if (lane == 0) atomicExch(overflow, 1); return; }
    }
    i64 base = b * (i64)B;
    unsigned emp[4];
    if (empties(dig, base, B, lane, emp) >= k) {
        // Empty slots for every miss (see plan_slots), in ascending position.
        i64 prev = -1;
        for (int r = 0; r < k; ++r) {
            i64 p = -1;
            for (i64 j = me; j >= 0; j = next[j]) {
                if (j > prev && (p < 0 || j < p)) p = j;
            }
            prev = p;
            int j = take_empty(emp);
            if (lane == 0) { out_slot[p] = base + j; out_evict[p] = false; }
        }
        return;
    }
    int cls[4]; i64 f[4]; i64 s[4];
    load_scores(dig, cnt, last, base, B, lane, protect_from, lru, cls, f, s);
    i64 prev = -1;
    bool full = false;
    for (int r = 0; r < k; ++r) {
        i64 p = -1;  // the smallest position above prev
        for (i64 j = me; j >= 0; j = next[j]) {
            if (j > prev && (p < 0 || j < p)) p = j;
        }
        prev = p;
        bool ev = false;
        int bj = full ? -1 : take_best(cls, f, s, lane, &ev);
        full = bj < 0;
        if (lane == 0) {
            out_slot[p] = full ? -1 : base + bj;
            out_evict[p] = !full && ev;
        }
    }
}

extern "C" __global__ void install_slots(const i64* __restrict__ slots,
                                         const i64* __restrict__ keys,
                                         const i64* __restrict__ counts, i64 n, i64 nb,
                                         i64 tick, i64* __restrict__ tkeys,
                                         unsigned char* __restrict__ dig,
                                         i64* __restrict__ cnt, i64* __restrict__ last) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || slots[i] < 0) return;
    i64 s = slots[i], k = keys[i], b;
    unsigned char d;
    place(k, nb, &b, &d);
    tkeys[s] = k;
    dig[s] = d;
    cnt[s] = counts[i];
    last[s] = tick;
}

// Slots found (>= 0) were accessed once in call tick.
extern "C" __global__ void touch_found(const i64* __restrict__ found, i64 n, i64 tick,
                                       i64* __restrict__ cnt, i64* __restrict__ last) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || found[i] < 0) return;
    cnt[found[i]] += 1;
    last[found[i]] = tick;
}

// dst[slots[i], :] = src[from[i], :] (src[i, :] without from): a warp per
// row, coalesced.
extern "C" __global__ void put_rows(const i64* __restrict__ slots, const float* __restrict__ src,
                                    const i64* __restrict__ from, i64 n, int width,
                                    float* __restrict__ dst) {
    i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= n || slots[w] < 0) return;
    const float* a = src + (from ? from[w] : w) * (i64)width;
    float* b = dst + slots[w] * (i64)width;
    for (int c = lane; c < width; c += 32) b[c] = a[c];
}
"""


class Kernels(TileLaunchers):
    """The compiled kernels and their launchers (CuPy arrays in and out)."""

    def __init__(self) -> None:
        import cupy  # type: ignore[import-not-found, unused-ignore]

        self.cp = cupy
        mod = cupy.RawModule(code=_SOURCE + TILE_SOURCE, options=("--std=c++14",))
        self._hash = mod.get_function("hash_keys")
        self._find = mod.get_function("find_slots")
        self._find_rows = mod.get_function("find_rows")
        self._plan = mod.get_function("plan_slots")
        self._install = mod.get_function("install_slots")
        self._link = mod.get_function("link_misses")
        self._plan_linked = mod.get_function("plan_linked")
        self._put_rows = mod.get_function("put_rows")
        self._touch = mod.get_function("touch_found")
        self._find_t = {t: mod.get_function(f"find{t}") for t in (2, 4, 8)}
        self._upsert_find8 = mod.get_function("upsert_find8")
        self._upsert_plan = mod.get_function("upsert_plan")
        self._put_rows8 = mod.get_function("put_rows8")
        self._serve_rows8 = mod.get_function("serve_rows8")
        #: Lanes a key for finds: 8 (``find8``), 4 or 2; None: by the rows'
        #: width (:func:`tile_for`); 0: a warp a key (``find_slots``,
        #: ``find_rows``: kept to compare, benches/gpu_cache.py).
        self.tile: int | None = None
        #: upsert_plan by a warp a bucket (True) or a key (False); None: by
        #: bucket where a call has at least half as many keys as buckets.
        self.by_bucket: bool | None = None

    def _grid(self, threads: int) -> tuple[int]:
        return (max(1, (threads + _THREADS - 1) // _THREADS),)

    def hash(self, keys: Array, buckets: int) -> tuple[Array, Array]:
        cp = self.cp
        keys = cp.ascontiguousarray(keys, dtype=cp.int64)
        n = int(keys.shape[0])
        bucket = cp.empty((n,), dtype=cp.int64)
        digest = cp.empty((n,), dtype=cp.uint8)
        if n:
            self._hash(
                self._grid(n), (_THREADS,), (keys, cp.int64(n), cp.int64(buckets), bucket, digest)
            )
        return bucket, digest

    def find(self, keys: Array, tkeys: Array, dig: Array, buckets: int, width: int) -> Array:
        cp = self.cp
        keys = cp.ascontiguousarray(keys, dtype=cp.int64)
        n = int(keys.shape[0])
        out = cp.empty((n,), dtype=cp.int64)
        if n and self.tile != 0:
            self.find_tiles(keys, tkeys, dig, buckets, width, out)
        elif n:
            self._find(
                self._grid(32 * n),
                (_THREADS,),
                (keys, cp.int64(n), tkeys, dig, cp.int64(buckets), cp.int32(width), out),
            )
        return out

    def find_rows(
        self, keys: Array, tkeys: Array, dig: Array, buckets: int, width: int, rows: Array
    ) -> tuple[Array, Array]:
        """Slots and rows (zeros where missing) of ``keys``."""
        cp = self.cp
        keys = cp.ascontiguousarray(keys, dtype=cp.int64)
        n, dim = int(keys.shape[0]), int(rows.shape[1])
        slot = cp.empty((n,), dtype=cp.int64)
        out = cp.empty((n, dim), dtype=cp.float32)
        if n and self.tile != 0:
            self.find_tiles(keys, tkeys, dig, buckets, width, slot, rows, out)
        elif n:
            self._find_rows(
                self._grid(32 * n),
                (_THREADS,),
                (
                    keys,
                    cp.int64(n),
                    tkeys,
                    dig,
                    cp.int64(buckets),
                    cp.int32(width),
                    rows,
                    cp.int32(dim),
                    slot,
                    out,
                ),
            )
        return slot, out

    def plan(
        self,
        sb: Array,
        order: Array,
        width: int,
        dig: Array,
        count: Array,
        last: Array,
        protect_from: int,
        lru: bool,
    ) -> tuple[Array, Array]:
        """Slots of misses whose buckets, sorted, are ``sb`` (``order``: the
        sorting permutation); results at the misses' own positions."""
        cp = self.cp
        m = int(sb.shape[0])
        slot = cp.empty((m,), dtype=cp.int64)
        evict = cp.empty((m,), dtype=cp.bool_)
        self._plan(
            self._grid(32 * m),
            (_THREADS,),
            (
                cp.ascontiguousarray(sb, dtype=cp.int64),
                cp.ascontiguousarray(order, dtype=cp.int64),
                cp.int64(m),
                cp.int32(width),
                dig,
                count,
                last,
                cp.int64(protect_from),
                cp.int32(1 if lru else 0),
                slot,
                evict,
            ),
        )
        return slot, evict

    def plan_linked(
        self,
        keys: Array,
        buckets: int,
        width: int,
        dig: Array,
        count: Array,
        last: Array,
        protect_from: int,
        lru: bool,
        found: Array = None,
    ) -> tuple[Array, Array] | None:
        """:meth:`plan` without a sort: misses linked per bucket by atomics,
        each bucket's taken in ascending position by its head's warp. None
        where a bucket has more than 64 misses (then plan by sorting). With
        ``found`` (a find's slots of ``keys``), the keys held already get -1."""
        cp = self.cp
        keys = cp.ascontiguousarray(keys, dtype=cp.int64)
        m = int(keys.shape[0])
        bucket = cp.empty((m,), dtype=cp.int64)
        head = cp.full((buckets,), -1, dtype=cp.int64)
        nxt = cp.empty((m,), dtype=cp.int64)
        held = cp.uint64(0) if found is None else cp.ascontiguousarray(found, dtype=cp.int64)
        self._link(
            self._grid(m),
            (_THREADS,),
            (keys, cp.int64(m), cp.int64(buckets), held, bucket, head, nxt),
        )
        slot = cp.empty((m,), dtype=cp.int64)
        evict = cp.empty((m,), dtype=cp.bool_)
        overflow = cp.zeros((1,), dtype=cp.int32)
        self._plan_linked(
            self._grid(32 * m),
            (_THREADS,),
            (
                bucket,
                head,
                nxt,
                cp.int64(m),
                cp.int32(width),
                dig,
                count,
                last,
                cp.int64(protect_from),
                cp.int32(1 if lru else 0),
                slot,
                evict,
                overflow,
            ),
        )
        if int(overflow.get()[0]):
            return None
        return slot, evict

    def install(
        self,
        slots: Array,
        keys: Array,
        counts: Array,
        buckets: int,
        tick: int,
        tkeys: Array,
        dig: Array,
        cnt: Array,
        last: Array,
    ) -> None:
        """Keys ``keys`` (with ``counts``) into ``slots``: key, digest, count
        and last call written in one pass (a slot of -1: nothing)."""
        cp = self.cp
        n = int(slots.shape[0])
        if n:
            self._install(
                self._grid(n),
                (_THREADS,),
                (
                    cp.ascontiguousarray(slots, dtype=cp.int64),
                    cp.ascontiguousarray(keys, dtype=cp.int64),
                    cp.ascontiguousarray(counts, dtype=cp.int64),
                    cp.int64(n),
                    cp.int64(buckets),
                    cp.int64(tick),
                    tkeys,
                    dig,
                    cnt,
                    last,
                ),
            )

    def touch(self, found: Array, tick: int, cnt: Array, last: Array) -> None:
        """One access in call ``tick`` for each slot of ``found`` (distinct; -1: none)."""
        cp = self.cp
        n = int(found.shape[0])
        if n:
            self._touch(
                self._grid(n),
                (_THREADS,),
                (
                    cp.ascontiguousarray(found, dtype=cp.int64),
                    cp.int64(n),
                    cp.int64(tick),
                    cnt,
                    last,
                ),
            )

    def put_rows(self, dst: Array, slots: Array, src: Array, rows_of: Array = None) -> None:
        """``dst[slots] = src`` for float32 rows (``slots`` distinct; -1:
        none); with ``rows_of``, ``dst[slots] = src[rows_of]`` (no gathered
        copy)."""
        cp = self.cp
        n = int(slots.shape[0])
        if n:
            self._put_rows(
                self._grid(32 * n),
                (_THREADS,),
                (
                    cp.ascontiguousarray(slots, dtype=cp.int64),
                    cp.ascontiguousarray(src, dtype=cp.float32),
                    cp.uint64(0)
                    if rows_of is None
                    else cp.ascontiguousarray(rows_of, dtype=cp.int64),
                    cp.int64(n),
                    cp.int32(int(dst.shape[1])),
                    dst,
                ),
            )
