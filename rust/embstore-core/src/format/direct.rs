//! Page-aligned read buffers, and reads of a checkpoint file that is not in
//! the page cache straight into them (`O_DIRECT`): a cold load's bytes go
//! from the disk into the buffer once, instead of into the page cache and
//! then copied out of it. On machine X, reading the 6.4 GB of an 8M-row
//! checkpoint took 1.9-3.1 s of CPU through the page cache and 0.16 s with
//! `O_DIRECT`, at the same disk rate; a cold load is bound by its CPU work.
//! A file mostly in the page cache already is read through it (a warm load
//! must not read the disk again).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use crate::error::Result;
use crate::zeroed::{Zeroable, try_zeroed};

/// The alignment and size unit `O_DIRECT` asks of a read's memory, offset
/// and length (a page: at least any disk's logical block).
const BLOCK: usize = 4096;

/// Files smaller than this are read through the page cache (a direct
/// read's setup is not worth it).
const DIRECT_FROM: u64 = 1 << 20;

/// Bytes asked for by one read call.
const CHUNK: usize = 64 << 20;

#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Block([u8; BLOCK]);

// SAFETY: `Block` is an array of bytes; all zero bytes is a valid value.
unsafe impl Zeroable for Block {}

/// A buffer of whole 4096-aligned blocks, zeroed when allocated (lazily, by
/// the kernel), and how many of its bytes the last read filled.
#[derive(Default)]
pub(crate) struct ReadBuf {
    blocks: Vec<Block>,
    filled: usize,
}

impl ReadBuf {
    /// Bytes it can hold.
    pub(crate) fn capacity(&self) -> usize {
        self.blocks.len() * BLOCK
    }

    /// The bytes the last read filled.
    pub(crate) fn filled(&self) -> &[u8] {
        &self.bytes()[..self.filled]
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `Block` is `repr(C)` over `[u8; BLOCK]` (no padding: its
        // size is its alignment), so the vector's `len` blocks are
        // `len * BLOCK` initialized, contiguous bytes, borrowed with `self`.
        unsafe { std::slice::from_raw_parts(self.blocks.as_ptr().cast::<u8>(), self.capacity()) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.capacity();
        // SAFETY: as in `bytes`, borrowed mutably with `self`; any byte
        // value is a valid `Block` content.
        unsafe { std::slice::from_raw_parts_mut(self.blocks.as_mut_ptr().cast::<u8>(), n) }
    }

    /// Room for at least `n` bytes; what it held is dropped when it grows.
    fn room(&mut self, n: usize) -> Result<()> {
        let want = n.div_ceil(BLOCK);
        if self.blocks.len() < want {
            self.blocks = Vec::new(); // the old buffer freed before the new one is taken
            self.blocks = try_zeroed(want)
                .ok_or_else(|| crate::error::oom("path", want.saturating_mul(BLOCK)))?;
        }
        Ok(())
    }
}

/// Whether most of the `len` bytes of `f` are in the page cache (a map of
/// the file that is never read, asked with `mincore`); `true` where it
/// cannot tell.
fn mostly_cached(f: &File, len: u64) -> bool {
    // SAFETY: the mapping is only passed to `mincore`, which reads the page
    // tables, never the file's bytes: a file changed or truncated meanwhile
    // cannot fault here. It is unmapped when `map` drops.
    let Ok(map) = (unsafe { memmap2::MmapOptions::new().len(len as usize).map(f) }) else {
        return true;
    };
    let pages = (len as usize).div_ceil(BLOCK);
    // A byte a page, taken fallibly (a file's length sizes it).
    let Some(mut resident) = try_zeroed::<u8>(pages) else {
        return true;
    };
    // SAFETY: `map` is a live mapping of `len` bytes at a page-aligned
    // address, and `resident` holds one byte for each of its pages.
    let rc = unsafe {
        libc::mincore(
            map.as_ptr() as *mut libc::c_void,
            len as usize,
            resident.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return true;
    }
    let held = resident.iter().filter(|&&b| b & 1 != 0).count();
    2 * held >= pages
}

/// Sets or clears `O_DIRECT` on `f`; false where the file system refuses.
fn set_direct(f: &File, on: bool) -> bool {
    let fd = f.as_raw_fd();
    // SAFETY: `fcntl` with F_GETFL / F_SETFL on a descriptor `f` owns and
    // keeps open for the call; it reads and sets flags only.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 {
            return false;
        }
        let flags = if on {
            flags | libc::O_DIRECT
        } else {
            flags & !libc::O_DIRECT
        };
        libc::fcntl(fd, libc::F_SETFL, flags) == 0
    }
}

/// Reads the open regular file `f` (`len` bytes by its metadata) into
/// `buf`, at most `limit + 1` bytes (one more than allowed, so that a file
/// grown since its size was read is told apart); returns how many it read.
/// A file of 1 MiB or more that is mostly not in the page cache is read
/// with `O_DIRECT` where the file system allows it (the second value:
/// whether it was).
///
/// # Errors
/// `OutOfMemory` for the buffer; the read's I/O error (the caller names the
/// file: `format::files`).
pub(crate) fn read_into(
    f: &File,
    len: u64,
    limit: u64,
    buf: &mut ReadBuf,
) -> Result<io::Result<(usize, bool)>> {
    let cap = usize::try_from(limit.saturating_add(1))
        .map_err(|_| crate::error::oom("path", limit))?
        .div_ceil(BLOCK)
        * BLOCK;
    buf.room(cap)?;
    let mut direct = len >= DIRECT_FROM && !mostly_cached(f, len) && set_direct(f, true);
    buf.filled = 0;
    let bytes = buf.bytes_mut();
    let mut at = 0usize;
    while at < cap {
        let end = (at + CHUNK).min(cap);
        match f.read_at(&mut bytes[at..end], at as u64) {
            Ok(0) => break,
            Ok(n) => {
                at += n;
                // A direct read that ends off a block met the end of the
                // file (and the next offset could not be read directly).
                if direct && !at.is_multiple_of(BLOCK) {
                    break;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if direct && at == 0 && e.raw_os_error() == Some(libc::EINVAL) => {
                // The file system took the flag but refuses the read:
                // through the page cache instead.
                if !set_direct(f, false) {
                    return Ok(Err(e));
                }
                direct = false;
            }
            Err(e) => return Ok(Err(e)),
        }
    }
    buf.filled = at;
    Ok(Ok((at, direct)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::temp_dir;

    /// Files of every size around the block and the direct threshold read
    /// back byte for byte, cold (dropped from the page cache where the
    /// kernel lets a process ask: `POSIX_FADV_DONTNEED`) and warm, and a
    /// limit one byte short is told apart.
    #[test]
    fn reads_return_the_files_bytes_cold_and_warm() {
        let dir = temp_dir("direct-read");
        // Whether the directory's file system takes O_DIRECT (tmpfs does
        // not: there every read goes through the cache, also checked).
        let probe = dir.join("probe");
        std::fs::write(&probe, [0u8; 8]).unwrap();
        let on_disk = set_direct(&File::open(&probe).unwrap(), true);
        let mut buf = ReadBuf::default();
        for len in [
            0usize,
            1,
            4095,
            4096,
            4097,
            (1 << 20) - 1,
            1 << 20,
            (3 << 20) + 17,
        ] {
            let want: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let path = dir.join(format!("f{len}"));
            std::fs::write(&path, &want).unwrap();
            for cold in [true, false] {
                let f = File::open(&path).unwrap();
                f.sync_all().unwrap();
                if cold {
                    // SAFETY: advice on a descriptor `f` owns; reads nothing.
                    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
                } else {
                    std::fs::read(&path).unwrap(); // (a direct read caches nothing)
                }
                let (n, direct) = read_into(&f, len as u64, len as u64, &mut buf)
                    .unwrap()
                    .unwrap();
                assert_eq!(n, len, "{len} bytes, cold {cold}");
                // Here (ext4 or xfs) a cold file of 1 MiB or more is read
                // directly, a warm one through the page cache.
                if on_disk {
                    assert_eq!(direct, cold && len >= 1 << 20, "{len} bytes, cold {cold}");
                }
                assert!(buf.filled() == &want[..], "{len} bytes, cold {cold}");
                assert_eq!(buf.capacity() % BLOCK, 0);
                assert_eq!(buf.filled().as_ptr() as usize % BLOCK, 0);
            }
            if len > 0 {
                let f = File::open(&path).unwrap();
                let (n, _) = read_into(&f, len as u64, len as u64 - 1, &mut buf)
                    .unwrap()
                    .unwrap();
                assert_eq!(n, len, "more than the limit is read, so it can be refused");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
