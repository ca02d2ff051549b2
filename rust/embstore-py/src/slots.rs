//! `embstore._core.SlotMap`: the host's map of a device cache's slots (see
//! `embstore_core::slots`), for `embstore.gpu.ServingCache`.
//!
//! Its mutex is only taken inside calls that the serving cache makes under
//! its own lock, which a fork waits for (`embstore.gpu._fork`), so a child
//! never inherits it held.

use std::sync::{Mutex, MutexGuard, PoisonError};

use embstore_core::slots::{Served, SlotMap};
use embstore_core::zeroed::{with_room, zeros};
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::error::PyStoreError;
use crate::mapped::PyMappedTable;
use crate::runtime::EnterStore;
use crate::store::{keys_arg, missing_of, slice_or_copy};

/// The native slot map; see `embstore.gpu.serving`.
#[pyclass(frozen, name = "SlotMap", module = "embstore._core")]
pub struct PySlotMap {
    inner: Mutex<SlotMap>,
}

impl PySlotMap {
    /// A serving call's native part (see [`PySlotMap::serve`]): what the
    /// core served, and the table's row width.
    #[allow(clippy::too_many_arguments)]
    fn served(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        tick: u64,
        table: &PyMappedTable,
        missing: &str,
        default_row: Option<PyReadonlyArray1<'_, f32>>,
        admit: bool,
    ) -> PyResult<(Served, usize)> {
        let keys = keys_arg(keys, "keys")?.readonly();
        let k = slice_or_copy(&keys, "keys")?;
        let k = &k[..];
        let missing = missing_of(missing, default_row.as_ref())?;
        let reader = table.inner().reader();
        let dim = reader.dim();
        let fetch = |keys: &[i64], rows: &mut [f32], found: &mut [bool]| {
            reader.lookup_cold(keys, missing, rows, Some(found))
        };
        let s = py.enter_store(|| self.map().serve(k, tick, admit, dim, &fetch))?;
        Ok((s, dim))
    }

    fn map(&self) -> MutexGuard<'_, SlotMap> {
        // A panic inside a call leaves the map as whole as its last
        // completed key: still a map.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

type I32s<'py> = Bound<'py, PyArray1<i32>>;
type I64s<'py> = Bound<'py, PyArray1<i64>>;
/// `SlotMap.serve`'s answer: src, miss_keys, miss_pos, rows, found,
/// adm_slot, adm_row.
type ServeOut<'py> = (
    I32s<'py>,
    I64s<'py>,
    I64s<'py>,
    Bound<'py, PyArray2<f32>>,
    Bound<'py, PyArray1<bool>>,
    I32s<'py>,
    I32s<'py>,
);

/// Bytes rounded up to a multiple of 16.
fn pad16(n: usize) -> usize {
    (n + 15) & !15
}

/// Types whose values are bytes without padding, every byte initialized.
trait Plain: Copy {}
impl Plain for i32 {}
impl Plain for f32 {}
impl Plain for bool {}

/// The bytes of a slice of plain numbers (or bools).
fn as_bytes<T: Plain>(v: &[T]) -> &[u8] {
    // SAFETY: `T: Plain` has no padding and every byte of a value is
    // initialized; the bytes are read only while `v` is borrowed.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Staging bytes a `serve_into` of `n` keys of `dim` floats may write.
#[pyfunction]
pub fn staging_bytes(n: usize, dim: usize) -> usize {
    3 * pad16(4 * n) + pad16(4 * n * dim) + pad16(n)
}

#[pymethods]
impl PySlotMap {
    /// Slots for at least `rows` keys (whole buckets of 32), evicting by
    /// `policy` ("lfu" or "lru").
    #[new]
    #[pyo3(signature = (rows, policy="lfu"))]
    fn new(rows: usize, policy: &str) -> PyResult<Self> {
        let lru = match policy {
            "lfu" => false,
            "lru" => true,
            other => {
                return Err(PyValueError::new_err(format!(
                    "policy: expected 'lfu' or 'lru', got {other:?}"
                )));
            }
        };
        let inner = SlotMap::new(rows, lru).map_err(PyStoreError)?;
        Ok(PySlotMap {
            inner: Mutex::new(inner),
        })
    }

    /// Slots in all.
    #[getter]
    fn capacity(&self) -> usize {
        self.map().capacity()
    }

    fn __len__(&self) -> usize {
        self.map().len()
    }

    /// Bytes of the map on the host.
    fn nbytes(&self) -> usize {
        self.map().nbytes()
    }

    /// A serving call's keys in call `tick` against `table` (its misses'
    /// rows, a missing key read as `missing` / `default_row`, one version
    /// throughout), the misses the table holds admitted where `admit`:
    /// `(src, miss_keys, miss_pos, rows, found, adm_slot, adm_row)` (see
    /// `embstore_core::slots::Served`). Partitions run in parallel for
    /// large calls.
    #[pyo3(signature = (keys, tick, table, missing="init", default_row=None, admit=true))]
    #[allow(clippy::too_many_arguments)]
    fn serve<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        tick: u64,
        table: PyRef<'py, PyMappedTable>,
        missing: &str,
        default_row: Option<PyReadonlyArray1<'py, f32>>,
        admit: bool,
    ) -> PyResult<ServeOut<'py>> {
        let (s, dim) = self.served(py, keys, tick, &table, missing, default_row, admit)?;
        let m = s.miss_keys.len();
        let rows = s
            .rows
            .into_pyarray(py)
            .reshape([m, dim])
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok((
            s.src.into_pyarray(py),
            s.miss_keys.into_pyarray(py),
            s.miss_pos.into_pyarray(py),
            rows,
            s.found.into_pyarray(py),
            s.adm_slot.into_pyarray(py),
            s.adm_row.into_pyarray(py),
        ))
    }

    /// [`PySlotMap::serve`] written into `staging` (bytes, e.g. a pinned
    /// buffer, at least `staging_bytes(n, dim)` long) for one copy to the
    /// device: src (int32), adm_slot, adm_row (int32), rows (float32) and,
    /// `with_found`, found (bool), each at a 16-byte aligned offset.
    /// Returns `(misses, admitted, adm_slot_at, adm_row_at, rows_at,
    /// found_at, total)`.
    #[pyo3(signature = (keys, tick, table, staging, missing="init", default_row=None, with_found=false))]
    #[allow(clippy::too_many_arguments)]
    fn serve_into<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        tick: u64,
        table: PyRef<'py, PyMappedTable>,
        mut staging: PyReadwriteArray1<'py, u8>,
        missing: &str,
        default_row: Option<PyReadonlyArray1<'py, f32>>,
        with_found: bool,
    ) -> PyResult<(usize, usize, usize, usize, usize, usize, usize)> {
        let n = keys.len()?;
        let need = staging_bytes(n, table.inner().dim());
        let out = staging
            .as_slice_mut()
            .map_err(|_| PyValueError::new_err("staging: expected a C-contiguous uint8 array"))?;
        if out.len() < need {
            return Err(PyValueError::new_err(format!(
                "staging: expected at least {need} bytes for {n} keys, got {}",
                out.len()
            )));
        }
        let (s, _) = self.served(py, keys, tick, &table, missing, default_row, true)?;
        let (m, a) = (s.miss_keys.len(), s.adm_slot.len());
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            let start = at;
            out[start..start + bytes.len()].copy_from_slice(bytes);
            at = start + pad16(bytes.len());
            start
        };
        put(as_bytes(&s.src));
        let slot_at = put(as_bytes(&s.adm_slot));
        let row_at = put(as_bytes(&s.adm_row));
        let rows_at = put(as_bytes(&s.rows));
        let found_at = if with_found {
            put(as_bytes(&s.found))
        } else {
            at
        };
        Ok((m, a, slot_at, row_at, rows_at, found_at, at))
    }

    /// Where each of `keys` is, an access counted in call `tick` for each
    /// one held: `(src, miss_keys, miss_pos)`, `src[i]` the slot of
    /// `keys[i]` or, for the j-th key not held, `-1 - j`; `miss_keys` and
    /// `miss_pos` those keys and their positions.
    #[allow(clippy::type_complexity)]
    fn find<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        tick: u64,
    ) -> PyResult<(I32s<'py>, I64s<'py>, I64s<'py>)> {
        let keys = keys_arg(keys, "keys")?.readonly();
        let k = slice_or_copy(&keys, "keys")?;
        let k = &k[..];
        let (src, mk, mp) = py.detach(|| -> Result<_, PyStoreError> {
            let mut src = zeros::<i32>("keys", k.len())?;
            let misses = self.map().find(k, tick, &mut src)?;
            let mut mk = with_room::<i64>("keys", misses)?;
            let mut mp = with_room::<i64>("keys", misses)?;
            for (i, s) in src.iter_mut().enumerate() {
                if *s < 0 {
                    *s = -1 - mk.len() as i32;
                    mk.push(k[i]);
                    mp.push(i as i64);
                }
            }
            Ok((src, mk, mp))
        })?;
        Ok((
            src.into_pyarray(py),
            mk.into_pyarray(py),
            mp.into_pyarray(py),
        ))
    }

    /// Admits `keys` in call `tick` (no slot read since `protect_from`
    /// given): `(slots, evicted)`, each key's slot (-1: held already or no
    /// room in its bucket) and the keys evicted.
    fn admit<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        tick: u64,
        protect_from: u64,
    ) -> PyResult<(I32s<'py>, I64s<'py>)> {
        let keys = keys_arg(keys, "keys")?.readonly();
        let k = slice_or_copy(&keys, "keys")?;
        let k = &k[..];
        let (slots, evicted) = py.detach(|| -> Result<_, PyStoreError> {
            let mut slots = zeros::<i32>("keys", k.len())?;
            let mut evicted = with_room::<i64>("keys", k.len())?;
            self.map()
                .admit(k, tick, protect_from, &mut slots, &mut evicted)?;
            Ok((slots, evicted))
        })?;
        Ok((slots.into_pyarray(py), evicted.into_pyarray(py)))
    }

    /// Frees the slots of `keys`: each key's freed slot (-1: not held).
    fn remove<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>) -> PyResult<I32s<'py>> {
        let keys = keys_arg(keys, "keys")?.readonly();
        let k = slice_or_copy(&keys, "keys")?;
        let k = &k[..];
        let slots = py.detach(|| -> Result<_, PyStoreError> {
            let mut slots = zeros::<i32>("keys", k.len())?;
            self.map().remove(k, &mut slots)?;
            Ok(slots)
        })?;
        Ok(slots.into_pyarray(py))
    }

    /// The keys held and their slots, by slot.
    fn items<'py>(&self, py: Python<'py>) -> (I64s<'py>, I64s<'py>) {
        let (k, s) = py.detach(|| self.map().items());
        (k.into_pyarray(py), s.into_pyarray(py))
    }
}
