//! One column of an arena's rows (weights or optimizer state): floats in
//! segments that never move, each segment's rows aligned to a cache line.

use crate::table::storage::memory::OutOfMemory;

/// Floats of one column (weights or optimizer state), `stride` a row, in
/// the arena's segments. Each segment's rows start at a 64-byte boundary
/// (the allocator only promises 16): a row of 64 floats then spans 4
/// cache lines, not 5, and a lookup or pooling pass, bound by the lines it
/// fetches, fetches a fifth fewer.
#[derive(Debug)]
pub(crate) struct Column {
    stride: usize,
    /// Per segment: `pad` leading floats up to the boundary, then rows.
    segs: Vec<Vec<f32>>,
    pads: Vec<usize>,
}

/// Floats in a cache line.
const LINE_FLOATS: usize = 16;

impl Column {
    pub(super) fn new(stride: usize) -> Self {
        Column {
            stride,
            segs: Vec::new(),
            pads: Vec::new(),
        }
    }

    /// Appends an empty segment with room for `cap` rows.
    pub(super) fn add_segment(&mut self, cap: usize) -> Result<(), OutOfMemory> {
        let mut v: Vec<f32> = Vec::new();
        let mut pad = 0;
        if self.stride > 0 {
            v.try_reserve_exact(cap * self.stride + LINE_FLOATS - 1)?;
            crate::huge::advise_huge(v.as_ptr().cast(), 4 * v.capacity(), false);
            // Floats from the allocation's start to the next line boundary
            // (the address is a multiple of 4: it holds f32s).
            let misalign = v.as_ptr() as usize % (4 * LINE_FLOATS);
            pad = (4 * LINE_FLOATS - misalign) % (4 * LINE_FLOATS) / 4;
            // Within the capacity just reserved: no reallocation.
            v.resize(pad, 0.0);
        }
        self.segs.push(v);
        self.pads.push(pad);
        Ok(())
    }

    /// Removes the last segment and returns its memory (to free once no
    /// reader can be reading it).
    pub(super) fn pop_segment(&mut self) -> Option<Vec<f32>> {
        self.pads.pop();
        self.segs.pop()
    }

    /// Where segment `k`'s row 0 starts, for readers.
    pub(super) fn row0(&mut self, k: usize) -> *mut f32 {
        let pad = self.pads[k];
        self.segs[k].as_mut_ptr().wrapping_add(pad)
    }

    #[inline(always)]
    pub(super) fn span(&self, k: usize, o: usize) -> std::ops::Range<usize> {
        let start = self.pads[k] + o * self.stride;
        start..start + self.stride
    }

    #[inline(always)]
    pub(super) fn row(&self, k: usize, o: usize) -> &[f32] {
        &self.segs[k][self.span(k, o)]
    }

    #[inline(always)]
    pub(super) fn row_mut(&mut self, k: usize, o: usize) -> &mut [f32] {
        let span = self.span(k, o);
        &mut self.segs[k][span]
    }

    /// Appends a zeroed row to segment `k` and returns it.
    #[inline]
    pub(super) fn push(&mut self, k: usize) -> &mut [f32] {
        let seg = &mut self.segs[k];
        let start = seg.len();
        seg.resize(start + self.stride, 0.0);
        &mut seg[start..]
    }

    /// Appends row `src` (`stride` floats) to segment `k`: copied in, where
    /// [`Column::push`] zeroes a row for its caller to write.
    #[inline]
    pub(super) fn push_copy(&mut self, k: usize, src: &[f32]) {
        assert_eq!(src.len(), self.stride, "a row is `stride` floats");
        self.segs[k].extend_from_slice(src);
    }

    /// The byte addresses of rows `o0..o1` of segment `k` (within its
    /// capacity; not necessarily written yet).
    pub(super) fn addresses(&self, k: usize, o0: usize, o1: usize) -> (usize, usize) {
        let base = self.segs[k].as_ptr() as usize + 4 * self.pads[k];
        (base + 4 * o0 * self.stride, base + 4 * o1 * self.stride)
    }

    /// Removes the last row of segment `k`.
    #[inline]
    pub(super) fn pop(&mut self, k: usize) {
        let seg = &mut self.segs[k];
        seg.truncate(seg.len() - self.stride);
    }

    /// Maps the memory of segment `k`'s first `rows` rows.
    pub(super) fn touch(&mut self, k: usize, rows: usize) {
        touch_spare(&mut self.segs[k], self.pads[k] + rows * self.stride);
    }

    /// Copies row `from` (segment, offset) over row `to`, which comes
    /// before it (an earlier segment, or an earlier offset of the same one).
    pub(super) fn move_row(&mut self, from: (usize, usize), to: (usize, usize)) {
        let (src, dst) = (self.span(from.0, from.1), self.span(to.0, to.1));
        if from.0 == to.0 {
            self.segs[to.0].copy_within(src, dst.start);
        } else {
            let (a, b) = self.segs.split_at_mut(from.0);
            a[to.0][dst].copy_from_slice(&b[0][src]);
        }
    }

    /// Floats of segment `k`'s capacity (for tests).
    #[cfg(test)]
    pub(super) fn capacity(&self, k: usize) -> usize {
        self.segs[k].capacity()
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
