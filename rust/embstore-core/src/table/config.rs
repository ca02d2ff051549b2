//! How a [`Table`](super::Table) is built: [`TableConfig`].

use crate::init::Initializer;
use crate::optim::Optimizer;
use crate::policy::Policy;
use crate::simd::Backend;

/// How a [`Table`] is built.
#[derive(Debug, Clone)]
pub struct TableConfig {
    /// Columns per row (>= 1).
    pub dim: usize,
    /// The optimizer, or `None` for a table that is only read and assigned.
    pub optimizer: Option<Optimizer>,
    /// How new rows are filled.
    pub initializer: Initializer,
    /// Seed of the initializer's streams.
    pub seed: u64,
    /// Number of shards; `None` picks `(available_parallelism * 4).next_power_of_two()`.
    pub num_shards: Option<usize>,
    /// SIMD backend; `None` reads `EMBSTORE_SIMD` or picks the best supported.
    pub backend: Option<Backend>,
    /// Row format, admission and eviction.
    pub policy: Policy,
}

impl TableConfig {
    /// A config with defaults for everything but `dim`.
    pub fn new(dim: usize) -> Self {
        TableConfig {
            dim,
            optimizer: None,
            initializer: Initializer::default(),
            seed: 0,
            num_shards: None,
            backend: None,
            policy: Policy::default(),
        }
    }
}

/// The default number of shards: four per core, a power of two.
pub fn default_num_shards() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores * 4).next_power_of_two()
}
