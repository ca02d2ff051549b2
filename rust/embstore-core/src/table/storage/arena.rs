//! Row storage of one shard: each row's weights and optimizer state, in
//! two columns of fixed-stride floats, with its key's index slot and its
//! save generation, in segments
//! that double in size. A segment is allocated once at its full capacity and
//! never reallocated, so rows never move in memory when the shard grows, no
//! growth copies the arena, and untouched capacity stays unmapped (the OS
//! gives pages on first write), which keeps resident memory equal to the rows
//! stored.

use crate::policy::Meta;
use crate::table::storage::ahead::Ahead;
use crate::table::storage::seqlock;
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

mod grow;

/// Most segments an arena has: segment 26 holds row 2^32 - 1.
pub(super) const MAX_SEGS: usize = 32;

/// The least an arena asks to map ahead ([`Arena::map_ahead`]), in bytes.
const AHEAD_LEAST_BYTES: usize = 1 << 20;

/// The most an arena asks to map ahead, in bytes: what it maps ahead and
/// never writes (a table that stops growing) is at most this a shard.
pub(crate) const AHEAD_MOST_BYTES: usize = 4 << 20;

/// The least state an insert maps before its rows are created
/// ([`Arena::map_state`]).
const MAP_STATE_LEAST_BYTES: usize = 64 << 10;

/// What an arena maps ahead is at most its rows over this.
const AHEAD_SHARE: usize = 8;

/// Rows in the first segment (a power of two); segment `k` holds `FIRST << k`.
const FIRST_SHIFT: u32 = 6;
pub(super) const FIRST: usize = 1 << FIRST_SHIFT;

/// Segment and offset of row `r`.
#[inline(always)]
pub(super) fn locate(r: usize) -> (usize, usize) {
    let x = r + FIRST;
    let k = (usize::BITS - 1 - x.leading_zeros() - FIRST_SHIFT) as usize;
    (k, x - (FIRST << k))
}

/// Per row: the index slot of its key (so that the writer finds the key's
/// word, [`seqlock`], from the row) and the save generation in which the
/// row last changed (for incremental checkpoints), as its distance above
/// the arena's `gen_base` in 16 bits; side by side, since a write of the
/// row updates the one and reads the other. Six bytes a row (packed to
/// two-byte alignment: a tag straddles two cache lines for one row in 16).
#[derive(Debug, Clone, Copy, Default)]
#[repr(C, packed(2))]
pub(crate) struct Tag {
    slot: u32,
    generation: u16,
}

/// How many save generations below the newest one written a rebase
/// ([`Arena::stored_generation`]) keeps exact: a row last changed earlier
/// reads as changed at the new base.
const GEN_KEPT: u32 = 1 << 15;

/// Rows of one shard, indexed densely from 0 to `len`. The keys live in the
/// shard's index only; each row keeps its key's slot there.
#[derive(Debug)]
pub(crate) struct Arena {
    /// The pages asked for ahead of the rows. First, so that it is dropped
    /// (its work marked stale) before the columns free their memory.
    ahead: Ahead,
    /// Rows whose pages need no asking: rows below it were reserved, asked
    /// for ahead (mapped or being mapped), or are the rows of the call
    /// that asked (written by that call).
    populated: usize,
    /// Floats of a row's weights.
    ww: usize,
    /// Floats of a row's optimizer state.
    sl: usize,
    len: usize,
    /// Per row: its [`Tag`].
    tags: Vec<Vec<Tag>>,
    /// The save generation a tag's stored 0 stands for: a row's generation
    /// is `gen_base` plus its tag's. A row whose generation is `gen_base`
    /// may have last changed at any generation up to it.
    gen_base: u32,
    /// Weights, `ww` floats a row. Kept apart from the state so that a
    /// lookup reads memory of weights only: an Adam table's lookups touch a
    /// third of the memory (and of the pages) an interleaved row would make
    /// them touch.
    weights: Column,
    /// Optimizer state, `sl` floats a row.
    state: Column,
    /// Per row, when the table's policy scores rows: its metadata. Empty
    /// otherwise (`track` false).
    meta: Vec<Vec<Meta>>,
    track: bool,
    /// Rows whose memory [`Arena::reserve`] has allocated and touched (the
    /// rows up to this count are resident whether or not they hold a row).
    reserved: usize,
    /// Where readers without the lock find the segments.
    view: Arc<SegView>,
}

/// The segments' addresses, published for readers that hold no lock
/// ([`seqlock`]): each column's row 0, per segment, null for a segment not
/// allocated. A segment given back is unpublished
/// first and freed through the epoch, once no reader can be copying from it.
#[derive(Debug)]
pub(crate) struct SegView {
    ww: usize,
    sl: usize,
    weights: [AtomicPtr<f32>; MAX_SEGS],
    state: [AtomicPtr<f32>; MAX_SEGS],
}

/// Where a reader finds one row: its weights and state (raw: the writer
/// may be changing them).
#[derive(Clone, Copy)]
pub(crate) struct RowAt {
    /// `ww` floats of weights.
    pub weights: *const f32,
    /// `sl` floats of optimizer state.
    pub state: *const f32,
}

impl SegView {
    fn new(ww: usize, sl: usize) -> Self {
        SegView {
            ww,
            sl,
            weights: std::array::from_fn(|_| AtomicPtr::default()),
            state: std::array::from_fn(|_| AtomicPtr::default()),
        }
    }

    /// Floats of a row's weights.
    #[inline(always)]
    pub(crate) fn ww(&self) -> usize {
        self.ww
    }

    /// Where row `r` lives, if its segment is allocated. For a reader
    /// pinned to the epoch (`_guard`): the memory stays allocated while it
    /// is pinned, whatever the writer does.
    #[inline(always)]
    pub(crate) fn row(&self, r: usize, _guard: &crossbeam_epoch::Guard) -> Option<RowAt> {
        let (k, o) = locate(r);
        let w = self.weights.get(k)?.load(Ordering::Acquire);
        if w.is_null() {
            return None;
        }
        let st = self.state[k].load(Ordering::Acquire);
        // Only addresses are computed here (wrapping: no dereference); a
        // published segment has room for `FIRST << k` rows and
        // `o < FIRST << k` (locate). The caller reads through them while
        // pinned (`_guard`): a segment is freed only through the epoch
        // after being unpublished.
        Some(RowAt {
            weights: w.wrapping_add(o * self.ww),
            state: st.wrapping_add(o * self.sl),
        })
    }

    /// Publishes segment `k`.
    fn publish(&self, k: usize, w: *mut f32, st: *mut f32) {
        self.state[k].store(st, Ordering::Release);
        self.weights[k].store(w, Ordering::Release);
    }

    /// Unpublishes segment `k`.
    fn unpublish(&self, k: usize) {
        self.weights[k].store(std::ptr::null_mut(), Ordering::Release);
        self.state[k].store(std::ptr::null_mut(), Ordering::Release);
    }
}

/// A change of one row's floats under way ([`Arena::row_to_change`]): the
/// version in its key's word is odd until this is dropped, so readers
/// without the lock never keep a copy of a half-written row.
pub(crate) struct RowWrite<'a> {
    weights: &'a mut [f32],
    state: &'a mut [f32],
    word: &'a AtomicU64,
    row: usize,
}

impl RowWrite<'_> {
    /// The row's weights and optimizer state.
    #[inline(always)]
    pub(crate) fn parts(&mut self) -> (&mut [f32], &mut [f32]) {
        (self.weights, self.state)
    }
}

impl Drop for RowWrite<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        seqlock::write_end(self.word, self.row);
    }
}

pub(crate) use crate::table::storage::memory::OutOfMemory;

/// The first row of segment `k`.
#[inline]
pub(super) fn segment_start(k: usize) -> usize {
    FIRST * ((1 << k) - 1)
}

/// Rows `from..to` (`from < to`) by segment: (segment, first offset,
/// offset past the last) for each segment they lie in.
fn spans(from: usize, to: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let (first, _) = locate(from);
    let (last, _) = locate(to - 1);
    (first..=last).map(move |k| {
        let base = segment_start(k);
        (
            k,
            from.max(base) - base,
            to.min(segment_start(k + 1)) - base,
        )
    })
}

use crate::table::storage::column::{Column, touch_spare};

impl Arena {
    /// An empty arena of rows of `ww` floats of weights and `sl` of
    /// optimizer state, with per-row [`Meta`] when `track`.
    pub(crate) fn new(ww: usize, sl: usize, track: bool) -> Self {
        Arena {
            ahead: Ahead::default(),
            populated: 0,
            ww,
            sl,
            len: 0,
            tags: Vec::new(),
            gen_base: 0,
            weights: Column::new(ww),
            state: Column::new(sl),
            meta: Vec::new(),
            track,
            reserved: 0,
            view: Arc::new(SegView::new(ww, sl)),
        }
    }

    /// The segments' addresses, for readers without the lock.
    pub(crate) fn view(&self) -> Arc<SegView> {
        self.view.clone()
    }

    /// Floats of a row's optimizer state.
    pub(crate) fn sl(&self) -> usize {
        self.sl
    }

    /// Float words of a row's weights.
    pub(crate) fn weight_words(&self) -> usize {
        self.ww
    }

    /// Whether rows carry metadata.
    pub(crate) fn tracks(&self) -> bool {
        self.track
    }

    /// The metadata of row `r` (default when not tracked).
    #[inline]
    pub(crate) fn meta(&self, r: usize) -> Meta {
        if !self.track {
            return Meta::default();
        }
        let (k, o) = locate(r);
        self.meta[k][o]
    }

    /// The metadata of row `r`, mutably.
    ///
    /// # Panics
    /// If rows are not tracked or `r >= len`.
    #[inline]
    pub(crate) fn meta_mut(&mut self, r: usize) -> &mut Meta {
        let (k, o) = locate(r);
        &mut self.meta[k][o]
    }

    /// Records `n` touches of row `r` (nothing when not tracked).
    #[inline]
    pub(crate) fn touch(&mut self, r: usize, tick: u64, step: u64, n: u32) {
        if self.track {
            self.meta_mut(r).touch(tick, step, n);
        }
    }

    /// Number of rows.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of one row: tag, floats and metadata.
    pub(crate) fn row_bytes(&self) -> usize {
        let meta = if self.track { size_of::<Meta>() } else { 0 };
        size_of::<Tag>() + 4 * (self.ww + self.sl) + meta
    }

    /// Bytes of the rows stored, and of rows reserved (what is
    /// resident).
    pub(crate) fn bytes(&self) -> usize {
        self.len.max(self.reserved) * self.row_bytes()
    }

    /// Of [`Arena::bytes`], the weights' and the optimizer state's.
    pub(crate) fn weight_and_state_bytes(&self) -> (usize, usize) {
        let rows = self.len.max(self.reserved);
        (rows * 4 * self.ww, rows * 4 * self.sl)
    }

    /// The save generation in which row `r` last changed, or a later one:
    /// exact for rows changed at most [`GEN_KEPT`] generations before the
    /// newest generation a row was written in; an older row reads as
    /// changed at the arena's base (a delta since an older save then
    /// writes rows that did not change, which is never wrong).
    #[inline]
    pub(crate) fn generation(&self, r: usize) -> u32 {
        let (k, o) = locate(r);
        self.gen_base + u32::from(self.tags[k][o].generation)
    }

    /// Generation `g` as a tag stores it: its distance above the base,
    /// 0 for a generation at or below it. A generation more than 16 bits
    /// above the base first moves the base up to [`GEN_KEPT`] below `g`,
    /// lowering every row's stored distance by as much (0 at least): one
    /// pass over the tags every 2^15 saves or more.
    #[inline]
    fn stored_generation(&mut self, g: u32) -> u16 {
        let Some(d) = g.checked_sub(self.gen_base) else {
            return 0;
        };
        if let Ok(d) = u16::try_from(d) {
            return d;
        }
        self.rebase(g - GEN_KEPT);
        (g - self.gen_base) as u16
    }

    /// Moves the generations' base up to `base` ([`Arena::stored_generation`]).
    #[cold]
    fn rebase(&mut self, base: u32) {
        let shift = u16::try_from(base - self.gen_base).unwrap_or(u16::MAX);
        for tag in self.tags.iter_mut().flatten() {
            tag.generation = tag.generation.saturating_sub(shift);
        }
        self.gen_base = base;
    }

    /// The index slot of row `r`'s key.
    ///
    /// # Panics
    /// If `r >= len`.
    #[inline]
    pub(crate) fn slot(&self, r: usize) -> usize {
        let (k, o) = locate(r);
        self.tags[k][o].slot as usize
    }

    /// Records that row `r`'s key is in index slot `slot`.
    #[inline]
    pub(crate) fn set_slot(&mut self, r: usize, slot: usize) {
        let (k, o) = locate(r);
        self.tags[k][o].slot = slot as u32;
    }

    /// The weights of row `r` (`ww` floats).
    ///
    /// # Panics
    /// If `r >= len`.
    #[inline]
    pub(crate) fn weights(&self, r: usize) -> &[f32] {
        let (k, o) = locate(r);
        self.weights.row(k, o)
    }

    /// The optimizer state of row `r` (`sl` floats).
    ///
    /// # Panics
    /// If `r >= len`.
    #[inline]
    pub(crate) fn state(&self, r: usize) -> &[f32] {
        let (k, o) = locate(r);
        self.state.row(k, o)
    }

    /// The weights and optimizer state of row `r`, mutably, for a change
    /// made in save generation `g`, which is recorded as the row's
    /// generation (for incremental checkpoints); `word` finds the word of
    /// the row's key (from its slot), whose version is odd until the
    /// change is dropped.
    ///
    /// # Panics
    /// If `r >= len`.
    #[inline]
    pub(crate) fn row_to_change<'a>(
        &'a mut self,
        r: usize,
        g: u32,
        word: impl FnOnce(usize) -> &'a AtomicU64,
    ) -> RowWrite<'a> {
        let stored = self.stored_generation(g);
        let (k, o) = locate(r);
        let tag = &mut self.tags[k][o];
        tag.generation = stored;
        let word = word(tag.slot as usize);
        seqlock::write_begin(word);
        RowWrite {
            weights: self.weights.row_mut(k, o),
            state: self.state.row_mut(k, o),
            word,
            row: r,
        }
    }

    /// Appends a row filled by `fill(weights, state)` (zeros when it gets
    /// them: [`Column::push`]), for a key whose slot
    /// is set after ([`Arena::set_slot`]: the row is filled before its key
    /// is published), and returns its index.
    #[inline]
    pub(crate) fn push(
        &mut self,
        generation: u32,
        fill: impl FnOnce(&mut [f32], &mut [f32]),
    ) -> usize {
        let (r, k) = self.push_tag(generation);
        fill(self.weights.push(k), self.state.push(k));
        self.len += 1;
        r
    }

    /// [`Arena::push`] of a row whose weights are `weights` as stored
    /// (`ww` floats), copied in (a new row is not zeroed first only to be
    /// written over), and whose state `state` writes.
    pub(crate) fn push_weights(
        &mut self,
        generation: u32,
        weights: &[f32],
        state: impl FnOnce(&mut [f32]),
    ) -> usize {
        let (r, k) = self.push_tag(generation);
        self.weights.push_copy(k, weights);
        state(self.state.push(k));
        self.len += 1;
        r
    }

    /// The next row's number and segment, its tag (and metadata) pushed,
    /// ready for its floats.
    fn push_tag(&mut self, generation: u32) -> (usize, usize) {
        let generation = self.stored_generation(generation);
        let r = self.len;
        let (k, _) = locate(r);
        if k == self.tags.len() {
            // Callers reserve room first (`Shard::reserve_pending`), so this
            // allocates only for a caller that did not.
            self.add_segment().expect("out of memory for a row segment");
        }
        if self.track {
            self.meta[k].push(Meta::default());
        }
        self.tags[k].push(Tag {
            slot: u32::MAX,
            generation,
        });
        // A reader that found this row number for a key removed or moved
        // earlier must not keep a copy of the new row's fill.
        seqlock::fill_begin();
        (r, k)
    }

    /// Removes row `r` by moving the last row into its place. When one
    /// moves, `word(slot)` finds the word of the moved row's key (in slot
    /// `slot`), whose version is odd while its floats move and which names
    /// row `r` after; returns that slot.
    ///
    /// # Panics
    /// If `r >= len`.
    pub(crate) fn swap_remove<'a>(
        &mut self,
        r: usize,
        word: impl FnOnce(usize) -> &'a AtomicU64,
    ) -> Option<usize> {
        assert!(r < self.len, "row {r} out of range {}", self.len);
        let last = self.len - 1;
        let moved = if r != last {
            let (lk, lo) = locate(last);
            let (rk, ro) = locate(r);
            let tag = self.tags[lk][lo];
            self.tags[rk][ro] = tag;
            if self.track {
                self.meta[rk][ro] = self.meta[lk][lo];
            }
            let word = word(tag.slot as usize);
            seqlock::write_begin(word);
            self.weights.move_row((lk, lo), (rk, ro));
            self.state.move_row((lk, lo), (rk, ro));
            seqlock::write_end(word, r);
            Some(tag.slot as usize)
        } else {
            None
        };
        let (lk, _) = locate(last);
        self.tags[lk].pop();
        if self.track {
            self.meta[lk].pop();
        }
        self.weights.pop(lk);
        self.state.pop(lk);
        if self.tags[lk].is_empty() && lk + 1 == self.tags.len() && lk > 0 {
            // Give back an emptied top segment (but keep the first one);
            // no page request made before touches it from now on.
            self.ahead.forget();
            self.tags.pop();
            self.view.unpublish(lk);
            let memory = (self.weights.pop_segment(), self.state.pop_segment());
            // Readers pinned now may still copy from it: free it after them.
            crossbeam_epoch::pin().defer(move || drop(memory));
            crate::table::storage::memory::retire();
            if self.track {
                self.meta.pop();
            }
            self.reserved = self.reserved.min(segment_start(self.tags.len()));
            self.populated = self.populated.min(segment_start(self.tags.len()));
        }
        self.len = last;
        moved
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locate_covers_rows_contiguously() {
        let mut expect = (0usize, 0usize);
        for r in 0..10_000 {
            let (k, o) = locate(r);
            assert_eq!((k, o), expect, "row {r}");
            expect = if o + 1 == FIRST << k {
                (k + 1, 0)
            } else {
                (k, o + 1)
            };
        }
    }

    /// Key words by slot, standing in for the shard's index: slot `key`
    /// for the row of key `key`.
    fn words(n: usize) -> Vec<AtomicU64> {
        (0..n).map(|_| AtomicU64::new(0)).collect()
    }

    /// Pushes a row for key `key` (slot `key`) with its weights `key` and
    /// its state `-key`.
    fn push_key(a: &mut Arena, key: u32) -> usize {
        let r = a.push(0, |w, st| {
            w.fill(key as f32);
            st.fill(-(key as f32));
        });
        a.set_slot(r, key as usize);
        r
    }

    /// A row pushed with its weights copied in holds what a row pushed by
    /// a fill that writes the same floats holds, tag and state included,
    /// across segments.
    #[test]
    fn a_row_pushed_with_its_weights_equals_one_filled_with_them() {
        let (mut a, mut b) = (Arena::new(3, 2, true), Arena::new(3, 2, true));
        for i in 0..300u32 {
            let w = [i as f32, -(i as f32), 0.5];
            let ra = a.push(i, |dst, st| {
                dst.copy_from_slice(&w);
                st.fill(i as f32 * 2.0);
            });
            let rb = b.push_weights(i, &w, |st| st.fill(i as f32 * 2.0));
            assert_eq!(ra, rb);
            assert_eq!(b.weights(rb), w);
            assert_eq!(a.state(ra), b.state(rb));
            assert_eq!(a.generation(ra), b.generation(rb));
        }
        assert_eq!(a.len(), b.len());
        assert_eq!(a.bytes(), b.bytes());
    }

    /// Save generations far apart (a table saved more than 2^16 times):
    /// a row reads as changed no earlier than it was, so `generation >
    /// since` (what a delta writes) misses no change; and exactly for rows
    /// and `since` within [`GEN_KEPT`] of the newest generation written.
    #[test]
    fn generations_far_apart_never_hide_a_change() {
        let mut a = Arena::new(2, 0, false);
        let w = words(64);
        let mut real = Vec::new();
        for key in 0..64u32 {
            let r = a.push(1, |wt, _| wt.fill(0.0));
            a.set_slot(r, key as usize);
            real.push(1u32);
        }
        let writes = [7u32, 70_000, 70_001, 140_000, 200_000, 4_000_000_000];
        for (i, &g) in writes.iter().enumerate() {
            for r in (i..64).step_by(i + 2) {
                drop(a.row_to_change(r, g, |s| &w[s]));
                real[r] = g;
            }
            for (r, &got) in real.iter().enumerate() {
                assert!(a.generation(r) >= got, "row {r} reads older at {g}");
                if got >= g - GEN_KEPT.min(g) {
                    assert_eq!(a.generation(r), got, "row {r} at {g}");
                }
            }
            for since in [
                0,
                1,
                6,
                7,
                g / 2,
                g - 40_000.min(g),
                g - GEN_KEPT.min(g),
                g - 1,
                g,
            ] {
                let changed = |r: &usize| real[*r] > since;
                let read = |r: &usize| a.generation(*r) > since;
                assert!(
                    (0..64).filter(changed).all(|r| read(&r)),
                    "a change hidden since {since}"
                );
                if since >= g - GEN_KEPT.min(g) {
                    assert!(
                        (0..64).all(|r| changed(&r) == read(&r)),
                        "not exact since {since}"
                    );
                }
            }
        }
        // A row created at a generation below the base (moved back from
        // disk with its old generation) reads as the base.
        let r = a.push(5, |wt, _| wt.fill(0.0));
        assert_eq!(a.generation(r), 4_000_000_000 - GEN_KEPT);
    }

    #[test]
    fn reserve_touches_segments_and_counts_reserved_rows() {
        let mut a = Arena::new(4, 2, true);
        let per_row = size_of::<Tag>() + 24 + size_of::<Meta>();
        push_key(&mut a, 1);
        a.reserve(1000).unwrap();
        assert_eq!(a.bytes(), 1001 * per_row, "reserved rows count as resident");
        let (last, _) = locate(1000);
        assert_eq!(a.tags.len(), last + 1, "every needed segment exists");
        assert!(a.weights.capacity(last) >= (1001 - segment_start(last)) * 4);
        assert!(a.state.capacity(last) >= (1001 - segment_start(last)) * 2);
        // Reserving less than what is reserved changes nothing.
        a.reserve(10).unwrap();
        assert_eq!(a.bytes(), 1001 * per_row);
        for key in 2..=1500u32 {
            push_key(&mut a, key);
        }
        assert_eq!(a.len(), 1500);
        assert_eq!(a.bytes(), 1500 * per_row, "past the reservation: rows");
        assert_eq!(a.weights(777), &[778.0; 4]);
        assert_eq!(a.state(777), &[-778.0; 2]);
        assert_eq!(a.slot(1499), 1500);
        let w = words(2000);
        while a.len() > 0 {
            a.swap_remove(a.len() - 1, |s| &w[s]);
        }
        // Emptied segments go back, with their reservation; the first stays.
        assert_eq!(a.bytes(), FIRST * per_row);
    }

    #[test]
    fn push_and_swap_remove_keep_slots_weights_and_state_together() {
        for sl in [0, 5] {
            let mut a = Arena::new(3, sl, true);
            let w = words(500);
            for key in 0..500u32 {
                let r = push_key(&mut a, key);
                a.touch(r, u64::from(key), 0, 1);
            }
            // Remove row 10 (key 10): the last row (key 499) moves there,
            // its key's word names row 10 with its version one write on.
            assert_eq!(a.swap_remove(10, |s| &w[s]), Some(499));
            assert_eq!(a.slot(10), 499);
            assert_eq!(w[499].load(Ordering::Relaxed), (2 << 32) | 11);
            assert_eq!(a.weights(10), &[499.0; 3]);
            assert_eq!(a.state(10), vec![-499.0; sl]);
            assert_eq!(a.meta(10).tick, 499, "metadata moves with its row");
            assert_eq!(a.len(), 499);
            // Remove the last row: nothing moves.
            assert_eq!(a.swap_remove(498, |s| &w[s]), None);
            while a.len() > 0 {
                let r = a.len() / 2;
                let moved = a.swap_remove(r, |s| &w[s]);
                if r < a.len() {
                    let k = moved.unwrap();
                    assert_eq!(a.slot(r), k);
                    assert_eq!(a.weights(r), &[k as f32; 3]);
                    assert_eq!(a.state(r), vec![-(k as f32); sl]);
                    let v = w[k].load(Ordering::Relaxed) >> 32;
                    let mut change = a.row_to_change(r, 3, |s| &w[s]);
                    let (wt, st) = change.parts();
                    assert_eq!((wt.len(), st.len()), (3, sl));
                    assert_eq!(
                        w[k].load(Ordering::Relaxed) >> 32,
                        v + 1,
                        "odd while changing"
                    );
                    drop(change);
                    assert_eq!(
                        w[k].load(Ordering::Relaxed),
                        ((v + 2) << 32) | (r as u64 + 1)
                    );
                    assert_eq!(a.generation(r), 3);
                }
            }
            assert_eq!(a.bytes(), 0);
            push_key(&mut a, 7);
            assert_eq!(a.slot(0), 7);
            assert_eq!(a.weights(0), &[7.0; 3]);
        }
    }

    #[test]
    fn rows_of_whole_cache_lines_start_on_a_line() {
        // 16 floats of weights and 32 of state: each row is whole lines.
        let mut a = Arena::new(16, 32, false);
        for key in 0..5_000u32 {
            let r = a.push(0, |w, st| {
                w.fill(key as f32);
                st.fill(1.0);
            });
            a.set_slot(r, key as usize);
        }
        for r in (0..5_000).step_by(7) {
            assert_eq!(a.weights(r).as_ptr() as usize % 64, 0, "weights of row {r}");
            assert_eq!(a.state(r).as_ptr() as usize % 64, 0, "state of row {r}");
            assert_eq!(a.weights(r), &[r as f32; 16]);
        }
        // Removal keeps rows on their lines and moves the right floats.
        let w = words(5_000);
        a.swap_remove(3, |s| &w[s]);
        assert_eq!(a.weights(3), &[4_999.0; 16]);
        assert_eq!(a.weights(3).as_ptr() as usize % 64, 0);
    }

    /// Of the whole pages of rows `o0..o1` of segment `k`'s weights: how
    /// many are resident, and how many there are.
    #[cfg(target_os = "linux")]
    fn resident_rows(a: &Arena, k: usize, o0: usize, o1: usize) -> (usize, usize) {
        let (s, e) = a.weights.addresses(k, o0, o1);
        let (s, e) = (s.next_multiple_of(4096), e / 4096 * 4096);
        (
            crate::table::storage::ahead::resident(s, e - s),
            (e - s) / 4096,
        )
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_growing_arena_maps_the_pages_of_its_next_rows_ahead() {
        if !crate::table::storage::ahead::populate_supported() {
            eprintln!("MADV_POPULATE_WRITE not supported here: skipped");
            return;
        }
        // Rows of 1 KiB: 1 MiB ahead is 1,024 rows, and needs 8,192 stored.
        let mut a = Arena::new(256, 0, false);
        let fill = |a: &mut Arena, n: usize| {
            a.ensure_segments(a.len() + n).unwrap();
            for _ in 0..n {
                let key = a.len() as u32;
                push_key(a, key);
            }
        };
        // (Whether a page is resident says little where the allocator
        // reused memory, so what was asked for is read from `populated`;
        // the pages themselves are checked in `ahead`'s test, on a fresh
        // mapping.)
        for _ in 0..60 {
            fill(&mut a, 100);
        }
        // Too small to map ahead: nothing asked for.
        assert_eq!(a.populated, 0);
        while a.len() < 8_256 {
            fill(&mut a, 64);
        }
        // 64 rows a call: once 8,192 were stored, the 1,024 rows after the
        // last call's (the larger of the call and 1 MiB, within an eighth
        // of the rows) were asked for.
        assert_eq!(a.len(), 8_304);
        crate::table::storage::ahead::settle();
        assert_eq!(a.populated, 8_304 + 1_024);
        let (k, o) = locate(a.len());
        let (resident, pages) = resident_rows(&a, k, o + 8, o + 1_000);
        assert_eq!((resident, pages > 200), (pages, true));
        // A call that adds 4 MiB or more runs on the pool: nothing more.
        fill(&mut a, 4_096);
        assert_eq!(a.populated, 8_304 + 1_024);
        // The rows written on mapped pages hold what was written.
        fill(&mut a, 2_000);
        for r in (0..a.len()).step_by(97) {
            assert_eq!(a.weights(r), &[r as f32; 256][..], "row {r}");
        }
    }
}
