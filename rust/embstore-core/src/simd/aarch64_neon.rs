//! The AArch64 NEON backend.
//!
//! # Safety
//! Each function requires a CPU with NEON; callers hold
//! a [`super::Backend`] of `Isa::Neon`, which exists only on such CPUs.

super::instantiate!(#[target_feature(enable = "neon")]);
