//! Turning a kernel-read Python frame (code object pointer, instruction
//! pointer) into (qualified name, file, line) by reading the code object
//! from the target's memory (`/proc/PID/mem`, read only) when its stack is
//! first seen. Code objects are cached per (process, address) with their
//! name, file and line-table pointers as a fingerprint, checked at each use:
//! a code object freed and another made at the same address (short-lived
//! `exec` code during imports does that) is read again. Everything
//! read is bounded and checked: a bad pointer or odd object gives a frame
//! with what could be read and a reason, never a panic.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;

use super::layout::{Instr, Layout};
use super::lines::{self, TableFormat};

/// Longest string or line table read from a code object.
const MAX_READ: u64 = 1 << 16;

/// What a code object says of itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodeInfo {
    pub name: String,
    pub file: String,
    pub firstlineno: i32,
    pub table: Vec<u8>,
}

/// Reads memory of one process.
pub trait Memory {
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool;
}

/// `/proc/PID/mem`.
pub struct ProcMem(File);

impl ProcMem {
    pub fn open(pid: u32) -> std::io::Result<Self> {
        File::open(format!("/proc/{pid}/mem")).map(ProcMem)
    }
}

impl Memory for ProcMem {
    fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
        self.0.read_exact_at(buf, addr).is_ok()
    }
}

fn read_u64(mem: &dyn Memory, addr: u64) -> Option<u64> {
    let mut buf = [0u8; 8];
    mem.read(addr, &mut buf).then(|| u64::from_le_bytes(buf))
}

fn read_u32(mem: &dyn Memory, addr: u64) -> Option<u32> {
    let mut buf = [0u8; 4];
    mem.read(addr, &mut buf).then(|| u32::from_le_bytes(buf))
}

/// A `str` object's text (compact objects: every code object's names are).
pub fn read_unicode(mem: &dyn Memory, layout: &Layout, obj: u64) -> Option<String> {
    let length = read_u64(mem, obj.wrapping_add(layout.unicode_length))?;
    let state = read_u32(mem, obj.wrapping_add(layout.unicode_state))?;
    let kind = (state >> 2) & 7;
    let compact = (state >> 5) & 1 == 1;
    let ascii = (state >> 6) & 1 == 1;
    if !compact || length > MAX_READ {
        return None;
    }
    let data = obj.wrapping_add(if ascii {
        layout.unicode_ascii_data
    } else {
        layout.unicode_compact_data
    });
    let width = match kind {
        1 => 1,
        2 => 2,
        4 => 4,
        _ => return None,
    };
    let mut buf = vec![0u8; usize::try_from(length.checked_mul(width)?).ok()?];
    if !mem.read(data, &mut buf) {
        return None;
    }
    Some(match width {
        1 => buf.iter().map(|&b| char::from(b)).collect(),
        2 => buf
            .chunks_exact(2)
            .map(|c| char::from_u32(u32::from(u16::from_le_bytes([c[0], c[1]]))).unwrap_or('?'))
            .collect(),
        _ => buf
            .chunks_exact(4)
            .map(|c| char::from_u32(u32::from_le_bytes([c[0], c[1], c[2], c[3]])).unwrap_or('?'))
            .collect(),
    })
}

/// A `bytes` object's contents.
fn read_bytes(mem: &dyn Memory, layout: &Layout, obj: u64) -> Option<Vec<u8>> {
    let size = read_u64(mem, obj.wrapping_add(layout.bytes_size))?;
    if size > MAX_READ {
        return None;
    }
    let mut buf = vec![0u8; usize::try_from(size).ok()?];
    mem.read(obj.wrapping_add(layout.bytes_sval), &mut buf)
        .then_some(buf)
}

/// Reads a code object.
pub fn read_code(mem: &dyn Memory, layout: &Layout, code: u64) -> Option<CodeInfo> {
    let name_ptr = layout
        .code_qualname
        .and_then(|q| read_u64(mem, code.wrapping_add(q)))
        .filter(|&p| p != 0)
        .or_else(|| read_u64(mem, code.wrapping_add(layout.code_name)))?;
    let name = read_unicode(mem, layout, name_ptr)?;
    let file = read_u64(mem, code.wrapping_add(layout.code_filename))
        .and_then(|p| read_unicode(mem, layout, p))
        .unwrap_or_default();
    let firstlineno = read_u32(mem, code.wrapping_add(layout.code_firstlineno)).unwrap_or(0) as i32;
    let table = read_u64(mem, code.wrapping_add(layout.code_linetable))
        .and_then(|p| read_bytes(mem, layout, p))
        .unwrap_or_default();
    Some(CodeInfo {
        name,
        file,
        firstlineno,
        table,
    })
}

/// One resolved Python frame.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PyFrame {
    /// Qualified name (`Handler.handle`, `<module>`), or `?` when unreadable.
    pub name: String,
    pub file: Option<String>,
    pub line: Option<u32>,
}

/// The byte offset in `code` of the instruction a frame's raw instruction
/// field `instr` names (3.11+: a pointer into `co_code_adaptive`; before: the
/// `int f_lasti`, read with the next 4 bytes, -1 before the first).
pub fn instruction_offset(layout: &Layout, code: u64, instr: u64) -> u32 {
    match layout.instr {
        Instr::Pointer => {
            let start = code.wrapping_add(layout.code_adaptive);
            u32::try_from(instr.saturating_sub(start)).unwrap_or(u32::MAX)
        }
        Instr::LastiBytes => (instr as u32 as i32).max(0) as u32,
        Instr::LastiUnits => ((instr as u32 as i32).max(0) as u32).saturating_mul(2),
    }
}

/// The pointers that identify a code object's contents.
fn fingerprint(mem: &dyn Memory, layout: &Layout, code: u64) -> Option<[u64; 3]> {
    Some([
        read_u64(
            mem,
            code.wrapping_add(layout.code_qualname.unwrap_or(layout.code_name)),
        )?,
        read_u64(mem, code.wrapping_add(layout.code_filename))?,
        read_u64(mem, code.wrapping_add(layout.code_linetable))?,
    ])
}

/// Resolves frames of one process, caching code objects.
#[derive(Default)]
pub struct Resolver {
    codes: HashMap<(u32, u64), ([u64; 3], Option<CodeInfo>)>,
}

impl Resolver {
    /// Resolves `(code, instr)` of process `pid`; `None` when the code
    /// object could not be read.
    pub fn frame(
        &mut self,
        pid: u32,
        mem: &dyn Memory,
        layout: &Layout,
        code: u64,
        instr: u64,
    ) -> Option<PyFrame> {
        let print = fingerprint(mem, layout, code)?;
        let entry = self
            .codes
            .entry((pid, code))
            .or_insert_with(|| (print, read_code(mem, layout, code)));
        if entry.0 != print {
            *entry = (print, read_code(mem, layout, code));
        }
        let info = entry.1.as_ref()?;
        let format = TableFormat::for_minor(layout.minor)?;
        let offset = instruction_offset(layout, code, instr);
        Some(PyFrame {
            name: info.name.clone(),
            file: (!info.file.is_empty()).then(|| info.file.clone()),
            line: lines::line_at(format, &info.table, info.firstlineno, offset),
        })
    }

    /// Forgets the code objects of a process that exited.
    pub fn forget(&mut self, pid: u32) {
        self.codes.retain(|&(p, _), _| p != pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake address space: one contiguous buffer at `base`.
    struct Buffer {
        base: u64,
        bytes: Vec<u8>,
    }

    impl Memory for Buffer {
        fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
            let Some(start) = addr
                .checked_sub(self.base)
                .and_then(|s| usize::try_from(s).ok())
            else {
                return false;
            };
            match self.bytes.get(start..start + buf.len()) {
                Some(src) => {
                    buf.copy_from_slice(src);
                    true
                }
                None => false,
            }
        }
    }

    fn put(bytes: &mut [u8], at: u64, value: &[u8]) {
        bytes[at as usize..at as usize + value.len()].copy_from_slice(value);
    }

    fn ascii(bytes: &mut [u8], layout: &Layout, at: u64, text: &str) {
        put(
            bytes,
            at + layout.unicode_length,
            &(text.len() as u64).to_le_bytes(),
        );
        // compact | ascii, kind 1
        put(
            bytes,
            at + layout.unicode_state,
            &((1u32 << 2) | (1 << 5) | (1 << 6)).to_le_bytes(),
        );
        put(bytes, at + layout.unicode_ascii_data, text.as_bytes());
    }

    #[test]
    fn resolves_a_code_object_from_memory() {
        let layout = super::super::layout::for_minor(12).expect("3.12");
        let base = 0x10_0000u64;
        let mut bytes = vec![0u8; 4096];
        let (code, name, file, table) = (0u64, 1024u64, 2048u64, 3072u64);
        put(
            &mut bytes,
            code + layout.code_qualname.expect("3.12 has co_qualname"),
            &(base + name).to_le_bytes(),
        );
        put(
            &mut bytes,
            code + layout.code_filename,
            &(base + file).to_le_bytes(),
        );
        put(
            &mut bytes,
            code + layout.code_linetable,
            &(base + table).to_le_bytes(),
        );
        put(
            &mut bytes,
            code + layout.code_firstlineno,
            &7u32.to_le_bytes(),
        );
        ascii(&mut bytes, &layout, name, "Handler.handle");
        ascii(&mut bytes, &layout, file, "app.py");
        // Two one-line entries: units 0-1 at line 7 (delta 0), 2-3 at line 9 (delta 2).
        let lt = [0x80 | (10 << 3) | 1, 0, 0, 0x80 | (12 << 3) | 1, 0, 0];
        put(
            &mut bytes,
            table + layout.bytes_size,
            &(lt.len() as u64).to_le_bytes(),
        );
        put(&mut bytes, table + layout.bytes_sval, &lt);
        let mem = Buffer { base, bytes };
        let mut resolver = Resolver::default();
        let at = |unit: u64| base + code + layout.code_adaptive + 2 * unit;
        let frame = resolver
            .frame(1, &mem, &layout, base + code, at(3))
            .expect("readable");
        assert_eq!(
            frame,
            PyFrame {
                name: "Handler.handle".into(),
                file: Some("app.py".into()),
                line: Some(9)
            }
        );
        assert_eq!(
            resolver
                .frame(1, &mem, &layout, base + code, at(0))
                .and_then(|f| f.line),
            Some(7)
        );
        // An unreadable code object gives nothing (cached as such).
        assert_eq!(resolver.frame(1, &mem, &layout, 0xdead_0000, 0), None);
        resolver.forget(1);
        assert!(resolver.codes.is_empty());
    }

    #[test]
    fn lasti_before_3_11_is_an_int_offset() {
        let l38 = super::super::layout::for_minor(8).expect("3.8");
        let l310 = super::super::layout::for_minor(10).expect("3.10");
        // f_lasti is read with the next 4 bytes (f_lineno) above it.
        let raw = |lasti: i32| u64::from(lasti as u32) | (77u64 << 32);
        assert_eq!(instruction_offset(&l38, 0x1000, raw(14)), 14);
        assert_eq!(instruction_offset(&l310, 0x1000, raw(7)), 14);
        assert_eq!(instruction_offset(&l38, 0x1000, raw(-1)), 0);
        let l312 = super::super::layout::for_minor(12).expect("3.12");
        assert_eq!(instruction_offset(&l312, 0x1000, 0x1000 + 192 + 6), 6);
        // A new 3.11/3.12 frame points just before its first instruction.
        assert_eq!(instruction_offset(&l312, 0x1000, 0x1000 + 190), 0);
    }
}
