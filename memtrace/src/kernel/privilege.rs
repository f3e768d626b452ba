//! The capabilities memtrace needs, checked before anything is loaded, so a
//! missing one is named in one line instead of surfacing as an `EPERM` deep
//! in a load or an attach.
//!
//! What each one is for (and why no other is asked for):
//!
//! - `CAP_BPF`: `bpf(2)`: maps, program loads, the raw tracepoint.
//! - `CAP_PERFMON`: tracing programs (`bpf_probe_read_user`, stack walks)
//!   and the per-CPU perf events.
//!
//!   `CAP_SYS_ADMIN` stands for both on every kernel (`bpf_capable()`,
//!   `perfmon_capable()`): Docker 20.10 (Debian 12's `docker.io`) cannot
//!   grant `CAP_BPF` or `CAP_PERFMON` by name, so `--cap-add SYS_ADMIN
//!   --cap-add SYS_PTRACE` is how a container of it gets to trace.
//! - `CAP_SYS_PTRACE`: another user's `/proc/PID/{maps,mem,root,exe}`
//!   (ptrace access checks); launch mode traces its own child without it.
//! - `CAP_SYS_ADMIN`: creating a uprobe through the `uprobe` PMU
//!   (`perf_event_open`). Linux 5.8 allowed it with `CAP_PERFMON`; upstream
//!   commit ba677dbe77af ("perf: Revert to requiring CAP_SYS_ADMIN for
//!   uprobes", 6.16, backported to the 5.15, 6.1, 6.6 and 6.12 stable series
//!   in 2025) requires `CAP_SYS_ADMIN` again. Which rule the running kernel
//!   applies is probed ([`uprobe_needs_sys_admin`]), never guessed from its
//!   version. With it, `/proc/PID/map_files` (container files on overlayfs)
//!   is readable too.
//!
//! Not needed: `CAP_SYS_RESOURCE` (BPF memory is charged to the memory
//! cgroup since 5.11; on older kernels raise `RLIMIT_MEMLOCK` instead),
//! `CAP_DAC_READ_SEARCH` (only for a target whose files its own user may not
//! read), `CAP_CHECKPOINT_RESTORE` (covered by `CAP_SYS_ADMIN`).

use crate::error::Failure;
use crate::kernel::features::{parse_cap_eff, CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN, CAP_SYS_PTRACE};

/// When memtrace needs a capability.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    /// Always.
    Always,
    /// To look at processes it did not start (`--pid`, `--name`,
    /// `--container`, `--cgroup`).
    Attaching,
    /// Where the kernel lets only `CAP_SYS_ADMIN` create uprobes.
    UprobesNeedAdmin,
}

/// One capability memtrace asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Need {
    /// Its number (linux/capability.h).
    pub number: u32,
    /// Its name as the kernel and the tools spell it (`CAP_BPF`).
    pub name: &'static str,
    pub when: When,
}

/// Every capability memtrace may need: the privilege check's set, and the
/// one `deploy/kubernetes/daemonset.yaml` adds (a unit test keeps them equal).
pub const CAPABILITIES: &[Need] = &[
    Need {
        number: CAP_BPF,
        name: "CAP_BPF",
        when: When::Always,
    },
    Need {
        number: CAP_PERFMON,
        name: "CAP_PERFMON",
        when: When::Always,
    },
    Need {
        number: CAP_SYS_PTRACE,
        name: "CAP_SYS_PTRACE",
        when: When::Attaching,
    },
    Need {
        number: CAP_SYS_ADMIN,
        name: "CAP_SYS_ADMIN",
        when: When::UprobesNeedAdmin,
    },
];

/// Facts the check is made from.
#[derive(Clone, Copy, Debug)]
pub struct Facts {
    /// The effective set (`CapEff`).
    pub cap_eff: u64,
    /// The highest capability this kernel knows (`cap_last_cap`): kernels
    /// before 5.8 know no `CAP_BPF`/`CAP_PERFMON`, and root's set lacks them.
    pub cap_last_cap: Option<u32>,
    /// Whether the kernel lets only `CAP_SYS_ADMIN` create uprobes (`None`:
    /// not probed or unknown).
    pub uprobes_need_admin: Option<bool>,
    /// Whether memtrace looks at processes it did not start.
    pub attaching: bool,
}

/// The capabilities missing from `facts` (pure).
pub fn missing(facts: &Facts) -> Vec<&'static Need> {
    let has = |cap: u32| facts.cap_eff & (1u64 << cap) != 0;
    CAPABILITIES
        .iter()
        .filter(|need| match need.when {
            When::Always => true,
            When::Attaching => facts.attaching,
            When::UprobesNeedAdmin => facts.uprobes_need_admin == Some(true),
        })
        .filter(|need| {
            // CAP_SYS_ADMIN stands for CAP_BPF and CAP_PERFMON (the kernel's
            // bpf_capable(), perfmon_capable()), and for any capability a
            // kernel does not know (before 5.8: neither).
            let unknown = facts.cap_last_cap.is_some_and(|last| need.number > last);
            let admin_stands_in = unknown || [CAP_BPF, CAP_PERFMON].contains(&need.number);
            let held = has(need.number) || (admin_stands_in && has(CAP_SYS_ADMIN));
            !held
        })
        .collect()
}

/// The one line naming what is missing.
pub fn refusal(missing: &[&Need], uprobes_need_admin: Option<bool>, attaching: bool) -> String {
    let names: Vec<&str> = missing.iter().map(|need| need.name).collect();
    let mut needed = vec!["CAP_BPF", "CAP_PERFMON"];
    if attaching {
        needed.push("CAP_SYS_PTRACE");
    }
    if uprobes_need_admin == Some(true) {
        needed.push("CAP_SYS_ADMIN (this kernel lets only it create uprobes)");
    }
    format!(
        "permission denied: missing {} (memtrace needs {}; or run it as root)",
        names.join(", "),
        needed.join(", ")
    )
}

/// Checks this process's capabilities (`attaching`: it traces processes it
/// did not start); a missing one is an [`crate::error::EXIT_PERMISSION`]
/// failure naming it.
pub fn check(attaching: bool) -> Result<(), Failure> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let cap_eff = parse_cap_eff(&status).unwrap_or(0);
    let cap_last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|text| text.trim().parse().ok());
    let mut facts = Facts {
        cap_eff,
        cap_last_cap,
        uprobes_need_admin: None,
        attaching,
    };
    // The probe means something only where perf itself lets this process in.
    let has = |cap: u32| cap_eff & (1u64 << cap) != 0;
    if !has(CAP_SYS_ADMIN) && has(CAP_PERFMON) {
        facts.uprobes_need_admin = uprobe_needs_sys_admin();
    }
    let missing = missing(&facts);
    if missing.is_empty() {
        return Ok(());
    }
    Err(Failure::permission(refusal(
        &missing,
        facts.uprobes_need_admin,
        attaching,
    )))
}

/// Whether this kernel lets only `CAP_SYS_ADMIN` create uprobes, asked also
/// where this process holds it (root, for `memtrace doctor`): the probe runs
/// on a thread of its own that first drops `CAP_SYS_ADMIN` from its
/// effective set (capabilities are per thread; the thread ends with it).
/// `None` when that cannot be asked (no `CAP_PERFMON`, no uprobe PMU).
pub fn uprobe_rule() -> Option<bool> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let cap_eff = parse_cap_eff(&status).unwrap_or(0);
    if cap_eff & (1u64 << CAP_PERFMON) == 0 {
        return None;
    }
    if cap_eff & (1u64 << CAP_SYS_ADMIN) == 0 {
        return uprobe_needs_sys_admin();
    }
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                drop_effective(CAP_SYS_ADMIN).ok()?;
                uprobe_needs_sys_admin()
            })
            .join()
            .ok()
            .flatten()
    })
}

/// Drops capability `cap` from the calling thread's effective set.
fn drop_effective(cap: u32) -> std::io::Result<()> {
    /// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
    const VERSION_3: u32 = 0x2008_0522;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget with a version 3 header and room for its two data
    // words, both alive for the call; pid 0 is the calling thread.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let word = (cap / 32) as usize;
    let Some(slot) = data.get_mut(word) else {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    };
    slot.effective &= !(1u32 << (cap % 32));
    // SAFETY: capset of the calling thread with the sets capget gave, less
    // one effective bit (always allowed); the pointers live for the call.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether this kernel refuses a uprobe PMU event to this process for want of
/// `CAP_SYS_ADMIN`: a `perf_event_open` of the `uprobe` PMU with no path
/// fails with `EACCES` at the capability check, which comes first, or with
/// `EINVAL` (no path) past it; nothing is created either way. `None` when the
/// kernel has no uprobe PMU or answers otherwise.
pub fn uprobe_needs_sys_admin() -> Option<bool> {
    let pmu: u32 = std::fs::read_to_string("/sys/bus/event_source/devices/uprobe/type")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    // perf_event_attr, PERF_ATTR_SIZE_VER0 (64 bytes): type, size, config,
    // sample_period, sample_type, read_format, flags, config1 (the path).
    let mut attr = [0u64; 8];
    attr[0] = u64::from(pmu) | (64u64 << 32);
    // exclude_kernel (bit 5) and exclude_hv (bit 6): no kernel-profiling check.
    attr[5] = (1 << 5) | (1 << 6);
    // SAFETY: `attr` is a zero-initialised perf_event_attr of the size it
    // declares, alive for the call; pid 0, cpu -1, group -1 are valid
    // arguments and a returned descriptor is closed at once.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            attr.as_ptr(),
            0 as libc::pid_t,
            -1 as libc::c_int,
            -1 as libc::c_int,
            libc::c_ulong::from(0x8u32), // PERF_FLAG_FD_CLOEXEC
        )
    };
    if fd >= 0 {
        // SAFETY: `fd` was just returned to this process and is closed once.
        unsafe { libc::close(fd as libc::c_int) };
        return Some(false);
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::EACCES) | Some(libc::EPERM) => Some(true),
        Some(libc::EINVAL) => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(list: &[u32]) -> u64 {
        list.iter().fold(0, |set, cap| set | (1u64 << cap))
    }

    fn names(facts: &Facts) -> Vec<&'static str> {
        missing(facts).iter().map(|need| need.name).collect()
    }

    #[test]
    fn each_missing_capability_is_named() {
        let three = caps(&[CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE]);
        let mut facts = Facts {
            cap_eff: three,
            cap_last_cap: Some(40),
            uprobes_need_admin: Some(false),
            attaching: true,
        };
        assert!(names(&facts).is_empty());
        facts.uprobes_need_admin = Some(true);
        assert_eq!(names(&facts), ["CAP_SYS_ADMIN"]);
        facts.cap_eff = three & !(1u64 << CAP_BPF);
        assert_eq!(names(&facts), ["CAP_BPF", "CAP_SYS_ADMIN"]);
        // Launch mode traces its own child: no CAP_SYS_PTRACE needed.
        facts.cap_eff = caps(&[CAP_BPF, CAP_PERFMON]);
        facts.uprobes_need_admin = Some(false);
        facts.attaching = false;
        assert!(names(&facts).is_empty());
        facts.attaching = true;
        assert_eq!(names(&facts), ["CAP_SYS_PTRACE"]);
        // Nothing at all.
        facts.cap_eff = 0;
        facts.uprobes_need_admin = None;
        assert_eq!(names(&facts), ["CAP_BPF", "CAP_PERFMON", "CAP_SYS_PTRACE"]);
        // Full root.
        facts.cap_eff = (1u64 << 41) - 1;
        facts.uprobes_need_admin = Some(true);
        assert!(names(&facts).is_empty());
    }

    #[test]
    fn cap_sys_admin_stands_for_cap_bpf_and_cap_perfmon() {
        // What Docker 20.10 can grant (it knows neither CAP_BPF nor
        // CAP_PERFMON by name): the kernel's bpf_capable() and
        // perfmon_capable() accept CAP_SYS_ADMIN.
        let mut facts = Facts {
            cap_eff: caps(&[CAP_SYS_ADMIN, CAP_SYS_PTRACE]),
            cap_last_cap: Some(40),
            uprobes_need_admin: None,
            attaching: true,
        };
        assert!(names(&facts).is_empty());
        // Not for CAP_SYS_PTRACE.
        facts.cap_eff = caps(&[CAP_SYS_ADMIN]);
        assert_eq!(names(&facts), ["CAP_SYS_PTRACE"]);
    }

    #[test]
    fn kernels_without_cap_bpf_take_cap_sys_admin_for_it() {
        // Root on 5.4: CapEff 0000003fffffffff, no bit 38 or 39.
        let facts = Facts {
            cap_eff: (1u64 << 38) - 1,
            cap_last_cap: Some(37),
            uprobes_need_admin: None,
            attaching: true,
        };
        assert!(names(&facts).is_empty());
    }

    #[test]
    fn the_refusal_is_one_line_naming_the_missing_ones() {
        let facts = Facts {
            cap_eff: caps(&[CAP_PERFMON, CAP_SYS_PTRACE]),
            cap_last_cap: Some(40),
            uprobes_need_admin: Some(true),
            attaching: true,
        };
        let line = refusal(&missing(&facts), Some(true), true);
        assert!(
            line.starts_with("permission denied: missing CAP_BPF, CAP_SYS_ADMIN ("),
            "{line}"
        );
        assert!(line.contains("CAP_SYS_PTRACE"), "{line}");
        assert!(!line.contains('\n'));
    }

    #[test]
    fn the_probe_answers_without_side_effects() {
        // Whatever this machine says, asking twice gives the same answer.
        assert_eq!(uprobe_needs_sys_admin(), uprobe_needs_sys_admin());
        // Asking from a thread without CAP_SYS_ADMIN leaves this one's set.
        let before = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| parse_cap_eff(&s));
        assert_eq!(uprobe_rule(), uprobe_rule());
        let after = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| parse_cap_eff(&s));
        assert_eq!(before, after);
    }

    /// The capabilities `deploy/kubernetes/daemonset.yaml` adds: the items
    /// under `capabilities:` / `add:`, and what it drops.
    fn manifest_capabilities(text: &str) -> (Vec<String>, Vec<String>) {
        let (mut add, mut drop) = (Vec::new(), Vec::new());
        let mut list: Option<&mut Vec<String>> = None;
        let mut in_capabilities = false;
        for line in text.lines() {
            let trimmed = line.trim();
            if trimmed.starts_with('#') || trimmed.is_empty() {
                continue;
            }
            if trimmed == "capabilities:" {
                in_capabilities = true;
                continue;
            }
            if !in_capabilities {
                continue;
            }
            match trimmed {
                "add:" => list = Some(&mut add),
                "drop:" => list = Some(&mut drop),
                item if item.starts_with("- ") => {
                    if let Some(list) = list.as_mut() {
                        let value = item[2..].split('#').next().unwrap_or("").trim();
                        list.push(value.trim_matches('"').to_string());
                    }
                }
                _ => {
                    in_capabilities = false;
                    list = None;
                }
            }
        }
        (add, drop)
    }

    #[test]
    fn the_daemonset_adds_exactly_the_capabilities_checked_here() {
        let text = include_str!("../../../deploy/kubernetes/daemonset.yaml");
        let (mut add, drop) = manifest_capabilities(text);
        add.sort();
        let mut wanted: Vec<String> = CAPABILITIES
            .iter()
            .map(|need| need.name.trim_start_matches("CAP_").to_string())
            .collect();
        wanted.sort();
        assert_eq!(add, wanted, "securityContext.capabilities.add");
        assert_eq!(drop, ["ALL"], "securityContext.capabilities.drop");
        assert!(text.contains("hostPID: true"));
    }

    #[test]
    fn the_manifest_reader_reads_lists() {
        let text = "x:\n  capabilities:\n    add:\n      - BPF # bpf(2)\n      - \"PERFMON\"\n    drop:\n      - ALL\n  readOnlyRootFilesystem: true\n  - NOT_A_CAP\n";
        let (add, drop) = manifest_capabilities(text);
        assert_eq!(add, ["BPF", "PERFMON"]);
        assert_eq!(drop, ["ALL"]);
    }
}
