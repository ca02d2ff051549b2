//! The one mapping from core errors to Python exceptions.

use embstore_core::StoreError;
use pyo3::PyErr;
use pyo3::exceptions::{PyRuntimeError, PyValueError};

/// Wraps a core error so that `?` converts it to a `PyErr`.
pub struct PyStoreError(pub StoreError);

impl From<StoreError> for PyStoreError {
    fn from(e: StoreError) -> Self {
        PyStoreError(e)
    }
}

impl From<PyStoreError> for PyErr {
    fn from(e: PyStoreError) -> PyErr {
        match e.0 {
            err @ (StoreError::InvalidArgument { .. }
            | StoreError::ShapeMismatch { .. }
            | StoreError::NonFinite { .. }
            | StoreError::NoOptimizer) => PyValueError::new_err(err.to_string()),
        }
    }
}

/// A panic inside a native call, reported instead of aborting the process.
pub fn panic_error(payload: Box<dyn std::any::Any + Send>) -> PyErr {
    let msg = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string());
    PyRuntimeError::new_err(format!("embstore internal error (panic): {msg}"))
}
