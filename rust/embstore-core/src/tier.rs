//! Tiers of rows below the table's memory ([`ColdTier`]): a batch interface
//! shaped like HierarchicalKV's `ExternalStorage` (find with a found mask,
//! insert-or-assign, erase, each for a batch of keys), and whole records
//! ([`ColdTier::find_records`]: stored words, optimizer state, metadata),
//! so that a tier of rows on disk or in mapped files sits under a table
//! without the table knowing which. The mapped reader
//! ([`crate::mapped::MappedTable`], read-only: its records through the
//! read half every tier of records shares, `record.rs`'s `RecordStore`)
//! and a [`Table`] (memory, and a disk table's store below it) implement
//! it.

use crate::error::{Result, invalid};
use crate::mapped::MappedTable;
use crate::rows::{Missing, check_len};
use crate::table::storage::tier::{RecordBatch, read_records};
use crate::table::{Records, Table};
use crate::zeroed::zeros;

/// A tier of rows keyed by int64 ids. Every call takes a batch and applies
/// whole or not at all; implementations are shared across threads.
pub trait ColdTier: Send + Sync {
    /// Columns per row.
    fn dim(&self) -> usize;
    /// Rows held.
    fn len(&self) -> u64;
    /// Whether it holds no row.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Whether [`ColdTier::insert_or_assign`] and [`ColdTier::erase`] can
    /// change it (a published checkpoint cannot).
    fn writable(&self) -> bool;
    /// The row of each key into `rows` (`keys.len() * dim` floats; a key
    /// it does not hold reads as zeros) and whether it holds each into
    /// `found`.
    ///
    /// # Errors
    /// `ShapeMismatch` naming `rows` or `found`; the tier's own errors (a
    /// damaged file).
    fn find(&self, keys: &[i64], rows: &mut [f32], found: &mut [bool]) -> Result<()>;
    /// Sets the rows of `keys` to `rows` (`keys.len() * dim` floats),
    /// inserting those it does not hold.
    ///
    /// # Errors
    /// `InvalidArgument` naming `keys` for a tier that is not writable;
    /// `ShapeMismatch` naming `rows`.
    fn insert_or_assign(&self, keys: &[i64], rows: &[f32]) -> Result<()>;
    /// Removes the rows of `keys`; returns how many it held.
    ///
    /// # Errors
    /// `InvalidArgument` naming `keys` for a tier that is not writable.
    fn erase(&self, keys: &[i64]) -> Result<u64>;

    /// Each key's whole record, as a table's [`Records`] hold rows: its
    /// stored words, optimizer state and (where the tier keeps them) 4
    /// metadata words, a key it does not hold as zeros; and whether it
    /// holds each into `found`. A tier that keeps weights alone (the
    /// default) reads them through [`ColdTier::find`] as float32 words
    /// and no state.
    ///
    /// # Errors
    /// As [`ColdTier::find`]; `OutOfMemory`.
    fn find_records(&self, keys: &[i64], found: &mut [bool]) -> Result<Records> {
        check_len("found", keys.len(), found.len())?;
        let mut words = zeros::<f32>("keys", keys.len() * self.dim())?;
        self.find(keys, &mut words, found)?;
        let mut k = Vec::new();
        k.try_reserve_exact(keys.len())
            .map_err(|_| crate::error::oom("keys", keys.len() * 8))?;
        k.extend_from_slice(keys);
        Ok(Records {
            keys: k,
            words,
            ..Records::default()
        })
    }
}

impl ColdTier for MappedTable {
    fn dim(&self) -> usize {
        MappedTable::dim(self)
    }
    fn len(&self) -> u64 {
        MappedTable::len(self)
    }
    fn writable(&self) -> bool {
        false
    }
    fn find(&self, keys: &[i64], rows: &mut [f32], found: &mut [bool]) -> Result<()> {
        check_len("found", keys.len(), found.len())?;
        self.lookup(keys, Missing::Zeros, rows, Some(found))
    }
    fn insert_or_assign(&self, keys: &[i64], rows: &[f32]) -> Result<()> {
        check_len("rows", keys.len() * MappedTable::dim(self), rows.len())?;
        Err(read_only())
    }
    fn erase(&self, _keys: &[i64]) -> Result<u64> {
        Err(read_only())
    }
    /// The records of the version served now, through the mapped reader's
    /// `RecordStore` (`mapped/records.rs`): the
    /// stored words as the checkpoint's files hold them, the optimizer
    /// state where the checkpoint kept it (zeros otherwise), the metadata
    /// where every file kept it.
    fn find_records(&self, keys: &[i64], found: &mut [bool]) -> Result<Records> {
        let store = self.records()?;
        let mut batch = RecordBatch::new(store.width());
        read_records(&store, keys, &mut batch, found)?;
        Records::from_batch(&batch, store.shape(), store.with_meta())
    }
}

/// A table is a tier too (a host's table under a device cache, a table a
/// reshard reads from): in memory and, for a disk table, below it in the
/// disk store. A find reads each row as stored, touching nothing (no
/// recency, count or hit changes; a disk table's rows come into memory for
/// the call); writes are the table's `assign` and `remove`.
impl ColdTier for Table {
    fn dim(&self) -> usize {
        Table::dim(self)
    }
    fn len(&self) -> u64 {
        Table::len(self) as u64
    }
    fn writable(&self) -> bool {
        true
    }
    fn find(&self, keys: &[i64], rows: &mut [f32], found: &mut [bool]) -> Result<()> {
        let dim = Table::dim(self);
        check_len("rows", keys.len() * dim, rows.len())?;
        let r = Records::find(self, keys, found)?;
        let ww = self.weight_words();
        for ((dst, stored), &hit) in rows
            .chunks_exact_mut(dim)
            .zip(r.words.chunks_exact(ww))
            .zip(found.iter())
        {
            if hit {
                self.read_weights(stored, dst);
            } else {
                dst.fill(0.0);
            }
        }
        Ok(())
    }
    fn insert_or_assign(&self, keys: &[i64], rows: &[f32]) -> Result<()> {
        self.assign(keys, rows)
    }
    fn erase(&self, keys: &[i64]) -> Result<u64> {
        Ok(self.remove(keys)? as u64)
    }
    fn find_records(&self, keys: &[i64], found: &mut [bool]) -> Result<Records> {
        Records::find(self, keys, found)
    }
}

fn read_only() -> crate::error::StoreError {
    invalid(
        "keys",
        "expected a writable tier; a mapped checkpoint is read-only (publish to it from a table)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::storage::tier::RecordStore;
    use crate::testing::{sgd, table, temp_dir};

    #[test]
    fn a_mapped_checkpoint_is_a_read_only_cold_tier() {
        let dir = temp_dir("tier-mapped");
        let t = table(3, 4, sgd(0.1));
        let keys: Vec<i64> = (0..50).collect();
        let mut rows = vec![0.0; 50 * 3];
        t.lookup(&keys, true, &mut rows).unwrap();
        t.save(&dir, false, false, None).unwrap();
        let tier: Box<dyn ColdTier> = Box::new(MappedTable::open(&dir).unwrap());
        assert_eq!((tier.dim(), tier.len(), tier.writable()), (3, 50, false));
        let ask = [7, 1000, 49, -3];
        let mut got = vec![9.0; 4 * 3];
        let mut found = [false; 4];
        tier.find(&ask, &mut got, &mut found).unwrap();
        assert_eq!(found, [true, false, true, false]);
        assert_eq!(&got[..3], &rows[7 * 3..8 * 3]);
        assert_eq!(&got[3..6], &[0.0; 3]);
        assert_eq!(&got[6..9], &rows[49 * 3..50 * 3]);
        let err = tier.insert_or_assign(&[1], &[1.0, 2.0, 3.0]).unwrap_err();
        assert!(err.to_string().contains("read-only"), "{err}");
        assert!(tier.erase(&[1]).is_err());
        assert!(tier.find(&ask, &mut got, &mut found[..3]).is_err());
        assert_eq!(tier.len(), 50, "a refused write changes nothing");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A table of `format` with Adam and a TTL (so rows carry metadata).
    fn trained(format: crate::policy::RowFormat) -> Table {
        let mut c = crate::TableConfig::new(6);
        c.optimizer = Some(crate::optim::Optimizer::Adam {
            lr: 0.05,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        });
        c.num_shards = Some(4);
        c.policy.format = format;
        c.policy.ttl_steps = Some(1_000);
        Table::new(c).unwrap()
    }

    fn train(t: &Table, keys: &[i64], salt: f32) {
        let mut out = vec![0.0; keys.len() * 6];
        t.lookup(keys, true, &mut out).unwrap();
        let g: Vec<f32> = (0..out.len())
            .map(|i| ((i % 13) as f32 - 6.0) * salt)
            .collect();
        t.apply_gradients(keys, &g).unwrap();
    }

    /// The oracle is the table that published the checkpoint: its
    /// records (taken with `Records::take`, touching nothing) equal what
    /// the mapped reader reads as records, word for word, through a chain
    /// of a full save and a delta that changes and removes rows; a key the
    /// chain removed or never held is not found.
    #[test]
    fn a_mapped_checkpoints_records_are_the_saving_tables() {
        use crate::policy::RowFormat;
        for format in [RowFormat::F32, RowFormat::BF16, RowFormat::I8] {
            let dir = temp_dir("tier-records");
            let t = trained(format);
            let keys: Vec<i64> = (0..400).map(|k| k * 31 - 900).collect();
            train(&t, &keys, 0.1);
            t.save(&dir, false, true, None).unwrap();
            train(&t, &keys[..100], -0.2);
            t.remove(&keys[300..320]).unwrap();
            t.save(&dir, true, true, None).unwrap();
            let tier = MappedTable::open(&dir).unwrap();
            let held = Records::keys_of(&t).unwrap();
            let want = Records::take(&t, &held).unwrap();
            let mut ask = held.clone();
            ask.extend_from_slice(&keys[300..320]);
            ask.push(123_456_789);
            let mut found = vec![false; ask.len()];
            let got = tier.find_records(&ask, &mut found).unwrap();
            let n = held.len();
            assert!(found[..n].iter().all(|&f| f), "{format:?}");
            assert!(found[n..].iter().all(|&f| !f), "{format:?}");
            let (ww, sl) = (t.weight_words(), t.state_len());
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(got.keys, ask);
            assert_eq!(bits(&got.words[..n * ww]), bits(&want.words), "{format:?}");
            assert_eq!(bits(&got.state[..n * sl]), bits(&want.state), "{format:?}");
            assert_eq!((got.meta_words, want.meta_words), (4, 4));
            assert_eq!(got.meta[..n * 4], want.meta[..], "{format:?}");
            assert!(got.words[n * ww..].iter().all(|&w| w == 0.0));
            // The store's listing is the table's keys, once each.
            let store = tier.records().unwrap();
            let mut listed: Vec<i64> = store.entries().map(|(k, _)| k).collect();
            listed.sort_unstable();
            assert_eq!(listed, held);
            assert_eq!(store.len(), held.len());
            let metas: std::collections::HashMap<i64, [u32; 4]> = store.metas().collect();
            assert_eq!(metas.len(), held.len());
            for (j, k) in held.iter().enumerate() {
                assert_eq!(metas[k], want.meta[4 * j..4 * j + 4], "{format:?}: key {k}");
                let (loc, _) = store.find(*k).unwrap();
                assert!(store.source(loc).is_some());
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    /// A table as a tier (memory, and a disk table's rows on disk): a
    /// find gives what a lookup gives for the keys it holds, zeros and
    /// not found for the others, and touches nothing (the metadata
    /// export is unchanged, no row is inserted).
    #[test]
    fn a_table_is_a_cold_tier_whose_finds_touch_nothing() {
        for disk in [false, true] {
            let dir = temp_dir("tier-table");
            let t = trained(crate::policy::RowFormat::BF16);
            let t = if disk {
                let mut c = t.config().clone();
                c.disk = Some(crate::DiskConfig {
                    path: dir.clone(),
                    memory_bytes: 8 * 1024,
                });
                Table::new(c).unwrap()
            } else {
                t
            };
            let keys: Vec<i64> = (0..300).collect();
            train(&t, &keys, 0.3);
            let before = t.export_all(true, true).unwrap();
            let ask = [5, 299, 1_000, -1, 17];
            let mut rows = vec![9.0; ask.len() * 6];
            let mut found = [true; 5];
            let tier: &dyn ColdTier = &t;
            tier.find(&ask, &mut rows, &mut found).unwrap();
            assert_eq!(found, [true, true, false, false, true]);
            let after = t.export_all(true, true).unwrap();
            assert_eq!(after.keys, before.keys, "a find inserts nothing");
            assert_eq!(after.meta, before.meta, "a find touches nothing");
            for (j, &k) in ask.iter().enumerate() {
                let got = &rows[j * 6..(j + 1) * 6];
                match before.keys.binary_search(&k) {
                    Ok(i) => assert_eq!(got, &before.rows[i * 6..(i + 1) * 6]),
                    Err(_) => assert_eq!(got, &[0.0; 6]),
                }
            }
            let r = tier.find_records(&ask, &mut found).unwrap();
            assert_eq!(r.words.len(), 5 * t.weight_words());
            assert_eq!(tier.erase(&[5, 1_000]).unwrap(), 1);
            tier.insert_or_assign(&[1_000], &[0.5; 6]).unwrap();
            tier.find(&[5, 1_000], &mut rows[..12], &mut found[..2])
                .unwrap();
            assert_eq!(&found[..2], &[false, true]);
            assert_eq!(&rows[6..12], &[0.5; 6]);
            assert!(tier.find(&[1], &mut rows[..5], &mut found[..1]).is_err());
            drop(t);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
