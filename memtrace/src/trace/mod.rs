//! Tracing a process: load, attach, run the one event loop (ring buffer ->
//! decode -> live table), watch the target, rescan for new libraries, and
//! hand the final state to the report builder and the chosen sink.

pub mod discovery;
pub mod loader;
mod pipeline;
mod status;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::signal::unix::{signal, SignalKind};

use crate::cli::TraceArgs;
use crate::error::{check_privilege, Failure};
use crate::output::Output;
use crate::report::{self, Settings, TargetInfo};
use crate::target::{self, ChildEvent, HeldChild};
use discovery::Discovery;
use loader::{LoadOptions, Probes};
use pipeline::Pipeline;

/// How often the target's mappings are rescanned for newly loaded libraries.
const RESCAN_EVERY: Duration = Duration::from_millis(500);

/// Runs `memtrace [--pid PID | -- CMD]`.
pub async fn run(args: TraceArgs) -> anyhow::Result<()> {
    if args.pid.is_none() && args.command.is_empty() {
        return Err(Failure::usage(
            "nothing to trace: give --pid PID, or -- CMD [ARGS...] (see memtrace --help)",
        )
        .into());
    }
    check_privilege()?;
    let output = Output::open(args.output.as_deref(), args.format)?;

    let (mut held, pid) = match args.pid {
        Some(pid) => {
            target::inspect(pid)?;
            (None, pid)
        }
        None => {
            let child = HeldChild::spawn(&args.command)?;
            let pid = child.pid;
            (Some(child), pid)
        }
    };

    let options = LoadOptions {
        stacks: args.stack_depth > 0,
        sample_rate: args.sample_rate,
        min_size: args.min_size,
        max_size: args.max_size.unwrap_or(u64::MAX),
        null_mode: args.null_probes,
        ring_bytes: args.ring_mib << 20,
        stack_entries: 16384,
        wakeup_bytes: 0,
    };
    let mut probes = Probes::load(pid, &options)?;
    let mut kernel_log = if args.verbose > 0 {
        aya_log::EbpfLogger::init(probes.ebpf_mut())
            .ok()
            .and_then(|logger| register(logger).ok())
    } else {
        None
    };

    let own_exe = std::env::current_exe().ok();
    let (exclude, extra): (Option<PathBuf>, Vec<PathBuf>) = match &held {
        Some(child) => (own_exe, child.program.iter().cloned().collect()),
        None => (None, Vec::new()),
    };
    let mut discovery = Discovery::new(pid, exclude, !args.entry_probes);
    discovery
        .scan(&mut probes, &extra)
        .with_context(|| format!("cannot read the mappings of pid {pid}"))?;
    if probes.specs().is_empty() {
        let why = discovery.problems.join("; ");
        return Err(Failure::runtime(format!(
            "found no allocator function to probe in pid {pid}{}",
            if why.is_empty() {
                String::new()
            } else {
                format!(": {why}")
            }
        ))
        .into());
    }
    for library in &discovery.libraries {
        log::info!(
            "probing {} ({} functions)",
            library.path.display(),
            library.functions.len()
        );
    }

    let target_info = match &mut held {
        Some(child) => {
            child.release()?;
            let exe = child
                .program
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| args.command[0].clone());
            TargetInfo {
                pid,
                comm: exe.rsplit('/').next().unwrap_or(&exe).to_string(),
                exe,
            }
        }
        None => target::inspect(pid)?,
    };

    let probed: usize = discovery.libraries.iter().map(|l| l.functions.len()).sum();
    eprintln!(
        "memtrace: tracing pid {pid} ({}): {probed} functions in {} objects; Ctrl-C to stop",
        target_info.comm,
        discovery.libraries.len()
    );
    let mut ring = register(probes.events.take().context("ring buffer already taken")?)?;
    let mut pipeline = Pipeline::new(pid);
    let started = Instant::now();
    let deadline = args.duration.map(|d| started + d);
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut rescan = tokio::time::interval(RESCAN_EVERY);
    let mut status_tick = tokio::time::interval(Duration::from_secs(1));
    let mut interim = tokio::time::interval(args.interval.unwrap_or(Duration::from_secs(3600)));
    interim.reset();
    let show_status = std::io::stderr().is_terminal();
    let mut status = status::StatusLine::new(show_status);
    let mut notes: Vec<String> = Vec::new();

    loop {
        tokio::select! {
            guard = ring.readable_mut() => {
                let mut guard = guard?;
                pipeline.drain(guard.get_inner_mut(), &probes);
                guard.clear_ready();
            }
            _ = rescan.tick() => {
                if held.is_none() && !target::is_alive(pid) {
                    notes.push(format!("target pid {pid} exited during the trace"));
                    eprintln!("memtrace: target pid {pid} exited; final report follows");
                    break;
                }
                let known = discovery.libraries.len();
                match discovery.scan(&mut probes, &[]) {
                    Ok(0) => {}
                    Ok(count) => {
                        for library in &discovery.libraries[known..] {
                            eprintln!(
                                "memtrace: probing newly loaded {} ({count} functions)",
                                library.path.display()
                            );
                        }
                    }
                    Err(err) => log::debug!("rescan: {err}"),
                }
            }
            _ = status_tick.tick(), if show_status => {
                status.update(started.elapsed(), pipeline.table().counts().allocs + pipeline.table().counts().frees,
                    pipeline.table().live_bytes(), lost(&probes));
            }
            _ = interim.tick(), if args.interval.is_some() => {
                let report = build_report(&args, &target_info, started, &pipeline, &probes, &discovery, notes.clone());
                output.interim(&report)?;
            }
            event = child_event(&mut held) => match event {
                ChildEvent::Exiting(ack) => {
                    // The command is stopped just before exit: read its
                    // mappings and the events so far while they still exist.
                    pipeline.refresh_space_now();
                    pipeline.drain(ring.get_mut(), &probes);
                    let _ = ack.send(());
                }
                ChildEvent::Exited(exit) => {
                    notes.push(format!("command exited: {exit}"));
                    break;
                }
            },
            Some(guard) = log_ready(&mut kernel_log) => {
                if let Ok(mut guard) = guard {
                    guard.get_inner_mut().flush();
                    guard.clear_ready();
                }
            }
            _ = interrupt.recv() => break,
            _ = terminate.recv() => break,
            _ = sleep_until(deadline) => break,
        }
    }
    status.clear();
    probes.detach();
    pipeline.drain(ring.get_mut(), &probes);
    let report = build_report(
        &args,
        &target_info,
        started,
        &pipeline,
        &probes,
        &discovery,
        notes,
    );
    output.finish(&report)?;
    Ok(())
}

fn lost(probes: &Probes) -> u64 {
    let counters = probes.counters();
    report::LOST_CAUSES
        .iter()
        .map(|cause| counters.get(*cause).copied().unwrap_or(0))
        .sum()
}

/// Registers a descriptor-owning value with the reactor for readability.
fn register<T: std::os::fd::AsRawFd>(inner: T) -> std::io::Result<AsyncFd<T>> {
    // SAFETY: `inner` (the ring buffer or the log reader) owns its descriptor,
    // keeps it open and returns the same one until it is dropped, which happens
    // only when the AsyncFd is dropped.
    unsafe { AsyncFd::register_with_interest(inner, Interest::READABLE) }
        .map_err(std::io::Error::from)
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

fn build_report(
    args: &TraceArgs,
    target: &TargetInfo,
    started: Instant,
    pipeline: &Pipeline,
    probes: &Probes,
    discovery: &Discovery,
    notes: Vec<String>,
) -> report::Report {
    let pid = target.pid;
    let mut symbolizer = crate::symbolize::BlazeSymbolizer::new(Box::new(move |path| {
        crate::probe::maps::path_in_target_root(pid, path)
    }));
    let mut notes = notes;
    notes.extend(discovery.problems.iter().cloned());
    let input = report::ReportInput {
        target: target.clone(),
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        now_ns: monotonic_ns(),
        table: pipeline.table(),
        specs: probes.specs(),
        stacks: pipeline.stacks(),
        kernel_counters: probes.counters(),
        libraries: discovery.libraries.clone(),
        missing_functions: discovery.missing_functions(),
        settings: Settings {
            stack_depth: args.stack_depth,
            min_age_ms: u64::try_from(args.min_age.as_millis()).unwrap_or(u64::MAX),
            top: args.top,
            sample_rate: args.sample_rate,
        },
        notes,
        timeline: Vec::new(),
    };
    report::build(input, &mut symbolizer)
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for clock_gettime to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64
}
