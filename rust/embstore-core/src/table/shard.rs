//! One shard: a hash index from key to row number over an [`Arena`].

use hashbrown::HashTable;

use super::Counters;
use super::NO_ROW;
use super::arena::{Arena, OutOfMemory};
use super::pages::PageAlloc;
use crate::policy::Sketch;

/// An index entry: the row number in the high 32 bits, the low 32 bits of
/// the key's hash in the low 32 bits. Keeping the hash in the entry lets the
/// index grow without reading the arena, and filters probes before the key
/// comparison.
type Entry = u64;

/// The hash hashbrown sees for an entry: a function of the stored 32 hash
/// bits only, with those bits in both halves so that the slot (low bits) and
/// the tag (top 7 bits) both vary. The table picks shards from the other 32
/// bits of the key hash ([`crate::hash::shard_of`]).
#[inline(always)]
fn index_hash(h32: u32) -> u64 {
    u64::from(h32) | (u64::from(h32) << 32)
}

/// Keys per block of [`Shard::find_many`].
const FIND_BLOCK: usize = 64;

#[inline(always)]
fn entry(row: usize, h32: u32) -> Entry {
    ((row as u64) << 32) | u64::from(h32)
}

#[inline(always)]
fn entry_row(e: Entry) -> usize {
    (e >> 32) as usize
}

/// A shard's index and rows. Not synchronized: the table wraps each shard in
/// a lock and takes it once per call.
#[derive(Debug)]
#[allow(clippy::len_without_is_empty)]
pub struct Shard {
    /// Row numbers and hash bits ([`Entry`]); the key lives in the arena.
    index: HashTable<Entry, PageAlloc>,
    /// Keys removed since the last save (for incremental checkpoints).
    pub removed: Vec<i64>,
    /// Whether removals are recorded in `removed`: only once the table has
    /// been saved or loaded (before that, no incremental save can follow, so
    /// an eviction-heavy table never saved keeps no list).
    pub track_removals: bool,
    /// Keys and rows.
    pub arena: Arena,
    /// This shard's part of the admission sketch, if any.
    pub sketch: Option<Sketch>,
    /// What happened to this shard's rows.
    pub counters: Counters,
    /// Removals so far. Row numbers change only when a row is removed (the
    /// last row moves into its place), so row numbers found under the lock
    /// are still right later, under the lock again, if this has not changed.
    pub removals: u64,
    /// Rows that calls in flight may still insert, each having made room for
    /// them with [`Shard::reserve_pending`]: the index and the arena keep
    /// room for all of them, so an insert never allocates mid-call.
    pending: usize,
}

impl Shard {
    /// An empty shard of rows of `stride` floats, with per-row metadata
    /// when `track`, and an admission sketch if given.
    pub fn new(stride: usize, track: bool, sketch: Option<Sketch>) -> Self {
        Shard {
            index: HashTable::new_in(PageAlloc),
            removed: Vec::new(),
            track_removals: false,
            arena: Arena::new(stride, track),
            sketch,
            counters: Counters::default(),
            removals: 0,
            pending: 0,
        }
    }

    /// Rows held.
    #[inline]
    pub fn len(&self) -> usize {
        self.arena.len()
    }

    /// Bytes held: rows, keys and the index's allocation.
    pub fn bytes(&self) -> usize {
        self.arena.bytes()
            + self.index.allocation_size()
            + self.removed.capacity() * 8
            + self.sketch.as_ref().map_or(0, Sketch::bytes)
    }

    /// Makes room in the index for `additional` more keys.
    pub fn reserve_index(&mut self, additional: usize) {
        self.index.reserve(additional, |&e| index_hash(e as u32));
    }

    /// [`Shard::reserve_index`] that reports running out of memory.
    ///
    /// # Errors
    /// When the index cannot be allocated; it is unchanged then.
    pub fn try_reserve_index(&mut self, additional: usize) -> Result<(), OutOfMemory> {
        self.index
            .try_reserve(additional, |&e| index_hash(e as u32))
            .map_err(|_| OutOfMemory)
    }

    /// Makes room in the index for `additional` more keys and allocates and
    /// touches their rows' memory ([`Arena::reserve`]).
    ///
    /// # Errors
    /// When the memory cannot be allocated.
    pub fn reserve_rows(&mut self, additional: usize) -> Result<(), OutOfMemory> {
        self.index
            .try_reserve(additional, |&e| index_hash(e as u32))
            .map_err(|_| OutOfMemory)?;
        self.arena.reserve(additional)
    }

    /// Makes room for `n` more rows on top of those that other calls in
    /// flight have made room for (index slots and arena segments, not
    /// touched), and counts them as pending until [`Shard::release_pending`].
    /// A call that may insert `n` rows calls this for every shard before it
    /// inserts anything, so that running out of memory refuses the call
    /// whole instead of stopping it half way.
    ///
    /// # Errors
    /// When the memory cannot be allocated; nothing is pending then.
    pub fn reserve_pending(&mut self, n: usize) -> Result<(), OutOfMemory> {
        let pending = self.pending.checked_add(n).ok_or(OutOfMemory)?;
        let target = self.len().checked_add(pending).ok_or(OutOfMemory)?;
        if target > u32::MAX as usize {
            return Err(OutOfMemory);
        }
        self.index
            .try_reserve(pending, |&e| index_hash(e as u32))
            .map_err(|_| OutOfMemory)?;
        self.arena.ensure_segments(target)?;
        self.pending = pending;
        Ok(())
    }

    /// Makes room for `n` more rows on top of the pending ones (index slots
    /// and arena segments) without counting them as pending: for a call
    /// that inserts them at once, under this lock. `false` when the memory
    /// cannot be allocated (the index may have grown; no row changed).
    pub fn make_room(&mut self, n: usize) -> bool {
        let Some(want) = self.pending.checked_add(n) else {
            return false;
        };
        match self.len().checked_add(want) {
            Some(target) if target <= u32::MAX as usize => {
                self.index
                    .try_reserve(want, |&e| index_hash(e as u32))
                    .is_ok()
                    && self.arena.ensure_segments(target).is_ok()
            }
            _ => false,
        }
    }

    /// Whether `n` more rows fit, on top of the pending ones, without
    /// allocating.
    pub fn has_room(&self, n: usize) -> bool {
        let want = self.pending.saturating_add(n);
        self.index.capacity() - self.index.len() >= want
            && self.arena.room() >= want.saturating_add(self.len())
    }

    /// Ends a [`Shard::reserve_pending`] of `n` rows (whether or not they
    /// were inserted).
    pub fn release_pending(&mut self, n: usize) {
        self.pending -= n;
    }

    /// The row of the entry whose stored hash bits match `hash`'s, if any: a
    /// probe that reads the index only. A present key's row is its
    /// candidate (or, in the rare case of two keys sharing 32 hash bits,
    /// another key's); no candidate means the key is absent.
    #[inline(always)]
    fn candidate(&self, hash: u64) -> u32 {
        let h32 = hash as u32;
        self.index
            .find(index_hash(h32), |&e| e as u32 == h32)
            .map_or(NO_ROW, |&e| entry_row(e) as u32)
    }

    /// The rows of the keys at batch positions `pos` (`keys[pos[j]]`, hash
    /// `hashes[pos[j]]`) into `rows` (`NO_ROW` where absent). Works in
    /// blocks: first every candidate of the block, whose probes read only
    /// the index and so overlap their cache misses, with the candidate's key
    /// prefetched; then each candidate checked against its key (a full probe
    /// where the check fails).
    pub fn find_many(&self, keys: &[i64], hashes: &[u64], pos: &[u32], rows: &mut Vec<u32>) {
        rows.clear();
        rows.reserve(pos.len());
        let ahead = super::prefetches(keys.len(), super::SEQUENTIAL_KEYS);
        for block in pos.chunks(FIND_BLOCK) {
            let start = rows.len();
            for &i in block {
                let c = self.candidate(hashes[i as usize]);
                if ahead && c != NO_ROW {
                    self.arena.prefetch_key(c as usize);
                }
                rows.push(c);
            }
            for (r, &i) in rows[start..].iter_mut().zip(block) {
                let i = i as usize;
                if *r != NO_ROW && self.arena.key(*r as usize) != keys[i] {
                    *r = self.find(keys[i], hashes[i]).map_or(NO_ROW, |x| x as u32);
                }
            }
        }
    }

    /// As [`Shard::find_many`], creating the rows of absent keys (filled by
    /// `fill(key, row)`) in batch order, after making room in the index for
    /// all of them at once.
    pub fn find_or_insert_many(
        &mut self,
        keys: &[i64],
        hashes: &[u64],
        pos: &[u32],
        generation: u32,
        fill: impl Fn(i64, &mut [f32]),
        rows: &mut Vec<u32>,
    ) {
        self.find_many(keys, hashes, pos, rows);
        self.insert_missing(keys, hashes, pos, generation, fill, rows);
    }

    /// Creates the rows of the positions whose entry in `rows` is
    /// `NO_ROW` (found absent by an earlier probe under this lock, or
    /// under an earlier hold of it with no removal since: a key inserted
    /// meanwhile is found, not inserted twice).
    pub fn insert_missing(
        &mut self,
        keys: &[i64],
        hashes: &[u64],
        pos: &[u32],
        generation: u32,
        fill: impl Fn(i64, &mut [f32]),
        rows: &mut [u32],
    ) {
        let missing = rows.iter().filter(|&&r| r == NO_ROW).count();
        if missing == 0 {
            return;
        }
        self.reserve_index(missing);
        for (r, &i) in rows.iter_mut().zip(pos) {
            if *r == NO_ROW {
                let (key, hash) = (keys[i as usize], hashes[i as usize]);
                let (row, _) = self.find_or_insert(key, hash, generation, |row| fill(key, row));
                *r = row as u32;
            }
        }
    }

    /// The row of `key` (whose hash is `hash`), if present.
    #[inline]
    pub fn find(&self, key: i64, hash: u64) -> Option<usize> {
        let arena = &self.arena;
        let h32 = hash as u32;
        self.index
            .find(index_hash(h32), |&e| {
                e as u32 == h32 && arena.key(entry_row(e)) == key
            })
            .map(|&e| entry_row(e))
    }

    /// The row of `key`, created by `fill` when missing; `true` when created.
    #[inline]
    pub fn find_or_insert(
        &mut self,
        key: i64,
        hash: u64,
        generation: u32,
        fill: impl FnOnce(&mut [f32]),
    ) -> (usize, bool) {
        let arena = &self.arena;
        let h32 = hash as u32;
        match self.index.entry(
            index_hash(h32),
            |&e| e as u32 == h32 && arena.key(entry_row(e)) == key,
            |&e| index_hash(e as u32),
        ) {
            hashbrown::hash_table::Entry::Occupied(e) => (entry_row(*e.get()), false),
            hashbrown::hash_table::Entry::Vacant(e) => {
                let r = self.arena.push(key, generation, fill);
                assert!(r <= u32::MAX as usize, "a shard holds at most 2^32 rows");
                e.insert(entry(r, h32));
                (r, true)
            }
        }
    }

    /// Removes `key`; `true` when it was present.
    pub fn remove(&mut self, key: i64, hash: u64) -> bool {
        let arena = &self.arena;
        let h32 = hash as u32;
        let Ok(found) = self.index.find_entry(index_hash(h32), |&e| {
            e as u32 == h32 && arena.key(entry_row(e)) == key
        }) else {
            return false;
        };
        let (e, _) = found.remove();
        let r = entry_row(e);
        self.removals += 1;
        if self.track_removals {
            self.removed.push(key);
        }
        let last = self.arena.len() - 1;
        if let Some(moved) = self.arena.swap_remove(r) {
            let mh = crate::hash::key_hash(moved) as u32;
            let slot = self
                .index
                .find_mut(index_hash(mh), |&x| x == entry(last, mh))
                .expect("index holds every arena row");
            *slot = entry(r, mh);
        }
        true
    }
}
