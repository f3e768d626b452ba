//! DWARF (CFI) unwinding in the kernel, on code built without frame
//! pointers: exact call chains by pid, in launch mode and through a library
//! loaded after attach; C++ `new` through libstdc++; deep recursion cut at
//! `--stack-depth` and counted; signal handlers and threads; Debian's
//! stripped, static `python3.11`; frame-pointer code unchanged against
//! `--stacks fp`; walks replayed only when every stack word they read is
//! unchanged; a second attach loading the tables from the on-disk cache,
//! and the search for allocator functions too (the same probes, the same
//! leaks);
//! tables built while tracing runs (whole stacks once ready, stacks cut
//! before counted).

use serde_json::Value;

use crate::support::{fixture, privileged, site_totals, sites_of, Fixture, Tracer};

/// An empty cache directory of this run's own (`memtrace-NAME-PID` in the
/// temporary directory), and the same as an argument.
fn empty_cache_dir(name: &str) -> (std::path::PathBuf, String) {
    let cache = std::env::temp_dir().join(format!("memtrace-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let dir = cache.display().to_string();
    (cache, dir)
}

/// The symbols of a site's frames, in order.
fn symbols(site: &Value) -> Vec<String> {
    site["frames"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| f["symbol"].as_str().unwrap_or("??").to_string())
        .collect()
}

/// Traces `unwind_chain MODE` by pid with `extra` flags.
fn trace_chain(mode: &str, extra: &[&str]) -> Value {
    trace_chain_env(mode, extra, &[])
}

/// [`trace_chain`] with environment variables for memtrace.
pub fn trace_chain_env(mode: &str, extra: &[&str], env: &[(&str, &str)]) -> Value {
    let mut target = Fixture::start("unwind_chain", &[mode, "30", "30"]);
    let pid = target.pid.to_string();
    let mut args = vec!["--pid", pid.as_str(), "--format", "json", "--top", "500"];
    args.extend_from_slice(extra);
    let tracer = Tracer::attach_env(&args, env);
    target.go();
    tracer.signal(libc::SIGINT);
    tracer.report().0
}

const CHAIN: [&str; 8] = [
    "lib_level3",
    "lib_level2",
    "lib_level1",
    "lib_entry",
    "outer3",
    "outer2",
    "outer1",
    "main",
];

pub fn assert_whole_chain(report: &Value, how: &str) {
    assert_eq!(
        site_totals(report, "lib_level3"),
        (15540, 20),
        "{how}: bytes"
    );
    let sites = sites_of(report, "lib_level3");
    assert_eq!(sites.len(), 1, "{how}: one call path, one site");
    let frames = symbols(sites[0]);
    assert_eq!(
        frames.get(..CHAIN.len()),
        Some(&CHAIN.map(String::from)[..]),
        "{how}: the exact chain up to main: {frames:?}"
    );
    assert!(
        frames.iter().any(|f| f.contains("libc_start")),
        "{how}: through libc to the start: {frames:?}"
    );
}

#[test]
fn no_frame_pointer_chain_is_whole_by_pid() {
    if !privileged() {
        return;
    }
    let report = trace_chain("chain", &[]);
    assert_whole_chain(&report, "by pid");
    assert_eq!(report["unwind"]["mode"], "dwarf");
    assert!(report["unwind"]["objects"].as_u64().unwrap_or(0) >= 3);
    assert!(report["unwind"]["kernel_bytes_used"].as_u64().unwrap_or(0) > 0);
    assert_eq!(report["stack_truncations_by_cause"]["no_table"], 0);
    assert_eq!(report["stack_truncations_by_cause"]["fault"], 0);

    // Frame pointers alone cannot see past the innermost function.
    let fp = trace_chain("chain", &["--stacks", "fp"]);
    let sites = sites_of(&fp, "lib_level3");
    assert!(!sites.is_empty());
    assert!(
        sites
            .iter()
            .all(|s| !symbols(s).contains(&"outer1".to_string())),
        "--stacks fp walks frame pointers only"
    );
    assert!(fp["unwind"].is_null());
}

#[test]
fn no_frame_pointer_chain_is_whole_in_launch_mode() {
    if !privileged() {
        return;
    }
    // The command allocates at once: memtrace learns each library ld.so
    // maps before any of its code runs.
    let exe = fixture("unwind_chain");
    let exe = exe.to_string_lossy();
    let out = std::env::temp_dir().join(format!(
        "memtrace-unwind-launch-{}.json",
        std::process::id()
    ));
    let out_arg = out.to_string_lossy().to_string();
    let status = std::process::Command::new(crate::support::MEMTRACE)
        .args([
            "--format", "json", "--output", &out_arg, "--", &exe, "chain", "@0",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .status()
        .expect("memtrace runs");
    assert!(status.success(), "memtrace: {status}");
    let text = std::fs::read_to_string(&out).expect("report written");
    let _ = std::fs::remove_file(&out);
    let report: Value = serde_json::from_str(&text).expect("JSON report");
    assert_whole_chain(&report, "launch mode");
}

#[test]
fn library_loaded_after_attach_gets_its_table() {
    if !privileged() {
        return;
    }
    let report = trace_chain("dlopen", &[]);
    assert_whole_chain(&report, "dlopen after attach");
}

#[test]
fn library_loaded_after_attach_is_built_while_tracing_when_the_rest_was_cached() {
    if !privileged() {
        return;
    }
    let (cache, dir) = empty_cache_dir("dlopen-cache");
    let mut target = Fixture::start("late_dlopen", &["30", "30"]);
    let pid = target.pid.to_string();
    let args = [
        "--pid",
        pid.as_str(),
        "--format",
        "json",
        "--top",
        "100",
        "--table-cache",
        dir.as_str(),
    ];
    // A first attach caches the objects mapped before the dlopen, and
    // detaches...
    let first = Tracer::attach(&args);
    first.signal(libc::SIGINT);
    let first = first.report().0;
    assert!(first["unwind"]["deferred"].as_u64().unwrap_or(0) >= 2);
    // ... so the second loads every table before tracing (none deferred):
    // the libraries dlopen'ed while it traces are built then.
    let mut tracer = Tracer::attach(&args);
    assert!(
        !tracer.stderr_text.contains("still building"),
        "{}",
        tracer.stderr_text
    );
    target.send_line();
    target.expect_line("loaded");
    // Both libraries may be found by one look at the mappings or by two,
    // each followed by its own "ready" line: wait for one after both.
    tracer.wait_for_stderr_after(&["libcuda.so.1", "libcudart.so.12"], "unwind tables ready");
    target.send_line();
    target.expect_line("done");
    tracer.signal(libc::SIGINT);
    let report = tracer.report().0;
    let unwind = &report["unwind"];
    assert!(unwind["deferred"].as_u64().unwrap_or(0) >= 1, "{unwind}");
    assert_eq!(unwind["pending"], serde_json::json!([]), "{unwind}");
    assert!(unwind["deferred_ms"].is_u64(), "{unwind}");
    assert_eq!(site_totals(&report, "late_leak"), (4 * 1048576, 4));
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn deep_recursion_is_cut_at_the_depth_and_counted() {
    if !privileged() {
        return;
    }
    let report = trace_chain("deep", &["--stack-depth", "40"]);
    assert_eq!(site_totals(&report, "recurse"), (999, 3));
    let sites = sites_of(&report, "recurse");
    let frames = symbols(sites[0]);
    assert_eq!(frames.len(), 40, "--stack-depth frames: {frames:?}");
    assert!(frames.iter().all(|f| f == "recurse"));
    let depth = report["stack_truncations_by_cause"]["depth"]
        .as_u64()
        .unwrap_or(0);
    assert!(depth >= 3, "the three deep stacks counted: {depth}");
    assert!(report["notes"].as_array().into_iter().flatten().any(|n| n
        .as_str()
        .is_some_and(|n| n.contains("stack walk(s) ended"))));
}

#[test]
fn signal_handlers_and_threads_unwind_cleanly() {
    if !privileged() {
        return;
    }
    let report = trace_chain("all", &[]);
    assert_eq!(site_totals(&report, "in_handler"), (2220, 4), "signal");
    for site in sites_of(&report, "in_handler") {
        let frames = symbols(site);
        let handler = frames.iter().position(|f| f == "on_signal");
        let raiser = frames.iter().position(|f| f == "signal_site");
        assert!(
            matches!((handler, raiser), (Some(h), Some(r)) if h < r),
            "through the signal frame to the interrupted code: {frames:?}"
        );
        assert!(frames.contains(&"main".to_string()), "{frames:?}");
    }
    assert_eq!(site_totals(&report, "thread_leaf"), (1776, 4), "thread");
    for site in sites_of(&report, "thread_leaf") {
        let frames = symbols(site);
        assert_eq!(frames.get(1).map(String::as_str), Some("worker"));
        assert!(
            frames.last().is_some_and(|f| f.contains("clone")),
            "a thread's stack ends at clone3: {frames:?}"
        );
    }
    assert_eq!(report["stack_truncations_by_cause"]["fault"], 0);
    assert_eq!(report["stack_truncations_by_cause"]["bad_rule"], 0);
}

#[test]
fn cpp_new_reaches_the_caller_through_libstdcxx() {
    if !privileged() {
        return;
    }
    let mut target = Fixture::start("unwind_cpp", &["30", "30"]);
    let pid = target.pid.to_string();
    let tracer = Tracer::attach(&["--pid", &pid, "--format", "json", "--top", "500"]);
    target.go();
    tracer.signal(libc::SIGINT);
    let report = tracer.report().0;
    let sites: Vec<&Value> = report["sites"].as_array().into_iter().flatten().collect();
    let reaching = |function: &str| -> (u64, u64) {
        sites
            .iter()
            .filter(|s| {
                let frames = symbols(s);
                frames.iter().any(|f| f == function) && frames.iter().any(|f| f == "main")
            })
            .fold((0, 0), |(b, c), s| {
                (
                    b + s["live_bytes"].as_u64().unwrap_or(0),
                    c + s["live_count"].as_u64().unwrap_or(0),
                )
            })
    };
    assert_eq!(reaching("make_node()"), (2000, 10), "new Node: {sites:#?}");
    assert_eq!(reaching("make_array()"), (5000, 5), "new char[]");
}

#[test]
fn frame_pointer_code_gives_the_same_stacks_as_fp_mode() {
    if !privileged() {
        return;
    }
    let dwarf = crate::support::trace_fixture("leak_sites", &["--duration", "4s"]);
    let fp = crate::support::trace_fixture("leak_sites", &["--duration", "4s", "--stacks", "fp"]);
    for function in ["leak_a", "leak_b", "leak_calloc", "realloc_chain"] {
        let take = |report: &Value| -> Vec<String> {
            sites_of(report, function)
                .first()
                .map(|s| symbols(s))
                .unwrap_or_default()
        };
        let (d, f) = (take(&dwarf), take(&fp));
        assert!(!d.is_empty(), "{function} found");
        // The frame-pointer walk may add a bogus frame past _start; up to
        // main (and through libc's start) both agree.
        let upto = |v: &[String]| -> Vec<String> {
            let end = v
                .iter()
                .position(|s| s == "main")
                .map_or(v.len(), |i| i + 1);
            v[..end].to_vec()
        };
        assert_eq!(upto(&d), upto(&f), "{function}: dwarf {d:?} fp {f:?}");
    }
}

#[test]
fn debian_python3_stacks_reach_the_interpreter_main() {
    if !privileged() {
        return;
    }
    let python = std::path::Path::new("/usr/bin/python3.11");
    if !python.exists() {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI installs Debian's python3.11 (.ci/run)"
        );
        eprintln!("SKIPPED: /usr/bin/python3.11 is not installed");
        return;
    }
    let script = "import sys, time\n\
                  sys.stdin.readline()\n\
                  keep = []\n\
                  for i in range(400):\n\
                  \x20   b = bytearray(6000)\n\
                  \x20   if i % 4 == 0: keep.append(b)\n\
                  print('done', flush=True)\n\
                  time.sleep(30)\n";
    let mut child = std::process::Command::new(python)
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3.11 starts");
    let pid = child.id().to_string();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let tracer = Tracer::attach(&["--pid", &pid, "--format", "json", "--top", "500"]);
    {
        use std::io::{BufRead, Write};
        let stdin = child.stdin.as_mut().expect("stdin");
        stdin.write_all(b"\n").expect("go");
        stdin.flush().expect("flush");
        let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        let _ = out.read_line(&mut line);
        assert_eq!(line.trim(), "done");
    }
    tracer.signal(libc::SIGINT);
    let report = tracer.report().0;
    let _ = child.kill();
    let _ = child.wait();
    let reaching: Vec<Vec<String>> = report["sites"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["live_count"].as_u64().unwrap_or(0) >= 90)
        .map(symbols)
        .collect();
    assert!(
        reaching.iter().any(|frames| {
            // The interpreter loop, or the Python frames that stand in for it.
            frames
                .iter()
                .any(|f| f.contains("_PyEval_EvalFrameDefault") || f == "<module>")
                && frames.iter().any(|f| f.contains("Py_BytesMain"))
        }),
        "the 100 kept bytearrays' stack reaches the interpreter loop and Py_BytesMain: {reaching:#?}"
    );
}

#[test]
fn stacks_pass_through_functions_whose_return_is_probed() {
    if !privileged() {
        return;
    }
    // The stub driver backs device memory with malloc, inside cudaMalloc and
    // cuMemAlloc_v2, whose return addresses the kernel's uretprobe trampoline
    // has replaced while they run.
    let report = crate::support::trace_fixture("cuda_leaks", &["--duration", "3s"]);
    let inner: Vec<Vec<String>> = report["sites"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["allocator"] == "libc")
        .map(symbols)
        .filter(|frames| frames.first().is_some_and(|f| f == "backed_alloc"))
        .collect();
    assert!(!inner.is_empty(), "the stub's own mallocs are traced");
    assert!(
        inner.iter().any(|frames| frames
            .windows(3)
            .any(|w| w[0] == "cuMemAlloc_v2" && w[1] == "cudaMalloc" && w[2] == "leak_device_a")),
        "through the trampolines to the caller: {inner:#?}"
    );
    assert_eq!(report["stack_truncations_by_cause"]["fault"], 0);
}

#[test]
fn replayed_walks_tell_callers_with_the_same_registers_apart() {
    if !privileged() {
        return;
    }
    // At malloc's return the PC, stack pointer and frame register are the
    // same for both callers; only a return address on the stack differs.
    let mut target = Fixture::start("twin_callers", &["30", "30"]);
    let pid = target.pid.to_string();
    let tracer = Tracer::attach(&["--pid", &pid, "--format", "json", "--top", "50"]);
    target.go();
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report();
    let through = |caller: &str| {
        sites_of(&report, "leaf")
            .iter()
            .filter(|site| symbols(site).get(1).map(String::as_str) == Some(caller))
            .fold((0, 0), |(bytes, count), site| {
                (
                    bytes + site["live_bytes"].as_u64().unwrap_or(0),
                    count + site["live_count"].as_u64().unwrap_or(0),
                )
            })
    };
    assert_eq!(through("twin_a"), (300 * 24, 300), "{stderr}");
    assert_eq!(through("twin_b"), (700 * 40, 700), "{stderr}");
    for site in sites_of(&report, "leaf") {
        let frames = symbols(site);
        assert_eq!(
            frames.get(2).map(String::as_str),
            Some("main"),
            "{frames:?}"
        );
    }
    // The walks in a block of the same caller were replayed.
    let replayed = report["kernel_counters"]["stacks_replayed"]
        .as_u64()
        .unwrap_or(0);
    assert!(replayed > 0, "{}", report["kernel_counters"]);
}

#[test]
fn a_second_attach_loads_every_table_from_the_cache_and_still_finds_the_chain() {
    if !privileged() {
        return;
    }
    let (cache, dir) = empty_cache_dir("table-cache");
    let mut target = Fixture::start("unwind_chain", &["chain", "30", "30"]);
    let pid = target.pid.to_string();
    let args = [
        "--pid",
        pid.as_str(),
        "--format",
        "json",
        "--top",
        "500",
        "--table-cache",
        dir.as_str(),
    ];
    // The first attach builds and stores every table, and detaches.
    let first = Tracer::attach(&args);
    first.signal(libc::SIGINT);
    let first = first.report().0;
    let stats = &first["unwind"]["cache"];
    let built = stats["misses"].as_u64().unwrap_or(0);
    assert!(built >= 3, "the executable, libunwind_lib, libc: {stats}");
    assert_eq!(stats["hits"], 0, "{stats}");
    assert_eq!(stats["stored"], built, "{stats}");

    // The second, to the same process, builds none and sees the same stacks.
    let second = Tracer::attach(&args);
    target.go();
    second.signal(libc::SIGINT);
    let report = second.report().0;
    let stats = &report["unwind"]["cache"];
    assert_eq!(stats["hits"], built, "{stats}");
    assert_eq!(stats["misses"], 0, "{stats}");
    assert_eq!(stats["rejected"], 0, "{stats}");
    assert_eq!(report["unwind"]["objects"], first["unwind"]["objects"]);
    assert_whole_chain(&report, "tables from the cache");
    let _ = std::fs::remove_dir_all(&cache);
}

/// `leak_sites` traced by pid with `--table-cache table_cache`.
fn trace_leak_sites(table_cache: &str) -> Value {
    crate::support::trace_fixture("leak_sites", &["--table-cache", table_cache])
}

#[test]
fn a_second_attach_takes_the_function_search_from_the_cache_and_finds_the_same_leaks() {
    if !privileged() {
        return;
    }
    let (cache, dir) = empty_cache_dir("fn-cache");
    // Two runs of the same program: the same objects, two processes.
    let first = trace_leak_sites(&dir);
    let stats = &first["function_cache"];
    let searched = stats["misses"].as_u64().unwrap_or(0);
    assert!(searched >= 3, "the executable, libc, ld.so: {stats}");
    assert_eq!(stats["hits"], 0, "{stats}");
    assert_eq!(stats["stored"], searched, "{stats}");
    assert_eq!(stats["dir"], dir.as_str(), "{stats}");
    let files = std::fs::read_dir(&cache)
        .expect("the cache directory")
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "fns"))
        .count() as u64;
    assert_eq!(files, searched, "one file per object searched");

    // The second searches nothing, probes the same functions at the same
    // places, and finds every leak as the first did.
    let second = trace_leak_sites(&dir);
    let stats = &second["function_cache"];
    assert_eq!(stats["hits"], searched, "{stats}");
    assert_eq!(stats["misses"], 0, "{stats}");
    assert_eq!(stats["rejected"], 0, "{stats}");
    assert_eq!(second["libraries"], first["libraries"]);
    // `off` caches neither: nothing counted, the same leaks.
    let off = trace_leak_sites("off");
    assert!(off.get("function_cache").is_none(), "{off}");
    for report in [&first, &second, &off] {
        assert_eq!(report["events"]["lost"], 0);
        for (site, bytes, blocks) in crate::compat::LEAKS {
            assert_eq!(site_totals(report, site), (bytes, blocks), "{site}");
        }
        for freed in ["balanced", "realloc_to_zero", "mmap_balanced"] {
            assert_eq!(site_totals(report, freed), (0, 0), "{freed} is freed");
        }
    }
    let _ = std::fs::remove_dir_all(&cache);
}

/// `unwind_chain chain` waiting for its go line, and memtrace attached to
/// it by pid without the table cache (every table built after tracing
/// starts), with `extra` flags; `whole`: waits for the tables to be ready.
fn chain_without_cache(extra: &[&str], whole: bool) -> (Fixture, Tracer) {
    let target = Fixture::start("unwind_chain", &["chain", "30", "30"]);
    let pid = target.pid.to_string();
    let mut command = std::process::Command::new(crate::support::MEMTRACE);
    command
        .args(["--pid", pid.as_str(), "--format", "json", "--top", "500"])
        .args(["--table-cache", "off"])
        .args(extra);
    let tracer = if whole {
        Tracer::attach_command(command)
    } else {
        Tracer::attach_tracing(command)
    };
    (target, tracer)
}

#[test]
fn tables_built_while_tracing_give_the_whole_chain_once_ready() {
    if !privileged() {
        return;
    }
    let (mut target, tracer) = chain_without_cache(&[], true);
    assert!(
        tracer.stderr_text.contains("unwind tables still building")
            && tracer.stderr_text.contains("unwind tables ready"),
        "{}",
        tracer.stderr_text
    );
    target.go();
    tracer.signal(libc::SIGINT);
    let report = tracer.report().0;
    assert_whole_chain(&report, "tables built while tracing");
    let unwind = &report["unwind"];
    let deferred = unwind["deferred"].as_u64().unwrap_or(0);
    assert!(
        deferred >= 3,
        "the executable, libunwind_lib, libc: {unwind}"
    );
    assert_eq!(unwind["objects"], deferred, "{unwind}");
    assert!(unwind["deferred_ms"].is_u64(), "{unwind}");
    assert_eq!(unwind["pending"], serde_json::json!([]), "{unwind}");
    // The fixture allocates nothing between the attach and "go".
    assert_eq!(report["stack_truncations_by_cause"]["table_pending"], 0);

    // --wait-for-tables: every table before tracing, none deferred.
    let (mut target, tracer) = chain_without_cache(&["--wait-for-tables"], true);
    assert!(
        !tracer.stderr_text.contains("still building"),
        "{}",
        tracer.stderr_text
    );
    target.go();
    tracer.signal(libc::SIGINT);
    let report = tracer.report().0;
    assert_whole_chain(&report, "--wait-for-tables");
    assert_eq!(report["unwind"]["deferred"], 0);
}

#[test]
fn stacks_cut_while_tables_are_built_are_counted_and_end_in_their_object() {
    if !privileged() {
        return;
    }
    // The chain runs at once, racing the tables: however the race goes,
    // every block is found, and each one whose stack stops short of main
    // ended at an object still without its table (counted).
    let (mut target, mut tracer) = chain_without_cache(&[], false);
    target.go();
    if tracer.stderr_text.contains("still building") {
        tracer.wait_for_stderr("unwind tables ready");
    }
    tracer.signal(libc::SIGINT);
    let report = tracer.report().0;
    assert_eq!(site_totals(&report, "lib_level3"), (15540, 20));
    let cut = report["stack_truncations_by_cause"]["table_pending"]
        .as_u64()
        .expect("table_pending counted");
    let short: u64 = sites_of(&report, "lib_level3")
        .iter()
        .filter(|site| !symbols(site).contains(&"main".to_string()))
        .map(|site| site["live_count"].as_u64().unwrap_or(0))
        .sum();
    assert!(
        short <= cut,
        "{short} blocks with stacks short of main, {cut} cut at a pending table"
    );
    if cut == 0 {
        assert_whole_chain(&report, "tables in before the chain ran");
    }
    assert_eq!(report["unwind"]["pending"], serde_json::json!([]));
    assert_eq!(report["stack_truncations_by_cause"]["no_table"], 0);
}
