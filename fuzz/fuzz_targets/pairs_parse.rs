//! `--pairs FILE` parsing (`memtrace/src/probe/pairs.rs`): arbitrary text
//! never panics; an accepted file yields, per pair, at least one alloc and
//! one free definition that the eBPF side can use (named, argument slots in
//! range, families past the built-ins, a handle read from memory only with a
//! status return), each alloc function once, each release function in one
//! domain; a rejected one names a line of the file.
#![no_main]

use std::collections::{BTreeMap, BTreeSet};

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
    match pairs::PairsParser::new(first_index).parse(text, "fuzz.toml") {
        Ok(defs) => {
            // Families are numbered on from first_index, one per pair, each
            // with at least one alloc and one free definition: a caller
            // numbering the next file by `defs.len() / 2` never reuses one.
            let mut families: BTreeMap<u8, (usize, usize)> = BTreeMap::new();
            let mut allocs: BTreeSet<&str> = BTreeSet::new();
            let mut releases: BTreeMap<&str, catalog::Domain> = BTreeMap::new();
            for def in &defs {
                assert!(!def.name.trim().is_empty());
                let name = def.allocator.name();
                assert!(!name.trim().is_empty());
                assert!(catalog::Allocator::parse_builtin(name).is_none());
                let family = def.allocator.family();
                assert!(usize::from(family) >= 8 + first_index);
                // A pair's handles live in its own domain or an earlier pair's
                // (one whose release it shares).
                let catalog::Domain::Custom(domain) = def.domain else {
                    panic!("domain {:?}", def.domain);
                };
                assert!(domain <= family && usize::from(domain) >= 8 + first_index);
                let counts = families.entry(family).or_insert((0, 0));
                match def.kind {
                    SpecKind::Alloc => {
                        counts.0 += 1;
                        assert!(allocs.insert(def.name), "alloc {} twice", def.name);
                        for slot in [def.size_arg, def.out_arg, def.ptr_arg] {
                            assert!(slot_ok(slot), "slot {slot}");
                        }
                        if def.out_arg != ARG_NONE {
                            assert_eq!(def.ret, RetKind::Status);
                        }
                    }
                    SpecKind::Free => {
                        counts.1 += 1;
                        assert!(def.ptr_arg < 6);
                        assert!(matches!(def.ret, RetKind::Void | RetKind::Status));
                        let shared = *releases.entry(def.name).or_insert(def.domain);
                        assert_eq!(shared, def.domain, "release {} split", def.name);
                    }
                    other => panic!("kind {other:?}"),
                }
            }
            for name in releases.keys() {
                assert!(!allocs.contains(name), "{name} is alloc and free");
            }
            for (i, (&family, &(allocs, frees))) in families.iter().enumerate() {
                assert_eq!(usize::from(family), 8 + first_index + i);
                assert!(allocs >= 1 && frees >= 1, "family {family}");
                // One pair, one way of calling: memory and quirk agree.
                let mut own = defs.iter().filter(|d| d.allocator.family() == family);
                let first = own.next().expect("a definition");
                for def in own {
                    assert_eq!(def.allocator, first.allocator);
                    assert_eq!(def.memory, first.memory);
                    assert_eq!(def.quirk, first.quirk);
                    assert_eq!(def.domain, first.domain);
                }
            }
            assert!(defs.len() / 2 >= families.len());
        }
        Err(err) => {
            assert!(err.line >= 1);
            assert!(err.line <= text.lines().count().max(1));
            assert_eq!(err.source_name, "fuzz.toml");
        }
    }
});
