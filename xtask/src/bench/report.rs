//! The page around the sections: the machine and method at the top of
//! BENCHMARKS.md, and the goals table at the end of the measured sections.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::common::{output_of, Env, TARGET_LOOP_S};
use super::Doc;

pub(super) struct Machine {
    cpu: String,
    cpus: usize,
    mem: String,
    kernel: String,
    glibc: String,
    os: String,
    memtrace: String,
    source: String,
    bpftrace: String,
    bcc: String,
    bcc_headers: String,
    has_allocators: bool,
}

pub(super) fn machine(
    env: &Env,
    root: &Path,
    memleak: &Result<Option<PathBuf>, String>,
) -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|kib| format!("{:.1} GiB", kib / 1024.0 / 1024.0))
        .unwrap_or_default();
    let os = std::fs::read_to_string("/etc/os-release")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim_matches('"').to_string())
        .unwrap_or_default();
    let commit = output_of(
        "git",
        &[
            "-C",
            &root.to_string_lossy(),
            "rev-parse",
            "--short",
            "HEAD",
        ],
    );
    let dirty = !output_of(
        "git",
        &["-C", &root.to_string_lossy(), "status", "--porcelain"],
    )
    .is_empty();
    let memtrace = format!(
        "`{}` ({})",
        env.memtrace.display(),
        output_of(&env.memtrace.to_string_lossy(), &["--version"])
    );
    Machine {
        cpu,
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        mem,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
        glibc: output_of("getconf", &["GNU_LIBC_VERSION"])
            .trim_start_matches("glibc ")
            .to_string(),
        os,
        memtrace,
        source: format!(
            "{commit}{}",
            if dirty {
                " (working tree has uncommitted changes)"
            } else {
                ""
            }
        ),
        bpftrace: output_of("bpftrace", &["--version"]),
        bcc: output_of("dpkg-query", &["-W", "-f", "${Version}", "bpfcc-tools"]),
        bcc_headers: match memleak {
            Ok(Some(dir)) => format!(
                "BCC_KERNEL_SOURCE={} (Debian's {} with its -common folder merged in: \
                 this kernel ships no headers)",
                dir.strip_prefix(root).unwrap_or(dir).display(),
                std::fs::read_to_string(dir.join(".merged"))
                    .unwrap_or_default()
                    .trim()
            ),
            Ok(None) => "the running kernel's /lib/modules/*/build".into(),
            Err(why) => format!("unavailable: {why}"),
        },
        has_allocators: env.has_allocators,
    }
}

enum Goal {
    Met(String),
    NotMet(String),
    Unknown(String),
}

fn goal_le(value: Option<f64>, limit: f64, show: impl Fn(f64) -> String) -> Goal {
    match value {
        Some(v) if v <= limit => Goal::Met(show(v)),
        Some(v) => Goal::NotMet(show(v)),
        None => Goal::Unknown("not measured".into()),
    }
}

/// The title, the machine and the method.
pub(super) fn render_header(doc: &Doc, s: &mut String) {
    let m = &doc.machine;
    let _ = writeln!(s, "# memtrace benchmarks\n");
    let _ = writeln!(
        s,
        "Written by `cargo xtask bench` (xtask/src/bench/); rerun it to refresh. A report, \
         not a test: numbers from a shared, noisy VM move from run to run, so compare the ratios \
         within one run rather than absolute numbers across runs.\n"
    );
    let _ = writeln!(
        s,
        "- Command: `{}` (took {:.0} s)",
        doc.command,
        doc.elapsed.as_secs_f64()
    );
    let _ = writeln!(
        s,
        "- Date: {}",
        output_of("date", &["-u", "+%Y-%m-%d %H:%M UTC"])
    );
    let _ = writeln!(
        s,
        "- CPU: {} x {} (no hardware perf counters in this VM)",
        m.cpus, m.cpu
    );
    let _ = writeln!(
        s,
        "- Memory: {}; OS: {}; kernel {}; glibc {}",
        m.mem, m.os, m.kernel, m.glibc
    );
    let _ = writeln!(s, "- memtrace: {}; source commit {}", m.memtrace, m.source);
    let _ = writeln!(
        s,
        "- Peers: {}; bcc (bpfcc-tools) {}, kernel headers: {}",
        if m.bpftrace.is_empty() {
            "bpftrace absent"
        } else {
            &m.bpftrace
        },
        if m.bcc.is_empty() { "absent" } else { &m.bcc },
        m.bcc_headers
    );
    let _ = writeln!(
        s,
        "- Method: {} interleaved rounds per configuration (A B C A B C ...; {} in the per-pair \
         tables, mallocbench and deepbench, whose ratios are the goals); each run starts the \
         program, attaches the tracer, waits until it is attached, then times the loop alone with \
         CLOCK_MONOTONIC. Loops are resized after each run to take about {TARGET_LOOP_S} s.\n",
        doc.rounds, doc.pair_rounds
    );
}

/// The goals table (and why the capacity goal could not be judged).
pub(super) fn render_goals(doc: &Doc, s: &mut String) {
    let m = &doc.machine;
    let p = &doc.pairs;
    let placed = p.median_of("placed floor");
    let memtrace_default = p.median_of("memtrace default");
    let depth0 = p.median_of("memtrace --stack-depth 0");
    let p_no_settle = p.median_of("memtrace --no-settle");
    let p_depth0_no_settle = p.median_of("memtrace --stack-depth 0 --no-settle");
    let bcc = p.median_of("bcc memleak");
    let gpu_overhead = doc.inference.gpu_overhead();
    let at_200k = doc.capacity.at_200k();
    let per_alloc = doc.rss.per_alloc();
    let _ = writeln!(s, "## Goals\n");
    let goals: Vec<(&str, Goal)> = vec![
        (
            "memtrace default <= 1.3x placed floor",
            goal_le(memtrace_default.zip(placed).map(|(a, b)| a / b), 1.3, |v| {
                format!("{v:.2}x")
            }),
        ),
        (
            "--stack-depth 0 <= 1.1x placed floor",
            goal_le(depth0.zip(placed).map(|(a, b)| a / b), 1.1, |v| {
                format!("{v:.2}x")
            }),
        ),
        (
            "the same, every pair sent (--no-settle) <= 1.3x placed floor",
            goal_le(p_no_settle.zip(placed).map(|(a, b)| a / b), 1.3, |v| {
                format!("{v:.2}x")
            }),
        ),
        (
            "the same, --stack-depth 0 --no-settle <= 1.1x placed floor",
            goal_le(
                p_depth0_no_settle.zip(placed).map(|(a, b)| a / b),
                1.1,
                |v| format!("{v:.2}x"),
            ),
        ),
        (
            "bcc memleak >= 5x memtrace default per pair",
            match bcc.zip(memtrace_default) {
                Some((b, d)) if b / d >= 5.0 => Goal::Met(format!("{:.1}x", b / d)),
                Some((b, d)) => Goal::NotMet(format!("{:.1}x", b / d)),
                None => Goal::Unknown("bcc memleak not measured".into()),
            },
        ),
        (
            "GPU-only < 1% overhead",
            match gpu_overhead {
                Some(v) if v < 1.0 => Goal::Met(format!("{v:+.1}%")),
                Some(v) => Goal::NotMet(format!("{v:+.1}%")),
                None if !m.has_allocators => {
                    Goal::Unknown("not measured: needs --allocators".into())
                }
                None => Goal::Unknown("not measured".into()),
            },
        ),
        (
            "zero lost at 200k events/s",
            match at_200k {
                Some((achieved, 0)) if achieved < 190_000.0 => Goal::Unknown(format!(
                    "0 lost, but the traced program reached only {achieved:.0} events/s"
                )),
                Some((achieved, 0)) => {
                    Goal::Met(format!("0 lost (achieved {achieved:.0} events/s)"))
                }
                Some((achieved, lost)) => {
                    Goal::NotMet(format!("{lost} lost (achieved {achieved:.0} events/s)"))
                }
                None => Goal::Unknown("not measured".into()),
            },
        ),
        (
            "<= 48 bytes RSS per live allocation",
            goal_le(per_alloc, 48.0, |v| format!("{v:.0} bytes")),
        ),
        (
            "redis SET under memtrace default >= 0.35x untraced",
            match doc.redis_set {
                Some(v) if v >= 0.35 => Goal::Met(format!("{v:.2}x")),
                Some(v) => Goal::NotMet(format!("{v:.2}x")),
                None => Goal::Unknown("not measured".into()),
            },
        ),
    ];
    let _ = writeln!(s, "| Goal | Status | Measured |");
    let _ = writeln!(s, "|---|---|---|");
    for (goal, status) in goals {
        let (word, value) = match status {
            Goal::Met(v) => ("met", v),
            Goal::NotMet(v) => ("not met", v),
            Goal::Unknown(v) => ("unknown", v),
        };
        let _ = writeln!(s, "| {goal} | {word} | {value} |");
    }
    if let Some((achieved, _)) = at_200k {
        if achieved < 190_000.0 {
            let _ = writeln!(
                s,
                "\nThe 200k events/s run reached only {achieved:.0} events/s: the traced program could not \
                 go faster, so the goal could not be checked at its rate."
            );
        }
    }
}
