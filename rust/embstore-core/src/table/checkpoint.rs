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
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use rayon::prelude::*;
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo, TensorView};
use serde::{Deserialize, Serialize};

use super::dirlock::{self, READERS_LOCK};
use super::{Table, TableConfig, read};
use crate::error::{Result, StoreError, ckpt_err};
use crate::hash::mix64;
use crate::init::Initializer;
use crate::optim::Optimizer;
use crate::policy::{Admission, Eviction, Policy, RowFormat};

/// The format name in every manifest.
pub const FORMAT: &str = "embstore-checkpoint";
/// The newest format version this build writes and reads.
pub const VERSION: u32 = 1;
/// The manifest's file name inside a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";
/// Rows per shard file are capped so that one file's bytes stay near this.
const FILE_BYTES: usize = 256 << 20;
/// The largest manifest a load accepts.
const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// A named configuration (optimizer or initializer) in a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NamedConfig {
    /// Class name, as in `embstore.optim` / `embstore.init`.
    pub name: String,
    /// Every parameter.
    pub params: BTreeMap<String, f64>,
}

/// One file of a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    /// File name inside the checkpoint directory.
    pub name: String,
    /// Rows (or removed keys) it holds.
    pub rows: u64,
    /// Its size in bytes.
    pub bytes: u64,
    /// CRC-32C (Castagnoli) of the whole file.
    pub crc32c: u32,
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
    /// The memory policy, when the table has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyConfig>,
    /// The table's call clock (LRU recency of the rows' metadata).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub clock: u64,
    /// CRC-32C of the manifest's canonical JSON without this field.
    #[serde(default)]
    pub checksum: Option<u32>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A table's admission and eviction settings in a manifest. When present,
/// the row files also hold a `meta` tensor (u32, 4 per row) when the policy
/// keeps per-row metadata.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyConfig {
    /// The admission filter ("always", "count", "probability").
    pub admission: NamedConfig,
    /// Steps a row lives untouched.
    pub ttl_steps: Option<u64>,
    /// Most rows.
    pub capacity: Option<u64>,
    /// "lfu" or "lru".
    pub eviction: String,
}

impl PolicyConfig {
    /// The settings of `p` (its row format is the manifest's dtype).
    fn of(p: &Policy) -> PolicyConfig {
        let (name, params) = p.admission.to_named();
        PolicyConfig {
            admission: NamedConfig {
                name: name.to_string(),
                params: params.into_iter().collect(),
            },
            ttl_steps: p.ttl_steps,
            capacity: p.capacity.map(|c| c as u64),
            eviction: p.eviction.name().to_string(),
        }
    }

    /// The policy these settings describe, with rows in `format`.
    fn policy(&self, format: RowFormat) -> Result<Policy> {
        let params: Vec<(String, f64)> = self
            .admission
            .params
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        let p = Policy {
            format,
            admission: Admission::from_named(&self.admission.name, &params)?,
            ttl_steps: self.ttl_steps,
            capacity: self.capacity.map(|c| c as usize),
            eviction: Eviction::from_name(&self.eviction)?,
        };
        p.validate()?;
        Ok(p)
    }
}

impl Manifest {
    /// The row format named by `dtype`.
    fn format(&self) -> Result<RowFormat> {
        RowFormat::from_name(&self.dtype)
    }

    /// The policy of the table that saved, with its row format.
    fn table_policy(&self) -> Result<Policy> {
        let format = self.format()?;
        match &self.policy {
            None => Ok(Policy {
                format,
                ..Policy::default()
            }),
            Some(pc) => pc.policy(format),
        }
    }

    /// Whether the row files hold a `meta` tensor.
    fn has_meta(&self) -> bool {
        self.policy
            .as_ref()
            .is_some_and(|p| p.ttl_steps.is_some() || p.capacity.is_some())
    }
}

impl Manifest {
    /// The CRC-32C of the canonical JSON of everything but `checksum`.
    fn compute_checksum(&self) -> u32 {
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

/// Where a table was last saved: incremental saves continue that chain.
#[derive(Debug, Clone)]
pub(crate) struct SaveMark {
    dir: PathBuf,
    id: String,
}

/// The last save of each table (by address would be fragile; it lives in
/// the table itself).
pub(crate) type LastSave = Mutex<Option<SaveMark>>;

fn io_err(path: &Path, what: &str, e: &std::io::Error) -> StoreError {
    ckpt_err(path, format!("{what}: {e}"))
}

/// A fresh checkpoint id (16 hex digits): the time, the process and a counter, mixed.
pub fn new_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let c = COUNTER.fetch_add(1, Ordering::Relaxed);
    let h = mix64(nanos ^ mix64(u64::from(std::process::id()) ^ mix64(c)));
    format!("{h:016x}")
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(dir, "cannot fsync the directory", &e))
}

/// Fsyncs the files `names` of `dir`, in parallel.
fn fsync_files<'a>(dir: &Path, names: impl IntoIterator<Item = &'a str>) -> Result<()> {
    let names: Vec<&str> = names.into_iter().collect();
    names.par_iter().try_for_each(|n| {
        let path = dir.join(n);
        File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| io_err(&path, "cannot fsync", &e))
    })
}

/// Writes `bytes` to `path` and fsyncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| io_err(path, "cannot create", &e))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| io_err(path, "cannot write", &e))
}

/// Plain number types whose in-memory bytes are their little-endian
/// encoding on a little-endian machine.
trait Plain: Copy {
    /// Appends the little-endian bytes of `v` to `out`.
    fn extend_le(v: &[Self], out: &mut Vec<u8>);
}

macro_rules! plain {
    ($t:ty) => {
        impl Plain for $t {
            fn extend_le(v: &[Self], out: &mut Vec<u8>) {
                #[cfg(target_endian = "little")]
                {
                    // SAFETY: `$t` is a primitive number: no padding, every
                    // byte initialized; u8 has alignment 1; the length is the
                    // slice's size in bytes. On a little-endian machine these
                    // bytes are the little-endian encoding.
                    let bytes = unsafe {
                        std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), size_of_val(v))
                    };
                    out.extend_from_slice(bytes);
                }
                #[cfg(not(target_endian = "little"))]
                for x in v {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
    };
}
plain!(f32);
plain!(i64);
plain!(u16);
plain!(u32);

/// One tensor to write: name, dtype, shape, and its bytes in pieces.
struct TensorOut<'a> {
    name: &'static str,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: &'a [u8],
}

/// Writes a safetensors file (header from the crate's own `Metadata`, then
/// the tensors' bytes) and returns its size and CRC-32C. The caller fsyncs
/// it ([`fsync_files`]) before publishing: deferring the fsyncs lets the
/// kernel write files back while later ones are still being built.
fn write_safetensors(path: &Path, tensors: &[TensorOut<'_>]) -> Result<(u64, u32)> {
    let mut offset = 0;
    let mut infos = Vec::with_capacity(tensors.len());
    for t in tensors {
        infos.push((
            t.name.to_string(),
            TensorInfo {
                dtype: t.dtype,
                shape: t.shape.clone(),
                data_offsets: (offset, offset + t.bytes.len()),
            },
        ));
        offset += t.bytes.len();
    }
    let meta = Metadata::new(None, infos)
        .map_err(|e| ckpt_err(path, format!("cannot describe the tensors: {e}")))?;
    let mut header = serde_json::to_vec(&meta)
        .map_err(|e| ckpt_err(path, format!("cannot serialize the header: {e}")))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut f = File::create(path).map_err(|e| io_err(path, "cannot create", &e))?;
    let n = (header.len() as u64).to_le_bytes();
    let mut crc = crc32c::crc32c(&n);
    crc = crc32c::crc32c_append(crc, &header);
    let mut write = |b: &[u8]| f.write_all(b).map_err(|e| io_err(path, "cannot write", &e));
    write(&n)?;
    write(&header)?;
    for t in tensors {
        crc = crc32c::crc32c_append(crc, t.bytes);
        write(t.bytes)?;
    }
    Ok(((8 + header.len() + offset) as u64, crc))
}

/// The tensors of one shard file, checked against the manifest.
struct Rows<'a> {
    keys: Cow<'a, [i64]>,
    rows: Cow<'a, [f32]>,
    state: Option<Cow<'a, [f32]>>,
    /// Per-row policy metadata, 4 words a row ([`Meta::to_words`]).
    meta: Option<Cow<'a, [u32]>>,
}

/// The safetensors dtype of rows stored in `fmt`.
fn rows_dtype(fmt: RowFormat) -> Dtype {
    match fmt {
        RowFormat::F32 => Dtype::F32,
        RowFormat::F16 => Dtype::F16,
        RowFormat::BF16 => Dtype::BF16,
    }
}

/// Rows stored in `fmt` as float32 (exact: every 16-bit value is a float32).
fn rows_f32(fmt: RowFormat, b: &[u8]) -> Cow<'_, [f32]> {
    let halves = || b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]));
    match fmt {
        RowFormat::F32 => f32s(b),
        RowFormat::F16 => Cow::Owned(halves().map(|h| half::f16::from_bits(h).to_f32()).collect()),
        RowFormat::BF16 => Cow::Owned(
            halves()
                .map(|h| half::bf16::from_bits(h).to_f32())
                .collect(),
        ),
    }
}

fn tensor<'d>(st: &SafeTensors<'d>, path: &Path, name: &str) -> Result<TensorView<'d>> {
    st.tensor(name)
        .map_err(|e| ckpt_err(path, format!("tensor {name:?}: {e}")))
}

fn expect_tensor<'d>(
    st: &SafeTensors<'d>,
    path: &Path,
    name: &str,
    dtype: Dtype,
    shape: &[usize],
) -> Result<&'d [u8]> {
    let t = tensor(st, path, name)?;
    if t.dtype() != dtype || t.shape() != shape {
        return Err(ckpt_err(
            path,
            format!(
                "tensor {name:?}: expected {dtype:?} of shape {shape:?}, found {:?} of shape {:?}",
                t.dtype(),
                t.shape()
            ),
        ));
    }
    Ok(t.data())
}

/// Little-endian bytes as numbers: borrowed in place when the machine is
/// little-endian and the bytes are aligned (the usual case: tensors start at
/// 8-byte offsets of a heap buffer), converted otherwise.
trait FromLe: Plain {
    fn from_le(b: &[u8]) -> Self;

    fn view(b: &[u8]) -> Cow<'_, [Self]> {
        #[cfg(target_endian = "little")]
        {
            // SAFETY: `Self` is a primitive number (f32/i64): every bit
            // pattern is a valid value; `align_to` only returns a middle part
            // that is correctly aligned and in bounds.
            let (head, mid, tail) = unsafe { b.align_to::<Self>() };
            if head.is_empty() && tail.is_empty() {
                return Cow::Borrowed(mid);
            }
        }
        Cow::Owned(
            b.chunks_exact(size_of::<Self>())
                .map(Self::from_le)
                .collect(),
        )
    }
}

impl FromLe for f32 {
    fn from_le(b: &[u8]) -> Self {
        f32::from_le_bytes(b.try_into().expect("4-byte chunk"))
    }
}

impl FromLe for u32 {
    fn from_le(b: &[u8]) -> Self {
        u32::from_le_bytes(b.try_into().expect("4-byte chunk"))
    }
}

impl FromLe for i64 {
    fn from_le(b: &[u8]) -> Self {
        i64::from_le_bytes(b.try_into().expect("8-byte chunk"))
    }
}

fn f32s(b: &[u8]) -> Cow<'_, [f32]> {
    f32::view(b)
}

fn i64s(b: &[u8]) -> Cow<'_, [i64]> {
    i64::view(b)
}

/// Byte buffers of one file being written: keys, rows, state.
type WriteBufs = (Vec<u8>, Vec<u8>, Vec<u8>, Vec<u8>);

thread_local! {
    /// Write buffers per thread, kept between files (no fresh memory to
    /// fault in for every file).
    static WRITE_BUFS: std::cell::RefCell<WriteBufs> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new(), Vec::new())) };
    /// A read buffer per thread, kept between files so that loading does
    /// not fault in fresh memory for every file.
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The bytes of the regular file at `path`, refused (without reading it
/// all) when it is not a regular file (a device, a FIFO: a symlink to
/// `/dev/zero` would never end) or holds more than `limit` bytes.
fn read_regular(path: &Path, limit: u64, missing: &str) -> Result<Vec<u8>> {
    let mut buf = Vec::new();
    let too_large =
        |len: u64| (len > limit).then(|| format!("{len} bytes, more than the {limit} allowed"));
    read_regular_into(path, limit, missing, &mut buf, too_large)?;
    Ok(buf)
}

/// [`read_regular`] into `buf` (cleared first); `size_err` says what is
/// wrong with a file of the given size, if anything.
fn read_regular_into(
    path: &Path,
    limit: u64,
    missing: &str,
    buf: &mut Vec<u8>,
    size_err: impl Fn(u64) -> Option<String>,
) -> Result<()> {
    let f = File::open(path).map_err(|e| io_err(path, missing, &e))?;
    let meta = f.metadata().map_err(|e| io_err(path, missing, &e))?;
    if !meta.is_file() {
        return Err(ckpt_err(path, "not a regular file"));
    }
    if let Some(msg) = size_err(meta.len()) {
        return Err(ckpt_err(path, msg));
    }
    buf.clear();
    buf.try_reserve_exact(meta.len() as usize)
        .map_err(|_| crate::error::oom("path", meta.len()))?;
    f.take(limit + 1)
        .read_to_end(buf)
        .map_err(|e| io_err(path, "cannot read", &e))?;
    if buf.len() as u64 > limit {
        return Err(ckpt_err(
            path,
            format!("more than the {limit} bytes expected (the file grew while read)"),
        ));
    }
    Ok(())
}

/// Reads a file named by the manifest and checks its size and CRC-32C.
fn read_checked_into(
    dir: &Path,
    e: &FileEntry,
    progress: Option<&AtomicU64>,
    buf: &mut Vec<u8>,
) -> Result<()> {
    if e.name.is_empty() || e.name.contains('/') || e.name.contains('\\') || e.name.starts_with('.')
    {
        return Err(ckpt_err(
            dir,
            format!("file name {:?} is not a plain file name", e.name),
        ));
    }
    let path = dir.join(&e.name);
    let size_err = |len: u64| {
        (len != e.bytes).then(|| {
            format!(
                "expected {} bytes, found {len} (truncated or replaced)",
                e.bytes
            )
        })
    };
    read_regular_into(&path, e.bytes, "missing or unreadable", buf, size_err)?;
    let crc = crc32c::crc32c(buf);
    if crc != e.crc32c {
        return Err(ckpt_err(
            &path,
            format!(
                "checksum mismatch: expected crc32c {:08x}, found {crc:08x} (damaged)",
                e.crc32c
            ),
        ));
    }
    if let Some(p) = progress {
        p.fetch_add(e.bytes, Ordering::Relaxed);
    }
    Ok(())
}

/// Runs `f` on the checked bytes of a file, read into this thread's buffer.
fn with_file<T>(
    dir: &Path,
    e: &FileEntry,
    progress: Option<&AtomicU64>,
    f: impl FnOnce(&[u8]) -> Result<T>,
) -> Result<T> {
    // The buffer is taken out of the thread's slot, not borrowed across `f`:
    // `f` may run rayon jobs, and a worker waiting in one may steal another
    // job of this kind on the same thread (which then finds the slot empty
    // and allocates a buffer of its own).
    let mut buf = READ_BUF.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
    let out = read_checked_into(dir, e, progress, &mut buf).and_then(|()| f(&buf));
    READ_BUF.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.capacity() < buf.capacity() {
            *slot = buf;
        }
    });
    out
}

/// Checks the tensors of one rows file without converting them.
fn check_rows(m: &Manifest, path: &Path, e: &FileEntry, buf: &[u8]) -> Result<()> {
    let st = SafeTensors::deserialize(buf)
        .map_err(|err| ckpt_err(path, format!("not a safetensors file: {err}")))?;
    let n = e.rows as usize;
    let fmt = m.format().map_err(|err| ckpt_err(path, err.to_string()))?;
    expect_tensor(&st, path, "keys", Dtype::I64, &[n])?;
    let rows = expect_tensor(&st, path, "rows", rows_dtype(fmt), &[n, m.dim])?;
    finite_in_file(path, "rows", &rows_f32(fmt, rows))?;
    if m.with_optimizer && m.state_len > 0 {
        let state = expect_tensor(&st, path, "state", Dtype::F32, &[n, m.state_len])?;
        finite_in_file(path, "state", &f32s(state))?;
    }
    if m.has_meta() {
        expect_tensor(&st, path, "meta", Dtype::U32, &[n, 4])?;
    }
    Ok(())
}

/// Refuses a tensor holding NaN or inf (a row or state that no call could
/// have written).
fn finite_in_file(path: &Path, name: &str, v: &[f32]) -> Result<()> {
    super::check_finite("values", v).map_err(|e| match e {
        StoreError::NonFinite { index, .. } => ckpt_err(
            path,
            format!("tensor {name:?} holds NaN or inf at flat index {index} (damaged)"),
        ),
        other => other,
    })
}

/// Parses and checks one rows file of the manifest.
fn parse_rows<'a>(m: &Manifest, path: &Path, e: &FileEntry, buf: &'a [u8]) -> Result<Rows<'a>> {
    let st = SafeTensors::deserialize(buf)
        .map_err(|err| ckpt_err(path, format!("not a safetensors file: {err}")))?;
    let n = e.rows as usize;
    let fmt = m.format().map_err(|err| ckpt_err(path, err.to_string()))?;
    let keys = i64s(expect_tensor(&st, path, "keys", Dtype::I64, &[n])?);
    let rows = rows_f32(
        fmt,
        expect_tensor(&st, path, "rows", rows_dtype(fmt), &[n, m.dim])?,
    );
    let state = if m.with_optimizer && m.state_len > 0 {
        Some(f32s(expect_tensor(
            &st,
            path,
            "state",
            Dtype::F32,
            &[n, m.state_len],
        )?))
    } else {
        None
    };
    let meta = if m.has_meta() {
        Some(u32::view(expect_tensor(
            &st,
            path,
            "meta",
            Dtype::U32,
            &[n, 4],
        )?))
    } else {
        None
    };
    Ok(Rows {
        keys,
        rows,
        state,
        meta,
    })
}

/// Parses and checks one removed-keys file.
fn parse_removed<'a>(path: &Path, e: &FileEntry, buf: &'a [u8]) -> Result<Cow<'a, [i64]>> {
    let st = SafeTensors::deserialize(buf)
        .map_err(|err| ckpt_err(path, format!("not a safetensors file: {err}")))?;
    Ok(i64s(expect_tensor(
        &st,
        path,
        "keys",
        Dtype::I64,
        &[e.rows as usize],
    )?))
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
    let value: serde_json::Value = serde_json::from_slice(&text)
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
fn check_manifest(m: &Manifest) -> std::result::Result<(), String> {
    if m.dim == 0 || m.dim > 1 << 20 {
        return Err(format!("dim {} out of range", m.dim));
    }
    if m.step > super::MAX_STEP {
        return Err(format!(
            "step {} out of range (at most {})",
            m.step,
            super::MAX_STEP
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
        p.policy(RowFormat::F32)
            .map_err(|e| format!("policy: {e}"))?;
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
    match m.chain.first() {
        Some(l) if l.kind == "full" && l.removed.is_none() => {}
        _ => return Err("the chain must start with a full snapshot".into()),
    }
    if m.chain.iter().skip(1).any(|l| l.kind != "delta") {
        return Err("every link after the first must be a delta".into());
    }
    Ok(())
}

impl Table {
    /// A manifest describing this table (no files yet), for [`publish`].
    pub fn manifest_base(&self, id: &str, with_optimizer: bool) -> Manifest {
        let (iname, iparams) = self.initializer.to_named();
        let optimizer = self.optimizer.map(|o| {
            let (name, params) = o.to_named();
            NamedConfig {
                name: name.to_string(),
                params,
            }
        });
        let with_state = with_optimizer && self.state_len > 0;
        Manifest {
            format: FORMAT.to_string(),
            version: VERSION,
            id: id.to_string(),
            dim: self.dim,
            dtype: self.policy.format.name().to_string(),
            state_len: if with_state { self.state_len } else { 0 },
            state_names: if with_state {
                self.optimizer
                    .map(|o| o.state_names().iter().map(|s| (*s).to_string()).collect())
                    .unwrap_or_default()
            } else {
                Vec::new()
            },
            optimizer,
            initializer: NamedConfig {
                name: iname.to_string(),
                params: iparams,
            },
            seed: self.seed,
            step: self.step(),
            num_shards: self.shards.len(),
            with_optimizer,
            rows: 0,
            chain: Vec::new(),
            policy: (self.policy
                != Policy {
                    format: self.policy.format,
                    ..Policy::default()
                })
            .then(|| PolicyConfig::of(&self.policy)),
            clock: self.clock(),
            checksum: None,
        }
    }

    /// Writes this table's rows (all, or with `only_gen` those changed in that
    /// save generation) to shard files `{prefix}-SSSSS-CCCC.safetensors` in
    /// `dir`, at most about 256 MB each, and returns their entries. The
    /// files are not yet fsynced (see [`publish`]). The caller holds the
    /// gate exclusively.
    fn write_rows(
        &self,
        dir: &Path,
        prefix: &str,
        only_gen: Option<u32>,
        with_optimizer: bool,
        progress: Option<&AtomicU64>,
    ) -> Result<Vec<FileEntry>> {
        let with_state = with_optimizer && self.state_len > 0;
        let (dim, sl, ww) = (self.dim, self.state_len, self.weight_words());
        let fmt = self.policy.format;
        let with_meta = self.policy.tracks();
        let row_bytes = 8 + 4 * (ww + if with_state { sl } else { 0 }) + 16;
        let per_file = (FILE_BYTES / row_bytes).max(1);

        // Each shard writes its rows (all, or those of this generation) in
        // files of at most `per_file` rows.
        let written: Vec<Vec<FileEntry>> = self
            .shards
            .par_iter()
            .enumerate()
            .map(|(s, lock)| -> Result<Vec<FileEntry>> {
                let g = read(lock);
                let rows: Vec<usize> = (0..g.len())
                    .filter(|&r| only_gen.is_none_or(|gen_| g.arena.generation(r) == gen_))
                    .collect();
                let mut out = Vec::new();
                WRITE_BUFS.with(|cell| -> Result<()> {
                    let bufs = &mut *cell.borrow_mut();
                    let (kb, w, st, mb) = (&mut bufs.0, &mut bufs.1, &mut bufs.2, &mut bufs.3);
                    for (c, chunk) in rows.chunks(per_file).enumerate() {
                        let n = chunk.len();
                        kb.clear();
                        w.clear();
                        st.clear();
                        mb.clear();
                        for &r in chunk {
                            i64::extend_le(&[g.arena.key(r)], kb);
                            let row = g.arena.row(r);
                            match fmt {
                                RowFormat::F32 => f32::extend_le(&row[..dim], w),
                                _ => u16::extend_le(&crate::policy::halves(&row[..ww])[..dim], w),
                            }
                            if with_state {
                                f32::extend_le(&row[ww..], st);
                            }
                            if with_meta {
                                u32::extend_le(&g.arena.meta(r).to_words(), mb);
                            }
                        }
                        let mut tensors = vec![
                            TensorOut {
                                name: "keys",
                                dtype: Dtype::I64,
                                shape: vec![n],
                                bytes: kb,
                            },
                            TensorOut {
                                name: "rows",
                                dtype: rows_dtype(fmt),
                                shape: vec![n, dim],
                                bytes: w,
                            },
                        ];
                        if with_meta {
                            tensors.push(TensorOut {
                                name: "meta",
                                dtype: Dtype::U32,
                                shape: vec![n, 4],
                                bytes: mb,
                            });
                        }
                        if with_state {
                            tensors.push(TensorOut {
                                name: "state",
                                dtype: Dtype::F32,
                                shape: vec![n, sl],
                                bytes: st,
                            });
                        }
                        let name = format!("{prefix}-{s:05}-{c:04}.safetensors");
                        let (bytes, crc) = write_safetensors(&dir.join(&name), &tensors)?;
                        if let Some(p) = progress {
                            p.fetch_add(bytes, Ordering::Relaxed);
                        }
                        out.push(FileEntry {
                            name,
                            rows: n as u64,
                            bytes,
                            crc32c: crc,
                        });
                    }
                    Ok(())
                })?;
                Ok(out)
            })
            .collect::<Result<_>>()?;
        Ok(written.into_iter().flatten().collect())
    }

    /// Writes a consistent snapshot of every row to shard files named
    /// `{prefix}-...` in `dir` (created if missing; its parent must exist) and fsyncs them, without
    /// publishing a manifest: for a caller that assembles one manifest from
    /// several tables (the ranks of a sharded table), then calls [`publish`].
    ///
    /// # Errors
    /// `Checkpoint` for I/O errors or a prefix that is not 16 hex digits
    /// followed by `-` and plain characters.
    pub fn write_files(
        &self,
        dir: &Path,
        prefix: &str,
        with_optimizer: bool,
        progress: Option<&AtomicU64>,
    ) -> Result<Vec<FileEntry>> {
        if !is_ours(&format!("{prefix}-00000-0000.safetensors")) || prefix.contains(['/', '\\']) {
            return Err(ckpt_err(
                dir,
                format!("file prefix {prefix:?} is not a checkpoint id"),
            ));
        }
        let _gate = self.gate.write().unwrap_or_else(PoisonError::into_inner);
        create_checkpoint_dir(dir)?;
        let written = self
            .write_rows(dir, prefix, None, with_optimizer, progress)
            .and_then(|files| {
                fsync_files(dir, files.iter().map(|f| f.name.as_str()))?;
                Ok(files)
            });
        if written.is_err() {
            remove_partial(dir, prefix);
        }
        written
    }

    /// Saves a consistent snapshot to directory `dir` (created if missing; its parent must exist).
    /// With `incremental`, writes only what changed since this table's last
    /// save to `dir` and appends it to that checkpoint's chain. Without
    /// `with_optimizer`, writes rows only (a serving export). `progress`, if
    /// given, counts the bytes written.
    ///
    /// Calls that change rows wait while the snapshot is taken; reads go on.
    ///
    /// # Errors
    /// `Checkpoint` for I/O errors, a `dir` that holds something other than
    /// an embstore checkpoint, or an incremental save with no earlier save
    /// of this table to `dir`. The previous checkpoint at `dir` stays whole.
    pub fn save(
        &self,
        dir: &Path,
        incremental: bool,
        with_optimizer: bool,
        progress: Option<&AtomicU64>,
    ) -> Result<SaveInfo> {
        let _gate = self.gate.write().unwrap_or_else(PoisonError::into_inner);
        create_checkpoint_dir(dir)?;
        let canonical = fs::canonicalize(dir).map_err(|e| io_err(dir, "cannot resolve", &e))?;
        let has_manifest = dir.join(MANIFEST).exists();
        if !has_manifest
            && fs::read_dir(dir)
                .map(|mut d| d.next().is_some())
                .unwrap_or(false)
        {
            let stray = fs::read_dir(dir)
                .map_err(|e| io_err(dir, "cannot list", &e))?
                .filter_map(|e| e.ok())
                .any(|e| !is_ours(&e.file_name().to_string_lossy()));
            if stray {
                return Err(ckpt_err(
                    dir,
                    "the directory holds files but no embstore manifest; refusing to write into it",
                ));
            }
        }
        // One save at a time per directory, across threads and processes;
        // the base of an incremental save is read under the lock.
        let _writer = dirlock::writer(dir)?;
        let has_manifest = dir.join(MANIFEST).exists();
        let base = if incremental {
            let mark = self
                .last_save
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            let prev = if has_manifest {
                Some(read_manifest(dir)?)
            } else {
                None
            };
            match (mark, prev) {
                (Some(mark), Some(prev)) if mark.dir == canonical && mark.id == prev.id => {
                    if prev.with_optimizer != with_optimizer {
                        return Err(ckpt_err(
                            dir,
                            "an incremental save must use the with_optimizer of its base",
                        ));
                    }
                    Some(prev)
                }
                _ => {
                    return Err(ckpt_err(
                        dir,
                        "an incremental save needs an earlier save (or load) of this table at this path",
                    ));
                }
            }
        } else {
            None
        };
        let id = new_id();
        let written = self.write_and_publish(dir, &id, base, with_optimizer, progress);
        let (manifest, text_len) = match written {
            Ok(w) => w,
            Err(e) => {
                // Nothing was published: what this save wrote is garbage
                // (and would fill the disk for the next save).
                remove_partial(dir, &id);
                return Err(e);
            }
        };

        // From here the new checkpoint is the one at `dir`.
        self.generation.fetch_add(1, Ordering::AcqRel);
        for lock in self.shards.iter() {
            let mut g = super::write(lock);
            g.removed = Vec::new();
            g.track_removals = true;
        }
        *self
            .last_save
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(SaveMark {
            dir: canonical,
            id: id.clone(),
        });
        let bytes_written = manifest.chain.last().map_or(0, |l| {
            l.files
                .iter()
                .chain(l.removed.iter())
                .map(|f| f.bytes)
                .sum()
        }) + text_len;
        Ok(SaveInfo {
            manifest,
            bytes_written,
        })
    }

    /// The writing part of [`Table::save`]: the files of a new link (all
    /// rows, or with `base` the changes since it), then the manifest,
    /// published. Returns the manifest and its size. The caller holds the
    /// gate exclusively and the writers' lock, and removes what was written
    /// when this fails.
    fn write_and_publish(
        &self,
        dir: &Path,
        id: &str,
        base: Option<Manifest>,
        with_optimizer: bool,
        progress: Option<&AtomicU64>,
    ) -> Result<(Manifest, u64)> {
        let save_gen = self.generation();
        let delta = base.is_some();
        let prefix = id.to_string();
        let files = self.write_rows(
            dir,
            &prefix,
            delta.then_some(save_gen),
            with_optimizer,
            progress,
        )?;

        let mut removed: Vec<i64> = Vec::new();
        if delta {
            for lock in self.shards.iter() {
                removed.extend_from_slice(&read(lock).removed);
            }
        }
        let removed_entry = if delta && !removed.is_empty() {
            let mut kb = Vec::with_capacity(removed.len() * 8);
            i64::extend_le(&removed, &mut kb);
            let name = format!("{id}-removed.safetensors");
            let (bytes, crc) = write_safetensors(
                &dir.join(&name),
                &[TensorOut {
                    name: "keys",
                    dtype: Dtype::I64,
                    shape: vec![removed.len()],
                    bytes: &kb,
                }],
            )?;
            Some(FileEntry {
                name,
                rows: removed.len() as u64,
                bytes,
                crc32c: crc,
            })
        } else {
            None
        };

        let mut manifest = self.manifest_base(id, with_optimizer);
        manifest.rows = self.shards.iter().map(|s| read(s).len() as u64).sum();
        manifest.chain = base.map(|b| b.chain).unwrap_or_default();
        manifest.chain.push(Link {
            kind: if delta { "delta" } else { "full" }.to_string(),
            files,
            removed: removed_entry,
        });
        let text_len = publish_locked(dir, &mut manifest)?;
        Ok((manifest, text_len))
    }

    /// Loads the checkpoint at `dir` into a new table (with `num_shards`
    /// shards, or the default). Every file is checked before any row is
    /// inserted. `progress`, if given, counts bytes read (twice the
    /// checkpoint's size: a checking pass, then a loading pass).
    ///
    /// # Errors
    /// `Checkpoint` for a damaged, unknown, newer or inconsistent checkpoint.
    pub fn load(
        dir: &Path,
        num_shards: Option<usize>,
        progress: Option<&AtomicU64>,
    ) -> Result<(Table, Manifest)> {
        Self::load_filtered(dir, num_shards, progress, None)
    }

    /// [`Table::load`] keeping only the rows whose key `keep` accepts (the
    /// keys one rank owns); the row count is then not checked against the
    /// manifest (the caller checks the sum over ranks).
    ///
    /// # Errors
    /// As [`Table::load`].
    pub fn load_filtered(
        dir: &Path,
        num_shards: Option<usize>,
        progress: Option<&AtomicU64>,
        keep: Option<&(dyn Fn(i64) -> bool + Sync)>,
    ) -> Result<(Table, Manifest)> {
        // A save to `dir` may publish a new checkpoint while this reads the
        // previous one. With the readers' lock held, the save leaves the
        // previous files in place; without one (no lock file), a load that
        // fails while the manifest changed under it reads the new one.
        let mut tries = 0;
        loop {
            let reader = dirlock::reader(dir);
            let m = read_manifest(dir)?;
            let id = m.id.clone();
            match Self::load_manifest(dir, m, num_shards, progress, keep) {
                Err(StoreError::Checkpoint { .. })
                    if reader.is_none()
                        && tries < 16
                        && read_manifest(dir).is_ok_and(|now| now.id != id) =>
                {
                    tries += 1;
                    if let Some(p) = progress {
                        p.store(0, Ordering::Relaxed);
                    }
                }
                other => return other,
            }
        }
    }

    /// [`Table::load_filtered`] of the checkpoint whose manifest is `m`.
    fn load_manifest(
        dir: &Path,
        m: Manifest,
        num_shards: Option<usize>,
        progress: Option<&AtomicU64>,
        keep: Option<&(dyn Fn(i64) -> bool + Sync)>,
    ) -> Result<(Table, Manifest)> {
        // Check pass: sizes, checksums, headers, dtypes and shapes.
        let files: Vec<(usize, &FileEntry, bool)> = m
            .chain
            .iter()
            .enumerate()
            .flat_map(|(i, l)| {
                l.removed
                    .iter()
                    .map(move |f| (i, f, true))
                    .chain(l.files.iter().map(move |f| (i, f, false)))
            })
            .collect();
        files
            .par_iter()
            .try_for_each(|&(_, e, removed)| -> Result<()> {
                let path = dir.join(&e.name);
                with_file(dir, e, progress, |buf| {
                    if removed {
                        parse_removed(&path, e, buf).map(|_| ())
                    } else {
                        check_rows(&m, &path, e, buf)
                    }
                })
            })?;

        let mut cfg = TableConfig::new(m.dim);
        cfg.optimizer = m
            .optimizer
            .as_ref()
            .map(|o| Optimizer::from_named(&o.name, &o.params))
            .transpose()?;
        cfg.initializer = Initializer::from_named(&m.initializer.name, &m.initializer.params)?;
        cfg.seed = m.seed;
        cfg.num_shards = num_shards;
        cfg.policy = m.table_policy()?;
        let table = Table::new(cfg)?;
        // `m.rows` is bounded by the rows of the files checked above.
        table
            .try_reserve_index(m.rows as usize)
            .map_err(|_| ckpt_err(dir, format!("not enough memory for {} rows", m.rows)))?;
        // Load pass: replay the chain; in each link the removals first, then
        // its files (disjoint keys) in parallel. The table is not shared yet.
        for link in &m.chain {
            if let Some(e) = &link.removed {
                with_file(dir, e, progress, |buf| {
                    table.remove(&parse_removed(&dir.join(&e.name), e, buf)?)
                })?;
            }
            link.files.par_iter().try_for_each(|e| -> Result<()> {
                with_file(dir, e, progress, |buf| {
                    let r = parse_rows(&m, &dir.join(&e.name), e, buf)?;
                    match keep {
                        None => table.assign_in(
                            &r.keys,
                            &r.rows,
                            r.state.as_deref(),
                            r.meta.as_deref(),
                            1,
                        )?,
                        Some(keep) => {
                            let (dim, sl) = (m.dim, m.state_len);
                            let pick: Vec<usize> =
                                (0..r.keys.len()).filter(|&i| keep(r.keys[i])).collect();
                            let keys: Vec<i64> = pick.iter().map(|&i| r.keys[i]).collect();
                            let rows: Vec<f32> = pick
                                .iter()
                                .flat_map(|&i| r.rows[i * dim..(i + 1) * dim].iter().copied())
                                .collect();
                            let state: Option<Vec<f32>> = r.state.as_ref().map(|st| {
                                pick.iter()
                                    .flat_map(|&i| st[i * sl..(i + 1) * sl].iter().copied())
                                    .collect()
                            });
                            let meta: Option<Vec<u32>> = r.meta.as_ref().map(|mt| {
                                pick.iter()
                                    .flat_map(|&i| mt[i * 4..(i + 1) * 4].iter().copied())
                                    .collect()
                            });
                            table.assign_in(&keys, &rows, state.as_deref(), meta.as_deref(), 1)?;
                        }
                    }
                    Ok(())
                })
            })?;
        }
        let loaded = table.len() as u64;
        if keep.is_none() && loaded != m.rows {
            return Err(ckpt_err(
                dir,
                format!(
                    "the chain replays to {loaded} rows, the manifest says {}",
                    m.rows
                ),
            ));
        }
        table.set_step(m.step)?;
        table.set_clock(m.clock);
        table.generation.store(2, Ordering::Release);
        for lock in table.shards.iter() {
            let mut g = super::write(lock);
            g.removed = Vec::new();
            g.track_removals = true;
        }
        let canonical = fs::canonicalize(dir).map_err(|e| io_err(dir, "cannot resolve", &e))?;
        *table
            .last_save
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(SaveMark {
            dir: canonical,
            id: m.id.clone(),
        });
        Ok((table, m))
    }
}

/// Publishes `manifest` at `dir`: fsyncs the files of its last link, writes
/// the manifest (with its checksum) to a temporary name, fsyncs it, renames
/// it over `manifest.json` and fsyncs the directory; then deletes the files
/// no link names, unless a load is reading the directory (they go at a
/// later publish). Holds the directory's writers' lock throughout (see
/// `dirlock`). Returns the manifest's size in bytes.
///
/// # Errors
/// `Checkpoint` for I/O errors; the previous manifest then still stands.
pub fn publish(dir: &Path, manifest: &mut Manifest) -> Result<u64> {
    let _writer = dirlock::writer(dir)?;
    publish_locked(dir, manifest)
}

/// [`publish`] by a caller that holds the writers' lock.
fn publish_locked(dir: &Path, manifest: &mut Manifest) -> Result<u64> {
    check_manifest(manifest).map_err(|msg| ckpt_err(dir, msg))?;
    manifest.checksum = Some(manifest.compute_checksum());
    let text = serde_json::to_vec_pretty(&manifest)
        .map_err(|e| ckpt_err(dir, format!("cannot serialize the manifest: {e}")))?;
    if let Some(link) = manifest.chain.last() {
        fsync_files(
            dir,
            link.files
                .iter()
                .chain(link.removed.iter())
                .map(|f| f.name.as_str()),
        )?;
    }
    fsync_dir(dir)?;
    let tmp = dir.join(format!("{MANIFEST}.tmp-{}", manifest.id));
    if let Err(e) = write_synced(&tmp, &text) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    // The publishing step: one atomic rename.
    if let Err(e) = fs::rename(&tmp, dir.join(MANIFEST)) {
        let _ = fs::remove_file(&tmp);
        return Err(io_err(dir, "cannot publish", &e));
    }
    fsync_dir(dir)?;
    if let Some(_cleaner) = dirlock::cleaner(dir) {
        remove_unreferenced(dir, manifest);
    }
    Ok(text.len() as u64)
}

/// Creates the checkpoint directory `dir` if it does not exist; its parent
/// must (a typo in a path should not silently create a tree of
/// directories). Several processes may create it at once.
///
/// # Errors
/// `Checkpoint` naming the missing parent, or the I/O error.
fn create_checkpoint_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !parent.is_dir() {
        return Err(ckpt_err(
            dir,
            format!(
                "the parent directory {} does not exist (create it first)",
                parent.display()
            ),
        ));
    }
    match fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(io_err(dir, "cannot create the directory", &e)),
    }
}

/// Deletes the files a save wrote before it failed: those named with its
/// id (best effort; they are garbage that no manifest names either way).
pub fn remove_partial(dir: &Path, id: &str) {
    let prefix = format!("{id}-");
    let tmp = format!("{MANIFEST}.tmp-{id}");
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if (name.starts_with(&prefix) && is_ours(&name)) || name == tmp {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

/// Whether a file name is one a save writes (an id-prefixed shard file or a
/// temporary manifest) or the manifest itself.
fn is_ours(name: &str) -> bool {
    name == MANIFEST
        || name == READERS_LOCK
        || name.starts_with(&format!("{MANIFEST}.tmp-"))
        || (name.ends_with(".safetensors")
            && name.len() > 17
            && name.as_bytes()[..16].iter().all(u8::is_ascii_hexdigit)
            && name.as_bytes()[16] == b'-')
}

/// Deletes our files that `m` does not name (best effort: a failure leaves
/// garbage, never a damaged checkpoint). The caller holds the writers' lock
/// and, so that no load is reading the files of the manifest `m` replaced,
/// the readers' lock exclusively ([`dirlock::cleaner`]).
fn remove_unreferenced(dir: &Path, m: &Manifest) {
    let keep: std::collections::HashSet<&str> = m.files().map(|f| f.name.as_str()).collect();
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name != MANIFEST
                && name != READERS_LOCK
                && is_ours(&name)
                && !keep.contains(name.as_str())
            {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

/// A file of a checkpoint and what is wrong with it (`None`: nothing).
pub type FileCheck = (FileEntry, Option<String>);

/// Checks every file of the checkpoint at `dir`: returns the manifest and,
/// per file, `None` when it holds or the error when not.
///
/// # Errors
/// `Checkpoint` when the manifest itself cannot be read.
pub fn verify(dir: &Path) -> Result<(Manifest, Vec<FileCheck>)> {
    let _reader = dirlock::reader(dir);
    let m = read_manifest(dir)?;
    let results: Vec<FileCheck> = m
        .files()
        .collect::<Vec<_>>()
        .par_iter()
        .map(|e| {
            let path = dir.join(&e.name);
            let r = with_file(dir, e, None, |buf| {
                if e.name.ends_with("-removed.safetensors") {
                    parse_removed(&path, e, buf).map(|_| ())
                } else {
                    check_rows(&m, &path, e, buf)
                }
            });
            ((*e).clone(), r.err().map(|x| x.to_string()))
        })
        .collect();
    if results.iter().all(|(_, err)| err.is_none()) {
        // What a load checks last: the chain replays to the manifest's rows.
        let replayed = replay_count(dir, &m)?;
        if replayed != m.rows {
            return Err(ckpt_err(
                dir,
                format!(
                    "the chain replays to {replayed} rows, the manifest says {}",
                    m.rows
                ),
            ));
        }
    }
    Ok((m, results))
}

/// The number of rows replaying the chain of `m` gives (keys only).
fn replay_count(dir: &Path, m: &Manifest) -> Result<u64> {
    let mut keys: std::collections::HashSet<i64> = std::collections::HashSet::new();
    for link in &m.chain {
        if let Some(e) = &link.removed {
            with_file(dir, e, None, |buf| {
                for k in parse_removed(&dir.join(&e.name), e, buf)?.iter() {
                    keys.remove(k);
                }
                Ok(())
            })?;
        }
        for e in &link.files {
            with_file(dir, e, None, |buf| {
                let st = SafeTensors::deserialize(buf)
                    .map_err(|err| ckpt_err(dir, format!("not a safetensors file: {err}")))?;
                let path = dir.join(&e.name);
                let ks = i64s(expect_tensor(
                    &st,
                    &path,
                    "keys",
                    Dtype::I64,
                    &[e.rows as usize],
                )?);
                keys.try_reserve(ks.len())
                    .map_err(|_| crate::error::oom("path", ks.len() * 8))?;
                keys.extend(ks.iter().copied());
                Ok(())
            })?;
        }
    }
    Ok(keys.len() as u64)
}
