//! Rows leaving memory: the spill of the lowest-scoring rows past a
//! shard's share of `memory_bytes`, and forgetting rows removed while on
//! disk.

use super::*;
use crate::table::views::DiskTier;

impl<'a> DiskTier<'a> {
    /// Moves rows to disk while a shard holds more than its share of
    /// `memory_bytes`, the lowest-scoring first (down to 15/16 of the
    /// share, so that a call adding a few rows does not move rows every
    /// time). A failure leaves the rows in memory and is kept for
    /// `stats()`; the next call tries again.
    pub(crate) fn spill_over(&self) {
        let Some(c) = self.cold.as_ref().filter(|c| c.owned()) else {
            return;
        };
        let finished = !lock(&c.compaction.done).is_empty();
        if !finished && !self.shards.iter().any(|s| read(s).len() > c.shard_rows) {
            return;
        }
        let _excl = c.gate.write().unwrap_or_else(PoisonError::into_inner);
        let mut error = self.install_compactions(&c.compaction);
        let protected = {
            let mut p = c.prefetched.lock().unwrap_or_else(PoisonError::into_inner);
            p.0 += 1;
            let round = p.0;
            p.1.retain(|_, &mut at| at + 2 >= round);
            std::mem::take(&mut p.1)
        };
        let target = (c.shard_rows - c.shard_rows / 16).max(1);
        let now = self.clock();
        let ev = self.policy.eviction;
        self.count_queued_reads();
        let moved: Vec<Result<usize>> = self
            .shards
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
        if error.is_some() {
            *c.error.lock().unwrap_or_else(PoisonError::into_inner) = error;
        }
        self.start_compaction(&c.compaction, &c.dir);
        trim_heap();
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
