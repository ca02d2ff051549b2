//! Advisory locks that make a checkpoint directory safe under concurrency,
//! between threads and between processes (`flock`-style whole-file locks,
//! [`std::fs::File::lock`]).
//!
//! - Writers (a save, a publish) hold the directory itself exclusively for
//!   the whole save: two saves to one path run one after the other, each
//!   publishing a whole checkpoint, instead of deleting each other's files.
//! - Readers (a load, a verify) hold [`READERS_LOCK`] shared while they read
//!   the manifest and its files. A writer deletes the files that its new
//!   manifest no longer names only if it can take that lock exclusively
//!   without waiting; otherwise it leaves them for the next save, so a load
//!   that started on the previous checkpoint reads it whole.
//!
//! The lock file is created by the first save; a directory without one (a
//! checkpoint written by an older embstore, or on a read-only copy) is read
//! without the readers' lock, and a load then retries when the manifest
//! changes under it. A lock file that is not a regular file (a FIFO, a
//! symbolic link) is refused, never opened blocking, followed or created
//! through ([`super::untrusted`]).

use crate::error::{Result, ckpt_err};
use crate::format::untrusted;
use std::fs::{File, TryLockError};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The readers' lock file inside a checkpoint directory.
pub(crate) const READERS_LOCK: &str = ".embstore-lock";

/// A held lock; dropping it releases the lock.
#[derive(Debug)]
pub struct DirLock {
    file: File,
    dir: PathBuf,
}

impl DirLock {
    /// The directory this lock is of.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Released explicitly, not only by closing the file: a process
        // forked meanwhile shares the open file (and so the lock) until it
        // closes its copy, which would keep the directory locked.
        let _ = self.file.unlock();
    }
}

/// Takes the writers' lock of `dir` (which exists), waiting for a save
/// that holds it, and makes sure the readers' lock file exists.
///
/// # Errors
/// `Checkpoint` when the directory cannot be opened or locked.
pub(crate) fn writer(dir: &Path) -> Result<DirLock> {
    let f = untrusted::open_dir(dir)
        .map_err(|e| ckpt_err(dir, format!("cannot open the directory: {e}")))?;
    f.lock()
        .map_err(|e| ckpt_err(dir, format!("cannot lock the directory for writing: {e}")))?;
    // Created now, while no reader can hold it (a reader that found none
    // reads without it).
    untrusted::open_or_create_file(&dir.join(READERS_LOCK))
        .map_err(|e| ckpt_err(dir, format!("cannot create {READERS_LOCK}: {e}")))?;
    Ok(DirLock {
        file: f,
        dir: dir.to_path_buf(),
    })
}

/// How long [`reader`] waits for the readers' lock: a save holds it
/// exclusively only while it unlinks files (milliseconds); longer means
/// another process holds it, which must not hang a reader.
pub const READ_WAIT: Duration = Duration::from_secs(10);

/// Takes the readers' lock of `dir` shared, waiting (at most
/// [`READ_WAIT`]) while a writer deletes files; `None` where the directory
/// has no lock file (read without it).
///
/// # Errors
/// As [`reader_within`].
pub(crate) fn reader(dir: &Path) -> Result<Option<DirLock>> {
    reader_within(dir, READ_WAIT)
}

/// Takes the readers' lock of `dir` shared if it is free now; `None`
/// where it is not, or the directory has no lock file.
///
/// # Errors
/// As [`reader_within`], but never for a lock held.
pub(crate) fn try_reader(dir: &Path) -> Result<Option<DirLock>> {
    match open_readers(dir)? {
        None => Ok(None),
        Some((f, _)) => Ok(f.try_lock_shared().ok().map(|()| DirLock {
            file: f,
            dir: dir.to_path_buf(),
        })),
    }
}

/// The readers' lock file of `dir`, opened (`None`: there is none).
fn open_readers(dir: &Path) -> Result<Option<(File, PathBuf)>> {
    let d = untrusted::open_dir(dir)
        .map_err(|e| ckpt_err(dir, format!("expected a checkpoint directory: {e}")))?;
    drop(d);
    let path = dir.join(READERS_LOCK);
    match untrusted::open_file(&path) {
        Ok(f) => Ok(Some((f, path))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ckpt_err(&path, format!("cannot open the lock file: {e}"))),
    }
}

/// Takes the readers' lock of `dir` shared, polling while a writer (or
/// another process) holds it exclusively, for at most `wait`; `None` where
/// the directory has no lock file. Never blocks in the kernel: the wait is
/// bounded, so a process that holds the lock forever cannot hang a reader.
///
/// # Errors
/// `Checkpoint` when `dir` is not a directory, the lock file is something
/// other than a regular file or cannot be opened, or the lock stays held
/// for `wait`.
pub fn reader_within(dir: &Path, wait: Duration) -> Result<Option<DirLock>> {
    let Some((f, path)) = open_readers(dir)? else {
        return Ok(None);
    };
    let start = Instant::now();
    let mut pause = Duration::from_micros(200);
    loop {
        match f.try_lock_shared() {
            Ok(()) => {
                return Ok(Some(DirLock {
                    file: f,
                    dir: dir.to_path_buf(),
                }));
            }
            Err(TryLockError::WouldBlock) => {}
            Err(TryLockError::Error(e)) => {
                return Err(ckpt_err(&path, format!("cannot lock for reading: {e}")));
            }
        }
        let spent = start.elapsed();
        if spent >= wait {
            return Err(ckpt_err(
                &path,
                format!(
                    "the readers' lock is held exclusively by another process for more than \
                     {:.1} s (a save holds it for milliseconds): nothing was read",
                    wait.as_secs_f64()
                ),
            ));
        }
        std::thread::sleep(pause.min(wait - spent));
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// How long a publish polls for the readers' lock to itself before it
/// leaves the files it replaced to the next publish ([`cleaner`]). Readers
/// hold the lock shared while they read a manifest and open its files
/// (milliseconds); a follower with nothing new takes no lock at all.
pub(crate) const CLEAN_WAIT: Duration = Duration::from_millis(200);

/// Takes the readers' lock of `dir` exclusively once no reader holds it,
/// polling for at most `wait`; `None` if readers held it all that time (or
/// there is no lock file that is a regular file). Never blocks in the
/// kernel, so a process holding the lock forever delays a publish by
/// `wait` only.
pub(crate) fn cleaner(dir: &Path, wait: Duration) -> Option<DirLock> {
    let f = untrusted::open_file(&dir.join(READERS_LOCK)).ok()?;
    let start = Instant::now();
    let mut pause = Duration::from_micros(100);
    loop {
        match f.try_lock() {
            Ok(()) => {
                return Some(DirLock {
                    file: f,
                    dir: dir.to_path_buf(),
                });
            }
            Err(TryLockError::WouldBlock) => {}
            Err(TryLockError::Error(_)) => return None,
        }
        let spent = start.elapsed();
        if spent >= wait {
            return None;
        }
        std::thread::sleep(pause.min(wait - spent));
        pause = (pause * 2).min(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_keeps_the_cleaner_out_and_writers_exclude_each_other() {
        let dir = std::env::temp_dir().join(format!("embstore-dirlock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(
            reader(&dir).unwrap().is_none(),
            "no lock file before the first save"
        );
        let w = writer(&dir).unwrap();
        {
            let _r = reader(&dir)
                .unwrap()
                .expect("the writer created the lock file");
            assert!(
                cleaner(&dir, Duration::from_millis(20)).is_none(),
                "a reader holds it"
            );
        }
        assert!(cleaner(&dir, Duration::ZERO).is_some(), "no reader now");
        // A second writer waits for the first: try from another thread.
        let (tx, rx) = std::sync::mpsc::channel();
        let d2 = dir.clone();
        let t = std::thread::spawn(move || {
            let _w2 = writer(&d2).unwrap();
            tx.send(()).unwrap();
        });
        assert!(
            rx.recv_timeout(std::time::Duration::from_millis(200))
                .is_err(),
            "the second writer must wait"
        );
        drop(w);
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("the second writer goes on once the first is done");
        t.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_cleaner_outwaits_a_reader_that_lets_go_within_its_wait() {
        let dir = std::env::temp_dir().join(format!("embstore-cleaner-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        drop(writer(&dir).unwrap());
        let r = reader(&dir)
            .unwrap()
            .expect("the writer made the lock file");
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(r);
        });
        let start = Instant::now();
        let got = cleaner(&dir, Duration::from_secs(5));
        assert!(got.is_some(), "the reader let go after 50 ms");
        assert!(
            start.elapsed() >= Duration::from_millis(40),
            "it had to wait for the reader"
        );
        t.join().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
