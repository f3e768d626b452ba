//! `--pairs FILE` parsing (`memtrace/src/probe/pairs.rs`): arbitrary text
//! never panics; an accepted file yields, per pair, an alloc and a free
//! definition that the eBPF side can use (named, argument slots in range,
//! families past the built-ins, a handle read from memory only with a status
//! return); a rejected one names a line of the file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memtrace_common::{RetKind, SpecKind, ARG_NONE};

/// pairs.rs reaches `super::catalog`; catalog.rs is pure, so both files are
/// included at the crate root.
#[allow(dead_code)]
#[path = "../../memtrace/src/probe/catalog.rs"]
mod catalog;

#[allow(dead_code)]
#[path = "../../memtrace/src/probe/pairs.rs"]
mod pairs;

/// `parse` leaks its definitions on purpose (they live for the whole run):
/// LeakSanitizer is told not to report them, at exit or per input.
#[no_mangle]
pub extern "C" fn __lsan_default_options() -> *const std::ffi::c_char {
    c"detect_leaks=0".as_ptr()
}

fn slot_ok(slot: u8) -> bool {
    slot < 6 || slot == ARG_NONE
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    // The first byte picks how many pairs earlier files declared.
    let first_index = usize::from(first % 8) * 25;
    match pairs::parse(text, "fuzz.toml", first_index) {
        Ok(defs) => {
            assert_eq!(defs.len() % 2, 0);
            for (i, pair) in defs.chunks(2).enumerate() {
                let (alloc, free) = (pair[0], pair[1]);
                assert_eq!(alloc.kind, SpecKind::Alloc);
                assert_eq!(free.kind, SpecKind::Free);
                assert!(!alloc.name.trim().is_empty());
                assert!(!free.name.trim().is_empty());
                let name = alloc.allocator.name();
                assert!(!name.trim().is_empty());
                assert!(catalog::Allocator::parse_builtin(name).is_none());
                assert_eq!(alloc.allocator, free.allocator);
                assert_eq!(alloc.domain, free.domain);
                assert_eq!(alloc.memory, free.memory);
                let family = alloc.allocator.family();
                assert_eq!(usize::from(family), 8 + first_index + i);
                assert_eq!(alloc.domain, catalog::Domain::Custom(family));
                for slot in [alloc.size_arg, alloc.out_arg, alloc.ptr_arg, free.ptr_arg] {
                    assert!(slot_ok(slot), "slot {slot}");
                }
                assert!(free.ptr_arg < 6);
                if alloc.out_arg != ARG_NONE {
                    assert_eq!(alloc.ret, RetKind::Status);
                }
                assert_eq!(alloc.quirk, free.quirk);
                assert!(matches!(free.ret, RetKind::Void | RetKind::Status));
            }
        }
        Err(err) => {
            assert!(err.line >= 1);
            assert!(err.line <= text.lines().count().max(1));
            assert_eq!(err.source_name, "fuzz.toml");
        }
    }
});
