//! The GPU sources' text parsers (`memtrace/src/monitor/sources/gpu.rs`):
//! vendor tool output (`key: value`, `key=value`, the `npu-smi info` table),
//! DRM fdinfo and `value unit` never panic; every figure is named, finite
//! and not negative; names are unique.
#![no_main]

use libfuzzer_sys::fuzz_target;

/// gpu.rs reaches `crate::monitor::units::unit_multiplier`; units.rs is pure,
/// so it is included at the crate root and re-exported at that path (see
/// procfs_parse.rs).
#[allow(dead_code)]
#[path = "../../memtrace/src/monitor/units.rs"]
pub mod units;

pub mod monitor {
    pub use super::units;
}

#[allow(dead_code)]
#[path = "../../memtrace/src/monitor/sources/gpu.rs"]
mod gpu;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let figures = gpu::parse_smi_output(text);
    for (i, (name, value)) in figures.iter().enumerate() {
        assert!(!name.is_empty());
        assert!(value.is_finite() && *value >= 0.0, "{name} = {value}");
        assert!(
            figures[..i].iter().all(|(other, _)| other != name),
            "{name} twice"
        );
    }
    if let Some((client, memory)) = gpu::parse_fdinfo(text) {
        assert!(client.contains('/'));
        for (name, value) in memory {
            assert!(name.starts_with("drm."));
            assert!(value.is_finite() && value >= 0.0, "{name} = {value}");
        }
    }
    for line in text.lines().take(64) {
        if let Some(value) = gpu::parse_value_unit(line) {
            assert!(value.is_finite() && value >= 0.0, "{line:?} = {value}");
        }
    }
});
