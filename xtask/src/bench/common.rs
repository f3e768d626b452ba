//! What every bench section shares: the run's environment ([`Env`]), the
//! tracers and peers a section attaches ([`Tracer`], [`Peers`], [`attach_with`]),
//! memtrace's JSON report ([`Report`]), one measured run ([`traced_run`]) and
//! the statistics and Markdown formatting the tables use.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde_json::Value;

use super::peers;
use super::proc::{Proc, Stream};

/// Seconds one measured loop should take (traced runs are resized to it).
pub(crate) const TARGET_LOOP_S: f64 = 0.5;

pub(crate) struct Env {
    pub(crate) memtrace: PathBuf,
    pub(crate) fixtures: PathBuf,
    pub(crate) bin: PathBuf,
    pub(crate) work: PathBuf,
    pub(crate) quick: bool,
    pub(crate) rounds: usize,
    /// Rounds of the per-pair tables.
    pub(crate) pair_rounds: usize,
    pub(crate) has_allocators: bool,
    pub(crate) has_follow_forks: bool,
}

impl Env {
    pub(crate) fn program(&self, name: &str) -> Command {
        Command::new(self.bin.join(name))
    }
}

/// The first number after `key` in a line such as `ns_per_pair 12.5`.
pub(crate) fn value_after(line: &str, key: &str) -> Option<f64> {
    let mut words = line.split_whitespace();
    while let Some(word) = words.next() {
        if word == key {
            return words.next()?.parse().ok();
        }
    }
    None
}

// --- tracers ----------------------------------------------------------------

#[derive(Clone, Debug)]
pub(crate) enum Tracer {
    None,
    /// memtrace with these extra flags and environment (the build of its
    /// eBPF programs forced by `MEMTRACE_EBPF_VARIANT`, its hashed in-flight
    /// slots by `MEMTRACE_THREAD_STORAGE=0`; empty: what the kernel gets).
    Memtrace {
        flags: Vec<String>,
        env: Vec<(&'static str, &'static str)>,
    },
    /// bpftrace's empty probes on this object's malloc (entry and return)
    /// and free (entry): the naive floor.
    Bpftrace(String),
    /// bcc's memleak by pid: the kernel headers it compiles against
    /// (BCC_KERNEL_SOURCE, None: the kernel's own) and the allocator object
    /// it probes (`-O`; None: its default, libc).
    Memleak {
        headers: Option<PathBuf>,
        object: Option<String>,
    },
}

/// The bpftrace floor's script for the allocator in `object` ("libc" or a path).
pub(crate) fn bpftrace_script(object: &str) -> String {
    format!(
        "BEGIN {{ printf(\"bench-attached\\n\"); }} \
         uprobe:{object}:malloc {{}} uretprobe:{object}:malloc {{}} uprobe:{object}:free {{}}"
    )
}

/// Where bcc and bpftrace are, found (and installed when allowed) once.
pub(crate) struct Peers {
    pub bpftrace: Result<(), String>,
    pub memleak: Result<Option<PathBuf>, String>,
}

impl Peers {
    /// Finds the peers, installing Debian's packages unless `no_install`.
    pub(crate) fn find(no_install: bool) -> Peers {
        let (bpftrace, memleak) = peers::find(no_install);
        Peers { bpftrace, memleak }
    }

    /// Peers not looked for (a section that runs none).
    pub(crate) fn unchecked() -> Peers {
        let why = || "not checked".to_string();
        Peers {
            bpftrace: Err(why()),
            memleak: Err(why()),
        }
    }

    /// bcc's memleak on `object`, or why it cannot run.
    pub(crate) fn memleak(&self, object: Option<&str>) -> Result<Tracer, String> {
        self.memleak.clone().map(|headers| Tracer::Memleak {
            headers,
            object: object.map(str::to_string),
        })
    }

    /// bpftrace's floor on `object`, or why it cannot run.
    pub(crate) fn bpftrace(&self, object: &str) -> Result<Tracer, String> {
        self.bpftrace
            .clone()
            .map(|()| Tracer::Bpftrace(object.to_string()))
    }
}

/// What memtrace's JSON report says about one run.
#[derive(Clone, Debug, Default)]
pub(crate) struct Report {
    pub allocs: u64,
    pub frees: u64,
    pub lost: u64,
    /// Non-zero lost_by_cause entries.
    pub(crate) causes: Vec<(String, u64)>,
    /// `bpf_programs` (with `--bpf-stats`): (program, runs, run_ns).
    pub(crate) programs: Vec<(String, u64, u64)>,
}

impl Report {
    pub(crate) fn parse(path: &Path) -> Result<Report> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let json: Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let num = |v: &Value| v.as_u64().unwrap_or(0);
        let events = &json["events"];
        let causes = json["lost_by_cause"]
            .as_object()
            .map(|m| {
                m.iter()
                    .filter(|(_, v)| num(v) > 0)
                    .map(|(k, v)| (k.clone(), num(v)))
                    .collect()
            })
            .unwrap_or_default();
        let programs = json["bpf_programs"]
            .as_array()
            .map(|programs| {
                programs
                    .iter()
                    .map(|p| {
                        (
                            p["program"].as_str().unwrap_or("?").to_string(),
                            num(&p["runs"]),
                            num(&p["run_ns"]),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ok(Report {
            allocs: num(&events["allocs"]),
            frees: num(&events["frees"]),
            lost: num(&events["lost"]),
            causes,
            programs,
        })
    }
}

/// An attached tracer.
pub(crate) struct Attached {
    pub(crate) proc: Option<Proc>,
    pub(crate) report: Option<PathBuf>,
    /// Seconds from the tracer's start to "attached".
    pub(crate) attach_s: f64,
    /// Seconds from the tracer's start to every unwind table in the kernel
    /// (memtrace's "unwind tables ready" when it built some while tracing;
    /// else `attach_s`): the workloads run from here, on whole stacks.
    pub(crate) ready_s: f64,
    /// memtrace's "N functions in M objects".
    pub(crate) summary: String,
}

impl Attached {
    /// Stops the tracer and reads memtrace's report.
    pub(crate) fn stop(mut self) -> Result<Option<Report>> {
        let mut status = None;
        if let Some(proc) = self.proc.as_mut() {
            status = Some(proc.stop(Duration::from_secs(30))?);
        }
        match &self.report {
            Some(path) => {
                let report = Report::parse(path);
                let _ = std::fs::remove_file(path);
                report.map(Some).map_err(|err| match self.proc.as_mut() {
                    Some(proc) => {
                        let status = status.map_or("?".into(), |s| s.to_string());
                        err.context(format!("memtrace ended ({status}); {}", proc.outputs()))
                    }
                    None => err,
                })
            }
            None => Ok(None),
        }
    }
}

pub(crate) fn attach(env: &Env, tracer: &Tracer, pid: i32) -> Result<Attached> {
    attach_with(&env.memtrace, &env.work, tracer, pid)
}

/// Attaches `tracer` to `pid` and waits until it is attached (memtrace:
/// `memtrace` is the binary, its report goes under `work`).
pub(crate) fn attach_with(
    memtrace: &Path,
    work: &Path,
    tracer: &Tracer,
    pid: i32,
) -> Result<Attached> {
    let t0 = Instant::now();
    match tracer {
        Tracer::None => Ok(Attached {
            proc: None,
            report: None,
            attach_s: 0.0,
            ready_s: 0.0,
            summary: String::new(),
        }),
        Tracer::Memtrace { flags, env } => {
            let report = work.join(format!("report-{}.json", next_seq()));
            let _ = std::fs::remove_file(&report);
            let mut cmd = Command::new(memtrace);
            cmd.envs(env.iter().copied());
            cmd.args(["--pid", &pid.to_string(), "--format", "json", "-o"])
                .arg(&report)
                .args(flags);
            let mut proc = Proc::spawn("memtrace", &mut cmd, true)?;
            let line = proc.wait_line(Stream::Err, Duration::from_secs(90), |l| {
                l.contains("memtrace: tracing pid")
            })?;
            let attach_s = t0.elapsed().as_secs_f64();
            let ready_s = if line.contains("unwind tables still building") {
                proc.wait_line(Stream::Err, Duration::from_secs(300), |l| {
                    l.contains("memtrace: unwind tables ready")
                })?;
                t0.elapsed().as_secs_f64()
            } else {
                attach_s
            };
            let summary = line
                .split_once("): ")
                .map(|(_, rest)| rest.split(';').next().unwrap_or(rest).to_string())
                .unwrap_or_default();
            Ok(Attached {
                proc: Some(proc),
                report: Some(report),
                attach_s,
                ready_s,
                summary,
            })
        }
        Tracer::Bpftrace(object) => {
            let mut cmd = Command::new("bpftrace");
            cmd.args(["-B", "line", "-p", &pid.to_string(), "-e"])
                .arg(bpftrace_script(object));
            let mut proc = Proc::spawn("bpftrace", &mut cmd, true)?;
            proc.wait_line(Stream::Out, Duration::from_secs(60), |l| {
                l.contains("bench-attached")
            })?;
            let attach_s = t0.elapsed().as_secs_f64();
            Ok(Attached {
                proc: Some(proc),
                report: None,
                attach_s,
                ready_s: attach_s,
                summary: String::new(),
            })
        }
        Tracer::Memleak { headers, object } => {
            // Interval 2 s: its first "Top 10 stacks" line comes after every
            // probe is attached (it prints "Attaching" before attaching).
            // Run through the launcher that fixes Debian's ctypes signature
            // of bpf_attach_uprobe (see assets/memleak_launcher.py); an
            // attach failure still gets three tries, listed in the report.
            let mut tries = 0;
            let proc = loop {
                tries += 1;
                let mut cmd = peers::memleak_command()?;
                cmd.args(["-p", &pid.to_string(), "2"])
                    .env("PYTHONUNBUFFERED", "1");
                if let Some(object) = object {
                    cmd.args(["-O", object]);
                }
                if let Some(headers) = headers {
                    cmd.env("BCC_KERNEL_SOURCE", headers);
                }
                let mut proc = Proc::spawn("memleak-bpfcc", &mut cmd, true)?;
                match proc.wait_line(Stream::Out, Duration::from_secs(120), |l| {
                    l.contains("stacks with outstanding")
                }) {
                    Ok(_) => break proc,
                    Err(err) => {
                        let attach_failed =
                            proc.err.seen.iter().any(|l| l.contains("Failed to attach"));
                        drop(proc);
                        if !attach_failed || tries >= 3 {
                            return Err(err);
                        }
                        let why = format!("{err:#}");
                        eprintln!("xtask bench:   memleak-bpfcc failed to attach; retrying");
                        if let Ok(mut notes) = MEMLEAK_RETRIES.lock() {
                            notes.push(why);
                        }
                    }
                }
            };
            let attach_s = t0.elapsed().as_secs_f64();
            Ok(Attached {
                proc: Some(proc),
                report: None,
                attach_s,
                ready_s: attach_s,
                summary: String::new(),
            })
        }
    }
}

/// memleak-bpfcc attach failures that a retry got past.
pub(crate) static MEMLEAK_RETRIES: std::sync::Mutex<Vec<String>> =
    std::sync::Mutex::new(Vec::new());

/// One measured run of a bench program.
pub(crate) struct Sample {
    pub(crate) value: f64,
    pub(crate) report: Option<Report>,
    pub(crate) attach_s: f64,
    /// Extra words of the result line (e.g. the achieved rate).
    pub(crate) line: String,
}

/// Starts `cmd` (a bench program), attaches `tracer`, says go, reads the
/// result line (`key VALUE ...`), stops the tracer, lets the program exit.
pub(crate) fn traced_run(
    env: &Env,
    name: &str,
    cmd: &mut Command,
    tracer: &Tracer,
    key: &str,
    timeout: Duration,
) -> Result<Sample> {
    let mut prog = Proc::spawn(name, cmd, false)?;
    prog.wait_line(Stream::Out, Duration::from_secs(60), |l| {
        l.starts_with("ready ")
    })?;
    let attached = attach(env, tracer, prog.pid())?;
    let attach_s = attached.attach_s;
    prog.send_line()?;
    let line = prog.wait_line(Stream::Out, timeout, |l| l.starts_with(key))?;
    let value =
        value_after(&line, key).with_context(|| format!("{name}: cannot parse '{line}'"))?;
    let report = attached.stop()?;
    prog.finish(Duration::from_secs(20))?;
    Ok(Sample {
        value,
        report,
        attach_s,
        line,
    })
}

// --- statistics -------------------------------------------------------------

pub(crate) fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

pub(crate) fn min(values: &[f64]) -> Option<f64> {
    values.iter().copied().min_by(f64::total_cmp)
}

pub(crate) fn max(values: &[f64]) -> Option<f64> {
    values.iter().copied().max_by(f64::total_cmp)
}

/// memtrace with these flags, as a [`Tracer`].
pub(crate) fn memtrace_flags(flags: &[&str]) -> Tracer {
    memtrace_env(flags, &[])
}

/// memtrace with `flags` and the environment `env`.
pub(crate) fn memtrace_env(flags: &[&str], env: &[(&'static str, &'static str)]) -> Tracer {
    Tracer::Memtrace {
        flags: flags.iter().map(|s| s.to_string()).collect(),
        env: env.to_vec(),
    }
}

/// memtrace with its default flags and the eBPF object `variant` forced
/// (the objects of kernels without `bpf_loop`, measured on this one).
pub(crate) fn memtrace_object(variant: &'static str) -> Tracer {
    memtrace_env(&[], &[("MEMTRACE_EBPF_VARIANT", variant)])
}

/// The environment that keeps in-flight calls in hashed slots instead of
/// each thread's task-local storage (the path of kernels without it).
pub(crate) const HASHED_SLOTS: (&str, &str) = ("MEMTRACE_THREAD_STORAGE", "0");

fn next_seq() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static SEQ: AtomicU32 = AtomicU32::new(1000);
    SEQ.fetch_add(1, Ordering::Relaxed)
}

pub(crate) fn output_of(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .unwrap_or_default()
}

pub(crate) fn fmt_ns(v: Option<f64>) -> String {
    match v {
        Some(v) if v >= 100.0 => format!("{v:.0}"),
        Some(v) => format!("{v:.1}"),
        None => "-".into(),
    }
}

pub(crate) fn fmt_ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => {
            let r = a / b;
            if r >= 100.0 {
                format!("{r:.0}x")
            } else if r >= 0.1 {
                format!("{r:.2}x")
            } else {
                format!("{r:.4}x")
            }
        }
        _ => "-".into(),
    }
}

pub(crate) fn lost_summary(reports: &[Report]) -> String {
    if reports.is_empty() {
        return "n/a".into();
    }
    let lost: u64 = reports.iter().map(|r| r.lost).sum();
    let mut causes: Vec<(String, u64)> = Vec::new();
    for (cause, n) in reports.iter().flat_map(|r| r.causes.iter()) {
        match causes.iter_mut().find(|(c, _)| c == cause) {
            Some(entry) => entry.1 += n,
            None => causes.push((cause.clone(), *n)),
        }
    }
    if causes.is_empty() {
        lost.to_string()
    } else {
        let causes: Vec<String> = causes.iter().map(|(c, n)| format!("{c} {n}")).collect();
        format!("{lost} ({})", causes.join(", "))
    }
}

pub(crate) fn one_line(text: &str) -> String {
    let text = text.replace(['\n', '|'], " ");
    if text.chars().count() > 300 {
        format!("{}...", text.chars().take(300).collect::<String>())
    } else {
        text
    }
}
