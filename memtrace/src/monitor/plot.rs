//! Pictures of a recording (`--plot FILE.svg|FILE.png`): one small chart per
//! metric, grouped by family (process, system, GPU), each segment in its own
//! colour with its Theil–Sen trend line overlaid and the verdict in the
//! title. Each panel is drawn and labelled in its metric's own unit (bytes in
//! MiB, counts, percentages). All-zero series are left out.
//!
//! Text needs a TrueType font: `$MEMTRACE_FONT`, else DejaVu/Liberation/any
//! `*Sans*.ttf` under /usr/share/fonts. Without one the curves are drawn
//! without text (a note says so).

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::monitor::error::MonitorError;
use crate::monitor::series::{Family, Recording, Series, Unit};
use crate::monitor::units::format_rate;
use crate::monitor::verdict::Verdict;

const PANEL_W: u32 = 520;
const PANEL_H: u32 = 280;
const COLUMNS: usize = 3;
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Picture formats by extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlotKind {
    Svg,
    Png,
}

impl PlotKind {
    /// From the extension of `path` (`.svg`, `.png`).
    pub fn from_path(path: &Path) -> Option<PlotKind> {
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase)
            .as_deref()
        {
            Some("svg") => Some(PlotKind::Svg),
            Some("png") => Some(PlotKind::Png),
            _ => None,
        }
    }
}

fn font_candidates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::env::var_os("MEMTRACE_FONT")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    for p in [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
        "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
        "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
    ] {
        out.push(PathBuf::from(p));
    }
    let mut stack = vec![(PathBuf::from("/usr/share/fonts"), 0)];
    while let Some((dir, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.filter_map(|e| e.ok()) {
            let p = e.path();
            if p.is_dir() && depth < 4 {
                stack.push((p, depth + 1));
            } else if p
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(".ttf") && n.contains("Sans"))
            {
                out.push(p);
            }
        }
    }
    out
}

/// Registers a font as "sans-serif" once; false when none was found.
fn font_ready() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        for path in font_candidates() {
            if let Ok(bytes) = std::fs::read(&path) {
                // The font table needs 'static bytes; this is done once.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    })
}

struct Panel<'a> {
    family: Family,
    metric: &'a str,
    unit: Unit,
    series: Vec<&'a Series>,
    verdicts: Vec<&'a Verdict>,
}

fn panels<'a>(rec: &'a Recording, verdicts: &'a [Verdict]) -> Vec<Panel<'a>> {
    let mut out: Vec<Panel<'a>> = Vec::new();
    let mut ordered: Vec<&Series> = rec.series.iter().collect();
    ordered.sort_by_key(|s| s.family);
    for s in ordered {
        let nonzero = s.points.iter().any(|(_, v)| v.is_some_and(|v| v != 0.0));
        if !nonzero {
            continue;
        }
        let slot = out
            .iter()
            .position(|p| p.family == s.family && p.metric == s.metric);
        let idx = match slot {
            Some(i) => i,
            None => {
                out.push(Panel {
                    family: s.family,
                    metric: &s.metric,
                    unit: s.unit,
                    series: Vec::new(),
                    verdicts: Vec::new(),
                });
                out.len() - 1
            }
        };
        out[idx].series.push(s);
        if let Some(v) = verdicts
            .iter()
            .find(|v| v.family == s.family && v.metric == s.metric && v.segment == s.segment)
        {
            out[idx].verdicts.push(v);
        }
    }
    out
}

fn title(p: &Panel) -> String {
    let verdicts: Vec<String> = p
        .verdicts
        .iter()
        .map(|v| {
            format!(
                "{} {}",
                v.label.as_str(),
                format_rate(v.slope_per_hour, v.unit == Unit::Bytes)
            )
        })
        .collect();
    format!(
        "{}: {} ({}) - {}",
        p.family.as_str(),
        p.metric,
        p.unit.plot_scale().1,
        verdicts.join(", ")
    )
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    text: bool,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let (scale, unit_label) = panel.unit.plot_scale();
    let mut x_max: f64 = 0.0;
    let mut x_min = f64::INFINITY;
    let mut y_min = f64::INFINITY;
    let mut y_max = f64::NEG_INFINITY;
    for s in &panel.series {
        for (t, v) in &s.points {
            x_min = x_min.min(*t);
            x_max = x_max.max(*t);
            if let Some(v) = v {
                y_min = y_min.min(v / scale);
                y_max = y_max.max(v / scale);
            }
        }
    }
    if !y_min.is_finite() || !x_min.is_finite() {
        return Ok(());
    }
    let pad = ((y_max - y_min) * 0.08).max(y_max.abs() * 0.01).max(1e-3);
    let (y0, y1) = (y_min - pad, y_max + pad);
    let x1 = if x_max > x_min { x_max } else { x_min + 1.0 };

    let mut builder = ChartBuilder::on(area);
    builder.margin(8);
    if text {
        builder
            .caption(title(panel), ("sans-serif", 13))
            .x_label_area_size(22)
            .y_label_area_size(52);
    }
    let mut chart = builder
        .build_cartesian_2d(x_min..x1, y0..y1)
        .map_err(|e| e.to_string())?;
    if text {
        chart
            .configure_mesh()
            .x_labels(6)
            .y_labels(5)
            .x_desc("s")
            .y_desc(unit_label)
            .label_style(("sans-serif", 10))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    for (i, s) in panel.series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        // Split at gaps so a missing stretch is not bridged.
        let mut run: Vec<(f64, f64)> = Vec::new();
        let mut runs: Vec<Vec<(f64, f64)>> = Vec::new();
        for (t, v) in &s.points {
            match v {
                Some(v) => run.push((*t, v / scale)),
                None => runs.push(std::mem::take(&mut run)),
            }
        }
        runs.push(run);
        for r in runs.into_iter().filter(|r| !r.is_empty()) {
            chart
                .draw_series(LineSeries::new(r, color.stroke_width(2)))
                .map_err(|e| e.to_string())?;
        }
        if let Some(v) = panel.verdicts.iter().find(|v| v.segment == s.segment) {
            let (ts, _) = s.valid_from(v.from_t);
            if let (Some(a), Some(b)) = (ts.first(), ts.last()) {
                let slope = v.slope_per_hour / 3600.0;
                let line = [*a, *b].map(|t| (t, (v.intercept + slope * t) / scale));
                chart
                    .draw_series(DashedLineSeries::new(line, 6, 4, BLACK.stroke_width(1)))
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    Ok(())
}

fn draw_all<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    panels: &[Panel],
    text: bool,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let rows = panels.len().div_ceil(COLUMNS).max(1);
    let areas = root.split_evenly((rows, COLUMNS));
    for (area, panel) in areas.iter().zip(panels) {
        draw_panel(area, panel, text)?;
    }
    root.present().map_err(|e| e.to_string())
}

/// Each metric panel as `(title, SVG text)`.
pub type PanelSvgs = Vec<(String, String)>;

/// One SVG per metric panel, as text (for the HTML page), with a note when
/// the curves had to be drawn without text.
pub fn panel_svgs(
    rec: &Recording,
    verdicts: &[Verdict],
) -> Result<(PanelSvgs, Option<String>), String> {
    let text = font_ready();
    let mut out = Vec::new();
    for panel in panels(rec, verdicts) {
        let mut svg = String::new();
        {
            let root = SVGBackend::with_string(&mut svg, (PANEL_W, PANEL_H)).into_drawing_area();
            root.fill(&WHITE).map_err(|e| e.to_string())?;
            draw_panel(&root, &panel, text)?;
            root.present().map_err(|e| e.to_string())?;
        }
        out.push((title(&panel), svg));
    }
    Ok((
        out,
        (!text).then(|| {
            "no TrueType font found (set MEMTRACE_FONT): curves drawn without axis text".into()
        }),
    ))
}

/// Draws the recording to `path` (`.svg` or `.png`). Returns a note when the
/// picture had to be drawn without text.
pub fn plot(
    path: &Path,
    rec: &Recording,
    verdicts: &[Verdict],
) -> Result<Option<String>, MonitorError> {
    let err = |reason: String| MonitorError::Plot {
        path: path.to_path_buf(),
        reason,
    };
    let kind = PlotKind::from_path(path)
        .ok_or_else(|| err("unknown extension (use .svg or .png)".into()))?;
    let panels = panels(rec, verdicts);
    let rows = panels.len().div_ceil(COLUMNS).max(1) as u32;
    let size = (PANEL_W * COLUMNS as u32, PANEL_H * rows);
    let text = font_ready();
    // Drawn in memory (a PNG in a private temporary file: the encoder
    // writes files only), then written whole, or in place to a device, FIFO
    // or through a symbolic link, as every output is.
    let bytes = match kind {
        PlotKind::Svg => {
            let mut svg = String::new();
            draw_all(
                SVGBackend::with_string(&mut svg, size).into_drawing_area(),
                &panels,
                text,
            )
            .map_err(err)?;
            svg.into_bytes()
        }
        PlotKind::Png => {
            // A fresh directory only this user can enter (created, never
            // reused: nobody can plant a link at the file's name).
            let dir = std::env::temp_dir().join(format!(
                "memtrace-plot-{}-{}",
                std::process::id(),
                PNG_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ));
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .map_err(|e| err(format!("{}: {e}", dir.display())))?;
            let temp = dir.join("plot.png");
            let drawn = draw_all(
                BitMapBackend::new(&temp, size).into_drawing_area(),
                &panels,
                text,
            )
            .and_then(|()| std::fs::read(&temp).map_err(|e| e.to_string()));
            let _ = std::fs::remove_dir_all(&dir);
            drawn.map_err(err)?
        }
    };
    crate::output::write_whole(path, super::store::FILE_MODE, |out| out.write_all(&bytes))
        .map_err(|e| MonitorError::Write {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    Ok((!text)
        .then(|| "no TrueType font found (set MEMTRACE_FONT): plot drawn without text".into()))
}

/// Tells apart the temporary PNG files of one process.
static PNG_SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::series::Meta;
    use crate::monitor::verdict::{judge, Thresholds};

    #[test]
    fn each_panel_is_labelled_in_its_metrics_unit() {
        let mut rec = Recording::new(Meta::default());
        let segment = rec.open_segment(10, "demo", 0.0);
        for i in 0..4 {
            let t = f64::from(i);
            rec.record(Family::Process, "VmRSS", Unit::Bytes, segment, t, 4e6);
            rec.record(Family::Process, "fds", Unit::Count, segment, t, 12.0);
            rec.record(Family::Process, "threads", Unit::Count, segment, t, 3.0);
            rec.record(Family::Gpu, "gpu0.busy", Unit::Percent, 0, t, 40.0);
        }
        let verdicts: Vec<Verdict> = rec
            .series
            .iter()
            .map(|s| judge(s, 0.0, &Thresholds::default()))
            .collect();
        let titles: Vec<String> = panels(&rec, &verdicts).iter().map(title).collect();
        let title_of = |metric: &str| {
            titles
                .iter()
                .find(|t| t.contains(&format!(": {metric} (")))
                .cloned()
                .unwrap_or_else(|| panic!("{metric} in {titles:?}"))
        };
        assert!(title_of("VmRSS").starts_with("process: VmRSS (MiB) - "));
        assert!(title_of("fds").starts_with("process: fds (count) - "));
        assert!(title_of("threads").starts_with("process: threads (count) - "));
        assert!(title_of("gpu0.busy").starts_with("gpu: gpu0.busy (%) - "));
        assert!(titles.iter().filter(|t| t.contains("(MiB)")).count() == 1);
    }
}
