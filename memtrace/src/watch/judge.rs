//! Judging: every selected metric of every watched process against the
//! monitor's verdict logic (`trigger`), once half a judged window has been
//! sampled after the process's warm-up; the first to fire (GPU first, then
//! the order of `--metrics`) starts an episode, unless `--dry-run`, the
//! back-off or the duty cap holds it, which is said once.

use std::time::{Duration, UNIX_EPOCH};

use crate::monitor::series::{Family, Unit};
use crate::monitor::units::{format_rate, format_value};
use crate::monitor::verdict::Label;
use crate::watch::episode;
use crate::watch::publish::{MetricView, Phase};
use crate::watch::trigger::{self, Judgement};
use crate::watch::watcher::Watcher;
use crate::watch::{millis, now_unix_ms, say, state, WatchError};

impl Watcher {
    /// Judges every selected metric of every watched process; starts an
    /// episode on the process whose metric fires.
    pub fn judge_and_act(&mut self, t: f64) -> Result<(), WatchError> {
        let span = self.args.judge_window.as_secs_f64();
        let mut firing: Vec<(usize, u32, (Family, String), Judgement)> = Vec::new();
        let mut views = Vec::new();
        let mut any_ready = false;
        for (pid, watched) in &self.procs {
            let from = watched.judge_from;
            // A verdict needs history: judging starts once half a window has
            // been sampled after the warm-up (one tooth of a sawtooth rises
            // like a leak; several do not).
            let ready = trigger::may_judge(t, from, span);
            any_ready |= ready;
            for (key, w) in &watched.windows {
                let Some((_, value)) = w.last() else { continue };
                let wanted = trigger::selected(key.0, &key.1, &self.args.metrics);
                let judged = (ready && wanted).then(|| w.judge(from, &self.th));
                let fires = judged.as_ref().is_some_and(|j| j.fires(&self.args.trigger));
                views.push(MetricView {
                    pid: *pid,
                    family: key.0,
                    metric: key.1.clone(),
                    unit: w.unit,
                    value,
                    label: judged.as_ref().map(|j| j.verdict.label),
                    slope_per_hour: judged.as_ref().map_or(0.0, |j| j.verdict.slope_per_hour),
                    triggers: wanted,
                });
                if let Some(j) = judged.filter(|_| fires) {
                    // GPU first (scarcest), then the order of --metrics.
                    let rank = if key.0 == Family::Gpu {
                        0
                    } else {
                        1 + self
                            .args
                            .metrics
                            .iter()
                            .position(|m| *m == key.1)
                            .unwrap_or(usize::MAX - 1)
                    };
                    firing.push((rank, *pid, key.clone(), j));
                }
            }
        }
        self.views = views;
        if self.running.is_some() {
            self.phase = Phase::Tracing;
            return Ok(());
        }
        if self.procs.is_empty() {
            return Ok(());
        }
        if !any_ready {
            self.phase = Phase::Warmup;
            return Ok(());
        }
        firing.sort_by_key(|f| (f.0, f.1));
        let Some((_, pid, key, j)) = firing.first().cloned() else {
            if self.state.consecutive > 0 {
                self.state.healthy();
                self.save_state()?;
            }
            self.phase = Phase::Watching;
            self.last_hold_note = None;
            return Ok(());
        };
        let bytes = j.verdict.unit == Unit::Bytes;
        let value = j.verdict.end.unwrap_or(0.0);
        let also: Vec<String> = firing
            .iter()
            .skip(1)
            .map(|f| {
                if f.1 == pid {
                    f.2 .1.clone()
                } else {
                    format!("{} of pid {}", f.2 .1, f.1)
                }
            })
            .collect();
        let since_unix_ms = self.unix_at(j.since_t);
        let rate = if j.verdict.label == Label::Jump {
            let step: f64 = j
                .verdict
                .steps
                .iter()
                .filter(|s| s.size > 0.0)
                .map(|s| s.size)
                .sum();
            format!("of +{}", format_value(step, bytes))
        } else {
            format!(
                "at {} ({} over the judged window)",
                format_rate(j.verdict.slope_per_hour, bytes),
                format_value(j.verdict.change, bytes)
            )
        };
        let text = format!(
            "{}{} {} {rate}, now {}, growing since {}{}",
            key.1,
            if self.target.single() {
                String::new()
            } else {
                format!(" of pid {pid}")
            },
            j.verdict.label.as_str(),
            format_value(value, bytes),
            humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(since_unix_ms)),
            if also.is_empty() {
                String::new()
            } else {
                format!(" (also {})", also.join(", "))
            }
        );
        let why = episode::Why {
            metric: key.1.clone(),
            family: key.0.as_str().to_string(),
            label: j.verdict.label.as_str().to_string(),
            slope_per_hour: j.verdict.slope_per_hour,
            change: j.verdict.change,
            since_unix_ms,
            triggered_unix_ms: now_unix_ms(),
            value,
            also,
            text,
        };
        if self.args.dry_run {
            self.phase = Phase::Holding;
            if t >= self.dry_hold_until {
                self.would_trace += 1;
                say(&format!("dry run: would trace pid {pid}: {}", why.text));
                self.dry_hold_until =
                    t + self.args.window.as_secs_f64() + self.args.backoff.as_secs_f64();
            }
            return Ok(());
        }
        let now = now_unix_ms();
        let window_ms = millis(self.args.window);
        if let Err(hold) = self.state.may_start(now, window_ms, self.args.max_duty) {
            self.phase = Phase::Holding;
            let (kind, until) = match hold {
                state::Hold::Backoff { until_unix_ms } => ("back-off", until_unix_ms),
                state::Hold::Duty { until_unix_ms, .. } => ("duty cap", until_unix_ms),
            };
            let note = format!("{kind} {until}");
            if self.last_hold_note.as_deref() != Some(note.as_str()) {
                say(&format!(
                    "{}; not tracing: {kind} until {}",
                    why.text,
                    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_millis(until))
                ));
                self.last_hold_note = Some(note);
            }
            return Ok(());
        }
        self.start_episode(pid, key, why)
    }
}
