//! The disk store as the table's cold tier ([`ColdStore`]), and its
//! segment files as the sources its records are read from.

use super::*;
use std::collections::TryReserveError;

use crate::table::storage::compact::{Scratch, each_row};
use crate::table::storage::tier::{ColdStore, RecordBatch, RecordSource, RecordStore};

impl ColdShard {
    /// The file of segment `seg`, while it exists.
    pub(crate) fn segment(&self, seg: u32) -> Option<Arc<SegFile>> {
        Some(self.segments.get(seg as usize)?.as_ref()?.file.clone())
    }

    /// Records `key`'s metadata words (for a shard that keeps them).
    fn set_meta(&mut self, key: i64, words: [u32; 4]) {
        if let Some(m) = self.metas.as_mut() {
            m.insert(key, words);
        }
    }
}

impl RecordSource for SegFile {
    fn read(&self, key: i64, loc: Loc, buf: &mut Vec<u8>, words: &mut [u32]) -> Result<()> {
        ColdShard::read(self, words.len(), key, loc, buf, words)
    }

    fn read_run(
        &self,
        live: &[(u32, i64, Loc)],
        scratch: Scratch<'_>,
        f: &mut dyn FnMut(i64, &[u32]) -> Result<()>,
    ) -> Result<()> {
        each_row(self, live, scratch, |key, _, words| f(key, words))
    }
}

impl RecordStore for ColdShard {
    fn len(&self) -> usize {
        self.index.len()
    }

    fn contains(&self, key: i64) -> bool {
        self.index.contains_key(&key)
    }

    fn find(&self, key: i64) -> Option<(Loc, Arc<dyn RecordSource>)> {
        let loc = *self.index.get(&key)?;
        let file: Arc<dyn RecordSource> = self.segment(loc.seg)?;
        Some((loc, file))
    }

    fn entries(&self) -> Box<dyn Iterator<Item = (i64, Loc)> + '_> {
        Box::new(self.index.iter().map(|(&k, &l)| (k, l)))
    }

    fn source(&self, loc: Loc) -> Option<Arc<dyn RecordSource>> {
        Some(self.segment(loc.seg)?)
    }

    fn metas(&self) -> Box<dyn Iterator<Item = (i64, [u32; 4])> + '_> {
        Box::new(
            self.metas
                .iter()
                .flat_map(|m| m.iter().map(|(&k, &w)| (k, w))),
        )
    }
}

impl ColdStore for ColdShard {
    fn try_reserve(&mut self, n: usize) -> std::result::Result<(), TryReserveError> {
        if let Some(m) = self.metas.as_mut() {
            m.try_reserve(n)?;
        }
        self.index.try_reserve(n)
    }

    /// Appends the rows to the active segment (a new one when it fills)
    /// and writes them, then names each: a failed write names none.
    fn put(&mut self, batch: &RecordBatch) -> Result<()> {
        debug_assert_eq!(batch.width, self.words);
        let mut placed = Vec::new();
        placed
            .try_reserve_exact(batch.len())
            .map_err(|_| crate::error::oom("keys", batch.len() as u128 * 16))?;
        for i in 0..batch.len() {
            match self.append(batch.keys[i], batch.generations[i], batch.row(i)) {
                Ok(loc) => placed.push(loc),
                Err(e) => {
                    self.discard();
                    return Err(e);
                }
            }
        }
        if let Err(e) = self.flush() {
            self.discard();
            return Err(e);
        }
        for (i, loc) in placed.into_iter().enumerate() {
            self.set(batch.keys[i], loc);
            self.set_meta(batch.keys[i], batch.meta(i));
        }
        Ok(())
    }

    fn take(&mut self, key: i64, loc: Loc) -> bool {
        if self.index.get(&key) != Some(&loc) {
            return false;
        }
        self.erase(key)
    }

    fn erase(&mut self, key: i64) -> bool {
        if let Some(m) = self.metas.as_mut() {
            m.remove(&key);
        }
        self.drop_entry(key)
    }

    fn stored_bytes(&self) -> u64 {
        self.segments.iter().flatten().map(|s| s.bytes).sum::<u64>() + self.pending.len() as u64
    }

    /// Its table, as hashbrown sizes it: a key, a [`Loc`] and a control
    /// byte a bucket, and the metadata's.
    fn index_bytes(&self) -> usize {
        self.index.capacity() * (size_of::<(i64, Loc)>() + 1)
            + self
                .metas
                .as_ref()
                .map_or(0, |m| m.capacity() * (size_of::<(i64, [u32; 4])>() + 1))
    }

    /// Files more than half dead, or a write failed since the last job.
    fn compaction_due(&self) -> bool {
        self.dead_share() > 0.5 || self.write_failed()
    }

    fn compaction_job(&mut self, budget: usize) -> Option<Job> {
        self.take_job(budget)
    }

    fn install(&mut self, done: Done) -> usize {
        self.install_job(done)
    }

    fn adopts(&self) -> bool {
        true
    }

    /// The file becomes a segment of this shard ([`base::adopt`]: linked,
    /// or copied where it cannot be), each row named at its record with
    /// its CRC.
    fn adopt(
        &mut self,
        dir: &Path,
        name: &str,
        bytes: u64,
        cols: Columns,
        rows: &mut dyn Iterator<Item = (i64, u32, [u32; 4])>,
    ) -> Result<()> {
        let seg = self.link_base(dir, name, bytes, cols)?;
        for (r, (key, crc, meta)) in rows.enumerate() {
            let loc = Loc {
                seg,
                rec: r as u32,
                generation: 1,
                crc,
            };
            self.set(key, loc);
            self.set_meta(key, meta);
        }
        Ok(())
    }

    #[cfg(test)]
    fn disk(&mut self) -> Option<&mut ColdShard> {
        Some(self)
    }
}
