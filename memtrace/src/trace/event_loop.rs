//! Stage 3 of a trace, the event loop: the one loop that reads the ring
//! buffer (decode -> live table) when the kernel wakes it and every
//! [`DRAIN_EVERY`], and between reads watches the traced processes (exits,
//! forks, `exec`s, new processes of the name), rescans their mappings for
//! newly loaded libraries, snapshots the table for trends, refreshes the
//! interim report, the live view, the status line and the metrics, and
//! serves the held command's stops (launch mode). It ends on Ctrl-C,
//! SIGTERM, `--duration`, `q` in the live view, or when every traced
//! process is gone.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;

use super::loader::Probes;
use super::status::StatusLine;
use super::{usdt_probes, Trace};
use crate::report;
use crate::tracee::{ChildEvent, HeldChild};

/// How often the target's mappings are rescanned for newly loaded libraries.
const RESCAN_EVERY: Duration = Duration::from_millis(500);
/// How long an interval's leak check waits for the launched command's
/// supervisor to stop it (it may be busy with a stop the loop answers).
const CHECK_STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// How often `/proc` is searched for processes that took the `--name` (or
/// joined the `--container`, the `--cgroup`).
const NAME_POLL_EVERY: Duration = Duration::from_millis(250);
/// Children are looked for every this many rescans (it may scan all of /proc).
const CHILDREN_EVERY_RESCANS: u64 = 4;
/// Snapshot period for trends when no `--interval` is given.
const DEFAULT_HISTORY_EVERY: Duration = Duration::from_secs(1);
/// What waits in the ring buffer below the kernel's wakeup threshold is
/// drained this often.
pub const DRAIN_EVERY: Duration = Duration::from_millis(20);
/// How often the Prometheus text is refreshed.
const METRICS_EVERY: Duration = Duration::from_secs(2);

/// Whether the loop goes on after an event.
#[derive(PartialEq, Eq)]
enum Next {
    Continue,
    Stop,
}

impl Trace<'_> {
    /// Runs until the trace should stop; what it read stays in the session.
    pub async fn event_loop(&mut self) -> anyhow::Result<()> {
        // `--duration` counts from when every probe is in place: attaching to a
        // large program on a loaded machine can take seconds of its own.
        let deadline = self.args.duration.map(|d| Instant::now() + d);
        let mut drain_tick = ticker(DRAIN_EVERY);
        let mut rescan = ticker(RESCAN_EVERY);
        let mut rescans: u64 = 0;
        let mut name_tick = ticker(NAME_POLL_EVERY);
        let mut status_tick = ticker(Duration::from_secs(1));
        let mut snapshot = ticker(self.args.interval.unwrap_or(DEFAULT_HISTORY_EVERY));
        snapshot.reset();
        let mut metrics_tick = ticker(METRICS_EVERY);
        let show_status = std::io::stderr().is_terminal() && self.live.is_none();
        let mut status = StatusLine::new(show_status);

        // Announced already; here too for a trace that starts without.
        self.probes.start_unwind_builds();
        let mut first_event_logged = false;
        loop {
            if let (false, Some(at)) = (first_event_logged, self.session.pipeline.first_event_at) {
                first_event_logged = true;
                log::info!(
                    "attach phase: first event {} ms after the probes' clock started",
                    at.saturating_duration_since(self.session.started)
                        .as_millis()
                );
            }
            tokio::select! {
                guard = self.ring.readable_mut() => {
                    let mut guard = guard?;
                    self.session.pipeline.drain(guard.get_inner_mut(), &self.probes);
                    guard.clear_ready();
                    self.session.adopt_forks(&mut self.probes, &mut self.discovery);
                }
                _ = drain_tick.tick() => {
                    self.probes.take_unwind_ready();
                    self.session.watch_python(&mut self.probes);
                    self.session.pipeline.drain(self.ring.get_mut(), &self.probes);
                    self.session.adopt_forks(&mut self.probes, &mut self.discovery);
                }
                _ = rescan.tick() => {
                    rescans += 1;
                    if self.rescan(rescans) == Next::Stop {
                        break;
                    }
                }
                _ = name_tick.tick(), if self.names.is_some() => {
                    if let Some(watch) = self.names.as_mut() {
                        for found in watch.find(&self.session.family.known()) {
                            self.session.adopt_named(found, true, &mut self.probes, &mut self.discovery);
                        }
                    }
                }
                _ = status_tick.tick(), if show_status => {
                    let table = self.session.pipeline.table();
                    let counts = table.counts();
                    status.update(self.session.started.elapsed(), counts.allocs + counts.frees,
                        table.live_bytes(), lost(&self.probes));
                }
                _ = snapshot.tick() => self.take_snapshot()?,
                event = crate::live::next_event(&mut self.live) => {
                    let action = self.live.as_mut().map(|view| view.handle(event));
                    match action {
                        Some(crate::live::Action::Quit) => break,
                        Some(crate::live::Action::Redraw) => crate::live::redraw(&mut self.live),
                        _ => {}
                    }
                }
                _ = metrics_tick.tick(), if self.metrics.is_some() => {
                    if let Some(tx) = &self.metrics {
                        let mut report = self.session.report(&self.probes, &self.discovery);
                        self.output.stamp(&mut report);
                        let _ = tx.send(Arc::new(crate::prometheus::render(&report)));
                    }
                }
                event = child_event(&mut self.held) => {
                    if self.handle_child_event(event) == Next::Stop {
                        break;
                    }
                }
                Some(guard) = log_ready(&mut self.kernel_log) => {
                    if let Ok(mut guard) = guard {
                        guard.get_inner_mut().flush();
                        guard.clear_ready();
                    }
                }
                _ = self.interrupt.recv() => break,
                _ = self.terminate.recv() => break,
                _ = sleep_until(deadline) => break,
            }
        }
        status.clear();
        Ok(())
    }

    /// The rescan tick (the `rescans`th): the processes' exits and `exec`s,
    /// their children every [`CHILDREN_EVERY_RESCANS`], and newly loaded
    /// libraries and USDT probes.
    fn rescan(&mut self, rescans: u64) -> Next {
        let pid = self.pid;
        let (session, probes, discovery) =
            (&mut self.session, &mut self.probes, &mut self.discovery);
        if self.held.is_none() && session.target_gone(pid, probes, self.ring.get_mut()) {
            return Next::Stop;
        }
        if let Some(memory) = super::session::read_memory(pid) {
            session.memory_last = Some(memory);
        }
        session.follow_execs(probes);
        for gone in session
            .family
            .reap(probes, &mut session.pipeline, self.ring.get_mut())
        {
            session.python.forget(gone, probes);
            let who = if session.family.selector().is_some() {
                "pid"
            } else {
                "child pid"
            };
            eprintln!("memtrace: {who} {gone} exited; its probes are detached");
        }
        if rescans.is_multiple_of(CHILDREN_EVERY_RESCANS) {
            for parent in session.family.running().collect::<Vec<_>>() {
                session.look_at_children(parent, None, probes, discovery);
            }
        }
        if self.held.is_none() && session.family.running().next().is_none() {
            eprintln!("memtrace: every traced process exited; final report follows");
            return Next::Stop;
        }
        let (known, known_usdt) = (discovery.libraries.len(), discovery.usdt.len());
        for traced in session.family.running().collect::<Vec<_>>() {
            if let Err(err) = discovery.scan(traced, probes, &[]) {
                log::debug!("rescan of pid {traced}: {err}");
            }
        }
        for library in &discovery.libraries[known..] {
            eprintln!(
                "memtrace: probing newly loaded {} ({} functions)",
                library.path.display(),
                library.functions.len()
            );
        }
        usdt_probes::say_new(&discovery.usdt[known_usdt..]);
        Next::Continue
    }

    /// The snapshot tick: the table recorded for trends, then the interim
    /// report to the live view or (with `--interval`) the output.
    fn take_snapshot(&mut self) -> anyhow::Result<()> {
        // A snapshot covers every event made before it, even when
        // memtrace was behind (stopped, or the ring became readable
        // in the same instant).
        self.session
            .pipeline
            .drain(self.ring.get_mut(), &self.probes);
        self.session.snapshot(&self.probes);
        if self.args.interval.is_some() {
            match self.held.as_ref() {
                // Launch mode: with --leak-check, the supervisor stops the
                // command (it holds it with ptrace).
                Some(held) if self.args.leak_check => {
                    if let Some(stop) = held.stop_for_check(CHECK_STOP_TIMEOUT) {
                        self.session.leak_check_held(
                            stop,
                            self.ring.get_mut(),
                            &self.probes,
                            crate::report::leak::CheckPoint::Interval,
                        );
                    }
                }
                Some(_) => {}
                None => self.session.leak_check_live(
                    self.ring.get_mut(),
                    &self.probes,
                    crate::report::leak::CheckPoint::Interval,
                ),
            }
        }
        if let Some(view) = self.live.as_mut() {
            let mut report = self.session.report(&self.probes, &self.discovery);
            report.interim = true;
            if self.args.interval.is_some() {
                self.output.offer(&report);
            }
            view.update(&report);
            crate::live::redraw(&mut self.live);
        } else if self.args.interval.is_some() {
            let mut report = self.session.report(&self.probes, &self.discovery);
            report.interim = true;
            self.output.interim(&mut report)?;
        }
        Ok(())
    }

    /// A stop of the held command (launch mode), answered once handled.
    fn handle_child_event(&mut self, event: ChildEvent) -> Next {
        let pid = self.pid;
        let session = &mut self.session;
        match event {
            ChildEvent::Exiting {
                pid: exiting,
                threads,
                ack,
            } => {
                // A process of the command is stopped just before exit:
                // read its mappings and the events so far while they
                // still exist, and judge its blocks (the leak check).
                session.pipeline.refresh_space_now(exiting);
                session.pipeline.drain(self.ring.get_mut(), &self.probes);
                session.follow_execs(&mut self.probes);
                session.leak_check_exiting(exiting, threads, self.ring.get_mut(), &self.probes);
                if exiting == pid {
                    if let Some(memory) = super::session::read_memory(pid) {
                        session.memory_last = Some(memory);
                    }
                }
                let _ = ack.send(());
            }
            ChildEvent::Exec { pid: replaced, ack } => {
                // Every event of the old image is in the ring by now: its
                // blocks are settled, then dropped with its address space.
                session
                    .pipeline
                    .drain_all(self.ring.get_mut(), &self.probes);
                session.note_exec_drops();
                // Without the exec reports (`task_exec`), the stream had no
                // exec event: dropped here, at the stop.
                let (blocks, bytes) = session.pipeline.forget_blocks(replaced);
                session.note_exec_drop(replaced, blocks, bytes);
                let _ = ack.send(());
            }
            ChildEvent::Mapped { pid: mapped, ack } => {
                if let Ok(mappings) = crate::probe::maps::read(mapped) {
                    self.probes.update_unwind(mapped, &mappings);
                    session.pipeline.observe_mappings(mapped, &mappings);
                }
                // A library mapped by ld.so is probed before its code runs.
                let known = self.discovery.libraries.len();
                if let Err(err) = self.discovery.scan(mapped, &mut self.probes, &[]) {
                    log::debug!("scan of pid {mapped} at a mapping: {err}");
                }
                for library in &self.discovery.libraries[known..] {
                    log::info!(
                        "probing {} ({} functions), mapped by the command",
                        library.path.display(),
                        library.functions.len()
                    );
                }
                session
                    .python
                    .check_now(mapped, &mut self.probes, session.pipeline.stacks_mut());
                let _ = ack.send(());
            }
            ChildEvent::Forked { parent, child, ack } => {
                session.pipeline.drain(self.ring.get_mut(), &self.probes);
                session.adopt_held(child, parent, &mut self.probes, &mut self.discovery);
                let _ = ack.send(());
            }
            ChildEvent::Exited(exit) => {
                session.notes.push(format!("command exited: {exit}"));
                session.family.let_go(
                    pid,
                    &mut self.probes,
                    &mut session.pipeline,
                    self.ring.get_mut(),
                );
                if !session.family.children_running() {
                    return Next::Stop;
                }
                eprintln!("memtrace: the command exited; still tracing its child processes");
                self.held = None;
            }
        }
        Next::Continue
    }
}

/// Events lost on the way to memtrace, all causes together (the status line).
fn lost(probes: &Probes) -> u64 {
    let counters = probes.counters();
    report::LOST_CAUSES
        .iter()
        .map(|cause| counters.get(*cause).copied().unwrap_or(0))
        .sum()
}

/// A periodic timer that, after a stall (memtrace stopped or starved),
/// fires once and then keeps its cadence instead of bursting to catch up:
/// a burst would print interim reports back to back, none of them newer.
fn ticker(period: Duration) -> tokio::time::Interval {
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    ticker
}

async fn child_event(held: &mut Option<HeldChild>) -> ChildEvent {
    match held {
        Some(child) => child.next_event().await,
        None => std::future::pending().await,
    }
}

async fn log_ready<T: std::os::fd::AsRawFd>(
    log: &mut Option<AsyncFd<T>>,
) -> Option<std::io::Result<tokio::io::unix::AsyncFdReadyMutGuard<'_, T>>> {
    match log {
        Some(fd) => Some(fd.readable_mut().await),
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
