//! A row with everything it carries, as it moves between tiers: the
//! record batch ([`RecordBatch`]: keys, save generations, each row's
//! stored words, optimizer state and metadata words), where a record is
//! ([`Loc`]), what it is read from ([`RecordSource`]) and the read half of
//! every tier of records ([`RecordStore`]), implemented by the stores
//! under a table (the disk store, the test tier; their write half is
//! `table/storage/tier.rs`'s `ColdStore`) and by the mapped reader
//! (`mapped/records.rs`). [`read_records`] reads a batch of keys' records
//! from any of them. This module names no table or mapped code.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::Result;

/// Threads that read a batch's records at most (the calling thread and
/// helpers): the device's queue depth they keep.
const READ_THREADS: usize = 32;

/// Where a key's record is, in the store that named it: in the disk
/// store its segment, its record there, and the save generation it was
/// last changed in (what an incremental save asks); in the mapped reader
/// its file's number and row (generation 0); in an adopted checkpoint
/// file (`table/storage/base.rs`) also the row's
/// CRC-32C, which a record keeps in its head instead (the 4 bytes fit in
/// what the map's entry pads to anyway).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    pub(crate) seg: u32,
    pub(crate) rec: u32,
    pub(crate) generation: u32,
    pub(crate) crc: u32,
}

/// Scratch room for the disk store's windowed reads (`each_row`): a
/// buffer per column, a row's bytes and its words (`words` long: a
/// record's words after its head).
pub(crate) type Scratch<'a> = (&'a mut [Vec<u8>; 3], &'a mut Vec<u8>, &'a mut [u32]);

/// Rows with everything they carry, as they move between memory and a
/// colder tier: each row's key, save generation, and words (its stored
/// weights, optimizer state and 4 metadata words, `width` a row, as the
/// bits of the floats and of the metadata).
#[derive(Debug, Default)]
pub(crate) struct RecordBatch {
    pub(crate) keys: Vec<i64>,
    pub(crate) generations: Vec<u32>,
    pub(crate) words: Vec<u32>,
    pub(crate) width: usize,
}

impl RecordBatch {
    /// An empty batch of rows of `width` words.
    pub(crate) fn new(width: usize) -> RecordBatch {
        RecordBatch {
            width,
            ..RecordBatch::default()
        }
    }

    /// Rows held.
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    /// Appends a row: `words` must yield `width` words.
    pub(crate) fn push(&mut self, key: i64, generation: u32, words: impl Iterator<Item = u32>) {
        self.keys.push(key);
        self.generations.push(generation);
        let at = self.words.len();
        self.words.extend(words);
        debug_assert_eq!(self.words.len() - at, self.width);
    }

    /// Row `i`'s words.
    pub(crate) fn row(&self, i: usize) -> &[u32] {
        &self.words[i * self.width..(i + 1) * self.width]
    }

    /// Row `i`'s metadata words (its last 4).
    pub(crate) fn meta(&self, i: usize) -> [u32; 4] {
        let r = self.row(i);
        std::array::from_fn(|j| r[r.len() - 4 + j])
    }
}

/// What a store's records are read from outside the shard's lock (a
/// segment file of the disk store).
pub(crate) trait RecordSource: Send + Sync + std::fmt::Debug {
    /// Reads `key`'s record at `loc` into `words` (a row's words), checking
    /// that it is `key`'s and whole; `buf` is scratch room.
    ///
    /// # Errors
    /// `Checkpoint` for a record that cannot be read or fails its check.
    fn read(&self, key: i64, loc: Loc, buf: &mut Vec<u8>, words: &mut [u32]) -> Result<()>;

    /// Reads the records `live` names (record number, key, place; by
    /// record number), handing each key and its words to `f` in order.
    ///
    /// # Errors
    /// As [`RecordSource::read`]; `f`'s error.
    fn read_run(
        &self,
        live: &[(u32, i64, Loc)],
        (_, buf, words): Scratch<'_>,
        f: &mut dyn FnMut(i64, &[u32]) -> Result<()>,
    ) -> Result<()> {
        for &(_, key, loc) in live {
            self.read(key, loc, buf, words)?;
            f(key, words)?;
        }
        Ok(())
    }
}

/// What a tier's records are found and listed by: the read half of a
/// tier, shared by the stores under a table (`ColdStore`: the disk
/// store, the test tier) and by the mapped reader, which serves a
/// published checkpoint's records read-only (`MappedRecords`). [`read_records`]
/// reads a batch of keys' records from any of them.
pub(crate) trait RecordStore: Send + Sync + std::fmt::Debug {
    /// Rows held.
    fn len(&self) -> usize;
    /// Whether it holds `key`.
    fn contains(&self, key: i64) -> bool;
    /// Where `key`'s record is, and what to read it from.
    fn find(&self, key: i64) -> Option<(Loc, Arc<dyn RecordSource>)>;
    /// Every key held with its place.
    fn entries(&self) -> Box<dyn Iterator<Item = (i64, Loc)> + '_>;
    /// What the record at `loc` (one [`ColdStore::entries`] named) is read
    /// from, while it is held.
    fn source(&self, loc: Loc) -> Option<Arc<dyn RecordSource>>;
    /// Every key held with its metadata words, where the store keeps them
    /// (for a policy that scores rows wherever they are).
    fn metas(&self) -> Box<dyn Iterator<Item = (i64, [u32; 4])> + '_>;
}

/// Reads the records of `keys` that `store` holds into `out` (whose width
/// is the store's record width; `out` is cleared first), one row a key in
/// `keys`' order, a key it does not hold as zero words, and whether each
/// is held into `found`.
///
/// # Errors
/// `ShapeMismatch` naming `found`; a record's read error (nothing is
/// returned then).
pub(crate) fn read_records(
    store: &dyn RecordStore,
    keys: &[i64],
    out: &mut RecordBatch,
    found: &mut [bool],
) -> Result<()> {
    crate::rows::check_len("found", keys.len(), found.len())?;
    let width = out.width;
    out.keys.clear();
    out.generations.clear();
    out.words.clear();
    let oom = |_| crate::error::oom("keys", keys.len() as u128 * (12 + 4 * width as u128));
    out.keys.try_reserve_exact(keys.len()).map_err(oom)?;
    out.generations.try_reserve_exact(keys.len()).map_err(oom)?;
    out.words
        .try_reserve_exact(keys.len() * width)
        .map_err(oom)?;
    let (mut buf, mut words) = (Vec::new(), vec![0u32; width]);
    for (&key, hit) in keys.iter().zip(found.iter_mut()) {
        match store.find(key) {
            Some((loc, src)) => {
                src.read(key, loc, &mut buf, &mut words)?;
                out.push(key, loc.generation, words.iter().copied());
                *hit = true;
            }
            None => {
                out.push(key, 0, std::iter::repeat_n(0, width));
                *hit = false;
            }
        }
    }
    Ok(())
}

/// Reads the records `wants` names (key, place, source) into `out`
/// (`words` a record, in `wants`' order), in chunks of 8 that the calling
/// thread and up to [`READ_THREADS`] - 1 more take in turn, so that as
/// many reads are in flight as a disk's queue wants (a thread that cannot
/// be started leaves its share to the others). No lock is held: a record,
/// once written, never changes, and each source stays readable while
/// `wants` holds it.
///
/// # Errors
/// A record's read error (the first met); `out` is partly written then.
pub(crate) fn read_all(
    wants: &[(i64, Loc, &dyn RecordSource)],
    words: usize,
    out: &mut [u32],
) -> Result<()> {
    const CHUNK: usize = 8;
    type Chunk<'a, 'w> = Mutex<Option<(&'a [(i64, Loc, &'w dyn RecordSource)], &'a mut [u32])>>;
    debug_assert_eq!(out.len(), wants.len() * words);
    let chunks: Vec<Chunk<'_, '_>> = wants
        .chunks(CHUNK)
        .zip(out.chunks_mut(CHUNK * words))
        .map(|c| Mutex::new(Some(c)))
        .collect();
    let next = AtomicUsize::new(0);
    let work = || -> Result<()> {
        let mut buf = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(slot) = chunks.get(i) else {
                return Ok(());
            };
            let taken = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
            if let Some((ws, o)) = taken {
                for (&(key, loc, src), dst) in ws.iter().zip(o.chunks_mut(words)) {
                    src.read(key, loc, &mut buf, dst)?;
                }
            }
        }
    };
    let helpers = chunks.len().saturating_sub(1).min(READ_THREADS - 1);
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..helpers)
            .filter_map(|_| {
                std::thread::Builder::new()
                    .name("embstore-disk-read".into())
                    .spawn_scoped(sc, work)
                    .ok()
            })
            .collect();
        let mut result = work();
        for h in handles {
            let r = h.join().unwrap_or_else(|_| {
                Err(crate::error::ckpt_err(
                    "disk store",
                    "a read thread panicked",
                ))
            });
            result = result.and(r);
        }
        result
    })
}
