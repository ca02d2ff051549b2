//! Rough phase timing of `apply_gradients` on a 2M-row Adam table (the real
//! benchmarks are in benches/; this is a profiling aid).
use std::time::Instant;

use embstore_core::hash::draw;
use embstore_core::table::check_finite;
use embstore_core::{Optimizer, Table, TableConfig};

fn main() {
    let (vocab, n, dim) = (2_000_000i64, 1_703_936usize, 64usize);
    let mut cfg = TableConfig::new(dim);
    cfg.optimizer = Some(Optimizer::Adam {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
    });
    let t = Table::new(cfg).unwrap();
    let all: Vec<i64> = (0..vocab).collect();
    let mut out = vec![0.0f32; all.len() * dim];
    t.lookup(&all, true, &mut out).unwrap();
    let keys: Vec<i64> = (0..n as u64)
        .map(|i| (draw(1, i) % vocab as u64) as i64)
        .collect();
    let grads: Vec<f32> = (0..n * dim).map(|i| (i % 7) as f32 * 0.01).collect();
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    for _ in 0..reps {
        let t0 = Instant::now();
        check_finite("grads", &grads).unwrap();
        let a = t0.elapsed();
        let t0 = Instant::now();
        t.apply_gradients(&keys, &grads).unwrap();
        let b = t0.elapsed();
        println!("check_finite {a:?}  apply_gradients (incl. check) {b:?}");
    }
}
