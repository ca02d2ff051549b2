//! Many threads calling one table at once, every kind of call mixed in
//! (apply, pooled apply, lookup, remove, export, save): no deadlock (the
//! test finishes), no lost update (exact integer totals), no torn row, and
//! every export a consistent snapshot.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;

use embstore_core::hash::draw;
use embstore_core::{Bags, Combiner, Initializer, Optimizer, Table, TableConfig};

const DIM: usize = 16;

fn table() -> Arc<Table> {
    let mut cfg = TableConfig::new(DIM);
    cfg.optimizer = Some(Optimizer::Sgd {
        lr: 1.0,
        weight_decay: 0.0,
    });
    cfg.initializer = Initializer::Zeros;
    cfg.num_shards = Some(4);
    Arc::new(Table::new(cfg).unwrap())
}

#[test]
fn mixed_concurrent_calls_lose_nothing_and_never_tear() {
    let t = table();
    let keys: Vec<i64> = (0..512).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let dir = std::env::temp_dir().join(format!("embstore-stress-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let (t, keys) = (t.clone(), keys.clone());
        writers.push(thread::spawn(move || {
            let mut applied = vec![0i64; keys.len()];
            for round in 0..400u64 {
                let batch: Vec<i64> = (0..64)
                    .map(|i| keys[(draw(w, round * 64 + i) % keys.len() as u64) as usize])
                    .collect();
                if round % 2 == 0 {
                    t.apply_gradients(&batch, &vec![-1.0; batch.len() * DIM])
                        .unwrap();
                } else {
                    // The same gradient as one-id bags through the pooled path.
                    let offsets: Vec<i64> = (0..=batch.len() as i64).collect();
                    let bags = Bags {
                        ids: &batch,
                        offsets: &offsets,
                        weights: None,
                        combiner: Combiner::Sum,
                    };
                    t.apply_pooled_gradients(&bags, &vec![-1.0; batch.len() * DIM])
                        .unwrap();
                }
                for k in batch {
                    applied[k as usize] += 1;
                }
            }
            applied
        }));
    }
    let mut readers = Vec::new();
    for r in 0..2 {
        let (t, keys, stop, dir) = (t.clone(), keys.clone(), stop.clone(), dir.clone());
        readers.push(thread::spawn(move || {
            let mut out = vec![0.0f32; keys.len() * DIM];
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                t.lookup(&keys, false, &mut out).unwrap();
                for row in out.chunks(DIM) {
                    assert!(row.iter().all(|&v| v == row[0]), "torn row {row:?}");
                }
                if r == 0 && n % 5 == 0 {
                    let (_, rows, _) = t.export(false).unwrap();
                    for row in rows.chunks(DIM) {
                        assert!(row.iter().all(|&v| v == row[0]), "torn export row");
                    }
                    t.save(&dir.join(format!("ck{}", n % 3)), false, true, None)
                        .unwrap();
                }
                n += 1;
            }
            n
        }));
    }
    let mut total = vec![0i64; keys.len()];
    for w in writers {
        for (t, a) in total.iter_mut().zip(w.join().unwrap()) {
            *t += a;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        assert!(r.join().unwrap() > 0);
    }
    let mut out = vec![0.0f32; keys.len() * DIM];
    t.lookup(&keys, false, &mut out).unwrap();
    for (k, row) in out.chunks(DIM).enumerate() {
        assert_eq!(row[0], total[k] as f32, "key {k}: lost updates");
    }
    assert_eq!(t.step(), 4 * 400);
    let (loaded, _) = Table::load(&dir.join("ck0"), Some(3), None).unwrap();
    assert!(loaded.len() <= keys.len());
    let _ = std::fs::remove_dir_all(&dir);
}
