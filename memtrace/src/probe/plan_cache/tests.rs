//! The function cache: round trips, a later search served from the cache
//! and identical to a fresh one, every corrupt file rejected, another
//! catalogue or flag set missing, unsafe files and directories refused.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use super::*;
use crate::probe::catalog::CATALOG;

fn full_catalog() -> Vec<&'static FuncDef> {
    CATALOG.iter().collect()
}

/// A system library, when installed (libc comes with every test machine).
fn system_lib(name: &str) -> Option<PathBuf> {
    ["/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu"]
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.exists())
}

fn libc() -> PathBuf {
    system_lib("libc.so.6").expect("libc.so.6")
}

/// Everything a plan holds, the definitions and offsets included.
fn everything(plan: &Option<LibraryPlan>) -> String {
    format!("{plan:?}")
}

/// A search for the whole catalogue through a cache in a new directory.
fn cached(place: bool) -> (tempfile::TempDir, FunctionSearch) {
    let parent = tempfile::tempdir().expect("tempdir");
    let mut search = FunctionSearch::new(full_catalog(), place);
    search
        .use_cache(&parent.path().join("cache"), disk_cache::DEFAULT_MIB << 20)
        .expect("opens");
    (parent, search)
}

fn counts(hits: u64, misses: u64, rejected: u64, stored: u64) -> (u64, u64, u64, u64) {
    (hits, misses, rejected, stored)
}

fn of(stats: &CacheStats) -> (u64, u64, u64, u64) {
    (stats.hits, stats.misses, stats.rejected, stats.stored)
}

/// The one function-cache file in the search's directory.
fn the_file(search: &FunctionSearch) -> PathBuf {
    let dir = search
        .cache
        .as_ref()
        .expect("cache")
        .store
        .dir()
        .to_path_buf();
    let files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("dir")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "fns"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

#[test]
fn a_later_search_comes_from_the_cache_and_plans_the_same() {
    let libc = libc();
    let (_dir, search) = cached(true);
    let fresh = plan::plan_library(&libc, &libc, &full_catalog(), true).expect("readable");
    assert!(fresh.is_some());
    let (first, stats) = search.plan(&libc, &libc);
    assert_eq!(of(&stats), counts(0, 1, 0, 1), "{stats:?}");
    let (second, stats) = search.plan(&libc, &libc);
    assert_eq!(of(&stats), counts(1, 0, 0, 0), "{stats:?}");
    let (first, second) = (first.expect("searched"), second.expect("cached"));
    assert_eq!(everything(&first), everything(&fresh));
    assert_eq!(everything(&second), everything(&fresh));
    let name = the_file(&search);
    let name = name.file_name().and_then(|n| n.to_str()).expect("name");
    assert!(name.starts_with("b-") && name.ends_with(".fns"), "{name}");
}

#[test]
fn an_object_without_functions_is_cached_as_such() {
    let Some(libm) = system_lib("libm.so.6") else {
        return;
    };
    let (_dir, search) = cached(true);
    assert!(search.plan(&libm, &libm).0.expect("readable").is_none());
    let (again, stats) = search.plan(&libm, &libm);
    assert!(again.expect("cached").is_none());
    assert_eq!(of(&stats), counts(1, 0, 0, 0));
}

#[test]
fn forwarders_and_placements_survive_the_round_trip() {
    let Some(lib) = system_lib("libstdc++.so.6") else {
        return;
    };
    let (_dir, search) = cached(true);
    let searched = search.plan(&lib, &lib).0.expect("readable");
    let (from_cache, stats) = search.plan(&lib, &lib);
    assert_eq!(stats.hits, 1);
    let from_cache = from_cache.expect("cached");
    assert_eq!(everything(&from_cache), everything(&searched));
    let plan = from_cache.expect("operator new");
    assert!(plan
        .forwarders
        .iter()
        .any(|f| f.function == "_ZdlPv" && f.to == "free"));
}

#[test]
fn the_heap_allocator_named_by_the_path_is_not_cached() {
    // The same file seen at another path: which allocator its `malloc` is
    // comes from the path it is mapped at, not from the cache.
    let libc = libc();
    let (_dir, search) = cached(true);
    search.plan(&libc, &libc).0.expect("readable");
    let renamed = Path::new("/opt/x/libmimalloc.so.2");
    let (plan, stats) = search.plan(renamed, &libc);
    assert_eq!(stats.hits, 1);
    let fresh = plan::plan_library(renamed, &libc, &full_catalog(), true).expect("readable");
    let plan = plan.expect("cached");
    assert_eq!(everything(&plan), everything(&fresh));
    assert_eq!(plan.expect("allocators").allocator, Some("mimalloc"));
}

#[test]
fn another_catalogue_or_flag_set_misses() {
    let libc = libc();
    let (dir, search) = cached(true);
    search.plan(&libc, &libc).0.expect("readable");
    let cache_dir = dir.path().join("cache");
    let mut entry_probes = FunctionSearch::new(full_catalog(), false);
    entry_probes
        .use_cache(&cache_dir, disk_cache::DEFAULT_MIB << 20)
        .expect("opens");
    let (plan, stats) = entry_probes.plan(&libc, &libc);
    assert_eq!(of(&stats), counts(0, 1, 0, 1), "--entry-probes: {stats:?}");
    let fresh = plan::plan_library(&libc, &libc, &full_catalog(), false).expect("readable");
    assert_eq!(everything(&plan.expect("searched")), everything(&fresh));

    let fewer: Vec<&'static FuncDef> = CATALOG.iter().filter(|d| d.name != "calloc").collect();
    let mut smaller = FunctionSearch::new(fewer, true);
    smaller
        .use_cache(&cache_dir, disk_cache::DEFAULT_MIB << 20)
        .expect("opens");
    let (plan, stats) = smaller.plan(&libc, &libc);
    assert_eq!(
        of(&stats),
        counts(0, 1, 0, 1),
        "another catalogue: {stats:?}"
    );
    let plan = plan.expect("searched").expect("allocators");
    assert!(plan.functions.iter().all(|f| f.function != "calloc"));
    // A definition changed in any field is another catalogue.
    let nested = CATALOG[0].nested_under(5);
    let leaked: &'static FuncDef = Box::leak(Box::new(nested));
    let mut changed = full_catalog();
    changed[0] = leaked;
    assert_ne!(
        inputs(Arch::HOST, &changed, true),
        inputs(Arch::HOST, &full_catalog(), true)
    );
    assert_ne!(
        inputs(Arch::X86_64, &full_catalog(), true),
        inputs(Arch::Aarch64, &full_catalog(), true)
    );
    // The first search's file is still there, and still served.
    assert_eq!(search.plan(&libc, &libc).1.hits, 1);
}

/// A valid file's bytes for libc's search, and what decoding needs.
fn libc_file() -> (Vec<u8>, Found, u64) {
    let libc = libc();
    let found = plan::search_as(Arch::HOST, &libc, &full_catalog(), true).expect("readable");
    let len = std::fs::metadata(&libc).expect("libc").len();
    let bytes = encode("b-01", 7, Arch::HOST, &found).expect("encodes");
    (bytes, found, len)
}

#[test]
fn every_truncation_and_every_flipped_byte_is_rejected() {
    let (good, found, len) = libc_file();
    let decode = |bytes: &[u8]| decode(bytes, "b-01", 7, Arch::HOST, len, &full_catalog());
    assert_eq!(decode(&good), Ok(found));
    for cut in 0..good.len() {
        assert!(decode(&good[..cut]).is_err(), "truncated to {cut}");
    }
    for at in 0..good.len() {
        let mut bad = good.clone();
        bad[at] ^= 0x01;
        assert!(decode(&bad).is_err(), "byte {at} flipped");
    }
}

#[test]
fn a_file_with_a_valid_checksum_but_foreign_or_out_of_bounds_is_rejected() {
    let (_, found, len) = libc_file();
    let catalog = full_catalog();
    let check = |found: &Found, key: &str, inputs: u64, arch: Arch| {
        let bytes = encode(key, inputs, arch, found).expect("encodes");
        decode(&bytes, "b-01", 7, Arch::HOST, len, &catalog)
    };
    assert!(check(&found, "b-01", 7, Arch::HOST).is_ok());
    assert_eq!(check(&found, "b-02", 7, Arch::HOST), Err(Rejected::Key));
    assert_eq!(check(&found, "b-01", 8, Arch::HOST), Err(Rejected::Format));
    let other = match Arch::HOST {
        Arch::X86_64 => Arch::Aarch64,
        Arch::Aarch64 => Arch::X86_64,
    };
    assert_eq!(check(&found, "b-01", 7, other), Err(Rejected::Format));
    let forged: [&dyn Fn(&mut Found); 7] = [
        &|f| f.functions[0].function = "not_in_the_catalogue".into(),
        &|f| f.functions[0].aliases.push("strdup".into()),
        &|f| f.defined.retain(|name| *name != f.functions[0].function),
        &|f| f.functions[0].file_offset = len,
        &|f| f.functions[0].probe_offset = WINDOW as u64,
        &|f| f.functions[0].args[2] = ARG_REGS,
        &|f| f.functions[1].file_offset = f.functions[0].file_offset,
    ];
    for (i, forge) in forged.iter().enumerate() {
        let mut bad = found.clone();
        forge(&mut bad);
        assert_eq!(
            check(&bad, "b-01", 7, Arch::HOST),
            Err(Rejected::Bounds),
            "forgery {i}"
        );
    }
    // Another program's JSON, with a valid checksum.
    let mut other = br#"{"magic":"memtrace-functions"}"#.to_vec();
    let crc = crc32fast::hash(&other);
    other.extend_from_slice(format!("\n{crc:08x}\n").as_bytes());
    assert_eq!(
        decode(&other, "b-01", 7, Arch::HOST, len, &catalog),
        Err(Rejected::Format)
    );
}

#[test]
fn a_corrupt_file_is_counted_removed_and_searched_again() {
    let libc = libc();
    let (_dir, search) = cached(true);
    let (fresh, _) = search.plan(&libc, &libc);
    let file = the_file(&search);
    let mut bytes = std::fs::read(&file).expect("read");
    let half = bytes.len() / 2;
    bytes[half] ^= 0x20;
    std::fs::write(&file, &bytes).expect("write");
    let (plan, stats) = search.plan(&libc, &libc);
    assert_eq!(of(&stats), counts(0, 1, 1, 1), "{stats:?}");
    assert!(
        stats.failures[0].contains("checksum mismatch"),
        "{:?}",
        stats.failures
    );
    assert_eq!(
        everything(&plan.expect("searched")),
        everything(&fresh.expect("searched"))
    );
    // Stored again, and valid.
    assert_eq!(of(&search.plan(&libc, &libc).1), counts(1, 0, 0, 0));
}

#[test]
fn unsafe_files_and_directories_are_refused_by_the_directory_checks() {
    let libc = libc();
    let (dir, search) = cached(true);
    search.plan(&libc, &libc).0.expect("readable");
    let file = the_file(&search);
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let (plan, stats) = search.plan(&libc, &libc);
    assert!(plan.expect("searched").is_some());
    assert_eq!(of(&stats), counts(0, 1, 1, 1), "{stats:?}");
    assert!(stats.failures[0].contains("only it may write"), "{stats:?}");

    let open = dir.path().join("open");
    std::fs::create_dir(&open).expect("mkdir");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let mut refused = FunctionSearch::new(full_catalog(), true);
    assert!(matches!(
        refused.use_cache(&open, disk_cache::DEFAULT_MIB << 20),
        Err(Refused::Unsafe(_))
    ));
    // Uncached then: searched, nothing counted.
    let (plan, stats) = refused.plan(&libc, &libc);
    assert!(plan.expect("searched").is_some());
    assert_eq!(stats, CacheStats::default());
}

#[test]
fn objects_that_cannot_be_read_are_the_searchs_errors_and_not_cached() {
    let (_dir, search) = cached(true);
    let missing = Path::new("/nonexistent/libfoo.so");
    let (plan, stats) = search.plan(missing, missing);
    assert!(matches!(plan, Err(ElfError::Io { .. })), "{plan:?}");
    assert_eq!(of(&stats), counts(0, 1, 0, 0));
}
