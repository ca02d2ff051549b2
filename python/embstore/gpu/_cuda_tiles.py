"""The device index's kernels by tiles of lanes (appended to ``_cuda.py``'s
source, whose helpers they use: ``place``, ``empties``, ``load_scores``,
``take_empty``, ``take_best``, ``LINK_CAP``), and their launchers.

- ``find8``, ``find4``, ``find2``: a tile of 8, 4 or 2 lanes per key reads
  the bucket's 128 digests in 16-byte loads; the lanes whose digest matches
  compare their candidate's key, all at once; the tile copies the row
  (float4). A warp holds 4 to 16 keys, so more of them are in flight than
  with a warp a key (``find_rows``): at dim 64 a find moves 721 bytes a key
  and runs at 81% of an H200's HBM bandwidth (benches/HISTORY.md).
- ``upsert_find8``, ``upsert_plan``, ``put_rows8``: insert_or_assign in three
  kernels (held keys touched, and missing ones placed in their bucket's row
  of ``FILL_CAP`` items, then its list; each bucket's misses planned and
  installed by one warp, counted into 64 spread counters; every row
  copied). On an H100 at dim 64 and load 0.5: 1.49-1.56 B keys/s, against
  1.23-1.27 with a list alone and two atomics a warp on one counter.
- ``serve_rows8``: a ServingCache call's output rows (cached or sent),
  hit mask and admissions in one launch.
"""

from __future__ import annotations

from typing import Any

Array = Any

_THREADS = 256
#: A bucket's misses of an insert_or_assign read by its planning warp in one
#: load (``FILL_CAP`` in the kernels); those past it are linked in a list.
FILL_CAP = 8

TILE_SOURCE = (
    f"#define FILL_CAP {FILL_CAP}\n"
    + r"""
// -- tiles of T lanes a key (T = 2, 4 or 8) ---------------------------------
// The lanes of this thread's tile of T.
template <int T>
__device__ __forceinline__ unsigned tile_mask() {
    return ((1u << T) - 1) << (threadIdx.x & (32 - T));
}

// The slot of k in its bucket, or -1, the same in the tile's T lanes
// (*bucket: k's bucket). Lane sub holds 128 / T of the bucket's digests
// (16-byte loads where B is a multiple of 16, else byte loads), and each
// round every lane with a matching digest compares one candidate's key, so
// a key is found in one round but for a digest collision (1 in 255 a slot).
template <int T>
__device__ __forceinline__ i64 probe_t(i64 k, const i64* __restrict__ tkeys,
                                       const unsigned char* __restrict__ dig, i64 nb, int B,
                                       int sub, i64* bucket) {
    constexpr int PER = 128 / T;
    const unsigned tmask = tile_mask<T>();
    unsigned char d;
    place(k, nb, bucket, &d);
    i64 base = *bucket * (i64)B;
    u64 m = 0;
    int j0 = sub * PER;
    if ((B & 15) == 0) {
#pragma unroll
        for (int v = 0; v < PER / 16; ++v) {
            int j = j0 + 16 * v;
            if (j < B) {
                uint4 q = *reinterpret_cast<const uint4*>(dig + base + j);
                unsigned w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                for (int t = 0; t < 16; ++t)
                    if (((w[t >> 2] >> (8 * (t & 3))) & 0xffu) == d) m |= 1ull << (16 * v + t);
            }
        }
    } else {
        for (int t = 0; t < PER; ++t)
            if (j0 + t < B && dig[base + j0 + t] == d) m |= 1ull << t;
    }
    for (;;) {
        if (!__ballot_sync(tmask, m != 0)) return -1;
        bool hit = false;
        int j = 0;
        if (m) {
            j = j0 + __ffsll((long long)m) - 1;
            m &= m - 1;
            hit = tkeys[base + j] == k;
        }
        unsigned hb = __ballot_sync(tmask, hit);
        if (hb) return base + __shfl_sync(tmask, j, __ffs(hb) - 1);
    }
}

// dst row (dim floats) = src row, by a tile's T lanes (vec: both 16-byte
// aligned and dim a multiple of 4: float4 copies); src null: zeros.
template <int T>
__device__ __forceinline__ void copy_t(float* __restrict__ dst, const float* __restrict__ src,
                                       int dim, int vec, int sub) {
    if (vec) {
        float4* o = reinterpret_cast<float4*>(dst);
        const float4* r = reinterpret_cast<const float4*>(src);
        const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int c = sub; c < (dim >> 2); c += T) o[c] = src ? r[c] : z;
    } else {
        for (int c = sub; c < dim; c += T) dst[c] = src ? src[c] : 0.0f;
    }
}

// find_slots and find_rows by tiles of T lanes: the slot of each key (and,
// with out_rows, its row: zeros where missing, or left as is where a miss
// list is asked for). With cnt, a found slot counts an access (atomically:
// keys may repeat) in call tick; with miss, the positions of the keys not
// found are appended to it (*nmiss of them, in no particular order).
template <int T>
__device__ __forceinline__ void find_t(const i64* __restrict__ keys, i64 n,
                                       const i64* __restrict__ tkeys,
                                       const unsigned char* __restrict__ dig, i64 nb, int B,
                                       const float* __restrict__ rows, int dim, int vec,
                                       i64* __restrict__ out_slot, float* __restrict__ out_rows,
                                       i64* __restrict__ cnt, i64* __restrict__ last, i64 tick,
                                       i64* __restrict__ miss, int* __restrict__ nmiss) {
    i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) / T;
    int sub = threadIdx.x & (T - 1);
    if (w >= n) return;
    i64 b;
    i64 s = probe_t<T>(keys[w], tkeys, dig, nb, B, sub, &b);
    if (sub == 0) {
        out_slot[w] = s;
        if (s >= 0 && cnt) {
            atomicAdd((unsigned long long*)&cnt[s], 1ULL);
            last[s] = tick;
        }
        if (s < 0 && miss) miss[atomicAdd(nmiss, 1)] = w;
    }
    if (out_rows && (s >= 0 || !miss))
        copy_t<T>(out_rows + w * (i64)dim, s >= 0 ? rows + s * (i64)dim : nullptr, dim, vec, sub);
}

#define FIND_ARGS                                                                             \
    const i64 *__restrict__ keys, i64 n, const i64 *__restrict__ tkeys,                      \
        const unsigned char *__restrict__ dig, i64 nb, int B, const float *__restrict__ rows, \
        int dim, int vec, i64 *__restrict__ out_slot, float *__restrict__ out_rows,           \
        i64 *__restrict__ cnt, i64 *__restrict__ last, i64 tick, i64 *__restrict__ miss,      \
        int *__restrict__ nmiss
#define FIND_PASS keys, n, tkeys, dig, nb, B, rows, dim, vec, out_slot, out_rows, cnt, last, \
    tick, miss, nmiss
extern "C" __global__ void find8(FIND_ARGS) { find_t<8>(FIND_PASS); }
extern "C" __global__ void find4(FIND_ARGS) { find_t<4>(FIND_PASS); }
extern "C" __global__ void find2(FIND_ARGS) { find_t<2>(FIND_PASS); }

// insert_or_assign, first half (tiles of 8 lanes, distinct keys): a held
// key's slot counts an access in call tick; a missing key takes the next
// place of its bucket's fill (atomicAdd): the first FILL_CAP places are
// the bucket's row of items, read by the planning warp in one load, the
// others a list of their own (head, next). Rows are copied by put_rows8.
extern "C" __global__ void upsert_find8(const i64* __restrict__ keys, i64 n,
                                        const i64* __restrict__ tkeys,
                                        const unsigned char* __restrict__ dig, i64 nb, int B,
                                        i64 tick, i64* __restrict__ cnt, i64* __restrict__ last,
                                        i64* __restrict__ out_slot,
                                        bool* __restrict__ out_evict, i64* __restrict__ bucket,
                                        int* __restrict__ fill, int* __restrict__ items,
                                        i64* __restrict__ head, i64* __restrict__ next) {
    i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 3;
    int sub = threadIdx.x & 7;
    if (w >= n) return;
    i64 b;
    i64 s = probe_t<8>(keys[w], tkeys, dig, nb, B, sub, &b);
    if (sub != 0) return;
    if (s >= 0) {
        cnt[s] += 1;
        last[s] = tick;
        out_slot[w] = s;
        out_evict[w] = false;
        bucket[w] = -1;
    } else {
        bucket[w] = b;
        int r = atomicAdd(&fill[b], 1);
        if (r < FILL_CAP)
            items[b * FILL_CAP + r] = (int)w;
        else
            next[w] = (i64)atomicExch((unsigned long long*)&head[b], (unsigned long long)w);
    }
}

// insert_or_assign, second half: the warp of a bucket plans it as
// plan_linked does (misses in ascending position, the running call's rows
// protected), with its misses in registers (lanes hold items lane and
// lane + 32: the bucket's row of items, then its list), then installs each
// admitted key (key, digest, one access in call tick). A warp per bucket
// (by_bucket: for calls of about as many keys as buckets or more, where
// nearly every bucket has misses) or per key (the warps of keys that are not
// their bucket's first item return at once). A bucket of more than 64
// misses gets slot -2 for them (the caller plans them by sorting) and sets
// counters[2]; counters[16 + 16 * i] (i < 64, a warp's by its index)
// count the keys admitted and the admissions that evicted a key, packed:
// admitted | evicted << 32.
extern "C" __global__ void upsert_plan(const i64* __restrict__ bucket,
                                       const int* __restrict__ fill,
                                       const int* __restrict__ items,
                                       const i64* __restrict__ head,
                                       const i64* __restrict__ next, i64 m, int B,
                                       const i64* __restrict__ keys, i64 nb, i64 tick, int lru,
                                       i64* __restrict__ tkeys, unsigned char* __restrict__ dig,
                                       i64* __restrict__ cnt, i64* __restrict__ last,
                                       i64* __restrict__ out_slot, bool* __restrict__ out_evict,
                                       unsigned long long* __restrict__ counters, int by_bucket) {
    i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    i64 b;
    if (by_bucket) {
        if (w >= nb) return;
        b = w;
        if (fill[b] == 0) return;
    } else {
        if (w >= m) return;
        b = bucket[w];
        if (b < 0 || items[b * FILL_CAP] != (int)w) return;
    }
    int k = fill[b];
    if (k > LINK_CAP) {
        if (lane < FILL_CAP) out_slot[items[b * FILL_CAP + lane]] = -2;
        for (i64 j = head[b]; j >= 0; j = next[j])
            if (lane == 0) out_slot[j] = -2;
        if (lane == 0) counters[2] = 1;
        return;
    }
    i64 pa = lane < k && lane < FILL_CAP ? (i64)items[b * FILL_CAP + lane] : -1, pb = -1;
    if (k > FILL_CAP) {
        int e = FILL_CAP;
        for (i64 j = head[b]; j >= 0; j = next[j]) {
            if (e == lane) pa = j;
            if (e == lane + 32) pb = j;
            ++e;
        }
    }
    // The keys to install, read now, while the bucket's digests are read.
    i64 ka = pa >= 0 ? keys[pa] : 0, kb = pb >= 0 ? keys[pb] : 0;
    // Each item's rank by position (the order the misses are served in).
    int ra = 0, rb = 0;
    for (int e = 0; e < k; ++e) {
        i64 pe = __shfl_sync(FULL, e < 32 ? pa : pb, e & 31);
        ra += pe < pa;
        rb += pe < pb;
    }
    i64 base = b * (i64)B;
    unsigned emp[4];
    bool scored = empties(dig, base, B, lane, emp) < k;
    int cls[4]; i64 f[4]; i64 s[4];
    if (scored) load_scores(dig, cnt, last, base, B, lane, tick, lru, cls, f, s);
    i64 sa = -1, sb = -1;
    bool ea = false, eb = false, full = false;
    for (int r = 0; r < k; ++r) {
        bool ev = false;
        int bj;
        if (!scored) {
            bj = take_empty(emp);
        } else {
            bj = full ? -1 : take_best(cls, f, s, lane, &ev);
            full = bj < 0;
        }
        i64 sl = bj < 0 ? -1 : base + bj;
        if (pa >= 0 && ra == r) { sa = sl; ea = bj >= 0 && ev; }
        if (pb >= 0 && rb == r) { sb = sl; eb = bj >= 0 && ev; }
    }
    // The bucket's slots are all read: install.
    for (int h = 0; h < 2; ++h) {
        i64 p = h ? pb : pa, sl = h ? sb : sa;
        if (p < 0) continue;
        out_slot[p] = sl;
        out_evict[p] = h ? eb : ea;
        if (sl >= 0) {
            i64 kk = h ? kb : ka, bb;
            unsigned char d;
            place(kk, nb, &bb, &d);
            tkeys[sl] = kk;
            dig[sl] = d;
            cnt[sl] = 1;
            last[sl] = tick;
        }
    }
    unsigned ga = __ballot_sync(FULL, sa >= 0), gb = __ballot_sync(FULL, sb >= 0);
    unsigned va = __ballot_sync(FULL, ea), vb = __ballot_sync(FULL, eb);
    // One atomic a warp into one of 64 counters, 128 bytes apart, packed
    // (admitted | evicted << 32): a warp's two atomics on one address each
    // serialized the kernel.
    u64 mine = (u64)(__popc(ga) + __popc(gb)) | ((u64)(__popc(va) + __popc(vb)) << 32);
    if (lane == 0 && mine) atomicAdd(&counters[16 + 16 * (w & 63)], (unsigned long long)mine);
}

// dst[slots[i], :] = src[i, :] for slots[i] >= 0, by tiles of 8 lanes
// (float4 copies with vec); with flag_dst, flag_dst[slots[i]] = flag_src[i].
extern "C" __global__ void put_rows8(const i64* __restrict__ slots,
                                     const float* __restrict__ src, i64 n, int dim, int vec,
                                     float* __restrict__ dst, const bool* __restrict__ flag_src,
                                     bool* __restrict__ flag_dst) {
    i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 3;
    int sub = threadIdx.x & 7;
    if (w >= n) return;
    i64 s = slots[w];
    if (s < 0) return;
    copy_t<8>(dst + s * (i64)dim, src + w * (i64)dim, dim, vec, sub);
    if (flag_dst && sub == 0) flag_dst[s] = flag_src[w];
}

// A serving call's rows in one launch, by tiles of 8 lanes (ServingCache):
// tile w < n writes output row w, the cached row src[w] (src >= 0) or the
// sent miss row -1 - src[w], and with found its hit flag (true, or the
// miss's fm); tile n + t (t < na) copies sent miss row adm_row[t] (t where
// adm_row is null) into cached slot adm_slot[t]. No admitted slot is one a
// tile of the same call reads (the host's slot map protects them), so the
// reads and writes of the cached rows never meet.
extern "C" __global__ void serve_rows8(const int* __restrict__ src, i64 n, float* cache,
                                       const float* __restrict__ sent, int dim, int vec,
                                       float* __restrict__ out, const bool* __restrict__ fm,
                                       bool* __restrict__ found,
                                       const int* __restrict__ adm_slot,
                                       const int* __restrict__ adm_row, i64 na) {
    i64 w = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 3;
    int sub = threadIdx.x & 7;
    if (w < n) {
        int s = src[w];
        const float* from = s >= 0 ? cache + (i64)s * dim : sent + (i64)(-1 - s) * dim;
        copy_t<8>(out + w * (i64)dim, from, dim, vec, sub);
        if (found && sub == 0) found[w] = s >= 0 ? true : fm[-1 - s];
    } else if (w < n + na) {
        i64 t = w - n;
        i64 r = adm_row ? adm_row[t] : t;
        copy_t<8>(cache + (i64)adm_slot[t] * dim, sent + r * dim, dim, vec, sub);
    }
}

"""
)


def tile_for(dim: int) -> int:
    """Lanes a key for a find that copies rows of ``dim`` floats (0: slots
    only): each lane copies 4 float4 or more, so that a warp has many keys in
    flight (2 at dim 32, 4 at 64, 8 at 128 and up: the fastest on an H200,
    benches/HISTORY.md); 2 for slots alone (10.7 B keys/s there, against
    9.1 with 4 lanes and 7.0 with 8)."""
    if dim == 0:
        return 2
    return 2 if dim <= 32 else 4 if dim <= 64 else 8


class TileLaunchers:
    """The launchers of the tile kernels (mixed into ``_cuda.Kernels``,
    which compiles them and sets ``cp``, the ``_find_t``, ``_upsert_*`` and
    ``_put_rows8`` functions, ``tile`` and ``by_bucket``)."""

    cp: Any
    tile: int | None
    by_bucket: bool | None
    _find_t: dict[int, Any]
    _upsert_find8: Any
    _upsert_plan: Any
    _put_rows8: Any
    _serve_rows8: Any

    def _grid(self, threads: int) -> tuple[int]:
        return (max(1, (threads + _THREADS - 1) // _THREADS),)

    @staticmethod
    def _vec(*arrays: Array) -> int:
        """1 where float4 copies are safe: rows of a multiple of 4 floats,
        every array 16-byte aligned."""
        ok = all(int(a.shape[1]) % 4 == 0 and a.data.ptr % 16 == 0 for a in arrays)
        return 1 if ok else 0

    def find_tiles(
        self,
        keys: Array,
        tkeys: Array,
        dig: Array,
        buckets: int,
        width: int,
        out_slot: Array,
        rows: Array = None,
        out_rows: Array = None,
        touch: tuple[Array, Array, int] | None = None,
        miss: tuple[Array, Array] | None = None,
    ) -> None:
        """The ``find8`` kernel (``find4``, ``find2`` by :attr:`tile`): slots
        of ``keys`` (contiguous int64) into
        ``out_slot``; with ``rows``, their rows into ``out_rows``; with
        ``touch`` (count, last, tick), an access counted for each found
        slot; with ``miss`` (positions, count), the positions of the keys
        not found appended (their rows in ``out_rows`` left as they are)."""
        cp = self.cp
        n = int(keys.shape[0])
        null = cp.uint64(0)
        dim = int(rows.shape[1]) if rows is not None else 0
        vec = self._vec(rows, out_rows) if rows is not None else 0
        cnt, last, tick = touch if touch is not None else (null, null, 0)
        pos, npos = miss if miss is not None else (null, null)
        tile = self.tile or tile_for(dim)
        self._find_t[tile](
            self._grid(tile * n),
            (_THREADS,),
            (
                keys,
                cp.int64(n),
                tkeys,
                dig,
                cp.int64(buckets),
                cp.int32(width),
                null if rows is None else rows,
                cp.int32(dim),
                cp.int32(vec),
                out_slot,
                null if out_rows is None else out_rows,
                cnt,
                last,
                cp.int64(tick),
                pos,
                npos,
            ),
        )

    def upsert(
        self,
        keys: Array,
        values: Array,
        rows: Array,
        buckets: int,
        width: int,
        tick: int,
        lru: bool,
        arrays: tuple[Array, Array, Array, Array],
    ) -> tuple[Array, Array, int, int, bool]:
        """insert_or_assign of ``keys`` (distinct) with float32 ``values``
        into ``rows`` in three kernels (find and link, plan and install, rows),
        ``arrays`` being the index's (keys,
        digest, count, last): each key's slot (-1: none to give; -2: its
        bucket had over 64 misses and is left for the caller to plan), whether
        it evicted a key, the keys admitted, the evictions, and whether any
        bucket was left."""
        cp = self.cp
        tkeys, dig, cnt, last = arrays
        keys = cp.ascontiguousarray(keys, dtype=cp.int64)
        values = cp.ascontiguousarray(values, dtype=cp.float32)
        n = int(keys.shape[0])
        if n >= 2**31:
            raise ValueError(f"keys: at most 2**31 - 1 keys a call, got {n}")
        slot = cp.empty((n,), dtype=cp.int64)
        evict = cp.empty((n,), dtype=cp.bool_)
        bucket = cp.empty((n,), dtype=cp.int64)
        nxt = cp.empty((n,), dtype=cp.int64)
        head = cp.full((buckets,), -1, dtype=cp.int64)
        fill = cp.zeros((buckets,), dtype=cp.int32)
        items = cp.empty((buckets * FILL_CAP,), dtype=cp.int32)
        lists = (fill, items, head, nxt)
        counters = cp.zeros((16 + 16 * 64,), dtype=cp.uint64)
        nb, w, t = cp.int64(buckets), cp.int32(width), cp.int64(tick)
        self._upsert_find8(
            self._grid(8 * n),
            (_THREADS,),
            (keys, cp.int64(n), tkeys, dig, nb, w, t, cnt, last, slot, evict, bucket, *lists),
        )
        lru_ = cp.int32(1 if lru else 0)
        index = (tkeys, dig, cnt, last)
        by_bucket = n >= buckets // 2 if self.by_bucket is None else self.by_bucket
        out = (slot, evict, counters, cp.int32(1 if by_bucket else 0))
        self._upsert_plan(
            self._grid(32 * (buckets if by_bucket else n)),
            (_THREADS,),
            (bucket, *lists, cp.int64(n), w, keys, nb, t, lru_, *index, *out),
        )
        self.put8(rows, slot, values)
        c = counters.get()
        packed, left = int(c[16::16].sum()), int(c[2])
        got, ev = packed & 0xFFFFFFFF, packed >> 32
        return slot, evict, got, ev, bool(left)

    def put8(
        self, dst: Array, slots: Array, src: Array, flags: tuple[Array, Array] | None = None
    ) -> None:
        """``dst[slots[i]] = src[i]`` where ``slots[i] >= 0`` (float32 rows,
        ``src`` contiguous), by tiles of 8 lanes; with ``flags`` (src, dst
        bools), ``flags[1][slots[i]] = flags[0][i]`` too."""
        cp = self.cp
        n = int(slots.shape[0])
        if n == 0:
            return
        null = cp.uint64(0)
        fs, fd = flags if flags is not None else (null, null)
        self._put_rows8(
            self._grid(8 * n),
            (_THREADS,),
            (
                slots,
                src,
                cp.int64(n),
                cp.int32(int(dst.shape[1])),
                cp.int32(self._vec(src, dst)),
                dst,
                fs,
                fd,
            ),
        )

    def serve8(
        self,
        cache: Array,
        src: tuple[int, int],
        out: Array | None,
        sent: int,
        flags: tuple[int, Array] | None,
        admit: tuple[int, int, int],
    ) -> None:
        """The ``serve_rows8`` kernel, on device addresses of a call's sent
        arrays (``src`` (address, n) of int32; ``sent`` float32 rows of the
        cache's width, 16-byte aligned): ``out[i]`` = ``cache[src[i]]`` or
        ``sent[-1 - src[i]]``, with ``flags`` (the misses' found address,
        the output mask) the hit mask; then, ``admit`` being (slots, rows or
        0, count), ``cache[slots[t]] = sent[rows[t]]`` (``sent[t]`` where
        rows is 0)."""
        cp = self.cp
        src_p, n = src
        slot_p, row_p, na = admit
        if n + na == 0:
            return
        u64 = cp.uint64
        fm, found = flags if flags is not None else (0, None)
        dim = int(cache.shape[1])
        vec = self._vec(cache, *([out] if out is not None else [])) if dim % 4 == 0 else 0
        self._serve_rows8(
            self._grid(8 * (n + na)),
            (_THREADS,),
            (
                u64(src_p),
                cp.int64(n),
                cache,
                u64(sent),
                cp.int32(dim),
                cp.int32(vec),
                u64(0) if out is None else out,
                u64(fm),
                u64(0) if found is None else found,
                u64(slot_p),
                u64(row_p),
                cp.int64(na),
            ),
        )
