//! Trend of one allocation site's live bytes over the trace intervals:
//! `growing` (a leak candidate), `stable` (pools, caches, resident weights),
//! `shrinking`, or `new` (too few intervals to judge), with a robust growth
//! rate (Theil–Sen slope). Also how many interval ends a block survived,
//! and, for a site with too few intervals to judge, whether its live blocks
//! piled up through the trace ([`accumulation_rate`]).
//!
//! Pure functions; the thresholds are the constants below.

use serde::{Deserialize, Serialize};

use crate::stats::{median, robust_sigma, theil_sen};

/// Fewest intervals, after warm-up, that can be judged; fewer is [`Trend::New`].
pub const MIN_JUDGED_INTERVALS: usize = 3;
/// Smallest change over the judged window that counts as growth or shrinkage, bytes.
pub const MIN_CHANGE_BYTES: f64 = 256.0;
/// Smallest change that counts, as a fraction of the site's median live bytes
/// (a 1 GiB weight buffer that gains 1 KiB is not growing).
pub const MIN_CHANGE_REL: f64 = 0.02;
/// The change over the window must also exceed this many robust sigmas of
/// the residuals around the fitted line (noise).
pub const NOISE_K: f64 = 3.0;
/// Fraction of interval-to-interval steps that must go the trend's way or
/// stay flat (a leak keeps rising; a sawtooth cache does not).
pub const MIN_MONOTONE_STEP_FRACTION: f64 = 0.6;
/// The edges of the window (medians of the first and last quarter of the
/// points) must differ by at least this fraction of the required change.
pub const EDGE_CHANGE_FRACTION: f64 = 0.5;

/// What a site's live bytes are doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Trend {
    /// Keeps rising across intervals: a leak candidate.
    Growing,
    /// Flat: pools, caches, weights allocated once.
    Stable,
    /// Clearly falling.
    Shrinking,
    /// Too few intervals after warm-up to judge.
    New,
}

impl Trend {
    pub fn as_str(self) -> &'static str {
        match self {
            Trend::Growing => "growing",
            Trend::Stable => "stable",
            Trend::Shrinking => "shrinking",
            Trend::New => "new",
        }
    }
}

impl std::fmt::Display for Trend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The judgment of one series.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TrendVerdict {
    pub trend: Trend,
    /// Theil–Sen slope of live bytes over time (negative when shrinking);
    /// computed whenever two points with distinct times remain, else 0.
    pub growth_bytes_per_s: f64,
    /// Intervals judged (after warm-up, non-finite points dropped).
    pub intervals: usize,
}

/// Classifies a site's `(t_s, live_bytes)` series, oldest first, ignoring the
/// first `warmup` points. Non-finite points are dropped.
pub fn classify_trend(series: &[(f64, f64)], warmup: usize) -> TrendVerdict {
    let points: Vec<(f64, f64)> = series
        .iter()
        .skip(warmup)
        .copied()
        .filter(|(t, v)| t.is_finite() && v.is_finite())
        .collect();
    let n = points.len();
    let (slope, intercept) = theil_sen(&points);
    let verdict = |trend| TrendVerdict {
        trend,
        growth_bytes_per_s: slope,
        intervals: n,
    };
    let (Some(&(t_first, _)), Some(&(t_last, _))) = (points.first(), points.last()) else {
        return verdict(Trend::New);
    };
    let span = t_last - t_first;
    if n < MIN_JUDGED_INTERVALS || span <= 0.0 {
        return verdict(Trend::New);
    }

    let values: Vec<f64> = points.iter().map(|&(_, v)| v).collect();
    let residuals: Vec<f64> = points
        .iter()
        .map(|&(t, v)| v - (intercept + slope * t))
        .collect();
    let noise = robust_sigma(&residuals);
    let level = median(&mut values.iter().map(|v| v.abs()).collect::<Vec<_>>());
    let required = MIN_CHANGE_BYTES
        .max(MIN_CHANGE_REL * level)
        .max(NOISE_K * noise);

    let change = slope * span;
    let edge = (n / 4).max(1);
    let first = median(&mut values[..edge].to_vec());
    let last = median(&mut values[n - edge..].to_vec());
    let edge_change = last - first;

    let steps = n - 1;
    let rising = values.windows(2).filter(|w| w[1] >= w[0]).count();
    let falling = values.windows(2).filter(|w| w[1] <= w[0]).count();
    let share = |k: usize| k as f64 / steps as f64;

    if change >= required
        && edge_change >= EDGE_CHANGE_FRACTION * required
        && share(rising) >= MIN_MONOTONE_STEP_FRACTION
    {
        verdict(Trend::Growing)
    } else if -change >= required
        && -edge_change >= EDGE_CHANGE_FRACTION * required
        && share(falling) >= MIN_MONOTONE_STEP_FRACTION
    {
        verdict(Trend::Shrinking)
    } else {
        verdict(Trend::Stable)
    }
}

/// Points of the survivor curve [`accumulation_rate`] judges.
pub const ACCUMULATION_POINTS: usize = 8;
/// Fewest steps of that curve that must rise for a pile-up: one block, or
/// one burst, made part-way through a trace is a single step (start-up
/// state, not a site that keeps allocating).
pub const MIN_ACCUMULATION_RISES: usize = 3;

/// How fast a site's live blocks piled up, bytes per second, when they did
/// so steadily through the trace: its survivor curve (the bytes of the
/// blocks still live that had been made by each time), sampled at
/// [`ACCUMULATION_POINTS`] even times over `0..=trace_duration_s`, is judged
/// as a series would be ([`classify_trend`]). `None` when the curve is not
/// growing: blocks made at start-up and kept (a cache, a pool) give a flat
/// curve, a churning cache's survivors are all recent (a late jump the
/// robust slope ignores). Only the live blocks are seen, so this tells a
/// site with too few intervals apart, not a judged one (whose freed blocks
/// the intervals saw). The curve must also rise in at least
/// [`MIN_ACCUMULATION_RISES`] of its steps: a single block or burst made
/// part-way through is one step (Theil–Sen alone would call a step in the
/// middle growth). `blocks`: `(alloc t_s, size)`, times on the trace's
/// clock; non-finite times are ignored, later ones count at the end.
pub fn accumulation_rate(blocks: &[(f64, u64)], trace_duration_s: f64) -> Option<f64> {
    if !trace_duration_s.is_finite() || trace_duration_s <= 0.0 {
        return None;
    }
    let mut made: Vec<(f64, u64)> = blocks
        .iter()
        .copied()
        .filter(|(t, _)| t.is_finite())
        .collect();
    made.sort_by(|a, b| a.0.total_cmp(&b.0));
    let step = trace_duration_s / (ACCUMULATION_POINTS - 1) as f64;
    let mut curve = Vec::with_capacity(ACCUMULATION_POINTS);
    let (mut next, mut bytes) = (0, 0u64);
    for k in 0..ACCUMULATION_POINTS {
        let t = if k + 1 == ACCUMULATION_POINTS {
            f64::INFINITY
        } else {
            step * k as f64
        };
        while let Some(&(at, size)) = made.get(next) {
            if at > t {
                break;
            }
            bytes = bytes.saturating_add(size);
            next += 1;
        }
        curve.push((step * k as f64, bytes as f64));
    }
    let rises = curve.windows(2).filter(|w| w[1].1 > w[0].1).count();
    let verdict = classify_trend(&curve, 0);
    (rises >= MIN_ACCUMULATION_RISES
        && verdict.trend == Trend::Growing
        && verdict.growth_bytes_per_s > 0.0)
        .then_some(verdict.growth_bytes_per_s)
}

/// How many interval ends a block allocated at `oldest_alloc_t_s` was live
/// at: the ends at or after the allocation (non-finite ends ignored).
pub fn survived_intervals(oldest_alloc_t_s: f64, interval_ends: &[f64]) -> u64 {
    if !oldest_alloc_t_s.is_finite() {
        return 0;
    }
    interval_ends
        .iter()
        .filter(|end| end.is_finite() && **end >= oldest_alloc_t_s)
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic noise in [-amp, amp].
    fn noise(i: usize, amp: f64) -> f64 {
        let x = (i as u64)
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let unit = (x >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
        (unit * 2.0 - 1.0) * amp
    }

    /// One point per second.
    fn series(n: usize, f: impl Fn(usize) -> f64) -> Vec<(f64, f64)> {
        (0..n).map(|i| (i as f64, f(i))).collect()
    }

    #[test]
    fn leak_of_1kib_per_interval_with_noise_is_growing() {
        let s = series(30, |i| 50_000.0 + 1024.0 * i as f64 + noise(i, 300.0));
        let v = classify_trend(&s, 2);
        assert_eq!(v.trend, Trend::Growing);
        assert!(
            (v.growth_bytes_per_s - 1024.0).abs() < 100.0,
            "{}",
            v.growth_bytes_per_s
        );
        assert_eq!(v.intervals, 28);
    }

    #[test]
    fn startup_pool_then_flat_is_stable() {
        // Empty before the pool is made, then 64 MiB for good.
        let s = series(40, |i| if i == 0 { 0.0 } else { 64.0 * 1048576.0 });
        for warmup in [0, 1, 3] {
            let v = classify_trend(&s, warmup);
            assert_eq!(v.trend, Trend::Stable, "warmup {warmup}");
            assert_eq!(v.growth_bytes_per_s, 0.0);
        }
    }

    #[test]
    fn flat_with_noise_is_stable() {
        let s = series(50, |i| 1_000_000.0 + noise(i, 5_000.0));
        assert_eq!(classify_trend(&s, 0).trend, Trend::Stable);
    }

    #[test]
    fn sawtooth_cache_is_stable() {
        // Fills by 10 KiB per interval, evicted every 5 intervals.
        let s = series(60, |i| 10_240.0 * (i % 5) as f64);
        assert_eq!(classify_trend(&s, 0).trend, Trend::Stable);
    }

    #[test]
    fn draining_series_is_shrinking() {
        let s = series(20, |i| 1_000_000.0 - 40_000.0 * i as f64 + noise(i, 1000.0));
        let v = classify_trend(&s, 0);
        assert_eq!(v.trend, Trend::Shrinking);
        assert!(
            (v.growth_bytes_per_s + 40_000.0).abs() < 2000.0,
            "{}",
            v.growth_bytes_per_s
        );
    }

    #[test]
    fn two_points_after_warmup_is_new() {
        let s = series(2, |i| 1024.0 * i as f64);
        let v = classify_trend(&s, 0);
        assert_eq!(v.trend, Trend::New);
        assert_eq!(v.growth_bytes_per_s, 1024.0);
        // Five points but three of them are warm-up.
        assert_eq!(
            classify_trend(&series(5, |i| i as f64), 3).trend,
            Trend::New
        );
        assert_eq!(classify_trend(&[], 0).trend, Trend::New);
    }

    #[test]
    fn tiny_growth_on_a_big_level_is_stable() {
        // 10 B per interval on 1 GiB: far below MIN_CHANGE_REL.
        let s = series(30, |i| 1_073_741_824.0 + 10.0 * i as f64);
        assert_eq!(classify_trend(&s, 0).trend, Trend::Stable);
    }

    #[test]
    fn staircase_leak_is_growing() {
        // 64 KiB every fourth interval: most steps flat, none falling.
        let s = series(40, |i| 65_536.0 * (i / 4) as f64);
        assert_eq!(classify_trend(&s, 0).trend, Trend::Growing);
    }

    #[test]
    fn non_finite_points_are_dropped() {
        let mut s = series(10, |i| 4096.0 * i as f64);
        s[4].1 = f64::NAN;
        let v = classify_trend(&s, 0);
        assert_eq!((v.trend, v.intervals), (Trend::Growing, 9));
    }

    #[test]
    fn trend_serializes_kebab_case() {
        let json =
            serde_json::to_string(&[Trend::Growing, Trend::Stable, Trend::Shrinking, Trend::New])
                .expect("serializes");
        assert_eq!(json, r#"["growing","stable","shrinking","new"]"#);
        assert_eq!(Trend::Shrinking.to_string(), "shrinking");
    }

    #[test]
    fn survived_intervals_counts_ends_at_or_after_the_allocation() {
        let ends = [1.0, 2.0, 3.0, 4.0, f64::NAN];
        assert_eq!(survived_intervals(0.5, &ends), 4);
        assert_eq!(survived_intervals(2.0, &ends), 3);
        assert_eq!(survived_intervals(2.5, &ends), 2);
        assert_eq!(survived_intervals(9.0, &ends), 0);
        assert_eq!(survived_intervals(f64::NAN, &ends), 0);
    }
}
