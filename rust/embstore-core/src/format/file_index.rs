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
    find_hashed(key, key_hash(key), n, slots, slot)
}

/// [`find`] of a key whose hash (`key_hash(key)`) the caller has.
#[inline]
pub(crate) fn find_hashed(
    key: i64,
    hash: u64,
    n: usize,
    slots: usize,
    slot: impl Fn(usize) -> (i64, i64),
) -> Result<Option<usize>, &'static str> {
    let mask = slots - 1;
    let mut i = hash as usize & mask;
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
/// none (written by an older embstore, which wrote neither the metadata
/// nor a tensor named `index`: `has_index` says whether the file holds
/// that tensor).
///
/// # Errors
/// What is wrong with the metadata (another index format, a count that
/// is not one, a shard outside the table's), or an `index` tensor without
/// the metadata naming its format: a damaged file, not an older one (a
/// load took it for one and loaded it, where a mapped read refused it as
/// one to convert: a fuzz case).
pub(crate) fn placement(
    info: &HashMap<String, String>,
    has_index: bool,
) -> std::result::Result<Option<(usize, usize)>, String> {
    match info.get("index").map(String::as_str) {
        None if has_index => {
            return Err(format!(
                "it holds an index tensor, but its header metadata does not name the \
                 index's format ({INDEX_FORMAT})"
            ));
        }
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
///
/// One pass over the slots in order, not a probe a key: each entry must
/// name a row holding its key and lie in the run of occupied slots where
/// its key's probe starts, at or after that start (so the probe reaches it
/// passing no empty slot), with no other entry of its key in the run
/// (which a probe would find first; two entries of one row are two of its
/// key). With `n` entries in all, that is what probing every key checks,
/// but read in order where the probes read the index at random (the lines
/// of a mapped file's first read), and in work about linear however long
/// the runs (a sort of each run), where the probes were quadratic in a run
/// a crafted file made long. Run once per file (a load's check pass, a
/// mapped file's first read).
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
    }
    let used = (0..slots).filter(|&i| slot(i).1 != 0).count();
    if used != n {
        return Err(format!("its index holds {used} entries for {n} rows"));
    }
    // `slots` > n (`slots_for`), so some slot is empty: the walk starts
    // after one, and no run of occupied slots wraps past its end.
    let Some(empty) = (0..slots).find(|&i| slot(i).1 == 0) else {
        return Err("its index has no empty slot".into());
    };
    let mask = slots - 1;
    // Walk positions: slot `(empty + 1 + p) & mask` is at position `p`.
    let at = |i: usize| i.wrapping_sub(empty + 1) & mask;
    // The current run's first position and its keys.
    let mut run_start = 0;
    let mut run: Vec<i64> = Vec::new();
    for p in 0..slots {
        let i = (empty + 1 + p) & mask;
        let (k, v) = slot(i);
        if v == 0 {
            no_repeats(&mut run)?;
            run_start = p + 1;
            continue;
        }
        let r = match usize::try_from(v.wrapping_sub(1)) {
            Ok(r) if r < n => r,
            _ => return Err("its index names a row outside its rows".into()),
        };
        if key(r) != k {
            return Err(format!(
                "its index holds key {k} for row {r}, whose key is {} (an index naming \
                 another key's row)",
                key(r)
            ));
        }
        let home = at(key_hash(k) as usize & mask);
        if home < run_start || home > p {
            return Err(format!("its index does not find key {k} (row {r})"));
        }
        // A run a crafted file made long is as long as its keys: the
        // memory for it is asked for, never assumed.
        run.try_reserve(1)
            .map_err(|_| format!("no memory to check a run of {} index entries", run.len()))?;
        run.push(k);
    }
    no_repeats(&mut run)
}

/// Refuses a run of occupied index slots holding a key twice (a probe
/// finds the first, so the other's row is hidden: the keys repeat), and
/// empties `run` for the next.
fn no_repeats(run: &mut Vec<i64>) -> std::result::Result<(), String> {
    if run.len() > 1 {
        run.sort_unstable();
        if let Some(w) = run.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!(
                "its index finds key {} at two rows (a duplicate key)",
                w[0]
            ));
        }
    }
    run.clear();
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

    /// The check as a reader would make it, key by key: every row's key
    /// probed for, found at its row, and no other entry.
    fn check_by_probes(n: usize, keys: &[i64], ix: &[[i64; 2]]) -> bool {
        let slot = |i: usize| (ix[i][0], ix[i][1]);
        (0..n).all(|r| find(keys[r], n, ix.len(), slot) == Ok(Some(r)))
            && (0..ix.len()).filter(|&i| ix[i][1] != 0).count() == n
    }

    /// The one-pass check refuses exactly what probing each key refuses,
    /// over indexes damaged at random: entries moved, swapped, emptied,
    /// pointed at other rows, duplicated; keys repeated; runs of slots
    /// that wrap past the index's end.
    #[test]
    fn the_one_pass_check_agrees_with_probing_every_key() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: usize| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % m as u64) as usize
        };
        let (mut refused, mut passed) = (0, 0);
        for case in 0..3_000 {
            let n = 1 + next(40);
            let mut keys: Vec<i64> = (0..n).map(|_| next(60) as i64 - 30).collect();
            keys.sort_unstable();
            keys.dedup();
            let n = keys.len();
            let mut ix = build(&keys);
            let mut ks = keys.clone();
            let len = ix.len();
            for _ in 0..next(3) {
                match next(7) {
                    0 => ix.swap(next(len), next(len)),
                    1 => ix[next(len)] = [0, 0],
                    2 => ix[next(len)][1] = next(n + 2) as i64,
                    3 => {
                        let i = next(len);
                        ix[(i + 1) % len] = ix[i];
                    }
                    4 => ix[next(len)][0] = keys[next(n)],
                    5 if n > 1 => ks[next(n)] = ks[next(n)],
                    _ => ix.rotate_left(1),
                }
            }
            let want = check_by_probes(n, &ks, &ix);
            let got = check_layout(n, |r| ks[r], len, |i| (ix[i][0], ix[i][1]), (0, 1));
            assert_eq!(
                got.is_ok(),
                want,
                "case {case}: {got:?}, keys {ks:?}, index {ix:?}"
            );
            if want {
                passed += 1;
            } else {
                refused += 1;
            }
        }
        assert!(
            refused > 500 && passed > 500,
            "{refused} refused, {passed} passed"
        );
    }

    /// A run of entries a crafted file made nearly as long as its keys is
    /// checked reading each slot a bounded number of times (a probe a key
    /// read about 3n^2/8 slots: 10^9 for these 50,000 keys).
    #[test]
    fn a_long_run_of_entries_is_checked_in_linear_work() {
        let n = 50_000;
        let slots = slots_for(n);
        let mask = slots - 1;
        // Keys whose probes start in the first n/4 slots, laid out as
        // linear probing places them: one run of about n entries.
        let mut keys: Vec<(usize, i64)> = (0i64..)
            .map(|k| (key_hash(k) as usize & mask, k))
            .filter(|&(h, _)| h < n / 4)
            .take(n)
            .collect();
        keys.sort_unstable();
        let mut ix = vec![[0i64; 2]; slots];
        let mut last = None;
        for (r, &(h, k)) in keys.iter().enumerate() {
            let at = last.map_or(h, |l: usize| h.max(l + 1));
            ix[at] = [k, r as i64 + 1];
            last = Some(at);
        }
        let longest = last.unwrap() - keys[0].0;
        assert!(longest > n * 9 / 10, "a run of {longest}");
        let reads = std::cell::Cell::new(0usize);
        let slot = |i: usize| {
            reads.set(reads.get() + 1);
            (ix[i][0], ix[i][1])
        };
        check_layout(n, |r| keys[r].1, slots, slot, (0, 1)).unwrap();
        assert!(
            reads.get() <= 3 * slots,
            "{} reads of {slots} slots",
            reads.get()
        );
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
        // An older file: neither the metadata nor the tensor.
        assert_eq!(placement(&info, false), Ok(None));
        // The tensor without the metadata: damaged, not older.
        assert!(placement(&info, true).unwrap_err().contains("index tensor"));
        info.insert("index".to_string(), INDEX_FORMAT.to_string());
        info.insert("num_shards".to_string(), "4".to_string());
        info.insert("shard".to_string(), "3".to_string());
        assert_eq!(placement(&info, true), Ok(Some((3, 4))));
        info.insert("shard".to_string(), "4".to_string());
        assert!(placement(&info, true).is_err());
        info.insert("index".to_string(), "other".to_string());
        assert!(placement(&info, true).is_err());
    }
}
