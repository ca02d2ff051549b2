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

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use super::lookup::Pass;
use super::{
    Missing, NO_ROW, PREFETCH_AHEAD, SEQUENTIAL_KEYS, SharedOut, Table, check_finite,
    check_finite_max, check_len,
};

use crate::error::{Result, invalid};
use crate::simd::{copy_streaming, prefetch, stream_fence};

/// Rows of the ids of multi-id bags that one span of a pooled lookup
/// gathers before summing them ([`Table::lookup_pooled_in`]): small enough
/// to stay in the L2 or L3 cache, large enough that the span's two pool
/// dispatches cost little against its work.
pub(crate) const POOL_SPAN_BYTES: usize = 4 << 20;

/// How a bag's rows are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Combiner {
    /// `sum_i w_i x_i`.
    Sum,
    /// `sum_i w_i x_i / sum_i w_i` (the plain mean without weights).
    Mean,
    /// `sum_i w_i x_i / sqrt(sum_i w_i^2)`.
    Sqrtn,
}

impl Combiner {
    /// The combiner named `name` ("sum", "mean", "sqrtn").
    ///
    /// # Errors
    /// `InvalidArgument` for any other name.
    pub fn from_name(name: &str) -> Result<Combiner> {
        match name {
            "sum" => Ok(Combiner::Sum),
            "mean" => Ok(Combiner::Mean),
            "sqrtn" => Ok(Combiner::Sqrtn),
            other => Err(invalid(
                "combiner",
                format!(
                    "expected one of {}; got {other:?}",
                    crate::vocab::one_of(crate::vocab::COMBINERS)
                ),
            )),
        }
    }
}

/// A batch of bags in CSR form: bag `b` holds `ids[offsets[b]..offsets[b + 1]]`.
#[derive(Debug, Clone, Copy)]
pub struct Bags<'a> {
    /// Ids of every bag, back to back (`nnz`).
    pub ids: &'a [i64],
    /// `batch + 1` offsets: start at 0, never decrease, end at `nnz`.
    pub offsets: &'a [i64],
    /// Optional per-id weights (`nnz`).
    pub weights: Option<&'a [f32]>,
    /// How each bag's rows are combined.
    pub combiner: Combiner,
}

/// Per-id bag and coefficient of a batch of bags.
pub(crate) struct Coefs {
    pub bag_of: Vec<u32>,
    pub coef: Vec<f32>,
}

impl Bags<'_> {
    /// Number of bags.
    pub fn batch(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    #[inline]
    fn range(&self, b: usize) -> std::ops::Range<usize> {
        self.offsets[b] as usize..self.offsets[b + 1] as usize
    }

    /// Checks the CSR structure and the weights.
    ///
    /// # Errors
    /// `InvalidArgument`/`ShapeMismatch`/`NonFinite` naming `offsets` or `weights`.
    pub fn validate(&self) -> Result<()> {
        let nnz = self.ids.len();
        if nnz > u32::MAX as usize {
            return Err(invalid(
                "ids",
                format!("expected at most 2^32 - 1 ids, got {nnz}"),
            ));
        }
        super::check_transient("ids", nnz)?;
        let Some(&first) = self.offsets.first() else {
            return Err(invalid(
                "offsets",
                "expected batch + 1 >= 1 offsets (include_last_offset=True), got an empty array",
            ));
        };
        if first != 0 {
            return Err(invalid(
                "offsets",
                format!("expected offsets[0] == 0, got {first}"),
            ));
        }
        if let Some(b) = self.offsets.windows(2).position(|w| w[1] < w[0]) {
            return Err(invalid(
                "offsets",
                format!(
                    "expected non-decreasing offsets, got offsets[{}] = {} > offsets[{}] = {}",
                    b,
                    self.offsets[b],
                    b + 1,
                    self.offsets[b + 1]
                ),
            ));
        }
        let last = self.offsets[self.offsets.len() - 1];
        if last != nnz as i64 {
            return Err(invalid(
                "offsets",
                format!("expected the last offset to equal len(ids) = {nnz}, got {last}"),
            ));
        }
        if let Some(w) = self.weights {
            check_len("weights", nnz, w.len())?;
            check_finite("weights", w)?;
        }
        Ok(())
    }

    /// Whether every bag holds exactly one id and there are no weights:
    /// then every coefficient is 1 (whatever the combiner) and bag `b` is
    /// id `b`. On validated bags.
    pub(crate) fn one_id_each(&self) -> bool {
        self.weights.is_none()
            && self.ids.len() == self.batch()
            && self.offsets.iter().enumerate().all(|(b, &o)| o == b as i64)
    }

    /// Each id's bag and coefficient `w_i / d_bag`.
    pub(crate) fn coefs(&self) -> Coefs {
        let nnz = self.ids.len();
        let mut bag_of = vec![0u32; nnz];
        let mut coef = vec![0.0f32; nnz];
        self.coefs_into(&mut bag_of, &mut coef);
        Coefs { bag_of, coef }
    }

    /// Each id's bag and coefficient `w_i / d_bag`, as the pooled kernels
    /// use them (for a tier that pools on another device).
    ///
    /// # Errors
    /// `OutOfMemory` naming `ids` when the two arrays cannot fit in the
    /// memory available (checked before they are allocated).
    pub fn coefficients(&self) -> Result<(Vec<u32>, Vec<f32>)> {
        super::check_transient("ids", self.ids.len())?;
        let c = self.coefs();
        Ok((c.bag_of, c.coef))
    }

    /// [`Bags::coefs`] into caller-provided slices of `nnz` entries each.
    pub(crate) fn coefs_into(&self, bag_of: &mut [u32], coef: &mut [f32]) {
        let weight = |i: usize| self.weights.map_or(1.0, |w| w[i]);
        for b in 0..self.batch() {
            let r = self.range(b);
            bag_of[r.clone()].fill(b as u32);
            let denom = match self.combiner {
                Combiner::Sum => 1.0,
                Combiner::Mean => r.clone().map(weight).sum::<f32>(),
                Combiner::Sqrtn => r.clone().map(|i| weight(i) * weight(i)).sum::<f32>().sqrt(),
            };
            for i in r {
                coef[i] = if denom == 0.0 { 0.0 } else { weight(i) / denom };
            }
        }
    }
}

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
        let _gate = self.lookup_changes(insert).then(|| self.enter());
        self.lookup_pooled_in(
            &[(*bags, 0)],
            insert,
            missing,
            SharedOut::new(out, self.dim),
        )?;
        if insert {
            self.enforce_capacity();
        }
        Ok(())
    }

    /// [`Table::lookup_pooled`] on checked input, with the gate held when
    /// `insert`, for one or more features served by this table: feature
    /// `(bags, col)` writes bag `b` to row `b` of `out` from column `col`.
    /// All the features' ids go through one plan, one reservation and one
    /// memo.
    ///
    /// An id alone in its bag is copied (scaled) straight to its output
    /// row by the shard pass. The ids of larger bags are pooled in spans of
    /// whole bags of about [`POOL_SPAN_BYTES`] of rows: a shard pass over
    /// the span's ids copies their rows into one small buffer, reused by
    /// every span and so kept in cache, and then the span's bags are summed
    /// from it in parallel (no lock held). The rows never pass through a
    /// buffer of the whole input's size.
    pub(crate) fn lookup_pooled_in(
        &self,
        feats: &[(Bags<'_>, usize)],
        insert: bool,
        missing: Missing<'_>,
        out: SharedOut,
    ) -> Result<()> {
        let dim = self.dim;
        let n: usize = feats.iter().map(|(b, _)| b.ids.len()).sum();
        let span_ids = (POOL_SPAN_BYTES / (4 * dim)).max(1);
        // Per id: where its row goes (the flat offset of its bag's output
        // columns, for an id alone in its bag) or its slot in its span's
        // buffer, and its coefficient.
        let mut dst = vec![usize::MAX; n];
        let mut slot = vec![NO_ROW; n];
        let mut coef = vec![0.0f32; n];
        // Spans of the concatenated ids, cut at bag starts: (first id,
        // end), each with at most `span_ids` ids of multi-id bags unless one
        // bag alone has more.
        let mut spans: Vec<Range<usize>> = Vec::new();
        let (mut start, mut held, mut most) = (0usize, 0usize, 0usize);
        let mut base = 0usize;
        let mut bag_of = Vec::new();
        for (bags, col) in feats {
            let m = bags.ids.len();
            bag_of.resize(m, 0);
            bags.coefs_into(&mut bag_of, &mut coef[base..base + m]);
            for b in 0..bags.batch() {
                let r = bags.range(b);
                if r.len() == 1 {
                    dst[base + r.start] = out.offset(b, *col);
                    continue;
                }
                if held > 0 && held + r.len() > span_ids {
                    spans.push(start..base + r.start);
                    most = most.max(held);
                    (start, held) = (base + r.start, 0);
                }
                for i in r {
                    slot[base + i] = held as u32;
                    held += 1;
                }
            }
            base += m;
        }
        spans.push(start..n);
        most = most.max(held);
        let ids: std::borrow::Cow<'_, [i64]> = match feats {
            [(bags, _)] => bags.ids.into(),
            _ => feats
                .iter()
                .flat_map(|(b, _)| b.ids.iter().copied())
                .collect(),
        };
        let ids = &ids[..];
        // The span buffer: refused before any change when even that cannot
        // be allocated. Allocated zeroed (no pass writes the zeros; every
        // slot is written by its span's shard pass before it is read).
        let mut gbuf = most
            .checked_mul(dim)
            .and_then(crate::zeroed::try_zeroed::<f32>)
            .ok_or_else(|| crate::error::oom("ids", most.saturating_mul(dim * 4)))?;
        let plan = self.plan(ids);
        let reserved = self.reserve_lookup(ids, &plan, insert)?;
        let found = self.found();
        let pass = Pass {
            keys: ids,
            plan: &plan,
            insert,
            reserved: &reserved,
            release: spans.len() == 1,
            found: Some(&found),
        };
        // Set where pooling overflowed float32 (checked per pooled row, in
        // cache; a copied row of a one-id bag is finite already).
        let overflow = AtomicBool::new(false);
        let stream = out.streams();
        let ahead = super::prefetches(n, SEQUENTIAL_KEYS);
        for span in &spans {
            let gout = SharedOut::new(&mut gbuf, dim);
            let emit = |i: usize, x: &[f32]| {
                if slot[i] == NO_ROW {
                    // SAFETY: dst[i] is the output row of a bag holding this
                    // id only, and position i belongs to one shard of the
                    // plan: one writer for this output row.
                    let d = unsafe { out.at(dst[i], dim) };
                    if coef[i] == 1.0 && stream {
                        copy_streaming(d, x);
                    } else {
                        d.copy_from_slice(x);
                        if coef[i] != 1.0 {
                            self.backend.scale(d, coef[i]);
                            // Checked while the row is in cache: a weight can
                            // scale a finite row past float32.
                            if !all_finite(d) {
                                overflow.store(true, Ordering::Relaxed);
                            }
                        }
                    }
                } else {
                    // SAFETY: slot[i] is position i's own row of the span
                    // buffer (slots are distinct within a span).
                    unsafe { gout.row(slot[i] as usize, dim) }.copy_from_slice(x);
                }
            };
            // Emits the ids of one shard whose rows are `rows` (`NO_ROW`: none).
            self.lookup_span(
                &pass,
                Some(span.start as u32..span.end as u32),
                |g, pos, rows| {
                    let mut tmp = vec![0.0f32; dim];
                    for (j, (&i, &r)) in pos.iter().zip(rows).enumerate() {
                        if ahead
                            && let Some(&ahead) = rows.get(j + PREFETCH_AHEAD)
                            && ahead != NO_ROW
                        {
                            prefetch(&g.arena.row(ahead as usize)[..self.wwords]);
                        }
                        let i = i as usize;
                        if r == NO_ROW {
                            self.fill_missing(ids[i], &mut tmp, missing);
                            emit(i, &tmp);
                        } else {
                            emit(i, self.weights(g.arena.row(r as usize), &mut tmp));
                        }
                    }
                    if stream {
                        stream_fence();
                    }
                },
            );
            self.pool_span(feats, span, &slot, &coef, &gbuf, out, &overflow);
        }
        if !pass.release {
            self.release_plan(&reserved);
        }
        self.remember(plan, found);
        if overflow.load(Ordering::Relaxed) {
            return Err(invalid(
                "weights",
                "pooling with these weights overflows float32 (a pooled value is inf or NaN); \
                 the output is not returned",
            ));
        }
        Ok(())
    }

    /// Sums the bags of several ids that start in `span` (of the
    /// concatenated ids of `feats`; the last span also takes the empty bags
    /// at the very end) from the span buffer `gbuf` into their output rows,
    /// in parallel over bags; an empty bag pools to zeros.
    #[allow(clippy::too_many_arguments)]
    fn pool_span(
        &self,
        feats: &[(Bags<'_>, usize)],
        span: &Range<usize>,
        slot: &[u32],
        coef: &[f32],
        gbuf: &[f32],
        out: SharedOut,
        overflow: &AtomicBool,
    ) {
        let (dim, backend) = (self.dim, self.backend);
        let n = slot.len();
        let mut base = 0usize;
        for (bags, col) in feats {
            let out = out.with_col(*col);
            let m = bags.ids.len();
            let (slot, coef) = (&slot[base..base + m], &coef[base..base + m]);
            // The feature's bags that start in the span, by their offsets.
            let first = |at: usize| {
                bags.offsets[..bags.batch()].partition_point(|&o| base + (o as usize) < at)
            };
            let lo = first(span.start);
            let hi = if span.end == n {
                bags.batch()
            } else {
                first(span.end)
            };
            let per_bag = (m / bags.batch().max(1)).max(1);
            // A small call sums its bags on the calling thread (a split would
            // dispatch to the pool, which costs more than the work).
            let min_len = if n <= SEQUENTIAL_KEYS {
                usize::MAX
            } else {
                (4096 / per_bag).max(1)
            };
            (lo..hi)
                .into_par_iter()
                .with_min_len(min_len)
                .for_each(|b| {
                    let r = bags.range(b);
                    if r.len() == 1 {
                        return;
                    }
                    // SAFETY: each bag's output row is written by this task only.
                    let d = unsafe { out.row(b, dim) };
                    d.fill(0.0);
                    for i in r {
                        let s = slot[i] as usize;
                        backend.axpy(d, coef[i], &gbuf[s * dim..(s + 1) * dim]);
                    }
                    if !all_finite(d) {
                        overflow.store(true, Ordering::Relaxed);
                    }
                });
            base += m;
        }
    }

    /// The backward of [`Table::lookup_pooled`] followed by one optimizer
    /// step: id `i` of bag `b` contributes `c_i * grads[b]` (`grads` is
    /// `batch * dim`).
    ///
    /// # Errors
    /// `NoOptimizer`, bad CSR input, wrong `grads` length, non-finite
    /// values; nothing changed.
    pub fn apply_pooled_gradients(&self, bags: &Bags<'_>, grads: &[f32]) -> Result<()> {
        if self.optimizer.is_none() {
            return Err(crate::StoreError::NoOptimizer);
        }
        bags.validate()?;
        if bags.one_id_each() {
            // Each id takes its bag's gradient as it is: the plain step.
            return self.apply_gradients(bags.ids, grads);
        }
        check_len("grads", bags.batch() * self.dim, grads.len())?;
        let most = check_finite_max("grads", grads)?;
        let Coefs { bag_of, coef } = bags.coefs();
        let dim = self.dim;
        check_pooled_sums(bags.ids, &bag_of, &coef, grads, dim, 0, dim, most)?;
        let _gate = self.enter();
        self.apply_in(bags.ids, |i| {
            let b = bag_of[i] as usize;
            (&grads[b * dim..(b + 1) * dim], coef[i])
        })?;
        self.enforce_capacity();
        Ok(())
    }
}

/// Refuses a pooled backward whose summed gradient of some id would exceed
/// [`super::MAX_GRAD_SUM`]: id `i` contributes `coef[i] * grads[bag_of[i]]`
/// (row `bag_of[i]` of `grads`, `stride` wide, columns `col..col + dim`);
/// `most` is the largest magnitude in `grads`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_pooled_sums(
    ids: &[i64],
    bag_of: &[u32],
    coef: &[f32],
    grads: &[f32],
    stride: usize,
    col: usize,
    dim: usize,
    most: f32,
) -> Result<()> {
    let max_coef = coef.iter().fold(0.0f32, |a, c| a.max(c.abs()));
    super::check_grad_sums("grads", ids, f64::from(most) * f64::from(max_coef), |i| {
        let b = bag_of[i] as usize * stride + col;
        let g = grads[b..b + dim].iter().fold(0.0f32, |a, v| a.max(v.abs()));
        f64::from(g) * f64::from(coef[i].abs())
    })
}

/// Whether every value of `v` is finite (a branch-free scan that vectorizes).
#[inline]
fn all_finite(v: &[f32]) -> bool {
    v.iter()
        .fold(0u32, |acc, x| acc.max(x.to_bits() & 0x7FFF_FFFF))
        < 0x7F80_0000
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
    bags.validate()?;
    check_idx("rows", rows.len(), dim, idx, bags)?;
    check_len("out", bags.batch() * dim, out.len())?;
    let backend = crate::simd::Backend::from_env()?;
    let Coefs { coef, .. } = bags.coefs();
    out.par_chunks_mut(dim.max(1))
        .enumerate()
        .with_min_len(256)
        .for_each(|(b, dst)| {
            dst.fill(0.0);
            for i in bags.range(b) {
                let r = idx[i] as usize;
                backend.axpy(dst, coef[i], &rows[r * dim..(r + 1) * dim]);
            }
        });
    Ok(())
}

/// The backward of [`pool_rows`]: sums `c_i * grads[bag(i)]` into row
/// `idx[i]` of `out` (`n * dim`, zeroed first).
///
/// # Errors
/// Bad CSR input, an `idx` entry out of range, wrong lengths, non-finite values.
pub fn spread_pooled(
    grads: &[f32],
    dim: usize,
    idx: &[i64],
    bags: &Bags<'_>,
    out: &mut [f32],
) -> Result<()> {
    bags.validate()?;
    check_len("grads", bags.batch() * dim, grads.len())?;
    check_finite("grads", grads)?;
    check_idx("out", out.len(), dim, idx, bags)?;
    let backend = crate::simd::Backend::from_env()?;
    let Coefs { bag_of, coef } = bags.coefs();
    out.fill(0.0);
    for (i, &r) in idx.iter().enumerate() {
        let b = bag_of[i] as usize;
        let r = r as usize;
        backend.axpy(
            &mut out[r * dim..(r + 1) * dim],
            coef[i],
            &grads[b * dim..(b + 1) * dim],
        );
    }
    Ok(())
}

/// Checks that `arg` (of `len` floats) holds whole rows of `dim` and that
/// `idx` has one entry per id, each naming one of those rows.
fn check_idx(
    arg: &'static str,
    len: usize,
    dim: usize,
    idx: &[i64],
    bags: &Bags<'_>,
) -> Result<()> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(invalid(arg, "expected a whole number of rows"));
    }
    let n = len / dim;
    check_len("idx", bags.ids.len(), idx.len())?;
    if let Some(&bad) = idx.iter().find(|&&r| r < 0 || r as usize >= n) {
        return Err(invalid(
            "idx",
            format!("expected 0 <= idx < {n}, got {bad}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{sgd, table};
    use super::*;

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
    fn pooling_in_several_spans_sums_each_bag_of_the_unpooled_rows() {
        // dim 1024: a span holds 1,024 gathered rows, so these bags (one
        // longer than a span, empty ones, one-id ones) need several.
        let dim = 1024;
        let span = POOL_SPAN_BYTES / (4 * dim);
        let sizes: Vec<usize> = (0..900)
            .map(|b| [0, 1, 2, 5, 7][b % 5])
            .chain([span + 9, 0])
            .collect();
        let (ids, offsets) = bags_of(&sizes, 300);
        assert!(ids.len() > 3 * span);
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
                assert!(t.take_memo(&ids).is_some());
            }
        }
    }
}
