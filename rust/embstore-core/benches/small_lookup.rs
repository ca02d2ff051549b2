//! Times lookups of a few keys on the calling thread, phase by phase (plan,
//! probe, copy), against a plain gather from a dense array: the per-key cost
//! that issue 14's small-call figures are made of.
//! `cargo bench -p embstore-core --bench small_lookup`; `KEYS=n`
//! times one size alone (for a profiler), `SCALE=x` repeats x times more,
//! `SHARDS=n` sets the shard count, `ROWS=n` the table's rows (100,000), `DIM=n` the row width (64), `OPT=none` drops Adam's state (`OPT=SGD` and the
//! like pick another optimizer),
//! `APPLY_ONLY=1` times only apply_gradients, `SERVE_ONLY=1` only serving lookups and
//! `Table::try_lookup_now` (serving and inserting).
use std::time::Instant;

use embstore_core::Table;

mod common;

fn best<F: FnMut()>(mut f: F, reps: usize) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..7 {
        let t = Instant::now();
        for _ in 0..reps {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    best * 1e9
}

fn main() {
    let dim: usize = std::env::var("DIM").map_or(64, |v| v.parse().expect("DIM: a number"));
    let rows: usize = std::env::var("ROWS").map_or(100_000, |v| v.parse().expect("ROWS: a number"));
    let mut cfg = common::config(dim);
    cfg.num_shards = std::env::var("SHARDS")
        .ok()
        .map(|v| v.parse().expect("SHARDS: a number"));
    let table = Table::new(cfg).unwrap();
    let dense = common::fill(&table, rows, dim);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let sizes: Vec<usize> = match std::env::var("KEYS") {
        Ok(v) => vec![v.parse().expect("KEYS: a number of keys")],
        Err(_) => vec![1, 16, 128, 1024],
    };
    let scale: usize = std::env::var("SCALE").map_or(1, |v| v.parse().expect("SCALE: a number"));
    for n in sizes {
        let keys = common::random_keys(&mut x, n, rows);
        let mut out = vec![0.0f32; n * dim];
        let reps = scale * 200_000 / n;
        let grads = vec![0.001f32; n * dim];
        if std::env::var_os("SERVE_ONLY").is_none() {
            let apply = best(|| table.apply_gradients(&keys, &grads).unwrap(), reps);
            println!("{n:5} keys: apply_gradients {apply:8.0} ns");
        }
        if std::env::var_os("APPLY_ONLY").is_some() {
            // A training step's pair: the lookup leaves a memo of its rows,
            // which the gradient call of the same keys takes.
            let m = embstore_core::Missing::Init;
            let pair = best(
                || {
                    table
                        .try_lookup_now(&keys, true, m, &mut out)
                        .unwrap()
                        .unwrap();
                    table.apply_gradients(&keys, &grads).unwrap();
                },
                reps,
            );
            let look = best(
                || {
                    table
                        .try_lookup_now(&keys, true, m, &mut out)
                        .unwrap()
                        .unwrap()
                },
                reps,
            );
            println!("{n:5} keys: lookup now + apply {pair:8.0} ns, lookup now {look:8.0} ns");
            continue;
        }
        if std::env::var_os("SERVE_ONLY").is_some() {
            let serve = best(|| table.lookup(&keys, false, &mut out).unwrap(), reps * 5);
            let mut now = |insert| {
                let m = embstore_core::Missing::Init;
                best(
                    || {
                        table
                            .try_lookup_now(&keys, insert, m, &mut out)
                            .unwrap()
                            .unwrap()
                    },
                    reps * 5,
                )
            };
            let (serve_now, train_now) = (now(false), now(true));
            println!(
                "{n:5} keys: lookup(insert=false) {serve:8.0} ns, now: insert=false {serve_now:8.0} ns, insert=true {train_now:8.0} ns"
            );
            continue;
        }
        let gather = best(
            || {
                for (o, &k) in out.chunks_exact_mut(dim).zip(&keys) {
                    o.copy_from_slice(&dense[k as usize * dim..(k as usize + 1) * dim]);
                }
                std::hint::black_box(&out);
            },
            reps,
        );
        let mut found = vec![false; n];
        let contains = best(|| table.contains(&keys, &mut found).unwrap(), reps);
        let serve = best(|| table.lookup(&keys, false, &mut out).unwrap(), reps);
        let train = best(|| table.lookup(&keys, true, &mut out).unwrap(), reps);
        println!(
            "{n:5} keys: gather {:8.0} ns, contains {contains:8.0} ns, lookup(insert=false) {:8.0} ns ({:.1} ns/key), insert=true {:8.0} ns",
            gather,
            serve,
            serve / n as f64,
            train
        );
    }
}
