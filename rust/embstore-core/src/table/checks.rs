//! Checks every batch call makes before it changes anything: finite
//! values, bounded gradient sums, lengths, and the transient memory a call
//! needs.

use crate::error::{Result, invalid, oom};
pub(crate) use crate::rows::check_len;
pub use crate::rows::{check_finite, check_finite_max};
use crate::table::storage::pages;
use rayon::iter::{IndexedParallelIterator, IntoParallelRefIterator, ParallelIterator};
use rayon::prelude::ParallelSliceMut;

/// The summed gradient of one key may not exceed this in magnitude: beyond
/// it the squared-gradient state of Adagrad, Adam and FTRL overflows
/// float32 (1e18 squared is 1e36, float32's largest value about 3.4e38).
pub const MAX_GRAD_SUM: f64 = 1e18;

/// Refuses a gradient call whose summed gradient of some key would exceed
/// [`MAX_GRAD_SUM`] in magnitude. Position `i` of `keys` contributes at most
/// `bound(i)` to each column of its key's sum; `max_bound` bounds them all.
/// Cheap when `max_bound * keys.len()` is within the limit (always, for
/// gradients of any sane size); else exact per key. Returns a bound on
/// every key's summed gradient (what a step's non-finite check starts from).
///
/// # Errors
/// `InvalidArgument` naming `arg` and the key.
pub(crate) fn check_grad_sums(
    arg: &'static str,
    keys: &[i64],
    max_bound: f64,
    bound: impl Fn(usize) -> f64 + Sync,
) -> Result<f64> {
    let cheap = max_bound * keys.len() as f64;
    if cheap <= MAX_GRAD_SUM {
        return Ok(cheap);
    }
    let mut sums: Vec<(i64, f64)> = keys
        .par_iter()
        .enumerate()
        .map(|(i, &k)| (k, bound(i)))
        .collect();
    sums.par_sort_unstable_by_key(|p| p.0);
    let mut j = 0;
    let mut most = 0.0f64;
    while j < sums.len() {
        let key = sums[j].0;
        let mut total = 0.0f64;
        while j < sums.len() && sums[j].0 == key {
            total += sums[j].1;
            j += 1;
        }
        if total > MAX_GRAD_SUM {
            return Err(invalid(
                arg,
                format!(
                    "the gradients of key {key} sum to up to {total:e} in magnitude, more than \
                     {MAX_GRAD_SUM:e} (the optimizer state would overflow float32); nothing changed"
                ),
            ));
        }
        most = most.max(total);
    }
    Ok(most)
}

/// Batches of more keys than this check, before they start, that the
/// memory of their per-key work arrays is available (below it the check
/// would cost more than it could save).
pub(crate) const TRANSIENT_CHECK_KEYS: usize = 1 << 20;

/// Bytes of per-key work arrays a batch call may hold at once (plan,
/// positions, rows found, coefficients, and the resolved rows of a pooling
/// chunk, 16 bytes an id, which for a call of one huge bag is every id).
pub(crate) const TRANSIENT_BYTES_PER_KEY: usize = 56;

/// Refuses a batch of `n` keys whose work arrays do not fit in the memory
/// available (an allocation that fails would abort the process).
///
/// # Errors
/// `OutOfMemory` naming `arg`.
pub(crate) fn check_transient(arg: &'static str, n: usize) -> Result<()> {
    if n < TRANSIENT_CHECK_KEYS {
        return Ok(());
    }
    let need = n.saturating_mul(TRANSIENT_BYTES_PER_KEY);
    match pages::available_memory() {
        Some(avail) if need > avail => Err(oom(arg, need)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_values_are_refused_by_name() {
        assert!(check_finite("grads", &[1.0, -2.0]).is_ok());
        let e = check_finite("grads", &[1.0, f32::NAN])
            .unwrap_err()
            .to_string();
        assert!(e.contains("grads"), "{e}");
        assert!(check_finite_max("grads", &[f32::INFINITY]).is_err());
        assert_eq!(check_finite_max("grads", &[1.0, -3.0, 2.0]).unwrap(), 3.0);
    }

    #[test]
    fn lengths_must_match() {
        assert!(check_len("values", 6, 6).is_ok());
        let e = check_len("values", 6, 5).unwrap_err().to_string();
        assert!(
            e.contains("values") && e.contains('6') && e.contains('5'),
            "{e}"
        );
    }

    #[test]
    fn small_batches_need_no_memory_check() {
        assert!(check_transient("keys", 10).is_ok());
    }
}
