//! Section "Thread churn in launch mode": what launch mode's exit check
//! costs a command that creates threads. For the check, the supervisor
//! traces every thread of the command (`PTRACE_O_TRACECLONE`): each thread
//! born is three ptrace stops (its clone, its first stop, its exit), so its
//! registers can be read when it dies with its process. `threadchurn`
//! (tests/fixtures/bench) creates and joins threads one after another and
//! times its own loop; it runs untraced, under memtrace with
//! `--no-leak-check` (threads untraced) and under memtrace's default, the
//! three interleaved round by round.

use std::fmt::Write as _;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use super::common::{median, value_after, Env};

/// Threads per run (fewer with --quick).
const THREADS: u64 = 20_000;
const THREADS_QUICK: u64 = 5_000;

/// The ways `threadchurn` runs: label, memtrace's flags (None: untraced).
const WAYS: [(&str, Option<&[&str]>); 3] = [
    ("untraced", None),
    ("memtrace --no-leak-check", Some(&["--no-leak-check"])),
    ("memtrace (exit check: every thread traced)", Some(&[])),
];

pub(super) struct ChurnResult {
    threads: u64,
    rounds: usize,
    /// Per way: the median ns per thread created and joined, or why not.
    per_thread_ns: Vec<std::result::Result<f64, String>>,
}

/// One run: ns per thread as `threadchurn` measured it.
fn run(env: &Env, threads: u64, flags: Option<&[&str]>) -> Result<f64> {
    let program = env.bin.join("threadchurn");
    let mut command = match flags {
        None => Command::new(&program),
        Some(flags) => {
            let mut command = Command::new("timeout");
            command
                .arg("600")
                .arg(&env.memtrace)
                .args(flags)
                .args(["--format", "json", "--output"])
                .arg(env.work.join("thread-churn.json"))
                .arg("--")
                .arg(&program);
            command
        }
    };
    let out = command
        .arg(threads.to_string())
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .context("threadchurn runs")?;
    if !out.status.success() {
        bail!("{}", out.status);
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|line| value_after(line, "per_thread_ns"))
        .context("no per_thread_ns line")
}

pub(super) fn bench(env: &Env) -> ChurnResult {
    let threads = if env.quick { THREADS_QUICK } else { THREADS };
    let rounds = env.rounds.clamp(1, 5);
    let mut samples: Vec<std::result::Result<Vec<f64>, String>> =
        WAYS.iter().map(|_| Ok(Vec::new())).collect();
    for round in 0..rounds {
        eprintln!("xtask bench:   thread churn, round {}/{rounds}", round + 1);
        for (way, (_, flags)) in WAYS.iter().enumerate() {
            let Ok(times) = &mut samples[way] else {
                continue;
            };
            match run(env, threads, *flags) {
                Ok(ns) => times.push(ns),
                Err(err) => samples[way] = Err(format!("{err:#}")),
            }
        }
    }
    ChurnResult {
        threads,
        rounds,
        per_thread_ns: samples
            .into_iter()
            .map(|times| times.and_then(|t| median(&t).ok_or_else(|| "no run".to_string())))
            .collect(),
    }
}

pub(super) fn render(result: &ChurnResult, s: &mut String) {
    let _ = writeln!(s, "## Thread churn in launch mode\n");
    let _ = writeln!(
        s,
        "`threadchurn {}` (tests/fixtures/bench: threads created and joined one after another, \
         each mallocs and frees a block; it times its own loop), median of {} interleaved rounds. \
         Launch mode's exit check reads the registers of every thread that dies with the \
         process, so the supervisor traces each thread the command creates: three ptrace stops \
         per thread. `--no-leak-check` leaves the threads untraced.\n",
        result.threads, result.rounds
    );
    let _ = writeln!(s, "| run | per thread created and joined | vs untraced |");
    let _ = writeln!(s, "|---|---|---|");
    let untraced = result.per_thread_ns.first().and_then(|r| r.as_ref().ok());
    for ((label, _), outcome) in WAYS.iter().zip(&result.per_thread_ns) {
        match outcome {
            Ok(ns) => {
                let ratio = untraced.map_or("-".to_string(), |u| format!("{:.2}x", ns / u));
                let _ = writeln!(s, "| {label} | {:.1} us | {ratio} |", ns / 1000.0);
            }
            Err(err) => {
                let _ = writeln!(s, "| {label} | failed: {err} | |");
            }
        }
    }
    let _ = writeln!(s);
}
