//! Leak judgment on the real eBPF path: trends, leak patterns, thread names
//! and allow-lists, against a fixture with one site of each kind.

use crate::support::{privileged, sites_of, Fixture, Tracer};

/// Traces `leak_patterns` for its whole run with 500 ms intervals; returns
/// the final report (the last of the JSON Lines).
fn trace_patterns(extra: &[&str]) -> serde_json::Value {
    let mut fixture = Fixture::start("leak_patterns", &["30", "30", "4"]);
    let pid = fixture.pid.to_string();
    let mut args = vec![
        "--pid",
        &pid,
        "--format",
        "json",
        "--interval",
        "500ms",
        "--top",
        "50",
    ];
    args.extend_from_slice(extra);
    let tracer = Tracer::attach(&args);
    fixture.go();
    tracer.signal(libc::SIGINT);
    let (report, _) = tracer.report_last_line();
    report
}

fn one<'a>(report: &'a serde_json::Value, symbol: &str) -> &'a serde_json::Value {
    let sites = sites_of(report, symbol);
    assert_eq!(sites.len(), 1, "one site for {symbol}");
    sites[0]
}

#[test]
fn trends_and_patterns_name_each_kind_of_leak() {
    if !privileged() {
        return;
    }
    let report = trace_patterns(&[]);
    let iteration = one(&report, "iteration_leak");
    assert_eq!(iteration["trend"], "growing");
    assert!(iteration["growth_bytes_per_s"].as_f64().unwrap_or(0.0) > 0.0);
    assert_eq!(iteration["pattern"]["kind"], "per-iteration");
    assert_eq!(iteration["pattern"]["bytes_per_period"], 4096);
    let period = iteration["pattern"]["period_ms"].as_f64().unwrap_or(0.0);
    assert!(
        (50.0..=1000.0).contains(&period),
        "period {period} ms (fixture: 100 ms)"
    );
    assert!(iteration["survived_intervals"].as_u64().unwrap_or(0) >= 3);

    let fragments = one(&report, "split_concat");
    assert_eq!(fragments["trend"], "growing");
    assert_eq!(fragments["pattern"]["kind"], "small-accumulating");

    let model = one(&report, "load_model");
    assert_eq!(model["live_bytes"], 8 << 20);
    assert_eq!(model["pattern"]["kind"], "large-once");
    assert_ne!(model["trend"], "growing");

    let pool = one(&report, "make_pool");
    assert_eq!(pool["live_bytes"], 64 * 1024);
    assert_eq!(pool["trend"], "stable", "a start-up pool is not a suspect");

    let worker = one(&report, "worker_leak");
    let names: Vec<&str> = worker["thread_names"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str())
        .collect();
    assert_eq!(names, vec!["leaky-worker"]);

    // Blocks freed by another thread are not leaks.
    assert!(sites_of(&report, "produce_item").is_empty());
    // Growing sites rank first.
    assert_eq!(report["sites"][0]["trend"], "growing");
    assert!(report["timeline"].as_array().is_some_and(|t| !t.is_empty()));
}

#[test]
fn allow_list_sets_the_pool_aside_but_still_counts_it() {
    if !privileged() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("memtrace-suppress-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("allow.txt");
    std::fs::write(&file, "# start-up pool\nleak:make_pool\n").expect("write");
    let path = file.to_str().expect("utf-8").to_string();
    let report = trace_patterns(&["--suppress", &path]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        sites_of(&report, "make_pool").is_empty(),
        "suppressed site hidden"
    );
    let entries = report["suppressed"]["by_entry"]
        .as_array()
        .expect("by_entry");
    let pool = entries
        .iter()
        .find(|e| e["entry"] == "line 2: leak:make_pool")
        .expect("the entry that matched");
    assert_eq!(pool["live_bytes"], 64 * 1024);
    assert_eq!(pool["live_count"], 64);
    assert!(report["suppressed"]["live_bytes"].as_u64().unwrap_or(0) >= 64 * 1024);
    // Everything else is still reported.
    assert_eq!(one(&report, "iteration_leak")["trend"], "growing");
}

#[test]
fn malformed_allow_list_names_its_line() {
    if !privileged() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("memtrace-badsup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("bad.txt");
    std::fs::write(&file, "leak:ok\nsize:big-bigger\n").expect("write");
    let out = std::process::Command::new(crate::support::MEMTRACE)
        .args(["--pid", "1", "--suppress"])
        .arg(&file)
        .output()
        .expect("runs");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("line 2"), "{stderr}");
}

#[test]
fn record_then_report_gives_the_live_report_offline() {
    if !privileged() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("memtrace-record-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("trace.jsonl");
    let path = file.to_str().expect("utf-8").to_string();
    let live = trace_patterns(&["--record", &path]);
    let replay = |file: &std::path::Path, extra: &[&str]| {
        std::process::Command::new(crate::support::MEMTRACE)
            .arg("report")
            .arg(file)
            .args(["--format", "json"])
            .args(extra)
            .output()
            .expect("memtrace report runs")
    };
    let out = replay(&file, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let offline: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(offline, live, "the replayed report equals the live one");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&file).expect("meta").permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);

    // A truncated file still gives a report of what could be read, and says so.
    let text = std::fs::read(&file).expect("read");
    let cut = dir.join("cut.jsonl");
    std::fs::write(&cut, &text[..text.len() * 2 / 3]).expect("write");
    let out = replay(&cut, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let partial: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert!(partial["notes"].as_array().is_some_and(|n| n
        .iter()
        .any(|n| n.as_str().is_some_and(|n| n.contains("truncated")))));
    assert!(partial["events"]["allocs"].as_u64().unwrap_or(0) > 0);

    // Not a record file at all: one clear line, exit 2.
    let junk = dir.join("junk.jsonl");
    std::fs::write(&junk, "hello\n").expect("write");
    let out = replay(&junk, &[]);
    assert_eq!(out.status.code(), Some(2));
    let out = replay(&dir.join("missing.jsonl"), &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sampling_and_size_filters_apply_in_the_kernel_and_say_so() {
    if !privileged() {
        return;
    }
    let trace = |extra: &[&str]| {
        let mut args = vec!["--duration", "3s"];
        args.extend_from_slice(extra);
        crate::support::trace_fixture("leak_sites", &args)
    };
    // Size filters: leak_a's 48-byte blocks are below --min-size, leak_b's are not.
    let filtered = trace(&["--min-size", "500"]);
    assert!(sites_of(&filtered, "leak_a").is_empty());
    assert_eq!(
        crate::support::site_totals(&filtered, "leak_b"),
        (10000, 10)
    );
    assert!(
        filtered["kernel_counters"]["filtered"]
            .as_u64()
            .unwrap_or(0)
            >= 100
    );
    assert_eq!(filtered["settings"]["min_size"], 500);
    // The balanced function's 64-byte blocks were filtered out but their
    // frees were not (a free has no size): unmatched, expected, and said so.
    assert!(filtered["events"]["unmatched_frees"].as_u64().unwrap_or(0) >= 1000);
    assert!(
        filtered["notes"]
            .as_array()
            .is_some_and(|n| n.iter().any(|n| n
                .as_str()
                .is_some_and(|n| n.contains("unmatched frees are expected")))),
        "{}",
        filtered["notes"]
    );

    // Sampling by address: a subset of blocks, each with its matching free.
    let sampled = trace(&["--sample-rate", "4"]);
    let (bytes, count) = crate::support::site_totals(&sampled, "leak_a");
    assert!(count < 100, "1 in 4 sampled: {count} of 100 blocks");
    assert_eq!(bytes, count * 48);
    for site in sampled["sites"].as_array().into_iter().flatten() {
        let rate = 4;
        assert_eq!(
            site["estimated_live_bytes"].as_u64(),
            site["live_bytes"].as_u64().map(|b| b * rate)
        );
    }
    // The balanced function's frees were sampled with their mallocs: no
    // unmatched frees appear beyond those of blocks older than the attach.
    let unmatched = sampled["events"]["unmatched_frees"]
        .as_u64()
        .unwrap_or(u64::MAX);
    assert!(unmatched <= 10, "unmatched frees {unmatched}");
    assert!(sampled["notes"].as_array().is_some_and(|n| n
        .iter()
        .any(|n| n.as_str().is_some_and(|n| n.contains("sampling 1 in 4")))));
    assert_eq!(sampled["settings"]["sample_rate"], 4);
    // Reconciliation against the target's own memory.
    let reconciliation = &sampled["reconciliation"];
    assert!(reconciliation["rss_anon_at_attach"].as_u64().is_some());
    assert!(reconciliation["tracked_host_bytes"].as_u64().is_some());
}
