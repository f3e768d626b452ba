//! Small inline SVG line charts for the HTML report: live bytes over time,
//! one or more series on shared axes. Pure string building (tested without a
//! browser); every label is escaped. Long series are reduced to at most
//! [`MAX_POINTS`] per line, keeping each bucket's minimum and maximum so a
//! spike in a 24-hour timeline still shows.

use std::fmt::Write;

use super::escape;
use crate::sink::human_bytes;

/// Most points drawn per line (each bucket contributes its min and max).
pub const MAX_POINTS: usize = 800;
/// Line colours, in order.
pub const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
];

const W: f64 = 560.0;
const H: f64 = 220.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 12.0;
const TOP: f64 = 26.0;
const BOTTOM: f64 = 34.0;

/// One line: its legend label and `(t_ms, bytes)` points, oldest first.
pub struct Line<'a> {
    pub label: &'a str,
    pub points: Vec<(u64, u64)>,
}

/// Reduces `points` to at most about `max` points: the series is cut into
/// equal-count buckets and each keeps its minimum and maximum, in time order.
pub fn reduce(points: &[(u64, u64)], max: usize) -> Vec<(u64, u64)> {
    let max = max.max(4);
    if points.len() <= max {
        return points.to_vec();
    }
    let buckets = max / 2;
    let per = points.len().div_ceil(buckets);
    let mut out = Vec::with_capacity(buckets * 2 + 1);
    for chunk in points.chunks(per) {
        let (mut lo, mut hi) = (chunk[0], chunk[0]);
        for &p in chunk {
            if p.1 < lo.1 {
                lo = p;
            }
            if p.1 > hi.1 {
                hi = p;
            }
        }
        if lo.0 <= hi.0 {
            out.push(lo);
            if hi != lo {
                out.push(hi);
            }
        } else {
            out.push(hi);
            out.push(lo);
        }
    }
    // The last point is the final state: keep it exactly.
    if let Some(&last) = points.last() {
        if out.last() != Some(&last) {
            out.push(last);
        }
    }
    out
}

/// Seconds as a short axis label (`45s`, `12m`, `3.5h`), with the
/// decimals the axis's span needs for its ticks to differ (`0.5s`, `1.5s`
/// on a 2 s trace).
fn time_label(ms: u64, span_ms: u64) -> String {
    let s = ms as f64 / 1000.0;
    if s < 120.0 {
        let decimals = match span_ms {
            0..2_000 => 2,
            2_000..20_000 => 1,
            _ => 0,
        };
        format!("{s:.decimals$}s")
    } else if s < 7200.0 {
        format!("{:.0}m", s / 60.0)
    } else {
        format!("{:.1}h", s / 3600.0)
    }
}

/// An SVG chart of `lines` titled `title`; a note instead when there is
/// nothing to draw.
pub fn svg(title: &str, lines: &[Line<'_>]) -> String {
    let mut out = String::new();
    let all = lines.iter().flat_map(|l| l.points.iter());
    let (mut t0, mut t1, mut y1) = (u64::MAX, 0u64, 0u64);
    let mut any = false;
    for &(t, y) in all {
        any = true;
        t0 = t0.min(t);
        t1 = t1.max(t);
        y1 = y1.max(y);
    }
    let _ = write!(
        out,
        "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {W} {H}\" width=\"{W}\" height=\"{H}\" role=\"img\">"
    );
    let _ = write!(
        out,
        "<text x=\"{LEFT}\" y=\"16\" class=\"ct\">{}</text>",
        escape(title)
    );
    if !any {
        let _ = write!(
            out,
            "<text x=\"{}\" y=\"{}\" class=\"cn\">no snapshots (the trace was shorter than one interval)</text></svg>",
            LEFT,
            H / 2.0
        );
        return out;
    }
    let span_t = (t1.saturating_sub(t0)).max(1) as f64;
    let y1 = y1.max(1) as f64;
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let x = |t: u64| LEFT + (t.saturating_sub(t0)) as f64 / span_t * pw;
    let y = |v: u64| TOP + ph - v as f64 / y1 * ph;
    // Axes, grid and labels.
    let _ = write!(
        out,
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw}\" height=\"{ph}\" class=\"cf\"/>"
    );
    for i in 0..=4 {
        let v = (y1 * f64::from(i) / 4.0) as u64;
        let yy = y(v);
        let _ = write!(
            out,
            "<line x1=\"{LEFT}\" x2=\"{}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" class=\"cg\"/><text x=\"{}\" y=\"{:.1}\" class=\"cy\">{}</text>",
            LEFT + pw,
            LEFT - 4.0,
            yy + 4.0,
            escape(&human_bytes(v))
        );
    }
    let mut last_label = String::new();
    for i in 0..=4 {
        let t = t0 + (span_t * f64::from(i) / 4.0) as u64;
        let label = time_label(t, t1.saturating_sub(t0));
        // A label equal to the last one says nothing new.
        if label == last_label {
            continue;
        }
        let _ = write!(
            out,
            "<text x=\"{:.1}\" y=\"{}\" class=\"cx\">{}</text>",
            x(t),
            H - BOTTOM + 16.0,
            label
        );
        last_label = label;
    }
    for (i, line) in lines.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        let points = reduce(&line.points, MAX_POINTS);
        let mut path = String::new();
        for (t, v) in &points {
            let _ = write!(path, "{:.1},{:.1} ", x(*t), y(*v));
        }
        let _ = write!(
            out,
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\" points=\"{}\"><title>{}</title></polyline>",
            path.trim_end(),
            escape(line.label)
        );
        if points.len() == 1 {
            let (t, v) = points[0];
            let _ = write!(
                out,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"2.5\" fill=\"{colour}\"/>",
                x(t),
                y(v)
            );
        }
    }
    out.push_str("</svg>");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_ticks_of_short_traces_differ() {
        let labels: Vec<String> = (0..=4).map(|i| time_label(i * 500, 2000)).collect();
        assert_eq!(labels, ["0.0s", "0.5s", "1.0s", "1.5s", "2.0s"]);
        assert_eq!(time_label(1250, 1500), "1.25s");
        assert_eq!(time_label(45_000, 60_000), "45s");
        assert_eq!(time_label(600_000, 3_600_000), "10m");
        let points = [(1000, 10), (1500, 20), (2000, 30), (2500, 40), (3000, 50)];
        let chart = svg(
            "t",
            &[Line {
                label: "x",
                points: points.to_vec(),
            }],
        );
        let ticks: Vec<&str> = chart
            .split("class=\"cx\">")
            .skip(1)
            .filter_map(|rest| rest.split('<').next())
            .collect();
        let mut unique = ticks.clone();
        unique.dedup();
        assert_eq!(ticks, unique, "{chart}");
    }

    #[test]
    fn reduce_keeps_spikes_and_the_last_point() {
        let mut points: Vec<(u64, u64)> = (0..100_000u64).map(|t| (t * 1000, 10)).collect();
        points[50_000].1 = 1_000_000;
        if let Some(p) = points.last_mut() {
            p.1 = 7;
        }
        let reduced = reduce(&points, 800);
        assert!(reduced.len() <= 802, "{}", reduced.len());
        assert!(reduced.iter().any(|p| p.1 == 1_000_000));
        assert_eq!(reduced.last(), Some(&(99_999_000, 7)));
        assert!(reduced.windows(2).all(|w| w[0].0 <= w[1].0));
        assert_eq!(reduce(&points[..10], 800).len(), 10);
    }

    #[test]
    fn labels_are_escaped_and_empty_charts_say_so() {
        let line = Line {
            label: "operator<<(std::ostream&, T)",
            points: vec![(0, 1), (1000, 2048)],
        };
        let svg = svg("live <bytes>", &[line]);
        assert!(svg.contains("operator&lt;&lt;(std::ostream&amp;, T)"));
        assert!(svg.contains("live &lt;bytes&gt;"));
        assert!(!svg.contains("<<"));
        assert!(svg.contains("<polyline"));
        assert!(svg.contains("2.0 KiB"));
        let empty = super::svg("nothing", &[]);
        assert!(empty.contains("no snapshots"));
        assert!(empty.ends_with("</svg>"));
    }
}
