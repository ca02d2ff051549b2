//! Rough timing of the batch calls (the peer comparison is `python -m embstore bench`).
use std::time::Instant;

use embstore_core::{Initializer, Optimizer, Table, TableConfig};

fn main() {
    let n = 1_700_000usize;
    let keys: Vec<i64> = (0..n as i64).map(|k| k.wrapping_mul(0x9E37_79B9)).collect();
    for opt in [
        None,
        Some(Optimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }),
    ] {
        let mut cfg = TableConfig::new(64);
        cfg.optimizer = opt;
        cfg.initializer = Initializer::Zeros;
        let t = Table::new(cfg).unwrap();
        let mut out = vec![0.0f32; n * 64];
        let t0 = Instant::now();
        t.lookup(&keys, true, &mut out).unwrap();
        let a = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        t.lookup(&keys, true, &mut out).unwrap();
        let b = t0.elapsed().as_secs_f64();
        let fresh: Vec<i64> = keys.iter().map(|k| k ^ (1 << 62)).collect();
        let values = vec![0.5f32; n * 64];
        let t0 = Instant::now();
        t.assign(&fresh, &values).unwrap();
        let c = t0.elapsed().as_secs_f64();
        let more: Vec<i64> = keys.iter().map(|k| k ^ (1 << 61)).collect();
        t.remove(&fresh).unwrap();
        let t0 = Instant::now();
        t.assign(&more, &values).unwrap();
        let d = t0.elapsed().as_secs_f64();
        println!(
            "assign-insert {:.2} Mrows/s, after remove {:.2} Mrows/s",
            n as f64 / c / 1e6,
            n as f64 / d / 1e6
        );
        println!(
            "{opt:?}: insert {:.2} Mrows/s, lookup existing {:.3}s",
            n as f64 / a / 1e6,
            b
        );
    }
}
