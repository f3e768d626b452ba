//! The printed summary (one line per metric: family, metric, segment, pid,
//! start, end, slope per hour, label) and the `--fail-on` gate.

use std::fmt::Write;

use crate::monitor::release::ReleaseReport;
use crate::monitor::series::{Recording, Unit};
use crate::monitor::units::{format_rate, format_value};
use crate::monitor::verdict::{Label, Verdict};
use crate::monitor::{Gate, Scope};

/// Why the gate failed, one entry per offending metric; empty when passed.
pub fn gate(
    verdicts: &[Verdict],
    release: Option<&ReleaseReport>,
    fail_on: &[Gate],
    scope: Scope,
) -> Vec<String> {
    let mut failures = Vec::new();
    for v in verdicts {
        if scope == Scope::Target && v.pid.is_none() {
            continue;
        }
        let hit = match v.label {
            Label::Growth => fail_on.contains(&Gate::Growth),
            Label::SlowGrowth => fail_on.contains(&Gate::SlowGrowth),
            Label::Jump => fail_on.contains(&Gate::Jump),
            Label::Jitter => fail_on.contains(&Gate::Jitter),
            Label::Stable | Label::Shrink | Label::TooShort => false,
        };
        if hit {
            let seg = if v.segment > 0 {
                format!(" (segment {})", v.segment)
            } else {
                String::new()
            };
            failures.push(format!(
                "{} {}{}: {}",
                v.family.as_str(),
                v.metric,
                seg,
                v.label.as_str()
            ));
        }
    }
    if fail_on.contains(&Gate::NotReleased) {
        if let Some(r) = release {
            for m in r.not_released() {
                failures.push(format!("{} {}: not-released", m.family.as_str(), m.metric));
            }
        }
    }
    failures
}

fn value(v: Option<f64>, unit: Unit) -> String {
    v.map(|v| format_value(v, unit == Unit::Bytes))
        .unwrap_or_else(|| "-".into())
}

/// Writes the summary into `out`.
pub fn summary(
    out: &mut String,
    rec: &Recording,
    verdicts: &[Verdict],
    release: Option<&ReleaseReport>,
    failures: &[String],
    fail_on: &[Gate],
) {
    let m = &rec.meta;
    let _ = writeln!(
        out,
        "memtrace monitor: {}: {} samples over {:.1}s every {}, warm-up {}",
        m.target,
        rec.sample_count(),
        rec.end_t(),
        humantime::format_duration(std::time::Duration::from_secs_f64(m.interval_s.max(0.0))),
        humantime::format_duration(std::time::Duration::from_secs_f64(m.warmup_s.max(0.0))),
    );
    let _ = writeln!(
        out,
        "{:<8} {:<26} {:>3} {:>8} {:>12} {:>12} {:>14}  label",
        "family", "metric", "seg", "pid", "start", "end", "slope"
    );
    for v in verdicts {
        let steps = if v.steps.is_empty() {
            String::new()
        } else {
            format!("  steps {}", v.step_labels().join(" "))
        };
        let gaps = if v.gaps > 0 {
            format!("  gaps {}", v.gaps)
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "{:<8} {:<26} {:>3} {:>8} {:>12} {:>12} {:>14}  {}{}{}",
            v.family.as_str(),
            v.metric,
            v.segment,
            v.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
            value(v.start, v.unit),
            value(v.end, v.unit),
            format_rate(v.slope_per_hour, v.unit == Unit::Bytes),
            v.label.as_str(),
            steps,
            gaps
        );
    }
    for seg in &rec.segments {
        let end = match (seg.end_s, &seg.end_note) {
            (Some(t), Some(n)) => format!("until {t:.1}s ({n})"),
            _ => "until the end".to_string(),
        };
        let _ = writeln!(
            out,
            "segment {}: pid {} ({}) from {:.1}s {}",
            seg.segment, seg.pid, seg.name, seg.start_s, end
        );
    }
    for r in &rec.runs {
        let _ = writeln!(
            out,
            "run {}: pid {} {} after {:.1}s",
            r.cycle,
            r.pid,
            r.status,
            r.end_s - r.start_s
        );
    }
    if let Some(report) = release {
        for r in &report.metrics {
            let after: Vec<String> = r
                .after
                .iter()
                .map(|a| match a {
                    Some(a) if *a > r.baseline => {
                        format!("+{}", format_value(a - r.baseline, true))
                    }
                    Some(a) => format_value(a - r.baseline, true),
                    None => "-".into(),
                })
                .collect();
            let _ = writeln!(
                out,
                "release {} {}: baseline {}, after each run {}, residual {} (tolerance {}): {}",
                r.family.as_str(),
                r.metric,
                format_value(r.baseline, true),
                after.join(" "),
                format_value(r.residual, true),
                format_value(r.tolerance, true),
                if r.released {
                    "released"
                } else {
                    "not-released"
                }
            );
        }
    }
    if !fail_on.is_empty() {
        if failures.is_empty() {
            let _ = writeln!(out, "gate: passed");
        } else {
            let _ = writeln!(out, "gate: FAILED (exit 3): {}", failures.join(", "));
        }
    }
}
