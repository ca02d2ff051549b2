//! Rows that move between a shard and its disk files: read from disk,
//! spilled to disk, and taken back (the disk tier's side of a shard).

use super::Shard;
use crate::policy::Meta;
use crate::table::storage::tier::RecordBatch;

/// Rows a spill hands the tier below at a time ([`Shard::spill`]).
const SPILL_BATCH: usize = 8192;

impl Shard {
    /// The words (stored weights, state, metadata, as floats of the same
    /// bits) of `key`'s row on disk; `None` when it is not there.
    ///
    /// # Errors
    /// `Checkpoint` when it cannot be read or fails its check.
    pub(crate) fn read_cold(&self, key: i64) -> crate::error::Result<Option<Vec<f32>>> {
        let Some((loc, source)) = self.cold.as_ref().and_then(|c| c.find(key)) else {
            return Ok(None);
        };
        let mut words = vec![0u32; self.record_width()];
        source.read(key, loc, &mut Vec::new(), &mut words)?;
        Ok(Some(words.into_iter().map(f32::from_bits).collect()))
    }

    /// Rows held on disk (none for a table in memory).
    pub(crate) fn cold_len(&self) -> usize {
        self.cold.as_ref().map_or(0, |c| c.len())
    }

    /// Words of a row as it moves between tiers: stored weights, state and
    /// 4 metadata words ([`RecordBatch`]).
    pub(crate) fn record_width(&self) -> usize {
        self.arena.weight_words() + self.arena.sl() + 4
    }

    /// Moves the rows of `keys` (held in memory) to the tier below: their
    /// stored words, state and metadata, with their save generations, as
    /// [`RecordBatch`]es of at most [`SPILL_BATCH`] rows that the tier
    /// takes whole; each batch's rows are then taken out of memory (not
    /// removals: nothing is logged for incremental saves). A batch at a
    /// time, so that the rows' copy in flight stays small beside the tier's
    /// own write buffer.
    ///
    /// # Errors
    /// `Checkpoint` when the tier cannot take a batch, `OutOfMemory` when
    /// its room cannot be had: that batch's rows and the later ones stay in
    /// memory then.
    pub(crate) fn spill(&mut self, keys: &[i64]) -> crate::error::Result<()> {
        let width = self.record_width();
        for part in keys.chunks(SPILL_BATCH) {
            let mut batch = RecordBatch::new(width);
            let mut found = Vec::new();
            let room = |_| crate::error::oom("keys", (part.len() * (width * 4 + 20)) as u128);
            batch.keys.try_reserve_exact(part.len()).map_err(room)?;
            batch
                .generations
                .try_reserve_exact(part.len())
                .map_err(room)?;
            batch
                .words
                .try_reserve_exact(part.len() * width)
                .map_err(room)?;
            found.try_reserve_exact(part.len()).map_err(room)?;
            for &key in part {
                let hash = crate::hash::key_hash(key);
                let Some((_, r)) = self.ix.find(&self.view.index, key, hash) else {
                    continue;
                };
                let a = &self.arena;
                let words = (a.weights(r).iter().chain(a.state(r)))
                    .map(|w| w.to_bits())
                    .chain(a.meta(r).to_words());
                batch.push(key, a.generation(r), words);
                found.push(hash);
            }
            self.cold
                .as_mut()
                .expect("a disk table's shard")
                .put(&batch)?;
            for (&key, hash) in batch.keys.iter().zip(found) {
                let (slot, r) = self
                    .ix
                    .find(&self.view.index, key, hash)
                    .expect("found above, under the same lock");
                self.drop_row(slot, r);
            }
        }
        Ok(())
    }

    /// Puts row `i` of `batch`, moved from the tier below, back into
    /// memory in its save generation. The caller made room, took the key
    /// off the tier, and found it absent here.
    pub(crate) fn insert_moved(&mut self, batch: &RecordBatch, i: usize, hash: u64) {
        let (key, generation, words) = (batch.keys[i], batch.generations[i], batch.row(i));
        let (ww, sl) = (self.arena.weight_words(), self.arena.sl());
        let (w, rest) = words.split_at(ww);
        let (st, meta) = rest.split_at(sl);
        let (r, created) = self.find_or_insert(key, hash, generation, |wd, sd| {
            for (d, s) in wd.iter_mut().zip(w) {
                *d = f32::from_bits(*s);
            }
            for (d, s) in sd.iter_mut().zip(st) {
                *d = f32::from_bits(*s);
            }
        });
        debug_assert!(created, "a key is in memory or on disk, never both");
        if self.arena.tracks() {
            *self.arena.meta_mut(r) = Meta::from_words(meta);
        }
    }
}
