//! Reading rows: the plan of a batch (its keys grouped by shard) and the
//! shard passes that run it, lookups (plain, with state, `contains`, the
//! export of every row), pooled lookups and the output buffers their passes
//! fill at once.

pub(crate) mod export;
pub(crate) mod lookup;
pub(crate) mod output;
pub(crate) mod plan;
pub(crate) mod pooled;
pub(crate) mod pooling;
