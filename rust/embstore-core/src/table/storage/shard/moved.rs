//! Rows that move between a shard and its disk files: read from disk,
//! spilled to disk, and taken back (the disk tier's side of a shard).

use super::Shard;
use crate::policy::Meta;
use crate::table::storage::cold::ColdShard;

impl Shard {
    /// The words (stored weights, state, metadata, as floats of the same
    /// bits) of `key`'s row on disk; `None` when it is not there.
    ///
    /// # Errors
    /// `Checkpoint` when it cannot be read or fails its check.
    pub(crate) fn read_cold(&self, key: i64) -> crate::error::Result<Option<Vec<f32>>> {
        let Some((loc, file)) = self.cold.as_ref().and_then(|c| c.find(key)) else {
            return Ok(None);
        };
        let n = self.arena.weight_words() + self.arena.sl() + 4;
        let mut words = vec![0u32; n];
        ColdShard::read(&file, n, key, loc, &mut Vec::new(), &mut words)?;
        Ok(Some(words.into_iter().map(f32::from_bits).collect()))
    }

    /// Rows held on disk (none for a table in memory).
    pub(crate) fn cold_len(&self) -> usize {
        self.cold.as_ref().map_or(0, ColdShard::len)
    }

    /// Moves the rows of `keys` (held in memory) to disk: their stored
    /// words, state and metadata, with their save generations, appended to
    /// the cold shard and written; then named there and taken out of
    /// memory (not removals: nothing is logged for incremental saves).
    ///
    /// # Errors
    /// `Checkpoint` when the disk store cannot take them: every row stays
    /// in memory then.
    pub(crate) fn spill(&mut self, keys: &[i64]) -> crate::error::Result<()> {
        let mut words = Vec::new();
        let mut placed = Vec::with_capacity(keys.len());
        let cold = self.cold.as_mut().expect("a disk table's shard");
        for &key in keys {
            let hash = crate::hash::key_hash(key);
            let Some((_, r)) = self.ix.find(&self.view.index, key, hash) else {
                continue;
            };
            words.clear();
            words.extend(self.arena.weights(r).iter().map(|w| w.to_bits()));
            words.extend(self.arena.state(r).iter().map(|w| w.to_bits()));
            words.extend(self.arena.meta(r).to_words());
            match cold.append(key, self.arena.generation(r), &words) {
                Ok(loc) => placed.push((key, hash, loc)),
                Err(e) => {
                    cold.discard();
                    return Err(e);
                }
            }
        }
        if let Err(e) = cold.flush() {
            cold.discard();
            return Err(e);
        }
        for (key, hash, loc) in placed {
            let (slot, r) = self
                .ix
                .find(&self.view.index, key, hash)
                .expect("found above, under the same lock");
            let cold = self.cold.as_mut().expect("checked above");
            cold.set(key, loc);
            cold.set_meta(key, self.arena.meta(r).to_words());
            self.drop_row(slot, r);
        }
        Ok(())
    }

    /// Puts a row moved from disk back into memory: `words` as
    /// [`Shard::spill`] wrote them, in save generation `generation`. The
    /// caller made room, took the key off disk, and found it absent here.
    pub(crate) fn insert_moved(&mut self, key: i64, hash: u64, generation: u32, words: &[u32]) {
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
