//! Stage 1 of a trace, the plan: the arguments checked and turned into
//! what is traced and how, before anything is loaded or started. It owns
//! the usage errors (nothing to trace, a bad `--suppress` file, `--prometheus`
//! address, `--pyroscope` URL or credentials, `--allocators` name,
//! `--symbol-prefix`, `--preset` or `--pairs` file), the functions to probe
//! (the catalogue, prefixed builds, declared pairs), the privilege check,
//! the eBPF load settings and the output (and its push to a profile store).

use super::by_name::Selector;
use super::loader::LoadOptions;
use super::{StackMode, TraceArgs};
use crate::analysis::Suppressions;
use crate::error::Failure;
use crate::output::Output;
use crate::probe::catalog::{Allocator, FuncDef};

/// The kernel wakes the reader only once this much waits in the ring buffer
/// (one wakeup per ~1300 events instead of one per event); the rest is drained
/// every [`super::event_loop::DRAIN_EVERY`].
const WAKEUP_BYTES: u64 = 64 << 10;

/// What the arguments ask for, checked.
pub struct Plan {
    /// `--name`, `--container`, `--cgroup` or `--pod`.
    pub selector: Option<Selector>,
    pub suppressions: Option<Suppressions>,
    /// `--prometheus`.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The functions to probe.
    pub catalog: Vec<&'static FuncDef>,
    pub options: LoadOptions,
    /// Where the reports go (opened: a bad path fails before the trace).
    pub output: Output,
}

impl Plan {
    /// Checks the arguments, in the order a user meets the errors: the
    /// target, then the files and names they give, then the privileges.
    pub fn from_args(args: &TraceArgs) -> anyhow::Result<Plan> {
        let selector = Selector::from_args(
            args.name.as_deref(),
            args.container.as_deref(),
            args.cgroup.as_deref(),
            args.pod.as_deref(),
        )?;
        if args.pid.is_none() && selector.is_none() && args.command.is_empty() {
            return Err(Failure::usage(
                "nothing to trace: give --pid PID, --name NAME, --container ID, --cgroup PATH, --pod NAMESPACE/NAME, or -- CMD [ARGS...] (see memtrace --help)",
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
        let push = crate::push::PushConfig::from_env(&args.push)
            .map_err(|err| Failure::usage(err.to_string()))?;
        let otlp = crate::push::OtlpConfig::from_args(&args.push)
            .map_err(|err| Failure::usage(err.to_string()))?;
        let catalog = catalog_for(args)?;
        crate::kernel::privilege::check(args.command.is_empty())?;
        let pusher = match push {
            Some(config) => Some(
                crate::push::Pusher::start(config, crate::push::Policy::default()).map_err(
                    |err| Failure::runtime(format!("--pyroscope: cannot start the push: {err}")),
                )?,
            ),
            None => None,
        };
        let otlp = match otlp {
            Some(config) => Some(
                crate::push::Pusher::start(config, crate::push::Policy::default()).map_err(
                    |err| {
                        Failure::runtime(format!("--otlp-profiles: cannot start the push: {err}"))
                    },
                )?,
            ),
            None => None,
        };
        let output = Output::open(
            args.output.as_deref(),
            args.format,
            crate::sink::Names::full_if(args.full_names),
        )?
        .push_to(pusher)
        .otlp_to(otlp);
        Ok(Plan {
            selector,
            suppressions,
            metrics_addr,
            catalog,
            options: load_options(args),
            output,
        })
    }
}

/// The eBPF programs' load-time settings.
fn load_options(args: &TraceArgs) -> LoadOptions {
    LoadOptions {
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
        attach: args.attach,
        // Set from the kernel when the variant is chosen.
        thread_storage: false,
    }
}

/// The heap allocators `--allocators` names (empty: all).
pub fn heap_allowed(names: &[String]) -> Vec<Allocator> {
    names
        .iter()
        .filter_map(|n| Allocator::parse_builtin(n.trim()))
        .filter(|a| a.is_heap())
        .collect()
}

/// The functions to probe: the built-in catalogue (restricted by
/// `--allocators`) plus the pairs of `--pairs` files and `--preset`s.
fn catalog_for(args: &TraceArgs) -> Result<Vec<&'static FuncDef>, Failure> {
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
