//! Optimizer steps: the step number, the gradient checks, admission, and
//! the per-shard update of the touched rows.

use crate::error::{Result, StoreError, invalid};
use crate::hash::rounding_stream;
use crate::hash::{key_hash, shard_of};
use crate::policy::{Admission, RowFormat};
use crate::simd::{Backend, prefetch};
use crate::table::batch::plan::{PREFETCH_AHEAD, Planned, SEQUENTIAL_STEP_KEYS, prefetches};
use crate::table::checks::{check_finite_max, check_grad_sums, check_len};
use crate::table::counters::Counters;
use crate::table::step::prepare::PreparedApply;
use crate::table::storage::shard::Shard;
use crate::table::views::Evictor;
use crate::table::views::Stepper;
use crate::table::{MAX_STEP, NO_ROW, Table, read};
use std::sync::atomic::{AtomicU32, Ordering};

/// Coupled weight decay of one step: the gradient a row's update sees is
/// `g + wd * w` ([`crate::optim::Optimizer::coupled_decay`]).
pub(crate) struct Decay<'a> {
    pub(crate) wd: f32,
    /// Scratch of `dim` floats (empty when `wd` is 0).
    pub(crate) g: &'a mut [f32],
}

impl Decay<'_> {
    /// The gradient to apply to row `w` whose summed gradient is `gsum`.
    #[inline]
    pub(crate) fn of<'s>(&'s mut self, backend: Backend, gsum: &'s [f32], w: &[f32]) -> &'s [f32] {
        if self.wd == 0.0 {
            return gsum;
        }
        self.g.copy_from_slice(gsum);
        backend.axpy(self.g, self.wd, w);
        self.g
    }
}

impl Table {
    /// One optimizer step: the gradients of repeated keys are summed, missing
    /// keys get a row from the initializer first, every touched row takes one
    /// update, and the step counter goes up by one. `grads` holds
    /// `keys.len() * dim` floats.
    ///
    /// # Errors
    /// `NoOptimizer`, `ShapeMismatch`, `NonFinite`; in each case nothing
    /// changed.
    pub fn apply_gradients(&self, keys: &[i64], grads: &[f32]) -> Result<()> {
        Stepper(self).apply_gradients_numbered(keys, grads, None)
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
        Stepper(self).apply_gradients_numbered(keys, grads, Some(step))
    }

    /// The admission sketch's estimate for each key (0 without a count
    /// filter), into `out`.
    ///
    /// # Errors
    /// `ShapeMismatch` when `out` has the wrong length.
    pub fn admission_counts(&self, keys: &[i64], out: &mut [u32]) -> Result<()> {
        Table::check_batch(keys)?;
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
}

impl<'a> Stepper<'a> {
    pub(crate) fn apply_gradients_numbered(
        &self,
        keys: &[i64],
        grads: &[f32],
        at: Option<u64>,
    ) -> Result<()> {
        if self.optimizer.is_none() {
            return Err(StoreError::NoOptimizer);
        }
        Table::check_batch(keys)?;
        let dim = self.dim;
        check_len("grads", keys.len() * dim, grads.len())?;
        let most = check_finite_max("grads", grads)?;
        let gs = check_grad_sums("grads", keys, f64::from(most), |i| {
            f64::from(
                grads[i * dim..(i + 1) * dim]
                    .iter()
                    .fold(0.0f32, |a, v| a.max(v.abs())),
            )
        })?;
        self.step_whole(
            keys,
            gs,
            at,
            |i| (&grads[i * dim..(i + 1) * dim], 1.0),
            |_| (),
        )
    }

    /// One whole step on checked input whose summed gradients are at most
    /// `gs` in magnitude (numbered `at`, or the next): takes the gate
    /// ([`Stepper::step_gate`]), makes room, passes a dry run where the bounds
    /// cannot rule out a non-finite result, steps, and enforces capacity.
    /// A step refused on the way changes nothing.
    pub(crate) fn step_whole<'g, G, P>(
        &self,
        keys: &[i64],
        gs: f64,
        at: Option<u64>,
        grad_of: G,
        ask: P,
    ) -> Result<()>
    where
        G: Fn(usize) -> (&'g [f32], f32) + Sync,
        P: Fn(usize) + Sync,
    {
        let (
            Planned {
                plan,
                floor: _floor,
            },
            found,
        ) = self.plan_step(keys)?;
        let t = at.unwrap_or_else(|| self.step() + 1);
        let gate = self.step_gate(gs, t);
        let prepared = self.prepare_apply(keys, at.is_none(), plan, found)?;
        let measured = if gate.needs_dry_run() {
            match self.dry_run(keys, t, &grad_of) {
                Ok(m) => Some(m),
                Err(e) => {
                    self.cancel_apply(prepared);
                    return Err(e);
                }
            }
        } else {
            None
        };
        let written = self.run_apply(keys, prepared, at, grad_of, ask);
        Evictor(self).enforce_capacity();
        self.end_step(gate, measured, written);
        Ok(())
    }

    /// The second half of a step ([`Stepper::step_whole`]): the step itself.
    /// Position `i` of `keys` contributes `coef * grad` with `(grad, coef) =
    /// grad_of(i)`: contributions to one key are summed in batch order, then
    /// the row takes one update; keys the admission filter refuses are
    /// dropped.
    /// The step is number `at`, or without it the next one (the counter goes up).
    /// Returns, for an optimizer that [measures its
    /// weights](Optimizer::measures_weights), the largest `|weight|` the
    /// step wrote (folded into the kernel's loop: the bound the next step's
    /// check starts from).
    ///
    /// `ask(i)` prefetches what `grad_of(i)` reads before the gradient row
    /// (a caller's position-to-row map: a pooled backward's bag and
    /// coefficient of each id); it runs further ahead than the rows'
    /// prefetch, so that finding a gradient row a few pairs ahead does not
    /// wait on a random read of that map (a Collection step spent a third
    /// of its update loop there). `|_| ()` where `grad_of` reads nothing
    /// first.
    pub(crate) fn run_apply<'g, G, P>(
        &self,
        keys: &[i64],
        prepared: PreparedApply,
        at: Option<u64>,
        grad_of: G,
        ask: P,
    ) -> Option<f64>
    where
        G: Fn(usize) -> (&'g [f32], f32) + Sync,
        P: Fn(usize) + Sync,
    {
        let opt = self.optimizer?;
        let measure = opt.measures_weights();
        let written = AtomicU32::new(0);
        let dim = self.dim;
        let t = at.unwrap_or_else(|| self.step.fetch_add(1, Ordering::AcqRel) + 1);
        let consts = opt.step_consts(t);
        let wd = opt.coupled_decay() as f32;
        let backend = self.backend;
        let save_gen = self.generation();
        let track = self.tracks();
        let tick = if track { self.next_tick() } else { 0 };
        let clock = if track { self.policy.age_clock(t) } else { 0 };
        let compact = self.policy.format != RowFormat::F32;
        let always = self.policy.admission.is_always();
        let plan = &prepared.plan;
        let n = self.shards.len();
        let ahead = prefetches(plan.hashes.len(), SEQUENTIAL_STEP_KEYS);
        self.par_shards_mut_below(plan, SEQUENTIAL_STEP_KEYS, |g, pos| {
            let len0 = g.len();
            // (row << 32 | position), sorted: each row's positions in batch order.
            let s = shard_of(plan.hashes[pos[0] as usize], n);
            let mut pairs: Vec<u64> = if always {
                self.rows_inserting(g, s, keys, plan, pos, &prepared.found, save_gen)
                    .iter()
                    .zip(pos)
                    .map(|(&r, &i)| (u64::from(r) << 32) | u64::from(i))
                    .collect()
            } else {
                self.admit(
                    g,
                    keys,
                    &plan.hashes,
                    pos,
                    t,
                    save_gen,
                    prepared.reserved[s],
                )
            };
            pairs.sort_unstable();
            // The sum of a key's gradients, allocated only for a key given
            // more than once (or scaled).
            let mut acc: Vec<f32> = Vec::new();
            // Scratch rows: a 16-bit row decoded, a gradient plus its decay.
            let mut wtmp = vec![0.0f32; if compact { dim } else { 0 }];
            let mut decayed = vec![0.0f32; if wd != 0.0 { dim } else { 0 }];
            let mut decay = Decay {
                wd,
                g: &mut decayed,
            };
            let mut j = 0;
            let mut top = 0u32;
            // Gradient rows are random reads, and rows (in ascending order)
            // skip: keep loads of both in flight for the pairs a little
            // ahead of the one being updated.
            let mut fetched = 0;
            let mut asked = 0;
            // Whether each row's update draws its rounding stream (8-bit rows).
            let streams = self.policy.format == RowFormat::I8 && RowFormat::stochastic_steps();
            while j < pairs.len() {
                let r = (pairs[j] >> 32) as usize;
                let mut end = j + 1;
                while end < pairs.len() && (pairs[end] >> 32) as usize == r {
                    end += 1;
                }
                let until = (end + 2 * PREFETCH_AHEAD).min(pairs.len());
                while ahead && asked < (end + 4 * PREFETCH_AHEAD).min(pairs.len()) {
                    ask((pairs[asked] & 0xFFFF_FFFF) as usize);
                    asked += 1;
                }
                while ahead && fetched < until {
                    let at = (pairs[fetched] & 0xFFFF_FFFF) as usize;
                    prefetch(grad_of(at).0);
                    let ar = (pairs[fetched] >> 32) as usize;
                    prefetch(g.weights(ar));
                    prefetch(g.state(ar));
                    g.prefetch_word(ar);
                    fetched += 1;
                }
                let (first, c0) = grad_of((pairs[j] & 0xFFFF_FFFF) as usize);
                let gsum: &[f32] = if end - j == 1 && c0 == 1.0 {
                    first
                } else {
                    acc.clear();
                    acc.resize(dim, 0.0);
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
                if track {
                    g.touch(r, tick, clock, (end - j) as u32);
                }
                // The key seeds an 8-bit row's rounding stream: read from
                // its index slot, which the write's version word shares
                // (prefetched above), not from the batch (a random read:
                // 7% of an int8 Adam step).
                let (mut change, key) = if streams {
                    g.row_to_change_keyed(r, save_gen)
                } else {
                    (g.row_to_change(r, save_gen), 0)
                };
                let (w, state) = change.parts();
                let most = if compact {
                    let stream = streams.then(|| rounding_stream(self.seed(), key, t));
                    self.apply_compact(&consts, w, state, gsum, &mut wtmp, &mut decay, stream)
                } else if measure {
                    let g = decay.of(backend, gsum, w);
                    backend.step_max(&consts, w, state, g)
                } else {
                    let g = decay.of(backend, gsum, w);
                    consts.apply(backend, w, state, g);
                    0
                };
                top = top.max(most);
                j = end;
            }
            if measure {
                written.fetch_max(top, Ordering::Relaxed);
            }
            let created = g.len() - len0;
            Counters::add(&g.counters().inserts, created);
            Counters::add(&g.counters().admitted, created);
            g.release_pending(prepared.reserved[s]);
            0
        });
        measure.then(|| f64::from(f32::from_bits(written.into_inner())))
    }

    /// One optimizer step on a 16- or 8-bit row: decode, update in float32,
    /// round back (an 8-bit row stochastically by `stream`, the key's
    /// [`rounding_stream`] at this step, or to nearest with None), kept out of line: float32 tables
    /// never call it. Returns the largest magnitude written, as bits.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn apply_compact(
        &self,
        consts: &crate::optim::StepConsts,
        w: &mut [f32],
        state: &mut [f32],
        gsum: &[f32],
        wtmp: &mut [f32],
        decay: &mut Decay<'_>,
        stream: Option<u64>,
    ) -> u32 {
        self.policy.format.decode_on(self.backend, w, wtmp);
        let g = decay.of(self.backend, gsum, wtmp);
        consts.apply(self.backend, wtmp, state, g);
        // A row saturates at the format's largest value instead of
        // becoming inf.
        let most = self.policy.format.max_finite();
        if self.policy.format == RowFormat::I8 {
            // One pass for the range, which bounds the row too; the clamp
            // only where the range is beyond it.
            let (mut lo, mut hi) = self.backend.min_max(wtmp);
            if lo < -most || hi > most {
                wtmp.iter_mut().for_each(|v| *v = v.clamp(-most, most));
                (lo, hi) = (lo.clamp(-most, most), hi.clamp(-most, most));
            }
            crate::format::codec::encode_i8_in(self.backend, wtmp, w, stream, (lo, hi));
            return (-lo).max(hi).to_bits();
        }
        for v in wtmp.iter_mut() {
            *v = v.clamp(-most, most);
        }
        self.policy
            .format
            .encode_rounding(self.backend, wtmp, w, stream);
        // Encoding rounds by at most 2^-8 relative (an 8-bit row stays within
        // its smallest and largest weight): a bound above the stored value.
        let top = f32::from_bits(self.backend.max_magnitude_bits(wtmp));
        (top * (1.0 + 1.0 / 128.0)).to_bits()
    }

    /// The (row << 32 | position) pairs of a shard's positions under an
    /// admission filter: present keys keep theirs; each missing key is
    /// counted once (per call, however often it occurs) and gets a row if
    /// the filter admits it,
    /// else its positions are dropped (counted as one rejected key). The
    /// call made room for `room` new rows ([`Stepper::reserve_plan`]); a key
    /// admitted past them gets room now, and is turned away (as if not
    /// admitted) when the memory cannot be had, so that the call still
    /// applies whole. Out of line: tables without a filter never call it.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn admit(
        &self,
        g: &mut Shard,
        keys: &[i64],
        hashes: &[u64],
        pos: &[u32],
        step: u64,
        save_gen: u32,
        room: usize,
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
        let mut created = 0;
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
            if ok && (created < room || g.make_room(1)) {
                created += 1;
                let first = missing[j].1 as usize;
                let (r, _) = g.find_or_insert(key, hashes[first], save_gen, |w, st| {
                    self.fill_pushed(key, w, st)
                });
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
        Counters::add(&g.counters().rejected, rejected);
        pairs
    }

    /// How many of a shard's absent keys (positions `pos`, `rows` their
    /// probe) the admission filter would admit now: each absent key once
    /// (however often it occurs), those whose count filter estimate would
    /// reach the minimum with this sighting; every one under a probability
    /// filter (its draw depends on the step, not known yet).
    pub(crate) fn admissible(&self, g: &Shard, keys: &[i64], pos: &[u32], rows: &[u32]) -> usize {
        let mut absent: Vec<i64> = rows
            .iter()
            .zip(pos)
            .filter(|&(&r, _)| r == NO_ROW)
            .map(|(_, &i)| keys[i as usize])
            .collect();
        absent.sort_unstable();
        absent.dedup();
        match (self.policy.admission, &g.sketch) {
            (Admission::Count { min_count, .. }, Some(sketch)) => absent
                .iter()
                .filter(|&&k| sketch.estimate_after(k, 1) >= min_count)
                .count(),
            _ => absent.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::table::views::Stepper;
    use crate::testing::{sgd, table};

    #[test]
    fn duplicate_keys_are_summed_into_one_step() {
        let t = table(2, 4, sgd(0.5));
        t.assign(&[1], &[1.0, 1.0]).unwrap();
        t.apply_gradients(&[1, 1], &[1.0, 2.0, 3.0, 4.0]).unwrap();
        let mut out = vec![0.0; 2];
        t.lookup(&[1], false, &mut out).unwrap();
        assert_eq!(out, [1.0 - 0.5 * 4.0, 1.0 - 0.5 * 6.0]);
        assert_eq!(t.step(), 1);
    }

    #[test]
    fn a_numbered_step_does_not_move_the_counter() {
        let t = table(2, 4, sgd(0.5));
        assert_eq!(t.advance_step().unwrap(), 1);
        t.apply_gradients_at(&[3], &[1.0, 1.0], 1).unwrap();
        assert_eq!(t.step(), 1);
        assert!(t.apply_gradients_at(&[3], &[f32::NAN, 1.0], 1).is_err());
    }

    #[test]
    fn a_refused_step_changes_nothing() {
        let t = table(2, 4, sgd(0.5));
        t.assign(&[1], &[1.0, 1.0]).unwrap();
        assert!(
            t.apply_gradients(&[1, 2], &[1.0, 1.0, f32::INFINITY, 0.0])
                .is_err()
        );
        assert_eq!((t.step(), t.len()), (0, 1));
    }

    /// A table of 8 columns, 4 shards, SGD, admitting keys on their second
    /// sighting.
    fn count_filtered() -> crate::table::Table {
        use crate::policy::{Admission, Policy};
        let mut cfg = crate::table::TableConfig::new(8);
        cfg.optimizer = sgd(0.5);
        cfg.num_shards = Some(4);
        cfg.policy = Policy {
            admission: Admission::Count {
                min_count: 2,
                width: 1 << 20,
                depth: 4,
            },
            ..Policy::default()
        };
        crate::table::Table::new(cfg).unwrap()
    }

    #[test]
    fn keys_the_filter_turns_away_do_not_grow_the_index() {
        let t = count_filtered();
        let keys: Vec<i64> = (0..20_000).collect();
        let grads = vec![1.0f32; keys.len() * 8];
        let before = t.stats().bytes;
        t.apply_gradients(&keys, &grads).unwrap();
        // Seen once: no key admitted, and no room made for any.
        assert_eq!(t.len(), 0);
        assert_eq!(t.stats().bytes, before);
        // Seen twice: every key admitted, with room made for each.
        t.apply_gradients(&keys, &grads).unwrap();
        assert_eq!(t.len(), keys.len());
        let mut out = vec![0.0f32; 8];
        t.lookup(&[19_999], false, &mut out).unwrap();
        assert!(out.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn a_key_admitted_past_the_room_made_for_the_call_gets_room_then() {
        let t = count_filtered();
        let keys: Vec<i64> = (0..5_000).collect();
        let grads = vec![1.0f32; keys.len() * 8];
        t.apply_gradients(&keys, &grads).unwrap();
        assert_eq!(t.len(), 0);
        // The pass over a shard told it made room for no rows: the keys its
        // filter admits get room one by one.
        let plan = t
            .plan(&keys, crate::table::batch::plan::Floor::Read)
            .unwrap();
        for (s, lock) in t.shards.iter().enumerate() {
            let pos = plan.positions(s);
            let mut g = crate::table::storage::write(lock);
            let before = g.len();
            let pairs = Stepper(&t).admit(&mut g, &keys, &plan.hashes, pos, 2, t.generation(), 0);
            assert_eq!(pairs.len(), pos.len());
            assert_eq!(g.len() - before, pos.len());
        }
        assert_eq!(t.len(), keys.len());
    }
}
