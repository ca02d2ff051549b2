//! Warming a mapped table's files: every page read into the page cache
//! and mapped now, in 2 MiB pages where the kernel can give them.
//!
//! A random lookup of a large mapped table misses the TLB on every row
//! unless the map is backed by 2 MiB pages, which the kernel gives a file
//! mapping only where the page cache holds the file in 2 MiB folios. A file
//! written by `save` (large writes) or read in by faults of a map that asks
//! for huge pages is cached that way; a file copied onto the host by `cp`,
//! `shutil.copytree` or a download tool (small writes) is cached in 4 KiB
//! pages and stays so until the kernel drops it: 2,000-key lookups of a
//! 10M-row dim-64 table took about 1.5x as long on such a copy
//! (benches/RESULTS.md).
//! Warming reads each file in through its map ([`populate`]), measures how
//! much of the map the kernel backed with 2 MiB pages (`/proc/self/smaps`),
//! and for a file mostly on small pages drops this process's pages of it
//! and the page cache's pages that no other process maps, then reads it in
//! again: the fault path then caches it in 2 MiB folios.
//!
//! The map stays valid throughout: a file is never changed in place
//! (saves write new files), so a page dropped and read again holds the
//! same bytes, and a concurrent lookup that touches it meanwhile only
//! waits for the read.

use super::file::MappedFile;
use std::sync::atomic::Ordering;

/// A transparent huge page.
#[cfg(target_os = "linux")]
const HUGE: usize = 2 << 20;

/// What warming did (see [`super::MappedTable::warm`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WarmReport {
    /// Files read in now (files warmed before are not read again).
    pub files: usize,
    /// Their mapped bytes.
    pub bytes: u64,
    /// Of them, files whose cached pages were mostly small and were read in
    /// again.
    pub recached_files: usize,
    /// Their mapped bytes.
    pub recached_bytes: u64,
    /// Bytes of the files warmed now that this process maps with 2 MiB
    /// pages, after warming; `None` where the kernel does not say.
    pub huge_page_bytes: Option<u64>,
}

/// Reads every page of `f`'s map in and maps it now (`MADV_POPULATE_READ`;
/// on kernels before 5.14, a read of each page). A map that asks for huge
/// pages is read ahead in 2 MiB folios where none are cached yet.
fn populate(f: &MappedFile) {
    if f.map.advise(memmap2::Advice::PopulateRead).is_ok() {
        return;
    }
    // The file's size was checked against its manifest when mapped; a file
    // truncated since by another program faults here as any read of the
    // map would (the module docs say so).
    for o in (0..f.map.len()).step_by(4096) {
        // SAFETY: `o` is within the map, which lives as long as `f`; a
        // volatile read keeps the touch from being optimized away.
        unsafe { std::ptr::read_volatile(f.map.as_ptr().add(o)) };
    }
}

/// Bytes of the map `[start, start + len)` that this process maps with
/// 2 MiB pages, from `/proc/self/smaps` (`FilePmdMapped`, summed over the
/// map's areas; a map split in two by its huge-page advice is two).
#[cfg(target_os = "linux")]
fn huge_bytes_of(smaps: &str, start: usize, len: usize) -> u64 {
    let end = start + len;
    let mut inside = false;
    let mut total = 0u64;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ')
            && let Some((a, b)) = range.split_once('-')
            && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        {
            inside = a >= start && b <= end;
            continue;
        }
        if inside && let Some(v) = line.strip_prefix("FilePmdMapped:") {
            let kb: u64 = v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
            total += kb * 1024;
        }
    }
    total
}

/// This process's `/proc/self/smaps`, where the kernel has one.
#[cfg(target_os = "linux")]
fn smaps() -> Option<String> {
    std::fs::read_to_string("/proc/self/smaps").ok()
}

/// Bytes of `f`'s map that 2 MiB pages could back: its whole huge pages.
#[cfg(target_os = "linux")]
fn eligible(f: &MappedFile) -> usize {
    let start = f.map.as_ptr() as usize;
    let first = start.next_multiple_of(HUGE);
    (start + f.map.len()).saturating_sub(first) / HUGE * HUGE
}

/// Drops this process's pages of `f` and the page cache's pages of its
/// file that no process maps (after writing back any not yet written: a
/// fresh copy's dirty pages would stay), then reads it in again. Returns
/// false, doing nothing, where the file at `f`'s path is no longer the file
/// mapped (removed, or another file under its name).
#[cfg(target_os = "linux")]
fn recache(f: &MappedFile) -> bool {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let (Some(dir), Some(name)) = (f.path.parent(), f.path.file_name()) else {
        return false;
    };
    let Some(file) = name
        .to_str()
        .and_then(|n| crate::format::files::open_named(dir, n, "cannot open").ok())
    else {
        return false;
    };
    match file.metadata() {
        Ok(m) if (m.dev(), m.ino()) == f.file_id => {}
        _ => return false,
    }
    // Written back first: the kernel drops clean pages only.
    if file.sync_data().is_err() {
        return false;
    }
    // SAFETY: a shared, read-only map of a file that is never changed in
    // place: dropping its pages unmaps them from this process, and the next
    // read of any of them faults the same bytes in from the file. No
    // reference into the map sees different contents.
    if unsafe { f.map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) }.is_err() {
        return false;
    }
    // SAFETY: posix_fadvise reads no memory of ours; the descriptor is open.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    populate(f);
    true
}

/// Warms `files` (each at most once over the table's life: see
/// [`MappedFile::warmed`]).
pub(super) fn warm<'a>(files: impl Iterator<Item = &'a MappedFile>) -> WarmReport {
    let mut report = WarmReport::default();
    let todo: Vec<&MappedFile> = files
        .filter(|f| !f.warmed.swap(true, Ordering::AcqRel))
        .collect();
    for f in &todo {
        populate(f);
        report.files += 1;
        report.bytes += f.map.len() as u64;
    }
    #[cfg(target_os = "linux")]
    if let Some(before) = smaps() {
        let mut recached = false;
        for f in &todo {
            let start = f.map.as_ptr() as usize;
            let huge = huge_bytes_of(&before, start, f.map.len());
            // Mostly on small pages, where 2 MiB ones could back it.
            if (huge as usize) < eligible(f) / 2 && recache(f) {
                report.recached_files += 1;
                report.recached_bytes += f.map.len() as u64;
                recached = true;
            }
        }
        let after = if recached { smaps() } else { Some(before) };
        report.huge_page_bytes = after.map(|s| {
            todo.iter()
                .map(|f| huge_bytes_of(&s, f.map.as_ptr() as usize, f.map.len()))
                .sum()
        });
    }
    report
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::huge_bytes_of;

    /// A map's 2 MiB-page bytes are summed over its areas (a map split in
    /// two by its huge-page advice is two) and nothing outside it counts.
    #[test]
    fn huge_page_bytes_are_summed_over_the_maps_areas_only() {
        let smaps = "\
7f0000000000-7f0000400000 r--s 00000000 fe:00 12 /ckpt/a.safetensors
Size:               4096 kB
Rss:                4096 kB
FilePmdMapped:      4096 kB
7f0000400000-7f0000500000 r--s 00400000 fe:00 12 /ckpt/a.safetensors
Rss:                1024 kB
FilePmdMapped:         0 kB
7f0000500000-7f0000900000 r--s 00000000 fe:00 13 /ckpt/b.safetensors
FilePmdMapped:      2048 kB
";
        let start = 0x7f00_0000_0000;
        assert_eq!(huge_bytes_of(smaps, start, 0x50_0000), 4 << 20);
        assert_eq!(huge_bytes_of(smaps, start + 0x50_0000, 0x40_0000), 2 << 20);
        assert_eq!(huge_bytes_of(smaps, start, 0x90_0000), 6 << 20);
        // A range that covers no whole area counts nothing.
        assert_eq!(huge_bytes_of(smaps, start + 0x1000, 0x10_0000), 0);
    }
}
