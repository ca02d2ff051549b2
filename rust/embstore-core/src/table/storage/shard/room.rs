//! A shard's room: the index and rows reserved ahead of a call's inserts,
//! counted against a capacity while the call runs.

use super::Shard;
use crate::table::storage::arena::OutOfMemory;

impl Shard {
    /// Makes room in the index for `additional` more keys.
    pub(crate) fn reserve_index(&mut self, additional: usize) {
        self.try_reserve_index(additional)
            .expect("out of memory for the index");
    }

    /// [`Shard::reserve_index`] that reports running out of memory.
    ///
    /// # Errors
    /// When the index cannot be allocated; it is unchanged then.
    pub(crate) fn try_reserve_index(&mut self, additional: usize) -> Result<(), OutOfMemory> {
        self.reserve_index_sized(additional, false, true)
    }

    /// Makes room in the index for `additional` more keys, a count known
    /// ahead (a load, a `reserve`): a table that must be rebuilt gets the
    /// slots they need at 3/4, not the growing index's half-empty one.
    /// `populate`: its pages mapped now (a `reserve`), not as keys arrive
    /// (a load, whose count comes from a manifest that nothing checked yet).
    ///
    /// # Errors
    /// When the index cannot be allocated; it is unchanged then.
    pub(crate) fn try_reserve_index_exact(
        &mut self,
        additional: usize,
        populate: bool,
    ) -> Result<(), OutOfMemory> {
        self.reserve_index_sized(additional, true, populate)
    }

    fn reserve_index_sized(
        &mut self,
        additional: usize,
        exact: bool,
        populate: bool,
    ) -> Result<(), OutOfMemory> {
        let arena = &mut self.arena;
        self.ix
            .reserve(&self.view.index, additional, exact, populate, |r, slot| {
                arena.set_slot(r, slot)
            })
    }

    /// Makes room in the index for `additional` more keys and allocates and
    /// touches their rows' memory ([`Arena::reserve`]).
    ///
    /// # Errors
    /// When the memory cannot be allocated.
    pub(crate) fn reserve_rows(&mut self, additional: usize) -> Result<(), OutOfMemory> {
        self.try_reserve_index_exact(additional, true)?;
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
                self.try_reserve_index(want).is_ok() && self.arena.ensure_segments(target).is_ok()
            }
            _ => false,
        }
    }

    /// Whether `n` more rows fit, on top of the pending ones, without
    /// allocating.
    pub(crate) fn has_room(&self, n: usize) -> bool {
        let want = self.pending.saturating_add(n);
        self.ix.room(&self.view.index) >= want
            && self.arena.room() >= want.saturating_add(self.len())
    }

    /// Ends a [`Shard::reserve_pending`] of `n` rows (whether or not they
    /// were inserted).
    pub(crate) fn release_pending(&mut self, n: usize) {
        self.pending -= n;
    }
}
