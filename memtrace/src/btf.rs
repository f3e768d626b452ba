//! The few kernel structure offsets memtrace's eBPF programs need, read from
//! the running kernel's BTF (`/sys/kernel/btf/vmlinux`): the uprobe return
//! instances the unwinder follows, and the task's user thread pointer
//! (`thread.fsbase` on x86-64, `thread.uw.tp_value` on arm64), from which
//! the Python frame reader finds a thread's `pthread_t`.
//!
//! A function with a return probe has its return address replaced by the
//! kernel's uretprobe trampoline while it runs; a stack walked through such a
//! frame (a `malloc` inside a traced `cudaMalloc`) meets the trampoline
//! instead of the caller. The kernel keeps the real address in the task's
//! `uprobe_task.return_instances` list (`orig_ret_vaddr`, with the stack
//! slot it came from in `stack`); the eBPF unwinder reads it from there with
//! these offsets, as the kernel's own stack walker does.
//!
//! BTF is a small, stable format (types, then strings); this reader walks the
//! type section once and knows only what finding a struct member needs. It
//! never panics on a malformed file: a missing piece is `None`.

use std::collections::HashMap;

/// Offsets (bytes) of the fields the trampoline fix-up follows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UprobeOffsets {
    /// `task_struct.utask`
    pub task_utask: u32,
    /// `uprobe_task.return_instances`
    pub utask_return_instances: u32,
    /// `return_instance.stack`
    pub ri_stack: u32,
    /// `return_instance.orig_ret_vaddr`
    pub ri_orig_ret_vaddr: u32,
    /// `return_instance.next`
    pub ri_next: u32,
}

/// Reads the offsets from the running kernel's BTF.
pub fn uprobe_offsets() -> Option<UprobeOffsets> {
    let data = std::fs::read("/sys/kernel/btf/vmlinux").ok()?;
    uprobe_offsets_in(&data)
}

/// The offset of a task's user thread pointer in the running kernel's
/// `task_struct` ([`thread_pointer_offset_in`]).
pub fn thread_pointer_offset() -> Option<u64> {
    thread_pointer_offset_in(
        &std::fs::read("/sys/kernel/btf/vmlinux").ok()?,
        crate::arch::Arch::HOST,
    )
}

/// The offset of a task's user thread pointer in `task_struct`, in a BTF
/// blob of a kernel for `arch`: `thread.fsbase` on x86-64,
/// `thread.uw.tp_value` on arm64 (`tp_value` is the first member of the
/// anonymous `uw` struct).
pub fn thread_pointer_offset_in(data: &[u8], arch: crate::arch::Arch) -> Option<u64> {
    let btf = Btf::parse(data)?;
    let thread = btf.member_offset("task_struct", "thread")?;
    let member = match arch {
        crate::arch::Arch::X86_64 => "fsbase",
        crate::arch::Arch::Aarch64 => "uw",
    };
    let pointer = btf.member_offset("thread_struct", member)?;
    Some(u64::from(thread) + u64::from(pointer))
}

/// Reads the offsets from a BTF blob.
pub fn uprobe_offsets_in(data: &[u8]) -> Option<UprobeOffsets> {
    let btf = Btf::parse(data)?;
    Some(UprobeOffsets {
        task_utask: btf.member_offset("task_struct", "utask")?,
        utask_return_instances: btf.member_offset("uprobe_task", "return_instances")?,
        ri_stack: btf.member_offset("return_instance", "stack")?,
        ri_orig_ret_vaddr: btf.member_offset("return_instance", "orig_ret_vaddr")?,
        ri_next: btf.member_offset("return_instance", "next")?,
    })
}

/// A struct member: its name and bit offset.
struct Member {
    name: u32,
    bits: u32,
}

struct Btf<'a> {
    strings: &'a [u8],
    /// Struct name offset -> members.
    structs: HashMap<u32, Vec<Member>>,
}

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    let bytes = data.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes(bytes.try_into().ok()?))
}

impl<'a> Btf<'a> {
    fn parse(data: &'a [u8]) -> Option<Self> {
        const MAGIC: u16 = 0xeb9f;
        if data.len() < 24 || u16::from_le_bytes([data[0], data[1]]) != MAGIC {
            return None;
        }
        let hdr_len = u32_at(data, 4)? as usize;
        let type_off = u32_at(data, 8)? as usize;
        let type_len = u32_at(data, 12)? as usize;
        let str_off = u32_at(data, 16)? as usize;
        let str_len = u32_at(data, 20)? as usize;
        let types_start = hdr_len.checked_add(type_off)?;
        let types = data.get(types_start..types_start.checked_add(type_len)?)?;
        let strings_start = hdr_len.checked_add(str_off)?;
        let strings = data.get(strings_start..strings_start.checked_add(str_len)?)?;
        let mut structs = HashMap::new();
        let mut at = 0usize;
        while at + 12 <= types.len() {
            let name = u32_at(types, at)?;
            let info = u32_at(types, at + 4)?;
            let kind = (info >> 24) & 0x1f;
            let vlen = (info & 0xffff) as usize;
            let kind_flag = info >> 31 != 0;
            at += 12;
            let extra = match kind {
                1 | 14 | 17 => 4, // INT, VAR, DECL_TAG
                3 => 12,          // ARRAY
                4 | 5 => {
                    // STRUCT, UNION: members of 12 bytes
                    let mut members = Vec::with_capacity(vlen);
                    for i in 0..vlen {
                        let m = at + i * 12;
                        let offset = u32_at(types, m + 8)?;
                        members.push(Member {
                            name: u32_at(types, m)?,
                            bits: if kind_flag {
                                offset & 0x00ff_ffff
                            } else {
                                offset
                            },
                        });
                    }
                    if kind == 4 && name != 0 {
                        structs.entry(name).or_insert(members);
                    }
                    vlen * 12
                }
                6 | 13 => vlen * 8,        // ENUM, FUNC_PROTO
                15 | 19 => vlen * 12,      // DATASEC, ENUM64
                2 | 7..=12 | 16 | 18 => 0, // PTR, FWD, TYPEDEF, qualifiers, FUNC, FLOAT, TYPE_TAG
                _ => return None,
            };
            at = at.checked_add(extra)?;
        }
        Some(Btf { strings, structs })
    }

    fn string(&self, offset: u32) -> Option<&'a [u8]> {
        let rest = self.strings.get(offset as usize..)?;
        let end = rest.iter().position(|&b| b == 0)?;
        Some(&rest[..end])
    }

    fn member_offset(&self, strukt: &str, member: &str) -> Option<u32> {
        let (_, members) = self
            .structs
            .iter()
            .find(|(&name, _)| self.string(name) == Some(strukt.as_bytes()))?;
        let found = members
            .iter()
            .find(|m| self.string(m.name) == Some(member.as_bytes()))?;
        (found.bits % 8 == 0).then_some(found.bits / 8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_running_kernels_uprobe_structs() {
        let Ok(data) = std::fs::read("/sys/kernel/btf/vmlinux") else {
            eprintln!("no kernel BTF here");
            return;
        };
        let offsets = uprobe_offsets_in(&data).expect("uprobe structs in BTF");
        assert!(offsets.task_utask > 0);
        assert_ne!(offsets.ri_stack, offsets.ri_orig_ret_vaddr);
        assert_ne!(offsets.ri_next, offsets.ri_stack);
    }

    #[test]
    fn finds_the_thread_pointer_in_this_kernel() {
        let Ok(data) = std::fs::read("/sys/kernel/btf/vmlinux") else {
            eprintln!("skipping: this kernel has no BTF");
            return;
        };
        let offset = thread_pointer_offset_in(&data, crate::arch::Arch::HOST)
            .expect("task_struct's thread pointer");
        // thread_struct sits at the end of a task_struct of several KiB.
        assert!(offset > 1024 && offset < 65536, "{offset}");
    }

    #[test]
    fn malformed_btf_is_none() {
        assert_eq!(thread_pointer_offset_in(b"", crate::arch::Arch::HOST), None);
        assert!(uprobe_offsets_in(b"").is_none());
        assert!(
            uprobe_offsets_in(&[0x9f, 0xeb, 1, 0, 24, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]).is_none()
        );
        let mut header = vec![0x9f, 0xeb, 1, 0];
        header.extend_from_slice(&24u32.to_le_bytes());
        header.extend_from_slice(&[0; 16]);
        assert!(uprobe_offsets_in(&header).is_none(), "no such structs");
    }
}
