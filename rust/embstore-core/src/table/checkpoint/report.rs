//! The report of `python -m embstore inspect`: what a checkpoint holds and
//! whether every check a load makes holds, as text and as JSON. Built here,
//! next to the manifest, so that nothing outside the core reads its layout.

use crate::error::Result;
use crate::format::manifest::{FileEntry, NamedConfig};
use crate::table::checkpoint::load::verify;
use std::path::Path;

/// `v` as Python's `{:g}` would print a parameter (e.g. `0.001`, `1e-10`).
fn short(v: f64) -> String {
    if v != 0.0 && (v.abs() < 1e-4 || v.abs() >= 1e16) {
        let s = format!("{v:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    } else {
        format!("{v}")
    }
}

/// `n` with thousands separators (`1,000`).
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn named(c: &NamedConfig) -> String {
    let params: Vec<String> = c
        .params
        .iter()
        .map(|(k, v)| format!("{k}={}", short(*v)))
        .collect();
    format!("{}({})", c.name, params.join(", "))
}

/// What [`report`] found.
#[derive(Debug, Clone)]
pub struct Report {
    /// The human-readable report, one line per fact and per file.
    pub text: String,
    /// `{"manifest": ..., "files": [{"name", "rows", "bytes", "ok", "error"}]}`.
    pub json: String,
    /// Whether every file passed every check.
    pub whole: bool,
}

/// Checks every file of the checkpoint at `dir` (as [`verify`]) and
/// describes it.
///
/// # Errors
/// `Checkpoint` when the manifest itself is missing or damaged.
pub fn report(dir: &Path) -> Result<Report> {
    let (m, files) = verify(dir)?;
    let bad = files.iter().filter(|(_, e)| e.is_some()).count();
    let mut t = String::new();
    let opt = m.optimizer.as_ref().map_or("none".to_string(), named);
    t += &format!("format: {} version {} (id {})\n", m.format, m.version, m.id);
    t += &format!(
        "dim: {}  dtype: {}  rows: {}  step: {}\n",
        m.dim,
        m.dtype,
        thousands(m.rows),
        m.step
    );
    let names = if m.state_names.is_empty() {
        "-".to_string()
    } else {
        m.state_names.join(", ")
    };
    t += &format!(
        "optimizer: {opt}  state saved: {} ({} floats/row: {names})\n",
        if m.with_optimizer { "True" } else { "False" },
        m.state_len
    );
    t += &format!(
        "initializer: {}  seed: {}  saved from {} shards\n",
        named(&m.initializer),
        m.seed,
        m.num_shards
    );
    for (i, link) in m.chain.iter().enumerate() {
        let entries: Vec<&FileEntry> = link.files.iter().chain(link.removed.iter()).collect();
        let bytes: u64 = entries.iter().map(|e| e.bytes).sum();
        t += &format!(
            "link {i} ({}): {} files, {} bytes\n",
            link.kind,
            entries.len(),
            thousands(bytes)
        );
        for e in entries {
            let err = files
                .iter()
                .find(|(f, _)| f.name == e.name)
                .and_then(|(_, err)| err.as_deref());
            t += &format!(
                "  {}  {:>12} rows  {:>14} bytes  crc32c {:08x}  {}\n",
                e.name,
                thousands(e.rows),
                thousands(e.bytes),
                e.crc32c,
                err.map_or("ok".to_string(), |x| format!("BAD: {x}"))
            );
        }
    }
    t += &if bad == 0 {
        "checksums: all ok\n".to_string()
    } else {
        format!("checksums: {bad} of {} files damaged\n", files.len())
    };
    let json = serde_json::json!({
        "manifest": m,
        "files": files
            .iter()
            .map(|(f, err)| serde_json::json!({
                "name": f.name, "rows": f.rows, "bytes": f.bytes,
                "ok": err.is_none(), "error": err,
            }))
            .collect::<Vec<_>>(),
    });
    Ok(Report {
        text: t,
        json: serde_json::to_string_pretty(&json).expect("a report always serializes"),
        whole: bad == 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{sgd, table, temp_dir};

    #[test]
    fn numbers_print_as_python_would() {
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(thousands(999), "999");
        assert_eq!(short(0.001), "0.001");
        assert_eq!(short(1e-10), "1e-10");
        assert_eq!(short(0.0), "0");
        assert_eq!(short(2.5e-5), "2.5e-05");
    }

    #[test]
    fn a_report_names_what_is_held_and_what_is_damaged() {
        let dir = temp_dir("report");
        let t = table(2, 2, sgd(0.5));
        t.assign(&(0..1000).collect::<Vec<i64>>(), &[0.5; 2000])
            .unwrap();
        let m = t.save(&dir, false, true, None).unwrap().manifest;
        let r = report(&dir).unwrap();
        assert!(r.whole);
        assert!(r.text.contains("rows: 1,000"), "{}", r.text);
        assert!(r.text.contains("SGD(lr=0.5, weight_decay=0)"), "{}", r.text);
        assert!(r.text.ends_with("checksums: all ok\n"));
        let f = dir.join(&m.chain[0].files[0].name);
        let mut bytes = std::fs::read(&f).unwrap();
        bytes[0] ^= 1;
        std::fs::write(&f, bytes).unwrap();
        let r = report(&dir).unwrap();
        assert!(!r.whole);
        assert!(r.text.contains("BAD: "));
        let v: serde_json::Value = serde_json::from_str(&r.json).unwrap();
        assert_eq!(v["files"][0]["ok"], false);
    }
}
