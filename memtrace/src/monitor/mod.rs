//! Soak-test monitor: samples process, kernel and GPU memory over time and
//! judges the curves (`memtrace monitor`).
//!
//! This file owns the command line ([`MonitorArgs`]) and [`run`], which wires
//! the pieces: `runner` (sampling loop), `sources` (procfs and GPU readers),
//! `series` (the recording), `verdict` (trend labels), `release` (memory
//! returned after a command), `store` (CSV/JSON), `plot` (SVG/PNG) and
//! `report` (the printed summary and the `--fail-on` gate); `sensitivity`
//! holds the verdict options `memtrace watch` shares.

mod error;
mod html;
mod plot;
mod release;
mod report;
mod runner;
pub(crate) mod sensitivity;
pub(crate) mod series;
pub(crate) mod sources;
mod store;
#[cfg(test)]
pub(crate) mod testutil;
pub(crate) mod units;
pub(crate) mod verdict;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};

use crate::duration::parse_duration;
use error::MonitorError;
pub use sensitivity::Sensitivity;
use series::Recording;
use units::parse_size;

const AFTER_HELP: &str = "\
Labels (per metric, after --warmup; thresholds below):
  stable       no significant trend, step or spread
  growth       steady growth at or above --growth-rate (bytes/h; counts: --growth-rate-count)
  slow-growth  significant steady growth below that rate
  jump         an upward level shift larger than --jump-k x the noise and the minimum change
  jitter       robust spread around a flat trend >= --jitter-rel x the level
  shrink       significant steady decrease;  too-short: fewer than 6 points
  A trend is significant when slope x window >= max(--min-change, --min-change-rel x level)
  and >= --noise-k x the robust noise (Theil-Sen slope, MAD of residuals).

Release check (with -- CMD): system MemUsed (MemTotal-MemAvailable), Shmem and GPU
device 'used' figures after each run has settled (--settle) are compared with the
baseline sampled before the first run; more than --release-tolerance above it is
'not-released'. --cycles N runs the command N times.

Files: --output FILE.csv|FILE.json, --plot FILE.svg|FILE.png, --html FILE.html (one page).
Offline: memtrace monitor analyze FILE [--warmup D] [--plot P] [--html H] [--fail-on ...]
re-judges and re-plots a saved recording.

Exit codes:
  0  done, gate passed
  1  error (unreadable root, unwritable output, malformed recording...)
  2  usage error (no target, no such pid, command cannot start, bad option)
  3  a --fail-on gate failed

Examples:
  memtrace monitor --name smengine_demo --duration 8h --output mem.csv --plot mem.svg
  memtrace monitor --pid 1234 --interval 5s --fail-on growth,slow-growth,jump
  memtrace monitor --cycles 5 --settle 3s --fail-on not-released -- ./my_test
  memtrace monitor --gpu-cmd 'mx-smi --show-memory' -- ./infer model.bin";

/// Options of `memtrace monitor`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, after_help = AFTER_HELP)]
pub struct MonitorArgs {
    #[command(subcommand)]
    pub action: Option<MonitorAction>,

    /// Watch this process (stops when it exits).
    #[arg(short, long, conflicts_with_all = ["name", "command"])]
    pub pid: Option<u32>,

    /// Watch every process with this name (comm or argv0 basename), following
    /// restarts: each new pid is a new segment.
    #[arg(short, long, conflicts_with = "command")]
    pub name: Option<String>,

    /// Time between samples.
    #[arg(short, long, value_parser = parse_duration, default_value = "1s")]
    pub interval: Duration,

    /// Stop after this long (default: until the target ends or Ctrl-C).
    #[arg(short, long, value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// After a launched command exits, keep sampling this long (release check).
    #[arg(long, value_parser = parse_duration, default_value = "2s")]
    pub settle: Duration,

    /// Run the command N times (requires -- CMD).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub cycles: u32,

    /// Save the samples to FILE (.csv or .json).
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,

    /// Vendor command printing GPU/NPU memory as `key: value [unit]` or
    /// `key=value` (e.g. 'mx-smi --show-memory'); run every sample.
    #[arg(long, value_name = "CMD")]
    pub gpu_cmd: Option<String>,

    /// Do not load NVML.
    #[arg(long)]
    pub no_nvml: bool,

    /// Read processes and meminfo under DIR instead of /proc.
    #[arg(long, value_name = "DIR", default_value = "/proc")]
    pub proc_root: PathBuf,

    /// Read DRM sysfs under DIR instead of /sys.
    #[arg(long, value_name = "DIR", default_value = "/sys")]
    pub sysfs_root: PathBuf,

    /// No progress bar even on a terminal.
    #[arg(long)]
    pub no_progress: bool,

    #[command(flatten)]
    pub judge: JudgeArgs,

    /// Command to launch and watch.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Sub-subcommands of `memtrace monitor`.
#[derive(Debug, Subcommand)]
pub enum MonitorAction {
    /// Re-judge (and re-plot) a recording saved with --output.
    Analyze(AnalyzeArgs),
}

/// Options of `memtrace monitor analyze`.
#[derive(Debug, Args)]
#[command(after_help = AFTER_HELP)]
pub struct AnalyzeArgs {
    /// Recording (.csv or .json) written by `memtrace monitor --output`.
    pub file: PathBuf,

    /// Save the recording again (convert CSV <-> JSON, JSON gets new verdicts).
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,

    #[command(flatten)]
    pub judge: JudgeArgs,
}

/// Labels that `--fail-on` turns into exit code 3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Gate {
    Growth,
    SlowGrowth,
    Jump,
    Jitter,
    /// Memory not back to baseline after a launched command (release check).
    NotReleased,
}

/// Which metrics the trend gates look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Scope {
    /// The watched processes (process and per-process GPU metrics).
    Target,
    /// Every metric, including system-wide and GPU device figures.
    All,
}

/// Judging, gating and plotting options (shared with `analyze`).
#[derive(Debug, Args)]
pub struct JudgeArgs {
    /// Ignore this much at the start of each segment [default: 0s; analyze: as recorded].
    #[arg(long, value_parser = parse_duration)]
    pub warmup: Option<Duration>,

    /// Draw the curves to FILE (.svg or .png).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,

    /// Write the soak report as one self-contained HTML page to FILE: the
    /// gate result, the verdicts, every curve with its trend, the segments
    /// and the sources.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,

    /// Exit with code 3 when a metric gets one of these labels (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', value_name = "LABELS")]
    pub fail_on: Vec<Gate>,

    /// Metrics the trend gates apply to.
    #[arg(long, value_enum, default_value_t = Scope::Target)]
    pub fail_scope: Scope,

    /// How sensitive the verdicts are.
    #[command(flatten)]
    pub sensitivity: Sensitivity,

    /// How far above baseline memory may stay after a command (release check).
    #[arg(long, value_parser = parse_size, default_value = "32MiB", value_name = "SIZE")]
    pub release_tolerance: f64,
}

impl JudgeArgs {
    fn thresholds(&self) -> verdict::Thresholds {
        self.sensitivity.thresholds()
    }

    /// Checks the file extensions and that the plot can be written.
    fn check_plot(&self) -> Result<(), MonitorError> {
        if let Some(p) = &self.plot {
            if plot::PlotKind::from_path(p).is_none() {
                return Err(MonitorError::Usage(format!(
                    "--plot {}: use a .svg or .png file name",
                    p.display()
                )));
            }
            store::probe_writable(p)?;
        }
        if let Some(p) = &self.html {
            store::probe_writable(p)?;
        }
        Ok(())
    }
}

fn check_output(path: &Option<PathBuf>) -> Result<(), MonitorError> {
    if let Some(p) = path {
        if store::FileKind::from_path(p).is_none() {
            return Err(MonitorError::Usage(format!(
                "--output {}: use a .csv or .json file name",
                p.display()
            )));
        }
        store::probe_writable(p)?;
    }
    Ok(())
}

/// Runs the monitor.
pub fn run(args: MonitorArgs) -> anyhow::Result<ExitCode> {
    let result = match args.action {
        Some(MonitorAction::Analyze(a)) => analyze(a),
        None => monitor(args),
    };
    match result {
        Ok(code) => Ok(code),
        Err(e) if e.is_usage() => {
            eprintln!("memtrace: {e}");
            Ok(ExitCode::from(2))
        }
        Err(e) => Err(anyhow::Error::new(e)).context("monitor"),
    }
}

fn monitor(args: MonitorArgs) -> Result<ExitCode, MonitorError> {
    let target = match (&args.pid, &args.name, args.command.is_empty()) {
        (Some(pid), None, true) => runner::Target::Pid(*pid),
        (None, Some(name), true) if !name.is_empty() => runner::Target::Name(name.clone()),
        (None, None, false) => runner::Target::Command(args.command.clone()),
        _ => return Err(MonitorError::Usage(
            "no target: give --pid PID, --name NAME or -- CMD [ARGS] (see memtrace monitor --help)"
                .into(),
        )),
    };
    if args.cycles > 1 && !matches!(target, runner::Target::Command(_)) {
        return Err(MonitorError::Usage(
            "--cycles needs a command: -- CMD [ARGS]".into(),
        ));
    }
    if args.interval.is_zero() {
        return Err(MonitorError::Usage("--interval must be more than 0".into()));
    }
    check_output(&args.output)?;
    args.judge.check_plot()?;
    let proc_root = procfs_root(&args.proc_root)?;
    if args.sysfs_root != Path::new("/sys") {
        sources::procfs::check_root(&args.sysfs_root).map_err(|source| MonitorError::Root {
            what: "sysfs",
            path: args.sysfs_root.clone(),
            source,
        })?;
    }
    let command_timeout = args.interval.max(Duration::from_secs(5));
    let (gpu, mut source_lines) = sources::gpu::GpuSources::probe(
        &args.sysfs_root,
        args.gpu_cmd.as_deref(),
        !args.no_nvml,
        command_timeout,
    );
    source_lines.insert(0, format!("procfs {}", proc_root.display()));
    let warmup = args.judge.warmup.unwrap_or(Duration::ZERO);
    let meta = series::Meta {
        target: match &target {
            runner::Target::Pid(p) => format!("pid {p}"),
            runner::Target::Name(n) => format!("name {n}"),
            runner::Target::Command(c) => format!("command {}", c.join(" ")),
        },
        interval_s: args.interval.as_secs_f64(),
        warmup_s: warmup.as_secs_f64(),
        settle_s: args.settle.as_secs_f64(),
        cycles: args.cycles,
        started_unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        sources: source_lines,
    };
    let cfg = runner::Config {
        target,
        interval: args.interval,
        duration: args.duration,
        settle: args.settle,
        cycles: args.cycles,
        proc_root,
        gpu,
        progress: !args.no_progress && std::io::stderr().is_terminal(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    crate::signals::set_flags_on_signals(stop.clone(), None);
    let rec = runner::run(&cfg, meta, &stop)?;
    finish(&rec, &args.judge, args.output.as_deref())
}

fn procfs_root(path: &Path) -> Result<PathBuf, MonitorError> {
    sources::procfs::check_root(path).map_err(|source| MonitorError::Root {
        what: "proc",
        path: path.to_path_buf(),
        source,
    })?;
    if !path.join("meminfo").exists() {
        return Err(MonitorError::Root {
            what: "proc",
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no meminfo in it"),
        });
    }
    Ok(path.to_path_buf())
}

fn analyze(args: AnalyzeArgs) -> Result<ExitCode, MonitorError> {
    check_output(&args.output)?;
    args.judge.check_plot()?;
    let mut rec = store::load(&args.file)?;
    if let Some(w) = args.judge.warmup {
        rec.meta.warmup_s = w.as_secs_f64();
    }
    finish(&rec, &args.judge, args.output.as_deref())
}

/// Judges, prints the summary, writes the files and applies the gate.
fn finish(
    rec: &Recording,
    judge: &JudgeArgs,
    output: Option<&Path>,
) -> Result<ExitCode, MonitorError> {
    let th = judge.thresholds();
    let verdicts: Vec<verdict::Verdict> = rec
        .series
        .iter()
        .map(|s| {
            let from = rec.segment_start(s.segment) + rec.meta.warmup_s;
            verdict::judge(s, from, &th)
        })
        .collect();
    let release = release::check(rec, judge.release_tolerance);
    let gate = report::gate(
        &verdicts,
        release.as_ref(),
        &judge.fail_on,
        judge.fail_scope,
    );
    let mut out = String::new();
    report::summary(
        &mut out,
        rec,
        &verdicts,
        release.as_ref(),
        &gate,
        &judge.fail_on,
    );
    print!("{out}");
    if let Some(path) = output {
        store::save(path, rec, &verdicts, release.as_ref())?;
        eprintln!("memtrace: wrote {}", path.display());
    }
    if let Some(path) = &judge.plot {
        if let Some(note) = plot::plot(path, rec, &verdicts)? {
            eprintln!("memtrace: {note}");
        }
        eprintln!("memtrace: wrote {}", path.display());
    }
    if let Some(path) = &judge.html {
        let judged = html::Judged {
            verdicts: &verdicts,
            release: release.as_ref(),
            failures: &gate,
            fail_on: &judge.fail_on,
        };
        html::write(path, rec, &judged)?;
        eprintln!("memtrace: wrote {}", path.display());
    }
    Ok(if gate.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}
