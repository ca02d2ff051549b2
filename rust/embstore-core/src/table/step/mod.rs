//! Training steps (on the rows a call found earlier, `batch/found.rs`): a step's
//! preparation (its plan with room made for the rows it may create), the
//! step itself, the bounds that keep every step finite, the backward of
//! pooled lookups and the Collection step over several tables.

pub(crate) mod apply;
pub(crate) mod bounds;
pub mod collection;
pub(crate) mod pooled;
pub(crate) mod prepare;
