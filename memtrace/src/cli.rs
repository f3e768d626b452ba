//! Command-line definitions (clap). Parsing only: no behaviour lives here.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::duration::parse_duration;
use crate::sink::Format;
use crate::trace::TraceArgs;

/// Find memory leaks in live processes, host and GPU/NPU, with eBPF uprobes.
#[derive(Debug, Parser)]
#[command(
    name = "memtrace",
    version,
    about,
    args_conflicts_with_subcommands = true,
    after_help = "Examples:\n  sudo memtrace --pid 1234 --duration 30s\n  sudo memtrace --pid 1234 --leak-check --duration 1m   # which live blocks nothing points to\n  sudo memtrace -- ./my_app args                        # leak check at its exit\n  sudo memtrace --fail-on definitely-lost -- ./unit_tests\n  memtrace monitor --name smengine_demo --duration 8h --output mem.csv"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,

    #[command(flatten)]
    pub trace: TraceArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Sample process, kernel and GPU memory over time and judge the curves (soak tests).
    Monitor(Box<crate::monitor::MonitorArgs>),
    /// Re-run the analysis of a `--record` file and render any format, offline.
    Report(ReportArgs),
    /// Build the DWARF unwind table of each object file and print what it
    /// takes (rows, FDEs, build time, kernel bytes) as JSON lines, without
    /// loading anything: what `--stacks dwarf` would load for it.
    UnwindTable(UnwindTableArgs),
    /// Check this kernel and these privileges: features found or missing,
    /// a load test of every eBPF program in every stack mode, the stack
    /// budget per call chain, and which modes will work (exit 0 when the
    /// default mode loads).
    Doctor(crate::doctor::DoctorArgs),
    /// Watch a process cheaply for days and trace it only while its memory
    /// grows: bounded episodes, each with its report.
    Watch(Box<crate::watch::WatchArgs>),
    /// List the USDT probes (provider, name, file offset, semaphore,
    /// arguments) an object file offers, or every object a process maps.
    Probes(crate::probe::usdt_list::ProbesArgs),
    /// Write the man pages, shell completions and the guide's reference
    /// chapters (every flag, every JSON key) under DIR (`cargo xtask dist`
    /// and `cargo xtask docs` call it).
    #[command(hide = true)]
    GenerateDocs(GenerateDocsArgs),
    /// Run by memtrace itself: outlives it to reap a leak-check snapshot
    /// left behind if memtrace is killed.
    #[command(hide = true)]
    SnapshotGuard,
    /// Run by memtrace itself: times forks of a small process with and
    /// without 64 MiB of anonymous memory (the snapshot's pause estimate).
    #[command(hide = true)]
    ForkCost,
}

/// Options of `memtrace generate-docs`.
#[derive(Debug, Args)]
pub struct GenerateDocsArgs {
    /// Where `man/`, `completions/` and `reference/` are written.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

/// Options of `memtrace unwind-table FILE...`.
#[derive(Debug, Args)]
pub struct UnwindTableArgs {
    /// ELF objects (executables, shared libraries).
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
}

/// Options of `memtrace report FILE`.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The file written by `memtrace --record FILE`.
    pub file: PathBuf,
    /// Report format.
    #[arg(short, long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Write the report to FILE instead of stdout.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Show at most N sites (default: as recorded).
    #[arg(long)]
    pub top: Option<usize>,
    /// Hide allocations younger than DUR (default: as recorded).
    #[arg(long, value_parser = parse_duration)]
    pub min_age: Option<Duration>,
    /// Set aside what was allocated in the first DUR.
    #[arg(long, value_parser = parse_duration)]
    pub warmup: Option<Duration>,
    /// Allow-list to apply (see `memtrace --help`).
    #[arg(long, value_name = "FILE")]
    pub suppress: Option<PathBuf>,
    /// Show frame names whole in the text and HTML reports (by default
    /// template arguments and parameter lists are elided, `<…>` and `(…)`,
    /// and long names cut at the front); JSON, pprof, folded and flame
    /// graphs always have them whole.
    #[arg(long)]
    pub full_names: bool,
    /// Exit with code 5 when the recorded leak check found bytes in these
    /// categories, after `--suppress` (comma-separated), as the live
    /// `--fail-on` does.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "CATEGORIES")]
    pub fail_on: Vec<crate::report::leak::LeakGate>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn pid_and_command_conflict() {
        let parsed = Cli::try_parse_from(["memtrace", "--pid", "1", "--", "ls"]);
        assert!(parsed.is_err());
        let parsed =
            Cli::try_parse_from(["memtrace", "--", "ls", "-l"]).expect("launch form parses");
        assert_eq!(parsed.trace.command, vec!["ls", "-l"]);
    }

    #[test]
    fn name_excludes_pid_and_command() {
        assert!(Cli::try_parse_from(["memtrace", "--name", "x", "--pid", "1"]).is_err());
        assert!(Cli::try_parse_from(["memtrace", "--name", "x", "--", "ls"]).is_err());
        let parsed = Cli::try_parse_from(["memtrace", "--name", "redis-server"]).expect("parses");
        assert_eq!(parsed.trace.name.as_deref(), Some("redis-server"));
    }

    #[test]
    fn container_and_cgroup_select_alone() {
        for flag in ["--container", "--cgroup"] {
            assert!(Cli::try_parse_from(["memtrace", flag, "x", "--pid", "1"]).is_err());
            assert!(Cli::try_parse_from(["memtrace", flag, "x", "--name", "y"]).is_err());
            assert!(Cli::try_parse_from(["memtrace", flag, "x", "--", "ls"]).is_err());
        }
        assert!(Cli::try_parse_from(["memtrace", "--container", "ab", "--cgroup", "/x"]).is_err());
        let parsed = Cli::try_parse_from([
            "memtrace",
            "--container",
            "0123abcd",
            "--max-processes",
            "8",
        ])
        .expect("parses");
        assert_eq!(parsed.trace.container.as_deref(), Some("0123abcd"));
        let parsed = Cli::try_parse_from(["memtrace", "--cgroup", "0::/a.slice"]).expect("parses");
        assert_eq!(parsed.trace.cgroup.as_deref(), Some("0::/a.slice"));
    }

    #[test]
    fn pod_selects_alone_in_trace_and_watch() {
        for (flag, value) in [
            ("--pid", "1"),
            ("--name", "y"),
            ("--container", "ab"),
            ("--cgroup", "/x"),
        ] {
            for args in [
                vec!["memtrace", "--pod", "shop/web-0", flag, value],
                vec!["memtrace", flag, value, "--pod", "shop/web-0"],
                vec!["memtrace", "watch", "--pod", "shop/web-0", flag, value],
            ] {
                assert!(Cli::try_parse_from(&args).is_err(), "{args:?}");
            }
        }
        assert!(Cli::try_parse_from(["memtrace", "--pod", "web-0", "--", "ls"]).is_err());
        let parsed = Cli::try_parse_from(["memtrace", "--pod", "shop/web-0"]).expect("parses");
        assert_eq!(parsed.trace.pod.as_deref(), Some("shop/web-0"));
        let parsed = Cli::try_parse_from(["memtrace", "watch", "--pod", "web-0", "--dry-run"])
            .expect("parses");
        let Some(Command::Watch(watch)) = parsed.command else {
            panic!("the watch command");
        };
        assert_eq!(watch.pod.as_deref(), Some("web-0"));
    }
}
