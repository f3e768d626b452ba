//! GPU and NPU allocators on the real eBPF path, against stub libraries that
//! export the real CUDA runtime/driver and Ascend ACL names and signatures.

use crate::support::{self, privileged, site_totals, sites_of, Fixture, Tracer};

fn trace_fixture(name: &str) -> serde_json::Value {
    support::trace_fixture(name, &["--duration", "3s"])
}

/// The sites of `symbol` (a loop the compiler unrolled has one per call
/// instruction) merged into one: bytes and counts summed, allocator and
/// memory checked to agree.
fn site(report: &serde_json::Value, symbol: &str) -> serde_json::Value {
    let sites = sites_of(report, symbol);
    assert!(!sites.is_empty(), "no site for {symbol}");
    for other in &sites[1..] {
        assert_eq!(other["allocator"], sites[0]["allocator"], "{symbol}");
        assert_eq!(other["memory"], sites[0]["memory"], "{symbol}");
    }
    let (bytes, count) = site_totals(report, symbol);
    let mut merged = sites[0].clone();
    merged["live_bytes"] = bytes.into();
    merged["live_count"] = count.into();
    merged
}

fn failed(report: &serde_json::Value, function: &str, code: i64) -> u64 {
    report["failed_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["function"] == function && f["code"] == code)
        .map(|f| f["count"].as_u64().unwrap_or(0))
        .sum()
}

#[test]
fn cuda_runtime_and_driver_are_traced_exactly_and_once() {
    if !privileged() {
        return;
    }
    let report = trace_fixture("cuda_leaks");
    let expect = [
        ("leak_device_a", 8 * 1048576, 8, "cuda", "device"),
        ("leak_device_b", 3 * 4096, 3, "cuda", "device"),
        ("leak_pinned", 2 * 8192, 2, "cuda", "pinned"),
        ("leak_managed", 12288, 1, "cuda", "managed"),
        ("leak_pitch", 7168, 1, "cuda", "device"),
        ("leak_3d", 10240, 1, "cuda", "device"),
        ("direct_driver_leak", 10000, 2, "cuda-driver", "device"),
        ("vmm_handles", 2 * 2097152, 2, "cuda-driver", "device"),
    ];
    for (symbol, bytes, count, allocator, memory) in expect {
        let site = site(&report, symbol);
        assert_eq!(
            (site["live_bytes"].as_u64(), site["live_count"].as_u64()),
            (Some(bytes), Some(count)),
            "{symbol}"
        );
        assert_eq!(site["allocator"], allocator, "{symbol}");
        assert_eq!(site["memory"], memory, "{symbol}");
    }
    // Freed, including asynchronously from another thread: not leaks.
    assert!(sites_of(&report, "balanced_device").is_empty());
    assert!(sites_of(&report, "async_cross_thread").is_empty());
    // Runtime calls made the driver calls inside them: counted once, as runtime.
    let driver_device: u64 = report["totals"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["allocator"] == "cuda-driver")
        .filter_map(|t| t["live_bytes"].as_u64())
        .sum();
    assert_eq!(
        driver_device,
        10000 + 2 * 2097152,
        "driver totals hold direct calls only"
    );
    // Every driver call made inside a runtime call was recognised as nested.
    assert!(
        report["kernel_counters"]["nested_calls"]
            .as_u64()
            .unwrap_or(0)
            >= 30
    );
    assert_eq!(report["kernel_counters"]["unpaired_returns"], 0);
    // Failed calls create nothing and are counted per function and code.
    assert_eq!(failed(&report, "cudaMalloc", 2), 2);
    assert_eq!(
        failed(&report, "cuMemAlloc_v2", 2),
        0,
        "the nested driver failure is not double-counted"
    );
    // The report lists each library and its functions.
    let libraries = report["libraries"].as_array().expect("libraries");
    let cudart = libraries
        .iter()
        .find(|l| {
            l["path"]
                .as_str()
                .is_some_and(|p| p.ends_with("libcudart.so.12"))
        })
        .expect("libcudart attached");
    let functions: Vec<&str> = cudart["functions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["function"].as_str())
        .collect();
    assert!(
        functions.contains(&"cudaMalloc") && functions.contains(&"cudaFree"),
        "{functions:?}"
    );
}

#[test]
fn ascend_acl_device_and_host_memory() {
    if !privileged() {
        return;
    }
    let report = trace_fixture("acl_leaks");
    let device = site(&report, "leak_acl_device");
    assert_eq!(
        (device["live_bytes"].as_u64(), device["live_count"].as_u64()),
        (Some(5 * 2097152), Some(5))
    );
    assert_eq!(device["allocator"], "acl");
    assert_eq!(device["memory"], "device");
    let host = site(&report, "leak_acl_host");
    assert_eq!(host["live_bytes"].as_u64(), Some(8192));
    assert_eq!(host["memory"], "pinned");
    assert!(sites_of(&report, "balanced_acl").is_empty());
    assert_eq!(failed(&report, "aclrtMalloc", 100000), 1);
}

#[test]
fn library_loaded_after_attach_is_found_and_traced() {
    if !privileged() {
        return;
    }
    let mut fixture = Fixture::start("late_dlopen", &["30", "30"]);
    let pid = fixture.pid.to_string();
    let mut tracer = Tracer::attach(&["--pid", &pid, "--format", "json", "--top", "100"]);
    assert!(!tracer.stderr_text.contains("libcudart"), "not mapped yet");
    fixture.send_line();
    fixture.expect_line("loaded");
    tracer.wait_for_stderr("newly loaded");
    tracer.wait_for_stderr("libcudart.so.12");
    fixture.send_line();
    fixture.expect_line("done");
    tracer.signal(libc::SIGINT);
    let (report, _) = tracer.report();
    assert_eq!(site_totals(&report, "late_leak"), (4 * 1048576, 4));
}

#[test]
fn real_cudart_from_pypi_counts_failed_calls_without_a_gpu() {
    if !privileged() {
        return;
    }
    let Some(real) = std::env::var_os("MEMTRACE_REAL_CUDART") else {
        // .ci/run installs the nvidia-cuda-runtime wheel and sets this variable.
        assert!(
            std::env::var_os("MEMTRACE_REQUIRE_KERNEL_TESTS").is_none()
                || std::env::var_os("CI").is_none(),
            "CI must provide MEMTRACE_REAL_CUDART"
        );
        eprintln!("SKIPPED: MEMTRACE_REAL_CUDART not set");
        return;
    };
    let real = real.to_string_lossy().into_owned();
    let mut fixture = Fixture::start("cudart_real_probe", &["30", "30", &real]);
    let pid = fixture.pid.to_string();
    let tracer = Tracer::attach(&["--pid", &pid, "--format", "json"]);
    // The trace ends only once both calls have returned: a loaded machine can
    // spend seconds in the runtime's first-call initialisation.
    fixture.go();
    tracer.signal(libc::SIGINT);
    let (report, _) = tracer.report();
    let libraries = report["libraries"].as_array().expect("libraries");
    assert!(
        libraries.iter().any(|l| l["path"]
            .as_str()
            .is_some_and(|p| p.contains("libcudart.so.13"))),
        "the real runtime was attached: {libraries:?}"
    );
    let failures: u64 = report["failed_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["function"] == "cudaMalloc")
        .filter_map(|f| f["count"].as_u64())
        .sum();
    assert_eq!(
        failures, 2,
        "both cudaMalloc calls failed without a GPU and were counted"
    );
    let cuda_live: u64 = report["totals"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["allocator"] == "cuda")
        .filter_map(|t| t["live_bytes"].as_u64())
        .sum();
    assert_eq!(cuda_live, 0, "failed calls create no live allocation");
    let _ = support::fixtures();
}
