//! One optimizer step on a row: the constants of step `t`, computed once
//! per call, and the update they apply through the SIMD kernels.

use crate::optim::Optimizer;
use crate::simd::{AdamParams, AdamWParams, Backend, FtrlParams};

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

impl Optimizer {
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
