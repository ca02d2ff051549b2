//! One version of a checkpoint, mapped: its chain's links, the overlay of
//! its deltas, and how a manifest becomes one.

use super::file::{MappedFile, map_file};
use crate::error::{Result, ckpt_err};
use crate::format::dirlock::{self, DirLock};
use crate::format::files::{ReadScope, with_file};
use crate::format::manifest::{MANIFEST, Manifest, read_manifest};
use crate::format::tensors::parse_removed;
use crate::hash::{key_hash, shard_of};
use crate::init::Initializer;
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// One link of the chain: its files by the saving table's shard, and the
/// keys it removed.
pub(super) struct Link {
    /// The names of its files (and its removals' file): a link is the same
    /// in two manifests when these are (a save names its files by its own
    /// id), so a refresh keeps the links it already mapped.
    pub(super) names: Vec<String>,
    pub(super) shards: usize,
    pub(super) files: Vec<Vec<MappedFile>>,
    pub(super) removed: HashSet<i64>,
}

impl Link {
    /// The names of a manifest link's files, as [`Link::names`].
    pub(super) fn names_of(link: &crate::format::manifest::Link) -> Vec<String> {
        link.files
            .iter()
            .chain(link.removed.iter())
            .map(|e| e.name.clone())
            .collect()
    }

    /// Checks every file ([`MappedFile::check`]).
    pub(super) fn check(&self) -> Result<()> {
        self.files.iter().flatten().try_for_each(MappedFile::check)
    }

    /// Asks the CPU to load the index slot where [`Link::find`] starts
    /// probing its first file of a key of hash `hash`.
    #[inline(always)]
    pub(super) fn prefetch(&self, hash: u64) {
        if self.shards > 0
            && let Some(f) = self.files[shard_of(hash, self.shards)].first()
        {
            f.prefetch_slot(hash);
        }
    }

    /// The file and row of `key` (of hash `hash`) among this link's files,
    /// not checked first: for counting only (answers come from
    /// [`Snapshot::locate`], which checks each file before it reads it).
    pub(super) fn find(&self, key: i64, hash: u64) -> Result<Option<(&MappedFile, usize)>> {
        if self.shards == 0 {
            return Ok(None);
        }
        for f in &self.files[shard_of(hash, self.shards)] {
            if let Some(r) = f.find(key)? {
                return Ok(Some((f, r)));
            }
        }
        Ok(None)
    }
}

/// One version of the checkpoint: what its manifest named, mapped. A call
/// reads one snapshot from start to end, so it sees one published version
/// whole, never a mix of two.
pub(super) struct Snapshot {
    /// The manifest's id.
    pub(super) id: String,
    pub(super) initializer: Initializer,
    pub(super) seed: u64,
    /// Newest link first.
    pub(super) links: Vec<Arc<Link>>,
    /// Every key the chain's deltas (all links but the oldest, the full
    /// one) name, with where its row is now or that it is removed: a
    /// lookup probes this, then the full link only, however long the
    /// chain. Private memory of about 32 bytes a delta key.
    pub(super) overlay: HashTable<Placed>,
    pub(super) rows: u64,
    pub(super) step: u64,
    /// Set once every file has passed its checksum check.
    pub(super) all_checked: AtomicBool,
    /// When the version was published: its manifest's modification time
    /// (a publish writes the manifest last, replacing it whole), read just
    /// after the manifest; `None` where the file system gives none.
    pub(super) published: Option<std::time::SystemTime>,
}

/// Where a key of the chain's deltas is: the link `link` places after the
/// full one (1: the first delta; the link is `links[links.len() - 1 -
/// link]`, newest first, so a publish that adds links changes no place),
/// `.files[shard][file]`, row `row`; or removed (`link == REMOVED`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Placed {
    pub(super) key: i64,
    pub(super) link: u32,
    pub(super) shard: u32,
    pub(super) file: u32,
    pub(super) row: u32,
}

/// How many keys ahead a refresh loads the full link's index line of a
/// delta's key.
const BASE_AHEAD: usize = 16;

/// [`Placed::link`] of a key the chain removed.
pub(super) const REMOVED: u32 = u32::MAX;

/// The overlay of `links` (newest first): their deltas replayed oldest
/// first, each link's removals before its files, as a load replays them.
pub(super) fn overlay_of(links: &[Arc<Link>]) -> Result<HashTable<Placed>> {
    placed_of(links, None).map(|(table, _)| table)
}

/// The overlay and replayed row count of `links` (newest first) where a
/// publish only added deltas to `prev`'s chain (every link of `prev`, in
/// order, ends `links`): `prev`'s overlay with the new deltas' keys put on
/// it, and `prev`'s rows counted forward by each key they change; `None`
/// for any other chain (a full publish, a compaction: built anew). The
/// work is the new deltas', not the chain's.
pub(super) fn overlay_after(
    prev: &Snapshot,
    links: &[Arc<Link>],
) -> Option<Result<(HashTable<Placed>, u64)>> {
    let kept = prev.links.len();
    let new = links.len().checked_sub(kept).filter(|&n| n > 0)?;
    let same = links[new..]
        .iter()
        .zip(&prev.links)
        .all(|(a, b)| Arc::ptr_eq(a, b));
    same.then(|| placed_of(links, Some((&prev.overlay, prev.rows, new))))
}

/// [`overlay_of`], or with `from` (an overlay, its chain's replayed rows
/// and how many links are new) [`overlay_after`]'s: the overlay, and the
/// rows counted forward (0 without `from`).
fn placed_of(
    links: &[Arc<Link>],
    from: Option<(&HashTable<Placed>, u64, usize)>,
) -> Result<(HashTable<Placed>, u64)> {
    let deltas = links.len().saturating_sub(1);
    let (prior, mut rows, todo) = match from {
        Some((o, rows, new)) => (Some(o), rows, new),
        None => (None, 0, deltas),
    };
    let keys_of =
        |l: &Arc<Link>| l.removed.len() + l.files.iter().flatten().map(|f| f.n).sum::<usize>();
    let adding: usize = links[..todo].iter().map(keys_of).sum();
    let oom = |n: usize| crate::error::oom("rows", n.saturating_mul(32));
    let mut table = match prior {
        // The prior overlay copied as it lies (no key hashed or placed
        // again) where it has room for the new keys: it was built with
        // room for a delta like the one that made it (reserved first: the
        // copy then allocates nothing, and a failed allocation is an error).
        Some(o) if o.capacity() - o.len() >= adding => {
            let mut t = HashTable::new();
            t.try_reserve(o.capacity(), |p: &Placed| key_hash(p.key))
                .map_err(|_| oom(o.capacity()))?;
            if t.capacity() == o.capacity() {
                t.clone_from(o);
            } else {
                for &p in o {
                    t.insert_unique(key_hash(p.key), p, |q| key_hash(q.key));
                }
            }
            t
        }
        _ => {
            let held = prior.map_or(0, HashTable::len).saturating_add(adding);
            // Room for another delta like the newest, so that the next
            // publish's refresh copies this overlay instead of placing
            // each of its keys again.
            let room = held.saturating_add(links[..todo].first().map_or(0, keys_of));
            let mut t: HashTable<Placed> = HashTable::new();
            t.try_reserve(room, |p| key_hash(p.key))
                .map_err(|_| oom(room))?;
            for &p in prior.into_iter().flatten() {
                t.insert_unique(key_hash(p.key), p, |q| key_hash(q.key));
            }
            t
        }
    };
    let base = links.last();
    let counting = prior.is_some();
    let mut put = |p: Placed| -> Result<()> {
        let hash = key_hash(p.key);
        let was = match table.entry(hash, |q| q.key == p.key, |q| key_hash(q.key)) {
            Entry::Occupied(mut e) => Some(std::mem::replace(e.get_mut(), p).link != REMOVED),
            Entry::Vacant(e) => {
                e.insert(p);
                None
            }
        };
        if prior.is_some() {
            // Held before this key's new place: by its last place in the
            // overlay, else by the full link.
            let before = match (was, base) {
                (Some(held), _) => held,
                (None, Some(b)) => b.find(p.key, hash)?.is_some(),
                (None, None) => false,
            };
            match (before, p.link != REMOVED) {
                (false, true) => rows += 1,
                (true, false) => rows = rows.saturating_sub(1),
                _ => {}
            }
        }
        Ok(())
    };
    for li in (0..todo).rev() {
        let link = &links[li];
        let place = (links.len() - 1 - li) as u32;
        for &key in &link.removed {
            put(Placed {
                key,
                link: REMOVED,
                shard: 0,
                file: 0,
                row: 0,
            })?;
        }
        for (s, files) in link.files.iter().enumerate() {
            for (fi, f) in files.iter().enumerate() {
                for r in 0..f.n {
                    if counting
                        && let Some(b) = base
                        && r + BASE_AHEAD < f.n
                    {
                        // A key the overlay lacks is looked for in the
                        // full link: its index line, loaded ahead.
                        b.prefetch(key_hash(f.key(r + BASE_AHEAD)));
                    }
                    put(Placed {
                        key: f.key(r),
                        link: place,
                        shard: s as u32,
                        file: fi as u32,
                        row: r as u32,
                    })?;
                }
            }
        }
    }
    Ok((table, rows))
}

/// Maps the links of manifest `m` at `dir` (newest first), taking those
/// `prev` holds from it.
pub(super) fn map_links(
    dir: &Path,
    m: &Arc<Manifest>,
    prev: Option<&Snapshot>,
) -> Result<Vec<Arc<Link>>> {
    let _scope = ReadScope::new(); // buffers kept from file to file
    let format = m.format()?;
    let mut links = Vec::with_capacity(m.chain.len());
    for link in m.chain.iter().rev() {
        let names = Link::names_of(link);
        if let Some(same) = prev.and_then(|p| p.links.iter().find(|l| l.names == names)) {
            links.push(same.clone());
            continue;
        }
        let removed = match &link.removed {
            Some(e) => with_file(dir, e, None, |buf| {
                parse_removed(&dir.join(&e.name), e, buf).map(|k| k.iter().copied().collect())
            })?,
            None => HashSet::new(),
        };
        let mut shards = 0;
        let mut files: Vec<Vec<MappedFile>> = Vec::new();
        for e in &link.files {
            let (f, n, s) = map_file(dir, e, m, format)?;
            if shards == 0 {
                shards = n;
                files.resize_with(n, Vec::new);
            } else if n != shards {
                return Err(ckpt_err(
                    &f.path,
                    format!("saved by a table of {n} shards, its link's other files by {shards}"),
                ));
            }
            files[s].push(f);
        }
        links.push(Arc::new(Link {
            names,
            shards,
            files,
            removed,
        }));
    }
    Ok(links)
}

/// Reads the manifest at `dir` and maps what it names (`None`: it is still
/// `prev`'s). `held`: the directory's readers' lock, which the caller took
/// before (outside any lock of its own: another process can hold it), so
/// that no save deletes the files of the manifest read before they are
/// mapped (once mapped, a file deleted stays readable); `None` where the
/// directory had no lock file: then a manifest replaced while its files
/// were mapped is read again (the lock only tried, never waited for).
///
/// Before it answers anything, the snapshot checks its deltas' files (what
/// a load checks: `MappedFile::check`), whose keys make the overlay, and
/// that the chain replays to the manifest's row count (the base's files are
/// checked on their first read).
pub(super) fn read_snapshot(
    dir: &Path,
    prev: Option<&Snapshot>,
    mut held: Option<DirLock>,
) -> Result<Option<(Arc<Manifest>, Snapshot)>> {
    let mut tries = 0;
    loop {
        let m = Arc::new(read_manifest(dir)?);
        // The link itself, never what it points to (the manifest was just
        // read as a regular file; a swap meanwhile gives no time).
        let published = std::fs::symlink_metadata(dir.join(MANIFEST))
            .ok()
            .filter(|meta| meta.is_file())
            .and_then(|meta| meta.modified().ok());
        if prev.is_some_and(|p| p.id == m.id) {
            return Ok(None);
        }
        match map_links(dir, &m, prev) {
            Ok(links) => {
                drop(held);
                let deltas = links.len().saturating_sub(1);
                links[..deltas].iter().try_for_each(|l| l.check())?;
                let (overlay, replayed) = match prev.and_then(|p| overlay_after(p, &links)) {
                    Some(built) => built?,
                    None => {
                        let overlay = overlay_of(&links)?;
                        let replayed = replayed_rows(&links, &overlay)?;
                        (overlay, replayed)
                    }
                };
                if replayed != m.rows {
                    // A damaged base reads as damage, not as a count.
                    if let Some(base) = links.last() {
                        base.check()?;
                    }
                    return Err(ckpt_err(
                        dir,
                        format!(
                            "the chain replays to {replayed} rows, the manifest says {}",
                            m.rows
                        ),
                    ));
                }
                let snap = Snapshot {
                    id: m.id.clone(),
                    initializer: Initializer::from_named(
                        &m.initializer.name,
                        &m.initializer.params,
                    )?,
                    seed: m.seed,
                    overlay,
                    links,
                    rows: m.rows,
                    step: m.step,
                    all_checked: AtomicBool::new(false),
                    published,
                };
                return Ok(Some((m, snap)));
            }
            Err(e) => {
                tries += 1;
                let replaced = read_manifest(dir).is_ok_and(|now| now.id != m.id);
                if held.is_some() || !replaced || tries >= 8 {
                    return Err(e);
                }
                // A save may have made the lock file meanwhile: taken if
                // free, never waited for.
                held = dirlock::try_reader(dir)?;
            }
        }
    }
}

/// The rows the chain `links` (newest first) replays to, whose deltas'
/// overlay is `overlay`: the base's rows, plus each delta key the chain
/// ends holding that the base lacks, less each base key it ends without.
pub(super) fn replayed_rows(links: &[Arc<Link>], overlay: &HashTable<Placed>) -> Result<u64> {
    let Some(base) = links.last() else {
        return Ok(0);
    };
    let mut rows: u64 = base.files.iter().flatten().map(|f| f.n as u64).sum();
    for p in overlay {
        let in_base = base.find(p.key, key_hash(p.key))?.is_some();
        let held = p.link != REMOVED;
        match (in_base, held) {
            (false, true) => rows += 1,
            (true, false) => rows = rows.saturating_sub(1),
            _ => {}
        }
    }
    Ok(rows)
}

impl Snapshot {
    /// Whether every file has passed its checksum check (then no call
    /// can spend time checking one).
    pub(super) fn checked(&self) -> bool {
        if self.all_checked.load(Ordering::Acquire) {
            return true;
        }
        let all = self.links.iter().all(|l| {
            l.files
                .iter()
                .flatten()
                .all(|f| matches!(f.checked.get(), Some(Ok(()))))
        });
        if all {
            self.all_checked.store(true, Ordering::Release);
        }
        all
    }

    /// The file and row holding `key`: where the deltas' overlay places
    /// it (or nowhere, removed), else in the full link. The chain so reads
    /// as a load replays it, newest link first, each link's removals
    /// before its files.
    /// Asks the CPU to load the index slot of the base link's file where
    /// [`Snapshot::locate`] will start probing for a key of hash `hash`.
    #[inline(always)]
    pub(super) fn prefetch(&self, hash: u64) {
        if let Some(base) = self.links.last() {
            base.prefetch(hash);
        }
    }

    /// Where a lookup of this version may find each key from its hash
    /// alone, as [`Snapshot::locate`] would: when no delta names a key
    /// (an empty overlay: every key is in the full link or nowhere), every
    /// file has passed its check, and the full link has at most one file
    /// a shard; then that file of each shard (`None` for a shard without).
    pub(super) fn single_files(&self) -> Option<Vec<Option<&MappedFile>>> {
        if !self.overlay.is_empty() || !self.checked() {
            return None;
        }
        let base = self.links.last()?;
        if base.shards == 0 {
            return None;
        }
        base.files
            .iter()
            .map(|fs| match fs.len() {
                0 => Some(None),
                1 => Some(Some(&fs[0])),
                _ => None,
            })
            .collect()
    }

    pub(super) fn locate(&self, key: i64, hash: u64) -> Result<Option<(&MappedFile, usize)>> {
        if !self.overlay.is_empty()
            && let Some(p) = self.overlay.find(hash, |p| p.key == key)
        {
            if p.link == REMOVED {
                return Ok(None);
            }
            let li = self.links.len() - 1 - p.link as usize;
            let f = &self.links[li].files[p.shard as usize][p.file as usize];
            f.check()?;
            return Ok(Some((f, p.row as usize)));
        }
        let Some(base) = self.links.last() else {
            return Ok(None);
        };
        if base.shards > 0 {
            // Each file is checked before anything of it is read, so a
            // damaged file is refused, never answered "missing".
            for f in &base.files[shard_of(hash, base.shards)] {
                f.check()?;
                if let Some(r) = f.find(key)? {
                    return Ok(Some((f, r)));
                }
            }
        }
        Ok(None)
    }
}
