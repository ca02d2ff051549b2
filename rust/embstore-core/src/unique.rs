//! The distinct keys of a batch and each position's index among them, by
//! hashing in one pass (first-occurrence order): what a tier that routes a
//! batch's keys to their owners computes once per call, in place of a
//! sort-based `np.unique`.

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use crate::error::{Result, invalid, oom};
use crate::hash::key_hash;
use crate::partition::Partition;
use crate::zeroed::{with_room, zeros};

/// What a sharded call sends: its distinct keys grouped by owner rank (in
/// first-occurrence order within a rank), so that they are the send buffer
/// as they are; each position's index among them; and how many go to each
/// rank.
#[derive(Debug)]
pub struct ExchangePlan {
    /// The distinct keys, rank 0's first, then rank 1's...
    pub keys: Vec<i64>,
    /// For each position of the batch, the index of its key in `keys`.
    pub inverse: Vec<i64>,
    /// How many of `keys` each rank owns.
    pub counts: Vec<i64>,
}

/// The exchange plan of a batch over `size` ranks partitioned by
/// `partition`: one hashing pass for the distinct keys, their owners, and a
/// counting sort by owner (no comparison sort, no permutation to apply
/// afterwards: the rows that come back are in `keys`' order).
///
/// # Errors
/// As [`unique_inverse`]; a key outside a "div" partition's key space;
/// `size < 1`.
pub fn plan_exchange(keys: &[i64], partition: &Partition, size: usize) -> Result<ExchangePlan> {
    let (uniq, mut inverse) = unique_inverse(keys)?;
    let mut owner = zeros::<i32>("keys", uniq.len())?;
    partition.owners(&uniq, size, &mut owner)?;
    let mut counts = vec![0i64; size];
    for &o in &owner {
        counts[o as usize] += 1;
    }
    let mut next = vec![0usize; size];
    let mut at = 0usize;
    for (n, c) in next.iter_mut().zip(&counts) {
        *n = at;
        at += *c as usize;
    }
    let mut place = zeros::<u32>("keys", uniq.len())?;
    let mut grouped = zeros::<i64>("keys", uniq.len())?;
    for (j, &o) in owner.iter().enumerate() {
        let p = next[o as usize];
        next[o as usize] += 1;
        place[j] = p as u32;
        grouped[p] = uniq[j];
    }
    for v in &mut inverse {
        *v = i64::from(place[*v as usize]);
    }
    Ok(ExchangePlan {
        keys: grouped,
        inverse,
        counts,
    })
}

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

    #[test]
    fn an_exchange_plan_groups_the_distinct_keys_by_owner() {
        let keys = [5i64, 8, 5, 3, 6, 8, 4, 7];
        let plan = plan_exchange(&keys, &Partition::Mod, 3).unwrap();
        // Owners (key mod 3): 5->2, 8->2, 3->0, 6->0, 4->1, 7->1.
        assert_eq!(plan.keys, [3, 6, 4, 7, 5, 8]);
        assert_eq!(plan.counts, [2, 2, 2]);
        for (i, &k) in keys.iter().enumerate() {
            assert_eq!(plan.keys[plan.inverse[i] as usize], k);
        }
        let div = Partition::Div { key_space: 6 };
        assert!(plan_exchange(&keys, &div, 2).is_err());
        assert!(plan_exchange(&keys, &Partition::Mod, 0).is_err());
        let empty = plan_exchange(&[], &Partition::Hash, 2).unwrap();
        assert_eq!((empty.keys.len(), empty.counts), (0, vec![0, 0]));
    }
}
