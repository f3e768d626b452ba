//! The monitor's procfs parsers (`memtrace/src/monitor/sources/procfs.rs`):
//! `/proc/PID/status` and `/proc/meminfo` text never panics the parser.
#![no_main]

use libfuzzer_sys::fuzz_target;

/// procfs.rs reaches `crate::monitor::units::unit_multiplier`; units.rs is
/// pure, so it is included too and re-exported at that path. (Inline
/// modules with `#[path]` would resolve through directories that do not
/// exist, so both files are included at the crate root.)
#[allow(dead_code)]
#[path = "../../memtrace/src/monitor/units.rs"]
pub mod units;

pub mod monitor {
    pub use super::units;
}

#[allow(dead_code)]
#[path = "../../memtrace/src/monitor/sources/procfs.rs"]
mod procfs;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let kv = procfs::parse_kv_kb(text);
    for (_, value) in &kv {
        let _ = value.is_finite();
    }
    let _ = procfs::parse_status(text);
    let _ = procfs::parse_meminfo(text);
    let _ = procfs::name_matches(text, Some(text), None);
    let _ = units::parse_size(text);
});
