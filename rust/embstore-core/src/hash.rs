//! Counter-based mixing functions: the key hash of the index and partitioner,
//! and the per-(seed, key, column) stream of the initializers.

/// The golden-ratio increment of splitmix64.
pub const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// splitmix64's finalizer (Stafford variant 13): a bijective 64-bit mixer.
#[inline(always)]
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hash of a key for the index and for shard selection. Sequential keys, keys
/// that share their low bits and negative keys all spread evenly.
#[inline(always)]
pub const fn key_hash(key: i64) -> u64 {
    mix64((key as u64) ^ 0x2545_F491_4F6C_DD1D)
}

/// The base of a row's initializer stream: a pure function of (seed, key).
#[inline(always)]
pub const fn row_stream(seed: u64, key: i64) -> u64 {
    mix64(mix64(seed ^ 0x6A09_E667_F3BC_C909) ^ (key as u64))
}

/// The stream of a row's stochastic rounding at optimizer step `step`: a
/// pure function of (seed, key, step), so that an 8-bit row rounds the same
/// whatever the thread count, shard count or rank that updates it.
#[inline(always)]
pub const fn rounding_stream(seed: u64, key: i64, step: u64) -> u64 {
    mix64(row_stream(seed ^ 0xB7E1_5162_8AED_2A6B, key) ^ step.wrapping_mul(GOLDEN))
}

/// The `i`-th 64-bit draw of a row stream (splitmix64 with counter `i`).
#[inline(always)]
pub const fn draw(stream: u64, i: u64) -> u64 {
    mix64(stream.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// The rank that owns `key` among `n` ranks under the "hash" partition:
/// a mixing hash independent of [`key_hash`], so that the keys one rank owns
/// still spread over all of its table's shards.
#[inline(always)]
pub const fn owner_of(key: i64, n: usize) -> usize {
    let h = mix64((key as u64) ^ 0x5851_F42D_4C95_7F2D);
    (((h >> 32) * n as u64) >> 32) as usize
}

/// Shard of a hash among `n` shards, from the high 32 bits; the in-shard
/// index uses the low 32 bits only, so the two are independent.
#[inline(always)]
pub const fn shard_of(hash: u64, n: usize) -> usize {
    (((hash >> 32) * n as u64) >> 32) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_of_stays_in_range_and_spreads() {
        for n in [1usize, 3, 8, 64, 4096] {
            let mut counts = vec![0usize; n];
            for k in 0..200_000i64 {
                let s = shard_of(key_hash(k), n);
                assert!(s < n);
                counts[s] += 1;
            }
            let mean = 200_000.0 / n as f64;
            let max = *counts.iter().max().unwrap() as f64;
            if n <= 64 {
                assert!(max < mean * 1.1, "n={n} max={max} mean={mean}");
            }
        }
    }

    #[test]
    fn owners_spread_and_are_independent_of_shards() {
        for n in [2usize, 3, 4] {
            let mut counts = vec![0usize; n];
            // Keys owned by rank 0 must still use every shard of its table.
            let mut shards = [0usize; 8];
            for k in 0..300_000i64 {
                let o = owner_of(k << 20, n);
                counts[o] += 1;
                if o == 0 {
                    shards[shard_of(key_hash(k << 20), 8)] += 1;
                }
            }
            let mean = 300_000.0 / n as f64;
            assert!(
                counts.iter().all(|&c| (c as f64) < mean * 1.05),
                "{counts:?}"
            );
            let smean = shards.iter().sum::<usize>() as f64 / 8.0;
            assert!(
                shards.iter().all(|&c| (c as f64) > smean * 0.9),
                "{shards:?}"
            );
        }
    }

    #[test]
    fn draws_differ_by_counter_and_key() {
        let s = row_stream(7, 42);
        assert_ne!(draw(s, 0), draw(s, 1));
        assert_ne!(row_stream(7, 42), row_stream(7, 43));
        assert_ne!(row_stream(7, 42), row_stream(8, 42));
    }
}
