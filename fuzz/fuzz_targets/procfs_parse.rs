//! The monitor's procfs parsers (`memtrace/src/monitor/sources/procfs.rs`):
//! `/proc/PID/status` and `/proc/meminfo` text never panics the parser.
#![no_main]

use libfuzzer_sys::fuzz_target;

/// procfs.rs reaches `crate::monitor::units::unit_multiplier`; units.rs is
/// pure, so it is included at the same path.
#[allow(dead_code)]
mod monitor {
    #[path = "../../../memtrace/src/monitor/units.rs"]
    pub mod units;
    pub mod sources {
        #[path = "../../../../memtrace/src/monitor/sources/procfs.rs"]
        pub mod procfs;
    }
}

use monitor::sources::procfs;

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
    let _ = monitor::units::parse_size(text);
});
