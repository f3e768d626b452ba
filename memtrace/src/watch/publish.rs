//! What the watch shows of itself: its phase, the heartbeat file
//! (`heartbeat.json`) and the Prometheus text (`--prometheus`), served from
//! a thread of its own.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;

use crate::monitor::series::{Family, Unit};
use crate::monitor::verdict::Label;
use crate::watch::{say, WatchError};

/// The watch's phase, as the heartbeat and Prometheus show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    WaitingForTarget,
    Warmup,
    Watching,
    Tracing,
    Holding,
}

impl Phase {
    pub const ALL: [Phase; 5] = [
        Phase::WaitingForTarget,
        Phase::Warmup,
        Phase::Watching,
        Phase::Tracing,
        Phase::Holding,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Phase::WaitingForTarget => "waiting-for-target",
            Phase::Warmup => "warmup",
            Phase::Watching => "watching",
            Phase::Tracing => "tracing",
            Phase::Holding => "holding",
        }
    }
}

/// What the heartbeat says about one metric.
#[derive(Clone, Debug, Serialize)]
pub struct MetricView {
    /// The process the figure is of.
    pub pid: u32,
    pub family: Family,
    pub metric: String,
    pub unit: Unit,
    pub value: f64,
    pub label: Option<Label>,
    pub slope_per_hour: f64,
    pub triggers: bool,
}

/// A process watched and where it lives (its container, its pod), for the
/// heartbeat (`processes[]`) and Prometheus (`memtrace_watch_process_info`).
#[derive(Clone, Debug, Serialize)]
pub struct WatchedProcess {
    pub pid: u32,
    #[serde(flatten)]
    pub placement: crate::tracee::container::Placement,
}

/// The last episode, for the heartbeat and Prometheus.
#[derive(Clone, Debug, Serialize)]
pub struct LastEpisode {
    pub number: u64,
    pub dir: String,
    pub pid: u32,
    pub metric: String,
    pub explanation: String,
    pub top: Vec<(String, u64)>,
}

/// The heartbeat file.
#[derive(Serialize)]
pub struct Heartbeat<'a> {
    pub format: &'static str,
    pub unix_ms: u64,
    pub watching_since_unix_ms: u64,
    pub phase: Phase,
    pub target: String,
    /// The lowest pid watched (the only one for --pid and --name).
    pub pid: Option<u32>,
    /// Every pid watched.
    pub pids: Vec<u32>,
    /// Every process watched, with its container and pod.
    pub processes: Vec<WatchedProcess>,
    pub restarts_seen: u64,
    pub dry_run: bool,
    pub metrics: &'a [MetricView],
    pub episodes_total: u64,
    pub episodes_this_run: u64,
    pub would_trace: u64,
    pub duty_used_ms: u64,
    pub duty_cap_ms: u64,
    pub backoff_until_unix_ms: u64,
    pub last_episode: Option<&'a LastEpisode>,
}

/// Binds `addr` now (a bad or busy address is a usage error) and serves the
/// latest rendering from a thread of its own.
pub fn start_prometheus(addr: &str) -> Result<tokio::sync::watch::Sender<Arc<String>>, WatchError> {
    let addr = crate::prometheus::parse_bind(addr)
        .map_err(|e| WatchError::Usage(format!("--prometheus: {e}")))?;
    let listener = std::net::TcpListener::bind(addr)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| WatchError::Usage(format!("--prometheus {addr}: {e}")))?;
    let (tx, rx) = tokio::sync::watch::channel(Arc::new(String::new()));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| WatchError::Io {
            path: PathBuf::from("tokio runtime"),
            source,
        })?;
    std::thread::spawn(move || {
        rt.block_on(async move {
            match tokio::net::TcpListener::from_std(listener) {
                Ok(l) => {
                    if let Err(e) = crate::prometheus::serve_on(l, rx).await {
                        say(&format!("prometheus: {e}"));
                    }
                }
                Err(e) => say(&format!("prometheus: {e}")),
            }
        });
    });
    say(&format!("serving metrics at http://{addr}/metrics"));
    Ok(tx)
}

fn escape_label(text: &str) -> String {
    text.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The watch's state in the Prometheus text exposition format.
pub fn render_prometheus(h: &Heartbeat<'_>) -> String {
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        name.to_string()
    };
    let _ = family(
        "memtrace_watch_metric",
        "gauge",
        "Latest value of each watched metric (bytes or counts).",
    );
    let mut body = String::new();
    for m in h.metrics {
        let _ = writeln!(
            body,
            "memtrace_watch_metric{{pid=\"{}\",family=\"{}\",metric=\"{}\",unit=\"{}\"}} {}",
            m.pid,
            m.family.as_str(),
            escape_label(&m.metric),
            m.unit.as_str(),
            m.value
        );
    }
    out.push_str(&body);
    body.clear();
    let _ = writeln!(
        out,
        "# HELP memtrace_watch_metric_slope_per_hour Trend of each judged metric over the judged window.\n# TYPE memtrace_watch_metric_slope_per_hour gauge"
    );
    for m in h.metrics.iter().filter(|m| m.label.is_some()) {
        let _ = writeln!(
            out,
            "memtrace_watch_metric_slope_per_hour{{pid=\"{}\",metric=\"{}\",label=\"{}\"}} {}",
            m.pid,
            escape_label(&m.metric),
            m.label.map_or("", Label::as_str),
            m.slope_per_hour
        );
    }
    let _ = writeln!(
        out,
        "# HELP memtrace_watch_state The watch's phase (1 for the current one).\n# TYPE memtrace_watch_state gauge"
    );
    for p in Phase::ALL {
        let _ = writeln!(
            out,
            "memtrace_watch_state{{state=\"{}\"}} {}",
            p.as_str(),
            u8::from(p == h.phase)
        );
    }
    let _ = writeln!(
        out,
        "# HELP memtrace_watch_target_pid The (lowest) pid watched (0 while waiting).\n# TYPE memtrace_watch_target_pid gauge\nmemtrace_watch_target_pid {}",
        h.pid.unwrap_or(0)
    );
    let _ = writeln!(
        out,
        "# HELP memtrace_watch_processes Processes watched.\n# TYPE memtrace_watch_processes gauge\nmemtrace_watch_processes {}",
        h.pids.len()
    );
    let _ = writeln!(
        out,
        "# HELP memtrace_watch_process_info Each process watched and where it lives (container, pod), to join on pid.\n# TYPE memtrace_watch_process_info gauge"
    );
    for process in &h.processes {
        let pid = process.pid.to_string();
        let placed = crate::prometheus::placement_labels(&process.placement);
        let mut labels = vec![("pid", pid.as_str())];
        labels.extend(placed.iter().map(|(key, value)| (*key, value.as_str())));
        let _ = writeln!(
            out,
            "memtrace_watch_process_info{} 1",
            crate::prometheus::label_set(&labels)
        );
    }
    let _ = writeln!(
        out,
        "# HELP memtrace_watch_episodes_total Episodes started (across the watcher's restarts).\n# TYPE memtrace_watch_episodes_total counter\nmemtrace_watch_episodes_total {}",
        h.episodes_total
    );
    let _ = writeln!(
        out,
        "# HELP memtrace_watch_duty_used_seconds Attached time in the last 24 hours.\n# TYPE memtrace_watch_duty_used_seconds gauge\nmemtrace_watch_duty_used_seconds {}",
        h.duty_used_ms as f64 / 1000.0
    );
    let _ = writeln!(
        out,
        "# HELP memtrace_watch_duty_cap_seconds Most attached time allowed in 24 hours.\n# TYPE memtrace_watch_duty_cap_seconds gauge\nmemtrace_watch_duty_cap_seconds {}",
        h.duty_cap_ms as f64 / 1000.0
    );
    let _ = writeln!(
        out,
        "# HELP memtrace_watch_last_episode_site_bytes Live bytes of the last episode's top sites (allocated during its window).\n# TYPE memtrace_watch_last_episode_site_bytes gauge"
    );
    if let Some(last) = h.last_episode {
        for (rank, (function, bytes)) in last.top.iter().enumerate() {
            let _ = writeln!(
                out,
                "memtrace_watch_last_episode_site_bytes{{episode=\"{}\",pid=\"{}\",rank=\"{}\",function=\"{}\"}} {bytes}",
                last.number,
                last.pid,
                rank + 1,
                escape_label(function)
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_text_names_state_metrics_and_sites() {
        let views = vec![MetricView {
            pid: 42,
            family: Family::Process,
            metric: "RssAnon".into(),
            unit: Unit::Bytes,
            value: 1024.0,
            label: Some(Label::Growth),
            slope_per_hour: 3600.0,
            triggers: true,
        }];
        let last = LastEpisode {
            number: 3,
            dir: "d".into(),
            pid: 42,
            metric: "RssAnon".into(),
            explanation: String::new(),
            top: vec![("leak \"here\"".into(), 4096)],
        };
        let h = Heartbeat {
            format: "x",
            unix_ms: 0,
            watching_since_unix_ms: 0,
            phase: Phase::Tracing,
            target: "pid 1".into(),
            pid: Some(42),
            pids: vec![42],
            processes: vec![WatchedProcess {
                pid: 42,
                placement: crate::tracee::container::Placement {
                    ns_pid: None,
                    ..crate::tracee::container::Placement::sample_pod()
                },
            }],
            restarts_seen: 0,
            dry_run: false,
            metrics: &views,
            episodes_total: 3,
            episodes_this_run: 1,
            would_trace: 0,
            duty_used_ms: 60_000,
            duty_cap_ms: 4_320_000,
            backoff_until_unix_ms: 0,
            last_episode: Some(&last),
        };
        let text = render_prometheus(&h);
        assert!(text.contains(
            "memtrace_watch_metric{pid=\"42\",family=\"process\",metric=\"RssAnon\",unit=\"bytes\"} 1024"
        ));
        assert!(text.contains("memtrace_watch_state{state=\"tracing\"} 1"));
        assert!(text.contains("memtrace_watch_state{state=\"watching\"} 0"));
        assert!(text.contains("memtrace_watch_episodes_total 3"));
        assert!(text.contains("memtrace_watch_target_pid 42"));
        assert!(text.contains("memtrace_watch_processes 1"));
        let info = format!(
            "memtrace_watch_process_info{{pid=\"42\",container_id=\"{}\",container_runtime=\"containerd\",pod_uid=\"0a1b2c3d-4e5f-6789-abcd-ef0123456789\",pod_name=\"web-0\",pod_namespace=\"shop\",container_name=\"app\"}} 1",
            "ab".repeat(32)
        );
        assert!(text.contains(&info), "{text}");
        assert!(text.contains("function=\"leak \\\"here\\\"\"} 4096"));
        assert!(text.contains("label=\"growth\"} 3600"));
    }
}
