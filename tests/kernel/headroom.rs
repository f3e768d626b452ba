//! Headroom of memtrace's eBPF programs on this kernel, read from
//! `memtrace doctor --format json`: every program loads in every stack mode
//! with the verifier's processed instructions under half its 1M limit, and
//! every call chain's combined stack (program -> function -> `bpf_loop`
//! callback -> nested callback, frames rounded to 32 B) stays under 448 B,
//! 64 B short of the verifier's 512. Kernels that prune less than this one
//! (6.12, 7.x) or have no private stacks (every LTS before 6.13) need that
//! margin. A failure lists every offender, not just the first.

use serde_json::Value;

use crate::support::{privileged, MEMTRACE};

/// Half the verifier's 1M processed-instruction budget.
const INSN_BUDGET: u64 = 500_000;
/// The stack budget per call chain (the verifier's limit is 512 B).
const STACK_BUDGET: u64 = 448;

fn doctor() -> (Value, String) {
    let out = std::process::Command::new(MEMTRACE)
        .args(["doctor", "--format", "json"])
        .output()
        .expect("memtrace doctor runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|err| {
        panic!(
            "memtrace doctor gave no JSON ({err}): {}\n{stderr}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    (report, stderr)
}

#[test]
fn every_program_loads_in_every_mode_with_half_the_verifier_budget() {
    if !privileged() {
        return;
    }
    let (report, stderr) = doctor();
    let mut problems = Vec::new();
    let tests = report["load_tests"].as_array().cloned().unwrap_or_default();
    assert!(!tests.is_empty(), "no load tests: {report}\n{stderr}");
    println!("verified instructions (budget {INSN_BUDGET} of 1000000):");
    for test in &tests {
        let flags = test["flags"].as_str().unwrap_or("?");
        if let Some(skipped) = test["skipped"].as_str() {
            problems.push(format!("{flags}: load test skipped: {skipped}"));
            continue;
        }
        if let Some(err) = test["maps_error"].as_str() {
            problems.push(format!("{flags}: maps: {err}"));
            continue;
        }
        for program in test["programs"].as_array().into_iter().flatten() {
            let name = program["program"].as_str().unwrap_or("?");
            let insns = program["verified_insns"].as_u64();
            println!(
                "  {flags:<16} {name:<10} {}",
                insns.map_or_else(|| "-".to_string(), |n| n.to_string())
            );
            if program["loaded"].as_bool() != Some(true) {
                problems.push(format!(
                    "{flags} {name}: not loaded: {} (log: {})",
                    program["error"].as_str().unwrap_or("?"),
                    program["log"].as_str().unwrap_or("none")
                ));
            } else if let Some(insns) = insns.filter(|&n| n >= INSN_BUDGET) {
                problems.push(format!(
                    "{flags} {name}: {insns} verified instructions (budget {INSN_BUDGET})"
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} program load problem(s) on kernel {}:\n  {}",
        problems.len(),
        report["kernel"]["release"].as_str().unwrap_or("?"),
        problems.join("\n  ")
    );
}

#[test]
fn every_call_chain_keeps_64_bytes_of_stack_headroom() {
    if !privileged() {
        return;
    }
    let (report, stderr) = doctor();
    let budget = &report["stack_budget"];
    let chains = budget["chains"].as_array().unwrap_or_else(|| {
        panic!(
            "no stack budget: {}\n{stderr}",
            report["stack_budget_error"]
        )
    });
    let describe = |chain: &Value| {
        let names: Vec<&str> = chain["functions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let frames: Vec<String> = chain["frames"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
            .map(|n| n.to_string())
            .collect();
        format!(
            "{} = {} B ({})",
            names.join(" -> "),
            chain["bytes"].as_u64().unwrap_or(0),
            frames.join("+")
        )
    };
    println!("stack per chain (frames rounded to 32 B, budget < {STACK_BUDGET} B):");
    for chain in chains {
        println!("  {}", describe(chain));
    }
    let over: Vec<String> = chains
        .iter()
        .filter(|chain| chain["bytes"].as_u64().unwrap_or(0) >= STACK_BUDGET)
        .map(describe)
        .collect();
    assert!(
        over.is_empty(),
        "{} call chain(s) at or over the {STACK_BUDGET} B stack budget (verifier limit 512 B; \
         kernels without private stacks refuse a chain over 512):\n  {}",
        over.len(),
        over.join("\n  ")
    );
}
