//! Leak judgment: which allocation sites are leaking, how fast, and what kind
//! of bug they probably are, plus the `--suppress` allow-lists.
//!
//! - [`trend`]: growing / stable / shrinking / new from a site's live-bytes
//!   series, with a Theil–Sen growth rate;
//! - [`pattern`]: per-iteration / small-accumulating / large-once from the
//!   site's live blocks;
//! - [`suppress`]: parsing and matching suppression files;
//! - [`rank`]: the order sites are reported in;
//! - [`SiteSeries`] (here): the bounded per-site series the trend is judged on.
//!
//! Everything here is pure (no I/O but [`Suppressions::load`]) and unit-tested.

// Not wired into tracing/reporting yet; drop this once it is.

pub mod history;
pub mod pattern;
pub mod rank;
pub mod suppress;
pub mod trend;

use std::collections::HashMap;
use std::hash::Hash;

pub use pattern::{classify, Pattern};
pub use rank::suspicion_rank;
pub use suppress::{BlockFacts, Suppressions};
pub use trend::{accumulation_rate, classify_trend, survived_intervals, Trend, TrendVerdict};

/// Most points kept per site; beyond that, the resolution is halved. 512
/// points (20 KiB a site) are plenty for a robust trend; the 30-minute soak
/// showed 4096 made memtrace's memory step up for an hour before it levelled.
pub const MAX_POINTS_PER_SITE: usize = 512;
/// Smallest per-site bound [`SiteSeries::with_max_points`] accepts.
const MIN_MAX_POINTS: usize = 4;

#[derive(Clone, Debug)]
struct Track {
    /// `(t_s, live_bytes)`.
    bytes: Vec<(f64, f64)>,
    /// `(t_s, live_count)`, same times as `bytes`.
    counts: Vec<(f64, f64)>,
    /// Intervals merged into each point.
    weights: Vec<u64>,
    /// Intervals per full point (a power of two).
    stride: u64,
    /// Consecutive intervals the site has been empty.
    idle: u64,
}

impl Default for Track {
    fn default() -> Self {
        Track {
            bytes: Vec::new(),
            counts: Vec::new(),
            weights: Vec::new(),
            stride: 1,
            idle: 0,
        }
    }
}

impl Track {
    fn push(&mut self, t_s: f64, bytes: f64, count: f64, max_points: usize) {
        if self.weights.last().is_some_and(|&w| w >= self.stride)
            && self.weights.len() >= max_points
        {
            self.halve();
        }
        match (
            self.weights.last_mut(),
            self.bytes.last_mut(),
            self.counts.last_mut(),
        ) {
            (Some(w), Some(b), Some(c)) if *w < self.stride => {
                *b = merge(*b, *w, (t_s, bytes), 1);
                *c = merge(*c, *w, (t_s, count), 1);
                *w += 1;
            }
            _ => {
                self.bytes.push((t_s, bytes));
                self.counts.push((t_s, count));
                self.weights.push(1);
            }
        }
    }

    /// Merges adjacent pairs, oldest first, and doubles the stride.
    fn halve(&mut self) {
        let pairs = |v: &[(f64, f64)], w: &[u64]| -> Vec<(f64, f64)> {
            v.chunks(2)
                .zip(w.chunks(2))
                .map(|(p, w)| match (p, w) {
                    ([a, b], [wa, wb]) => merge(*a, *wa, *b, *wb),
                    _ => p.first().copied().unwrap_or((0.0, 0.0)),
                })
                .collect()
        };
        self.bytes = pairs(&self.bytes, &self.weights);
        self.counts = pairs(&self.counts, &self.weights);
        self.weights = self.weights.chunks(2).map(|w| w.iter().sum()).collect();
        self.stride = self.stride.saturating_mul(2);
    }
}

/// Weighted average of two `(t, value)` points.
fn merge(a: (f64, f64), wa: u64, b: (f64, f64), wb: u64) -> (f64, f64) {
    let (wa, wb) = (wa as f64, wb as f64);
    let total = wa + wb;
    ((a.0 * wa + b.0 * wb) / total, (a.1 * wa + b.1 * wb) / total)
}

/// Per-site series of live bytes and counts, one point per interval, each
/// bounded to `max_points`: when a site's series is full, adjacent pairs are
/// merged (times and values averaged, oldest first) and later intervals are
/// averaged in groups of the same size, so every point covers the same number
/// of intervals (uniform weight for the trend fit) and memory stays bounded
/// over hours. The newest point may cover fewer intervals.
#[derive(Clone, Debug)]
pub struct SiteSeries<K> {
    tracks: HashMap<K, Track>,
    max_points: usize,
}

impl<K: Hash + Eq + Clone> Default for SiteSeries<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Hash + Eq + Clone> SiteSeries<K> {
    /// Bounded to [`MAX_POINTS_PER_SITE`] points per site.
    pub fn new() -> Self {
        Self::with_max_points(MAX_POINTS_PER_SITE)
    }

    /// Bounded to `max_points` per site (at least 4).
    pub fn with_max_points(max_points: usize) -> Self {
        SiteSeries {
            tracks: HashMap::new(),
            max_points: max_points.max(MIN_MAX_POINTS),
        }
    }

    /// Adds one interval's point for `key`. Non-finite times are ignored.
    pub fn record(&mut self, key: &K, t_s: f64, live_bytes: u64, live_count: u64) {
        if !t_s.is_finite() {
            return;
        }
        let max = self.max_points;
        let track = self.tracks.entry(key.clone()).or_default();
        track.push(t_s, live_bytes as f64, live_count as f64, max);
        track.idle = if live_bytes == 0 && live_count == 0 {
            track.idle + 1
        } else {
            0
        };
    }

    /// Forgets the sites empty for the last `intervals` intervals, so the
    /// number of tracks follows the sites that hold memory, not every site
    /// ever seen. A site that comes back starts a new series.
    pub fn forget_idle(&mut self, intervals: u64) {
        self.tracks.retain(|_, track| track.idle < intervals);
    }

    /// `(t_s, live_bytes)` of `key`, oldest first.
    pub fn series(&self, key: &K) -> Option<&[(f64, f64)]> {
        self.tracks.get(key).map(|t| t.bytes.as_slice())
    }

    /// `(t_s, live_count)` of `key`, oldest first.
    #[cfg(test)]
    pub fn count_series(&self, key: &K) -> Option<&[(f64, f64)]> {
        self.tracks.get(key).map(|t| t.counts.as_slice())
    }

    /// Forgets a site.
    #[cfg(test)]
    pub fn remove(&mut self, key: &K) {
        self.tracks.remove(key);
    }

    /// Keeps only the sites `keep` accepts (bounds the number of sites).
    #[cfg(test)]
    pub fn retain(&mut self, mut keep: impl FnMut(&K) -> bool) {
        self.tracks.retain(|k, _| keep(k));
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.tracks.keys()
    }

    /// Number of sites.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.tracks.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.tracks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn site_series_records_per_key() {
        let mut s: SiteSeries<(u8, u32)> = SiteSeries::new();
        s.record(&(0, 1), 1.0, 100, 1);
        s.record(&(0, 1), 2.0, 200, 2);
        s.record(&(0, 2), 1.0, 7, 1);
        s.record(&(0, 2), f64::NAN, 9, 1);
        assert_eq!(s.series(&(0, 1)), Some(&[(1.0, 100.0), (2.0, 200.0)][..]));
        assert_eq!(s.count_series(&(0, 1)), Some(&[(1.0, 1.0), (2.0, 2.0)][..]));
        assert_eq!(s.series(&(0, 2)).map(<[_]>::len), Some(1));
        assert_eq!(s.series(&(9, 9)), None);
        assert_eq!(s.len(), 2);
        s.retain(|k| k.1 == 2);
        assert_eq!(s.keys().collect::<Vec<_>>(), [&(0, 2)]);
        s.remove(&(0, 2));
        assert!(s.is_empty());
    }

    #[test]
    fn idle_sites_are_forgotten_and_busy_ones_kept() {
        let mut s: SiteSeries<u8> = SiteSeries::new();
        for i in 0..10u32 {
            s.record(&1, f64::from(i), 0, 0);
            s.record(&2, f64::from(i), 8, 1);
        }
        s.forget_idle(10);
        assert_eq!(s.keys().collect::<Vec<_>>(), [&2]);
        // An empty stretch shorter than the limit is kept.
        s.record(&2, 10.0, 0, 0);
        s.forget_idle(10);
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn site_series_stays_bounded_and_keeps_the_trend() {
        let mut s: SiteSeries<&str> = SiteSeries::new();
        // 8 hours of 1 s intervals of a 1 KiB/s leak.
        for i in 0..28_800u64 {
            s.record(&"leak", i as f64, 1024 * i, i);
        }
        let series = s.series(&"leak").expect("recorded");
        assert!(series.len() <= MAX_POINTS_PER_SITE, "{}", series.len());
        assert!(series.len() > MAX_POINTS_PER_SITE / 2);
        // Oldest first, newest point intact, times still increasing.
        assert!(series.windows(2).all(|w| w[0].0 < w[1].0));
        // Uniform resolution: 64 intervals per point, first and last averaged.
        assert_eq!(series.len(), 28_800 / 64);
        assert_eq!(series[0], (31.5, 1024.0 * 31.5));
        assert_eq!(series.last(), Some(&(28_767.5, 1024.0 * 28_767.5)));
        let v = classify_trend(series, 0);
        assert_eq!(v.trend, Trend::Growing);
        assert!(
            (v.growth_bytes_per_s - 1024.0).abs() < 1.0,
            "{}",
            v.growth_bytes_per_s
        );
        let counts = s.count_series(&"leak").expect("recorded");
        assert_eq!(counts.len(), series.len());
    }

    #[test]
    fn site_series_small_bound() {
        let mut s: SiteSeries<u8> = SiteSeries::with_max_points(8);
        for i in 0..1000 {
            s.record(&1, f64::from(i), 10 * i as u64, 1);
            assert!(s.series(&1).map_or(0, <[_]>::len) <= 8);
        }
        // Each point still lies on the line: averaging keeps (t, 10 t).
        let series = s.series(&1).expect("recorded");
        assert!(series.iter().all(|&(t, v)| (v - 10.0 * t).abs() < 1e-6));
        assert!(series.windows(2).all(|w| w[0].0 < w[1].0));
        // A too-small bound is raised to the minimum.
        let mut s: SiteSeries<u8> = SiteSeries::with_max_points(0);
        for i in 0..10 {
            s.record(&1, f64::from(i), 10, 1);
        }
        assert!(s.series(&1).map_or(0, <[_]>::len) <= MIN_MAX_POINTS);
    }
}
