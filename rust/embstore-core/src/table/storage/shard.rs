//! One shard: an index from key to row number over an [`Arena`], and the
//! [`View`] through which readers that hold no lock read both.

use crate::policy::Meta;
use crate::policy::Sketch;
use crate::table::NO_ROW;
use crate::table::counters::Counters;
use crate::table::storage::arena::{Arena, RowWrite};
use crate::table::storage::index::{self, Index};
use crate::table::storage::seqlock;
use crate::table::storage::tier::ColdStore;
use crate::table::storage::view::{PROBE_AHEAD, PROBE_PREFETCH_MIN, Reads, View};
use crossbeam_queue::SegQueue;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

mod moved;
mod room;

/// Batches of at least this many keys in a shard may skip the probe of a
/// call's reservation ([`Shard::sampled_all_absent`]).
const SAMPLE_FROM: usize = 1024;

/// Keys that sample probes.
const SAMPLE_KEYS: usize = 32;

/// The keys a shard removed, from absolute position `base` on (position
/// `p` is `keys[p - base]`); save marks name positions in it.
#[derive(Debug, Default)]
pub(crate) struct RemovalLog {
    pub keys: Vec<i64>,
    pub base: u64,
}

impl RemovalLog {
    /// The position after the last key logged.
    pub(crate) fn end(&self) -> u64 {
        self.base + self.keys.len() as u64
    }

    /// The keys logged from position `from` on (all that are kept when
    /// `from` was dropped, which [`RemovalLog::keep_from`] never does to a
    /// position a mark names).
    pub(crate) fn since(&self, from: u64) -> &[i64] {
        let skip = from.saturating_sub(self.base) as usize;
        &self.keys[skip.min(self.keys.len())..]
    }

    /// Drops the keys before position `from` (no mark needs them).
    pub(crate) fn keep_from(&mut self, from: u64) {
        let drop = (from.saturating_sub(self.base) as usize).min(self.keys.len());
        if drop > 0 {
            self.keys.drain(..drop);
            self.base += drop as u64;
            if self.keys.capacity() > 4 * self.keys.len() + 64 {
                self.keys.shrink_to_fit();
            }
        }
    }
}

/// A shard's index and rows, for the writer: the table wraps each shard in
/// a lock, which writers take; readers go through the shard's [`View`].
#[derive(Debug)]
#[allow(clippy::len_without_is_empty)]
pub(crate) struct Shard {
    /// The readers' view (index and segments); shared with the table.
    view: Arc<View>,
    /// The writer's counts of the index.
    ix: index::Writer,
    /// Keys removed (for incremental checkpoints), in order: the log from
    /// absolute position `removed_base` on, kept from the earliest position
    /// a save mark still needs ([`RemovalLog`]).
    pub removed: RemovalLog,
    /// Whether removals are logged: only while the table has save marks
    /// (before its first save or load no incremental save can follow, so an
    /// eviction-heavy table never saved keeps no log).
    pub track_removals: bool,
    /// Rows (reached through the shard's row methods only).
    arena: Arena,
    /// This shard's part of the admission sketch, if any.
    pub sketch: Option<Sketch>,
    /// Removals so far. Row numbers change only when a row is removed (the
    /// last row moves into its place), so row numbers found under the lock
    /// are still right later, under the lock again, if this has not changed.
    pub removals: u64,
    /// Rows that calls in flight may still insert, each having made room for
    /// them with [`Shard::reserve_pending`]: the index and the arena keep
    /// room for all of them, so an insert never allocates mid-call.
    pending: usize,
    /// A disk table's rows of this shard on disk ([`ColdShard`]): rows
    /// move there ([`Shard::spill`]) and back ([`Shard::insert_moved`])
    /// keeping their bits and save generation; a key is in memory or on
    /// disk, never both.
    pub cold: Option<Box<dyn ColdStore>>,
}

/// The rows API: a row of the shard by its number (found through the
/// index under the shard's lock), as every caller outside the storage
/// reaches it.
impl Shard {
    /// The stored weights of row `r` (in the row format's words).
    #[inline]
    pub(crate) fn weights(&self, r: usize) -> &[f32] {
        self.arena.weights(r)
    }

    /// The optimizer state of row `r`.
    #[inline]
    pub(crate) fn state(&self, r: usize) -> &[f32] {
        self.arena.state(r)
    }

    /// The policy metadata of row `r`.
    #[inline]
    pub(crate) fn meta(&self, r: usize) -> Meta {
        self.arena.meta(r)
    }

    /// The policy metadata of row `r`, to set.
    #[inline]
    pub(crate) fn meta_mut(&mut self, r: usize) -> &mut Meta {
        self.arena.meta_mut(r)
    }

    /// Counts `n` touches of row `r` at `tick` and `step`.
    #[inline]
    pub(crate) fn touch(&mut self, r: usize, tick: u64, step: u64, n: u32) {
        self.arena.touch(r, tick, step, n);
    }

    /// Bytes a row costs (weights, state, tag, metadata).
    pub(crate) fn row_bytes(&self) -> usize {
        self.arena.row_bytes()
    }
}

impl Shard {
    /// An empty shard of rows of `ww` floats of weights and `sl` of
    /// optimizer state, with per-row metadata when `track`, and an
    /// admission sketch if given.
    pub(crate) fn new(ww: usize, sl: usize, track: bool, sketch: Option<Sketch>) -> Self {
        let arena = Arena::new(ww, sl, track);
        let s = Shard {
            view: Arc::new(View {
                index: Index::default(),
                segs: arena.view(),
                counters: Counters::default(),
                reads: SegQueue::new(),
                queued: AtomicUsize::new(0),
                counted: Default::default(),
            }),
            ix: index::Writer::default(),
            removed: RemovalLog::default(),
            track_removals: false,
            arena,
            sketch,
            removals: 0,
            pending: 0,
            cold: None,
        };
        s.publish_counts();
        s
    }

    /// Publishes the shard's rows and bytes for lock-free readers
    /// ([`View::counted`]); the holder of the write lock calls it.
    pub(crate) fn publish_counts(&self) {
        let c = &self.view.counted;
        c[0].store(self.len() + self.cold_len(), Ordering::Release);
        c[1].store(self.bytes(), Ordering::Release);
    }

    /// Counts the serving reads queued on this shard ([`View::reads`]) as
    /// touches of the rows their keys have now (a key removed since is
    /// skipped). The caller holds the write lock.
    pub(crate) fn count_reads(&mut self) {
        while let Some(reads) = self.view.reads.pop() {
            self.view
                .queued
                .fetch_sub(reads.keys.len(), Ordering::Relaxed);
            self.touch_read(&reads);
        }
    }

    /// Counts one serving call's reads of this shard as touches (the
    /// caller holds the write lock).
    pub(crate) fn touch_read(&mut self, reads: &Reads) {
        for &(key, hash) in &reads.keys {
            if let Some(r) = self.find(key, hash) {
                self.arena.touch(r, reads.tick, reads.step, 1);
            }
        }
    }

    /// The readers' view of this shard.
    pub(crate) fn view(&self) -> Arc<View> {
        self.view.clone()
    }

    /// What happened to this shard's rows.
    #[inline]
    pub(crate) fn counters(&self) -> &Counters {
        &self.view.counters
    }

    /// Rows held.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.arena.len()
    }

    /// Bytes held: rows, keys and the index's allocation.
    pub(crate) fn bytes(&self) -> usize {
        self.arena.bytes()
            + self.ix.bytes(&self.view.index)
            + self.removed.keys.capacity() * 8
            + self.sketch.as_ref().map_or(0, Sketch::bytes)
    }

    /// Of [`Shard::bytes`]: the index's allocation, the rows' weights and
    /// their optimizer state.
    pub(crate) fn bytes_by_part(&self) -> (usize, usize, usize) {
        let (w, st) = self.arena.weight_and_state_bytes();
        (self.ix.bytes(&self.view.index), w, st)
    }

    /// The rows of the keys at batch positions `pos` (`keys[pos[j]]`, hash
    /// `hashes[pos[j]]`) into `rows` (`NO_ROW` where absent). A probe reads
    /// the index only, so the probes of consecutive keys overlap their cache
    /// misses; from [`PROBE_PREFETCH_MIN`] keys on, the index lines of the
    /// key [`PROBE_AHEAD`] ahead are prefetched too.
    pub(crate) fn find_many(&self, keys: &[i64], hashes: &[u64], pos: &[u32], rows: &mut Vec<u32>) {
        rows.clear();
        rows.reserve(pos.len());
        let Some(slots) = self.ix.slots_ref(&self.view.index) else {
            rows.resize(pos.len(), NO_ROW);
            return;
        };
        let row = |(_, w)| seqlock::row_named(w) as u32;
        rows.extend(pos.iter().enumerate().map(|(j, &i)| {
            prefetch_probe_ahead(slots, hashes, pos, j);
            let i = i as usize;
            slots.find(keys[i], hashes[i]).map_or(NO_ROW, row)
        }));
    }

    /// The rows (row number and key, in row order) last changed in a save
    /// generation after `since`, or every row for `None`: a pass over the
    /// rows' tags in memory order, reading the key of each row taken. The
    /// caller holds the shard's lock.
    pub(crate) fn rows_since(&self, since: Option<u32>) -> Vec<(usize, i64)> {
        let Some(slots) = self.ix.slots_ref(&self.view.index) else {
            return Vec::new();
        };
        (0..self.arena.len())
            .filter(|&r| since.is_none_or(|g| self.arena.generation(r) > g))
            .map(|r| {
                let key = slots.cell(self.arena.slot(r)).key.load(Ordering::Relaxed);
                (r, key)
            })
            .collect()
    }

    /// Every key held with its row number, in no particular order.
    pub(crate) fn keys_and_rows(&self) -> impl Iterator<Item = (i64, usize)> + '_ {
        self.ix.live(&self.view.index)
    }

    /// Whether a sample of the keys at `pos` (every one of a few, spread
    /// over the batch) finds none of them here, for a batch of at least
    /// [`SAMPLE_FROM`] keys: a call inserting that many new keys (a fill, an
    /// ingest) then makes room for all of them without probing them all
    /// first. A batch of mostly new keys with a few held gets room for
    /// those few too, which the call gives back when it ends.
    pub(crate) fn sampled_all_absent(&self, keys: &[i64], hashes: &[u64], pos: &[u32]) -> bool {
        if pos.len() < SAMPLE_FROM {
            return false;
        }
        let step = pos.len() / SAMPLE_KEYS;
        (0..SAMPLE_KEYS).all(|j| {
            let i = pos[j * step] as usize;
            self.find(keys[i], hashes[i]).is_none()
        })
    }

    /// As [`Shard::find_many`], creating the rows of absent keys (filled by
    /// `fill(key, weights, state)`) in batch order, after making room in the index for
    /// all of them at once.
    ///
    /// Where the index has room for every position already (a call that
    /// reserved room for all of them: [`Shard::reserve_pending`]), one pass
    /// probes each key and creates its row if absent, so that an absent
    /// key's index line is read once; otherwise the keys are probed first
    /// and room made for the absent ones.
    pub(crate) fn find_or_insert_many(
        &mut self,
        keys: &[i64],
        hashes: &[u64],
        pos: &[u32],
        generation: u32,
        fill: impl Fn(i64, &mut [f32], &mut [f32]),
        rows: &mut Vec<u32>,
    ) {
        if pos.is_empty() || self.ix.room(&self.view.index) < pos.len() {
            self.find_many(keys, hashes, pos, rows);
            self.insert_missing(keys, hashes, pos, generation, fill, rows);
            return;
        }
        rows.clear();
        rows.reserve(pos.len());
        let row = |(_, w)| seqlock::row_named(w) as u32;
        for (j, &i) in pos.iter().enumerate() {
            let (key, hash) = (keys[i as usize], hashes[i as usize]);
            // A held key by the probe `find_many` makes; an absent one
            // created while its index line is in cache.
            let held = self.ix.slots_ref(&self.view.index).and_then(|slots| {
                prefetch_probe_ahead(slots, hashes, pos, j);
                slots.find(key, hash).map(row)
            });
            rows.push(held.unwrap_or_else(|| {
                let (r, _) = self.find_or_insert(key, hash, generation, |w, st| fill(key, w, st));
                r as u32
            }));
        }
    }

    /// Creates the rows of the positions whose entry in `rows` is
    /// `NO_ROW` (found absent by an earlier probe under this lock, or
    /// under an earlier hold of it with no removal since: a key inserted
    /// meanwhile is found, not inserted twice).
    pub(crate) fn insert_missing(
        &mut self,
        keys: &[i64],
        hashes: &[u64],
        pos: &[u32],
        generation: u32,
        fill: impl Fn(i64, &mut [f32], &mut [f32]),
        rows: &mut [u32],
    ) {
        let missing = rows.iter().filter(|&&r| r == NO_ROW).count();
        if missing == 0 {
            return;
        }
        self.reserve_index(missing);
        for (j, &i) in pos.iter().enumerate() {
            self.prefetch_ahead(hashes, pos, j);
            let r = &mut rows[j];
            if *r == NO_ROW {
                let (key, hash) = (keys[i as usize], hashes[i as usize]);
                let (row, _) = self.find_or_insert(key, hash, generation, |w, st| fill(key, w, st));
                *r = row as u32;
            }
        }
    }

    /// In a loop that probes the keys at `pos` in turn (`j` the one probed
    /// now), starts loading the index line of the key [`PROBE_AHEAD`]
    /// positions on, from [`PROBE_PREFETCH_MIN`] keys: each probe of a
    /// large index is a cache miss, and the misses of keys ahead overlap.
    #[inline(always)]
    pub(crate) fn prefetch_ahead(&self, hashes: &[u64], pos: &[u32], j: usize) {
        if let Some(slots) = self.ix.slots_ref(&self.view.index) {
            prefetch_probe_ahead(slots, hashes, pos, j);
        }
    }

    /// Starts loading the index lines that probes of the keys at `pos`
    /// read first, for a batch too small for [`Shard::prefetch_ahead`]:
    /// called as a call takes the shard, the misses overlap with the
    /// call's work before its probes (a one-row insert into a large table
    /// waited on its probe's miss for a tenth of its time).
    #[inline]
    pub(crate) fn prefetch_homes(&self, hashes: &[u64], pos: &[u32]) {
        if pos.len() < PROBE_PREFETCH_MIN
            && let Some(slots) = self.ix.slots_ref(&self.view.index)
        {
            for &p in pos {
                slots.prefetch(hashes[p as usize]);
            }
        }
    }

    /// The row of `key` (whose hash is `hash`), if present.
    #[inline]
    pub(crate) fn find(&self, key: i64, hash: u64) -> Option<usize> {
        self.ix.find(&self.view.index, key, hash).map(|(_, r)| r)
    }

    /// The row of `key`, created by `fill(weights, state)` when missing
    /// (the row's weights and state are zeros when `fill` gets them);
    /// `true` when created.
    #[inline]
    pub(crate) fn find_or_insert(
        &mut self,
        key: i64,
        hash: u64,
        generation: u32,
        fill: impl FnOnce(&mut [f32], &mut [f32]),
    ) -> (usize, bool) {
        self.find_or_push(key, hash, |a| a.push(generation, fill))
    }

    /// [`Shard::find_or_insert`] of a row whose weights, when it is
    /// created, are `weights` as stored (copied in: [`Arena::push_weights`])
    /// and whose state `state` writes.
    #[inline]
    pub(crate) fn find_or_insert_weights(
        &mut self,
        key: i64,
        hash: u64,
        generation: u32,
        weights: &[f32],
        state: impl FnOnce(&mut [f32]),
    ) -> (usize, bool) {
        self.find_or_push(key, hash, |a| a.push_weights(generation, weights, state))
    }

    /// The row of `key`, pushed by `push` when missing, and its key then
    /// put in the index.
    #[inline]
    fn find_or_push(
        &mut self,
        key: i64,
        hash: u64,
        push: impl FnOnce(&mut Arena) -> usize,
    ) -> (usize, bool) {
        if let Some((_, r)) = self.ix.find(&self.view.index, key, hash) {
            return (r, false);
        }
        if self.ix.room(&self.view.index) == 0 {
            self.reserve_index(1);
        }
        let r = push(&mut self.arena);
        assert!(
            r < (u32::MAX - 1) as usize,
            "a shard holds under 2^32 - 1 rows"
        );
        let slot = self.ix.insert(&self.view.index, key, hash, r);
        self.arena.set_slot(r, slot);
        (r, true)
    }

    /// Starts loading the index line of row `r`'s key, which a change of
    /// the row writes (its version): a step's rows are visited in row
    /// order, their keys' slots in hash order.
    #[inline(always)]
    pub(crate) fn prefetch_word(&self, r: usize) {
        if let Some(s) = self.ix.slots_ref(&self.view.index) {
            let slot = self.arena.slot(r);
            crate::simd::prefetch_addr(std::ptr::from_ref(s.cell(slot)) as usize);
        }
    }

    /// The weights and optimizer state of row `r`, for a change made in
    /// save generation `g` ([`Arena::row_to_change`]; the version in the
    /// key's word is odd until the change is dropped).
    #[inline]
    pub(crate) fn row_to_change(&mut self, r: usize, g: u32) -> RowWrite<'_> {
        let (ix, index) = (&self.ix, &self.view.index);
        self.arena.row_to_change(r, g, |slot| ix.word(index, slot))
    }

    /// [`Shard::row_to_change`] with the row's key, read from its index
    /// slot (the line the write's version word is on: an 8-bit row's
    /// rounding stream needs the key, and the batch's copy of it is a
    /// random read of the caller's keys).
    #[inline]
    pub(crate) fn row_to_change_keyed(&mut self, r: usize, g: u32) -> (RowWrite<'_>, i64) {
        let (ix, index) = (&self.ix, &self.view.index);
        let mut key = 0;
        let w = self.arena.row_to_change(r, g, |slot| {
            let c = ix.cell(index, slot);
            // The writer holds the shard: a published slot's key never
            // changes (a removed key's slot is not reused).
            key = c.key.load(Ordering::Relaxed);
            &c.word
        });
        (w, key)
    }

    /// Removes `key` (in memory or, for a disk table, on disk); `true`
    /// when it was present.
    pub(crate) fn remove(&mut self, key: i64, hash: u64) -> bool {
        let held = match self.ix.find(&self.view.index, key, hash) {
            Some((slot, r)) => {
                self.drop_row(slot, r);
                true
            }
            None => self.cold.as_mut().is_some_and(|c| c.erase(key)),
        };
        if held && self.track_removals {
            self.removed.keys.push(key);
        }
        held
    }

    /// Takes row `r` (in index slot `slot`) out of memory.
    fn drop_row(&mut self, slot: usize, r: usize) {
        self.ix.remove(&self.view.index, slot);
        self.removals += 1;
        let (ix, index) = (&self.ix, &self.view.index);
        self.arena.swap_remove(r, |slot| ix.word(index, slot));
    }
}

/// [`Shard::prefetch_ahead`] in `slots`: the index line of the key
/// [`PROBE_AHEAD`] positions after `j` in `pos`, from
/// [`PROBE_PREFETCH_MIN`] keys.
#[inline(always)]
fn prefetch_probe_ahead(slots: &index::Slots, hashes: &[u64], pos: &[u32], j: usize) {
    if pos.len() >= PROBE_PREFETCH_MIN
        && let Some(&a) = pos.get(j + PROBE_AHEAD)
    {
        slots.prefetch(hashes[a as usize]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::key_hash;

    /// A batch of held keys, new keys and repeats: the one-pass creation
    /// (room made for every position first) and the two-pass one (probe,
    /// then room for the absent keys) give the same rows, each absent key
    /// created once, in batch order, held keys' rows untouched; and the
    /// reservation's sample tells a batch of new keys from one with held
    /// keys among those it samples.
    #[test]
    fn one_pass_and_two_pass_creation_give_the_same_rows() {
        let fill = |key: i64, w: &mut [f32], st: &mut [f32]| {
            w.fill(key as f32);
            st.fill(1.0);
        };
        let held: Vec<i64> = (0..3_000).map(|k| k * 7).collect();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let batch: Vec<i64> = (0..6_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Held keys (multiples of 7 below 21,000), new ones, repeats.
                (x % 30_000) as i64
            })
            .collect();
        let hashes: Vec<u64> = batch.iter().map(|&k| key_hash(k)).collect();
        let pos: Vec<u32> = (0..batch.len() as u32).collect();
        let mut out = Vec::new();
        for one_pass in [true, false] {
            let mut s = Shard::new(2, 1, false, None);
            for &k in &held {
                s.find_or_insert(k, key_hash(k), 0, |w, st| fill(k, w, st));
            }
            if one_pass {
                s.reserve_index(batch.len());
            }
            assert_eq!(s.ix.room(&s.view.index) >= batch.len(), one_pass);
            let mut rows = Vec::new();
            s.find_or_insert_many(&batch, &hashes, &pos, 0, fill, &mut rows);
            let mut seen = std::collections::HashSet::new();
            let mut next = held.len();
            for (&k, &r) in batch.iter().zip(&rows) {
                let r = r as usize;
                assert_eq!(s.find(k, key_hash(k)), Some(r));
                assert_eq!(s.arena.weights(r), &[k as f32; 2]);
                if k % 7 == 0 && k < 21_000 {
                    assert_eq!(r, (k / 7) as usize, "a held key keeps its row");
                } else if seen.insert(k) {
                    assert_eq!(r, next, "new rows in batch order");
                    next += 1;
                }
            }
            assert_eq!(s.len(), next);
            out.push(rows);
        }
        assert_eq!(out[0], out[1]);
        let s = Shard::new(2, 1, false, None);
        let fresh: Vec<i64> = (100_000..102_048).collect();
        let fh: Vec<u64> = fresh.iter().map(|&k| key_hash(k)).collect();
        let fp: Vec<u32> = (0..fresh.len() as u32).collect();
        assert!(s.sampled_all_absent(&fresh, &fh, &fp));
        assert!(!s.sampled_all_absent(&fresh, &fh, &fp[..SAMPLE_FROM - 1]));
        let mut s = s;
        // One sampled key held (the sample's first: position 0).
        s.find_or_insert(fresh[0], fh[0], 0, |w, st| fill(fresh[0], w, st));
        assert!(!s.sampled_all_absent(&fresh, &fh, &fp));
    }

    /// A dict model of a shard under inserts and removals in random order:
    /// every key held is found at a row holding its weights, and
    /// `keys_and_rows` lists exactly the keys held, each with its row.
    #[test]
    fn removals_keep_every_other_key_found_and_listed() {
        let mut s = Shard::new(2, 1, false, None);
        let mut model = std::collections::HashMap::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Keys from a small range, negative ones included, so that
            // inserts hit present keys and removals hit absent ones.
            let key = (x % 4_000) as i64 - 2_000;
            if step % 3 == 2 {
                assert_eq!(s.remove(key, key_hash(key)), model.remove(&key).is_some());
            } else {
                let (r, created) = s.find_or_insert(key, key_hash(key), 0, |w, st| {
                    w.fill(key as f32);
                    st.fill(-(key as f32));
                });
                assert_eq!(created, model.insert(key, ()).is_none());
                assert_eq!(s.arena.weights(r), &[key as f32; 2]);
            }
        }
        assert_eq!(s.len(), model.len());
        for &key in model.keys() {
            let r = s.find(key, key_hash(key)).expect("a held key is found");
            assert_eq!(s.arena.weights(r), &[key as f32; 2]);
            assert_eq!(s.arena.state(r), &[-(key as f32)]);
            assert_eq!(s.find(key, key_hash(key)), Some(r));
        }
        let mut listed: Vec<(i64, usize)> = s.keys_and_rows().collect();
        listed.sort_unstable();
        let mut keys: Vec<i64> = model.keys().copied().collect();
        keys.sort_unstable();
        assert_eq!(listed.iter().map(|p| p.0).collect::<Vec<_>>(), keys);
        for (key, r) in listed {
            assert_eq!(
                s.arena.weights(r),
                &[key as f32; 2],
                "key {key} listed with its row"
            );
        }
        let mut rows: Vec<usize> = s.keys_and_rows().map(|p| p.1).collect();
        rows.sort_unstable();
        assert_eq!(rows, (0..s.len()).collect::<Vec<_>>(), "rows are dense");
    }
}
