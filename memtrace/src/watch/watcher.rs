//! The watch loop: each `--interval` it finds the target's processes
//! (`targets`), samples their metrics with no probe attached (procfs, NVML,
//! DRM, a vendor command), judges them (`judge`), looks after the episode
//! in flight (`episodes`) and publishes the heartbeat and Prometheus text
//! (`publish`). Signals: SIGTERM/SIGINT end the loop, SIGHUP saves the state.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::monitor::series::{Family, Unit};
use crate::monitor::sources::{gpu::GpuSources, procfs};
use crate::monitor::verdict::Thresholds;
use crate::watch::args::WatchArgs;
use crate::watch::episode::InFlight;
use crate::watch::publish::{self, Heartbeat, LastEpisode, MetricView, Phase};
use crate::watch::targets::{process_age_s, Target};
use crate::watch::trigger::{self, Window};
use crate::watch::{millis, now_unix_ms, say, state, WatchError};

/// One watched process: when judging may start, and its metrics' windows.
pub struct Watched {
    /// Judging starts at this time on the watcher's axis: its warm-up end,
    /// or its first sample if later ([`trigger::judge_from`]).
    pub judge_from: f64,
    pub windows: BTreeMap<(Family, String), Window>,
    /// Its container and pod, read when it was found.
    pub placement: crate::tracee::container::Placement,
}

pub struct Watcher {
    pub args: WatchArgs,
    pub target: Target,
    pub exe: PathBuf,
    gpu: GpuSources,
    pub th: Thresholds,
    stop: Arc<AtomicBool>,
    hup: Arc<AtomicBool>,
    start: Instant,
    started_unix_ms: u64,
    pub state: state::State,
    /// The processes watched now, by pid.
    pub procs: BTreeMap<u32, Watched>,
    /// Processes watched since the start (the first is no restart).
    restarts_seen: u64,
    pub views: Vec<MetricView>,
    pub phase: Phase,
    pub running: Option<InFlight>,
    pub episodes_this_run: u64,
    pub would_trace: u64,
    pub dry_hold_until: f64,
    pub last_hold_note: Option<String>,
    pub last_heartbeat: Option<Instant>,
    pub last_episode: Option<LastEpisode>,
    prometheus: Option<tokio::sync::watch::Sender<Arc<String>>>,
}

impl Watcher {
    pub fn new(mut args: WatchArgs) -> Result<Watcher, WatchError> {
        let target = Target::from_args(&args)?;
        // Each episode's tracer pushes its report: the options are checked
        // here, once, and passed on (the credentials in the environment).
        crate::push::PushConfig::from_env(&args.push)
            .map_err(|e| WatchError::Usage(e.to_string()))?;
        crate::push::OtlpConfig::from_args(&args.push)
            .map_err(|e| WatchError::Usage(e.to_string()))?;
        let mut tracer_args = args.push.as_tracer_args();
        if args.leak_check {
            tracer_args.push("--leak-check".to_string());
        }
        tracer_args.append(&mut args.tracer_args);
        args.tracer_args = tracer_args;
        if args.interval.is_zero() || args.window.is_zero() {
            return Err(WatchError::Usage(
                "--interval and --window must be more than 0".into(),
            ));
        }
        if args.trigger.is_empty() || args.metrics.is_empty() {
            return Err(WatchError::Usage(
                "--trigger and --metrics need at least one entry".into(),
            ));
        }
        if args.reports.is_none() && !args.dry_run {
            return Err(WatchError::Usage(
                "--reports DIR is needed to write episodes (or use --dry-run)".into(),
            ));
        }
        if !args.dry_run {
            crate::kernel::privilege::check(true).map_err(|e| WatchError::Usage(e.message))?;
        }
        let mut st = state::State::default();
        if let Some(dir) = &args.reports {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|source| {
                    WatchError::Usage(format!("--reports {}: {source}", dir.display()))
                })?;
            st = state::load(dir)?;
            for n in st.recover() {
                say(&format!(
                    "episode {n} was cut short by the previous watcher's end"
                ));
            }
        }
        let exe = std::env::current_exe().map_err(|source| WatchError::Io {
            path: PathBuf::from("/proc/self/exe"),
            source,
        })?;
        let prometheus = match &args.prometheus {
            Some(addr) => Some(publish::start_prometheus(addr)?),
            None => None,
        };
        let (gpu, sources) = GpuSources::probe(
            Path::new("/sys"),
            args.gpu_cmd.as_deref(),
            !args.no_nvml,
            args.interval.max(Duration::from_secs(5)),
        );
        let th = args.sensitivity.thresholds();
        let stop = Arc::new(AtomicBool::new(false));
        let hup = Arc::new(AtomicBool::new(false));
        crate::signals::set_flags_on_signals(stop.clone(), Some(hup.clone()));
        say(&format!(
            "watching {} every {:?} (judged over {:?}, triggers {}); sources: {}",
            target.describe(),
            args.interval,
            args.judge_window,
            args.trigger
                .iter()
                .map(|t| t.label().as_str())
                .collect::<Vec<_>>()
                .join(","),
            sources.join("; ")
        ));
        Ok(Watcher {
            target,
            exe,
            gpu,
            th,
            stop,
            hup,
            start: Instant::now(),
            started_unix_ms: now_unix_ms(),
            state: st,
            procs: BTreeMap::new(),
            restarts_seen: 0,
            views: Vec::new(),
            phase: Phase::WaitingForTarget,
            running: None,
            episodes_this_run: 0,
            would_trace: 0,
            dry_hold_until: 0.0,
            last_hold_note: None,
            last_heartbeat: None,
            last_episode: None,
            prometheus,
            args,
        })
    }

    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Unix milliseconds of a time on the `start` axis.
    pub fn unix_at(&self, t: f64) -> u64 {
        self.started_unix_ms
            .saturating_add((t.max(0.0) * 1000.0) as u64)
    }

    pub fn run(&mut self) -> Result<(), WatchError> {
        let mut tick: u64 = 0;
        loop {
            if self.stop.load(Ordering::SeqCst) {
                say("stopping (signal)");
                break;
            }
            if self.hup.swap(false, Ordering::SeqCst) {
                say("SIGHUP: state saved, watching on");
                self.save_state()?;
                self.last_heartbeat = None;
            }
            if self
                .args
                .duration
                .is_some_and(|d| self.start.elapsed() >= d)
            {
                say("duration reached");
                break;
            }
            if !self.resolve_target()? {
                break;
            }
            let t = self.now();
            self.sample(t);
            self.poll_episode()?;
            self.judge_and_act(t)?;
            self.publish()?;
            tick += 1;
            let next = self.start + self.args.interval.mul_f64(tick as f64);
            while Instant::now() < next && !self.stop.load(Ordering::SeqCst) {
                std::thread::sleep((next - Instant::now()).min(Duration::from_millis(50)));
            }
        }
        Ok(())
    }

    /// Drops the processes that ended and takes in new ones; false when the
    /// watch should end (a `--pid` gone, after its episode).
    fn resolve_target(&mut self) -> Result<bool, WatchError> {
        let proc_root = Path::new("/proc");
        let gone: Vec<u32> = self
            .procs
            .keys()
            .copied()
            .filter(|p| !procfs::process_alive(proc_root, *p))
            .collect();
        for pid in gone {
            say(&format!("pid {pid} exited"));
            self.procs.remove(&pid);
        }
        let known: BTreeSet<u32> = self.procs.keys().copied().collect();
        let found = self
            .target
            .find(&known, self.restarts_seen > 0)
            .map_err(|source| WatchError::Io {
                path: proc_root.to_path_buf(),
                source,
            })?;
        for pid in found {
            let age = process_age_s(pid).unwrap_or(0.0);
            let judge_from = trigger::judge_from(self.now(), age, self.args.warmup.as_secs_f64());
            if self.restarts_seen > 0 && self.target.single() {
                say(&format!("target restarted: watching pid {pid}"));
            } else {
                say(&format!("watching pid {pid}"));
            }
            self.restarts_seen += 1;
            self.procs.insert(
                pid,
                Watched {
                    judge_from,
                    windows: BTreeMap::new(),
                    placement: crate::tracee::container::Placement::of(pid),
                },
            );
            self.last_hold_note = None;
        }
        if !self.procs.is_empty() {
            return Ok(true);
        }
        if !self.target.waits() {
            // A pid is watched once: the watch ends with it (after the
            // episode in flight, which ends with it too).
            return Ok(self.running.is_some());
        }
        if self.last_hold_note.as_deref() != Some("waiting") {
            say(&format!(
                "waiting for a process: {}",
                self.target.describe()
            ));
            self.last_hold_note = Some("waiting".into());
        }
        self.views.clear();
        self.phase = Phase::WaitingForTarget;
        Ok(true)
    }

    /// Samples every watched process. Device-wide GPU figures belong to a
    /// process only while it is the one watched.
    fn sample(&mut self, t: f64) {
        let proc_root = Path::new("/proc");
        let span = self.args.judge_window.as_secs_f64();
        let cap = ((span / self.args.interval.as_secs_f64()).ceil() as usize + 1).min(4096);
        let devices = if self.procs.len() == 1 {
            self.gpu.sample_devices().0
        } else {
            Vec::new()
        };
        for (pid, watched) in self.procs.iter_mut() {
            let mut push = |family: Family, metric: &str, unit: Unit, value: f64| {
                watched
                    .windows
                    .entry((family, metric.to_string()))
                    .or_insert_with(|| Window::new(family, metric, unit, span, cap))
                    .push(t, value);
            };
            if let Some(s) = procfs::read_process(proc_root, *pid) {
                for (k, v) in &s.memory {
                    push(Family::Process, k, Unit::Bytes, *v);
                }
                if let Some(fds) = s.fds {
                    push(Family::Process, "fds", Unit::Count, fds);
                }
                if let Some(threads) = s.threads {
                    push(Family::Process, "threads", Unit::Count, threads);
                }
            }
            for (k, v) in self.gpu.sample_process(proc_root, *pid) {
                push(Family::Gpu, &k, Unit::Bytes, v);
            }
            for (k, v) in &devices {
                push(Family::Gpu, k, Unit::Bytes, *v);
            }
        }
    }

    pub fn save_state(&self) -> Result<(), WatchError> {
        match &self.args.reports {
            Some(dir) => state::save(dir, &self.state),
            None => Ok(()),
        }
    }

    /// Rewrites the heartbeat when due and updates the Prometheus text.
    fn publish(&mut self) -> Result<(), WatchError> {
        let now = now_unix_ms();
        let window_ms = millis(self.args.window);
        let pids: Vec<u32> = self.procs.keys().copied().collect();
        let heartbeat = Heartbeat {
            format: "memtrace-watch-heartbeat/1",
            unix_ms: now,
            watching_since_unix_ms: self.started_unix_ms,
            phase: self.phase,
            target: self.target.describe(),
            pid: pids.first().copied(),
            pids,
            processes: self
                .procs
                .iter()
                .map(|(&pid, watched)| publish::WatchedProcess {
                    pid,
                    placement: watched.placement.clone(),
                })
                .collect(),
            restarts_seen: self.restarts_seen.saturating_sub(1),
            dry_run: self.args.dry_run,
            metrics: &self.views,
            episodes_total: self.state.next_episode.saturating_sub(1),
            episodes_this_run: self.episodes_this_run,
            would_trace: self.would_trace,
            duty_used_ms: self.state.duty_used_ms(now, window_ms),
            duty_cap_ms: (self.args.max_duty * state::DAY_MS as f64) as u64,
            backoff_until_unix_ms: self.state.backoff_until_unix_ms,
            last_episode: self.last_episode.as_ref(),
        };
        if let Some(tx) = &self.prometheus {
            tx.send_replace(Arc::new(publish::render_prometheus(&heartbeat)));
        }
        let due = self
            .last_heartbeat
            .is_none_or(|at| at.elapsed() >= self.args.heartbeat);
        if due {
            if let Some(dir) = &self.args.reports {
                state::write_json(&dir.join("heartbeat.json"), &heartbeat)?;
            }
            self.last_heartbeat = Some(Instant::now());
        }
        Ok(())
    }

    /// Ends a running episode (it still writes its report) and saves.
    pub fn shutdown(&mut self) {
        if let Some(flight) = self.running.as_mut() {
            say(&format!("episode {}: ending it early", flight.run.number));
            flight.run.interrupt();
            let status = flight.run.wait_bounded(Duration::from_secs(60));
            if let Err(e) = self.complete_episode(status) {
                say(&e.to_string());
            }
        }
        self.last_heartbeat = None;
        if let Err(e) = self.publish().and_then(|()| self.save_state()) {
            say(&e.to_string());
        }
    }
}
