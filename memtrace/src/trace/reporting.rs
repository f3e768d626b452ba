//! The session as a report, interim or final: the notes gathered from
//! every part of the trace, the memory reconciliation (what the traced
//! allocators hold against the target's RssAnon growth, and the
//! "unexplained memory" note when they hold almost none of it), and the
//! input the report builder (`crate::report::build`) takes.

use std::time::{Duration, Instant};

use super::discovery::Discovery;
use super::loader::Probes;
use super::session::{monotonic_ns, read_memory, Session};
use super::usdt_probes;
use crate::probe::catalog::Allocator;
use crate::report::{self, Reconciliation, Settings};

impl Session<'_> {
    /// The report of the trace so far (interim) or at its end.
    pub fn report(&mut self, probes: &Probes, discovery: &Discovery) -> report::Report {
        let mut notes = self.notes.clone();
        notes.extend(discovery.problems.iter().cloned());
        notes.extend(crate::tracee::files::note());
        notes.extend(self.family.notes());
        let exited = self.pipeline.exited_threads();
        if !exited.is_empty() {
            const SHOWN: usize = 10;
            let shown: Vec<String> = exited.iter().take(SHOWN).map(u32::to_string).collect();
            notes.push(format!(
                "{} allocating thread(s) exited during the trace (tids {}{}); their blocks stay attributed to them",
                exited.len(),
                shown.join(", "),
                if exited.len() > SHOWN { ", ..." } else { "" }
            ));
        }
        // The figures as of now, not of the last rescan (up to 500 ms old).
        if let Some(memory) = read_memory(self.target.pid) {
            self.memory_last = Some(memory);
        }
        let reconciliation = self.reconciliation(probes);
        if let Some(note) = reconciliation
            .as_ref()
            .and_then(|r| unexplained_growth(r, discovery))
        {
            notes.insert(0, note);
        }
        let args = self.args;
        let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let input = report::ReportInput {
            target: self.target.clone(),
            duration_ms: millis(self.ended.map_or_else(Instant::now, |e| e.0) - self.started),
            now_ns: self.ended.map_or_else(monotonic_ns, |e| e.1),
            started_ns: self.started_ns,
            table: self.pipeline.table(),
            specs: probes.specs(),
            stacks: self.pipeline.stacks(),
            history: Some(&self.history),
            suppressions: self.suppressions.as_ref(),
            thread_names: self.pipeline.thread_names(),
            kernel_counters: probes.counters(),
            libraries: discovery
                .libraries
                .iter()
                .filter_map(|l| serde_json::to_value(l).ok())
                .collect(),
            missing_functions: discovery.missing_functions(),
            settings: Settings {
                stack_depth: args.stack_depth,
                min_age_ms: millis(args.min_age),
                top: args.top,
                sample_rate: args.sample_rate,
                min_size: args.min_size,
                max_size: args.max_size,
                warmup_ms: millis(args.warmup),
                interval_ms: args.interval.map(millis),
                suppress_file: args.suppress.as_ref().map(|p| p.display().to_string()),
                attach: Some(probes.attach_method().to_string()),
            },
            notes,
            reconciliation,
            processes: self.family.processes(),
            attach_failures: probes.attach_failures.clone(),
            leak_check: self
                .leak
                .summary
                .as_ref()
                .map(|summary| (summary, &self.leak.verdicts)),
            leak_gates: &self.args.fail_on,
        };
        let mut report = report::build(input, &mut self.symbolizer);
        report.unwind = probes.unwind.as_ref().map(|unwind| unwind.summary());
        report.function_cache = discovery.function_cache.clone();
        if self.args.bpf_stats {
            report.bpf_programs = probes.program_costs();
        }
        report.device_cache = usdt_probes::device_cache(
            &discovery.usdt,
            self.pipeline.table(),
            probes.specs(),
            &self.pipeline.usdt_tags,
        );
        report.usdt = discovery
            .usdt
            .iter()
            .filter_map(|plan| serde_json::to_value(plan).ok())
            .collect();
        report
    }

    fn reconciliation(&self, probes: &Probes) -> Option<Reconciliation> {
        let (start, now) = (self.memory_at_attach?, self.memory_last?);
        // The target's own blocks: the memory figures are its.
        let tracked = |allocator: &dyn Fn(Allocator) -> bool| -> u64 {
            self.pipeline
                .table()
                .blocks()
                .filter(|(pid, _, _, block)| {
                    *pid == self.target.pid
                        && probes
                            .specs()
                            .get(usize::from(block.spec))
                            .is_some_and(|s| allocator(s.allocator))
                })
                .map(|(_, _, _, block)| block.size)
                .sum()
        };
        let tracked_host_bytes = tracked(&|a: Allocator| a.is_heap());
        let growth = now.rss_anon as i64 - start.rss_anon as i64;
        let explained_ratio = (growth > 0).then(|| tracked_host_bytes as f64 / growth as f64);
        Some(Reconciliation {
            rss_anon_at_attach: start.rss_anon,
            rss_anon_now: now.rss_anon,
            rss_anon_growth: growth,
            vm_rss_at_attach: start.vm_rss,
            vm_rss_now: now.vm_rss,
            tracked_host_bytes,
            tracked_mmap_bytes: tracked(&|a: Allocator| a == Allocator::Mmap),
            explained_ratio,
            note: "tracked heap bytes are what was allocated since attach and is still live; memory allocated before attach, allocator overhead, freed-but-cached heap and untraced allocators are not in it; mappings count virtual size".to_string(),
        })
    }
}

/// RssAnon growth below this is never called unexplained (allocator caches,
/// stacks, page-table noise).
const UNEXPLAINED_MIN_GROWTH: i64 = 8 << 20;

/// "No silent nothing": the target's RssAnon grew by more than a few MiB
/// while the traced allocators hold (almost) none of it, so it likely
/// allocates through something memtrace does not know. Names what was probed.
fn unexplained_growth(r: &Reconciliation, discovery: &Discovery) -> Option<String> {
    let tracked = r.tracked_host_bytes.saturating_add(r.tracked_mmap_bytes);
    let growth = r.rss_anon_growth;
    if growth < UNEXPLAINED_MIN_GROWTH || tracked.saturating_mul(10) >= growth.unsigned_abs() {
        return None;
    }
    let probed: Vec<String> = discovery
        .libraries
        .iter()
        .map(|l| match l.allocator {
            Some(allocator) => format!("{} ({allocator})", l.path.display()),
            None => l.path.display().to_string(),
        })
        .collect();
    Some(format!(
        "unexplained memory: RssAnon grew by {} MiB during the trace but the traced allocators \
         hold only {} KiB of it; the target may allocate through an allocator memtrace does not \
         know (probed: {}); --lib PATH or --symbol-prefix PREFIX adds one",
        growth >> 20,
        tracked >> 10,
        if probed.is_empty() {
            "nothing".to_string()
        } else {
            probed.join(", ")
        }
    ))
}
