//! What kind of leak a site's live blocks look like, from their
//! `(alloc time, size)` list and the site's trend:
//!
//! - `per-iteration`: equal-size blocks made at a steady rate (a temporary
//!   buffer never freed inside a loop, one per request). Judged first on the
//!   exact cadence of bursts (several buffers per iteration), then, when
//!   stamps are jittered, on a regular grid: a block's stamp may come up to
//!   a period, or a scan of the kernel's held table
//!   ([`PER_ITERATION_STAMP_SLACK_S`]), after its allocation (a held block
//!   is stamped when it leaves the hold), which splits and merges bursts
//!   whatever the block size;
//! - `small-accumulating`: many small blocks piling up (fragments left by
//!   split/concat paths);
//! - `large-once`: one or very few large, old blocks that are not growing (a
//!   buffer, table or model never freed). Large means large: at least
//!   [`LARGE_BLOCK_BYTES`], or at least [`LARGE_MIN_BYTES`] and a sizeable
//!   share of all the process holds ([`LARGE_SHARE_OF_PROCESS`]) — never a
//!   4 KiB stdio buffer that happens to be alone at its site.
//!
//! Pure functions; the thresholds are the constants below.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::trend::Trend;
use crate::stats::{median, theil_sen};

/// Fewest blocks of the dominant size for `per-iteration`.
pub const PER_ITERATION_MIN_BLOCKS: usize = 4;
/// Fewest periods (bursts of allocations) for `per-iteration`.
pub const PER_ITERATION_MIN_PERIODS: usize = 4;
/// Share of the blocks that must have exactly the dominant size.
pub const PER_ITERATION_MIN_DOMINANT_SHARE: f64 = 0.8;
/// Largest coefficient of variation (sigma / mean) of the periods.
pub const PER_ITERATION_MAX_PERIOD_CV: f64 = 0.5;
/// Gaps shorter than this fraction of the 90th-percentile gap join blocks
/// into one burst (several buffers leaked by the same iteration).
pub const BURST_SPLIT_FRACTION: f64 = 0.2;
/// Share of the bursts that must hold the typical (median) number of blocks.
pub const PER_ITERATION_MIN_CONSISTENT_BURSTS: f64 = 0.75;
/// Fewest blocks for the steady-grid judgment (the fallback when bursts are
/// not exact): with fewer, random arrivals fit a grid too often.
pub const PER_ITERATION_MIN_GRID_BLOCKS: usize = 16;
/// How far a block's stamp may sit from the steady grid, in periods.
pub const PER_ITERATION_MAX_GRID_DEVIATION: f64 = 1.0;
/// How late a block's stamp may be besides, seconds: a block the kernel held
/// is stamped when user space takes it, a scan or two (about 0.1 s) after it
/// was made, later when user space was busy.
pub const PER_ITERATION_STAMP_SLACK_S: f64 = 0.25;
/// The grid's allowed deviation must be at most this fraction of the active
/// span (otherwise any handful of blocks fits it).
pub const PER_ITERATION_MAX_GRID_SPAN_FRACTION: f64 = 0.25;
/// The blocks must keep coming: from the first block, they must cover at
/// least this fraction of the remaining trace (a pool made in a tight loop at
/// startup does not).
pub const PER_ITERATION_MIN_ACTIVE_FRACTION: f64 = 0.5;

/// Fewest blocks for `small-accumulating`.
pub const SMALL_MIN_BLOCKS: usize = 32;
/// Median block size below which blocks are small, bytes.
pub const SMALL_MAX_MEDIAN_BYTES: u64 = 4096;

/// Blocks this big or bigger are large, bytes (1 MiB).
pub const LARGE_BLOCK_BYTES: u64 = 1 << 20;
/// Smallest block that can count as large by its share of the process (256 KiB).
pub const LARGE_MIN_BYTES: u64 = 256 << 10;
/// A block of [`LARGE_MIN_BYTES`] or more is large when it alone holds at
/// least this share of the live bytes tracked in its process(es).
pub const LARGE_SHARE_OF_PROCESS: f64 = 0.25;
/// The large blocks must hold at least this share of the site's bytes.
pub const LARGE_SHARE_OF_SITE: f64 = 0.5;
/// Most large blocks a `large-once` site may have.
pub const LARGE_ONCE_MAX_BLOCKS: usize = 8;
/// Large blocks must have been live for at least this fraction of the trace.
pub const LARGE_ONCE_MIN_AGE_FRACTION: f64 = 0.5;

/// A leak pattern. JSON: `{"kind": "per-iteration", "period_ms": .., "bytes_per_period": ..}`,
/// `{"kind": "large-once"}`, `{"kind": "small-accumulating"}`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Pattern {
    /// Equal-size blocks at a regular period.
    PerIteration {
        /// Median time between iterations.
        period_ms: f64,
        /// Dominant block size × blocks per iteration.
        bytes_per_period: u64,
    },
    /// One or very few large, old blocks, not growing.
    LargeOnce,
    /// Many small blocks piling up.
    SmallAccumulating,
}

impl Pattern {
    #[cfg(test)]
    pub fn kind(&self) -> &'static str {
        match self {
            Pattern::PerIteration { .. } => "per-iteration",
            Pattern::LargeOnce => "large-once",
            Pattern::SmallAccumulating => "small-accumulating",
        }
    }
}

/// Classifies a site's live blocks, `(alloc t_s, size)` with times on the
/// same clock as `trace_duration_s` (seconds since tracing started);
/// `process_bytes`: the live bytes tracked in the site's process(es), all
/// sites together (what "a sizeable share" is measured against).
/// Precedence: per-iteration, small-accumulating, large-once; `None` when no
/// pattern fits (e.g. a flat pool). Blocks with non-finite times are ignored.
pub fn classify(
    blocks: &[(f64, u64)],
    trend: Trend,
    trace_duration_s: f64,
    process_bytes: u64,
) -> Option<Pattern> {
    let blocks: Vec<(f64, u64)> = blocks
        .iter()
        .copied()
        .filter(|(t, _)| t.is_finite())
        .collect();
    if blocks.is_empty() {
        return None;
    }
    per_iteration(&blocks, trend, trace_duration_s)
        .or_else(|| small_accumulating(&blocks, trend))
        .or_else(|| large_once(&blocks, trend, trace_duration_s, process_bytes))
}

/// Whether one block is large (see the module doc).
pub fn is_large(size: u64, process_bytes: u64) -> bool {
    size >= LARGE_BLOCK_BYTES
        || (size >= LARGE_MIN_BYTES && size as f64 >= LARGE_SHARE_OF_PROCESS * process_bytes as f64)
}

fn per_iteration(blocks: &[(f64, u64)], trend: Trend, trace_duration_s: f64) -> Option<Pattern> {
    if !matches!(trend, Trend::Growing | Trend::New) {
        return None;
    }
    let mut by_size: HashMap<u64, usize> = HashMap::new();
    for &(_, size) in blocks {
        *by_size.entry(size).or_insert(0) += 1;
    }
    // Most frequent size; ties go to the larger size (deterministic).
    let (size, count) = by_size
        .into_iter()
        .max_by(|a, b| a.1.cmp(&b.1).then(a.0.cmp(&b.0)))?;
    if size == 0
        || count < PER_ITERATION_MIN_BLOCKS
        || (count as f64) < PER_ITERATION_MIN_DOMINANT_SHARE * blocks.len() as f64
    {
        return None;
    }
    let mut times: Vec<f64> = blocks
        .iter()
        .filter(|&&(_, s)| s == size)
        .map(|&(t, _)| t)
        .collect();
    times.sort_by(f64::total_cmp);
    let (&first, &last) = (times.first()?, times.last()?);
    if last - first < PER_ITERATION_MIN_ACTIVE_FRACTION * (trace_duration_s - first) {
        return None;
    }
    exact_bursts(&times, size).or_else(|| steady_grid(&times, size))
}

/// Bursts (one per iteration) at a regular cadence, each of the same number
/// of blocks; `times` sorted, at least one.
fn exact_bursts(times: &[f64], size: u64) -> Option<Pattern> {
    let first = *times.first()?;
    // Group into bursts (one per iteration), then judge the burst cadence.
    let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    let mut sorted = gaps.clone();
    sorted.sort_by(f64::total_cmp);
    let p90 = *sorted.get((sorted.len() * 9 / 10).min(sorted.len().saturating_sub(1)))?;
    if p90 <= 0.0 {
        return None;
    }
    let split = BURST_SPLIT_FRACTION * p90;
    let mut starts = vec![first];
    let mut sizes = vec![1.0_f64];
    for (gap, &t) in gaps.iter().zip(&times[1..]) {
        match sizes.last_mut() {
            Some(n) if *gap < split => *n += 1.0,
            _ => {
                starts.push(t);
                sizes.push(1.0);
            }
        }
    }
    if starts.len() < PER_ITERATION_MIN_PERIODS {
        return None;
    }
    let periods: Vec<f64> = starts.windows(2).map(|w| w[1] - w[0]).collect();
    let mean = periods.iter().sum::<f64>() / periods.len() as f64;
    let var = periods.iter().map(|p| (p - mean).powi(2)).sum::<f64>() / periods.len() as f64;
    if mean <= 0.0 || var.sqrt() / mean >= PER_ITERATION_MAX_PERIOD_CV {
        return None;
    }
    let per_burst = median(&mut sizes.clone()).round().max(1.0);
    let consistent = sizes.iter().filter(|&&n| n == per_burst).count();
    if (consistent as f64) < PER_ITERATION_MIN_CONSISTENT_BURSTS * sizes.len() as f64 {
        return None;
    }
    // The mean period (first to last burst): stamps quantized to user
    // space's scans make the median of single periods a multiple of the
    // scan interval, not the iteration's.
    let period_s = mean;
    let per_burst = per_burst as u64;
    Some(Pattern::PerIteration {
        period_ms: period_s * 1000.0,
        bytes_per_period: size.saturating_mul(per_burst),
    })
}

/// One block per step of a steady grid, each stamped within
/// [`PER_ITERATION_MAX_GRID_DEVIATION`] periods (or
/// [`PER_ITERATION_STAMP_SLACK_S`]) of it: a steady rate whose stamps were
/// jittered, split or merged. The grid's step is the Theil–Sen slope of the
/// stamps over their rank; `times` sorted.
fn steady_grid(times: &[f64], size: u64) -> Option<Pattern> {
    if times.len() < PER_ITERATION_MIN_GRID_BLOCKS {
        return None;
    }
    let ranked: Vec<(f64, f64)> = times
        .iter()
        .enumerate()
        .map(|(i, &t)| (i as f64, t))
        .collect();
    let (period_s, start) = theil_sen(&ranked);
    if !period_s.is_finite() || period_s <= 0.0 {
        return None;
    }
    let span = times.last()? - times.first()?;
    let allowed = PER_ITERATION_MAX_GRID_DEVIATION * period_s + PER_ITERATION_STAMP_SLACK_S;
    if allowed > PER_ITERATION_MAX_GRID_SPAN_FRACTION * span {
        return None;
    }
    let on_grid = ranked
        .iter()
        .all(|&(i, t)| (t - (start + period_s * i)).abs() <= allowed);
    on_grid.then_some(Pattern::PerIteration {
        period_ms: period_s * 1000.0,
        bytes_per_period: size,
    })
}

fn small_accumulating(blocks: &[(f64, u64)], trend: Trend) -> Option<Pattern> {
    if trend != Trend::Growing || blocks.len() < SMALL_MIN_BLOCKS {
        return None;
    }
    let mut sizes: Vec<u64> = blocks.iter().map(|&(_, s)| s).collect();
    let mid = sizes.len() / 2;
    let (_, median_size, _) = sizes.select_nth_unstable(mid);
    (*median_size < SMALL_MAX_MEDIAN_BYTES).then_some(Pattern::SmallAccumulating)
}

fn large_once(
    blocks: &[(f64, u64)],
    trend: Trend,
    trace_duration_s: f64,
    process_bytes: u64,
) -> Option<Pattern> {
    if trend == Trend::Growing {
        return None;
    }
    let total: u64 = blocks.iter().map(|&(_, s)| s).fold(0, u64::saturating_add);
    // The site's own bytes are part of its process's, whatever the caller passed.
    let process_bytes = process_bytes.max(total);
    let large: Vec<(f64, u64)> = blocks
        .iter()
        .copied()
        .filter(|&(_, s)| is_large(s, process_bytes))
        .collect();
    let large_bytes: u64 = large.iter().map(|&(_, s)| s).fold(0, u64::saturating_add);
    let min_age = LARGE_ONCE_MIN_AGE_FRACTION * trace_duration_s;
    let old = large.iter().all(|&(t, _)| trace_duration_s - t >= min_age);
    (!large.is_empty()
        && large.len() <= LARGE_ONCE_MAX_BLOCKS
        && (large_bytes as f64) >= LARGE_SHARE_OF_SITE * total as f64
        && old)
        .then_some(Pattern::LargeOnce)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic generator (LCG), values in `0..n`.
    struct Lcg(u64);
    impl Lcg {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 33) % n
        }
    }

    #[test]
    fn buffer_every_100ms_is_per_iteration() {
        // 4096 B every 100 ms (±10 ms jitter) for 10 s.
        let mut rng = Lcg(7);
        let blocks: Vec<(f64, u64)> = (0..100)
            .map(|i| {
                (
                    0.1 * i as f64 + (rng.below(21) as f64 - 10.0) / 1000.0 + 0.05,
                    4096,
                )
            })
            .collect();
        match classify(&blocks, Trend::Growing, 10.0, 0) {
            Some(Pattern::PerIteration {
                period_ms,
                bytes_per_period,
            }) => {
                assert!((period_ms - 100.0).abs() < 10.0, "{period_ms}");
                assert_eq!(bytes_per_period, 4096);
            }
            other => panic!("{other:?}"),
        }
    }

    /// Stamps as the kernel's held table gives them: a block leaves the
    /// hold when user space takes it, at its second scan after the
    /// allocation, or earlier when its thread allocates again (`pushed`: a
    /// loop in one thread; not in a pool whose threads take turns). Scans
    /// every 60 ms, and every 20th waits `stall_s` (user space busy): the
    /// blocks made meanwhile are taken together.
    fn held_stamps(allocs: &[f64], pushed: bool, stall_s: f64) -> Vec<f64> {
        let end = allocs.last().copied().unwrap_or(0.0) + 1.0;
        let mut scans = Vec::new();
        let mut t = 0.0;
        while t < end {
            scans.push(t);
            t += if scans.len() % 20 == 0 { stall_s } else { 0.06 };
        }
        allocs
            .iter()
            .enumerate()
            .map(|(i, &made)| {
                let taken = scans.iter().filter(|&&s| s > made).nth(1).copied();
                let next = allocs.get(i + 1).copied().filter(|_| pushed);
                match (taken, next) {
                    (Some(a), Some(b)) => a.min(b),
                    (Some(a), None) | (None, Some(a)) => a,
                    (None, None) => end,
                }
            })
            .collect()
    }

    fn per_iteration_of(blocks: &[(f64, u64)], trace_s: f64) -> (f64, u64) {
        match classify(blocks, Trend::Growing, trace_s, 0) {
            Some(Pattern::PerIteration {
                period_ms,
                bytes_per_period,
            }) => (period_ms, bytes_per_period),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_steady_leak_stamped_late_is_per_iteration_whatever_its_size() {
        // One block every 100 ms for 10 s. In a pool whose threads take
        // turns, each block waits in the kernel's hold for user space's
        // scans; with user space busy for 0.3 s now and then, several blocks
        // get one stamp: the bursts are no longer equal, nor evenly spaced
        // (this lost `per-iteration` once held blocks were stamped when
        // taken). The rate is steady: it is per-iteration, at any size.
        let allocs: Vec<f64> = (0..100).map(|i| 0.05 + 0.1 * f64::from(i)).collect();
        for (pushed, stall_s) in [(false, 0.3), (false, 0.06), (true, 0.3), (true, 0.06)] {
            let stamps = held_stamps(&allocs, pushed, stall_s);
            for size in [16, 512, 4096, 65_536, 1 << 20] {
                let blocks: Vec<(f64, u64)> = stamps.iter().map(|&t| (t, size)).collect();
                let (period_ms, bytes) = per_iteration_of(&blocks, 10.2);
                assert!(
                    (90.0..=110.0).contains(&period_ms),
                    "pushed {pushed}, stall {stall_s}, {size} B: {period_ms} ms"
                );
                assert_eq!(bytes, size);
            }
        }
    }

    #[test]
    fn the_demos_leak_is_per_iteration_and_its_cache_has_no_pattern() {
        // leaky_demo 400: 256 B kept every 4th request of ~5 ms, pushed out
        // of the hold by the next request's allocation; 16 x 4096 at start.
        let leak: Vec<(f64, u64)> = (0..100)
            .map(|i| (0.003 + 0.0202 * f64::from(i) + 0.0051, 256))
            .collect();
        let (period_ms, bytes) = per_iteration_of(&leak, 2.1);
        assert!((19.0..=22.0).contains(&period_ms), "{period_ms}");
        assert_eq!(bytes, 256);
        let cache: Vec<(f64, u64)> = (0..16)
            .map(|i| (0.002 + 0.000_01 * f64::from(i), 4096))
            .collect();
        for trend in [Trend::New, Trend::Stable] {
            assert_eq!(classify(&cache, trend, 2.1, 90_000), None);
        }
    }

    #[test]
    fn random_arrivals_of_one_size_are_not_per_iteration() {
        // Exponential gaps (a Poisson process), mean 0.5 s, for 60 s.
        for seed in 1..=20 {
            let mut rng = Lcg(seed);
            let mut t = 0.0;
            let blocks: Vec<(f64, u64)> = (0..120)
                .map(|_| {
                    let u = (rng.below(1_000_000) as f64 + 0.5) / 1_000_000.0;
                    t += -0.5 * u.ln();
                    (t, 256)
                })
                .collect();
            let end = t + 0.1;
            assert!(
                !matches!(
                    classify(&blocks, Trend::Growing, end, 0),
                    Some(Pattern::PerIteration { .. })
                ),
                "seed {seed}"
            );
        }
    }

    #[test]
    fn the_64mib_block_stays_large_once_next_to_a_steady_leak() {
        let blocks = [(0.05, 64 << 20)];
        assert_eq!(
            classify(&blocks, Trend::Stable, 10.2, (64 << 20) + 409_600),
            Some(Pattern::LargeOnce)
        );
    }

    #[test]
    fn two_buffers_per_iteration_double_the_bytes_per_period() {
        let blocks: Vec<(f64, u64)> = (0..50)
            .flat_map(|i| {
                let t = 0.2 * i as f64;
                [(t, 1024), (t + 0.001, 1024)]
            })
            .collect();
        match classify(&blocks, Trend::Growing, 10.0, 0) {
            Some(Pattern::PerIteration {
                period_ms,
                bytes_per_period,
            }) => {
                assert!((period_ms - 200.0).abs() < 1.0, "{period_ms}");
                assert_eq!(bytes_per_period, 2048);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn irregular_or_mixed_sizes_are_not_per_iteration() {
        // Equal sizes but bursty, irregular times.
        let times = [0.0, 0.01, 3.0, 3.2, 7.5, 9.9];
        let blocks: Vec<(f64, u64)> = times.iter().map(|&t| (t, 4096)).collect();
        assert!(!matches!(
            classify(&blocks, Trend::Growing, 10.0, 0),
            Some(Pattern::PerIteration { .. })
        ));
        // Regular times but only half the blocks share a size.
        let blocks: Vec<(f64, u64)> = (0..20)
            .map(|i| (0.5 * i as f64, if i % 2 == 0 { 4096 } else { 100 + i }))
            .collect();
        assert!(!matches!(
            classify(&blocks, Trend::Growing, 10.0, 0),
            Some(Pattern::PerIteration { .. })
        ));
        // Three blocks are too few.
        let blocks = [(1.0, 64), (2.0, 64), (3.0, 64)];
        assert_eq!(classify(&blocks, Trend::Growing, 3.5, 0), None);
    }

    #[test]
    fn one_old_64mib_block_is_large_once() {
        let blocks = [(0.5, 64 << 20)];
        assert_eq!(
            classify(&blocks, Trend::Stable, 60.0, 0),
            Some(Pattern::LargeOnce)
        );
        assert_eq!(
            classify(&blocks, Trend::New, 60.0, 0),
            Some(Pattern::LargeOnce)
        );
        // Growing sites are not "once"; young blocks have not survived the trace.
        assert_eq!(classify(&blocks, Trend::Growing, 60.0, 0), None);
        assert_eq!(classify(&[(50.0, 64 << 20)], Trend::Stable, 60.0, 0), None);
    }

    #[test]
    fn a_block_under_the_floor_is_never_large() {
        // glibc's stdio buffer alone at its site, and all the process holds.
        assert_eq!(classify(&[(0.1, 4096)], Trend::Stable, 30.0, 4096), None);
        // A 24 KiB table: the same.
        assert_eq!(classify(&[(0.1, 24 << 10)], Trend::Stable, 30.0, 0), None);
        // One byte under the share floor, whatever its share.
        let just_under = LARGE_MIN_BYTES - 1;
        assert_eq!(
            classify(&[(0.1, just_under)], Trend::Stable, 30.0, just_under),
            None
        );
    }

    #[test]
    fn large_means_a_mib_or_a_sizeable_share_of_the_process() {
        // 1 MiB is large whatever the process holds; 1 byte less is not, in
        // a process holding 64 MiB.
        let big = 64 << 20;
        assert_eq!(
            classify(&[(0.1, LARGE_BLOCK_BYTES)], Trend::Stable, 30.0, big),
            Some(Pattern::LargeOnce)
        );
        assert_eq!(
            classify(&[(0.1, LARGE_BLOCK_BYTES - 1)], Trend::Stable, 30.0, big),
            None
        );
        // 256 KiB holding a quarter of the process: large; just under a
        // quarter: not.
        let block = LARGE_MIN_BYTES;
        assert_eq!(
            classify(&[(0.1, block)], Trend::Stable, 30.0, 4 * block),
            Some(Pattern::LargeOnce)
        );
        assert_eq!(
            classify(&[(0.1, block)], Trend::Stable, 30.0, 4 * block + 4),
            None
        );
        assert!(is_large(LARGE_BLOCK_BYTES, u64::MAX));
        assert!(!is_large(LARGE_MIN_BYTES - 1, 0));
    }

    #[test]
    fn large_blocks_must_hold_most_of_the_site() {
        // One 300 KB block among small ones, a sizeable share of the process.
        let blocks = [(1.0, 300_000), (2.0, 1000), (2.5, 2000)];
        assert_eq!(
            classify(&blocks, Trend::Stable, 30.0, 1 << 20),
            Some(Pattern::LargeOnce)
        );
        // A 1 MiB block next to 2 MiB of small ones is not "once".
        let mut blocks = vec![(1.0, 1 << 20)];
        blocks.extend((0..512).map(|i| (1.0 + f64::from(i) / 1000.0, 4096)));
        assert_eq!(classify(&blocks, Trend::Stable, 30.0, 0), None);
    }

    #[test]
    fn many_random_small_blocks_growing_are_small_accumulating() {
        let mut rng = Lcg(42);
        let blocks: Vec<(f64, u64)> = (0..500)
            .map(|_| (rng.below(60_000) as f64 / 1000.0, 16 + rng.below(497)))
            .collect();
        assert_eq!(
            classify(&blocks, Trend::Growing, 60.0, 0),
            Some(Pattern::SmallAccumulating)
        );
        // Not growing: no pattern.
        assert_eq!(classify(&blocks, Trend::Stable, 60.0, 0), None);
    }

    #[test]
    fn flat_pool_has_no_pattern() {
        // 64 × 4 KiB made in a tight loop at startup, then held.
        let blocks: Vec<(f64, u64)> = (0..64).map(|i| (0.001 * i as f64, 4096)).collect();
        assert_eq!(classify(&blocks, Trend::Stable, 120.0, 0), None);
        // Even if the site were still new, a startup burst is not per-iteration.
        assert_eq!(classify(&blocks, Trend::New, 120.0, 0), None);
        assert_eq!(classify(&[], Trend::Growing, 120.0, 0), None);
    }

    #[test]
    fn many_large_blocks_are_not_large_once() {
        let blocks: Vec<(f64, u64)> = (0..16).map(|i| (0.01 * i as f64, 2 << 20)).collect();
        assert_eq!(classify(&blocks, Trend::Stable, 100.0, 0), None);
    }

    #[test]
    fn pattern_json_shape() {
        let json = serde_json::to_value(Pattern::PerIteration {
            period_ms: 100.0,
            bytes_per_period: 4096,
        })
        .expect("serializes");
        assert_eq!(
            json,
            serde_json::json!({"kind": "per-iteration", "period_ms": 100.0, "bytes_per_period": 4096})
        );
        assert_eq!(
            serde_json::to_value(Pattern::LargeOnce).expect("serializes"),
            serde_json::json!({"kind": "large-once"})
        );
        assert_eq!(
            serde_json::to_value(Pattern::SmallAccumulating).expect("serializes"),
            serde_json::json!({"kind": "small-accumulating"})
        );
        assert_eq!(Pattern::LargeOnce.kind(), "large-once");
    }
}
