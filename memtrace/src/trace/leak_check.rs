//! When the leak check runs and how its result joins the report.
//!
//! By pid (`--leak-check`): at the final report and at each `--interval`
//! report, every traced process is stopped ([`crate::tracee::stop`]), the
//! events made before the stop are drained into the live table (so the
//! table is exactly the memory's state), each process is judged, and the
//! threads resume. In launch mode the check runs by default when the
//! command is about to exit (its memory intact, its exiting thread's
//! registers read by the supervisor), as valgrind and LeakSanitizer do.
//!
//! A judgement: the nodes are the process's live blocks in the table (host
//! blocks are scanned when reached, device blocks never; mappings and
//! handles are not judged: mappings are roots, as in valgrind); the roots
//! come from [`crate::tracee::roots`]; [`crate::reach`] splits the blocks.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use aya::maps::{MapData, RingBuf};

use super::before_attach;
use super::leak_explain::{self, ExplainTarget};
use super::loader::Probes;
use super::session::Session;
use crate::probe::catalog::{Allocator, Domain, Memory};
use crate::probe::SpecEntry;
use crate::reach::{self, Category, Node};
use crate::report::leak::{
    Amount, BeforeAttach, CheckMode, CheckPoint, Explanation, LeakCheck, LeakSplit, LeakState,
    LeakVerdicts, VerdictRun,
};
use crate::report::LOST_CAUSES;
use crate::stacks::StackStore;
use crate::table::LiveTable;
use crate::tracee::glibc_heap;
use crate::tracee::maps::Mapping;
use crate::tracee::roots::{self, RootOptions};
use crate::tracee::snapshot::{self, Snapshot};
use crate::tracee::stop::{ProcessMemory, Stopped, StoppedThread};

/// How often the ring is read while a snapshot is scanned.
const SCAN_POLL: Duration = Duration::from_millis(10);
/// How long a thread may take to reach its stop before the check gives up.
const STOP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a process whose heap walk met a locked arena runs before it is
/// stopped again, once (the thread inside malloc leaves it meanwhile).
const LOCKED_ARENA_RESUME: Duration = Duration::from_millis(10);

/// One process judged.
#[derive(Default)]
struct Judgement {
    pid: u32,
    split: LeakSplit,
    heuristics: BTreeMap<String, Amount>,
    not_judged: Amount,
    scanned: u64,
    unreadable: u64,
    skipped: u64,
    verdicts: Vec<VerdictRun>,
    explanations: Vec<Explanation>,
    before_attach: Option<BeforeAttach>,
    /// The heap walk met an arena locked (a thread stopped inside malloc).
    arena_locked: bool,
}

/// Why a process was not judged.
enum Refused {
    /// Events were lost or the table is full: no process can be judged.
    NotExact(String),
    /// It could not be stopped.
    Stop(String),
    /// It could not be read (it exited).
    Process(String),
}

/// How one process was read.
#[derive(Default)]
struct Reading {
    /// When the process was stopped (`CLOCK_MONOTONIC` ns).
    stopped_at_ns: u64,
    mode: Option<CheckMode>,
    fallback: Option<String>,
    threads: usize,
    pause: Duration,
    clone: Duration,
    clone_estimate: Option<Duration>,
    scan: Duration,
    copied: u64,
}

impl Reading {
    /// Adds this process's reading to the check's summary.
    fn note(&self, summary: &mut LeakCheck) {
        summary.mode = match (summary.mode, self.mode) {
            (Some(CheckMode::Stopped), _) | (_, Some(CheckMode::Stopped)) => {
                Some(CheckMode::Stopped)
            }
            (a, b) => b.or(a),
        };
        if summary.fallback.is_none() {
            summary.fallback.clone_from(&self.fallback);
        }
        summary.clone_ms += self.clone.as_secs_f64() * 1000.0;
        if let Some(estimate) = self.clone_estimate {
            *summary.clone_estimate_ms.get_or_insert(0.0) += estimate.as_secs_f64() * 1000.0;
        }
        summary.scan_ms += self.scan.as_secs_f64() * 1000.0;
        summary.copied_at_stop_bytes += self.copied;
    }
}

/// Takes the snapshot of stopped process `prepared.pid`: the ranges a
/// child would not show copied first, then the clone; the child's memory
/// as the scan reads it (through `/proc/PID/mem`, the copies served
/// instead of the child's), and the bytes copied.
fn take_snapshot(
    prepared: &Prepared,
    stopped: &Stopped,
    plan: &mut snapshot::Plan,
) -> Result<(Snapshot, ProcessMemory, u64), String> {
    let pid = prepared.pid;
    plan.refresh(pid, &prepared.mappings)?;
    let ranges = plan.to_copy(&prepared.mappings)?;
    let copies = ProcessMemory::new(pid).copy_ranges(&ranges);
    let copied = copies.iter().map(|(_, b)| b.len() as u64).sum();
    let taken = Snapshot::take(pid, &stopped.threads, &prepared.mappings, plan)?;
    let memory = ProcessMemory::new(taken.child)
        .with_copies(copies)
        .through_proc_mem()
        .map_err(|err| format!("the snapshot's memory cannot be opened: {err}"))?;
    Ok((taken, memory, copied))
}

/// What the judge needs besides the process.
struct JudgeInput<'a> {
    table: &'a LiveTable,
    specs: &'a [SpecEntry],
    stacks: &'a StackStore,
    /// The table holds every block since the process began.
    complete: bool,
    /// `--leak-check-explain`.
    explain: &'a [ExplainTarget],
    /// Walk glibc's heap: the blocks from before the attach become nodes.
    heap_walk: bool,
}

/// File names of GPU/NPU runtime and driver libraries, whose own memory
/// never keeps a device block reachable (a real driver records every
/// allocation's address in its tables).
fn runtime_name(name: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "libcuda.so",
        "libcudart.so",
        "libnvidia-",
        "libnvcuvid",
        "libascendcl.so",
        "libascend_hal.so",
        "libruntime.so",
        "libacl_",
        "libhccl",
    ];
    PREFIXES.iter().any(|p| name.starts_with(p))
}

fn file_name(path: &Path) -> &str {
    path.file_name().and_then(|n| n.to_str()).unwrap_or("")
}

/// Whether memory of `memory` kind is judged, and whether it is scanned.
fn node_kind(entry: &SpecEntry) -> Option<bool> {
    if entry.allocator == Allocator::Mmap {
        return None;
    }
    match entry.memory {
        Memory::Host | Memory::Pinned => Some(true),
        Memory::Device | Memory::Managed => Some(false),
        Memory::Handle => None,
    }
}

/// What the judge reads of one process, taken while it is stopped: the
/// judgement itself may then read a snapshot while the process runs.
struct Prepared {
    pid: u32,
    threads: Vec<StoppedThread>,
    mappings: Vec<Mapping>,
    /// Its blocks in the table, in the table's order: (domain, address).
    nodes: Vec<Node>,
    /// The domain of the nodes from each index on (its first node's).
    domains: Vec<(usize, Domain)>,
    not_judged: Amount,
    /// File names of the objects defining a device allocator memtrace probes.
    device_modules: Vec<String>,
    complete: bool,
    explain: Vec<ExplainTarget>,
    heap_walk: bool,
}

/// Reads what the judge needs of stopped process `pid`: its blocks in the
/// table, its mappings; an error (one line) when it exited.
fn prepare(
    pid: u32,
    threads: &[StoppedThread],
    input: &JudgeInput<'_>,
) -> Result<Prepared, String> {
    // The runtime libraries: by name, and every object defining a device
    // allocator memtrace probes.
    let device_modules: Vec<String> = input
        .specs
        .iter()
        .filter(|s| matches!(s.memory, Memory::Device | Memory::Managed | Memory::Pinned))
        .filter_map(|s| s.module)
        .map(|m| file_name(Path::new(m)).to_string())
        .collect();
    let runtime_library = |path: &Path| {
        runtime_name(file_name(path)) || device_modules.iter().any(|m| m == file_name(path))
    };
    let taken = Instant::now();
    let mut nodes = Vec::new();
    let mut domains: Vec<(usize, Domain)> = Vec::new();
    let mut runtime_stacks: foldhash::HashMap<u32, bool> = Default::default();
    let mut not_judged = Amount::default();
    for (owner, domain, addr, block) in input.table.blocks() {
        if owner != pid {
            continue;
        }
        let Some(entry) = input.specs.get(usize::from(block.spec)) else {
            continue;
        };
        let Some(scan) = node_kind(entry) else {
            not_judged.add(block.size);
            continue;
        };
        // Per call stack, not per block (10M blocks come from a few sites).
        let runtime_owned = scan
            && match block.stack() {
                crate::event::StackRef::Id(id) => *runtime_stacks.entry(id).or_insert_with(|| {
                    input
                        .stacks
                        .get(id)
                        .and_then(|frames| frames.first())
                        .and_then(|frame| frame.file.as_ref())
                        .is_some_and(|file| runtime_library(&file.module))
                }),
                _ => false,
            };
        if domains.last().is_none_or(|&(_, d)| d != domain) {
            domains.push((nodes.len(), domain));
        }
        nodes.push(Node::new(addr, block.size, scan, runtime_owned));
    }
    log::debug!(
        "leak check of pid {pid}: {} blocks taken from the table in {:.1} ms",
        nodes.len(),
        taken.elapsed().as_secs_f64() * 1000.0
    );
    let Ok(mappings) = crate::tracee::maps::read_raw(pid) else {
        return Err(format!(
            "pid {pid} exited during the check: nothing of it is judged"
        ));
    };
    Ok(Prepared {
        pid,
        threads: threads.to_vec(),
        mappings,
        nodes,
        domains,
        not_judged,
        device_modules,
        complete: input.complete,
        explain: input.explain.to_vec(),
        heap_walk: input.heap_walk,
    })
}

/// Judges a prepared process, reading its memory through `memory` (the
/// process itself, stopped, or its snapshot); an error (one line) when it
/// could not be read (it exited meanwhile: killed while stopped).
fn judge(prepared: &Prepared, mut memory: ProcessMemory) -> Result<Judgement, String> {
    let pid = prepared.pid;
    let threads = &prepared.threads[..];
    let mappings = &prepared.mappings;
    let runtime_library = |path: &Path| {
        runtime_name(file_name(path))
            || prepared.device_modules.iter().any(|m| m == file_name(path))
    };
    let mut judgement = Judgement {
        pid,
        not_judged: prepared.not_judged,
        ..Judgement::default()
    };
    // Borrowed (10M traced blocks: 160 MB of nodes), copied only when the
    // walk adds its blocks.
    let mut nodes: Cow<'_, [Node]> = Cow::Borrowed(&prepared.nodes);
    let memory_pid = memory.pid;
    let gone = || {
        if memory_pid != pid {
            format!("the snapshot of pid {pid} was killed during the scan: nothing of it is judged")
        } else {
            format!("pid {pid} exited during the check: nothing of it is judged")
        }
    };
    let stack_starts: Vec<u64> = threads.iter().map(StoppedThread::stack_from).collect();
    // glibc's heap walked: its blocks from before the attach become nodes
    // (after the traced ones), the heaps walked and glibc's own blocks no
    // roots.
    let mut excluded: Vec<(u64, u64)> = Vec::new();
    let mut phase = Phases::new(pid);
    let walk_started = Instant::now();
    let mut walked = prepared.heap_walk.then(|| {
        let sps: Vec<u64> = threads.iter().map(|t| t.sp).collect();
        let mut walked = before_attach::walk(pid, mappings, &sps, &mut memory);
        if memory.skipped > 0 {
            // Reads past the deadline give nothing: said as what it is, not
            // as the unreadable chunk the walk then met.
            let cut = "the walk was cut at --leak-check-max-pause".to_string();
            match &mut walked {
                Ok(walk) => walk.partial.insert(0, cut),
                Err(reason) => *reason = format!("{cut} ({reason})"),
            }
        }
        walked
    });
    let walk_ms = walk_started.elapsed().as_secs_f64() * 1000.0;
    phase.done("heap walk");
    // The traced blocks' ranges (the walked ones lie in the heaps walked,
    // excluded whole from the roots: 160 MB less for 10M blocks).
    let mut scanned_ranges: Vec<(u64, u64)> = nodes
        .iter()
        .filter(|n| n.scan())
        .map(|n| (n.start, n.start.saturating_add(n.size())))
        .collect();
    if !scanned_ranges.is_sorted() {
        scanned_ranges.sort_unstable();
    }
    if let Some(Ok(walk)) = &mut walked {
        judgement.arena_locked = walk.locked;
        let mut traced: Vec<u64> = nodes.iter().map(|n| n.start).collect();
        traced.sort_unstable();
        // Both in address order: one pass over the two. The chunks become
        // nodes in place (both 16 bytes), the traced nodes put before them.
        let mut next_traced = traced.iter().peekable();
        let mut with_walked: Vec<Node> = walk
            .take_chunks()
            .into_iter()
            .filter(|c| {
                while next_traced.next_if(|&&t| t < c.start).is_some() {}
                next_traced.peek() != Some(&&c.start)
            })
            .map(|c| Node::host(c.start, c.size))
            .collect();
        with_walked.splice(0..0, nodes.iter().copied());
        nodes = Cow::Owned(with_walked);
        excluded.extend_from_slice(&walk.walked);
        excluded.extend_from_slice(&walk.metadata);
    }
    // glibc's own memory: main_arena's chunk pointers (false interior
    // pointers into the block before each chunk) always; its heaps when
    // every block in them is a node.
    phase.done("pre-attach nodes");
    let symbol = before_attach::main_arena_symbol(pid, mappings);
    excluded.extend(glibc_heap::main_arena_pointers(
        mappings,
        &mut memory,
        symbol,
    ));
    if prepared.complete {
        excluded.extend(glibc_heap::heap_extents(
            mappings,
            &scanned_ranges,
            &mut memory,
        ));
    }
    let roots = roots::roots(
        mappings,
        &RootOptions {
            stack_starts: &stack_starts,
            excluded: &excluded,
            nodes: &scanned_ranges,
            runtime_library: &runtime_library,
        },
    );
    // (160 MB for 10M blocks: not kept through the marking.)
    drop(scanned_ranges);
    let registers: Vec<u64> = threads.iter().flat_map(StoppedThread::root_words).collect();
    let vtable = roots::vtable_predicate(mappings);
    phase.done("roots");
    let scan_started = Instant::now();
    log::info!(
        "leak check of pid {pid}: {} nodes, {} root regions ({} bytes)",
        nodes.len(),
        roots.len(),
        roots.iter().map(|r| r.len).sum::<u64>()
    );
    let outcome = reach::classify(
        &reach::Input {
            nodes: &nodes,
            roots: &roots,
            registers: &registers,
            vtable: &vtable,
            provenance: !prepared.explain.is_empty(),
            // A pre-attach block's type is named by its first word.
            first_words: walked.is_some(),
        },
        &mut memory,
    );
    log::info!(
        "leak check of pid {pid}: {} bytes scanned in {} ms ({} read ahead)",
        outcome.scanned_bytes,
        scan_started.elapsed().as_millis(),
        memory.read_ahead()
    );
    if memory.gone || !crate::tracee::is_alive(memory_pid) {
        return Err(gone());
    }
    phase.done("marking");
    judgement.scanned = outcome.scanned_bytes;
    judgement.unreadable = memory.unreadable;
    judgement.skipped = memory.skipped;
    let cut = memory.skipped > 0;
    let traced = prepared.nodes.len();
    if let Some(walked) = &walked {
        for (node, verdict) in nodes[traced..].iter().zip(&outcome.verdicts[traced..]) {
            if cut && verdict.category != Category::StillReachable {
                judgement.not_judged.add(node.size());
            } else {
                judgement.split.add(verdict.category, node.size());
            }
        }
        // Each block's first word, as the scan read it (pre-attach blocks
        // are 24 bytes or more): a vtable pointer names its type.
        let mut types = before_attach::TypeNames::new(pid, mappings);
        let blocks = nodes[traced..]
            .iter()
            .zip(&outcome.verdicts[traced..])
            .zip(&outcome.first_words[traced..])
            .filter(|((_, v), _)| !cut || v.category == Category::StillReachable)
            .map(|((n, v), &word)| before_attach::Block {
                size: n.size(),
                category: v.category,
                type_name: types.of(word),
            });
        judgement.before_attach = Some(before_attach::summary(
            walked,
            walk_ms,
            blocks,
            before_attach::notes(mappings),
        ));
        phase.done("pre-attach summary");
    }
    if !prepared.explain.is_empty() {
        let categories: Vec<Category> = outcome.verdicts.iter().map(|v| v.category).collect();
        judgement.explanations = leak_explain::Context {
            pid,
            nodes: &nodes,
            categories: &categories,
            marks: &outcome.marks,
            mappings,
            threads,
        }
        .explain(&prepared.explain);
    }
    // The traced blocks' verdicts, a run per domain (the walked blocks
    // have none: the table does not hold them).
    for (k, &(first, domain)) in prepared.domains.iter().enumerate() {
        let end = prepared
            .domains
            .get(k + 1)
            .map_or(traced, |&(next, _)| next);
        let mut run = VerdictRun::new(pid, domain, end - first);
        for (node, verdict) in nodes[first..end].iter().zip(&outcome.verdicts[first..end]) {
            let size = node.size();
            // A scan cut short proves only what it reached.
            if cut && verdict.category != Category::StillReachable {
                judgement.not_judged.add(size);
                continue;
            }
            judgement.split.add(verdict.category, size);
            if let Some(heuristic) = verdict.heuristic {
                judgement
                    .heuristics
                    .entry(heuristic.name().to_string())
                    .or_default()
                    .add(size);
            }
            run.push(node.start, verdict.category);
        }
        judgement.verdicts.push(run);
    }
    phase.done("verdicts");
    Ok(judgement)
}

/// Each phase of a judgement's time, logged (`-vv`): where a slow check
/// spends it.
struct Phases {
    pid: u32,
    last: Instant,
}

impl Phases {
    fn new(pid: u32) -> Phases {
        Phases {
            pid,
            last: Instant::now(),
        }
    }

    fn done(&mut self, what: &str) {
        let now = Instant::now();
        log::debug!(
            "leak check of pid {}: {what} took {:.1} ms",
            self.pid,
            (now - self.last).as_secs_f64() * 1000.0
        );
        self.last = now;
    }
}

/// Starts a new check's result (by pid: each check replaces the last).
fn begin(state: &mut LeakState, when: CheckPoint) {
    state.verdicts = LeakVerdicts::default();
    state.summary = Some(LeakCheck {
        ran: true,
        when: Some(when),
        ..LeakCheck::default()
    });
}

/// Adds one process's judgement to the current result.
fn add(state: &mut LeakState, judgement: Judgement, threads: usize, judged_at_ns: u64) {
    let pid = judgement.pid;
    let Some(summary) = state.summary.as_mut() else {
        return;
    };
    summary.split.merge(&judgement.split);
    for (name, amount) in judgement.heuristics {
        summary
            .reachable_via_heuristic
            .entry(name)
            .or_default()
            .merge(amount);
    }
    summary.not_judged.merge(judgement.not_judged);
    summary.scanned_bytes += judgement.scanned;
    summary.unreadable_bytes += judgement.unreadable;
    summary.skipped_bytes += judgement.skipped;
    summary.threads += threads as u64;
    summary.processes += 1;
    summary.explain.extend(judgement.explanations);
    if let Some(before) = judgement.before_attach {
        match summary.before_attach.as_mut() {
            Some(all) => {
                all.split.merge(&before.split);
                all.groups.extend(before.groups);
                all.notes.extend(before.notes);
            }
            None => summary.before_attach = Some(before),
        }
    }
    let kept = Instant::now();
    state.verdicts.add(judgement.verdicts, pid, judged_at_ns);
    log::debug!(
        "leak check of pid {pid}: verdicts kept in {:.1} ms",
        kept.elapsed().as_secs_f64() * 1000.0
    );
}

/// Events lost so far, all causes.
fn lost(probes: &Probes) -> u64 {
    let counters = probes.counters();
    LOST_CAUSES
        .iter()
        .map(|c| counters.get(*c).copied().unwrap_or(0))
        .sum()
}

impl Session<'_> {
    /// Whether leak checks were asked for (`--leak-check`, `--fail-on`, or
    /// launch mode without `--no-leak-check`).
    pub fn leak_check_enabled(&self) -> bool {
        let args = self.args;
        if args.no_leak_check {
            return false;
        }
        args.leak_check
            || !args.fail_on.is_empty()
            || !args.leak_check_explain.is_empty()
            || !args.command.is_empty()
    }

    /// Whether the table holds every block `pid` ever made and kept: the
    /// launched command itself, traced from its first instruction, with
    /// nothing sampled, filtered or lost.
    fn table_complete(&self, pid: u32, probes: &Probes) -> bool {
        let args = self.args;
        !args.command.is_empty()
            && pid == self.target.pid
            && args.sample_rate == 1
            && args.min_size == 0
            && args.max_size.is_none()
            && (args.allocators.is_empty() || args.allocators.iter().any(|a| a == "libc"))
            && lost(probes) == 0
            && self.pipeline.table().counts().table_full == 0
    }

    /// By pid: each traced process in turn is stopped, the table brought
    /// up to the stop, and the process judged, from a snapshot while it
    /// runs again or stopped for the whole scan; the result replaces the
    /// last check's.
    pub fn leak_check_live(
        &mut self,
        ring: &mut RingBuf<MapData>,
        probes: &Probes,
        when: CheckPoint,
    ) {
        if !self.leak_check_enabled() {
            return;
        }
        if !self.args.command.is_empty() {
            // The supervisor holds the command with ptrace: its check is
            // the one at exit.
            return;
        }
        let running: Vec<u32> = self.family.running().collect();
        if running.is_empty() {
            // Nothing to stop: an earlier check (at an interval) stands.
            if self.leak.summary.is_none() {
                self.leak.summary = Some(LeakCheck::not_run(
                    when,
                    "every traced process exited before the check: nothing is judged",
                ));
            }
            return;
        }
        begin(&mut self.leak, when);
        let mut refusal = None;
        let mut pause = Duration::ZERO;
        for pid in running {
            let mode = self.args.leak_check_mode;
            match self.check_process(pid, ring, probes, mode, true) {
                Ok((judgement, reading)) => {
                    pause += reading.pause;
                    add(
                        &mut self.leak,
                        judgement,
                        reading.threads,
                        reading.stopped_at_ns,
                    );
                    if let Some(summary) = self.leak.summary.as_mut() {
                        reading.note(summary);
                    }
                }
                Err(Refused::NotExact(reason)) => {
                    self.leak.summary = Some(LeakCheck::not_run(when, reason));
                    self.leak.verdicts = LeakVerdicts::default();
                    return;
                }
                Err(Refused::Stop(line)) => {
                    if refusal.is_none() {
                        eprintln!("memtrace: leak check skipped: {line}");
                    }
                    refusal.get_or_insert(line);
                }
                Err(Refused::Process(line)) => {
                    eprintln!("memtrace: leak check: {line}");
                    refusal.get_or_insert(line);
                }
            }
        }
        if self.leak.summary.as_ref().is_some_and(|s| s.processes == 0) {
            let reason = refusal.unwrap_or_else(|| "no process could be checked".to_string());
            self.leak.summary = Some(LeakCheck::not_run(when, reason));
            self.leak.verdicts = LeakVerdicts::default();
            return;
        }
        self.finish_check(pause, refusal);
    }

    /// Checks one process by pid: stops it, brings the table up to the
    /// stop, then judges a snapshot while it runs (`mode` snapshot, when
    /// the preflight and the clone succeed) or judges it stopped. An arena
    /// locked at the stop (`retry_locked`) makes it run 10 ms and be
    /// checked once more.
    fn check_process(
        &mut self,
        pid: u32,
        ring: &mut RingBuf<MapData>,
        probes: &Probes,
        mode: CheckMode,
        retry_locked: bool,
    ) -> Result<(Judgement, Reading), Refused> {
        // The preflight reads smaps before the stop: no pause for it.
        let mut plan = (mode == CheckMode::Snapshot).then(|| {
            crate::tracee::maps::read_raw(pid)
                .map_err(|_| format!("pid {pid} exited"))
                .and_then(|mappings| {
                    snapshot::preflight(pid, &mappings, self.args.leak_check_max_pause)
                })
        });
        let stop_started = Instant::now();
        let stopped = Stopped::stop(pid, STOP_TIMEOUT).map_err(|e| Refused::Stop(e.to_string()))?;
        // Every event made before the stop, and what the kernel holds.
        self.pipeline.drain_all(ring, probes);
        let lost = lost(probes);
        if lost > 0 {
            return Err(Refused::NotExact(format!(
                "{lost} events were lost: the live table is not exact, so nothing is judged"
            )));
        }
        if self.pipeline.table().counts().table_full > 0 {
            return Err(Refused::NotExact(
                "the live table reached --max-live: blocks are missing, so nothing is judged"
                    .to_string(),
            ));
        }
        let prepared = prepare(
            pid,
            &stopped.threads,
            &JudgeInput {
                table: self.pipeline.table(),
                specs: probes.specs(),
                stacks: self.pipeline.stacks(),
                complete: self.table_complete(pid, probes),
                explain: &self.args.leak_check_explain,
                heap_walk: !self.args.no_heap_walk,
            },
        )
        .map_err(Refused::Process)?;
        let mut reading = Reading {
            threads: stopped.threads.len(),
            stopped_at_ns: super::session::monotonic_ns(),
            ..Reading::default()
        };
        let taken = match plan.as_mut() {
            Some(Ok(plan)) => {
                reading.clone_estimate = plan.clone_estimate;
                take_snapshot(&prepared, &stopped, plan)
            }
            Some(Err(reason)) => Err(reason.clone()),
            None => Err(String::new()),
        };
        let judged = match taken {
            Ok((taken, copies, copied)) => {
                reading.mode = Some(CheckMode::Snapshot);
                reading.clone = taken.clone_time;
                reading.copied = copied;
                drop(stopped);
                reading.pause = stop_started.elapsed();
                let scan_started = Instant::now();
                let memory = copies;
                let (judged, killed) =
                    self.judge_while_running(&prepared, memory, taken.child, ring, probes);
                reading.scan = scan_started.elapsed();
                if let Err(line) = taken.release() {
                    eprintln!("memtrace: leak check: {line}");
                }
                if let Some(reason) = killed {
                    // The copy cost too much: checked again, stopped.
                    let (judgement, mut again) =
                        self.check_process(pid, ring, probes, CheckMode::Stopped, retry_locked)?;
                    again.pause += reading.pause;
                    again.fallback = Some(reason);
                    return Ok((judgement, again));
                }
                judged
            }
            Err(reason) => {
                reading.mode = Some(CheckMode::Stopped);
                reading.clone_estimate = None;
                reading.fallback = (!reason.is_empty()).then_some(reason);
                let scan_started = Instant::now();
                let deadline = stop_started + self.args.leak_check_max_pause;
                let judged = judge(&prepared, ProcessMemory::new(pid).with_deadline(deadline));
                reading.scan = scan_started.elapsed();
                drop(stopped);
                reading.pause = stop_started.elapsed();
                judged
            }
        };
        let judgement = judged.map_err(Refused::Process)?;
        if judgement.arena_locked && retry_locked {
            // A thread was stopped inside malloc: the process runs briefly
            // and is checked again (a lock still held is partial).
            std::thread::sleep(LOCKED_ARENA_RESUME);
            let (mut judgement, mut again) = self.check_process(pid, ring, probes, mode, false)?;
            again.pause += reading.pause;
            if judgement.arena_locked {
                let walk = judgement.before_attach.as_mut().map(|b| &mut b.heap_walk);
                if let Some(reason) = walk.and_then(|w| w.reason.as_mut()) {
                    reason.push_str(&format!(
                        " (still held after the process ran {} ms more)",
                        LOCKED_ARENA_RESUME.as_millis()
                    ));
                }
            }
            return Ok((judgement, again));
        }
        Ok((judgement, reading))
    }

    /// Judges a snapshot in a thread of its own while this one keeps
    /// reading the ring (the process runs and allocates meanwhile) and
    /// watches its memory cgroup: near the limit, the snapshot is killed
    /// (the scan then fails) and the reason returned.
    fn judge_while_running(
        &mut self,
        prepared: &Prepared,
        memory: ProcessMemory,
        child: u32,
        ring: &mut RingBuf<MapData>,
        probes: &Probes,
    ) -> (Result<Judgement, String>, Option<String>) {
        let mut killed = None;
        let judged = std::thread::scope(|scope| {
            let worker = scope.spawn(move || judge(prepared, memory));
            while !worker.is_finished() {
                self.pipeline.drain_all(ring, probes);
                let left = snapshot::memory_headroom(prepared.pid);
                if killed.is_none() && left.is_some_and(|left| left < snapshot::CGROUP_MARGIN / 2) {
                    Snapshot::kill_now(child);
                    killed = Some(format!(
                        "the snapshot was given up: its memory cgroup came within {} MiB of its limit during the scan",
                        left.unwrap_or(0) >> 20
                    ));
                }
                std::thread::sleep(SCAN_POLL);
            }
            worker
                .join()
                .unwrap_or_else(|_| Err("the scan of the snapshot failed".to_string()))
        });
        (judged, killed)
    }

    /// Launch mode, at an `--interval` (with `--leak-check`): the command
    /// stopped by its supervisor, every thread ([`HeldChild::stop_for_check`]);
    /// judged stopped (the supervisor holds it with ptrace, so no snapshot
    /// is injected), then resumed.
    ///
    /// [`HeldChild::stop_for_check`]: crate::tracee::HeldChild::stop_for_check
    pub fn leak_check_held(
        &mut self,
        stop: crate::tracee::CheckStop,
        ring: &mut RingBuf<MapData>,
        probes: &Probes,
        when: CheckPoint,
    ) {
        let started = Instant::now();
        let pid = stop.pid;
        self.pipeline.drain_all(ring, probes);
        let lost = lost(probes);
        if lost > 0 {
            self.leak.summary = Some(LeakCheck::not_run(
                when,
                format!(
                    "{lost} events were lost: the live table is not exact, so nothing is judged"
                ),
            ));
            self.leak.verdicts = LeakVerdicts::default();
            return;
        }
        begin(&mut self.leak, when);
        let stopped_at_ns = super::session::monotonic_ns();
        let judged = prepare(
            pid,
            &stop.threads,
            &JudgeInput {
                table: self.pipeline.table(),
                specs: probes.specs(),
                stacks: self.pipeline.stacks(),
                complete: self.table_complete(pid, probes),
                explain: &self.args.leak_check_explain,
                heap_walk: self.args.heap_walk,
            },
        )
        .and_then(|prepared| {
            let deadline = started + self.args.leak_check_max_pause;
            judge(&prepared, ProcessMemory::new(pid).with_deadline(deadline))
        });
        let threads = stop.threads.len();
        drop(stop);
        let reading = Reading {
            stopped_at_ns,
            mode: Some(CheckMode::Stopped),
            fallback: (self.args.leak_check_mode == CheckMode::Snapshot).then(|| {
                "launch mode: memtrace's supervisor holds the command with ptrace, so it is stopped for the whole scan".to_string()
            }),
            threads,
            pause: started.elapsed(),
            scan: started.elapsed(),
            ..Reading::default()
        };
        match judged {
            Ok(judgement) => {
                add(&mut self.leak, judgement, threads, stopped_at_ns);
                if let Some(summary) = self.leak.summary.as_mut() {
                    reading.note(summary);
                }
                self.finish_check(reading.pause, None);
            }
            Err(line) => {
                self.leak.summary = Some(LeakCheck::not_run(when, line));
                self.leak.verdicts = LeakVerdicts::default();
            }
        }
    }

    /// Launch mode: `pid` is stopped just before it exits (its main
    /// thread's registers given, and those of the threads that died with
    /// it); judges it, its memory intact.
    pub fn leak_check_exiting(
        &mut self,
        pid: u32,
        threads: Vec<StoppedThread>,
        ring: &mut RingBuf<MapData>,
        probes: &Probes,
    ) {
        if !self.leak_check_enabled() || self.args.command.is_empty() {
            return;
        }
        let started = Instant::now();
        self.pipeline.drain_all(ring, probes);
        let lost = lost(probes);
        if lost > 0 {
            self.leak.summary = Some(LeakCheck::not_run(
                CheckPoint::Exit,
                format!(
                    "{lost} events were lost: the live table is not exact, so nothing is judged"
                ),
            ));
            return;
        }
        // The exit check replaces an interval's; the processes of one
        // command exiting (with --follow-forks) add up.
        if self
            .leak
            .summary
            .as_ref()
            .is_none_or(|s| !s.ran || s.when != Some(CheckPoint::Exit))
        {
            begin(&mut self.leak, CheckPoint::Exit);
        }
        let complete = self.table_complete(pid, probes);
        if let Some(summary) = self.leak.summary.as_mut() {
            summary.complete_table |= complete;
        }
        let judged = prepare(
            pid,
            &threads,
            &JudgeInput {
                table: self.pipeline.table(),
                specs: probes.specs(),
                stacks: self.pipeline.stacks(),
                complete,
                explain: &self.args.leak_check_explain,
                heap_walk: self.args.heap_walk,
            },
        )
        .and_then(|prepared| {
            let deadline = started + self.args.leak_check_max_pause;
            judge(&prepared, ProcessMemory::new(pid).with_deadline(deadline))
        });
        if let Some(summary) = self.leak.summary.as_mut() {
            summary.mode = Some(CheckMode::Stopped);
            summary.scan_ms += started.elapsed().as_secs_f64() * 1000.0;
        }
        match judged {
            Ok(judgement) => add(
                &mut self.leak,
                judgement,
                threads.len(),
                super::session::monotonic_ns(),
            ),
            Err(line) => {
                if self.leak.summary.as_ref().is_some_and(|s| s.processes == 0) {
                    self.leak.summary = Some(LeakCheck::not_run(CheckPoint::Exit, line));
                }
                return;
            }
        }
        self.finish_check(started.elapsed(), None);
    }

    /// Launch mode at the end: a command that never reached its exit stop
    /// (killed by SIGKILL, or still running when the trace ended) was not
    /// checked; the report says so.
    pub fn leak_check_not_reached(&mut self) {
        if self.args.command.is_empty() || !self.leak_check_enabled() || self.leak.summary.is_some()
        {
            return;
        }
        self.leak.summary = Some(LeakCheck::not_run(
            CheckPoint::Exit,
            "the command was not seen exiting (killed by SIGKILL, or still running when the trace ended): nothing is judged",
        ));
    }

    /// Records the pause and says what a cut scan left out.
    fn finish_check(&mut self, pause: Duration, refusal: Option<String>) {
        if let Some(summary) = self.leak.summary.as_mut() {
            summary.pause_ms += pause.as_secs_f64() * 1000.0;
            if summary.skipped_bytes > 0 {
                summary.reason = Some(format!(
                    "the scan reached --leak-check-max-pause ({} ms): {} bytes were not scanned, so blocks not proven reachable are not judged",
                    self.args.leak_check_max_pause.as_millis(),
                    summary.skipped_bytes
                ));
            } else if let Some(refusal) = refusal {
                summary.reason = Some(format!("some processes were not checked: {refusal}"));
            }
        }
        log::info!(
            "leak check: stopped {:.1} ms in all",
            pause.as_secs_f64() * 1000.0
        );
    }
}
