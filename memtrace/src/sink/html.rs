//! HTML sink: the whole report as one self-contained page (no network, no
//! external script or font): summary, event and loss counters,
//! reconciliation, live-bytes charts per allocator and for the top sites
//! (inline SVG, [`chart`]), the interactive flame graph (inferno's SVG, with
//! its own script, in a `data:` frame), and the sites table with every
//! site's full stack.
//!
//! The table is drawn by the page's script from one embedded JSON blob,
//! a page of rows at a time, so 10,000 sites stay quick: frames are stored
//! once and referenced by index, and per-site histories are kept only for
//! the first [`HISTORY_SITES`] sites. Static text is escaped here
//! ([`escape`]); the script only ever sets `textContent`.
//!
//! Frame names in the table, the stacks and the chart legends are short
//! ([`crate::symbolize::short`], at most [`NAME_WIDTH`] characters) unless
//! `--full-names` asks for them whole; a shortened name's full form is its
//! tooltip (and the filter searches it). The flame graph keeps full names.
//!
//! Sampled traces show estimates and say so in a banner; incomplete traces
//! (lost events, a full table, failed attaches) say so on top. Only the
//! final report is written.
//!
//! Over 800 lines with its tests (~220): the page's own code is ~630.

pub mod chart;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write;

use base64::Engine as _;
use serde::Serialize;

use super::{
    frame_name, human_bytes, module_name, pattern_label, scaled, scaling_note, short_frame_name,
    site_live, Names, Sink,
};
use crate::report::{Frame, FrameKind, Report};

/// Sites whose live-bytes history is embedded (for their detail chart).
pub const HISTORY_SITES: usize = 200;
/// Points kept per embedded site history.
const HISTORY_POINTS: usize = 120;
/// Width of the embedded flame graph, pixels. Frames narrower than half a
/// pixel are left out of it: with 10,000 sites they would be most of the
/// page, and every site is in the table anyway.
const FLAME_WIDTH: usize = 1200;
/// Most characters of a short frame name in the table and the stacks.
pub const NAME_WIDTH: usize = 120;
/// Most characters of a short frame name in a chart legend.
const LEGEND_WIDTH: usize = 60;
/// Sites drawn in the "top sites" chart.
const CHART_SITES: usize = 8;

const STYLE: &str = include_str!("html/report.css");
const SCRIPT: &str = include_str!("html/report.js");

pub struct HtmlSink {
    /// Short or whole frame names (`--full-names`).
    pub names: Names,
}

impl Sink for HtmlSink {
    fn write(&self, report: &Report, interim: bool, out: &mut dyn Write) -> std::io::Result<()> {
        if interim {
            return Ok(());
        }
        out.write_all(page(report, self.names)?.as_bytes())
    }
}

/// Escapes text for HTML content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The page's shared style sheet (the monitor's page uses it too).
pub fn style() -> &'static str {
    STYLE
}

/// The whole page.
pub fn page(report: &Report, names: Names) -> std::io::Result<String> {
    let mut out = String::with_capacity(64 << 10);
    let title = format!(
        "memtrace: {} (pid {})",
        report.target.comm, report.target.pid
    );
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; frame-src data:\">\
         <title>{}</title><style>{STYLE}</style></head><body>",
        escape(&title)
    );
    banners(&mut out, report);
    let _ = write!(
        out,
        "<header><h1>{}</h1><p class=\"sub\">{}{} &middot; traced {} &middot; {} allocs, {} frees</p></header>",
        escape(&title),
        escape(&report.target.exe),
        report
            .target
            .placement
            .summary()
            .map(|summary| format!(" &middot; {}", escape(&summary)))
            .unwrap_or_default(),
        escape(&duration(report.duration_ms)),
        report.events.allocs,
        report.events.frees
    );
    out.push_str("<nav><a href=\"#summary\">Summary</a>");
    if report.leak_check.is_some() {
        out.push_str("<a href=\"#leak-check\">Leak check</a>");
    }
    out.push_str("<a href=\"#charts\">Live bytes over time</a><a href=\"#flame\">Flame graph</a><a href=\"#sites\">Sites</a></nav>");
    summary(&mut out, report);
    leak_check_section(&mut out, report);
    charts(&mut out, report, names);
    flame(&mut out, report);
    sites_section(&mut out, report);
    let _ = write!(
        out,
        "<script type=\"application/json\" id=\"memtrace-data\">{}</script><script>{SCRIPT}</script></body></html>",
        data(report, names)?
    );
    out.push('\n');
    Ok(out)
}

fn duration(ms: u64) -> String {
    humantime::format_duration(std::time::Duration::from_millis(ms)).to_string()
}

fn banners(out: &mut String, report: &Report) {
    if !report.complete {
        let mut why = Vec::new();
        if report.events.lost > 0 {
            why.push(format!("{} events were lost", report.events.lost));
        }
        if report.events.table_full > 0 {
            why.push(format!(
                "{} allocations were not tracked (live table full)",
                report.events.table_full
            ));
        }
        if !report.attach_failures.is_empty() {
            why.push(format!(
                "{} function(s) could not be attached",
                report.attach_failures.len()
            ));
        }
        let _ = write!(
            out,
            "<div class=\"banner bad\" id=\"incomplete\"><b>Incomplete trace:</b> {}; the live table may be wrong (see the counters below).</div>",
            escape(&why.join("; "))
        );
    }
    if let Some(note) = scaling_note(report) {
        let _ = write!(
            out,
            "<div class=\"banner warn\" id=\"sampled\"><b>Estimates:</b> {}.</div>",
            escape(&note)
        );
    }
    if report.interim {
        out.push_str("<div class=\"banner warn\">Interim report: tracing was still running.</div>");
    }
}

/// A two-column table of `(name, value)` rows.
fn kv_table(out: &mut String, id: &str, caption: &str, rows: &[(String, String)]) {
    let _ = write!(
        out,
        "<table class=\"kv\" id=\"{id}\"><caption>{}</caption>",
        escape(caption)
    );
    for (name, value) in rows {
        let _ = write!(
            out,
            "<tr><th>{}</th><td>{}</td></tr>",
            escape(name),
            escape(value)
        );
    }
    out.push_str("</table>");
}

/// The leak check: valgrind's four lines, and the sites holding lost bytes.
fn leak_check_section(out: &mut String, report: &Report) {
    let Some(check) = &report.leak_check else {
        return;
    };
    out.push_str("<section id=\"leak-check\"><h2>Leak check</h2>");
    if !check.ran {
        let _ = write!(
            out,
            "<p class=\"note\">The leak check did not run: {}</p></section>",
            escape(check.reason.as_deref().unwrap_or("no reason given"))
        );
        return;
    }
    let amount = |a: crate::report::leak::Amount| {
        format!(
            "{} ({} bytes) in {} blocks",
            human_bytes(a.bytes),
            a.bytes,
            a.blocks
        )
    };
    let split = &check.split;
    let mut rows = vec![
        ("definitely lost".to_string(), amount(split.definitely_lost)),
        ("indirectly lost".to_string(), amount(split.indirectly_lost)),
        ("possibly lost".to_string(), amount(split.possibly_lost)),
        ("still reachable".to_string(), amount(split.still_reachable)),
        (
            "pause".to_string(),
            format!(
                "{:.1} ms: {} thread(s) of {} process(es), {} scanned",
                check.pause_ms,
                check.threads,
                check.processes,
                human_bytes(check.scanned_bytes)
            ),
        ),
    ];
    for (heuristic, reached) in &check.reachable_via_heuristic {
        rows.push((format!("reachable via {heuristic}"), amount(*reached)));
    }
    if let Some(reason) = &check.reason {
        rows.push(("note".to_string(), reason.clone()));
    }
    if !check.failed_gates.is_empty() {
        rows.push((
            "--fail-on".to_string(),
            format!("FAILED: {}", check.failed_gates.join(", ")),
        ));
    }
    kv_table(
        out,
        "leak-summary",
        "What nothing points to any more (valgrind's categories)",
        &rows,
    );
    out.push_str(
        "<table class=\"grid\" id=\"leak-sites\"><thead><tr><th>#</th><th>top frame</th>\
         <th>definitely lost</th><th>indirectly lost</th><th>possibly lost</th><th>still reachable</th>\
         </tr></thead><tbody>",
    );
    for (rank, site) in report.sites.iter().enumerate() {
        let Some(split) = &site.leak_check else {
            continue;
        };
        let cell = |a: crate::report::leak::Amount| {
            if a.blocks == 0 {
                String::new()
            } else {
                format!("{} in {}", human_bytes(a.bytes), a.blocks)
            }
        };
        let frame = site
            .frames
            .first()
            .map_or_else(|| "[no stack]".to_string(), frame_name);
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            rank + 1,
            escape(&frame),
            cell(split.definitely_lost),
            cell(split.indirectly_lost),
            cell(split.possibly_lost),
            cell(split.still_reachable),
        );
    }
    out.push_str("</tbody></table></section>");
}

fn summary(out: &mut String, report: &Report) {
    out.push_str("<section id=\"summary\"><h2>Summary</h2><div class=\"cards\">");
    // Totals per allocator.
    let _ = write!(
        out,
        "<table class=\"grid\" id=\"totals\"><caption>Live memory by allocator{}</caption><tr><th>allocator</th><th>memory</th><th>live bytes</th><th>blocks</th></tr>",
        if sampled(report) { " (estimates)" } else { "" }
    );
    for total in &report.totals {
        let bytes = scaled(report, total.live_bytes);
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td class=\"num\" title=\"{bytes} bytes\">{}</td><td class=\"num\">{}</td></tr>",
            escape(total.allocator.name()),
            escape(total.memory.name()),
            escape(&human_bytes(bytes)),
            scaled(report, total.live_count)
        );
    }
    if report.totals.is_empty() {
        out.push_str("<tr><td colspan=\"4\">nothing live</td></tr>");
    }
    out.push_str("</table>");

    let e = &report.events;
    let mut rows: Vec<(String, String)> = vec![
        ("allocs".into(), e.allocs.to_string()),
        ("frees".into(), e.frees.to_string()),
        ("lost".into(), e.lost.to_string()),
        ("unmatched_frees".into(), e.unmatched_frees.to_string()),
        ("stack_failures".into(), e.stack_failures.to_string()),
        ("failed_calls".into(), e.failed_calls.to_string()),
        ("table_full".into(), e.table_full.to_string()),
    ];
    rows.extend(
        report
            .lost_by_cause
            .iter()
            .map(|(cause, n)| (format!("lost: {cause}"), n.to_string())),
    );
    rows.extend(
        report
            .stack_failures_by_cause
            .iter()
            .map(|(cause, n)| (format!("stack failure: {cause}"), n.to_string())),
    );
    kv_table(out, "events", "Events and losses", &rows);

    if let Some(r) = &report.reconciliation {
        let mut rows = vec![
            (
                "RssAnon at attach → now".to_string(),
                format!(
                    "{} → {}",
                    human_bytes(r.rss_anon_at_attach),
                    human_bytes(r.rss_anon_now)
                ),
            ),
            (
                "RssAnon growth".into(),
                format!(
                    "{}{}",
                    if r.rss_anon_growth < 0 { "-" } else { "+" },
                    human_bytes(r.rss_anon_growth.unsigned_abs())
                ),
            ),
            (
                "VmRSS at attach → now".into(),
                format!(
                    "{} → {}",
                    human_bytes(r.vm_rss_at_attach),
                    human_bytes(r.vm_rss_now)
                ),
            ),
            (
                "tracked heap bytes".into(),
                human_bytes(r.tracked_host_bytes),
            ),
            (
                "tracked mapping bytes".into(),
                human_bytes(r.tracked_mmap_bytes),
            ),
        ];
        if let Some(ratio) = r.explained_ratio {
            rows.push((
                "explained".into(),
                format!("{:.0}% of the growth", ratio * 100.0),
            ));
        }
        kv_table(out, "reconciliation", "Reconciliation", &rows);
        let _ = write!(out, "<p class=\"note\">{}</p>", escape(&r.note));
    }

    let s = &report.settings;
    let mut rows = vec![
        ("stack depth".to_string(), s.stack_depth.to_string()),
        (
            "sample rate".into(),
            format!("1 in {}", s.sample_rate.max(1)),
        ),
        ("top".into(), s.top.to_string()),
        ("min age".into(), duration(s.min_age_ms)),
        ("warm-up".into(), duration(s.warmup_ms)),
    ];
    if let Some(ms) = s.interval_ms {
        rows.push(("interval".into(), duration(ms)));
    }
    if s.min_size > 0 || s.max_size.is_some() {
        rows.push((
            "size range".into(),
            format!(
                "{}..{}",
                s.min_size,
                s.max_size.map_or_else(String::new, |m| m.to_string())
            ),
        ));
    }
    if let Some(file) = &s.suppress_file {
        rows.push(("allow-list".into(), file.clone()));
    }
    if report.suppressed.live_count > 0 {
        rows.push((
            "set aside (allow-list, warm-up)".into(),
            format!(
                "{} in {} blocks",
                human_bytes(report.suppressed.live_bytes),
                report.suppressed.live_count
            ),
        ));
    }
    kv_table(out, "settings", "Settings", &rows);
    out.push_str("</div>");

    if !report.failed_calls.is_empty() {
        out.push_str("<table class=\"grid\" id=\"failed-calls\"><caption>Failed calls (not live)</caption><tr><th>function</th><th>allocator</th><th>code</th><th>calls</th></tr>");
        for f in &report.failed_calls {
            let _ = write!(
                out,
                "<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
                escape(&f.function),
                escape(f.allocator.name()),
                f.code,
                f.count
            );
        }
        out.push_str("</table>");
    }
    if report.processes.len() > 1 {
        out.push_str("<table class=\"grid\" id=\"processes\"><caption>Processes</caption><tr><th>pid</th><th>parent</th><th>command</th><th>live bytes</th><th>blocks</th><th>state</th></tr>");
        for p in &report.processes {
            let _ = write!(
                out,
                "<tr><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
                p.pid,
                p.parent.map_or_else(|| "-".to_string(), |p| p.to_string()),
                escape(&p.comm),
                escape(&human_bytes(p.live_bytes)),
                p.live_count,
                if p.exited { "exited" } else { "running" }
            );
        }
        out.push_str("</table>");
    }
    let mut notes: Vec<&str> = report.notes.iter().map(String::as_str).collect();
    notes.extend(report.attach_failures.iter().map(String::as_str));
    if !report.missing_functions.is_empty() {
        out.push_str("<p class=\"note\">Not found in the target: ");
        out.push_str(&escape(&report.missing_functions.join(", ")));
        out.push_str("</p>");
    }
    if !notes.is_empty() {
        out.push_str("<ul class=\"notes\" id=\"notes\">");
        for note in notes {
            let _ = write!(out, "<li>{}</li>", escape(note));
        }
        out.push_str("</ul>");
    }
    out.push_str("</section>");
}

fn sampled(report: &Report) -> bool {
    report.settings.sample_rate > 1
}

/// Live bytes per allocator from the timeline, and the top sites' histories.
fn charts(out: &mut String, report: &Report, names: Names) {
    out.push_str("<section id=\"charts\"><h2>Live bytes over time</h2><div class=\"charts\">");
    let mut per_allocator: Vec<(String, Vec<(u64, u64)>)> = Vec::new();
    for sample in &report.timeline {
        let label = format!("{} {}", sample.allocator.name(), sample.memory.name());
        let point = (sample.t_ms, scaled(report, sample.live_bytes));
        match per_allocator.iter_mut().find(|(l, _)| *l == label) {
            Some((_, points)) => points.push(point),
            None => per_allocator.push((label, vec![point])),
        }
    }
    if per_allocator.is_empty() {
        out.push_str(&chart::svg("live bytes by allocator", &[]));
    }
    for (label, points) in &per_allocator {
        out.push_str(&chart::svg(
            &format!("{label}: live bytes"),
            &[chart::Line {
                label,
                points: points.clone(),
            }],
        ));
    }
    let labels: Vec<String> = report
        .sites
        .iter()
        .take(CHART_SITES)
        .enumerate()
        .map(|(i, site)| {
            format!(
                "#{} {}",
                i + 1,
                site.frames.first().map_or_else(
                    || site.functions.join(","),
                    |f| short_frame_name(f, names, LEGEND_WIDTH)
                )
            )
        })
        .collect();
    let lines: Vec<chart::Line<'_>> = report
        .sites
        .iter()
        .zip(&labels)
        .filter(|(site, _)| !site.history.is_empty())
        .map(|(site, label)| chart::Line {
            label,
            points: site
                .history
                .iter()
                .map(|&(t, b)| (t, scaled(report, b)))
                .collect(),
        })
        .collect();
    if !lines.is_empty() {
        out.push_str("<figure>");
        out.push_str(&chart::svg(
            &format!("top {} sites: live bytes", lines.len()),
            &lines,
        ));
        out.push_str("<figcaption>");
        for (i, line) in lines.iter().enumerate() {
            let _ = write!(
                out,
                "<span class=\"key\" style=\"color:{}\">&#9632;</span> {} ",
                chart::PALETTE[i % chart::PALETTE.len()],
                escape(line.label)
            );
        }
        out.push_str("</figcaption></figure>");
    }
    out.push_str("</div></section>");
}

/// inferno's flame graph (its own interactive SVG) in a `data:` frame, so
/// its script and ids stay apart from the page's.
fn flame(out: &mut String, report: &Report) {
    out.push_str("<section id=\"flame\"><h2>Flame graph of live bytes</h2>");
    let mut svg = Vec::new();
    let drawn = super::flamegraph::draw(report, Some(FLAME_WIDTH), &mut svg).is_ok();
    if drawn && !svg.is_empty() {
        let height = svg_height(&svg).map_or(560, |h| h + 4);
        let _ = write!(
            out,
            "<p class=\"note\">Click a frame to zoom, Search to highlight; frames under 0.5 px are left out (every site is in the table below).{}</p><iframe id=\"flamegraph\" title=\"flame graph\" style=\"height:{height}px\" src=\"data:image/svg+xml;base64,{}\"></iframe>",
            if sampled(report) {
                " Widths are estimates."
            } else {
                ""
            },
            base64::engine::general_purpose::STANDARD.encode(&svg)
        );
    } else {
        out.push_str("<p class=\"note\">The flame graph could not be drawn.</p>");
    }
    out.push_str("</section>");
}

/// The `height` of an SVG document's root element, in pixels.
fn svg_height(svg: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(svg).ok()?;
    let root = &text[text.find("<svg")?..];
    let root = &root[..root.find('>')?];
    let value = root.split(" height=\"").nth(1)?.split('"').next()?;
    value.parse::<f64>().ok().map(|h| h.ceil() as u64)
}

fn sites_section(out: &mut String, report: &Report) {
    let _ = write!(
        out,
        "<section id=\"sites\"><h2>Sites <small>({} shown, ranked by suspicion{})</small></h2>\
         <div class=\"controls\"><input id=\"filter\" type=\"search\" placeholder=\"filter: function, file, module\" autocomplete=\"off\">\
         <select id=\"allocator\"><option value=\"\">all allocators</option>",
        report.sites.len(),
        if sampled(report) {
            "; bytes and blocks are estimates"
        } else {
            ""
        }
    );
    let mut allocators: Vec<&str> = report.sites.iter().map(|s| s.allocator.name()).collect();
    allocators.sort_unstable();
    allocators.dedup();
    for name in allocators {
        let _ = write!(out, "<option value=\"{0}\">{0}</option>", escape(name));
    }
    out.push_str(
        "</select><span id=\"count\"></span><button id=\"prev\" type=\"button\">&larr; prev</button>\
         <button id=\"next\" type=\"button\">next &rarr;</button></div>\
         <noscript><p class=\"note\">The sites table needs JavaScript (it is inline; nothing is fetched).</p></noscript>\
         <table class=\"grid sites\" id=\"sites-table\"><thead><tr>\
         <th data-key=\"rank\">#</th><th data-key=\"allocator\">allocator</th><th data-key=\"bytes\">live bytes</th>\
         <th data-key=\"count\">blocks</th><th data-key=\"growth\">growth/s</th><th data-key=\"trend\">trend</th>\
         <th data-key=\"age\">oldest</th><th data-key=\"pattern\">pattern</th><th data-key=\"frame\">top frame</th>\
         </tr></thead><tbody id=\"rows\"></tbody></table>\
         <div id=\"detail\" hidden></div></section>",
    );
}

/// The embedded data the script renders: frames once, sites by reference.
#[derive(Serialize)]
struct Data<'a> {
    sampled: bool,
    sample_rate: u32,
    duration_ms: u64,
    /// `[name, module file name, file, line, addr, offset, module path,
    /// kind, full name]` (kind: `native` or `python`; name: short unless
    /// `--full-names`; full name: only when it differs from name).
    frames: Vec<FrameData<'a>>,
    sites: Vec<SiteData<'a>>,
}

type FrameData<'a> = (
    String,
    Option<&'a str>,
    Option<&'a str>,
    Option<u32>,
    &'a str,
    Option<&'a str>,
    Option<&'a str>,
    FrameKind,
    Option<String>,
);

#[derive(Serialize)]
struct SiteData<'a> {
    rank: usize,
    allocator: &'static str,
    memory: &'static str,
    bytes: u64,
    count: u64,
    growth: f64,
    trend: crate::analysis::Trend,
    pattern: Option<String>,
    age: u64,
    survived: u64,
    functions: &'a [String],
    internal: bool,
    threads: &'a [u32],
    thread_names: &'a [String],
    pids: &'a [u32],
    note: Option<&'a str>,
    stack: Vec<usize>,
    history: Vec<(u64, u64)>,
}

/// A frame's identity for sharing: every field.
type FrameKey<'a> = (
    FrameKind,
    &'a str,
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
    Option<u32>,
    Option<&'a str>,
);

fn data(report: &Report, names: Names) -> std::io::Result<String> {
    let mut frame_index: HashMap<FrameKey<'_>, usize> = HashMap::new();
    let mut frames: Vec<FrameData<'_>> = Vec::new();
    let mut sites = Vec::with_capacity(report.sites.len());
    let factor = f64::from(report.settings.sample_rate.max(1));
    for (rank, site) in report.sites.iter().enumerate() {
        let stack: Vec<usize> = site
            .frames
            .iter()
            .map(|frame: &Frame| {
                let key = (
                    frame.kind,
                    frame.addr.as_str(),
                    frame.symbol.as_deref(),
                    frame.module.as_deref(),
                    frame.file.as_deref(),
                    frame.line,
                    frame.offset.as_deref(),
                );
                *frame_index.entry(key).or_insert_with(|| {
                    let full = frame_name(frame);
                    let name = short_frame_name(frame, names, NAME_WIDTH);
                    let full = (full != name).then_some(full);
                    frames.push((
                        name,
                        frame.module.as_deref().map(module_name),
                        frame.file.as_deref(),
                        frame.line,
                        frame.addr.as_str(),
                        frame.offset.as_deref(),
                        frame.module.as_deref(),
                        frame.kind,
                        full,
                    ));
                    frames.len() - 1
                })
            })
            .collect();
        let (bytes, count) = site_live(report, site);
        let history: Vec<(u64, u64)> = if rank < HISTORY_SITES {
            chart::reduce(&site.history, HISTORY_POINTS)
                .into_iter()
                .map(|(t, b)| (t, scaled(report, b)))
                .collect()
        } else {
            Vec::new()
        };
        sites.push(SiteData {
            rank: rank + 1,
            allocator: site.allocator.name(),
            memory: site.memory.name(),
            bytes,
            count,
            growth: if site.growth_bytes_per_s.is_finite() {
                site.growth_bytes_per_s * factor
            } else {
                0.0
            },
            trend: site.trend,
            pattern: site.pattern.as_ref().map(pattern_label),
            age: site.oldest_age_ms,
            survived: site.survived_intervals,
            functions: &site.functions,
            internal: site.internal,
            threads: &site.threads,
            thread_names: &site.thread_names,
            pids: &site.pids,
            note: site.stack_note.as_deref(),
            stack,
            history,
        });
    }
    let data = Data {
        sampled: sampled(report),
        sample_rate: report.settings.sample_rate.max(1),
        duration_ms: report.duration_ms,
        frames,
        sites,
    };
    serde_json::to_string(&data)
        .map(|text| text.replace('<', "\\u003c"))
        .map_err(std::io::Error::other)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::fixture;
    use serde_json::{json, Value};

    fn render(report: &Report) -> String {
        let mut out = Vec::new();
        HtmlSink {
            names: Names::Short,
        }
        .write(report, false, &mut out)
        .expect("renders");
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn a_leak_check_gets_its_section() {
        let html = render(&fixture::checked_report());
        assert!(html.contains("id=\"leak-check\""));
        assert!(html.contains("href=\"#leak-check\""));
        assert!(html.contains("<th>definitely lost</th><td>300 B (300 bytes) in 1 blocks</td>"));
        assert!(html.contains("id=\"leak-sites\""));
        assert!(!render(&fixture::report()).contains("id=\"leak-check\""));
    }

    #[test]
    fn page_is_self_contained_and_holds_every_section() {
        let html = render(&fixture::report());
        assert!(html.starts_with("<!DOCTYPE html>"));
        for id in [
            "id=\"summary\"",
            "id=\"events\"",
            "id=\"totals\"",
            "id=\"charts\"",
            "id=\"flamegraph\"",
            "id=\"sites-table\"",
            "id=\"memtrace-data\"",
        ] {
            assert!(html.contains(id), "{id}");
        }
        // Nothing is fetched: no external references at all.
        for bad in ["http://", "https://", "src=\"/", "<link", "@import", "url("] {
            let outside_svg_ns = html
                .replace("http://www.w3.org/2000/svg", "")
                .replace("http://www.w3.org/1999/xlink", "");
            assert!(!outside_svg_ns.contains(bad), "{bad}");
        }
        assert!(!html.contains("id=\"incomplete\""));
        assert!(!html.contains("id=\"sampled\""));
        assert!(html.contains("data:image/svg+xml;base64,"));
        assert_eq!(
            svg_height(b"<?xml?><svg version=\"1.1\" width=\"1200\" height=\"190\">"),
            Some(190)
        );
        assert_eq!(svg_height(b"<svg>"), None);
    }

    #[test]
    fn symbols_are_escaped_everywhere() {
        let mut report = fixture::report();
        // A name that shortening leaves as it is (the chart legend shows it).
        report.sites[0].frames[0].symbol = Some("ns::operator<</script>&x".into());
        report.target.comm = "a<b>&c".into();
        let html = render(&report);
        assert!(!html.contains("</script>\""));
        assert!(!html.contains("operator<</script>"));
        assert!(html.contains("a&lt;b&gt;&amp;c"));
        // In the JSON blob `<` is \u003c: the script element is not closed early.
        let value = blob(&html);
        assert_eq!(value["frames"][0][0], "ns::operator<</script>&x");
        assert_eq!(value["frames"][0][8], Value::Null);
        // The top-sites chart legend is escaped too.
        assert!(html.contains("ns::operator&lt;&lt;/script&gt;&amp;x"));
        // A shortened one keeps its full name, escaped the same way.
        report.sites[0].frames[0].symbol = Some("std::vector<int>::push_back&</script>".into());
        let html = render(&report);
        assert!(!html.contains("push_back&</script>"));
        let value = blob(&html);
        assert_eq!(value["frames"][0][0], "std::vector<…>::push_back&<…>");
        assert_eq!(
            value["frames"][0][8],
            "std::vector<int>::push_back&</script>"
        );
    }

    /// The page's embedded JSON blob.
    fn blob(html: &str) -> Value {
        let start =
            html.find("id=\"memtrace-data\">").expect("blob") + "id=\"memtrace-data\">".len();
        let end = html[start..].find("</script>").expect("end") + start;
        serde_json::from_str(&html[start..end]).expect("blob is JSON")
    }

    #[test]
    fn frame_names_are_short_with_the_full_name_kept_unless_full_names() {
        let full = "at::Tensor c10::Dispatcher::redispatch<at::Tensor, c10::ArrayRef<long> >(c10::TypedOperatorHandle<at::Tensor (c10::ArrayRef<long>)> const&, c10::DispatchKeySet, c10::ArrayRef<long>) const";
        let mut report = fixture::report();
        report.sites[0].frames[0].symbol = Some(full.into());
        let html = render(&report);
        let value = blob(&html);
        assert_eq!(value["frames"][0][0], "c10::Dispatcher::redispatch<…>(…)");
        assert_eq!(value["frames"][0][8], full);
        // The chart legend is short; the flame graph keeps the full name.
        assert!(html.contains("#1 c10::Dispatcher::redispatch&lt;…&gt;(…)"));
        // The script shows the full name as the tooltip and searches it.
        assert!(SCRIPT.contains("f[8]") && SCRIPT.contains("fullName(f)"));
        let mut out = Vec::new();
        HtmlSink { names: Names::Full }
            .write(&report, false, &mut out)
            .expect("renders");
        let value = blob(&String::from_utf8(out).expect("utf-8"));
        assert_eq!(value["frames"][0][0], full);
        assert_eq!(value["frames"][0][8], Value::Null);
    }

    #[test]
    fn incomplete_and_sampled_traces_say_so_on_top() {
        let mut report = fixture::report();
        report.complete = false;
        report.events.lost = 12;
        report.settings.sample_rate = 4;
        let html = render(&report);
        let banner = html.find("id=\"incomplete\"").expect("incomplete banner");
        assert!(banner < html.find("<header>").expect("header"));
        assert!(html.contains("12 events were lost"));
        assert!(html.contains("id=\"sampled\""));
        let blob_start = html.find("id=\"memtrace-data\">").expect("blob") + 19;
        let blob_end = html[blob_start..].find("</script>").expect("end") + blob_start;
        let value: Value = serde_json::from_str(&html[blob_start..blob_end]).expect("JSON");
        assert_eq!(value["sampled"], true);
        // Estimates: the CUDA site's 4096 bytes scaled by 4.
        assert_eq!(value["sites"][0]["bytes"], 16384);
    }

    #[test]
    fn frames_are_shared_and_sites_reference_them() {
        let html = render(&fixture::report());
        let start = html.find("id=\"memtrace-data\">").expect("blob") + 19;
        let end = html[start..].find("</script>").expect("end") + start;
        let value: Value = serde_json::from_str(&html[start..end]).expect("JSON");
        assert_eq!(value["sites"].as_array().map(Vec::len), Some(3));
        assert_eq!(value["sites"][0]["stack"], json!([0, 1]));
        assert_eq!(value["frames"][0][0], "alloc_buffers");
        assert_eq!(value["frames"][0][2], "app.c");
        assert_eq!(value["frames"][0][3], 42);
        assert_eq!(
            value["sites"][2]["note"],
            "stacks not requested (--stack-depth 0)"
        );
        assert_eq!(
            value["sites"][0]["history"],
            json!([[1000, 2048], [2000, 4096]])
        );
    }

    #[test]
    fn python_frames_are_marked_apart_from_native_ones() {
        let mut report = fixture::report();
        let native = report.sites[0].frames[0].clone();
        let python = Frame {
            kind: FrameKind::Python,
            addr: String::new(),
            symbol: Some("Cache.put".into()),
            module: None,
            file: Some("/srv/app/cache.py".into()),
            line: Some(41),
            offset: None,
            inlined: Vec::new(),
        };
        // Same fields but the kind: two frames, not one shared.
        let lookalike = Frame {
            kind: FrameKind::Python,
            ..native.clone()
        };
        report.sites[0].frames = vec![python, native, lookalike];
        let html = render(&report);
        let start = html.find("id=\"memtrace-data\">").expect("blob") + 19;
        let end = html[start..].find("</script>").expect("end") + start;
        let value: Value = serde_json::from_str(&html[start..end]).expect("JSON");
        assert_eq!(value["sites"][0]["stack"], json!([0, 1, 2]));
        assert_eq!(value["frames"][0][0], "Cache.put (cache.py:41)");
        assert_eq!(value["frames"][0][7], "python");
        assert_eq!(value["frames"][1][7], "native");
        assert_eq!(value["frames"][2][7], "python");
        // The script tags Python frames "py" and the style colours them.
        assert!(
            html.contains("tag.textContent = \"py\""),
            "script tags py frames"
        );
        assert!(html.contains(".tag.py{"), "style for the py tag");
        assert!(
            html.contains("td.py,.stack tr.py td{color:"),
            "style for py frames"
        );
    }

    #[test]
    fn interim_reports_are_not_written() {
        let mut out = Vec::new();
        HtmlSink {
            names: Names::Short,
        }
        .write(&fixture::report(), true, &mut out)
        .expect("ok");
        assert!(out.is_empty());
    }

    /// A report the size of a busy day: 10,000 sites with 24-frame stacks
    /// (callers shared, as in real programs) and a 24-hour timeline. Prints
    /// the page's size and how long rendering took (no threshold: numbers
    /// for the record, `cargo test -- --nocapture`).
    #[test]
    fn ten_thousand_sites_and_a_day_of_timeline_stay_bounded() {
        let mut report = fixture::report();
        let template = report.sites[0].clone();
        report.sites = (0..10_000u64)
            .map(|i| {
                let mut site = template.clone();
                site.live_bytes = 1_000_000 - i * 7;
                site.frames = (0..24u64)
                    .map(|depth| {
                        let id = if depth == 0 { i } else { i % (50 * depth) };
                        Frame {
                            addr: format!("0x{:x}", 0x40_0000 + depth * 0x1000 + id),
                            symbol: Some(format!("ns::fn_{depth}_{id}<T>")),
                            module: Some("/opt/app/lib/libapp.so".into()),
                            file: Some(format!("src/module_{depth}.cc")),
                            line: Some(u32::try_from(id % 900 + 1).unwrap_or(1)),
                            offset: Some(format!("0x{:x}", depth * 0x1000 + id)),
                            kind: crate::report::FrameKind::Native,
                            inlined: Vec::new(),
                        }
                    })
                    .collect();
                site.history = (0..512u64).map(|t| (t * 168_750, t * 100 + i)).collect();
                site
            })
            .collect();
        // 24 h at 1 s, thinned by the history to at most 2048 snapshots.
        report.timeline = (0..2048u64)
            .map(|t| crate::report::TimelineSample {
                t_ms: t * 42_187,
                allocator: crate::probe::catalog::Allocator::Libc,
                memory: crate::probe::catalog::Memory::Host,
                live_bytes: 1 << 30 | (t * 4096),
                live_count: t,
            })
            .collect();
        let started = std::time::Instant::now();
        let html = render(&report);
        let took = started.elapsed();
        eprintln!(
            "html report: 10000 sites, 24 h timeline: {} bytes ({:.1} MiB), rendered in {:?}",
            html.len(),
            html.len() as f64 / (1 << 20) as f64,
            took
        );
        // `MEMTRACE_HTML_SAMPLE=FILE` keeps the page, to open in a browser.
        if let Some(path) = std::env::var_os("MEMTRACE_HTML_SAMPLE") {
            std::fs::write(path, &html).expect("sample written");
        }
        // Size is bounded by sharing frames and capping histories; the
        // table itself is drawn by the page a page at a time.
        assert!(html.len() < 64 << 20, "{} bytes", html.len());
        let start = html.find("id=\"memtrace-data\">").expect("blob") + 19;
        let end = html[start..].find("</script>").expect("end") + start;
        let value: Value = serde_json::from_str(&html[start..end]).expect("JSON");
        assert_eq!(value["sites"].as_array().map(Vec::len), Some(10_000));
        assert!(value["frames"].as_array().map_or(0, Vec::len) < 10_000 * 24);
        assert_eq!(value["sites"][HISTORY_SITES]["history"], json!([]));
        assert!(value["sites"][0]["history"].as_array().map_or(0, Vec::len) <= HISTORY_POINTS + 2);
    }
}
