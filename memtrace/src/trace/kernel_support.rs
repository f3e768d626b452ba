//! Telling a kernel that lacks a feature memtrace needs apart from other load
//! and attach failures, and saying so in one line that names the feature and
//! the kernel option or version that provides it.
//!
//! The classification reads the error chain aya returns: the system call that
//! failed, its errno and, where aya knows better than the errno, its own error
//! variant (no attach-cookie support, no uprobe PMU in sysfs). A missing
//! feature is a runtime failure (exit 1); a refused privilege keeps its own
//! exit code (4).

use std::error::Error;
use std::io;

use aya::maps::MapError;
use aya::programs::uprobe::UProbeError;
use aya::programs::ProgramError;
use aya::sys::SyscallError;

use crate::error::Failure;
use crate::kernel::verifier;

/// The map the ring buffer lives in (see memtrace-ebpf).
const RING_MAP: &str = "EVENTS";
/// Where the kernel describes its uprobe PMU; absent without CONFIG_UPROBE_EVENTS.
const UPROBE_PMU_DIR: &str = "/sys/bus/event_source/devices/uprobe";

/// A kernel feature memtrace needs and this kernel lacks, as the one line to show.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unsupported(String);

impl From<Unsupported> for Failure {
    fn from(unsupported: Unsupported) -> Self {
        Failure::runtime(unsupported.0)
    }
}

/// What aya's feature probes found (they run before the first load).
#[derive(Clone, Copy, Debug)]
pub struct Probed {
    pub global_data: bool,
}

impl Probed {
    pub fn from_aya() -> Self {
        Probed {
            global_data: aya::features().bpf_global_data(),
        }
    }
}

/// Turns an error from loading the eBPF object or its programs into the
/// failure the user sees: a refused privilege (exit 4), a missing kernel
/// feature (exit 1, one line naming it), or any other load failure (exit 1)
/// with its whole cause chain.
pub fn load_failure(err: &(dyn Error + 'static)) -> Failure {
    load_failure_with(err, Probed::from_aya())
}

fn load_failure_with(err: &(dyn Error + 'static), probed: Probed) -> Failure {
    if errno_in(err) == Some(libc::EPERM) {
        return Failure::permission(format!(
            "permission denied loading eBPF programs: memtrace needs root, or CAP_BPF and CAP_PERFMON ({})",
            chain(err)
        ));
    }
    match unsupported_at_load(err, probed) {
        Some(unsupported) => unsupported.into(),
        None => Failure::runtime(format!("cannot load the eBPF programs: {}", chain(err))),
    }
}

/// Turns a program's load error into the failure the user sees. A refused
/// privilege and a missing kernel feature are as in [`load_failure`]; a
/// verifier refusal becomes one line (see `kernel::verifier`): the program,
/// the stack mode (`mode`), the limit it hit, what to try (`alternatives`,
/// asked only when another stack mode may help: the flags that load here),
/// and the file the whole log was saved to.
pub fn program_load_failure(
    program: &str,
    mode: &str,
    err: &ProgramError,
    alternatives: impl FnOnce() -> Vec<&'static str>,
) -> Failure {
    let ProgramError::LoadError {
        io_error,
        verifier_log,
    } = err
    else {
        return load_failure(err);
    };
    if io_error.raw_os_error() == Some(libc::EPERM) {
        return load_failure(err);
    }
    verifier_failure(program, mode, &verifier_log.to_string(), alternatives)
}

/// [`program_load_failure`] on the verifier's log.
fn verifier_failure(
    program: &str,
    mode: &str,
    log: &str,
    alternatives: impl FnOnce() -> Vec<&'static str>,
) -> Failure {
    let reason = verifier::classify(log);
    let others = if reason.depends_on_mode() {
        alternatives()
    } else {
        Vec::new()
    };
    let saved = verifier::save_log(program, log);
    let lines = log.lines().count();
    Failure::runtime(verifier::one_line(
        program,
        mode,
        &reason,
        &others,
        saved.as_deref().map(|path| (path, lines)),
    ))
}

/// The missing kernel feature behind a load error, if that is what it is.
pub fn unsupported_at_load(err: &(dyn Error + 'static), probed: Probed) -> Option<Unsupported> {
    let map = find::<MapError>(err).and_then(|map| match map {
        MapError::CreateError { name, io_error } => Some((name.as_str(), io_error.raw_os_error())),
        _ => None,
    });
    let relocation = matches!(
        find::<aya::EbpfError>(err),
        Some(aya::EbpfError::RelocationError(_))
    );
    load_verdict(errno_in(err), map, relocation, probed)
}

/// [`unsupported_at_load`] on the facts it reads from the error chain: the
/// first errno, the map whose creation failed (and its errno), whether a
/// relocation failed.
fn load_verdict(
    errno: Option<i32>,
    map: Option<(&str, Option<i32>)>,
    relocation: bool,
    probed: Probed,
) -> Option<Unsupported> {
    if errno == Some(libc::ENOSYS) {
        return Some(no_bpf());
    }
    if let Some((RING_MAP, Some(libc::EINVAL))) = map {
        return Some(Unsupported(format!(
            "this kernel does not support BPF ring buffers (creating map {RING_MAP}: EINVAL; needs Linux 5.8 or newer)"
        )));
    }
    // Without global data aya leaves the .rodata/.bss maps out, so relocating
    // the load-time settings fails.
    if relocation && !probed.global_data {
        return Some(Unsupported(
            "this kernel does not support BPF global data (BPF_PROG_LOAD feature probe failed; needs Linux 5.2 or newer, memtrace needs 5.15)".to_string(),
        ));
    }
    None
}

/// The missing kernel feature behind a uprobe attach error, if that is what it is.
pub fn unsupported_at_attach(err: &ProgramError) -> Option<Unsupported> {
    match err {
        ProgramError::AttachCookieNotSupported => Some(Unsupported(
            "this kernel does not support BPF attach cookies on uprobes (BPF perf links and bpf_get_attach_cookie; needs Linux 5.15 or newer)".to_string(),
        )),
        ProgramError::UProbeError(UProbeError::FileError { filename, io_error })
            if filename.starts_with(UPROBE_PMU_DIR)
                && io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Some(no_uprobes(&format!("no {}", filename.display())))
        }
        ProgramError::SyscallError(SyscallError { call, io_error }) => {
            syscall_unsupported(call, io_error)
        }
        _ => None,
    }
}

/// Wraps a uprobe attach error: a missing kernel feature becomes an
/// [`Unsupported`] (find it with `downcast_ref`), anything else keeps its
/// chain under `what` ("uprobe", "uretprobe").
pub fn attach_error(err: ProgramError, what: &'static str) -> anyhow::Error {
    match unsupported_at_attach(&err) {
        Some(unsupported) => unsupported.into(),
        None => anyhow::Error::new(err).context(what),
    }
}

/// What an attach failure that is not a missing feature most likely means,
/// when memtrace can tell: `perf_event_open` refusing a uprobe with EINVAL on
/// a valid offset is the kernel's rule that all uprobes on one (file, offset)
/// share one `ref_ctr_offset`, system-wide, broken by another tracer.
pub fn attach_conflict(err: &anyhow::Error) -> Option<&'static str> {
    const CONFLICT: &str =
        "another tracer holds a uprobe on this instruction with a different ref_ctr_offset \
         (the kernel allows one per file offset, system-wide; bcc's Python tools pass a \
         garbage one, iovisor/bcc#5236: start them with tracefs mounted, or stop them)";
    err.chain().find_map(|cause| {
        if let Some(multi) = cause.downcast_ref::<crate::kernel::uprobe_multi::MultiError>() {
            // A uprobe_multi link meets the same rule (EINVAL from uprobe_register).
            return (multi.raw_os_error() == Some(libc::EINVAL)).then_some(CONFLICT);
        }
        let program = cause.downcast_ref::<ProgramError>()?;
        match program {
            ProgramError::SyscallError(SyscallError { call, io_error })
                if *call == "perf_event_open" && io_error.raw_os_error() == Some(libc::EINVAL) =>
            {
                Some(CONFLICT)
            }
            _ => None,
        }
    })
}

fn syscall_unsupported(call: &str, io_error: &io::Error) -> Option<Unsupported> {
    let errno = io_error.raw_os_error()?;
    match (call, errno) {
        (_, libc::ENOSYS) if call.starts_with("bpf") => Some(no_bpf()),
        ("perf_event_open", libc::ENOSYS) => Some(Unsupported(
            "this kernel does not support perf events (perf_event_open: ENOSYS; needs CONFIG_PERF_EVENTS)"
                .to_string(),
        )),
        // ENOENT: no PMU of the uprobe type; EOPNOTSUPP: the PMU cannot
        // create this event.
        ("perf_event_open", libc::ENOENT | libc::EOPNOTSUPP) => {
            Some(no_uprobes(&format!("perf_event_open: {}", errno_name(errno))))
        }
        _ => None,
    }
}

fn no_bpf() -> Unsupported {
    Unsupported(
        "this kernel does not support BPF (bpf syscall: ENOSYS; needs CONFIG_BPF_SYSCALL)"
            .to_string(),
    )
}

fn no_uprobes(why: &str) -> Unsupported {
    Unsupported(format!(
        "this kernel cannot create uprobes ({why}; needs CONFIG_UPROBE_EVENTS)"
    ))
}

/// The first OS error number in the chain.
fn errno_in(err: &(dyn Error + 'static)) -> Option<i32> {
    find::<io::Error>(err).and_then(io::Error::raw_os_error)
}

/// The first error of type `T` in the chain.
fn find<'a, T: Error + 'static>(err: &'a (dyn Error + 'static)) -> Option<&'a T> {
    let mut current = Some(err);
    while let Some(e) = current {
        if let Some(found) = e.downcast_ref::<T>() {
            return Some(found);
        }
        current = e.source();
    }
    None
}

/// The messages of the chain, joined by ": ", each once (aya's messages
/// sometimes repeat their source's).
fn chain(err: &(dyn Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut current = Some(err);
    while let Some(e) = current {
        let text = e.to_string();
        if !parts.last().is_some_and(|last| last.contains(&text)) {
            parts.push(text);
        }
        current = e.source();
    }
    parts.join(": ")
}

fn errno_name(errno: i32) -> String {
    match errno {
        libc::ENOENT => "ENOENT".to_string(),
        libc::EOPNOTSUPP => "EOPNOTSUPP".to_string(),
        libc::ENOSYS => "ENOSYS".to_string(),
        libc::EINVAL => "EINVAL".to_string(),
        other => format!("errno {other}"),
    }
}

/// Whether an attach error (as [`attach_error`] wraps it) is a missing kernel feature.
pub fn unsupported_in(err: &anyhow::Error) -> Option<&Unsupported> {
    err.downcast_ref::<Unsupported>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{EXIT_PERMISSION, EXIT_RUNTIME};
    use std::path::PathBuf;

    const MODERN: Probed = Probed { global_data: true };

    fn os(errno: i32) -> io::Error {
        io::Error::from_raw_os_error(errno)
    }

    fn map_create(name: &str, errno: i32) -> aya::EbpfError {
        aya::EbpfError::MapError(MapError::CreateError {
            name: name.to_string(),
            io_error: os(errno),
        })
    }

    fn syscall(call: &'static str, errno: i32) -> ProgramError {
        ProgramError::SyscallError(SyscallError {
            call,
            io_error: os(errno),
        })
    }

    #[test]
    fn verifier_refusal_is_one_line_naming_the_limit_and_the_log() {
        let mut log = String::new();
        for i in 0..2000 {
            log.push_str(&format!("{i}: (bf) r1 = r6\n"));
        }
        log.push_str("combined stack size of 3 calls is 608. Too large\nprocessed 15063 insns (limit 1000000)\n");
        let program = format!("unit_test_{}", std::process::id());
        let failure = verifier_failure(&program, "--stacks dwarf", &log, || vec!["--stacks fp"]);
        assert_eq!(failure.code, EXIT_RUNTIME);
        let line = failure.message;
        assert!(!line.contains('\n'), "{line}");
        assert!(line.contains(&program), "{line}");
        assert!(
            line.contains("combined stack size of 3 calls is 608 B (limit 512)"),
            "{line}"
        );
        assert!(line.contains("--stacks fp loads on this kernel"), "{line}");
        let path = verifier::log_path(&program, std::process::id());
        assert!(line.contains(&path.display().to_string()), "{line}");
        let saved = std::fs::read_to_string(&path).unwrap_or_default();
        assert_eq!(saved.lines().count(), 2002);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn missing_atomics_do_not_ask_for_other_modes() {
        let program = format!("unit_test_atomics_{}", std::process::id());
        let failure = verifier_failure(
            &program,
            "--stacks fp",
            "BPF_STX uses reserved fields\n",
            || panic!("no other mode helps without atomics"),
        );
        assert!(failure
            .message
            .contains("the kernel lacks BPF atomics, 5.12+"));
        assert!(failure.message.contains("memtrace doctor"));
        let _ = std::fs::remove_file(verifier::log_path(&program, std::process::id()));
    }

    #[test]
    fn bpf_enosys_names_the_missing_bpf_syscall() {
        let failure = load_failure_with(&map_create("SPECS", libc::ENOSYS), MODERN);
        assert_eq!(failure.code, EXIT_RUNTIME);
        assert_eq!(
            failure.message,
            "this kernel does not support BPF (bpf syscall: ENOSYS; needs CONFIG_BPF_SYSCALL)"
        );
    }

    #[test]
    fn eperm_at_load_stays_a_privilege_failure() {
        let failure = load_failure_with(&map_create("EVENTS", libc::EPERM), MODERN);
        assert_eq!(failure.code, EXIT_PERMISSION);
        assert!(failure.message.starts_with("permission denied"));
        assert!(failure.message.contains("EVENTS"), "{}", failure.message);
    }

    #[test]
    fn ring_map_einval_names_ring_buffers() {
        let failure = load_failure_with(&map_create(RING_MAP, libc::EINVAL), MODERN);
        assert_eq!(failure.code, EXIT_RUNTIME);
        assert!(failure.message.contains("BPF ring buffers"));
        assert!(failure.message.contains("5.8"));
    }

    #[test]
    fn other_load_failures_keep_their_cause() {
        let failure = load_failure_with(&map_create("PENDING", libc::EINVAL), MODERN);
        assert_eq!(failure.code, EXIT_RUNTIME);
        assert!(failure
            .message
            .starts_with("cannot load the eBPF programs: "));
        assert!(failure.message.contains("PENDING"), "{}", failure.message);
        assert!(
            failure.message.contains("os error 22"),
            "{}",
            failure.message
        );
        assert!(!failure.message.contains('\n'));
    }

    #[test]
    fn relocation_failure_without_global_data_names_it() {
        let old = Probed { global_data: false };
        let verdict = load_verdict(Some(libc::EINVAL), None, true, old).map(|u| u.0);
        assert!(verdict.is_some_and(|m| m.contains("BPF global data") && m.contains("5.15")));
        assert_eq!(load_verdict(Some(libc::EINVAL), None, true, MODERN), None);
        assert_eq!(load_verdict(Some(libc::EINVAL), None, false, old), None);
    }

    #[test]
    fn perf_event_open_without_a_uprobe_pmu_names_uprobe_events() {
        for (errno, name) in [(libc::ENOENT, "ENOENT"), (libc::EOPNOTSUPP, "EOPNOTSUPP")] {
            let unsupported = unsupported_at_attach(&syscall("perf_event_open", errno));
            assert_eq!(
                unsupported,
                Some(Unsupported(format!(
                    "this kernel cannot create uprobes (perf_event_open: {name}; needs CONFIG_UPROBE_EVENTS)"
                )))
            );
        }
    }

    #[test]
    fn perf_event_open_enosys_names_perf_events() {
        let unsupported = unsupported_at_attach(&syscall("perf_event_open", libc::ENOSYS));
        assert!(unsupported.is_some_and(|u| u.0.contains("CONFIG_PERF_EVENTS")));
    }

    #[test]
    fn bpf_link_create_enosys_names_bpf() {
        assert_eq!(
            unsupported_at_attach(&syscall("bpf_link_create", libc::ENOSYS)),
            Some(no_bpf())
        );
    }

    #[test]
    fn missing_uprobe_pmu_file_names_uprobe_events() {
        let filename = PathBuf::from(UPROBE_PMU_DIR).join("type");
        let err = ProgramError::UProbeError(UProbeError::FileError {
            filename,
            io_error: os(libc::ENOENT),
        });
        let unsupported = unsupported_at_attach(&err).map(|u| u.0);
        assert_eq!(
            unsupported.as_deref(),
            Some("this kernel cannot create uprobes (no /sys/bus/event_source/devices/uprobe/type; needs CONFIG_UPROBE_EVENTS)")
        );
    }

    #[test]
    fn no_attach_cookies_names_the_kernel_version() {
        let unsupported = unsupported_at_attach(&ProgramError::AttachCookieNotSupported);
        assert!(unsupported.is_some_and(|u| u.0.contains("attach cookies") && u.0.contains("5.15")));
    }

    #[test]
    fn einval_from_perf_event_open_names_a_ref_ctr_conflict() {
        let err = attach_error(syscall("perf_event_open", libc::EINVAL), "uprobe");
        assert!(unsupported_in(&err).is_none());
        let why = attach_conflict(&err).unwrap_or_default();
        assert!(why.contains("ref_ctr_offset"), "{why}");
        let other = attach_error(syscall("perf_event_open", libc::EBUSY), "uprobe");
        assert_eq!(attach_conflict(&other), None);
    }

    #[test]
    fn ordinary_attach_failures_are_not_kernel_features() {
        for err in [
            syscall("perf_event_open", libc::EACCES),
            syscall("perf_event_open", libc::EPERM),
            syscall("perf_event_open", libc::EINVAL),
            syscall("bpf_link_create", libc::EINVAL),
            ProgramError::UProbeError(UProbeError::FileError {
                filename: PathBuf::from("/usr/lib/libc.so.6"),
                io_error: os(libc::ENOENT),
            }),
            ProgramError::NotLoaded,
        ] {
            assert_eq!(unsupported_at_attach(&err), None, "{err:?}");
        }
    }

    #[test]
    fn attach_error_is_downcastable_only_for_missing_features() {
        let err = attach_error(syscall("perf_event_open", libc::ENOENT), "uprobe");
        assert!(unsupported_in(&err).is_some());
        let err = attach_error(syscall("perf_event_open", libc::EACCES), "uretprobe");
        assert!(unsupported_in(&err).is_none());
        let text = format!("{err:#}");
        assert!(text.starts_with("uretprobe: "), "{text}");
        assert!(text.contains("Permission denied"), "{text}");
    }
}
