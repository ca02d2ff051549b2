//! The host's map of a device cache: which key each slot (row of the
//! device's row array) holds, each slot's accesses, and the cache's eviction
//! policy, so that a serving call finds its hits, chooses the slots of the
//! rows it admits and tells the device where every row is in one pass on the
//! host, with no read back from the device (`embstore.gpu.ServingCache`).
//!
//! Slots are grouped in buckets of [`BUCKET`] slots, a key's bucket fixed by
//! its hash (as HierarchicalKV and the device index group theirs): a key
//! admitted takes a free slot of its bucket, else the slot of its bucket
//! with the lowest score (accesses for "lfu", the last call for "lru") that
//! the running call has not read; with none to give it is not admitted.
//! Buckets are split in up to [`PARTS`] partitions of whole buckets, so that
//! [`SlotMap::serve`] runs each partition's keys on one thread, the only one
//! to touch its partition's slots (no atomics, no lock): the calling thread
//! takes partitions one at a time and pool threads take the rest as they
//! wake (a serving call of 2,000 keys is done in about the time two
//! wake-ups take, so it never waits for one before it starts). A bucket's
//! keys are handled in the order of their positions either way, so the
//! result is the same on any number of threads.
//!
//! A probe reads two lines that its key alone does not name: the bucket's
//! digests, then the slot whose digest matches (a 32-slot bucket spans 8
//! lines). Both are asked for ahead, the digests [`AHEAD`] keys before the
//! probe and the matching slot [`NEAR`] keys before it, once its digests
//! are in cache; an admission's whole bucket a few misses before it.

use crate::par::run_shared;

use crate::error::{Result, invalid};
use crate::hash::{key_hash, mix64};
use crate::simd::prefetch_addr;
use crate::zeroed::{Zeroable, with_room, zeros};

mod part;

/// Slots a bucket: 32 digests (half a cache line), compared as 4 words.
pub const BUCKET: usize = 32;

/// Partitions at most (see the module).
pub const PARTS: usize = 16;

/// Keys of a call below which [`SlotMap::serve`] runs on the calling thread
/// alone (from it, pool threads help).
const PARALLEL_KEYS: usize = 512;

/// Keys whose buckets' digests are asked for ahead of their probe.
const AHEAD: usize = 16;

/// Keys whose matching slot is asked for ahead of their probe (its
/// digests, asked for `AHEAD - NEAR` keys earlier, read to find it).
const NEAR: usize = 8;

/// Misses whose buckets are asked for whole ahead of their admission.
const ADMIT_AHEAD: usize = 4;

/// A slot: its key, the low 32 bits of the last call (tick) that read or
/// admitted it, and its accesses since it was admitted (meaningful where its
/// digest is not 0): 16 bytes, 4 slots a cache line. Ages are taken modulo
/// 2^32 calls, so a slot left unread for 2^32 calls (about 5 days at 10,000
/// calls a second) counts as read recently again: an eviction order a little
/// off, never a wrong row.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
struct Slot {
    key: i64,
    last: u32,
    count: u32,
}

// SAFETY: `Slot` is plain integers (and padding); all zero bytes is a valid
// value of each field.
unsafe impl Zeroable for Slot {}

/// Which key each slot of a fixed array of slots holds (see the module).
#[derive(Debug)]
pub struct SlotMap {
    /// A byte of each slot's key hash (never 0), 0 where the slot is free:
    /// a bucket's are compared at once before any key is.
    digest: Vec<u8>,
    slots: Vec<Slot>,
    buckets: usize,
    /// Buckets a partition.
    per_part: usize,
    lru: bool,
    len: usize,
}

/// What [`SlotMap::serve`] found and chose for a call's keys.
#[derive(Debug, Default)]
pub struct Served {
    /// Each key's slot, or `-1 - j` for the key of `miss_keys[j]`.
    pub src: Vec<i32>,
    /// The keys not held (a key repeated, as often as it is).
    pub miss_keys: Vec<i64>,
    /// Their positions among the call's keys.
    pub miss_pos: Vec<i64>,
    /// Their rows, `miss_keys.len() * dim` floats, from the fetch.
    pub rows: Vec<f32>,
    /// Whether the fetch found each.
    pub found: Vec<bool>,
    /// Slots given to misses the fetch found...
    pub adm_slot: Vec<i32>,
    /// ...and the index among the misses of the row each takes.
    pub adm_row: Vec<i32>,
    /// Keys evicted to make room.
    pub evicted: usize,
}

/// The rows of missed keys, as [`crate::mapped::MappedReader::lookup`]
/// gives them: `(keys, rows out, found out)`.
pub type Fetch<'a> = dyn Fn(&[i64], &mut [f32], &mut [bool]) -> Result<()> + Sync + 'a;

/// What a serving call asks of each partition.
#[derive(Clone, Copy)]
struct Call<'a> {
    tick: u64,
    admit: bool,
    dim: usize,
    fetch: &'a Fetch<'a>,
}

/// A partition's slots (whole buckets), for the thread that owns them.
struct Part<'a> {
    digest: &'a mut [u8],
    slots: &'a mut [Slot],
    /// The global index of its first slot.
    base: usize,
    lru: bool,
}

/// What a partition's thread found for its keys (positions ascending).
#[derive(Default)]
struct PartOut {
    hits: Vec<(u32, i32)>,
    miss_pos: Vec<u32>,
    miss_keys: Vec<i64>,
    rows: Vec<f32>,
    found: Vec<bool>,
    /// (global slot, index among this partition's misses).
    adm: Vec<(i32, u32)>,
    evicted: usize,
    added: usize,
}

/// The slots of word `i` of a bucket's digests whose digest is `d`: bit
/// 8j + 7 for slot 8i + j (8 digests compared a byte at a time, exactly: no
/// carry crosses a byte).
#[inline]
fn matches(digest: &[u8], at: usize, i: usize, d: u8) -> u64 {
    const LOW7: u64 = 0x7F7F_7F7F_7F7F_7F7F;
    let b: [u8; 8] = digest[at + 8 * i..at + 8 * i + 8]
        .try_into()
        .unwrap_or_default();
    let x = u64::from_le_bytes(b) ^ (u64::from(d) * 0x0101_0101_0101_0101);
    !(((x & LOW7) + LOW7) | x | LOW7)
}

/// The slot of `key` in the bucket at `at` of `digest` and `slots`, if
/// held: the slots whose digest is `d`, their keys compared.
#[inline]
fn slot_in(digest: &[u8], slots: &[Slot], at: usize, d: u8, key: i64) -> Option<usize> {
    for i in 0..BUCKET / 8 {
        let mut m = matches(digest, at, i, d);
        while m != 0 {
            let s = at + 8 * i + (m.trailing_zeros() / 8) as usize;
            if slots[s].key == key {
                return Some(s);
            }
            m &= m - 1;
        }
    }
    None
}

impl SlotMap {
    /// Slots for at least `rows` keys (rounded up to whole buckets of
    /// [`BUCKET`] slots, and to whole partitions), evicting by accesses
    /// (`lru = false`) or last use.
    ///
    /// # Errors
    /// `InvalidArgument` naming `rows` (over 2^31 - 1 slots);
    /// `OutOfMemory` naming `rows`.
    pub fn new(rows: usize, lru: bool) -> Result<Self> {
        let buckets = rows.div_ceil(BUCKET).max(1);
        let parts = buckets.min(PARTS);
        let per_part = buckets.div_ceil(parts);
        let buckets = per_part * parts;
        let cap = buckets
            .checked_mul(BUCKET)
            .filter(|&c| c <= i32::MAX as usize)
            .ok_or_else(|| {
                invalid(
                    "rows",
                    format!("expected at most 2^31 - 1 slots, got {rows}"),
                )
            })?;
        let slots: Vec<Slot> = zeros("rows", cap)?;
        // Probes land all over the slots: on huge pages they miss the TLB
        // far less (an index's advice, from 4 MiB: 262,144 slots).
        crate::huge::advise_huge(slots.as_ptr().cast(), size_of_val(&slots[..]), true);
        Ok(SlotMap {
            digest: zeros("rows", cap)?,
            slots,
            buckets,
            per_part,
            lru,
            len: 0,
        })
    }

    /// Slots in all (the device's rows).
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Slots in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no slot is in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The global bucket of `key` and its digest.
    #[inline]
    fn place(&self, key: i64) -> (usize, u8) {
        let h = mix64(key_hash(key) ^ 0x3C6E_F372_FE94_F82B);
        let b = (((h >> 32) * self.buckets as u64) >> 32) as usize;
        let d = (h & 0xFF) as u8;
        (b, if d == 0 { 1 } else { d })
    }

    /// Every slot as one partition.
    fn whole(&mut self) -> Part<'_> {
        Part {
            digest: &mut self.digest,
            slots: &mut self.slots,
            base: 0,
            lru: self.lru,
        }
    }

    /// The slot of `key`, if held.
    pub fn get(&self, key: i64) -> Option<u32> {
        let (b, d) = self.place(key);
        slot_in(&self.digest, &self.slots, b * BUCKET, d, key).map(|s| s as u32)
    }

    /// A serving call's keys in call `tick`: each key's slot (an access
    /// counted for each held one), the misses' rows from `fetch` (one
    /// call a partition, on that partition's thread), and with `admit` the
    /// misses `fetch` found admitted, never into a slot the call reads (see
    /// [`Served`]). A call of [`PARALLEL_KEYS`] keys or more runs its
    /// partitions in parallel.
    ///
    /// # Errors
    /// What `fetch` returns (nothing of the call applied but the accesses
    /// and admissions of partitions already done: the map stays whole);
    /// `OutOfMemory` naming `keys`; `InvalidArgument` for more than 2^31 - 1
    /// keys.
    pub fn serve(
        &mut self,
        keys: &[i64],
        tick: u64,
        admit: bool,
        dim: usize,
        fetch: &Fetch<'_>,
    ) -> Result<Served> {
        let n = keys.len();
        if n > i32::MAX as usize {
            return Err(invalid(
                "keys",
                format!("expected at most 2^31 - 1 keys, got {n}"),
            ));
        }
        // Each key's partition and place; positions grouped by partition
        // (a counting sort: ascending within each).
        let parts = self.buckets / self.per_part;
        let mut part_of = with_room::<u32>("keys", n)?;
        let mut places = with_room::<(u32, u8)>("keys", n)?;
        let mut counts = vec![0usize; parts + 1];
        for &k in keys {
            let (b, d) = self.place(k);
            let p = b / self.per_part;
            part_of.push(p as u32);
            places.push((((b - p * self.per_part) * BUCKET) as u32, d));
            counts[p + 1] += 1;
        }
        for p in 0..parts {
            counts[p + 1] += counts[p];
        }
        let mut next = counts.clone();
        let mut pos = zeros::<u32>("keys", n)?;
        let mut grouped = with_room::<(u32, u8)>("keys", n)?;
        grouped.resize(n, (0, 0));
        for i in 0..n {
            let p = part_of[i] as usize;
            pos[next[p]] = i as u32;
            grouped[next[p]] = places[i];
            next[p] += 1;
        }
        let span = self.per_part * BUCKET;
        let lru = self.lru;
        let work: Vec<_> = self
            .digest
            .chunks_mut(span)
            .zip(self.slots.chunks_mut(span))
            .enumerate()
            .map(|(p, (digest, slots))| {
                let part = Part {
                    digest,
                    slots,
                    base: p * span,
                    lru,
                };
                let r = counts[p]..counts[p + 1];
                (part, &pos[r.clone()], &grouped[r])
            })
            .filter(|(_, pos, _)| !pos.is_empty())
            .collect();
        let call = Call {
            tick,
            admit,
            dim,
            fetch,
        };
        let run = |(mut part, pos, places): (Part<'_>, &[u32], &[(u32, u8)])| {
            part.serve(keys, pos, places, &call)
        };
        // The calling thread serves partitions itself, pool threads
        // helping as they wake (with one pool thread, none: handing a call
        // over costs two wake-ups and runs nothing beside it).
        let helpers = (rayon::current_num_threads() - 1).min(work.len().saturating_sub(1));
        let outs: Vec<Result<PartOut>> = if n >= PARALLEL_KEYS && helpers > 0 {
            run_shared(work, helpers, &run)
                .ok_or_else(|| invalid("keys", "a partition of the call did not run"))?
        } else {
            work.into_iter().map(run).collect()
        };
        let outs = outs.into_iter().collect::<Result<Vec<PartOut>>>()?;
        self.merge(n, dim, outs)
    }

    /// The partitions' outputs as one [`Served`] (misses numbered by
    /// partition, then position).
    fn merge(&mut self, n: usize, dim: usize, outs: Vec<PartOut>) -> Result<Served> {
        let m: usize = outs.iter().map(|o| o.miss_keys.len()).sum();
        let a: usize = outs.iter().map(|o| o.adm.len()).sum();
        let mut s = Served {
            src: zeros("keys", n)?,
            miss_keys: with_room("keys", m)?,
            miss_pos: with_room("keys", m)?,
            rows: with_room("keys", m * dim)?,
            found: with_room("keys", m)?,
            adm_slot: with_room("keys", a)?,
            adm_row: with_room("keys", a)?,
            evicted: 0,
        };
        for o in outs {
            let j0 = s.miss_keys.len();
            for &(p, slot) in &o.hits {
                s.src[p as usize] = slot;
            }
            for (j, &p) in o.miss_pos.iter().enumerate() {
                s.src[p as usize] = -1 - (j0 + j) as i32;
                s.miss_pos.push(i64::from(p));
            }
            s.miss_keys.extend_from_slice(&o.miss_keys);
            s.rows.extend_from_slice(&o.rows);
            s.found.extend_from_slice(&o.found);
            for &(slot, j) in &o.adm {
                s.adm_slot.push(slot);
                s.adm_row.push((j0 + j as usize) as i32);
            }
            s.evicted += o.evicted;
            self.len += o.added;
        }
        Ok(s)
    }

    /// Each key's slot into `slots` (-1 where not held), an access counted
    /// in call `tick` for each key found (a key repeated counts each time);
    /// returns how many were not held.
    ///
    /// # Errors
    /// `InvalidArgument` naming `slots` if its length differs from `keys`'.
    pub fn find(&mut self, keys: &[i64], tick: u64, slots: &mut [i32]) -> Result<usize> {
        check_slots(keys, slots)?;
        let mut misses = 0;
        for (&k, out) in keys.iter().zip(slots.iter_mut()) {
            let (b, d) = self.place(k);
            let mut w = self.whole();
            match w.slot_in(b * BUCKET, d, k) {
                Some(s) => {
                    w.touch(s, tick);
                    *out = s as i32;
                }
                None => {
                    *out = -1;
                    misses += 1;
                }
            }
        }
        Ok(misses)
    }

    /// Admits `keys` in call `tick`, in order: each key's slot into `slots`
    /// (-1: held already, e.g. a key repeated, or its bucket had no slot to
    /// give), and the keys evicted to make room appended to `evicted`. A slot
    /// read or admitted in calls `protect_from` and after is never given, so
    /// the rows a running call reads stay where they are.
    ///
    /// # Errors
    /// `InvalidArgument` naming `slots` if its length differs from `keys`'.
    pub fn admit(
        &mut self,
        keys: &[i64],
        tick: u64,
        protect_from: u64,
        slots: &mut [i32],
        evicted: &mut Vec<i64>,
    ) -> Result<()> {
        check_slots(keys, slots)?;
        for (&k, out) in keys.iter().zip(slots.iter_mut()) {
            *out = -1;
            let (b, d) = self.place(k);
            let mut w = self.whole();
            w.prefetch_bucket(b * BUCKET);
            if let Some((s, old)) = w.admit(k, b * BUCKET, d, tick, protect_from) {
                match old {
                    Some(old) => evicted.push(old),
                    None => self.len += 1,
                }
                *out = s as i32;
            }
        }
        Ok(())
    }

    /// Frees the slots of `keys` that are held; each key's freed slot into
    /// `slots` (-1: not held).
    ///
    /// # Errors
    /// `InvalidArgument` naming `slots` if its length differs from `keys`'.
    pub fn remove(&mut self, keys: &[i64], slots: &mut [i32]) -> Result<()> {
        check_slots(keys, slots)?;
        for (&k, out) in keys.iter().zip(slots.iter_mut()) {
            *out = -1;
            if let Some(s) = self.get(k) {
                let s = s as usize;
                self.digest[s] = 0;
                self.slots[s] = Slot::default();
                self.len -= 1;
                *out = s as i32;
            }
        }
        Ok(())
    }

    /// The keys held and their slots, by slot.
    pub fn items(&self) -> (Vec<i64>, Vec<i64>) {
        let mut keys = Vec::with_capacity(self.len);
        let mut slots = Vec::with_capacity(self.len);
        for (s, (&d, e)) in self.digest.iter().zip(&self.slots).enumerate() {
            if d != 0 {
                keys.push(e.key);
                slots.push(s as i64);
            }
        }
        (keys, slots)
    }

    /// Bytes of the map.
    pub fn nbytes(&self) -> usize {
        self.capacity() * (1 + size_of::<Slot>())
    }
}

fn check_slots(keys: &[i64], slots: &[i32]) -> Result<()> {
    if slots.len() != keys.len() {
        return Err(invalid(
            "slots",
            format!("expected {} slots, got {}", keys.len(), slots.len()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// The keys whose slot is -1, in order.
    fn not_held(keys: &[i64], slots: &[i32]) -> Vec<i64> {
        keys.iter()
            .zip(slots)
            .filter(|(_, s)| **s < 0)
            .map(|(k, _)| *k)
            .collect()
    }

    /// A model of the map: key -> slot, and per slot (key, count, last).
    struct Model {
        slot: HashMap<i64, usize>,
        at: Vec<Option<(i64, u32, u64)>>,
        bucket: usize,
    }

    #[test]
    fn finds_admits_evicts_and_removes_as_a_dict_model_does() {
        for lru in [false, true] {
            let mut m = SlotMap::new(80, lru).unwrap();
            assert_eq!(m.capacity(), 96);
            let mut model = Model {
                slot: HashMap::new(),
                at: vec![None; 96],
                bucket: BUCKET,
            };
            let mut state = 7u64;
            for tick in 1..400u64 {
                let keys: Vec<i64> = (0..24)
                    .map(|_| {
                        state = mix64(state);
                        (state % 180) as i64 - 90
                    })
                    .collect();
                let mut slots = vec![0i32; keys.len()];
                let misses = m.find(&keys, tick, &mut slots).unwrap();
                let mut want_misses = 0;
                for (&k, &s) in keys.iter().zip(&slots) {
                    match model.slot.get(&k) {
                        Some(&ms) => {
                            assert_eq!(s as usize, ms);
                            let e = model.at[ms].as_mut().unwrap();
                            e.1 = e.1.saturating_add(1);
                            e.2 = tick;
                        }
                        None => {
                            assert_eq!(s, -1);
                            want_misses += 1;
                        }
                    }
                }
                assert_eq!(misses, want_misses);
                let miss = not_held(&keys, &slots);
                let mut got = vec![0i32; miss.len()];
                let mut evicted = Vec::new();
                m.admit(&miss, tick, tick, &mut got, &mut evicted).unwrap();
                let mut want_evicted = Vec::new();
                for (&k, &s) in miss.iter().zip(&got) {
                    if model.slot.contains_key(&k) {
                        assert_eq!(s, -1, "a key repeated is admitted once");
                        continue;
                    }
                    let (b, _) = m.place(k);
                    let span = b * BUCKET..b * BUCKET + model.bucket;
                    let pick = span.clone().find(|&s| model.at[s].is_none()).or_else(|| {
                        span.clone()
                            .filter(|&s| model.at[s].unwrap().2 < tick)
                            .min_by_key(|&s| {
                                let (_, c, l) = model.at[s].unwrap();
                                (if lru { l } else { u64::from(c) }, s)
                            })
                    });
                    match pick {
                        None => assert_eq!(s, -1),
                        Some(p) => {
                            assert_eq!(s as usize, p);
                            if let Some((old, _, _)) = model.at[p] {
                                model.slot.remove(&old);
                                want_evicted.push(old);
                            }
                            model.at[p] = Some((k, 1, tick));
                            model.slot.insert(k, p);
                        }
                    }
                }
                assert_eq!(evicted, want_evicted);
                if tick % 50 == 0 {
                    let gone: Vec<i64> = (-90..-60).collect();
                    let mut freed = vec![0i32; gone.len()];
                    m.remove(&gone, &mut freed).unwrap();
                    for (&k, &s) in gone.iter().zip(&freed) {
                        match model.slot.remove(&k) {
                            Some(p) => {
                                assert_eq!(s as usize, p);
                                model.at[p] = None;
                            }
                            None => assert_eq!(s, -1),
                        }
                    }
                }
                assert_eq!(m.len(), model.slot.len());
            }
            let (keys, slots) = m.items();
            assert_eq!(keys.len(), model.slot.len());
            for (k, s) in keys.iter().zip(&slots) {
                assert_eq!(model.slot[k], *s as usize);
            }
        }
    }

    #[test]
    fn serve_on_many_threads_equals_find_then_admit_in_order() {
        // The fetch's rows: each key's value in every column; keys that are
        // multiples of 3 not found.
        let dim = 3;
        let fetch = |keys: &[i64], rows: &mut [f32], found: &mut [bool]| -> Result<()> {
            for (j, &k) in keys.iter().enumerate() {
                rows[j * dim..j * dim + dim].fill(k as f32);
                found[j] = k % 3 != 0;
            }
            Ok(())
        };
        // Pools of 1 (the call on its own thread), 2 and 8 threads (the
        // calling thread and up to 7 helpers taking partitions).
        for (lru, threads) in [(false, 1), (true, 1), (false, 2), (true, 8), (false, 8)] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| serve_equals_find_then_admit(lru, dim, &fetch));
        }
    }

    fn serve_equals_find_then_admit(lru: bool, dim: usize, fetch: &Fetch<'_>) {
        let mut a = SlotMap::new(3_000, lru).unwrap();
        let mut b = SlotMap::new(3_000, lru).unwrap();
        assert_eq!(a.buckets / a.per_part, PARTS);
        let mut state = 11u64;
        for tick in 1..40u64 {
            let n = if tick % 2 == 0 { 2_000 } else { 100 }; // parallel, then not
            let keys: Vec<i64> = (0..n)
                .map(|_| {
                    state = mix64(state);
                    (state % 9_000) as i64
                })
                .collect();
            let got = a.serve(&keys, tick, true, dim, fetch).unwrap();
            let mut slots = vec![0i32; n];
            b.find(&keys, tick, &mut slots).unwrap();
            let miss = not_held(&keys, &slots);
            let held: Vec<i64> = miss.iter().copied().filter(|k| k % 3 != 0).collect();
            let mut adm = vec![0i32; held.len()];
            let mut evicted = Vec::new();
            b.admit(&held, tick, tick, &mut adm, &mut evicted).unwrap();
            assert_eq!(got.miss_keys.len(), miss.len());
            assert_eq!(got.evicted, evicted.len());
            for (i, (&k, &s)) in keys.iter().zip(&slots).enumerate() {
                let src = got.src[i];
                if s >= 0 {
                    assert_eq!(src, s, "a hit's slot");
                } else {
                    let j = (-1 - src) as usize;
                    assert_eq!(got.miss_keys[j], k);
                    assert_eq!(got.miss_pos[j], i as i64);
                    assert_eq!(got.found[j], k % 3 != 0);
                    assert_eq!(got.rows[j * dim], k as f32);
                }
            }
            // The same admissions: each admitted slot takes its miss's key.
            let mut want: Vec<(i32, i64)> = held
                .iter()
                .zip(&adm)
                .filter(|(_, s)| **s >= 0)
                .map(|(k, s)| (*s, *k))
                .collect();
            let mut have: Vec<(i32, i64)> = got
                .adm_slot
                .iter()
                .zip(&got.adm_row)
                .map(|(&s, &j)| (s, got.miss_keys[j as usize]))
                .collect();
            want.sort_unstable();
            have.sort_unstable();
            assert_eq!(have, want);
            assert_eq!(a.items(), b.items());
            assert_eq!(a.len(), b.len());
        }
        assert!(a.len() > 2_500, "the map fills: {}", a.len());
    }

    #[test]
    fn a_slot_read_by_the_running_call_is_never_given() {
        // One bucket, full, every slot read in call 5: a new key waits.
        let mut m = SlotMap::new(BUCKET, false).unwrap();
        let keys: Vec<i64> = (0..BUCKET as i64).collect();
        let mut s = vec![0i32; BUCKET];
        let mut ev = Vec::new();
        m.admit(&keys, 4, 4, &mut s, &mut ev).unwrap();
        assert_eq!(s, (0..BUCKET as i32).collect::<Vec<_>>());
        m.find(&keys, 5, &mut s).unwrap();
        m.find(&keys[..3], 5, &mut s[..3]).unwrap();
        let mut one = [0i32; 1];
        m.admit(&[100], 5, 5, &mut one, &mut ev).unwrap();
        assert_eq!((one, ev.len()), ([-1], 0));
        m.admit(&[100], 6, 6, &mut one, &mut ev).unwrap();
        assert_eq!(ev, [3], "the lowest count, first of equals");
        assert_eq!(m.get(100), Some(3));
    }

    #[test]
    fn a_call_of_no_keys_serves_nothing_on_any_pool() {
        let fetch = |_: &[i64], _: &mut [f32], _: &mut [bool]| -> Result<()> { Ok(()) };
        for threads in [1, 4] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut m = SlotMap::new(100, false).unwrap();
            let got = pool.install(|| m.serve(&[], 1, true, 4, &fetch)).unwrap();
            assert!(got.src.is_empty() && got.miss_keys.is_empty() && got.adm_slot.is_empty());
            assert!(m.is_empty());
        }
    }

    #[test]
    fn bad_arguments_are_refused_by_name() {
        let e = SlotMap::new(usize::MAX / 2, false).unwrap_err().to_string();
        assert!(e.contains("rows"), "{e}");
        let mut m = SlotMap::new(10, false).unwrap();
        let e = m.find(&[1, 2], 1, &mut [0]).unwrap_err().to_string();
        assert!(e.contains("slots"), "{e}");
    }
}
