//! `--suppress FILE` parsing and matching (`memtrace/src/analysis/suppress.rs`):
//! arbitrary text never panics; a parsed file matches arbitrary blocks
//! without panicking; glob matching of arbitrary patterns is total.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../memtrace/src/analysis/suppress.rs"]
mod suppress;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Split: first line is also used as a glob and as a frame name.
    let first = text.lines().next().unwrap_or("");
    if let Ok(glob) = suppress::Glob::parse(first) {
        let _ = glob.matches(text);
        let _ = glob.matches(first);
        let _ = glob.to_string();
    }
    if let Ok(rules) = suppress::Suppressions::parse(text) {
        let symbols = [Some(first), None, Some("main")];
        let modules = [Some("/lib/x86_64-linux-gnu/libc.so.6"), None, Some(first)];
        for (allocator, addr, size) in [
            ("libc", 0u64, 0u64),
            ("cuda", u64::MAX, u64::MAX),
            (first, 0x1000, 4096),
        ] {
            let block = suppress::BlockFacts {
                allocator,
                addr,
                size,
                symbols: &symbols,
                modules: &modules,
            };
            if let Some(index) = rules.matches_block(&block) {
                assert!(index < rules.entries().len());
            }
        }
    }
});
