//! The leak check's snapshot: while every thread of the service is
//! stopped ([`super::stop`]), one of them runs a single `clone` system call
//! that memtrace injects (as debuggers and CRIU's compel run a system call
//! in a tracee: its registers pointed at a `syscall`/`svc` instruction of
//! its own libc, stepped with `PTRACE_SYSCALL`, then restored exactly).
//! The child is a copy-on-write image of the service's memory at the stop;
//! it is seized at birth (`PTRACE_O_TRACECLONE`) and never runs a single
//! instruction of the service's code; the service resumes at once and the
//! check scans the child while the service works. Then the child is
//! killed, and the service reaps it through one more injected system call
//! (`wait4`), so its process tree shows nothing.
//!
//! The clone: `CLONE_FILES` (the child shares the fd table: no socket,
//! lock or pipe gets another reference, and its death closes nothing) and
//! exit signal 0 (the service gets no `SIGCHLD`, and its `wait`,
//! `waitpid(-1)` and `waitid(P_ALL)` never see the child: only `__WALL` or
//! `__WCLONE` waits do). No atfork handler runs: it is the raw system call,
//! not glibc's `fork`. `PTRACE_O_EXITKILL` on the child kills it if
//! memtrace dies; the [`guard`](super::snapshot_guard) then has it reaped.
//!
//! [`preflight`] says, before the stop, whether a snapshot is safe and
//! complete: seccomp (suspended for the injected thread with
//! `PTRACE_O_SUSPEND_SECCOMP`, else no injection), `vm.overcommit_memory=2`
//! headroom, the memory and pids cgroups' headroom, and the ranges a child
//! would not see as the service does (`MADV_DONTFORK`, `MADV_WIPEONFORK`,
//! userfaultfd-registered, shared writable): those are copied from the
//! service during the stop, and past [`COPY_LIMIT`] the check stops the
//! service instead. Any failure of the clone itself falls back the same
//! way; the report says which.

use std::io::Write;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::maps::Mapping;
use super::stop::{detach, errno, event_message, seize, wait_stopped, StoppedThread, Waited};

/// Most bytes copied from the service during the stop (ranges the child
/// would not show as the service has them); past it the check stops the
/// service for the whole scan instead.
pub const COPY_LIMIT: u64 = 64 << 20;
/// The least a memory cgroup must have left for a snapshot: page tables of
/// the copy and the pages the service writes during the scan are charged
/// to it. Below it during the scan, the child is killed.
pub const CGROUP_MARGIN: u64 = 64 << 20;
/// Most pinned memory (`VmPin`: RDMA registrations, io_uring's fixed
/// buffers, drivers' pinned pages) a snapshot takes: the kernel copies a
/// pinned anonymous page into the child at the clone itself, during the
/// stop, and charges it.
pub const PINNED_LIMIT: u64 = 64 << 20;

const CLONE_FILES: u64 = 0x400;
const WNOHANG: u64 = 1;
const WALL: u64 = 0x4000_0000;
/// `PTRACE_O_SUSPEND_SECCOMP` (not in every libc crate version).
const PTRACE_O_SUSPEND_SECCOMP: i32 = 1 << 21;
const PTRACE_O_EXITKILL: i32 = 1 << 20;

#[cfg(target_arch = "x86_64")]
mod arch {
    pub const SYS_CLONE: u64 = 56;
    pub const SYS_WAIT4: u64 = 61;
    pub const SYS_RESTART: u64 = 219;
    /// Words of `user_regs_struct`.
    pub const WORDS: usize = 27;
    const RAX: usize = 10;
    const ORIG_RAX: usize = 15;
    const RIP: usize = 16;
    const ARGS: [usize; 6] = [14, 13, 12, 7, 9, 8];
    /// `syscall`.
    pub const INSTRUCTION: &[u8] = &[0x0f, 0x05];
    pub const ALIGN: usize = 1;

    /// Registers that run system call `nr` at `at` (the thread leaves its
    /// stop to user mode there; `orig_rax` -1 so no restart logic applies).
    pub fn call(saved: &[u64], at: u64, nr: u64, args: [u64; 6]) -> Vec<u64> {
        let mut regs = saved.to_vec();
        regs[RIP] = at;
        regs[RAX] = nr;
        regs[ORIG_RAX] = u64::MAX;
        for (k, value) in args.into_iter().enumerate() {
            regs[ARGS[k]] = value;
        }
        regs
    }

    pub fn result(regs: &[u64]) -> i64 {
        regs[RAX] as i64
    }

    pub fn pc(regs: &[u64]) -> u64 {
        regs[RIP]
    }

    /// The registers to give back: the saved ones, with a system call the
    /// stop interrupted set to run again, as the kernel would have on
    /// resuming from that stop (x86-64 decides it after the stop; the
    /// thread now resumes from a system-call stop, where it would not).
    pub fn restored(saved: &[u64]) -> Vec<u64> {
        let mut regs = saved.to_vec();
        if regs[ORIG_RAX] != u64::MAX {
            match regs[RAX] as i64 {
                // ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND.
                -514..=-512 => {
                    regs[RAX] = regs[ORIG_RAX];
                    regs[RIP] -= 2;
                }
                // ERESTART_RESTARTBLOCK.
                -516 => {
                    regs[RAX] = SYS_RESTART;
                    regs[RIP] -= 2;
                }
                _ => {}
            }
        }
        regs[ORIG_RAX] = u64::MAX;
        regs
    }
}

#[cfg(target_arch = "aarch64")]
mod arch {
    pub const SYS_CLONE: u64 = 220;
    pub const SYS_WAIT4: u64 = 260;
    /// Words of `user_pt_regs`.
    pub const WORDS: usize = 34;
    const X8: usize = 8;
    const PC: usize = 32;
    /// `svc #0`.
    pub const INSTRUCTION: &[u8] = &[0x01, 0x00, 0x00, 0xd4];
    pub const ALIGN: usize = 4;

    /// Registers that run system call `nr` at `at`.
    pub fn call(saved: &[u64], at: u64, nr: u64, args: [u64; 6]) -> Vec<u64> {
        let mut regs = saved.to_vec();
        regs[PC] = at;
        regs[X8] = nr;
        regs[..6].copy_from_slice(&args);
        regs
    }

    pub fn result(regs: &[u64]) -> i64 {
        regs[0] as i64
    }

    pub fn pc(regs: &[u64]) -> u64 {
        regs[PC]
    }

    /// The registers to give back: arm64 settles a restart before the stop,
    /// so the saved ones are what the thread resumes with.
    pub fn restored(saved: &[u64]) -> Vec<u64> {
        saved.to_vec()
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
mod arch {
    pub const SYS_CLONE: u64 = 0;
    pub const SYS_WAIT4: u64 = 0;
    pub const WORDS: usize = usize::MAX;
    pub const INSTRUCTION: &[u8] = &[];
    pub const ALIGN: usize = 1;
    pub fn call(saved: &[u64], _: u64, _: u64, _: [u64; 6]) -> Vec<u64> {
        saved.to_vec()
    }
    pub fn result(_: &[u64]) -> i64 {
        -1
    }
    pub fn pc(_: &[u64]) -> u64 {
        0
    }
    pub fn restored(saved: &[u64]) -> Vec<u64> {
        saved.to_vec()
    }
}

/// A range the child would not show as the service has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Flagged {
    pub start: u64,
    pub end: u64,
    /// Why: `dontfork`, `wipeonfork`, `userfaultfd` or `shared`.
    pub why: &'static str,
}

/// What [`preflight`] found: the snapshot may be taken.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// Ranges to copy from the service during the stop.
    pub flagged: Vec<Flagged>,
    /// The mappings' bounds when the flags were read: a stop that finds
    /// others reads the flags again.
    pub bounds: Vec<(u64, u64)>,
    /// The service runs under a seccomp filter: the injected thread's is
    /// suspended.
    pub suspend_seccomp: bool,
    /// How long the clone should take, from the anonymous memory and the
    /// host's measured fork cost ([`super::fork_cost`]); None when the cost
    /// could not be measured.
    pub clone_estimate: Option<std::time::Duration>,
}

/// The VmFlags of `/proc/PID/smaps` that make a range differ in a child,
/// with the mappings' bounds.
pub fn flagged_ranges(smaps: &str) -> (Vec<Flagged>, Vec<(u64, u64)>) {
    let mut flagged = Vec::new();
    let mut bounds = Vec::new();
    let mut current: Option<(u64, u64)> = None;
    for line in smaps.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            let Some((start, end)) = current else {
                continue;
            };
            let has = |f: &str| flags.split_whitespace().any(|x| x == f);
            let why = if has("dc") {
                Some("dontfork")
            } else if has("wf") {
                Some("wipeonfork")
            } else if has("um") || has("uw") || has("ui") {
                Some("userfaultfd")
            } else {
                None
            };
            if let Some(why) = why {
                flagged.push(Flagged { start, end, why });
            }
            continue;
        }
        // A mapping's header: `start-end perms offset dev inode path`.
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
        else {
            continue;
        };
        if perms.len() != 4 {
            continue;
        }
        current = Some((start, end));
        bounds.push((start, end));
    }
    (flagged, bounds)
}

/// `Seccomp:` of `/proc/PID/status` (0 none, 1 strict, 2 filter).
pub fn seccomp_mode(status: &str) -> u32 {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Seccomp:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A number of a `key: value kB` file (`/proc/meminfo`), in bytes.
/// Pinned bytes of a process (`VmPin:` of its status).
fn pinned_bytes(status: &str) -> u64 {
    meminfo_bytes(status, "VmPin").unwrap_or(0)
}

fn meminfo_bytes(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kib| kib * 1024)
}

/// Bytes a copy of the process is charged under strict overcommit: its
/// private writable mappings.
fn private_writable(mappings: &[Mapping]) -> u64 {
    mappings
        .iter()
        .filter(|m| m.writable && !m.shared)
        .map(|m| m.end - m.start)
        .sum()
}

/// The service's cgroup v2 directory (or v1's, per controller).
fn cgroup_dir(pid: u32, controller: &str) -> Option<std::path::PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        if controllers.is_empty() {
            let dir = std::path::Path::new("/sys/fs/cgroup").join(path);
            if dir.join(format!("{controller}.max")).exists() {
                return Some(dir);
            }
        } else if controllers.split(',').any(|c| c == controller) {
            return Some(
                std::path::Path::new("/sys/fs/cgroup")
                    .join(controller)
                    .join(path),
            );
        }
    }
    None
}

fn read_number(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Bytes the service's memory cgroup may still charge before its limit
/// (`None`: no limit).
pub fn memory_headroom(pid: u32) -> Option<u64> {
    let dir = cgroup_dir(pid, "memory")?;
    let (max, current) = if dir.join("memory.max").exists() {
        (
            read_number(&dir.join("memory.max"))?,
            read_number(&dir.join("memory.current"))?,
        )
    } else {
        let max = read_number(&dir.join("memory.limit_in_bytes"))?;
        if max >= 1 << 62 {
            return None;
        }
        (max, read_number(&dir.join("memory.usage_in_bytes"))?)
    };
    Some(max.saturating_sub(current))
}

/// Processes the service's pids cgroup may still start (`None`: no limit).
fn pids_headroom(pid: u32) -> Option<u64> {
    let dir = cgroup_dir(pid, "pids")?;
    let max = read_number(&dir.join("pids.max"))?;
    let current = read_number(&dir.join("pids.current"))?;
    Some(max.saturating_sub(current))
}

/// Whether reading a copy-on-write child through `/proc/PID/mem` leaves
/// the pages it reads shared (kernels that broke COW on every GUP read,
/// 5.8 to 5.10, copy each one into the child): probed once, on a child of
/// memtrace's own that only waits, by the `Private_Dirty` of a 256 KiB
/// mapping it shares (its own VMA: `MADV_DONTDUMP` keeps it from merging)
/// before and after a read of it.
pub fn reads_share_pages() -> bool {
    static PROBED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PROBED.get_or_init(|| probe_reads_share_pages().unwrap_or(true))
}

/// [`reads_share_pages`]'s probe; `None` when it could not be made (a
/// snapshot's own clone then says what it can).
fn probe_reads_share_pages() -> Option<bool> {
    const BYTES: usize = 256 << 10;
    // SAFETY: a new private anonymous mapping, ours alone until unmapped.
    let area = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if area == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: `area` is BYTES of writable memory just mapped; the advice
    // changes only its flags.
    unsafe {
        libc::madvise(area, BYTES, libc::MADV_DONTDUMP);
        std::ptr::write_bytes(area.cast::<u8>(), 0x5a, BYTES);
    }
    let addr = area as u64;
    // SAFETY: the child only calls pause(2) until it is killed: no
    // allocation, no lock (memtrace has other threads).
    let child = unsafe { libc::fork() };
    if child == 0 {
        loop {
            // SAFETY: pause is async-signal-safe.
            unsafe { libc::pause() };
        }
    }
    let outcome = (child > 0).then(|| {
        let before = private_dirty_at(child as u32, addr);
        let mut copy = vec![0u8; BYTES];
        let read = std::fs::File::open(format!("/proc/{child}/mem")).and_then(|f| {
            use std::os::unix::fs::FileExt;
            f.read_exact_at(&mut copy, addr)
        });
        let after = private_dirty_at(child as u32, addr);
        log::debug!("COW probe: Private_Dirty {before:?} -> {after:?} KiB, read {read:?}");
        // SAFETY: kill and reap our own child.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        match (read, before, after) {
            (Ok(()), Some(before), Some(after)) => {
                Some(after.saturating_sub(before) < (BYTES as u64 >> 10) / 2)
            }
            _ => None,
        }
    });
    // SAFETY: unmapping the area mapped above, no longer used.
    unsafe { libc::munmap(area, BYTES) };
    outcome.flatten()
}

/// `Private_Dirty` (KiB) of the mapping of `pid` holding `addr`.
fn private_dirty_at(pid: u32, addr: u64) -> Option<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        let range = line
            .split_whitespace()
            .next()
            .and_then(|r| r.split_once('-'));
        if let Some((start, end)) = range {
            if let (Ok(start), Ok(end)) =
                (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
            {
                inside = start <= addr && addr < end;
                continue;
            }
        }
        if inside {
            if let Some(v) = line.strip_prefix("Private_Dirty:") {
                return v.split_whitespace().next()?.parse().ok();
            }
        }
    }
    None
}

/// Whether a snapshot of `pid` is safe and complete, and its clone fits
/// in `max_pause`, read before the stop; the reason it is not (the check
/// then stops the service, its scan cut at `max_pause`).
pub fn preflight(
    pid: u32,
    mappings: &[Mapping],
    max_pause: std::time::Duration,
) -> Result<Plan, String> {
    if cfg!(not(any(target_arch = "x86_64", target_arch = "aarch64"))) {
        return Err("snapshots are made on x86-64 and arm64 only".into());
    }
    if !reads_share_pages() {
        return Err("on this kernel a read of a copy-on-write child copies each page it reads (GUP breaks COW, as on 5.8-5.10): a snapshot would double the memory it scans".into());
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("cannot read /proc/{pid}/status: {e}"))?;
    let suspend_seccomp = match seccomp_mode(&status) {
        0 => false,
        1 => {
            return Err(
                "the process runs in seccomp strict mode: no system call can be injected".into(),
            )
        }
        _ => true,
    };
    if std::fs::read_to_string("/proc/sys/vm/overcommit_memory").is_ok_and(|v| v.trim() == "2") {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let limit = meminfo_bytes(&meminfo, "CommitLimit").unwrap_or(0);
        let committed = meminfo_bytes(&meminfo, "Committed_AS").unwrap_or(u64::MAX);
        let need = private_writable(mappings);
        let left = limit.saturating_sub(committed);
        if left < need {
            return Err(format!(
                "vm.overcommit_memory=2 and the commit limit leaves {} MiB, a copy of the process needs {} MiB",
                left >> 20,
                need >> 20
            ));
        }
    }
    let pinned = pinned_bytes(&status);
    if pinned > PINNED_LIMIT {
        return Err(format!(
            "{} MiB of it is pinned (VmPin: RDMA, io_uring or driver buffers): the clone would copy it during the stop",
            pinned >> 20
        ));
    }
    if let Some(left) = memory_headroom(pid) {
        if left < CGROUP_MARGIN + pinned {
            return Err(format!(
                "its memory cgroup is {} MiB from its limit (a snapshot needs {} MiB of headroom)",
                left >> 20,
                (CGROUP_MARGIN + pinned) >> 20
            ));
        }
    }
    if pids_headroom(pid) == Some(0) {
        return Err("its pids cgroup is at its limit".into());
    }
    let clone_estimate = clone_estimate(pid);
    if let Some((estimate, anon)) = clone_estimate.filter(|(estimate, _)| *estimate > max_pause) {
        return Err(format!(
            "its clone would stop it about {:.1} ms ({} MiB of anonymous memory at this host's measured fork cost), more than --leak-check-max-pause {:.1} ms",
            estimate.as_secs_f64() * 1e3,
            anon >> 20,
            max_pause.as_secs_f64() * 1e3
        ));
    }
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
        .map_err(|e| format!("cannot read /proc/{pid}/smaps: {e}"))?;
    let (flagged, bounds) = flagged_ranges(&smaps);
    Ok(Plan {
        flagged,
        bounds,
        suspend_seccomp,
        clone_estimate: clone_estimate.map(|(estimate, _)| estimate),
    })
}

/// The clone's estimated duration for `pid`, with its anonymous bytes.
fn clone_estimate(pid: u32) -> Option<(std::time::Duration, u64)> {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let (anon, huge) = super::fork_cost::anonymous(&rollup)?;
    let cost = super::fork_cost::for_host()?;
    Some((cost.estimate(anon, huge), anon))
}

impl Plan {
    /// The flags again when the mappings changed since they were read
    /// (called during the stop).
    pub fn refresh(&mut self, pid: u32, mappings: &[Mapping]) -> Result<(), String> {
        let now: Vec<(u64, u64)> = mappings.iter().map(|m| (m.start, m.end)).collect();
        if now == self.bounds {
            return Ok(());
        }
        let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
            .map_err(|e| format!("cannot read /proc/{pid}/smaps: {e}"))?;
        (self.flagged, self.bounds) = flagged_ranges(&smaps);
        Ok(())
    }

    /// The flagged ranges to copy during the stop (those readable in
    /// `mappings`), or why they are too many.
    pub fn to_copy(&self, mappings: &[Mapping]) -> Result<Vec<(u64, u64)>, String> {
        let mut copy = Vec::new();
        let mut total = 0u64;
        for f in &self.flagged {
            let readable = mappings
                .iter()
                .any(|m| m.readable && m.start < f.end && f.start < m.end);
            if !readable {
                continue;
            }
            total += f.end - f.start;
            if total > COPY_LIMIT {
                return Err(format!(
                    "{} MiB of {} and other ranges a snapshot cannot hold as the process has them (more than {} MiB to copy during the stop)",
                    total >> 20,
                    f.why,
                    COPY_LIMIT >> 20
                ));
            }
            copy.push((f.start, f.end));
        }
        Ok(copy)
    }
}

/// The copy of a stopped service: scan it, then drop it (killed and
/// reaped).
pub struct Snapshot {
    pub service: u32,
    pub child: u32,
    /// How long the clone took (the page tables' copy).
    pub clone_time: Duration,
    /// Where the system call instruction used is.
    instruction: u64,
    suspend_seccomp: bool,
    released: bool,
}

/// A failed `ptrace` request, with errno.
fn ptrace_errno(result: libc::c_long, what: &str) -> Result<(), String> {
    if result == 0 {
        Ok(())
    } else {
        Err(format!(
            "{what}: {}",
            std::io::Error::from_raw_os_error(errno())
        ))
    }
}

fn set_options(tid: i32, options: i32) -> Result<(), i32> {
    // SAFETY: PTRACE_SETOPTIONS on our stopped tracee; the options are data.
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_SETOPTIONS,
            tid,
            std::ptr::null_mut::<libc::c_void>(),
            options as usize as *mut libc::c_void,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

fn set_registers(tid: i32, regs: &[u64]) -> Result<(), String> {
    let mut words = regs.to_vec();
    let mut iov = libc::iovec {
        iov_base: words.as_mut_ptr().cast(),
        iov_len: std::mem::size_of_val(words.as_slice()),
    };
    // SAFETY: PTRACE_SETREGSET on our stopped tracee: the kernel reads
    // `iov_len` bytes of `words`; the address argument is the note type.
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_SETREGSET,
            tid,
            libc::NT_PRSTATUS as usize as *mut libc::c_void,
            (&mut iov as *mut libc::iovec).cast::<libc::c_void>(),
        )
    };
    ptrace_errno(r, "cannot set the registers")
}

/// arm64: no system call in flight (its restart logic then leaves the
/// restored registers alone).
#[cfg(target_arch = "aarch64")]
fn forget_system_call(tid: i32) {
    const NT_ARM_SYSTEM_CALL: usize = 0x404;
    let mut number: i32 = -1;
    let mut iov = libc::iovec {
        iov_base: (&mut number as *mut i32).cast(),
        iov_len: 4,
    };
    // SAFETY: PTRACE_SETREGSET of the 4-byte system-call number on our
    // stopped tracee; the kernel reads `number`.
    unsafe {
        libc::ptrace(
            libc::PTRACE_SETREGSET,
            tid,
            NT_ARM_SYSTEM_CALL as *mut libc::c_void,
            (&mut iov as *mut libc::iovec).cast::<libc::c_void>(),
        )
    };
}
#[cfg(not(target_arch = "aarch64"))]
fn forget_system_call(_tid: i32) {}

fn resume(tid: i32, request: libc::c_uint, signal: i32) -> Result<(), String> {
    // SAFETY: resuming our stopped tracee; the signal is data.
    let r = unsafe {
        libc::ptrace(
            request,
            tid,
            std::ptr::null_mut::<libc::c_void>(),
            signal as usize as *mut libc::c_void,
        )
    };
    ptrace_errno(r, "cannot resume the thread")
}

/// Blocks until `tid` changes state; its wait status.
fn wait_for(tid: i32) -> Result<i32, String> {
    loop {
        let mut status = 0;
        // SAFETY: waitpid on our own tracee with a valid status pointer.
        let who = unsafe { libc::waitpid(tid, &mut status, libc::__WALL) };
        if who == tid {
            return Ok(status);
        }
        if who < 0 && errno() != libc::EINTR {
            return Err(format!(
                "waiting for thread {tid}: {}",
                std::io::Error::from_raw_os_error(errno())
            ));
        }
    }
}

/// What an injected system call did.
struct Injected {
    result: i64,
    /// A child it created (clone), seized.
    child: Option<u32>,
    /// Signals that arrived for the thread meanwhile, to give back.
    signals: Vec<i32>,
}

/// Runs system call `nr` in stopped thread `thread` at `instruction`, and
/// gives the thread its registers back (it stays stopped).
fn inject(
    thread: &StoppedThread,
    instruction: u64,
    nr: u64,
    args: [u64; 6],
    suspend_seccomp: bool,
) -> Result<Injected, String> {
    let tid = thread.tid;
    let mut options = libc::PTRACE_O_TRACESYSGOOD
        | libc::PTRACE_O_TRACECLONE
        | libc::PTRACE_O_TRACEFORK
        | libc::PTRACE_O_TRACEVFORK;
    if suspend_seccomp {
        options |= PTRACE_O_SUSPEND_SECCOMP;
    }
    set_options(tid, options).map_err(|e| {
        if suspend_seccomp {
            format!(
                "the process runs under a seccomp filter and its filter cannot be suspended for the injected system call (PTRACE_O_SUSPEND_SECCOMP: {}; it needs CAP_SYS_ADMIN and CONFIG_CHECKPOINT_RESTORE)",
                std::io::Error::from_raw_os_error(e)
            )
        } else {
            format!(
                "cannot set ptrace options: {}",
                std::io::Error::from_raw_os_error(e)
            )
        }
    })?;
    set_registers(tid, &arch::call(&thread.registers, instruction, nr, args))?;
    let mut injected = Injected {
        result: -1,
        child: None,
        signals: Vec::new(),
    };
    let mut syscall_stops = 0;
    let mut signal = 0;
    let outcome = loop {
        if let Err(e) = resume(tid, libc::PTRACE_SYSCALL, signal) {
            break Err(e);
        }
        signal = 0;
        let status = match wait_for(tid) {
            Ok(status) => status,
            Err(e) => break Err(e),
        };
        if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
            return Err(format!(
                "thread {tid} exited during the injected system call"
            ));
        }
        let stop = libc::WSTOPSIG(status);
        let event = status >> 16;
        if stop == libc::SIGTRAP | 0x80 {
            syscall_stops += 1;
            if syscall_stops == 2 {
                break Ok(());
            }
        } else if stop == libc::SIGTRAP
            && [
                libc::PTRACE_EVENT_CLONE,
                libc::PTRACE_EVENT_FORK,
                libc::PTRACE_EVENT_VFORK,
            ]
            .contains(&event)
        {
            injected.child = Some(event_message(tid) as u32);
        } else if event == 0 && stop != libc::SIGTRAP {
            // A signal for this thread: given back when it resumes.
            injected.signals.push(stop);
        }
    };
    let after = super::stop::registers(tid);
    if let Some(after) = &after {
        injected.result = arch::result(after);
    }
    // Back to what it was, whatever happened.
    let restored = set_registers(tid, &arch::restored(&thread.registers));
    forget_system_call(tid);
    let _ = set_options(tid, 0);
    outcome?;
    restored?;
    Ok(injected)
}

/// Where a system-call instruction is in `pid`'s code: its libc first
/// (any executable mapping else), not at any thread's program counter nor
/// just before it (arm64 restarts a call there).
fn find_instruction(pid: u32, mappings: &[Mapping], threads: &[StoppedThread]) -> Option<u64> {
    let avoid: Vec<u64> = threads
        .iter()
        .filter(|t| !t.registers.is_empty())
        .flat_map(|t| {
            let pc = arch::pc(&t.registers);
            [pc, pc.wrapping_sub(4), pc.wrapping_sub(2)]
        })
        .collect();
    let libc_first = |m: &&Mapping| {
        let name = m
            .path
            .as_deref()
            .and_then(|p| p.file_name())
            .and_then(|n| n.to_str())
            .unwrap_or("");
        !(name.starts_with("libc.so") || name.starts_with("libc-"))
    };
    let mut code: Vec<&Mapping> = mappings
        .iter()
        .filter(|m| m.executable && m.readable)
        .collect();
    code.sort_by_key(libc_first);
    let mut memory = super::stop::ProcessMemory::new(pid);
    let mut buf = vec![0u8; 64 << 10];
    for mapping in code {
        let mut at = mapping.start;
        let end = mapping.end.min(mapping.start + (8 << 20));
        while at < end {
            let len = ((end - at) as usize).min(buf.len());
            let read = crate::reach::Memory::read(&mut memory, at, &mut buf[..len]);
            if read < arch::INSTRUCTION.len() {
                break;
            }
            let found = buf[..read]
                .windows(arch::INSTRUCTION.len())
                .enumerate()
                .filter(|(k, _)| aligned(at + *k as u64))
                .find(|(k, w)| *w == arch::INSTRUCTION && !avoid.contains(&(at + *k as u64)));
            if let Some((k, _)) = found {
                return Some(at + k as u64);
            }
            // The instruction may straddle two reads.
            at += (read - arch::INSTRUCTION.len() + 1) as u64;
        }
    }
    None
}

/// Whether an instruction may start at `addr` (arm64: 4-byte aligned).
fn aligned(addr: u64) -> bool {
    addr & (arch::ALIGN as u64 - 1) == 0
}

/// The thread to inject into: one with no signal pending (a signal's
/// handler would see the restarted call), outside a system call first.
fn pick_thread(threads: &[StoppedThread]) -> Option<&StoppedThread> {
    let ready = threads
        .iter()
        .filter(|t| t.signal == 0 && t.tid > 0 && t.registers.len() == arch::WORDS);
    ready
        .clone()
        .find(|t| !t.in_system_call())
        .or_else(|| ready.clone().next())
}

impl Snapshot {
    /// Clones the stopped service `pid` (every thread in `threads`
    /// stopped by this thread); the child is seized, stopped at birth.
    pub fn take(
        pid: u32,
        threads: &[StoppedThread],
        mappings: &[Mapping],
        plan: &Plan,
    ) -> Result<Snapshot, String> {
        let thread = pick_thread(threads).ok_or_else(|| {
            if threads
                .iter()
                .any(|t| t.registers.len() != arch::WORDS && t.tid > 0)
            {
                "the process is not a 64-bit process of memtrace's architecture".to_string()
            } else {
                "every thread had a signal pending at the stop".to_string()
            }
        })?;
        let instruction = find_instruction(pid, mappings, threads)
            .ok_or("no system-call instruction was found in the process's code")?;
        guard_arm(pid, instruction, plan.suspend_seccomp);
        let started = Instant::now();
        let injected = inject(
            thread,
            instruction,
            arch::SYS_CLONE,
            [CLONE_FILES, 0, 0, 0, 0, 0],
            plan.suspend_seccomp,
        );
        if let Some(child) = injected.as_ref().ok().and_then(|i| i.child) {
            guard_child(pid, child);
        } else {
            guard_disarm(pid);
        }
        let injected = injected?;
        let clone_time = started.elapsed();
        for &signal in &injected.signals {
            // SAFETY: tgkill with our tracee's ids; the signal arrived for
            // that thread while it ran the injected call.
            unsafe { libc::syscall(libc::SYS_tgkill, pid as i32, thread.tid, signal) };
        }
        let child = match (injected.result, injected.child) {
            (r, Some(child)) if r > 0 => child,
            (r, _) if r < 0 => {
                return Err(format!(
                    "the injected clone failed: {}",
                    std::io::Error::from_raw_os_error((-r) as i32)
                ))
            }
            _ => return Err("the injected clone made no child".into()),
        };
        let mut snapshot = Snapshot {
            service: pid,
            child,
            clone_time,
            instruction,
            suspend_seccomp: plan.suspend_seccomp,
            released: false,
        };
        // Its first stop, then: killed if memtrace dies.
        let status = wait_for(child as i32)?;
        if !libc::WIFSTOPPED(status) {
            snapshot.released = true;
            return Err("the snapshot's child died at birth".into());
        }
        let _ = set_options(child as i32, PTRACE_O_EXITKILL);
        Ok(snapshot)
    }

    /// Kills the child and has the service reap it.
    pub fn release(mut self) -> Result<(), String> {
        self.released = true;
        self.kill_and_reap()
    }

    /// Kills the child now (the scan reading it then fails): the service's
    /// memory cgroup is near its limit.
    pub fn kill_now(child: u32) {
        // SAFETY: kill(2) of our own seized child.
        unsafe { libc::kill(child as i32, libc::SIGKILL) };
    }

    fn kill_and_reap(&self) -> Result<(), String> {
        Snapshot::kill_now(self.child);
        // Our wait as its tracer: it then becomes the service's zombie.
        loop {
            let status = wait_for(self.child as i32)?;
            if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                break;
            }
        }
        let reaped = reap(
            self.service,
            self.child,
            self.instruction,
            self.suspend_seccomp,
        );
        guard_disarm(self.service);
        reaped
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        if !self.released {
            self.released = true;
            if let Err(e) = self.kill_and_reap() {
                log::warn!("snapshot child {}: {e}", self.child);
            }
        }
    }
}

/// Has `service` reap its zombie child `child`: one of its threads is
/// stopped for a `wait4(child, NULL, WNOHANG|__WALL, NULL)`, then resumed.
pub fn reap(
    service: u32,
    child: u32,
    instruction: u64,
    suspend_seccomp: bool,
) -> Result<(), String> {
    // wait4 runs in the service's pid namespace: the child by the pid it
    // has there (a container's), not the host's.
    let inner = std::fs::read_to_string(format!("/proc/{child}/status"))
        .ok()
        .and_then(|status| super::container::ns_pid(&status))
        .unwrap_or(child);
    let tids: Vec<i32> = std::fs::read_dir(format!("/proc/{service}/task"))
        .map_err(|_| format!("pid {service} exited"))?
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    let mut last = String::from("no thread could be stopped");
    for tid in tids {
        if seize(tid).is_err() {
            continue;
        }
        let signal = match wait_stopped(tid, Instant::now() + Duration::from_secs(2)) {
            Waited::Stopped(signal) => signal,
            Waited::Exited => continue,
            Waited::TimedOut => {
                detach(tid, 0);
                continue;
            }
        };
        let outcome = match super::stop::registers(tid) {
            Some(registers) if registers.len() == arch::WORDS => {
                let thread = StoppedThread {
                    tid,
                    registers,
                    signal,
                    ..StoppedThread::default()
                };
                inject(
                    &thread,
                    instruction,
                    arch::SYS_WAIT4,
                    [u64::from(inner), 0, WNOHANG | WALL, 0, 0, 0],
                    suspend_seccomp,
                )
            }
            _ => Err("cannot read its registers".into()),
        };
        detach(tid, signal);
        match outcome {
            Ok(injected) => {
                for signal in injected.signals {
                    // SAFETY: tgkill of the service's own thread with a
                    // signal that arrived for it during the call.
                    unsafe { libc::syscall(libc::SYS_tgkill, service as i32, tid, signal) };
                }
                // Reaped, or already reaped by the service itself (ECHILD).
                if injected.result == i64::from(inner) || injected.result == -(libc::ECHILD as i64)
                {
                    return Ok(());
                }
                last = format!("wait4 gave {}", injected.result);
            }
            Err(e) => last = e,
        }
    }
    Err(format!(
        "the snapshot's child {child} was not reaped: {last}"
    ))
}

// The guard's side of these lines is `super::snapshot_guard`.

/// The running guard, started once.
struct Guard {
    _process: Child,
    stdin: ChildStdin,
}

static GUARD: Mutex<Option<Guard>> = Mutex::new(None);

/// Sends one line to the guard, starting it first; false when there is
/// no guard (it could not be started: the snapshot goes on unguarded).
fn send(line: &str) -> bool {
    let Ok(mut guard) = GUARD.lock() else {
        return false;
    };
    if guard.is_none() {
        use std::os::unix::process::CommandExt;
        let started = Command::new("/proc/self/exe")
            .arg("snapshot-guard")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .process_group(0)
            .spawn();
        match started {
            Ok(mut process) => {
                if let Some(stdin) = process.stdin.take() {
                    *guard = Some(Guard {
                        _process: process,
                        stdin,
                    });
                }
            }
            Err(e) => log::warn!("the snapshot guard could not start: {e}"),
        }
    }
    guard.as_mut().is_some_and(|g| {
        writeln!(g.stdin, "{line}")
            .and_then(|()| g.stdin.flush())
            .is_ok()
    })
}

/// Before the clone into `service`.
fn guard_arm(service: u32, instruction: u64, suspend_seccomp: bool) {
    let children = children(service);
    let list: Vec<String> = children.iter().map(u32::to_string).collect();
    send(&format!(
        "arm {service} {instruction} {} {}",
        u8::from(suspend_seccomp),
        list.join(" ")
    ));
}

/// Once the clone made `child`.
fn guard_child(service: u32, child: u32) {
    send(&format!("child {service} {child}"));
}

/// Once the child is reaped (or never born).
fn guard_disarm(service: u32) {
    send(&format!("disarm {service}"));
}

/// The children of every thread of `pid`.
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut all: Vec<u32> = tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|text| {
            text.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect();
    all.sort_unstable();
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_ranges_a_child_would_not_show() {
        let smaps = "\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
Size:                132 kB
VmFlags: rd wr mr mw me ac
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
VmFlags: rd wr mr mw me dc ac
7f0000100000-7f0000200000 rw-p 00000000 00:00 0
VmFlags: rd wr mr mw me wf ac
7f0000200000-7f0000300000 rw-s 00000000 00:05 12                         /dev/zero (deleted)
VmFlags: rd wr sh mr mw me ms
7f0000300000-7f0000400000 r--s 00000000 08:01 99                         /usr/share/x
VmFlags: rd sh mr mw me ms
7f0000400000-7f0000500000 rw-p 00000000 00:00 0
VmFlags: rd wr mr mw me ac um
";
        let (flagged, bounds) = flagged_ranges(smaps);
        let whys: Vec<&str> = flagged.iter().map(|f| f.why).collect();
        // Shared memory is the same pages in the child: not flagged.
        assert_eq!(whys, ["dontfork", "wipeonfork", "userfaultfd"]);
        assert_eq!(flagged[0].start, 0x7f00_0000_0000);
        assert_eq!(bounds.len(), 6);
    }

    #[test]
    fn copies_only_flagged_ranges_that_are_mapped_readable() {
        let maps = crate::tracee::maps::parse(
            "00005000-00006000 rw-p 00000000 00:00 0\n00007000-00008000 ---p 00000000 00:00 0\n",
        );
        let flagged = |start, end| Flagged {
            start,
            end,
            why: "dontfork",
        };
        let plan = Plan {
            flagged: vec![
                flagged(0x1000, 0x2000),
                flagged(0x5000, 0x6000),
                flagged(0x7000, 0x8000),
            ],
            ..Plan::default()
        };
        assert_eq!(plan.to_copy(&maps), Ok(vec![(0x5000, 0x6000)]));
        let big = Plan {
            flagged: vec![flagged(0x5000, 0x5000 + COPY_LIMIT + 4096)],
            ..Plan::default()
        };
        let maps = crate::tracee::maps::parse(&format!(
            "00005000-{:08x} rw-p 00000000 00:00 0\n",
            0x5000 + COPY_LIMIT + 4096
        ));
        assert!(big.to_copy(&maps).is_err_and(|e| e.contains("dontfork")));
    }

    #[test]
    fn reading_a_forked_child_leaves_its_pages_shared_on_this_kernel() {
        // Since 5.11 a read through /proc/PID/mem takes plain references.
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut numbers = release
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse::<u32>().ok());
        let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
        if version >= (5, 11) {
            assert!(reads_share_pages(), "kernel {release}");
        }
        // Probed once.
        assert_eq!(reads_share_pages(), reads_share_pages());
    }

    #[test]
    fn reads_seccomp_and_meminfo() {
        assert_eq!(seccomp_mode("Name:\tx\nSeccomp:\t2\n"), 2);
        assert_eq!(seccomp_mode("Name:\tx\n"), 0);
        assert_eq!(
            meminfo_bytes("CommitLimit:    1000 kB\n", "CommitLimit"),
            Some(1_024_000)
        );
        assert_eq!(
            pinned_bytes("VmLck:\t  8 kB\nVmPin:\t   65540 kB\n"),
            65540 << 10
        );
        assert_eq!(pinned_bytes("Name:\tx\n"), 0);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn an_interrupted_call_is_set_to_run_again() {
        let mut saved = vec![0u64; arch::WORDS];
        saved[15] = 0; // orig_rax: read(2)
        saved[10] = (-512i64) as u64; // ERESTARTSYS
        saved[16] = 0x1002;
        let regs = arch::restored(&saved);
        assert_eq!((regs[10], regs[16], regs[15]), (0, 0x1000, u64::MAX));
        saved[10] = (-516i64) as u64;
        assert_eq!(arch::restored(&saved)[10], 219);
        // A call that returned stays returned.
        saved[10] = 5;
        assert_eq!(arch::restored(&saved)[16], 0x1002);
        let call = arch::call(&saved, 0x4000, 56, [1, 2, 3, 4, 5, 6]);
        assert_eq!(
            (call[16], call[10], call[15], call[14], call[7]),
            (0x4000, 56, u64::MAX, 1, 4)
        );
    }
}
