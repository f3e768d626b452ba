//! memtrace: find memory leaks in live processes with eBPF uprobes.
//!
//! Thin entry point: parse the command line, dispatch, and turn errors into
//! one line on stderr with a documented exit code.

mod cli;
mod monitor;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let result = match cli.command {
        Some(cli::Command::Monitor(args)) => monitor::run(args),
        None => Err(anyhow::anyhow!("tracing is not built yet")),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("memtrace: {err:#}");
            ExitCode::from(1)
        }
    }
}
