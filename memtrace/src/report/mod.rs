//! The report model (serde): what a trace found, field names a stable JSON
//! contract. How it is built from the live table, the stack store and the
//! counters is [`build`](fn@build) (one step per function). Sinks render
//! it; nothing here prints.

mod build;
pub mod device_cache;
pub mod leak;

pub use build::build;
pub use leak::{LeakCheck, LeakSplit, LeakVerdicts};

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use crate::analysis::history::History;
use crate::analysis::{Pattern, Suppressions, Trend};
pub use crate::model::{Frame, FrameKind, TimelineSample};
use crate::probe::catalog::{Allocator, Memory};
use crate::probe::SpecEntry;
use crate::stacks::StackStore;
use crate::table::LiveTable;
use crate::tracee::container::Placement;
pub use crate::tracee::TargetInfo;

/// The whole report; field names are a stable JSON contract (add, never rename).
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Report {
    /// The traced process: the `--pid` given, the launched command, or the
    /// first process found by `--name` (`--container`, `--cgroup`, `--pod`).
    pub target: TargetInfo,
    /// Milliseconds from the start of tracing (taken just before the first
    /// probe was attached) to this report, or to the end of the trace.
    pub duration_ms: u64,
    /// True for the reports printed every `--interval`; the last one is final.
    pub interim: bool,
    /// False when events were lost: the live table may then be wrong.
    pub complete: bool,
    /// What the trace saw, counted over its whole length.
    pub events: EventCounts,
    /// Events lost, by kernel counter: `ringbuf_full` (the ring buffer to
    /// memtrace was full), `pending_full` (the in-flight call table was
    /// full), `out_read_failed` (an out-parameter could not be read after
    /// the call), `mmap_table_full` (no longer counted: always 0); their
    /// sum is `events.lost`.
    pub lost_by_cause: BTreeMap<String, u64>,
    /// Stacks that could not be captured, by kernel counter: `stack_fault`
    /// (the walk faulted), `stack_collision` (the stack map's bucket held
    /// another stack), `stack_other` (the map full, the walk preempted, any
    /// other error); their sum is `events.stack_failures`.
    pub stack_failures_by_cause: BTreeMap<String, u64>,
    /// Live bytes and blocks per allocator and memory kind: every block in
    /// the live table, of every traced process, whatever its age, those set
    /// aside (`suppressed`) included.
    pub totals: Vec<Total>,
    /// The allocation sites shown, most suspicious first (after a leak
    /// check, the proven leaks first), at most `--top`: the live blocks
    /// not set aside and at least `--min-age` old, grouped by allocator,
    /// memory kind and stack (native and Python frames).
    pub sites: Vec<Site>,
    /// Allocator calls that failed (returned NULL, `MAP_FAILED` or an error
    /// status), by function and return code.
    pub failed_calls: Vec<FailedCall>,
    /// Each object whose allocator functions are probed: `path` (as the
    /// target sees it), `allocator` (the heap allocator it is, when it is
    /// one), `functions` (each `function`, its `aliases`, `probe_offset`,
    /// `placement`, `emulated`), `forwarders` (functions that only jump to
    /// another probed one) and `refused` (functions that cannot be probed).
    #[schemars(with = "Vec<crate::probe::plan::LibraryPlan>")]
    pub libraries: Vec<serde_json::Value>,
    /// Catalogue functions of the allocators found that no traced object
    /// defines (within each group of names one of which was found: the C
    /// interface, the C++ operators, an allocator's own API).
    pub missing_functions: Vec<String>,
    /// The options the trace ran with (`memtrace report FILE` may override
    /// `top`, `min_age_ms` and `warmup_ms` with its own flags).
    pub settings: Settings,
    /// Every counter the eBPF programs keep, by name, summed over the CPUs
    /// (`nested_calls`, `filtered`, `settled_in_kernel`,
    /// `stack_truncated_*`, `py_*`, ...; the causes in `lost_by_cause` and
    /// `stack_failures_by_cause` among them); empty when replaying a record
    /// file whose footer is missing.
    pub kernel_counters: BTreeMap<String, u64>,
    /// What a reader of this report should know, one sentence each: lost
    /// events, functions not attached, sampling, blocks made in the last
    /// second, expected unmatched frees, truncated stacks, problems met
    /// while finding the allocators, threads that exited, ...
    pub notes: Vec<String>,
    /// Live bytes per allocator at each interval (`--interval`), oldest first.
    pub timeline: Vec<TimelineSample>,
    /// What the allow-list (`--suppress`) and `--warmup` set aside: counted, not shown.
    pub suppressed: Suppressed,
    /// Tracked host bytes against the target's own memory growth since attach.
    pub reconciliation: Option<Reconciliation>,
    /// The processes traced: the target, and with `--follow-forks` each
    /// descendant, with what each still holds.
    pub processes: Vec<ProcessInfo>,
    /// Functions that could not be attached though others of their object
    /// were (another tracer's conflicting probe, ...): their calls are missing.
    pub attach_failures: Vec<String>,
    /// Stacks that ended before their outermost frame, by cause
    /// (`depth`: `--stack-depth` reached; `fault`: unreadable stack memory;
    /// `no_table`: code without CFI where frame pointers did not continue;
    /// `bad_rule`: a CFI rule the unwinder cannot follow; `table_cap`: the
    /// object's table did not fit `--unwind-table-mib`).
    pub stack_truncations_by_cause: BTreeMap<String, u64>,
    /// The DWARF unwinder's tables (objects, rows, kernel memory); `None` with
    /// `--stacks fp`, `--stack-depth 0` or offline.
    pub unwind: Option<crate::unwind::kernel::UnwindSummary>,
    /// The on-disk cache of the search of each object for allocator
    /// functions (`--table-cache`: the directory of `unwind.cache`, whose
    /// bound it shares): `hits` (objects whose search was read back),
    /// `misses` (objects searched), `rejected` (files refused: searched
    /// again), `stored`, `evicted`, `failures`; absent when it is off.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub function_cache: Option<crate::disk_cache::CacheStats>,
    /// The CPython interpreters found in traced processes, and whether (or
    /// why not) their Python frames are read.
    pub python: Vec<crate::interp::python::Interpreter>,
    /// With `--bpf-stats`: each of memtrace's BPF programs, how often it ran
    /// and the kernel time it took (memtrace's own cost in the traced
    /// process, the traps excluded); empty without.
    pub bpf_programs: Vec<ProgramCost>,
    /// With USDT probes of a caching device allocator (`--preset pytorch`):
    /// its blocks (tensors) and the device segments held from the CUDA
    /// runtime, side by side; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_cache: Option<DeviceCache>,
    /// Each object whose USDT probes are traced (`usdt =` pairs, presets):
    /// `path` and its `sites` (`probe`, `file_offset`, `semaphore_offset`);
    /// absent when none are.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    #[schemars(with = "Vec<crate::probe::usdt_plan::UsdtPlan>")]
    pub usdt: Vec<serde_json::Value>,
    /// With `--pyroscope URL`: what became of the reports pushed to the
    /// profile store so far; absent without.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub push: Option<PushStats>,
    /// With `--otlp-profiles URL`: what became of the reports pushed to the
    /// OpenTelemetry Collector so far (the same counters); absent without.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp: Option<PushStats>,
    /// With `--leak-check` (and by default in launch mode): which live
    /// blocks nothing points to any more, in valgrind's four categories;
    /// absent when no check was asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leak_check: Option<LeakCheck>,
}

/// The reports pushed to a profile store (`--pyroscope`) or a Collector
/// (`--otlp-profiles`), counted: none is lost silently.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct PushStats {
    /// Where they go (the push endpoint; credentials never appear in it).
    pub endpoint: String,
    /// Reports the store accepted.
    pub sent: u64,
    /// Reports given up on after their tries (an error answer, the store
    /// unreachable or too slow).
    pub failed: u64,
    /// Reports never tried: pushed out of the full queue by newer ones, or
    /// still waiting when memtrace ended.
    pub dropped: u64,
    /// Tries after a first one failed.
    pub retries: u64,
    /// Reports with no live site, not pushed (an empty profile).
    pub skipped_empty: u64,
    /// The latest failure, if any.
    pub last_error: Option<String>,
}

/// A caching device allocator seen two ways: the blocks its USDT probes
/// hand out (PyTorch's tensors) and the segments it holds from the CUDA
/// runtime (`cudaMalloc`, nested driver calls counted once). Their
/// difference is what the cache holds: freed tensors' memory kept for
/// reuse, and the unused tails of segments.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct DeviceCache {
    /// The USDT allocator(s) whose blocks are the tensors.
    pub allocators: Vec<String>,
    /// Bytes of the live tensors: the live device blocks of `allocators`.
    pub tensor_live_bytes: u64,
    /// How many tensors are live.
    pub tensor_live_count: u64,
    /// Bytes of the live device segments: the live device blocks of the
    /// CUDA runtime and driver (`cuda`, `cuda-driver`), whoever asked.
    pub segment_live_bytes: u64,
    /// How many device segments are live.
    pub segment_live_count: u64,
    /// `segment_live_bytes - tensor_live_bytes`: memory the cache holds
    /// (negative when segments were allocated before the trace began).
    pub cached_bytes: i64,
    /// Live tensors by device index and stream, as the probe gave them.
    pub tensors_by_device: Vec<DeviceTensors>,
    /// Tagged allocations whose device and stream were not kept (memtrace's
    /// map of them was full): they count under device -1.
    pub tags_dropped: u64,
}

/// Live tensors of one device and stream.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, schemars::JsonSchema)]
pub struct DeviceTensors {
    /// The device index (-1: none given).
    pub device: i64,
    /// The stream id (`stream.id()`).
    pub stream: i64,
    /// Bytes of the live tensors of this device and stream.
    pub live_bytes: u64,
    /// How many tensors of this device and stream are live.
    pub live_count: u64,
}

/// One BPF program's runs and run time (`--bpf-stats`).
#[derive(
    Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize, schemars::JsonSchema,
)]
pub struct ProgramCost {
    /// The BPF program: `call_enter` (allocator entries), `call_exit`
    /// (their returns), `usdt_fire` (USDT probes), `task_new` (forks) or
    /// `task_exec` (execs).
    pub program: String,
    /// Times it ran while the kernel's BPF statistics were on.
    pub runs: u64,
    /// Kernel time spent in it over those runs, in nanoseconds.
    pub run_ns: u64,
    /// `run_ns / runs` (0 when it never ran).
    pub ns_per_run: u64,
}

impl ProgramCost {
    pub fn new(program: &str, runs: u64, run_ns: u64) -> Self {
        ProgramCost {
            program: program.to_string(),
            runs,
            run_ns,
            ns_per_run: run_ns.checked_div(runs).unwrap_or(0),
        }
    }
}

/// Kernel counters of stacks cut short, and their names in
/// `stack_truncations_by_cause`.
pub const TRUNCATION_CAUSES: &[(&str, &str)] = &[
    ("stack_truncated_depth", "depth"),
    ("stack_truncated_fault", "fault"),
    ("stack_truncated_no_table", "no_table"),
    ("stack_truncated_bad_rule", "bad_rule"),
    ("stack_truncated_table_cap", "table_cap"),
    ("stack_truncated_table_pending", "table_pending"),
];

/// One traced process.
#[derive(
    Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq, Eq, schemars::JsonSchema,
)]
pub struct ProcessInfo {
    /// Its pid as memtrace sees it (`ns_pid` is the one inside its own pid
    /// namespace).
    pub pid: u32,
    /// The traced process it forked from (none for the target).
    pub parent: Option<u32>,
    /// Its command name (`/proc/PID/stat`; for a launched command, its
    /// program's file name); empty when it could not be read.
    pub comm: String,
    /// Its executable's path (`/proc/PID/exe`; for a launched command, the
    /// program as found in `PATH`); empty when it could not be read.
    pub exe: String,
    /// Milliseconds after tracing started when its probes were in place.
    pub traced_from_ms: u64,
    /// Milliseconds between the kernel reporting its fork (for a process
    /// found by `--name` during the trace: its start) and its probes being in
    /// place: its allocations in that window were not seen.
    pub attach_delay_ms: Option<u64>,
    /// Traced because it has the `--name` (not as a child).
    #[serde(default)]
    pub by_name: bool,
    /// Found by `--name` after tracing started (it started later).
    #[serde(default)]
    pub started_during_trace: bool,
    /// Launch mode held it before its first instruction until its probes
    /// were in place: nothing of it was missed.
    pub held_at_birth: bool,
    /// It exited before the report.
    pub exited: bool,
    /// Bytes of its blocks live in the table (all of them: those set aside
    /// and the young included).
    pub live_bytes: u64,
    /// How many of its blocks are live in the table.
    pub live_count: u64,
    /// Its pid in its own pid namespace and its container (keys `ns_pid`,
    /// `cgroup`, `container_id`, `container_runtime`, `pod_uid`, `pod_name`,
    /// `pod_namespace`, `container_name`).
    #[serde(flatten, default)]
    pub placement: Placement,
}

/// Blocks set aside by the allow-list or the warm-up.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct Suppressed {
    /// Bytes of the live blocks set aside, all entries together.
    pub live_bytes: u64,
    /// How many live blocks were set aside.
    pub live_count: u64,
    /// What each allow-list entry (and the warm-up) set aside, by entry.
    pub by_entry: Vec<SuppressedEntry>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct SuppressedEntry {
    /// The allow-list entry (`line N: text`) or `warmup`.
    pub entry: String,
    /// Bytes of the live blocks this entry set aside.
    pub live_bytes: u64,
    /// How many live blocks this entry set aside.
    pub live_count: u64,
}

/// How much of the target's memory growth memtrace's tracked bytes explain.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq, schemars::JsonSchema)]
pub struct Reconciliation {
    /// The target's `RssAnon` (resident anonymous memory, from
    /// `/proc/PID/status`) when tracing started, in bytes.
    pub rss_anon_at_attach: u64,
    /// The target's `RssAnon` when this report was made (the last figure
    /// read, once it has exited), in bytes.
    pub rss_anon_now: u64,
    /// `rss_anon_now - rss_anon_at_attach`, in bytes (negative when it
    /// shrank).
    pub rss_anon_growth: i64,
    /// The target's `VmRSS` (all its resident memory) when tracing started,
    /// in bytes.
    pub vm_rss_at_attach: u64,
    /// The target's `VmRSS` when this report was made (the last figure
    /// read, once it has exited), in bytes.
    pub vm_rss_now: u64,
    /// Live heap bytes memtrace tracks in the target (libc, jemalloc,
    /// tcmalloc, mimalloc; not its descendants').
    pub tracked_host_bytes: u64,
    /// Live anonymous mappings memtrace tracks in the target, in bytes
    /// (virtual: not all resident).
    pub tracked_mmap_bytes: u64,
    /// tracked / growth, when the growth is positive.
    pub explained_ratio: Option<f64>,
    /// What the tracked bytes leave out (memory allocated before the
    /// attach, allocator overhead, freed heap the allocator keeps, untraced
    /// allocators), and that mappings count their virtual size.
    pub note: String,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct EventCounts {
    /// Allocations seen (a `realloc`'s new block counts as one), those
    /// settled in the kernel included.
    pub allocs: u64,
    /// Releases that found their block in the table (a whole `munmap` of a
    /// traced mapping included), those settled in the kernel included.
    pub frees: u64,
    /// Events that never reached memtrace (every cause in `lost_by_cause`).
    pub lost: u64,
    /// Releases of an address with no live block in the table: blocks made
    /// before tracing started, or left out by `--min-size`/`--max-size`
    /// (see `notes`).
    pub unmatched_frees: u64,
    /// Releases seen at two probes (an `operator delete` ending in a probed
    /// `sdallocx`), counted once.
    pub releases_seen_twice: u64,
    /// Allocations whose stack could not be captured (their sites show no
    /// frames): the sum of `stack_failures_by_cause`.
    pub stack_failures: u64,
    /// Allocator calls that failed: the sum of `failed_calls[].count`.
    pub failed_calls: u64,
    /// Allocations not tracked because the live table was at its cap.
    pub table_full: u64,
    /// Heap blocks released before their allocation left the kernel: the
    /// pairs settled there (included in `allocs` and `frees`).
    pub settled_in_kernel: u64,
    /// Mappings partly unmapped (each keeps what lies outside the range).
    pub mappings_trimmed: u64,
    /// `munmap` ranges that met no traced mapping (mapped before the
    /// attach, from a file, or by the dynamic loader): not anomalies.
    pub unmaps_untracked: u64,
    /// Allocations at an address still live in the table with no release of
    /// its block seen (the old block is dropped): releases no probe saw.
    pub addresses_reused: u64,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct Total {
    pub allocator: Allocator,
    pub memory: Memory,
    /// Bytes of the live blocks of this allocator and memory kind.
    pub live_bytes: u64,
    /// How many blocks of this allocator and memory kind are live.
    pub live_count: u64,
}

#[derive(Clone, Debug, Serialize, PartialEq, schemars::JsonSchema)]
pub struct Site {
    pub allocator: Allocator,
    pub memory: Memory,
    /// Bytes of the site's live blocks (under `--sample-rate`, of the
    /// sample).
    pub live_bytes: u64,
    /// How many of the site's blocks are live (under `--sample-rate`, of
    /// the sample).
    pub live_count: u64,
    /// Age of the site's oldest live block when the report was made, in
    /// milliseconds.
    pub oldest_age_ms: u64,
    /// `growing`, `stable`, `shrinking`, or `new` (too few intervals to say).
    pub trend: Trend,
    /// Robust slope of the site's live bytes over the intervals.
    pub growth_bytes_per_s: f64,
    /// The leak pattern this site looks like, if any.
    pub pattern: Option<Pattern>,
    /// Intervals the site's oldest live block has lived through.
    pub survived_intervals: u64,
    /// With `--sample-rate N` (N > 1): `live_bytes` × N; for an allocator
    /// whose sizes are a sampler's estimates (`--preset otel-memory`):
    /// `live_bytes` itself; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimated_live_bytes: Option<u64>,
    /// With `--sample-rate N` (N > 1): `live_count` × N; absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimated_live_count: Option<u64>,
    /// The probed functions that made these blocks.
    pub functions: Vec<String>,
    /// The allocator's own library made these blocks for itself (its caller
    /// is inside that library: thread stacks, malloc arenas, stdio buffers,
    /// locale data): usually caches, ranked last within their trend.
    pub internal: bool,
    /// Processes holding these blocks: the target, and with
    /// `--follow-forks` its descendants.
    pub pids: Vec<u32>,
    /// Allocating thread ids.
    pub threads: Vec<u32>,
    /// Their names (`/proc/PID/task/TID/comm`), where known.
    pub thread_names: Vec<String>,
    /// Why there are no frames, when there are none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stack_note: Option<String>,
    /// `frames[0]` is the function that called the allocator.
    pub frames: Vec<Frame>,
    /// `[t_ms, live_bytes]` at each interval snapshot, oldest first (the
    /// series the trend is judged on; bounded, coarser over long traces).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<(u64, u64)>,
    /// The leak check's split of the site's blocks (blocks made after the
    /// check are in none); absent when no check ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leak_check: Option<LeakSplit>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct FailedCall {
    /// The probed function whose calls failed (`malloc`, `cudaMalloc`, ...).
    pub function: String,
    pub allocator: Allocator,
    /// What it returned, as a signed 32-bit number: 0 (NULL) for a function
    /// returning a pointer, -1 for `mmap`'s `MAP_FAILED`, the error code
    /// for one returning a status (`cudaMalloc`, ...).
    pub code: i64,
    /// How many of its calls failed with this code.
    pub count: u64,
}

#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, schemars::JsonSchema)]
pub struct Settings {
    /// `--stack-depth`: frames kept per allocation stack (0: no stacks).
    pub stack_depth: u32,
    /// `--min-age` in milliseconds: younger blocks are left out of the
    /// sites (not of `totals`).
    pub min_age_ms: u64,
    /// `--top`: the most sites shown.
    pub top: usize,
    /// `--sample-rate`: one allocation in this many is traced (1: all).
    pub sample_rate: u32,
    /// `--min-size`: smaller allocations are not traced, in bytes (0: none
    /// are left out).
    pub min_size: u64,
    /// `--max-size`: larger allocations are not traced, in bytes; null
    /// without it.
    pub max_size: Option<u64>,
    /// `--warmup` in milliseconds: blocks made this early in the trace are
    /// set aside (0: none).
    pub warmup_ms: u64,
    /// `--interval` in milliseconds: the period of the interim reports (and
    /// of the snapshots trends are judged on); null without it.
    pub interval_ms: Option<u64>,
    /// `--suppress`: the allow-list file's path; null without it.
    pub suppress_file: Option<String>,
    /// How the probes were attached: `uprobe_multi` (one BPF link per
    /// process, object and stage) or `perf_event` (one per probe); absent
    /// in records written before it was kept.
    #[serde(default)]
    pub attach: Option<String>,
}

/// Everything the builder reads.
pub struct ReportInput<'a> {
    pub target: TargetInfo,
    pub duration_ms: u64,
    /// Monotonic time now and when tracing started (the clock of block timestamps).
    pub now_ns: u64,
    pub started_ns: u64,
    pub table: &'a LiveTable,
    pub specs: &'a [SpecEntry],
    pub stacks: &'a StackStore,
    pub history: Option<&'a History>,
    pub suppressions: Option<&'a Suppressions>,
    pub thread_names: &'a HashMap<u32, String>,
    pub kernel_counters: BTreeMap<String, u64>,
    pub libraries: Vec<serde_json::Value>,
    pub missing_functions: Vec<String>,
    pub settings: Settings,
    pub notes: Vec<String>,
    pub reconciliation: Option<Reconciliation>,
    /// What is known of the traced processes; pids seen only in the table
    /// are added with what the table says.
    pub processes: Vec<ProcessInfo>,
    pub attach_failures: Vec<String>,
    /// The latest leak check and its verdicts, when one was asked.
    pub leak_check: Option<(&'a LeakCheck, &'a LeakVerdicts)>,
    /// `--fail-on`: the categories that fail the run.
    pub leak_gates: &'a [leak::LeakGate],
}

/// Kernel counters that mean events were lost.
pub const LOST_CAUSES: &[&str] = &[
    "ringbuf_full",
    "pending_full",
    "out_read_failed",
    "mmap_table_full",
];
/// Kernel counters that mean a stack could not be captured.
pub const STACK_CAUSES: &[&str] = &["stack_fault", "stack_collision", "stack_other"];

/// Whether `--min-size`/`--max-size` narrowed what is traced.
pub fn size_filtered(settings: &Settings) -> bool {
    settings.min_size > 0 || settings.max_size.is_some()
}
