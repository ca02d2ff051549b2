//! Output buffers that many shard passes fill at once, each writing only
//! its own rows.

use std::marker::PhantomData;

/// A raw pointer to an output buffer that shards fill in parallel, each
/// writing only the rows of its own batch positions. Row `i` starts at
/// `i * stride + col` (a Collection writes each feature into its columns of
/// one wide array).
///
/// Invariant: `ptr` is valid for writes of `len` floats for `'a`, the
/// exclusive borrow of the buffer it was made from (so a `SharedOut` cannot
/// outlive its buffer, nor can anyone else touch the buffer meanwhile), and
/// no two writers receive the same row.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut<'a> {
    ptr: *mut f32,
    len: usize,
    stride: usize,
    col: usize,
    _buffer: PhantomData<&'a mut [f32]>,
}

// SAFETY: a `SharedOut` is only used to write disjoint rows (one batch
// position or bag belongs to exactly one writer), so sending it to other
// threads cannot produce overlapping writes.
unsafe impl Send for SharedOut<'_> {}
// SAFETY: as for `Send`: concurrent users write disjoint rows only.
unsafe impl Sync for SharedOut<'_> {}

impl<'a> SharedOut<'a> {
    /// Rows of `dim` floats packed back to back in `out`.
    pub(crate) fn new(out: &'a mut [f32], dim: usize) -> Self {
        Self::strided(out, dim, 0)
    }

    /// Rows of `stride` floats in `out`, writing columns `col..col + dim`.
    pub(crate) fn strided(out: &'a mut [f32], stride: usize, col: usize) -> Self {
        SharedOut {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            stride,
            col,
            _buffer: PhantomData,
        }
    }

    /// The same buffer, writing from column `col`.
    pub(crate) fn with_col(self, col: usize) -> Self {
        SharedOut { col, ..self }
    }

    /// The `dim` floats of output row `i`.
    ///
    /// # Safety
    /// No other live reference may cover row `i`: each row is handed to
    /// exactly one writer (the shard that owns the key, or the bag's task).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn row(&self, i: usize, dim: usize) -> &mut [f32] {
        let start = i * self.stride + self.col;
        assert!(
            self.col + dim <= self.stride && start + dim <= self.len,
            "output row out of range"
        );
        // SAFETY: in bounds by the assert; exclusive by this function's
        // contract; the buffer outlives the call (type invariant).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), dim) }
    }
}

/// Like [`SharedOut`], for bools: one flag per batch position.
///
/// Invariant: the pointer is valid for writes of `len` bools for `'a`, the
/// exclusive borrow it was made from, and each position is written by one
/// thread only.
pub(crate) struct SharedBools<'a> {
    ptr: *mut bool,
    len: usize,
    _buffer: PhantomData<&'a mut [bool]>,
}
// SAFETY: positions are written by exactly one shard task each (plan).
unsafe impl Sync for SharedBools<'_> {}
// SAFETY: as for `Sync`.
unsafe impl Send for SharedBools<'_> {}

impl<'a> SharedBools<'a> {
    /// Flags written into `out`.
    pub(crate) fn new(out: &'a mut [bool]) -> Self {
        SharedBools {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            _buffer: PhantomData,
        }
    }

    /// Sets flag `i`.
    ///
    /// # Safety
    /// No other thread may write or read flag `i` during the call (each
    /// position belongs to one shard task).
    pub(crate) unsafe fn set(&self, i: usize, value: bool) {
        assert!(i < self.len, "flag out of range");
        // SAFETY: in bounds by the assert; the buffer outlives `'a` (type
        // invariant); exclusive by this function's contract.
        unsafe { *self.ptr.add(i) = value };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_land_at_their_stride_and_column() {
        let mut buf = vec![0.0f32; 12];
        {
            let out = SharedOut::strided(&mut buf, 4, 1);
            // SAFETY: one writer per row, in bounds.
            unsafe {
                out.row(0, 2).copy_from_slice(&[1.0, 2.0]);
                out.row(2, 3).copy_from_slice(&[7.0, 8.0, 9.0]);
            }
        }
        assert_eq!(buf, [0., 1., 2., 0., 0., 0., 0., 0., 0., 7., 8., 9.]);
    }

    #[test]
    #[should_panic(expected = "output row out of range")]
    fn a_row_past_the_end_panics_instead_of_writing() {
        let mut buf = vec![0.0f32; 8];
        let out = SharedOut::new(&mut buf, 4);
        // SAFETY: the call panics before writing.
        unsafe { out.row(2, 4) }.fill(1.0);
    }

    #[test]
    fn flags_are_set_by_position() {
        let mut flags = vec![false; 5];
        let shared = SharedBools::new(&mut flags);
        // SAFETY: one writer.
        unsafe {
            shared.set(1, true);
            shared.set(4, true);
        }
        assert_eq!(flags, [false, true, false, false, true]);
    }
}
