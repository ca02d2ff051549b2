//! Every name, parameter and default the library accepts, in one place.
//!
//! The configuration parsers (`Optimizer::from_named`,
//! `Initializer::from_named`, `Admission::from_named`, the `from_name`s of
//! dtypes, evictions, combiners and partitions) read their names and
//! defaults from here, and the Python binding exports these lists
//! (`_core.vocabulary()`): the Python classes are declarations that one
//! test checks against this export, so a new parameter is one change here
//! plus one line in Python.

use std::collections::BTreeMap;

use crate::error::{Result, invalid};

/// One parameter of a named configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Param {
    /// As the Python class's field spells it.
    pub name: &'static str,
    /// Its default; `None` for a required parameter.
    pub default: Option<f64>,
    /// Whether it must be a whole number.
    pub integer: bool,
}

/// A named configuration (an optimizer, an initializer, an admission filter)
/// and its parameters, in the order of the Python class's fields.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Named {
    /// As the Python class (or the manifest, for admission filters) names it.
    pub name: &'static str,
    /// Its parameters.
    pub params: &'static [Param],
}

const fn req(name: &'static str) -> Param {
    Param {
        name,
        default: None,
        integer: false,
    }
}

const fn opt(name: &'static str, default: f64) -> Param {
    Param {
        name,
        default: Some(default),
        integer: false,
    }
}

const fn int(name: &'static str, default: Option<f64>) -> Param {
    Param {
        name,
        default,
        integer: true,
    }
}

const WEIGHT_DECAY: Param = opt("weight_decay", 0.0);

/// Adam's and AdamW's parameters: the same but for weight_decay's default.
const fn adam(weight_decay: f64) -> [Param; 5] {
    [
        opt("lr", 1e-3),
        opt("beta1", 0.9),
        opt("beta2", 0.999),
        opt("eps", 1e-8),
        opt("weight_decay", weight_decay),
    ]
}

/// The optimizers (see [`crate::optim::Optimizer`]).
pub const OPTIMIZERS: &[Named] = &[
    Named {
        name: "SGD",
        params: &[req("lr"), WEIGHT_DECAY],
    },
    Named {
        name: "Adagrad",
        params: &[
            req("lr"),
            opt("initial_accumulator_value", 0.0),
            opt("eps", 1e-10),
            WEIGHT_DECAY,
        ],
    },
    Named {
        name: "RowWiseAdagrad",
        params: &[req("lr"), opt("eps", 1e-10), WEIGHT_DECAY],
    },
    Named {
        name: "Adam",
        params: &adam(0.0),
    },
    Named {
        name: "AdamW",
        params: &adam(0.01),
    },
    Named {
        name: "Ftrl",
        params: &[
            req("lr"),
            opt("l1", 0.0),
            opt("l2", 0.0),
            opt("beta", 0.0),
            opt("initial_accumulator_value", 0.1),
            WEIGHT_DECAY,
        ],
    },
];

/// The initializers (see [`crate::init::Initializer`]).
pub const INITIALIZERS: &[Named] = &[
    Named {
        name: "Uniform",
        params: &[opt("low", -0.05), opt("high", 0.05)],
    },
    Named {
        name: "Normal",
        params: &[opt("mean", 0.0), opt("std", 1.0)],
    },
    Named {
        name: "TruncatedNormal",
        params: &[opt("mean", 0.0), opt("std", 1.0)],
    },
    Named {
        name: "Zeros",
        params: &[],
    },
    Named {
        name: "Constant",
        params: &[opt("value", 0.0)],
    },
];

/// The admission filters (see [`crate::policy::Admission`]); "always" is
/// the table without a filter.
pub const ADMISSIONS: &[Named] = &[
    Named {
        name: "count",
        params: &[
            int("min_count", None),
            int("width", Some((1u64 << 23) as f64)),
            int("depth", Some(4.0)),
        ],
    },
    Named {
        name: "probability",
        params: &[req("p")],
    },
];

/// Row storage dtypes.
pub const DTYPES: &[&str] = &["float32", "float16", "bfloat16", "int8"];
/// Capacity eviction orders (and a DeviceCache's replacement policies).
pub const EVICTIONS: &[&str] = &["lfu", "lru"];
/// Pooling combiners.
pub const COMBINERS: &[&str] = &["sum", "mean", "sqrtn"];
/// Key-to-rank partitions of a ShardedTable.
pub const PARTITIONS: &[&str] = &["hash", "mod", "div"];

/// `"a", "b" or "c"`: the names for an error message.
pub fn one_of(names: &[&str]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("{n:?}")).collect();
    match quoted.split_last() {
        None => String::new(),
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
    }
}

/// The configuration of `kind` (the argument's name) named `name`.
///
/// # Errors
/// `InvalidArgument` naming `kind` and the names it accepts.
pub fn find(kind: &'static str, list: &'static [Named], name: &str) -> Result<&'static Named> {
    list.iter().find(|n| n.name == name).ok_or_else(|| {
        let names: Vec<&str> = list.iter().map(|n| n.name).collect();
        invalid(
            kind,
            format!("expected one of {}; got {name:?}", one_of(&names)),
        )
    })
}

/// Checks that `name` is one of `names`.
///
/// # Errors
/// `InvalidArgument` naming `arg` and the names it accepts.
pub fn check_name(arg: &'static str, names: &[&str], name: &str) -> Result<()> {
    if names.contains(&name) {
        Ok(())
    } else {
        Err(invalid(
            arg,
            format!("expected one of {}; got {name:?}", one_of(names)),
        ))
    }
}

impl Named {
    /// Parameter `name` from `p`, or its default.
    ///
    /// # Errors
    /// A required parameter that `p` lacks, or a fractional value of an
    /// integer parameter.
    ///
    /// # Panics
    /// If `name` is not one of this configuration's parameters (a bug).
    pub fn get(&self, p: &BTreeMap<String, f64>, name: &'static str) -> Result<f64> {
        let spec = self
            .params
            .iter()
            .find(|q| q.name == name)
            .unwrap_or_else(|| panic!("{} has no parameter {name}", self.name));
        let v = p
            .get(name)
            .copied()
            .or(spec.default)
            .ok_or_else(|| invalid(name, "missing parameter"))?;
        if spec.integer && v.fract() != 0.0 {
            return Err(invalid(name, format!("expected an integer, got {v}")));
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::Initializer;
    use crate::optim::Optimizer;
    use crate::partition::Partition;
    use crate::policy::{Admission, Eviction, RowFormat};
    use crate::table::Combiner;

    fn defaults(n: &Named) -> BTreeMap<String, f64> {
        // Required parameters get a value every configuration accepts.
        n.params
            .iter()
            .map(|q| (q.name.to_string(), q.default.unwrap_or(0.5)))
            .collect()
    }

    #[test]
    fn every_named_configuration_parses_and_names_its_parameters_back() {
        for n in OPTIMIZERS {
            let o = Optimizer::from_named(n.name, &defaults(n)).unwrap();
            let (name, p) = o.to_named();
            assert_eq!((name, p), (n.name, defaults(n)));
        }
        for n in INITIALIZERS {
            let i = Initializer::from_named(n.name, &defaults(n)).unwrap();
            assert_eq!(i.to_named(), (n.name, defaults(n)));
        }
        for n in ADMISSIONS {
            let mut p = defaults(n);
            p.insert("min_count".into(), 2.0);
            p.retain(|k, _| n.params.iter().any(|q| q.name == k));
            let a = Admission::from_named(n.name, &p.clone().into_iter().collect::<Vec<_>>());
            let (name, back) = a.unwrap().to_named();
            assert_eq!(name, n.name);
            assert_eq!(back.into_iter().collect::<BTreeMap<_, _>>(), p);
        }
    }

    #[test]
    fn every_listed_name_parses_and_others_do_not() {
        for d in DTYPES {
            assert_eq!(RowFormat::from_name(d).unwrap().name(), *d);
        }
        for e in EVICTIONS {
            assert_eq!(Eviction::from_name(e).unwrap().name(), *e);
        }
        for c in COMBINERS {
            Combiner::from_name(c).unwrap();
        }
        for p in PARTITIONS {
            Partition::from_name(p, Some(10)).unwrap();
        }
        let e = RowFormat::from_name("float64").unwrap_err().to_string();
        assert!(
            e.contains("\"float32\", \"float16\", \"bfloat16\" or \"int8\""),
            "{e}"
        );
        assert!(Combiner::from_name("max").is_err());
        assert!(find("optimizer", OPTIMIZERS, "Lamb").is_err());
    }

    #[test]
    fn integer_parameters_refuse_fractions() {
        let count = find("admission", ADMISSIONS, "count").unwrap();
        let p: BTreeMap<String, f64> = [("min_count".to_string(), 1.5)].into();
        assert!(count.get(&p, "min_count").is_err());
        assert_eq!(count.get(&p, "depth").unwrap(), 4.0);
    }
}
