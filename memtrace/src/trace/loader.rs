//! Loading the embedded eBPF object with its load-time settings, attaching
//! the two generic programs per planned function and traced process (with the
//! spec index as attach cookie, each link scoped to one process, never
//! system-wide), the fork reporter for `--follow-forks`, and detaching in a
//! safe order.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::path::PathBuf;

use anyhow::Context;
use aya::maps::{Array, HashMap, MapData, PerCpuArray, RingBuf, StackTraceMap};
use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeLinkId, UProbeScope};
use aya::programs::{RawTracePoint, UProbe};
use aya::{Ebpf, EbpfLoader};
use memtrace_common::{Counter, ProbeSpec, PyProc, PyStack, MAX_SPECS};

use crate::error::Failure;
use crate::probe::plan::LibraryPlan;
use crate::probe::SpecEntry;
use crate::trace::kernel_support;

/// The eBPF object built by `cargo xtask build-ebpf`, embedded at build time.
static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/memtrace.bpf.o"));

const ENTER: &str = "call_enter";
const EXIT: &str = "call_exit";
const FORKS: &str = "task_new";

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

/// Where one probed function is attached: enough to attach it again for
/// another process.
#[derive(Clone, Debug)]
struct AttachedFunction {
    path: PathBuf,
    entry_offset: u64,
    /// File offset of the function when it has a return probe.
    return_offset: Option<u64>,
    index: u16,
}

/// The links of one traced process.
#[derive(Default)]
struct ProcessLinks {
    enter: Vec<UProbeLinkId>,
    exit: Vec<UProbeLinkId>,
}

/// The loaded programs and the maps the event loop reads.
pub struct Probes {
    ebpf: Ebpf,
    specs: Vec<SpecEntry>,
    spec_map: Array<MapData, ProbeSpec>,
    functions: Vec<AttachedFunction>,
    processes: BTreeMap<u32, ProcessLinks>,
    /// Functions that could not be attached while others of their object
    /// were: their calls are missing from the live table.
    pub attach_failures: Vec<String>,
    /// Processes whose forks the kernel reports (`--follow-forks`).
    traced: Option<HashMap<MapData, u32, u8>>,
    pub events: Option<RingBuf<MapData>>,
    stacks: StackTraceMap<MapData>,
    counters: PerCpuArray<MapData, u64>,
    /// CPython processes' reading recipes, by tgid (`interp::python`).
    py_procs: HashMap<MapData, u32, PyProc>,
    py_stacks: HashMap<MapData, u32, PyStack>,
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
        Counter::PyNoThreadState => "py_no_thread_state",
        Counter::PyReadFault => "py_read_fault",
        Counter::PyTruncated => "py_truncated",
        Counter::PyStackMapFull => "py_stack_map_full",
        Counter::PyHashCollision => "py_hash_collision",
    }
}

impl Probes {
    /// Loads the programs and maps into the kernel; `pid` is the first
    /// process to trace.
    pub fn load(pid: u32, options: &LoadOptions) -> anyhow::Result<Self> {
        if EBPF_OBJECT.is_empty() {
            return Err(Failure::runtime(
                "this memtrace was built without its eBPF object: run `cargo xtask build-ebpf`, then rebuild",
            )
            .into());
        }
        if pid == 0 {
            return Err(Failure::usage("pid 0 is not a process").into());
        }
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
        let py_procs =
            HashMap::try_from(ebpf.take_map("PY_PROCS").context("map PY_PROCS missing")?)?;
        let py_stacks = HashMap::try_from(
            ebpf.take_map("PY_STACKS")
                .context("map PY_STACKS missing")?,
        )?;
        Ok(Probes {
            ebpf,
            specs: Vec::new(),
            spec_map,
            functions: Vec::new(),
            processes: BTreeMap::from([(pid, ProcessLinks::default())]),
            attach_failures: Vec::new(),
            traced: None,
            events: Some(events),
            stacks,
            counters,
            py_procs,
            py_stacks,
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
            match self.attach_function(&plan.open_path, &plan.path, &probe) {
                Ok(()) => {
                    attached += 1;
                    kept.push(probe);
                }
                Err(err) => {
                    unsupported = unsupported.or(kernel_support::unsupported_in(&err).cloned());
                    let why = match kernel_support::attach_conflict(&err) {
                        Some(conflict) => format!("{err:#}: {conflict}"),
                        None => format!("{err:#}"),
                    };
                    failures.push(format!("{}: {why}", probe.function));
                }
            }
        }
        plan.functions = kept;
        if let (0, Some(unsupported)) = (attached, unsupported) {
            // The kernel lacks a feature: every function failed alike.
            return Err(unsupported.into());
        }
        if attached > 0 {
            // Some functions of this object are traced and these are not: the
            // trace goes on, said loudly, and the report is marked incomplete.
            for failure in &failures {
                let line = format!("cannot attach {failure} in {}", plan.path.display());
                eprintln!("memtrace: warning: {line}");
                self.attach_failures.push(line);
            }
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
        module: &std::path::Path,
        probe: &crate::probe::plan::PlannedProbe,
    ) -> anyhow::Result<()> {
        let index = u16::try_from(self.specs.len())
            .ok()
            .filter(|&i| u32::from(i) < MAX_SPECS)
            .ok_or_else(|| Failure::runtime("too many probed functions"))?;
        self.spec_map
            .set(u32::from(index), probe.def.spec(index), 0)?;
        let function = AttachedFunction {
            path: path.to_path_buf(),
            entry_offset: probe.file_offset + probe.probe_offset,
            return_offset: probe.def.needs_return_probe().then_some(probe.file_offset),
            index,
        };
        // A process may have exited meanwhile: the function counts as attached
        // when it is attached for at least one process.
        let pids: Vec<u32> = self.processes.keys().copied().collect();
        let mut first_error = None;
        let mut attached = 0;
        for pid in pids {
            match self.attach_for(&function, pid) {
                Ok(()) => attached += 1,
                Err(err) => {
                    first_error.get_or_insert(err);
                }
            }
        }
        if let (0, Some(err)) = (attached, first_error) {
            return Err(err);
        }
        self.specs.push(SpecEntry {
            // Bounded: at most MAX_SPECS specs a session.
            module: Some(Box::leak(module.display().to_string().into_boxed_str())),
            ..SpecEntry::from(probe.def)
        });
        self.functions.push(function);
        log::info!(
            "attached {} in {} at {:#x} {}",
            probe.function,
            path.display(),
            probe.file_offset,
            probe.placement
        );
        Ok(())
    }

    /// Attaches one function's probes for one process.
    fn attach_for(&mut self, function: &AttachedFunction, pid: u32) -> anyhow::Result<()> {
        let pid_nz =
            NonZeroU32::new(pid).ok_or_else(|| Failure::usage("pid 0 is not a process"))?;
        let scope = UProbeScope::OneProcess(pid_nz);
        let cookie = Some(u64::from(function.index));
        // The return probe goes first: an entry whose return probe is not yet
        // attached would leave a stale in-flight record behind.
        if let Some(offset) = function.return_offset {
            let program: &mut UProbe = self
                .ebpf
                .program_mut(EXIT)
                .context("call_exit missing")?
                .try_into()?;
            let point = UProbeAttachPoint {
                location: UProbeAttachLocation::AbsoluteOffset(offset),
                cookie,
            };
            let link = program
                .attach(point, &function.path, scope)
                .map_err(|err| kernel_support::attach_error(err, "uretprobe"))?;
            self.processes.entry(pid).or_default().exit.push(link);
        }
        let program: &mut UProbe = self
            .ebpf
            .program_mut(ENTER)
            .context("call_enter missing")?
            .try_into()?;
        let point = UProbeAttachPoint {
            location: UProbeAttachLocation::AbsoluteOffset(function.entry_offset),
            cookie,
        };
        match program.attach(point, &function.path, scope) {
            Ok(link) => {
                self.processes.entry(pid).or_default().enter.push(link);
                Ok(())
            }
            Err(err) => {
                // No half-attached function: its return probe alone would
                // only produce unpaired returns.
                if function.return_offset.is_some() {
                    let orphan = self.processes.get_mut(&pid).and_then(|l| l.exit.pop());
                    if let Some(orphan) = orphan {
                        self.detach_links(ProcessLinks {
                            enter: Vec::new(),
                            exit: vec![orphan],
                        });
                    }
                }
                Err(kernel_support::attach_error(err, "uprobe"))
            }
        }
    }

    /// Loads and attaches the fork reporter and reports the forks of the
    /// processes traced so far (and of each one added later). It runs on every
    /// task creation on the machine but only looks up the creator in a hash
    /// map: nothing per allocation.
    pub fn watch_forks(&mut self) -> anyhow::Result<()> {
        let map = self.ebpf.take_map("TRACED").context("map TRACED missing")?;
        let mut traced: HashMap<MapData, u32, u8> = HashMap::try_from(map)?;
        for &pid in self.processes.keys() {
            traced.insert(pid, 1, 0)?;
        }
        self.traced = Some(traced);
        let program: &mut RawTracePoint = self
            .ebpf
            .program_mut(FORKS)
            .with_context(|| format!("program {FORKS} missing from the eBPF object"))?
            .try_into()?;
        program.load().map_err(|err| load_failure(&err))?;
        program
            .attach("task_newtask")
            .context("cannot attach to the task_newtask tracepoint")?;
        Ok(())
    }

    /// Starts tracing one more process (a child of a traced one): attaches
    /// every function probed so far, scoped to it. Returns how many functions
    /// were attached; the first failure is returned when none could be.
    pub fn add_process(&mut self, pid: u32) -> anyhow::Result<usize> {
        if self.processes.contains_key(&pid) {
            return Ok(0);
        }
        self.processes.insert(pid, ProcessLinks::default());
        if let Some(traced) = self.traced.as_mut() {
            traced.insert(pid, 1, 0)?;
        }
        let functions = self.functions.clone();
        let mut attached = 0;
        let mut first_error = None;
        for function in &functions {
            match self.attach_for(function, pid) {
                Ok(()) => attached += 1,
                Err(err) => {
                    log::debug!(
                        "pid {pid}: cannot attach {}: {err:#}",
                        function.path.display()
                    );
                    first_error.get_or_insert(err);
                }
            }
        }
        match first_error {
            Some(err) if attached == 0 => {
                self.remove_process(pid);
                Err(err)
            }
            _ => Ok(attached),
        }
    }

    /// Stops tracing a process (it exited): detaches its probes, entries first.
    pub fn remove_process(&mut self, pid: u32) {
        if let Some(links) = self.processes.remove(&pid) {
            self.detach_links(links);
        }
        if let Some(traced) = self.traced.as_mut() {
            let _ = traced.remove(&pid);
        }
    }

    /// Detaches every probe, entry probes first, then return probes, so no
    /// call is left half-recorded.
    pub fn detach(&mut self) {
        let all: Vec<ProcessLinks> = std::mem::take(&mut self.processes).into_values().collect();
        let mut merged = ProcessLinks::default();
        for links in all {
            merged.enter.extend(links.enter);
            merged.exit.extend(links.exit);
        }
        self.detach_links(merged);
    }

    fn detach_links(&mut self, links: ProcessLinks) {
        if let Some(Ok(program)) = self.ebpf.program_mut(ENTER).map(<&mut UProbe>::try_from) {
            for link in links.enter {
                let _ = program.detach(link);
            }
        }
        if let Some(Ok(program)) = self.ebpf.program_mut(EXIT).map(<&mut UProbe>::try_from) {
            for link in links.exit {
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

    /// Lets the kernel read the Python frames of process `pid`.
    pub fn set_python(&mut self, pid: u32, config: &PyProc) -> anyhow::Result<()> {
        self.py_procs
            .insert(pid, config, 0)
            .with_context(|| format!("cannot configure the Python frame reader for pid {pid}"))
    }

    /// Stops reading the Python frames of `pid` (it exited or exec'd).
    pub fn clear_python(&mut self, pid: u32) {
        let _ = self.py_procs.remove(&pid);
    }

    /// The Python stack stored under `id`.
    pub fn python_stack(&self, id: u32) -> Option<PyStack> {
        self.py_stacks.get(&id, 0).ok()
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
