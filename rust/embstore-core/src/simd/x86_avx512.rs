//! The AVX-512F backend.
//!
//! # Safety
//! Each function requires a CPU with AVX-512F; callers hold a
//! [`super::Backend::Avx512`], which exists only on such CPUs.

super::instantiate!(#[target_feature(enable = "avx512f")]);
