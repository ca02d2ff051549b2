//! Reads: lookups (with or without inserting, with a default for missing
//! keys, with optimizer state), `contains`, and `export`.

use crate::error::Result;
use crate::hash::shard_of;
use crate::policy::RowFormat;
use crate::simd::prefetch;
use crate::table::batch::Reserved;
use crate::table::batch::found::FoundRows;
use crate::table::batch::output::{SharedBools, SharedOut};
use crate::table::batch::plan::{
    COPY_PREFETCH_KEYS, Floor, PREFETCH_AHEAD, Plan, Planned, SEQUENTIAL_KEYS, prefetches,
};
use crate::table::checks::check_len;
use crate::table::counters::Counters;
use crate::table::storage::shard::Shard;
use crate::table::storage::view::{Probed, copy_racy, racy};
use crate::table::storage::{try_lock, try_write};
use crate::table::views::Reader;
use crate::table::views::{DiskTier, Evictor, Memos, Stepper};
use crate::table::{Missing, NO_ROW, Table};

thread_local! {
    /// A serving pass's (slot, row) probes of one shard ([`Reader::serve_into`]).
    static PROBES: std::cell::RefCell<Vec<Probed>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Table {
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
        Reader(self).check_lookup(keys, missing, out)?;
        let dim = self.dim;
        if let Some(done) = DiskTier(self).in_pieces(keys.len(), |r| {
            let o = &mut out[r.start * dim..r.end * dim];
            self.lookup_or(&keys[r], insert, missing, o)
        }) {
            return done;
        }
        let Planned {
            plan,
            floor: _floor,
        } = self.plan(keys, Floor::Read)?;
        let out = SharedOut::new(out, self.dim);
        if !self.lookup_changes(insert) {
            Reader(self).serve_into(keys, &plan, out, missing, |_, _, _| {});
            self.record_reads(keys, &plan);
            return Ok(());
        }
        let _gate = self.enter();
        // Only a training lookup (inserting) leaves a memo for the gradient
        // call that follows it: a serving lookup neither pays for one nor
        // replaces a training thread's.
        let found = insert.then(|| FoundRows::new(self.shards.len()));
        Reader(self).lookup_rows(keys, &plan, insert, found.as_ref(), |g, pos, rows| {
            Reader(self).copy_rows(g, keys, pos, rows, out, missing);
        })?;
        if let Some(found) = found {
            Memos(self).remember(plan, found);
            Evictor(self).enforce_capacity();
        }
        Ok(())
    }

    /// [`Table::lookup_or`] without inserting that also writes to `found`
    /// (`keys.len()` flags) whether each key had a row: the row read and
    /// its flag come from one probe and one whole copy (no lock), so a row
    /// another thread evicts or removes meanwhile is either read and found
    /// or read as `missing` and not found (HierarchicalKV's find with its
    /// founds).
    ///
    /// # Errors
    /// As [`Table::lookup_or`]; `ShapeMismatch` when `found` has the wrong
    /// length.
    pub fn lookup_found(
        &self,
        keys: &[i64],
        missing: Missing<'_>,
        out: &mut [f32],
        found: &mut [bool],
    ) -> Result<()> {
        Reader(self).check_lookup(keys, missing, out)?;
        check_len("found", keys.len(), found.len())?;
        let dim = self.dim;
        if let Some(done) = DiskTier(self).in_pieces(keys.len(), |r| {
            let (o, f) = (&mut out[r.start * dim..r.end * dim], &mut found[r.clone()]);
            self.lookup_found(&keys[r], missing, o, f)
        }) {
            return done;
        }
        let plan = self.plan(keys, Floor::Read)?;
        let out = SharedOut::new(out, self.dim);
        let flags = SharedBools::new(found);
        Reader(self).serve_into(keys, &plan, out, missing, |i, hit, _| {
            // SAFETY: i < keys.len() == found.len(), and position i
            // belongs to one shard only, so no other thread writes it.
            unsafe { flags.set(i, hit) };
        });
        self.record_reads(keys, &plan);
        Ok(())
    }

    /// A small [`Table::lookup_or`] that runs only if it can run at once
    /// without waiting: at most `SEQUENTIAL_KEYS` keys, a table whose
    /// lookups record no touches (no TTL, no capacity: no eviction follows)
    /// and, for a lookup that inserts, no admission filter, and every lock
    /// it needs free now: the gate (shared) when it inserts,
    /// then the read locks (serving) or write locks (inserting) of the
    /// shards it needs, each only tried, in index order. It then runs on
    /// the calling thread, holding those shard locks together. For a
    /// caller that must not wait (the binding, which runs it without
    /// releasing the GIL: a few microseconds of work then cost no GIL
    /// hand-over).
    ///
    /// An inserting lookup makes room for the rows it may create in every
    /// shard before it creates any (refused whole, as `lookup_or`), and
    /// leaves its memo for the gradient call that follows when the memo's
    /// lock is free (else none: that call then probes the index itself).
    ///
    /// Returns `None`, having counted nothing and changed nothing (`out`
    /// may hold some rows), when it cannot run so; the caller then makes
    /// the ordinary call.
    ///
    /// # Errors
    /// As [`Table::lookup_or`].
    pub fn try_lookup_now(
        &self,
        keys: &[i64],
        insert: bool,
        missing: Missing<'_>,
        out: &mut [f32],
    ) -> Option<Result<()>> {
        if self.cold.is_some() {
            // A disk table's call may read from disk: the ordinary call.
            return None;
        }
        let inserts = self.inserts(insert);
        if keys.len() > SEQUENTIAL_KEYS || insert && !inserts || inserts && self.policy.tracks() {
            return None;
        }
        if let Err(e) = Reader(self).check_lookup(keys, missing, out) {
            return Some(Err(e));
        }
        if inserts {
            return Reader(self).try_insert_now(keys, missing, out);
        }
        // A serving lookup takes no lock at all (`storage::seqlock`).
        let plan = self.plan(keys, Floor::Read).ok()?;
        Reader(self).serve_into(
            keys,
            &plan,
            SharedOut::new(out, self.dim),
            missing,
            |_, _, _| {},
        );
        self.record_reads(keys, &plan);
        Some(Ok(()))
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
        Table::check_batch(keys)?;
        let (dim, sl) = (self.dim, self.state_len);
        check_len("out", keys.len() * dim, out.len())?;
        check_len("state", keys.len() * sl, state.len())?;
        if let Some(done) = DiskTier(self).in_pieces(keys.len(), |r| {
            let o = &mut out[r.start * dim..r.end * dim];
            let s = &mut state[r.start * sl..r.end * sl];
            self.lookup_with_state(&keys[r], insert, o, s)
        }) {
            return done;
        }
        let plan = self.plan(keys, Floor::Read)?;
        let out = SharedOut::new(out, dim);
        let st_out = SharedOut::new(state, sl);
        if !self.lookup_changes(insert) {
            Reader(self).serve_into(keys, &plan, out, Missing::Init, |i, _, src| {
                // SAFETY: position i belongs to this shard only (plan).
                let dst = unsafe { st_out.row(i, sl) };
                match (src, &self.optimizer) {
                    // SAFETY: `src` is the row's state in its pinned
                    // segment, copied inside the seqlock check (`racy`).
                    (Some(src), _) => unsafe { copy_racy(dst, src) },
                    (None, Some(o)) => o.init_state(dst),
                    (None, None) => {}
                }
            });
            self.record_reads(keys, &plan);
            return Ok(());
        }
        let _gate = self.lookup_changes(insert).then(|| self.enter());
        Reader(self).lookup_rows(keys, &plan, insert, None, |g, pos, rows| {
            Reader(self).copy_rows(g, keys, pos, rows, out, Missing::Init);
            if sl == 0 {
                return;
            }
            for (&i, &r) in pos.iter().zip(rows) {
                // SAFETY: position i belongs to this shard only (plan).
                let dst = unsafe { st_out.row(i as usize, sl) };
                match (r, &self.optimizer) {
                    (NO_ROW, Some(o)) => o.init_state(dst),
                    (NO_ROW, None) => {}
                    _ => dst.copy_from_slice(g.state(r as usize)),
                }
            }
        })?;
        if insert {
            Evictor(self).enforce_capacity();
        }
        Ok(())
    }

    /// Whether each key has a row; `out` gets one bool per key.
    ///
    /// # Errors
    /// `ShapeMismatch` when `out` has the wrong length.
    pub fn contains(&self, keys: &[i64], out: &mut [bool]) -> Result<()> {
        Table::check_batch(keys)?;
        check_len("out", keys.len(), out.len())?;
        let plan = self.plan(keys, Floor::InPlace)?;
        let shared = SharedBools::new(out);
        if self.cold.is_some() {
            // A disk table: in memory or on disk, under each shard's lock.
            use rayon::prelude::*;
            self.shards.par_iter().enumerate().for_each(|(s, lock)| {
                let g = crate::table::storage::read(lock);
                for &i in plan.positions(s) {
                    let (i, key) = (i as usize, keys[i as usize]);
                    let hit = g.find(key, plan.hashes[i]).is_some()
                        || g.cold.as_ref().is_some_and(|c| c.contains(key));
                    // SAFETY: as below: position i is this shard's only.
                    unsafe { shared.set(i, hit) };
                }
            });
            return Ok(());
        }
        // Without a lock (`storage::seqlock`).
        self.par_views(&plan, |view, guard, pos| {
            let shared = &shared;
            view.contains_many(guard, keys, &plan.hashes, pos, |i, hit| {
                // SAFETY: i < keys.len() == out.len(), and position i belongs
                // to this shard only, so no other thread writes it.
                unsafe { shared.set(i, hit) };
            });
        });
        Ok(())
    }
}

impl<'a> Reader<'a> {
    /// The inserting half of [`Table::try_lookup_now`], on checked input.
    fn try_insert_now(
        &self,
        keys: &[i64],
        missing: Missing<'_>,
        out: &mut [f32],
    ) -> Option<Result<()>> {
        let _gate = try_lock(self.gate.try_read())?;
        // A table in memory (the caller's check): the plan holds no floor.
        let plan = self.plan(keys, Floor::Read).ok()?.plan;
        let mut held = Vec::with_capacity(self.shards.len().min(keys.len()));
        for (s, lock) in self.shards.iter().enumerate() {
            if !plan.positions(s).is_empty() {
                held.push((s, try_write(lock)?));
            }
        }
        // Every shard's rows, and room for the absent ones, before any row
        // is created: running out of memory refuses the call whole.
        let mut found_rows: Vec<(Vec<u32>, usize)> = Vec::with_capacity(held.len());
        for (s, g) in &mut held {
            let mut rows = Vec::new();
            g.find_many(keys, &plan.hashes, plan.positions(*s), &mut rows);
            let absent = rows.iter().filter(|&&r| r == NO_ROW).count();
            if g.reserve_pending(absent).is_err() {
                for ((_, g), (_, n)) in held.iter_mut().zip(&found_rows) {
                    g.release_pending(*n);
                }
                return Some(Err(Stepper(self).refuse_rows("keys", keys.len())));
            }
            found_rows.push((rows, absent));
        }
        let save_gen = self.generation();
        let fill = |key, w: &mut [f32], st: &mut [f32]| self.fill_pushed(key, w, st);
        let shared = SharedOut::new(out, self.dim);
        let found = FoundRows::new(self.shards.len());
        for ((s, g), (mut rows, absent)) in held.iter_mut().zip(found_rows) {
            let pos = plan.positions(*s);
            let len0 = g.len();
            g.insert_missing(keys, &plan.hashes, pos, save_gen, fill, &mut rows);
            g.release_pending(absent);
            self.copy_rows(g, keys, pos, &rows, shared, missing);
            self.count_lookups(g, pos.len(), &rows, len0);
            found.put(*s, g, rows);
        }
        drop(held);
        Memos(self).try_remember(plan, found);
        Some(Ok(()))
    }

    /// The checks of [`Table::lookup_or`]'s arguments.
    fn check_lookup(&self, keys: &[i64], missing: Missing<'_>, out: &[f32]) -> Result<()> {
        Table::check_batch(keys)?;
        self.check_missing(missing)?;
        check_len("out", keys.len() * self.dim, out.len())
    }

    /// The shard pass of a lookup: resolves the row of each of the plan's
    /// keys (creating missing ones when `insert` and no admission filter;
    /// else `NO_ROW`), records the touches when rows carry metadata, hands
    /// each shard's positions and rows to `emit`, and counts. The caller
    /// holds the gate when [`Table::lookup_changes`].
    pub(crate) fn lookup_rows<F>(
        &self,
        keys: &[i64],
        plan: &Plan,
        insert: bool,
        found: Option<&FoundRows>,
        emit: F,
    ) -> Result<()>
    where
        F: Fn(&Shard, &[u32], &[u32]) + Sync,
    {
        let n = self.shards.len();
        // The reservation's probes, for this call's own pass (the caller's
        // `found` keeps what the pass finds, for the gradient call after).
        let probed = FoundRows::new(n);
        let reserved = self.reserve_lookup(keys, plan, insert, &probed)?;
        let keep = |g: &Shard, pos: &[u32], rows: Vec<u32>| {
            if let Some(found) = found {
                found.put(shard_of(plan.hashes[pos[0] as usize], n), g, rows);
            }
        };
        let insert = self.inserts(insert);
        let track = self.tracks();
        if insert || track {
            let save_gen = self.generation();
            let (tick, step) = if track {
                (self.next_tick(), self.policy.age_clock(self.step()))
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
                    rows = Stepper(self).rows_inserting(g, s, keys, plan, pos, &probed, save_gen);
                } else {
                    g.find_many(keys, &plan.hashes, pos, &mut rows);
                }
                if track {
                    for &r in &rows {
                        if r != NO_ROW {
                            g.touch(r as usize, tick, step, 1);
                        }
                    }
                }
                emit(g, pos, &rows);
                self.count_lookups(g, pos.len(), &rows, len0);
                keep(g, pos, rows);
                if insert {
                    g.release_pending(reserved[s]);
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

    /// The reservations of a lookup over `plan` ([`Stepper::reserve_plan`]):
    /// none unless it inserts ([`Table::inserts`]).
    pub(crate) fn reserve_lookup(
        &self,
        keys: &[i64],
        plan: &Plan,
        insert: bool,
        probed: &FoundRows,
    ) -> Result<Reserved> {
        if self.inserts(insert) {
            Stepper(self).reserve_plan(plan, keys, Some(probed), false, "keys")
        } else {
            Ok(Vec::new())
        }
    }

    /// A serving lookup's pass, taking no lock and waiting for no writer
    /// (`storage::seqlock`): writes each key's row (whole: one version of
    /// it) to `out`, or `missing`'s row for a key without one, and tells
    /// `then(position, found, state)` (`state`: the row's optimizer state,
    /// `state_len` floats read in the same version, or None when absent),
    /// then counts the lookups.
    pub(crate) fn serve_into<T>(
        &self,
        keys: &[i64],
        plan: &Plan,
        out: SharedOut,
        missing: Missing<'_>,
        then: T,
    ) where
        T: Fn(usize, bool, Option<*const f32>) + Sync,
    {
        let (dim, ww) = (self.dim, self.wwords);
        // Index lines and rows are prefetched in calls of more than
        // COPY_PREFETCH_KEYS keys, as the training lookup's rows are: a
        // serving call's keys vary, and its rows are out of cache. 1,024
        // varied keys of a 100k-row table: 43 us against 65-74 without;
        // the same 1,024 keys called again and again (rows in cache): 22-24
        // against 18 (benches/RESULTS.md, 2026-11-28). Until then only calls
        // spread over the pool (past SEQUENTIAL_KEYS) prefetched, judged on
        // repeated keys.
        let spread = prefetches(keys.len(), COPY_PREFETCH_KEYS);
        let format = self.policy.format;
        self.par_views(plan, |view, guard, pos| {
            let hit = |j: usize, w: *const f32, st: *const f32| {
                let i = pos[j] as usize;
                // SAFETY: position i belongs to this shard only (plan).
                let dst = unsafe { out.row(i, dim) };
                // Plain stores, whatever the output's size: non-temporal
                // ones (for outputs past 8 MiB until 2026-11-27) made
                // lookups of 100,000 ids and more 1.5-2.6x slower on an
                // Intel Xeon VM (80 against 31 ns a key), where an older
                // Cascade Lake VM had measured 4% faster.
                match format {
                    // SAFETY: w holds the row's `ww` floats (the view's
                    // segment, pinned); a racing write is caught by the
                    // seqlock check after the copy (`copy_racy`).
                    RowFormat::F32 => unsafe { copy_racy(dst, w) },
                    // SAFETY: as above.
                    f => f.decode_on(self.backend, unsafe { racy(w, ww) }, dst),
                }
                then(i, true, Some(st));
            };
            let miss = |j: usize| {
                let i = pos[j] as usize;
                // SAFETY: position i belongs to this shard only (plan).
                self.fill_missing(keys[i], unsafe { out.row(i, dim) }, missing);
                then(i, false, None);
            };
            // One probe buffer a thread, not an allocation a shard: a
            // small call visits up to every shard.
            let hits = PROBES.with_borrow_mut(|probes| {
                view.read_many(guard, keys, &plan.hashes, pos, spread, probes, hit, miss)
            });
            let c = &view.counters;
            Counters::add(&c.lookups, pos.len());
            Counters::add(&c.hits, hits);
            Counters::add(&c.misses, pos.len() - hits);
        });
    }

    /// Counts a shard's part of a lookup: `rows` holds the row of each id
    /// (`NO_ROW` for none); rows at or past `len0` were created by the call.
    pub(crate) fn count_lookups(&self, g: &Shard, n: usize, rows: &[u32], len0: usize) {
        let hits = rows.iter().filter(|&&r| (r as usize) < len0).count();
        let c = g.counters();
        Counters::add(&c.lookups, n);
        Counters::add(&c.hits, hits);
        Counters::add(&c.misses, n - hits);
        Counters::add(&c.inserts, g.len() - len0);
    }

    /// Copies the weights of arena row `rows[j]` to output row `pos[j]`,
    /// prefetching the rows a few steps ahead; where `rows[j]` is
    /// `NO_ROW`, writes the row key `keys[pos[j]]` would get.
    pub(crate) fn copy_rows(
        &self,
        shard: &Shard,
        keys: &[i64],
        pos: &[u32],
        rows: &[u32],
        out: SharedOut,
        missing: Missing<'_>,
    ) {
        let (dim, ww) = (self.dim, self.wwords);
        // The row format is matched once per call, not per row.
        let ahead = prefetches(keys.len(), COPY_PREFETCH_KEYS);
        // Each format's loop is its own copy of this one, with its row copy
        // inlined (through `&dyn`, an indirect call per row cost about a
        // tenth of a small lookup's instructions).
        macro_rules! copy {
            ($decode:expr) => {{
                let decode = $decode;
                for j in 0..pos.len() {
                    if ahead
                        && let Some(&ahead) = rows.get(j + PREFETCH_AHEAD)
                        && ahead != NO_ROW
                    {
                        prefetch(shard.weights(ahead as usize));
                    }
                    let i = pos[j] as usize;
                    // SAFETY: position i belongs to this shard only (plan).
                    let dst = unsafe { out.row(i, dim) };
                    if rows[j] != NO_ROW {
                        decode(shard.weights(rows[j] as usize), dst);
                    } else {
                        self.fill_missing(keys[i], dst, missing);
                    }
                }
            }};
        }
        // Plain stores at any output size (see `serve_into`).
        match self.policy.format {
            // A row of one float (a bias): a move, not a call to memcpy
            // (which a loop over a row of unknown length compiles to).
            RowFormat::F32 if dim == 1 => copy!(|row: &[f32], dst: &mut [f32]| dst[0] = row[0]),
            // A plain copy: libc's memcpy, in its AVX-512 form where the CPU
            // has it, beat an inlined loop of 16-float blocks compiled for
            // baseline x86-64 (`cargo bench --bench small_lookup`, 128-key
            // serving lookups at dim 8, 16 and 64).
            RowFormat::F32 => {
                copy!(|row: &[f32], dst: &mut [f32]| dst.copy_from_slice(&row[..dim]))
            }
            f => copy!(|row: &[f32], dst: &mut [f32]| f.decode_on(self.backend, &row[..ww], dst)),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::error::StoreError;
    use crate::hash::{key_hash, shard_of};
    use crate::table::batch::plan::SEQUENTIAL_KEYS;
    use crate::table::storage::{read, write};
    use crate::table::views::Memos;
    use crate::table::{Missing, Table, TableConfig};
    use crate::testing::{sgd, table};

    #[test]
    fn a_serving_lookup_now_reads_what_lookup_reads_even_while_a_writer_holds_its_shard() {
        let t = table(3, 4, sgd(0.1));
        t.lookup(&[1, 2, 3, 4, 5], true, &mut [0.0; 15]).unwrap();
        let keys = [5, 1, 9, 2, 5];
        let row = [7.0, 8.0, 9.0];
        let (mut want, mut got) = ([0.0; 15], [0.0; 15]);
        t.lookup_or(&keys, false, Missing::Row(&row), &mut want)
            .unwrap();
        let lookups = |t: &Table| t.stats().counters[0].1;
        assert_eq!(t.stats().counters[0].0, "lookups");
        let before = lookups(&t);
        t.try_lookup_now(&keys, false, Missing::Row(&row), &mut got)
            .expect("no shard is busy")
            .unwrap();
        assert_eq!(got, want);
        assert_eq!(lookups(&t) - before, 5);
        assert_eq!(t.len(), 5, "nothing inserted");
        // A shard held by a writer: a serving lookup takes no lock, so it
        // runs all the same and reads the same rows.
        let s = shard_of(key_hash(5), t.shards.len());
        let held = write(&t.shards[s]);
        let mut again = [0.0; 15];
        t.try_lookup_now(&keys, false, Missing::Row(&row), &mut again)
            .expect("a serving lookup never declines for a lock")
            .unwrap();
        drop(held);
        assert_eq!(again, want);
        assert_eq!(lookups(&t), before + 10);
        // Bad arguments are errors, as lookup_or's.
        let e = t
            .try_lookup_now(&keys, false, Missing::Init, &mut [0.0; 3])
            .unwrap();
        assert!(matches!(
            e,
            Err(StoreError::ShapeMismatch { arg: "out", .. })
        ));
        // Too many keys for the calling thread: declined.
        let many: Vec<i64> = (0..SEQUENTIAL_KEYS as i64 + 1).collect();
        let mut out = vec![0.0; many.len() * 3];
        assert!(
            t.try_lookup_now(&many, false, Missing::Init, &mut out)
                .is_none()
        );
    }

    #[test]
    fn a_training_lookup_now_does_what_lookup_does_or_declines_without_waiting() {
        let (want, got) = (table(3, 4, sgd(0.1)), table(3, 4, sgd(0.1)));
        for t in [&want, &got] {
            t.lookup(&[1, 2, 3], true, &mut [0.0; 9]).unwrap();
        }
        let keys = [5, 1, 9, 2, 5, 12];
        let (mut a, mut b) = ([0.0; 18], [f32::NAN; 18]);
        want.lookup(&keys, true, &mut a).unwrap();
        got.try_lookup_now(&keys, true, Missing::Init, &mut b)
            .expect("nothing is busy")
            .unwrap();
        assert_eq!(a, b, "the same rows, new ones included");
        assert_eq!(want.export(true).unwrap(), got.export(true).unwrap());
        assert_eq!(want.stats().counters, got.stats().counters);
        assert!(
            Memos(&got).take_memo(&keys).is_some(),
            "a memo for the backward"
        );
        // The gate or a shard held elsewhere: declined, nothing changed.
        let (len, counters) = (got.len(), got.stats().counters);
        let new = [40i64, 41, 42];
        {
            let _snapshot = got.gate.write().unwrap();
            assert!(
                got.try_lookup_now(&new, true, Missing::Init, &mut [0.0; 9])
                    .is_none()
            );
        }
        let s = shard_of(key_hash(41), got.shards.len());
        let held = read(&got.shards[s]);
        assert!(
            got.try_lookup_now(&new, true, Missing::Init, &mut [0.0; 9])
                .is_none()
        );
        drop(held);
        assert_eq!((got.len(), got.stats().counters), (len, counters));
        // A table whose lookups may evict: always the ordinary call.
        let mut cfg = TableConfig::new(3);
        cfg.policy.capacity = Some(100);
        let capped = Table::new(cfg).unwrap();
        assert!(
            capped
                .try_lookup_now(&new, true, Missing::Init, &mut [0.0; 9])
                .is_none()
        );
    }

    #[test]
    fn serving_lookups_store_nothing_and_read_the_default() {
        let t = table(3, 4, sgd(0.1));
        let mut out = vec![9.0; 6];
        t.lookup_or(&[1, 2], false, Missing::Zeros, &mut out)
            .unwrap();
        assert_eq!(out, [0.0; 6]);
        assert_eq!(t.len(), 0);
        let row = [1.0, 2.0, 3.0];
        t.lookup_or(&[4], false, Missing::Row(&row), &mut out[..3])
            .unwrap();
        assert_eq!(&out[..3], &row);
        let mut init = vec![0.0; 3];
        t.lookup(&[4], false, &mut init).unwrap();
        let mut expect = vec![0.0; 3];
        t.initializer().fill(7, 4, &mut expect);
        assert_eq!(init, expect);
    }

    #[test]
    fn inserting_lookups_create_rows_that_contains_sees() {
        let t = table(2, 4, None);
        let mut out = vec![0.0; 4];
        t.lookup(&[10, 11], true, &mut out).unwrap();
        let mut found = vec![false; 3];
        t.contains(&[10, 12, 11], &mut found).unwrap();
        assert_eq!(found, [true, false, true]);
        let (keys, rows, state) = t.export(false).unwrap();
        assert_eq!(keys, [10, 11]);
        assert_eq!(rows, out);
        assert!(state.is_empty());
    }
}
