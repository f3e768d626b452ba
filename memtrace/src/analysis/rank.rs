//! Ordering sites by how suspicious they are: growing sites first (fastest
//! growth first), then new sites by live bytes, those whose live blocks
//! piled up steadily through the trace weighted [`ACCUMULATING_WEIGHT`]
//! times (too few intervals to judge, but the blocks say they grow), then
//! stable and shrinking sites (most live bytes first within each); within a
//! class, sites the allocator's own library allocated for itself (thread
//! stacks, arenas, stdio buffers) come last.
//!
//! So a flat site never outranks a growing one of comparable bytes: a cache
//! made once at start-up and a site leaking every request, both still `new`
//! in a short trace, rank the leak first unless the cache holds more than
//! [`ACCUMULATING_WEIGHT`] times its bytes; and a megabyte kept at the end
//! of a short script is not buried under hundreds of start-up sites of a
//! few hundred bytes each that were made while the script loaded.

use std::cmp::Ordering;

use super::trend::Trend;

/// How many times its live bytes a `new` site whose blocks piled up
/// steadily counts for, against a `new` site whose blocks did not.
pub const ACCUMULATING_WEIGHT: f64 = 16.0;

/// Sort key: ascending order puts the most suspicious site first
/// (`sites.sort_by_key(|s| suspicion_rank(..))`).
#[derive(Clone, Copy, Debug)]
pub struct SuspicionRank {
    class: u8,
    internal: bool,
    /// Growth rate for a growing site; live bytes, weighted when
    /// accumulating, for a new one; live bytes otherwise. Finite.
    score: f64,
    /// The accumulation rate of an accumulating new site (0 otherwise):
    /// breaks ties of equal scores.
    rate: f64,
    live_bytes: u64,
}

/// The sort key of a site; see [`SuspicionRank`]. `accumulation_bytes_per_s`:
/// how fast its live blocks piled up (see
/// [`super::trend::accumulation_rate`]), used for a `new` site only.
pub fn suspicion_rank(
    trend: Trend,
    growth_bytes_per_s: f64,
    accumulation_bytes_per_s: Option<f64>,
    live_bytes: u64,
    internal: bool,
) -> SuspicionRank {
    let accumulating = accumulation_bytes_per_s.filter(|r| r.is_finite() && *r > 0.0);
    let bytes = live_bytes as f64;
    let (class, score, rate) = match (trend, accumulating) {
        (Trend::Growing, _) => (0, growth_bytes_per_s, 0.0),
        (Trend::New, Some(rate)) => (1, bytes * ACCUMULATING_WEIGHT, rate),
        (Trend::New, None) => (1, bytes, 0.0),
        (Trend::Stable, _) => (2, bytes, 0.0),
        (Trend::Shrinking, _) => (3, bytes, 0.0),
    };
    SuspicionRank {
        class,
        internal,
        score: if score.is_finite() { score } else { 0.0 },
        rate,
        live_bytes,
    }
}

impl Ord for SuspicionRank {
    fn cmp(&self, other: &Self) -> Ordering {
        self.class
            .cmp(&other.class)
            .then(self.internal.cmp(&other.internal))
            .then(other.score.total_cmp(&self.score))
            .then(other.rate.total_cmp(&self.rate))
            .then(other.live_bytes.cmp(&self.live_bytes))
    }
}

impl PartialOrd for SuspicionRank {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for SuspicionRank {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for SuspicionRank {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::trend::accumulation_rate;

    #[test]
    fn growing_by_rate_then_new_stable_shrinking_by_bytes() {
        let mut sites = [
            ("shrinking-big", Trend::Shrinking, -50.0, 1 << 30),
            ("stable-small", Trend::Stable, 0.0, 100),
            ("growing-slow-big", Trend::Growing, 10.0, 1 << 30),
            ("new", Trend::New, 999_999.0, 10),
            ("stable-big", Trend::Stable, 3.0, 1 << 20),
            ("growing-fast-small", Trend::Growing, 1000.0, 64),
            ("growing-nan", Trend::Growing, f64::NAN, 5),
            ("shrinking-small", Trend::Shrinking, -1.0, 1),
        ];
        sites.sort_by_key(|&(_, trend, rate, bytes)| {
            suspicion_rank(trend, rate, None, bytes, false)
        });
        let names: Vec<&str> = sites.iter().map(|s| s.0).collect();
        assert_eq!(
            names,
            [
                "growing-fast-small",
                "growing-slow-big",
                "growing-nan",
                "new",
                "stable-big",
                "stable-small",
                "shrinking-big",
                "shrinking-small",
            ]
        );
    }

    #[test]
    fn equal_keys_compare_equal() {
        assert_eq!(
            suspicion_rank(Trend::Stable, 5.0, None, 10, false),
            suspicion_rank(Trend::Stable, -7.0, None, 10, false)
        );
        assert!(
            suspicion_rank(Trend::Growing, 1.0, None, 0, false)
                < suspicion_rank(Trend::New, 0.0, None, u64::MAX, false)
        );
        // Allocator-internal sites last within their class, not below it.
        assert!(
            suspicion_rank(Trend::Stable, 0.0, None, 1, false)
                < suspicion_rank(Trend::Stable, 0.0, None, 1 << 30, true)
        );
        assert!(
            suspicion_rank(Trend::Growing, 1.0, None, 1, true)
                < suspicion_rank(Trend::Stable, 0.0, None, 1 << 30, false)
        );
    }

    /// `(alloc t_s, size)` of `count` blocks of `size`, one every `every_s`
    /// from `from_s`.
    fn steady(count: usize, size: u64, from_s: f64, every_s: f64) -> Vec<(f64, u64)> {
        (0..count)
            .map(|i| (from_s + every_s * i as f64, size))
            .collect()
    }

    /// The site's rank as the report computes it from its blocks.
    fn rank_of(blocks: &[(f64, u64)], trend: Trend, trace_s: f64) -> SuspicionRank {
        let bytes = blocks.iter().map(|b| b.1).sum();
        suspicion_rank(trend, 0.0, accumulation_rate(blocks, trace_s), bytes, false)
    }

    #[test]
    fn the_demos_leak_outranks_its_cache_while_both_are_new() {
        // leaky_demo 400: warm_cache keeps 16 x 4096 made at start;
        // format_response leaks 256 B every 4th request of ~5 ms (100
        // blocks over ~2 s). Two intervals: both still `new`.
        let trace_s = 2.1;
        let cache = steady(16, 4096, 0.002, 0.000_01);
        let leak = steady(100, 256, 0.025, 0.0202);
        assert!(accumulation_rate(&cache, trace_s).is_none());
        let rate = accumulation_rate(&leak, trace_s).expect("the leak accumulates");
        assert!((10_000.0..16_000.0).contains(&rate), "{rate}");
        assert!(rank_of(&leak, Trend::New, trace_s) < rank_of(&cache, Trend::New, trace_s));
        // Judged (three intervals): growing against stable, the same order.
        assert!(rank_of(&leak, Trend::Growing, trace_s) < rank_of(&cache, Trend::Stable, trace_s));
        // The cache does not outrank the leak at ten times its bytes...
        let big_cache = steady(64, 4096, 0.002, 0.000_01);
        assert!(rank_of(&leak, Trend::New, trace_s) < rank_of(&big_cache, Trend::New, trace_s));
        assert!(rank_of(&leak, Trend::New, trace_s) < rank_of(&big_cache, Trend::Stable, trace_s));
        // ...but bytes that are not comparable (32 times) do, while both are new.
        let huge_cache = steady(200, 4096, 0.002, 0.000_01);
        assert!(rank_of(&huge_cache, Trend::New, trace_s) < rank_of(&leak, Trend::New, trace_s));
    }

    #[test]
    fn accumulating_new_sites_count_their_bytes_weighted_between_growing_and_stable() {
        let growing = suspicion_rank(Trend::Growing, 1.0, None, 1, false);
        let accumulating = suspicion_rank(Trend::New, 0.0, Some(100.0), 1000, false);
        let faster = suspicion_rank(Trend::New, 0.0, Some(1000.0), 1000, false);
        let flat_comparable = suspicion_rank(Trend::New, 0.0, None, 15_000, false);
        let flat_far_bigger = suspicion_rank(Trend::New, 0.0, None, 17_000, false);
        let stable = suspicion_rank(Trend::Stable, 0.0, Some(5000.0), 1 << 30, false);
        assert!(growing < flat_far_bigger);
        assert!(
            faster < accumulating,
            "equal bytes: the faster pile-up first"
        );
        assert!(accumulating < flat_comparable);
        assert!(flat_far_bigger < accumulating);
        assert!(accumulating < stable && flat_far_bigger < stable);
        // Non-finite or non-positive rates are no evidence.
        for rate in [f64::NAN, f64::INFINITY, 0.0, -5.0] {
            assert_eq!(
                suspicion_rank(Trend::New, 0.0, Some(rate), 7, false),
                suspicion_rank(Trend::New, 0.0, None, 7, false)
            );
        }
    }

    #[test]
    fn a_megabyte_kept_at_the_end_of_a_script_outranks_its_start_up() {
        // A short Python script traced from launch: ~300 start-up sites of
        // about a kilobyte each, their blocks made all through the trace
        // while it imported, a few single large blocks (arenas) made
        // part-way, then the script's own 10 x 100 kB kept in a burst at
        // the end (kernel matrix, leak.py: 1.3 s under TCG).
        let trace_s = 1.3;
        let mut sites: Vec<(&str, SuspicionRank)> = (0..300)
            .map(|i| {
                let blocks = steady(8, 128, 0.01 + 0.001 * f64::from(i), 0.15);
                ("start-up", rank_of(&blocks, Trend::New, trace_s))
            })
            .collect();
        for (k, size) in [(0.4, 262_144), (0.55, 131_072), (0.2, 65_536)] {
            let single = [(k, size)];
            assert!(accumulation_rate(&single, trace_s).is_none(), "one block");
            sites.push(("arena", rank_of(&single, Trend::New, trace_s)));
        }
        let kept = steady(10, 100_001, 1.25, 0.003);
        assert!(accumulation_rate(&kept, trace_s).is_none(), "a burst");
        sites.push(("kept", rank_of(&kept, Trend::New, trace_s)));
        sites.sort_by_key(|s| s.1);
        assert_eq!(sites[0].0, "kept");
        assert!(sites[1..4].iter().all(|s| s.0 == "arena"));
    }

    #[test]
    fn a_late_burst_or_a_churning_cache_is_not_accumulating() {
        // 64 blocks all made in the last tenth of a 10 s trace (a cache
        // whose older entries were replaced): no steady pile-up.
        let late = steady(64, 1024, 9.0, 0.01);
        assert!(accumulation_rate(&late, 10.0).is_none());
        // A leak that started halfway and kept going is.
        let half = steady(50, 1024, 5.0, 0.1);
        assert!(accumulation_rate(&half, 10.0).is_some());
        // One block made halfway is a single step, however large.
        assert!(accumulation_rate(&[(5.0, 1 << 20)], 10.0).is_none());
        // A few blocks spread over the trace are a pile-up.
        let spread = steady(4, 1 << 20, 1.0, 2.5);
        assert!(accumulation_rate(&spread, 10.0).is_some());
        assert!(accumulation_rate(&[], 10.0).is_none());
        assert!(accumulation_rate(&half, 0.0).is_none());
        assert!(accumulation_rate(&half, f64::NAN).is_none());
    }
}
