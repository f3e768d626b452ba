//! memtrace: find memory leaks in live processes with eBPF uprobes.
//!
//! Thin entry point: parse the command line, dispatch, and turn errors into
//! one line on stderr with a documented exit code (see `error`).

mod analysis;
mod arch;
mod btf;
mod cli;
mod disk_cache;
mod doctor;
mod duration;
mod error;
mod event;
mod interp;
mod kernel;
#[cfg(test)]
mod layering;
mod live;
mod model;
mod monitor;
mod output;
mod parallel;
mod probe;
mod prometheus;
mod push;
mod reach;
mod record;
mod reference;
mod report;
mod signals;
mod sink;
mod stacks;
mod stats;
mod symbolize;
mod table;
mod trace;
mod tracee;
mod unwind;
mod watch;

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
    if matches!(
        cli.command,
        None | Some(cli::Command::Watch(_) | cli::Command::Doctor(_))
    ) {
        // Learnt while memtrace is one thread with no child: it asks the
        // kernel about a child of its own (arm64), which a launch's wait
        // for any child must never see.
        kernel::pac::return_address_mask();
    }
    let result = match cli.command {
        Some(cli::Command::Monitor(args)) => monitor::run(*args),
        Some(cli::Command::Report(args)) => run_report(args),
        Some(cli::Command::UnwindTable(args)) => unwind::describe(&args.files),
        Some(cli::Command::Doctor(args)) => doctor::run(&args),
        Some(cli::Command::Watch(args)) => watch::run(*args),
        Some(cli::Command::Probes(args)) => probe::usdt_list::run(&args),
        Some(cli::Command::GenerateDocs(args)) => reference::run(&args),
        Some(cli::Command::SnapshotGuard) => tracee::snapshot_guard::run(),
        Some(cli::Command::ForkCost) => tracee::fork_cost::run(),
        None => run_trace(cli.trace),
    };
    match result {
        Ok(code) => code,
        Err(err) => error::report(&err),
    }
}

fn run_report(args: cli::ReportArgs) -> anyhow::Result<ExitCode> {
    let millis = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let suppressions = match &args.suppress {
        Some(path) => Some(
            analysis::Suppressions::load(path)
                .map_err(|err| error::Failure::usage(err.to_string()))?,
        ),
        None => None,
    };
    let output = output::Output::open(
        args.output.as_deref(),
        args.format,
        sink::Names::full_if(args.full_names),
    )?;
    let mut report = record::replay(
        &args.file,
        record::ReplayOptions {
            top: args.top,
            min_age_ms: args.min_age.map(millis),
            warmup_ms: args.warmup.map(millis),
            suppressions,
            leak_gates: args.fail_on.clone(),
        },
    )?;
    output.finish(&mut report)?;
    let failed = report
        .leak_check
        .as_ref()
        .map(|check| check.failed_gates.clone())
        .unwrap_or_default();
    if !failed.is_empty() {
        eprintln!(
            "memtrace: the recorded leak check failed --fail-on: {} (exit {})",
            failed.join(", "),
            error::EXIT_LEAKS
        );
        return Ok(ExitCode::from(error::EXIT_LEAKS));
    }
    Ok(ExitCode::SUCCESS)
}

fn run_trace(args: trace::TraceArgs) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    if runtime.block_on(trace::run(args))? {
        return Ok(ExitCode::from(error::EXIT_LEAKS));
    }
    Ok(ExitCode::SUCCESS)
}
