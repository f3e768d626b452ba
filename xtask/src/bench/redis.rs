//! `cargo xtask bench` section: a real workload. Debian's `redis-server`
//! (it links jemalloc) under `redis-benchmark` SET, GET and LPUSH on
//! loopback, with a fixed request count, untraced vs memtrace (default,
//! `--stack-depth 0`, `--sample-rate 100`) vs bcc memleak vs bpftrace's
//! empty probes, in interleaved rounds; the result is the traced / untraced
//! throughput ratio. Also runnable alone: `cargo xtask bench --section redis`
//! (or `cargo xtask bench-redis`).

use std::fmt::Write as _;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::common::{attach_with, memtrace_flags, Peers, Tracer};

/// How one configuration runs the server.
enum Setup {
    Untraced,
    /// A tracer attached by pid (memtrace, bcc memleak, bpftrace), or why
    /// it is unavailable here.
    Traced(Result<Tracer, String>),
}

/// One traced (or untraced) configuration.
struct Config {
    name: &'static str,
    how: String,
    setup: Setup,
    /// Requests per second per test, one entry per run.
    rps: Vec<[f64; TESTS.len()]>,
    /// (allocs, frees, lost) per memtrace run.
    events: Vec<(u64, u64, u64)>,
    errors: Vec<String>,
}

/// The redis-benchmark tests run, in its `-t` spelling and its CSV's.
const TESTS: [(&str, &str); 3] = [("set", "SET"), ("get", "GET"), ("lpush", "LPUSH")];

/// Options of the section.
pub struct RedisBench<'a> {
    pub memtrace: &'a Path,
    pub work: &'a Path,
    pub rounds: usize,
    pub requests: u64,
    pub peers: &'a Peers,
}

/// The allocator object redis-server calls: Debian links jemalloc; the
/// peers probe it there (libc otherwise).
const ALLOCATOR_OBJECT: &str = "libjemalloc";

/// What the section found.
pub struct RedisResult {
    /// A `## ` heading and a table, or a paragraph saying why it was skipped.
    pub markdown: String,
    /// memtrace default's SET throughput / untraced.
    pub set_ratio: Option<f64>,
}

/// Runs the section.
pub fn section(opts: &RedisBench) -> RedisResult {
    let mut set_ratio = None;
    let md = markdown(opts, &mut set_ratio);
    RedisResult {
        markdown: md,
        set_ratio,
    }
}

fn markdown(opts: &RedisBench, set_ratio: &mut Option<f64>) -> String {
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
    let object = jemalloc_object();
    let peer_object = object.clone().unwrap_or_else(|| "libc".into());
    let memtrace = |flags: &[&str]| Setup::Traced(Ok(memtrace_flags(flags)));
    let mut configs = vec![
        config("untraced", "no tracer", Setup::Untraced),
        config("memtrace default", "`memtrace --pid PID`", memtrace(&[])),
        config(
            "memtrace --stack-depth 0",
            "`memtrace --pid PID --stack-depth 0`",
            memtrace(&["--stack-depth", "0"]),
        ),
        config(
            "memtrace --sample-rate 100",
            "`memtrace --pid PID --sample-rate 100`",
            memtrace(&["--sample-rate", "100"]),
        ),
        config(
            "bcc memleak",
            "`memleak-bpfcc -p PID -O JEMALLOC 2` (stacks, every allocator function it knows)",
            Setup::Traced(opts.peers.memleak(Some(&peer_object))),
        ),
        config(
            "bpftrace empty probes",
            "`bpftrace -p PID`, empty malloc entry+return and free entry probes on jemalloc",
            Setup::Traced(opts.peers.bpftrace(&peer_object)),
        ),
    ];
    let tests: Vec<&str> = TESTS.iter().map(|t| t.0).collect();
    for round in 0..opts.rounds {
        for config in configs.iter_mut() {
            let tracer = match &config.setup {
                Setup::Untraced => None,
                Setup::Traced(Ok(tracer)) => Some(tracer),
                Setup::Traced(Err(_)) => continue,
            };
            eprintln!(
                "xtask bench:   round {} redis {} ({} requests each of {})",
                round + 1,
                config.name,
                opts.requests,
                tests.join(", ")
            );
            match one_run(opts, tracer) {
                Ok(run) => {
                    config.rps.push(run.rps);
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
        "`redis-server` {} ({}) on 127.0.0.1, `redis-benchmark -t {} -n {} -c 50 \
         --csv`, one server per run, the tracer attached by pid before the benchmark starts; \
         {} interleaved rounds, medians. Ratio = traced / untraced requests per second.\n",
        version(),
        object.as_deref().unwrap_or("libc malloc"),
        tests.join(","),
        opts.requests,
        opts.rounds
    );
    md.push_str("| configuration | how | runs |");
    for (_, test) in TESTS {
        let _ = write!(md, " {test} req/s | {test} ratio |");
    }
    md.push_str(" allocs seen | lost |\n|---|---|---:|");
    for _ in TESTS {
        md.push_str("---:|---:|");
    }
    md.push_str("---:|---:|\n");
    let base: Vec<Option<f64>> = (0..TESTS.len())
        .map(|t| median(&configs[0].rps.iter().map(|r| r[t]).collect::<Vec<_>>()))
        .collect();
    for c in &configs {
        let _ = write!(md, "| {} | {} | {} |", c.name, c.how, c.rps.len());
        for (t, base) in base.iter().enumerate() {
            let value = median(&c.rps.iter().map(|r| r[t]).collect::<Vec<_>>());
            let ratio = match (value, base) {
                (Some(v), Some(b)) if *b > 0.0 => {
                    if t == 0 && c.name == "memtrace default" {
                        *set_ratio = Some(v / b);
                    }
                    format!("{:.2}x", v / b)
                }
                _ => "-".into(),
            };
            let _ = write!(
                md,
                " {} | {ratio} |",
                value.map_or("-".into(), |v| format!("{v:.0}"))
            );
        }
        let memtrace = matches!(c.setup, Setup::Traced(Ok(Tracer::Memtrace { .. })));
        let allocs = c.events.iter().map(|e| e.0).max();
        let lost: u64 = c.events.iter().map(|e| e.2).sum();
        let _ = writeln!(
            md,
            " {} | {} |",
            match (memtrace, allocs) {
                (true, Some(a)) => a.to_string(),
                _ => "-".into(),
            },
            if memtrace {
                lost.to_string()
            } else {
                "n/a".into()
            },
        );
    }
    for c in &configs {
        if let Setup::Traced(Err(why)) = &c.setup {
            let _ = writeln!(md, "\n{}: unavailable: {why}", c.name);
        }
        for err in &c.errors {
            let _ = writeln!(md, "\n{}: failed: {}", c.name, err.replace('\n', " "));
        }
    }
    md.push('\n');
    md
}

fn config(name: &'static str, how: &str, setup: Setup) -> Config {
    Config {
        name,
        how: how.to_string(),
        setup,
        rps: Vec::new(),
        events: Vec::new(),
        errors: Vec::new(),
    }
}

/// Debian's libjemalloc, as redis-server loads it (None: not installed).
fn jemalloc_object() -> Option<String> {
    let out = Command::new("ldd")
        .arg(which("redis-server")?)
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|line| {
            let path = line.split("=>").nth(1)?.split_whitespace().next()?;
            path.contains(ALLOCATOR_OBJECT).then(|| path.to_string())
        })
}

fn which(program: &str) -> Option<String> {
    let out = Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .ok()?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!path.is_empty()).then_some(path)
}

pub(super) fn version() -> String {
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
    rps: [f64; TESTS.len()],
    events: Option<(u64, u64, u64)>,
}

/// A child killed (SIGINT first, then SIGKILL) when dropped.
pub(super) struct Guard(pub(super) Child);

impl Guard {
    pub(super) fn interrupt_and_wait(&mut self, timeout: Duration) -> Result<()> {
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

pub(super) fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding a loopback port")?;
    Ok(listener.local_addr()?.port())
}

fn one_run(opts: &RedisBench, tracer: Option<&Tracer>) -> Result<Run> {
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
    let attached = match tracer {
        Some(tracer) => Some(attach_with(
            opts.memtrace,
            opts.work,
            tracer,
            server.0.id() as i32,
        )?),
        None => None,
    };
    let tests: Vec<&str> = TESTS.iter().map(|t| t.0).collect();
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port, "-t"])
        .arg(tests.join(","))
        .args(["-c", "50", "--csv", "-n"])
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
    let mut values = [0.0; TESTS.len()];
    for (value, (_, test)) in values.iter_mut().zip(TESTS) {
        *value = rps(test)?;
    }
    let events = match attached {
        Some(attached) => attached
            .stop()?
            .map(|report| (report.allocs, report.frees, report.lost)),
        None => None,
    };
    server.interrupt_and_wait(Duration::from_secs(20))?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Run {
        rps: values,
        events,
    })
}

pub(super) fn wait_ready(port: &str) -> Result<()> {
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

pub(super) fn median(values: &[f64]) -> Option<f64> {
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
