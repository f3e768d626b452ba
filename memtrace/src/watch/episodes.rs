//! The episode's life inside the loop: start the tracer child for the pid
//! whose metric fired, notice when it has attached (its `tracing` line) and
//! when it ends, then summarize it (`episode::finish`: the metric's change
//! from attach to detach, the sites found, the reconciliation), record it in
//! the state and prune old episodes (`--keep`).

use crate::monitor::series::{Family, Unit};
use crate::monitor::units::format_value;
use crate::watch::episode::{self, InFlight};
use crate::watch::publish::{LastEpisode, Phase};
use crate::watch::watcher::Watcher;
use crate::watch::{millis, now_unix_ms, say, WatchError};

impl Watcher {
    pub fn start_episode(
        &mut self,
        pid: u32,
        key: (Family, String),
        why: episode::Why,
    ) -> Result<(), WatchError> {
        let Some(reports) = self.args.reports.clone() else {
            return Ok(());
        };
        let now = now_unix_ms();
        let (number, dir) = self.state.begin(now, &key.1, pid);
        self.save_state()?;
        let plan = episode::Plan {
            exe: &self.exe,
            pid,
            window: self.args.window,
            dir: reports.join(&dir),
            top: self.args.top,
            tracer_args: &self.args.tracer_args,
        };
        say(&format!(
            "episode {number}: tracing pid {pid} for {:?}: {}",
            self.args.window, why.text
        ));
        match episode::start(&plan, number, now) {
            Ok(run) => {
                self.phase = Phase::Tracing;
                self.episodes_this_run += 1;
                self.running = Some(InFlight {
                    run,
                    why,
                    family: key.0,
                    key,
                    attached_t: None,
                });
            }
            Err(e) => {
                say(&format!("episode {number}: the tracer did not start: {e}"));
                self.state.end(
                    number,
                    now_unix_ms(),
                    0,
                    "failed",
                    millis(self.args.backoff),
                    millis(self.args.max_backoff),
                );
                self.save_state()?;
            }
        }
        Ok(())
    }

    /// Finishes the episode when its tracer has ended.
    pub fn poll_episode(&mut self) -> Result<(), WatchError> {
        let now = self.now();
        let Some(flight) = self.running.as_mut() else {
            return Ok(());
        };
        if flight.attached_t.is_none() {
            let log =
                std::fs::read_to_string(flight.run.dir.join("tracer.log")).unwrap_or_default();
            if log.contains("memtrace: tracing") {
                flight.attached_t = Some(now);
            }
        }
        let Some(status) = flight.run.try_wait() else {
            return Ok(());
        };
        self.complete_episode(Some(status))
    }

    pub fn complete_episode(
        &mut self,
        status: Option<std::process::ExitStatus>,
    ) -> Result<(), WatchError> {
        let Some(flight) = self.running.take() else {
            return Ok(());
        };
        let end_t = self.now();
        let window = self
            .procs
            .get(&flight.run.pid)
            .and_then(|w| w.windows.get(&flight.key));
        let bytes = window.is_none_or(|w| w.unit == Unit::Bytes);
        let traced_guess = flight.run.started.elapsed().as_secs_f64();
        // The report's own duration is exact; the sample nearest its start
        // comes from the watcher's clock.
        let report_ms = std::fs::read(flight.run.dir.join(episode::REPORT_JSON))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| v["duration_ms"].as_u64());
        let traced_s = report_ms.map_or(traced_guess, |ms| ms as f64 / 1000.0);
        // Attached when the tracer said so (to a tick), else as long
        // before the end as it traced; detached that long after attaching.
        let attach_t = flight.attached_t.unwrap_or(end_t - traced_s);
        let change = episode::Change {
            metric: flight.key.1.clone(),
            bytes,
            at_attach: window.and_then(|w| w.value_at(attach_t)),
            at_detach: window.and_then(|w| w.value_at(attach_t + traced_s)),
        };
        let summary = episode::finish(
            &flight.run,
            episode::Finish {
                exe: &self.exe,
                why: flight.why,
                family: flight.family,
                change,
                status,
                top: self.args.top,
                keep_trace: self.args.keep_traces,
            },
        );
        let number = flight.run.number;
        let (outcome, traced_ms) = match &summary {
            Ok(s) => {
                say(&format!(
                    "episode {number} {}: {}; {}",
                    s.outcome,
                    match s.found.first() {
                        Some(f) => format!(
                            "top site {} ({} in {} blocks)",
                            f.function,
                            format_value(f.live_bytes as f64, true),
                            f.live_count
                        ),
                        None => "no site holds memory".to_string(),
                    },
                    s.explanation
                ));
                self.last_episode = Some(LastEpisode {
                    number,
                    pid: flight.run.pid,
                    dir: flight.run.dir.display().to_string(),
                    metric: s.why.metric.clone(),
                    explanation: s.explanation.clone(),
                    top: s
                        .found
                        .iter()
                        .take(5)
                        .map(|f| (f.function.clone(), f.live_bytes))
                        .collect(),
                });
                (s.outcome.clone(), s.traced_ms)
            }
            Err(e) => {
                say(&format!("episode {number}: {e}"));
                ("failed".to_string(), millis(flight.run.started.elapsed()))
            }
        };
        self.state.end(
            number,
            now_unix_ms(),
            traced_ms,
            &outcome,
            millis(self.args.backoff),
            millis(self.args.max_backoff),
        );
        if let Some(dir) = self.args.reports.clone() {
            for doomed in self.state.prune(self.args.keep as usize, now_unix_ms()) {
                if let Err(e) = std::fs::remove_dir_all(dir.join(&doomed)) {
                    say(&format!("cannot delete {doomed}: {e}"));
                }
            }
        }
        self.save_state()?;
        self.phase = Phase::Holding;
        self.last_heartbeat = None;
        Ok(())
    }
}
