//! A disk table's rows on disk read whole, for a save (in file order, an
//! incremental save's those changed since) or an export.

use std::sync::Arc;

use crate::error::Result;
use crate::table::storage::Shard;
use crate::table::storage::cold::Loc;
use crate::table::storage::tier::RecordSource;

/// A row on disk to write to a checkpoint (or export): its key, place and
/// file.
pub(crate) struct DiskItem {
    pub(crate) key: i64,
    loc: Loc,
    file: Arc<dyn RecordSource>,
}

/// A row to write: in memory (row number, key) or on disk.
pub(crate) enum Item {
    Mem(usize, i64),
    Disk(DiskItem),
}

impl Item {
    /// The row's key.
    pub(crate) fn key(&self) -> i64 {
        match self {
            Item::Mem(_, k) => *k,
            Item::Disk(d) => d.key,
        }
    }
}

/// Appends to `items` the rows shard `g` holds on disk that changed in a
/// save generation after `since` (all for `None`), in file order, so that
/// a save reads each segment front to back.
pub(crate) fn disk_items(g: &Shard, since: Option<u32>, items: &mut Vec<Item>) {
    let Some(cold) = &g.cold else {
        return;
    };
    let mut disk: Vec<DiskItem> = cold
        .entries()
        .filter(|(_, l)| since.is_none_or(|s| l.generation > s))
        .filter_map(|(key, loc)| {
            Some(DiskItem {
                key,
                loc,
                file: cold.source(loc)?,
            })
        })
        .collect();
    disk.sort_unstable_by_key(|d| (d.loc.seg, d.loc.rec));
    items.extend(disk.into_iter().map(Item::Disk));
}

/// How many rows [`disk_items`] lists for shard `g`, counted without
/// listing (or sorting) them.
pub(crate) fn disk_count(g: &Shard, since: Option<u32>) -> usize {
    g.cold.as_ref().map_or(0, |cold| {
        cold.entries()
            .filter(|(_, l)| since.is_none_or(|s| l.generation > s))
            .filter(|(_, l)| cold.source(*l).is_some())
            .count()
    })
}

/// Reads runs of rows on disk for a save: the rows of one file that follow
/// each other in a list (in file order), in windows where they lie close
/// ([`each_row`]), with scratch room kept from run to run.
pub(crate) struct RunReader {
    bufs: [Vec<u8>; 3],
    body: Vec<u8>,
    words: Vec<u32>,
    live: Vec<(u32, i64, Loc)>,
}

impl RunReader {
    /// A reader of rows of `words` words (stored weights, state, metadata).
    pub(crate) fn new(words: usize) -> RunReader {
        RunReader {
            bufs: Default::default(),
            body: Vec::new(),
            words: vec![0; words],
            live: Vec::new(),
        }
    }

    /// Reads the run of disk items that `items` starts with (those of its
    /// first item's file), handing each row's key and words to `f` in
    /// order; returns the run's length.
    ///
    /// # Errors
    /// `Checkpoint` for a row that cannot be read or fails its check;
    /// `f`'s error.
    pub(crate) fn read_run(
        &mut self,
        items: &[Item],
        mut f: impl FnMut(i64, &[u32]) -> Result<()>,
    ) -> Result<usize> {
        let Some(Item::Disk(first)) = items.first() else {
            return Ok(0);
        };
        self.live.clear();
        for item in items {
            match item {
                Item::Disk(d)
                    if std::ptr::addr_eq(Arc::as_ptr(&d.file), Arc::as_ptr(&first.file)) =>
                {
                    self.live.push((d.loc.rec, d.key, d.loc));
                }
                _ => break,
            }
        }
        let scratch = (&mut self.bufs, &mut self.body, &mut self.words[..]);
        first.file.read_run(&self.live, scratch, &mut f)?;
        Ok(self.live.len())
    }
}

/// Reads the row `d` names into `words` (`n` words: stored weights, state,
/// metadata).
///
/// # Errors
/// `Checkpoint` when it cannot be read or fails its check.
pub(crate) fn read_item(d: &DiskItem, n: usize, words: &mut Vec<u32>) -> Result<()> {
    words.resize(n, 0);
    d.file.read(d.key, d.loc, &mut Vec::new(), words)
}
