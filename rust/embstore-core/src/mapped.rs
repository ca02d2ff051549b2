//! A read-only table served from a checkpoint's files mapped into memory
//! ([`MappedTable`]): opening reads the manifest and each file's header,
//! never its rows, so any number of processes share one copy of the rows in
//! the page cache, and a checkpoint larger than memory is served page by
//! page. Each shard file carries its own hash index
//! ([`crate::table::checkpoint::file_index`]), so no process builds one.
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

use crate::error::{Result, ckpt_err};
use crate::hash::{key_hash, shard_of};
use crate::init::Initializer;
use crate::policy::RowFormat;
use crate::simd::Backend;
use crate::table::Missing;
use crate::table::checkpoint::dirlock::{self, DirLock};
use crate::table::checkpoint::file_index::{self, INDEX_FORMAT};
use crate::table::checkpoint::files::{io_err, open_named, with_file};
use crate::table::checkpoint::manifest::{FileEntry, Manifest, read_manifest};
use crate::table::checkpoint::tensors::{check_rows, parse_removed, rows_dtype};
use crate::table::checks::check_len;
use crate::zeroed::{with_room, zeros};
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;
use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::SafeTensors;
use safetensors::tensor::Dtype;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};

/// Keys a call handles on the calling thread; larger calls spread over
/// rayon's pool.
const SEQUENTIAL_KEYS: usize = 4096;

/// The most keys [`MappedTable::try_lookup_now`] runs at once.
const NOW_KEYS: usize = 1024;

/// One mapped shard file: where its keys, rows and index lie in the map.
struct MappedFile {
    path: PathBuf,
    map: Mmap,
    /// Its entry in the manifest that first named it, and that manifest:
    /// what its check holds it to.
    entry: FileEntry,
    manifest: Arc<Manifest>,
    /// The file's check (its checksum, then everything a load checks:
    /// tensors, finite rows and state, its keys against its index and
    /// shard), run by the first call that reads from it, hit or miss (an
    /// error message when it failed).
    checked: OnceLock<std::result::Result<(), String>>,
    n: usize,
    keys: usize,
    rows: usize,
    row_bytes: usize,
    index: usize,
    slots: usize,
}

impl MappedFile {
    /// Passes once the file's bytes match its manifest checksum and hold
    /// what a load requires of them ([`check_rows`]: the same check, so a
    /// file a load refuses is refused here, before any answer from it).
    #[inline]
    fn check(&self) -> Result<()> {
        // Every read checks its file: once passed, one load and a compare.
        if matches!(self.checked.get(), Some(Ok(()))) {
            return Ok(());
        }
        self.check_now()
    }

    /// [`MappedFile::check`] past its fast path: the check itself, run once.
    #[cold]
    fn check_now(&self) -> Result<()> {
        let res = self.checked.get_or_init(|| {
            let got = crc32c::crc32c(&self.map);
            if got != self.entry.crc32c {
                return Err(format!(
                    "checksum mismatch (CRC-32C {got:#010x}, the manifest says {:#010x}): \
                     the file is damaged",
                    self.entry.crc32c
                ));
            }
            check_rows(&self.manifest, &self.path, &self.entry, &self.map).map_err(|e| match e {
                crate::error::StoreError::Checkpoint { msg, .. } => msg,
                other => other.to_string(),
            })
        });
        res.clone().map_err(|m| ckpt_err(&self.path, m))
    }

    /// The key of row `r`.
    #[inline]
    fn key(&self, r: usize) -> i64 {
        let o = self.keys + 8 * r;
        i64::from_le_bytes(self.map[o..o + 8].try_into().expect("8 bytes"))
    }

    /// Index slot `i`: a key and its row plus one (0: empty).
    #[inline]
    fn slot(&self, i: usize) -> (i64, i64) {
        let o = self.index + 16 * i;
        let b = &self.map[o..o + 16];
        (
            i64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            i64::from_le_bytes(b[8..].try_into().expect("8 bytes")),
        )
    }

    /// The row of `key` in this file, if any.
    #[inline]
    fn find(&self, key: i64) -> Result<Option<usize>> {
        file_index::find(key, self.n, self.slots, |i| self.slot(i))
            .map_err(|m| ckpt_err(&self.path, m))
    }

    /// The stored bytes of row `r`.
    #[inline]
    fn row(&self, r: usize) -> &[u8] {
        let o = self.rows + self.row_bytes * r;
        &self.map[o..o + self.row_bytes]
    }
}

/// One link of the chain: its files by the saving table's shard, and the
/// keys it removed.
struct Link {
    /// The names of its files (and its removals' file): a link is the same
    /// in two manifests when these are (a save names its files by its own
    /// id), so a refresh keeps the links it already mapped.
    names: Vec<String>,
    shards: usize,
    files: Vec<Vec<MappedFile>>,
    removed: HashSet<i64>,
}

impl Link {
    /// The names of a manifest link's files, as [`Link::names`].
    fn names_of(link: &crate::table::checkpoint::Link) -> Vec<String> {
        link.files
            .iter()
            .chain(link.removed.iter())
            .map(|e| e.name.clone())
            .collect()
    }

    /// Checks every file ([`MappedFile::check`]).
    fn check(&self) -> Result<()> {
        self.files.iter().flatten().try_for_each(MappedFile::check)
    }

    /// The file and row of `key` (of hash `hash`) among this link's files,
    /// not checked first: for counting only (answers come from
    /// [`Snapshot::locate`], which checks each file before it reads it).
    fn find(&self, key: i64, hash: u64) -> Result<Option<(&MappedFile, usize)>> {
        if self.shards == 0 {
            return Ok(None);
        }
        for f in &self.files[shard_of(hash, self.shards)] {
            if let Some(r) = f.find(key)? {
                return Ok(Some((f, r)));
            }
        }
        Ok(None)
    }
}

/// One version of the checkpoint: what its manifest named, mapped. A call
/// reads one snapshot from start to end, so it sees one published version
/// whole, never a mix of two.
struct Snapshot {
    /// The manifest's id.
    id: String,
    initializer: Initializer,
    seed: u64,
    /// Newest link first.
    links: Vec<Arc<Link>>,
    /// Every key the chain's deltas (all links but the oldest, the full
    /// one) name, with where its row is now or that it is removed: a
    /// lookup probes this, then the full link only, however long the
    /// chain. Private memory of about 32 bytes a delta key.
    overlay: HashTable<Placed>,
    rows: u64,
    step: u64,
    /// Set once every file has passed its checksum check.
    all_checked: AtomicBool,
}

/// Where a key of the chain's deltas is: `links[link].files[shard][file]`,
/// row `row`, or removed (`link == REMOVED`).
#[derive(Debug, Clone, Copy)]
struct Placed {
    key: i64,
    link: u32,
    shard: u32,
    file: u32,
    row: u32,
}

/// [`Placed::link`] of a key the chain removed.
const REMOVED: u32 = u32::MAX;

/// The overlay of `links` (newest first): their deltas replayed oldest
/// first, each link's removals before its files, as a load replays them.
fn overlay_of(links: &[Arc<Link>]) -> Result<HashTable<Placed>> {
    let deltas = links.len().saturating_sub(1);
    let held: usize = links[..deltas]
        .iter()
        .map(|l| l.removed.len() + l.files.iter().flatten().map(|f| f.n).sum::<usize>())
        .sum();
    let mut table: HashTable<Placed> = HashTable::new();
    table
        .try_reserve(held, |p| key_hash(p.key))
        .map_err(|_| crate::error::oom("rows", held.saturating_mul(32)))?;
    let mut put = |p: Placed| {
        let hash = key_hash(p.key);
        match table.entry(hash, |q| q.key == p.key, |q| key_hash(q.key)) {
            Entry::Occupied(mut e) => *e.get_mut() = p,
            Entry::Vacant(e) => {
                e.insert(p);
            }
        }
    };
    for li in (0..deltas).rev() {
        let link = &links[li];
        for &key in &link.removed {
            put(Placed {
                key,
                link: REMOVED,
                shard: 0,
                file: 0,
                row: 0,
            });
        }
        for (s, files) in link.files.iter().enumerate() {
            for (fi, f) in files.iter().enumerate() {
                for r in 0..f.n {
                    put(Placed {
                        key: f.key(r),
                        link: li as u32,
                        shard: s as u32,
                        file: fi as u32,
                        row: r as u32,
                    });
                }
            }
        }
    }
    Ok(table)
}

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
    /// map one version twice; no call that reads takes it.
    refreshing: Mutex<()>,
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

/// Maps one shard file and finds its tensors.
fn map_file(
    dir: &Path,
    e: &FileEntry,
    m: &Arc<Manifest>,
    format: RowFormat,
) -> Result<(MappedFile, usize, usize)> {
    let path = dir.join(&e.name);
    let file = open_named(dir, &e.name, "cannot open")?;
    let size = file
        .metadata()
        .map_err(|err| io_err(&path, "cannot stat", &err))?
        .len();
    if size != e.bytes {
        return Err(ckpt_err(
            &path,
            format!(
                "{size} bytes, the manifest says {}: the file is damaged",
                e.bytes
            ),
        ));
    }
    // SAFETY: the map is read-only and private to this process's view of an
    // immutable checkpoint file: embstore never writes a published file in
    // place (saves create new files and unlink old ones). Another program
    // truncating it while mapped would make reads fault (the module docs
    // say so); no Rust reference into the map outlives `MappedFile`.
    let map = unsafe { Mmap::map(&file) }.map_err(|err| io_err(&path, "cannot map", &err))?;
    let bad = |what: String| ckpt_err(&path, what);
    let st = SafeTensors::deserialize(&map)
        .map_err(|err| bad(format!("not a safetensors file: {err}")))?;
    let (_, header) = SafeTensors::read_metadata(&map)
        .map_err(|err| bad(format!("not a safetensors file: {err}")))?;
    let info = header.metadata().clone().unwrap_or_default();
    let Some((shard, shards)) = file_index::placement(&info).map_err(bad)? else {
        return Err(bad(format!(
            "has no hash index ({INDEX_FORMAT}): it was saved by an older embstore. Load it \
             with Table.load and save it again to serve it with mmap=True"
        )));
    };
    let n = e.rows as usize;
    let base = map.as_ptr() as usize;
    let at = |name: &str, dtype: Dtype, shape: &[usize]| -> Result<usize> {
        let t = st
            .tensor(name)
            .map_err(|err| bad(format!("tensor {name:?}: {err}")))?;
        if t.dtype() != dtype || t.shape() != shape {
            return Err(bad(format!(
                "tensor {name:?}: expected {dtype:?} of shape {shape:?}, found {:?} of shape {:?}",
                t.dtype(),
                t.shape()
            )));
        }
        Ok(t.data().as_ptr() as usize - base)
    };
    let slots = file_index::slots_for(n);
    let keys = at("keys", Dtype::I64, &[n])?;
    let rows = at("rows", rows_dtype(format), &[n, m.dim])?;
    let index = at("index", Dtype::I64, &[slots, 2])?;
    let row_bytes = match format {
        RowFormat::F32 => 4 * m.dim,
        RowFormat::F16 | RowFormat::BF16 => 2 * m.dim,
    };
    let f = MappedFile {
        path,
        map,
        entry: e.clone(),
        manifest: m.clone(),
        checked: OnceLock::new(),
        n,
        keys,
        rows,
        row_bytes,
        index,
        slots,
    };
    Ok((f, shards, shard))
}

/// Maps the links of manifest `m` at `dir` (newest first), taking those
/// `prev` holds from it.
fn map_links(dir: &Path, m: &Arc<Manifest>, prev: Option<&Snapshot>) -> Result<Vec<Arc<Link>>> {
    let format = m.format()?;
    let mut links = Vec::with_capacity(m.chain.len());
    for link in m.chain.iter().rev() {
        let names = Link::names_of(link);
        if let Some(same) = prev.and_then(|p| p.links.iter().find(|l| l.names == names)) {
            links.push(same.clone());
            continue;
        }
        let removed = match &link.removed {
            Some(e) => with_file(dir, e, None, |buf| {
                parse_removed(&dir.join(&e.name), e, buf).map(|k| k.iter().copied().collect())
            })?,
            None => HashSet::new(),
        };
        let mut shards = 0;
        let mut files: Vec<Vec<MappedFile>> = Vec::new();
        for e in &link.files {
            let (f, n, s) = map_file(dir, e, m, format)?;
            if shards == 0 {
                shards = n;
                files.resize_with(n, Vec::new);
            } else if n != shards {
                return Err(ckpt_err(
                    &f.path,
                    format!("saved by a table of {n} shards, its link's other files by {shards}"),
                ));
            }
            files[s].push(f);
        }
        links.push(Arc::new(Link {
            names,
            shards,
            files,
            removed,
        }));
    }
    Ok(links)
}

/// Reads the manifest at `dir` and maps what it names (`None`: it is still
/// `prev`'s). `held`: the directory's readers' lock, which the caller took
/// before (outside any lock of its own: another process can hold it), so
/// that no save deletes the files of the manifest read before they are
/// mapped (once mapped, a file deleted stays readable); `None` where the
/// directory had no lock file: then a manifest replaced while its files
/// were mapped is read again (the lock only tried, never waited for).
///
/// Before it answers anything, the snapshot checks its deltas' files (what
/// a load checks: `MappedFile::check`), whose keys make the overlay, and
/// that the chain replays to the manifest's row count (the base's files are
/// checked on their first read).
fn read_snapshot(
    dir: &Path,
    prev: Option<&Snapshot>,
    mut held: Option<DirLock>,
) -> Result<Option<(Arc<Manifest>, Snapshot)>> {
    let mut tries = 0;
    loop {
        let m = Arc::new(read_manifest(dir)?);
        if prev.is_some_and(|p| p.id == m.id) {
            return Ok(None);
        }
        match map_links(dir, &m, prev) {
            Ok(links) => {
                drop(held);
                let deltas = links.len().saturating_sub(1);
                links[..deltas].iter().try_for_each(|l| l.check())?;
                let overlay = overlay_of(&links)?;
                let replayed = replayed_rows(&links, &overlay)?;
                if replayed != m.rows {
                    // A damaged base reads as damage, not as a count.
                    if let Some(base) = links.last() {
                        base.check()?;
                    }
                    return Err(ckpt_err(
                        dir,
                        format!(
                            "the chain replays to {replayed} rows, the manifest says {}",
                            m.rows
                        ),
                    ));
                }
                let snap = Snapshot {
                    id: m.id.clone(),
                    initializer: Initializer::from_named(
                        &m.initializer.name,
                        &m.initializer.params,
                    )?,
                    seed: m.seed,
                    overlay,
                    links,
                    rows: m.rows,
                    step: m.step,
                    all_checked: AtomicBool::new(false),
                };
                return Ok(Some((m, snap)));
            }
            Err(e) => {
                tries += 1;
                let replaced = read_manifest(dir).is_ok_and(|now| now.id != m.id);
                if held.is_some() || !replaced || tries >= 8 {
                    return Err(e);
                }
                // A save may have made the lock file meanwhile: taken if
                // free, never waited for.
                held = dirlock::try_reader(dir)?;
            }
        }
    }
}

/// The rows the chain `links` (newest first) replays to, whose deltas'
/// overlay is `overlay`: the base's rows, plus each delta key the chain
/// ends holding that the base lacks, less each base key it ends without.
fn replayed_rows(links: &[Arc<Link>], overlay: &HashTable<Placed>) -> Result<u64> {
    let Some(base) = links.last() else {
        return Ok(0);
    };
    let mut rows: u64 = base.files.iter().flatten().map(|f| f.n as u64).sum();
    for p in overlay {
        let in_base = base.find(p.key, key_hash(p.key))?.is_some();
        let held = p.link != REMOVED;
        match (in_base, held) {
            (false, true) => rows += 1,
            (true, false) => rows = rows.saturating_sub(1),
            _ => {}
        }
    }
    Ok(rows)
}

impl Snapshot {
    /// Whether every file has passed its checksum check (then no call
    /// can spend time checking one).
    fn checked(&self) -> bool {
        if self.all_checked.load(Ordering::Acquire) {
            return true;
        }
        let all = self.links.iter().all(|l| {
            l.files
                .iter()
                .flatten()
                .all(|f| matches!(f.checked.get(), Some(Ok(()))))
        });
        if all {
            self.all_checked.store(true, Ordering::Release);
        }
        all
    }

    /// The file and row holding `key`: where the deltas' overlay places
    /// it (or nowhere, removed), else in the full link. The chain so reads
    /// as a load replays it, newest link first, each link's removals
    /// before its files.
    fn locate(&self, key: i64, hash: u64) -> Result<Option<(&MappedFile, usize)>> {
        if !self.overlay.is_empty()
            && let Some(p) = self.overlay.find(hash, |p| p.key == key)
        {
            if p.link == REMOVED {
                return Ok(None);
            }
            let f = &self.links[p.link as usize].files[p.shard as usize][p.file as usize];
            f.check()?;
            return Ok(Some((f, p.row as usize)));
        }
        let Some(base) = self.links.last() else {
            return Ok(None);
        };
        if base.shards > 0 {
            // Each file is checked before anything of it is read, so a
            // damaged file is refused, never answered "missing".
            for f in &base.files[shard_of(hash, base.shards)] {
                f.check()?;
                if let Some(r) = f.find(key)? {
                    return Ok(Some((f, r)));
                }
            }
        }
        Ok(None)
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
    /// lock ([`crate::table::checkpoint::lock_for_reading`]) first, outside
    /// any lock of its own, or found none (`None`). The path is made
    /// absolute here, once: a refresh reads the directory opened, whatever
    /// the process's working directory is then.
    ///
    /// # Errors
    /// As [`MappedTable::open`].
    pub fn open_held(dir: &Path, held: Option<DirLock>) -> Result<MappedTable> {
        let dir = std::path::absolute(dir).map_err(|e| io_err(dir, "cannot resolve", &e))?;
        let (m, snap) = read_snapshot(&dir, None, held)?.expect("a first read maps a snapshot");
        Ok(MappedTable {
            dir,
            dim: m.dim,
            format: m.format()?,
            backend: Backend::from_env()?,
            current: RwLock::new(Arc::new(snap)),
            refreshing: Mutex::new(()),
        })
    }

    /// The version served now.
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
        let held = dirlock::reader(&self.dir)?;
        self.refresh_held(held)
    }

    /// [`MappedTable::refresh`] for a caller that took the directory's
    /// readers' lock first, outside any lock of its own (as
    /// [`MappedTable::open_held`]).
    ///
    /// # Errors
    /// As [`MappedTable::refresh`].
    pub fn refresh_held(&self, held: Option<DirLock>) -> Result<bool> {
        let _one = self
            .refreshing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let prev = self.snapshot();
        let Some((m, snap)) = read_snapshot(&self.dir, Some(&prev), held)? else {
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
        // links kept were checked when first read).
        for link in &snap.links {
            if !prev.links.iter().any(|l| Arc::ptr_eq(l, link)) {
                link.check()?;
            }
        }
        let old = std::mem::replace(
            &mut *self.current.write().unwrap_or_else(PoisonError::into_inner),
            Arc::new(snap),
        );
        // Unmapped (once no call holds it) outside the lock.
        drop(old);
        Ok(true)
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
        (keys.len() <= NOW_KEYS && snap.checked())
            .then(|| self.lookup_in(&snap, keys, missing, out, found))
    }

    /// Columns per row.
    pub fn dim(&self) -> usize {
        self.dim
    }
    /// Rows held (in the version served now).
    pub fn len(&self) -> u64 {
        self.snapshot().rows
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
        self.snapshot().step
    }
    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes row `r` of `f` as float32 to `dst`.
    fn decode(&self, f: &MappedFile, r: usize, dst: &mut [f32]) {
        let b = f.row(r);
        match self.format {
            RowFormat::F32 => {
                for (d, c) in dst.iter_mut().zip(b.chunks_exact(4)) {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            RowFormat::F16 => {
                for (d, c) in dst.iter_mut().zip(b.chunks_exact(2)) {
                    *d = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            RowFormat::BF16 => {
                for (d, c) in dst.iter_mut().zip(b.chunks_exact(2)) {
                    *d = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
        }
    }

    /// The row of each key into `out` (`keys.len() * dim` floats), a key
    /// without a row read as `missing`; with `found`, whether each had one.
    ///
    /// # Errors
    /// `ShapeMismatch` for `out`, `found` or a default row of the wrong
    /// length; `InvalidArgument` for a non-finite default row;
    /// `Checkpoint` when a file the call reads is damaged.
    pub fn lookup(
        &self,
        keys: &[i64],
        missing: Missing<'_>,
        out: &mut [f32],
        found: Option<&mut [bool]>,
    ) -> Result<()> {
        self.lookup_in(&self.snapshot(), keys, missing, out, found)
    }

    /// [`MappedTable::lookup`] of version `snap`.
    fn lookup_in(
        &self,
        snap: &Snapshot,
        keys: &[i64],
        missing: Missing<'_>,
        out: &mut [f32],
        found: Option<&mut [bool]>,
    ) -> Result<()> {
        let dim = self.dim;
        check_len("out", keys.len() * dim, out.len())?;
        missing.check(dim)?;
        let mut none = Vec::new();
        let found = match found {
            Some(f) => {
                check_len("found", keys.len(), f.len())?;
                f
            }
            None => &mut none[..],
        };
        let one = |key: i64, dst: &mut [f32], flag: Option<&mut bool>| -> Result<()> {
            let hit = match snap.locate(key, key_hash(key))? {
                Some((f, r)) => {
                    self.decode(f, r, dst);
                    true
                }
                None => {
                    missing.fill(
                        &snap.initializer,
                        self.backend,
                        snap.seed,
                        self.format,
                        key,
                        dst,
                    );
                    false
                }
            };
            if let Some(flag) = flag {
                *flag = hit;
            }
            Ok(())
        };
        let with_flags = !found.is_empty();
        if keys.len() <= SEQUENTIAL_KEYS {
            // No prefetching: in calls on the calling thread it cost more
            // than it saved (benches/mapped.py: 1,024 keys 35 us with a
            // slot and row prefetch pipeline, 30-31 us without).
            for (i, (&k, dst)) in keys.iter().zip(out.chunks_exact_mut(dim)).enumerate() {
                one(k, dst, with_flags.then(|| &mut found[i]))?;
            }
            return Ok(());
        }
        let rows = keys.par_iter().zip(out.par_chunks_mut(dim));
        if with_flags {
            rows.zip(found.par_iter_mut())
                .with_min_len(SEQUENTIAL_KEYS / 4)
                .try_for_each(|((&k, dst), f)| one(k, dst, Some(f)))
        } else {
            rows.with_min_len(SEQUENTIAL_KEYS / 4)
                .try_for_each(|(&k, dst)| one(k, dst, None))
        }
    }

    /// Whether each key has a row, into `out`.
    ///
    /// # Errors
    /// `ShapeMismatch` for `out` of the wrong length; `Checkpoint` when a
    /// file the call reads is damaged.
    pub fn contains(&self, keys: &[i64], out: &mut [bool]) -> Result<()> {
        check_len("out", keys.len(), out.len())?;
        let snap = self.snapshot();
        keys.par_iter()
            .zip(out.par_iter_mut())
            .with_min_len(SEQUENTIAL_KEYS)
            .try_for_each(|(&k, o)| {
                *o = snap.locate(k, key_hash(k))?.is_some();
                Ok(())
            })
    }

    /// Every row, keys ascending: `(keys, rows)` (`n * dim` floats).
    /// Reads (and checks) every file.
    ///
    /// # Errors
    /// `OutOfMemory` naming `rows`; `Checkpoint` for a damaged file.
    pub fn export(&self) -> Result<(Vec<i64>, Vec<f32>)> {
        // Room for every row the files hold (the manifest's count is
        // checked, not trusted, here), taken fallibly.
        let snap = self.snapshot();
        let held: usize = snap
            .links
            .iter()
            .flat_map(|l| l.files.iter().flatten())
            .map(|f| f.n)
            .sum();
        let mut decided: HashSet<i64> = HashSet::new();
        decided
            .try_reserve(held)
            .map_err(|_| crate::error::oom("rows", held.saturating_mul(16)))?;
        let mut refs: Vec<(i64, &MappedFile, usize)> = with_room("rows", held)?;
        // Newest link first: a key is taken from the newest link whose files
        // hold it; a link's removals hide the links before it.
        for link in &snap.links {
            for f in link.files.iter().flatten() {
                f.check()?;
                for r in 0..f.n {
                    let k = f.key(r);
                    if decided.insert(k) {
                        refs.push((k, f, r));
                    }
                }
            }
            decided.extend(link.removed.iter().copied());
        }
        drop(decided);
        refs.par_sort_unstable_by_key(|&(k, _, _)| k);
        let dim = self.dim;
        let mut rows = zeros::<f32>("rows", refs.len() * dim)?;
        rows.par_chunks_mut(dim)
            .zip(refs.par_iter())
            .with_min_len(1024)
            .for_each(|(dst, &(_, f, r))| self.decode(f, r, dst));
        Ok((refs.iter().map(|&(k, _, _)| k).collect(), rows))
    }
}
