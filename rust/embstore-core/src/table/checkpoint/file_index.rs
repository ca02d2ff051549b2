//! The hash index a shard file carries (format [`INDEX_FORMAT`]), so that
//! a reader that maps the file finds a key's row without building an index
//! of its own: a tensor `index` of `cap` slots of two little-endian i64
//! (`cap` a power of two, the index at most 3/4 full), open addressing with
//! linear probing from slot `key_hash(key) & (cap - 1)`, each slot a key
//! and its row number plus one (0: empty). A probe reads one 16-byte slot,
//! four a cache line, and never the file's keys. The file's header metadata names the format and the
//! shard count of the table that saved it (`num_shards`), whose
//! `shard_of(key_hash(key), num_shards)` chose the file's shard (`shard`).

use crate::hash::key_hash;

/// The format name in a file's header metadata (key `index`).
pub(crate) const INDEX_FORMAT: &str = "embstore-index-1";

/// Slots of the index of `n` rows: a power of two above `4n / 3` (so at
/// most 3/4 full, and more than 3/8: 21 to 43 bytes a row on disk), and at
/// least 8.
pub(crate) fn slots_for(n: usize) -> usize {
    (n + n / 3 + 1).next_power_of_two().max(8)
}

/// The index of `keys` (distinct; row `r` holds `keys[r]`), as slots of
/// (key, row + 1).
pub(crate) fn build(keys: &[i64]) -> Vec<[i64; 2]> {
    let cap = slots_for(keys.len());
    let mask = cap - 1;
    let mut slots = vec![[0i64; 2]; cap];
    for (r, &k) in keys.iter().enumerate() {
        let mut i = key_hash(k) as usize & mask;
        while slots[i][1] != 0 {
            i = (i + 1) & mask;
        }
        slots[i] = [k, r as i64 + 1];
    }
    slots
}

/// Where `key` is among `n` rows, through an index of `slots` slots read
/// by `slot(i)` (key, row + 1): `Ok(Some(row))`, `Ok(None)` when absent,
/// `Err` when a slot names a row outside `0..n` or the key's path has no
/// empty slot (a damaged file: probing stops after `slots` slots, so a
/// damaged index cannot hang a reader).
#[inline]
pub(crate) fn find(
    key: i64,
    n: usize,
    slots: usize,
    slot: impl Fn(usize) -> (i64, i64),
) -> Result<Option<usize>, &'static str> {
    let mask = slots - 1;
    let mut i = key_hash(key) as usize & mask;
    for _ in 0..slots {
        match slot(i) {
            (_, 0) => return Ok(None),
            (k, v) if k == key => {
                return match usize::try_from(v.wrapping_sub(1)) {
                    Ok(r) if r < n => Ok(Some(r)),
                    _ => Err("its index names a row outside its rows"),
                };
            }
            _ => {}
        }
        i = (i + 1) & mask;
    }
    Err("its index has no empty slot")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_found_at_its_row_and_others_are_absent() {
        let keys: Vec<i64> = (0..5_000).map(|k| k * 7919 - 1_000_000).collect();
        let ix = build(&keys);
        assert_eq!(ix.len(), slots_for(keys.len()));
        let find_in = |k| find(k, keys.len(), ix.len(), |i| (ix[i][0], ix[i][1]));
        for (r, &k) in keys.iter().enumerate() {
            assert_eq!(find_in(k), Ok(Some(r)));
        }
        for k in [1i64, 2, i64::MAX, i64::MIN] {
            assert_eq!(find_in(k), Ok(None));
        }
    }

    #[test]
    fn a_damaged_index_is_reported_never_followed_forever() {
        let full = [(7i64, 1i64); 8];
        assert!(find(9, 2, 8, |i| full[i]).is_err());
        let past = [(9i64, 3i64); 8];
        assert!(find(9, 2, 8, |i| past[i]).is_err());
        let negative = [(9i64, -5i64); 8];
        assert!(find(9, 2, 8, |i| negative[i]).is_err());
        let lowest = [(9i64, i64::MIN); 8];
        assert!(find(9, 2, 8, |i| lowest[i]).is_err());
    }
}
