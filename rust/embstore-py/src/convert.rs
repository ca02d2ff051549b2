//! Conversion of Python configuration to core types, and the one helper that
//! runs core calls with the GIL released.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};

use embstore_core::{Initializer, Optimizer, StoreError};
use pyo3::exceptions::PyValueError;
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

fn param(params: &HashMap<String, f64>, name: &str, default: Option<f64>) -> PyResult<f64> {
    match params.get(name).copied().or(default) {
        Some(v) => Ok(v),
        None => Err(PyValueError::new_err(format!("{name}: missing parameter"))),
    }
}

/// An optimizer from its class name and parameters, as `embstore.optim` passes them.
pub fn optimizer(name: &str, p: &HashMap<String, f64>) -> PyResult<Optimizer> {
    let opt = match name {
        "SGD" => Optimizer::Sgd {
            lr: param(p, "lr", None)?,
        },
        "Adagrad" => Optimizer::Adagrad {
            lr: param(p, "lr", None)?,
            initial_accumulator_value: param(p, "initial_accumulator_value", Some(0.0))?,
            eps: param(p, "eps", Some(1e-10))?,
        },
        "RowWiseAdagrad" => Optimizer::RowWiseAdagrad {
            lr: param(p, "lr", None)?,
            eps: param(p, "eps", Some(1e-10))?,
        },
        "Adam" => Optimizer::Adam {
            lr: param(p, "lr", Some(1e-3))?,
            beta1: param(p, "beta1", Some(0.9))?,
            beta2: param(p, "beta2", Some(0.999))?,
            eps: param(p, "eps", Some(1e-8))?,
        },
        "AdamW" => Optimizer::AdamW {
            lr: param(p, "lr", Some(1e-3))?,
            beta1: param(p, "beta1", Some(0.9))?,
            beta2: param(p, "beta2", Some(0.999))?,
            eps: param(p, "eps", Some(1e-8))?,
            weight_decay: param(p, "weight_decay", Some(0.01))?,
        },
        "Ftrl" => Optimizer::Ftrl {
            lr: param(p, "lr", None)?,
            l1: param(p, "l1", Some(0.0))?,
            l2: param(p, "l2", Some(0.0))?,
            beta: param(p, "beta", Some(0.0))?,
            initial_accumulator_value: param(p, "initial_accumulator_value", Some(0.1))?,
        },
        other => {
            return Err(PyValueError::new_err(format!(
                "optimizer: expected one of SGD, Adagrad, RowWiseAdagrad, Adam, AdamW, Ftrl; got {other:?}"
            )));
        }
    };
    opt.validate().map_err(PyStoreError)?;
    Ok(opt)
}

/// An initializer from its class name and parameters, as `embstore.init` passes them.
pub fn initializer(name: &str, p: &HashMap<String, f64>) -> PyResult<Initializer> {
    let init = match name {
        "Uniform" => Initializer::Uniform {
            low: param(p, "low", Some(-0.05))?,
            high: param(p, "high", Some(0.05))?,
        },
        "Normal" => Initializer::Normal {
            mean: param(p, "mean", Some(0.0))?,
            std: param(p, "std", Some(1.0))?,
        },
        "TruncatedNormal" => Initializer::TruncatedNormal {
            mean: param(p, "mean", Some(0.0))?,
            std: param(p, "std", Some(1.0))?,
        },
        "Zeros" => Initializer::Zeros,
        "Constant" => Initializer::Constant {
            value: param(p, "value", None)?,
        },
        other => {
            return Err(PyValueError::new_err(format!(
                "initializer: expected one of Uniform, Normal, TruncatedNormal, Zeros, Constant; got {other:?}"
            )));
        }
    };
    init.validate().map_err(PyStoreError)?;
    Ok(init)
}
