//! Conversion of Python configuration to core types.

use std::collections::HashMap;

use embstore_core::{Admission, Initializer, Missing, Optimizer};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::error::PyStoreError;

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

/// An admission filter from its name and parameters, as `embstore.policy` passes them.
pub fn admission(name: &str, p: &HashMap<String, f64>) -> PyResult<Admission> {
    let p: Vec<(String, f64)> = p.iter().map(|(k, v)| (k.clone(), *v)).collect();
    Ok(Admission::from_named(name, &p).map_err(PyStoreError)?)
}

/// A lookup's default for keys without a row: "init", "zeros" or "row" (then
/// `row` holds it).
pub fn missing<'a>(mode: &str, row: Option<&'a [f32]>) -> PyResult<Missing<'a>> {
    match (mode, row) {
        ("init", None) => Ok(Missing::Init),
        ("zeros", None) => Ok(Missing::Zeros),
        ("row", Some(r)) => Ok(Missing::Row(r)),
        _ => Err(PyValueError::new_err(format!(
            "default: expected \"init\", \"zeros\" or a row of dim floats, got {mode:?}"
        ))),
    }
}
