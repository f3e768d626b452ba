//! The report model (serde) and how it is built from the live table, the
//! stack store and the counters. Sinks render it; nothing here prints.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Serialize;

use crate::analysis::history::{History, SiteKey};
use crate::analysis::{
    accumulation_rate, classify, classify_trend, survived_intervals, suspicion_rank, BlockFacts,
    Pattern, Suppressions, Trend, TrendVerdict,
};
use crate::event::StackRef;
pub use crate::model::{Frame, FrameKind, TimelineSample};
use crate::probe::catalog::{Allocator, Memory};
use crate::probe::maps::FileAddr;
use crate::probe::SpecEntry;
use crate::stacks::StackStore;
use crate::symbolize::Symbolize;
use crate::table::LiveTable;
use crate::target::container::Placement;
pub use crate::target::TargetInfo;

/// The whole report; field names are a stable JSON contract (add, never rename).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub target: TargetInfo,
    pub duration_ms: u64,
    /// True for the reports printed every `--interval`; the last one is final.
    pub interim: bool,
    /// False when events were lost: the live table may then be wrong.
    pub complete: bool,
    pub events: EventCounts,
    pub lost_by_cause: BTreeMap<String, u64>,
    pub stack_failures_by_cause: BTreeMap<String, u64>,
    pub totals: Vec<Total>,
    pub sites: Vec<Site>,
    pub failed_calls: Vec<FailedCall>,
    pub libraries: Vec<serde_json::Value>,
    pub missing_functions: Vec<String>,
    pub settings: Settings,
    pub kernel_counters: BTreeMap<String, u64>,
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
    /// The CPython interpreters found in traced processes, and whether (or
    /// why not) their Python frames are read.
    pub python: Vec<crate::interp::python::Interpreter>,
    /// With `--bpf-stats`: each of memtrace's BPF programs, how often it ran
    /// and the kernel time it took (memtrace's own cost in the traced
    /// process, the traps excluded); empty without.
    pub bpf_programs: Vec<ProgramCost>,
}

/// One BPF program's runs and run time (`--bpf-stats`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ProgramCost {
    pub program: String,
    pub runs: u64,
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
];

/// One traced process.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ProcessInfo {
    pub pid: u32,
    /// The traced process it forked from (none for the target).
    pub parent: Option<u32>,
    pub comm: String,
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
    /// Filled by the report builder from the live table.
    pub live_bytes: u64,
    pub live_count: u64,
    /// Its pid in its own pid namespace and its container (keys `ns_pid`,
    /// `cgroup`, `container_id`, `container_runtime`, `pod_uid`).
    #[serde(flatten, default)]
    pub placement: Placement,
}

/// Blocks set aside by the allow-list or the warm-up.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Suppressed {
    pub live_bytes: u64,
    pub live_count: u64,
    pub by_entry: Vec<SuppressedEntry>,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct SuppressedEntry {
    /// The allow-list entry (`line N: text`) or `warmup`.
    pub entry: String,
    pub live_bytes: u64,
    pub live_count: u64,
}

/// How much of the target's memory growth memtrace's tracked bytes explain.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct Reconciliation {
    pub rss_anon_at_attach: u64,
    pub rss_anon_now: u64,
    pub rss_anon_growth: i64,
    pub vm_rss_at_attach: u64,
    pub vm_rss_now: u64,
    /// Live heap bytes (libc allocator) memtrace tracks.
    pub tracked_host_bytes: u64,
    /// Live anonymous mappings memtrace tracks (virtual: not all resident).
    pub tracked_mmap_bytes: u64,
    /// tracked / growth, when the growth is positive.
    pub explained_ratio: Option<f64>,
    pub note: String,
}

#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct EventCounts {
    pub allocs: u64,
    pub frees: u64,
    /// Events that never reached memtrace (every cause in `lost_by_cause`).
    pub lost: u64,
    pub unmatched_frees: u64,
    /// Releases seen at two probes (an `operator delete` ending in a probed
    /// `sdallocx`), counted once.
    pub releases_seen_twice: u64,
    pub stack_failures: u64,
    pub failed_calls: u64,
    /// Allocations not tracked because the live table was at its cap.
    pub table_full: u64,
    /// Heap blocks released before their allocation left the kernel: the
    /// pairs settled there (included in `allocs` and `frees`).
    pub settled_in_kernel: u64,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Total {
    pub allocator: Allocator,
    pub memory: Memory,
    pub live_bytes: u64,
    pub live_count: u64,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Site {
    pub allocator: Allocator,
    pub memory: Memory,
    pub live_bytes: u64,
    pub live_count: u64,
    pub oldest_age_ms: u64,
    /// `growing`, `stable`, `shrinking`, or `new` (too few intervals to say).
    pub trend: Trend,
    /// Robust slope of the site's live bytes over the intervals.
    pub growth_bytes_per_s: f64,
    /// The leak pattern this site looks like, if any.
    pub pattern: Option<Pattern>,
    /// Intervals the site's oldest live block has lived through.
    pub survived_intervals: u64,
    /// With `--sample-rate N`: live bytes and blocks scaled by N.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimated_live_bytes: Option<u64>,
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
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct FailedCall {
    pub function: String,
    pub allocator: Allocator,
    pub code: i64,
    pub count: u64,
}

#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct Settings {
    pub stack_depth: u32,
    pub min_age_ms: u64,
    pub top: usize,
    pub sample_rate: u32,
    pub min_size: u64,
    pub max_size: Option<u64>,
    pub warmup_ms: u64,
    pub interval_ms: Option<u64>,
    pub suppress_file: Option<String>,
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

#[derive(Default)]
struct SiteAcc {
    live_bytes: u64,
    live_count: u64,
    oldest_ts: u64,
    functions: BTreeSet<&'static str>,
    /// The objects defining those functions.
    modules: BTreeSet<&'static str>,
    threads: BTreeSet<u32>,
    pids: BTreeSet<u32>,
    /// (seconds since start, size) of each live block, for pattern detection.
    blocks: Vec<(f64, u64)>,
}

/// A site judged: its key, blocks, trend, pattern, whether the allocator
/// made it for itself, and how fast its live blocks piled up (`new` sites).
type Judged = (
    SiteKey,
    SiteAcc,
    TrendVerdict,
    Option<Pattern>,
    bool,
    Option<f64>,
);

/// Builds the report, symbolizing the frames of the sites shown.
/// Blocks younger than this at the end are "young": short-lived blocks still
/// in use when the window closed are among them.
const YOUNG_NS: u64 = 1_000_000_000;

/// The note on live blocks made in the trace's last second.
fn young_note((bytes, count): (u64, u64)) -> Option<String> {
    (count > 0).then(|| {
        format!(
            "{count} live block(s) ({bytes} bytes) were made in the trace's last second: the report is the state at its end, so blocks a balanced site was still using then are among them (--min-age 1s leaves them out)"
        )
    })
}

pub fn build(input: ReportInput<'_>, symbolizer: &mut dyn Symbolize) -> Report {
    let spec = |index: u16| input.specs.get(usize::from(index));
    let min_age_ns = input.settings.min_age_ms.saturating_mul(1_000_000);
    // With no warm-up nothing is set aside, not even blocks stamped just
    // before the session clock started.
    let warmup_until = if input.settings.warmup_ms == 0 {
        0
    } else {
        input
            .started_ns
            .saturating_add(input.settings.warmup_ms.saturating_mul(1_000_000))
    };
    let depth = input.settings.stack_depth as usize;
    let seconds = |ts: u64| ts.saturating_sub(input.started_ns) as f64 / 1e9;

    // Symbols of every stack, when the allow-list matches on them.
    let needs_symbols = input.suppressions.is_some_and(Suppressions::needs_symbols);
    let mut symbols: HashMap<FileAddr, crate::symbolize::SymInfo> = HashMap::new();
    if needs_symbols {
        let all: Vec<FileAddr> = input
            .table
            .blocks()
            .filter_map(|(_, _, _, b)| match b.stack() {
                StackRef::Id(id) => Some(id),
                _ => None,
            })
            .collect::<BTreeSet<u32>>()
            .into_iter()
            .filter_map(|id| input.stacks.get(id))
            .flat_map(|frames| frames.iter().take(depth).filter_map(|f| f.file.clone()))
            .collect::<BTreeSet<FileAddr>>()
            .into_iter()
            .collect();
        symbols.extend(all.iter().cloned().zip(symbolizer.symbolize(&all)));
    }

    let mut totals: BTreeMap<(Allocator, Memory), (u64, u64)> = BTreeMap::new();
    let mut sites: HashMap<SiteKey, SiteAcc> = HashMap::new();
    let mut suppressed: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut per_process: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    // Live blocks made in the window's last second (bytes, count).
    let mut young = (0u64, 0u64);
    for (pid, _, addr, block) in input.table.blocks() {
        let Some(entry) = spec(block.spec) else {
            continue;
        };
        let held = per_process.entry(pid).or_insert((0, 0));
        held.0 += block.size;
        held.1 += 1;
        let total = totals
            .entry((entry.allocator, entry.memory))
            .or_insert((0, 0));
        total.0 += block.size;
        total.1 += 1;
        if let Some(reason) = suppression(&input, entry, addr, block, warmup_until, &symbols) {
            let slot = suppressed.entry(reason).or_insert((0, 0));
            slot.0 += block.size;
            slot.1 += 1;
            continue;
        }
        let age_ns = input.now_ns.saturating_sub(block.ts_ns);
        if age_ns < min_age_ns {
            continue;
        }
        if age_ns < YOUNG_NS {
            young.0 += block.size;
            young.1 += 1;
        }
        let site = sites
            .entry((
                entry.allocator,
                entry.memory,
                input.stacks.canonical(block.stack()),
                input.stacks.python.canonical(block.py_stack),
            ))
            .or_insert_with(|| SiteAcc {
                oldest_ts: u64::MAX,
                ..SiteAcc::default()
            });
        site.live_bytes += block.size;
        site.live_count += 1;
        site.oldest_ts = site.oldest_ts.min(block.ts_ns);
        site.functions.insert(entry.function);
        if let Some(module) = entry.module {
            site.modules.insert(module);
        }
        site.threads.insert(block.tid);
        site.pids.insert(pid);
        site.blocks.push((seconds(block.ts_ns), block.size));
    }

    let trace_s = input.duration_ms as f64 / 1000.0;
    let interval_ends: &[f64] = input.history.map_or(&[], |h| h.interval_ends.as_slice());
    // A statically linked program defines its allocator itself: its own
    // calls are not the library's.
    let programs: BTreeSet<&str> = std::iter::once(input.target.exe.as_str())
        .chain(input.processes.iter().map(|p| p.exe.as_str()))
        .collect();
    let mut judged: Vec<Judged> = sites
        .into_iter()
        .map(|(key, acc)| {
            let series = input.history.map_or(&[][..], |h| h.series(&key));
            let verdict = classify_trend(series, 0);
            let process_bytes: u64 = acc
                .pids
                .iter()
                .filter_map(|pid| per_process.get(pid))
                .map(|held| held.0)
                .sum();
            let pattern = classify(&acc.blocks, verdict.trend, trace_s, process_bytes);
            // Python frames name who asked, whatever native code allocated.
            let internal = key.3 == 0
                && allocated_inside_allocator(key.2, input.stacks, &acc.modules, &programs);
            let accumulation = (verdict.trend == Trend::New)
                .then(|| accumulation_rate(&acc.blocks, trace_s))
                .flatten();
            (key, acc, verdict, pattern, internal, accumulation)
        })
        .collect();
    judged.sort_by(|a, b| {
        suspicion_rank(a.2.trend, a.2.growth_bytes_per_s, a.5, a.1.live_bytes, a.4)
            .cmp(&suspicion_rank(
                b.2.trend,
                b.2.growth_bytes_per_s,
                b.5,
                b.1.live_bytes,
                b.4,
            ))
            .then(b.1.live_count.cmp(&a.1.live_count))
            .then(a.0.cmp(&b.0))
    });
    judged.truncate(input.settings.top);

    let wanted: Vec<FileAddr> = judged
        .iter()
        .filter_map(|((_, _, stack, _), ..)| match stack {
            StackRef::Id(id) => input.stacks.get(*id),
            _ => None,
        })
        .flat_map(|frames| frames.iter().take(depth).filter_map(|f| f.file.clone()))
        .filter(|addr| !symbols.contains_key(addr))
        .collect();
    symbols.extend(wanted.iter().cloned().zip(symbolizer.symbolize(&wanted)));

    let rate = u64::from(input.settings.sample_rate.max(1));
    let sites = judged
        .into_iter()
        .map(
            |((allocator, memory, stack, py), acc, verdict, pattern, internal, _)| {
                let (frames, stack_note) = site_frames(stack, input.stacks, depth, &symbols);
                let frames = crate::interp::python::merge::merge(
                    frames,
                    input.stacks.python.frames(py).unwrap_or(&[]),
                );
                let stack_note = stack_note.or_else(|| {
                    input.stacks.python.is_truncated(py).then(|| {
                        format!(
                            "Python stack cut at {} frames (outer frames missing)",
                            memtrace_common::PY_MAX_DEPTH
                        )
                    })
                });
                Site {
                    allocator,
                    memory,
                    live_bytes: acc.live_bytes,
                    live_count: acc.live_count,
                    oldest_age_ms: input.now_ns.saturating_sub(acc.oldest_ts) / 1_000_000,
                    trend: verdict.trend,
                    growth_bytes_per_s: verdict.growth_bytes_per_s,
                    pattern,
                    survived_intervals: survived_intervals(seconds(acc.oldest_ts), interval_ends),
                    estimated_live_bytes: (rate > 1).then(|| acc.live_bytes.saturating_mul(rate)),
                    estimated_live_count: (rate > 1).then(|| acc.live_count.saturating_mul(rate)),
                    functions: acc.functions.into_iter().map(str::to_string).collect(),
                    internal,
                    thread_names: acc
                        .threads
                        .iter()
                        .filter_map(|tid| input.thread_names.get(tid).cloned())
                        .collect::<BTreeSet<String>>()
                        .into_iter()
                        .collect(),
                    threads: acc.threads.into_iter().collect(),
                    pids: acc.pids.into_iter().collect(),
                    stack_note,
                    frames,
                    history: input.history.map_or_else(Vec::new, |h| {
                        h.series(&(allocator, memory, stack, py))
                            .iter()
                            .map(|&(t_s, bytes)| ((t_s * 1000.0) as u64, bytes as u64))
                            .collect()
                    }),
                }
            },
        )
        .collect();

    let counts = input.table.counts();
    let failed_calls: Vec<FailedCall> = counts
        .failed
        .iter()
        .filter_map(|(&(index, code), &count)| {
            let entry = spec(index)?;
            Some(FailedCall {
                function: entry.function.to_string(),
                allocator: entry.allocator,
                code,
                count,
            })
        })
        .collect();
    let pick = |causes: &[&str]| -> BTreeMap<String, u64> {
        causes
            .iter()
            .map(|c| {
                (
                    c.to_string(),
                    input.kernel_counters.get(*c).copied().unwrap_or(0),
                )
            })
            .collect()
    };
    let lost_by_cause = pick(LOST_CAUSES);
    let stack_failures_by_cause = pick(STACK_CAUSES);
    let lost: u64 = lost_by_cause.values().sum();
    let kernel = |name: &str| input.kernel_counters.get(name).copied().unwrap_or(0);
    let settled = kernel("settled_in_kernel");
    let events = EventCounts {
        allocs: counts.allocs + settled,
        frees: counts.frees + settled,
        settled_in_kernel: settled,
        lost,
        unmatched_frees: counts.unmatched_frees,
        releases_seen_twice: counts.releases_seen_twice + kernel("settled_seen_twice"),
        stack_failures: stack_failures_by_cause.values().sum(),
        failed_calls: failed_calls.iter().map(|f| f.count).sum(),
        table_full: counts.table_full,
    };
    let mut notes = input.notes;
    if lost > 0 {
        notes.push(format!(
            "{lost} events were lost: the live table is incomplete (see lost_by_cause)"
        ));
    }
    if !input.attach_failures.is_empty() {
        notes.push(format!(
            "{} probed function(s) could not be attached: their calls are missing and the live table is incomplete (see attach_failures)",
            input.attach_failures.len()
        ));
    }
    if rate > 1 {
        notes.push(format!(
            "sampling 1 in {rate} allocations (by address): live figures are of the sample; estimated_* fields scale them by {rate}"
        ));
    }
    if let Some(note) = young_note(young) {
        notes.push(note);
    }
    if let Some(note) = size_filter_note(
        &input.settings,
        counts.unmatched_frees,
        &input.kernel_counters,
    ) {
        notes.push(note);
    }
    let suppressed = Suppressed {
        live_bytes: suppressed.values().map(|v| v.0).sum(),
        live_count: suppressed.values().map(|v| v.1).sum(),
        by_entry: suppressed
            .into_iter()
            .map(|(entry, (live_bytes, live_count))| SuppressedEntry {
                entry,
                live_bytes,
                live_count,
            })
            .collect(),
    };
    let processes = process_list(input.processes, &input.target, per_process);
    let stack_truncations_by_cause: BTreeMap<String, u64> = TRUNCATION_CAUSES
        .iter()
        .map(|(counter, name)| {
            (
                name.to_string(),
                input.kernel_counters.get(*counter).copied().unwrap_or(0),
            )
        })
        .collect();
    let truncated: u64 = stack_truncations_by_cause.values().sum();
    if truncated > 0 {
        let causes: Vec<String> = stack_truncations_by_cause
            .iter()
            .filter(|(_, &n)| n > 0)
            .map(|(cause, n)| format!("{n} {cause}"))
            .collect();
        notes.push(format!(
            "{truncated} stack walk(s) ended before the outermost frame ({}; see stack_truncations_by_cause)",
            causes.join(", ")
        ));
    }
    Report {
        stack_truncations_by_cause,
        unwind: None,
        bpf_programs: Vec::new(),
        target: input.target,
        duration_ms: input.duration_ms,
        interim: false,
        complete: lost == 0 && counts.table_full == 0 && input.attach_failures.is_empty(),
        events,
        lost_by_cause,
        stack_failures_by_cause,
        totals: totals
            .into_iter()
            .map(|((allocator, memory), (live_bytes, live_count))| Total {
                allocator,
                memory,
                live_bytes,
                live_count,
            })
            .collect(),
        sites,
        failed_calls,
        libraries: input.libraries,
        missing_functions: input.missing_functions,
        settings: input.settings,
        kernel_counters: input.kernel_counters,
        notes,
        timeline: input
            .history
            .map(|h| h.timeline.clone())
            .unwrap_or_default(),
        suppressed,
        reconciliation: input.reconciliation,
        processes,
        attach_failures: input.attach_failures,
        python: input.stacks.python.interpreters().cloned().collect(),
    }
}

/// Whether `--min-size`/`--max-size` narrowed what is traced.
pub fn size_filtered(settings: &Settings) -> bool {
    settings.min_size > 0 || settings.max_size.is_some()
}

/// Why unmatched frees are expected under a size filter. The kernel drops an
/// allocation outside the size range at its return, but a free carries no
/// size and cannot be told apart: the free of every filtered-out block
/// reaches the live table and finds nothing there.
fn size_filter_note(
    settings: &Settings,
    unmatched_frees: u64,
    kernel_counters: &BTreeMap<String, u64>,
) -> Option<String> {
    if !size_filtered(settings) || unmatched_frees == 0 {
        return None;
    }
    let range = match settings.max_size {
        Some(max) => format!("{}..={max} bytes", settings.min_size),
        None => format!(">= {} bytes", settings.min_size),
    };
    let filtered = kernel_counters.get("filtered").copied().unwrap_or(0);
    Some(format!(
        "{unmatched_frees} unmatched frees are expected, not an anomaly: only allocations of {range} are traced (the kernel skipped {filtered}), but frees carry no size, so the frees of the skipped blocks find no block"
    ))
}

/// The traced processes with what each holds; a pid that holds blocks but is
/// not listed (a replay of an older record) is added, the target first.
fn process_list(
    mut known: Vec<ProcessInfo>,
    target: &TargetInfo,
    mut held: BTreeMap<u32, (u64, u64)>,
) -> Vec<ProcessInfo> {
    if !known.iter().any(|p| p.pid == target.pid) {
        known.insert(
            0,
            ProcessInfo {
                pid: target.pid,
                comm: target.comm.clone(),
                exe: target.exe.clone(),
                placement: target.placement.clone(),
                ..ProcessInfo::default()
            },
        );
    }
    for process in &mut known {
        let (bytes, count) = held.remove(&process.pid).unwrap_or((0, 0));
        process.live_bytes = bytes;
        process.live_count = count;
    }
    known.extend(
        held.into_iter()
            .map(|(pid, (live_bytes, live_count))| ProcessInfo {
                pid,
                live_bytes,
                live_count,
                ..ProcessInfo::default()
            }),
    );
    known
}

/// Whether a stack's innermost frame (the allocator's caller) lies in a
/// library (not a traced program) that defines the allocator functions of
/// the site: the library allocated for itself.
fn allocated_inside_allocator(
    stack: StackRef,
    stacks: &StackStore,
    modules: &BTreeSet<&'static str>,
    programs: &BTreeSet<&str>,
) -> bool {
    let StackRef::Id(id) = stack else {
        return false;
    };
    stacks
        .get(id)
        .and_then(|frames| frames.first())
        .and_then(|frame| frame.file.as_ref())
        .is_some_and(|file| {
            let caller = file.module.display().to_string();
            !programs.contains(caller.as_str()) && modules.iter().any(|m| *m == caller)
        })
}

/// Why a block is set aside (warm-up or an allow-list entry), if it is.
fn suppression(
    input: &ReportInput<'_>,
    entry: &SpecEntry,
    addr: u64,
    block: &crate::table::LiveBlock,
    warmup_until: u64,
    symbols: &HashMap<FileAddr, crate::symbolize::SymInfo>,
) -> Option<String> {
    if block.ts_ns < warmup_until {
        return Some("warmup".to_string());
    }
    let suppressions = input.suppressions?;
    let frames: &[crate::stacks::RawFrame] = match block.stack() {
        StackRef::Id(id) => input.stacks.get(id).unwrap_or(&[]),
        _ => &[],
    };
    let depth = input.settings.stack_depth as usize;
    let infos: Vec<Option<&crate::symbolize::SymInfo>> = frames
        .iter()
        .take(depth)
        .map(|f| f.file.as_ref().and_then(|file| symbols.get(file)))
        .collect();
    let symbol_names: Vec<Option<&str>> = infos
        .iter()
        .map(|i| i.and_then(|i| i.symbol.as_deref()))
        .collect();
    let module_paths: Vec<String> = frames
        .iter()
        .take(depth)
        .map(|f| {
            f.file
                .as_ref()
                .map(|f| f.module.display().to_string())
                .unwrap_or_default()
        })
        .collect();
    let modules: Vec<Option<&str>> = module_paths
        .iter()
        .map(|m| (!m.is_empty()).then_some(m.as_str()))
        .collect();
    let facts = BlockFacts {
        allocator: entry.allocator.name(),
        addr,
        size: block.size,
        symbols: &symbol_names,
        modules: &modules,
    };
    let index = suppressions.matches_block(&facts)?;
    suppressions.entries().get(index).map(|e| e.to_string())
}

fn site_frames(
    stack: StackRef,
    stacks: &StackStore,
    depth: usize,
    symbols: &HashMap<FileAddr, crate::symbolize::SymInfo>,
) -> (Vec<Frame>, Option<String>) {
    match stack {
        StackRef::NotRequested => (
            Vec::new(),
            Some("stacks not requested (--stack-depth 0)".into()),
        ),
        StackRef::Failed(errno) => (
            Vec::new(),
            Some(format!("stack capture failed: {}", errno_name(errno))),
        ),
        StackRef::Id(id) => match stacks.get(id) {
            None => (Vec::new(), Some(format!("stack {id} could not be read"))),
            Some(raw) => (
                raw.iter()
                    .take(depth)
                    .map(|frame| {
                        let info = frame.file.as_ref().and_then(|f| symbols.get(f));
                        Frame {
                            kind: FrameKind::Native,
                            addr: format!("{:#x}", frame.addr),
                            symbol: info.and_then(|i| i.symbol.clone()),
                            module: frame.file.as_ref().map(|f| f.module.display().to_string()),
                            file: info.and_then(|i| i.file.clone()),
                            line: info.and_then(|i| i.line),
                            offset: frame.file.as_ref().map(|f| format!("{:#x}", f.file_offset)),
                        }
                    })
                    .collect(),
                None,
            ),
        },
    }
}

fn errno_name(errno: i32) -> String {
    match errno {
        14 => "EFAULT (frame walk faulted)".into(),
        17 => "EEXIST (stack map bucket collision)".into(),
        12 => "ENOMEM (stack map full)".into(),
        other => format!("errno {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Action, Event};
    use crate::probe::catalog::Domain;
    use crate::probe::maps::AddressSpace;
    use crate::symbolize::{SymInfo, Symbolize};
    use crate::target::maps::parse;

    struct FakeSymbols;
    impl Symbolize for FakeSymbols {
        fn symbolize(&mut self, addrs: &[FileAddr]) -> Vec<SymInfo> {
            addrs
                .iter()
                .map(|a| SymInfo {
                    symbol: Some(format!("fn_{:x}", a.file_offset)),
                    file: Some("app.c".into()),
                    line: Some(a.file_offset as u32),
                })
                .collect()
        }
    }

    /// A report input over these tables with every other field empty.
    fn input<'a>(
        table: &'a LiveTable,
        specs: &'a [SpecEntry],
        stacks: &'a StackStore,
        names: &'a HashMap<u32, String>,
    ) -> ReportInput<'a> {
        ReportInput {
            target: TargetInfo::default(),
            duration_ms: 1,
            now_ns: 1,
            started_ns: 0,
            history: None,
            suppressions: None,
            thread_names: names,
            reconciliation: None,
            processes: Vec::new(),
            attach_failures: Vec::new(),
            table,
            specs,
            stacks,
            kernel_counters: BTreeMap::new(),
            libraries: Vec::new(),
            missing_functions: Vec::new(),
            settings: Settings::default(),
            notes: Vec::new(),
        }
    }

    fn specs() -> Vec<SpecEntry> {
        vec![
            SpecEntry {
                function: "malloc",
                allocator: Allocator::Libc,
                memory: Memory::Host,
                domain: Domain::Heap,
                module: Some("/lib/libc.so.6"),
            },
            SpecEntry {
                function: "cudaMalloc",
                allocator: Allocator::Cuda,
                memory: Memory::Device,
                domain: Domain::CudaMemory,
                module: None,
            },
        ]
    }

    fn alloc(spec: u16, addr: u64, size: u64, stack: u32, ts_ns: u64) -> Event {
        Event {
            ts_ns,
            pid: 1,
            tid: 7,
            spec,
            py_stack: 0,
            action: Action::Alloc {
                addr,
                size,
                stack: StackRef::Id(stack),
            },
        }
    }

    fn sample() -> Report {
        let specs = specs();
        let mut table = LiveTable::new(1000);
        for i in 0..3 {
            table.apply(&alloc(0, 0x100 + i, 100, 1, 1_000_000), Domain::Heap);
        }
        table.apply(&alloc(0, 0x200, 50, 2, 2_000_000_000), Domain::Heap);
        table.apply(&alloc(1, 0x100, 4096, 3, 0), Domain::CudaMemory);
        let space = AddressSpace::new(parse("1000-9000 r-xp 00000000 fe:01 5 /bin/app\n"));
        let mut stacks = StackStore::default();
        stacks.insert(1, &[0x1100, 0x1200, 0x1300], &space);
        stacks.insert(2, &[0x1500], &space);
        stacks.insert(3, &[0x1600], &space);
        let names = HashMap::new();
        let input = ReportInput {
            target: TargetInfo {
                pid: 1,
                comm: "app".into(),
                exe: "/bin/app".into(),
                ..TargetInfo::default()
            },
            duration_ms: 5000,
            now_ns: 2_500_000_000,
            kernel_counters: [("ringbuf_full".to_string(), 0)].into_iter().collect(),
            settings: Settings {
                stack_depth: 2,
                min_age_ms: 1000,
                top: 10,
                sample_rate: 1,
                ..Settings::default()
            },
            ..input(&table, &specs, &stacks, &names)
        };
        build(input, &mut FakeSymbols)
    }

    #[test]
    fn blocks_made_in_the_last_second_are_named_young() {
        assert_eq!(young_note((0, 0)), None);
        let note = young_note((4096, 2)).expect("a note");
        assert!(note.starts_with("2 live block(s) (4096 bytes)"), "{note}");
        assert!(note.contains("--min-age"), "{note}");
    }

    #[test]
    fn sites_sorted_by_bytes_with_min_age_applied() {
        let report = sample();
        // The 50-byte block is 0.5 s old: hidden by --min-age 1s, but in the totals.
        assert_eq!(report.sites.len(), 2);
        assert_eq!(report.sites[0].live_bytes, 4096);
        assert_eq!(report.sites[0].memory, Memory::Device);
        assert_eq!(report.sites[1].live_bytes, 300);
        assert_eq!(report.sites[1].live_count, 3);
        assert_eq!(report.sites[1].oldest_age_ms, 2499);
        let libc_total = report
            .totals
            .iter()
            .find(|t| t.allocator == Allocator::Libc)
            .expect("libc total");
        assert_eq!((libc_total.live_bytes, libc_total.live_count), (350, 4));
    }

    #[test]
    fn sites_allocated_inside_the_allocator_library_are_internal_and_last() {
        let specs = specs();
        let mut table = LiveTable::new(1000);
        // A big block from libc itself (a thread stack), a small one from the program.
        table.apply(&alloc(0, 0x100, 1 << 20, 1, 0), Domain::Heap);
        table.apply(&alloc(0, 0x200, 10, 2, 0), Domain::Heap);
        let space = AddressSpace::new(parse(
            "1000-2000 r-xp 00000000 fe:01 5 /bin/app\n5000-6000 r-xp 00000000 fe:01 6 /lib/libc.so.6\n",
        ));
        let mut stacks = StackStore::default();
        stacks.insert(1, &[0x5100, 0x1200], &space);
        stacks.insert(2, &[0x1300], &space);
        let names = HashMap::new();
        let report = build(
            ReportInput {
                target: TargetInfo {
                    pid: 1,
                    comm: "app".into(),
                    exe: "/bin/app".into(),
                    ..TargetInfo::default()
                },
                duration_ms: 1000,
                now_ns: 1_000_000_000,
                settings: Settings {
                    stack_depth: 4,
                    top: 10,
                    sample_rate: 1,
                    ..Settings::default()
                },
                ..input(&table, &specs, &stacks, &names)
            },
            &mut FakeSymbols,
        );
        let flags: Vec<(u64, bool)> = report
            .sites
            .iter()
            .map(|s| (s.live_bytes, s.internal))
            .collect();
        assert_eq!(flags, vec![(10, false), (1 << 20, true)]);
    }

    #[test]
    fn frames_symbolized_and_truncated_to_depth() {
        let report = sample();
        let frames = &report.sites[1].frames;
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].addr, "0x1100");
        assert_eq!(frames[0].symbol.as_deref(), Some("fn_100"));
        assert_eq!(frames[0].module.as_deref(), Some("/bin/app"));
        assert_eq!(frames[0].offset.as_deref(), Some("0x100"));
    }

    #[test]
    fn json_has_the_contract_keys() {
        let value = serde_json::to_value(sample()).expect("serializes");
        for key in ["target", "duration_ms", "events", "totals", "sites"] {
            assert!(value.get(key).is_some(), "missing {key}");
        }
        for key in [
            "allocs",
            "frees",
            "lost",
            "unmatched_frees",
            "stack_failures",
        ] {
            assert!(value["events"].get(key).is_some(), "missing events.{key}");
        }
        let site = &value["sites"][0];
        for key in [
            "allocator",
            "live_bytes",
            "live_count",
            "oldest_age_ms",
            "frames",
        ] {
            assert!(site.get(key).is_some(), "missing sites[].{key}");
        }
        assert_eq!(site["allocator"], "cuda");
        assert_eq!(site["memory"], "device");
        for key in ["addr", "symbol", "module", "file", "line"] {
            assert!(
                site["frames"][0].get(key).is_some(),
                "missing frames[].{key}"
            );
        }
        assert_eq!(value["target"]["comm"], "app");
    }

    #[test]
    fn lost_events_mark_the_report_incomplete() {
        let specs = specs();
        let table = LiveTable::new(10);
        let stacks = StackStore::default();
        let names = HashMap::new();
        let input = ReportInput {
            target: TargetInfo::default(),
            kernel_counters: [
                ("ringbuf_full".to_string(), 5),
                ("stack_fault".to_string(), 2),
            ]
            .into_iter()
            .collect(),
            ..input(&table, &specs, &stacks, &names)
        };
        let report = build(input, &mut FakeSymbols);
        assert!(!report.complete);
        assert_eq!(report.events.lost, 5);
        assert_eq!(report.events.stack_failures, 2);
        assert!(report
            .notes
            .iter()
            .any(|n| n.contains("5 events were lost")));
    }

    #[test]
    fn unmatched_frees_under_a_size_filter_get_a_note_not_a_warning() {
        let specs = specs();
        let mut table = LiveTable::new(10);
        table.apply(&alloc(0, 0x100, 1000, 1, 0), Domain::Heap);
        // Two frees of blocks the kernel filtered out (too small to trace).
        for addr in [0x300, 0x400] {
            let free = Event {
                ts_ns: 5,
                pid: 1,
                tid: 7,
                spec: 0,
                py_stack: 0,
                action: Action::Free { addr },
            };
            table.apply(&free, Domain::Heap);
        }
        let stacks = StackStore::default();
        let names = HashMap::new();
        let build_with = |settings: Settings| {
            let input = ReportInput {
                target: TargetInfo::default(),
                kernel_counters: [("filtered".to_string(), 7)].into_iter().collect(),
                settings,
                ..input(&table, &specs, &stacks, &names)
            };
            build(input, &mut FakeSymbols)
        };
        let filtered = build_with(Settings {
            min_size: 500,
            ..Settings::default()
        });
        assert_eq!(filtered.events.unmatched_frees, 2);
        // Expected frees do not make the report incomplete.
        assert!(filtered.complete);
        let note = filtered
            .notes
            .iter()
            .find(|n| n.contains("unmatched frees are expected"))
            .expect("a note");
        assert!(note.starts_with("2 unmatched frees"), "{note}");
        assert!(note.contains(">= 500 bytes"), "{note}");
        assert!(note.contains("skipped 7"), "{note}");
        let ranged = build_with(Settings {
            min_size: 16,
            max_size: Some(4096),
            ..Settings::default()
        });
        assert!(
            ranged.notes.iter().any(|n| n.contains("16..=4096 bytes")),
            "{:?}",
            ranged.notes
        );
        // No filter: unmatched frees are blocks from before the attach, no note.
        let plain = build_with(Settings::default());
        assert!(plain.notes.iter().all(|n| !n.contains("unmatched")));
    }
}
