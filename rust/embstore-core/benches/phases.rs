//! Rough timing of `lookup` and `apply_gradients` on a full 2M-row Adam
//! table (dim 64, a batch of 1.7M random ids, the benchmark's workload),
//! with a plain gather from a dense array for scale. A profiling aid; the
//! peer comparison is `python -m embstore bench`. `REPS=n` sets the repetitions.
use std::time::Instant;

use embstore_core::hash::draw;
use embstore_core::table::check_finite;
use embstore_core::{Optimizer, Table, TableConfig};
use rayon::prelude::*;

fn main() {
    let (vocab, n, dim) = (2_000_000i64, 1_703_936usize, 64usize);
    let mut cfg = TableConfig::new(dim);
    cfg.optimizer = Some(Optimizer::Adam {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.0,
    });
    let t = Table::new(cfg).unwrap();
    let all: Vec<i64> = (0..vocab).collect();
    let mut dense = vec![0.0f32; all.len() * dim];
    let t0 = Instant::now();
    t.lookup(&all, true, &mut dense).unwrap();
    println!("insert {vocab} rows: {:?}", t0.elapsed());
    let keys: Vec<i64> = (0..n as u64)
        .map(|i| (draw(1, i) % vocab as u64) as i64)
        .collect();
    let grads: Vec<f32> = (0..n * dim).map(|i| (i % 7) as f32 * 0.01).collect();
    let mut out = vec![0.0f32; n * dim];
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    for _ in 0..reps {
        let t0 = Instant::now();
        t.lookup(&keys, true, &mut out).unwrap();
        let lookup = t0.elapsed();
        let t0 = Instant::now();
        out.par_chunks_mut(dim * 1024)
            .zip(keys.par_chunks(1024))
            .for_each(|(o, ks)| {
                for (d, &k) in o.chunks_exact_mut(dim).zip(ks) {
                    let k = k as usize;
                    d.copy_from_slice(&dense[k * dim..(k + 1) * dim]);
                }
            });
        let gather = t0.elapsed();
        let t0 = Instant::now();
        check_finite("grads", &grads).unwrap();
        let check = t0.elapsed();
        let t0 = Instant::now();
        t.apply_gradients(&keys, &grads).unwrap();
        let apply = t0.elapsed();
        println!(
            "lookup (mapped output) {lookup:?}  dense gather {gather:?}  \
             check_finite {check:?}  apply_gradients (incl. check) {apply:?}"
        );
    }
}
