//! How a [`Report`] is built from the live table, the stack store and the
//! counters, one step per function: [`allow_list_symbols`], [`tally_blocks`]
//! (totals, processes, set-aside, sites), [`judge_sites`] (trend, pattern,
//! rank, `--top`), [`symbolize_shown`], [`site_reports`], then the counters
//! ([`failed_calls`], [`event_counts`], [`truncations_by_cause`]), the
//! [`notes`] and the process list.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::*;
use crate::analysis::history::SiteKey;
use crate::analysis::{
    accumulation_rate, classify, classify_trend, survived_intervals, suspicion_rank, BlockFacts,
    TrendVerdict,
};
use crate::event::StackRef;
use crate::probe::maps::FileAddr;
use crate::symbolize::{SymInfo, Symbolize};
use crate::table::Counts;

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
    /// The leak check's split of its blocks.
    leak: LeakSplit,
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

/// Builds the report, symbolizing the frames of the sites shown: the blocks
/// tallied into sites and totals, the sites judged and ranked, the shown
/// ones symbolized, then the counters, the processes and the notes.
pub fn build(input: ReportInput<'_>, symbolizer: &mut dyn Symbolize) -> Report {
    let depth = input.settings.stack_depth as usize;
    let mut symbols = allow_list_symbols(&input, depth, symbolizer);
    let tally = tally_blocks(&input, &symbols);
    let judged = judge_sites(&input, tally.sites, &tally.per_process);
    symbolize_shown(&judged, input.stacks, depth, &mut symbols, symbolizer);
    let rate = u64::from(input.settings.sample_rate.max(1));
    // Each site's block sizes (glibc's heap: for the blocks from before the
    // attach of the same size).
    let site_sizes: Vec<Vec<u64>> = judged
        .iter()
        .map(|(key, acc, ..)| {
            if key.0 == Allocator::Libc {
                acc.blocks.iter().map(|&(_, size)| size).collect()
            } else {
                Vec::new()
            }
        })
        .collect();
    let sites = site_reports(judged, &input, depth, &symbols, rate);
    let site_sizes = &site_sizes[..site_sizes.len().min(sites.len())];

    let counts = input.table.counts();
    let failed_calls = failed_calls(&input, counts);
    let lost_by_cause = pick_counters(&input.kernel_counters, LOST_CAUSES);
    let stack_failures_by_cause = pick_counters(&input.kernel_counters, STACK_CAUSES);
    let lost: u64 = lost_by_cause.values().sum();
    let events = event_counts(
        counts,
        &input.kernel_counters,
        lost,
        &stack_failures_by_cause,
        &failed_calls,
    );
    let stack_truncations_by_cause = truncations_by_cause(&input.kernel_counters);
    let more_notes = notes(
        &input,
        counts.unmatched_frees,
        lost,
        rate,
        tally.young,
        &stack_truncations_by_cause,
    );
    let mut notes = input.notes;
    notes.extend(more_notes);
    let suppressed = suppressed_summary(tally.suppressed);
    let processes = process_list(input.processes, &input.target, tally.per_process);
    Report {
        stack_truncations_by_cause,
        unwind: None,
        function_cache: None,
        bpf_programs: Vec::new(),
        device_cache: None,
        usdt: Vec::new(),
        push: None,
        otlp: None,
        target: input.target,
        duration_ms: input.duration_ms,
        interim: false,
        complete: lost == 0 && counts.table_full == 0 && input.attach_failures.is_empty(),
        events,
        lost_by_cause,
        stack_failures_by_cause,
        totals: totals_list(tally.totals),
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
        leak_check: input.leak_check.map(|(check, _)| {
            let mut check = check.clone();
            if check.ran {
                check.failed_gates = super::leak::failed_gates(input.leak_gates, &tally.leak);
            }
            if let Some(before) = check.before_attach.as_mut() {
                for group in &mut before.groups {
                    group.same_size_as_site = same_size_site(group.size, site_sizes);
                }
            }
            check
        }),
    }
}

/// Symbols of every stack, when the allow-list matches on them (empty otherwise).
fn allow_list_symbols(
    input: &ReportInput<'_>,
    depth: usize,
    symbolizer: &mut dyn Symbolize,
) -> HashMap<FileAddr, SymInfo> {
    let needs_symbols = input.suppressions.is_some_and(Suppressions::needs_symbols);
    let mut symbols: HashMap<FileAddr, SymInfo> = HashMap::new();
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
    symbols
}

/// The live blocks counted once: per allocator (totals), per process, set
/// aside (warm-up, allow-list), young, and per site (those old enough).
#[derive(Default)]
struct Tally {
    totals: BTreeMap<(Allocator, Memory), (u64, u64)>,
    sites: HashMap<SiteKey, SiteAcc>,
    suppressed: BTreeMap<String, (u64, u64)>,
    per_process: BTreeMap<u32, (u64, u64)>,
    /// Live blocks made in the window's last second (bytes, count).
    young: (u64, u64),
    /// The leak check's split of the blocks not set aside (for `--fail-on`).
    leak: LeakSplit,
}

/// The usable size glibc gives a request of `size` bytes (64-bit): from
/// a heap chunk (16-byte granules, 24 at least), or a chunk of its own
/// (mmapped: whole pages).
fn glibc_usable(size: u64) -> [u64; 2] {
    let chunk = ((size + 8 + 15) & !15).max(32);
    let mapped = ((size + 16 + 4095) & !4095) - 16;
    [chunk - 8, mapped]
}

/// The first site (1-based rank among `sites`' block sizes) with a block
/// glibc made `usable` bytes long.
fn same_size_site(usable: u64, sites: &[Vec<u64>]) -> Option<usize> {
    sites
        .iter()
        .position(|sizes| sizes.iter().any(|&s| glibc_usable(s).contains(&usable)))
        .map(|k| k + 1)
}

/// One pass over the live table: totals, processes, what is set aside, and
/// the sites the rest belong to.
fn tally_blocks(input: &ReportInput<'_>, symbols: &HashMap<FileAddr, SymInfo>) -> Tally {
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
    let seconds = |ts: u64| ts.saturating_sub(input.started_ns) as f64 / 1e9;
    let mut tally = Tally::default();
    let verdicts = input.leak_check.map(|(_, verdicts)| verdicts);
    for (pid, domain, addr, block) in input.table.blocks() {
        let Some(entry) = spec(block.spec) else {
            continue;
        };
        let verdict = verdicts.and_then(|v| v.of_block(pid, domain, addr, block.ts_ns));
        let held = tally.per_process.entry(pid).or_insert((0, 0));
        held.0 += block.size;
        held.1 += 1;
        let total = tally
            .totals
            .entry((entry.allocator, entry.memory))
            .or_insert((0, 0));
        total.0 += block.size;
        total.1 += 1;
        if let Some(reason) = suppression(input, entry, addr, block, warmup_until, symbols) {
            let slot = tally.suppressed.entry(reason).or_insert((0, 0));
            slot.0 += block.size;
            slot.1 += 1;
            continue;
        }
        if let Some(category) = verdict {
            tally.leak.add(category, block.size);
        }
        let age_ns = input.now_ns.saturating_sub(block.ts_ns);
        if age_ns < min_age_ns {
            continue;
        }
        if age_ns < YOUNG_NS {
            tally.young.0 += block.size;
            tally.young.1 += 1;
        }
        let site = tally
            .sites
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
        if let Some(category) = verdict {
            site.leak.add(category, block.size);
        }
    }
    tally
}

/// Each site's trend, pattern and accumulation judged, the sites ranked by
/// suspicion, the `--top` kept.
fn judge_sites(
    input: &ReportInput<'_>,
    sites: HashMap<SiteKey, SiteAcc>,
    per_process: &BTreeMap<u32, (u64, u64)>,
) -> Vec<Judged> {
    let trace_s = input.duration_ms as f64 / 1000.0;
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
    let checked = input.leak_check.is_some_and(|(check, _)| check.ran);
    judged.sort_by(|a, b| {
        // After a leak check, proven leaks first: definitely lost bytes,
        // then indirectly, then possibly lost.
        let proven = |acc: &SiteAcc| {
            if checked {
                (
                    std::cmp::Reverse(acc.leak.definitely_lost.bytes),
                    std::cmp::Reverse(acc.leak.indirectly_lost.bytes),
                    std::cmp::Reverse(acc.leak.possibly_lost.bytes),
                )
            } else {
                Default::default()
            }
        };
        proven(&a.1).cmp(&proven(&b.1)).then_with(|| {
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
        })
    });
    judged.truncate(input.settings.top);
    judged
}

/// Symbolizes the frames of the sites shown that are not symbolized yet.
fn symbolize_shown(
    judged: &[Judged],
    stacks: &StackStore,
    depth: usize,
    symbols: &mut HashMap<FileAddr, SymInfo>,
    symbolizer: &mut dyn Symbolize,
) {
    let wanted: Vec<FileAddr> = judged
        .iter()
        .filter_map(|((_, _, stack, _), ..)| match stack {
            StackRef::Id(id) => stacks.get(*id),
            _ => None,
        })
        .flat_map(|frames| frames.iter().take(depth).filter_map(|f| f.file.clone()))
        .filter(|addr| !symbols.contains_key(addr))
        .collect();
    symbols.extend(wanted.iter().cloned().zip(symbolizer.symbolize(&wanted)));
}

/// Whether `allocator`'s sizes are estimates (a sampler's weighted bytes).
fn estimated(input: &ReportInput<'_>, allocator: Allocator) -> bool {
    input
        .specs
        .iter()
        .any(|spec| spec.estimate && spec.allocator == allocator)
}

/// The sites shown, in rank order: frames (native and Python merged),
/// figures, estimates under sampling, threads and history.
fn site_reports(
    judged: Vec<Judged>,
    input: &ReportInput<'_>,
    depth: usize,
    symbols: &HashMap<FileAddr, SymInfo>,
    rate: u64,
) -> Vec<Site> {
    let seconds = |ts: u64| ts.saturating_sub(input.started_ns) as f64 / 1e9;
    let interval_ends: &[f64] = input.history.map_or(&[], |h| h.interval_ends.as_slice());
    judged
        .into_iter()
        .map(
            |((allocator, memory, stack, py), acc, verdict, pattern, internal, _)| {
                let (frames, stack_note) = site_frames(stack, input.stacks, depth, symbols);
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
                    // A sampler's weighted bytes are the estimate itself.
                    estimated_live_bytes: (rate > 1 || estimated(input, allocator))
                        .then(|| acc.live_bytes.saturating_mul(rate)),
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
                    leak_check: input
                        .leak_check
                        .filter(|(check, _)| check.ran)
                        .map(|_| acc.leak),
                }
            },
        )
        .collect()
}

/// Live bytes and blocks per allocator and memory kind.
fn totals_list(totals: BTreeMap<(Allocator, Memory), (u64, u64)>) -> Vec<Total> {
    totals
        .into_iter()
        .map(|((allocator, memory), (live_bytes, live_count))| Total {
            allocator,
            memory,
            live_bytes,
            live_count,
        })
        .collect()
}

/// Failed allocator calls by function and return code.
fn failed_calls(input: &ReportInput<'_>, counts: &Counts) -> Vec<FailedCall> {
    let spec = |index: u16| input.specs.get(usize::from(index));
    counts
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
        .collect()
}

/// The kernel counters named in `causes` (0 when absent).
fn pick_counters(
    kernel_counters: &BTreeMap<String, u64>,
    causes: &[&str],
) -> BTreeMap<String, u64> {
    causes
        .iter()
        .map(|c| (c.to_string(), kernel_counters.get(*c).copied().unwrap_or(0)))
        .collect()
}

/// The event counts: the table's, plus what the kernel settled itself.
fn event_counts(
    counts: &Counts,
    kernel_counters: &BTreeMap<String, u64>,
    lost: u64,
    stack_failures_by_cause: &BTreeMap<String, u64>,
    failed_calls: &[FailedCall],
) -> EventCounts {
    let kernel = |name: &str| kernel_counters.get(name).copied().unwrap_or(0);
    let settled = kernel("settled_in_kernel");
    EventCounts {
        allocs: counts.allocs + settled,
        frees: counts.frees + settled,
        settled_in_kernel: settled,
        lost,
        unmatched_frees: counts.unmatched_frees,
        releases_seen_twice: counts.releases_seen_twice + kernel("settled_seen_twice"),
        stack_failures: stack_failures_by_cause.values().sum(),
        failed_calls: failed_calls.iter().map(|f| f.count).sum(),
        table_full: counts.table_full,
        mappings_trimmed: counts.mappings_trimmed,
        unmaps_untracked: counts.unmaps_untracked,
        addresses_reused: counts.addresses_reused,
    }
}

/// Stacks cut short, by cause name.
fn truncations_by_cause(kernel_counters: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    TRUNCATION_CAUSES
        .iter()
        .map(|(counter, name)| {
            (
                name.to_string(),
                kernel_counters.get(*counter).copied().unwrap_or(0),
            )
        })
        .collect()
}

/// The notes the build adds after the session's own, in this order: lost
/// events, unattached functions, sampling, young blocks, a size filter's
/// unmatched frees, truncated stacks.
fn notes(
    input: &ReportInput<'_>,
    unmatched_frees: u64,
    lost: u64,
    rate: u64,
    young: (u64, u64),
    stack_truncations_by_cause: &BTreeMap<String, u64>,
) -> Vec<String> {
    let mut notes = Vec::new();
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
    let mut sampled: Vec<&str> = input
        .specs
        .iter()
        .filter(|spec| spec.estimate)
        .map(|spec| spec.allocator.name())
        .collect();
    sampled.sort_unstable();
    sampled.dedup();
    if !sampled.is_empty() {
        notes.push(format!(
            "{}: bytes are estimates: each sampled allocation counts the bytes its probe says it stands for (weighted_bytes), its sites carry them as estimated_live_bytes",
            sampled.join(", ")
        ));
    }
    if let Some(note) = young_note(young) {
        notes.push(note);
    }
    if let Some(note) = size_filter_note(&input.settings, unmatched_frees, &input.kernel_counters) {
        notes.push(note);
    }
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
    notes
}

/// What was set aside, in all and per allow-list entry (or `warmup`).
fn suppressed_summary(suppressed: BTreeMap<String, (u64, u64)>) -> Suppressed {
    Suppressed {
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
    }
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
    symbols: &HashMap<FileAddr, SymInfo>,
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
    let infos: Vec<Option<&SymInfo>> = frames
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
    symbols: &HashMap<FileAddr, SymInfo>,
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
                            inlined: info.map(|i| i.inlined.clone()).unwrap_or_default(),
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
mod tests;
