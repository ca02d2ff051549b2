//! Miss-ratio curves: the LRU stack distance of every access of a recorded
//! key stream (Mattson et al., 1970), from which the hit rate of an LRU cache
//! of any size follows: an access hits a cache of `c` rows exactly when
//! fewer than `c` other distinct keys were accessed since the previous
//! access to its key.
//!
//! One pass with a Fenwick tree over positions marking each key's latest
//! access: O(n log n) time, O(n) memory.

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use crate::hash::key_hash;

/// Fenwick tree of counts over positions `0..n`.
struct Fenwick(Vec<i32>);

impl Fenwick {
    fn add(&mut self, i: usize, v: i32) {
        let mut i = i + 1;
        while i < self.0.len() {
            self.0[i] += v;
            i += i & i.wrapping_neg();
        }
    }

    /// Sum of positions `0..i`.
    fn prefix(&self, i: usize) -> i64 {
        let (mut i, mut s) = (i, 0i64);
        while i > 0 {
            s += i64::from(self.0[i]);
            i &= i - 1;
        }
        s
    }
}

/// The LRU stack distance of each access of `keys`: the number of distinct
/// other keys accessed since the previous access to the same key, or -1 for
/// a key's first access.
pub fn lru_stack_distances(keys: &[i64]) -> Vec<i64> {
    let n = keys.len();
    let mut tree = Fenwick(vec![0; n + 1]);
    // Each key's latest position.
    let mut last: HashTable<(i64, usize)> = HashTable::new();
    let mut out = Vec::with_capacity(n);
    for (i, &k) in keys.iter().enumerate() {
        match last.entry(key_hash(k), |e| e.0 == k, |e| key_hash(e.0)) {
            Entry::Occupied(mut e) => {
                let p = std::mem::replace(&mut e.get_mut().1, i);
                out.push(tree.prefix(i) - tree.prefix(p + 1));
                tree.add(p, -1);
            }
            Entry::Vacant(e) => {
                e.insert((k, i));
                out.push(-1);
            }
        }
        tree.add(i, 1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, quadratically: distinct keys strictly between the
    /// previous access and this one.
    fn naive(keys: &[i64]) -> Vec<i64> {
        (0..keys.len())
            .map(|i| match keys[..i].iter().rposition(|&k| k == keys[i]) {
                None => -1,
                Some(p) => {
                    let mut seen: Vec<i64> = keys[p + 1..i].to_vec();
                    seen.sort_unstable();
                    seen.dedup();
                    seen.len() as i64
                }
            })
            .collect()
    }

    #[test]
    fn matches_the_definition() {
        let mut x = 12345u64;
        let keys: Vec<i64> = (0..3000)
            .map(|_| {
                x = crate::hash::mix64(x);
                ((x % 97) * (x % 7)) as i64 - 50
            })
            .collect();
        assert_eq!(lru_stack_distances(&keys), naive(&keys));
        assert_eq!(
            lru_stack_distances(&[1, 2, 1, 1, 3, 2]),
            vec![-1, -1, 1, 0, -1, 2]
        );
    }
}
