//! The table against a `std::collections::HashMap` model, over random batches
//! of lookups, assignments, removals and SGD steps with repeated, negative and
//! extreme keys; and the determinism of initial rows across shard counts.

use std::collections::HashMap;

use embstore_core::hash::draw;
use embstore_core::{Initializer, Optimizer, Table, TableConfig};

const DIM: usize = 5;

fn table(num_shards: usize) -> Table {
    let mut cfg = TableConfig::new(DIM);
    cfg.optimizer = Some(Optimizer::Sgd {
        lr: 0.5,
        weight_decay: 0.0,
    });
    cfg.seed = 11;
    cfg.num_shards = Some(num_shards);
    Table::new(cfg).unwrap()
}

fn init_row(key: i64) -> Vec<f32> {
    let mut row = vec![0.0; DIM];
    Initializer::default().fill(11, key, &mut row);
    row
}

/// Keys from a small pool so that batches repeat keys, with extremes mixed in.
fn key(r: u64) -> i64 {
    match r % 10 {
        0 => i64::MIN + (r % 3) as i64,
        1 => i64::MAX - (r % 3) as i64,
        _ => ((r >> 8) % 300) as i64 - 150,
    }
}

#[test]
fn table_matches_hashmap_model() {
    for num_shards in [1, 3, 8] {
        let t = table(num_shards);
        let mut model: HashMap<i64, Vec<f32>> = HashMap::new();
        let mut c = 0u64;
        let mut rnd = || {
            c += 1;
            draw(0xABCD, c)
        };
        for _round in 0..200 {
            let n = (rnd() % 64) as usize;
            let keys: Vec<i64> = (0..n).map(|_| key(rnd())).collect();
            match rnd() % 4 {
                0 => {
                    let insert = rnd() % 2 == 0;
                    let mut out = vec![0.0; n * DIM];
                    t.lookup(&keys, insert, &mut out).unwrap();
                    for (i, k) in keys.iter().enumerate() {
                        let expect = model.get(k).cloned().unwrap_or_else(|| init_row(*k));
                        assert_eq!(&out[i * DIM..(i + 1) * DIM], &expect[..]);
                        if insert {
                            model.entry(*k).or_insert_with(|| init_row(*k));
                        }
                    }
                }
                1 => {
                    let values: Vec<f32> = (0..n * DIM).map(|_| (rnd() % 100) as f32).collect();
                    t.assign(&keys, &values).unwrap();
                    for (i, k) in keys.iter().enumerate() {
                        model.insert(*k, values[i * DIM..(i + 1) * DIM].to_vec());
                    }
                }
                2 => {
                    let removed = t.remove(&keys).unwrap();
                    let mut expect = 0;
                    for k in &keys {
                        if model.remove(k).is_some() {
                            expect += 1;
                        }
                    }
                    assert_eq!(removed, expect);
                }
                _ => {
                    // Gradients that are small integers: sums are exact in f32.
                    let grads: Vec<f32> = (0..n * DIM).map(|_| (rnd() % 7) as f32 - 3.0).collect();
                    t.apply_gradients(&keys, &grads).unwrap();
                    let mut sums: HashMap<i64, Vec<f32>> = HashMap::new();
                    for (i, k) in keys.iter().enumerate() {
                        let s = sums.entry(*k).or_insert_with(|| vec![0.0; DIM]);
                        for d in 0..DIM {
                            s[d] += grads[i * DIM + d];
                        }
                    }
                    for (k, g) in sums {
                        let row = model.entry(k).or_insert_with(|| init_row(k));
                        for d in 0..DIM {
                            row[d] -= 0.5 * g[d];
                        }
                    }
                }
            }
            assert_eq!(t.len(), model.len());
        }
        let (keys, rows, _) = t.export(false).unwrap();
        let mut expect: Vec<_> = model.into_iter().collect();
        expect.sort_by_key(|e| e.0);
        assert_eq!(keys, expect.iter().map(|e| e.0).collect::<Vec<_>>());
        let flat: Vec<f32> = expect.into_iter().flat_map(|e| e.1).collect();
        assert_eq!(rows, flat, "num_shards={num_shards}");
    }
}

#[test]
fn initial_rows_do_not_depend_on_shards_or_order() {
    let keys: Vec<i64> = (0..5000).map(|i| (i * 7919) ^ (i << 40)).collect();
    let mut reversed = keys.clone();
    reversed.reverse();
    let mut reference = None;
    for (num_shards, ks) in [(1, &keys), (4, &reversed), (64, &keys)] {
        let t = table(num_shards);
        let mut out = vec![0.0; ks.len() * DIM];
        t.lookup(ks, true, &mut out).unwrap();
        let (k, rows, _) = t.export(false).unwrap();
        let bits: Vec<u32> = rows.iter().map(|v| v.to_bits()).collect();
        match &reference {
            None => reference = Some((k, bits)),
            Some(r) => assert_eq!(r, &(k, bits), "num_shards={num_shards}"),
        }
    }
}

#[test]
fn refused_calls_change_nothing() {
    let t = table(4);
    t.assign(&[1, 2], &[1.0; 2 * DIM]).unwrap();
    let before = t.export(true).unwrap();
    let mut bad = vec![0.0; 2 * DIM];
    bad[7] = f32::NAN;
    assert!(t.apply_gradients(&[1, 3], &bad).is_err());
    assert!(t.apply_gradients(&[1, 3], &[0.0; DIM]).is_err());
    assert!(t.assign(&[5, 6], &bad).is_err());
    assert_eq!(t.export(true).unwrap(), before);
    assert_eq!(t.step(), 0);
}

/// Outputs past `STREAM_MIN_BYTES` (8 MiB) are written with non-temporal
/// stores: the rows must equal those of the same lookups in small calls
/// (plain stores), for lookup and for pooled lookups of one-id bags.
#[test]
fn large_outputs_written_by_streaming_equal_small_calls() {
    use embstore_core::table::{Bags, Combiner};
    let dim = 64;
    let mut cfg = TableConfig::new(dim);
    cfg.seed = 5;
    let t = Table::new(cfg).unwrap();
    let n = 40_000; // 40,000 x 64 floats = 10 MiB
    let keys: Vec<i64> = (0..n as u64)
        .map(|i| (draw(3, i) % 50_000) as i64)
        .collect();
    let mut big = vec![0.0f32; n * dim];
    t.lookup(&keys, true, &mut big).unwrap();
    let mut small = vec![0.0f32; n * dim];
    for (k, o) in keys.chunks(100).zip(small.chunks_mut(100 * dim)) {
        t.lookup(k, true, o).unwrap();
    }
    assert_eq!(big, small, "lookup");
    let offsets: Vec<i64> = (0..=n as i64).collect();
    let bags = Bags {
        ids: &keys,
        offsets: &offsets,
        weights: None,
        combiner: Combiner::Sum,
    };
    let mut pooled = vec![0.0f32; n * dim];
    t.lookup_pooled(&bags, true, &mut pooled).unwrap();
    assert_eq!(pooled, small, "lookup_pooled of one-id bags");
}
