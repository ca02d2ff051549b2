//! Bounded fuzzing (proptest), run by `cargo test`: the checkpoint reader
//! on mutated manifests and shard files (their checksums recomputed, so
//! the mutations reach the parsers and checks behind the checksums), and
//! the batch API against a HashMap model. `EMBSTORE_FUZZ_CASES` sets the
//! number of cases (default 64 each) for longer runs.
//!
//! Properties: a load never panics (an abort or hang would end the test
//! run), returns a table that holds the rows its manifest says or a
//! `Checkpoint` error; every batch call equals the model's answer.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use embstore_core::mapped::MappedTable;
use embstore_core::table::checkpoint::Manifest;
use embstore_core::{Initializer, Missing, Optimizer, StoreError, Table, TableConfig};
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("EMBSTORE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64)
}

fn table(dim: usize, opt: Option<Optimizer>) -> Table {
    let mut cfg = TableConfig::new(dim);
    cfg.optimizer = opt;
    cfg.initializer = Initializer::Uniform {
        low: -0.5,
        high: 0.5,
    };
    cfg.num_shards = Some(2);
    Table::new(cfg).unwrap()
}

fn fresh_dir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "embstore-fuzz-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A small saved checkpoint (two links: a full save and an incremental one).
fn saved(dir: &Path) {
    let t = table(
        3,
        Some(Optimizer::Adagrad {
            lr: 0.5,
            initial_accumulator_value: 0.5,
            eps: 0.25,
            weight_decay: 0.0,
        }),
    );
    let keys: Vec<i64> = (0..40).collect();
    t.lookup(&keys, true, &mut vec![0.0; 40 * 3]).unwrap();
    t.save(dir, false, true, None).unwrap();
    t.apply_gradients(&keys[..10], &[0.25; 30]).unwrap();
    t.remove(&[11, 12]).unwrap();
    t.save(dir, true, true, None).unwrap();
}

/// Writes `m` back with a valid checksum (the canonical JSON of everything
/// but the checksum, as the writer computes it).
fn write_manifest(dir: &Path, mut m: Manifest) {
    m.checksum = None;
    let canon = serde_json::to_value(&m).unwrap().to_string();
    m.checksum = Some(crc32c::crc32c(canon.as_bytes()));
    std::fs::write(dir.join("manifest.json"), serde_json::to_vec(&m).unwrap()).unwrap();
}

fn read_manifest(dir: &Path) -> Manifest {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

/// The load's outcome is one of the two allowed: a table holding what its
/// manifest says, or a checkpoint error (a refusal, not a crash).
fn check_load(dir: &Path) -> Result<(), TestCaseError> {
    match Table::load(dir, None, None) {
        Ok((t, m)) => prop_assert_eq!(t.len() as u64, m.rows),
        Err(StoreError::Checkpoint { .. } | StoreError::OutOfMemory { .. }) => {}
        Err(e) => prop_assert!(false, "a load failed with a non-checkpoint error: {}", e),
    }
    Ok(())
}

/// [`Table::load`] and [`MappedTable::open`] + `export` of `dir`: both
/// refuse, or both give the same rows.
fn check_both(dir: &Path) -> Result<(), TestCaseError> {
    let loaded = Table::load(dir, None, None);
    let mapped = MappedTable::open(dir).and_then(|m| m.export().map(|e| (m.len(), e)));
    match (loaded, mapped) {
        (Ok((t, _)), Ok((len, (keys, rows)))) => {
            let (want_keys, want_rows, _) = t.export(false).unwrap();
            prop_assert_eq!(len, t.len() as u64);
            prop_assert_eq!(keys, want_keys);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&rows), bits(&want_rows));
        }
        (Err(_), Err(_)) => {}
        (Ok(_), Err(e)) => prop_assert!(false, "loaded, but the mapped read refused: {}", e),
        (Err(e), Ok(_)) => {
            prop_assert!(false, "the mapped read served, but the load refused: {}", e)
        }
    }
    Ok(())
}

#[derive(Debug, Clone)]
enum Edit {
    /// A numeric field of the manifest set to a value.
    Number(usize, u64),
    /// A file entry's name, rows or bytes changed.
    Entry(usize, usize, u64),
    /// Bytes of a shard file overwritten at an offset (then re-checksummed).
    Bytes(usize, usize, Vec<u8>),
    /// A shard file cut to a length (then re-checksummed).
    Truncate(usize, usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    let big = prop_oneof![
        0u64..8,
        Just(u64::MAX),
        Just(1u64 << 40),
        Just(u64::from(u32::MAX)),
        any::<u64>()
    ];
    prop_oneof![
        (0usize..6, big.clone()).prop_map(|(f, v)| Edit::Number(f, v)),
        (0usize..8, 0usize..3, big).prop_map(|(i, f, v)| Edit::Entry(i, f, v)),
        (
            0usize..8,
            0usize..4096,
            proptest::collection::vec(any::<u8>(), 1..16)
        )
            .prop_map(|(i, at, b)| Edit::Bytes(i, at, b)),
        (0usize..8, 0usize..4096).prop_map(|(i, n)| Edit::Truncate(i, n)),
    ]
}

fn apply_edit(dir: &Path, e: &Edit) {
    let mut m = read_manifest(dir);
    let mut files: Vec<(usize, usize)> = Vec::new();
    for (li, l) in m.chain.iter().enumerate() {
        for fi in 0..l.files.len() {
            files.push((li, fi));
        }
    }
    match e {
        Edit::Number(f, v) => match f {
            0 => m.dim = *v as usize,
            1 => m.state_len = *v as usize,
            2 => m.rows = *v,
            3 => m.step = *v,
            4 => m.num_shards = *v as usize,
            _ => m.seed = *v,
        },
        Edit::Entry(i, f, v) => {
            let (li, fi) = files[i % files.len()];
            let entry = &mut m.chain[li].files[fi];
            match f {
                0 => entry.rows = *v,
                1 => entry.bytes = *v,
                _ => entry.name = format!("{v:x}"),
            }
        }
        Edit::Bytes(i, at, bytes) => {
            let (li, fi) = files[i % files.len()];
            let path = dir.join(&m.chain[li].files[fi].name);
            // A file an earlier edit renamed in the manifest: nothing to edit.
            let Ok(mut data) = std::fs::read(&path) else {
                return;
            };
            let at = at % data.len().max(1);
            for (k, b) in bytes.iter().enumerate() {
                if at + k < data.len() {
                    data[at + k] = *b;
                }
            }
            std::fs::write(&path, &data).unwrap();
            let entry = &mut m.chain[li].files[fi];
            entry.bytes = data.len() as u64;
            entry.crc32c = crc32c::crc32c(&data);
        }
        Edit::Truncate(i, n) => {
            let (li, fi) = files[i % files.len()];
            let path = dir.join(&m.chain[li].files[fi].name);
            // A file an earlier edit renamed in the manifest: nothing to edit.
            let Ok(mut data) = std::fs::read(&path) else {
                return;
            };
            data.truncate(n % (data.len() + 1));
            std::fs::write(&path, &data).unwrap();
            let entry = &mut m.chain[li].files[fi];
            entry.bytes = data.len() as u64;
            entry.crc32c = crc32c::crc32c(&data);
        }
    }
    write_manifest(dir, m);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// Mutated checkpoints (valid checksums, damaged contents) load whole
    /// or are refused with a checkpoint error; nothing panics.
    #[test]
    fn a_damaged_checkpoint_is_loaded_whole_or_refused(edits in proptest::collection::vec(edit(), 1..4)) {
        let dir = fresh_dir("ckpt");
        saved(&dir);
        for e in &edits {
            apply_edit(&dir, e);
        }
        let r = check_load(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        r?;
    }

    /// A load and a mapped open (with a read of every row) agree on any
    /// damaged or crafted directory: both refuse, or both serve the same
    /// rows (a mapped reader never serves what a load refuses, nor the
    /// other way round).
    #[test]
    fn a_load_and_a_mapped_read_both_refuse_or_serve_the_same_rows(
        edits in proptest::collection::vec(edit(), 1..4)
    ) {
        let dir = fresh_dir("both");
        saved(&dir);
        for e in &edits {
            apply_edit(&dir, e);
        }
        let r = check_both(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        r?;
    }

    /// Random JSON in place of the manifest is refused, never a panic.
    #[test]
    fn arbitrary_manifest_bytes_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let dir = fresh_dir("json");
        saved(&dir);
        std::fs::write(dir.join("manifest.json"), &bytes).unwrap();
        let r = Table::load(&dir, None, None);
        let _ = std::fs::remove_dir_all(&dir);
        let refused = matches!(r, Err(StoreError::Checkpoint { .. }));
        prop_assert!(refused, "random manifest bytes were not refused as a damaged checkpoint");
    }
}

#[derive(Debug, Clone)]
enum Op {
    Lookup(Vec<i64>, bool),
    Assign(Vec<i64>, i8),
    Remove(Vec<i64>),
    Apply(Vec<i64>, i8),
    Contains(Vec<i64>),
}

fn keys() -> impl Strategy<Value = Vec<i64>> {
    proptest::collection::vec(
        prop_oneof![0i64..24, Just(i64::MIN), Just(i64::MAX), Just(-1)],
        0..20,
    )
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (keys(), any::<bool>()).prop_map(|(k, i)| Op::Lookup(k, i)),
        (keys(), any::<i8>()).prop_map(|(k, v)| Op::Assign(k, v)),
        keys().prop_map(Op::Remove),
        (keys(), any::<i8>()).prop_map(|(k, v)| Op::Apply(k, v)),
        keys().prop_map(Op::Contains),
    ]
}

const DIM: usize = 2;

/// The model: key -> row; a new row is the initializer's.
struct Model {
    rows: HashMap<i64, Vec<f32>>,
    init: Table,
}

impl Model {
    fn init_row(&self, k: i64) -> Vec<f32> {
        let mut r = vec![0.0; DIM];
        self.init
            .lookup_or(&[k], false, Missing::Init, &mut r)
            .unwrap();
        r
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    /// Every call of a random sequence (lookups that insert or serve,
    /// assigns, removes, SGD steps with repeated keys, contains) answers
    /// what a HashMap model answers, with the same float32 arithmetic.
    #[test]
    fn the_batch_api_equals_a_hashmap_model(ops in proptest::collection::vec(op(), 1..30)) {
        let sgd = Optimizer::Sgd { lr: 0.5, weight_decay: 0.0 };
        let t = table(DIM, Some(sgd));
        let mut model = Model { rows: HashMap::new(), init: table(DIM, None) };
        for op in &ops {
            match op {
                Op::Lookup(ks, insert) => {
                    let mut out = vec![0.0; ks.len() * DIM];
                    t.lookup(ks, *insert, &mut out).unwrap();
                    for (i, k) in ks.iter().enumerate() {
                        let want = match model.rows.get(k) {
                            Some(r) => r.clone(),
                            None => model.init_row(*k),
                        };
                        if *insert {
                            model.rows.entry(*k).or_insert_with(|| want.clone());
                        }
                        prop_assert_eq!(&out[i * DIM..(i + 1) * DIM], &want[..]);
                    }
                }
                Op::Assign(ks, v) => {
                    let vals: Vec<f32> = ks.iter().flat_map(|&k| [f32::from(*v), k as f32]).collect();
                    t.assign(ks, &vals).unwrap();
                    for (i, k) in ks.iter().enumerate() {
                        model.rows.insert(*k, vals[i * DIM..(i + 1) * DIM].to_vec());
                    }
                }
                Op::Remove(ks) => {
                    let n = t.remove(ks).unwrap();
                    let mut distinct = ks.clone();
                    distinct.sort_unstable();
                    distinct.dedup();
                    let want = distinct.iter().filter(|k| model.rows.remove(k).is_some()).count();
                    prop_assert_eq!(n, want);
                }
                Op::Apply(ks, v) => {
                    let grads: Vec<f32> = (0..ks.len() * DIM).map(|j| f32::from(*v) / (j + 1) as f32).collect();
                    t.apply_gradients(ks, &grads).unwrap();
                    // Each key's gradients summed in batch order, then one update.
                    let mut sums: Vec<(i64, Vec<f32>, usize)> = Vec::new();
                    for (i, k) in ks.iter().enumerate() {
                        let g = &grads[i * DIM..(i + 1) * DIM];
                        match sums.iter_mut().find(|s| s.0 == *k) {
                            Some(s) => {
                                for (a, b) in s.1.iter_mut().zip(g) { *a += b; }
                                s.2 += 1;
                            }
                            None => sums.push((*k, g.to_vec(), 1)),
                        }
                    }
                    for (k, g, _) in sums {
                        let row = match model.rows.get(&k) {
                            Some(r) => r.clone(),
                            None => model.init_row(k),
                        };
                        let new: Vec<f32> = row.iter().zip(&g).map(|(w, g)| w - 0.5 * g).collect();
                        model.rows.insert(k, new);
                    }
                }
                Op::Contains(ks) => {
                    let mut out = vec![false; ks.len()];
                    t.contains(ks, &mut out).unwrap();
                    for (i, k) in ks.iter().enumerate() {
                        prop_assert_eq!(out[i], model.rows.contains_key(k));
                    }
                }
            }
            prop_assert_eq!(t.len(), model.rows.len());
        }
    }
}
