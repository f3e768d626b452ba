//! Headroom of memtrace's eBPF programs on this kernel, read from
//! `memtrace doctor --format json`: every program loads in every stack mode
//! with the verifier's processed instructions under half its 1M limit, and
//! every call chain's combined stack (program -> function -> `bpf_loop`
//! callback -> nested callback, frames rounded to 32 B) stays under 448 B,
//! 64 B short of the verifier's 512. Kernels that prune less than this one
//! (6.12, 7.x) or have no private stacks (every LTS before 6.13) need that
//! margin. A failure lists every offender, not just the first. Each build
//! of the programs is held to it on this kernel: the full object and, forced
//! with `MEMTRACE_EBPF_VARIANT`, the `tailcall` and `compat` objects of
//! kernels without `bpf_loop`, their tail-called walk programs included (the
//! kernel matrix's 5.10 row runs the same doctor there).

use serde_json::Value;

use crate::support::{privileged, MEMTRACE};

/// Half the verifier's 1M processed-instruction budget.
const INSN_BUDGET: u64 = 500_000;
/// The stack budget per call chain (the verifier's limit is 512 B).
const STACK_BUDGET: u64 = 448;

/// Every build of the programs: `None` is the one this kernel gets.
const VARIANTS: [Option<&str>; 3] = [None, Some("tailcall"), Some("compat")];

fn doctor(variant: Option<&str>) -> (Value, String) {
    let mut command = std::process::Command::new(MEMTRACE);
    if let Some(variant) = variant {
        command.env("MEMTRACE_EBPF_VARIANT", variant);
    }
    let out = command
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
    let mut problems = Vec::new();
    let mut release = String::new();
    for variant in VARIANTS {
        let (report, stderr) = doctor(variant);
        release = report["kernel"]["release"]
            .as_str()
            .unwrap_or("?")
            .to_string();
        let object = report["ebpf_object"]["variant"].as_str().unwrap_or("?");
        if let Some(forced) = variant {
            assert_eq!(object, forced, "doctor loads the forced object");
        }
        load_problems(&report, &stderr, object, &mut problems);
    }
    assert!(
        problems.is_empty(),
        "{} program load problem(s) on kernel {release}:\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
}

/// What keeps `report`'s load tests (of the `object` build) from their budget.
fn load_problems(report: &Value, stderr: &str, object: &str, problems: &mut Vec<String>) {
    let tests = report["load_tests"].as_array().cloned().unwrap_or_default();
    assert!(!tests.is_empty(), "no load tests: {report}\n{stderr}");
    println!("{object} object: verified instructions (budget {INSN_BUDGET} of 1000000):");
    for test in &tests {
        let flags = format!("{object} {}", test["flags"].as_str().unwrap_or("?"));
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
                "  {flags:<24} {name:<11} {}",
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
}

#[test]
fn every_call_chain_keeps_64_bytes_of_stack_headroom() {
    if !privileged() {
        return;
    }
    for variant in VARIANTS {
        let (report, stderr) = doctor(variant);
        chains_within_budget(&report, &stderr);
    }
}

/// Asserts every call chain of `report`'s object is under the budget.
fn chains_within_budget(report: &Value, stderr: &str) {
    let object = report["ebpf_object"]["variant"].as_str().unwrap_or("?");
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
    println!(
        "{object} object: stack per chain (frames rounded to 32 B, budget < {STACK_BUDGET} B):"
    );
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
        "{object} object: {} call chain(s) at or over the {STACK_BUDGET} B stack budget (verifier \
         limit 512 B; kernels without private stacks refuse a chain over 512):\n  {}",
        over.len(),
        over.join("\n  ")
    );
}
