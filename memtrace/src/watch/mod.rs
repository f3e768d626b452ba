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
//! The target is a pid (the watch ends with it) or a name (followed across
//! restarts). SIGTERM/SIGINT end the watch cleanly (a running episode is
//! cut short and still reported); SIGHUP is logged and saves the state.

mod episode;
mod state;
mod trigger;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use serde::Serialize;

use crate::duration::parse_duration;
use crate::error::Failure;
use crate::monitor::series::{Family, Unit};
use crate::monitor::sources::{gpu::GpuSources, procfs};
use crate::monitor::units::{format_rate, format_value, parse_size};
use crate::monitor::verdict::{Label, Thresholds};
use trigger::{Judgement, Trigger, Window};

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

Examples:
  sudo memtrace watch --name smengine_demo --reports /var/lib/memtrace
  sudo memtrace watch --pid 1234 --reports out --window 2m --max-duty 2% --prometheus 9465
  memtrace watch --name my_service --dry-run";

/// Options of `memtrace watch`.
#[derive(Debug, Args)]
#[command(after_help = AFTER_HELP)]
pub struct WatchArgs {
    /// Watch this process (the watch ends when it exits).
    #[arg(short, long, conflicts_with = "name")]
    pub pid: Option<u32>,

    /// Watch the process with this name (comm or argv0 basename), following
    /// its restarts; with several, the lowest pid.
    #[arg(short, long)]
    pub name: Option<String>,

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

    /// Stop after this long (default: until the target ends or SIGTERM).
    #[arg(short, long, value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// Vendor command printing GPU/NPU memory (as `memtrace monitor --gpu-cmd`).
    #[arg(long, value_name = "CMD")]
    pub gpu_cmd: Option<String>,

    /// Do not load NVML.
    #[arg(long)]
    pub no_nvml: bool,

    /// Growth rate (per hour) from which growth of a byte metric is `growth`.
    #[arg(long, value_parser = parse_size, default_value = "10MiB", value_name = "SIZE")]
    pub growth_rate: f64,

    /// Growth rate (per hour) from which growth of a count is `growth`.
    #[arg(long, default_value_t = 60.0, value_name = "N")]
    pub growth_rate_count: f64,

    /// Smallest change of a byte metric that counts.
    #[arg(long, value_parser = parse_size, default_value = "1MiB", value_name = "SIZE")]
    pub min_change: f64,

    /// Smallest change of a count that counts.
    #[arg(long, default_value_t = 3.0, value_name = "N")]
    pub min_change_count: f64,

    /// Smallest change that counts, as a fraction of the level.
    #[arg(long, default_value_t = 0.01, value_name = "FRACTION")]
    pub min_change_rel: f64,

    /// A trend must exceed this many robust noise sigmas over the window.
    #[arg(long, default_value_t = 3.0, value_name = "K")]
    pub noise_k: f64,

    /// A step must exceed this many within-level noise sigmas.
    #[arg(long, default_value_t = 6.0, value_name = "K")]
    pub jump_k: f64,

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

/// Seconds since `pid` started (from `/proc/PID/stat` and `/proc/uptime`).
fn process_age_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    // Fields after the command: state is field 3, starttime field 22.
    let start_ticks: f64 = after.split_whitespace().nth(19)?.parse().ok()?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| (uptime - start_ticks / hz as f64).max(0.0))
}

/// Which process is watched.
enum Target {
    Pid(u32),
    Name(String),
}

/// The watch's phase, as the heartbeat and Prometheus show it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Phase {
    WaitingForTarget,
    Warmup,
    Watching,
    Tracing,
    Holding,
}

impl Phase {
    const ALL: [Phase; 5] = [
        Phase::WaitingForTarget,
        Phase::Warmup,
        Phase::Watching,
        Phase::Tracing,
        Phase::Holding,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Phase::WaitingForTarget => "waiting-for-target",
            Phase::Warmup => "warmup",
            Phase::Watching => "watching",
            Phase::Tracing => "tracing",
            Phase::Holding => "holding",
        }
    }
}

/// An episode in flight, with what is needed to summarize it.
struct InFlight {
    run: episode::Running,
    why: episode::Why,
    family: Family,
    /// Metric key, for the value at attach and detach.
    key: (Family, String),
    /// When the tracer said it was tracing (watcher's axis, to a tick).
    attached_t: Option<f64>,
}

/// What the heartbeat says about one metric.
#[derive(Clone, Debug, Serialize)]
struct MetricView {
    family: Family,
    metric: String,
    unit: Unit,
    value: f64,
    label: Option<Label>,
    slope_per_hour: f64,
    triggers: bool,
}

/// The last episode, for the heartbeat and Prometheus.
#[derive(Clone, Debug, Serialize)]
struct LastEpisode {
    number: u64,
    dir: String,
    metric: String,
    explanation: String,
    top: Vec<(String, u64)>,
}

/// The heartbeat file.
#[derive(Serialize)]
struct Heartbeat<'a> {
    format: &'static str,
    unix_ms: u64,
    watching_since_unix_ms: u64,
    phase: Phase,
    target: String,
    pid: Option<u32>,
    restarts_seen: u64,
    dry_run: bool,
    metrics: &'a [MetricView],
    episodes_total: u64,
    episodes_this_run: u64,
    would_trace: u64,
    duty_used_ms: u64,
    duty_cap_ms: u64,
    backoff_until_unix_ms: u64,
    last_episode: Option<&'a LastEpisode>,
}

struct Watcher {
    args: WatchArgs,
    target: Target,
    exe: PathBuf,
    gpu: GpuSources,
    th: Thresholds,
    stop: Arc<AtomicBool>,
    hup: Arc<AtomicBool>,
    start: Instant,
    started_unix_ms: u64,
    state: state::State,
    pid: Option<u32>,
    restarts_seen: u64,
    /// Judging starts at this time on the `start` axis (warm-up end).
    judge_from: f64,
    windows: BTreeMap<(Family, String), Window>,
    views: Vec<MetricView>,
    phase: Phase,
    running: Option<InFlight>,
    episodes_this_run: u64,
    would_trace: u64,
    dry_hold_until: f64,
    last_hold_note: Option<String>,
    last_heartbeat: Option<Instant>,
    last_episode: Option<LastEpisode>,
    prometheus: Option<tokio::sync::watch::Sender<Arc<String>>>,
}

impl Watcher {
    fn new(args: WatchArgs) -> Result<Watcher, WatchError> {
        let target = match (&args.pid, &args.name) {
            (Some(pid), None) => Target::Pid(*pid),
            (None, Some(name)) if !name.is_empty() => Target::Name(name.clone()),
            _ => {
                return Err(WatchError::Usage(
                    "no target: give --pid PID or --name NAME (see memtrace watch --help)".into(),
                ))
            }
        };
        if let Target::Pid(pid) = target {
            if !procfs::process_alive(Path::new("/proc"), pid) {
                return Err(WatchError::Usage(format!("no process with pid {pid}")));
            }
        }
        if args.interval.is_zero() || args.window.is_zero() {
            return Err(WatchError::Usage(
                "--interval and --window must be more than 0".into(),
            ));
        }
        if args.trigger.is_empty() || args.metrics.is_empty() {
            return Err(WatchError::Usage(
                "--trigger and --metrics need at least one entry".into(),
            ));
        }
        if args.reports.is_none() && !args.dry_run {
            return Err(WatchError::Usage(
                "--reports DIR is needed to write episodes (or use --dry-run)".into(),
            ));
        }
        if !args.dry_run {
            crate::kernel::privilege::check(true).map_err(|e| WatchError::Usage(e.message))?;
        }
        let mut st = state::State::default();
        if let Some(dir) = &args.reports {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|source| {
                    WatchError::Usage(format!("--reports {}: {source}", dir.display()))
                })?;
            st = state::load(dir)?;
            for n in st.recover() {
                say(&format!(
                    "episode {n} was cut short by the previous watcher's end"
                ));
            }
        }
        let exe = std::env::current_exe().map_err(|source| WatchError::Io {
            path: PathBuf::from("/proc/self/exe"),
            source,
        })?;
        let prometheus = match &args.prometheus {
            Some(addr) => Some(start_prometheus(addr)?),
            None => None,
        };
        let (gpu, sources) = GpuSources::probe(
            Path::new("/sys"),
            args.gpu_cmd.as_deref(),
            !args.no_nvml,
            args.interval.max(Duration::from_secs(5)),
        );
        let th = Thresholds {
            growth_rate_bytes: args.growth_rate,
            growth_rate_count: args.growth_rate_count,
            min_change_bytes: args.min_change,
            min_change_count: args.min_change_count,
            min_change_rel: args.min_change_rel,
            noise_k: args.noise_k,
            jump_k: args.jump_k,
            ..Thresholds::default()
        };
        let stop = Arc::new(AtomicBool::new(false));
        let hup = Arc::new(AtomicBool::new(false));
        install_signals(stop.clone(), hup.clone());
        say(&format!(
            "watching {} every {:?} (judged over {:?}, triggers {}); sources: {}",
            match &target {
                Target::Pid(p) => format!("pid {p}"),
                Target::Name(n) => format!("name {n}"),
            },
            args.interval,
            args.judge_window,
            args.trigger
                .iter()
                .map(|t| t.label().as_str())
                .collect::<Vec<_>>()
                .join(","),
            sources.join("; ")
        ));
        Ok(Watcher {
            target,
            exe,
            gpu,
            th,
            stop,
            hup,
            start: Instant::now(),
            started_unix_ms: now_unix_ms(),
            state: st,
            pid: None,
            restarts_seen: 0,
            judge_from: 0.0,
            windows: BTreeMap::new(),
            views: Vec::new(),
            phase: Phase::WaitingForTarget,
            running: None,
            episodes_this_run: 0,
            would_trace: 0,
            dry_hold_until: 0.0,
            last_hold_note: None,
            last_heartbeat: None,
            last_episode: None,
            prometheus,
            args,
        })
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Unix milliseconds of a time on the `start` axis.
    fn unix_at(&self, t: f64) -> u64 {
        self.started_unix_ms
            .saturating_add((t.max(0.0) * 1000.0) as u64)
    }

    fn run(&mut self) -> Result<(), WatchError> {
        let mut tick: u64 = 0;
        loop {
            if self.stop.load(Ordering::SeqCst) {
                say("stopping (signal)");
                break;
            }
            if self.hup.swap(false, Ordering::SeqCst) {
                say("SIGHUP: state saved, watching on");
                self.save_state()?;
                self.last_heartbeat = None;
            }
            if self
                .args
                .duration
                .is_some_and(|d| self.start.elapsed() >= d)
            {
                say("duration reached");
                break;
            }
            if !self.resolve_target()? {
                break;
            }
            let t = self.now();
            if let Some(pid) = self.pid {
                self.sample(pid, t);
            }
            self.poll_episode()?;
            self.judge_and_act(t)?;
            self.publish()?;
            tick += 1;
            let next = self.start + self.args.interval.mul_f64(tick as f64);
            while Instant::now() < next && !self.stop.load(Ordering::SeqCst) {
                std::thread::sleep((next - Instant::now()).min(Duration::from_millis(50)));
            }
        }
        Ok(())
    }

    /// Finds (or re-finds) the target; false when the watch should end.
    fn resolve_target(&mut self) -> Result<bool, WatchError> {
        let proc_root = Path::new("/proc");
        if let Some(pid) = self.pid {
            if procfs::process_alive(proc_root, pid) {
                return Ok(true);
            }
            say(&format!("pid {pid} exited"));
            self.pid = None;
            self.windows.clear();
            self.views.clear();
            self.phase = Phase::WaitingForTarget;
        }
        let found = match &self.target {
            // A pid is watched once: the watch ends with it (after the
            // episode in flight, which ends with it too).
            Target::Pid(_) if self.restarts_seen > 0 => return Ok(self.running.is_some()),
            Target::Pid(pid) => procfs::process_alive(proc_root, *pid).then_some(*pid),
            Target::Name(name) => procfs::find_by_name(proc_root, name, std::process::id())
                .map_err(|source| WatchError::Io {
                    path: proc_root.to_path_buf(),
                    source,
                })?
                .into_iter()
                .next(),
        };
        let Some(pid) = found else {
            if let Target::Name(name) = &self.target {
                if self.last_hold_note.as_deref() != Some("waiting") {
                    say(&format!("waiting for a process named '{name}'"));
                    self.last_hold_note = Some("waiting".into());
                }
                self.phase = Phase::WaitingForTarget;
                return Ok(true);
            }
            return Ok(self.running.is_some());
        };
        let age = process_age_s(pid).unwrap_or(0.0);
        self.judge_from = self.now() - age + self.args.warmup.as_secs_f64();
        if self.restarts_seen > 0 {
            say(&format!("target restarted: watching pid {pid}"));
        } else {
            say(&format!("watching pid {pid}"));
        }
        self.restarts_seen += 1;
        self.pid = Some(pid);
        self.last_hold_note = None;
        Ok(true)
    }

    fn push(&mut self, family: Family, metric: &str, unit: Unit, t: f64, value: f64) {
        let span = self.args.judge_window.as_secs_f64();
        let cap = ((span / self.args.interval.as_secs_f64()).ceil() as usize + 1).min(4096);
        self.windows
            .entry((family, metric.to_string()))
            .or_insert_with(|| Window::new(family, metric, unit, span, cap))
            .push(t, value);
    }

    fn sample(&mut self, pid: u32, t: f64) {
        let proc_root = Path::new("/proc");
        if let Some(s) = procfs::read_process(proc_root, pid) {
            for (k, v) in &s.memory {
                self.push(Family::Process, k, Unit::Bytes, t, *v);
            }
            if let Some(fds) = s.fds {
                self.push(Family::Process, "fds", Unit::Count, t, fds);
            }
            if let Some(threads) = s.threads {
                self.push(Family::Process, "threads", Unit::Count, t, threads);
            }
        }
        for (k, v) in self.gpu.sample_process(proc_root, pid) {
            self.push(Family::Gpu, &k, Unit::Bytes, t, v);
        }
        let (devices, _errors) = self.gpu.sample_devices();
        for (k, v) in devices {
            self.push(Family::Gpu, &k, Unit::Bytes, t, v);
        }
    }

    /// Judges every selected metric; starts an episode when one fires.
    fn judge_and_act(&mut self, t: f64) -> Result<(), WatchError> {
        let Some(pid) = self.pid else {
            return Ok(());
        };
        let from = self.judge_from;
        // A verdict needs history: judging starts once half a window has
        // been sampled after the warm-up (one tooth of a sawtooth rises
        // like a leak; several do not).
        let ready = from + self.args.judge_window.as_secs_f64() / 2.0;
        let mut firing: Vec<(usize, (Family, String), Judgement)> = Vec::new();
        let mut views = Vec::new();
        for (key, w) in &self.windows {
            let Some((_, value)) = w.last() else { continue };
            let wanted = trigger::selected(key.0, &key.1, &self.args.metrics);
            let judged = (t >= ready && wanted).then(|| w.judge(from, &self.th));
            let fires = judged.as_ref().is_some_and(|j| j.fires(&self.args.trigger));
            views.push(MetricView {
                family: key.0,
                metric: key.1.clone(),
                unit: w.unit,
                value,
                label: judged.as_ref().map(|j| j.verdict.label),
                slope_per_hour: judged.as_ref().map_or(0.0, |j| j.verdict.slope_per_hour),
                triggers: wanted,
            });
            if fires {
                if let Some(j) = judged {
                    // GPU first (scarcest), then the order of --metrics.
                    let rank = if key.0 == Family::Gpu {
                        0
                    } else {
                        1 + self
                            .args
                            .metrics
                            .iter()
                            .position(|m| *m == key.1)
                            .unwrap_or(usize::MAX - 1)
                    };
                    firing.push((rank, key.clone(), j));
                }
            }
        }
        self.views = views;
        if self.running.is_some() {
            self.phase = Phase::Tracing;
            return Ok(());
        }
        if t < ready {
            self.phase = Phase::Warmup;
            return Ok(());
        }
        firing.sort_by_key(|f| f.0);
        let Some((_, key, j)) = firing.first().cloned() else {
            if self.state.consecutive > 0 {
                self.state.healthy();
                self.save_state()?;
            }
            self.phase = Phase::Watching;
            self.last_hold_note = None;
            return Ok(());
        };
        let bytes = j.verdict.unit == Unit::Bytes;
        let value = j.verdict.end.unwrap_or(0.0);
        let also: Vec<String> = firing.iter().skip(1).map(|f| f.1 .1.clone()).collect();
        let since_unix_ms = self.unix_at(j.since_t);
        let rate = if j.verdict.label == Label::Jump {
            let step: f64 = j
                .verdict
                .steps
                .iter()
                .filter(|s| s.size > 0.0)
                .map(|s| s.size)
                .sum();
            format!("of +{}", format_value(step, bytes))
        } else {
            format!(
                "at {} ({} over the judged window)",
                format_rate(j.verdict.slope_per_hour, bytes),
                format_value(j.verdict.change, bytes)
            )
        };
        let text = format!(
            "{} {} {rate}, now {}, growing since {}{}",
            key.1,
            j.verdict.label.as_str(),
            format_value(value, bytes),
            humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(since_unix_ms)),
            if also.is_empty() {
                String::new()
            } else {
                format!(" (also {})", also.join(", "))
            }
        );
        let why = episode::Why {
            metric: key.1.clone(),
            family: key.0.as_str().to_string(),
            label: j.verdict.label.as_str().to_string(),
            slope_per_hour: j.verdict.slope_per_hour,
            change: j.verdict.change,
            since_unix_ms,
            triggered_unix_ms: now_unix_ms(),
            value,
            also,
            text,
        };
        if self.args.dry_run {
            self.phase = Phase::Holding;
            if t >= self.dry_hold_until {
                self.would_trace += 1;
                say(&format!("dry run: would trace pid {pid}: {}", why.text));
                self.dry_hold_until =
                    t + self.args.window.as_secs_f64() + self.args.backoff.as_secs_f64();
            }
            return Ok(());
        }
        let now = now_unix_ms();
        let window_ms = millis(self.args.window);
        if let Err(hold) = self.state.may_start(now, window_ms, self.args.max_duty) {
            self.phase = Phase::Holding;
            let (kind, until) = match hold {
                state::Hold::Backoff { until_unix_ms } => ("back-off", until_unix_ms),
                state::Hold::Duty { until_unix_ms, .. } => ("duty cap", until_unix_ms),
            };
            let note = format!("{kind} {until}");
            if self.last_hold_note.as_deref() != Some(note.as_str()) {
                say(&format!(
                    "{}; not tracing: {kind} until {}",
                    why.text,
                    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(until))
                ));
                self.last_hold_note = Some(note);
            }
            return Ok(());
        }
        self.start_episode(pid, key, why)
    }

    fn start_episode(
        &mut self,
        pid: u32,
        key: (Family, String),
        why: episode::Why,
    ) -> Result<(), WatchError> {
        let Some(reports) = self.args.reports.clone() else {
            return Ok(());
        };
        let now = now_unix_ms();
        let (number, dir) = self.state.begin(now, &key.1, pid);
        self.save_state()?;
        let plan = episode::Plan {
            exe: &self.exe,
            pid,
            window: self.args.window,
            dir: reports.join(&dir),
            top: self.args.top,
            tracer_args: &self.args.tracer_args,
        };
        say(&format!(
            "episode {number}: tracing pid {pid} for {:?}: {}",
            self.args.window, why.text
        ));
        match episode::start(&plan, number, now) {
            Ok(run) => {
                self.phase = Phase::Tracing;
                self.episodes_this_run += 1;
                self.running = Some(InFlight {
                    run,
                    why,
                    family: key.0,
                    key,
                    attached_t: None,
                });
            }
            Err(e) => {
                say(&format!("episode {number}: the tracer did not start: {e}"));
                self.state.end(
                    number,
                    now_unix_ms(),
                    0,
                    "failed",
                    millis(self.args.backoff),
                    millis(self.args.max_backoff),
                );
                self.save_state()?;
            }
        }
        Ok(())
    }

    /// Finishes the episode when its tracer has ended.
    fn poll_episode(&mut self) -> Result<(), WatchError> {
        let now = self.now();
        let Some(flight) = self.running.as_mut() else {
            return Ok(());
        };
        if flight.attached_t.is_none() {
            let log =
                std::fs::read_to_string(flight.run.dir.join("tracer.log")).unwrap_or_default();
            if log.contains("memtrace: tracing") {
                flight.attached_t = Some(now);
            }
        }
        let Some(status) = flight.run.try_wait() else {
            return Ok(());
        };
        self.complete_episode(Some(status))
    }

    fn complete_episode(
        &mut self,
        status: Option<std::process::ExitStatus>,
    ) -> Result<(), WatchError> {
        let Some(flight) = self.running.take() else {
            return Ok(());
        };
        let end_t = self.now();
        let window = self.windows.get(&flight.key);
        let bytes = window.is_none_or(|w| w.unit == Unit::Bytes);
        let traced_guess = flight.run.started.elapsed().as_secs_f64();
        // The report's own duration is exact; the sample nearest its start
        // comes from the watcher's clock.
        let report_ms = std::fs::read(flight.run.dir.join(episode::REPORT_JSON))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v["duration_ms"].as_u64());
        let traced_s = report_ms.map_or(traced_guess, |ms| ms as f64 / 1000.0);
        // Attached when the tracer said so (to a tick), else as long
        // before the end as it traced; detached that long after attaching.
        let attach_t = flight.attached_t.unwrap_or(end_t - traced_s);
        let change = episode::Change {
            metric: flight.key.1.clone(),
            bytes,
            at_attach: window.and_then(|w| w.value_at(attach_t)),
            at_detach: window.and_then(|w| w.value_at(attach_t + traced_s)),
        };
        let summary = episode::finish(
            &flight.run,
            episode::Finish {
                exe: &self.exe,
                why: flight.why,
                family: flight.family,
                change,
                status,
                top: self.args.top,
                keep_trace: self.args.keep_traces,
            },
        );
        let number = flight.run.number;
        let (outcome, traced_ms) = match &summary {
            Ok(s) => {
                say(&format!(
                    "episode {number} {}: {}; {}",
                    s.outcome,
                    match s.found.first() {
                        Some(f) => format!(
                            "top site {} ({} in {} blocks)",
                            f.function,
                            format_value(f.live_bytes as f64, true),
                            f.live_count
                        ),
                        None => "no site holds memory".to_string(),
                    },
                    s.explanation
                ));
                self.last_episode = Some(LastEpisode {
                    number,
                    dir: flight.run.dir.display().to_string(),
                    metric: s.why.metric.clone(),
                    explanation: s.explanation.clone(),
                    top: s
                        .found
                        .iter()
                        .take(5)
                        .map(|f| (f.function.clone(), f.live_bytes))
                        .collect(),
                });
                (s.outcome.clone(), s.traced_ms)
            }
            Err(e) => {
                say(&format!("episode {number}: {e}"));
                ("failed".to_string(), millis(flight.run.started.elapsed()))
            }
        };
        self.state.end(
            number,
            now_unix_ms(),
            traced_ms,
            &outcome,
            millis(self.args.backoff),
            millis(self.args.max_backoff),
        );
        if let Some(dir) = self.args.reports.clone() {
            for doomed in self.state.prune(self.args.keep as usize, now_unix_ms()) {
                if let Err(e) = std::fs::remove_dir_all(dir.join(&doomed)) {
                    say(&format!("cannot delete {doomed}: {e}"));
                }
            }
        }
        self.save_state()?;
        self.phase = Phase::Holding;
        self.last_heartbeat = None;
        Ok(())
    }

    fn save_state(&self) -> Result<(), WatchError> {
        match &self.args.reports {
            Some(dir) => state::save(dir, &self.state),
            None => Ok(()),
        }
    }

    /// Rewrites the heartbeat when due and updates the Prometheus text.
    fn publish(&mut self) -> Result<(), WatchError> {
        let now = now_unix_ms();
        let window_ms = millis(self.args.window);
        let heartbeat = Heartbeat {
            format: "memtrace-watch-heartbeat/1",
            unix_ms: now,
            watching_since_unix_ms: self.started_unix_ms,
            phase: self.phase,
            target: match &self.target {
                Target::Pid(p) => format!("pid {p}"),
                Target::Name(n) => format!("name {n}"),
            },
            pid: self.pid,
            restarts_seen: self.restarts_seen.saturating_sub(1),
            dry_run: self.args.dry_run,
            metrics: &self.views,
            episodes_total: self.state.next_episode.saturating_sub(1),
            episodes_this_run: self.episodes_this_run,
            would_trace: self.would_trace,
            duty_used_ms: self.state.duty_used_ms(now, window_ms),
            duty_cap_ms: (self.args.max_duty * state::DAY_MS as f64) as u64,
            backoff_until_unix_ms: self.state.backoff_until_unix_ms,
            last_episode: self.last_episode.as_ref(),
        };
        if let Some(tx) = &self.prometheus {
            tx.send_replace(Arc::new(render_prometheus(&heartbeat)));
        }
        let due = self
            .last_heartbeat
            .is_none_or(|at| at.elapsed() >= self.args.heartbeat);
        if due {
            if let Some(dir) = &self.args.reports {
                state::write_json(&dir.join("heartbeat.json"), &heartbeat)?;
            }
            self.last_heartbeat = Some(Instant::now());
        }
        Ok(())
    }

    /// Ends a running episode (it still writes its report) and saves.
    fn shutdown(&mut self) {
        if let Some(flight) = self.running.as_mut() {
            say(&format!("episode {}: ending it early", flight.run.number));
            flight.run.interrupt();
            let status = flight.run.wait_bounded(Duration::from_secs(60));
            if let Err(e) = self.complete_episode(status) {
                say(&e.to_string());
            }
        }
        self.last_heartbeat = None;
        if let Err(e) = self.publish().and_then(|()| self.save_state()) {
            say(&e.to_string());
        }
    }
}

/// Sets `stop` on SIGINT/SIGTERM and `hup` on SIGHUP.
fn install_signals(stop: Arc<AtomicBool>, hup: Arc<AtomicBool>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    let signals = {
        let _guard = rt.enter();
        (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        )
    };
    let (Ok(mut int), Ok(mut term), Ok(mut hang)) = signals else {
        return;
    };
    std::thread::spawn(move || {
        rt.block_on(async {
            loop {
                tokio::select! {
                    _ = int.recv() => { stop.store(true, Ordering::SeqCst); }
                    _ = term.recv() => { stop.store(true, Ordering::SeqCst); }
                    _ = hang.recv() => { hup.store(true, Ordering::SeqCst); }
                }
            }
        });
    });
}

/// Binds `addr` now (a bad or busy address is a usage error) and serves the
/// latest rendering from a thread of its own.
fn start_prometheus(addr: &str) -> Result<tokio::sync::watch::Sender<Arc<String>>, WatchError> {
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
fn render_prometheus(h: &Heartbeat<'_>) -> String {
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
            "memtrace_watch_metric{{family=\"{}\",metric=\"{}\",unit=\"{}\"}} {}",
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
            "memtrace_watch_metric_slope_per_hour{{metric=\"{}\",label=\"{}\"}} {}",
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
        "# HELP memtrace_watch_target_pid The pid watched (0 while waiting).\n# TYPE memtrace_watch_target_pid gauge\nmemtrace_watch_target_pid {}",
        h.pid.unwrap_or(0)
    );
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
                "memtrace_watch_last_episode_site_bytes{{episode=\"{}\",rank=\"{}\",function=\"{}\"}} {bytes}",
                last.number,
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
    fn fractions_parse_as_percent_or_plain() {
        assert_eq!(parse_fraction("5%"), Ok(0.05));
        assert_eq!(parse_fraction("0.5"), Ok(0.5));
        assert!(parse_fraction("0").is_err());
        assert!(parse_fraction("150%").is_err());
        assert!(parse_fraction("lots").is_err());
    }

    #[test]
    fn prometheus_text_names_state_metrics_and_sites() {
        let views = vec![MetricView {
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
            "memtrace_watch_metric{family=\"process\",metric=\"RssAnon\",unit=\"bytes\"} 1024"
        ));
        assert!(text.contains("memtrace_watch_state{state=\"tracing\"} 1"));
        assert!(text.contains("memtrace_watch_state{state=\"watching\"} 0"));
        assert!(text.contains("memtrace_watch_episodes_total 3"));
        assert!(text.contains("memtrace_watch_target_pid 42"));
        assert!(text.contains("function=\"leak \\\"here\\\"\"} 4096"));
        assert!(text.contains("label=\"growth\"} 3600"));
    }
}
