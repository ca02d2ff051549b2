//! What the storage's memory comes back through: the one allocation
//! failure ([`OutOfMemory`]) and the epoch's reclamation of replaced indexes
//! and emptied segments ([`retire`], [`reclaim_pending`]).

use crossbeam_epoch as epoch;
use std::sync::atomic::{AtomicBool, Ordering};

/// Memory for rows could not be allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutOfMemory;

impl From<std::collections::TryReserveError> for OutOfMemory {
    fn from(_: std::collections::TryReserveError) -> Self {
        OutOfMemory
    }
}

/// Frees what the epoch lets free now: unpinned, this thread pins and
/// flushes a few times, each letting the global epoch advance (when no
/// reader is pinned in an older one) and collecting what is two epochs old,
/// so that a replaced index or an emptied segment goes back to the OS at
/// once when no reader holds it, not at some later call's pin.
pub(crate) fn reclaim() {
    for _ in 0..3 {
        epoch::pin().flush();
    }
}

/// Whether memory was handed to the epoch since the last
/// [`reclaim_pending`].
static PENDING: AtomicBool = AtomicBool::new(false);

/// Records that memory was handed to the epoch, and tries to free it now.
pub(crate) fn retire() {
    PENDING.store(true, Ordering::Relaxed);
    reclaim();
}

/// [`reclaim`] if memory was handed to the epoch since the last call: for a
/// writer call's end, when the readers pinned during its growth (its own
/// parallel jobs included) have left.
pub(crate) fn reclaim_pending() {
    if PENDING.load(Ordering::Relaxed) && PENDING.swap(false, Ordering::Relaxed) {
        reclaim();
    }
}
