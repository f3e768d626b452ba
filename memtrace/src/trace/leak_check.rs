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
    Amount, BeforeAttach, CheckPoint, Explanation, LeakCheck, LeakSplit, LeakState, LeakVerdicts,
};
use crate::report::LOST_CAUSES;
use crate::stacks::StackStore;
use crate::table::LiveTable;
use crate::tracee::glibc_heap;
use crate::tracee::roots::{self, RootOptions};
use crate::tracee::stop::{ProcessMemory, Stopped, StoppedThread};

/// How long a thread may take to reach its stop before the check gives up.
const STOP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a process whose heap walk met a locked arena runs before it is
/// stopped again, once (the thread inside malloc leaves it meanwhile).
const LOCKED_ARENA_RESUME: Duration = Duration::from_millis(10);

/// One process judged.
#[derive(Default)]
struct Judgement {
    split: LeakSplit,
    heuristics: BTreeMap<String, Amount>,
    not_judged: Amount,
    scanned: u64,
    unreadable: u64,
    skipped: u64,
    verdicts: Vec<((u32, Domain, u64), Category)>,
    explanations: Vec<Explanation>,
    before_attach: Option<BeforeAttach>,
    /// The heap walk met an arena locked (a thread stopped inside malloc).
    arena_locked: bool,
}

/// What the judge needs besides the process.
struct JudgeInput<'a> {
    table: &'a LiveTable,
    specs: &'a [SpecEntry],
    stacks: &'a StackStore,
    /// The table holds every block since the process began.
    complete: bool,
    deadline: Instant,
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

/// Judges one stopped process; an error (one line) when it could not be
/// read (it exited meanwhile: killed while stopped).
fn judge(pid: u32, threads: &[StoppedThread], input: &JudgeInput<'_>) -> Result<Judgement, String> {
    let mut judgement = Judgement::default();
    // The runtime libraries: by name, and every object defining a device
    // allocator memtrace probes.
    let device_modules: Vec<&str> = input
        .specs
        .iter()
        .filter(|s| matches!(s.memory, Memory::Device | Memory::Managed | Memory::Pinned))
        .filter_map(|s| s.module)
        .map(|m| file_name(Path::new(m)))
        .collect();
    let runtime_library =
        |path: &Path| runtime_name(file_name(path)) || device_modules.contains(&file_name(path));
    let mut nodes = Vec::new();
    let mut keys = Vec::new();
    for (owner, domain, addr, block) in input.table.blocks() {
        if owner != pid {
            continue;
        }
        let Some(entry) = input.specs.get(usize::from(block.spec)) else {
            continue;
        };
        let Some(scan) = node_kind(entry) else {
            judgement.not_judged.add(block.size);
            continue;
        };
        let runtime_owned = scan
            && match block.stack() {
                crate::event::StackRef::Id(id) => input
                    .stacks
                    .get(id)
                    .and_then(|frames| frames.first())
                    .and_then(|frame| frame.file.as_ref())
                    .is_some_and(|file| runtime_library(&file.module)),
                _ => false,
            };
        nodes.push(Node {
            start: addr,
            size: block.size,
            scan,
            runtime_owned,
        });
        keys.push(((pid, domain, addr), block.size));
    }
    let gone = || format!("pid {pid} exited during the check: nothing of it is judged");
    let Ok(mappings) = crate::tracee::maps::read_raw(pid) else {
        return Err(gone());
    };
    let stack_starts: Vec<u64> = threads.iter().map(StoppedThread::stack_from).collect();
    let mut memory = ProcessMemory::new(pid).with_deadline(input.deadline);
    // glibc's heap walked: its blocks from before the attach become nodes
    // (after the traced ones), the heaps walked and glibc's own blocks no
    // roots.
    let mut excluded: Vec<(u64, u64)> = Vec::new();
    let walk_started = Instant::now();
    let walked = input.heap_walk.then(|| {
        let sps: Vec<u64> = threads.iter().map(|t| t.sp).collect();
        before_attach::walk(pid, &mappings, &sps, &mut memory)
    });
    let walk_ms = walk_started.elapsed().as_secs_f64() * 1000.0;
    if let Some(Ok(walk)) = &walked {
        judgement.arena_locked = walk.locked;
        let traced: std::collections::HashSet<u64> = nodes.iter().map(|n| n.start).collect();
        nodes.extend(
            walk.chunks
                .iter()
                .filter(|c| !traced.contains(&c.start))
                .map(|c| Node::host(c.start, c.size)),
        );
        excluded.extend_from_slice(&walk.walked);
        excluded.extend_from_slice(&walk.metadata);
    }
    let scanned_ranges: Vec<(u64, u64)> = nodes
        .iter()
        .filter(|n| n.scan)
        .map(|n| (n.start, n.start.saturating_add(n.size)))
        .collect();
    // glibc's own memory: main_arena's chunk pointers (false interior
    // pointers into the block before each chunk) always; its heaps when
    // every block in them is a node.
    excluded.extend(glibc_heap::main_arena_pointers(&mappings, &mut memory));
    if input.complete {
        let mut sorted = scanned_ranges.clone();
        sorted.sort_unstable();
        excluded.extend(glibc_heap::heap_extents(&mappings, &sorted, &mut memory));
    }
    let roots = roots::roots(
        &mappings,
        &RootOptions {
            stack_starts: &stack_starts,
            excluded: &excluded,
            nodes: &scanned_ranges,
            runtime_library: &runtime_library,
        },
    );
    let registers: Vec<u64> = threads
        .iter()
        .flat_map(|t| t.registers.iter().copied())
        .collect();
    let vtable = roots::vtable_predicate(&mappings);
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
            provenance: !input.explain.is_empty(),
        },
        &mut memory,
    );
    log::info!(
        "leak check of pid {pid}: {} bytes scanned in {} ms",
        outcome.scanned_bytes,
        scan_started.elapsed().as_millis()
    );
    if memory.gone || !crate::tracee::is_alive(pid) {
        return Err(gone());
    }
    judgement.scanned = outcome.scanned_bytes;
    judgement.unreadable = memory.unreadable;
    judgement.skipped = memory.skipped;
    let cut = memory.skipped > 0;
    let traced = keys.len();
    if let Some(walked) = &walked {
        // Each block's first word (pre-attach blocks are 24 bytes or
        // more), read in batches: a vtable pointer names its type.
        let ranges: Vec<(u64, usize)> = nodes[traced..].iter().map(|n| (n.start, 8)).collect();
        let mut words = vec![0u8; 8 * ranges.len()];
        reach::Memory::read_many(&mut memory, &ranges, &mut words);
        let first_words: Vec<u64> = words
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
            .collect();
        let types = before_attach::type_names(pid, &mappings, &first_words);
        let blocks: Vec<before_attach::Block> = nodes[traced..]
            .iter()
            .zip(&outcome.verdicts[traced..])
            .zip(types)
            .filter(|((_, v), _)| !cut || v.category == Category::StillReachable)
            .map(|((n, v), type_name)| before_attach::Block {
                size: n.size,
                category: v.category,
                type_name,
            })
            .collect();
        for (node, verdict) in nodes[traced..].iter().zip(&outcome.verdicts[traced..]) {
            if cut && verdict.category != Category::StillReachable {
                judgement.not_judged.add(node.size);
            } else {
                judgement.split.add(verdict.category, node.size);
            }
        }
        judgement.before_attach = Some(before_attach::summary(
            walked,
            walk_ms,
            &blocks,
            before_attach::notes(&mappings),
        ));
    }
    if !input.explain.is_empty() {
        let categories: Vec<Category> = outcome.verdicts.iter().map(|v| v.category).collect();
        judgement.explanations = leak_explain::Context {
            pid,
            nodes: &nodes,
            categories: &categories,
            marks: &outcome.marks,
            mappings: &mappings,
            threads,
        }
        .explain(input.explain);
    }
    for ((key, size), verdict) in keys.into_iter().zip(outcome.verdicts) {
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
        judgement.verdicts.push((key, verdict.category));
    }
    Ok(judgement)
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
fn add(state: &mut LeakState, judgement: Judgement, threads: usize) {
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
    let mut entries = std::mem::take(&mut state.verdicts).into_entries();
    entries.extend(judgement.verdicts);
    state.verdicts = LeakVerdicts::new(entries);
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

    /// By pid: stops every traced process, brings the table up to the
    /// stop, judges, resumes; the result replaces the last check's.
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
        let started = Instant::now();
        let mut stopped = Vec::new();
        let mut refusal = None;
        for pid in running {
            match Stopped::stop(pid, STOP_TIMEOUT) {
                Ok(process) => stopped.push(process),
                Err(err) => {
                    let line = err.to_string();
                    if refusal.is_none() {
                        eprintln!("memtrace: leak check skipped: {line}");
                    }
                    refusal.get_or_insert(line);
                }
            }
        }
        if stopped.is_empty() {
            let reason = refusal.unwrap_or_else(|| "no traced process is running".to_string());
            self.leak.summary = Some(LeakCheck::not_run(when, reason));
            self.leak.verdicts = LeakVerdicts::default();
            return;
        }
        // Every event made before the stop, and what the kernel holds.
        self.pipeline.drain_all(ring, probes);
        let lost = lost(probes);
        if lost > 0 || self.pipeline.table().counts().table_full > 0 {
            drop(stopped);
            let reason = if lost > 0 {
                format!(
                    "{lost} events were lost: the live table is not exact, so nothing is judged"
                )
            } else {
                "the live table reached --max-live: blocks are missing, so nothing is judged"
                    .to_string()
            };
            self.leak.summary = Some(LeakCheck::not_run(when, reason));
            self.leak.verdicts = LeakVerdicts::default();
            return;
        }
        let deadline = started + self.args.leak_check_max_pause;
        begin(&mut self.leak, when);
        let mut k = 0;
        while k < stopped.len() {
            let mut judged = self.judge_stopped(&stopped[k], probes, deadline);
            // False when the process could not be stopped again: it left
            // `stopped`, the next one is at `k` now.
            let mut still_stopped = true;
            if judged.as_ref().is_ok_and(|j| j.arena_locked) {
                // A thread was stopped inside malloc: resume the process
                // briefly, stop it again, bring the table up to the new
                // stop and judge once more (a lock still held is partial).
                let pid = stopped[k].pid;
                drop(stopped.remove(k));
                std::thread::sleep(LOCKED_ARENA_RESUME);
                match Stopped::stop(pid, STOP_TIMEOUT) {
                    Ok(again) => {
                        stopped.insert(k, again);
                        self.pipeline.drain_all(ring, probes);
                        judged = self.judge_stopped(&stopped[k], probes, deadline);
                        if let Some(judgement) = judged.as_mut().ok().filter(|j| j.arena_locked) {
                            let walk = judgement.before_attach.as_mut().map(|b| &mut b.heap_walk);
                            if let Some(reason) = walk.and_then(|w| w.reason.as_mut()) {
                                reason.push_str(&format!(
                                    " (still held after the process ran {} ms more)",
                                    LOCKED_ARENA_RESUME.as_millis()
                                ));
                            }
                        }
                    }
                    Err(err) => {
                        judged = Err(err.to_string());
                        still_stopped = false;
                    }
                }
            }
            let threads = if still_stopped {
                stopped[k].threads.len()
            } else {
                0
            };
            match judged {
                Ok(judgement) => add(&mut self.leak, judgement, threads),
                Err(line) => {
                    eprintln!("memtrace: leak check: {line}");
                    refusal.get_or_insert(line);
                }
            }
            if still_stopped {
                k += 1;
            }
        }
        let stopped_count = stopped.len();
        drop(stopped);
        if self.leak.summary.as_ref().is_some_and(|s| s.processes == 0) {
            let reason = refusal.unwrap_or_else(|| "no process could be checked".to_string());
            self.leak.summary = Some(LeakCheck::not_run(when, reason));
            return;
        }
        self.finish_check(started, stopped_count, refusal);
    }

    /// Judges one process stopped by pid.
    fn judge_stopped(
        &self,
        process: &Stopped,
        probes: &Probes,
        deadline: Instant,
    ) -> Result<Judgement, String> {
        judge(
            process.pid,
            &process.threads,
            &JudgeInput {
                table: self.pipeline.table(),
                specs: probes.specs(),
                stacks: self.pipeline.stacks(),
                complete: self.table_complete(process.pid, probes),
                deadline,
                explain: &self.args.leak_check_explain,
                heap_walk: !self.args.no_heap_walk,
            },
        )
    }

    /// Launch mode: `pid` is stopped just before it exits (its exiting
    /// thread's registers given); judges it, its memory intact.
    pub fn leak_check_exiting(
        &mut self,
        pid: u32,
        registers: Option<Vec<u64>>,
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
        if self.leak.summary.as_ref().is_none_or(|s| !s.ran) {
            begin(&mut self.leak, CheckPoint::Exit);
        }
        let threads: Vec<StoppedThread> = registers
            .map(|registers| StoppedThread {
                sp: crate::tracee::stop::stack_pointer(&registers),
                registers,
            })
            .into_iter()
            .collect();
        let complete = self.table_complete(pid, probes);
        if let Some(summary) = self.leak.summary.as_mut() {
            summary.complete_table |= complete;
        }
        let judged = judge(
            pid,
            &threads,
            &JudgeInput {
                table: self.pipeline.table(),
                specs: probes.specs(),
                stacks: self.pipeline.stacks(),
                complete,
                deadline: started + self.args.leak_check_max_pause,
                explain: &self.args.leak_check_explain,
                heap_walk: self.args.heap_walk,
            },
        );
        match judged {
            // The other threads are already gone: only the exiting one counts.
            Ok(judgement) => add(&mut self.leak, judgement, 1),
            Err(line) => {
                if self.leak.summary.as_ref().is_some_and(|s| s.processes == 0) {
                    self.leak.summary = Some(LeakCheck::not_run(CheckPoint::Exit, line));
                }
                return;
            }
        }
        self.finish_check(started, 1, None);
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
    fn finish_check(&mut self, started: Instant, processes: usize, refusal: Option<String>) {
        let pause = started.elapsed();
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
            "leak check: {processes} process(es) stopped for {:.1} ms",
            pause.as_secs_f64() * 1000.0
        );
    }
}
