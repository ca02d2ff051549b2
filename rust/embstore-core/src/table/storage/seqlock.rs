//! The lock-free read protocol: how a reader that holds no lock finds a
//! key's row in a shard's index and copies the row whole, while the shard's
//! one writer (who holds the shard's write lock) inserts, removes, moves and
//! changes rows.
//!
//! An index slot is a key and a 64-bit word, side by side (16 bytes, four
//! slots a cache line): the word holds the key's row (`row + 1`, or
//! [`EMPTY`], or [`TOMB`] once removed) in its low half and the key's
//! version in its high half. The version is a seqlock per key: the writer
//! makes it odd before it writes the key's floats (a release fence after
//! the store) and even again after (a release store, which also names the
//! row the floats now live in, so a move is one such write).
//!
//! - **Finding.** The writer fills an empty slot by storing the key, then
//!   the word with release; a slot's key never changes after that (only a
//!   rebuilt index reuses a removed key's slot), so a reader that matches
//!   the key and then acquires a live word holds a pair the writer published
//!   together.
//! - **Copying.** A reader takes the word (version even), copies the row it
//!   names, then (after an acquire fence) loads the word again and keeps the
//!   copy only if it is unchanged. If any float it copied came from a write
//!   made after its first load (the key's own update, a move of another row
//!   into this one after this key's removal, a new row's fill), the release
//!   fence before that write orders every store before it, this key's word
//!   change included, before the reader's second load: the reader sees a
//!   changed word and reads again. A new row's fill is preceded by such a
//!   fence too ([`fill_begin`]), so a row number reused after a removal is
//!   never copied as the removed key's. An index replaced by a larger or
//!   cleaned one has every word marked removed after the new one is
//!   published, so a reader that probed the old one fails the same check;
//!   a reader whose probe missed checks that its index is still the current
//!   one.
//!
//! The protocol is written once, in [`protocol!`], and instantiated twice:
//! on std's atomics for the table, and on loom's in this module's tests,
//! where loom runs every interleaving of a writer and readers (`cargo test
//! -p embstore-core --features loom --lib -- seqlock handoff`).

pub(crate) mod consts {
    /// The row half of an empty slot's word (zero, so a fresh zeroed index
    /// is empty).
    pub(crate) const EMPTY: u32 = 0;
    /// The row half of a removed key's word.
    pub(crate) const TOMB: u32 = u32::MAX;
    /// One step of a word's version half.
    pub(crate) const STEP: u64 = 1 << 32;
}

/// The protocol's functions over one atomics module (`std::sync::atomic`,
/// or loom's).
macro_rules! protocol {
    ($atomic:path) => {
        use $atomic::{AtomicI64, AtomicU64, Ordering, fence};
        #[allow(unused_imports)]
        pub(crate) use $crate::table::storage::seqlock::consts::{EMPTY, STEP, TOMB};

        /// One index slot: a key and its word (version, row).
        #[derive(Debug)]
        #[repr(C, align(16))]
        pub(crate) struct Cell {
            pub(crate) key: AtomicI64,
            pub(crate) word: AtomicU64,
        }

        /// The row half of a word.
        #[inline(always)]
        pub(crate) fn row_of(word: u64) -> u32 {
            word as u32
        }

        /// The row a live word names.
        #[inline(always)]
        pub(crate) fn row_named(word: u64) -> usize {
            (word as u32 - 1) as usize
        }

        /// Whether a write of the key is under way (odd version).
        #[inline(always)]
        pub(crate) fn writing(word: u64) -> bool {
            (word >> 32) & 1 == 1
        }

        /// The slot holding `key` and its word, probing from slot `home`
        /// (linear probing over `cells.len()` slots, any number), or
        /// `None` when the key has no row. For the writer and readers
        /// alike; a reader keeps a copy only if [`read_end`] passes.
        #[inline(always)]
        pub(crate) fn probe(cells: &[Cell], key: i64, home: usize) -> Option<(usize, u64)> {
            let n = cells.len();
            let mut i = if home < n { home } else { home % n };
            loop {
                let c = &cells[i];
                let k = c.key.load(Ordering::Relaxed);
                if k == key {
                    let w = c.word.load(Ordering::Acquire);
                    match row_of(w) {
                        // Empty (key 0's probe), or an insert not yet
                        // published: absent.
                        EMPTY => return None,
                        TOMB => {}
                        _ => return Some((i, w)),
                    }
                } else if k == 0 && row_of(c.word.load(Ordering::Acquire)) == EMPTY {
                    return None;
                }
                i += 1;
                if i == n {
                    i = 0;
                }
            }
        }

        /// Publishes `key` at row `row` in empty slot `slot`, version 0
        /// (writer only; the row's floats were written before).
        #[inline]
        pub(crate) fn publish(cells: &[Cell], slot: usize, key: i64, row: usize) {
            cells[slot].key.store(key, Ordering::Relaxed);
            cells[slot].word.store(row as u64 + 1, Ordering::Release);
        }

        /// Puts word `word` (copied from a replaced index) with `key` in
        /// empty slot `slot` of an index no reader holds yet (writer only).
        #[inline]
        pub(crate) fn copy_in(cells: &[Cell], slot: usize, key: i64, word: u64) {
            cells[slot].key.store(key, Ordering::Relaxed);
            cells[slot].word.store(word, Ordering::Relaxed);
        }

        /// Marks slot `slot`'s key removed (writer only).
        #[inline]
        pub(crate) fn bury(cells: &[Cell], slot: usize) {
            cells[slot].word.store(u64::from(TOMB), Ordering::Release);
        }

        /// Starts a write of the floats of the key whose word is `w`
        /// (writer only): its version odd, then a release fence.
        #[inline(always)]
        pub(crate) fn write_begin(w: &AtomicU64) {
            let x = w.load(Ordering::Relaxed);
            w.store(x.wrapping_add(STEP), Ordering::Relaxed);
            fence(Ordering::Release);
        }

        /// Ends a write that [`write_begin`] started: the version even
        /// again, the key's floats now at row `row` (its old row unless the
        /// write moved them).
        #[inline(always)]
        pub(crate) fn write_end(w: &AtomicU64, row: usize) {
            let x = w.load(Ordering::Relaxed);
            let v = (x >> 32).wrapping_add(1);
            w.store((v << 32) | (row as u64 + 1), Ordering::Release);
        }

        /// Before the writer fills a new row's floats: a release fence, so
        /// that a reader that copies any of them also sees every word the
        /// writer changed before (a removed key's, a moved key's).
        #[inline(always)]
        pub(crate) fn fill_begin() {
            fence(Ordering::Release);
        }

        /// Whether the word of `cell` is still `word`, the word a reader
        /// loaded before its copy: then the copy holds one version of the
        /// key's row.
        #[inline(always)]
        pub(crate) fn read_end(cell: &Cell, word: u64) -> bool {
            fence(Ordering::Acquire);
            cell.word.load(Ordering::Relaxed) == word
        }
    };
}

protocol!(std::sync::atomic);

#[cfg(all(test, feature = "loom"))]
mod loom_model {
    //! The protocol under loom: a writer that updates, removes and moves
    //! rows of a 4-slot index and fills a reused row, and a reader that
    //! looks keys up, and every interleaving of them (with the memory
    //! orders above) checked: the reader's copy is always one whole version
    //! of the key's row, or the key is reported absent.
    mod p {
        protocol!(loom::sync::atomic);
    }
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};

    /// Two rows of two words each and a 4-slot index.
    struct Shard {
        cells: Vec<p::Cell>,
        data: Vec<[AtomicU32; 2]>,
    }

    impl Shard {
        fn new() -> Self {
            Shard {
                cells: (0..4)
                    .map(|_| p::Cell {
                        key: AtomicI64::new(0),
                        word: AtomicU64::new(0),
                    })
                    .collect(),
                data: (0..2)
                    .map(|_| [AtomicU32::new(0), AtomicU32::new(0)])
                    .collect(),
            }
        }

        /// Both words of `row` to `v` (no version change: a fill, or inside
        /// a write).
        fn put(&self, row: usize, v: u32) {
            self.data[row][0].store(v, Ordering::Relaxed);
            self.data[row][1].store(v, Ordering::Relaxed);
        }

        /// The writer's update of the key in `slot` (at `row`): both words
        /// to `v` (key * 100 + step).
        fn write(&self, slot: usize, row: usize, v: u32) {
            p::write_begin(&self.cells[slot].word);
            self.put(row, v);
            p::write_end(&self.cells[slot].word, row);
        }

        /// A reader's lookup: the row's two words, whole, or None.
        fn read(&self, key: i64, home: usize) -> Option<[u32; 2]> {
            loop {
                let (slot, w) = p::probe(&self.cells, key, home)?;
                if p::writing(w) {
                    loom::thread::yield_now();
                    continue;
                }
                let row = p::row_named(w);
                let got = [
                    self.data[row][0].load(Ordering::Relaxed),
                    self.data[row][1].load(Ordering::Relaxed),
                ];
                if p::read_end(&self.cells[slot], w) {
                    return Some(got);
                }
                loom::thread::yield_now();
            }
        }
    }

    use super::consts::TOMB;

    /// Keys 1 (row 0, slot 1) and 2 (row 1, slot 2) are held; the writer
    /// updates key 2, removes key 1 (key 2's row moves into row 0), fills
    /// row 1 for a new key 3 (slot 3), then updates key 2 again. A reader
    /// of key 2 sees one of key 2's three versions, whole; a reader of key
    /// 1 sees key 1's row or nothing.
    #[test]
    fn readers_see_whole_rows_of_their_key_while_a_writer_moves_rows() {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(3);
        b.check(|| {
            let s = Arc::new(Shard::new());
            s.put(0, 100);
            p::publish(&s.cells, 1, 1, 0);
            s.put(1, 200);
            p::publish(&s.cells, 2, 2, 1);
            let w = {
                let s = s.clone();
                loom::thread::spawn(move || {
                    s.write(2, 1, 201);
                    // Remove key 1: bury its slot, move row 1 (key 2) into
                    // row 0 under key 2's version.
                    p::bury(&s.cells, 1);
                    let moved = [
                        s.data[1][0].load(Ordering::Relaxed),
                        s.data[1][1].load(Ordering::Relaxed),
                    ];
                    p::write_begin(&s.cells[2].word);
                    s.data[0][0].store(moved[0], Ordering::Relaxed);
                    s.data[0][1].store(moved[1], Ordering::Relaxed);
                    p::write_end(&s.cells[2].word, 0);
                    // Row 1 is reused at once (a new key's fill).
                    p::fill_begin();
                    s.put(1, 999);
                    p::publish(&s.cells, 3, 3, 1);
                    s.write(2, 0, 202);
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
            assert!(p::row_of(s.cells[1].word.load(Ordering::Relaxed)) == TOMB);
        });
    }
}
