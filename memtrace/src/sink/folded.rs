//! Folded sink: collapsed stacks weighted by live bytes, the input format of
//! flame-graph tools (inferno, FlameGraph, speedscope). One line per stack:
//! `outermost;...;innermost;[allocator memory] live_bytes`. With
//! `--sample-rate N` the weight is the estimate (the sample times N, the JSON
//! report's `estimated_live_bytes`); the format has no room to say so.

use std::collections::HashMap;
use std::io::Write;

use super::{frame_name, site_live, Sink};
use crate::report::{Report, Site};

pub struct FoldedSink;

impl Sink for FoldedSink {
    /// Interim reports are skipped: a folded file is read whole, and several
    /// reports in one stream would be summed by the tools reading it.
    fn write(&self, report: &Report, interim: bool, out: &mut dyn Write) -> std::io::Result<()> {
        if interim {
            return Ok(());
        }
        for line in lines(report) {
            writeln!(out, "{line}")?;
        }
        Ok(())
    }
}

/// The folded lines of a report, in site order; sites whose stacks render
/// the same are merged into the first one's line.
pub(super) fn lines(report: &Report) -> Vec<String> {
    let mut order: Vec<String> = Vec::new();
    let mut bytes: HashMap<String, u64> = HashMap::new();
    for site in &report.sites {
        let stack = stack(site);
        let (weight, _) = site_live(report, site);
        match bytes.get_mut(&stack) {
            Some(total) => *total = total.saturating_add(weight),
            None => {
                bytes.insert(stack.clone(), weight);
                order.push(stack);
            }
        }
    }
    order
        .into_iter()
        .map(|stack| {
            let total = bytes.get(&stack).copied().unwrap_or(0);
            format!("{stack} {total}")
        })
        .collect()
}

/// The `;`-joined frames of one site, outermost first, ending with the
/// allocator pseudo-frame.
fn stack(site: &Site) -> String {
    let mut parts: Vec<String> = site
        .frames
        .iter()
        .rev()
        .map(|frame| escape(&frame_name(frame)))
        .collect();
    if parts.is_empty() {
        parts.push("[no stack]".into());
    }
    parts.push(format!(
        "[{} {}]",
        site.allocator.name(),
        site.memory.name()
    ));
    parts.join(";")
}

/// Makes a frame name safe in a folded line: `;` separates frames (collapse
/// tools turn it into `:`, as inferno's do), a line break would end the line,
/// and leading or trailing blanks would be trimmed. Inner spaces are kept:
/// readers take the count after the last space only (C++ names have spaces).
fn escape(name: &str) -> String {
    let cleaned: String = name
        .chars()
        .map(|c| match c {
            ';' => ':',
            c if c.is_control() || c.is_whitespace() => ' ',
            c => c,
        })
        .collect();
    let trimmed = cleaned.trim();
    if trimmed.is_empty() {
        "??".into()
    } else {
        trimmed.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::fixture;

    #[test]
    fn folded_lines_are_exact() {
        let report = fixture::report();
        assert_eq!(
            lines(&report),
            vec![
                "main;alloc_buffers;[cuda device] 4096",
                "main;app+0x100;[libc host] 300",
                "[no stack];[libc host] 50",
            ]
        );
    }

    #[test]
    fn folded_weights_of_a_sampled_report_are_the_estimates() {
        let mut report = fixture::report();
        report.settings.sample_rate = 8;
        report.sites[0].estimated_live_bytes = Some(4096 * 8);
        assert_eq!(
            lines(&report),
            vec![
                "main;alloc_buffers;[cuda device] 32768",
                "main;app+0x100;[libc host] 2400",
                "[no stack];[libc host] 400",
            ]
        );
    }

    #[test]
    fn folded_sink_writes_final_reports_only() {
        let report = fixture::report();
        let mut out = Vec::new();
        FoldedSink
            .write(&report, true, &mut out)
            .expect("writes interim");
        assert!(out.is_empty());
        FoldedSink
            .write(&report, false, &mut out)
            .expect("writes final");
        let text = String::from_utf8(out).expect("utf-8");
        assert_eq!(text.lines().count(), 3);
        assert!(text.ends_with("[no stack];[libc host] 50\n"));
    }

    #[test]
    fn folded_names_are_escaped_and_same_stacks_merged() {
        let mut report = fixture::report();
        report.sites[0].frames[0].symbol = Some("std::array<int; 4>::fill\n(x) ".into());
        let mut twin = report.sites[0].clone();
        twin.live_bytes = 4;
        report.sites.push(twin);
        let lines = lines(&report);
        assert_eq!(lines.len(), 3);
        assert_eq!(
            lines[0],
            "main;std::array<int: 4>::fill (x);[cuda device] 4100"
        );
        assert_eq!(escape(" \t"), "??");
    }
}
