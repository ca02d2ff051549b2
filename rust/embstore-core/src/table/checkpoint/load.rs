//! Loading: the manifest chain checked whole, then replayed into a new
//! table; and `verify`, which checks without loading.

use crate::error::{Result, StoreError, ckpt_err, invalid};
use crate::format::dirlock::{self, DirLock};
use crate::format::files::{ReadScope, for_each_file, io_err, with_file};
use crate::format::manifest::{FileEntry, Manifest, SaveMark, parse_manifest, read_manifest};
use crate::format::tensors::{
    check_rows, check_rows_with, expect_tensor, finite_in_file, i64s, parse_removed, parse_rows,
    same_shard_count, state_possible,
};
use crate::init::Initializer;
use crate::optim::Optimizer;
use crate::policy::RowFormat;
use crate::rows::Scan;
use crate::table::batch::plan::Floor;
use crate::table::step::bounds::Magnitudes;
use crate::table::views::Checkpointer;
use crate::table::views::{DiskTier, Writer};
use crate::table::write::Taken;
use crate::table::{DiskConfig, Table, TableConfig};
use rayon::iter::{IntoParallelRefIterator, ParallelIterator};
use safetensors::tensor::{Dtype, SafeTensors};
use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// A load's own settings: what the table it makes may choose. Everything
/// else (dim, optimizer, initializer, seed, policies) is the checkpoint's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadConfig {
    /// Shards of the new table (None: the default; a disk table's: the
    /// checkpoint's count, so that it can take the files as they are).
    pub num_shards: Option<usize>,
    /// A disk table ([`DiskConfig`]), or one in memory.
    pub disk: Option<DiskConfig>,
    /// The rows' storage (None: the checkpoint's). Another format than the
    /// checkpoint's converts each file's rows as it loads (decoded, then
    /// encoded to nearest as an insert would store them), never holding
    /// two copies of the table.
    pub format: Option<RowFormat>,
}

impl LoadConfig {
    /// A load at `num_shards` shards, otherwise as saved.
    pub fn shards(num_shards: Option<usize>) -> LoadConfig {
        LoadConfig {
            num_shards,
            ..LoadConfig::default()
        }
    }

    /// From JSON `{"num_shards", "disk", "memory_bytes", "dtype"}` (each
    /// null or absent for the checkpoint's; `disk` and `memory_bytes`
    /// together or neither).
    ///
    /// # Errors
    /// `InvalidArgument` naming the setting that is not what it must be.
    pub fn from_json(text: &str) -> Result<LoadConfig> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| invalid("settings", format!("expected a JSON object: {e}")))?;
        let field = |name: &'static str| v.get(name).filter(|x| !x.is_null());
        let uint = |name: &'static str| -> Result<Option<u64>> {
            field(name)
                .map(|x| {
                    x.as_u64().ok_or_else(|| {
                        invalid(name, format!("expected a non-negative integer, got {x}"))
                    })
                })
                .transpose()
        };
        let num_shards = uint("num_shards")?.map(|n| n as usize);
        let memory_bytes = uint("memory_bytes")?;
        let disk = field("disk")
            .map(|x| {
                x.as_str()
                    .map(std::path::PathBuf::from)
                    .ok_or_else(|| invalid("disk", format!("expected a path, got {x}")))
            })
            .transpose()?;
        let disk = match (disk, memory_bytes) {
            (None, None) => None,
            (Some(path), Some(memory_bytes)) => Some(DiskConfig { path, memory_bytes }),
            (None, Some(_)) => return Err(invalid("memory_bytes", "expected disk= with it")),
            (Some(_), None) => return Err(invalid("disk", "expected memory_bytes= with it")),
        };
        let format = field("dtype")
            .map(|x| {
                x.as_str()
                    .and_then(|d| RowFormat::from_name(d).ok())
                    .ok_or_else(|| {
                        invalid(
                            "dtype",
                            format!(
                                "expected \"float32\", \"float16\", \"bfloat16\" or \"int8\", got {x}"
                            ),
                        )
                    })
            })
            .transpose()?;
        Ok(LoadConfig {
            num_shards,
            disk,
            format,
        })
    }
}

impl Table {
    /// Loads the checkpoint at `dir` into a new table (with `num_shards`
    /// shards, or the default). Each file is read once and checked whole
    /// before its rows are inserted; the table is returned only when every
    /// file held. `progress`, if given, counts bytes read (the checkpoint's
    /// size).
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
        let held = dirlock::reader(dir)?;
        Self::load_held(dir, held, num_shards, progress, keep)
    }

    /// [`Table::load_filtered`] for a caller that took the directory's
    /// readers' lock ([`super::lock_for_reading`]) first, outside any lock
    /// of its own (another process can hold it, which must not hold up
    /// anything else), or found the directory without one (`None`).
    ///
    /// # Errors
    /// As [`Table::load`].
    pub fn load_held(
        dir: &Path,
        held: Option<DirLock>,
        num_shards: Option<usize>,
        progress: Option<&AtomicU64>,
        keep: Option<&(dyn Fn(i64) -> bool + Sync)>,
    ) -> Result<(Table, Manifest)> {
        Self::load_as(dir, held, &LoadConfig::shards(num_shards), progress, keep)
    }

    /// [`Table::load_held`] with the settings of `load`: as a disk table
    /// (whose rows beyond its memory go to disk file by file as they load,
    /// so that a checkpoint larger than memory loads), at another shard
    /// count, in another row format.
    ///
    /// # Errors
    /// As [`Table::load`]; `InvalidArgument` for disk settings the table
    /// refuses.
    pub fn load_as(
        dir: &Path,
        mut held: Option<DirLock>,
        load: &LoadConfig,
        progress: Option<&AtomicU64>,
        keep: Option<&(dyn Fn(i64) -> bool + Sync)>,
    ) -> Result<(Table, Manifest)> {
        // A save to `dir` may publish a new checkpoint while this reads the
        // previous one. With the readers' lock held, the save leaves the
        // previous files in place; without one (no lock file), a load that
        // fails while the manifest changed under it reads the new one.
        let mut tries = 0;
        loop {
            let m = read_manifest(dir)?;
            let id = m.id.clone();
            match Checkpointer::load_manifest(dir, m, load, progress, keep) {
                Err(StoreError::Checkpoint { .. })
                    if held.is_none()
                        && tries < 16
                        && read_manifest(dir).is_ok_and(|now| now.id != id) =>
                {
                    tries += 1;
                    if let Some(p) = progress {
                        p.store(0, Ordering::Relaxed);
                    }
                    // A save may have made the lock file meanwhile: taken
                    // if free, never waited for.
                    held = dirlock::try_reader(dir)?;
                }
                other => return other,
            }
        }
    }

    /// [`Table::load_filtered`] of the checkpoint at `dir` whose manifest is
    /// `text` (as [`read_manifest_text`](super::read_manifest_text) gave it to one process): every
    /// rank of a sharded table loads the one checkpoint that rank 0 read,
    /// even while another process publishes a newer one. The caller holds
    /// the readers' lock ([`hold_for_reading`](super::hold_for_reading)) from before `text` was read,
    /// so its files are still there.
    ///
    /// # Errors
    /// As [`Table::load`].
    pub fn load_filtered_manifest(
        dir: &Path,
        text: &[u8],
        load: &LoadConfig,
        progress: Option<&AtomicU64>,
        keep: Option<&(dyn Fn(i64) -> bool + Sync)>,
    ) -> Result<(Table, Manifest)> {
        let m = parse_manifest(dir, text)?;
        Checkpointer::load_manifest(dir, m, load, progress, keep)
    }
}

impl<'a> Checkpointer<'a> {
    /// [`Table::load_filtered`] of the checkpoint whose manifest is `m`.
    pub(crate) fn load_manifest(
        dir: &Path,
        m: Manifest,
        load: &LoadConfig,
        progress: Option<&AtomicU64>,
        keep: Option<&(dyn Fn(i64) -> bool + Sync)>,
    ) -> Result<(Table, Manifest)> {
        let (num_shards, disk) = (load.num_shards, load.disk.as_ref());
        // Read buffers are kept from file to file until the load ends.
        let _scope = ReadScope::new();
        // Each file is read once, checked whole before its rows load (the
        // table, not yet returned, is dropped if a later file fails); a
        // disk table holds one file at a time.

        let mut cfg = TableConfig::new(m.dim);
        cfg.optimizer = m
            .optimizer
            .as_ref()
            .map(|o| Optimizer::from_named(&o.name, &o.params))
            .transpose()?;
        cfg.initializer = Initializer::from_named(&m.initializer.name, &m.initializer.params)?;
        cfg.seed = m.seed;
        // A disk table opens at the checkpoint's shard count unless told
        // otherwise, so that it can take the files as they are (adopt.rs).
        cfg.num_shards = match (num_shards, disk) {
            (None, Some(_)) => Some(m.num_shards.clamp(1, crate::format::MAX_SHARDS)),
            _ => num_shards,
        };
        cfg.policy = m.table_policy()?;
        // Another row format: each file's rows are decoded as they load
        // and stored in the table's (the file's stored words not kept).
        let saved_format = cfg.policy.format;
        if let Some(f) = load.format {
            cfg.policy.format = f;
        }
        let same_format = cfg.policy.format == saved_format;
        cfg.disk = disk.cloned();
        let table = Table::new(cfg)?;
        let on_disk = table.disk().is_some();
        // Room for the manifest's rows, but no more than the files could
        // hold (a key is 8 bytes, and each file's size is checked when it
        // is read): a manifest cannot make the load reserve memory its
        // files do not back.
        let file_bytes: u64 = m
            .chain
            .iter()
            .flat_map(|l| &l.files)
            .fold(0u64, |a, e| a.saturating_add(e.bytes));
        if !on_disk {
            table
                .try_reserve_index(m.rows.min(file_bytes / 8) as usize)
                .map_err(|_| ckpt_err(dir, format!("not enough memory for {} rows", m.rows)))?;
        }
        // Load pass: replay the chain; in each link the removals first, then
        // its files (disjoint keys) in parallel. The table is not shared yet.
        // A disk table's row from an earlier link that went to disk is
        // replaced (its disk copy forgotten), and rows beyond its memory go
        // to disk after each file.
        // `stored`: 8-bit rows as the table holds them (their bytes kept),
        // beside `rows` decoded (for the bounds).
        // `known`: the file's magnitudes ([`magnitudes_of_file`]), a bound
        // on any part of it.
        let assign = |keys: &[i64],
                      rows: &[f32],
                      stored: Option<&[f32]>,
                      st: Option<&[f32]>,
                      meta: Option<&[u32]>,
                      g,
                      known: Magnitudes| {
            let stored = stored.filter(|_| same_format);
            if !on_disk {
                let plan = Taken::Plan(table.plan(keys, Floor::Skip)?.plan);
                return Writer(&table).assign_in(
                    keys,
                    rows,
                    stored,
                    st,
                    meta,
                    g,
                    Some(known),
                    plan,
                );
            }
            // In parts, each moved out as far as memory needs before the
            // next comes in: memory holds `memory_bytes` and one part.
            const PART: usize = 1 << 16;
            let (dim, sl, ww) = (table.dim(), table.state_len(), table.weight_words());
            for (i, k) in keys.chunks(PART).enumerate() {
                let (from, n) = (i * PART, k.len());
                let r = &rows[from * dim..][..n * dim];
                let sw = stored.map(|w| &w[from * ww..][..n * ww]);
                let s = st.map(|s| &s[from * sl..][..n * sl]);
                let mt = meta.map(|mt| &mt[from * 4..][..n * 4]);
                let plan = table.plan(k, Floor::Skip)?.plan;
                DiskTier(&table).forget_on_disk(k, &plan);
                Writer(&table).assign_in(k, r, sw, s, mt, g, Some(known), Taken::Plan(plan))?;
                DiskTier(&table).spill_now();
            }
            Ok::<(), StoreError>(())
        };
        for link in &m.chain {
            if let Some(e) = &link.removed {
                with_file(dir, e, progress, |buf| {
                    table.remove(&parse_removed(&dir.join(&e.name), e, buf)?)
                })?;
            }
            let checked = std::sync::Mutex::new(Vec::new());
            let load_file = |e: &FileEntry, buf: &[u8]| -> Result<()> {
                let path = dir.join(&e.name);
                // Rows and state are found finite as their magnitudes are
                // measured, below: one pass over them for both.
                let n = check_rows_with(&m, &path, e, buf, Scan::Parallel, false)?;
                checked
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push((path.clone(), n));
                // A disk table takes the file itself as a segment where
                // it can (no row rewritten).
                if on_disk && keep.is_none() && Checkpointer(&table).adopt_file(&m, dir, e, buf)? {
                    return Ok(());
                }
                let r = parse_rows(&m, &path, e, buf)?;
                let known = magnitudes_of_file(&table, &m, &path, &r.rows, r.state.as_deref())?;
                match keep {
                    None => assign(
                        &r.keys,
                        &r.rows,
                        r.stored.as_deref(),
                        r.state.as_deref(),
                        r.meta.as_deref(),
                        1,
                        known,
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
                        let ww = m.format()?.words(dim);
                        let stored: Option<Vec<f32>> = r.stored.as_ref().map(|sw| {
                            pick.iter()
                                .flat_map(|&i| sw[i * ww..(i + 1) * ww].iter().copied())
                                .collect()
                        });
                        let meta: Option<Vec<u32>> = r.meta.as_ref().map(|mt| {
                            pick.iter()
                                .flat_map(|&i| mt[i * 4..(i + 1) * 4].iter().copied())
                                .collect()
                        });
                        assign(
                            &keys,
                            &rows,
                            stored.as_deref(),
                            state.as_deref(),
                            meta.as_deref(),
                            1,
                            known,
                        )?;
                    }
                }
                Ok(())
            };
            // A file at a time on each pool thread, as the reader thread
            // brings it; a disk table (each file adopted, or loaded and moved
            // to disk as far as memory needs) reads without the reader's
            // extra buffer.
            for_each_file(dir, &link.files, progress, !on_disk, load_file)?;
            let checked = checked
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            same_shard_count(checked.iter().map(|(p, n)| (p.as_path(), *n)))?;
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
        // Loaded rows are of save generation 1, rows changed from now on of
        // 2: an incremental save here writes those.
        table.generation.store(2, Ordering::Release);
        let canonical = fs::canonicalize(dir).map_err(|e| io_err(dir, "cannot resolve", &e))?;
        let ends = Checkpointer(&table).removal_ends();
        Checkpointer(&table).set_mark(SaveMark {
            dir: canonical,
            id: m.id.clone(),
            since: 1,
            removed_at: ends.clone(),
            base: (m.chain.len() == 1).then_some((1, ends)),
        });
        Ok((table, m))
    }
}

/// The magnitudes of a loaded file's rows and state (what inserting them
/// raises the table's bounds by: [`Magnitudes::of`]), measured in one
/// parallel pass that also finds a NaN or inf, since a non-finite value
/// makes its block's magnitude, and so the file's, non-finite: the file is
/// then refused, the tensor and the value's index named
/// ([`finite_in_file`]); then the state a step can produce
/// ([`state_possible`]), as [`check_rows`] checks a file it reads whole.
///
/// # Errors
/// `Checkpoint` for a non-finite row or state value, or impossible state.
pub(super) fn magnitudes_of_file(
    table: &Table,
    m: &Manifest,
    path: &Path,
    rows: &[f32],
    state: Option<&[f32]>,
) -> Result<Magnitudes> {
    let (dim, opt) = (table.dim(), table.optimizer.as_ref());
    let mags = Magnitudes::of(opt, dim, rows, state.unwrap_or(&[]));
    let (rows_ok, state_ok) = (mags.w.is_finite(), mags.s.iter().all(|v| v.is_finite()));
    if !rows_ok {
        finite_in_file(path, "rows", rows, Scan::Parallel)?;
    }
    if let Some(st) = state {
        // State the magnitudes do not cover whole (no optimizer to lay it
        // out, or not its layout) is checked on its own.
        let n = rows.len() / dim.max(1);
        let covered = opt.is_some_and(|o| st.len() == n * o.state_len(dim));
        if !covered || !state_ok {
            finite_in_file(path, "state", st, Scan::Parallel)?;
        }
    }
    if !(rows_ok && state_ok) {
        return Err(ckpt_err(path, "holds NaN or inf (damaged)"));
    }
    if let Some(st) = state {
        state_possible(m, path, st, Scan::Parallel)?;
    }
    Ok(mags)
}

/// A file of a checkpoint and what is wrong with it (`None`: nothing).
pub type FileCheck = (FileEntry, Option<String>);

/// Checks every file of the checkpoint at `dir`: returns the manifest and,
/// per file, `None` when it holds or the error when not.
///
/// # Errors
/// `Checkpoint` when the manifest itself cannot be read.
pub fn verify(dir: &Path) -> Result<(Manifest, Vec<FileCheck>)> {
    let _reader = dirlock::reader(dir)?;
    let _scope = ReadScope::new();
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
                    check_rows(&m, &path, e, buf, Scan::Parallel).map(|_| ())
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
pub(crate) fn replay_count(dir: &Path, m: &Manifest) -> Result<u64> {
    let _scope = ReadScope::new();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::manifest::read_manifest;
    use crate::optim::Optimizer;
    use crate::table::Table;
    use crate::testing::{table, temp_dir};

    fn adam() -> Option<Optimizer> {
        Some(Optimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        })
    }

    #[test]
    fn a_load_restores_rows_state_and_step_at_any_shard_count() {
        let dir = temp_dir("load");
        let t = table(3, 4, adam());
        let keys: Vec<i64> = (0..50).collect();
        t.apply_gradients(&keys, &[0.1; 150]).unwrap();
        t.save(&dir, false, true, None).unwrap();
        t.apply_gradients(&keys[..5], &[0.2; 15]).unwrap();
        t.save(&dir, true, true, None).unwrap();
        for shards in [1, 8] {
            let (back, m) = Table::load(&dir, Some(shards), None).unwrap();
            assert_eq!((back.step(), back.num_shards(), m.rows), (2, shards, 50));
            assert_eq!(back.export(true).unwrap(), t.export(true).unwrap());
        }
        let (_, checks) = verify(&dir).unwrap();
        assert!(checks.iter().all(|(_, err)| err.is_none()));
        assert_eq!(
            replay_count(&dir, &read_manifest(&dir).unwrap()).unwrap(),
            50
        );
    }

    #[test]
    fn a_damaged_file_fails_the_load_and_verify_names_it() {
        let dir = temp_dir("load-bad");
        let t = table(3, 2, adam());
        t.apply_gradients(&[1, 2], &[0.1; 6]).unwrap();
        let m = t.save(&dir, false, true, None).unwrap().manifest;
        let f = dir.join(&m.chain[0].files[0].name);
        let mut bytes = std::fs::read(&f).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&f, bytes).unwrap();
        assert!(Table::load(&dir, None, None).is_err());
        let (_, checks) = verify(&dir).unwrap();
        assert!(checks.iter().any(|(_, err)| err.is_some()));
    }
}
