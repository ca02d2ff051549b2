//! `embstore._core.MappedTable`: a read-only table over a checkpoint's
//! mapped files (see `embstore_core::mapped`).

use std::path::PathBuf;
use std::sync::Arc;

use embstore_core::MappedTable;
use embstore_core::zeroed::zeros;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::runtime::{EnterStore, lock_for_reading};
use crate::store::{keys_arg, missing_of, slice, slice_or_copy};
use embstore_core::table::checkpoint::READ_WAIT;
use std::time::Duration;

/// The native mapped table; see `embstore.MappedTable`.
#[pyclass(frozen, name = "MappedTable", module = "embstore._core")]
pub struct PyMappedTable {
    inner: Arc<MappedTable>,
}

impl PyMappedTable {
    /// The core table.
    pub(crate) fn inner(&self) -> &MappedTable {
        &self.inner
    }
}

#[pymethods]
impl PyMappedTable {
    /// Maps the checkpoint at `path` (manifest and file headers read, no
    /// rows).
    /// rows). The directory's readers' lock is waited for (at most 10 s)
    /// before the call lock is taken (`runtime::lock_for_reading`).
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let held = lock_for_reading(py, &path, READ_WAIT)?;
        let inner = py.enter_store(|| MappedTable::open_held(&path, held))?;
        Ok(PyMappedTable {
            inner: Arc::new(inner),
        })
    }

    /// Serves what was published since (see `MappedTable::refresh`);
    /// whether anything was. `wait`: seconds to wait for the directory's
    /// readers' lock (held by another process) before raising
    /// `CheckpointError` (default 10).
    #[pyo3(signature = (wait=None))]
    fn refresh(&self, py: Python<'_>, wait: Option<f64>) -> PyResult<bool> {
        let wait = match wait {
            None => READ_WAIT,
            Some(w) => Duration::try_from_secs_f64(w).map_err(|_| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "wait: expected seconds >= 0, got {w}"
                ))
            })?,
        };
        let table = &self.inner;
        // Nothing published since: no lock taken (a follower polls often).
        if py.detach(|| table.unchanged()) {
            return Ok(false);
        }
        let held = lock_for_reading(py, table.dir(), wait)?;
        py.enter_store(|| table.refresh_held(held))
    }

    /// Reads every file of the version served in now, in 2 MiB pages where
    /// the kernel can give them (see `MappedTable::warm`): what it did.
    fn warm<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let table = &self.inner;
        let r = py.detach(|| table.warm());
        let d = pyo3::types::PyDict::new(py);
        d.set_item("files", r.files)?;
        d.set_item("bytes", r.bytes)?;
        d.set_item("recached_files", r.recached_files)?;
        d.set_item("recached_bytes", r.recached_bytes)?;
        d.set_item("huge_page_bytes", r.huge_page_bytes)?;
        Ok(d)
    }

    /// Whether each refresh from now on warms the files it maps.
    fn set_warm(&self, on: bool) {
        self.inner.set_warm(on);
    }

    /// The checkpoint directory, absolute (resolved once, at open).
    #[getter]
    fn path(&self) -> std::ffi::OsString {
        self.inner.dir().as_os_str().to_os_string()
    }

    /// Versions swapped in by refreshes since open (0 at open).
    #[getter]
    fn version(&self) -> u64 {
        self.inner.version()
    }

    /// Columns per row.
    #[getter]
    fn dim(&self) -> usize {
        self.inner.dim()
    }

    /// Row storage of the files.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.format().name()
    }

    /// Optimizer steps of the table that saved.
    #[getter]
    fn step(&self) -> u64 {
        self.inner.step()
    }

    fn __len__(&self) -> usize {
        self.inner.len() as usize
    }

    /// Rows of `keys` (a missing key read as `missing`) and, with
    /// `with_found`, whether each key had a row.
    #[pyo3(signature = (keys, missing="init", default_row=None, with_found=false))]
    #[allow(clippy::type_complexity)]
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        missing: &str,
        default_row: Option<PyReadonlyArray1<'py, f32>>,
        with_found: bool,
    ) -> PyResult<(
        Bound<'py, PyArray2<f32>>,
        Option<Bound<'py, PyArray1<bool>>>,
    )> {
        let keys = keys_arg(keys, "keys")?.readonly();
        let k = slice_or_copy(&keys, "keys")?;
        let k = &k[..];
        let missing = missing_of(missing, default_row.as_ref())?;
        let table = &self.inner;
        let out = crate::outbuf::array2(py, k.len(), table.dim(), "keys")?;
        let found = {
            let mut rw = out.readwrite();
            let dst = rw.as_slice_mut()?;
            let found = zeros::<bool>("keys", if with_found { k.len() } else { 0 })
                .map_err(crate::error::PyStoreError)?;
            // A small lookup runs at once, with the GIL held, once every
            // file has passed its checksum check.
            let t0 = std::time::Instant::now();
            let found = py.enter_store_now(
                (dst, found),
                |(dst, found)| {
                    let flags = with_found.then_some(&mut found[..]);
                    table
                        .try_lookup_now(k, missing, dst, flags)
                        .map(|r| r.map(|()| std::mem::take(found)))
                },
                |(dst, mut found)| {
                    let flags = with_found.then_some(&mut found[..]);
                    table.lookup(k, missing, dst, flags).map(|()| found)
                },
            )?;
            table.lookup_latency().record(t0.elapsed());
            found
        };
        Ok((out, with_found.then(|| found.into_pyarray(py))))
    }

    /// The lookup latency histogram (see `Table.lookup_latency`).
    fn lookup_latency(&self) -> (Vec<f64>, Vec<u64>, f64) {
        crate::store::latency_of(self.inner.lookup_latency())
    }

    /// Figures of the version served and of the calls since open: rows,
    /// lookups, hits, mapped_bytes (the files, shared with every process
    /// that maps them), overlay_bytes (private), published (the version's
    /// publish time, seconds since the epoch, or None), refresh_seconds.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let s = self.inner.stats();
        let d = pyo3::types::PyDict::new(py);
        d.set_item("rows", s.rows)?;
        d.set_item("lookups", s.lookups)?;
        d.set_item("hits", s.hits)?;
        d.set_item("mapped_bytes", s.mapped_bytes)?;
        d.set_item("overlay_bytes", s.overlay_bytes)?;
        let published = s
            .published
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs_f64());
        d.set_item("published", published)?;
        d.set_item("refresh_seconds", s.refresh_seconds)?;
        Ok(d)
    }

    /// Every row, keys ascending: (keys, rows).
    #[allow(clippy::type_complexity)]
    fn export<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(Bound<'py, PyArray1<i64>>, Bound<'py, PyArray2<f32>>)> {
        let table = &self.inner;
        let (keys, rows) = py.enter_store(|| table.export())?;
        let n = keys.len();
        let rows = rows
            .into_pyarray(py)
            .reshape([n, table.dim()])
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
        Ok((keys.into_pyarray(py), rows))
    }

    /// Whether each key has a row.
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
}
