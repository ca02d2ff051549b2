//! What optimizer state steps can produce: the magnitudes of a fresh row's
//! state, the prediction of how far one step can move them (the bounds that
//! keep every step finite, `table::step::bounds`), and the check of state
//! that comes in from outside (assign with state, checkpoints).

use crate::error::{Result, invalid};
use crate::optim::Optimizer;
use crate::rows::Scan;
use crate::table::step::bounds::COMFORT;
use rayon::prelude::*;

impl Optimizer {
    /// The magnitudes of a fresh row's state: per block, and the
    /// accumulator's starting value.
    pub(crate) fn initial_magnitudes(&self) -> ([f64; 2], f64) {
        let acc = |v: f64| f64::from(v as f32);
        match *self {
            Optimizer::Adagrad {
                initial_accumulator_value: v,
                ..
            } => ([acc(v), 0.0], acc(v)),
            Optimizer::Ftrl {
                initial_accumulator_value: v,
                ..
            } => ([0.0, acc(v)], acc(v)),
            Optimizer::RowWiseAdagrad { .. } => ([0.0; 2], 0.0),
            _ => ([0.0; 2], f64::INFINITY),
        }
    }

    /// Bounds on every value one step numbered `t` computes (intermediates
    /// included) for a table whose values are within `m` and whose summed
    /// gradients are at most `gs` in magnitude: the table's magnitudes
    /// after the step, or `None` when some bound passes
    /// [`COMFORT`] or a divisor may be zero (the step must
    /// then be checked row by row). In f64, with a margin for float32
    /// rounding.
    #[inline]
    pub(crate) fn predict(
        &self,
        m: &crate::table::Magnitudes,
        gs: f64,
        t: u64,
        dim: usize,
    ) -> Option<crate::table::Magnitudes> {
        // A few float32 roundings per value (each at most 2^-24 relative).
        // Small, because the state bounds compound it every step: at 4e-7
        // they outgrow the truth by 1e20 only after about 1e8 steps (then a
        // step measures every row anew, see `table::step::bounds`).
        const ROUND: f64 = 1.0 + 4e-7;
        let limit = COMFORT;
        let wd = self.coupled_decay();
        // The gradient after coupled decay.
        let gd = (gs + wd * m.w) * ROUND;
        // |g| / (sqrt(h + g^2) + eps) <= 1 (h >= 0), up to rounding, unless
        // g^2 underflows to 0 (|g| < 4e-23): then at most 4e-23 / divisor.
        let ratio = |divisor: f64, rows: f64| -> Option<f64> {
            (divisor > 0.0).then(|| (gd / divisor).min((1.01 * rows).max(4e-23 / divisor)))
        };
        let mut out = *m;
        let _ = t; // every bound below holds at any step t >= 1
        match *self {
            Optimizer::Sgd { lr, .. } => {
                let decay = (1.0 - lr * wd).abs().max(1.0);
                out.w = (m.w * decay + lr * gd) * ROUND;
                if lr * gd > limit {
                    return None;
                }
            }
            Optimizer::Adagrad { lr, eps, .. } => {
                out.s[0] = (m.s[0] + gd * gd) * ROUND;
                let r = ratio(f64::from(eps as f32) + m.acc_min.sqrt(), 1.0)?;
                out.w = (m.w + lr * r) * ROUND;
            }
            Optimizer::RowWiseAdagrad { lr, eps, .. } => {
                // mean(g^2) is a sum of `dim` rounded terms: dim * 2^-24 relative.
                let sum_err = 1.0 + dim as f64 * 1.2e-7;
                out.s[0] = (m.s[0] + gd * gd * sum_err) * ROUND;
                let rows = (dim as f64).sqrt() * 1.1 * sum_err;
                let r = ratio(f64::from(eps as f32) + m.acc_min.sqrt(), rows)?;
                out.w = (m.w + lr * r) * ROUND;
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                ..
            }
            | Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                ..
            } => {
                let eps = f64::from(eps as f32);
                if eps <= 0.0 {
                    return None;
                }
                let mm = (beta1 * m.s[0] + (1.0 - beta1) * gd) * ROUND;
                out.s[0] = m.s[0].max(mm);
                out.s[1] = m.s[1].max((beta2 * m.s[1] + (1.0 - beta2) * gd * gd) * ROUND);
                // Adam: lr sqrt(bc2) / bc1 * m / (sqrt(v) + eps); AdamW:
                // lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps); both divisors
                // >= eps, and bc2 = 1 - beta2^t <= 1, bc1 = 1 - beta1^t >=
                // 1 - beta1 for every t >= 1: a bound of the step size that
                // holds at every step (no powers of the betas per call).
                let step = lr / (1.0 - beta1);
                // The kernels' step-size constant is a float32 too: past the
                // limit it may be inf, and inf * 0 a NaN row.
                if mm / eps > limit || step > limit {
                    return None;
                }
                out.w = (m.w + step * mm / eps) * ROUND;
            }
            Optimizer::Ftrl { lr, l2, beta, .. } => {
                let n_new = (m.s[1] + gd * gd) * ROUND;
                out.s[1] = n_new;
                // (sqrt(n') - sqrt(n)) / lr and sqrt(n') / lr.
                let sigma = n_new.sqrt() / lr * ROUND;
                let z = (m.s[0] + gd + sigma * m.w) * ROUND;
                out.s[0] = m.s[0].max(z);
                let divisor = (beta + m.acc_min.sqrt()) / lr + 2.0 * l2;
                if divisor <= 0.0 || sigma > limit {
                    return None;
                }
                // FTRL's weights are computed afresh from z and n.
                out.w = m.w.max(z / divisor * ROUND);
            }
        }
        let all = [gd, out.w, out.s[0], out.s[1]];
        all.iter()
            .all(|v| v.is_finite() && *v <= limit)
            .then_some(out)
    }

    /// The state blocks (offset within a row's state, length) that never
    /// go negative: the squared-gradient accumulators (Adagrad's `h`, Adam's
    /// `v`, FTRL's `n`). Every update adds a square to them (or a decayed
    /// sum of squares), so no step can make one negative; one that is makes
    /// the next step's square root NaN.
    fn nonnegative_state(&self, dim: usize) -> Option<(usize, usize)> {
        match self {
            Optimizer::Sgd { .. } => None,
            Optimizer::RowWiseAdagrad { .. } => Some((0, 1)),
            Optimizer::Adagrad { .. } => Some((0, dim)),
            Optimizer::Adam { .. } | Optimizer::AdamW { .. } | Optimizer::Ftrl { .. } => {
                Some((dim, dim))
            }
        }
    }

    /// Checks rows of optimizer state (`state_len(dim)` floats each, finite
    /// already) against what this optimizer can produce: its accumulators
    /// are never negative.
    ///
    /// # Errors
    /// `InvalidArgument` naming `arg`, the row and the block.
    pub fn check_state(&self, arg: &'static str, dim: usize, state: &[f32]) -> Result<()> {
        self.check_state_on(arg, dim, state, Scan::Parallel)
    }

    /// [`Optimizer::check_state`], its scan run as `scan` says.
    ///
    /// # Errors
    /// As [`Optimizer::check_state`].
    pub fn check_state_on(
        &self,
        arg: &'static str,
        dim: usize,
        state: &[f32],
        scan: Scan,
    ) -> Result<()> {
        let sl = self.state_len(dim);
        let Some((off, len)) = self.nonnegative_state(dim) else {
            return Ok(());
        };
        if sl == 0 {
            return Ok(());
        }
        // Blocks of rows on every core; the first bad row of the first bad block.
        const ROWS: usize = 4096;
        let negative = |row: &[f32]| row[off..off + len].iter().any(|&x| x < 0.0);
        let bad_block = |block: &[f32]| block.chunks_exact(sl).any(negative);
        let bad = match scan {
            Scan::Parallel => state.par_chunks(sl * ROWS).position_first(bad_block),
            Scan::Here => state.chunks(sl * ROWS).position(bad_block),
        }
        .map(|b| {
            let block = &state[b * sl * ROWS..];
            b * ROWS
                + block
                    .chunks_exact(sl)
                    .position(negative)
                    .expect("the block holds a negative state")
        });
        match bad {
            None => Ok(()),
            Some(r) => {
                let names = self.state_names();
                let block = names[if off == 0 { 0 } else { names.len() - 1 }];
                Err(invalid(
                    arg,
                    format!(
                        "row {r}: {} state {block:?} is negative, which no step can produce \
                         (it accumulates squares); nothing changed",
                        self.name()
                    ),
                ))
            }
        }
    }
}
