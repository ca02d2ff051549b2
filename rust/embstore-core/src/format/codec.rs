//! The row codec: how a row's `dim` weights are stored ([`RowFormat`]), in
//! the table's memory (float words, 16-bit values packed two to a word) and
//! in a checkpoint's files (little-endian). The arena, the file writer, the
//! loader and the mapped reader all encode and decode rows here.

use crate::error::{Result, invalid};
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
        }
    }

    /// Float words that hold `dim` weights.
    pub fn words(self, dim: usize) -> usize {
        match self {
            RowFormat::F32 => dim,
            RowFormat::F16 | RowFormat::BF16 => dim.div_ceil(2),
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
        let mut tmp = [0.0f32; 1];
        let bad = src.iter().position(|&v| {
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
        }
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
        }
    }

    /// Rounds `x` in place to what this format stores.
    #[inline]
    pub fn round(self, x: &mut [f32]) {
        match self {
            RowFormat::F32 => {}
            RowFormat::F16 => x.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32()),
            RowFormat::BF16 => x.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32()),
        }
    }
}

impl RowFormat {
    /// Bytes a stored weight takes in a file.
    pub fn item_bytes(self) -> usize {
        match self {
            RowFormat::F32 => 4,
            RowFormat::F16 | RowFormat::BF16 => 2,
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
        }
    }

    /// Appends the first `dim` weights stored in `words` (as the table holds
    /// them) to `out` as a file stores them (little-endian).
    #[inline]
    pub fn extend_stored(self, words: &[f32], dim: usize, out: &mut Vec<u8>) {
        match self {
            RowFormat::F32 => f32::extend_le(&words[..dim], out),
            RowFormat::F16 | RowFormat::BF16 => u16::extend_le(&halves(words)[..dim], out),
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
