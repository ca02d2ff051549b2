//! The host's map of a device cache: which key each slot (row of the
//! device's row array) holds, each slot's accesses, and the cache's eviction
//! policy, so that a serving call finds its hits, chooses the slots of the
//! rows it admits and tells the device where every row is in one pass on the
//! host, with no read back from the device (`embstore.gpu.ServingCache`).
//!
//! Slots are grouped in buckets of `bucket` slots, a key's bucket fixed by
//! its hash (as HierarchicalKV and the device index group theirs): a key
//! admitted takes a free slot of its bucket, else the slot of its bucket
//! with the lowest score (accesses for "lfu", the last call for "lru") that
//! the running call has not read; with none to give it is not admitted.

use crate::error::{Result, invalid};
use crate::hash::{key_hash, mix64};
use crate::simd::prefetch_addr;
use crate::zeroed::{Zeroable, zeros};

/// Slots a bucket: 32 digests (half a cache line), compared as 4 words.
pub const BUCKET: usize = 32;

/// Keys whose buckets are asked for ahead of their probe.
const AHEAD: usize = 8;

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
    lru: bool,
    len: usize,
}

impl SlotMap {
    /// Slots for at least `rows` keys (rounded up to whole buckets of
    /// [`BUCKET`] slots), evicting by accesses (`lru = false`) or last use.
    ///
    /// # Errors
    /// `InvalidArgument` naming `rows` (over 2^31 - 1 slots);
    /// `OutOfMemory` naming `rows`.
    pub fn new(rows: usize, lru: bool) -> Result<Self> {
        let buckets = rows.div_ceil(BUCKET).max(1);
        let cap = buckets
            .checked_mul(BUCKET)
            .filter(|&c| c <= i32::MAX as usize)
            .ok_or_else(|| {
                invalid(
                    "rows",
                    format!("expected at most 2^31 - 1 slots, got {rows}"),
                )
            })?;
        let digest = zeros("rows", cap)?;
        let slots = zeros("rows", cap)?;
        Ok(SlotMap {
            digest,
            slots,
            buckets,
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

    /// The first slot of `key`'s bucket and the key's digest.
    #[inline]
    fn place(&self, key: i64) -> (usize, u8) {
        let h = mix64(key_hash(key) ^ 0x3C6E_F372_FE94_F82B);
        let b = (((h >> 32) * self.buckets as u64) >> 32) as usize;
        let d = (h & 0xFF) as u8;
        (b * BUCKET, if d == 0 { 1 } else { d })
    }

    /// The slots of word `i` of the bucket at `at` (slots `8i..8i + 8`)
    /// whose digest is `d`: bit 8j + 7 for slot 8i + j (8 digests compared a
    /// byte at a time, exactly: no carry crosses a byte).
    #[inline]
    fn matches(&self, at: usize, i: usize, d: u8) -> u64 {
        const LOW7: u64 = 0x7F7F_7F7F_7F7F_7F7F;
        let b: [u8; 8] = self.digest[at + 8 * i..at + 8 * i + 8]
            .try_into()
            .unwrap_or_default();
        let x = u64::from_le_bytes(b) ^ (u64::from(d) * 0x0101_0101_0101_0101);
        !(((x & LOW7) + LOW7) | x | LOW7)
    }

    /// The slot of `key`, if held.
    pub fn get(&self, key: i64) -> Option<u32> {
        let (at, d) = self.place(key);
        self.slot_in(at, d, key)
    }

    #[inline]
    fn slot_in(&self, at: usize, d: u8, key: i64) -> Option<u32> {
        for i in 0..BUCKET / 8 {
            let mut m = self.matches(at, i, d);
            while m != 0 {
                let s = at + 8 * i + (m.trailing_zeros() / 8) as usize;
                if self.slots[s].key == key {
                    return Some(s as u32);
                }
                m &= m - 1;
            }
        }
        None
    }

    /// Asks for `key`'s bucket (digests and slots) to be in cache; its
    /// place.
    #[inline]
    fn prefetch(&self, key: i64) -> (usize, u8) {
        let (at, d) = self.place(key);
        prefetch_addr(self.digest[at..].as_ptr() as usize);
        prefetch_addr(self.slots[at..].as_ptr() as usize);
        (at, d)
    }

    /// [`SlotMap::prefetch`] for an admission, which reads every slot of
    /// the bucket (8 cache lines).
    #[inline]
    fn prefetch_bucket(&self, key: i64) -> (usize, u8) {
        let (at, d) = self.prefetch(key);
        for s in (at + 4..at + BUCKET).step_by(4) {
            prefetch_addr(&self.slots[s] as *const Slot as usize);
        }
        (at, d)
    }

    /// Each key's slot into `slots` (-1 where not held), an access counted
    /// in call `tick` for each key found (a key repeated counts each time);
    /// returns how many were not held.
    ///
    /// # Errors
    /// `InvalidArgument` naming `slots` if its length differs from `keys`'.
    pub fn find(&mut self, keys: &[i64], tick: u64, slots: &mut [i32]) -> Result<usize> {
        if slots.len() != keys.len() {
            return Err(invalid(
                "slots",
                format!("expected {} slots, got {}", keys.len(), slots.len()),
            ));
        }
        // Each key's place is computed once, AHEAD keys before its probe,
        // when its bucket is asked for.
        let mut ring = [(0usize, 0u8); AHEAD];
        for (i, &k) in keys.iter().take(AHEAD).enumerate() {
            ring[i] = self.prefetch(k);
        }
        let mut misses = 0;
        for (i, (&k, out)) in keys.iter().zip(slots.iter_mut()).enumerate() {
            let (at, d) = ring[i % AHEAD];
            if let Some(&next) = keys.get(i + AHEAD) {
                ring[i % AHEAD] = self.prefetch(next);
            }
            match self.slot_in(at, d, k) {
                Some(s) => {
                    let e = &mut self.slots[s as usize];
                    e.count = e.count.saturating_add(1);
                    e.last = tick as u32;
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
        if slots.len() != keys.len() {
            return Err(invalid(
                "slots",
                format!("expected {} slots, got {}", keys.len(), slots.len()),
            ));
        }
        let mut ring = [(0usize, 0u8); AHEAD];
        for (i, &k) in keys.iter().take(AHEAD).enumerate() {
            ring[i] = self.prefetch_bucket(k);
        }
        for (i, (&k, out)) in keys.iter().zip(slots.iter_mut()).enumerate() {
            let (at, d) = ring[i % AHEAD];
            if let Some(&next) = keys.get(i + AHEAD) {
                ring[i % AHEAD] = self.prefetch_bucket(next);
            }
            *out = -1;
            if self.slot_in(at, d, k).is_some() {
                continue;
            }
            let Some(s) = self.room(at, protect_from) else {
                continue;
            };
            if self.digest[s] != 0 {
                evicted.push(self.slots[s].key);
            } else {
                self.len += 1;
            }
            self.digest[s] = d;
            self.slots[s] = Slot {
                key: k,
                last: tick as u32,
                count: 1,
            };
            *out = s as i32;
        }
        Ok(())
    }

    /// A slot of the bucket at `at` to give: the first free one, else the
    /// lowest-scoring one not read since `protect_from` (the first of equals).
    fn room(&self, at: usize, protect_from: u64) -> Option<usize> {
        for i in 0..BUCKET / 8 {
            let free = self.matches(at, i, 0);
            if free != 0 {
                return Some(at + 8 * i + (free.trailing_zeros() / 8) as usize);
            }
        }
        // Calls from each slot's last read to `protect_from` (mod 2^32).
        let now = protect_from as u32;
        let mut best: Option<(u32, usize)> = None;
        for (j, e) in self.slots[at..at + BUCKET].iter().enumerate() {
            let age = now.wrapping_sub(e.last);
            if age == 0 || age > u32::MAX / 2 {
                continue; // read by a call from protect_from on
            }
            // The lowest count (lfu) or the oldest (lru) slot, the first of
            // equals: minimize count, or maximize age.
            let score = if self.lru { u32::MAX - age } else { e.count };
            if best.is_none_or(|(b, _)| score < b) {
                best = Some((score, at + j));
            }
        }
        best.map(|(_, s)| s)
    }

    /// Frees the slots of `keys` that are held; each key's freed slot into
    /// `slots` (-1: not held).
    ///
    /// # Errors
    /// `InvalidArgument` naming `slots` if its length differs from `keys`'.
    pub fn remove(&mut self, keys: &[i64], slots: &mut [i32]) -> Result<()> {
        if slots.len() != keys.len() {
            return Err(invalid(
                "slots",
                format!("expected {} slots, got {}", keys.len(), slots.len()),
            ));
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

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
                let miss: Vec<i64> = keys
                    .iter()
                    .zip(&slots)
                    .filter(|(_, s)| **s < 0)
                    .map(|(k, _)| *k)
                    .collect();
                let mut got = vec![0i32; miss.len()];
                let mut evicted = Vec::new();
                m.admit(&miss, tick, tick, &mut got, &mut evicted).unwrap();
                let mut want_evicted = Vec::new();
                for (&k, &s) in miss.iter().zip(&got) {
                    if model.slot.contains_key(&k) {
                        assert_eq!(s, -1, "a key repeated is admitted once");
                        continue;
                    }
                    let (at, _) = m.place(k);
                    let span = at..at + model.bucket;
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
    fn bad_arguments_are_refused_by_name() {
        let e = SlotMap::new(usize::MAX / 2, false).unwrap_err().to_string();
        assert!(e.contains("rows"), "{e}");
        let mut m = SlotMap::new(10, false).unwrap();
        let e = m.find(&[1, 2], 1, &mut [0]).unwrap_err().to_string();
        assert!(e.contains("slots"), "{e}");
    }
}
