//! A read-only table served from a checkpoint's files mapped into memory
//! ([`MappedTable`]): opening reads the manifest and each file's header,
//! never its rows, so any number of processes share one copy of the rows in
//! the page cache, and a checkpoint larger than memory is served page by
//! page. Each shard file carries its own hash index
//! ([`crate::format::file_index`]), so no process builds one.
//!
//! Trust: the manifest is checked (schema and checksum) on open, as
//! `Table::load` checks it. A file's CRC-32C is checked once, on the first
//! call that reads from it (all of it: 3.3 ms for a 34 MB file in
//! `benches/mapped.py`), and until it passes no row of it is served; a file
//! that fails is refused on every call. Index entries are bounds-checked and probing is bounded, so even a
//! crafted file with a matching checksum cannot make a reader read out of
//! bounds or loop. The files must not be truncated or rewritten in place
//! while mapped (reading a page cut off a mapped file kills the process
//! with SIGBUS); embstore never does either: a save writes new files and
//! unlinks the old ones, which stay readable through the map.
//!
//! Live updates: [`MappedTable::refresh`] reads the manifest again and maps
//! the links it does not hold yet (a publish's delta; a new base or a
//! compacted chain's new files), keeping those it holds; it checks the new
//! files' checksums before it serves them, then swaps the new version in.
//! Every call reads the version it started with to its end, so it sees one
//! publish whole. Private memory grows by the new links' removed keys and
//! the bookkeeping of their files, not by their rows (those are mapped).

mod file;
mod pipeline;
mod records;
mod snapshot;
mod warm;

use crate::error::{Result, ckpt_err};
use crate::format::codec::RowFormat;
use crate::format::dirlock::{self, DirLock};
use crate::format::files::io_err;
use crate::format::manifest::manifest_bytes;
use crate::hash::key_hash;
use crate::latency::Latency;
use crate::rows::Missing;
use crate::rows::check_len;
use crate::simd::Backend;
use crate::zeroed::{with_room, zeros};
use file::MappedFile;
use rayon::prelude::*;
use snapshot::{Link, Snapshot, read_snapshot};
use std::collections::HashSet;
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

mod read;
pub(crate) use records::MappedRecords;
pub use warm::WarmReport;

/// Keys a call handles on the calling thread; larger calls spread over
/// rayon's pool.
const SEQUENTIAL_KEYS: usize = 4096;

/// The most keys [`MappedTable::try_lookup_now`] runs at once.
const NOW_KEYS: usize = 1024;

/// Keys ahead of the one located whose index slot a lookup prefetches
/// ([`MappedTable::lookup_run`]).
const SLOT_AHEAD: usize = 16;

/// Keys between locating a row (and prefetching it) and copying it.
const ROW_AHEAD: usize = 8;

/// Calls of more keys than this prefetch (a smaller call's keys are gone
/// before its prefetches would land, and repeated small calls read rows in
/// cache: 128 keys took 3.0 us with the prefetches where 2.6-3.0 without).
const PREFETCH_FROM: usize = 32;

/// A read-only table whose rows are read from a checkpoint directory's
/// files mapped into memory (see the module docs).
pub struct MappedTable {
    dir: PathBuf,
    dim: usize,
    format: RowFormat,
    backend: Backend,
    /// The version served: a call clones the `Arc` (the lock is held for
    /// that only) and reads that version to the end; a refresh swaps in a
    /// new one. A leaf lock.
    current: RwLock<Arc<Snapshot>>,
    /// Held by a refresh for its whole run, so that two refreshes do not
    /// map one version twice; no call that reads takes it. It guards the
    /// manifest's bytes as read before the last open or refresh that
    /// succeeded (read before the version it mapped, so a publish between
    /// the two reads differs from them): [`MappedTable::unchanged`]
    /// compares the manifest with them, without the readers' lock.
    refreshing: Mutex<Option<Vec<u8>>>,
    /// Versions swapped in since open (0 at open): raised before a refresh
    /// that swapped returns, so a cache of this table's rows that reads it
    /// at the start of a call knows whether what it holds may be stale.
    version: AtomicU64,
    /// Keys looked up since open.
    lookups: AtomicU64,
    /// Those of them that had a row.
    hits: AtomicU64,
    /// Latencies of lookup calls (recorded by the binding).
    latency: Latency,
    /// How long the last open or refresh that swapped in a version took,
    /// in nanoseconds (the files mapped and checked, the overlay built).
    refresh_ns: AtomicU64,
    /// Versions swapped out whose last reader was a call: handed here
    /// ([`MappedTable::release`]) instead of unmapped on the serving thread
    /// (an unmap and an overlay's free take milliseconds: a lookup's p99.9
    /// during refreshes), and dropped by the next [`MappedTable::unchanged`]
    /// (a follow thread's poll) or refresh, or with the table. A leaf lock.
    retired: Mutex<Vec<Snapshot>>,
    /// Whether a refresh warms the files it maps before it checks and
    /// serves them ([`MappedTable::set_warm`]).
    warm_new: AtomicBool,
}

/// A mapped table's figures, as `stats()` reports them.
#[derive(Debug, Clone)]
pub struct MappedStats {
    /// Rows of the version served.
    pub rows: u64,
    /// Keys looked up since open.
    pub lookups: u64,
    /// Those of them that had a row.
    pub hits: u64,
    /// Bytes of the files mapped (shared with every process that maps them).
    pub mapped_bytes: u64,
    /// Private memory of the deltas' overlay (about 32 bytes a delta key).
    pub overlay_bytes: u64,
    /// When the version served was published (see `Snapshot::published`).
    pub published: Option<std::time::SystemTime>,
    /// Seconds the last open or refresh that swapped a version in took.
    pub refresh_seconds: f64,
}

impl std::fmt::Debug for MappedTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MappedTable({}, {} rows)",
            self.dir.display(),
            self.len()
        )
    }
}
impl MappedTable {
    /// Maps the checkpoint at `dir`: reads and checks its manifest, maps
    /// every file of its chain and reads their headers (no rows).
    ///
    /// # Errors
    /// `Checkpoint` for a missing or damaged manifest or file, or a file
    /// without a hash index (saved by an older embstore: the message says
    /// how to convert it).
    pub fn open(dir: &Path) -> Result<MappedTable> {
        let held = dirlock::reader(dir)?;
        Self::open_held(dir, held)
    }

    /// [`MappedTable::open`] for a caller that took the directory's readers'
    /// lock ([`crate::format::dirlock::reader_within`]) first, outside
    /// any lock of its own, or found none (`None`). The path is made
    /// absolute here, once: a refresh reads the directory opened, whatever
    /// the process's working directory is then.
    ///
    /// # Errors
    /// As [`MappedTable::open`].
    pub fn open_held(dir: &Path, held: Option<DirLock>) -> Result<MappedTable> {
        let t0 = std::time::Instant::now();
        let dir = std::path::absolute(dir).map_err(|e| io_err(dir, "cannot resolve", &e))?;
        let seen = manifest_bytes(&dir).ok();
        let (m, snap) = read_snapshot(&dir, None, held)?.expect("a first read maps a snapshot");
        Ok(MappedTable {
            dir,
            dim: m.dim,
            format: m.format()?,
            backend: Backend::from_env()?,
            current: RwLock::new(Arc::new(snap)),
            refreshing: Mutex::new(seen),
            version: AtomicU64::new(0),
            lookups: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            latency: Latency::default(),
            refresh_ns: AtomicU64::new(elapsed_ns(t0)),
            retired: Mutex::new(Vec::new()),
            warm_new: AtomicBool::new(false),
        })
    }

    /// The version served now.
    /// A call's end with version `snap`: if the call was its last reader
    /// (a refresh swapped it out meanwhile), it is handed to the retired
    /// list, not dropped here (see the `retired` field).
    fn release(&self, snap: Arc<Snapshot>) {
        if let Some(last) = Arc::into_inner(snap) {
            self.retired
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(last);
        }
    }

    /// Drops the retired versions (outside the lock).
    fn drop_retired(&self) {
        let old = std::mem::take(&mut *self.retired.lock().unwrap_or_else(PoisonError::into_inner));
        drop(old);
    }

    /// Versions retired and not yet dropped (for tests).
    #[cfg(test)]
    fn retired_count(&self) -> usize {
        self.retired
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// The version served now as a store of whole records (every file
    /// checked first): what [`crate::tier::ColdTier::find_records`] reads.
    ///
    /// # Errors
    /// `Checkpoint` for a damaged file.
    pub(crate) fn records(&self) -> Result<MappedRecords> {
        MappedRecords::new(self.snapshot())
    }

    fn snapshot(&self) -> Arc<Snapshot> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Serves what was published at the path since this table was opened
    /// or last refreshed: maps the links of the new manifest it does not
    /// hold yet (an incremental publish maps its delta's files only; a new
    /// full save, or a compacted chain, its new files), checks their
    /// checksums, then swaps the new version in at once: a call that
    /// started before reads the old version to its end, every call after
    /// the new one. Returns whether anything was published since.
    ///
    /// # Errors
    /// `Checkpoint` for a damaged manifest or file, or a checkpoint whose
    /// rows are no longer of this table's `dim` and storage; the table
    /// serves the version it served before then.
    pub fn refresh(&self) -> Result<bool> {
        if self.unchanged() {
            return Ok(false);
        }
        let held = dirlock::reader(&self.dir)?;
        self.refresh_held(held)
    }

    /// Whether the manifest reads, byte for byte, as it did before the
    /// version served now was mapped: then nothing was published since and
    /// a refresh has nothing to do. Takes no lock of the directory (a
    /// publish replaces the manifest whole), so a follower that polls it
    /// keeps out of the way of a publish's clean-up (which needs the
    /// readers' lock to itself); `false` where it cannot tell.
    pub fn unchanged(&self) -> bool {
        self.drop_retired();
        let Ok(now) = manifest_bytes(&self.dir) else {
            return false;
        };
        self.refreshing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_deref()
            == Some(now.as_slice())
    }

    /// [`MappedTable::refresh`] for a caller that took the directory's
    /// readers' lock first, outside any lock of its own (as
    /// [`MappedTable::open_held`]).
    ///
    /// # Errors
    /// As [`MappedTable::refresh`].
    pub fn refresh_held(&self, held: Option<DirLock>) -> Result<bool> {
        let t0 = std::time::Instant::now();
        self.drop_retired();
        let mut seen = self
            .refreshing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let prev = self.snapshot();
        let before = manifest_bytes(&self.dir).ok();
        let Some((m, snap)) = read_snapshot(&self.dir, Some(&prev), held)? else {
            *seen = before;
            return Ok(false);
        };
        if m.dim != self.dim || m.format()? != self.format {
            return Err(ckpt_err(
                &self.dir,
                format!(
                    "now holds rows of dim {} stored as {}, not this table's dim {} stored as \
                     {}: open it again",
                    m.dim,
                    m.format()?.name(),
                    self.dim,
                    self.format.name()
                ),
            ));
        }
        // New files are checked before anything of them is served (the
        // links kept were checked when first read); warmed first where
        // asked, so that the check reads them from 2 MiB folios once.
        let new: Vec<&Arc<Link>> = (snap.links.iter())
            .filter(|link| !prev.links.iter().any(|l| Arc::ptr_eq(l, link)))
            .collect();
        if self.warm_new.load(Ordering::Acquire) {
            warm::warm(new.iter().flat_map(|l| l.files.iter().flatten()));
        }
        for link in new {
            link.check()?;
        }
        let old = std::mem::replace(
            &mut *self.current.write().unwrap_or_else(PoisonError::into_inner),
            Arc::new(snap),
        );
        *seen = before;
        self.refresh_ns.store(elapsed_ns(t0), Ordering::Relaxed);
        self.version.fetch_add(1, Ordering::AcqRel);
        // Unmapped (once no call holds it) outside the lock.
        drop(old);
        Ok(true)
    }

    /// Reads every file of the version served into memory now, in 2 MiB
    /// pages where the kernel can give them (a file it finds cached in
    /// small pages, as a copy by `cp` leaves it, is dropped from the page
    /// cache where no other process maps it and read again: see
    /// [`warm`](self::warm)). Files warmed before are skipped. For a table
    /// that fits in memory: it reads the whole table.
    pub fn warm(&self) -> WarmReport {
        let snap = self.snapshot();
        let report = warm::warm(snap.links.iter().flat_map(|l| l.files.iter().flatten()));
        self.release(snap);
        report
    }

    /// Whether each refresh from now on warms the files it maps
    /// ([`MappedTable::warm`]) before it checks and serves them.
    pub fn set_warm(&self, on: bool) {
        self.warm_new.store(on, Ordering::Release);
    }

    /// A small [`MappedTable::lookup`] (at most 1,024 keys) that runs only
    /// when no file it might read still needs its checksum check: for a
    /// caller that runs it without releasing the GIL (a few microseconds).
    /// `None`: make the ordinary call.
    pub fn try_lookup_now(
        &self,
        keys: &[i64],
        missing: Missing<'_>,
        out: &mut [f32],
        found: Option<&mut [bool]>,
    ) -> Option<Result<()>> {
        let snap = self.snapshot();
        let r = (keys.len() <= NOW_KEYS && snap.checked())
            .then(|| self.lookup_in(&snap, keys, missing, out, found, PREFETCH_FROM));
        self.release(snap);
        r
    }

    /// Versions swapped in by refreshes since open (0 at open; see
    /// [`MappedTable::refresh`]): a call that reads a version `v` and then
    /// rows reads rows of version `v` or later.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Latencies of this table's lookup calls (recorded by the caller that
    /// times them: the binding).
    pub fn lookup_latency(&self) -> &Latency {
        &self.latency
    }

    /// The table's figures now (see [`MappedStats`]).
    pub fn stats(&self) -> MappedStats {
        let snap = self.snapshot();
        let files = snap.links.iter().flat_map(|l| l.files.iter().flatten());
        let stats = MappedStats {
            rows: snap.rows,
            lookups: self.lookups.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            mapped_bytes: files.map(|f| f.map.len() as u64).sum(),
            overlay_bytes: (snap.overlay.allocation_size()) as u64,
            published: snap.published,
            refresh_seconds: self.refresh_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        };
        self.release(snap);
        stats
    }

    /// Columns per row.
    pub fn dim(&self) -> usize {
        self.dim
    }
    /// Rows held (in the version served now).
    pub fn len(&self) -> u64 {
        let snap = self.snapshot();
        let rows = snap.rows;
        self.release(snap);
        rows
    }
    /// Whether it holds no row.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Row storage of the files.
    pub fn format(&self) -> RowFormat {
        self.format
    }
    /// Optimizer steps the saving table had taken.
    pub fn step(&self) -> u64 {
        let snap = self.snapshot();
        let step = snap.step;
        self.release(snap);
        step
    }
    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Nanoseconds since `t0`.
fn elapsed_ns(t0: std::time::Instant) -> u64 {
    u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// One version of a [`MappedTable`], read by [`MappedReader::lookup`].
pub struct MappedReader<'a> {
    table: &'a MappedTable,
    /// Released to the table when the reader is dropped.
    snap: ManuallyDrop<Arc<Snapshot>>,
}

impl Drop for MappedReader<'_> {
    fn drop(&mut self) {
        // SAFETY: `snap` is taken once, here, and never used after.
        let snap = unsafe { ManuallyDrop::take(&mut self.snap) };
        self.table.release(snap);
    }
}

impl MappedReader<'_> {
    /// [`MappedTable::lookup`] of this reader's version.
    ///
    /// # Errors
    /// As [`MappedTable::lookup`].
    pub fn lookup(
        &self,
        keys: &[i64],
        missing: Missing<'_>,
        out: &mut [f32],
        found: Option<&mut [bool]>,
    ) -> Result<()> {
        self.table
            .lookup_in(&self.snap, keys, missing, out, found, PREFETCH_FROM)
    }

    /// [`MappedReader::lookup`] of keys whose rows are unlikely to be in
    /// the CPU's caches (a serving cache's misses): index slots and rows
    /// prefetched ahead whatever the call's size. A `SlotMap` partition's
    /// misses are 10-30 keys a call: the native part of 2,000-key serving
    /// calls (a 4M-row table, one thread) took 124.7-131.5 us on machine X
    /// with the prefetches against 131.4-137.2 without (5 rounds in turn).
    ///
    /// # Errors
    /// As [`MappedTable::lookup`].
    pub fn lookup_cold(
        &self,
        keys: &[i64],
        missing: Missing<'_>,
        out: &mut [f32],
        found: Option<&mut [bool]>,
    ) -> Result<()> {
        self.table
            .lookup_in(&self.snap, keys, missing, out, found, 0)
    }

    /// Columns per row.
    pub fn dim(&self) -> usize {
        self.table.dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::dirlock::READERS_LOCK;
    use crate::testing::{sgd, table, temp_dir};
    use std::time::{Duration, Instant};

    #[test]
    fn a_refresh_with_nothing_new_takes_no_lock_and_a_publish_is_seen() {
        let dir = temp_dir("mapped-unchanged");
        let t = table(2, 2, sgd(0.1));
        t.assign(&[1, 2], &[1.0, 1.0, 2.0, 2.0]).unwrap();
        t.save(&dir, false, false, None).unwrap();
        let m = MappedTable::open(&dir).unwrap();
        assert!(m.unchanged(), "nothing published since the open");
        assert_eq!(m.version(), 0);
        // Another process holds the readers' lock exclusively (forever, as
        // far as this reader knows): a refresh with nothing new returns at
        // once instead of waiting for it.
        let other = std::fs::File::open(dir.join(READERS_LOCK)).unwrap();
        other.lock().unwrap();
        let start = Instant::now();
        assert!(!m.refresh().unwrap(), "nothing to refresh");
        assert!(start.elapsed() < Duration::from_secs(1));
        assert_eq!(
            m.version(),
            0,
            "a refresh with nothing new swaps nothing in"
        );
        other.unlock().unwrap();
        t.assign(&[2], &[5.0, 5.0]).unwrap();
        t.save(&dir, true, false, None).unwrap();
        assert!(!m.unchanged(), "a publish changes the manifest");
        assert!(m.refresh().unwrap());
        assert_eq!(
            m.version(),
            1,
            "the version is raised before refresh returns"
        );
        assert!(m.unchanged(), "the refresh read the manifest it serves");
        let mut out = [0.0; 2];
        m.lookup(&[2], Missing::Zeros, &mut out, None).unwrap();
        assert_eq!(out, [5.0, 5.0]);
        assert!(!m.refresh().unwrap());
        assert_eq!(m.version(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_version_whose_last_reader_is_a_call_is_dropped_by_the_next_poll() {
        let dir = temp_dir("mapped-retired");
        let t = table(2, 2, sgd(0.1));
        t.assign(&[1], &[1.0, 1.0]).unwrap();
        t.save(&dir, false, false, None).unwrap();
        let m = MappedTable::open(&dir).unwrap();
        let reader = m.reader(); // a call in flight on version 0
        t.assign(&[1], &[3.0, 3.0]).unwrap();
        t.save(&dir, true, false, None).unwrap();
        assert!(m.refresh().unwrap());
        assert_eq!(m.retired_count(), 0, "a call still reads version 0");
        let mut out = [0.0; 2];
        reader.lookup(&[1], Missing::Zeros, &mut out, None).unwrap();
        assert_eq!(out, [1.0, 1.0], "the call reads its version to the end");
        drop(reader);
        assert_eq!(m.retired_count(), 1, "handed over, not dropped by the call");
        assert!(m.unchanged());
        assert_eq!(m.retired_count(), 0, "dropped by the poll");
        m.lookup(&[1], Missing::Zeros, &mut out, None).unwrap();
        assert_eq!(out, [3.0, 3.0]);
        assert_eq!(m.retired_count(), 0, "the current version is never retired");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file's first check ran its scans on the pool: its thread, waiting
    /// for a block another thread took, ran queued jobs meanwhile, and a
    /// job that read the same file waited on the check its own thread was
    /// running (a `OnceLock` initialized on itself: the first 2,000-key
    /// `SlotMap` serve of a fresh 4M-row table hung on a 16-core machine).
    /// Here two pool threads: the first read of a large file; a job that
    /// frees the other thread after a time that each round makes longer,
    /// so that in some round it is free to take part of the check's scan;
    /// then reads of the file queued, under a watchdog.
    #[test]
    fn a_first_read_never_waits_on_its_own_threads_check() {
        let dir = temp_dir("mapped-first-check");
        let (dim, n) = (16, 400_000i64);
        let t = table(dim, 1, sgd(0.1));
        let keys: Vec<i64> = (0..n).collect();
        let rows: Vec<f32> = (0..n as usize * dim).map(|i| (i % 7) as f32).collect();
        t.assign(&keys, &rows).unwrap();
        t.save(&dir, false, false, None).unwrap();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        // How long a first read takes (its check), the other thread idle.
        let first_read = || {
            let m = MappedTable::open(&dir).unwrap();
            let t0 = Instant::now();
            pool.install(|| m.lookup(&[0], Missing::Zeros, &mut [0.0; 16], None))
                .unwrap();
            t0.elapsed()
        };
        let check = first_read().min(first_read());
        for round in 0..40u32 {
            // From a quarter of the check to all of it: the scan lies between.
            let busy = check / 4 + check * 3 / 4 * round / 40;
            let m = Arc::new(MappedTable::open(&dir).unwrap());
            let (tx, rx) = std::sync::mpsc::channel();
            let jobs = 24usize;
            for j in 0..jobs {
                let (m, tx) = (Arc::clone(&m), tx.clone());
                pool.spawn(move || {
                    if j == 1 {
                        let t0 = Instant::now();
                        while t0.elapsed() < busy {}
                        tx.send(-1.0).unwrap();
                    } else {
                        let mut out = vec![0.0; dim];
                        m.lookup(&[j as i64], Missing::Zeros, &mut out, None)
                            .unwrap();
                        tx.send(out[0]).unwrap();
                    }
                });
            }
            for _ in 0..jobs {
                rx.recv_timeout(Duration::from_secs(60))
                    .unwrap_or_else(|_| panic!("round {round}: a lookup hung on a file's check"));
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
