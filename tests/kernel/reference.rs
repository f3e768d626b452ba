//! The guide's JSON reference (docs/src/reference/json.md, generated from the
//! serialized types by `memtrace generate-docs`) names every key that real
//! reports have: a key the schema walk misses (an untyped value, a custom
//! serializer) fails here.

use std::collections::HashMap;

use serde_json::Value;

use super::support::*;

/// The reference's rows: key path -> type column.
fn reference_rows() -> HashMap<String, String> {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/reference/json.md");
    let text = std::fs::read_to_string(&path).expect("docs/src/reference/json.md");
    text.lines()
        .filter_map(|line| {
            let mut cells = line.strip_prefix("| `")?.splitn(2, "` | ");
            let key = cells.next()?.to_string();
            let kind = cells.next()?.split(" | ").next()?.to_string();
            Some((key, kind))
        })
        .collect()
}

/// Every object key under `value` at `path` that has no row.
fn missing_keys(value: &Value, path: &str, rows: &HashMap<String, String>, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                let key_path = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match rows.get(&key_path) {
                    None => out.push(key_path),
                    Some(kind) if kind.starts_with("map of") => {
                        if let Value::Object(entries) = child {
                            for entry in entries.values() {
                                missing_keys(entry, &format!("{key_path}.*"), rows, out);
                            }
                        }
                    }
                    Some(_) => missing_keys(child, &key_path, rows, out),
                }
            }
        }
        Value::Array(items) => {
            for item in items {
                missing_keys(item, &format!("{path}[]"), rows, out);
            }
        }
        _ => {}
    }
}

#[test]
fn every_key_of_real_reports_is_in_the_json_reference() {
    if !privileged() {
        return;
    }
    let rows = reference_rows();
    assert!(rows.len() > 100, "the reference has {} rows", rows.len());
    let demo = fixture("leaky_demo");
    // Launch mode: the leak check at exit, patterns, a timeline.
    let out = memtrace(&[
        "--format",
        "json",
        "--interval",
        "200ms",
        "--",
        demo.to_str().expect("utf8"),
        "40",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // One JSON line per interval: the last is the final report.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout
        .lines()
        .rfind(|l| !l.trim().is_empty())
        .expect("a report");
    let report: Value = serde_json::from_str(last).expect("the final report's JSON");
    assert_eq!(report["interim"], Value::Bool(false), "the final report");
    assert!(report["leak_check"].is_object(), "a leak check ran");
    let mut missing = Vec::new();
    missing_keys(&report, "", &rows, &mut missing);
    let doctor = memtrace(&["doctor", "--format", "json"]);
    let doctor: Value = serde_json::from_slice(&doctor.stdout).expect("the doctor's JSON");
    missing_keys(&doctor, "", &rows, &mut missing);
    missing.sort();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "keys of real reports not in docs/src/reference/json.md: {missing:?}"
    );
}
