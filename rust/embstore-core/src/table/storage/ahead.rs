//! Pages mapped ahead of the rows that will need them. A first write to
//! fresh memory costs a page fault and the kernel's clear of the page, most
//! of what inserting a new row costs (a 3 KiB row of dim 768: the clear
//! alone is over half of an insert). An arena that grows asks for the
//! pages of its next rows on a thread of its own (`MADV_POPULATE_WRITE`,
//! which maps them without changing a byte), so that the inserting thread
//! finds them mapped and the clears run on another core meanwhile.
//!
//! Every piece of work runs inside the background runner (the binding's
//! call lock: a `fork()` waits for it), under its arena's [`Ahead`] lock,
//! a leaf lock in the crate's order: an arena that gives memory back (a
//! segment emptied, the arena dropped) takes that lock first and marks the
//! work made before as stale, so no work ever touches memory that was
//! given back. The work is advice: a kernel without `MADV_POPULATE_WRITE`
//! (before Linux 5.14), a thread that cannot start, or memory the kernel
//! refuses leaves the rows to fault in on the inserting thread, as before.

use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, PoisonError};

/// The rows an arena has asked to map ahead, and the lock its work runs
/// under: the lock holds the arena's generation, raised whenever memory is
/// given back; work made in an earlier generation does nothing.
#[derive(Debug, Default)]
pub(crate) struct Ahead {
    generation: Arc<Mutex<u64>>,
}

/// One arena's pages to map: address ranges (start, end) of its columns;
/// `done` hears when the work has run (tests).
struct Work {
    generation: Arc<Mutex<u64>>,
    made_in: u64,
    ranges: Vec<(usize, usize)>,
    done: Option<Sender<()>>,
}

impl Ahead {
    /// Asks the populate thread to map `ranges` (byte addresses inside the
    /// arena's live segments).
    pub(crate) fn request(&self, ranges: Vec<(usize, usize)>) {
        send(self.work(ranges, None));
    }

    fn work(&self, ranges: Vec<(usize, usize)>, done: Option<Sender<()>>) -> Work {
        Work {
            generation: Arc::clone(&self.generation),
            made_in: *lock(&self.generation),
            ranges,
            done,
        }
    }

    /// Marks every request made so far as stale, waiting for one that is
    /// mapping pages now: after this no request touches memory the arena
    /// gives back.
    pub(crate) fn forget(&self) {
        *lock(&self.generation) += 1;
    }
}

impl Drop for Ahead {
    fn drop(&mut self) {
        self.forget();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The populate thread's queue, and the process that started it (a forked
/// child has no such thread: its first request starts its own). A leaf
/// lock, held to send.
static QUEUE: Mutex<Option<(u32, Sender<Work>)>> = Mutex::new(None);

fn send(work: Work) {
    let mut q = lock(&QUEUE);
    let pid = std::process::id();
    let work = match q.as_ref() {
        Some((owner, tx)) if *owner == pid => match tx.send(work) {
            Ok(()) => return,
            Err(e) => e.0,
        },
        _ => work,
    };
    let (tx, rx) = channel::<Work>();
    let started = std::thread::Builder::new()
        .name("embstore-pages".into())
        .spawn(move || {
            for w in rx {
                crate::table::compaction::run_background(Box::new(move || w.run()));
            }
        });
    if started.is_ok() && tx.send(work).is_ok() {
        *q = Some((pid, tx));
    }
}

impl Work {
    fn run(self) {
        {
            let current = lock(&self.generation);
            if *current == self.made_in {
                for &(start, end) in &self.ranges {
                    super::pages::populate(start, end);
                }
            }
        }
        if let Some(done) = self.done {
            let _ = done.send(());
        }
    }
}

/// Waits until the populate thread has run every request made before.
#[cfg(test)]
pub(crate) fn settle() {
    let (tx, rx) = channel();
    send(Work {
        generation: Arc::new(Mutex::new(0)),
        made_in: 0,
        ranges: Vec::new(),
        done: Some(tx),
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .expect("the populate thread runs");
}

/// Pages of `start..start + len` (page-aligned) that are resident.
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn resident(start: usize, len: usize) -> usize {
    let mut v = vec![0u8; len.div_ceil(4096)];
    // SAFETY: `start` is a page-aligned mapping of `len` bytes; `v` has a
    // byte per page.
    let rc = unsafe { libc::mincore(start as *mut _, len, v.as_mut_ptr()) };
    assert_eq!(rc, 0);
    v.iter().filter(|&&b| b & 1 == 1).count()
}

/// Whether this kernel maps pages on `MADV_POPULATE_WRITE` (Linux 5.14).
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn populate_supported() -> bool {
    let mut v: Vec<u8> = Vec::with_capacity(3 << 12);
    let page = (v.as_mut_ptr() as usize).next_multiple_of(4096);
    super::pages::populate(page, page + 4096);
    resident(page, 4096) == 1
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// A fresh anonymous mapping of `len` bytes (no page resident yet).
    fn fresh(len: usize) -> usize {
        // SAFETY: a new anonymous private mapping touches no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p as usize
    }

    #[test]
    fn requests_map_pages_and_stale_ones_do_nothing() {
        if !populate_supported() {
            eprintln!("MADV_POPULATE_WRITE not supported here: skipped");
            return;
        }
        let len = 1 << 20;
        let (a, b) = (fresh(len), fresh(len));
        let ahead = Ahead::default();
        // A request made before the arena gave memory back does nothing.
        let stale = ahead.work(vec![(a, a + len)], None);
        ahead.forget();
        stale.run();
        assert_eq!(resident(a, len), 0);
        // A current one, on the populate thread, maps every page.
        let (tx, rx) = channel();
        send(ahead.work(vec![(b + 4096, b + len)], Some(tx)));
        rx.recv_timeout(std::time::Duration::from_secs(30)).unwrap();
        assert_eq!(resident(b, len), len / 4096 - 1);
        // The contents are unchanged: the pages read as zeros.
        // SAFETY: `b` is a live mapping of `len` bytes.
        let bytes = unsafe { std::slice::from_raw_parts(b as *const u8, len) };
        assert!(bytes.iter().all(|&x| x == 0));
        for p in [a, b] {
            // SAFETY: unmaps the mappings made above, no longer used.
            unsafe { libc::munmap(p as *mut _, len) };
        }
    }
}
