//! A mapped checkpoint's rows as whole records ([`MappedRecords`]): the
//! mapped reader as a [`RecordStore`], the read half of the tier interface
//! the disk store and the test tier implement under a table. A record is
//! what a disk table's record holds: the row's stored words (an 8-bit
//! row's codes, scale and offset; as the file stores them), its optimizer
//! state where the checkpoint kept it (zeros where a file has none) and 4
//! metadata words where it kept them (zeros otherwise). One version is
//! read from start to end, whatever a refresh swaps in meanwhile.

use super::file::MappedFile;
use super::snapshot::Snapshot;
use crate::error::{Result, ckpt_err};
use crate::hash::key_hash;
use crate::record::{Loc, RecordSource, RecordStore};
use std::collections::HashMap;
use std::sync::Arc;

/// One version of a mapped checkpoint as a store of records: every file
/// of its chain is a [`RecordSource`], a record's place its file's number
/// here ([`Loc::seg`]) and its row in that file ([`Loc::rec`]).
pub(crate) struct MappedRecords {
    snap: Arc<Snapshot>,
    files: Vec<Arc<FileSource>>,
    /// Each file's number, by the address of its `MappedFile`.
    numbers: HashMap<usize, u32>,
    /// Stored words and state words a record holds (with 4 metadata words).
    ww: usize,
    sl: usize,
    /// Whether every file keeps metadata (then [`RecordStore::metas`]
    /// lists it).
    with_meta: bool,
}

impl std::fmt::Debug for MappedRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedRecords")
            .field("files", &self.files.len())
            .field("ww", &self.ww)
            .field("sl", &self.sl)
            .finish()
    }
}

/// One mapped file as a [`RecordSource`] (it holds the version it is of).
struct FileSource {
    snap: Arc<Snapshot>,
    place: (usize, usize, usize),
    ww: usize,
    sl: usize,
}

impl std::fmt::Debug for FileSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSource")
            .field("path", &self.file().path)
            .finish()
    }
}

impl FileSource {
    fn file(&self) -> &MappedFile {
        let (l, s, i) = self.place;
        &self.snap.links[l].files[s][i]
    }
}

/// Little-endian words of `bytes` into `words` (as many as both hold).
fn words_of(bytes: &[u8], words: &mut [u32]) {
    for (w, b) in words.iter_mut().zip(bytes.chunks_exact(4)) {
        *w = u32::from_le_bytes(b.try_into().expect("4 bytes"));
    }
}

impl RecordSource for FileSource {
    fn read(&self, key: i64, loc: Loc, _buf: &mut Vec<u8>, words: &mut [u32]) -> Result<()> {
        let f = self.file();
        f.check()?;
        let r = loc.rec as usize;
        if r >= f.n || f.key(r) != key {
            return Err(ckpt_err(
                &f.path,
                format!("row {r} does not hold key {key}: not a record of this file"),
            ));
        }
        let (ww, sl) = (self.ww, self.sl);
        words.fill(0);
        words_of(f.row(r), &mut words[..ww]);
        if let Some((at, bytes)) = f.state
            && bytes == 4 * sl
        {
            words_of(
                &f.map[at + r * bytes..at + (r + 1) * bytes],
                &mut words[ww..ww + sl],
            );
        }
        if let Some(at) = f.meta {
            words_of(
                &f.map[at + 16 * r..at + 16 * (r + 1)],
                &mut words[ww + sl..],
            );
        }
        Ok(())
    }
}

impl MappedRecords {
    /// The records of version `snap`, every file of it checked first (its
    /// checksum and everything a load checks), so that no later find
    /// meets a damaged file.
    ///
    /// # Errors
    /// `Checkpoint` for a damaged file.
    pub(super) fn new(snap: Arc<Snapshot>) -> Result<MappedRecords> {
        let mut places = Vec::new();
        for (l, link) in snap.links.iter().enumerate() {
            link.check()?;
            for (s, fs) in link.files.iter().enumerate() {
                places.extend((0..fs.len()).map(|i| (l, s, i)));
            }
        }
        let all = || places.iter().map(|&(l, s, i)| &snap.links[l].files[s][i]);
        let ww = all().map(|f| f.row_bytes / 4).max().unwrap_or(0);
        let sl = all()
            .filter_map(|f| f.state.map(|(_, b)| b / 4))
            .max()
            .unwrap_or(0);
        let with_meta = !places.is_empty() && all().all(|f| f.meta.is_some());
        let numbers = all()
            .enumerate()
            .map(|(seg, f)| (std::ptr::from_ref(f) as usize, seg as u32))
            .collect();
        let files = places
            .iter()
            .map(|&place| {
                Arc::new(FileSource {
                    snap: snap.clone(),
                    place,
                    ww,
                    sl,
                })
            })
            .collect();
        Ok(MappedRecords {
            snap,
            files,
            numbers,
            ww,
            sl,
            with_meta,
        })
    }

    /// A record's words: stored words, state words, 4 metadata words.
    pub(crate) fn width(&self) -> usize {
        self.ww + self.sl + 4
    }

    /// Stored words and state words a record holds.
    pub(crate) fn shape(&self) -> (usize, usize) {
        (self.ww, self.sl)
    }

    /// Whether the records carry the metadata the checkpoint kept.
    pub(crate) fn with_meta(&self) -> bool {
        self.with_meta
    }

    /// Where `key`'s record is: its file's number and row.
    fn place(&self, key: i64) -> Option<Loc> {
        // Every file passed its check in `new`: a probe cannot fail.
        let (f, r) = self.snap.locate(key, key_hash(key)).ok().flatten()?;
        let seg = *self.numbers.get(&(std::ptr::from_ref(f) as usize))?;
        Some(Loc {
            seg,
            rec: r as u32,
            generation: 0,
            crc: 0,
        })
    }

    /// Every record's key and place, file by file, those a newer link
    /// replaced or removed left out.
    fn live(&self) -> impl Iterator<Item = (i64, Loc)> + '_ {
        self.files.iter().enumerate().flat_map(move |(seg, s)| {
            let f = s.file();
            (0..f.n).filter_map(move |r| {
                let key = f.key(r);
                let (g, at) = self.snap.locate(key, key_hash(key)).ok().flatten()?;
                (std::ptr::eq(g, f) && at == r).then_some((
                    key,
                    Loc {
                        seg: seg as u32,
                        rec: r as u32,
                        generation: 0,
                        crc: 0,
                    },
                ))
            })
        })
    }
}

impl RecordStore for MappedRecords {
    fn len(&self) -> usize {
        self.snap.rows as usize
    }

    fn contains(&self, key: i64) -> bool {
        self.place(key).is_some()
    }

    fn find(&self, key: i64) -> Option<(Loc, Arc<dyn RecordSource>)> {
        let loc = self.place(key)?;
        Some((loc, self.files[loc.seg as usize].clone()))
    }

    fn entries(&self) -> Box<dyn Iterator<Item = (i64, Loc)> + '_> {
        Box::new(self.live())
    }

    fn source(&self, loc: Loc) -> Option<Arc<dyn RecordSource>> {
        Some(self.files.get(loc.seg as usize)?.clone())
    }

    fn metas(&self) -> Box<dyn Iterator<Item = (i64, [u32; 4])> + '_> {
        if !self.with_meta {
            return Box::new(std::iter::empty());
        }
        Box::new(self.live().map(|(key, loc)| {
            let f = self.files[loc.seg as usize].file();
            let at = f.meta.expect("every file keeps metadata") + 16 * loc.rec as usize;
            let mut w = [0; 4];
            words_of(&f.map[at..at + 16], &mut w);
            (key, w)
        }))
    }
}
