//! Planning a batch: keys grouped by shard (a stable counting sort), the
//! shard passes run in parallel or, for small batches, on the calling
//! thread, and the reservations that let a call apply whole or not at all.

use crate::error::{Result, invalid};
use crate::hash::{key_hash, shard_of};
use crate::table::checks::check_transient;
use crate::table::cold::hold::ColdHold;
use crate::table::storage::shard::Shard;
use crate::table::storage::view::View;
use crate::table::storage::write;
use crate::table::views::DiskTier;
use crate::table::{Table, read};
use crate::zeroed::zeros_huge;
use rayon::iter::{
    IndexedParallelIterator, IntoParallelIterator, IntoParallelRefIterator, ParallelExtend,
    ParallelIterator,
};
use rayon::prelude::ParallelSlice;

/// A batch's keys grouped by shard.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) hashes: Vec<u64>,
    /// Positions in the batch, grouped by shard, in batch order within a shard.
    pub(crate) order: Vec<u32>,
    /// `order[starts[s]..starts[s + 1]]` are shard `s`'s positions.
    pub(crate) starts: Vec<usize>,
}

impl Plan {
    pub(crate) fn positions(&self, s: usize) -> &[u32] {
        &self.order[self.starts[s]..self.starts[s + 1]]
    }

    /// The shard that owns every key, where one does (and there are keys).
    pub(crate) fn one_shard(&self) -> Option<usize> {
        let h = *self.hashes.first()?;
        let s = shard_of(h, self.starts.len() - 1);
        (self.positions(s).len() == self.hashes.len()).then_some(s)
    }
}

/// Batches of at most this many keys run their shard passes (lookups,
/// pooling, assign, remove) on the calling thread, visiting only the shards
/// they need, instead of dispatching a job per shard to the pool: below it
/// the dispatch (waking pool threads) costs more than the work it spreads
/// (measured with `cargo bench --bench small_lookup`; the figures are in
/// benches/HISTORY.md, "Small calls"); several Python threads making small
/// calls run them in parallel.
pub(crate) const SEQUENTIAL_KEYS: usize = 1024;

/// Bytes of rows written at which a write pass (an `assign`) moves to the
/// pool whatever its keys: [`SEQUENTIAL_KEYS`] rows of dim 64 with an Adam
/// state, so that wide rows (text embeddings of dim 768: 3 KiB a row,
/// most of it a fresh page's first write) spread from fewer keys.
pub(crate) const SEQUENTIAL_WRITE_BYTES: usize = SEQUENTIAL_KEYS * 768;

/// The keys at most which a pass writing `row_bytes` a key runs on the
/// calling thread.
pub(crate) fn sequential_writes(row_bytes: usize) -> usize {
    SEQUENTIAL_KEYS.min(SEQUENTIAL_WRITE_BYTES / row_bytes.max(1))
}

/// [`SEQUENTIAL_KEYS`] for the pass of an optimizer step, which does more
/// work per key, so that spreading it pays from fewer keys.
pub(crate) const SEQUENTIAL_STEP_KEYS: usize = 256;

/// Whether a call of `n` keys prefetches rows and keys ahead of their use:
/// only a call of more than `most` keys, whose rows are mostly out of
/// cache (`most` is the pass's [`SEQUENTIAL_KEYS`] or
/// [`SEQUENTIAL_STEP_KEYS`], so that prefetching starts where the pass
/// moves to the pool, or a lower [`COPY_PREFETCH_KEYS`] for a lookup's
/// copy). In a small call the prefetches cost more than they save; in a
/// call on the pool they save more than they cost (`cargo bench --bench
/// small_lookup`, figures in benches/HISTORY.md).
#[inline]
pub(crate) fn prefetches(n: usize, most: usize) -> bool {
    n > most
}

/// The most keys a lookup copies without prefetching rows: lower than
/// [`SEQUENTIAL_KEYS`], since a lookup of several hundred varied keys on the
/// calling thread reads rows that are out of cache: from a few hundred keys
/// on, prefetching rows took less time than not (benches/HISTORY.md).
pub(crate) const COPY_PREFETCH_KEYS: usize = 256;

/// How many rows ahead [`copy_rows`] prefetches.
pub(crate) const PREFETCH_AHEAD: usize = 8;

/// Batches of at least this many keys group their positions by shard in
/// parallel, in chunks of this many.
const PARALLEL_PLAN_KEYS: usize = 1 << 16;

/// A stable counting sort of the positions of `hashes` by shard: the
/// positions, and where each shard's start.
fn group_by_shard(hashes: &[u64], n_shards: usize) -> Result<(Vec<u32>, Vec<usize>)> {
    let mut counts = vec![0usize; n_shards + 1];
    for &h in hashes {
        counts[shard_of(h, n_shards) + 1] += 1;
    }
    for s in 0..n_shards {
        counts[s + 1] += counts[s];
    }
    let starts = counts.clone();
    let mut next = counts;
    let mut order = zeros_huge::<u32>("keys", hashes.len())?;
    for (i, &h) in hashes.iter().enumerate() {
        let slot = &mut next[shard_of(h, n_shards)];
        order[*slot] = i as u32;
        *slot += 1;
    }
    Ok((order, starts))
}

/// [`group_by_shard`] in parallel: each chunk of [`PARALLEL_PLAN_KEYS`]
/// positions counts its shards, and then writes its positions into its own
/// part of each shard's range (the parts lie in chunk order, so the sort
/// stays stable).
fn par_group_by_shard(hashes: &[u64], n_shards: usize) -> Result<(Vec<u32>, Vec<usize>)> {
    let counts: Vec<Vec<usize>> = hashes
        .par_chunks(PARALLEL_PLAN_KEYS)
        .map(|c| {
            let mut n = vec![0usize; n_shards];
            for &h in c {
                n[shard_of(h, n_shards)] += 1;
            }
            n
        })
        .collect();
    let mut starts = vec![0usize; n_shards + 1];
    for s in 0..n_shards {
        starts[s + 1] = starts[s] + counts.iter().map(|n| n[s]).sum::<usize>();
    }
    let mut order = zeros_huge::<u32>("keys", hashes.len())?;
    // parts[c][s]: chunk c's part of shard s's range.
    let mut parts: Vec<Vec<&mut [u32]>> = counts.iter().map(|_| Vec::new()).collect();
    let mut rest: &mut [u32] = &mut order;
    for s in 0..n_shards {
        for (c, n) in counts.iter().enumerate() {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(n[s]);
            parts[c].push(part);
            rest = tail;
        }
    }
    parts
        .into_par_iter()
        .zip(hashes.par_chunks(PARALLEL_PLAN_KEYS))
        .enumerate()
        .for_each(|(c, (mut parts, chunk))| {
            let mut next = vec![0usize; n_shards];
            let base = c * PARALLEL_PLAN_KEYS;
            for (j, &h) in chunk.iter().enumerate() {
                let s = shard_of(h, n_shards);
                parts[s][next[s]] = (base + j) as u32;
                next[s] += 1;
            }
        });
    Ok((order, starts))
}

/// What a call's plan asks of a disk table's floor ([`Table::plan`]; the
/// disk tier is `table::cold`). A table in memory has no floor: every
/// kind is the same plan there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Floor {
    /// The keys' rows on disk moved into memory for the call, its ids
    /// counted for the hit rate (lookups, assigns).
    Read,
    /// As [`Floor::Read`], the ids not counted (a gradient step, whose ids
    /// are those of the lookup it follows; a reshard's take).
    Step,
    /// Rows held where they are, in memory or on disk, for the call: the
    /// floor's gate only (`contains`).
    InPlace,
    /// No hold: the caller holds the floor already (a load, a move of
    /// rows to disk), or each shard's pass reads memory and disk together
    /// under its lock (a removal, an eviction).
    Skip,
}

/// A batch's plan with, for a disk table, the floor held for the call
/// ([`Table::plan`]): the keys' rows stay where the plan's kind put them
/// until it is dropped, and then memory gives back what it holds over its
/// bound. Keep `floor` alive for the whole call (destructure it into a
/// named binding, never `_`).
pub(crate) struct Planned<'a> {
    pub(crate) plan: Plan,
    pub(crate) floor: Option<ColdHold<'a>>,
}

impl std::ops::Deref for Planned<'_> {
    type Target = Plan;
    fn deref(&self) -> &Plan {
        &self.plan
    }
}

impl Table {
    /// Hashes `keys`, groups their positions by shard and, for a disk
    /// table, stands the call on the floor as `floor` asks: the one way a
    /// call gets a plan, so that no call reaches rows past the disk tier.
    ///
    /// # Errors
    /// `OutOfMemory` naming `keys` when its work arrays cannot be had; a
    /// disk table's: `Checkpoint` for a row on disk that cannot be read.
    pub(crate) fn plan(&self, keys: &[i64], floor: Floor) -> Result<Planned<'_>> {
        let plan = self.group(keys)?;
        DiskTier(self).stand(plan, keys, floor)
    }

    /// [`Table::plan`] of several tables' keys (`tables` in ascending id,
    /// the crate's lock order), each with the plan already `made` for it
    /// (a lookup's memo) or grouped here, in parallel (at least `min_len`
    /// tables a job); then each stands on its floor in that order, their
    /// holds joined into one (released together, before any of them moves
    /// rows to disk).
    ///
    /// # Errors
    /// As [`Table::plan`]; no floor is held then.
    pub(crate) fn plan_many<'a>(
        tables: &[(&'a Table, &[i64])],
        made: Vec<Option<Plan>>,
        floor: Floor,
        min_len: usize,
    ) -> Result<(Vec<Plan>, Option<ColdHold<'a>>)> {
        let grouped: Vec<Plan> = tables
            .par_iter()
            .zip(made)
            .with_min_len(min_len)
            .map(|((t, keys), made)| match made {
                Some(p) => Ok(p),
                None => t.group(keys),
            })
            .collect::<Result<_>>()?;
        let mut hold = ColdHold::none();
        let mut plans = Vec::with_capacity(tables.len());
        for ((t, keys), plan) in tables.iter().zip(grouped) {
            let Planned { plan, floor: f } = DiskTier(t).stand(plan, keys, floor)?;
            hold.join(f);
            plans.push(plan);
        }
        Ok((plans, hold.some()))
    }

    /// Hashes `keys` and groups their positions by shard (only
    /// [`Table::plan`] and [`Table::plan_many`] call it).
    fn group(&self, keys: &[i64]) -> Result<Plan> {
        let n_shards = self.shards.len();
        let mut hashes = crate::zeroed::with_room_huge::<u64>("keys", keys.len())?;
        if keys.len() < 1 << 14 {
            hashes.extend(keys.iter().map(|&k| key_hash(k)));
        } else {
            // Room is made: collecting in parallel does not reallocate.
            hashes.par_extend(keys.par_iter().with_min_len(1 << 14).map(|&k| key_hash(k)));
        }
        let (order, starts) = if keys.len() < PARALLEL_PLAN_KEYS {
            group_by_shard(&hashes, n_shards)?
        } else {
            par_group_by_shard(&hashes, n_shards)?
        };
        Ok(Plan {
            hashes,
            order,
            starts,
        })
    }

    /// Runs `f(shard, positions)` under each shard's write lock, in parallel,
    /// for the shards that own at least one of the plan's keys; sums results.
    pub(crate) fn par_shards_mut<F>(&self, plan: &Plan, f: F) -> usize
    where
        F: Fn(&mut Shard, &[u32]) -> usize + Sync,
    {
        self.par_shards_mut_below(plan, SEQUENTIAL_KEYS, f)
    }

    /// [`Table::par_shards_mut`] that runs on the calling thread for plans
    /// of at most `sequential` keys.
    pub(crate) fn par_shards_mut_below<F>(&self, plan: &Plan, sequential: usize, f: F) -> usize
    where
        F: Fn(&mut Shard, &[u32]) -> usize + Sync,
    {
        if plan.hashes.len() <= sequential {
            // A small call: on the calling thread, only the shards it needs.
            return (0..self.shards.len())
                .filter_map(|s| {
                    let pos = plan.positions(s);
                    (!pos.is_empty()).then(|| f(&mut write(&self.shards[s]), pos))
                })
                .sum();
        }
        self.shards
            .par_iter()
            .enumerate()
            .map(|(s, lock)| {
                let pos = plan.positions(s);
                if pos.is_empty() {
                    0
                } else {
                    f(&mut write(lock), pos)
                }
            })
            .sum()
    }

    /// As [`Self::par_shards_mut`], under read locks.
    pub(crate) fn par_shards<F>(&self, plan: &Plan, f: F)
    where
        F: Fn(&Shard, &[u32]) + Sync,
    {
        if plan.hashes.len() <= SEQUENTIAL_KEYS {
            // A small call: on the calling thread, only the shards it needs.
            for (s, lock) in self.shards.iter().enumerate() {
                let pos = plan.positions(s);
                if !pos.is_empty() {
                    f(&read(lock), pos);
                }
            }
            return;
        }
        self.shards.par_iter().enumerate().for_each(|(s, lock)| {
            let pos = plan.positions(s);
            if !pos.is_empty() {
                f(&read(lock), pos);
            }
        });
    }

    /// Runs `f(view, guard, positions)` on each shard's readers' view, with
    /// no lock, pinned to the epoch, in parallel (on the calling thread for
    /// small plans), for the shards that own at least one of the plan's
    /// keys.
    pub(crate) fn par_views<F>(&self, plan: &Plan, f: F)
    where
        F: Fn(&View, &crossbeam_epoch::Guard, &[u32]) + Sync,
    {
        if plan.hashes.len() <= SEQUENTIAL_KEYS {
            let guard = crossbeam_epoch::pin();
            for (s, view) in self.views.iter().enumerate() {
                let pos = plan.positions(s);
                if !pos.is_empty() {
                    f(view, &guard, pos);
                }
            }
            return;
        }
        self.views.par_iter().enumerate().for_each(|(s, view)| {
            let pos = plan.positions(s);
            if !pos.is_empty() {
                f(view, &crossbeam_epoch::pin(), pos);
            }
        });
    }

    pub(crate) fn check_batch(keys: &[i64]) -> Result<()> {
        if keys.len() > u32::MAX as usize {
            return Err(invalid(
                "keys",
                format!(
                    "expected at most 2^32 - 1 keys per call, got {}",
                    keys.len()
                ),
            ));
        }
        check_transient("keys", keys.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::shard_of;
    use crate::table::Table;
    use crate::testing::table;
    use std::sync::atomic::Ordering;

    #[test]
    fn a_plan_lists_every_position_once_in_its_shard_in_order() {
        let t = table(2, 8, None);
        let keys: Vec<i64> = (0..500).map(|k| k * 7919 - 1000).collect();
        let plan = t
            .plan(&keys, crate::table::batch::plan::Floor::Read)
            .unwrap();
        let mut seen = vec![0u32; keys.len()];
        for s in 0..t.num_shards() {
            let pos = plan.positions(s);
            assert!(
                pos.windows(2).all(|w| w[0] < w[1]),
                "stable order in shard {s}"
            );
            for &p in pos {
                assert_eq!(shard_of(plan.hashes[p as usize], t.num_shards()), s);
                seen[p as usize] += 1;
            }
        }
        assert!(seen.iter().all(|&c| c == 1));
    }

    #[test]
    fn the_parallel_grouping_is_the_sequential_counting_sort() {
        // Several chunks, the last one partial, skewed shards, 1 to 64 shards.
        let n = 3 * PARALLEL_PLAN_KEYS + 12_345;
        let hashes: Vec<u64> = (0..n as u64)
            .map(|i| crate::hash::key_hash((i * i % 100_003) as i64))
            .collect();
        for shards in [1, 3, 8, 64] {
            let par = par_group_by_shard(&hashes, shards).unwrap();
            assert_eq!(
                par,
                group_by_shard(&hashes, shards).unwrap(),
                "{shards} shards"
            );
            assert_eq!(par.1[shards], n);
        }
    }

    #[test]
    fn small_batches_run_on_the_calling_thread() {
        let t = table(2, 8, None);
        let me = std::thread::current().id();
        let keys: Vec<i64> = (0..SEQUENTIAL_KEYS as i64).collect();
        let plan = t
            .plan(&keys, crate::table::batch::plan::Floor::Read)
            .unwrap();
        let off_thread = std::sync::atomic::AtomicUsize::new(0);
        let visited = t.par_shards_mut_below(&plan, SEQUENTIAL_KEYS, |_, pos| {
            if std::thread::current().id() != me {
                off_thread.fetch_add(1, Ordering::Relaxed);
            }
            pos.len()
        });
        assert_eq!(visited, keys.len());
        assert_eq!(off_thread.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn batches_of_more_than_u32_positions_are_refused() {
        assert!(Table::check_batch(&[1, 2, 3]).is_ok());
    }
}
