//! Compacting a disk table's shard in the background: a [`Job`] taken
//! under the shard's lock ([`ColdShard::compaction_job`]) copies the live
//! rows of its half-dead files into a new segment without any lock (the
//! files it reads are never changed, and stay open while it holds them),
//! and the [`Done`] it gives back names the rows in their new place under
//! the lock again ([`ColdShard::install`]), each only if it is still where
//! the job found it.
//!
//! [`ColdShard::compaction_job`]: super::cold::ColdShard::compaction_job
//! [`ColdShard::install`]: super::cold::ColdShard::install

use std::path::PathBuf;
use std::sync::Arc;

use crate::error::{Result, ckpt_err};
use crate::table::storage::base;
use crate::table::storage::record::{HEAD, Loc, decode, decode_body, encode};
use crate::table::storage::seg_file::SegFile;

/// Rows are read from a file in windows of this many records, so that a
/// job holds little memory whatever the file's size.
const WINDOW: usize = 2048;

/// Bytes of new records a job gathers before it writes them.
const WRITE_BYTES: usize = 4 << 20;

/// The live rows of a file to compact: its number, its file, and (record,
/// key, place) by record.
pub(crate) type Victim = (u32, Arc<SegFile>, Vec<(u32, i64, Loc)>);

/// A job's new segment: its file, its rows (record, key, the place each
/// was copied from) and its bytes.
pub(crate) type Written = (SegFile, Vec<(u32, i64, Loc)>, u64);

/// A compaction's work (see the module's docs).
pub(crate) struct Job {
    /// The new segment's number and path.
    seg: u32,
    path: PathBuf,
    files: Vec<Victim>,
    /// Every buffer the job fills, allocated by the thread that makes the
    /// job: a job's own thread allocates nothing of size, so the memory it
    /// uses goes back to the allocator's main arena (a thread of its own
    /// would keep tens of megabytes resident in an arena of its own).
    room: Room,
}

/// A job's buffers (see [`Job`]).
struct Room {
    out: Vec<u8>,
    moved: Vec<(u32, i64, Loc)>,
    bufs: [Vec<u8>; 3],
    body: Vec<u8>,
    words: Vec<u32>,
}

/// A job's outcome, for [`ColdShard::install`](super::cold::ColdShard::install).
#[derive(Debug)]
pub(crate) struct Done {
    pub(super) seg: u32,
    /// The files compacted.
    pub(super) victims: Vec<u32>,
    /// The new segment, its rows (record, key, the place they were copied
    /// from) and its bytes; `None` when the job failed.
    pub(super) written: Option<Written>,
    /// Why it failed.
    pub(crate) error: Option<String>,
}

impl Job {
    /// The job of copying the live rows `files` (records of `words`
    /// words) into a new segment, number `seg` at `path`.
    pub(super) fn new(seg: u32, path: PathBuf, words: usize, files: Vec<Victim>) -> Job {
        let rb = HEAD + 4 * words;
        let rows = files.iter().map(|f| f.2.len()).sum();
        // A window of any column, with room for O_DIRECT's alignment.
        let widest = files
            .iter()
            .filter_map(|f| f.1.base.map(|c| c.body_bytes()))
            .fold(rb, usize::max);
        let window = WINDOW * widest + (16 << 10);
        Job {
            seg,
            path,
            files,
            room: Room {
                out: Vec::with_capacity(WRITE_BYTES + rb),
                moved: Vec::with_capacity(rows),
                bufs: std::array::from_fn(|_| Vec::with_capacity(window)),
                body: Vec::with_capacity(widest),
                words: vec![0; words],
            },
        }
    }

    /// Live rows the job moves.
    pub(crate) fn rows(&self) -> usize {
        self.files.iter().map(|f| f.2.len()).sum()
    }

    /// Copies the live rows into the new segment (written back and dropped
    /// from the page cache, as any flush); a failure leaves no file.
    pub(crate) fn run(mut self) -> Done {
        let victims = self.files.iter().map(|f| f.0).collect();
        match self.copy() {
            Ok(written) => Done {
                seg: self.seg,
                victims,
                written: Some(written),
                error: None,
            },
            Err(e) => {
                let _ = std::fs::remove_file(&self.path);
                Done {
                    seg: self.seg,
                    victims,
                    written: None,
                    error: Some(e.to_string()),
                }
            }
        }
    }

    fn copy(&mut self) -> Result<Written> {
        let io = |e: std::io::Error| ckpt_err("disk store", format!("compacting: {e}"));
        let file = SegFile::create(&self.path).map_err(io)?;
        let Room {
            out,
            moved,
            bufs,
            body,
            words,
        } = &mut self.room;
        let mut at = 0u64;
        for (_, src, live) in &self.files {
            each_row(src, live, (bufs, body, words), |key, loc, words| {
                encode(key, loc.generation, words, out);
                moved.push((moved.len() as u32, key, loc));
                if out.len() >= WRITE_BYTES {
                    file.write_at(out, at).map_err(io)?;
                    at += out.len() as u64;
                    out.clear();
                }
                Ok(())
            })?;
        }
        if !out.is_empty() {
            file.write_at(out, at).map_err(io)?;
            at += out.len() as u64;
        }
        Ok((file, std::mem::take(moved), at))
    }
}

pub(crate) use crate::record::Scratch;

/// Reads the rows `live` (record, key, place; by record) of `file`, in
/// windows of up to [`WINDOW`] records where at least one in 16 of a
/// window's records is wanted (one read a column), one by one otherwise;
/// checks each (a record's key, generation and CRC; an adopted checkpoint
/// row's CRC) and hands its words to `f`, in `live`'s order.
///
/// # Errors
/// `Checkpoint` for an I/O error or a damaged row; `f`'s error.
pub(crate) fn each_row(
    file: &SegFile,
    live: &[(u32, i64, Loc)],
    (bufs, body, words): Scratch<'_>,
    mut f: impl FnMut(i64, Loc, &[u32]) -> Result<()>,
) -> Result<()> {
    let io = |e: std::io::Error| ckpt_err("disk store", format!("reading rows: {e}"));
    let words_len = words.len();
    let mut i = 0;
    while i < live.len() {
        let first = live[i].0;
        let mut end = live[i..].partition_point(|l| l.0 < first + WINDOW as u32) + i;
        if (end - i) * 16 < (live[end - 1].0 - first + 1) as usize {
            end = i + 1;
        }
        let span = (live[end - 1].0 - first + 1) as usize;
        match &file.base {
            None => {
                let rb = HEAD + 4 * words_len;
                let got = file
                    .read_at(&mut bufs[0], span * rb, u64::from(first) * rb as u64)
                    .map_err(io)?;
                for &(rec, key, loc) in &live[i..end] {
                    let from = (rec - first) as usize * rb;
                    decode(&got[from..from + rb], key, loc.generation, words)?;
                    f(key, loc, words)?;
                }
            }
            Some(cols) => {
                let mut got: [&[u8]; 3] = [&[], &[], &[]];
                for (k, (buf, g)) in bufs.iter_mut().zip(got.iter_mut()).enumerate() {
                    let (off, len, _) = cols.pieces(first)[k];
                    if len > 0 {
                        *g = file.read_at(buf, span * len, off).map_err(io)?;
                    }
                }
                body.resize(cols.body_bytes(), 0);
                for &(rec, key, loc) in &live[i..end] {
                    cols.blank(body);
                    for (k, g) in got.iter().enumerate() {
                        let (_, len, at) = cols.pieces(rec)[k];
                        let from = (rec - first) as usize * len;
                        body[at..at + len].copy_from_slice(&g[from..from + len]);
                    }
                    decode_body(body, key, base::row_crc(body) == loc.crc, words)?;
                    f(key, loc, words)?;
                }
            }
        }
        i = end;
    }
    Ok(())
}
