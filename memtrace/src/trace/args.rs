//! The options of the tracer, the default command ([`TraceArgs`]): the
//! target (`--pid`, `--name`, `--container`, `--cgroup`, `--pod`, `-- CMD`), what is
//! probed and how stacks are walked, the report and its outputs, and the
//! kernel-side limits (ring, stack map, unwind tables).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::duration::parse_duration;
use crate::sink::Format;

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
    #[arg(help_heading = "Target", short, long, conflicts_with = "command")]
    pub pid: Option<u32>,

    /// Trace every process with this exact name (comm, argv0 or executable
    /// basename), each with probes of its own, and those that start later.
    #[arg(help_heading = "Target", long, value_name = "NAME", conflicts_with_all = ["pid", "command"])]
    pub name: Option<String>,

    /// Trace every process of this container (its id, or a unique prefix of
    /// it, as the container id read from /proc/PID/cgroup: Docker,
    /// containerd, CRI-O, Podman, Kubernetes), each with probes of its own,
    /// and those that start in it later.
    #[arg(help_heading = "Target", long, value_name = "ID", conflicts_with_all = ["pid", "command", "name", "cgroup"])]
    pub container: Option<String>,

    /// Trace every process in this cgroup or below it (a path as
    /// /proc/PID/cgroup shows it: /system.slice/x.service, 0::/PATH for v2,
    /// N:CONTROLLERS:/PATH for a v1 hierarchy), each with probes of its own,
    /// and those that join it later.
    #[arg(help_heading = "Target", long, value_name = "PATH", conflicts_with_all = ["pid", "command", "name"])]
    pub cgroup: Option<String>,

    /// Trace every process of this Kubernetes pod on this node (NAMESPACE/NAME,
    /// or NAME alone where no other namespace has a pod of that name; named
    /// from the kubelet's and the runtime's files, as the reports name it),
    /// each with probes of its own, and those that start in it later.
    #[arg(help_heading = "Target", long, value_name = "NAMESPACE/NAME", conflicts_with_all = ["pid", "command", "name", "container", "cgroup"])]
    pub pod: Option<String>,

    /// Stop after tracing this long, counted once the probes are attached (e.g. 5s, 2m); default: until Ctrl-C or the target exits.
    #[arg(help_heading = "Target", short, long, value_parser = parse_duration)]
    pub duration: Option<Duration>,

    /// Print an interim report every DUR.
    #[arg(help_heading = "Output", short, long, value_parser = parse_duration)]
    pub interval: Option<Duration>,

    /// Full-screen live view of the sites, redrawn every interval (default
    /// 1s); `q` quits and writes the final report. Needs stdout to be a
    /// terminal (otherwise tracing runs as without it).
    #[arg(help_heading = "Output", long)]
    pub live: bool,

    /// Hide allocations younger than DUR from the report.
    #[arg(help_heading = "Output", long, value_parser = parse_duration, default_value = "0s")]
    pub min_age: Duration,

    /// Show at most N sites.
    #[arg(help_heading = "Output", long, default_value_t = 20)]
    pub top: usize,

    /// Report format.
    #[arg(help_heading = "Output", short, long, value_enum, default_value_t = Format::Text)]
    pub format: Format,

    /// Show frame names whole in the text report, the HTML page and
    /// `--live` (by default template arguments and parameter lists are
    /// elided, `<…>` and `(…)`, and long names cut at the front); JSON,
    /// pprof, folded, flame graphs and records always have them whole.
    #[arg(help_heading = "Output", long)]
    pub full_names: bool,

    /// Write the report to FILE instead of stdout.
    #[arg(help_heading = "Output", short, long)]
    pub output: Option<PathBuf>,

    /// Frames kept per allocation stack (0: no stacks, cheapest). 64 by
    /// default: PyTorch's dispatcher under CPython takes ~50 (BENCHMARKS.md).
    #[arg(help_heading = "Stacks", long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(0..=127))]
    pub stack_depth: u32,

    /// How stacks are walked: `dwarf` (the objects' call-frame information,
    /// in the kernel; frame pointers where an object has none) or `fp`
    /// (frame pointers only: cheapest, short stacks through code built
    /// without them).
    #[arg(help_heading = "Stacks", long, value_enum, default_value_t = StackMode::Dwarf)]
    pub stacks: StackMode,

    /// Kernel memory for the DWARF unwinder's tables, in MiB; objects whose
    /// table does not fit fall back to frame pointers and are named in the
    /// report.
    #[arg(help_heading = "Stacks", long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub unwind_table_mib: u32,

    /// Where built unwind tables, and what the search of each object for
    /// allocator functions found, are cached, by object build-id, for later
    /// attaches to the same objects (a directory only memtrace's user can
    /// write; refused otherwise), or `off` (neither is cached).
    #[arg(help_heading = "Stacks", long, value_name = "DIR|off", default_value = crate::unwind::cache::DEFAULT_DIR)]
    pub table_cache: crate::unwind::cache::Setting,

    /// Bound on the table cache's total size, in MiB, tables and function
    /// searches together (the least recently used files are removed beyond it).
    #[arg(help_heading = "Stacks", long, default_value_t = crate::unwind::cache::DEFAULT_MIB, value_parser = clap::value_parser!(u64).range(1..))]
    pub table_cache_mib: u64,

    /// Attached to a running process, tracing starts once the cached unwind
    /// tables are in; the others are built while it runs, and stacks
    /// reaching an object still without one are cut there and counted
    /// (`stack_truncated_table_pending`). This waits for every table
    /// first, as a launched command (held until then) always does.
    #[arg(help_heading = "Stacks", long)]
    pub wait_for_tables: bool,

    /// Trace one allocation in N (chosen by address, so the matching free is
    /// sampled too); totals are then estimates. Applied in the kernel.
    #[arg(help_heading = "Probes", long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub sample_rate: u32,

    /// Ignore allocations smaller than this many bytes (applied in the kernel).
    #[arg(help_heading = "Probes", long, default_value_t = 0)]
    pub min_size: u64,

    /// Ignore allocations larger than this many bytes (applied in the kernel).
    #[arg(help_heading = "Probes", long)]
    pub max_size: Option<u64>,

    /// Trace only these allocators (comma-separated: libc, jemalloc,
    /// tcmalloc, mimalloc, mmap, cuda, cuda-driver, acl, python); default:
    /// all found but python (CPython's PyObject_Malloc family, traced only
    /// when named). A heap allocator is the object defining
    /// `malloc`/`operator new`. Pairs from --pairs/--preset are always traced.
    #[arg(
        help_heading = "Probes",
        long,
        value_delimiter = ',',
        value_name = "LIST"
    )]
    pub allocators: Vec<String>,

    /// Also look for the heap functions under this symbol prefix (an
    /// allocator built with prefixed names, e.g. `my_` for `my_malloc`);
    /// `je_` and `_rjem_` (jemalloc) are always looked for. Repeatable.
    #[arg(help_heading = "Probes", long, value_name = "PREFIX")]
    pub symbol_prefix: Vec<String>,

    /// Also probe this object file (a library memtrace does not find by
    /// itself, e.g. one not yet loaded). Repeatable.
    #[arg(help_heading = "Probes", long = "lib", value_name = "PATH")]
    pub libs: Vec<PathBuf>,

    /// Trace the resource pairs declared in this TOML file (handles,
    /// descriptors, custom pools). Repeatable.
    #[arg(help_heading = "Probes", long, value_name = "FILE")]
    pub pairs: Vec<PathBuf>,

    /// Trace a built-in set of pairs: acl-handles, cuda-handles, fds, files;
    /// pytorch (tensors from PyTorch's USDT probes beside the cudaMalloc
    /// segments) and otel-memory (a sampler's USDT probes: estimates).
    /// Repeatable.
    #[arg(help_heading = "Probes", long, value_name = "NAME")]
    pub preset: Vec<String>,

    /// Allow-list of pools, caches and resident data (LSan `leak:` lines,
    /// `symbol:`, `module:`, `allocator:`, `size:MIN-MAX`, `addr:START-END`).
    /// Suppressed bytes are still counted, in their own total.
    #[arg(help_heading = "Judgement", long, value_name = "FILE")]
    pub suppress: Option<PathBuf>,

    /// Set aside what is allocated in the first DUR (start-up pools, caches).
    #[arg(help_heading = "Judgement", long, value_parser = parse_duration, default_value = "0s")]
    pub warmup: Duration,

    /// Prove leaks: stop the target briefly (every thread, with ptrace; no
    /// signal is sent), scan its memory for pointers and split the live
    /// blocks into valgrind's categories (definitely, indirectly, possibly
    /// lost, still reachable), at the final report and at each `--interval`
    /// report. In launch mode (`-- CMD`) the check runs at the command's
    /// exit by default, and with this flag at each `--interval` too.
    #[arg(help_heading = "Judgement", long, conflicts_with = "no_leak_check")]
    pub leak_check: bool,

    /// Launch mode: no leak check at the command's exit.
    #[arg(help_heading = "Judgement", long)]
    pub no_leak_check: bool,

    /// Exit with code 5 when the leak check finds bytes in these
    /// categories, after `--suppress` (comma-separated); implies
    /// `--leak-check`.
    #[arg(
        help_heading = "Judgement",
        long,
        value_enum,
        value_delimiter = ',',
        value_name = "CATEGORIES"
    )]
    pub fail_on: Vec<crate::report::leak::LeakGate>,

    /// Explain a leak check's verdict: for the block holding ADDR (hex or
    /// decimal), or for the largest ten blocks of a category
    /// (`definitely-lost`, `indirectly-lost`, `possibly-lost`,
    /// `still-reachable`), the chain of pointers from a register or root
    /// that kept it in its category, or that none did (comma-separated;
    /// implies `--leak-check`).
    #[arg(
        help_heading = "Judgement",
        long,
        value_delimiter = ',',
        value_name = "ADDR|CATEGORY"
    )]
    pub leak_check_explain: Vec<super::leak_explain::ExplainTarget>,

    /// By pid, the leak check walks glibc's heap to judge the blocks
    /// allocated before the attach too; with this it does not (the heap is
    /// then a root, as with other allocators).
    #[arg(help_heading = "Judgement", long, conflicts_with = "heap_walk")]
    pub no_heap_walk: bool,

    /// Launch mode: walk glibc's heap at the exit check too (a cross-check:
    /// memtrace saw every block, so the four totals stay the same).
    #[arg(help_heading = "Judgement", long)]
    pub heap_walk: bool,

    /// The longest one leak check may hold the target stopped; what a cut
    /// scan did not reach is not judged (counted as `skipped_bytes`).
    #[arg(help_heading = "Judgement", long, value_parser = parse_duration, default_value = "10s", value_name = "DUR")]
    pub leak_check_max_pause: Duration,

    /// By pid, how the leak check reads the process: `snapshot` stops it
    /// only to clone a copy-on-write child (one injected `clone`, no
    /// atfork handler runs) and scans the child while the process runs;
    /// `stopped` holds it stopped for the whole scan. A snapshot that is
    /// not safe (seccomp, cgroup or overcommit headroom, ranges a child
    /// does not share) falls back to `stopped`, and the report says why.
    #[arg(
        help_heading = "Judgement",
        long,
        value_enum,
        default_value = "snapshot",
        value_name = "MODE"
    )]
    pub leak_check_mode: crate::report::leak::CheckMode,

    /// Record the event stream (and what is needed to symbolize it) to FILE,
    /// for `memtrace report FILE` later, offline.
    #[arg(help_heading = "Output", long, value_name = "FILE")]
    pub record: Option<PathBuf>,

    /// Serve live metrics in the Prometheus text format on ADDR (PORT,
    /// HOST:PORT; a bare port binds 127.0.0.1).
    #[arg(help_heading = "Output", long, value_name = "ADDR")]
    pub prometheus: Option<String>,

    /// Pushing each report to a profile store (Pyroscope, Grafana).
    #[command(flatten)]
    pub push: crate::push::PushArgs,

    /// Most live blocks tracked; past it new blocks are counted in
    /// `events.table_full` and the report is marked incomplete.
    #[arg(help_heading = "Limits", long, default_value_t = 50_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_live: u64,

    /// Buckets of the kernel's stack-trace map; distinct stacks beyond what
    /// it holds are counted as `stack_collision` failures.
    #[arg(help_heading = "Stacks", long, default_value_t = 16384, value_parser = clap::value_parser!(u32).range(64..=1_048_576))]
    pub stack_map_entries: u32,

    /// Trace the target's child processes too (and theirs): each new process
    /// gets its own probes, scoped to it, as soon as the kernel reports the
    /// fork. Without it, children are listed in a note, not traced.
    #[arg(help_heading = "Target", long)]
    pub follow_forks: bool,

    /// With --follow-forks, --name, --container, --cgroup or --pod: most processes
    /// traced at once (the target included); further ones are counted and
    /// named in a note.
    #[arg(help_heading = "Target", long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub max_processes: u32,

    /// Ring-buffer size in MiB (a power of two).
    #[arg(help_heading = "Limits", long, default_value_t = 8, value_parser = parse_ring_mib)]
    pub ring_mib: u32,

    /// Measure memtrace's own cost: turn on the kernel's BPF run-time
    /// statistics while tracing (system-wide, for every BPF program, at some
    /// tens of ns per program run) and report how often each of memtrace's
    /// programs ran and the time it took (`bpf_programs`).
    #[arg(help_heading = "Output", long)]
    pub bpf_stats: bool,

    /// Send every heap allocation and release to memtrace as it happens. By
    /// default the kernel holds each thread's newest heap allocation and,
    /// when it is released before the thread allocates again, settles the
    /// pair there (counted in `allocs`, `frees` and `settled_in_kernel`, at
    /// a fraction of the cost of sending both).
    #[arg(help_heading = "Probes", long)]
    pub no_settle: bool,

    /// Benchmark floor: attach empty probes that record nothing.
    #[arg(help_heading = "Probes", long, hide = true)]
    pub null_probes: bool,

    /// How probes are attached: `uprobe_multi` links (one per object and
    /// process, Linux 6.6+: fast to attach and detach), one perf event per
    /// probe, or auto (links where the kernel has them). For benchmarks and tests.
    #[arg(help_heading = "Probes", long, value_enum, hide = true, default_value_t = crate::trace::loader::AttachMode::Auto)]
    pub attach: crate::trace::loader::AttachMode,

    /// Benchmark floor: put every probe at its function's entry (no placement).
    #[arg(help_heading = "Probes", long, hide = true)]
    pub entry_probes: bool,

    /// Debug output (-v: attach plan and kernel log; -vv: more).
    #[arg(help_heading = "Output", short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// Command to launch and trace from its first instruction.
    #[arg(help_heading = "Target", last = true, value_name = "CMD")]
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
