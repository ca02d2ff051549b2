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

/// The `i`-th 64-bit draw of a row stream (splitmix64 with counter `i`).
#[inline(always)]
pub const fn draw(stream: u64, i: u64) -> u64 {
    mix64(stream.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN)))
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
    fn draws_differ_by_counter_and_key() {
        let s = row_stream(7, 42);
        assert_ne!(draw(s, 0), draw(s, 1));
        assert_ne!(row_stream(7, 42), row_stream(7, 43));
        assert_ne!(row_stream(7, 42), row_stream(8, 42));
    }
}
