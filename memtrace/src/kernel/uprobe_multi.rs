//! `uprobe_multi` BPF links (Linux 6.6+): one `BPF_LINK_CREATE` attaches a
//! program to many offsets of one file, each with its own attach cookie
//! (and USDT semaphore), for one process; closing the link detaches them all
//! at once. A uprobe perf event per probe instead costs the kernel a
//! serialized unregistration with grace-period waits on close (seconds for
//! a hundred probes).
//!
//! Programs attached this way must be loaded with the expected attach type
//! `BPF_TRACE_UPROBE_MULTI` (aya's `UProbe::load_for_uprobe_multi`, a patch
//! in `third_party/aya`), and such a program can no longer be attached to a
//! perf event (the kernel refuses it with `EINVAL`).
//!
//! [`probe`] finds out whether the kernel has the links as libbpf does:
//! a link on `/` (not a regular file) fails with `EBADF` where the link type
//! exists, and a negative pid fails early with `EINVAL` only where the
//! 6.6 kernels' PID filter (one thread instead of the whole process) was
//! fixed; without that fix the links are treated as missing.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use thiserror::Error;

/// `BPF_PROG_LOAD`.
const BPF_PROG_LOAD: libc::c_long = 5;
/// `BPF_LINK_CREATE`.
const BPF_LINK_CREATE: libc::c_long = 28;
/// `BPF_PROG_TYPE_KPROBE` (uprobes are kprobe programs).
const BPF_PROG_TYPE_KPROBE: u32 = 2;
/// `BPF_TRACE_UPROBE_MULTI` (attach type, include/uapi/linux/bpf.h).
pub const BPF_TRACE_UPROBE_MULTI: u32 = 48;
/// `BPF_F_UPROBE_MULTI_RETURN`: the link's probes are return probes.
const BPF_F_UPROBE_MULTI_RETURN: u32 = 1;
/// Bytes of `union bpf_attr` passed (the link_create part ends at 60).
const ATTR_SIZE: usize = 64;

/// Why a `uprobe_multi` link could not be created.
#[derive(Debug, Error)]
pub enum MultiError {
    #[error("a uprobe_multi link needs at least one offset")]
    Empty,
    #[error("{what}: {len} entries for {cnt} offsets")]
    Length {
        what: &'static str,
        len: usize,
        cnt: usize,
    },
    #[error("path with a NUL byte")]
    Path,
    #[error("pid {0} out of range")]
    Pid(u32),
    #[error("BPF_LINK_CREATE (uprobe_multi): {0}")]
    Kernel(#[source] io::Error),
}

impl MultiError {
    /// The kernel's errno, when the kernel refused the link.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            MultiError::Kernel(err) => err.raw_os_error(),
            _ => None,
        }
    }
}

/// One `uprobe_multi` link: every probe of one file for one process (entry
/// or return). Held only to be dropped: closing it detaches them all.
#[derive(Debug)]
pub struct MultiLink {
    _fd: OwnedFd,
}

/// What one link attaches: a program at `offsets` of the file `path`
/// points to (a C string), for process `pid` (0: every process).
#[derive(Clone, Copy, Debug)]
pub struct LinkRequest {
    pub prog_fd: u32,
    pub path_ptr: u64,
    pub offsets_ptr: u64,
    /// 0: no semaphores.
    pub ref_ctr_offsets_ptr: u64,
    /// 0: no cookies.
    pub cookies_ptr: u64,
    pub cnt: u32,
    pub ret: bool,
    pub pid: u32,
}

/// The bytes of `union bpf_attr` for `BPF_LINK_CREATE` with the
/// `uprobe_multi` member: prog_fd @0, target_fd @4 (unused: 0), attach_type
/// @8, flags @12, then path @16, offsets @24, ref_ctr_offsets @32, cookies
/// @40, cnt @48, flags @52, pid @56. Pure, for tests.
pub fn link_attr(request: &LinkRequest) -> [u8; ATTR_SIZE] {
    let mut attr = [0u8; ATTR_SIZE];
    let mut put32 = |at: usize, value: u32| attr[at..at + 4].copy_from_slice(&value.to_ne_bytes());
    put32(0, request.prog_fd);
    put32(8, BPF_TRACE_UPROBE_MULTI);
    put32(48, request.cnt);
    put32(52, u32::from(request.ret) * BPF_F_UPROBE_MULTI_RETURN);
    put32(56, request.pid);
    for (at, value) in [
        (16, request.path_ptr),
        (24, request.offsets_ptr),
        (32, request.ref_ctr_offsets_ptr),
        (40, request.cookies_ptr),
    ] {
        attr[at..at + 8].copy_from_slice(&value.to_ne_bytes());
    }
    attr
}

/// `BPF_LINK_CREATE` with `attr`; the new descriptor or the kernel's error.
fn link_create(attr: &[u8; ATTR_SIZE]) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a zero-filled bpf_attr of the size passed; every
    // pointer in it refers to memory the caller keeps alive for the call,
    // and the kernel only reads through them.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_CREATE,
            attr.as_ptr(),
            ATTR_SIZE as libc::c_uint,
        )
    };
    crate::kernel::syscall_fd::owned(fd)
}

/// Attaches `program` (loaded for `BPF_TRACE_UPROBE_MULTI`) at `offsets` of
/// `path` for process `pid`, each with the cookie and semaphore (file
/// offset, 0: none) of the same index; return probes when `ret`.
pub fn attach(
    program: BorrowedFd<'_>,
    path: &Path,
    offsets: &[u64],
    cookies: Option<&[u64]>,
    ref_ctr_offsets: Option<&[u64]>,
    ret: bool,
    pid: u32,
) -> Result<MultiLink, MultiError> {
    let cnt = offsets.len();
    if cnt == 0 {
        return Err(MultiError::Empty);
    }
    for (what, array) in [("cookies", cookies), ("semaphores", ref_ctr_offsets)] {
        if let Some(array) = array.filter(|a| a.len() != cnt) {
            return Err(MultiError::Length {
                what,
                len: array.len(),
                cnt,
            });
        }
    }
    let c_path = CString::new(path.as_os_str().as_bytes()).map_err(|_| MultiError::Path)?;
    if libc::pid_t::try_from(pid).is_err() {
        return Err(MultiError::Pid(pid));
    }
    let request = LinkRequest {
        prog_fd: u32::try_from(program.as_raw_fd()).unwrap_or(u32::MAX),
        path_ptr: c_path.as_ptr() as u64,
        offsets_ptr: offsets.as_ptr() as u64,
        ref_ctr_offsets_ptr: ref_ctr_offsets.map_or(0, |a| a.as_ptr() as u64),
        cookies_ptr: cookies.map_or(0, |a| a.as_ptr() as u64),
        cnt: u32::try_from(cnt).unwrap_or(u32::MAX),
        ret,
        pid,
    };
    let fd = link_create(&link_attr(&request)).map_err(MultiError::Kernel)?;
    Ok(MultiLink { _fd: fd })
}

/// Loads `r0 = 0; exit` as a kprobe program for `BPF_TRACE_UPROBE_MULTI`.
fn load_probe_program() -> io::Result<OwnedFd> {
    // BPF_ALU64|BPF_MOV|BPF_K r0 = 0; BPF_JMP|BPF_EXIT.
    let insns: [u64; 2] = [0xb7, 0x95];
    let license = c"GPL";
    // union bpf_attr for BPF_PROG_LOAD: prog_type @0, insn_cnt @4, insns @8,
    // license @16, ... expected_attach_type @68.
    let mut attr = [0u8; 72];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_KPROBE.to_ne_bytes());
    attr[4..8].copy_from_slice(&2u32.to_ne_bytes());
    attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    attr[68..72].copy_from_slice(&BPF_TRACE_UPROBE_MULTI.to_ne_bytes());
    // SAFETY: `attr` is a zero-filled BPF_PROG_LOAD attribute of the size
    // passed; the instructions and license it points to outlive the call.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, attr.as_ptr(), attr.len()) };
    crate::kernel::syscall_fd::owned(fd)
}

/// What [`probe`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Support {
    /// Links with a working process filter.
    Found,
    /// No such link type (before 6.6, or not built in).
    Missing,
    /// The link type exists but filters one thread, not the process (6.6
    /// without the fix): unusable for tracing a process.
    ThreadFilter,
}

/// Asks the kernel whether it has usable `uprobe_multi` links (see the
/// module's docs); an error: the probe program could not be loaded (no
/// privilege, or no such attach type).
pub fn probe() -> io::Result<Support> {
    let program = load_probe_program()?;
    let offset: u64 = 0;
    let root = c"/";
    let mut request = LinkRequest {
        prog_fd: u32::try_from(program.as_raw_fd()).unwrap_or(u32::MAX),
        path_ptr: root.as_ptr() as u64,
        offsets_ptr: std::ptr::addr_of!(offset) as u64,
        ref_ctr_offsets_ptr: 0,
        cookies_ptr: 0,
        cnt: 1,
        ret: false,
        pid: 0,
    };
    match link_create(&link_attr(&request)) {
        Err(err) if err.raw_os_error() == Some(libc::EBADF) => {}
        // Linked on "/"? Not a kernel to trust with it either.
        Ok(_) | Err(_) => return Ok(Support::Missing),
    }
    request.pid = u32::MAX; // -1
    match link_create(&link_attr(&request)) {
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => Ok(Support::Found),
        _ => Ok(Support::ThreadFilter),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attr_lays_out_link_create_uprobe_multi() {
        let request = LinkRequest {
            prog_fd: 7,
            path_ptr: 0x1111,
            offsets_ptr: 0x2222,
            ref_ctr_offsets_ptr: 0x3333,
            cookies_ptr: 0x4444,
            cnt: 5,
            ret: true,
            pid: 4242,
        };
        let attr = link_attr(&request);
        let word = |at: usize| u64::from_ne_bytes(attr[at..at + 8].try_into().expect("8"));
        let half = |at: usize| u32::from_ne_bytes(attr[at..at + 4].try_into().expect("4"));
        assert_eq!(half(0), 7);
        assert_eq!(half(4), 0, "target_fd unused");
        assert_eq!(half(8), 48);
        assert_eq!(half(12), 0, "link flags");
        assert_eq!(word(16), 0x1111);
        assert_eq!(word(24), 0x2222);
        assert_eq!(word(32), 0x3333);
        assert_eq!(word(40), 0x4444);
        assert_eq!(half(48), 5);
        assert_eq!(half(52), 1, "BPF_F_UPROBE_MULTI_RETURN");
        assert_eq!(half(56), 4242);
        assert!(attr[60..].iter().all(|&b| b == 0));
        let entry = link_attr(&LinkRequest {
            ret: false,
            ..request
        });
        assert_eq!(u32::from_ne_bytes(entry[52..56].try_into().expect("4")), 0);
    }

    #[test]
    fn mismatched_arrays_are_refused_before_the_kernel() {
        let fd = std::fs::File::open("/dev/null").expect("/dev/null");
        let fd = std::os::fd::AsFd::as_fd(&fd);
        let path = Path::new("/bin/true");
        assert!(matches!(
            attach(fd, path, &[], None, None, false, 1),
            Err(MultiError::Empty)
        ));
        assert!(matches!(
            attach(fd, path, &[1, 2], Some(&[1]), None, false, 1),
            Err(MultiError::Length {
                what: "cookies",
                len: 1,
                cnt: 2
            })
        ));
        assert!(matches!(
            attach(fd, path, &[1], None, Some(&[1, 2]), false, 1),
            Err(MultiError::Length {
                what: "semaphores",
                ..
            })
        ));
    }
}
