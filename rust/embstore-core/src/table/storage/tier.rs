//! The tier under a shard's memory, as the table sees it: a store of
//! whole rows that moves [`RecordBatch`]es ([`ColdStore`]), and what a row
//! is read from outside the shard's lock ([`RecordSource`]). The disk
//! store ([`ColdShard`](super::cold::ColdShard)) is one; a table reaches
//! its cold rows through these traits alone, so another tier (a test's
//! slow one in memory: `table/cold/slow_tier.rs`) plugs in under it.
//!
//! A store is called under its shard's lock (the table's lock order:
//! cold gate, table gate, shard lock); a read of a record it found goes
//! through the [`RecordSource`] it handed out, after the lock is dropped
//! (a record, once written, never changes; the source stays readable
//! while a caller holds its `Arc`).

use std::collections::TryReserveError;
use std::path::Path;
use std::sync::Arc;

use crate::error::Result;
use crate::table::storage::base::Columns;
use crate::table::storage::compact::{Done, Job, Scratch};
use crate::table::storage::record::Loc;

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

/// One shard's rows below memory (see the module's docs): a key is in
/// memory or here, never both.
pub(crate) trait ColdStore: Send + Sync + std::fmt::Debug {
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
    /// Room for `n` more keys.
    ///
    /// # Errors
    /// When the memory cannot be had.
    fn try_reserve(&mut self, n: usize) -> std::result::Result<(), TryReserveError>;
    /// Takes `batch`'s rows (keys it does not hold), whole or not at all.
    ///
    /// # Errors
    /// `Checkpoint` when they cannot be written: none is held then.
    fn put(&mut self, batch: &RecordBatch) -> Result<()>;
    /// Removes `key` if its record is still at `loc` (a row read outside
    /// the lock is taken into memory only if nothing moved it meanwhile).
    fn take(&mut self, key: i64, loc: Loc) -> bool;
    /// Removes `key`; whether it was held.
    fn erase(&mut self, key: i64) -> bool;
    /// Bytes the store takes where it keeps its records.
    fn stored_bytes(&self) -> u64;
    /// Bytes of memory its index takes.
    fn index_bytes(&self) -> usize;

    /// Whether [`ColdStore::compaction_job`] has work.
    fn compaction_due(&self) -> bool {
        false
    }
    /// Work of compacting the store, about `budget` rows, run without the
    /// shard's lock.
    fn compaction_job(&mut self, _budget: usize) -> Option<Job> {
        None
    }
    /// Names what a compaction job moved; returns how many rows.
    fn install(&mut self, _done: Done) -> usize {
        0
    }
    /// Whether [`ColdStore::adopt`] takes checkpoint files as they are.
    fn adopts(&self) -> bool {
        false
    }
    /// Takes the rows file `name` of the checkpoint at `dir` (checked
    /// whole, `bytes` long, its columns at `cols`) as it is, its rows
    /// (key, CRC of the row's bytes, metadata words; in file order) named
    /// here in save generation 1.
    ///
    /// # Errors
    /// `Checkpoint` when it cannot be taken; nothing is named then.
    fn adopt(
        &mut self,
        dir: &Path,
        name: &str,
        bytes: u64,
        _cols: Columns,
        _rows: &mut dyn Iterator<Item = (i64, u32, [u32; 4])>,
    ) -> Result<()> {
        Err(crate::error::ckpt_err(
            dir.join(name),
            format!("this store takes no checkpoint file as it is ({bytes} bytes)"),
        ))
    }
    /// The disk store itself (tests that look at its files).
    #[cfg(test)]
    fn disk(&mut self) -> Option<&mut super::cold::ColdShard> {
        None
    }
}
