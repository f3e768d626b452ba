//! memtrace: find memory leaks in live processes with eBPF uprobes.
//!
//! Thin entry point: parse the command line, dispatch, and turn errors into
//! one line on stderr with a documented exit code (see `error`).

mod analysis;
mod cli;
mod error;
mod event;
mod monitor;
mod output;
mod probe;
mod prometheus;
mod report;
mod sink;
mod stacks;
mod symbolize;
mod table;
mod target;
mod trace;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let level = match cli.trace.verbose {
        0 => log::LevelFilter::Warn,
        1 => log::LevelFilter::Info,
        _ => log::LevelFilter::Debug,
    };
    env_logger::Builder::new()
        .filter_level(level)
        .format_timestamp(None)
        .init();
    let result = match cli.command {
        Some(cli::Command::Monitor(args)) => monitor::run(args),
        None => run_trace(cli.trace),
    };
    match result {
        Ok(code) => code,
        Err(err) => error::report(&err),
    }
}

fn run_trace(args: cli::TraceArgs) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(trace::run(args))?;
    Ok(ExitCode::SUCCESS)
}
