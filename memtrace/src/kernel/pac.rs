//! Pointer authentication (arm64): which bits of a return address are
//! address, so that the in-kernel unwinder can strip the authentication
//! code that `paciasp` signed into a saved x30 before it symbolizes or
//! follows it. The kernel tells a tracer its mask through `PTRACE_GETREGSET`
//! `NT_ARM_PAC_MASK` (the same for every process of a boot); memtrace asks
//! it about a child of its own, stopped at birth and killed at once. On
//! x86-64, and where the kernel does not answer, see [`return_address_mask`].

/// `main` asks once, before any thread or child exists: the answer is kept
/// for the process's life.
///
/// The mask the unwinder applies to every return address: all ones on
/// x86-64; on arm64 the kernel's answer (address bits only), or the 48-bit
/// user address space every arm64 Linux gives a process by default when the
/// kernel cannot be asked (a kernel without pointer authentication has no
/// bits to strip above it either).
pub fn return_address_mask() -> u64 {
    static MASK: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *MASK.get_or_init(|| {
        if cfg!(target_arch = "aarch64") {
            match kernel_mask() {
                Some(pac) => !pac,
                None => (1u64 << 48) - 1,
            }
        } else {
            u64::MAX
        }
    })
}

/// `NT_ARM_PAC_MASK`: `struct user_pac_mask { u64 data_mask, insn_mask }`.
#[cfg(target_arch = "aarch64")]
fn kernel_mask() -> Option<u64> {
    const NT_ARM_PAC_MASK: libc::c_int = 0x406;
    // SAFETY: fork has no preconditions; the child only makes
    // async-signal-safe calls (ptrace, raise, _exit) before it dies.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return None;
    }
    if child == 0 {
        // SAFETY: the child asks to be traced, stops, and exits if resumed.
        unsafe {
            libc::ptrace(libc::PTRACE_TRACEME, 0, 0, 0);
            libc::raise(libc::SIGSTOP);
            libc::_exit(0);
        }
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    let stopped =
        unsafe { libc::waitpid(child, &mut status, 0) } == child && libc::WIFSTOPPED(status);
    let mut masks = [0u64; 2];
    let mut iov = libc::iovec {
        iov_base: masks.as_mut_ptr().cast(),
        iov_len: std::mem::size_of_val(&masks),
    };
    // SAFETY: GETREGSET on our stopped tracee into a buffer of `iov_len`
    // bytes; the iovec outlives the call.
    let read = stopped
        && unsafe {
            libc::ptrace(
                libc::PTRACE_GETREGSET,
                child,
                NT_ARM_PAC_MASK as usize as *mut libc::c_void,
                (&mut iov as *mut libc::iovec).cast::<libc::c_void>(),
            )
        } == 0;
    // SAFETY: killing and reaping our own child.
    unsafe {
        libc::kill(child, libc::SIGKILL);
        libc::waitpid(child, &mut status, 0);
    }
    read.then_some(masks[0] | masks[1])
}

#[cfg(not(target_arch = "aarch64"))]
fn kernel_mask() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mask_keeps_every_user_address() {
        let mask = return_address_mask();
        // Any user code address of a 48-bit address space survives it.
        for addr in [
            0x40_0000u64,
            0x5555_5555_4000,
            0x7fff_f7dd_0000,
            0xffff_ffff_f000,
        ] {
            assert_eq!(addr & mask, addr, "{addr:#x} under {mask:#x}");
        }
        if cfg!(target_arch = "x86_64") {
            assert_eq!(mask, u64::MAX);
        }
    }
}
