//! Sparse optimizers: their configuration, state layout and per-row update.
//!
//! Every optimizer is "exact" about duplicate keys: a batch's gradients for
//! one key are summed first and the row takes one update, as
//! torch.optim.SparseAdam (which coalesces) and FBGEMM's exact optimizers do.
//! Rows that a batch does not touch do not change ("lazy" updates). The step
//! counter `t` is the table's, incremented once per `apply_gradients` call.
//!
//! `weight_decay` of SGD, Adagrad, RowWiseAdagrad, Adam and Ftrl is coupled
//! L2, as torch's `weight_decay`: the summed gradient of a touched row
//! becomes `g + weight_decay * w` before the update (untouched rows do not
//! decay). AdamW's `weight_decay` is decoupled, as torch.optim.AdamW's.

use std::collections::BTreeMap;

use crate::error::{Result, invalid};
use crate::simd::{AdamParams, AdamWParams, Backend, FtrlParams};
use crate::vocab;

/// An optimizer and its hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Optimizer {
    /// `w -= lr * g`. No state.
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Coupled L2: `g += weight_decay * w` first.
        weight_decay: f64,
    },
    /// torch.optim.Adagrad. State `h[dim]`.
    Adagrad {
        /// Learning rate.
        lr: f64,
        /// Starting value of `h`.
        initial_accumulator_value: f64,
        /// Added to `sqrt(h)`.
        eps: f64,
        /// Coupled L2: `g += weight_decay * w` first.
        weight_decay: f64,
    },
    /// FBGEMM's row-wise Adagrad. State: one float `h` per row.
    RowWiseAdagrad {
        /// Learning rate.
        lr: f64,
        /// Added to `sqrt(h)`.
        eps: f64,
        /// Coupled L2: `g += weight_decay * w` first.
        weight_decay: f64,
    },
    /// torch.optim.SparseAdam. State `m[dim], v[dim]`.
    Adam {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Added to `sqrt(v)`.
        eps: f64,
        /// Coupled L2: `g += weight_decay * w` first.
        weight_decay: f64,
    },
    /// torch.optim.AdamW applied to touched rows only. State `m[dim], v[dim]`.
    AdamW {
        /// Learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Added to the bias-corrected `sqrt(v)`.
        eps: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
    },
    /// FTRL-Proximal as tf.keras.optimizers.Ftrl with learning_rate_power=-0.5.
    /// State `z[dim]` (linear), `n[dim]` (accumulator).
    Ftrl {
        /// Learning rate.
        lr: f64,
        /// L1 regularization strength.
        l1: f64,
        /// L2 regularization strength.
        l2: f64,
        /// Beta as in keras' Ftrl.
        beta: f64,
        /// Starting value of `n`.
        initial_accumulator_value: f64,
        /// Coupled L2: `g += weight_decay * w` first.
        weight_decay: f64,
    },
}

/// Constants of one optimizer step, computed once per call from `t`.
#[derive(Debug, Clone, Copy)]
pub enum StepConsts {
    /// SGD.
    Sgd(f32),
    /// Adagrad (lr, eps).
    Adagrad(f32, f32),
    /// Row-wise Adagrad (lr, eps).
    RowWiseAdagrad(f32, f32),
    /// Adam.
    Adam(AdamParams),
    /// AdamW.
    AdamW(AdamWParams),
    /// FTRL.
    Ftrl(FtrlParams),
}

fn check(arg: &'static str, v: f64, ok: bool, expected: &str) -> Result<()> {
    // The kernels compute in float32: a parameter beyond its range would be inf there.
    if v.is_finite() && v.abs() <= f64::from(f32::MAX) && ok {
        Ok(())
    } else {
        Err(invalid(
            arg,
            format!("expected {expected} (finite as float32), got {v}"),
        ))
    }
}

impl Optimizer {
    /// The optimizer named `name` (as `embstore.optim` spells its class) with
    /// parameters `p` (defaults for the ones left out), validated.
    ///
    /// # Errors
    /// An unknown name, a missing required parameter or a bad value.
    pub fn from_named(name: &str, p: &BTreeMap<String, f64>) -> Result<Optimizer> {
        let spec = vocab::find("optimizer", vocab::OPTIMIZERS, name)?;
        let get = |param| spec.get(p, param);
        let opt = match spec.name {
            "SGD" => Optimizer::Sgd {
                lr: get("lr")?,
                weight_decay: get("weight_decay")?,
            },
            "Adagrad" => Optimizer::Adagrad {
                lr: get("lr")?,
                initial_accumulator_value: get("initial_accumulator_value")?,
                eps: get("eps")?,
                weight_decay: get("weight_decay")?,
            },
            "RowWiseAdagrad" => Optimizer::RowWiseAdagrad {
                lr: get("lr")?,
                eps: get("eps")?,
                weight_decay: get("weight_decay")?,
            },
            "Adam" => Optimizer::Adam {
                lr: get("lr")?,
                beta1: get("beta1")?,
                beta2: get("beta2")?,
                eps: get("eps")?,
                weight_decay: get("weight_decay")?,
            },
            "AdamW" => Optimizer::AdamW {
                lr: get("lr")?,
                beta1: get("beta1")?,
                beta2: get("beta2")?,
                eps: get("eps")?,
                weight_decay: get("weight_decay")?,
            },
            "Ftrl" => Optimizer::Ftrl {
                lr: get("lr")?,
                l1: get("l1")?,
                l2: get("l2")?,
                beta: get("beta")?,
                initial_accumulator_value: get("initial_accumulator_value")?,
                weight_decay: get("weight_decay")?,
            },
            other => unreachable!("{other} is listed in vocab::OPTIMIZERS without a parser"),
        };
        opt.validate()?;
        Ok(opt)
    }

    /// The name and every parameter, the inverse of [`Optimizer::from_named`].
    pub fn to_named(&self) -> (&'static str, BTreeMap<String, f64>) {
        let p: Vec<(&str, f64)> = match *self {
            Optimizer::Sgd { lr, weight_decay } => vec![("lr", lr), ("weight_decay", weight_decay)],
            Optimizer::Adagrad {
                lr,
                initial_accumulator_value,
                eps,
                weight_decay,
            } => vec![
                ("lr", lr),
                ("initial_accumulator_value", initial_accumulator_value),
                ("eps", eps),
                ("weight_decay", weight_decay),
            ],
            Optimizer::RowWiseAdagrad {
                lr,
                eps,
                weight_decay,
            } => vec![("lr", lr), ("eps", eps), ("weight_decay", weight_decay)],
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => vec![
                ("lr", lr),
                ("beta1", beta1),
                ("beta2", beta2),
                ("eps", eps),
                ("weight_decay", weight_decay),
            ],
            Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => vec![
                ("lr", lr),
                ("beta1", beta1),
                ("beta2", beta2),
                ("eps", eps),
                ("weight_decay", weight_decay),
            ],
            Optimizer::Ftrl {
                lr,
                l1,
                l2,
                beta,
                initial_accumulator_value,
                weight_decay,
            } => vec![
                ("lr", lr),
                ("l1", l1),
                ("l2", l2),
                ("beta", beta),
                ("initial_accumulator_value", initial_accumulator_value),
                ("weight_decay", weight_decay),
            ],
        };
        (
            self.name(),
            p.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        )
    }

    /// The optimizer's name as `embstore.optim` spells its class.
    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::Sgd { .. } => "SGD",
            Optimizer::Adagrad { .. } => "Adagrad",
            Optimizer::RowWiseAdagrad { .. } => "RowWiseAdagrad",
            Optimizer::Adam { .. } => "Adam",
            Optimizer::AdamW { .. } => "AdamW",
            Optimizer::Ftrl { .. } => "Ftrl",
        }
    }

    /// Floats of optimizer state per row for a table of `dim` columns.
    pub fn state_len(&self, dim: usize) -> usize {
        match self {
            Optimizer::Sgd { .. } => 0,
            Optimizer::RowWiseAdagrad { .. } => 1,
            Optimizer::Adagrad { .. } => dim,
            Optimizer::Adam { .. } | Optimizer::AdamW { .. } | Optimizer::Ftrl { .. } => 2 * dim,
        }
    }

    /// Names of the state blocks, in their order within a row's state.
    pub fn state_names(&self) -> &'static [&'static str] {
        match self {
            Optimizer::Sgd { .. } => &[],
            Optimizer::Adagrad { .. } | Optimizer::RowWiseAdagrad { .. } => &["sum"],
            Optimizer::Adam { .. } | Optimizer::AdamW { .. } => &["exp_avg", "exp_avg_sq"],
            Optimizer::Ftrl { .. } => &["linear", "accumulator"],
        }
    }

    /// Where a row's state splits into its two blocks (block 0 is
    /// `state[..split]`), and which block (if any) is the accumulator a
    /// step divides by (whose minimum [`Optimizer::predict`] needs).
    pub(crate) fn state_blocks(&self, dim: usize) -> (usize, Option<usize>) {
        match self {
            Optimizer::Sgd { .. } => (0, None),
            Optimizer::Adagrad { .. } => (dim, Some(0)),
            Optimizer::RowWiseAdagrad { .. } => (1, Some(0)),
            Optimizer::Adam { .. } | Optimizer::AdamW { .. } => (dim, None),
            Optimizer::Ftrl { .. } => (dim, Some(1)),
        }
    }

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
    /// [`crate::table::COMFORT`] or a divisor may be zero (the step must
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
        // step measures every row anew, see `table::bounds`).
        const ROUND: f64 = 1.0 + 4e-7;
        let limit = crate::table::COMFORT;
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
                if mm / eps > limit {
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
        let sl = self.state_len(dim);
        let Some((off, len)) = self.nonnegative_state(dim) else {
            return Ok(());
        };
        if sl == 0 {
            return Ok(());
        }
        let bad = state
            .chunks_exact(sl)
            .position(|row| row[off..off + len].iter().any(|&x| x < 0.0));
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

    /// Checks every hyper-parameter; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        let lr_ok = |lr: f64| check("lr", lr, lr > 0.0, "a finite lr > 0");
        // eps keeps a zero gradient on a zero accumulator from being 0 / 0
        // (NaN): it must be > 0 as float32 (the kernels' precision).
        let eps_ok = |e: f64| {
            check(
                "eps",
                e,
                e > 0.0 && (e as f32) > 0.0,
                "a finite eps > 0 (as float32; with eps = 0 a zero gradient on a zero \
                 accumulator gives 0/0 = NaN)",
            )
        };
        let beta_ok = |arg, b: f64| check(arg, b, (0.0..1.0).contains(&b), "0 <= beta < 1");
        check(
            "weight_decay",
            self.coupled_decay(),
            self.coupled_decay() >= 0.0,
            "a finite weight_decay >= 0",
        )?;
        match *self {
            Optimizer::Sgd { lr, .. } => lr_ok(lr),
            Optimizer::Adagrad {
                lr,
                initial_accumulator_value,
                eps,
                ..
            } => {
                lr_ok(lr)?;
                check(
                    "initial_accumulator_value",
                    initial_accumulator_value,
                    initial_accumulator_value >= 0.0,
                    "a finite value >= 0",
                )?;
                // A positive starting accumulator keeps sqrt(h) > 0 on its own.
                if (initial_accumulator_value as f32) > 0.0 && eps == 0.0 {
                    Ok(())
                } else {
                    eps_ok(eps)
                }
            }
            Optimizer::RowWiseAdagrad { lr, eps, .. } => {
                lr_ok(lr)?;
                eps_ok(eps)
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                ..
            } => {
                lr_ok(lr)?;
                beta_ok("beta1", beta1)?;
                beta_ok("beta2", beta2)?;
                eps_ok(eps)
            }
            Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                lr_ok(lr)?;
                beta_ok("beta1", beta1)?;
                beta_ok("beta2", beta2)?;
                eps_ok(eps)?;
                check(
                    "weight_decay",
                    weight_decay,
                    weight_decay >= 0.0 && lr * weight_decay < 1.0,
                    "a finite weight_decay >= 0 with lr * weight_decay < 1",
                )
            }
            Optimizer::Ftrl {
                lr,
                l1,
                l2,
                beta,
                initial_accumulator_value,
                ..
            } => {
                lr_ok(lr)?;
                check("l1", l1, l1 >= 0.0, "a finite l1 >= 0")?;
                check("l2", l2, l2 >= 0.0, "a finite l2 >= 0")?;
                check("beta", beta, beta >= 0.0, "a finite beta >= 0")?;
                check(
                    "initial_accumulator_value",
                    initial_accumulator_value,
                    initial_accumulator_value > 0.0,
                    "a finite value > 0",
                )
            }
        }
    }

    /// The coupled L2 strength (`g += weight_decay * w` before the update);
    /// 0 for AdamW, whose decay is decoupled and part of its step.
    pub fn coupled_decay(&self) -> f64 {
        match *self {
            Optimizer::Sgd { weight_decay, .. }
            | Optimizer::Adagrad { weight_decay, .. }
            | Optimizer::RowWiseAdagrad { weight_decay, .. }
            | Optimizer::Adam { weight_decay, .. }
            | Optimizer::Ftrl { weight_decay, .. } => weight_decay,
            Optimizer::AdamW { .. } => 0.0,
        }
    }

    /// Whether a step must measure the weights it writes for the next
    /// step's bound ([`Optimizer::predict`]): where the predicted weight
    /// bound would feed back into itself and grow geometrically (Adam's
    /// first moment through coupled weight decay, FTRL's `z` through
    /// `sigma * w`). Elsewhere the prediction grows by an amount that does
    /// not depend on the weights, and a step measures nothing.
    pub(crate) fn measures_weights(&self) -> bool {
        match *self {
            Optimizer::Adam { weight_decay, .. } => weight_decay != 0.0,
            Optimizer::Ftrl { .. } => true,
            _ => false,
        }
    }

    /// Writes the state of a new (or newly assigned) row.
    pub fn init_state(&self, state: &mut [f32]) {
        match *self {
            Optimizer::Adagrad {
                initial_accumulator_value: v,
                ..
            } => state.fill(v as f32),
            Optimizer::Ftrl {
                initial_accumulator_value: v,
                ..
            } => {
                let half = state.len() / 2;
                state[..half].fill(0.0);
                state[half..].fill(v as f32);
            }
            _ => state.fill(0.0),
        }
    }

    /// The constants of step number `t` (1 for the first step).
    pub fn step_consts(&self, t: u64) -> StepConsts {
        let t = t.min(i32::MAX as u64) as i32;
        match *self {
            Optimizer::Sgd { lr, .. } => StepConsts::Sgd(lr as f32),
            Optimizer::Adagrad { lr, eps, .. } => StepConsts::Adagrad(lr as f32, eps as f32),
            Optimizer::RowWiseAdagrad { lr, eps, .. } => {
                StepConsts::RowWiseAdagrad(lr as f32, eps as f32)
            }
            Optimizer::Adam {
                lr,
                beta1,
                beta2,
                eps,
                ..
            } => {
                let bc1 = 1.0 - beta1.powi(t);
                let bc2 = 1.0 - beta2.powi(t);
                StepConsts::Adam(AdamParams {
                    one_minus_b1: (1.0 - beta1) as f32,
                    one_minus_b2: (1.0 - beta2) as f32,
                    step_size: (lr * bc2.sqrt() / bc1) as f32,
                    eps: eps as f32,
                })
            }
            Optimizer::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let bc1 = 1.0 - beta1.powi(t);
                let bc2 = 1.0 - beta2.powi(t);
                StepConsts::AdamW(AdamWParams {
                    decay: (1.0 - lr * weight_decay) as f32,
                    one_minus_b1: (1.0 - beta1) as f32,
                    b2: beta2 as f32,
                    one_minus_b2: (1.0 - beta2) as f32,
                    step_size: (lr / bc1) as f32,
                    bc2_sqrt: bc2.sqrt() as f32,
                    eps: eps as f32,
                })
            }
            Optimizer::Ftrl {
                lr, l1, l2, beta, ..
            } => StepConsts::Ftrl(FtrlParams {
                lr: lr as f32,
                l1: l1 as f32,
                l2_total: (2.0 * l2 + beta / lr) as f32,
            }),
        }
    }
}

impl StepConsts {
    /// Applies one step with summed gradient `g` to a row's weights `w` and
    /// its optimizer state `state` (laid out as [`Optimizer::state_names`]).
    #[inline]
    pub fn apply(&self, b: Backend, w: &mut [f32], state: &mut [f32], g: &[f32]) {
        match self {
            StepConsts::Sgd(lr) => b.sgd(w, g, *lr),
            StepConsts::Adagrad(lr, eps) => b.adagrad(w, state, g, *lr, *eps),
            StepConsts::RowWiseAdagrad(lr, eps) => {
                b.rowwise_adagrad(w, &mut state[0], g, *lr, *eps)
            }
            StepConsts::Adam(p) => {
                let (m, v) = state.split_at_mut(w.len());
                b.adam(w, m, v, g, p)
            }
            StepConsts::AdamW(p) => {
                let (m, v) = state.split_at_mut(w.len());
                b.adamw(w, m, v, g, p)
            }
            StepConsts::Ftrl(p) => {
                let (z, n) = state.split_at_mut(w.len());
                b.ftrl(w, z, n, g, p)
            }
        }
    }
}
