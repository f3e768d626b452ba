//! `cargo xtask bench` section: a real workload. Debian's `redis-server`
//! (it links jemalloc) under `redis-benchmark` SET and GET on loopback, with
//! a fixed request count, untraced vs memtrace (default flags) vs memtrace
//! `--stack-depth 0`, in interleaved rounds; the result is the traced /
//! untraced throughput ratio. Also runnable alone: `cargo xtask bench-redis`.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// One traced (or untraced) configuration.
struct Config {
    name: &'static str,
    /// memtrace's flags; `None`: untraced.
    flags: Option<&'static [&'static str]>,
    set: Vec<f64>,
    get: Vec<f64>,
    /// (allocs, frees, lost) per traced run.
    events: Vec<(u64, u64, u64)>,
    errors: Vec<String>,
}

/// Options of the section.
pub struct RedisBench<'a> {
    pub memtrace: &'a Path,
    pub work: &'a Path,
    pub rounds: usize,
    pub requests: u64,
}

/// Runs the section and returns its Markdown (a `## ` heading and a table),
/// or a paragraph saying why it was skipped.
pub fn section(opts: &RedisBench) -> String {
    let mut md = String::from("## Real workload: redis-server under redis-benchmark\n\n");
    for tool in ["redis-server", "redis-benchmark"] {
        if Command::new(tool).arg("--version").output().is_err() {
            let _ = writeln!(
                md,
                "Skipped: `{tool}` is not installed (Debian `redis-server`, `redis-tools`).\n"
            );
            return md;
        }
    }
    let mut configs = vec![
        config("untraced", None),
        config("memtrace", Some(&[])),
        config("memtrace --stack-depth 0", Some(&["--stack-depth", "0"])),
    ];
    for round in 0..opts.rounds {
        for config in configs.iter_mut() {
            eprintln!(
                "xtask bench:   round {} redis {} ({} requests each of SET, GET)",
                round + 1,
                config.name,
                opts.requests
            );
            match one_run(opts, config.flags) {
                Ok(run) => {
                    config.set.push(run.set);
                    config.get.push(run.get);
                    config.events.extend(run.events);
                }
                Err(err) => {
                    eprintln!("xtask bench:   redis {} failed: {err:#}", config.name);
                    config.errors.push(format!("{err:#}"));
                }
            }
        }
    }
    let _ = writeln!(
        md,
        "`redis-server` {} (jemalloc) on 127.0.0.1, `redis-benchmark -t set,get -n {} -c 50 \
         --csv`, one server per run, memtrace attached by pid before the benchmark starts; \
         {} interleaved rounds, medians. Ratio = traced / untraced requests per second.\n",
        version(),
        opts.requests,
        opts.rounds
    );
    md.push_str(
        "| configuration | SET req/s | SET ratio | GET req/s | GET ratio | allocs seen | lost |\n",
    );
    md.push_str("|---|---|---|---|---|---|---|\n");
    let base_set = median(&configs[0].set);
    let base_get = median(&configs[0].get);
    for c in &configs {
        let ratio = |v: Option<f64>, base: Option<f64>| match (v, base) {
            (Some(v), Some(b)) if b > 0.0 => format!("{:.2}x", v / b),
            _ => "-".into(),
        };
        let (set, get) = (median(&c.set), median(&c.get));
        let allocs = c.events.iter().map(|e| e.0).max();
        let lost: u64 = c.events.iter().map(|e| e.2).sum();
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} |",
            c.name,
            set.map_or("-".into(), |v| format!("{v:.0}")),
            ratio(set, base_set),
            get.map_or("-".into(), |v| format!("{v:.0}")),
            ratio(get, base_get),
            if c.flags.is_some() {
                allocs.map_or("-".into(), |a| a.to_string())
            } else {
                "-".into()
            },
            if c.flags.is_some() {
                lost.to_string()
            } else {
                "-".into()
            },
        );
    }
    for c in &configs {
        for err in &c.errors {
            let _ = writeln!(md, "\n{}: failed: {}", c.name, err.replace('\n', " "));
        }
    }
    md.push('\n');
    md
}

fn config(name: &'static str, flags: Option<&'static [&'static str]>) -> Config {
    Config {
        name,
        flags,
        set: Vec::new(),
        get: Vec::new(),
        events: Vec::new(),
        errors: Vec::new(),
    }
}

fn version() -> String {
    Command::new("redis-server")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .find_map(|w| w.strip_prefix("v=").map(str::to_string))
        })
        .unwrap_or_else(|| "?".into())
}

struct Run {
    set: f64,
    get: f64,
    events: Option<(u64, u64, u64)>,
}

/// A child killed (SIGINT first, then SIGKILL) when dropped.
struct Guard(Child);

impl Guard {
    fn interrupt_and_wait(&mut self, timeout: Duration) -> Result<()> {
        // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.0.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
        bail!("did not stop within {timeout:?} after SIGINT")
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding a loopback port")?;
    Ok(listener.local_addr()?.port())
}

fn one_run(opts: &RedisBench, flags: Option<&[&str]>) -> Result<Run> {
    let port = free_port()?.to_string();
    let dir = opts.work.join(format!("redis-{port}"));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut server = Guard(
        Command::new("redis-server")
            .args([
                "--port",
                &port,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--daemonize", "no", "--protected-mode", "yes", "--dir"])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server")?,
    );
    wait_ready(&port)?;
    let report_path: Option<PathBuf> = flags.map(|_| dir.join("report.json"));
    let mut tracer = match (flags, &report_path) {
        (Some(flags), Some(report)) => {
            let mut child = Command::new(opts.memtrace)
                .args([
                    "--pid",
                    &server.0.id().to_string(),
                    "--format",
                    "json",
                    "-o",
                ])
                .arg(report)
                .args(flags)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .context("starting memtrace")?;
            let stderr = child.stderr.take().context("memtrace stderr")?;
            let mut lines = BufReader::new(stderr).lines();
            loop {
                match lines.next() {
                    Some(Ok(line)) if line.contains("memtrace: tracing pid") => break,
                    Some(Ok(_)) => continue,
                    _ => bail!("memtrace ended before attaching"),
                }
            }
            // Keep draining its stderr so it never blocks.
            std::thread::spawn(move || for _ in lines {});
            Some(Guard(child))
        }
        _ => None,
    };
    let out = Command::new("redis-benchmark")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            "set,get",
            "-c",
            "50",
            "--csv",
            "-n",
        ])
        .arg(opts.requests.to_string())
        .output()
        .context("running redis-benchmark")?;
    if !out.status.success() {
        bail!(
            "redis-benchmark failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let csv = String::from_utf8_lossy(&out.stdout).into_owned();
    let rps = |test: &str| -> Result<f64> {
        csv.lines()
            .find(|l| l.starts_with(&format!("\"{test}\"")))
            .and_then(|l| l.split(',').nth(1))
            .and_then(|v| v.trim_matches('"').parse().ok())
            .with_context(|| format!("no {test} line in redis-benchmark's output: {csv}"))
    };
    let (set, get) = (rps("SET")?, rps("GET")?);
    let mut events = None;
    if let (Some(tracer), Some(path)) = (tracer.as_mut(), &report_path) {
        tracer.interrupt_and_wait(Duration::from_secs(60))?;
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let json: Value = serde_json::from_str(&text).context("memtrace's report")?;
        let num = |v: &Value| v.as_u64().unwrap_or(0);
        events = Some((
            num(&json["events"]["allocs"]),
            num(&json["events"]["frees"]),
            num(&json["events"]["lost"]),
        ));
    }
    drop(tracer);
    server.interrupt_and_wait(Duration::from_secs(20))?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Run { set, get, events })
}

fn wait_ready(port: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let ping = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", port, "ping"])
            .output();
        if ping.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("PONG")) {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("redis-server did not answer PING on port {port}")
}

fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    })
}
