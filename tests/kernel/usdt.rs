//! USDT probes (`memtrace probes PID|FILE`): the probes of the sdt.h
//! fixtures, PIE and non-PIE, with semaphores and without, and of a library
//! a running process dlopened late, listed with exact names, counts, file
//! offsets (the probe's nop at each) and decoded arguments; a file that is
//! no ELF object is one clear line.

use serde_json::Value;

use crate::support::{assert_one_clear_line, fixture, memtrace, privileged, Fixture};

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
