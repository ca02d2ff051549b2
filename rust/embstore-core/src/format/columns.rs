//! Where a shard file's columns lie: the one reader of a rows file's
//! layout. A rows file is a safetensors file of `n` rows as columns:
//! `keys` (i64), `rows` (the manifest's row format), `state` (f32, where
//! the manifest has optimizer state), `meta` (4 u32 a row, where the
//! manifest has metadata) and `index` (the hash index of its keys, where
//! its header names its shard). The loader, a disk table's adoption of a
//! file and the mapped reader each take the columns from here, checked
//! against the manifest's dtypes and shapes.

use crate::error::{Result, ckpt_err};
use crate::format::codec::RowFormat;
use crate::format::file_index;
use crate::format::manifest::{FileEntry, Manifest};
use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use std::path::Path;

/// A rows file's columns ([`Columns::read`]): each one's bytes in the
/// file's buffer, checked for the dtype and shape the manifest says.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Columns<'d> {
    /// Rows the file holds.
    pub(crate) n: usize,
    /// The rows' format (the manifest's).
    pub(crate) format: RowFormat,
    /// `n` keys, 8 bytes each.
    pub(crate) keys: &'d [u8],
    /// `n` rows, [`Columns::row_bytes`] each.
    pub(crate) rows: &'d [u8],
    /// Bytes a row takes in `rows`.
    pub(crate) row_bytes: usize,
    /// `n` rows of optimizer state (`state_len` floats each), where the
    /// manifest has it.
    pub(crate) state: Option<&'d [u8]>,
    /// `n` rows of metadata (16 bytes each), where the manifest has it.
    pub(crate) meta: Option<&'d [u8]>,
    /// The hash index ([`file_index::slots_for`]`(n)` slots of 16 bytes)
    /// and the file's place (shard, shards), where its header names one.
    pub(crate) index: Option<(&'d [u8], (usize, usize))>,
}

impl<'d> Columns<'d> {
    /// The columns of the rows file `e` of manifest `m`, whose bytes are
    /// `buf` (read from, or mapped at, `path`).
    ///
    /// # Errors
    /// `Checkpoint` naming `path` for a file that is not safetensors, a
    /// tensor missing or of another dtype or shape than the manifest says,
    /// or a header whose shard placement is damaged.
    pub(crate) fn read(
        m: &Manifest,
        path: &Path,
        e: &FileEntry,
        buf: &'d [u8],
    ) -> Result<Columns<'d>> {
        let bad = |what: String| ckpt_err(path, what);
        let st = SafeTensors::deserialize(buf)
            .map_err(|err| bad(format!("not a safetensors file: {err}")))?;
        let (_, header) = SafeTensors::read_metadata(buf)
            .map_err(|err| bad(format!("not a safetensors file: {err}")))?;
        let n = e.rows as usize;
        let format = m.format().map_err(|err| bad(err.to_string()))?;
        let keys = expect_tensor(&st, path, "keys", Dtype::I64, &[n])?;
        let rows = expect_tensor(
            &st,
            path,
            "rows",
            rows_dtype(format),
            &[n, format.file_cols(m.dim)],
        )?;
        let state = if m.with_optimizer && m.state_len > 0 {
            Some(expect_tensor(
                &st,
                path,
                "state",
                Dtype::F32,
                &[n, m.state_len],
            )?)
        } else {
            None
        };
        let meta = if m.has_meta() {
            Some(expect_tensor(&st, path, "meta", Dtype::U32, &[n, 4])?)
        } else {
            None
        };
        let info = header.metadata().clone().unwrap_or_default();
        let place = file_index::placement(&info, header.info("index").is_some())
            .map_err(|what| bad(format!("{what} (damaged)")))?;
        let index = match place {
            Some(place) => {
                let slots = file_index::slots_for(n);
                Some((
                    expect_tensor(&st, path, "index", Dtype::I64, &[slots, 2])?,
                    place,
                ))
            }
            None => None,
        };
        Ok(Columns {
            n,
            format,
            keys,
            rows,
            row_bytes: format.file_row_bytes(m.dim),
            state,
            meta,
            index,
        })
    }

    /// Where `column` (one of this file's) starts in `buf`, the buffer it
    /// was read from.
    pub(crate) fn offset(buf: &[u8], column: &[u8]) -> u64 {
        (column.as_ptr() as usize - buf.as_ptr() as usize) as u64
    }
}

/// The safetensors dtype of rows stored in `fmt`.
pub(crate) fn rows_dtype(fmt: RowFormat) -> Dtype {
    match fmt {
        RowFormat::F32 => Dtype::F32,
        RowFormat::F16 => Dtype::F16,
        RowFormat::BF16 => Dtype::BF16,
        RowFormat::I8 => Dtype::U8,
    }
}

/// The tensor `name` of `st` (the file at `path`).
pub(crate) fn tensor<'d>(st: &SafeTensors<'d>, path: &Path, name: &str) -> Result<TensorView<'d>> {
    st.tensor(name)
        .map_err(|e| ckpt_err(path, format!("tensor {name:?}: {e}")))
}

/// The bytes of tensor `name`, checked to be of `dtype` and `shape`.
pub(crate) fn expect_tensor<'d>(
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
