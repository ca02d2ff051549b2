//! The portable backend: the kernel bodies compiled for the build's baseline.

super::instantiate!(#[inline]);
