//! Text sink: what a person reads — totals, then each site with its bytes,
//! count, oldest age and symbolized frames.

use std::io::Write;

use super::{human_bytes, Sink};
use crate::report::{Frame, Report};

pub struct TextSink;

impl Sink for TextSink {
    fn write(&self, report: &Report, interim: bool, out: &mut dyn Write) -> std::io::Result<()> {
        let target = &report.target;
        let kind = if interim { "interim report" } else { "report" };
        writeln!(
            out,
            "memtrace {kind}: pid {} ({}) {} — traced {:.1}s",
            target.pid,
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
        for process in report.processes.iter().filter(|p| p.parent.is_some()) {
            writeln!(
                out,
                "child: pid {} ({}) of pid {} holds {} in {} blocks{}",
                process.pid,
                process.comm,
                process.parent.unwrap_or_default(),
                human_bytes(process.live_bytes),
                process.live_count,
                if process.exited { ", exited" } else { "" }
            )?;
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
                site.functions.join(","),
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
            if let Some(note) = &site.stack_note {
                writeln!(out, "    ({note})")?;
            }
            for (depth, frame) in site.frames.iter().enumerate() {
                writeln!(out, "    {depth:>2} {}", frame_line(frame))?;
            }
        }
        if report.sites.is_empty() {
            writeln!(out, "no outstanding allocation sites")?;
        }
        Ok(())
    }
}

/// The site's trend and leak pattern in words.
fn judgment(site: &crate::report::Site) -> String {
    use crate::analysis::{Pattern, Trend};
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
        Some(Pattern::LargeOnce) => {
            text.push_str("; one large block held (e.g. a model never unloaded)")
        }
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

/// What was found of one CPython interpreter.
fn python_line(found: &crate::interp::python::Interpreter) -> String {
    let object = found.object.rsplit('/').next().unwrap_or(&found.object);
    let how = if found.frames_read {
        let mut how = format!("Python frames read ({} stacks", found.stacks);
        if found.unresolved_frames > 0 {
            how.push_str(&format!(", {} frames unresolved", found.unresolved_frames));
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

fn frame_line(frame: &Frame) -> String {
    let place = match frame.kind {
        crate::report::FrameKind::Python => "[python]",
        crate::report::FrameKind::Native => frame.addr.as_str(),
    };
    let mut line = format!("{place} {}", frame.symbol.as_deref().unwrap_or("??"));
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
        TextSink.write(report, false, &mut out).expect("writes");
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

    #[test]
    fn python_frames_show_name_file_and_line() {
        let frame =
            crate::interp::python::merge::python_frame(&crate::interp::python::resolve::PyFrame {
                name: "Handler.handle".into(),
                file: Some("app.py".into()),
                line: Some(8),
            });
        assert_eq!(frame_line(&frame), "[python] Handler.handle at app.py:8");
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
}
