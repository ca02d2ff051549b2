//! Output arrays of the batch calls, from a small pool of recycled buffers.
//!
//! A training loop asks for an output of the same size every step and drops
//! the last one. Fresh memory costs a page fault and a page clear per page on
//! first touch (a lookup of 1.7M rows of dim 64 writes 436 MB of it), so
//! large outputs live in buffers that return here when NumPy frees their
//! array and serve the next call of about the same size: the pages stay
//! mapped. At most [`MAX_KEPT`] buffers and [`MAX_KEPT_BYTES`] are kept;
//! `free_output_buffers()` gives them back to the OS.
//!
//! Every caller writes each element of the array before returning it (the
//! batch calls fill every output row), so a reused buffer's old contents
//! never show.

use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};

use numpy::PyArray2;
use numpy::ndarray::ArrayView2;
use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;

/// Outputs smaller than this come from NumPy's allocator as usual.
const MIN_BYTES: usize = 4 << 20;
/// Buffers kept for reuse, at most.
const MAX_KEPT: usize = 4;
/// Bytes kept for reuse, at most.
const MAX_KEPT_BYTES: usize = 2 << 30;

/// Freed buffers, oldest first.
static POOL: Mutex<VecDeque<Vec<f32>>> = Mutex::new(VecDeque::new());

fn pool() -> std::sync::MutexGuard<'static, VecDeque<Vec<f32>>> {
    POOL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A kept buffer of `n` to `2n` floats (the smallest), if any.
fn take(n: usize) -> Option<Vec<f32>> {
    let mut p = pool();
    let best = p
        .iter()
        .enumerate()
        .filter(|(_, v)| v.len() >= n && v.len() <= 2 * n)
        .min_by_key(|(_, v)| v.len())
        .map(|(i, _)| i)?;
    p.remove(best)
}

/// Keeps `v` for reuse (dropping the oldest buffers beyond the limits).
fn give(v: Vec<f32>) {
    if v.len() * 4 < MIN_BYTES || v.len() * 4 > MAX_KEPT_BYTES {
        return;
    }
    let dropped: Vec<Vec<f32>> = {
        let mut p = pool();
        p.push_back(v);
        let mut out = Vec::new();
        while p.len() > MAX_KEPT || p.iter().map(|v| v.len() * 4).sum::<usize>() > MAX_KEPT_BYTES {
            out.extend(p.pop_front());
        }
        out
    };
    drop(dropped); // unmapped outside the lock
}

/// `n` zeros, or `None` when the memory cannot be allocated
/// (`embstore_core::zeroed::try_zeroed`: zeroed pages from the OS, mapped
/// on first write).
fn zeroed(n: usize) -> Option<Vec<f32>> {
    embstore_core::zeroed::try_zeroed_huge(n)
}

/// (buffers kept, bytes kept, most buffers kept, most bytes kept).
pub fn stats() -> (usize, usize, usize, usize) {
    let p = pool();
    let bytes = p.iter().map(|v| v.len() * 4).sum();
    (p.len(), bytes, MAX_KEPT, MAX_KEPT_BYTES)
}

/// Gives every kept buffer back to the OS; returns their bytes.
pub fn free_all() -> usize {
    let all: Vec<Vec<f32>> = pool().drain(..).collect();
    all.iter().map(|v| v.len() * 4).sum()
}

/// The memory behind an output array: NumPy holds it as the array's base
/// object and drops it with the array, which returns the buffer to the pool.
#[pyclass(frozen, module = "embstore._core")]
struct OutputBuffer {
    /// Taken only by `drop`; the array writes through a pointer into it.
    data: Mutex<Vec<f32>>,
}

impl Drop for OutputBuffer {
    fn drop(&mut self) {
        let v = std::mem::take(self.data.get_mut().unwrap_or_else(PoisonError::into_inner));
        give(v);
    }
}

/// A fresh C-contiguous float32 array of `rows x cols` from NumPy's
/// allocator, not zeroed: every caller overwrites the whole array (the
/// module's contract, which recycled buffers rely on too), and clearing it
/// first cost a sixth of a 128-key lookup. A failed allocation is
/// NumPy's MemoryError (`PyArray2::new` and `zeros` would panic on it).
/// `no_memory` is the error for dimensions NumPy cannot take.
fn uninit2(
    py: Python<'_>,
    rows: usize,
    cols: usize,
    no_memory: impl Fn() -> PyErr,
) -> PyResult<Bound<'_, PyArray2<f32>>> {
    use numpy::npyffi::{NpyTypes, PY_ARRAY_API, get_type_object, npy_intp};
    use numpy::{Element, PyArrayDescrMethods};
    let mut dims = [
        npy_intp::try_from(rows).map_err(|_| no_memory())?,
        npy_intp::try_from(cols).map_err(|_| no_memory())?,
    ];
    // SAFETY: the NumPy C API (imported by `PY_ARRAY_API`) called with the
    // GIL held: a 2-D array of the float32 descriptor (a new reference,
    // which the call steals), C order (no strides, flags 0), memory of its
    // own (no data, no base object). It returns a new reference or null
    // with a Python error set. Its bytes are whatever NumPy's allocator
    // gave; any of them is a valid f32, and the caller overwrites them all
    // before anyone reads the array.
    let ptr = unsafe {
        PY_ARRAY_API.PyArray_NewFromDescr(
            py,
            get_type_object(py, NpyTypes::PyArray_Type),
            f32::get_dtype(py).into_dtype_ptr(),
            2,
            dims.as_mut_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
            std::ptr::null_mut(),
        )
    };
    // SAFETY: `ptr` is a new (owned) reference, or null with an error set.
    let arr = unsafe { Bound::from_owned_ptr_or_err(py, ptr)? };
    Ok(arr.cast_into::<PyArray2<f32>>()?)
}

/// A C-contiguous float32 array of `rows x cols` whose contents the caller
/// must overwrite entirely (a recycled buffer holds old values, a small
/// array whatever NumPy's allocator gave).
///
/// # Errors
/// `MemoryError` naming `arg` when the memory cannot be allocated.
pub fn array2<'py>(
    py: Python<'py>,
    rows: usize,
    cols: usize,
    arg: &str,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let n = rows
        .checked_mul(cols)
        .filter(|n| n.checked_mul(4).is_some());
    let no_memory = || {
        PyMemoryError::new_err(format!(
            "{arg}: the output of {rows} x {cols} float32 needs {} bytes, more than could be \
             allocated; nothing changed",
            (rows as u128) * (cols as u128) * 4
        ))
    };
    let n = n.ok_or_else(no_memory)?;
    if n * 4 < MIN_BYTES {
        return uninit2(py, rows, cols, no_memory);
    }
    let mut v = match take(n) {
        Some(v) => v,
        None => zeroed(n).ok_or_else(no_memory)?,
    };
    let ptr = v.as_mut_ptr();
    let owner = Bound::new(
        py,
        OutputBuffer {
            data: Mutex::new(v),
        },
    )?;
    // SAFETY: `ptr` points to at least `rows * cols` initialized floats (the
    // buffer holds `n` or more), in the allocation `owner` owns; moving the
    // Vec into `owner` does not move its heap data, and nothing reallocates
    // it while `owner` lives. The view only lives for this statement.
    let view = unsafe { ArrayView2::from_shape_ptr((rows, cols), ptr.cast_const()) };
    // SAFETY: `owner` becomes the array's base object, so the memory the
    // array points into stays valid (and in place) as long as the array;
    // the array is the buffer's only user until it is freed.
    Ok(unsafe { PyArray2::borrow_from_array(&view, owner.into_any()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn take_returns_a_kept_buffer_of_fitting_size_and_give_bounds_the_pool() {
        free_all();
        let n = MIN_BYTES / 4;
        give(vec![1.0; n]);
        give(vec![2.0; 3 * n]);
        assert!(take(4 * n).is_none(), "3n is smaller than 4n");
        assert!(take(n / 4).is_none(), "n is more than twice n/4");
        let got = take(2 * n).expect("3n serves 2n");
        assert_eq!((got.len(), got[0]), (3 * n, 2.0));
        assert_eq!(take(n).map(|v| v.len()), Some(n));
        for _ in 0..MAX_KEPT + 3 {
            give(vec![0.0; n]);
        }
        assert_eq!(pool().len(), MAX_KEPT);
        assert_eq!(free_all(), MAX_KEPT * n * 4);
        give(vec![0.0; 16]);
        assert_eq!(pool().len(), 0, "small buffers are not kept");
    }
}
