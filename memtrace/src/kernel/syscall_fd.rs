//! The descriptor a raw system call returns (`bpf(2)`, `perf_event_open(2)`),
//! as an owned file descriptor or the call's error.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

/// `ret`, a system call's return value that is a new descriptor on success,
/// as an [`OwnedFd`]; a negative `ret` is the call's `errno`.
pub fn owned(ret: libc::c_long) -> io::Result<OwnedFd> {
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = libc::c_int::try_from(ret)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "descriptor out of range"))?;
    // SAFETY: the kernel just returned this descriptor, owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_returns_are_errors_and_descriptors_are_owned() {
        // SAFETY: a plain dup of stdin's descriptor, owned by the result.
        let ret = unsafe { libc::dup(0) };
        let fd = owned(libc::c_long::from(ret)).expect("a descriptor");
        drop(fd);
        assert!(owned(libc::c_long::from(libc::c_int::MAX) + 1).is_err());
    }
}
