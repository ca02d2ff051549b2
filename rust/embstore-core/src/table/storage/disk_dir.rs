//! A disk table's own directory of segment files: made fresh under the
//! table's `disk` path, locked while the table lives, removed with it; the
//! directories of disk tables whose process died are removed by the next
//! disk table made beside them.
//!
//! A directory gets its name only once its lock is held: it is made under
//! a staging name (`.embstore-new-ID`), its lock file created and locked
//! there, and only then renamed to `embstore-disk-PID-ID`. So a directory
//! with the table's name always has a lock, held from before it had the
//! name until its process dies, and the one check both the sweep and the
//! creation make ([`held`]) tells a live table from a dead one whatever the
//! pid namespace (two containers sharing a spill volume, each trainer pid
//! 1): no name is reused while its lock is held, and no live directory is
//! removed.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Result, invalid};

/// Names of disk tables' directories, and of those being made.
const PREFIX: &str = "embstore-disk-";
const STAGING: &str = ".embstore-new-";

/// A staging directory left this long is a crashed creation's (a creation
/// holds its lock within microseconds of making it).
const STAGING_AGE: Duration = Duration::from_secs(600);

/// Fresh names tried before a creation gives up (each is new: the time,
/// the process and a counter, mixed).
const TRIES: usize = 16;

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
    ///
    /// # Errors
    /// `InvalidArgument` naming `disk` when `parent` is empty, is not a
    /// directory, or no directory can be made in it.
    pub(crate) fn create(parent: &Path) -> Result<StoreDir> {
        if parent.as_os_str().is_empty() {
            return Err(invalid(
                "disk",
                "expected the path of a directory, got an empty path",
            ));
        }
        let fail = |e: std::io::Error| {
            invalid(
                "disk",
                format!("cannot make a directory under {}: {e}", parent.display()),
            )
        };
        if parent.exists() && !parent.is_dir() {
            return Err(invalid(
                "disk",
                format!(
                    "expected a directory, {} is a file (or a link to one)",
                    parent.display()
                ),
            ));
        }
        std::fs::create_dir_all(parent).map_err(fail)?;
        remove_stale(parent);
        let pid = std::process::id();
        let mut last = None;
        for _ in 0..TRIES {
            let id = crate::format::files::new_id();
            let staging = parent.join(format!("{STAGING}{id}"));
            match std::fs::create_dir(&staging) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(fail(e)),
            }
            let locked = crate::format::untrusted::create_file(&staging.join("lock"))
                .and_then(|f| f.try_lock().map(|()| f).map_err(std::io::Error::from));
            let lock = match locked {
                Ok(f) => f,
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&staging);
                    return Err(fail(e));
                }
            };
            let path = parent.join(format!("{PREFIX}{pid}-{id}"));
            // Never over another table's directory: a live one holds its
            // lock file, so a rename onto it fails (a directory is renamed
            // only onto an empty one), and the name is checked first.
            if path.symlink_metadata().is_ok() {
                let _ = std::fs::remove_dir_all(&staging);
                continue;
            }
            match std::fs::rename(&staging, &path) {
                Ok(()) => {
                    return Ok(StoreDir {
                        path,
                        _lock: lock,
                        pid,
                    });
                }
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&staging);
                    last = Some(e);
                }
            }
        }
        Err(fail(last.unwrap_or_else(|| {
            std::io::Error::other(format!("{TRIES} fresh names were all taken"))
        })))
    }
}

impl Drop for StoreDir {
    fn drop(&mut self) {
        if self.pid == std::process::id() {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Whether a process holds the lock of the directory `dir`: `Some(true)`
/// while one does, `Some(false)` when its lock file is free (its process
/// is gone), `None` when it has no lock file to ask (opened as an
/// untrusted file is: no link followed, no blocking open of a FIFO). The
/// one check of liveness, for the sweep and the creation alike.
fn held(dir: &Path) -> Option<bool> {
    let lock = crate::format::untrusted::open_file(&dir.join("lock")).ok()?;
    Some(lock.try_lock().is_err())
}

/// Removes the disk-table directories under `parent` whose lock no process
/// holds (a process killed before it could remove its own), and staging
/// directories of creations that crashed long ago.
fn remove_stale(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let staging = name.starts_with(STAGING);
        if !name.starts_with(PREFIX) && !staging {
            continue;
        }
        // Only a real directory.
        let Ok(meta) = e.metadata() else { continue };
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let dir = e.path();
        let dead = if staging {
            // A creation locks within microseconds; one this old crashed
            // (its lock, if it made one, is free or it never had one).
            let old = meta
                .modified()
                .ok()
                .and_then(|m| m.elapsed().ok())
                .is_some_and(|age| age > STAGING_AGE);
            old && held(&dir) != Some(true)
        } else {
            held(&dir) == Some(false)
        };
        if dead {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::temp_dir;

    #[test]
    fn a_live_directory_of_a_process_with_the_same_pid_is_never_removed_or_reused() {
        let parent = temp_dir("dirs-same-pid");
        // Another process's table (another container, the same pid): its
        // directory is named as this process would name one, and its lock
        // is held (by a file opened here: flock is per open file).
        let pid = std::process::id();
        let mut theirs = Vec::new();
        for n in 0..4 {
            let dir = parent.join(format!("{PREFIX}{pid}-{n}"));
            std::fs::create_dir(&dir).unwrap();
            let lock = File::create(dir.join("lock")).unwrap();
            lock.lock().unwrap();
            std::fs::write(dir.join("seg-0"), b"rows").unwrap();
            theirs.push((dir, lock));
        }
        let ours: Vec<StoreDir> = (0..8).map(|_| StoreDir::create(&parent).unwrap()).collect();
        for (dir, _) in &theirs {
            assert_eq!(std::fs::read(dir.join("seg-0")).unwrap(), b"rows");
        }
        let mut names: Vec<&PathBuf> = ours.iter().map(|d| &d.path).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 8);
        for d in &ours {
            assert!(theirs.iter().all(|(t, _)| *t != d.path));
            assert_eq!(held(&d.path), Some(true));
        }
        // Their process dies (its lock released): the next creation
        // removes its directories, never ours.
        let dead: Vec<PathBuf> = theirs.drain(..).map(|(d, _)| d).collect();
        let next = StoreDir::create(&parent).unwrap();
        assert!(dead.iter().all(|d| !d.exists()));
        assert!(ours.iter().chain([&next]).all(|d| d.path.exists()));
        drop(ours);
        drop(next);
        let left: Vec<_> = std::fs::read_dir(&parent).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
        std::fs::remove_dir_all(&parent).unwrap();
    }

    #[test]
    fn a_fresh_staging_directory_stays_and_an_old_unlocked_one_goes() {
        let parent = temp_dir("dirs-staging");
        let fresh = parent.join(format!("{STAGING}fresh"));
        std::fs::create_dir_all(&fresh).unwrap();
        std::fs::write(fresh.join("lock"), b"").unwrap();
        let old = parent.join(format!("{STAGING}old"));
        std::fs::create_dir_all(&old).unwrap();
        let past = std::time::SystemTime::now() - STAGING_AGE * 2;
        File::open(&old).unwrap().set_modified(past).unwrap();
        let made = StoreDir::create(&parent).unwrap();
        assert!(fresh.exists());
        assert!(!old.exists());
        drop(made);
        std::fs::remove_dir_all(&parent).unwrap();
    }

    #[test]
    fn an_empty_path_or_a_file_is_refused_naming_disk() {
        let parent = temp_dir("dirs-bad");
        std::fs::create_dir_all(&parent).unwrap();
        let file = parent.join("a-file");
        std::fs::write(&file, b"x").unwrap();
        for bad in [PathBuf::new(), file.clone()] {
            let e = StoreDir::create(&bad).unwrap_err().to_string();
            assert!(e.contains("disk"), "{e}");
            assert!(e.contains("expected"), "{e}");
        }
        assert_eq!(std::fs::read(&file).unwrap(), b"x");
        std::fs::remove_dir_all(&parent).unwrap();
    }
}
