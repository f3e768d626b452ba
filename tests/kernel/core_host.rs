//! Host allocators (libc heap, anonymous mmap) on the real eBPF path.

use crate::support::{
    self, privileged, run_json, site_totals, sites_of, total_for, Fixture, Tracer,
};

/// Attaches to a running `leak_sites`, lets it work, and returns the report.
fn trace_leak_sites(fixture_name: &str) -> serde_json::Value {
    support::trace_fixture(fixture_name, &["--duration", "4s"])
}

#[test]
fn attach_to_running_process_finds_each_leak_exactly() {
    if !privileged() {
        return;
    }
    let report = trace_leak_sites("leak_sites");
    assert_eq!(site_totals(&report, "leak_a"), (4800, 100), "leak_a");
    assert_eq!(site_totals(&report, "leak_b"), (10000, 10), "leak_b");
    assert_eq!(
        site_totals(&report, "leak_calloc"),
        (1000, 5),
        "calloc = n*size"
    );
    assert_eq!(
        site_totals(&report, "leak_memalign"),
        (768, 3),
        "posix_memalign"
    );
    assert_eq!(
        site_totals(&report, "realloc_chain"),
        (4096, 1),
        "realloc chain keeps only the last block"
    );
    assert_eq!(
        site_totals(&report, "leak_mmap"),
        (131072, 2),
        "anonymous mmap"
    );
    for freed in ["balanced", "realloc_to_zero", "mmap_balanced"] {
        assert!(
            sites_of(&report, freed).is_empty(),
            "{freed} freed everything but was reported"
        );
    }
    // Several threads leaking: every block found, attributed to the worker threads.
    assert_eq!(site_totals(&report, "leak_in_thread"), (4096, 32));
    let threads: std::collections::BTreeSet<u64> = sites_of(&report, "leak_in_thread")
        .iter()
        .flat_map(|s| s["threads"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t.as_u64())
        .collect();
    assert_eq!(threads.len(), 4, "four worker threads: {threads:?}");
    assert!(!threads.contains(&report["target"]["pid"].as_u64().unwrap_or(0)));
    // The workers were joined before the report: said in a note, by tid.
    let note = report["notes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str())
        .find(|n| n.contains("allocating thread(s) exited during the trace"))
        .unwrap_or_else(|| panic!("no note on exited threads: {}", report["notes"]));
    assert!(note.starts_with("4 allocating"), "{note}");
    for tid in &threads {
        assert!(note.contains(&tid.to_string()), "{note}");
    }
    // Site metadata and frames.
    let leak_a = sites_of(&report, "leak_a")[0];
    assert_eq!(leak_a["allocator"], "libc");
    assert_eq!(leak_a["memory"], "host");
    assert_eq!(
        leak_a["frames"][0]["file"]
            .as_str()
            .map(|f| f.ends_with("leak_sites.c")),
        Some(true)
    );
    assert!(leak_a["frames"][0]["line"].as_u64().is_some());
    assert_eq!(
        leak_a["frames"][1]["symbol"], "main",
        "the caller's caller follows"
    );
    assert!(leak_a["oldest_age_ms"].as_u64().is_some());
    // Counters are reported and nothing was lost.
    for key in [
        "allocs",
        "frees",
        "lost",
        "unmatched_frees",
        "stack_failures",
    ] {
        assert!(report["events"][key].is_u64(), "events.{key}");
    }
    assert_eq!(report["events"]["lost"], 0);
    assert!(report["events"]["frees"].as_u64().unwrap_or(0) >= 1000);
    assert_eq!(report["target"]["comm"], "leak_sites");
    let libraries = report["libraries"].as_array().expect("libraries");
    assert!(libraries
        .iter()
        .any(|l| l["path"].as_str().is_some_and(|p| p.contains("libc.so"))));
}

#[test]
fn build_without_frame_pointers_still_names_the_direct_caller() {
    if !privileged() {
        return;
    }
    let report = trace_leak_sites("leak_sites_nofp");
    // The first frame comes from the return probe's instruction pointer, not
    // from the frame-pointer walk, so it is exact even without frame pointers.
    assert_eq!(site_totals(&report, "leak_a"), (4800, 100));
    assert_eq!(site_totals(&report, "leak_b"), (10000, 10));
    let (libc_bytes, _) = total_for(&report, "libc");
    assert!(libc_bytes >= 4800 + 10000 + 1000 + 768 + 4096 + 4096);
}

#[test]
fn launch_mode_sees_a_leak_in_the_first_instructions_of_main() {
    if !privileged() {
        return;
    }
    let early = support::fixture("early_leak");
    let early = early.to_str().expect("utf-8 path");
    let report = run_json(&["--format", "json", "--", early]);
    assert_eq!(site_totals(&report, "early_leak_first"), (777, 1));
    assert!(report["notes"].as_array().is_some_and(|n| n
        .iter()
        .any(|n| n.as_str().is_some_and(|n| n.contains("command exited")))));
}

#[test]
fn target_exiting_mid_trace_gives_a_final_report() {
    if !privileged() {
        return;
    }
    // Works at once after go, then exits; memtrace was told to trace far longer.
    let mut fixture = Fixture::start("leak_sites", &["30", "0"]);
    let pid = fixture.pid.to_string();
    let tracer = Tracer::attach(&["--pid", &pid, "--format", "json", "--top", "100"]);
    fixture.go();
    fixture.wait();
    let (report, stderr) = tracer.report();
    assert_eq!(site_totals(&report, "leak_a"), (4800, 100));
    assert!(
        stderr.contains("exited"),
        "stderr says the target exited: {stderr}"
    );
    assert!(report["notes"].as_array().is_some_and(|n| n
        .iter()
        .any(|n| n.as_str().is_some_and(|n| n.contains("exited")))));
}

#[test]
fn sigint_produces_a_final_report_and_exit_zero() {
    if !privileged() {
        return;
    }
    let mut fixture = Fixture::start("leak_sites", &["30", "30"]);
    let pid = fixture.pid.to_string();
    let tracer = Tracer::attach(&["--pid", &pid, "--format", "json", "--top", "100"]);
    fixture.go();
    tracer.signal(libc::SIGINT);
    let (report, _) = tracer.report();
    assert_eq!(site_totals(&report, "leak_b"), (10000, 10));
    // The target is unharmed and still running.
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
}

#[test]
fn stack_depth_zero_reports_sites_without_frames() {
    if !privileged() {
        return;
    }
    let mut fixture = Fixture::start("leak_sites", &["30", "30"]);
    let pid = fixture.pid.to_string();
    let tracer = Tracer::attach(&[
        "--pid",
        &pid,
        "--format",
        "json",
        "--stack-depth",
        "0",
        "--duration",
        "3s",
    ]);
    fixture.go();
    let (report, _) = tracer.report();
    let (libc_bytes, _) = total_for(&report, "libc");
    assert!(libc_bytes >= 4800 + 10000);
    let sites = report["sites"].as_array().expect("sites");
    assert!(sites
        .iter()
        .all(|s| s["frames"].as_array().is_some_and(|f| f.is_empty())));
    assert_eq!(report["events"]["stack_failures"], 0);
}

#[test]
fn children_of_the_target_are_reported_as_not_traced() {
    if !privileged() {
        return;
    }
    let mut parent = std::process::Command::new("sh")
        .args(["-c", "sleep 30 & sleep 30 & wait"])
        .spawn()
        .expect("sh runs");
    let pid = parent.id().to_string();
    let tracer = Tracer::attach(&["--pid", &pid, "--format", "json", "--duration", "3s"]);
    let (report, _) = tracer.report();
    let _ = parent.kill();
    let _ = parent.wait();
    let note = report["notes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str())
        .find(|n| n.contains("were not traced"))
        .unwrap_or_else(|| panic!("no note about children: {}", report["notes"]))
        .to_string();
    assert!(note.starts_with("2 child process"), "{note}");
}

#[test]
fn bpf_stats_reports_memtracers_own_programs_and_is_off_by_default() {
    if !privileged() {
        return;
    }
    let run = |extra: &[&str]| {
        let mut fixture = Fixture::start("leak_sites", &["30", "30"]);
        let pid = fixture.pid.to_string();
        let mut args = vec!["--pid", &pid, "--format", "json", "--duration", "3s"];
        args.extend_from_slice(extra);
        let tracer = Tracer::attach(&args);
        fixture.go();
        tracer.report().0
    };
    let report = run(&["--bpf-stats"]);
    let allocs = report["events"]["allocs"].as_u64().expect("allocs");
    let programs = report["bpf_programs"].as_array().expect("bpf_programs");
    let program = |name: &str| {
        programs
            .iter()
            .find(|p| p["program"] == name)
            .unwrap_or_else(|| panic!("{name} in {programs:?}"))
    };
    for name in ["call_enter", "call_exit"] {
        let p = program(name);
        let runs = p["runs"].as_u64().expect("runs");
        // Every allocation traced ran both programs at least once.
        assert!(runs >= allocs, "{name}: {runs} runs for {allocs} allocs");
        assert!(p["run_ns"].as_u64().expect("run_ns") > 0, "{p}");
        assert_eq!(
            p["ns_per_run"].as_u64(),
            Some(p["run_ns"].as_u64().unwrap_or(0) / runs),
            "{p}"
        );
    }
    let plain = run(&[]);
    assert_eq!(
        plain["bpf_programs"],
        serde_json::json!([]),
        "off by default"
    );
}

#[test]
fn mappings_unmapped_in_parts_keep_exactly_what_is_still_mapped() {
    if !privileged() {
        return;
    }
    const PAGE: u64 = 4096;
    let report = support::trace_fixture("mmap_ranges", &[]);
    let events = &report["events"];
    assert_eq!(
        site_totals(&report, "trim_tail"),
        (3 * 12 * PAGE, 3),
        "a tail unmapped: {}",
        report["sites"]
    );
    assert_eq!(
        site_totals(&report, "trim_both"),
        (2 * 8 * PAGE, 2),
        "head and tail unmapped"
    );
    assert_eq!(
        site_totals(&report, "punch_hole"),
        (2 * 8 * PAGE, 4),
        "a hole splits a mapping in two"
    );
    for gone in ["gone_in_parts", "two_at_once"] {
        assert_eq!(site_totals(&report, gone), (0, 0), "{gone}");
    }
    // 3 tails, 2 x (head, tail), 2 holes, 4 first parts.
    assert_eq!(events["mappings_trimmed"], 13, "{events}");
    assert!(
        events["unmaps_untracked"].as_u64() >= Some(1),
        "the file mapping's unmap: {events}"
    );
    assert_eq!(events["unmatched_frees"], 0, "{events}");
}

/// Whether `memtrace doctor` finds usable `uprobe_multi` links here.
fn kernel_has_uprobe_multi() -> bool {
    let out = support::memtrace(&["doctor", "--format", "json"]);
    let doctor: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    doctor["features"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|f| f["key"] == "uprobe_multi" && f["presence"] == "found")
}

#[test]
fn perf_events_and_uprobe_multi_links_find_the_same_leaks() {
    if !privileged() {
        return;
    }
    let multi = kernel_has_uprobe_multi();
    let modes: &[&str] = if multi { &["perf", "multi"] } else { &["perf"] };
    let mut totals = Vec::new();
    for &mode in modes {
        let mut fixture = Fixture::start("leak_sites", &["30", "30"]);
        let pid = fixture.pid.to_string();
        let tracer = Tracer::attach(&[
            "--pid",
            &pid,
            "--format",
            "json",
            "--top",
            "500",
            "--duration",
            "4s",
            "-v",
            "--attach",
            mode,
        ]);
        fixture.go();
        let (report, stderr) = tracer.report_last_line();
        // Each probed function is logged as attached, by links only in multi mode.
        let by_links = stderr
            .lines()
            .filter(|l| l.contains("attached") && l.contains("(uprobe_multi)"))
            .count();
        if mode == "multi" {
            assert!(
                by_links >= 8,
                "functions attached by uprobe_multi links: {stderr}"
            );
        } else {
            assert_eq!(by_links, 0, "--attach perf uses perf events: {stderr}");
        }
        assert_eq!(report["events"]["lost"], 0, "{mode}");
        let sums: Vec<(u64, u64)> = [
            "leak_a",
            "leak_b",
            "leak_calloc",
            "realloc_chain",
            "leak_mmap",
            "leak_in_thread",
        ]
        .iter()
        .map(|s| site_totals(&report, s))
        .collect();
        totals.push(sums);
    }
    assert_eq!(totals[0][0], (4800, 100), "leak_a with perf events");
    assert_eq!(totals[0][5], (4096, 32), "leak_in_thread with perf events");
    if multi {
        assert_eq!(
            totals[0], totals[1],
            "perf events and uprobe_multi links agree"
        );
    } else {
        // Asked for where the kernel lacks them: one clear line.
        let out = support::memtrace(&["--attach", "multi", "--duration", "1s", "--", "true"]);
        support::assert_one_clear_line(&out, 2, "--attach multi");
    }
}
