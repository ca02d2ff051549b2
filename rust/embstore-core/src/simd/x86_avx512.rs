//! The AVX-512 backend (F, DQ, VL).
//!
//! # Safety
//! Each function requires a CPU with AVX-512F, DQ and VL; callers hold
//! a [`super::Backend`] of `Isa::Avx512`, which exists only on such CPUs.

super::instantiate!(#[target_feature(enable = "avx512f,avx512dq,avx512vl")]);
