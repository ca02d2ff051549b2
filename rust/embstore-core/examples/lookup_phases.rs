//! Rough timing of `lookup` on a full 2M-row table against a plain gather
//! from a dense array (a profiling aid; the real benchmarks are in benches/).
use std::time::Instant;

use embstore_core::hash::draw;
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
    });
    let t = Table::new(cfg).unwrap();
    let all: Vec<i64> = (0..vocab).collect();
    let mut out = vec![0.0f32; all.len() * dim];
    let t0 = Instant::now();
    t.lookup(&all, true, &mut out).unwrap();
    println!("insert 2M: {:?}", t0.elapsed());
    let dense = out;
    if let Ok(s) = std::fs::read_to_string("/proc/self/smaps_rollup") {
        for l in s
            .lines()
            .filter(|l| l.contains("AnonHuge") || l.starts_with("Rss"))
        {
            println!("{l}");
        }
    }
    let keys: Vec<i64> = (0..n as u64)
        .map(|i| (draw(1, i) % vocab as u64) as i64)
        .collect();
    let mut out = vec![0.0f32; n * dim];
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    for _ in 0..reps {
        let t0 = Instant::now();
        t.lookup(&keys, true, &mut out).unwrap();
        let a = t0.elapsed();
        let t0 = Instant::now();
        out.par_chunks_mut(dim * 1024)
            .zip(keys.par_chunks(1024))
            .for_each(|(o, ks)| {
                for (d, &k) in o.chunks_exact_mut(dim).zip(ks) {
                    let k = k as usize;
                    d.copy_from_slice(&dense[k * dim..(k + 1) * dim]);
                }
            });
        let b = t0.elapsed();
        println!("lookup (prefaulted out) {a:?}  dense gather {b:?}");
    }
}
