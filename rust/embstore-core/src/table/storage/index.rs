//! A shard's index: keys to row numbers, in an open-addressed table of
//! slots (linear probing) that readers probe without a lock while the
//! shard's writer, under the shard's write lock, inserts, removes and moves
//! entries ([`super::seqlock`] has the protocol). The writer grows or
//! cleans the index by building a new one and publishing it; the old one is
//! freed once no reader can still be probing it (crossbeam-epoch).

use crate::hash::key_hash;
use crate::table::storage::memory::{OutOfMemory, retire};
use crate::table::storage::pages::PageAlloc;
use crate::table::storage::seqlock::{self, Cell, EMPTY, TOMB};
use allocator_api2::alloc::{Allocator, Layout};
use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

/// Slots in use (live keys and removed ones) at most this fraction of all
/// slots: linear probing's misses stay short (about 8 slots at 3/4).
const LOAD_NUM: usize = 3;
const LOAD_DEN: usize = 4;

/// The fewest slots an index has.
const MIN_SLOTS: usize = 16;

/// An index that grows as keys arrive grows to twice the keys it must hold
/// (half full), and to at least this many times its slots (as a fraction):
/// between rebuilds it is then 1/2 to 3/4 full (3/8 to 3/4 when it grew to
/// powers of two), for half again the rebuilding work of doubling. An
/// index sized for a count known ahead (a load, a `reserve`) gets the
/// slots that count needs at 3/4, or half again its slots where that is
/// more ([`slots_for`]).
const GROW_NUM: usize = 3;
const GROW_DEN: usize = 2;

/// Slot counts past this are multiples of it (a 1 KiB block of slots).
const SLOT_STEP: usize = 64;

/// `len` zeroed values of an atomic integer type, from [`PageAlloc`]: large
/// arrays come from the OS already zero and unmapped until written, so an
/// index's empty slots cost address space, not memory.
struct Zeroed<T> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: a `Zeroed` owns its array of atomics, which are Send and Sync.
unsafe impl<T: Send> Send for Zeroed<T> {}
// SAFETY: as above; shared access goes through the atomics.
unsafe impl<T: Sync> Sync for Zeroed<T> {}

/// Values of atomics whose all-zero bytes are valid (each atomic 0).
///
/// # Safety
/// Implementors must be valid for all-zero bytes.
unsafe trait ZeroAtomic {}
// SAFETY: a Cell is an AtomicI64 and an AtomicU64 (repr(C)), each with its
// integer's representation, so zero bytes are key 0 and word 0.
unsafe impl ZeroAtomic for Cell {}

impl<T: ZeroAtomic> Zeroed<T> {
    /// `populate`: map every page now, for writing (see [`Slots::new`]).
    fn new(len: usize, populate: bool) -> Result<Self, OutOfMemory> {
        let layout = Layout::array::<T>(len).map_err(|_| OutOfMemory)?;
        let p = PageAlloc.allocate_zeroed(layout).map_err(|_| OutOfMemory)?;
        let start = p.cast::<u8>().as_ptr();
        crate::huge::advise_huge(start, layout.size(), true);
        if populate {
            crate::table::storage::pages::populate(start as usize, start as usize + layout.size());
        }
        Ok(Zeroed { ptr: p.cast(), len })
    }

    #[inline(always)]
    fn get(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` values of T, zero-initialized (valid,
        // `ZeroAtomic`) and alive until drop; only shared access is given.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn bytes(&self) -> usize {
        self.len * size_of::<T>()
    }
}

impl<T> Drop for Zeroed<T> {
    fn drop(&mut self) {
        let layout = Layout::array::<T>(self.len).expect("the layout it was allocated with");
        // SAFETY: allocated by PageAlloc with this layout in `new`, freed once.
        unsafe { PageAlloc.deallocate(self.ptr.cast(), layout) };
    }
}

/// One table of slots, each a key and its word ([`seqlock`]: row and
/// version), side by side so that a probe reads one line for both.
pub(crate) struct Slots {
    cells: Zeroed<Cell>,
}

impl std::fmt::Debug for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Slots({})", self.cells.len)
    }
}

impl Slots {
    /// `n` empty slots. `populate`: every page mapped for writing now, for
    /// a table about to be filled (a growth moves the keys in, a call's
    /// new keys or a `reserve`'s follow): a probe reads a slot before an
    /// insert writes it, so a page left unmapped took a read fault (the
    /// zero page), then a write fault and a flush of the other cores' TLBs
    /// (fresh inserts into an 8-shard table spent 10% of their time
    /// there). Not for a count that nothing backs yet (a load's manifest,
    /// untrusted): that table's pages map as keys arrive.
    fn new(n: usize, populate: bool) -> Result<Self, OutOfMemory> {
        // Slots are named by u32 in the rows' tags.
        if n == 0 || n > u32::MAX as usize {
            return Err(OutOfMemory);
        }
        Ok(Slots {
            cells: Zeroed::new(n, populate)?,
        })
    }

    /// Number of slots.
    #[inline(always)]
    pub(crate) fn len(&self) -> usize {
        self.cells.len
    }

    /// The first slot a probe for a key of hash `hash` reads: the hash's
    /// low 32 bits scaled to the slots (a multiply, so any number of slots
    /// works; the shard was chosen by the high 32, [`crate::hash::shard_of`]).
    #[inline(always)]
    pub(crate) fn home(&self, hash: u64) -> usize {
        ((u64::from(hash as u32) * self.len() as u64) >> 32) as usize
    }

    /// The slot of `key` (hash `hash`) and its word, if held.
    #[inline(always)]
    pub(crate) fn find(&self, key: i64, hash: u64) -> Option<(usize, u64)> {
        seqlock::probe(self.cells.get(), key, self.home(hash))
    }

    /// Slot `slot`.
    #[inline(always)]
    pub(crate) fn cell(&self, slot: usize) -> &Cell {
        &self.cells.get()[slot]
    }

    /// Starts loading the line a probe for `hash` reads first.
    #[inline(always)]
    pub(crate) fn prefetch(&self, hash: u64) {
        let i = self.home(hash);
        crate::simd::prefetch_addr(self.cells.get().as_ptr().wrapping_add(i) as usize);
    }

    /// Puts `key` (known absent) with word `word` in the first empty slot
    /// of its probe and returns the slot (writer only; a removed key's slot
    /// is not reused, so a slot's key never changes once published).
    /// `publish`: the slots are readable (release the word); otherwise a
    /// rebuild no reader sees yet.
    fn insert(&self, key: i64, hash: u64, word: u64, publish: bool) -> usize {
        let cells = self.cells.get();
        let mut i = self.home(hash);
        while seqlock::row_of(cells[i].word.load(Ordering::Relaxed)) != EMPTY {
            i += 1;
            if i == cells.len() {
                i = 0;
            }
        }
        if publish {
            seqlock::publish(cells, i, key, word as usize - 1);
        } else {
            seqlock::copy_in(cells, i, key, word);
        }
        i
    }

    /// Every key live now, with its slot and word, for a reader: each word
    /// is acquired before its key is read (the key was stored before the
    /// word was released), and the words are the reader's to check.
    pub(crate) fn live_now(&self) -> impl Iterator<Item = (usize, i64, u64)> + '_ {
        self.cells.get().iter().enumerate().filter_map(|(i, c)| {
            let w = c.word.load(Ordering::Acquire);
            let r = seqlock::row_of(w);
            (r != EMPTY && r != TOMB).then(|| (i, c.key.load(Ordering::Relaxed), w))
        })
    }

    /// Every live key and its word (writer only).
    fn live(&self) -> impl Iterator<Item = (i64, u64)> + '_ {
        self.cells.get().iter().filter_map(|c| {
            let w = c.word.load(Ordering::Relaxed);
            let r = seqlock::row_of(w);
            (r != EMPTY && r != TOMB).then(|| (c.key.load(Ordering::Relaxed), w))
        })
    }
}

/// The readers' side of a shard's index: the current [`Slots`].
#[derive(Debug, Default)]
pub(crate) struct Index {
    slots: Atomic<Slots>,
}

impl Drop for Index {
    fn drop(&mut self) {
        // SAFETY: dropping the index, no reader or writer can hold it; the
        // current slots are freed here, earlier ones were deferred.
        unsafe {
            let g = epoch::unprotected();
            let s = self.slots.load(Ordering::Relaxed, g);
            if !s.is_null() {
                drop(s.into_owned());
            }
        }
    }
}

impl Index {
    /// The current slots, for a reader pinned by `guard` (None while the
    /// index has never held a key).
    #[inline(always)]
    pub(crate) fn load<'g>(&self, guard: &'g Guard) -> Option<&'g Slots> {
        // SAFETY: slots are published whole (release) and freed only
        // through the epoch after being replaced, so while `guard` pins
        // this thread the slots loaded stay alive.
        unsafe { self.slots.load(Ordering::Acquire, guard).as_ref() }
    }

    /// Whether `slots` is still the current table (a reader's check that
    /// its probe was not of a replaced index).
    #[inline(always)]
    pub(crate) fn is_current(&self, slots: &Slots, guard: &Guard) -> bool {
        std::ptr::eq(self.slots.load(Ordering::Acquire, guard).as_raw(), slots)
    }

    /// The current slots, for the writer (who holds the shard's write lock:
    /// no one else replaces or frees them meanwhile).
    #[inline(always)]
    fn mine(&self) -> Option<&Slots> {
        // SAFETY: only the writer replaces the slots and defers the old
        // ones' free; the writer is the caller, so they outlive this
        // borrow of `self`.
        unsafe {
            self.slots
                .load(Ordering::Relaxed, epoch::unprotected())
                .as_ref()
        }
    }
}

/// The writer's side of a shard's index: what only the writer counts.
#[derive(Debug, Default)]
pub(crate) struct Writer {
    /// Live keys.
    live: usize,
    /// Slots holding a key, live or removed.
    used: usize,
}

impl Writer {
    /// Live keys.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.live
    }

    /// Slots of the current table.
    pub(crate) fn slots(&self, ix: &Index) -> usize {
        ix.mine().map_or(0, Slots::len)
    }

    /// Bytes of the current table.
    pub(crate) fn bytes(&self, ix: &Index) -> usize {
        ix.mine().map_or(0, |s| s.cells.bytes())
    }

    /// Keys that fit before the table must be rebuilt.
    pub(crate) fn room(&self, ix: &Index) -> usize {
        (self.slots(ix) / LOAD_DEN * LOAD_NUM).saturating_sub(self.used)
    }

    /// The slot of `key` and its row (writer).
    #[inline(always)]
    pub(crate) fn find(&self, ix: &Index, key: i64, hash: u64) -> Option<(usize, usize)> {
        let (slot, w) = ix.mine()?.find(key, hash)?;
        Some((slot, seqlock::row_named(w)))
    }

    /// The word of slot `slot` (writer), for a write of its key's floats.
    #[inline(always)]
    pub(crate) fn word<'a>(&self, ix: &'a Index, slot: usize) -> &'a AtomicU64 {
        &self.cell(ix, slot).word
    }

    /// Slot `slot` (writer): its key, and its word for a write of the
    /// key's floats.
    #[inline(always)]
    pub(crate) fn cell<'a>(&self, ix: &'a Index, slot: usize) -> &'a Cell {
        ix.mine().expect("a key's slot").cell(slot)
    }

    /// The current slots (writer), for batch probes.
    #[inline(always)]
    pub(crate) fn slots_ref<'a>(&self, ix: &'a Index) -> Option<&'a Slots> {
        ix.mine()
    }

    /// Makes room for `additional` more keys: when they would not fit, a
    /// new table (sized by [`slots_for`]: `exact`, for a count known ahead,
    /// or growing as keys arrive; a removal-heavy table gets a clean one of
    /// the same size), published for readers; the old one is freed when no
    /// reader holds it. `moved(row, slot)` is told the new slot of each
    /// key's row.
    ///
    /// # Errors
    /// When the new table cannot be allocated; the index is unchanged.
    pub(crate) fn reserve(
        &mut self,
        ix: &Index,
        additional: usize,
        exact: bool,
        populate: bool,
        mut moved: impl FnMut(usize, usize),
    ) -> Result<(), OutOfMemory> {
        if self.room(ix) >= additional {
            return Ok(());
        }
        let want = self.live.checked_add(additional).ok_or(OutOfMemory)?;
        let n = slots_for(want, self.slots(ix), exact).ok_or(OutOfMemory)?;
        let new = Slots::new(n, populate)?;
        if let Some(old) = ix.mine() {
            for (k, w) in old.live() {
                // Versions carry over: a key keeps counting its writes.
                let slot = new.insert(k, key_hash(k), w, false);
                moved(seqlock::row_named(w), slot);
            }
        }
        {
            let guard = epoch::pin();
            let old = ix.slots.swap(Owned::new(new), Ordering::AcqRel, &guard);
            // SAFETY: the old slots stay alive until the deferred destroy
            // below runs, after this guard.
            if let Some(o) = unsafe { old.as_ref() } {
                // Every key of the replaced table is marked removed there,
                // so a reader that found a row in it fails its check
                // (`seqlock::read_end`) once this is visible, and probes
                // the current table: no reader compares tables per key.
                let cells = o.cells.get();
                for (i, c) in cells.iter().enumerate() {
                    if seqlock::row_of(c.word.load(Ordering::Relaxed)) != EMPTY {
                        seqlock::bury(cells, i);
                    }
                }
            }
            if !old.is_null() {
                // SAFETY: `old` is no longer reachable from the index;
                // readers that loaded it are pinned, and the epoch frees it
                // after them.
                unsafe { guard.defer_destroy(old) };
            }
        }
        retire();
        self.used = self.live;
        Ok(())
    }

    /// Inserts `key` (known absent) at row `row`, whose floats are written,
    /// and returns its slot; room was made first ([`Writer::reserve`]).
    ///
    /// # Panics
    /// If there is no room.
    #[inline]
    pub(crate) fn insert(&mut self, ix: &Index, key: i64, hash: u64, row: usize) -> usize {
        assert!(self.room(ix) > 0, "room is made before an insert");
        let s = ix.mine().expect("reserve made a table");
        let slot = s.insert(key, hash, row as u64 + 1, true);
        self.live += 1;
        self.used += 1;
        slot
    }

    /// Removes the key of slot `slot`.
    #[inline]
    pub(crate) fn remove(&mut self, ix: &Index, slot: usize) {
        let s = ix.mine().expect("a removed key was held");
        seqlock::bury(s.cells.get(), slot);
        self.live -= 1;
    }

    /// Every live key with its row.
    pub(crate) fn live<'a>(&self, ix: &'a Index) -> impl Iterator<Item = (i64, usize)> + 'a {
        ix.mine()
            .into_iter()
            .flat_map(Slots::live)
            .map(|(k, w)| (k, seqlock::row_named(w)))
    }
}

/// The slots of a new table for `want` keys replacing one of `current`
/// slots: where `want` does not fit `current` at 3/4, at least
/// [`GROW_NUM`]/[`GROW_DEN`] of `current` (so that reserving a little at a
/// time, as inserting does, rebuilds a number of times logarithmic in the
/// keys) and `want` at 3/4 (`exact`) or at 1/2 (growing); else `current`
/// (a clean copy). Past [`SLOT_STEP`], a multiple of it; None: too many to
/// count.
fn slots_for(want: usize, current: usize, exact: bool) -> Option<usize> {
    let need = want
        .checked_mul(LOAD_DEN)?
        .div_ceil(LOAD_NUM)
        .max(MIN_SLOTS);
    let n = if need <= current {
        current
    } else {
        let grown = current.checked_mul(GROW_NUM)? / GROW_DEN;
        let room = if exact {
            need
        } else {
            want.checked_mul(2)?.max(need)
        };
        room.max(grown)
    };
    if n <= SLOT_STEP {
        Some(n.next_power_of_two())
    } else {
        n.checked_next_multiple_of(SLOT_STEP)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new index about to be filled is mapped for writing when it is made
    /// (a probe reads each slot before an insert writes it: left unmapped,
    /// each page took a read fault, then a write fault and a flush of every
    /// core's TLB); one sized by a count nothing backs yet is not.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_new_index_is_mapped_when_made() {
        use crate::table::storage::ahead::{populate_supported, resident};
        if !populate_supported() {
            eprintln!("MADV_POPULATE_WRITE not supported here: skipped");
            return;
        }
        // 4 MiB of slots: a mapping of its own (PageAlloc), page-aligned.
        let s = Slots::new(1 << 18, true).unwrap();
        let (start, len) = (s.cells.ptr.as_ptr() as usize, s.cells.bytes());
        assert_eq!(start % 4096, 0);
        assert_eq!(resident(start, len), len / 4096);
        // Not for a count nothing backs yet (a load's manifest): untouched.
        let s = Slots::new(1 << 18, false).unwrap();
        let (start, len) = (s.cells.ptr.as_ptr() as usize, s.cells.bytes());
        assert_eq!(resident(start, len), 0);
    }

    /// Table sizes: a count known ahead at 3/4; a growing index at 1/2
    /// after each growth and half again its slots at least, so between
    /// rebuilds it is 1/2 to 3/4 full whatever the batches; a clean copy of
    /// a removal-heavy one the same size.
    #[test]
    fn tables_are_sized_at_three_quarters_or_grow_to_half_full() {
        assert_eq!(slots_for(0, 0, true), Some(16));
        assert_eq!(slots_for(7_500_000, 0, true), Some(10_000_000));
        assert_eq!(slots_for(7_500_000, 0, false), Some(15_000_000));
        assert_eq!(slots_for(1_000, 1_024, false), Some(2_048));
        assert_eq!(slots_for(800, 1_024, false), Some(1_600));
        // A count known ahead: 3/4, or half again when that is more.
        assert_eq!(slots_for(800, 1_024, true), Some(1_536));
        assert_eq!(slots_for(3_000, 1_024, true), Some(4_032));
        // Reserving a little at a time grows geometrically, not a rebuild
        // a call.
        let (mut n, mut rebuilds) = (0usize, 0);
        for keys in (1_000..1_000_000).step_by(1_000) {
            if keys * 4 > n * 3 {
                n = slots_for(keys, n, true).unwrap();
                rebuilds += 1;
            }
        }
        assert!(rebuilds <= 25, "{rebuilds} rebuilds");
        assert_eq!(slots_for(100, 1_024, false), Some(1_024));
        assert_eq!(slots_for(usize::MAX / 2, 16, false), None);
        for batch in [1usize, 100, 10_000, 300_000] {
            let (mut n, mut keys, mut low) = (0usize, 0usize, 1.0f64);
            while keys < 5_000_000 {
                if (keys + batch) * 4 > n * 3 {
                    n = slots_for(keys + batch, n, false).unwrap();
                }
                keys += batch;
                assert!(keys * 4 <= n * 3);
                if keys > 10_000 {
                    low = low.min(keys as f64 / n as f64);
                }
            }
            assert!(low >= 0.49, "batches of {batch}: lowest load {low}");
        }
    }

    /// A dict model of the index under inserts, removals and moves: every
    /// live key is found at its row, removed keys are not, growth and
    /// rebuilds keep every live key and report each row's new slot, and a
    /// move bumps the key's version by one write.
    #[test]
    fn the_index_follows_a_dict_model_through_growth_and_rebuilds() {
        let ix = Index::default();
        let mut w = Writer::default();
        let mut model = std::collections::HashMap::new();
        // Row -> slot, as the arena keeps it.
        let mut slot_of = std::collections::HashMap::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for step in 0..50_000usize {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Key 0 and negative keys included.
            let key = (x % 3_000) as i64 - 1_500;
            let h = key_hash(key);
            match (w.find(&ix, key, h), model.get(&key).copied()) {
                (None, None) => {
                    w.reserve(&ix, 1, step % 3 == 0, step % 2 == 0, |r, slot| {
                        slot_of.insert(r, slot);
                    })
                    .unwrap();
                    let slot = w.insert(&ix, key, h, step);
                    slot_of.insert(step, slot);
                    model.insert(key, step);
                }
                (Some((slot, r)), Some(want)) => {
                    assert_eq!(r, want, "key {key}");
                    assert_eq!(slot_of[&r], slot, "the slot reported for row {r}");
                    if step % 2 == 0 {
                        w.remove(&ix, slot);
                        model.remove(&key);
                    } else {
                        let word = w.word(&ix, slot);
                        let v = word.load(Ordering::Relaxed) >> 32;
                        seqlock::write_begin(word);
                        assert!(seqlock::writing(word.load(Ordering::Relaxed)));
                        seqlock::write_end(word, step);
                        assert_eq!(word.load(Ordering::Relaxed) >> 32, v + 2);
                        slot_of.insert(step, slot);
                        model.insert(key, step);
                    }
                }
                (got, want) => panic!("key {key}: index {got:?}, model {want:?}"),
            }
        }
        assert_eq!(w.len(), model.len());
        let mut live: Vec<_> = w.live(&ix).collect();
        live.sort_unstable();
        let mut want: Vec<_> = model.into_iter().collect();
        want.sort_unstable();
        assert_eq!(live, want);
        assert!(w.slots(&ix) <= 4 * MIN_SLOTS.max(2 * w.len()).next_multiple_of(SLOT_STEP));
    }
}
