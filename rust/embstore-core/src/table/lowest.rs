//! The rows a capacity eviction takes next, kept between calls.
//!
//! Evicting the lowest-scoring rows means scoring every row: a full cache
//! that inserts one row a call paid a scan of the whole table for each (a
//! one-row `assign` of dim 768 took 68 us at 10,700 rows and 160 us at
//! 42,800, machine E). A scan now keeps, past the rows it evicts, the next
//! lowest-scoring ones (a 16th of the table) with their scores and the
//! highest of them, the bar; later evictions take rows from them, in
//! score order, until they run out, and only then scan again.
//!
//! The rows kept are still the lowest because scores only rise: a touch
//! adds to a row's count and moves its last touch forward
//! ([`Meta::touch`](crate::policy::Meta::touch)), so every row not kept
//! scores above the bar for good, and a kept row whose score rose is
//! scored again when it comes up (kept at its new score while below the
//! bar, dropped above it). A row created after the scan records a later
//! call's tick: under LRU (tick first) it scores above the bar; under LFU
//! (count first) it does when the bar's count is at most one, so an LFU
//! scan keeps only rows touched at most once. Whatever sets a row's
//! metadata directly (a `restore` or load, a disk table's moves) breaks
//! that, and forgets the rows kept ([`Evictor::forget_lowest`]); a disk
//! table keeps none. Calls running at the same time may see the order of
//! the moment each looked, as a full scan may.
//!
//! A scan holds, per shard, at most about twice what it keeps of the
//! shard (never every row's score at once: [`lowest_of`]), and without the
//! memory for that evicts nothing rather than abort; without the memory
//! for the rows to keep it keeps none.

use crate::hash::{key_hash, shard_of};
use crate::policy::Eviction;
use crate::table::storage::read;
use crate::table::views::Evictor;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::PoisonError;

/// An eviction's sort key ([`Eviction::score`]): smaller goes first.
pub(crate) type Score = (u64, u64, i64);

/// A scan keeps the next lowest rows up to this share of the table (one
/// in this many rows).
const KEEP_SHARE: usize = 16;

/// An eviction of more rows than this scans (taking many rows one at a
/// time from the kept ones costs more than a parallel scan).
const MOST_TAKEN: usize = 1024;

/// The next rows to evict, by their score when last seen, and the bar:
/// every row not kept scores above it.
#[derive(Debug)]
pub(crate) struct Lowest {
    heap: BinaryHeap<Reverse<Score>>,
    bar: Score,
}

impl Lowest {
    /// From a scan's lowest rows past those it evicts (`rest`, ascending):
    /// under LFU only those touched at most once. `None` when none is kept
    /// (or the memory for them is not there).
    fn new(ev: Eviction, rest: &[Score]) -> Option<Lowest> {
        let keep = match ev {
            Eviction::Lru => rest.len(),
            Eviction::Lfu => rest.partition_point(|s| s.0 <= 1),
        };
        let bar = *rest[..keep].last()?;
        let mut v = Vec::new();
        v.try_reserve_exact(keep).ok()?;
        v.extend(rest[..keep].iter().map(|&s| Reverse(s)));
        Some(Lowest {
            heap: BinaryHeap::from(v),
            bar,
        })
    }

    /// Bytes held (counted in the table's bytes).
    pub(crate) fn bytes(&self) -> usize {
        self.heap.capacity() * size_of::<Reverse<Score>>()
    }
}

/// The scores of a scan go through a buffer of this many at least, cut
/// down to the lowest `keep` whenever it fills.
const SCAN_CHUNK: usize = 1 << 16;

/// The `keep` lowest of `scores` (about `total` of them; in no order),
/// holding at most about twice `keep` (or [`SCAN_CHUNK`]) of them at a
/// time rather than every score (a scan of 100M rows would take 2.4 GB at
/// once); `None` when the memory for that is not there.
pub(crate) fn lowest_of(
    scores: impl Iterator<Item = Score>,
    total: usize,
    keep: usize,
) -> Option<Vec<Score>> {
    lowest_in_chunks(scores, total, keep, SCAN_CHUNK)
}

/// [`lowest_of`] with a buffer of at least `chunk` scores.
fn lowest_in_chunks(
    scores: impl Iterator<Item = Score>,
    total: usize,
    keep: usize,
    chunk: usize,
) -> Option<Vec<Score>> {
    let room = keep.saturating_mul(2).max(chunk).min(total);
    let mut v: Vec<Score> = Vec::new();
    v.try_reserve_exact(room).ok()?;
    let cut = |v: &mut Vec<Score>| {
        if v.len() > keep {
            v.select_nth_unstable(keep);
            v.truncate(keep);
        }
    };
    for s in scores {
        if v.len() == v.capacity() {
            cut(&mut v);
            if v.len() == v.capacity() {
                // Every score kept so far is among the lowest (`keep` at
                // least the room): more room, fallibly.
                v.try_reserve(v.len().max(1)).ok()?;
            }
        }
        v.push(s);
    }
    cut(&mut v);
    Some(v)
}

/// The lowest rows of the table from each shard's lowest (`(scores,
/// all)`: `all` when they are every row of the shard): those at or below
/// the bar, the lowest of the highest score each shard kept without
/// keeping all its rows, so that every row left out scores above it. Each
/// shard kept at least the `k` a scan evicts (or all its rows), so the
/// table's lowest `k` are among them. `None` without the memory.
pub(crate) fn merge_lowest(per_shard: Vec<(Vec<Score>, bool)>) -> Option<Vec<Score>> {
    let bar = per_shard
        .iter()
        .filter(|(v, all)| !all && !v.is_empty())
        .filter_map(|(v, _)| v.iter().max())
        .min()
        .copied();
    let total: usize = per_shard.iter().map(|(v, _)| v.len()).sum();
    let mut out = Vec::new();
    out.try_reserve_exact(total).ok()?;
    for (v, _) in per_shard {
        out.extend(v.into_iter().filter(|s| bar.is_none_or(|b| *s <= b)));
    }
    Some(out)
}

impl<'a> Evictor<'a> {
    /// How many of the next lowest rows a scan of `len` rows that evicts
    /// `k` keeps past them.
    pub(crate) fn lowest_to_keep(&self, len: usize, k: usize) -> usize {
        if self.cold.is_some() || k > MOST_TAKEN {
            0
        } else {
            len / KEEP_SHARE
        }
    }

    /// Keeps `rest` (a scan's next lowest rows, ascending) for later
    /// evictions.
    pub(crate) fn keep_lowest(&self, rest: &[Score]) {
        let kept = Lowest::new(self.policy.eviction, rest);
        *self.lowest.lock().unwrap_or_else(PoisonError::into_inner) = kept;
    }

    /// Forgets the rows kept: for a call that sets rows' metadata directly.
    pub(crate) fn forget_lowest(&self) {
        self.lowest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }

    /// The `k` lowest-scoring rows' keys, from the rows kept by a scan;
    /// `None` when they cannot tell (none kept, too few, or `k` large): the
    /// caller scans.
    pub(crate) fn lowest_kept(&self, k: usize) -> Option<Vec<i64>> {
        if k > MOST_TAKEN {
            return None;
        }
        // Taken out of its lock (a leaf lock) while the shards are read; a
        // call meanwhile finds none kept and scans.
        let mut kept = self
            .lowest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()?;
        let ev = self.policy.eviction;
        let n = self.shards.len();
        let mut out = Vec::with_capacity(k);
        while out.len() < k {
            let Reverse(was) = kept.heap.pop()?;
            let key = was.2;
            let hash = key_hash(key);
            let now = {
                let g = read(&self.shards[shard_of(hash, n)]);
                g.find(key, hash).map(|r| ev.score(&g.meta(r), key))
            };
            match now {
                // No kept row scores below its last seen score, and every
                // other row scores above the bar: this is the lowest.
                Some(s) if s == was => out.push(key),
                Some(s) if s <= kept.bar => kept.heap.push(Reverse(s)),
                // Gone, or now above the bar: one of the other rows.
                _ => {}
            }
        }
        *self.lowest.lock().unwrap_or_else(PoisonError::into_inner) = Some(kept);
        Some(out)
    }

    /// Bytes of the rows kept.
    pub(crate) fn lowest_bytes(&self) -> usize {
        self.lowest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, Lowest::bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::{Score, lowest_in_chunks, merge_lowest};
    use crate::policy::{Eviction, Meta};
    use crate::table::{Table, TableConfig};

    #[test]
    fn merged_lowest_stop_where_a_shard_left_lower_rows_out() {
        let shard = |from: i64, to: i64| -> Vec<Score> { (from..to).map(|i| (0, 0, i)).collect() };
        let kept = |v: &[Score], keep: usize| v[..keep.min(v.len())].to_vec();
        // Shard a holds every lower score: its rows past the ten it kept
        // score below all of shard b's, so none of b's may be kept.
        let (a, b) = (shard(0, 100), shard(100, 200));
        let mut got = merge_lowest(vec![(kept(&a, 10), false), (kept(&b, 10), false)]).unwrap();
        got.sort_unstable();
        assert_eq!(got, shard(0, 10));
        // A shard that kept all its rows sets no bar.
        let c = shard(500, 503);
        let mut got = merge_lowest(vec![(kept(&a, 10), false), (c.clone(), true)]).unwrap();
        got.sort_unstable();
        assert_eq!(got, shard(0, 10));
        let mut got = merge_lowest(vec![(c.clone(), true), (shard(600, 601), true)]).unwrap();
        got.sort_unstable();
        assert_eq!(got, [c, shard(600, 601)].concat());
    }

    #[test]
    fn the_lowest_in_chunks_are_a_full_sorts_first() {
        let scores: Vec<Score> = (0..1000u64)
            .map(|i| (crate::hash::draw(3, i) % 50, i % 7, i as i64))
            .collect();
        let mut sorted = scores.clone();
        sorted.sort_unstable();
        for keep in [0, 1, 5, 64, 999, 1000, 2000] {
            for chunk in [1, 7, 100, 1 << 16] {
                let mut got = lowest_in_chunks(scores.iter().copied(), 1000, keep, chunk).unwrap();
                got.sort_unstable();
                assert_eq!(got, sorted[..keep.min(1000)], "keep {keep} chunk {chunk}");
            }
        }
    }

    fn present(t: &Table, key: i64) -> bool {
        let mut out = [false];
        t.contains(&[key], &mut out).unwrap();
        out[0]
    }

    #[test]
    fn a_restored_row_that_scores_lowest_goes_first() {
        let mut cfg = TableConfig::new(2);
        cfg.num_shards = Some(2);
        cfg.policy.capacity = Some(640);
        cfg.policy.eviction = Eviction::Lru;
        let t = Table::new(cfg).unwrap();
        let row = [1.0f32, 2.0];
        // 641 keys, one a call: the last insert scans and keeps 40 rows.
        for k in 0..641 {
            t.assign(&[k], &row).unwrap();
        }
        assert!(!present(&t, 0));
        assert!(t.lowest.lock().unwrap().is_some(), "the scan kept rows");
        // A row restored as last touched at tick 0 scores below every row
        // kept: the next eviction must take it, not the oldest kept row.
        let meta = Meta {
            tick: 0,
            step: 0,
            count: 1,
        };
        t.restore(&[10_000], &row, None, Some(&meta.to_words()), 0)
            .unwrap();
        assert!(!present(&t, 10_000), "the restored row is the lowest");
        assert!(present(&t, 1));
        t.assign(&[10_001], &row).unwrap();
        assert!(!present(&t, 1), "then the oldest row");
        assert!(present(&t, 2));
    }
}
