//! Where a thread's in-flight calls live: in its own task-local storage where
//! the kernel lets uprobe programs use it (`memtrace doctor` says so in
//! `ebpf_object.thread_storage`), in hashed slots elsewhere or with
//! `MEMTRACE_THREAD_STORAGE=0`. Both must find every leak of `leak_sites`
//! exactly (nested calls, threads, reallocations, mmap), and keep every
//! call of many threads preempting one another on every CPU; with per-thread
//! storage no call ever waits in the shared hash map for a slot another
//! thread holds. The kernel matrices run these on every kernel.

use std::process::Command;

use serde_json::Value;

use crate::compat::LEAKS;
use crate::support::{launch_report, privileged, site_totals, Fixture, Tracer, MEMTRACE};

/// The two homes of in-flight calls, by `MEMTRACE_THREAD_STORAGE`.
const MODES: [(&str, &str); 2] = [("per-thread storage", "1"), ("hashed slots", "0")];

/// `memtrace doctor`'s JSON with `MEMTRACE_THREAD_STORAGE` at `value`.
fn doctor(value: &str) -> Value {
    let out = Command::new(MEMTRACE)
        .env("MEMTRACE_THREAD_STORAGE", value)
        .args(["doctor", "--format", "json"])
        .output()
        .expect("memtrace doctor runs");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|err| {
        panic!(
            "doctor JSON ({err}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// Whether this kernel lets uprobe programs use task-local storage.
fn kernel_allows_thread_storage(report: &Value) -> bool {
    report["features"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|f| f["key"] == "task_storage_in_uprobes" && f["presence"] == "found")
}

#[test]
fn in_flight_calls_live_in_each_threads_own_storage_where_the_kernel_allows_it() {
    if !privileged() {
        return;
    }
    let report = doctor("1");
    let object = &report["ebpf_object"];
    let expected = object["variant"] != "compat" && kernel_allows_thread_storage(&report);
    assert_eq!(
        object["thread_storage"], expected,
        "{object} with features {}",
        report["features"]
    );
    assert_eq!(
        doctor("0")["ebpf_object"]["thread_storage"],
        false,
        "MEMTRACE_THREAD_STORAGE=0 keeps hashed slots"
    );
}

#[test]
fn both_homes_of_in_flight_calls_find_every_leak_exactly() {
    if !privileged() {
        return;
    }
    for (mode, value) in MODES {
        let (report, stderr) = launch_report(
            &[("MEMTRACE_THREAD_STORAGE", value)],
            "leak_sites",
            &["0", "0"],
        );
        assert_eq!(report["events"]["lost"], 0, "{mode}: {stderr}");
        assert_eq!(
            report["kernel_counters"]["in_flight_spilled"]
                .as_u64()
                .unwrap_or(0),
            0,
            "{mode}: nested families keep their own slots: {}",
            report["kernel_counters"]
        );
        for (site, bytes, blocks) in LEAKS {
            assert_eq!(
                site_totals(&report, site),
                (bytes, blocks),
                "{mode}: {site}: {}",
                report["sites"]
            );
        }
        for freed in ["balanced", "realloc_to_zero", "mmap_balanced"] {
            assert_eq!(
                site_totals(&report, freed),
                (0, 0),
                "{mode}: {freed} is freed"
            );
        }
    }
}

#[test]
fn many_threads_preempting_one_another_keep_every_call_in_both_homes() {
    if !privileged() {
        return;
    }
    const CALLS: u64 = 5000;
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get() as u64);
    let threads = (cpus * 4).clamp(8, 64);
    let uses_thread_storage = doctor("1")["ebpf_object"]["thread_storage"] == true;
    for (mode, value) in MODES {
        let (threads_arg, calls_arg) = (threads.to_string(), CALLS.to_string());
        let mut target = Fixture::start("counter_hammer", &["30", "30", &threads_arg, &calls_arg]);
        let pid = target.pid.to_string();
        let tracer = Tracer::attach_env(
            &["--pid", &pid, "--format", "json", "--allocators", "libc"],
            &[("MEMTRACE_THREAD_STORAGE", value)],
        );
        target.go();
        tracer.signal(libc::SIGINT);
        let (report, stderr) = tracer.report();
        let counters = &report["kernel_counters"];
        assert_eq!(report["events"]["lost"], 0, "{mode}: {stderr}");
        assert_eq!(
            counters["unpaired_returns"].as_u64().unwrap_or(0),
            0,
            "{mode}: {counters}"
        );
        // Every malloc(1) of every thread returned and was matched by its free.
        assert_eq!(
            site_totals(&report, "tiny_pair"),
            (0, 0),
            "{mode}: {}",
            report["sites"]
        );
        let allocs = report["events"]["allocs"].as_u64().unwrap_or(0);
        assert!(
            allocs >= threads * CALLS,
            "{mode}: {allocs} allocations seen, {threads} x {CALLS} made: {}",
            report["events"]
        );
        if value == "1" && uses_thread_storage {
            assert_eq!(
                counters["in_flight_spilled"].as_u64().unwrap_or(0),
                0,
                "{mode}: no thread's call waits for a slot: {counters}"
            );
        }
    }
}
