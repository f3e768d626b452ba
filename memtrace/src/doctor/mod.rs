//! `memtrace doctor [--format text|json]`: what this kernel and this process
//! allow, on one screen, and whether memtrace's eBPF programs load here.
//!
//! It probes the kernel's features ([`crate::kernel::features`]), reads
//! the privileges, loads the embedded eBPF object once per stack mode (default
//! `--stacks dwarf`, `--stacks fp`, `--stack-depth 0`) and each of its
//! programs in it (`call_enter`, `call_exit`, `usdt_fire`, `task_new`; nothing is
//! attached), computes the object's stack budget per call chain
//! ([`crate::kernel::stack_budget`]) and says which modes will work. Exit 0
//! when the default mode's programs load, 1 otherwise. The text screen is
//! `text`'s.
//!
//! JSON (`--format json`), one object; keys are stable:
//! - `schema`: 1
//! - `kernel`: `release` (`uname -r`), `version` (`"6.18.44"` or null), `arch`
//! - `features[]`: `key` (`btf`, `uprobe_pmu`, `ring_buffer`, `global_data`,
//!   `atomics_fetch`, `bpf_loop`, `perf_link`, `attach_cookie`,
//!   `raw_tracepoint`, `task_storage`, `uprobe_multi`, `uretprobe_syscall`),
//!   `presence` (`found` | `missing` | `unknown`), `since` (mainline release),
//!   `describe`, `detail` (how it was found out)
//! - `privileges`: `euid`, `cap_eff` (hex), `cap_bpf`, `cap_perfmon`,
//!   `cap_sys_ptrace`, `cap_sys_admin`, `perf_event_paranoid`,
//!   `unprivileged_bpf_disabled`, `lockdown` (null when unknown), `can_trace`,
//!   `uprobes_need_sys_admin` (this kernel lets only CAP_SYS_ADMIN create
//!   uprobes: Linux 6.16+; probed, null when unknown)
//! - `load_tests[]`: `mode` (`default` | `stacks_fp` | `stack_depth_0`),
//!   `flags`, `skipped` (why it was not run, or null), `maps_error` (the
//!   object's maps could not be created, or null), `programs[]`: `program`,
//!   `loaded`, `verified_insns` (the verifier's processed-instruction count,
//!   null before 5.16 or on failure), `error` (one line, or null), `log`
//!   (the file holding the verifier's whole log, or null)
//! - `stack_budget`: `limit` (512), `goal` (448), `rounding` (32), `frames`
//!   (function -> deepest stack byte), `chains[]`: `functions` (program
//!   first), `frames` (rounded), `bytes`; `private_stack_refused[]` (the
//!   programs holding a tail call, which 6.13+ kernels never run on a
//!   per-CPU private stack); or null with `stack_budget_error`
//! - `modes[]`: `mode` (`default`, `stacks_fp`, `stack_depth_0`, `settling`,
//!   `python_frames`, `follow_forks`), `flags`, `works` (true | false | null:
//!   not known without the load test), `why[]` (what keeps it from working)
//! - `default_loads`: whether the default mode's programs loaded (the exit code)
//! - `ebpf_object`: `variant` (`full`; `tailcall` on kernels with attach
//!   cookies and atomics with fetch but no `bpf_loop`; `compat` on kernels
//!   without cookies or atomics with fetch: the load tests then load it,
//!   its tail-called walk programs included), `missing` (feature keys),
//!   `why` (the probed features that chose it), `notice` (what it does
//!   differently, or null)

mod text;

use std::process::ExitCode;

use memtrace_common::unwind::{STACK_MODE_DWARF, STACK_MODE_FP, STACK_MODE_NONE};
use serde::Serialize;

use crate::kernel::features::{self, Feature, FeatureCheck, Features, Mode, Presence, Privileges};
use crate::kernel::stack_budget::{self, Budget};
use crate::kernel::verifier;
use crate::trace::loader::{self, LoadOptions};

/// Output of `memtrace doctor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DoctorFormat {
    Text,
    Json,
}

/// Options of `memtrace doctor`.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = DoctorFormat::Text)]
    pub format: DoctorFormat,
}

#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
struct Kernel {
    /// The kernel release as `uname -r` gives it (`unknown` when
    /// `/proc/sys/kernel/osrelease` cannot be read).
    release: String,
    /// Its numeric head, `MAJOR.MINOR.PATCH` (`6.18.44`); null when the
    /// release does not start with `MAJOR.MINOR`.
    version: Option<String>,
    /// The machine architecture memtrace was built for (`x86_64`,
    /// `aarch64`).
    arch: String,
}

/// One program's result in one mode.
#[derive(Clone, Debug, PartialEq, Serialize, schemars::JsonSchema)]
pub struct ProgramReport {
    /// The program: `call_enter`, `call_exit`, `usdt_fire`, `task_new`, or
    /// a tail-called one (`tail_walk`, `tail_python`) of an object without
    /// `bpf_loop`.
    pub program: String,
    /// Whether the kernel accepted it.
    pub loaded: bool,
    /// The verifier's processed-instruction count; null when it was refused
    /// or the kernel does not report the count (before 5.16).
    pub verified_insns: Option<u32>,
    /// Why it was refused, in one line (the verifier's reason where it gave
    /// one); null when it loaded.
    pub error: Option<String>,
    /// The file holding the verifier's whole log (in `$XDG_RUNTIME_DIR`,
    /// else `/tmp`); null when it loaded, when the refusal was not the
    /// verifier's, or when the file could not be written.
    pub log: Option<String>,
}

/// One stack mode's load test.
#[derive(Clone, Debug, PartialEq, Serialize, schemars::JsonSchema)]
pub struct ModeLoad {
    /// The stack mode: `default`, `stacks_fp` or `stack_depth_0`.
    pub mode: &'static str,
    /// The flags that ask for it: `--stacks dwarf`, `--stacks fp` or
    /// `--stack-depth 0`.
    pub flags: &'static str,
    /// Why the test was not run (this memtrace was built without its eBPF
    /// object, or this process may not load BPF programs); null when it
    /// ran.
    pub skipped: Option<String>,
    /// Why the object's maps could not be created (then no program was
    /// tried); null when they were, or the test was skipped.
    pub maps_error: Option<String>,
    /// Each program's load, in this mode; empty when the test was skipped
    /// or the maps failed.
    pub programs: Vec<ProgramReport>,
}

impl ModeLoad {
    /// Whether `programs` all loaded, and every tail-called program the test
    /// tried (`None`: the test did not run).
    fn loaded(&self, programs: &[&str]) -> Option<bool> {
        if self.skipped.is_some() {
            return None;
        }
        if self.maps_error.is_some() {
            return Some(false);
        }
        Some(
            programs
                .iter()
                .all(|name| self.programs.iter().any(|p| p.program == *name && p.loaded))
                && self
                    .programs
                    .iter()
                    .all(|p| p.loaded || !Self::tail_called(p)),
        )
    }

    /// A program of the objects without `bpf_loop` that every trace of them
    /// loads, in every mode (the DWARF walk and the Python frames run there):
    /// if it fails, no mode works.
    fn tail_called(program: &ProgramReport) -> bool {
        loader::TAIL_PROGRAMS.contains(&program.program.as_str())
    }

    /// What failed, one line each.
    fn failures(&self, programs: &[&str]) -> Vec<String> {
        if let Some(err) = &self.maps_error {
            return vec![format!("{}: maps: {err}", self.flags)];
        }
        self.programs
            .iter()
            .filter(|p| {
                (programs.contains(&p.program.as_str()) || Self::tail_called(p)) && !p.loaded
            })
            .map(|p| {
                format!(
                    "{} {}: {}",
                    self.flags,
                    p.program,
                    p.error.as_deref().unwrap_or("failed")
                )
            })
            .collect()
    }
}

/// Whether one mode will work, and what keeps it from working.
#[derive(Clone, Debug, PartialEq, Serialize, schemars::JsonSchema)]
pub struct ModeVerdict {
    /// The mode: `default`, `stacks_fp`, `stack_depth_0`, `settling`,
    /// `python_frames` or `follow_forks`.
    pub mode: &'static str,
    /// How a user asks for it (`--stacks fp`, `--follow-forks`, ...).
    pub flags: &'static str,
    /// True when its load test passed and no feature it needs is missing;
    /// false when something keeps it from working; null when that is not
    /// known (its load test was skipped).
    pub works: Option<bool>,
    /// What keeps it from working: missing features (`no ... (5.8+)`),
    /// programs refused, or why its load test was skipped; empty when
    /// nothing does.
    pub why: Vec<String>,
}

#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Report {
    /// The version of this document's layout: 1.
    schema: u32,
    /// The running kernel.
    kernel: Kernel,
    /// Each kernel feature memtrace uses or may use, probed on this kernel.
    features: Vec<FeatureCheck>,
    privileges: Privileges,
    /// One load test per stack mode: the eBPF object loaded with the mode's
    /// settings and each of its programs in it, nothing attached.
    load_tests: Vec<ModeLoad>,
    /// The eBPF object's stack use per call chain, read from its code; null
    /// when it could not be analysed (`stack_budget_error` says why).
    stack_budget: Option<Budget>,
    /// Why the stack budget could not be computed (no eBPF object in this
    /// build, an object that does not parse or has no programs); null when
    /// `stack_budget` is there.
    stack_budget_error: Option<String>,
    /// Whether each way of tracing will work here, and what keeps it from
    /// working.
    modes: Vec<ModeVerdict>,
    /// Whether the default mode's programs (`call_enter`, `call_exit`, and
    /// the tail-called ones where the object has them) loaded: `memtrace
    /// doctor` then exits 0, else 1.
    default_loads: bool,
    ebpf_object: EbpfObject,
}

/// Which build of the eBPF programs this kernel gets (`kernel::variant`).
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
struct EbpfObject {
    /// `full`, `tailcall` or `compat`.
    variant: &'static str,
    /// Each thread's in-flight calls are kept in its own task-local storage
    /// (no hash, no claim, no compare-and-swap per call); false: in hashed
    /// slots (the compat object, kernels whose uprobe programs may not use
    /// task storage, or `MEMTRACE_THREAD_STORAGE=0`).
    thread_storage: bool,
    /// The features of the full object's this kernel lacks (feature keys).
    missing: Vec<&'static str>,
    /// Why this variant, from the probed features.
    why: String,
    /// What the object does differently from the full one (`null` for `full`).
    notice: Option<String>,
}

// `usdt_fire` is load-tested (and its headroom checked) but judges no
// mode: only traces of USDT probes load it.
const ENTRY_PROGRAMS: [&str; 2] = ["call_enter", "call_exit"];
const ALL_PROGRAMS: [&str; 3] = ["call_enter", "call_exit", "task_new"];

/// The three stack modes a load test covers: key, flags, settings.
fn stack_modes() -> [(&'static str, LoadOptions); 3] {
    let default = LoadOptions {
        stack_mode: STACK_MODE_DWARF,
        stack_depth: 64,
        // As the tracer's defaults: 64 frames, 64 MiB of tables, 64 processes.
        unwind: crate::unwind::kernel::Capacity::from_mib(64, 65),
        sample_rate: 1,
        min_size: 0,
        max_size: u64::MAX,
        null_mode: false,
        ring_bytes: 8 << 20,
        stack_entries: 16384,
        wakeup_bytes: 64 << 10,
        settle_in_kernel: true,
        // As a trace attaches by default: `uprobe_multi` links where found.
        attach: crate::trace::loader::AttachMode::Auto,
        // Set from the kernel when the variant is chosen.
        thread_storage: false,
    };
    [
        (Mode::Dwarf.key(), default),
        (
            Mode::FramePointers.key(),
            LoadOptions {
                stack_mode: STACK_MODE_FP,
                ..default
            },
        ),
        (
            Mode::NoStacks.key(),
            LoadOptions {
                stack_mode: STACK_MODE_NONE,
                stack_depth: 0,
                ..default
            },
        ),
    ]
}

/// Runs the load test of one mode.
fn load_mode(key: &'static str, options: &LoadOptions, skip: Option<&str>) -> ModeLoad {
    let flags = loader::mode_flags(options);
    let mut result = ModeLoad {
        mode: key,
        flags,
        skipped: skip.map(str::to_string),
        maps_error: None,
        programs: Vec::new(),
    };
    if skip.is_some() {
        return result;
    }
    match loader::load_test(options) {
        Err(err) => result.maps_error = Some(error_chain(&err)),
        Ok(programs) => {
            result.programs = programs
                .into_iter()
                .map(|program| match program.outcome {
                    Ok(insns) => ProgramReport {
                        program: program.name.to_string(),
                        loaded: true,
                        verified_insns: insns,
                        error: None,
                        log: None,
                    },
                    Err(err) => {
                        let (error, log) = describe_failure(program.name, key, &err);
                        ProgramReport {
                            program: program.name.to_string(),
                            loaded: false,
                            verified_insns: None,
                            error: Some(error),
                            log,
                        }
                    }
                })
                .collect();
        }
    }
    result
}

/// A program's load failure in one line, and where its verifier log went.
fn describe_failure(
    program: &str,
    mode: &str,
    err: &aya::programs::ProgramError,
) -> (String, Option<String>) {
    match err {
        aya::programs::ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = verifier_log.to_string();
            let reason = verifier::classify(&log);
            let saved = verifier::save_log(&format!("{program}-{mode}"), &log);
            let text = match reason {
                verifier::Reason::Empty => format!("refused: {io_error}"),
                reason => reason.describe(),
            };
            (text, saved.map(|path| path.display().to_string()))
        }
        other => (error_chain(other), None),
    }
}

fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = Vec::new();
    let mut current = Some(err);
    while let Some(e) = current {
        let text = e.to_string();
        if !parts.iter().any(|p: &String| p.contains(&text)) {
            parts.push(text);
        }
        current = e.source();
    }
    // A verifier log never reaches here, but keep the line a line.
    parts.join(": ").replace('\n', " ")
}

/// Which modes will work, from the features and the load tests (pure).
pub fn verdicts(presence: impl Fn(Feature) -> Presence, loads: &[ModeLoad]) -> Vec<ModeVerdict> {
    let load = |key: &str| loads.iter().find(|l| l.mode == key);
    Mode::ALL
        .iter()
        .map(|&mode| {
            let (test, programs): (Option<&ModeLoad>, &[&str]) = match mode {
                Mode::Dwarf | Mode::Settling | Mode::PythonFrames => {
                    (load(Mode::Dwarf.key()), &ENTRY_PROGRAMS)
                }
                Mode::FramePointers => (load(Mode::FramePointers.key()), &ENTRY_PROGRAMS),
                Mode::NoStacks => (load(Mode::NoStacks.key()), &ENTRY_PROGRAMS),
                Mode::FollowForks => (load(Mode::Dwarf.key()), &ALL_PROGRAMS),
            };
            let mut why: Vec<String> = mode
                .missing(&presence)
                .into_iter()
                .map(|f| format!("no {} ({}+)", f.describe(), f.since()))
                .collect();
            let loaded = test.and_then(|t| t.loaded(programs));
            if let (Some(false), Some(test)) = (loaded, test) {
                why.extend(test.failures(programs));
            }
            let works = match loaded {
                _ if !why.is_empty() => Some(false),
                Some(true) => Some(true),
                _ => None,
            };
            if works.is_none() {
                if let Some(skipped) = test.and_then(|t| t.skipped.clone()) {
                    why.push(format!("load test skipped: {skipped}"));
                }
            }
            ModeVerdict {
                mode: mode.key(),
                flags: mode.flags(),
                works,
                why,
            }
        })
        .collect()
}

/// Runs `memtrace doctor`.
pub fn run(args: &DoctorArgs) -> anyhow::Result<ExitCode> {
    let privileges = Privileges::read().with_uprobe_rule(crate::kernel::privilege::uprobe_rule());
    let features = features::probe(privileges.can_trace);
    let choice = crate::kernel::variant::forced(|f| features.presence(f))
        .unwrap_or_else(|| crate::kernel::variant::Choice::from_presence(|f| features.presence(f)));
    let object = loader::object(choice.variant);
    let skip = if object.is_empty() {
        Some("this memtrace was built without its eBPF object (`cargo xtask build-ebpf`)")
    } else if !privileges.can_trace {
        Some("needs root, or CAP_BPF and CAP_PERFMON (and CAP_SYS_ADMIN where the kernel lets only it create uprobes)")
    } else {
        None
    };
    let load_tests: Vec<ModeLoad> = stack_modes()
        .iter()
        .map(|(key, options)| load_mode(key, options, skip))
        .collect();
    let (stack_budget, stack_budget_error) = match stack_budget::of_object(object) {
        Ok(budget) => (Some(budget), None),
        Err(err) => (None, Some(err.to_string())),
    };
    let modes = verdicts(|f| features.presence(f), &load_tests);
    let ebpf_object = EbpfObject {
        variant: choice.variant.key(),
        thread_storage: choice.thread_storage,
        missing: choice.missing.iter().map(|f| f.key()).collect(),
        why: choice.reason(),
        notice: choice.notice(true),
    };
    let default_loads = load_tests
        .iter()
        .find(|l| l.mode == Mode::Dwarf.key())
        .and_then(|l| l.loaded(&ENTRY_PROGRAMS))
        .unwrap_or(false);
    let report = Report {
        schema: 1,
        kernel: kernel_of(&features),
        features: features.checks.clone(),
        privileges,
        load_tests,
        stack_budget,
        stack_budget_error,
        modes,
        default_loads,
        ebpf_object,
    };
    let text = match args.format {
        DoctorFormat::Json => serde_json::to_string_pretty(&report)? + "\n",
        DoctorFormat::Text => text::render_text(&report),
    };
    print!("{text}");
    Ok(if default_loads {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(crate::error::EXIT_RUNTIME)
    })
}

fn kernel_of(features: &Features) -> Kernel {
    Kernel {
        release: features.release.clone(),
        version: features.version.map(|v| v.to_string()),
        arch: features.arch.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn program(name: &str, loaded: bool) -> ProgramReport {
        ProgramReport {
            program: name.to_string(),
            loaded,
            verified_insns: loaded.then_some(1000),
            error: (!loaded).then(|| "combined stack size of 3 calls is 608 B (limit 512)".into()),
            log: None,
        }
    }

    fn mode_load(key: &'static str, flags: &'static str, exit_loads: bool) -> ModeLoad {
        ModeLoad {
            mode: key,
            flags,
            skipped: None,
            maps_error: None,
            programs: vec![
                program("call_enter", true),
                program("call_exit", exit_loads),
                program("task_new", true),
                program("usdt_fire", true),
            ],
        }
    }

    #[test]
    fn this_hosts_situation_fails_default_but_not_fp() {
        let loads = [
            mode_load("default", "--stacks dwarf", false),
            mode_load("stacks_fp", "--stacks fp", true),
            mode_load("stack_depth_0", "--stack-depth 0", true),
        ];
        let verdicts = verdicts(|_| Presence::Found, &loads);
        let works: Vec<(&str, Option<bool>)> = verdicts.iter().map(|v| (v.mode, v.works)).collect();
        assert_eq!(
            works,
            vec![
                ("default", Some(false)),
                ("stacks_fp", Some(true)),
                ("stack_depth_0", Some(true)),
                ("settling", Some(false)),
                ("python_frames", Some(false)),
                ("follow_forks", Some(false)),
            ]
        );
        assert_eq!(
            verdicts[0].why,
            vec!["--stacks dwarf call_exit: combined stack size of 3 calls is 608 B (limit 512)"]
        );
    }

    #[test]
    fn missing_features_fail_modes_even_without_a_load_test() {
        let skipped = ModeLoad {
            mode: "default",
            flags: "--stacks dwarf",
            skipped: Some("needs root".into()),
            maps_error: None,
            programs: Vec::new(),
        };
        let presence = |f: Feature| {
            if f == Feature::AtomicsFetch {
                Presence::Missing
            } else {
                Presence::Unknown
            }
        };
        let verdicts = verdicts(presence, &[skipped]);
        let by_key = |key: &str| verdicts.iter().find(|v| v.mode == key).cloned();
        let settling = by_key("settling").expect("settling");
        assert_eq!(settling.works, Some(false));
        assert!(
            settling.why[0].contains("atomics with fetch"),
            "{:?}",
            settling.why
        );
        // DWARF stacks need no atomics (any object walks them): unknown,
        // with nothing against them.
        let dwarf = by_key("default").expect("default");
        assert_eq!(dwarf.works, None);
        assert!(
            dwarf.why.iter().all(|w| w.starts_with("load test skipped")),
            "{:?}",
            dwarf.why
        );
    }

    #[test]
    fn follow_forks_needs_the_fork_reporter() {
        let mut load = mode_load("default", "--stacks dwarf", true);
        load.programs[2].loaded = false;
        let verdicts = verdicts(|_| Presence::Found, &[load]);
        let by_key = |key: &str| verdicts.iter().find(|v| v.mode == key).cloned();
        assert_eq!(by_key("default").and_then(|v| v.works), Some(true));
        assert_eq!(by_key("follow_forks").and_then(|v| v.works), Some(false));
    }

    #[test]
    fn a_tail_called_program_that_fails_fails_every_mode() {
        let mut loads = [
            mode_load("default", "--stacks dwarf", true),
            mode_load("stacks_fp", "--stacks fp", true),
            mode_load("stack_depth_0", "--stack-depth 0", true),
        ];
        for load in &mut loads {
            load.programs.push(program("tail_python", true));
            load.programs.push(program("tail_walk", true));
        }
        let all_work = verdicts(|_| Presence::Found, &loads);
        assert!(
            all_work.iter().all(|v| v.works == Some(true)),
            "{all_work:?}"
        );
        // Seen on arm64 5.10: the compat object's walk refused, its probes loaded.
        for load in &mut loads {
            load.programs[5].loaded = false;
            load.programs[5].error = Some("invalid read from stack".into());
        }
        let verdicts = verdicts(|_| Presence::Found, &loads);
        for verdict in &verdicts {
            assert_eq!(verdict.works, Some(false), "{verdict:?}");
        }
        let default = verdicts
            .iter()
            .find(|v| v.mode == "default")
            .expect("default");
        assert_eq!(
            default.why,
            vec!["--stacks dwarf tail_walk: invalid read from stack"]
        );
        assert_eq!(loads[0].loaded(&ENTRY_PROGRAMS), Some(false));
    }

    #[test]
    fn maps_error_fails_the_mode() {
        let load = ModeLoad {
            mode: "default",
            flags: "--stacks dwarf",
            skipped: None,
            maps_error: Some("creating map EVENTS: EINVAL".into()),
            programs: Vec::new(),
        };
        assert_eq!(load.loaded(&ENTRY_PROGRAMS), Some(false));
        assert_eq!(
            load.failures(&ENTRY_PROGRAMS),
            vec!["--stacks dwarf: maps: creating map EVENTS: EINVAL"]
        );
    }
}
