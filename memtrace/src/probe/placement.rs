//! Probe placement: choosing the byte offset inside a traced function at
//! which its uprobe is attached.
//!
//! This module owns one decision, made from the first bytes of the function
//! as read from the ELF file: attach at the entry (offset 0), or a few bytes
//! later where the kernel can *emulate* the probed instruction instead of
//! single-stepping it out of line. On x86-64 (kernel 6.18, measured) a hit on
//! an emulated instruction costs ~0.4 us; a single-stepped one ~15 us more,
//! because it takes a second trap. glibc `malloc` starts with `push r12`
//! (emulated), while `free` starts with `test rdi,rdi` (single-stepped) and
//! only reaches `push rbp` at `+9`, after its NULL check.
//!
//! The chooser is pure and conservative: it moves only past instructions
//! that every relevant path executes and that write no register (only flags),
//! and only onto an instruction it knows the kernel emulates. Anything else
//! (an unknown instruction, a write to a register, a branch back into the
//! skipped bytes) keeps the probe at offset 0, with a reason saying why.
//!
//! What the kernel emulates mirrors `arch/x86/kernel/uprobes.c`:
//! `push r64` (`50+r`, or `41 50+r` for r8..r15), NOPs (`90` without `f3`,
//! and the `0f 1f /0` multi-byte forms), and relative `jmp`, `call` and `jcc`
//! without a `66` prefix. `endbr64` is not emulated. Kernels older than the
//! multi-byte NOP emulation single-step `0f 1f`; that costs speed, never
//! correctness.
//!
//! Only what lies inside the bytes given can be checked: a branch from
//! further into the function back into the skipped bytes is not seen. Pass
//! [`WINDOW`] bytes (fewer when the symbol is shorter).

use std::fmt;

use iced_x86::{
    Code, ConditionCode, Decoder, DecoderError, DecoderOptions, FastFormatter, FlowControl,
    Instruction, InstructionInfoFactory, OpAccess, OpKind, Register,
};

/// How many bytes of the function's start [`choose`] wants to see.
pub const WINDOW: usize = 64;

/// An integer argument register of the x86-64 System V calling convention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ArgReg {
    Rdi,
    Rsi,
    Rdx,
    Rcx,
    R8,
    R9,
}

impl ArgReg {
    /// The register carrying integer argument `index` (0-based), if any.
    pub fn nth(index: usize) -> Option<Self> {
        [
            Self::Rdi,
            Self::Rsi,
            Self::Rdx,
            Self::Rcx,
            Self::R8,
            Self::R9,
        ]
        .get(index)
        .copied()
    }

    /// The register's name, as in Intel syntax.
    pub fn name(self) -> &'static str {
        match self {
            Self::Rdi => "rdi",
            Self::Rsi => "rsi",
            Self::Rdx => "rdx",
            Self::Rcx => "rcx",
            Self::R8 => "r8",
            Self::R9 => "r9",
        }
    }

    fn register(self) -> Register {
        match self {
            Self::Rdi => Register::RDI,
            Self::Rsi => Register::RSI,
            Self::Rdx => Register::RDX,
            Self::Rcx => Register::RCX,
            Self::R8 => Register::R8,
            Self::R9 => Register::R9,
        }
    }
}

/// What the probe needs from the function, which bounds how far it may move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeRole {
    /// Every call must fire, with every argument and the stack untouched:
    /// allocation entries and uretprobes. Moves past `endbr64` only.
    Entry,
    /// A release-like function whose probe reads only the pointer in
    /// `ptr_reg`, and for which a NULL pointer is a no-op: a leading NULL
    /// check on that register (`test reg,reg` or `cmp reg,0`, then `je`)
    /// may be skipped, so NULL calls never fire.
    ReleasePointer { ptr_reg: ArgReg },
}

/// Where to attach, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Byte offset from the function's entry.
    pub offset: u64,
    pub reason: PlacementReason,
}

impl Placement {
    /// The function's entry, whatever the chooser said (placement disabled).
    pub fn at_entry(self) -> Self {
        if self.offset == 0 {
            return self;
        }
        Placement {
            offset: 0,
            reason: PlacementReason::Stay {
                entry: None,
                why: "placement disabled".to_string(),
            },
        }
    }

    /// Whether the probed instruction is one the kernel emulates (fast path).
    pub fn is_emulated(&self) -> bool {
        !matches!(self.reason, PlacementReason::Stay { .. })
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "+{} ({})", self.offset, self.reason)
    }
}

/// Why [`choose`] picked its offset. Instructions are in Intel syntax.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlacementReason {
    /// The entry instruction is emulated: offset 0.
    EntryEmulated { insn: String },
    /// Moved past `endbr64` onto the emulated `insn`.
    SkippedEndbr64 { insn: String },
    /// Moved past a NULL check of the pointer register (`check`, e.g.
    /// `test rdi,rdi; je`), and `endbr64` before it if `endbr64`, onto the
    /// emulated `insn`, which only non-NULL pointers reach.
    SkippedNullCheck {
        endbr64: bool,
        check: String,
        insn: String,
    },
    /// Offset 0, single-stepped: `entry` is the entry instruction (`None`
    /// when its bytes do not decode), `why` says why no later spot is safe.
    Stay { entry: Option<String>, why: String },
}

impl fmt::Display for PlacementReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::EntryEmulated { insn } => write!(f, "entry `{insn}` is emulated"),
            Self::SkippedEndbr64 { insn } => {
                write!(f, "skipped `endbr64`; `{insn}` is emulated")
            }
            Self::SkippedNullCheck {
                endbr64,
                check,
                insn,
            } => {
                let endbr = if *endbr64 { "`endbr64` and " } else { "" };
                write!(
                    f,
                    "skipped {endbr}NULL check `{check}`; `{insn}` is emulated"
                )
            }
            Self::Stay {
                entry: Some(entry),
                why,
            } => write!(f, "entry `{entry}` is single-stepped; {why}"),
            Self::Stay { entry: None, why } => write!(f, "entry does not decode; {why}"),
        }
    }
}

/// Chooses where to attach a probe with `role` to the function whose first
/// bytes (at its entry, up to [`WINDOW`], not past the symbol's end) are
/// `code`.
pub fn choose(code: &[u8], role: ProbeRole) -> Placement {
    let insns = decode(code);
    let Some(first) = insns.first() else {
        return stay(None, "no safe emulated spot".to_string());
    };
    if first.emulated {
        return Placement {
            offset: 0,
            reason: PlacementReason::EntryEmulated {
                insn: first.text.clone(),
            },
        };
    }
    let entry = Some(first.text.clone());

    let endbr64 = first.instr.code() == Code::Endbr64;
    let start = usize::from(endbr64);
    if endbr64 {
        match insns.get(1) {
            Some(next) if next.emulated => {
                return finish(
                    &insns,
                    1,
                    entry,
                    PlacementReason::SkippedEndbr64 {
                        insn: next.text.clone(),
                    },
                );
            }
            Some(_) => {}
            None => {
                return stay(entry, "bytes after `endbr64` do not decode".to_string());
            }
        }
    }

    let ProbeRole::ReleasePointer { ptr_reg } = role else {
        let why = if endbr64 {
            format!(
                "`{}` after `endbr64` is single-stepped too; no safe emulated spot",
                insns[1].text
            )
        } else {
            "no safe emulated spot".to_string()
        };
        return stay(entry, why);
    };

    match null_check(&insns, start, ptr_reg) {
        Ok(candidate) => {
            let check = format!("{}; {}", insns[start].text, insns[start + 1].mnemonic());
            finish(
                &insns,
                candidate,
                entry,
                PlacementReason::SkippedNullCheck {
                    endbr64,
                    check,
                    insn: insns[candidate].text.clone(),
                },
            )
        }
        Err(why) => stay(entry, format!("{why}; no safe emulated spot")),
    }
}

#[cfg(test)]
/// Whether the kernel's x86-64 uprobe code emulates the instruction at the
/// start of `insn` (no second trap). `false` when it does not decode.
pub fn is_emulated(insn: &[u8]) -> bool {
    let mut decoder = Decoder::with_ip(64, insn, 0, DecoderOptions::NONE);
    let instr = decoder.decode();
    if decoder.last_error() != DecoderError::None || instr.is_invalid() {
        return false;
    }
    insn.get(..instr.len())
        .is_some_and(|bytes| emulated(&instr, bytes))
}

/// One decoded instruction at `offset` from the function's entry.
struct Decoded {
    offset: u64,
    instr: Instruction,
    emulated: bool,
    text: String,
}

impl Decoded {
    fn end(&self) -> u64 {
        self.offset + self.instr.len() as u64
    }

    fn mnemonic(&self) -> &str {
        self.text.split_whitespace().next().unwrap_or(&self.text)
    }
}

/// Decodes `code` from its start, stopping at the first byte that does not
/// begin a whole, valid instruction.
fn decode(code: &[u8]) -> Vec<Decoded> {
    let mut decoder = Decoder::with_ip(64, code, 0, DecoderOptions::NONE);
    let mut formatter = FastFormatter::new();
    formatter.options_mut().set_use_hex_prefix(true);
    formatter.options_mut().set_uppercase_hex(false);
    let mut out = Vec::new();
    while decoder.can_decode() {
        let offset = decoder.ip();
        let instr = decoder.decode();
        if decoder.last_error() != DecoderError::None || instr.is_invalid() {
            break;
        }
        let start = offset as usize;
        let Some(bytes) = code.get(start..start + instr.len()) else {
            break;
        };
        let mut text = String::new();
        formatter.format(&instr, &mut text);
        out.push(Decoded {
            offset,
            emulated: emulated(&instr, bytes),
            instr,
            text,
        });
    }
    out
}

/// The kernel's emulation rules (`branch_setup_xol_ops`,
/// `push_setup_xol_ops`), given the decoded instruction and its bytes.
fn emulated(instr: &Instruction, bytes: &[u8]) -> bool {
    let is_push_opcode = |b: u8| (0x50..=0x57).contains(&b);
    match instr.code() {
        Code::Push_r64 => match bytes {
            [op] => is_push_opcode(*op),
            [0x41, op] => is_push_opcode(*op),
            _ => false,
        },
        Code::Nopw | Code::Nopd | Code::Nopq | Code::Nop_rm16 | Code::Nop_rm32 | Code::Nop_rm64 => {
            true
        }
        Code::Jmp_rel8_64 | Code::Jmp_rel32_64 | Code::Call_rel32_64 => !has_66_prefix(bytes),
        _ if instr.is_jcc_short_or_near() => !has_66_prefix(bytes),
        _ => false,
    }
}

/// Whether the legacy prefixes of the instruction in `bytes` include `66`.
fn has_66_prefix(bytes: &[u8]) -> bool {
    for &b in bytes {
        match b {
            0x66 => return true,
            0x67 | 0xf0 | 0xf2 | 0xf3 | 0x26 | 0x2e | 0x36 | 0x3e | 0x64 | 0x65 | 0x40..=0x4f => {}
            _ => return false,
        }
    }
    false
}

/// Matches `test reg,reg` / `cmp reg,0` on `ptr_reg` at `insns[at]`, then
/// `je` whose target lies past the fall-through, and returns the index of
/// the fall-through instruction if it is emulated.
fn null_check(insns: &[Decoded], at: usize, ptr_reg: ArgReg) -> Result<usize, String> {
    let reg = ptr_reg.register();
    let Some(check) = insns.get(at) else {
        return Err("bytes do not decode".to_string());
    };
    let i = &check.instr;
    let tests_ptr = match i.code() {
        Code::Test_rm64_r64 => {
            i.op0_kind() == OpKind::Register && i.op0_register() == reg && i.op1_register() == reg
        }
        Code::Cmp_rm64_imm8 | Code::Cmp_rm64_imm32 => {
            i.op0_kind() == OpKind::Register && i.op0_register() == reg && i.immediate(1) == 0
        }
        _ => false,
    };
    if !tests_ptr {
        return Err(format!(
            "`{}` is not a NULL check of the pointer register {}",
            check.text,
            ptr_reg.name()
        ));
    }
    let Some(jump) = insns.get(at + 1) else {
        return Err(format!("bytes after `{}` do not decode", check.text));
    };
    let j = &jump.instr;
    let is_je = matches!(j.code(), Code::Je_rel8_64 | Code::Je_rel32_64)
        && j.condition_code() == ConditionCode::e;
    if !is_je {
        return Err(format!(
            "`{}` after `{}` is not `je` to the NULL path",
            jump.text, check.text
        ));
    }
    let Some(candidate) = insns.get(at + 2) else {
        return Err(format!("bytes after `{}` do not decode", jump.text));
    };
    if j.near_branch_target() <= candidate.offset {
        return Err(format!(
            "`{}` jumps back to +{:#x}, not past the candidate +{:#x}",
            jump.text,
            j.near_branch_target(),
            candidate.offset
        ));
    }
    if !candidate.emulated {
        return Err(format!(
            "`{}` after the NULL check is single-stepped too",
            candidate.text
        ));
    }
    Ok(at + 2)
}

/// Accepts moving onto `insns[candidate]` unless a skipped instruction
/// writes a register or a branch in the window lands in `[0, candidate]`.
fn finish(
    insns: &[Decoded],
    candidate: usize,
    entry: Option<String>,
    reason: PlacementReason,
) -> Placement {
    let target_offset = insns[candidate].offset;
    let mut info = InstructionInfoFactory::new();
    for skipped in &insns[..candidate] {
        let writes = info
            .info(&skipped.instr)
            .used_registers()
            .iter()
            .find(|used| {
                matches!(
                    used.access(),
                    OpAccess::Write
                        | OpAccess::CondWrite
                        | OpAccess::ReadWrite
                        | OpAccess::ReadCondWrite
                )
            })
            .map(|used| used.register());
        if let Some(register) = writes {
            return stay(
                entry,
                format!(
                    "skipped `{}` writes {}; no safe emulated spot",
                    skipped.text,
                    format!("{register:?}").to_lowercase()
                ),
            );
        }
    }
    for branch in insns {
        if let Some(target) = near_target(&branch.instr) {
            let is_call = branch.instr.flow_control() == FlowControl::Call;
            // A call to the entry is a new invocation that passes the whole
            // skipped prefix; any other branch into it could fire twice.
            if target <= target_offset && !(is_call && target == 0) {
                return stay(
                    entry,
                    format!(
                        "`{}` at +{:#x} branches into the skipped bytes [0, {:#x}]; no safe \
                         emulated spot",
                        branch.text, branch.offset, target_offset
                    ),
                );
            }
        }
    }
    debug_assert!(insns[..candidate]
        .last()
        .is_some_and(|last| last.end() == target_offset));
    Placement {
        offset: target_offset,
        reason,
    }
}

/// The function-relative target of a direct near branch or call.
fn near_target(instr: &Instruction) -> Option<u64> {
    let direct = matches!(
        instr.op0_kind(),
        OpKind::NearBranch16 | OpKind::NearBranch32 | OpKind::NearBranch64
    );
    let flow = instr.flow_control();
    let branches = matches!(
        flow,
        FlowControl::UnconditionalBranch
            | FlowControl::ConditionalBranch
            | FlowControl::Call
            | FlowControl::XbeginXabortXend
    );
    (direct && branches).then(|| instr.near_branch_target())
}

fn stay(entry: Option<String>, why: String) -> Placement {
    Placement {
        offset: 0,
        reason: PlacementReason::Stay { entry, why },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FREE: ProbeRole = ProbeRole::ReleasePointer {
        ptr_reg: ArgReg::Rdi,
    };

    // Bytes below are read from /lib/x86_64-linux-gnu/libc.so.6 of glibc
    // 2.36 (Debian 12), text file offset == vaddr, at the address `readelf
    // -Ws` gives, up to 64 bytes and never past the symbol's size; the
    // comments repeat `objdump -d` for the instructions that matter.

    /// `free` (= `__libc_free`, `cfree`) @0x98ef0, 257 bytes:
    /// `test rdi,rdi; je +0xc8 (ret); push rbp; lea rsi,[rdi-0x10]; ...`
    const GLIBC_FREE: [u8; 64] = [
        0x48, 0x85, 0xff, 0x0f, 0x84, 0xbf, 0x00, 0x00, 0x00, 0x55, 0x48, 0x8d, 0x77, 0xf0, 0x53,
        0x48, 0x83, 0xec, 0x18, 0x48, 0x8b, 0x1d, 0xd6, 0x9e, 0x13, 0x00, 0x48, 0x8b, 0x47, 0xf8,
        0x64, 0x8b, 0x2b, 0xa8, 0x02, 0x75, 0x5b, 0x48, 0x8b, 0x15, 0x5c, 0x9e, 0x13, 0x00, 0x64,
        0x48, 0x83, 0x3a, 0x00, 0x0f, 0x84, 0x99, 0x00, 0x00, 0x00, 0x48, 0x8d, 0x3d, 0x32, 0xad,
        0x13, 0x00, 0xa8, 0x04,
    ];

    /// `malloc` (= `__libc_malloc`) @0x98930, 791 bytes: `push r12; push rbp; ...`
    const GLIBC_MALLOC: [u8; 64] = [
        0x41, 0x54, 0x55, 0x53, 0x48, 0x89, 0xfb, 0x48, 0x83, 0xec, 0x10, 0x80, 0x3d, 0x46, 0x1b,
        0x14, 0x00, 0x00, 0x0f, 0x84, 0xf8, 0x01, 0x00, 0x00, 0x48, 0x85, 0xdb, 0x0f, 0x88, 0xfd,
        0x01, 0x00, 0x00, 0x48, 0x8d, 0x43, 0x17, 0x31, 0xed, 0x48, 0x83, 0xf8, 0x1f, 0x76, 0x0c,
        0x48, 0x83, 0xe0, 0xf0, 0x48, 0x8d, 0x68, 0xef, 0x48, 0xc1, 0xed, 0x04, 0x4c, 0x8b, 0x25,
        0x08, 0xa4, 0x13, 0x00,
    ];

    /// `calloc` @0x996e0, 944 bytes: `push r13; mov rax,rdi; ...`
    const GLIBC_CALLOC: [u8; 64] = [
        0x41, 0x55, 0x48, 0x89, 0xf8, 0x41, 0x54, 0x55, 0x53, 0x48, 0x83, 0xec, 0x18, 0x48, 0xf7,
        0xe6, 0x48, 0x89, 0xc3, 0x0f, 0x90, 0xc0, 0x48, 0x85, 0xdb, 0x0f, 0x88, 0xd9, 0x02, 0x00,
        0x00, 0x0f, 0xb6, 0xc0, 0x48, 0x85, 0xc0, 0x0f, 0x85, 0xcd, 0x02, 0x00, 0x00, 0x80, 0x3d,
        0x76, 0x0d, 0x14, 0x00, 0x00, 0x0f, 0x84, 0x48, 0x02, 0x00, 0x00, 0x48, 0x8b, 0x05, 0x59,
        0x96, 0x13, 0x00, 0x64,
    ];

    /// `realloc` @0x99130, 1247 bytes: `push r15; push r14; ...`
    const GLIBC_REALLOC: [u8; 64] = [
        0x41, 0x57, 0x41, 0x56, 0x41, 0x55, 0x41, 0x54, 0x55, 0x48, 0x89, 0xf5, 0x53, 0x48, 0x89,
        0xfb, 0x48, 0x83, 0xec, 0x28, 0x80, 0x3d, 0x3d, 0x13, 0x14, 0x00, 0x00, 0x0f, 0x84, 0x57,
        0x01, 0x00, 0x00, 0x48, 0x85, 0xed, 0x75, 0x22, 0x48, 0x85, 0xdb, 0x0f, 0x85, 0xc1, 0x01,
        0x00, 0x00, 0x48, 0x83, 0xc4, 0x28, 0x48, 0x89, 0xef, 0x5b, 0x5d, 0x41, 0x5c, 0x41, 0x5d,
        0x41, 0x5e, 0x41, 0x5f,
    ];

    /// `posix_memalign` @0x9a280, 119 bytes:
    /// `cmp byte [rip+0x140201],0; push r12; ...`
    const GLIBC_POSIX_MEMALIGN: [u8; 64] = [
        0x80, 0x3d, 0x01, 0x02, 0x14, 0x00, 0x00, 0x41, 0x54, 0x49, 0x89, 0xd4, 0x55, 0x48, 0x89,
        0xfd, 0x53, 0x48, 0x89, 0xf3, 0x74, 0x5a, 0x48, 0x89, 0xda, 0x48, 0xc1, 0xea, 0x03, 0x48,
        0x8d, 0x42, 0xff, 0x48, 0x21, 0xd0, 0x48, 0x89, 0xda, 0x83, 0xe2, 0x07, 0x48, 0x09, 0xd0,
        0x75, 0x31, 0x48, 0x85, 0xdb, 0x74, 0x2c, 0x4c, 0x89, 0xe6, 0x48, 0x89, 0xdf, 0xe8, 0x91,
        0xe9, 0xff, 0xff, 0x48,
    ];

    /// `aligned_alloc` (= `memalign`) @0x99610, 52 bytes:
    /// `cmp byte [rip+0x140e71],0; je +0x10; jmp ...`
    const GLIBC_MEMALIGN: [u8; 52] = [
        0x80, 0x3d, 0x71, 0x0e, 0x14, 0x00, 0x00, 0x74, 0x07, 0xe9, 0x32, 0xf6, 0xff, 0xff, 0x66,
        0x90, 0x48, 0x83, 0xec, 0x18, 0x48, 0x89, 0x74, 0x24, 0x08, 0x48, 0x89, 0x3c, 0x24, 0xe8,
        0xbe, 0xbc, 0xff, 0xff, 0x48, 0x8b, 0x74, 0x24, 0x08, 0x48, 0x8b, 0x3c, 0x24, 0x48, 0x83,
        0xc4, 0x18, 0xe9, 0x0c, 0xf6, 0xff, 0xff,
    ];

    /// `valloc` @0x99650, 47 bytes: `cmp byte [rip+0x140e31],0; push rbx; ...`
    const GLIBC_VALLOC: [u8; 47] = [
        0x80, 0x3d, 0x31, 0x0e, 0x14, 0x00, 0x00, 0x53, 0x48, 0x89, 0xfb, 0x74, 0x1b, 0x48, 0x8b,
        0x05, 0x34, 0x98, 0x13, 0x00, 0x48, 0x89, 0xde, 0x5b, 0x48, 0x8b, 0x78, 0x18, 0xe9, 0xdf,
        0xf5, 0xff, 0xff, 0x0f, 0x1f, 0x80, 0x00, 0x00, 0x00, 0x00, 0xe8, 0x73, 0xbc, 0xff, 0xff,
        0xeb, 0xde,
    ];

    /// `munmap` @0x101a00, 33 bytes: `mov eax,0xb; syscall; ...`
    const GLIBC_MUNMAP: [u8; 33] = [
        0xb8, 0x0b, 0x00, 0x00, 0x00, 0x0f, 0x05, 0x48, 0x3d, 0x01, 0xf0, 0xff, 0xff, 0x73, 0x01,
        0xc3, 0x48, 0x8b, 0x0d, 0xc9, 0x13, 0x0d, 0x00, 0xf7, 0xd8, 0x64, 0x89, 0x01, 0x48, 0x83,
        0xc8, 0xff, 0xc3,
    ];

    /// `mmap` (= `mmap64`) @0x1019a0, 84 bytes: `mov r10d,ecx; test r9d,0xfff; ...`
    const GLIBC_MMAP: [u8; 64] = [
        0x41, 0x89, 0xca, 0x41, 0xf7, 0xc1, 0xff, 0x0f, 0x00, 0x00, 0x75, 0x14, 0xb8, 0x09, 0x00,
        0x00, 0x00, 0x0f, 0x05, 0x48, 0x3d, 0x00, 0xf0, 0xff, 0xff, 0x77, 0x25, 0xc3, 0x0f, 0x1f,
        0x40, 0x00, 0x48, 0x8b, 0x05, 0x19, 0x14, 0x0d, 0x00, 0x64, 0xc7, 0x00, 0x16, 0x00, 0x00,
        0x00, 0x48, 0xc7, 0xc0, 0xff, 0xff, 0xff, 0xff, 0xc3, 0x66, 0x2e, 0x0f, 0x1f, 0x84, 0x00,
        0x00, 0x00, 0x00, 0x00,
    ];

    /// `malloc_usable_size` @0x99d40, 51 bytes:
    /// `test rdi,rdi; je +0x30; mov rcx,[rdi-8]; ...`
    const GLIBC_MALLOC_USABLE_SIZE: [u8; 51] = [
        0x48, 0x85, 0xff, 0x74, 0x2b, 0x48, 0x8b, 0x4f, 0xf8, 0x48, 0x89, 0xca, 0x48, 0x83, 0xe2,
        0xf8, 0x83, 0xe1, 0x02, 0x48, 0x8d, 0x42, 0xf0, 0x75, 0x19, 0x48, 0x8b, 0x44, 0x07, 0x08,
        0x48, 0x83, 0xea, 0x08, 0x83, 0xe0, 0x01, 0x48, 0x0f, 0x45, 0xc2, 0xc3, 0x66, 0x0f, 0x1f,
        0x44, 0x00, 0x00, 0x31, 0xc0, 0xc3,
    ];

    fn assert_stays(p: &Placement) {
        assert_eq!(p.offset, 0, "{p}");
        assert!(!p.is_emulated(), "{p}");
    }

    fn assert_stays_for(name: &str, p: &Placement) {
        assert_eq!(p.offset, 0, "{name}: {p}");
        assert!(!p.is_emulated(), "{name}: {p}");
    }

    #[test]
    fn glibc_free_skips_null_check_to_push_rbp() {
        let p = choose(&GLIBC_FREE, FREE);
        assert_eq!(p.offset, 9, "{p}");
        assert_eq!(
            p.to_string(),
            "+9 (skipped NULL check `test rdi,rdi; je`; `push rbp` is emulated)"
        );
        assert!(p.is_emulated());
    }

    #[test]
    fn glibc_free_as_entry_stays_at_test() {
        let p = choose(&GLIBC_FREE, ProbeRole::Entry);
        assert_stays(&p);
        assert_eq!(
            p.reason.to_string(),
            "entry `test rdi,rdi` is single-stepped; no safe emulated spot"
        );
    }

    #[test]
    fn glibc_allocators_start_emulated() {
        for (name, code, insn) in [
            ("malloc", &GLIBC_MALLOC[..], "push r12"),
            ("calloc", &GLIBC_CALLOC[..], "push r13"),
            ("realloc", &GLIBC_REALLOC[..], "push r15"),
        ] {
            for role in [ProbeRole::Entry, FREE] {
                let p = choose(code, role);
                assert_eq!(p.offset, 0, "{name}: {p}");
                assert_eq!(
                    p.reason,
                    PlacementReason::EntryEmulated {
                        insn: insn.to_string()
                    },
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn glibc_functions_starting_single_stepped_stay() {
        for (name, code) in [
            ("posix_memalign", &GLIBC_POSIX_MEMALIGN[..]),
            ("memalign", &GLIBC_MEMALIGN[..]),
            ("valloc", &GLIBC_VALLOC[..]),
            ("munmap", &GLIBC_MUNMAP[..]),
            ("mmap", &GLIBC_MMAP[..]),
        ] {
            for role in [ProbeRole::Entry, FREE] {
                assert_stays_for(name, &choose(code, role));
            }
        }
        let p = choose(&GLIBC_MUNMAP, FREE);
        assert_eq!(
            p.reason.to_string(),
            "entry `mov eax,0xb` is single-stepped; `mov eax,0xb` is not a NULL check of the \
             pointer register rdi; no safe emulated spot"
        );
    }

    #[test]
    fn null_check_onto_single_stepped_instruction_stays() {
        // malloc_usable_size: the fall-through after the NULL check is
        // `mov rcx,[rdi-8]`, single-stepped as well.
        let p = choose(&GLIBC_MALLOC_USABLE_SIZE, FREE);
        assert_stays(&p);
        assert_eq!(
            p.reason.to_string(),
            "entry `test rdi,rdi` is single-stepped; `mov rcx,[rdi-0x8]` after the NULL check is \
             single-stepped too; no safe emulated spot"
        );
    }

    #[test]
    fn endbr64_then_push_moves_for_every_role() {
        // endbr64; push rbp; mov rbp,rsp; ret
        let code = [0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x48, 0x89, 0xe5, 0xc3];
        for role in [ProbeRole::Entry, FREE] {
            let p = choose(&code, role);
            assert_eq!(p.offset, 4, "{p}");
            assert_eq!(
                p.to_string(),
                "+4 (skipped `endbr64`; `push rbp` is emulated)"
            );
        }
    }

    #[test]
    fn endbr64_then_single_stepped_stays() {
        // endbr64; mov rax,rdi; ret
        let code = [0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x89, 0xf8, 0xc3];
        let p = choose(&code, ProbeRole::Entry);
        assert_stays(&p);
        assert_eq!(
            p.reason.to_string(),
            "entry `endbr64` is single-stepped; `mov rax,rdi` after `endbr64` is single-stepped \
             too; no safe emulated spot"
        );
    }

    #[test]
    fn endbr64_null_check_push_rbx() {
        // endbr64; test rdi,rdi; je +0x10; push rbx; mov rbx,rdi; pop rbx; ret; ...; ret
        let code = [
            0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x85, 0xff, 0x74, 0x07, 0x53, 0x48, 0x89, 0xfb, 0x5b,
            0xc3, 0x90, 0xc3,
        ];
        let p = choose(&code, FREE);
        assert_eq!(p.offset, 9, "{p}");
        assert_eq!(
            p.to_string(),
            "+9 (skipped `endbr64` and NULL check `test rdi,rdi; je`; `push rbx` is emulated)"
        );
        // The same function as an entry probe only moves past endbr64 when
        // the next instruction is emulated, which `test` is not.
        assert_stays(&choose(&code, ProbeRole::Entry));
    }

    #[test]
    fn cmp_zero_null_check_near_je() {
        // cmp rsi,0; je near +0x100; push r14
        let code = [
            0x48, 0x83, 0xfe, 0x00, 0x0f, 0x84, 0xf6, 0x00, 0x00, 0x00, 0x41, 0x56, 0xc3,
        ];
        let role = ProbeRole::ReleasePointer {
            ptr_reg: ArgReg::Rsi,
        };
        let p = choose(&code, role);
        assert_eq!(p.offset, 10, "{p}");
        assert_eq!(
            p.to_string(),
            "+10 (skipped NULL check `cmp rsi,0x0; je`; `push r14` is emulated)"
        );
    }

    #[test]
    fn write_to_pointer_before_push_stays() {
        // mov rdi,[rdi]; push rbp; ret
        let code = [0x48, 0x8b, 0x3f, 0x55, 0xc3];
        let p = choose(&code, FREE);
        assert_stays(&p);
        assert_eq!(
            p.reason.to_string(),
            "entry `mov rdi,[rdi]` is single-stepped; `mov rdi,[rdi]` is not a NULL check of the \
             pointer register rdi; no safe emulated spot"
        );
    }

    #[test]
    fn skipped_instruction_writing_a_register_is_refused() {
        // Not reachable through `choose` (it only skips endbr64, test/cmp and
        // je), but `finish` re-checks every skipped instruction on its own.
        // mov rdi,[rdi]; push rbp
        let insns = decode(&[0x48, 0x8b, 0x3f, 0x55]);
        let p = finish(
            &insns,
            1,
            Some(insns[0].text.clone()),
            PlacementReason::SkippedEndbr64 {
                insn: insns[1].text.clone(),
            },
        );
        assert_stays(&p);
        assert_eq!(
            p.reason.to_string(),
            "entry `mov rdi,[rdi]` is single-stepped; skipped `mov rdi,[rdi]` writes rdi; no safe \
             emulated spot"
        );
        // endbr64, test and je write no register (flags are not registers here).
        let insns = decode(&[
            0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x85, 0xff, 0x74, 0x01, 0x55, 0xc3,
        ]);
        let p = finish(
            &insns,
            3,
            None,
            PlacementReason::SkippedEndbr64 {
                insn: insns[3].text.clone(),
            },
        );
        assert_eq!(p.offset, 9, "{p}");
    }

    #[test]
    fn je_back_into_prefix_stays() {
        // test rdi,rdi; je -> +0 (back to the entry); push rbp; ret
        let code = [0x48, 0x85, 0xff, 0x74, 0xfb, 0x55, 0xc3];
        let p = choose(&code, FREE);
        assert_stays(&p);
        assert!(p.reason.to_string().contains("jumps back to +0x0"), "{p}");
        // test rdi,rdi; je -> +5 (the candidate itself); push rbp; ret
        let code = [0x48, 0x85, 0xff, 0x74, 0x00, 0x55, 0xc3];
        assert_stays(&choose(&code, FREE));
    }

    #[test]
    fn later_branch_back_into_prefix_stays() {
        // test rdi,rdi; je +0x0c; push rbp; pop rbp; jmp +3 (the je); ret
        let code = [
            0x48, 0x85, 0xff, 0x74, 0x07, 0x55, 0x5d, 0xeb, 0xfa, 0xc3, 0xc3, 0xc3, 0xc3,
        ];
        let p = choose(&code, FREE);
        assert_stays(&p);
        assert!(
            p.reason
                .to_string()
                .contains("branches into the skipped bytes"),
            "{p}"
        );
    }

    #[test]
    fn recursive_call_to_entry_is_fine() {
        // endbr64; push rbx; call +0 (recursion); pop rbx; ret
        let code = [
            0xf3, 0x0f, 0x1e, 0xfa, 0x53, 0xe8, 0xf6, 0xff, 0xff, 0xff, 0x5b, 0xc3,
        ];
        assert_eq!(choose(&code, ProbeRole::Entry).offset, 4);
    }

    #[test]
    fn null_check_of_other_register_stays() {
        // test rsi,rsi; je +0x10; push rbp  -- but the pointer is in rdi
        let code = [0x48, 0x85, 0xf6, 0x74, 0x0b, 0x55, 0xc3];
        let p = choose(&code, FREE);
        assert_stays(&p);
        assert!(
            p.reason
                .to_string()
                .contains("not a NULL check of the pointer register rdi"),
            "{p}"
        );
        // test edi,edi only checks the low half of the pointer.
        let code = [0x85, 0xff, 0x74, 0x0b, 0x55, 0xc3];
        assert_stays(&choose(&code, FREE));
        // test rdi,rsi is not a NULL check either.
        let code = [0x48, 0x85, 0xf7, 0x74, 0x0b, 0x55, 0xc3];
        assert_stays(&choose(&code, FREE));
    }

    #[test]
    fn jne_after_test_stays() {
        // test rdi,rdi; jne +0x10; push rbp
        let code = [0x48, 0x85, 0xff, 0x75, 0x0b, 0x55, 0xc3];
        assert_stays(&choose(&code, FREE));
    }

    #[test]
    fn entry_role_never_skips_null_check() {
        // test rdi,rdi; je; push rbp -- an allocation entry must see every call.
        let code = [0x48, 0x85, 0xff, 0x74, 0x0b, 0x55, 0xc3];
        let p = choose(&code, ProbeRole::Entry);
        assert_stays(&p);
    }

    #[test]
    fn undecodable_or_truncated_stays() {
        assert_stays(&choose(&[], FREE));
        // 0x06 (push es) is invalid in 64-bit mode.
        let p = choose(&[0x06, 0x55], FREE);
        assert_stays(&p);
        assert_eq!(
            p.reason.to_string(),
            "entry does not decode; no safe emulated spot"
        );
        // test rdi,rdi; je <truncated>
        assert_stays(&choose(&[0x48, 0x85, 0xff, 0x0f, 0x84, 0x10], FREE));
        // endbr64 and nothing after it.
        assert_stays(&choose(&[0xf3, 0x0f, 0x1e, 0xfa], ProbeRole::Entry));
    }

    #[test]
    fn emulation_rules() {
        // push r64, and r8..r15 with REX.B only.
        assert!(is_emulated(&[0x55]));
        assert!(is_emulated(&[0x41, 0x54]));
        assert!(!is_emulated(&[0x48, 0x55])); // rex.W push rbp
        assert!(!is_emulated(&[0x66, 0x55])); // push bp
        assert!(!is_emulated(&[0x6a, 0x00])); // push imm8
                                              // nops: single-byte, 66 90, and 0f 1f /0 multi-byte forms.
        assert!(is_emulated(&[0x90]));
        assert!(is_emulated(&[0x66, 0x90]));
        assert!(is_emulated(&[0x0f, 0x1f, 0x44, 0x00, 0x00]));
        assert!(is_emulated(&[
            0x66, 0x2e, 0x0f, 0x1f, 0x84, 0x00, 0x00, 0x00, 0x00, 0x00
        ]));
        assert!(!is_emulated(&[0xf3, 0x90])); // pause
        assert!(!is_emulated(&[0x41, 0x90])); // xchg r8d,eax
        assert!(!is_emulated(&[0xf3, 0x0f, 0x1e, 0xfa])); // endbr64
                                                          // relative branches, not with a 66 prefix.
        assert!(is_emulated(&[0xeb, 0x00]));
        assert!(is_emulated(&[0xe9, 0, 0, 0, 0]));
        assert!(is_emulated(&[0xe8, 0, 0, 0, 0]));
        assert!(is_emulated(&[0x74, 0x00]));
        assert!(is_emulated(&[0x0f, 0x85, 0, 0, 0, 0]));
        assert!(!is_emulated(&[0x66, 0xe9, 0, 0, 0, 0]));
        assert!(!is_emulated(&[0xe3, 0x00])); // jrcxz
        assert!(!is_emulated(&[0xff, 0xe0])); // jmp rax
                                              // everything else.
        assert!(!is_emulated(&[0x48, 0x85, 0xff])); // test rdi,rdi
        assert!(!is_emulated(&[0xc3])); // ret
        assert!(!is_emulated(&[])); // nothing
        assert!(!is_emulated(&[0x0f])); // truncated
    }

    #[test]
    fn arg_regs() {
        assert_eq!(ArgReg::nth(0), Some(ArgReg::Rdi));
        assert_eq!(ArgReg::nth(5), Some(ArgReg::R9));
        assert_eq!(ArgReg::nth(6), None);
        assert_eq!(ArgReg::R8.name(), "r8");
    }
}
