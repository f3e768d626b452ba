//! The options of `memtrace watch` ([`WatchArgs`]): the target (`--pid`,
//! `--name`, `--container`, `--cgroup`, `--pod`), sampling and judging, episodes,
//! the duty cap and back-off, and the outputs.

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgGroup, Args};

use crate::duration::parse_duration;
use crate::monitor::Sensitivity;
use crate::watch::trigger::Trigger;

const AFTER_HELP: &str = "\
Watches with no probe attached; traces only while a metric grows.

Each tick samples the target's RssAnon, VmRSS, VmData, fd count and GPU memory
(NVML, DRM, --gpu-cmd) and judges the last --judge-window of each with the
monitor's verdict logic (see `memtrace monitor --help` for the labels and the
sensitivity options), once half a --judge-window has been sampled after
--warmup. A label in --trigger starts an episode: memtrace traces
the target for --window and writes DIR/episode-NNNN/ (report.json, report.html,
profile.pb.gz, tracer.log, episode.json). Then back-off (--backoff, doubled per
episode while the metric keeps growing, at most --max-backoff) and a duty cap
(--max-duty of any 24 h). DIR/heartbeat.json is rewritten every --heartbeat;
DIR/watch-state.json carries numbering, back-off and duty across restarts.
Options after `--` are passed to the tracer (e.g. -- --preset fds --stack-depth 16).

Exit codes: 0 done (duration reached, target gone, SIGTERM), 1 error, 2 usage.

With --container, --cgroup or --pod every process of the selection (also those
started later) is sampled and judged on its own, after its own warm-up, and
an episode traces the process that grows; device-wide GPU figures are judged
only while the selection holds one process.

Examples:
  sudo memtrace watch --name smengine_demo --reports /var/lib/memtrace
  sudo memtrace watch --container 3f2a9c --reports /var/lib/memtrace
  sudo memtrace watch --pod shop/web-0 --reports /var/lib/memtrace
  sudo memtrace watch --pid 1234 --reports out --window 2m --max-duty 2% --prometheus 9465
  memtrace watch --name my_service --dry-run";

/// Options of `memtrace watch`.
#[derive(Debug, Args)]
#[command(after_help = AFTER_HELP)]
#[command(group(ArgGroup::new("target").args(["pid", "name", "container", "cgroup", "pod"])))]
pub struct WatchArgs {
    /// Watch this process (the watch ends when it exits).
    #[arg(short, long)]
    pub pid: Option<u32>,

    /// Watch the process with this name (comm, argv0 or executable
    /// basename), following its restarts; with several, the lowest pid.
    #[arg(short, long)]
    pub name: Option<String>,

    /// Watch every process in this container (its id or a unique prefix, as
    /// `/proc/PID/cgroup` shows it), including processes started later;
    /// each is judged on its own and an episode traces the one that grows.
    #[arg(long, value_name = "ID")]
    pub container: Option<String>,

    /// Watch every process in this cgroup or below it (a path as
    /// `/proc/PID/cgroup` shows it: `/system.slice/x.service`, `0::/...`,
    /// `4:memory:/...`), including processes started later; each is judged
    /// on its own.
    #[arg(long, value_name = "PATH")]
    pub cgroup: Option<String>,

    /// Watch every process of this Kubernetes pod on this node
    /// (`NAMESPACE/NAME`, or `NAME` alone where no other namespace has a pod
    /// of that name), including processes started in it later; each is
    /// judged on its own.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    pub pod: Option<String>,

    /// Directory for episode reports, the heartbeat and the state file
    /// (created 0700). Required unless --dry-run.
    #[arg(long, value_name = "DIR")]
    pub reports: Option<PathBuf>,

    /// Judge and log, never attach.
    #[arg(long)]
    pub dry_run: bool,

    /// Time between samples.
    #[arg(short, long, value_parser = parse_duration, default_value = "5s")]
    pub interval: Duration,

    /// The recent span each metric is judged on.
    #[arg(long, value_parser = parse_duration, default_value = "10m")]
    pub judge_window: Duration,

    /// Ignore the first DUR of each target process's life (start-up, caches).
    #[arg(long, value_parser = parse_duration, default_value = "1m")]
    pub warmup: Duration,

    /// Labels that start an episode (comma-separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        value_name = "LABELS",
        default_value = "growth,slow-growth,jump"
    )]
    pub trigger: Vec<Trigger>,

    /// Metrics that may trigger: /proc/PID/status names, `fds`, `threads`,
    /// and `gpu` for every GPU memory-in-use figure.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "LIST",
        default_value = "RssAnon,VmRSS,VmData,fds,gpu"
    )]
    pub metrics: Vec<String>,

    /// How long each episode traces.
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    pub window: Duration,

    /// Most attached time in any 24 hours, as a percentage (`5%`) or fraction.
    #[arg(long, value_parser = parse_fraction, default_value = "5%")]
    pub max_duty: f64,

    /// Pause after an episode before the next one may start.
    #[arg(long, value_parser = parse_duration, default_value = "5m")]
    pub backoff: Duration,

    /// Longest pause (the back-off doubles while the metric keeps growing).
    #[arg(long, value_parser = parse_duration, default_value = "6h")]
    pub max_backoff: Duration,

    /// Episode directories kept (older ones are deleted).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    pub keep: u32,

    /// Sites per episode report.
    #[arg(long, default_value_t = 20)]
    pub top: usize,

    /// End each episode with a leak check (the tracer's `--leak-check`):
    /// the target is stopped for a moment and the episode says which of the
    /// blocks it saw nothing points to any more.
    #[arg(long)]
    pub leak_check: bool,

    /// Keep each episode's recorded trace (trace.jsonl) after rendering.
    #[arg(long)]
    pub keep_traces: bool,

    /// How often heartbeat.json is rewritten.
    #[arg(long, value_parser = parse_duration, default_value = "1m")]
    pub heartbeat: Duration,

    /// Serve the watch's metrics in the Prometheus text format on ADDR
    /// (PORT, HOST:PORT; a bare port binds 127.0.0.1).
    #[arg(long, value_name = "ADDR")]
    pub prometheus: Option<String>,

    /// Pushing each episode's report to a profile store (Pyroscope, Grafana).
    #[command(flatten)]
    pub push: crate::push::PushArgs,

    /// Stop after this long (default: until the target ends or SIGTERM).
    #[arg(short, long, value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// Vendor command printing GPU/NPU memory (as `memtrace monitor --gpu-cmd`).
    #[arg(long, value_name = "CMD")]
    pub gpu_cmd: Option<String>,

    /// Do not load NVML.
    #[arg(long)]
    pub no_nvml: bool,

    /// How sensitive the triggers are (the monitor's verdict options).
    #[command(flatten)]
    pub sensitivity: Sensitivity,

    /// Tracer options for each episode.
    #[arg(last = true, value_name = "TRACER_ARGS")]
    pub tracer_args: Vec<String>,
}

/// Parses `5%` or `0.05`.
fn parse_fraction(text: &str) -> Result<f64, String> {
    let t = text.trim();
    let value = match t.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map(|v| v / 100.0),
        None => t.parse::<f64>(),
    }
    .map_err(|_| format!("invalid fraction '{text}' (examples: 5%, 0.05)"))?;
    if !(value > 0.0 && value <= 1.0) {
        return Err(format!(
            "invalid fraction '{text}': more than 0, at most 100%"
        ));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_parse_as_percent_or_plain() {
        assert_eq!(parse_fraction("5%"), Ok(0.05));
        assert_eq!(parse_fraction("0.5"), Ok(0.5));
        assert!(parse_fraction("0").is_err());
        assert!(parse_fraction("150%").is_err());
        assert!(parse_fraction("lots").is_err());
    }
}
