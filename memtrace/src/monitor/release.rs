//! "Released after the run": with `-- CMD`, compares system-wide memory
//! (MemUsed, Shmem, GPU device `*used*` figures) after each run has settled
//! with the baseline sampled before the first run.

use serde::{Deserialize, Serialize};

use crate::monitor::series::{Family, Recording, Series, Unit};
use crate::monitor::verdict::median;

/// Release check of one metric.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReleaseMetric {
    pub family: Family,
    pub metric: String,
    pub unit: Unit,
    /// Median before the first run.
    pub baseline: f64,
    /// Settled level after each run (median of the second half of the
    /// settle window), `null` when there were no samples.
    pub after: Vec<Option<f64>>,
    /// Last settled level minus baseline.
    pub residual: f64,
    pub tolerance: f64,
    /// False when `residual > tolerance`: memory did not come back.
    pub released: bool,
}

/// Release check of a launched command.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ReleaseReport {
    pub metrics: Vec<ReleaseMetric>,
}

impl ReleaseReport {
    /// Metrics that did not come back.
    pub fn not_released(&self) -> impl Iterator<Item = &ReleaseMetric> {
        self.metrics.iter().filter(|m| !m.released)
    }
}

fn checked(s: &Series) -> bool {
    match s.family {
        Family::System => s.metric == "MemUsed" || s.metric == "Shmem",
        Family::Gpu => s.segment == 0 && s.metric.contains("used"),
        Family::Process => false,
    }
}

fn window_median(s: &Series, from: f64, to: f64) -> Option<f64> {
    let mut vals: Vec<f64> = s
        .points
        .iter()
        .filter(|(t, _)| *t >= from && *t < to)
        .filter_map(|(_, v)| *v)
        .collect();
    (!vals.is_empty()).then(|| median(&mut vals))
}

/// Checks every run of `rec`; `None` when nothing was launched.
pub fn check(rec: &Recording, tolerance: f64) -> Option<ReleaseReport> {
    let first = rec.runs.first()?;
    let mut report = ReleaseReport::default();
    for s in rec.series.iter().filter(|s| checked(s)) {
        let Some(baseline) = window_median(s, f64::NEG_INFINITY, first.start_s) else {
            continue;
        };
        let mut after = Vec::new();
        for (i, run) in rec.runs.iter().enumerate() {
            let next = rec
                .runs
                .get(i + 1)
                .map(|r| r.start_s)
                .unwrap_or(f64::INFINITY);
            let last_t = s
                .points
                .iter()
                .filter(|(t, v)| *t > run.end_s && *t < next && v.is_some())
                .map(|(t, _)| *t)
                .fold(f64::NAN, f64::max);
            let value = if last_t.is_nan() {
                None
            } else {
                let from = run.end_s + (last_t - run.end_s) / 2.0;
                window_median(s, from, next)
            };
            after.push(value);
        }
        let Some(last) = after.iter().rev().find_map(|v| *v) else {
            continue;
        };
        let residual = last - baseline;
        report.metrics.push(ReleaseMetric {
            family: s.family,
            metric: s.metric.clone(),
            unit: s.unit,
            baseline,
            after,
            residual,
            tolerance,
            released: residual <= tolerance,
        });
    }
    Some(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::monitor::series::{Meta, Run};

    fn run(cycle: u32, start_s: f64, end_s: f64) -> Run {
        Run {
            cycle,
            pid: 1,
            start_s,
            end_s,
            exit_code: Some(0),
            signal: None,
            core_dumped: false,
            status: "exited 0".into(),
        }
    }

    #[test]
    fn shmem_left_behind_each_cycle_is_flagged() {
        let mut rec = Recording::new(Meta::default());
        let mib = 1048576.0;
        for i in 0..40 {
            let t = i as f64 * 0.25;
            // Baseline 10 MiB; each run (1 s long, every 3 s from t=1) leaves 64 MiB.
            let runs_done = ((t - 1.0) / 3.0).floor().max(-1.0) + 1.0;
            let in_run = t >= 1.0 && ((t - 1.0) % 3.0) < 1.0;
            let shmem = 10.0 * mib + 64.0 * mib * (runs_done - if in_run { 1.0 } else { 0.0 });
            rec.record(Family::System, "Shmem", Unit::Bytes, 0, t, shmem);
            rec.record(Family::System, "MemUsed", Unit::Bytes, 0, t, 500.0 * mib);
            rec.record(Family::System, "Cached", Unit::Bytes, 0, t, 900.0 * mib);
        }
        rec.runs = vec![run(1, 1.0, 2.0), run(2, 4.0, 5.0), run(3, 7.0, 8.0)];
        let report = check(&rec, 32.0 * mib).expect("report");
        assert_eq!(report.metrics.len(), 2);
        let shmem = report
            .metrics
            .iter()
            .find(|m| m.metric == "Shmem")
            .expect("shmem");
        assert!(!shmem.released);
        assert_eq!(shmem.after.len(), 3);
        assert!((shmem.residual / mib - 192.0).abs() < 1e-6, "{shmem:?}");
        let used = report
            .metrics
            .iter()
            .find(|m| m.metric == "MemUsed")
            .expect("used");
        assert!(used.released);
        assert_eq!(report.not_released().count(), 1);
    }

    #[test]
    fn no_runs_no_report() {
        assert!(check(&Recording::new(Meta::default()), 1.0).is_none());
    }
}
