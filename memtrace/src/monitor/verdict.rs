//! Judging one series after warm-up: robust trend (Theil–Sen slope, pairs
//! subsampled when there are many points), step jumps (binary segmentation
//! with a piecewise-constant model that must beat the trend line), jitter
//! (robust spread of the residuals around the trend relative to the level),
//! and the resulting label.

use serde::{Deserialize, Serialize};

use crate::monitor::series::{Family, Series, Unit};
use crate::monitor::units::format_value;

/// Fewest points that can be judged.
pub const MIN_POINTS: usize = 6;

/// Thresholds of the labels (see `memtrace monitor --help` for defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct Thresholds {
    /// Bytes per hour at or above which growth is `growth`, below `slow-growth`.
    pub growth_rate_bytes: f64,
    /// Same for counts (fds, threads), per hour.
    pub growth_rate_count: f64,
    /// Smallest change (trend over the window, or step) that counts, bytes.
    pub min_change_bytes: f64,
    /// Smallest change that counts for counts.
    pub min_change_count: f64,
    /// Smallest change that counts, as a fraction of the level.
    pub min_change_rel: f64,
    /// A trend must exceed this many noise sigmas over the window.
    pub noise_k: f64,
    /// A step must exceed this many within-level noise sigmas.
    pub jump_k: f64,
    /// Residual spread (sigma / level) at or above which the label is `jitter`.
    pub jitter_rel: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            growth_rate_bytes: 10.0 * 1024.0 * 1024.0,
            growth_rate_count: 60.0,
            min_change_bytes: 1024.0 * 1024.0,
            min_change_count: 3.0,
            min_change_rel: 0.01,
            noise_k: 3.0,
            jump_k: 6.0,
            jitter_rel: 0.05,
        }
    }
}

/// The verdict on one series.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Label {
    /// No significant trend, step or spread.
    Stable,
    /// Steady growth at or above the growth rate.
    Growth,
    /// Significant steady growth below the growth rate.
    SlowGrowth,
    /// At least one upward level shift.
    Jump,
    /// Large spread around a flat trend (sawtooth, churn).
    Jitter,
    /// Significant steady decrease.
    Shrink,
    /// Fewer than [`MIN_POINTS`] points after warm-up.
    TooShort,
}

impl Label {
    /// Name used in output and in `--fail-on`.
    pub fn as_str(self) -> &'static str {
        match self {
            Label::Stable => "stable",
            Label::Growth => "growth",
            Label::SlowGrowth => "slow-growth",
            Label::Jump => "jump",
            Label::Jitter => "jitter",
            Label::Shrink => "shrink",
            Label::TooShort => "too-short",
        }
    }
}

/// One detected level shift.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// Time of the first point after the shift.
    pub t_s: f64,
    /// Level after minus level before.
    pub size: f64,
}

/// The judgement of one series.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Verdict {
    pub family: Family,
    pub metric: String,
    pub unit: Unit,
    pub segment: u32,
    pub pid: Option<u32>,
    pub label: Label,
    /// Points judged (after warm-up, gaps excluded).
    pub points: usize,
    /// First and last judged values.
    pub start: Option<f64>,
    pub end: Option<f64>,
    /// Theil–Sen slope, units per hour.
    pub slope_per_hour: f64,
    /// Trend value at t = 0 (the trend is `intercept + slope * t`).
    pub intercept: f64,
    /// Start of the judged window (after warm-up), seconds.
    pub from_t: f64,
    /// Trend over the judged window (slope x span).
    pub change: f64,
    /// Robust sigma of the residuals around the trend.
    pub noise: f64,
    /// `noise` relative to the median level.
    pub jitter_rel: f64,
    pub steps: Vec<Step>,
    /// Gaps in the whole series.
    pub gaps: usize,
}

impl Verdict {
    /// Each step as `SIZE@Ts`, for the text and HTML reports.
    pub fn step_labels(&self) -> Vec<String> {
        self.steps
            .iter()
            .map(|s| {
                format!(
                    "{}@{:.1}s",
                    format_value(s.size, self.unit == Unit::Bytes),
                    s.t_s
                )
            })
            .collect()
    }
}

pub use crate::stats::{median, robust_sigma};

/// Theil–Sen fit of parallel time and value slices: `(slope per time unit, intercept)`.
pub fn theil_sen(t: &[f64], v: &[f64]) -> (f64, f64) {
    let points: Vec<(f64, f64)> = t.iter().copied().zip(v.iter().copied()).collect();
    crate::stats::theil_sen(&points)
}

fn abs_residual_sum(t: &[f64], v: &[f64]) -> f64 {
    let (b, a) = theil_sen(t, v);
    t.iter().zip(v).map(|(t, v)| (v - a - b * t).abs()).sum()
}

/// Binary segmentation: finds level shifts that a two-level model explains
/// much better than a straight line.
fn find_steps(t: &[f64], v: &[f64], floor: f64, jump_k: f64, depth: u32, out: &mut Vec<Step>) {
    let n = v.len();
    let m = (n / 20).max(3);
    if n < 2 * m {
        return;
    }
    // Best split by between-group variance (prefix sums).
    let total: f64 = v.iter().sum();
    let mut left = 0.0;
    let mut best = (0.0, 0usize);
    for k in 1..n {
        left += v[k - 1];
        if k < m || n - k < m {
            continue;
        }
        let ml = left / k as f64;
        let mr = (total - left) / (n - k) as f64;
        let score = (k * (n - k)) as f64 / n as f64 * (ml - mr).powi(2);
        if score > best.0 {
            best = (score, k);
        }
    }
    let k = best.1;
    if k == 0 {
        return;
    }
    let lmed = median(&mut v[..k].to_vec());
    let rmed = median(&mut v[k..].to_vec());
    let shift = rmed - lmed;
    let residuals: Vec<f64> = v
        .iter()
        .enumerate()
        .map(|(i, x)| if i < k { x - lmed } else { x - rmed })
        .collect();
    let within = robust_sigma(&residuals);
    let step_cost: f64 = residuals.iter().map(|r| r.abs()).sum();
    let line_cost = abs_residual_sum(t, v);
    if shift.abs() >= floor && shift.abs() >= jump_k * within && step_cost < 0.5 * line_cost {
        out.push(Step {
            t_s: t[k],
            size: shift,
        });
        if depth < 3 {
            find_steps(&t[..k], &v[..k], floor, jump_k, depth + 1, out);
            find_steps(&t[k..], &v[k..], floor, jump_k, depth + 1, out);
        }
    }
}

/// Judges `series` using the points at or after `from_t`.
pub fn judge(series: &Series, from_t: f64, th: &Thresholds) -> Verdict {
    let (t, v) = series.valid_from(from_t);
    let bytes = series.unit == Unit::Bytes;
    let mut verdict = Verdict {
        family: series.family,
        metric: series.metric.clone(),
        unit: series.unit,
        segment: series.segment,
        pid: series.pid,
        label: Label::TooShort,
        points: v.len(),
        start: v.first().copied(),
        end: v.last().copied(),
        slope_per_hour: 0.0,
        intercept: 0.0,
        from_t,
        change: 0.0,
        noise: 0.0,
        jitter_rel: 0.0,
        steps: Vec::new(),
        gaps: series.gaps.len(),
    };
    let n = v.len();
    if n < MIN_POINTS {
        return verdict;
    }
    let (slope, intercept) = theil_sen(&t, &v);
    let residuals: Vec<f64> = t
        .iter()
        .zip(&v)
        .map(|(t, v)| v - intercept - slope * t)
        .collect();
    let noise = robust_sigma(&residuals);
    let level = median(&mut v.iter().map(|x| x.abs()).collect::<Vec<_>>());
    let abs_floor = if bytes {
        th.min_change_bytes
    } else {
        th.min_change_count
    };
    let floor = abs_floor.max(th.min_change_rel * level);
    let span = t[n - 1] - t[0];
    let change = slope * span;
    verdict.slope_per_hour = slope * 3600.0;
    verdict.intercept = intercept;
    verdict.change = change;
    verdict.noise = noise;
    verdict.jitter_rel = if level > 0.0 { noise / level } else { 0.0 };

    find_steps(&t, &v, floor, th.jump_k, 0, &mut verdict.steps);
    verdict.steps.sort_by(|a, b| a.t_s.total_cmp(&b.t_s));

    // The trend must show in robust thirds too (rules out sawtooth artefacts).
    let third = (n / 3).max(1);
    let first = median(&mut v[..third].to_vec());
    let last = median(&mut v[n - third..].to_vec());
    let tf = median(&mut t[..third].to_vec());
    let tl = median(&mut t[n - third..].to_vec());
    let expected = slope * (tl - tf);
    let observed = last - first;
    let consistent = observed.signum() == slope.signum() && observed.abs() >= 0.5 * expected.abs();
    let significant =
        slope != 0.0 && change.abs() >= floor && change.abs() >= th.noise_k * noise && consistent;
    let jitter = verdict.jitter_rel >= th.jitter_rel && noise >= floor / 2.0;
    let rate = if bytes {
        th.growth_rate_bytes
    } else {
        th.growth_rate_count
    };

    verdict.label = if verdict.steps.iter().any(|s| s.size > 0.0) {
        Label::Jump
    } else if significant && slope > 0.0 {
        if slope * 3600.0 >= rate {
            Label::Growth
        } else {
            Label::SlowGrowth
        }
    } else if jitter {
        Label::Jitter
    } else if significant {
        Label::Shrink
    } else {
        Label::Stable
    };
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::testutil::noise;

    const MIB: f64 = 1024.0 * 1024.0;

    fn series(f: impl Fn(f64, usize) -> f64, n: usize, dt: f64) -> Series {
        Series {
            family: Family::Process,
            metric: "VmRSS".into(),
            unit: Unit::Bytes,
            segment: 1,
            pid: Some(1),
            points: (0..n)
                .map(|i| (i as f64 * dt, Some(f(i as f64 * dt, i))))
                .collect(),
            gaps: Vec::new(),
        }
    }

    fn label(s: &Series) -> Label {
        judge(s, 0.0, &Thresholds::default()).label
    }

    #[test]
    fn theil_sen_ignores_outliers() {
        let t: Vec<f64> = (0..50).map(|i| i as f64).collect();
        let mut v: Vec<f64> = t.iter().map(|t| 3.0 * t + 10.0).collect();
        v[7] = 1e9;
        v[30] = -1e9;
        let (b, a) = theil_sen(&t, &v);
        assert!((b - 3.0).abs() < 1e-9, "{b}");
        assert!((a - 10.0).abs() < 1e-6, "{a}");
    }

    #[test]
    fn theil_sen_samples_pairs_on_long_series() {
        let t: Vec<f64> = (0..5000).map(|i| i as f64).collect();
        let v: Vec<f64> = t
            .iter()
            .enumerate()
            .map(|(i, t)| 2.0 * t + noise(i))
            .collect();
        let (b, _) = theil_sen(&t, &v);
        assert!((b - 2.0).abs() < 0.01, "{b}");
    }

    #[test]
    fn flat_with_noise_is_stable() {
        let s = series(|_, i| 100.0 * MIB + 64.0 * 1024.0 * noise(i), 600, 1.0);
        assert_eq!(label(&s), Label::Stable);
    }

    #[test]
    fn one_mib_per_minute_is_growth() {
        let s = series(
            |t, i| 100.0 * MIB + MIB * t / 60.0 + 64.0 * 1024.0 * noise(i),
            600,
            1.0,
        );
        let v = judge(&s, 0.0, &Thresholds::default());
        assert_eq!(v.label, Label::Growth);
        assert!(
            (v.slope_per_hour / MIB - 60.0).abs() < 2.0,
            "{}",
            v.slope_per_hour
        );
    }

    #[test]
    fn tiny_steady_growth_is_slow_growth() {
        // 2 MiB/h over 2 h on 50 MiB, noise 16 KiB.
        let s = series(
            |t, i| 50.0 * MIB + 2.0 * MIB * t / 3600.0 + 16.0 * 1024.0 * noise(i),
            720,
            10.0,
        );
        assert_eq!(label(&s), Label::SlowGrowth);
    }

    #[test]
    fn one_step_is_jump() {
        let s = series(
            |t, i| {
                100.0 * MIB + if t >= 300.0 { 50.0 * MIB } else { 0.0 } + 32.0 * 1024.0 * noise(i)
            },
            600,
            1.0,
        );
        let v = judge(&s, 0.0, &Thresholds::default());
        assert_eq!(v.label, Label::Jump);
        assert_eq!(v.steps.len(), 1);
        assert!((v.steps[0].t_s - 300.0).abs() <= 1.0);
        assert!((v.steps[0].size / MIB - 50.0).abs() < 1.0);
    }

    #[test]
    fn sawtooth_with_flat_trend_is_jitter() {
        for period in [37.0, 60.0, 150.0, 200.0] {
            let s = series(
                |t, i| {
                    100.0 * MIB + 20.0 * MIB * ((t % period) / period) + 16.0 * 1024.0 * noise(i)
                },
                600,
                1.0,
            );
            let v = judge(&s, 0.0, &Thresholds::default());
            assert_eq!(v.label, Label::Jitter, "period {period}: {v:?}");
        }
    }

    #[test]
    fn staircase_leak_is_growth_not_jump() {
        // 4 MiB every 20 s: a leak sampled finer than it happens.
        let s = series(
            |t, _| 100.0 * MIB + 4.0 * MIB * (t / 20.0).floor(),
            600,
            1.0,
        );
        assert_eq!(label(&s), Label::Growth);
    }

    #[test]
    fn step_down_and_decrease_are_not_leaks() {
        let s = series(
            |t, _| if t < 300.0 { 200.0 * MIB } else { 100.0 * MIB },
            600,
            1.0,
        );
        let v = judge(&s, 0.0, &Thresholds::default());
        assert_ne!(v.label, Label::Jump);
        assert_eq!(v.steps.len(), 1);
        let s = series(|t, _| 200.0 * MIB - MIB * t / 60.0, 600, 1.0);
        assert_eq!(label(&s), Label::Shrink);
    }

    #[test]
    fn counts_and_short_series() {
        let mut s = series(|t, _| 10.0 + (t * 2.0).floor(), 100, 0.1);
        s.unit = Unit::Count;
        assert_eq!(label(&s), Label::Growth);
        let s = series(|_, _| 1.0, 4, 1.0);
        assert_eq!(label(&s), Label::TooShort);
        let s = series(|_, _| 0.0, 40, 1.0);
        assert_eq!(label(&s), Label::Stable);
    }

    #[test]
    fn warmup_points_are_ignored() {
        let s = series(
            |t, _| if t < 10.0 { t * MIB } else { 100.0 * MIB },
            100,
            1.0,
        );
        assert_eq!(judge(&s, 10.0, &Thresholds::default()).label, Label::Stable);
    }
}
