//! Tracing a process (and with `--follow-forks` its descendants, with
//! `--name`, `--container` or `--cgroup` every process of a name, container
//! or cgroup, including those that start later): load,
//! attach, run the one event loop (ring buffer -> decode -> live table), watch
//! the processes, rescan for new libraries, snapshot the table every interval,
//! and hand the state to the report builder and the chosen sink (and the
//! Prometheus endpoint).

mod args;
mod by_name;
pub mod discovery;
mod family;
mod held;
mod kernel_support;
pub mod loader;
mod pipeline;
mod python;
mod status;
pub mod usdt_attach;
pub mod usdt_probes;

use std::collections::BTreeSet;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::signal::unix::{signal, SignalKind};

use crate::analysis::history::History;
use crate::analysis::Suppressions;
use crate::error::Failure;
use crate::output::Output;
use crate::probe::catalog::Allocator;
use crate::report::{self, ProcessInfo, Reconciliation, Settings, TargetInfo};
use crate::symbolize::BlazeSymbolizer;
use crate::target::{self, ChildEvent, HeldChild};
use discovery::Discovery;
use family::{Adoption, Family, Tools};
use loader::{DetachStage, LoadOptions, Probes};
use memtrace_common::unwind::STACK_MODE_DWARF;
use pipeline::Pipeline;

use args::StackMode;
pub use args::TraceArgs;

/// How often the target's mappings are rescanned for newly loaded libraries.
const RESCAN_EVERY: Duration = Duration::from_millis(500);
/// How often `/proc` is searched for processes that took the `--name` (or
/// joined the `--container`, the `--cgroup`).
const NAME_POLL_EVERY: Duration = Duration::from_millis(250);
/// Children are looked for every this many rescans (it may scan all of /proc).
const CHILDREN_EVERY_RESCANS: u64 = 4;
/// Snapshot period for trends when no `--interval` is given.
const DEFAULT_HISTORY_EVERY: Duration = Duration::from_secs(1);
/// The kernel wakes the reader only once this much waits in the ring buffer
/// (one wakeup per ~1300 events instead of one per event); the rest is drained
/// every [`DRAIN_EVERY`].
const WAKEUP_BYTES: u64 = 64 << 10;
const DRAIN_EVERY: Duration = Duration::from_millis(20);
/// At the end of a trace, releases are still watched this long after the
/// allocation probes are detached (and again after the reallocation probes),
/// so blocks made just before the end and released just after are not
/// reported live.
const DETACH_GRACE: Duration = Duration::from_millis(50);
/// How long after the window closes releases of blocks made before it are
/// still applied (a block in use at that moment and freed just after is not
/// reported live), and programs that read the flag just before it flipped
/// finish.
const WINDOW_SETTLE: Duration = Duration::from_millis(50);
/// How often the Prometheus text is refreshed.
const METRICS_EVERY: Duration = Duration::from_secs(2);

/// Runs `memtrace [--pid PID | --name NAME | -- CMD]`.
pub async fn run(args: TraceArgs) -> anyhow::Result<()> {
    let selector = by_name::Selector::from_args(
        args.name.as_deref(),
        args.container.as_deref(),
        args.cgroup.as_deref(),
    )?;
    if args.pid.is_none() && selector.is_none() && args.command.is_empty() {
        return Err(Failure::usage(
            "nothing to trace: give --pid PID, --name NAME, --container ID, --cgroup PATH, or -- CMD [ARGS...] (see memtrace --help)",
        )
        .into());
    }
    let suppressions = match &args.suppress {
        Some(path) => {
            Some(Suppressions::load(path).map_err(|err| Failure::usage(err.to_string()))?)
        }
        None => None,
    };
    let metrics_addr = match &args.prometheus {
        Some(text) => Some(crate::prometheus::parse_bind(text).map_err(Failure::usage)?),
        None => None,
    };
    let catalog = catalog_for(&args)?;
    crate::kernel::privilege::check(args.command.is_empty())?;
    let output = Output::open(args.output.as_deref(), args.format)?;

    let mut names = selector.map(by_name::Watch::new);
    // With --name (--container, --cgroup): the first process selected is
    // the target, the others are traced beside it.
    let mut peers = Vec::new();
    let (mut held, pid) = match (args.pid, names.as_mut()) {
        (Some(pid), _) => {
            target::inspect(pid)?;
            (None, pid)
        }
        (None, Some(watch)) => {
            let found = watch.find(&BTreeSet::new());
            let Some((&first, rest)) = found.split_first() else {
                return Err(Failure::usage(watch.selector().none_running()).into());
            };
            peers = rest.to_vec();
            (None, first)
        }
        (None, None) => {
            let child = HeldChild::spawn(&args.command, args.follow_forks)?;
            let pid = child.pid;
            (Some(child), pid)
        }
    };

    let options = LoadOptions {
        stack_mode: match (args.stack_depth, args.stacks) {
            (0, _) => memtrace_common::unwind::STACK_MODE_NONE,
            (_, StackMode::Fp) => memtrace_common::unwind::STACK_MODE_FP,
            (_, StackMode::Dwarf) => memtrace_common::unwind::STACK_MODE_DWARF,
        },
        stack_depth: args.stack_depth,
        unwind: crate::unwind::kernel::Capacity::from_mib(
            args.unwind_table_mib,
            args.max_processes.saturating_add(1),
        ),
        sample_rate: args.sample_rate,
        min_size: args.min_size,
        max_size: args.max_size.unwrap_or(u64::MAX),
        null_mode: args.null_probes,
        ring_bytes: args.ring_mib << 20,
        stack_entries: args.stack_map_entries,
        wakeup_bytes: WAKEUP_BYTES,
        settle_in_kernel: !args.no_settle,
    };
    let mut probes = Probes::load(pid, &options)?;
    // Held to the end of the trace: the kernel counts run time while it is open.
    let _bpf_stats = if args.bpf_stats {
        Some(
            aya::sys::enable_stats(aya::sys::Stats::RunTime).map_err(|err| {
                Failure::runtime(format!(
                    "--bpf-stats: the kernel refused to turn on BPF statistics: {err}"
                ))
            })?,
        )
    } else {
        None
    };
    // Before any probe, so a fork during attach is still reported. Without
    // --follow-forks the reports only name the children in a note.
    match probes.watch_forks() {
        Ok(()) => {}
        Err(err) if args.follow_forks => {
            return Err(Failure::runtime(format!(
                "--follow-forks: cannot watch for forks: {err:#}"
            ))
            .into());
        }
        Err(err) => log::warn!("fork reports unavailable, children found by polling: {err:#}"),
    }
    // The session clock starts before any probe is attached.
    let (started, started_ns) = (Instant::now(), monotonic_ns());
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
    let mut discovery = Discovery::new(exclude, !args.entry_probes, catalog);
    discovery.heap_allowed = heap_allowed(&args.allocators);
    for warning in discovery.add_libraries(pid, &mut probes, &args.libs)? {
        eprintln!("memtrace: warning: {warning}");
        discovery.problems.push(warning);
    }
    discovery
        .scan(pid, &mut probes, &extra)
        .with_context(|| format!("cannot read the mappings of pid {pid}"))?;
    // Not `probes.specs()`: a spec is recorded before its attach is tried.
    if discovery.libraries.iter().all(|l| l.functions.is_empty()) && discovery.usdt.is_empty() {
        if let Some(unsupported) = discovery.unsupported.take() {
            return Err(Failure::from(unsupported).into());
        }
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
                placement: target::container::Placement::of(pid),
            }
        }
        None => target::inspect(pid)?,
    };
    // Signal handlers first: a Ctrl-C right after the announcement must still
    // produce a report.
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let probed: usize = discovery.libraries.iter().map(|l| l.functions.len()).sum();

    let mut live = if args.live {
        crate::live::LiveView::start(&format!("{} (pid {pid})", target_info.comm))?
    } else {
        None
    };
    let mut ring = register(probes.events.take().context("ring buffer already taken")?)?;
    let mut session = Session {
        args: &args,
        target: target_info.clone(),
        started,
        ended: None,
        started_ns,
        family: Family::new(
            pid,
            ProcessInfo {
                pid,
                comm: target_info.comm.clone(),
                exe: target_info.exe.clone(),
                placement: target_info.placement.clone(),
                ..ProcessInfo::default()
            },
            args.follow_forks,
            args.max_processes,
        )
        .with_selector(names.as_ref().map(|watch| watch.selector().clone())),
        pipeline: Pipeline::new(usize::try_from(args.max_live).unwrap_or(usize::MAX)),
        history: History::default(),
        suppressions,
        symbolizer: BlazeSymbolizer::new(Box::new(move |path| {
            crate::probe::maps::path_in_target_root(pid, path)
        })),
        memory_at_attach: read_memory(pid),
        memory_last: read_memory(pid),
        notes: Vec::new(),
        python: python::PythonWatch::default(),
    };
    // On a kernel that got the compat programs: one line now, a note in
    // every report.
    if let Some(notice) = probes.variant().notice(
        options.stack_mode == STACK_MODE_DWARF,
        options.settle_in_kernel,
    ) {
        eprintln!("memtrace: {notice}");
        session.notes.push(notice);
    }
    // The target's mappings now, while it runs: its stacks are normalized
    // against them even when memtrace reads the events after it exited.
    session.pipeline.refresh_space_now(pid);
    // Before the announcement: by pid, Python frames are read from the
    // first allocation traced.
    session.watch_python(&mut probes);
    eprintln!(
        "memtrace: tracing pid {pid} ({}): {probed} functions in {} objects; Ctrl-C to stop",
        target_info.comm,
        discovery.libraries.len()
    );
    // Children the target already has.
    session.look_at_children(pid, None, &mut probes, &mut discovery);
    session.family.reset_seen();
    // The other processes of the name.
    for peer in peers {
        session.adopt_named(peer, false, &mut probes, &mut discovery);
    }
    if let Some(path) = &args.record {
        session.pipeline.recorder = Some(crate::record::Recorder::create(
            path,
            &session.target,
            session.started_ns,
        )?);
    }
    let metrics = match metrics_addr {
        Some(addr) => {
            let (tx, rx) = tokio::sync::watch::channel(Arc::new(String::new()));
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|err| Failure::usage(format!("cannot serve metrics on {addr}: {err}")))?;
            eprintln!("memtrace: Prometheus metrics on http://{addr}/metrics");
            tokio::spawn(crate::prometheus::serve_on(listener, rx));
            Some(tx)
        }
        None => None,
    };

    // `--duration` counts from when every probe is in place: attaching to a
    // large program on a loaded machine can take seconds of its own.
    let deadline = args.duration.map(|d| Instant::now() + d);
    let mut drain_tick = ticker(DRAIN_EVERY);
    let mut rescan = ticker(RESCAN_EVERY);
    let mut rescans: u64 = 0;
    let mut name_tick = ticker(NAME_POLL_EVERY);
    let mut status_tick = ticker(Duration::from_secs(1));
    let mut snapshot = ticker(args.interval.unwrap_or(DEFAULT_HISTORY_EVERY));
    snapshot.reset();
    let mut metrics_tick = ticker(METRICS_EVERY);
    let show_status = std::io::stderr().is_terminal() && live.is_none();
    let mut status = status::StatusLine::new(show_status);

    loop {
        tokio::select! {
            guard = ring.readable_mut() => {
                let mut guard = guard?;
                session.pipeline.drain(guard.get_inner_mut(), &probes);
                guard.clear_ready();
                session.adopt_forks(&mut probes, &mut discovery);
            }
            _ = drain_tick.tick() => {
                session.watch_python(&mut probes);
                session.pipeline.drain(ring.get_mut(), &probes);
                session.adopt_forks(&mut probes, &mut discovery);
            }
            _ = rescan.tick() => {
                if held.is_none() && session.target_gone(pid, &mut probes, ring.get_mut()) {
                    break;
                }
                if let Some(memory) = read_memory(pid) {
                    session.memory_last = Some(memory);
                }
                session.follow_execs(&mut probes);
                rescans += 1;
                for gone in session.family.reap(&mut probes, &mut session.pipeline, ring.get_mut()) {
                    session.python.forget(gone, &mut probes);
                    let who = if session.family.selector().is_some() {
                        "pid"
                    } else {
                        "child pid"
                    };
                    eprintln!("memtrace: {who} {gone} exited; its probes are detached");
                }
                if rescans.is_multiple_of(CHILDREN_EVERY_RESCANS) {
                    for parent in session.family.running().collect::<Vec<_>>() {
                        session.look_at_children(parent, None, &mut probes, &mut discovery);
                    }
                }
                if held.is_none() && session.family.running().next().is_none() {
                    eprintln!("memtrace: every traced process exited; final report follows");
                    break;
                }
                let (known, known_usdt) = (discovery.libraries.len(), discovery.usdt.len());
                for traced in session.family.running().collect::<Vec<_>>() {
                    if let Err(err) = discovery.scan(traced, &mut probes, &[]) {
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
            }
            _ = name_tick.tick(), if names.is_some() => {
                if let Some(watch) = names.as_mut() {
                    for found in watch.find(&session.family.known()) {
                        session.adopt_named(found, true, &mut probes, &mut discovery);
                    }
                }
            }
            _ = status_tick.tick(), if show_status => {
                let counts = session.pipeline.table().counts();
                status.update(session.started.elapsed(), counts.allocs + counts.frees,
                    session.pipeline.table().live_bytes(), lost(&probes));
            }
            _ = snapshot.tick() => {
                // A snapshot covers every event made before it, even when
                // memtrace was behind (stopped, or the ring became readable
                // in the same instant).
                session.pipeline.drain(ring.get_mut(), &probes);
                session.snapshot(&probes);
                if let Some(view) = live.as_mut() {
                    let mut report = session.report(&probes, &discovery);
                    report.interim = true;
                    view.update(&report);
                    crate::live::redraw(&mut live);
                } else if args.interval.is_some() {
                    let mut report = session.report(&probes, &discovery);
                    report.interim = true;
                    output.interim(&report)?;
                }
            }
            event = crate::live::next_event(&mut live) => {
                let action = live.as_mut().map(|view| view.handle(event));
                match action {
                    Some(crate::live::Action::Quit) => break,
                    Some(crate::live::Action::Redraw) => crate::live::redraw(&mut live),
                    _ => {}
                }
            }
            _ = metrics_tick.tick(), if metrics.is_some() => {
                if let Some(tx) = &metrics {
                    let report = session.report(&probes, &discovery);
                    let _ = tx.send(Arc::new(crate::prometheus::render(&report)));
                }
            }
            event = child_event(&mut held) => match event {
                ChildEvent::Exiting { pid: exiting, ack } => {
                    // A process of the command is stopped just before exit:
                    // read its mappings and the events so far while they
                    // still exist.
                    session.pipeline.refresh_space_now(exiting);
                    session.pipeline.drain(ring.get_mut(), &probes);
                    session.follow_execs(&mut probes);
                    if exiting == pid {
                        if let Some(memory) = read_memory(pid) {
                            session.memory_last = Some(memory);
                        }
                    }
                    let _ = ack.send(());
                }
                ChildEvent::Mapped { pid: mapped, ack } => {
                    if let Ok(mappings) = crate::probe::maps::read(mapped) {
                        probes.update_unwind(mapped, &mappings);
                        session.pipeline.observe_mappings(mapped, &mappings);
                    }
                    let _ = ack.send(());
                }
                ChildEvent::Forked { parent, child, ack } => {
                    session.pipeline.drain(ring.get_mut(), &probes);
                    session.adopt_held(child, parent, &mut probes, &mut discovery);
                    let _ = ack.send(());
                }
                ChildEvent::Exited(exit) => {
                    session.notes.push(format!("command exited: {exit}"));
                    session.family.let_go(pid, &mut probes, &mut session.pipeline, ring.get_mut());
                    if !session.family.children_running() {
                        break;
                    }
                    eprintln!("memtrace: the command exited; still tracing its child processes");
                    held = None;
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
    // The terminal is given back before the final report is written.
    drop(live);
    session.ended = Some((Instant::now(), monotonic_ns()));
    let ended_ns = session.ended.map_or_else(monotonic_ns, |e| e.1);
    // The window closes in one step: the programs stop recording
    // allocations (releases of earlier blocks still count for a short
    // grace), what they sent is read and what the kernel holds is taken,
    // and the report is the state at this moment. Detaching (seconds for
    // many probes) comes after the report is written.
    let closed = probes.close_window();
    if closed {
        // A program that read the flag just before it flipped finishes
        // within microseconds.
        tokio::time::sleep(WINDOW_SETTLE).await;
        session.pipeline.drain_all(ring.get_mut(), &probes);
    }
    session.pipeline.close(ended_ns);
    if !closed {
        let watched = session.family.running().next().is_some();
        probes.mark_ending();
        for stage in DetachStage::ORDER {
            let detaching = probes.detach_stage(stage);
            close_while_draining(detaching, &mut session, &mut ring, &probes).await;
            if watched && stage != DetachStage::Releases {
                tokio::time::sleep(DETACH_GRACE).await;
                session.pipeline.drain(ring.get_mut(), &probes);
            }
        }
        let detaching = probes.detach();
        close_while_draining(detaching, &mut session, &mut ring, &probes).await;
    }
    session.snapshot(&probes);
    let report = session.report(&probes, &discovery);
    if let Some(tx) = &metrics {
        let _ = tx.send(Arc::new(crate::prometheus::render(&report)));
    }
    if let Some(recorder) = session.pipeline.recorder.take() {
        let ended_ns = session.ended.map_or_else(monotonic_ns, |e| e.1);
        recorder.finish(&report, ended_ns, session.pipeline.thread_names())?;
    }
    output.finish(&report)?;
    if closed {
        // Nothing is recorded any more: the probes only need to go.
        let detaching = probes.detach();
        let _ = tokio::task::spawn_blocking(move || detaching.close_at_once()).await;
    }
    Ok(())
}

/// Detaches probes on a blocking thread while the event loop keeps reading
/// the ring buffer: closing a uprobe waits for an RCU grace period (seconds
/// for a few dozen in a VM), and a busy target fills the ring meanwhile, so
/// releases after the end would otherwise be lost.
async fn close_while_draining(
    detaching: loader::Detaching,
    session: &mut Session<'_>,
    ring: &mut AsyncFd<aya::maps::RingBuf<aya::maps::MapData>>,
    probes: &Probes,
) {
    let mut closing = tokio::task::spawn_blocking(move || detaching.close());
    loop {
        tokio::select! {
            _ = &mut closing => break,
            _ = tokio::time::sleep(DRAIN_EVERY) => session.pipeline.drain(ring.get_mut(), probes),
        }
    }
    session.pipeline.drain_all(ring.get_mut(), probes);
}

/// The heap allocators `--allocators` names (empty: all).
fn heap_allowed(names: &[String]) -> Vec<Allocator> {
    names
        .iter()
        .filter_map(|n| Allocator::parse_builtin(n.trim()))
        .filter(|a| a.is_heap())
        .collect()
}

/// The functions to probe: the built-in catalogue (restricted by
/// `--allocators`) plus the pairs of `--pairs` files and `--preset`s.
fn catalog_for(args: &TraceArgs) -> Result<Vec<&'static crate::probe::catalog::FuncDef>, Failure> {
    use crate::probe::{catalog, pairs};
    let mut wanted = Vec::new();
    for name in &args.allocators {
        let allocator = Allocator::parse_builtin(name.trim()).ok_or_else(|| {
            Failure::usage(format!(
                "--allocators: unknown allocator '{name}' (libc, jemalloc, tcmalloc, mimalloc, mmap, cuda, cuda-driver, acl, python)"
            ))
        })?;
        wanted.push(allocator);
    }
    // The standard heap names are looked for whenever any heap allocator is
    // wanted: which allocator they are depends on the object defining them
    // (see `Discovery::heap_allowed`).
    let any_heap = wanted.iter().any(|a| a.is_heap());
    let python = wanted.contains(&Allocator::Python);
    let mut defs: Vec<&'static catalog::FuncDef> = catalog::CATALOG
        .iter()
        .filter(|def| {
            if wanted.is_empty() {
                def.allocator.by_default()
            } else {
                wanted.contains(&def.allocator) || (def.allocator == Allocator::Libc && any_heap)
            }
        })
        .map(|def| {
            if python && def.allocator == Allocator::Libc {
                // malloc inside PyObject_Malloc is the same block: counted once.
                let nested: &'static catalog::FuncDef =
                    Box::leak(Box::new(def.nested_under(Allocator::Python.family())));
                nested
            } else {
                def
            }
        })
        .collect();
    // Prefixed allocator builds (je_malloc, _rjem_mallocx, --symbol-prefix).
    let mut prefixes: Vec<String> = catalog::JEMALLOC_PREFIXES
        .iter()
        .map(|p| p.to_string())
        .collect();
    for prefix in &args.symbol_prefix {
        if prefix.is_empty()
            || !prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(Failure::usage(format!(
                "--symbol-prefix: '{prefix}' is not a symbol prefix (letters, digits, '_')"
            )));
        }
        if !prefixes.contains(prefix) {
            prefixes.push(prefix.clone());
        }
    }
    let base = defs.clone();
    for prefix in &prefixes {
        defs.extend(catalog::prefixed(prefix, &base));
    }
    let mut sources: Vec<(String, String)> = Vec::new();
    for name in &args.preset {
        let text = pairs::preset(name).ok_or_else(|| {
            let known: Vec<&str> = pairs::PRESETS.iter().map(|(n, _)| *n).collect();
            Failure::usage(format!(
                "--preset: unknown preset '{name}' ({})",
                known.join(", ")
            ))
        })?;
        sources.push((format!("preset {name}"), text.to_string()));
    }
    for path in &args.pairs {
        let text = std::fs::read_to_string(path)
            .map_err(|err| Failure::usage(format!("--pairs {}: {err}", path.display())))?;
        sources.push((path.display().to_string(), text));
    }
    // All sources at once: pairs from different files that name the same
    // release function share it.
    let declared = pairs::parse_sources(&sources).map_err(|err| Failure::usage(err.to_string()))?;
    // A function the user declared in a pair is theirs, even when the
    // catalogue knows its name (a pool's `je_malloc`).
    defs.retain(|def| !declared.iter().any(|pair| pair.name == def.name));
    defs.extend(declared);
    Ok(defs)
}

/// VmRSS and RssAnon of a process, in bytes.
#[derive(Clone, Copy, Debug)]
struct MemoryFigures {
    vm_rss: u64,
    rss_anon: u64,
}

fn read_memory(pid: u32) -> Option<MemoryFigures> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    };
    Some(MemoryFigures {
        vm_rss: field("VmRSS:")?,
        rss_anon: field("RssAnon:")?,
    })
}

/// Everything one trace accumulates.
struct Session<'a> {
    args: &'a TraceArgs,
    target: TargetInfo,
    started: Instant,
    /// When tracing stopped (the report's duration ends there, not when it is built).
    ended: Option<(Instant, u64)>,
    started_ns: u64,
    pipeline: Pipeline,
    history: History,
    suppressions: Option<Suppressions>,
    symbolizer: BlazeSymbolizer,
    memory_at_attach: Option<MemoryFigures>,
    memory_last: Option<MemoryFigures>,
    /// The target and the children it is followed into.
    family: Family,
    notes: Vec<String>,
    python: python::PythonWatch,
}

impl Session<'_> {
    /// Looks for CPython in the running traced processes that are due.
    fn watch_python(&mut self, probes: &mut Probes) {
        for pid in self.family.running().collect::<Vec<_>>() {
            self.python.poll(pid, probes, self.pipeline.stacks_mut());
        }
    }

    /// Notices a traced process running another image (`exec`, same pid):
    /// the probes stay (they follow the process), the address map is re-read
    /// so new stacks are symbolized against the new image, and the report
    /// says so.
    fn follow_execs(&mut self, probes: &mut Probes) {
        let target = self.target.pid;
        for pid in self.family.running().collect::<Vec<_>>() {
            let Some((exe, was)) = self.family.follow_exec(pid, &mut self.pipeline) else {
                continue;
            };
            // The kernel's unwinder gets the new image's mappings now, not
            // at the first stack that meets them.
            if let Ok(mappings) = crate::probe::maps::read(pid) {
                probes.update_unwind(pid, &mappings);
                self.pipeline.observe_mappings(pid, &mappings);
            }
            let who = if pid == target {
                "target pid"
            } else {
                "child pid"
            };
            let note = format!("{who} {pid} now runs {exe} (exec; was {was})");
            eprintln!("memtrace: {note}");
            self.notes.push(note);
            if pid == target {
                match target::inspect(pid) {
                    Ok(info) => self.target = info,
                    Err(_) => self.target.exe = exe,
                }
            }
        }
    }

    /// Checks the target itself (attach mode); true when tracing should stop
    /// because it is gone and no followed child runs.
    fn target_gone(&mut self, pid: u32, probes: &mut Probes, ring: &mut RingBuf<MapData>) -> bool {
        if self.family.target_exited() {
            return false;
        }
        let reused = if !target::is_alive(pid) {
            false
        } else if target::start_time(pid) != self.family.target_start() {
            true
        } else {
            return false;
        };
        self.notes.push(if reused {
            format!("target pid {pid} exited and the pid was reused by another process")
        } else {
            format!("target pid {pid} exited during the trace")
        });
        self.family.let_go(pid, probes, &mut self.pipeline, ring);
        if self.family.children_running() {
            if self.family.selector().is_some() {
                eprintln!("memtrace: target pid {pid} exited; still tracing the other processes");
            } else {
                eprintln!("memtrace: target pid {pid} exited; still tracing its child processes");
            }
            return false;
        }
        eprintln!(
            "memtrace: target pid {pid} exited{}; final report follows",
            if reused { " (pid reused)" } else { "" }
        );
        true
    }

    /// Handles the forks the kernel reported since the last drain, and gives
    /// the unwinder the new mappings of processes it found out of date.
    fn adopt_forks(&mut self, probes: &mut Probes, discovery: &mut Discovery) {
        for pid in std::mem::take(&mut self.pipeline.stale_maps) {
            if let Ok(mappings) = crate::probe::maps::read(pid) {
                probes.update_unwind(pid, &mappings);
                self.pipeline.observe_mappings(pid, &mappings);
            }
        }
        self.family
            .forks_reported(std::mem::take(&mut self.pipeline.forks_reported));
        for (parent, forked_ns) in std::mem::take(&mut self.pipeline.forks) {
            self.look_at_children(parent, Some(forked_ns), probes, discovery);
        }
    }

    /// Adopts (or notes) the children of a traced process.
    fn look_at_children(
        &mut self,
        parent: u32,
        forked_ns: Option<u64>,
        probes: &mut Probes,
        discovery: &mut Discovery,
    ) {
        let seen = self.with_tools(probes, discovery, |family, tools| {
            family.look_at_children(parent, forked_ns, tools)
        });
        for (child, parent, adoption) in seen {
            say_adoption(child, parent, &adoption);
        }
    }

    /// Adopts a process found by `--name`; `late`: found after tracing started.
    fn adopt_named(
        &mut self,
        pid: u32,
        late: bool,
        probes: &mut Probes,
        discovery: &mut Discovery,
    ) {
        let adoption = self.with_tools(probes, discovery, |family, tools| {
            family.adopt_named(pid, late, tools)
        });
        let reason = self
            .family
            .selector()
            .map(|selector| selector.reason())
            .unwrap_or_default();
        match adoption {
            Adoption::Followed => {
                let comm = target::inspect(pid).map(|t| t.comm).unwrap_or_default();
                let since = if late {
                    " and started during the trace"
                } else {
                    ""
                };
                eprintln!("memtrace: tracing pid {pid} ({comm}) too: {reason}{since}");
            }
            Adoption::Known => {}
            other => eprintln!("memtrace: pid {pid} ({reason}): {other}"),
        }
    }

    /// Adopts a child that launch mode holds at birth.
    fn adopt_held(
        &mut self,
        child: u32,
        parent: u32,
        probes: &mut Probes,
        discovery: &mut Discovery,
    ) {
        let adoption = self.with_tools(probes, discovery, |family, tools| {
            family.adopt(child, parent, None, true, tools)
        });
        say_adoption(child, parent, &adoption);
    }

    /// Runs `adopt` on the family with what adopting a child needs.
    fn with_tools<T>(
        &mut self,
        probes: &mut Probes,
        discovery: &mut Discovery,
        adopt: impl FnOnce(&mut Family, &mut Tools<'_>) -> T,
    ) -> T {
        let now = self.clock();
        let mut tools = Tools {
            probes,
            pipeline: &mut self.pipeline,
            discovery,
            now: &now,
        };
        adopt(&mut self.family, &mut tools)
    }

    /// (milliseconds since tracing started, monotonic ns), for adoption records.
    fn clock(&self) -> impl Fn() -> (u64, u64) {
        let started = self.started;
        move || {
            let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            (ms, monotonic_ns())
        }
    }

    /// Records the live table for the trend analysis.
    fn snapshot(&mut self, probes: &Probes) {
        let t_s = self.started.elapsed().as_secs_f64();
        self.history.record(
            self.pipeline.table(),
            probes.specs(),
            self.pipeline.stacks(),
            t_s,
        );
        if let Some(recorder) = self.pipeline.recorder.as_mut() {
            recorder.snapshot(t_s);
        }
    }

    fn report(&mut self, probes: &Probes, discovery: &Discovery) -> report::Report {
        let mut notes = self.notes.clone();
        notes.extend(discovery.problems.iter().cloned());
        notes.extend(crate::target::files::note());
        notes.extend(self.family.notes());
        let exited = self.pipeline.exited_threads();
        if !exited.is_empty() {
            const SHOWN: usize = 10;
            let shown: Vec<String> = exited.iter().take(SHOWN).map(u32::to_string).collect();
            notes.push(format!(
                "{} allocating thread(s) exited during the trace (tids {}{}); their blocks stay attributed to them",
                exited.len(),
                shown.join(", "),
                if exited.len() > SHOWN { ", ..." } else { "" }
            ));
        }
        // The figures as of now, not of the last rescan (up to 500 ms old).
        if let Some(memory) = read_memory(self.target.pid) {
            self.memory_last = Some(memory);
        }
        let reconciliation = self.reconciliation(probes);
        if let Some(note) = reconciliation
            .as_ref()
            .and_then(|r| unexplained_growth(r, discovery))
        {
            notes.insert(0, note);
        }
        let args = self.args;
        let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let input = report::ReportInput {
            target: self.target.clone(),
            duration_ms: millis(self.ended.map_or_else(Instant::now, |e| e.0) - self.started),
            now_ns: self.ended.map_or_else(monotonic_ns, |e| e.1),
            started_ns: self.started_ns,
            table: self.pipeline.table(),
            specs: probes.specs(),
            stacks: self.pipeline.stacks(),
            history: Some(&self.history),
            suppressions: self.suppressions.as_ref(),
            thread_names: self.pipeline.thread_names(),
            kernel_counters: probes.counters(),
            libraries: discovery
                .libraries
                .iter()
                .filter_map(|l| serde_json::to_value(l).ok())
                .collect(),
            missing_functions: discovery.missing_functions(),
            settings: Settings {
                stack_depth: args.stack_depth,
                min_age_ms: millis(args.min_age),
                top: args.top,
                sample_rate: args.sample_rate,
                min_size: args.min_size,
                max_size: args.max_size,
                warmup_ms: millis(args.warmup),
                interval_ms: args.interval.map(millis),
                suppress_file: args.suppress.as_ref().map(|p| p.display().to_string()),
            },
            notes,
            reconciliation,
            processes: self.family.processes(),
            attach_failures: probes.attach_failures.clone(),
        };
        let mut report = report::build(input, &mut self.symbolizer);
        report.unwind = probes.unwind.as_ref().map(|unwind| unwind.summary());
        if self.args.bpf_stats {
            report.bpf_programs = probes.program_costs();
        }
        report.device_cache = usdt_probes::device_cache(
            &discovery.usdt,
            self.pipeline.table(),
            probes.specs(),
            &self.pipeline.usdt_tags,
        );
        report.usdt = discovery
            .usdt
            .iter()
            .filter_map(|plan| serde_json::to_value(plan).ok())
            .collect();
        report
    }

    fn reconciliation(&self, probes: &Probes) -> Option<Reconciliation> {
        let (start, now) = (self.memory_at_attach?, self.memory_last?);
        // The target's own blocks: the memory figures are its.
        let tracked = |allocator: &dyn Fn(Allocator) -> bool| -> u64 {
            self.pipeline
                .table()
                .blocks()
                .filter(|(pid, _, _, block)| {
                    *pid == self.target.pid
                        && probes
                            .specs()
                            .get(usize::from(block.spec))
                            .is_some_and(|s| allocator(s.allocator))
                })
                .map(|(_, _, _, block)| block.size)
                .sum()
        };
        let tracked_host_bytes = tracked(&|a: Allocator| a.is_heap());
        let growth = now.rss_anon as i64 - start.rss_anon as i64;
        let explained_ratio = (growth > 0).then(|| tracked_host_bytes as f64 / growth as f64);
        Some(Reconciliation {
            rss_anon_at_attach: start.rss_anon,
            rss_anon_now: now.rss_anon,
            rss_anon_growth: growth,
            vm_rss_at_attach: start.vm_rss,
            vm_rss_now: now.vm_rss,
            tracked_host_bytes,
            tracked_mmap_bytes: tracked(&|a: Allocator| a == Allocator::Mmap),
            explained_ratio,
            note: "tracked heap bytes are what was allocated since attach and is still live; memory allocated before attach, allocator overhead, freed-but-cached heap and untraced allocators are not in it; mappings count virtual size".to_string(),
        })
    }
}

/// RssAnon growth below this is never called unexplained (allocator caches,
/// stacks, page-table noise).
const UNEXPLAINED_MIN_GROWTH: i64 = 8 << 20;

/// "No silent nothing": the target's RssAnon grew by more than a few MiB
/// while the traced allocators hold (almost) none of it, so it likely
/// allocates through something memtrace does not know. Names what was probed.
fn unexplained_growth(r: &Reconciliation, discovery: &Discovery) -> Option<String> {
    let tracked = r.tracked_host_bytes.saturating_add(r.tracked_mmap_bytes);
    let growth = r.rss_anon_growth;
    if growth < UNEXPLAINED_MIN_GROWTH || tracked.saturating_mul(10) >= growth.unsigned_abs() {
        return None;
    }
    let probed: Vec<String> = discovery
        .libraries
        .iter()
        .map(|l| match l.allocator {
            Some(allocator) => format!("{} ({allocator})", l.path.display()),
            None => l.path.display().to_string(),
        })
        .collect();
    Some(format!(
        "unexplained memory: RssAnon grew by {} MiB during the trace but the traced allocators \
         hold only {} KiB of it; the target may allocate through an allocator memtrace does not \
         know (probed: {}); --lib PATH or --symbol-prefix PREFIX adds one",
        growth >> 20,
        tracked >> 10,
        if probed.is_empty() {
            "nothing".to_string()
        } else {
            probed.join(", ")
        }
    ))
}

/// One stderr line per child memtrace saw.
fn say_adoption(child: u32, parent: u32, adoption: &Adoption) {
    match adoption {
        Adoption::Followed => eprintln!("memtrace: following child pid {child} of pid {parent}"),
        Adoption::Known => {}
        other => eprintln!("memtrace: child pid {child} of pid {parent}: {other}"),
    }
}

fn lost(probes: &Probes) -> u64 {
    let counters = probes.counters();
    report::LOST_CAUSES
        .iter()
        .map(|cause| counters.get(*cause).copied().unwrap_or(0))
        .sum()
}

/// Registers a descriptor-owning value with the reactor for readability.
/// A periodic timer that, after a stall (memtrace stopped or starved),
/// fires once and then keeps its cadence instead of bursting to catch up:
/// a burst would print interim reports back to back, none of them newer.
fn ticker(period: Duration) -> tokio::time::Interval {
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    ticker
}

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
