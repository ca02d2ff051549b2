//! The one mapping from core errors to Python exceptions.

use embstore_core::StoreError;
use pyo3::PyErr;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError, PyRuntimeError, PyValueError};

create_exception!(
    embstore.exceptions,
    EmbstoreError,
    PyException,
    "Base class of embstore's own exceptions."
);
create_exception!(
    embstore.exceptions,
    CheckpointError,
    EmbstoreError,
    "A checkpoint could not be written, or is damaged, unknown or does not fit; nothing was loaded."
);

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
            err @ StoreError::Checkpoint { .. } => CheckpointError::new_err(err.to_string()),
            err @ StoreError::OutOfMemory { .. } => PyMemoryError::new_err(err.to_string()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use pyo3::Python;
    use pyo3::types::PyTypeMethods;

    #[test]
    fn every_store_error_maps_to_its_python_class() {
        Python::initialize();
        Python::attach(|py| {
            let cases: Vec<(StoreError, &str)> = vec![
                (StoreError::NoOptimizer, "ValueError"),
                (
                    StoreError::NonFinite {
                        arg: "grads",
                        index: 3,
                    },
                    "ValueError",
                ),
                (
                    StoreError::Checkpoint {
                        path: "x".into(),
                        msg: "bad".into(),
                    },
                    "CheckpointError",
                ),
                (
                    StoreError::OutOfMemory {
                        arg: "keys",
                        bytes: 1 << 40,
                    },
                    "MemoryError",
                ),
            ];
            for (e, class) in cases {
                let err: PyErr = PyStoreError(e).into();
                let name = err.get_type(py).name().unwrap().to_string();
                assert_eq!(name, class);
            }
        });
    }
}
