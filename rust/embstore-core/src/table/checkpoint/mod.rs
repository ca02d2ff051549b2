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
//! table's last save to the same directory. Loading replays the chain.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use rayon::prelude::*;
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo, TensorView};
use serde::{Deserialize, Serialize};

use super::dirlock::{self, READERS_LOCK};
use super::untrusted;
use super::{Table, TableConfig, read};
use crate::error::{Result, StoreError, ckpt_err};
use crate::hash::mix64;
use crate::init::Initializer;
use crate::optim::Optimizer;
use crate::policy::{Admission, Eviction, Policy, RowFormat};

mod files;
mod load;
mod manifest;
mod publish;
mod report;
mod save;
mod tensors;

pub use super::dirlock::DirLock;
pub use files::new_id;
use files::*;
pub use load::{FileCheck, verify};
pub use manifest::*;
use publish::*;
pub use publish::{hold_for_reading, lock_for_writing, publish_parts, remove_partial};
pub use report::{Report, report};
use tensors::*;
