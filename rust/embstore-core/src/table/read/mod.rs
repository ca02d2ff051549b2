//! Reading rows: the shard passes of a batch's plan (`batch/`), lookups (plain, with state, `contains`, the
//! export of every row), pooled lookups and the output buffers their passes
//! fill at once.

pub(crate) mod disk;
pub(crate) mod export;
pub(crate) mod lookup;
pub(crate) mod pooled;
pub(crate) mod pooling;
