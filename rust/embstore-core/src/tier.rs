//! Tiers of rows below the table's memory ([`ColdTier`]): a batch interface
//! shaped like HierarchicalKV's `ExternalStorage` (find with a found mask,
//! insert-or-assign, erase, each for a batch of keys), so that a tier of
//! rows on disk or in mapped files sits under a table without the table
//! knowing which. The mapped reader ([`crate::mapped::MappedTable`]) is the
//! first, read-only, implementation.

use crate::error::{Result, invalid};
use crate::mapped::MappedTable;
use crate::rows::{Missing, check_len};

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
}
