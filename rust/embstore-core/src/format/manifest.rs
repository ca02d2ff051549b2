//! The manifest: its schema (serde), its checksum and its checks, and
//! reading it from a directory.

use crate::error::{Result, ckpt_err};
use crate::format::MAX_STEP;
use crate::format::codec::RowFormat;
pub use crate::format::files::FileEntry;
use crate::format::files::read_regular;
use crate::format::untrusted;
use crate::init::Initializer;
use crate::optim::Optimizer;
use crate::policy::Policy;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The format name in every manifest.
pub const FORMAT: &str = "embstore-checkpoint";
/// The newest format version this build reads: 2 adds a checkpoint's
/// [`PartitionRecord`] (a sharded table's), and only a manifest holding
/// one is written as 2, so every other checkpoint stays readable by builds
/// that read version 1 (a newer version is refused by name, where an
/// unknown field would read as a checksum mismatch).
pub const VERSION: u32 = 2;
/// The version of a manifest without a partition.
pub const VERSION_PLAIN: u32 = 1;
/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// Rows per shard file are capped so that one file's bytes stay near this.
pub(crate) const FILE_BYTES: usize = 256 << 20;
/// The largest manifest a load accepts.
pub(crate) const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// A named configuration (optimizer or initializer) in a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NamedConfig {
    /// Class name, as in `embstore.optim` / `embstore.init`.
    pub name: String,
    /// Every parameter.
    pub params: BTreeMap<String, f64>,
}

/// A link of the chain: a full snapshot or a delta on top of the previous links.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// "full" or "delta".
    pub kind: String,
    /// Shard files of rows (keys, rows, and state when saved with it).
    pub files: Vec<FileEntry>,
    /// For a delta: the file of keys removed since the previous link.
    pub removed: Option<FileEntry>,
}

/// The manifest of a checkpoint directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Format version; a reader refuses a newer one.
    pub version: u32,
    /// Unique id of this manifest (names its files).
    pub id: String,
    /// Columns per row.
    pub dim: usize,
    /// Row dtype.
    pub dtype: String,
    /// Floats of optimizer state per row in the files (0 without state).
    pub state_len: usize,
    /// Names of the state blocks.
    pub state_names: Vec<String>,
    /// The optimizer, if the table has one.
    pub optimizer: Option<NamedConfig>,
    /// The initializer.
    pub initializer: NamedConfig,
    /// Initializer seed.
    pub seed: u64,
    /// Optimizer steps taken.
    pub step: u64,
    /// Shards of the table that saved (informational; any count loads).
    pub num_shards: usize,
    /// Whether the files hold optimizer state.
    pub with_optimizer: bool,
    /// Rows after replaying the chain.
    pub rows: u64,
    /// Full snapshot, then deltas.
    pub chain: Vec<Link>,
    /// The memory policy, when the table's differs from the default
    /// ([`Policy`]'s serde form, its row format being `dtype`). When
    /// present and keeping per-row metadata, the row files also hold a
    /// `meta` tensor (u32, 4 per row).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<Policy>,
    /// The table's call clock (LRU recency of the rows' metadata).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub clock: u64,
    /// How the keys were spread over the ranks that saved it (a sharded
    /// table's checkpoint; version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<PartitionRecord>,
    /// CRC-32C of the manifest's canonical JSON without this field.
    #[serde(default)]
    pub checksum: Option<u32>,
}

/// How a sharded table spread its keys over its ranks, as its checkpoint
/// records it: a partition ([`crate::partition::Partition`]: "hash", "mod"
/// or "div" over `key_space` keys; or "bucket": keys hashed into buckets,
/// each bucket's rank in `buckets`) over `world_size` ranks, in the
/// record's own `version` (1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartitionRecord {
    /// "hash", "mod" or "div".
    pub kind: String,
    /// Keys lie in `[0, key_space)` ("div" only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_space: Option<i64>,
    /// Ranks the keys were spread over.
    pub world_size: u64,
    /// The record's version (1).
    pub version: u32,
    /// Kind "bucket": the rank of each bucket, a key's bucket being its
    /// "hash" owner among `buckets.len()` (moved whole by a reshard).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buckets: Option<Vec<u32>>,
}

impl PartitionRecord {
    /// Checks the record: a known kind, a key space where "div" needs one,
    /// 1 to 2^30 ranks, version 1.
    ///
    /// # Errors
    /// What is wrong, naming the field.
    pub fn check(&self) -> std::result::Result<(), String> {
        match (self.kind.as_str(), &self.buckets) {
            ("bucket", Some(b)) => {
                if b.is_empty() || b.len() > MAX_BUCKETS {
                    return Err(format!(
                        "partition: {} buckets out of range (1 to {MAX_BUCKETS})",
                        b.len()
                    ));
                }
                if let Some(r) = b.iter().find(|&&r| u64::from(r) >= self.world_size) {
                    return Err(format!(
                        "partition: a bucket of rank {r}, of {} ranks",
                        self.world_size
                    ));
                }
            }
            ("bucket", None) => return Err("partition: \"bucket\" without its buckets".into()),
            (_, Some(_)) => return Err(format!("partition: {:?} with buckets", self.kind)),
            (kind, None) => {
                crate::partition::Partition::from_name(kind, self.key_space)
                    .map_err(|e| format!("partition: {e}"))?;
            }
        }
        if !(1..=1 << 30).contains(&self.world_size) {
            return Err(format!(
                "partition: world_size {} out of range (1 to 2^30)",
                self.world_size
            ));
        }
        if self.version != 1 {
            return Err(format!(
                "partition: version {} is not 1 (written by a newer embstore)",
                self.version
            ));
        }
        Ok(())
    }
}

/// Buckets a "bucket" partition has at most.
pub(crate) const MAX_BUCKETS: usize = 1 << 20;

pub(crate) fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl Manifest {
    /// The row format named by `dtype`.
    pub(crate) fn format(&self) -> Result<RowFormat> {
        RowFormat::from_name(&self.dtype)
    }

    /// The policy of the table that saved, with its row format.
    pub(crate) fn table_policy(&self) -> Result<Policy> {
        let format = self.format()?;
        match &self.policy {
            None => Ok(Policy {
                format,
                ..Policy::default()
            }),
            Some(p) => {
                let p = Policy { format, ..*p };
                p.validate()?;
                Ok(p)
            }
        }
    }

    /// Whether the row files hold a `meta` tensor.
    pub(crate) fn has_meta(&self) -> bool {
        self.policy.as_ref().is_some_and(Policy::tracks)
    }
}

impl Manifest {
    /// The CRC-32C of the canonical JSON of everything but `checksum`.
    pub(crate) fn compute_checksum(&self) -> u32 {
        let mut m = self.clone();
        m.checksum = None;
        let v = serde_json::to_value(&m).expect("a manifest always serializes");
        crc32c::crc32c(v.to_string().as_bytes())
    }

    /// Bytes of every file of the chain (what a load reads, once per pass).
    pub fn total_bytes(&self) -> u64 {
        self.files().map(|f| f.bytes).fold(0, u64::saturating_add)
    }

    /// Every file of the chain.
    pub fn files(&self) -> impl Iterator<Item = &FileEntry> {
        self.chain
            .iter()
            .flat_map(|l| l.files.iter().chain(l.removed.iter()))
    }
}

/// What a save wrote.
#[derive(Debug, Clone)]
pub struct SaveInfo {
    /// The new manifest.
    pub manifest: Manifest,
    /// Bytes written by this save (files and manifest).
    pub bytes_written: u64,
}

/// What a table knows of one checkpoint path it saved to (or loaded from):
/// an incremental save there writes what changed since. Each path has its
/// own mark, so a trainer can publish serving updates to one path and save
/// training checkpoints to another, each chain incremental.
#[derive(Debug, Clone)]
pub(crate) struct SaveMark {
    /// The directory, canonical.
    pub(crate) dir: PathBuf,
    /// The id of the manifest this table published (or loaded) there: an
    /// incremental save continues only that checkpoint.
    pub(crate) id: String,
    /// The save generation of that save: rows marked with a later one
    /// changed since.
    pub(crate) since: u32,
    /// Per shard, the position in the shard's removal log at that save
    /// (removals since are the log from there).
    pub(crate) removed_at: Vec<u64>,
    /// The same two at the save of the chain's full link, when this table
    /// wrote it (a table loaded from a chain of deltas does not know what
    /// changed since the base): a compacting save writes the changes since
    /// the base as one delta.
    pub(crate) base: Option<(u32, Vec<u64>)>,
}

/// Paths whose marks a table keeps; saving to a further path forgets the
/// least recently saved one (whose next save must then be full).
pub(crate) const MAX_MARKS: usize = 8;

/// The save marks of a table, the most recently saved path last (at most
/// [`MAX_MARKS`]), and the removal-log positions of saves in flight.
pub(crate) type LastSave = Mutex<SaveMarks>;

/// What a table keeps of its saves (see [`LastSave`]).
#[derive(Debug, Default)]
pub(crate) struct SaveMarks {
    /// Per path, the most recently saved last.
    pub(crate) marks: Vec<SaveMark>,
    /// Saves that took their snapshot but have not recorded their mark
    /// yet: an id and each shard's removal-log position at the snapshot.
    /// The log is kept from there too, so a save at another path that
    /// finishes meanwhile cannot drop removals the first one's next
    /// incremental save needs.
    pub(crate) pins: Vec<(u64, Vec<u64>)>,
    /// The next pin's id.
    pub(crate) next_pin: u64,
}

impl SaveMarks {
    /// Per shard (of `shards`), the oldest removal-log position a mark or
    /// a pin needs (`u64::MAX`: none).
    pub(crate) fn needed(&self, shards: usize) -> Vec<u64> {
        (0..shards)
            .map(|s| {
                let marks = self.marks.iter().map(|m| {
                    m.base
                        .as_ref()
                        .map_or(m.removed_at[s], |b| b.1[s].min(m.removed_at[s]))
                });
                let pins = self.pins.iter().map(|p| p.1[s]);
                marks.chain(pins).min().unwrap_or(u64::MAX)
            })
            .collect()
    }
}

/// Reads and checks a directory's manifest (not yet its files).
///
/// # Errors
/// `Checkpoint` when the manifest is missing, unreadable, not JSON of the
/// expected shape, of an unknown format or newer version, or its checksum
/// or configuration does not hold.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let text = read_regular(&path, MAX_MANIFEST_BYTES, "no manifest")?;
    parse_manifest(dir, &text)
}

/// The bytes of the manifest of the checkpoint at `dir`, bounded but not
/// checked: for telling one publish from the next without parsing (a
/// publish replaces the manifest whole, by a rename).
///
/// # Errors
/// `Checkpoint` when it cannot be read (missing, not a regular file, too
/// large).
pub(crate) fn manifest_bytes(dir: &Path) -> Result<Vec<u8>> {
    read_regular(&dir.join(MANIFEST), MAX_MANIFEST_BYTES, "no manifest")
}

/// The bytes of the manifest of the checkpoint at `dir`, bounded and
/// checked as [`read_manifest`] checks them: for processes that must all
/// load the one checkpoint a single reader saw ([`parse_manifest`]).
///
/// # Errors
/// As [`read_manifest`].
pub fn read_manifest_text(dir: &Path) -> Result<Vec<u8>> {
    let text = read_regular(&dir.join(MANIFEST), MAX_MANIFEST_BYTES, "no manifest")?;
    parse_manifest(dir, &text)?;
    Ok(text)
}

/// Parses and checks the manifest `text` of the checkpoint at `dir`.
///
/// # Errors
/// As [`read_manifest`].
pub fn parse_manifest(dir: &Path, text: &[u8]) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    if text.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(ckpt_err(&path, "manifest larger than allowed"));
    }
    let value: serde_json::Value = serde_json::from_slice(text)
        .map_err(|e| ckpt_err(&path, format!("not valid JSON: {e}")))?;
    match value.get("format").and_then(|f| f.as_str()) {
        Some(FORMAT) => {}
        other => {
            return Err(ckpt_err(
                &path,
                format!("not an embstore checkpoint (format {other:?}, expected {FORMAT:?})"),
            ));
        }
    }
    match value.get("version").and_then(serde_json::Value::as_u64) {
        Some(v) if v <= u64::from(VERSION) => {}
        Some(v) => {
            return Err(ckpt_err(
                &path,
                format!(
                    "format version {v} was written by a newer embstore; this build reads versions up to {VERSION}"
                ),
            ));
        }
        None => return Err(ckpt_err(&path, "manifest has no format version")),
    }
    let m: Manifest = serde_json::from_value(value).map_err(|e| {
        ckpt_err(
            &path,
            format!("manifest does not have the expected fields: {e}"),
        )
    })?;
    let crc = m.compute_checksum();
    if m.checksum != Some(crc) {
        return Err(ckpt_err(
            &path,
            format!(
                "manifest checksum mismatch: expected {:?}, computed {crc:08x} (damaged)",
                m.checksum
            ),
        ));
    }
    check_manifest(&m).map_err(|msg| ckpt_err(&path, msg))?;
    Ok(m)
}

/// Structural checks of a parsed manifest; the message says what is wrong.
pub(crate) fn check_manifest(m: &Manifest) -> std::result::Result<(), String> {
    if m.dim == 0 || m.dim > 1 << 20 {
        return Err(format!("dim {} out of range", m.dim));
    }
    if m.step > MAX_STEP {
        return Err(format!(
            "step {} out of range (at most {})",
            m.step, MAX_STEP
        ));
    }
    // Replaying the chain cannot give more rows than its files hold.
    let file_rows = m
        .chain
        .iter()
        .flat_map(|l| l.files.iter())
        .try_fold(0u64, |acc, f| acc.checked_add(f.rows));
    match file_rows {
        Some(n) if m.rows <= n => {}
        _ => {
            return Err(format!(
                "rows {} is more than its files hold ({file_rows:?})",
                m.rows
            ));
        }
    }
    if RowFormat::from_name(&m.dtype).is_err() {
        return Err(format!(
            "dtype {:?} is not supported by this build",
            m.dtype
        ));
    }
    if let Some(p) = &m.policy {
        p.validate().map_err(|e| format!("policy: {e}"))?;
    }
    if let Some(p) = &m.partition {
        p.check()?;
        if m.version < VERSION {
            return Err(format!(
                "a partition in a version {} manifest (partitions came with version {VERSION})",
                m.version
            ));
        }
    }
    let opt = m
        .optimizer
        .as_ref()
        .map(|o| Optimizer::from_named(&o.name, &o.params));
    let opt = opt.transpose().map_err(|e| format!("optimizer: {e}"))?;
    Initializer::from_named(&m.initializer.name, &m.initializer.params)
        .map_err(|e| format!("initializer: {e}"))?;
    let expect_state = if m.with_optimizer {
        opt.map_or(0, |o| o.state_len(m.dim))
    } else {
        0
    };
    if m.state_len != expect_state {
        return Err(format!(
            "state_len {} does not match the optimizer's {expect_state}",
            m.state_len
        ));
    }
    // Every file is a plain name inside the directory: a manifest naming
    // `../x` or `/etc/passwd` is refused before anything is opened.
    for f in m.files() {
        if let Some(why) = untrusted::not_plain(&f.name) {
            return Err(format!(
                "names the file {:?}, which is not a plain file name ({why})",
                f.name
            ));
        }
    }
    match m.chain.first() {
        Some(l) if l.kind == "full" && l.removed.is_none() => {}
        _ => return Err("the chain must start with a full snapshot".into()),
    }
    if m.chain.iter().skip(1).any(|l| l.kind != "delta") {
        return Err("every link after the first must be a delta".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Admission;
    use crate::testing::{sgd, table, temp_dir};

    #[test]
    fn a_policy_written_before_ttl_seconds_reads_and_writes_as_it_was() {
        // A manifest's policy as checkpoints written before ttl_seconds and
        // capacity_bytes hold it: it parses, and serializes to the same
        // bytes, so its checksum still matches.
        let old = r#"{"admission":{"name":"always","params":{}},"ttl_steps":5,"capacity":9,"eviction":"lru"}"#;
        let mut p: Policy = serde_json::from_str(old).unwrap();
        assert_eq!((p.ttl_seconds, p.capacity_bytes), (None, None));
        assert_eq!(serde_json::to_string(&p).unwrap(), old);
        p.ttl_steps = None;
        p.ttl_seconds = Some(60);
        p.capacity_bytes = Some(1 << 20);
        p.admission = Admission::Count {
            min_count: 3,
            width: 1024,
            depth: 2,
        };
        let back: Policy = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
    }

    #[test]
    fn a_policy_with_an_unknown_setting_or_a_bad_filter_is_refused() {
        for bad in [
            r#"{"admission":{"name":"always","params":{}},"eviction":"lfu","made_up":1}"#,
            r#"{"admission":{"name":"count","params":{"min_count":0,"width":8,"depth":1}}}"#,
            r#"{"eviction":"fifo"}"#,
        ] {
            assert!(serde_json::from_str::<Policy>(bad).is_err(), "{bad}");
        }
    }

    fn saved() -> (std::path::PathBuf, Manifest) {
        let dir = temp_dir("manifest");
        let t = table(3, 2, sgd(0.1));
        t.assign(&[1, 2, 3], &[0.5; 9]).unwrap();
        let info = t.save(&dir, false, true, None).unwrap();
        (dir, info.manifest)
    }

    #[test]
    fn a_bucket_record_names_each_buckets_rank_within_its_world() {
        let record = |kind: &str, buckets: Option<Vec<u32>>| PartitionRecord {
            kind: kind.to_string(),
            key_space: None,
            world_size: 2,
            version: 1,
            buckets,
        };
        assert!(record("bucket", Some(vec![0, 1, 1])).check().is_ok());
        assert!(record("bucket", Some(vec![0, 2])).check().is_err());
        assert!(record("bucket", Some(vec![])).check().is_err());
        assert!(record("bucket", None).check().is_err());
        assert!(record("hash", Some(vec![0])).check().is_err());
        assert!(record("hash", None).check().is_ok());
    }

    #[test]
    fn the_checksum_covers_every_field() {
        let (dir, m) = saved();
        assert_eq!(read_manifest(&dir).unwrap().checksum, m.checksum);
        let mut other = m.clone();
        other.step += 1;
        assert_ne!(other.compute_checksum(), m.compute_checksum());
        assert_eq!(m.checksum, Some(m.compute_checksum()));
        assert_eq!(m.total_bytes(), m.files().map(|f| f.bytes).sum::<u64>());
    }

    #[test]
    fn structural_checks_name_what_is_wrong() {
        let (_, m) = saved();
        assert!(check_manifest(&m).is_ok());
        let mut bad = m.clone();
        bad.dim = 0;
        assert!(check_manifest(&bad).unwrap_err().contains("dim"));
        let mut bad = m.clone();
        bad.rows = 1 << 40;
        assert!(check_manifest(&bad).unwrap_err().contains("rows"));
    }

    #[test]
    fn a_damaged_manifest_is_refused() {
        let (dir, _) = saved();
        let path = dir.join(MANIFEST);
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        v["step"] = serde_json::json!(5);
        std::fs::write(&path, v.to_string()).unwrap();
        assert!(read_manifest(&dir).is_err());
    }
}
