//! Bench sections of the DWARF unwinder: the cost per pair on a 20-frame
//! stack of code without frame pointers (DWARF against the frame-pointer walk
//! and no stacks), and what building the unwind tables of real objects takes
//! (`memtrace unwind-table`).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use super::{
    fmt_ns, fmt_ratio, lost_summary, median, memtrace_flags, min, one_line, Env, PairConfig,
};

pub struct DeepResult {
    configs: Vec<PairConfig>,
}

pub fn bench_deep(env: &Env) -> DeepResult {
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
    super::run_rounds(env, "deepbench", &mut configs);
    DeepResult { configs }
}

pub fn render_deep(deep: &DeepResult, s: &mut String) {
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

pub struct TableRow {
    name: String,
    line: Result<Value, String>,
}

/// Real objects of this machine: libc, libstdc++, a pyenv libpython, and the
/// nightly toolchain's libLLVM (the stand-in for PyTorch-sized libraries).
fn objects() -> Vec<(String, Option<PathBuf>)> {
    let first = |candidates: &[&str]| candidates.iter().map(PathBuf::from).find(|p| p.is_file());
    let libpython = Command::new("pyenv")
        .args(["prefix", "3.11"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .map(|prefix| PathBuf::from(prefix).join("lib/libpython3.11.so.1.0"))
        .filter(|p| p.is_file());
    let llvm = crate::nightly_llvm().ok().map(|(_, llvm)| llvm);
    vec![
        (
            "libc.so.6".into(),
            first(&[
                "/usr/lib/x86_64-linux-gnu/libc.so.6",
                "/lib/x86_64-linux-gnu/libc.so.6",
            ]),
        ),
        (
            "libstdc++.so.6".into(),
            first(&["/usr/lib/x86_64-linux-gnu/libstdc++.so.6"]),
        ),
        (
            "python3.11 (Debian, static)".into(),
            first(&["/usr/bin/python3.11"]),
        ),
        ("libpython3.11.so (pyenv)".into(), libpython),
        ("libLLVM.so (nightly toolchain)".into(), llvm),
    ]
}

pub fn bench_tables(env: &Env) -> Vec<TableRow> {
    objects()
        .into_iter()
        .map(|(name, path)| {
            let line = match path {
                None => Err("not on this machine".to_string()),
                Some(path) => Command::new(&env.memtrace)
                    .arg("unwind-table")
                    .arg(&path)
                    .output()
                    .map_err(|e| e.to_string())
                    .and_then(|out| {
                        serde_json::from_slice::<Value>(&out.stdout)
                            .map_err(|_| String::from_utf8_lossy(&out.stderr).trim().to_string())
                    }),
            };
            TableRow { name, line }
        })
        .collect()
}

pub fn render_tables(rows: &[TableRow], s: &mut String) {
    let _ = writeln!(s, "## Unwind tables\n");
    let _ = writeln!(
        s,
        "`memtrace unwind-table FILE`: the rows the DWARF unwinder loads for an object, built \
         once per file (release build, one run each). Kernel bytes are whole 4 KiB chunks of \
         4-byte rows (offset in page, rule index), the rule dictionary and the page index.\n"
    );
    let _ = writeln!(
        s,
        "| Object | .eh_frame | FDEs | Rows | Kernel bytes | Kernel / .eh_frame | Build ms |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        match &row.line {
            Ok(v) => {
                let eh = v["eh_frame_bytes"].as_f64().unwrap_or(0.0);
                let kb = v["kernel_bytes"].as_f64().unwrap_or(0.0);
                let _ = writeln!(
                    s,
                    "| {} | {:.0} KiB | {} | {} | {:.0} KiB | {} | {:.0} |",
                    row.name,
                    eh / 1024.0,
                    v["fdes"],
                    v["rows"],
                    kb / 1024.0,
                    if eh > 0.0 {
                        format!("{:.2}", kb / eh)
                    } else {
                        "-".into()
                    },
                    v["build_ms"].as_f64().unwrap_or(0.0)
                );
            }
            Err(why) => {
                let _ = writeln!(
                    s,
                    "| {} | - | - | - | - | - | {} |",
                    row.name,
                    one_line(why)
                );
            }
        }
    }
    let _ = writeln!(s);
}
