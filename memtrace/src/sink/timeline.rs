//! Timeline sink: live memory over time as Chrome trace-event JSON, which the
//! Perfetto UI and chrome://tracing open. A `live bytes` and a `live blocks`
//! counter per timeline sample (one series per allocator and memory), an
//! instant marker at each interval boundary, names for the target's process
//! and track, and a final counter at the end of the trace from the totals.
//! With `--sample-rate N` the counters are estimates (the sample times N) and
//! `otherData` carries `sample_rate` and a `note` saying so.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;

use serde_json::{json, Map, Value};

use super::{sample_rate, scaled, scaling_note, Sink};
use crate::report::Report;

pub struct TimelineSink;

impl Sink for TimelineSink {
    fn write(&self, report: &Report, interim: bool, out: &mut dyn Write) -> std::io::Result<()> {
        if interim {
            return Ok(());
        }
        serde_json::to_writer(&mut *out, &trace(report))?;
        writeln!(out)
    }
}

/// Live bytes and blocks per series at one moment.
type Point = BTreeMap<String, (u64, u64)>;

/// The trace document of one report.
pub(super) fn trace(report: &Report) -> Value {
    let pid = report.target.pid;
    // The one track the counters live on.
    let tid = pid;
    let mut points: BTreeMap<u64, Point> = BTreeMap::new();
    for sample in &report.timeline {
        let point = points.entry(sample.t_ms).or_default();
        let entry = point
            .entry(series(sample.allocator.name(), sample.memory.name()))
            .or_default();
        entry.0 += scaled(report, sample.live_bytes);
        entry.1 += scaled(report, sample.live_count);
    }
    let boundaries: Vec<u64> = points.keys().copied().collect();
    let last = points.entry(report.duration_ms).or_default();
    last.clear();
    for total in &report.totals {
        let entry = last
            .entry(series(total.allocator.name(), total.memory.name()))
            .or_default();
        entry.0 += scaled(report, total.live_bytes);
        entry.1 += scaled(report, total.live_count);
    }
    // Every counter event names every series, so a series that drops out
    // reads 0 rather than keeping its last value.
    let all: BTreeSet<String> = points.values().flat_map(|p| p.keys().cloned()).collect();

    let mut events = vec![
        json!({
            "name": "process_name", "ph": "M", "pid": pid, "tid": tid,
            "args": {"name": format!(
                "{} (pid {pid}{})",
                report.target.comm,
                report.target.placement.summary().map(|s| format!(", {s}")).unwrap_or_default()
            )},
        }),
        json!({
            "name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
            "args": {"name": "memtrace: live memory"},
        }),
    ];
    for (t_ms, point) in &points {
        let ts = t_ms.saturating_mul(1000);
        let mut bytes = Map::new();
        let mut blocks = Map::new();
        for name in &all {
            let (b, n) = point.get(name).copied().unwrap_or((0, 0));
            bytes.insert(name.clone(), b.into());
            blocks.insert(name.clone(), n.into());
        }
        for (counter, args) in [("live bytes", bytes), ("live blocks", blocks)] {
            events.push(json!({
                "name": counter, "cat": "memtrace", "ph": "C", "ts": ts,
                "pid": pid, "tid": tid, "args": args,
            }));
        }
    }
    for (index, t_ms) in boundaries.iter().enumerate() {
        events.push(json!({
            "name": "interval", "cat": "memtrace", "ph": "i", "s": "g",
            "ts": t_ms.saturating_mul(1000), "pid": pid, "tid": tid,
            "args": {"index": index + 1},
        }));
    }
    events.push(json!({
        "name": "end of trace", "cat": "memtrace", "ph": "i", "s": "g",
        "ts": report.duration_ms.saturating_mul(1000), "pid": pid, "tid": tid,
        "args": {"complete": report.complete},
    }));
    let mut other = json!({
        "tool": "memtrace",
        "pid": pid.to_string(),
        "comm": report.target.comm,
        "exe": report.target.exe,
        "complete": report.complete.to_string(),
    });
    if let Some(summary) = report.target.placement.summary() {
        other["placement"] = summary.into();
    }
    if let Some(note) = scaling_note(report) {
        other["sample_rate"] = sample_rate(report).to_string().into();
        other["note"] = note.into();
    }
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": other,
    })
}

/// A counter series name, e.g. `libc host`.
fn series(allocator: &str, memory: &str) -> String {
    format!("{allocator} {memory}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::fixture;

    fn parsed() -> Value {
        let mut out = Vec::new();
        TimelineSink
            .write(&fixture::report(), false, &mut out)
            .expect("writes");
        serde_json::from_slice(&out).expect("valid JSON")
    }

    fn events<'a>(doc: &'a Value, ph: &str, name: &str) -> Vec<&'a Value> {
        doc["traceEvents"]
            .as_array()
            .expect("traceEvents")
            .iter()
            .filter(|e| e["ph"] == ph && e["name"] == name)
            .collect()
    }

    #[test]
    fn timeline_counters_at_sample_times_and_the_end() {
        let doc = parsed();
        assert_eq!(doc["displayTimeUnit"], "ms");
        let counters = events(&doc, "C", "live bytes");
        let times: Vec<u64> = counters.iter().filter_map(|e| e["ts"].as_u64()).collect();
        assert_eq!(times, [1_000_000, 2_000_000, 2_500_000]);
        assert_eq!(
            counters[0]["args"],
            json!({"libc host": 100, "cuda device": 0})
        );
        assert_eq!(
            counters[1]["args"],
            json!({"libc host": 350, "cuda device": 4096})
        );
        assert_eq!(
            counters[2]["args"],
            json!({"libc host": 350, "cuda device": 4096})
        );
        let blocks = events(&doc, "C", "live blocks");
        assert_eq!(blocks[1]["args"]["libc host"], 4);
        for counter in counters {
            assert_eq!(counter["pid"], 4242);
        }
    }

    #[test]
    fn timeline_of_a_sampled_report_counts_estimates_and_says_so() {
        let mut report = fixture::report();
        report.settings.sample_rate = 3;
        let doc = trace(&report);
        let counters = events(&doc, "C", "live bytes");
        assert_eq!(
            counters[1]["args"],
            json!({"libc host": 1050, "cuda device": 12288})
        );
        assert_eq!(counters[2]["args"]["libc host"], 1050);
        assert_eq!(events(&doc, "C", "live blocks")[1]["args"]["libc host"], 12);
        assert_eq!(doc["otherData"]["sample_rate"], "3");
        assert!(doc["otherData"]["note"]
            .as_str()
            .is_some_and(|n| n.contains("scaled by 3")));
        assert!(parsed()["otherData"].get("note").is_none());
    }

    #[test]
    fn timeline_marks_intervals_and_names_the_process() {
        let doc = parsed();
        let marks = events(&doc, "i", "interval");
        let times: Vec<u64> = marks.iter().filter_map(|e| e["ts"].as_u64()).collect();
        assert_eq!(times, [1_000_000, 2_000_000]);
        assert!(marks.iter().all(|m| m["s"] == "g"));
        let process = events(&doc, "M", "process_name");
        assert_eq!(process[0]["args"]["name"], "app (pid 4242)");
        assert_eq!(events(&doc, "M", "thread_name").len(), 1);
        assert_eq!(events(&doc, "i", "end of trace")[0]["ts"], 2_500_000);
    }

    #[test]
    fn timeline_skips_interim_reports() {
        let mut out = Vec::new();
        TimelineSink
            .write(&fixture::report(), true, &mut out)
            .expect("writes");
        assert!(out.is_empty());
    }
}
