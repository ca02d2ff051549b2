//! The hash index a shard file carries (format [`INDEX_FORMAT`]), so that
//! a reader that maps the file finds a key's row without building an index
//! of its own: a tensor `index` of `cap` slots of two little-endian i64
//! (`cap` a power of two, the index at most 3/4 full), open addressing with
//! linear probing from slot `key_hash(key) & (cap - 1)`, each slot a key
//! and its row number plus one (0: empty). A probe reads one 16-byte slot,
//! four a cache line, and never the file's keys. The file's header metadata names the format and the
//! shard count of the table that saved it (`num_shards`), whose
//! `shard_of(key_hash(key), num_shards)` chose the file's shard (`shard`).

use crate::hash::{key_hash, shard_of};
use std::collections::HashMap;

/// The format name in a file's header metadata (key `index`).
pub(crate) const INDEX_FORMAT: &str = "embstore-index-1";

/// Slots of the index of `n` rows: a power of two above `4n / 3` (so at
/// most 3/4 full, and more than 3/8: 21 to 43 bytes a row on disk), and at
/// least 8.
pub(crate) fn slots_for(n: usize) -> usize {
    // Saturating: `n` may come from a crafted manifest (a count no file
    // holds, refused when the shapes are compared).
    n.saturating_add(n / 3)
        .saturating_add(1)
        .checked_next_power_of_two()
        .unwrap_or(usize::MAX)
        .max(8)
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

/// A file's place in its table (header metadata `num_shards` and `shard`)
/// when it carries an index of [`INDEX_FORMAT`]; `Ok(None)` when it has
/// none (written by an older embstore).
///
/// # Errors
/// What is wrong with the metadata (another index format, a count that
/// is not one, a shard outside the table's).
pub(crate) fn placement(
    info: &HashMap<String, String>,
) -> std::result::Result<Option<(usize, usize)>, String> {
    match info.get("index").map(String::as_str) {
        None => return Ok(None),
        Some(INDEX_FORMAT) => {}
        Some(other) => {
            return Err(format!(
                "header metadata index {other:?} is not {INDEX_FORMAT:?}"
            ));
        }
    }
    let num = |name: &str| -> std::result::Result<usize, String> {
        info.get(name)
            .and_then(|v| v.parse::<usize>().ok())
            .ok_or_else(|| format!("header metadata {name:?} is not a count"))
    };
    let (shards, shard) = (num("num_shards")?, num("shard")?);
    if !(1..=crate::format::MAX_SHARDS).contains(&shards) || shard >= shards {
        return Err(format!("shard {shard} of {shards}: not a shard"));
    }
    Ok(Some((shard, shards)))
}

/// Checks a file's keys and index against each other and its header:
/// every key is of the file's `shard` (of `shards`), the index finds every
/// key at its own row (so keys are distinct), and holds no other entry. A
/// file that passes answers every probe as its keys tensor does: a crafted
/// index cannot serve one key's row for another, nor hide a key.
/// O(n) probes, run once per file (a load's check pass, a mapped file's
/// first read).
///
/// # Errors
/// What is wrong, naming the first row or slot found wrong.
pub(crate) fn check_layout(
    n: usize,
    key: impl Fn(usize) -> i64,
    slots: usize,
    slot: impl Fn(usize) -> (i64, i64),
    (shard, shards): (usize, usize),
) -> std::result::Result<(), String> {
    if slots != slots_for(n) {
        return Err(format!(
            "its index has {slots} slots, {n} rows need {}",
            slots_for(n)
        ));
    }
    for r in 0..n {
        let k = key(r);
        if shard_of(key_hash(k), shards) != shard {
            return Err(format!(
                "key {k} (row {r}) is not of shard {shard} of {shards}, as its header says"
            ));
        }
        match find(k, n, slots, &slot)? {
            Some(got) if got == r => {}
            Some(got) => {
                return Err(format!(
                    "its index finds key {k} at row {got}, its keys hold it at row {r} (a \
                     duplicate key, or an index naming another key's row)"
                ));
            }
            None => return Err(format!("its index does not find key {k} (row {r})")),
        }
    }
    let used = (0..slots).filter(|&i| slot(i).1 != 0).count();
    if used != n {
        return Err(format!("its index holds {used} entries for {n} rows"));
    }
    Ok(())
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

    fn index_of(keys: &[i64]) -> Vec<[i64; 2]> {
        build(keys)
    }

    #[test]
    fn a_layout_check_passes_what_build_writes_and_refuses_crafted_indexes() {
        let keys: Vec<i64> = (0..400)
            .filter(|&k| shard_of(key_hash(k), 3) == 1)
            .collect();
        let n = keys.len();
        let check = |keys: &[i64], ix: &[[i64; 2]], place| {
            check_layout(n, |r| keys[r], ix.len(), |i| (ix[i][0], ix[i][1]), place)
        };
        let ix = index_of(&keys);
        check(&keys, &ix, (1, 3)).unwrap();
        // Another shard's header.
        assert!(
            check(&keys, &ix, (0, 3))
                .unwrap_err()
                .contains("not of shard")
        );
        // A slot naming another key's row.
        let mut bad = ix.clone();
        let i = bad.iter().position(|s| s[1] == 1).unwrap();
        bad[i][1] = 2;
        assert!(check(&keys, &bad, (1, 3)).is_err());
        // An extra entry for a key the file does not hold.
        let mut bad = ix.clone();
        let i = bad.iter().position(|s| s[1] == 0).unwrap();
        bad[i] = [i64::MIN, 1];
        assert!(check(&keys, &bad, (1, 3)).unwrap_err().contains("entries"));
        // A duplicate key in the keys tensor.
        let mut dup = keys.clone();
        dup[1] = dup[0];
        assert!(check(&dup, &index_of(&dup), (1, 3)).is_err());
        // An index of the wrong size.
        assert!(check(&keys, &ix[..ix.len() / 2], (1, 3)).is_err());
    }

    #[test]
    fn slots_for_a_crafted_count_saturates_instead_of_overflowing() {
        assert_eq!(slots_for(0), 8);
        assert_eq!(slots_for(6), 16);
        assert_eq!(slots_for(usize::MAX), usize::MAX);
        assert_eq!(slots_for(usize::MAX / 2), usize::MAX);
    }

    #[test]
    fn placement_reads_the_header_or_says_what_is_wrong() {
        let mut info = HashMap::new();
        assert_eq!(placement(&info), Ok(None));
        info.insert("index".to_string(), INDEX_FORMAT.to_string());
        info.insert("num_shards".to_string(), "4".to_string());
        info.insert("shard".to_string(), "3".to_string());
        assert_eq!(placement(&info), Ok(Some((3, 4))));
        info.insert("shard".to_string(), "4".to_string());
        assert!(placement(&info).is_err());
        info.insert("index".to_string(), "other".to_string());
        assert!(placement(&info).is_err());
    }
}
