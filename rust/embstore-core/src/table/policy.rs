//! Eviction: TTL and capacity (LFU / LRU), after calls and on demand.

use crate::policy::Meta;
use crate::table::batch::output::{SharedBools, SharedOut};
use crate::table::batch::plan::Floor;
use crate::table::counters::Counters;
use crate::table::lowest::{Score, lowest_of, merge_lowest};
use crate::table::views::DiskTier;
use crate::table::views::Evictor;
use crate::table::{Table, read};
use rayon::iter::{IntoParallelRefIterator, ParallelIterator};

impl Table {
    /// Runs the eviction policy now: removes the rows not touched for
    /// `ttl_steps` optimizer steps (or more than `ttl_seconds` seconds),
    /// then, above the capacity (`capacity`, `capacity_bytes`), the
    /// lowest-scoring rows. Returns the evicted keys ascending and, with
    /// `with_rows`, their weights (`n * dim`) for archiving.
    pub fn evict(&self, with_rows: bool) -> (Vec<i64>, Vec<f32>) {
        let _floor = DiskTier(self).rows_in_place();
        let _gate = self.enter();
        let mut keys = Vec::new();
        let mut rows = Vec::new();
        if self.policy.ttl_steps.is_some() || self.policy.ttl_seconds.is_some() {
            self.count_queued_reads();
            let policy = &self.policy;
            let now = policy.age_clock(self.step());
            let expired: Vec<i64> = self
                .shards
                .par_iter()
                .flat_map_iter(|lock| {
                    let g = read(lock);
                    let on_disk = g.cold.iter().flat_map(|c| c.metas());
                    g.keys_and_rows()
                        .filter(|&(_, r)| policy.expired(&g.meta(r), now))
                        .map(|(key, _)| key)
                        .chain(
                            on_disk
                                .filter(|(_, w)| policy.expired(&Meta::from_words(w), now))
                                .map(|(key, _)| key),
                        )
                        .collect::<Vec<_>>()
                })
                .collect();
            (keys, rows) = Evictor(self).remove_evicted(&expired, with_rows);
        }
        if let Some(cap) = self.capacity {
            let len = self.len();
            if len > cap {
                let (k2, r2) = Evictor(self).evict_lowest(len - cap, with_rows);
                keys.extend(k2);
                rows.extend(r2);
            }
        }
        let dim = self.dim;
        let mut order: Vec<usize> = (0..keys.len()).collect();
        order.sort_unstable_by_key(|&i| keys[i]);
        let sorted_keys = order.iter().map(|&i| keys[i]).collect();
        let sorted_rows = if with_rows {
            order
                .iter()
                .flat_map(|&i| rows[i * dim..(i + 1) * dim].iter().copied())
                .collect()
        } else {
            Vec::new()
        };
        (sorted_keys, sorted_rows)
    }
}

impl<'a> Evictor<'a> {
    /// After a call that inserted: evicts the lowest-scoring rows until at
    /// most `capacity` remain. The caller holds the gate shared.
    pub(crate) fn enforce_capacity(&self) {
        let Some(cap) = self.capacity else {
            return;
        };
        // One pass over the shards finds both counts: a one-row insert into
        // a cache with `capacity_bytes` spent a seventh of its time in three.
        let (len, held) = self.len_and_bytes();
        if len > cap {
            self.evict_lowest(len - cap, false);
        }
        if let Some(budget) = self.policy.capacity_bytes {
            let known = (len <= cap).then_some((len, held));
            self.enforce_bytes(budget, known);
        }
    }

    /// Whether the table holds more rows than its capacity, or more bytes
    /// than `capacity_bytes` (as the shards' last writers published them:
    /// no lock taken).
    pub(crate) fn over_capacity(&self) -> bool {
        self.may_pass_capacity(0)
    }

    /// Whether `n` new rows may take the table past its capacity (in rows,
    /// or in bytes at [`Table::row_cost`] a row), as the shards' last
    /// writers published them.
    pub(crate) fn may_pass_capacity(&self, n: usize) -> bool {
        let Some(cap) = self.capacity else {
            return false;
        };
        let (len, held) = self.len_and_bytes();
        let bytes = (held as u64).saturating_add((n * self.row_cost()) as u64);
        len + n > cap || self.policy.capacity_bytes.is_some_and(|b| bytes > b)
    }

    /// Evicts rows until every byte the table counts (`stats().bytes`)
    /// fits in `budget`. The row bound of `capacity_bytes` assumes each
    /// shard's index at its lowest load; an index grown by a call's inserts
    /// (made before that call's evictions) stays larger, so the rows make
    /// room for it. Rows reserved beyond those held (`reserve`) are not
    /// given back by evicting: past two rounds it stops. `known`: the
    /// table's rows and bytes as the caller just counted them (with
    /// nothing evicted since).
    fn enforce_bytes(&self, budget: u64, mut known: Option<(usize, usize)>) {
        let row = read(&self.shards[0]).row_bytes() as u64;
        for _ in 0..2 {
            let (len, held) = known.take().unwrap_or_else(|| self.len_and_bytes());
            let held = held as u64;
            if held <= budget || len == 0 {
                return;
            }
            let k = usize::try_from((held - budget).div_ceil(row)).map_or(len, |k| k.min(len));
            self.evict_lowest(k, false);
        }
    }

    /// Removes the `k` rows of lowest eviction score; returns their keys
    /// and, with `with_rows`, their weights (in no particular order).
    pub(crate) fn evict_lowest(&self, k: usize, with_rows: bool) -> (Vec<i64>, Vec<f32>) {
        let ev = self.policy.eviction;
        self.count_queued_reads();
        if let Some(keys) = self.lowest_kept(k) {
            return self.remove_evicted(&keys, with_rows);
        }
        // The scan keeps the next lowest rows past the `k` it evicts, for
        // the evictions after it (`table::lowest`): each shard its own
        // lowest `k` and twice its share of those.
        let n = self.shards.len();
        let spare = self.lowest_to_keep(self.len(), k);
        let keep = k.saturating_add(spare.div_ceil(n).saturating_mul(2));
        let per_shard: Option<Vec<(Vec<Score>, bool)>> = self
            .shards
            .par_iter()
            .map(|lock| {
                let g = read(lock);
                // A disk table's rows on disk are scored by the metadata
                // its cold shard keeps for them.
                let on_disk = g.cold.iter().flat_map(|c| c.metas());
                let scores = g
                    .keys_and_rows()
                    .map(|(key, r)| ev.score(&g.meta(r), key))
                    .chain(on_disk.map(|(key, w)| ev.score(&Meta::from_words(&w), key)));
                let total = g.len() + g.cold_len();
                lowest_of(scores, total, keep).map(|v| (v, total <= keep))
            })
            .collect();
        // Without the memory for the scan's work arrays nothing is evicted
        // (the next call that inserts, or `evict`, tries again): an
        // eviction is never worth an abort.
        let Some(mut cands) = per_shard.and_then(merge_lowest) else {
            return (Vec::new(), Vec::new());
        };
        // The lowest `k` to evict and, past them, at most `spare` to keep
        // (the rest score above those kept), in order.
        let end = k.saturating_add(spare);
        if cands.len() > end {
            cands.select_nth_unstable(end);
            cands.truncate(end);
        }
        if spare > 0 {
            cands.sort_unstable();
            self.keep_lowest(cands.get(k..).unwrap_or_default());
        }
        let keys: Vec<i64> = cands.iter().take(k).map(|c| c.2).collect();
        self.remove_evicted(&keys, with_rows)
    }

    /// Removes `keys` as evictions (counted), returning those that were
    /// present and, with `with_rows`, their weights. Without the memory for
    /// its work arrays it removes nothing (the next call that inserts, or
    /// `evict`, tries again): an eviction is never worth an abort.
    pub(crate) fn remove_evicted(&self, keys: &[i64], with_rows: bool) -> (Vec<i64>, Vec<f32>) {
        let dim = self.dim;
        let Ok(plan) = self.plan(keys, Floor::Skip) else {
            return (Vec::new(), Vec::new());
        };
        let mut rows = vec![0.0f32; if with_rows { keys.len() * dim } else { 0 }];
        let mut found = vec![false; keys.len()];
        let out = SharedOut::new(&mut rows, dim);
        let flags = SharedBools::new(&mut found);
        self.par_shards_mut(&plan, |g, pos| {
            let flags = &flags;
            let mut n = 0;
            for &i in pos {
                let i = i as usize;
                let held = match g.find(keys[i], plan.hashes[i]) {
                    Some(r) => {
                        if with_rows {
                            // SAFETY: position i belongs to this shard only (plan).
                            self.read_weights(g.weights(r), unsafe { out.row(i, dim) });
                        }
                        true
                    }
                    // A row on disk: its weights read from there; one that
                    // cannot be read stays (evicted by a later round).
                    None => match with_rows.then(|| g.read_cold(keys[i])) {
                        Some(Ok(Some(words))) => {
                            // SAFETY: as above.
                            self.read_weights(&words, unsafe { out.row(i, dim) });
                            true
                        }
                        Some(_) => false,
                        None => g.cold_len() > 0,
                    },
                };
                if held && g.remove(keys[i], plan.hashes[i]) {
                    // SAFETY: i < found.len(); position i is this shard's only.
                    unsafe { flags.set(i, true) };
                    n += 1;
                }
            }
            Counters::add(&g.counters().evicted, n);
            n
        });
        let mut kept_keys = Vec::new();
        let mut kept_rows = Vec::new();
        for (i, &f) in found.iter().enumerate() {
            if f {
                kept_keys.push(keys[i]);
                if with_rows {
                    kept_rows.extend_from_slice(&rows[i * dim..(i + 1) * dim]);
                }
            }
        }
        (kept_keys, kept_rows)
    }
}

#[cfg(test)]
mod tests {
    use crate::policy::Eviction;
    use crate::table::{Table, TableConfig};
    use crate::testing::sgd;

    fn table(capacity: Option<usize>, ttl: Option<u64>) -> Table {
        let mut cfg = TableConfig::new(2);
        cfg.optimizer = sgd(0.1);
        cfg.num_shards = Some(2);
        cfg.policy.capacity = capacity;
        cfg.policy.ttl_steps = ttl;
        cfg.policy.eviction = Eviction::Lfu;
        Table::new(cfg).unwrap()
    }

    /// The counts a capacity check reads without locks, as each shard's
    /// last writer published them, equal `stats()`'s (taken under the
    /// locks) after every kind of call that changes rows or memory.
    #[test]
    fn published_counts_follow_every_write() {
        let t = table(Some(300), None);
        let same = |what: &str| {
            let s = t.stats();
            assert_eq!(t.len_and_bytes(), (s.rows, s.bytes), "after {what}");
        };
        same("nothing");
        let keys: Vec<i64> = (0..200).collect();
        t.assign(&keys, &vec![1.0; 400]).unwrap();
        same("assign");
        t.assign(&[7], &[2.0, 2.0]).unwrap();
        same("a one-row assign");
        let mut out = vec![0.0; 2 * 150];
        let more: Vec<i64> = (150..300).collect();
        t.lookup(&more, true, &mut out).unwrap();
        same("a lookup that inserts");
        t.lookup(&[1000, 1001], true, &mut out[..4]).unwrap();
        same("a small lookup that inserts");
        let grads = vec![0.5; 2 * 100];
        let new: Vec<i64> = (400..500).collect();
        t.apply_gradients(&new, &grads).unwrap();
        same("a step that creates rows and evicts");
        t.remove(&[400, 401, 5]).unwrap();
        same("remove");
        t.reserve_rows(1000).unwrap();
        same("reserve");
        t.evict(false);
        same("evict");
        // A small insert that only tries the locks (a table that tracks
        // no touches).
        let u = table(None, None);
        let mut out = [0.0; 4];
        let got = u.try_lookup_now(&[1, 2], true, crate::table::Missing::Init, &mut out);
        assert!(matches!(got, Some(Ok(()))));
        let s = u.stats();
        assert_eq!((s.rows, u.len_and_bytes()), (2, (s.rows, s.bytes)));
    }

    #[test]
    fn stats_bytes_never_exceed_capacity_bytes() {
        // At 7e7142d a 64 MiB budget of 768-wide Adagrad rows held 0.2% more
        // (the indexes grown by each call's inserts before its evictions);
        // here 16 MiB of 256-wide rows.
        let mut cfg = TableConfig::new(256);
        cfg.optimizer = Some(crate::optim::Optimizer::Adagrad {
            lr: 0.1,
            initial_accumulator_value: 0.0,
            eps: 1e-10,
            weight_decay: 0.0,
        });
        cfg.num_shards = Some(8);
        cfg.policy.capacity_bytes = Some(16 << 20);
        let t = Table::new(cfg).unwrap();
        let mut out = vec![0.0; 4096 * 256];
        for round in 0..12i64 {
            let keys: Vec<i64> = (0..4096)
                .map(|i| (i * 7919 + round * 104_729) % 1_000_000)
                .collect();
            t.lookup(&keys, true, &mut out).unwrap();
            let s = t.stats();
            assert!(
                s.bytes as u64 <= 16 << 20,
                "round {round}: {} bytes",
                s.bytes
            );
        }
        assert!(t.len() > 7_000, "the budget is used: {} rows", t.len());
    }

    #[test]
    fn capacity_keeps_the_most_touched_rows() {
        let t = table(Some(2), None);
        let mut out = vec![0.0; 6];
        t.lookup(&[1, 1, 2], true, &mut out).unwrap();
        t.lookup(&[2, 3, 3], true, &mut out).unwrap();
        let (mut keys, _, _) = t.export(false).unwrap();
        keys.sort_unstable();
        assert_eq!(keys, [2, 3], "key 1 (two touches, oldest) goes first");
    }

    #[test]
    fn a_serving_read_beside_a_writer_waits_for_no_lock_and_still_counts_as_a_touch() {
        use std::sync::{Arc, mpsc};
        use std::time::Duration;
        let mut cfg = TableConfig::new(2);
        cfg.optimizer = sgd(0.1);
        cfg.num_shards = Some(1);
        cfg.policy.capacity = Some(2);
        cfg.policy.eviction = Eviction::Lru;
        let t = Arc::new(Table::new(cfg).unwrap());
        let mut out = vec![0.0; 2];
        t.lookup(&[1], true, &mut out).unwrap();
        t.lookup(&[2], true, &mut out).unwrap();
        // A writer holds the only shard's write lock; a serving read of key
        // 1 returns meanwhile, its touch queued.
        let held = crate::table::storage::write(&t.shards[0]);
        let (tx, rx) = mpsc::channel();
        let reader = Arc::clone(&t);
        std::thread::spawn(move || {
            let mut o = vec![0.0; 2];
            reader.lookup(&[1], false, &mut o).unwrap();
            tx.send(()).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(10))
            .expect("the serving read waited for the writer's lock");
        assert_eq!(t.views[0].reads.len(), 1, "the touch is queued");
        drop(held);
        // Key 3 makes three rows: the least recently touched goes, which
        // is key 2 only if the queued read of key 1 was counted.
        t.lookup(&[3], true, &mut out).unwrap();
        let (mut keys, _, _) = t.export(false).unwrap();
        keys.sort_unstable();
        assert_eq!(keys, [1, 3]);
        assert!(t.views[0].reads.is_empty());
    }

    #[test]
    fn touches_queued_beside_a_long_hold_stay_bounded() {
        use crate::table::storage::view::MAX_QUEUED_READS;
        let mut cfg = TableConfig::new(2);
        cfg.num_shards = Some(1);
        cfg.policy.capacity = Some(1 << 20);
        let t = Table::new(cfg).unwrap();
        let big: Vec<i64> = (0..MAX_QUEUED_READS as i64 - 10).collect();
        let mut out = vec![0.0; 2 * big.len()];
        // A snapshot's hold: the shard's read lock, so try_write fails.
        let held = crate::table::storage::read(&t.shards[0]);
        t.lookup(&big, false, &mut out).unwrap();
        t.lookup(&big[..10], false, &mut out[..20]).unwrap();
        // Past the bound: not queued.
        t.lookup(&big[..11], false, &mut out[..22]).unwrap();
        let view = &t.views[0];
        assert_eq!(
            view.queued.load(std::sync::atomic::Ordering::Relaxed),
            MAX_QUEUED_READS
        );
        assert_eq!(view.reads.len(), 2);
        drop(held);
        drop(crate::table::storage::write(&t.shards[0]));
        assert_eq!(view.queued.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert!(view.reads.is_empty());
    }

    #[test]
    fn ttl_removes_rows_untouched_for_that_many_steps() {
        let t = table(None, Some(1));
        t.apply_gradients(&[1], &[0.1, 0.1]).unwrap();
        t.apply_gradients(&[2], &[0.1, 0.1]).unwrap();
        t.apply_gradients(&[2], &[0.1, 0.1]).unwrap();
        let (keys, rows) = t.evict(true);
        assert_eq!(keys, [1]);
        assert_eq!(rows.len(), 2);
        assert_eq!(t.len(), 1);
    }
}
