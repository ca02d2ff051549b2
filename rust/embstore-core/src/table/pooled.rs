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

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use super::{
    Missing, NO_ROW, PREFETCH_AHEAD, SharedOut, Table, check_finite, check_finite_max, check_len,
};
use crate::error::{Result, invalid};
use crate::simd::{copy_streaming, prefetch, stream_fence};

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
    /// All the features' ids go through one plan and one pass over the
    /// shards.
    pub(crate) fn lookup_pooled_in(
        &self,
        feats: &[(Bags<'_>, usize)],
        insert: bool,
        missing: Missing<'_>,
        out: SharedOut,
    ) -> Result<()> {
        let dim = self.dim;
        let backend = self.backend;
        let n: usize = feats.iter().map(|(b, _)| b.ids.len()).sum();
        // Per id: where its row goes (the flat offset of its bag's output
        // columns, for an id alone in its bag) or its gather slot (ids of
        // larger bags are gathered first and pooled per bag afterwards), and
        // its coefficient.
        let mut dst = vec![usize::MAX; n];
        let mut slot = vec![NO_ROW; n];
        let mut coef = vec![0.0f32; n];
        let mut gathered = 0usize;
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
                } else {
                    for i in r {
                        slot[base + i] = gathered as u32;
                        gathered += 1;
                    }
                }
            }
            base += m;
        }
        let ids: std::borrow::Cow<'_, [i64]> = match feats {
            [(bags, _)] => bags.ids.into(),
            _ => feats
                .iter()
                .flat_map(|(b, _)| b.ids.iter().copied())
                .collect(),
        };
        let ids = &ids[..];
        // Rows of the ids of bags of several ids: as large as the input
        // times dim, so its allocation may fail (refused before any change).
        // Set where pooling overflowed float32 (checked per pooled row, in
        // cache; a copied row of a one-id bag is finite already).
        let overflow = AtomicBool::new(false);
        // Allocated zeroed (no pass writes the zeros; every gathered row
        // is written once below before it is read).
        let mut gbuf = gathered
            .checked_mul(dim)
            .and_then(crate::zeroed::try_zeroed::<f32>)
            .ok_or_else(|| crate::error::oom("ids", gathered.saturating_mul(dim * 4)))?;
        let gout = SharedOut::new(&mut gbuf, dim);
        let stream = out.streams();
        let emit = |i: usize, x: &[f32]| {
            if slot[i] == NO_ROW {
                // SAFETY: dst[i] is the output row of a bag holding this id
                // only, and position i belongs to one shard of the plan: one
                // writer for this output row.
                let d = unsafe { out.at(dst[i], dim) };
                if coef[i] == 1.0 && stream {
                    copy_streaming(d, x);
                } else {
                    d.copy_from_slice(x);
                    if coef[i] != 1.0 {
                        backend.scale(d, coef[i]);
                        // Checked while the row is in cache: a weight can
                        // scale a finite row past float32.
                        if !all_finite(d) {
                            overflow.store(true, Ordering::Relaxed);
                        }
                    }
                }
            } else {
                // SAFETY: slot[i] is position i's own gather row.
                unsafe { gout.row(slot[i] as usize, dim) }.copy_from_slice(x);
            }
        };
        let plan = self.plan(ids);
        let found = self.found();
        // Emits the ids of one shard whose rows are `rows` (`NO_ROW`: none).
        self.lookup_rows(ids, &plan, insert, Some(&found), |g, pos, rows| {
            let mut tmp = vec![0.0f32; dim];
            for (j, (&i, &r)) in pos.iter().zip(rows).enumerate() {
                if let Some(&ahead) = rows.get(j + PREFETCH_AHEAD)
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
        })?;
        self.remember(plan, found);
        let gbuf = &gbuf;
        let mut base = 0usize;
        for (bags, col) in feats {
            let out = out.with_col(*col);
            let (slot, coef) = (&slot[base..], &coef[base..]);
            (0..bags.batch())
                .into_par_iter()
                .with_min_len(1024)
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
            base += bags.ids.len();
        }
        if overflow.load(Ordering::Relaxed) {
            return Err(invalid(
                "weights",
                "pooling with these weights overflows float32 (a pooled value is inf or NaN); \
                 the output is not returned",
            ));
        }
        Ok(())
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
