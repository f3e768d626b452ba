//! Heap blocks settled in the kernel: a thread's newest allocation is held
//! there and, released first, never sent. Fixture: `settle_mix` (same-thread
//! and cross-thread releases, a reallocation of a held block, kept blocks,
//! a block held until memtrace takes it and then freed, its address reused
//! for short-lived blocks, and a last allocation that stays held until
//! memtrace takes it).

use serde_json::Value;

use crate::support::{privileged, site_totals, Fixture, Tracer};

const ROUNDS: u64 = 20000;

fn trace_settle_mix(extra: &[&str]) -> (Value, String) {
    let rounds = ROUNDS.to_string();
    let mut fixture = Fixture::start("settle_mix", &["30", "30", &rounds]);
    let pid = fixture.pid.to_string();
    let mut args = vec!["--pid", &pid, "--format", "json", "--top", "100"];
    args.extend_from_slice(extra);
    let tracer = Tracer::attach(&args);
    fixture.go();
    // The last allocation is held in the kernel now, and its thread sleeps.
    std::thread::sleep(std::time::Duration::from_millis(300));
    tracer.signal(libc::SIGINT);
    tracer.report()
}

fn assert_exact_live_set(report: &Value, stderr: &str) {
    assert_eq!(report["events"]["lost"], 0, "{stderr}");
    assert_eq!(
        site_totals(report, "kept_a"),
        (ROUNDS / 100 * 48, ROUNDS / 100),
        "{}",
        report["sites"]
    );
    assert_eq!(
        site_totals(report, "last_alloc"),
        (7777, 1),
        "the held last allocation is reported: {}",
        report["sites"]
    );
    for balanced in [
        "short_lived",
        "handed_over",
        "grown",
        "taken_late",
        "reused",
    ] {
        assert_eq!(
            site_totals(report, balanced),
            (0, 0),
            "{balanced}: {}",
            report["sites"]
        );
    }
}

#[test]
fn settled_pairs_leave_the_live_set_and_every_count_exactly_as_sending_every_event() {
    if !privileged() {
        return;
    }
    let (settled, stderr) = trace_settle_mix(&[]);
    assert_exact_live_set(&settled, &stderr);
    let (sent, stderr) = trace_settle_mix(&["--no-settle"]);
    assert_exact_live_set(&sent, &stderr);

    let events = |report: &Value, key: &str| report["events"][key].as_u64().unwrap_or(u64::MAX);
    // Every short-lived block's malloc/free pair on its own thread is settled
    // (a few more: cross-thread releases that came first, reallocations),
    // the reused ones too: a block user space took from the kernel leaves
    // no trace there that would keep the next block at its address from
    // being held.
    assert!(
        events(&settled, "settled_in_kernel") >= 2 * ROUNDS,
        "{}",
        settled["events"]
    );
    assert_eq!(events(&sent, "settled_in_kernel"), 0, "{}", sent["events"]);
    for key in ["allocs", "frees", "unmatched_frees", "releases_seen_twice"] {
        assert_eq!(
            events(&settled, key),
            events(&sent, key),
            "{key}: settled {} {} vs sent {} {}",
            settled["events"],
            settled["kernel_counters"],
            sent["events"],
            sent["kernel_counters"]
        );
    }
}
