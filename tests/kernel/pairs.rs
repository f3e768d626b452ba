//! User-declared resource pairs (`--pairs`, `--preset`) and hand-named
//! libraries (`--lib`) on the real eBPF path.

use crate::support::{memtrace, privileged, site_totals, sites_of, Fixture, Tracer};

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
    let pool = crate::support::fixture("libpool.so");
    let pool = pool.to_str().expect("utf-8").to_string();
    let mut fixture = Fixture::start("leak_sites", &["30", "30"]);
    let pid = fixture.pid.to_string();
    let tracer = Tracer::attach(&[
        "--pid",
        &pid,
        "--format",
        "json",
        "--duration",
        "2s",
        "--lib",
        &pool,
    ]);
    assert!(
        tracer
            .stderr_text
            .contains("defines none of the probed functions"),
        "{}",
        tracer.stderr_text
    );
    fixture.go();
    let (report, _) = tracer.report();
    assert!(report["notes"].as_array().is_some_and(|n| n
        .iter()
        .any(|n| n.as_str().is_some_and(|n| n.contains("libpool.so")))));
    assert_eq!(site_totals(&report, "leak_a"), (4800, 100));
}
