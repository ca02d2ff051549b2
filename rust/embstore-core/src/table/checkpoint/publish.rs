//! Publishing a manifest by rename (crash-safe), creating the checkpoint
//! directory, and removing files no manifest names.

use crate::error::{Result, ckpt_err};
use crate::format::dirlock::{DirLock, READERS_LOCK};
use crate::format::files::{fsync_dir, fsync_files, io_err, read_regular, write_synced};
use crate::format::manifest::{
    FileEntry, Link, MANIFEST, Manifest, PartitionRecord, VERSION, check_manifest, read_manifest,
};
use crate::format::{dirlock, untrusted};
use crate::table::Table;
use std::fs;
use std::path::Path;

/// Holds the readers' lock of the checkpoint directory `dir` shared (no
/// save deletes the files of the manifest a reader saw while it is held),
/// creating the lock file if the directory has none; for processes that
/// load one checkpoint together (the ranks of a sharded table). `None`
/// where the directory has no lock file and none can be made (a read-only
/// copy, which no save changes either).
///
/// # Errors
/// `Checkpoint` when `dir` is not a directory or its lock file is not a
/// regular file or cannot be locked.
pub fn hold_for_reading(dir: &Path) -> Result<Option<DirLock>> {
    if !dir.is_dir() {
        return Err(ckpt_err(dir, "not a checkpoint directory"));
    }
    if let Some(held) = dirlock::reader(dir)? {
        return Ok(Some(held));
    }
    match untrusted::open_or_create_file(&dir.join(READERS_LOCK)) {
        Ok(_) => dirlock::reader(dir),
        Err(e)
            if e.kind() == std::io::ErrorKind::PermissionDenied
                || e.kind() == std::io::ErrorKind::ReadOnlyFilesystem =>
        {
            Ok(None)
        }
        Err(e) => Err(ckpt_err(dir, format!("cannot create {READERS_LOCK}: {e}"))),
    }
}

/// Creates the checkpoint directory `dir` if it is missing (its parent
/// must exist) and takes its writers' lock, waiting for a save that holds
/// it: the first lock of a save ([`Table::save_locked`],
/// [`publish_parts`]), taken before any other.
///
/// # Errors
/// `Checkpoint` when the directory cannot be created, opened or locked, or
/// its lock file is not a regular file.
pub fn lock_for_writing(dir: &Path) -> Result<DirLock> {
    create_checkpoint_dir(dir)?;
    dirlock::writer(dir)
}

/// Publishes one full checkpoint, at the directory whose writers' lock
/// the caller took with [`lock_for_writing`], made of `parts` (the files each
/// part's [`Table::write_files`] wrote, e.g. one per rank of a sharded
/// table) holding `rows` rows in all, described by `table`'s configuration
/// and step, and with `partition`, how the parts' tables spread their keys
/// (a version 2 manifest): the caller never builds a manifest itself.
///
/// # Errors
/// `Checkpoint` for I/O errors, or a `rows` the files cannot hold.
pub fn publish_parts(
    writer: &DirLock,
    table: &Table,
    id: &str,
    with_optimizer: bool,
    parts: Vec<Vec<FileEntry>>,
    rows: u64,
    partition: Option<PartitionRecord>,
) -> Result<Manifest> {
    let dir = writer.dir();
    let mut m = table.manifest_base(id, with_optimizer);
    m.rows = rows;
    if partition.is_some() {
        m.version = VERSION;
    }
    m.partition = partition;
    m.chain = vec![Link {
        kind: "full".to_string(),
        files: parts.into_iter().flatten().collect(),
        removed: None,
    }];
    check_manifest(&m).map_err(|e| ckpt_err(dir, e))?;
    publish_locked(dir, &mut m)?;
    Ok(m)
}

/// Publishes at `dir` the manifest `text` (checked as a load checks it)
/// whose files were copied there (by a replica from its source), with the
/// same protocol as a save: under the writers' lock, each named file a
/// regular file of its recorded size, synced, then the manifest renamed
/// over the old one and the files no manifest names any longer deleted
/// once no reader holds the directory. The copier has checked each file's
/// CRC-32C; readers check it again before serving a row of it. Returns
/// the manifest's checksum.
///
/// # Errors
/// `Checkpoint` when the manifest does not hold, a file it names is
/// missing, not a regular file or of another size, or on I/O errors.
pub fn publish_copied(dir: &Path, text: &[u8]) -> Result<u32> {
    let mut m = crate::format::manifest::parse_manifest(dir, text)?;
    let writer = lock_for_writing(dir)?;
    for f in m.files() {
        let len = untrusted::open_in(writer.dir(), &f.name)
            .and_then(|file| file.metadata())
            .map_err(|e| io_err(dir, &format!("cannot open {}", f.name), &e))?
            .len();
        if len != f.bytes {
            return Err(ckpt_err(
                dir,
                format!("{} has {len} bytes, the manifest says {}", f.name, f.bytes),
            ));
        }
    }
    let names: Vec<String> = m.files().map(|f| f.name.clone()).collect();
    fsync_files(dir, names.iter().map(String::as_str))?;
    publish_locked(dir, &mut m)?;
    Ok(m.checksum.unwrap_or_default())
}

/// [`publish`] by a caller that holds the writers' lock.
pub(crate) fn publish_locked(dir: &Path, manifest: &mut Manifest) -> Result<u64> {
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
    // The manifest this one replaces: its files that the new one does not
    // name are the ones to delete (other unnamed files may be a part save
    // in progress, see `remove_unreferenced`).
    let previous = read_manifest(dir).ok();
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
    if let Some(_cleaner) = dirlock::cleaner(dir, dirlock::CLEAN_WAIT) {
        remove_unreferenced(dir, manifest, previous.as_ref());
    } else if let Some(prev) = &previous {
        // A reader holds the directory: the replaced files stay for it,
        // listed so that the next publish that finds no reader deletes
        // them (not an hour later, as unnamed files of unknown origin).
        retire(dir, manifest, prev);
    }
    Ok(text.len() as u64)
}

/// The list of files replaced while a reader held the directory, to
/// delete at the next publish that gets the readers' lock (one name a
/// line; untrusted like every file here: only names a save writes, not
/// named by the manifest then, are deleted).
pub(crate) const RETIRED: &str = ".embstore-retired";

/// The most bytes of [`RETIRED`] read (past it the list is started anew:
/// its files then go once stale).
const RETIRED_BYTES: u64 = 16 << 20;

/// The names listed in [`RETIRED`] (none when it is missing, unreadable or
/// too large).
fn retired(dir: &Path) -> Vec<String> {
    read_regular(&dir.join(RETIRED), RETIRED_BYTES, "no list")
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .map(|t| t.lines().map(str::to_string).collect())
        .unwrap_or_default()
}

/// Adds the files of `previous` that `m` does not name to [`RETIRED`]
/// (best effort: a failure leaves them to the stale rule). The caller
/// holds the writers' lock.
fn retire(dir: &Path, m: &Manifest, previous: &Manifest) {
    let keep: std::collections::HashSet<&str> = m.files().map(|f| f.name.as_str()).collect();
    let mut names = retired(dir);
    let before = names.len();
    names.extend(
        previous
            .files()
            .map(|f| f.name.clone())
            .filter(|n| !keep.contains(n.as_str())),
    );
    if names.len() == before {
        return;
    }
    names.sort_unstable();
    names.dedup();
    let tmp = dir.join(format!("{RETIRED}.tmp-{}", m.id));
    let _ = fs::remove_file(&tmp);
    let mut text = names.join("\n");
    text.push('\n');
    let written = untrusted::create_file(&tmp)
        .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()))
        .and_then(|()| fs::rename(&tmp, dir.join(RETIRED)));
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
}

/// Creates the checkpoint directory `dir` if it does not exist; its parent
/// must (a typo in a path should not silently create a tree of
/// directories). Several processes may create it at once.
///
/// # Errors
/// `Checkpoint` naming the missing parent, or the I/O error.
pub(crate) fn create_checkpoint_dir(dir: &Path) -> Result<()> {
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
pub(crate) fn is_ours(name: &str) -> bool {
    name == MANIFEST
        || name == READERS_LOCK
        || name == RETIRED
        || name.starts_with(&format!("{MANIFEST}.tmp-"))
        || name.starts_with(&format!("{RETIRED}.tmp-"))
        || (name.ends_with(".safetensors")
            && name.len() > 17
            && name.as_bytes()[..16].iter().all(u8::is_ascii_hexdigit)
            && name.as_bytes()[16] == b'-')
}

/// Whether `name` is a file of a single save (`{id}-SSSSS-CCCC.safetensors`,
/// `{id}-removed.safetensors`) or a temporary file a publish writes: all
/// of them are written only under the directory's writers' lock, so one
/// that no manifest names while a publish holds that lock is garbage (a
/// save that crashed, or files kept for a reader), never work in progress.
/// The parts of a sharded save (`{id}-{name}-...`, written before they are
/// published together) are not.
pub(crate) fn written_under_lock(name: &str) -> bool {
    let b = name.as_bytes();
    let id = |b: &[u8]| b.len() > 17 && b[..16].iter().all(u8::is_ascii_hexdigit) && b[16] == b'-';
    let digits = |b: &[u8]| b.iter().all(u8::is_ascii_digit);
    if name.starts_with(&format!("{MANIFEST}.tmp-")) || name.starts_with(&format!("{RETIRED}.tmp-"))
    {
        return true;
    }
    if !id(b) {
        return false;
    }
    let rest = &b[17..];
    rest == b"removed.safetensors"
        || (rest.len() == 5 + 1 + 4 + 12
            && digits(&rest[..5])
            && rest[5] == b'-'
            && digits(&rest[6..10])
            && &rest[10..] == b".safetensors")
}

/// Files no manifest names are deleted once they are this old: a save that
/// crashed, or a deletion deferred while a load read the directory. Younger
/// ones may be the parts of a save in progress (the ranks of a sharded
/// table write their files first and publish them together), so they stay.
pub(crate) const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

/// Deletes our files that `m` does not name and that either the manifest
/// it replaced (`previous`) named or are older than [`STALE_AFTER`] (best
/// effort: a failure leaves garbage, never a damaged checkpoint). The
/// caller holds the writers' lock and, so that no load is reading the
/// files of the manifest `m` replaced, the readers' lock exclusively
/// ([`dirlock::cleaner`]).
pub(crate) fn remove_unreferenced(dir: &Path, m: &Manifest, previous: Option<&Manifest>) {
    let keep: std::collections::HashSet<&str> = m.files().map(|f| f.name.as_str()).collect();
    // Replaced now, or earlier while a reader held the directory.
    let listed = retired(dir);
    let replaced: std::collections::HashSet<&str> = previous
        .into_iter()
        .flat_map(|p| p.files().map(|f| f.name.as_str()))
        .chain(listed.iter().map(String::as_str))
        .collect();
    let now = std::time::SystemTime::now();
    let stale = |e: &fs::DirEntry| {
        // The entry itself (a link is not followed); unknown age: young.
        e.metadata()
            .and_then(|md| md.modified())
            .is_ok_and(|t| now.duration_since(t).is_ok_and(|age| age > STALE_AFTER))
    };
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name != MANIFEST
                && name != READERS_LOCK
                && name != RETIRED
                && is_ours(&name)
                && !keep.contains(name.as_str())
                && (replaced.contains(name.as_str()) || written_under_lock(&name) || stale(&e))
            {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    if !listed.is_empty() {
        let _ = fs::remove_file(dir.join(RETIRED));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::manifest::MANIFEST;
    use crate::testing::{sgd, table, temp_dir};

    #[test]
    fn a_single_saves_files_are_told_from_a_parts() {
        assert!(written_under_lock(
            "0123456789abcdef-00001-0002.safetensors"
        ));
        assert!(written_under_lock("0123456789abcdef-removed.safetensors"));
        assert!(written_under_lock(&format!(
            "{MANIFEST}.tmp-0123456789abcdef"
        )));
        assert!(!written_under_lock(
            "0123456789abcdef-r0001-00001-0002.safetensors"
        ));
        assert!(!written_under_lock(
            "0123456789abcdef-00001-00001-0002.safetensors"
        ));
        assert!(!written_under_lock(
            "0123456789abcdef-removed-00001-0002.safetensors"
        ));
        assert!(!written_under_lock(MANIFEST));
        assert!(!written_under_lock("notes.txt"));
    }

    #[test]
    fn a_crashed_saves_files_go_at_the_next_publish() {
        // A save killed before its publish leaves its files unnamed: the
        // next publish (which holds the writers' lock, so no single save
        // is in flight) deletes them at once, not an hour later.
        let dir = temp_dir("publish-crashed");
        let t = table(2, 2, sgd(0.1));
        t.assign(&[1, 2], &[0.5; 4]).unwrap();
        t.save(&dir, false, true, None).unwrap();
        let crashed = dir.join("00000000000000cc-00001-0000.safetensors");
        let tmp = dir.join(format!("{MANIFEST}.tmp-00000000000000cc"));
        let part = dir.join("00000000000000dd-r0001-00000-0000.safetensors");
        for f in [&crashed, &tmp, &part] {
            std::fs::write(f, b"x").unwrap();
        }
        t.save(&dir, true, true, None).unwrap();
        assert!(!crashed.exists() && !tmp.exists());
        assert!(
            part.exists(),
            "a young part of a sharded save in flight stays"
        );
    }

    #[test]
    fn our_file_names_are_recognised_and_others_are_not() {
        assert!(is_ours(MANIFEST));
        assert!(is_ours("0123456789abcdef-00001.safetensors"));
        assert!(is_ours(&format!("{MANIFEST}.tmp-1")));
        assert!(!is_ours("notes.txt"));
        assert!(!is_ours("weights.safetensors"));
    }

    #[test]
    fn unnamed_files_stay_while_young_and_go_once_stale() {
        let dir = temp_dir("publish-stale");
        let t = table(2, 2, sgd(0.1));
        t.assign(&[1, 2], &[0.5; 4]).unwrap();
        t.save(&dir, false, true, None).unwrap();
        // A part save in progress (young) and a crashed one (old).
        let young = dir.join("00000000000000aa-r0001-00000-0000.safetensors");
        let old = dir.join("00000000000000bb-r0001-00000-0000.safetensors");
        std::fs::write(&young, b"part").unwrap();
        std::fs::write(&old, b"part").unwrap();
        let long_ago = std::time::SystemTime::now() - STALE_AFTER * 2;
        std::fs::File::options()
            .write(true)
            .open(&old)
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
        t.save(&dir, false, true, None).unwrap();
        assert!(
            young.exists(),
            "a young unnamed file (a part save in progress) was deleted"
        );
        assert!(!old.exists(), "a stale unnamed file was kept");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_save_over_another_removes_only_the_files_it_replaced() {
        let dir = temp_dir("publish");
        let t = table(2, 2, sgd(0.1));
        t.assign(&[1, 2], &[0.5; 4]).unwrap();
        let first = t.save(&dir, false, true, None).unwrap().manifest;
        std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
        let second = t.save(&dir, false, true, None).unwrap().manifest;
        for f in first.files() {
            assert!(!dir.join(&f.name).exists(), "{} removed", f.name);
        }
        for f in second.files() {
            assert!(dir.join(&f.name).exists(), "{} kept", f.name);
        }
        assert!(dir.join("notes.txt").exists(), "a file not ours is kept");
    }

    #[test]
    fn a_partition_is_recorded_in_a_version_2_manifest_and_checked() {
        use crate::format::manifest::{PartitionRecord, VERSION_PLAIN, parse_manifest};
        let dir = temp_dir("publish-partition");
        let t = table(2, 2, sgd(0.1));
        t.lookup(&[1, 2, 3], true, &mut [0.0; 6]).unwrap();
        let id = crate::format::files::new_id();
        let files = t
            .write_files(&dir, &format!("{id}-r0000"), false, None)
            .unwrap();
        let record = PartitionRecord {
            kind: "div".into(),
            key_space: Some(100),
            world_size: 3,
            version: 1,
            buckets: None,
        };
        let writer = lock_for_writing(&dir).unwrap();
        let m = publish_parts(
            &writer,
            &t,
            &id,
            false,
            vec![files],
            3,
            Some(record.clone()),
        )
        .unwrap();
        drop(writer);
        assert_eq!((m.version, m.partition.as_ref()), (VERSION, Some(&record)));
        let read = read_manifest(&dir).unwrap();
        assert_eq!(read.partition, Some(record.clone()));
        assert_eq!(
            crate::table::Table::load(&dir, None, None).unwrap().0.len(),
            3
        );
        // A plain save stays version 1 (older builds read it).
        t.save(&dir, false, false, None).unwrap();
        let plain = read_manifest(&dir).unwrap();
        assert_eq!((plain.version, plain.partition), (VERSION_PLAIN, None));
        // Crafted records are refused, named (checksums recomputed).
        let text = std::fs::read(dir.join(MANIFEST)).unwrap();
        let base: Manifest = serde_json::from_slice(&text).unwrap();
        let bad = [
            (
                PartitionRecord {
                    kind: "x".into(),
                    ..record.clone()
                },
                2,
                "partition",
            ),
            (
                PartitionRecord {
                    key_space: None,
                    ..record.clone()
                },
                2,
                "key_space",
            ),
            (
                PartitionRecord {
                    world_size: 0,
                    ..record.clone()
                },
                2,
                "world_size",
            ),
            (
                PartitionRecord {
                    version: 2,
                    ..record.clone()
                },
                2,
                "version 2",
            ),
            (record.clone(), 1, "partition in a version 1"),
        ];
        for (rec, version, says) in bad {
            let mut m = base.clone();
            m.partition = Some(rec);
            m.version = version;
            m.checksum = Some(m.compute_checksum());
            let err = parse_manifest(&dir, &serde_json::to_vec(&m).unwrap()).unwrap_err();
            assert!(err.to_string().contains(says), "{says}: {err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn files_a_reader_kept_go_at_the_next_publish_that_finds_none() {
        // At 7e7142d they stayed an hour (then went as stale unnamed
        // files): beside followers, publishes piled up dead files.
        let dir = temp_dir("publish-retired");
        let t = table(2, 2, sgd(0.1));
        t.assign(&[1, 2], &[0.5; 4]).unwrap();
        let first = t.save(&dir, false, true, None).unwrap().manifest;
        let reader = dirlock::reader(&dir).unwrap().expect("a lock file");
        t.assign(&[3], &[0.5; 2]).unwrap();
        let second = t.save(&dir, false, true, None).unwrap().manifest;
        for f in first.files() {
            assert!(dir.join(&f.name).exists(), "{} kept for the reader", f.name);
        }
        assert!(dir.join(RETIRED).exists());
        t.assign(&[4], &[0.5; 2]).unwrap();
        let third = t.save(&dir, false, true, None).unwrap().manifest;
        drop(reader);
        for f in first.files().chain(second.files()) {
            assert!(dir.join(&f.name).exists(), "{} kept for the reader", f.name);
        }
        t.assign(&[5], &[0.5; 2]).unwrap();
        let fourth = t.save(&dir, false, true, None).unwrap().manifest;
        for f in first.files().chain(second.files()).chain(third.files()) {
            assert!(!dir.join(&f.name).exists(), "{} still there", f.name);
        }
        for f in fourth.files() {
            assert!(dir.join(&f.name).exists(), "{} kept", f.name);
        }
        assert!(!dir.join(RETIRED).exists(), "the list is removed once done");
        // A crafted list names only what a save writes and the manifest
        // does not name: the manifest, the lock and foreign files stay.
        std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
        let names: Vec<&str> = fourth.files().map(|f| f.name.as_str()).collect();
        let list = format!(
            "{MANIFEST}\n{READERS_LOCK}\nnotes.txt\n../x\n{}\n",
            names.join("\n")
        );
        std::fs::write(dir.join(RETIRED), list).unwrap();
        t.assign(&[6], &[0.5; 2]).unwrap();
        let fifth = t.save(&dir, true, true, None).unwrap().manifest;
        assert!(dir.join("notes.txt").exists());
        assert!(dir.join(READERS_LOCK).exists());
        for f in fifth.files() {
            assert!(dir.join(&f.name).exists(), "{} kept", f.name);
        }
        crate::table::Table::load(&dir, None, None).unwrap();
    }

    #[test]
    fn a_checkpoint_directory_needs_an_existing_parent() {
        let dir = temp_dir("publish-parent");
        assert!(create_checkpoint_dir(&dir.join("a/b")).is_err());
        create_checkpoint_dir(&dir.join("a")).unwrap();
    }
}
