//! A disk table's compaction in the background: at the end of a round of
//! moving rows to disk (under the cold gate taken exclusively), the rows
//! that finished jobs moved are named in their new places, and a job is
//! started for the shards whose files are more than half dead
//! ([`storage::compact`](super::storage::compact)); one runs at a time, on
//! a thread of its own.

use crate::table::views::DiskTier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::table::Shards;
use crate::table::storage::cold::{Done, Job};
use crate::table::storage::disk_dir::StoreDir;
use crate::table::storage::write;

/// The background compaction of a disk table's shards (see
/// [`storage::compact`](super::storage::compact)): at most one job runs at
/// a time; a job done waits here until the next round of moving rows out
/// names its rows in their new places.
#[derive(Debug, Default)]
pub(crate) struct Compaction {
    pub(crate) running: Arc<AtomicBool>,
    pub(crate) done: Arc<Mutex<Vec<(usize, Done)>>>,
    /// Rows moved by the jobs installed.
    pub(crate) moved: AtomicU64,
}

/// A mutex's guard (a poisoned one is taken as it is).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Live rows a compaction job moves at most (beyond one file's).
const JOB_ROWS: usize = 1 << 17;

/// What background work runs inside, on its thread: set by the Python
/// binding ([`set_background_runner`]) to its call lock, so that a
/// `fork()` waits for it as for a call.
static RUNNER: std::sync::OnceLock<Runner> = std::sync::OnceLock::new();

/// Work for the background, and what runs it ([`set_background_runner`]).
pub type Work = Box<dyn FnOnce() + Send>;
type Runner = fn(Work);

/// Sets what a disk table's background work (compaction) runs inside:
/// `run` is handed each piece of work on the thread made for it, and runs
/// it (inside whatever lock a `fork()` must wait for). Set once; later
/// calls change nothing.
pub fn set_background_runner(run: fn(Work)) {
    let _ = RUNNER.set(run);
}

/// Runs `work`, on a thread of the crate's own, inside the runner if one is
/// set.
pub(crate) fn run_background(work: Work) {
    match RUNNER.get() {
        Some(run) => run(work),
        None => work(),
    }
}

/// Runs `work` on a thread of its own (inside the runner, if one is set);
/// where no thread can be started, now, on the calling thread (which is in
/// a call already).
pub(crate) fn background(name: &str, work: Work) {
    let slot = Arc::new(Mutex::new(Some(work)));
    let theirs = Arc::clone(&slot);
    let spawned = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            if let Some(w) = lock(&theirs).take() {
                run_background(w);
            }
        });
    if spawned.is_err()
        && let Some(w) = lock(&slot).take()
    {
        w();
    }
}

/// Names the rows that finished compaction jobs moved in their new places
/// (the caller holds the cold gate exclusively, so no call is between
/// finding a row and moving it in); returns the last job's failure, if
/// any.
pub(crate) fn install_compactions(shards: &Shards, c: &Compaction) -> Option<String> {
    let done = std::mem::take(&mut *lock(&c.done));
    let mut error = None;
    for (s, d) in done {
        if d.error.is_some() {
            error.clone_from(&d.error);
        }
        if let Some(cold) = write(&shards[s]).cold.as_mut() {
            let n = cold.install(d);
            c.moved.fetch_add(n as u64, Ordering::Relaxed);
        }
    }
    error
}

impl DiskTier<'_> {
    /// Waits for a scheduled round of moving rows out and a running
    /// compaction job, and names what it moved (tests that look at the
    /// files).
    #[cfg(test)]
    pub(crate) fn settle_compaction(&self) {
        let Some(c) = &self.cold else {
            return;
        };
        // A round of moving rows out still scheduled runs first (it may
        // start a job).
        self.settle_spill(c);
        while c.compaction.running.load(Ordering::Acquire) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let _excl = c.gate.write().unwrap_or_else(PoisonError::into_inner);
        assert_eq!(install_compactions(&self.shards, &c.compaction), None);
    }
}

/// Starts a compaction job, in the background, of the shards whose files
/// are more than half dead, unless one is running. The caller holds the
/// cold gate exclusively.
pub(crate) fn start_compaction(shards: &Shards, c: &Compaction, dir: &Arc<StoreDir>) {
    if c.running.load(Ordering::Acquire) {
        return;
    }
    // A job's lists of rows take memory (about 64 bytes a live row
    // while it runs): it moves about `JOB_ROWS` over all shards.
    let mut budget = JOB_ROWS;
    let mut jobs: Vec<(usize, Job)> = Vec::new();
    for (s, lock) in shards.iter().enumerate() {
        if budget == 0 {
            break;
        }
        let mut g = write(lock);
        let Some(cold) = g.cold.as_mut().filter(|cs| cs.compaction_due()) else {
            continue;
        };
        if let Some(job) = cold.compaction_job(budget) {
            budget = budget.saturating_sub(job.rows());
            jobs.push((s, job));
        }
    }
    if jobs.is_empty() {
        return;
    }
    c.running.store(true, Ordering::Release);
    let (done, running) = (Arc::clone(&c.done), Arc::clone(&c.running));
    // The table's directory outlives the job (the table may be dropped
    // while its job writes there): removed by whichever goes last.
    let dir = Arc::clone(dir);
    background(
        "embstore-compact",
        Box::new(move || {
            let _dir = dir;
            // Cleared however the work ends (a panic included), so that a
            // later round starts the next job.
            struct Clear(Arc<AtomicBool>);
            impl Drop for Clear {
                fn drop(&mut self) {
                    self.0.store(false, Ordering::Release);
                }
            }
            let _clear = Clear(running);
            for (s, job) in jobs {
                let d = job.run();
                lock(&done).push((s, d));
            }
            // This thread's allocations (the job's lists) given back.
            trim_heap();
        }),
    );
}

/// Gives the allocator's free memory back to the OS (glibc keeps the
/// freed buffers of a round of moving rows, tens of megabytes, resident
/// otherwise), so that a disk table's resident memory follows its rows.
pub(crate) fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointer and only returns free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}
