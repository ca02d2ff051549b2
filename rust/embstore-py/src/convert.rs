//! Conversion of Python configuration to core types, and the one helper that
//! runs core calls with the GIL released.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};

use embstore_core::{Initializer, Optimizer, StoreError};
use pyo3::prelude::*;

use crate::error::{PyStoreError, panic_error};

/// Runs an O(n) core call with the GIL released, turning a core error or a
/// panic into a Python exception. Nothing inside may touch Python objects.
pub trait EnterStore {
    /// Runs `f` detached from the interpreter.
    fn enter_store<T: Send>(self, f: impl FnOnce() -> Result<T, StoreError> + Send) -> PyResult<T>;
}

impl EnterStore for Python<'_> {
    fn enter_store<T: Send>(self, f: impl FnOnce() -> Result<T, StoreError> + Send) -> PyResult<T> {
        match self.detach(|| catch_unwind(AssertUnwindSafe(f))) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(PyStoreError(e).into()),
            Err(payload) => Err(panic_error(payload)),
        }
    }
}

/// An optimizer from its class name and parameters, as `embstore.optim` passes them.
pub fn optimizer(name: &str, p: &HashMap<String, f64>) -> PyResult<Optimizer> {
    let p = p.iter().map(|(k, v)| (k.clone(), *v)).collect();
    Ok(Optimizer::from_named(name, &p).map_err(PyStoreError)?)
}

/// An initializer from its class name and parameters, as `embstore.init` passes them.
pub fn initializer(name: &str, p: &HashMap<String, f64>) -> PyResult<Initializer> {
    let p = p.iter().map(|(k, v)| (k.clone(), *v)).collect();
    Ok(Initializer::from_named(name, &p).map_err(PyStoreError)?)
}
