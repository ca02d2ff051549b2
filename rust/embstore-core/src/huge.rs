//! Transparent huge pages: the advice (`MADV_HUGEPAGE`) that large blocks
//! ask for (a table's row columns and indexes, a serving cache's slot map,
//! large outputs, mapped checkpoint files), and its switch
//! (`EMBSTORE_HUGE_PAGES`).

/// Row columns at least this large ask for transparent huge pages
/// ([`advise_huge`]): a segment being filled leaves at most one huge page
/// (2 MiB) resident past its rows. From 4 MiB (it was 32): an 8-shard
/// table of 1.15M dim-64 rows kept all but its last segments on 4 KiB
/// pages, and an `assign` of them ran at 9.9-12.2M rows/s against
/// 14.6-15.7M with these (machine E).
pub(crate) const HUGE_FROM: usize = 4 << 20;

/// Indexes at least this large ask for huge pages too: keys hash all over
/// an index, so every page of one is touched (nothing is left resident
/// that would not be), and a probe is a random read that the TLB misses.
pub(crate) const HUGE_INDEX_FROM: usize = 4 << 20;

/// A transparent huge page on x86-64 and most ARM64 kernels.
pub(crate) const HUGE_PAGE: usize = 2 << 20;

/// What [`advise_huge`] asks for: `EMBSTORE_HUGE_PAGES=0` nothing (for
/// comparing against the kernel's default), `rows` the row columns only,
/// anything else (the default) row columns and indexes; read once.
fn huge_pages_for(index: bool) -> bool {
    static MODE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let mode = MODE.get_or_init(|| std::env::var("EMBSTORE_HUGE_PAGES").unwrap_or_default());
    match mode.as_str() {
        "0" => false,
        "rows" => !index,
        _ => true,
    }
}

/// Asks the kernel to back the 2 MiB-aligned part of the block at `ptr`
/// (`len` bytes, at least [`HUGE_FROM`], or [`HUGE_INDEX_FROM`] for an
/// index) with transparent huge pages
/// (`MADV_HUGEPAGE`), as NumPy and torch ask for their large arrays: a
/// kernel in THP mode `madvise` (Debian's and Ubuntu's default) gives them
/// only to memory that asks. Random row reads then miss the TLB far less,
/// and a first write faults once per 2 MiB, not per 4 KiB. Best effort: a
/// kernel without THP, or in mode `never`, refuses and nothing changes.
/// `index`: the block is an index (else a row column).
pub(crate) fn advise_huge(ptr: *const u8, len: usize, index: bool) {
    #[cfg(target_os = "linux")]
    if len >= (if index { HUGE_INDEX_FROM } else { HUGE_FROM }) && huge_pages_for(index) {
        let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
        let end = (ptr as usize).saturating_add(len) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: MADV_HUGEPAGE changes neither the contents nor the
            // mapping of the range, which lies inside the caller's live
            // block; a failure is ignored (the advice is optional).
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len, index);
}
