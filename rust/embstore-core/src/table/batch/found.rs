//! Rows found in an earlier phase: [`FoundRows`], the one carrier of "the
//! rows these positions resolved to" between the phases of a call (a
//! reservation's probe, then the shard pass that uses its rows) and from a
//! lookup to the gradient call on the same keys that usually follows it
//! ([`Memo`]: no second hash-table probe).

use crate::hash::key_hash;
use crate::table::NO_ROW;
use crate::table::batch::plan::Plan;
use crate::table::storage::{Shard, try_lock};
use crate::table::views::Memos;
use rayon::prelude::*;
use std::sync::{Mutex, PoisonError};

/// One shard's rows as a phase found them: the row of each of the plan's
/// positions in the shard (`NO_ROW`: no row), and the shard's removal count
/// then ([`Shard::removals`]): the rows stay right while it has not moved.
#[derive(Debug)]
struct ShardRows {
    rows: Vec<u32>,
    removals: u64,
}

/// Rows found in an earlier phase, per shard of a plan. A later phase takes
/// a shard's rows from here while that shard has removed nothing since (a
/// removal moves a row); otherwise it probes the index again. Shard passes
/// run in parallel, so each shard has its own slot.
#[derive(Debug)]
pub(crate) struct FoundRows {
    shards: Vec<Mutex<Option<ShardRows>>>,
}

impl FoundRows {
    /// No rows found yet, for a table of `n` shards.
    pub(crate) fn new(n: usize) -> FoundRows {
        FoundRows {
            shards: (0..n).map(|_| Mutex::new(None)).collect(),
        }
    }

    /// Records `rows`, the rows shard `s` (`g`, locked by the caller)
    /// resolved its positions to.
    pub(crate) fn put(&self, s: usize, g: &Shard, rows: Vec<u32>) {
        let removals = g.removals;
        *self.shards[s]
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(ShardRows { rows, removals });
    }

    /// Shard `s`'s rows, taken out (a phase uses them once), if they are
    /// still right for `g` and are of its `n` positions.
    pub(crate) fn take(&self, s: usize, g: &Shard, n: usize) -> Option<Vec<u32>> {
        let mut slot = self.shards[s]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match slot.take() {
            Some(f) if f.removals == g.removals && f.rows.len() == n => Some(f.rows),
            _ => None,
        }
    }

    /// How many of shard `s`'s `n` positions have no row, if its rows are
    /// still right for `g` (left in place).
    pub(crate) fn absent(&self, s: usize, g: &Shard, n: usize) -> Option<usize> {
        let slot = self.shards[s]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        slot.as_ref()
            .filter(|f| f.removals == g.removals && f.rows.len() == n)
            .map(|f| f.rows.iter().filter(|&&r| r == NO_ROW).count())
    }

    /// Each shard's removal count when its rows were found (0 for a shard
    /// with none).
    pub(crate) fn removals(&self) -> Vec<u64> {
        self.per_shard(|f| f.map_or(0, |f| f.removals)).collect()
    }

    /// Bytes held: 4 per position, 8 per shard.
    fn bytes(&self) -> usize {
        self.per_shard(|f| f.map_or(0, |f| f.rows.capacity() * 4 + 8))
            .sum()
    }

    /// `f` of each shard's rows (`None`: none found), in shard order.
    fn per_shard<'s, T>(
        &'s self,
        f: impl Fn(Option<&ShardRows>) -> T + 's,
    ) -> impl Iterator<Item = T> + 's {
        self.shards
            .iter()
            .map(move |m| f(m.lock().unwrap_or_else(PoisonError::into_inner).as_ref()))
    }
}

/// What the last lookup found: its keys' plan and their rows. A gradient
/// call on exactly these keys (the backward of that lookup, in a training
/// step) takes the plan and the rows from here instead of planning and
/// probing again, for every shard that has removed nothing since; the
/// others are probed as usual.
pub(crate) struct Memo {
    pub(crate) plan: Plan,
    pub(crate) found: FoundRows,
}

impl std::fmt::Debug for Memo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Memo({} keys)", self.keys_len())
    }
}

impl Memo {
    /// Bytes held: 16 per key of the lookup (hash, position, row).
    pub(crate) fn bytes(&self) -> usize {
        let p = &self.plan;
        p.hashes.capacity() * 8
            + p.order.capacity() * 4
            + p.starts.capacity() * 8
            + self.found.bytes()
    }

    pub(crate) fn keys_len(&self) -> usize {
        self.plan.hashes.len()
    }

    /// Whether this memo is of exactly `keys` (compared through their
    /// hashes: the key hash is a bijection).
    pub(crate) fn is_of(&self, keys: &[i64]) -> bool {
        keys.len() == self.keys_len()
            && keys
                .par_iter()
                .zip(&self.plan.hashes)
                .with_min_len(1 << 14)
                .all(|(&k, &h)| key_hash(k) == h)
    }
}

/// Lookups of more ids than this keep no [`Memo`] (at 16 bytes per id, at
/// most 64 MiB are kept).
pub(crate) const MEMO_MAX_KEYS: usize = 1 << 22;

impl<'a> Memos<'a> {
    /// Keeps what a lookup found as the [`Memo`] for the gradient call that
    /// follows it (replacing the previous one).
    pub(crate) fn remember(&self, plan: Plan, found: FoundRows) {
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
        let memo = Memo { plan, found };
        *self.memo.lock().unwrap_or_else(PoisonError::into_inner) = Some(memo);
    }

    /// [`Memos::remember`] for a caller that must not wait: the memo's lock
    /// is only tried, and when it is busy nothing is kept (the gradient
    /// call that follows then probes the index itself). A lookup of at most
    /// [`SEQUENTIAL_KEYS`](crate::table::batch::plan::SEQUENTIAL_KEYS) keys.
    pub(crate) fn try_remember(&self, plan: Plan, found: FoundRows) {
        let Some(mut slot) = try_lock(self.memo.try_lock()) else {
            return;
        };
        // The old memo is dropped after the lock (it may be large).
        let old = slot.replace(Memo { plan, found });
        drop(slot);
        drop(old);
    }

    /// The memo of exactly `keys`, taken out (a gradient call uses it once).
    /// The comparison runs on the pool, so it runs outside the lock; a memo
    /// of other keys goes back unless a newer one has arrived meanwhile.
    pub(crate) fn take_memo(&self, keys: &[i64]) -> Option<Memo> {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::storage::read;
    use crate::testing::{sgd, table};

    #[test]
    fn a_lookup_leaves_a_memo_of_its_keys_only() {
        let t = table(4, 4, sgd(0.1));
        let keys = [5i64, 9, 5, -3];
        let mut out = vec![0.0; keys.len() * 4];
        t.lookup(&keys, true, &mut out).unwrap();
        assert!(
            Memos(&t).take_memo(&[5, 9, 4, -3]).is_none(),
            "other keys: no memo"
        );
        t.lookup(&keys, true, &mut out).unwrap();
        let m = Memos(&t).take_memo(&keys).expect("memo of the same keys");
        assert!(m.is_of(&keys));
        assert_eq!(m.keys_len(), keys.len());
        assert!(m.bytes() >= keys.len() * 8);
        assert!(Memos(&t).take_memo(&keys).is_none(), "a memo is taken once");
    }

    #[test]
    fn a_serving_lookup_keeps_no_memo_and_leaves_the_training_one() {
        let t = table(4, 4, sgd(0.1));
        let train = [5i64, 9];
        let mut out = vec![0.0; 8];
        t.lookup(&train, true, &mut out).unwrap();
        // Another thread serves other keys between the forward and the
        // backward of a training step.
        t.lookup(&[1, 2], false, &mut out).unwrap();
        assert!(
            Memos(&t).take_memo(&[1, 2]).is_none(),
            "no memo of a serving lookup"
        );
        assert!(
            Memos(&t).take_memo(&train).is_some(),
            "the training memo survives"
        );
    }

    #[test]
    fn a_memo_does_not_survive_a_removal_in_its_shard() {
        let t = table(4, 1, sgd(0.1));
        let keys = [1i64, 2, 3];
        let mut out = vec![0.0; 12];
        t.lookup(&keys, true, &mut out).unwrap();
        t.remove(&[2]).unwrap();
        let m = Memos(&t).take_memo(&keys).expect("memo kept");
        let g = read(&t.shards[0]);
        assert!(
            m.found.take(0, &g, keys.len()).is_none(),
            "the removal invalidates it"
        );
    }

    #[test]
    fn rows_found_are_taken_once_and_only_while_the_shard_removed_nothing() {
        let t = table(4, 1, sgd(0.1));
        let mut out = vec![0.0; 12];
        t.lookup(&[1, 2, 3], true, &mut out).unwrap();
        let found = FoundRows::new(1);
        {
            let g = read(&t.shards[0]);
            found.put(0, &g, vec![0, NO_ROW, 2]);
            assert_eq!(found.absent(0, &g, 3), Some(1));
            assert_eq!(found.absent(0, &g, 2), None, "rows of other positions");
            assert_eq!(found.take(0, &g, 3), Some(vec![0, NO_ROW, 2]));
            assert_eq!(found.take(0, &g, 3), None, "taken once");
            found.put(0, &g, vec![0, 1, 2]);
        }
        t.remove(&[2]).unwrap();
        let g = read(&t.shards[0]);
        assert_eq!(found.absent(0, &g, 3), None, "stale after a removal");
        assert_eq!(found.take(0, &g, 3), None, "stale after a removal");
    }
}
