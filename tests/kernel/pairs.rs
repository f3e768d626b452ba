//! User-declared resource pairs (`--pairs`, `--preset`) and hand-named
//! libraries (`--lib`) on the real eBPF path.

use crate::support::{memtrace, privileged, site_totals, sites_of, total_for, Fixture, Tracer};

fn trace(name: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["--duration", "3s"];
    args.extend_from_slice(extra);
    crate::support::trace_fixture(name, &args)
}

fn allocator_of(report: &serde_json::Value, symbol: &str) -> String {
    let sites = sites_of(report, symbol);
    assert!(!sites.is_empty(), "no site for {symbol}");
    sites[0]["allocator"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn acl_handle_preset_counts_leaked_descriptors_and_models() {
    if !privileged() {
        return;
    }
    let report = trace("acl_leaks", &["--preset", "acl-handles"]);
    for (symbol, allocator, count) in [
        ("leak_tensor_desc", "acl-tensor-desc", 4),
        ("leak_model", "acl-model", 1),
        ("leak_dataset", "acl-dataset", 3),
        ("leak_databuffer", "acl-data-buffer", 2),
    ] {
        assert_eq!(allocator_of(&report, symbol), allocator, "{symbol}");
        assert_eq!(site_totals(&report, symbol).1, count, "{symbol} handles");
        assert_eq!(sites_of(&report, symbol)[0]["memory"], "handle");
    }
    // Device memory is still traced alongside.
    assert_eq!(site_totals(&report, "leak_acl_device"), (5 * 2097152, 5));
}

#[test]
fn pairs_file_and_fd_preset_trace_a_custom_pool_handles_and_descriptors() {
    if !privileged() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("memtrace-pairs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("pool.toml");
    std::fs::write(
        &file,
        r#"
[[pair]]
name = "pool"
alloc = "je_malloc"
free = "je_free"
size = "arg0"

[[pair]]
name = "pool-handle"
alloc = "pool_open"
free = "pool_close"
handle = "out1"
handle_bits = 32
success = "zero"
free_checked = true
"#,
    )
    .expect("write");
    let path = file.to_str().expect("utf-8").to_string();
    let report = trace("pairs_handles", &["--pairs", &path, "--preset", "fds"]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(allocator_of(&report, "leak_pool"), "pool");
    assert_eq!(site_totals(&report, "leak_pool"), (300, 3));
    assert_eq!(allocator_of(&report, "leak_pool_handles"), "pool-handle");
    assert_eq!(site_totals(&report, "leak_pool_handles").1, 1);
    assert_eq!(allocator_of(&report, "leak_fds"), "fd");
    assert_eq!(site_totals(&report, "leak_fds").1, 2);
}

/// (live bytes, live count) of `allocator`'s sites whose first frame is
/// `symbol` (a handle pair without a size counts handles, not bytes).
fn totals_of(report: &serde_json::Value, symbol: &str, allocator: &str) -> (u64, u64) {
    sites_of(report, symbol)
        .iter()
        .filter(|site| site["allocator"] == allocator)
        .fold((0, 0), |(bytes, count), site| {
            (
                bytes + site["live_bytes"].as_u64().unwrap_or(0),
                count + site["live_count"].as_u64().unwrap_or(0),
            )
        })
}

#[test]
fn fd_and_file_presets_report_exactly_the_leaked_descriptors_and_streams() {
    if !privileged() {
        return;
    }
    let report = trace("fd_leaks", &["--preset", "fds", "--preset", "files"]);
    // Each creator's leaks at its own site, as one "fd" resource.
    for (symbol, count) in [("leak_openat", 2), ("leak_dup", 2), ("leak_socket", 1)] {
        assert_eq!(totals_of(&report, symbol, "fd").1, count, "{symbol}");
        assert_eq!(sites_of(&report, symbol)[0]["memory"], "handle");
    }
    assert_eq!(totals_of(&report, "leak_stream", "file").1, 1);
    // Nothing else: the closed ones (by close, closedir's and fclose's
    // internal close) released whatever function created them — open,
    // creat, dup2, dup3, eventfd, accept, accept4, opendir, fopen. The one
    // more fd is the leaked stream's, opened inside fopen.
    assert_eq!(
        total_for(&report, "fd").1,
        6,
        "{}",
        serde_json::to_string_pretty(&report["sites"]).unwrap_or_default()
    );
    assert_eq!(total_for(&report, "file").1, 1);
    assert!(sites_of(&report, "balanced_fds").is_empty());
    // close is probed once, whatever number of creators it serves.
    let closes = report["libraries"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|lib| lib["functions"].as_array().into_iter().flatten())
        .filter(|f| f["function"] == "close")
        .count();
    assert_eq!(closes, 1);
}

#[test]
fn malformed_pairs_and_unknown_presets_are_usage_errors() {
    if !privileged() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("memtrace-badpairs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("bad.toml");
    std::fs::write(
        &file,
        "[[pair]]\nname = \"x\"\nalloc = \"a\"\nfree = \"f\"\nhandle = \"arg7\"\n",
    )
    .expect("write");
    let out = memtrace(&["--pid", "1", "--pairs", file.to_str().expect("utf-8")]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("line 2"), "names the line: {stderr}");
    let out = memtrace(&["--pid", "1", "--preset", "nope"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown preset"));
    let out = memtrace(&["--pid", "1", "--allocators", "libc,gpu"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown allocator"));
}

#[test]
fn lib_must_be_a_readable_elf_file() {
    if !privileged() {
        return;
    }
    let me = std::process::id().to_string();
    let out = memtrace(&["--pid", &me, "--lib", "/no/such/lib.so", "--duration", "1s"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));
    let out = memtrace(&["--pid", &me, "--lib", "/etc/hostname", "--duration", "1s"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not an ELF"));
}

#[test]
fn lib_without_known_functions_is_a_listed_warning() {
    if !privileged() {
        return;
    }
    // libm defines no allocator (libpool.so's je_malloc is a jemalloc name).
    let pool = [
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib/x86_64-linux-gnu/libm.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("glibc's libm.so.6")
    .to_string();
    let mut fixture = Fixture::start("leak_sites", &["30", "30"]);
    let pid = fixture.pid.to_string();
    let tracer = Tracer::attach(&["--pid", &pid, "--format", "json", "--lib", &pool]);
    assert!(
        tracer
            .stderr_text
            .contains("defines none of the probed functions"),
        "{}",
        tracer.stderr_text
    );
    fixture.go();
    // Stopped once the fixture is done (a fixed --duration raced it under load).
    tracer.signal(libc::SIGINT);
    let (report, _) = tracer.report();
    assert!(report["notes"].as_array().is_some_and(|n| n
        .iter()
        .any(|n| n.as_str().is_some_and(|n| n.contains("libm.so.6")))));
    assert_eq!(site_totals(&report, "leak_a"), (4800, 100));
}
