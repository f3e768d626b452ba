//! The leak check's snapshot mode by pid (`--leak-check-mode snapshot`, the
//! default): the service stopped only to clone a copy-on-write child that
//! is scanned while the service runs. On `leak_snapshot`
//! (tests/fixtures/leak_check/snapshot.c): the verdicts equal a full
//! stop's while a writer thread moves every pointer of a ring without a
//! pause; blocks held only in `MADV_DONTFORK` and `MADV_WIPEONFORK` pages
//! stay reachable (those pages are copied during the stop); a seccomp
//! filter that kills on clone and wait4 is suspended for the injected
//! calls; a memory cgroup near its limit makes the check stop the service
//! instead, and say so; memtrace killed mid-scan leaves no child behind.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::leak::{checked_by_pid, checked_every_second, service_runs_on, site_split, state};
use crate::support::{privileged, Fixture};

/// Bytes and blocks.
type Amount = (u64, u64);

/// The verdicts of the fixture's sites, by function: still reachable,
/// definitely lost.
fn verdicts(report: &Value) -> Vec<(&'static str, Amount, Amount)> {
    [
        "keep_in_dontfork",
        "keep_in_wipeonfork",
        "fill_ring",
        "fill_big",
        "lose",
    ]
    .into_iter()
    .map(|function| {
        let split = site_split(report, function);
        (function, split["still_reachable"], split["definitely_lost"])
    })
    .collect()
}

/// The children of every thread of `pid`.
fn children(pid: u32) -> Vec<u32> {
    let mut all = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let text = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        all.extend(
            text.split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok()),
        );
    }
    all
}

/// `Private_Dirty` of a process (`/proc/PID/smaps_rollup`), KiB.
fn private_dirty_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("Private_Dirty:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// The service checks its ring and blocks, says so, and exits cleanly.
fn ends_intact(mut service: Fixture) {
    assert!(
        children(service.pid).is_empty(),
        "{:?}",
        children(service.pid)
    );
    service.send_line();
    service.expect_line("intact");
    service.expect_line("alive");
    service.send_line();
    service.wait();
}

/// Checks `leak_snapshot BIG_MIB` by pid in `mode`, the writer running.
fn checked(mode: &str, args: &[&str]) -> (Value, Fixture) {
    let mut service = Fixture::start("leak_snapshot", args);
    let (report, _) = checked_by_pid(&mut service, "served", &["--leak-check-mode", mode]);
    (report, service)
}

/// The check fell back to the full stop, its `fallback` naming `why`, and
/// judged the fixture's lost blocks all the same.
fn stopped_because(report: &Value, why: &str) {
    let check = &report["leak_check"];
    assert_eq!(check["mode"], "stopped", "{check}");
    let fallback = check["fallback"].as_str().unwrap_or_default();
    assert!(fallback.contains(why), "{check}");
    assert_eq!(site_split(report, "lose")["definitely_lost"], (48 * 50, 50));
}

#[test]
fn a_snapshot_judges_as_a_full_stop_does_while_the_service_writes() {
    if !privileged() {
        return;
    }
    let expected = vec![
        ("keep_in_dontfork", (100, 1), (0, 0)),
        ("keep_in_wipeonfork", (200, 1), (0, 0)),
        ("fill_ring", (64 * 1000, 1000), (0, 0)),
        ("fill_big", (16 * 16 * 65536, 256), (0, 0)),
        ("lose", (0, 0), (48 * 50, 50)),
    ];
    let (stopped, service) = checked("stopped", &["16"]);
    let check = &stopped["leak_check"];
    assert_eq!(check["mode"], "stopped", "{check}");
    assert_eq!(check["fallback"], Value::Null, "{check}");
    assert_eq!(verdicts(&stopped), expected);
    ends_intact(service);

    let (snapshot, service) = checked("snapshot", &["16"]);
    let check = &snapshot["leak_check"];
    assert_eq!(check["mode"], "snapshot", "{check}");
    assert_eq!(check["fallback"], Value::Null, "{check}");
    // The dontfork and wipeonfork pages, copied during the stop.
    assert_eq!(check["copied_at_stop_bytes"], 8192, "{check}");
    assert!(
        check["clone_ms"].as_f64().is_some_and(|ms| ms > 0.0),
        "{check}"
    );
    assert!(
        check["scan_ms"].as_f64().is_some_and(|ms| ms > 0.0),
        "{check}"
    );
    // Estimated before the stop from this host's measured fork cost.
    assert!(
        check["clone_estimate_ms"]
            .as_f64()
            .is_some_and(|ms| ms > 0.0),
        "{check}"
    );
    assert_eq!(verdicts(&snapshot), expected);
    for key in ["definitely_lost", "indirectly_lost"] {
        assert_eq!(check[key], stopped["leak_check"][key], "{key}");
    }
    ends_intact(service);
}

#[test]
fn a_seccomp_filter_killing_on_clone_and_wait4_is_suspended_for_the_snapshot() {
    if !privileged() {
        return;
    }
    let (report, service) = checked("snapshot", &["0", "seccomp"]);
    let check = &report["leak_check"];
    assert_eq!(check["mode"], "snapshot", "{check}");
    assert_eq!(
        site_split(&report, "lose")["definitely_lost"],
        (48 * 50, 50)
    );
    // Alive: neither the clone nor the reaping wait4 met the filter.
    assert!(matches!(state(service.pid), Some('S' | 'R')));
    ends_intact(service);
}

/// A memory cgroup (v2, else v1) holding `pid` with `limit` bytes; moved
/// back to the root and removed on drop.
struct MemoryCgroup {
    dir: std::path::PathBuf,
    root: std::path::PathBuf,
    pid: u32,
}

impl MemoryCgroup {
    fn create(pid: u32, limit: u64) -> MemoryCgroup {
        let v2 = std::path::Path::new("/sys/fs/cgroup/cgroup.controllers");
        let unified = std::fs::read_to_string(v2).is_ok_and(|c| c.contains("memory"));
        let (root, limit_file) = if unified {
            ("/sys/fs/cgroup", "memory.max")
        } else {
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")
        };
        let root = std::path::PathBuf::from(root);
        let dir = root.join(format!("memtrace-snapshot-test-{pid}"));
        std::fs::create_dir(&dir).expect("a memory cgroup");
        let cgroup = MemoryCgroup { dir, root, pid };
        std::fs::write(cgroup.dir.join("cgroup.procs"), pid.to_string()).expect("moved in");
        std::fs::write(cgroup.dir.join(limit_file), limit.to_string()).expect("limited");
        cgroup
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(self.root.join("cgroup.procs"), self.pid.to_string());
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[test]
fn a_memory_cgroup_near_its_limit_makes_the_check_stop_the_service_and_say_why() {
    if !privileged() {
        return;
    }
    let mut service = Fixture::start("leak_snapshot", &["0"]);
    let _cgroup = MemoryCgroup::create(service.pid, 48 << 20);
    let (report, _) = checked_by_pid(&mut service, "served", &[]);
    stopped_because(&report, "memory cgroup");
    ends_intact(service);
}

#[test]
fn pinned_memory_makes_the_check_stop_the_service_and_say_why() {
    if !privileged() {
        return;
    }
    // 96 MiB registered with io_uring as fixed buffers: pinned, so a clone
    // would copy them during the stop.
    let mut service = Fixture::start("leak_snapshot", &["0", "pinned"]);
    let (report, _) = checked_by_pid(&mut service, "served", &[]);
    let status =
        std::fs::read_to_string(format!("/proc/{}/status", service.pid)).unwrap_or_default();
    let pinned_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmPin:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    if pinned_kib == 0 {
        eprintln!("skipping: no io_uring here, nothing pinned");
        ends_intact(service);
        return;
    }
    assert!(
        pinned_kib >= 96 << 10,
        "the kernel counts io_uring's buffers as pinned: {pinned_kib} kB"
    );
    stopped_because(&report, "pinned");
    ends_intact(service);
}

#[test]
fn a_clone_estimated_past_the_max_pause_makes_the_check_stop_the_service_and_say_why() {
    if !privileged() {
        return;
    }
    // No fork of a process takes under a microsecond: the estimate is over
    // the bound, and the check stops the service instead (its scan cut at
    // the bound, and said).
    let mut service = Fixture::start("leak_snapshot", &["16"]);
    let (report, _) = checked_by_pid(
        &mut service,
        "served",
        &[
            "--leak-check-mode",
            "snapshot",
            "--leak-check-max-pause",
            "1us",
        ],
    );
    let check = &report["leak_check"];
    assert_eq!(check["mode"], "stopped", "{check}");
    let fallback = check["fallback"].as_str().unwrap_or_default();
    assert!(
        fallback.contains("its clone would stop it about")
            && fallback.contains("more than --leak-check-max-pause 0.0 ms"),
        "{check}"
    );
    assert!(
        check["reason"]
            .as_str()
            .is_some_and(|r| r.contains("--leak-check-max-pause")),
        "{check}"
    );
    // The heap walk, cut too, says so.
    let walk = &check["before_attach"]["heap_walk"];
    assert!(
        walk["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("the walk was cut at --leak-check-max-pause")),
        "{walk}"
    );
    ends_intact(service);
}

#[test]
fn memtrace_killed_during_a_snapshot_scan_leaves_no_child_and_the_service_runs_on() {
    if !privileged() {
        return;
    }
    // 1 GiB to scan: the snapshot lives long enough to be caught. The
    // service idles meanwhile (its worker blocked in read(2)), so nothing it
    // writes makes pages private to the child.
    let mut service = Fixture::start("leak_service", &["10", "30", "1024"]);
    let tracer = checked_every_second(&service, "snapshot");
    service.send_line();
    service.expect_line("served 10");
    // A snapshot caught a while into its scan: what the scan read is still
    // shared with the service, not copied into the child (a pinning read,
    // `process_vm_readv`, would unshare every page it reads).
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut private = None;
    let mut child = Vec::new();
    while private.is_none() && Instant::now() < deadline {
        child = children(service.pid);
        if child.len() != 1 {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        std::thread::sleep(Duration::from_millis(300));
        private = private_dirty_kib(child[0]).filter(|_| children(service.pid) == child);
    }
    let private = private.expect("no snapshot was caught 300 ms into its scan within 60 s");
    assert!(
        private < 64 << 10,
        "the child holds {private} KiB of its own"
    );
    tracer.signal(libc::SIGKILL);
    drop(tracer);
    // Killed with memtrace, then reaped by the service (the guard's wait4).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !children(service.pid).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        std::fs::metadata(format!("/proc/{}", child[0])).is_err(),
        "child {} left",
        child[0]
    );
    assert!(
        children(service.pid).is_empty(),
        "{:?}",
        children(service.pid)
    );
    service_runs_on(service);
}

#[test]
fn launch_mode_interval_checks_judge_the_running_command_as_its_exit_check_does() {
    if !privileged() {
        return;
    }
    use std::io::Write;
    let output = std::env::temp_dir().join(format!(
        "memtrace-launch-interval-{}.jsonl",
        std::process::id()
    ));
    let mut memtrace = std::process::Command::new(crate::support::MEMTRACE)
        .arg("--output")
        .arg(&output)
        .args([
            "--leak-check",
            "--interval",
            "300ms",
            "--format",
            "json",
            "--top",
            "100",
            "--",
        ])
        .arg(crate::support::fixture("leak_snapshot"))
        .arg("16")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("memtrace runs");
    let mut stdin = memtrace.stdin.take().expect("stdin");
    // Go; the writer runs through several checks; stop it; exit. (From a
    // thread: the interim reports are read meanwhile.)
    let feeder = std::thread::spawn(move || {
        for pause in [1500, 2500, 500] {
            std::thread::sleep(Duration::from_millis(pause));
            let _ = stdin.write_all(b"\n");
        }
    });
    let out = memtrace.wait_with_output().expect("memtrace ends");
    let _ = feeder.join();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The command's own output (on the same stdout as the interim
    // reports): its data intact after the checks.
    assert!(
        stdout.contains("intact\n") && !stdout.contains("corrupt"),
        "{stdout}"
    );
    let last: Value = std::fs::read_to_string(&output)
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .expect("the final report");
    let _ = std::fs::remove_file(&output);
    // Interim reports, whole lines (one the command wrote into is skipped).
    let reports: Vec<Value> = stdout
        .lines()
        .filter(|l| l.starts_with('{'))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let expected = vec![
        ("keep_in_dontfork", (100, 1), (0, 0)),
        ("keep_in_wipeonfork", (200, 1), (0, 0)),
        ("fill_ring", (64 * 1000, 1000), (0, 0)),
        ("fill_big", (16 * 16 * 65536, 256), (0, 0)),
        ("lose", (0, 0), (48 * 50, 50)),
    ];
    // Checks at intervals while the writer moved the ring: every thread
    // stopped by the supervisor, each judged as the exit check judges.
    let during: Vec<&Value> = reports
        .iter()
        .filter(|r| r["interim"] == true && r["leak_check"]["when"] == "interval")
        .filter(|r| site_split(r, "fill_ring").get("still_reachable") == Some(&(64_000, 1000)))
        // The writer thread still running.
        .filter(|r| r["leak_check"]["threads"] == 2)
        .collect();
    assert!(
        during.len() >= 2,
        "{} interval checks after the work",
        during.len()
    );
    for report in &during {
        let check = &report["leak_check"];
        assert_eq!(check["mode"], "stopped", "{check}");
        assert_eq!(verdicts(report), expected);
    }
    assert_eq!(last["leak_check"]["when"], "exit");
    assert_eq!(verdicts(&last), expected);
}
