//! x86-64 probe placement: where on an x86-64 function's first bytes
//! (decoded with iced-x86) its probe goes.
//!
//! Attach at the entry (offset 0), or a few bytes
//! later where the kernel can *emulate* the probed instruction instead of
//! single-stepping it out of line. On x86-64 (kernel 6.18, measured) a hit on
//! an emulated instruction costs ~0.4 us; a single-stepped one ~15 us more,
//! because it takes a second trap. glibc `malloc` starts with `push r12`
//! (emulated); glibc `free` starts with `test rdi,rdi` (single-stepped) and
//! reaches `push rbp` at `+9`, after its NULL check; jemalloc's `malloc`
//! starts with `cmp rdi,0x1000` and reaches an emulated `ja` at `+7`.
//!
//! The chooser is pure and conservative. It walks the function's
//! straight-line prefix and stops on the first instruction the kernel
//! emulates, provided that:
//! - every skipped instruction falls through (no branch, call or return
//!   before the candidate) and writes no memory, so every call passes the
//!   candidate exactly once;
//! - no direct branch among the bytes given lands inside the skipped prefix
//!   or on the candidate (a call back to the entry is a new invocation);
//! - every argument the probe reads still sits in an argument register: a
//!   plain `mov r64,r64` copy is followed (mimalloc's `malloc` moves its size
//!   from `rdi` to `rsi`), and the placement says where each argument is read;
//! - the stack pointer is unchanged when [`Needs::keep_stack`] (functions
//!   with a return probe: the uretprobe, attached at the same spot, takes the
//!   return address from `[rsp]`).
//!
//! A plain release ([`Needs::release_ptr`]) may also skip a NULL check of its
//! pointer (`test reg,reg` or `cmp reg,0`, then `je` forward past the
//! candidate): NULL frees then never fire at all. When nothing past the
//! check qualifies, the `je` itself is used.
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
//! [`super::WINDOW`] bytes (fewer when the symbol is shorter).
//!
//! Over 800 lines with its tests (~670 of prologue cases); the decoder itself is ~490.

use iced_x86::{
    Code, ConditionCode, Decoder, DecoderError, DecoderOptions, FastFormatter, FlowControl,
    Instruction, InstructionInfoFactory, OpAccess, OpKind, Register,
};

use super::{relocated_args, stay, ArgReg, Needs, Placement, PlacementReason, IDENTITY};
use crate::arch::Arch;

/// The x86-64 System V integer argument registers, in argument order.
const ARG_REGISTERS: [Register; 6] = [
    Register::RDI,
    Register::RSI,
    Register::RDX,
    Register::RCX,
    Register::R8,
    Register::R9,
];

/// The argument index of a register (any width), if it is an argument register.
fn arg_of(register: Register) -> Option<u8> {
    ARG_REGISTERS
        .iter()
        .position(|r| *r == register.full_register())
        .map(|i| i as u8)
}

/// The 64-bit argument register of argument `index`.
fn register(index: u8) -> Option<Register> {
    ARG_REGISTERS.get(usize::from(index)).copied()
}

fn arg_name(index: u8) -> &'static str {
    ArgReg::nth(Arch::X86_64, usize::from(index)).map_or("?", ArgReg::name)
}

/// Chooses where to attach a probe with `needs` to the function whose first
/// bytes (at its entry, up to [`super::WINDOW`], not past the symbol's end) are
/// `code`.
pub fn choose(code: &[u8], needs: Needs) -> Placement {
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
            args: IDENTITY,
        };
    }
    let entry = Some(first.text.clone());
    let mut walk = Walk {
        insns: &insns,
        needs,
        holds: [Some(0), Some(1), Some(2), Some(3), Some(4), Some(5)],
        skipped: Vec::new(),
        info: InstructionInfoFactory::new(),
    };
    let mut fallback: Option<Placement> = None;
    let mut at = 0;
    loop {
        let Some(insn) = insns.get(at) else {
            let why = "the bytes end before an emulated instruction".to_string();
            return fallback.unwrap_or_else(|| stay(entry, why));
        };
        if insn.emulated {
            return match walk.accept(at) {
                Ok(placement) => placement,
                Err(why) => {
                    fallback.unwrap_or_else(|| stay(entry, format!("{why}; no safe emulated spot")))
                }
            };
        }
        if let Some(ptr) = needs.release_ptr {
            if let Some(check) = walk.null_check(at, ptr) {
                // The `je` itself is emulated: a spot NULL frees reach too.
                if fallback.is_none() {
                    let mut at_je = walk.clone_state();
                    at_je.skipped.push(format!("`{}`", insn.text));
                    fallback = at_je.accept(at + 1).ok();
                }
                walk.skipped.push(check);
                at += 2;
                continue;
            }
        }
        if let Err(why) = walk.skip(at) {
            return fallback
                .unwrap_or_else(|| stay(entry, format!("{why}; no safe emulated spot")));
        }
        at += 1;
    }
}

/// The state of [`choose`]'s walk down the prefix.
struct Walk<'a> {
    insns: &'a [Decoded],
    needs: Needs,
    /// `holds[r]`: which original argument register `r` still holds.
    holds: [Option<u8>; 6],
    skipped: Vec<String>,
    info: InstructionInfoFactory,
}

impl<'a> Walk<'a> {
    fn clone_state(&self) -> Walk<'a> {
        Walk {
            insns: self.insns,
            needs: self.needs,
            holds: self.holds,
            skipped: self.skipped.clone(),
            info: InstructionInfoFactory::new(),
        }
    }

    /// The register now holding original argument `arg`, preferring its own.
    fn locate(&self, arg: u8) -> Option<u8> {
        if self.holds[usize::from(arg)] == Some(arg) {
            return Some(arg);
        }
        self.holds
            .iter()
            .position(|h| *h == Some(arg))
            .map(|r| r as u8)
    }

    /// Skips the non-emulated `insns[at]`, or says why it cannot be skipped.
    fn skip(&mut self, at: usize) -> Result<(), String> {
        let insn = &self.insns[at];
        let instr = &insn.instr;
        if instr.flow_control() != FlowControl::Next {
            return Err(format!(
                "`{}` at +{:#x} leaves the straight line before any emulated instruction",
                insn.text, insn.offset
            ));
        }
        let info = self.info.info(instr);
        if info.used_memory().iter().any(|m| writes(m.access())) {
            return Err(format!("skipped `{}` writes memory", insn.text));
        }
        let written: Vec<Register> = info
            .used_registers()
            .iter()
            .filter(|used| writes(used.access()))
            .map(|used| used.register().full_register())
            .collect();
        if written.contains(&Register::RSP) {
            if self.needs.keep_stack {
                return Err(format!(
                    "skipped `{}` moves the stack pointer (a return probe needs it)",
                    insn.text
                ));
            }
            // Only growing the stack (`sub rsp,imm`): the nesting check
            // compares stack pointers, which must not rise above the entry's.
            let grows = matches!(instr.code(), Code::Sub_rm64_imm8 | Code::Sub_rm64_imm32)
                && instr.op0_kind() == OpKind::Register
                && instr.op0_register() == Register::RSP;
            if !grows {
                return Err(format!(
                    "skipped `{}` moves the stack pointer other than down",
                    insn.text
                ));
            }
        }
        // `mov r64,r64` between argument registers copies an argument.
        let copy = match instr.code() {
            Code::Mov_r64_rm64 | Code::Mov_rm64_r64
                if instr.op0_kind() == OpKind::Register && instr.op1_kind() == OpKind::Register =>
            {
                arg_of(instr.op1_register()).map(|src| self.holds[usize::from(src)])
            }
            _ => None,
        };
        for register in written {
            if let Some(reg) = arg_of(register) {
                self.holds[usize::from(reg)] = match (copy, instr.op0_register()) {
                    (Some(value), dst) if dst.full_register() == register => value,
                    _ => None,
                };
            }
        }
        for arg in 0..6u8 {
            if self.needs.args & (1 << arg) != 0 && self.locate(arg).is_none() {
                let reg = arg_name(arg);
                return Err(format!(
                    "skipped `{}` overwrites argument {arg} ({reg})",
                    insn.text
                ));
            }
        }
        self.skipped.push(format!("`{}`", insn.text));
        Ok(())
    }

    /// Matches `test r,r` / `cmp r,0` on the register holding argument
    /// `ptr` at `insns[at]`, then `je` forward past the fall-through.
    fn null_check(&self, at: usize, ptr: u8) -> Option<String> {
        let reg = register(self.locate(ptr)?)?;
        let check = self.insns.get(at)?;
        let i = &check.instr;
        let tests_ptr = match i.code() {
            Code::Test_rm64_r64 => {
                i.op0_kind() == OpKind::Register
                    && i.op0_register() == reg
                    && i.op1_register() == reg
            }
            Code::Cmp_rm64_imm8 | Code::Cmp_rm64_imm32 => {
                i.op0_kind() == OpKind::Register && i.op0_register() == reg && i.immediate(1) == 0
            }
            _ => false,
        };
        let jump = self.insns.get(at + 1)?;
        let j = &jump.instr;
        let is_je = matches!(j.code(), Code::Je_rel8_64 | Code::Je_rel32_64)
            && j.condition_code() == ConditionCode::e;
        (tests_ptr && is_je && j.near_branch_target() > jump.end())
            .then(|| format!("NULL check `{}; {}`", check.text, jump.mnemonic()))
    }

    /// Accepts the emulated `insns[at]` unless a branch among the bytes
    /// lands in `(0, its offset]`.
    fn accept(&self, at: usize) -> Result<Placement, String> {
        let target_offset = self.insns[at].offset;
        for branch in self.insns {
            if let Some(target) = near_target(&branch.instr) {
                if target > 0 && target <= target_offset {
                    return Err(format!(
                        "`{}` at +{:#x} branches into the skipped bytes (0, {:#x}]",
                        branch.text, branch.offset, target_offset
                    ));
                }
            }
        }
        let (args, moved) = relocated_args(Arch::X86_64, self.needs, |arg| self.locate(arg))?;
        Ok(Placement {
            offset: target_offset,
            reason: PlacementReason::Moved {
                skipped: self.skipped.clone(),
                insn: self.insns[at].text.clone(),
                moved,
            },
            args,
        })
    }
}

fn writes(access: OpAccess) -> bool {
    matches!(
        access,
        OpAccess::Write | OpAccess::CondWrite | OpAccess::ReadWrite | OpAccess::ReadCondWrite
    )
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

#[cfg(test)]
mod tests {
    use super::*;

    const FREE: Needs = Needs::release(0);
    /// `void *f(size_t size)` with a return probe.
    const ALLOC: Needs = Needs {
        args: 0b1,
        keep_stack: true,
        release_ptr: None,
    };
    /// `void *f(void *ptr, size_t size)` with a return probe.
    const REALLOC: Needs = Needs {
        args: 0b11,
        keep_stack: true,
        release_ptr: None,
    };

    include!("../testdata/prologues.rs");

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

    fn at(code: &[u8], needs: Needs) -> (u64, String) {
        let p = choose(code, needs);
        assert!(p.is_emulated(), "{p}");
        (p.offset, p.reason.to_string())
    }

    #[test]
    fn glibc_free_skips_null_check_to_push_rbp() {
        let p = choose(&GLIBC_FREE, FREE);
        assert_eq!(
            p.to_string(),
            "+9 (skipped NULL check `test rdi,rdi; je`; `push rbp` is emulated)"
        );
        assert!(p.is_emulated());
        assert_eq!(p.args, IDENTITY);
    }

    #[test]
    fn glibc_free_as_entry_stops_on_the_je() {
        // An entry probe must see NULL frees too: it stops on the `je`.
        let p = choose(&GLIBC_FREE, Needs::ENTRY);
        assert_eq!(p.offset, 3, "{p}");
        assert!(
            p.reason
                .to_string()
                .starts_with("skipped `test rdi,rdi`; `je"),
            "{p}"
        );
    }

    #[test]
    fn glibc_allocators_start_emulated() {
        for (name, code, insn) in [
            ("malloc", &GLIBC_MALLOC[..], "push r12"),
            ("calloc", &GLIBC_CALLOC[..], "push r13"),
            ("realloc", &GLIBC_REALLOC[..], "push r15"),
        ] {
            for needs in [Needs::ENTRY, FREE] {
                let p = choose(code, needs);
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
    fn glibc_functions_moved_past_flag_only_checks() {
        // posix_memalign, valloc: `cmp byte [rip+..],0` (flags only), then a push.
        assert_eq!(at(&GLIBC_POSIX_MEMALIGN, Needs::ENTRY).0, 7);
        assert_eq!(at(&GLIBC_VALLOC, Needs::ENTRY).0, 7);
        // memalign: the same check, then `je` (emulated).
        assert_eq!(at(&GLIBC_MEMALIGN, Needs::ENTRY).0, 7);
        // mmap: `mov r10d,ecx` writes no argument register, `test r9d,0xfff`
        // only flags; `jne` at +10. mmap reads length (rsi) and flags (rcx).
        let mmap = Needs {
            args: 0b1010,
            keep_stack: true,
            release_ptr: None,
        };
        let (offset, why) = at(&GLIBC_MMAP, mmap);
        assert_eq!(offset, 10, "{why}");
        // munmap: `mov eax,0xb; syscall` leaves the straight line first.
        let p = choose(&GLIBC_MUNMAP, FREE);
        assert_stays(&p);
        assert!(
            p.reason
                .to_string()
                .contains("`syscall` at +0x5 leaves the straight line"),
            "{p}"
        );
    }

    #[test]
    fn null_check_then_more_work_moves_further() {
        // malloc_usable_size: after the NULL check, `mov rcx,[rdi-8]` etc.
        // write rcx/rdx/rax only, up to the `jne` at +0x17.
        let (offset, why) = at(&GLIBC_MALLOC_USABLE_SIZE, FREE);
        assert_eq!(offset, 0x17, "{why}");
        assert!(
            why.starts_with("skipped NULL check `test rdi,rdi; je`, `mov rcx,[rdi-0x8]`"),
            "{why}"
        );
    }

    #[test]
    fn endbr64_then_push_moves_for_every_role() {
        // endbr64; push rbp; mov rbp,rsp; ret
        let code = [0xf3, 0x0f, 0x1e, 0xfa, 0x55, 0x48, 0x89, 0xe5, 0xc3];
        for needs in [Needs::ENTRY, FREE] {
            let p = choose(&code, needs);
            assert_eq!(
                p.to_string(),
                "+4 (skipped `endbr64`; `push rbp` is emulated)"
            );
        }
    }

    #[test]
    fn return_before_any_emulated_instruction_stays() {
        // endbr64; mov rax,rdi; ret
        let code = [0xf3, 0x0f, 0x1e, 0xfa, 0x48, 0x89, 0xf8, 0xc3];
        let p = choose(&code, Needs::ENTRY);
        assert_stays(&p);
        assert_eq!(
            p.reason.to_string(),
            "entry `endbr64` is single-stepped; `ret` at +0x7 leaves the straight line before \
             any emulated instruction; no safe emulated spot"
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
        assert_eq!(
            p.to_string(),
            "+9 (skipped `endbr64`, NULL check `test rdi,rdi; je`; `push rbx` is emulated)"
        );
        // As an entry probe it stops on the `je`, which NULL calls pass too.
        assert_eq!(choose(&code, Needs::ENTRY).offset, 7);
    }

    #[test]
    fn cmp_zero_null_check_near_je() {
        // cmp rsi,0; je near +0x100; push r14
        let code = [
            0x48, 0x83, 0xfe, 0x00, 0x0f, 0x84, 0xf6, 0x00, 0x00, 0x00, 0x41, 0x56, 0xc3,
        ];
        let p = choose(&code, Needs::release(1));
        assert_eq!(
            p.to_string(),
            "+10 (skipped NULL check `cmp rsi,0x0; je`; `push r14` is emulated)"
        );
    }

    #[test]
    fn overwriting_a_read_argument_stays() {
        // mov rdi,[rdi]; push rbp; ret
        let code = [0x48, 0x8b, 0x3f, 0x55, 0xc3];
        let p = choose(&code, FREE);
        assert_stays(&p);
        assert_eq!(
            p.reason.to_string(),
            "entry `mov rdi,[rdi]` is single-stepped; skipped `mov rdi,[rdi]` overwrites \
             argument 0 (rdi); no safe emulated spot"
        );
        // The same write is harmless when the probe does not read rdi.
        let size_only = Needs {
            args: 0b10,
            keep_stack: true,
            release_ptr: None,
        };
        assert_eq!(choose(&code, size_only).offset, 3);
    }

    #[test]
    fn copied_argument_is_followed() {
        // mov rsi,rdi; xor edi,edi; push rbx  -- the size now lives in rsi.
        let code = [0x48, 0x89, 0xfe, 0x31, 0xff, 0x53, 0xc3];
        let p = choose(&code, ALLOC);
        assert_eq!(p.offset, 5, "{p}");
        assert_eq!(p.arg(0), 1);
        assert!(
            p.reason.to_string().ends_with("; argument 0 read from rsi"),
            "{p}"
        );
        // A 32-bit copy is not the 64-bit value.
        let code = [0x89, 0xfe, 0x31, 0xff, 0x53, 0xc3];
        assert_stays(&choose(&code, ALLOC));
    }

    #[test]
    fn moving_the_stack_pointer_is_refused_for_return_probes() {
        // sub rsp,8; call +0  -- fine for a release, not under a uretprobe.
        let code = [0x48, 0x83, 0xec, 0x08, 0xe8, 0x00, 0x00, 0x00, 0x00, 0xc3];
        assert_eq!(choose(&code, FREE).offset, 4);
        // pop rbx; push rbx -- the stack pointer rises: refused even for a release.
        let p = choose(&[0x5b, 0x53, 0xc3], FREE);
        assert_stays(&p);
        assert!(p.reason.to_string().contains("other than down"), "{p}");
        let p = choose(&code, ALLOC);
        assert_stays(&p);
        assert!(
            p.reason.to_string().contains("moves the stack pointer"),
            "{p}"
        );
    }

    #[test]
    fn memory_writes_are_refused() {
        // mov [rsp-8],rdi; push rbp
        let code = [0x48, 0x89, 0x7c, 0x24, 0xf8, 0x55, 0xc3];
        let p = choose(&code, FREE);
        assert_stays(&p);
        assert!(p.reason.to_string().contains("writes memory"), "{p}");
    }

    #[test]
    fn branches_into_the_prefix_stay() {
        // test rdi,rdi; je -> +0 (back to the entry); push rbp; ret
        // A loop to the entry passes the probe again, as an entry probe would.
        let code = [0x48, 0x85, 0xff, 0x74, 0xfb, 0x55, 0xc3];
        assert_eq!(choose(&code, FREE).offset, 3);
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
        assert_eq!(choose(&code, Needs::ENTRY).offset, 4);
    }

    #[test]
    fn only_a_null_check_of_the_pointer_is_skipped() {
        // test rsi,rsi; je; push rbp  -- the pointer is in rdi: stop on the je.
        for code in [
            &[0x48, 0x85, 0xf6, 0x74, 0x0b, 0x55, 0xc3][..],
            // test edi,edi only checks the low half of the pointer.
            &[0x85, 0xff, 0x74, 0x0b, 0x55, 0xc3][..],
            // test rdi,rsi is not a NULL check either.
            &[0x48, 0x85, 0xf7, 0x74, 0x0b, 0x55, 0xc3][..],
            // jne after the test is not the NULL path.
            &[0x48, 0x85, 0xff, 0x75, 0x0b, 0x55, 0xc3][..],
        ] {
            let (offset, why) = at(code, FREE);
            assert!(!why.contains("NULL check"), "{why}");
            assert_eq!(offset, code.len() as u64 - 4, "{why}");
        }
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
        assert_stays(&choose(&[0xf3, 0x0f, 0x1e, 0xfa], Needs::ENTRY));
    }

    #[test]
    fn jemalloc_prologues() {
        // malloc / operator new: `cmp rdi,0x1000; ja` -- the `ja` at +7.
        for code in [JEMALLOC_MALLOC, JEMALLOC__ZNWM] {
            let (offset, why) = at(code, ALLOC);
            assert_eq!(offset, 7, "{why}");
            assert!(why.starts_with("skipped `cmp rdi,0x1000`; `ja "), "{why}");
        }
        // free: register arithmetic on rax/rcx/rdx, then a `jne`.
        let (offset, why) = at(JEMALLOC_FREE, FREE);
        assert_eq!(offset, 0x30, "{why}");
        // sized delete: NULL check, `sub rsp,8` (fine without a return probe), `call`.
        let (offset, why) = at(JEMALLOC__ZDLPVM, FREE);
        assert_eq!(offset, 9, "{why}");
        assert!(
            why.starts_with("skipped NULL check `test rdi,rdi; je`, `sub rsp,0x8`"),
            "{why}"
        );
        // sdallocx(ptr, size, flags): `mov r8,rdi; cmp rsi,0x1000; ja`.
        assert_eq!(at(JEMALLOC_SDALLOCX, FREE).0, 10);
        // rallocx(ptr, size, flags): `xor ecx,ecx; jmp` (rcx is not read).
        assert_eq!(at(JEMALLOC_RALLOCX, REALLOC).0, 2);
        // calloc, mallocx, dallocx, realloc start with a push.
        for code in [
            JEMALLOC_CALLOC,
            JEMALLOC_MALLOCX,
            JEMALLOC_DALLOCX,
            JEMALLOC_REALLOC,
        ] {
            assert_eq!(at(code, REALLOC).0, 0);
        }
    }

    #[test]
    fn tcmalloc_prologues() {
        // malloc (= tc_malloc): `mov rax,[rip+..]; mov r8,rdi; test rax,rax; jne`.
        let (offset, why) = at(TCMALLOC_MALLOC, ALLOC);
        assert_eq!(offset, 13, "{why}");
        // operator new (= tc_new) alike.
        assert_eq!(at(TCMALLOC__ZNWM, ALLOC).0, 13);
        // free (= tc_free, operator delete): `mov rax,[rip+..]; test; jne`.
        assert_eq!(at(TCMALLOC_FREE, FREE).0, 10);
        assert_eq!(at(TCMALLOC__ZDLPVM, FREE).0, 10);
        // realloc starts with a push; calloc's `cmp byte fs:[rcx+0x10],0; jne`.
        assert_eq!(at(TCMALLOC_REALLOC, REALLOC).0, 0);
        let calloc = Needs {
            args: 0b11,
            keep_stack: true,
            release_ptr: None,
        };
        assert_eq!(at(TCMALLOC_CALLOC, calloc).0, 12);
    }

    #[test]
    fn mimalloc_prologues() {
        // malloc (= mi_malloc): `mov rax,[rip+..]; mov rsi,rdi; mov rdi,fs:[rax];
        // cmp rsi,0x400; ja` -- the size is read from rsi at the `ja`.
        for code in [MIMALLOC_MALLOC, MIMALLOC_MI_ZALLOC] {
            let p = choose(code, ALLOC);
            assert_eq!(p.offset, 0x15, "{p}");
            assert_eq!(p.arg(0), 1, "{p}");
        }
        // realloc: ptr and size shuffled to rsi and rdx, then `jmp`.
        let p = choose(MIMALLOC_REALLOC, REALLOC);
        assert_eq!(p.offset, 0x14, "{p}");
        assert_eq!((p.arg(0), p.arg(1)), (1, 2), "{p}");
        // free (= mi_free, operator delete): `mov rcx,rdi`, then its NULL check.
        let (offset, why) = at(MIMALLOC_FREE, FREE);
        assert!(offset >= 6, "{why}");
        // operator new (= mi_new) starts with a push.
        assert_eq!(at(MIMALLOC__ZNWM, ALLOC).0, 0);
    }

    #[test]
    fn every_real_prologue_gets_a_reasoned_placement() {
        for (name, code, needs) in [
            ("jemalloc xallocx", JEMALLOC_XALLOCX, REALLOC),
            (
                "jemalloc posix_memalign",
                JEMALLOC_POSIX_MEMALIGN,
                Needs::ENTRY,
            ),
            (
                "jemalloc aligned_alloc",
                JEMALLOC_ALIGNED_ALLOC,
                Needs::ENTRY,
            ),
            ("jemalloc operator delete", JEMALLOC__ZDLPV, FREE),
            ("tcmalloc aligned new", TCMALLOC__ZNWM_ALIGNED, REALLOC),
            ("tcmalloc tc_memalign", TCMALLOC_TC_MEMALIGN, REALLOC),
            ("mimalloc sized delete", MIMALLOC__ZDLPVM, FREE),
            (
                "mimalloc mi_malloc_aligned",
                MIMALLOC_MI_MALLOC_ALIGNED,
                REALLOC,
            ),
            ("mimalloc mi_free_size", MIMALLOC_MI_FREE_SIZE, FREE),
            ("libstdc++ new[]", LIBSTDCXX__ZNAM, ALLOC),
            ("libstdc++ delete", LIBSTDCXX__ZDLPV, FREE),
        ] {
            let p = choose(code, needs);
            // A jump as the first instruction is emulated at the entry.
            assert!(p.is_emulated(), "{name}: {p}");
            assert!(!p.reason.to_string().is_empty(), "{name}");
        }
        // mimalloc's calloc copies its count to rax (not an argument
        // register) before overwriting rdi: it stays, and says why.
        let p = choose(MIMALLOC_CALLOC, REALLOC);
        assert_stays(&p);
        assert!(
            p.reason.to_string().contains("overwrites argument 0 (rdi)"),
            "{p}"
        );
    }

    #[test]
    fn libstdcxx_operator_new_moves_to_its_push() {
        // endbr64; test rdi,rdi; mov eax,1; push rbx
        let (offset, why) = at(LIBSTDCXX__ZNWM, ALLOC);
        assert_eq!(offset, 12, "{why}");
        // The nothrow form moves rsp before its call: it stays under a uretprobe.
        assert_stays(&choose(LIBSTDCXX__ZNWM_NOTHROW, ALLOC));
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
        assert_eq!(arg_name(0), "rdi");
        assert_eq!(arg_name(5), "r9");
        assert_eq!(register(6), None);
        assert_eq!(arg_name(4), "r8");
        assert_eq!(arg_of(Register::R8D), Some(4));
    }
}
