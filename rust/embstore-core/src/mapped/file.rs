//! One mapped shard file: mapped, its tensors found, checked once before
//! its first read.

use crate::error::{Result, ckpt_err};
use crate::format::codec::RowFormat;
use crate::format::columns::Columns;
use crate::format::file_index::{self, INDEX_FORMAT};
use crate::format::files::{io_err, open_named};
use crate::format::manifest::{FileEntry, Manifest};
use crate::format::tensors::check_rows;
use crate::rows::Scan;
use memmap2::Mmap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};

/// One mapped shard file: where its keys, rows and index lie in the map.
pub(super) struct MappedFile {
    pub(super) path: PathBuf,
    pub(super) map: Mmap,
    /// Its entry in the manifest that first named it, and that manifest:
    /// what its check holds it to.
    pub(super) entry: FileEntry,
    pub(super) manifest: Arc<Manifest>,
    /// The file's check (its checksum, then everything a load checks:
    /// tensors, finite rows and state, its keys against its index and
    /// shard), run by the first call that reads from it, hit or miss (an
    /// error message when it failed).
    pub(super) checked: OnceLock<std::result::Result<(), String>>,
    pub(super) n: usize,
    pub(super) keys: usize,
    pub(super) rows: usize,
    pub(super) row_bytes: usize,
    /// The optimizer state column, where the file has one: its offset and
    /// bytes a row (what a record read of it carries, [`super::records`]).
    pub(super) state: Option<(usize, usize)>,
    /// The metadata column's offset (16 bytes a row), where it has one.
    pub(super) meta: Option<usize>,
    pub(super) index: usize,
    pub(super) slots: usize,
    /// The mapped file's device and inode: a warm that reopens it by name
    /// acts only on this file ([`super::warm`]).
    pub(super) file_id: (u64, u64),
    /// Whether it was warmed ([`super::warm`]): once is enough.
    pub(super) warmed: AtomicBool,
}

impl MappedFile {
    /// Passes once the file's bytes match its manifest checksum and hold
    /// what a load requires of them ([`check_rows`]: the same check, so a
    /// file a load refuses is refused here, before any answer from it).
    #[inline]
    pub(super) fn check(&self) -> Result<()> {
        // Every read checks its file: once passed, one load and a compare.
        if matches!(self.checked.get(), Some(Ok(()))) {
            return Ok(());
        }
        self.check_now()
    }

    /// [`MappedFile::check`] past its fast path: the check itself, run once.
    #[cold]
    pub(super) fn check_now(&self) -> Result<()> {
        let res = self.checked.get_or_init(|| {
            let got = crc32c::crc32c(&self.map);
            if got != self.entry.crc32c {
                return Err(format!(
                    "checksum mismatch (CRC-32C {got:#010x}, the manifest says {:#010x}): \
                     the file is damaged",
                    self.entry.crc32c
                ));
            }
            // On this thread alone: a pool thread that initializes the
            // lock and hands part of a scan to the pool would, while it
            // waits for that part, run other jobs, one of which may read
            // this file and wait on this lock, held by its own thread (the
            // first large call of a fresh table would hang).
            check_rows(
                &self.manifest,
                &self.path,
                &self.entry,
                &self.map,
                Scan::Here,
            )
            .map(|_| ())
            .map_err(|e| match e {
                crate::error::StoreError::Checkpoint { msg, .. } => msg,
                other => other.to_string(),
            })
        });
        res.clone().map_err(|m| ckpt_err(&self.path, m))
    }

    /// The key of row `r`.
    #[inline]
    pub(super) fn key(&self, r: usize) -> i64 {
        let o = self.keys + 8 * r;
        i64::from_le_bytes(self.map[o..o + 8].try_into().expect("8 bytes"))
    }

    /// Index slot `i`: a key and its row plus one (0: empty).
    #[inline]
    pub(super) fn slot(&self, i: usize) -> (i64, i64) {
        let o = self.index + 16 * i;
        let b = &self.map[o..o + 16];
        (
            i64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            i64::from_le_bytes(b[8..].try_into().expect("8 bytes")),
        )
    }

    /// Asks the CPU to load the index slot where the probe for a key of
    /// hash `hash` starts ([`MappedFile::find`]): a hint, reading nothing.
    #[inline(always)]
    pub(super) fn prefetch_slot(&self, hash: u64) {
        let i = hash as usize & (self.slots - 1);
        crate::simd::prefetch_addr(self.map.as_ptr() as usize + self.index + 16 * i);
    }

    /// Asks the CPU to load row `r`'s bytes.
    #[inline(always)]
    pub(super) fn prefetch_row(&self, r: usize) {
        crate::simd::prefetch(self.row(r));
    }

    /// The row of `key` in this file, if any.
    #[inline]
    pub(super) fn find(&self, key: i64) -> Result<Option<usize>> {
        file_index::find(key, self.n, self.slots, |i| self.slot(i))
            .map_err(|m| ckpt_err(&self.path, m))
    }

    /// [`MappedFile::find`] of a key of hash `hash` (`key_hash(key)`).
    #[inline]
    pub(super) fn find_hashed(&self, key: i64, hash: u64) -> Result<Option<usize>> {
        file_index::find_hashed(key, hash, self.n, self.slots, |i| self.slot(i))
            .map_err(|m| ckpt_err(&self.path, m))
    }

    /// The stored bytes of row `r`.
    #[inline]
    pub(super) fn row(&self, r: usize) -> &[u8] {
        let o = self.rows + self.row_bytes * r;
        &self.map[o..o + self.row_bytes]
    }
}

/// Maps one shard file and finds its tensors.
pub(super) fn map_file(
    dir: &Path,
    e: &FileEntry,
    m: &Arc<Manifest>,
    format: RowFormat,
) -> Result<(MappedFile, usize, usize)> {
    let path = dir.join(&e.name);
    let file = open_named(dir, &e.name, "cannot open")?;
    let meta = file
        .metadata()
        .map_err(|err| io_err(&path, "cannot stat", &err))?;
    let size = meta.len();
    let file_id = {
        use std::os::unix::fs::MetadataExt;
        (meta.dev(), meta.ino())
    };
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
    // Before the first read: a fault of a map that asks for huge pages reads
    // ahead in 2 MiB folios and maps them whole where the file system caches
    // large folios, so random reads of rows miss the TLB far less.
    crate::huge::advise_huge(map.as_ptr(), map.len(), false);
    let cols = Columns::read(m, &path, e, &map)?;
    let Some((index, (shard, shards))) = cols.index else {
        return Err(ckpt_err(
            &path,
            format!(
                "has no hash index ({INDEX_FORMAT}): it was saved by an older embstore. Load \
                 it with Table.load and save it again to serve it with mmap=True"
            ),
        ));
    };
    if cols.format != format {
        return Err(ckpt_err(
            &path,
            "rows of another format than the manifest's",
        ));
    }
    let n = cols.n;
    let at = |column: &[u8]| Columns::offset(&map, column) as usize;
    let (keys, rows, row_bytes) = (at(cols.keys), at(cols.rows), cols.row_bytes);
    let (index, slots) = (at(index), index.len() / 16);
    let state = cols.state.filter(|_| n > 0).map(|s| (at(s), s.len() / n));
    let meta = cols.meta.map(at);
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
        state,
        meta,
        index,
        slots,
        file_id,
        warmed: AtomicBool::new(false),
    };
    Ok((f, shards, shard))
}
