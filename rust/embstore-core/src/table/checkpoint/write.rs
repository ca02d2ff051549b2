//! Writing a table's rows to shard files: each shard's rows gathered into
//! pieces in parallel and written as safetensors files with their
//! hash index, for a save, a publish or a part of a sharded checkpoint.

use crate::error::{Result, ckpt_err};
use crate::format::file_index;
use crate::format::files::{Gathered, fsync_files};
use crate::format::manifest::{
    FILE_BYTES, FORMAT, FileEntry, Manifest, NamedConfig, VERSION_PLAIN,
};
use crate::format::tensors::{Plain, StreamedFile, rows_dtype};
use crate::policy::Policy;
use crate::table::Table;
use crate::table::checkpoint::publish::{create_checkpoint_dir, is_ours, remove_partial};
use crate::table::read::disk::{Item, RunReader};
use crate::table::storage::{Shard, read};
use crate::table::views::Checkpointer;
use crate::table::views::DiskTier;
use rayon::iter::{IndexedParallelIterator, IntoParallelRefIterator, ParallelIterator};
use safetensors::tensor::Dtype;
use std::path::Path;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicU64, Ordering};

/// Shard `g`'s rows to write: in memory, then on disk in file order (all,
/// or those changed after save generation `since`).
fn shard_items(g: &Shard, since: Option<u32>) -> Vec<Item> {
    let mut items: Vec<Item> = g
        .rows_since(since)
        .into_iter()
        .map(|(r, k)| Item::Mem(r, k))
        .collect();
    crate::table::read::disk::disk_items(g, since, &mut items);
    items
}

/// Bytes of rows a save gathers at a time into a file it writes (per pool
/// thread writing): a file is written in pieces of this size, so what a
/// save holds beside the table is a piece a thread, plus each file's keys
/// and index (24-48 bytes a row of the file).
const WRITE_PIECE: usize = 4 << 20;

/// Puts the rows, metadata (with `meta`) and state (where gathered) of
/// `got` as the next pieces of `f`'s tensors (laid out by
/// [`Checkpointer::file_layout`]).
fn put_rows(f: &mut StreamedFile, got: &Gathered, meta: bool) -> Result<()> {
    f.put(1, &got.w)?;
    if meta {
        f.put(3, &got.mb)?;
    }
    if got.with_state {
        f.put(if meta { 4 } else { 3 }, &got.st)?;
    }
    Ok(())
}

impl Table {
    /// A manifest describing this table (no files yet), for [`publish_parts`](super::publish_parts).
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
            version: VERSION_PLAIN,
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
            .then_some(self.policy),
            clock: self.clock(),
            partition: None,
            checksum: None,
        }
    }

    /// Writes a consistent snapshot of every row to shard files named
    /// `{prefix}-...` in `dir` (created if missing; its parent must exist) and fsyncs them, without
    /// publishing a manifest: for a caller that assembles one manifest from
    /// several tables (the ranks of a sharded table), then calls [`publish_parts`](super::publish_parts).
    ///
    /// # Errors
    /// `Checkpoint` for I/O errors or a prefix that is not 16 hex digits
    /// followed by `-` and a name of plain characters (a part's name: the
    /// files of a single save, named by the id alone, are the ones a
    /// publish may delete at once when no manifest names them).
    pub fn write_files(
        &self,
        dir: &Path,
        prefix: &str,
        with_optimizer: bool,
        progress: Option<&AtomicU64>,
    ) -> Result<Vec<FileEntry>> {
        if !is_ours(&format!("{prefix}-00000-0000.safetensors"))
            || prefix.len() <= 17
            || prefix.contains(['/', '\\'])
        {
            return Err(ckpt_err(
                dir,
                format!("file prefix {prefix:?} is not a checkpoint id"),
            ));
        }
        let _floor = DiskTier(self).rows_in_place();
        let _gate = self.gate.write().unwrap_or_else(PoisonError::into_inner);
        create_checkpoint_dir(dir)?;
        let written = Checkpointer(self)
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
}

impl<'a> Checkpointer<'a> {
    /// Bytes a row takes in a file at most: its key, its weights as
    /// stored, its state if written, and room for metadata.
    pub(super) fn file_row_bytes(&self, with_state: bool) -> usize {
        8 + 4 * (self.weight_words() + if with_state { self.state_len } else { 0 }) + 16
    }

    /// Rows a file holds at most.
    pub(super) fn rows_per_file(&self, with_state: bool) -> usize {
        (FILE_BYTES / self.file_row_bytes(with_state)).max(1)
    }

    /// Copies the rows `chunk` of shard `g` (in memory, or a disk table's
    /// on disk) into `out` as the bytes of their tensors.
    ///
    /// # Errors
    /// `Checkpoint` for a row on disk that cannot be read.
    pub(super) fn gather(
        &self,
        g: &Shard,
        chunk: &[Item],
        with_state: bool,
        out: &mut Gathered,
    ) -> Result<()> {
        let dim = self.dim;
        let fmt = self.policy.format;
        let with_meta = self.policy.tracks();
        out.keys.clear();
        out.kb.clear();
        out.w.clear();
        out.st.clear();
        out.mb.clear();
        // Sized once: a copy-out's buffers are new (growing them would copy
        // and fault their pages again at each doubling).
        let n = chunk.len();
        out.keys.reserve(n);
        out.kb.reserve(n * 8);
        out.w.reserve(n * fmt.file_row_bytes(dim));
        if with_state {
            out.st.reserve(n * self.state_len * 4);
        }
        if with_meta {
            out.mb.reserve(n * 16);
        }
        let (ww, sl) = (self.wwords, self.state_len);
        let mut floats = Vec::new();
        let mut reader = RunReader::new(ww + sl + 4);
        let mut i = 0;
        while i < chunk.len() {
            match &chunk[i] {
                Item::Mem(r, key) => {
                    out.keys.push(*key);
                    let r = *r;
                    fmt.extend_stored(g.weights(r), dim, &mut out.w);
                    if with_state {
                        f32::extend_le(g.state(r), &mut out.st);
                    }
                    if with_meta {
                        u32::extend_le(&g.meta(r).to_words(), &mut out.mb);
                    }
                    i += 1;
                }
                Item::Disk(_) => {
                    // A run of rows of one file, in file order: read in
                    // windows where they lie close.
                    i += reader.read_run(&chunk[i..], |key, words| {
                        out.keys.push(key);
                        floats.clear();
                        floats.extend(words.iter().map(|&w| f32::from_bits(w)));
                        fmt.extend_stored(&floats[..ww], dim, &mut out.w);
                        if with_state {
                            f32::extend_le(&floats[ww..ww + sl], &mut out.st);
                        }
                        if with_meta {
                            u32::extend_le(&words[ww + sl..], &mut out.mb);
                        }
                        Ok(())
                    })?;
                }
            }
        }
        i64::extend_le(&out.keys, &mut out.kb);
        Ok(())
    }

    /// The tensors of a shard file of `n` rows whose index has `slots`
    /// slots, in file order (index, rows, keys, then meta and state where
    /// written), as (name, dtype, shape, bytes); and the header's strings.
    #[allow(clippy::type_complexity)]
    fn file_layout(
        &self,
        s: usize,
        n: usize,
        slots: usize,
        with_state: bool,
    ) -> (
        Vec<(&'static str, Dtype, Vec<usize>, usize)>,
        std::collections::HashMap<String, String>,
    ) {
        let fmt = self.policy.format;
        // The file's own hash index, for readers that map it
        // (`checkpoint::file_index`). It comes first, then the rows: the
        // two tensors a mapped reader reads at random start on 64-byte
        // boundaries (the header is padded to one; the index's bytes are
        // a multiple of 128).
        let mut tensors = vec![
            ("index", Dtype::I64, vec![slots, 2], slots * 16),
            (
                "rows",
                rows_dtype(fmt),
                vec![n, fmt.file_cols(self.dim)],
                n * fmt.file_row_bytes(self.dim),
            ),
            ("keys", Dtype::I64, vec![n], n * 8),
        ];
        if self.policy.tracks() {
            tensors.push(("meta", Dtype::U32, vec![n, 4], n * 16));
        }
        if with_state {
            tensors.push((
                "state",
                Dtype::F32,
                vec![n, self.state_len],
                n * self.state_len * 4,
            ));
        }
        let header = [
            ("index", file_index::INDEX_FORMAT.to_string()),
            ("num_shards", self.shards.len().to_string()),
            ("shard", s.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        (tensors, header)
    }

    /// Creates shard `s`'s `c`-th file, `{prefix}-SSSSS-CCCC.safetensors`,
    /// for the rows of `keys`, and writes its header, hash index and keys;
    /// the caller puts its rows, metadata and state ([`put_rows`]).
    fn start_file(
        &self,
        dir: &Path,
        prefix: &str,
        (s, c): (usize, usize),
        keys: &[i64],
        with_state: bool,
    ) -> Result<(String, StreamedFile)> {
        let index = file_index::build(keys);
        let (tensors, header) = self.file_layout(s, keys.len(), index.len(), with_state);
        let name = format!("{prefix}-{s:05}-{c:04}.safetensors");
        let mut f = StreamedFile::create(&dir.join(&name), &tensors, Some(header))?;
        let mut b = Vec::with_capacity(index.len() * 16);
        i64::extend_le(index.as_flattened(), &mut b);
        drop(index);
        f.put(0, &b)?;
        b.clear();
        i64::extend_le(keys, &mut b);
        f.put(2, &b)?;
        Ok((name, f))
    }

    /// Writes one gathered file, `{prefix}-SSSSS-CCCC.safetensors` for
    /// shard `s`'s `c`-th file, with its hash index.
    pub(super) fn write_gathered(
        &self,
        dir: &Path,
        prefix: &str,
        (s, c): (usize, usize),
        got: &Gathered,
        progress: Option<&AtomicU64>,
    ) -> Result<FileEntry> {
        let (name, mut f) = self.start_file(dir, prefix, (s, c), &got.keys, got.with_state)?;
        put_rows(&mut f, got, self.policy.tracks())?;
        self.finish_file(name, f, got.keys.len(), progress)
    }

    /// The entry of a file whose every tensor was put.
    fn finish_file(
        &self,
        name: String,
        f: StreamedFile,
        n: usize,
        progress: Option<&AtomicU64>,
    ) -> Result<FileEntry> {
        let (bytes, crc) = f.finish()?;
        if let Some(p) = progress {
            p.fetch_add(bytes, Ordering::Relaxed);
        }
        Ok(FileEntry {
            name,
            rows: n as u64,
            bytes,
            crc32c: crc,
        })
    }

    /// Writes the rows `chunk` of shard `g` as shard `s`'s `c`-th file,
    /// gathered a piece of at most [`WRITE_PIECE`] bytes at a time into
    /// `buf` (so a file of any size is written from one piece's memory,
    /// besides its keys and index).
    #[allow(clippy::too_many_arguments)]
    fn write_chunk(
        &self,
        g: &Shard,
        dir: &Path,
        prefix: &str,
        at: (usize, usize),
        chunk: &[Item],
        with_state: bool,
        buf: &mut Gathered,
        progress: Option<&AtomicU64>,
    ) -> Result<FileEntry> {
        let keys: Vec<i64> = chunk.iter().map(Item::key).collect();
        let (name, mut f) = self.start_file(dir, prefix, at, &keys, with_state)?;
        drop(keys);
        let per_piece = (WRITE_PIECE / self.file_row_bytes(with_state)).max(1);
        for piece in chunk.chunks(per_piece) {
            self.gather(g, piece, with_state, buf)?;
            put_rows(&mut f, buf, self.policy.tracks())?;
        }
        self.finish_file(name, f, chunk.len(), progress)
    }

    /// Writes this table's rows (all, or with `since` those changed in a
    /// later save generation) to shard files `{prefix}-SSSSS-CCCC.safetensors` in
    /// `dir`, at most about 256 MB each, and returns their entries: each
    /// file gathered and written in turn (a buffer per thread). The files
    /// are not yet fsynced (see [`publish`]). The caller holds the gate
    /// exclusively.
    pub(crate) fn write_rows(
        &self,
        dir: &Path,
        prefix: &str,
        since: Option<u32>,
        with_optimizer: bool,
        progress: Option<&AtomicU64>,
    ) -> Result<Vec<FileEntry>> {
        if self.policy.tracks() {
            self.count_queued_reads();
        }
        self.write_listed(
            dir,
            prefix,
            since,
            with_optimizer && self.state_len > 0,
            progress,
        )
    }

    /// Rows a save writes (as [`Checkpointer::rows_to_write`] lists them), counted
    /// without listing them. The caller holds the gate exclusively.
    pub(super) fn count_to_write(&self, since: Option<u32>) -> usize {
        self.shards
            .par_iter()
            .map(|lock| {
                let g = read(lock);
                g.rows_since(since).len() + crate::table::read::disk::disk_count(&g, since)
            })
            .sum()
    }

    /// Per shard, the rows to write (as [`Shard::rows_since`]). The caller
    /// holds the gate exclusively.
    pub(super) fn rows_to_write(&self, since: Option<u32>) -> Vec<Vec<Item>> {
        if self.policy.tracks() {
            self.count_queued_reads();
        }
        self.shards
            .par_iter()
            .map(|lock| shard_items(&read(lock), since))
            .collect()
    }

    /// [`Checkpointer::write_rows`]: each shard's rows listed and written in
    /// turn (a disk table's list may name millions of rows on disk).
    pub(super) fn write_listed(
        &self,
        dir: &Path,
        prefix: &str,
        since: Option<u32>,
        with_state: bool,
        progress: Option<&AtomicU64>,
    ) -> Result<Vec<FileEntry>> {
        let per_file = self.rows_per_file(with_state);
        let written: Vec<Vec<FileEntry>> = self
            .shards
            .par_iter()
            .enumerate()
            .map(|(s, lock)| -> Result<Vec<FileEntry>> {
                let g = read(lock);
                let rows = shard_items(&g, since);
                // One piece's buffers per shard's job, freed when it ends
                // (none kept between saves).
                let mut buf = Gathered {
                    with_state,
                    ..Gathered::default()
                };
                rows.chunks(per_file)
                    .enumerate()
                    .map(|(c, chunk)| {
                        let at = (s, c);
                        self.write_chunk(&g, dir, prefix, at, chunk, with_state, &mut buf, progress)
                    })
                    .collect()
            })
            .collect::<Result<_>>()?;
        Ok(written.into_iter().flatten().collect())
    }

    /// Every file [`Checkpointer::write_listed`] would write, gathered into memory
    /// (for writing after the gate is released): `(shard, file number,
    /// rows)`. The caller holds the gate exclusively.
    ///
    /// # Errors
    /// `Checkpoint` for a row on disk that cannot be read.
    pub(super) fn gather_rows(
        &self,
        lists: &[Vec<Item>],
        with_state: bool,
    ) -> Result<Vec<(usize, usize, Gathered)>> {
        let per_file = self.rows_per_file(with_state);
        let per_shard: Vec<Vec<(usize, usize, Gathered)>> = self
            .shards
            .par_iter()
            .zip(lists.par_iter())
            .enumerate()
            .map(|(s, (lock, rows))| -> Result<Vec<_>> {
                let g = read(lock);
                rows.chunks(per_file)
                    .enumerate()
                    .map(|(c, chunk)| {
                        let mut got = Gathered {
                            with_state,
                            ..Gathered::default()
                        };
                        self.gather(&g, chunk, with_state, &mut got)?;
                        Ok((s, c, got))
                    })
                    .collect()
            })
            .collect::<Result<_>>()?;
        Ok(per_shard.into_iter().flatten().collect())
    }
}
