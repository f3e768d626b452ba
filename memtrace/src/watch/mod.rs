//! `memtrace watch`: monitor cheaply for days, trace only while memory grows.
//!
//! The watch loop samples the target's metrics the way `memtrace monitor`
//! does (`/proc/PID/status`, its fd count, its GPU memory from NVML, DRM
//! fdinfo/sysfs or a vendor command) with no probe attached, keeps a bounded
//! sliding window per metric and judges it with the monitor's verdict code
//! (`trigger`). When a metric grows (`--trigger growth,slow-growth,jump`),
//! an episode (`episode`) runs the memtrace binary itself as a child tracer
//! for `--window`, writes its report to `--reports DIR` (JSON, one-page HTML,
//! pprof, and `episode.json`: why it started, what it found, how much of the
//! growth that explains), and the watcher goes back to watching with a
//! back-off and a duty-cycle cap (`state`, which also survives the
//! watcher's restarts). A quiet run writes only `heartbeat.json`.
//!
//! The target is a pid (the watch ends with it), a name (followed across
//! restarts), or a container or cgroup (every process in it, each judged on
//! its own: `targets`). SIGTERM/SIGINT end the watch cleanly (a running
//! episode is cut short and still reported); SIGHUP is logged and saves the
//! state.
//!
//! Rooms: `args` (the options), `watcher` (the loop, sampling, the
//! heartbeat), `targets`, `judge` (verdicts and what fires), `episodes` (the
//! episode's life in the loop), `episode` (the tracer child and the
//! summary), `trigger` (windows and labels), `state` (the state file, duty
//! and back-off), `publish` (heartbeat and Prometheus text).

mod args;
mod episode;
mod episodes;
mod judge;
mod publish;
mod state;
mod targets;
mod trigger;
mod watcher;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::Failure;
pub use args::WatchArgs;
use watcher::Watcher;

/// Errors of the watcher.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("{0}")]
    Usage(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("state file {}: {why}", path.display())]
    State { path: PathBuf, why: String },
}

/// Runs `memtrace watch`.
pub fn run(args: WatchArgs) -> anyhow::Result<ExitCode> {
    match Watcher::new(args) {
        Ok(mut w) => {
            let result = w.run();
            w.shutdown();
            result.map_err(into_anyhow)?;
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => Err(into_anyhow(e)),
    }
}

fn into_anyhow(e: WatchError) -> anyhow::Error {
    match e {
        WatchError::Usage(m) => anyhow::Error::new(Failure::usage(m)),
        other => anyhow::Error::new(Failure::runtime(format!("watch: {other}"))),
    }
}

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Prints one timestamped line on stderr.
fn say(text: &str) {
    let stamp = humantime::format_rfc3339_seconds(SystemTime::now());
    eprintln!("memtrace watch: {stamp} {text}");
}
