//! Judging the watched metrics: a bounded sliding window of samples per
//! metric, judged with the monitor's verdict code (`monitor::verdict`), and
//! the rule that turns a verdict into a trigger. Pure logic: no I/O, no
//! clock; times are seconds on the watcher's own monotonic axis.

use std::collections::VecDeque;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::monitor::series::{Family, Series, Unit};
use crate::monitor::verdict::{self, Label, Thresholds, Verdict};

/// Verdict labels that start an episode (`--trigger`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Trigger {
    /// Steady growth at or above `--growth-rate`.
    Growth,
    /// Significant steady growth below `--growth-rate`.
    SlowGrowth,
    /// An upward level shift.
    Jump,
}

impl Trigger {
    /// The label this trigger answers to.
    pub fn label(self) -> Label {
        match self {
            Trigger::Growth => Label::Growth,
            Trigger::SlowGrowth => Label::SlowGrowth,
            Trigger::Jump => Label::Jump,
        }
    }
}

/// When judging a process found at `now` may start: `warmup` after it
/// started (`age_s` before now), and never before its first sample, taken
/// now. A process that ran before the watch began has no samples from
/// before then: counted from its start, its warm-up and the half window
/// below would be long over, and it would be judged on its first few
/// samples (one tooth of a sawtooth rises like a leak).
pub fn judge_from(now: f64, age_s: f64, warmup_s: f64) -> f64 {
    (now - age_s + warmup_s).max(now)
}

/// Whether a process whose judging starts at `judge_from` may be judged at
/// `t`: once half a judged window has been sampled after that.
pub fn may_judge(t: f64, judge_from: f64, judge_window_s: f64) -> bool {
    t >= judge_from + judge_window_s / 2.0
}

/// The recent samples of one metric, bounded in time and in count.
#[derive(Clone, Debug)]
pub struct Window {
    pub family: Family,
    pub metric: String,
    pub unit: Unit,
    span_s: f64,
    cap: usize,
    points: VecDeque<(f64, f64)>,
}

impl Window {
    /// An empty window keeping `span_s` seconds and at most `cap` points.
    pub fn new(family: Family, metric: &str, unit: Unit, span_s: f64, cap: usize) -> Window {
        Window {
            family,
            metric: metric.to_string(),
            unit,
            span_s,
            cap: cap.max(verdict::MIN_POINTS),
            points: VecDeque::new(),
        }
    }

    /// Adds a sample and drops what fell out of the window.
    pub fn push(&mut self, t: f64, value: f64) {
        self.points.push_back((t, value));
        while self.points.len() > self.cap {
            self.points.pop_front();
        }
        while let Some((first, _)) = self.points.front() {
            if t - first > self.span_s {
                self.points.pop_front();
            } else {
                break;
            }
        }
    }

    /// The latest value.
    pub fn last(&self) -> Option<(f64, f64)> {
        self.points.back().copied()
    }

    /// The value nearest at or before `t` (the first one when none is).
    pub fn value_at(&self, t: f64) -> Option<f64> {
        self.points
            .iter()
            .rev()
            .find(|(pt, _)| *pt <= t)
            .or_else(|| self.points.front())
            .map(|(_, v)| *v)
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// The window as a monitor series (segment 1), for `verdict::judge`.
    fn series(&self) -> Series {
        Series {
            family: self.family,
            metric: self.metric.clone(),
            unit: self.unit,
            segment: 1,
            pid: None,
            points: self.points.iter().map(|(t, v)| (*t, Some(*v))).collect(),
            gaps: Vec::new(),
        }
    }

    /// Judges the samples at or after `from_t` (the end of the warm-up).
    pub fn judge(&self, from_t: f64, th: &Thresholds) -> Judgement {
        let verdict = verdict::judge(&self.series(), from_t, th);
        let points: Vec<(f64, f64)> = self
            .points
            .iter()
            .copied()
            .filter(|(t, _)| *t >= from_t)
            .collect();
        let floor = floor(&verdict, th);
        let still_growing = still_growing(&points, verdict.slope_per_hour / 3600.0);
        let since_t = onset(&verdict, &points, floor);
        let recent_jump = match (points.first(), points.last()) {
            (Some((first, _)), Some((last, _))) => {
                let recent = last - (last - first) / 3.0;
                verdict
                    .steps
                    .iter()
                    .any(|s| s.size > 0.0 && s.t_s >= recent)
            }
            _ => false,
        };
        Judgement {
            verdict,
            still_growing,
            recent_jump,
            since_t,
        }
    }
}

/// One metric's judgement at one moment.
#[derive(Clone, Debug)]
pub struct Judgement {
    pub verdict: Verdict,
    /// For a growth label: whether the latest third of the window still
    /// grows (a warm-up that has levelled off does not).
    pub still_growing: bool,
    /// For a jump: whether an upward step lies in the latest third of the
    /// window (an episode only sees what is allocated while it traces, so a
    /// step long past, such as a warm-up, is not worth one).
    pub recent_jump: bool,
    /// When the growth (or the first upward step) began, as far as the
    /// window shows.
    pub since_t: f64,
}

impl Judgement {
    /// Whether this judgement starts an episode under `triggers`.
    pub fn fires(&self, triggers: &[Trigger]) -> bool {
        let label = self.verdict.label;
        if !triggers.iter().any(|t| t.label() == label) {
            return false;
        }
        match label {
            Label::Growth | Label::SlowGrowth => self.still_growing,
            Label::Jump => self.recent_jump,
            _ => false,
        }
    }
}

/// The smallest change that counts for this verdict's metric.
fn floor(v: &Verdict, th: &Thresholds) -> f64 {
    let abs = if v.unit == Unit::Bytes {
        th.min_change_bytes
    } else {
        th.min_change_count
    };
    let level = v.start.unwrap_or(0.0).abs().max(v.end.unwrap_or(0.0).abs());
    abs.max(th.min_change_rel * level)
}

/// Whether the latest third of `points` rises at least a third as fast as
/// the whole window's trend (`slope` per second): a growth that stopped
/// (a cache warmed up, then flat) does not.
fn still_growing(points: &[(f64, f64)], slope: f64) -> bool {
    let n = points.len();
    if n < verdict::MIN_POINTS || slope <= 0.0 {
        return false;
    }
    let tail = &points[n - (n / 3).max(3)..];
    let half = tail.len() / 2;
    let mut first: Vec<f64> = tail[..half].iter().map(|p| p.1).collect();
    let mut last: Vec<f64> = tail[half..].iter().map(|p| p.1).collect();
    let mut tf: Vec<f64> = tail[..half].iter().map(|p| p.0).collect();
    let mut tl: Vec<f64> = tail[half..].iter().map(|p| p.0).collect();
    let observed = verdict::median(&mut last) - verdict::median(&mut first);
    let expected = slope * (verdict::median(&mut tl) - verdict::median(&mut tf));
    observed > 0.0 && observed >= expected / 3.0
}

/// When the growth began: the first upward step for a jump, otherwise the
/// last time the metric was still at its starting level (within half the
/// change floor); the window's start when it never was.
fn onset(v: &Verdict, points: &[(f64, f64)], floor: f64) -> f64 {
    if let Some(step) = v.steps.iter().find(|s| s.size > 0.0) {
        return step.t_s;
    }
    let Some(first) = points.first() else {
        return v.from_t;
    };
    let head = (points.len() / 6).max(1);
    let mut start: Vec<f64> = points[..head].iter().map(|p| p.1).collect();
    let level = verdict::median(&mut start);
    points
        .iter()
        .rev()
        .find(|(_, value)| *value <= level + floor / 2.0)
        .map_or(first.0, |(t, _)| *t)
}

/// Whether a metric is one that may trigger, given `--metrics` (names, or
/// `gpu` for every GPU figure of memory in use).
pub fn selected(family: Family, metric: &str, wanted: &[String]) -> bool {
    if wanted.iter().any(|w| w == metric) {
        return true;
    }
    family == Family::Gpu
        && wanted.iter().any(|w| w == "gpu")
        && !metric.contains("total")
        && !metric.contains("free")
        && !metric.contains("usage")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::testutil::noise;

    const MIB: f64 = 1024.0 * 1024.0;

    /// A window of `n` samples every `dt` seconds.
    fn window(f: impl Fn(f64, usize) -> f64, n: usize, dt: f64) -> Window {
        let mut w = Window::new(Family::Process, "RssAnon", Unit::Bytes, 1e9, 100_000);
        for i in 0..n {
            let t = i as f64 * dt;
            w.push(t, f(t, i));
        }
        w
    }

    const ALL: [Trigger; 3] = [Trigger::Growth, Trigger::SlowGrowth, Trigger::Jump];

    /// A process running for an hour when the watch finds it, 100 s in,
    /// with `--judge-window 60s --warmup 30s`: judged 30 s (half a window)
    /// after its first sample, not 5 s.
    #[test]
    fn a_process_already_running_is_judged_half_a_window_after_its_first_sample() {
        let (found_at, window, warmup) = (100.0, 60.0, 30.0);
        let from = judge_from(found_at, 3600.0, warmup);
        assert_eq!(from, found_at);
        assert!(!may_judge(found_at + 5.0, from, window));
        assert!(!may_judge(found_at + 29.9, from, window));
        assert!(may_judge(found_at + 30.0, from, window));
    }

    /// A process started 2 s before it was found: its warm-up ends 28 s
    /// later, and half a window after that it is judged.
    #[test]
    fn a_young_process_is_judged_after_its_warm_up_and_half_a_window() {
        let from = judge_from(10.0, 2.0, 30.0);
        assert_eq!(from, 38.0);
        assert!(!may_judge(67.9, from, 60.0));
        assert!(may_judge(68.0, from, 60.0));
    }

    fn fires(w: &Window) -> bool {
        w.judge(0.0, &Thresholds::default()).fires(&ALL)
    }

    #[test]
    fn steady_does_not_fire() {
        let w = window(|_, i| 80.0 * MIB + 48.0 * 1024.0 * noise(i), 300, 1.0);
        assert!(!fires(&w));
    }

    #[test]
    fn gc_sawtooth_does_not_fire() {
        for period in [15.0, 30.0, 45.0] {
            let w = window(
                |t, i| 60.0 * MIB + 24.0 * MIB * ((t % period) / period) + 8.0 * 1024.0 * noise(i),
                300,
                1.0,
            );
            let j = w.judge(0.0, &Thresholds::default());
            assert!(!j.fires(&ALL), "period {period}: {:?}", j.verdict);
        }
    }

    #[test]
    fn warm_up_plateau_does_not_fire_once_flat() {
        // Grows 40 MiB in the first 60 s, then flat for four minutes.
        let w = window(
            |t, i| 50.0 * MIB + 40.0 * MIB * (t / 60.0).min(1.0) + 16.0 * 1024.0 * noise(i),
            300,
            1.0,
        );
        let j = w.judge(0.0, &Thresholds::default());
        assert!(!j.fires(&ALL), "{:?} still {}", j.verdict, j.still_growing);
        // And with the warm-up excluded, it is stable.
        let j = w.judge(60.0, &Thresholds::default());
        assert_eq!(j.verdict.label, Label::Stable);
    }

    #[test]
    fn slow_leak_fires_as_slow_growth() {
        // 3 MiB/h over two hours, sampled every 10 s.
        let w = window(
            |t, i| 50.0 * MIB + 3.0 * MIB * t / 3600.0 + 16.0 * 1024.0 * noise(i),
            720,
            10.0,
        );
        let j = w.judge(0.0, &Thresholds::default());
        assert_eq!(j.verdict.label, Label::SlowGrowth);
        assert!(j.fires(&ALL));
        assert!(!j.fires(&[Trigger::Growth, Trigger::Jump]));
    }

    #[test]
    fn leak_after_steady_fires_with_its_onset() {
        // Flat for 200 s, then 1 MiB/s.
        let w = window(
            |t, i| 80.0 * MIB + MIB * (t - 200.0).max(0.0) + 16.0 * 1024.0 * noise(i),
            300,
            1.0,
        );
        let j = w.judge(0.0, &Thresholds::default());
        assert!(j.fires(&ALL), "{:?}", j.verdict);
        assert!((195.0..=215.0).contains(&j.since_t), "onset {}", j.since_t);
    }

    #[test]
    fn step_jump_fires_at_the_step() {
        let w = window(
            |t, i| {
                80.0 * MIB + if t >= 150.0 { 30.0 * MIB } else { 0.0 } + 16.0 * 1024.0 * noise(i)
            },
            300,
            1.0,
        );
        let j = w.judge(0.0, &Thresholds::default());
        assert_eq!(j.verdict.label, Label::Jump);
        assert!(!j.fires(&ALL), "a step long past is not traced");
        assert!((j.since_t - 150.0).abs() <= 1.0);
        let w = window(
            |t, i| {
                80.0 * MIB + if t >= 250.0 { 30.0 * MIB } else { 0.0 } + 16.0 * 1024.0 * noise(i)
            },
            300,
            1.0,
        );
        let j = w.judge(0.0, &Thresholds::default());
        assert_eq!(j.verdict.label, Label::Jump);
        assert!(j.fires(&ALL));
        assert!(!j.fires(&[Trigger::Growth]));
    }

    #[test]
    fn window_is_bounded_in_time_and_count() {
        let mut w = Window::new(Family::Process, "fds", Unit::Count, 10.0, 8);
        for i in 0..100 {
            w.push(i as f64, 1.0);
        }
        assert_eq!(w.len(), 8);
        let mut w = Window::new(Family::Process, "fds", Unit::Count, 10.0, 1000);
        for i in 0..100 {
            w.push(i as f64, i as f64);
        }
        assert_eq!(w.len(), 11);
        assert_eq!(w.value_at(95.5), Some(95.0));
        assert_eq!(w.value_at(0.0), Some(89.0));
    }

    #[test]
    fn metrics_are_selected_by_name_or_gpu() {
        let wanted = vec!["RssAnon".to_string(), "gpu".to_string()];
        assert!(selected(Family::Process, "RssAnon", &wanted));
        assert!(!selected(Family::Process, "VmRSS", &wanted));
        assert!(selected(Family::Gpu, "nvml.used", &wanted));
        assert!(selected(Family::Gpu, "nvml0.used", &wanted));
        assert!(!selected(Family::Gpu, "nvml0.total", &wanted));
        assert!(!selected(
            Family::Gpu,
            "nvml0.used",
            &["RssAnon".to_string()]
        ));
    }
}
