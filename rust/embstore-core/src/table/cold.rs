//! A disk table: at most `memory_bytes` of rows (with their state) in
//! memory, the rest on disk ([`storage::cold`](super::storage::cold)), so
//! one machine holds and trains a table larger than its memory.
//!
//! The disk tier is a floor under the table, not a guard each call must
//! remember: a call gets its keys' plan only from [`Table::plan`], which
//! for a disk table takes the table's *cold gate* shared and moves the
//! rows its keys have on disk into memory ([`DiskTier::stand`]) with the plan
//! the call then uses (each key is planned once). It reads them all at
//! once, from many threads, so that the device's queue is kept full, and
//! the call then runs as on a table in memory. When the call ends (its
//! plan dropped) and memory holds more rows than `memory_bytes` allows,
//! the rows that scored lowest for the table's eviction order (LFU by
//! default: fewest touches) go to disk, under the cold gate taken
//! exclusively, so that no call ever finds a row gone between moving it in
//! and using it. Rows keep their bits, optimizer
//! state, touch counts and save generation wherever they are: a disk table
//! gives the rows an in-memory table gives for the same calls, and its
//! incremental saves write what changed.
//!
//! Lock order: the cold gate comes first, before the table's gate and any
//! shard lock; it is taken on the calling thread only, never in a rayon
//! job, and a call on several tables takes theirs by ascending table id.

use crate::table::views::DiskTier;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use rayon::prelude::*;

use crate::error::{Result, invalid, oom};
use crate::record::read_all;
use crate::table::Table;
use crate::table::batch::plan::{Floor, Plan, Planned};
use crate::table::compaction::{Compaction, lock, trim_heap};
use crate::table::storage::cold::{ColdShard, KeyHasher, Loc};
use crate::table::storage::disk_dir::StoreDir;
use crate::table::storage::tier::{RecordBatch, RecordSource};
use crate::table::storage::{read, write};
use std::collections::HashMap;
use std::hash::BuildHasherDefault;

mod handoff;
pub(crate) mod hold;
#[cfg(test)]
pub(crate) mod slow_tier;
pub(crate) mod spill;

use hold::ColdHold;

/// Where a disk table keeps the rows that are not in memory, and how much
/// memory its rows may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskConfig {
    /// A directory (created if missing) under which the table makes its
    /// own directory of segment files, removed when the table is dropped.
    pub path: PathBuf,
    /// Bytes of rows kept in memory, each row counted at
    /// [`Table::row_cost`](super::Table::row_cost).
    pub memory_bytes: u64,
}

/// Keys with the round of moving rows out they came in at.
type Rounds = HashMap<i64, u64, BuildHasherDefault<KeyHasher>>;

/// Rows touched by this many of the latest calls are moved to disk last.
const RECENT_CALLS: u64 = 2;

/// Keys a disk table's lookup takes at a time at the least
/// ([`DiskTier::cold_piece`]).
const MIN_PIECE: usize = 4096;

/// The state of a disk table (see the module's docs).
#[derive(Debug)]
pub(crate) struct Cold {
    pub(crate) gate: RwLock<()>,
    /// The process that made the table's files: a `fork()`ed child's copy
    /// refuses calls (its moves would write and delete its parent's files).
    pid: u32,
    /// Most rows in memory, per shard.
    pub(crate) shard_rows: usize,
    pub(crate) config: DiskConfig,
    /// Ids asked for by calls, and those whose rows were on disk.
    ids: AtomicU64,
    cold_ids: AtomicU64,
    /// Rows moved in from disk and out to it.
    rows_in: AtomicU64,
    rows_out: AtomicU64,
    /// The last error moving rows out (they stayed in memory).
    error: Mutex<Option<String>>,
    /// Keys a prefetch moved in, with the round of moving rows out they
    /// came in at: rows out go on without them for two rounds (the step
    /// running while they came in, and the step that uses them).
    prefetched: Mutex<(u64, Rounds)>,
    /// Compaction jobs: whether one is running, and those done.
    pub(crate) compaction: Compaction,
    /// A round of moving rows out scheduled or running (`cold/handoff.rs`):
    /// whichever thread clears it, under the gate taken exclusively, runs
    /// it.
    pub(crate) handoff: handoff::Handoff,
    /// The last round's failure until a call is told of it
    /// ([`spill::take_disk_reports`]).
    unreported: Mutex<Option<String>>,
    /// Rounds of moving rows out run, and those run on a call's thread.
    rounds: AtomicU64,
    rounds_on_calls: AtomicU64,
    /// Held for its lock and removed when the last holder goes: the
    /// table, or a compaction job still writing into it (which holds a
    /// clone while it runs, so the directory is never removed under it).
    pub(crate) dir: Arc<StoreDir>,
}

/// A disk table's figures (`stats()`).
#[derive(Debug, Clone, Default)]
pub struct DiskStats {
    /// Rows in memory.
    pub memory_rows: usize,
    /// Rows on disk.
    pub disk_rows: usize,
    /// Bytes of the segment files (live and dead records).
    pub disk_bytes: u64,
    /// Bytes of memory the on-disk rows' index takes.
    pub disk_index_bytes: usize,
    /// Ids served from memory over all ids asked for (FBGEMM's
    /// `overall_hit_rate`); 1 before any call.
    pub overall_hit_rate: f64,
    /// Rows read from disk, and written to it.
    pub rows_read: u64,
    /// Rows written to disk.
    pub rows_written: u64,
    /// Rows that compaction moved to a new segment (in the background).
    pub rows_compacted: u64,
    /// Rounds of moving rows out of memory, on the tier's thread or a
    /// call's.
    pub spill_rounds: u64,
    /// Of those, the rounds a call ran itself before it started, the
    /// tier's thread not having begun them (calls that follow each other
    /// closely: no time between them to hide the writes in).
    pub spill_rounds_on_calls: u64,
    /// The last failure to move rows to disk, if any (the rows stayed in
    /// memory; the next call tries again).
    pub error: Option<String>,
}

impl Cold {
    /// Whether this process made the table's files (not a forked child).
    pub(crate) fn owned(&self) -> bool {
        self.pid == std::process::id()
    }

    /// The disk state of a table being built, whose `shards` (not shared
    /// yet) each get their cold part: checks the settings that depend on
    /// several (a policy that drops rows is not supported on disk yet).
    pub(crate) fn for_shards(
        config: &DiskConfig,
        policy: &crate::policy::Policy,
        shards: &[crossbeam_utils::CachePadded<RwLock<crate::table::storage::Shard>>],
        wwords: usize,
        state_len: usize,
    ) -> Result<Cold> {
        if policy.capacity_bytes.is_some() {
            return Err(invalid(
                "disk",
                "expected a table without capacity_bytes: a disk table bounds its memory \
                 with memory_bytes (bound its rows with capacity)",
            ));
        }
        let row_cost = crate::policy::Policy {
            ttl_steps: Some(1),
            ..*policy
        }
        .row_cost(wwords, state_len);
        let words = wwords + state_len + 4;
        let (cold, parts) = Cold::new(config, shards.len(), row_cost, words, policy.tracks())?;
        for (lock, part) in shards.iter().zip(parts) {
            write(lock).cold = Some(Box::new(part));
        }
        Ok(cold)
    }

    /// The disk state of a table of `num_shards` shards whose rows cost
    /// `row_cost` bytes, and each shard's cold part (records of `words`;
    /// `metas`: keeping each row's metadata in memory, for eviction).
    fn new(
        config: &DiskConfig,
        num_shards: usize,
        row_cost: usize,
        words: usize,
        metas: bool,
    ) -> Result<(Cold, Vec<ColdShard>)> {
        let rows = config.memory_bytes / row_cost as u64;
        if rows < num_shards as u64 {
            return Err(invalid(
                "memory_bytes",
                format!(
                    "expected room for at least one row a shard ({num_shards} x {row_cost} \
                     bytes), got {}",
                    config.memory_bytes
                ),
            ));
        }
        let dir = StoreDir::create(&config.path)?;
        let shards = (0..num_shards)
            .map(|s| ColdShard::new(&dir.path, s, words, metas))
            .collect();
        let cold = Cold {
            gate: RwLock::new(()),
            shard_rows: usize::try_from(rows / num_shards as u64).unwrap_or(usize::MAX),
            config: config.clone(),
            ids: AtomicU64::new(0),
            cold_ids: AtomicU64::new(0),
            rows_in: AtomicU64::new(0),
            rows_out: AtomicU64::new(0),
            error: Mutex::new(None),
            prefetched: Mutex::default(),
            compaction: Compaction::default(),
            handoff: handoff::Handoff::new(),
            unreported: Mutex::new(None),
            rounds: AtomicU64::new(0),
            rounds_on_calls: AtomicU64::new(0),
            pid: std::process::id(),
            dir: Arc::new(dir),
        };
        Ok((cold, shards))
    }
}

/// A row on disk that a call needs.
struct Want {
    pos: usize,
    key: i64,
    loc: Loc,
    file: Arc<dyn RecordSource>,
}

impl Table {
    /// Moves the rows of `keys` that this disk table holds on disk into
    /// memory now (nothing for a table in memory), for a prefetch thread:
    /// they stay in memory for the next two rounds of moving rows out,
    /// whatever their score, so that the call that needs them (the next
    /// step of a training loop) finds them there. The ids do not count for
    /// the hit rate.
    ///
    /// # Errors
    /// As [`DiskTier::stand`] (the call that needs the rows meets the
    /// failure again).
    pub fn prefetch_now(&self, keys: &[i64]) -> Result<()> {
        let Some(c) = &self.cold else {
            return Ok(());
        };
        if !c.owned() {
            return Err(crate::table::storage::cold::forked());
        }
        {
            let mut p = c.prefetched.lock().unwrap_or_else(PoisonError::into_inner);
            let round = p.0;
            p.1.extend(keys.iter().map(|&k| (k, round)));
        }
        let plan = self.plan(keys, Floor::InPlace);
        spill::leave_for_the_next_call(c);
        let plan = plan?;
        DiskTier(self).fault_in(c, keys, &plan, false)
    }

    /// A disk table's figures; `None` for a table in memory.
    pub fn disk_stats(&self) -> Option<DiskStats> {
        let c = self.cold.as_ref()?;
        // The figures of the table settled: a scheduled round of moving
        // rows out is run (or waited for) first.
        if c.owned() {
            DiskTier(self).settle_spill(c);
        }
        let mut st = DiskStats::default();
        for lock in self.shards.iter() {
            let g = read(lock);
            st.memory_rows += g.len();
            if let Some(cs) = &g.cold {
                st.disk_rows += cs.len();
                st.disk_bytes += cs.stored_bytes();
                st.disk_index_bytes += cs.index_bytes();
            }
        }
        let ids = c.ids.load(Ordering::Relaxed);
        let cold = c.cold_ids.load(Ordering::Relaxed);
        st.overall_hit_rate = if ids == 0 {
            1.0
        } else {
            1.0 - cold as f64 / ids as f64
        };
        st.rows_read = c.rows_in.load(Ordering::Relaxed);
        st.rows_written = c.rows_out.load(Ordering::Relaxed);
        st.rows_compacted = c.compaction.moved.load(Ordering::Relaxed);
        st.spill_rounds = c.rounds.load(Ordering::Relaxed);
        st.spill_rounds_on_calls = c.rounds_on_calls.load(Ordering::Relaxed);
        st.error = c
            .error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Some(st)
    }

    /// The disk table's settings; `None` for a table in memory.
    pub fn disk(&self) -> Option<&DiskConfig> {
        self.cold.as_ref().map(|c| &c.config)
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        if let Some(c) = self.cold.as_ref().filter(|c| c.owned()) {
            DiskTier(self).call_off(c);
        }
    }
}

impl<'a> DiskTier<'a> {
    /// The floor under a planned call ([`Table::plan`]; see [`Floor`]): for
    /// a disk table, the cold gate taken shared and, for a call that reads
    /// or trains rows, the rows of `keys` that are on disk moved into
    /// memory, where they stay until the plan is dropped. A table in
    /// memory, or [`Floor::Skip`], has the plan only.
    ///
    /// # Errors
    /// `Checkpoint` for a row that cannot be read or fails its check;
    /// `OutOfMemory` naming `keys`; a forked child's copy of a disk table
    /// refuses. No row changed (some may have moved into memory).
    pub(crate) fn stand(&self, plan: Plan, keys: &[i64], floor: Floor) -> Result<Planned<'a>> {
        let Some(c) = self.0.cold.as_ref().filter(|_| floor != Floor::Skip) else {
            return Ok(Planned { plan, floor: None });
        };
        if !c.owned() {
            return Err(crate::table::storage::cold::forked());
        }
        // A call starts within the bound: a round of moving rows out that
        // the tier's thread has not started yet runs here first.
        self.spill_due(c);
        spill::report_to_this_call(c);
        let hold = ColdHold::of(
            self.0,
            c.gate.read().unwrap_or_else(PoisonError::into_inner),
        );
        if floor != Floor::InPlace {
            self.fault_in(c, keys, &plan, floor == Floor::Read)?;
        }
        Ok(Planned {
            plan,
            floor: Some(hold),
        })
    }

    /// For a call over every row (a save, an export, a sweep of the
    /// policy, the list of keys): the floor held with nothing moved, so
    /// that no row crosses between memory and disk while the call reads
    /// both. `None` for a table in memory.
    pub(crate) fn rows_in_place(&self) -> Option<ColdHold<'a>> {
        let c = self.0.cold.as_ref()?;
        let guard = c.gate.read().unwrap_or_else(PoisonError::into_inner);
        Some(ColdHold::of(self.0, guard))
    }

    /// Moves the rows of `keys` on disk into memory (`plan` is theirs);
    /// `count`: the ids count for the hit rate (a call's; not a
    /// prefetch's).
    fn fault_in(&self, c: &Cold, keys: &[i64], plan: &Plan, count: bool) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        // Moving rows in writes shards: as every shard writer, under the
        // table's gate shared (an export holds it exclusively while its
        // parallel copy holds every shard's read lock).
        let _gate = self.enter();
        let found: Vec<(u64, Vec<Want>)> = self
            .shards
            .par_iter()
            .enumerate()
            .map(|(s, lock)| -> Result<(u64, Vec<Want>)> {
                let pos = plan.positions(s);
                let g = read(lock);
                let Some(cold) = g.cold.as_ref().filter(|c| c.len() > 0) else {
                    return Ok((0, Vec::new()));
                };
                // Room for every position first: a batch's list is sized
                // by its input, so its memory is asked for, not assumed.
                let mut wants = Vec::new();
                wants
                    .try_reserve_exact(pos.len())
                    .map_err(|_| oom("keys", (pos.len() * size_of::<Want>()) as u128))?;
                // A row is in memory or on disk, never both (moving it
                // either way takes it from the other side under this
                // shard's write lock), so the disk index alone says which
                // keys to bring: each key is probed once in it here, and
                // once in memory by the call.
                for &i in pos {
                    let key = keys[i as usize];
                    if let Some((loc, file)) = cold.find(key) {
                        wants.push(Want {
                            pos: i as usize,
                            key,
                            loc,
                            file,
                        });
                    }
                }
                let n = wants.len() as u64;
                wants.sort_unstable_by_key(|w| w.key);
                wants.dedup_by_key(|w| w.key);
                Ok((n, wants))
            })
            .collect::<Result<_>>()?;
        if count {
            c.ids.fetch_add(keys.len() as u64, Ordering::Relaxed);
            let cold_ids: u64 = found.iter().map(|f| f.0).sum();
            c.cold_ids.fetch_add(cold_ids, Ordering::Relaxed);
        }
        let total: usize = found.iter().map(|f| f.1.len()).sum();
        if total == 0 {
            return Ok(());
        }
        // The rows as one record batch, read outside every lock.
        let words = self.weight_words() + self.state_len + 4;
        let mut batch = RecordBatch::new(words);
        batch.words = crate::zeroed::zeros::<u32>("keys", total * words)?;
        let room = |_| oom("keys", total as u128 * 52);
        let mut list: Vec<(i64, Loc, &dyn RecordSource)> = Vec::new();
        list.try_reserve_exact(total).map_err(room)?;
        batch.keys.try_reserve_exact(total).map_err(room)?;
        batch.generations.try_reserve_exact(total).map_err(room)?;
        list.extend(
            found
                .iter()
                .flat_map(|f| f.1.iter())
                .map(|w| (w.key, w.loc, &*w.file)),
        );
        batch.keys.extend(list.iter().map(|w| w.0));
        batch
            .generations
            .extend(list.iter().map(|w| w.1.generation));
        read_all(&list, words, &mut batch.words)?;
        // Into memory, shard by shard: a row moved or taken meanwhile (by
        // another call moving it in, or a removal) is left as it is.
        let mut start = 0;
        let parts: Vec<(usize, usize, usize)> = found
            .iter()
            .enumerate()
            .map(|(s, f)| {
                let p = (s, start, f.1.len());
                start += f.1.len();
                p
            })
            .filter(|p| p.2 > 0)
            .collect();
        parts
            .par_iter()
            .try_for_each(|&(s, from, n)| -> Result<()> {
                let mut g = write(&self.shards[s]);
                if !g.make_room(n) {
                    return Err(oom("keys", (n * words * 4) as u128));
                }
                for (j, w) in found[s].1.iter().enumerate() {
                    let hash = plan.hashes[w.pos];
                    if g.find(w.key, hash).is_some() {
                        continue;
                    }
                    let taken = g.cold.as_mut().is_some_and(|cs| cs.take(w.key, w.loc));
                    if taken {
                        g.insert_moved(&batch, from + j, hash);
                    }
                }
                Ok(())
            })?;
        c.rows_in.fetch_add(total as u64, Ordering::Relaxed);
        Ok(())
    }

    /// For a disk table, the keys a lookup of `n` keys takes at a time
    /// when it cannot take them all (`None`: all at once, and always for a
    /// table in memory): about half of `memory_bytes` of rows, at least
    /// [`MIN_PIECE`] keys. A call larger than that is served in pieces,
    /// each moved in, read and moved out before the next, so a call of
    /// any size brings at most a piece's rows into memory beyond
    /// `memory_bytes`. (An inserting lookup in pieces that fails in a later
    /// piece, a row on disk that cannot be read, keeps the rows that the
    /// earlier pieces created: rows as a lookup of those keys would have
    /// created them.)
    fn cold_piece(&self, n: usize) -> Option<usize> {
        let c = self.cold.as_ref()?;
        let piece = (c.shard_rows.saturating_mul(self.shards.len()) / 2).max(MIN_PIECE);
        (n > piece).then_some(piece)
    }

    /// A call of `n` keys that [`DiskTier::cold_piece`] splits: `call` run on
    /// each piece's positions in turn, and its result (`None`: the call is
    /// taken whole, by the caller).
    pub(crate) fn in_pieces(
        &self,
        n: usize,
        mut call: impl FnMut(std::ops::Range<usize>) -> Result<()>,
    ) -> Option<Result<()>> {
        let piece = self.cold_piece(n)?;
        Some(
            (0..n)
                .step_by(piece)
                .try_for_each(|from| call(from..(from + piece).min(n))),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::manifest::SaveInfo;
    use crate::optim::Optimizer;
    use crate::table::checkpoint::LoadConfig;
    use crate::table::{Bags, Combiner, TableConfig};
    use crate::testing::temp_dir;
    use safetensors::SafeTensors;
    use std::collections::BTreeMap;
    use std::collections::HashMap;
    use std::path::Path;

    /// A load as a disk table of `num_shards` shards under `disk`.
    fn on_disk(num_shards: usize, disk: &DiskConfig) -> LoadConfig {
        LoadConfig {
            num_shards: Some(num_shards),
            disk: Some(disk.clone()),
            format: None,
        }
    }

    fn adam() -> Option<Optimizer> {
        Some(Optimizer::from_named("Adam", &BTreeMap::from([("lr".into(), 0.05)])).unwrap())
    }

    /// The tier under a disk table's memory in a test.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    enum Tier {
        /// The disk store.
        Disk,
        /// The test tier ([`slow_tier::SlowTier`]), through the trait alone.
        Slow,
    }

    fn pair(dir: &Path, memory_rows: u64) -> (Table, Table) {
        pair_on(
            dir,
            memory_rows,
            crate::policy::Policy::default(),
            Tier::Disk,
        )
    }

    /// A table in memory and its twin on `tier` with memory for
    /// `memory_rows` rows.
    fn pair_on(
        dir: &Path,
        memory_rows: u64,
        policy: crate::policy::Policy,
        tier: Tier,
    ) -> (Table, Table) {
        let mk = |disk: Option<DiskConfig>| {
            let mut cfg = TableConfig::new(5);
            cfg.optimizer = adam();
            cfg.seed = 11;
            cfg.num_shards = Some(4);
            cfg.disk = disk;
            cfg.policy = policy;
            Table::new(cfg).unwrap()
        };
        let ram = mk(None);
        // Rows cost their weights, state, metadata, tag and index slot.
        let cost = crate::policy::Policy {
            ttl_steps: Some(1),
            ..Default::default()
        }
        .row_cost(5, ram.state_len()) as u64;
        let disk = mk(Some(DiskConfig {
            path: dir.to_path_buf(),
            memory_bytes: memory_rows * cost,
        }));
        if tier == Tier::Slow {
            slow_tier::SlowTier::plug(&disk);
        }
        (ram, disk)
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn keys(&mut self, n: usize, space: u64) -> Vec<i64> {
            (0..n).map(|_| (self.next() % space) as i64 - 20).collect()
        }
        fn floats(&mut self, n: usize) -> Vec<f32> {
            (0..n)
                .map(|_| (self.next() % 2001) as f32 / 1000.0 - 1.0)
                .collect()
        }
    }

    /// The oracle is the same table in memory: every call, in a random
    /// mix, gives the same results bit for bit while a disk table with
    /// memory for 40 of its ~500 rows moves rows out and back.
    #[test]
    fn a_disk_table_gives_what_a_table_in_memory_gives() {
        gives_what_memory_gives(Tier::Disk);
    }

    #[test]
    fn a_table_over_the_slow_test_tier_gives_what_a_table_in_memory_gives() {
        gives_what_memory_gives(Tier::Slow);
    }

    fn gives_what_memory_gives(tier: Tier) {
        let dir = temp_dir("disk-table");
        let (ram, disk) = pair_on(&dir, 40, crate::policy::Policy::default(), tier);
        let mut rng = Rng(0x1234_5678_9abc_def1);
        let both = |f: &dyn Fn(&Table) -> Vec<u32>| assert_eq!(f(&ram), f(&disk));
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<u32>>();
        for round in 0..300 {
            let keys = rng.keys(48, 520);
            match round % 6 {
                0 | 1 => both(&|t| {
                    let mut out = vec![0.0; keys.len() * 5];
                    t.lookup(&keys, true, &mut out).unwrap();
                    bits(out)
                }),
                2 => {
                    let g = rng.floats(keys.len() * 5);
                    both(&|t| {
                        t.apply_gradients(&keys, &g).unwrap();
                        vec![]
                    });
                }
                3 => {
                    let offsets: Vec<i64> = (0..=keys.len() as i64).step_by(4).collect();
                    let bags = Bags {
                        ids: &keys,
                        offsets: &offsets,
                        weights: None,
                        combiner: Combiner::Mean,
                    };
                    let g = rng.floats((offsets.len() - 1) * 5);
                    both(&|t| {
                        let mut out = vec![0.0; (offsets.len() - 1) * 5];
                        t.lookup_pooled(&bags, true, &mut out).unwrap();
                        t.apply_pooled_gradients(&bags, &g).unwrap();
                        bits(out)
                    });
                }
                4 => {
                    let v = rng.floats(8 * 5);
                    both(&|t| {
                        t.assign(&keys[..8], &v).unwrap();
                        vec![t.remove(&keys[8..12]).unwrap() as u32]
                    });
                }
                _ => both(&|t| {
                    let mut out = vec![0.0; keys.len() * 5];
                    let mut found = vec![false; keys.len()];
                    t.lookup_found(&keys, crate::table::Missing::Zeros, &mut out, &mut found)
                        .unwrap();
                    let mut has = vec![false; keys.len()];
                    t.contains(&keys, &mut has).unwrap();
                    assert_eq!(found, has);
                    let mut v = bits(out);
                    v.extend(found.iter().map(|&f| u32::from(f)));
                    v.push(t.len() as u32);
                    v
                }),
            }
            let st = disk.disk_stats().unwrap();
            assert!(st.memory_rows <= 40 + 48, "round {round}: {st:?}");
            assert_eq!(st.memory_rows + st.disk_rows, ram.len());
        }
        DiskTier(&disk).settle_compaction();
        let st = disk.disk_stats().unwrap();
        assert!(st.disk_rows > 300 && st.rows_read > 1000, "{st:?}");
        assert!(st.overall_hit_rate < 0.5, "{st:?}");
        assert!(st.error.is_none());
        assert!(
            tier == Tier::Slow || st.rows_compacted > 100,
            "compacted in the background: {st:?}"
        );
        assert_eq!(export(&disk), export(&ram));
        drop(disk);
        // Removed by the last holder: the table, or a thread of its tier
        // still between rounds (which holds it for a moment).
        let start = std::time::Instant::now();
        while std::fs::read_dir(&dir).unwrap().count() > 0 && start.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "its directory went"
        );
    }

    fn train(t: &Table, rng: &mut Rng, rounds: usize) {
        for _ in 0..rounds {
            let keys = rng.keys(48, 400);
            let mut out = vec![0.0; keys.len() * 5];
            t.lookup(&keys, true, &mut out).unwrap();
            t.apply_gradients(&keys, &rng.floats(keys.len() * 5))
                .unwrap();
            t.remove(&keys[..2]).unwrap();
        }
    }

    fn export(t: &Table) -> (Vec<i64>, Vec<u32>, Vec<u32>) {
        let (k, r, s) = t.export(true).unwrap();
        let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect();
        (k, bits(r), bits(s))
    }

    /// Saves (full, then incremental) of a disk table whose rows are
    /// mostly on disk load as the table in memory they equal, into memory
    /// and as a disk table with less memory still, which trains on alike.
    #[test]
    fn a_disk_tables_saves_and_loads_hold_every_row() {
        saves_and_loads_hold_every_row(Tier::Disk);
    }

    #[test]
    fn saves_and_loads_over_the_slow_test_tier_hold_every_row() {
        saves_and_loads_hold_every_row(Tier::Slow);
    }

    fn saves_and_loads_hold_every_row(tier: Tier) {
        let (dir, ck, dir2) = (
            temp_dir("disk-save"),
            temp_dir("disk-ck"),
            temp_dir("disk-2"),
        );
        let (ram, disk) = pair_on(&dir, 40, crate::policy::Policy::default(), tier);
        for t in [&ram, &disk] {
            train(t, &mut Rng(99), 30);
        }
        assert_eq!(export(&ram), export(&disk));
        let ram_ck = temp_dir("ram-ck");
        disk.save(&ck, false, true, None).unwrap();
        ram.save(&ram_ck, false, true, None).unwrap();
        for t in [&ram, &disk] {
            train(t, &mut Rng(7), 4);
        }
        // The delta holds the rows changed since, as the table in memory's.
        let delta = |i: SaveInfo| {
            let link = i.manifest.chain.last().unwrap().clone();
            assert_eq!(link.kind, "delta");
            (
                link.files.iter().map(|f| f.rows).sum::<u64>(),
                link.removed.map(|r| r.rows),
            )
        };
        let written = delta(disk.save(&ck, true, true, None).unwrap());
        assert_eq!(written, delta(ram.save(&ram_ck, true, true, None).unwrap()));
        assert!(
            written.0 > 0 && written.0 < disk.len() as u64 / 2,
            "{written:?}"
        );
        let (back, _) = Table::load(&ck, None, None).unwrap();
        assert_eq!(export(&back), export(&ram));
        let cost = disk.row_cost() as u64;
        let small = DiskConfig {
            path: dir2.clone(),
            memory_bytes: 24 * cost,
        };
        let (back, _) = Table::load_as(&ck, None, &on_disk(4, &small), None, None).unwrap();
        let st = back.disk_stats().unwrap();
        assert!(st.memory_rows <= 24 && st.disk_rows > 200, "{st:?}");
        assert_eq!(export(&back), export(&ram));
        for t in [&ram, &back] {
            train(t, &mut Rng(5), 10);
        }
        assert_eq!(export(&back), export(&ram));
    }

    fn files_in(dir: &Path, ext: &str) -> usize {
        let mut n = 0;
        for d in std::fs::read_dir(dir).unwrap().flatten() {
            if d.path().is_dir() {
                n += files_in(&d.path(), ext);
            } else if d.path().extension().is_some_and(|e| e == ext) {
                n += 1;
            }
        }
        n
    }

    /// A checkpoint (a full link and a delta with removals) opened as a
    /// disk table of its shard count takes its files as segments: nothing
    /// in memory, nothing rewritten, every row as the table in memory's;
    /// it trains on alike while the files die and are compacted, and
    /// outlives the checkpoint's directory. Both ways of taking a file: a
    /// hard link, and the copy a checkpoint on another file system needs.
    #[test]
    fn a_checkpoint_opened_as_a_disk_table_is_served_from_its_own_files() {
        for copy in [false, true] {
            crate::table::storage::base::COPY_ONLY
                .store(copy, std::sync::atomic::Ordering::Relaxed);
            let (dir, ck, dir2) = (
                temp_dir("adopt-a"),
                temp_dir("adopt-ck"),
                temp_dir("adopt-b"),
            );
            let (ram, disk) = pair(&dir, 40);
            train(&ram, &mut Rng(3), 30);
            ram.save(&ck, false, true, None).unwrap();
            train(&ram, &mut Rng(4), 5);
            ram.save(&ck, true, true, None).unwrap();
            drop(disk);
            let cost = ram.row_cost() as u64;
            let small = DiskConfig {
                path: dir2.clone(),
                memory_bytes: 24 * cost,
            };
            let (back, _) = Table::load_as(&ck, None, &on_disk(4, &small), None, None).unwrap();
            let st = back.disk_stats().unwrap();
            assert_eq!((st.memory_rows, st.disk_rows), (0, ram.len()), "{st:?}");
            assert_eq!(files_in(&dir2, "seg"), 0, "no row rewritten");
            let adopted = files_in(&dir2, "base");
            assert_eq!(adopted, 8, "4 shards' files of two links");
            assert_eq!(export(&back), export(&ram));
            // A save reads the adopted files' columns in windows.
            let again = temp_dir("adopt-again");
            back.save(&again, false, true, None).unwrap();
            let (copy, _) = Table::load(&again, None, None).unwrap();
            assert_eq!(export(&copy), export(&ram));
            std::fs::remove_dir_all(&ck).unwrap();
            for t in [&ram, &back] {
                train(t, &mut Rng(5), 4);
            }
            // Compaction moves the live rows of half-dead adopted files.
            DiskTier(&back).settle_compaction();
            let mut half_dead = 0;
            for lock in back.shards.iter() {
                let mut g = write(lock);
                let c = g.cold.as_mut().unwrap().disk().unwrap();
                half_dead += c.half_dead_files();
                c.compact().unwrap();
                assert_eq!(c.half_dead_files(), 0);
            }
            assert!(half_dead > 0, "the test compacts adopted files");
            assert_eq!(export(&back), export(&ram));
            for t in [&ram, &back] {
                train(t, &mut Rng(6), 120);
            }
            let st = back.disk_stats().unwrap();
            assert!(st.error.is_none(), "{st:?}");
            assert!(
                files_in(&dir2, "base") < adopted,
                "dead and half-dead files went: {st:?}"
            );
            assert_eq!(export(&back), export(&ram));
        }
    }

    /// The file taken is the checkpoint's own (a hard link): a byte
    /// changed in it afterwards reads as an error naming the key, never as
    /// a row, and the other rows still read.
    #[test]
    fn a_checkpoint_file_changed_after_its_load_reads_as_an_error() {
        use std::os::unix::fs::FileExt;
        let (ck, dir2) = (temp_dir("adopt-dmg-ck"), temp_dir("adopt-dmg"));
        let (ram, _disk) = pair(&temp_dir("adopt-dmg-a"), 40);
        train(&ram, &mut Rng(3), 10);
        let info = ram.save(&ck, false, true, None).unwrap();
        let small = DiskConfig {
            path: dir2,
            memory_bytes: 24 * ram.row_cost() as u64,
        };
        let (back, _) = Table::load_as(&ck, None, &on_disk(4, &small), None, None).unwrap();
        let (keys, _, _) = ram.export(false).unwrap();
        // The last byte of the first file's first row's weights.
        let name = &info.manifest.chain[0].files[0].name;
        let bytes = std::fs::read(ck.join(name)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let k = crate::format::tensors::i64s(st.tensor("keys").unwrap().data())[0];
        let w = st.tensor("rows").unwrap().data();
        let at = (w.as_ptr() as usize - bytes.as_ptr() as usize + 5 * 4 - 1) as u64;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(ck.join(name))
            .unwrap();
        f.write_all_at(&[w[19] ^ 0x40], at).unwrap();
        let mut out = vec![0.0; 5];
        let e = back.lookup(&[k], false, &mut out).unwrap_err().to_string();
        assert!(e.contains(&format!("key {k} is damaged")), "{e}");
        let other = *keys.iter().find(|&&o| o != k).unwrap();
        let mut want = vec![0.0; 5];
        ram.lookup(&[other], false, &mut want).unwrap();
        back.lookup(&[other], false, &mut out).unwrap();
        assert_eq!(out, want);
    }

    /// A load at another shard count cannot take the files as they are:
    /// it writes the rows to segments, and gives the same table.
    #[test]
    fn a_checkpoint_opened_at_another_shard_count_is_rewritten() {
        let (dir, ck, dir2) = (
            temp_dir("adopt-3a"),
            temp_dir("adopt-3ck"),
            temp_dir("adopt-3b"),
        );
        let (ram, _disk) = pair(&dir, 40);
        train(&ram, &mut Rng(3), 20);
        ram.save(&ck, false, true, None).unwrap();
        let small = DiskConfig {
            path: dir2.clone(),
            memory_bytes: 24 * ram.row_cost() as u64,
        };
        let (back, _) = Table::load_as(&ck, None, &on_disk(3, &small), None, None).unwrap();
        assert_eq!(files_in(&dir2, "base"), 0);
        assert!(files_in(&dir2, "seg") > 0);
        assert_eq!(export(&back), export(&ram));
    }

    /// Eviction policies on a disk table evict what they evict on the
    /// table in memory, wherever the rows are: capacity (LFU and LRU,
    /// scored by the metadata kept for the rows on disk), TTL in steps
    /// (`evict`, with the evicted rows' weights), and admission, in a mix
    /// of calls; bit for bit.
    #[test]
    fn eviction_policies_on_a_disk_table_evict_what_they_evict_in_memory() {
        policies_evict_what_they_evict_in_memory(Tier::Disk);
    }

    #[test]
    fn eviction_policies_over_the_slow_test_tier_evict_what_they_evict_in_memory() {
        policies_evict_what_they_evict_in_memory(Tier::Slow);
    }

    fn policies_evict_what_they_evict_in_memory(tier: Tier) {
        use crate::policy::{Admission, Eviction, Policy};
        let policies = [
            Policy {
                capacity: Some(300),
                eviction: Eviction::Lfu,
                ..Policy::default()
            },
            Policy {
                capacity: Some(250),
                eviction: Eviction::Lru,
                ttl_steps: Some(6),
                ..Policy::default()
            },
            Policy {
                ttl_steps: Some(4),
                admission: Admission::from_named("count", &[("min_count".into(), 2.0)]).unwrap(),
                ..Policy::default()
            },
        ];
        for (n, policy) in policies.into_iter().enumerate() {
            let dir = temp_dir(&format!("disk-policy-{n}"));
            let (ram, disk) = pair_on(&dir, 40, policy, tier);
            let mut rng = Rng(0x51ed_2701 + n as u64);
            for round in 0..160 {
                let keys = rng.keys(48, 600);
                match round % 4 {
                    0 | 1 => {
                        let mut outs = [vec![0.0; 48 * 5], vec![0.0; 48 * 5]];
                        for (t, out) in [&ram, &disk].into_iter().zip(&mut outs) {
                            t.lookup(&keys, true, out).unwrap();
                        }
                        assert_eq!(outs[0], outs[1], "round {round}");
                    }
                    2 => {
                        let g = rng.floats(keys.len() * 5);
                        for t in [&ram, &disk] {
                            t.apply_gradients(&keys, &g).unwrap();
                        }
                    }
                    _ => {
                        let a = ram.evict(true);
                        let b = disk.evict(true);
                        assert_eq!(a.0, b.0, "round {round}: the keys evicted");
                        assert_eq!(a.1, b.1, "round {round}: their rows");
                    }
                }
                assert_eq!(ram.len(), disk.len(), "round {round}");
                assert_eq!(export(&ram), export(&disk), "round {round}");
            }
            let st = disk.disk_stats().unwrap();
            assert!(st.disk_rows > 100 && st.error.is_none(), "{st:?}");
            // More rows evicted than memory ever held (88 at most): most
            // of them from disk.
            let evicted: u64 = disk
                .shards
                .iter()
                .map(|s| read(s).counters().evicted.load(Ordering::Relaxed))
                .sum();
            assert!(evicted > 200, "policy {n}: {evicted} evicted");
        }
    }

    /// Threads mixing every call on one disk table (assign, lookups with
    /// and without insert, gradients, removals, prefetch, contains, full
    /// and incremental saves, exports, records read where they lie) while
    /// rows move in and out and compaction jobs run in the background:
    /// each thread reads what it last wrote to its own keys, the last save
    /// loads as the table's export, nothing fails, and nothing hangs (a
    /// watchdog).
    #[test]
    fn threads_mixing_every_call_beside_background_compaction_read_what_they_wrote() {
        threads_mixing_every_call(Tier::Disk);
    }

    #[test]
    fn threads_mixing_every_call_over_the_slow_test_tier_read_what_they_wrote() {
        threads_mixing_every_call(Tier::Slow);
    }

    fn threads_mixing_every_call(tier: Tier) {
        use std::sync::mpsc;
        use std::time::Duration;
        let (dir, ck) = (temp_dir("disk-threads"), temp_dir("disk-threads-ck"));
        let (_ram, disk) = pair_on(&dir, 30, crate::policy::Policy::default(), tier);
        let disk = Arc::new(disk);
        let (tx, rx) = mpsc::channel::<()>();
        let writers = 4;
        for t in 0..writers {
            let (d, tx) = (Arc::clone(&disk), tx.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x9e37 + t);
                let base = t as i64 * 10_000;
                let mut model: HashMap<i64, f32> = HashMap::new();
                for round in 0..300u32 {
                    let mut keys: Vec<i64> =
                        (0..16).map(|_| base + (rng.next() % 150) as i64).collect();
                    keys.sort_unstable();
                    keys.dedup();
                    let n = keys.len();
                    match round % 6 {
                        0 | 1 => {
                            let v = round as f32 + t as f32 / 8.0;
                            d.assign(&keys, &vec![v; n * 5]).unwrap();
                            model.extend(keys.iter().map(|&k| (k, v)));
                        }
                        2 => {
                            let mut out = vec![0.0; n * 5];
                            let mut found = vec![false; n];
                            d.lookup_found(
                                &keys,
                                crate::table::Missing::Zeros,
                                &mut out,
                                &mut found,
                            )
                            .unwrap();
                            for (i, k) in keys.iter().enumerate() {
                                assert_eq!(found[i], model.contains_key(k), "key {k}");
                                let want = model.get(k).copied().unwrap_or(0.0);
                                assert_eq!(out[i * 5], want, "key {k} round {round}");
                            }
                        }
                        3 => {
                            d.remove(&keys[..n.min(4)]).unwrap();
                            for k in &keys[..n.min(4)] {
                                model.remove(k);
                            }
                        }
                        4 => {
                            d.prefetch_now(&keys).unwrap();
                            let mut has = vec![false; n];
                            d.contains(&keys, &mut has).unwrap();
                            for (i, k) in keys.iter().enumerate() {
                                assert_eq!(has[i], model.contains_key(k));
                            }
                            // Records read where they lie (memory or disk).
                            let r = crate::table::Records::find(&d, &keys, &mut has).unwrap();
                            for (i, k) in keys.iter().enumerate() {
                                assert_eq!(has[i], model.contains_key(k));
                                let want = model.get(k).copied().unwrap_or(0.0);
                                assert_eq!(r.words[i * 5], want, "key {k}'s record");
                            }
                        }
                        _ => {
                            // Gradients on keys no thread reads back, and
                            // lookups that insert them.
                            let other: Vec<i64> = keys.iter().map(|k| k + 5_000).collect();
                            let mut out = vec![0.0; n * 5];
                            d.lookup(&other, true, &mut out).unwrap();
                            d.apply_gradients(&other, &vec![0.01; n * 5]).unwrap();
                        }
                    }
                }
                tx.send(()).unwrap();
            });
        }
        let saver = {
            let d = Arc::clone(&disk);
            let ck = ck.clone();
            std::thread::spawn(move || {
                for i in 0..12 {
                    d.save(&ck, i % 3 != 0, true, None).unwrap();
                    let _ = d.export(true).unwrap();
                    let keys = crate::table::Records::keys_of(&d).unwrap();
                    let mut found = vec![false; keys.len()];
                    crate::table::Records::find(&d, &keys, &mut found).unwrap();
                }
            })
        };
        for _ in 0..writers {
            rx.recv_timeout(Duration::from_secs(120))
                .expect("a thread panicked or hung");
        }
        saver.join().expect("the saver");
        disk.save(&ck, true, true, None).unwrap();
        let (back, _) = Table::load(&ck, None, None).unwrap();
        assert_eq!(export(&back), export(&disk));
        DiskTier(&disk).settle_compaction();
        let st = disk.disk_stats().unwrap();
        assert!(st.error.is_none(), "{st:?}");
        assert!(
            (tier == Tier::Slow || st.rows_compacted > 0) && st.disk_rows > 100,
            "{st:?}"
        );
    }

    /// Rows held in memory, read off the shards (not through
    /// `disk_stats`, which settles a scheduled round first).
    fn in_memory(t: &Table) -> usize {
        t.shards.iter().map(|s| read(s).len()).sum()
    }

    /// A call over the bound returns before its rows move out: the round
    /// runs on the tier's thread, and memory is back within the bound
    /// without another call.
    #[test]
    fn rows_over_the_bound_move_out_on_the_tiers_own_thread() {
        let dir = temp_dir("spill-thread");
        let (_ram, disk) = pair(&dir, 40);
        let keys: Vec<i64> = (0..200).collect();
        let mut out = vec![0.0; keys.len() * 5];
        disk.lookup(&keys, true, &mut out).unwrap();
        let c = disk.cold.as_ref().unwrap();
        let start = std::time::Instant::now();
        while c.handoff.in_flight() || c.rounds.load(Ordering::Acquire) == 0 {
            assert!(start.elapsed().as_secs() < 30, "the tier's round never ran");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // The round is counted before it runs: wait for its gate.
        drop(c.gate.write().unwrap());
        assert!(in_memory(&disk) <= 40, "{}", in_memory(&disk));
        let st = disk.disk_stats().unwrap();
        assert_eq!(
            (st.spill_rounds, st.spill_rounds_on_calls),
            (1, 0),
            "{st:?}"
        );
        assert_eq!(st.disk_rows + st.memory_rows, 200);
    }

    /// A round the tier's thread has not started is run by the next call
    /// before it brings its rows in: a call never starts over the bound.
    #[test]
    fn the_next_call_runs_a_round_the_tier_has_not_started() {
        let dir = temp_dir("spill-next-call");
        let (ram, disk) = pair(&dir, 40);
        let keys: Vec<i64> = (0..200).collect();
        let mut out = vec![0.0; keys.len() * 5];
        spill::HOLD_BACK.with(|h| h.set(true));
        disk.lookup(&keys, true, &mut out).unwrap();
        spill::HOLD_BACK.with(|h| h.set(false));
        assert_eq!(in_memory(&disk), 200, "nothing moved yet");
        let c = disk.cold.as_ref().unwrap();
        assert!(c.handoff.due());
        // A call of keys all in memory: its floor runs the round first, so
        // some of them come back from disk.
        let mut one = vec![0.0; 5];
        disk.lookup(&[7], true, &mut one).unwrap();
        // Run on the call's thread (a round the call schedules in turn runs
        // on the tier's).
        assert_eq!(c.rounds_on_calls.load(Ordering::Acquire), 1);
        ram.lookup(&keys, true, &mut out).unwrap();
        let mut want = vec![0.0; 5];
        ram.lookup(&[7], true, &mut want).unwrap();
        assert_eq!(one, want);
        assert!(in_memory(&disk) <= 40 + 1, "{}", in_memory(&disk));
        let st = disk.disk_stats().unwrap();
        assert!(st.disk_rows >= 159 && st.rows_read == 1, "{st:?}");
    }

    #[test]
    fn a_disk_table_refuses_a_memory_too_small_and_capacity_bytes() {
        let dir = temp_dir("disk-refused");
        let mut cfg = TableConfig::new(4);
        cfg.num_shards = Some(4);
        cfg.disk = Some(DiskConfig {
            path: dir.clone(),
            memory_bytes: 100,
        });
        let e = Table::new(cfg.clone()).unwrap_err().to_string();
        assert!(e.starts_with("memory_bytes: expected room"), "{e}");
        cfg.disk.as_mut().unwrap().memory_bytes = 1 << 20;
        cfg.policy.capacity_bytes = Some(1 << 20);
        let e = Table::new(cfg).unwrap_err().to_string();
        assert!(
            e.starts_with("disk: expected a table without capacity_bytes"),
            "{e}"
        );
    }

    /// Three implementations of the record store read the same rows the
    /// same: a disk table's rows below memory, in the disk store or in the
    /// test tier, read through `RecordStore` alone (by `entries` and
    /// `source`, and by `find`), equal word for word (stored words, state,
    /// metadata) the records the mapped reader reads from a checkpoint of
    /// the same table; each store's metadata listing is its records'.
    #[test]
    fn the_disk_store_the_test_tier_and_the_mapped_reader_read_the_same_records() {
        use crate::table::storage::read;
        use crate::table::storage::tier::{RecordStore, read_records};
        for tier in [Tier::Disk, Tier::Slow] {
            let (dir, ckpt) = (temp_dir("records-three"), temp_dir("records-three-ckpt"));
            let policy = crate::policy::Policy {
                ttl_steps: Some(1_000),
                ..Default::default()
            };
            let (_ram, disk) = pair_on(&dir, 40, policy, tier);
            let mut rng = Rng(0x5eed_0000_0000_0007);
            for _ in 0..20 {
                let keys = rng.keys(48, 400);
                let mut out = vec![0.0; keys.len() * 5];
                disk.lookup(&keys, true, &mut out).unwrap();
                let g = rng.floats(keys.len() * 5);
                disk.apply_gradients(&keys, &g).unwrap();
            }
            disk.stats();
            disk.save(&ckpt, false, true, None).unwrap();
            let mapped = crate::mapped::MappedTable::open(&ckpt)
                .unwrap()
                .records()
                .unwrap();
            let width = mapped.width();
            let (mut buf, mut a, mut b) = (Vec::new(), vec![0; width], vec![0; width]);
            let mut below = 0;
            for s in disk.shards.iter() {
                let g = read(s);
                let store: &dyn RecordStore = g.cold.as_deref().expect("a disk table's shard");
                let metas: HashMap<i64, [u32; 4]> = store.metas().collect();
                let keys: Vec<i64> = store.entries().map(|(k, _)| k).collect();
                assert_eq!(keys.len(), store.len());
                for (key, loc) in store.entries() {
                    store
                        .source(loc)
                        .unwrap()
                        .read(key, loc, &mut buf, &mut a)
                        .unwrap();
                    let (at, src) = store.find(key).unwrap();
                    assert_eq!(at, loc);
                    src.read(key, at, &mut buf, &mut b).unwrap();
                    assert_eq!(a, b);
                    let (at, src) = mapped.find(key).expect("the checkpoint holds it");
                    src.read(key, at, &mut buf, &mut b).unwrap();
                    assert_eq!(a, b, "{tier:?}: key {key}'s record");
                    assert_eq!(
                        metas[&key],
                        a[width - 4..],
                        "{tier:?}: key {key}'s metadata"
                    );
                    below += 1;
                }
                // A batch read through the read half alone, a key it does
                // not hold read as zeros and not found.
                let mut ask = keys.clone();
                ask.push(1 << 40);
                let mut batch = RecordBatch::new(width);
                let mut found = vec![false; ask.len()];
                read_records(store, &ask, &mut batch, &mut found).unwrap();
                assert!(found[..keys.len()].iter().all(|&f| f));
                assert!(!found[keys.len()] && batch.row(keys.len()).iter().all(|&w| w == 0));
            }
            assert!(below > 200, "{tier:?}: {below} rows below memory");
            drop(disk);
            let _ = std::fs::remove_dir_all(&ckpt);
        }
    }
}
