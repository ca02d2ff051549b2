//! The distinct keys of a batch and each position's index among them, by
//! hashing in one pass (first-occurrence order): what a tier that routes a
//! batch's keys to their owners computes once per call, in place of a
//! sort-based `np.unique`.

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use crate::error::{Result, invalid, oom};
use crate::hash::key_hash;
use crate::zeroed::with_room;

/// The distinct values of `keys`, in the order they first occur, and for
/// each position of `keys` the index of its value among them (so that
/// `uniq[inverse[i]] == keys[i]`).
///
/// # Errors
/// `InvalidArgument` for more than `u32::MAX` keys; `OutOfMemory` naming
/// `keys` when the work arrays cannot be had.
pub fn unique_inverse(keys: &[i64]) -> Result<(Vec<i64>, Vec<i64>)> {
    let n = keys.len();
    if n > u32::MAX as usize {
        return Err(invalid(
            "keys",
            format!("expected at most 2^32 - 1 keys, got {n}"),
        ));
    }
    let hasher = |&(k, _): &(i64, u32)| key_hash(k);
    let mut seen: HashTable<(i64, u32)> = HashTable::new();
    seen.try_reserve(n, hasher)
        .map_err(|_| oom("keys", n as u128 * 24))?;
    let mut uniq = with_room("keys", n)?;
    let mut inverse = with_room("keys", n)?;
    for &k in keys {
        let j = match seen.entry(key_hash(k), |&(x, _)| x == k, hasher) {
            Entry::Occupied(e) => e.get().1,
            Entry::Vacant(e) => {
                let j = uniq.len() as u32;
                e.insert((k, j));
                uniq.push(k);
                j
            }
        };
        inverse.push(i64::from(j));
    }
    Ok((uniq, inverse))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_keys_in_first_occurrence_order_and_every_position_maps_back() {
        let keys = [5i64, -1, 5, i64::MIN, 7, -1, i64::MAX, 5];
        let (uniq, inverse) = unique_inverse(&keys).unwrap();
        assert_eq!(uniq, [5, -1, i64::MIN, 7, i64::MAX]);
        assert_eq!(inverse, [0, 1, 0, 2, 3, 1, 4, 0]);
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(uniq[inverse[i] as usize], k);
        }
        assert_eq!(unique_inverse(&[]).unwrap(), (vec![], vec![]));
    }
}
