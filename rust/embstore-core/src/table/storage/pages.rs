//! The allocator of the shard index and the row columns: blocks of 64 KiB
//! and more come straight from the OS (anonymous `mmap`, from 4 MiB on a
//! huge page's boundary) and go straight back (`munmap`); and the
//! mapping ahead of pages a writer is about to fill (the advice for huge
//! pages is in [`crate::huge`]).
//!
//! An index grows by half again and frees its old allocation. From the C heap,
//! those freed blocks often stay resident (glibc raises its mmap threshold
//! after large frees, and later blocks of that size come from the heap and
//! stay there when freed), so a table's resident memory would exceed what it
//! holds by an allocator-dependent margin. Mapped blocks return to the OS on
//! free, which keeps resident memory equal to `stats()["bytes"]`.

use allocator_api2::alloc::{AllocError, Allocator, Global, Layout};
use std::ptr::NonNull;

/// Blocks at least this large are mapped.
#[cfg(unix)]
const MAPPED: usize = 1 << 16;

/// Mapped blocks at least this large start on a huge page's boundary
/// (the least size that asks for huge pages: [`crate::huge::HUGE_FROM`]).
#[cfg(unix)]
const ALIGN_FROM: usize = crate::huge::HUGE_FROM;

#[cfg(unix)]
use crate::huge::HUGE_PAGE;

/// A page.
#[cfg(unix)]
const PAGE: usize = 4096;

/// See the module docs.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PageAlloc;

impl PageAlloc {
    #[cfg(unix)]
    fn mapped(layout: Layout) -> bool {
        layout.size() >= MAPPED && layout.align() <= 4096
    }

    #[cfg(not(unix))]
    fn mapped(_: Layout) -> bool {
        false
    }
}

// SAFETY: mapped blocks are page-aligned (so aligned for any layout with
// align <= 4096), at least `layout.size()` bytes, valid until unmapped in
// `deallocate` with the same size; other blocks are Global's, returned to
// Global. `mapped` depends on the layout only, so a block is always freed
// the way it was allocated. Copies of `PageAlloc` are interchangeable.
unsafe impl Allocator for PageAlloc {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if !Self::mapped(layout) {
            return Global.allocate(layout);
        }
        #[cfg(unix)]
        {
            let size = layout.size();
            // A block that asks for huge pages starts on a huge page's
            // boundary: mapped with a huge page's room to spare, whose
            // unaligned head and tail are then unmapped (the kernel gives
            // huge pages only to aligned 2 MiB ranges: a block at a page
            // boundary keeps up to 4 MiB of it on small pages).
            let spare = if size >= ALIGN_FROM {
                HUGE_PAGE - PAGE
            } else {
                0
            };
            let mapped = size.checked_add(spare).ok_or(AllocError)?;
            // SAFETY: an anonymous private mapping of `mapped` bytes at an
            // address of the kernel's choice touches no existing memory; the
            // result is checked against MAP_FAILED.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    mapped,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(AllocError);
            }
            let (start, end) = (p as usize, p as usize + mapped);
            let block = if spare == 0 {
                start
            } else {
                let block = start.next_multiple_of(HUGE_PAGE);
                let tail = (block + size).next_multiple_of(PAGE);
                // SAFETY: `start..block` and `tail..end` lie inside the
                // mapping just made (`block - start <= spare` and `tail <=
                // end`, both page-aligned), which nothing else uses; the
                // block `block..block + size` stays mapped.
                unsafe {
                    if block > start {
                        libc::munmap(start as *mut libc::c_void, block - start);
                    }
                    if end > tail {
                        libc::munmap(tail as *mut libc::c_void, end - tail);
                    }
                }
                block
            };
            let p = NonNull::new(block as *mut u8).ok_or(AllocError)?;
            Ok(NonNull::slice_from_raw_parts(p, size))
        }
        #[cfg(not(unix))]
        unreachable!("nothing is mapped off unix")
    }

    fn allocate_zeroed(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if Self::mapped(layout) {
            // A fresh anonymous mapping reads as zeros: nothing to write
            // (and no page is touched until used).
            self.allocate(layout)
        } else {
            Global.allocate_zeroed(layout)
        }
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if !Self::mapped(layout) {
            // SAFETY: the caller passes a block this allocator gave out for
            // `layout`; unmapped layouts came from Global.
            unsafe { Global.deallocate(ptr, layout) };
            return;
        }
        #[cfg(unix)]
        // SAFETY: `ptr` is a mapping of `layout.size()` bytes made by
        // `allocate` (same layout), not yet unmapped, and no longer used.
        unsafe {
            libc::munmap(ptr.as_ptr().cast(), layout.size());
        }
    }
}

/// Asks the kernel to map the whole pages inside the byte addresses
/// `start..end` for writing now (`MADV_POPULATE_WRITE`: each page faulted
/// in as a write would fault it, its contents unchanged). Best effort: a
/// kernel before 5.14 refuses, and the pages fault in when first written.
pub(crate) fn populate(start: usize, end: usize) {
    #[cfg(target_os = "linux")]
    {
        let page = 4096;
        let (s, e) = (start.next_multiple_of(page), end / page * page);
        if e > s {
            // SAFETY: populating changes neither the contents nor the
            // mapping of the range; the caller passes addresses of memory
            // it holds (an arena's live segment), and a failure is ignored.
            unsafe {
                libc::madvise(s as *mut libc::c_void, e - s, libc::MADV_POPULATE_WRITE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, end);
}

/// Memory the OS could still give this process without swapping
/// (`MemAvailable` of `/proc/meminfo`), and no more than the address space
/// its `RLIMIT_AS` leaves, where known.
pub(crate) fn available_memory() -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    let avail = kib * 1024;
    Some(address_space_left().map_or(avail, |left| avail.min(left)))
}

/// The address space `RLIMIT_AS` still allows this process, if limited.
fn address_space_left() -> Option<usize> {
    #[cfg(target_os = "linux")]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit struct through a valid pointer.
        if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } != 0
            || lim.rlim_cur == libc::RLIM_INFINITY
        {
            return None;
        }
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmSize:"))?;
        let used = line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024;
        Some(lim.rlim_cur.saturating_sub(used) as usize)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn available_memory_is_known_on_linux() {
        if cfg!(target_os = "linux") {
            let m = available_memory().expect("MemAvailable in /proc/meminfo");
            assert!(m > 1 << 20, "{m}");
        }
    }

    #[test]
    fn small_and_large_blocks_round_trip() {
        for size in [8usize, 4096, 1 << 16, 3 << 20, (4 << 20) + 100, 9 << 20] {
            let layout = Layout::from_size_align(size, 8).unwrap();
            let p = PageAlloc.allocate(layout).unwrap();
            // SAFETY: `p` is a fresh block of at least `size` bytes.
            unsafe {
                let bytes = std::slice::from_raw_parts_mut(p.cast::<u8>().as_ptr(), size);
                bytes.fill(0xA5);
                assert!(bytes.iter().all(|&b| b == 0xA5));
                PageAlloc.deallocate(p.cast(), layout);
            }
        }
    }

    /// A block large enough to ask for huge pages starts on a huge page's
    /// boundary (else up to 4 MiB of it would stay on small pages), reads
    /// as zeros when asked zeroed, and its whole length is usable; blocks
    /// in a row do not overlap.
    #[cfg(unix)]
    #[test]
    fn blocks_that_ask_for_huge_pages_are_aligned_to_one() {
        let layouts = [(4usize << 20) + 4097, 6 << 20, 16 << 20]
            .map(|size| Layout::from_size_align(size, 64).unwrap());
        let blocks: Vec<_> = layouts
            .iter()
            .map(|&l| PageAlloc.allocate_zeroed(l).unwrap())
            .collect();
        for (p, l) in blocks.iter().zip(&layouts) {
            let start = p.cast::<u8>().as_ptr() as usize;
            assert_eq!(start % HUGE_PAGE, 0, "{start:#x} for {} bytes", l.size());
            // SAFETY: a live block of `l.size()` zeroed bytes.
            let bytes = unsafe { std::slice::from_raw_parts_mut(start as *mut u8, l.size()) };
            assert!(bytes.iter().step_by(4096).all(|&b| b == 0));
            bytes[l.size() - 1] = 1;
            bytes[0] = 1;
        }
        for (p, l) in blocks.into_iter().zip(layouts) {
            // SAFETY: allocated above with `l`, freed once.
            unsafe { PageAlloc.deallocate(p.cast(), l) };
        }
    }
}
