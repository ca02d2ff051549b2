//! The safetensors codec of the shard files: writing tensors, and reading
//! and checking the keys, rows, state, metadata and removed-keys tensors.

use crate::error::{Result, StoreError, ckpt_err};
use crate::format::codec::RowFormat;
use crate::format::columns::Columns;
pub(crate) use crate::format::columns::{expect_tensor, rows_dtype};
use crate::format::file_index;
use crate::format::files::io_err;
use crate::format::manifest::{FileEntry, Manifest};
use crate::format::untrusted;
use crate::optim::Optimizer;
use crate::rows::{Scan, check_finite_max_on};
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo};
use std::borrow::Cow;
use std::io::Write;
use std::path::Path;

pub(crate) use crate::format::codec::Plain;

/// One tensor to write: name, dtype, shape, and its bytes in pieces.
pub(crate) struct TensorOut<'a> {
    pub(crate) name: &'static str,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<usize>,
    pub(crate) bytes: &'a [u8],
}

/// Writes a safetensors file (header from the crate's own `Metadata`, then
/// the tensors' bytes) and returns its size and CRC-32C. The caller fsyncs
/// it ([`fsync_files`]) before publishing: deferring the fsyncs lets the
/// kernel write files back while later ones are still being built.
pub(crate) fn write_safetensors(path: &Path, tensors: &[TensorOut<'_>]) -> Result<(u64, u32)> {
    write_safetensors_with(path, tensors, None)
}

/// [`write_safetensors`] with string metadata in the header
/// (`__metadata__`).
pub(crate) fn write_safetensors_with(
    path: &Path,
    tensors: &[TensorOut<'_>],
    metadata: Option<std::collections::HashMap<String, String>>,
) -> Result<(u64, u32)> {
    let specs: Vec<_> = tensors
        .iter()
        .map(|t| (t.name, t.dtype, t.shape.clone(), t.bytes.len()))
        .collect();
    let mut f = StreamedFile::create(path, &specs, metadata)?;
    for (i, t) in tensors.iter().enumerate() {
        f.put(i, t.bytes)?;
    }
    f.finish()
}

/// A safetensors file written tensor by tensor in pieces, in any order
/// across tensors ([`StreamedFile::put`]): its header is written first from
/// the tensors' dtypes and shapes, each piece goes to its tensor's place
/// (`pwrite`), and the file's CRC-32C is the tensors' own CRCs, each taken
/// as its pieces come, combined in file order at [`StreamedFile::finish`].
/// So a file of any size is written from a buffer of one piece: what a
/// disk table's save holds beside its rows.
pub(crate) struct StreamedFile {
    file: std::fs::File,
    path: std::path::PathBuf,
    /// Per tensor: where it starts in the file, its bytes, the bytes put
    /// so far and their CRC-32C.
    tensors: Vec<(u64, u64, u64, u32)>,
    /// The CRC-32C of the length prefix and header, and their bytes.
    head: (u32, u64),
}

impl StreamedFile {
    /// Creates the file `path` (nothing may be there) for `tensors` (their
    /// `bytes` unused: only their lengths, which [`StreamedFile::put`]
    /// fills) and writes its header.
    ///
    /// # Errors
    /// `Checkpoint` when the file cannot be created or written.
    pub(crate) fn create(
        path: &Path,
        tensors: &[(&'static str, Dtype, Vec<usize>, usize)],
        metadata: Option<std::collections::HashMap<String, String>>,
    ) -> Result<StreamedFile> {
        let mut offset = 0;
        let mut infos = Vec::with_capacity(tensors.len());
        for (name, dtype, shape, len) in tensors {
            infos.push((
                (*name).to_string(),
                TensorInfo {
                    dtype: *dtype,
                    shape: shape.clone(),
                    data_offsets: (offset, offset + len),
                },
            ));
            offset += len;
        }
        let header = header_bytes(path, metadata, infos)?;
        let mut f = untrusted::create_file(path).map_err(|e| io_err(path, "cannot create", &e))?;
        let n = (header.len() as u64).to_le_bytes();
        let crc = crc32c::crc32c_append(crc32c::crc32c(&n), &header);
        f.write_all(&n)
            .and_then(|()| f.write_all(&header))
            .map_err(|e| io_err(path, "cannot write", &e))?;
        let head = (8 + header.len()) as u64;
        let mut at = head;
        let tensors = tensors
            .iter()
            .map(|t| {
                let start = at;
                at += t.3 as u64;
                (start, t.3 as u64, 0, 0)
            })
            .collect();
        Ok(StreamedFile {
            file: f,
            path: path.to_path_buf(),
            tensors,
            head: (crc, head),
        })
    }

    /// Writes `bytes`, the next piece of tensor `t` (in the order given to
    /// [`StreamedFile::create`]).
    ///
    /// # Errors
    /// `Checkpoint` for an I/O error, or a piece past the tensor's end.
    pub(crate) fn put(&mut self, t: usize, bytes: &[u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let (start, len, put, crc) = &mut self.tensors[t];
        if *put + bytes.len() as u64 > *len {
            return Err(ckpt_err(&self.path, "a tensor's pieces overrun it"));
        }
        self.file
            .write_all_at(bytes, *start + *put)
            .map_err(|e| io_err(&self.path, "cannot write", &e))?;
        *crc = crc32c::crc32c_append(*crc, bytes);
        *put += bytes.len() as u64;
        Ok(())
    }

    /// The file's size and CRC-32C, once every tensor is whole.
    ///
    /// # Errors
    /// `Checkpoint` when a tensor was not filled.
    pub(crate) fn finish(self) -> Result<(u64, u32)> {
        let (mut crc, mut size) = self.head;
        for &(_, len, put, c) in &self.tensors {
            if put != len {
                return Err(ckpt_err(&self.path, "a tensor was left short"));
            }
            crc = crc32c::crc32c_combine(crc, c, len as usize);
            size += len;
        }
        Ok((size, crc))
    }
}

/// A safetensors header (the crate's own `Metadata` as JSON), padded with
/// spaces after the JSON (as safetensors allows) so that the tensors'
/// bytes start on a 64-byte boundary: a file's first tensors (a shard
/// file's index, then its rows) are then aligned to cache lines where a
/// mapped reader reads them at random (a 256-byte row at an offset of 16
/// spans 5 lines, not 4).
fn header_bytes(
    path: &Path,
    metadata: Option<std::collections::HashMap<String, String>>,
    infos: Vec<(String, TensorInfo)>,
) -> Result<Vec<u8>> {
    let meta = Metadata::new(metadata, infos)
        .map_err(|e| ckpt_err(path, format!("cannot describe the tensors: {e}")))?;
    let mut header = serde_json::to_vec(&meta)
        .map_err(|e| ckpt_err(path, format!("cannot serialize the header: {e}")))?;
    header.resize((8 + header.len()).next_multiple_of(64) - 8, b' ');
    Ok(header)
}

/// The tensors of one shard file, checked against the manifest.
pub(crate) struct Rows<'a> {
    pub(crate) keys: Cow<'a, [i64]>,
    pub(crate) rows: Cow<'a, [f32]>,
    /// For 8-bit rows, the rows as the table holds them (words a row), so
    /// that a load keeps their bytes; `rows` holds them decoded.
    pub(crate) stored: Option<Cow<'a, [f32]>>,
    pub(crate) state: Option<Cow<'a, [f32]>>,
    /// Per-row policy metadata, 4 words a row ([`Meta::to_words`]).
    pub(crate) meta: Option<Cow<'a, [u32]>>,
}

/// Rows stored in `fmt` as float32 (exact: every 16-bit value is a float32).
pub(crate) fn rows_f32(fmt: RowFormat, dim: usize, b: &[u8]) -> Cow<'_, [f32]> {
    if fmt == RowFormat::F32 {
        return f32s(b);
    }
    if fmt == RowFormat::I8 {
        let per = fmt.file_row_bytes(dim);
        let mut out = vec![0.0f32; b.len() / per.max(1) * dim];
        for (o, row) in out
            .chunks_exact_mut(dim.max(1))
            .zip(b.chunks_exact(per.max(1)))
        {
            fmt.decode_bytes(row, o);
        }
        return Cow::Owned(out);
    }
    let mut out = vec![0.0f32; b.len() / fmt.item_bytes()];
    fmt.decode_bytes(b, &mut out);
    Cow::Owned(out)
}

/// Little-endian bytes as numbers: borrowed in place when the machine is
/// little-endian and the bytes are aligned (the usual case: tensors start at
/// 8-byte offsets of a heap buffer), converted otherwise.
pub(crate) trait FromLe: Plain {
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

pub(crate) fn f32s(b: &[u8]) -> Cow<'_, [f32]> {
    f32::view(b)
}

pub(crate) fn i64s(b: &[u8]) -> Cow<'_, [i64]> {
    i64::view(b)
}

/// Checks a rows file whole without converting it (tensors, finite rows
/// and state, its index and shard), its scans run as `scan` says; returns
/// the shard count its header names (`None`: a file without an index),
/// which every file of one link must share ([`same_shard_count`]).
pub(crate) fn check_rows(
    m: &Manifest,
    path: &Path,
    e: &FileEntry,
    buf: &[u8],
    scan: Scan,
) -> Result<Option<usize>> {
    check_rows_with(m, path, e, buf, scan, true)
}

/// [`check_rows`], with the checks of the rows' and state's values (finite,
/// and state a step can produce) left to the caller where `finite` is
/// false: a load measures their magnitudes before it inserts them, a scan
/// that finds a NaN or inf too (then named by [`finite_in_file`]), so the
/// bytes are read once for both; it then runs [`state_possible`].
pub(crate) fn check_rows_with(
    m: &Manifest,
    path: &Path,
    e: &FileEntry,
    buf: &[u8],
    scan: Scan,
    finite: bool,
) -> Result<Option<usize>> {
    let cols = Columns::read(m, path, e, buf)?;
    if finite {
        finite_in_file(path, "rows", &rows_f32(cols.format, m.dim, cols.rows), scan)?;
        if let Some(state) = cols.state {
            let state = f32s(state);
            finite_in_file(path, "state", &state, scan)?;
            state_possible(m, path, &state, scan)?;
        }
    }
    check_index(path, &cols)
}

/// Checks a rows file's hash index and shard, where it has one, as a
/// mapped reader relies on them (`file_index::check_layout`): a load
/// refuses what `Table.load(path, mmap=True)` would refuse.
fn check_index(path: &Path, cols: &Columns<'_>) -> Result<Option<usize>> {
    let Some((index, place)) = cols.index else {
        return Ok(None);
    };
    let bad = |m: String| ckpt_err(path, format!("{m} (damaged)"));
    let (keys, index) = (i64s(cols.keys), i64s(index));
    file_index::check_layout(
        cols.n,
        |r| keys[r],
        index.len() / 2,
        |i| (index[2 * i], index[2 * i + 1]),
        place,
    )
    .map_err(bad)?;
    Ok(Some(place.1))
}

/// Refuses a link whose files name different shard counts in their headers
/// (`counts`: each file's path and count, as [`check_rows`] returned it):
/// one table saved them, so a mapped reader could not route a key among
/// them.
///
/// # Errors
/// `Checkpoint` naming the first file that differs from the link's first.
pub(crate) fn same_shard_count<'p>(
    counts: impl IntoIterator<Item = (&'p Path, Option<usize>)>,
) -> Result<()> {
    let mut first = None;
    for (path, n) in counts {
        let Some(n) = n else { continue };
        match first {
            None => first = Some(n),
            Some(shards) if shards != n => {
                return Err(ckpt_err(
                    path,
                    format!("saved by a table of {n} shards, its link's other files by {shards}"),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Refuses a file's state (found finite) that no step can produce (a
/// negative accumulator), damage too: the next step would make the row NaN.
pub(crate) fn state_possible(m: &Manifest, path: &Path, state: &[f32], scan: Scan) -> Result<()> {
    if let Some(opt) = &m.optimizer {
        let opt = Optimizer::from_named(&opt.name, &opt.params)
            .map_err(|err| ckpt_err(path, err.to_string()))?;
        opt.check_state_on("state", m.dim, state, scan)
            .map_err(|err| ckpt_err(path, format!("tensor \"state\": {err} (damaged)")))?;
    }
    Ok(())
}

/// Refuses a tensor holding NaN or inf (a row or state that no call could
/// have written), its scan run as `scan` says.
pub(crate) fn finite_in_file(path: &Path, name: &str, v: &[f32], scan: Scan) -> Result<()> {
    check_finite_max_on("values", v, scan)
        .map(|_| ())
        .map_err(|e| match e {
            StoreError::NonFinite { index, .. } => ckpt_err(
                path,
                format!("tensor {name:?} holds NaN or inf at flat index {index} (damaged)"),
            ),
            other => other,
        })
}

/// Parses and checks one rows file of the manifest.
pub(crate) fn parse_rows<'a>(
    m: &Manifest,
    path: &Path,
    e: &FileEntry,
    buf: &'a [u8],
) -> Result<Rows<'a>> {
    let cols = Columns::read(m, path, e, buf)?;
    let fmt = cols.format;
    Ok(Rows {
        keys: i64s(cols.keys),
        rows: rows_f32(fmt, m.dim, cols.rows),
        stored: (fmt == RowFormat::I8).then(|| f32s(cols.rows)),
        state: cols.state.map(f32s),
        meta: cols.meta.map(u32::view),
    })
}

/// Parses and checks one removed-keys file.
pub(crate) fn parse_removed<'a>(
    path: &Path,
    e: &FileEntry,
    buf: &'a [u8],
) -> Result<Cow<'a, [i64]>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::codec::RowFormat;
    use crate::format::columns::tensor;
    use crate::testing::temp_dir;

    #[test]
    fn tensors_round_trip_through_a_safetensors_file() {
        let dir = temp_dir("tensors");
        let path = dir.join("t.safetensors");
        let mut keys = Vec::new();
        i64::extend_le(&[3, -1, i64::MAX], &mut keys);
        let mut rows = Vec::new();
        f32::extend_le(&[1.5, -2.0, 0.25, 8.0, 0.0, -0.5], &mut rows);
        let (bytes, crc) = write_safetensors(
            &path,
            &[
                TensorOut {
                    name: "keys",
                    dtype: Dtype::I64,
                    shape: vec![3],
                    bytes: &keys,
                },
                TensorOut {
                    name: "rows",
                    dtype: Dtype::F32,
                    shape: vec![3, 2],
                    bytes: &rows,
                },
            ],
        )
        .unwrap();
        let data = std::fs::read(&path).unwrap();
        assert_eq!(bytes, data.len() as u64);
        assert_eq!(crc, crc32c::crc32c(&data));
        let st = SafeTensors::deserialize(&data).unwrap();
        let k = tensor(&st, &path, "keys").unwrap();
        assert_eq!(&*i64s(k.data()), &[3, -1, i64::MAX]);
        let r = tensor(&st, &path, "rows").unwrap();
        assert_eq!(r.shape(), &[3, 2]);
        assert_eq!(f32s(r.data())[3], 8.0);
        assert!(tensor(&st, &path, "state").is_err());
    }

    #[test]
    fn a_file_streamed_in_pieces_is_the_file_written_whole() {
        let dir = temp_dir("tensors-streamed");
        let mut a = Vec::new();
        i64::extend_le(&(0..1000).collect::<Vec<i64>>(), &mut a);
        let mut b = Vec::new();
        f32::extend_le(
            &(0..777).map(|i| i as f32 * 0.5).collect::<Vec<_>>(),
            &mut b,
        );
        let meta = || Some([("k".to_string(), "v".to_string())].into_iter().collect());
        let whole = dir.join("whole.safetensors");
        let (size, crc) = write_safetensors_with(
            &whole,
            &[
                TensorOut {
                    name: "a",
                    dtype: Dtype::I64,
                    shape: vec![1000],
                    bytes: &a,
                },
                TensorOut {
                    name: "b",
                    dtype: Dtype::F32,
                    shape: vec![777],
                    bytes: &b,
                },
            ],
            meta(),
        )
        .unwrap();
        let streamed = dir.join("streamed.safetensors");
        let specs = [
            ("a", Dtype::I64, vec![1000], a.len()),
            ("b", Dtype::F32, vec![777], b.len()),
        ];
        let mut f = StreamedFile::create(&streamed, &specs, meta()).unwrap();
        // Pieces of both tensors, interleaved, of uneven sizes.
        let (mut ia, mut ib) = (0, 0);
        while ia < a.len() || ib < b.len() {
            let na = (a.len() - ia).min(1234);
            f.put(0, &a[ia..ia + na]).unwrap();
            ia += na;
            let nb = (b.len() - ib).min(333);
            f.put(1, &b[ib..ib + nb]).unwrap();
            ib += nb;
        }
        assert!(f.put(1, &[0]).is_err());
        assert_eq!(f.finish().unwrap(), (size, crc));
        assert_eq!(
            std::fs::read(&whole).unwrap(),
            std::fs::read(&streamed).unwrap()
        );
        let short = dir.join("short.safetensors");
        let mut f = StreamedFile::create(&short, &specs, None).unwrap();
        f.put(0, &a).unwrap();
        assert!(f.finish().is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn compact_rows_widen_to_f32() {
        assert_eq!(rows_dtype(RowFormat::F16), Dtype::F16);
        assert_eq!(rows_dtype(RowFormat::BF16), Dtype::BF16);
        let mut b = Vec::new();
        u16::extend_le(&[half::f16::from_f32(1.5).to_bits()], &mut b);
        assert_eq!(&*rows_f32(RowFormat::F16, 1, &b), &[1.5]);
    }
}
