//! USDT probes (`<sys/sdt.h>`): the `.note.stapsdt` notes of an ELF object,
//! where each probe sits in the file (what a uprobe attaches to), its
//! semaphore (the kernel's uprobe reference counter raises it while a probe
//! is attached) and its argument specs, decoded into what the eBPF side
//! reads: x86-64 (`-8@%rbp`, `8@-56(%rbp)`, `-4@$5`) and aarch64 (`8@x0`,
//! `-4@w1`, `8@[sp, 16]`, `-8@[x29, -8]`, `8@sp`, `-4@#12`, `8@12`). A spec
//! is decoded for the architecture of the object carrying it; objects of
//! another architecture than the one traced are refused by name
//! ([`read_for`]).
//!
//! Pure: bytes in, probes or a typed error out; never a panic on malformed
//! input (`fuzz/fuzz_targets/usdt_parse.rs`).

use std::fmt;
use std::path::Path;

use object::{Object, ObjectSection, ObjectSegment, SegmentFlags};

use crate::arch::Arch;

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
    #[error("an {machine} object, not {arch}: its probes are not attached")]
    ForeignArch { machine: String, arch: Arch },
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
    #[error("argument specs of {0} objects are not decoded")]
    Machine(String),
}

/// A general-purpose register, numbered as its slot in the kernel's
/// register frame for uprobes, which is what the eBPF side reads
/// (`ArgLoc::reg`; byte offset = slot * 8 for both):
/// - x86-64: the slot in `struct pt_regs` (`r15` = 0 ... `rdi` = 14,
///   `rsp` = 19);
/// - aarch64: `struct user_pt_regs { u64 regs[31]; u64 sp; u64 pc; u64
///   pstate; }`: slot `n` = `x<n>` (and `w<n>`) for `n` in 0..=30, slot 31 =
///   `sp` (pc at 256 is no operand).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reg {
    arch: Arch,
    slot: u8,
}

impl serde::Serialize for Reg {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.name())
    }
}

/// `struct pt_regs` slot names, in order (x86-64).
const PT_REGS: [&str; 21] = [
    "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi",
    "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss",
];

/// The aarch64 slot of `sp` in `struct user_pt_regs`.
const AARCH64_SP: u8 = 31;

impl Reg {
    /// The register's slot in the architecture's register frame.
    pub fn slot(self) -> u8 {
        self.slot
    }

    /// Its 64-bit name (`rax`, `x0`, `sp`).
    pub fn name(self) -> String {
        match self.arch {
            Arch::X86_64 => PT_REGS
                .get(usize::from(self.slot))
                .copied()
                .unwrap_or("?")
                .to_string(),
            Arch::Aarch64 if self.slot == AARCH64_SP => "sp".to_string(),
            Arch::Aarch64 => format!("x{}", self.slot),
        }
    }

    /// Byte offset of the register in `struct pt_regs` (x86-64) or
    /// `struct user_pt_regs` (aarch64).
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn pt_regs_offset(self) -> u16 {
        u16::from(self.slot) * 8
    }

    /// The register a name of `arch` is part of. x86-64: any width (`%al`,
    /// `%ax`, `%eax`, `%rax`, `%r8d`); the high-byte registers (`%ah`) and
    /// `%rip` are not offered. aarch64: `x0`..`x30`, `w0`..`w30` (the same
    /// register), `sp` and `wsp`; not the zero register.
    pub fn parse(name: &str, arch: Arch) -> Option<Reg> {
        match arch {
            Arch::X86_64 => Self::parse_x86(name),
            Arch::Aarch64 => Self::parse_aarch64(name),
        }
    }

    fn parse_aarch64(name: &str) -> Option<Reg> {
        let slot = match name {
            "sp" | "wsp" => AARCH64_SP,
            _ => {
                let digits = name.strip_prefix('x').or_else(|| name.strip_prefix('w'))?;
                // One canonical spelling: no sign, no leading zero.
                if digits.is_empty()
                    || !digits.bytes().all(|b| b.is_ascii_digit())
                    || (digits.len() > 1 && digits.starts_with('0'))
                {
                    return None;
                }
                digits.parse::<u8>().ok().filter(|n| *n <= 30)?
            }
        };
        Some(Reg {
            arch: Arch::Aarch64,
            slot,
        })
    }

    fn parse_x86(name: &str) -> Option<Reg> {
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
        let slot = u8::try_from(index).ok()?;
        Some(Reg {
            arch: Arch::X86_64,
            slot,
        })
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
    /// The architecture whose spec it was (how it is written back).
    #[serde(skip)]
    pub arch: Arch,
}

impl fmt::Display for UsdtArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ty = if self.signed { 'i' } else { 'u' };
        let bits = u16::from(self.size) * 8;
        match (self.arch, self.location) {
            (Arch::X86_64, ArgLocation::Register { reg }) => {
                write!(f, "{ty}{bits} %{}", reg.name())
            }
            (Arch::X86_64, ArgLocation::Memory { reg, offset }) => {
                write!(f, "{ty}{bits} {offset}(%{})", reg.name())
            }
            (Arch::X86_64, ArgLocation::Constant { value }) => write!(f, "{ty}{bits} ${value}"),
            (Arch::Aarch64, ArgLocation::Register { reg }) => {
                write!(f, "{ty}{bits} {}", reg.name())
            }
            (Arch::Aarch64, ArgLocation::Memory { reg, offset: 0 }) => {
                write!(f, "{ty}{bits} [{}]", reg.name())
            }
            (Arch::Aarch64, ArgLocation::Memory { reg, offset }) => {
                write!(f, "{ty}{bits} [{}, {offset}]", reg.name())
            }
            (Arch::Aarch64, ArgLocation::Constant { value }) => write!(f, "{ty}{bits} #{value}"),
        }
    }
}

/// Decodes one argument spec of `arch` (`N@OPERAND`; a spec without `N@`
/// is taken as 8 unsigned bytes, as the oldest sdt.h wrote them).
pub fn decode_arg(spec: &str, arch: Arch) -> Result<UsdtArg, ArgError> {
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
    let location = match arch {
        Arch::X86_64 => x86_location(spec, operand)?,
        Arch::Aarch64 => aarch64_location(spec, operand)?,
    };
    Ok(UsdtArg {
        size,
        signed,
        location,
        arch,
    })
}

/// An aarch64 operand: `x0`/`w1`/`sp` (register), `[x1]`, `[sp, 16]`,
/// `[x29, -8]`, `[x2, #8]` (memory), `#12`, `12`, `-5` (constant). Register
/// indexes (`[x1, x2]`) and symbolic offsets (`[x1, #:lo12:sym]`) are not.
fn aarch64_location(spec: &str, operand: &str) -> Result<ArgLocation, ArgError> {
    let unsupported = || ArgError::Unsupported(spec.to_string());
    if let Some(inner) = operand.strip_prefix('[') {
        let inner = inner.strip_suffix(']').ok_or_else(unsupported)?;
        let (base, offset) = match inner.split_once(',') {
            Some((base, offset)) => {
                let offset = offset.trim();
                let number = offset.strip_prefix('#').unwrap_or(offset);
                let value = parse_int(number).ok_or_else(|| {
                    if Reg::parse(number, Arch::Aarch64).is_some() || number.starts_with(':') {
                        unsupported()
                    } else {
                        ArgError::Number(spec.to_string())
                    }
                })?;
                (base.trim(), value)
            }
            None => (inner.trim(), 0),
        };
        let reg =
            Reg::parse(base, Arch::Aarch64).ok_or_else(|| ArgError::Register(spec.to_string()))?;
        return Ok(ArgLocation::Memory { reg, offset });
    }
    if let Some(value) = operand.strip_prefix('#') {
        let value = parse_int(value).ok_or_else(|| ArgError::Number(spec.to_string()))?;
        return Ok(ArgLocation::Constant { value });
    }
    if operand.starts_with(|c: char| c.is_ascii_digit() || c == '-' || c == '+') {
        let value = parse_int(operand).ok_or_else(|| ArgError::Number(spec.to_string()))?;
        return Ok(ArgLocation::Constant { value });
    }
    if operand.starts_with(|c: char| c.is_ascii_alphabetic()) {
        return Reg::parse(operand, Arch::Aarch64)
            .map(|reg| ArgLocation::Register { reg })
            .ok_or_else(|| ArgError::Register(spec.to_string()));
    }
    Err(unsupported())
}

/// An x86-64 operand (AT&T syntax): `%rax`, `-56(%rbp)`, `$5`.
fn x86_location(spec: &str, operand: &str) -> Result<ArgLocation, ArgError> {
    let location = if let Some(value) = operand.strip_prefix('$') {
        ArgLocation::Constant {
            value: parse_int(value).ok_or_else(|| ArgError::Number(spec.to_string()))?,
        }
    } else if operand.starts_with('%') {
        ArgLocation::Register {
            reg: Reg::parse(operand, Arch::X86_64)
                .ok_or_else(|| ArgError::Register(spec.to_string()))?,
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
            reg: Reg::parse(inner, Arch::X86_64)
                .ok_or_else(|| ArgError::Register(spec.to_string()))?,
            offset,
        }
    } else {
        return Err(ArgError::Unsupported(spec.to_string()));
    };
    Ok(location)
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

/// Decodes an argument string of `arch` (specs separated by spaces; an
/// aarch64 memory operand has one inside its brackets: `8@[sp, 16]`).
pub fn decode_args(text: &str, arch: Arch) -> Result<Vec<UsdtArg>, ArgError> {
    split_specs(text)
        .into_iter()
        .map(|spec| decode_arg(spec, arch))
        .collect()
}

/// The specs of an argument string: split at whitespace outside brackets.
fn split_specs(text: &str) -> Vec<&str> {
    let mut specs = Vec::new();
    let mut depth = 0usize;
    let mut start: Option<usize> = None;
    for (at, c) in text.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            c if c.is_ascii_whitespace() && depth == 0 => {
                if let Some(from) = start.take() {
                    specs.push(&text[from..at]);
                }
                continue;
            }
            _ => {}
        }
        start.get_or_insert(at);
    }
    if let Some(from) = start {
        specs.push(&text[from..]);
    }
    specs
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
/// named at several sites appears once per site), their arguments decoded
/// for the object's own architecture.
pub fn parse(data: &[u8]) -> Result<Vec<UsdtProbe>, UsdtError> {
    let file = object::File::parse(data).map_err(|err| UsdtError::NotElf(err.to_string()))?;
    let machine = super::elf::e_machine(data);
    let arch = machine.and_then(Arch::from_elf_machine);
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
        let args = match arch {
            Some(arch) => decode_args(&note.args, arch),
            None => Err(ArgError::Machine(
                machine.map_or_else(|| "unknown".into(), super::elf::machine_name),
            )),
        };
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

/// The USDT probes of the file at `path` (of any architecture: listings).
pub fn read(path: &Path) -> Result<Vec<UsdtProbe>, ReadError> {
    read_checked(path, None)
}

/// The USDT probes of the file at `path`, which must be an `arch` object
/// (what is probed: [`Arch::HOST`]).
pub fn read_for(path: &Path, arch: Arch) -> Result<Vec<UsdtProbe>, ReadError> {
    read_checked(path, Some(arch))
}

fn read_checked(path: &Path, arch: Option<Arch>) -> Result<Vec<UsdtProbe>, ReadError> {
    let data = std::fs::read(path).map_err(|source| ReadError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let wrap = |source| ReadError::Usdt {
        path: path.display().to_string(),
        source,
    };
    if let (Some(arch), Some(machine)) = (arch, super::elf::e_machine(&data)) {
        if Arch::from_elf_machine(machine) != Some(arch) {
            return Err(wrap(UsdtError::ForeignArch {
                machine: super::elf::machine_name(machine),
                arch,
            }));
        }
    }
    parse(&data).map_err(wrap)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(name: &str) -> Reg {
        Reg::parse(name, Arch::X86_64).expect(name)
    }

    fn xreg(name: &str) -> Reg {
        Reg::parse(name, Arch::Aarch64).expect(name)
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
            assert_eq!(Reg::parse(bad, Arch::X86_64), None, "{bad}");
        }
    }

    #[test]
    fn decodes_pytorch_argument_specs() {
        // libc10_cuda.so's two pytorch:malloc sites (DESIGN.md, USDT).
        let args =
            decode_args("-8@%rbp -1@%al -8@%r12 -8@56(%rsp)", Arch::X86_64).expect("decodes");
        assert_eq!(
            args,
            vec![
                UsdtArg {
                    size: 8,
                    signed: true,
                    location: ArgLocation::Register { reg: reg("%rbp") },
                    arch: Arch::X86_64
                },
                UsdtArg {
                    size: 1,
                    signed: true,
                    location: ArgLocation::Register { reg: reg("%rax") },
                    arch: Arch::X86_64
                },
                UsdtArg {
                    size: 8,
                    signed: true,
                    location: ArgLocation::Register { reg: reg("%r12") },
                    arch: Arch::X86_64
                },
                UsdtArg {
                    size: 8,
                    signed: true,
                    location: ArgLocation::Memory {
                        reg: reg("%rsp"),
                        offset: 56
                    },
                    arch: Arch::X86_64
                },
            ]
        );
        let args =
            decode_args("-8@%rax -1@%dl -8@%r14 -8@-56(%rbp)", Arch::X86_64).expect("decodes");
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
        let arg = decode_arg("4@$-5", Arch::X86_64).expect("constant");
        assert_eq!(
            (arg.size, arg.signed, arg.location),
            (4, false, ArgLocation::Constant { value: -5 })
        );
        assert_eq!(
            decode_arg("-2@$0x10", Arch::X86_64).expect("hex").location,
            ArgLocation::Constant { value: 16 }
        );
        assert_eq!(
            decode_arg("8@(%rdi)", Arch::X86_64)
                .expect("no offset")
                .location,
            ArgLocation::Memory {
                reg: reg("%rdi"),
                offset: 0
            }
        );
        let old = decode_arg("%rsi", Arch::X86_64).expect("sizeless");
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
            assert!(decode_arg(bad, Arch::X86_64).is_err(), "{bad}");
        }
        assert_eq!(decode_args("", Arch::X86_64).expect("none"), vec![]);
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

    #[test]
    fn specs_split_outside_brackets() {
        assert_eq!(
            split_specs(" -8@x0  -8@[x2, 16]\t1@[sp] 8@-8(%rbp) "),
            ["-8@x0", "-8@[x2, 16]", "1@[sp]", "8@-8(%rbp)"]
        );
        assert_eq!(split_specs(""), Vec::<&str>::new());
        // An unclosed bracket keeps the rest as one (undecodable) spec.
        assert_eq!(split_specs("8@[x1, 8 4@x2"), ["8@[x1, 8 4@x2"]);
    }

    #[test]
    fn aarch64_registers_are_user_pt_regs_slots() {
        for (names, slot) in [
            (&["x0", "w0"][..], 0),
            (&["x1", "w1"][..], 1),
            (&["x29", "w29"][..], 29),
            (&["x30", "w30"][..], 30),
            (&["sp", "wsp"][..], 31),
        ] {
            for name in names {
                assert_eq!(xreg(name).slot(), slot, "{name}");
            }
        }
        assert_eq!(xreg("w7").name(), "x7");
        assert_eq!(xreg("wsp").name(), "sp");
        // struct user_pt_regs { u64 regs[31]; u64 sp; u64 pc; u64 pstate; }
        assert_eq!(xreg("x0").pt_regs_offset(), 0);
        assert_eq!(xreg("x29").pt_regs_offset(), 232);
        assert_eq!(xreg("x30").pt_regs_offset(), 240);
        assert_eq!(xreg("sp").pt_regs_offset(), 248);
        for bad in [
            "x31", "w31", "xzr", "wzr", "x", "x01", "x-1", "pc", "%x0", "X0", "v0", "rax", "x30a",
        ] {
            assert_eq!(Reg::parse(bad, Arch::Aarch64), None, "{bad}");
        }
        // An x86 name is no aarch64 register and the reverse.
        assert_eq!(Reg::parse("%rsp", Arch::Aarch64), None);
        assert_eq!(Reg::parse("x0", Arch::X86_64), None);
    }

    #[test]
    fn decodes_aarch64_specs() {
        let arg = |spec: &str| decode_arg(spec, Arch::Aarch64).expect(spec);
        let loc = |spec: &str| arg(spec).location;
        assert_eq!(loc("8@x0"), ArgLocation::Register { reg: xreg("x0") });
        let w1 = arg("-4@w1");
        assert_eq!((w1.size, w1.signed), (4, true));
        assert_eq!(w1.location, ArgLocation::Register { reg: xreg("x1") });
        assert_eq!(loc("8@sp"), ArgLocation::Register { reg: xreg("sp") });
        for (spec, base, offset) in [
            ("8@[sp, 16]", "sp", 16),
            ("-8@[x29, -8]", "x29", -8),
            ("4@[x1]", "x1", 0),
            ("-8@[sp]", "sp", 0),
            ("-8@[x2, #8]", "x2", 8),
            ("1@[sp,19]", "sp", 19),
            ("8@[x3, 0x10]", "x3", 16),
        ] {
            assert_eq!(
                loc(spec),
                ArgLocation::Memory {
                    reg: xreg(base),
                    offset
                },
                "{spec}"
            );
        }
        for (spec, value) in [("-4@#12", 12), ("8@12", 12), ("-4@-5", -5), ("4@#-5", -5)] {
            assert_eq!(loc(spec), ArgLocation::Constant { value }, "{spec}");
        }
        assert_eq!(arg("-8@[x29, -8]").to_string(), "i64 [x29, -8]");
        assert_eq!(arg("4@[x1]").to_string(), "u32 [x1]");
        assert_eq!(arg("-4@w1").to_string(), "i32 x1");
        assert_eq!(arg("-4@#12").to_string(), "i32 #12");
        for (bad, why) in [
            ("-8@[x1, #:lo12:.LANCHOR0]", "unsupported"),
            ("8@[x1, x2]", "unsupported"),
            ("8@[x1", "unsupported"),
            ("8@%rax", "unsupported"),
            ("8@xzr", "unknown register"),
            ("8@v0", "unknown register"),
            ("8@[x31, 8]", "unknown register"),
            ("8@#x", "bad number"),
            ("8@[sp, 1z]", "bad number"),
            ("3@x0", "bad size"),
        ] {
            let err = decode_arg(bad, Arch::Aarch64).expect_err(bad);
            assert!(err.to_string().contains(why), "{bad}: {err}");
        }
        // The same text decodes per architecture: `8@12` is no x86 operand.
        assert!(decode_arg("8@12", Arch::X86_64).is_err());
        assert!(decode_arg("8@x0", Arch::X86_64).is_err());
    }

    /// Argument strings `aarch64-linux-gnu-readelf -n` printed for
    /// [`AARCH64_FIXTURE`] built with Debian's aarch64-linux-gnu-gcc 12.2 (-O2).
    const AARCH64_NOTES: [(&str, &str); 6] = [
        ("alloc", "-8@x0 -4@x1 -8@[x2, 16] 1@x3"),
        ("mem", "-8@x4 -4@[x2, 8] -2@[x2, 12]"),
        ("consts", "-4@12 -4@-5 -8@[x1, #:lo12:.LANCHOR0]"),
        ("free", "-8@x0"),
        ("many", "-8@x10 -8@x2 -8@x4 -8@x6 -8@x3"),
        ("stk", "-8@x0 -8@x8 -8@x9 -8@x7"),
    ];

    /// The same at -O0: stack slots off sp.
    const AARCH64_NOTES_O0: [&str; 6] = [
        "-8@[sp, 24] -4@[sp, 20] -8@x0 1@[sp, 19]",
        "-8@x1 -4@x2 -2@x0",
        "-4@12 -4@-5 -8@x0",
        "-8@x0",
        "-8@x2 -8@x3 -8@x4 -8@x5 -8@x0",
        "-8@[sp, 56] -8@[sp, 64] -8@[sp, 72] -8@[sp]",
    ];

    const AARCH64_FIXTURE: &str = r#"
#include <sys/sdt.h>
volatile long sink;
struct blk { long a; int b; short c; char d; long e; };
__attribute__((noinline)) void work(long p, int n, struct blk *b, unsigned char c) {
    long local[4] = { p, n, 3, 4 };
    volatile long *vl = local;
    DTRACE_PROBE4(demo, alloc, p, n, b->e, c);
    DTRACE_PROBE3(demo, mem, vl[1], b->b, b->c);
    DTRACE_PROBE3(demo, consts, 12, -5, (long)sink);
    STAP_PROBE1(demo, free, p + 1);
}
long big(long a, long b, long c, long d, long e, long f, long g, long h, long i, long j) {
    DTRACE_PROBE5(demo, many, a*b, c*d, e*f, g*h, i*j);
    DTRACE_PROBE4(demo, stk, a, i, j, h);
    return a+b;
}
int main(int argc, char **argv) {
    struct blk b = {1,2,3,4,5};
    (void)argv;
    work(argc, 7, &b, 9);
    return (int)big(argc,2,3,4,5,6,7,8,9,10);
}
"#;

    #[test]
    fn decodes_real_aarch64_notes() {
        let slots = |text: &str| -> Vec<String> {
            decode_args(text, Arch::Aarch64)
                .expect(text)
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        assert_eq!(
            slots(AARCH64_NOTES[0].1),
            ["i64 x0", "i32 x1", "i64 [x2, 16]", "u8 x3"]
        );
        assert_eq!(
            slots(AARCH64_NOTES[1].1),
            ["i64 x4", "i32 [x2, 8]", "i16 [x2, 12]"]
        );
        // A symbolic offset cannot be read: the whole site is reported.
        assert!(matches!(
            decode_args(AARCH64_NOTES[2].1, Arch::Aarch64),
            Err(ArgError::Unsupported(_))
        ));
        assert_eq!(
            slots(AARCH64_NOTES[5].1),
            ["i64 x0", "i64 x8", "i64 x9", "i64 x7"]
        );
        assert_eq!(
            slots(AARCH64_NOTES_O0[0]),
            ["i64 [sp, 24]", "i32 [sp, 20]", "i64 x0", "u8 [sp, 19]"]
        );
        assert_eq!(slots(AARCH64_NOTES_O0[2]), ["i32 #12", "i32 #-5", "i64 x0"]);
        assert_eq!(
            slots(AARCH64_NOTES_O0[5]),
            ["i64 [sp, 56]", "i64 [sp, 64]", "i64 [sp, 72]", "i64 [sp]"]
        );
        // Slots: x<n> = n, sp = 31.
        let args = decode_args(AARCH64_NOTES_O0[0], Arch::Aarch64).expect("decodes");
        assert_eq!(
            args[0].location,
            ArgLocation::Memory {
                reg: xreg("sp"),
                offset: 24
            }
        );
        let ArgLocation::Memory { reg, .. } = args[0].location else {
            unreachable!()
        };
        assert_eq!(reg.slot(), 31);
    }

    /// Builds [`AARCH64_FIXTURE`] with the cross compiler at `opt`.
    fn build_aarch64(opt: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("memtrace-usdt-{}-aarch64{opt}", std::process::id()));
        let include = dir.join("include/sys");
        std::fs::create_dir_all(&include).expect("temp dir");
        // sdt.h is architecture-neutral; the cross compiler does not look in
        // the host's include directory, so it gets only these two.
        for header in ["sdt.h", "sdt-config.h"] {
            let from = Path::new("/usr/include/x86_64-linux-gnu/sys").join(header);
            std::fs::copy(&from, include.join(header))
                .unwrap_or_else(|e| panic!("{}: {e} (systemtap-sdt-dev)", from.display()));
        }
        let src = dir.join("probes.c");
        std::fs::write(&src, AARCH64_FIXTURE).expect("write source");
        let out = dir.join(format!("probes{opt}"));
        let status = std::process::Command::new("aarch64-linux-gnu-gcc")
            .arg(opt)
            .arg("-I")
            .arg(dir.join("include"))
            .arg("-o")
            .arg(&out)
            .arg(&src)
            .status()
            .expect("aarch64-linux-gnu-gcc runs (apt-get install gcc-aarch64-linux-gnu)");
        assert!(status.success(), "aarch64-linux-gnu-gcc failed");
        out
    }

    #[test]
    fn reads_notes_of_an_aarch64_build() {
        for (opt, texts) in [
            ("-O2", AARCH64_NOTES.map(|(_, text)| text)),
            ("-O0", AARCH64_NOTES_O0),
        ] {
            let path = build_aarch64(opt);
            let probes = read(&path).expect("reads");
            let names: Vec<&str> = probes.iter().map(|p| p.name.as_str()).collect();
            assert_eq!(names, AARCH64_NOTES.map(|(name, _)| name), "{opt}");
            for (probe, text) in probes.iter().zip(texts) {
                assert_eq!(probe.args_text, text, "{opt} {}", probe.name);
                // Decoded for the object's architecture, as decode_args does.
                assert_eq!(probe.args, decode_args(text, Arch::Aarch64), "{opt}");
            }
            // The probe instruction at the file offset is an A64 nop.
            let data = std::fs::read(&path).expect("built");
            for probe in &probes {
                let at = usize::try_from(probe.file_offset).expect("offset");
                assert_eq!(
                    &data[at..at + 4],
                    &[0x1f, 0x20, 0x03, 0xd5],
                    "{}",
                    probe.name
                );
            }
            // Probed only by an aarch64 memtrace: refused by name elsewhere.
            assert!(read_for(&path, Arch::Aarch64).is_ok());
            let err = read_for(&path, Arch::X86_64).expect_err("foreign");
            assert_eq!(
                err.to_string(),
                format!(
                    "{}: an aarch64 object, not x86_64: its probes are not attached",
                    path.display()
                )
            );
            if let Some(dir) = path.parent() {
                let _ = std::fs::remove_dir_all(dir);
            }
        }
    }
}
