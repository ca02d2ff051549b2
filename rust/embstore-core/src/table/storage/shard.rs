//! One shard: a hash index from key to row number over an [`Arena`].

use crate::policy::Sketch;
use crate::table::NO_ROW;
use crate::table::counters::Counters;
use crate::table::storage::arena::{Arena, OutOfMemory};
use crate::table::storage::pages::PageAlloc;
use hashbrown::HashTable;

/// An index entry: a key and its row number, 12 bytes. Keeping the key in
/// the entry makes a probe read the index only, not the row's storage as
/// well (one cache miss fewer per key in a large table); the arena keeps no
/// copy of the key, only its 32 hash bits, so that a row's entry can be
/// found from the row when the row moves.
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
struct Entry {
    key: i64,
    row: u32,
}

impl Entry {
    #[inline(always)]
    fn key(&self) -> i64 {
        self.key
    }

    #[inline(always)]
    fn row(&self) -> usize {
        self.row as usize
    }
}

/// A batch probe prefetches index lines when it probes at least this many
/// keys in the shard: below it (a call of up to about 512 keys with the
/// default shards), the prefetches cost about what they save.
const PROBE_PREFETCH_MIN: usize = 64;

/// How many keys ahead a batch probe prefetches the index lines.
const PROBE_AHEAD: usize = 8;

/// The addresses of the index lines a probe for a hash reads first: its
/// group's control bytes and its home bucket. hashbrown keeps control byte
/// `i` at `data_end + i` and bucket `i` at `data_end - (i + 1) * 12`, and
/// starts a probe at bucket `hash & mask`; those are its layout, not its
/// API, so the addresses are only ever prefetched (a prefetch of a wrong
/// address costs a wasted fetch, never a wrong result), and a test checks
/// them against `get_bucket` so that a layout change is noticed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IndexLines {
    data_end: usize,
    mask: usize,
}

impl IndexLines {
    /// The first bucket a probe for a key of hash `hash` looks at.
    #[inline(always)]
    fn home(&self, hash: u64) -> usize {
        index_hash(hash as u32) as usize & self.mask
    }

    /// The address of bucket `i`.
    #[inline(always)]
    fn bucket(&self, i: usize) -> usize {
        self.data_end.wrapping_sub((i + 1) * size_of::<Entry>())
    }

    /// Starts loading the lines a probe for `hash` reads first.
    #[inline(always)]
    pub(crate) fn prefetch(&self, hash: u64) {
        let i = self.home(hash);
        crate::simd::prefetch_addr(self.data_end.wrapping_add(i));
        crate::simd::prefetch_addr(self.bucket(i));
    }
}

/// The hash hashbrown sees for a key of hash `hash`: a function of its low
/// 32 bits only, with those bits in both halves so that the slot (low bits)
/// and the tag (top 7 bits) both vary. The table picks shards from the other
/// 32 bits of the key hash ([`crate::hash::shard_of`]).
#[inline(always)]
fn index_hash(h32: u32) -> u64 {
    u64::from(h32) | (u64::from(h32) << 32)
}

/// The hash of an entry, for the index to move it when it grows.
#[inline(always)]
fn rehash(e: &Entry) -> u64 {
    index_hash(crate::hash::key_hash(e.key()) as u32)
}

/// A shard's index and rows. Not synchronized: the table wraps each shard in
/// a lock and takes it once per call.
#[derive(Debug)]
#[allow(clippy::len_without_is_empty)]
pub(crate) struct Shard {
    /// Keys and row numbers ([`Entry`]).
    index: HashTable<Entry, PageAlloc>,
    /// Keys removed since the last save (for incremental checkpoints).
    pub removed: Vec<i64>,
    /// Whether removals are recorded in `removed`: only once the table has
    /// been saved or loaded (before that, no incremental save can follow, so
    /// an eviction-heavy table never saved keeps no list).
    pub track_removals: bool,
    /// Rows.
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
    /// An empty shard of rows of `ww` floats of weights and `sl` of
    /// optimizer state, with per-row metadata when `track`, and an
    /// admission sketch if given.
    pub(crate) fn new(ww: usize, sl: usize, track: bool, sketch: Option<Sketch>) -> Self {
        Shard {
            index: HashTable::new_in(PageAlloc),
            removed: Vec::new(),
            track_removals: false,
            arena: Arena::new(ww, sl, track),
            sketch,
            counters: Counters::default(),
            removals: 0,
            pending: 0,
        }
    }

    /// Rows held.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.arena.len()
    }

    /// Bytes held: rows, keys and the index's allocation.
    pub(crate) fn bytes(&self) -> usize {
        self.arena.bytes()
            + self.index.allocation_size()
            + self.removed.capacity() * 8
            + self.sketch.as_ref().map_or(0, Sketch::bytes)
    }

    /// Makes room in the index for `additional` more keys.
    pub(crate) fn reserve_index(&mut self, additional: usize) {
        self.index.reserve(additional, rehash);
    }

    /// [`Shard::reserve_index`] that reports running out of memory.
    ///
    /// # Errors
    /// When the index cannot be allocated; it is unchanged then.
    pub(crate) fn try_reserve_index(&mut self, additional: usize) -> Result<(), OutOfMemory> {
        self.index
            .try_reserve(additional, rehash)
            .map_err(|_| OutOfMemory)
    }

    /// Makes room in the index for `additional` more keys and allocates and
    /// touches their rows' memory ([`Arena::reserve`]).
    ///
    /// # Errors
    /// When the memory cannot be allocated.
    pub(crate) fn reserve_rows(&mut self, additional: usize) -> Result<(), OutOfMemory> {
        self.index
            .try_reserve(additional, rehash)
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
    pub(crate) fn reserve_pending(&mut self, n: usize) -> Result<(), OutOfMemory> {
        if !self.make_room(n) {
            return Err(OutOfMemory);
        }
        self.pending += n;
        Ok(())
    }

    /// Makes room for `n` more rows on top of the pending ones (index slots
    /// and arena segments) without counting them as pending: for a call
    /// that inserts them at once, under this lock. `false` when the memory
    /// cannot be allocated (the index may have grown; no row changed).
    pub(crate) fn make_room(&mut self, n: usize) -> bool {
        let Some(want) = self.pending.checked_add(n) else {
            return false;
        };
        match self.len().checked_add(want) {
            Some(target) if target <= u32::MAX as usize => {
                self.index.try_reserve(want, rehash).is_ok()
                    && self.arena.ensure_segments(target).is_ok()
            }
            _ => false,
        }
    }

    /// Whether `n` more rows fit, on top of the pending ones, without
    /// allocating.
    pub(crate) fn has_room(&self, n: usize) -> bool {
        let want = self.pending.saturating_add(n);
        self.index.capacity() - self.index.len() >= want
            && self.arena.room() >= want.saturating_add(self.len())
    }

    /// Ends a [`Shard::reserve_pending`] of `n` rows (whether or not they
    /// were inserted).
    pub(crate) fn release_pending(&mut self, n: usize) {
        self.pending -= n;
    }

    /// The rows of the keys at batch positions `pos` (`keys[pos[j]]`, hash
    /// `hashes[pos[j]]`) into `rows` (`NO_ROW` where absent). A probe reads
    /// the index only, so the probes of consecutive keys overlap their cache
    /// misses; from [`PROBE_PREFETCH_MIN`] keys on, the index lines of the
    /// key [`PROBE_AHEAD`] ahead are prefetched too.
    pub(crate) fn find_many(&self, keys: &[i64], hashes: &[u64], pos: &[u32], rows: &mut Vec<u32>) {
        rows.clear();
        rows.reserve(pos.len());
        let lines = (pos.len() >= PROBE_PREFETCH_MIN)
            .then(|| self.index_lines())
            .flatten();
        rows.extend(pos.iter().enumerate().map(|(j, &i)| {
            if let (Some(lines), Some(&ahead)) = (&lines, pos.get(j + PROBE_AHEAD)) {
                lines.prefetch(hashes[ahead as usize]);
            }
            let i = i as usize;
            self.find(keys[i], hashes[i]).map_or(NO_ROW, |r| r as u32)
        }));
    }

    /// Where the index keeps the buckets a hash probes first, or None when
    /// the index is empty; see [`IndexLines`].
    pub(crate) fn index_lines(&self) -> Option<IndexLines> {
        if self.index.is_empty() {
            return None;
        }
        let j = self.index.iter_buckets().next()?;
        let e: &Entry = self.index.get_bucket(j)?;
        let data_end = std::ptr::from_ref(e) as usize + (j + 1) * size_of::<Entry>();
        Some(IndexLines {
            data_end,
            mask: self.index.num_buckets() - 1,
        })
    }

    /// Every key held with its row number, in no particular order.
    pub(crate) fn keys_and_rows(&self) -> impl Iterator<Item = (i64, usize)> + '_ {
        self.index.iter().map(|e| (e.key(), e.row()))
    }

    /// As [`Shard::find_many`], creating the rows of absent keys (filled by
    /// `fill(key, weights, state)`) in batch order, after making room in the index for
    /// all of them at once.
    pub(crate) fn find_or_insert_many(
        &mut self,
        keys: &[i64],
        hashes: &[u64],
        pos: &[u32],
        generation: u32,
        fill: impl Fn(i64, &mut [f32], &mut [f32]),
        rows: &mut Vec<u32>,
    ) {
        self.find_many(keys, hashes, pos, rows);
        self.insert_missing(keys, hashes, pos, generation, fill, rows);
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
        for (r, &i) in rows.iter_mut().zip(pos) {
            if *r == NO_ROW {
                let (key, hash) = (keys[i as usize], hashes[i as usize]);
                let (row, _) = self.find_or_insert(key, hash, generation, |w, st| fill(key, w, st));
                *r = row as u32;
            }
        }
    }

    /// The row of `key` (whose hash is `hash`), if present.
    #[inline]
    pub(crate) fn find(&self, key: i64, hash: u64) -> Option<usize> {
        self.index
            .find(index_hash(hash as u32), |e| e.key() == key)
            .map(Entry::row)
    }

    /// The row of `key`, created by `fill(weights, state)` when missing; `true` when created.
    #[inline]
    pub(crate) fn find_or_insert(
        &mut self,
        key: i64,
        hash: u64,
        generation: u32,
        fill: impl FnOnce(&mut [f32], &mut [f32]),
    ) -> (usize, bool) {
        let h32 = hash as u32;
        match self
            .index
            .entry(index_hash(h32), |e| e.key() == key, rehash)
        {
            hashbrown::hash_table::Entry::Occupied(e) => (e.get().row(), false),
            hashbrown::hash_table::Entry::Vacant(e) => {
                let r = self.arena.push(h32, generation, fill);
                assert!(r <= u32::MAX as usize, "a shard holds at most 2^32 rows");
                e.insert(Entry { key, row: r as u32 });
                (r, true)
            }
        }
    }

    /// Removes `key`; `true` when it was present.
    pub(crate) fn remove(&mut self, key: i64, hash: u64) -> bool {
        let Ok(found) = self
            .index
            .find_entry(index_hash(hash as u32), |e| e.key() == key)
        else {
            return false;
        };
        let (e, _) = found.remove();
        let r = e.row();
        self.removals += 1;
        if self.track_removals {
            self.removed.push(key);
        }
        let last = self.arena.len() - 1;
        if let Some(mh) = self.arena.swap_remove(r) {
            let slot = self
                .index
                .find_mut(index_hash(mh), |x| x.row() == last)
                .expect("index holds every arena row");
            slot.row = r as u32;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::key_hash;

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
            assert_eq!(s.arena.hash32(r), key_hash(key) as u32);
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

    #[test]
    fn index_lines_give_the_bucket_address_of_each_key() {
        let mut s = Shard::new(4, 0, false, None);
        assert!(s.index_lines().is_none(), "an empty index has no lines");
        let mut homes = 0;
        for key in -5_000i64..5_000 {
            s.find_or_insert(key, key_hash(key), 0, |_, _| {});
        }
        let lines = s.index_lines().expect("a filled index has lines");
        for key in -5_000i64..5_000 {
            let hash = key_hash(key);
            let b = s
                .index
                .find_bucket_index(index_hash(hash as u32), |e| e.key() == key)
                .expect("every inserted key is held");
            let e = s.index.get_bucket(b).expect("a found bucket is full");
            // Every key's bucket sits where the layout puts it, so the
            // home bucket's address is right too.
            assert_eq!(lines.bucket(b), std::ptr::from_ref(e) as usize, "key {key}");
            if b == lines.home(hash) {
                homes += 1;
            }
        }
        // Most keys sit in their home bucket or its group, so prefetching
        // the home bucket's line fetches the entry a probe reads.
        assert!(
            homes > 5_000,
            "only {homes} of 10,000 keys in their home bucket"
        );
    }

    #[test]
    fn an_index_entry_is_twelve_bytes() {
        assert_eq!(size_of::<Entry>(), 12);
    }
}
