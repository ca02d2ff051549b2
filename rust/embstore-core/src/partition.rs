//! Which rank owns a key: the partitions of a sharded table.

use rayon::prelude::*;

use crate::error::{Result, invalid};
use crate::hash::owner_of;

/// How keys are spread over `size` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Partition {
    /// A mixing hash of the key (even for sequential or patterned keys).
    Hash,
    /// `key mod size` (non-negative), as SOK and TF's "mod" strategy.
    Mod,
    /// Contiguous ranges of `[0, key_space)`, as TF's "div" strategy.
    Div {
        /// Keys must lie in `[0, key_space)`.
        key_space: i64,
    },
}

impl Partition {
    /// The partition named `name` ("hash", "mod", "div").
    ///
    /// # Errors
    /// An unknown name, or "div" without a positive `key_space`.
    pub fn from_name(name: &str, key_space: Option<i64>) -> Result<Partition> {
        match (name, key_space) {
            ("hash", _) => Ok(Partition::Hash),
            ("mod", _) => Ok(Partition::Mod),
            ("div", Some(k)) if k > 0 => Ok(Partition::Div { key_space: k }),
            ("div", _) => Err(invalid(
                "key_space",
                "expected key_space > 0 with partition=\"div\"",
            )),
            (other, _) => Err(invalid(
                "partition",
                format!(
                    "expected one of {}; got {other:?}",
                    crate::vocab::one_of(crate::vocab::PARTITIONS)
                ),
            )),
        }
    }

    /// The owner of `key` among `size` ranks, or `None` for a key outside
    /// a "div" partition's key space.
    #[inline]
    pub fn owner(&self, key: i64, size: usize) -> Option<usize> {
        match *self {
            Partition::Hash => Some(owner_of(key, size)),
            Partition::Mod => Some(key.rem_euclid(size as i64) as usize),
            Partition::Div { key_space } => {
                if (0..key_space).contains(&key) {
                    let block = (key_space as u64).div_ceil(size as u64);
                    Some((key as u64 / block) as usize)
                } else {
                    None
                }
            }
        }
    }

    /// The owner of every key, into `out`.
    ///
    /// # Errors
    /// A key outside a "div" partition's key space, or `size < 1`.
    pub fn owners(&self, keys: &[i64], size: usize, out: &mut [i32]) -> Result<()> {
        if size < 1 {
            return Err(invalid("size", "expected at least one rank"));
        }
        out.par_iter_mut()
            .zip(keys.par_iter())
            .with_min_len(1 << 14)
            .for_each(|(o, &k)| *o = self.owner(k, size).map_or(-1, |r| r as i32));
        if let Some(i) = out.iter().position(|&o| o < 0) {
            let Partition::Div { key_space } = *self else {
                unreachable!("only div refuses keys")
            };
            return Err(invalid(
                "keys",
                format!(
                    "expected keys in [0, {key_space}) with partition=\"div\", got {}",
                    keys[i]
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mod_and_div_owners() {
        assert_eq!(Partition::Mod.owner(-1, 3), Some(2));
        assert_eq!(Partition::Mod.owner(7, 3), Some(1));
        let div = Partition::Div { key_space: 10 };
        let owners: Vec<_> = (0..10).map(|k| div.owner(k, 3).unwrap()).collect();
        assert_eq!(owners, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]);
        assert_eq!(div.owner(10, 3), None);
        assert_eq!(div.owner(-1, 3), None);
        assert_eq!(
            Partition::Div {
                key_space: i64::MAX
            }
            .owner(i64::MAX - 1, 4),
            Some(3)
        );
    }
}
