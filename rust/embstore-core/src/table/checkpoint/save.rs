//! Saving: the rows of a snapshot written to shard files in parallel, full
//! or incremental, then published.

use crate::error::{Result, ckpt_err};
use crate::format::dirlock::DirLock;
use crate::format::files::{io_err, new_id};
use crate::format::manifest::{
    FileEntry, Link, MANIFEST, MAX_MARKS, Manifest, SaveInfo, SaveMark, read_manifest,
};
use crate::format::tensors::{Plain, TensorOut, write_safetensors};
use crate::table::checkpoint::publish::{
    is_ours, lock_for_writing, publish_locked, remove_partial,
};
use crate::table::storage::{pages, read};
use crate::table::views::Checkpointer;
use crate::table::views::DiskTier;
use crate::table::{Table, storage};
use safetensors::tensor::Dtype;
use std::fs;
use std::path::Path;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicU64, Ordering};

impl Table {
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
        let writer = lock_for_writing(dir)?;
        self.save_locked(&writer, incremental, with_optimizer, progress)
    }

    /// [`Table::save`] to the directory whose writers' lock the caller
    /// took with [`lock_for_writing`] (first, before any other lock: see
    /// the crate's lock order), so that waiting for another save's lock
    /// holds nothing else, not even the binding's call lock, and a
    /// `fork()` meanwhile goes ahead.
    ///
    /// # Errors
    /// As [`Table::save`].
    pub fn save_locked(
        &self,
        writer: &DirLock,
        incremental: bool,
        with_optimizer: bool,
        progress: Option<&AtomicU64>,
    ) -> Result<SaveInfo> {
        let dir = writer.dir();
        // A disk table's rows stay where they are until the save is done.
        let _floor = DiskTier(self).rows_in_place();
        let gate = self.gate.write().unwrap_or_else(PoisonError::into_inner);
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
        // One save at a time per directory, across threads and processes
        // (the writers' lock, held since before the gate); the base of an
        // incremental save is read under it.
        let has_manifest = dir.join(MANIFEST).exists();
        let mark = self
            .last_save
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .marks
            .iter()
            .find(|m| m.dir == canonical)
            .cloned();
        let kind = if incremental {
            let prev = if has_manifest {
                Some(read_manifest(dir)?)
            } else {
                None
            };
            match (mark, prev) {
                (Some(mark), Some(prev)) if mark.id == prev.id => {
                    if prev.with_optimizer != with_optimizer {
                        return Err(ckpt_err(
                            dir,
                            "an incremental save must use the with_optimizer of its base",
                        ));
                    }
                    Kind::continuing(mark, prev)
                }
                _ => {
                    return Err(ckpt_err(
                        dir,
                        "an incremental save needs an earlier save (or load) of this table at this path",
                    ));
                }
            }
        } else {
            Kind::Full
        };
        let id = new_id();
        let written = Checkpointer(self).write_and_publish(
            dir,
            &id,
            kind,
            with_optimizer,
            progress,
            gate,
            incremental,
        );
        let (manifest, text_len, mark, pin) = match written {
            Ok(w) => w,
            Err(e) => {
                // Nothing was published: what this save wrote is garbage
                // (and would fill the disk for the next save). Its pin on
                // the removal logs went with the error.
                remove_partial(dir, &id);
                Checkpointer(self).set_marks_unchanged();
                return Err(e);
            }
        };
        // From here the new checkpoint is the one at `dir`: its mark takes
        // over from the pin (recorded first, so the log is never without
        // one or the other).
        Checkpointer(self).set_mark(SaveMark {
            dir: canonical,
            ..mark
        });
        drop(pin);
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
}

impl<'a> Checkpointer<'a> {
    /// After a save that failed: the removal logs kept for the marks as
    /// they are (none logged at all without a mark, as before the save
    /// turned logging on).
    fn set_marks_unchanged(&self) {
        let (marks, pins) = {
            let m = self
                .last_save
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            (m.marks.len(), m.pins.len())
        };
        // Another save in flight (a pin) still needs the log.
        if marks == 0 && pins == 0 {
            for lock in self.shards.iter() {
                let mut g = storage::write(lock);
                g.track_removals = false;
                let end = g.removed.end();
                g.removed.keep_from(end);
            }
        }
    }

    /// Each shard's removal log end (the caller holds the gate exclusively,
    /// or the table is not shared yet).
    pub(crate) fn removal_ends(&self) -> Vec<u64> {
        self.shards.iter().map(|l| read(l).removed.end()).collect()
    }

    /// Records `mark` as the mark of its path (the most recent; the least
    /// recently saved path's mark is forgotten past [`MAX_MARKS`]) and
    /// drops the removals no mark needs. The caller holds the path's
    /// writers' lock (a save, after releasing the gate) or the table is not
    /// shared yet. A save at another path meanwhile only moves its own
    /// mark's positions forward, so positions computed here before it keep
    /// more of a log than the marks then need, never less.
    pub(crate) fn set_mark(&self, mark: SaveMark) {
        // The marks' lock is a leaf: released before the shard locks.
        let keep: Vec<u64> = {
            let mut saved = self
                .last_save
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let marks = &mut saved.marks;
            marks.retain(|m| m.dir != mark.dir);
            marks.push(mark);
            if marks.len() > MAX_MARKS {
                marks.remove(0);
            }
            saved.needed(self.shards.len())
        };
        for (lock, &from) in self.shards.iter().zip(&keep) {
            let mut g = storage::write(lock);
            g.removed.keep_from(from);
            g.track_removals = true;
        }
    }

    /// The writing part of [`Table::save`]: the files of a new link (all
    /// rows, or the changes `kind` names), then the manifest, published.
    /// Returns the manifest, its size and the path's new mark (its `dir`
    /// left for the caller). The caller holds the writers' lock and passes
    /// the gate, held exclusively: the snapshot is taken under it. With
    /// `copy_out` (an incremental save: a publish, which may also compact
    /// its chain), when the rows to write fit in [`SNAPSHOT_BYTES`] (and a
    /// quarter of the memory available), they are copied out and the gate
    /// released before any file is written, so that training goes on while
    /// a publish writes; otherwise (a full save asked for, which would
    /// take longer to copy out and write than to write) each file is
    /// written under the gate, in parallel. The caller removes what was
    /// written when this fails.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_and_publish(
        &self,
        dir: &Path,
        id: &str,
        kind: Kind,
        with_optimizer: bool,
        progress: Option<&AtomicU64>,
        gate: std::sync::RwLockWriteGuard<'_, ()>,
        copy_out: bool,
    ) -> Result<(Manifest, u64, SaveMark, Pin<'a>)> {
        // A mark whose removals the log no longer holds (it never should:
        // marks and pins keep them) cannot write a true delta: the save
        // writes everything instead of losing removals.
        let kind = match kind {
            Kind::Delta { ref mark, .. } | Kind::Compact { ref mark, .. }
                if !self.log_holds(mark) =>
            {
                Kind::Full
            }
            other => other,
        };
        let (since, removed_at, chain, base) = match kind {
            Kind::Full => (None, None, Vec::new(), None),
            Kind::Delta { mark, mut prev } => (
                Some(mark.since),
                Some(mark.removed_at),
                std::mem::take(&mut prev.chain),
                mark.base,
            ),
            Kind::Compact { mark, mut prev } => {
                let (gen_, at) = mark
                    .base
                    .clone()
                    .expect("a compacting save has its base's mark");
                prev.chain.truncate(1);
                (
                    Some(gen_),
                    Some(at),
                    std::mem::take(&mut prev.chain),
                    mark.base,
                )
            }
        };
        let with_state = with_optimizer && self.state_len > 0;

        // Under the gate: what to write, the removals, the manifest's
        // figures, and the save generation moved on (rows changed from now
        // on are the next save's).
        let mut removed: Vec<i64> = Vec::new();
        if let Some(at) = &removed_at {
            for (lock, &from) in self.shards.iter().zip(at) {
                removed.extend_from_slice(read(lock).removed.since(from));
            }
        }
        let mut manifest = self.manifest_base(id, with_optimizer);
        manifest.rows = self.len() as u64;
        let row_bytes = self.file_row_bytes(with_state);
        let mut budget =
            pages::available_memory().map_or(SNAPSHOT_BYTES, |a| (a / 4).min(SNAPSHOT_BYTES));
        if self.cold.is_some() {
            // A disk table's memory is bounded by its settings: it copies
            // out no more than that bound's fixed share.
            budget = budget.min(DISK_SNAPSHOT_BYTES);
        }
        let rows = self.count_to_write(since);
        let copy = copy_out && rows.saturating_mul(row_bytes) <= budget;
        let gathered = copy
            .then(|| self.gather_rows(&self.rows_to_write(since), with_state))
            .transpose()?;
        let save_gen = self.generation.fetch_add(1, Ordering::AcqRel);
        let ends = self.removal_ends();
        // Pinned under the gate, until the caller records the mark.
        let pin = self.pin_removals(ends.clone());
        // Removals from here on are this path's next delta's: logged from
        // now (a first save's would otherwise be lost between releasing
        // the gate and recording the mark).
        for lock in self.shards.iter() {
            storage::write(lock).track_removals = true;
        }
        let mark = SaveMark {
            dir: Default::default(),
            id: id.to_string(),
            since: save_gen,
            removed_at: ends.clone(),
            base: if since.is_none() {
                Some((save_gen, ends))
            } else {
                base
            },
        };

        let files = match gathered {
            Some(files) => {
                drop(gate);
                // On the calling thread: the pool stays free for the
                // calls that go on meanwhile (a file write blocks in I/O).
                files
                    .iter()
                    .map(|(s, c, got)| self.write_gathered(dir, id, (*s, *c), got, progress))
                    .collect::<Result<Vec<_>>>()?
            }
            None => {
                if self.policy.tracks() {
                    self.count_queued_reads();
                }
                let files = self.write_listed(dir, id, since, with_state, progress)?;
                drop(gate);
                files
            }
        };
        let removed_entry = if !removed.is_empty() {
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
        manifest.chain = chain;
        manifest.chain.push(Link {
            kind: if since.is_some() { "delta" } else { "full" }.to_string(),
            files,
            removed: removed_entry,
        });
        let text_len = publish_locked(dir, &mut manifest)?;
        Ok((manifest, text_len, mark, pin))
    }

    /// Whether every shard's removal log still holds what `mark` (and its
    /// base, for a compaction) needs.
    fn log_holds(&self, mark: &SaveMark) -> bool {
        self.shards.iter().enumerate().all(|(s, lock)| {
            let base = read(lock).removed.base;
            mark.removed_at[s] >= base && mark.base.as_ref().is_none_or(|b| b.1[s] >= base)
        })
    }

    /// Keeps the removal logs from `at` (each shard's position) until the
    /// returned pin is dropped.
    fn pin_removals(&self, at: Vec<u64>) -> Pin<'a> {
        let mut saved = self
            .last_save
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let id = saved.next_pin;
        saved.next_pin += 1;
        saved.pins.push((id, at));
        Pin { table: self.0, id }
    }
}

/// A save's hold on the removal logs from its snapshot on
/// ([`Checkpointer::pin_removals`]); dropping it lets them go.
pub(crate) struct Pin<'a> {
    table: &'a Table,
    id: u64,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        self.table
            .last_save
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pins
            .retain(|p| p.0 != self.id);
    }
}

/// The most bytes of rows a save copies out of the table to write them
/// after releasing the gate (a larger one writes under the gate instead of
/// holding a second copy).
pub(crate) const SNAPSHOT_BYTES: usize = 4 << 30;

/// [`SNAPSHOT_BYTES`] for a disk table: part of the fixed overhead its
/// memory bound allows (README, "The memory a disk table uses").
pub(crate) const DISK_SNAPSHOT_BYTES: usize = 32 << 20;

/// Deltas a chain holds before an incremental save compacts it.
pub(crate) const MAX_DELTAS: usize = 8;

/// What a save writes.
#[derive(Debug, Clone)]
pub(crate) enum Kind {
    /// Every row: a new chain.
    Full,
    /// The changes since `mark` (this table's last save at the path),
    /// appended to `prev`'s chain.
    Delta { mark: SaveMark, prev: Manifest },
    /// The changes since the chain's full link, replacing its deltas.
    Compact { mark: SaveMark, prev: Manifest },
}

impl Kind {
    /// What an incremental save at a path whose checkpoint `prev` this
    /// table's `mark` names writes: a delta, or, once the chain holds
    /// [`MAX_DELTAS`] deltas, one delta of every change since its full
    /// link; a full save where the deltas hold half the base's rows or more
    /// (a load would replay more than 1.5 bases) or this table does not
    /// know the changes since the base (it loaded a chain of deltas). A
    /// chain so stays within `MAX_DELTAS + 1` links and a load or refresh
    /// reads at most about 1.5 times a full checkpoint's rows.
    fn continuing(mark: SaveMark, prev: Manifest) -> Kind {
        let rows = |l: &Link| -> u64 {
            l.files.iter().map(|f| f.rows).sum::<u64>() + l.removed.as_ref().map_or(0, |f| f.rows)
        };
        let base_rows = prev.chain.first().map_or(0, rows);
        let delta_rows: u64 = prev.chain.iter().skip(1).map(rows).sum();
        let deltas = prev.chain.len().saturating_sub(1);
        if prev.chain.is_empty() || delta_rows.saturating_mul(2) >= base_rows.max(1) {
            Kind::Full
        } else if deltas < MAX_DELTAS {
            Kind::Delta { mark, prev }
        } else if mark.base.is_some() {
            Kind::Compact { mark, prev }
        } else {
            Kind::Full
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Kind, MAX_DELTAS, MAX_MARKS, SaveMark, fs, lock_for_writing, new_id, storage};
    use crate::table::views::Checkpointer;
    use crate::testing::{sgd, table, temp_dir};

    #[test]
    fn an_incremental_save_writes_only_the_changed_rows() {
        let dir = temp_dir("save");
        let t = table(2, 2, sgd(0.1));
        t.assign(&(0..100).collect::<Vec<i64>>(), &[0.5; 200])
            .unwrap();
        let full = t.save(&dir, false, true, None).unwrap().manifest;
        t.apply_gradients(&[3, 4], &[0.1; 4]).unwrap();
        t.remove(&[7]).unwrap();
        let delta = t.save(&dir, true, true, None).unwrap().manifest;
        assert_eq!(delta.chain.len(), 2);
        let link = &delta.chain[1];
        assert_eq!(link.files.iter().map(|f| f.rows).sum::<u64>(), 2);
        assert!(link.removed.is_some());
        assert_eq!(delta.rows, 99);
        assert!(full.chain.len() == 1);
    }

    #[test]
    fn a_rows_only_save_has_no_state() {
        let dir = temp_dir("save-rows");
        let t = table(2, 2, sgd(0.1));
        t.assign(&[1], &[1.0, 2.0]).unwrap();
        let m = t.save(&dir, false, false, None).unwrap().manifest;
        assert!(!m.with_optimizer);
        assert_eq!(t.manifest_base("x", false).dim, 2);
    }

    /// The table's rows as `(keys, rows)`, keys ascending.
    fn rows_of(t: &crate::table::Table) -> (Vec<i64>, Vec<f32>) {
        let (k, r, _) = t.export(false).unwrap();
        (k, r)
    }

    #[test]
    fn each_path_keeps_its_own_incremental_chain() {
        // A trainer publishing rows-only deltas to one path and saving
        // checkpoints with state to another, interleaved: each chain loads
        // to the table as it was at that path's last save.
        let (serve, train) = (temp_dir("serve"), temp_dir("train"));
        let t = table(2, 3, sgd(0.1));
        t.assign(&(0..200).collect::<Vec<i64>>(), &[0.5; 400])
            .unwrap();
        t.save(&serve, false, false, None).unwrap();
        t.save(&train, false, true, None).unwrap();
        for round in 0..5i64 {
            t.apply_gradients(&[round, 50 + round], &[0.25; 4]).unwrap();
            t.remove(&[100 + round]).unwrap();
            t.assign(&[1_000 + round], &[3.0, 4.0]).unwrap();
            t.save(&serve, true, false, None).unwrap();
            let (back, m) = crate::table::Table::load(&serve, None, None).unwrap();
            assert!(!m.with_optimizer);
            assert_eq!(m.chain.last().unwrap().kind, "delta");
            assert_eq!(
                rows_of(&back),
                rows_of(&t),
                "the serving chain at round {round}"
            );
            if round % 2 == 0 {
                t.apply_gradients(&[7], &[1.0; 2]).unwrap();
                t.remove(&[150 + round]).unwrap();
                t.save(&train, true, true, None).unwrap();
                let (back, m) = crate::table::Table::load(&train, None, None).unwrap();
                assert!(m.with_optimizer);
                assert_eq!(
                    rows_of(&back),
                    rows_of(&t),
                    "the training chain at round {round}"
                );
            }
        }
    }

    #[test]
    fn a_full_save_elsewhere_between_a_saves_snapshot_and_its_mark_keeps_its_removals() {
        // Path A's first save stopped between its snapshot and its mark (its
        // files still being written), removals meanwhile, and a full save at
        // path B that finishes first: B's mark must not drop the removals
        // A's next delta needs (it did: that delta then missed them).
        let (a, b) = (temp_dir("pin-a"), temp_dir("pin-b"));
        let t = table(2, 2, sgd(0.1));
        t.assign(&(0..100).collect::<Vec<i64>>(), &[0.5; 200])
            .unwrap();
        let writer = lock_for_writing(&a).unwrap();
        let gate = t.gate.write().unwrap();
        let id = new_id();
        let (_, _, mark, pin) = Checkpointer(&t)
            .write_and_publish(&a, &id, Kind::Full, false, None, gate, false)
            .unwrap();
        t.remove(&[1, 2, 3]).unwrap();
        t.save(&b, false, false, None).unwrap();
        Checkpointer(&t).set_mark(SaveMark {
            dir: fs::canonicalize(&a).unwrap(),
            ..mark
        });
        drop(pin);
        drop(writer);
        let m = t.save(&a, true, false, None).unwrap().manifest;
        assert_eq!(m.chain.len(), 2, "the save at A stays incremental");
        let (back, _) = crate::table::Table::load(&a, None, None).unwrap();
        assert_eq!(rows_of(&back), rows_of(&t));
        // A mark whose removals are gone (a ninth path forgot it, say)
        // writes everything rather than a delta that misses them.
        t.remove(&[4]).unwrap();
        for lock in t.shards.iter() {
            let mut g = storage::write(lock);
            let end = g.removed.end();
            g.removed.keep_from(end);
        }
        let m = t.save(&a, true, false, None).unwrap().manifest;
        assert_eq!(
            m.chain.len(),
            1,
            "a full save, not a delta missing key 4's removal"
        );
        let (back, _) = crate::table::Table::load(&a, None, None).unwrap();
        assert_eq!(rows_of(&back), rows_of(&t));
    }

    #[test]
    fn incremental_saves_compact_their_chain() {
        // Small deltas: the chain never holds more than MAX_DELTAS deltas;
        // past that one delta of every change since the base replaces them.
        let dir = temp_dir("compact");
        let t = table(2, 2, sgd(0.1));
        t.assign(&(0..1_000).collect::<Vec<i64>>(), &[0.5; 2_000])
            .unwrap();
        t.save(&dir, false, false, None).unwrap();
        let mut kinds = Vec::new();
        for round in 0..30i64 {
            t.apply_gradients(&[round % 13, 500 + round], &[0.25; 4])
                .unwrap();
            t.remove(&[900 + round]).unwrap();
            let m = t.save(&dir, true, false, None).unwrap().manifest;
            assert!(m.chain.len() <= MAX_DELTAS + 1);
            kinds.push(m.chain.len());
            let (back, _) = crate::table::Table::load(&dir, None, None).unwrap();
            assert_eq!(rows_of(&back), rows_of(&t), "round {round}");
            let files = std::fs::read_dir(&dir).unwrap().count();
            assert!(files <= 4 * (MAX_DELTAS + 1) + 4, "{files} files");
        }
        // It compacted (the chain went back to two links) and kept the base.
        assert!(
            kinds
                .windows(2)
                .any(|w| w[0] == MAX_DELTAS + 1 && w[1] == 2),
            "{kinds:?}"
        );
        // Deltas as large as half the base: a full save instead.
        let all: Vec<i64> = (0..1_000).collect();
        t.apply_gradients(&all, &[0.5; 2_000]).unwrap();
        let m = t.save(&dir, true, false, None).unwrap().manifest;
        assert_eq!(m.chain.last().unwrap().kind, "delta");
        t.apply_gradients(&[1], &[0.5; 2]).unwrap();
        let m = t.save(&dir, true, false, None).unwrap().manifest;
        assert_eq!((m.chain.len(), m.chain[0].kind.as_str()), (1, "full"));
        let (back, _) = crate::table::Table::load(&dir, None, None).unwrap();
        assert_eq!(rows_of(&back), rows_of(&t));
    }

    #[test]
    fn a_table_loaded_from_deltas_compacts_by_saving_whole() {
        let dir = temp_dir("compact-loaded");
        let t = table(2, 2, sgd(0.1));
        t.assign(&(0..1_000).collect::<Vec<i64>>(), &[0.5; 2_000])
            .unwrap();
        t.save(&dir, false, false, None).unwrap();
        t.apply_gradients(&[1], &[0.5; 2]).unwrap();
        t.save(&dir, true, false, None).unwrap();
        let (back, _) = crate::table::Table::load(&dir, None, None).unwrap();
        for round in 0..MAX_DELTAS as i64 + 1 {
            back.apply_gradients(&[round], &[0.5; 2]).unwrap();
            back.remove(&[800 + round]).unwrap();
            back.save(&dir, true, false, None).unwrap();
        }
        let m = crate::table::checkpoint::read_manifest(&dir).unwrap();
        assert!(m.chain.len() < MAX_DELTAS + 1, "{}", m.chain.len());
        let (again, _) = crate::table::Table::load(&dir, None, None).unwrap();
        assert_eq!(rows_of(&again), rows_of(&back));
    }

    #[test]
    fn a_ninth_path_forgets_the_least_recently_saved_one() {
        let t = table(2, 2, sgd(0.1));
        t.assign(&[1], &[1.0, 2.0]).unwrap();
        let dirs: Vec<_> = (0..MAX_MARKS + 1)
            .map(|i| temp_dir(&format!("mark{i}")))
            .collect();
        for d in &dirs {
            t.save(d, false, false, None).unwrap();
        }
        t.assign(&[2], &[1.0, 2.0]).unwrap();
        let err = t.save(&dirs[0], true, false, None).unwrap_err();
        assert!(err.to_string().contains("earlier save"), "{err}");
        for d in &dirs[1..] {
            t.save(d, true, false, None).unwrap();
        }
    }
}
