//! `cargo xtask bench`: measures memtrace against the probe floor and its
//! peers (bpftrace, bcc's memleak) and writes BENCHMARKS.md. This file owns
//! the options, the run (every section in order, or one with `--section`)
//! and the page; each section lives in its own file, what they share in
//! common.rs.
//!
//! This is a report, not a test: nothing here asserts on timings. Runs of the
//! different configurations are interleaved (A B C A B C ...) so that a noisy
//! machine hurts them alike, and every table reports medians and ratios taken
//! from one invocation. Every subprocess has a deadline and is stopped when its
//! guard drops (tracers get SIGINT first, then SIGKILL), so an error never
//! leaves a tracer attached.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use super::{root, run};
use common::{Env, Peers};

mod allocators;
mod attach;
mod capacity;
mod collateral;
mod common;
mod deep;
mod ending;
mod inference;
mod kernel_time;
mod leak_check;
mod memory;
mod pairs;
mod peers;
mod proc;
mod redis;
mod report;
mod tables;
mod thread_churn;
mod usdt;
mod watch;
mod workloads;

/// Options of `cargo xtask bench`.
#[derive(Debug, Default, Args)]
pub struct BenchArgs {
    /// Shorter run: 2 rounds and shorter workloads.
    #[arg(long)]
    quick: bool,
    /// Interleaved rounds per configuration (default 5; 2 with --quick).
    #[arg(long)]
    rounds: Option<usize>,
    /// Interleaved rounds per configuration of the per-pair tables
    /// (mallocbench, deepbench), whose ratios are the goals (default 9; 2
    /// with --quick): short runs there are cheap and noisy.
    #[arg(long)]
    pair_rounds: Option<usize>,
    /// Requests per redis-benchmark test (SET, GET, LPUSH) and run (default
    /// 50000; 20000 with --quick).
    #[arg(long)]
    requests: Option<u64>,
    /// Run only this section and print its Markdown (BENCHMARKS.md is left
    /// alone).
    #[arg(long, value_enum)]
    section: Option<Section>,
    /// Where to write the report (relative to the workspace root).
    #[arg(long, default_value = "BENCHMARKS.md")]
    out: PathBuf,
    /// Measure this memtrace binary instead of building target/release/memtrace.
    #[arg(long)]
    memtrace: Option<PathBuf>,
    /// Never install missing peers (bpftrace, bcc) with apt-get.
    #[arg(long)]
    no_install: bool,
}

/// The sections, in BENCHMARKS.md's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Section {
    /// Cost per malloc(64)+free pair (mallocbench): the goals' ratios.
    Pairs,
    /// Deep stacks without frame pointers (deepbench).
    Deep,
    /// Unwind tables of real objects (`memtrace unwind-table`).
    Tables,
    /// Inference-like workload (small mallocs and cudaMalloc per request).
    Inference,
    /// Pipeline capacity at rising event rates.
    Capacity,
    /// User-side cost: memory per live allocation, time to attach.
    Memory,
    /// Collateral cost on another process.
    Collateral,
    /// redis-server under redis-benchmark.
    Redis,
    /// redis-server SET under `memtrace watch` while healthy; the watcher's own cost.
    Watch,
    /// mallocbench under each preloaded allocator.
    Allocators,
    /// Python and C++ workloads.
    #[value(alias = "python")]
    Workloads,
    /// How long after its window a trace's report is written and memtrace exits.
    Ending,
    /// ns per event: USDT probes (semaphore or not) vs a function-entry uprobe.
    Usdt,
    /// Time to tracing on PyTorch: table cache off, cold, warm; stack depth.
    Attach,
    /// `--leak-check`: pause and scan rate against heap size, beside the
    /// `process_vm_readv` copy rate.
    LeakCheck,
    /// Launch mode: ns per thread created and joined, untraced, with
    /// `--no-leak-check` and with the exit check (every thread traced).
    ThreadChurn,
}

impl Section {
    /// Whether the section attaches bpftrace or bcc's memleak.
    fn uses_peers(self) -> bool {
        matches!(self, Section::Pairs | Section::Redis | Section::Workloads)
    }
}

/// Everything a bench page holds.
struct Doc {
    command: String,
    machine: report::Machine,
    elapsed: Duration,
    rounds: usize,
    pair_rounds: usize,
    pairs: pairs::PairsResult,
    deep: deep::DeepResult,
    tables: Vec<tables::TableRow>,
    inference: inference::InferenceResult,
    capacity: capacity::CapacityResult,
    rss: memory::RssResult,
    attach: memory::AttachResult,
    collateral: collateral::CollateralResult,
    /// redis SET throughput under memtrace default / untraced.
    redis_set: Option<f64>,
}

/// `cargo xtask bench`.
pub fn bench(args: BenchArgs) -> Result<()> {
    bench_as("bench", args)
}

/// A section's own command (`cargo xtask bench-redis` ...): that section
/// alone with these rounds (and redis requests).
pub fn alias(task: &str, section: Section, rounds: usize, requests: Option<u64>) -> Result<()> {
    bench_as(
        task,
        BenchArgs {
            section: Some(section),
            rounds: Some(rounds),
            requests,
            ..BenchArgs::default()
        },
    )
}

fn bench_as(task: &str, args: BenchArgs) -> Result<()> {
    let started = Instant::now();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("cargo xtask {task} attaches uprobes: run it as root");
    }
    super::setup::ensure(if args.no_install {
        super::setup::Need::BenchNoPeers
    } else {
        super::setup::Need::Bench
    })?;
    let root = root();
    let env = prepare(&args, &root)?;
    let requests = args
        .requests
        .unwrap_or(if env.quick { 20_000 } else { 50_000 });
    if let Some(section) = args.section {
        let peers = if section.uses_peers() {
            eprintln!("xtask bench: checking peers");
            Peers::find(args.no_install)
        } else {
            Peers::unchecked()
        };
        print!("{}", one_section(section, &env, &peers, requests));
        return Ok(());
    }
    let (rounds, pair_rounds) = (env.rounds, env.pair_rounds);

    eprintln!("xtask bench: checking peers");
    let peers = Peers::find(args.no_install);
    let (bpftrace, memleak) = (&peers.bpftrace, &peers.memleak);

    let machine = report::machine(&env, &root, memleak);
    eprintln!("xtask bench: malloc/free pairs ({pair_rounds} rounds)");
    let pairs = pairs::bench(&env, bpftrace, memleak);
    eprintln!("xtask bench: deep stacks without frame pointers ({pair_rounds} rounds)");
    let deep = deep::bench(&env);
    eprintln!("xtask bench: unwind tables of real objects");
    let tables = tables::bench(&env);
    eprintln!("xtask bench: inference-like workload");
    let inference = inference::bench(&env);
    eprintln!("xtask bench: pipeline capacity");
    let capacity = capacity::bench(&env);
    eprintln!("xtask bench: memtrace memory per live allocation");
    let rss = memory::bench_rss(&env);
    eprintln!("xtask bench: time to attach");
    let attach = memory::bench_attach(&env);
    eprintln!("xtask bench: collateral cost on another process ({rounds} rounds)");
    let collateral = collateral::bench(&env);

    eprintln!("xtask bench: Python and C++ workloads");
    let python = workloads_section(&env, &peers, rounds.min(3));
    eprintln!("xtask bench: redis-server under redis-benchmark ({rounds} rounds)");
    let redis = redis_section(&env, &peers, requests);
    eprintln!("xtask bench: redis-server under memtrace watch ({rounds} rounds)");
    let mut watching = String::new();
    watch::render(&watch::bench(&env, requests), &mut watching);
    eprintln!("xtask bench: mallocbench under each preloaded allocator ({rounds} rounds)");
    let allocators = allocators_section(&env);
    eprintln!("xtask bench: end of a trace");
    let mut ending = String::new();
    ending::render(&ending::bench(&env), &mut ending);
    eprintln!("xtask bench: USDT probes ({pair_rounds} rounds)");
    let mut usdt = String::new();
    usdt::render(&usdt::bench(&env), &mut usdt);
    eprintln!("xtask bench: time to tracing on PyTorch");
    let mut attaching = String::new();
    attach::render(&attach::bench(&env), &mut attaching);

    let command = std::iter::once("cargo xtask".to_string())
        .chain(std::env::args().skip(1))
        .collect::<Vec<_>>()
        .join(" ");
    let mut doc = render(&Doc {
        command,
        machine,
        elapsed: started.elapsed(),
        rounds,
        pair_rounds,
        pairs,
        deep,
        tables,
        inference,
        capacity,
        rss,
        attach,
        collateral,
        redis_set: redis.set_ratio,
    });
    doc.push('\n');
    doc.push_str(&redis.markdown);
    doc.push_str(&watching);
    doc.push_str(&allocators);
    doc.push_str(&python);
    doc.push_str(&ending);
    doc.push_str(&usdt);
    doc.push_str(&attaching);
    let out = if args.out.is_absolute() {
        args.out.clone()
    } else {
        root.join(&args.out)
    };
    std::fs::write(&out, doc).with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "xtask bench: wrote {} in {:.0}s",
        out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Builds what the bench runs (memtrace unless `--memtrace`, the fixtures,
/// the bench programs) and says what this memtrace supports.
fn prepare(args: &BenchArgs, root: &Path) -> Result<Env> {
    let quick = args.quick;
    let rounds = args.rounds.unwrap_or(if quick { 2 } else { 5 }).max(1);
    let pair_rounds = args.pair_rounds.unwrap_or(if quick { 2 } else { 9 }).max(1);
    let memtrace = match &args.memtrace {
        Some(path) => path
            .canonicalize()
            .with_context(|| format!("--memtrace {}", path.display()))?,
        None => {
            super::build_release()?;
            crate::release_binary()
        }
    };
    let fixtures = root.join("target/fixtures");
    if let Err(err) = super::fixtures() {
        eprintln!(
            "xtask bench: building the fixtures failed ({err:#}); using what target/fixtures holds"
        );
    }
    run(Command::new("make")
        .args(["-s", "-f"])
        .arg(root.join("tests/fixtures/bench/bench.mk"))
        .arg(format!("OUT={}", fixtures.display()))
        .arg("bench"))?;
    let work = root.join("target/bench");
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;

    let help = Command::new(&memtrace)
        .arg("--help")
        .output()
        .with_context(|| format!("running {} --help", memtrace.display()))?;
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    Ok(Env {
        memtrace,
        bin: fixtures.join("bench"),
        fixtures,
        work,
        quick,
        rounds,
        pair_rounds,
        has_allocators: help.contains("--allocators"),
        has_follow_forks: help.contains("--follow-forks"),
    })
}

/// One section run alone: its Markdown. The workloads run `env.rounds`
/// rounds here (at most 3 in the full bench).
fn one_section(section: Section, env: &Env, peers: &Peers, requests: u64) -> String {
    let mut s = String::new();
    match section {
        Section::Pairs => {
            let pairs = pairs::bench(env, &peers.bpftrace, &peers.memleak);
            pairs::render(&pairs, &mut s);
        }
        Section::Deep => deep::render(&deep::bench(env), &mut s),
        Section::Tables => tables::render(&tables::bench(env), &mut s),
        Section::Inference => inference::render(&inference::bench(env), &mut s),
        Section::Capacity => capacity::render(&capacity::bench(env), &mut s),
        Section::Memory => {
            let rss = memory::bench_rss(env);
            memory::render(&rss, &memory::bench_attach(env), &mut s);
        }
        Section::Collateral => collateral::render(&collateral::bench(env), &mut s),
        Section::Redis => s = redis_section(env, peers, requests).markdown,
        Section::Watch => watch::render(&watch::bench(env, requests), &mut s),
        Section::Allocators => s = allocators_section(env),
        Section::Workloads => s = workloads_section(env, peers, env.rounds),
        Section::Ending => ending::render(&ending::bench(env), &mut s),
        Section::Usdt => usdt::render(&usdt::bench(env), &mut s),
        Section::Attach => attach::render(&attach::bench(env), &mut s),
        Section::LeakCheck => leak_check::render(&leak_check::bench(env), &mut s),
        Section::ThreadChurn => thread_churn::render(&thread_churn::bench(env), &mut s),
    }
    s
}

fn workloads_section(env: &Env, peers: &Peers, rounds: usize) -> String {
    workloads::section(&workloads::WorkloadBench {
        memtrace: &env.memtrace,
        work: &env.work,
        rounds,
        peers,
        cxxbench: &env.bin.join("cxxbench"),
    })
}

fn redis_section(env: &Env, peers: &Peers, requests: u64) -> redis::RedisResult {
    redis::section(&redis::RedisBench {
        memtrace: &env.memtrace,
        work: &env.work,
        rounds: env.rounds,
        requests,
        peers,
    })
}

fn allocators_section(env: &Env) -> String {
    allocators::section(&allocators::AllocatorBench {
        memtrace: &env.memtrace,
        mallocbench: &env.bin.join("mallocbench"),
        rounds: env.rounds,
    })
}

/// The page up to the redis section: header, the measured sections, goals.
fn render(doc: &Doc) -> String {
    let mut s = String::new();
    report::render_header(doc, &mut s);
    pairs::render(&doc.pairs, &mut s);
    deep::render(&doc.deep, &mut s);
    tables::render(&doc.tables, &mut s);
    inference::render(&doc.inference, &mut s);
    capacity::render(&doc.capacity, &mut s);
    memory::render(&doc.rss, &doc.attach, &mut s);
    collateral::render(&doc.collateral, &mut s);
    report::render_goals(doc, &mut s);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_section_has_a_name_and_python_is_workloads() {
        let names: Vec<String> = Section::value_variants()
            .iter()
            .filter_map(|s| s.to_possible_value())
            .map(|v| v.get_name().to_string())
            .collect();
        assert_eq!(
            names,
            [
                "pairs",
                "deep",
                "tables",
                "inference",
                "capacity",
                "memory",
                "collateral",
                "redis",
                "watch",
                "allocators",
                "workloads",
                "ending",
                "usdt",
                "attach",
                "leak-check",
                "thread-churn"
            ]
        );
        assert_eq!(Section::from_str("python", false), Ok(Section::Workloads));
    }
}
