//! Nothing a step writes is NaN or inf: bounds on the magnitudes a table
//! holds, the test that lets a step run in place, and the dry run that
//! decides a step the bounds cannot clear.
//!
//! A table keeps upper bounds on `|weight|` and on each of its (at most
//! two) optimizer state blocks, and a lower bound on the accumulator that
//! optimizers divide by (Adagrad's `h`, FTRL's `n`). Before a step,
//! [`Optimizer::predict`] bounds every value the step can compute from
//! them and from the call's summed-gradient bound; when all stay below
//! [`COMFORT`] (far above any trained value, far below float32's largest),
//! the step runs as always, in parallel and in place, and the bounds rise
//! to the prediction. Otherwise the step takes its table's gate
//! exclusively, the bounds are measured anew from every row, and if the
//! prediction still does not clear, a dry run computes each touched row's
//! new values aside: a step that would make any of them non-finite is
//! refused whole, before anything changes.
//!
//! Writes that are not steps (assign, load, restore) raise the bounds by
//! what they write; new rows start within the initializer's bound.
//!
//! Steps that run at once on one table each predict from the bounds as
//! they were before the other's step, so the state bounds may lag the
//! truth by a factor of the steps in flight (each step's growth is added
//! once, not compounded); the factor of about 3e8 between [`COMFORT`] and
//! float32's largest value absorbs that. The weight bound is measured, so
//! it never lags.

use crate::error::{Result, invalid};
use crate::hash::{key_hash, shard_of};
use crate::optim::Optimizer;
use crate::policy::RowFormat;
use crate::simd::Backend;
use crate::table::storage::read;
use crate::table::views::Stepper;
use rayon::prelude::*;
use std::sync::atomic::{AtomicU32, Ordering};

/// Predicted magnitudes up to this run a step in place. A trained row never
/// comes near it; float32 overflows only at about 3.4e38, so the margin
/// also covers the rounding and the concurrent steps a prediction cannot see.
pub(crate) const COMFORT: f64 = 1e30;

/// Bounds on what a table holds (f64; see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Magnitudes {
    /// Every `|weight|` is at most this.
    pub w: f64,
    /// Every `|value|` of state block 0 / 1 is at most this.
    pub s: [f64; 2],
    /// Every value of the accumulator block is at least this (>= 0).
    pub acc_min: f64,
}

impl Magnitudes {
    /// The bounds of a table that holds nothing yet: the initializer's
    /// magnitude for weights, the optimizer's starting state.
    pub(crate) fn initial(opt: Option<&Optimizer>, init_max: f64) -> Magnitudes {
        let (s, acc_min) = opt.map_or(([0.0; 2], f64::INFINITY), |o| o.initial_magnitudes());
        Magnitudes {
            w: init_max,
            s,
            acc_min,
        }
    }

    /// Measured from rows: `values` (`dim` a row) and `state` (the
    /// optimizer's layout, `state_len` a row; may be empty).
    pub(crate) fn of(opt: Option<&Optimizer>, dim: usize, values: &[f32], state: &[f32]) -> Self {
        // Blocks of rows on every core (a write-back of 100,000s of rows
        // would otherwise scan them on one), reduced by `max`.
        const ROWS: usize = 4096;
        let rows = values.len() / dim.max(1);
        if rows <= ROWS {
            return Self::of_rows(opt, dim, values, state);
        }
        let sl = if state.is_empty() {
            0
        } else {
            state.len() / rows
        };
        (0..rows.div_ceil(ROWS))
            .into_par_iter()
            .map(|c| {
                let (a, z) = (c * ROWS, ((c + 1) * ROWS).min(rows));
                Self::of_rows(opt, dim, &values[a * dim..z * dim], &state[a * sl..z * sl])
            })
            .reduce(
                || Magnitudes {
                    w: 0.0,
                    s: [0.0; 2],
                    acc_min: f64::INFINITY,
                },
                Magnitudes::max,
            )
    }

    /// [`Magnitudes::of`] on one thread.
    fn of_rows(opt: Option<&Optimizer>, dim: usize, values: &[f32], state: &[f32]) -> Self {
        let b = Backend::best();
        let top = |v: &[f32]| f64::from(f32::from_bits(b.max_magnitude_bits(v)));
        let mut m = Magnitudes {
            w: top(values),
            s: [0.0; 2],
            acc_min: f64::INFINITY,
        };
        if let Some(o) = opt {
            let sl = o.state_len(dim);
            let (split, acc) = o.state_blocks(dim);
            if sl > 0 && !state.is_empty() {
                let mut bits = [0u32; 2];
                let mut acc_bits = u32::MAX;
                for row in state.chunks_exact(sl) {
                    let (b0, b1) = row.split_at(split);
                    bits[0] = bits[0].max(b.max_magnitude_bits(b0));
                    bits[1] = bits[1].max(b.max_magnitude_bits(b1));
                    if let Some(a) = acc {
                        let block = if a == 0 { b0 } else { b1 };
                        // Accumulators are >= 0 (checked), so their bits order as values.
                        acc_bits = block.iter().fold(acc_bits, |m, v| m.min(v.to_bits()));
                    }
                }
                m.s = bits.map(|x| f64::from(f32::from_bits(x)));
                if acc_bits != u32::MAX {
                    m.acc_min = f64::from(f32::from_bits(acc_bits));
                }
            }
        }
        m
    }

    /// The larger of each bound (the smaller accumulator minimum). A NaN
    /// bound (rows holding a NaN: measured from a file not yet found
    /// finite) stays NaN, where `f64::max` would drop it.
    pub(crate) fn max(self, o: Magnitudes) -> Magnitudes {
        let top = |a: f64, b: f64| {
            if a.is_nan() || b.is_nan() {
                f64::NAN
            } else {
                a.max(b)
            }
        };
        Magnitudes {
            w: top(self.w, o.w),
            s: [top(self.s[0], o.s[0]), top(self.s[1], o.s[1])],
            acc_min: self.acc_min.min(o.acc_min),
        }
    }
}

/// An f32 at least `v` (bits), for an upper bound kept in an atomic.
fn up(v: f64) -> u32 {
    let f = v.min(f64::from(f32::MAX)) as f32;
    if f64::from(f) < v && f < f32::MAX {
        f.next_up().to_bits()
    } else {
        f.to_bits()
    }
}

/// An f32 at most `v` (>= 0), for a lower bound.
fn down(v: f64) -> u32 {
    if v.is_infinite() {
        return f32::INFINITY.to_bits();
    }
    let f = v as f32;
    if f64::from(f) > v {
        f.next_down().max(0.0).to_bits()
    } else {
        f.to_bits()
    }
}

/// A table's [`Magnitudes`], shared by its calls (atomics: every write
/// only raises an upper bound or lowers the minimum, so concurrent calls
/// never lose one another's).
#[derive(Debug)]
pub(crate) struct Bounds {
    w: AtomicU32,
    s: [AtomicU32; 2],
    acc_min: AtomicU32,
}

impl Bounds {
    pub(crate) fn new(m: Magnitudes) -> Bounds {
        Bounds {
            w: AtomicU32::new(up(m.w)),
            s: [AtomicU32::new(up(m.s[0])), AtomicU32::new(up(m.s[1]))],
            acc_min: AtomicU32::new(down(m.acc_min)),
        }
    }

    pub(crate) fn get(&self) -> Magnitudes {
        let f = |a: &AtomicU32| f64::from(f32::from_bits(a.load(Ordering::Acquire)));
        Magnitudes {
            w: f(&self.w),
            s: [f(&self.s[0]), f(&self.s[1])],
            acc_min: f(&self.acc_min),
        }
    }

    /// [`Bounds::raise`] by a step that started from bounds `before`: only
    /// what grew past them is written (most steps of a settled table write
    /// none).
    pub(crate) fn raise_from(&self, before: &Magnitudes, m: &Magnitudes) {
        if m.w > before.w || m.s[0] > before.s[0] || m.s[1] > before.s[1] {
            self.raise(&Magnitudes {
                acc_min: f64::INFINITY,
                ..*m
            });
        }
        if m.acc_min < before.acc_min {
            self.raise(&Magnitudes {
                w: 0.0,
                s: [0.0; 2],
                acc_min: m.acc_min,
            });
        }
    }

    /// Raises the bounds to cover `m` (never lowers one). A bound already
    /// high enough is only read (no atomic write).
    pub(crate) fn raise(&self, m: &Magnitudes) {
        let raise = |a: &AtomicU32, v: u32| {
            if a.load(Ordering::Acquire) < v {
                a.fetch_max(v, Ordering::AcqRel);
            }
        };
        raise(&self.w, up(m.w));
        raise(&self.s[0], up(m.s[0]));
        raise(&self.s[1], up(m.s[1]));
        let lo = down(m.acc_min);
        if self.acc_min.load(Ordering::Acquire) > lo {
            self.acc_min.fetch_min(lo, Ordering::AcqRel);
        }
    }

    /// Sets the bounds to `m`: only under the table's gate held
    /// exclusively, from a measurement of every row.
    pub(crate) fn set(&self, m: &Magnitudes) {
        self.w.store(up(m.w), Ordering::Release);
        self.s[0].store(up(m.s[0]), Ordering::Release);
        self.s[1].store(up(m.s[1]), Ordering::Release);
        self.acc_min.store(down(m.acc_min), Ordering::Release);
    }
}

/// How a step may run, decided before it takes its table's gate.
pub(crate) enum StepGate<'a> {
    /// The prediction clears: the gate shared, the bounds to raise after.
    Fast {
        _gate: crate::table::Entered<'a>,
        predicted: Magnitudes,
        before: Magnitudes,
    },
    /// The gate held exclusively; with `None` the step must pass a dry run
    /// first ([`Stepper::dry_run`]), else the bounds to raise after.
    Checked {
        _gate: std::sync::RwLockWriteGuard<'a, ()>,
        predicted: Option<Magnitudes>,
    },
}

impl StepGate<'_> {
    /// Whether the step must pass a dry run before it changes anything.
    pub(crate) fn needs_dry_run(&self) -> bool {
        matches!(
            self,
            StepGate::Checked {
                predicted: None,
                ..
            }
        )
    }
}

impl<'a> Stepper<'a> {
    /// The gate for a step numbered `t` whose summed gradients are at most
    /// `gs` in magnitude (see [`StepGate`]).
    pub(crate) fn step_gate(&self, gs: f64, t: u64) -> StepGate<'a> {
        let before = self.bounds.get();
        let Some(opt) = self.optimizer else {
            return StepGate::Fast {
                _gate: self.0.enter(),
                predicted: before,
                before,
            };
        };
        if let Some(predicted) = opt.predict(&before, gs, t, self.dim) {
            return StepGate::Fast {
                _gate: self.0.enter(),
                predicted,
                before,
            };
        }
        let gate = self
            .0
            .gate
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // The bounds are loose after many predictions: measure every row.
        let exact = self.measure();
        self.bounds.set(&exact);
        StepGate::Checked {
            _gate: gate,
            predicted: opt.predict(&exact, gs, t, self.dim),
        }
    }

    /// After a step that ran through `gate`: the bounds rise to the
    /// prediction (or the dry run's measurement, `measured`), the weight
    /// bound to `written`, the largest weight the step wrote, where it
    /// measured it ([`Optimizer::measures_weights`]: a loose prediction
    /// there would feed back into the next one).
    pub(crate) fn end_step(
        &self,
        gate: StepGate<'_>,
        measured: Option<Magnitudes>,
        written: Option<f64>,
    ) {
        match (&gate, measured) {
            (
                StepGate::Fast {
                    predicted, before, ..
                },
                _,
            ) => {
                let m = Magnitudes {
                    w: written.unwrap_or(predicted.w),
                    ..*predicted
                };
                self.bounds.raise_from(before, &m);
            }
            (
                StepGate::Checked {
                    predicted: Some(p), ..
                },
                _,
            ) => self.bounds.raise(&Magnitudes {
                w: written.unwrap_or(p.w),
                ..*p
            }),
            // A dry run measured every row it stepped.
            (_, Some(m)) => self.bounds.raise(&m),
            (_, None) => {}
        }
        drop(gate);
    }

    /// The exact magnitudes of every row (the caller holds the gate
    /// exclusively, so no step runs meanwhile).
    fn measure(&self) -> Magnitudes {
        let init = Magnitudes::initial(self.optimizer.as_ref(), self.initializer.max_abs());
        let opt = self.optimizer.as_ref();
        let mut w = vec![0.0f32; self.dim];
        let mut m = init;
        for lock in self.shards.iter() {
            let g = read(lock);
            for (_, r) in g.keys_and_rows() {
                self.read_weights(g.weights(r), &mut w);
                m = m.max(Magnitudes::of(opt, self.dim, &w, g.state(r)));
            }
        }
        m
    }

    /// Computes the step numbered `t` of `keys` (position `i` contributing
    /// `coef * grad` with `(grad, coef) = grad_of(i)`, summed in batch order
    /// as the step sums them) on copies of the touched rows (absent keys
    /// from their initial rows), changing nothing, and returns the
    /// magnitudes of the results. The caller holds the gate exclusively.
    ///
    /// # Errors
    /// `InvalidArgument` naming `grads` and the first key whose row or state
    /// would be non-finite; `OutOfMemory` for the work arrays.
    pub(crate) fn dry_run<'g, G>(&self, keys: &[i64], t: u64, grad_of: G) -> Result<Magnitudes>
    where
        G: Fn(usize) -> (&'g [f32], f32),
    {
        let Some(opt) = self.optimizer else {
            return Ok(self.bounds.get());
        };
        let (dim, backend) = (self.dim, self.backend);
        let consts = opt.step_consts(t);
        let wd = opt.coupled_decay() as f32;
        let compact = self.policy.format != RowFormat::F32;
        let mut order: Vec<u32> = crate::zeroed::with_room("keys", keys.len())?;
        order.extend(0..keys.len() as u32);
        order.sort_by_key(|&i| (keys[i as usize], i));
        let n = self.shards.len();
        let mut w = vec![0.0f32; self.wwords];
        let mut st = vec![0.0f32; self.state_len];
        let (mut acc, mut wtmp, mut decayed) = (vec![0.0f32; dim], vec![0.0; dim], vec![0.0; dim]);
        let mut out = Magnitudes {
            w: 0.0,
            s: [0.0; 2],
            acc_min: f64::INFINITY,
        };
        let mut j = 0;
        while j < order.len() {
            let key = keys[order[j] as usize];
            let mut end = j + 1;
            while end < order.len() && keys[order[end] as usize] == key {
                end += 1;
            }
            acc.fill(0.0);
            for &p in &order[j..end] {
                let (gr, c) = grad_of(p as usize);
                if c == 1.0 {
                    backend.add_assign(&mut acc, gr);
                } else {
                    backend.axpy(&mut acc, c, gr);
                }
            }
            let h = key_hash(key);
            {
                let g = read(&self.shards[shard_of(h, n)]);
                match g.find(key, h) {
                    Some(r) => {
                        w.copy_from_slice(g.weights(r));
                        st.copy_from_slice(g.state(r));
                    }
                    None => self.fill_new(key, &mut w, &mut st),
                }
            }
            let mut decay = super::apply::Decay {
                wd,
                g: &mut decayed,
            };
            if compact {
                let stream = RowFormat::stochastic_steps()
                    .then(|| crate::hash::rounding_stream(self.seed(), key, t));
                self.apply_compact(
                    &consts, &mut w, &mut st, &acc, &mut wtmp, &mut decay, stream,
                );
                self.read_weights(&w, &mut wtmp);
            } else {
                let g = decay.of(backend, &acc, &w);
                consts.apply(backend, &mut w, &mut st, g);
                wtmp.copy_from_slice(&w);
            }
            let m = Magnitudes::of(Some(&opt), dim, &wtmp, &st);
            if !(m.w.is_finite() && m.s[0].is_finite() && m.s[1].is_finite()) {
                let what = if m.w.is_finite() {
                    "optimizer state"
                } else {
                    "row"
                };
                return Err(invalid(
                    "grads",
                    format!(
                        "this step would make the {what} of key {key} non-finite (float32 \
                         overflows under these optimizer settings and values); nothing changed"
                    ),
                ));
            }
            out = out.max(m);
            j = end;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::Initializer;
    use crate::table::{Table, TableConfig};

    /// A small deterministic generator (splitmix64) for the test's draws.
    struct Draw(u64);
    impl Draw {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            crate::hash::mix64(self.0)
        }
        /// 10^u for u uniform in [lo, hi).
        fn log(&mut self, lo: f64, hi: f64) -> f64 {
            let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
            10f64.powf(lo + (hi - lo) * u)
        }
    }

    fn optimizers(d: &mut Draw) -> Vec<Optimizer> {
        let lr = d.log(-4.0, 2.0);
        let wd = if d.next().is_multiple_of(2) {
            0.0
        } else {
            d.log(-4.0, -1.0)
        };
        let eps = d.log(-10.0, -2.0);
        vec![
            Optimizer::Sgd {
                lr,
                weight_decay: wd,
            },
            Optimizer::Adagrad {
                lr,
                initial_accumulator_value: d.log(-3.0, 0.0),
                eps,
                weight_decay: wd,
            },
            Optimizer::RowWiseAdagrad {
                lr,
                eps,
                weight_decay: wd,
            },
            Optimizer::Adam {
                lr,
                beta1: 0.9,
                beta2: 0.999,
                eps,
                weight_decay: wd,
            },
            Optimizer::AdamW {
                lr: lr.min(0.5),
                beta1: 0.8,
                beta2: 0.99,
                eps,
                weight_decay: wd,
            },
            Optimizer::Ftrl {
                lr,
                l1: d.log(-4.0, -1.0),
                l2: d.log(-4.0, -1.0),
                beta: 0.0,
                initial_accumulator_value: d.log(-2.0, 0.0),
                weight_decay: wd,
            },
        ]
    }

    /// The soundness of the fast path: after every step the prediction let
    /// run in place, the rows measured are within the bounds (the bounds
    /// may only be too high), for every optimizer over random settings,
    /// values and gradients up to 1e6, with repeated keys.
    #[test]
    fn measured_magnitudes_never_exceed_the_bounds_after_a_step() {
        let mut d = Draw(7);
        let (mut applied, mut tight) = (0, 0);
        for round in 0..24 {
            for opt in optimizers(&mut d) {
                let mut cfg = TableConfig::new(8);
                cfg.optimizer = Some(opt);
                cfg.initializer = Initializer::Uniform {
                    low: -0.5,
                    high: 0.5,
                };
                cfg.num_shards = Some(4);
                let t = Table::new(cfg).unwrap();
                let scale = d.log(-3.0, 3.0) as f32;
                let keys: Vec<i64> = (0..200).map(|_| (d.next() % 64) as i64).collect();
                for step in 0..6 {
                    let gscale = d.log(-6.0, 6.0) as f32;
                    let grads: Vec<f32> = (0..keys.len() * 8)
                        .map(|_| ((d.next() % 2001) as f32 / 1000.0 - 1.0) * gscale)
                        .collect();
                    if step == 2 {
                        let vals: Vec<f32> = (0..64 * 8)
                            .map(|_| ((d.next() % 2001) as f32 / 1000.0 - 1.0) * scale)
                            .collect();
                        let ks: Vec<i64> = (0..64).collect();
                        t.assign(&ks, &vals).unwrap();
                    }
                    if t.apply_gradients(&keys, &grads).is_err() {
                        continue; // a refused step changes nothing
                    }
                    applied += 1;
                    let bound = t.bounds.get();
                    let _g = t.gate.write().unwrap();
                    let m = Stepper(&t).measure();
                    let what = format!("round {round}, {opt:?}, step {step}: {m:?} vs {bound:?}");
                    assert!(m.w <= bound.w, "weights past their bound: {what}");
                    assert!(m.s[0] <= bound.s[0], "state block 0 past its bound: {what}");
                    assert!(m.s[1] <= bound.s[1], "state block 1 past its bound: {what}");
                    assert!(
                        m.acc_min >= bound.acc_min,
                        "accumulator below its bound: {what}"
                    );
                    // Not vacuous: most bounds stay within 1e12 of the values.
                    tight += usize::from(bound.w <= 1e12 * m.w.max(1.0));
                }
            }
        }
        assert!(applied > 700, "only {applied} steps applied");
        assert!(
            tight * 10 > applied * 9,
            "bounds loose in {} of {applied}",
            applied - tight
        );
    }

    /// Long training with every optimizer and weight decay stays on the
    /// fast path: the predicted state bounds settle instead of growing
    /// into the range that sends every step to a full measurement.
    #[test]
    fn long_training_keeps_bounds_far_from_the_checked_range() {
        let mut d = Draw(11);
        for opt in optimizers(&mut d) {
            let opt = match opt {
                Optimizer::Sgd { .. } => Optimizer::Sgd {
                    lr: 0.05,
                    weight_decay: 0.01,
                },
                Optimizer::Adam { .. } => Optimizer::Adam {
                    lr: 1e-3,
                    beta1: 0.9,
                    beta2: 0.999,
                    eps: 1e-8,
                    weight_decay: 0.01,
                },
                o => o,
            };
            let mut cfg = TableConfig::new(8);
            cfg.optimizer = Some(opt);
            let t = Table::new(cfg).unwrap();
            let keys: Vec<i64> = (0..256).map(|i| i % 64).collect();
            for step in 0..3000 {
                let grads: Vec<f32> = (0..keys.len() * 8)
                    .map(|_| (d.next() % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                t.apply_gradients(&keys, &grads).unwrap();
                let m = t.magnitudes();
                let top = m.w.max(m.s[0]).max(m.s[1]);
                assert!(top < COMFORT / 1e6, "{opt:?} at step {step}: {m:?}");
            }
        }
    }

    #[test]
    fn bounds_round_outwards_and_only_move_outwards_when_raised() {
        let b = Bounds::new(Magnitudes {
            w: 0.1,
            s: [1.0 / 3.0, 0.0],
            acc_min: 0.1,
        });
        let m = b.get();
        assert!(
            m.w >= 0.1 && m.s[0] >= 1.0 / 3.0 && m.acc_min <= 0.1,
            "{m:?}"
        );
        b.raise(&Magnitudes {
            w: 0.01,
            s: [10.0, 2.0],
            acc_min: 1.0,
        });
        let r = b.get();
        assert_eq!(r.w, m.w, "a lower weight bound does not lower it");
        assert!(r.s[0] >= 10.0 && r.s[1] >= 2.0);
        assert_eq!(r.acc_min, m.acc_min, "a higher minimum does not raise it");
        assert_eq!(f32::from_bits(up(1e300)), f32::MAX);
    }
}
