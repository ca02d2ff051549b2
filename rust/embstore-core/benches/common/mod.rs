//! Set-up the timing examples share: the table's optimizer from `OPT`, a
//! table filled with rows `0..rows` (and their dense copy), random keys.

use embstore_core::{Optimizer, Table, TableConfig};

/// A table of `dim` columns with the optimizer `OPT` names: Adam when unset,
/// none for `OPT=none` (rows without optimizer state), else that optimizer
/// with lr 0.01.
pub fn config(dim: usize) -> TableConfig {
    let mut cfg = TableConfig::new(dim);
    match std::env::var("OPT").as_deref() {
        Ok("none") => {}
        Ok(name) => {
            let lr = std::collections::BTreeMap::from([("lr".to_string(), 0.01)]);
            cfg.optimizer = Some(Optimizer::from_named(name, &lr).expect("OPT: an optimizer"));
        }
        Err(_) => cfg.optimizer = Some(Optimizer::from_named("Adam", &Default::default()).unwrap()),
    }
    cfg
}

/// Creates the rows of keys `0..rows` and returns them as a dense array.
pub fn fill(table: &Table, rows: usize, dim: usize) -> Vec<f32> {
    let all: Vec<i64> = (0..rows as i64).collect();
    let mut dense = vec![0.0f32; rows * dim];
    table.lookup(&all, true, &mut dense).unwrap();
    dense
}

/// `n` keys drawn from `0..rows` by the xorshift generator in `state`.
pub fn random_keys(state: &mut u64, n: usize, rows: usize) -> Vec<i64> {
    (0..n)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            (*state % rows as u64) as i64
        })
        .collect()
}
