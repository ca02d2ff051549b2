//! A disk table's own directory of segment files: made fresh under the
//! table's `disk` path, locked while the table lives, removed with it; the
//! directories of disk tables whose process died are removed by the next
//! disk table made beside them.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Result, invalid};

/// A disk table's own directory under [`DiskConfig::path`], locked while
/// the table lives and removed with it.
#[derive(Debug)]
pub(crate) struct StoreDir {
    pub(crate) path: PathBuf,
    _lock: File,
    /// The process that made it (a forked child never removes it).
    pid: u32,
}

impl StoreDir {
    /// Creates a fresh directory under `parent`, removing the directories
    /// of disk tables whose process is gone (their lock is free).
    pub(crate) fn create(parent: &Path) -> Result<StoreDir> {
        let fail = |e: std::io::Error| {
            invalid(
                "disk",
                format!("cannot make a directory under {}: {e}", parent.display()),
            )
        };
        std::fs::create_dir_all(parent).map_err(fail)?;
        remove_stale(parent);
        static N: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "embstore-disk-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let path = parent.join(name);
        if path.exists() {
            // A directory of an earlier process of the same id.
            let _ = std::fs::remove_dir_all(&path);
        }
        std::fs::create_dir(&path).map_err(fail)?;
        let lock = File::create(path.join("lock")).map_err(fail)?;
        lock.lock().map_err(fail)?;
        Ok(StoreDir {
            path,
            _lock: lock,
            pid: std::process::id(),
        })
    }
}

impl Drop for StoreDir {
    fn drop(&mut self) {
        if self.pid == std::process::id() {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Removes the disk-table directories under `parent` whose lock no process
/// holds (a process killed before it could remove its own).
fn remove_stale(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        if !name.to_string_lossy().starts_with("embstore-disk-") {
            continue;
        }
        let dir = e.path();
        // Only a real directory, and its lock file opened as an untrusted
        // file is (no link followed, no blocking open of a FIFO).
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let Ok(lock) = crate::format::untrusted::open_file(&dir.join("lock")) else {
            continue;
        };
        if lock.try_lock().is_ok() {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
