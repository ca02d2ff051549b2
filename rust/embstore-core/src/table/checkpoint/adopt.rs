//! A disk table's load of a checkpoint file by adoption: the file, checked
//! whole, becomes one of its shard's segments on disk
//! ([`storage::base`](crate::table::storage::base)) and its rows are named
//! there, so a checkpoint larger than memory loads at the rate it is read.

use crate::table::views::Checkpointer;
use std::path::Path;

use rayon::prelude::*;

use crate::error::{Result, oom};
use crate::format::columns::Columns as FileColumns;
use crate::format::manifest::{FileEntry, Manifest};
use crate::format::tensors::{f32s, i64s, rows_f32};
use crate::table::storage::base::{Columns, row_crc};
use crate::table::storage::write;

impl<'a> Checkpointer<'a> {
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
        // A store that takes no file as it is (another tier than the
        // disk store) is given the rows by a load.
        let adopts = crate::table::storage::read(&self.shards[0])
            .cold
            .as_ref()
            .is_some_and(|c| c.adopts());
        if !adopts || m.format()? != self.policy.format {
            return Ok(false);
        }
        let path = dir.join(&e.name);
        let file = FileColumns::read(m, &path, e, buf)?;
        let Some((shard, cols)) = self.columns(m, &file, buf) else {
            return Ok(false);
        };
        if cols.rows == 0 {
            return Ok(true);
        }
        let n = file.n;
        let keys = i64s(file.keys);
        // What the rows hold, in the bounds every step's non-finite check
        // starts from (as a load into memory raises them).
        let rows = rows_f32(file.format, self.dim, file.rows);
        let state = match (cols.state, file.state) {
            (Some(_), Some(s)) => f32s(s),
            _ => std::borrow::Cow::Borrowed(&[][..]),
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
        let mut rows = keys.iter().zip(&crcs).enumerate().map(|(r, (&key, &crc))| {
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
            (key, crc, meta)
        });
        cold.adopt(dir, &e.name, e.bytes, cols, &mut rows)?;
        Ok(true)
    }

    /// The shard and segment columns of a checked rows file (`file`, its
    /// columns in `buf`), where it can be adopted as it is (see
    /// [`Checkpointer::adopt_file`]).
    fn columns(
        &self,
        m: &Manifest,
        file: &FileColumns<'_>,
        buf: &[u8],
    ) -> Option<(usize, Columns)> {
        let (_, (shard, shards)) = file.index?;
        let rows = u32::try_from(file.n).ok()?;
        let with_state = m.with_optimizer && m.state_len == self.state_len;
        if shards != self.shards.len()
            || (self.state_len > 0 && !with_state)
            || (self.policy.tracks() && !m.has_meta())
        {
            return None;
        }
        let at = |column: &[u8]| FileColumns::offset(buf, column);
        let state = match file.state {
            Some(s) if self.state_len > 0 => Some((at(s), 4 * self.state_len)),
            _ => None,
        };
        // A file without metadata loads its rows touched once, at one tick
        // (as a load of them into memory records).
        let (meta, fixed_meta) = match file.meta {
            Some(t) => (Some(at(t)), [0; 4]),
            None => {
                let mut meta = crate::policy::Meta::default();
                meta.touch(self.next_tick(), self.policy.age_clock(self.step()), 1);
                (None, meta.to_words())
            }
        };
        Some((
            shard,
            Columns {
                rows,
                ww: self.wwords,
                sl: self.state_len,
                weights: (at(file.rows), file.row_bytes),
                state,
                meta,
                fixed_meta,
            },
        ))
    }
}
