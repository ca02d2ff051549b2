//! Grouped pooled calls over several tables in one native call.

use std::sync::Arc;

use embstore_core::collection::{self, Feature};
use embstore_core::{Bags, Table};
use numpy::{PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::exceptions::{PyMemoryError, PyValueError};
use pyo3::prelude::*;

use crate::runtime::EnterStore;
use crate::store::{PyTable, bags};

type Ids<'py> = Vec<PyReadonlyArray1<'py, i64>>;
type Weights<'py> = Vec<Option<PyReadonlyArray1<'py, f32>>>;

/// Borrows every feature's arrays; checks the lists have one entry per table.
fn features<'a>(
    tables: &[Arc<Table>],
    ids: &'a Ids<'_>,
    offsets: &'a Ids<'_>,
    weights: &'a Weights<'_>,
    combiners: &[String],
    names: Option<&[String]>,
) -> PyResult<Vec<Bags<'a>>> {
    let n = tables.len();
    if ids.len() != n
        || offsets.len() != n
        || weights.len() != n
        || combiners.len() != n
        || names.is_some_and(|m| m.len() != n)
    {
        return Err(PyValueError::new_err(format!(
            "features: expected {n} ids, offsets, weights, combiners and names, one per table"
        )));
    }
    (0..n)
        .map(|i| {
            let b = bags(&ids[i], &offsets[i], weights[i].as_ref(), &combiners[i])?;
            // Checked here too, so that the error names the feature.
            b.validate().map_err(|e| {
                let name = names.map_or_else(|| format!("feature {i}"), |m| format!("{:?}", m[i]));
                let msg = format!("batch[{name}] {e}");
                // The exception type is the error's (MemoryError for memory),
                // only the message gains the feature's name.
                match e {
                    embstore_core::StoreError::OutOfMemory { .. } => PyMemoryError::new_err(msg),
                    _ => PyValueError::new_err(msg),
                }
            })?;
            Ok(b)
        })
        .collect()
}

fn zip<'a>(tables: &'a [Arc<Table>], bags: &[Bags<'a>]) -> Vec<Feature<'a>> {
    tables
        .iter()
        .zip(bags)
        .map(|(t, b)| Feature { table: t, bags: *b })
        .collect()
}

/// Pooled rows of every feature side by side: (batch, sum of dims).
#[pyfunction]
#[pyo3(signature = (tables, ids, offsets, weights, combiners, insert=true, names=None, missing="init"))]
#[allow(clippy::too_many_arguments)]
pub fn collection_lookup_pooled<'py>(
    py: Python<'py>,
    tables: Vec<PyRef<'py, PyTable>>,
    ids: Ids<'py>,
    offsets: Ids<'py>,
    weights: Weights<'py>,
    combiners: Vec<String>,
    insert: bool,
    names: Option<Vec<String>>,
    missing: &str,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let missing = crate::convert::missing(missing, None)?;
    let tables: Vec<Arc<Table>> = tables.iter().map(|t| t.inner.clone()).collect();
    let bags = features(
        &tables,
        &ids,
        &offsets,
        &weights,
        &combiners,
        names.as_deref(),
    )?;
    let batch = bags.first().map_or(0, |b| b.batch());
    let total: usize = tables.iter().map(|t| t.dim()).sum();
    let out = crate::outbuf::array2(py, batch, total, "offsets")?;
    {
        let mut rw = out.readwrite();
        let dst = rw.as_slice_mut()?;
        let feats = zip(&tables, &bags);
        let t0 = std::time::Instant::now();
        py.enter_store(|| collection::lookup_pooled_or(&feats, insert, missing, dst))?;
        // Each table's histogram counts the call that read it, at the
        // call's latency.
        let took = t0.elapsed();
        for (i, t) in tables.iter().enumerate() {
            if !tables[..i].iter().any(|u| Arc::ptr_eq(t, u)) {
                t.lookup_latency().record(took);
            }
        }
    }
    Ok(out)
}

/// Backward of [`collection_lookup_pooled`] and one step per distinct table.
#[pyfunction]
#[pyo3(signature = (tables, ids, offsets, weights, combiners, grads, names=None))]
#[allow(clippy::too_many_arguments)]
pub fn collection_apply_pooled_gradients<'py>(
    py: Python<'py>,
    tables: Vec<PyRef<'py, PyTable>>,
    ids: Ids<'py>,
    offsets: Ids<'py>,
    weights: Weights<'py>,
    combiners: Vec<String>,
    grads: PyReadonlyArray2<'py, f32>,
    names: Option<Vec<String>>,
) -> PyResult<()> {
    let tables: Vec<Arc<Table>> = tables.iter().map(|t| t.inner.clone()).collect();
    let bags = features(
        &tables,
        &ids,
        &offsets,
        &weights,
        &combiners,
        names.as_deref(),
    )?;
    let g = grads
        .as_slice()
        .map_err(|_| PyValueError::new_err("grads: expected a C-contiguous array"))?;
    let feats = zip(&tables, &bags);
    py.enter_store(|| collection::apply_pooled_gradients(&feats, g))
}
