//! A mapped call's pipeline over its keys ([`MappedTable::lookup_run`]):
//! each key's index slot prefetched ahead, its row prefetched once found,
//! its row copied some keys later.

use super::file::MappedFile;
use super::snapshot::Snapshot;
use super::{MappedTable, ROW_AHEAD, SLOT_AHEAD};
use crate::error::Result;
use crate::hash::{key_hash, shard_of};
use crate::rows::{Missing, NewRows};

impl MappedTable {
    /// The rows of `keys` into `out` (a key without one read as
    /// `missing`), each key's hit into `found` if given; returns the hits.
    /// A pipeline: the index slot of the key [`SLOT_AHEAD`] keys on is
    /// prefetched, each key located is its row prefetched, and a row is
    /// copied [`ROW_AHEAD`] keys after it was located, so that a call of
    /// keys spread over a table larger than the caches waits for several
    /// of its memory reads at once instead of two in turn a key (1.7M ids
    /// of a 1M-row dim-64 table: 61-66 ms, was 129-138). Without
    /// `prefetch` nothing is prefetched.
    pub(super) fn lookup_run(
        &self,
        snap: &Snapshot,
        keys: &[i64],
        missing: &Missing<'_>,
        out: &mut [f32],
        found: Option<&mut [bool]>,
        prefetch: bool,
    ) -> Result<u64> {
        // A call large enough to prefetch, of a version with one file a
        // shard and nothing to check: each key's file found from its hash
        // alone (hashed once), no overlay and no file check a key (2,000-key
        // calls of a mapped 1M-row table: 134 against 144 us at dim 64, 72
        // against 83 at dim 16; 1,024 keys in cache 22.9 against 27.9 us).
        if prefetch && let Some(files) = snap.single_files() {
            let file = |h: u64| files[shard_of(h, files.len())];
            let locate = |k: i64, h: u64| match file(h) {
                Some(f) => Ok(f.find_hashed(k, h)?.map(|r| (f, r))),
                None => Ok(None),
            };
            let ask = |h: u64| {
                if let Some(f) = file(h) {
                    f.prefetch_slot(h);
                }
            };
            return self.run_keys(snap, keys, missing, out, found, prefetch, locate, ask);
        }
        let locate = |k: i64, h: u64| snap.locate(k, h);
        let ask = |h: u64| snap.prefetch(h);
        self.run_keys(snap, keys, missing, out, found, prefetch, locate, ask)
    }

    /// [`MappedTable::lookup_run`] with `locate(key, hash)` finding a key's
    /// file and row, and `ask(hash)` prefetching where it will look.
    #[allow(clippy::too_many_arguments)]
    fn run_keys<'s>(
        &self,
        snap: &Snapshot,
        keys: &[i64],
        missing: &Missing<'_>,
        out: &mut [f32],
        mut found: Option<&mut [bool]>,
        prefetch: bool,
        locate: impl Fn(i64, u64) -> Result<Option<(&'s MappedFile, usize)>>,
        ask: impl Fn(u64),
    ) -> Result<u64> {
        let dim = self.dim;
        let n = keys.len();
        let mut ring: [Option<(&MappedFile, usize)>; ROW_AHEAD] = [None; ROW_AHEAD];
        let mut hits = 0;
        // Keys `i..i + SLOT_AHEAD`'s hashes, key `i`'s at `i % SLOT_AHEAD`.
        let mut hashes = [0u64; SLOT_AHEAD];
        for (h, &k) in hashes.iter_mut().zip(keys) {
            *h = key_hash(k);
            if prefetch {
                ask(*h);
            }
        }
        for i in 0..n + ROW_AHEAD {
            if let Some(j) = i.checked_sub(ROW_AHEAD) {
                let dst = &mut out[j * dim..(j + 1) * dim];
                let hit = match ring[j % ROW_AHEAD] {
                    Some((f, r)) => {
                        self.decode(f, r, dst);
                        true
                    }
                    None => {
                        let new = NewRows {
                            initializer: &snap.initializer,
                            backend: self.backend,
                            seed: snap.seed,
                            format: self.format,
                        };
                        missing.fill(&new, keys[j], dst);
                        false
                    }
                };
                if let Some(f) = found.as_deref_mut() {
                    f[j] = hit;
                }
                hits += u64::from(hit);
            }
            if let Some(&k) = keys.get(i) {
                let at = locate(k, hashes[i % SLOT_AHEAD])?;
                if prefetch && let Some((f, r)) = at {
                    f.prefetch_row(r);
                }
                ring[i % ROW_AHEAD] = at;
                if let Some(&next) = keys.get(i + SLOT_AHEAD) {
                    let h = key_hash(next);
                    hashes[i % SLOT_AHEAD] = h;
                    if prefetch {
                        ask(h);
                    }
                }
            }
        }
        Ok(hits)
    }
}
