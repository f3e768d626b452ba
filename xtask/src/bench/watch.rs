//! `cargo xtask bench` section: what `memtrace watch` costs while the
//! target is healthy. redis-server SET throughput (`redis-benchmark -t set`)
//! untraced and under `memtrace watch --pid PID` (no probe attached while
//! healthy), one fresh server per run, the two interleaved in each round;
//! a run in which the watcher started an episode is reported apart, not
//! mixed in. Then the watcher's own CPU time and peak RSS while it watches
//! an idle redis-server at its default settings, measured over a short
//! watch and scaled to an hour (stated so in the table). Runnable alone:
//! `cargo xtask bench --section watch`.

use std::fmt::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::common::Env;
use super::redis::{free_port, median, version, wait_ready, Guard};

/// What the section measured.
pub(super) struct WatchResult {
    requests: u64,
    rounds: usize,
    /// SET requests per second: untraced, under the watcher.
    untraced: Vec<f64>,
    watched: Vec<f64>,
    /// Runs in which the watcher started an episode (left out).
    episodes: usize,
    errors: Vec<String>,
    cost: Result<WatcherCost, String>,
    skipped: Option<String>,
}

/// The watcher's own cost over one measured watch.
struct WatcherCost {
    watched_s: f64,
    cpu_s: f64,
    peak_rss_kib: u64,
}

/// Runs the section (`requests` SET requests per run).
pub(super) fn bench(env: &Env, requests: u64) -> WatchResult {
    let mut result = WatchResult {
        requests,
        rounds: env.rounds,
        untraced: Vec::new(),
        watched: Vec::new(),
        episodes: 0,
        errors: Vec::new(),
        cost: Err("not measured".into()),
        skipped: None,
    };
    for tool in ["redis-server", "redis-benchmark", "redis-cli"] {
        if Command::new(tool).arg("--version").output().is_err() {
            result.skipped = Some(format!(
                "`{tool}` is not installed (Debian `redis-server`, `redis-tools`)"
            ));
            return result;
        }
    }
    for round in 0..env.rounds {
        for watched in [false, true] {
            eprintln!(
                "xtask bench:   round {} redis SET {}",
                round + 1,
                if watched {
                    "under memtrace watch"
                } else {
                    "untraced"
                }
            );
            match set_run(env, requests, watched) {
                Ok((rps, false)) if watched => result.watched.push(rps),
                Ok((rps, _)) if !watched => result.untraced.push(rps),
                Ok(_) => result.episodes += 1,
                Err(e) => result.errors.push(format!("{e:#}")),
            }
        }
    }
    let watch_for = Duration::from_secs(if env.quick { 30 } else { 300 });
    eprintln!("xtask bench:   memtrace watch's own cost over {watch_for:?}");
    result.cost = watcher_cost(env, watch_for).map_err(|e| format!("{e:#}"));
    result
}

/// A redis-server on a free loopback port, ready.
fn start_server(env: &Env) -> Result<(Guard, String, std::path::PathBuf)> {
    let port = free_port()?.to_string();
    let dir = env.work.join(format!("watch-redis-{port}"));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let server = Guard(
        Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--daemonize", "no", "--dir"])
            .arg(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting redis-server")?,
    );
    wait_ready(&port)?;
    Ok((server, port, dir))
}

/// A `memtrace watch --pid PID` with its reports under `dir`, started and
/// past its first sample.
fn start_watch(env: &Env, pid: u32, dir: &Path) -> Result<Guard> {
    let log = std::fs::File::create(dir.join("watch.log")).context("watch.log")?;
    let watch = Guard(
        Command::new(&env.memtrace)
            .args(["watch", "--pid", &pid.to_string(), "--reports"])
            .arg(dir.join("reports"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting memtrace watch")?,
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while !dir.join("reports/heartbeat.json").exists() {
        if Instant::now() > deadline {
            bail!(
                "memtrace watch wrote no heartbeat: {}",
                std::fs::read_to_string(dir.join("watch.log")).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(watch)
}

/// One SET run: requests per second, and whether an episode started.
fn set_run(env: &Env, requests: u64, watched: bool) -> Result<(f64, bool)> {
    let (mut server, port, dir) = start_server(env)?;
    let mut watch = if watched {
        Some(start_watch(env, server.0.id(), &dir)?)
    } else {
        None
    };
    let out = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port, "-t", "set", "-c", "50"])
        .args(["--csv", "-n", &requests.to_string()])
        .output()
        .context("running redis-benchmark")?;
    let csv = String::from_utf8_lossy(&out.stdout).into_owned();
    let rps = csv
        .lines()
        .find(|l| l.starts_with("\"SET\""))
        .and_then(|l| l.split(',').nth(1))
        .and_then(|v| v.trim_matches('"').parse::<f64>().ok())
        .with_context(|| format!("no SET line in redis-benchmark's output: {csv}"))?;
    let episode = dir.join("reports/episode-0001").exists();
    if let Some(w) = watch.as_mut() {
        w.interrupt_and_wait(Duration::from_secs(60))?;
    }
    server.interrupt_and_wait(Duration::from_secs(20))?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok((rps, episode))
}

/// The watcher's CPU seconds and peak RSS over `span` of watching an idle
/// redis-server at the default settings.
fn watcher_cost(env: &Env, span: Duration) -> Result<WatcherCost> {
    let (mut server, _port, dir) = start_server(env)?;
    let mut watch = start_watch(env, server.0.id(), &dir)?;
    let started = Instant::now();
    std::thread::sleep(span);
    let pid = watch.0.id();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).context("watcher's stat")?;
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).context("watcher's status")?;
    let watched_s = started.elapsed().as_secs_f64();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // utime and stime: fields 14 and 15, 12th and 13th after the comm.
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i)?.parse::<f64>().ok())
        .sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let peak_rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    watch.interrupt_and_wait(Duration::from_secs(60))?;
    server.interrupt_and_wait(Duration::from_secs(20))?;
    let _ = std::fs::remove_dir_all(&dir);
    if hz <= 0.0 {
        bail!("no clock tick rate");
    }
    Ok(WatcherCost {
        watched_s,
        cpu_s: ticks / hz,
        peak_rss_kib,
    })
}

/// The section's Markdown.
pub(super) fn render(r: &WatchResult, s: &mut String) {
    let _ = writeln!(s, "## Watching while healthy: memtrace watch\n");
    if let Some(why) = &r.skipped {
        let _ = writeln!(s, "Skipped: {why}.\n");
        return;
    }
    let _ = writeln!(
        s,
        "`redis-server` {} on 127.0.0.1, `redis-benchmark -t set -n {} -c 50 --csv`, one server \
         per run; untraced and under `memtrace watch --pid PID --reports DIR` (defaults: a \
         sample every 5 s, no probe attached while healthy) in {} interleaved rounds, medians. \
         Runs in which the watcher started an episode are left out and counted.\n",
        version(),
        r.requests,
        r.rounds
    );
    let base = median(&r.untraced);
    let watched = median(&r.watched);
    let _ = writeln!(
        s,
        "| configuration | runs | SET req/s | ratio |\n|---|---:|---:|---:|"
    );
    let show = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.0}"));
    let _ = writeln!(
        s,
        "| untraced | {} | {} | 1.00x |",
        r.untraced.len(),
        show(base)
    );
    let ratio = match (watched, base) {
        (Some(w), Some(b)) if b > 0.0 => format!("{:.3}x", w / b),
        _ => "-".into(),
    };
    let _ = writeln!(
        s,
        "| under memtrace watch | {} | {} | {ratio} |",
        r.watched.len(),
        show(watched)
    );
    if r.episodes > 0 {
        let _ = writeln!(
            s,
            "\n{} watched run(s) started an episode: left out.",
            r.episodes
        );
    }
    for e in &r.errors {
        let _ = writeln!(s, "\nfailed: {}", e.replace('\n', " "));
    }
    match &r.cost {
        Ok(c) => {
            let per_hour = c.cpu_s * 3600.0 / c.watched_s.max(1e-9);
            let _ = writeln!(
                s,
                "\nThe watcher's own cost, watching an idle redis-server at the defaults for \
                 {:.0} s (not an hour: the CPU figure is scaled to one): {:.2} CPU s in {:.0} s, \
                 so about **{per_hour:.1} CPU s per hour of watching** ({:.4}% of one CPU); \
                 peak RSS (VmHWM) over that watch {:.1} MiB.\n",
                c.watched_s,
                c.cpu_s,
                c.watched_s,
                per_hour / 36.0,
                c.peak_rss_kib as f64 / 1024.0
            );
        }
        Err(e) => {
            let _ = writeln!(s, "\nThe watcher's own cost: not measured: {e}\n");
        }
    }
}
