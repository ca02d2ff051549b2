//! Conversion of Python configuration to core types, and the one helper that
//! runs core calls with the GIL released.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, PoisonError};

use rayon::{ThreadPool, ThreadPoolBuilder};

use embstore_core::{Initializer, Optimizer, StoreError};
use pyo3::prelude::*;

use crate::error::{PyStoreError, panic_error};

/// The thread pool of this process. Every batch call runs in it. It is
/// rebuilt in a forked child: the parent's worker threads do not exist
/// there, and a pool that counts on them would hang the child's first call
/// (a PyTorch DataLoader worker or a multiprocessing child, say).
pub fn pool() -> Arc<ThreadPool> {
    static POOL: Mutex<Option<(u32, Arc<ThreadPool>)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut slot = POOL.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((owner, pool)) = slot.as_ref()
        && *owner == pid
    {
        return pool.clone();
    }
    let pool = Arc::new(
        ThreadPoolBuilder::new()
            .thread_name(|i| format!("embstore-{i}"))
            .build()
            .expect("cannot start embstore's thread pool"),
    );
    if let Some(stale) = slot.replace((pid, pool.clone())) {
        // The parent's pool: its threads are gone in this process; dropping
        // it would signal them. Leak the handle instead (once per fork).
        std::mem::forget(stale);
    }
    pool
}

/// Runs an O(n) core call with the GIL released, in this process's pool,
/// turning a core error or a panic into a Python exception. Nothing inside
/// may touch Python objects.
pub trait EnterStore {
    /// Runs `f` detached from the interpreter.
    fn enter_store<T: Send>(self, f: impl FnOnce() -> Result<T, StoreError> + Send) -> PyResult<T>;
}

impl EnterStore for Python<'_> {
    fn enter_store<T: Send>(self, f: impl FnOnce() -> Result<T, StoreError> + Send) -> PyResult<T> {
        let pool = pool();
        match self.detach(|| pool.install(|| catch_unwind(AssertUnwindSafe(f)))) {
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
