//! Section "USDT probes": ns per event of a USDT probe on a 5-byte nop
//! (with a semaphore and without), of a function-entry uprobe (emulated
//! `push %rbp`) and of no tracer, in one run: `usdtbench` calls
//! `bench_event(p)` in a loop; each call is one event. Traced as the
//! release half of a `--pairs` resource (`membench:free`, or the function
//! `bench_event`), so each event is a release memtrace records; the floors
//! (`--null-probes`) are the probes with empty programs.

use std::fmt::Write as _;
use std::path::Path;

use super::common::{
    fmt_ns, fmt_ratio, lost_summary, median, memtrace_flags, min, one_line, Env, Tracer,
};
use super::pairs::{run_rounds, PairConfig};

/// The three builds of tests/fixtures/bench/usdtbench.c and what they probe.
const PROGRAMS: [(&str, &str); 3] = [
    ("usdtbench", "USDT, semaphore"),
    ("usdtbench_plain", "USDT, no semaphore"),
    ("usdtbench_call", "function entry"),
];

pub(super) struct UsdtResult {
    /// Per program: its label and its configurations.
    groups: Vec<(&'static str, Vec<PairConfig>)>,
}

/// The pairs file of a program: its USDT probes, or the function.
fn pairs_file(env: &Env, program: &str) -> std::io::Result<std::path::PathBuf> {
    let path = env.work.join(format!("{program}.toml"));
    let text = if program == "usdtbench_call" {
        "[[pair]]\nname = \"membench\"\nalloc = \"bench_never\"\nfree = \"bench_event\"\n"
            .to_string()
    } else {
        "[[pair]]\nname = \"membench\"\nalloc = { usdt = \"membench:alloc\" }\n\
         free = { usdt = \"membench:free\" }\nhandle = \"arg0\"\nfree_handle = \"arg0\"\n"
            .to_string()
    };
    std::fs::write(&path, text)?;
    Ok(path)
}

fn with_pairs(pairs: &Path, flags: &[&str]) -> Tracer {
    let pairs = pairs.display().to_string();
    let mut all = vec!["--pairs", pairs.as_str()];
    all.extend_from_slice(flags);
    memtrace_flags(&all)
}

pub(super) fn bench(env: &Env) -> UsdtResult {
    let traced = 100_000;
    let mut groups = Vec::new();
    for (program, label) in PROGRAMS {
        let mut configs = vec![PairConfig::new(
            "untraced",
            "no tracer".into(),
            Tracer::None,
            20_000_000,
        )];
        match pairs_file(env, program) {
            Ok(pairs) => {
                configs.push(PairConfig::new(
                    "floor",
                    "`memtrace --null-probes --pairs`".into(),
                    with_pairs(&pairs, &["--null-probes"]),
                    traced,
                ));
                configs.push(PairConfig::new(
                    "memtrace",
                    "`memtrace --pairs`".into(),
                    with_pairs(&pairs, &[]),
                    traced,
                ));
            }
            Err(err) => eprintln!("xtask bench: {program}: cannot write its pairs file: {err}"),
        }
        run_rounds(env, program, &mut configs);
        groups.push((label, configs));
    }
    UsdtResult { groups }
}

pub(super) fn render(r: &UsdtResult, s: &mut String) {
    let _ = writeln!(s, "## USDT probes\n");
    let _ = writeln!(
        s,
        "`usdtbench`: a loop calling `bench_event(p)`, one event per call \
         (tests/fixtures/bench/usdtbench.c), built three ways: a USDT probe on the 5-byte \
         nop `0f 1f 44 00 00` behind a semaphore, the same probe without one, and no probe \
         (the function-entry uprobe sits on its emulated `push %rbp`). Each event is a \
         release (`membench:free` or `bench_event` as a `--pairs` free). ns per event; \
         ratios use medians. Kernels from 6.18 run a uprobe on that nop as a call, not a \
         trap; untraced, the semaphore costs one compare and branch.\n"
    );
    let _ = writeln!(
        s,
        "| Probe | Configuration | How | Runs | Min ns/event | Median ns/event | x untraced | Lost events |"
    );
    let _ = writeln!(s, "|---|---|---|---:|---:|---:|---:|---|");
    let mut floors = Vec::new();
    for (label, configs) in &r.groups {
        let untraced = configs
            .iter()
            .find(|c| c.name == "untraced")
            .and_then(|c| median(&c.samples));
        for c in configs {
            let med = median(&c.samples);
            if c.name == "floor" {
                floors.push((*label, med));
            }
            let _ = writeln!(
                s,
                "| {label} | {} | {} | {} | {} | {} | {} | {} |",
                c.name,
                c.how,
                c.samples.len(),
                fmt_ns(min(&c.samples)),
                fmt_ns(med),
                fmt_ratio(med, untraced),
                lost_summary(&c.reports)
            );
            for err in &c.errors {
                let _ = writeln!(s, "\n- {label} {}: a run failed: {}", c.name, one_line(err));
            }
        }
    }
    let floor = |name: &str| floors.iter().find(|(l, _)| *l == name).and_then(|f| f.1);
    let _ = writeln!(
        s,
        "\n- USDT floor / function-entry floor here: {} (semaphore), {} (no semaphore)\n",
        fmt_ratio(floor("USDT, semaphore"), floor("function entry")),
        fmt_ratio(floor("USDT, no semaphore"), floor("function entry"))
    );
}
