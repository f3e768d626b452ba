//! Section "User-side cost": memtrace's own memory per live allocation
//! (`livealloc` holding N blocks) and its time to attach (`mallocbench`,
//! and `manylibs` with 50 dlopened libraries).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::common::{
    attach, lost_summary, median, memtrace_flags, min, one_line, value_after, Env, Report,
};
use super::proc::{Proc, Stream};

struct RssRun {
    live: u64,
    /// VmHWM once memtrace had taken in every event (before the report).
    steady_kib: u64,
    /// VmHWM at exit (includes building the report).
    peak_kib: u64,
    report: Report,
}

fn status_kib(pid: i32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

fn rss_run(env: &Env, live: u64) -> Result<RssRun> {
    let mut prog = Proc::spawn(
        "livealloc",
        env.program("livealloc")
            .arg(live.to_string())
            .arg("60")
            .arg("120"),
        false,
    )?;
    prog.wait_line(Stream::Out, Duration::from_secs(30), |l| {
        l.starts_with("ready ")
    })?;
    let mut attached = attach(env, &memtrace_flags(&[]), prog.pid())?;
    let tracer_pid = attached.proc.as_ref().map(Proc::pid).context("no tracer")?;
    prog.send_line()?;
    prog.wait_line(Stream::Out, Duration::from_secs(600), |l| {
        l.starts_with("live ")
    })?;
    // memtrace has taken in every event when its RSS stops growing.
    let mut last = 0;
    let mut stable_since = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let rss = status_kib(tracer_pid, "VmRSS:").context("memtrace exited early")?;
        if rss != last {
            last = rss;
            stable_since = Instant::now();
        } else if stable_since.elapsed() > Duration::from_millis(1500) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let steady_kib = status_kib(tracer_pid, "VmHWM:").context("memtrace exited early")?;
    let mut peak_kib = steady_kib;
    let proc = attached.proc.as_mut().context("no tracer")?;
    proc.signal(libc::SIGINT);
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if let Some(hwm) = status_kib(tracer_pid, "VmHWM:") {
            peak_kib = peak_kib.max(hwm);
        }
        if proc.wait_exit(Duration::from_millis(20)).is_some() {
            break;
        }
        if Instant::now() > deadline {
            bail!("memtrace did not stop within 300 s of SIGINT");
        }
    }
    let report = attached.stop()?.context("no memtrace report")?;
    prog.finish(Duration::from_secs(20))?;
    Ok(RssRun {
        live,
        steady_kib,
        peak_kib,
        report,
    })
}

pub(super) struct RssResult {
    runs: Vec<Result<RssRun, String>>,
}

pub(super) fn bench_rss(env: &Env) -> RssResult {
    let sizes: &[u64] = if env.quick {
        &[0, 1_000_000]
    } else {
        &[0, 1_000_000, 10_000_000]
    };
    let runs = sizes
        .iter()
        .copied()
        .map(|live| {
            eprintln!("xtask bench:   {live} live allocations");
            rss_run(env, live).map_err(|e| format!("{e:#}"))
        })
        .collect();
    RssResult { runs }
}

pub(super) struct AttachResult {
    libs_loaded: Option<u64>,
    rows: Vec<(String, Vec<f64>, String, Vec<String>)>,
}

/// Shared objects for manylibs: regular `lib*.so.N` files, minus allocator
/// interposers, sanitizers and the C runtime itself.
fn candidate_libs() -> Vec<PathBuf> {
    let dir = Path::new("/usr/lib/x86_64-linux-gnu");
    let skip = [
        "libc.so",
        "libc_malloc",
        "ld-linux",
        "libmemusage",
        "libSegFault",
        "libpcprofile",
        "san.so",
        "jemalloc",
        "tcmalloc",
        "libpthread",
        "libdl.so",
        "libthread_db",
        "libBrokenLocale",
        "libnss_",
        "libvulkan",
        "libGL",
        "libEGL",
        "libpython",
        "libLLVM",
        "libclang",
        "libbcc",
        "libbpf",
    ];
    let mut libs: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                .map(|e| e.path())
                .filter(|p| {
                    let name = p
                        .file_name()
                        .unwrap_or_default()
                        .to_string_lossy()
                        .into_owned();
                    name.starts_with("lib")
                        && name.contains(".so.")
                        && !skip.iter().any(|s| name.contains(s))
                })
                .collect()
        })
        .unwrap_or_default();
    libs.sort();
    libs.truncate(200);
    libs
}

pub(super) fn bench_attach(env: &Env) -> AttachResult {
    let libs = candidate_libs();
    let mut result = AttachResult {
        libs_loaded: None,
        rows: Vec::new(),
    };
    let rounds = if env.quick { 2 } else { 3 };
    let mut few = (
        String::from("mallocbench (libc only)"),
        Vec::new(),
        String::new(),
        Vec::new(),
    );
    let mut many = (
        String::from("manylibs (50 dlopened libraries)"),
        Vec::new(),
        String::new(),
        Vec::new(),
    );
    for round in 0..rounds {
        eprintln!("xtask bench:   attach round {}", round + 1);
        let tracer = memtrace_flags(&[]);
        for (row, program) in [(&mut few, "mallocbench"), (&mut many, "manylibs")] {
            let outcome = (|| -> Result<(f64, String, Option<u64>)> {
                let mut cmd = env.program(program);
                if program == "manylibs" {
                    cmd.args(["50", "60", "60", "--"]).args(&libs);
                } else {
                    cmd.args(["1000", "60", "30"]);
                }
                let mut prog = Proc::spawn(program, &mut cmd, false)?;
                prog.wait_line(Stream::Out, Duration::from_secs(60), |l| {
                    l.starts_with("ready ")
                })?;
                prog.err.drain();
                let loaded = prog
                    .err
                    .seen
                    .iter()
                    .find_map(|l| value_after(l, "loaded"))
                    .map(|v| v as u64);
                let attached = attach(env, &tracer, prog.pid())?;
                let out = (attached.attach_s, attached.summary.clone(), loaded);
                // memtrace can die of a SIGINT that comes right after its
                // "tracing" line (seen here): let it settle first.
                std::thread::sleep(Duration::from_millis(500));
                attached.stop()?;
                prog.finish(Duration::from_secs(20))?;
                Ok(out)
            })();
            match outcome {
                Ok((secs, summary, loaded)) => {
                    row.1.push(secs);
                    row.2 = summary;
                    if loaded.is_some() {
                        result.libs_loaded = loaded;
                    }
                }
                Err(e) => row.3.push(format!("{e:#}")),
            }
        }
    }
    result.rows = vec![few, many];
    result
}

impl RssResult {
    /// Bytes of steady VmHWM per live allocation at the largest table
    /// measured (difference to 0 live, divided by N).
    pub(super) fn per_alloc(&self) -> Option<f64> {
        let ok: Vec<&RssRun> = self.runs.iter().filter_map(|r| r.as_ref().ok()).collect();
        let base = ok.iter().find(|r| r.live == 0)?;
        ok.iter().rfind(|r| r.live > 0).map(|full| {
            (full.steady_kib as f64 - base.steady_kib as f64) * 1024.0 / full.live as f64
        })
    }
}

pub(super) fn render(rss: &RssResult, attach: &AttachResult, s: &mut String) {
    let _ = writeln!(s, "## User-side cost\n");
    let _ = writeln!(
        s,
        "memtrace's VmHWM (peak RSS from /proc) tracing `livealloc` (tests/fixtures/bench/livealloc.c), \
         which holds N live malloc(16) blocks. \"Steady\" is read once memtrace's RSS stopped growing \
         after the last allocation; \"at exit\" includes building the report.\n"
    );
    let _ = writeln!(
        s,
        "| Live allocations | Steady VmHWM | VmHWM at exit | Allocs seen | Lost |"
    );
    let _ = writeln!(s, "|---:|---:|---:|---:|---|");
    for run in &rss.runs {
        match run {
            Ok(r) => {
                let _ = writeln!(
                    s,
                    "| {} | {:.1} MiB | {:.1} MiB | {} | {} |",
                    r.live,
                    r.steady_kib as f64 / 1024.0,
                    r.peak_kib as f64 / 1024.0,
                    r.report.allocs,
                    lost_summary(std::slice::from_ref(&r.report))
                );
            }
            Err(err) => {
                let _ = writeln!(s, "| - | - | - | - | failed: {} |", one_line(err));
            }
        }
    }
    let ok: Vec<&RssRun> = rss.runs.iter().filter_map(|r| r.as_ref().ok()).collect();
    if let Some(base) = ok.iter().find(|r| r.live == 0) {
        for full in ok.iter().filter(|r| r.live > 0) {
            let steady =
                (full.steady_kib as f64 - base.steady_kib as f64) * 1024.0 / full.live as f64;
            let peak = (full.peak_kib as f64 - base.peak_kib as f64) * 1024.0 / full.live as f64;
            let _ = writeln!(
                s,
                "\nPer live allocation at {} live (difference to 0 live, divided by N): {steady:.0} bytes steady, {peak:.0} bytes at exit.",
                full.live
            );
        }
    }
    let _ = writeln!(s);

    let _ = writeln!(
        s,
        "Time to attach: from memtrace's start to its `memtrace: tracing pid` line (default flags), \
         per target. manylibs (tests/fixtures/bench/manylibs.c) dlopens the first {} of the sorted \
         regular `lib*.so.*` files of /usr/lib/x86_64-linux-gnu that load (allocator interposers, \
         sanitizers and the C runtime excluded).\n",
        attach.libs_loaded.map_or("50".into(), |n| n.to_string())
    );
    let _ = writeln!(s, "| Target | Runs | Min s | Median s | memtrace found |");
    let _ = writeln!(s, "|---|---:|---:|---:|---|");
    for (name, secs, summary, errors) in &attach.rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} |",
            name,
            secs.len(),
            min(secs).map_or("-".into(), |v| format!("{v:.2}")),
            median(secs).map_or("-".into(), |v| format!("{v:.2}")),
            if errors.is_empty() {
                summary.clone()
            } else {
                format!("{summary} (failed: {})", one_line(&errors[0]))
            }
        );
    }
    let _ = writeln!(s);
}
