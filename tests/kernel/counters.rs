//! memtrace's own kernel counters stay exact under contention: every CPU's
//! programs bump them at once, and preemptible kernels let one program
//! interrupt another on its CPU, so an increment that is not atomic loses
//! counts. Fixture: `counter_hammer` (threads x calls of `malloc(1)`/`free`,
//! all filtered out in the kernel by `--min-size 2`).

use crate::support::{privileged, Fixture, Tracer};

const CALLS: u64 = 20000;

#[test]
fn counters_bumped_from_every_cpu_at_once_are_exact() {
    if !privileged() {
        return;
    }
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get() as u64);
    // More threads than CPUs: every CPU runs several, and they preempt one
    // another in the middle of the programs.
    let threads = (cpus * 4).clamp(8, 64);
    let (threads_arg, calls_arg) = (threads.to_string(), CALLS.to_string());
    let mut fixture = Fixture::start("counter_hammer", &["30", "30", &threads_arg, &calls_arg]);
    let pid = fixture.pid.to_string();
    let tracer = Tracer::attach(&[
        "--pid",
        &pid,
        "--format",
        "json",
        "--allocators",
        "libc",
        "--min-size",
        "2",
    ]);
    fixture.go();
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    let expected = threads * CALLS;
    assert_eq!(report["events"]["lost"], 0, "{stderr}");
    assert_eq!(
        report["kernel_counters"]["filtered"].as_u64(),
        Some(expected),
        "{threads} threads x {CALLS} filtered allocations: {}",
        report["kernel_counters"]
    );
    // Their frees carry no size: each is a release of an unknown block.
    let unmatched = report["events"]["unmatched_frees"].as_u64().unwrap_or(0);
    assert!(
        unmatched >= expected,
        "unmatched frees {unmatched} < {expected}: {}",
        report["events"]
    );
}
