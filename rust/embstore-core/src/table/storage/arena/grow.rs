//! How an arena grows: segments reserved and touched ahead of the rows
//! pushed into them, state columns mapped, pages mapped ahead.

use super::*;

impl Arena {
    /// Allocates the segments for `additional` more rows and touches their
    /// memory, so that pushing that many rows later maps no fresh page (a
    /// first write to fresh memory, a page fault and a page clear, is most
    /// of the cost of inserting rows). The reserved rows count in
    /// [`Arena::bytes`] from now on.
    ///
    /// # Errors
    /// When the memory cannot be allocated; nothing was reserved then (the
    /// segments already added stay, empty).
    pub(crate) fn reserve(&mut self, additional: usize) -> Result<(), OutOfMemory> {
        let target = self.len.saturating_add(additional);
        if target <= self.len.max(self.reserved) {
            return Ok(());
        }
        let (last, _) = locate(target - 1);
        while self.tags.len() <= last {
            self.add_segment()?;
        }
        let (first, _) = locate(self.len);
        for k in first..=last {
            let upto = (target - segment_start(k)).min(FIRST << k);
            self.weights.touch(k, upto);
            self.state.touch(k, upto);
            touch_spare(&mut self.tags[k], upto);
            if self.track {
                touch_spare(&mut self.meta[k], upto);
            }
        }
        self.reserved = target;
        self.populated = self.populated.max(target);
        Ok(())
    }

    /// Rows the allocated segments hold (stored and room for more).
    pub(crate) fn room(&self) -> usize {
        if self.tags.is_empty() {
            0
        } else {
            segment_start(self.tags.len())
        }
    }

    /// Allocates (without touching) the segments that rows up to
    /// `target` need, so that pushing up to `target` rows allocates
    /// nothing more.
    ///
    /// # Errors
    /// When the memory cannot be allocated; the segments added before the
    /// failure stay, empty.
    pub(crate) fn ensure_segments(&mut self, target: usize) -> Result<(), OutOfMemory> {
        if target == 0 {
            return Ok(());
        }
        let (last, _) = locate(target - 1);
        while self.tags.len() <= last {
            self.add_segment()?;
        }
        self.map_state(target);
        self.map_ahead(target);
        Ok(())
    }

    /// Maps for writing, now, the pages of the optimizer state of the rows
    /// up to `target` that no earlier request mapped (from
    /// [`MAP_STATE_LEAST_BYTES`] of them): a new row whose state starts at
    /// zero is not written when it is created ([`Column::push`]), and a
    /// step's first access to its state is a read, which would map the
    /// shared zero page, whose copy on the step's write then costs a page
    /// fault and a TLB flush on every core (a state page written first
    /// costs a fault only). The weights are written as rows are created.
    fn map_state(&mut self, target: usize) {
        let from = self.populated.max(self.len);
        if self.sl == 0 || target <= from || (target - from) * 4 * self.sl < MAP_STATE_LEAST_BYTES {
            return;
        }
        for (k, o0, o1) in spans(from, target) {
            self.state.populate_unwritten(k, o0, o1);
        }
    }

    /// Asks for the pages of the rows after `target` (the rows up to which
    /// a call may insert) to be mapped on the populate thread
    /// ([`Ahead`]), so that the next calls' new rows find their memory
    /// mapped: as many rows as this call may add, from 1 to 4 MiB of them
    /// ([`AHEAD_MOST_BYTES`]: what is mapped ahead and never written is at
    /// most that) and never more than an eighth of the rows stored,
    /// within the segments allocated. Nothing for rows that
    /// [`Arena::reserve`] mapped, for a call that adds 4 MiB or more, or
    /// while the arena is too small for an eighth to be 1 MiB.
    fn map_ahead(&mut self, target: usize) {
        let row = 4 * (self.ww + self.sl);
        if target <= self.reserved || row == 0 {
            return;
        }
        // A call that adds as much as the most mapped ahead runs its
        // writes on the pool's threads, which fault its pages on every
        // core: a populate thread would only compete with them (fresh
        // inserts of 65,536 keys into an Adam table ran 15% slower).
        if (target - self.len).saturating_mul(row) >= AHEAD_MOST_BYTES {
            return;
        }
        let least = AHEAD_LEAST_BYTES.div_ceil(row);
        let ahead = (target - self.len)
            .clamp(least, (AHEAD_MOST_BYTES / row).max(least))
            .min(self.len / AHEAD_SHARE);
        if ahead < least || self.populated >= target + ahead / 2 {
            return;
        }
        let from = self.populated.max(target);
        let to = (target + ahead).min(self.room());
        if to <= from {
            return;
        }
        let mut ranges = Vec::new();
        for (k, o0, o1) in spans(from, to) {
            ranges.push(self.weights.addresses(k, o0, o1));
            if self.sl > 0 {
                ranges.push(self.state.addresses(k, o0, o1));
            }
        }
        self.ahead.request(ranges);
        self.populated = to;
    }

    /// Appends the next (empty) segment at its full capacity.
    pub(super) fn add_segment(&mut self) -> Result<(), OutOfMemory> {
        if self.tags.len() >= MAX_SEGS {
            return Err(OutOfMemory);
        }
        let cap = FIRST
            .checked_shl(self.tags.len() as u32)
            .filter(|c| c.checked_mul((self.ww + self.sl).max(8) * 4).is_some())
            .ok_or(OutOfMemory)?;
        let mut tags = Vec::new();
        tags.try_reserve_exact(cap)?;
        let mut meta = Vec::new();
        if self.track {
            meta.try_reserve_exact(cap)?;
        }
        // The float columns last: a failure before them leaves every
        // column with as many segments as before.
        self.weights.add_segment(cap)?;
        if let Err(e) = self.state.add_segment(cap) {
            self.weights.pop_segment();
            return Err(e);
        }
        let k = self.tags.len();
        self.tags.push(tags);
        if self.track {
            self.meta.push(meta);
        }
        let (w, st) = (self.weights.row0(k), self.state.row0(k));
        self.view.publish(k, w, st);
        Ok(())
    }
}
