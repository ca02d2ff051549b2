//! Initializers: each row's initial values are a pure function of
//! (seed, key, column), drawn from a counter-based stream
//! ([`crate::hash::draw`]), never from a shared RNG. The same key therefore
//! gets the same row whatever the number of shards or ranks, the insertion
//! order or the thread count.

use std::collections::BTreeMap;

use crate::error::{Result, invalid};
use crate::hash::{draw, row_stream};
use crate::simd::Backend;
use crate::vocab;

/// How new rows are filled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Initializer {
    /// Uniform in `[low, high)`.
    Uniform {
        /// Lower bound (inclusive).
        low: f64,
        /// Upper bound (exclusive).
        high: f64,
    },
    /// Normal(mean, std) by Box-Muller.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
    /// Normal(mean, std) redrawn until within two standard deviations, as
    /// `tf.random.truncated_normal` and `torch.nn.init.trunc_normal_(a=-2, b=2)`.
    TruncatedNormal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
    /// Every value 0.
    Zeros,
    /// Every value `value`.
    Constant {
        /// The value.
        value: f64,
    },
}

impl Default for Initializer {
    fn default() -> Self {
        Initializer::Uniform {
            low: -0.05,
            high: 0.05,
        }
    }
}

const INV_2_24: f64 = 1.0 / (1u64 << 24) as f64;

/// The least float32 whose value is at least `high`.
fn least_at(high: f64) -> f32 {
    let h = high as f32;
    // `h` is the nearest: when it is not below `high`, the float before it
    // is (else that one would be nearer).
    if f64::from(h) >= high { h } else { h.next_up() }
}

/// The largest float32 below `high`, and no lower than `low` rounded
/// (`low < high`): the top of a uniform draw in `[low, high)`.
fn below(high: f64, low: f64) -> f32 {
    let h = high as f32;
    let top = if f64::from(h) >= high {
        h.next_down()
    } else {
        h
    };
    top.max(low as f32)
}

/// A standard normal draw from one 64-bit value (Box-Muller, both uniforms
/// from disjoint bits; computed in f64 so rounding does not depend on SIMD).
#[inline]
fn std_normal(bits: u64) -> f64 {
    let u1 = ((bits >> 40) + 1) as f64 * INV_2_24; // (0, 1]
    let u2 = (bits & 0xFF_FFFF) as f64 * INV_2_24; // [0, 1)
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

impl Initializer {
    /// The initializer named `name` (as `embstore.init` spells its class)
    /// with parameters `p`, validated.
    ///
    /// # Errors
    /// An unknown name, a missing required parameter or a bad value.
    pub fn from_named(name: &str, p: &BTreeMap<String, f64>) -> Result<Initializer> {
        let spec = vocab::find("initializer", vocab::INITIALIZERS, name)?;
        let get = |param| spec.get(p, param);
        let init = match spec.name {
            "Uniform" => Initializer::Uniform {
                low: get("low")?,
                high: get("high")?,
            },
            "Normal" => Initializer::Normal {
                mean: get("mean")?,
                std: get("std")?,
            },
            "TruncatedNormal" => Initializer::TruncatedNormal {
                mean: get("mean")?,
                std: get("std")?,
            },
            "Zeros" => Initializer::Zeros,
            "Constant" => Initializer::Constant {
                value: get("value")?,
            },
            other => unreachable!("{other} is listed in vocab::INITIALIZERS without a parser"),
        };
        init.validate()?;
        Ok(init)
    }

    /// The name and every parameter, the inverse of [`Initializer::from_named`].
    pub fn to_named(&self) -> (&'static str, BTreeMap<String, f64>) {
        let (name, p): (&str, Vec<(&str, f64)>) = match *self {
            Initializer::Uniform { low, high } => ("Uniform", vec![("low", low), ("high", high)]),
            Initializer::Normal { mean, std } => ("Normal", vec![("mean", mean), ("std", std)]),
            Initializer::TruncatedNormal { mean, std } => {
                ("TruncatedNormal", vec![("mean", mean), ("std", std)])
            }
            Initializer::Zeros => ("Zeros", vec![]),
            Initializer::Constant { value } => ("Constant", vec![("value", value)]),
        };
        (
            name,
            p.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        )
    }

    /// Checks the parameters; the error names the bad one.
    pub fn validate(&self) -> Result<()> {
        let finite = |arg: &'static str, v: f64| {
            if v.is_finite() && v.abs() <= f64::from(f32::MAX) {
                Ok(())
            } else {
                Err(invalid(
                    arg,
                    format!("expected a number finite as float32, got {v}"),
                ))
            }
        };
        match *self {
            Initializer::Uniform { low, high } => {
                finite("low", low)?;
                finite("high", high)?;
                if low > high {
                    return Err(invalid(
                        "high",
                        format!("expected high >= low, got low={low}, high={high}"),
                    ));
                }
                finite("high", high - low).map_err(|_| {
                    invalid(
                        "high",
                        format!(
                            "expected high - low finite as float32, got low={low}, high={high}"
                        ),
                    )
                })?;
            }
            Initializer::Normal { mean, std } | Initializer::TruncatedNormal { mean, std } => {
                finite("mean", mean)?;
                finite("std", std)?;
                if std < 0.0 {
                    return Err(invalid("std", format!("expected std >= 0, got {std}")));
                }
            }
            Initializer::Zeros => {}
            Initializer::Constant { value } => finite("value", value)?,
        }
        Ok(())
    }

    /// A bound on the magnitude of every value this initializer writes.
    pub fn max_abs(&self) -> f64 {
        match *self {
            Initializer::Uniform { low, high } => low.abs().max(high.abs()),
            // The normal draws come from 53-bit uniforms: |z| < 9.
            Initializer::Normal { mean, std } => mean.abs() + 9.0 * std,
            Initializer::TruncatedNormal { mean, std } => mean.abs() + 2.0 * std,
            Initializer::Zeros => 0.0,
            Initializer::Constant { value } => value.abs(),
        }
    }

    /// Writes the initial row of `key` into `out` (its length is the dim).
    pub fn fill(&self, seed: u64, key: i64, out: &mut [f32]) {
        self.fill_with(Backend::SCALAR, seed, key, out);
    }

    /// [`Initializer::fill`] on a SIMD backend (bit-identical results).
    pub fn fill_with(&self, backend: Backend, seed: u64, key: i64, out: &mut [f32]) {
        match *self {
            Initializer::Uniform { low, high } => {
                backend.uniform_fill(out, row_stream(seed, key), low, high - low);
                // A draw within half a float32 step of `high` rounds up to
                // it: such values become the largest float32 below `high`,
                // so that the interval stays half-open.
                if high > low {
                    let (top, from) = (below(high, low), least_at(high));
                    // A compare of f32s (`*o >= from` exactly when `*o`
                    // as f64 is at least `high`) and a select: the loop
                    // vectorizes, where a compare in f64 did not.
                    for o in out.iter_mut() {
                        *o = if *o >= from { top } else { *o };
                    }
                }
            }
            Initializer::Normal { mean, std } => {
                let s = row_stream(seed, key);
                for (c, o) in out.iter_mut().enumerate() {
                    let z = std_normal(draw(s, c as u64));
                    *o = (mean + std * z) as f32;
                }
            }
            Initializer::TruncatedNormal { mean, std } => {
                let s = row_stream(seed, key);
                let dim = out.len() as u64;
                for (c, o) in out.iter_mut().enumerate() {
                    // Redraw with counters c, c + dim, c + 2*dim, ... until |z| <= 2.
                    let mut i = c as u64;
                    let z = loop {
                        let z = std_normal(draw(s, i));
                        if z.abs() <= 2.0 {
                            break z;
                        }
                        i += dim;
                    };
                    *o = (mean + std * z) as f32;
                }
            }
            Initializer::Zeros => out.fill(0.0),
            Initializer::Constant { value } => out.fill(value as f32),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A float32 is at least `least_at(high)` exactly when its value is at
    /// least `high`, for bounds on, between and beside float32 values.
    #[test]
    fn least_at_splits_float32s_where_high_does() {
        let mut highs = vec![0.05, 1.0, 3.0, -0.3, 1e-30, 1e39, -1e39];
        for h in [0.05f32, 3.0, -0.3, 7.25e-3] {
            let (lo, hi) = (f64::from(h.next_down()), f64::from(h.next_up()));
            let x = f64::from(h);
            highs.extend([x, (x + hi) / 2.0, (x + lo) / 2.0, x + (hi - x) / 1e6]);
        }
        for high in highs {
            let from = least_at(high);
            let probe = [from.next_down(), from, from.next_up()];
            for o in probe.into_iter().filter(|o| o.is_finite()) {
                assert_eq!(o >= from, f64::from(o) >= high, "{o} against {high}");
            }
        }
    }

    #[test]
    fn uniform_draws_stay_below_high() {
        // Seed 101, key 15269, column 3 drew -1 + 4u with u so close to 1
        // that it rounded to 3.0 as float32 (found by a search; the
        // initializer's interval is [low, high)).
        let init = Initializer::Uniform {
            low: -1.0,
            high: 3.0,
        };
        let mut row = [0.0f32; 8];
        init.fill(101, 15269, &mut row);
        assert!(row.iter().all(|v| (-1.0..3.0).contains(v)), "{row:?}");
        assert_eq!(row[3], 3.0f32.next_down());
        assert_eq!(below(3.0, -1.0), 3.0f32.next_down());
        // 0.1 is no float32: the largest one below it.
        let t = below(0.1, -1.0);
        assert!(f64::from(t) < 0.1 && f64::from(t.next_up()) >= 0.1);
        // No float32 in [low, high): low, rounded.
        assert_eq!(below(1.0, 1.0 - 1e-12), 1.0);
    }

    #[test]
    fn uniform_in_range_and_mean_near_center() {
        let init = Initializer::Uniform {
            low: -1.0,
            high: 3.0,
        };
        let mut row = vec![0.0f32; 64];
        let mut sum = 0.0f64;
        for key in 0..2000 {
            init.fill(1, key, &mut row);
            for &v in &row {
                assert!((-1.0..3.0).contains(&v));
                sum += f64::from(v);
            }
        }
        let mean = sum / (2000.0 * 64.0);
        assert!((mean - 1.0).abs() < 0.02, "mean {mean}");
    }

    #[test]
    fn normal_moments_and_truncation() {
        let n = Initializer::Normal {
            mean: 0.5,
            std: 2.0,
        };
        let t = Initializer::TruncatedNormal {
            mean: 0.0,
            std: 1.0,
        };
        let mut row = vec![0.0f32; 100];
        let (mut s1, mut s2) = (0.0f64, 0.0f64);
        for key in 0..1000 {
            n.fill(3, key, &mut row);
            for &v in &row {
                s1 += f64::from(v);
                s2 += f64::from(v) * f64::from(v);
            }
            t.fill(3, key, &mut row);
            assert!(row.iter().all(|v| v.abs() <= 2.0));
        }
        let m = s1 / 100_000.0;
        let var = s2 / 100_000.0 - m * m;
        assert!((m - 0.5).abs() < 0.05, "mean {m}");
        assert!((var.sqrt() - 2.0).abs() < 0.05, "std {}", var.sqrt());
    }

    #[test]
    fn fill_is_a_pure_function_of_seed_key_column() {
        let init = Initializer::default();
        let (mut a, mut b) = (vec![0.0f32; 16], vec![0.0f32; 16]);
        init.fill(9, -5, &mut a);
        init.fill(9, 77, &mut b);
        init.fill(9, -5, &mut b);
        assert_eq!(a, b);
        // A shorter row is the prefix of a longer one: column c depends on c only.
        let mut short = vec![0.0f32; 4];
        init.fill(9, -5, &mut short);
        assert_eq!(&a[..4], &short[..]);
    }
}
