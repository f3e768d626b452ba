//! `--html FILE`: the soak report as one self-contained page: the gate
//! result first, the verdict table (each metric's label, slope, steps and
//! gaps), the release check, the segments (process lifetimes) and runs,
//! every metric's curve with its fitted trend (the same plotters panels as
//! `--plot`, inline SVG), the sources used and the notes. No script, no
//! network; every text is escaped.

use std::fmt::Write as _;
use std::path::Path;

use crate::monitor::error::MonitorError;
use crate::monitor::plot;
use crate::monitor::release::ReleaseReport;
use crate::monitor::series::{Recording, Unit};
use crate::monitor::units::{format_rate, format_value};
use crate::monitor::verdict::{Label, Verdict};
use crate::monitor::Gate;
use crate::sink::html::{escape, style};

/// What the page shows besides the recording.
pub struct Judged<'a> {
    pub verdicts: &'a [Verdict],
    pub release: Option<&'a ReleaseReport>,
    /// Why the gate failed (empty: passed).
    pub failures: &'a [String],
    pub fail_on: &'a [Gate],
}

/// Writes the page to `path` (whole: a temporary name, then renamed; in
/// place to a device, FIFO or through a symbolic link).
pub fn write(path: &Path, rec: &Recording, judged: &Judged<'_>) -> Result<(), MonitorError> {
    let text = page(rec, judged).map_err(|reason| MonitorError::Write {
        path: path.to_path_buf(),
        reason,
    })?;
    super::store::write_text(path, &text)
}

fn value(v: Option<f64>, unit: Unit) -> String {
    v.map(|v| format_value(v, unit == Unit::Bytes))
        .unwrap_or_else(|| "-".into())
}

fn label_class(label: Label) -> &'static str {
    match label {
        Label::Growth | Label::Jump => "t-growing",
        Label::SlowGrowth | Label::Jitter => "t-new",
        _ => "",
    }
}

/// The page's text.
pub fn page(rec: &Recording, judged: &Judged<'_>) -> Result<String, String> {
    let m = &rec.meta;
    let mut out = String::with_capacity(256 << 10);
    let title = format!("memtrace monitor: {}", m.target);
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">\
         <title>{}</title><style>{}</style></head><body><header><h1>{}</h1><p class=\"sub\">{} samples over {:.1}s, every {}, warm-up {}</p></header>",
        escape(&title),
        style(),
        escape(&title),
        rec.sample_count(),
        rec.end_t(),
        humantime::format_duration(std::time::Duration::from_secs_f64(m.interval_s.max(0.0))),
        humantime::format_duration(std::time::Duration::from_secs_f64(m.warmup_s.max(0.0))),
    );

    // The gate first.
    out.push_str("<section id=\"gate\"><h2>Gate</h2>");
    if judged.fail_on.is_empty() {
        out.push_str("<p id=\"gate-result\">No gate (no <code>--fail-on</code> given).</p>");
    } else {
        let gates: Vec<String> = judged
            .fail_on
            .iter()
            .filter_map(clap::ValueEnum::to_possible_value)
            .map(|v| v.get_name().to_string())
            .collect();
        if judged.failures.is_empty() {
            let _ = write!(
                out,
                "<p id=\"gate-result\" class=\"verdict-pass\">PASSED (--fail-on {})</p>",
                escape(&gates.join(","))
            );
        } else {
            let _ = write!(
                out,
                "<p id=\"gate-result\" class=\"verdict-fail\">FAILED (exit 3, --fail-on {}): {}</p>",
                escape(&gates.join(",")),
                escape(&judged.failures.join(", "))
            );
        }
    }
    out.push_str("</section>");

    // The verdicts.
    out.push_str(
        "<section id=\"verdicts\"><h2>Verdicts</h2><table class=\"grid\" id=\"verdict-table\">\
         <tr><th>family</th><th>metric</th><th>segment</th><th>pid</th><th>start</th><th>end</th>\
         <th>slope</th><th>label</th><th>steps</th><th>gaps</th></tr>",
    );
    for v in judged.verdicts {
        let steps = v.step_labels();
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"{}\">{}</td><td>{}</td><td class=\"num\">{}</td></tr>",
            v.family.as_str(),
            escape(&v.metric),
            v.segment,
            v.pid.map_or_else(|| "-".to_string(), |p| p.to_string()),
            escape(&value(v.start, v.unit)),
            escape(&value(v.end, v.unit)),
            escape(&format_rate(v.slope_per_hour, v.unit == Unit::Bytes)),
            label_class(v.label),
            v.label.as_str(),
            escape(&steps.join(" ")),
            v.gaps
        );
    }
    if judged.verdicts.is_empty() {
        out.push_str("<tr><td colspan=\"10\">no metric was sampled</td></tr>");
    }
    out.push_str("</table></section>");

    if let Some(report) = judged.release {
        out.push_str("<section id=\"release\"><h2>Release check</h2><table class=\"grid\"><tr><th>metric</th><th>baseline</th><th>after each run</th><th>residual</th><th>tolerance</th><th>result</th></tr>");
        for r in &report.metrics {
            let after: Vec<String> = r
                .after
                .iter()
                .map(|a| a.map_or_else(|| "-".into(), |a| format_value(a - r.baseline, true)))
                .collect();
            let _ = write!(
                out,
                "<tr><td>{} {}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"{}\">{}</td></tr>",
                r.family.as_str(),
                escape(&r.metric),
                escape(&format_value(r.baseline, true)),
                escape(&after.join(" ")),
                escape(&format_value(r.residual, true)),
                escape(&format_value(r.tolerance, true)),
                if r.released { "" } else { "t-growing" },
                if r.released { "released" } else { "not-released" }
            );
        }
        out.push_str("</table></section>");
    }

    out.push_str("<section id=\"segments\"><h2>Segments and runs</h2>");
    if rec.segments.is_empty() {
        out.push_str("<p class=\"note\">No process segment (system-wide metrics only).</p>");
    } else {
        out.push_str("<table class=\"grid\" id=\"segment-table\"><tr><th>segment</th><th>pid</th><th>name</th><th>from</th><th>until</th></tr>");
        for seg in &rec.segments {
            let until = match (seg.end_s, &seg.end_note) {
                (Some(t), Some(n)) => format!("{t:.1}s ({n})"),
                (Some(t), None) => format!("{t:.1}s"),
                _ => "the end".to_string(),
            };
            let _ = write!(
                out,
                "<tr><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{:.1}s</td><td>{}</td></tr>",
                seg.segment,
                seg.pid,
                escape(&seg.name),
                seg.start_s,
                escape(&until)
            );
        }
        out.push_str("</table>");
    }
    if !rec.runs.is_empty() {
        out.push_str("<table class=\"grid\" id=\"run-table\"><tr><th>run</th><th>pid</th><th>status</th><th>from</th><th>to</th></tr>");
        for r in &rec.runs {
            let _ = write!(
                out,
                "<tr><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{:.1}s</td><td class=\"num\">{:.1}s</td></tr>",
                r.cycle,
                r.pid,
                escape(&r.status),
                r.start_s,
                r.end_s
            );
        }
        out.push_str("</table>");
    }
    out.push_str("</section>");

    let (panels, note) = plot::panel_svgs(rec, judged.verdicts)?;
    out.push_str("<section id=\"curves\"><h2>Curves</h2><p class=\"note\">Each segment (process lifetime) in its own colour; dashed: the fitted trend (Theil–Sen) over the judged window.</p>");
    if let Some(note) = note {
        let _ = write!(out, "<p class=\"note\">{}</p>", escape(&note));
    }
    if panels.is_empty() {
        out.push_str("<p class=\"note\">Every series is all zero: nothing to draw.</p>");
    }
    out.push_str("<div class=\"panels\">");
    for (title, svg) in &panels {
        let _ = write!(
            out,
            "<figure class=\"panel\"><figcaption>{}</figcaption>{}</figure>",
            escape(title),
            strip_xml_declaration(svg)
        );
    }
    out.push_str("</div></section>");

    out.push_str("<section id=\"sources\"><h2>Sources</h2><ul>");
    for source in &m.sources {
        let _ = write!(out, "<li>{}</li>", escape(source));
    }
    if m.sources.is_empty() {
        out.push_str("<li>not recorded</li>");
    }
    out.push_str("</ul>");
    if !rec.notes.is_empty() {
        out.push_str("<h2>Notes</h2><ul class=\"notes\">");
        for n in &rec.notes {
            let _ = write!(out, "<li>{:.1}s: {}</li>", n.t_s, escape(&n.note));
        }
        out.push_str("</ul>");
    }
    out.push_str("</section></body></html>\n");
    Ok(out)
}

/// An SVG document as an element to put inline.
fn strip_xml_declaration(svg: &str) -> &str {
    match svg.find("<svg") {
        Some(start) => &svg[start..],
        None => svg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::series::{Family, Meta, Segment, Series};
    use crate::monitor::verdict::{judge, Thresholds};

    fn recording() -> Recording {
        let growing: Vec<(f64, Option<f64>)> = (0..40)
            .map(|i| (f64::from(i), Some(100e6 + f64::from(i) * 1e6)))
            .collect();
        let flat: Vec<(f64, Option<f64>)> = (0..40).map(|i| (f64::from(i), Some(5e6))).collect();
        Recording::from_parts(
            Meta {
                target: "name <demo>".into(),
                interval_s: 1.0,
                sources: vec!["procfs /proc".into(), "nvml: not found".into()],
                ..Meta::default()
            },
            vec![Segment {
                segment: 1,
                pid: 42,
                name: "demo".into(),
                start_s: 0.0,
                end_s: Some(39.0),
                end_note: Some("exited".into()),
            }],
            Vec::new(),
            Vec::new(),
            vec![
                Series {
                    family: Family::Process,
                    metric: "VmRSS".into(),
                    unit: Unit::Bytes,
                    segment: 1,
                    pid: Some(42),
                    points: growing,
                    gaps: Vec::new(),
                },
                Series {
                    family: Family::System,
                    metric: "Shmem".into(),
                    unit: Unit::Bytes,
                    segment: 0,
                    pid: None,
                    points: flat,
                    gaps: Vec::new(),
                },
            ],
        )
    }

    #[test]
    fn gate_comes_first_then_verdicts_curves_and_sources() {
        let rec = recording();
        let verdicts: Vec<Verdict> = rec
            .series
            .iter()
            .map(|s| judge(s, 0.0, &Thresholds::default()))
            .collect();
        let failures = vec!["process VmRSS (segment 1): growth".to_string()];
        let html = page(
            &rec,
            &Judged {
                verdicts: &verdicts,
                release: None,
                failures: &failures,
                fail_on: &[Gate::Growth],
            },
        )
        .expect("page");
        let gate = html.find("id=\"gate-result\"").expect("gate");
        let table = html.find("id=\"verdict-table\"").expect("verdicts");
        let curves = html.find("id=\"curves\"").expect("curves");
        let sources = html.find("id=\"sources\"").expect("sources");
        assert!(gate < table && table < curves && curves < sources);
        assert!(html.contains("FAILED (exit 3, --fail-on growth)"));
        assert!(html.contains("<td class=\"t-growing\">growth</td>"));
        assert!(html.contains("name &lt;demo&gt;"));
        assert!(html.contains("nvml: not found"));
        assert!(html.contains("exited"));
        // Both curves are drawn inline, with no XML declaration mid-page.
        assert_eq!(html.matches("<figure class=\"panel\">").count(), 2);
        assert!(!html.contains("<?xml"));
        assert!(!html.contains("<script"));
        let outside = html.replace("http://www.w3.org/2000/svg", "");
        assert!(!outside.contains("http://") && !outside.contains("https://"));
    }

    #[test]
    fn no_gate_and_passed_gate_are_said() {
        let rec = recording();
        fn judged(fail_on: &[Gate]) -> Judged<'_> {
            Judged {
                verdicts: &[],
                release: None,
                failures: &[],
                fail_on,
            }
        }
        let html = page(&rec, &judged(&[])).expect("page");
        assert!(html.contains("No gate"));
        let html = page(&rec, &judged(&[Gate::Jump])).expect("page");
        assert!(html.contains("PASSED (--fail-on jump)"));
    }
}
