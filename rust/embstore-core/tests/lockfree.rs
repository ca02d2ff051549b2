//! Readers that take no lock (serving lookups, pooled lookups, `contains`,
//! hit masks, lookups with state) against writers that assign, step,
//! remove, evict, reserve and grow the same table: every row read is whole.
//!
//! Every row the writers ever store has all its elements equal (assigns of
//! constant rows, zero-initialized inserts, SGD and Adam steps with the
//! same gradient in every column, which keep a constant row constant, and
//! its optimizer state too), so a reader that sees two different values in
//! one row has read a torn row: half of one update and half of another, or
//! a row from memory reused for another key. Runs under a watchdog that
//! fails the test if the threads do not finish.
//!
//! `EMBSTORE_TORN_ROWS=N` reads at least N rows (the figure in
//! benches/RESULTS.md is from N = 10^8, release build); the default is a
//! short run for CI. A last test checks that a row found is its own key's
//! assigned row (a row published before its values were written once
//! showed zeros to a reader with a hit mask).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use embstore_core::hash::draw;
use embstore_core::{
    Bags, Combiner, Eviction, Initializer, Missing, Optimizer, Policy, Table, TableConfig,
};

const DIM: usize = 256;
/// Keys the writers use: few enough that readers often meet rows being
/// changed, removed and re-created; a moving window adds new keys so that
/// shards keep growing their index and arena.
const KEYS: u64 = 512;

fn table(adam: bool, policy: Policy) -> Arc<Table> {
    let mut cfg = TableConfig::new(DIM);
    cfg.optimizer = Some(if adam {
        Optimizer::Adam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    } else {
        Optimizer::Sgd {
            lr: 0.5,
            weight_decay: 0.0,
        }
    });
    cfg.initializer = Initializer::Zeros;
    cfg.num_shards = Some(4);
    cfg.policy = policy;
    Arc::new(Table::new(cfg).unwrap())
}

/// Whether every row of `rows` (`dim` floats each) has equal elements;
/// counts the rows checked.
fn check_rows(rows: &[f32], dim: usize, what: &str) -> u64 {
    for row in rows.chunks_exact(dim) {
        assert!(
            row.iter().all(|&x| x.to_bits() == row[0].to_bits()),
            "a torn row from {what}: {row:?}"
        );
    }
    (rows.len() / dim.max(1)) as u64
}

/// Runs `writers` writer threads and 3 readers on `t` until the readers
/// have read `want` rows (at least `min_time`), under a watchdog.
fn run(t: Arc<Table>, want: u64, evicts: bool) -> u64 {
    let stop = Arc::new(AtomicBool::new(false));
    let read = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let done = done.clone();
        thread::spawn(move || {
            let start = Instant::now();
            while !done.load(Ordering::Relaxed) {
                if start.elapsed() > Duration::from_secs(600) {
                    eprintln!("watchdog: the lock-free stress test hung for 600 s");
                    std::process::exit(3);
                }
                thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let mut handles = Vec::new();
    for w in 0..2u64 {
        let (t, stop) = (t.clone(), stop.clone());
        handles.push(thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // A window of keys that moves: new keys grow the shards,
                // old ones are removed.
                let base = (round / 8) as i64 * 64;
                let keys: Vec<i64> = (0..256)
                    .map(|i| base + (draw(w, round * 256 + i) % KEYS) as i64)
                    .collect();
                match round % 6 {
                    0 => {
                        let v = (round % 97) as f32 - 48.0;
                        let rows: Vec<f32> = keys
                            .iter()
                            .flat_map(|&k| std::iter::repeat_n(v + k as f32 * 1e-3, DIM))
                            .collect();
                        t.assign(&keys, &rows).unwrap();
                    }
                    1 | 2 => {
                        // One gradient value per key, the same in every column.
                        let g: Vec<f32> = keys
                            .iter()
                            .flat_map(|&k| std::iter::repeat_n((k % 7) as f32 - 3.0, DIM))
                            .collect();
                        t.apply_gradients(&keys, &g).unwrap();
                    }
                    3 => {
                        t.remove(&keys[..128]).unwrap();
                    }
                    4 => {
                        // Training lookups insert (and, with a capacity,
                        // evict what no longer fits).
                        let mut out = vec![0.0; keys.len() * DIM];
                        t.lookup(&keys, true, &mut out).unwrap();
                        check_rows(&out, DIM, "an inserting lookup");
                        if evicts {
                            t.evict(false);
                        }
                    }
                    _ => {
                        t.reserve_rows(1_000).unwrap();
                    }
                }
                round += 1;
            }
        }));
    }
    for r in 0..3u64 {
        let (t, stop, read) = (t.clone(), stop.clone(), read.clone());
        handles.push(thread::spawn(move || {
            let mut round = 0u64;
            let sl = t.state_len();
            while !stop.load(Ordering::Relaxed) {
                let base = (round / 8) as i64 * 64;
                let n = [1usize, 16, 128, 1_024, 3_000][(round % 5) as usize];
                let keys: Vec<i64> = (0..n as u64)
                    .map(|i| base + (draw(100 + r, round * 4096 + i) % (KEYS + 512)) as i64)
                    .collect();
                let mut got = 0;
                let mut out = vec![0.0; n * DIM];
                match round % 4 {
                    0 => {
                        t.lookup_or(&keys, false, Missing::Zeros, &mut out).unwrap();
                        got += check_rows(&out, DIM, "a serving lookup");
                    }
                    1 => {
                        let mut found = vec![false; n];
                        t.lookup_found(&keys, Missing::Zeros, &mut out, &mut found)
                            .unwrap();
                        got += check_rows(&out, DIM, "a lookup with hit mask");
                        let mut has = vec![false; n];
                        t.contains(&keys, &mut has).unwrap();
                    }
                    2 => {
                        let mut st = vec![0.0; n * sl];
                        t.lookup_with_state(&keys, false, &mut out, &mut st)
                            .unwrap();
                        got += check_rows(&out, DIM, "a lookup with state");
                        if sl > 0 {
                            // Adam's state is two constant halves (m, v):
                            // each half whole.
                            check_rows(&st, DIM, "a row's optimizer state");
                        }
                    }
                    _ => {
                        // Bags of 4 ids, mean-pooled: the mean of constant
                        // rows is constant.
                        let offsets: Vec<i64> = (0..=n as i64).step_by(4).collect();
                        let keys = &keys[..*offsets.last().unwrap() as usize];
                        let bags = Bags {
                            ids: keys,
                            offsets: &offsets,
                            weights: None,
                            combiner: Combiner::Mean,
                        };
                        let mut pooled = vec![0.0; (offsets.len() - 1) * DIM];
                        t.lookup_pooled_or(&bags, false, Missing::Zeros, &mut pooled)
                            .unwrap();
                        // A sum of rows each whole is constant up to
                        // rounding only if each row is: check each bag's
                        // elements to the float rounding of a 4-row mean.
                        for row in pooled.chunks_exact(DIM) {
                            let tol = 1e-5 * row[0].abs().max(1.0);
                            assert!(
                                row.iter().all(|&x| (x - row[0]).abs() <= tol),
                                "a torn row in a pooled lookup: {row:?}"
                            );
                        }
                        got += keys.len() as u64;
                    }
                }
                read.fetch_add(got, Ordering::Relaxed);
                round += 1;
            }
        }));
    }
    let start = Instant::now();
    while read.load(Ordering::Relaxed) < want || start.elapsed() < Duration::from_millis(500) {
        thread::sleep(Duration::from_millis(20));
        if handles.iter().any(|h| h.is_finished()) {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().expect("a reader or writer failed");
    }
    done.store(true, Ordering::Relaxed);
    watchdog.join().unwrap();
    read.load(Ordering::Relaxed)
}

fn wanted() -> u64 {
    std::env::var("EMBSTORE_TORN_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000_000)
}

#[test]
fn lock_free_readers_never_see_a_torn_row_of_an_sgd_table() {
    let n = run(table(false, Policy::default()), wanted(), false);
    eprintln!("sgd: {n} rows read, none torn");
}

#[test]
fn lock_free_readers_never_see_a_torn_row_or_state_of_an_adam_table() {
    let n = run(table(true, Policy::default()), wanted() / 2, false);
    eprintln!("adam: {n} rows read, none torn");
}

#[test]
fn readers_of_an_evicting_table_never_see_a_torn_row() {
    // TTL and capacity: rows record touches, evictions remove them.
    let policy = Policy {
        ttl_steps: Some(3),
        capacity: Some(2_000),
        eviction: Eviction::Lru,
        ..Policy::default()
    };
    let n = run(table(false, policy), wanted() / 4, true);
    eprintln!("evicting: {n} rows read, none torn");
}

/// A key's row holds the key's own value in every column; a writer removes
/// keys and assigns them again (so rows are freed, reused and re-created)
/// while readers take hit masks: every row found is its key's row, never a
/// row published before its values were written (the initializer's zeros
/// or a removed key's floats), and every row missing reads zeros.
#[test]
fn a_found_row_is_always_its_own_keys_assigned_row() {
    const N: i64 = 2_000;
    let t = {
        let mut cfg = TableConfig::new(16);
        cfg.initializer = Initializer::Zeros;
        cfg.num_shards = Some(4);
        Arc::new(Table::new(cfg).unwrap())
    };
    let value = |k: i64| (k + 1) as f32;
    let rows_of = move |keys: &[i64]| -> Vec<f32> {
        keys.iter()
            .flat_map(|&k| std::iter::repeat_n(value(k), 16))
            .collect()
    };
    let all: Vec<i64> = (0..N).collect();
    t.assign(&all, &rows_of(&all)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (t, stop) = (t.clone(), stop.clone());
        thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let keys: Vec<i64> = (0..300)
                    .map(|i| (draw(7, round * 300 + i) % N as u64) as i64)
                    .collect();
                t.remove(&keys).unwrap();
                t.assign(&keys, &rows_of(&keys)).unwrap();
                round += 1;
            }
        })
    };
    let want = wanted() / 4;
    let readers: Vec<_> = (0..2u64)
        .map(|r| {
            let t = t.clone();
            thread::spawn(move || {
                let mut read = 0u64;
                let mut round = 0u64;
                let start = Instant::now();
                while read < want / 2 || start.elapsed() < Duration::from_millis(500) {
                    assert!(start.elapsed() < Duration::from_secs(600), "hung");
                    let keys: Vec<i64> = (0..512)
                        .map(|i| (draw(50 + r, round * 512 + i) % N as u64) as i64)
                        .collect();
                    let mut out = vec![0.0; keys.len() * 16];
                    let mut found = vec![false; keys.len()];
                    t.lookup_found(&keys, Missing::Zeros, &mut out, &mut found)
                        .unwrap();
                    for (j, row) in out.chunks_exact(16).enumerate() {
                        let want = if found[j] { value(keys[j]) } else { 0.0 };
                        assert!(
                            row.iter().all(|&x| x == want),
                            "key {} found {}: {row:?}",
                            keys[j],
                            found[j]
                        );
                    }
                    read += keys.len() as u64;
                    round += 1;
                }
                read
            })
        })
        .collect();
    let read: u64 = readers.into_iter().map(|h| h.join().unwrap()).sum();
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    eprintln!("hit masks: {read} rows read, each its own key's");
}
