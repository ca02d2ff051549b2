//! Work shared between the calling thread and rayon's pool: for calls
//! small enough that handing them to the pool whole (the caller asleep
//! until a pool thread wakes, runs them and wakes it again) costs as much
//! as the work.

use std::sync::OnceLock;

use crossbeam_queue::ArrayQueue;

/// `run` of every item of `work`, in the order of `work`: the calling
/// thread takes items one at a time with up to `helpers` jobs on rayon's
/// pool (each item taken once, by whoever comes first), so a call starts
/// at once instead of waiting for a pool thread to wake and never waits
/// for one that has nothing left to take but to return. None only if an
/// item did not run (it cannot: a panic in `run` is raised here instead).
pub(crate) fn run_shared<W: Send, R: Send + Sync>(
    work: Vec<W>,
    helpers: usize,
    run: &(dyn Fn(W) -> R + Sync),
) -> Option<Vec<R>> {
    let n = work.len();
    let queue = ArrayQueue::new(n.max(1));
    for item in work.into_iter().enumerate() {
        // The queue holds `n` items: no push is refused.
        let _ = queue.push(item);
    }
    let done: Vec<OnceLock<R>> = (0..n).map(|_| OnceLock::new()).collect();
    let drain = || {
        while let Some((i, w)) = queue.pop() {
            let _ = done[i].set(run(w));
        }
    };
    rayon::in_place_scope(|s| {
        for _ in 0..helpers {
            s.spawn(|_| drain());
        }
        drain();
    });
    done.into_iter().map(OnceLock::into_inner).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::mix64;

    #[test]
    fn run_shared_runs_every_item_once_in_order_on_any_pool() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        for threads in [1, 2, 3, 8] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for (items, helpers) in [(0, 0), (1, 0), (1, 3), (16, 1), (16, 7), (200, 15)] {
                let runs = AtomicUsize::new(0);
                let run = |i: usize| {
                    runs.fetch_add(1, Ordering::Relaxed);
                    // Uneven work, so that helpers and the caller interleave.
                    (0..(i % 7) * 500).fold(i as u64, |a, x| mix64(a ^ x as u64))
                };
                let want: Vec<u64> = (0..items).map(run).collect();
                runs.store(0, Ordering::Relaxed);
                // From outside the pool (as the binding calls) and from a
                // thread of it (a forked child's calls).
                let outside = run_shared((0..items).collect(), helpers, &run);
                let inside = pool.install(|| run_shared((0..items).collect(), helpers, &run));
                assert_eq!(
                    outside.as_deref(),
                    Some(&want[..]),
                    "{threads} {items} {helpers}"
                );
                assert_eq!(
                    inside.as_deref(),
                    Some(&want[..]),
                    "{threads} {items} {helpers}"
                );
                assert_eq!(runs.load(Ordering::Relaxed), 2 * items, "each item once");
            }
        }
    }

    #[test]
    fn a_panic_in_run_shared_is_raised_to_the_caller_and_hangs_nothing() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .unwrap();
        for bad in [0usize, 7, 15] {
            let run = |i: usize| {
                assert!(i != bad, "item {i} fails");
                i
            };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.install(|| run_shared((0..16).collect(), 3, &run))
            }));
            assert!(r.is_err(), "the panic of item {bad} reached the caller");
        }
        // The pool serves the next call whole.
        let ok = pool.install(|| run_shared((0..16).collect(), 3, &|i: usize| i * 2));
        assert_eq!(ok, Some((0..16).map(|i| i * 2).collect()));
    }
}
