//! File plumbing: fsync, synced writes, and bounded reads of regular files
//! (with their size and CRC-32C checked).

use crate::error::{Result, StoreError, ckpt_err};
use crate::format::direct::{ReadBuf, read_into};
use crate::format::untrusted;
use crate::hash::mix64;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// One file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint directory.
    pub name: String,
    /// Rows (or removed keys) it holds.
    pub rows: u64,
    /// Its size in bytes.
    pub bytes: u64,
    /// CRC-32C (Castagnoli) of the whole file.
    pub crc32c: u32,
}

pub(crate) fn io_err(path: &Path, what: &str, e: &std::io::Error) -> StoreError {
    ckpt_err(path, format!("{what}: {e}"))
}

/// A fresh checkpoint id (16 hex digits): the time, the process and a counter, mixed.
pub fn new_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let c = COUNTER.fetch_add(1, Ordering::Relaxed);
    let h = mix64(nanos ^ mix64(u64::from(std::process::id()) ^ mix64(c)));
    format!("{h:016x}")
}

pub(crate) fn fsync_dir(dir: &Path) -> Result<()> {
    untrusted::open_dir(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(dir, "cannot fsync the directory", &e))
}

/// Threads that fsync a save's files at once (the calling thread and up to
/// this many less one helpers).
const FSYNC_THREADS: usize = 4;

/// Fsyncs the files `names` of `dir`, several at once, on the calling
/// thread and short-lived helper threads, never on rayon's pool: a worker
/// blocked on the disk is one that the calls going on meanwhile (a training
/// step beside a publish) do not get. Where a helper cannot be started the
/// others, and at least the calling thread, fsync its share.
pub(crate) fn fsync_files<'a>(dir: &Path, names: impl IntoIterator<Item = &'a str>) -> Result<()> {
    let names: Vec<&str> = names.into_iter().collect();
    let next = AtomicUsize::new(0);
    let work = || -> Result<()> {
        loop {
            let Some(n) = names.get(next.fetch_add(1, Ordering::Relaxed)) else {
                return Ok(());
            };
            let path = dir.join(n);
            untrusted::open_file(&path)
                .and_then(|f| f.sync_all())
                .map_err(|e| io_err(&path, "cannot fsync", &e))?;
        }
    };
    std::thread::scope(|s| {
        let helpers: Vec<_> = (1..names.len().min(FSYNC_THREADS))
            .filter_map(|i| {
                std::thread::Builder::new()
                    .name(format!("embstore-fsync-{i}"))
                    .spawn_scoped(s, work)
                    .ok()
            })
            .collect();
        let mine = work();
        helpers.into_iter().fold(mine, |acc, h| {
            let theirs = h
                .join()
                .unwrap_or_else(|_| Err(ckpt_err(dir, "an fsync thread panicked")));
            acc.and(theirs)
        })
    })
}

/// Writes `bytes` to the new file `path` (nothing may be there, not even a
/// symbolic link) and fsyncs it.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = untrusted::create_file(path).map_err(|e| io_err(path, "cannot create", &e))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| io_err(path, "cannot write", &e))
}

/// The rows of one file to write, gathered: its keys, and the bytes of its
/// keys, rows, optimizer state (with `with_state`) and metadata tensors.
#[derive(Debug, Default)]
pub(crate) struct Gathered {
    pub(crate) keys: Vec<i64>,
    pub(crate) kb: Vec<u8>,
    pub(crate) w: Vec<u8>,
    pub(crate) st: Vec<u8>,
    pub(crate) mb: Vec<u8>,
    pub(crate) with_state: bool,
}

/// Read buffers kept between the files of the reads in progress (loads,
/// checks, a mapped table's opening or refresh), so that a read does not
/// fault in fresh memory for every file (files are up to 256 MiB), and
/// dropped when the last such read ends, so that nothing stays resident
/// after it (buffers kept per thread for good held a file's size on every
/// pool thread: 28 bytes a key after loading 10M keys of dim 16). With the
/// number of reads in progress. A leaf lock (`lib.rs`, "Locks"): held to
/// take or put back a buffer, or to count a read in or out.
static READ_BUFS: std::sync::Mutex<(usize, Vec<ReadBuf>)> = std::sync::Mutex::new((0, Vec::new()));

fn read_bufs() -> std::sync::MutexGuard<'static, (usize, Vec<ReadBuf>)> {
    READ_BUFS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A read of several files in progress: while one is alive, the buffers
/// that [`with_file`] reads into are kept for the next file; when the last
/// one ends they are dropped.
#[derive(Debug)]
pub(crate) struct ReadScope(());

impl ReadScope {
    pub(crate) fn new() -> Self {
        read_bufs().0 += 1;
        ReadScope(())
    }
}

impl Drop for ReadScope {
    fn drop(&mut self) {
        let freed = {
            let mut g = read_bufs();
            g.0 -= 1;
            if g.0 == 0 {
                std::mem::take(&mut g.1)
            } else {
                Vec::new()
            }
        };
        drop(freed); // outside the lock
    }
}

/// The bytes of the regular file at `path`, refused (without blocking or
/// reading it) when it is not a regular file (a device, a FIFO, a symbolic
/// link: see [`untrusted`]) or holds more than `limit` bytes.
pub(crate) fn read_regular(path: &Path, limit: u64, missing: &str) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    let too_large =
        |len: u64| (len > limit).then(|| format!("{len} bytes, more than the {limit} allowed"));
    read_regular_into(path, limit, missing, &mut buf, too_large)?;
    Ok(buf)
}

/// [`read_regular`] into `buf` (cleared first); `size_err` says what is
/// wrong with a file of the given size, if anything.
pub(crate) fn read_regular_into(
    path: &Path,
    limit: u64,
    missing: &str,
    buf: &mut Vec<u8>,
    size_err: impl Fn(u64) -> Option<String>,
) -> Result<()> {
    let f = untrusted::open_file(path).map_err(|e| open_err(path, missing, &e))?;
    read_open_into(f, path, limit, missing, buf, size_err)
}

/// The error of an open of `path`: refused by kind (a FIFO, a link, a name
/// that is not plain) rather than `missing`.
fn open_err(path: &Path, missing: &str, e: &std::io::Error) -> StoreError {
    let what = if matches!(
        e.kind(),
        std::io::ErrorKind::Other | std::io::ErrorKind::InvalidInput
    ) {
        "refused"
    } else {
        missing
    };
    io_err(path, what, e)
}

/// Opens the file `name` that a manifest of the checkpoint at `dir` names,
/// through the one checked way ([`untrusted::open_in`]: a plain name
/// inside `dir`), so nothing outside the directory is read or described;
/// `missing` says what a missing or unreadable file is.
///
/// # Errors
/// `Checkpoint`: a name that is not plain (naming the directory only), or
/// the open's error (naming the file).
pub(crate) fn open_named(dir: &Path, name: &str, missing: &str) -> Result<std::fs::File> {
    untrusted::open_in(dir, name).map_err(|err| {
        if err.kind() == std::io::ErrorKind::InvalidInput {
            ckpt_err(dir, err.to_string())
        } else {
            open_err(&dir.join(name), missing, &err)
        }
    })
}

/// [`read_regular_into`] of the file `f`, open at `path`.
fn read_open_into(
    f: std::fs::File,
    path: &Path,
    limit: u64,
    missing: &str,
    buf: &mut Vec<u8>,
    size_err: impl Fn(u64) -> Option<String>,
) -> Result<()> {
    let meta = f.metadata().map_err(|e| io_err(path, missing, &e))?;
    if let Some(msg) = size_err(meta.len()) {
        return Err(ckpt_err(path, msg));
    }
    buf.clear();
    buf.try_reserve_exact(meta.len() as usize)
        .map_err(|_| crate::error::oom("path", meta.len()))?;
    f.take(limit + 1)
        .read_to_end(buf)
        .map_err(|e| io_err(path, "cannot read", &e))?;
    if buf.len() as u64 > limit {
        return Err(ckpt_err(
            path,
            format!("more than the {limit} bytes expected (the file grew while read)"),
        ));
    }
    Ok(())
}

/// Reads a file named by the manifest and checks its size and CRC-32C (a
/// cold file straight from the disk: [`read_into`]).
pub(crate) fn read_checked_into(
    dir: &Path,
    e: &FileEntry,
    progress: Option<&AtomicU64>,
    buf: &mut ReadBuf,
) -> Result<()> {
    read_sized_into(dir, e, buf)?;
    check_crc(dir, e, progress, buf.filled())
}

/// [`read_checked_into`] without the CRC-32C: the file opened by its plain
/// name, its size checked against the manifest's before and after the read.
fn read_sized_into(dir: &Path, e: &FileEntry, buf: &mut ReadBuf) -> Result<()> {
    let f = open_named(dir, &e.name, "missing or unreadable")?;
    let path = dir.join(&e.name);
    let len = f
        .metadata()
        .map_err(|err| io_err(&path, "missing or unreadable", &err))?
        .len();
    if len != e.bytes {
        return Err(ckpt_err(
            &path,
            format!(
                "expected {} bytes, found {len} (truncated or replaced)",
                e.bytes
            ),
        ));
    }
    let (n, _) =
        read_into(&f, len, e.bytes, buf)?.map_err(|err| io_err(&path, "cannot read", &err))?;
    if n as u64 > e.bytes {
        return Err(ckpt_err(
            &path,
            format!(
                "more than the {} bytes expected (the file grew while read)",
                e.bytes
            ),
        ));
    }
    Ok(())
}

/// Checks a file's bytes against the manifest's CRC-32C, then counts them
/// into `progress`.
fn check_crc(dir: &Path, e: &FileEntry, progress: Option<&AtomicU64>, bytes: &[u8]) -> Result<()> {
    let crc = crc32c::crc32c(bytes);
    if crc != e.crc32c {
        return Err(ckpt_err(
            dir.join(&e.name),
            format!(
                "checksum mismatch: expected crc32c {:08x}, found {crc:08x} (damaged)",
                e.crc32c
            ),
        ));
    }
    if let Some(p) = progress {
        p.fetch_add(e.bytes, Ordering::Relaxed);
    }
    Ok(())
}

/// Runs `f` on the checked bytes of a file, read into this thread's buffer.
pub(crate) fn with_file<T>(
    dir: &Path,
    e: &FileEntry,
    progress: Option<&AtomicU64>,
    f: impl FnOnce(&[u8]) -> Result<T>,
) -> Result<T> {
    let mut buf = take_buf();
    let out = read_checked_into(dir, e, progress, &mut buf).and_then(|()| f(buf.filled()));
    put_buf(buf);
    out
}

/// Runs `f` on the checked bytes of each of `files`, on rayon's pool in
/// the order they arrive, while a thread of its own reads them in order,
/// at most one file ahead of the pool: the disk reads the next file while
/// the cores check and load the last ones (a direct read, which a cold
/// file gets, has no kernel read-ahead to do that). Stops at the first
/// error; the reader stops at its next file. Without `ahead` (a disk
/// table, whose memory is tight: the reader's file is one buffer more), or
/// where the thread cannot start, each pool thread reads its own files, one
/// at a time ([`with_file`]).
///
/// # Errors
/// The first error of a read or of `f`.
pub(crate) fn for_each_file(
    dir: &Path,
    files: &[FileEntry],
    progress: Option<&AtomicU64>,
    ahead: bool,
    f: impl Fn(&FileEntry, &[u8]) -> Result<()> + Sync,
) -> Result<()> {
    use rayon::prelude::*;
    let each = |e: &FileEntry| with_file(dir, e, progress, |buf| f(e, buf));
    let by_pool = || files.par_iter().with_max_len(1).try_for_each(each);
    if files.len() < 2 || !ahead {
        return by_pool();
    }
    let (tx, rx) = std::sync::mpsc::sync_channel::<(usize, Result<ReadBuf>)>(1);
    std::thread::scope(|s| {
        let reader = std::thread::Builder::new()
            .name("embstore-read".into())
            .spawn_scoped(s, move || {
                for (i, e) in files.iter().enumerate() {
                    // Reads alone: the checksum is taken by the pool thread
                    // that loads the file, so the disk is kept busy.
                    let mut buf = take_buf();
                    let read = read_sized_into(dir, e, &mut buf).map(|()| buf);
                    let failed = read.is_err();
                    // A receiver gone (the loads stopped at an error) ends it.
                    if tx.send((i, read)).is_err() || failed {
                        break;
                    }
                }
            });
        if reader.is_err() {
            return by_pool();
        }
        rx.into_iter().par_bridge().try_for_each(|(i, read)| {
            let buf = read?;
            let out = check_crc(dir, &files[i], progress, buf.filled())
                .and_then(|()| f(&files[i], buf.filled()));
            put_buf(buf);
            out
        })
    })
}

/// A kept read buffer (the largest), or a new one: taken out, not borrowed
/// across the work on its bytes, which may run rayon jobs (a worker waiting
/// in one may steal another job of this kind, which then takes another
/// buffer or allocates one).
fn take_buf() -> ReadBuf {
    let mut g = read_bufs();
    let big = (0..g.1.len()).max_by_key(|&i| g.1[i].capacity());
    big.map(|i| g.1.swap_remove(i)).unwrap_or_default()
}

/// Gives a read buffer back: kept while a read is in progress, else freed.
fn put_buf(buf: ReadBuf) {
    let mut g = read_bufs();
    if g.0 > 0 {
        g.1.push(buf);
    } else {
        drop(g);
        drop(buf); // no read in progress keeps it (outside the lock)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::invalid;
    use crate::testing::temp_dir;

    /// Files read ahead by the reader thread (or by the pool threads) reach `f` each once with
    /// their bytes; an error of `f`, or a damaged file, ends the run with
    /// that error while the reader has files left (it stops; nothing
    /// hangs).
    #[test]
    fn files_read_ahead_each_reach_f_once_and_an_error_stops_the_reader() {
        let dir = temp_dir("files-ahead");
        let entries: Vec<FileEntry> = (0..12usize)
            .map(|i| {
                let name = format!("f{i}.bin");
                let bytes: Vec<u8> = (0..(i * 50_000 + 3)).map(|j| (i + j) as u8).collect();
                write_synced(&dir.join(&name), &bytes).unwrap();
                FileEntry {
                    name,
                    rows: 0,
                    bytes: bytes.len() as u64,
                    crc32c: crc32c::crc32c(&bytes),
                }
            })
            .collect();
        // With the reader thread, and each pool thread reading its own.
        for ahead in [true, false] {
            let seen = std::sync::Mutex::new(Vec::new());
            for_each_file(&dir, &entries, None, ahead, |e, buf| {
                assert_eq!(buf.len() as u64, e.bytes);
                assert_eq!(crc32c::crc32c(buf), e.crc32c);
                seen.lock().unwrap().push(e.name.clone());
                Ok(())
            })
            .unwrap();
            let mut seen = seen.into_inner().unwrap();
            seen.sort();
            let mut want: Vec<String> = entries.iter().map(|e| e.name.clone()).collect();
            want.sort();
            assert_eq!(seen, want, "every file once");
            let e = for_each_file(&dir, &entries, None, ahead, |e, _| {
                if e.name == "f2.bin" {
                    Err(invalid("rows", "refused by the test".to_string()))
                } else {
                    Ok(())
                }
            })
            .unwrap_err();
            assert!(e.to_string().contains("refused by the test"), "{e}");
            let mut damaged = entries.clone();
            damaged[3].crc32c ^= 1;
            let e = for_each_file(&dir, &damaged, None, ahead, |_, _| Ok(()))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("f3.bin") && e.contains("checksum mismatch"),
                "{e}"
            );
            assert!(
                read_bufs().1.is_empty(),
                "no read in progress keeps a buffer"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn synced_writes_read_back_and_limits_hold() {
        let dir = temp_dir("files");
        let path = dir.join("a.bin");
        write_synced(&path, b"hello").unwrap();
        fsync_files(&dir, ["a.bin"]).unwrap();
        fsync_dir(&dir).unwrap();
        assert_eq!(read_regular(&path, 5, "a").unwrap(), b"hello");
        let e = read_regular(&path, 4, "a").unwrap_err().to_string();
        assert!(e.contains("more than the 4 allowed"), "{e}");
        assert!(read_regular(&dir.join("missing"), 5, "missing file").is_err());
    }

    #[test]
    fn fsyncs_finish_while_every_pool_worker_is_busy_and_name_a_missing_file() {
        // A publish fsyncs beside training that keeps rayon's workers busy:
        // the fsyncs must not wait for a worker (they once ran on the pool,
        // and a training step waited behind a worker blocked on the disk).
        let dir = temp_dir("files-fsync");
        let names: Vec<String> = (0..12).map(|i| format!("f{i}.bin")).collect();
        for n in &names {
            write_synced(&dir.join(n), n.as_bytes()).unwrap();
        }
        let workers = rayon::current_num_threads();
        let parked =
            std::sync::Arc::new((std::sync::Mutex::new(0usize), std::sync::Condvar::new()));
        let release = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        {
            let (parked, release) = (parked.clone(), release.clone());
            rayon::spawn_broadcast(move |_| {
                *parked.0.lock().unwrap() += 1;
                parked.1.notify_all();
                while !release.load(Ordering::Acquire) {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            });
        }
        let mut n = parked.0.lock().unwrap();
        while *n < workers {
            n = parked.1.wait(n).unwrap();
        }
        drop(n);
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dir.clone();
        std::thread::spawn(move || {
            let ok = fsync_files(&d, names.iter().map(String::as_str));
            let missing = fsync_files(&d, ["f0.bin", "gone.bin", "f1.bin"]);
            let _ = tx.send((ok.is_ok(), missing.map_err(|e| e.to_string())));
        });
        let got = rx.recv_timeout(std::time::Duration::from_secs(20));
        release.store(true, Ordering::Release);
        let (ok, missing) = got.expect("fsync_files waited for a busy rayon worker");
        assert!(ok);
        let e = missing.unwrap_err();
        assert!(e.contains("gone.bin") && e.contains("cannot fsync"), "{e}");
    }

    #[test]
    fn a_directory_is_not_a_regular_file() {
        let dir = temp_dir("files-dir");
        assert!(read_regular(&dir, 1 << 20, "dir").is_err());
    }

    #[test]
    fn checkpoint_ids_are_fresh_hex() {
        let (a, b) = (new_id(), new_id());
        assert_ne!(a, b);
        assert_eq!(a.len(), 16);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
    }
}
