//! Output sinks: each renders a [`Report`] in one format behind one trait, so
//! the event pipeline is the same whatever the user asked for.
//!
//! Sampling (`--sample-rate N`): the text and JSON sinks show what was traced
//! and, per site, the estimate (`estimated_live_bytes`/`estimated_live_count`,
//! the sample times N); the sinks that draw or profile (pprof, folded, flame
//! graph, timeline) show estimates only, so their figures compare with an
//! unsampled run, and say so where the format has room for it.

mod flamegraph;
mod folded;
pub mod html;
mod json;
pub mod pprof;
mod text;
mod timeline;

use std::io::Write;

use clap::ValueEnum;

use crate::report::{Frame, Report, Site};
pub use crate::symbolize::short::Names;

/// Output formats of the trace report (`--format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Human-readable report.
    Text,
    /// Stable JSON contract.
    Json,
    /// Collapsed stacks weighted by live bytes (for flamegraph tools).
    Folded,
    /// Flame graph of live bytes by allocation site (SVG).
    Flamegraph,
    /// Gzipped pprof profile (`go tool pprof`): in-use space and objects.
    Pprof,
    /// Chrome trace-event JSON of live bytes over time (Perfetto, chrome://tracing).
    Timeline,
    /// One self-contained HTML page: summary, charts, flame graph, sites table.
    Html,
}

/// Renders reports in one format.
pub trait Sink {
    /// Writes one report; interim reports carry `interim = true`.
    fn write(&self, report: &Report, interim: bool, out: &mut dyn Write) -> std::io::Result<()>;
}

/// The sink for a `--format` value. `names`: how the formats a person
/// reads (text, HTML) show frame names; the others always show them whole.
pub fn for_format(format: Format, names: Names) -> Box<dyn Sink> {
    match format {
        Format::Text => Box::new(text::TextSink { names }),
        Format::Json => Box::new(json::JsonSink),
        Format::Folded => Box::new(folded::FoldedSink),
        Format::Flamegraph => Box::new(flamegraph::FlamegraphSink),
        Format::Pprof => Box::new(pprof::PprofSink),
        Format::Timeline => Box::new(timeline::TimelineSink),
        Format::Html => Box::new(html::HtmlSink { names }),
    }
}

/// The report's sampling rate, 1 when every allocation was traced.
pub fn sample_rate(report: &Report) -> u64 {
    u64::from(report.settings.sample_rate.max(1))
}

/// A figure of the traced sample as an estimate for the whole process: with
/// `--sample-rate N`, the figure times N (saturating), else the figure.
pub fn scaled(report: &Report, value: u64) -> u64 {
    value.saturating_mul(sample_rate(report))
}

/// A site's live bytes and blocks as the profile sinks (pprof, folded,
/// flame graph) weigh it: the JSON report's `estimated_live_bytes` and
/// `estimated_live_count` when sampled, else what was traced.
pub fn site_live(report: &Report, site: &Site) -> (u64, u64) {
    (
        site.estimated_live_bytes
            .unwrap_or_else(|| scaled(report, site.live_bytes)),
        site.estimated_live_count
            .unwrap_or_else(|| scaled(report, site.live_count)),
    )
}

/// What the sinks that scale say about it, when the report is sampled.
pub fn scaling_note(report: &Report) -> Option<String> {
    let rate = sample_rate(report);
    (rate > 1).then(|| {
        format!(
            "sampled: one allocation in {rate} traced (by address); bytes and blocks are estimates, the sample scaled by {rate}"
        )
    })
}

/// Human-readable byte count (binary units).
/// A probed function's name as a person reads it: C++ names demangled
/// (`_Znwm` -> `operator new(unsigned long)`), others as they are.
pub fn function_name(name: &str) -> String {
    if !name.starts_with("_Z") {
        return name.to_string();
    }
    cpp_demangle::Symbol::new(name)
        .ok()
        .and_then(|symbol| symbol.demangle().ok())
        .unwrap_or_else(|| name.to_string())
}

pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// A frame's display name: its symbol, else `module+offset` (module file
/// name only), else its address; a Python frame is `name (file:line)`
/// (file name only), as py-spy shows it.
pub fn frame_name(frame: &Frame) -> String {
    if frame.kind == crate::report::FrameKind::Python {
        let file = frame.file.as_deref().unwrap_or("?");
        return format!(
            "{} ({}:{})",
            frame.symbol.as_deref().unwrap_or("?"),
            module_name(file),
            frame
                .line
                .map_or_else(|| "?".to_string(), |l| l.to_string())
        );
    }
    if let Some(symbol) = frame.symbol.as_deref().filter(|s| !s.is_empty()) {
        return symbol.to_string();
    }
    match (&frame.module, &frame.offset) {
        (Some(module), Some(offset)) => format!("{}+{offset}", module_name(module)),
        _ => frame.addr.clone(),
    }
}

/// [`frame_name`] for a person: a native symbol shortened to `width`
/// ([`crate::symbolize::short`]), a Python frame's `name (file:line)` cut
/// to it; whole under [`Names::Full`].
pub fn short_frame_name(frame: &Frame, names: Names, width: usize) -> String {
    use crate::symbolize::short;
    let full = frame_name(frame);
    match names {
        Names::Full => full,
        Names::Short if frame.kind == crate::report::FrameKind::Python => {
            short::fit_plain(&full, width)
        }
        Names::Short => match frame.symbol.as_deref().filter(|s| !s.is_empty()) {
            Some(symbol) => short::short(symbol, width),
            None => full,
        },
    }
}

/// A leak pattern in a few words (`per-iteration 256 B/5ms`).
pub fn pattern_label(pattern: &crate::analysis::Pattern) -> String {
    use crate::analysis::Pattern;
    match pattern {
        Pattern::PerIteration {
            period_ms,
            bytes_per_period,
        } => format!(
            "per-iteration {}/{period_ms:.0}ms",
            human_bytes(*bytes_per_period)
        ),
        Pattern::LargeOnce => "large-once".to_string(),
        Pattern::SmallAccumulating => "small-accumulating".to_string(),
    }
}

/// The file name of a module path (`/usr/lib/libc.so.6` -> `libc.so.6`).
pub fn module_name(module: &str) -> &str {
    module.rsplit('/').next().unwrap_or(module)
}

#[cfg(test)]
pub(crate) mod fixture {
    //! A small hand-made report shared by the sink and exporter tests.

    use std::collections::BTreeMap;

    use crate::probe::catalog::{Allocator, Memory};
    use crate::report::{
        EventCounts, FailedCall, Frame, Report, Settings, Site, TargetInfo, TimelineSample, Total,
    };

    fn frame(addr: &str, symbol: Option<&str>, offset: &str, line: Option<u32>) -> Frame {
        Frame {
            kind: crate::report::FrameKind::Native,
            addr: addr.into(),
            symbol: symbol.map(str::to_string),
            module: Some("/opt/app/bin/app".into()),
            file: line.map(|_| "app.c".to_string()),
            line,
            offset: Some(offset.into()),
            inlined: Vec::new(),
        }
    }

    fn site(allocator: Allocator, memory: Memory, bytes: u64, count: u64) -> Site {
        Site {
            allocator,
            memory,
            live_bytes: bytes,
            live_count: count,
            oldest_age_ms: 1500,
            trend: crate::analysis::Trend::Growing,
            growth_bytes_per_s: 12.5,
            pattern: None,
            survived_intervals: 2,
            estimated_live_bytes: None,
            estimated_live_count: None,
            functions: vec!["malloc".into()],
            internal: false,
            threads: vec![7],
            pids: vec![4242],
            thread_names: vec!["worker".into()],
            stack_note: None,
            frames: Vec::new(),
            history: vec![(1000, bytes / 2), (2000, bytes)],
            leak_check: None,
        }
    }

    /// [`report`] after a leak check: its first site still reachable, its
    /// second definitely lost.
    pub fn checked_report() -> Report {
        use crate::reach::Category;
        let mut report = report();
        let mut check = crate::report::LeakCheck {
            ran: true,
            when: Some(crate::report::leak::CheckPoint::End),
            pause_ms: 12.5,
            ..Default::default()
        };
        check.split.add(Category::StillReachable, 4096);
        check.split.add(Category::DefinitelyLost, 300);
        report.leak_check = Some(check);
        let mut held = crate::report::LeakSplit::default();
        held.add(Category::StillReachable, 4096);
        report.sites[0].leak_check = Some(held);
        let mut lost = crate::report::LeakSplit::default();
        lost.add(Category::DefinitelyLost, 300);
        report.sites[1].leak_check = Some(lost);
        report
    }

    /// Three sites: a CUDA one with two frames, a libc one whose inner frame
    /// has no symbol, and a libc one without a stack.
    pub fn report() -> Report {
        let cuda = Site {
            functions: vec!["cudaMalloc".into()],
            frames: vec![
                frame("0x5600", Some("alloc_buffers"), "0x600", Some(42)),
                frame("0x5700", Some("main"), "0x700", Some(7)),
            ],
            ..site(Allocator::Cuda, Memory::Device, 4096, 1)
        };
        let libc = Site {
            frames: vec![
                frame("0x5100", None, "0x100", None),
                frame("0x5200", Some("main"), "0x200", Some(9)),
            ],
            ..site(Allocator::Libc, Memory::Host, 300, 3)
        };
        let bare = Site {
            stack_note: Some("stacks not requested (--stack-depth 0)".into()),
            ..site(Allocator::Libc, Memory::Host, 50, 1)
        };
        let timeline = vec![
            sample(1000, Allocator::Libc, Memory::Host, 100, 1),
            sample(2000, Allocator::Libc, Memory::Host, 350, 4),
            sample(2000, Allocator::Cuda, Memory::Device, 4096, 1),
        ];
        Report {
            stack_truncations_by_cause: BTreeMap::new(),
            unwind: None,
            function_cache: None,
            bpf_programs: Vec::new(),
            device_cache: None,
            usdt: Vec::new(),
            push: None,
            otlp: None,
            python: Vec::new(),
            leak_check: None,
            processes: Vec::new(),
            attach_failures: Vec::new(),
            target: TargetInfo {
                pid: 4242,
                comm: "app".into(),
                exe: "/opt/app/bin/app".into(),
                ..TargetInfo::default()
            },
            duration_ms: 2500,
            interim: false,
            complete: true,
            events: EventCounts {
                allocs: 10,
                frees: 5,
                lost: 0,
                unmatched_frees: 1,
                releases_seen_twice: 0,
                settled_in_kernel: 0,
                stack_failures: 2,
                failed_calls: 3,
                table_full: 0,
                mappings_trimmed: 0,
                unmaps_untracked: 0,
                addresses_reused: 0,
            },
            lost_by_cause: [("ringbuf_full".to_string(), 0)].into_iter().collect(),
            stack_failures_by_cause: BTreeMap::new(),
            totals: vec![
                Total {
                    allocator: Allocator::Libc,
                    memory: Memory::Host,
                    live_bytes: 350,
                    live_count: 4,
                },
                Total {
                    allocator: Allocator::Cuda,
                    memory: Memory::Device,
                    live_bytes: 4096,
                    live_count: 1,
                },
            ],
            sites: vec![cuda, libc, bare],
            failed_calls: vec![FailedCall {
                function: "cudaMalloc".into(),
                allocator: Allocator::Cuda,
                code: 2,
                count: 3,
            }],
            libraries: Vec::new(),
            missing_functions: Vec::new(),
            settings: Settings {
                stack_depth: 32,
                min_age_ms: 0,
                top: 20,
                sample_rate: 1,
                ..Settings::default()
            },
            kernel_counters: BTreeMap::new(),
            notes: Vec::new(),
            timeline,
            suppressed: Default::default(),
            reconciliation: None,
        }
    }

    fn sample(
        t_ms: u64,
        allocator: Allocator,
        memory: Memory,
        bytes: u64,
        count: u64,
    ) -> TimelineSample {
        TimelineSample {
            t_ms,
            allocator,
            memory,
            live_bytes: bytes,
            live_count: count,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_functions_read_demangled() {
        assert_eq!(function_name("_Znwm"), "operator new(unsigned long)");
        assert_eq!(
            function_name("_ZdlPvm"),
            "operator delete(void*, unsigned long)"
        );
        assert_eq!(function_name("malloc"), "malloc");
        assert_eq!(function_name("_Zbroken"), "_Zbroken");
    }

    #[test]
    fn bytes_are_human() {
        assert_eq!(human_bytes(12), "12 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(8 << 20), "8.0 MiB");
    }

    #[test]
    fn every_format_but_folded_names_the_pod() {
        let mut report = fixture::report();
        report.target.placement = crate::tracee::container::Placement::sample_pod();
        for format in [
            Format::Text,
            Format::Json,
            Format::Flamegraph,
            Format::Pprof,
            Format::Timeline,
            Format::Html,
        ] {
            let mut out = Vec::new();
            for_format(format, Names::Short)
                .write(&report, false, &mut out)
                .expect("renders");
            if format == Format::Pprof {
                let mut plain = Vec::new();
                std::io::Read::read_to_end(
                    &mut flate2::read::GzDecoder::new(out.as_slice()),
                    &mut plain,
                )
                .expect("gzip");
                out = plain;
            }
            let text = String::from_utf8_lossy(&out);
            let (pod, container) = if format == Format::Json {
                ("\"pod_name\":\"web-0\"", "\"container_name\":\"app\"")
            } else {
                ("pod shop/web-0", "app")
            };
            assert!(
                text.contains(pod) && text.contains(container),
                "{format:?}: {text}"
            );
        }
    }
}
