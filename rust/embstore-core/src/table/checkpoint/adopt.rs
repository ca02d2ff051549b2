//! A disk table's load of a checkpoint file by adoption: the file, checked
//! whole, becomes one of its shard's segments on disk
//! ([`storage::base`](crate::table::storage::base)) and its rows are named
//! there, so a checkpoint larger than memory loads at the rate it is read.

use std::path::Path;

use rayon::prelude::*;
use safetensors::tensor::{Dtype, SafeTensors};

use crate::error::{Result, ckpt_err, oom};
use crate::format::file_index;
use crate::format::manifest::{FileEntry, Manifest};
use crate::format::tensors::{expect_tensor, f32s, i64s, rows_f32, rows_tensor};
use crate::table::Table;
use crate::table::storage::base::{Columns, row_crc};
use crate::table::storage::cold::Loc;
use crate::table::storage::write;

impl Table {
    /// Takes the rows file `e` of the checkpoint at `dir` (`buf`: its
    /// bytes, checked whole by the caller) into this disk table as a
    /// segment of the shard it was saved from, its rows of save generation
    /// 1 (a load's). `false`, with nothing changed, where the file cannot
    /// be adopted as it is: a table in memory, another shard count, a file
    /// without its index, or one without the state or metadata the table
    /// keeps; the caller then loads its rows.
    ///
    /// # Errors
    /// `Checkpoint` when the file cannot be linked or copied into the
    /// table's directory; `OutOfMemory` naming `path` for the rows' index.
    pub(crate) fn adopt_file(
        &self,
        m: &Manifest,
        dir: &Path,
        e: &FileEntry,
        buf: &[u8],
    ) -> Result<bool> {
        // A file of another row format than the table's is loaded, its
        // rows converted, not taken as it is.
        if self.cold.is_none() || m.format()? != self.policy.format {
            return Ok(false);
        }
        let path = dir.join(&e.name);
        let Some((shard, cols)) = self.columns(m, &path, e, buf)? else {
            return Ok(false);
        };
        if cols.rows == 0 {
            return Ok(true);
        }
        let st = SafeTensors::deserialize(buf)
            .map_err(|err| ckpt_err(&path, format!("not a safetensors file: {err}")))?;
        let n = e.rows as usize;
        let keys = i64s(expect_tensor(&st, &path, "keys", Dtype::I64, &[n])?);
        // What the rows hold, in the bounds every step's non-finite check
        // starts from (as a load into memory raises them).
        let fmt = self.policy.format;
        let rows = rows_f32(fmt, self.dim, rows_tensor(&st, &path, fmt, n, self.dim)?);
        let state = match cols.state {
            Some(_) => f32s(expect_tensor(
                &st,
                &path,
                "state",
                Dtype::F32,
                &[n, self.state_len],
            )?),
            None => std::borrow::Cow::Borrowed(&[][..]),
        };
        // The loader's value check (finite rows and state, state a step
        // can produce), as a load into memory and a mapped read run it.
        let mut mag =
            super::load::magnitudes_of_file(self, m, &path, &rows, cols.state.map(|_| &state[..]))?;
        drop((rows, state));
        mag.w *= 1.0 + 1.0 / 128.0;
        self.bounds.raise(&mag);
        // Each row's CRC, from the checked bytes, as a read will take it.
        let crcs: Vec<u32> = (0..cols.rows)
            .into_par_iter()
            .map_init(
                || vec![0u8; cols.body_bytes()],
                |body, r| {
                    cols.blank(body);
                    for (off, len, at) in cols.pieces(r) {
                        let off = off as usize;
                        body[at..at + len].copy_from_slice(&buf[off..off + len]);
                    }
                    row_crc(body)
                },
            )
            .collect();
        let mut g = write(&self.shards[shard]);
        // A row an earlier file of the chain loaded into memory (one that
        // could not be adopted) is replaced.
        for &key in keys.iter() {
            let hash = crate::hash::key_hash(key);
            if g.find(key, hash).is_some() {
                g.remove(key, hash);
            }
        }
        if cols.meta.is_none() {
            crate::table::counters::Counters::add(&g.counters().inserts, n);
        }
        let cold = g.cold.as_mut().expect("a disk table's shard");
        cold.try_reserve(n)
            .map_err(|_| oom("path", n as u128 * 24))?;
        let seg = cold.adopt(dir, &e.name, e.bytes, cols)?;
        for (r, (&key, &crc)) in keys.iter().zip(&crcs).enumerate() {
            let loc = Loc {
                seg,
                rec: r as u32,
                generation: 1,
                crc,
            };
            cold.set(key, loc);
            let meta = match cols.meta {
                Some(off) => {
                    let at = off as usize + 16 * r;
                    std::array::from_fn(|j| {
                        let b = &buf[at + 4 * j..at + 4 * j + 4];
                        u32::from_le_bytes(b.try_into().expect("4 bytes"))
                    })
                }
                None => cols.fixed_meta,
            };
            cold.set_meta(key, meta);
        }
        Ok(true)
    }

    /// The shard and columns of a checked rows file, where it can be
    /// adopted as it is (see [`Table::adopt_file`]).
    fn columns(
        &self,
        m: &Manifest,
        path: &Path,
        e: &FileEntry,
        buf: &[u8],
    ) -> Result<Option<(usize, Columns)>> {
        let (_, header) = SafeTensors::read_metadata(buf)
            .map_err(|err| ckpt_err(path, format!("not a safetensors file: {err}")))?;
        let info = header.metadata().clone().unwrap_or_default();
        let Ok(Some((shard, shards))) =
            file_index::placement(&info, header.info("index").is_some())
        else {
            return Ok(None);
        };
        let with_state = m.with_optimizer && m.state_len == self.state_len;
        let Ok(rows) = u32::try_from(e.rows) else {
            return Ok(None);
        };
        if shards != self.shards.len()
            || (self.state_len > 0 && !with_state)
            || (self.policy.tracks() && !m.has_meta())
        {
            return Ok(None);
        }
        let st = SafeTensors::deserialize(buf)
            .map_err(|err| ckpt_err(path, format!("not a safetensors file: {err}")))?;
        let n = e.rows as usize;
        let at = |b: &[u8]| (b.as_ptr() as usize - buf.as_ptr() as usize) as u64;
        let fmt = self.policy.format;
        let w = rows_tensor(&st, path, fmt, n, self.dim)?;
        let state = if self.state_len > 0 {
            let s = expect_tensor(&st, path, "state", Dtype::F32, &[n, self.state_len])?;
            Some((at(s), 4 * self.state_len))
        } else {
            None
        };
        // A file without metadata loads its rows touched once, at one tick
        // (as a load of them into memory records).
        let (meta, fixed_meta) = if m.has_meta() {
            let t = expect_tensor(&st, path, "meta", Dtype::U32, &[n, 4])?;
            (Some(at(t)), [0; 4])
        } else {
            let mut meta = crate::policy::Meta::default();
            meta.touch(self.next_tick(), self.policy.age_clock(self.step()), 1);
            (None, meta.to_words())
        };
        Ok(Some((
            shard,
            Columns {
                rows,
                ww: self.wwords,
                sl: self.state_len,
                weights: (at(w), fmt.file_row_bytes(self.dim)),
                state,
                meta,
                fixed_meta,
            },
        )))
    }
}
