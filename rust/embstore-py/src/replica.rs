//! What a replica (`embstore.serving.Replica`) needs of the core: a
//! source's manifest checked as a load checks it, the CRC-32C a manifest
//! records, and a local publish with the save's protocol.

use std::path::PathBuf;

use embstore_core::table::checkpoint;
use pyo3::prelude::*;

use crate::error::PyStoreError;
use crate::runtime::EnterStore;

/// The files the manifest `text` (read from `source`, named in errors)
/// names, each `(name, bytes, crc32c)` once, after checking the manifest
/// as a load checks it (schema, version, checksum, plain file names).
#[pyfunction]
pub fn manifest_files(source: PathBuf, text: &[u8]) -> PyResult<Vec<(String, u64, u32)>> {
    let m = checkpoint::parse_manifest(&source, text).map_err(PyStoreError)?;
    let mut seen = std::collections::HashSet::new();
    Ok(m.files()
        .filter(|f| seen.insert(f.name.as_str()))
        .map(|f| (f.name.clone(), f.bytes, f.crc32c))
        .collect())
}

/// The CRC-32C of `data` continued from `value` (0 to start), as a
/// manifest records each file's.
#[pyfunction]
#[pyo3(signature = (data, value = 0))]
pub fn crc32c(py: Python<'_>, data: &[u8], value: u32) -> u32 {
    if data.len() < 1 << 16 {
        return ::crc32c::crc32c_append(value, data);
    }
    py.detach(|| ::crc32c::crc32c_append(value, data))
}

/// Publishes at `path` the manifest `text` whose files were copied there,
/// as a save publishes (`checkpoint::publish_copied`); returns the
/// manifest's checksum.
#[pyfunction]
pub fn publish_copied(py: Python<'_>, path: PathBuf, text: Vec<u8>) -> PyResult<u32> {
    py.enter_store(|| checkpoint::publish_copied(&path, &text))
}
