//! What the running kernel offers memtrace, found by asking it, never by
//! its version alone: each eBPF feature is probed by creating the map,
//! loading the tiny program or finding the symbol that only a kernel with it
//! has (distribution kernels backport features and leave others out). The
//! version is only shown, and names the release a missing feature arrived in.
//!
//! Also owns the privilege facts (effective uid, capabilities,
//! `perf_event_paranoid`, `unprivileged_bpf_disabled`, lockdown) and the
//! table of which features each tracing mode needs ([`Mode::needs`]).
//!
//! The parsers (`CapEff`, the lockdown line, the kernel release) and the mode
//! table are pure and tested without root; the probes need the kernel.
//!
//! Over 800 lines with its tests (~130): the code, one probe per feature and the mode table, is ~670.

use std::fmt;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;

use aya::maps::MapType;
use aya::programs::ProgramType;
use aya::sys::{is_helper_supported, is_map_supported, is_program_supported, BpfHelper};
use serde::Serialize;

/// The running kernel's BTF.
pub const BTF_PATH: &str = "/sys/kernel/btf/vmlinux";
/// Where the kernel describes its uprobe PMU (CONFIG_UPROBE_EVENTS).
pub const UPROBE_PMU_DIR: &str = "/sys/bus/event_source/devices/uprobe";
const LOCKDOWN_PATH: &str = "/sys/kernel/security/lockdown";
const KALLSYMS: &str = "/proc/kallsyms";

/// A kernel release, as `uname -r` gives it (`6.18.44-fc-v1045`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct KernelVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl fmt::Display for KernelVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Parses the numeric head of a kernel release: `5.10.0-30-cloud-amd64` is
/// 5.10.0, `7.2-rc1` 7.2.0, `6.18.44-fc-v1045` 6.18.44; `None` without at
/// least `MAJOR.MINOR`.
pub fn parse_release(release: &str) -> Option<KernelVersion> {
    let mut parts = release.trim().splitn(3, '.');
    let number = |part: Option<&str>| -> Option<u32> {
        let part = part?;
        let end = part
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(part.len());
        part[..end].parse().ok()
    };
    let major = number(parts.next())?;
    let minor = number(parts.next())?;
    let patch = number(parts.next()).unwrap_or(0);
    Some(KernelVersion {
        major,
        minor,
        patch,
    })
}

/// Whether a feature is there: found, missing, or not known (the probe
/// itself was refused, e.g. without privilege).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Presence {
    Found,
    Missing,
    Unknown,
}

impl Presence {
    fn of(found: bool) -> Self {
        if found {
            Presence::Found
        } else {
            Presence::Missing
        }
    }

    pub fn word(self) -> &'static str {
        match self {
            Presence::Found => "found",
            Presence::Missing => "MISSING",
            Presence::Unknown => "unknown",
        }
    }
}

/// The kernel features memtrace uses or may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Feature {
    Btf,
    UprobePmu,
    RingBuffer,
    GlobalData,
    AtomicsFetch,
    BpfLoop,
    PerfLink,
    AttachCookie,
    RawTracepoint,
    TaskStorage,
    TaskStorageInUprobes,
    UprobeMulti,
    UretprobeSyscall,
    TailCallsWithCalls,
}

impl Feature {
    pub const ALL: [Feature; 14] = [
        Feature::Btf,
        Feature::UprobePmu,
        Feature::RingBuffer,
        Feature::GlobalData,
        Feature::AtomicsFetch,
        Feature::BpfLoop,
        Feature::PerfLink,
        Feature::AttachCookie,
        Feature::RawTracepoint,
        Feature::TaskStorage,
        Feature::TaskStorageInUprobes,
        Feature::UprobeMulti,
        Feature::UretprobeSyscall,
        Feature::TailCallsWithCalls,
    ];

    /// The stable key (JSON `features[].key`).
    pub fn key(self) -> &'static str {
        match self {
            Feature::Btf => "btf",
            Feature::UprobePmu => "uprobe_pmu",
            Feature::RingBuffer => "ring_buffer",
            Feature::GlobalData => "global_data",
            Feature::AtomicsFetch => "atomics_fetch",
            Feature::BpfLoop => "bpf_loop",
            Feature::PerfLink => "perf_link",
            Feature::AttachCookie => "attach_cookie",
            Feature::RawTracepoint => "raw_tracepoint",
            Feature::TaskStorage => "task_storage",
            Feature::TaskStorageInUprobes => "task_storage_in_uprobes",
            Feature::UprobeMulti => "uprobe_multi",
            Feature::UretprobeSyscall => "uretprobe_syscall",
            Feature::TailCallsWithCalls => "tail_calls_with_calls",
        }
    }

    /// What it is, for people.
    pub fn describe(self) -> &'static str {
        match self {
            Feature::Btf => "kernel BTF (/sys/kernel/btf/vmlinux)",
            Feature::UprobePmu => "uprobe perf events (CONFIG_UPROBE_EVENTS)",
            Feature::RingBuffer => "BPF ring buffer map",
            Feature::GlobalData => "BPF global data (.rodata/.bss maps)",
            Feature::AtomicsFetch => "BPF atomics with fetch (fetch-add, xchg, cmpxchg)",
            Feature::BpfLoop => "bpf_loop helper",
            Feature::PerfLink => "BPF perf links",
            Feature::AttachCookie => "bpf_get_attach_cookie",
            Feature::RawTracepoint => "raw tracepoint programs",
            Feature::TaskStorage => "task-local storage map",
            Feature::TaskStorageInUprobes => {
                "task-local storage from uprobe programs (each thread's in-flight calls)"
            }
            Feature::UprobeMulti => {
                "uprobe_multi links (one BPF link per object and process: fast attach and detach)"
            }
            Feature::UretprobeSyscall => "uretprobe syscall (fast return probes, x86-64)",
            Feature::TailCallsWithCalls => {
                "tail calls in programs with BPF-to-BPF calls (x86-64 from 5.10, arm64 from 6.0)"
            }
        }
    }

    /// The mainline release it arrived in (backports may have it earlier).
    pub fn since(self) -> &'static str {
        match self {
            Feature::Btf => "5.2",
            Feature::UprobePmu => "4.17",
            Feature::RingBuffer => "5.8",
            Feature::GlobalData => "5.2",
            Feature::AtomicsFetch => "5.12",
            Feature::BpfLoop => "5.17",
            Feature::PerfLink => "5.15",
            Feature::AttachCookie => "5.15",
            Feature::RawTracepoint => "4.17",
            Feature::TaskStorage => "5.11",
            Feature::TaskStorageInUprobes => "5.11",
            Feature::UprobeMulti => "6.6",
            Feature::UretprobeSyscall => "6.11",
            // The JITs that keep the tail-call count across calls.
            Feature::TailCallsWithCalls if cfg!(target_arch = "aarch64") => "6.0",
            Feature::TailCallsWithCalls => "5.10",
        }
    }
}

/// One probed feature.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct FeatureCheck {
    /// The feature's stable key (`btf`, `uprobe_pmu`, `ring_buffer`,
    /// `atomics_fetch`, `bpf_loop`, `uprobe_multi`, ...).
    pub key: &'static str,
    pub presence: Presence,
    /// The mainline release it arrived in (`5.8`); backports may have it
    /// earlier.
    pub since: &'static str,
    /// What it is, for people.
    pub describe: &'static str,
    /// How it was found out (or why not).
    pub detail: String,
    #[serde(skip)]
    pub feature: Feature,
}

/// Everything probed about the kernel.
#[derive(Clone, Debug)]
pub struct Features {
    pub release: String,
    pub version: Option<KernelVersion>,
    pub arch: String,
    pub checks: Vec<FeatureCheck>,
}

impl Features {
    /// The presence of one feature (unknown when it was not probed).
    pub fn presence(&self, feature: Feature) -> Presence {
        self.checks
            .iter()
            .find(|check| check.feature == feature)
            .map_or(Presence::Unknown, |check| check.presence)
    }
}

/// Probes the running kernel. `privileged`: whether this process may load
/// BPF programs (otherwise the probes that need it say `unknown`).
pub fn probe(privileged: bool) -> Features {
    let (release, arch) = uname();
    let version = parse_release(&release);
    let checks = Feature::ALL
        .iter()
        .map(|&feature| {
            let (presence, detail) = probe_one(feature, privileged);
            FeatureCheck {
                key: feature.key(),
                presence,
                since: feature.since(),
                describe: feature.describe(),
                detail,
                feature,
            }
        })
        .collect();
    Features {
        release,
        version,
        arch,
        checks,
    }
}

/// Probes one feature of the running kernel (see [`probe`]).
pub fn probe_feature(feature: Feature, privileged: bool) -> Presence {
    probe_one(feature, privileged).0
}

fn probe_one(feature: Feature, privileged: bool) -> (Presence, String) {
    let needs_bpf = || {
        (
            Presence::Unknown,
            "not probed: loading BPF needs root or CAP_BPF".to_string(),
        )
    };
    match feature {
        Feature::Btf => match std::fs::metadata(BTF_PATH) {
            Ok(meta) => (
                Presence::Found,
                format!("{BTF_PATH}, {} KiB", meta.len() >> 10),
            ),
            Err(err) => (Presence::Missing, format!("{BTF_PATH}: {err}")),
        },
        Feature::UprobePmu => {
            let found = Path::new(UPROBE_PMU_DIR).join("type").exists();
            (Presence::of(found), UPROBE_PMU_DIR.to_string())
        }
        _ if !privileged => needs_bpf(),
        Feature::RingBuffer => map_probe(MapType::RingBuf),
        Feature::TaskStorage => map_probe(MapType::TaskStorage),
        Feature::TaskStorageInUprobes => task_storage_in_uprobes_probe(),
        Feature::GlobalData => (
            Presence::of(aya::features().bpf_global_data()),
            "aya feature probe (array map referenced by a program)".to_string(),
        ),
        Feature::PerfLink => (
            Presence::of(aya::features().bpf_perf_link()),
            "aya feature probe (BPF_LINK_CREATE on a perf event)".to_string(),
        ),
        Feature::AttachCookie => helper_probe(BpfHelper::BPF_FUNC_get_attach_cookie),
        Feature::BpfLoop => helper_probe(BpfHelper::BPF_FUNC_loop),
        Feature::RawTracepoint => match is_program_supported(ProgramType::RawTracePoint) {
            Ok(found) => (
                Presence::of(found),
                "loaded a raw tracepoint program".to_string(),
            ),
            Err(err) => (Presence::Unknown, format!("probe failed: {err}")),
        },
        Feature::AtomicsFetch => atomics_probe(),
        Feature::TailCallsWithCalls => tail_calls_with_calls_probe(),
        Feature::UprobeMulti => uprobe_multi_probe(),
        Feature::UretprobeSyscall => {
            if std::env::consts::ARCH != "x86_64" {
                return (Presence::Missing, "x86-64 only".to_string());
            }
            // Never called to find out: outside the kernel's return trampoline
            // the uretprobe syscall kills its caller with SIGILL.
            symbol_probe(&["__x64_sys_uretprobe", "__do_sys_uretprobe"])
        }
    }
}

fn uprobe_multi_probe() -> (Presence, String) {
    use super::uprobe_multi::{probe, Support};
    match probe() {
        Ok(Support::Found) => (
            Presence::Found,
            "BPF_LINK_CREATE (uprobe_multi) on '/' refused as expected, PID filter fixed"
                .to_string(),
        ),
        Ok(Support::Missing) => (
            Presence::Missing,
            "BPF_LINK_CREATE refused the uprobe_multi attach type: one perf event per probe"
                .to_string(),
        ),
        Ok(Support::ThreadFilter) => (
            Presence::Missing,
            "uprobe_multi links filter one thread, not the process (6.6 without the fix): one perf event per probe"
                .to_string(),
        ),
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => (
            Presence::Missing,
            "the kernel does not know the BPF_TRACE_UPROBE_MULTI attach type".to_string(),
        ),
        Err(err) => (Presence::Unknown, format!("probe failed: {err}")),
    }
}

fn map_probe(map: MapType) -> (Presence, String) {
    match is_map_supported(map) {
        Ok(found) => (Presence::of(found), "created the map".to_string()),
        Err(err) => (Presence::Unknown, format!("probe failed: {err}")),
    }
}

/// Whether a kprobe-type program (which uprobe programs are) may call
/// `bpf_task_storage_get` on the current task (`bpf_get_current_task_btf`):
/// the map type alone does not say, since the helpers were LSM-only at first.
fn task_storage_in_uprobes_probe() -> (Presence, String) {
    if let (Presence::Missing, detail) = map_probe(MapType::TaskStorage) {
        return (Presence::Missing, format!("no task storage map: {detail}"));
    }
    for helper in [
        BpfHelper::BPF_FUNC_get_current_task_btf,
        BpfHelper::BPF_FUNC_task_storage_get,
    ] {
        match is_helper_supported(ProgramType::KProbe, helper) {
            Ok(true) => {}
            Ok(false) => {
                return (
                    Presence::Missing,
                    format!("a kprobe program may not call {helper:?}"),
                )
            }
            Err(err) => return (Presence::Unknown, format!("probe failed: {err}")),
        }
    }
    (
        Presence::Found,
        "loaded kprobe programs calling bpf_get_current_task_btf and bpf_task_storage_get"
            .to_string(),
    )
}

fn helper_probe(helper: BpfHelper) -> (Presence, String) {
    match is_helper_supported(ProgramType::KProbe, helper) {
        Ok(found) => (
            Presence::of(found),
            "loaded a kprobe program calling it".to_string(),
        ),
        Err(err) => (Presence::Unknown, format!("probe failed: {err}")),
    }
}

/// Whether any of `names` is a function of the running kernel (in
/// `/proc/kallsyms`, whose names are readable even when addresses are hidden).
fn symbol_probe(names: &[&str]) -> (Presence, String) {
    match std::fs::read_to_string(KALLSYMS) {
        Ok(text) => match kallsyms_has(&text, names) {
            Some(name) => (Presence::Found, format!("{name} in {KALLSYMS}")),
            None => (Presence::Missing, format!("no {} in {KALLSYMS}", names[0])),
        },
        Err(err) => (Presence::Unknown, format!("{KALLSYMS}: {err}")),
    }
}

/// The first of `names` that `/proc/kallsyms` text lists (`ADDR TYPE NAME [MODULE]`).
fn kallsyms_has<'a>(text: &str, names: &[&'a str]) -> Option<&'a str> {
    let listed: std::collections::HashSet<&str> = text
        .lines()
        .filter_map(|line| line.split_whitespace().nth(2))
        .collect();
    names.iter().copied().find(|name| listed.contains(name))
}

/// BPF instruction encoding, for the atomics probe.
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TYPE_SOCKET_FILTER: u32 = 1;

/// One eBPF instruction.
#[repr(C)]
#[derive(Clone, Copy)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: (src << 4) | (dst & 0x0f),
        off,
        imm,
    }
}

/// `*(u64 *)(r10 - 8) = 0; r1 = 1; r1 = atomic_fetch_add(*(u64 *)(r10 - 8), r1); r0 = 0; exit`:
/// a kernel without BPF atomics (before 5.12) refuses the fetch flag in the
/// immediate ("BPF_STX uses reserved fields").
const ATOMIC_FETCH_PROGRAM: [Insn; 6] = [
    insn(0xb7, 1, 0, 0, 0),   // BPF_ALU64|BPF_MOV|BPF_K: r1 = 0
    insn(0x7b, 10, 1, -8, 0), // BPF_STX|BPF_MEM|BPF_DW: *(u64 *)(r10 - 8) = r1
    insn(0xb7, 1, 0, 0, 1),   // r1 = 1
    insn(0xdb, 10, 1, -8, 1), // BPF_STX|BPF_ATOMIC|BPF_DW, imm BPF_ADD|BPF_FETCH
    insn(0xb7, 0, 0, 0, 0),   // r0 = 0
    insn(0x95, 0, 0, 0, 0),   // BPF_JMP|BPF_EXIT
];

/// `r6 = r1; call sub; r1 = r6; r2 = PROG_ARRAY; r3 = 0; tail_call; r0 = 0;
/// exit; sub: r0 = 0; exit`, with the prog array's fd put in at index 3: a
/// kernel whose JIT cannot keep the tail-call count across BPF-to-BPF
/// calls (arm64 before 6.0) refuses it ("tail_calls are not allowed in
/// programs with bpf-to-bpf calls"). The full object's programs are such
/// programs (a global walk function and the private-stack guard's tail call).
const TAIL_CALL_WITH_CALL_PROGRAM: [Insn; 11] = [
    insn(0xbf, 6, 1, 0, 0),  // BPF_ALU64|BPF_MOV|BPF_X: r6 = r1
    insn(0x85, 0, 1, 0, 7),  // BPF_JMP|BPF_CALL, BPF_PSEUDO_CALL: call insn 9
    insn(0xbf, 1, 6, 0, 0),  // r1 = r6
    insn(0x18, 2, 1, 0, 0),  // BPF_LD|BPF_IMM|BPF_DW, BPF_PSEUDO_MAP_FD: r2 = map (fd set later)
    insn(0x00, 0, 0, 0, 0),  // (its upper half)
    insn(0xb7, 3, 0, 0, 0),  // r3 = 0
    insn(0x85, 0, 0, 0, 12), // call bpf_tail_call
    insn(0xb7, 0, 0, 0, 0),  // r0 = 0
    insn(0x95, 0, 0, 0, 0),  // exit
    insn(0xb7, 0, 0, 0, 0),  // sub: r0 = 0
    insn(0x95, 0, 0, 0, 0),  // exit
];

/// `BPF_MAP_CREATE` and `BPF_MAP_TYPE_PROG_ARRAY`.
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_TYPE_PROG_ARRAY: u32 = 3;

/// The head of `union bpf_attr` for BPF_MAP_CREATE.
#[repr(C)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
}

/// A one-slot program array, for the tail-call probe.
fn prog_array() -> std::io::Result<OwnedFd> {
    let attr = MapCreateAttr {
        map_type: BPF_MAP_TYPE_PROG_ARRAY,
        key_size: 4,
        value_size: 4,
        max_entries: 1,
        map_flags: 0,
    };
    // SAFETY: `attr` is a valid BPF_MAP_CREATE attribute of the size passed.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_CREATE,
            &attr as *const MapCreateAttr,
            std::mem::size_of::<MapCreateAttr>(),
        )
    };
    let fd = i32::try_from(fd).unwrap_or(-1);
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the bpf syscall returned a new file descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn tail_calls_with_calls_probe() -> (Presence, String) {
    let map = match prog_array() {
        Ok(map) => map,
        Err(err) => {
            return (
                Presence::Unknown,
                format!("cannot create a program array: {err}"),
            )
        }
    };
    let mut program = TAIL_CALL_WITH_CALL_PROGRAM;
    program[3].imm = std::os::fd::AsRawFd::as_raw_fd(&map);
    program_probe(&program, "a program with a BPF-to-BPF call and a tail call")
}

/// The head of `union bpf_attr` for BPF_PROG_LOAD (the kernel takes a
/// shorter attr than its own and zero-fills the rest).
#[repr(C)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
}

/// Loads `insns` as a socket filter; the verifier's log on failure.
fn load_raw(insns: &[Insn]) -> Result<(), (i32, String)> {
    let license = c"GPL";
    let mut log = vec![0u8; 4096];
    let attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_SOCKET_FILTER,
        insn_cnt: u32::try_from(insns.len()).unwrap_or(u32::MAX),
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: u32::try_from(log.len()).unwrap_or(0),
        log_buf: log.as_mut_ptr() as u64,
        kern_version: 0,
        prog_flags: 0,
    };
    // SAFETY: `attr` is a valid BPF_PROG_LOAD attribute of the size passed;
    // the instruction, license and log buffers it points to outlive the call,
    // and the log buffer is writable for `log_size` bytes.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_LOAD,
            &attr as *const ProgLoadAttr,
            std::mem::size_of::<ProgLoadAttr>(),
        )
    };
    if fd >= 0 {
        let fd = i32::try_from(fd).unwrap_or(-1);
        if fd >= 0 {
            // SAFETY: the bpf syscall returned a new file descriptor we own.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
        return Ok(());
    }
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    Err((errno, String::from_utf8_lossy(&log[..end]).into_owned()))
}

fn atomics_probe() -> (Presence, String) {
    program_probe(
        &ATOMIC_FETCH_PROGRAM,
        "a program using BPF_ATOMIC|BPF_FETCH",
    )
}

/// Whether the kernel loads `insns` (`what` it is, for the detail): a
/// refusal for want of privilege tells nothing.
fn program_probe(insns: &[Insn], what: &str) -> (Presence, String) {
    match load_raw(insns) {
        Ok(()) => (Presence::Found, format!("loaded {what}")),
        Err((errno, log)) if errno == libc::EPERM => (
            Presence::Unknown,
            format!("probe refused (EPERM){}", last_line(&log)),
        ),
        Err((errno, log)) => (
            Presence::Missing,
            format!("{what} was refused (errno {errno}){}", last_line(&log)),
        ),
    }
}

fn last_line(log: &str) -> String {
    log.lines()
        .rev()
        .find(|line| !line.trim().is_empty() && !line.starts_with("processed "))
        .map(|line| format!(": {}", line.trim()))
        .unwrap_or_default()
}

/// `uname -r` and the machine.
fn uname() -> (String, String) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".to_string());
    (release, std::env::consts::ARCH.to_string())
}

/// Capability numbers (linux/capability.h).
pub const CAP_SYS_PTRACE: u32 = 19;
pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_PERFMON: u32 = 38;
pub const CAP_BPF: u32 = 39;

/// The effective capability set from `/proc/self/status` text.
pub fn parse_cap_eff(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
}

/// The active lockdown mode from `/sys/kernel/security/lockdown`
/// (`none [integrity] confidentiality`: the bracketed one).
pub fn parse_lockdown(text: &str) -> Option<String> {
    let start = text.find('[')?;
    let end = text[start..].find(']')? + start;
    Some(text[start + 1..end].trim().to_string()).filter(|mode| !mode.is_empty())
}

/// What this process may do.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct Privileges {
    /// This process's effective user id (0: root).
    pub euid: u32,
    /// The effective capability set, hex as in `/proc/self/status`.
    pub cap_eff: String,
    /// Whether the effective set holds CAP_BPF (loading BPF programs and
    /// maps).
    pub cap_bpf: bool,
    /// Whether the effective set holds CAP_PERFMON (perf events, uprobes).
    pub cap_perfmon: bool,
    /// Whether the effective set holds CAP_SYS_PTRACE (reading a process
    /// memtrace did not start).
    pub cap_sys_ptrace: bool,
    /// Whether the effective set holds CAP_SYS_ADMIN.
    pub cap_sys_admin: bool,
    /// `kernel.perf_event_paranoid` (`None`: unreadable).
    pub perf_event_paranoid: Option<i64>,
    /// `kernel.unprivileged_bpf_disabled`.
    pub unprivileged_bpf_disabled: Option<i64>,
    /// The active lockdown mode (`none`, `integrity`, `confidentiality`);
    /// `None` without the lockdown LSM or securityfs.
    pub lockdown: Option<String>,
    /// Root, CAP_SYS_ADMIN, or CAP_BPF and CAP_PERFMON: enough to load the
    /// programs (to attach them, CAP_SYS_ADMIN too where
    /// `uprobes_need_sys_admin`).
    pub can_trace: bool,
    /// Whether this kernel lets only CAP_SYS_ADMIN create uprobes (Linux
    /// 6.16, and the 5.15/6.1/6.6/6.12 stable kernels that took the change
    /// in 2025); probed on this kernel, null when unknown.
    pub uprobes_need_sys_admin: Option<bool>,
}

impl Privileges {
    /// Builds the facts from their raw sources (pure).
    pub fn from_parts(
        euid: u32,
        cap_eff: u64,
        paranoid: Option<i64>,
        unprivileged_bpf: Option<i64>,
        lockdown: Option<String>,
    ) -> Self {
        let has = |cap: u32| cap_eff & (1u64 << cap) != 0;
        let cap_bpf = has(CAP_BPF);
        let cap_perfmon = has(CAP_PERFMON);
        let cap_sys_admin = has(CAP_SYS_ADMIN);
        Privileges {
            euid,
            cap_eff: format!("{cap_eff:016x}"),
            cap_bpf,
            cap_perfmon,
            cap_sys_ptrace: has(CAP_SYS_PTRACE),
            cap_sys_admin,
            perf_event_paranoid: paranoid,
            unprivileged_bpf_disabled: unprivileged_bpf,
            lockdown,
            can_trace: euid == 0 || cap_sys_admin || (cap_bpf && cap_perfmon),
            uprobes_need_sys_admin: None,
        }
    }

    /// With the kernel's uprobe rule (see [`Privileges::uprobes_need_sys_admin`]):
    /// where only CAP_SYS_ADMIN may create uprobes, a process without it
    /// loads the programs but cannot attach them ([`Privileges::blocker`]).
    pub fn with_uprobe_rule(mut self, need: Option<bool>) -> Self {
        self.uprobes_need_sys_admin = need;
        self
    }

    /// What this kernel asks of uprobes, in one line for `memtrace doctor`.
    pub fn uprobe_line(&self) -> String {
        let have = if self.cap_sys_admin {
            "this process has it"
        } else {
            "this process lacks it"
        };
        match self.uprobes_need_sys_admin {
            Some(true) => format!(
                "uprobes     CAP_SYS_ADMIN needed: this kernel lets only CAP_SYS_ADMIN create uprobes (Linux 6.16+ and stable kernels with the 2025 backport); {have}"
            ),
            Some(false) => "uprobes     CAP_PERFMON is enough: this kernel lets CAP_PERFMON create uprobes (before Linux 6.16)".to_string(),
            None => format!(
                "uprobes     CAP_SYS_ADMIN may be needed: Linux 6.16+ (and stable kernels with the 2025 backport) let only CAP_SYS_ADMIN create uprobes; this kernel's rule could not be probed; {have}"
            ),
        }
    }

    /// Reads them for this process.
    pub fn read() -> Self {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let sysctl = |name: &str| {
            std::fs::read_to_string(format!("/proc/sys/kernel/{name}"))
                .ok()
                .and_then(|text| text.trim().parse().ok())
        };
        let lockdown = std::fs::read_to_string(LOCKDOWN_PATH)
            .ok()
            .and_then(|text| parse_lockdown(&text));
        Privileges::from_parts(
            euid,
            parse_cap_eff(&status).unwrap_or(0),
            sysctl("perf_event_paranoid"),
            sysctl("unprivileged_bpf_disabled"),
            lockdown,
        )
    }

    /// What keeps this process from tracing, if anything.
    pub fn blocker(&self) -> Option<String> {
        let admin = self.uprobes_need_sys_admin == Some(true) && !self.cap_sys_admin;
        if !self.can_trace || admin {
            let mut missing: Vec<&str> =
                [(self.cap_bpf, "CAP_BPF"), (self.cap_perfmon, "CAP_PERFMON")]
                    .iter()
                    .filter(|(has, _)| !has)
                    .map(|(_, name)| *name)
                    .collect();
            if admin {
                missing.push("CAP_SYS_ADMIN");
            }
            let uprobes = match self.uprobes_need_sys_admin {
                Some(true) => "CAP_SYS_ADMIN to create uprobes (this kernel lets only it: Linux 6.16+ and stable kernels with the 2025 backport)",
                Some(false) => "no CAP_SYS_ADMIN (this kernel lets CAP_PERFMON create uprobes)",
                None => "CAP_SYS_ADMIN too on Linux 6.16+ (and stable kernels with the 2025 backport), where only it may create uprobes",
            };
            return Some(format!(
                "missing {}: memtrace needs CAP_BPF, CAP_PERFMON, {uprobes}, and CAP_SYS_PTRACE to trace processes it did not start; or run it as root",
                missing.join(", ")
            ));
        }
        if self.lockdown.as_deref() == Some("confidentiality") {
            return Some(
                "kernel lockdown is 'confidentiality': BPF reads of user memory are refused"
                    .to_string(),
            );
        }
        None
    }
}

/// What a user can ask memtrace to do, each with its own needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The default: stacks unwound in the kernel from DWARF CFI.
    Dwarf,
    /// `--stacks fp`.
    FramePointers,
    /// `--stack-depth 0`.
    NoStacks,
    /// The kernel settles short-lived heap blocks (default; `--no-settle` off).
    Settling,
    /// Python frames (`--allocators python` on a CPython process).
    PythonFrames,
    /// `--follow-forks`.
    FollowForks,
}

impl Mode {
    pub const ALL: [Mode; 6] = [
        Mode::Dwarf,
        Mode::FramePointers,
        Mode::NoStacks,
        Mode::Settling,
        Mode::PythonFrames,
        Mode::FollowForks,
    ];

    /// The stable key (JSON `modes[].mode`).
    pub fn key(self) -> &'static str {
        match self {
            Mode::Dwarf => "default",
            Mode::FramePointers => "stacks_fp",
            Mode::NoStacks => "stack_depth_0",
            Mode::Settling => "settling",
            Mode::PythonFrames => "python_frames",
            Mode::FollowForks => "follow_forks",
        }
    }

    /// How a user asks for it.
    pub fn flags(self) -> &'static str {
        match self {
            Mode::Dwarf => "(default, --stacks dwarf)",
            Mode::FramePointers => "--stacks fp",
            Mode::NoStacks => "--stack-depth 0",
            Mode::Settling => "(default; --no-settle turns it off)",
            Mode::PythonFrames => "--allocators python",
            Mode::FollowForks => "--follow-forks",
        }
    }

    /// The features it cannot do without. Every build of the programs
    /// (`kernel::variant`) walks DWARF stacks and reads Python frames (with
    /// `bpf_loop`, or across tail calls without it); settling heap pairs in
    /// the kernel needs compare-and-swap and the attach cookies of the
    /// objects that have it (full, tailcall).
    pub fn needs(self) -> &'static [Feature] {
        const BASE: &[Feature] = &[Feature::UprobePmu, Feature::RingBuffer, Feature::GlobalData];
        const SETTLE: &[Feature] = &[
            Feature::UprobePmu,
            Feature::RingBuffer,
            Feature::GlobalData,
            Feature::AtomicsFetch,
            Feature::AttachCookie,
        ];
        const PYTHON: &[Feature] = &[
            Feature::UprobePmu,
            Feature::RingBuffer,
            Feature::GlobalData,
            Feature::Btf,
        ];
        const FORKS: &[Feature] = &[
            Feature::UprobePmu,
            Feature::RingBuffer,
            Feature::GlobalData,
            Feature::RawTracepoint,
        ];
        match self {
            Mode::Settling => SETTLE,
            Mode::Dwarf | Mode::FramePointers | Mode::NoStacks => BASE,
            Mode::PythonFrames => PYTHON,
            Mode::FollowForks => FORKS,
        }
    }

    /// The features it needs that `presence` says are missing (unknown ones
    /// are not counted against it).
    pub fn missing(self, presence: impl Fn(Feature) -> Presence) -> Vec<Feature> {
        self.needs()
            .iter()
            .copied()
            .filter(|&feature| presence(feature) == Presence::Missing)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn releases_parse_to_their_numeric_head() {
        let v = |major, minor, patch| KernelVersion {
            major,
            minor,
            patch,
        };
        assert_eq!(parse_release("6.18.44-fc-v1045"), Some(v(6, 18, 44)));
        assert_eq!(parse_release("5.10.0-30-cloud-amd64"), Some(v(5, 10, 0)));
        assert_eq!(parse_release("7.2-rc1\n"), Some(v(7, 2, 0)));
        assert_eq!(parse_release("6.1"), Some(v(6, 1, 0)));
        assert_eq!(parse_release("6.12.117+deb13-amd64"), Some(v(6, 12, 117)));
        assert_eq!(parse_release("linux"), None);
        assert_eq!(parse_release("6"), None);
        assert!(v(5, 10, 0) < v(5, 12, 0));
    }

    #[test]
    fn cap_eff_is_read_as_hex() {
        let status = "Name:\tcat\nCapInh:\t0000000000000000\nCapPrm:\t000001ffffffffff\nCapEff:\t000001ffffffffff\n";
        assert_eq!(parse_cap_eff(status), Some(0x1ff_ffff_ffff));
        let privileges = Privileges::from_parts(1000, 0x1ff_ffff_ffff, Some(2), Some(2), None);
        assert!(privileges.cap_bpf && privileges.cap_perfmon && privileges.cap_sys_admin);
        assert!(privileges.can_trace);
        assert_eq!(privileges.cap_eff, "000001ffffffffff");
        assert_eq!(parse_cap_eff("Name:\tx\n"), None);
        assert_eq!(parse_cap_eff("CapEff:\tzz\n"), None);
    }

    #[test]
    fn bpf_and_perfmon_without_root_can_trace() {
        let caps = (1u64 << CAP_BPF) | (1u64 << CAP_PERFMON);
        let privileges = Privileges::from_parts(1000, caps, Some(2), Some(2), None);
        assert!(privileges.can_trace && !privileges.cap_sys_ptrace);
        assert_eq!(privileges.blocker(), None);
        let only_bpf = Privileges::from_parts(1000, 1u64 << CAP_BPF, None, None, None);
        assert!(!only_bpf.can_trace);
        assert!(only_bpf
            .blocker()
            .is_some_and(|b| b.contains("CAP_PERFMON")));
        let root = Privileges::from_parts(0, 0, None, None, None);
        assert!(root.can_trace);
    }

    #[test]
    fn where_only_cap_sys_admin_creates_uprobes_doctor_says_so() {
        let caps = (1u64 << CAP_BPF) | (1u64 << CAP_PERFMON) | (1u64 << CAP_SYS_PTRACE);
        let old = Privileges::from_parts(1000, caps, Some(2), Some(2), None)
            .with_uprobe_rule(Some(false));
        assert!(old.can_trace);
        assert_eq!(old.blocker(), None);
        assert!(
            old.uprobe_line().contains("CAP_PERFMON is enough"),
            "{}",
            old.uprobe_line()
        );
        let new =
            Privileges::from_parts(1000, caps, Some(2), Some(2), None).with_uprobe_rule(Some(true));
        // It loads the programs, but cannot attach them.
        assert!(new.can_trace);
        let blocker = new.blocker().expect("blocked");
        assert!(blocker.starts_with("missing CAP_SYS_ADMIN: "), "{blocker}");
        assert!(blocker.contains("6.16"), "{blocker}");
        assert!(
            new.uprobe_line().contains("CAP_SYS_ADMIN needed"),
            "{}",
            new.uprobe_line()
        );
        assert!(new.uprobe_line().ends_with("this process lacks it"));
        // With CAP_SYS_ADMIN the same kernel is fine, and still named.
        let admin = Privileges::from_parts(1000, caps | (1u64 << CAP_SYS_ADMIN), None, None, None)
            .with_uprobe_rule(Some(true));
        assert!(admin.can_trace && admin.blocker().is_none());
        assert!(admin.uprobe_line().ends_with("this process has it"));
        // Unknown: the 6.16 rule is still named.
        let unknown = Privileges::from_parts(1000, 1u64 << CAP_BPF, None, None, None);
        let blocker = unknown.blocker().expect("blocked");
        assert!(blocker.starts_with("missing CAP_PERFMON: "), "{blocker}");
        assert!(
            blocker.contains("CAP_SYS_ADMIN too on Linux 6.16+"),
            "{blocker}"
        );
        assert!(unknown.uprobe_line().contains("may be needed"));
    }

    #[test]
    fn lockdown_takes_the_bracketed_mode() {
        assert_eq!(
            parse_lockdown("[none] integrity confidentiality\n").as_deref(),
            Some("none")
        );
        assert_eq!(
            parse_lockdown("none integrity [confidentiality]").as_deref(),
            Some("confidentiality")
        );
        assert_eq!(parse_lockdown("none integrity"), None);
        assert_eq!(parse_lockdown("[]"), None);
        let locked = Privileges::from_parts(0, 0, None, None, Some("confidentiality".into()));
        assert!(locked.blocker().is_some_and(|b| b.contains("lockdown")));
    }

    #[test]
    fn kallsyms_lines_are_matched_by_name() {
        let text = "ffffffff8133e0a0 T __x64_sys_uretprobe\nffffffff814cfe90 T bpf_uprobe_multi_link_attach\n0000000000000000 t foo\t[mod]\n";
        assert_eq!(
            kallsyms_has(text, &["__x64_sys_uretprobe"]),
            Some("__x64_sys_uretprobe")
        );
        assert_eq!(kallsyms_has(text, &["sys_uretprobe"]), None);
        assert_eq!(kallsyms_has(text, &["nope", "foo"]), Some("foo"));
        assert_eq!(
            kallsyms_has(
                text,
                &["bpf_uprobe_multi_link_attach", "__x64_sys_uretprobe"]
            ),
            Some("bpf_uprobe_multi_link_attach")
        );
    }

    #[test]
    fn mode_table_follows_the_features() {
        // A 5.10 kernel: no atomics with fetch, no bpf_loop, no cookies. The
        // compat object serves every mode but settling.
        let old = |feature: Feature| match feature {
            Feature::AtomicsFetch
            | Feature::BpfLoop
            | Feature::AttachCookie
            | Feature::UprobeMulti => Presence::Missing,
            _ => Presence::Found,
        };
        assert_eq!(
            Mode::Settling.missing(old),
            [Feature::AtomicsFetch, Feature::AttachCookie]
        );
        for mode in Mode::ALL.into_iter().filter(|&m| m != Mode::Settling) {
            assert!(mode.missing(old).is_empty(), "{mode:?}");
        }
        // 5.15: only bpf_loop missing: the tailcall object settles too.
        let ubuntu_22_04 = |feature: Feature| match feature {
            Feature::BpfLoop | Feature::UprobeMulti => Presence::Missing,
            _ => Presence::Found,
        };
        for mode in Mode::ALL {
            assert_eq!(mode.missing(ubuntu_22_04), Vec::new(), "{mode:?}");
        }
        // 6.1: everything memtrace needs.
        let modern = |feature: Feature| match feature {
            Feature::UprobeMulti | Feature::UretprobeSyscall => Presence::Missing,
            _ => Presence::Found,
        };
        for mode in Mode::ALL {
            assert_eq!(mode.missing(modern), Vec::new(), "{mode:?}");
        }
        // Python frames need BTF; follow-forks a raw tracepoint.
        let no_btf = |feature: Feature| Presence::of(feature != Feature::Btf);
        assert_eq!(Mode::PythonFrames.missing(no_btf), vec![Feature::Btf]);
        assert!(Mode::Dwarf.missing(no_btf).is_empty());
        let no_tp = |feature: Feature| Presence::of(feature != Feature::RawTracepoint);
        assert_eq!(
            Mode::FollowForks.missing(no_tp),
            vec![Feature::RawTracepoint]
        );
        // Unknown is not held against a mode.
        assert!(Mode::Dwarf.missing(|_| Presence::Unknown).is_empty());
    }

    #[test]
    fn keys_are_unique() {
        let mut keys: Vec<_> = Feature::ALL.iter().map(|f| f.key()).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), Feature::ALL.len());
        let mut modes: Vec<_> = Mode::ALL.iter().map(|m| m.key()).collect();
        modes.dedup();
        assert_eq!(modes.len(), Mode::ALL.len());
    }
}
