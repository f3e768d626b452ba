//! Where a traced thread's `pthread_t` sits relative to its thread pointer
//! (the value the kernel keeps per task: `fsbase` on x86-64, `tp_value` on
//! arm64), for the Python frame reader, which matches each CPython thread
//! state's `thread_id` (a `pthread_self()`) against the running thread.
//!
//! x86-64 glibc puts the TCB (the `struct pthread`) at the thread pointer:
//! the two are equal. arm64 glibc puts the thread pointer just after its
//! `struct pthread`, whose size changes between glibc releases; glibc
//! exports it for libthread_db as `_thread_db_sizeof_pthread` (a `u32`),
//! which is read from the target's own libc.

use std::path::Path;

use object::{Object, ObjectSegment, ObjectSymbol};

use crate::arch::Arch;
use crate::tracee::{files, maps};

/// Bytes from `pthread_self()` up to the thread pointer in process `pid`;
/// `None` when they cannot be known (no glibc mapped, a libc without the
/// export).
pub fn pthread_below_tp(pid: u32, arch: Arch) -> Option<u32> {
    match arch {
        Arch::X86_64 => Some(0),
        Arch::Aarch64 => {
            let mappings = maps::read_raw(pid).ok()?;
            let libc = mappings.iter().find(|m| {
                m.is_file()
                    && m.path
                        .as_deref()
                        .and_then(Path::file_name)
                        .is_some_and(|n| n.to_string_lossy().starts_with("libc.so"))
            })?;
            let path = files::open(pid, libc).ok()?;
            sizeof_pthread(&std::fs::read(path).ok()?)
        }
    }
}

/// `_thread_db_sizeof_pthread` of a glibc `libc.so.6` image.
pub fn sizeof_pthread(data: &[u8]) -> Option<u32> {
    let file = object::File::parse(data).ok()?;
    let symbol = file
        .dynamic_symbols()
        .chain(file.symbols())
        .find(|s| s.name() == Ok("_thread_db_sizeof_pthread"))?;
    let addr = symbol.address();
    let offset = file.segments().find_map(|seg| {
        let (start, size) = (seg.address(), seg.size());
        let (file_offset, file_size) = seg.file_range();
        (addr >= start && addr + 4 <= start + size.min(file_size))
            .then(|| file_offset + (addr - start))
    })?;
    let bytes = data.get(offset as usize..offset as usize + 4)?;
    let size = u32::from_le_bytes(bytes.try_into().ok()?);
    // A struct pthread is some hundreds of bytes to a few KiB.
    (256..=16384).contains(&size).then_some(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_sizeof_pthread_from_real_glibcs() {
        let mut seen = 0;
        for path in [
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/usr/aarch64-linux-gnu/lib/libc.so.6",
        ] {
            let Ok(data) = std::fs::read(path) else {
                continue;
            };
            let size = sizeof_pthread(&data).expect("libc exports _thread_db_sizeof_pthread");
            assert!(size.is_multiple_of(8), "{path}: {size}");
            seen += 1;
        }
        if seen == 0 {
            eprintln!("skipping: no glibc found");
        }
    }

    #[test]
    fn x86_needs_no_libc_and_garbage_is_none() {
        assert_eq!(pthread_below_tp(u32::MAX, Arch::X86_64), Some(0));
        assert_eq!(pthread_below_tp(u32::MAX, Arch::Aarch64), None);
        assert_eq!(sizeof_pthread(b"not an elf"), None);
    }
}
