//! The eBPF objects of kernels without `bpf_loop`, forced on this kernel
//! with `MEMTRACE_EBPF_VARIANT`: `compat` (no attach cookies or atomics with
//! fetch either, 5.10 - 5.14: probes found by their address, calls by the
//! stack pointer of their return, nothing settled) and `tailcall` (5.15,
//! 5.16: cookies, heap pairs settled in the kernel). Both walk DWARF stacks
//! and read Python frames in tail-called programs. Each must find every leak
//! of `leak_sites` exactly, in launch mode and by pid, give whole chains to
//! `main` in code without frame pointers (127 frames deep across tail
//! calls too) and Python frames at their lines, and say in one line which
//! programs it loaded. The kernel matrix (`cargo xtask test-kernels`) runs
//! the compat object on a real 5.10.

use std::process::Command;

use serde_json::Value;

use crate::support::{launch_report, privileged, site_totals, sites_of, Fixture, MEMTRACE};

/// The builds for kernels without `bpf_loop`.
const VARIANTS: [&str; 2] = ["compat", "tailcall"];

/// What `leak_sites` leaks: (site, bytes, blocks).
pub const LEAKS: [(&str, u64, u64); 7] = [
    ("leak_a", 4800, 100),
    ("leak_b", 10000, 10),
    ("leak_calloc", 1000, 5),
    ("leak_memalign", 768, 3),
    ("realloc_chain", 4096, 1),
    ("leak_in_thread", 4096, 32),
    ("leak_mmap", 131072, 2),
];

fn assert_exact(report: &Value, stderr: &str, variant: &str) {
    assert_eq!(report["events"]["lost"], 0, "{stderr}");
    let settled = report["events"]["settled_in_kernel"].as_u64().unwrap_or(0);
    if variant == "compat" {
        assert_eq!(settled, 0, "nothing settled without compare-and-swap");
    } else {
        assert!(settled > 0, "{variant}: heap pairs settled in the kernel");
    }
    for (site, bytes, blocks) in LEAKS {
        assert_eq!(
            site_totals(report, site),
            (bytes, blocks),
            "{site}: {}",
            report["sites"]
        );
    }
    for freed in ["balanced", "realloc_to_zero", "mmap_balanced"] {
        assert_eq!(site_totals(report, freed), (0, 0), "{freed} is freed");
    }
    assert_says_which(report, variant);
}

/// The report says which programs ran.
fn assert_says_which(report: &Value, variant: &str) {
    let line = format!("the {variant} eBPF programs are loaded");
    assert!(
        report["notes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|n| n.as_str().is_some_and(|n| n.contains(&line))),
        "the report says which programs ran: {}",
        report["notes"]
    );
}

#[test]
fn programs_without_bpf_loop_find_every_leak_exactly_in_launch_mode() {
    if !privileged() {
        return;
    }
    for variant in VARIANTS {
        leaks_in_launch_mode(variant);
    }
}

fn leaks_in_launch_mode(variant: &str) {
    let (report, stderr) = launch_report(
        &[("MEMTRACE_EBPF_VARIANT", variant)],
        "leak_sites",
        &["0", "0"],
    );
    assert!(
        stderr.contains(&format!("the {variant} eBPF programs are loaded")),
        "one line says so: {stderr}"
    );
    assert_exact(&report, &stderr, variant);
}

#[test]
fn programs_without_bpf_loop_find_every_leak_exactly_by_pid() {
    if !privileged() {
        return;
    }
    for variant in VARIANTS {
        leaks_by_pid(variant);
    }
}

fn leaks_by_pid(variant: &str) {
    let mut target = Fixture::start("leak_sites", &["30", "30"]);
    let pid = target.pid.to_string();
    let mut tracer = Command::new(MEMTRACE)
        .env("MEMTRACE_EBPF_VARIANT", variant)
        .args(["--pid", &pid, "--format", "json", "--top", "500"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("memtrace starts");
    // Attached once it says it is tracing.
    let mut stderr = tracer.stderr.take().expect("stderr piped");
    let mut seen = String::new();
    {
        use std::io::{BufRead, BufReader};
        let mut lines = BufReader::new(&mut stderr);
        loop {
            let mut line = String::new();
            if lines.read_line(&mut line).expect("stderr") == 0 {
                panic!("memtrace ended before tracing: {seen}");
            }
            seen.push_str(&line);
            if line.contains("tracing pid") {
                break;
            }
        }
    }
    target.go();
    // SAFETY: signalling our own child.
    unsafe { libc::kill(tracer.id() as i32, libc::SIGINT) };
    let out = tracer.wait_with_output().expect("memtrace ends");
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
    seen.push_str(&rest);
    assert!(out.status.success(), "{seen}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("JSON report");
    assert_exact(&report, &seen, variant);
}

#[test]
fn programs_without_bpf_loop_walk_whole_dwarf_chains_across_tail_calls() {
    if !privileged() {
        return;
    }
    for variant in VARIANTS {
        let env = [("MEMTRACE_EBPF_VARIANT", variant)];
        let report = crate::unwind::trace_chain_env("chain", &[], &env);
        crate::unwind::assert_whole_chain(&report, variant);
        assert_says_which(&report, variant);

        // 127 frames: the walk runs 22 tail-called programs, within the
        // kernel's 33 tail calls per probe.
        let report = crate::unwind::trace_chain_env("deep", &["--stack-depth", "127"], &env);
        assert_eq!(site_totals(&report, "recurse"), (999, 3), "{variant}");
        for site in sites_of(&report, "recurse") {
            let frames: Vec<&str> = site["frames"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|f| f["symbol"].as_str())
                .collect();
            assert_eq!(frames.len(), 127, "{variant}: 127 frames: {frames:?}");
            assert!(frames.iter().all(|f| *f == "recurse"), "{variant}");
        }
        let cut = report["stack_truncations_by_cause"]["depth"].as_u64();
        assert!(cut >= Some(3), "{variant}: the deep stacks counted as cut");
        assert_eq!(
            report["kernel_counters"]["walk_not_started"].as_u64(),
            Some(0),
            "{variant}: every walk ran in its tail-called programs"
        );
    }
}

#[test]
fn programs_without_bpf_loop_read_python_frames() {
    if !privileged() {
        return;
    }
    let python = std::path::PathBuf::from("/usr/bin/python3.11");
    assert!(
        python.exists(),
        "Debian's python3.11 is required (.ci/run installs it)"
    );
    for variant in VARIANTS {
        let env = [("MEMTRACE_EBPF_VARIANT", variant)];
        let report = crate::python::trace_script_by_pid_env(&python, "leaky.py", &[], &env);
        let handler = crate::python::sites_in(&report, "render");
        assert_eq!(handler.len(), 1, "{variant}: one handler site: {report}");
        assert_eq!(
            crate::python::py_frames(handler[0]),
            vec![
                crate::python::expect("render", "render"),
                crate::python::expect("handle", "handle"),
                crate::python::expect("<module>", "module_handle"),
            ],
            "{variant}"
        );
        assert_eq!(handler[0]["live_count"], 10, "{variant}");
        assert_eq!(handler[0]["live_bytes"], 10 * 100_001, "{variant}");
        assert_says_which(&report, variant);
    }
}
