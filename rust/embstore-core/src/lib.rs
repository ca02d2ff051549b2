//! # embstore-core
//!
//! Sharded hash tables from int64 feature ids to learned embedding rows and
//! their optimizer state, with SIMD sparse optimizers. No Python here: the
//! binding crate `embstore-py` wraps this crate as `embstore._core`.
//!
//! ## Model
//! A [`Table`] holds rows of `dim` floats plus `state_len` floats of optimizer
//! state per key, in shards chosen by a hash of the key. Every batch call
//! hashes its keys once, groups them by shard, and processes the shards in
//! parallel on rayon's pool, taking each shard's lock once.
//!
//! ## Consistency
//! Any number of threads may call any method at once. A row is written only
//! under its shard's write lock, so no update is lost. Serving reads (a
//! lookup or pooled lookup that does not insert, `contains`, the live
//! `export`) take no lock at all: they copy a row between two reads of its key's version, kept
//! beside the key in the index (`table::storage::seqlock`) and retry a copy a writer overlapped, so a
//! reader sees a row wholly before or wholly after an update, never waits
//! for a writer's lock, and reads a row removed meanwhile as it was or as
//! missing (memory is freed through crossbeam-epoch, after the readers that
//! might still read it). On a table with TTL or capacity a serving read
//! also counts its keys as touches: where a shard's write lock is free it
//! counts them under it (only tried), else it queues them on the shard's
//! lock-free queue for the lock's next holder, which counts them first
//! (`storage::write`); eviction, `export` and `save` count what is queued
//! before they read the metadata (a shard queues at most
//! `storage::shard::MAX_QUEUED_READS` keys: beside a long hold, reads past
//! them go uncounted). So a serving read waits for no writer on any table.
//!
//! ## Locks: the one order
//! This is the only place the order is written down; every lock of the
//! crate (and of the binding) is in it. A thread that holds a lock takes
//! only locks further down the list.
//!
//! 1. A checkpoint directory's writers' lock (`format::dirlock`, taken by
//!    [`table::checkpoint::lock_for_writing`]): a save or a publish takes
//!    it first, before anything else, and the binding waits for it with
//!    the GIL released and outside the call lock, so a save that waits for
//!    another process's save holds nothing and never holds up `fork()`.
//! 2. A checkpoint directory's readers' lock (`format::dirlock`),
//!    held shared by a reader: a load, `inspect`, a [`MappedTable`] while it
//!    maps a manifest's files (on open and in `refresh`). Another process
//!    can hold it, so it is taken before the call lock, with the GIL
//!    released (the binding's `runtime::lock_for_reading`), and only by
//!    polling for a bounded time (10 s; a follow thread its period): a wait
//!    for it never holds up `fork()` and never hangs. Inside the core a
//!    reader that holds none only tries it ([`Table::load_held`],
//!    [`MappedTable::open_held`], [`MappedTable::refresh_held`]). A save
//!    deletes old files only if it gets it exclusively without waiting,
//!    else lists them for the next publish that does.
//! 3. The binding's call lock (`embstore-py`, `runtime::CALLS`): shared by
//!    every native call, exclusive only in the `fork()` prepare handler, so
//!    that a process forks while no call is inside the core.
//! 4. A disk table's cold gate (`table::cold`), shared by every call that
//!    reads or changes its rows from before it moves the call's rows on
//!    disk into memory until it ends (and by a prefetch thread, a save and
//!    an export), exclusive only to move rows to disk, which a call does
//!    after releasing its own hold, holding nothing: so no call finds a row
//!    gone between moving it in and using it. Taken on the calling thread
//!    (a prefetch's own thread), never in a rayon job; a call on several
//!    tables takes theirs in ascending [`Table::id`] before any gate.
//!    Inside it, the table's gate (a call moving its rows in holds it
//!    shared, as every shard writer does), and in rayon jobs a shard's lock
//!    and then its cold part (the `ColdStore` a shard holds, under that
//!    lock). A disk table's compaction job (`table::storage::compact`) runs
//!    on a thread of its own inside the binding's call lock and takes no
//!    lock of the table: what it finds and what it moved are named under
//!    the cold gate taken exclusively. A round of moving rows out runs on
//!    a thread of its own too, inside the call lock, and takes the cold
//!    gate exclusively first (the call lock, then the cold gate, as a
//!    call); a call's floor runs a round itself only where it can take the
//!    gate at once (`try_write`), so it never waits on a gate it holds.
//! 5. Table gates ([`Table`]'s `gate`), shared by every call that changes
//!    rows (lookups that insert, assigns, steps, removals,
//!    evictions, `reserve`), exclusive for a snapshot (`export`, `save`;
//!    an incremental save only while it copies its rows out)
//!    and for a step whose bounds cannot rule out a non-finite result
//!    (`table::step::bounds`: the rows are measured and the step dry-run first).
//!    A call on several tables (a [`collection`] call) takes their gates in
//!    ascending [`Table::id`], on the calling thread.
//! 6. A mapped table's refresh lock (`mapped`: one refresh at a time),
//!    taken inside the call lock, with the readers' lock already held. A
//!    serving cache's slot map lock (the binding's `SlotMap`, over
//!    [`slots::SlotMap`]), inside the call lock, held for a serving call's
//!    whole native part, its partitions' jobs included (the calling thread
//!    runs some, pool jobs the rest, [`par`]): they take no lock of their
//!    own but the leaf locks of the mapped table they read (its version,
//!    its files' checks), and nothing else takes it.
//! 7. Shard locks, by shard index, taken by writers and by the reads that
//!    must see no writer (snapshots, training lookups); serving reads take
//!    none, only trying a write lock to count touches (see "Consistency");
//!    the queued touches are counted by whoever takes a write lock, and
//!    before eviction, `export` and `save` read metadata on the calling
//!    thread (each such shard's write lock in turn, none held). Inside rayon
//!    jobs a thread holds at most one, and only for the job, except a
//!    pooling job of a pooled lookup that inserts
//!    (`table::read::pooling`), which holds the read locks of the shards its
//!    bags read, taken in index order, for the job: a writer holds one write
//!    lock at a time and waits for nothing while holding it (or, on the
//!    calling thread, only tries further ones), so the job's wait for a
//!    read lock always ends. The one caller that holds shard locks
//!    across a parallel call is `export` (every shard's read lock, taken in
//!    index order), and it holds its gate exclusively: every shard writer
//!    holds the gate shared, so no job can be waiting for a write lock
//!    then, and readers never wait for readers. [`Table::try_lookup_now`]
//!    takes no lock when it serves, and when it inserts holds the write
//!    locks of the shards it needs together, on the calling thread, having
//!    only tried each (in index order, after trying its gate): it never
//!    waits.
//! 8. Leaf locks, never held while taking another or running parallel work:
//!    the memo, the rows a capacity eviction takes next (`table::lowest`:
//!    held to take or put them back, not while it reads the shards), the
//!    save marks (with the removal-log pins of saves in
//!    flight), the per-shard slots of `FoundRows`, a disk table's
//!    prefetched keys, its last error and its finished compaction jobs,
//!    the chunks of a disk read, the read buffers kept between a
//!    checkpoint's files (`format::files`), an arena's pages asked for
//!    ahead (`table::storage::ahead`: held by the populate thread for one
//!    `madvise`, inside the binding's call lock, and by the arena to give
//!    memory back) and the populate thread's queue (held to send), the
//!    binding's output buffer pool, a mapped table's version (held to
//!    clone or swap an `Arc`; the old version is dropped after), its
//!    retired versions (held to push or take the list; dropped after), and a
//!    mapped file's checksum check
//!    (`mapped`: a `OnceLock` whose one checker computes a CRC and runs the
//!    loader's checks of the file on its own thread, with no pool work and
//!    no lock, so a pool job that waits for it waits for neither: its scans
//!    once ran on the pool, and the checker, waiting for a block another
//!    thread took, ran a job that waited for its own check).
//!
//! A load's reader thread (`format::files::for_each_file`) holds no lock
//! while it reads a file (it takes a read buffer under its leaf lock), and
//! the pool threads that wait for its next file on the channel between
//! them hold none either.
//!
//! The rule behind the order: no thread waits for pool work while holding a
//! lock that a pool job might wait for. Gates are never taken inside a job,
//! and a whole call never runs as a job (the binding runs it on the calling
//! thread), so a worker blocked in one call cannot hold up another.
//! Python-side locks (a `DeviceCache`'s) come before all of these: they are
//! held across native calls, never taken by native code. The GIL is not in
//! the order: native code waits for locks only with the GIL released; the
//! one call run with it held (the binding's `runtime::EnterStore::enter_store_now`,
//! for `try_lookup_now`) only tries the call lock, the gate, the shard locks
//! and the memo's lock.
//!
//! ## Determinism
//! A new row's values are a pure function of (seed, key, column)
//! ([`init`]), and a step sums a key's duplicate gradients in batch order, so
//! results do not depend on the number of shards or threads.

#![deny(unsafe_op_in_unsafe_fn)]
// What the binding, the tests and the benches use is `pub`; the rest is
// `pub(crate)`.
#![warn(unreachable_pub)]

pub mod curve;
pub mod error;
pub mod format;
pub mod hash;
pub(crate) mod huge;
pub mod init;
pub mod latency;
pub mod mapped;
pub mod optim;
pub(crate) mod par;
pub mod partition;
pub mod policy;
pub(crate) mod record;
pub mod rows;
pub mod simd;
pub mod slots;
pub mod strings;
pub mod table;
#[cfg(test)]
pub(crate) mod testing;
pub mod tier;
pub mod unique;
pub mod vocab;
pub mod zeroed;

pub use error::{Result, StoreError};
pub use init::Initializer;
pub use mapped::{MappedStats, MappedTable, WarmReport};
pub use optim::Optimizer;
pub use policy::{Admission, Eviction, Policy, RowFormat};
pub use rows::Missing;
pub use simd::{Backend, Isa};
pub use table::step::collection;
pub use table::{Bags, Combiner, DiskConfig, DiskStats, Stats, Table, TableConfig};
