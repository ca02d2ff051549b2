//! `embstore.hash_keys`: str / bytes values to int64 keys
//! ([`embstore_core::strings`]), hashed in parallel without the GIL.

use embstore_core::error::oom;
use embstore_core::strings;
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray1};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};

use crate::runtime::EnterStore;

/// An output vector of `n` keys, or MemoryError.
fn keys_out(n: usize) -> PyResult<Vec<i64>> {
    let mut out = Vec::new();
    out.try_reserve_exact(n)
        .map_err(|_| crate::error::PyStoreError(oom("values", n.saturating_mul(8))))?;
    out.resize(n, 0);
    Ok(out)
}

/// Keys of a list of `str` / `bytes` objects (UTF-8 for `str`). The list
/// is read in place: its items are borrowed, not first copied into a
/// vector whose allocation could fail without an error to raise.
#[pyfunction]
pub fn hash_objects<'py>(
    py: Python<'py>,
    values: &Bound<'py, PyList>,
    salt: u64,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let n = values.len();
    let mut items: Vec<Bound<'py, PyAny>> = Vec::new();
    items
        .try_reserve_exact(n)
        .map_err(|_| crate::error::PyStoreError(oom("values", n.saturating_mul(8))))?;
    items.extend(values.iter());
    let mut slices: Vec<&[u8]> = Vec::new();
    slices
        .try_reserve_exact(n)
        .map_err(|_| crate::error::PyStoreError(oom("values", n.saturating_mul(16))))?;
    for (i, v) in items.iter().enumerate() {
        if let Ok(s) = v.cast::<PyString>() {
            let text = s.to_str().map_err(|e| {
                PyValueError::new_err(format!("values: value {i} is not valid UTF-8 text: {e}"))
            })?;
            slices.push(text.as_bytes());
        } else if let Ok(b) = v.cast::<PyBytes>() {
            slices.push(b.as_bytes());
        } else {
            return Err(PyTypeError::new_err(format!(
                "values: expected str or bytes values, got {} at index {i}",
                v.get_type().name()?
            )));
        }
    }
    let mut out = keys_out(slices.len())?;
    py.enter_store(|| {
        strings::hash_slices(&slices, salt, &mut out);
        Ok(())
    })?;
    Ok(out.into_pyarray(py))
}

/// The contiguous elements of a fixed-width value array and the number of
/// values, checked to be a whole number of values of `width` >= 1 elements.
fn fixed_width<'a, T: numpy::Element>(
    data: &'a PyReadonlyArray1<'_, T>,
    width: usize,
) -> PyResult<(&'a [T], usize)> {
    let d = data
        .as_slice()
        .map_err(|_| PyValueError::new_err("values: expected a contiguous array"))?;
    if width == 0 || d.len() % width != 0 {
        return Err(PyValueError::new_err(
            "values: data is not a whole number of values of width >= 1",
        ));
    }
    Ok((d, d.len() / width))
}

/// Keys of fixed-width byte strings (NumPy `S<width>`, as its raw bytes).
#[pyfunction]
pub fn hash_fixed_bytes<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u8>,
    width: usize,
    salt: u64,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let (d, n) = fixed_width(&data, width)?;
    let mut out = keys_out(n)?;
    py.enter_store(|| {
        strings::hash_fixed_bytes(d, width, salt, &mut out);
        Ok(())
    })?;
    Ok(out.into_pyarray(py))
}

/// Keys of fixed-width UCS-4 strings (NumPy `U<width>`, as its code points).
#[pyfunction]
pub fn hash_ucs4<'py>(
    py: Python<'py>,
    data: PyReadonlyArray1<'py, u32>,
    width: usize,
    salt: u64,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let (d, n) = fixed_width(&data, width)?;
    let mut out = keys_out(n)?;
    py.enter_store(|| strings::hash_ucs4(d, width, salt, &mut out))?;
    Ok(out.into_pyarray(py))
}
