//! Section "Collateral cost: another process": an untraced `mallocbench`
//! and `forkbench` timed while memtrace traces an idle bystander.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Result;

use super::common::{
    attach, fmt_ns, fmt_ratio, lost_summary, max, median, memtrace_flags, min, one_line,
    traced_run, Env, Report, Sample, Tracer, TARGET_LOOP_S,
};
use super::proc::{Proc, Stream};

/// One configuration of the collateral section: what runs beside the
/// measured (untraced) program.
struct CollateralConfig {
    name: &'static str,
    how: String,
    /// Attached to the idle bystander, never to the measured program.
    tracer: Tracer,
    samples: Vec<f64>,
    reports: Vec<Report>,
    unavailable: Option<String>,
    errors: Vec<String>,
}

/// A measured program and its configurations.
struct CollateralProgram {
    program: &'static str,
    /// The result line's key (`ns_per_pair`, `ns_per_fork`).
    key: &'static str,
    /// What one iteration is (`pair`, `fork`).
    unit: &'static str,
    what: &'static str,
    /// Iterations per run (resized after each round from the untraced runs).
    count: u64,
    min_count: u64,
    max_count: u64,
    /// ns per iteration assumed for the timeout before anything is measured.
    guess_ns: f64,
    configs: Vec<CollateralConfig>,
}

pub(super) struct CollateralResult {
    programs: Vec<CollateralProgram>,
}

impl CollateralConfig {
    fn new(
        name: &'static str,
        how: &str,
        tracer: Tracer,
        unavailable: Option<String>,
    ) -> CollateralConfig {
        CollateralConfig {
            name,
            how: how.into(),
            tracer,
            samples: Vec::new(),
            reports: Vec::new(),
            unavailable,
            errors: Vec::new(),
        }
    }
}

/// The configurations every measured program runs under: no tracer, and
/// memtrace (default, --follow-forks) tracing a different, idle process.
fn collateral_configs(env: &Env) -> Vec<CollateralConfig> {
    let follow = if env.has_follow_forks {
        None
    } else {
        Some("this memtrace has no --follow-forks".to_string())
    };
    vec![
        CollateralConfig::new("untraced", "no tracer", Tracer::None, None),
        CollateralConfig::new(
            "memtrace on another pid",
            "`memtrace --pid IDLE` (default flags)",
            memtrace_flags(&[]),
            None,
        ),
        CollateralConfig::new(
            "memtrace --follow-forks on another pid",
            "`memtrace --pid IDLE --follow-forks`",
            memtrace_flags(&["--follow-forks"]),
            follow,
        ),
    ]
}

/// Starts the idle bystander (`livealloc 0`: a live libc user waiting for
/// its go line), attaches `tracer` to it, runs `program COUNT` untraced
/// beside it and reads its result line, then stops the tracer. The sample's
/// report is memtrace's report on the bystander.
fn collateral_run(
    env: &Env,
    program: &str,
    count: u64,
    tracer: &Tracer,
    key: &str,
    timeout: Duration,
) -> Result<Sample> {
    let mut idle = Proc::spawn(
        "livealloc (idle bystander)",
        env.program("livealloc").args(["0", "600", "600"]),
        false,
    )?;
    idle.wait_line(Stream::Out, Duration::from_secs(30), |l| {
        l.starts_with("ready ")
    })?;
    let attached = attach(env, tracer, idle.pid())?;
    let mut cmd = env.program(program);
    cmd.arg(count.to_string()).arg("60").arg("30");
    let sample = traced_run(env, program, &mut cmd, &Tracer::None, key, timeout);
    // Stop the tracer whatever happened to the run (its report on the
    // bystander says whether it saw anything of the measured program).
    let report = attached.stop();
    let mut sample = sample?;
    sample.report = report?;
    idle.finish(Duration::from_secs(20))?;
    Ok(sample)
}

pub(super) fn bench(env: &Env) -> CollateralResult {
    let mut programs = vec![
        CollateralProgram {
            program: "mallocbench",
            key: "ns_per_pair",
            unit: "pair",
            what: "malloc(64)+free pairs",
            count: if env.quick { 10_000_000 } else { 20_000_000 },
            min_count: 100_000,
            max_count: 100_000_000,
            guess_ns: 50.0,
            configs: collateral_configs(env),
        },
        CollateralProgram {
            program: "forkbench",
            key: "ns_per_fork",
            unit: "fork",
            what: "fork + child _exit(0) + waitpid",
            count: if env.quick { 500 } else { 1_000 },
            min_count: 100,
            max_count: 200_000,
            guess_ns: 1_000_000.0,
            configs: collateral_configs(env),
        },
    ];
    for round in 0..env.rounds {
        for prog in programs.iter_mut() {
            let count = prog.count;
            // Every configuration of a round runs the same loop, with a
            // timeout from the slowest median so far.
            let slowest = prog
                .configs
                .iter()
                .filter_map(|c| median(&c.samples))
                .fold(prog.guess_ns, f64::max);
            let expect_s = 10.0 + count as f64 * slowest / 1e9 * 4.0;
            for config in prog.configs.iter_mut() {
                if config.unavailable.is_some() {
                    continue;
                }
                eprintln!(
                    "xtask bench:   round {} {} {} ({count} {}s)",
                    round + 1,
                    prog.program,
                    config.name,
                    prog.unit
                );
                match collateral_run(
                    env,
                    prog.program,
                    count,
                    &config.tracer,
                    prog.key,
                    Duration::from_secs_f64(expect_s.min(180.0)),
                ) {
                    Ok(sample) => {
                        config.samples.push(sample.value);
                        config.reports.extend(sample.report);
                    }
                    Err(err) => {
                        eprintln!(
                            "xtask bench:   {} {} failed: {err:#}",
                            prog.program, config.name
                        );
                        config.errors.push(format!("{err:#}"));
                    }
                }
            }
            // Resize the loop to about TARGET_LOOP_S from the untraced runs.
            if let Some(ns) = prog.configs.first().and_then(|c| median(&c.samples)) {
                prog.count = ((TARGET_LOOP_S * 1e9 / ns.max(0.1)) as u64)
                    .clamp(prog.min_count, prog.max_count);
            }
        }
    }
    CollateralResult { programs }
}

pub(super) fn render(collateral: &CollateralResult, s: &mut String) {
    let _ = writeln!(s, "## Collateral cost: another process\n");
    let _ = writeln!(
        s,
        "memtrace attaches its uprobes to one process (perf_event_open with that pid), so other \
         processes should pay nothing; only its fork reporter (a raw tracepoint on `task_newtask`, \
         always attached) runs system-wide, on every process creation, and returns at once for a \
         creator it does not trace. Here memtrace traces an idle bystander (`livealloc 0` waiting \
         for its go line: a live libc user making no calls) while an unrelated, untraced program \
         is timed; \"untraced\" runs the same bystander with no tracer. `mallocbench` measures \
         the uprobes' reach (ns per malloc(64)+free pair), `forkbench` \
         (tests/fixtures/bench/forkbench.c) the fork reporter's system-wide cost (ns per fork + \
         child `_exit(0)` + waitpid). Interleaved rounds as above, the same loop size for every \
         configuration of a round.\n"
    );
    let _ = writeln!(
        s,
        "| Measured program | Configuration | How | Runs | Min ns/iteration | Median ns/iteration | Max ns/iteration | x untraced | Events memtrace saw | Lost events |"
    );
    let _ = writeln!(s, "|---|---|---|---:|---:|---:|---:|---:|---:|---|");
    for prog in &collateral.programs {
        let untraced = prog.configs.first().and_then(|c| median(&c.samples));
        for c in &prog.configs {
            let label = format!("{} (ns/{})", prog.program, prog.unit);
            if let Some(why) = &c.unavailable {
                let _ = writeln!(
                    s,
                    "| {label} | {} | {} | 0 | - | - | - | - | - | skipped: {} |",
                    c.name,
                    c.how,
                    one_line(why)
                );
                continue;
            }
            let med = median(&c.samples);
            let seen = if c.reports.is_empty() {
                "n/a".to_string()
            } else {
                c.reports
                    .iter()
                    .map(|r| r.allocs + r.frees)
                    .sum::<u64>()
                    .to_string()
            };
            let _ = writeln!(
                s,
                "| {label} | {} | {} | {} | {} | {} | {} | {} | {seen} | {} |",
                c.name,
                c.how,
                c.samples.len(),
                fmt_ns(min(&c.samples)),
                fmt_ns(med),
                fmt_ns(max(&c.samples)),
                fmt_ratio(med, untraced),
                lost_summary(&c.reports)
            );
        }
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "- Expected: every ratio ~1.00x (memtrace costs an unrelated process nothing). Noise on \
         this shared VM is a few percent over many runs, but single short runs drift more: \
         back-to-back untraced mallocbench runs, nothing traced, have spread by ~20% (fastest to \
         slowest) here. \
         So with few rounds a ratio a few percent (up to ~1.15x with --quick) either side of \
         1.00x is noise, not cost; the untraced runs' own range, below, gives this run's scale."
    );
    for prog in &collateral.programs {
        let Some(untraced) = prog.configs.first() else {
            continue;
        };
        let med = median(&untraced.samples);
        if let (Some(lo), Some(hi), Some(med)) =
            (min(&untraced.samples), max(&untraced.samples), med)
        {
            if med > 0.0 {
                let _ = writeln!(
                    s,
                    "- {} untraced ({}): runs from {:.2}x to {:.2}x of their median over {} runs.",
                    prog.program,
                    prog.what,
                    lo / med,
                    hi / med,
                    untraced.samples.len()
                );
            }
        }
    }
    let _ = writeln!(
        s,
        "- \"Events memtrace saw\": allocations and frees in memtrace's report on the bystander, \
         summed over the runs; 0 means none of the measured program's calls reached it."
    );
    for prog in &collateral.programs {
        for c in &prog.configs {
            for err in &c.errors {
                let _ = writeln!(
                    s,
                    "- {} {}: a run failed: {}",
                    prog.program,
                    c.name,
                    one_line(err)
                );
            }
        }
    }
    let _ = writeln!(s);
}
