//! Rows with everything they carry, as one batch: the keys, each row's
//! stored words (an 8-bit row's codes, scale and offset), its optimizer
//! state and its policy metadata. [`Records::take`] reads them from a
//! table, a batch of keys at a time, from memory or from disk, without
//! touching them (no recency or count changes); [`Table::restore_stored`]
//! puts them into another. An online reshard moves a table between ranks
//! so: a disk table's rows below memory are read where they lie, one
//! batch at a time, none moved into its memory.

use crate::table::views::DiskTier;
use std::sync::PoisonError;

use crate::error::{Result, invalid, oom};
use crate::record::{Loc, RecordBatch, RecordSource, read_all};
use crate::table::batch::output::SharedOut;
use crate::table::batch::plan::Floor;
use crate::table::read::disk::disk_items;
use crate::table::storage::read;
use crate::table::{NO_ROW, Table};
use crate::zeroed::zeros;
use std::sync::Arc;

/// Records below memory a take reads at a time (the scratch it holds).
const READ_PIECE: usize = 4096;

/// A batch of rows as a table stores them ([`Records::take`]).
#[derive(Debug, Default)]
pub struct Records {
    /// The rows' keys, in the order asked for.
    pub keys: Vec<i64>,
    /// Stored words, [`Table::weight_words`] a row.
    pub words: Vec<f32>,
    /// Optimizer state, [`Table::state_len`] a row.
    pub state: Vec<f32>,
    /// Policy metadata, 4 words a row ([`crate::policy::Meta::to_words`])
    /// where the table's policy tracks touches (TTL, capacity); else empty.
    pub meta: Vec<u32>,
    /// Metadata words a row: 4 where the policy tracks touches, else 0.
    pub meta_words: usize,
}

impl Records {
    /// The rows of `batch` (records of `ww` stored words, `sl` state words
    /// and 4 metadata words), with their metadata where `with_meta`.
    ///
    /// # Errors
    /// `OutOfMemory` when the columns cannot be allocated.
    pub(crate) fn from_batch(
        batch: &RecordBatch,
        (ww, sl): (usize, usize),
        with_meta: bool,
    ) -> Result<Records> {
        let n = batch.len();
        debug_assert_eq!(batch.width, ww + sl + 4);
        let mw = if with_meta { 4 } else { 0 };
        let mut keys: Vec<i64> = Vec::new();
        keys.try_reserve_exact(n).map_err(|_| oom("keys", n * 8))?;
        keys.extend_from_slice(&batch.keys);
        let mut words = zeros::<f32>("keys", n * ww)?;
        let mut state = zeros::<f32>("keys", n * sl)?;
        let mut meta = zeros::<u32>("keys", n * mw)?;
        for i in 0..n {
            let r = batch.row(i);
            for (d, &w) in words[i * ww..(i + 1) * ww].iter_mut().zip(&r[..ww]) {
                *d = f32::from_bits(w);
            }
            for (d, &w) in state[i * sl..(i + 1) * sl].iter_mut().zip(&r[ww..ww + sl]) {
                *d = f32::from_bits(w);
            }
            meta[i * mw..(i + 1) * mw].copy_from_slice(&r[ww + sl..ww + sl + mw]);
        }
        Ok(Records {
            keys,
            words,
            state,
            meta,
            meta_words: mw,
        })
    }

    /// Every key `t` holds, in memory and on disk, ascending: one
    /// consistent listing (writers wait for it).
    ///
    /// # Errors
    /// `OutOfMemory` when the list cannot be allocated.
    pub fn keys_of(t: &Table) -> Result<Vec<i64>> {
        let _floor = DiskTier(t).rows_in_place();
        let _gate = t.gate.write().unwrap_or_else(PoisonError::into_inner);
        let guards: Vec<_> = t.shards.iter().map(|s| read(s)).collect();
        let mut disk = Vec::new();
        for g in &guards {
            disk_items(g, None, &mut disk);
        }
        let total = guards.iter().map(|g| g.len()).sum::<usize>() + disk.len();
        let mut keys: Vec<i64> = Vec::new();
        keys.try_reserve_exact(total)
            .map_err(|_| oom("keys", total * 8))?;
        for g in &guards {
            keys.extend(g.keys_and_rows().map(|(k, _)| k));
        }
        keys.extend(disk.iter().map(|d| d.key()));
        keys.sort_unstable();
        Ok(keys)
    }

    /// The rows of `keys` in `t`, each as stored, with its state and (where
    /// the policy tracks touches) metadata. Nothing about a row changes or
    /// moves: a disk table's rows below memory are read where they lie
    /// (through its store's `RecordStore` half), no touch is recorded and
    /// no hit counted.
    ///
    /// # Errors
    /// `InvalidArgument` naming `keys` for a key `t` does not hold (the
    /// first such); `OutOfMemory`; `Checkpoint` for a row on disk that
    /// cannot be read.
    pub fn take(t: &Table, keys: &[i64]) -> Result<Records> {
        let mut found = zeros::<bool>("keys", keys.len())?;
        let r = Records::find(t, keys, &mut found)?;
        if let Some(i) = found.iter().position(|&f| !f) {
            return Err(invalid(
                "keys",
                format!(
                    "expected keys the table holds, got {}, which has no row",
                    keys[i]
                ),
            ));
        }
        Ok(r)
    }

    /// [`Records::take`] that reads a key `t` does not hold as zeros and
    /// says whether it holds each in `found` (refusing none).
    ///
    /// # Errors
    /// `ShapeMismatch` naming `found`; `OutOfMemory`; `Checkpoint` for a
    /// row on disk that cannot be read.
    pub fn find(t: &Table, keys: &[i64], found: &mut [bool]) -> Result<Records> {
        crate::rows::check_len("found", keys.len(), found.len())?;
        Table::check_batch(keys)?;
        let (ww, sl) = (t.wwords, t.state_len);
        let with_meta = t.policy.tracks();
        let mw = if with_meta { 4 } else { 0 };
        let mut words = zeros::<f32>("keys", keys.len() * ww)?;
        let mut state = zeros::<f32>("keys", keys.len() * sl)?;
        let mut meta_f = zeros::<f32>("keys", keys.len() * mw)?;
        // Rows stay where they are for the call: those in memory are read
        // under their shard's lock, those below it found there and read
        // from their store's source after the lock is dropped (a record,
        // once written, never changes), none moved into memory.
        let plan = t.plan(keys, Floor::InPlace)?;
        if with_meta {
            t.count_queued_reads();
        }
        found.fill(true);
        let missing = std::sync::Mutex::new(Vec::<usize>::new());
        let below = std::sync::Mutex::new(Vec::<(usize, Loc, Arc<dyn RecordSource>)>::new());
        {
            let (w_out, st_out) = (
                SharedOut::new(&mut words, ww),
                SharedOut::new(&mut state, sl),
            );
            let m_out = SharedOut::new(&mut meta_f, mw);
            t.par_shards(&plan, |g, pos| {
                let mut rows = Vec::new();
                g.find_many(keys, &plan.hashes, pos, &mut rows);
                for (&i, &r) in pos.iter().zip(&rows) {
                    let i = i as usize;
                    if r == NO_ROW {
                        match g.cold.as_deref().and_then(|c| c.find(keys[i])) {
                            Some((loc, src)) => below
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .push((i, loc, src)),
                            None => missing
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .push(i),
                        }
                        continue;
                    }
                    let r = r as usize;
                    // SAFETY: position i belongs to this shard only (plan).
                    let (dst, st) = unsafe { (w_out.row(i, ww), st_out.row(i, sl)) };
                    dst.copy_from_slice(&g.weights(r)[..ww]);
                    st.copy_from_slice(g.state(r));
                    if with_meta {
                        // SAFETY: as above.
                        let m = unsafe { m_out.row(i, 4) };
                        for (d, w) in m.iter_mut().zip(g.meta(r).to_words()) {
                            *d = f32::from_bits(w);
                        }
                    }
                }
            });
            // Read as a fault-in reads (many in flight: a disk's random
            // reads want depth), a bounded piece at a time.
            let below = below.into_inner().unwrap_or_else(PoisonError::into_inner);
            let width = ww + sl + 4;
            let mut rec = zeros::<u32>("keys", below.len().min(READ_PIECE) * width)?;
            for part in below.chunks(READ_PIECE) {
                let list: Vec<(i64, Loc, &dyn RecordSource)> = part
                    .iter()
                    .map(|(i, loc, src)| (keys[*i], *loc, &**src))
                    .collect();
                let rec = &mut rec[..part.len() * width];
                read_all(&list, width, rec)?;
                for ((i, _, _), r) in part.iter().zip(rec.chunks_exact(width)) {
                    // SAFETY: position i is one key's (each key is listed
                    // once, by its shard), and no other writer runs now.
                    let (dst, st) = unsafe { (w_out.row(*i, ww), st_out.row(*i, sl)) };
                    let bits = |d: &mut [f32], w: &[u32]| {
                        d.iter_mut()
                            .zip(w)
                            .for_each(|(d, &w)| *d = f32::from_bits(w));
                    };
                    bits(dst, &r[..ww]);
                    bits(st, &r[ww..ww + sl]);
                    if with_meta {
                        // SAFETY: as above.
                        bits(unsafe { m_out.row(*i, 4) }, &r[ww + sl..]);
                    }
                }
            }
        }
        for i in missing.into_inner().unwrap_or_else(PoisonError::into_inner) {
            found[i] = false;
        }
        let mut keys_out: Vec<i64> = Vec::new();
        keys_out
            .try_reserve_exact(keys.len())
            .map_err(|_| oom("keys", keys.len() * 8))?;
        keys_out.extend_from_slice(keys);
        Ok(Records {
            keys: keys_out,
            words,
            state,
            meta: meta_f.into_iter().map(f32::to_bits).collect(),
            meta_words: mw,
        })
    }

    /// Puts these rows into `t` (a table of the same configuration) as
    /// [`Table::restore_stored`] does, with `clock` the call clock their
    /// metadata ticks count in.
    ///
    /// # Errors
    /// As [`Table::restore_stored`]; nothing changed then.
    pub fn put(&self, t: &Table, clock: u64) -> Result<()> {
        let meta = (!self.meta.is_empty()).then_some(&self.meta[..]);
        let state = (t.state_len > 0).then_some(&self.state[..]);
        t.restore_stored(&self.keys, &self.words, state, meta, clock)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TableConfig;
    use crate::optim::Optimizer;

    fn table(capacity: bool) -> Table {
        let mut c = TableConfig::new(8);
        c.optimizer = Some(Optimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        });
        if capacity {
            c.policy.capacity = Some(1000);
        }
        Table::new(c).unwrap()
    }

    #[test]
    fn taken_rows_put_into_a_fresh_table_equal_the_source_and_touch_nothing() {
        for capacity in [false, true] {
            let a = table(capacity);
            let keys: Vec<i64> = (0..300).map(|k| k * 7 - 50).collect();
            let mut out = vec![0.0; keys.len() * 8];
            a.lookup(&keys, true, &mut out).unwrap();
            a.apply_gradients(&keys, &vec![0.5; keys.len() * 8])
                .unwrap();
            let before = a.export_all(true, true).unwrap();
            let listed = Records::keys_of(&a).unwrap();
            assert_eq!(listed, before.keys);
            let r = Records::take(&a, &listed).unwrap();
            // Taking touched nothing: the metadata is as before.
            assert_eq!(a.export_all(true, true).unwrap().meta, before.meta);
            assert_eq!(r.meta, before.meta);
            let b = table(capacity);
            r.put(&b, before.clock).unwrap();
            let after = b.export_all(true, true).unwrap();
            assert_eq!(after.keys, before.keys);
            assert_eq!(after.rows, before.rows);
            assert_eq!(after.state, before.state);
            assert_eq!(after.meta, before.meta);
        }
    }

    #[test]
    fn a_key_without_a_row_is_refused_by_name() {
        let a = table(false);
        let mut out = vec![0.0; 8];
        a.lookup(&[1], true, &mut out).unwrap();
        let e = Records::take(&a, &[1, 99]).unwrap_err().to_string();
        assert!(e.contains("keys") && e.contains("99"), "{e}");
    }

    /// A disk table's rows below memory are read where they lie: the
    /// records equal its twin in memory's, word for word, and taking them
    /// reads nothing into memory (memory and disk row counts unchanged).
    #[test]
    fn a_disk_tables_rows_are_taken_where_they_lie() {
        let dir = crate::testing::temp_dir("records-disk");
        let ram = table(true);
        let mut c = ram.config();
        c.disk = Some(crate::DiskConfig {
            path: dir.clone(),
            memory_bytes: 16 * 1024,
        });
        let disk = Table::new(c).unwrap();
        let keys: Vec<i64> = (0..2_000).map(|k| k * 13 - 7).collect();
        for t in [&ram, &disk] {
            for part in keys.chunks(250) {
                let mut out = vec![0.0; part.len() * 8];
                t.lookup(part, true, &mut out).unwrap();
                t.apply_gradients(part, &vec![0.25; part.len() * 8])
                    .unwrap();
            }
        }
        let before = disk.disk_stats().unwrap();
        assert!(before.disk_rows > 500, "{before:?}");
        let held = Records::keys_of(&ram).unwrap();
        assert_eq!(Records::keys_of(&disk).unwrap(), held);
        let (a, b) = (
            Records::take(&ram, &held).unwrap(),
            Records::take(&disk, &held).unwrap(),
        );
        let after = disk.disk_stats().unwrap();
        assert_eq!(
            (after.memory_rows, after.disk_rows, after.rows_read),
            (before.memory_rows, before.disk_rows, before.rows_read)
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.words), bits(&b.words));
        assert_eq!(bits(&a.state), bits(&b.state));
        assert_eq!(a.meta, b.meta);
        drop(disk);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
