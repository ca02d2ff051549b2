//! `embstore._core`: the thin PyO3 binding of `embstore-core`. It converts
//! arguments, releases the GIL around every O(n) call, maps errors to Python
//! exceptions, and does nothing else.

mod collection;
mod convert;
mod distributed;
mod error;
mod mapped;
mod outbuf;
mod replica;
mod runtime;
mod slots;
mod store;
mod strings;

use pyo3::prelude::*;

/// The native module.
#[pymodule(gil_used = false)]
mod _core {
    use std::collections::HashMap;

    use embstore_core::Backend;
    use pyo3::prelude::*;

    #[pymodule_export]
    use crate::collection::{collection_apply_pooled_gradients, collection_lookup_pooled};
    #[pymodule_export]
    use crate::distributed::{
        PyDirectoryHold, bag_coefficients, check_bags, checkpoint_manifest_text, hold_directory,
        load_table_owned, new_checkpoint_id, partition_owners, plan_exchange, pool_rows,
        pool_rows_into, spread_pooled, spread_pooled_add, unique_inverse,
    };
    #[pymodule_export]
    use crate::error::{CheckpointError, EmbstoreError};
    #[pymodule_export]
    use crate::mapped::PyMappedTable;
    #[pymodule_export]
    use crate::replica::{crc32c, manifest_files, publish_copied};
    #[pymodule_export]
    use crate::slots::{PySlotMap, staging_bytes};
    #[pymodule_export]
    use crate::store::{PyProgress, PyTable, checkpoint_report, load_table};
    #[pymodule_export]
    use crate::strings::{hash_fixed_bytes, hash_objects, hash_ucs4};

    /// Names of the SIMD backends this CPU supports, scalar first.
    #[pyfunction]
    fn simd_backends() -> Vec<&'static str> {
        Backend::available()
            .into_iter()
            .map(Backend::name)
            .collect()
    }

    /// Whether optimizer steps round 8-bit rows stochastically (the
    /// default) or to nearest (`EMBSTORE_INT8_ROUNDING=nearest`), as this
    /// process's tables do: a tier that trains 8-bit rows itself rounds
    /// them the same way.
    #[pyfunction]
    fn int8_stochastic_steps() -> bool {
        embstore_core::policy::RowFormat::stochastic_steps()
    }

    /// Validates an optimizer's parameters (ValueError naming the bad one).
    #[pyfunction]
    fn check_optimizer(name: &str, params: HashMap<String, f64>) -> PyResult<()> {
        crate::convert::optimizer(name, &params).map(|_| ())
    }

    /// Validates an initializer's parameters (ValueError naming the bad one).
    #[pyfunction]
    fn check_initializer(name: &str, params: HashMap<String, f64>) -> PyResult<()> {
        crate::convert::initializer(name, &params).map(|_| ())
    }

    /// Validates an admission filter's parameters (ValueError naming the bad one).
    #[pyfunction]
    fn check_admission(name: &str, params: HashMap<String, f64>) -> PyResult<()> {
        crate::convert::admission(name, &params).map(|_| ())
    }

    /// The float32 constants of step number `t` of an optimizer, as the
    /// native kernels use them (`Optimizer::step_consts`), for the device
    /// cache's array-API formulas: {"lr", "eps", "one_minus_b1",
    /// "one_minus_b2", "b2", "step_size", "bc2_sqrt", "decay", "l1",
    /// "l2_total", "weight_decay"}, those the optimizer has.
    #[pyfunction]
    fn optimizer_constants(
        name: &str,
        params: HashMap<String, f64>,
        t: u64,
    ) -> PyResult<HashMap<&'static str, f32>> {
        use embstore_core::optim::StepConsts;
        let opt = crate::convert::optimizer(name, &params)?;
        let mut c: HashMap<&'static str, f32> = HashMap::new();
        c.insert("weight_decay", opt.coupled_decay() as f32);
        match opt.step_consts(t.max(1)) {
            StepConsts::Sgd(lr) => {
                c.insert("lr", lr);
            }
            StepConsts::Adagrad(lr, eps) | StepConsts::RowWiseAdagrad(lr, eps) => {
                c.insert("lr", lr);
                c.insert("eps", eps);
            }
            StepConsts::Adam(p) => {
                c.extend([
                    ("one_minus_b1", p.one_minus_b1),
                    ("one_minus_b2", p.one_minus_b2),
                    ("step_size", p.step_size),
                    ("eps", p.eps),
                ]);
            }
            StepConsts::AdamW(p) => {
                c.extend([
                    ("decay", p.decay),
                    ("one_minus_b1", p.one_minus_b1),
                    ("b2", p.b2),
                    ("one_minus_b2", p.one_minus_b2),
                    ("step_size", p.step_size),
                    ("bc2_sqrt", p.bc2_sqrt),
                    ("eps", p.eps),
                ]);
            }
            StepConsts::Ftrl(p) => {
                c.extend([("lr", p.lr), ("l1", p.l1), ("l2_total", p.l2_total)]);
            }
        }
        Ok(c)
    }

    /// The LRU stack distance of every access of a key stream (-1 for a
    /// key's first access); see `embstore.gpu.cache_curve`.
    #[pyfunction]
    fn lru_stack_distances<'py>(
        py: Python<'py>,
        keys: numpy::PyReadonlyArray1<'py, i64>,
    ) -> PyResult<Bound<'py, numpy::PyArray1<i64>>> {
        use numpy::IntoPyArray;
        let k = keys.as_slice().map_err(|_| {
            pyo3::exceptions::PyValueError::new_err("keys: expected a contiguous 1-D int64 array")
        })?;
        let d = py.detach(|| embstore_core::curve::lru_stack_distances(k));
        Ok(d.into_pyarray(py))
    }

    /// Gives the kept output buffers back to the OS; returns their bytes.
    #[pyfunction]
    fn free_output_buffers() -> usize {
        crate::outbuf::free_all()
    }

    /// The output buffer pool: (buffers kept, bytes kept, most buffers, most bytes).
    #[pyfunction]
    fn output_buffer_stats() -> (usize, usize, usize, usize) {
        crate::outbuf::stats()
    }

    /// (bytes of every file, rows) of the checkpoint at `path`: its manifest
    /// read natively, with the loader's checks and size limit.
    #[pyfunction]
    fn checkpoint_size(py: Python<'_>, path: std::path::PathBuf) -> PyResult<(u64, u64)> {
        use crate::runtime::EnterStore;
        py.enter_store(|| {
            embstore_core::table::checkpoint::read_manifest(&path)
                .map(|m| (m.total_bytes(), m.rows))
        })
    }

    /// Removes the files of an unpublished save whose names start with
    /// `prefix` (a rank's part of a sharded save that did not publish).
    #[pyfunction]
    fn remove_unpublished(path: std::path::PathBuf, prefix: &str) {
        embstore_core::table::checkpoint::remove_partial(&path, prefix);
    }

    /// Every name, parameter and default the core accepts
    /// (`embstore_core::vocab`): {"optimizers" | "initializers" |
    /// "admissions": {name: [(param, default or None, integer)]},
    /// "dtypes" | "evictions" | "combiners" | "partitions": [name]}.
    #[pyfunction]
    fn vocabulary(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
        use embstore_core::vocab;
        use pyo3::types::PyDict;
        let d = PyDict::new(py);
        for (kind, list) in [
            ("optimizers", vocab::OPTIMIZERS),
            ("initializers", vocab::INITIALIZERS),
            ("admissions", vocab::ADMISSIONS),
        ] {
            let by_name = PyDict::new(py);
            for n in list {
                let params: Vec<(&str, Option<f64>, bool)> = n
                    .params
                    .iter()
                    .map(|p| (p.name, p.default, p.integer))
                    .collect();
                by_name.set_item(n.name, params)?;
            }
            d.set_item(kind, by_name)?;
        }
        d.set_item("dtypes", vocab::DTYPES)?;
        d.set_item("evictions", vocab::EVICTIONS)?;
        d.set_item("combiners", vocab::COMBINERS)?;
        d.set_item("partitions", vocab::PARTITIONS)?;
        Ok(d)
    }

    /// Number of threads of the native pool.
    #[pyfunction]
    fn num_threads() -> PyResult<usize> {
        crate::runtime::in_pool(rayon::current_num_threads).map_err(crate::runtime::no_pool)
    }

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        crate::runtime::PARENT_PID.get_or_init(std::process::id);
        crate::runtime::install_fork_handlers();
        crate::runtime::start_global_pool()?;
        // A disk table's background work runs inside the call lock, so
        // that a fork() waits for it.
        embstore_core::table::set_background_runner(crate::runtime::in_call);
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        Ok(())
    }
}
