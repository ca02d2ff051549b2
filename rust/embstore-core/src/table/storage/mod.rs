//! Where rows live: shards (an index of keys to row numbers and an arena of
//! rows each), the arena's segments and pages, and the shard locks.

pub(crate) mod ahead;
pub(crate) mod arena;
pub(crate) mod base;
pub(crate) mod cold;
pub(crate) mod column;
pub(crate) mod compact;
pub(crate) mod disk_dir;
pub(crate) mod index;
pub(crate) mod memory;
pub(crate) mod pages;
pub(crate) mod record;
pub(crate) mod seg_file;
pub(crate) mod seqlock;
pub(crate) mod shard;
pub(crate) mod tier;
pub(crate) mod view;

use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub(crate) use shard::Shard;

/// Counts every shard's queued serving reads (`Table::record_reads`)
/// before the caller reads the rows' metadata (eviction, export, save, a
/// spill), taking each such shard's write lock briefly. Holding no shard
/// lock.
pub(crate) fn count_queued_reads(
    shards: &[crossbeam_utils::CachePadded<RwLock<Shard>>],
    views: &[crossbeam_utils::CachePadded<std::sync::Arc<view::View>>],
) {
    for (lock, view) in shards.iter().zip(views.iter()) {
        if !view.reads.is_empty() {
            drop(write(lock));
        }
    }
}

/// A shard's read lock (a poisoned lock is taken as the others are).
pub(crate) fn read(lock: &RwLock<Shard>) -> RwLockReadGuard<'_, Shard> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

/// The guard of a `try_read`/`try_write`/`try_lock` if the lock was free
/// (`None` instead of waiting; a poisoned lock is taken as the others are).
pub(crate) fn try_lock<G>(r: std::sync::TryLockResult<G>) -> Option<G> {
    match r {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// A shard's write lock (a poisoned lock is taken as the others are), with
/// the serving reads queued while it was taken counted first
/// ([`Shard::count_reads`]), so that whoever holds it sees every touch.
pub(crate) fn write(lock: &RwLock<Shard>) -> ShardWrite<'_> {
    let mut g = lock.write().unwrap_or_else(PoisonError::into_inner);
    g.count_reads();
    ShardWrite(g)
}

/// A shard's write lock if it was free (`None` instead of waiting; a
/// poisoned lock is taken as the others are).
pub(crate) fn try_write(lock: &RwLock<Shard>) -> Option<ShardWrite<'_>> {
    try_lock(lock.try_write()).map(ShardWrite)
}

/// A shard's write lock, held: every write to a shard is made through
/// one, and its release publishes the shard's rows and bytes for the
/// capacity check ([`Shard::publish_counts`]).
pub(crate) struct ShardWrite<'a>(RwLockWriteGuard<'a, Shard>);

impl std::ops::Deref for ShardWrite<'_> {
    type Target = Shard;
    #[inline(always)]
    fn deref(&self) -> &Shard {
        &self.0
    }
}

impl std::ops::DerefMut for ShardWrite<'_> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut Shard {
        &mut self.0
    }
}

impl Drop for ShardWrite<'_> {
    fn drop(&mut self) {
        self.0.publish_counts();
    }
}
