//! USDT probes (`memtrace probes PID|FILE`): the probes of the sdt.h
//! fixtures, PIE and non-PIE, with semaphores and without, and of a library
//! a running process dlopened late, listed with exact names, counts, file
//! offsets (the probe's nop at each) and decoded arguments; a file that is
//! no ELF object is one clear line. Traced through `usdt =` pairs: exact
//! blocks and bytes from probes with semaphores (PIE and non-PIE
//! executables) and without (a library dlopened late), each semaphore
//! raised while memtrace is attached and back to 0 after a normal end and
//! after `kill -9` of memtrace (read from the fixture's /proc/PID/mem);
//! with `--follow-forks`, raised in a forked child that is traced (its
//! blocks exact, under its pid) and 0 in it again after memtrace ends.
//! `--preset pytorch` on a stub of PyTorch's allocator driven from Python:
//! the leaked tensors at their Python line, beside the cudaMalloc segment
//! (its nested driver call counted once) and what the cache holds; its
//! `--record` replays to the same `device_cache` and `usdt`.
//! `--preset otel-memory` on a byte sampler: the estimate is the sampled
//! blocks' weighted bytes exactly, within three standard deviations of the
//! true live bytes, and marked an estimate.

use serde_json::Value;

use crate::support::{
    assert_one_clear_line, fixture, memtrace, privileged, total_for, Fixture, Tracer,
};

fn list(target: &str) -> Value {
    let out = memtrace(&["probes", target, "--format", "json"]);
    assert!(
        out.status.success(),
        "memtrace probes {target}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// (provider:name, semaphore offset, argument text) of each probe of an object.
fn probes_of(object: &Value) -> Vec<(String, Option<u64>, String)> {
    let mut probes: Vec<_> = object["probes"]
        .as_array()
        .expect("probes")
        .iter()
        .map(|p| {
            (
                format!(
                    "{}:{}",
                    p["provider"].as_str().expect("provider"),
                    p["name"].as_str().expect("name")
                ),
                p["semaphore_offset"].as_u64(),
                p["args_text"].as_str().expect("args").to_string(),
            )
        })
        .collect();
    probes.sort();
    probes
}

/// Every probe's file offset holds sdt.h's nop, every argument decoded.
fn check_sites(path: &std::path::Path, object: &Value) {
    let data = std::fs::read(path).expect("fixture readable");
    for probe in object["probes"].as_array().expect("probes") {
        let offset = probe["file_offset"].as_u64().expect("offset") as usize;
        assert_eq!(data[offset], 0x90, "{probe}");
        assert!(probe["args_error"].is_null(), "{probe}");
        let args = probe["args"].as_array().expect("args");
        assert_eq!(
            args.len(),
            probe["args_text"]
                .as_str()
                .expect("text")
                .split_whitespace()
                .count()
        );
        if let Some(sema) = probe["semaphore_offset"].as_u64() {
            // The semaphore's initial value in `.probes`.
            assert_eq!(&data[sema as usize..sema as usize + 2], &[0, 0]);
        }
    }
}

#[test]
fn lists_probes_of_pie_non_pie_and_library_files() {
    if !privileged() {
        return;
    }
    for name in ["usdt_probes", "usdt_probes_nopie"] {
        let path = fixture(name);
        let report = list(path.to_str().expect("utf-8 path"));
        let objects = report["objects"].as_array().expect("objects");
        assert_eq!(objects.len(), 1);
        let probes = probes_of(&objects[0]);
        assert_eq!(probes.len(), 2, "{name}: {probes:?}");
        assert_eq!(probes[0].0, "memtrace_test:alloc");
        assert_eq!(probes[1].0, "memtrace_test:free");
        assert!(probes.iter().all(|p| p.1.is_some()), "{name}: semaphores");
        check_sites(&path, &objects[0]);
        let pc = objects[0]["probes"][0]["pc"].as_u64().expect("pc");
        let offset = objects[0]["probes"][0]["file_offset"]
            .as_u64()
            .expect("offset");
        if name.ends_with("nopie") {
            assert!(pc >= 0x400000 && offset < 0x400000, "{pc:#x} {offset:#x}");
        } else {
            assert_eq!(pc, offset);
        }
    }
    let path = fixture("libusdt_lib.so");
    let report = list(path.to_str().expect("utf-8 path"));
    let probes = probes_of(&report["objects"][0]);
    assert_eq!(
        probes,
        [
            (
                "memtrace_lib:alloc".to_string(),
                None,
                "-8@%rdi 8@%rax".to_string()
            ),
            ("memtrace_lib:free".to_string(), None, "8@%rdi".to_string()),
        ]
    );
    check_sites(&path, &report["objects"][0]);
}

#[test]
fn lists_probes_of_a_process_and_its_late_library() {
    if !privileged() {
        return;
    }
    let lib = fixture("libusdt_lib.so");
    let mut target = Fixture::start("usdt_probes", &[lib.to_str().expect("path"), "10", "10"]);
    let before = list(&target.pid.to_string());
    let names = |report: &Value| -> Vec<String> {
        let mut names: Vec<String> = report["objects"]
            .as_array()
            .expect("objects")
            .iter()
            .map(|o| o["path"].as_str().expect("path").to_string())
            .collect();
        names.sort();
        names
    };
    assert_eq!(
        names(&before),
        [fixture("usdt_probes").display().to_string()],
        "{before}"
    );
    // Nothing attached: the probes' semaphores stay down.
    target.send_line();
    target.expect_line("sema 0 0");
    target.expect_line("loaded");
    target.send_line();
    target.expect_line("sema 0 0");
    target.expect_line("done");
    let after = list(&target.pid.to_string());
    assert_eq!(
        names(&after),
        [
            lib.display().to_string(),
            fixture("usdt_probes").display().to_string()
        ],
        "{after}"
    );
    let text = memtrace(&["probes", &target.pid.to_string()]);
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(stdout.contains("memtrace_lib:alloc"), "{stdout}");
    assert!(stdout.contains("semaphore"), "{stdout}");
}

#[test]
fn a_file_that_is_no_elf_object_is_one_clear_line() {
    if !privileged() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("memtrace-usdt-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let bad = dir.join("not-elf.so");
    std::fs::write(&bad, b"\x7fELF garbage").expect("write");
    let out = memtrace(&["probes", bad.to_str().expect("path")]);
    assert_one_clear_line(&out, 2, "not-elf.so");
    // A truncated copy of a real object with notes: an error, never a panic.
    let data = std::fs::read(fixture("libusdt_lib.so")).expect("fixture");
    for cut in [64, 1024, data.len() / 2, data.len() - 1] {
        std::fs::write(&bad, &data[..cut]).expect("write");
        let out = memtrace(&["probes", bad.to_str().expect("path")]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "cut {cut}: {stderr}");
        assert!(
            matches!(out.status.code(), Some(0 | 2)),
            "cut {cut}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The fixtures' probes as two pairs: the executable's (pointer, size),
/// the library's (size, pointer: the other order).
const PAIRS: &str = r#"
[[pair]]
name = "test-pool"
alloc = { usdt = "memtrace_test:alloc" }
free = { usdt = "memtrace_test:free" }
handle = "arg0"
size = "arg1"
free_handle = "arg0"

[[pair]]
name = "lib-pool"
alloc = { usdt = "memtrace_lib:alloc" }
free = { usdt = "memtrace_lib:free" }
handle = "arg1"
size = "arg0"
free_handle = "arg0"
"#;

fn pairs_file(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("memtrace-usdt-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("usdt.toml");
    std::fs::write(&file, PAIRS).expect("pairs file");
    file
}

/// The `unsigned short` at `addr` in process `pid`.
fn read_u16(pid: u32, addr: u64) -> u16 {
    use std::os::unix::fs::FileExt;
    let mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("/proc/PID/mem");
    let mut value = [0u8; 2];
    mem.read_exact_at(&mut value, addr)
        .expect("semaphore readable");
    u16::from_ne_bytes(value)
}

/// Starts a usdt_probes fixture; returns it and its semaphores' addresses.
fn start(name: &str) -> (Fixture, [u64; 2]) {
    let lib = fixture("libusdt_lib.so");
    let mut target = Fixture::start(name, &[lib.to_str().expect("path"), "30", "30"]);
    let line = target.line_starting("semaphores");
    let addrs: Vec<u64> = line
        .split_whitespace()
        .map(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).expect("hex address"))
        .collect();
    assert_eq!(addrs.len(), 2, "{line}");
    (target, [addrs[0], addrs[1]])
}

fn semaphores(pid: u32, addrs: [u64; 2]) -> [u16; 2] {
    [read_u16(pid, addrs[0]), read_u16(pid, addrs[1])]
}

#[test]
fn usdt_pairs_count_exactly_in_pie_non_pie_and_a_late_library_full_and_compat() {
    if !privileged() {
        return;
    }
    let pairs = pairs_file("counts");
    // The full object (specs by attach cookie), the tailcall one (cookies,
    // its USDT allocations' stacks walked across tail calls) and the compat
    // one (by the probed address in SPEC_BY_ADDR).
    for (name, variant) in [
        ("usdt_probes", "full"),
        ("usdt_probes_nopie", "full"),
        ("usdt_probes", "tailcall"),
        ("usdt_probes", "compat"),
        ("usdt_probes_nopie", "compat"),
    ] {
        let (mut target, addrs) = start(name);
        assert_eq!(semaphores(target.pid, addrs), [0, 0], "{name}: before");
        let pid = target.pid.to_string();
        let args = [
            "--pid",
            pid.as_str(),
            "--pairs",
            pairs.to_str().expect("path"),
            "--format",
            "json",
            "--top",
            "500",
        ];
        let mut tracer = Tracer::attach_env(&args, &[("MEMTRACE_EBPF_VARIANT", variant)]);
        let name = format!("{name} ({variant})");
        assert_eq!(semaphores(target.pid, addrs), [1, 1], "{name}: attached");
        target.send_line();
        target.expect_line("sema 1 1");
        target.expect_line("loaded");
        tracer.wait_for_stderr("probing USDT probes of newly loaded");
        target.send_line();
        target.expect_line("done");
        tracer.signal(libc::SIGINT);
        let (report, _) = tracer.report_last_line();
        // Executable: 5 allocations of 100..500 bytes, the first two freed.
        assert_eq!(
            total_for(&report, "test-pool"),
            (1200, 3),
            "{name}: {report}"
        );
        // Library: 64, 128, 256, 512, the first and last freed.
        assert_eq!(total_for(&report, "lib-pool"), (384, 2), "{name}: {report}");
        let sites: Vec<&Value> = report["sites"]
            .as_array()
            .expect("sites")
            .iter()
            .filter(|s| s["allocator"] == "test-pool")
            .collect();
        assert!(!sites.is_empty());
        for site in &sites {
            assert_eq!(
                site["functions"],
                serde_json::json!(["memtrace_test:alloc"])
            );
            let symbols: Vec<&str> = site["frames"]
                .as_array()
                .expect("frames")
                .iter()
                .filter_map(|f| f["symbol"].as_str())
                .collect();
            assert_eq!(symbols.first(), Some(&"pool_alloc"), "{name}: {symbols:?}");
            // The kernel's frame-pointer walk (compat) starts at rbp, which
            // a probe before the prologue (shrink-wrapped) has not set: it
            // may skip the caller. DWARF unwinding (full) does not.
            if variant == "full" {
                assert!(symbols.contains(&"main"), "{name}: {symbols:?}");
            }
        }
        assert_eq!(report["events"]["unmatched_frees"], 0, "{name}");
        // Both objects' sites, each probe name once per site.
        let mut probed: Vec<String> = report["usdt"]
            .as_array()
            .expect("usdt")
            .iter()
            .flat_map(|o| o["sites"].as_array().cloned().unwrap_or_default())
            .map(|s| s["probe"].as_str().unwrap_or("").to_string())
            .collect();
        probed.sort();
        assert_eq!(
            probed,
            [
                "memtrace_lib:alloc",
                "memtrace_lib:free",
                "memtrace_test:alloc",
                "memtrace_test:free"
            ],
            "{name}"
        );
        // A normal end: the kernel dropped the semaphores with the probes.
        assert_eq!(semaphores(target.pid, addrs), [0, 0], "{name}: after");
    }
    if let Some(dir) = pairs.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn semaphores_fall_back_to_zero_when_memtrace_is_killed() {
    if !privileged() {
        return;
    }
    let pairs = pairs_file("kill");
    let (target, addrs) = start("usdt_probes");
    let pid = target.pid.to_string();
    let mut tracer = Tracer::attach(&[
        "--pid",
        pid.as_str(),
        "--pairs",
        pairs.to_str().expect("path"),
        "--format",
        "json",
    ]);
    assert_eq!(semaphores(target.pid, addrs), [1, 1]);
    tracer.signal(libc::SIGKILL);
    let _ = tracer.child.wait();
    assert_eq!(semaphores(target.pid, addrs), [0, 0]);
    if let Some(dir) = pairs.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn follow_forks_raises_a_forked_childs_semaphores_while_traced_and_drops_them_after() {
    if !privileged() {
        return;
    }
    let pairs = pairs_file("fork");
    let mut family = Fixture::start("usdt_fork", &["60", "1"]);
    let line = family.line_starting("semaphores");
    let addrs: Vec<u64> = line
        .split_whitespace()
        .map(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).expect("hex address"))
        .collect();
    let addrs = [addrs[0], addrs[1]];
    let parent = family.pid;
    assert_eq!(semaphores(parent, addrs), [0, 0], "before");
    let pid = parent.to_string();
    let mut tracer = Tracer::attach(&[
        "--pid",
        pid.as_str(),
        "--follow-forks",
        "--pairs",
        pairs.to_str().expect("path"),
        "--format",
        "json",
        "--top",
        "500",
    ]);
    assert_eq!(semaphores(parent, addrs), [1, 1], "parent attached");
    family.send_line();
    let child: u32 = family.line_starting("child ").parse().expect("child pid");
    tracer.wait_for_stderr(&format!("following child pid {child} of pid {parent}"));
    assert_eq!(semaphores(child, addrs), [1, 1], "followed child");
    family.send_line();
    // The child saw its semaphores raised and fired its probes.
    family.expect_line("child sema 1 1");
    tracer.signal(libc::SIGINT);
    let (report, stderr) = tracer.report_last_line();
    // Exactly the child's blocks: 5 of 100..500 bytes, the first two freed.
    assert_eq!(
        total_for(&report, "test-pool"),
        (1200, 3),
        "{stderr}\n{report}"
    );
    let pids: Vec<u64> = report["sites"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["allocator"] == "test-pool")
        .flat_map(|s| s["pids"].as_array().cloned().unwrap_or_default())
        .filter_map(|p| p.as_u64())
        .collect();
    assert!(
        !pids.is_empty() && pids.iter().all(|&p| p == u64::from(child)),
        "the child's blocks, the child's pid: {pids:?}"
    );
    assert_eq!(report["events"]["unmatched_frees"], 0);
    // memtrace has ended: both processes' semaphores are down again.
    assert_eq!(semaphores(child, addrs), [0, 0], "child after");
    assert_eq!(semaphores(parent, addrs), [0, 0], "parent after");
    family.send_line();
    family.expect_line("done");
    if let Some(dir) = pairs.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn malformed_usdt_pairs_are_one_line() {
    if !privileged() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("memtrace-usdt-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for (body, needle) in [
        (
            "alloc = { usdt = \"nocolon\" }\nfree = { usdt = \"p:f\" }\nhandle = \"arg0\"",
            "expected \"provider:name\"",
        ),
        (
            "alloc = { usdt = \"p:a\" }\nfree = \"free_fn\"\nhandle = \"arg0\"",
            "both be USDT probes",
        ),
        (
            "alloc = { usdt = \"p:a\" }\nfree = { usdt = \"p:f\" }\nhandle = \"arg12\"",
            "N from 0 to 11",
        ),
        (
            "alloc = { usdt = \"p:a\" }\nfree = { usdt = \"p:f\" }",
            "needs handle",
        ),
    ] {
        let file = dir.join("bad.toml");
        std::fs::write(&file, format!("[[pair]]\nname = \"bad\"\n{body}\n")).expect("write");
        let out = memtrace(&["--pairs", file.to_str().expect("path"), "--", "/bin/true"]);
        assert_one_clear_line(&out, 2, needle);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The line of the `# L:name` marker in tests/python/`file`.
fn python_line(file: &str, name: &str) -> u64 {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/python")
        .join(file);
    let text = std::fs::read_to_string(path).expect("script");
    let marker = format!("# L:{name}");
    text.lines()
        .position(|l| l.trim_end().ends_with(&marker))
        .map(|i| i as u64 + 1)
        .unwrap_or_else(|| panic!("no marker {marker}"))
}

/// Runs a Python script with `args`, traces it by pid with `extra` from its
/// `ready` line to its `done` line, returns the JSON report.
fn trace_python(script: &str, args: &[&str], extra: &[&str]) -> Value {
    use std::io::{BufRead, Write};
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/python")
        .join(script);
    let mut child = std::process::Command::new("/usr/bin/python3.11")
        .arg(path)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3.11 starts (Debian's, .ci/run installs it)");
    let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("ready");
    assert!(line.starts_with("ready"), "{line}");
    let pid = child.id().to_string();
    let mut argv = vec!["--pid", pid.as_str(), "--format", "json", "--top", "200"];
    argv.extend_from_slice(extra);
    let tracer = Tracer::attach(&argv);
    child
        .stdin
        .as_mut()
        .expect("stdin")
        .write_all(b"\n")
        .expect("go");
    loop {
        line.clear();
        let n = out.read_line(&mut line).expect("output");
        assert!(n > 0, "script ended before done");
        if line.trim() == "done" {
            break;
        }
    }
    tracer.signal(libc::SIGINT);
    let (report, _) = tracer.report();
    let _ = child.kill();
    let _ = child.wait();
    report
}

#[test]
fn pytorch_preset_finds_the_leaked_tensors_python_line_beside_the_segments() {
    if !privileged() {
        return;
    }
    let lib = fixture("libc10_cuda.so");
    let record = std::env::temp_dir().join(format!("memtrace-torch-{}.rec", std::process::id()));
    let report = trace_python(
        "torch_leak.py",
        &[lib.to_str().expect("path")],
        &[
            "--preset",
            "pytorch",
            "--record",
            record.to_str().expect("path"),
        ],
    );
    // The record replays to the same device cache view and USDT objects.
    let out = memtrace(&[
        "report",
        record.to_str().expect("path"),
        "--format",
        "json",
        "--top",
        "200",
    ]);
    let _ = std::fs::remove_file(&record);
    assert!(out.status.success(), "{out:?}");
    let replayed: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(replayed["device_cache"], report["device_cache"]);
    assert_eq!(replayed["usdt"], report["usdt"]);
    const MIB: u64 = 1 << 20;
    // Three 1 MiB tensors kept; the 4 KiB ones were freed.
    assert_eq!(total_for(&report, "pytorch"), (3 * MIB, 3), "{report}");
    // One 4 MiB segment, its nested cuMemAlloc_v2 counted once.
    assert_eq!(total_for(&report, "cuda"), (4 * MIB, 1), "{report}");
    assert_eq!(total_for(&report, "cuda-driver"), (0, 0), "{report}");
    let cache = &report["device_cache"];
    assert_eq!(cache["allocators"], serde_json::json!(["pytorch"]));
    assert_eq!(cache["tensor_live_bytes"], 3 * MIB);
    assert_eq!(cache["tensor_live_count"], 3);
    assert_eq!(cache["segment_live_bytes"], 4 * MIB);
    assert_eq!(cache["segment_live_count"], 1);
    assert_eq!(cache["cached_bytes"], MIB);
    assert_eq!(
        cache["tensors_by_device"],
        serde_json::json!([{"device": 0, "stream": 7, "live_bytes": 3 * MIB, "live_count": 3}])
    );
    // The leak is the Python line that allocated the tensors.
    let leak = python_line("torch_leak.py", "leak");
    let sites: Vec<&Value> = report["sites"]
        .as_array()
        .expect("sites")
        .iter()
        .filter(|s| s["allocator"] == "pytorch")
        .collect();
    // One site per probe site of the stub (its fast and slow paths), each
    // at the Python line.
    let bytes: u64 = sites.iter().filter_map(|s| s["live_bytes"].as_u64()).sum();
    assert_eq!(bytes, 3 * MIB);
    for site in sites {
        assert_eq!(site["functions"], serde_json::json!(["pytorch:malloc"]));
        let python: Vec<(String, u64)> = site["frames"]
            .as_array()
            .expect("frames")
            .iter()
            .filter(|f| f["kind"] == "python")
            .map(|f| {
                (
                    f["symbol"].as_str().unwrap_or("").to_string(),
                    f["line"].as_u64().unwrap_or(0),
                )
            })
            .collect();
        assert_eq!(
            python.first(),
            Some(&("forward".to_string(), leak)),
            "{python:?}"
        );
    }
}

#[test]
fn otel_memory_preset_estimates_live_bytes_from_weighted_samples() {
    if !privileged() {
        return;
    }
    let mut target = Fixture::start("otel_sampler", &["30", "30"]);
    let pid = target.pid.to_string();
    let tracer = Tracer::attach(&[
        "--pid",
        pid.as_str(),
        "--preset",
        "otel-memory",
        "--format",
        "json",
        "--top",
        "500",
    ]);
    target.send_line();
    let line = target.line_starting("true_live");
    let words: Vec<&str> = line.split_whitespace().collect();
    let number = |key: &str| -> u64 {
        let at = words.iter().position(|w| *w == key).expect(key);
        words[at + 1].parse().expect("number")
    };
    let (true_live, estimate, sigma, samples) = (
        words[0].parse::<u64>().expect("true_live"),
        number("estimate"),
        number("sigma"),
        number("samples"),
    );
    target.expect_line("done");
    tracer.signal(libc::SIGINT);
    let (report, _) = tracer.report_last_line();
    // The sampled blocks still live, each weighing its weighted_bytes.
    assert_eq!(
        total_for(&report, "otel-memory"),
        (estimate, samples),
        "{report}"
    );
    assert!(
        estimate.abs_diff(true_live) <= 3 * sigma,
        "estimate {estimate} vs {true_live} (sigma {sigma})"
    );
    let sites: Vec<&Value> = report["sites"]
        .as_array()
        .expect("sites")
        .iter()
        .filter(|s| s["allocator"] == "otel-memory")
        .collect();
    assert!(!sites.is_empty());
    for site in sites {
        assert_eq!(site["estimated_live_bytes"], site["live_bytes"]);
    }
    let notes = report["notes"].to_string();
    assert!(
        notes.contains("otel-memory: bytes are estimates"),
        "{notes}"
    );
    assert_eq!(report["events"]["unmatched_frees"], 0, "{report}");
}
