//! One column of an arena's rows (weights or optimizer state): floats in
//! segments that never move, each segment's rows aligned to a cache line.

use crate::table::storage::memory::OutOfMemory;
use crate::table::storage::pages::PageAlloc;
use allocator_api2::boxed::Box;

/// Floats of one column (weights or optimizer state), `stride` a row, in
/// the arena's segments. Each segment's rows start at a 64-byte boundary
/// (the allocator only promises 16): a row of 64 floats then spans 4
/// cache lines, not 5, and a lookup or pooling pass, bound by the lines it
/// fetches, fetches a fifth fewer.
///
/// A segment is one zeroed block at its full size (from the OS, mapped on
/// first touch, for 64 KiB and more: [`PageAlloc`]), and the column knows
/// from where on its floats were never written: a row pushed there is
/// zero without a write, so a new row's optimizer state that starts at
/// zero is not written at all (its pages are mapped for writing by the
/// arena before a large insert: `Arena::map_state`).
#[derive(Debug)]
pub(crate) struct Column {
    stride: usize,
    segs: Vec<Segment>,
}

/// One segment of a column: `pad` leading floats up to the line
/// boundary, then rows.
#[derive(Debug)]
pub(crate) struct Segment {
    floats: Box<[f32], PageAlloc>,
    pad: usize,
    /// Floats in use, `pad` included.
    len: usize,
    /// Floats from which every float is zero (never written since the
    /// block was allocated zeroed, or zeroed again).
    clean: usize,
}

impl Segment {
    /// Maps for writing the pages of floats `from..to` (within the block).
    fn populate(&self, from: usize, to: usize) {
        let to = to.min(self.floats.len());
        if to > from {
            let p = self.floats[from..to].as_ptr() as usize;
            crate::table::storage::pages::populate(p, p + 4 * (to - from));
        }
    }
}

/// Floats in a cache line.
const LINE_FLOATS: usize = 16;

impl Column {
    pub(super) fn new(stride: usize) -> Self {
        Column {
            stride,
            segs: Vec::new(),
        }
    }

    /// Appends an empty segment with room for `cap` rows.
    pub(super) fn add_segment(&mut self, cap: usize) -> Result<(), OutOfMemory> {
        let n = if self.stride > 0 {
            cap.checked_mul(self.stride)
                .and_then(|f| f.checked_add(LINE_FLOATS - 1))
                .ok_or(OutOfMemory)?
        } else {
            0
        };
        let zeroed = Box::<[f32], PageAlloc>::try_new_zeroed_slice_in(n, PageAlloc)
            .map_err(|_| OutOfMemory)?;
        // SAFETY: every float of the block is zero bytes, which is 0.0.
        let floats = unsafe { zeroed.assume_init() };
        crate::huge::advise_huge(floats.as_ptr().cast(), 4 * n, false);
        // Floats from the block's start to the next line boundary (the
        // address is a multiple of 4: it holds f32s).
        let misalign = floats.as_ptr() as usize % (4 * LINE_FLOATS);
        let pad = if n == 0 {
            0
        } else {
            (4 * LINE_FLOATS - misalign) % (4 * LINE_FLOATS) / 4
        };
        self.segs.push(Segment {
            floats,
            pad,
            len: pad,
            clean: pad,
        });
        Ok(())
    }

    /// Removes the last segment and returns its memory (to free once no
    /// reader can be reading it).
    pub(super) fn pop_segment(&mut self) -> Option<Segment> {
        self.segs.pop()
    }

    /// Where segment `k`'s row 0 starts, for readers.
    pub(super) fn row0(&mut self, k: usize) -> *mut f32 {
        let seg = &mut self.segs[k];
        seg.floats.as_mut_ptr().wrapping_add(seg.pad)
    }

    #[inline(always)]
    pub(super) fn span(&self, k: usize, o: usize) -> std::ops::Range<usize> {
        let start = self.segs[k].pad + o * self.stride;
        start..start + self.stride
    }

    /// Row `o` of segment `k`.
    ///
    /// # Panics
    /// If the row is not in use.
    #[inline(always)]
    pub(super) fn row(&self, k: usize, o: usize) -> &[f32] {
        let seg = &self.segs[k];
        &seg.floats[..seg.len][self.span(k, o)]
    }

    /// Row `o` of segment `k`, mutably.
    ///
    /// # Panics
    /// If the row is not in use.
    #[inline(always)]
    pub(super) fn row_mut(&mut self, k: usize, o: usize) -> &mut [f32] {
        let span = self.span(k, o);
        let seg = &mut self.segs[k];
        &mut seg.floats[..seg.len][span]
    }

    /// The next row of segment `k`, taken into use: its floats start where
    /// [`Column::push`] and [`Column::push_copy`] write.
    ///
    /// # Panics
    /// If the segment is full (callers add segments first).
    #[inline]
    fn take_row(&mut self, k: usize) -> (&mut [f32], bool) {
        let stride = self.stride;
        let seg = &mut self.segs[k];
        let start = seg.len;
        let end = start + stride;
        assert!(end <= seg.floats.len(), "a segment holds its capacity");
        let clean = start >= seg.clean;
        seg.len = end;
        seg.clean = seg.clean.max(end);
        (&mut seg.floats[start..end], clean)
    }

    /// Appends a zeroed row to segment `k` and returns it (zero already
    /// where the segment was never written there: nothing is written then).
    #[inline]
    pub(super) fn push(&mut self, k: usize) -> &mut [f32] {
        let (row, clean) = self.take_row(k);
        if !clean {
            row.fill(0.0);
        }
        row
    }

    /// Appends row `src` (`stride` floats) to segment `k`: copied in
    /// (streamed past the cache where large: [`copy_streaming`]), where
    /// [`Column::push`] zeroes a row for its caller to write.
    ///
    /// [`copy_streaming`]: crate::simd::copy_streaming
    #[inline]
    pub(super) fn push_copy(&mut self, k: usize, src: &[f32]) {
        assert_eq!(src.len(), self.stride, "a row is `stride` floats");
        crate::simd::copy_streaming(self.take_row(k).0, src);
    }

    /// The byte addresses of rows `o0..o1` of segment `k` (within its
    /// capacity; not necessarily written yet).
    pub(super) fn addresses(&self, k: usize, o0: usize, o1: usize) -> (usize, usize) {
        let seg = &self.segs[k];
        let base = seg.floats.as_ptr() as usize + 4 * seg.pad;
        (base + 4 * o0 * self.stride, base + 4 * o1 * self.stride)
    }

    /// Removes the last row of segment `k`.
    #[inline]
    pub(super) fn pop(&mut self, k: usize) {
        let seg = &mut self.segs[k];
        assert!(seg.len >= seg.pad + self.stride, "the segment has a row");
        seg.len -= self.stride;
    }

    /// Maps the memory of segment `k`'s first `rows` rows: the rows past
    /// those in use are zeroed where written before, and their pages
    /// faulted in for writing where never written ([`populate`]).
    ///
    /// [`populate`]: crate::table::storage::pages::populate
    pub(super) fn touch(&mut self, k: usize, rows: usize) {
        let seg = &mut self.segs[k];
        let upto = (seg.pad + rows * self.stride).min(seg.floats.len());
        if upto <= seg.len {
            return;
        }
        let written = seg.clean.min(upto);
        if written > seg.len {
            seg.floats[seg.len..written].fill(0.0);
        }
        seg.populate(written, upto);
        if upto >= seg.clean {
            seg.clean = seg.len;
        }
    }

    /// Maps for writing the pages of rows `o0..o1` of segment `k` past
    /// where it was ever written ([`populate`]: the contents stay zero).
    ///
    /// [`populate`]: crate::table::storage::pages::populate
    pub(super) fn populate_unwritten(&self, k: usize, o0: usize, o1: usize) {
        let seg = &self.segs[k];
        seg.populate(
            (seg.pad + o0 * self.stride).max(seg.clean),
            seg.pad + o1 * self.stride,
        );
    }

    /// Copies row `from` (segment, offset) over row `to`, which comes
    /// before it (an earlier segment, or an earlier offset of the same one).
    pub(super) fn move_row(&mut self, from: (usize, usize), to: (usize, usize)) {
        let (src, dst) = (self.span(from.0, from.1), self.span(to.0, to.1));
        if from.0 == to.0 {
            let seg = &mut self.segs[to.0];
            seg.floats[..seg.len].copy_within(src, dst.start);
        } else {
            let (a, b) = self.segs.split_at_mut(from.0);
            let (to_seg, from_seg) = (&mut a[to.0], &b[0]);
            to_seg.floats[..to_seg.len][dst].copy_from_slice(&from_seg.floats[..from_seg.len][src]);
        }
    }

    /// Floats of segment `k`'s block (for tests).
    #[cfg(test)]
    pub(super) fn capacity(&self, k: usize) -> usize {
        self.segs[k].floats.len()
    }
}

/// Writes defaults into `v`'s spare capacity up to element `upto` (without
/// changing its length), so that the pages are mapped before rows arrive.
pub(super) fn touch_spare<T: Copy + Default>(v: &mut Vec<T>, upto: usize) {
    let len = v.len();
    if upto > len {
        v.spare_capacity_mut()[..upto - len].fill(std::mem::MaybeUninit::new(T::default()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pushed row is zeros, whether the segment's memory there was
    /// never written (nothing written) or held a row since removed; a
    /// touch past the rows keeps that true.
    #[test]
    fn a_pushed_row_is_zeros_where_a_removed_row_lay_and_where_none_did() {
        let mut c = Column::new(5);
        c.add_segment(64).unwrap();
        for i in 0..10 {
            c.push(0).fill(i as f32 + 1.0);
        }
        for _ in 0..6 {
            c.pop(0);
        }
        c.push_copy(0, &[7.0; 5]);
        assert_eq!(c.row(0, 4), &[7.0; 5]);
        for o in 5..12 {
            assert_eq!(c.push(0), &[0.0; 5], "row {o}");
            assert_eq!(c.row(0, o), &[0.0; 5]);
            c.row_mut(0, o).fill(-1.0);
        }
        for _ in 0..7 {
            c.pop(0);
        }
        c.touch(0, 40);
        for o in 5..40 {
            assert_eq!(c.push(0), &[0.0; 5], "row {o} after a touch");
        }
        assert_eq!(c.row(0, 3), &[4.0; 5], "rows in use keep their floats");
    }

    /// Rows start on a cache line's boundary in every segment.
    #[test]
    fn rows_start_on_a_line() {
        let mut c = Column::new(64);
        for k in 0..4 {
            c.add_segment(64 << k).unwrap();
            assert_eq!(c.row0(k) as usize % 64, 0);
            assert_eq!(c.push(k).as_ptr() as usize % 64, 0);
        }
    }
}
