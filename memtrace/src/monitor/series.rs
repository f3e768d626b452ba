//! The in-memory recording: one series per (family, metric, segment), where a
//! segment is one process lifetime (segment 0 holds system-wide metrics).
//! Missing samples are gaps (a `null` point plus a note), never errors.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// Which part of the machine a metric describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// Per-process metrics (`/proc/PID/status`, fds, threads).
    Process,
    /// System-wide metrics (`/proc/meminfo`).
    System,
    /// GPU metrics, per device (segment 0) or per process.
    Gpu,
}

impl Family {
    /// Lower-case name used in files and output.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Process => "process",
            Family::System => "system",
            Family::Gpu => "gpu",
        }
    }

    /// Inverse of [`Family::as_str`].
    pub fn parse(text: &str) -> Option<Family> {
        match text {
            "process" => Some(Family::Process),
            "system" => Some(Family::System),
            "gpu" => Some(Family::Gpu),
            _ => None,
        }
    }
}

/// Unit of a series' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Unit {
    /// Bytes.
    Bytes,
    /// A count (file descriptors, threads).
    Count,
    /// A percentage (a utilisation).
    Percent,
}

impl Unit {
    /// Lower-case name used in files.
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Bytes => "bytes",
            Unit::Count => "count",
            Unit::Percent => "percent",
        }
    }

    /// How a plot shows values of this unit: what each value is divided by,
    /// and the label of the axis (bytes in MiB, counts as they are,
    /// percentages in %).
    pub fn plot_scale(self) -> (f64, &'static str) {
        match self {
            Unit::Bytes => (1024.0 * 1024.0, "MiB"),
            Unit::Count => (1.0, "count"),
            Unit::Percent => (1.0, "%"),
        }
    }

    /// Inverse of [`Unit::as_str`].
    pub fn parse(text: &str) -> Option<Unit> {
        match text {
            "bytes" => Some(Unit::Bytes),
            "count" => Some(Unit::Count),
            "percent" => Some(Unit::Percent),
            _ => None,
        }
    }
}

/// A note at a point in time (a gap's cause, an event).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Note {
    /// Seconds since the start of the recording.
    pub t_s: f64,
    /// What happened.
    pub note: String,
}

/// One metric of one segment over time.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Series {
    pub family: Family,
    pub metric: String,
    pub unit: Unit,
    /// 0 for system-wide and device metrics, 1.. for process segments.
    pub segment: u32,
    pub pid: Option<u32>,
    /// `[t_s, value]`; `value` is `null` at a gap.
    pub points: Vec<(f64, Option<f64>)>,
    /// Why each gap happened.
    #[serde(default)]
    pub gaps: Vec<Note>,
}

impl Series {
    /// Valid `(t, v)` points at or after `from_t`.
    pub fn valid_from(&self, from_t: f64) -> (Vec<f64>, Vec<f64>) {
        self.points
            .iter()
            .filter_map(|(t, v)| v.map(|v| (*t, v)))
            .filter(|(t, _)| *t >= from_t)
            .unzip()
    }
}

/// One lifetime of a watched process.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Segment {
    pub segment: u32,
    pub pid: u32,
    pub name: String,
    pub start_s: f64,
    pub end_s: Option<f64>,
    pub end_note: Option<String>,
}

/// One run of a launched command (`-- CMD`, once per cycle).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Run {
    pub cycle: u32,
    pub pid: u32,
    pub start_s: f64,
    pub end_s: f64,
    /// Exit code when it exited normally.
    pub exit_code: Option<i32>,
    /// Signal number when it was killed by a signal.
    pub signal: Option<i32>,
    pub core_dumped: bool,
    /// Human-readable status (`exited 0`, `killed by signal 9`...).
    pub status: String,
}

/// What was watched and how.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Meta {
    /// `pid 123`, `name foo`, `command ./a.out x`.
    pub target: String,
    pub interval_s: f64,
    pub warmup_s: f64,
    #[serde(default)]
    pub settle_s: f64,
    #[serde(default)]
    pub cycles: u32,
    /// Unix time of t=0, milliseconds.
    pub started_unix_ms: u64,
    /// Sources that were found (or why not).
    #[serde(default)]
    pub sources: Vec<String>,
}

/// Everything sampled in one monitor session.
#[derive(Clone, Debug, Default)]
pub struct Recording {
    pub meta: Meta,
    pub segments: Vec<Segment>,
    pub runs: Vec<Run>,
    pub notes: Vec<Note>,
    pub series: Vec<Series>,
    index: HashMap<(Family, String, u32), usize>,
}

impl Recording {
    /// An empty recording.
    pub fn new(meta: Meta) -> Recording {
        Recording {
            meta,
            ..Recording::default()
        }
    }

    /// Rebuilds a recording from loaded parts (sorted by time).
    pub fn from_parts(
        meta: Meta,
        segments: Vec<Segment>,
        runs: Vec<Run>,
        notes: Vec<Note>,
        series: Vec<Series>,
    ) -> Recording {
        let mut rec = Recording {
            meta,
            segments,
            runs,
            notes,
            series,
            index: HashMap::new(),
        };
        for s in &mut rec.series {
            s.points
                .sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
        }
        rec.reindex();
        rec
    }

    fn reindex(&mut self) {
        self.index = self
            .series
            .iter()
            .enumerate()
            .map(|(i, s)| ((s.family, s.metric.clone(), s.segment), i))
            .collect();
    }

    /// Adds one sample (the pid comes from the segment; none for segment 0).
    pub fn record(
        &mut self,
        family: Family,
        metric: &str,
        unit: Unit,
        segment: u32,
        t: f64,
        value: f64,
    ) {
        let pid = self
            .segments
            .iter()
            .find(|s| s.segment == segment)
            .map(|s| s.pid);
        let key = (family, metric.to_string(), segment);
        let idx = match self.index.get(&key) {
            Some(i) => *i,
            None => {
                self.series.push(Series {
                    family,
                    metric: metric.to_string(),
                    unit,
                    segment,
                    pid,
                    points: Vec::new(),
                    gaps: Vec::new(),
                });
                let i = self.series.len() - 1;
                self.index.insert(key, i);
                i
            }
        };
        self.series[idx].points.push((t, Some(value)));
    }

    /// Marks a gap in every series of `family`/`segment` not sampled at `t`
    /// whose last point is a value (so a gap is recorded once, not per tick).
    pub fn close_missing(&mut self, family: Family, segment: u32, t: f64, note: &str) {
        for s in &mut self.series {
            if s.family != family || s.segment != segment {
                continue;
            }
            if let Some((last_t, Some(_))) = s.points.last() {
                if *last_t < t {
                    s.points.push((t, None));
                    s.gaps.push(Note {
                        t_s: t,
                        note: note.to_string(),
                    });
                }
            }
        }
    }

    /// Starts a new process segment and returns its number.
    pub fn open_segment(&mut self, pid: u32, name: &str, t: f64) -> u32 {
        let segment = self.segments.len() as u32 + 1;
        self.segments.push(Segment {
            segment,
            pid,
            name: name.to_string(),
            start_s: t,
            end_s: None,
            end_note: None,
        });
        segment
    }

    /// Ends a process segment, marking its series with a gap.
    pub fn close_segment(&mut self, segment: u32, t: f64, note: &str) {
        if let Some(seg) = self.segments.iter_mut().find(|s| s.segment == segment) {
            if seg.end_s.is_none() {
                seg.end_s = Some(t);
                seg.end_note = Some(note.to_string());
            }
        }
        self.close_missing(Family::Process, segment, t, note);
        self.close_missing(Family::Gpu, segment, t, note);
    }

    /// Adds a timed note.
    pub fn note(&mut self, t: f64, note: impl Into<String>) {
        self.notes.push(Note {
            t_s: t,
            note: note.into(),
        });
    }

    /// Start time of a segment (0 for segment 0).
    pub fn segment_start(&self, segment: u32) -> f64 {
        self.segments
            .iter()
            .find(|s| s.segment == segment)
            .map(|s| s.start_s)
            .unwrap_or(0.0)
    }

    /// Number of sample times (distinct `t` over all series).
    pub fn sample_count(&self) -> usize {
        let mut ts: Vec<u64> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|(t, _)| (t * 1000.0).round() as u64))
            .collect();
        ts.sort_unstable();
        ts.dedup();
        ts.len()
    }

    /// Last sample time.
    pub fn end_t(&self) -> f64 {
        self.series
            .iter()
            .filter_map(|s| s.points.last().map(|p| p.0))
            .fold(0.0, f64::max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_unit_has_its_own_plot_label() {
        assert_eq!(Unit::Bytes.plot_scale(), (1048576.0, "MiB"));
        assert_eq!(Unit::Count.plot_scale(), (1.0, "count"));
        assert_eq!(Unit::Percent.plot_scale(), (1.0, "%"));
        for unit in [Unit::Bytes, Unit::Count, Unit::Percent] {
            assert_eq!(Unit::parse(unit.as_str()), Some(unit));
        }
    }

    #[test]
    fn missing_metrics_become_one_gap() {
        let mut rec = Recording::new(Meta::default());
        rec.record(Family::Gpu, "card0.vram_used", Unit::Bytes, 0, 0.0, 1.0);
        rec.close_missing(Family::Gpu, 0, 1.0, "source error");
        rec.close_missing(Family::Gpu, 0, 2.0, "source error");
        let s = &rec.series[0];
        assert_eq!(s.points, vec![(0.0, Some(1.0)), (1.0, None)]);
        assert_eq!(s.gaps.len(), 1);
        assert_eq!(s.gaps[0].note, "source error");
    }

    #[test]
    fn segments_are_numbered_from_one() {
        let mut rec = Recording::new(Meta::default());
        assert_eq!(rec.open_segment(10, "a", 0.0), 1);
        assert_eq!(rec.open_segment(11, "a", 1.0), 2);
        rec.record(Family::Process, "VmRSS", Unit::Bytes, 1, 0.5, 4.0);
        rec.close_segment(1, 0.9, "process exited");
        assert_eq!(rec.segments[0].end_s, Some(0.9));
        assert_eq!(rec.series[0].gaps[0].note, "process exited");
    }
}
