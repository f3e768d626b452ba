//! Where the kernel keeps a thread's `fs` base: the byte offset of
//! `task_struct.thread.fsbase`, read from the running kernel's BTF
//! (`/sys/kernel/btf/vmlinux`). On x86_64 the `fs` base of a user thread is
//! its `pthread_t` (glibc and musl point `%fs` at the thread's control
//! block), which CPython stores in every thread state as `thread_id` (3.8+):
//! with this offset the kernel finds the allocating thread's state on every
//! version and in any pid namespace, GIL held or not.
//!
//! A minimal BTF reader: the header, then type records walked by kind to
//! find two structs and their members. Malformed data gives `None`.

/// BTF kinds whose records are followed by `vlen` entries of this size.
fn trailing(kind: u32, vlen: u32) -> Option<usize> {
    let vlen = vlen as usize;
    Some(match kind {
        1 => 4,                    // INT
        2 | 7..=12 | 16 | 18 => 0, // PTR, FWD, TYPEDEF, VOLATILE, CONST, RESTRICT, FUNC, FLOAT, TYPE_TAG
        3 => 12,                   // ARRAY
        4 | 5 => 12 * vlen,        // STRUCT, UNION
        6 => 8 * vlen,             // ENUM
        13 => 8 * vlen,            // FUNC_PROTO
        14 => 4,                   // VAR
        15 => 12 * vlen,           // DATASEC
        17 => 4,                   // DECL_TAG
        19 => 12 * vlen,           // ENUM64
        _ => return None,
    })
}

struct Btf<'a> {
    types: &'a [u8],
    strings: &'a [u8],
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

impl<'a> Btf<'a> {
    fn parse(data: &'a [u8]) -> Option<Self> {
        if data.get(..2)? != [0x9f, 0xeb] {
            return None;
        }
        let hdr_len = u32_at(data, 4)? as usize;
        let type_off = u32_at(data, 8)? as usize;
        let type_len = u32_at(data, 12)? as usize;
        let str_off = u32_at(data, 16)? as usize;
        let str_len = u32_at(data, 20)? as usize;
        let body = data.get(hdr_len..)?;
        Some(Btf {
            types: body.get(type_off..type_off.checked_add(type_len)?)?,
            strings: body.get(str_off..str_off.checked_add(str_len)?)?,
        })
    }

    fn name(&self, off: u32) -> &'a [u8] {
        let rest = self.strings.get(off as usize..).unwrap_or(&[]);
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        &rest[..end]
    }

    /// Every type as (id, kind, name offset, vlen, kind_flag, position of its members).
    fn records(&self) -> Vec<(u32, u32, u32, u32, bool, usize)> {
        let mut out = Vec::new();
        let mut pos = 0;
        let mut id = 1;
        while pos + 12 <= self.types.len() {
            let (Some(name), Some(info)) = (u32_at(self.types, pos), u32_at(self.types, pos + 4))
            else {
                break;
            };
            let kind = (info >> 24) & 0x1f;
            let vlen = info & 0xffff;
            let Some(extra) = trailing(kind, vlen) else {
                break;
            };
            out.push((id, kind, name, vlen, info >> 31 == 1, pos + 12));
            pos += 12 + extra;
            id += 1;
        }
        out
    }
}

/// Byte offset of member `member` (and its type id) in the struct at `members`.
fn member(
    btf: &Btf<'_>,
    rec: (u32, u32, u32, u32, bool, usize),
    member: &str,
) -> Option<(u64, u32)> {
    let (_, _, _, vlen, kind_flag, at) = rec;
    for i in 0..vlen as usize {
        let m = at + 12 * i;
        if btf.name(u32_at(btf.types, m)?) == member.as_bytes() {
            let ty = u32_at(btf.types, m + 4)?;
            let mut bits = u32_at(btf.types, m + 8)?;
            if kind_flag {
                bits &= 0x00ff_ffff;
            }
            return (bits % 8 == 0).then_some((u64::from(bits / 8), ty));
        }
    }
    None
}

/// `offsetof(struct task_struct, thread.fsbase)` in a BTF blob.
pub fn fsbase_offset(data: &[u8]) -> Option<u64> {
    let btf = Btf::parse(data)?;
    let records = btf.records();
    let task = records
        .iter()
        .find(|r| r.1 == 4 && btf.name(r.2) == b"task_struct")?;
    let (thread_at, thread_ty) = member(&btf, *task, "thread")?;
    let thread = records.iter().find(|r| r.0 == thread_ty && r.1 == 4)?;
    let (fsbase_at, _) = member(&btf, *thread, "fsbase")?;
    Some(thread_at + fsbase_at)
}

/// The offset for the running kernel, if its BTF says.
pub fn running_kernel() -> Option<u64> {
    fsbase_offset(&std::fs::read("/sys/kernel/btf/vmlinux").ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_fsbase_in_this_kernel() {
        let Ok(data) = std::fs::read("/sys/kernel/btf/vmlinux") else {
            eprintln!("skipping: this kernel has no BTF");
            return;
        };
        let offset = fsbase_offset(&data).expect("task_struct.thread.fsbase");
        // thread_struct sits at the end of a task_struct of several KiB.
        assert!(offset > 1024 && offset < 65536, "{offset}");
    }

    #[test]
    fn bad_blobs_give_none() {
        assert_eq!(fsbase_offset(b""), None);
        assert_eq!(fsbase_offset(&[0x9f, 0xeb, 1, 0, 24, 0, 0, 0]), None);
        let mut header = vec![0x9f, 0xeb, 1, 0];
        for v in [24u32, 0, 12, 12, 1] {
            header.extend_from_slice(&v.to_le_bytes());
        }
        header.extend_from_slice(&[0u8; 13]);
        assert_eq!(fsbase_offset(&header), None);
    }
}
