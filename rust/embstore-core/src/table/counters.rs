//! Event counters of a shard, reported by name in `stats()`.

use std::sync::atomic::{AtomicU64, Ordering};

/// The counters' names, in the order of `Counters::named`.
pub const COUNTER_NAMES: [&str; 7] = [
    "lookups", "hits", "misses", "inserts", "admitted", "rejected", "evicted",
];

/// Counter values by name (see [`COUNTER_NAMES`]).
pub type NamedCounts = [(&'static str, u64); 7];

/// What happened to a shard's rows, counted once per call per shard.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Ids looked up (lookup, lookup_pooled).
    pub lookups: AtomicU64,
    /// Looked-up ids whose key had a row before the call.
    pub hits: AtomicU64,
    /// Looked-up ids whose key had none.
    pub misses: AtomicU64,
    /// Rows created (by any call).
    pub inserts: AtomicU64,
    /// Keys given a row by a gradient call.
    pub admitted: AtomicU64,
    /// Keys whose gradients were dropped by the admission filter (per call).
    pub rejected: AtomicU64,
    /// Rows removed by TTL or capacity eviction.
    pub evicted: AtomicU64,
}

impl Counters {
    /// Adds `n` to `c`.
    #[inline]
    pub(crate) fn add(c: &AtomicU64, n: usize) {
        if n > 0 {
            c.fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// Every count with its name.
    pub(crate) fn named(&self) -> NamedCounts {
        let values = [
            &self.lookups,
            &self.hits,
            &self.misses,
            &self.inserts,
            &self.admitted,
            &self.rejected,
            &self.evicted,
        ];
        std::array::from_fn(|i| (COUNTER_NAMES[i], values[i].load(Ordering::Relaxed)))
    }

    /// Sums `other` into `total`, name by name.
    pub(crate) fn sum_into(total: &mut NamedCounts, other: &NamedCounts) {
        for ((name, t), (other_name, v)) in total.iter_mut().zip(other) {
            debug_assert_eq!(name, other_name);
            *t += v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_travel_with_their_names() {
        let c = Counters::default();
        Counters::add(&c.hits, 3);
        Counters::add(&c.evicted, 2);
        Counters::add(&c.lookups, 0);
        let named = c.named();
        let get = |n: &str| named.iter().find(|(k, _)| *k == n).unwrap().1;
        assert_eq!((get("hits"), get("evicted"), get("lookups")), (3, 2, 0));
        let mut total = Counters::default().named();
        Counters::sum_into(&mut total, &named);
        Counters::sum_into(&mut total, &named);
        assert_eq!(total.iter().map(|(_, v)| v).sum::<u64>(), 10);
        assert_eq!(total.map(|(k, _)| k), COUNTER_NAMES);
    }
}
