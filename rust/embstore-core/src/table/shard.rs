//! One shard: a hash index from key to row number over an [`Arena`].

use hashbrown::HashTable;

use super::arena::Arena;
use crate::hash::key_hash;

/// A shard's index and rows. Not synchronized: the table wraps each shard in
/// a lock and takes it once per call.
#[derive(Debug)]
#[allow(clippy::len_without_is_empty)]
pub struct Shard {
    /// Row numbers, hashed by their key (the key lives in the arena).
    index: HashTable<u32>,
    /// Keys and rows.
    pub arena: Arena,
}

impl Shard {
    /// An empty shard of rows of `stride` floats.
    pub fn new(stride: usize) -> Self {
        Shard {
            index: HashTable::new(),
            arena: Arena::new(stride),
        }
    }

    /// Rows held.
    #[inline]
    pub fn len(&self) -> usize {
        self.arena.len()
    }

    /// Bytes held: rows, keys and the index's allocation.
    pub fn bytes(&self) -> usize {
        self.arena.bytes() + self.index.allocation_size()
    }

    /// The row of `key` (whose hash is `hash`), if present.
    #[inline]
    pub fn find(&self, key: i64, hash: u64) -> Option<usize> {
        let arena = &self.arena;
        self.index
            .find(hash, |&r| arena.key(r as usize) == key)
            .map(|&r| r as usize)
    }

    /// The row of `key`, created by `fill` when missing; `true` when created.
    #[inline]
    pub fn find_or_insert(
        &mut self,
        key: i64,
        hash: u64,
        fill: impl FnOnce(&mut [f32]),
    ) -> (usize, bool) {
        let arena = &self.arena;
        match self.index.entry(
            hash,
            |&r| arena.key(r as usize) == key,
            |&r| key_hash(arena.key(r as usize)),
        ) {
            hashbrown::hash_table::Entry::Occupied(e) => (*e.get() as usize, false),
            hashbrown::hash_table::Entry::Vacant(e) => {
                let r = self.arena.push(key, fill);
                let r32 = u32::try_from(r).expect("a shard holds at most 2^32 rows");
                e.insert(r32);
                (r, true)
            }
        }
    }

    /// Removes `key`; `true` when it was present.
    pub fn remove(&mut self, key: i64, hash: u64) -> bool {
        let arena = &self.arena;
        let Ok(entry) = self
            .index
            .find_entry(hash, |&r| arena.key(r as usize) == key)
        else {
            return false;
        };
        let (r, _) = entry.remove();
        let last = (self.arena.len() - 1) as u32;
        if let Some(moved) = self.arena.swap_remove(r as usize) {
            let slot = self
                .index
                .find_mut(key_hash(moved), |&x| x == last)
                .expect("index holds every arena row");
            *slot = r;
        }
        true
    }
}
