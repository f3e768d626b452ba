//! Tracing a process (and with `--follow-forks` its descendants, with
//! `--name`, `--container` or `--cgroup` every process of a name, container
//! or cgroup, including those that start later). [`run`] takes a trace
//! through its stages, each in a module of its own:
//!
//! 1. [`plan`]: the arguments checked and turned into what is traced and
//!    how, before anything is loaded;
//! 2. [`attach`]: the target chosen or started, the eBPF programs loaded,
//!    the probes attached, the trace announced: a [`Trace`];
//! 3. [`event_loop`]: the one loop (ring buffer -> decode -> live table)
//!    that watches the processes, rescans for new libraries, snapshots the
//!    table every interval and keeps the interim outputs fresh;
//! 4. [`end`]: the window closed, the rest read, the final report written
//!    (to the chosen sink, the record file and the Prometheus endpoint),
//!    the probes detached.
//!
//! What a trace accumulates is its [`session`]; [`reporting`] turns it into
//! a report. Below them: [`discovery`] (what to probe in a process),
//! [`loader`] (the eBPF object: load, attach, detach), `pipeline` (events
//! into the live table), `family` (the traced processes), `python`
//! (CPython frames), `held` (blocks the kernel holds), the USDT probes
//! ([`usdt_probes`], [`usdt_attach`]) and `kernel_support`.

mod args;
mod attach;
mod before_attach;
mod by_name;
pub mod discovery;
mod end;
mod event_loop;
mod family;
mod held;
mod kernel_support;
mod leak_check;
mod leak_explain;
pub mod loader;
mod pipeline;
mod plan;
mod python;
mod reporting;
mod session;
mod status;
pub mod usdt_attach;
pub mod usdt_probes;

use std::os::fd::OwnedFd;
use std::sync::Arc;

use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use tokio::signal::unix::Signal;

use crate::output::Output;
use crate::tracee::HeldChild;
use args::StackMode;
pub use args::TraceArgs;
use discovery::Discovery;
use loader::Probes;
pub use session::monotonic_ns;
use session::Session;

/// Runs `memtrace [--pid PID | --name NAME | -- CMD]`; true when the
/// leak check failed a `--fail-on` gate.
pub async fn run(args: TraceArgs) -> anyhow::Result<bool> {
    let plan = plan::Plan::from_args(&args)?;
    let mut trace = Trace::attach(&args, plan).await?;
    trace.event_loop().await?;
    trace.end().await
}

/// A trace with its probes attached: what the event loop and the end work
/// on. The fields drop in this order (the metrics sender first, the output
/// last).
struct Trace<'a> {
    args: &'a TraceArgs,
    /// The target (the first process selected by `--name`, `--container`,
    /// `--cgroup`).
    pid: u32,
    /// The Prometheus text, for the endpoint's task (`--prometheus`).
    metrics: Option<tokio::sync::watch::Sender<Arc<String>>>,
    session: Session<'a>,
    ring: AsyncFd<RingBuf<MapData>>,
    /// `--live`: given back (dropped) before the final report.
    live: Option<crate::live::LiveView>,
    interrupt: Signal,
    terminate: Signal,
    discovery: Discovery,
    /// The eBPF programs' log (`-v`).
    kernel_log: Option<AsyncFd<aya_log::EbpfLogger<&'static dyn log::Log>>>,
    /// `--bpf-stats`: the kernel counts run time while this is open.
    _bpf_stats: Option<OwnedFd>,
    probes: Probes,
    /// Launch mode: the command, until it exits.
    held: Option<HeldChild>,
    /// `--name`, `--container`, `--cgroup`: the search for new processes.
    names: Option<by_name::Watch>,
    output: Output,
}
