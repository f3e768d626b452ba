//! Small robust statistics shared by the leak analysis and the soak-test
//! monitor: median, robust sigma (scaled MAD) and the Theil–Sen slope. Pure functions over `f64`;
//! callers drop non-finite values before calling.

/// Scale from the median absolute deviation to a normal standard deviation.
const MAD_SIGMA: f64 = 1.4826;

/// Most points Theil–Sen pairs up exhaustively; longer inputs are
/// subsampled evenly (first and last kept) to this many points, which keeps
/// the pair count under 20 000.
pub const THEIL_SEN_MAX_POINTS: usize = 200;

/// Median (0 for an empty slice); reorders `xs`.
pub fn median(xs: &mut [f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let len = xs.len();
    let mid = len / 2;
    let (lower, m, _) = xs.select_nth_unstable_by(mid, f64::total_cmp);
    let m = *m;
    if len % 2 == 1 {
        m
    } else {
        let lo = lower.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (lo + m) / 2.0
    }
}

/// Robust sigma: 1.4826 × median absolute deviation (0 for an empty slice).
pub fn robust_sigma(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    let med = median(&mut v);
    let mut dev: Vec<f64> = xs.iter().map(|x| (x - med).abs()).collect();
    MAD_SIGMA * median(&mut dev)
}

/// Evenly spaced indices into `0..n`, at most `max` of them, first and last
/// included.
fn even_indices(n: usize, max: usize) -> Vec<usize> {
    if n <= max || max < 2 {
        return (0..n).collect();
    }
    let last = n - 1;
    (0..max).map(|k| k * last / (max - 1)).collect()
}

/// Theil–Sen fit of `(t, v)` points: `(slope per time unit, intercept)`, the
/// median of the pairwise slopes (pairs with equal times skipped) and the
/// median intercept. `(0, median v)` when no pair has distinct times.
pub fn theil_sen(points: &[(f64, f64)]) -> (f64, f64) {
    let picked: Vec<(f64, f64)> = even_indices(points.len(), THEIL_SEN_MAX_POINTS)
        .into_iter()
        .filter_map(|i| points.get(i).copied())
        .collect();
    let mut slopes = Vec::with_capacity(picked.len() * picked.len().saturating_sub(1) / 2);
    for (i, &(ti, vi)) in picked.iter().enumerate() {
        for &(tj, vj) in &picked[i + 1..] {
            let dt = tj - ti;
            if dt != 0.0 {
                slopes.push((vj - vi) / dt);
            }
        }
    }
    let slope = if slopes.is_empty() {
        0.0
    } else {
        median(&mut slopes)
    };
    let mut intercepts: Vec<f64> = points.iter().map(|&(t, v)| v - slope * t).collect();
    (slope, median(&mut intercepts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_odd_even_empty() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }

    #[test]
    fn theil_sen_ignores_an_outlier_and_subsamples() {
        let mut pts: Vec<(f64, f64)> = (0..1000)
            .map(|i| (i as f64, 3.0 * i as f64 + 7.0))
            .collect();
        pts[500].1 = 1e12;
        let (slope, intercept) = theil_sen(&pts);
        assert!((slope - 3.0).abs() < 1e-9, "{slope}");
        assert!((intercept - 7.0).abs() < 1e-6, "{intercept}");
        assert_eq!(even_indices(1000, 200).len(), 200);
        assert_eq!(even_indices(1000, 200).last(), Some(&999));
    }

    #[test]
    fn theil_sen_degenerate_inputs() {
        assert_eq!(theil_sen(&[]), (0.0, 0.0));
        assert_eq!(theil_sen(&[(1.0, 5.0), (1.0, 7.0)]).0, 0.0);
    }
}
