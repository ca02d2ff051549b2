//! A shard's rows on disk: the cold part of a disk table's shard.
//!
//! Rows that leave memory (`ColdStore::put`, in cold/store.rs) are
//! appended to the shard's active segment file, so the disk sees
//! sequential writes only; a key's
//! place is kept in an in-memory index (key -> segment, record, save
//! generation: 12 bytes a key plus the map's own). A row taken back into
//! memory (`ColdStore::take`) leaves a dead record behind; a segment whose
//! records are all dead is deleted, and one mostly dead is compacted (its
//! live records appended again, then the file deleted).
//!
//! A record is `key (i64) | save generation (u32) | CRC-32C (u32) | the
//! row's words`, where the words are the row's stored weights, its
//! optimizer state and its 4 metadata words. Every read checks the key and
//! the CRC: the files are written and read by this process only (a disk
//! table's files do not outlive it), yet a damaged or altered file reads as
//! an error, never as another key's row.
//!
//! The caller holds the shard's lock for every method but
//! [`ColdShard::read`], which reads a record the lock found, outside it
//! (the file stays open while a caller holds its `Arc`; a record, once
//! written, never changes).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Result, ckpt_err};
use crate::table::storage::base::{self, Columns};
pub(crate) use crate::table::storage::compact::{Done, Job};
pub(crate) use crate::table::storage::record::Loc;
use crate::table::storage::record::{HEAD, decode, decode_body, encode};

mod compacting;
mod store;
pub(crate) use crate::table::storage::seg_file::SegFile;

/// A segment holds about this many bytes of records (in unit tests a few
/// kilobytes, so that their small tables fill, empty and compact files).
#[cfg(not(test))]
const SEGMENT_BYTES: usize = 64 << 20;
#[cfg(test)]
const SEGMENT_BYTES: usize = 4 << 10;

/// The active segment is closed once it holds this fraction of a
/// segment's records and half of them are dead (see [`ColdShard::append`]):
/// a shard's dead records in its active segment stay under about
/// `SEGMENT_BYTES / ROLL_DEAD` or its live ones.
const ROLL_DEAD: u32 = 16;

/// Keys hashed with the table's own mix (keys are not attacker-chosen
/// hash-flooding input here any more than in the table's index).
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = crate::hash::mix64(self.0 ^ u64::from(b));
        }
    }
    fn write_i64(&mut self, key: i64) {
        self.0 = crate::hash::key_hash(key);
    }
}

type KeyMap<V> = HashMap<i64, V, BuildHasherDefault<KeyHasher>>;

#[derive(Debug)]
struct Segment {
    file: Arc<SegFile>,
    path: PathBuf,
    /// Bytes of the file.
    bytes: u64,
    /// Records written.
    written: u32,
    /// Records the index still names.
    live: u32,
    /// A compaction job is copying its live records.
    compacting: bool,
}

/// One shard's rows on disk (see the module's docs).
#[derive(Debug)]
pub(crate) struct ColdShard {
    dir: PathBuf,
    shard: usize,
    /// Words of a record after its head.
    words: usize,
    index: KeyMap<Loc>,
    /// For a table whose policy evicts (TTL, capacity): each row's
    /// metadata words, which eviction scores it by wherever it is (16
    /// bytes a key plus the map's own).
    metas: Option<KeyMap<[u32; 4]>>,
    segments: Vec<Option<Segment>>,
    /// The segment appended to (`None` before the first put).
    active: Option<u32>,
    /// Records appended by the current batch of puts, written by
    /// [`ColdShard::flush`].
    pending: Vec<u8>,
    /// The first pending record's number in the active segment.
    pending_from: u32,
    /// Records a segment holds.
    per_segment: u32,
    /// The process whose files these are: a `fork()`ed child holds a copy
    /// of this shard but never writes or deletes its parent's files.
    pid: u32,
    /// A write failed since the last compaction job was taken: the next
    /// round compacts whatever files are half dead, however little of the
    /// shard is dead (a full disk is given back its dead records' room).
    write_failed: bool,
}

impl ColdShard {
    /// An empty cold shard of records of `words` words, its files in
    /// `dir` (which exists) named by `shard`; `metas`: it keeps each row's
    /// metadata in memory too ([`ColdShard::metas`]).
    pub(crate) fn new(dir: &Path, shard: usize, words: usize, metas: bool) -> ColdShard {
        let per_segment = (SEGMENT_BYTES / (HEAD + 4 * words)).clamp(1, u32::MAX as usize) as u32;
        ColdShard {
            per_segment,
            dir: dir.to_path_buf(),
            shard,
            words,
            index: KeyMap::default(),
            metas: metas.then(KeyMap::default),
            segments: Vec::new(),
            active: None,
            pending: Vec::new(),
            pending_from: 0,
            pid: std::process::id(),
            write_failed: false,
        }
    }

    /// Whether this process made the shard's files (not a forked child).
    pub(crate) fn owned(&self) -> bool {
        self.pid == std::process::id()
    }

    /// Deletes `path`, one of this shard's files, unless this process is
    /// a forked child (the files are its parent's).
    fn delete(&self, path: &Path) {
        if self.owned() {
            let _ = std::fs::remove_file(path);
        }
    }

    fn record_bytes(&self) -> usize {
        HEAD + 4 * self.words
    }

    /// Reads the record at `loc` of `file` into `words` (`words` long),
    /// checking that it is `key`'s and whole.
    ///
    /// # Errors
    /// `Checkpoint` for an I/O error or a record that is not `key`'s or
    /// fails its CRC.
    pub(crate) fn read(
        file: &SegFile,
        words_len: usize,
        key: i64,
        loc: Loc,
        buf: &mut Vec<u8>,
        words: &mut [u32],
    ) -> Result<()> {
        let io = |e: std::io::Error| ckpt_err("disk store", format!("reading a row: {e}"));
        if let Some(cols) = &file.base {
            let mut body = vec![0u8; cols.body_bytes()];
            cols.blank(&mut body);
            for (off, len, at) in cols.pieces(loc.rec) {
                if len > 0 {
                    let got = file.read_at(buf, len, off).map_err(io)?;
                    body[at..at + len].copy_from_slice(got);
                }
            }
            return decode_body(&body, key, base::row_crc(&body) == loc.crc, words);
        }
        let rb = HEAD + 4 * words_len;
        let rec = file
            .read_at(buf, rb, loc.rec as u64 * rb as u64)
            .map_err(io)?;
        decode(rec, key, loc.generation, words)
    }

    /// Takes the file `name` of the checkpoint at `dir` (checked whole by
    /// the caller, its columns at `cols`) as a segment of this shard
    /// ([`base::adopt`]); returns its number, for [`ColdShard::set`] of
    /// its rows (of generation 1, each with its CRC).
    ///
    /// # Errors
    /// `Checkpoint` when it cannot be linked, copied or opened, or is not
    /// `bytes` long.
    fn link_base(&mut self, dir: &Path, name: &str, bytes: u64, cols: Columns) -> Result<u32> {
        let n = self.segments.len() as u32;
        let path = self.dir.join(format!("s{:04}-{n:08}.base", self.shard));
        let fail = |e: std::io::Error| {
            ckpt_err(
                dir.join(name),
                format!("cannot take it as a disk segment: {e}"),
            )
        };
        base::adopt(dir, name, &path).map_err(fail)?;
        let kept = base::open(&path).and_then(|(file, direct)| {
            let len = file.metadata()?.len();
            if len != bytes {
                return Err(std::io::Error::other(format!(
                    "{len} bytes, {bytes} checked (replaced meanwhile)"
                )));
            }
            Ok((file, direct))
        });
        let (file, direct) = match kept {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(fail(e));
            }
        };
        self.segments.push(Some(Segment {
            file: Arc::new(SegFile {
                file,
                direct,
                base: Some(cols),
            }),
            path,
            bytes,
            written: cols.rows,
            live: 0,
            compacting: false,
        }));
        Ok(n)
    }

    /// Appends `key`'s row (`words`: weights, state, metadata), last
    /// changed in save generation `generation`, to the pending records;
    /// returns where it will be. Nothing names it until [`ColdShard::set`]
    /// after a [`ColdShard::flush`] that wrote it.
    ///
    /// # Errors
    /// `Checkpoint` when a full segment cannot be written or a new segment
    /// file cannot be created.
    pub(crate) fn append(&mut self, key: i64, generation: u32, words: &[u32]) -> Result<Loc> {
        debug_assert_eq!(words.len(), self.words);
        // A new segment when the active one is full, or when it is half
        // dead past a sixteenth of its size (rows moved out, then back in):
        // compaction never takes the active segment, so its dead records
        // would otherwise fill up to a whole segment's room for good.
        let full = self.active.is_none_or(|a| {
            let s = self.segments[a as usize]
                .as_ref()
                .expect("the active segment");
            s.written + self.pending_records() >= self.per_segment
                || (s.written >= self.per_segment / ROLL_DEAD && s.live * 2 <= s.written)
        });
        if full {
            self.flush()?;
            self.open_segment()?;
        }
        let seg = self.active.expect("a segment was opened");
        let rec = self.pending_from + self.pending_records();
        encode(key, generation, words, &mut self.pending);
        Ok(Loc {
            seg,
            rec,
            generation,
            crc: 0,
        })
    }

    /// Names `loc` (written by [`ColdShard::append`] and
    /// [`ColdShard::flush`]) as `key`'s row, in place of any earlier one.
    pub(crate) fn set(&mut self, key: i64, loc: Loc) {
        self.drop_entry(key);
        self.index.insert(key, loc);
        if let Some(s) = self.segments[loc.seg as usize].as_mut() {
            s.live += 1;
        }
    }

    /// [`ColdShard::append`], [`ColdShard::flush`] and [`ColdShard::set`]
    /// of one row (for tests and single moves).
    ///
    /// # Errors
    /// As [`ColdShard::append`] and [`ColdShard::flush`].
    #[cfg(test)]
    pub(crate) fn put_one(&mut self, key: i64, generation: u32, words: &[u32]) -> Result<()> {
        let loc = self.append(key, generation, words)?;
        self.flush()?;
        self.set(key, loc);
        Ok(())
    }

    /// Forgets the pending records (after a failed [`ColdShard::flush`]:
    /// nothing names them).
    pub(crate) fn discard(&mut self) {
        self.pending.clear();
    }

    fn pending_records(&self) -> u32 {
        (self.pending.len() / self.record_bytes()) as u32
    }

    fn open_segment(&mut self) -> Result<()> {
        if !self.owned() {
            return Err(forked());
        }
        let n = self.segments.len() as u32;
        let path = self.segment_path(n);
        let file = SegFile::create(&path).map_err(|e| {
            self.write_failed = true;
            ckpt_err(&path, format!("creating a disk segment: {e}"))
        })?;
        self.segments.push(Some(Segment {
            file: Arc::new(file),
            path,
            bytes: 0,
            written: 0,
            live: 0,
            compacting: false,
        }));
        self.active = Some(n);
        self.pending_from = 0;
        Ok(())
    }

    fn segment_path(&self, n: u32) -> PathBuf {
        self.dir.join(format!("s{:04}-{n:08}.seg", self.shard))
    }

    /// Writes the pending records to the active segment.
    ///
    /// # Errors
    /// `Checkpoint` for an I/O error (the records stay pending).
    pub(crate) fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        if !self.owned() {
            return Err(forked());
        }
        let a = self.active.expect("pending records have a segment");
        let rb = self.record_bytes() as u64;
        let s = self.segments[a as usize]
            .as_mut()
            .expect("the active segment");
        if let Err(e) = s
            .file
            .write_at(&self.pending, u64::from(self.pending_from) * rb)
        {
            self.roll_over();
            return Err(ckpt_err("disk store", format!("writing rows: {e}")));
        }
        let n = (self.pending.len() as u64 / rb) as u32;
        s.written += n;
        s.bytes += self.pending.len() as u64;
        self.pending_from += n;
        self.pending.clear();
        // A large flush's room is given back rather than kept resident.
        self.pending.shrink_to(1 << 20);
        Ok(())
    }

    /// After a failed write (a full disk, most often): the active segment
    /// is cut back to its last whole write (a partial write's room given
    /// back) and closed, so that it is compacted like any other file once
    /// half dead (a segment appended to for long holds mostly the dead
    /// records of rows moved back in, which compaction never took while it
    /// was active), or deleted at once when nothing in it is live; the next
    /// append opens a new segment. The pending records are the caller's to
    /// discard.
    fn roll_over(&mut self) {
        self.write_failed = true;
        let Some(a) = self.active.take() else {
            return;
        };
        self.pending_from = 0;
        let slot = &mut self.segments[a as usize];
        if let Some(s) = slot {
            let _ = s.file.file.set_len(s.bytes);
            if s.live == 0 {
                let path = s.path.clone();
                *slot = None;
                self.delete(&path);
            }
        }
    }

    /// Whether a write failed since the last compaction job was taken (the
    /// next round compacts what it can, see [`ColdShard::roll_over`]).
    pub(crate) fn write_failed(&self) -> bool {
        self.write_failed
    }

    fn drop_entry(&mut self, key: i64) -> bool {
        let Some(loc) = self.index.remove(&key) else {
            return false;
        };
        let last = Some(loc.seg) != self.active;
        let slot = &mut self.segments[loc.seg as usize];
        if let Some(s) = slot {
            s.live -= 1;
            if s.live == 0 && last {
                // Every record dead: the file goes (a reader holding its
                // `Arc` still reads it).
                let path = s.path.clone();
                *slot = None;
                self.delete(&path);
            }
        }
        true
    }
}

impl Drop for ColdShard {
    fn drop(&mut self) {
        let segments = std::mem::take(&mut self.segments);
        for s in segments.into_iter().flatten() {
            self.delete(&s.path);
        }
    }
}

/// The error of a write to a disk table's files from a forked child.
pub(crate) fn forked() -> crate::error::StoreError {
    crate::error::invalid(
        "disk",
        "a disk table cannot be used in a fork()ed child: its files are its parent's \
         (open a checkpoint of it with Table.load in the child instead)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::storage::tier::{ColdStore, RecordStore};
    use crate::testing::temp_dir;
    use std::os::unix::fs::FileExt;

    fn words_of(key: i64, n: usize) -> Vec<u32> {
        (0..n)
            .map(|i| (key as u32).wrapping_mul(31) ^ i as u32)
            .collect()
    }

    fn read_back(c: &ColdShard, key: i64) -> Result<Vec<u32>> {
        let (loc, _) = c.find(key).expect("held");
        let file = c.segment(loc.seg).expect("held");
        let mut w = vec![0; c.words];
        ColdShard::read(&file, c.words, key, loc, &mut Vec::new(), &mut w)?;
        Ok(w)
    }

    /// A dict model of a cold shard under puts, takes and erases in
    /// random order, small segments so that files fill, die and compact.
    #[test]
    fn puts_takes_and_compaction_keep_every_row_readable() {
        let dir = temp_dir("cold");
        let mut c = ColdShard::new(&dir, 3, 6, false);
        // 40-byte records, 16 to a segment.
        c.per_segment = 16;
        let mut model = std::collections::HashMap::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for step in 0..3_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = (x % 300) as i64 - 150;
            match step % 4 {
                0 | 1 => {
                    c.put_one(key, step, &words_of(key ^ i64::from(step), c.words))
                        .unwrap();
                    model.insert(key, step);
                }
                2 => {
                    if let Some((loc, _)) = c.find(key) {
                        assert!(c.take(key, loc));
                        assert!(!c.take(key, loc), "taken once");
                    }
                    model.remove(&key);
                }
                _ => assert_eq!(c.erase(key), model.remove(&key).is_some()),
            }
            if step % 500 == 499 {
                c.compact().unwrap();
            }
        }
        c.flush().unwrap();
        assert_eq!(c.len(), model.len());
        for (&key, &step) in &model {
            assert_eq!(
                read_back(&c, key).unwrap(),
                words_of(key ^ i64::from(step), c.words)
            );
        }
        c.compact().unwrap();
        assert!(c.dead_share() < 0.5 + 1e-9, "{}", c.dead_share());
        let files = std::fs::read_dir(&dir).unwrap().count();
        assert!(
            files <= c.segments.iter().flatten().count(),
            "dead files deleted"
        );
        drop(c);
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "dropped: no file"
        );
    }

    #[test]
    fn a_damaged_record_reads_as_an_error_never_as_a_row() {
        let dir = temp_dir("cold-damage");
        let mut c = ColdShard::new(&dir, 0, 4, false);
        c.put_one(7, 1, &[1, 2, 3, 4]).unwrap();
        c.put_one(8, 1, &[5, 6, 7, 8]).unwrap();
        c.flush().unwrap();
        let (loc, _) = c.find(8).unwrap();
        let file = c.segment(loc.seg).unwrap();
        // One bit flipped in key 8's words.
        let at = u64::from(loc.rec) * 32 + 20;
        let mut b = [0u8];
        file.file.read_exact_at(&mut b, at).unwrap();
        file.file.write_all_at(&[b[0] ^ 1], at).unwrap();
        assert_eq!(read_back(&c, 7).unwrap(), vec![1, 2, 3, 4]);
        let e = read_back(&c, 8).unwrap_err().to_string();
        assert!(e.contains("key 8 is damaged"), "{e}");
        // Key 7's place read as key 8's: refused too.
        let (loc7, _) = c.find(7).unwrap();
        let e = ColdShard::read(&file, 4, 8, loc7, &mut Vec::new(), &mut [0; 4]).unwrap_err();
        assert!(e.to_string().contains("damaged"));
    }
}
