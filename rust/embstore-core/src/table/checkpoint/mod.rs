//! Checkpoints: a directory holding a JSON manifest and shard files in the
//! safetensors format (readable by NumPy/torch without embstore).
//!
//! Publishing is crash-safe: a save writes new files under names no earlier
//! manifest uses, fsyncs them, then writes the manifest to a temporary name,
//! fsyncs it and renames it over `manifest.json` (and fsyncs the
//! directory). Until that rename the previous manifest and every file it
//! names are untouched; after it, the new ones are complete. Files no
//! manifest names any more are deleted after the rename.
//!
//! Loading never executes anything: it parses JSON and safetensors headers,
//! checks the manifest's own checksum, every file's size and CRC-32C, and
//! every tensor's dtype and shape, all before the first row is inserted.
//!
//! An incremental save appends a delta to the manifest's chain: the rows
//! changed (inserted, assigned or trained) and the keys removed since the
//! table's last save to the same directory. A table keeps a mark per path
//! (up to eight), so incremental chains at two paths (serving publishes
//! and training checkpoints) go on side by side. Chains stay bounded: past
//! eight deltas an incremental save writes one delta of every change since
//! the chain's full link in their place, and once the deltas hold half the
//! base's rows it writes a full checkpoint (`save::Kind`). Each is
//! published like any save, so a reader or a crash always finds a whole
//! checkpoint. Loading replays the chain.

pub(crate) mod adopt;
pub(crate) mod load;
pub(crate) mod publish;
pub(crate) mod report;
pub(crate) mod save;
pub(crate) mod write;

pub use crate::format::dirlock::{DirLock, READ_WAIT, reader_within as lock_for_reading};
pub use crate::format::files::new_id;
pub use crate::format::manifest::{
    FORMAT, FileEntry, Link, MANIFEST, Manifest, NamedConfig, PartitionRecord, SaveInfo, VERSION,
    VERSION_PLAIN, parse_manifest, read_manifest, read_manifest_text,
};
pub use load::{FileCheck, LoadConfig, verify};
pub use publish::{
    hold_for_reading, lock_for_writing, publish_copied, publish_parts, remove_partial,
};
pub use report::{Report, report};
