//! Ordering sites by how suspicious they are: growing sites first (fastest
//! growth first), then new, stable and shrinking sites (most live bytes
//! first within each); within a class, sites the allocator's own library
//! allocated for itself (thread stacks, arenas, stdio buffers) come last.

use std::cmp::Ordering;

use super::trend::Trend;

/// Sort key: ascending order puts the most suspicious site first
/// (`sites.sort_by_key(|s| suspicion_rank(..))`).
#[derive(Clone, Copy, Debug)]
pub struct SuspicionRank {
    class: u8,
    internal: bool,
    /// Growth rate (growing sites only; 0 otherwise), finite.
    rate: f64,
    live_bytes: u64,
}

/// The sort key of a site; see [`SuspicionRank`].
pub fn suspicion_rank(
    trend: Trend,
    growth_bytes_per_s: f64,
    live_bytes: u64,
    internal: bool,
) -> SuspicionRank {
    let class = match trend {
        Trend::Growing => 0,
        Trend::New => 1,
        Trend::Stable => 2,
        Trend::Shrinking => 3,
    };
    let rate = if trend == Trend::Growing && growth_bytes_per_s.is_finite() {
        growth_bytes_per_s
    } else {
        0.0
    };
    SuspicionRank {
        class,
        internal,
        rate,
        live_bytes,
    }
}

impl Ord for SuspicionRank {
    fn cmp(&self, other: &Self) -> Ordering {
        self.class
            .cmp(&other.class)
            .then(self.internal.cmp(&other.internal))
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
        sites.sort_by_key(|&(_, trend, rate, bytes)| suspicion_rank(trend, rate, bytes, false));
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
            suspicion_rank(Trend::Stable, 5.0, 10, false),
            suspicion_rank(Trend::Stable, -7.0, 10, false)
        );
        assert!(
            suspicion_rank(Trend::Growing, 1.0, 0, false)
                < suspicion_rank(Trend::New, 0.0, u64::MAX, false)
        );
        // Allocator-internal sites last within their class, not below it.
        assert!(
            suspicion_rank(Trend::Stable, 0.0, 1, false)
                < suspicion_rank(Trend::Stable, 0.0, 1 << 30, true)
        );
        assert!(
            suspicion_rank(Trend::Growing, 1.0, 1, true)
                < suspicion_rank(Trend::Stable, 0.0, 1 << 30, false)
        );
    }
}
