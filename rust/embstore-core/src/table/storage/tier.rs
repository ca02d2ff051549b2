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

use crate::error::Result;
pub(crate) use crate::record::{RecordBatch, RecordSource, RecordStore, read_records};
use crate::table::storage::base::Columns;
use crate::table::storage::compact::{Done, Job};
use crate::table::storage::record::Loc;

/// One shard's rows below memory (see the module's docs): a key is in
/// memory or here, never both. Found and listed through its
/// [`RecordStore`] half.
pub(crate) trait ColdStore: RecordStore {
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
