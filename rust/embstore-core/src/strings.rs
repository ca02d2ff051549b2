//! String and byte keys to int64 keys: XXH3-64 (the xxHash family's 64-bit
//! hash, a published, platform-independent algorithm) of each value's bytes,
//! read as a two's-complement int64; under a salt `s != 0`, that hash `h`
//! becomes `mix64(h ^ mix64(s))` (splitmix64's finalizer, a bijection).
//!
//! Why not XXH3's seed: for inputs of 1 to 3 bytes XXH3 adds the seed into
//! a 32-bit combination of the bytes before mixing, so short strings under
//! different seeds collide by construction ('0'..'999' under seeds 0..25
//! gave 19,440 shared keys of 26,000). Here the salt acts on the finished
//! 64-bit hash, so the keys of one salt are a bijective image of another's
//! and two keys of different (string, salt) pairs coincide with probability
//! about 2^-64 at every length. Salt 0 keeps the plain XXH3-64 of the bytes.
//!
//! A `str` hashes as its UTF-8 bytes, so the same text gives the same key
//! from a Python list, a NumPy unicode array or a bytes array holding its
//! UTF-8. Fixed-width NumPy values (`U`, `S`) end at their first trailing
//! NUL, as NumPy reads them.
//!
//! Collisions: for `n` distinct values the chance that any two share a key
//! is about `n^2 / 2^65` (1e-6 for 6 million values, 3% for a billion).

use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

use crate::hash::mix64;

use crate::error::{Result, invalid};

/// Values per parallel job: below this a call runs on the calling thread.
const CHUNK: usize = 16 * 1024;

/// The key of one value's bytes under `salt`.
#[inline]
pub fn hash_bytes(bytes: &[u8], salt: u64) -> i64 {
    let h = xxh3_64(bytes);
    let h = if salt == 0 { h } else { mix64(h ^ mix64(salt)) };
    h as i64
}

/// Keys of byte strings given as slices.
pub fn hash_slices(values: &[&[u8]], salt: u64, out: &mut [i64]) {
    assert_eq!(values.len(), out.len(), "one output per value");
    out.par_chunks_mut(CHUNK)
        .zip(values.par_chunks(CHUNK))
        .for_each(|(o, v)| {
            for (o, v) in o.iter_mut().zip(v) {
                *o = hash_bytes(v, salt);
            }
        });
}

/// Keys of fixed-width byte strings (NumPy `S<width>`): `data` holds
/// `out.len()` values of `width` bytes each; trailing NULs are not part of a
/// value.
pub fn hash_fixed_bytes(data: &[u8], width: usize, salt: u64, out: &mut [i64]) {
    assert_eq!(data.len(), width * out.len(), "width bytes per value");
    if width == 0 {
        out.fill(hash_bytes(b"", salt));
        return;
    }
    out.par_chunks_mut(CHUNK)
        .zip(data.par_chunks(CHUNK * width))
        .for_each(|(o, d)| {
            for (o, v) in o.iter_mut().zip(d.chunks_exact(width)) {
                let end = v.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
                *o = hash_bytes(&v[..end], salt);
            }
        });
}

/// Keys of fixed-width UCS-4 strings (NumPy `U<width>`): `data` holds
/// `out.len()` values of `width` code points each, hashed as UTF-8 without
/// their trailing NULs.
///
/// # Errors
/// A code point that is not a Unicode scalar value (a surrogate or above
/// U+10FFFF): nothing is written for any value.
pub fn hash_ucs4(data: &[u32], width: usize, salt: u64, out: &mut [i64]) -> Result<()> {
    assert_eq!(data.len(), width * out.len(), "width code points per value");
    if width == 0 {
        out.fill(hash_bytes(b"", salt));
        return Ok(());
    }
    let bad = |c: &u32| char::from_u32(*c).is_none();
    let first_bad = data
        .par_chunks(CHUNK * width)
        .position_first(|chunk| chunk.iter().any(bad))
        .and_then(|j| {
            let start = j * CHUNK * width;
            data[start..].iter().position(bad).map(|i| start + i)
        });
    if let Some(i) = first_bad {
        return Err(invalid(
            "values",
            format!(
                "value {} holds code point {:#x}, which is not a Unicode scalar value",
                i / width,
                data[i]
            ),
        ));
    }
    out.par_chunks_mut(CHUNK)
        .zip(data.par_chunks(CHUNK * width))
        .for_each(|(o, d)| {
            let mut buf = Vec::with_capacity(4 * width);
            for (o, v) in o.iter_mut().zip(d.chunks_exact(width)) {
                let end = v.iter().rposition(|&c| c != 0).map_or(0, |i| i + 1);
                buf.clear();
                if v[..end].iter().all(|&c| c < 0x80) {
                    // ASCII: UTF-8 is one byte per code point.
                    buf.extend(v[..end].iter().map(|&c| c as u8));
                } else {
                    for &c in &v[..end] {
                        // Checked above: every code point is a scalar value.
                        let ch = char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER);
                        let mut enc = [0u8; 4];
                        buf.extend_from_slice(ch.encode_utf8(&mut enc).as_bytes());
                    }
                }
                *o = hash_bytes(&buf, salt);
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_three_layouts_agree_on_the_same_text() {
        let words = ["", "a", "user:42", "héllo wörld", "日本語", "🙂x"];
        let width = words.iter().map(|w| w.chars().count()).max().unwrap();
        let bwidth = words.iter().map(|w| w.len()).max().unwrap();
        let mut ucs4 = vec![0u32; width * words.len()];
        let mut fixed = vec![0u8; bwidth * words.len()];
        for (i, w) in words.iter().enumerate() {
            for (j, c) in w.chars().enumerate() {
                ucs4[i * width + j] = c as u32;
            }
            fixed[i * bwidth..i * bwidth + w.len()].copy_from_slice(w.as_bytes());
        }
        let slices: Vec<&[u8]> = words.iter().map(|w| w.as_bytes()).collect();
        let (mut a, mut b, mut c) = (vec![0; 6], vec![0; 6], vec![0; 6]);
        hash_slices(&slices, 7, &mut a);
        hash_fixed_bytes(&fixed, bwidth, 7, &mut b);
        hash_ucs4(&ucs4, width, 7, &mut c).unwrap();
        assert_eq!(a, b);
        assert_eq!(a, c);
        // the salt changes every key
        let mut d = vec![0; 6];
        hash_slices(&slices, 8, &mut d);
        assert!(a.iter().zip(&d).all(|(x, y)| x != y));
    }

    #[test]
    fn a_surrogate_is_refused_and_nothing_written() {
        let mut out = vec![5i64; 2];
        let err = hash_ucs4(&[0x61, 0xD800], 1, 0, &mut out).unwrap_err();
        assert!(err.to_string().contains("value 1"), "{err}");
        assert_eq!(out, vec![5, 5]);
    }

    #[test]
    fn large_batches_equal_one_at_a_time() {
        let data: Vec<String> = (0..100_000).map(|i| format!("k{i}")).collect();
        let slices: Vec<&[u8]> = data.iter().map(|s| s.as_bytes()).collect();
        let mut out = vec![0; data.len()];
        hash_slices(&slices, 3, &mut out);
        for (s, k) in data.iter().zip(&out).step_by(997) {
            assert_eq!(*k, hash_bytes(s.as_bytes(), 3));
        }
    }
}
