//! Times a pooled lookup of 1.7M ids (26 a bag, 2M-row table) against the
//! unpooled lookup of the same ids and a plain gather-sum of the same rows
//! from a dense array, in turn in one process: the gap issue 14's bag
//! figures are made of. `cargo bench -p embstore-core --bench
//! pooled_gather`; `OPT=none` drops Adam's state, `PER=n` sets the ids a bag.
use std::time::Instant;

use embstore_core::{Bags, Combiner, Table};

mod common;
use rayon::prelude::*;

fn gather_sum(dense: &[f32], dim: usize, ids: &[i64], per: usize, out: &mut [f32]) {
    out.par_chunks_mut(dim * 256)
        .enumerate()
        .for_each(|(c, o)| {
            let ids = &ids[c * 256 * per..][..o.len() / dim * per];
            for (b, d) in o.chunks_mut(dim).enumerate() {
                d.fill(0.0);
                for j in 0..per {
                    let i = b * per + j;
                    if let Some(&ahead) = ids.get(i + 8) {
                        embstore_core::simd::prefetch(&dense[ahead as usize * dim..][..dim]);
                    }
                    let r = &dense[ids[i] as usize * dim..][..dim];
                    for (x, y) in d.iter_mut().zip(r) {
                        *x += y;
                    }
                }
            }
        });
}

fn main() {
    let dim = 64usize;
    let rows = 2_000_000usize;
    let per: usize = std::env::var("PER").map_or(26, |v| v.parse().expect("PER: a number"));
    let cfg = common::config(dim);
    let table = Table::new(cfg).unwrap();
    let dense = common::fill(&table, rows, dim);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let n = 1_703_936 / per * per;
    let ids = common::random_keys(&mut x, n, rows);
    let offsets: Vec<i64> = (0..=n / per).map(|b| (b * per) as i64).collect();
    let bags = Bags {
        ids: &ids,
        offsets: &offsets,
        weights: None,
        combiner: Combiner::Sum,
    };
    let mut pooled = vec![0.0f32; n / per * dim];
    let mut bare = vec![0.0f32; n / per * dim];
    let mut unpooled = vec![0.0f32; n * dim];
    for round in 0..5 {
        let t = Instant::now();
        table.lookup_pooled(&bags, false, &mut pooled).unwrap();
        let tp = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        table.lookup(&ids, false, &mut unpooled).unwrap();
        let tu = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        gather_sum(&dense, dim, &ids, per, &mut bare);
        let tb = t.elapsed().as_secs_f64() * 1e3;
        println!(
            "round {round}: pooled {tp:.0} ms, unpooled {tu:.0} ms, dense gather-sum {tb:.0} ms"
        );
    }
    let diff = pooled
        .iter()
        .zip(&bare)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    println!("max |pooled - dense gather-sum| = {diff:e}");
}
