//! Rows as every tier hands them out, whichever answers a batch call (the
//! table's shards, the mapped reader, a cold tier): what a key without a
//! row reads as ([`Missing`]), the row slot that means "no row"
//! ([`NO_ROW`]), and the checks of lengths and values a call makes before
//! it changes anything.

use crate::error::{Result, StoreError, invalid};
use crate::format::codec::RowFormat;
use crate::init::Initializer;
use crate::simd::Backend;
use rayon::iter::IndexedParallelIterator;
use rayon::prelude::ParallelSlice;

/// What a lookup returns for a key that has no row and gets none.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub enum Missing<'a> {
    /// The row the initializer would give the key (a pure function of
    /// seed, key and column), as before a first training step.
    #[default]
    Init,
    /// Zeros (serving: an unknown id contributes nothing to a sum).
    Zeros,
    /// This row (`dim` floats).
    Row(&'a [f32]),
}

impl Missing<'_> {
    /// Checks a default for missing keys: a given row has `dim` finite
    /// floats.
    ///
    /// # Errors
    /// `ShapeMismatch` or `InvalidArgument`, naming `default`.
    pub(crate) fn check(self, dim: usize) -> Result<()> {
        if let Missing::Row(row) = self {
            check_len("default", dim, row.len())?;
            if row.iter().any(|v| !v.is_finite()) {
                return Err(invalid("default", "expected finite values"));
            }
        }
        Ok(())
    }

    /// What a key without a row reads as, into `dst` (`dim` floats): its
    /// new row ([`NewRows::read`]), zeros or the given row.
    #[inline]
    pub(crate) fn fill(self, new: &NewRows<'_>, key: i64, dst: &mut [f32]) {
        match self {
            Missing::Init => new.read(key, dst),
            Missing::Zeros => dst.fill(0.0),
            Missing::Row(row) => dst.copy_from_slice(row),
        }
    }
}

thread_local! {
    /// A row of floats for encoding new compact rows.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// What a key without a row becomes, in every tier: the row the
/// initializer gives it under the seed (a pure function of seed, key and
/// column), in the row format. A table stores it ([`NewRows::store`]) when
/// the key gets a row; a lookup that gives none reads it
/// ([`NewRows::read`], [`Missing::Init`]); both are the same row.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NewRows<'a> {
    pub(crate) initializer: &'a Initializer,
    pub(crate) backend: Backend,
    pub(crate) seed: u64,
    pub(crate) format: RowFormat,
}

impl NewRows<'_> {
    /// The key's new row as float32 into `dst` (`dim` floats), rounded to
    /// the row format: what reading it back after a store gives.
    #[inline]
    pub(crate) fn read(&self, key: i64, dst: &mut [f32]) {
        self.initializer
            .fill_with(self.backend, self.seed, key, dst);
        self.format.round(dst);
    }

    /// The key's new row as the table stores it, into `words` (the row
    /// format's words for `dim` weights).
    #[inline]
    pub(crate) fn store(&self, key: i64, dim: usize, words: &mut [f32]) {
        if self.format == RowFormat::F32 {
            self.initializer
                .fill_with(self.backend, self.seed, key, &mut words[..dim]);
        } else {
            SCRATCH.with_borrow_mut(|tmp| {
                tmp.resize(dim, 0.0);
                self.initializer
                    .fill_with(self.backend, self.seed, key, tmp);
                self.format.encode(tmp, words);
            });
        }
    }
}

/// A row slot meaning "no row": a key that is absent (not found, or not
/// admitted) in the per-shard row lists of a plan, the memo and the pooled
/// passes.
pub(crate) const NO_ROW: u32 = u32::MAX;

/// Fails with the flat index of the first non-finite value.
pub fn check_finite(arg: &'static str, data: &[f32]) -> Result<()> {
    check_finite_max(arg, data).map(|_| ())
}

/// [`check_finite`] that also returns the largest magnitude in `data`.
pub fn check_finite_max(arg: &'static str, data: &[f32]) -> Result<f32> {
    check_finite_max_on(arg, data, Scan::Parallel)
}

/// Where a check's scan runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scan {
    /// In blocks on rayon's pool.
    Parallel,
    /// On the calling thread alone: for a check run while its thread holds
    /// something other calls wait for (a `OnceLock` being initialized),
    /// where a pool thread waiting for a block it handed out could run
    /// another job meanwhile, one that waits for what it holds.
    Here,
}

/// [`check_finite_max`], its scan run as `scan` says.
pub fn check_finite_max_on(arg: &'static str, data: &[f32], scan: Scan) -> Result<f32> {
    const CHUNK: usize = 1 << 16;
    // A branch-free scan in the CPU's widest vectors: the largest
    // magnitude's bits; an exponent of all ones is NaN/inf.
    let backend = crate::simd::Backend::best();
    let top = match scan {
        Scan::Parallel => backend.max_magnitude_bits_pooled(data),
        Scan::Here => backend.max_magnitude_bits(data),
    };
    if top < 0x7F80_0000 {
        return Ok(f32::from_bits(top));
    }
    let bad = |c: &[f32]| c.iter().any(|v| !v.is_finite());
    let first_bad_chunk = match scan {
        Scan::Parallel => data.par_chunks(CHUNK).position_first(bad),
        Scan::Here => data.chunks(CHUNK).position(bad),
    };
    match first_bad_chunk {
        None => Ok(f32::from_bits(top)),
        Some(c) => {
            let start = c * CHUNK;
            let offset = data[start..]
                .iter()
                .position(|v| !v.is_finite())
                .expect("the chunk holds a non-finite value");
            Err(StoreError::NonFinite {
                arg,
                index: start + offset,
            })
        }
    }
}

/// Fails with `ShapeMismatch` naming `arg` unless `got == expected`.
///
/// # Errors
/// As above.
pub(crate) fn check_len(arg: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(StoreError::ShapeMismatch { arg, expected, got })
    }
}
