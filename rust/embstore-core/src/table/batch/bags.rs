//! CSR bags of ids, as `torch.nn.EmbeddingBag(include_last_offset=True)`
//! and TF's `embedding_lookup_sparse` take them ([`Bags`], [`Combiner`]):
//! their checks and each id's bag and coefficient ([`Coefs`]), shared by
//! the pooled lookups and their backward.

use crate::error::{Result, invalid};
use crate::table::checks::{check_finite, check_len, check_transient};
use crate::zeroed::with_room;
use crate::zeroed::zeros;
use std::borrow::Cow;

/// How a bag's rows are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Combiner {
    /// `sum_i w_i x_i`.
    Sum,
    /// `sum_i w_i x_i / sum_i w_i` (the plain mean without weights).
    Mean,
    /// `sum_i w_i x_i / sqrt(sum_i w_i^2)`.
    Sqrtn,
}

impl Combiner {
    /// The combiner named `name` ("sum", "mean", "sqrtn").
    ///
    /// # Errors
    /// `InvalidArgument` for any other name.
    pub fn from_name(name: &str) -> Result<Combiner> {
        match name {
            "sum" => Ok(Combiner::Sum),
            "mean" => Ok(Combiner::Mean),
            "sqrtn" => Ok(Combiner::Sqrtn),
            other => Err(invalid(
                "combiner",
                format!(
                    "expected one of {}; got {other:?}",
                    crate::vocab::one_of(crate::vocab::COMBINERS)
                ),
            )),
        }
    }
}

/// A batch of bags in CSR form: bag `b` holds `ids[offsets[b]..offsets[b + 1]]`.
#[derive(Debug, Clone, Copy)]
pub struct Bags<'a> {
    /// Ids of every bag, back to back (`nnz`).
    pub ids: &'a [i64],
    /// `batch + 1` offsets: start at 0, never decrease, end at `nnz`.
    pub offsets: &'a [i64],
    /// Optional per-id weights (`nnz`).
    pub weights: Option<&'a [f32]>,
    /// How each bag's rows are combined.
    pub combiner: Combiner,
}

/// Per-id bag and coefficient of a batch of bags.
pub(crate) struct Coefs {
    pub bag_of: Vec<u32>,
    pub coef: Vec<f32>,
}

impl Bags<'_> {
    /// Number of bags.
    pub fn batch(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    #[inline]
    pub(crate) fn range(&self, b: usize) -> std::ops::Range<usize> {
        self.offsets[b] as usize..self.offsets[b + 1] as usize
    }

    /// Checks the CSR structure and the weights.
    ///
    /// # Errors
    /// `InvalidArgument`/`ShapeMismatch`/`NonFinite` naming `offsets` or `weights`.
    pub fn validate(&self) -> Result<()> {
        let nnz = self.ids.len();
        if nnz > u32::MAX as usize {
            return Err(invalid(
                "ids",
                format!("expected at most 2^32 - 1 ids, got {nnz}"),
            ));
        }
        check_transient("ids", nnz)?;
        let Some(&first) = self.offsets.first() else {
            return Err(invalid(
                "offsets",
                "expected batch + 1 >= 1 offsets (include_last_offset=True), got an empty array",
            ));
        };
        if first != 0 {
            return Err(invalid(
                "offsets",
                format!("expected offsets[0] == 0, got {first}"),
            ));
        }
        if let Some(b) = self.offsets.windows(2).position(|w| w[1] < w[0]) {
            return Err(invalid(
                "offsets",
                format!(
                    "expected non-decreasing offsets, got offsets[{}] = {} > offsets[{}] = {}",
                    b,
                    self.offsets[b],
                    b + 1,
                    self.offsets[b + 1]
                ),
            ));
        }
        let last = self.offsets[self.offsets.len() - 1];
        if last != nnz as i64 {
            return Err(invalid(
                "offsets",
                format!("expected the last offset to equal len(ids) = {nnz}, got {last}"),
            ));
        }
        if let Some(w) = self.weights {
            check_len("weights", nnz, w.len())?;
            check_finite("weights", w)?;
        }
        Ok(())
    }

    /// Whether every bag holds exactly one id and there are no weights:
    /// then every coefficient is 1 (whatever the combiner) and bag `b` is
    /// id `b`. On validated bags.
    pub(crate) fn one_id_each(&self) -> bool {
        self.weights.is_none()
            && self.ids.len() == self.batch()
            && self.offsets.iter().enumerate().all(|(b, &o)| o == b as i64)
    }

    /// Each id's bag and coefficient `w_i / d_bag`.
    ///
    /// # Errors
    /// `OutOfMemory` naming `ids` when the two arrays cannot be had.
    pub(crate) fn coefs(&self) -> Result<Coefs> {
        let nnz = self.ids.len();
        let mut bag_of = zeros::<u32>("ids", nnz)?;
        let mut coef = zeros::<f32>("ids", nnz)?;
        self.coefs_into(&mut bag_of, &mut coef);
        Ok(Coefs { bag_of, coef })
    }

    /// Each id's bag and coefficient `w_i / d_bag`, as the pooled kernels
    /// use them (for a tier that pools on another device).
    ///
    /// # Errors
    /// `OutOfMemory` naming `ids` when the two arrays cannot fit in the
    /// memory available (checked before they are allocated).
    pub fn coefficients(&self) -> Result<(Vec<u32>, Vec<f32>)> {
        check_transient("ids", self.ids.len())?;
        let c = self.coefs()?;
        Ok((c.bag_of, c.coef))
    }

    /// [`Bags::coefs`] into caller-provided slices of `nnz` entries each.
    pub(crate) fn coefs_into(&self, bag_of: &mut [u32], coef: &mut [f32]) {
        let weight = |i: usize| self.weights.map_or(1.0, |w| w[i]);
        for b in 0..self.batch() {
            let r = self.range(b);
            bag_of[r.clone()].fill(b as u32);
            let denom = match self.combiner {
                Combiner::Sum => 1.0,
                Combiner::Mean => r.clone().map(weight).sum::<f32>(),
                Combiner::Sqrtn => r.clone().map(|i| weight(i) * weight(i)).sum::<f32>().sqrt(),
            };
            for i in r {
                coef[i] = if denom == 0.0 { 0.0 } else { weight(i) / denom };
            }
        }
    }
}

/// Checks that columns `col..col + dim` lie within rows of `stride`.
pub(crate) fn check_columns(stride: usize, col: usize, dim: usize) -> Result<()> {
    if dim == 0 || col.checked_add(dim).is_none_or(|end| end > stride) {
        return Err(invalid(
            "col",
            format!("expected columns {col}..{col} + {dim} within rows of {stride}"),
        ));
    }
    Ok(())
}

/// Checks that `arg` (of `len` floats) holds whole rows of `dim` and that
/// `idx` has one entry per id, each naming one of those rows.
pub(crate) fn check_idx(
    arg: &'static str,
    len: usize,
    dim: usize,
    idx: &[i64],
    bags: &Bags<'_>,
) -> Result<()> {
    if dim == 0 || !len.is_multiple_of(dim) {
        return Err(invalid(arg, "expected a whole number of rows"));
    }
    let n = len / dim;
    check_len("idx", bags.ids.len(), idx.len())?;
    if let Some(&bad) = idx.iter().find(|&&r| r < 0 || r as usize >= n) {
        return Err(invalid(
            "idx",
            format!("expected 0 <= idx < {n}, got {bad}"),
        ));
    }
    Ok(())
}

/// The ids of `feats` one after another: those of one feature as they
/// are, of several copied into one list (a Collection's table serving
/// several features plans them together).
///
/// # Errors
/// `OutOfMemory` naming `ids`.
pub(crate) fn pooled_ids<'a>(feats: &[(Bags<'a>, usize)]) -> Result<Cow<'a, [i64]>> {
    Ok(match feats {
        [(bags, _)] => bags.ids.into(),
        _ => {
            let n = feats.iter().map(|(b, _)| b.ids.len()).sum();
            let mut all = with_room("ids", n)?;
            all.extend(feats.iter().flat_map(|(b, _)| b.ids.iter().copied()));
            all.into()
        }
    })
}
