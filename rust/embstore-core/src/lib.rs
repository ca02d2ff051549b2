//! # embstore-core
//!
//! Sharded hash tables from int64 feature ids to learned embedding rows and
//! their optimizer state, with SIMD sparse optimizers. No Python here: the
//! binding crate `embstore-py` wraps this crate as `embstore._core`.
//!
//! ## Model
//! A [`Table`] holds rows of `dim` floats plus `state_len` floats of optimizer
//! state per key, in shards chosen by a hash of the key. Every batch call
//! hashes its keys once, groups them by shard, and processes the shards in
//! parallel on rayon's pool, taking each shard's lock once.
//!
//! ## Consistency
//! Any number of threads may call any method at once. A row is read and
//! written only under its shard's lock: a reader sees a row wholly before or
//! wholly after an update, and no update is lost.
//!
//! ## Determinism
//! A new row's values are a pure function of (seed, key, column)
//! ([`init`]), and a step sums a key's duplicate gradients in batch order, so
//! results do not depend on the number of shards or threads.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod collection;
pub mod curve;
pub mod error;
pub mod hash;
pub mod init;
pub mod optim;
pub mod partition;
pub mod policy;
pub mod simd;
pub mod table;

pub use error::{Result, StoreError};
pub use init::Initializer;
pub use optim::Optimizer;
pub use policy::{Admission, Eviction, Policy, RowFormat};
pub use simd::Backend;
pub use table::{Bags, Combiner, Stats, Table, TableConfig};
