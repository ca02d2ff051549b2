//! The backward of pooled lookups: id `i` of bag `b` takes `c_i * grad[b]`
//! (see [`crate::table::read::pooled`] for `c_i`), then one optimizer step;
//! and [`spread_pooled`], the same for rows pooled elsewhere.

use crate::Bags;
use crate::error::Result;
use crate::simd::prefetch;
use crate::table::Table;
use crate::table::batch::bags::{Coefs, check_columns, check_idx};
use crate::table::checks::{check_finite, check_finite_max, check_grad_sums, check_len};
use crate::table::views::Stepper;

impl Table {
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
        let Coefs { bag_of, coef } = bags.coefs()?;
        let dim = self.dim;
        let gs = check_pooled_sums(bags.ids, &bag_of, &coef, grads, dim, 0, dim, most)?;
        Stepper(self).step_whole(
            bags.ids,
            gs,
            None,
            |i| {
                let b = bag_of[i] as usize;
                (&grads[b * dim..(b + 1) * dim], coef[i])
            },
            |i| {
                prefetch(&bag_of[i..=i]);
                prefetch(&coef[i..=i]);
            },
        )
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
) -> Result<f64> {
    let max_coef = coef.iter().fold(0.0f32, |a, c| a.max(c.abs()));
    check_grad_sums("grads", ids, f64::from(most) * f64::from(max_coef), |i| {
        let b = bag_of[i] as usize * stride + col;
        let g = grads[b..b + dim].iter().fold(0.0f32, |a, v| a.max(v.abs()));
        f64::from(g) * f64::from(coef[i].abs())
    })
}

/// The backward of [`pool_rows`](crate::table::pool_rows): sums `c_i * grads[bag(i)]` into row
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
    check_idx("out", out.len(), dim, idx, bags)?;
    out.fill(0.0);
    spread_pooled_add(grads, dim, 0, dim, idx, bags, out)
}

/// [`spread_pooled`] from columns `col..col + dim` of `grads` (rows of
/// `stride` floats: several features' gradients side by side), added to
/// `out` (`n * dim`) instead of replacing it: the features of one table
/// sum into one array, with no copy of their columns. Checked first (lengths,
/// finite values), then added.
///
/// # Errors
/// Bad CSR input, an `idx` entry out of range, wrong lengths, columns
/// outside the row, non-finite values.
pub fn spread_pooled_add(
    grads: &[f32],
    stride: usize,
    col: usize,
    dim: usize,
    idx: &[i64],
    bags: &Bags<'_>,
    out: &mut [f32],
) -> Result<()> {
    bags.validate()?;
    check_columns(stride, col, dim)?;
    check_len("grads", bags.batch() * stride, grads.len())?;
    check_idx("out", out.len(), dim, idx, bags)?;
    // One pass over the columns read (a check_finite call per row costs
    // more than the row).
    if let Some(r) = grads
        .chunks_exact(stride)
        .position(|row| !row[col..col + dim].iter().all(|v| v.is_finite()))
    {
        check_finite("grads", &grads[r * stride + col..r * stride + col + dim])?;
    }
    let backend = crate::simd::Backend::from_env()?;
    let Coefs { bag_of, coef } = bags.coefs()?;
    for (i, &r) in idx.iter().enumerate() {
        let b = bag_of[i] as usize * stride + col;
        let r = r as usize;
        backend.axpy(
            &mut out[r * dim..(r + 1) * dim],
            coef[i],
            &grads[b..b + dim],
        );
    }
    Ok(())
}
