//! The sharded table: every row this process owns.
//!
//! A batch call hashes its keys once, groups their positions by shard
//! (a stable counting sort), and processes the shards in parallel on the
//! rayon pool; a writer takes each shard's lock once per call, and nothing
//! in its per-key loop takes a lock. Rows are written only under their
//! shard's lock; serving reads take no lock and copy each row under its
//! version check (`storage::seqlock`), so a concurrent reader sees a row
//! wholly before or wholly after an update.
//!
//! The concepts, one folder or file each: `storage` (shards, their index
//! and arena), `read` (the plan of a batch, lookups, pooled lookups,
//! export), `step` (rows found earlier, preparing and applying a step, the
//! bounds that keep it finite, the Collection step), `write` (assign,
//! reserve, remove), `policy` (TTL and capacity eviction), [`checkpoint`],
//! and the checks and counters every call shares.

/// Declares a view of a table for one concern (checkpoint writing, the
/// disk tier, eviction, a step's phases, ...): a `Copy` wrapper of a
/// `&Table` whose methods are that concern's helpers, so that the
/// [`Table`] itself is a facade of the public calls and the few helpers
/// every concern shares. A view reads the table's fields and shared
/// helpers through `Deref`; it is made where needed, `View(table)`.
macro_rules! table_view {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Clone, Copy)]
        pub(crate) struct $name<'a>(pub(crate) &'a crate::table::Table);

        impl std::ops::Deref for $name<'_> {
            type Target = crate::table::Table;
            fn deref(&self) -> &crate::table::Table {
                self.0
            }
        }
    };
}

pub(crate) mod batch;
pub mod checkpoint;
pub(crate) mod checks;
pub(crate) mod cold;
pub(crate) mod compaction;
mod config;
pub(crate) mod counters;
mod figures;
mod lowest;
mod policy;
pub(crate) mod read;
pub mod records;
pub(crate) mod step;
pub(crate) mod storage;
mod stored;
pub(crate) mod views;
mod write;

use crate::error::{Result, invalid, oom};
use crate::init::Initializer;
use crate::optim::Optimizer;
use crate::policy::{Admission, Policy, Sketch};
use crate::simd::Backend;
use batch::found::Memo;
use counters::Counters;
use crossbeam_utils::CachePadded;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{PoisonError, RwLock, RwLockReadGuard};

/// A table's shards, each behind its lock.
pub(crate) type Shards = std::sync::Arc<[CachePadded<RwLock<Shard>>]>;
/// Each shard's readers' view.
pub(crate) type Views = std::sync::Arc<[CachePadded<std::sync::Arc<storage::view::View>>]>;
use step::bounds::Bounds;
use storage::{Shard, read};

pub use crate::format::{MAX_SHARDS, MAX_STEP};
pub use crate::rows::Missing;
pub(crate) use crate::rows::{NO_ROW, NewRows};
pub use batch::bags::{Bags, Combiner};
pub use checks::{MAX_GRAD_SUM, check_finite, check_finite_max};
pub use cold::spill::take_disk_reports;
pub use cold::{DiskConfig, DiskStats};
pub use compaction::{Work, set_background_runner};
pub use config::{TableConfig, default_num_shards};
pub use counters::{COUNTER_NAMES, NamedCounts};
pub use read::export::Exported;
pub use read::pooled::{pool_rows, pool_rows_into};
pub use records::Records;
pub use step::bounds::Magnitudes;
pub use step::pooled::{spread_pooled, spread_pooled_add};

/// Sharded hash table from int64 keys to rows of `dim` floats plus optimizer
/// state.
#[derive(Debug)]
pub struct Table {
    /// Unique in the process, in creation order: the order in which a call
    /// on several tables takes their gates (see the crate's lock order).
    id: u64,
    dim: usize,
    state_len: usize,
    optimizer: Option<Optimizer>,
    initializer: Initializer,
    seed: u64,
    backend: Backend,
    step: AtomicU64,
    policy: Policy,
    /// The most rows kept ([`Policy::capacity_rows`]).
    capacity: Option<usize>,
    /// Float words of a row's weights (`dim`, or half that for 16-bit rows).
    wwords: usize,
    /// The call clock: every call that touches rows advances it by one, and
    /// the rows it touches record it (LRU recency).
    tick: AtomicU64,
    /// Shared with a disk table's spill job (`table/cold/spill.rs`).
    shards: Shards,
    /// Each shard's readers' view (its index and rows, read without its
    /// lock: `storage::seqlock`).
    views: Views,
    /// Taken shared by every call that changes rows, on the calling thread,
    /// and exclusively by [`Table::export`] for a snapshot of one moment.
    /// Never taken inside a rayon job, and no shard lock is held across a
    /// rayon call, so a worker blocked on a lock never holds up a job that
    /// would release it.
    gate: RwLock<()>,
    /// The save generation: rows changed now are marked with it, and a save
    /// moves it on (incremental checkpoints write the rows of one generation).
    generation: AtomicU32,
    /// Where this table was last saved (incremental saves continue there).
    last_save: crate::format::manifest::LastSave,
    /// The last lookup's rows, for the gradient call that follows it.
    memo: std::sync::Mutex<Option<Memo>>,
    /// The rows a capacity eviction takes next (`lowest`).
    lowest: std::sync::Mutex<Option<lowest::Lowest>>,
    /// Bounds on the magnitudes the rows hold (see `bounds`).
    bounds: Bounds,
    /// A disk table's disk tier (`cold`); dropped after the shards.
    cold: Option<std::sync::Arc<cold::Cold>>,
    /// Latencies of lookup calls, as the binding records them.
    latency: crate::latency::Latency,
}

/// A table's figures, as `stats()` reports them.
#[derive(Debug, Clone)]
pub struct Stats {
    /// Rows held.
    pub rows: usize,
    /// Bytes held by rows, keys and index.
    pub bytes: usize,
    /// Rows of each shard.
    pub shard_rows: Vec<usize>,
    /// Optimizer steps taken.
    pub step: u64,
    /// Event counts by name: lookups, hits, misses, inserts, admitted,
    /// rejected, evicted (see `Counters`).
    pub counters: NamedCounts,
    /// Bytes of the admission sketch (included in `bytes`).
    pub sketch_bytes: usize,
    /// Of `bytes`, the key indexes' allocations (the rest besides the
    /// next two: each row's tag, policy metadata, the sketch, the last
    /// lookup's plan kept for its backward, the rows a capacity eviction
    /// takes next, the table itself).
    pub index_bytes: usize,
    /// Of `bytes`, the rows' weights as stored (for 16- and 8-bit rows,
    /// their bytes, scale and offset included).
    pub weights_bytes: usize,
    /// Of `bytes`, the rows' optimizer state.
    pub state_bytes: usize,
}

impl Table {
    /// Builds an empty table.
    ///
    /// # Errors
    /// `InvalidArgument` for `dim < 1`, a bad shard count, bad optimizer or
    /// initializer parameters, or an unknown `EMBSTORE_SIMD`.
    pub fn new(cfg: TableConfig) -> Result<Table> {
        if cfg.dim < 1 || cfg.dim > (1 << 20) {
            return Err(invalid(
                "dim",
                format!("expected 1 <= dim <= 1048576, got {}", cfg.dim),
            ));
        }
        let num_shards = cfg.num_shards.unwrap_or_else(default_num_shards);
        if !(1..=MAX_SHARDS).contains(&num_shards) {
            return Err(invalid(
                "num_shards",
                format!("expected 1 <= num_shards <= {MAX_SHARDS}, got {num_shards}"),
            ));
        }
        if let Some(opt) = &cfg.optimizer {
            opt.validate()?;
        }
        cfg.initializer.validate()?;
        cfg.policy.validate()?;
        let most = cfg.policy.format.max_finite();
        if cfg.initializer.max_abs() > f64::from(most) {
            return Err(invalid(
                "initializer",
                format!(
                    "expected values that {} rows hold (|v| <= {most}), got an initializer \
                     writing values up to {}",
                    cfg.policy.format.name(),
                    cfg.initializer.max_abs()
                ),
            ));
        }
        if cfg.optimizer.is_none() {
            if cfg.policy.ttl_steps.is_some() {
                return Err(invalid(
                    "ttl_steps",
                    "expected a table with an optimizer (a row's age is counted in optimizer steps)",
                ));
            }
            if !cfg.policy.admission.is_always() {
                return Err(invalid(
                    "admission",
                    "expected a table with an optimizer (admission counts gradient sightings)",
                ));
            }
        }
        // A `Backend` is supported by this CPU by construction.
        let backend = match cfg.backend {
            Some(b) => b,
            None => Backend::from_env()?,
        };
        let state_len = cfg.optimizer.map_or(0, |o| o.state_len(cfg.dim));
        let policy = cfg.policy;
        let wwords = policy.format.words(cfg.dim);
        // A disk table scores rows by their touches to choose those that
        // go to disk.
        let track = policy.tracks() || cfg.disk.is_some();
        let capacity = policy.capacity_rows(wwords, state_len);
        if capacity == Some(0) {
            return Err(invalid(
                "capacity_bytes",
                format!(
                    "expected at least one row's {} bytes (weights, optimizer state, metadata, \
                     tag and index slot), got {}",
                    policy.row_cost(wwords, state_len),
                    policy.capacity_bytes.unwrap_or(0)
                ),
            ));
        }
        let shards = (0..num_shards)
            .map(|_| {
                let sketch = match policy.admission {
                    Admission::Count { width, depth, .. } => {
                        let w = width.div_ceil(num_shards);
                        let sk = Sketch::try_new(w, depth).ok_or_else(|| {
                            oom("admission", (width as u128).saturating_mul(depth as u128))
                        })?;
                        Some(sk)
                    }
                    _ => None,
                };
                Ok(CachePadded::new(RwLock::new(Shard::new(
                    wwords, state_len, track, sketch,
                ))))
            })
            .collect::<Result<Shards>>()?;
        let views = shards
            .iter()
            .map(|s| CachePadded::new(read(s).view()))
            .collect();
        let cold = cfg
            .disk
            .as_ref()
            .map(|d| cold::Cold::for_shards(d, &policy, &shards, wwords, state_len))
            .transpose()?
            .map(std::sync::Arc::new);
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Ok(Table {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            dim: cfg.dim,
            state_len,
            optimizer: cfg.optimizer,
            initializer: cfg.initializer,
            seed: cfg.seed,
            backend,
            step: AtomicU64::new(0),
            policy,
            capacity,
            wwords,
            tick: AtomicU64::new(0),
            shards,
            views,
            gate: RwLock::new(()),
            generation: AtomicU32::new(1),
            last_save: std::sync::Mutex::default(),
            memo: std::sync::Mutex::new(None),
            lowest: std::sync::Mutex::new(None),
            bounds: Bounds::new(Magnitudes::initial(
                cfg.optimizer.as_ref(),
                cfg.initializer.max_abs(),
            )),
            cold,
            latency: crate::latency::Latency::default(),
        })
    }

    /// Latencies of this table's lookup calls (recorded by the caller that
    /// times them: the binding, around each lookup and pooled lookup).
    pub fn lookup_latency(&self) -> &crate::latency::Latency {
        &self.latency
    }

    /// The most rows this table keeps (`capacity`, and `capacity_bytes`
    /// over [`Table::row_cost`]); `None`: no bound.
    pub fn capacity_rows(&self) -> Option<usize> {
        self.capacity
    }

    /// The bytes a row counts for under `capacity_bytes`
    /// ([`Policy::row_cost`]).
    pub fn row_cost(&self) -> usize {
        self.policy.row_cost(self.wwords, self.state_len)
    }

    /// This table's id: unique in the process, ascending in creation
    /// order. Calls that take several tables' gates take them by ascending id.
    pub fn id(&self) -> u64 {
        self.id
    }
    /// Columns per row.
    pub fn dim(&self) -> usize {
        self.dim
    }
    /// Floats of optimizer state per row.
    pub fn state_len(&self) -> usize {
        self.state_len
    }
    /// The optimizer.
    pub fn optimizer(&self) -> Option<&Optimizer> {
        self.optimizer.as_ref()
    }
    /// The initializer.
    pub fn initializer(&self) -> &Initializer {
        &self.initializer
    }
    /// The initializer's seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }
    /// The SIMD backend in use.
    pub fn backend(&self) -> Backend {
        self.backend
    }
    /// Number of shards.
    pub fn num_shards(&self) -> usize {
        self.shards.len()
    }
    /// Optimizer steps taken.
    pub fn step(&self) -> u64 {
        self.step.load(Ordering::Acquire)
    }
    /// Sets the step counter (used when restoring a table).
    ///
    /// # Errors
    /// `InvalidArgument` naming `step` above [`MAX_STEP`].
    pub fn set_step(&self, step: u64) -> Result<()> {
        if step > MAX_STEP {
            return Err(invalid(
                "step",
                format!("expected 0 <= step <= {MAX_STEP}, got {step}"),
            ));
        }
        self.step.store(step, Ordering::Release);
        Ok(())
    }
    /// The config that builds an empty table like this one (its shard
    /// count and backend as they are).
    pub fn config(&self) -> TableConfig {
        TableConfig {
            dim: self.dim,
            optimizer: self.optimizer,
            initializer: self.initializer,
            seed: self.seed,
            num_shards: Some(self.num_shards()),
            backend: Some(self.backend),
            policy: self.policy,
            disk: self.disk().cloned(),
        }
    }
    /// The memory policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }
    /// Upper bounds on the magnitudes the table holds (and the lowest
    /// accumulator), as its steps' non-finite checks use them.
    pub fn magnitudes(&self) -> Magnitudes {
        self.bounds.get()
    }
    /// The call clock (see [`Meta::tick`](crate::policy::Meta::tick)).
    pub fn clock(&self) -> u64 {
        self.tick.load(Ordering::Acquire)
    }
    /// Sets the call clock (used when restoring a table).
    pub(crate) fn set_clock(&self, tick: u64) {
        self.tick.store(tick, Ordering::Release);
    }
    /// Whether a lookup changes the table (inserts rows), so that it must
    /// take the gate; a serving lookup's touches are counted without it
    /// ([`Table::record_reads`]).
    pub(crate) fn lookup_changes(&self, insert: bool) -> bool {
        self.inserts(insert)
    }
    /// Whether a lookup asked to `insert` stores rows: only without an
    /// admission filter (with one, only gradient calls admit keys).
    pub(crate) fn inserts(&self, insert: bool) -> bool {
        insert && self.policy.admission.is_always()
    }
    /// After a serving call on a table whose rows carry metadata (TTL or
    /// capacity): counts each key read as a touch of its row, without
    /// waiting: a shard whose write lock is free has them counted now, a
    /// shard a writer holds has them queued on its view for the lock's next
    /// holder ([`storage::shard::Reads`]). Nothing for other tables.
    pub(crate) fn record_reads(&self, keys: &[i64], plan: &batch::plan::Plan) {
        if !self.tracks() {
            return;
        }
        let (tick, step) = (self.next_tick(), self.policy.age_clock(self.step()));
        for (s, lock) in self.shards.iter().enumerate() {
            let pos = plan.positions(s);
            if pos.is_empty() {
                continue;
            }
            let key_of = |&i: &u32| (keys[i as usize], plan.hashes[i as usize]);
            if let Some(mut g) = storage::try_write(lock) {
                g.count_reads();
                for (key, hash) in pos.iter().map(key_of) {
                    if let Some(r) = g.find(key, hash) {
                        g.touch(r, tick, step, 1);
                    }
                }
                continue;
            }
            // Queued for the lock's next holder; without the memory for
            // the queue entry, these reads go uncounted (touches are a
            // hint to eviction, never worth an abort).
            if let Ok(mut queued) = crate::zeroed::with_room("keys", pos.len()) {
                queued.extend(pos.iter().map(key_of));
                self.views[s].queue_reads(storage::view::Reads {
                    tick,
                    step,
                    keys: queued,
                });
            }
        }
    }

    /// Counts every shard's queued serving reads ([`Table::record_reads`])
    /// before the caller reads the rows' metadata (eviction, export, save),
    /// taking each such shard's write lock briefly. On the calling thread,
    /// holding no shard lock.
    pub(crate) fn count_queued_reads(&self) {
        storage::count_queued_reads(&self.shards, &self.views);
    }

    /// Advances the call clock; returns this call's tick.
    /// Whether rows record their touches: for a TTL or capacity policy,
    /// or a disk table (which moves the rows touched least to disk).
    pub(crate) fn tracks(&self) -> bool {
        self.policy.tracks() || self.cold.is_some()
    }
    fn next_tick(&self) -> u64 {
        self.tick.fetch_add(1, Ordering::AcqRel) + 1
    }
    /// Float words of a row's stored weights ([`RowFormat::words`]).
    pub fn weight_words(&self) -> usize {
        self.wwords
    }

    /// What a key without a row becomes in this table ([`NewRows`]).
    #[inline]
    pub(crate) fn new_rows(&self) -> NewRows<'_> {
        NewRows {
            initializer: &self.initializer,
            backend: self.backend,
            seed: self.seed,
            format: self.policy.format,
        }
    }

    /// Fills a new row: its weights as stored ([`NewRows::store`]), its
    /// state from the optimizer.
    #[inline]
    fn fill_new(&self, key: i64, w: &mut [f32], state: &mut [f32]) {
        self.new_rows().store(key, self.dim, w);
        if let Some(o) = &self.optimizer {
            o.init_state(state);
        }
    }

    /// [`Table::fill_new`] of a row the arena has just pushed, whose
    /// weights and state are zeros ([`Shard::find_or_insert`]): a state
    /// that starts at zero is left as it is (an Adam row's 512 bytes of
    /// state at dim 64 are not written again).
    #[inline]
    fn fill_pushed(&self, key: i64, w: &mut [f32], state: &mut [f32]) {
        self.new_rows().store(key, self.dim, w);
        if let Some(o) = &self.optimizer
            && !o.state_starts_zero()
        {
            o.init_state(state);
        }
    }

    /// What a lookup returns for a key without a row, into `dst` (`dim`
    /// floats): its new row (rounded to the row format), zeros or the
    /// caller's default row.
    #[inline]
    pub(crate) fn fill_missing(&self, key: i64, dst: &mut [f32], missing: Missing<'_>) {
        missing.fill(&self.new_rows(), key, dst);
    }

    /// Checks a lookup's default for missing keys ([`Missing::check`]).
    pub(crate) fn check_missing(&self, missing: Missing<'_>) -> Result<()> {
        missing.check(self.dim)
    }

    /// Writes the weights of arena row `row` (all its words) to `dst`.
    #[inline]
    pub(crate) fn read_weights(&self, row: &[f32], dst: &mut [f32]) {
        self.policy.format.decode(&row[..self.wwords], dst);
    }

    /// Stores `src` as the weights of arena row `row`.
    #[inline]
    pub(crate) fn write_weights(&self, row: &mut [f32], src: &[f32]) {
        self.policy.format.encode(src, &mut row[..self.wwords]);
    }

    /// The current save generation.
    pub(crate) fn generation(&self) -> u32 {
        self.generation.load(Ordering::Acquire)
    }

    /// Takes the gate shared, for a call that changes rows.
    pub(crate) fn enter(&self) -> Entered<'_> {
        Entered(self.gate.read().unwrap_or_else(PoisonError::into_inner))
    }
}

/// A writer call's hold of its table's gate ([`Table::enter`]). On
/// release, on the calling thread and outside any parallel job, it frees
/// what the call's writers replaced (an index grown, a segment emptied) once
/// no reader can hold it (`storage::memory::reclaim_pending`), so resident
/// memory follows `stats()["bytes"]` when the call returns.
pub(crate) struct Entered<'a>(#[allow(dead_code)] RwLockReadGuard<'a, ()>);

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        storage::memory::reclaim_pending();
    }
}
