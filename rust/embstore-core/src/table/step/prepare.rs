//! Preparing a call that may create rows: room made in every shard before
//! anything changes (so that running out of memory refuses the call whole),
//! and a gradient call's plan, taken from the last lookup's memo when it
//! was of the same keys.

use crate::error::{Result, StoreError, invalid, oom};
use crate::table::batch::Reserved;
use crate::table::batch::found::{FoundRows, Memo};
use crate::table::batch::plan::{Floor, Plan, Planned};
use crate::table::cold::hold::ColdHold;
use crate::table::storage::{Shard, write};
use crate::table::views::Stepper;
use crate::table::views::{DiskTier, Memos};
use crate::table::{MAX_STEP, NO_ROW, Table};
use crossbeam_utils::CachePadded;
use rayon::prelude::*;
use std::sync::RwLock;

/// Batches of fewer keys than this make their reservations
/// ([`Stepper::reserve_plan`]) on the calling thread.
const SMALL_BATCH: usize = 1 << 14;

/// A gradient call's plan with room made for its new rows
/// ([`Stepper::prepare_apply`]).
#[derive(Debug)]
pub(crate) struct PreparedApply {
    /// The keys grouped by shard: the last lookup's plan when it was of the
    /// same keys, else a fresh one.
    pub(crate) plan: Plan,
    /// Rows already found: the last lookup's, or the reservation's probes.
    pub(crate) found: FoundRows,
    pub(crate) reserved: Reserved,
}

/// A step's plan with the rows its lookup found ([`Stepper::plan_steps`]).
pub(crate) type StepPlan = (Plan, FoundRows);

impl<'a> Stepper<'a> {
    /// Makes room, in every shard that owns some of the plan's keys, for
    /// the rows the call may create ([`Shard::reserve_pending`]): a call
    /// that may insert does this before it changes anything, so that
    /// running out of memory refuses it whole. A shard with room for all its
    /// positions counts them as pending without a probe; one without counts
    /// its absent keys (from `found` when it holds the shard's rows, else by
    /// a probe, whose rows go into `found` for the call's own pass) and
    /// makes room for those. Each shard's count is given back by the call's
    /// pass over that shard ([`Shard::release_pending`]) or by
    /// [`Stepper::release_plan`].
    ///
    /// A gradient call on a table with an admission filter (`admits`)
    /// makes room only for the absent keys the filter would admit now
    /// ([`Stepper::admissible`]), so that a flood of keys the filter turns
    /// away does not grow the index; a key admitted past that count (the
    /// filter's counts rose meanwhile) gets room then, or is turned away
    /// ([`Stepper::admit`]).
    ///
    /// # Errors
    /// `OutOfMemory` naming `arg`; nothing is reserved then.
    pub(crate) fn reserve_plan(
        &self,
        plan: &Plan,
        keys: &[i64],
        found: Option<&FoundRows>,
        admits: bool,
        arg: &'static str,
    ) -> Result<Reserved> {
        // Per shard: what was reserved, or None when that failed. A small
        // batch stays on the calling thread (a pool dispatch would cost
        // more than taking a few locks).
        let one = |(s, lock): (usize, &CachePadded<RwLock<Shard>>)| {
            let pos = plan.positions(s);
            if pos.is_empty() {
                return Some(0);
            }
            self.reserve_shard(&mut write(lock), s, plan, keys, found, admits)
        };
        let done: Vec<Option<usize>> = if plan.hashes.len() < SMALL_BATCH {
            self.shards.iter().enumerate().map(one).collect()
        } else {
            self.shards.par_iter().enumerate().map(one).collect()
        };
        if done.iter().all(Option::is_some) {
            return Ok(done.into_iter().map(Option::unwrap_or_default).collect());
        }
        // Give back what the shards that succeeded reserved.
        let counts: Reserved = done.into_iter().map(Option::unwrap_or_default).collect();
        self.release_plan(&counts);
        Err(self.refuse_rows(arg, plan.hashes.len()))
    }

    /// [`Stepper::reserve_plan`]'s work in shard `s` (`g`, write-locked, the
    /// plan's positions there not empty): the rows reserved, or `None`
    /// when the memory for them is not there (nothing reserved then).
    pub(crate) fn reserve_shard(
        &self,
        g: &mut Shard,
        s: usize,
        plan: &Plan,
        keys: &[i64],
        found: Option<&FoundRows>,
        admits: bool,
    ) -> Option<usize> {
        let pos = plan.positions(s);
        g.prefetch_homes(&plan.hashes, pos);
        let n = if g.has_room(pos.len()) {
            pos.len()
        } else if let Some(n) = found.and_then(|f| f.absent(s, g, pos.len())) {
            n
        } else if !admits && g.sampled_all_absent(keys, &plan.hashes, pos) {
            // Room for every position without probing them all: the call's
            // pass then probes each key once, in the grown index
            // ([`Shard::find_or_insert_many`]), instead of once here and
            // again there.
            pos.len()
        } else {
            let mut rows = Vec::new();
            g.find_many(keys, &plan.hashes, pos, &mut rows);
            let missing = if admits {
                self.admissible(g, keys, pos, &rows)
            } else {
                rows.iter().filter(|&&x| x == NO_ROW).count()
            };
            if let Some(f) = found {
                f.put(s, g, rows);
            }
            missing
        };
        g.reserve_pending(n).ok()?;
        Some(n)
    }

    /// The error of a call of `n` keys (`arg`) refused for want of memory
    /// for the rows it may create.
    pub(crate) fn refuse_rows(&self, arg: &'static str, n: usize) -> StoreError {
        let row = self.wwords + self.state_len;
        oom(arg, (n as u128) * (row as u128 * 4 + 24))
    }

    /// The rows of shard `s`'s positions (`g`, write-locked), creating those
    /// of absent keys: from `found` when it still holds the shard's rows
    /// (only the absent keys are probed again), else by probing them all.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rows_inserting(
        &self,
        g: &mut Shard,
        s: usize,
        keys: &[i64],
        plan: &Plan,
        pos: &[u32],
        found: &FoundRows,
        save_gen: u32,
    ) -> Vec<u32> {
        let fill = |key, w: &mut [f32], st: &mut [f32]| self.fill_pushed(key, w, st);
        match found.take(s, g, pos.len()) {
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

    /// Ends the reservations of [`Stepper::reserve_plan`] without inserting
    /// (a call that reserved and then stopped).
    pub(crate) fn release_plan(&self, reserved: &[usize]) {
        for (lock, &n) in self.shards.iter().zip(reserved) {
            if n > 0 {
                write(lock).release_pending(n);
            }
        }
    }

    /// [`Stepper::plan_steps`] of one table, without the lists (a step of
    /// one key pays for no more than its plan).
    ///
    /// # Errors
    /// As [`Table::plan`].
    pub(crate) fn plan_step(&self, keys: &[i64]) -> Result<(Planned<'a>, FoundRows)> {
        match self.memo_for_step(keys) {
            Some(m) => Ok((DiskTier(self.0).stand(m.plan, keys, Floor::Step)?, m.found)),
            None => {
                let found = FoundRows::new(self.shards.len());
                Ok((self.0.plan(keys, Floor::Step)?, found))
            }
        }
    }

    /// The memo of the lookup `keys` came from, for a step to take over:
    /// never for a table with an admission filter, which decides per key
    /// at the step.
    fn memo_for_step(&self, keys: &[i64]) -> Option<Memo> {
        let always = self.policy.admission.is_always();
        always.then(|| Memos(self).take_memo(keys)).flatten()
    }

    /// The plans of a gradient call on one or more tables (`tables` with
    /// their keys, in ascending id), each on its floor ([`Floor::Step`]):
    /// the last lookup's plan and rows where that lookup was of these keys
    /// (no second plan), else a new plan ([`Table::plan_many`]).
    ///
    /// # Errors
    /// As [`Table::plan`]; no floor is held then.
    pub(crate) fn plan_steps<'t>(
        tables: &[(&'t Table, &[i64])],
        min_len: usize,
    ) -> Result<(Vec<StepPlan>, Option<ColdHold<'t>>)> {
        let (made, found): (Vec<Option<Plan>>, Vec<FoundRows>) = tables
            .iter()
            .map(|(t, k)| match Stepper(t).memo_for_step(k) {
                Some(m) => (Some(m.plan), m.found),
                None => (None, FoundRows::new(t.shards.len())),
            })
            .unzip();
        let (plans, floor) = Table::plan_many(tables, made, Floor::Step, min_len)?;
        Ok((plans.into_iter().zip(found).collect(), floor))
    }

    /// The first half of a step ([`Stepper::step_whole`]): room made for
    /// every row the step may create, on the keys' `plan` with the rows
    /// `found` of the lookup it follows ([`Stepper::plan_steps`]). Nothing
    /// has changed yet; a call that stops here gives the room back with
    /// [`Stepper::cancel_apply`].
    ///
    /// # Errors
    /// `OutOfMemory` naming `keys`.
    pub(crate) fn prepare_apply(
        &self,
        keys: &[i64],
        counts: bool,
        plan: Plan,
        found: FoundRows,
    ) -> Result<PreparedApply> {
        if counts && self.step() >= MAX_STEP {
            return Err(invalid(
                "step",
                format!("the table is at step {MAX_STEP}, the most it can count"),
            ));
        }
        let always = self.policy.admission.is_always();
        let reserved = if self.optimizer.is_some() {
            self.reserve_plan(&plan, keys, Some(&found), !always, "keys")?
        } else {
            Vec::new()
        };
        Ok(PreparedApply {
            plan,
            found,
            reserved,
        })
    }

    /// Gives back the room a [`Stepper::prepare_apply`] made.
    pub(crate) fn cancel_apply(&self, prepared: PreparedApply) {
        self.release_plan(&prepared.reserved);
    }
}
