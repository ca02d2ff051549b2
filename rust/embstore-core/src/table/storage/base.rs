//! A checkpoint's files as a disk table's first segments: a load of a
//! checkpoint larger than memory links each file into the table's own
//! directory (copies it where a link cannot be made) and names its rows
//! there, instead of rewriting every row into segment files. The load then
//! reads each file once, at the disk's sequential rate, and writes nothing.
//!
//! A checkpoint file holds its rows as columns (keys, rows, state,
//! metadata), so one row is read in up to three pieces. The file was
//! checked whole when it was loaded (size, CRC-32C, tensors, finite values,
//! its hash index); each row's CRC-32C, taken from those checked bytes, is
//! kept in the key's place ([`Loc::crc`](super::cold::Loc)) and checked at
//! every read, so a file changed afterwards (the link is the same inode as
//! the checkpoint's file) reads as an error, never as a row.

use std::fs::File;
use std::io;
use std::path::Path;

/// Where a checkpoint file's columns are: byte offsets of its tensors'
/// data and the bytes one row takes in each, and the words of the record
/// a row is read into (`ww` weight words, `sl` state words, 4 metadata
/// words; what a column does not hold stays zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Columns {
    /// Rows the file holds.
    pub(crate) rows: u32,
    pub(crate) ww: usize,
    pub(crate) sl: usize,
    /// The stored weights: offset, bytes a row.
    pub(crate) weights: (u64, usize),
    /// The optimizer state, if the table has any: offset, bytes a row.
    pub(crate) state: Option<(u64, usize)>,
    /// The metadata (16 bytes a row), if the file has it.
    pub(crate) meta: Option<u64>,
    /// Every row's metadata words where the file has none (the touch a
    /// load records).
    pub(crate) fixed_meta: [u32; 4],
}

impl Columns {
    /// Bytes of a row's record words.
    pub(crate) fn body_bytes(&self) -> usize {
        4 * (self.ww + self.sl + 4)
    }

    /// Sets `body` (a row's record words, [`Columns::body_bytes`]) to what
    /// a row holds before its pieces are read in: zeros, and the fixed
    /// metadata where the file has none.
    pub(crate) fn blank(&self, body: &mut [u8]) {
        body.fill(0);
        if self.meta.is_none() {
            let at = 4 * (self.ww + self.sl);
            for (d, w) in body[at..at + 16].chunks_exact_mut(4).zip(self.fixed_meta) {
                d.copy_from_slice(&w.to_le_bytes());
            }
        }
    }

    /// The pieces of row `rec`: (offset in the file, bytes, first byte in
    /// the record's words); an absent column's piece is empty.
    pub(crate) fn pieces(&self, rec: u32) -> [(u64, usize, usize); 3] {
        let (ww, sl, r) = (self.ww, self.sl, u64::from(rec));
        let (wo, wb) = self.weights;
        let st = self
            .state
            .map_or((0, 0, 0), |(so, sb)| (so + r * sb as u64, sb, 4 * ww));
        let mt = self
            .meta
            .map_or((0, 0, 0), |mo| (mo + r * 16, 16, 4 * (ww + sl)));
        [(wo + r * wb as u64, wb, 0), st, mt]
    }
}

/// The CRC-32C of one row's bytes as a record's words hold them.
pub(crate) fn row_crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Makes `dst` (in the table's own directory) the file `name` of the
/// checkpoint at `dir`: a hard link where the file system allows one, a
/// copy otherwise. The source is opened as an untrusted file (a plain
/// name, no link followed, a regular file); what `dst` holds is checked
/// row by row when read.
///
/// # Errors
/// The open's, link's or copy's error.
pub(crate) fn adopt(dir: &Path, name: &str, dst: &Path) -> io::Result<()> {
    let mut src = crate::format::untrusted::open_in(dir, name)?;
    // `link` without following: a name swapped for a symbolic link since
    // the open is linked as the link itself, which the open of `dst`
    // refuses.
    if !copy_only() && std::fs::hard_link(dir.join(name), dst).is_ok() {
        return Ok(());
    }
    let mut out = crate::format::untrusted::create_file(dst)?;
    io::copy(&mut src, &mut out)?;
    out.sync_data()?;
    Ok(())
}

/// Opens an adopted file for reading rows: as an untrusted file (a link
/// swapped in is refused), and a second time with O_DIRECT where the file
/// system allows it.
///
/// # Errors
/// The open's error.
pub(crate) fn open(path: &Path) -> io::Result<(File, Option<File>)> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let file = crate::format::untrusted::open_file(path)?;
    // Non-blocking, and kept only if it is the same file as the first open
    // (a name swapped between the two opens is read through the first).
    let a = file.metadata()?;
    let direct = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT | libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()
        .filter(|d| {
            d.metadata()
                .is_ok_and(|m| m.dev() == a.dev() && m.ino() == a.ino())
        });
    Ok((file, direct))
}

/// Tests take the copy where a link would do (the path a checkpoint on
/// another file system takes).
#[cfg(test)]
pub(crate) static COPY_ONLY: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

fn copy_only() -> bool {
    #[cfg(test)]
    return COPY_ONLY.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(test))]
    false
}
