//! One tracing episode: the memtrace binary itself is started as a child
//! (`memtrace --pid PID --duration WINDOW --format json --record ...`), so
//! the watcher never holds a probe and a tracer failure cannot take it down.
//! When the child ends, the recorded trace is rendered offline to the
//! one-page HTML and to pprof (`memtrace report`), and `episode.json` says
//! why the episode started, what it found and how much of the metric's
//! growth that explains.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::monitor::series::Family;
use crate::monitor::units::format_value;
use crate::watch::WatchError;

/// The report the tracer writes in the episode directory.
pub const REPORT_JSON: &str = "report.json";
/// The recorded event stream (deleted after rendering unless kept).
pub const TRACE_FILE: &str = "trace.jsonl";
/// The summary the watcher writes.
pub const EPISODE_JSON: &str = "episode.json";

/// What an episode is to do.
pub struct Plan<'a> {
    pub exe: &'a Path,
    pub pid: u32,
    pub window: Duration,
    pub dir: PathBuf,
    pub top: usize,
    /// Extra tracer options (after `--` on the watch command line).
    pub tracer_args: &'a [String],
}

/// A tracer child at work.
pub struct Running {
    child: Child,
    pub number: u64,
    pub dir: PathBuf,
    pub pid: u32,
    pub started: Instant,
    pub started_unix_ms: u64,
    interrupted: bool,
}

/// Starts the tracer for episode `number`.
pub fn start(plan: &Plan<'_>, number: u64, now_unix_ms: u64) -> Result<Running, WatchError> {
    use std::os::unix::fs::DirBuilderExt;
    use std::os::unix::process::CommandExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&plan.dir)
        .map_err(|source| WatchError::Io {
            path: plan.dir.clone(),
            source,
        })?;
    let log_path = plan.dir.join("tracer.log");
    let log = File::create(&log_path).map_err(|source| WatchError::Io {
        path: log_path,
        source,
    })?;
    let window = format!("{}ms", plan.window.as_millis());
    let mut cmd = Command::new(plan.exe);
    cmd.arg("--pid")
        .arg(plan.pid.to_string())
        .args(["--duration", &window, "--format", "json", "--top"])
        .arg(plan.top.to_string())
        .arg("--output")
        .arg(plan.dir.join(REPORT_JSON))
        .arg("--record")
        .arg(plan.dir.join(TRACE_FILE))
        .args(plan.tracer_args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log));
    // SAFETY: the closure runs in the child between fork and exec and only
    // calls prctl, which is async-signal-safe: if the watcher dies, the
    // tracer is interrupted and detaches instead of tracing on unwatched.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGINT as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|source| WatchError::Io {
        path: plan.exe.to_path_buf(),
        source,
    })?;
    Ok(Running {
        child,
        number,
        dir: plan.dir.clone(),
        pid: plan.pid,
        started: Instant::now(),
        started_unix_ms: now_unix_ms,
        interrupted: false,
    })
}

impl Running {
    /// The child's exit status once it has ended.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        match self.child.try_wait() {
            Ok(status) => status,
            Err(_) => {
                let _ = self.child.kill();
                self.child.wait().ok()
            }
        }
    }

    /// Asks the tracer to end now and write its report (SIGINT, once).
    pub fn interrupt(&mut self) {
        if !self.interrupted {
            self.interrupted = true;
            if let Ok(pid) = i32::try_from(self.child.id()) {
                // SAFETY: kill with our own child's pid and a valid signal.
                unsafe { libc::kill(pid, libc::SIGINT) };
            }
        }
    }

    /// Waits for the tracer to end, at most `limit`, then kills it.
    pub fn wait_bounded(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        self.child.wait().ok()
    }
}

/// An episode in flight, with what is needed to summarize it.
pub struct InFlight {
    pub run: Running,
    pub why: Why,
    pub family: Family,
    /// Metric key, for the value at attach and detach.
    pub key: (Family, String),
    /// When the tracer said it was tracing (watcher's axis, to a tick).
    pub attached_t: Option<f64>,
}

/// Why an episode started.
#[derive(Clone, Debug, Serialize)]
pub struct Why {
    pub metric: String,
    pub family: String,
    /// The monitor's label (`growth`, `slow-growth`, `jump`).
    pub label: String,
    pub slope_per_hour: f64,
    /// Change of the trend over the judged window.
    pub change: f64,
    /// When the growth began, as far as the judged window shows.
    pub since_unix_ms: u64,
    pub triggered_unix_ms: u64,
    pub value: f64,
    /// Other metrics that fired at the same moment.
    pub also: Vec<String>,
    /// The same in words.
    pub text: String,
}

/// One site the episode found holding memory allocated during its window.
#[derive(Clone, Debug, Serialize)]
pub struct Found {
    pub function: String,
    pub location: Option<String>,
    pub allocator: String,
    pub memory: String,
    pub live_bytes: u64,
    pub live_count: u64,
    pub growth_bytes_per_s: f64,
    pub trend: String,
}

/// The metric before and after the traced window.
#[derive(Clone, Debug, Serialize)]
pub struct Change {
    pub metric: String,
    pub bytes: bool,
    pub at_attach: Option<f64>,
    pub at_detach: Option<f64>,
}

/// What `episode.json` holds.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub format: &'static str,
    pub number: u64,
    pub pid: u32,
    pub why: Why,
    pub started_unix_ms: u64,
    /// How long the tracer was attached (the report's duration).
    pub traced_ms: u64,
    /// `done`, or `failed` with the tracer's exit status.
    pub outcome: String,
    pub tracer_status: String,
    pub found: Vec<Found>,
    pub found_bytes: u64,
    pub metric_growth: Option<f64>,
    /// Found bytes over the metric's growth while traced.
    pub explained_ratio: Option<f64>,
    pub explanation: String,
    /// The tracer's own reconciliation with RssAnon, in words.
    pub tracer_reconciliation: Option<String>,
    /// Files of the episode, relative to its directory.
    pub files: Vec<String>,
    pub notes: Vec<String>,
    /// With `--pyroscope`: the tracer's push of the report (its report's
    /// `push`: endpoint, sent, failed, dropped, retries, last_error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub push: Option<Value>,
    /// With `--otlp-profiles`: the tracer's export of the report (its
    /// report's `otlp`, the same fields).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp: Option<Value>,
    /// With `--leak-check`: the tracer's check at the episode's end (its
    /// report's `leak_check`: the four categories, pause, scanned bytes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leak_check: Option<Value>,
}

/// Whether a report site's memory is what `family`/`metric` measures.
fn counts_for(family: Family, metric: &str, memory: &str) -> bool {
    match family {
        Family::Gpu => matches!(memory, "device" | "managed"),
        _ if metric == "fds" || metric == "threads" => memory == "handle",
        _ => memory == "host",
    }
}

/// The sites of a tracer report that hold memory (already ranked by it).
pub fn found_sites(report: &Value, top: usize) -> Vec<Found> {
    let Some(sites) = report["sites"].as_array() else {
        return Vec::new();
    };
    sites
        .iter()
        .filter(|s| s["live_bytes"].as_u64().unwrap_or(0) > 0)
        .filter(|s| !s["internal"].as_bool().unwrap_or(false))
        .take(top)
        .map(|s| {
            let frame = &s["frames"][0];
            let function = frame["symbol"]
                .as_str()
                .map(str::to_string)
                .or_else(|| frame["addr"].as_str().map(|a| format!("[{a}]")))
                .unwrap_or_else(|| "[no stack]".to_string());
            let location = match (frame["file"].as_str(), frame["line"].as_u64()) {
                (Some(f), Some(l)) => Some(format!("{f}:{l}")),
                (Some(f), None) => Some(f.to_string()),
                _ => frame["module"].as_str().map(str::to_string),
            };
            Found {
                function,
                location,
                allocator: s["allocator"].as_str().unwrap_or("?").to_string(),
                memory: s["memory"].as_str().unwrap_or("?").to_string(),
                live_bytes: s["live_bytes"].as_u64().unwrap_or(0),
                live_count: s["live_count"].as_u64().unwrap_or(0),
                growth_bytes_per_s: s["growth_bytes_per_s"].as_f64().unwrap_or(0.0),
                trend: s["trend"].as_str().unwrap_or("?").to_string(),
            }
        })
        .collect()
}

/// The reconciliation in words: how much of the metric's growth while
/// traced the sites found explain.
pub fn explain(
    why: &Why,
    family: Family,
    change: &Change,
    found: &[Found],
    traced_ms: u64,
) -> (u64, Option<f64>, Option<f64>, String) {
    let relevant: Vec<&Found> = found
        .iter()
        .filter(|f| counts_for(family, &why.metric, &f.memory))
        .collect();
    let held: u64 = relevant.iter().map(|f| f.live_bytes).sum();
    let count: u64 = relevant.iter().map(|f| f.live_count).sum();
    let fmt = |v: f64| format_value(v, change.bytes);
    let secs = traced_ms as f64 / 1000.0;
    let held_text = if change.bytes {
        format!("{} in {count} blocks", fmt(held as f64))
    } else {
        format!("{count} handles")
    };
    let subject = match relevant.len() {
        0 => "no site found".to_string(),
        1 => "the site found holds".to_string(),
        n => format!("the {n} sites found hold"),
    };
    let amount = if change.bytes {
        held as f64
    } else {
        count as f64
    };
    let growth = match (change.at_attach, change.at_detach) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    match growth {
        Some(g) if g > 0.0 => {
            let ratio = amount / g;
            let text = if relevant.is_empty() {
                format!(
                    "{} grew {} while traced ({secs:.1}s); no traced allocation made then is still live: the growth is outside what memtrace probes (another allocator, file mappings, or the kernel)",
                    change.metric,
                    fmt(g)
                )
            } else {
                format!(
                    "{} grew {} while traced ({secs:.1}s); {subject} {held_text} allocated in that time: they explain {:.0}% of it",
                    change.metric,
                    fmt(g),
                    ratio * 100.0
                )
            };
            (held, growth, Some(ratio), text)
        }
        Some(g) => (
            held,
            growth,
            None,
            format!(
                "{} did not grow while traced ({secs:.1}s, change {}); {subject}{} {held_text} allocated in that time",
                change.metric,
                fmt(g),
                if relevant.is_empty() { ";" } else { "" }
            ),
        ),
        None => (
            held,
            None,
            None,
            format!(
                "{} was not sampled across the whole window ({secs:.1}s); {subject} {held_text} allocated in that time",
                change.metric
            ),
        ),
    }
}

/// Renders the recorded trace offline: `report.html` and `profile.pb.gz`.
/// Returns the files written and a note per failure.
fn render(exe: &Path, dir: &Path, keep_trace: bool) -> (Vec<String>, Vec<String>) {
    let trace = dir.join(TRACE_FILE);
    let mut files = Vec::new();
    let mut notes = Vec::new();
    if !trace.exists() {
        notes.push("the tracer left no recording: no HTML or pprof".to_string());
        return (files, notes);
    }
    for (format, name) in [("html", "report.html"), ("pprof", "profile.pb.gz")] {
        let out = Command::new(exe)
            .arg("report")
            .arg(&trace)
            .args(["--format", format, "--output"])
            .arg(dir.join(name))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output();
        match out {
            Ok(o) if o.status.success() => files.push(name.to_string()),
            Ok(o) => notes.push(format!(
                "{format}: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => notes.push(format!("{format}: {e}")),
        }
    }
    if keep_trace {
        files.push(TRACE_FILE.to_string());
    } else {
        let _ = std::fs::remove_file(&trace);
    }
    (files, notes)
}

/// Everything [`finish`] needs besides the episode itself.
pub struct Finish<'a> {
    pub exe: &'a Path,
    pub why: Why,
    pub family: Family,
    pub change: Change,
    pub status: Option<ExitStatus>,
    pub top: usize,
    pub keep_trace: bool,
}

/// Reads the tracer's report, renders HTML and pprof, writes `episode.json`.
pub fn finish(run: &Running, input: Finish<'_>) -> Result<Summary, WatchError> {
    let report_path = run.dir.join(REPORT_JSON);
    let report: Option<Value> = std::fs::read(&report_path)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok());
    let status_text = match input.status {
        Some(s) => s.to_string(),
        None => "unknown".to_string(),
    };
    let mut files = Vec::new();
    let mut notes = Vec::new();
    let (found, traced_ms, reconciliation) = match &report {
        Some(r) => {
            files.push(REPORT_JSON.to_string());
            (
                found_sites(r, input.top),
                r["duration_ms"].as_u64().unwrap_or(0),
                r["reconciliation"]["note"].as_str().map(str::to_string),
            )
        }
        None => {
            notes.push(format!(
                "the tracer wrote no report ({status_text}); see tracer.log"
            ));
            (Vec::new(), 0, None)
        }
    };
    files.push("tracer.log".to_string());
    let (rendered, render_notes) = render(input.exe, &run.dir, input.keep_trace);
    files.extend(rendered);
    notes.extend(render_notes);
    let (found_bytes, metric_growth, explained_ratio, explanation) =
        explain(&input.why, input.family, &input.change, &found, traced_ms);
    let push = report.as_ref().and_then(|r| r.get("push")).cloned();
    let otlp = report.as_ref().and_then(|r| r.get("otlp")).cloned();
    let leak_check = report.as_ref().and_then(|r| r.get("leak_check")).cloned();
    if let Some(check) = &leak_check {
        if check["ran"] == Value::Bool(false) {
            notes.push(format!(
                "the leak check did not run: {}",
                check["reason"].as_str().unwrap_or("no reason given")
            ));
        }
    }
    for pushed in [&push, &otlp].into_iter().flatten() {
        let lost = pushed["failed"].as_u64().unwrap_or(0) + pushed["dropped"].as_u64().unwrap_or(0);
        if lost > 0 {
            notes.push(format!(
                "the report was not pushed to {}: {}",
                pushed["endpoint"].as_str().unwrap_or("the profile store"),
                pushed["last_error"].as_str().unwrap_or("unknown error")
            ));
        }
    }
    let summary = Summary {
        format: "memtrace-watch-episode/1",
        number: run.number,
        pid: run.pid,
        why: input.why,
        started_unix_ms: run.started_unix_ms,
        traced_ms,
        outcome: if report.is_some() { "done" } else { "failed" }.to_string(),
        tracer_status: status_text,
        found,
        found_bytes,
        metric_growth,
        explained_ratio,
        explanation,
        tracer_reconciliation: reconciliation,
        files,
        notes,
        push,
        otlp,
        leak_check,
    };
    crate::watch::state::write_json(&run.dir.join(EPISODE_JSON), &summary)?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn why(metric: &str) -> Why {
        Why {
            metric: metric.to_string(),
            family: "process".to_string(),
            label: "growth".to_string(),
            slope_per_hour: 1.0,
            change: 1.0,
            since_unix_ms: 0,
            triggered_unix_ms: 0,
            value: 0.0,
            also: Vec::new(),
            text: String::new(),
        }
    }

    fn report() -> Value {
        serde_json::json!({
            "duration_ms": 10000,
            "sites": [
                {"live_bytes": 4194304, "live_count": 64, "allocator": "libc", "memory": "host",
                 "internal": false, "trend": "growing", "growth_bytes_per_s": 400000.0,
                 "frames": [{"symbol": "leak_here", "file": "leak.c", "line": 12}]},
                {"live_bytes": 1048576, "live_count": 1, "allocator": "cuda", "memory": "device",
                 "internal": false, "trend": "new", "growth_bytes_per_s": 0.0,
                 "frames": [{"symbol": "gpu_site", "module": "/x/prog"}]},
                {"live_bytes": 4096, "live_count": 1, "allocator": "libc", "memory": "host",
                 "internal": true, "trend": "stable", "frames": []},
                {"live_bytes": 0, "live_count": 0, "allocator": "libc", "memory": "host",
                 "internal": false, "trend": "stable", "frames": []}
            ]
        })
    }

    #[test]
    fn sites_holding_memory_are_found_in_rank_order() {
        let found = found_sites(&report(), 10);
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].function, "leak_here");
        assert_eq!(found[0].location.as_deref(), Some("leak.c:12"));
        assert_eq!(found[1].location.as_deref(), Some("/x/prog"));
        assert_eq!(found_sites(&report(), 1).len(), 1);
    }

    #[test]
    fn the_explanation_counts_the_metric_kind_only() {
        let found = found_sites(&report(), 10);
        let change = Change {
            metric: "RssAnon".into(),
            bytes: true,
            at_attach: Some(100.0 * 1048576.0),
            at_detach: Some(105.0 * 1048576.0),
        };
        let (held, growth, ratio, text) =
            explain(&why("RssAnon"), Family::Process, &change, &found, 10_000);
        assert_eq!(held, 4_194_304);
        assert_eq!(growth, Some(5.0 * 1048576.0));
        assert!((ratio.unwrap_or(0.0) - 0.8).abs() < 1e-9);
        assert!(text.contains("explain 80%"), "{text}");
        let (held, _, ratio, text) =
            explain(&why("nvml.used"), Family::Gpu, &change, &found, 10_000);
        assert_eq!(held, 1_048_576);
        assert!((ratio.unwrap_or(0.0) - 0.2).abs() < 1e-9, "{text}");
    }

    #[test]
    fn no_growth_and_no_samples_are_said_so() {
        let change = Change {
            metric: "RssAnon".into(),
            bytes: true,
            at_attach: Some(10.0),
            at_detach: Some(10.0),
        };
        let (_, _, ratio, text) = explain(&why("RssAnon"), Family::Process, &change, &[], 1000);
        assert_eq!(ratio, None);
        assert!(text.contains("did not grow"), "{text}");
        let change = Change {
            at_attach: None,
            ..change
        };
        let (_, _, _, text) = explain(&why("RssAnon"), Family::Process, &change, &[], 1000);
        assert!(text.contains("not sampled"), "{text}");
    }
}
