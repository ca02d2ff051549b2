//! How a [`Table`](super::Table) is built: [`TableConfig`], and its JSON
//! form, the one spec the binding passes both ways.

use serde_json::{Map, Value, json};

use crate::error::{Result, invalid};
use crate::format::codec::RowFormat;
use crate::format::manifest::NamedConfig;
use crate::init::Initializer;
use crate::optim::Optimizer;
use crate::policy::Policy;
use crate::simd::Backend;
use crate::table::cold::DiskConfig;

/// How a [`Table`] is built.
#[derive(Debug, Clone)]
pub struct TableConfig {
    /// Columns per row (>= 1).
    pub dim: usize,
    /// The optimizer, or `None` for a table that is only read and assigned.
    pub optimizer: Option<Optimizer>,
    /// How new rows are filled.
    pub initializer: Initializer,
    /// Seed of the initializer's streams.
    pub seed: u64,
    /// Number of shards; `None` picks `(available_parallelism * 4).next_power_of_two()`.
    pub num_shards: Option<usize>,
    /// SIMD backend; `None` reads `EMBSTORE_SIMD` or picks the best supported.
    pub backend: Option<Backend>,
    /// Row format, admission and eviction.
    pub policy: Policy,
    /// A disk table's directory and memory ([`DiskConfig`]); `None` for a
    /// table in memory.
    pub disk: Option<DiskConfig>,
}

impl TableConfig {
    /// A config with defaults for everything but `dim`.
    pub fn new(dim: usize) -> Self {
        TableConfig {
            dim,
            optimizer: None,
            initializer: Initializer::default(),
            seed: 0,
            num_shards: None,
            backend: None,
            policy: Policy::default(),
            disk: None,
        }
    }
}

impl TableConfig {
    /// The config as one flat JSON object: `dim`, `seed`, `num_shards`
    /// (absent when `None`), `dtype`, `optimizer` and `initializer` as
    /// `{"name", "params"}`, and every [`Policy`] field in its serde form.
    /// The backend is not part of it. The Python `embstore.TableConfig`
    /// has the same fields, so a setting added to `Policy` travels between
    /// them with no code here.
    pub fn to_json(&self) -> String {
        let mut v = serde_json::to_value(self.policy).expect("a policy always serializes");
        let m = v.as_object_mut().expect("a policy serializes as an object");
        let named = |(name, params): (&str, _)| NamedConfig {
            name: name.to_string(),
            params,
        };
        m.insert("dim".into(), json!(self.dim));
        m.insert("seed".into(), json!(self.seed));
        if let Some(n) = self.num_shards {
            m.insert("num_shards".into(), json!(n));
        }
        m.insert("dtype".into(), json!(self.policy.format.name()));
        let opt = self.optimizer.as_ref().map(|o| named(o.to_named()));
        m.insert("optimizer".into(), json!(opt));
        m.insert(
            "initializer".into(),
            json!(named(self.initializer.to_named())),
        );
        if let Some(d) = &self.disk {
            m.insert("disk".into(), json!(d.path));
            m.insert("memory_bytes".into(), json!(d.memory_bytes));
        }
        v.to_string()
    }

    /// The inverse of [`TableConfig::to_json`]: a field left out takes its
    /// default (only `dim` is required). The values are parsed, not
    /// checked: [`Table::new`](super::Table::new) checks them.
    ///
    /// # Errors
    /// `InvalidArgument` naming the field that is not what it should be,
    /// or `config` for what is not a JSON object or names an unknown field.
    pub fn from_json(text: &str) -> Result<TableConfig> {
        let mut m: Map<String, Value> = serde_json::from_str(text)
            .map_err(|e| invalid("config", format!("expected a JSON object: {e}")))?;
        let take = |m: &mut Map<String, Value>, name: &str| m.remove(name).filter(|v| !v.is_null());
        let dim =
            take(&mut m, "dim").ok_or_else(|| invalid("dim", "expected an integer, got none"))?;
        let mut cfg = TableConfig::new(parse("dim", dim)?);
        if let Some(v) = take(&mut m, "seed") {
            cfg.seed = parse("seed", v)?;
        }
        cfg.num_shards = take(&mut m, "num_shards")
            .map(|v| parse("num_shards", v))
            .transpose()?;
        cfg.optimizer = take(&mut m, "optimizer")
            .map(|v| {
                let n: NamedConfig = parse("optimizer", v)?;
                Optimizer::from_named(&n.name, &n.params)
            })
            .transpose()?;
        if let Some(v) = take(&mut m, "initializer") {
            let n: NamedConfig = parse("initializer", v)?;
            cfg.initializer = Initializer::from_named(&n.name, &n.params)?;
        }
        cfg.disk = match (take(&mut m, "disk"), take(&mut m, "memory_bytes")) {
            (None, None) => None,
            (Some(p), Some(b)) => Some(DiskConfig {
                path: parse("disk", p)?,
                memory_bytes: parse("memory_bytes", b)?,
            }),
            (None, Some(_)) => return Err(invalid("memory_bytes", "expected disk= with it")),
            (Some(_), None) => return Err(invalid("disk", "expected memory_bytes= with it")),
        };
        let format = match take(&mut m, "dtype") {
            Some(v) => RowFormat::from_name(&parse::<String>("dtype", v)?)?,
            None => RowFormat::default(),
        };
        cfg.policy = Policy {
            format,
            ..serde_json::from_value(Value::Object(m))
                .map_err(|e| invalid("config", e.to_string()))?
        };
        Ok(cfg)
    }
}

fn parse<T: serde::de::DeserializeOwned>(arg: &'static str, v: Value) -> Result<T> {
    serde_json::from_value(v).map_err(|e| invalid(arg, e.to_string()))
}

/// The default number of shards: four per core, a power of two.
pub fn default_num_shards() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores * 4).next_power_of_two()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Admission, Eviction};
    use crate::table::Table;
    use std::collections::BTreeMap;

    fn every_setting() -> TableConfig {
        let mut cfg = TableConfig::new(6);
        cfg.optimizer =
            Some(Optimizer::from_named("Adam", &BTreeMap::from([("lr".into(), 0.1)])).unwrap());
        cfg.initializer =
            Initializer::from_named("Normal", &BTreeMap::from([("std".into(), 0.3)])).unwrap();
        cfg.seed = u64::MAX;
        cfg.num_shards = Some(4);
        cfg.policy = Policy {
            format: RowFormat::BF16,
            admission: Admission::Count {
                min_count: 3,
                width: 512,
                depth: 2,
            },
            ttl_steps: None,
            ttl_seconds: Some(30),
            capacity: Some(1000),
            capacity_bytes: Some(1 << 20),
            eviction: Eviction::Lru,
        };
        cfg
    }

    #[test]
    fn a_config_reads_back_from_its_json_and_from_the_table_it_built() {
        let cfg = every_setting();
        let back = TableConfig::from_json(&cfg.to_json()).unwrap();
        assert_eq!(back.to_json(), cfg.to_json());
        assert_eq!(back.policy, cfg.policy);
        assert_eq!(back.optimizer, cfg.optimizer);
        let table = Table::new(cfg.clone()).unwrap();
        let built = table.config();
        assert_eq!(built.policy, cfg.policy);
        assert_eq!((built.seed, built.num_shards), (u64::MAX, Some(4)));
        assert_eq!(built.to_json(), cfg.to_json());
        // A disk table's settings travel too.
        let mut on_disk = TableConfig::new(2);
        on_disk.disk = Some(DiskConfig {
            path: "/some/where".into(),
            memory_bytes: 1 << 30,
        });
        let back = TableConfig::from_json(&on_disk.to_json()).unwrap();
        assert_eq!(back.disk, on_disk.disk);
        // Only dim is required; the rest take the defaults.
        let plain = TableConfig::from_json(r#"{"dim": 3}"#).unwrap();
        assert_eq!(plain.policy, Policy::default());
        assert!(plain.optimizer.is_none() && plain.num_shards.is_none());
    }

    #[test]
    fn a_config_naming_an_unknown_setting_or_a_bad_value_is_refused_by_name() {
        let err = |text: &str| TableConfig::from_json(text).unwrap_err().to_string();
        assert!(err(r#"{"dim": 3, "made_up": 1}"#).starts_with("config: unknown field `made_up`"));
        assert!(err(r#"{"seed": 1}"#).starts_with("dim:"));
        assert!(err(r#"{"dim": -3}"#).starts_with("dim:"));
        assert!(err(r#"{"dim": 3, "dtype": "int4"}"#).starts_with("dtype:"));
        assert!(
            err(r#"{"dim": 3, "optimizer": {"name": "Nope", "params": {}}}"#)
                .starts_with("optimizer:")
        );
        assert!(err(r#"{"dim": 3, "eviction": "fifo"}"#).contains("eviction"));
        assert!(err("[1]").starts_with("config: expected a JSON object"));
    }
}
