//! `memtrace doctor`'s text screen: the kernel, its features, the
//! privileges, each load test, the stack budget and the verdict per mode.

use std::fmt::Write as _;

use super::Report;
use crate::kernel::verifier;

fn yes(flag: bool) -> &'static str {
    if flag {
        "yes"
    } else {
        "no"
    }
}

fn or_unknown<T: ToString>(value: &Option<T>) -> String {
    value
        .as_ref()
        .map_or_else(|| "unknown".to_string(), ToString::to_string)
}

pub(super) fn render_text(report: &Report) -> String {
    let mut out = String::new();
    let k = &report.kernel;
    let _ = writeln!(out, "kernel      {} ({})", k.release, k.arch);
    let _ = writeln!(out, "features");
    for check in &report.features {
        let _ = writeln!(
            out,
            "  {:<21} {:<8} {} [{}+]: {}",
            check.key,
            check.presence.word(),
            check.describe,
            check.since,
            check.detail
        );
    }
    let p = &report.privileges;
    let _ = writeln!(
        out,
        "privileges  euid {}, CapEff {}: CAP_BPF {}, CAP_PERFMON {}, CAP_SYS_PTRACE {}, CAP_SYS_ADMIN {}",
        p.euid,
        p.cap_eff,
        yes(p.cap_bpf),
        yes(p.cap_perfmon),
        yes(p.cap_sys_ptrace),
        yes(p.cap_sys_admin)
    );
    let _ = writeln!(
        out,
        "            perf_event_paranoid {}, unprivileged_bpf_disabled {}, lockdown {}",
        or_unknown(&p.perf_event_paranoid),
        or_unknown(&p.unprivileged_bpf_disabled),
        or_unknown(&p.lockdown)
    );
    let _ = writeln!(out, "{}", p.uprobe_line());
    if let Some(blocker) = p.blocker() {
        let _ = writeln!(out, "            cannot trace: {blocker}");
    }
    let _ = writeln!(
        out,
        "load test   (verifier's processed instructions, limit {})",
        verifier::INSN_LIMIT
    );
    for test in &report.load_tests {
        if let Some(skipped) = &test.skipped {
            let _ = writeln!(out, "  {:<16} skipped: {skipped}", test.flags);
            continue;
        }
        if let Some(err) = &test.maps_error {
            let _ = writeln!(out, "  {:<16} FAILED creating maps: {err}", test.flags);
            continue;
        }
        let cells: Vec<String> = test
            .programs
            .iter()
            .map(|p| match (p.loaded, p.verified_insns) {
                (true, Some(insns)) => format!("{} ok {insns}", p.program),
                (true, None) => format!("{} ok", p.program),
                (false, _) => format!("{} FAILED", p.program),
            })
            .collect();
        let _ = writeln!(out, "  {:<16} {}", test.flags, cells.join(", "));
        for p in test.programs.iter().filter(|p| !p.loaded) {
            let log = p
                .log
                .as_deref()
                .map(|l| format!(" (log: {l})"))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "  {:<16}   {}: {}{log}",
                "",
                p.program,
                p.error.as_deref().unwrap_or("failed")
            );
        }
    }
    match (&report.stack_budget, &report.stack_budget_error) {
        (Some(budget), _) => {
            let _ = writeln!(
                out,
                "stack per chain (static upper bound, frames rounded to {} B; limit {} B, goal < {} B)",
                budget.rounding, budget.limit, budget.goal
            );
            let mut shown = budget.worst_per_program();
            for chain in budget.over_goal() {
                if !shown.contains(&chain) {
                    shown.push(chain);
                }
            }
            shown.sort_by_key(|chain| std::cmp::Reverse(chain.bytes));
            for chain in shown {
                let mark = if chain.bytes >= budget.limit {
                    "  OVER LIMIT"
                } else if chain.bytes >= budget.goal {
                    "  over goal"
                } else {
                    ""
                };
                let _ = writeln!(out, "  {}{mark}", chain.describe());
            }
            if !budget.private_stack_refused.is_empty() {
                let _ = writeln!(
                    out,
                    "  no private stacks (a preempted program would share one per CPU): {}",
                    budget.private_stack_refused.join(", ")
                );
            }
        }
        (None, Some(err)) => {
            let _ = writeln!(out, "stack per chain: {err}");
        }
        (None, None) => {}
    }
    let _ = writeln!(out, "modes");
    for mode in &report.modes {
        let word = match mode.works {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "?",
        };
        let why = if mode.why.is_empty() {
            String::new()
        } else {
            format!(": {}", mode.why.join("; "))
        };
        let _ = writeln!(out, "  {word:<4} {:<14} {}{why}", mode.mode, mode.flags);
    }
    let _ = writeln!(
        out,
        "ebpf object {}: {}",
        report.ebpf_object.variant,
        report
            .ebpf_object
            .notice
            .as_deref()
            .unwrap_or(&report.ebpf_object.why)
    );
    let _ = writeln!(
        out,
        "in-flight   {}",
        if report.ebpf_object.thread_storage {
            "each thread's task-local storage"
        } else {
            "hashed slots"
        }
    );
    let _ = writeln!(
        out,
        "verdict     {}",
        if report.default_loads {
            "the default mode loads on this kernel"
        } else {
            "the default mode does NOT load on this kernel (exit 1)"
        }
    );
    out
}
