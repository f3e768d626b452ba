//! `cargo xtask bench` section: `mallocbench` (malloc(64)+free pairs) under
//! each heap allocator a service ships with — glibc, and Debian's jemalloc,
//! tcmalloc and mimalloc preloaded — untraced, traced with probes placed on
//! emulated instructions (memtrace's default), and traced with every probe at
//! its function's entry (`--entry-probes`, what a tracer without placement
//! pays). Also runnable alone: `cargo xtask bench --section
//! allocators` (or `cargo xtask bench-allocators`).

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const LIBDIR: &str = "/usr/lib/x86_64-linux-gnu";

/// Options of the section.
pub struct AllocatorBench<'a> {
    pub memtrace: &'a Path,
    /// The built `mallocbench`.
    pub mallocbench: &'a Path,
    pub rounds: usize,
}

struct Row {
    allocator: &'static str,
    preload: Option<String>,
    /// ns per pair: untraced, placed, entry.
    samples: [Vec<f64>; 3],
    errors: Vec<String>,
}

const CONFIGS: [(&str, Option<&[&str]>, u64); 3] = [
    ("untraced", None, 5_000_000),
    ("placed", Some(&["--stack-depth", "0"]), 100_000),
    (
        "entry",
        Some(&["--stack-depth", "0", "--entry-probes"]),
        50_000,
    ),
];

/// Runs the section and returns its Markdown.
pub fn section(opts: &AllocatorBench) -> String {
    let mut md = String::from("## mallocbench under each heap allocator\n\n");
    let mut rows = vec![Row {
        allocator: "glibc",
        preload: None,
        samples: Default::default(),
        errors: Vec::new(),
    }];
    for (allocator, file) in [
        ("jemalloc", "libjemalloc.so.2"),
        ("tcmalloc", "libtcmalloc.so.4"),
        ("mimalloc", "libmimalloc.so.2"),
    ] {
        let path = format!("{LIBDIR}/{file}");
        if Path::new(&path).exists() {
            rows.push(Row {
                allocator,
                preload: Some(path),
                samples: Default::default(),
                errors: Vec::new(),
            });
        } else {
            let _ = writeln!(md, "{allocator}: skipped, {path} is not installed.\n");
        }
    }
    for round in 0..opts.rounds {
        for row in rows.iter_mut() {
            for (i, (name, flags, pairs)) in CONFIGS.iter().enumerate() {
                eprintln!(
                    "xtask bench:   round {} mallocbench {} {name} ({pairs} pairs)",
                    round + 1,
                    row.allocator
                );
                match run(opts, row.preload.as_deref(), *flags, *pairs) {
                    Ok(ns) => row.samples[i].push(ns),
                    Err(err) => {
                        eprintln!("xtask bench:   {} {name} failed: {err:#}", row.allocator);
                        row.errors.push(format!("{name}: {err:#}"));
                    }
                }
            }
        }
    }
    let _ = writeln!(
        md,
        "ns per malloc(64)+free pair, medians of {} interleaved rounds; the allocator \
         preloaded (`LD_PRELOAD`) into `mallocbench`; memtrace with `--stack-depth 0`, probes \
         placed (default) or all at the entry (`--entry-probes`).\n",
        opts.rounds
    );
    md.push_str(
        "| allocator | untraced | placed | entry | placed / entry |\n|---|---|---|---|---|\n",
    );
    for row in &rows {
        let m: Vec<Option<f64>> = row.samples.iter().map(|s| median(s)).collect();
        let fmt = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0}"));
        let ratio = match (m[1], m[2]) {
            (Some(p), Some(e)) if e > 0.0 => format!("{:.2}", p / e),
            _ => "-".into(),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {ratio} |",
            row.allocator,
            fmt(m[0]),
            fmt(m[1]),
            fmt(m[2])
        );
    }
    for row in &rows {
        for err in &row.errors {
            let _ = writeln!(md, "\n{}: {}", row.allocator, err.replace('\n', " "));
        }
    }
    md.push('\n');
    md
}

/// A child killed when dropped.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn lines_of<R: std::io::Read + Send + 'static>(stream: R) -> Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn wait_for(
    rx: &Receiver<String>,
    timeout: Duration,
    pred: impl Fn(&str) -> bool,
) -> Result<String> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if pred(&line) => return Ok(line),
            Ok(_) => continue,
            Err(_) => bail!("no expected line within {timeout:?}"),
        }
    }
}

fn run(
    opts: &AllocatorBench,
    preload: Option<&str>,
    flags: Option<&[&str]>,
    pairs: u64,
) -> Result<f64> {
    let mut cmd = Command::new(opts.mallocbench);
    cmd.args([pairs.to_string().as_str(), "60", "30"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(lib) = preload {
        cmd.env("LD_PRELOAD", lib);
    }
    let mut bench = Guard(cmd.spawn().context("starting mallocbench")?);
    let mut stdin: ChildStdin = bench.0.stdin.take().context("stdin")?;
    let out = lines_of(bench.0.stdout.take().context("stdout")?);
    wait_for(&out, Duration::from_secs(30), |l| l.starts_with("ready "))?;
    let tracer = match flags {
        Some(flags) => {
            let mut child = Command::new(opts.memtrace)
                .args([
                    "--pid",
                    &bench.0.id().to_string(),
                    "--format",
                    "json",
                    "-o",
                    "/dev/null",
                ])
                .args(flags)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .context("starting memtrace")?;
            let err = lines_of(child.stderr.take().context("stderr")?);
            let tracer = Guard(child);
            wait_for(&err, Duration::from_secs(90), |l| {
                l.contains("memtrace: tracing pid")
            })?;
            Some(tracer)
        }
        None => None,
    };
    stdin.write_all(b"\n").and_then(|_| stdin.flush())?;
    let line = wait_for(&out, Duration::from_secs(180), |l| {
        l.starts_with("ns_per_pair")
    })?;
    let ns: f64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("cannot parse '{line}'"))?;
    if let Some(mut tracer) = tracer {
        // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
        unsafe { libc::kill(tracer.0.id() as i32, libc::SIGINT) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while tracer.0.try_wait()?.is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    drop(stdin);
    Ok(ns)
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
