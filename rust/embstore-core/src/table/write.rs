//! Writes that are not optimizer steps: assign (with or without state),
//! reserve, remove.

use crate::error::{Result, invalid, oom};
use crate::hash::shard_of;
use crate::policy::{Meta, RowFormat};
use crate::table::batch::plan::{Floor, Plan, Planned, sequential_writes};
use crate::table::checks::{check_finite, check_len};
use crate::table::counters::Counters;
use crate::table::step::bounds::Magnitudes;
use crate::table::storage::{Shard, ShardWrite, pages, try_lock, try_write, write};
use crate::table::views::Writer;
use crate::table::views::{Evictor, Stepper};
use crate::table::{Table, read};
use rayon::iter::{IntoParallelRefIterator, ParallelIterator};

/// The most keys [`Table::try_assign_now`] takes.
pub(crate) const NOW_KEYS: usize = 16;

/// The plan an assign runs on ([`Writer::assign_in`]), made by its caller.
pub(crate) enum Taken<'a> {
    /// The keys' plan.
    Plan(Plan),
    /// The keys' plan, and the write lock of the one shard that owns them
    /// all.
    Shard(Plan, usize, ShardWrite<'a>),
}

impl Table {
    /// Inserts or overwrites rows with their optimizer state (`keys.len() *
    /// state_len` floats): the inverse of [`Table::lookup_with_state`].
    ///
    /// # Errors
    /// `ShapeMismatch`, `NonFinite`; nothing changed.
    pub fn assign_state(&self, keys: &[i64], values: &[f32], state: &[f32]) -> Result<()> {
        Writer(self).assign_checked(keys, values, None, Some(state), None, None, None)
    }

    /// Inserts or overwrites the rows of `keys` with `values` (`keys.len() *
    /// dim` floats), resetting their optimizer state. Where a key repeats,
    /// its last value wins.
    ///
    /// # Errors
    /// `ShapeMismatch` for a wrong `values` length; `NonFinite` for NaN/inf.
    pub fn assign(&self, keys: &[i64], values: &[f32]) -> Result<()> {
        Writer(self).assign_checked(keys, values, None, None, None, None, None)
    }

    /// Inserts or overwrites rows with their optimizer state (if given) and
    /// their policy metadata ([`Meta::to_words`], 4 words a key; ignored by
    /// a table that tracks no touches; without it each key counts a touch
    /// now, as [`Table::assign`]), and moves the call clock forward to
    /// `clock`: the inverse of [`Table::export_all`], which rebuilds an
    /// LFU/LRU/TTL table exactly (a state dict).
    ///
    /// # Errors
    /// `ShapeMismatch`, `NonFinite`, impossible state; nothing changed.
    pub fn restore(
        &self,
        keys: &[i64],
        values: &[f32],
        state: Option<&[f32]>,
        meta: Option<&[u32]>,
        clock: u64,
    ) -> Result<()> {
        let meta = meta.filter(|_| self.policy.tracks());
        if let Some(m) = meta {
            check_len("meta", keys.len() * 4, m.len())?;
        }
        Writer(self).assign_checked(keys, values, None, state, meta, None, Some(clock))
    }

    /// [`Table::assign`] of a few keys of one shard, made only if it need
    /// not wait: for the binding to make with the GIL held (handing the GIL
    /// over and back cost a one-row insert into a cache 6% of its time).
    /// `None`, having changed nothing, where it would wait (the gate or the
    /// shard's lock taken), allocate (no room for the keys' rows in the
    /// shard) or is not such a call (more than [`NOW_KEYS`] keys, several
    /// shards, a disk table, a table its new rows may take past its
    /// capacity: that call evicts, with the GIL released); the caller then
    /// makes the ordinary call. `Some(Ok(true))`: the rows are written and
    /// the table is past its capacity (calls in other threads filled it
    /// meanwhile): the caller then runs [`Table::enforce_capacity_now`].
    ///
    /// # Errors
    /// As [`Table::assign`]; nothing changed.
    pub fn try_assign_now(&self, keys: &[i64], values: &[f32]) -> Option<Result<bool>> {
        if self.cold.is_some()
            || keys.is_empty()
            || keys.len() > NOW_KEYS
            || Evictor(self).may_pass_capacity(keys.len())
        {
            return None;
        }
        let m = match Writer(self).check_assign(keys, values, None) {
            Ok(m) => m,
            Err(e) => return Some(Err(e)),
        };
        let _gate = try_lock(self.gate.try_read())?;
        let plan = self.plan(keys, Floor::Read).ok()?.plan;
        let s = plan.one_shard()?;
        let g = try_write(&self.shards[s])?;
        if !g.has_room(keys.len()) {
            return None;
        }
        let save_gen = self.generation();
        let done = Writer(self).assign_in(
            keys,
            values,
            None,
            None,
            None,
            save_gen,
            Some(m),
            Taken::Shard(plan, s, g),
        );
        Some(done.map(|()| Evictor(self).over_capacity()))
    }

    /// [`Evictor::enforce_capacity`] for a caller that does not hold the
    /// gate (after [`Table::try_assign_now`]).
    pub fn enforce_capacity_now(&self) {
        let _gate = self.enter();
        Evictor(self).enforce_capacity();
    }

    /// Makes room in the index for about `additional` more rows in total
    /// (spread over the shards), so that a bulk insert does not grow the
    /// index step by step. Row memory, and the index's pages, are left to
    /// be mapped as rows arrive (a load calls this with its manifest's
    /// count, which its files have not confirmed yet; see
    /// [`Table::reserve_rows`] for both now).
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
            .map(|lock| write(lock).try_reserve_index_exact(per, false).is_err())
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
        let row_bytes = read(&self.shards[0]).row_bytes();
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
        Table::check_batch(keys)?;
        let _gate = self.enter();
        let plan = self.plan(keys, Floor::Skip)?;
        Ok(self.par_shards_mut(&plan, |g, pos| {
            pos.iter()
                .filter(|&&i| g.remove(keys[i as usize], plan.hashes[i as usize]))
                .count()
        }))
    }
}

impl<'a> Writer<'a> {
    /// Checks `values` and `state` (finite, of the row format, state an
    /// optimizer can produce), then assigns them (with `meta`, as
    /// [`Writer::assign_in`]) under the gate and moves the call clock
    /// forward to `clock`: the one path of assign, assign with state and
    /// restore. The rows are marked with save generation `save_gen`, or
    /// (`None`) the one current once the gate is held: read before it, a
    /// save's snapshot in between would move the generation on and the
    /// rows, marked with the older one, would be left out of every later
    /// incremental save (the replayed chain then lost them). `stored`: the
    /// rows' words as the table keeps them, `values` their decoded weights
    /// ([`Table::assign_stored`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn assign_checked(
        &self,
        keys: &[i64],
        values: &[f32],
        stored: Option<&[f32]>,
        state: Option<&[f32]>,
        meta: Option<&[u32]>,
        save_gen: Option<u32>,
        clock: Option<u64>,
    ) -> Result<()> {
        let m = self.check_assign(keys, values, state)?;
        let Planned {
            plan,
            floor: _floor,
        } = self.plan(keys, Floor::Read)?;
        let _gate = self.enter();
        let save_gen = save_gen.unwrap_or_else(|| self.generation());
        let taken = Taken::Plan(plan);
        self.assign_in(keys, values, stored, state, meta, save_gen, Some(m), taken)?;
        if let Some(c) = clock {
            self.set_clock(self.clock().max(c));
        }
        Evictor(self).enforce_capacity();
        Ok(())
    }

    /// The checks of an assign's `values` and `state` (lengths, finite, of
    /// the row format, a state the optimizer can produce): their
    /// magnitudes, for the bounds the call raises.
    fn check_assign(
        &self,
        keys: &[i64],
        values: &[f32],
        state: Option<&[f32]>,
    ) -> Result<Magnitudes> {
        Table::check_batch(keys)?;
        let (dim, sl) = (self.dim, self.state_len);
        check_len("values", keys.len() * dim, values.len())?;
        if let Some(st) = state {
            check_len("state", keys.len() * sl, st.len())?;
        }
        // One scan of the values finds both the magnitudes the insert
        // raises the bounds by and any NaN or inf (a non-finite largest
        // magnitude; `check_finite` then names the first).
        let m = Magnitudes::of(self.optimizer.as_ref(), dim, values, state.unwrap_or(&[]));
        if !m.w.is_finite() {
            check_finite("values", values)?;
        }
        self.policy.format.check_fits("values", values)?;
        if let Some(st) = state {
            check_finite("state", st)?;
            if let Some(opt) = &self.optimizer {
                opt.check_state("state", dim, st)?;
            }
        }
        Ok(m)
    }

    /// [`Table::assign_with_state`] on checked input, with the gate held
    /// (or the table not yet shared). With `meta` (4 words per key, see
    /// [`Meta::to_words`]) the rows get that metadata (a load); without,
    /// each occurrence of a key counts as a touch. `known`: the magnitudes
    /// of `values` and `state` (or bounds above them), where the caller
    /// measured them already (a load measures each file's once). `taken`:
    /// the keys' plan, made by the caller, with the write lock of the one
    /// shard that owns them all where the caller took it
    /// ([`Table::try_assign_now`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn assign_in(
        &self,
        keys: &[i64],
        values: &[f32],
        stored: Option<&[f32]>,
        state: Option<&[f32]>,
        meta: Option<&[u32]>,
        save_gen: u32,
        known: Option<Magnitudes>,
        taken: Taken<'_>,
    ) -> Result<()> {
        let (dim, sl, ww) = (self.dim, self.state_len, self.wwords);
        if let Some(sw) = stored {
            check_len("rows", keys.len() * ww, sw.len())?;
        }
        let sequential = sequential_writes(4 * (ww + sl));
        let (plan, one) = match taken {
            Taken::Shard(plan, s, g) => (plan, Some((s, g))),
            Taken::Plan(plan) => {
                // A call that runs here on one shard (a one-row call)
                // holds its write lock once, for the reservation and the
                // writes.
                let one = plan
                    .one_shard()
                    .filter(|_| keys.len() <= sequential)
                    .map(|s| (s, write(&self.shards[s])));
                (plan, one)
            }
        };
        let mut held = None;
        let reserved = match one {
            Some((s, mut g)) => {
                let n = Stepper(self)
                    .reserve_shard(&mut g, s, &plan, keys, None, false)
                    .ok_or_else(|| Stepper(self).refuse_rows("keys", keys.len()))?;
                held = Some((s, g));
                let mut r = vec![0; self.shards.len()];
                r[s] = n;
                r
            }
            None => Stepper(self).reserve_plan(&plan, keys, None, false, "keys")?,
        };
        if meta.is_some() {
            // Metadata set directly may score below the rows kept for
            // eviction (`table::lowest`).
            Evictor(self).forget_lowest();
        }
        // What this writes, in the bounds every step's non-finite check
        // starts from (raised before the rows change: a bound may only be
        // too high, never too low). 16-bit rows round by at most 2^-8.
        let mut m = known.unwrap_or_else(|| {
            Magnitudes::of(self.optimizer.as_ref(), dim, values, state.unwrap_or(&[]))
        });
        m.w *= 1.0 + 1.0 / 128.0;
        self.bounds.raise(&m);
        let n = self.shards.len();
        let track = self.tracks();
        let (tick, step) = if track && meta.is_none() {
            (self.next_tick(), self.policy.age_clock(self.step()))
        } else {
            (0, 0)
        };
        // Float32 rows are stored as given.
        let copy_rows = self.policy.format == RowFormat::F32 && ww == dim;
        let write_shard = |g: &mut Shard, pos: &[u32]| {
            let len0 = g.len();
            for (j, &i) in pos.iter().enumerate() {
                g.prefetch_ahead(&plan.hashes, pos, j);
                let i = i as usize;
                // A new key's row is written before its key is published, so
                // a serving read never sees it with any other floats.
                let write_state = |st: &mut [f32]| match (state, &self.optimizer) {
                    (Some(src), _) => st.copy_from_slice(&src[i * sl..(i + 1) * sl]),
                    (None, Some(o)) => o.init_state(st),
                    (None, None) => {}
                };
                // Weights kept as given: the row's words as a file kept
                // them (8-bit rows), or float32 rows; copied into a new row,
                // not written over zeros.
                let kept = match stored {
                    Some(sw) => Some(&sw[i * ww..(i + 1) * ww]),
                    None => copy_rows.then(|| &values[i * dim..(i + 1) * dim]),
                };
                let write_weights = |w: &mut [f32]| match kept {
                    Some(src) => w[..ww].copy_from_slice(src),
                    None => self.write_weights(w, &values[i * dim..(i + 1) * dim]),
                };
                // A pushed row's state is zeros already
                // ([`Shard::find_or_insert`]): an initial state of zeros
                // is not written again.
                let new_state = |st: &mut [f32]| match (state, &self.optimizer) {
                    (None, Some(o)) if o.state_starts_zero() => {}
                    _ => write_state(st),
                };
                let mut written = false;
                let (r, _) = match kept {
                    Some(src) => {
                        g.find_or_insert_weights(keys[i], plan.hashes[i], save_gen, src, |st| {
                            new_state(st);
                            written = true;
                        })
                    }
                    None => g.find_or_insert(keys[i], plan.hashes[i], save_gen, |w, st| {
                        write_weights(w);
                        new_state(st);
                        written = true;
                    }),
                };
                if track {
                    match meta {
                        Some(m) => *g.meta_mut(r) = Meta::from_words(&m[i * 4..i * 4 + 4]),
                        None => g.touch(r, tick, step, 1),
                    }
                }
                if !written {
                    let mut change = g.row_to_change(r, save_gen);
                    let (w, st) = change.parts();
                    write_weights(w);
                    write_state(st);
                }
            }
            if meta.is_none() {
                Counters::add(&g.counters().inserts, g.len() - len0);
            }
            g.release_pending(reserved[shard_of(plan.hashes[pos[0] as usize], n)]);
            0
        };
        match held {
            Some((s, mut g)) => {
                write_shard(&mut g, plan.positions(s));
            }
            None => {
                self.par_shards_mut_below(&plan, sequential, write_shard);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::optim::Optimizer;
    use crate::testing::table;

    fn adagrad() -> Option<Optimizer> {
        Some(Optimizer::Adagrad {
            lr: 0.1,
            initial_accumulator_value: 0.5,
            eps: 1e-10,
            weight_decay: 0.0,
        })
    }

    #[test]
    fn assign_resets_state_and_assign_state_keeps_it() {
        let t = table(2, 4, adagrad());
        t.assign(&[1, 2], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let (mut rows, mut state) = (vec![0.0; 4], vec![0.0; 4]);
        t.lookup_with_state(&[1, 2], false, &mut rows, &mut state)
            .unwrap();
        assert_eq!(rows, [1.0, 2.0, 3.0, 4.0]);
        assert_eq!(state, [0.5; 4], "fresh state: the initial accumulator");
        t.assign_state(&[2], &[5.0, 6.0], &[7.0, 8.0]).unwrap();
        t.lookup_with_state(&[2], false, &mut rows[..2], &mut state[..2])
            .unwrap();
        assert_eq!(
            (&rows[..2], &state[..2]),
            (&[5.0, 6.0][..], &[7.0, 8.0][..])
        );
    }

    #[test]
    fn remove_counts_the_keys_present() {
        let t = table(2, 4, None);
        t.assign(&[1, 2, 3], &[0.0; 6]).unwrap();
        assert_eq!(t.remove(&[2, 9, 2]).unwrap(), 1);
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn reserve_changes_no_rows() {
        let t = table(2, 4, None);
        t.reserve_rows(100).unwrap();
        t.try_reserve_index(100).unwrap();
        assert_eq!(t.len(), 0);
    }
}

#[cfg(test)]
mod now_tests {
    use crate::hash::{key_hash, shard_of};
    use crate::table::storage::write;
    use crate::table::views::Evictor;
    use crate::table::{Table, TableConfig};

    fn export(t: &Table) -> (Vec<i64>, Vec<f32>) {
        let (k, r, _) = t.export(false).unwrap();
        (k, r)
    }

    /// A one-shard assign made only where it need not wait: refused (and
    /// nothing changed) while the gate or its shard's lock is taken, or
    /// where its rows need memory; made, with the same result as
    /// `assign`, otherwise; bad values refused whole.
    #[test]
    fn try_assign_now_waits_for_nothing_and_changes_nothing_when_it_cannot() {
        let mut cfg = TableConfig::new(2);
        cfg.num_shards = Some(2);
        cfg.policy.capacity = Some(100);
        let t = Table::new(cfg).unwrap();
        // A fresh shard has no room for rows yet: the ordinary call.
        assert!(t.try_assign_now(&[1], &[1.0, 1.0]).is_none());
        t.assign(&(0..50).collect::<Vec<_>>(), &[0.5; 100]).unwrap();
        let before = export(&t);
        // Keys of both shards: not such a call.
        let in_shard = |s: usize| (1000..).find(|&k| shard_of(key_hash(k), 2) == s).unwrap();
        let (a, b) = (in_shard(0), in_shard(1));
        assert!(t.try_assign_now(&[a, b], &[1.0; 4]).is_none());
        {
            let _g = write(&t.shards[shard_of(key_hash(a), 2)]);
            assert!(
                t.try_assign_now(&[a], &[1.0, 1.0]).is_none(),
                "shard locked"
            );
        }
        {
            let _g = t.gate.write().unwrap();
            assert!(t.try_assign_now(&[a], &[1.0, 1.0]).is_none(), "gate locked");
        }
        let bad = t.try_assign_now(&[a], &[f32::NAN, 1.0]);
        assert!(matches!(bad, Some(Err(_))), "{bad:?}");
        assert_eq!(export(&t), before, "nothing changed");
        // Made: the same as an assign.
        assert!(matches!(
            t.try_assign_now(&[a, a], &[1.0, 2.0, 3.0, 4.0]),
            Some(Ok(false))
        ));
        let mut out = [0.0; 2];
        t.lookup(&[a], false, &mut out).unwrap();
        assert_eq!(out, [3.0, 4.0], "the last value of a repeated key wins");
        assert_eq!(t.len(), 51);
        // Up to the capacity it is made; a call that may pass it is the
        // ordinary call's (which evicts).
        let more: Vec<i64> = (2000..2400)
            .filter(|&k| shard_of(key_hash(k), 2) == 0)
            .collect();
        t.assign(&more[..48], &[0.0; 96]).unwrap();
        assert_eq!(t.len(), 99);
        assert!(matches!(
            t.try_assign_now(&[more[48]], &[0.0, 0.0]),
            Some(Ok(false))
        ));
        assert!(t.try_assign_now(&[more[49]], &[0.0, 0.0]).is_none());
        assert_eq!(t.len(), 100);
        assert!(!Evictor(&t).over_capacity());
        assert_eq!(t.len(), 100);
    }
}
