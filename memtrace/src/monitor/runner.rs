//! The sampling loop: ticks at a fixed interval, samples system and GPU
//! figures plus each watched process, follows processes by name across
//! restarts (a new pid opens a new segment), and launches a command once or
//! for several cycles with a baseline before and a settle window after each
//! run. A process or source that disappears becomes a gap with a note.

use std::collections::HashSet;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::monitor::error::MonitorError;
use crate::monitor::series::{Family, Meta, Recording, Run, Unit};
use crate::monitor::sources::gpu::GpuSources;
use crate::monitor::sources::procfs;

/// What to watch.
#[derive(Clone, Debug)]
pub enum Target {
    Pid(u32),
    Name(String),
    Command(Vec<String>),
}

/// How to sample.
pub struct Config {
    pub target: Target,
    pub interval: Duration,
    pub duration: Option<Duration>,
    pub settle: Duration,
    pub cycles: u32,
    pub proc_root: PathBuf,
    pub gpu: GpuSources,
    pub progress: bool,
}

/// Baseline samples taken before the first run of a command.
const BASELINE_SAMPLES: u32 = 3;

struct Sampler<'a> {
    cfg: &'a Config,
    stop: &'a AtomicBool,
    rec: Recording,
    start: Instant,
    tick: u64,
    bar: Option<ProgressBar>,
    last_gpu_errors: Vec<String>,
    meminfo_failed: bool,
}

/// Human text for an exit status: (code, signal, core dumped, text).
pub fn describe_status(status: ExitStatus) -> (Option<i32>, Option<i32>, bool, String) {
    if let Some(code) = status.code() {
        return (Some(code), None, false, format!("exited {code}"));
    }
    let signal = status.signal();
    let core = status.core_dumped();
    let text = match signal {
        Some(sig) => {
            let name = match sig {
                1 => " (SIGHUP)",
                2 => " (SIGINT)",
                3 => " (SIGQUIT)",
                4 => " (SIGILL)",
                6 => " (SIGABRT)",
                7 => " (SIGBUS)",
                8 => " (SIGFPE)",
                9 => " (SIGKILL)",
                11 => " (SIGSEGV)",
                13 => " (SIGPIPE)",
                15 => " (SIGTERM)",
                _ => "",
            };
            let dumped = if core { ", core dumped" } else { "" };
            format!("killed by signal {sig}{name}{dumped}")
        }
        None => format!("{status}"),
    };
    (None, signal, core, text)
}

impl<'a> Sampler<'a> {
    fn new(cfg: &'a Config, meta: Meta, stop: &'a AtomicBool) -> Sampler<'a> {
        let bar = cfg.progress.then(|| {
            let (bar, template) = match cfg.duration {
                Some(d) => (
                    ProgressBar::new(d.as_millis() as u64),
                    "{elapsed_precise} [{wide_bar}] {percent}% left {eta_precise}  {msg}",
                ),
                None => (
                    ProgressBar::new_spinner(),
                    "{spinner} {elapsed_precise}  {msg}",
                ),
            };
            if let Ok(style) = ProgressStyle::with_template(template) {
                bar.set_style(style);
            }
            bar.set_draw_target(ProgressDrawTarget::stderr());
            bar
        });
        Sampler {
            cfg,
            stop,
            rec: Recording::new(meta),
            start: Instant::now(),
            tick: 0,
            bar,
            last_gpu_errors: Vec::new(),
            meminfo_failed: false,
        }
    }

    fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Prints a line (above the progress bar) and records it as a note.
    fn say(&mut self, t: f64, text: String) {
        match &self.bar {
            Some(bar) => bar.println(format!("memtrace: {text}")),
            None => eprintln!("memtrace: {text}"),
        }
        self.rec.note(t, text);
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    fn deadline_passed(&self) -> bool {
        self.cfg.duration.is_some_and(|d| self.start.elapsed() >= d)
    }

    /// Sleeps until the next tick; false if stopped meanwhile.
    fn wait_next(&mut self) -> bool {
        let interval = self.cfg.interval.as_secs_f64();
        let elapsed = self.now();
        self.tick = (self.tick + 1).max((elapsed / interval).ceil() as u64);
        let target = self.start + self.cfg.interval.mul_f64(self.tick as f64);
        loop {
            if self.stopped() {
                return false;
            }
            let now = Instant::now();
            if now >= target {
                return true;
            }
            std::thread::sleep((target - now).min(Duration::from_millis(50)));
        }
    }

    fn sample_global(&mut self, t: f64) {
        match procfs::read_meminfo(&self.cfg.proc_root) {
            Ok(values) => {
                for (k, v) in values {
                    self.rec.record(Family::System, &k, Unit::Bytes, 0, t, v);
                }
                self.meminfo_failed = false;
            }
            Err(e) => {
                let note = format!("meminfo unreadable: {e}");
                self.rec.close_missing(Family::System, 0, t, &note);
                if !self.meminfo_failed {
                    self.say(t, note);
                }
                self.meminfo_failed = true;
            }
        }
        let (values, errors) = self.cfg.gpu.sample_devices();
        for (k, v) in values {
            self.rec.record(Family::Gpu, &k, Unit::Bytes, 0, t, v);
        }
        let note = if errors.is_empty() {
            "metric no longer reported".to_string()
        } else {
            errors.join("; ")
        };
        self.rec.close_missing(Family::Gpu, 0, t, &note);
        if errors != self.last_gpu_errors {
            if !errors.is_empty() {
                self.say(t, format!("gpu source error: {note}"));
            }
            self.last_gpu_errors = errors;
        }
        if let Some(bar) = &self.bar {
            if self.cfg.duration.is_some() {
                bar.set_position(self.start.elapsed().as_millis() as u64);
            } else {
                bar.tick();
            }
        }
    }

    /// Samples one process; false when it is gone.
    fn sample_process(&mut self, segment: u32, pid: u32, t: f64) -> bool {
        let Some(sample) = procfs::read_process(&self.cfg.proc_root, pid) else {
            return false;
        };
        for (k, v) in &sample.memory {
            self.rec
                .record(Family::Process, k, Unit::Bytes, segment, t, *v);
        }
        if let Some(fds) = sample.fds {
            self.rec
                .record(Family::Process, "fds", Unit::Count, segment, t, fds);
        }
        if let Some(threads) = sample.threads {
            self.rec
                .record(Family::Process, "threads", Unit::Count, segment, t, threads);
        }
        for (k, v) in self.cfg.gpu.sample_process(&self.cfg.proc_root, pid) {
            self.rec.record(Family::Gpu, &k, Unit::Bytes, segment, t, v);
        }
        self.rec
            .close_missing(Family::Process, segment, t, "metric no longer reported");
        self.rec
            .close_missing(Family::Gpu, segment, t, "metric no longer reported");
        if let (Some(bar), Some((_, rss))) =
            (&self.bar, sample.memory.iter().find(|(k, _)| k == "VmRSS"))
        {
            bar.set_message(format!(
                "pid {pid} VmRSS {}",
                crate::monitor::units::format_bytes(*rss)
            ));
        }
        true
    }

    fn finish(self) -> Recording {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        self.rec
    }

    fn run_pid(&mut self, pid: u32) -> Result<(), MonitorError> {
        if !procfs::process_alive(&self.cfg.proc_root, pid) {
            return Err(MonitorError::NoSuchPid(pid));
        }
        let (comm, _) = procfs::process_names(&self.cfg.proc_root, pid);
        let seg = self
            .rec
            .open_segment(pid, comm.as_deref().unwrap_or("?"), self.now());
        loop {
            let t = self.now();
            self.sample_global(t);
            if !self.sample_process(seg, pid, t) {
                self.rec.close_segment(seg, t, "process exited");
                self.say(t, format!("pid {pid} exited"));
                break;
            }
            if self.deadline_passed() || !self.wait_next() {
                break;
            }
        }
        Ok(())
    }

    fn run_name(&mut self, name: &str) -> Result<(), MonitorError> {
        let own = std::process::id();
        let mut active: Vec<(u32, u32)> = Vec::new();
        let mut done: HashSet<u32> = HashSet::new();
        let mut said_waiting = false;
        loop {
            let t = self.now();
            self.sample_global(t);
            match procfs::find_by_name(&self.cfg.proc_root, name, own) {
                Ok(pids) => {
                    for pid in pids {
                        if done.contains(&pid) || active.iter().any(|(_, p)| *p == pid) {
                            continue;
                        }
                        let seg = self.rec.open_segment(pid, name, t);
                        active.push((seg, pid));
                        self.say(t, format!("following pid {pid} ({name}) as segment {seg}"));
                    }
                }
                Err(e) => {
                    return Err(MonitorError::Root {
                        what: "proc",
                        path: self.cfg.proc_root.clone(),
                        source: e,
                    })
                }
            }
            let mut still = Vec::new();
            for (seg, pid) in std::mem::take(&mut active) {
                if self.sample_process(seg, pid, t) {
                    still.push((seg, pid));
                } else {
                    self.rec.close_segment(seg, t, "process exited");
                    self.say(
                        t,
                        format!("pid {pid} ({name}) exited, segment {seg} closed"),
                    );
                    done.insert(pid);
                }
            }
            active = still;
            if active.is_empty() && !said_waiting {
                self.say(t, format!("waiting for a process named '{name}'"));
                said_waiting = true;
            } else if !active.is_empty() {
                said_waiting = false;
            }
            if self.deadline_passed() || !self.wait_next() {
                break;
            }
        }
        Ok(())
    }

    fn record_run(&mut self, cycle: u32, pid: u32, start_s: f64, status: ExitStatus, seg: u32) {
        let t = self.now();
        let (exit_code, signal, core_dumped, text) = describe_status(status);
        self.rec.close_segment(seg, t, &text);
        self.rec.runs.push(Run {
            cycle,
            pid,
            start_s,
            end_s: t,
            exit_code,
            signal,
            core_dumped,
            status: text.clone(),
        });
        self.say(
            t,
            format!("cycle {cycle}: pid {pid} {text} after {:.1}s", t - start_s),
        );
    }

    fn spawn(cmd: &[String]) -> Result<Child, MonitorError> {
        let (program, args) = cmd
            .split_first()
            .ok_or_else(|| MonitorError::Usage("empty command".into()))?;
        Command::new(program)
            .args(args)
            .spawn()
            .map_err(|source| MonitorError::Spawn {
                cmd: program.clone(),
                source,
            })
    }

    fn run_command(&mut self, cmd: &[String]) -> Result<(), MonitorError> {
        // Baseline before the first run.
        for i in 0..BASELINE_SAMPLES {
            let t = self.now();
            self.sample_global(t);
            if i + 1 < BASELINE_SAMPLES && !self.wait_next() {
                return Ok(());
            }
        }
        let cycles = self.cfg.cycles.max(1);
        let name = cmd
            .first()
            .and_then(|c| c.rsplit('/').next())
            .unwrap_or("?")
            .to_string();
        for cycle in 1..=cycles {
            if !self.wait_next() {
                return Ok(());
            }
            let mut child = match Self::spawn(cmd) {
                Ok(c) => c,
                Err(e) if cycle == 1 => return Err(e),
                Err(e) => {
                    let t = self.now();
                    self.say(t, format!("cycle {cycle}: {e}"));
                    return Ok(());
                }
            };
            let pid = child.id();
            let start_s = self.now();
            let seg = self.rec.open_segment(pid, &name, start_s);
            self.say(
                start_s,
                format!("cycle {cycle}/{cycles}: started pid {pid}"),
            );
            let mut finished = false;
            loop {
                let t = self.now();
                self.sample_global(t);
                self.sample_process(seg, pid, t);
                match child.try_wait() {
                    Ok(Some(status)) => {
                        self.record_run(cycle, pid, start_s, status, seg);
                        break;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        self.say(t, format!("cannot wait for pid {pid}: {e}"));
                        finished = true;
                        break;
                    }
                }
                let interrupted = self.stopped();
                if self.deadline_passed() || interrupted {
                    let why = if interrupted {
                        "interrupted"
                    } else {
                        "duration reached"
                    };
                    self.say(t, format!("{why}: killing pid {pid}"));
                    let _ = child.kill();
                    match child.wait() {
                        Ok(status) => self.record_run(cycle, pid, start_s, status, seg),
                        Err(e) => self.say(t, format!("cannot wait for pid {pid}: {e}")),
                    }
                    finished = true;
                    break;
                }
                if !self.wait_next() {
                    continue; // stopped: the check above kills the child
                }
            }
            // Settle: keep sampling system-wide figures.
            let settle_end = self.now() + self.cfg.settle.as_secs_f64();
            while !self.stopped() && self.wait_next() {
                let t = self.now();
                self.sample_global(t);
                if t >= settle_end {
                    break;
                }
            }
            if finished || self.stopped() {
                break;
            }
        }
        Ok(())
    }
}

/// Samples until the target ends, the duration passes, or `stop` is set.
pub fn run(cfg: &Config, meta: Meta, stop: &AtomicBool) -> Result<Recording, MonitorError> {
    let mut sampler = Sampler::new(cfg, meta, stop);
    let result = match &cfg.target {
        Target::Pid(pid) => sampler.run_pid(*pid),
        Target::Name(name) => sampler.run_name(name),
        Target::Command(cmd) => sampler.run_command(cmd),
    };
    let rec = sampler.finish();
    result.map(|()| rec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_are_described() {
        let (code, sig, core, text) = describe_status(ExitStatus::from_raw(3 << 8));
        assert_eq!(
            (code, sig, core, text.as_str()),
            (Some(3), None, false, "exited 3")
        );
        let (code, sig, core, text) = describe_status(ExitStatus::from_raw(11 | 0x80));
        assert_eq!((code, sig, core), (None, Some(11), true));
        assert_eq!(text, "killed by signal 11 (SIGSEGV), core dumped");
        let (_, sig, core, _) = describe_status(ExitStatus::from_raw(9));
        assert_eq!((sig, core), (Some(9), false));
    }
}
