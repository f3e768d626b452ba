//! The device cache view of a caching device allocator probed through USDT
//! (PyTorch's `pytorch:malloc(devPtr, device, size, stream)`): the device
//! index and stream each tagged allocation carried, kept while it lives,
//! and the report's side by side view of its tensors and the `cudaMalloc`
//! segments. The live trace and the replay of a record file feed the same
//! events through [`UsdtTags`] and build the view with [`build`], so a
//! replayed report shows the live one's `device_cache`.

use std::collections::HashMap;

use memtrace_common::{EventKind, WireEvent, FLAG_TAGGED};

use super::{DeviceCache, DeviceTensors};
use crate::probe::catalog::{Allocator, Domain, Memory};
use crate::probe::SpecEntry;
use crate::table::LiveTable;

/// Most tagged blocks remembered: past it a block's tags are counted
/// (`dropped`) and it is reported under device -1.
const MAX_TAGGED: usize = 1 << 20;

/// The tags (device, stream) of the live tagged allocations, by process,
/// address domain and address.
#[derive(Debug, Default)]
pub struct UsdtTags {
    live: HashMap<(u32, Domain, u64), (i64, i64)>,
    /// Tagged allocations not remembered (the map was full).
    pub dropped: u64,
}

impl UsdtTags {
    /// Takes one event: a tagged allocation's tags are kept until a
    /// release of its address in its domain.
    pub fn observe(&mut self, wire: &WireEvent, specs: &[SpecEntry]) {
        let tagged = wire.flags & FLAG_TAGGED != 0;
        if !tagged && self.live.is_empty() {
            // No USDT device allocator in this trace: nothing to keep.
            return;
        }
        let Some(spec) = specs.get(usize::from(wire.spec)) else {
            return;
        };
        let key = (wire.pid, spec.domain, wire.addr);
        if wire.kind == EventKind::Alloc as u8 && tagged {
            if self.live.len() >= MAX_TAGGED && !self.live.contains_key(&key) {
                self.dropped += 1;
                return;
            }
            // The device index is a signed byte in PyTorch's probe, sign
            // extended by the kernel side; the stream id is signed too.
            self.live
                .insert(key, (i64::from(wire.tag as i32), wire.aux as i64));
        } else if wire.kind == EventKind::Free as u8 {
            self.live.remove(&key);
        }
    }

    fn get(&self, pid: u32, domain: Domain, addr: u64) -> Option<(i64, i64)> {
        self.live.get(&(pid, domain, addr)).copied()
    }
}

/// The device cache view: `allocators` names the USDT device allocators
/// whose blocks are tensors (the CUDA runtime's and driver's device blocks
/// are the segments); `None` when there are none.
pub fn build(
    allocators: &[String],
    table: &LiveTable,
    specs: &[SpecEntry],
    tags: &UsdtTags,
) -> Option<DeviceCache> {
    if allocators.is_empty() {
        return None;
    }
    let mut cache = DeviceCache {
        tags_dropped: tags.dropped,
        allocators: allocators.to_vec(),
        ..DeviceCache::default()
    };
    let mut by_device: HashMap<(i64, i64), (u64, u64)> = HashMap::new();
    for (pid, domain, addr, block) in table.blocks() {
        let Some(spec) = specs.get(usize::from(block.spec)) else {
            continue;
        };
        if spec.memory != Memory::Device {
            continue;
        }
        if allocators.iter().any(|name| name == spec.allocator.name()) {
            cache.tensor_live_bytes += block.size;
            cache.tensor_live_count += 1;
            let tag = tags.get(pid, domain, addr).unwrap_or((-1, 0));
            let entry = by_device.entry(tag).or_default();
            entry.0 += block.size;
            entry.1 += 1;
        } else if matches!(spec.allocator, Allocator::Cuda | Allocator::CudaDriver) {
            cache.segment_live_bytes += block.size;
            cache.segment_live_count += 1;
        }
    }
    cache.cached_bytes = i64::try_from(cache.segment_live_bytes)
        .unwrap_or(i64::MAX)
        .saturating_sub(i64::try_from(cache.tensor_live_bytes).unwrap_or(i64::MAX));
    cache.tensors_by_device = by_device
        .into_iter()
        .map(
            |((device, stream), (live_bytes, live_count))| DeviceTensors {
                device,
                stream,
                live_bytes,
                live_count,
            },
        )
        .collect();
    cache
        .tensors_by_device
        .sort_by_key(|d| (d.device, d.stream));
    Some(cache)
}
