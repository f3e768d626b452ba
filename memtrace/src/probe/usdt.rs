//! USDT probes (`<sys/sdt.h>`): the `.note.stapsdt` notes of an ELF object,
//! where each probe sits in the file (what a uprobe attaches to), its
//! semaphore (the kernel's uprobe reference counter raises it while a probe
//! is attached) and its x86-64 argument specs (`-8@%rbp`, `8@-56(%rbp)`,
//! `-4@$5`), decoded into what the eBPF side reads.
//!
//! Pure: bytes in, probes or a typed error out; never a panic on malformed
//! input (`fuzz/fuzz_targets/usdt_parse.rs`).

use std::fmt;
use std::path::Path;

use object::{Object, ObjectSection, ObjectSegment, SegmentFlags};

/// ELF note type of a stapsdt note (`NT_STAPSDT`).
const NT_STAPSDT: u32 = 3;
/// Note owner name of stapsdt notes.
const NOTE_NAME: &[u8] = b"stapsdt";
/// ELF `PF_X`.
const PF_X: u32 = 1;

/// Why an object's USDT notes could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UsdtError {
    #[error("not an ELF object: {0}")]
    NotElf(String),
    #[error("malformed .note.stapsdt at byte {offset}: {what}")]
    Malformed { offset: usize, what: &'static str },
    #[error("probe {provider}:{name} at {pc:#x} lies in no loaded segment or section")]
    Unmapped {
        provider: String,
        name: String,
        pc: u64,
    },
}

/// Why one argument spec could not be decoded.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ArgError {
    #[error("bad size in {0:?} (1, 2, 4 or 8 bytes, negative for signed)")]
    Size(String),
    #[error("unknown register in {0:?}")]
    Register(String),
    #[error("unsupported operand {0:?} (index, symbolic or %rip-relative)")]
    Unsupported(String),
    #[error("bad number in {0:?}")]
    Number(String),
}

/// A general-purpose register, numbered as its slot in the kernel's x86-64
/// `struct pt_regs` (byte offset = index * 8), which is what the eBPF side reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reg(pub u8);

impl serde::Serialize for Reg {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.name())
    }
}

/// `struct pt_regs` slot names, in order (x86-64).
const PT_REGS: [&str; 21] = [
    "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi",
    "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss",
];

impl Reg {
    /// Its 64-bit name (`rax`).
    pub fn name(self) -> &'static str {
        PT_REGS.get(usize::from(self.0)).copied().unwrap_or("?")
    }

    /// Byte offset of the register in `struct pt_regs`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn pt_regs_offset(self) -> u16 {
        u16::from(self.0) * 8
    }

    /// The register a name (any width: `%al`, `%ax`, `%eax`, `%rax`, `%r8d`)
    /// is part of; the high-byte registers (`%ah`) and `%rip` are not offered.
    pub fn parse(name: &str) -> Option<Reg> {
        let name = name.strip_prefix('%')?;
        let full = match name {
            "rax" | "eax" | "ax" | "al" => "rax",
            "rbx" | "ebx" | "bx" | "bl" => "rbx",
            "rcx" | "ecx" | "cx" | "cl" => "rcx",
            "rdx" | "edx" | "dx" | "dl" => "rdx",
            "rsi" | "esi" | "si" | "sil" => "rsi",
            "rdi" | "edi" | "di" | "dil" => "rdi",
            "rbp" | "ebp" | "bp" | "bpl" => "rbp",
            "rsp" | "esp" | "sp" | "spl" => "rsp",
            other => {
                let digits = other.strip_prefix('r')?;
                let end = digits
                    .find(|c: char| !c.is_ascii_digit())
                    .unwrap_or(digits.len());
                let (number, suffix) = digits.split_at(end);
                if !matches!(suffix, "" | "d" | "w" | "b" | "l") {
                    return None;
                }
                match number {
                    "8" => "r8",
                    "9" => "r9",
                    "10" => "r10",
                    "11" => "r11",
                    "12" => "r12",
                    "13" => "r13",
                    "14" => "r14",
                    "15" => "r15",
                    _ => return None,
                }
            }
        };
        let index = PT_REGS.iter().position(|r| *r == full)?;
        u8::try_from(index).ok().map(Reg)
    }
}

/// Where an argument's value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ArgLocation {
    /// In a register (its low `size` bytes).
    Register { reg: Reg },
    /// In memory at `reg + offset`.
    Memory { reg: Reg, offset: i64 },
    /// A constant.
    Constant { value: i64 },
}

/// One decoded argument spec.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct UsdtArg {
    /// Bytes of the value: 1, 2, 4 or 8.
    pub size: u8,
    /// Sign-extended from `size` bytes (a negative size in the spec).
    pub signed: bool,
    pub location: ArgLocation,
}

impl fmt::Display for UsdtArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ty = if self.signed { 'i' } else { 'u' };
        let bits = u16::from(self.size) * 8;
        match self.location {
            ArgLocation::Register { reg } => write!(f, "{ty}{bits} %{}", reg.name()),
            ArgLocation::Memory { reg, offset } => {
                write!(f, "{ty}{bits} {offset}(%{})", reg.name())
            }
            ArgLocation::Constant { value } => write!(f, "{ty}{bits} ${value}"),
        }
    }
}

/// Decodes one x86-64 argument spec (`N@OPERAND`; a spec without `N@` is
/// taken as 8 unsigned bytes, as the oldest sdt.h wrote them).
pub fn decode_arg(spec: &str) -> Result<UsdtArg, ArgError> {
    let (size, operand) = match spec.split_once('@') {
        Some((size, operand)) => {
            let size: i8 = size.parse().map_err(|_| ArgError::Size(spec.to_string()))?;
            (size, operand)
        }
        None => (8, spec),
    };
    let signed = size < 0;
    let size = size.unsigned_abs();
    if !matches!(size, 1 | 2 | 4 | 8) {
        return Err(ArgError::Size(spec.to_string()));
    }
    let location = if let Some(value) = operand.strip_prefix('$') {
        ArgLocation::Constant {
            value: parse_int(value).ok_or_else(|| ArgError::Number(spec.to_string()))?,
        }
    } else if operand.starts_with('%') {
        ArgLocation::Register {
            reg: Reg::parse(operand).ok_or_else(|| ArgError::Register(spec.to_string()))?,
        }
    } else if let Some((offset, rest)) = operand.split_once('(') {
        let inner = rest
            .strip_suffix(')')
            .ok_or_else(|| ArgError::Unsupported(spec.to_string()))?;
        if inner.contains(',') || inner == "%rip" || inner == "%eip" {
            return Err(ArgError::Unsupported(spec.to_string()));
        }
        let offset = if offset.is_empty() {
            0
        } else {
            parse_int(offset).ok_or_else(|| ArgError::Unsupported(spec.to_string()))?
        };
        ArgLocation::Memory {
            reg: Reg::parse(inner).ok_or_else(|| ArgError::Register(spec.to_string()))?,
            offset,
        }
    } else {
        return Err(ArgError::Unsupported(spec.to_string()));
    };
    Ok(UsdtArg {
        size,
        signed,
        location,
    })
}

/// A decimal or `0x` hexadecimal integer, optionally negative.
fn parse_int(text: &str) -> Option<i64> {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    let magnitude = match digits
        .strip_prefix("0x")
        .or_else(|| digits.strip_prefix("0X"))
    {
        Some(hex) => u64::from_str_radix(hex, 16).ok()?,
        None => digits.parse::<u64>().ok()?,
    };
    if negative {
        0i64.checked_sub_unsigned(magnitude)
    } else {
        i64::try_from(magnitude).ok()
    }
}

/// Decodes an argument string (specs separated by spaces).
pub fn decode_args(text: &str) -> Result<Vec<UsdtArg>, ArgError> {
    text.split_ascii_whitespace().map(decode_arg).collect()
}

/// One stapsdt note as written, before any address adjustment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawNote {
    pub pc: u64,
    pub base: u64,
    pub semaphore: u64,
    pub provider: String,
    pub name: String,
    pub args: String,
}

/// Parses the contents of a `.note.stapsdt` section. Notes of other owners
/// or types are skipped; a truncated or inconsistent note is an error.
pub fn parse_notes(
    data: &[u8],
    little_endian: bool,
    is_64: bool,
) -> Result<Vec<RawNote>, UsdtError> {
    let word = |bytes: &[u8]| -> u64 {
        match bytes.len() {
            4 => {
                let b = [bytes[0], bytes[1], bytes[2], bytes[3]];
                u64::from(if little_endian {
                    u32::from_le_bytes(b)
                } else {
                    u32::from_be_bytes(b)
                })
            }
            _ => {
                let mut b = [0u8; 8];
                b.copy_from_slice(&bytes[..8]);
                if little_endian {
                    u64::from_le_bytes(b)
                } else {
                    u64::from_be_bytes(b)
                }
            }
        }
    };
    let align4 = |n: usize| n.checked_add(3).map(|n| n & !3);
    let addr_size = if is_64 { 8 } else { 4 };
    let mut notes = Vec::new();
    let mut at = 0usize;
    while at < data.len() {
        let malformed = |what| UsdtError::Malformed { offset: at, what };
        let header = data
            .get(at..at + 12)
            .ok_or_else(|| malformed("truncated header"))?;
        let name_size = usize::try_from(word(&header[0..4])).map_err(|_| malformed("size"))?;
        let desc_size = usize::try_from(word(&header[4..8])).map_err(|_| malformed("size"))?;
        let kind = word(&header[8..12]);
        let name_start = at + 12;
        let desc_start = align4(
            name_start
                .checked_add(name_size)
                .ok_or_else(|| malformed("size"))?,
        )
        .ok_or_else(|| malformed("size"))?;
        let desc_end = desc_start
            .checked_add(desc_size)
            .ok_or_else(|| malformed("size"))?;
        let next = align4(desc_end).ok_or_else(|| malformed("size"))?;
        let name = data
            .get(name_start..name_start + name_size)
            .ok_or_else(|| malformed("name runs past the section"))?;
        let desc = data
            .get(desc_start..desc_end)
            .ok_or_else(|| malformed("descriptor runs past the section"))?;
        let owner = name.strip_suffix(b"\0").unwrap_or(name);
        if owner == NOTE_NAME && kind == u64::from(NT_STAPSDT) {
            if desc.len() < 3 * addr_size {
                return Err(malformed("descriptor shorter than its three addresses"));
            }
            let pc = word(&desc[..addr_size]);
            let base = word(&desc[addr_size..2 * addr_size]);
            let semaphore = word(&desc[2 * addr_size..3 * addr_size]);
            let mut strings = desc[3 * addr_size..].split(|b| *b == 0);
            let mut text = |what| -> Result<String, UsdtError> {
                let bytes = strings.next().ok_or_else(|| malformed(what))?;
                String::from_utf8(bytes.to_vec()).map_err(|_| malformed("text is not UTF-8"))
            };
            let provider = text("no provider")?;
            let name = text("no name")?;
            let args = text("no argument string")?;
            // The argument string must be NUL-terminated inside the descriptor.
            if strings.next().is_none() {
                return Err(malformed("argument string not terminated"));
            }
            if provider.is_empty() || name.is_empty() {
                return Err(malformed("empty provider or name"));
            }
            notes.push(RawNote {
                pc,
                base,
                semaphore,
                provider,
                name,
                args,
            });
        }
        if next <= at {
            return Err(malformed("size"));
        }
        at = next;
    }
    Ok(notes)
}

/// A USDT probe of an object, placed in its file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsdtProbe {
    pub provider: String,
    pub name: String,
    /// Virtual address of the probe's instruction (after `.stapsdt.base` adjustment).
    pub pc: u64,
    /// File offset of that instruction: what a uprobe attaches to.
    pub file_offset: u64,
    /// Virtual address of the semaphore (an `unsigned short`), if the probe has one.
    pub semaphore: Option<u64>,
    /// File offset of the semaphore: the uprobe's `ref_ctr_offset`.
    pub semaphore_offset: Option<u64>,
    /// The argument string as written in the note.
    pub args_text: String,
    /// The decoded arguments, or why they could not be decoded.
    pub args: Result<Vec<UsdtArg>, ArgError>,
}

impl UsdtProbe {
    /// `provider:name`.
    pub fn full_name(&self) -> String {
        format!("{}:{}", self.provider, self.name)
    }
}

/// The USDT probes of the ELF object in `data`, in note order (a probe
/// named at several sites appears once per site).
pub fn parse(data: &[u8]) -> Result<Vec<UsdtProbe>, UsdtError> {
    let file = object::File::parse(data).map_err(|err| UsdtError::NotElf(err.to_string()))?;
    let Some(section) = file.section_by_name(".note.stapsdt") else {
        return Ok(Vec::new());
    };
    let notes_data = section.data().map_err(|_| UsdtError::Malformed {
        offset: 0,
        what: "section data out of the file",
    })?;
    let notes = parse_notes(notes_data, file.is_little_endian(), file.is_64())?;
    let stapsdt_base = file.section_by_name(".stapsdt.base").map(|s| s.address());
    // Loaded segments: (vaddr, file offset, file size, executable).
    let segments: Vec<(u64, u64, u64, bool)> = file
        .segments()
        .map(|segment| {
            let (offset, file_size) = segment.file_range();
            let executable = match segment.flags() {
                SegmentFlags::Elf { p_flags } => p_flags & PF_X != 0,
                _ => true,
            };
            (segment.address(), offset, file_size, executable)
        })
        .collect();
    let sections: Vec<(u64, u64, u64)> = file
        .sections()
        .filter_map(|s| {
            let (offset, size) = s.file_range()?;
            (s.address() != 0).then_some((s.address(), size, offset))
        })
        .collect();
    // A virtual address to its file offset: by the loaded segment holding
    // it (its file part), else by a section (objects without program headers).
    let to_offset = |addr: u64, want_exec: bool| -> Option<u64> {
        if !segments.is_empty() {
            return segments
                .iter()
                .find_map(|&(vaddr, offset, file_size, exec)| {
                    let delta = addr.checked_sub(vaddr)?;
                    (delta < file_size && (exec || !want_exec))
                        .then(|| offset.checked_add(delta))?
                });
        }
        sections.iter().find_map(|&(vaddr, size, offset)| {
            let delta = addr.checked_sub(vaddr)?;
            (delta < size).then(|| offset.checked_add(delta))?
        })
    };
    let mut probes = Vec::with_capacity(notes.len());
    for note in notes {
        // sdt.h records the link-time address of `.stapsdt.base` in each
        // note; prelinking or relinking moves it, so the pc moves with it.
        let pc = match stapsdt_base {
            Some(actual) if note.base != 0 => note.pc.wrapping_add(actual.wrapping_sub(note.base)),
            _ => note.pc,
        };
        let file_offset = to_offset(pc, true).ok_or_else(|| UsdtError::Unmapped {
            provider: note.provider.clone(),
            name: note.name.clone(),
            pc,
        })?;
        let semaphore = (note.semaphore != 0).then_some(note.semaphore);
        let semaphore_offset = semaphore.and_then(|addr| to_offset(addr, false));
        let args = decode_args(&note.args);
        probes.push(UsdtProbe {
            provider: note.provider,
            name: note.name,
            pc,
            file_offset,
            semaphore,
            semaphore_offset,
            args_text: note.args,
            args,
        });
    }
    Ok(probes)
}

/// Errors reading a file's probes.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Usdt { path: String, source: UsdtError },
}

/// The USDT probes of the file at `path`.
pub fn read(path: &Path) -> Result<Vec<UsdtProbe>, ReadError> {
    let data = std::fs::read(path).map_err(|source| ReadError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse(&data).map_err(|source| ReadError::Usdt {
        path: path.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(name: &str) -> Reg {
        Reg::parse(name).expect(name)
    }

    #[test]
    fn register_aliases_name_one_register() {
        for (names, full) in [
            (&["%al", "%ax", "%eax", "%rax"][..], "rax"),
            (&["%dl", "%dx", "%edx", "%rdx"][..], "rdx"),
            (&["%sil", "%si", "%esi", "%rsi"][..], "rsi"),
            (&["%dil", "%di", "%edi", "%rdi"][..], "rdi"),
            (&["%bpl", "%bp", "%ebp", "%rbp"][..], "rbp"),
            (&["%spl", "%sp", "%esp", "%rsp"][..], "rsp"),
            (&["%r8b", "%r8w", "%r8d", "%r8"][..], "r8"),
            (&["%r12b", "%r12w", "%r12d", "%r12", "%r12l"][..], "r12"),
            (&["%r15"][..], "r15"),
        ] {
            for name in names {
                assert_eq!(reg(name).name(), full, "{name}");
            }
        }
        assert_eq!(reg("%rdi").pt_regs_offset(), 112);
        assert_eq!(reg("%rax").pt_regs_offset(), 80);
        assert_eq!(reg("%rsp").pt_regs_offset(), 152);
        assert_eq!(reg("%r15").pt_regs_offset(), 0);
        for bad in ["%ah", "%rip", "%r16", "%r7", "rax", "%", "%xmm0", "%r8q"] {
            assert_eq!(Reg::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn decodes_pytorch_argument_specs() {
        // libc10_cuda.so's two pytorch:malloc sites (DESIGN.md, USDT).
        let args = decode_args("-8@%rbp -1@%al -8@%r12 -8@56(%rsp)").expect("decodes");
        assert_eq!(
            args,
            vec![
                UsdtArg {
                    size: 8,
                    signed: true,
                    location: ArgLocation::Register { reg: reg("%rbp") }
                },
                UsdtArg {
                    size: 1,
                    signed: true,
                    location: ArgLocation::Register { reg: reg("%rax") }
                },
                UsdtArg {
                    size: 8,
                    signed: true,
                    location: ArgLocation::Register { reg: reg("%r12") }
                },
                UsdtArg {
                    size: 8,
                    signed: true,
                    location: ArgLocation::Memory {
                        reg: reg("%rsp"),
                        offset: 56
                    }
                },
            ]
        );
        let args = decode_args("-8@%rax -1@%dl -8@%r14 -8@-56(%rbp)").expect("decodes");
        assert_eq!(
            args[3].location,
            ArgLocation::Memory {
                reg: reg("%rbp"),
                offset: -56
            }
        );
        assert_eq!(args[1].to_string(), "i8 %rdx");
        assert_eq!(args[3].to_string(), "i64 -56(%rbp)");
    }

    #[test]
    fn decodes_sizes_constants_and_memory_forms() {
        let arg = decode_arg("4@$-5").expect("constant");
        assert_eq!(
            (arg.size, arg.signed, arg.location),
            (4, false, ArgLocation::Constant { value: -5 })
        );
        assert_eq!(
            decode_arg("-2@$0x10").expect("hex").location,
            ArgLocation::Constant { value: 16 }
        );
        assert_eq!(
            decode_arg("8@(%rdi)").expect("no offset").location,
            ArgLocation::Memory {
                reg: reg("%rdi"),
                offset: 0
            }
        );
        let old = decode_arg("%rsi").expect("sizeless");
        assert_eq!((old.size, old.signed), (8, false));
        for bad in [
            "3@%rax",
            "16@%rax",
            "x@%rax",
            "8@%ah",
            "8@foo(%rip)",
            "8@8(%rip)",
            "8@(%rax,%rdx,8)",
            "8@$sym",
            "8@12",
            "8@-8(%rbp",
            "-128@%rax",
            "8@$99999999999999999999",
        ] {
            assert!(decode_arg(bad).is_err(), "{bad}");
        }
        assert_eq!(decode_args("").expect("none"), vec![]);
    }

    fn note(name: &[u8], kind: u32, desc: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&u32::try_from(name.len()).expect("len").to_le_bytes());
        out.extend_from_slice(&u32::try_from(desc.len()).expect("len").to_le_bytes());
        out.extend_from_slice(&kind.to_le_bytes());
        out.extend_from_slice(name);
        while out.len() % 4 != 0 {
            out.push(0);
        }
        out.extend_from_slice(desc);
        while out.len() % 4 != 0 {
            out.push(0);
        }
        out
    }

    fn desc(pc: u64, base: u64, sema: u64, strings: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        for word in [pc, base, sema] {
            out.extend_from_slice(&word.to_le_bytes());
        }
        out.extend_from_slice(strings);
        out
    }

    #[test]
    fn parses_raw_notes_and_skips_foreign_ones() {
        let mut data = note(b"GNU\0", 3, &[1, 2, 3, 4]);
        data.extend(note(
            b"stapsdt\0",
            3,
            &desc(0x1139, 0x2004, 0x4010, b"pytorch\0free\0-8@%rdi\0"),
        ));
        data.extend(note(b"stapsdt\0", 3, &desc(0x1200, 0, 0, b"p\0n\0\0")));
        let notes = parse_notes(&data, true, true).expect("parses");
        assert_eq!(notes.len(), 2);
        assert_eq!(
            notes[0],
            RawNote {
                pc: 0x1139,
                base: 0x2004,
                semaphore: 0x4010,
                provider: "pytorch".into(),
                name: "free".into(),
                args: "-8@%rdi".into(),
            }
        );
        assert_eq!(notes[1].args, "");
    }

    #[test]
    fn malformed_notes_are_errors() {
        let good = note(b"stapsdt\0", 3, &desc(1, 0, 0, b"p\0n\0a\0"));
        // Every truncation short of the descriptor's end is an error, never
        // a panic (the last note's padding may be missing).
        let desc_end = 12 + 8 + 24 + 6;
        assert!(parse_notes(&good[..desc_end], true, true).is_ok());
        for end in 1..desc_end {
            assert!(parse_notes(&good[..end], true, true).is_err(), "end {end}");
        }
        for strings in [&b"p\0n\0a"[..], b"p\0", b"\0n\0a\0", b"p\0n\xff\0a\0"] {
            let bad = note(b"stapsdt\0", 3, &desc(1, 0, 0, strings));
            assert!(parse_notes(&bad, true, true).is_err(), "{strings:?}");
        }
        let short = note(b"stapsdt\0", 3, &[0; 16]);
        assert!(parse_notes(&short, true, true).is_err());
        let mut huge = good.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_notes(&huge, true, true).is_err());
        assert!(parse(b"not an elf").is_err());
    }

    /// Builds `sources` with gcc and `<sys/sdt.h>` (systemtap-sdt-dev).
    fn build(sources: &[&str], flags: &[&str], tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("memtrace-usdt-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut command = std::process::Command::new("gcc");
        command.args(flags).arg("-O1");
        for (i, source) in sources.iter().enumerate() {
            let src = dir.join(format!("probe{i}.c"));
            std::fs::write(&src, source).expect("write source");
            command.arg(&src);
        }
        let out = dir.join("probe.out");
        let status = command.arg("-o").arg(&out).status().expect("gcc runs");
        assert!(
            status.success(),
            "gcc failed: is systemtap-sdt-dev installed?"
        );
        out
    }

    /// `demo:alloc` with a semaphore (in `.probes`, as sdt.h users declare it).
    const WITH_SEMAPHORE: &str = r#"
#define _SDT_HAS_SEMAPHORES 1
#include <sys/sdt.h>
__extension__ unsigned short demo_alloc_semaphore __attribute__((unused)) __attribute__((section(".probes")));
volatile long sink;
__attribute__((noinline)) void work(long p, int n) {
    if (demo_alloc_semaphore) sink = 1;
    DTRACE_PROBE2(demo, alloc, p, n);
}
"#;

    /// `demo:free` and `demo:tick` without.
    const WITHOUT: &str = r#"
#include <sys/sdt.h>
void work(long p, int n);
__attribute__((noinline)) void release(long p) {
    STAP_PROBE1(demo, free, p + 1);
    STAP_PROBE(demo, tick);
}
int main(void) { work(42, 7); release(42); return 0; }
"#;

    fn check_fixture(path: &Path) {
        let data = std::fs::read(path).expect("built");
        let probes = parse(&data).expect("parses");
        let names: Vec<String> = probes.iter().map(UsdtProbe::full_name).collect();
        assert_eq!(names, ["demo:alloc", "demo:free", "demo:tick"]);
        let alloc = &probes[0];
        assert!(alloc.semaphore.is_some() && alloc.semaphore_offset.is_some());
        assert_eq!(probes[1].semaphore, None);
        assert_eq!(alloc.args.as_ref().expect("decoded").len(), 2);
        assert_eq!(probes[2].args, Ok(vec![]));
        // The probe's instruction is a nop at the file offset.
        for probe in &probes {
            let byte = data[usize::try_from(probe.file_offset).expect("offset")];
            assert_eq!(byte, 0x90, "{}", probe.full_name());
        }
        // The semaphore's file offset holds its (zero) initial value in `.probes`.
        let sema = usize::try_from(alloc.semaphore_offset.expect("offset")).expect("offset");
        assert_eq!(&data[sema..sema + 2], &[0, 0]);
    }

    #[test]
    fn reads_probes_of_pie_and_non_pie_builds() {
        check_fixture(&build(
            &[WITH_SEMAPHORE, WITHOUT],
            &["-fPIE", "-pie"],
            "pie",
        ));
        let exec = build(
            &[WITH_SEMAPHORE, WITHOUT],
            &["-fno-pie", "-no-pie"],
            "nopie",
        );
        check_fixture(&exec);
        // Non-PIE: addresses are absolute, file offsets are not.
        let probes = read(&exec).expect("reads");
        assert!(probes[0].pc >= 0x400000 && probes[0].file_offset < 0x400000);
        let lib = build(&[WITH_SEMAPHORE, WITHOUT], &["-fPIC", "-shared"], "lib");
        check_fixture(&lib);
        for path in [&exec, &lib] {
            if let Some(dir) = path.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }

    #[test]
    fn stapsdt_base_moves_the_pc() {
        let path = build(&[WITH_SEMAPHORE, WITHOUT], &["-fPIE", "-pie"], "base");
        let mut data = std::fs::read(&path).expect("built");
        let probe = parse(&data).expect("parses").remove(0);
        let file = object::File::parse(&*data).expect("elf");
        let base = file
            .section_by_name(".stapsdt.base")
            .expect(".stapsdt.base")
            .address();
        // As if the object had been prelinked 0x10 lower than the note says:
        // the note's recorded base is 0x10 below the section's address.
        let mut needle = probe.pc.to_le_bytes().to_vec();
        needle.extend_from_slice(&base.to_le_bytes());
        let at = data
            .windows(16)
            .position(|w| w == needle.as_slice())
            .expect("the note's pc and base");
        data[at + 8..at + 16].copy_from_slice(&(base - 0x10).to_le_bytes());
        let moved = parse(&data).expect("parses").remove(0);
        assert_eq!(moved.pc, probe.pc + 0x10);
        assert_eq!(moved.file_offset, probe.file_offset + 0x10);
        assert_eq!(moved.semaphore, probe.semaphore);
        if let Some(dir) = path.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
