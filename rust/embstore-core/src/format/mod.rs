//! The checkpoint's file format, apart from any table: the manifest
//! (`manifest.json`: the chain of links and the files each names), the
//! shard files (safetensors with a hash index of their keys,
//! [`file_index`]; where their columns lie, [`columns`], the one reader of
//! that layout), the row codec ([`codec::RowFormat`]), the directory's locks
//! ([`dirlock`]) and the one way an untrusted directory's files are opened
//! ([`untrusted`], [`files`]).
//!
//! A checkpoint directory is untrusted input: every reader here bounds what
//! it reads, opens plain names only (no link, no path outside the
//! directory), and checks checksums before it hands anything on. The
//! writers of a table (`table::checkpoint`: save, load, publish) and the
//! mapped reader (`mapped`) both stand on this module; it names neither.

pub mod codec;
pub(crate) mod columns;
pub(crate) mod direct;
pub(crate) mod dirlock;
pub(crate) mod file_index;
pub(crate) mod files;
pub(crate) mod manifest;
pub(crate) mod tensors;
pub(crate) mod untrusted;

/// The largest step count a table reaches, and a manifest may record (`i64::MAX`: steps travel as
/// signed 64-bit integers through MPI and JSON readers). A gradient call on
/// a table at this step is refused instead of wrapping to 0.
pub const MAX_STEP: u64 = i64::MAX as u64;

/// The most shards a table may have (and a file's header may name).
pub const MAX_SHARDS: usize = 1 << 16;
