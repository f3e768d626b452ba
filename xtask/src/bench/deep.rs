//! Section "Deep stacks without frame pointers": `deepbench` (malloc+free
//! 20 calls deep in -O2 -fomit-frame-pointer code) under the placed floor,
//! `--stack-depth 0`, `--stacks fp` and memtrace's default DWARF unwinding.

use std::fmt::Write as _;

use super::common::{fmt_ns, fmt_ratio, lost_summary, median, memtrace_flags, min, one_line, Env};
use super::pairs::{run_rounds, PairConfig};

pub(super) struct DeepResult {
    configs: Vec<PairConfig>,
}

pub(super) fn bench(env: &Env) -> DeepResult {
    let traced = 100_000;
    let mut configs = vec![
        PairConfig::new(
            "placed floor",
            "`memtrace --null-probes`".into(),
            memtrace_flags(&["--null-probes"]),
            traced,
        ),
        PairConfig::new(
            "memtrace --stack-depth 0",
            "`memtrace --stack-depth 0`".into(),
            memtrace_flags(&["--stack-depth", "0"]),
            traced,
        ),
        PairConfig::new(
            "memtrace --stacks fp",
            "`memtrace --stacks fp` (frame pointers: 1-2 frames here)".into(),
            memtrace_flags(&["--stacks", "fp"]),
            traced,
        ),
        PairConfig::new(
            "memtrace default",
            "`memtrace` (DWARF: the whole 20+ frames)".into(),
            memtrace_flags(&[]),
            traced,
        ),
    ];
    run_rounds(env, "deepbench", &mut configs);
    DeepResult { configs }
}

pub(super) fn render(deep: &DeepResult, s: &mut String) {
    let by = |name: &str| {
        deep.configs
            .iter()
            .find(|c| c.name == name)
            .and_then(|c| median(&c.samples))
    };
    let placed = by("placed floor");
    let _ = writeln!(s, "## Deep stacks without frame pointers\n");
    let _ = writeln!(
        s,
        "`deepbench`: malloc(64)+free made 20 calls deep in `-O2 -fomit-frame-pointer` code \
         (tests/fixtures/bench/deepbench.c), where frame pointers see one or two frames and \
         the DWARF unwinder the whole stack. ns per pair; ratios use medians.\n"
    );
    let _ = writeln!(s, "| Configuration | How | Runs | Min ns/pair | Median ns/pair | x placed floor | Lost events |");
    let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---|");
    for c in &deep.configs {
        let med = median(&c.samples);
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} |",
            c.name,
            c.how,
            c.samples.len(),
            fmt_ns(min(&c.samples)),
            fmt_ns(med),
            fmt_ratio(med, placed),
            lost_summary(&c.reports)
        );
        for err in &c.errors {
            let _ = writeln!(s, "\n- {}: a run failed: {}", c.name, one_line(err));
        }
    }
    let _ = writeln!(
        s,
        "\n- DWARF default / `--stacks fp` here: {} (DWARF walks ~22 frames, fp stops after 1-2)",
        fmt_ratio(by("memtrace default"), by("memtrace --stacks fp"))
    );
    let _ = writeln!(
        s,
        "- DWARF default / `--stack-depth 0` here: {}\n",
        fmt_ratio(by("memtrace default"), by("memtrace --stack-depth 0"))
    );
}
