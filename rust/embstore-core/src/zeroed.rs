//! Fallible zeroed allocation: `vec![0; n]` that reports failure instead of
//! aborting the process, and that takes large blocks from the OS already
//! zero (calloc), so no pass writes the zeros.

/// Types whose all-zero bit pattern is a valid value (`0`, `0.0`).
///
/// # Safety
/// An implementor must be valid for every byte zero.
pub unsafe trait Zeroable: Copy {}

// SAFETY: zero bits are 0.0f32.
unsafe impl Zeroable for f32 {}
// SAFETY: zero bits are 0u8.
unsafe impl Zeroable for u8 {}
// SAFETY: zero bits are 0u32.
unsafe impl Zeroable for u32 {}
// SAFETY: zero bits are 0u64.
unsafe impl Zeroable for u64 {}
// SAFETY: zero bits are 0i64.
unsafe impl Zeroable for i64 {}
// SAFETY: all-zero bytes are the i32 0.
unsafe impl Zeroable for i32 {}
// SAFETY: zero bits are 0usize.
unsafe impl Zeroable for usize {}
// SAFETY: the zero byte is `false`.
unsafe impl Zeroable for bool {}

/// `n` zeros of a work or output array sized by the argument `arg`, or
/// `OutOfMemory` naming it: the one way a call allocates an array whose
/// length comes from its input (`vec![0; n]` would abort the process when
/// the memory cannot be had).
///
/// # Errors
/// `OutOfMemory` naming `arg` and the bytes asked for.
pub fn zeros<T: Zeroable>(arg: &'static str, n: usize) -> crate::error::Result<Vec<T>> {
    try_zeroed(n).ok_or_else(|| crate::error::oom(arg, n.saturating_mul(size_of::<T>())))
}

/// [`zeros`] asking for transparent huge pages ([`try_zeroed_huge`]): a
/// large work array written once per call (a batch's hashes and its
/// positions by shard) then faults once per 2 MiB, not per 4 KiB.
///
/// # Errors
/// `OutOfMemory` naming `arg` and the bytes asked for.
pub fn zeros_huge<T: Zeroable>(arg: &'static str, n: usize) -> crate::error::Result<Vec<T>> {
    try_zeroed_huge(n).ok_or_else(|| crate::error::oom(arg, n.saturating_mul(size_of::<T>())))
}

/// [`with_room`] whose room asks for transparent huge pages (from 4 MiB:
/// [`advise_huge`](crate::huge::advise_huge)), for a large work array
/// written whole once per call, with nothing zeroed first.
///
/// # Errors
/// `OutOfMemory` naming `arg` and the bytes asked for.
pub fn with_room_huge<T>(arg: &'static str, n: usize) -> crate::error::Result<Vec<T>> {
    let v = with_room::<T>(arg, n)?;
    crate::huge::advise_huge(v.as_ptr().cast(), v.capacity() * size_of::<T>(), false);
    Ok(v)
}

/// An empty vector with room for `n` values, or `OutOfMemory` naming `arg`.
///
/// # Errors
/// `OutOfMemory` naming `arg` and the bytes asked for.
pub fn with_room<T>(arg: &'static str, n: usize) -> crate::error::Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| crate::error::oom(arg, n.saturating_mul(size_of::<T>())))?;
    Ok(v)
}

/// `n` zeros, or `None` when the memory cannot be allocated.
pub fn try_zeroed<T: Zeroable>(n: usize) -> Option<Vec<T>> {
    let layout = std::alloc::Layout::array::<T>(n).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: the layout has a non-zero size (checked above).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of
    // `n` values of `T` (capacity `n`, `T`'s alignment), and all `n` are
    // initialized: zero bytes are a valid `T` (`Zeroable`).
    Some(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// [`try_zeroed`] for a large array written out of order (a batch call's
/// output, filled feature by feature): its memory asks for transparent
/// huge pages ([`advise_huge`](crate::huge::advise_huge)),
/// so that writes to rows far apart do not each miss the TLB on 4 KiB
/// pages, and a first write faults once per 2 MiB.
pub fn try_zeroed_huge<T: Zeroable>(n: usize) -> Option<Vec<T>> {
    let v: Vec<T> = try_zeroed(n)?;
    crate::huge::advise_huge(v.as_ptr().cast(), v.len() * size_of::<T>(), false);
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_vectors_hold_zeros_and_sizes_past_the_address_space_fail() {
        let v: Vec<f32> = try_zeroed(1000).unwrap();
        assert!(v.iter().all(|&x| x == 0.0));
        assert_eq!(v.len(), 1000);
        assert!(try_zeroed::<u8>(0).unwrap().is_empty());
        assert!(try_zeroed::<f32>(usize::MAX / 2).is_none());
        assert!(try_zeroed::<u32>(usize::MAX / 4 + 1).is_none());
        let e = zeros::<bool>("keys", usize::MAX / 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("keys"), "{e}");
        assert!(with_room::<i64>("values", usize::MAX / 16).is_err());
        assert_eq!(zeros::<i64>("keys", 3).unwrap(), vec![0, 0, 0]);
    }
}
