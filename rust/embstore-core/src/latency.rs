//! A lock-free histogram of call latencies, exported by `embstore.metrics`
//! as Prometheus's `embstore_lookup_seconds`.
//!
//! Buckets are fixed (Prometheus's convention of cumulative `le` bounds is
//! applied by the reader); recording one call is a bucket search over a
//! few bounds and two relaxed atomic adds, so a call of one key pays tens
//! of nanoseconds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in nanoseconds (1 us to 10 s, 1-2.5-5
/// steps); a last bucket holds everything above.
pub const BOUNDS_NS: [u64; 22] = [
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// The most one call adds to the sum: a day.
const MAX_NS: u64 = 86_400 * 1_000_000_000;

/// Counts of calls by latency bucket, and their total time.
#[derive(Debug, Default)]
pub struct Latency {
    /// `buckets[i]`: calls with `BOUNDS_NS[i-1] < ns <= BOUNDS_NS[i]`;
    /// the last, calls above every bound.
    buckets: [AtomicU64; BOUNDS_NS.len() + 1],
    sum_ns: AtomicU64,
}

/// A reading of a [`Latency`]: per-bucket counts (not cumulative, the last
/// above every bound) and the total in nanoseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LatencyCounts {
    /// Calls per bucket, in the order of [`BOUNDS_NS`], then above them.
    pub buckets: Vec<u64>,
    /// Their total time.
    pub sum_ns: u64,
}

impl Latency {
    /// Counts one call of duration `d`.
    #[inline]
    pub fn record(&self, d: Duration) {
        // At most a day a call, so that the sum (584 years of calls) does
        // not wrap.
        let ns = u64::try_from(d.as_nanos()).map_or(MAX_NS, |ns| ns.min(MAX_NS));
        let i = BOUNDS_NS.partition_point(|&b| b < ns);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// The counts now (each read on its own: a call recorded meanwhile may
    /// be in the sum and not yet in its bucket, or the other way round).
    pub fn counts(&self) -> LatencyCounts {
        LatencyCounts {
            buckets: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_lands_in_the_first_bucket_whose_bound_holds_it() {
        let l = Latency::default();
        l.record(Duration::from_nanos(999));
        l.record(Duration::from_nanos(1_000)); // on the bound: le 1 us
        l.record(Duration::from_nanos(1_001));
        l.record(Duration::from_secs(11));
        l.record(Duration::MAX);
        let c = l.counts();
        assert_eq!(c.buckets.len(), BOUNDS_NS.len() + 1);
        assert_eq!((c.buckets[0], c.buckets[1]), (2, 1));
        assert_eq!(c.buckets[BOUNDS_NS.len()], 2);
        assert_eq!(c.buckets.iter().sum::<u64>(), 5);
        // Durations past a day count as a day.
        assert_eq!(c.sum_ns, 3_000 + 11_000_000_000 + MAX_NS);
    }
}
