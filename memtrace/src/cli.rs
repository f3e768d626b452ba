//! Command-line definitions (clap). Parsing only: no behaviour lives here.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::duration::parse_duration;
use crate::sink::Format;

/// Find memory leaks in live processes, host and GPU/NPU, with eBPF uprobes.
#[derive(Debug, Parser)]
#[command(
    name = "memtrace",
    version,
    about,
    args_conflicts_with_subcommands = true,
    after_help = "Examples:\n  sudo memtrace --pid 1234 --duration 30s\n  sudo memtrace -- ./my_app args\n  memtrace monitor --name smengine_demo --duration 8h --output mem.csv"
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
    Doctor(crate::kernel::doctor::DoctorArgs),
    /// Watch a process cheaply for days and trace it only while its memory
    /// grows: bounded episodes, each with its report.
    Watch(Box<crate::watch::WatchArgs>),
    /// List the USDT probes (provider, name, file offset, semaphore,
    /// arguments) an object file offers, or every object a process maps.
    Probes(crate::probe::usdt_list::ProbesArgs),
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
}

/// How allocation stacks are walked (`--stacks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StackMode {
    Dwarf,
    Fp,
}

/// Options of the tracer (the default command).
#[derive(Debug, Args)]
pub struct TraceArgs {
    /// Attach to this running process.
    #[arg(short, long, conflicts_with = "command")]
    pub pid: Option<u32>,

    /// Trace every process with this exact name (comm, argv0 or executable
    /// basename), each with probes of its own, and those that start later.
    #[arg(long, value_name = "NAME", conflicts_with_all = ["pid", "command"])]
    pub name: Option<String>,

    /// Trace every process of this container (its id, or a unique prefix of
    /// it, as the container id read from /proc/PID/cgroup: Docker,
    /// containerd, CRI-O, Podman, Kubernetes), each with probes of its own,
    /// and those that start in it later.
    #[arg(long, value_name = "ID", conflicts_with_all = ["pid", "command", "name", "cgroup"])]
    pub container: Option<String>,

    /// Trace every process in this cgroup or below it (a path as
    /// /proc/PID/cgroup shows it: /system.slice/x.service, 0::/PATH for v2,
    /// N:CONTROLLERS:/PATH for a v1 hierarchy), each with probes of its own,
    /// and those that join it later.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["pid", "command", "name"])]
    pub cgroup: Option<String>,

    /// Stop after tracing this long, counted once the probes are attached (e.g. 5s, 2m); default: until Ctrl-C or the target exits.
    #[arg(short, long, value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// Print an interim report every DUR.
    #[arg(short, long, value_parser = parse_duration)]
    pub interval: Option<Duration>,

    /// Full-screen live view of the sites, redrawn every interval (default
    /// 1s); `q` quits and writes the final report. Needs stdout to be a
    /// terminal (otherwise tracing runs as without it).
    #[arg(long)]
    pub live: bool,

    /// Hide allocations younger than DUR from the report.
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub min_age: Duration,

    /// Show at most N sites.
    #[arg(long, default_value_t = 20)]
    pub top: usize,

    /// Report format.
    #[arg(short, long, value_enum, default_value_t = Format::Text)]
    pub format: Format,

    /// Write the report to FILE instead of stdout.
    #[arg(short, long)]
    pub output: Option<PathBuf>,

    /// Frames kept per allocation stack (0: no stacks, cheapest).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(0..=127))]
    pub stack_depth: u32,

    /// How stacks are walked: `dwarf` (the objects' call-frame information,
    /// in the kernel; frame pointers where an object has none) or `fp`
    /// (frame pointers only: cheapest, short stacks through code built
    /// without them).
    #[arg(long, value_enum, default_value_t = StackMode::Dwarf)]
    pub stacks: StackMode,

    /// Kernel memory for the DWARF unwinder's tables, in MiB; objects whose
    /// table does not fit fall back to frame pointers and are named in the
    /// report.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub unwind_table_mib: u32,

    /// Trace one allocation in N (chosen by address, so the matching free is
    /// sampled too); totals are then estimates. Applied in the kernel.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub sample_rate: u32,

    /// Ignore allocations smaller than this many bytes (applied in the kernel).
    #[arg(long, default_value_t = 0)]
    pub min_size: u64,

    /// Ignore allocations larger than this many bytes (applied in the kernel).
    #[arg(long)]
    pub max_size: Option<u64>,

    /// Trace only these allocators (comma-separated: libc, jemalloc,
    /// tcmalloc, mimalloc, mmap, cuda, cuda-driver, acl, python); default:
    /// all found but python (CPython's PyObject_Malloc family, traced only
    /// when named). A heap allocator is the object defining
    /// `malloc`/`operator new`. Pairs from --pairs/--preset are always traced.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub allocators: Vec<String>,

    /// Also look for the heap functions under this symbol prefix (an
    /// allocator built with prefixed names, e.g. `my_` for `my_malloc`);
    /// `je_` and `_rjem_` (jemalloc) are always looked for. Repeatable.
    #[arg(long, value_name = "PREFIX")]
    pub symbol_prefix: Vec<String>,

    /// Also probe this object file (a library memtrace does not find by
    /// itself, e.g. one not yet loaded). Repeatable.
    #[arg(long = "lib", value_name = "PATH")]
    pub libs: Vec<PathBuf>,

    /// Trace the resource pairs declared in this TOML file (handles,
    /// descriptors, custom pools). Repeatable.
    #[arg(long, value_name = "FILE")]
    pub pairs: Vec<PathBuf>,

    /// Trace a built-in set of pairs: acl-handles, cuda-handles, fds, files;
    /// pytorch (tensors from PyTorch's USDT probes beside the cudaMalloc
    /// segments) and otel-memory (a sampler's USDT probes: estimates).
    /// Repeatable.
    #[arg(long, value_name = "NAME")]
    pub preset: Vec<String>,

    /// Allow-list of pools, caches and resident data (LSan `leak:` lines,
    /// `symbol:`, `module:`, `allocator:`, `size:MIN-MAX`, `addr:START-END`).
    /// Suppressed bytes are still counted, in their own total.
    #[arg(long, value_name = "FILE")]
    pub suppress: Option<PathBuf>,

    /// Set aside what is allocated in the first DUR (start-up pools, caches).
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub warmup: Duration,

    /// Record the event stream (and what is needed to symbolize it) to FILE,
    /// for `memtrace report FILE` later, offline.
    #[arg(long, value_name = "FILE")]
    pub record: Option<PathBuf>,

    /// Serve live metrics in the Prometheus text format on ADDR (PORT,
    /// HOST:PORT; a bare port binds 127.0.0.1).
    #[arg(long, value_name = "ADDR")]
    pub prometheus: Option<String>,

    /// Most live blocks tracked; past it new blocks are counted in
    /// `events.table_full` and the report is marked incomplete.
    #[arg(long, default_value_t = 50_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_live: u64,

    /// Buckets of the kernel's stack-trace map; distinct stacks beyond what
    /// it holds are counted as `stack_collision` failures.
    #[arg(long, default_value_t = 16384, value_parser = clap::value_parser!(u32).range(64..=1_048_576))]
    pub stack_map_entries: u32,

    /// Trace the target's child processes too (and theirs): each new process
    /// gets its own probes, scoped to it, as soon as the kernel reports the
    /// fork. Without it, children are listed in a note, not traced.
    #[arg(long)]
    pub follow_forks: bool,

    /// With --follow-forks, --name, --container or --cgroup: most processes
    /// traced at once (the target included); further ones are counted and
    /// named in a note.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_processes: u32,

    /// Ring-buffer size in MiB (a power of two).
    #[arg(long, default_value_t = 8, value_parser = parse_ring_mib)]
    pub ring_mib: u32,

    /// Measure memtrace's own cost: turn on the kernel's BPF run-time
    /// statistics while tracing (system-wide, for every BPF program, at some
    /// tens of ns per program run) and report how often each of memtrace's
    /// programs ran and the time it took (`bpf_programs`).
    #[arg(long)]
    pub bpf_stats: bool,

    /// Send every heap allocation and release to memtrace as it happens. By
    /// default the kernel holds each thread's newest heap allocation and,
    /// when it is released before the thread allocates again, settles the
    /// pair there (counted in `allocs`, `frees` and `settled_in_kernel`, at
    /// a fraction of the cost of sending both).
    #[arg(long)]
    pub no_settle: bool,

    /// Benchmark floor: attach empty probes that record nothing.
    #[arg(long, hide = true)]
    pub null_probes: bool,

    /// Benchmark floor: put every probe at its function's entry (no placement).
    #[arg(long, hide = true)]
    pub entry_probes: bool,

    /// Debug output (-v: attach plan and kernel log; -vv: more).
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// Command to launch and trace from its first instruction.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// Parses a ring-buffer size in MiB: a power of two from 1 to 1024.
fn parse_ring_mib(text: &str) -> Result<u32, String> {
    let mib: u32 = text
        .parse()
        .map_err(|_| format!("invalid ring size '{text}': expected MiB as a number"))?;
    if mib == 0 || mib > 1024 || !mib.is_power_of_two() {
        return Err(format!(
            "invalid ring size {mib}: a power of two from 1 to 1024 MiB"
        ));
    }
    Ok(mib)
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
}
