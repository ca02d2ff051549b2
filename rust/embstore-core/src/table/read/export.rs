//! The export of every row: a snapshot of one moment (`export_all`, under
//! the gate exclusively) or a read that waits for no writer (`export_live`,
//! each row copied whole under its key's version).

use crate::error::{Result, oom};
use crate::hash::key_hash;
use crate::policy::RowFormat;
use crate::table::Table;
use crate::table::batch::output::SharedOut;
use crate::table::read::disk::{Item, disk_items, read_item};
use crate::table::storage::pages;
use crate::table::storage::read;
use crate::table::storage::view::{copy_racy, racy};
use crate::table::views::DiskTier;
use crate::zeroed::zeros;
use rayon::iter::{IndexedParallelIterator, IntoParallelRefIterator, ParallelIterator};
use rayon::prelude::{ParallelSlice, ParallelSliceMut};
use std::sync::atomic::{AtomicU64, Ordering};

/// Rows a parallel job of an export copies before it counts them.
const EXPORT_BLOCK: usize = 4096;
use std::sync::PoisonError;

/// The shard number that marks a row read from disk in an export's list.
const DISK: u32 = u32::MAX;

/// A whole table as arrays ([`Table::export_all`]).
#[derive(Debug)]
pub struct Exported {
    /// Keys, ascending.
    pub keys: Vec<i64>,
    /// Weights, `dim` a row.
    pub rows: Vec<f32>,
    /// Optimizer state, `state_len` a row (empty without `with_state`).
    pub state: Vec<f32>,
    /// Policy metadata, 4 words a row (empty without it).
    pub meta: Vec<u32>,
    /// The table's call clock (the recency that metadata ticks count in).
    pub clock: u64,
}

/// `OutOfMemory` unless `bytes` fit in the memory the OS could still give.
fn need(bytes: usize) -> Result<()> {
    match pages::available_memory() {
        Some(avail) if bytes as u128 > avail as u128 => Err(oom("with_state", bytes)),
        _ => Ok(()),
    }
}

impl Table {
    /// Every row: keys ascending, their weights (`n * dim`), and with
    /// `with_state` their optimizer state (`n * state_len`). One consistent
    /// snapshot of one moment, even while other threads call the table.
    ///
    /// # Errors
    /// `OutOfMemory` when the copy cannot be allocated.
    pub fn export(&self, with_state: bool) -> Result<(Vec<i64>, Vec<f32>, Vec<f32>)> {
        let e = self.export_all(with_state, false)?;
        Ok((e.keys, e.rows, e.state))
    }

    /// [`Table::export`] with, when `with_meta` and the table tracks touches
    /// (TTL or capacity), each row's policy metadata ([`Meta::to_words`](crate::policy::Meta::to_words),
    /// 4 words a row) and the table's call clock: everything
    /// [`Table::restore`] needs to rebuild the table exactly.
    ///
    /// # Errors
    /// `OutOfMemory` when the copy cannot be allocated.
    pub fn export_all(&self, with_state: bool, with_meta: bool) -> Result<Exported> {
        self.export_all_counted(with_state, with_meta, None)
    }

    /// [`Table::export_all`] that adds the bytes of rows and state it has
    /// copied to `done` as it goes (for a progress bar).
    ///
    /// # Errors
    /// As [`Table::export_all`].
    pub fn export_all_counted(
        &self,
        with_state: bool,
        with_meta: bool,
        done: Option<&AtomicU64>,
    ) -> Result<Exported> {
        // Exclusive gate: no call that changes rows is running or can start,
        // so the shard read locks below wait for nobody, and the parallel
        // copy under them cannot be held up by a job that needs a write lock.
        let _floor = DiskTier(self).rows_in_place();
        let _gate = self.gate.write().unwrap_or_else(PoisonError::into_inner);
        if with_meta {
            self.count_queued_reads();
        }
        let guards: Vec<_> = self.shards.iter().map(|s| read(s)).collect();
        let total: usize = guards.iter().map(|g| g.len()).sum();
        let (dim, sl) = (self.dim, self.state_len);
        need(total * (16 + 4 * dim + if with_state { 4 * sl } else { 0 }))?;
        let mut refs: Vec<(i64, u32, u32)> = Vec::new();
        refs.try_reserve_exact(total)
            .map_err(|_| oom("with_state", total * 16))?;
        for (s, g) in guards.iter().enumerate() {
            refs.extend(g.keys_and_rows().map(|(k, r)| (k, s as u32, r as u32)));
        }
        // A disk table's rows on disk (shard `DISK`): listed here, each
        // read straight into the outputs by the copy below (never all read
        // into memory first: a disk table's export holds its outputs and
        // one record a thread, not every record on disk).
        let mut disk: Vec<Item> = Vec::new();
        for g in &guards {
            disk_items(g, None, &mut disk);
        }
        let words = self.wwords + sl + 4;
        refs.try_reserve_exact(disk.len())
            .map_err(|_| oom("with_state", disk.len() * 16))?;
        refs.extend(
            disk.iter()
                .enumerate()
                .map(|(j, d)| (d.key(), DISK, j as u32)),
        );
        refs.par_sort_unstable_by_key(|&(k, _, _)| k);
        let n = refs.len();
        let mut keys = zeros::<i64>("with_state", n)?;
        for (k, r) in keys.iter_mut().zip(&refs) {
            *k = r.0;
        }
        let mut rows = zeros::<f32>("with_state", n * dim)?;
        let mut state = zeros::<f32>("with_state", if with_state { n * sl } else { 0 })?;
        let with_meta = with_meta && self.policy.tracks();
        let mut meta = zeros::<u32>("with_state", if with_meta { n * 4 } else { 0 })?;
        if with_meta {
            meta.par_chunks_mut(4)
                .zip(refs.par_iter())
                .for_each(|(dst, &(_, s, r))| {
                    if s != DISK {
                        dst.copy_from_slice(&guards[s as usize].meta(r as usize).to_words());
                    }
                });
        }
        // The rows on disk's state and metadata, written by the pass that
        // reads them (each position by one job only).
        let state_out = SharedOut::new(&mut state, sl);
        // SAFETY: u32 and f32 have one size and alignment and every bit
        // pattern is a valid f32: the metadata's words are written through
        // this view as the bits they are, and `meta` is not otherwise used
        // while it lives.
        let meta_f32 =
            unsafe { std::slice::from_raw_parts_mut(meta.as_mut_ptr().cast(), meta.len()) };
        let meta_out = SharedOut::new(meta_f32, 4);
        let failed = std::sync::Mutex::new(None);
        // Copied in blocks of rows, each block counted in `done` once.
        let count = |rows: usize, width: usize| {
            if let Some(d) = done {
                d.fetch_add((rows * width * 4) as u64, Ordering::Relaxed);
            }
        };
        rows.par_chunks_mut(dim * EXPORT_BLOCK)
            .zip(refs.par_chunks(EXPORT_BLOCK))
            .enumerate()
            .for_each_init(
                || (Vec::new(), Vec::new()),
                |(buf, w), (b, (block, refs))| {
                    for (j, (dst, &(_, s, r))) in block.chunks_exact_mut(dim).zip(refs).enumerate()
                    {
                        match s {
                            DISK => {
                                let Item::Disk(d) = &disk[r as usize] else {
                                    continue;
                                };
                                if let Err(e) = read_item(d, words, buf) {
                                    *failed.lock().unwrap_or_else(PoisonError::into_inner) =
                                        Some(e);
                                    continue;
                                }
                                w.clear();
                                w.extend(buf.iter().map(|&v| f32::from_bits(v)));
                                self.read_weights(w, dst);
                                let i = b * EXPORT_BLOCK + j;
                                if with_state && sl > 0 {
                                    // SAFETY: position i is this job's only.
                                    let st = unsafe { state_out.row(i, sl) };
                                    st.copy_from_slice(&w[self.wwords..self.wwords + sl]);
                                }
                                if with_meta {
                                    // SAFETY: position i is this job's only.
                                    let m = unsafe { meta_out.row(i, 4) };
                                    m.copy_from_slice(&w[self.wwords + sl..words]);
                                }
                            }
                            _ => self.read_weights(guards[s as usize].weights(r as usize), dst),
                        }
                    }
                    count(refs.len(), dim);
                },
            );
        if let Some(e) = failed.into_inner().unwrap_or_else(PoisonError::into_inner) {
            return Err(e);
        }
        if with_state && sl > 0 {
            state
                .par_chunks_mut(sl * EXPORT_BLOCK)
                .zip(refs.par_chunks(EXPORT_BLOCK))
                .for_each(|(block, refs)| {
                    for (dst, &(_, s, r)) in block.chunks_exact_mut(sl).zip(refs) {
                        if s != DISK {
                            dst.copy_from_slice(guards[s as usize].state(r as usize));
                        }
                    }
                    count(refs.len(), sl);
                });
        }
        Ok(Exported {
            keys,
            rows,
            state,
            meta,
            clock: self.clock(),
        })
    }

    /// [`Table::export`] that waits for no writer: each shard's keys are
    /// listed from its index and each row copied whole under its key's
    /// version, with no lock ([`View::fetch`]). Each row (and its state) is
    /// one version of it, but rows are of different moments: a row changed,
    /// inserted or removed during the call is read before or after the
    /// change (a removed one is left out), each key once. No metadata:
    /// touches are not versioned.
    ///
    /// # Errors
    /// `OutOfMemory` when the copy cannot be allocated.
    pub fn export_live(&self, with_state: bool) -> Result<Exported> {
        self.export_live_counted(with_state, None)
    }

    /// [`Table::export_live`] that adds to `done` the bytes of rows and
    /// state of each shard it has read (for a progress bar).
    ///
    /// # Errors
    /// As [`Table::export_live`].
    pub fn export_live_counted(
        &self,
        with_state: bool,
        done: Option<&AtomicU64>,
    ) -> Result<Exported> {
        if self.cold.is_some() {
            // A disk table's rows on disk are read under its cold gate.
            return self.export_all_counted(with_state, false, done);
        }
        let (dim, ww) = (self.dim, self.wwords);
        let sl = if with_state { self.state_len } else { 0 };
        let format = self.policy.format;
        // The rows are copied twice (per shard, then in key order): the
        // memory both need is checked first, for the keys held now.
        let held: usize = {
            let guard = crossbeam_epoch::pin();
            self.views.iter().map(|v| v.live_count(&guard)).sum()
        };
        need(2 * held * (16 + 4 * (dim + sl)))?;
        type Part = (Vec<i64>, Vec<f32>, Vec<f32>);
        let parts: Vec<Result<Part>> = self
            .views
            .par_iter()
            .map(|view| {
                let guard = crossbeam_epoch::pin();
                let (mut keys, mut rows, mut state) = (Vec::new(), Vec::new(), Vec::new());
                let mut failed = None;
                view.each_live(&guard, |slots, key, probed| {
                    if failed.is_some() {
                        return;
                    }
                    if keys.try_reserve(1).is_err()
                        || rows.try_reserve(dim).is_err()
                        || state.try_reserve(sl).is_err()
                    {
                        failed = Some(oom("with_state", (8 + 4 * (dim + sl)) * keys.len()));
                        return;
                    }
                    let (r0, s0) = (rows.len(), state.len());
                    rows.resize(r0 + dim, 0.0);
                    state.resize(s0 + sl, 0.0);
                    let held = view.fetch(&guard, slots, probed, key, key_hash(key), |w, st| {
                        let dst = &mut rows[r0..];
                        match format {
                            // SAFETY: the row's floats in its pinned segment,
                            // copied inside the seqlock check (`copy_racy`).
                            RowFormat::F32 => unsafe { copy_racy(dst, w) },
                            // SAFETY: as above.
                            f => f.decode_on(self.backend, unsafe { racy(w, ww) }, dst),
                        }
                        if sl > 0 {
                            // SAFETY: as above, for the state's floats.
                            unsafe { copy_racy(&mut state[s0..], st) };
                        }
                    });
                    if held {
                        keys.push(key);
                    } else {
                        rows.truncate(r0);
                        state.truncate(s0);
                    }
                });
                if let Some(d) = done {
                    d.fetch_add(4 * (rows.len() + state.len()) as u64, Ordering::Relaxed);
                }
                failed.map_or(Ok((keys, rows, state)), Err)
            })
            .collect();
        let mut shards = Vec::with_capacity(parts.len());
        for p in parts {
            shards.push(p?);
        }
        let n: usize = shards.iter().map(|p| p.0.len()).sum();
        let mut refs: Vec<(i64, u32, u32)> = Vec::new();
        refs.try_reserve_exact(n)
            .map_err(|_| oom("with_state", n * 16))?;
        for (s, p) in shards.iter().enumerate() {
            refs.extend(
                p.0.iter()
                    .enumerate()
                    .map(|(j, &k)| (k, s as u32, j as u32)),
            );
        }
        // A key removed and inserted again during the scan of its shard
        // can be listed twice (its old slot before, its new one after):
        // the later read (larger `j`, same shard) is kept.
        refs.par_sort_unstable_by_key(|&(k, _, j)| (k, j));
        let mut w = 0;
        for i in 0..refs.len() {
            if i + 1 < refs.len() && refs[i + 1].0 == refs[i].0 {
                continue;
            }
            refs[w] = refs[i];
            w += 1;
        }
        refs.truncate(w);
        let n = refs.len();
        let mut keys = zeros::<i64>("with_state", n)?;
        for (k, r) in keys.iter_mut().zip(&refs) {
            *k = r.0;
        }
        let mut rows = zeros::<f32>("with_state", n * dim)?;
        rows.par_chunks_mut(dim)
            .zip(refs.par_iter())
            .for_each(|(dst, &(_, s, j))| {
                let j = j as usize;
                dst.copy_from_slice(&shards[s as usize].1[j * dim..(j + 1) * dim]);
            });
        let mut state = zeros::<f32>("with_state", n * sl)?;
        if sl > 0 {
            state
                .par_chunks_mut(sl)
                .zip(refs.par_iter())
                .for_each(|(dst, &(_, s, j))| {
                    let j = j as usize;
                    dst.copy_from_slice(&shards[s as usize].2[j * sl..(j + 1) * sl]);
                });
        }
        Ok(Exported {
            keys,
            rows,
            state,
            meta: Vec::new(),
            clock: self.clock(),
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::table::storage::write;
    use crate::testing::{sgd, table};
    use std::sync::{Arc, mpsc};
    use std::time::Duration;

    /// On a quiet table the live export equals the snapshot; with every
    /// shard's write lock and the gate held by a writer, it still returns
    /// (the snapshot would wait), and returns the same rows.
    #[test]
    fn a_live_export_equals_the_snapshot_and_waits_for_no_writer() {
        let t = Arc::new(table(3, 4, sgd(0.1)));
        let keys: Vec<i64> = (0..2_000).map(|k| k * 7_919 - 5_000).collect();
        let rows: Vec<f32> = (0..keys.len() * 3).map(|i| i as f32).collect();
        t.assign(&keys, &rows).unwrap();
        t.remove(&keys[..100]).unwrap();
        let snap = t.export_all(true, false).unwrap();
        let live = t.export_live(true).unwrap();
        assert_eq!(live.keys.len(), keys.len() - 100);
        assert_eq!(live.keys, snap.keys);
        assert_eq!(live.rows, snap.rows);
        assert_eq!(live.state, snap.state);
        let _gate = t.gate.read().unwrap();
        let _held: Vec<_> = t.shards.iter().map(|s| write(s)).collect();
        let (tx, rx) = mpsc::channel();
        let t2 = Arc::clone(&t);
        std::thread::spawn(move || tx.send(t2.export_live(false).unwrap()).unwrap());
        let got = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("a live export waits for no writer's lock");
        assert_eq!(got.keys, snap.keys);
        assert_eq!(got.rows, snap.rows);
        assert!(got.state.is_empty());
    }
}
