//! A shard as its readers reach it, without its lock ([`View`]): the
//! index's slots and the arena's segments, probed and copied under the
//! seqlock protocol; batch probes that prefetch index lines ahead; the
//! reads queued to be counted as touches.

use crate::table::NO_ROW;
use crate::table::counters::Counters;
use crate::table::storage::arena::SegView;
use crate::table::storage::index::{Index, Slots};
use crate::table::storage::seqlock;
use crossbeam_epoch::Guard;
use crossbeam_queue::SegQueue;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A batch probe prefetches index lines when it probes at least this many
/// keys in the shard: below it (a call of up to about 512 keys with the
/// default shards), the prefetches cost about what they save.
pub(super) const PROBE_PREFETCH_MIN: usize = 64;

/// How many keys ahead a batch probe prefetches the index lines.
pub(super) const PROBE_AHEAD: usize = 8;

/// What a batch read's first pass found for one key: its slot and word
/// (row and version), or nothing.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Probed {
    slot: u32,
    word: u64,
}

impl Probed {
    /// A key found absent.
    pub(crate) const ABSENT: Probed = Probed { slot: 0, word: 0 };

    /// The row found (`NO_ROW`: none).
    #[inline(always)]
    pub(crate) fn row(self) -> u32 {
        match seqlock::row_of(self.word) {
            seqlock::EMPTY => NO_ROW,
            r => r - 1,
        }
    }
}

/// Keys a serving call read from one shard of a table whose rows carry
/// metadata (TTL or capacity), to be counted as touches of their rows
/// ([`View::reads`]).
#[derive(Debug)]
pub(crate) struct Reads {
    /// The reading call's tick and the table's step then.
    pub(crate) tick: u64,
    pub(crate) step: u64,
    /// Each key read, with its hash: one touch each (a key read twice,
    /// twice), of its row if it still has one when counted.
    pub(crate) keys: Vec<(i64, u64)>,
}

/// What readers of a shard reach without its lock: the index's current
/// slots, the arena's segments, the counters, and the reads waiting to be
/// counted as touches.
#[derive(Debug)]
pub(crate) struct View {
    pub(super) index: Index,
    pub(super) segs: Arc<SegView>,
    /// What happened to this shard's rows.
    pub counters: Counters,
    /// Serving reads of a tracked table that found the shard's lock taken:
    /// queued (lock-free) instead of waiting for it, and counted by the
    /// next holder of the write lock ([`Shard::count_reads`], called by
    /// [`super::write`]) before anything reads the metadata.
    pub(crate) reads: SegQueue<Reads>,
    /// Keys in `reads`, kept at most [`MAX_QUEUED_READS`].
    pub(crate) queued: AtomicUsize,
    /// The shard's rows and bytes ([`super::Shard::bytes`]) as the last
    /// holder of its write lock left them ([`super::ShardWrite`]): what a
    /// capacity check after every insert reads without taking each
    /// shard's lock.
    pub(crate) counted: [AtomicUsize; 2],
}

/// The most keys a shard queues for touch counting ([`View::reads`]):
/// 1 MiB a shard. A writer's hold ends in milliseconds, but a snapshot
/// (`save`, `export`) holds every shard for as long as it writes; serving
/// reads past this many keys meanwhile are not counted as touches, so that
/// memory stays bounded.
pub(crate) const MAX_QUEUED_READS: usize = 1 << 16;

impl View {
    /// Queues one serving call's reads of this shard for the write lock's
    /// next holder, unless [`MAX_QUEUED_READS`] keys are queued already
    /// (then they go uncounted).
    pub(crate) fn queue_reads(&self, reads: Reads) {
        let n = reads.keys.len();
        if self.queued.load(Ordering::Relaxed) + n <= MAX_QUEUED_READS {
            self.queued.fetch_add(n, Ordering::Relaxed);
            self.reads.push(reads);
        }
    }
}

impl View {
    /// Copies the row of `key` (hash `hash`) whole, through `copy(weights,
    /// state)` (raw pointers to `ww` and `sl` floats, which the writer may
    /// be changing: `copy` must only copy them out), retrying until a copy
    /// holds one version of the row ([`seqlock`]); `false` (nothing kept)
    /// when the key has no row. Takes no lock and waits for no writer;
    /// `guard` pins this thread to the epoch for the whole call.
    #[inline(always)]
    pub(crate) fn read(
        &self,
        guard: &Guard,
        key: i64,
        hash: u64,
        mut copy: impl FnMut(*const f32, *const f32),
    ) -> bool {
        loop {
            let Some(s) = self.index.load(guard) else {
                // An index never built.
                return false;
            };
            let Some((slot, w)) = s.find(key, hash) else {
                if self.index.is_current(s, guard) {
                    return false;
                }
                // A replaced index: probe the current one.
                continue;
            };
            if !seqlock::writing(w)
                && let Some(at) = self.segs.row(seqlock::row_named(w), guard)
            {
                copy(at.weights, at.state);
                if seqlock::read_end(s.cell(slot), w) {
                    return true;
                }
            }
            std::hint::spin_loop();
        }
    }

    /// [`View::read`] for a batch: the keys at positions `pos` of `keys`
    /// (hashes `hashes`), each either copied whole through `hit(j, weights,
    /// state)` or reported absent through `miss(j)` (`j` indexes `pos`).
    /// First probes every key (their cache misses overlap), then copies and
    /// checks each row; a copy that fails its check is read again alone. In
    /// a call spread over the pool (`spread`: rows out of cache), the index
    /// lines of keys ahead are prefetched from [`PROBE_PREFETCH_MIN`] keys,
    /// and rows ahead of the copy. Returns the keys found.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn read_many(
        &self,
        guard: &Guard,
        keys: &[i64],
        hashes: &[u64],
        pos: &[u32],
        spread: bool,
        probes: &mut Vec<Probed>,
        mut hit: impl FnMut(usize, *const f32, *const f32),
        mut miss: impl FnMut(usize),
    ) -> usize {
        let Some(s) = self.index.load(guard) else {
            (0..pos.len()).for_each(&mut miss);
            return 0;
        };
        probes.clear();
        probes.reserve(pos.len());
        let ahead = spread && pos.len() >= PROBE_PREFETCH_MIN;
        probes.extend(pos.iter().enumerate().map(|(j, &i)| {
            if ahead && let Some(&a) = pos.get(j + PROBE_AHEAD) {
                s.prefetch(hashes[a as usize]);
            }
            let i = i as usize;
            Self::probe(s, keys[i], hashes[i])
        }));
        let mut found = 0;
        for j in 0..pos.len() {
            if spread
                && let Some(p) = probes.get(j + PROBE_AHEAD)
                && p.row() != NO_ROW
            {
                self.prefetch_row_whole(p.row() as usize, guard);
            }
            let (key, hash) = (keys[pos[j] as usize], hashes[pos[j] as usize]);
            let held = self.fetch(guard, s, probes[j], key, hash, |w, st| hit(j, w, st));
            if held {
                found += 1;
            } else {
                miss(j);
            }
        }
        found
    }

    /// What a probe of `slots` for `key` (hash `hash`) finds, for
    /// [`View::fetch`].
    #[inline(always)]
    pub(crate) fn probe(slots: &Slots, key: i64, hash: u64) -> Probed {
        slots
            .find(key, hash)
            .map_or(Probed::ABSENT, |(slot, word)| Probed {
                slot: slot as u32,
                word,
            })
    }

    /// Copies the row of `key` (hash `hash`) through `copy` as
    /// [`View::read`] does, starting from `probed`, what a probe of `slots`
    /// found, and probing again only when that answer no longer holds.
    /// `true` when the key has a row.
    #[inline(always)]
    pub(crate) fn fetch(
        &self,
        guard: &Guard,
        slots: &Slots,
        probed: Probed,
        key: i64,
        hash: u64,
        mut copy: impl FnMut(*const f32, *const f32),
    ) -> bool {
        let Probed { slot, word } = probed;
        let first = if seqlock::row_of(word) == seqlock::EMPTY {
            // Absent unless the index was replaced meanwhile.
            self.index.is_current(slots, guard).then_some(false)
        } else if seqlock::writing(word) {
            None
        } else {
            self.segs
                .row(seqlock::row_named(word), guard)
                .and_then(|at| {
                    copy(at.weights, at.state);
                    seqlock::read_end(slots.cell(slot as usize), word).then_some(true)
                })
        };
        first.unwrap_or_else(|| self.read(guard, key, hash, copy))
    }

    /// Starts loading every line of row `r`'s weights.
    #[inline(always)]
    pub(crate) fn prefetch_row_whole(&self, r: usize, guard: &Guard) {
        if let Some(at) = self.segs.row(r, guard) {
            // SAFETY: the row's weights in a segment kept alive by `guard`;
            // only their addresses are used (a prefetch).
            crate::simd::prefetch(unsafe { racy(at.weights, self.segs.ww()) });
        }
    }

    /// Every key of the current index with what its probe would find, for
    /// [`View::fetch`]: a key inserted or removed meanwhile may or may not
    /// be listed, and one removed reads as absent.
    pub(crate) fn each_live<'g>(
        &self,
        guard: &'g Guard,
        mut f: impl FnMut(&'g Slots, i64, Probed),
    ) {
        if let Some(s) = self.index.load(guard) {
            for (slot, key, word) in s.live_now() {
                let slot = slot as u32;
                f(s, key, Probed { slot, word });
            }
        }
    }

    /// How many keys the current index holds now.
    pub(crate) fn live_count(&self, guard: &Guard) -> usize {
        self.index.load(guard).map_or(0, |s| s.live_now().count())
    }

    /// Whether `key` (hash `hash`) has a row now.
    #[inline]
    pub(crate) fn contains(&self, guard: &Guard, key: i64, hash: u64) -> bool {
        self.read(guard, key, hash, |_, _| {})
    }

    /// [`View::contains`] for the keys at positions `pos` of `keys` (hashes
    /// `hashes`), each answer through `found(i, held)` (`i` a position):
    /// from [`PROBE_PREFETCH_MIN`] keys on, the index lines of the key
    /// [`PROBE_AHEAD`] on are prefetched, so that the probes overlap their
    /// cache misses.
    pub(crate) fn contains_many(
        &self,
        guard: &Guard,
        keys: &[i64],
        hashes: &[u64],
        pos: &[u32],
        mut found: impl FnMut(usize, bool),
    ) {
        let slots = (pos.len() >= PROBE_PREFETCH_MIN)
            .then(|| self.index.load(guard))
            .flatten();
        for (j, &i) in pos.iter().enumerate() {
            if let Some(s) = slots
                && let Some(&a) = pos.get(j + PROBE_AHEAD)
            {
                s.prefetch(hashes[a as usize]);
            }
            let i = i as usize;
            found(i, self.contains(guard, keys[i], hashes[i]));
        }
    }

    /// The current slots, for a batch's prefetches.
    #[inline(always)]
    pub(crate) fn slots<'g>(&self, guard: &'g Guard) -> Option<&'g Slots> {
        self.index.load(guard)
    }
}

/// `n` floats at `p`, for a reader's optimistic copy ([`View::read`]).
///
/// # Safety
/// `p` points to `n` floats that stay allocated for `'a` (a segment of a
/// [`View`] read while pinned to the epoch). The shard's writer may be
/// writing them meanwhile: the slice must only be copied from, and the copy
/// kept only when the row's version check passes (the seqlock's optimistic
/// read, as crossbeam's `AtomicCell` reads its values).
#[inline(always)]
pub(crate) unsafe fn racy<'a>(p: *const f32, n: usize) -> &'a [f32] {
    // SAFETY: allocated and aligned for n floats for 'a (the contract).
    unsafe { std::slice::from_raw_parts(p, n) }
}

/// Copies `dst.len()` floats from `p` into `dst` (see [`racy`]).
///
/// # Safety
/// As [`racy`] for `dst.len()` floats.
#[inline(always)]
pub(crate) unsafe fn copy_racy(dst: &mut [f32], p: *const f32) {
    // SAFETY: the caller's contract.
    dst.copy_from_slice(unsafe { racy(p, dst.len()) });
}
