//! Rows as the table stores them: read and written as their words (an
//! 8-bit row's codes, scale and offset; a 16-bit row's halves), not as
//! float32. A tier that trains rows elsewhere in their stored form (a
//! device cache over an 8-bit table) takes them and gives them back bit
//! for bit, where a round trip through float32 would re-encode them (an
//! 8-bit row's scale recomputed from its decoded weights can move by an
//! ulp, and its codes with it).

use crate::table::views::Writer;
use crate::table::views::{Evictor, Reader};
use rayon::prelude::*;

use crate::error::{Result, invalid};
use crate::policy::RowFormat;
use crate::rows::{check_finite, check_len};
use crate::table::batch::output::SharedOut;
use crate::table::batch::plan::Floor;
use crate::table::{Missing, NO_ROW, Table};
use crate::zeroed::zeros;

impl Table {
    /// [`Table::lookup_with_state`] with each row as stored: `words` gets
    /// [`Table::weight_words`] words a key (a key without a row, where
    /// `insert` is false, gets its initializer row encoded to nearest, as an
    /// insert would store it), `state` its optimizer state.
    ///
    /// # Errors
    /// `ShapeMismatch` (naming `out`) for `words` or `state` of the wrong length.
    pub fn lookup_stored_with_state(
        &self,
        keys: &[i64],
        insert: bool,
        words: &mut [f32],
        state: &mut [f32],
    ) -> Result<()> {
        Table::check_batch(keys)?;
        let (dim, ww, sl) = (self.dim, self.wwords, self.state_len);
        check_len("out", keys.len() * ww, words.len())?;
        check_len("state", keys.len() * sl, state.len())?;
        let plan = self.plan(keys, Floor::Read)?;
        let w_out = SharedOut::new(words, ww);
        let st_out = SharedOut::new(state, sl);
        let _gate = self.lookup_changes(insert).then(|| self.enter());
        Reader(self).lookup_rows(keys, &plan, insert, None, |g, pos, rows| {
            let mut tmp = vec![0.0f32; dim];
            for (&i, &r) in pos.iter().zip(rows) {
                let i = i as usize;
                // SAFETY: position i belongs to this shard only (plan).
                let (dst, st) = unsafe { (w_out.row(i, ww), st_out.row(i, sl)) };
                if r == NO_ROW {
                    self.fill_missing(keys[i], &mut tmp, Missing::Init);
                    dst.fill(0.0);
                    self.write_weights(dst, &tmp);
                    if let Some(o) = &self.optimizer {
                        o.init_state(st);
                    }
                } else {
                    dst.copy_from_slice(&g.weights(r as usize)[..ww]);
                    st.copy_from_slice(g.state(r as usize));
                }
            }
        })?;
        if insert {
            Evictor(self).enforce_capacity();
        }
        Ok(())
    }

    /// Inserts or overwrites rows given as stored (`words`,
    /// [`Table::weight_words`] a key, as [`Table::lookup_stored_with_state`]
    /// gives them) with their optimizer state: the row keeps these words
    /// exactly. Checked as [`Table::assign_state`] checks its values, on the
    /// weights the words decode to; an 8-bit row's scale must be finite and
    /// not negative, its offset finite.
    ///
    /// # Errors
    /// `ShapeMismatch` for wrong lengths; `InvalidArgument` naming `rows`
    /// for words that decode to weights this table cannot hold, or `state`
    /// for impossible state; nothing changed then.
    pub fn assign_stored(&self, keys: &[i64], words: &[f32], state: &[f32]) -> Result<()> {
        let values = Writer(self).decode_stored(keys, words)?;
        Writer(self).assign_checked(keys, &values, Some(words), Some(state), None, None, None)
    }

    /// [`Table::restore`] of rows as the table stores them (`words`, as
    /// [`Table::assign_stored`] takes them): 8-bit rows move between tables
    /// as they are, never quantized again (a reshard).
    ///
    /// # Errors
    /// As [`Table::assign_stored`] and [`Table::restore`].
    pub fn restore_stored(
        &self,
        keys: &[i64],
        words: &[f32],
        state: Option<&[f32]>,
        meta: Option<&[u32]>,
        clock: u64,
    ) -> Result<()> {
        let values = Writer(self).decode_stored(keys, words)?;
        if keys.is_empty() {
            // Nothing to write: only the clock (no tick for an empty call).
            self.set_clock(self.clock().max(clock));
            return Ok(());
        }
        let meta = meta.filter(|_| self.policy.tracks());
        if let Some(m) = meta {
            check_len("meta", keys.len() * 4, m.len())?;
        }
        Writer(self).assign_checked(keys, &values, Some(words), state, meta, None, Some(clock))
    }
}

impl<'a> Writer<'a> {
    /// The weights of stored rows `words`, checked (an 8-bit row's scale
    /// and offset, finite values that fit the format).
    fn decode_stored(&self, keys: &[i64], words: &[f32]) -> Result<Vec<f32>> {
        Table::check_batch(keys)?;
        let (dim, ww) = (self.dim, self.wwords);
        check_len("rows", keys.len() * ww, words.len())?;
        let format = self.policy.format;
        if format == RowFormat::I8 {
            let cw = ww - 2;
            for (i, w) in words.chunks_exact(ww.max(1)).enumerate() {
                let (scale, offset) = (w[cw], w[cw + 1]);
                if !(scale.is_finite() && scale >= 0.0 && offset.is_finite()) {
                    return Err(invalid(
                        "rows",
                        format!(
                            "expected an 8-bit row's scale finite and >= 0 and its offset \
                             finite, got scale {scale} and offset {offset} in row {i}"
                        ),
                    ));
                }
            }
        }
        let mut values: Vec<f32> = zeros("rows", keys.len() * dim)?;
        // Decoded on the pool (a write-back of a device cache's misses is
        // 10^5 rows and more); no lock is held here.
        let backend = self.backend;
        values
            .par_chunks_exact_mut(dim.max(1))
            .zip(words.par_chunks_exact(ww.max(1)))
            .with_min_len(1024)
            .for_each(|(v, w)| format.decode_on(backend, w, v));
        check_finite("rows", &values)?;
        format.check_fits("rows", &values)?;
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use crate::optim::Optimizer;
    use crate::policy::RowFormat;
    use crate::table::{Table, TableConfig};

    fn int8_table() -> Table {
        let mut cfg = TableConfig::new(5);
        cfg.policy.format = RowFormat::I8;
        cfg.optimizer = Some(Optimizer::Sgd {
            lr: 0.1,
            weight_decay: 0.0,
        });
        Table::new(cfg).unwrap()
    }

    #[test]
    fn stored_rows_go_back_bit_for_bit_and_bad_words_change_nothing() {
        let t = int8_table();
        let ww = t.weight_words();
        assert_eq!(ww, 4, "two words of codes, scale, offset");
        let keys = [3i64, 9];
        t.assign(
            &keys,
            &[0.1, -0.2, 0.3, 0.05, 0.0, 1.0, 2.0, -3.0, 0.5, 0.25],
        )
        .unwrap();
        t.apply_gradients(&keys, &[0.3; 10]).unwrap();
        let (mut words, mut st) = (vec![0.0; 2 * ww], vec![]);
        t.lookup_stored_with_state(&keys, false, &mut words, &mut st)
            .unwrap();
        // Into another table: the same words, and the same floats read.
        let u = int8_table();
        u.assign_stored(&keys, &words, &st).unwrap();
        let mut again = vec![0.0; 2 * ww];
        u.lookup_stored_with_state(&keys, false, &mut again, &mut st)
            .unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&again), bits(&words));
        let (mut a, mut b) = (vec![0.0; 10], vec![0.0; 10]);
        t.lookup(&keys, false, &mut a).unwrap();
        u.lookup(&keys, false, &mut b).unwrap();
        assert_eq!(bits(&a), bits(&b));
        // A negative scale, then an infinite offset: refused, nothing changed.
        for (at, bad) in [(2, -1.0f32), (3, f32::INFINITY)] {
            let mut w = words.clone();
            w[ww + at] = bad;
            let e = u.assign_stored(&[3, 100], &w, &st).unwrap_err();
            assert!(e.to_string().starts_with("rows:"), "{e}");
            assert_eq!(u.len(), 2);
        }
    }
}
