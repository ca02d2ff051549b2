//! One partition's work in a serving call: probing its buckets for the
//! call's keys, and admitting the misses into them (lowest score out).

use super::*;

impl Part<'_> {
    /// The local slot of `key` in the bucket at local slot `at`, if held.
    #[inline]
    pub(super) fn slot_in(&self, at: usize, d: u8, key: i64) -> Option<usize> {
        slot_in(self.digest, self.slots, at, d, key)
    }

    /// Asks for the slot of the first digest of the bucket at `at` equal
    /// to `d` to be in cache (the slot a held key is in, but for a digest
    /// shared by chance): its key is the probe's one read that the
    /// bucket's digests do not tell.
    #[inline]
    pub(super) fn prefetch_match(&self, at: usize, d: u8) {
        for i in 0..BUCKET / 8 {
            let m = matches(self.digest, at, i, d);
            if m != 0 {
                let s = at + 8 * i + (m.trailing_zeros() / 8) as usize;
                prefetch_addr(&self.slots[s] as *const Slot as usize);
                return;
            }
        }
    }

    /// Asks for the digests of the bucket at `at` to be in cache.
    #[inline]
    pub(super) fn prefetch_digests(&self, at: usize) {
        prefetch_addr(self.digest[at..].as_ptr() as usize);
    }

    /// Asks for the whole bucket at `at` to be in cache, its digests and
    /// every slot (an admission into a full bucket reads every score).
    #[inline]
    pub(super) fn prefetch_bucket(&self, at: usize) {
        self.prefetch_digests(at);
        for s in (at..at + BUCKET).step_by(4) {
            prefetch_addr(&self.slots[s] as *const Slot as usize);
        }
    }

    /// An access of local slot `s` in call `tick`.
    #[inline]
    pub(super) fn touch(&mut self, s: usize, tick: u64) {
        let e = &mut self.slots[s];
        e.count = e.count.saturating_add(1);
        e.last = tick as u32;
    }

    /// A local slot of the bucket at `at` to give: the first free one, else
    /// the lowest-scoring one not read since `protect_from` (the first of
    /// equals).
    pub(super) fn room(&self, at: usize, protect_from: u64) -> Option<usize> {
        for i in 0..BUCKET / 8 {
            let free = matches(self.digest, at, i, 0);
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

    /// Admits `key` (digest `d`, bucket at `at`) in call `tick`: its local
    /// slot and the key it evicted, or None (held already, or no room).
    pub(super) fn admit(
        &mut self,
        key: i64,
        at: usize,
        d: u8,
        tick: u64,
        protect_from: u64,
    ) -> Option<(usize, Option<i64>)> {
        if self.slot_in(at, d, key).is_some() {
            return None;
        }
        let s = self.room(at, protect_from)?;
        let old = (self.digest[s] != 0).then_some(self.slots[s].key);
        self.digest[s] = d;
        self.slots[s] = Slot {
            key,
            last: tick as u32,
            count: 1,
        };
        Some((s, old))
    }

    /// The call's keys of this partition (`pos`, ascending, with their
    /// places): probed, hits touched, misses fetched and (with `admit`)
    /// admitted.
    pub(super) fn serve(
        &mut self,
        keys: &[i64],
        pos: &[u32],
        places: &[(u32, u8)],
        call: &Call<'_>,
    ) -> Result<PartOut> {
        let Call {
            tick,
            admit,
            dim,
            fetch,
        } = *call;
        // Every list taken fallibly at the most it can hold (this
        // partition's keys), so no push below allocates.
        let n = pos.len();
        let mut out = PartOut {
            hits: with_room("keys", n)?,
            miss_pos: with_room("keys", n)?,
            miss_keys: with_room("keys", n)?,
            ..PartOut::default()
        };
        let mut miss_place = with_room::<(u32, u8)>("keys", n)?;
        // Two stages ahead of each probe: the bucket's digests AHEAD keys
        // before it, then (in cache by then) the slot they name NEAR keys
        // before it, so that the key compared is in cache too.
        for &(at, _) in places.iter().take(AHEAD) {
            self.prefetch_digests(at as usize);
        }
        for &(at, d) in places.iter().take(NEAR) {
            self.prefetch_match(at as usize, d);
        }
        for (i, (&p, &(at, d))) in pos.iter().zip(places).enumerate() {
            if let Some(&(next, _)) = places.get(i + AHEAD) {
                self.prefetch_digests(next as usize);
            }
            if let Some(&(near, nd)) = places.get(i + NEAR) {
                self.prefetch_match(near as usize, nd);
            }
            let k = keys[p as usize];
            match self.slot_in(at as usize, d, k) {
                Some(s) => {
                    self.touch(s, tick);
                    out.hits.push((p, (self.base + s) as i32));
                }
                None => {
                    out.miss_pos.push(p);
                    out.miss_keys.push(k);
                    miss_place.push((at, d));
                }
            }
        }
        let m = out.miss_keys.len();
        if m == 0 {
            return Ok(out);
        }
        out.rows = zeros("keys", m * dim)?;
        out.found = zeros("keys", m)?;
        fetch(&out.miss_keys, &mut out.rows, &mut out.found)?;
        if admit {
            out.adm = with_room("keys", m)?;
            // An admission reads every slot of a full bucket (the scores):
            // the buckets of the misses a few ahead are asked for whole.
            for &(at, _) in miss_place.iter().take(ADMIT_AHEAD) {
                self.prefetch_bucket(at as usize);
            }
            for (j, &(at, d)) in miss_place.iter().enumerate() {
                if let Some(&(next, _)) = miss_place.get(j + ADMIT_AHEAD) {
                    self.prefetch_bucket(next as usize);
                }
                if !out.found[j] {
                    continue;
                }
                if let Some((s, old)) = self.admit(out.miss_keys[j], at as usize, d, tick, tick) {
                    out.adm.push(((self.base + s) as i32, j as u32));
                    match old {
                        Some(_) => out.evicted += 1,
                        None => out.added += 1,
                    }
                }
            }
        }
        Ok(out)
    }
}
