//! The kernel bodies, written once as plain loops over slices. Each backend
//! module instantiates them inside a `#[target_feature]` function so that LLVM
//! vectorizes the same loop for that instruction set. No loop here lets the
//! compiler reorder or fuse float operations (Rust never contracts a*b+c into
//! an FMA, nor reassociates a reduction), so every backend computes the same
//! IEEE operations in the same order and its results are bit-identical to the
//! scalar backend's; `tests` in `simd/mod.rs` checks exactly that.

use super::{AdamParams, AdamWParams, FtrlParams};
use crate::hash::{GOLDEN, mix64};

/// `acc += x`.
#[inline(always)]
pub(super) fn add_assign(acc: &mut [f32], x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

/// `acc += a * x`.
#[inline(always)]
pub(super) fn axpy(acc: &mut [f32], a: f32, x: &[f32]) {
    for (o, &v) in acc.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// The largest of `data`'s magnitudes as bits (sign cleared), 0 for no
/// data: bits of `0x7F80_0000` or more mean a NaN or an infinity is present.
/// Integer max is exact in any order, so every backend agrees.
#[inline(always)]
pub(super) fn max_magnitude_bits(data: &[f32]) -> u32 {
    data.iter()
        .fold(0u32, |acc, v| acc.max(v.to_bits() & 0x7FFF_FFFF))
}

/// `x *= a`.
#[inline(always)]
pub(super) fn scale(x: &mut [f32], a: f32) {
    for v in x.iter_mut() {
        *v *= a;
    }
}

/// The largest of `top` and the magnitude of `w` as bits (see
/// [`max_magnitude_bits`]): the step kernels fold each new weight into it
/// in their own loop, where it costs two vector operations per vector.
#[inline(always)]
fn fold_top(top: u32, w: f32) -> u32 {
    top.max(w.to_bits() & 0x7FFF_FFFF)
}

/// SGD: `w -= lr * g`. Every step kernel returns the largest magnitude of
/// the new weights as bits ([`max_magnitude_bits`]).
#[inline(always)]
pub(super) fn sgd(w: &mut [f32], g: &[f32], lr: f32) -> u32 {
    let mut top = 0;
    for (w, &g) in w.iter_mut().zip(g) {
        *w -= lr * g;
        top = fold_top(top, *w);
    }
    top
}

/// Adagrad as torch.optim.Adagrad: `h += g^2; w += -lr * (g / (sqrt(h) + eps))`.
#[inline(always)]
pub(super) fn adagrad(w: &mut [f32], h: &mut [f32], g: &[f32], lr: f32, eps: f32) -> u32 {
    let mut top = 0;
    for ((w, h), &g) in w.iter_mut().zip(h.iter_mut()).zip(g) {
        *h += g * g;
        *w += -lr * (g / (h.sqrt() + eps));
        top = fold_top(top, *w);
    }
    top
}

/// Row-wise Adagrad as FBGEMM: `h += mean(g^2); w -= lr * g / (sqrt(h) + eps)`.
#[inline(always)]
pub(super) fn rowwise_adagrad(w: &mut [f32], h: &mut f32, g: &[f32], lr: f32, eps: f32) -> u32 {
    let mut sq = 0.0f32;
    for &g in g {
        sq += g * g;
    }
    *h += sq / g.len() as f32;
    let denom = h.sqrt() + eps;
    let step = lr / denom;
    let mut top = 0;
    if step.is_finite() {
        for (w, &g) in w.iter_mut().zip(g) {
            *w -= step * g;
            top = fold_top(top, *w);
        }
    } else {
        // `lr / denom` overflowed (a huge lr over a zero or underflowed
        // accumulator): `step * g` would be inf for a tiny gradient and NaN
        // for a zero one, where `lr * g / denom` is the finite update.
        for (w, &g) in w.iter_mut().zip(g) {
            *w -= lr * g / denom;
            top = fold_top(top, *w);
        }
    }
    top
}

/// Adam as torch.optim.SparseAdam:
/// `m += (g - m)(1 - b1); v += (g^2 - v)(1 - b2); w += -step * (m / (sqrt(v) + eps))`
/// with `step = lr * sqrt(1 - b2^t) / (1 - b1^t)`.
#[inline(always)]
pub(super) fn adam(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], p: &AdamParams) -> u32 {
    let mut top = 0;
    for (((w, m), v), &g) in w.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        *m += (g - *m) * p.one_minus_b1;
        *v += (g * g - *v) * p.one_minus_b2;
        *w += -p.step_size * (*m / (v.sqrt() + p.eps));
        top = fold_top(top, *w);
    }
    top
}

/// AdamW as torch.optim.AdamW: `w *= 1 - lr*wd`, then
/// `m += (g - m)(1 - b1); v = v*b2 + (1 - b2) g^2;
///  w += -lr/(1 - b1^t) * (m / (sqrt(v)/sqrt(1 - b2^t) + eps))`.
#[inline(always)]
pub(super) fn adamw(
    w: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[f32],
    p: &AdamWParams,
) -> u32 {
    let mut top = 0;
    for (((w, m), v), &g) in w.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        *w *= p.decay;
        *m += (g - *m) * p.one_minus_b1;
        *v = *v * p.b2 + p.one_minus_b2 * (g * g);
        *w += -p.step_size * (*m / (v.sqrt() / p.bc2_sqrt + p.eps));
        top = fold_top(top, *w);
    }
    top
}

/// FTRL-Proximal as tf.keras.optimizers.Ftrl (learning_rate_power = -0.5):
/// `n' = n + g^2; z += g - (sqrt(n') - sqrt(n))/lr * w;
///  w = |z| > l1 ? (sign(z) l1 - z) / (sqrt(n')/lr + 2 l2 + beta/lr) : 0`.
#[inline(always)]
pub(super) fn ftrl(w: &mut [f32], z: &mut [f32], n: &mut [f32], g: &[f32], p: &FtrlParams) -> u32 {
    let mut top = 0;
    for (((w, z), n), &g) in w.iter_mut().zip(z.iter_mut()).zip(n.iter_mut()).zip(g) {
        let n_new = *n + g * g;
        let sqrt_new = n_new.sqrt();
        *z += g - (sqrt_new - n.sqrt()) / p.lr * *w;
        *n = n_new;
        let quadratic = sqrt_new / p.lr + p.l2_total;
        let zs = *z;
        let l1 = if zs < 0.0 { -p.l1 } else { p.l1 };
        *w = if zs.abs() > p.l1 {
            (l1 - zs) / quadratic
        } else {
            0.0
        };
        top = fold_top(top, *w);
    }
    top
}

/// The uniform initializer of one row: column `c` is
/// `low + span * u_c` with `u_c = (draw(stream, c) >> 11) * 2^-53`, the
/// splitmix64 counter draw of [`crate::hash::draw`], computed in f64.
#[inline(always)]
pub(super) fn uniform_fill(out: &mut [f32], stream: u64, low: f64, span: f64) {
    const INV_2_53: f64 = 1.0 / (1u64 << 53) as f64;
    for (c, o) in out.iter_mut().enumerate() {
        let bits = mix64(stream.wrapping_add((c as u64).wrapping_add(1).wrapping_mul(GOLDEN)));
        let u = (bits >> 11) as f64 * INV_2_53;
        *o = (low + span * u) as f32;
    }
}
