//! A shard's index: keys to row numbers, in an open-addressed table of
//! slots (linear probing) that readers probe without a lock while the
//! shard's writer, under the shard's write lock, inserts, removes and moves
//! entries ([`super::seqlock`] has the protocol). The writer grows or
//! cleans the index by building a new one and publishing it; the old one is
//! freed once no reader can still be probing it (crossbeam-epoch).

use crate::hash::key_hash;
use crate::table::storage::arena::OutOfMemory;
use crate::table::storage::pages::PageAlloc;
use crate::table::storage::seqlock::{self, EMPTY, TOMB};
use allocator_api2::alloc::{Allocator, Layout};
use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};

/// Slots in use (live keys and removed ones) at most this fraction of all
/// slots: linear probing's misses stay short (about 8 slots at 3/4).
const LOAD_NUM: usize = 3;
const LOAD_DEN: usize = 4;

/// The fewest slots an index has.
const MIN_SLOTS: usize = 16;

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

/// Atomic integers whose all-zero bytes are the value 0.
///
/// # Safety
/// Implementors must be valid for all-zero bytes.
unsafe trait ZeroAtomic {}
// SAFETY: AtomicI64 has i64's representation; zero bytes are 0.
unsafe impl ZeroAtomic for AtomicI64 {}
// SAFETY: AtomicU32 has u32's representation; zero bytes are 0.
unsafe impl ZeroAtomic for AtomicU32 {}

impl<T: ZeroAtomic> Zeroed<T> {
    fn new(len: usize) -> Result<Self, OutOfMemory> {
        let layout = Layout::array::<T>(len).map_err(|_| OutOfMemory)?;
        let p = PageAlloc.allocate_zeroed(layout).map_err(|_| OutOfMemory)?;
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

/// Frees what the epoch lets free now: unpinned, this thread pins and
/// flushes a few times, each letting the global epoch advance (when no
/// reader is pinned in an older one) and collecting what is two epochs old,
/// so that a replaced index or an emptied segment goes back to the OS at
/// once when no reader holds it, not at some later call's pin.
pub(crate) fn reclaim() {
    for _ in 0..3 {
        epoch::pin().flush();
    }
}

/// Whether memory was handed to the epoch since the last
/// [`reclaim_pending`].
static PENDING: AtomicBool = AtomicBool::new(false);

/// Records that memory was handed to the epoch, and tries to free it now.
pub(crate) fn retire() {
    PENDING.store(true, Ordering::Relaxed);
    reclaim();
}

/// [`reclaim`] if memory was handed to the epoch since the last call: for a
/// writer call's end, when the readers pinned during its growth (its own
/// parallel jobs included) have left.
pub(crate) fn reclaim_pending() {
    if PENDING.load(Ordering::Relaxed) && PENDING.swap(false, Ordering::Relaxed) {
        reclaim();
    }
}

/// One table of slots: keys, and row words (`row + 1`, [`EMPTY`] or
/// [`TOMB`]), in two arrays so that a probe reads a line of 8 keys and
/// reads a row word only for the key it matches.
pub(crate) struct Slots {
    keys: Zeroed<AtomicI64>,
    rows: Zeroed<AtomicU32>,
}

impl std::fmt::Debug for Slots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Slots({})", self.keys.len)
    }
}

impl Slots {
    fn new(n: usize) -> Result<Self, OutOfMemory> {
        debug_assert!(n.is_power_of_two());
        Ok(Slots {
            keys: Zeroed::new(n)?,
            rows: Zeroed::new(n)?,
        })
    }

    /// Number of slots.
    #[inline(always)]
    pub(crate) fn len(&self) -> usize {
        self.keys.len
    }

    /// The first slot a probe for a key of hash `hash` reads.
    #[inline(always)]
    pub(crate) fn home(&self, hash: u64) -> usize {
        (hash as u32 as usize) & (self.len() - 1)
    }

    /// The slot and row of `key` (hash `hash`), if held.
    #[inline(always)]
    pub(crate) fn find(&self, key: i64, hash: u64) -> Option<(usize, usize)> {
        seqlock::probe(self.keys.get(), self.rows.get(), key, self.home(hash))
    }

    /// Whether slot `slot` still names row `row` (see [`seqlock::names`]).
    #[inline(always)]
    pub(crate) fn names(&self, slot: usize, row: usize) -> bool {
        seqlock::names(self.rows.get(), slot, row)
    }

    /// Starts loading the lines a probe for `hash` reads first.
    #[inline(always)]
    pub(crate) fn prefetch(&self, hash: u64) {
        let i = self.home(hash);
        crate::simd::prefetch_addr(self.keys.get().as_ptr().wrapping_add(i) as usize);
        crate::simd::prefetch_addr(self.rows.get().as_ptr().wrapping_add(i) as usize);
    }

    /// Puts `key` (known absent) at row `row` in the first empty slot of
    /// its probe (writer only; a removed key's slot is not reused, so a
    /// slot's key never changes once published).
    fn insert(&self, key: i64, hash: u64, row: usize) {
        let (keys, rows) = (self.keys.get(), self.rows.get());
        let mask = self.len() - 1;
        let mut i = self.home(hash);
        while rows[i].load(Ordering::Relaxed) != EMPTY {
            i = (i + 1) & mask;
        }
        seqlock::publish(keys, rows, i, key, row);
    }

    /// Every live key and its row (writer only).
    fn live(&self) -> impl Iterator<Item = (i64, usize)> + '_ {
        let (keys, rows) = (self.keys.get(), self.rows.get());
        keys.iter().zip(rows).filter_map(|(k, r)| {
            let r = r.load(Ordering::Relaxed);
            (r != EMPTY && r != TOMB).then(|| (k.load(Ordering::Relaxed), r as usize - 1))
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
        ix.mine().map_or(0, |s| s.keys.bytes() + s.rows.bytes())
    }

    /// Keys that fit before the table must be rebuilt.
    pub(crate) fn room(&self, ix: &Index) -> usize {
        (self.slots(ix) / LOAD_DEN * LOAD_NUM).saturating_sub(self.used)
    }

    /// The row of `key` and its slot (writer).
    #[inline(always)]
    pub(crate) fn find(&self, ix: &Index, key: i64, hash: u64) -> Option<(usize, usize)> {
        ix.mine()?.find(key, hash)
    }

    /// The current slots (writer), for batch probes.
    #[inline(always)]
    pub(crate) fn slots_ref<'a>(&self, ix: &'a Index) -> Option<&'a Slots> {
        ix.mine()
    }

    /// Makes room for `additional` more keys: when they would not fit, a
    /// new table sized for the live keys and them (a removal-heavy table
    /// gets a clean one of the same size), published for readers; the old
    /// one is freed when no reader holds it.
    ///
    /// # Errors
    /// When the new table cannot be allocated; the index is unchanged.
    pub(crate) fn reserve(&mut self, ix: &Index, additional: usize) -> Result<(), OutOfMemory> {
        if self.room(ix) >= additional {
            return Ok(());
        }
        let want = self.live.checked_add(additional).ok_or(OutOfMemory)?;
        let n = want
            .checked_mul(LOAD_DEN)
            .map(|x| x.div_ceil(LOAD_NUM))
            .and_then(usize::checked_next_power_of_two)
            .ok_or(OutOfMemory)?
            .max(MIN_SLOTS);
        let new = Slots::new(n)?;
        if let Some(old) = ix.mine() {
            for (k, r) in old.live() {
                new.insert(k, key_hash(k), r);
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
                // (`seqlock::names`) once this is visible, and probes the
                // current table: no reader needs to compare tables per key.
                let rows = o.rows.get();
                for (i, r) in rows.iter().enumerate() {
                    if r.load(Ordering::Relaxed) != EMPTY {
                        seqlock::bury(rows, i);
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

    /// Inserts `key` (known absent) at row `row`; room was made first.
    #[inline]
    pub(crate) fn insert(&mut self, ix: &Index, key: i64, hash: u64, row: usize) {
        if self.room(ix) == 0 {
            self.reserve(ix, 1).expect("out of memory for the index");
        }
        let s = ix.mine().expect("reserve made a table");
        s.insert(key, hash, row);
        self.live += 1;
        self.used += 1;
    }

    /// Removes the key of slot `slot`.
    #[inline]
    pub(crate) fn remove(&mut self, ix: &Index, slot: usize) {
        let s = ix.mine().expect("a removed key was held");
        seqlock::bury(s.rows.get(), slot);
        self.live -= 1;
    }

    /// Points the key of slot `slot` at row `row` (a move).
    #[inline]
    pub(crate) fn repoint(&mut self, ix: &Index, slot: usize, row: usize) {
        let s = ix.mine().expect("a moved key is held");
        seqlock::repoint(s.rows.get(), slot, row);
    }

    /// The slot of the key held at row `row`, whose hash is `hash`.
    pub(crate) fn slot_of_row(&self, ix: &Index, hash: u32, row: usize) -> Option<usize> {
        let s = ix.mine()?;
        let rows = s.rows.get();
        let mask = s.len() - 1;
        let mut i = s.home(u64::from(hash));
        loop {
            let r = rows[i].load(Ordering::Relaxed);
            if r == EMPTY {
                return None;
            }
            if r == row as u32 + 1 {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// Every live key with its row.
    pub(crate) fn live<'a>(&self, ix: &'a Index) -> impl Iterator<Item = (i64, usize)> + 'a {
        ix.mine().into_iter().flat_map(Slots::live)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dict model of the index under inserts, removals and moves: every
    /// live key is found at its row, removed keys are not, and growth and
    /// rebuilds keep every live key.
    #[test]
    fn the_index_follows_a_dict_model_through_growth_and_rebuilds() {
        let ix = Index::default();
        let mut w = Writer::default();
        let mut model = std::collections::HashMap::new();
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
                    w.insert(&ix, key, h, step);
                    model.insert(key, step);
                }
                (Some((slot, r)), Some(want)) => {
                    assert_eq!(r, want, "key {key}");
                    if step % 2 == 0 {
                        w.remove(&ix, slot);
                        model.remove(&key);
                    } else {
                        w.repoint(&ix, slot, step);
                        model.insert(key, step);
                        assert_eq!(w.slot_of_row(&ix, h as u32, step), Some(slot));
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
        assert!(w.slots(&ix) <= 4 * MIN_SLOTS.max(4 * w.len() / 3).next_power_of_two());
    }
}
