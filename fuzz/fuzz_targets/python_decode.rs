//! CPython line tables and the code-object decoder
//! (`memtrace/src/interp/python/lines.rs`, `resolve.rs`): arbitrary bytes as
//! any version's line table, and as a target's memory holding a code object,
//! never panic, and lines never come from outside the table's reach.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../memtrace/src/interp/python"]
mod python {
    pub mod layout;
    pub mod lines;
    pub mod resolve;
}

use python::{layout, lines, resolve};

/// The fuzz input as a process's memory from address 0x1000.
struct Bytes<'a>(&'a [u8]);

impl resolve::Memory for Bytes<'_> {
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
        let Some(start) = addr.checked_sub(0x1000).and_then(|s| usize::try_from(s).ok()) else {
            return false;
        };
        match start
            .checked_add(buf.len())
            .and_then(|end| self.0.get(start..end))
        {
            Some(src) => {
                buf.copy_from_slice(src);
                true
            }
            None => false,
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let format = match selector % 3 {
        0 => lines::TableFormat::Lnotab,
        1 => lines::TableFormat::Linetable310,
        _ => lines::TableFormat::Locations,
    };
    let first = i32::from(selector) - 128;
    for offset in (0..rest.len() as u32 * 2 + 4).step_by(2) {
        let _ = lines::line_at(format, rest, first, offset);
    }
    let _ = lines::line_at(format, rest, i32::MAX, u32::MAX);
    for minor in 11..=13 {
        let Some(layout) = layout::for_minor(minor) else {
            continue;
        };
        let mem = Bytes(rest);
        let _ = layout::from_debug_offsets(layout, rest);
        let mut resolver = resolve::Resolver::default();
        for code in [0x1000u64, 0x1008, 0x1000 + u64::from(selector)] {
            let _ = resolver.frame(1, &mem, &layout, code, code + 0x100);
        }
    }
});
