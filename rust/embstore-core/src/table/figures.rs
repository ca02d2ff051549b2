//! A table's figures: rows, bytes by part, and its `Stats`.

use super::*;
use crate::table::views::Evictor;

impl Table {
    /// Rows held.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let g = read(s);
                g.len() + g.cold_len()
            })
            .sum()
    }

    /// Whether the table holds no row.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// [`Table::len`] and the bytes held (as [`Table::stats`]'s `bytes`,
    /// without the counters): as each shard's last writer left them
    /// ([`storage::ShardWrite`]), without taking their locks (a one-row
    /// insert into a cache spent 4% of its time taking them); a disk
    /// table's, whose rows on disk change under its own locks, each shard
    /// read once.
    pub(crate) fn len_and_bytes(&self) -> (usize, usize) {
        let fixed = std::mem::size_of::<Self>()
            + self.shards.len() * std::mem::size_of::<CachePadded<RwLock<Shard>>>();
        let (len, shards) = if self.cold.is_none() {
            self.views.iter().fold((0, 0), |(n, b), v| {
                let c = &v.counted;
                (
                    n + c[0].load(Ordering::Acquire),
                    b + c[1].load(Ordering::Acquire),
                )
            })
        } else {
            self.shards.iter().fold((0, 0), |(n, b), s| {
                let g = read(s);
                (n + g.len() + g.cold_len(), b + g.bytes())
            })
        };
        let memo = self
            .memo
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, Memo::bytes);
        (len, fixed + shards + memo + Evictor(self).lowest_bytes())
    }

    /// Rows, bytes and per-shard rows.
    pub fn stats(&self) -> Stats {
        // A disk table's figures settled: a round of moving rows out that
        // is scheduled or running is run or waited for first.
        if let Some(c) = self.cold.as_ref().filter(|c| c.owned()) {
            crate::table::views::DiskTier(self).settle_spill(c);
        }
        let mut shard_rows = Vec::with_capacity(self.shards.len());
        let mut bytes = std::mem::size_of::<Self>()
            + self.shards.len() * std::mem::size_of::<CachePadded<RwLock<Shard>>>();
        let mut counters = Counters::default().named();
        let mut sketch_bytes = 0;
        let mut parts = (0, 0, 0);
        for s in self.shards.iter() {
            let g = read(s);
            shard_rows.push(g.len() + g.cold_len());
            bytes += g.bytes();
            let (ix, w, st) = g.bytes_by_part();
            parts = (parts.0 + ix, parts.1 + w, parts.2 + st);
            sketch_bytes += g.sketch.as_ref().map_or(0, Sketch::bytes);
            Counters::sum_into(&mut counters, &g.counters().named());
        }
        bytes += self
            .memo
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map_or(0, Memo::bytes);
        bytes += Evictor(self).lowest_bytes();
        Stats {
            rows: shard_rows.iter().sum(),
            bytes,
            shard_rows,
            step: self.step(),
            counters,
            sketch_bytes,
            index_bytes: parts.0,
            weights_bytes: parts.1,
            state_bytes: parts.2,
        }
    }
}
