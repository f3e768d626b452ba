//! `cargo xtask bench` section: Python programs traced by pid — a loop of
//! 1000-byte `bytearray` allocations (each a `malloc`, so an event with its
//! native and Python stack) and a pure-Python JSON encode/decode loop —
//! untraced, memtrace default (DWARF native stacks plus Python frames read in
//! the kernel), `--stacks fp` (frame pointers plus Python frames) and
//! `--stack-depth 0` (no stacks, no Python frames), in interleaved rounds.
//! Also runnable alone: `cargo xtask bench-python`.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// Options of the section.
pub struct PythonBench<'a> {
    pub memtrace: &'a Path,
    pub work: &'a Path,
    pub rounds: usize,
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

const CONFIGS: [(&str, Option<&[&str]>); 4] = [
    ("untraced", None),
    ("memtrace default", Some(&[])),
    ("memtrace --stacks fp", Some(&["--stacks", "fp"])),
    ("memtrace --stack-depth 0", Some(&["--stack-depth", "0"])),
];

const WORKLOADS: [(&str, &str, u64); 2] = [
    ("bytearray(1000) loop", "alloc", 20_000),
    ("json dumps+loads loop", "json", 2_000),
];

fn interpreters() -> Vec<(String, PathBuf)> {
    let mut found = Vec::new();
    if Path::new("/usr/bin/python3.11").exists() {
        found.push((
            "Debian python3.11".to_string(),
            PathBuf::from("/usr/bin/python3.11"),
        ));
    }
    if let Ok(out) = Command::new("pyenv").args(["prefix", "3.12"]).output() {
        let prefix = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        let python = prefix.join("bin/python3.12");
        if out.status.success() && python.exists() {
            found.push(("pyenv 3.12".to_string(), python));
        }
    }
    found
}

/// One run: the script's ns per iteration under `flags` (None: untraced).
fn run_once(
    opts: &PythonBench,
    python: &Path,
    script: &Path,
    mode: &str,
    n: u64,
    flags: Option<&[&str]>,
) -> Result<f64> {
    let mut child = Command::new(python)
        .arg(script)
        .arg(n.to_string())
        .arg(mode)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", python.display()))?;
    let mut stdin = child.stdin.take().context("stdin")?;
    let mut out = BufReader::new(child.stdout.take().context("stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let pid = line
        .strip_prefix("ready ")
        .map(str::trim)
        .context("no ready line")?
        .to_string();
    let tracer = match flags {
        Some(flags) => {
            let mut tracer = Command::new(opts.memtrace)
                .args(["--pid", &pid, "--format", "json", "--output", "/dev/null"])
                .args(flags)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .context("starting memtrace")?;
            let mut err = tracer.stderr.take().context("stderr")?;
            let mut seen = Vec::new();
            let mut byte = [0u8; 1];
            while !String::from_utf8_lossy(&seen).contains("memtrace: tracing") {
                if err.read(&mut byte)? == 0 {
                    bail!(
                        "memtrace ended before attaching: {}",
                        String::from_utf8_lossy(&seen)
                    );
                }
                seen.push(byte[0]);
            }
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut err, &mut std::io::sink());
            });
            Some(tracer)
        }
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
    if let Some(mut tracer) = tracer {
        // SAFETY: kill with the pid of our own child and a valid signal.
        unsafe { libc::kill(tracer.id() as i32, libc::SIGINT) };
        let _ = tracer.wait();
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
pub fn section(opts: &PythonBench) -> String {
    let mut md = String::from("## Python workloads\n\n");
    let interpreters = interpreters();
    if interpreters.is_empty() {
        md.push_str("No Python interpreter found (Debian python3.11, pyenv 3.12).\n\n");
        return md;
    }
    let script = opts.work.join("pybench.py");
    if let Err(err) = std::fs::write(&script, SCRIPT) {
        let _ = writeln!(md, "Cannot write {}: {err}\n", script.display());
        return md;
    }
    let _ = writeln!(
        md,
        "A Python program traced by pid: `bytearray(1000)` in a loop (each one a `malloc` and a \
         `free`, so every iteration is two events, the allocation with its native and Python \
         stack) and a pure-Python `json.dumps`+`json.loads` loop of a 40-key dict; ns per \
         iteration, medians of {} interleaved rounds; ratio = traced / untraced. \
         `--stack-depth 0` captures neither native stacks nor Python frames.\n",
        opts.rounds
    );
    let _ = writeln!(
        md,
        "| interpreter | workload | configuration | ns/iteration | x untraced |"
    );
    let _ = writeln!(md, "|---|---|---|---:|---:|");
    let mut errors = Vec::new();
    for (label, python) in &interpreters {
        for (workload, mode, n) in WORKLOADS {
            let mut samples: Vec<Vec<f64>> = vec![Vec::new(); CONFIGS.len()];
            for _ in 0..opts.rounds {
                for (i, (name, flags)) in CONFIGS.iter().enumerate() {
                    eprintln!("xtask bench:   python {label} {mode} {name}");
                    match run_once(opts, python, &script, mode, n, *flags) {
                        Ok(v) => samples[i].push(v),
                        Err(err) => errors.push(format!("{label} {mode} {name}: {err:#}")),
                    }
                }
            }
            let untraced = median(&mut samples[0].clone());
            for (i, (name, _)) in CONFIGS.iter().enumerate() {
                let med = median(&mut samples[i].clone());
                let ratio = match (med, untraced) {
                    (Some(m), Some(u)) if u > 0.0 => format!("{:.2}x", m / u),
                    _ => "-".into(),
                };
                let _ = writeln!(
                    md,
                    "| {label} | {workload} | {name} | {} | {ratio} |",
                    med.map_or("-".into(), |v| format!("{v:.0}"))
                );
            }
        }
    }
    for err in errors {
        let _ = writeln!(md, "\n- a run failed: {}", err.replace('\n', " "));
    }
    md.push('\n');
    md
}
