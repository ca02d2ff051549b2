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

use crate::error::{Result, invalid};
use crate::vocab;

mod bounds;
mod step;

use std::collections::BTreeMap;
pub use step::StepConsts;

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

    /// Whether a new row's state is all zeros ([`Optimizer::init_state`]
    /// writes only zeros): a row that is zero already needs no write.
    pub(crate) fn state_starts_zero(&self) -> bool {
        match *self {
            Optimizer::Adagrad {
                initial_accumulator_value: v,
                ..
            }
            | Optimizer::Ftrl {
                initial_accumulator_value: v,
                ..
            } => (v as f32).to_bits() == 0,
            _ => true,
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
}
