//! Rows leaving memory: the spill of the lowest-scoring rows past a
//! shard's share of `memory_bytes`, and forgetting rows removed while on
//! disk.

use super::*;
use crate::policy::Eviction;
use crate::table::compaction::{background, install_compactions, start_compaction};
use crate::table::storage::view::View;
use crate::table::storage::{Shard, count_queued_reads};
use crate::table::views::DiskTier;
use crate::table::{Shards, Views};
use crossbeam_utils::CachePadded;
use std::sync::{RwLockWriteGuard, Weak};

thread_local! {
    /// Failures of rounds of moving rows out, reported to the call of this
    /// thread that stood on the floor next ([`take_disk_reports`]).
    static REPORTS: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The failures to move rows to disk that the calls of this thread met
/// since the last time this was asked (each reported once, to the first
/// call on its table after it): the rows stayed in memory, past
/// `memory_bytes`, and later rounds try again. The binding turns them into
/// Python warnings of the call that met them.
pub fn take_disk_reports() -> Vec<String> {
    REPORTS.with(|r| std::mem::take(&mut *r.borrow_mut()))
}

/// Hands the failure of the last round of `c`, if not yet reported, to the
/// call of this thread ([`take_disk_reports`]).
pub(crate) fn report_to_this_call(c: &Cold) {
    if let Some(e) = c
        .unreported
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
    {
        REPORTS.with(|r| r.borrow_mut().push(e));
    }
}

/// Gives a failure a call of this thread took back to `c` (a prefetch's
/// thread, which has no caller to tell): the next call on the table is
/// told.
pub(crate) fn leave_for_the_next_call(c: &Cold) {
    if let Some(e) = take_disk_reports().pop() {
        c.unreported
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get_or_insert(e);
    }
}

#[cfg(test)]
thread_local! {
    /// Tests: a round scheduled on this thread is left for the next call
    /// (as when the tier's thread has not started it yet).
    pub(crate) static HOLD_BACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A round of moving rows out of memory, with what it needs of its table
/// (shared with the thread that runs it, so that it outlives the call
/// that scheduled it; a table dropped meanwhile is left as it is).
pub(crate) struct SpillJob {
    shards: Weak<[CachePadded<RwLock<Shard>>]>,
    views: Weak<[CachePadded<Arc<View>>]>,
    cold: Weak<Cold>,
    eviction: Eviction,
    /// The call clock when it was scheduled: the rows the last calls
    /// before it touched stay.
    now: u64,
}

impl SpillJob {
    /// Runs the round if it is still due (`Handoff::run_if_due`, under
    /// the cold gate taken exclusively, so it runs once), on whichever
    /// thread comes first: the tier's, or the next call's.
    fn run_if_due(&self, gate: Option<RwLockWriteGuard<'_, ()>>, c: &Cold, on_call: bool) {
        let _excl = gate.unwrap_or_else(|| c.gate.write().unwrap_or_else(PoisonError::into_inner));
        c.handoff.run_if_due(|| {
            let (Some(shards), Some(views)) = (self.shards.upgrade(), self.views.upgrade()) else {
                return;
            };
            c.rounds.fetch_add(1, Ordering::Relaxed);
            if on_call {
                c.rounds_on_calls.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(e) = spill_round(&shards, &views, c, self.eviction, self.now) {
                *c.error.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.clone());
                *c.unreported.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
            }
        });
    }
}

/// Moves rows to disk while a shard holds more than its share of
/// `memory_bytes`, the lowest-scoring first (down to 15/16 of the share,
/// so that a call adding a few rows does not move rows every time), then
/// names what finished compaction jobs moved and starts the next. The
/// caller holds the cold gate exclusively. Returns the failure, if any:
/// the rows stay in memory, and the next round tries again.
fn spill_round(shards: &Shards, views: &Views, c: &Cold, ev: Eviction, now: u64) -> Option<String> {
    let mut error = install_compactions(shards, &c.compaction);
    let protected = {
        let mut p = c.prefetched.lock().unwrap_or_else(PoisonError::into_inner);
        p.0 += 1;
        let round = p.0;
        p.1.retain(|_, &mut at| at + 2 >= round);
        std::mem::take(&mut p.1)
    };
    let target = (c.shard_rows - c.shard_rows / 16).max(1);
    count_queued_reads(shards, views);
    let moved: Vec<Result<usize>> = shards
        .par_iter()
        .map(|lock| -> Result<usize> {
            let mut g = write(lock);
            let len = g.len();
            if len <= c.shard_rows {
                return Ok(0);
            }
            let k = len - target;
            // Rows the last calls touched stay (a step's gradient call
            // follows its lookup), and those a prefetch brought, unless
            // memory holds little else.
            let (mut cands, recent): (Vec<_>, Vec<_>) = g
                .keys_and_rows()
                .filter(|(key, _)| !protected.contains_key(key))
                .map(|(key, r)| {
                    let m = g.meta(r);
                    (ev.score(&m, key), m.tick + RECENT_CALLS > now)
                })
                .partition(|(_, recent)| !recent);
            if cands.len() < k {
                cands.extend(recent);
            }
            let mut cands: Vec<(u64, u64, i64)> = cands.into_iter().map(|c| c.0).collect();
            if cands.len() > k {
                cands.select_nth_unstable(k);
                cands.truncate(k);
            }
            let keys: Vec<i64> = cands.iter().map(|c| c.2).collect();
            g.spill(&keys)?;
            Ok(keys.len())
        })
        .collect();
    {
        let mut p = c.prefetched.lock().unwrap_or_else(PoisonError::into_inner);
        let kept = std::mem::replace(&mut p.1, protected);
        p.1.extend(kept);
    }
    for m in moved {
        match m {
            Ok(n) => {
                c.rows_out.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) => error = Some(e.to_string()),
        }
    }
    start_compaction(shards, &c.compaction, &c.dir);
    trim_heap();
    error
}

impl<'a> DiskTier<'a> {
    /// A round of moving rows out, as of now.
    fn spill_job(&self, c: &Arc<Cold>) -> SpillJob {
        SpillJob {
            shards: Arc::downgrade(&self.shards),
            views: Arc::downgrade(&self.views),
            cold: Arc::downgrade(c),
            eviction: self.policy.eviction,
            now: self.clock(),
        }
    }

    /// Whether a round of moving rows out has work: a shard over its share
    /// of `memory_bytes`, or compaction jobs done to name.
    fn spill_needed(&self, c: &Cold) -> bool {
        !lock(&c.compaction.done).is_empty()
            || self.shards.iter().any(|s| read(s).len() > c.shard_rows)
    }

    /// At the release of a call's hold: where memory holds too many rows,
    /// a round of moving rows out is scheduled on a thread of the tier's
    /// own (inside the binding's call lock, so a `fork()` waits for it),
    /// so the caller goes on while the rows are written. The next call on
    /// the table runs it first if that thread has not started it
    /// ([`DiskTier::spill_due`]): a call never starts over the bound.
    pub(crate) fn spill_soon(&self) {
        let Some(c) = self.cold.as_ref().filter(|c| c.owned()) else {
            return;
        };
        if !self.spill_needed(c) || !c.handoff.schedule() {
            return;
        }
        #[cfg(test)]
        if HOLD_BACK.with(std::cell::Cell::get) {
            return;
        }
        let job = self.spill_job(c);
        background(
            "embstore-spill",
            Box::new(move || {
                if let Some(c) = job.cold.upgrade().filter(|c| c.handoff.due()) {
                    job.run_if_due(None, &c, false);
                }
            }),
        );
    }

    /// At the start of a call on the floor: a scheduled round of moving
    /// rows out that the tier's thread has not taken runs here first,
    /// where the cold gate is free (where other calls hold it, their rows
    /// are in memory anyway; a call of this thread holding it shared
    /// cannot wait for it).
    pub(crate) fn spill_due(&self, c: &Arc<Cold>) {
        if !c.handoff.due() {
            return;
        }
        if let Some(gate) = crate::table::storage::try_lock(c.gate.try_write()) {
            self.spill_job(c).run_if_due(Some(gate), c, true);
        }
    }

    /// The table settled (`stats()`, tests; by a caller holding no hold of
    /// it): a scheduled round runs here, and one running on the tier's
    /// thread is waited for.
    pub(crate) fn settle_spill(&self, c: &Arc<Cold>) {
        if c.handoff.in_flight() {
            self.spill_job(c).run_if_due(None, c, true);
        }
    }

    /// At the table's drop: a scheduled round is called off, and a thread
    /// of the tier still holding the table's disk state is given up to a
    /// second to let go of it, so that the table's directory goes with the
    /// table (otherwise with that thread, once its round ends).
    pub(crate) fn call_off(&self, c: &Arc<Cold>) {
        c.handoff.call_off();
        let start = std::time::Instant::now();
        while Arc::strong_count(c) > 1 && start.elapsed() < std::time::Duration::from_secs(1) {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// A round of moving rows out, now, on this thread (a load between
    /// its parts).
    pub(crate) fn spill_now(&self) {
        let Some(c) = self.cold.as_ref().filter(|c| c.owned()) else {
            return;
        };
        if self.spill_needed(c) {
            c.handoff.schedule();
            self.settle_spill(c);
        }
    }

    /// Forgets the disk copies of `keys` (whose rows a load is about to
    /// replace in memory; `plan` is theirs), logging no removal.
    pub(crate) fn forget_on_disk(&self, keys: &[i64], plan: &Plan) {
        if self.cold.is_none() {
            return;
        }
        self.par_shards_mut(plan, |g, pos| {
            for &i in pos {
                let (key, hash) = (keys[i as usize], plan.hashes[i as usize]);
                if g.find(key, hash).is_none()
                    && let Some(c) = g.cold.as_mut()
                {
                    c.erase(key);
                }
            }
            0
        });
    }
}
