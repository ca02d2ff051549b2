//! SIMD kernels behind one interface, picked once at run time.
//!
//! Every backend runs the same kernel bodies (`kernels`), compiled for its
//! instruction set, so results are bit-identical across backends. The backend
//! is chosen when a table is built: the best the CPU supports, or the one the
//! environment variable `EMBSTORE_SIMD` names (`scalar`, `avx2`, `avx512`,
//! `neon`), for tests and benchmarks.

#[cfg(all(target_arch = "aarch64", not(miri)))]
mod aarch64_neon;
mod kernels;
mod scalar;
#[cfg(all(target_arch = "x86_64", not(miri)))]
mod x86_avx2;
#[cfg(all(target_arch = "x86_64", not(miri)))]
mod x86_avx512;

use crate::error::{Result, invalid};

/// Per-call constants of an Adam (SparseAdam) step.
#[derive(Debug, Clone, Copy)]
pub struct AdamParams {
    /// `1 - beta1`.
    pub one_minus_b1: f32,
    /// `1 - beta2`.
    pub one_minus_b2: f32,
    /// `lr * sqrt(1 - beta2^t) / (1 - beta1^t)`.
    pub step_size: f32,
    /// Epsilon.
    pub eps: f32,
}

/// Per-call constants of an AdamW step.
#[derive(Debug, Clone, Copy)]
pub struct AdamWParams {
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// `1 - beta1`.
    pub one_minus_b1: f32,
    /// `beta2`.
    pub b2: f32,
    /// `1 - beta2`.
    pub one_minus_b2: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
    /// Epsilon.
    pub eps: f32,
}

/// Constants of an FTRL step.
#[derive(Debug, Clone, Copy)]
pub struct FtrlParams {
    /// Learning rate.
    pub lr: f32,
    /// L1 strength.
    pub l1: f32,
    /// `2 * l2 + beta / lr`.
    pub l2_total: f32,
}

/// An instruction set the kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable code with no target features beyond the build's baseline.
    Scalar,
    /// x86-64 AVX2 + FMA.
    Avx2,
    /// x86-64 AVX-512 (F, DQ, VL).
    Avx512,
    /// AArch64 NEON.
    Neon,
}

impl Isa {
    /// Every instruction set, scalar first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon];

    /// Name as `EMBSTORE_SIMD` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// Whether the running CPU supports this instruction set.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(all(target_arch = "x86_64", not(miri)))]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(all(target_arch = "x86_64", not(miri)))]
            Isa::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512dq")
                    && std::arch::is_x86_feature_detected!("avx512vl")
            }
            #[cfg(all(target_arch = "aarch64", not(miri)))]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

/// A backend for the kernels: an [`Isa`] that the running CPU supports.
///
/// Invariant: the field is private, and the only ways to get a `Backend`
/// ([`Backend::new`], [`Backend::detect`], [`Backend::from_name`],
/// [`Backend::SCALAR`]) check the CPU first, so safe code cannot obtain a
/// backend whose instructions the CPU lacks. That is what makes the
/// `unsafe` calls in the dispatch sound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backend(Isa);

impl Backend {
    /// The portable backend, supported everywhere.
    pub const SCALAR: Backend = Backend(Isa::Scalar);

    /// The backend of `isa`, if the running CPU supports it.
    pub fn new(isa: Isa) -> Option<Backend> {
        isa.supported().then_some(Backend(isa))
    }

    /// Its instruction set.
    pub fn isa(self) -> Isa {
        self.0
    }

    /// Name as `EMBSTORE_SIMD` spells it.
    pub fn name(self) -> &'static str {
        self.0.name()
    }

    /// Every backend the running CPU supports, scalar first.
    pub fn available() -> Vec<Backend> {
        Isa::ALL.into_iter().filter_map(Backend::new).collect()
    }

    /// The best supported backend.
    pub fn detect() -> Backend {
        *Backend::available().last().unwrap_or(&Backend::SCALAR)
    }

    /// [`Backend::detect`], detected once per process: for kernels whose
    /// result is the same on every backend (integer scans), where
    /// `EMBSTORE_SIMD` need not be honoured.
    pub fn best() -> Backend {
        static BEST: std::sync::OnceLock<Backend> = std::sync::OnceLock::new();
        *BEST.get_or_init(Backend::detect)
    }

    /// The backend named `name`, if this CPU supports it.
    ///
    /// # Errors
    /// [`crate::StoreError::InvalidArgument`] for an unknown or unsupported name.
    pub fn from_name(name: &str) -> Result<Backend> {
        let wanted = name.trim().to_ascii_lowercase();
        let Some(isa) = Isa::ALL.into_iter().find(|i| i.name() == wanted) else {
            return Err(invalid(
                "EMBSTORE_SIMD",
                format!("expected one of scalar, avx2, avx512, neon; got {wanted:?}"),
            ));
        };
        Backend::new(isa).ok_or_else(|| {
            invalid(
                "EMBSTORE_SIMD",
                format!("{name:?} is not supported by this CPU"),
            )
        })
    }

    /// The backend `EMBSTORE_SIMD` names, or the best supported one when unset.
    ///
    /// # Errors
    /// When the variable names an unknown or unsupported backend.
    pub fn from_env() -> Result<Backend> {
        match std::env::var("EMBSTORE_SIMD") {
            Ok(v) if !v.trim().is_empty() => Backend::from_name(&v),
            _ => Ok(Backend::detect()),
        }
    }
}

/// Asks the CPU to start loading `slice` into cache: every cache line it
/// touches, its last one too where it does not start on a line (a row of
/// 256 bytes at an offset of 16 in a checkpoint file spans 5 lines; a
/// prefetch every 64 bytes from its start loaded 4). A hint: no effect on
/// results; a no-op where the architecture has no prefetch instruction.
#[inline(always)]
pub fn prefetch<T>(slice: &[T]) {
    let bytes = size_of_val(slice);
    if bytes == 0 {
        return;
    }
    // From the line of the first byte to the line of the last.
    let start = slice.as_ptr() as usize;
    let mut line = start & !63;
    while line <= (start + bytes - 1) & !63 {
        prefetch_addr(line);
        line += 64;
    }
}

/// Asks the CPU to start loading the cache line at address `addr`, which
/// need not be mapped (a prefetch never faults): for addresses computed
/// from a layout, not taken from a live reference.
#[inline(always)]
pub fn prefetch_addr(addr: usize) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch reads and changes nothing architecturally and
        // never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(addr as *const i8) };
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = addr;
}

/// Rows of at least this many floats are streamed ([`copy_streaming`]).
const STREAM_LEAST: usize = 256;

/// Copies `src` into `dst` (the same length), memory that is not read
/// again soon (a new row): on an AMD x86-64 CPU, where `dst` starts on a
/// cache line and is whole lines of at least 1 KiB, with streaming stores
/// (SSE2, on every x86-64 CPU), which write the lines without first
/// reading them from memory as an ordinary store must, then a store fence,
/// so that the row is visible before any later store (the one that
/// publishes its key); otherwise an ordinary copy. On an AMD EPYC VM
/// (machine E) one-row inserts of dim-768 rows into fresh memory ran 5-10%
/// faster, 1,024-row ones 1.1-4.7x (the ordinary copy's reads competed
/// with the kernel clearing the next pages on the other core). Not on
/// other CPUs: on an Intel Xeon VM (machine X) streaming stores into
/// lookup outputs had made lookups of 100,000 ids 1.5-2.6x slower (taken
/// out 2026-11-27), and no Intel machine measured these. The same result
/// whatever the CPU, so `EMBSTORE_SIMD` does not choose it.
#[inline]
pub fn copy_streaming(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming: equal lengths");
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if streams() && stream_copy(dst, src) {
        return;
    }
    dst.copy_from_slice(src);
}

/// [`copy_streaming`]'s streamed copy, on any x86-64 CPU: `false` (nothing
/// written) where `dst` is not whole lines of at least 1 KiB starting on
/// a line.
#[cfg(all(target_arch = "x86_64", not(miri)))]
fn stream_copy(dst: &mut [f32], src: &[f32]) -> bool {
    if dst.len() < STREAM_LEAST
        || !dst.len().is_multiple_of(16)
        || !(dst.as_ptr() as usize).is_multiple_of(64)
    {
        return false;
    }
    use std::arch::x86_64::{_mm_loadu_ps, _mm_sfence, _mm_stream_ps};
    for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
        // SAFETY: SSE2 is part of x86-64; `s` holds 4 floats to read
        // (unaligned load), `d` 4 floats to write, 16-byte aligned (the
        // row starts on a 64-byte line and steps by 16 bytes).
        unsafe { _mm_stream_ps(d.as_mut_ptr(), _mm_loadu_ps(s.as_ptr())) };
    }
    // SAFETY: a fence has no operands; it orders the streaming stores
    // above before every later store.
    unsafe { _mm_sfence() };
    true
}

/// Whether [`copy_streaming`] streams: on an AMD CPU (its `cpuid` vendor),
/// asked once per process.
#[cfg(all(target_arch = "x86_64", not(miri)))]
fn streams() -> bool {
    static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AMD.get_or_init(|| {
        // `cpuid` leaf 0 (on every x86-64 CPU): the vendor string.
        let r = std::arch::x86_64::__cpuid(0);
        let mut vendor = [0u8; 12];
        vendor[..4].copy_from_slice(&r.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
        vendor[8..].copy_from_slice(&r.ecx.to_le_bytes());
        &vendor == b"AuthenticAMD"
    })
}

/// Dispatches `$f(args)` to the backend's instantiation.
macro_rules! dispatch {
    ($self:expr, $f:ident($($arg:expr),*)) => {
        match $self.0 {
            #[cfg(all(target_arch = "x86_64", not(miri)))]
            // SAFETY: a `Backend` of `Isa::Avx2` exists only when the CPU has
            // AVX2 and FMA (type invariant of `Backend`).
            Isa::Avx2 => unsafe { x86_avx2::$f($($arg),*) },
            #[cfg(all(target_arch = "x86_64", not(miri)))]
            // SAFETY: a `Backend` of `Isa::Avx512` exists only when the CPU
            // has AVX-512F, DQ and VL (type invariant of `Backend`).
            Isa::Avx512 => unsafe { x86_avx512::$f($($arg),*) },
            #[cfg(all(target_arch = "aarch64", not(miri)))]
            // SAFETY: a `Backend` of `Isa::Neon` exists only when the CPU has
            // NEON (type invariant of `Backend`).
            Isa::Neon => unsafe { aarch64_neon::$f($($arg),*) },
            _ => scalar::$f($($arg),*),
        }
    };
}

impl Backend {
    /// `acc += x`.
    #[inline]
    pub fn add_assign(self, acc: &mut [f32], x: &[f32]) {
        dispatch!(self, add_assign(acc, x))
    }
    /// `acc += a * x`.
    #[inline]
    pub fn axpy(self, acc: &mut [f32], a: f32, x: &[f32]) {
        dispatch!(self, axpy(acc, a, x))
    }
    /// The smallest and largest of `x` (not empty, finite).
    #[inline]
    pub fn min_max(self, x: &[f32]) -> (f32, f32) {
        dispatch!(self, min_max(x))
    }
    /// An 8-bit row's weights from its codes (`kernels::dequant_u8`).
    #[inline]
    pub fn dequant_u8(self, q: &[u8], scale: f32, offset: f32, out: &mut [f32]) {
        dispatch!(self, dequant_u8(q, scale, offset, out))
    }
    /// An 8-bit row's codes, rounded to nearest or, with `stream`,
    /// stochastically (`kernels::quant_u8`).
    #[inline]
    pub fn quant_u8(self, x: &[f32], lo: f32, scale: f32, stream: Option<u64>, q: &mut [u8]) {
        dispatch!(self, quant_u8(x, lo, scale, stream, q))
    }
    /// The largest magnitude in `data` as bits (`kernels::max_magnitude_bits`).
    #[inline]
    pub fn max_magnitude_bits(self, data: &[f32]) -> u32 {
        dispatch!(self, max_magnitude_bits(data))
    }
    /// [`Backend::max_magnitude_bits`] in blocks of 64 Ki values on rayon's
    /// pool where `data` holds more than one.
    pub fn max_magnitude_bits_pooled(self, data: &[f32]) -> u32 {
        use rayon::prelude::*;
        const BLOCK: usize = 1 << 16;
        if data.len() <= BLOCK {
            return self.max_magnitude_bits(data);
        }
        data.par_chunks(BLOCK)
            .map(|c| self.max_magnitude_bits(c))
            .reduce(|| 0, std::cmp::Ord::max)
    }
    /// `x *= a`.
    #[inline]
    pub fn scale(self, x: &mut [f32], a: f32) {
        dispatch!(self, scale(x, a))
    }
    /// SGD step on one row.
    #[inline]
    pub fn sgd(self, w: &mut [f32], g: &[f32], lr: f32) {
        dispatch!(self, sgd(w, g, lr))
    }
    /// Adagrad step on one row.
    #[inline]
    pub fn adagrad(self, w: &mut [f32], h: &mut [f32], g: &[f32], lr: f32, eps: f32) {
        dispatch!(self, adagrad(w, h, g, lr, eps))
    }
    /// Row-wise Adagrad step on one row.
    #[inline]
    pub fn rowwise_adagrad(self, w: &mut [f32], h: &mut f32, g: &[f32], lr: f32, eps: f32) {
        dispatch!(self, rowwise_adagrad(w, h, g, lr, eps))
    }
    /// Adam step on one row.
    #[inline]
    pub fn adam(self, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], p: &AdamParams) {
        dispatch!(self, adam(w, m, v, g, p))
    }
    /// AdamW step on one row.
    #[inline]
    pub fn adamw(self, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], p: &AdamWParams) {
        dispatch!(self, adamw(w, m, v, g, p))
    }
    /// The uniform initializer's row (see `kernels::uniform_fill`).
    #[inline]
    pub fn uniform_fill(self, out: &mut [f32], stream: u64, low: f64, span: f64) {
        dispatch!(self, uniform_fill(out, stream, low, span))
    }
    /// One optimizer step on a row (as [`crate::optim::StepConsts::apply`])
    /// that also returns the largest magnitude of the row's new weights, as
    /// bits (the bound every later step's non-finite check starts from).
    #[inline]
    pub fn step_max(
        self,
        c: &crate::optim::StepConsts,
        w: &mut [f32],
        state: &mut [f32],
        g: &[f32],
    ) -> u32 {
        dispatch!(self, step_max(c, w, state, g))
    }
    /// FTRL step on one row.
    #[inline]
    pub fn ftrl(self, w: &mut [f32], z: &mut [f32], n: &mut [f32], g: &[f32], p: &FtrlParams) {
        dispatch!(self, ftrl(w, z, n, g, p))
    }
}

/// Instantiates every kernel of `kernels` as a function of this module,
/// with the given attributes (a `#[target_feature]` for SIMD backends).
macro_rules! instantiate {
    ($(#[$attr:meta])*) => {
        use super::kernels;
        use super::{AdamParams, AdamWParams, FtrlParams};

        $(#[$attr])*
        pub(crate) fn add_assign(acc: &mut [f32], x: &[f32]) { kernels::add_assign(acc, x) }
        $(#[$attr])*
        pub(crate) fn axpy(acc: &mut [f32], a: f32, x: &[f32]) { kernels::axpy(acc, a, x) }
        $(#[$attr])*
        pub(crate) fn scale(x: &mut [f32], a: f32) { kernels::scale(x, a) }
        $(#[$attr])*
        pub(crate) fn max_magnitude_bits(data: &[f32]) -> u32 { kernels::max_magnitude_bits(data) }
        $(#[$attr])*
        pub(crate) fn sgd(w: &mut [f32], g: &[f32], lr: f32) { kernels::sgd(w, g, lr); }
        $(#[$attr])*
        pub(crate) fn adagrad(w: &mut [f32], h: &mut [f32], g: &[f32], lr: f32, eps: f32) {
            kernels::adagrad(w, h, g, lr, eps);
        }
        $(#[$attr])*
        pub(crate) fn rowwise_adagrad(w: &mut [f32], h: &mut f32, g: &[f32], lr: f32, eps: f32) {
            kernels::rowwise_adagrad(w, h, g, lr, eps);
        }
        $(#[$attr])*
        pub(crate) fn adam(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], p: &AdamParams) {
            kernels::adam(w, m, v, g, p);
        }
        $(#[$attr])*
        pub(crate) fn adamw(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], p: &AdamWParams) {
            kernels::adamw(w, m, v, g, p);
        }
        $(#[$attr])*
        pub(crate) fn ftrl(w: &mut [f32], z: &mut [f32], n: &mut [f32], g: &[f32], p: &FtrlParams) {
            kernels::ftrl(w, z, n, g, p);
        }
        $(#[$attr])*
        pub(crate) fn uniform_fill(out: &mut [f32], stream: u64, low: f64, span: f64) {
            kernels::uniform_fill(out, stream, low, span)
        }
        $(#[$attr])*
        pub(crate) fn min_max(x: &[f32]) -> (f32, f32) { kernels::min_max(x) }
        $(#[$attr])*
        pub(crate) fn dequant_u8(q: &[u8], scale: f32, offset: f32, out: &mut [f32]) {
            kernels::dequant_u8(q, scale, offset, out)
        }
        $(#[$attr])*
        pub(crate) fn quant_u8(x: &[f32], lo: f32, scale: f32, stream: Option<u64>, q: &mut [u8]) {
            kernels::quant_u8(x, lo, scale, stream, q)
        }
        $(#[$attr])*
        pub(crate) fn step_max(
            c: &crate::optim::StepConsts,
            w: &mut [f32],
            state: &mut [f32],
            g: &[f32],
        ) -> u32 {
            use crate::optim::StepConsts as S;
            // Each kernel folds the new weights' largest magnitude into its
            // own loop (two vector operations per vector, no second pass).
            match c {
                S::Sgd(lr) => kernels::sgd(w, g, *lr),
                S::Adagrad(lr, eps) => kernels::adagrad(w, state, g, *lr, *eps),
                S::RowWiseAdagrad(lr, eps) => {
                    kernels::rowwise_adagrad(w, &mut state[0], g, *lr, *eps)
                }
                S::Adam(p) => {
                    let (m, v) = state.split_at_mut(w.len());
                    kernels::adam(w, m, v, g, p)
                }
                S::AdamW(p) => {
                    let (m, v) = state.split_at_mut(w.len());
                    kernels::adamw(w, m, v, g, p)
                }
                S::Ftrl(p) => {
                    let (z, n) = state.split_at_mut(w.len());
                    kernels::ftrl(w, z, n, g, p)
                }
            }
        }
    };
}
use instantiate;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_streaming_copies_every_float_streamed_or_not() {
        // A line-aligned buffer: offsets 0 (streamed where long, whole
        // lines), 4 (16-byte but not line aligned) and 1 (unaligned); lengths
        // short, long, and long but not whole lines.
        let mut buf = vec![0.0f32; 4096 + 64];
        let base = buf.as_ptr().align_offset(64);
        for off in [0usize, 1, 4] {
            for len in [3usize, 16, 255, 256, 768, 770, 1024] {
                let src = values(len as u64 + off as u64, len);
                let start = base + off;
                buf.fill(-1.0);
                copy_streaming(&mut buf[start..start + len], &src);
                assert_eq!(&buf[start..start + len], &src[..], "off {off} len {len}");
                assert!(buf[..start].iter().all(|&v| v == -1.0));
                assert!(buf[start + len..].iter().all(|&v| v == -1.0));
                // The streamed copy itself, on any x86-64 CPU.
                #[cfg(all(target_arch = "x86_64", not(miri)))]
                {
                    buf.fill(-1.0);
                    let streamed = stream_copy(&mut buf[start..start + len], &src);
                    assert_eq!(streamed, off == 0 && len >= 256 && len % 16 == 0);
                    if streamed {
                        assert_eq!(&buf[start..start + len], &src[..]);
                        assert!(buf[..start].iter().all(|&v| v == -1.0));
                        assert!(buf[start + len..].iter().all(|&v| v == -1.0));
                    }
                }
            }
        }
    }

    /// Deterministic pseudo-random values in [-2, 2), with some zeros.
    fn values(seed: u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let b = crate::hash::draw(seed, i as u64);
                if b.is_multiple_of(17) {
                    0.0
                } else {
                    ((b >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
                }
            })
            .collect()
    }

    /// Runs every kernel on one backend over odd and even lengths and returns
    /// all outputs, to compare bit for bit with the scalar backend.
    fn run_all(b: Backend) -> Vec<u32> {
        let mut out = Vec::new();
        for (k, dim) in [1usize, 3, 7, 8, 15, 16, 17, 31, 64, 100, 128]
            .into_iter()
            .enumerate()
        {
            let s = k as u64 * 10;
            let g = values(s, dim);
            let w0 = values(s + 1, dim);
            let pos: Vec<f32> = values(s + 2, dim).iter().map(|v| v.abs() + 0.1).collect();

            // 8-bit rows: range, codes (to nearest and stochastic), weights.
            let (lo, hi) = b.min_max(&w0);
            out.extend([lo.to_bits(), hi.to_bits()]);
            let scale = (hi - lo) / 255.0;
            let mut q = vec![0u8; dim];
            for stream in [None, Some(s * 7 + 1)] {
                b.quant_u8(&w0, lo, scale, stream, &mut q);
                out.extend(q.iter().map(|&c| u32::from(c)));
                let mut back = vec![0.0f32; dim];
                b.dequant_u8(&q, scale, lo, &mut back);
                out.extend(back.iter().map(|v| v.to_bits()));
            }

            let mut w = w0.clone();
            b.add_assign(&mut w, &g);
            b.axpy(&mut w, 0.37, &g);
            b.scale(&mut w, -1.3);
            b.sgd(&mut w, &g, 0.01);
            out.extend(w.iter().map(|v| v.to_bits()));

            let (mut w, mut h) = (w0.clone(), pos.clone());
            b.adagrad(&mut w, &mut h, &g, 0.1, 1e-10);
            out.extend(w.iter().chain(&h).map(|v| v.to_bits()));

            let (mut w, mut h) = (w0.clone(), 0.3f32);
            b.rowwise_adagrad(&mut w, &mut h, &g, 0.1, 1e-10);
            out.extend(w.iter().map(|v| v.to_bits()));
            out.push(h.to_bits());

            let (mut w, mut m, mut v) = (w0.clone(), values(s + 3, dim), pos.clone());
            let p = AdamParams {
                one_minus_b1: 0.1,
                one_minus_b2: 0.001,
                step_size: 0.003,
                eps: 1e-8,
            };
            b.adam(&mut w, &mut m, &mut v, &g, &p);
            out.extend(w.iter().chain(&m).chain(&v).map(|v| v.to_bits()));

            let (mut w, mut m, mut v) = (w0.clone(), values(s + 3, dim), pos.clone());
            let p = AdamWParams {
                decay: 0.99,
                one_minus_b1: 0.1,
                b2: 0.999,
                one_minus_b2: 0.001,
                step_size: 0.01,
                bc2_sqrt: 0.05,
                eps: 1e-8,
            };
            b.adamw(&mut w, &mut m, &mut v, &g, &p);
            out.extend(w.iter().chain(&m).chain(&v).map(|v| v.to_bits()));

            let (mut w, mut z, mut n) = (w0.clone(), values(s + 4, dim), pos.clone());
            let p = FtrlParams {
                lr: 0.1,
                l1: 0.5,
                l2_total: 0.2,
            };
            b.ftrl(&mut w, &mut z, &mut n, &g, &p);
            out.extend(w.iter().chain(&z).chain(&n).map(|v| v.to_bits()));

            let mut scan = values(s + 5, dim);
            out.push(b.max_magnitude_bits(&scan));
            scan[dim / 2] = f32::NEG_INFINITY;
            out.push(b.max_magnitude_bits(&scan));

            let mut row = vec![0.0f32; dim];
            b.uniform_fill(&mut row, crate::hash::row_stream(s, -7), -0.05, 0.1);
            out.extend(row.iter().map(|v| v.to_bits()));
        }
        out
    }

    #[test]
    fn every_backend_matches_scalar_bit_for_bit() {
        let reference = run_all(Backend::SCALAR);
        let available = Backend::available();
        for b in available {
            assert_eq!(
                run_all(b),
                reference,
                "backend {} differs from scalar",
                b.name()
            );
        }
    }

    /// The fused step-and-measure equals the step then the measure, on
    /// every backend and optimizer, bit for bit.
    #[test]
    fn step_max_is_the_step_and_its_largest_magnitude() {
        use crate::optim::Optimizer;
        let opts = [
            Optimizer::Sgd {
                lr: 0.3,
                weight_decay: 0.0,
            },
            Optimizer::Adagrad {
                lr: 0.3,
                initial_accumulator_value: 0.1,
                eps: 1e-6,
                weight_decay: 0.0,
            },
            Optimizer::RowWiseAdagrad {
                lr: 0.3,
                eps: 1e-6,
                weight_decay: 0.0,
            },
            Optimizer::Adam {
                lr: 0.3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-6,
                weight_decay: 0.0,
            },
            Optimizer::AdamW {
                lr: 0.3,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-6,
                weight_decay: 0.1,
            },
            Optimizer::Ftrl {
                lr: 0.3,
                l1: 0.01,
                l2: 0.01,
                beta: 0.0,
                initial_accumulator_value: 0.1,
                weight_decay: 0.0,
            },
        ];
        for b in Backend::available() {
            for opt in opts {
                for dim in [1usize, 7, 16, 64, 100] {
                    let c = opt.step_consts(3);
                    let g = values(1, dim);
                    let mut w1 = values(2, dim);
                    let mut s1: Vec<f32> = values(3, opt.state_len(dim))
                        .iter()
                        .map(|v| v.abs())
                        .collect();
                    let (mut w2, mut s2) = (w1.clone(), s1.clone());
                    c.apply(b, &mut w1, &mut s1, &g);
                    let top = b.max_magnitude_bits(&w1);
                    assert_eq!(
                        b.step_max(&c, &mut w2, &mut s2, &g),
                        top,
                        "{opt:?} {}",
                        b.name()
                    );
                    assert_eq!(w1, w2);
                    assert_eq!(s1, s2);
                }
            }
        }
    }

    #[test]
    fn a_backend_exists_only_for_a_supported_isa() {
        for isa in Isa::ALL {
            assert_eq!(Backend::new(isa).is_some(), isa.supported(), "{isa:?}");
            if let Some(b) = Backend::new(isa) {
                assert_eq!(b.isa(), isa);
            }
        }
        assert!(Backend::new(Isa::Scalar).is_some());
        #[cfg(target_arch = "x86_64")]
        assert!(Backend::new(Isa::Neon).is_none());
    }

    #[test]
    fn from_name_refuses_unknown_names() {
        assert!(Backend::from_name("sse9").is_err());
        assert_eq!(Backend::from_name("scalar").unwrap(), Backend::SCALAR);
        assert_eq!(
            Backend::from_name(Backend::detect().name()).unwrap(),
            Backend::detect()
        );
    }
}
