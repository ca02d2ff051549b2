//! Memory policies: compact row formats, admission of new keys, eviction by
//! age (TTL) or capacity (LFU/LRU), the per-row metadata they score rows by,
//! and the counters `stats()` reports.
//!
//! None of it costs anything when it is not configured: a table without a
//! TTL or a capacity keeps no per-row metadata, a table without an admission
//! filter keeps no sketch, and the per-key loops test one flag per call.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Result, invalid};
use crate::hash::{draw, mix64};
use crate::vocab;

pub use crate::format::codec::RowFormat;

/// Which keys get a row when a gradient first reaches them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Admission {
    /// Every key.
    #[default]
    Always,
    /// A key once `min_count` gradient calls have held it (a call counts a
    /// key once, however often its batch holds it, so that a batch
    /// deduplicated on the way, by a ShardedTable or a DeviceCache, counts
    /// the same), counted in a count-min sketch of `depth` rows of `width` 8-bit counters
    /// (conservative update). The sketch never under-counts, so a key is
    /// never admitted late; it may over-count and admit early. With
    /// probability at least `1 - exp(-depth)` a key's count is over by at
    /// most `e * n / width`, where `n` is the number of sightings (key,
    /// call) of unadmitted keys in its shard's part of the sketch and the sketch's
    /// columns are split evenly over the shards.
    Count {
        /// Sightings needed (1..=255).
        min_count: u32,
        /// Counters per sketch row, over all shards.
        width: usize,
        /// Sketch rows (independent hashes).
        depth: usize,
    },
    /// Each sighting of an unadmitted key admits it with probability `p`,
    /// decided by a hash of (seed, key, step): the same on every rank and
    /// in every run.
    Probability {
        /// Probability per sighting, in (0, 1].
        p: f64,
    },
}

impl Admission {
    /// The filter named `name` with `params` (as the Python classes and the
    /// checkpoint manifest name them).
    ///
    /// # Errors
    /// `InvalidArgument` for an unknown name or bad parameters.
    pub fn from_named(name: &str, params: &[(String, f64)]) -> Result<Admission> {
        if name == "always" {
            return Ok(Admission::Always);
        }
        let spec = vocab::find("admission", vocab::ADMISSIONS, name)?;
        let p: BTreeMap<String, f64> = params.iter().cloned().collect();
        let whole = |arg: &'static str, lo: f64, hi: f64| -> Result<f64> {
            let v = spec.get(&p, arg)?;
            if (lo..=hi).contains(&v) {
                Ok(v)
            } else {
                Err(invalid(
                    arg,
                    format!("expected an integer in [{lo}, {hi}], got {v}"),
                ))
            }
        };
        let a = match spec.name {
            "count" => Admission::Count {
                min_count: whole("min_count", 1.0, 255.0)? as u32,
                width: whole("width", 1.0, (1u64 << 40) as f64)? as usize,
                depth: whole("depth", 1.0, 16.0)? as usize,
            },
            "probability" => {
                let p = spec.get(&p, "p")?;
                if !(p > 0.0 && p <= 1.0) {
                    return Err(invalid("p", format!("expected 0 < p <= 1, got {p}")));
                }
                Admission::Probability { p }
            }
            other => unreachable!("{other} is listed in vocab::ADMISSIONS without a parser"),
        };
        Ok(a)
    }

    /// Name and parameters, as [`Admission::from_named`] takes them.
    pub fn to_named(&self) -> (&'static str, Vec<(String, f64)>) {
        match *self {
            Admission::Always => ("always", Vec::new()),
            Admission::Count {
                min_count,
                width,
                depth,
            } => (
                "count",
                vec![
                    ("min_count".into(), f64::from(min_count)),
                    ("width".into(), width as f64),
                    ("depth".into(), depth as f64),
                ],
            ),
            Admission::Probability { p } => ("probability", vec![("p".into(), p)]),
        }
    }

    /// Whether every key is admitted.
    pub fn is_always(&self) -> bool {
        matches!(self, Admission::Always)
    }

    /// Whether a sighting at optimizer step `step` admits `key` under
    /// [`Admission::Probability`].
    pub fn draw_admits(p: f64, seed: u64, key: i64, step: u64) -> bool {
        let stream = mix64(mix64(seed ^ 0x3C6E_F372_FE94_F82B) ^ (key as u64));
        let u = (draw(stream, step) >> 11) as f64 * (1.0 / (1u64 << 53) as f64);
        u < p
    }
}

/// A filter's serde form, `{"name": .., "params": {..}}`: as manifests
/// and the binding's config spell every named configuration.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Named {
    name: String,
    params: BTreeMap<String, f64>,
}

impl Serialize for Admission {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let (name, params) = self.to_named();
        Named {
            name: name.to_string(),
            params: params.into_iter().collect(),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Admission {
    /// Checked as [`Admission::from_named`] checks it.
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let n = Named::deserialize(d)?;
        let params: Vec<(String, f64)> = n.params.into_iter().collect();
        Admission::from_named(&n.name, &params).map_err(serde::de::Error::custom)
    }
}

/// Which rows capacity eviction removes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Eviction {
    /// Least frequently used: fewest accesses, then least recent, then
    /// smallest key.
    #[default]
    Lfu,
    /// Least recently used: least recent, then fewest accesses, then
    /// smallest key.
    Lru,
}

impl Eviction {
    /// "lfu" or "lru".
    ///
    /// # Errors
    /// `InvalidArgument` naming `eviction` otherwise.
    pub fn from_name(name: &str) -> Result<Eviction> {
        match name {
            "lfu" => Ok(Eviction::Lfu),
            "lru" => Ok(Eviction::Lru),
            other => Err(invalid(
                "eviction",
                format!(
                    "expected {}; got {other:?}",
                    vocab::one_of(vocab::EVICTIONS)
                ),
            )),
        }
    }

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            Eviction::Lfu => "lfu",
            Eviction::Lru => "lru",
        }
    }

    /// A sort key: smaller is evicted first.
    #[inline]
    pub fn score(self, m: &Meta, key: i64) -> (u64, u64, i64) {
        match self {
            Eviction::Lfu => (u64::from(m.count), m.tick, key),
            Eviction::Lru => (m.tick, u64::from(m.count), key),
        }
    }
}

impl Serialize for Eviction {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for Eviction {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Eviction::from_name(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// A table's memory policy: the settings of a table beyond its shape,
/// optimizer and initializer, in one place.
///
/// Its serde form is the one spec of these settings: a checkpoint's
/// manifest holds it as its `policy`, and the binding passes it inside a
/// [`TableConfig`](crate::TableConfig)'s JSON (`TableConfig::to_json`), so
/// the Python `embstore.TableConfig` reaches a new field here with no code
/// between them. A field added later is left out of the JSON while unset
/// (`skip_serializing_if`), so that manifests written before it read, and
/// checksum, as they were written; an unknown field is refused.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// Row storage (the manifest's and the config's `dtype`, outside the
    /// policy's serde form).
    #[serde(skip)]
    pub format: RowFormat,
    /// Which keys get rows from gradients.
    pub admission: Admission,
    /// `evict()` removes rows not touched for this many optimizer steps.
    pub ttl_steps: Option<u64>,
    /// `evict()` removes rows not touched for more than this many seconds
    /// of wall-clock time (at most one of the two TTLs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
    /// After a call that inserts, rows beyond this many are evicted.
    pub capacity: Option<usize>,
    /// After a call that inserts, rows beyond this many bytes are evicted
    /// (each row counted at [`Policy::row_cost`]); with `capacity` too,
    /// the lower bound holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity_bytes: Option<u64>,
    /// Which rows capacity eviction removes first.
    pub eviction: Eviction,
}

/// Index bytes a row is counted at in [`Policy::row_cost`]: its 16-byte
/// slot at the index's lowest load (3/8), rounded up.
pub const INDEX_BYTES_A_ROW: usize = 43;

/// The most seconds (and steps) a TTL may be: ages are kept in 32 bits.
const MAX_TTL: u64 = 1 << 31;

impl Policy {
    /// Whether rows carry [`Meta`].
    pub fn tracks(&self) -> bool {
        self.ttl_steps.is_some()
            || self.ttl_seconds.is_some()
            || self.capacity.is_some()
            || self.capacity_bytes.is_some()
    }

    /// The bytes a row of `ww` weight words and `sl` state floats counts
    /// for under `capacity_bytes`: its weights, state, metadata, tag (8)
    /// and index slot ([`INDEX_BYTES_A_ROW`]).
    pub fn row_cost(&self, ww: usize, sl: usize) -> usize {
        let meta = if self.tracks() { size_of::<Meta>() } else { 0 };
        4 * (ww + sl) + meta + 8 + INDEX_BYTES_A_ROW
    }

    /// The most rows the table keeps: `capacity`, and `capacity_bytes`
    /// over [`Policy::row_cost`], whichever is lower (`None`: no bound).
    pub fn capacity_rows(&self, ww: usize, sl: usize) -> Option<usize> {
        let by_bytes = self
            .capacity_bytes
            .map(|b| usize::try_from(b / self.row_cost(ww, sl) as u64).unwrap_or(usize::MAX));
        match (self.capacity, by_bytes) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Checks the numbers.
    ///
    /// # Errors
    /// `InvalidArgument` naming `ttl_steps`, `ttl_seconds`, `capacity` or
    /// `capacity_bytes`.
    pub fn validate(&self) -> Result<()> {
        for (name, ttl) in [
            ("ttl_steps", self.ttl_steps),
            ("ttl_seconds", self.ttl_seconds),
        ] {
            if let Some(t) = ttl
                && !(1..=MAX_TTL).contains(&t)
            {
                return Err(invalid(
                    name,
                    format!("expected 1 <= {name} <= 2^31, got {t}"),
                ));
            }
        }
        if self.ttl_steps.is_some() && self.ttl_seconds.is_some() {
            return Err(invalid(
                "ttl_seconds",
                "expected at most one of ttl_steps and ttl_seconds, got both",
            ));
        }
        if self.capacity == Some(0) {
            return Err(invalid("capacity", "expected capacity >= 1, got 0"));
        }
        if self.capacity_bytes == Some(0) {
            return Err(invalid(
                "capacity_bytes",
                "expected capacity_bytes >= 1, got 0",
            ));
        }
        Ok(())
    }

    /// The clock a touch records and a TTL measures ages on: seconds since
    /// the Unix epoch with `ttl_seconds` (32 bits hold them until 2106),
    /// else the optimizer step `step`.
    pub fn age_clock(&self, step: u64) -> u64 {
        if self.ttl_seconds.is_some() {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        } else {
            step
        }
    }

    /// Whether a row of metadata `m` has outlived the TTL at clock `now`
    /// ([`Policy::age_clock`]): untouched for `ttl_steps` steps, or for
    /// more than `ttl_seconds` seconds (whole seconds are counted, so a row
    /// goes up to a second late, never early).
    pub fn expired(&self, m: &Meta, now: u64) -> bool {
        match (self.ttl_steps, self.ttl_seconds) {
            (Some(t), _) => m.age(now) >= t,
            (_, Some(t)) => m.age(now) > t,
            _ => false,
        }
    }
}

/// Per-row metadata: what eviction scores a row by. A row is touched by
/// every occurrence of its key in a lookup, assign or gradient call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(C)]
pub struct Meta {
    /// The table's call clock at the row's last touch.
    pub tick: u64,
    /// The optimizer step at the last touch (mod 2^32).
    pub step: u32,
    /// Touches so far (saturating).
    pub count: u32,
}

impl Meta {
    /// Records `n` touches in call `tick` at optimizer step `step`.
    #[inline]
    pub fn touch(&mut self, tick: u64, step: u64, n: u32) {
        // A serving read counted late (queued while a writer held the
        // shard) adds its count but does not move the last touch back.
        if tick >= self.tick {
            self.tick = tick;
            self.step = step as u32;
        }
        self.count = self.count.saturating_add(n);
    }

    /// Steps since the last touch, as of step `now`.
    #[inline]
    pub fn age(&self, now: u64) -> u64 {
        u64::from((now as u32).wrapping_sub(self.step))
    }

    /// As four u32 words (tick low, tick high, step, count), for checkpoints.
    pub fn to_words(self) -> [u32; 4] {
        [
            self.tick as u32,
            (self.tick >> 32) as u32,
            self.step,
            self.count,
        ]
    }

    /// The inverse of [`Meta::to_words`].
    pub fn from_words(w: &[u32]) -> Meta {
        Meta {
            tick: u64::from(w[0]) | (u64::from(w[1]) << 32),
            step: w[2],
            count: w[3],
        }
    }
}

/// One shard's part of a count-min sketch of 8-bit saturating counters.
#[derive(Debug)]
pub struct Sketch {
    width: usize,
    depth: usize,
    cells: Vec<u8>,
}

impl Sketch {
    /// `depth` rows of `width` zeroed counters (pages are mapped on first
    /// write, so an unused sketch costs no resident memory).
    pub fn new(width: usize, depth: usize) -> Sketch {
        Self::try_new(width, depth).expect("memory for the admission sketch")
    }

    /// [`Sketch::new`], or `None` when its counters cannot be allocated.
    pub fn try_new(width: usize, depth: usize) -> Option<Sketch> {
        let n = width.max(1).checked_mul(depth)?;
        let cells = crate::zeroed::try_zeroed::<u8>(n)?;
        Some(Sketch {
            width: width.max(1),
            depth,
            cells,
        })
    }

    /// Bytes of counters.
    pub fn bytes(&self) -> usize {
        self.cells.len()
    }

    #[inline]
    fn cell(&self, key: i64, d: usize) -> usize {
        let h = mix64((key as u64) ^ (d as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03));
        d * self.width + ((u128::from(h) * self.width as u128) >> 64) as usize
    }

    /// The estimated count of `key`.
    pub fn estimate(&self, key: i64) -> u32 {
        (0..self.depth)
            .map(|d| u32::from(self.cells[self.cell(key, d)]))
            .min()
            .unwrap_or(0)
    }

    /// The estimate of `key` after `n` more sightings (what [`Sketch::add`]
    /// would return), without adding them.
    pub fn estimate_after(&self, key: i64, n: u32) -> u32 {
        (self.estimate(key) + n).min(255)
    }

    /// Adds `n` sightings of `key` (conservative update: only counters below
    /// the new estimate rise to it) and returns the new estimate.
    pub fn add(&mut self, key: i64, n: u32) -> u32 {
        let new = self.estimate_after(key, n);
        for d in 0..self.depth {
            let c = self.cell(key, d);
            if u32::from(self.cells[c]) < new {
                self.cells[c] = new as u8;
            }
        }
        new
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_formats_round_trip_what_they_store() {
        let src: Vec<f32> = (0..9).map(|i| (i as f32 - 4.0) * 0.3141).collect();
        for f in [RowFormat::F32, RowFormat::F16, RowFormat::BF16] {
            let mut words = vec![0.0f32; f.words(src.len())];
            f.encode(&src, &mut words);
            let mut back = vec![0.0f32; src.len()];
            f.decode(&words, &mut back);
            let mut rounded = src.clone();
            f.round(&mut rounded);
            assert_eq!(back, rounded, "{f:?}");
            let tol = match f {
                RowFormat::F32 => 0.0,
                RowFormat::F16 => 1e-3,
                RowFormat::BF16 => 8e-3,
                RowFormat::I8 => unreachable!("not in this test: codec.rs tests 8-bit rows"),
            };
            for (a, b) in back.iter().zip(&src) {
                assert!(
                    (a - b).abs() <= tol * b.abs().max(1e-3),
                    "{f:?}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn sketch_never_undercounts_and_saturates() {
        let mut s = Sketch::new(64, 3);
        let mut truth = std::collections::HashMap::new();
        for i in 0..2000i64 {
            let key = (i * 7919) % 300;
            let n = (i % 3) as u32 + 1;
            let est = s.add(key, n);
            let t = truth.entry(key).or_insert(0u32);
            *t += n;
            assert!(est >= (*t).min(255), "key {key}: {est} < {t}");
            assert!(est <= 255);
        }
        let mut wide = Sketch::new(1 << 20, 4);
        assert_eq!(wide.add(5, 1), 1);
        assert_eq!(wide.add(5, 1), 2);
        assert_eq!(wide.estimate(6), 0);
    }

    #[test]
    fn probability_admission_is_a_pure_function_near_p() {
        let hits = (0..100_000i64)
            .filter(|&k| Admission::draw_admits(0.25, 7, k, 3))
            .count();
        assert!((hits as f64 / 1e5 - 0.25).abs() < 0.01, "{hits}");
        assert_eq!(
            Admission::draw_admits(0.5, 1, 42, 9),
            Admission::draw_admits(0.5, 1, 42, 9)
        );
    }
}
