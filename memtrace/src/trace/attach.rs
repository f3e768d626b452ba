//! Stage 2 of a trace, attach: the target chosen (`--pid`), found
//! (`--name`, `--container`, `--cgroup`: the first process selected with
//! something to probe, see [`by_name::first_traceable`]; the others are
//! traced beside it) or started and held (`-- CMD`); the eBPF
//! programs loaded; the probes found and attached in the target, its
//! children and its peers; the trace announced on stderr; the record file
//! and the metrics endpoint opened. What it builds is a [`Trace`], ready for
//! its event loop.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::signal::unix::{signal, SignalKind};

use super::by_name;
use super::discovery::Discovery;
use super::family::Family;
use super::loader::Probes;
use super::pipeline::Pipeline;
use super::plan::{heap_allowed, Plan};
use super::session::{monotonic_ns, read_memory, Session};
use super::{python, Trace, TraceArgs};
use crate::analysis::history::History;
use crate::error::Failure;
use crate::report::{ProcessInfo, TargetInfo};
use crate::symbolize::BlazeSymbolizer;
use crate::tracee::{self, HeldChild};

/// The process a trace starts from.
struct Chosen {
    /// Launch mode: the command, held until its probes are attached.
    held: Option<HeldChild>,
    pid: u32,
    /// With `--name` (`--container`, `--cgroup`): the other processes
    /// selected at the start.
    peers: Vec<u32>,
}

/// `--pid`, the first process of `--name` (`--container`, `--cgroup`), or
/// the command started and held.
fn choose_target(args: &TraceArgs, names: Option<&mut by_name::Watch>) -> anyhow::Result<Chosen> {
    Ok(match (args.pid, names) {
        (Some(pid), _) => {
            tracee::inspect(pid)?;
            Chosen {
                held: None,
                pid,
                peers: Vec::new(),
            }
        }
        (None, Some(watch)) => {
            let found = watch.find(&BTreeSet::new());
            let Some((&first, rest)) = found.split_first() else {
                return Err(Failure::usage(watch.selector().none_running()).into());
            };
            Chosen {
                held: None,
                pid: first,
                peers: rest.to_vec(),
            }
        }
        (None, None) => {
            // The exit check reads every thread's registers: each is traced.
            let child = HeldChild::spawn(&args.command, args.follow_forks, !args.no_leak_check)?;
            let pid = child.pid;
            Chosen {
                held: Some(child),
                pid,
                peers: Vec::new(),
            }
        }
    })
}

impl<'a> Trace<'a> {
    /// Loads and attaches everything the plan names; the trace's clock
    /// starts before the first probe.
    pub async fn attach(args: &'a TraceArgs, plan: Plan) -> anyhow::Result<Trace<'a>> {
        let Plan {
            selector,
            suppressions,
            metrics_addr,
            catalog,
            options,
            output,
        } = plan;
        let mut names = selector.map(by_name::Watch::new);
        let Chosen {
            mut held,
            pid,
            peers,
        } = choose_target(args, names.as_mut())?;

        let loading = Instant::now();
        let mut probes = Probes::load(pid, &options)?;
        if let Some(unwind) = probes.unwind.as_mut() {
            unwind.use_cache(&args.table_cache, args.table_cache_mib << 20);
            unwind.defer_builds(held.is_none() && !args.wait_for_tables);
        }
        log::info!(
            "attach phase: eBPF programs loaded in {} ms",
            loading.elapsed().as_millis()
        );
        // Held to the end of the trace: the kernel counts run time while it is open.
        let bpf_stats = if args.bpf_stats {
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
        // An exec drops the old image's blocks where it happened in the
        // stream; without it, by pid, they stay in the table.
        let exec_reports = probes.watch_execs().err().map(|err| {
            format!(
                "exec reports unavailable ({err:#}): a traced process that runs exec keeps its old image's blocks in the report"
            )
        });
        // The session clock starts before any probe is attached.
        let (started, started_ns) = (Instant::now(), monotonic_ns());
        let kernel_log = if args.verbose > 0 {
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
        // The unwind tables' directory keeps the function search too; a
        // refused one is said once, by the unwinder when it has tables.
        discovery.use_cache(
            &args.table_cache,
            args.table_cache_mib << 20,
            probes.unwind.is_none(),
        );
        // A selection's processes are tried in turn: one with nothing to
        // probe (`docker run --init`'s docker-init) is skipped with a note.
        let candidates: Vec<u32> = std::iter::once(pid).chain(peers).collect();
        // A launched command is held before `exec`: its libraries are not
        // mapped yet when memtrace shares none with it (a static memtrace,
        // another libc); they are probed as `ld.so` maps each, before any
        // of their code runs (`ChildEvent::Mapped`).
        let launching = held.is_some();
        let several = candidates.len() > 1;
        let what = names
            .as_ref()
            .map(|watch| watch.selector().what())
            .unwrap_or_default();
        discovery.hold_warnings = several;
        let mut loaded_for = pid;
        let mut mark = 0;
        let (pid, skipped) = by_name::first_traceable(&candidates, &what, |candidate| {
            if candidate != loaded_for {
                probes.remove_process(loaded_for);
                probes.add_process(candidate)?;
                loaded_for = candidate;
            }
            mark = discovery.problems.len();
            for warning in discovery.add_libraries(candidate, &mut probes, &args.libs)? {
                discovery.warn(warning);
            }
            let scanned = discovery.scan(candidate, &mut probes, &extra);
            // Not `probes.specs()`: a spec is recorded before its attach is tried.
            if scanned.is_ok() && (launching || !discovery.nothing_probed()) {
                return Ok(by_name::Tried::Traced);
            }
            if let Some(unsupported) = discovery.unsupported.take() {
                return Err(Failure::from(unsupported).into());
            }
            let mut why = discovery.take_problems_since(mark);
            match scanned {
                Ok(_) => {}
                Err(err) if several => why.push(format!("cannot read its mappings: {err}")),
                Err(err) => {
                    return Err(anyhow::Error::new(err)
                        .context(format!("cannot read the mappings of pid {candidate}")))
                }
            }
            Ok(by_name::Tried::Nothing {
                comm: tracee::inspect(candidate)
                    .map(|info| info.comm)
                    .unwrap_or_default(),
                why: why.join("; "),
            })
        })?;
        log::info!(
            "attach phase: target chosen, programs loaded, tables and probes in place {} ms after start",
            loading.elapsed().as_millis()
        );
        discovery.release_warnings(mark);
        for skip in &skipped {
            eprintln!("memtrace: {}", skip.note());
        }
        let peers: Vec<u32> = candidates
            .iter()
            .skip_while(|&&candidate| candidate != pid)
            .skip(1)
            .copied()
            .collect();
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
                    placement: tracee::container::Placement::of(pid),
                }
            }
            None => tracee::inspect(pid)?,
        };
        // Signal handlers first: a Ctrl-C right after the announcement must still
        // produce a report.
        let interrupt = signal(SignalKind::interrupt())?;
        let terminate = signal(SignalKind::terminate())?;
        let probed: usize = discovery.libraries.iter().map(|l| l.functions.len()).sum();

        let live = if args.live {
            crate::live::LiveView::start(
                &format!("{} (pid {pid})", target_info.comm),
                crate::sink::Names::full_if(args.full_names),
            )?
        } else {
            None
        };
        let ring = register(probes.events.take().context("ring buffer already taken")?)?;
        let session = Session {
            args,
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
            .with_selector(names.as_ref().map(|watch| watch.selector().clone()))
            .with_skipped(skipped),
            pipeline: Pipeline::new(usize::try_from(args.max_live).unwrap_or(usize::MAX)),
            history: History::default(),
            suppressions,
            symbolizer: BlazeSymbolizer::new(Box::new(move |path| {
                crate::probe::maps::path_in_target_root(pid, path)
            })),
            memory_at_attach: read_memory(pid),
            memory_last: read_memory(pid),
            notes: exec_reports.into_iter().collect(),
            python: python::PythonWatch::default(),
            leak: Default::default(),
            exec_drops: Default::default(),
        };
        let mut trace = Trace {
            args,
            pid,
            metrics: None,
            session,
            ring,
            live,
            interrupt,
            terminate,
            discovery,
            kernel_log,
            _bpf_stats: bpf_stats,
            probes,
            held,
            names,
            output,
        };
        // On a kernel that got the tailcall or compat programs: one line
        // now, a note in every report.
        if let Some(notice) = trace.probes.variant().notice(options.settle_in_kernel) {
            eprintln!("memtrace: {notice}");
            trace.session.notes.push(notice);
        }
        trace.announce(probed, peers)?;
        if let Some(addr) = metrics_addr {
            let (tx, rx) = tokio::sync::watch::channel(Arc::new(String::new()));
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|err| Failure::usage(format!("cannot serve metrics on {addr}: {err}")))?;
            eprintln!("memtrace: Prometheus metrics on http://{addr}/metrics");
            tokio::spawn(crate::prometheus::serve_on(listener, rx));
            trace.metrics = Some(tx);
        }
        Ok(trace)
    }

    /// Announces the trace, then takes in the target's children and the
    /// other processes of the name, and opens the `--record` file.
    fn announce(&mut self, probed: usize, peers: Vec<u32>) -> anyhow::Result<()> {
        let pid = self.pid;
        let session = &mut self.session;
        // The target's mappings now, while it runs: its stacks are normalized
        // against them even when memtrace reads the events after it exited.
        session.pipeline.refresh_space_now(pid);
        // Before the announcement: by pid, Python frames are read from the
        // first allocation traced.
        session.watch_python(&mut self.probes);
        self.probes.start_unwind_builds();
        let building = match self.probes.unwind_pending() {
            0 => String::new(),
            n => format!(
                "; {n} unwind tables still building (stacks reaching them are cut, and counted, until they are in)"
            ),
        };
        eprintln!(
            "memtrace: tracing pid {pid} ({}): {probed} functions in {} objects; Ctrl-C to stop{building}",
            session.target.comm,
            self.discovery.libraries.len()
        );
        // Children the target already has.
        session.look_at_children(pid, None, &mut self.probes, &mut self.discovery);
        session.family.reset_seen();
        // The other processes of the name.
        for peer in peers {
            session.adopt_named(peer, false, &mut self.probes, &mut self.discovery);
        }
        if let Some(path) = &self.args.record {
            session.pipeline.recorder = Some(crate::record::Recorder::create(
                path,
                &session.target,
                session.started_ns,
            )?);
        }
        Ok(())
    }
}

/// Registers a descriptor-owning value with the reactor for readability.
fn register<T: std::os::fd::AsRawFd>(inner: T) -> std::io::Result<AsyncFd<T>> {
    // SAFETY: `inner` (the ring buffer or the log reader) owns its descriptor,
    // keeps it open and returns the same one until it is dropped, which happens
    // only when the AsyncFd is dropped.
    unsafe { AsyncFd::register_with_interest(inner, Interest::READABLE) }
        .map_err(std::io::Error::from)
}
