//! What the trace makes of its USDT probes beyond the live table: the
//! device index and stream each tagged allocation carried (PyTorch's
//! `pytorch:malloc(devPtr, device, size, stream)`), and the report's side
//! by side view of a caching allocator's tensors and its `cudaMalloc`
//! segments; and the line that says an object's probes were attached late.

use crate::probe::catalog::Memory;
use crate::probe::usdt_plan::UsdtPlan;
use crate::probe::SpecEntry;
use crate::report::DeviceCache;
use crate::table::LiveTable;

pub use crate::report::device_cache::UsdtTags;

/// The device cache view, when the session probes USDT device allocators
/// (see [`crate::report::device_cache::build`]).
pub fn device_cache(
    plans: &[UsdtPlan],
    table: &LiveTable,
    specs: &[SpecEntry],
    tags: &UsdtTags,
) -> Option<DeviceCache> {
    crate::report::device_cache::build(&device_allocators(plans), table, specs, tags)
}

/// The names of the USDT device allocators `plans` probe, sorted, once each.
pub fn device_allocators(plans: &[UsdtPlan]) -> Vec<String> {
    let mut allocators: Vec<String> = plans
        .iter()
        .flat_map(|plan| plan.sites.iter())
        .filter(|site| site.def.memory == Memory::Device)
        .map(|site| site.def.allocator.name().to_string())
        .collect();
    allocators.sort();
    allocators.dedup();
    allocators
}

/// Says which objects' USDT sites were just attached (a rescan found them).
pub fn say_new(plans: &[UsdtPlan]) {
    for plan in plans {
        eprintln!(
            "memtrace: probing USDT probes of newly loaded {} ({} sites)",
            plan.path.display(),
            plan.sites.len()
        );
    }
}
