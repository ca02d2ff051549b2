//! The row codec: how a row's `dim` weights are stored ([`RowFormat`]), in
//! the table's memory (float words, 16-bit values packed two to a word) and
//! in a checkpoint's files (little-endian). The arena, the file writer, the
//! loader and the mapped reader all encode and decode rows here.

use crate::error::{Result, invalid};
use crate::simd::Backend;
use crate::vocab;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// How a row's `dim` weights are stored. Optimizer state is always float32;
/// optimizer math is done in float32 and rounded to the row format (round to
/// nearest even) when the row is written back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowFormat {
    /// 32-bit floats.
    #[default]
    F32,
    /// IEEE half precision (1 sign, 5 exponent, 10 mantissa bits).
    F16,
    /// bfloat16 (the top 16 bits of a float32).
    BF16,
    /// 8-bit codes with a float32 scale and offset per row: weight `c` is
    /// `offset + scale * q[c]`, `q[c]` in 0..=255, the row's smallest weight
    /// at 0 and its largest at 255 ([`RowFormat::encode`]); an optimizer
    /// step rounds stochastically ([`RowFormat::encode_rounding`]). The
    /// scale and offset are float32 rather than 16-bit: 8 bytes a row (72
    /// at dim 64, 3.6x fewer than float32's 256), exact for any range, and
    /// the same arithmetic in every backend and in NumPy.
    I8,
}

/// Bytes of the codes of a `dim`-weight 8-bit row, in whole words.
fn code_words(dim: usize) -> usize {
    dim.div_ceil(4)
}

/// Reinterprets float words as bytes.
fn bytes_of(words: &[f32]) -> &[u8] {
    // SAFETY: every bit pattern is a valid u8 and u8 has alignment 1; the
    // length is the words' size in bytes.
    unsafe { std::slice::from_raw_parts(words.as_ptr().cast::<u8>(), size_of_val(words)) }
}

/// Mutable [`bytes_of`].
fn bytes_of_mut(words: &mut [f32]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`; any bytes written leave each f32 word a
    // valid (if meaningless) f32 bit pattern, read back only as codes.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), size_of_val(words)) }
}

/// Reinterprets float words as the 16-bit values packed in them.
fn halves(words: &[f32]) -> &[u16] {
    // SAFETY: every bit pattern is a valid u16, and f32's alignment (4) is a
    // multiple of u16's (2), so the prefix and suffix are empty.
    let (pre, mid, post) = unsafe { words.align_to::<u16>() };
    debug_assert!(pre.is_empty() && post.is_empty());
    mid
}

/// Mutable [`halves`].
fn halves_mut(words: &mut [f32]) -> &mut [u16] {
    // SAFETY: as in `halves`; any u16 written leaves each f32 word a valid
    // (if meaningless) f32 bit pattern, and these words are only read back
    // as 16-bit values.
    let (pre, mid, post) = unsafe { words.align_to_mut::<u16>() };
    debug_assert!(pre.is_empty() && post.is_empty());
    mid
}

impl RowFormat {
    /// The format named `name` ("float32", "float16", "bfloat16").
    ///
    /// # Errors
    /// `InvalidArgument` naming `dtype` for any other name.
    pub fn from_name(name: &str) -> Result<RowFormat> {
        match name {
            "float32" => Ok(RowFormat::F32),
            "float16" => Ok(RowFormat::F16),
            "bfloat16" => Ok(RowFormat::BF16),
            "int8" => Ok(RowFormat::I8),
            other => Err(invalid(
                "dtype",
                format!("expected {}; got {other:?}", vocab::one_of(vocab::DTYPES)),
            )),
        }
    }

    /// The format's name, as [`RowFormat::from_name`] takes it.
    pub fn name(self) -> &'static str {
        match self {
            RowFormat::F32 => "float32",
            RowFormat::F16 => "float16",
            RowFormat::BF16 => "bfloat16",
            RowFormat::I8 => "int8",
        }
    }

    /// Float words that hold `dim` weights.
    pub fn words(self, dim: usize) -> usize {
        match self {
            RowFormat::F32 => dim,
            RowFormat::F16 | RowFormat::BF16 => dim.div_ceil(2),
            RowFormat::I8 => code_words(dim) + 2,
        }
    }

    /// Bytes of `dim` weights.
    pub fn bytes(self, dim: usize) -> usize {
        4 * self.words(dim)
    }

    /// The largest finite magnitude a row of this format holds.
    pub fn max_finite(self) -> f32 {
        match self {
            RowFormat::F32 => f32::MAX,
            RowFormat::F16 => f16::MAX.to_f32(),
            RowFormat::BF16 => bf16::MAX.to_f32(),
            // Half of float32's range: the span of a row (largest minus
            // smallest) stays finite.
            RowFormat::I8 => f32::MAX / 2.0,
        }
    }

    /// Fails naming `arg` when a value of `src` is beyond what this format
    /// holds finitely (it would be stored as inf).
    ///
    /// # Errors
    /// `InvalidArgument` naming `arg` and the first such value.
    pub fn check_fits(self, arg: &'static str, src: &[f32]) -> Result<()> {
        if self == RowFormat::F32 {
            return Ok(());
        }
        let most = self.max_finite();
        // Every value within the format's largest finite one fits (one
        // vector scan, on the pool where large); else the first that does
        // not is found value by value below.
        if Backend::best().max_magnitude_bits_pooled(src) <= most.to_bits() {
            return Ok(());
        }
        let mut tmp = [0.0f32; 1];
        let bad = src.iter().position(|&v| {
            if self == RowFormat::I8 {
                // Any value up to half of float32's range: a row's span stays finite.
                return v.is_nan() || v.abs() > most;
            }
            self.encode(&[v], &mut tmp);
            let mut back = [0.0f32];
            self.decode(&tmp, &mut back);
            !back[0].is_finite()
        });
        match bad {
            None => Ok(()),
            Some(i) => Err(crate::error::invalid(
                arg,
                format!(
                    "expected values that {} rows hold (|v| <= {}), got {} at flat index {i}",
                    self.name(),
                    self.max_finite(),
                    src[i]
                ),
            )),
        }
    }

    /// Writes the weights stored in `words` to `out` (`dim` floats).
    #[inline]
    pub fn decode(self, words: &[f32], out: &mut [f32]) {
        let dim = out.len();
        match self {
            RowFormat::F32 => out.copy_from_slice(&words[..dim]),
            RowFormat::F16 => {
                let h: &[f16] =
                    half::slice::HalfBitsSliceExt::reinterpret_cast(&halves(words)[..dim]);
                h.convert_to_f32_slice(out);
            }
            RowFormat::BF16 => {
                let h: &[bf16] =
                    half::slice::HalfBitsSliceExt::reinterpret_cast(&halves(words)[..dim]);
                h.convert_to_f32_slice(out);
            }
            RowFormat::I8 => self.decode_on(Backend::best(), words, out),
        }
    }

    /// [`RowFormat::decode`] by `backend`'s kernels (the same results).
    #[inline]
    pub fn decode_on(self, backend: Backend, words: &[f32], out: &mut [f32]) {
        if self != RowFormat::I8 {
            return self.decode(words, out);
        }
        let dim = out.len();
        let cw = code_words(dim);
        backend.dequant_u8(
            &bytes_of(&words[..cw])[..dim],
            words[cw],
            words[cw + 1],
            out,
        );
    }

    /// Stores `src` (`dim` floats) into `words` by `backend`'s kernels: as
    /// [`RowFormat::encode`], but an 8-bit row rounds stochastically by
    /// `stream` ([`crate::hash::rounding_stream`] of seed, key and step; to
    /// nearest with None).
    #[inline]
    pub fn encode_rounding(
        self,
        backend: Backend,
        src: &[f32],
        words: &mut [f32],
        stream: Option<u64>,
    ) {
        if self == RowFormat::I8 {
            encode_i8(backend, src, words, stream);
        } else {
            self.encode(src, words);
        }
    }

    /// Whether optimizer steps round 8-bit rows stochastically: yes, unless
    /// the environment variable `EMBSTORE_INT8_ROUNDING` is `nearest` (read
    /// once per process; for comparing the two, as benches/RESULTS.md does).
    pub fn stochastic_steps() -> bool {
        static STOCHASTIC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *STOCHASTIC.get_or_init(|| {
            std::env::var("EMBSTORE_INT8_ROUNDING").map_or(true, |v| v != "nearest")
        })
    }

    /// Stores `src` (`dim` floats) into `words`, rounding to nearest even.
    #[inline]
    pub fn encode(self, src: &[f32], words: &mut [f32]) {
        let dim = src.len();
        match self {
            RowFormat::F32 => words[..dim].copy_from_slice(src),
            RowFormat::F16 => {
                let h: &mut [f16] = half::slice::HalfBitsSliceExt::reinterpret_cast_mut(
                    &mut halves_mut(words)[..dim],
                );
                h.convert_from_f32_slice(src);
            }
            RowFormat::BF16 => {
                let h: &mut [bf16] = half::slice::HalfBitsSliceExt::reinterpret_cast_mut(
                    &mut halves_mut(words)[..dim],
                );
                h.convert_from_f32_slice(src);
            }
            RowFormat::I8 => encode_i8(Backend::best(), src, words, None),
        }
    }

    /// Rounds `x` in place to what this format stores.
    #[inline]
    pub fn round(self, x: &mut [f32]) {
        match self {
            RowFormat::F32 => {}
            RowFormat::F16 => x.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32()),
            RowFormat::BF16 => x.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32()),
            RowFormat::I8 => {
                // A read of a missing key's row calls this per key: the
                // words in a scratch buffer of this thread, not allocated.
                thread_local! {
                    static WORDS: std::cell::RefCell<Vec<f32>> =
                        const { std::cell::RefCell::new(Vec::new()) };
                }
                WORDS.with_borrow_mut(|words| {
                    words.resize(self.words(x.len()), 0.0);
                    self.encode(x, words);
                    self.decode(words, x);
                });
            }
        }
    }
}

/// An 8-bit row of `src` into `words`: offset the smallest weight, scale
/// the span over 255, codes rounded to nearest or by `stream`.
#[inline]
fn encode_i8(backend: Backend, src: &[f32], words: &mut [f32], stream: Option<u64>) {
    let range = if src.is_empty() {
        (0.0, 0.0)
    } else {
        backend.min_max(src)
    };
    encode_i8_in(backend, src, words, stream, range);
}

/// [`encode_i8`] for a caller that has `src`'s smallest and largest
/// weights already (an optimizer step, which bounds what it wrote by them).
#[inline]
pub(crate) fn encode_i8_in(
    backend: Backend,
    src: &[f32],
    words: &mut [f32],
    stream: Option<u64>,
    (lo, hi): (f32, f32),
) {
    let dim = src.len();
    let cw = code_words(dim);
    let scale = (hi - lo) / 255.0;
    let (codes, tail) = words.split_at_mut(cw);
    backend.quant_u8(src, lo, scale, stream, &mut bytes_of_mut(codes)[..dim]);
    tail[0] = scale;
    tail[1] = lo;
}

impl RowFormat {
    /// Columns of a row in a file's "rows" tensor: `dim` weights, or for an
    /// 8-bit row its bytes as the table holds them (codes in whole words,
    /// scale, offset: a u8 tensor).
    pub fn file_cols(self, dim: usize) -> usize {
        match self {
            RowFormat::I8 => 4 * self.words(dim),
            _ => dim,
        }
    }

    /// Bytes of a row in a file.
    pub fn file_row_bytes(self, dim: usize) -> usize {
        self.file_cols(dim) * self.item_bytes()
    }

    /// Bytes a stored weight takes in a file.
    pub fn item_bytes(self) -> usize {
        match self {
            RowFormat::F32 => 4,
            RowFormat::F16 | RowFormat::BF16 => 2,
            RowFormat::I8 => 1,
        }
    }

    /// Writes the weights of `bytes`, as a file stores them (little-endian,
    /// `out.len()` weights), to `out` as float32 (exact: every 16-bit value
    /// is a float32).
    #[inline]
    pub fn decode_bytes(self, bytes: &[u8], out: &mut [f32]) {
        match self {
            RowFormat::F32 => {
                for (d, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            RowFormat::F16 => {
                for (d, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            RowFormat::BF16 => {
                for (d, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            RowFormat::I8 => {
                // One row as the table holds it: codes (whole words), scale, offset.
                let at = 4 * code_words(out.len());
                let f = |i: usize| {
                    f32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]])
                };
                let (scale, offset) = (f(at), f(at + 4));
                for (d, &q) in out.iter_mut().zip(&bytes[..at]) {
                    *d = offset + scale * f32::from(q);
                }
            }
        }
    }

    /// Appends the first `dim` weights stored in `words` (as the table holds
    /// them) to `out` as a file stores them (little-endian).
    #[inline]
    pub fn extend_stored(self, words: &[f32], dim: usize, out: &mut Vec<u8>) {
        match self {
            RowFormat::F32 => f32::extend_le(&words[..dim], out),
            RowFormat::F16 | RowFormat::BF16 => u16::extend_le(&halves(words)[..dim], out),
            RowFormat::I8 => f32::extend_le(&words[..self.words(dim)], out),
        }
    }
}

/// Plain number types whose in-memory bytes are their little-endian
/// encoding on a little-endian machine.
pub(crate) trait Plain: Copy {
    /// Appends the little-endian bytes of `v` to `out`.
    fn extend_le(v: &[Self], out: &mut Vec<u8>);
}

macro_rules! plain {
    ($t:ty) => {
        impl Plain for $t {
            fn extend_le(v: &[Self], out: &mut Vec<u8>) {
                #[cfg(target_endian = "little")]
                {
                    // SAFETY: `$t` is a primitive number: no padding, every
                    // byte initialized; u8 has alignment 1; the length is the
                    // slice's size in bytes. On a little-endian machine these
                    // bytes are the little-endian encoding.
                    let bytes = unsafe {
                        std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), size_of_val(v))
                    };
                    out.extend_from_slice(bytes);
                }
                #[cfg(not(target_endian = "little"))]
                for x in v {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
        }
    };
}
plain!(f32);
plain!(i64);
plain!(u16);
plain!(u32);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::rounding_stream;

    fn row(seed: u64, dim: usize) -> Vec<f32> {
        (0..dim)
            .map(|c| ((crate::hash::draw(seed, c as u64) >> 40) as f32 / 16_777_216.0 - 0.5) * 0.3)
            .collect()
    }

    #[test]
    fn an_8_bit_row_keeps_its_ends_and_is_within_half_a_step_elsewhere() {
        let f = RowFormat::I8;
        for dim in [1usize, 3, 4, 9, 64, 127] {
            let src = row(dim as u64, dim);
            let mut words = vec![0.0f32; f.words(dim)];
            assert_eq!(f.words(dim), dim.div_ceil(4) + 2);
            f.encode(&src, &mut words);
            let mut back = vec![0.0f32; dim];
            f.decode(&words, &mut back);
            let lo = src.iter().copied().fold(f32::INFINITY, f32::min);
            let hi = src.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let step = (hi - lo) / 255.0;
            for (a, b) in back.iter().zip(&src) {
                assert!(
                    (a - b).abs() <= 0.5 * step * 1.0001 + 1e-7,
                    "dim {dim}: {a} vs {b}"
                );
            }
            assert_eq!(back.iter().copied().fold(f32::INFINITY, f32::min), lo);
            let mut rounded = src.clone();
            f.round(&mut rounded);
            assert_eq!(rounded, back, "round() is encode then decode");
            // The file bytes of the row decode to the same weights.
            let mut bytes = Vec::new();
            f.extend_stored(&words, dim, &mut bytes);
            let mut from_file = vec![0.0f32; dim];
            f.decode_bytes(&bytes, &mut from_file);
            assert_eq!(from_file, back);
        }
    }

    #[test]
    fn stochastic_rounding_is_unbiased_and_a_function_of_seed_key_and_step() {
        let f = RowFormat::I8;
        let dim = 16;
        let src = row(5, dim);
        let (mut sum, n) = (vec![0.0f64; dim], 4000u64);
        let mut words = vec![0.0f32; f.words(dim)];
        let mut back = vec![0.0f32; dim];
        for step in 0..n {
            let stream = Some(rounding_stream(1, 42, step));
            f.encode_rounding(Backend::SCALAR, &src, &mut words, stream);
            f.decode(&words, &mut back);
            for (s, b) in sum.iter_mut().zip(&back) {
                *s += f64::from(*b);
            }
        }
        let (lo, hi) = Backend::SCALAR.min_max(&src);
        let step = f64::from((hi - lo) / 255.0);
        for (s, x) in sum.iter().zip(&src) {
            // The mean of n draws within a few standard errors of the value.
            assert!((s / n as f64 - f64::from(*x)).abs() < 4.0 * step / (n as f64).sqrt() + 1e-7);
        }
        let once = |seed, key, st| {
            let mut w = vec![0.0f32; f.words(dim)];
            let stream = Some(rounding_stream(seed, key, st));
            f.encode_rounding(Backend::detect(), &src, &mut w, stream);
            w.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(once(1, 2, 3), once(1, 2, 3));
        assert_ne!(once(1, 2, 3), once(1, 2, 4));
        assert_ne!(once(1, 2, 3), once(1, 3, 3));
        assert_ne!(once(1, 2, 3), once(2, 2, 3));
    }
}
