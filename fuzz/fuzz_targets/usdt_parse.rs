//! USDT notes (`memtrace/src/probe/usdt.rs`): arbitrary bytes, as a whole
//! ELF object or as the contents of a `.note.stapsdt` section, never panic;
//! accepted notes have a provider and a name, and every argument spec the
//! decoder accepts has a size of 1, 2, 4 or 8 and names a `pt_regs` slot.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../memtrace/src/probe/usdt.rs"]
mod usdt;

fn check_args(text: &str) {
    if let Ok(args) = usdt::decode_args(text) {
        for arg in args {
            assert!(matches!(arg.size, 1 | 2 | 4 | 8));
            match arg.location {
                usdt::ArgLocation::Register { reg } | usdt::ArgLocation::Memory { reg, .. } => {
                    assert!(reg.pt_regs_offset() <= 160);
                }
                usdt::ArgLocation::Constant { .. } => {}
            }
            let _ = arg.to_string();
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    match first % 3 {
        0 => {
            if let Ok(probes) = usdt::parse(rest) {
                for probe in probes {
                    assert!(!probe.provider.is_empty() && !probe.name.is_empty());
                    check_args(&probe.args_text);
                }
            }
        }
        1 => {
            if let Ok(notes) = usdt::parse_notes(rest, first & 4 == 0, first & 8 == 0) {
                for note in notes {
                    assert!(!note.provider.is_empty() && !note.name.is_empty());
                    check_args(&note.args);
                }
            }
        }
        _ => {
            if let Ok(text) = std::str::from_utf8(rest) {
                check_args(text);
            }
        }
    }
});
