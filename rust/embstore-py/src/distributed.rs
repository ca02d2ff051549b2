//! Native pieces of `embstore.distributed`: partitions, pooling of rows
//! fetched from other ranks, and checkpoint files written by many ranks.

use std::path::PathBuf;

use embstore_core::Table;
use embstore_core::error::oom;
use embstore_core::partition::Partition;
use embstore_core::table::checkpoint;
use embstore_core::table::checkpoint::LoadConfig;
use embstore_core::table::{
    pool_rows as core_pool_rows, pool_rows_into as core_pool_rows_into,
    spread_pooled as core_spread_pooled, spread_pooled_add as core_spread_pooled_add,
};
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyReadwriteArray2, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::error::PyStoreError;
use crate::runtime::EnterStore;
use crate::store::{PyProgress, PyTable, bags, slice, slice2};

fn partition(kind: &str, key_space: Option<i64>) -> PyResult<Partition> {
    Ok(Partition::from_name(kind, key_space).map_err(PyStoreError)?)
}

/// The owning rank of each key: int32 (n,).
#[pyfunction]
#[pyo3(signature = (keys, size, kind="hash", key_space=None))]
pub fn partition_owners<'py>(
    py: Python<'py>,
    keys: PyReadonlyArray1<'py, i64>,
    size: usize,
    kind: &str,
    key_space: Option<i64>,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let p = partition(kind, key_space)?;
    let k = slice(&keys, "keys")?;
    let mut out: Vec<i32> = Vec::new();
    out.try_reserve_exact(k.len())
        .map_err(|_| PyStoreError(oom("keys", k.len() as u128 * 4)))?;
    out.resize(k.len(), 0);
    py.enter_store(|| p.owners(k, size, &mut out))?;
    Ok(out.into_pyarray(py))
}

/// Distinct keys and each position's index among them.
type KeysAndIndex<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<i64>>);

/// The distinct keys in first-occurrence order, and each position's index
/// among them: int64 (u,) and int64 (n,).
#[pyfunction]
pub fn unique_inverse<'py>(
    py: Python<'py>,
    keys: PyReadonlyArray1<'py, i64>,
) -> PyResult<KeysAndIndex<'py>> {
    let k = slice(&keys, "keys")?;
    let (uniq, inverse) = py.enter_store(|| embstore_core::unique::unique_inverse(k))?;
    Ok((uniq.into_pyarray(py), inverse.into_pyarray(py)))
}

/// The exchange plan of a batch: its distinct keys grouped by owner rank,
/// each position's index among them, and the count each rank owns.
type Plan<'py> = (
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
);

/// The distinct keys grouped by owner rank (first-occurrence order within
/// a rank), each position's index among them, and how many each rank owns.
#[pyfunction]
#[pyo3(signature = (keys, size, kind="hash", key_space=None))]
pub fn plan_exchange<'py>(
    py: Python<'py>,
    keys: PyReadonlyArray1<'py, i64>,
    size: usize,
    kind: &str,
    key_space: Option<i64>,
) -> PyResult<Plan<'py>> {
    let p = partition(kind, key_space)?;
    let k = slice(&keys, "keys")?;
    let plan = py.enter_store(|| embstore_core::unique::plan_exchange(k, &p, size))?;
    Ok((
        plan.keys.into_pyarray(py),
        plan.inverse.into_pyarray(py),
        plan.counts.into_pyarray(py),
    ))
}

/// Pools rows already fetched: id i of the bags uses row idx[i] of rows.
#[pyfunction]
#[pyo3(signature = (rows, idx, offsets, weights=None, combiner="sum"))]
pub fn pool_rows<'py>(
    py: Python<'py>,
    rows: PyReadonlyArray2<'py, f32>,
    idx: PyReadonlyArray1<'py, i64>,
    offsets: PyReadonlyArray1<'py, i64>,
    weights: Option<PyReadonlyArray1<'py, f32>>,
    combiner: &str,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let dim = rows.shape()[1];
    let b = bags(&idx, &offsets, weights.as_ref(), combiner)?;
    let (r, i) = (slice2(&rows, "rows")?, slice(&idx, "idx")?);
    let out = crate::outbuf::array2(py, b.batch(), dim, "offsets")?;
    {
        let mut rw = out.readwrite();
        let dst = rw.as_slice_mut()?;
        py.enter_store(|| core_pool_rows(r, dim, i, &b, dst))?;
    }
    Ok(out)
}

/// `pool_rows` into columns `col..col + dim` of `out` (batch, stride), in place.
#[pyfunction]
#[pyo3(signature = (rows, idx, offsets, out, col, weights=None, combiner="sum"))]
#[allow(clippy::too_many_arguments)]
pub fn pool_rows_into<'py>(
    py: Python<'py>,
    rows: PyReadonlyArray2<'py, f32>,
    idx: PyReadonlyArray1<'py, i64>,
    offsets: PyReadonlyArray1<'py, i64>,
    mut out: PyReadwriteArray2<'py, f32>,
    col: usize,
    weights: Option<PyReadonlyArray1<'py, f32>>,
    combiner: &str,
) -> PyResult<()> {
    let (dim, stride) = (rows.shape()[1], out.shape()[1]);
    let b = bags(&idx, &offsets, weights.as_ref(), combiner)?;
    let (r, i) = (slice2(&rows, "rows")?, slice(&idx, "idx")?);
    let dst = out.as_slice_mut()?;
    py.enter_store(|| core_pool_rows_into(r, dim, i, &b, dst, stride, col))
}

/// Adds the backward of `pool_rows` from columns `col..col + dim` of
/// `grads` (batch, stride) to `out` (n, dim), in place.
#[pyfunction]
#[pyo3(signature = (grads, col, idx, offsets, out, weights=None, combiner="sum"))]
#[allow(clippy::too_many_arguments)]
pub fn spread_pooled_add<'py>(
    py: Python<'py>,
    grads: PyReadonlyArray2<'py, f32>,
    col: usize,
    idx: PyReadonlyArray1<'py, i64>,
    offsets: PyReadonlyArray1<'py, i64>,
    mut out: PyReadwriteArray2<'py, f32>,
    weights: Option<PyReadonlyArray1<'py, f32>>,
    combiner: &str,
) -> PyResult<()> {
    let (stride, dim) = (grads.shape()[1], out.shape()[1]);
    let b = bags(&idx, &offsets, weights.as_ref(), combiner)?;
    let (g, i) = (slice2(&grads, "grads")?, slice(&idx, "idx")?);
    let dst = out.as_slice_mut()?;
    py.enter_store(|| core_spread_pooled_add(g, stride, col, dim, i, &b, dst))
}

/// Backward of `pool_rows`: per-row gradient sums, (n, dim).
#[pyfunction]
#[pyo3(signature = (grads, idx, offsets, n, weights=None, combiner="sum"))]
pub fn spread_pooled<'py>(
    py: Python<'py>,
    grads: PyReadonlyArray2<'py, f32>,
    idx: PyReadonlyArray1<'py, i64>,
    offsets: PyReadonlyArray1<'py, i64>,
    n: usize,
    weights: Option<PyReadonlyArray1<'py, f32>>,
    combiner: &str,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let dim = grads.shape()[1];
    let b = bags(&idx, &offsets, weights.as_ref(), combiner)?;
    let (g, i) = (slice2(&grads, "grads")?, slice(&idx, "idx")?);
    let out = crate::outbuf::array2(py, n, dim, "n")?;
    {
        let mut rw = out.readwrite();
        let dst = rw.as_slice_mut()?;
        py.enter_store(|| core_spread_pooled(g, dim, i, &b, dst))?;
    }
    Ok(out)
}

/// Checks bags (CSR ids, offsets, weights, combiner) without a table:
/// the validation a pooled call does, before any rank sends anything.
#[pyfunction]
#[pyo3(signature = (ids, offsets, weights=None, combiner="sum"))]
pub fn check_bags(
    ids: PyReadonlyArray1<'_, i64>,
    offsets: PyReadonlyArray1<'_, i64>,
    weights: Option<PyReadonlyArray1<'_, f32>>,
    combiner: &str,
) -> PyResult<usize> {
    let b = bags(&ids, &offsets, weights.as_ref(), combiner)?;
    b.validate().map_err(PyStoreError)?;
    Ok(b.batch())
}

/// Each id's bag and coefficient, as NumPy arrays.
type BagCoefficients<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<f32>>);

/// Checked CSR bags: each id's bag (int64) and the coefficient `w_i / d_bag`
/// (float32) the native pooling uses.
#[pyfunction]
pub fn bag_coefficients<'py>(
    py: Python<'py>,
    ids: PyReadonlyArray1<'py, i64>,
    offsets: PyReadonlyArray1<'py, i64>,
    weights: Option<PyReadonlyArray1<'py, f32>>,
    combiner: &str,
) -> PyResult<BagCoefficients<'py>> {
    let b = bags(&ids, &offsets, weights.as_ref(), combiner)?;
    b.validate().map_err(PyStoreError)?;
    let (bag_of, coef) = py.enter_store(|| b.coefficients())?;
    let mut wide =
        embstore_core::zeroed::zeros::<i64>("ids", bag_of.len()).map_err(PyStoreError)?;
    for (w, b) in wide.iter_mut().zip(bag_of) {
        *w = i64::from(b);
    }
    let bag_of = wide;
    Ok((bag_of.into_pyarray(py), coef.into_pyarray(py)))
}

/// A fresh checkpoint id.
#[pyfunction]
pub fn new_checkpoint_id() -> String {
    checkpoint::new_id()
}

/// Loads the rows of a checkpoint that rank `rank` of `size` owns: of the
/// checkpoint whose manifest is `manifest` (the text one rank read, so
/// that every rank loads the same one), or of the one at `path` now.
#[pyfunction]
#[pyo3(signature = (path, size, rank, settings="{}", kind="hash", key_space=None, buckets=None, manifest=None, progress=None))]
#[allow(clippy::too_many_arguments)]
pub fn load_table_owned(
    py: Python<'_>,
    path: PathBuf,
    size: usize,
    rank: usize,
    settings: &str,
    kind: &str,
    key_space: Option<i64>,
    buckets: Option<Vec<u32>>,
    manifest: Option<String>,
    progress: Option<PyRef<'_, PyProgress>>,
) -> PyResult<PyTable> {
    let load = LoadConfig::from_json(settings).map_err(PyStoreError)?;
    // "bucket": a key's bucket is its "hash" owner among the buckets, its
    // rank the bucket's.
    let (p, buckets) = match (kind, buckets) {
        ("bucket", Some(b)) if !b.is_empty() && b.iter().all(|&r| (r as usize) < size) => {
            (Partition::Hash, Some(b))
        }
        ("bucket", _) => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "buckets: expected the rank (below {size}) of each bucket with kind=\"bucket\""
            )));
        }
        (_, None) => (partition(kind, key_space)?, None),
        (_, Some(_)) => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "buckets: only with kind=\"bucket\", got kind={kind:?}"
            )));
        }
    };
    let counter = progress.map(|p| p.done.clone());
    let keep = move |k: i64| match &buckets {
        Some(b) => b[p.owner(k, b.len()).unwrap_or(0)] as usize == rank,
        None => p.owner(k, size) == Some(rank),
    };
    // The readers' lock is waited for here, outside the call lock (see
    // `runtime::lock_for_reading`); a manifest given was read under the
    // caller's hold.
    let held = match manifest {
        Some(_) => None,
        None => crate::runtime::lock_for_reading(py, &path, checkpoint::READ_WAIT)?,
    };
    let (table, _) = py.enter_store(|| match &manifest {
        Some(text) => Table::load_filtered_manifest(
            &path,
            text.as_bytes(),
            &load,
            counter.as_deref(),
            Some(&keep),
        ),
        None => Table::load_as(&path, held, &load, counter.as_deref(), Some(&keep)),
    })?;
    Ok(PyTable::from_table(table))
}

/// The manifest of the checkpoint at `path`, as text (checked).
#[pyfunction]
pub fn checkpoint_manifest_text(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    let bytes = py.enter_store(|| checkpoint::read_manifest_text(&path))?;
    String::from_utf8(bytes).map_err(|e| {
        pyo3::exceptions::PyValueError::new_err(format!("path: manifest is not UTF-8: {e}"))
    })
}

/// A shared hold on a checkpoint directory's readers' lock: while any
/// process holds one, no save deletes the files of the manifest it saw.
#[pyclass(name = "DirectoryHold", module = "embstore._core")]
pub struct PyDirectoryHold {
    lock: Option<checkpoint::DirLock>,
}

#[pymethods]
impl PyDirectoryHold {
    /// Gives the hold up (also when the object goes away).
    fn release(&mut self) {
        self.lock = None;
    }
}

/// Holds the readers' lock of the checkpoint directory `path` (waiting,
/// with the GIL released and outside the call lock, only while a save
/// deletes files).
#[pyfunction]
pub fn hold_directory(py: Python<'_>, path: PathBuf) -> PyResult<PyDirectoryHold> {
    let lock = py
        .detach(|| checkpoint::hold_for_reading(&path))
        .map_err(PyStoreError)?;
    Ok(PyDirectoryHold { lock })
}
