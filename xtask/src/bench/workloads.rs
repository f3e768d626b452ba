//! `cargo xtask bench` section: real programs traced by pid. Python (Debian's
//! python3.11 and pyenv's 3.12): a loop of 1000-byte `bytearray` allocations
//! (each a `malloc`, so an event with its native and Python stack) and a
//! pure-Python JSON encode/decode loop; C++ under jemalloc (`cxxbench`:
//! std::map/std::string/std::vector churn through operator new/delete,
//! built -O2 without frame pointers, Debian's libjemalloc preloaded).
//! Each untraced, memtrace default (DWARF native stacks plus Python frames
//! read in the kernel), `--stacks fp`, `--stack-depth 0` (no stacks, no
//! Python frames), `--sample-rate 100`, bcc memleak and bpftrace's empty
//! probes, in interleaved rounds. Also runnable alone: `cargo xtask bench
//! --section workloads` (or `cargo xtask bench-workloads`, `bench-python`).

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result};

use super::common::{attach_with, memtrace_flags, Peers, Tracer};

/// Options of the section.
pub struct WorkloadBench<'a> {
    pub memtrace: &'a Path,
    pub work: &'a Path,
    pub rounds: usize,
    pub peers: &'a Peers,
    /// The `cxxbench` fixture (tests/fixtures/bench/cxxbench.cpp).
    pub cxxbench: &'a Path,
}

const SCRIPT: &str = r#"import json, os, sys, time
n, mode = int(sys.argv[1]), sys.argv[2]
print("ready", os.getpid(), flush=True)
sys.stdin.readline()
data = {"k%d" % i: [i, str(i), {"x": i, "y": [1, 2, 3]}] for i in range(40)}
t0 = time.perf_counter()
if mode == "alloc":
    for i in range(n):
        b = bytearray(1000)
else:
    for i in range(n):
        json.loads(json.dumps(data))
t1 = time.perf_counter()
print("ns_per_iter %.1f" % ((t1 - t0) * 1e9 / n), flush=True)
sys.stdin.readline()
"#;

/// Debian's jemalloc, preloaded into the C++ workload.
const JEMALLOC: &str = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2";

/// One measured program: it prints "ready PID", waits for a line, runs its
/// loop, prints "ns_per_iter X" and waits for another line.
struct Program {
    /// Interpreter or language, and the allocator.
    label: String,
    workload: &'static str,
    argv: Vec<String>,
    preload: Option<&'static str>,
    /// The allocator object the peers probe ("libc" or a path).
    allocator: String,
}

/// The configurations, each a tracer (`None`: untraced) or why it cannot run.
fn configs(peers: &Peers, allocator: &str) -> Vec<(&'static str, Result<Option<Tracer>, String>)> {
    let memtrace = |flags: &[&str]| Ok(Some(memtrace_flags(flags)));
    let object = (allocator != "libc").then_some(allocator);
    vec![
        ("untraced", Ok(None)),
        ("memtrace default", memtrace(&[])),
        ("memtrace --stacks fp", memtrace(&["--stacks", "fp"])),
        (
            "memtrace --stack-depth 0",
            memtrace(&["--stack-depth", "0"]),
        ),
        (
            "memtrace --sample-rate 100",
            memtrace(&["--sample-rate", "100"]),
        ),
        ("bcc memleak", peers.memleak(object).map(Some)),
        ("bpftrace empty probes", peers.bpftrace(allocator).map(Some)),
    ]
}

fn programs(opts: &WorkloadBench, script: &Path) -> Vec<Program> {
    let mut interpreters = Vec::new();
    if Path::new("/usr/bin/python3.11").exists() {
        interpreters.push((
            "Debian python3.11".to_string(),
            PathBuf::from("/usr/bin/python3.11"),
        ));
    }
    if let Ok(out) = Command::new("pyenv").args(["prefix", "3.12"]).output() {
        let prefix = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        let python = prefix.join("bin/python3.12");
        if out.status.success() && python.exists() {
            interpreters.push(("pyenv 3.12".to_string(), python));
        }
    }
    let mut found = Vec::new();
    for (label, python) in interpreters {
        for (workload, mode, n) in [
            ("bytearray(1000) loop", "alloc", 20_000),
            ("json dumps+loads loop", "json", 2_000),
        ] {
            found.push(Program {
                label: label.clone(),
                workload,
                argv: vec![
                    python.display().to_string(),
                    script.display().to_string(),
                    n.to_string(),
                    mode.to_string(),
                ],
                preload: None,
                allocator: "libc".into(),
            });
        }
    }
    if opts.cxxbench.exists() && Path::new(JEMALLOC).exists() {
        found.push(Program {
            label: "C++ (-O2, no frame pointers), jemalloc".into(),
            workload: "std::map<string, vector> build+lookup+destroy",
            argv: vec![opts.cxxbench.display().to_string(), "3000".into()],
            preload: Some(JEMALLOC),
            allocator: JEMALLOC.into(),
        });
    }
    found
}

/// One run: the program's ns per iteration under `tracer` (None: untraced).
fn run_once(opts: &WorkloadBench, program: &Program, tracer: Option<&Tracer>) -> Result<f64> {
    let mut cmd = Command::new(&program.argv[0]);
    cmd.args(&program.argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    if let Some(preload) = program.preload {
        cmd.env("LD_PRELOAD", preload);
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", program.argv[0]))?;
    let mut stdin = child.stdin.take().context("stdin")?;
    let mut out = BufReader::new(child.stdout.take().context("stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let pid: i32 = line
        .strip_prefix("ready ")
        .and_then(|p| p.trim().parse().ok())
        .context("no ready line")?;
    let attached = match tracer {
        Some(tracer) => Some(attach_with(opts.memtrace, opts.work, tracer, pid)?),
        None => None,
    };
    stdin.write_all(b"\n")?;
    stdin.flush()?;
    line.clear();
    out.read_line(&mut line)?;
    let value = line
        .strip_prefix("ns_per_iter ")
        .and_then(|v| v.trim().parse::<f64>().ok())
        .with_context(|| format!("unexpected output {line:?}"))?;
    if let Some(attached) = attached {
        attached.stop()?;
    }
    let _ = stdin.write_all(b"\n");
    drop(stdin);
    let _ = child.wait();
    Ok(value)
}

fn median(values: &mut [f64]) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied()
}

/// Runs the section and returns its Markdown.
pub fn section(opts: &WorkloadBench) -> String {
    let mut md = String::from("## Real workloads: Python and C++\n\n");
    let script = opts.work.join("pybench.py");
    if let Err(err) = std::fs::write(&script, SCRIPT) {
        let _ = writeln!(md, "Cannot write {}: {err}\n", script.display());
        return md;
    }
    let programs = programs(opts, &script);
    if programs.is_empty() {
        md.push_str(
            "No workload found (Debian python3.11, pyenv 3.12, cxxbench with Debian's libjemalloc2).\n\n",
        );
        return md;
    }
    let _ = writeln!(
        md,
        "Programs traced by pid. Python: `bytearray(1000)` in a loop (each one a `malloc` and a \
         `free`, so every iteration is two events, the allocation with its native and Python \
         stack) and a pure-Python `json.dumps`+`json.loads` loop of a 40-key dict. C++: \
         `cxxbench` (tests/fixtures/bench/cxxbench.cpp), per iteration a `std::map<std::string, \
         std::vector<int>>` of 64 entries built, searched and destroyed (~256 operator new + \
         delete), `-O2` without frame pointers, `LD_PRELOAD` of Debian's libjemalloc. The peers \
         probe jemalloc's `malloc`/`free` there (`memleak-bpfcc -O`, bpftrace's \
         `uprobe:LIBJEMALLOC:malloc`), which jemalloc's own `operator new`/`delete` never call: \
         in that row they see none of the program's allocations, so their cost there is the \
         cost of tracing nothing (memleak has no `operator new` probes; memtrace probes the C++ \
         operators of the object that defines them). ns per iteration, medians of {} \
         interleaved rounds; ratio = traced / untraced. `--stack-depth 0` captures neither \
         native stacks nor Python frames.\n",
        opts.rounds
    );
    let _ = writeln!(
        md,
        "| program | workload | configuration | ns/iteration | x untraced |"
    );
    let _ = writeln!(md, "|---|---|---|---:|---:|");
    let mut errors = Vec::new();
    for program in &programs {
        let configs = configs(opts.peers, &program.allocator);
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
        for _ in 0..opts.rounds {
            for (i, (name, setup)) in configs.iter().enumerate() {
                let Ok(tracer) = setup else { continue };
                eprintln!(
                    "xtask bench:   {} {} {name}",
                    program.label, program.workload
                );
                match run_once(opts, program, tracer.as_ref()) {
                    Ok(v) => samples[i].push(v),
                    Err(err) => errors.push(format!(
                        "a run failed: {} {} {name}: {err:#}",
                        program.label, program.workload
                    )),
                }
            }
        }
        let untraced = median(&mut samples[0].clone());
        for (i, (name, setup)) in configs.iter().enumerate() {
            let med = median(&mut samples[i].clone());
            let ratio = match (med, untraced) {
                (Some(m), Some(u)) if u > 0.0 => format!("{:.2}x", m / u),
                _ => "-".into(),
            };
            let value = match setup {
                Err(_) => "unavailable".to_string(),
                Ok(_) => med.map_or("-".into(), |v| format!("{v:.0}")),
            };
            let _ = writeln!(
                md,
                "| {} | {} | {name} | {value} | {ratio} |",
                program.label, program.workload
            );
        }
        for (name, setup) in &configs {
            if let Err(why) = setup {
                let line = format!("{name}: unavailable: {why}");
                if !errors.contains(&line) {
                    errors.push(line);
                }
            }
        }
    }
    for err in errors {
        let _ = writeln!(md, "\n- {}", err.replace('\n', " "));
    }
    md.push('\n');
    md
}
