//! Flame-graph sink: an interactive SVG of live bytes by allocation site,
//! drawn by inferno from the folded stacks. Only the final report is drawn.
//! With `--sample-rate N` its widths and the subtitle's totals are estimates
//! (the sample times N), and the subtitle says so.

use std::io::Write;

use inferno::flamegraph::color::{BasicPalette, Palette};
use inferno::flamegraph::{self, Options};

use super::{folded, human_bytes, scaled, scaling_note, site_live, Sink};
use crate::report::Report;

pub struct FlamegraphSink;

impl Sink for FlamegraphSink {
    fn write(&self, report: &Report, interim: bool, out: &mut dyn Write) -> std::io::Result<()> {
        if interim {
            return Ok(());
        }
        draw(report, None, out)
    }
}

/// Draws the flame graph. `embedded` (for the HTML page): a fixed width of
/// `embedded` pixels instead of a fluid one (the page's frame may not be
/// laid out yet when the graph's script sizes itself), and frames narrower
/// than half a pixel left out (inferno's default otherwise: 0.1).
pub fn draw(report: &Report, embedded: Option<usize>, out: &mut dyn Write) -> std::io::Result<()> {
    {
        let title = title(report);
        let lines = folded::lines(report);
        let total: u64 = report.sites.iter().map(|s| site_live(report, s).0).sum();
        if total == 0 {
            // inferno refuses an empty graph; say so in a valid SVG instead.
            return empty_svg(&title, out);
        }
        let mut options = Options::default();
        options.title = title;
        options.subtitle = Some(subtitle(report));
        options.count_name = "bytes".into();
        options.name_type = "Site:".into();
        options.colors = Palette::Basic(BasicPalette::Mem);
        // Colours follow the frame names, so two runs look alike.
        options.hash = true;
        options.deterministic = true;
        if let Some(width) = embedded {
            options.image_width = Some(width);
            options.min_width = 0.5;
        }
        flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), out)
    }
}

fn title(report: &Report) -> String {
    let placement = report
        .target
        .placement
        .summary()
        .map(|summary| format!("; {summary}"))
        .unwrap_or_default();
    format!(
        "memtrace: live bytes by allocation site (pid {} {}{placement})",
        report.target.pid, report.target.comm
    )
}

/// Live totals and the trace length, under the title.
fn subtitle(report: &Report) -> String {
    let mut parts: Vec<String> = report
        .totals
        .iter()
        .map(|t| {
            format!(
                "{} {}: {} in {} blocks",
                t.allocator.name(),
                t.memory.name(),
                human_bytes(scaled(report, t.live_bytes)),
                scaled(report, t.live_count)
            )
        })
        .collect();
    parts.push(format!("traced {:.1}s", report.duration_ms as f64 / 1000.0));
    if let Some(note) = scaling_note(report) {
        parts.push(note);
    }
    if !report.complete {
        parts.push("incomplete: events were lost".into());
    }
    parts.join(" — ")
}

fn empty_svg(title: &str, out: &mut dyn Write) -> std::io::Result<()> {
    write!(
        out,
        concat!(
            "<?xml version=\"1.0\" standalone=\"no\"?>\n",
            "<svg version=\"1.1\" width=\"1200\" height=\"80\" viewBox=\"0 0 1200 80\" ",
            "xmlns=\"http://www.w3.org/2000/svg\">\n",
            "<text x=\"600\" y=\"24\" text-anchor=\"middle\" font-family=\"Verdana\" ",
            "font-size=\"17\">{}</text>\n",
            "<text x=\"600\" y=\"56\" text-anchor=\"middle\" font-family=\"Verdana\" ",
            "font-size=\"12\">no live bytes outstanding</text>\n",
            "</svg>\n"
        ),
        xml_escape(title)
    )
}

fn xml_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&apos;"),
            c => escaped.push(c),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::fixture;

    fn render(report: &Report, interim: bool) -> String {
        let mut out = Vec::new();
        FlamegraphSink
            .write(report, interim, &mut out)
            .expect("renders");
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn flamegraph_is_an_svg_with_the_sites() {
        let svg = render(&fixture::report(), false);
        assert!(svg.starts_with("<?xml"), "{}", &svg[..40.min(svg.len())]);
        assert!(svg.contains("<svg"));
        assert!(svg.contains("alloc_buffers"));
        assert!(svg.contains("[no stack]"));
        assert!(svg.contains("memtrace: live bytes by allocation site (pid 4242 app)"));
        assert!(svg.contains("bytes"));
    }

    #[test]
    fn flamegraph_of_a_sampled_report_shows_estimates_and_says_so() {
        let mut report = fixture::report();
        report.settings.sample_rate = 2;
        let line = subtitle(&report);
        assert!(line.contains("cuda device: 8.0 KiB in 2 blocks"), "{line}");
        assert!(line.contains("scaled by 2"), "{line}");
        let svg = render(&report, false);
        assert!(svg.contains("scaled by 2"));
        // Widths follow the scaled bytes: 4096 * 2 for the CUDA site.
        assert!(svg.contains("8,192 bytes"), "scaled widths");
        assert!(!subtitle(&fixture::report()).contains("scaled"));
    }

    #[test]
    fn flamegraph_skips_interim_reports() {
        assert!(render(&fixture::report(), true).is_empty());
    }

    #[test]
    fn flamegraph_of_nothing_is_still_an_svg() {
        let mut report = fixture::report();
        report.sites.clear();
        report.target.comm = "a<b>".into();
        let svg = render(&report, false);
        assert!(svg.starts_with("<?xml"));
        assert!(svg.contains("<svg"));
        assert!(svg.contains("pid 4242 a&lt;b&gt;"));
        assert!(svg.trim_end().ends_with("</svg>"));
    }
}
