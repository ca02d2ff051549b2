//! A test tier: a table's rows below memory kept in memory, each read
//! slowed down, written against [`ColdStore`] alone. A disk table whose
//! shards hold it in place of the disk store runs the disk tier's
//! bit-for-bit tests (`table::cold::tests`): the table reaches its cold
//! rows through the trait only.

use std::collections::{HashMap, TryReserveError};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Result, ckpt_err};
use crate::table::Table;
use crate::table::storage::record::Loc;
use crate::table::storage::tier::{ColdStore, RecordBatch, RecordSource, RecordStore};
use crate::table::storage::write;

/// How long each record read takes (a slow device).
const READ_TIME: Duration = Duration::from_micros(20);

/// A put's rows, kept as they came: the source its records are read from.
#[derive(Debug)]
struct Chunk(RecordBatch);

impl RecordSource for Chunk {
    fn read(&self, key: i64, loc: Loc, _buf: &mut Vec<u8>, words: &mut [u32]) -> Result<()> {
        std::thread::sleep(READ_TIME);
        let r = loc.rec as usize;
        let b = &self.0;
        if b.keys.get(r) != Some(&key) || b.generations[r] != loc.generation {
            return Err(ckpt_err(
                "slow tier",
                format!("the record of key {key} is not where it was named"),
            ));
        }
        words.copy_from_slice(b.row(r));
        Ok(())
    }
}

/// One shard's rows in the test tier: the chunks puts made, with how many
/// of each chunk's rows are still named, and each key's place.
#[derive(Debug, Default)]
pub(crate) struct SlowTier {
    chunks: Vec<Option<(Arc<Chunk>, usize)>>,
    index: HashMap<i64, Loc>,
    metas: HashMap<i64, [u32; 4]>,
}

impl SlowTier {
    /// Puts an empty test tier under each shard of `t`, a new disk table
    /// (whose disk stores hold nothing yet), in place of its disk store.
    pub(crate) fn plug(t: &Table) {
        for lock in t.shards.iter() {
            let mut g = write(lock);
            assert_eq!(
                g.cold.as_ref().map(|c| c.len()),
                Some(0),
                "a new disk table"
            );
            g.cold = Some(Box::new(SlowTier::default()));
        }
    }
}

impl RecordStore for SlowTier {
    fn len(&self) -> usize {
        self.index.len()
    }

    fn contains(&self, key: i64) -> bool {
        self.index.contains_key(&key)
    }

    fn find(&self, key: i64) -> Option<(Loc, Arc<dyn RecordSource>)> {
        let loc = *self.index.get(&key)?;
        Some((loc, self.source(loc)?))
    }

    fn entries(&self) -> Box<dyn Iterator<Item = (i64, Loc)> + '_> {
        Box::new(self.index.iter().map(|(&k, &l)| (k, l)))
    }

    fn source(&self, loc: Loc) -> Option<Arc<dyn RecordSource>> {
        let (chunk, _) = self.chunks.get(loc.seg as usize)?.as_ref()?;
        let source: Arc<dyn RecordSource> = chunk.clone();
        Some(source)
    }

    fn metas(&self) -> Box<dyn Iterator<Item = (i64, [u32; 4])> + '_> {
        Box::new(self.metas.iter().map(|(&k, &w)| (k, w)))
    }
}

impl ColdStore for SlowTier {
    fn try_reserve(&mut self, n: usize) -> std::result::Result<(), TryReserveError> {
        self.metas.try_reserve(n)?;
        self.index.try_reserve(n)
    }

    fn put(&mut self, batch: &RecordBatch) -> Result<()> {
        let seg = self.chunks.len() as u32;
        let mut copy = RecordBatch::new(batch.width);
        for i in 0..batch.len() {
            copy.push(
                batch.keys[i],
                batch.generations[i],
                batch.row(i).iter().copied(),
            );
        }
        for i in 0..batch.len() {
            let key = batch.keys[i];
            self.erase(key);
            let loc = Loc {
                seg,
                rec: i as u32,
                generation: batch.generations[i],
                crc: 0,
            };
            self.index.insert(key, loc);
            self.metas.insert(key, batch.meta(i));
        }
        self.chunks.push(Some((Arc::new(Chunk(copy)), batch.len())));
        Ok(())
    }

    fn take(&mut self, key: i64, loc: Loc) -> bool {
        self.index.get(&key) == Some(&loc) && self.erase(key)
    }

    fn erase(&mut self, key: i64) -> bool {
        self.metas.remove(&key);
        let Some(loc) = self.index.remove(&key) else {
            return false;
        };
        let slot = &mut self.chunks[loc.seg as usize];
        if let Some((_, live)) = slot {
            *live -= 1;
            if *live == 0 {
                // A reader holding the chunk's `Arc` still reads it.
                *slot = None;
            }
        }
        true
    }

    fn stored_bytes(&self) -> u64 {
        let words: usize = self
            .chunks
            .iter()
            .flatten()
            .map(|c| c.0.0.words.len())
            .sum();
        words as u64 * 4
    }

    fn index_bytes(&self) -> usize {
        self.index.capacity() * (size_of::<(i64, Loc)>() + 1)
            + self.metas.capacity() * (size_of::<(i64, [u32; 4])>() + 1)
    }
}
