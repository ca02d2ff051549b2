//! `embstore._core.Table`: a frozen, thread-safe handle on a core table.
//!
//! Array arguments arrive as C-contiguous NumPy arrays of the right dtype
//! (the Python wrapper converts and checks them). Their borrows are taken
//! before the GIL is released and live until the call returns. As with any
//! buffer shared with Python, another Python thread that writes into an
//! input array during a call races with it; that is the caller's bug and
//! is not guarded against here (rust-numpy's borrow checking covers Rust
//! borrows only).

use std::borrow::Cow;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use embstore_core::{Backend, Bags, Combiner, Table, TableConfig};
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::PyStoreError;
use crate::runtime::EnterStore;
use embstore_core::table::Records;
use embstore_core::table::checkpoint;
use embstore_core::table::checkpoint::LoadConfig;
use embstore_core::zeroed::{with_room, zeros};

/// The native table; see `embstore.Table` for the documented interface.
#[pyclass(frozen, name = "Table", module = "embstore._core")]
pub struct PyTable {
    /// The core table, shared by every Python reference and by running calls.
    pub(crate) inner: Arc<Table>,
}

pub(crate) fn slice<'a, T: numpy::Element>(
    arr: &'a PyReadonlyArray1<'_, T>,
    arg: &str,
) -> PyResult<&'a [T]> {
    arr.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{arg}: expected a C-contiguous array")))
}

/// [`slice`] for the arguments a Python wrapper passes as it got them
/// (an int64 or float32 array of the right rank, C-contiguous or not): a
/// strided view is copied, into memory allocated fallibly, instead of
/// refused.
pub(crate) fn slice_or_copy<'a, T: numpy::Element + Copy>(
    arr: &'a PyReadonlyArray1<'_, T>,
    arg: &'static str,
) -> PyResult<Cow<'a, [T]>> {
    match arr.as_slice() {
        Ok(s) => Ok(Cow::Borrowed(s)),
        Err(_) => copied(arr.as_array().iter().copied(), arr.len(), arg),
    }
}

/// The rows of a `(n, dim)` float32 array, refused as `as_rows` refuses
/// any other shape; a strided array is copied (see [`slice_or_copy`]).
pub(crate) fn rows_of<'a>(
    arr: &'a PyReadonlyArray2<'_, f32>,
    n: usize,
    dim: usize,
    arg: &'static str,
) -> PyResult<Cow<'a, [f32]>> {
    check_shape(arr, n, dim, arg)?;
    match arr.as_slice() {
        Ok(s) => Ok(Cow::Borrowed(s)),
        Err(_) => copied(arr.as_array().iter().copied(), arr.len(), arg),
    }
}

/// `obj` as a 1-D int64 array: taken as it is when it is one, else
/// converted and checked by `embstore._convert.as_keys` (whose errors name
/// `arg`). The one conversion path of a call's keys: the Python wrapper
/// passes them as it got them.
pub(crate) fn keys_arg<'py>(
    obj: &Bound<'py, PyAny>,
    arg: &'static str,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        return Ok(a.clone());
    }
    let conv = obj.py().import("embstore._convert")?.getattr("as_keys")?;
    Ok(conv.call1((obj, arg))?.cast_into::<PyArray1<i64>>()?)
}

/// The ids and offsets of a pooled call as the wrapper got them, each taken
/// or converted by [`keys_arg`].
type BagArrays<'py> = (PyReadonlyArray1<'py, i64>, PyReadonlyArray1<'py, i64>);

fn bag_arrays<'py>(
    ids: &Bound<'py, PyAny>,
    offsets: &Bound<'py, PyAny>,
) -> PyResult<BagArrays<'py>> {
    Ok((
        keys_arg(ids, "ids")?.readonly(),
        keys_arg(offsets, "offsets")?.readonly(),
    ))
}

/// `obj` as a float32 array of `n` rows of `dim`: taken as it is when it is
/// a 2-D float32 array (its shape checked by [`rows_of`]), else converted
/// and checked by `embstore._convert.as_rows`.
pub(crate) fn rows_arg<'py>(
    obj: &Bound<'py, PyAny>,
    n: usize,
    dim: usize,
    arg: &'static str,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    if let Ok(a) = obj.cast::<PyArray2<f32>>() {
        return Ok(a.clone());
    }
    let conv = obj.py().import("embstore._convert")?.getattr("as_rows")?;
    Ok(conv
        .call1((obj, n, dim, arg))?
        .cast_into::<PyArray2<f32>>()?)
}

fn copied<'a, T: Copy>(
    items: impl Iterator<Item = T>,
    n: usize,
    arg: &'static str,
) -> PyResult<Cow<'a, [T]>> {
    let mut v = with_room(arg, n).map_err(PyStoreError)?;
    v.extend(items);
    Ok(Cow::Owned(v))
}

fn check_shape(arr: &PyReadonlyArray2<'_, f32>, n: usize, dim: usize, arg: &str) -> PyResult<()> {
    let shape = arr.shape();
    if shape != [n, dim] {
        return Err(PyValueError::new_err(format!(
            "{arg}: expected shape ({n}, {dim}), got ({}, {})",
            shape[0], shape[1]
        )));
    }
    Ok(())
}

pub(crate) fn slice2<'a, T: numpy::Element>(
    arr: &'a PyReadonlyArray2<'_, T>,
    arg: &str,
) -> PyResult<&'a [T]> {
    arr.as_slice()
        .map_err(|_| PyValueError::new_err(format!("{arg}: expected a C-contiguous array")))
}

/// Takes the writers' lock of the checkpoint directory `path` (creating
/// the directory), waiting for another save that holds it with the GIL
/// released and outside the binding's call lock: the first lock of the
/// crate's order, so that a `fork()` is not held up for as long as another
/// process keeps the directory locked.
fn lock_outside_calls(py: Python<'_>, path: &std::path::Path) -> PyResult<checkpoint::DirLock> {
    Ok(py
        .detach(|| checkpoint::lock_for_writing(path))
        .map_err(PyStoreError)?)
}

/// A byte counter that a running save or load advances, for progress bars.
#[pyclass(frozen, name = "Progress", module = "embstore._core")]
#[derive(Default)]
pub struct PyProgress {
    /// Bytes done so far.
    pub(crate) done: Arc<AtomicU64>,
}

#[pymethods]
impl PyProgress {
    #[new]
    fn new() -> Self {
        PyProgress::default()
    }

    /// Bytes done so far.
    #[getter]
    fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }
}

fn manifest_json(m: &embstore_core::table::checkpoint::Manifest) -> PyResult<String> {
    serde_json::to_string(m).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// Loads a checkpoint into a native table (its configuration is read back
/// with `Table.config()`).
#[pyfunction]
#[pyo3(signature = (path, settings="{}", progress=None))]
pub fn load_table(
    py: Python<'_>,
    path: PathBuf,
    settings: &str,
    progress: Option<PyRef<'_, PyProgress>>,
) -> PyResult<PyTable> {
    let load = LoadConfig::from_json(settings).map_err(PyStoreError)?;
    let counter = progress.map(|p| p.done.clone());
    let held = crate::runtime::lock_for_reading(py, &path, checkpoint::READ_WAIT)?;
    let (table, _) =
        py.enter_store(|| Table::load_as(&path, held, &load, counter.as_deref(), None))?;
    Ok(PyTable::from_table(table))
}

/// The report of `python -m embstore inspect`: (text, JSON, whether every
/// file passed every check).
#[pyfunction]
pub fn checkpoint_report(py: Python<'_>, path: PathBuf) -> PyResult<(String, String, bool)> {
    // Held across the report (which takes it again, at once): taken here,
    // outside the call lock.
    let held = crate::runtime::lock_for_reading(py, &path, checkpoint::READ_WAIT);
    let r = py.enter_store(|| checkpoint::report(&path))?;
    drop(held);
    Ok((r.text, r.json, r.whole))
}

/// The combiner named `name`.
pub(crate) fn combiner(name: &str) -> PyResult<Combiner> {
    Ok(Combiner::from_name(name).map_err(PyStoreError)?)
}

/// Bags over borrowed slices.
pub(crate) fn bags<'a>(
    ids: &'a PyReadonlyArray1<'_, i64>,
    offsets: &'a PyReadonlyArray1<'_, i64>,
    weights: Option<&'a PyReadonlyArray1<'_, f32>>,
    combiner_name: &str,
) -> PyResult<Bags<'a>> {
    Ok(Bags {
        ids: slice(ids, "ids")?,
        offsets: slice(offsets, "offsets")?,
        weights: weights.map(|w| slice(w, "weights")).transpose()?,
        combiner: combiner(combiner_name)?,
    })
}

/// Bags over ids and offsets already taken (see [`slice_or_copy`]).
fn bags_over<'a>(
    ids: &'a [i64],
    offsets: &'a [i64],
    weights: Option<&'a PyReadonlyArray1<'_, f32>>,
    combiner_name: &str,
) -> PyResult<Bags<'a>> {
    Ok(Bags {
        ids,
        offsets,
        weights: weights.map(|w| slice(w, "weights")).transpose()?,
        combiner: combiner(combiner_name)?,
    })
}

fn to_2d(
    py: Python<'_>,
    v: Vec<f32>,
    rows: usize,
    cols: usize,
) -> PyResult<Bound<'_, PyArray2<f32>>> {
    v.into_pyarray(py).reshape([rows, cols])
}

impl PyTable {
    /// Wraps a core table.
    pub(crate) fn from_table(table: Table) -> Self {
        PyTable {
            inner: Arc::new(table),
        }
    }
}

#[pymethods]
impl PyTable {
    /// A table built from `config`, the JSON of a core `TableConfig`
    /// (`embstore.TableConfig` writes it), on the SIMD backend `simd`.
    #[new]
    #[pyo3(signature = (config, simd=None))]
    fn new(config: &str, simd: Option<&str>) -> PyResult<Self> {
        let mut cfg = TableConfig::from_json(config).map_err(PyStoreError)?;
        cfg.backend = match simd {
            Some(name) => Some(Backend::from_name(name).map_err(PyStoreError)?),
            None => None,
        };
        let table = Table::new(cfg).map_err(PyStoreError)?;
        Ok(PyTable {
            inner: Arc::new(table),
        })
    }

    /// Columns per row.
    #[getter]
    fn dim(&self) -> usize {
        self.inner.dim()
    }

    /// Floats of optimizer state per row.
    #[getter]
    fn state_len(&self) -> usize {
        self.inner.state_len()
    }

    /// Seed of the initializer.
    #[getter]
    fn seed(&self) -> u64 {
        self.inner.seed()
    }

    /// Optimizer steps taken.
    #[getter]
    fn step(&self) -> u64 {
        self.inner.step()
    }

    /// Number of shards.
    #[getter]
    fn num_shards(&self) -> usize {
        self.inner.num_shards()
    }

    /// Name of the SIMD backend in use.
    #[getter]
    fn simd(&self) -> &'static str {
        self.inner.backend().name()
    }

    /// Names of the optimizer state blocks.
    #[getter]
    fn state_names(&self) -> Vec<&'static str> {
        self.inner
            .optimizer()
            .map_or_else(Vec::new, |o| o.state_names().to_vec())
    }

    /// Storage dtype of the rows.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.policy().format.name()
    }

    /// The table's configuration as the JSON `TableConfig::to_json` writes
    /// (what `embstore.TableConfig` reads back; a loaded table's wrapper
    /// is rebuilt from it).
    fn config_json(&self) -> String {
        self.inner.config().to_json()
    }

    /// The call clock (LRU recency).
    #[getter]
    fn clock(&self) -> u64 {
        self.inner.clock()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Runs TTL and capacity eviction now; the evicted keys ascending and,
    /// with `with_rows`, their rows.
    #[pyo3(signature = (with_rows=false))]
    #[allow(clippy::type_complexity)]
    fn evict<'py>(
        &self,
        py: Python<'py>,
        with_rows: bool,
    ) -> PyResult<(Bound<'py, PyArray1<i64>>, Option<Bound<'py, PyArray2<f32>>>)> {
        let table = &self.inner;
        let (keys, rows) = py.enter_store(|| Ok(table.evict(with_rows)))?;
        let n = keys.len();
        let rows = if with_rows {
            Some(to_2d(py, rows, n, table.dim())?)
        } else {
            None
        };
        Ok((keys.into_pyarray(py), rows))
    }

    /// The admission sketch's count estimate of each key.
    fn admission_counts<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray1<'_, i64>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let k = slice(&keys, "keys")?;
        let mut out = zeros::<u32>("keys", k.len()).map_err(PyStoreError)?;
        let table = &self.inner;
        py.enter_store(|| table.admission_counts(k, &mut out))?;
        Ok(out.into_pyarray(py))
    }

    #[pyo3(signature = (keys, insert=true, missing="init", default_row=None))]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        insert: bool,
        missing: &str,
        default_row: Option<PyReadonlyArray1<'py, f32>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let keys = keys_arg(keys, "keys")?.readonly();
        let k = slice_or_copy(&keys, "keys")?;
        let k = &k[..];
        let missing = missing_of(missing, default_row.as_ref())?;
        let table = &self.inner;
        let out = crate::outbuf::array2(py, k.len(), table.dim(), "keys")?;
        {
            let mut rw = out.readwrite();
            let dst = rw.as_slice_mut()?;
            // A small lookup runs at once, with the GIL held, when it need
            // not wait for any lock.
            let t0 = Instant::now();
            py.enter_store_now(
                dst,
                |dst| table.try_lookup_now(k, insert, missing, dst),
                |dst| table.lookup_or(k, insert, missing, dst),
            )?;
            table.lookup_latency().record(t0.elapsed());
        }
        Ok(out)
    }

    #[pyo3(signature = (keys, missing="init", default_row=None))]
    #[allow(clippy::type_complexity)]
    fn lookup_found<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        missing: &str,
        default_row: Option<PyReadonlyArray1<'py, f32>>,
    ) -> PyResult<(Bound<'py, PyArray2<f32>>, Bound<'py, PyArray1<bool>>)> {
        let keys = keys_arg(keys, "keys")?.readonly();
        let k = slice_or_copy(&keys, "keys")?;
        let k = &k[..];
        let missing = missing_of(missing, default_row.as_ref())?;
        let table = &self.inner;
        let out = crate::outbuf::array2(py, k.len(), table.dim(), "keys")?;
        let found = {
            let mut rw = out.readwrite();
            let dst = rw.as_slice_mut()?;
            let t0 = Instant::now();
            let found = py.enter_store(|| {
                let mut found = zeros::<bool>("keys", k.len())?;
                table
                    .lookup_found(k, missing, dst, &mut found)
                    .map(|()| found)
            })?;
            table.lookup_latency().record(t0.elapsed());
            found
        };
        Ok((out, found.into_pyarray(py)))
    }

    #[pyo3(signature = (
        ids, offsets, weights=None, combiner="sum", insert=true, missing="init", default_row=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn lookup_pooled<'py>(
        &self,
        py: Python<'py>,
        ids: &Bound<'py, PyAny>,
        offsets: &Bound<'py, PyAny>,
        weights: Option<PyReadonlyArray1<'py, f32>>,
        combiner: &str,
        insert: bool,
        missing: &str,
        default_row: Option<PyReadonlyArray1<'py, f32>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let (ids, offsets) = bag_arrays(ids, offsets)?;
        let (i, o) = (
            slice_or_copy(&ids, "ids")?,
            slice_or_copy(&offsets, "offsets")?,
        );
        let b = bags_over(&i, &o, weights.as_ref(), combiner)?;
        let missing = missing_of(missing, default_row.as_ref())?;
        let table = &self.inner;
        let out = crate::outbuf::array2(py, b.batch(), table.dim(), "offsets")?;
        {
            let mut rw = out.readwrite();
            let dst = rw.as_slice_mut()?;
            let t0 = Instant::now();
            py.enter_store(|| table.lookup_pooled_or(&b, insert, missing, dst))?;
            table.lookup_latency().record(t0.elapsed());
        }
        Ok(out)
    }

    #[pyo3(signature = (ids, offsets, grads, weights=None, combiner="sum"))]
    fn apply_pooled_gradients(
        &self,
        py: Python<'_>,
        ids: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        weights: Option<PyReadonlyArray1<'_, f32>>,
        combiner: &str,
    ) -> PyResult<()> {
        let (ids, offsets) = bag_arrays(ids, offsets)?;
        let (i, o) = (
            slice_or_copy(&ids, "ids")?,
            slice_or_copy(&offsets, "offsets")?,
        );
        let b = bags_over(&i, &o, weights.as_ref(), combiner)?;
        let table = &self.inner;
        let batch = b.offsets.len().saturating_sub(1);
        let grads = rows_arg(grads, batch, table.dim(), "grads")?.readonly();
        let g = rows_of(&grads, batch, table.dim(), "grads")?;
        py.enter_store(|| table.apply_pooled_gradients(&b, &g))
    }

    fn contains<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray1<'py, i64>,
    ) -> PyResult<Bound<'py, PyArray1<bool>>> {
        let k = slice(&keys, "keys")?;
        let table = &self.inner;
        let out = py.enter_store(|| {
            let mut out = zeros::<bool>("keys", k.len())?;
            table.contains(k, &mut out).map(|()| out)
        })?;
        Ok(out.into_pyarray(py))
    }

    /// Keys and values as the wrapper got them (converted by [`keys_arg`]
    /// and [`rows_arg`] unless they are int64 `(n,)` and float32 `(n, dim)`
    /// arrays): a one-row call pays for no check made twice.
    #[pyo3(signature = (keys, values, state=None))]
    fn assign(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        state: Option<PyReadonlyArray2<'_, f32>>,
    ) -> PyResult<()> {
        let table = &self.inner;
        let keys = keys_arg(keys, "keys")?.readonly();
        let k = slice_or_copy(&keys, "keys")?;
        let values = rows_arg(values, k.len(), table.dim(), "values")?.readonly();
        let v = rows_of(&values, k.len(), table.dim(), "values")?;
        let (k, v) = (&k[..], &v[..]);
        let st = state.as_ref().map(|s| slice2(s, "state")).transpose()?;
        if st.is_none() {
            // A small assign runs at once, with the GIL held, when it need
            // not wait for any lock nor allocate; evictions it calls for
            // run as any call does.
            let over = py.enter_store_now(
                (),
                |()| table.try_assign_now(k, v),
                |()| table.assign(k, v).map(|()| false),
            )?;
            if over {
                py.enter_store(|| {
                    table.enforce_capacity_now();
                    Ok(())
                })?;
            }
            return Ok(());
        }
        py.enter_store(|| match st {
            Some(st) => table.assign_state(k, v, st),
            None => table.assign(k, v),
        })
    }

    /// Rows and optimizer state of `keys` (a tier in front of the table
    /// takes both over). With `out` (a writeable C-contiguous float32
    /// array of at least `n * (dim + state_len)` values, a transfer buffer)
    /// the rows go to its first `n * dim` values and the state right after
    /// them, and nothing is returned. With `stored`, each row is its
    /// stored words (`weight_words` a row) instead of `dim` floats.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (keys, insert, out=None, stored=false))]
    fn lookup_with_state<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray1<'py, i64>,
        insert: bool,
        out: Option<Bound<'py, PyArray1<f32>>>,
        stored: bool,
    ) -> PyResult<Option<(Bound<'py, PyArray2<f32>>, Bound<'py, PyArray2<f32>>)>> {
        let k = slice(&keys, "keys")?;
        let table = &self.inner;
        let sl = table.state_len();
        let dim = if stored {
            table.weight_words()
        } else {
            table.dim()
        };
        let run = |dst: &mut [f32], sdst: &mut [f32]| {
            if stored {
                table.lookup_stored_with_state(k, insert, dst, sdst)
            } else {
                table.lookup_with_state(k, insert, dst, sdst)
            }
        };
        if let Some(buf) = out {
            let mut rw = buf
                .try_readwrite()
                .map_err(|_| PyValueError::new_err("out: expected a writeable array"))?;
            let all = rw
                .as_slice_mut()
                .map_err(|_| PyValueError::new_err("out: expected a C-contiguous array"))?;
            let need = k.len() * (dim + sl);
            if all.len() < need {
                return Err(PyValueError::new_err(format!(
                    "out: expected at least {need} float32 values, got {}",
                    all.len()
                )));
            }
            let (dst, sdst) = all[..need].split_at_mut(k.len() * dim);
            py.enter_store(|| run(dst, sdst))?;
            return Ok(None);
        }
        let out = crate::outbuf::array2(py, k.len(), dim, "keys")?;
        let st = crate::outbuf::array2(py, k.len(), sl, "keys")?;
        {
            let mut rw = out.readwrite();
            let mut sw = st.readwrite();
            let (dst, sdst) = (rw.as_slice_mut()?, sw.as_slice_mut()?);
            py.enter_store(|| run(dst, sdst))?;
        }
        Ok(Some((out, st)))
    }

    /// Float words of a row as the table stores it.
    fn weight_words(&self) -> usize {
        self.inner.weight_words()
    }

    /// Inserts or overwrites rows given as stored (`words`, float32
    /// `(n, weight_words)`) with their optimizer state, kept bit for bit.
    fn assign_stored(
        &self,
        py: Python<'_>,
        keys: PyReadonlyArray1<'_, i64>,
        words: PyReadonlyArray2<'_, f32>,
        state: PyReadonlyArray2<'_, f32>,
    ) -> PyResult<()> {
        let (k, w, st) = (
            slice(&keys, "keys")?,
            slice2(&words, "words")?,
            slice2(&state, "state")?,
        );
        let table = &self.inner;
        py.enter_store(|| table.assign_stored(k, w, st))
    }

    /// Sets the optimizer step counter (a tier in front of the table that
    /// runs the optimizer itself keeps the table's count in step).
    fn set_step(&self, step: u64) -> PyResult<()> {
        Ok(self.inner.set_step(step).map_err(PyStoreError)?)
    }

    /// Reserves index space and touched row memory for `rows` more rows.
    fn reserve(&self, py: Python<'_>, rows: usize) -> PyResult<()> {
        let table = &self.inner;
        py.enter_store(|| table.reserve_rows(rows))
    }

    fn remove(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, i64>) -> PyResult<usize> {
        let k = slice(&keys, "keys")?;
        let table = &self.inner;
        py.enter_store(|| table.remove(k))
    }

    /// Takes the next step number (a tier in front that runs the step of
    /// some rows itself), without changing any row.
    fn advance_step(&self) -> PyResult<u64> {
        Ok(self.inner.advance_step().map_err(PyStoreError)?)
    }

    /// One optimizer step numbered `step` (from `advance_step`).
    fn apply_gradients_at(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
        step: u64,
    ) -> PyResult<()> {
        let table = &self.inner;
        let keys = keys_arg(keys, "keys")?.readonly();
        let k = slice_or_copy(&keys, "keys")?;
        let grads = rows_arg(grads, k.len(), table.dim(), "grads")?.readonly();
        let g = rows_of(&grads, k.len(), table.dim(), "grads")?;
        py.enter_store(|| table.apply_gradients_at(&k, &g, step))
    }

    fn apply_gradients(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        grads: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let table = &self.inner;
        let keys = keys_arg(keys, "keys")?.readonly();
        let k = slice_or_copy(&keys, "keys")?;
        let grads = rows_arg(grads, k.len(), table.dim(), "grads")?.readonly();
        let g = rows_of(&grads, k.len(), table.dim(), "grads")?;
        py.enter_store(|| table.apply_gradients(&k, &g))
    }

    /// Every row: keys ascending, rows, with `with_state` their optimizer
    /// state, and with `with_meta` each row's policy metadata (4 u32 words
    /// a row: tick low, tick high, step, count; none where the table tracks
    /// no touches) and the call clock, all of one snapshot; or, with
    /// `consistent=False`, read without waiting for writers (each row whole,
    /// rows of different moments, no metadata).
    #[pyo3(signature = (with_state=false, with_meta=false, consistent=true, progress=None))]
    #[allow(clippy::type_complexity)]
    fn export<'py>(
        &self,
        py: Python<'py>,
        with_state: bool,
        with_meta: bool,
        consistent: bool,
        progress: Option<PyRef<'_, PyProgress>>,
    ) -> PyResult<(
        Bound<'py, PyArray1<i64>>,
        Bound<'py, PyArray2<f32>>,
        Bound<'py, PyArray2<f32>>,
        Bound<'py, PyArray2<u32>>,
        u64,
    )> {
        let table = &self.inner;
        let done = progress.map(|p| p.done.clone());
        let done = done.as_deref();
        let e = if consistent {
            py.enter_store(|| table.export_all_counted(with_state, with_meta, done))?
        } else {
            py.enter_store(|| table.export_live_counted(with_state, done))?
        };
        let n = e.keys.len();
        let sl = if with_state { table.state_len() } else { 0 };
        let words = if e.meta.is_empty() { 0 } else { 4 };
        Ok((
            e.keys.into_pyarray(py),
            to_2d(py, e.rows, n, table.dim())?,
            to_2d(py, e.state, n, sl)?,
            e.meta.into_pyarray(py).reshape([n, words])?,
            e.clock,
        ))
    }

    /// Rows with optimizer state and policy metadata (`meta`: 4 u32 words
    /// a row, as [`export`] gives them with `with_meta`); the clock moves to `clock`.
    #[pyo3(signature = (keys, values, state, meta, clock))]
    fn restore(
        &self,
        py: Python<'_>,
        keys: PyReadonlyArray1<'_, i64>,
        values: PyReadonlyArray2<'_, f32>,
        state: Option<PyReadonlyArray2<'_, f32>>,
        meta: PyReadonlyArray2<'_, u32>,
        clock: u64,
    ) -> PyResult<()> {
        let (k, v) = (slice(&keys, "keys")?, slice2(&values, "values")?);
        let st = state.as_ref().map(|s| slice2(s, "state")).transpose()?;
        let m = slice2(&meta, "meta")?;
        let m = (!m.is_empty()).then_some(m);
        let table = &self.inner;
        py.enter_store(|| table.restore(k, v, st, m, clock))
    }

    /// `restore` of rows as the table stores them (`assign_stored`'s words).
    fn restore_stored(
        &self,
        py: Python<'_>,
        keys: PyReadonlyArray1<'_, i64>,
        words: PyReadonlyArray2<'_, f32>,
        state: Option<PyReadonlyArray2<'_, f32>>,
        meta: PyReadonlyArray2<'_, u32>,
        clock: u64,
    ) -> PyResult<()> {
        let (k, w) = (slice(&keys, "keys")?, slice2(&words, "words")?);
        let st = state.as_ref().map(|s| slice2(s, "state")).transpose()?;
        let m = slice2(&meta, "meta")?;
        let m = (!m.is_empty()).then_some(m);
        let table = &self.inner;
        py.enter_store(|| table.restore_stored(k, w, st, m, clock))
    }

    /// Every key held (in memory and on disk), ascending.
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let table = &self.inner;
        let keys = py.enter_store(|| Records::keys_of(table))?;
        Ok(keys.into_pyarray(py))
    }

    /// The rows of `keys` as stored, with their state and metadata words
    /// (4 a row where the policy tracks touches, else none); touches nothing.
    #[allow(clippy::type_complexity)]
    fn take_records<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray1<'py, i64>,
    ) -> PyResult<(
        Bound<'py, PyArray2<f32>>,
        Bound<'py, PyArray2<f32>>,
        Bound<'py, PyArray2<u32>>,
    )> {
        let k = slice(&keys, "keys")?;
        let table = &self.inner;
        let r = py.enter_store(|| Records::take(table, k))?;
        let (n, mw) = (k.len(), r.meta_words);
        Ok((
            to_2d(py, r.words, n, table.weight_words())?,
            to_2d(py, r.state, n, table.state_len())?,
            r.meta.into_pyarray(py).reshape([n, mw])?,
        ))
    }

    #[pyo3(signature = (path, incremental=false, with_optimizer=true, progress=None))]
    fn save(
        &self,
        py: Python<'_>,
        path: PathBuf,
        incremental: bool,
        with_optimizer: bool,
        progress: Option<PyRef<'_, PyProgress>>,
    ) -> PyResult<(String, u64)> {
        let counter = progress.map(|p| p.done.clone());
        let table = &self.inner;
        let writer = lock_outside_calls(py, &path)?;
        let info = py.enter_store(|| {
            table.save_locked(&writer, incremental, with_optimizer, counter.as_deref())
        })?;
        Ok((manifest_json(&info.manifest)?, info.bytes_written))
    }

    /// Writes every row to shard files `{prefix}-...` (fsynced, no manifest);
    /// returns their entries as JSON.
    #[pyo3(signature = (path, prefix, with_optimizer=true))]
    fn write_files(
        &self,
        py: Python<'_>,
        path: PathBuf,
        prefix: &str,
        with_optimizer: bool,
    ) -> PyResult<String> {
        let table = &self.inner;
        let files = py.enter_store(|| table.write_files(&path, prefix, with_optimizer, None))?;
        serde_json::to_string(&files).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Publishes one checkpoint at `path` made of the files of `parts`
    /// (each a `write_files` result), `rows` rows in all, described by this
    /// table's configuration and step; returns the manifest as JSON.
    #[pyo3(signature = (path, id, parts, rows, with_optimizer=true, partition=None))]
    #[allow(clippy::too_many_arguments)]
    fn publish_parts(
        &self,
        py: Python<'_>,
        path: PathBuf,
        id: &str,
        parts: Vec<String>,
        rows: u64,
        with_optimizer: bool,
        partition: Option<&str>,
    ) -> PyResult<String> {
        let files = parts
            .iter()
            .map(|p| serde_json::from_str(p))
            .collect::<std::result::Result<Vec<Vec<checkpoint::FileEntry>>, _>>()
            .map_err(|e| PyValueError::new_err(format!("parts: {e}")))?;
        let partition = partition
            .map(|text| {
                let record: checkpoint::PartitionRecord = serde_json::from_str(text)
                    .map_err(|e| PyValueError::new_err(format!("partition: {e}")))?;
                record
                    .check()
                    .map_err(|e| PyValueError::new_err(e.to_string()))?;
                Ok::<_, PyErr>(record)
            })
            .transpose()?;
        let table = &self.inner;
        let writer = lock_outside_calls(py, &path)?;
        let m = py.enter_store(|| {
            checkpoint::publish_parts(&writer, table, id, with_optimizer, files, rows, partition)
        })?;
        manifest_json(&m)
    }

    /// The lookup latency histogram: (bucket bounds in seconds, calls per
    /// bucket with one more above the last bound, total seconds).
    fn lookup_latency(&self) -> (Vec<f64>, Vec<u64>, f64) {
        latency_of(self.inner.lookup_latency())
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let table = &self.inner;
        let s = py.enter_store(|| Ok(table.stats()))?;
        let d = PyDict::new(py);
        d.set_item("rows", s.rows)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("shard_rows", s.shard_rows)?;
        d.set_item("num_shards", table.num_shards())?;
        d.set_item("step", s.step)?;
        d.set_item("dim", table.dim())?;
        d.set_item("state_len", table.state_len())?;
        d.set_item("simd", table.backend().name())?;
        d.set_item("dtype", table.policy().format.name())?;
        for (name, v) in s.counters {
            d.set_item(name, v)?;
        }
        d.set_item("sketch_bytes", s.sketch_bytes)?;
        d.set_item("index_bytes", s.index_bytes)?;
        d.set_item("weights_bytes", s.weights_bytes)?;
        d.set_item("state_bytes", s.state_bytes)?;
        d.set_item("capacity", table.policy().capacity)?;
        d.set_item("capacity_bytes", table.policy().capacity_bytes)?;
        d.set_item("capacity_rows", table.capacity_rows())?;
        d.set_item("row_cost", table.row_cost())?;
        if let Some(st) = table.disk_stats() {
            d.set_item("memory_rows", st.memory_rows)?;
            d.set_item("disk_rows", st.disk_rows)?;
            d.set_item("disk_bytes", st.disk_bytes)?;
            d.set_item("disk_index_bytes", st.disk_index_bytes)?;
            d.set_item("overall_hit_rate", st.overall_hit_rate)?;
            d.set_item("disk_rows_read", st.rows_read)?;
            d.set_item("disk_rows_written", st.rows_written)?;
            d.set_item("disk_rows_compacted", st.rows_compacted)?;
            d.set_item("disk_spill_rounds", st.spill_rounds)?;
            d.set_item("disk_spill_rounds_on_calls", st.spill_rounds_on_calls)?;
            d.set_item("disk_error", st.error)?;
        }
        Ok(d)
    }

    /// Starts moving the rows of `keys` that a disk table holds on disk
    /// into memory, on a thread of its own (inside the call lock, so that
    /// a `fork()` waits for it), and returns at once (nothing for a table
    /// in memory). A failure is left for the call that needs the rows.
    fn prefetch(&self, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        if self.inner.disk().is_none() {
            return Ok(());
        }
        let keys = keys_arg(keys, "keys")?.readonly();
        let keys = slice_or_copy(&keys, "keys")?;
        // The thread's own copy, its memory asked for first.
        let mut owned = with_room("keys", keys.len()).map_err(PyStoreError)?;
        owned.extend_from_slice(&keys);
        let (keys, table) = (owned, self.inner.clone());
        std::thread::Builder::new()
            .name("embstore-prefetch".into())
            .spawn(move || {
                crate::runtime::in_call(|| {
                    let _ = table.prefetch_now(&keys);
                })
            })
            .map(drop)
            .map_err(|e| PyValueError::new_err(format!("keys: cannot start a prefetch: {e}")))
    }
}

/// A latency histogram as Python reads it (see `Table.lookup_latency`).
pub(crate) fn latency_of(l: &embstore_core::latency::Latency) -> (Vec<f64>, Vec<u64>, f64) {
    let c = l.counts();
    let bounds = embstore_core::latency::BOUNDS_NS
        .iter()
        .map(|&ns| ns as f64 / 1e9)
        .collect();
    (bounds, c.buckets, c.sum_ns as f64 * 1e-9)
}

/// A lookup's `missing` mode and optional default row as the core's
/// [`Missing`].
pub(crate) fn missing_of<'a>(
    mode: &str,
    row: Option<&'a PyReadonlyArray1<'_, f32>>,
) -> PyResult<embstore_core::Missing<'a>> {
    let row = row.map(|r| slice(r, "default")).transpose()?;
    crate::convert::missing(mode, row)
}
