//! Text sink: what a person reads — totals, what the tracked bytes mean next
//! to the process's resident memory, the traced processes, then each site
//! with its bytes, count, oldest age and symbolized frames. Frame names are
//! shortened to [`NAME_WIDTH`] ([`crate::symbolize::short`]) unless
//! `--full-names` asks for them whole.

use std::io::Write;

use super::{human_bytes, Names, Sink};
use crate::report::{Frame, ProcessInfo, Reconciliation, Report};

/// Most characters of a frame's name in a short frame line: with the
/// depth, address, file and module it fits a wide terminal line.
pub const NAME_WIDTH: usize = 80;

pub struct TextSink {
    /// Short or whole frame names (`--full-names`).
    pub names: Names,
}

impl Sink for TextSink {
    fn write(&self, report: &Report, interim: bool, out: &mut dyn Write) -> std::io::Result<()> {
        let target = &report.target;
        let kind = if interim { "interim report" } else { "report" };
        writeln!(
            out,
            "memtrace {kind}: pid {}{} ({}) {} — traced {:.1}s",
            target.pid,
            target.placement.describe(),
            target.comm,
            target.exe,
            report.duration_ms as f64 / 1000.0
        )?;
        let e = &report.events;
        // Under a size filter the frees of skipped blocks are unmatched by
        // design (see the note): say so where the count is.
        let expected = if e.unmatched_frees > 0 && crate::report::size_filtered(&report.settings) {
            " (expected: size filter)"
        } else {
            ""
        };
        writeln!(
            out,
            "events: {} allocs, {} frees, {} lost, {} unmatched frees{expected}, {} stack failures, {} failed calls",
            e.allocs, e.frees, e.lost, e.unmatched_frees, e.stack_failures, e.failed_calls
        )?;
        if report.totals.is_empty() {
            writeln!(out, "live: nothing outstanding")?;
        }
        for total in &report.totals {
            writeln!(
                out,
                "live: {:<12} {:<8} {:>12} in {} blocks",
                total.allocator.name(),
                total.memory.name(),
                human_bytes(total.live_bytes),
                total.live_count
            )?;
        }
        if let Some(cache) = &report.device_cache {
            for line in device_cache_lines(cache) {
                writeln!(out, "{line}")?;
            }
        }
        for python in &report.python {
            writeln!(out, "{}", python_line(python))?;
        }
        for library in &report.libraries {
            let path = library["path"].as_str().unwrap_or("?");
            let functions: Vec<String> = library["functions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|f| {
                    let name = f["function"].as_str()?;
                    Some(match f["probe_offset"].as_u64() {
                        Some(offset) if offset > 0 => format!("{name}@+{offset}"),
                        _ => name.to_string(),
                    })
                })
                .collect();
            writeln!(out, "probed: {path}: {}", functions.join(" "))?;
        }
        if !report.missing_functions.is_empty() {
            writeln!(out, "not found: {}", report.missing_functions.join(" "))?;
        }
        if let Some(unwind) = &report.unwind {
            let truncated: u64 = report.stack_truncations_by_cause.values().sum();
            writeln!(
                out,
                "stacks: dwarf, {} objects with unwind tables ({} of kernel memory, {} reserved){}{}",
                unwind.objects,
                human_bytes(unwind.kernel_bytes_used),
                human_bytes(unwind.kernel_bytes_reserved),
                if truncated > 0 {
                    format!(", {truncated} cut short")
                } else {
                    String::new()
                },
                if unwind.capped.is_empty() {
                    String::new()
                } else {
                    format!(
                        ", {} over --unwind-table-mib: {}",
                        unwind.capped.len(),
                        unwind.capped.join(" ")
                    )
                }
            )?;
            if let Some(cache) = &unwind.cache {
                writeln!(
                    out,
                    "unwind tables: prepared in {} ms, loaded in {} ms; cache {}: {} hits, {} built, {} rejected, {} evicted",
                    unwind.build_ms,
                    unwind.load_ms,
                    cache.dir,
                    cache.hits,
                    cache.misses,
                    cache.rejected,
                    cache.evicted
                )?;
                for failure in &cache.failures {
                    writeln!(out, "unwind table cache: {failure}")?;
                }
            }
            if unwind.deferred > 0 {
                let when = match unwind.deferred_ms {
                    Some(ms) => format!("all in {ms} ms after tracing started"),
                    None => format!(
                        "{} still being built: {}",
                        unwind.pending.len(),
                        unwind.pending.join(" ")
                    ),
                };
                writeln!(
                    out,
                    "unwind tables built while tracing ran: {} objects, {when} (stacks reaching them before were cut: table_pending)",
                    unwind.deferred
                )?;
            }
        }
        if let Some(cache) = &report.function_cache {
            writeln!(
                out,
                "allocator functions: cache {}: {} hits, {} searched, {} rejected, {} evicted",
                cache.dir, cache.hits, cache.misses, cache.rejected, cache.evicted
            )?;
            for failure in &cache.failures {
                writeln!(out, "function cache: {failure}")?;
            }
        }
        if !report.bpf_programs.is_empty() {
            let programs: Vec<String> = report
                .bpf_programs
                .iter()
                .map(|p| format!("{} {} runs, {} ns each", p.program, p.runs, p.ns_per_run))
                .collect();
            writeln!(out, "memtrace's own BPF time: {}", programs.join("; "))?;
        }
        for push in report.push.iter().chain(&report.otlp) {
            writeln!(out, "{}", push_line(push))?;
        }
        if let Some(reconciliation) = &report.reconciliation {
            let pid = (report.processes.len() > 1).then_some(target.pid);
            let rate = super::sample_rate(report);
            writeln!(
                out,
                "memory: {}",
                reconciliation_words(reconciliation, pid, rate)
            )?;
        }
        // One process traced by name reads like one traced by pid.
        let by_name = report.processes.len() > 1 && report.processes.iter().any(|p| p.by_name);
        for process in &report.processes {
            if let Some(line) = process_line(process, by_name) {
                writeln!(out, "{line}")?;
            }
        }
        for note in &report.notes {
            writeln!(out, "note: {note}")?;
        }
        for failed in &report.failed_calls {
            writeln!(
                out,
                "failed: {} returned {} x{}",
                failed.function, failed.code, failed.count
            )?;
        }
        if let Some(check) = &report.leak_check {
            for line in leak_summary_lines(check) {
                writeln!(out, "{line}")?;
            }
        }
        writeln!(out)?;
        for (rank, site) in report.sites.iter().enumerate() {
            writeln!(
                out,
                "#{} {} ({} bytes) in {} blocks — {} {} via {} — oldest {:.1}s — threads {}",
                rank + 1,
                human_bytes(site.live_bytes),
                site.live_bytes,
                site.live_count,
                site.allocator.name(),
                site.memory.name(),
                site.functions
                    .iter()
                    .map(|f| super::function_name(f))
                    .collect::<Vec<_>>()
                    .join(", "),
                site.oldest_age_ms as f64 / 1000.0,
                site.threads
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )?;
            if let (Some(bytes), Some(count)) =
                (site.estimated_live_bytes, site.estimated_live_count)
            {
                writeln!(
                    out,
                    "    estimated {} in {count} blocks (sampled 1 in {})",
                    human_bytes(bytes),
                    report.settings.sample_rate
                )?;
            }
            if report.processes.len() > 1 {
                let pids: Vec<String> = site.pids.iter().map(u32::to_string).collect();
                writeln!(out, "    in process {}", pids.join(","))?;
            }
            writeln!(out, "    {}", judgment(site))?;
            if let Some(split) = &site.leak_check {
                writeln!(out, "    {}", site_leak_words(split))?;
            }
            if let Some(note) = &site.stack_note {
                writeln!(out, "    ({note})")?;
            }
            for (depth, frame) in site.frames.iter().enumerate() {
                for call in &frame.inlined {
                    writeln!(out, "       {}", inlined_line(call, self.names))?;
                }
                writeln!(out, "    {depth:>2} {}", frame_line(frame, self.names))?;
            }
        }
        if report.sites.is_empty() {
            writeln!(out, "no outstanding allocation sites")?;
        }
        Ok(())
    }
}

/// Groups digits by thousands, as valgrind prints its figures.
fn thousands(value: u64) -> String {
    let digits = value.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The leak check's summary, in valgrind's words.
fn leak_summary_lines(check: &crate::report::LeakCheck) -> Vec<String> {
    use crate::report::leak::CheckPoint;
    let when = match check.when {
        Some(CheckPoint::Exit) => "at exit",
        Some(CheckPoint::End) => "at the end",
        Some(CheckPoint::Interval) => "at this interval",
        None => "",
    };
    if !check.ran {
        return vec![format!(
            "leak check {when}: not run: {}",
            check.reason.as_deref().unwrap_or("no reason given")
        )];
    }
    let amount = |a: crate::report::leak::Amount| {
        format!(
            "{} bytes in {} blocks",
            thousands(a.bytes),
            thousands(a.blocks)
        )
    };
    let split = &check.split;
    let how = match check.mode {
        Some(crate::report::leak::CheckMode::Snapshot) => format!(
            " (snapshot: clone {:.1} ms; scanned in {:.1} ms while it ran)",
            check.clone_ms, check.scan_ms
        ),
        _ => String::new(),
    };
    let mut lines = vec![format!(
        "leak check {when}: {} thread(s) of {} process(es) stopped {:.1} ms{how}, {} scanned",
        check.threads,
        check.processes,
        check.pause_ms,
        human_bytes(check.scanned_bytes)
    )];
    if let Some(fallback) = &check.fallback {
        lines.push(format!("   stopped for the whole scan: {fallback}"));
    }
    lines.extend([
        format!("   definitely lost: {}", amount(split.definitely_lost)),
        format!("   indirectly lost: {}", amount(split.indirectly_lost)),
        format!("     possibly lost: {}", amount(split.possibly_lost)),
        format!("   still reachable: {}", amount(split.still_reachable)),
    ]);
    for (heuristic, reached) in &check.reachable_via_heuristic {
        lines.push(format!(
            "                      of which reachable via heuristic {heuristic}: {}",
            amount(*reached)
        ));
    }
    if check.not_judged.blocks > 0 {
        lines.push(format!(
            "        not judged: {} (mappings and handles are roots, not blocks)",
            amount(check.not_judged)
        ));
    }
    if let Some(reason) = &check.reason {
        lines.push(format!("   note: {reason}"));
    }
    if !check.failed_gates.is_empty() {
        lines.push(format!(
            "   FAILED --fail-on {} (exit 5)",
            check.failed_gates.join(",")
        ));
    }
    if let Some(before) = &check.before_attach {
        lines.extend(before.lines());
    }
    for explanation in &check.explain {
        lines.push(format!("   explain {}:", explanation.asked));
        lines.extend(explanation.lines.iter().map(|line| format!("     {line}")));
    }
    lines
}

/// A site's blocks as the leak check split them, in words.
fn site_leak_words(split: &crate::report::LeakSplit) -> String {
    if split.lost_bytes() == 0 {
        if split.still_reachable.blocks > 0 {
            return "leak check: all still reachable (something still points to every block)"
                .to_string();
        }
        return "leak check: none of its blocks were judged (made after the check)".to_string();
    }
    let mut parts = Vec::new();
    for (name, amount) in [
        ("definitely lost", split.definitely_lost),
        ("indirectly lost", split.indirectly_lost),
        ("possibly lost", split.possibly_lost),
        ("still reachable", split.still_reachable),
    ] {
        if amount.blocks > 0 {
            parts.push(format!(
                "{name} {} in {} blocks",
                human_bytes(amount.bytes),
                amount.blocks
            ));
        }
    }
    format!("leak check: {}", parts.join(", "))
}

/// The site's trend and leak pattern in words.
/// What became of the pushes to the profile store (`--pyroscope`) or the
/// Collector (`--otlp-profiles`).
fn push_line(push: &crate::report::PushStats) -> String {
    let mut line = format!(
        "pushed to {}: {} sent, {} failed, {} dropped, {} retries",
        push.endpoint, push.sent, push.failed, push.dropped, push.retries
    );
    if push.skipped_empty > 0 {
        line.push_str(&format!(", {} empty not pushed", push.skipped_empty));
    }
    if let Some(error) = &push.last_error {
        line.push_str(&format!(" (last error: {error})"));
    }
    line
}

fn judgment(site: &crate::report::Site) -> String {
    use crate::analysis::{Pattern, Trend};
    use crate::probe::catalog::Memory;
    let mut text = match site.trend {
        Trend::Growing => format!(
            "growing {}/s",
            human_bytes(site.growth_bytes_per_s.max(0.0) as u64)
        ),
        other => other.as_str().to_string(),
    };
    match &site.pattern {
        Some(Pattern::PerIteration {
            period_ms,
            bytes_per_period,
        }) => text.push_str(&format!(
            "; per-iteration leak: {} every {period_ms:.0} ms",
            human_bytes(*bytes_per_period)
        )),
        Some(Pattern::LargeOnce) => text.push_str(match site.memory {
            Memory::Host | Memory::Handle => {
                "; one large block held since early on (a buffer, table or cache never freed)"
            }
            Memory::Device | Memory::Pinned | Memory::Managed => {
                "; one large block held since early on (e.g. a model or weights never unloaded)"
            }
        }),
        Some(Pattern::SmallAccumulating) => text.push_str("; small blocks accumulating"),
        None => {}
    }
    if site.internal {
        text.push_str("; made by the allocator's own library for itself (a cache, usually)");
    }
    if !site.thread_names.is_empty() {
        text.push_str(&format!("; threads {}", site.thread_names.join(",")));
    }
    text
}

/// One line per traced process other than a lone target: children as
/// `child:`, processes traced for their `--name` as `process:`.
fn process_line(process: &ProcessInfo, by_name: bool) -> Option<String> {
    let holds = format!(
        "holds {} in {} blocks{}",
        human_bytes(process.live_bytes),
        process.live_count,
        if process.exited { ", exited" } else { "" }
    );
    if let Some(parent) = process.parent {
        return Some(format!(
            "child: pid {}{} ({}) of pid {parent} {holds}",
            process.pid,
            process.placement.describe(),
            process.comm
        ));
    }
    if !by_name {
        return None;
    }
    let since = if process.started_during_trace {
        format!(
            ", started during the trace, traced from {:.1}s{}",
            process.traced_from_ms as f64 / 1000.0,
            match process.attach_delay_ms {
                Some(ms) => format!(" ({ms} ms after it started)"),
                None => String::new(),
            }
        )
    } else {
        String::new()
    };
    Some(format!(
        "process: pid {}{} ({}) {holds}{since}",
        process.pid,
        process.placement.describe(),
        process.comm
    ))
}

/// The reconciliation in words: how the live bytes memtrace tracks compare
/// with the growth of the process's resident anonymous memory, and what a
/// difference means. `pid`: named when several processes are traced (the
/// figures are the target's); `rate`: the sampling rate (tracked bytes are
/// then an estimate).
fn reconciliation_words(r: &Reconciliation, pid: Option<u32>, rate: u64) -> String {
    /// Differences this small are allocator overhead and page rounding.
    const SLACK_BYTES: u64 = 512 << 10;
    /// Differences within this share of the larger figure count as explained.
    const SLACK_SHARE: f64 = 0.25;
    let tracked = r.tracked_host_bytes.saturating_mul(rate);
    let growth = r.rss_anon_growth;
    let who = pid.map_or_else(String::new, |pid| format!("pid {pid}: "));
    let estimated = if rate > 1 {
        format!(" (estimated: sampled 1 in {rate})")
    } else {
        String::new()
    };
    let rss = if growth > 0 {
        format!("RssAnon grew {}", human_bytes(growth.unsigned_abs()))
    } else if growth < 0 {
        format!("RssAnon shrank {}", human_bytes(growth.unsigned_abs()))
    } else {
        "RssAnon did not change".to_string()
    };
    let mapped = r.tracked_mmap_bytes.saturating_mul(rate);
    let tracked_text = match mapped {
        0 => format!(
            "tracked {} live since attach{estimated}",
            human_bytes(tracked)
        ),
        _ => format!(
            "tracked {} of heap and {} of anonymous mappings live since attach{estimated}",
            human_bytes(tracked),
            human_bytes(mapped)
        ),
    };
    let growth_bytes = u64::try_from(growth).unwrap_or(0);
    let slack = SLACK_BYTES.max((SLACK_SHARE * tracked.max(growth_bytes) as f64) as u64);
    let meaning = if tracked <= slack && growth_bytes <= slack && mapped == 0 {
        "both within allocator and page rounding, nothing to explain"
    } else if tracked.abs_diff(growth_bytes) <= slack {
        "the tracked blocks explain the growth"
    } else if tracked > growth_bytes {
        "untouched pages are not resident (a block counts only once written), or the blocks reuse heap freed before"
    } else if tracked.saturating_add(mapped).saturating_add(slack) >= growth_bytes {
        "the mappings can hold what the heap does not explain (they count only where written)"
    } else {
        "the rest is memory the tracked blocks do not hold: blocks allocated before attach and written since, an allocator memtrace does not trace, heap the allocator keeps after free, or thread stacks"
    };
    format!("{who}{tracked_text}; {rss}: {meaning}")
}

/// What was found of one CPython interpreter.
/// The tensors and segments of a caching device allocator, side by side.
fn device_cache_lines(cache: &crate::report::DeviceCache) -> Vec<String> {
    let mut lines = vec![format!(
        "device: {} tensors {} in {} blocks | cudaMalloc segments {} in {} | held by the cache {}{}",
        cache.allocators.join("+"),
        human_bytes(cache.tensor_live_bytes),
        cache.tensor_live_count,
        human_bytes(cache.segment_live_bytes),
        cache.segment_live_count,
        if cache.cached_bytes < 0 { "-" } else { "" },
        human_bytes(cache.cached_bytes.unsigned_abs())
    )];
    for d in &cache.tensors_by_device {
        lines.push(format!(
            "device: cuda:{} stream {}: tensors {} in {} blocks",
            d.device,
            d.stream,
            human_bytes(d.live_bytes),
            d.live_count
        ));
    }
    lines
}

fn python_line(found: &crate::interp::python::Interpreter) -> String {
    let object = found.object.rsplit('/').next().unwrap_or(&found.object);
    let how = if found.frames_read {
        let mut how = format!("Python frames read ({} stacks", found.stacks);
        if found.unresolved_frames > 0 {
            how.push_str(&format!(", {} frames unresolved", found.unresolved_frames));
        }
        if found.stacks_rejected > 0 {
            how.push_str(&format!(
                ", {} stacks rejected: their stored frames did not match their key",
                found.stacks_rejected
            ));
        }
        how.push(')');
        how
    } else {
        format!(
            "Python frames not read: {}",
            found.reason.as_deref().unwrap_or("?")
        )
    };
    format!(
        "python: pid {} CPython {} ({object}): {how}",
        found.pid, found.version
    )
}

/// A function inlined at a frame's address, above that frame (as perf and
/// heaptrack show them).
fn inlined_line(call: &crate::symbolize::InlinedCall, names: Names) -> String {
    let name = match names {
        Names::Full => call.symbol.clone(),
        Names::Short => crate::symbolize::short::short(&call.symbol, NAME_WIDTH),
    };
    let mut line = format!("(inlined) {name}");
    if let (Some(file), Some(number)) = (&call.file, call.line) {
        line.push_str(&format!(" at {file}:{number}"));
    }
    line
}

fn frame_line(frame: &Frame, names: Names) -> String {
    use crate::symbolize::short;
    let symbol = frame.symbol.as_deref().unwrap_or("??");
    let python = frame.kind == crate::report::FrameKind::Python;
    let place = if python {
        "[python]"
    } else {
        frame.addr.as_str()
    };
    let name = match names {
        Names::Full => symbol.to_string(),
        Names::Short if python => short::fit_plain(symbol, NAME_WIDTH),
        Names::Short => short::short(symbol, NAME_WIDTH),
    };
    let mut line = format!("{place} {name}");
    if let (Some(file), Some(number)) = (&frame.file, frame.line) {
        line.push_str(&format!(" at {file}:{number}"));
    }
    if let Some(module) = &frame.module {
        let name = module.rsplit('/').next().unwrap_or(module);
        line.push_str(&format!(
            " [{name}+{}]",
            frame.offset.as_deref().unwrap_or("?")
        ));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::fixture;

    fn render(report: &Report) -> String {
        let mut out = Vec::new();
        TextSink {
            names: Names::Short,
        }
        .write(report, false, &mut out)
        .expect("writes");
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn sampled_sites_show_their_estimate_under_the_traced_figures() {
        let mut report = fixture::report();
        report.settings.sample_rate = 4;
        report.sites[1].estimated_live_bytes = Some(1200);
        report.sites[1].estimated_live_count = Some(12);
        let text = render(&report);
        assert!(text.contains("#2 300 B (300 bytes) in 3 blocks"), "{text}");
        assert!(
            text.contains("    estimated 1.2 KiB in 12 blocks (sampled 1 in 4)"),
            "{text}"
        );
        assert!(!render(&fixture::report()).contains("estimated"));
    }

    fn reconciliation(tracked: u64, growth: i64, mmap: u64) -> Reconciliation {
        Reconciliation {
            rss_anon_at_attach: 100 << 20,
            rss_anon_now: (100i64 << 20).saturating_add(growth) as u64,
            rss_anon_growth: growth,
            vm_rss_at_attach: 120 << 20,
            vm_rss_now: 120 << 20,
            tracked_host_bytes: tracked,
            tracked_mmap_bytes: mmap,
            explained_ratio: None,
            note: String::new(),
        }
    }

    #[test]
    fn reconciliation_says_what_the_difference_means() {
        const MIB: u64 = 1 << 20;
        let words = |tracked: u64, growth: i64, mmap: u64| {
            reconciliation_words(&reconciliation(tracked, growth, mmap), None, 1)
        };
        // More tracked than resident: the issue's own example.
        assert_eq!(
            words(653 * MIB / 10, MIB as i64, 0),
            "tracked 65.3 MiB live since attach; RssAnon grew 1.0 MiB: untouched pages are not resident (a block counts only once written), or the blocks reuse heap freed before"
        );
        // Close enough: explained.
        let text = words(10 * MIB, 11 * MIB as i64, 0);
        assert!(
            text.ends_with("RssAnon grew 11.0 MiB: the tracked blocks explain the growth"),
            "{text}"
        );
        // Small figures within page rounding and allocator overhead.
        let text = words(4096, 0, 0);
        assert!(text.ends_with("RssAnon did not change: both within allocator and page rounding, nothing to explain"), "{text}");
        // More resident than tracked: memory memtrace did not see.
        let text = words(MIB, 40 * MIB as i64, 0);
        assert!(text.contains("RssAnon grew 40.0 MiB: the rest is memory the tracked blocks do not hold: blocks allocated before attach"), "{text}");
        assert!(
            text.contains("an allocator memtrace does not trace"),
            "{text}"
        );
        // ... unless tracked anonymous mappings can hold it.
        let text = words(MIB, 40 * MIB as i64, 39 * MIB);
        assert_eq!(text, "tracked 1.0 MiB of heap and 39.0 MiB of anonymous mappings live since attach; RssAnon grew 40.0 MiB: the mappings can hold what the heap does not explain (they count only where written)");
        // Shrinking RSS with blocks tracked: they reuse memory already resident.
        let text = words(8 * MIB, -(2 * MIB as i64), 0);
        assert!(
            text.contains("RssAnon shrank 2.0 MiB: untouched pages are not resident"),
            "{text}"
        );
        // Several processes: the figures are the target's; sampled: estimated.
        let text = reconciliation_words(&reconciliation(MIB, MIB as i64, 0), Some(42), 4);
        assert!(text.starts_with("pid 42: tracked 4.0 MiB live since attach (estimated: sampled 1 in 4); RssAnon grew 1.0 MiB: untouched"), "{text}");
    }

    #[test]
    fn the_report_carries_the_reconciliation_in_words() {
        let mut report = fixture::report();
        assert!(!render(&report).contains("memory: "));
        report.reconciliation = Some(reconciliation(1 << 20, 1 << 20, 0));
        let text = render(&report);
        assert!(text.contains("\nmemory: tracked 1.0 MiB live since attach; RssAnon grew 1.0 MiB: the tracked blocks explain the growth\n"), "{text}");
    }

    #[test]
    fn tables_built_while_tracing_get_a_line_saying_whether_all_are_in() {
        let mut report = fixture::report();
        let mut unwind = crate::unwind::kernel::UnwindSummary {
            mode: "dwarf".into(),
            deferred: 3,
            pending: vec!["/usr/lib/libbig.so".into()],
            ..Default::default()
        };
        report.unwind = Some(unwind.clone());
        assert!(
            render(&report).contains("3 objects, 1 still being built: /usr/lib/libbig.so"),
            "{}",
            render(&report)
        );
        unwind.pending.clear();
        unwind.deferred_ms = Some(812);
        report.unwind = Some(unwind.clone());
        assert!(render(&report).contains("3 objects, all in 812 ms after tracing started"));
        unwind.deferred = 0;
        report.unwind = Some(unwind);
        assert!(!render(&report).contains("built while tracing"));
    }

    #[test]
    fn the_function_cache_gets_a_line_and_its_failures_one_each() {
        let mut report = fixture::report();
        assert!(!render(&report).contains("allocator functions: cache"));
        report.function_cache = Some(crate::disk_cache::CacheStats {
            dir: "/var/cache/memtrace/unwind".into(),
            hits: 85,
            misses: 1,
            rejected: 1,
            failures: vec!["/usr/lib/libx.so: cached functions rejected: checksum mismatch".into()],
            ..Default::default()
        });
        let text = render(&report);
        assert!(
            text.contains("\nallocator functions: cache /var/cache/memtrace/unwind: 85 hits, 1 searched, 1 rejected, 0 evicted\nfunction cache: /usr/lib/libx.so: cached functions rejected: checksum mismatch\n"),
            "{text}"
        );
    }

    #[test]
    fn the_push_outcome_is_one_line() {
        let mut report = fixture::report();
        assert!(!render(&report).contains("pushed to"));
        report.push = Some(crate::report::PushStats {
            endpoint: "http://store/push.v1.PusherService/Push".into(),
            sent: 2,
            failed: 1,
            last_error: Some("HTTP 500".into()),
            ..Default::default()
        });
        assert!(render(&report).contains(
            "pushed to http://store/push.v1.PusherService/Push: 2 sent, 1 failed, 0 dropped, 0 retries (last error: HTTP 500)"
        ));
    }

    #[test]
    fn processes_traced_by_name_get_a_line_each() {
        let mut report = fixture::report();
        let named = |pid: u32, late: bool| ProcessInfo {
            pid,
            comm: "worker".into(),
            by_name: true,
            started_during_trace: late,
            traced_from_ms: if late { 2500 } else { 1 },
            attach_delay_ms: late.then_some(120),
            live_bytes: 2048,
            live_count: 2,
            ..ProcessInfo::default()
        };
        report.processes = vec![named(10, false), named(11, true)];
        let text = render(&report);
        assert!(
            text.contains("\nprocess: pid 10 (worker) holds 2.0 KiB in 2 blocks\n"),
            "{text}"
        );
        assert!(text.contains("\nprocess: pid 11 (worker) holds 2.0 KiB in 2 blocks, started during the trace, traced from 2.5s (120 ms after it started)\n"), "{text}");
        // By pid, a lone target gets no line; a child does.
        report.processes = vec![
            ProcessInfo {
                pid: 10,
                ..ProcessInfo::default()
            },
            ProcessInfo {
                pid: 12,
                parent: Some(10),
                comm: "kid".into(),
                ..ProcessInfo::default()
            },
        ];
        let text = render(&report);
        assert!(!text.contains("process: pid"), "{text}");
        assert!(
            text.contains("child: pid 12 (kid) of pid 10 holds 0 B in 0 blocks"),
            "{text}"
        );
    }

    #[test]
    fn unmatched_frees_under_a_size_filter_are_marked_expected() {
        let mut report = fixture::report();
        assert!(render(&report).contains(" 1 unmatched frees, "));
        report.settings.min_size = 64;
        assert!(render(&report).contains(" 1 unmatched frees (expected: size filter), "));
        report.settings.min_size = 0;
        report.settings.max_size = Some(4096);
        assert!(render(&report).contains("(expected: size filter)"));
        report.events.unmatched_frees = 0;
        assert!(!render(&report).contains("expected"));
    }

    /// PyTorch's dispatcher frame, as it made 1,189-character lines.
    const PYTORCH_CALL: &str = "c10::impl::wrap_kernel_functor_unboxed_<c10::impl::detail::WrapFunctionIntoFunctor_<c10::CompileTimeFunctionPointer<at::Tensor (c10::DispatchKeySet, at::Tensor const&, c10::ArrayRef<long>, c10::optional<c10::ScalarType>), &torch::autograd::VariableType::(anonymous namespace)::empty_strided>, at::Tensor, c10::guts::typelist::typelist<c10::DispatchKeySet, at::Tensor const&, c10::ArrayRef<long>, c10::optional<c10::ScalarType> > >, at::Tensor (c10::DispatchKeySet, at::Tensor const&, c10::ArrayRef<long>, c10::optional<c10::ScalarType>)>::call(c10::OperatorKernel*, c10::DispatchKeySet, at::Tensor const&, c10::ArrayRef<long>, c10::optional<c10::ScalarType>)";

    #[test]
    fn cpp_frames_are_short_unless_full_names_are_asked() {
        let mut report = fixture::report();
        report.sites[0].frames[0].symbol = Some(PYTORCH_CALL.into());
        let short = render(&report);
        assert!(
            short.contains(
                " c10::impl::wrap_kernel_functor_unboxed_<…>::call(…) at app.c:42 [app+0x600]\n"
            ),
            "{short}"
        );
        assert!(!short.contains("OperatorKernel"), "{short}");
        let mut out = Vec::new();
        TextSink { names: Names::Full }
            .write(&report, false, &mut out)
            .expect("writes");
        let full = String::from_utf8(out).expect("utf-8");
        assert!(
            full.contains(&format!(" {PYTORCH_CALL} at app.c:42")),
            "{full}"
        );
        // Only the frame line differs.
        assert_eq!(short.lines().count(), full.lines().count());
        // Too long even short: the front namespaces go.
        report.sites[0].frames[0].symbol = Some(format!(
            "{}::Allocator::malloc(unsigned long)",
            ["outer", "middle", "inner"].repeat(8).join("::")
        ));
        let text = render(&report);
        let line = text
            .lines()
            .find(|l| l.contains("Allocator::malloc(…)"))
            .expect("frame line");
        assert!(line.contains(" …::"), "{line}");
        let name = line.split(' ').find(|w| w.starts_with('…')).expect("name");
        assert!(name.chars().count() <= NAME_WIDTH, "{name}");
    }

    #[test]
    fn python_frames_show_name_file_and_line() {
        let frame =
            crate::interp::python::merge::python_frame(&crate::interp::python::resolve::PyFrame {
                name: "Handler.handle".into(),
                file: Some("app.py".into()),
                line: Some(8),
            });
        assert_eq!(
            frame_line(&frame, Names::Short),
            "[python] Handler.handle at app.py:8"
        );
    }

    #[test]
    fn python_interpreters_are_named_with_what_was_read() {
        let found = crate::interp::python::Interpreter {
            pid: 7,
            version: "3.12.1".into(),
            object: "/opt/py/lib/libpython3.12.so.1.0".into(),
            frames_read: true,
            reason: None,
            stacks: 4,
            unresolved_frames: 1,
            stacks_rejected: 0,
        };
        assert_eq!(
            python_line(&found),
            "python: pid 7 CPython 3.12.1 (libpython3.12.so.1.0): Python frames read (4 stacks, 1 frames unresolved)"
        );
        let old = crate::interp::python::Interpreter {
            frames_read: false,
            reason: Some("frames of Python 3.7 are not read (3.8 to 3.13 are)".into()),
            ..found
        };
        assert!(python_line(&old)
            .ends_with("not read: frames of Python 3.7 are not read (3.8 to 3.13 are)"));
    }

    #[test]
    fn the_leak_check_reads_like_valgrind_and_splits_each_site() {
        use crate::reach::Category;
        use crate::report::leak::{CheckPoint, LeakCheck};
        let mut report = fixture::checked_report();
        if let Some(check) = report.leak_check.as_mut() {
            check.when = Some(CheckPoint::Exit);
            check.threads = 2;
            check.processes = 1;
            check.failed_gates = vec!["definitely-lost".into()];
            check.split = crate::report::LeakSplit::default();
            for _ in 0..100 {
                check.split.add(Category::DefinitelyLost, 256);
            }
            check.split.add(Category::StillReachable, 1_234_567);
        }
        let text = render(&report);
        assert!(
            text.contains("   definitely lost: 25,600 bytes in 100 blocks"),
            "{text}"
        );
        assert!(
            text.contains("   still reachable: 1,234,567 bytes in 1 blocks"),
            "{text}"
        );
        assert!(
            text.contains("     possibly lost: 0 bytes in 0 blocks"),
            "{text}"
        );
        assert!(text.contains("leak check at exit: 2 thread(s)"), "{text}");
        assert!(
            text.contains("FAILED --fail-on definitely-lost (exit 5)"),
            "{text}"
        );
        assert!(
            text.contains("leak check: definitely lost 300 B in 1 blocks"),
            "{text}"
        );
        assert!(text.contains("leak check: all still reachable"), "{text}");
        report.leak_check = Some(LeakCheck::not_run(
            CheckPoint::End,
            "pid 9 is already traced by pid 10",
        ));
        let text = render(&report);
        assert!(
            text.contains("leak check at the end: not run: pid 9 is already traced by pid 10"),
            "{text}"
        );
        assert!(!text.contains("definitely lost:"), "{text}");
    }

    #[test]
    fn inlined_functions_are_shown_above_their_frame() {
        let mut report = fixture::report();
        report.sites[0].frames[0].inlined = vec![crate::symbolize::InlinedCall {
            symbol: "std::vector<int, std::allocator<int> >::_M_realloc_insert(int&&)".into(),
            file: Some("vector.tcc".into()),
            line: Some(449),
        }];
        let text = render(&report);
        let inlined = text
            .lines()
            .position(|l| {
                l.contains("(inlined) std::vector<…>::_M_realloc_insert(…) at vector.tcc:449")
            })
            .expect("the inlined line");
        assert!(
            text.lines()
                .nth(inlined + 1)
                .is_some_and(|l| l.contains(" 0 0x5600 alloc_buffers")),
            "{text}"
        );
    }
}
