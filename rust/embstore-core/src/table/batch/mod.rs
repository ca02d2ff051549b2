//! What a batch call is made of, whether it reads rows or trains them: the
//! plan (a batch's keys grouped by shard, [`plan`]), the rows found in an
//! earlier phase ([`found`]), the output buffers many shard passes fill at
//! once ([`output`]) and CSR bags ([`bags`]). Reading (`read/`) and
//! stepping (`step/`) both speak it and import nothing of each other.

pub(crate) mod bags;
pub(crate) mod found;
pub(crate) mod output;
pub(crate) mod plan;

/// Rows each shard made room for (by shard), before a call changes
/// anything: an inserting lookup's or a step's reservation.
pub(crate) type Reserved = Vec<usize>;
