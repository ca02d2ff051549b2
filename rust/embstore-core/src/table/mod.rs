//! The sharded table: every row this process owns.
//!
//! A batch call hashes its keys once, groups their positions by shard
//! (a stable counting sort), and processes the shards in parallel on the
//! rayon pool; each shard's lock is taken once per call, and nothing in the
//! per-key loop takes a lock or touches an atomic. Rows are read and written
//! only under their shard's lock, so a concurrent reader sees a row wholly
//! before or wholly after an update.

mod arena;
pub mod checkpoint;
mod dirlock;
mod pages;
mod pooled;
mod shard;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crossbeam_utils::CachePadded;
use rayon::prelude::*;

use crate::error::{Result, StoreError, invalid, oom};
use crate::hash::{key_hash, shard_of};
use crate::init::Initializer;
use crate::optim::Optimizer;
use crate::policy::{Admission, Counters, Meta, Policy, RowFormat, Sketch};
use crate::simd::{Backend, copy_streaming, prefetch, stream_fence};
pub use pooled::{Bags, Combiner, pool_rows, spread_pooled};
use shard::Shard;

/// What a lookup returns for a key that has no row and gets none.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum Missing<'a> {
    /// The row the initializer would give the key (a pure function of
    /// seed, key and column), as before a first training step.
    #[default]
    Init,
    /// Zeros (serving: an unknown id contributes nothing to a sum).
    Zeros,
    /// This row (`dim` floats).
    Row(&'a [f32]),
}

/// Outputs at least this large are written with non-temporal stores
/// ([`SharedOut::streams`]).
pub(crate) const STREAM_MIN_BYTES: usize = 8 << 20;

/// The largest step count a table reaches (`i64::MAX`: steps travel as
/// signed 64-bit integers through MPI and JSON readers). A gradient call on
/// a table at this step is refused instead of wrapping to 0.
pub const MAX_STEP: u64 = i64::MAX as u64;

/// The most shards a table may have.
pub const MAX_SHARDS: usize = 1 << 16;

/// How a [`Table`] is built.
#[derive(Debug, Clone)]
pub struct TableConfig {
    /// Columns per row (>= 1).
    pub dim: usize,
    /// The optimizer, or `None` for a table that is only read and assigned.
    pub optimizer: Option<Optimizer>,
    /// How new rows are filled.
    pub initializer: Initializer,
    /// Seed of the initializer's streams.
    pub seed: u64,
    /// Number of shards; `None` picks `(available_parallelism * 4).next_power_of_two()`.
    pub num_shards: Option<usize>,
    /// SIMD backend; `None` reads `EMBSTORE_SIMD` or picks the best supported.
    pub backend: Option<Backend>,
    /// Row format, admission and eviction.
    pub policy: Policy,
}

impl TableConfig {
    /// A config with defaults for everything but `dim`.
    pub fn new(dim: usize) -> Self {
        TableConfig {
            dim,
            optimizer: None,
            initializer: Initializer::default(),
            seed: 0,
            num_shards: None,
            backend: None,
            policy: Policy::default(),
        }
    }
}

/// The default number of shards: four per core, a power of two.
pub fn default_num_shards() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores * 4).next_power_of_two()
}

/// A batch's keys grouped by shard.
#[derive(Debug)]
pub(crate) struct Plan {
    hashes: Vec<u64>,
    /// Positions in the batch, grouped by shard, in batch order within a shard.
    order: Vec<u32>,
    /// `order[starts[s]..starts[s + 1]]` are shard `s`'s positions.
    starts: Vec<usize>,
}

impl Plan {
    fn positions(&self, s: usize) -> &[u32] {
        &self.order[self.starts[s]..self.starts[s + 1]]
    }
}

/// What the last lookup found: its keys' plan, and the row of each
/// of the plan's positions, shard by shard, with each shard's removal count
/// at the time. A gradient call on exactly these keys (the backward of that
/// lookup, in a training step) takes the rows from here instead of probing
/// the index again, for every shard that has removed nothing since
/// ([`Shard::removals`]); the others are probed as usual.
struct Memo {
    plan: Plan,
    /// Per shard: the rows of `plan.positions(s)` (`u32::MAX`: no row).
    rows: Vec<Vec<u32>>,
    /// Per shard: its removal count when `rows` was found.
    removals: Vec<u64>,
}

impl std::fmt::Debug for Memo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Memo({} keys)", self.keys_len())
    }
}

impl Memo {
    /// Bytes held: 16 per key of the lookup (hash, position, row).
    fn bytes(&self) -> usize {
        let p = &self.plan;
        p.hashes.capacity() * 8
            + p.order.capacity() * 4
            + p.starts.capacity() * 8
            + self.rows.iter().map(|r| r.capacity() * 4).sum::<usize>()
            + self.removals.capacity() * 8
    }

    fn keys_len(&self) -> usize {
        self.plan.hashes.len()
    }

    /// Whether the rows kept for shard `s` are still its rows (it removed
    /// nothing since, and they are of `n` positions).
    fn valid_for(&self, s: usize, g: &Shard, n: usize) -> bool {
        self.removals[s] == g.removals && self.rows[s].len() == n
    }

    /// Whether this memo is of exactly `keys` (compared through their
    /// hashes: the key hash is a bijection).
    fn is_of(&self, keys: &[i64]) -> bool {
        keys.len() == self.keys_len()
            && keys
                .par_iter()
                .zip(&self.plan.hashes)
                .with_min_len(1 << 14)
                .all(|(&k, &h)| key_hash(k) == h)
    }
}

/// What [`Table::reserve_plan`] did for one shard.
#[derive(Debug, Default)]
pub(crate) struct Reserved {
    /// Rows reserved (pending until the call's pass over the shard).
    n: usize,
    /// The rows of the shard's positions, when it probed for them, and the
    /// shard's removal count then: still right while that has not changed.
    /// Taken (not copied) by the one job of the call's pass over the shard.
    probed: std::sync::Mutex<Option<(Vec<u32>, u64)>>,
}

impl Reserved {
    /// The probed rows, if still valid for shard `g` (taken out: one use).
    fn rows_for(&self, g: &Shard) -> Option<Vec<u32>> {
        let probed = self
            .probed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match probed {
            Some((rows, removals)) if removals == g.removals => Some(rows),
            _ => None,
        }
    }
}

/// A gradient call's plan with room made for its new rows
/// ([`Table::prepare_apply`]): the last lookup's memo when it was of the
/// same keys, else a fresh plan.
#[derive(Debug)]
pub(crate) struct PreparedApply {
    memo: std::result::Result<Memo, Plan>,
    /// What was reserved per shard ([`Table::reserve_plan`]).
    reserved: Vec<Reserved>,
}

impl PreparedApply {
    fn plan(&self) -> &Plan {
        match &self.memo {
            Ok(m) => &m.plan,
            Err(p) => p,
        }
    }
}

/// Lookups of more ids than this keep no [`Memo`] (at 16 bytes per id, at
/// most 64 MiB are kept).
const MEMO_MAX_KEYS: usize = 1 << 22;

/// Per shard, where a lookup's shard pass leaves its rows and the shard's
/// removal count for the [`Memo`].
type Found = Vec<std::sync::Mutex<(Vec<u32>, u64)>>;

/// A raw pointer to an output buffer that shards fill in parallel, each
/// writing only the rows of its own batch positions. Row `i` starts at
/// `i * stride + col` (a Collection writes each feature into its columns of
/// one wide array).
///
/// Invariant: `ptr` is valid for writes of `len` floats for the lifetime of
/// the call that created it, and no two writers receive the same row.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut {
    ptr: *mut f32,
    len: usize,
    stride: usize,
    col: usize,
}

// SAFETY: a `SharedOut` is only used to write disjoint rows (one batch
// position or bag belongs to exactly one writer), so sending it to other
// threads cannot produce overlapping writes.
unsafe impl Send for SharedOut {}
// SAFETY: as for `Send`: concurrent users write disjoint rows only.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// Rows of `dim` floats packed back to back in `out`.
    pub(crate) fn new(out: &mut [f32], dim: usize) -> Self {
        Self::strided(out, dim, 0)
    }

    /// Rows of `stride` floats in `out`, writing columns `col..col + dim`.
    pub(crate) fn strided(out: &mut [f32], stride: usize, col: usize) -> Self {
        SharedOut {
            ptr: out.as_mut_ptr(),
            len: out.len(),
            stride,
            col,
        }
    }

    /// The same buffer, writing from column `col`.
    pub(crate) fn with_col(self, col: usize) -> Self {
        SharedOut { col, ..self }
    }

    /// Whether rows should be written with non-temporal stores: the output
    /// is larger than the caches ([`STREAM_MIN_BYTES`]), so its lines would
    /// be evicted before anyone reads them, and streaming them saves reading
    /// each line into cache before it is overwritten.
    pub(crate) fn streams(&self) -> bool {
        self.len * 4 >= STREAM_MIN_BYTES
    }

    /// The flat offset of row `i`, column `col` (for [`SharedOut::at`]).
    pub(crate) fn offset(&self, i: usize, col: usize) -> usize {
        i * self.stride + col
    }

    /// The `dim` floats from flat offset `off`.
    ///
    /// # Safety
    /// No other live reference may cover them (one writer per output row).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn at(&self, off: usize, dim: usize) -> &mut [f32] {
        assert!(off + dim <= self.len, "output row out of range");
        // SAFETY: in bounds by the assert; exclusive by this function's
        // contract; the buffer outlives the call (type invariant).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), dim) }
    }

    /// The `dim` floats of output row `i`.
    ///
    /// # Safety
    /// No other live reference may cover row `i`: each row is handed to
    /// exactly one writer (the shard that owns the key, or the bag's task).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn row(&self, i: usize, dim: usize) -> &mut [f32] {
        let start = i * self.stride + self.col;
        assert!(
            self.col + dim <= self.stride && start + dim <= self.len,
            "output row out of range"
        );
        // SAFETY: in bounds by the assert; exclusive by this function's
        // contract; the buffer outlives the call (type invariant).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), dim) }
    }
}

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
    /// Float words of a row's weights (`dim`, or half that for 16-bit rows).
    wwords: usize,
    /// The call clock: every call that touches rows advances it by one, and
    /// the rows it touches record it (LRU recency).
    tick: AtomicU64,
    shards: Box<[CachePadded<RwLock<Shard>>]>,
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
    last_save: checkpoint::LastSave,
    /// The last lookup's rows, for the gradient call that follows it.
    memo: std::sync::Mutex<Option<Memo>>,
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
    /// Event counts: lookups, hits, misses, inserts, admitted, rejected,
    /// evicted (see [`Counters`]).
    pub counters: [u64; 7],
    /// Bytes of the admission sketch (included in `bytes`).
    pub sketch_bytes: usize,
}

fn read(lock: &RwLock<Shard>) -> RwLockReadGuard<'_, Shard> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write(lock: &RwLock<Shard>) -> RwLockWriteGuard<'_, Shard> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

/// Fails with the flat index of the first non-finite value.
pub fn check_finite(arg: &'static str, data: &[f32]) -> Result<()> {
    check_finite_max(arg, data).map(|_| ())
}

/// The summed gradient of one key may not exceed this in magnitude: beyond
/// it the squared-gradient state of Adagrad, Adam and FTRL overflows
/// float32 (1e18 squared is 1e36, float32's largest value about 3.4e38).
pub const MAX_GRAD_SUM: f64 = 1e18;

/// [`check_finite`] that also returns the largest magnitude in `data`.
pub fn check_finite_max(arg: &'static str, data: &[f32]) -> Result<f32> {
    const CHUNK: usize = 1 << 16;
    // A branch-free scan that vectorizes: the largest magnitude's bits; an
    // exponent of all ones is NaN/inf.
    let most = |c: &[f32]| {
        c.iter()
            .fold(0u32, |acc, v| acc.max(v.to_bits() & 0x7FFF_FFFF))
    };
    let top = data
        .par_chunks(CHUNK)
        .map(most)
        .reduce(|| 0, std::cmp::Ord::max);
    if top < 0x7F80_0000 {
        return Ok(f32::from_bits(top));
    }
    let bad = |c: &[f32]| c.iter().any(|v| !v.is_finite());
    let first_bad_chunk = data.par_chunks(CHUNK).position_first(bad);
    match first_bad_chunk {
        None => Ok(f32::from_bits(top)),
        Some(c) => {
            let start = c * CHUNK;
            let offset = data[start..]
                .iter()
                .position(|v| !v.is_finite())
                .expect("the chunk holds a non-finite value");
            Err(StoreError::NonFinite {
                arg,
                index: start + offset,
            })
        }
    }
}

/// Refuses a gradient call whose summed gradient of some key would exceed
/// [`MAX_GRAD_SUM`] in magnitude. Position `i` of `keys` contributes at most
/// `bound(i)` to each column of its key's sum; `max_bound` bounds them all.
/// Cheap when `max_bound * keys.len()` is within the limit (always, for
/// gradients of any sane size); else exact per key.
///
/// # Errors
/// `InvalidArgument` naming `arg` and the key.
pub(crate) fn check_grad_sums(
    arg: &'static str,
    keys: &[i64],
    max_bound: f64,
    bound: impl Fn(usize) -> f64 + Sync,
) -> Result<()> {
    if max_bound * keys.len() as f64 <= MAX_GRAD_SUM {
        return Ok(());
    }
    let mut sums: Vec<(i64, f64)> = keys
        .par_iter()
        .enumerate()
        .map(|(i, &k)| (k, bound(i)))
        .collect();
    sums.par_sort_unstable_by_key(|p| p.0);
    let mut j = 0;
    while j < sums.len() {
        let key = sums[j].0;
        let mut total = 0.0f64;
        while j < sums.len() && sums[j].0 == key {
            total += sums[j].1;
            j += 1;
        }
        if total > MAX_GRAD_SUM {
            return Err(invalid(
                arg,
                format!(
                    "the gradients of key {key} sum to up to {total:e} in magnitude, more than \
                     {MAX_GRAD_SUM:e} (the optimizer state would overflow float32); nothing changed"
                ),
            ));
        }
    }
    Ok(())
}

/// Batches of more keys than this check, before they start, that the
/// memory of their per-key work arrays is available (below it the check
/// would cost more than it could save).
const TRANSIENT_CHECK_KEYS: usize = 1 << 20;

/// Bytes of per-key work arrays a batch call may hold at once (plan,
/// positions, rows found, coefficients).
const TRANSIENT_BYTES_PER_KEY: usize = 40;

/// Refuses a batch of `n` keys whose work arrays do not fit in the memory
/// available (an allocation that fails would abort the process).
///
/// # Errors
/// `OutOfMemory` naming `arg`.
pub(crate) fn check_transient(arg: &'static str, n: usize) -> Result<()> {
    if n < TRANSIENT_CHECK_KEYS {
        return Ok(());
    }
    let need = n.saturating_mul(TRANSIENT_BYTES_PER_KEY);
    match pages::available_memory() {
        Some(avail) if need > avail => Err(oom(arg, need)),
        _ => Ok(()),
    }
}

pub(crate) fn check_len(arg: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(StoreError::ShapeMismatch { arg, expected, got })
    }
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
        let backend = match cfg.backend {
            Some(b) if b.supported() => b,
            Some(b) => {
                return Err(invalid(
                    "backend",
                    format!("{} is not supported by this CPU", b.name()),
                ));
            }
            None => Backend::from_env()?,
        };
        let state_len = cfg.optimizer.map_or(0, |o| o.state_len(cfg.dim));
        let policy = cfg.policy;
        let wwords = policy.format.words(cfg.dim);
        let stride = wwords + state_len;
        let track = policy.tracks();
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
                    stride, track, sketch,
                ))))
            })
            .collect::<Result<_>>()?;
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
            wwords,
            tick: AtomicU64::new(0),
            shards,
            gate: RwLock::new(()),
            generation: AtomicU32::new(1),
            last_save: std::sync::Mutex::new(None),
            memo: std::sync::Mutex::new(None),
        })
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
    /// The memory policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }
    /// The call clock (see [`Meta::tick`]).
    pub fn clock(&self) -> u64 {
        self.tick.load(Ordering::Acquire)
    }
    /// Sets the call clock (used when restoring a table).
    pub(crate) fn set_clock(&self, tick: u64) {
        self.tick.store(tick, Ordering::Release);
    }
    /// Whether a lookup changes the table (inserts rows or records touches),
    /// so that it must take the gate.
    pub(crate) fn lookup_changes(&self, insert: bool) -> bool {
        (insert && self.policy.admission.is_always()) || self.policy.tracks()
    }
    /// Advances the call clock; returns this call's tick.
    fn next_tick(&self) -> u64 {
        self.tick.fetch_add(1, Ordering::AcqRel) + 1
    }
    /// Float words of a row's weights.
    pub(crate) fn weight_words(&self) -> usize {
        self.wwords
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| read(s).len()).sum()
    }

    /// Whether the table holds no row.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows, bytes and per-shard rows.
    pub fn stats(&self) -> Stats {
        let mut shard_rows = Vec::with_capacity(self.shards.len());
        let mut bytes = std::mem::size_of::<Self>()
            + self.shards.len() * std::mem::size_of::<CachePadded<RwLock<Shard>>>();
        let mut counters = [0u64; 7];
        let mut sketch_bytes = 0;
        for s in self.shards.iter() {
            let g = read(s);
            shard_rows.push(g.len());
            bytes += g.bytes();
            sketch_bytes += g.sketch.as_ref().map_or(0, Sketch::bytes);
            for (a, b) in counters.iter_mut().zip(g.counters.get()) {
                *a += b;
            }
        }
        bytes += self
            .memo
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, Memo::bytes);
        Stats {
            rows: shard_rows.iter().sum(),
            bytes,
            shard_rows,
            step: self.step(),
            counters,
            sketch_bytes,
        }
    }

    /// Fills a new row (weights from the initializer, state from the optimizer).
    #[inline]
    fn fill_new(&self, key: i64, row: &mut [f32]) {
        let (w, state) = row.split_at_mut(self.wwords);
        if self.policy.format == RowFormat::F32 {
            self.initializer.fill_with(self.backend, self.seed, key, w);
        } else {
            SCRATCH.with_borrow_mut(|tmp| {
                tmp.resize(self.dim, 0.0);
                self.initializer
                    .fill_with(self.backend, self.seed, key, tmp);
                self.policy.format.encode(tmp, w);
            });
        }
        if let Some(o) = &self.optimizer {
            o.init_state(state);
        }
    }

    /// What a lookup returns for a key without a row, into `dst` (`dim`
    /// floats): the row the key would get (rounded to the row format), zeros
    /// or the caller's default row.
    #[inline]
    pub(crate) fn fill_missing(&self, key: i64, dst: &mut [f32], missing: Missing<'_>) {
        match missing {
            Missing::Init => {
                self.initializer
                    .fill_with(self.backend, self.seed, key, dst);
                self.policy.format.round(dst);
            }
            Missing::Zeros => dst.fill(0.0),
            Missing::Row(row) => dst.copy_from_slice(row),
        }
    }

    /// Checks a lookup's default for missing keys: a given row has `dim`
    /// finite floats.
    pub(crate) fn check_missing(&self, missing: Missing<'_>) -> Result<()> {
        if let Missing::Row(row) = missing {
            check_len("default", self.dim, row.len())?;
            if row.iter().any(|v| !v.is_finite()) {
                return Err(invalid("default", "expected finite values"));
            }
        }
        Ok(())
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

    /// The weights of `row` as floats: the row itself for float32 rows,
    /// else decoded into `tmp`.
    #[inline]
    pub(crate) fn weights<'a>(&self, row: &'a [f32], tmp: &'a mut [f32]) -> &'a [f32] {
        if self.policy.format == RowFormat::F32 {
            &row[..self.dim]
        } else {
            self.read_weights(row, tmp);
            tmp
        }
    }

    /// Hashes `keys` and groups their positions by shard.
    fn plan(&self, keys: &[i64]) -> Plan {
        let n_shards = self.shards.len();
        let hashes: Vec<u64> = keys
            .par_iter()
            .with_min_len(1 << 14)
            .map(|&k| key_hash(k))
            .collect();
        let mut shard_ids: Vec<u32> = Vec::with_capacity(keys.len());
        let mut counts = vec![0usize; n_shards + 1];
        for &h in &hashes {
            let s = shard_of(h, n_shards);
            shard_ids.push(s as u32);
            counts[s + 1] += 1;
        }
        for s in 0..n_shards {
            counts[s + 1] += counts[s];
        }
        let starts = counts.clone();
        let mut next = counts;
        let mut order = vec![0u32; keys.len()];
        for (i, &s) in shard_ids.iter().enumerate() {
            let slot = &mut next[s as usize];
            order[*slot] = i as u32;
            *slot += 1;
        }
        Plan {
            hashes,
            order,
            starts,
        }
    }

    /// Runs `f(shard, positions)` under each shard's write lock, in parallel,
    /// for the shards that own at least one of the plan's keys; sums results.
    fn par_shards_mut<F>(&self, plan: &Plan, f: F) -> usize
    where
        F: Fn(&mut Shard, &[u32]) -> usize + Sync,
    {
        self.par_shards_mut_below(plan, SEQUENTIAL_KEYS, f)
    }

    /// [`Table::par_shards_mut`] that runs on the calling thread for plans
    /// of at most `sequential` keys.
    fn par_shards_mut_below<F>(&self, plan: &Plan, sequential: usize, f: F) -> usize
    where
        F: Fn(&mut Shard, &[u32]) -> usize + Sync,
    {
        if plan.hashes.len() <= sequential {
            // A small call: on the calling thread, only the shards it needs.
            return (0..self.shards.len())
                .filter_map(|s| {
                    let pos = plan.positions(s);
                    (!pos.is_empty()).then(|| f(&mut write(&self.shards[s]), pos))
                })
                .sum();
        }
        self.shards
            .par_iter()
            .enumerate()
            .map(|(s, lock)| {
                let pos = plan.positions(s);
                if pos.is_empty() {
                    0
                } else {
                    f(&mut write(lock), pos)
                }
            })
            .sum()
    }

    /// Makes room, in every shard that owns some of the plan's keys, for
    /// the rows the call may create ([`Shard::reserve_pending`]): a call
    /// that may insert does this before it changes anything, so that
    /// running out of memory refuses it whole. A shard with room for all its
    /// positions counts them as pending without a probe; one without counts
    /// its absent keys (from `memo`, the last lookup's rows, when they are
    /// still valid; else by a probe, whose rows the call's own pass then
    /// reuses) and makes room for those. Each shard's count is given back by
    /// the call's pass over that shard ([`Shard::release_pending`]) or by
    /// [`Table::release_plan`].
    ///
    /// # Errors
    /// `OutOfMemory` naming `arg`; nothing is reserved then.
    fn reserve_plan(
        &self,
        plan: &Plan,
        keys: &[i64],
        memo: Option<&Memo>,
        arg: &'static str,
    ) -> Result<Vec<Reserved>> {
        // Per shard: what was reserved, or None when that failed. A small
        // batch stays on the calling thread (a pool dispatch would cost
        // more than taking a few locks).
        let one = |(s, lock): (usize, &CachePadded<RwLock<Shard>>)| {
            let pos = plan.positions(s);
            let mut r = Reserved::default();
            if pos.is_empty() {
                return Some(r);
            }
            let mut g = write(lock);
            r.n = if g.has_room(pos.len()) {
                pos.len()
            } else if let Some(m) = memo.filter(|m| m.valid_for(s, &g, pos.len())) {
                m.rows[s].iter().filter(|&&x| x == u32::MAX).count()
            } else {
                let mut rows = Vec::new();
                g.find_many(keys, &plan.hashes, pos, &mut rows);
                let missing = rows.iter().filter(|&&x| x == u32::MAX).count();
                r.probed = std::sync::Mutex::new(Some((rows, g.removals)));
                missing
            };
            g.reserve_pending(r.n).ok()?;
            Some(r)
        };
        let done: Vec<Option<Reserved>> = if plan.hashes.len() < SMALL_BATCH {
            self.shards.iter().enumerate().map(one).collect()
        } else {
            self.shards.par_iter().enumerate().map(one).collect()
        };
        if done.iter().all(Option::is_some) {
            return Ok(done.into_iter().map(Option::unwrap_or_default).collect());
        }
        // Give back what the shards that succeeded reserved.
        let counts: Vec<Reserved> = done.into_iter().map(Option::unwrap_or_default).collect();
        self.release_plan(&counts);
        let row = self.wwords + self.state_len;
        Err(oom(
            arg,
            (plan.hashes.len() as u128) * (row as u128 * 4 + 24),
        ))
    }

    /// The rows of a shard's positions, creating those of absent keys: from
    /// the reservation's probe when it is still valid (only the absent keys
    /// are probed again), else by probing them all.
    fn rows_inserting(
        &self,
        g: &mut Shard,
        keys: &[i64],
        plan: &Plan,
        pos: &[u32],
        reserved: &Reserved,
        save_gen: u32,
    ) -> Vec<u32> {
        let fill = |key, row: &mut [f32]| self.fill_new(key, row);
        match reserved.rows_for(g) {
            Some(mut rows) => {
                g.insert_missing(keys, &plan.hashes, pos, save_gen, fill, &mut rows);
                rows
            }
            None => {
                let mut rows = Vec::new();
                g.find_or_insert_many(keys, &plan.hashes, pos, save_gen, fill, &mut rows);
                rows
            }
        }
    }

    /// Ends the reservations of [`Table::reserve_plan`] without inserting
    /// (a call that reserved and then stopped).
    pub(crate) fn release_plan(&self, reserved: &[Reserved]) {
        for (lock, r) in self.shards.iter().zip(reserved) {
            if r.n > 0 {
                write(lock).release_pending(r.n);
            }
        }
    }

    /// As [`Self::par_shards_mut`], under read locks.
    fn par_shards<F>(&self, plan: &Plan, f: F)
    where
        F: Fn(&Shard, &[u32]) + Sync,
    {
        if plan.hashes.len() <= SEQUENTIAL_KEYS {
            // A small call: on the calling thread, only the shards it needs.
            for (s, lock) in self.shards.iter().enumerate() {
                let pos = plan.positions(s);
                if !pos.is_empty() {
                    f(&read(lock), pos);
                }
            }
            return;
        }
        self.shards.par_iter().enumerate().for_each(|(s, lock)| {
            let pos = plan.positions(s);
            if !pos.is_empty() {
                f(&read(lock), pos);
            }
        });
    }

    fn check_batch(keys: &[i64]) -> Result<()> {
        if keys.len() > u32::MAX as usize {
            return Err(invalid(
                "keys",
                format!(
                    "expected at most 2^32 - 1 keys per call, got {}",
                    keys.len()
                ),
            ));
        }
        check_transient("keys", keys.len())
    }

    /// Writes the rows of `keys` into `out` (`keys.len() * dim` floats).
    /// With `insert` (and no admission filter), missing keys get a new row
    /// from the initializer; otherwise `out` gets the initializer's row and
    /// nothing is stored.
    ///
    /// # Errors
    /// `ShapeMismatch` when `out` has the wrong length.
    pub fn lookup(&self, keys: &[i64], insert: bool, out: &mut [f32]) -> Result<()> {
        self.lookup_or(keys, insert, Missing::Init, out)
    }

    /// [`Table::lookup`] whose keys without a row (not inserted) read as
    /// `missing` instead of the initializer's row.
    ///
    /// # Errors
    /// `ShapeMismatch` when `out` or a default row has the wrong length; a
    /// non-finite default row.
    pub fn lookup_or(
        &self,
        keys: &[i64],
        insert: bool,
        missing: Missing<'_>,
        out: &mut [f32],
    ) -> Result<()> {
        Self::check_batch(keys)?;
        self.check_missing(missing)?;
        let dim = self.dim;
        check_len("out", keys.len() * dim, out.len())?;
        let plan = self.plan(keys);
        let out = SharedOut::new(out, dim);
        let _gate = self.lookup_changes(insert).then(|| self.enter());
        let found = self.found();
        self.lookup_rows(keys, &plan, insert, Some(&found), |g, pos, rows| {
            self.copy_rows(&g.arena, keys, pos, rows, out, missing);
        })?;
        self.remember(plan, found);
        if insert {
            self.enforce_capacity();
        }
        Ok(())
    }

    /// Empty [`Found`] slots, one per shard.
    pub(crate) fn found(&self) -> Found {
        (0..self.shards.len()).map(|_| Default::default()).collect()
    }

    /// Keeps what a lookup found as the [`Memo`] for the gradient call that
    /// follows it (replacing the previous one).
    pub(crate) fn remember(&self, plan: Plan, found: Found) {
        let mut slot = self.memo.lock().unwrap_or_else(PoisonError::into_inner);
        if plan.hashes.len() > MEMO_MAX_KEYS {
            // A bulk lookup (filling a table, say) is no training step: keep
            // nothing rather than 16 bytes per id.
            let old = slot.take();
            drop(slot);
            drop(old);
            return;
        }
        drop(slot);
        let (rows, removals) = found
            .into_iter()
            .map(|m| m.into_inner().unwrap_or_else(PoisonError::into_inner))
            .unzip();
        let memo = Memo {
            plan,
            rows,
            removals,
        };
        *self.memo.lock().unwrap_or_else(PoisonError::into_inner) = Some(memo);
    }

    /// The memo of exactly `keys`, taken out (a gradient call uses it once).
    /// The comparison runs on the pool, so it runs outside the lock; a memo
    /// of other keys goes back unless a newer one has arrived meanwhile.
    fn take_memo(&self, keys: &[i64]) -> Option<Memo> {
        let slot = || self.memo.lock().unwrap_or_else(PoisonError::into_inner);
        let memo = slot().take()?;
        if memo.is_of(keys) {
            return Some(memo);
        }
        let mut s = slot();
        if s.is_none() {
            *s = Some(memo);
        }
        None
    }

    /// [`Table::lookup`] that also writes each key's optimizer state to
    /// `state` (`keys.len() * state_len` floats): for a tier in front of the
    /// table (a device cache) that takes rows over with their state. A key
    /// without a row gets the optimizer's initial state.
    ///
    /// # Errors
    /// `ShapeMismatch` when `out` or `state` has the wrong length.
    pub fn lookup_with_state(
        &self,
        keys: &[i64],
        insert: bool,
        out: &mut [f32],
        state: &mut [f32],
    ) -> Result<()> {
        Self::check_batch(keys)?;
        let (dim, sl, ww) = (self.dim, self.state_len, self.wwords);
        check_len("out", keys.len() * dim, out.len())?;
        check_len("state", keys.len() * sl, state.len())?;
        let plan = self.plan(keys);
        let out = SharedOut::new(out, dim);
        let st_out = SharedOut::new(state, sl);
        let _gate = self.lookup_changes(insert).then(|| self.enter());
        self.lookup_rows(keys, &plan, insert, None, |g, pos, rows| {
            self.copy_rows(&g.arena, keys, pos, rows, out, Missing::Init);
            if sl == 0 {
                return;
            }
            for (&i, &r) in pos.iter().zip(rows) {
                // SAFETY: position i belongs to this shard only (plan).
                let dst = unsafe { st_out.row(i as usize, sl) };
                match (r, &self.optimizer) {
                    (u32::MAX, Some(o)) => o.init_state(dst),
                    (u32::MAX, None) => {}
                    _ => dst.copy_from_slice(&g.arena.row(r as usize)[ww..]),
                }
            }
        })?;
        if insert {
            self.enforce_capacity();
        }
        Ok(())
    }

    /// Inserts or overwrites rows with their optimizer state (`keys.len() *
    /// state_len` floats): the inverse of [`Table::lookup_with_state`].
    ///
    /// # Errors
    /// `ShapeMismatch`, `NonFinite`; nothing changed.
    pub fn assign_state(&self, keys: &[i64], values: &[f32], state: &[f32]) -> Result<()> {
        self.assign_with_state(keys, values, Some(state), self.generation())
    }

    /// The shard pass of a lookup: resolves the row of each of the plan's
    /// keys (creating missing ones when `insert` and no admission filter;
    /// else `u32::MAX`), records the touches when rows carry metadata, hands
    /// each shard's positions and rows to `emit`, and counts. The caller
    /// holds the gate when [`Table::lookup_changes`].
    fn lookup_rows<F>(
        &self,
        keys: &[i64],
        plan: &Plan,
        insert: bool,
        found: Option<&Found>,
        emit: F,
    ) -> Result<()>
    where
        F: Fn(&Shard, &[u32], &[u32]) + Sync,
    {
        let n = self.shards.len();
        let keep = |g: &Shard, pos: &[u32], rows: Vec<u32>| {
            if let Some(found) = found {
                let s = shard_of(plan.hashes[pos[0] as usize], n);
                *found[s].lock().unwrap_or_else(PoisonError::into_inner) = (rows, g.removals);
            }
        };
        let insert = insert && self.policy.admission.is_always();
        let track = self.policy.tracks();
        let reserved = if insert {
            self.reserve_plan(plan, keys, None, "keys")?
        } else {
            Vec::new()
        };
        if insert || track {
            let save_gen = self.generation();
            let (tick, step) = if track {
                (self.next_tick(), self.step())
            } else {
                (0, 0)
            };
            self.par_shards_mut(plan, |g, pos| {
                let len0 = g.len();
                // Resolve every row first (independent probes overlap their
                // cache misses); `emit` then reads them with prefetching.
                let mut rows = Vec::new();
                let s = shard_of(plan.hashes[pos[0] as usize], n);
                if insert {
                    rows = self.rows_inserting(g, keys, plan, pos, &reserved[s], save_gen);
                } else {
                    g.find_many(keys, &plan.hashes, pos, &mut rows);
                }
                if track {
                    for &r in &rows {
                        if r != u32::MAX {
                            g.arena.touch(r as usize, tick, step, 1);
                        }
                    }
                }
                emit(g, pos, &rows);
                self.count_lookups(g, pos.len(), &rows, len0);
                keep(g, pos, rows);
                if insert {
                    g.release_pending(reserved[s].n);
                }
                0
            });
        } else {
            self.par_shards(plan, |g, pos| {
                let mut rows = Vec::new();
                g.find_many(keys, &plan.hashes, pos, &mut rows);
                emit(g, pos, &rows);
                self.count_lookups(g, pos.len(), &rows, g.len());
                keep(g, pos, rows);
            });
        }
        Ok(())
    }

    /// Counts a shard's part of a lookup: `rows` holds the row of each id
    /// (`u32::MAX` for none); rows at or past `len0` were created by the call.
    fn count_lookups(&self, g: &Shard, n: usize, rows: &[u32], len0: usize) {
        let hits = rows.iter().filter(|&&r| (r as usize) < len0).count();
        let c = &g.counters;
        Counters::add(&c.lookups, n);
        Counters::add(&c.hits, hits);
        Counters::add(&c.misses, n - hits);
        Counters::add(&c.inserts, g.len() - len0);
    }

    /// Copies the weights of arena row `rows[j]` to output row `pos[j]`,
    /// prefetching the rows a few steps ahead; where `rows[j]` is
    /// `u32::MAX`, writes the row key `keys[pos[j]]` would get.
    fn copy_rows(
        &self,
        arena: &arena::Arena,
        keys: &[i64],
        pos: &[u32],
        rows: &[u32],
        out: SharedOut,
        missing: Missing<'_>,
    ) {
        let (dim, ww) = (self.dim, self.wwords);
        // The row format is matched once per call, not per row.
        let copy = |decode: &dyn Fn(&[f32], &mut [f32])| {
            for j in 0..pos.len() {
                if let Some(&ahead) = rows.get(j + PREFETCH_AHEAD)
                    && ahead != u32::MAX
                {
                    prefetch(&arena.row(ahead as usize)[..ww]);
                }
                let i = pos[j] as usize;
                // SAFETY: position i belongs to this shard only (plan).
                let dst = unsafe { out.row(i, dim) };
                if rows[j] != u32::MAX {
                    decode(arena.row(rows[j] as usize), dst);
                } else {
                    self.fill_missing(keys[i], dst, missing);
                }
            }
        };
        match self.policy.format {
            RowFormat::F32 if out.streams() => {
                copy(&|row, dst| copy_streaming(dst, &row[..dim]));
                stream_fence();
            }
            RowFormat::F32 => copy(&|row, dst| dst.copy_from_slice(&row[..dim])),
            f => copy(&|row, dst| f.decode(&row[..ww], dst)),
        }
    }

    /// Whether each key has a row; `out` gets one bool per key.
    ///
    /// # Errors
    /// `ShapeMismatch` when `out` has the wrong length.
    pub fn contains(&self, keys: &[i64], out: &mut [bool]) -> Result<()> {
        Self::check_batch(keys)?;
        check_len("out", keys.len(), out.len())?;
        let plan = self.plan(keys);
        let mut found = vec![false; keys.len()];
        let shared = SharedBools(found.as_mut_ptr());
        self.par_shards(&plan, |g, pos| {
            let shared = &shared;
            for &i in pos {
                let i = i as usize;
                let hit = g.find(keys[i], plan.hashes[i]).is_some();
                // SAFETY: i < keys.len() == found.len(), and position i belongs
                // to this shard only, so no other thread writes it.
                unsafe { *shared.0.add(i) = hit };
            }
        });
        out.copy_from_slice(&found);
        Ok(())
    }

    /// Inserts or overwrites the rows of `keys` with `values` (`keys.len() *
    /// dim` floats), resetting their optimizer state. Where a key repeats,
    /// its last value wins.
    ///
    /// # Errors
    /// `ShapeMismatch` for a wrong `values` length; `NonFinite` for NaN/inf.
    pub fn assign(&self, keys: &[i64], values: &[f32]) -> Result<()> {
        self.assign_with_state(keys, values, None, self.generation())
    }

    /// [`Table::assign`] that also sets the optimizer state (`keys.len() *
    /// state_len` floats) instead of resetting it, marking the rows with
    /// save generation `save_gen`.
    pub(crate) fn assign_with_state(
        &self,
        keys: &[i64],
        values: &[f32],
        state: Option<&[f32]>,
        save_gen: u32,
    ) -> Result<()> {
        Self::check_batch(keys)?;
        let (dim, sl) = (self.dim, self.state_len);
        check_len("values", keys.len() * dim, values.len())?;
        check_finite("values", values)?;
        self.policy.format.check_fits("values", values)?;
        if let Some(st) = state {
            check_len("state", keys.len() * sl, st.len())?;
            check_finite("state", st)?;
        }
        let _gate = self.enter();
        self.assign_in(keys, values, state, None, save_gen)?;
        self.enforce_capacity();
        Ok(())
    }

    /// [`Table::assign_with_state`] on checked input, with the gate held
    /// (or the table not yet shared). With `meta` (4 words per key, see
    /// [`Meta::to_words`]) the rows get that metadata (a load); without,
    /// each occurrence of a key counts as a touch.
    pub(crate) fn assign_in(
        &self,
        keys: &[i64],
        values: &[f32],
        state: Option<&[f32]>,
        meta: Option<&[u32]>,
        save_gen: u32,
    ) -> Result<()> {
        let (dim, sl, ww) = (self.dim, self.state_len, self.wwords);
        let plan = self.plan(keys);
        let reserved = self.reserve_plan(&plan, keys, None, "keys")?;
        let n = self.shards.len();
        let track = self.policy.tracks();
        let (tick, step) = if track && meta.is_none() {
            (self.next_tick(), self.step())
        } else {
            (0, 0)
        };
        self.par_shards_mut(&plan, |g, pos| {
            let len0 = g.len();
            for &i in pos {
                let i = i as usize;
                let (r, _) = g.find_or_insert(keys[i], plan.hashes[i], save_gen, |_| {});
                g.arena.set_generation(r, save_gen);
                if track {
                    match meta {
                        Some(m) => *g.arena.meta_mut(r) = Meta::from_words(&m[i * 4..i * 4 + 4]),
                        None => g.arena.touch(r, tick, step, 1),
                    }
                }
                let row = g.arena.row_mut(r);
                self.write_weights(row, &values[i * dim..(i + 1) * dim]);
                let st = &mut row[ww..];
                match (state, &self.optimizer) {
                    (Some(src), _) => st.copy_from_slice(&src[i * sl..(i + 1) * sl]),
                    (None, Some(o)) => o.init_state(st),
                    (None, None) => {}
                }
            }
            if meta.is_none() {
                Counters::add(&g.counters.inserts, g.len() - len0);
            }
            g.release_pending(reserved[shard_of(plan.hashes[pos[0] as usize], n)].n);
            0
        });
        Ok(())
    }

    /// Makes room in the index for about `additional` more rows in total
    /// (spread over the shards), so that a bulk insert does not grow the
    /// index step by step. Row memory is left to grow as rows arrive (see
    /// [`Table::reserve_rows`] for both).
    ///
    /// # Errors
    /// `OutOfMemory` naming `rows` when the index cannot be allocated.
    pub fn try_reserve_index(&self, additional: usize) -> Result<()> {
        let n = self.shards.len();
        let per = additional / n + additional / n / 16 + 16;
        let _gate = self.enter();
        let failed = self
            .shards
            .par_iter()
            .map(|lock| write(lock).try_reserve_index(per).is_err())
            .reduce(|| false, |a, b| a || b);
        if failed {
            return Err(oom("rows", (per as u128) * (n as u128) * 8));
        }
        Ok(())
    }

    /// Makes room for `additional` more rows, spread over the shards as keys
    /// spread (each shard gets its share plus four standard deviations):
    /// index space, and row memory allocated and touched now, so that
    /// inserting that many new keys later maps no fresh memory (as
    /// HierarchicalKV and TFRA tables take their initial capacity up front).
    /// The reserved memory counts in `stats().bytes` from now on.
    ///
    /// # Errors
    /// `InvalidArgument` naming `rows` when the memory cannot be allocated;
    /// rows and keys are unchanged then.
    pub fn reserve_rows(&self, additional: usize) -> Result<()> {
        if additional == 0 {
            return Ok(());
        }
        let n = self.shards.len();
        let mean = additional.div_ceil(n);
        let per = mean + 4 * (mean as f64).sqrt().ceil() as usize;
        let row_bytes = read(&self.shards[0]).arena.row_bytes();
        let need = (per as u128) * (n as u128) * (row_bytes as u128);
        // Writers take the gate first (the crate's lock order), so that a
        // snapshot holding it exclusively never waits for this.
        let _gate = self.enter();
        if let Some(avail) = pages::available_memory()
            && need > avail as u128
        {
            return Err(invalid(
                "rows",
                format!(
                    "reserving {additional} rows needs {need} bytes, more than the \
                     {avail} bytes of memory available"
                ),
            ));
        }
        let failed = self
            .shards
            .par_iter()
            .map(|lock| write(lock).reserve_rows(per).is_err())
            .reduce(|| false, |a, b| a || b);
        if failed {
            return Err(invalid(
                "rows",
                format!("could not allocate memory for {additional} more rows"),
            ));
        }
        Ok(())
    }

    /// Removes the rows of `keys`; returns how many were present.
    ///
    /// # Errors
    /// Only for batches of more than 2^32 - 1 keys.
    pub fn remove(&self, keys: &[i64]) -> Result<usize> {
        Self::check_batch(keys)?;
        let _gate = self.enter();
        let plan = self.plan(keys);
        Ok(self.par_shards_mut(&plan, |g, pos| {
            pos.iter()
                .filter(|&&i| g.remove(keys[i as usize], plan.hashes[i as usize]))
                .count()
        }))
    }

    /// One optimizer step: the gradients of repeated keys are summed, missing
    /// keys get a row from the initializer first, every touched row takes one
    /// update, and the step counter goes up by one. `grads` holds
    /// `keys.len() * dim` floats.
    ///
    /// # Errors
    /// `NoOptimizer`, `ShapeMismatch`, `NonFinite`; in each case nothing
    /// changed.
    pub fn apply_gradients(&self, keys: &[i64], grads: &[f32]) -> Result<()> {
        self.apply_gradients_numbered(keys, grads, None)
    }

    /// Takes the next step number (the counter goes up by one) without
    /// changing any row: for a tier in front of the table that runs some
    /// rows' step itself (a device cache) and the others' here with
    /// [`Table::apply_gradients_at`], so that the table's count stays one
    /// per step whatever other threads do meanwhile.
    ///
    /// # Errors
    /// `NoOptimizer`; `InvalidArgument` naming `step` at [`MAX_STEP`].
    pub fn advance_step(&self) -> Result<u64> {
        if self.optimizer.is_none() {
            return Err(StoreError::NoOptimizer);
        }
        self.step
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                (t < MAX_STEP).then_some(t + 1)
            })
            .map(|t| t + 1)
            .map_err(|_| {
                invalid(
                    "step",
                    format!("the table is at step {MAX_STEP}, the most it can count"),
                )
            })
    }

    /// [`Table::apply_gradients`] as step number `step`, taken earlier with
    /// [`Table::advance_step`]: the counter does not move.
    ///
    /// # Errors
    /// As [`Table::apply_gradients`]; `InvalidArgument` naming `step` for 0
    /// or a step the table has not reached.
    pub fn apply_gradients_at(&self, keys: &[i64], grads: &[f32], step: u64) -> Result<()> {
        if step == 0 || step > self.step() {
            return Err(invalid(
                "step",
                format!(
                    "expected a step taken with advance_step (1..={}), got {step}",
                    self.step()
                ),
            ));
        }
        self.apply_gradients_numbered(keys, grads, Some(step))
    }

    fn apply_gradients_numbered(&self, keys: &[i64], grads: &[f32], at: Option<u64>) -> Result<()> {
        if self.optimizer.is_none() {
            return Err(StoreError::NoOptimizer);
        }
        Self::check_batch(keys)?;
        let dim = self.dim;
        check_len("grads", keys.len() * dim, grads.len())?;
        let most = check_finite_max("grads", grads)?;
        check_grad_sums("grads", keys, f64::from(most), |i| {
            f64::from(
                grads[i * dim..(i + 1) * dim]
                    .iter()
                    .fold(0.0f32, |a, v| a.max(v.abs())),
            )
        })?;
        let _gate = self.enter();
        let prepared = self.prepare_apply(keys, at.is_none())?;
        self.run_apply(keys, prepared, at, |i| {
            (&grads[i * dim..(i + 1) * dim], 1.0)
        });
        self.enforce_capacity();
        Ok(())
    }

    /// The current save generation.
    pub(crate) fn generation(&self) -> u32 {
        self.generation.load(Ordering::Acquire)
    }

    /// Takes the gate shared, for a call that changes rows.
    pub(crate) fn enter(&self) -> RwLockReadGuard<'_, ()> {
        self.gate.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// One optimizer step where position `i` of `keys` contributes
    /// `coef * grad` with `(grad, coef) = grad_of(i)`: contributions to one
    /// key are summed in batch order, then the row takes one update. Keys
    /// the admission filter refuses are dropped. The caller has checked the
    /// inputs and holds the gate, and calls [`Table::enforce_capacity`]
    /// afterwards; a table without an optimizer does nothing.
    pub(crate) fn apply_in<'g, G>(&self, keys: &[i64], grad_of: G) -> Result<()>
    where
        G: Fn(usize) -> (&'g [f32], f32) + Sync,
    {
        let prepared = self.prepare_apply(keys, true)?;
        self.run_apply(keys, prepared, None, grad_of);
        Ok(())
    }

    /// The first half of [`Table::apply_in`]: the keys' plan (the last
    /// lookup's, when it was of these keys) with room made for every row
    /// the step may create. Nothing has changed yet; a call that stops here
    /// gives the room back with [`Table::cancel_apply`].
    ///
    /// # Errors
    /// `OutOfMemory` naming `keys`.
    pub(crate) fn prepare_apply(&self, keys: &[i64], counts: bool) -> Result<PreparedApply> {
        if counts && self.step() >= MAX_STEP {
            return Err(invalid(
                "step",
                format!("the table is at step {MAX_STEP}, the most it can count"),
            ));
        }
        let always = self.policy.admission.is_always();
        let memo = if always { self.take_memo(keys) } else { None };
        let memo = match memo {
            Some(m) => Ok(m),
            None => Err(self.plan(keys)),
        };
        let plan = match &memo {
            Ok(m) => &m.plan,
            Err(p) => p,
        };
        let reserved = if self.optimizer.is_some() {
            self.reserve_plan(plan, keys, memo.as_ref().ok(), "keys")?
        } else {
            Vec::new()
        };
        Ok(PreparedApply { memo, reserved })
    }

    /// Gives back the room a [`Table::prepare_apply`] made.
    pub(crate) fn cancel_apply(&self, prepared: PreparedApply) {
        self.release_plan(&prepared.reserved);
    }

    /// The second half of [`Table::apply_in`]: the step itself.
    /// The step is number `at`, or without it the next one (the counter goes up).
    pub(crate) fn run_apply<'g, G>(
        &self,
        keys: &[i64],
        prepared: PreparedApply,
        at: Option<u64>,
        grad_of: G,
    ) where
        G: Fn(usize) -> (&'g [f32], f32) + Sync,
    {
        let Some(opt) = self.optimizer else {
            return;
        };
        let (dim, ww) = (self.dim, self.wwords);
        let t = at.unwrap_or_else(|| self.step.fetch_add(1, Ordering::AcqRel) + 1);
        let consts = opt.step_consts(t);
        let wd = opt.coupled_decay() as f32;
        let backend = self.backend;
        let save_gen = self.generation();
        let track = self.policy.tracks();
        let tick = if track { self.next_tick() } else { 0 };
        let compact = self.policy.format != RowFormat::F32;
        let always = self.policy.admission.is_always();
        let memo = prepared.memo.as_ref().ok();
        let plan = prepared.plan();
        let n = self.shards.len();
        self.par_shards_mut_below(plan, SEQUENTIAL_STEP_KEYS, |g, pos| {
            let len0 = g.len();
            // (row << 32 | position), sorted: each row's positions in batch order.
            let mut pairs: Vec<u64> = if always {
                let s = shard_of(plan.hashes[pos[0] as usize], n);
                let fill = |key, row: &mut [f32]| self.fill_new(key, row);
                let rows = match memo {
                    // The lookup's rows, still where they were: only keys it
                    // did not store need a probe.
                    Some(m) if m.valid_for(s, g, pos.len()) => {
                        let mut rows = m.rows[s].clone();
                        for (r, &i) in rows.iter_mut().zip(pos) {
                            if *r == u32::MAX {
                                let (k, h) = (keys[i as usize], plan.hashes[i as usize]);
                                *r = g.find_or_insert(k, h, save_gen, |row| fill(k, row)).0 as u32;
                            }
                        }
                        rows
                    }
                    _ => self.rows_inserting(g, keys, plan, pos, &prepared.reserved[s], save_gen),
                };
                rows.iter()
                    .zip(pos)
                    .map(|(&r, &i)| (u64::from(r) << 32) | u64::from(i))
                    .collect()
            } else {
                self.admit(g, keys, &plan.hashes, pos, t, save_gen)
            };
            pairs.sort_unstable();
            let mut acc = vec![0.0f32; dim];
            // Scratch rows: a 16-bit row decoded, a gradient plus its decay.
            let mut wtmp = vec![0.0f32; if compact { dim } else { 0 }];
            let mut decayed = vec![0.0f32; if wd != 0.0 { dim } else { 0 }];
            let mut decay = Decay {
                wd,
                g: &mut decayed,
            };
            let mut j = 0;
            // Gradient rows are random reads, and rows (in ascending order)
            // skip: keep loads of both in flight for the pairs a little
            // ahead of the one being updated.
            let mut fetched = 0;
            while j < pairs.len() {
                let r = (pairs[j] >> 32) as usize;
                let mut end = j + 1;
                while end < pairs.len() && (pairs[end] >> 32) as usize == r {
                    end += 1;
                }
                let until = (end + 2 * PREFETCH_AHEAD).min(pairs.len());
                while fetched < until {
                    prefetch(grad_of((pairs[fetched] & 0xFFFF_FFFF) as usize).0);
                    prefetch(g.arena.row((pairs[fetched] >> 32) as usize));
                    fetched += 1;
                }
                let (first, c0) = grad_of((pairs[j] & 0xFFFF_FFFF) as usize);
                let gsum: &[f32] = if end - j == 1 && c0 == 1.0 {
                    first
                } else {
                    acc.fill(0.0);
                    for &p in &pairs[j..end] {
                        let (gr, c) = grad_of((p & 0xFFFF_FFFF) as usize);
                        if c == 1.0 {
                            backend.add_assign(&mut acc, gr);
                        } else {
                            backend.axpy(&mut acc, c, gr);
                        }
                    }
                    &acc
                };
                g.arena.set_generation(r, save_gen);
                if track {
                    g.arena.touch(r, tick, t, (end - j) as u32);
                }
                let (w, state) = g.arena.row_mut(r).split_at_mut(ww);
                if compact {
                    self.apply_compact(&consts, w, state, gsum, &mut wtmp, &mut decay);
                } else {
                    let g = decay.of(backend, gsum, w);
                    consts.apply(backend, w, state, g);
                }
                j = end;
            }
            let created = g.len() - len0;
            Counters::add(&g.counters.inserts, created);
            Counters::add(&g.counters.admitted, created);
            g.release_pending(prepared.reserved[shard_of(plan.hashes[pos[0] as usize], n)].n);
            0
        });
    }

    /// One optimizer step on a 16-bit row: decode, update in float32, round
    /// back (kept out of line: float32 tables never call it).
    #[inline(never)]
    fn apply_compact(
        &self,
        consts: &crate::optim::StepConsts,
        w: &mut [f32],
        state: &mut [f32],
        gsum: &[f32],
        wtmp: &mut [f32],
        decay: &mut Decay<'_>,
    ) {
        self.policy.format.decode(w, wtmp);
        let g = decay.of(self.backend, gsum, wtmp);
        consts.apply(self.backend, wtmp, state, g);
        // A row saturates at the format's largest value instead of
        // becoming inf.
        let most = self.policy.format.max_finite();
        for v in wtmp.iter_mut() {
            *v = v.clamp(-most, most);
        }
        self.policy.format.encode(wtmp, w);
    }

    /// The (row << 32 | position) pairs of a shard's positions under an
    /// admission filter: present keys keep theirs; each missing key is
    /// counted once (per call, however often it occurs) and gets a row if
    /// the filter admits it,
    /// else its positions are dropped (counted as one rejected key). Out of
    /// line: tables without a filter never call it.
    #[inline(never)]
    fn admit(
        &self,
        g: &mut Shard,
        keys: &[i64],
        hashes: &[u64],
        pos: &[u32],
        step: u64,
        save_gen: u32,
    ) -> Vec<u64> {
        let mut pairs = Vec::with_capacity(pos.len());
        let mut missing: Vec<(i64, u32)> = Vec::new();
        for &i in pos {
            let iu = i as usize;
            match g.find(keys[iu], hashes[iu]) {
                Some(r) => pairs.push(((r as u64) << 32) | u64::from(i)),
                None => missing.push((keys[iu], i)),
            }
        }
        missing.sort_unstable();
        let mut rejected = 0;
        let mut j = 0;
        while j < missing.len() {
            let key = missing[j].0;
            let mut end = j + 1;
            while end < missing.len() && missing[end].0 == key {
                end += 1;
            }
            let ok = match self.policy.admission {
                Admission::Always => true,
                Admission::Count { min_count, .. } => {
                    let sketch = g.sketch.as_mut().expect("a count filter has a sketch");
                    sketch.add(key, 1) >= min_count
                }
                Admission::Probability { p } => Admission::draw_admits(p, self.seed, key, step),
            };
            if ok {
                let first = missing[j].1 as usize;
                let (r, _) =
                    g.find_or_insert(key, hashes[first], save_gen, |row| self.fill_new(key, row));
                pairs.extend(
                    missing[j..end]
                        .iter()
                        .map(|&(_, i)| ((r as u64) << 32) | u64::from(i)),
                );
            } else {
                rejected += 1;
            }
            j = end;
        }
        Counters::add(&g.counters.rejected, rejected);
        pairs
    }

    /// The admission sketch's estimate for each key (0 without a count
    /// filter), into `out`.
    ///
    /// # Errors
    /// `ShapeMismatch` when `out` has the wrong length.
    pub fn admission_counts(&self, keys: &[i64], out: &mut [u32]) -> Result<()> {
        Self::check_batch(keys)?;
        check_len("out", keys.len(), out.len())?;
        for (o, &k) in out.iter_mut().zip(keys) {
            let s = shard_of(key_hash(k), self.shards.len());
            *o = read(&self.shards[s])
                .sketch
                .as_ref()
                .map_or(0, |sk| sk.estimate(k));
        }
        Ok(())
    }

    /// After a call that inserted: evicts the lowest-scoring rows until at
    /// most `capacity` remain. The caller holds the gate shared.
    pub(crate) fn enforce_capacity(&self) {
        let Some(cap) = self.policy.capacity else {
            return;
        };
        let len = self.len();
        if len > cap {
            self.evict_lowest(len - cap, false);
        }
    }

    /// Removes the `k` rows of lowest eviction score; returns their keys
    /// and, with `with_rows`, their weights (in no particular order).
    fn evict_lowest(&self, k: usize, with_rows: bool) -> (Vec<i64>, Vec<f32>) {
        let ev = self.policy.eviction;
        let smallest = |v: &mut Vec<(u64, u64, i64)>| {
            if v.len() > k {
                v.select_nth_unstable(k);
                v.truncate(k);
            }
        };
        let mut cands: Vec<(u64, u64, i64)> = self
            .shards
            .par_iter()
            .flat_map_iter(|lock| {
                let g = read(lock);
                let mut v: Vec<_> = (0..g.len())
                    .map(|r| ev.score(&g.arena.meta(r), g.arena.key(r)))
                    .collect();
                smallest(&mut v);
                v
            })
            .collect();
        smallest(&mut cands);
        let keys: Vec<i64> = cands.iter().map(|c| c.2).collect();
        self.remove_evicted(&keys, with_rows)
    }

    /// Removes `keys` as evictions (counted), returning those that were
    /// present and, with `with_rows`, their weights.
    fn remove_evicted(&self, keys: &[i64], with_rows: bool) -> (Vec<i64>, Vec<f32>) {
        let dim = self.dim;
        let plan = self.plan(keys);
        let mut rows = vec![0.0f32; if with_rows { keys.len() * dim } else { 0 }];
        let mut found = vec![false; keys.len()];
        let out = SharedOut::new(&mut rows, dim);
        let flags = SharedBools(found.as_mut_ptr());
        self.par_shards_mut(&plan, |g, pos| {
            let flags = &flags;
            let mut n = 0;
            for &i in pos {
                let i = i as usize;
                if let Some(r) = g.find(keys[i], plan.hashes[i]) {
                    if with_rows {
                        // SAFETY: position i belongs to this shard only (plan).
                        self.read_weights(g.arena.row(r), unsafe { out.row(i, dim) });
                    }
                    g.remove(keys[i], plan.hashes[i]);
                    // SAFETY: i < found.len(); position i is this shard's only.
                    unsafe { *flags.0.add(i) = true };
                    n += 1;
                }
            }
            Counters::add(&g.counters.evicted, n);
            n
        });
        let mut kept_keys = Vec::new();
        let mut kept_rows = Vec::new();
        for (i, &f) in found.iter().enumerate() {
            if f {
                kept_keys.push(keys[i]);
                if with_rows {
                    kept_rows.extend_from_slice(&rows[i * dim..(i + 1) * dim]);
                }
            }
        }
        (kept_keys, kept_rows)
    }

    /// Runs the eviction policy now: removes the rows not touched for
    /// `ttl_steps` optimizer steps, then, above `capacity`, the
    /// lowest-scoring rows. Returns the evicted keys ascending and, with
    /// `with_rows`, their weights (`n * dim`) for archiving.
    pub fn evict(&self, with_rows: bool) -> (Vec<i64>, Vec<f32>) {
        let _gate = self.enter();
        let mut keys = Vec::new();
        let mut rows = Vec::new();
        if let Some(ttl) = self.policy.ttl_steps {
            let now = self.step();
            let expired: Vec<i64> = self
                .shards
                .par_iter()
                .flat_map_iter(|lock| {
                    let g = read(lock);
                    (0..g.len())
                        .filter(|&r| g.arena.meta(r).age(now) >= ttl)
                        .map(|r| g.arena.key(r))
                        .collect::<Vec<_>>()
                })
                .collect();
            (keys, rows) = self.remove_evicted(&expired, with_rows);
        }
        if let Some(cap) = self.policy.capacity {
            let len = self.len();
            if len > cap {
                let (k2, r2) = self.evict_lowest(len - cap, with_rows);
                keys.extend(k2);
                rows.extend(r2);
            }
        }
        let dim = self.dim;
        let mut order: Vec<usize> = (0..keys.len()).collect();
        order.sort_unstable_by_key(|&i| keys[i]);
        let sorted_keys = order.iter().map(|&i| keys[i]).collect();
        let sorted_rows = if with_rows {
            order
                .iter()
                .flat_map(|&i| rows[i * dim..(i + 1) * dim].iter().copied())
                .collect()
        } else {
            Vec::new()
        };
        (sorted_keys, sorted_rows)
    }

    /// Every row: keys ascending, their weights (`n * dim`), and with
    /// `with_state` their optimizer state (`n * state_len`). One consistent
    /// snapshot of one moment, even while other threads call the table.
    ///
    /// # Errors
    /// `OutOfMemory` when the copy cannot be allocated.
    pub fn export(&self, with_state: bool) -> Result<(Vec<i64>, Vec<f32>, Vec<f32>)> {
        // Exclusive gate: no call that changes rows is running or can start,
        // so the shard read locks below wait for nobody, and the parallel
        // copy under them cannot be held up by a job that needs a write lock.
        let _gate = self.gate.write().unwrap_or_else(PoisonError::into_inner);
        let guards: Vec<_> = self.shards.iter().map(|s| read(s)).collect();
        let total: usize = guards.iter().map(|g| g.len()).sum();
        let (dim, sl) = (self.dim, self.state_len);
        let need = |n: usize| -> Result<()> {
            match pages::available_memory() {
                Some(avail) if n as u128 > avail as u128 => Err(oom("with_state", n)),
                _ => Ok(()),
            }
        };
        need(total * (16 + 4 * dim + if with_state { 4 * sl } else { 0 }))?;
        let mut refs: Vec<(i64, u32, u32)> = Vec::new();
        refs.try_reserve_exact(total)
            .map_err(|_| oom("with_state", total * 16))?;
        for (s, g) in guards.iter().enumerate() {
            for r in 0..g.len() {
                refs.push((g.arena.key(r), s as u32, r as u32));
            }
        }
        refs.par_sort_unstable_by_key(|&(k, _, _)| k);
        let n = refs.len();
        let keys: Vec<i64> = refs.iter().map(|r| r.0).collect();
        let mut rows = vec![0.0f32; n * dim];
        let mut state = vec![0.0f32; if with_state { n * sl } else { 0 }];
        let ww = self.wwords;
        rows.par_chunks_mut(dim)
            .zip(refs.par_iter())
            .for_each(|(dst, &(_, s, r))| {
                self.read_weights(guards[s as usize].arena.row(r as usize), dst);
            });
        if with_state && sl > 0 {
            state
                .par_chunks_mut(sl)
                .zip(refs.par_iter())
                .for_each(|(dst, &(_, s, r))| {
                    dst.copy_from_slice(&guards[s as usize].arena.row(r as usize)[ww..]);
                });
        }
        Ok((keys, rows, state))
    }
}

/// Batches of fewer keys than this make their reservations
/// ([`Table::reserve_plan`]) on the calling thread.
const SMALL_BATCH: usize = 1 << 14;

/// Batches of at most this many keys run their shard passes (lookups,
/// pooling, assign, remove) on the calling thread, visiting only the shards
/// they need, instead of dispatching a job per shard to the pool: below it
/// the dispatch (waking pool threads, about 10 us here) costs more than the
/// work it spreads. Chosen from measurements on the 2-core CI-class VM
/// (benches/RESULTS.md, "Small calls": at 512 keys a lookup took 48-51 us
/// on the calling thread against 55-75 us spread, at 1,024 about the
/// same); several Python threads making small calls run them in parallel.
pub(crate) const SEQUENTIAL_KEYS: usize = 1024;

/// [`SEQUENTIAL_KEYS`] for the pass of an optimizer step, which does more
/// work per key (at 512 keys an Adam step of dim 64 took 153-160 us on the
/// calling thread against 131-137 us spread).
pub(crate) const SEQUENTIAL_STEP_KEYS: usize = 256;

/// How many rows ahead [`copy_rows`] prefetches.
pub(crate) const PREFETCH_AHEAD: usize = 8;

thread_local! {
    /// A row of floats for encoding new compact rows.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Like [`SharedOut`], for bools.
///
/// Invariant: the pointer is valid for the call that made it and each
/// position is written by one thread only.
struct SharedBools(*mut bool);
// SAFETY: positions are written by exactly one shard task each (plan).
unsafe impl Sync for SharedBools {}
// SAFETY: as for `Sync`.
unsafe impl Send for SharedBools {}

/// Coupled weight decay of one step: the gradient a row's update sees is
/// `g + wd * w` ([`crate::optim::Optimizer::coupled_decay`]).
struct Decay<'a> {
    wd: f32,
    /// Scratch of `dim` floats (empty when `wd` is 0).
    g: &'a mut [f32],
}

impl Decay<'_> {
    /// The gradient to apply to row `w` whose summed gradient is `gsum`.
    #[inline]
    fn of<'s>(&'s mut self, backend: Backend, gsum: &'s [f32], w: &[f32]) -> &'s [f32] {
        if self.wd == 0.0 {
            return gsum;
        }
        self.g.copy_from_slice(gsum);
        backend.axpy(self.g, self.wd, w);
        self.g
    }
}
