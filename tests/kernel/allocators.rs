//! Every allocator a real service uses, on the real eBPF path: C++
//! `new`/`delete` under glibc and under Debian's jemalloc, tcmalloc and
//! mimalloc (preloaded), their own APIs called directly, allocators built
//! into the executable under a prefix, and probes moved onto emulated
//! instructions (with their return probes) under load.

use serde_json::Value;

use crate::support::{privileged, site_totals, sites_of, Fixture, Tracer};

const LIBDIR: &str = "/usr/lib/x86_64-linux-gnu";

/// Starts `name` (with `env`), attaches memtrace by pid with `extra`, lets
/// the fixture work, and returns the final JSON report and memtrace's stderr.
fn trace(name: &str, env: &[(&str, &str)], extra: &[&str]) -> (Value, String) {
    let mut fixture = Fixture::start_env(name, &["30", "30"], env);
    let pid = fixture.pid.to_string();
    let mut args = vec!["--pid", pid.as_str(), "--format", "json", "--top", "500"];
    args.extend_from_slice(extra);
    let tracer = Tracer::attach(&args);
    fixture.go();
    tracer.signal(libc::SIGINT);
    tracer.report_last_line()
}

fn library(name: &str) -> String {
    let path = format!("{LIBDIR}/{name}");
    assert!(
        std::path::Path::new(&path).exists(),
        "{path} is missing (.ci/run installs it)"
    );
    path
}

/// The one allocator named by the sites whose first frame is `symbol`.
fn allocator_of(report: &Value, symbol: &str) -> String {
    let names: std::collections::BTreeSet<String> = sites_of(report, symbol)
        .iter()
        .filter_map(|s| s["allocator"].as_str().map(str::to_string))
        .collect();
    assert_eq!(names.len(), 1, "{symbol}: allocators {names:?}");
    names.into_iter().next().unwrap_or_default()
}

fn assert_nothing_counted_twice(report: &Value) {
    assert_eq!(
        report["events"]["unmatched_frees"], 0,
        "a release seen at two probes would be an unmatched free: {}",
        report["events"]
    );
    for site in report["sites"].as_array().into_iter().flatten() {
        let symbol = site["frames"][0]["symbol"].as_str().unwrap_or("");
        assert!(
            !symbol.contains("operator new") && !symbol.starts_with("_Zn"),
            "frames[0] is operator new, not its caller: {site}"
        );
    }
}

/// The C++ fixture's known leaks, under whichever allocator.
fn check_cxx(report: &Value, allocator: &str) {
    assert_eq!(site_totals(report, "make_nodes"), (4800, 100), "new Node");
    assert_eq!(
        site_totals(report, "make_arrays"),
        (1000, 10),
        "new char[100]"
    );
    assert_eq!(site_totals(report, "make_aligned"), (640, 5), "aligned new");
    assert_eq!(
        site_totals(report, "leak_nothrow"),
        (512, 8),
        "nothrow new[]"
    );
    assert!(
        sites_of(report, "balanced_nodes").is_empty(),
        "balanced_nodes freed everything"
    );
    for site in ["make_nodes", "make_arrays", "make_aligned", "leak_nothrow"] {
        assert_eq!(allocator_of(report, site), allocator, "{site}");
        let frame = &sites_of(report, site)[0]["frames"][0];
        assert_eq!(
            frame["file"].as_str().map(|f| f.ends_with("cxx_leaks.cpp")),
            Some(true),
            "{site}: frames[0] is the caller of operator new: {frame}"
        );
    }
    assert_nothing_counted_twice(report);
}

#[test]
fn cxx_new_delete_under_glibc() {
    if !privileged() {
        return;
    }
    let (report, _) = trace("cxx_leaks", &[], &[]);
    check_cxx(&report, "libc");
    // Each of the 1468 `new`s calls glibc's malloc (or aligned_alloc) inside
    // libstdc++'s operator new: seen there and skipped as nested, in the kernel.
    let nested = report["kernel_counters"]["nested_calls"]
        .as_u64()
        .unwrap_or(0);
    assert!(nested >= 1468, "nested calls: {nested}");
    // libstdc++'s operator delete only jumps to free: not probed itself.
    let libstdcxx = report["libraries"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|l| l["path"].as_str().is_some_and(|p| p.contains("libstdc++")))
        .unwrap_or_else(|| panic!("libstdc++ probed: {}", report["libraries"]));
    assert!(
        libstdcxx["forwarders"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|f| f["function"] == "_ZdlPv" && f["to"] == "free"),
        "{libstdcxx}"
    );
}

#[test]
fn cxx_new_delete_under_preloaded_jemalloc() {
    if !privileged() {
        return;
    }
    let lib = library("libjemalloc.so.2");
    let (report, _) = trace("cxx_leaks", &[("LD_PRELOAD", &lib)], &[]);
    check_cxx(&report, "jemalloc");
}

#[test]
fn cxx_new_delete_under_preloaded_tcmalloc() {
    if !privileged() {
        return;
    }
    let lib = library("libtcmalloc.so.4");
    let (report, _) = trace("cxx_leaks", &[("LD_PRELOAD", &lib)], &[]);
    check_cxx(&report, "tcmalloc");
}

#[test]
fn cxx_new_delete_under_preloaded_mimalloc() {
    if !privileged() {
        return;
    }
    let lib = library("libmimalloc.so.2");
    let (report, _) = trace("cxx_leaks", &[("LD_PRELOAD", &lib)], &[]);
    check_cxx(&report, "mimalloc");
}

/// The probe of `function` in the object whose path contains `object`.
fn probe_of<'a>(report: &'a Value, object: &str, function: &str) -> &'a Value {
    report["libraries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|l| l["path"].as_str().is_some_and(|p| p.contains(object)))
        .flat_map(|l| l["functions"].as_array().into_iter().flatten())
        .find(|f| {
            f["function"] == function
                || f["aliases"]
                    .as_array()
                    .is_some_and(|a| a.iter().any(|n| n == function))
        })
        .unwrap_or_else(|| panic!("{function} probed in {object}: {}", report["libraries"]))
}

#[test]
fn jemalloc_api_direct_and_moved_probes_under_load() {
    if !privileged() {
        return;
    }
    let (report, _) = trace("jemalloc_api", &[], &[]);
    assert_eq!(site_totals(&report, "leak_mallocx"), (1000, 10), "mallocx");
    assert_eq!(site_totals(&report, "rallocx_chain"), (4096, 1), "rallocx");
    assert_eq!(
        site_totals(&report, "resize_in_place"),
        (448, 4),
        "xallocx keeps the block, at its real size"
    );
    for freed in ["sized_balanced", "dallocx_balanced", "load_balanced"] {
        assert!(sites_of(&report, freed).is_empty(), "{freed} was reported");
    }
    // jemalloc's malloc is probed on its `ja` at +7, with its return probe
    // there: both ways through the branch are seen, with the right size and
    // pointer (the frees match) and the right return address (frames[0]).
    let malloc = probe_of(&report, "libjemalloc", "malloc");
    assert_eq!(malloc["probe_offset"], 7, "{malloc}");
    assert_eq!(malloc["emulated"], true, "{malloc}");
    assert_eq!(
        site_totals(&report, "leak_small_t"),
        (1280, 32),
        "fall-through"
    );
    assert_eq!(
        site_totals(&report, "leak_large_t"),
        (160000, 32),
        "branch taken"
    );
    for site in ["leak_mallocx", "leak_small_t", "leak_large_t"] {
        assert_eq!(allocator_of(&report, site), "jemalloc", "{site}");
    }
    let free = probe_of(&report, "libjemalloc", "free");
    assert_eq!(free["emulated"], true, "{free}");
    assert_nothing_counted_twice(&report);
}

#[test]
fn mimalloc_api_direct() {
    if !privileged() {
        return;
    }
    let (report, _) = trace("mimalloc_api", &[], &[]);
    assert_eq!(site_totals(&report, "leak_mi_malloc"), (1000, 5));
    assert_eq!(site_totals(&report, "leak_mi_zalloc"), (256, 4));
    assert_eq!(site_totals(&report, "leak_mi_calloc"), (200, 2));
    assert_eq!(site_totals(&report, "leak_mi_aligned"), (300, 3));
    assert_eq!(site_totals(&report, "mi_realloc_chain"), (1024, 1));
    assert_eq!(site_totals(&report, "leak_mi_new"), (96, 2));
    for freed in ["mi_balanced", "mi_sized_balanced"] {
        assert!(sites_of(&report, freed).is_empty(), "{freed} was reported");
    }
    assert_eq!(allocator_of(&report, "leak_mi_malloc"), "mimalloc");
    // mi_malloc moves its size to rsi before its first emulated instruction:
    // the probe reads it there.
    let malloc = probe_of(&report, "libmimalloc", "mi_malloc");
    assert_eq!(malloc["emulated"], true, "{malloc}");
    assert_nothing_counted_twice(&report);
}

#[test]
fn prefixed_allocator_in_the_executable_is_found_through_symtab() {
    if !privileged() {
        return;
    }
    let (report, _) = trace("prefixed_jemalloc", &[], &[]);
    assert_eq!(site_totals(&report, "leak_prefixed"), (640, 10));
    assert!(sites_of(&report, "balanced_prefixed").is_empty());
    assert_eq!(allocator_of(&report, "leak_prefixed"), "jemalloc");
    probe_of(&report, "prefixed_jemalloc", "je_malloc");
}

#[test]
fn symbol_prefix_finds_an_unknown_allocator() {
    if !privileged() {
        return;
    }
    let (report, _) = trace("custom_prefix", &[], &["--symbol-prefix", "my_"]);
    assert_eq!(site_totals(&report, "leak_big"), (24 << 20, 24));
    assert!(sites_of(&report, "balanced_custom").is_empty());
    let notes = report["notes"].to_string();
    assert!(!notes.contains("unexplained memory"), "{notes}");
}

#[test]
fn unexplained_growth_is_said_and_names_the_probed_objects() {
    if !privileged() {
        return;
    }
    let (report, _) = trace("custom_prefix", &[], &[]);
    assert!(sites_of(&report, "leak_big").is_empty());
    let note = report["notes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n.as_str())
        .find(|n| n.starts_with("unexplained memory"))
        .unwrap_or_else(|| panic!("no unexplained-memory note: {}", report["notes"]));
    assert!(note.contains("libc.so.6 (libc)"), "{note}");
    assert!(note.contains("--symbol-prefix"), "{note}");
}

#[test]
fn stripped_executable_with_its_own_allocator_gets_one_warning() {
    if !privileged() {
        return;
    }
    let (report, stderr) = trace("custom_prefix_stripped", &[], &[]);
    let warnings = stderr
        .lines()
        .filter(|l| l.contains("is stripped and imports no malloc"))
        .count();
    assert_eq!(warnings, 1, "{stderr}");
    assert!(
        report["notes"].to_string().contains("is stripped"),
        "{}",
        report["notes"]
    );
}

/// `cxx_forms`' sites: every `operator new` form paired with a delete form
/// (called explicitly), then the new-expressions of a program (issue 26's
/// mix), with each site's block size.
const FORM_SITES: [(&str, &str, u64); 15] = [
    ("form_new_delete", "new / delete", 104),
    ("form_new_sized", "new / sized delete", 112),
    ("form_array_delete", "new[] / delete[]", 120),
    ("form_array_sized", "new[] / sized delete[]", 136),
    ("form_nothrow", "nothrow new / nothrow delete", 144),
    (
        "form_array_nothrow",
        "nothrow new[] / nothrow delete[]",
        152,
    ),
    ("form_aligned", "aligned new / aligned delete", 192),
    (
        "form_aligned_sized",
        "aligned new / sized aligned delete",
        256,
    ),
    (
        "form_array_aligned",
        "aligned new[] / aligned delete[]",
        384,
    ),
    (
        "form_array_aligned_sized",
        "aligned new[] / sized aligned delete[]",
        448,
    ),
    (
        "form_aligned_nothrow",
        "aligned nothrow new / aligned nothrow delete",
        320,
    ),
    (
        "form_array_aligned_nothrow",
        "aligned nothrow new[] / aligned nothrow delete[]",
        576,
    ),
    ("expr_node", "new Node (200 B) / delete", 200),
    ("expr_chars", "new char[1000] / delete[]", 1000),
    ("expr_wide", "new Wide (alignas 64) / delete", 192),
];

/// Every operator form exact under `allocator`: each site made 400 blocks
/// and kept 100, and nothing else was allocated or released after "go", so
/// the totals are exact too (an allocation missed or a release lost at any
/// site shows in them even where live counts could balance out).
fn check_forms(report: &Value, allocator: &str) {
    let mut wrong = Vec::new();
    for (site, form, size) in FORM_SITES {
        let got = site_totals(report, site);
        if got != (100 * size, 100) {
            wrong.push(format!(
                "{site} ({form}): {} live blocks, {} bytes (want 100, {})",
                got.1,
                got.0,
                100 * size
            ));
        }
    }
    assert!(wrong.is_empty(), "{allocator}:\n{}", wrong.join("\n"));
    for (site, _, _) in FORM_SITES {
        assert_eq!(allocator_of(report, site), allocator, "{site}");
    }
    let events = &report["events"];
    assert_eq!(
        (events["allocs"].as_u64(), events["frees"].as_u64()),
        (Some(6000), Some(4500)),
        "{allocator}: 15 sites x 400 allocations, 300 releases: {events}"
    );
    assert_nothing_counted_twice(report);
}

#[test]
fn every_operator_form_exact_under_glibc() {
    if !privileged() {
        return;
    }
    let (report, _) = trace("cxx_forms", &[], &[]);
    check_forms(&report, "libc");
}

#[test]
fn every_operator_form_exact_under_preloaded_jemalloc() {
    if !privileged() {
        return;
    }
    let lib = library("libjemalloc.so.2");
    let (report, _) = trace("cxx_forms", &[("LD_PRELOAD", &lib)], &[]);
    check_forms(&report, "jemalloc");
}

#[test]
fn every_operator_form_exact_under_preloaded_tcmalloc() {
    if !privileged() {
        return;
    }
    let lib = library("libtcmalloc.so.4");
    let (report, _) = trace("cxx_forms", &[("LD_PRELOAD", &lib)], &[]);
    check_forms(&report, "tcmalloc");
}

#[test]
fn every_operator_form_exact_under_preloaded_mimalloc() {
    if !privileged() {
        return;
    }
    let lib = library("libmimalloc.so.2");
    let (report, _) = trace("cxx_forms", &[("LD_PRELOAD", &lib)], &[]);
    check_forms(&report, "mimalloc");
}
