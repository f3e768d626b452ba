//! Soak-test monitor: samples process, kernel and GPU memory over time and
//! judges the curves (`memtrace monitor`).

use std::process::ExitCode;

use clap::Args;

/// Options of `memtrace monitor`.
#[derive(Debug, Args)]
pub struct MonitorArgs {
    /// Process to watch.
    #[arg(short, long)]
    pub pid: Option<u32>,
}

/// Runs the monitor.
pub fn run(_args: MonitorArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("memtrace monitor is not built yet")
}
