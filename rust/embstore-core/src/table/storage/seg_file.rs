//! A disk table's segment file, and its reads and writes.

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::table::storage::base::Columns;

/// The page size O_DIRECT reads are aligned to.
const BLOCK: usize = 4096;

/// A segment file: written through the page cache (each flush then
/// written back and dropped from it, so that the cache holds no more of a
/// disk table's rows than a flush), read with O_DIRECT where the file
/// system allows it (a row read comes from the device, never from cached
/// pages that a memory limit would count).
#[derive(Debug)]
pub(crate) struct SegFile {
    pub(super) file: File,
    pub(super) direct: Option<File>,
    /// An adopted checkpoint file's columns (`None`: a segment of records).
    pub(super) base: Option<Columns>,
}

impl SegFile {
    /// A new segment file at `path` (which must not exist), for records.
    ///
    /// # Errors
    /// The create's error.
    pub(super) fn create(path: &std::path::Path) -> std::io::Result<SegFile> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        // Where the file system takes no O_DIRECT (tmpfs), reads go
        // through the page cache.
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok();
        Ok(SegFile {
            file,
            direct,
            base: None,
        })
    }

    /// `len` bytes at `off`, read into `buf` (scratch room) and returned.
    pub(super) fn read_at<'b>(
        &self,
        buf: &'b mut Vec<u8>,
        len: usize,
        off: u64,
    ) -> std::io::Result<&'b [u8]> {
        if let Some(d) = &self.direct {
            let start = off & !(BLOCK as u64 - 1);
            let need = (off - start) as usize + len;
            let n = need.next_multiple_of(BLOCK);
            buf.resize(n + BLOCK, 0);
            let a = buf.as_ptr().align_offset(BLOCK);
            let mut got = 0;
            while got < need {
                match d.read_at(&mut buf[a + got..a + n], start + got as u64) {
                    Ok(0) => break,
                    Ok(r) => got += r,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            if got < need {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let from = a + (off - start) as usize;
            return Ok(&buf[from..from + len]);
        }
        buf.resize(len, 0);
        self.file.read_exact_at(&mut buf[..len], off)?;
        Ok(&buf[..len])
    }

    /// Writes `bytes` at `off`, waits for them to reach the device, and
    /// drops them from the page cache.
    pub(super) fn write_at(&self, bytes: &[u8], off: u64) -> std::io::Result<()> {
        self.file.write_all_at(bytes, off)?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.file);
        let (o, n) = (off as libc::off64_t, bytes.len() as libc::off64_t);
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        // SAFETY: `fd` is this open file's descriptor for the whole call;
        // sync_file_range and posix_fadvise read no memory of ours.
        let r = unsafe { libc::sync_file_range(fd, o, n, flags) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: as above. Advice only: its failure changes nothing.
        unsafe { libc::posix_fadvise(fd, o, n, libc::POSIX_FADV_DONTNEED) };
        Ok(())
    }
}
