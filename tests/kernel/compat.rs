//! The compat eBPF object (kernels without attach cookies, BPF atomics with
//! fetch or `bpf_loop`: 5.10 - 5.16), forced on this kernel with
//! `MEMTRACE_EBPF_VARIANT=compat`: probes found by their address, calls by
//! the stack pointer of their return, nothing settled, frame-pointer stacks.
//! It must find every leak of `leak_sites` exactly, in launch mode and by
//! pid, and say in one line what it does instead. The kernel matrix
//! (`cargo xtask test-kernels`) runs it on a real 5.10.

use std::process::Command;

use serde_json::Value;

use crate::support::{fixture, privileged, site_totals, Fixture, MEMTRACE};

/// What `leak_sites` leaks: (site, bytes, blocks).
const LEAKS: [(&str, u64, u64); 7] = [
    ("leak_a", 4800, 100),
    ("leak_b", 10000, 10),
    ("leak_calloc", 1000, 5),
    ("leak_memalign", 768, 3),
    ("realloc_chain", 4096, 1),
    ("leak_in_thread", 4096, 32),
    ("leak_mmap", 131072, 2),
];

fn assert_exact(report: &Value, stderr: &str) {
    assert_eq!(report["events"]["lost"], 0, "{stderr}");
    assert_eq!(report["events"]["settled_in_kernel"], 0, "nothing settled");
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
    assert!(
        report["notes"].as_array().into_iter().flatten().any(|n| n
            .as_str()
            .is_some_and(|n| n.contains("compat eBPF programs"))),
        "the report says which programs ran: {}",
        report["notes"]
    );
}

#[test]
fn compat_programs_find_every_leak_exactly_in_launch_mode() {
    if !privileged() {
        return;
    }
    // The command writes on stdout too: the report goes to a file.
    let path = std::env::temp_dir().join(format!("memtrace-compat-{}.json", std::process::id()));
    let out = Command::new(MEMTRACE)
        .env("MEMTRACE_EBPF_VARIANT", "compat")
        .args(["--format", "json", "--top", "500", "--output"])
        .arg(&path)
        .arg("--")
        .arg(fixture("leak_sites"))
        .args(["0", "0"])
        .output()
        .expect("memtrace runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("compat eBPF programs are loaded"),
        "one line says so: {stderr}"
    );
    let text = std::fs::read(&path).expect("the report file");
    let _ = std::fs::remove_file(&path);
    let report: Value = serde_json::from_slice(&text).expect("JSON report");
    assert_exact(&report, &stderr);
}

#[test]
fn compat_programs_find_every_leak_exactly_by_pid() {
    if !privileged() {
        return;
    }
    let mut target = Fixture::start("leak_sites", &["30", "30"]);
    let pid = target.pid.to_string();
    let mut tracer = Command::new(MEMTRACE)
        .env("MEMTRACE_EBPF_VARIANT", "compat")
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
    assert_exact(&report, &seen);
}
