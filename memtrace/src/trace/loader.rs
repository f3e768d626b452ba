//! Loading the embedded eBPF object with its load-time settings, attaching
//! the two generic programs per planned function (with the spec index as attach
//! cookie, scoped to the target process), and detaching in a safe order.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use anyhow::Context;
use aya::maps::{Array, MapData, PerCpuArray, RingBuf, StackTraceMap};
use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope};
use aya::programs::UProbe;
use aya::{Ebpf, EbpfLoader};
use memtrace_common::{Counter, ProbeSpec, MAX_SPECS};

use crate::error::Failure;
use crate::probe::plan::LibraryPlan;
use crate::probe::SpecEntry;
use crate::trace::kernel_support;

/// The eBPF object built by `cargo xtask build-ebpf`, embedded at build time.
static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/memtrace.bpf.o"));

const ENTER: &str = "call_enter";
const EXIT: &str = "call_exit";

/// Load-time settings of the eBPF programs.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    pub stacks: bool,
    pub sample_rate: u32,
    pub min_size: u64,
    pub max_size: u64,
    /// Empty programs (the probe-cost floor for benchmarks).
    pub null_mode: bool,
    pub ring_bytes: u32,
    pub stack_entries: u32,
    pub wakeup_bytes: u64,
}

/// The loaded programs and the maps the event loop reads.
pub struct Probes {
    ebpf: Ebpf,
    pid: NonZeroU32,
    specs: Vec<SpecEntry>,
    spec_map: Array<MapData, ProbeSpec>,
    enter_links: Vec<UProbeLinkId>,
    exit_links: Vec<UProbeLinkId>,
    pub events: Option<RingBuf<MapData>>,
    stacks: StackTraceMap<MapData>,
    counters: PerCpuArray<MapData, u64>,
}

/// Kernel counter names, as shown in reports.
pub fn counter_name(counter: Counter) -> &'static str {
    match counter {
        Counter::RingbufFull => "ringbuf_full",
        Counter::StackFault => "stack_fault",
        Counter::StackCollision => "stack_collision",
        Counter::StackOther => "stack_other",
        Counter::PendingFull => "pending_full",
        Counter::UnpairedReturn => "unpaired_returns",
        Counter::StalePending => "stale_in_flight",
        Counter::OutReadFailed => "out_read_failed",
        Counter::MmapTableFull => "mmap_table_full",
        Counter::Nested => "nested_calls",
        Counter::Filtered => "filtered",
    }
}

impl Probes {
    /// Loads the programs and maps into the kernel.
    pub fn load(pid: u32, options: &LoadOptions) -> anyhow::Result<Self> {
        if EBPF_OBJECT.is_empty() {
            return Err(Failure::runtime(
                "this memtrace was built without its eBPF object: run `cargo xtask build-ebpf`, then rebuild",
            )
            .into());
        }
        let pid = NonZeroU32::new(pid).ok_or_else(|| Failure::usage("pid 0 is not a process"))?;
        let stacks_enabled: u32 = options.stacks.into();
        let null_mode: u32 = options.null_mode.into();
        let mut ebpf = EbpfLoader::new()
            .override_global("STACKS_ENABLED", &stacks_enabled, true)
            .override_global("SAMPLE_RATE", &options.sample_rate, true)
            .override_global("MIN_SIZE", &options.min_size, true)
            .override_global("MAX_SIZE", &options.max_size, true)
            .override_global("NULL_MODE", &null_mode, true)
            .override_global("WAKEUP_BYTES", &options.wakeup_bytes, true)
            .map_max_entries("EVENTS", options.ring_bytes)
            .map_max_entries("STACKS", options.stack_entries.max(1))
            .load(EBPF_OBJECT)
            .map_err(|err| load_failure(&err))?;
        for name in [ENTER, EXIT] {
            let program: &mut UProbe = ebpf
                .program_mut(name)
                .with_context(|| format!("program {name} missing from the eBPF object"))?
                .try_into()?;
            program.load().map_err(|err| load_failure(&err))?;
        }
        let spec_map = Array::try_from(ebpf.take_map("SPECS").context("map SPECS missing")?)?;
        let events = RingBuf::try_from(ebpf.take_map("EVENTS").context("map EVENTS missing")?)?;
        let stacks =
            StackTraceMap::try_from(ebpf.take_map("STACKS").context("map STACKS missing")?)?;
        let counters =
            PerCpuArray::try_from(ebpf.take_map("COUNTERS").context("map COUNTERS missing")?)?;
        Ok(Probes {
            ebpf,
            pid,
            specs: Vec::new(),
            spec_map,
            enter_links: Vec::new(),
            exit_links: Vec::new(),
            events: Some(events),
            stacks,
            counters,
        })
    }

    /// The eBPF object, for the kernel log reader.
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    pub fn specs(&self) -> &[SpecEntry] {
        &self.specs
    }

    /// Attaches every function of `plan`; returns how many probes were attached.
    /// A function that cannot be attached is logged and left out of the plan.
    pub fn attach_library(&mut self, plan: &mut LibraryPlan) -> anyhow::Result<usize> {
        let mut attached = 0;
        let mut failures = Vec::new();
        let mut unsupported = None;
        let mut kept = Vec::new();
        for probe in plan.functions.drain(..) {
            match self.attach_function(&plan.open_path, &probe) {
                Ok(()) => {
                    attached += 1;
                    kept.push(probe);
                }
                Err(err) => {
                    unsupported = unsupported.or(kernel_support::unsupported_in(&err).cloned());
                    failures.push(format!("{}: {err:#}", probe.function));
                }
            }
        }
        plan.functions = kept;
        if let (0, Some(unsupported)) = (attached, unsupported) {
            // The kernel lacks a feature: every function failed alike.
            return Err(unsupported.into());
        }
        for failure in &failures {
            log::warn!("{}: cannot attach {failure}", plan.path.display());
        }
        if attached == 0 && !failures.is_empty() {
            anyhow::bail!(
                "cannot attach to {}: {}",
                plan.path.display(),
                failures.join("; ")
            );
        }
        Ok(attached)
    }

    fn attach_function(
        &mut self,
        path: &std::path::Path,
        probe: &crate::probe::plan::PlannedProbe,
    ) -> anyhow::Result<()> {
        let index = u16::try_from(self.specs.len())
            .ok()
            .filter(|&i| u32::from(i) < MAX_SPECS)
            .ok_or_else(|| Failure::runtime("too many probed functions"))?;
        self.spec_map
            .set(u32::from(index), probe.def.spec(index), 0)?;
        self.specs.push(SpecEntry::from(probe.def));
        let scope = UProbeScope::OneProcess(self.pid);
        let cookie = Some(u64::from(index));
        // The return probe goes first: an entry whose return probe is not yet
        // attached would leave a stale in-flight record behind.
        if probe.def.needs_return_probe() {
            let program: &mut UProbe = self
                .ebpf
                .program_mut(EXIT)
                .context("call_exit missing")?
                .try_into()?;
            let point = UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(probe.file_offset),
                cookie,
            };
            self.exit_links.push(
                program
                    .attach(point, path, scope)
                    .map_err(|err| kernel_support::attach_error(err, "uretprobe"))?,
            );
        }
        let program: &mut UProbe = self
            .ebpf
            .program_mut(ENTER)
            .context("call_enter missing")?
            .try_into()?;
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(probe.file_offset + probe.probe_offset),
            cookie,
        };
        self.enter_links.push(
            program
                .attach(point, path, scope)
                .map_err(|err| kernel_support::attach_error(err, "uprobe"))?,
        );
        log::info!(
            "attached {} in {} at {:#x} {}",
            probe.function,
            path.display(),
            probe.file_offset,
            probe.placement
        );
        Ok(())
    }

    /// Detaches entry probes first, then return probes, so no call is left
    /// half-recorded.
    pub fn detach(&mut self) {
        if let Some(Ok(program)) = self.ebpf.program_mut(ENTER).map(<&mut UProbe>::try_from) {
            for link in self.enter_links.drain(..) {
                let _ = program.detach(link);
            }
        }
        if let Some(Ok(program)) = self.ebpf.program_mut(EXIT).map(<&mut UProbe>::try_from) {
            for link in self.exit_links.drain(..) {
                let _ = program.detach(link);
            }
        }
    }

    /// Sums the per-CPU kernel counters.
    pub fn counters(&self) -> BTreeMap<String, u64> {
        Counter::ALL
            .iter()
            .map(|&counter| {
                let value = self
                    .counters
                    .get(&(counter as u32), 0)
                    .map(|values| values.iter().sum())
                    .unwrap_or(0);
                (counter_name(counter).to_string(), value)
            })
            .collect()
    }

    /// The return addresses of a stack id, innermost first.
    pub fn stack(&self, id: u32) -> Option<Vec<u64>> {
        let trace = self.stacks.get(&id, 0).ok()?;
        Some(trace.frames().iter().map(|frame| frame.ip).collect())
    }
}

/// Turns a load error into a clear failure (privilege problems and missing
/// kernel features get their own, see [`kernel_support::load_failure`]).
fn load_failure(err: &(dyn std::error::Error + 'static)) -> anyhow::Error {
    kernel_support::load_failure(err).into()
}
