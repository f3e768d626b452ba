//! `cargo xtask soak`: memtrace's own memory over a long steady trace.
//!
//! Runs the `soak` bench program (steady allocator churn, bounded live set,
//! 64 recurring call paths) traced by the release memtrace, while
//! `memtrace monitor` samples memtrace itself, and fails when memtrace's
//! memory is judged to grow (`--fail-on growth,slow-growth,jump`). Prints the
//! monitor's verdict table; RELIABILITY.md records the figures.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use clap::Args;

use super::{root, run};

/// Options of `cargo xtask soak`.
#[derive(Debug, Args)]
pub struct SoakArgs {
    /// Minutes of steady load (the issue asks for 30).
    #[arg(long, default_value_t = 30)]
    minutes: u64,
    /// Allocator events per second.
    #[arg(long, default_value_t = 20_000)]
    events_per_s: u64,
    /// Where the monitor's samples go (CSV).
    #[arg(long, default_value = "target/soak/monitor.csv")]
    samples: PathBuf,
}

pub fn soak(args: SoakArgs) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("cargo xtask soak attaches uprobes: run it as root");
    }
    let root = root();
    super::build_release()?;
    let fixtures = super::fixtures()?;
    run(Command::new("make")
        .args(["-s", "-f"])
        .arg(root.join("tests/fixtures/bench/bench.mk"))
        .arg(format!("OUT={}", fixtures.display()))
        .arg("bench"))?;
    let memtrace = crate::release_binary();
    let work = root.join("target/soak");
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let seconds = args.minutes.max(1) * 60;

    let mut workload = Command::new(fixtures.join("bench/soak"))
        .args([args.events_per_s.to_string(), seconds.to_string()])
        .args(["120", "5"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the soak program")?;
    let mut lines = BufReader::new(workload.stdout.take().context("soak stdout")?).lines();
    let ready = lines.next().transpose()?.unwrap_or_default();
    let Some(pid) = ready.strip_prefix("ready ").map(str::trim) else {
        bail!("soak program said {ready:?}");
    };
    let mut tracer = Command::new(&memtrace)
        .args(["--pid", pid, "--duration"])
        .arg(format!("{}s", seconds + 30))
        .args(["--format", "json", "--output"])
        .arg(work.join("report.json"))
        .stderr(Stdio::piped())
        .spawn()
        .context("starting memtrace")?;
    let mut tracer_err = BufReader::new(tracer.stderr.take().context("memtrace stderr")?);
    let mut line = String::new();
    while !line.contains("memtrace: tracing") {
        line.clear();
        if tracer_err.read_line(&mut line)? == 0 {
            bail!("memtrace ended before attaching");
        }
    }
    let samples = if args.samples.is_absolute() {
        args.samples.clone()
    } else {
        root.join(&args.samples)
    };
    let mut monitor = Command::new(&memtrace)
        .args(["monitor", "--pid", &tracer.id().to_string()])
        .args(["--interval", "5s", "--warmup", "60s", "--duration"])
        .arg(format!("{}s", seconds + 10))
        .args(["--no-progress", "--fail-on", "growth,slow-growth,jump"])
        .arg("--output")
        .arg(&samples)
        .spawn()
        .context("starting memtrace monitor")?;
    eprintln!(
        "xtask soak: {} events/s for {} min; memtrace pid {} watched by memtrace monitor",
        args.events_per_s,
        args.minutes,
        tracer.id()
    );
    let mut go = workload.stdin.take().context("soak stdin")?;
    go.write_all(b"\n")?;
    for line in lines.map_while(Result::ok) {
        eprintln!("xtask soak: {line}");
    }
    let _ = go.write_all(b"\n");
    workload.wait()?;
    let traced = tracer.wait()?;
    let verdict = monitor.wait()?;
    if !traced.success() {
        bail!("memtrace failed: {traced}");
    }
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(work.join("report.json"))?)
            .context("memtrace's report")?;
    eprintln!(
        "xtask soak: memtrace saw {} events, lost {}",
        report["events"]["allocs"].as_u64().unwrap_or(0)
            + report["events"]["frees"].as_u64().unwrap_or(0),
        report["events"]["lost"]
    );
    match verdict.code() {
        Some(0) => Ok(()),
        Some(3) => bail!("memtrace's own memory was judged to grow (see the table above)"),
        _ => bail!("memtrace monitor failed: {verdict}"),
    }
}
