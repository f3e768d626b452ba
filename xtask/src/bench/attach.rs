//! Section "Time to tracing on PyTorch": memtrace attached by pid to a real
//! PyTorch (CPU) process (tests/python/torch_cpu_leak.py on PyPI's torch
//! wheel, unpacked with its dependencies into target/pypi/torch-env): seconds
//! from memtrace's start to "tracing pid" with the table cache off (the
//! previous behaviour, the baseline), on a first attach (empty cache) and on
//! a later one (warm cache), interleaved; then, warm, how many stacks
//! `--stack-depth` 32, 64 and 127 cut and what each walk costs in the kernel
//! (`--bpf-stats`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::Value;

use super::common::{attach, fmt_ratio, median, memtrace_flags, one_line, Env};
use super::proc::{Proc, Stream};
use crate::{root, run};

/// One attach: seconds to tracing, to every unwind table in the kernel,
/// and what its report said.
struct Attach {
    seconds: f64,
    ready: f64,
    report: Value,
}

pub(super) struct AttachBench {
    objects: usize,
    baseline: Vec<Result<Attach, String>>,
    cold: Vec<Result<Attach, String>>,
    warm: Vec<Result<Attach, String>>,
    /// A later attach whose function-search files were removed first: the
    /// search's cost, beside a later attach that finds them.
    warm_searched: Vec<Result<Attach, String>>,
    depths: Vec<(u32, Result<Attach, String>)>,
}

/// Removes the function-search files (`*.fns`) of the cache in `dir`,
/// leaving its unwind tables.
fn forget_function_search(dir: &std::path::Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.path().extension().is_some_and(|e| e == "fns") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// PyPI's torch wheel and its dependencies in target/pypi/torch-env,
/// installed once.
fn torch_env() -> Result<PathBuf> {
    let dir = root().join("target/pypi/torch-env");
    if dir.join("torch/__init__.py").is_file() {
        return Ok(dir);
    }
    run(Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-compile",
            "--only-binary=:all:",
            "--target",
        ])
        .arg(&dir)
        .arg("torch"))?;
    Ok(dir)
}

fn start_torch(env_dir: &PathBuf) -> Result<Proc> {
    let mut cmd = Command::new("python3");
    cmd.arg(root().join("tests/python/torch_cpu_leak.py"))
        .env("PYTHONPATH", env_dir);
    let mut proc = Proc::spawn("torch_cpu_leak.py", &mut cmd, false)?;
    proc.wait_line(Stream::Out, Duration::from_secs(120), |l| {
        l.starts_with("ready ")
    })?;
    Ok(proc)
}

/// Attaches with `flags`, traces for `for_s`, stops; the report's JSON.
fn one(env: &Env, pid: i32, flags: &[&str], for_s: u64) -> Result<Attach, String> {
    let run = || -> Result<Attach> {
        let mut attached = attach(env, &memtrace_flags(flags), pid)?;
        std::thread::sleep(Duration::from_secs(for_s));
        let path = attached.report.clone().context("no report path")?;
        if let Some(proc) = attached.proc.as_mut() {
            proc.stop(Duration::from_secs(60))?;
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let _ = std::fs::remove_file(&path);
        Ok(Attach {
            seconds: attached.attach_s,
            ready: attached.ready_s,
            report: serde_json::from_str(&text)?,
        })
    };
    run().map_err(|err| one_line(&format!("{err:#}")))
}

pub(super) fn bench(env: &Env) -> AttachBench {
    let mut result = AttachBench {
        objects: 0,
        baseline: Vec::new(),
        cold: Vec::new(),
        warm: Vec::new(),
        warm_searched: Vec::new(),
        depths: Vec::new(),
    };
    let torch = match torch_env().and_then(|dir| start_torch(&dir)) {
        Ok(proc) => proc,
        Err(err) => {
            let why = one_line(&format!("{err:#}"));
            result.baseline.push(Err(why));
            return result;
        }
    };
    let pid = torch.pid();
    result.objects = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map(|maps| {
            let mut files: Vec<&str> = maps
                .lines()
                .filter(|l| l.split_whitespace().nth(1).is_some_and(|p| p.contains('x')))
                .filter_map(|l| l.split_whitespace().nth(5))
                .filter(|p| p.starts_with('/'))
                .collect();
            files.sort_unstable();
            files.dedup();
            files.len()
        })
        .unwrap_or(0);
    let cache = env.work.join("table-cache");
    let cache_flag = cache.display().to_string();
    let rounds = env.rounds.min(3);
    for round in 0..rounds {
        eprintln!("xtask bench:   attach round {}", round + 1);
        let _ = std::fs::remove_dir_all(&cache);
        result.baseline.push(one(
            env,
            pid,
            &["--table-cache", "off", "--wait-for-tables"],
            1,
        ));
        result
            .cold
            .push(one(env, pid, &["--table-cache", &cache_flag], 1));
        result
            .warm
            .push(one(env, pid, &["--table-cache", &cache_flag], 1));
        forget_function_search(&cache);
        result
            .warm_searched
            .push(one(env, pid, &["--table-cache", &cache_flag], 1));
    }
    for depth in [32u32, 64, 127] {
        eprintln!("xtask bench:   --stack-depth {depth}");
        let depth_flag = depth.to_string();
        result.depths.push((
            depth,
            one(
                env,
                pid,
                &[
                    "--table-cache",
                    &cache_flag,
                    "--stack-depth",
                    &depth_flag,
                    "--bpf-stats",
                ],
                5,
            ),
        ));
    }
    let _ = std::fs::remove_dir_all(&cache);
    drop(torch);
    result
}

fn seconds(runs: &[Result<Attach, String>]) -> Option<f64> {
    median_of(runs, |a| a.seconds)
}

fn ready(runs: &[Result<Attach, String>]) -> Option<f64> {
    median_of(runs, |a| a.ready)
}

fn median_of(runs: &[Result<Attach, String>], pick: impl Fn(&Attach) -> f64) -> Option<f64> {
    let ok: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .map(pick)
        .collect();
    median(&ok)
}

/// The median over the runs of the report's number at `pointer` (a JSON
/// pointer), or `-`.
fn figure(runs: &[Result<Attach, String>], pointer: &str) -> String {
    let values: Vec<f64> = runs
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .filter_map(|a| a.report.pointer(pointer).and_then(Value::as_f64))
        .collect();
    median(&values).map_or("-".into(), |v| format!("{v:.0}"))
}

/// Leak sites whose frames reach the script's `kept.append` lines (its
/// Python frames), in the last run.
fn leak_sites(runs: &[Result<Attach, String>]) -> String {
    runs.iter()
        .rev()
        .find_map(|r| r.as_ref().ok())
        .and_then(|a| a.report["sites"].as_array())
        .map(|sites| {
            sites
                .iter()
                .filter(|site| site["frames"].to_string().contains("torch_cpu_leak.py"))
                .count()
                .to_string()
        })
        .unwrap_or_else(|| "-".into())
}

pub(super) fn render(bench: &AttachBench, s: &mut String) {
    let _ = writeln!(s, "## Time to tracing on PyTorch\n");
    let _ = writeln!(
        s,
        "memtrace `--pid` on a real PyTorch process (tests/python/torch_cpu_leak.py: PyPI's torch \
         wheel and its CUDA dependencies, CPU path, {} executable objects mapped), seconds from \
         memtrace's start to its \"tracing pid\" line (tracing starts once the cached tables \
         are in; the others are built while it runs) and to every table in the kernel (its \
         \"unwind tables ready\" line: whole stacks from there; stacks cut before are counted, \
         `table_pending`); medians of the interleaved rounds. Baseline: \
         `--table-cache off --wait-for-tables` (every table built before tracing, as before the \
         cache). First attach: an empty cache directory; later attach: the same directory \
         again. Tables prepared: \
         loaded from the cache or built, in parallel, before tracing (`unwind.build_ms`); \
         loaded into maps: \
         copied into the kernel (`unwind.load_ms`). Function search: the objects whose \
         allocator functions came from the cache (`function_cache.hits`) and those searched \
         (`function_cache.misses`); the last row removed the cache's function files first \
         (`*.fns`), keeping its tables: what the search costs a later attach. The last column \
         counts the report's sites \
         whose Python frames reach the script's lines: the same where every table was in \
         before tracing (the stacks do not depend on where the tables came from); a stack cut \
         while its tables were built (counted) makes a site of its own. \
         Reproduce: `cargo xtask bench --section attach`.\n",
        bench.objects
    );
    let _ = writeln!(
        s,
        "| Attach | Seconds to tracing | vs baseline | Seconds to every table | Stacks cut while tables were built | Tables prepared (ms) | Loaded into maps (ms) | Cache hits / built | Function search: cached / searched | Sites reaching the script's lines |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let base = seconds(&bench.baseline);
    for (name, runs) in [
        (
            "baseline (`--table-cache off --wait-for-tables`)",
            &bench.baseline,
        ),
        ("first attach (cold cache)", &bench.cold),
        ("later attach (warm cache)", &bench.warm),
        (
            "later attach, function search not cached",
            &bench.warm_searched,
        ),
    ] {
        let errors: Vec<&String> = runs.iter().filter_map(|r| r.as_ref().err()).collect();
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {} | {} | {} | {} | {} / {} | {} / {} | {} |{}",
            seconds(runs).map_or("-".into(), |v| format!("{v:.2}")),
            fmt_ratio(seconds(runs), base),
            ready(runs).map_or("-".into(), |v| format!("{v:.2}")),
            figure(runs, "/stack_truncations_by_cause/table_pending"),
            figure(runs, "/unwind/build_ms"),
            figure(runs, "/unwind/load_ms"),
            figure(runs, "/unwind/cache/hits"),
            figure(runs, "/unwind/cache/misses"),
            figure(runs, "/function_cache/hits"),
            figure(runs, "/function_cache/misses"),
            leak_sites(runs),
            errors
                .first()
                .map_or(String::new(), |e| format!(" failed: {e}"))
        );
    }
    let _ = writeln!(
        s,
        "\nStack depth on the same process (warm cache, 5 s each, `--bpf-stats`): stacks cut at \
         the depth (`stack_truncations_by_cause.depth`) out of the allocations traced, and the kernel's \
         mean time per run of the return probe (where the stack is walked).\n"
    );
    let _ = writeln!(
        s,
        "| `--stack-depth` | Allocations | Cut at the depth | ns per return-probe run |"
    );
    let _ = writeln!(s, "|---:|---:|---:|---:|");
    for (depth, run) in &bench.depths {
        match run {
            Ok(a) => {
                let exit_ns = a.report["bpf_programs"]
                    .as_array()
                    .and_then(|programs| {
                        programs
                            .iter()
                            .find(|p| p["program"] == "call_exit")
                            .map(|p| p["ns_per_run"].to_string())
                    })
                    .unwrap_or_else(|| "-".into());
                let _ = writeln!(
                    s,
                    "| {depth} | {} | {} | {exit_ns} |",
                    a.report["events"]["allocs"], a.report["stack_truncations_by_cause"]["depth"],
                );
            }
            Err(err) => {
                let _ = writeln!(s, "| {depth} | - | - | failed: {err} |");
            }
        }
    }
    let _ = writeln!(s);
}
