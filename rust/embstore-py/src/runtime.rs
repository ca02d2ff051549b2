//! The binding's runtime: rayon's pool (the global one, or a forked
//! child's own), the call lock a fork waits on, the fork handlers, and the
//! one way every core call is entered ([`EnterStore::enter_store`], with a
//! call that never waits first tried with the GIL held).

use std::cell::RefCell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock, RwLockWriteGuard};

use rayon::{ThreadPool, ThreadPoolBuildError, ThreadPoolBuilder};

use embstore_core::StoreError;
use pyo3::exceptions::PyMemoryError;
use pyo3::prelude::*;

use crate::error::{PyStoreError, panic_error};

/// The process that imported the module.
pub static PARENT_PID: OnceLock<u32> = OnceLock::new();

/// Set in a child process by the fork handler ([`install_fork_handlers`]):
/// until then every call runs in the importing process, which [`in_pool`]
/// knows without asking the OS for the process id (a system call per call).
static FORKED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// In a forked child: this thread's own pool, and the process it was made in.
    static CHILD_POOL: RefCell<Option<(u32, Arc<ThreadPool>)>> = const { RefCell::new(None) };
}

/// Runs `f` where its parallel work can run. Normally that is rayon's
/// global pool, with `f` on the calling thread (a whole call is never a
/// rayon job, so a worker waiting in a join never picks up another caller's
/// call, which might wait on a lock the first one holds). In a forked child
/// the global pool's threads do not exist (its first call would hang: a
/// PyTorch DataLoader worker, a multiprocessing child); there each calling
/// thread gets a pool of its own, so calls still never steal one another.
///
/// # Errors
/// When a forked child's pool cannot start its threads (nothing ran).
pub fn in_pool<T: Send>(f: impl FnOnce() -> T + Send) -> Result<T, ThreadPoolBuildError> {
    if !FORKED.load(Ordering::Relaxed) {
        return Ok(f());
    }
    let pid = std::process::id();
    if *PARENT_PID.get_or_init(|| pid) == pid {
        return Ok(f());
    }
    let pool = CHILD_POOL.with(|cell| {
        let mut slot = cell.borrow_mut();
        match slot.as_ref() {
            Some((owner, pool)) if *owner == pid => Ok(pool.clone()),
            _ => {
                let pool = Arc::new(
                    ThreadPoolBuilder::new()
                        .thread_name(|i| format!("embstore-child-{i}"))
                        .build()?,
                );
                if let Some(stale) = slot.replace((pid, pool.clone())) {
                    // A pool of an earlier process: its threads are gone.
                    std::mem::forget(stale);
                }
                Ok(pool)
            }
        }
    })?;
    Ok(pool.install(f))
}

/// Starts rayon's global pool (at import), so that no later call is the
/// first to need its threads: rayon tries to start its global pool once
/// per process, so a first call made where no thread can start (a memory
/// or process limit reached since import) would leave every later call
/// without a pool.
///
/// # Errors
/// `MemoryError` naming the OS's reason when the threads cannot start (the
/// import fails with it).
pub fn start_global_pool() -> PyResult<()> {
    let started = ThreadPoolBuilder::new()
        .thread_name(|i| format!("embstore-{i}"))
        .build_global();
    match started {
        Ok(()) => Ok(()),
        // Started already: this process imported the module before.
        Err(e) if e.to_string().contains("already") => Ok(()),
        Err(e) => Err(PyMemoryError::new_err(format!(
            "embstore: cannot start its native thread pool: {e}"
        ))),
    }
}

/// The error of a call that found no pool to run in.
pub fn no_pool(e: ThreadPoolBuildError) -> PyErr {
    PyMemoryError::new_err(format!(
        "cannot start a native thread pool in this forked process: {e}; nothing changed"
    ))
}

/// Held shared by every core call ([`EnterStore::enter_store`]) and
/// exclusively across `fork()` (see [`install_fork_handlers`]): a process
/// forks only while no call is inside the core, so no table lock, no pool
/// job and no half-written row is left behind in the child, whose first
/// call would otherwise wait forever on a lock held by a thread that does
/// not exist there.
static CALLS: RwLock<()> = RwLock::new(());

thread_local! {
    /// The forking thread's hold on [`CALLS`], from `prepare` to `parent`/`child`.
    static FORK_HOLD: RefCell<Option<RwLockWriteGuard<'static, ()>>> = const { RefCell::new(None) };
}

extern "C" fn before_fork() {
    let hold = CALLS.write().unwrap_or_else(PoisonError::into_inner);
    FORK_HOLD.with(|h| *h.borrow_mut() = Some(hold));
}

extern "C" fn after_fork() {
    FORK_HOLD.with(|h| drop(h.borrow_mut().take()));
}

extern "C" fn after_fork_in_child() {
    FORKED.store(true, Ordering::Relaxed);
    after_fork();
}

/// Registers the fork handlers (once, at import). The forking thread holds
/// the GIL, and a call inside the core never needs it, so waiting for the
/// calls in flight cannot deadlock.
pub fn install_fork_handlers() {
    #[cfg(unix)]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: the three handlers are plain functions that live as
            // long as the process (the module is never unloaded); they only
            // take and release a std lock held in a thread-local slot of the
            // forking thread (the child's also sets an atomic flag).
            unsafe {
                libc::pthread_atfork(
                    Some(before_fork),
                    Some(after_fork),
                    Some(after_fork_in_child),
                );
            }
        });
    }
}

/// Runs an O(n) core call with the GIL released (see [`in_pool`]),
/// turning a core error or a panic into a Python exception. Nothing inside
/// may touch Python objects.
pub trait EnterStore {
    /// Runs `f` detached from the interpreter.
    fn enter_store<T: Send>(self, f: impl FnOnce() -> Result<T, StoreError> + Send) -> PyResult<T>;

    /// Runs a core call that can first be tried at once: `now` (on `arg`)
    /// with the GIL held, a call that never waits and answers `None` where
    /// it would have to; then, unless it answered, `f` (on `arg`) as
    /// [`EnterStore::enter_store`] runs it. A small lookup is such a call:
    /// for a call of a few microseconds, handing the GIL over and back
    /// costs more than the call.
    fn enter_store_now<A: Send, T: Send>(
        self,
        arg: A,
        now: impl FnOnce(&mut A) -> Option<Result<T, StoreError>>,
        f: impl FnOnce(A) -> Result<T, StoreError> + Send,
    ) -> PyResult<T>;
}

impl EnterStore for Python<'_> {
    fn enter_store<T: Send>(self, f: impl FnOnce() -> Result<T, StoreError> + Send) -> PyResult<T> {
        let run = || {
            let _call = CALLS.read().unwrap_or_else(PoisonError::into_inner);
            let got = in_pool(|| catch_unwind(AssertUnwindSafe(f)));
            (got, embstore_core::table::take_disk_reports())
        };
        let (got, reports) = self.detach(run);
        for e in reports {
            disk_warning(self, &e)?;
        }
        match got {
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err(e))) => Err(PyStoreError(e).into()),
            Ok(Err(payload)) => Err(panic_error(payload)),
            Err(e) => Err(no_pool(e)),
        }
    }

    fn enter_store_now<A: Send, T: Send>(
        self,
        mut arg: A,
        now_: impl FnOnce(&mut A) -> Option<Result<T, StoreError>>,
        f: impl FnOnce(A) -> Result<T, StoreError> + Send,
    ) -> PyResult<T> {
        match now(|| now_(&mut arg))? {
            Some(v) => Ok(v),
            None => self.enter_store(|| f(arg)),
        }
    }
}

/// Tells the caller, as a `RuntimeWarning`, of a disk table's failure to
/// move rows out of memory since its last call (the rows stayed in memory,
/// past `memory_bytes`; later calls try again).
///
/// # Errors
/// The warning, where warnings are errors.
fn disk_warning(py: Python<'_>, e: &str) -> PyResult<()> {
    let msg = std::ffi::CString::new(format!(
        "a disk table could not move rows out of memory: they stay in memory, past \
         memory_bytes, and later calls try again (stats()['disk_error']): {e}"
    ))
    .unwrap_or_default();
    PyErr::warn(
        py,
        &py.get_type::<pyo3::exceptions::PyRuntimeWarning>(),
        &msg,
        1,
    )
}

/// Runs `f`, a core call on a thread of the binding's own (a disk table's
/// prefetch), inside the call lock and where its parallel work can run, as
/// [`EnterStore::enter_store`] runs a call: a `fork()` waits for it.
/// A panic is caught and dropped (the call that needs its work meets the
/// failure again).
pub fn in_call(f: impl FnOnce() + Send) {
    let _call = CALLS.read().unwrap_or_else(PoisonError::into_inner);
    let _ = in_pool(|| catch_unwind(AssertUnwindSafe(f)));
}

/// Runs a core call that never waits (it answers `None` where it would
/// have to) with the GIL held: for a call of a few microseconds, handing
/// the GIL over and back costs more than the call, and from several
/// Python threads each hand-over waits for a thread switch. Nothing here
/// blocks: the call lock is only tried (a fork in progress means `None`),
/// and the core call takes only locks that are free. `Ok(None)`: the
/// caller makes the ordinary call.
///
/// # Errors
/// The core call's error, or a panic as an internal error.
fn now<T>(f: impl FnOnce() -> Option<Result<T, StoreError>>) -> PyResult<Option<T>> {
    let _call = match CALLS.try_read() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return Ok(None),
    };
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(None) => Ok(None),
        Ok(Some(Ok(v))) => Ok(Some(v)),
        Ok(Some(Err(e))) => Err(PyStoreError(e).into()),
        Err(payload) => Err(panic_error(payload)),
    }
}

/// Takes the readers' lock of the checkpoint directory `path` (shared) for
/// a call about to read it, waiting at most `wait`, with the GIL released
/// and outside the call lock: another process can hold that lock, and a
/// wait inside the call lock would hold up `fork()` (and so every thread
/// of the process) for as long. `None`: the directory has no lock file.
///
/// # Errors
/// `CheckpointError` when `path` is not a checkpoint directory, its lock
/// file is not a regular file, or the lock stays held for `wait`.
pub fn lock_for_reading(
    py: Python<'_>,
    path: &std::path::Path,
    wait: std::time::Duration,
) -> PyResult<Option<embstore_core::table::checkpoint::DirLock>> {
    py.detach(|| embstore_core::table::checkpoint::lock_for_reading(path, wait))
        .map_err(|e| PyStoreError(e).into())
}
