//! The AVX2 + FMA backend.
//!
//! # Safety
//! Each function requires a CPU with AVX2 and FMA; callers hold
//! a [`super::Backend`] of `Isa::Avx2`, which exists only on such CPUs.

super::instantiate!(#[target_feature(enable = "avx2,fma")]);
