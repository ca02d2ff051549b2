//! Fixtures of the crate's unit tests: small tables, optimizers and fresh
//! temporary directories.

use crate::optim::Optimizer;
use crate::table::{Table, TableConfig};
use std::sync::atomic::{AtomicU64, Ordering};

/// A table of `dim` columns, `shards` shards, seed 7 and `optimizer`.
pub(crate) fn table(dim: usize, shards: usize, optimizer: Option<Optimizer>) -> Table {
    let mut cfg = TableConfig::new(dim);
    cfg.optimizer = optimizer;
    cfg.seed = 7;
    cfg.num_shards = Some(shards);
    Table::new(cfg).unwrap()
}

/// SGD with learning rate `lr`.
pub(crate) fn sgd(lr: f64) -> Option<Optimizer> {
    Some(Optimizer::Sgd {
        lr,
        weight_decay: 0.0,
    })
}

/// A fresh directory under the system's temporary directory.
pub(crate) fn temp_dir(tag: &str) -> std::path::PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("embstore-unit-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
