//! Report accuracy on what real programs do: a busy loop whose blocks are all
//! released must never show live blocks, however short the trace and
//! whenever it ends; `--name` traces every process of a name, those started
//! later included, and refuses a name nothing has. Fixture: `balanced_loop`
//! (churn sites `churn_realloc`/`churn_plain`, and `named_leak` after go).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::support::{fixture, memtrace, privileged, Fixture, Tracer};

/// Sites whose frames name a churn function, with their live blocks.
fn churn_sites(report: &Value) -> Vec<(String, u64)> {
    report["sites"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|site| {
            let symbol = site["frames"]
                .as_array()?
                .iter()
                .filter_map(|f| f["symbol"].as_str())
                .find(|s| s.starts_with("churn_"))?;
            Some((symbol.to_string(), site["live_count"].as_u64().unwrap_or(0)))
        })
        .collect()
}

/// The site whose first frame is `function`.
fn site_of<'a>(report: &'a Value, function: &str) -> Option<&'a Value> {
    report["sites"].as_array()?.iter().find(|site| {
        site["frames"][0]["symbol"]
            .as_str()
            .is_some_and(|s| s == function)
    })
}

#[test]
fn balanced_sites_hold_nothing_at_the_end_of_short_traces() {
    if !privileged() {
        return;
    }
    // Churns from the start, never told to go: 100 loops a second of
    // malloc -> realloc -> free and malloc -> free.
    let churn = Fixture::start("balanced_loop", &["600", "600", "600", "0"]);
    let pid = churn.pid.to_string();
    const RUNS: usize = 12;
    let dir = std::env::temp_dir().join(format!("memtrace-balanced-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let record = dir.join("trace.jsonl");
    let record = path_str(&record);
    let mut left = Vec::new();
    let mut traced = 0;
    for run in 0..RUNS {
        let out = memtrace(&[
            "--pid",
            &pid,
            "--duration",
            "1s",
            "--format",
            "json",
            "--top",
            "500",
            "--record",
            record,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "run {run}: {stderr}");
        let report: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|err| panic!("run {run}: bad JSON ({err}): {stderr}"));
        // Under load attaching may take most of the second: such a run
        // sees little, but the loop must have been seen by some.
        let events = &report["events"];
        if events["allocs"].as_u64().unwrap_or(0) > 0 && events["frees"].as_u64().unwrap_or(0) > 0 {
            traced += 1;
        }
        for (symbol, live) in churn_sites(&report) {
            left.push(format!("run {run}: {symbol} {live} live"));
        }
        // The recording replays to the same end.
        let out = memtrace(&["report", record, "--format", "json", "--top", "500"]);
        assert!(out.status.success(), "run {run}: replay failed");
        let replayed: Value = serde_json::from_slice(&out.stdout).expect("replay JSON");
        for (symbol, live) in churn_sites(&replayed) {
            left.push(format!("run {run}, replayed: {symbol} {live} live"));
        }
        assert_eq!(
            replayed["events"]["unmatched_frees"], report["events"]["unmatched_frees"],
            "run {run}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(traced > 0, "no run saw the loop's allocations and frees");
    assert!(
        left.is_empty(),
        "balanced sites reported live at the end of a trace ({traced} of {RUNS} runs saw the loop):\n{}",
        left.join("\n")
    );
}

/// `balanced_loop` under a name no other test (or other checkout running
/// the suite) uses, so `--name` sees only this test's processes.
struct NamedCopy {
    dir: PathBuf,
    path: PathBuf,
    name: String,
}

impl NamedCopy {
    fn new(tag: &str) -> NamedCopy {
        // comm keeps 15 bytes: the tag and the pid fit.
        let name = format!("{tag}{}", std::process::id());
        assert!(name.len() <= 15, "{name}");
        let original = fixture("balanced_loop");
        let dir = original.with_file_name(format!("named-{name}"));
        std::fs::create_dir_all(&dir).expect("fixture dir");
        let path = dir.join(&name);
        let _ = std::fs::remove_file(&path);
        // A hard link, not a copy: a file just written may still be open
        // for writing in a process another test thread is forking, and
        // executing it would then fail with ETXTBSY.
        std::fs::hard_link(&original, &path).expect("link the fixture");
        NamedCopy { dir, path, name }
    }

    fn start(&self) -> Fixture {
        // An absolute path: `Fixture::start` joins it to the fixture dir.
        Fixture::start(path_str(&self.path), &["60", "60", "120", "10"])
    }
}

impl Drop for NamedCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

fn process(report: &Value, pid: u32) -> Option<&Value> {
    report["processes"]
        .as_array()?
        .iter()
        .find(|p| p["pid"].as_u64() == Some(u64::from(pid)))
}

fn leak_pids(report: &Value) -> Vec<u64> {
    let site = site_of(report, "named_leak")
        .unwrap_or_else(|| panic!("named_leak site: {}", report["sites"]));
    site["pids"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_u64)
        .collect()
}

#[test]
fn by_name_traces_every_process_with_the_name() {
    if !privileged() {
        return;
    }
    let copy = NamedCopy::new("twins");
    let mut first = copy.start();
    let mut second = copy.start();
    let mut tracer = Tracer::attach(&["--name", &copy.name, "--format", "json", "--top", "500"]);
    // The lower pid is the target; the other is traced beside it.
    let (target, other) = if first.pid < second.pid {
        (first.pid, second.pid)
    } else {
        (second.pid, first.pid)
    };
    assert!(
        tracer
            .stderr_text
            .contains(&format!("tracing pid {target} ({})", copy.name)),
        "{}",
        tracer.stderr_text
    );
    tracer.wait_for_stderr(&format!(
        "tracing pid {other} ({}) too: it has the name {}\n",
        copy.name, copy.name
    ));
    first.go();
    second.go();
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    for fixture in [&first, &second] {
        let entry = process(&report, fixture.pid)
            .unwrap_or_else(|| panic!("pid {} in processes: {stderr}", fixture.pid));
        assert_eq!(entry["by_name"], true, "{entry}");
        assert_eq!(entry["started_during_trace"], false, "{entry}");
        assert_eq!(entry["live_count"], 10, "{entry}");
    }
    let mut pids = leak_pids(&report);
    pids.sort_unstable();
    let mut want = vec![u64::from(first.pid), u64::from(second.pid)];
    want.sort_unstable();
    assert_eq!(pids, want);
    let site = site_of(&report, "named_leak").expect("site");
    assert_eq!(site["live_count"], 20, "{site}");
    assert!(
        report["notes"].as_array().into_iter().flatten().any(|n| n
            .as_str()
            .is_some_and(|n| n.starts_with("traced 2 processes named"))),
        "{}",
        report["notes"]
    );
}

#[test]
fn by_name_picks_up_a_process_started_later() {
    if !privileged() {
        return;
    }
    let copy = NamedCopy::new("late");
    let mut first = copy.start();
    let mut tracer = Tracer::attach(&["--name", &copy.name, "--format", "json", "--top", "500"]);
    assert!(
        tracer
            .stderr_text
            .contains(&format!("tracing pid {} ({})", first.pid, copy.name)),
        "{}",
        tracer.stderr_text
    );
    let mut later = copy.start();
    tracer.wait_for_stderr(&format!(
        "tracing pid {} ({}) too: it has the name",
        later.pid, copy.name
    ));
    first.go();
    later.go();
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    let entry = process(&report, later.pid)
        .unwrap_or_else(|| panic!("pid {} in processes: {stderr}", later.pid));
    assert_eq!(entry["by_name"], true, "{entry}");
    assert_eq!(entry["started_during_trace"], true, "{entry}");
    assert!(entry["attach_delay_ms"].as_u64().is_some(), "{entry}");
    // Found while its C library still starts up, the copy's own thread
    // stack and stdio buffer are traced too: its 10 leaks at least.
    assert!(entry["live_count"].as_u64() >= Some(10), "{entry}");
    assert_eq!(
        process(&report, first.pid).expect("first")["started_during_trace"],
        false
    );
    let mut pids = leak_pids(&report);
    pids.sort_unstable();
    assert_eq!(pids, vec![u64::from(first.pid), u64::from(later.pid)]);
    // Each copy's 10 leaks, at their site.
    let site = site_of(&report, "named_leak").expect("site");
    assert_eq!(site["live_count"], 20, "{site}");
    assert!(
        report["notes"].as_array().into_iter().flatten().any(|n| n
            .as_str()
            .is_some_and(|n| n.starts_with("1 of them started during the trace"))),
        "{}",
        report["notes"]
    );
}

#[test]
fn by_name_with_no_such_process_is_one_line_and_exit_2() {
    if !privileged() {
        return;
    }
    let name = format!("nosuch{}", std::process::id());
    let out = memtrace(&["--name", &name]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        format!("memtrace: --name {name}: no running process has this name (exact comm, argv0 or executable basename)")
    );
}
