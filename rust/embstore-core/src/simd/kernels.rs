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

/// The smallest and largest of `x` (`x` not empty, finite), by 16 lanes of
/// compare-and-select (a fold of `f32::min` does not vectorize).
#[inline(always)]
pub(super) fn min_max(x: &[f32]) -> (f32, f32) {
    let mut lo = [x[0]; 16];
    let mut hi = [x[0]; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            lo[i] = if c[i] < lo[i] { c[i] } else { lo[i] };
            hi[i] = if c[i] > hi[i] { c[i] } else { hi[i] };
        }
    }
    for (i, &v) in chunks.remainder().iter().enumerate() {
        lo[i] = if v < lo[i] { v } else { lo[i] };
        hi[i] = if v > hi[i] { v } else { hi[i] };
    }
    // A tree of halves: 4 vector steps where a lane-by-lane fold took 15.
    for w in [8, 4, 2, 1] {
        for i in 0..w {
            lo[i] = if lo[i + w] < lo[i] { lo[i + w] } else { lo[i] };
            hi[i] = if hi[i + w] > hi[i] { hi[i + w] } else { hi[i] };
        }
    }
    (lo[0], hi[0])
}

/// An 8-bit row's weights: `out[c] = offset + scale * q[c]` (a product,
/// then a sum: no fused multiply-add, so every backend and NumPy agree).
#[inline(always)]
pub(super) fn dequant_u8(q: &[u8], scale: f32, offset: f32, out: &mut [f32]) {
    for (o, &v) in out.iter_mut().zip(q) {
        *o = offset + scale * f32::from(v);
    }
}

/// lowbias32 (Chris Wellons): a 32-bit mixer whose multiplies vectorize on
/// every backend.
#[inline(always)]
fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7FEB_352D);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846C_A68B);
    x ^ (x >> 16)
}

/// The stochastic rounding draw of column `c` of a row stream: 24 bits of
/// `mix32(base + c * 0x9E3779B9)`, `base` the stream's two halves xored,
/// as a float in [0, 1).
#[inline(always)]
pub(crate) fn rounding_draw(stream: u64, c: usize) -> f32 {
    const INV_2_24: f32 = 1.0 / (1u32 << 24) as f32;
    let base = (stream >> 32) as u32 ^ stream as u32;
    (mix32(base.wrapping_add((c as u32).wrapping_mul(0x9E37_79B9))) >> 8) as f32 * INV_2_24
}

/// An 8-bit row's codes: `q[c] = clamp(floor((x[c] - lo) * (1 / scale) +
/// u_c), 0, 255)` (a product by the reciprocal, computed once: a division a
/// weight cost more than the rest of an Adam step), with `u_c = 0.5` (round
/// to nearest) or, with `stream`, [`rounding_draw`] in [0, 1); all zeros
/// where `scale` is 0 (a constant row). Branch-free selects, so that the
/// loop vectorizes.
#[inline(always)]
pub(super) fn quant_u8(x: &[f32], lo: f32, scale: f32, stream: Option<u64>, q: &mut [u8]) {
    if scale == 0.0 {
        q.fill(0);
        return;
    }
    let inv = 1.0 / scale;
    let code = |v: f32, u: f32| {
        let f = ((v - lo) * inv + u).floor();
        let f = if f >= 0.0 { f } else { 0.0 }; // NaN too
        let f = if f > 255.0 { 255.0 } else { f };
        // SAFETY: `f` is a whole number in 0..=255 (a NaN became 0 above),
        // so it converts exactly; unlike a saturating `as` cast (a check
        // for each value), this one vectorizes.
        unsafe { f.to_int_unchecked::<i32>() as u8 }
    };
    match stream {
        None => {
            for (d, &v) in q.iter_mut().zip(x) {
                *d = code(v, 0.5);
            }
        }
        Some(s) => {
            for (c, (d, &v)) in q.iter_mut().zip(x).enumerate() {
                *d = code(v, rounding_draw(s, c));
            }
        }
    }
}
