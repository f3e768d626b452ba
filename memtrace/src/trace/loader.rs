//! Loading the embedded eBPF object the kernel can take (full or compat, see
//! `kernel::variant`) with its load-time settings, attaching the two generic
//! programs per planned function and traced process (with the spec index as
//! attach cookie, or published by address for the compat object; each link
//! scoped to one process, never system-wide: one uprobe perf event per probe,
//! or where the kernel has them `uprobe_multi` links per object, see `multi`),
//! the fork reporter for
//! `--follow-forks`, closing the trace's window in one step (every program
//! returns at once) and detaching: after a closed window all at once, else
//! in a safe order — allocation entry probes first, then reallocation, then
//! release entry probes, then return probes (see [`DetachStage`]), so no
//! block is reported live because its release was no longer watched.
//!
//! Over 800 lines: the loader's state (links, maps, the held table, the
//! compat address table) and the load-test entry points `memtrace doctor`
//! shares are one `Probes`; its seams are attach, detach and load.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::path::PathBuf;

use super::held::HeldTable;
use crate::unwind::kernel::UnwindTables;
use anyhow::Context;
use aya::maps::{Array, HashMap, MapData, PerCpuArray, ProgramArray, RingBuf, StackTraceMap};
use aya::programs::uprobe::{
    UProbeAttachLocation, UProbeAttachPoint, UProbeLink, UProbeLinkId, UProbeScope,
};
use aya::programs::{RawTracePoint, UProbe};
use aya::{Ebpf, EbpfLoader};
use memtrace_common::unwind::{DwarfStack, MAX_FRAMES, STACK_MODE_DWARF};
use memtrace_common::{Counter, ProbeSpec, PyProc, PyStack, MAX_SPECS};

use crate::error::Failure;
use crate::kernel::uprobe_multi::MultiLink;
use crate::kernel::variant::{Choice, Variant};
use crate::probe::plan::LibraryPlan;
use crate::probe::SpecEntry;
use crate::trace::kernel_support;
use crate::trace::usdt_attach::UsdtLink;

mod multi;
mod usdt;

pub use multi::AttachMode;

/// The eBPF object built by `cargo xtask build-ebpf`, embedded at build time.
static EBPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/memtrace.bpf.o"));
/// The object for kernels with attach cookies and BPF atomics with fetch
/// but no `bpf_loop` (see `kernel::variant`).
static EBPF_OBJECT_TAILCALL: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/memtrace-tailcall.bpf.o"));
/// The object for kernels without attach cookies or BPF atomics with fetch
/// (see `kernel::variant`).
static EBPF_OBJECT_COMPAT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/memtrace-compat.bpf.o"));

const ENTER: &str = "call_enter";
const EXIT: &str = "call_exit";
const FORKS: &str = "task_new";
/// The exec reporter (see [`Probes::watch_forks`]).
const EXECS: &str = "task_exec";
/// The program of every USDT probe (`memtrace-ebpf/src/usdt.rs`).
const USDT: &str = "usdt_fire";
/// The tail-called programs of the `tailcall` and `compat` objects, at
/// their index in `TAIL_PROGS` (`memtrace-ebpf/src/tail.rs`).
pub const TAIL_PROGRAMS: [&str; 2] = ["tail_walk", "tail_python"];

/// Load-time settings of the eBPF programs.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    /// `STACK_MODE_NONE`, `STACK_MODE_FP` or `STACK_MODE_DWARF`.
    pub stack_mode: u32,
    /// Frames per stack (DWARF mode).
    pub stack_depth: u32,
    /// Sizes of the DWARF unwinder's maps.
    pub unwind: crate::unwind::kernel::Capacity,
    pub sample_rate: u32,
    pub min_size: u64,
    pub max_size: u64,
    /// Empty programs (the probe-cost floor for benchmarks).
    pub null_mode: bool,
    pub ring_bytes: u32,
    pub stack_entries: u32,
    pub wakeup_bytes: u64,
    /// Let the kernel hold each thread's newest heap allocation and settle
    /// it there when it is released first (`--no-settle` turns this off).
    pub settle_in_kernel: bool,
    /// Perf events or `uprobe_multi` links (hidden `--attach`).
    pub attach: AttachMode,
    /// Keep each thread's in-flight calls in its task-local storage (set
    /// from the chosen variant, see [`variant_options`]).
    pub thread_storage: bool,
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
    /// When its entry probe is detached at the end of a trace.
    stage: DetachStage,
}

/// The order in which entry probes are detached when a trace ends. Releases
/// were attached before allocations (so nothing allocated in the attach gap
/// looks leaked); they are detached after them, for the same reason: while
/// allocations are still seen, their releases must be too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum DetachStage {
    /// Functions that only create blocks (`malloc`, `mmap`, `cudaMalloc` ...).
    Allocations,
    /// Functions that release one block and create another (`realloc`).
    Reallocations,
    /// Functions that only release (`free`, `munmap` ...).
    Releases,
}

impl DetachStage {
    /// Every stage, in detach order.
    pub const ORDER: [DetachStage; 3] = [
        DetachStage::Allocations,
        DetachStage::Reallocations,
        DetachStage::Releases,
    ];

    pub fn of(kind: memtrace_common::SpecKind) -> DetachStage {
        use memtrace_common::SpecKind;
        match kind {
            SpecKind::Alloc => DetachStage::Allocations,
            SpecKind::Realloc => DetachStage::Reallocations,
            SpecKind::Free => DetachStage::Releases,
        }
    }
}

/// The links of one traced process.
#[derive(Default)]
struct ProcessLinks {
    enter: Vec<(DetachStage, UProbeLinkId)>,
    exit: Vec<UProbeLinkId>,
    /// USDT sites' events (see `usdt`), closed with the entry probes of their stage.
    usdt: Vec<(DetachStage, UsdtLink)>,
    /// `uprobe_multi` links of entry probes, one per (object, stage) (see `multi`).
    enter_multi: Vec<(DetachStage, MultiLink)>,
    /// `uprobe_multi` links of return probes, one per object.
    exit_multi: Vec<MultiLink>,
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
    dwarf_stacks: HashMap<MapData, u32, DwarfStack>,
    /// The DWARF unwinder's tables (`None` in frame-pointer or no-stack mode).
    pub unwind: Option<UnwindTables>,
    counters: PerCpuArray<MapData, u64>,
    /// CPython processes' reading recipes, by tgid (`interp::python`).
    py_procs: HashMap<MapData, u32, PyProc>,
    py_stacks: HashMap<MapData, u32, PyStack>,
    /// Flags user space sets for the programs (`CONTROL_*`).
    control: Array<MapData, u32>,
    /// The processes with a Python frame reader.
    python_pids: std::collections::BTreeSet<u32>,
    /// The kernel's held allocations, mapped (`None`: none are held).
    held: Option<HeldTable>,
    /// The settings it was loaded with (for a later program's load failure).
    options: LoadOptions,
    /// The build of the programs this kernel got, and why.
    variant: Choice,
    /// With the compat object: each probed address's spec, per process.
    spec_by_addr: Option<HashMap<MapData, AddrKey, u32>>,
    /// USDT sites and their per-process events.
    usdt: usdt::UsdtSites,
    /// The `tailcall` and `compat` objects' program array, filled: the
    /// kernel empties it when its last user-space reference closes.
    _tail_programs: Option<ProgramArray<MapData>>,
    /// Probes are attached through `uprobe_multi` links (the programs were
    /// loaded for them), not perf events.
    multi: bool,
}

/// A probed address in a process (the compat object's `SPEC_BY_ADDR` key).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AddrKey {
    tgid: u32,
    _pad: u32,
    addr: u64,
}

// SAFETY: a plain `#[repr(C)]` struct of integers without padding bytes.
unsafe impl aya::Pod for AddrKey {}

/// Index in `CONTROL`: 1 once the trace is ending.
const CONTROL_ENDING: u32 = 0;
/// Index in `CONTROL`: how many processes have a Python frame reader.
const CONTROL_PYTHON: u32 = 1;
/// Index in `CONTROL`: 1 while the kernel may hold allocations (user space
/// has the held table mapped).
const CONTROL_HOLD: u32 = 2;
/// Index in `CONTROL`: 1 once the trace's window has closed (every program
/// returns at once).
const CONTROL_CLOSED: u32 = 3;

/// Maps the held table and lets the kernel hold allocations; `None` (and
/// every allocation sent at once) when the table cannot be mapped.
fn map_held(ebpf: &Ebpf, control: &mut Array<MapData, u32>) -> Option<HeldTable> {
    let fd = |name: &str| match ebpf.map(name) {
        Some(aya::maps::Map::Array(data)) => Some(std::os::fd::AsFd::as_fd(data.fd())),
        _ => None,
    };
    let (Some(slots), Some(index)) = (fd("HELD"), fd("HELD_INDEX")) else {
        log::warn!("the held-allocation maps are missing: every event is sent");
        return None;
    };
    match HeldTable::map(slots, index) {
        Ok(table) => match control.set(CONTROL_HOLD, 1, 0) {
            Ok(()) => Some(table),
            Err(err) => {
                log::warn!("cannot enable held allocations: {err}");
                None
            }
        },
        Err(err) => {
            log::warn!("cannot map the held-allocation table ({err}): every event is sent");
            None
        }
    }
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
        Counter::UnwindDepth => "stack_truncated_depth",
        Counter::UnwindReadFault => "stack_truncated_fault",
        Counter::UnwindNoTable => "stack_truncated_no_table",
        Counter::UnwindBadRule => "stack_truncated_bad_rule",
        Counter::UnwindTableCap => "stack_truncated_table_cap",
        Counter::UnwindNoMappings => "stack_no_mappings",
        Counter::UnwindNewStack => "dwarf_stacks",
        Counter::PyNoThreadState => "py_no_thread_state",
        Counter::PyReadFault => "py_read_fault",
        Counter::PyTruncated => "py_truncated",
        Counter::PyStackMapFull => "py_stack_map_full",
        Counter::PyHashCollision => "py_hash_collision",
        Counter::InFlightSpilled => "in_flight_spilled",
        Counter::SettledInKernel => "settled_in_kernel",
        Counter::SettledSeenTwice => "settled_seen_twice",
        Counter::StacksReplayed => "stacks_replayed",
        Counter::WalkNotStarted => "walk_not_started",
        Counter::UnwindTablePending => "stack_truncated_table_pending",
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
        let variant = crate::kernel::variant::choose(true);
        let options = &variant_options(&variant, options);
        let unwind_capacity = unwind_capacity(options);
        let multi = multi::resolve(options.attach, &variant)?;
        let mut ebpf = open(options, variant.variant).map_err(|err| load_failure(&err))?;
        let tail_programs = if variant.variant.tail_calls() {
            Some(load_tail_programs(&mut ebpf, options)?)
        } else {
            None
        };
        for name in [ENTER, EXIT] {
            let program: &mut UProbe = ebpf
                .program_mut(name)
                .with_context(|| format!("program {name} missing from the eBPF object"))?
                .try_into()?;
            let loaded = if multi {
                program.load_for_uprobe_multi()
            } else {
                program.load()
            };
            loaded.map_err(|err| program_load_failure(name, options, &err))?;
            if let Some(insns) = program
                .info()
                .ok()
                .and_then(|info| info.verified_instruction_count())
            {
                // The verifier's budget is 1M per program: the margin left.
                log::debug!("program {name}: the verifier processed {insns} instructions");
            }
        }
        let spec_map = Array::try_from(ebpf.take_map("SPECS").context("map SPECS missing")?)?;
        let events = RingBuf::try_from(ebpf.take_map("EVENTS").context("map EVENTS missing")?)?;
        let stacks =
            StackTraceMap::try_from(ebpf.take_map("STACKS").context("map STACKS missing")?)?;
        let counters =
            PerCpuArray::try_from(ebpf.take_map("COUNTERS").context("map COUNTERS missing")?)?;
        let dwarf_stacks = HashMap::try_from(
            ebpf.take_map("DWARF_STACKS")
                .context("map DWARF_STACKS missing")?,
        )?;
        let unwind = if options.stack_mode == STACK_MODE_DWARF {
            Some(UnwindTables::take(&mut ebpf, unwind_capacity)?)
        } else {
            None
        };
        let py_procs =
            HashMap::try_from(ebpf.take_map("PY_PROCS").context("map PY_PROCS missing")?)?;
        let py_stacks = HashMap::try_from(
            ebpf.take_map("PY_STACKS")
                .context("map PY_STACKS missing")?,
        )?;
        let mut control =
            Array::try_from(ebpf.take_map("CONTROL").context("map CONTROL missing")?)?;
        let held = if options.settle_in_kernel && !options.null_mode {
            map_held(&ebpf, &mut control)
        } else {
            None
        };
        let spec_by_addr = if variant.variant.has_cookies() {
            None
        } else {
            Some(HashMap::try_from(
                ebpf.take_map("SPEC_BY_ADDR")
                    .context("map SPEC_BY_ADDR missing")?,
            )?)
        };
        Ok(Probes {
            options: *options,
            variant,
            _tail_programs: tail_programs,
            spec_by_addr,
            held,
            control,
            python_pids: std::collections::BTreeSet::new(),
            dwarf_stacks,
            unwind,
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
            usdt: usdt::UsdtSites::default(),
            multi,
        })
    }

    /// The kernel's held allocations, when it holds any.
    pub fn held(&self) -> Option<&HeldTable> {
        self.held.as_ref()
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
        let outcomes: Vec<_> = if self.multi {
            let probes: Vec<_> = plan.functions.drain(..).collect();
            let outcomes = self.attach_functions_multi(&plan.open_path, &plan.path, &probes);
            probes.into_iter().zip(outcomes).collect()
        } else {
            let probes: Vec<_> = plan.functions.drain(..).collect();
            probes
                .into_iter()
                .map(|probe| {
                    let outcome = self.attach_function(&plan.open_path, &plan.path, &probe);
                    (probe, outcome)
                })
                .collect()
        };
        for (probe, outcome) in outcomes {
            match outcome {
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
        self.spec_map.set(u32::from(index), probe.spec(index), 0)?;
        let function = AttachedFunction {
            path: path.to_path_buf(),
            entry_offset: probe.file_offset + probe.probe_offset,
            return_offset: probe.return_offset(),
            index,
            stage: DetachStage::of(probe.def.kind),
        };
        self.in_every_process(|probes, pid| probes.attach_for(&function, pid))?;
        self.specs.push(SpecEntry {
            // Bounded: at most MAX_SPECS specs a session.
            module: Some(Box::leak(module.display().to_string().into_boxed_str())),
            allocator: probe.allocator,
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

    /// Gives `probe` the next spec index and publishes its spec (the
    /// `uprobe_multi` path registers a whole object's specs before its links).
    fn register_spec(
        &mut self,
        module: &std::path::Path,
        probe: &crate::probe::plan::PlannedProbe,
    ) -> anyhow::Result<u16> {
        let index = u16::try_from(self.specs.len())
            .ok()
            .filter(|&i| u32::from(i) < MAX_SPECS)
            .ok_or_else(|| Failure::runtime("too many probed functions"))?;
        self.spec_map.set(u32::from(index), probe.spec(index), 0)?;
        self.specs.push(SpecEntry {
            // Bounded: at most MAX_SPECS specs a session.
            module: Some(Box::leak(module.display().to_string().into_boxed_str())),
            allocator: probe.allocator,
            ..SpecEntry::from(probe.def)
        });
        Ok(index)
    }

    /// Runs `attach` for every traced process. A process may have exited
    /// meanwhile: it is enough that `attach` works for one of them; when it
    /// works for none, the first error is the answer.
    fn in_every_process(
        &mut self,
        mut attach: impl FnMut(&mut Self, u32) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let pids: Vec<u32> = self.processes.keys().copied().collect();
        let mut first_error = None;
        let mut attached = 0;
        for pid in pids {
            match attach(self, pid) {
                Ok(()) => attached += 1,
                Err(err) => {
                    first_error.get_or_insert(err);
                }
            }
        }
        match (attached, first_error) {
            (0, Some(err)) => Err(err),
            _ => Ok(()),
        }
    }

    /// Attaches one function's probes for one process.
    fn attach_for(&mut self, function: &AttachedFunction, pid: u32) -> anyhow::Result<()> {
        let pid_nz =
            NonZeroU32::new(pid).ok_or_else(|| Failure::usage("pid 0 is not a process"))?;
        let scope = UProbeScope::OneProcess(pid_nz);
        // The compat object finds the spec by the probed address instead
        // (kernels before 5.15 have no attach cookies).
        let cookie = if self.variant.variant.has_cookies() {
            Some(u64::from(function.index))
        } else {
            if let Ok(mappings) = crate::probe::maps::read(pid) {
                self.publish_spec_addr(pid, function, &mappings);
            }
            None
        };
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
                self.processes
                    .entry(pid)
                    .or_default()
                    .enter
                    .push((function.stage, link));
                Ok(())
            }
            Err(err) => {
                // No half-attached function: its return probe alone would
                // only produce unpaired returns.
                if function.return_offset.is_some() {
                    let orphan = self.processes.get_mut(&pid).and_then(|l| l.exit.pop());
                    if let Some(orphan) = orphan {
                        self.take_links(ProcessLinks {
                            exit: vec![orphan],
                            ..ProcessLinks::default()
                        })
                        .close();
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
        self.attach_tracepoint(FORKS, "task_newtask")
    }

    /// Loads and attaches the exec reporter: an exec of a traced process
    /// (as `TRACED` names them: [`Probes::watch_forks`] first) becomes an
    /// event in the stream, after every event of the old image, so the
    /// table drops that image's blocks exactly there. Runs on every exec
    /// on the machine, a hash lookup each.
    pub fn watch_execs(&mut self) -> anyhow::Result<()> {
        if self.traced.is_none() {
            anyhow::bail!("the traced processes' map is not set up");
        }
        self.attach_tracepoint(EXECS, "sched_process_exec")
    }

    /// Loads raw tracepoint program `name` and attaches it to `tracepoint`.
    fn attach_tracepoint(&mut self, name: &str, tracepoint: &str) -> anyhow::Result<()> {
        let program: &mut RawTracePoint = self
            .ebpf
            .program_mut(name)
            .with_context(|| format!("program {name} missing from the eBPF object"))?
            .try_into()?;
        program
            .load()
            .map_err(|err| program_load_failure(name, &self.options, &err))?;
        program
            .attach(tracepoint)
            .with_context(|| format!("cannot attach to the {tracepoint} tracepoint"))?;
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
        if let Ok(mappings) = crate::probe::maps::read(pid) {
            self.update_unwind(pid, &mappings);
        }
        if let Some(traced) = self.traced.as_mut() {
            traced.insert(pid, 1, 0)?;
        }
        let functions = self.functions.clone();
        let mut attached = 0;
        let mut first_error = None;
        let outcomes: Vec<_> = if self.multi {
            self.attach_multi_for(&functions, pid)
        } else {
            functions
                .iter()
                .map(|function| self.attach_for(function, pid))
                .collect()
        };
        for (function, outcome) in functions.iter().zip(outcomes) {
            match outcome {
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
        let (usdt_attached, usdt_error) = self.usdt_add_process(pid);
        attached += usdt_attached;
        let first_error = first_error.or(usdt_error);
        match first_error {
            Some(err) if attached == 0 => {
                self.remove_process(pid);
                Err(err)
            }
            _ => Ok(attached),
        }
    }

    /// Loads the unwind tables built while tracing runs that are done since
    /// the last call (see [`UnwindTables::defer_builds`]); says so on stderr
    /// when the last one is in.
    pub fn take_unwind_ready(&mut self) {
        if let Some((built, ms)) = self.unwind.as_mut().and_then(|u| u.take_ready()) {
            eprintln!("memtrace: unwind tables ready: {built} built in {ms} ms while tracing");
            log::info!("attach phase: the last unwind table built while tracing in the kernel {ms} ms after it started");
        }
    }

    /// Tracing has started: the unwind tables set aside are built now.
    pub fn start_unwind_builds(&mut self) {
        if let Some(unwind) = self.unwind.as_mut() {
            unwind.start_builds();
        }
    }

    /// A stack of process `pid` ended at `addr`: if that is an object whose
    /// unwind table is still being built, it is built next.
    pub fn promote_unwind(&self, pid: u32, addr: u64) {
        if let Some(unwind) = self.unwind.as_ref() {
            unwind.promote(pid, addr);
        }
    }

    /// Objects whose unwind tables are being built while tracing runs.
    pub fn unwind_pending(&self) -> usize {
        self.unwind.as_ref().map_or(0, |u| u.pending_count())
    }

    /// Gives the DWARF unwinder process `pid`'s current executable mappings
    /// (building the tables of objects it has not seen); no-op in other modes.
    pub fn update_unwind(&mut self, pid: u32, mappings: &[crate::probe::maps::Mapping]) {
        if self.spec_by_addr.is_some() {
            // An exec or a new mapping moves the probed addresses.
            for function in self.functions.clone() {
                self.publish_spec_addr(pid, &function, mappings);
            }
            self.usdt_publish(pid, mappings);
        }
        if let Some(unwind) = self.unwind.as_mut() {
            // A launched child shows memtrace's own image until it execs:
            // no table for that.
            let own = std::env::current_exe().ok();
            let mappings: Vec<_> = mappings
                .iter()
                .filter(|m| own.is_none() || m.path != own)
                .cloned()
                .collect();
            unwind.update_process(pid, &mappings, &|path| {
                crate::probe::maps::path_in_target_root(pid, path)
            });
        }
    }

    /// With the compat object: tells the kernel which spec the probe at
    /// `function`'s entry has in process `pid`, at the address its file is
    /// mapped at there (found by the file's inode and offset).
    fn publish_spec_addr(
        &mut self,
        pid: u32,
        function: &AttachedFunction,
        mappings: &[crate::probe::maps::Mapping],
    ) {
        let Some(map) = self.spec_by_addr.as_mut() else {
            return;
        };
        let Ok(meta) = std::fs::metadata(&function.path) else {
            return;
        };
        let inode = std::os::unix::fs::MetadataExt::ino(&meta);
        let offset = function.entry_offset;
        let Some(addr) = mappings.iter().find_map(|m| {
            let len = m.end - m.start;
            (m.inode == inode
                && m.executable
                && offset >= m.file_offset
                && offset - m.file_offset < len)
                .then(|| m.start + (offset - m.file_offset))
        }) else {
            return;
        };
        let key = AddrKey {
            tgid: pid,
            _pad: 0,
            addr,
        };
        if let Err(err) = map.insert(key, u32::from(function.index), 0) {
            log::warn!("pid {pid}: cannot publish the probe at {addr:#x}: {err}");
        }
    }

    /// The build of the eBPF programs this kernel got, and why.
    pub fn variant(&self) -> &Choice {
        &self.variant
    }

    /// How the probes are attached, as the report's `settings.attach` names
    /// it: `uprobe_multi` links or one `perf_event` per probe.
    pub fn attach_method(&self) -> &'static str {
        if self.multi {
            "uprobe_multi"
        } else {
            "perf_event"
        }
    }

    /// Stops tracing a process (it exited): detaches its probes, entries first.
    pub fn remove_process(&mut self, pid: u32) {
        if let Some(unwind) = self.unwind.as_mut() {
            unwind.remove_process(pid);
        }
        let usdt = self.usdt.take_process(pid);
        let mut links = self.processes.remove(&pid).unwrap_or_default();
        links.usdt = usdt;
        self.take_links(links).close();
        if let Some(traced) = self.traced.as_mut() {
            let _ = traced.remove(&pid);
        }
    }

    /// Takes the entry probes of one stage in every traced process, for
    /// [`Detaching::close`]: the first step of ending a trace (see
    /// [`DetachStage`]); [`Probes::detach`] finishes it.
    pub fn detach_stage(&mut self, stage: DetachStage) -> Detaching {
        let mut links = ProcessLinks::default();
        for process in self.processes.values_mut() {
            let (now, later): (Vec<_>, Vec<_>) =
                process.enter.drain(..).partition(|(s, _)| *s == stage);
            process.enter = later;
            links.enter.extend(now);
            let (now, later): (Vec<_>, Vec<_>) = process
                .enter_multi
                .drain(..)
                .partition(|(s, _)| *s == stage);
            process.enter_multi = later;
            links.enter_multi.extend(now);
        }
        links.usdt = self.usdt.take_stage(stage);
        self.take_links(links)
    }

    /// Takes every probe left, for [`Detaching::close`]: entry probes stage
    /// by stage, then return probes, so no call is left half-recorded.
    pub fn detach(&mut self) -> Detaching {
        let all: Vec<ProcessLinks> = std::mem::take(&mut self.processes).into_values().collect();
        let mut merged = ProcessLinks::default();
        for links in all {
            merged.enter.extend(links.enter);
            merged.exit.extend(links.exit);
            merged.enter_multi.extend(links.enter_multi);
            merged.exit_multi.extend(links.exit_multi);
        }
        merged.usdt = self.usdt.take_all();
        self.take_links(merged)
    }

    /// Takes `links` out of the programs: entry probes in [`DetachStage`]
    /// order, then return probes.
    fn take_links(&mut self, mut links: ProcessLinks) -> Detaching {
        links.enter.sort_by_key(|(stage, _)| *stage);
        let mut entries: Vec<(DetachStage, Link)> = links
            .usdt
            .into_iter()
            .map(|(stage, link)| (stage, Link::Usdt(link)))
            .chain(
                links
                    .enter_multi
                    .into_iter()
                    .map(|(stage, link)| (stage, Link::Multi(link))),
            )
            .collect();
        if let Some(Ok(program)) = self.ebpf.program_mut(ENTER).map(<&mut UProbe>::try_from) {
            for (stage, id) in links.enter {
                if let Ok(link) = program.take_link(id) {
                    entries.push((stage, Link::Uprobe(link)));
                }
            }
        }
        let mut batches = Vec::new();
        for stage in DetachStage::ORDER {
            let (now, later): (Vec<_>, Vec<_>) =
                entries.into_iter().partition(|(s, _)| *s == stage);
            entries = later;
            batches.push(now.into_iter().map(|(_, link)| link).collect());
        }
        batches.push(entries.into_iter().map(|(_, link)| link).collect());
        let mut exits: Vec<Link> = links.exit_multi.into_iter().map(Link::Multi).collect();
        if let Some(Ok(program)) = self.ebpf.program_mut(EXIT).map(<&mut UProbe>::try_from) {
            for id in links.exit {
                if let Ok(link) = program.take_link(id) {
                    exits.push(Link::Uprobe(link));
                }
            }
        }
        batches.push(exits);
        Detaching { batches }
    }

    /// Closes the trace's window in one step: from now on every program
    /// returns at once, so nothing after this moment changes the report,
    /// however long the probes take to detach. False when the flag could
    /// not be set (the caller then ends the trace the slow way).
    pub fn close_window(&mut self) -> bool {
        match self.control.set(CONTROL_CLOSED, 1, 0) {
            Ok(()) => true,
            Err(err) => {
                log::debug!("cannot close the trace's window: {err}");
                false
            }
        }
    }

    /// Tells the kernel programs the trace is ending: a return whose entry
    /// probe is already gone is then expected, not an unpaired return.
    pub fn mark_ending(&mut self) {
        if let Err(err) = self.control.set(CONTROL_ENDING, 1, 0) {
            log::debug!("cannot mark the trace as ending: {err}");
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

    /// How often each of memtrace's programs ran and the kernel time it took
    /// (counted only while the kernel's BPF statistics are on: `--bpf-stats`).
    pub fn program_costs(&self) -> Vec<crate::report::ProgramCost> {
        [ENTER, EXIT, USDT, FORKS]
            .into_iter()
            .filter_map(|name| {
                let info = self.ebpf.program(name)?.info().ok()?;
                let run_ns = u64::try_from(info.run_time().as_nanos()).unwrap_or(u64::MAX);
                Some(crate::report::ProgramCost::new(
                    name,
                    info.run_count(),
                    run_ns,
                ))
            })
            .collect()
    }

    /// Lets the kernel read the Python frames of process `pid`.
    pub fn set_python(&mut self, pid: u32, config: &PyProc) -> anyhow::Result<()> {
        self.py_procs
            .insert(pid, config, 0)
            .with_context(|| format!("cannot configure the Python frame reader for pid {pid}"))?;
        self.python_pids.insert(pid);
        self.publish_python_count();
        Ok(())
    }

    /// Stops reading the Python frames of `pid` (it exited or exec'd).
    pub fn clear_python(&mut self, pid: u32) {
        let _ = self.py_procs.remove(&pid);
        self.python_pids.remove(&pid);
        self.publish_python_count();
    }

    /// Tells the kernel how many processes have a Python reader: with none,
    /// allocations skip the reader's map look-up.
    fn publish_python_count(&mut self) {
        let count = u32::try_from(self.python_pids.len()).unwrap_or(u32::MAX);
        if let Err(err) = self.control.set(CONTROL_PYTHON, count, 0) {
            log::warn!("cannot enable the Python frame reader: {err}");
        }
    }

    /// The Python stack stored under `id`.
    pub fn python_stack(&self, id: u32) -> Option<PyStack> {
        self.py_stacks.get(&id, 0).ok()
    }

    /// The return addresses of a stack id, innermost first.
    pub fn stack(&self, id: u32) -> Option<Vec<u64>> {
        if self.unwind.is_some() {
            let stack = self.dwarf_stacks.get(&id, 0).ok()?;
            let len = (stack.len as usize).min(MAX_FRAMES);
            return Some(stack.pcs[..len].to_vec());
        }
        let trace = self.stacks.get(&id, 0).ok()?;
        Some(trace.frames().iter().map(|frame| frame.ip).collect())
    }
}

/// One probe to close: a uprobe link of aya's, a USDT site's event, or a
/// `uprobe_multi` link (many probes, closed at once).
enum Link {
    // Held only to be dropped (closed).
    Uprobe(#[allow(dead_code)] UProbeLink),
    Usdt(#[allow(dead_code)] UsdtLink),
    Multi(#[allow(dead_code)] MultiLink),
}

/// Probes taken out of their programs, still attached until [`Detaching::close`].
pub struct Detaching {
    /// Closed one batch after the other.
    batches: Vec<Vec<Link>>,
}

impl Detaching {
    /// Detaches the probes (slow: each close waits for an RCU grace period,
    /// so callers run it off the event loop and keep reading events).
    pub fn close(self) {
        let started = std::time::Instant::now();
        let count = self.count();
        for batch in self.batches {
            drop_concurrently(batch, STAGED_THREADS);
        }
        log::debug!("detached {count} in {:?}", started.elapsed());
    }

    /// What is being closed, for the log: perf events and links.
    fn count(&self) -> String {
        let all = self.batches.iter().flatten();
        let multi = all
            .clone()
            .filter(|l| matches!(l, Link::Multi(_) | Link::Usdt(UsdtLink::Multi(_))))
            .count();
        let other = all.count() - multi;
        format!("{other} perf-event probes and {multi} uprobe_multi links")
    }

    /// Detaches every probe at once, in no order: once the trace's window
    /// is closed no program records anything, so nothing depends on which
    /// probe goes first, and each close's grace period overlaps the others.
    pub fn close_at_once(self) {
        let started = std::time::Instant::now();
        let count = self.count();
        let all: Vec<_> = self.batches.into_iter().flatten().collect();
        drop_concurrently(all, AT_ONCE_THREADS);
        log::debug!("detached {count} in {:?}", started.elapsed());
    }
}

/// Threads a staged detach closes each stage's probes from.
const STAGED_THREADS: usize = 16;
/// Threads [`Detaching::close_at_once`] closes probes from.
const AT_ONCE_THREADS: usize = 128;

/// Drops (detaches) `links` from a few threads at once: closing a uprobe's
/// perf event waits for an RCU grace period in the kernel (a few hundred ms
/// in a VM), and waits in parallel overlap, so ending a trace of dozens of
/// probes takes one or two grace periods, not one per probe.
fn drop_concurrently<T: Send>(links: Vec<T>, threads: usize) {
    if links.len() <= 1 {
        return;
    }
    let mut groups: Vec<Vec<T>> = (0..threads.min(links.len())).map(|_| Vec::new()).collect();
    let count = groups.len();
    for (i, link) in links.into_iter().enumerate() {
        groups[i % count].push(link);
    }
    std::thread::scope(|scope| {
        for group in groups {
            scope.spawn(move || drop(group));
        }
    });
}

/// Turns a load error into a clear failure (privilege problems and missing
/// kernel features get their own, see [`kernel_support::load_failure`]).
fn load_failure(err: &(dyn std::error::Error + 'static)) -> anyhow::Error {
    kernel_support::load_failure(err).into()
}

/// The embedded eBPF object of `variant` (empty when built without it).
pub fn object(variant: Variant) -> &'static [u8] {
    object_of(variant)
}

/// The unwinder's map sizes: outside DWARF mode its big maps shrink to one element.
fn unwind_capacity(options: &LoadOptions) -> crate::unwind::kernel::Capacity {
    if options.stack_mode == STACK_MODE_DWARF {
        options.unwind
    } else {
        crate::unwind::kernel::Capacity::minimal()
    }
}

/// Creates the maps of the embedded object with `options`' load-time
/// settings; no program is loaded yet.
fn open(options: &LoadOptions, variant: Variant) -> Result<Ebpf, aya::EbpfError> {
    let depth = options.stack_depth.min(MAX_FRAMES as u32);
    let null_mode: u32 = options.null_mode.into();
    let unwind_capacity = unwind_capacity(options);
    let offsets = crate::btf::uprobe_offsets().unwrap_or_else(|| {
        log::warn!("no uprobe structures in the kernel's BTF: stacks through functions with return probes end there");
        crate::btf::UprobeOffsets::default()
    });
    let ra_mask = crate::kernel::pac::return_address_mask();
    let thread_storage: u32 = options.thread_storage.into();
    // Hashed in-flight slots are only used without per-thread storage.
    let in_flight_slots = if options.thread_storage {
        1
    } else {
        memtrace_common::IN_FLIGHT_SLOTS
    };
    EbpfLoader::new()
        // The task-local storage map (`THREADS`), which aya creates from its
        // BTF but has no type of its own for.
        .allow_unsupported_maps()
        .override_global("OFF_UTASK", &offsets.task_utask, true)
        .override_global(
            "OFF_RETURN_INSTANCES",
            &offsets.utask_return_instances,
            true,
        )
        .override_global("OFF_RI_STACK", &offsets.ri_stack, true)
        .override_global("OFF_RI_ORIG", &offsets.ri_orig_ret_vaddr, true)
        .override_global("OFF_RI_NEXT", &offsets.ri_next, true)
        .override_global("RA_MASK", &ra_mask, false)
        .override_global("STACK_MODE", &options.stack_mode, true)
        .override_global("MAX_DEPTH", &depth, true)
        .override_global("SAMPLE_RATE", &options.sample_rate, true)
        .override_global("MIN_SIZE", &options.min_size, true)
        .override_global("MAX_SIZE", &options.max_size, true)
        .override_global("NULL_MODE", &null_mode, true)
        .override_global("WAKEUP_BYTES", &options.wakeup_bytes, true)
        .override_global("THREAD_STORAGE", &thread_storage, false)
        .map_max_entries("EVENTS", options.ring_bytes)
        .map_max_entries("IN_FLIGHT", in_flight_slots)
        .map_max_entries("STACKS", options.stack_entries.max(1))
        .map_max_entries("DWARF_STACKS", options.stack_entries.max(1))
        .map_max_entries("UNWIND_ROWS", unwind_capacity.row_chunks)
        .map_max_entries("UNWIND_PAGES", unwind_capacity.page_chunks)
        .map_max_entries("UNWIND_RULES", unwind_capacity.rule_chunks)
        .map_max_entries("PROC_MAPS", unwind_capacity.processes)
        .map_max_entries("PROC_SLOTS", unwind_capacity.processes)
        .load(object_of(variant))
}

/// The embedded object of `variant`.
fn object_of(variant: Variant) -> &'static [u8] {
    match variant {
        Variant::Full => EBPF_OBJECT,
        Variant::TailCall => EBPF_OBJECT_TAILCALL,
        Variant::Compat => EBPF_OBJECT_COMPAT,
    }
}

/// Loads the tail-called programs of the `tailcall` and `compat` objects
/// and puts them in `TAIL_PROGS`, which is returned: it must stay open.
fn load_tail_programs(
    ebpf: &mut Ebpf,
    options: &LoadOptions,
) -> anyhow::Result<ProgramArray<MapData>> {
    let mut array = ProgramArray::try_from(
        ebpf.take_map("TAIL_PROGS")
            .context("map TAIL_PROGS missing from the eBPF object")?,
    )?;
    for (index, name) in (0u32..).zip(TAIL_PROGRAMS) {
        let program: &mut UProbe = ebpf
            .program_mut(name)
            .with_context(|| format!("program {name} missing from the eBPF object"))?
            .try_into()?;
        program
            .load()
            .map_err(|err| program_load_failure(name, options, &err))?;
        let fd = program.fd()?;
        array.set(index, fd, 0)?;
    }
    Ok(array)
}

/// `options` as the chosen object can serve them: the compat object
/// settles nothing in the kernel (no compare-and-swap).
pub fn variant_options(choice: &Choice, options: &LoadOptions) -> LoadOptions {
    let options = LoadOptions {
        thread_storage: choice.thread_storage,
        ..*options
    };
    match choice.variant {
        Variant::Full | Variant::TailCall => options,
        Variant::Compat => LoadOptions {
            settle_in_kernel: false,
            ..options
        },
    }
}

/// The flags that select a stack mode, for messages.
pub fn mode_flags(options: &LoadOptions) -> &'static str {
    match options.stack_mode {
        STACK_MODE_DWARF => "--stacks dwarf",
        memtrace_common::unwind::STACK_MODE_FP => "--stacks fp",
        _ => "--stack-depth 0",
    }
}

/// `options` in the cheaper stack modes, for trying what loads instead.
fn cheaper_modes(options: &LoadOptions) -> Vec<LoadOptions> {
    use memtrace_common::unwind::{STACK_MODE_FP, STACK_MODE_NONE};
    let fp = LoadOptions {
        stack_mode: STACK_MODE_FP,
        ..*options
    };
    let none = LoadOptions {
        stack_mode: STACK_MODE_NONE,
        stack_depth: 0,
        ..*options
    };
    match options.stack_mode {
        STACK_MODE_DWARF => vec![fp, none],
        STACK_MODE_FP => vec![none],
        _ => Vec::new(),
    }
}

/// A program's load failure as one line (see [`kernel_support::program_load_failure`]);
/// when the verifier refused it for size or stack, the cheaper stack modes
/// that load on this kernel are named.
fn program_load_failure(
    name: &str,
    options: &LoadOptions,
    err: &aya::programs::ProgramError,
) -> anyhow::Error {
    kernel_support::program_load_failure(name, mode_flags(options), err, || {
        cheaper_modes(options)
            .iter()
            .filter(|cheaper| {
                load_test(cheaper).is_ok_and(|programs| {
                    programs
                        .iter()
                        .all(|p| p.name == FORKS || p.outcome.is_ok())
                })
            })
            .map(mode_flags)
            .collect()
    })
    .into()
}

fn verified_insns(info: Option<aya::programs::ProgramInfo>) -> Option<u32> {
    info.and_then(|info| info.verified_instruction_count())
}

/// One program's load in [`load_test`].
pub struct ProgramLoad {
    pub name: &'static str,
    /// The verifier's processed-instruction count (kernels from 5.16 report
    /// it), or why the program was refused.
    pub outcome: Result<Option<u32>, aya::programs::ProgramError>,
}

/// Loads the embedded object with `options` and each of its programs
/// (`call_enter`, `call_exit`, `usdt_fire`, `task_new`, `task_exec`), attaching nothing; everything is
/// unloaded on return. An error: the maps could not be created.
pub fn load_test(options: &LoadOptions) -> Result<Vec<ProgramLoad>, aya::EbpfError> {
    let choice = crate::kernel::variant::choose(true);
    // Loaded as a trace with these options would load them: for
    // `uprobe_multi` links where it would use them.
    let multi = multi::resolve(options.attach, &choice).unwrap_or(false);
    let mut ebpf = open(&variant_options(&choice, options), choice.variant)?;
    let mut results = Vec::new();
    let tail = if choice.variant.tail_calls() {
        &TAIL_PROGRAMS[..]
    } else {
        &[]
    };
    for name in [ENTER, EXIT, USDT, FORKS, EXECS].iter().chain(tail) {
        let name = *name;
        let outcome = match ebpf.program_mut(name) {
            None => Err(aya::programs::ProgramError::NotLoaded),
            Some(aya::programs::Program::UProbe(program)) => if multi {
                program.load_for_uprobe_multi()
            } else {
                program.load()
            }
            .map(|()| verified_insns(program.info().ok())),
            Some(aya::programs::Program::RawTracePoint(program)) => {
                program.load().map(|()| verified_insns(program.info().ok()))
            }
            Some(_) => Err(aya::programs::ProgramError::UnexpectedProgramType),
        };
        results.push(ProgramLoad { name, outcome });
    }
    Ok(results)
}
