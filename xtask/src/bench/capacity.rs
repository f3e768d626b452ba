//! Section "Pipeline capacity": `capacity` at rising target event rates
//! under default memtrace: the rate each run reached and the events lost.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context;

use super::common::{lost_summary, memtrace_flags, one_line, traced_run, value_after, Env, Report};

/// Allocating threads of the capacity program (one per core here).
const CAPACITY_THREADS: u32 = 2;

pub(super) struct CapacityRow {
    rate: u64,
    outcome: Result<(f64, Report), String>,
}

pub(super) fn bench(env: &Env) -> CapacityResult {
    let seconds = if env.quick { 1.0 } else { 2.0 };
    let mut rows = Vec::new();
    for rate in [50_000u64, 100_000, 200_000, 400_000, 800_000] {
        eprintln!("xtask bench:   capacity {rate} events/s");
        let mut cmd = env.program("capacity");
        cmd.arg(rate.to_string())
            .arg(seconds.to_string())
            .arg("60")
            .arg("30")
            .arg(CAPACITY_THREADS.to_string());
        let outcome = traced_run(
            env,
            "capacity",
            &mut cmd,
            &memtrace_flags(&[]),
            "pairs",
            Duration::from_secs_f64(seconds * 20.0 + 30.0),
        )
        .and_then(|s| {
            let achieved = value_after(&s.line, "events_per_s").context("no events_per_s")?;
            Ok((achieved, s.report.context("no memtrace report")?))
        })
        .map_err(|e| format!("{e:#}"));
        if let Err(err) = &outcome {
            eprintln!("xtask bench:   capacity {rate} failed: {err}");
        }
        rows.push(CapacityRow { rate, outcome });
    }
    CapacityResult { seconds, rows }
}

pub(super) struct CapacityResult {
    /// Seconds each rate runs.
    seconds: f64,
    rows: Vec<CapacityRow>,
}

impl CapacityResult {
    /// The 200k events/s run: (achieved events/s, lost events).
    pub(super) fn at_200k(&self) -> Option<(f64, u64)> {
        self.rows.iter().rev().find_map(|row| match &row.outcome {
            Ok((achieved, report)) if row.rate == 200_000 => Some((*achieved, report.lost)),
            _ => None,
        })
    }
}

pub(super) fn render(capacity: &CapacityResult, s: &mut String) {
    let (seconds, rows) = (&capacity.seconds, &capacity.rows);
    let _ = writeln!(s, "## Pipeline capacity\n");
    let _ = writeln!(
        s,
        "`capacity` (tests/fixtures/bench/capacity.c): {CAPACITY_THREADS} threads run malloc(64)+free \
         pairs in 1 ms batches at a target rate (split between them) for {seconds} s, traced by \
         default memtrace (64-frame stacks). One pair is two events. \"Achieved\" is the rate the \
         traced program reached: the probes' cost can hold it below the target.\n"
    );
    let _ = writeln!(
        s,
        "| Target events/s | Achieved events/s | Events counted (allocs+frees) | Lost |"
    );
    let _ = writeln!(s, "|---:|---:|---:|---|");
    let mut best_zero = None;
    for row in rows {
        match &row.outcome {
            Ok((achieved, report)) => {
                if report.lost == 0 {
                    best_zero = Some(best_zero.map_or(*achieved, |b: f64| b.max(*achieved)));
                }
                let _ = writeln!(
                    s,
                    "| {} | {:.0} | {} | {} |",
                    row.rate,
                    achieved,
                    report.allocs + report.frees,
                    lost_summary(std::slice::from_ref(report))
                );
            }
            Err(err) => {
                let _ = writeln!(s, "| {} | - | - | failed: {} |", row.rate, one_line(err));
            }
        }
    }
    let _ = writeln!(
        s,
        "\nHighest achieved rate with zero lost events: {}\n",
        best_zero.map_or("none".into(), |v| format!("{v:.0} events/s"))
    );
}
