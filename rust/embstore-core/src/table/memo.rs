//! The memo: the rows the last lookup found, kept for the gradient call on
//! the same keys that usually follows it (no second hash-table probe).

use super::*;

/// What the last lookup found: its keys' plan, and the row of each
/// of the plan's positions, shard by shard, with each shard's removal count
/// at the time. A gradient call on exactly these keys (the backward of that
/// lookup, in a training step) takes the rows from here instead of probing
/// the index again, for every shard that has removed nothing since
/// ([`Shard::removals`]); the others are probed as usual.
pub(super) struct Memo {
    pub(super) plan: Plan,
    /// Per shard: the rows of `plan.positions(s)` (`NO_ROW`: no row).
    pub(super) rows: Vec<Vec<u32>>,
    /// Per shard: its removal count when `rows` was found.
    pub(super) removals: Vec<u64>,
}

impl std::fmt::Debug for Memo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Memo({} keys)", self.keys_len())
    }
}

impl Memo {
    /// The memo of a lookup over `plan` that found `found`.
    fn of(plan: Plan, found: Found) -> Memo {
        let (rows, removals) = found
            .into_iter()
            .map(|m| m.into_inner().unwrap_or_else(PoisonError::into_inner))
            .unzip();
        Memo {
            plan,
            rows,
            removals,
        }
    }

    /// Bytes held: 16 per key of the lookup (hash, position, row).
    pub(super) fn bytes(&self) -> usize {
        let p = &self.plan;
        p.hashes.capacity() * 8
            + p.order.capacity() * 4
            + p.starts.capacity() * 8
            + self.rows.iter().map(|r| r.capacity() * 4).sum::<usize>()
            + self.removals.capacity() * 8
    }

    pub(super) fn keys_len(&self) -> usize {
        self.plan.hashes.len()
    }

    /// Whether the rows kept for shard `s` are still its rows (it removed
    /// nothing since, and they are of `n` positions).
    pub(super) fn valid_for(&self, s: usize, g: &Shard, n: usize) -> bool {
        self.removals[s] == g.removals && self.rows[s].len() == n
    }

    /// Whether this memo is of exactly `keys` (compared through their
    /// hashes: the key hash is a bijection).
    pub(super) fn is_of(&self, keys: &[i64]) -> bool {
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
pub(super) const MEMO_MAX_KEYS: usize = 1 << 22;

/// Per shard, where a lookup's shard pass leaves its rows and the shard's
/// removal count for the [`Memo`].
pub(super) type Found = Vec<std::sync::Mutex<(Vec<u32>, u64)>>;

impl Table {
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
        let memo = Memo::of(plan, found);
        *self.memo.lock().unwrap_or_else(PoisonError::into_inner) = Some(memo);
    }

    /// [`Table::remember`] for a caller that must not wait: the memo's lock
    /// is only tried, and when it is busy nothing is kept (the gradient
    /// call that follows then probes the index itself). A lookup of at most
    /// [`SEQUENTIAL_KEYS`] keys.
    pub(crate) fn try_remember(&self, plan: Plan, found: Found) {
        let Some(mut slot) = try_lock(self.memo.try_lock()) else {
            return;
        };
        // The old memo is dropped after the lock (it may be large).
        let old = slot.replace(Memo::of(plan, found));
        drop(slot);
        drop(old);
    }

    /// The memo of exactly `keys`, taken out (a gradient call uses it once).
    /// The comparison runs on the pool, so it runs outside the lock; a memo
    /// of other keys goes back unless a newer one has arrived meanwhile.
    pub(super) fn take_memo(&self, keys: &[i64]) -> Option<Memo> {
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
    use super::super::test_support::{sgd, table};
    use super::*;

    #[test]
    fn a_lookup_leaves_a_memo_of_its_keys_only() {
        let t = table(4, 4, sgd(0.1));
        let keys = [5i64, 9, 5, -3];
        let mut out = vec![0.0; keys.len() * 4];
        t.lookup(&keys, true, &mut out).unwrap();
        assert!(t.take_memo(&[5, 9, 4, -3]).is_none(), "other keys: no memo");
        t.lookup(&keys, true, &mut out).unwrap();
        let m = t.take_memo(&keys).expect("memo of the same keys");
        assert!(m.is_of(&keys));
        assert_eq!(m.keys_len(), keys.len());
        assert!(m.bytes() >= keys.len() * 8);
        assert!(t.take_memo(&keys).is_none(), "a memo is taken once");
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
            t.take_memo(&[1, 2]).is_none(),
            "no memo of a serving lookup"
        );
        assert!(t.take_memo(&train).is_some(), "the training memo survives");
    }

    #[test]
    fn a_memo_does_not_survive_a_removal_in_its_shard() {
        let t = table(4, 1, sgd(0.1));
        let keys = [1i64, 2, 3];
        let mut out = vec![0.0; 12];
        t.lookup(&keys, true, &mut out).unwrap();
        t.remove(&[2]).unwrap();
        let m = t.take_memo(&keys).expect("memo kept");
        let g = read(&t.shards[0]);
        assert!(
            !m.valid_for(0, &g, keys.len()),
            "the removal invalidates it"
        );
    }
}
