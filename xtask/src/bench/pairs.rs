//! Section "Cost per malloc(64)+free pair": `mallocbench` untraced, under
//! the probe floors, memtrace's modes, bpftrace's empty probes and bcc's
//! memleak; the ratios that are the bench's goals. Also the interleaved
//! per-pair rounds ([`run_rounds`]) the deep-stacks section reuses.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use super::common::{
    fmt_ns, fmt_ratio, lost_summary, median, memtrace_env, memtrace_flags, memtrace_object, min,
    one_line, traced_run, Env, Report, Tracer, HASHED_SLOTS, MEMLEAK_RETRIES, TARGET_LOOP_S,
};
use super::kernel_time;

pub(super) struct PairConfig {
    pub(super) name: &'static str,
    pub(super) how: String,
    pub(super) tracer: Tracer,
    pub(super) pairs: u64,
    pub(super) samples: Vec<f64>,
    pub(super) attach_s: Vec<f64>,
    pub(super) reports: Vec<Report>,
    pub(super) unavailable: Option<String>,
    pub(super) errors: Vec<String>,
}

pub(super) struct PairsResult {
    configs: Vec<PairConfig>,
    kernel_time: Vec<kernel_time::ConfigTime>,
}

impl PairsResult {
    pub(super) fn median_of(&self, name: &str) -> Option<f64> {
        self.configs
            .iter()
            .find(|c| c.name == name)
            .and_then(|c| median(&c.samples))
    }
}
pub(super) fn bench(
    env: &Env,
    bpftrace: &Result<(), String>,
    memleak: &Result<Option<PathBuf>, String>,
) -> PairsResult {
    let traced = 100_000;
    let mut configs = vec![
        PairConfig::new("untraced", "no tracer".into(), Tracer::None, 20_000_000),
        PairConfig::new(
            "naive floor",
            "`memtrace --null-probes --entry-probes`".into(),
            memtrace_flags(&["--null-probes", "--entry-probes"]),
            traced,
        ),
        PairConfig::new("placed floor", "`memtrace --null-probes`".into(), memtrace_flags(&["--null-probes"]), traced),
        PairConfig::new(
            "memtrace --stack-depth 0",
            "`memtrace --stack-depth 0`".into(),
            memtrace_flags(&["--stack-depth", "0"]),
            traced,
        ),
        PairConfig::new("memtrace default", "`memtrace` (64-frame DWARF stacks)".into(), memtrace_flags(&[]), traced),
        PairConfig::new(
            "memtrace --stack-depth 0, hashed in-flight slots",
            "`MEMTRACE_THREAD_STORAGE=0 memtrace --stack-depth 0`: in-flight calls in hashed slots claimed by compare-and-swap (kernels whose uprobe programs may not use task storage) instead of each thread's task-local storage".into(),
            memtrace_env(&["--stack-depth", "0"], &[HASHED_SLOTS]),
            traced,
        ),
        PairConfig::new(
            "memtrace, hashed in-flight slots",
            "`MEMTRACE_THREAD_STORAGE=0 memtrace`".into(),
            memtrace_env(&[], &[HASHED_SLOTS]),
            traced,
        ),
        PairConfig::new(
            "memtrace, tailcall object",
            "`MEMTRACE_EBPF_VARIANT=tailcall memtrace`: the object of kernels without `bpf_loop` (5.15, 5.16), its walk across tail calls".into(),
            memtrace_object("tailcall"),
            traced,
        ),
        PairConfig::new(
            "memtrace, compat object",
            "`MEMTRACE_EBPF_VARIANT=compat memtrace`: the object of 5.10-5.14 (no cookies, nothing settled in the kernel)".into(),
            memtrace_object("compat"),
            traced,
        ),
        PairConfig::new(
            "memtrace --no-settle",
            "`memtrace --no-settle` (DWARF stacks, both events of every pair sent: the cost of a block that outlives its thread's next allocation)".into(),
            memtrace_flags(&["--no-settle"]),
            traced,
        ),
        PairConfig::new(
            "memtrace --stack-depth 0 --no-settle",
            "`memtrace --stack-depth 0 --no-settle`".into(),
            memtrace_flags(&["--stack-depth", "0", "--no-settle"]),
            traced,
        ),
        PairConfig::new(
            "memtrace --stacks fp",
            "`memtrace --stacks fp` (frame-pointer stacks)".into(),
            memtrace_flags(&["--stacks", "fp"]),
            traced,
        ),
        PairConfig::new(
            "memtrace --sample-rate 100",
            "`memtrace --sample-rate 100`".into(),
            memtrace_flags(&["--sample-rate", "100"]),
            traced,
        ),
        PairConfig::new(
            "bpftrace empty probes",
            "`bpftrace -p PID` with empty `uprobe:libc:malloc`, `uretprobe:libc:malloc`, `uprobe:libc:free`".into(),
            Tracer::Bpftrace("libc".into()),
            traced,
        ),
        PairConfig::new(
            "bcc memleak",
            "`memleak-bpfcc -p PID 2` (its defaults: every allocator, stacks)".into(),
            Tracer::Memleak {
                headers: memleak.clone().ok().flatten(),
                object: None,
            },
            traced,
        ),
    ];
    let mark = |configs: &mut [PairConfig], name: &str, why: &String| {
        if let Some(config) = configs.iter_mut().find(|c| c.name == name) {
            config.unavailable = Some(why.clone());
        }
    };
    if let Err(why) = bpftrace {
        mark(&mut configs, "bpftrace empty probes", why);
    }
    if let Err(why) = memleak {
        mark(&mut configs, "bcc memleak", why);
    }
    run_rounds(env, "mallocbench", &mut configs);
    // A peer none of whose runs worked is unavailable, and says why.
    for config in configs.iter_mut() {
        let peer = matches!(config.tracer, Tracer::Bpftrace(_) | Tracer::Memleak { .. });
        if peer && config.samples.is_empty() && config.unavailable.is_none() {
            if let Some(first) = config.errors.first() {
                config.unavailable = Some(first.clone());
                config.errors.clear();
            }
        }
    }
    let kernel_time = kernel_time::measure(env, |name| {
        configs
            .iter()
            .find(|c| c.name == name && !c.samples.is_empty())
            .map(|c| c.pairs)
    });
    PairsResult {
        configs,
        kernel_time,
    }
}

/// Runs every configuration `env.pair_rounds` times, interleaved, on a
/// mallocbench-like `program` (PAIRS WAIT LINGER, prints `ns_per_pair`),
/// resizing each loop to about [`TARGET_LOOP_S`].
pub(super) fn run_rounds(env: &Env, program: &str, configs: &mut [PairConfig]) {
    for round in 0..env.pair_rounds {
        for config in configs.iter_mut() {
            if config.unavailable.is_some() {
                continue;
            }
            eprintln!(
                "xtask bench:   round {} {} ({} pairs)",
                round + 1,
                config.name,
                config.pairs
            );
            let mut cmd = env.program(program);
            cmd.arg(config.pairs.to_string()).arg("60").arg("30");
            let expect_s =
                5.0 + config.pairs as f64 * median(&config.samples).unwrap_or(20_000.0) / 1e9 * 4.0;
            let result = traced_run(
                env,
                program,
                &mut cmd,
                &config.tracer,
                "ns_per_pair",
                Duration::from_secs_f64(expect_s.min(120.0)),
            );
            match result {
                Ok(sample) => {
                    config.samples.push(sample.value);
                    if !matches!(config.tracer, Tracer::None) {
                        config.attach_s.push(sample.attach_s);
                    }
                    if let Some(report) = sample.report {
                        config.reports.push(report);
                    }
                    // Resize the loop so it takes about TARGET_LOOP_S.
                    let ns = median(&config.samples).unwrap_or(sample.value).max(0.1);
                    config.pairs = ((TARGET_LOOP_S * 1e9 / ns) as u64).clamp(10_000, 100_000_000);
                }
                Err(err) => {
                    eprintln!("xtask bench:   {} failed: {err:#}", config.name);
                    config.errors.push(format!("{err:#}"));
                }
            }
        }
    }
}

impl PairConfig {
    pub(super) fn new(name: &'static str, how: String, tracer: Tracer, pairs: u64) -> PairConfig {
        PairConfig {
            name,
            how,
            tracer,
            pairs,
            samples: Vec::new(),
            attach_s: Vec::new(),
            reports: Vec::new(),
            unavailable: None,
            errors: Vec::new(),
        }
    }
}

pub(super) fn render(p: &PairsResult, s: &mut String) {
    let untraced = p.median_of("untraced");
    let placed = p.median_of("placed floor");
    let _ = writeln!(s, "## Cost per malloc(64)+free pair\n");
    let _ = writeln!(
        s,
        "`mallocbench`: a tight loop of malloc(64)+free (tests/fixtures/bench/mallocbench.c). \
         ns per pair; ratios use medians. Lost events come from memtrace's JSON report, summed \
         over the runs.\n"
    );
    let _ = writeln!(s, "| Configuration | How | Runs | Min ns/pair | Median ns/pair | x untraced | x placed floor | Attach s | Lost events |");
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---:|---:|---|");
    for c in &p.configs {
        if let Some(why) = &c.unavailable {
            let _ = writeln!(
                s,
                "| {} | {} | 0 | - | - | - | - | peer unavailable: {} |",
                c.name,
                c.how,
                one_line(why)
            );
            continue;
        }
        let med = median(&c.samples);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            c.name,
            c.how,
            c.samples.len(),
            fmt_ns(min(&c.samples)),
            fmt_ns(med),
            fmt_ratio(med, untraced),
            fmt_ratio(med, placed),
            median(&c.attach_s).map_or("-".into(), |v| format!("{v:.1}")),
            lost_summary(&c.reports)
        );
    }
    let memtrace_default = p.median_of("memtrace default");
    let depth0 = p.median_of("memtrace --stack-depth 0");
    let p_no_settle = p.median_of("memtrace --no-settle");
    let bcc = p.median_of("bcc memleak");
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "- bcc memleak / memtrace default: {}",
        fmt_ratio(bcc, memtrace_default)
    );
    let _ = writeln!(
        s,
        "- bcc memleak / memtrace --stack-depth 0: {}",
        fmt_ratio(bcc, depth0)
    );
    let _ = writeln!(
        s,
        "- every mallocbench pair is freed before its thread allocates again, so memtrace settles it \
         in the kernel (`settled_in_kernel`); `--no-settle` sends both events of each pair, the \
         cost of blocks that live longer: bcc memleak / memtrace --no-settle: {}",
        fmt_ratio(bcc, p_no_settle)
    );
    let _ = writeln!(
        s,
        "- memtrace default (DWARF) / memtrace --stacks fp, same frames (mallocbench has frame \
         pointers): {} (goal <= 1.3x)",
        fmt_ratio(memtrace_default, p.median_of("memtrace --stacks fp"))
    );
    let _ = writeln!(
        s,
        "- the objects of kernels without `bpf_loop`, on this kernel: tailcall object / memtrace \
         default: {}; compat object / memtrace default: {} (compat sends every event: compare \
         with --no-settle: {})",
        fmt_ratio(p.median_of("memtrace, tailcall object"), memtrace_default),
        fmt_ratio(p.median_of("memtrace, compat object"), memtrace_default),
        fmt_ratio(p.median_of("memtrace, compat object"), p_no_settle)
    );
    let _ = writeln!(
        s,
        "- in-flight calls in hashed slots / in each thread's task-local storage: {} with \
         `--stack-depth 0`, {} with stacks (1.00x: the same cost)",
        fmt_ratio(
            p.median_of("memtrace --stack-depth 0, hashed in-flight slots"),
            p.median_of("memtrace --stack-depth 0")
        ),
        fmt_ratio(
            p.median_of("memtrace, hashed in-flight slots"),
            memtrace_default
        )
    );
    let _ = writeln!(
        s,
        "- bpftrace empty probes / placed floor: {} (the price of probing free at its entry, \
         where its first instruction is single-stepped)",
        fmt_ratio(p.median_of("bpftrace empty probes"), placed)
    );
    let _ = writeln!(
        s,
        "- bpftrace's `-p` filters the events, not the probes: its uprobes fire system-wide while it runs."
    );
    for c in &p.configs {
        for err in &c.errors {
            let _ = writeln!(s, "- {}: a run failed: {}", c.name, one_line(err));
        }
    }
    let retries = MEMLEAK_RETRIES
        .lock()
        .map(|v| v.clone())
        .unwrap_or_default();
    if let Some(first) = retries.first() {
        let _ = writeln!(
            s,
            "- memleak-bpfcc failed to attach {} time(s) and was restarted (up to 3 tries per run); \
             first failure: {}",
            retries.len(),
            one_line(first)
        );
    }
    let _ = writeln!(s);
    kernel_time::render(&p.kernel_time, placed, s);
    let _ = writeln!(s);
}
