//! The pooling pass of a pooled lookup ([`Pooler::lookup_pooled_in`]): bags
//! pooled in parallel in chunks of whole bags, each job holding the read
//! locks of its shards and summing each bag's rows straight from them.

use crate::Bags;
use crate::hash::shard_of;
use crate::policy::RowFormat;
use crate::simd::prefetch_addr;
use crate::table::batch::output::SharedOut;
use crate::table::batch::plan::{COPY_PREFETCH_KEYS, SEQUENTIAL_KEYS, prefetches};
use crate::table::counters::Counters;
use crate::table::storage::shard::Shard;
use crate::table::storage::view::{Probed, View, copy_racy, racy};
use crate::table::views::Pooler;
use crate::table::{Missing, NO_ROW, read};
use rayon::iter::{IntoParallelIterator, ParallelIterator};
use std::ops::Range;
use std::sync::RwLockReadGuard;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

/// Ids of one job of a pooled lookup's pooling pass
/// ([`Pooler::lookup_pooled_in`]): whole bags of about this many ids, so
/// that taking the job's shard read locks costs little against its work.
pub(crate) const POOL_CHUNK_IDS: usize = 4096;

/// Shard read locks a pooling pass holds ([`Pooler::hold`]): per shard, its
/// guard if the pass reads it, and whether it removed rows since the lookup
/// pass found them (its ids are then probed again).
pub(crate) struct Held<'t> {
    guards: Vec<Option<RwLockReadGuard<'t, Shard>>>,
    stale: Vec<bool>,
}

/// What every pooling job of one [`Pooler::lookup_pooled_in`] shares.
pub(crate) struct Pooling<'a> {
    /// The call's ids (all its features', back to back) and their hashes.
    pub(crate) ids: &'a [i64],
    pub(crate) hashes: &'a [u64],
    /// Each id's row as the lookup pass found it (`NO_ROW`: none), stored
    /// by that pass's shard jobs.
    pub(crate) row_of: &'a [AtomicU32],
    /// Each shard's removal count when the lookup pass found its rows.
    pub(crate) removals: &'a [u64],
    /// Each id's coefficient in its bag.
    pub(crate) coef: &'a [f32],
    pub(crate) missing: Missing<'a>,
    /// Set where pooling overflowed float32.
    pub(crate) overflow: &'a AtomicBool,
}

/// How many ids ahead a pooling pass prefetches the first cache line of
/// a row (the CPU's own prefetchers fetch the lines after it as the row
/// is read): faster at every bag length than prefetching every line of the
/// row 8 ids ahead (`cargo bench --bench pooled_gather`; figures in
/// benches/HISTORY.md). A likely reason: random rows of a large table miss
/// the TLB as well as the cache, and fewer prefetches a row queue fewer
/// page walks.
pub(crate) const POOL_PREFETCH_AHEAD: usize = 16;

impl<'a> Pooler<'a> {
    /// Pools the bags of one feature (its ids start at `base` of the
    /// call's ids) into `out`, in parallel over chunks of bags, each job
    /// holding its own shard read locks; see [`Pooler::lookup_pooled_in`].
    pub(crate) fn pool_bags(
        &self,
        bags: &Bags<'_>,
        base: usize,
        pool: &Pooling<'_>,
        out: SharedOut,
    ) {
        let batch = bags.batch();
        let per_bag = (bags.ids.len() / batch.max(1)).max(1);
        let chunk = (POOL_CHUNK_IDS / per_bag).max(1);
        (0..batch.div_ceil(chunk)).into_par_iter().for_each(|c| {
            let range = c * chunk..((c + 1) * chunk).min(batch);
            let ids =
                bags.offsets[range.start] as usize + base..bags.offsets[range.end] as usize + base;
            let held = self.hold(pool, ids);
            self.pool_chunk(bags, base, range, pool, out, &held);
        });
    }

    /// The read locks of the shards that the call's ids `ids` live in,
    /// taken in index order, and which of them removed rows since the
    /// lookup pass.
    pub(crate) fn hold(&self, pool: &Pooling<'_>, ids: Range<usize>) -> Held<'a> {
        let ns = self.shards.len();
        let mut need = vec![false; ns];
        for &h in &pool.hashes[ids] {
            need[shard_of(h, ns)] = true;
        }
        let guards: Vec<Option<RwLockReadGuard<'a, Shard>>> = need
            .iter()
            .zip(self.0.shards.iter())
            .map(|(&need, lock)| need.then(|| read(lock)))
            .collect();
        let stale = guards
            .iter()
            .zip(pool.removals)
            .map(|(g, &r)| g.as_ref().is_some_and(|g| g.removals != r))
            .collect();
        Held { guards, stale }
    }

    /// Pools bags `range` of one feature (ids from `base` of the call's)
    /// under `held`, the read locks of the shards their ids live in.
    pub(crate) fn pool_chunk(
        &self,
        bags: &Bags<'_>,
        base: usize,
        range: Range<usize>,
        pool: &Pooling<'_>,
        out: SharedOut,
        held: &Held<'_>,
    ) {
        let (dim, ns) = (self.dim, self.shards.len());
        if range.is_empty() {
            return;
        }
        let end = bags.offsets[range.end] as usize + base;
        let Held { guards, stale } = held;
        // The row of position i in its (locked) shard, or NO_ROW.
        let locate = |i: usize| -> (&Shard, u32) {
            let s = shard_of(pool.hashes[i], ns);
            let g = guards[s]
                .as_deref()
                .expect("every shard of the chunk's ids is locked");
            let r = if stale[s] {
                g.find(pool.ids[i], pool.hashes[i])
                    .map_or(NO_ROW, |r| r as u32)
            } else {
                pool.row_of[i].load(Ordering::Relaxed)
            };
            (g, r)
        };
        // First each id's row (None: not held), then the sums: the summing
        // loop, bound by row fetches, runs no bookkeeping between them.
        let start = bags.offsets[range.start] as usize + base;
        let rows: Vec<Option<&[f32]>> = (start..end)
            .map(|i| {
                let (g, r) = locate(i);
                (r != NO_ROW).then(|| g.weights(r as usize))
            })
            .collect();
        // From as few ids as a lookup's copy prefetches (COPY_PREFETCH_KEYS):
        // a call's ids vary, and their rows are out of cache. Training
        // pooled lookups of 1,024 varied ids in bags of 4, 100k-row table:
        // 57-61 us against 98 when only calls past SEQUENTIAL_KEYS
        // prefetched (benches/RESULTS.md, 2026-11-28).
        let ahead = prefetches(pool.ids.len(), COPY_PREFETCH_KEYS);
        self.sum_bags(bags, base, range, pool, out, |i, tmp| {
            if ahead && let Some(Some(r)) = rows.get(i + POOL_PREFETCH_AHEAD - start) {
                prefetch_addr(r.as_ptr() as usize);
            }
            match rows[i - start] {
                Some(r) if self.policy.format == RowFormat::F32 => Some(&r[..dim]),
                Some(r) => {
                    self.read_weights(r, tmp);
                    None
                }
                None => {
                    self.fill_missing(pool.ids[i], tmp, pool.missing);
                    None
                }
            }
        });
    }

    /// Sums each bag of `range` (ids from `base` of the call's) into its
    /// output row, each id's row times its coefficient: `row(i, tmp)` gives
    /// id `i`'s row (asked once per id, in order), as a slice, or `None`
    /// when it wrote the row into `tmp`. A sum that is not finite sets
    /// `pool.overflow`; an empty bag is zeros.
    fn sum_bags<'r>(
        &self,
        bags: &Bags<'_>,
        base: usize,
        range: Range<usize>,
        pool: &Pooling<'_>,
        out: SharedOut,
        mut row: impl FnMut(usize, &mut [f32]) -> Option<&'r [f32]>,
    ) {
        let dim = self.dim;
        let mut tmp = vec![0.0f32; dim];
        // Plain stores into the output at any size: non-temporal ones (a
        // bag summed in cache and streamed out, for outputs past 8 MiB until
        // 2026-11-27) made a Collection's forward 1.4x slower on an Intel
        // Xeon VM (170 against 121 ms, 26 bags of one id of 65,536).
        for b in range {
            let ids = bags.range(b);
            let (lo, hi) = (ids.start + base, ids.end + base);
            // SAFETY: each bag's output row is written by this chunk only.
            let d: &mut [f32] = unsafe { out.row(b, dim) };
            for i in lo..hi {
                let got = row(i, &mut tmp);
                let x = got.unwrap_or(&tmp[..]);
                let c = pool.coef[i];
                if i > lo {
                    self.backend.axpy(d, c, x);
                } else {
                    d.copy_from_slice(x);
                    if c != 1.0 {
                        self.backend.scale(d, c);
                    }
                }
            }
            if lo == hi {
                d.fill(0.0);
            } else if (hi - lo > 1 || pool.coef[lo] != 1.0) && !all_finite(d) {
                // A copied row is finite already; a scaled or summed one
                // is checked while it is in cache.
                pool.overflow.store(true, Ordering::Relaxed);
            }
        }
    }
}

impl<'a> Pooler<'a> {
    /// The pooling of a serving pooled lookup (no insert, no touches to
    /// record), taking no lock and waiting for no writer
    /// (`storage::seqlock`): in parallel over chunks of whole bags (on the
    /// calling thread for a small call), each chunk probes its ids, then
    /// sums each bag from whole copies of its rows.
    pub(crate) fn serve_pooled(
        &self,
        feats: &[(Bags<'_>, usize)],
        pool: &Pooling<'_>,
        out: SharedOut,
    ) {
        let n = pool.ids.len();
        let mut base = 0usize;
        for (bags, col) in feats {
            let out = out.with_col(*col);
            let batch = bags.batch();
            if n <= SEQUENTIAL_KEYS {
                self.serve_chunk(bags, base, 0..batch, pool, out);
            } else {
                let per_bag = (bags.ids.len() / batch.max(1)).max(1);
                let chunk = (POOL_CHUNK_IDS / per_bag).max(1);
                (0..batch.div_ceil(chunk)).into_par_iter().for_each(|c| {
                    let range = c * chunk..((c + 1) * chunk).min(batch);
                    self.serve_chunk(bags, base, range, pool, out);
                });
            }
            base += bags.ids.len();
        }
    }

    /// Pools bags `range` of one feature (ids from `base` of the call's)
    /// without a lock; see [`Pooler::serve_pooled`].
    fn serve_chunk(
        &self,
        bags: &Bags<'_>,
        base: usize,
        range: Range<usize>,
        pool: &Pooling<'_>,
        out: SharedOut,
    ) {
        let (ww, ns) = (self.wwords, self.shards.len());
        if range.is_empty() {
            return;
        }
        let guard = crossbeam_epoch::pin();
        let start = bags.offsets[range.start] as usize + base;
        let end = bags.offsets[range.end] as usize + base;
        let mut slots = vec![None; ns];
        for (s, view) in self.views.iter().enumerate() {
            slots[s] = view.slots(&guard);
        }
        // First each id's (slot, row), the index lines of ids ahead
        // prefetched (from COPY_PREFETCH_KEYS ids, as in `pool_chunk`); then
        // the sums.
        let ahead = prefetches(pool.ids.len(), COPY_PREFETCH_KEYS);
        let probes: Vec<Probed> = (start..end)
            .map(|i| {
                if ahead
                    && let Some(&h) = pool.hashes.get(i + POOL_PREFETCH_AHEAD)
                    && let Some(sl) = slots[shard_of(h, ns)]
                {
                    sl.prefetch(h);
                }
                let s = shard_of(pool.hashes[i], ns);
                slots[s].map_or(Probed::ABSENT, |sl| {
                    View::probe(sl, pool.ids[i], pool.hashes[i])
                })
            })
            .collect();
        let format = self.policy.format;
        self.sum_bags(bags, base, range, pool, out, |i, tmp| {
            if ahead
                && let Some(p) = probes.get(i + POOL_PREFETCH_AHEAD - start)
                && p.row() != NO_ROW
                && let Some(h) = pool.hashes.get(i + POOL_PREFETCH_AHEAD)
            {
                // Every line of the row: the copy below reads them at once
                // (a seqlock copy, not a running sum). The first line alone,
                // as `pool_chunk` asks for, made 1,024 varied ids of a
                // 1M-row table 1.4-1.7x slower (138-172 against 88-100 us).
                self.views[shard_of(*h, ns)].prefetch_row_whole(p.row() as usize, &guard);
            }
            let s = shard_of(pool.hashes[i], ns);
            let held = match slots[s] {
                Some(sl) => self.views[s].fetch(
                    &guard,
                    sl,
                    probes[i - start],
                    pool.ids[i],
                    pool.hashes[i],
                    |w, _| match format {
                        // SAFETY: the row's floats in its pinned segment,
                        // copied inside the seqlock check (`racy`).
                        RowFormat::F32 => unsafe { copy_racy(tmp, w) },
                        // SAFETY: as above.
                        f => f.decode_on(self.backend, unsafe { racy(w, ww) }, tmp),
                    },
                ),
                None => false,
            };
            if !held {
                self.fill_missing(pool.ids[i], tmp, pool.missing);
            }
            None
        });
        let mut hits = vec![0usize; ns];
        let mut looked = vec![0usize; ns];
        for (i, p) in (start..end).zip(&probes) {
            let s = shard_of(pool.hashes[i], ns);
            looked[s] += 1;
            hits[s] += usize::from(p.row() != NO_ROW);
        }
        for (s, view) in self.views.iter().enumerate() {
            if looked[s] > 0 {
                let c = &view.counters;
                Counters::add(&c.lookups, looked[s]);
                Counters::add(&c.hits, hits[s]);
                Counters::add(&c.misses, looked[s] - hits[s]);
            }
        }
    }
}

/// Whether every value of `v` is finite (a branch-free scan that vectorizes).
#[inline]
pub(crate) fn all_finite(v: &[f32]) -> bool {
    v.iter()
        .fold(0u32, |acc, x| acc.max(x.to_bits() & 0x7FFF_FFFF))
        < 0x7F80_0000
}
