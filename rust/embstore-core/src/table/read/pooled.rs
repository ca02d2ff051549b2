//! Pooled lookups and their backward: CSR bags of ids, as
//! `torch.nn.EmbeddingBag(include_last_offset=True)` and TF's
//! `embedding_lookup_sparse` take them.
//!
//! A bag's pooled row is `sum_i c_i * x_i` over its ids, with `c_i = w_i / d`
//! (`w_i` the id's weight, 1 without weights) and `d` the combiner's
//! denominator: 1 for `sum`, `sum_i w_i` for `mean`, `sqrt(sum_i w_i^2)` for
//! `sqrtn`. The backward gives id `i` the gradient `c_i * grad[bag]`, exactly
//! what EmbeddingBag's backward gives, and then takes one optimizer step.
//! An empty bag pools to zeros (and a bag whose denominator is 0 too).

use crate::error::{Result, invalid};
use crate::table::batch::bags::{Bags, Coefs, check_columns, check_idx};
use crate::table::batch::found::FoundRows;
use crate::table::batch::output::SharedOut;
use crate::table::batch::plan::{Floor, Plan, Planned, SEQUENTIAL_KEYS};
use crate::table::checks::check_len;
use crate::table::read::pooling::{Pooling, all_finite};
use crate::table::views::Pooler;
use crate::table::views::{Evictor, Memos, Reader};
use crate::table::{Missing, NO_ROW, Table};
use crate::zeroed::{with_room, zeros};
use rayon::iter::{IndexedParallelIterator, ParallelIterator};
use rayon::prelude::ParallelSliceMut;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

impl Table {
    /// Pooled rows of `bags` into `out` (`batch * dim`). With `insert`,
    /// missing ids get a stored row from the initializer; without, they pool
    /// the initializer's row and nothing is stored.
    ///
    /// # Errors
    /// Bad CSR input or a wrong `out` length; nothing changed.
    pub fn lookup_pooled(&self, bags: &Bags<'_>, insert: bool, out: &mut [f32]) -> Result<()> {
        self.lookup_pooled_or(bags, insert, Missing::Init, out)
    }

    /// [`Table::lookup_pooled`] whose ids without a row (not inserted) pool
    /// `missing` instead of the initializer's row.
    ///
    /// # Errors
    /// Bad CSR input, a wrong `out` length or a bad default row; nothing changed.
    pub fn lookup_pooled_or(
        &self,
        bags: &Bags<'_>,
        insert: bool,
        missing: Missing<'_>,
        out: &mut [f32],
    ) -> Result<()> {
        bags.validate()?;
        if bags.one_id_each() {
            // Each pooled row is its id's row: the plain lookup, without
            // the per-id bag bookkeeping.
            return self.lookup_or(bags.ids, insert, missing, out);
        }
        self.check_missing(missing)?;
        check_len("out", bags.batch() * self.dim, out.len())?;
        let Planned {
            plan,
            floor: _floor,
        } = self.plan(bags.ids, Floor::Read)?;
        let _gate = self.lookup_changes(insert).then(|| self.enter());
        Pooler(self).lookup_pooled_in(
            &[(*bags, 0)],
            bags.ids,
            plan,
            insert,
            missing,
            SharedOut::new(out, self.dim),
        )?;
        if insert {
            Evictor(self).enforce_capacity();
        }
        Ok(())
    }
}

impl<'a> Pooler<'a> {
    /// [`Table::lookup_pooled`] on checked input, with the gate held when
    /// `insert`, for one or more features served by this table: feature
    /// `(bags, col)` writes bag `b` to row `b` of `out` from column `col`.
    /// All the features' ids (`ids`, `batch::bags::pooled_ids`) go through one plan
    /// (`plan`, made by the caller before the gate), one reservation and
    /// one memo.
    ///
    /// First the rows of every id are found (and created, when `insert`)
    /// by the shard pass of an unpooled lookup, which copies nothing. Then
    /// the bags are pooled in parallel, in chunks of whole bags: a chunk's
    /// job holds the read locks of the shards its ids live in (taken in
    /// index order) and sums each bag's rows straight from the shards, in
    /// the bag's id order. No row passes through a buffer. A shard that
    /// removed rows since the first pass (another thread's eviction or
    /// removal) has the chunk's ids probed again under the read lock.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lookup_pooled_in(
        &self,
        feats: &[(Bags<'_>, usize)],
        ids: &[i64],
        plan: Plan,
        insert: bool,
        missing: Missing<'_>,
        out: SharedOut,
    ) -> Result<()> {
        let n = ids.len();
        let mut coef = zeros::<f32>("ids", n)?;
        let mut bag_of = Vec::new();
        let mut base = 0usize;
        for (bags, _) in feats {
            let m = bags.ids.len();
            bag_of.resize(m, 0);
            bags.coefs_into(&mut bag_of, &mut coef[base..base + m]);
            base += m;
        }
        drop(bag_of);
        if !self.lookup_changes(insert) {
            let overflow = AtomicBool::new(false);
            let pool = Pooling {
                ids,
                hashes: &plan.hashes,
                row_of: &[],
                removals: &[],
                coef: &coef,
                missing,
                overflow: &overflow,
            };
            self.serve_pooled(feats, &pool, out);
            self.record_reads(ids, &plan);
            return Pooler::pooled_overflow(&overflow);
        }
        let found = FoundRows::new(self.shards.len());
        // Each id's row, written by each shard's job as it finds them, and
        // each shard's removal count then.
        let mut row_of: Vec<AtomicU32> = with_room("ids", n)?;
        row_of.extend((0..n).map(|_| AtomicU32::new(NO_ROW)));
        Reader(self).lookup_rows(ids, &plan, insert, Some(&found), |_, pos, rows| {
            for (&i, &r) in pos.iter().zip(rows) {
                row_of[i as usize].store(r, Ordering::Relaxed);
            }
        })?;
        let removals = found.removals();
        let overflow = AtomicBool::new(false);
        let pool = Pooling {
            ids,
            hashes: &plan.hashes,
            row_of: &row_of,
            removals: &removals,
            coef: &coef,
            missing,
            overflow: &overflow,
        };
        // A small call pools on the calling thread under one set of locks.
        let held = (n <= SEQUENTIAL_KEYS).then(|| self.hold(&pool, 0..n));
        let mut base = 0usize;
        for (bags, col) in feats {
            let out = out.with_col(*col);
            match &held {
                Some(held) => self.pool_chunk(bags, base, 0..bags.batch(), &pool, out, held),
                None => self.pool_bags(bags, base, &pool, out),
            }
            base += bags.ids.len();
        }
        drop(held);
        Memos(self).remember(plan, found);
        Pooler::pooled_overflow(&overflow)
    }

    /// The error of a pooled lookup whose pooling overflowed float32.
    pub(crate) fn pooled_overflow(overflow: &AtomicBool) -> Result<()> {
        if overflow.load(Ordering::Relaxed) {
            return Err(invalid(
                "weights",
                "pooling with these weights overflows float32 (a pooled value is inf or NaN); \
                 the output is not returned",
            ));
        }
        Ok(())
    }
}

/// Pools rows that the caller already holds: id `i` of `bags` uses row
/// `idx[i]` of `rows` (`n * dim`). Writes `batch * dim` floats to `out`.
/// The forward of [`Table::lookup_pooled`] for rows fetched from elsewhere
/// (another rank).
///
/// # Errors
/// Bad CSR input, an `idx` entry out of range, wrong lengths.
pub fn pool_rows(
    rows: &[f32],
    dim: usize,
    idx: &[i64],
    bags: &Bags<'_>,
    out: &mut [f32],
) -> Result<()> {
    pool_rows_into(rows, dim, idx, bags, out, dim, 0)
}

/// [`pool_rows`] into columns `col..col + dim` of `out`, whose rows are
/// `stride` floats: several features' pooled rows side by side, each
/// written in place (`batch * stride` floats; other columns untouched).
///
/// # Errors
/// Bad CSR input, an `idx` entry out of range, wrong lengths, columns
/// outside the row.
pub fn pool_rows_into(
    rows: &[f32],
    dim: usize,
    idx: &[i64],
    bags: &Bags<'_>,
    out: &mut [f32],
    stride: usize,
    col: usize,
) -> Result<()> {
    bags.validate()?;
    check_idx("rows", rows.len(), dim, idx, bags)?;
    check_columns(stride, col, dim)?;
    check_len("out", bags.batch() * stride, out.len())?;
    let backend = crate::simd::Backend::from_env()?;
    let Coefs { coef, .. } = bags.coefs()?;
    // The one check every pooled path makes (as `Table::lookup_pooled`):
    // a pooled value that overflowed float32 is refused, naming `weights`.
    let overflow = AtomicBool::new(false);
    out.par_chunks_mut(stride)
        .enumerate()
        .with_min_len(256)
        .for_each(|(b, row)| {
            let dst = &mut row[col..col + dim];
            dst.fill(0.0);
            for i in bags.range(b) {
                let r = idx[i] as usize;
                backend.axpy(dst, coef[i], &rows[r * dim..(r + 1) * dim]);
            }
            if !all_finite(dst) {
                overflow.store(true, Ordering::Relaxed);
            }
        });
    Pooler::pooled_overflow(&overflow)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::batch::bags::Combiner;
    use crate::table::batch::output::SharedOut;
    use crate::table::read::pooling::POOL_CHUNK_IDS;
    use crate::table::storage::read;
    use crate::table::views::Memos;
    use crate::table::{Missing, NO_ROW};
    use crate::testing::{sgd, table};
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    /// Bags of `sizes` ids drawn from `0..keys`: (ids, offsets).
    fn bags_of(sizes: &[usize], keys: i64) -> (Vec<i64>, Vec<i64>) {
        let mut offsets = vec![0i64];
        let mut ids = Vec::new();
        let mut x = 12345i64;
        for &s in sizes {
            for _ in 0..s {
                x = (x * 1_103_515_245 + 12345) % 2_147_483_648;
                ids.push(x % keys);
            }
            offsets.push(ids.len() as i64);
        }
        (ids, offsets)
    }

    #[test]
    fn bags_of_one_id_each_pool_and_step_as_the_plain_calls() {
        let ids = [4i64, 9, 4, 7];
        let offsets = [0i64, 1, 2, 3, 4];
        let grads: Vec<f32> = (0..12).map(|i| 0.1 * i as f32 - 0.5).collect();
        for combiner in [Combiner::Sum, Combiner::Mean, Combiner::Sqrtn] {
            let bags = Bags {
                ids: &ids,
                offsets: &offsets,
                weights: None,
                combiner,
            };
            assert!(bags.one_id_each());
            let (pooled, plain) = (table(3, 2, sgd(0.1)), table(3, 2, sgd(0.1)));
            let (mut a, mut b) = (vec![0.0; 12], vec![0.0; 12]);
            pooled.lookup_pooled(&bags, true, &mut a).unwrap();
            plain.lookup(&ids, true, &mut b).unwrap();
            assert_eq!(a, b);
            pooled.apply_pooled_gradients(&bags, &grads).unwrap();
            plain.apply_gradients(&ids, &grads).unwrap();
            assert_eq!(pooled.export(true).unwrap(), plain.export(true).unwrap());
            assert_eq!(pooled.step(), 1);
        }
        // Weights, an empty bag or a bag of two: the pooled path.
        let w = [2.0f32; 4];
        let weighted = Bags {
            ids: &ids,
            offsets: &offsets,
            weights: Some(&w),
            combiner: Combiner::Sum,
        };
        assert!(!weighted.one_id_each());
        for offsets in [[0i64, 1, 1, 3, 4], [0, 2, 2, 3, 4]] {
            let bags = Bags {
                offsets: &offsets,
                weights: None,
                ..weighted
            };
            assert!(!bags.one_id_each());
        }
        let t = table(3, 2, sgd(0.1));
        let (mut a, mut b) = (vec![0.0; 12], vec![0.0; 12]);
        t.lookup_pooled(&weighted, true, &mut a).unwrap();
        t.lookup(&ids, false, &mut b).unwrap();
        let doubled: Vec<f32> = b.iter().map(|x| 2.0 * x).collect();
        assert_eq!(a, doubled);
    }

    #[test]
    fn a_chunk_probes_again_the_shards_that_removed_rows_since_the_lookup_pass() {
        let t = table(2, 2, sgd(0.1));
        let ids = [1i64, 2, 3, 4, 5, 6];
        let offsets = [0i64, 2, 3, 6];
        let bags = Bags {
            ids: &ids,
            offsets: &offsets,
            weights: None,
            combiner: Combiner::Sum,
        };
        let mut want = vec![0.0; 6];
        t.lookup_pooled(&bags, true, &mut want).unwrap();
        // The rows as a pass found them, then key 2 removed (its shard's
        // last row moves into its place) and key 5's row found stale too.
        let plan = t
            .plan(&ids, crate::table::batch::plan::Floor::Read)
            .unwrap();
        let row_of: Vec<AtomicU32> = ids.iter().map(|_| AtomicU32::new(NO_ROW)).collect();
        let mut removals = vec![0u64; t.shards.len()];
        for (s, lock) in t.shards.iter().enumerate() {
            let g = read(lock);
            let mut rows = Vec::new();
            g.find_many(&ids, &plan.hashes, plan.positions(s), &mut rows);
            for (&i, &r) in plan.positions(s).iter().zip(&rows) {
                row_of[i as usize].store(r, Ordering::Relaxed);
            }
            removals[s] = g.removals;
        }
        t.remove(&[2]).unwrap();
        let coef = vec![1.0f32; ids.len()];
        let overflow = AtomicBool::new(false);
        let pool = Pooling {
            ids: &ids,
            hashes: &plan.hashes,
            row_of: &row_of,
            removals: &removals,
            coef: &coef,
            missing: Missing::Zeros,
            overflow: &overflow,
        };
        let mut got = vec![f32::NAN; 6];
        Pooler(&t).pool_bags(&bags, 0, &pool, SharedOut::new(&mut got, 2));
        // The calling thread's path, under one set of locks: the same.
        let held = Pooler(&t).hold(&pool, 0..ids.len());
        let mut again = vec![f32::NAN; 6];
        Pooler(&t).pool_chunk(&bags, 0, 0..3, &pool, SharedOut::new(&mut again, 2), &held);
        drop(held);
        assert_eq!(again, got);
        // Key 2 now has no row (zeros); every other id reads its own row.
        let mut rows = vec![0.0; 12];
        t.lookup_or(&ids, false, Missing::Zeros, &mut rows).unwrap();
        assert_eq!(&rows[2..4], &[0.0, 0.0]);
        for (b, w) in offsets.windows(2).enumerate() {
            for c in 0..2 {
                let sum: f32 = (w[0] as usize..w[1] as usize)
                    .map(|i| rows[i * 2 + c])
                    .sum();
                assert_eq!(got[b * 2 + c], sum, "bag {b} column {c}");
            }
        }
        assert_ne!(&got[..2], &want[..2], "bag 0 lost key 2's row");
        assert!(!overflow.load(Ordering::Relaxed));
    }

    #[test]
    fn pooling_in_several_chunks_sums_each_bag_of_the_unpooled_rows() {
        // Bags of many sizes (empty ones, one-id ones, one longer than a
        // chunk) over more ids than several chunks hold.
        let dim = 16;
        let chunk = POOL_CHUNK_IDS;
        let sizes: Vec<usize> = (0..4000)
            .map(|b| [0, 1, 2, 5, 7][b % 5])
            .chain([chunk + 9, 0])
            .collect();
        let (ids, offsets) = bags_of(&sizes, 300);
        assert!(ids.len() > 3 * chunk);
        for insert in [true, false] {
            let t = table(dim, 3, sgd(0.1));
            let bags = Bags {
                ids: &ids,
                offsets: &offsets,
                weights: None,
                combiner: Combiner::Mean,
            };
            let mut pooled = vec![f32::NAN; sizes.len() * dim];
            t.lookup_pooled(&bags, insert, &mut pooled).unwrap();
            let distinct = ids.iter().collect::<std::collections::HashSet<_>>().len();
            assert_eq!(t.len(), if insert { distinct } else { 0 });
            let mut rows = vec![0.0; ids.len() * dim];
            t.lookup(&ids, false, &mut rows).unwrap();
            for (b, w) in offsets.windows(2).enumerate() {
                let (s, e) = (w[0] as usize, w[1] as usize);
                let got = &pooled[b * dim..(b + 1) * dim];
                for c in 0..dim {
                    let sum: f64 = (s..e).map(|i| f64::from(rows[i * dim + c])).sum();
                    let want = if e > s { sum / (e - s) as f64 } else { 0.0 };
                    assert!(
                        (f64::from(got[c]) - want).abs() <= 1e-5,
                        "bag {b} column {c}: {} != {want} (insert {insert})",
                        got[c]
                    );
                }
            }
            if insert {
                // The memo of the whole call serves its backward.
                assert!(Memos(&t).take_memo(&ids).is_some());
            }
        }
    }
}
