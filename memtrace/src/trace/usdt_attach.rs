//! Attaching a program to a USDT probe through a uprobe perf event opened
//! here, because aya 0.14's `UProbe::attach` cannot pass the probe's
//! semaphore: `perf_event_open` on the uprobe PMU with the semaphore's file
//! offset as the uprobe's reference counter (`ref_ctr_offset`, in
//! `attr.config` bits 32-63, Linux 4.20+). The kernel raises the semaphore
//! in the traced process for as long as the uprobe exists and drops it when
//! the event is closed: when memtrace detaches, exits or is killed.
//!
//! The program is attached with a BPF link carrying the attach cookie (the
//! spec index, as for every other probe), or on kernels without perf-event
//! links (before 5.15) with `PERF_EVENT_IOC_SET_BPF` and no cookie.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Where the uprobe PMU's dynamic type number is published.
const UPROBE_TYPE: &str = "/sys/bus/event_source/devices/uprobe/type";
/// `PERF_UPROBE_REF_CTR_OFFSET_SHIFT` (include/uapi/linux/perf_event.h).
const REF_CTR_OFFSET_SHIFT: u32 = 32;
/// `PERF_FLAG_FD_CLOEXEC`.
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 8;
/// `PERF_EVENT_IOC_ENABLE` (`_IO('$', 0)`).
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;
/// `PERF_EVENT_IOC_SET_BPF` (`_IOW('$', 8, __u32)`).
const PERF_EVENT_IOC_SET_BPF: libc::c_ulong = 0x4004_2408;
/// `BPF_LINK_CREATE`.
const BPF_LINK_CREATE: libc::c_long = 28;
/// `BPF_PERF_EVENT` (attach type).
const BPF_PERF_EVENT: u32 = 41;
/// Bytes of `struct perf_event_attr` passed (`PERF_ATTR_SIZE_VER5`).
const ATTR_SIZE: usize = 112;

/// A USDT probe attached for one process: the uprobe perf event and, when
/// attached through a BPF link, the link; or, on kernels with them, a
/// `uprobe_multi` link carrying the semaphore. Dropping it detaches the
/// program and removes the uprobe (and so lowers the semaphore).
#[derive(Debug)]
pub enum UsdtLink {
    Perf {
        // Field order: the link is closed before the event.
        _link: Option<OwnedFd>,
        _event: OwnedFd,
    },
    // Held only to be dropped (closed).
    Multi(#[allow(dead_code)] crate::kernel::uprobe_multi::MultiLink),
}

/// The uprobe PMU's type number.
pub fn uprobe_pmu_type() -> io::Result<u32> {
    let text = std::fs::read_to_string(UPROBE_TYPE)?;
    text.trim().parse().map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{UPROBE_TYPE}: {text:?} is no number"),
        )
    })
}

/// The bytes of a `struct perf_event_attr` for a uprobe at `offset` in the
/// file whose path `path_ptr` points to, with the semaphore at file offset
/// `ref_ctr_offset` (0: none). Pure, for tests.
pub fn uprobe_attr(pmu_type: u32, path_ptr: u64, offset: u64, ref_ctr_offset: u64) -> [u8; 128] {
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&pmu_type.to_ne_bytes());
    attr[4..8].copy_from_slice(&(ATTR_SIZE as u32).to_ne_bytes());
    // config: the reference counter's offset in bits 32-63 (bit 0 would
    // make it a return probe).
    attr[8..16].copy_from_slice(&(ref_ctr_offset << REF_CTR_OFFSET_SHIFT).to_ne_bytes());
    // config1: the path (uprobe_path); config2: the probe's file offset.
    attr[56..64].copy_from_slice(&path_ptr.to_ne_bytes());
    attr[64..72].copy_from_slice(&offset.to_ne_bytes());
    attr
}

/// Opens a uprobe perf event at `offset` of `path` for process `pid`, with
/// the semaphore at file offset `ref_ctr_offset` if any.
pub fn open_uprobe(
    path: &Path,
    offset: u64,
    ref_ctr_offset: Option<u64>,
    pid: u32,
) -> io::Result<OwnedFd> {
    let ref_ctr = ref_ctr_offset.unwrap_or(0);
    if ref_ctr >> (64 - REF_CTR_OFFSET_SHIFT) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("semaphore offset {ref_ctr:#x} does not fit the uprobe's 32 bits"),
        ));
    }
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path with a NUL byte"))?;
    let attr = uprobe_attr(uprobe_pmu_type()?, c_path.as_ptr() as u64, offset, ref_ctr);
    // SAFETY: `attr` is a zero-filled perf_event_attr of ATTR_SIZE bytes or
    // more, `c_path` outlives the call, and the syscall only reads them;
    // pid > 0 with cpu -1 traces that process on every CPU.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            attr.as_ptr(),
            pid,
            -1 as libc::c_int,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    crate::kernel::syscall_fd::owned(fd)
}

/// Attaches `program` to the uprobe `event` with `cookie` (through a BPF
/// link), or without a cookie by `PERF_EVENT_IOC_SET_BPF` when `cookie` is
/// `None` (the compat object, kernels without perf-event links).
pub fn attach(
    program: BorrowedFd<'_>,
    event: OwnedFd,
    cookie: Option<u64>,
) -> io::Result<UsdtLink> {
    let link = match cookie {
        Some(cookie) => {
            // union bpf_attr, link_create: prog_fd, target_fd, attach_type,
            // flags, then perf_event.bpf_cookie.
            let mut attr = [0u8; 64];
            let prog_fd = u32::try_from(program.as_raw_fd()).unwrap_or(u32::MAX);
            let target_fd = u32::try_from(event.as_raw_fd()).unwrap_or(u32::MAX);
            attr[0..4].copy_from_slice(&prog_fd.to_ne_bytes());
            attr[4..8].copy_from_slice(&target_fd.to_ne_bytes());
            attr[8..12].copy_from_slice(&BPF_PERF_EVENT.to_ne_bytes());
            attr[16..24].copy_from_slice(&cookie.to_ne_bytes());
            // SAFETY: `attr` is a zero-filled bpf_attr of the size passed;
            // the kernel only reads it.
            let fd = unsafe {
                libc::syscall(
                    libc::SYS_bpf,
                    BPF_LINK_CREATE,
                    attr.as_ptr(),
                    attr.len() as libc::c_uint,
                )
            };
            Some(crate::kernel::syscall_fd::owned(fd)?)
        }
        None => {
            // SAFETY: both descriptors are open for the call; the ioctl
            // takes the program descriptor by value.
            let rc = unsafe {
                libc::ioctl(
                    event.as_raw_fd(),
                    PERF_EVENT_IOC_SET_BPF as _,
                    program.as_raw_fd(),
                )
            };
            if rc < 0 {
                return Err(io::Error::last_os_error());
            }
            None
        }
    };
    // SAFETY: the descriptor is an open perf event; the ioctl takes no argument.
    let rc = unsafe { libc::ioctl(event.as_raw_fd(), PERF_EVENT_IOC_ENABLE as _, 0) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UsdtLink::Perf {
        _link: link,
        _event: event,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attr_carries_path_offset_and_semaphore() {
        let attr = uprobe_attr(9, 0x1122_3344, 0x1139, 0x3010);
        let word = |at: usize| u64::from_ne_bytes(attr[at..at + 8].try_into().expect("8 bytes"));
        assert_eq!(u32::from_ne_bytes(attr[0..4].try_into().expect("4")), 9);
        assert_eq!(u32::from_ne_bytes(attr[4..8].try_into().expect("4")), 112);
        assert_eq!(word(8), 0x3010 << 32);
        assert_eq!(word(56), 0x1122_3344);
        assert_eq!(word(64), 0x1139);
        assert!(attr[16..56].iter().all(|&b| b == 0));
    }

    /// Root only: a uprobe with a reference counter raises the semaphore of
    /// a running process while it exists and drops it when closed.
    #[test]
    fn semaphore_is_raised_while_the_uprobe_exists() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || uprobe_pmu_type().is_err() {
            return;
        }
        let dir = std::env::temp_dir().join(format!("memtrace-usdt-sema-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let src = dir.join("sema.c");
        std::fs::write(
            &src,
            r#"
#define _SDT_HAS_SEMAPHORES 1
#include <sys/sdt.h>
#include <unistd.h>
__extension__ unsigned short demo_hit_semaphore __attribute__((unused)) __attribute__((section(".probes")));
int main(void) { for (;;) { if (demo_hit_semaphore) DTRACE_PROBE1(demo, hit, 1); usleep(1000); } }
"#,
        )
        .expect("source");
        let exe = dir.join("sema");
        let built = std::process::Command::new("gcc")
            .args(["-O1", "-o"])
            .arg(&exe)
            .arg(&src)
            .status()
            .expect("gcc runs");
        assert!(built.success(), "gcc with <sys/sdt.h> (systemtap-sdt-dev)");
        let probe = crate::probe::usdt::read(&exe).expect("notes").remove(0);
        let mut child = std::process::Command::new(&exe).spawn().expect("runs");
        std::thread::sleep(std::time::Duration::from_millis(100));
        let pid = child.id();
        let semaphore = probe.semaphore.expect("semaphore");
        let read = || {
            use std::os::unix::fs::FileExt;
            let maps = crate::probe::maps::read_raw(pid).expect("maps");
            let base = maps
                .iter()
                .find(|m| m.path.as_deref() == Some(exe.as_path()) && m.file_offset == 0)
                .expect("mapped")
                .start;
            let mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("mem");
            let mut value = [0u8; 2];
            mem.read_exact_at(&mut value, base + semaphore)
                .expect("semaphore readable");
            u16::from_ne_bytes(value)
        };
        assert_eq!(read(), 0);
        let event = open_uprobe(&exe, probe.file_offset, probe.semaphore_offset, pid)
            .expect("uprobe opens");
        assert_eq!(read(), 1);
        drop(event);
        assert_eq!(read(), 0);
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
