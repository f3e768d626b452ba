//! `--follow-forks`: a target's children and grandchildren are traced with
//! probes of their own (scoped to each, never system-wide), their leaks are
//! attributed to them exactly, and without the flag (or past
//! `--max-processes`) they are named in a note instead. Fixture:
//! `tests/fixtures/host/fork_leaks.c`, whose children wait on stdin until
//! the test has seen memtrace report them as followed.

use serde_json::Value;

use crate::reliability::{libc_text_patches, Proc};
use crate::support::{privileged, site_totals, sites_of, Tracer};

/// The pid in a fixture line `WHO <pid>`.
fn pid_in(line: &str, who: &str) -> u32 {
    line.strip_prefix(who)
        .and_then(|rest| rest.trim().parse().ok())
        .unwrap_or_else(|| panic!("expected `{who} PID`, got {line:?}"))
}

/// The pids holding a site's blocks.
fn site_pids(report: &Value, symbol: &str) -> Vec<u64> {
    let sites = sites_of(report, symbol);
    assert_eq!(sites.len(), 1, "one {symbol} site: {}", report["sites"]);
    sites[0]["pids"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_u64)
        .collect()
}

fn note_with<'a>(report: &'a Value, needle: &str) -> Option<&'a str> {
    report["notes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .find(|n| n.contains(needle))
}

fn process(report: &Value, pid: u32) -> &Value {
    report["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["pid"].as_u64() == Some(u64::from(pid)))
        .unwrap_or_else(|| panic!("pid {pid} not in processes: {}", report["processes"]))
}

#[test]
fn follow_forks_traces_children_and_grandchildren_exactly() {
    if !privileged() {
        return;
    }
    let mut family = Proc::fixture("fork_leaks", &["120", "1"]);
    let parent = family.pid;
    let pid = parent.to_string();
    let mut tracer = Tracer::attach(&["--pid", &pid, "--follow-forks", "--format", "json"]);
    family.send();
    let child = pid_in(&family.line(), "child ");
    tracer.wait_for_stderr(&format!("following child pid {child} of pid {parent}"));
    // The child has breakpoints of its own now, and only int3s where probes are.
    let patched = libc_text_patches(child);
    assert!(!patched.is_empty(), "the followed child has breakpoints");
    assert!(patched.iter().all(|&(_, _, b)| b == 0xcc), "{patched:x?}");
    // A process that is not in the family gets none.
    let mut stranger = Proc::fixture("leak_sites", &["120", "0"]);
    assert!(
        libc_text_patches(stranger.pid).is_empty(),
        "a process outside the family was patched"
    );
    stranger.send();
    stranger.expect("done");
    family.send();
    let grandchild = pid_in(&family.line(), "grandchild ");
    tracer.wait_for_stderr(&format!("following child pid {grandchild} of pid {child}"));
    family.send();
    family.expect("done");
    let (_, status) = family.finish();
    assert!(status.success(), "{status}");
    let (report, stderr) = tracer.report();

    // Each process's leaks, exactly, attributed to it.
    assert_eq!(site_totals(&report, "parent_leak"), (3000, 3));
    assert_eq!(site_totals(&report, "thread_leak"), (2000, 4));
    assert_eq!(site_totals(&report, "child_leak"), (10000, 5));
    assert_eq!(site_totals(&report, "grandchild_leak"), (21000, 7));
    assert_eq!(site_pids(&report, "parent_leak"), vec![u64::from(parent)]);
    assert_eq!(
        site_pids(&report, "thread_leak"),
        vec![u64::from(parent)],
        "a thread is not a process"
    );
    assert_eq!(site_pids(&report, "child_leak"), vec![u64::from(child)]);
    assert_eq!(
        site_pids(&report, "grandchild_leak"),
        vec![u64::from(grandchild)]
    );
    // The block the parent allocated before forking: still live in the
    // parent; the child's free of its copy is an unmatched free, not a
    // release of the parent's block.
    let main_sites = sites_of(&report, "main");
    assert!(
        main_sites
            .iter()
            .any(|s| s["live_bytes"] == 777 && s["pids"] == serde_json::json!([parent])),
        "{}",
        report["sites"]
    );
    assert!(report["events"]["unmatched_frees"].as_u64() >= Some(1));

    // The family tree and what each still held.
    assert_eq!(process(&report, parent)["parent"], Value::Null);
    assert_eq!(process(&report, child)["parent"], parent);
    assert_eq!(process(&report, grandchild)["parent"], child);
    assert_eq!(process(&report, child)["live_bytes"], 10000);
    assert_eq!(process(&report, grandchild)["live_bytes"], 21000);
    for pid in [child, grandchild] {
        assert_eq!(process(&report, pid)["exited"], true);
        assert!(
            stderr.contains(&format!("child pid {pid} exited; its probes are detached")),
            "{stderr}"
        );
    }
    assert!(
        note_with(&report, "followed 2 child process(es)").is_some(),
        "{}",
        report["notes"]
    );
    assert_eq!(report["events"]["lost"], 0);
}

#[test]
fn without_follow_forks_children_are_named_not_traced() {
    if !privileged() {
        return;
    }
    let mut family = Proc::fixture("fork_leaks", &["120", "1"]);
    let parent = family.pid;
    let pid = parent.to_string();
    let mut tracer = Tracer::attach(&["--pid", &pid, "--format", "json"]);
    family.send();
    let child = pid_in(&family.line(), "child ");
    // The kernel reports the fork at once, and memtrace names the child.
    tracer.wait_for_stderr(&format!("child pid {child} of pid {parent}: not traced"));
    family.send();
    let _ = pid_in(&family.line(), "grandchild ");
    family.send();
    family.expect("done");
    let (report, _) = tracer.report();
    assert_eq!(site_totals(&report, "parent_leak"), (3000, 3));
    assert!(sites_of(&report, "child_leak").is_empty());
    assert!(sites_of(&report, "grandchild_leak").is_empty());
    let note = note_with(&report, "were not traced")
        .unwrap_or_else(|| panic!("no note about children: {}", report["notes"]));
    assert!(note.contains(&child.to_string()), "{note}");
    assert!(note.contains("--follow-forks"), "{note}");
    assert_eq!(report["processes"].as_array().map(Vec::len), Some(1));
}

#[test]
fn max_processes_caps_the_followed_family() {
    if !privileged() {
        return;
    }
    let mut family = Proc::fixture("fork_leaks", &["120", "1"]);
    let parent = family.pid;
    let pid = parent.to_string();
    let mut tracer = Tracer::attach(&[
        "--pid",
        &pid,
        "--follow-forks",
        "--max-processes",
        "2",
        "--format",
        "json",
    ]);
    family.send();
    let child = pid_in(&family.line(), "child ");
    tracer.wait_for_stderr(&format!("following child pid {child} of pid {parent}"));
    family.send();
    let grandchild = pid_in(&family.line(), "grandchild ");
    tracer.wait_for_stderr(&format!(
        "child pid {grandchild} of pid {child}: not traced: --max-processes reached"
    ));
    family.send();
    family.expect("done");
    let (report, stderr) = tracer.report();
    assert_eq!(site_totals(&report, "child_leak"), (10000, 5));
    assert!(sites_of(&report, "grandchild_leak").is_empty());
    assert!(!stderr.contains(&format!("following child pid {grandchild}")));
    let note = note_with(&report, "--max-processes 2 was reached")
        .unwrap_or_else(|| panic!("no cap note: {}", report["notes"]));
    assert!(note.contains(&grandchild.to_string()), "{note}");
}

#[test]
fn launched_command_children_are_held_at_birth_and_traced_exactly() {
    if !privileged() {
        return;
    }
    // Three children that live a few milliseconds each: only holding them
    // at birth (launch mode traces forks with ptrace) catches all of them.
    let leak_sites = crate::support::fixture("leak_sites");
    let script = format!(
        "for i in 1 2 3; do {} 0 0 </dev/null >/dev/null; done",
        leak_sites.display()
    );
    let report = crate::support::run_json(&[
        "--follow-forks",
        "--format",
        "json",
        "--top",
        "500",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let children: Vec<&Value> = report["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| !p["parent"].is_null())
        .collect();
    assert_eq!(children.len(), 3, "{}", report["processes"]);
    for child in &children {
        assert_eq!(child["held_at_birth"], true, "{child}");
        assert_eq!(
            child["comm"], "leak_sites",
            "its exec was followed: {child}"
        );
    }
    // One site per call path across the three processes, with each
    // process's leaks counted exactly once.
    assert_eq!(site_totals(&report, "leak_a"), (3 * 4800, 3 * 100));
    assert_eq!(site_totals(&report, "leak_b"), (3 * 10000, 3 * 10));
    assert_eq!(site_pids(&report, "leak_a").len(), 3);
    assert!(
        note_with(&report, "held at birth").is_some(),
        "{}",
        report["notes"]
    );
    assert_eq!(report["events"]["lost"], 0);
}
