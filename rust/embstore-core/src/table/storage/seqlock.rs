//! The lock-free read protocol: how a reader that holds no lock finds a
//! key's row in a shard's index and copies the row whole, while the shard's
//! one writer (who holds the shard's write lock) inserts, removes, moves and
//! changes rows.
//!
//! Two pieces, each a handful of atomic operations:
//!
//! - **Index slots.** A slot is a key and a row word. The writer fills an
//!   empty slot by storing the key, then the row word (`row + 1`) with
//!   release; a slot's key never changes after that (a removal stores
//!   [`TOMB`] in the row word, and only a rebuilt index reuses the slot), so
//!   a reader that matches the key and then acquires a live row word holds a
//!   pair the writer published together. A move (the last row filling a
//!   removed row's place) stores the moved key's new row word.
//! - **Row versions** (a seqlock per row): the writer makes a row's version
//!   odd before it writes the row's floats (a release fence after the
//!   store) and even again after (a release store). A reader takes an even
//!   version, checks that the key's slot still names the row, copies, then
//!   (after an acquire fence) checks that the version did not change. If
//!   any float it copied came from a write, the fences make the odd version
//!   visible to that check, so a copy that passes holds one version of the
//!   row: all of one update or none of it. A row moved or removed meanwhile
//!   fails the slot check or the version check, and the reader probes again
//!   (or finds the key gone). An index replaced by a larger or cleaned one
//!   has every slot marked removed after the new one is published, so a
//!   reader that probed the old one fails the same slot check; a reader
//!   whose probe missed checks that its index is still the current one.
//!
//! The protocol is written once, in [`protocol!`], and instantiated twice:
//! on std's atomics for the table, and on loom's in this module's tests,
//! where loom runs every interleaving of a writer and readers (`cargo test
//! -p embstore-core --release --lib seqlock` with `RUSTFLAGS="--cfg loom"`).

pub(crate) mod consts {
    /// The row word of an empty slot (zero, so a fresh zeroed index is empty).
    pub(crate) const EMPTY: u32 = 0;
    /// The row word of a removed key's slot.
    pub(crate) const TOMB: u32 = u32::MAX;
}

/// The protocol's functions over one atomics module (`std::sync::atomic`,
/// or loom's).
macro_rules! protocol {
    ($atomic:path) => {
        use $atomic::{AtomicI64, AtomicU32, Ordering, fence};
        #[allow(unused_imports)]
        pub(crate) use $crate::table::storage::seqlock::consts::{EMPTY, TOMB};

        /// The slot holding `key` and the row it names, probing from slot
        /// `home` (linear probing over `keys.len()` slots, a power of two),
        /// or `None` when the key has no row. For the writer and readers
        /// alike; a reader must check the answer as [`read_begin`] says.
        #[inline(always)]
        pub(crate) fn probe(
            keys: &[AtomicI64],
            rows: &[AtomicU32],
            key: i64,
            home: usize,
        ) -> Option<(usize, usize)> {
            let mask = keys.len() - 1;
            let mut i = home & mask;
            loop {
                let k = keys[i].load(Ordering::Relaxed);
                if k == key {
                    let r = rows[i].load(Ordering::Acquire);
                    if r == EMPTY {
                        // Empty (key 0's probe), or an insert not yet
                        // published: absent.
                        return None;
                    }
                    if r != TOMB {
                        return Some((i, r as usize - 1));
                    }
                } else if k == 0 && rows[i].load(Ordering::Acquire) == EMPTY {
                    return None;
                }
                i = (i + 1) & mask;
            }
        }

        /// Publishes `key` at row `row` in empty slot `slot` (writer only).
        #[inline]
        pub(crate) fn publish(
            keys: &[AtomicI64],
            rows: &[AtomicU32],
            slot: usize,
            key: i64,
            row: usize,
        ) {
            keys[slot].store(key, Ordering::Relaxed);
            rows[slot].store(row as u32 + 1, Ordering::Release);
        }

        /// Points occupied slot `slot` at row `row` (writer only: a move).
        #[inline]
        pub(crate) fn repoint(rows: &[AtomicU32], slot: usize, row: usize) {
            rows[slot].store(row as u32 + 1, Ordering::Release);
        }

        /// Marks slot `slot`'s key removed (writer only).
        #[inline]
        pub(crate) fn bury(rows: &[AtomicU32], slot: usize) {
            rows[slot].store(TOMB, Ordering::Release);
        }

        /// Whether slot `slot` still names row `row` (a reader's check
        /// after [`read_begin`]).
        #[inline(always)]
        pub(crate) fn names(rows: &[AtomicU32], slot: usize, row: usize) -> bool {
            rows[slot].load(Ordering::Acquire) == row as u32 + 1
        }

        /// Starts a write of the row whose version is `v` (writer only).
        #[inline(always)]
        pub(crate) fn write_begin(v: &AtomicU32) {
            let x = v.load(Ordering::Relaxed);
            v.store(x.wrapping_add(1), Ordering::Relaxed);
            fence(Ordering::Release);
        }

        /// Ends a write that [`write_begin`] started.
        #[inline(always)]
        pub(crate) fn write_end(v: &AtomicU32) {
            let x = v.load(Ordering::Relaxed);
            v.store(x.wrapping_add(1), Ordering::Release);
        }

        /// A reader's start of a copy of a row: its version if no write is
        /// under way. The reader then checks with [`names`] that the key's
        /// slot still names the row, copies it, and keeps the copy only if
        /// [`read_end`] passes.
        #[inline(always)]
        pub(crate) fn read_begin(v: &AtomicU32) -> Option<u32> {
            let x = v.load(Ordering::Acquire);
            (x & 1 == 0).then_some(x)
        }

        /// Whether no write touched the row since [`read_begin`] gave `x`.
        #[inline(always)]
        pub(crate) fn read_end(v: &AtomicU32, x: u32) -> bool {
            fence(Ordering::Acquire);
            v.load(Ordering::Relaxed) == x
        }
    };
}

protocol!(std::sync::atomic);

#[cfg(all(test, loom))]
mod loom_model {
    //! The protocol under loom: a writer that updates, removes and moves
    //! rows of a 4-slot index, and a reader that looks a key up, and every
    //! interleaving of them (with the memory orders above) checked: the
    //! reader's copy is always one whole version of the key's row, or the
    //! key is reported absent.
    mod p {
        protocol!(loom::sync::atomic);
    }
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicI64, AtomicU32, Ordering};

    /// Two rows of two words each, their versions, and a 4-slot index.
    struct Shard {
        keys: Vec<AtomicI64>,
        rows: Vec<AtomicU32>,
        data: Vec<[AtomicU32; 2]>,
        vers: Vec<AtomicU32>,
    }

    impl Shard {
        fn new() -> Self {
            Shard {
                keys: (0..4).map(|_| AtomicI64::new(0)).collect(),
                rows: (0..4).map(|_| AtomicU32::new(EMPTY)).collect(),
                data: (0..2)
                    .map(|_| [AtomicU32::new(0), AtomicU32::new(0)])
                    .collect(),
                vers: (0..2).map(|_| AtomicU32::new(0)).collect(),
            }
        }

        /// The writer's row write: both words to `v` (key * 100 + step).
        fn write(&self, row: usize, v: u32) {
            p::write_begin(&self.vers[row]);
            self.data[row][0].store(v, Ordering::Relaxed);
            self.data[row][1].store(v, Ordering::Relaxed);
            p::write_end(&self.vers[row]);
        }

        /// A reader's lookup: the row's two words, whole, or None.
        fn read(&self, key: i64, home: usize) -> Option<[u32; 2]> {
            loop {
                let (slot, row) = p::probe(&self.keys, &self.rows, key, home)?;
                let Some(v) = p::read_begin(&self.vers[row]) else {
                    loom::thread::yield_now();
                    continue;
                };
                if !p::names(&self.rows, slot, row) {
                    loom::thread::yield_now();
                    continue;
                }
                let got = [
                    self.data[row][0].load(Ordering::Relaxed),
                    self.data[row][1].load(Ordering::Relaxed),
                ];
                if p::read_end(&self.vers[row], v) {
                    return Some(got);
                }
                loom::thread::yield_now();
            }
        }
    }

    use super::consts::{EMPTY, TOMB};

    /// Keys 1 (row 0, slot 1) and 2 (row 1, slot 2) are held; the writer
    /// updates key 2, removes key 1 (key 2's row moves into row 0), then
    /// updates key 2 again. A reader of key 2 sees one of key 2's three
    /// versions, whole; a reader of key 1 sees key 1's row or nothing.
    #[test]
    fn readers_see_whole_rows_of_their_key_while_a_writer_moves_rows() {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(|| {
            let s = Arc::new(Shard::new());
            p::publish(&s.keys, &s.rows, 1, 1, 0);
            p::publish(&s.keys, &s.rows, 2, 2, 1);
            s.write(0, 100);
            s.write(1, 200);
            let w = {
                let s = s.clone();
                loom::thread::spawn(move || {
                    s.write(1, 201);
                    // Remove key 1: bury its slot, move row 1 (key 2) into
                    // row 0, point key 2's slot at row 0.
                    p::bury(&s.rows, 1);
                    let moved = [
                        s.data[1][0].load(Ordering::Relaxed),
                        s.data[1][1].load(Ordering::Relaxed),
                    ];
                    p::write_begin(&s.vers[0]);
                    s.data[0][0].store(moved[0], Ordering::Relaxed);
                    s.data[0][1].store(moved[1], Ordering::Relaxed);
                    p::write_end(&s.vers[0]);
                    p::repoint(&s.rows, 2, 0);
                    // Row 1 is reused at once (a new row's fill).
                    s.write(1, 999);
                    s.write(0, 202);
                })
            };
            let r = {
                let s = s.clone();
                loom::thread::spawn(move || {
                    let two = s.read(2, 2).expect("key 2 is never removed");
                    assert_eq!(two[0], two[1], "a torn row of key 2: {two:?}");
                    assert!([200, 201, 202].contains(&two[0]), "not key 2's: {two:?}");
                    if let Some(one) = s.read(1, 1) {
                        assert_eq!(one, [100, 100], "key 1 read from reused memory");
                    }
                })
            };
            w.join().unwrap();
            r.join().unwrap();
            assert!(s.rows[1].load(Ordering::Relaxed) == TOMB);
        });
    }
}
