//! A mapped table's reads: lookups (newest link first), `contains`,
//! `export`.

use super::*;

impl MappedTable {
    /// Writes row `r` of `f` as float32 to `dst`.
    pub(super) fn decode(&self, f: &MappedFile, r: usize, dst: &mut [f32]) {
        self.format.decode_bytes(f.row(r), dst);
    }

    /// The row of each key into `out` (`keys.len() * dim` floats), a key
    /// without a row read as `missing`; with `found`, whether each had one.
    ///
    /// # Errors
    /// `ShapeMismatch` for `out`, `found` or a default row of the wrong
    /// length; `InvalidArgument` for a non-finite default row;
    /// `Checkpoint` when a file the call reads is damaged.
    pub fn lookup(
        &self,
        keys: &[i64],
        missing: Missing<'_>,
        out: &mut [f32],
        found: Option<&mut [bool]>,
    ) -> Result<()> {
        let snap = self.snapshot();
        let r = self.lookup_in(&snap, keys, missing, out, found, PREFETCH_FROM);
        self.release(snap);
        r
    }

    /// A reader of the version served now: its lookups all read that
    /// version, whatever a refresh swaps in meanwhile (a call split over
    /// threads reads one version).
    pub fn reader(&self) -> MappedReader<'_> {
        MappedReader {
            table: self,
            snap: ManuallyDrop::new(self.snapshot()),
        }
    }

    /// [`MappedTable::lookup`] of version `snap`, prefetching in calls of
    /// more than `prefetch_from` keys.
    pub(super) fn lookup_in(
        &self,
        snap: &Snapshot,
        keys: &[i64],
        missing: Missing<'_>,
        out: &mut [f32],
        found: Option<&mut [bool]>,
        prefetch_from: usize,
    ) -> Result<()> {
        let prefetch = keys.len() > prefetch_from;
        let dim = self.dim;
        check_len("out", keys.len() * dim, out.len())?;
        missing.check(dim)?;
        let mut none = Vec::new();
        let found = match found {
            Some(f) => {
                check_len("found", keys.len(), f.len())?;
                f
            }
            None => &mut none[..],
        };
        let with_flags = !found.is_empty();
        let hits = if keys.len() <= SEQUENTIAL_KEYS {
            self.lookup_run(
                snap,
                keys,
                &missing,
                out,
                with_flags.then_some(found),
                prefetch,
            )?
        } else {
            // Pieces of at least a quarter of a call on the calling thread.
            let piece = SEQUENTIAL_KEYS / 4;
            let rows = keys.par_chunks(piece).zip(out.par_chunks_mut(piece * dim));
            let sum = |a: u64, b: u64| Ok(a + b);
            if with_flags {
                rows.zip(found.par_chunks_mut(piece))
                    .map(|((k, dst), f)| self.lookup_run(snap, k, &missing, dst, Some(f), prefetch))
                    .try_reduce(|| 0, sum)?
            } else {
                rows.map(|(k, dst)| self.lookup_run(snap, k, &missing, dst, None, prefetch))
                    .try_reduce(|| 0, sum)?
            }
        };
        // Counted once a call, when it succeeds.
        self.lookups.fetch_add(keys.len() as u64, Ordering::Relaxed);
        self.hits.fetch_add(hits, Ordering::Relaxed);
        Ok(())
    }

    /// Whether each key has a row, into `out`.
    ///
    /// # Errors
    /// `ShapeMismatch` for `out` of the wrong length; `Checkpoint` when a
    /// file the call reads is damaged.
    pub fn contains(&self, keys: &[i64], out: &mut [bool]) -> Result<()> {
        check_len("out", keys.len(), out.len())?;
        let snap = self.snapshot();
        let prefetch = keys.len() > PREFETCH_FROM;
        let r = keys
            .par_chunks(SEQUENTIAL_KEYS)
            .zip(out.par_chunks_mut(SEQUENTIAL_KEYS))
            .try_for_each(|(k, o)| Self::contains_run(&snap, k, o, prefetch));
        self.release(snap);
        r
    }

    /// Whether each of `keys` has a row, into `out`: the index slot of the
    /// key [`SLOT_AHEAD`] keys on prefetched (with `prefetch`), so that the
    /// probes of a call wait for several index reads at once instead of one
    /// at a time (2,000 keys of a 1M-row table on machine E: 56 us a call,
    /// 160 when each key was probed in turn; benches/RESULTS.md).
    pub(super) fn contains_run(
        snap: &Snapshot,
        keys: &[i64],
        out: &mut [bool],
        prefetch: bool,
    ) -> Result<()> {
        let mut hashes = [0u64; SLOT_AHEAD];
        for (h, &k) in hashes.iter_mut().zip(keys) {
            *h = key_hash(k);
            if prefetch {
                snap.prefetch(*h);
            }
        }
        for (i, (&k, o)) in keys.iter().zip(out.iter_mut()).enumerate() {
            *o = snap.locate(k, hashes[i % SLOT_AHEAD])?.is_some();
            if let Some(&next) = keys.get(i + SLOT_AHEAD) {
                let h = key_hash(next);
                hashes[i % SLOT_AHEAD] = h;
                if prefetch {
                    snap.prefetch(h);
                }
            }
        }
        Ok(())
    }

    /// Every row, keys ascending: `(keys, rows)` (`n * dim` floats).
    /// Reads (and checks) every file.
    ///
    /// # Errors
    /// `OutOfMemory` naming `rows`; `Checkpoint` for a damaged file.
    pub fn export(&self) -> Result<(Vec<i64>, Vec<f32>)> {
        // Room for every row the files hold (the manifest's count is
        // checked, not trusted, here), taken fallibly.
        let snap = self.snapshot();
        let held: usize = snap
            .links
            .iter()
            .flat_map(|l| l.files.iter().flatten())
            .map(|f| f.n)
            .sum();
        let mut decided: HashSet<i64> = HashSet::new();
        decided
            .try_reserve(held)
            .map_err(|_| crate::error::oom("rows", held.saturating_mul(16)))?;
        let mut refs: Vec<(i64, &MappedFile, usize)> = with_room("rows", held)?;
        // Newest link first: a key is taken from the newest link whose files
        // hold it; a link's removals hide the links before it.
        for link in &snap.links {
            for f in link.files.iter().flatten() {
                f.check()?;
                for r in 0..f.n {
                    let k = f.key(r);
                    if decided.insert(k) {
                        refs.push((k, f, r));
                    }
                }
            }
            decided.extend(link.removed.iter().copied());
        }
        drop(decided);
        refs.par_sort_unstable_by_key(|&(k, _, _)| k);
        let dim = self.dim;
        let mut rows = zeros::<f32>("rows", refs.len() * dim)?;
        rows.par_chunks_mut(dim)
            .zip(refs.par_iter())
            .with_min_len(1024)
            .for_each(|(dst, &(_, f, r))| self.decode(f, r, dst));
        Ok((refs.iter().map(|&(k, _, _)| k).collect(), rows))
    }
}
