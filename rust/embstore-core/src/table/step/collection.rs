//! Grouped pooled lookups: many features, each a batch of bags over its
//! table, served in one call and one parallel pass. Features may share a
//! table; a shared table takes one optimizer step per call, over the
//! gradients of all the features that use it.

use crate::Bags;
use crate::error::{Result, StoreError, invalid};
use crate::simd::prefetch;
use crate::table::batch::bags::pooled_ids;
use crate::table::batch::output::SharedOut;
use crate::table::batch::plan::{Floor, SEQUENTIAL_KEYS};
use crate::table::checks::{check_finite_max, check_grad_sums, check_len};
use crate::table::views::{Evictor, Pooler, Stepper};
use crate::table::{Missing, Table};
use crate::zeroed::zeros;
use rayon::prelude::*;
use std::borrow::Cow;

/// One feature of a grouped call: its table and its bags.
#[derive(Debug, Clone, Copy)]
pub struct Feature<'a> {
    /// The table serving this feature.
    pub table: &'a Table,
    /// This feature's bags; every feature of a call has the same batch.
    pub bags: Bags<'a>,
}

/// Checks every feature and returns (batch, total columns).
fn check(features: &[Feature<'_>]) -> Result<(usize, usize)> {
    let Some(first) = features.first() else {
        return Err(invalid("features", "expected at least one feature"));
    };
    let batch = first.bags.batch();
    for f in features {
        f.bags.validate()?;
        if f.bags.batch() != batch {
            return Err(invalid(
                "offsets",
                format!(
                    "expected every feature to have the same batch size {batch}, got {}",
                    f.bags.batch()
                ),
            ));
        }
    }
    Ok((batch, features.iter().map(|f| f.table.dim()).sum()))
}

/// Each feature's first column in the wide output.
fn columns(features: &[Feature<'_>]) -> Vec<usize> {
    features
        .iter()
        .scan(0, |c, f| {
            let col = *c;
            *c += f.table.dim();
            Some(col)
        })
        .collect()
}

/// The distinct tables of `features`, in the crate's lock order (ascending
/// [`Table::id`]), each with the indices of the features that use it.
fn groups<'a>(features: &[Feature<'a>]) -> Vec<(&'a Table, Vec<usize>)> {
    let mut out: Vec<(&Table, Vec<usize>)> = Vec::new();
    for (i, f) in features.iter().enumerate() {
        match out.iter_mut().find(|(t, _)| std::ptr::eq(*t, f.table)) {
            Some((_, idx)) => idx.push(i),
            None => out.push((f.table, vec![i])),
        }
    }
    out.sort_by_key(|(t, _)| t.id());
    out
}

/// Pooled rows of every feature into `out` (`batch * sum of dims`), feature
/// after feature along each row.
///
/// # Errors
/// Bad CSR input, differing batch sizes, a wrong `out` length; nothing changed.
pub fn lookup_pooled(features: &[Feature<'_>], insert: bool, out: &mut [f32]) -> Result<()> {
    lookup_pooled_or(features, insert, Missing::Init, out)
}

/// [`lookup_pooled`] whose ids without a row (not inserted) pool `missing`
/// ([`Missing::Init`] or [`Missing::Zeros`]: the features' tables may differ
/// in width, so a given row is refused).
///
/// # Errors
/// As [`lookup_pooled`]; a [`Missing::Row`].
pub fn lookup_pooled_or(
    features: &[Feature<'_>],
    insert: bool,
    missing: Missing<'_>,
    out: &mut [f32],
) -> Result<()> {
    if let Missing::Row(_) = missing {
        return Err(invalid(
            "default",
            "a Collection takes \"init\" or \"zeros\" (its tables may differ in width)",
        ));
    }
    let (batch, total) = check(features)?;
    check_len("out", batch * total, out.len())?;
    let cols = columns(features);
    // Gates are taken here, on the calling thread, never inside a job, in
    // the crate's one order (tables by id; see `Table::id`).
    let groups = groups(features);
    let min_len = split_at(features);
    // Each table's features and their ids, planned (in parallel) and on
    // the table's floor (in table order), before any gate.
    let feats: Vec<Vec<(Bags<'_>, usize)>> = groups
        .iter()
        .map(|(_, idx)| {
            idx.iter()
                .map(|&fi| (features[fi].bags, cols[fi]))
                .collect()
        })
        .collect();
    let ids: Vec<Cow<'_, [i64]>> = feats.iter().map(|f| pooled_ids(f)).collect::<Result<_>>()?;
    let keyed: Vec<(&Table, &[i64])> = groups
        .iter()
        .zip(&ids)
        .map(|((t, _), ids)| (*t, &ids[..]))
        .collect();
    let made = keyed.iter().map(|_| None).collect();
    let (plans, _floor) = Table::plan_many(&keyed, made, Floor::Read, min_len)?;
    let gates: Vec<_> = groups
        .iter()
        .filter(|(t, _)| t.lookup_changes(insert))
        .map(|(t, _)| t.enter())
        .collect();
    let shared = SharedOut::strided(out, total, 0);
    // One pass per distinct table over all the features it serves.
    keyed
        .par_iter()
        .zip(&feats)
        .zip(plans)
        .with_min_len(min_len)
        .map(|(((table, ids), feats), plan)| {
            Pooler(table).lookup_pooled_in(feats, ids, plan, insert, missing, shared)
        })
        .collect::<Result<Vec<()>>>()?;
    if insert {
        for (t, _) in &groups {
            Evictor(t).enforce_capacity();
        }
    }
    drop(gates);
    Ok(())
}

/// The least number of tables or features a job of a Collection call's
/// parallel loops takes: all of them (no split, so no dispatch to the
/// pool, which costs more than the work) when the call's ids are few
/// enough for one thread ([`SEQUENTIAL_KEYS`]); one otherwise.
fn split_at(features: &[Feature<'_>]) -> usize {
    let ids: usize = features.iter().map(|f| f.bags.ids.len()).sum();
    if ids <= SEQUENTIAL_KEYS {
        usize::MAX
    } else {
        1
    }
}

/// The backward of [`lookup_pooled`] and one optimizer step per distinct
/// table; `grads` has the layout of the forward's output.
///
/// # Errors
/// `NoOptimizer` for a table without one, bad CSR input, a wrong `grads`
/// length, non-finite values; nothing changed.
pub fn apply_pooled_gradients(features: &[Feature<'_>], grads: &[f32]) -> Result<()> {
    let (batch, total) = check(features)?;
    if features.iter().any(|f| f.table.optimizer().is_none()) {
        return Err(StoreError::NoOptimizer);
    }
    check_len("grads", batch * total, grads.len())?;
    let most = check_finite_max("grads", grads)?;
    let cols = columns(features);
    let groups = groups(features);
    // Every table's ids, gradient offsets and coefficients.
    let min_len = split_at(features);
    let inputs: Vec<(Vec<i64>, Vec<usize>, Vec<f32>)> = groups
        .par_iter()
        .with_min_len(min_len)
        .map(|(_, idx)| -> Result<_> {
            // Every id of every feature on this table, with the flat offset of
            // its bag's gradient row and its coefficient; each feature fills its
            // own part, in parallel.
            let n: usize = idx.iter().map(|&fi| features[fi].bags.ids.len()).sum();
            let mut keys = zeros::<i64>("ids", n)?;
            let mut src = zeros::<usize>("ids", n)?;
            let mut coef = zeros::<f32>("ids", n)?;
            let mut parts = Vec::with_capacity(idx.len());
            let (mut k, mut s, mut c) = (&mut keys[..], &mut src[..], &mut coef[..]);
            for &fi in idx {
                let len = features[fi].bags.ids.len();
                let (k0, k1) = std::mem::take(&mut k).split_at_mut(len);
                let (s0, s1) = std::mem::take(&mut s).split_at_mut(len);
                let (c0, c1) = std::mem::take(&mut c).split_at_mut(len);
                parts.push((fi, k0, s0, c0));
                (k, s, c) = (k1, s1, c1);
            }
            parts.into_par_iter().with_min_len(min_len).try_for_each(
                |(fi, k, s, c)| -> Result<()> {
                    let bags = &features[fi].bags;
                    k.copy_from_slice(bags.ids);
                    let mut bag_of = zeros::<u32>("ids", k.len())?;
                    bags.coefs_into(&mut bag_of, c);
                    for (dst, &b) in s.iter_mut().zip(&bag_of) {
                        *dst = b as usize * total + cols[fi];
                    }
                    Ok(())
                },
            )?;
            Ok((keys, src, coef))
        })
        .collect::<Result<_>>()?;
    let mut sums = Vec::with_capacity(groups.len());
    for ((table, _), (keys, src, coef)) in groups.iter().zip(&inputs) {
        let dim = table.dim();
        let max_coef = coef.iter().fold(0.0f32, |a, c| a.max(c.abs()));
        sums.push(check_grad_sums(
            "grads",
            keys,
            f64::from(most * max_coef),
            |i| {
                let g = grads[src[i]..src[i] + dim]
                    .iter()
                    .fold(0.0f32, |a, v| a.max(v.abs()));
                f64::from(g) * f64::from(coef[i].abs())
            },
        )?);
    }
    // Every table's plan on its floor (`Stepper::plan_steps`), then the
    // gates, in ascending table id (each shared, or exclusive for a step
    // its bounds cannot clear: see `table::step::bounds`).
    let keyed: Vec<(&Table, &[i64])> = groups
        .iter()
        .zip(&inputs)
        .map(|((t, _), (keys, _, _))| (*t, &keys[..]))
        .collect();
    let (plans, _floor) = Stepper::plan_steps(&keyed, min_len)?;
    let gates: Vec<_> = groups
        .iter()
        .zip(&sums)
        .map(|((t, _), &gs)| Stepper(t).step_gate(gs, t.step() + 1))
        .collect();
    // Room for every table's new rows first, and the dry runs of the steps
    // that need one, so that running out of memory or a non-finite result
    // refuses the call whole; then every table's step.
    let mut prepared = Vec::with_capacity(groups.len());
    let mut measured = Vec::with_capacity(groups.len());
    let mut failed = None;
    let mut plans = plans.into_iter();
    for (((table, _), (keys, src, coef)), gate) in groups.iter().zip(&inputs).zip(&gates) {
        let dim = table.dim();
        let (plan, found) = plans.next().expect("a plan a table");
        match Stepper(table).prepare_apply(keys, true, plan, found) {
            Ok(p) => prepared.push(p),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
        if gate.needs_dry_run() {
            let grad_of = |i: usize| (&grads[src[i]..src[i] + dim], coef[i]);
            match Stepper(table).dry_run(keys, table.step() + 1, grad_of) {
                Ok(m) => measured.push(Some(m)),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        } else {
            measured.push(None);
        }
    }
    if let Some(e) = failed {
        for ((t, _), p) in groups.iter().zip(prepared) {
            Stepper(t).cancel_apply(p);
        }
        return Err(e);
    }
    let written: Vec<Option<f64>> = groups
        .par_iter()
        .zip(inputs.par_iter())
        .zip(prepared.into_par_iter())
        .with_min_len(min_len)
        .map(|(((table, _), (keys, src, coef)), p)| {
            let dim = table.dim();
            Stepper(table).run_apply(
                keys,
                p,
                None,
                |i| (&grads[src[i]..src[i] + dim], coef[i]),
                |i| {
                    prefetch(&src[i..=i]);
                    prefetch(&coef[i..=i]);
                },
            )
        })
        .collect();
    for ((((t, _), gate), m), w) in groups.iter().zip(gates).zip(measured).zip(written) {
        Evictor(t).enforce_capacity();
        Stepper(t).end_step(gate, m, w);
    }
    Ok(())
}
