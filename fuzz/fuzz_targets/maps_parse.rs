//! `/proc/PID/maps` parsing and address normalization
//! (`memtrace/src/probe/maps.rs`): arbitrary text never panics, and every
//! normalized address lies inside the mapping it was attributed to.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../memtrace/src/probe/maps.rs"]
mod maps;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mappings = maps::parse(text);
    let _ = maps::executable_files(&mappings);
    let probes: Vec<u64> = mappings
        .iter()
        .flat_map(|m| {
            [
                m.start,
                m.end,
                m.start.wrapping_add(1),
                m.end.wrapping_sub(1),
            ]
        })
        .collect();
    let space = maps::AddressSpace::new(mappings.clone());
    for addr in probes {
        if let Some(file_addr) = space.normalize(addr) {
            // Some file mapping contains addr.
            assert!(mappings.iter().any(|m| m.is_file()
                && m.start <= addr
                && addr < m.end
                && m.path.as_ref() == Some(&file_addr.module)));
        }
    }
});
