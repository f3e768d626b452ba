//! A64 (arm64) instruction decoding for probe placement: what the kernel's
//! uprobes do with one instruction word ([`Kernel`]), what a straight-line
//! instruction changes ([`Straight`]), where a direct branch goes, and its
//! text. Only the encodings placement needs are decoded; anything else is
//! [`Straight::Unknown`] (never skipped) and printed as `.inst 0x...`.
//!
//! The kernel classes mirror `arch/arm64/kernel/probes/decode-insn.c` and the
//! encoding masks of `arch/arm64/include/asm/insn.h`:
//! - simulated (no single-step): `b.cond`, `cbz`/`cbnz`, `tbz`/`tbnz`,
//!   `adr`/`adrp`, `b`/`bl`, `br`/`blr`/`ret`, and `nop` (simulated since
//!   6.x; older kernels step it, which costs speed, never correctness);
//! - refused (`arch_uprobe_analyze_insn` fails): literal loads (the kernel
//!   simulated integer ones for uprobes until its 2024 fix; SIMD ones it
//!   would step from the wrong address, so memtrace refuses every literal
//!   load), exclusive loads and stores (`ldxr`, `stxr`, `ldaxp`, ...),
//!   `cpy*`/`set*` memory operations, `msr`, `mrs` other than of `daif`,
//!   exception generation (`svc`, `brk`, ...), `eret`, the
//!   pointer-authenticating branches (`retaa`, `braa`, `blraa`, ...) and
//!   hints other than `nop`, `pac*`, `xpaclri` and `bti`;
//! - everything else is single-stepped out of line.
//!
//! Hand-decoded rather than through a disassembler crate: the kernel itself
//! classifies by these masks, so matching them bit for bit is the faithful
//! model, and the few straight-line classes skipped need their register
//! effects, which disassemblers do not give.

/// What the kernel's arm64 uprobes do with an instruction at the probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Simulated in the breakpoint handler (cheap).
    Simulated,
    /// Single-stepped out of line (a second trap).
    Stepped,
    /// Refused: no uprobe can sit on it. The class, for messages.
    Refused(&'static str),
}

/// How a stack-pointer write moves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpWrite {
    None,
    /// `sub sp, sp, #imm`: the stack only grows.
    Down,
    /// Any other write.
    Other,
}

/// The register effects of a straight-line instruction that writes no memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Effect {
    /// Bit `r` set: writes `x<r>` (or `w<r>`), `r` in 0..=30.
    pub writes: u32,
    pub sp: SpWrite,
    /// `(dst, src)`: a full 64-bit copy `x<dst> = x<src>` (`mov`, `orr`
    /// with `xzr`, `add #0`).
    pub copy: Option<(u8, u8)>,
}

impl Effect {
    const NONE: Effect = Effect {
        writes: 0,
        sp: SpWrite::None,
        copy: None,
    };

    fn writes(reg: u8) -> Effect {
        Effect {
            writes: gpr_bit(reg),
            ..Effect::NONE
        }
    }
}

/// What skipping an instruction would do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Straight {
    /// Falls through, writes no memory, changes only these registers.
    Known(Effect),
    /// Falls through but writes memory (a store).
    WritesMemory,
    /// Not decoded, a branch, or a system instruction: never skipped.
    Unknown,
}

/// A test that can be a NULL check of a pointer register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Test {
    /// `cbz x<r>, target` (64-bit).
    Cbz(u8),
    /// `cmp x<r>, #0` (`subs xzr, x<r>, #0`).
    CmpZero(u8),
    /// `b.eq target`.
    BranchEq,
}

/// One decoded instruction word.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insn {
    pub word: u32,
    pub kernel: Kernel,
    pub straight: Straight,
    /// A direct branch's (or call's) displacement in bytes from this instruction.
    pub branch: Option<i64>,
    pub test: Option<Test>,
    /// Its text; branch targets relative to this instruction (`+0x40`).
    pub text: String,
}

impl Insn {
    /// Its text with branch targets as offsets from the function's entry,
    /// the instruction sitting at `offset`.
    pub fn text_at(&self, offset: u64) -> String {
        match self.branch {
            Some(disp) => {
                let target = i128::from(offset) + i128::from(disp);
                let shown = if target < 0 {
                    format!("-{:#x}", -target)
                } else {
                    format!("+{target:#x}")
                };
                self.text.replace(BRANCH_MARK, &shown)
            }
            None => self.text.clone(),
        }
    }
}

/// Stands for the branch target in [`Insn::text`] until [`Insn::text_at`].
const BRANCH_MARK: &str = "<target>";

fn bits(word: u32, lo: u32, len: u32) -> u32 {
    (word >> lo) & ((1u32 << len) - 1)
}

fn bit(word: u32, at: u32) -> bool {
    (word >> at) & 1 == 1
}

fn gpr_bit(reg: u8) -> u32 {
    if reg < 31 {
        1 << reg
    } else {
        0
    }
}

/// Sign-extends the low `len` bits of `value`.
fn sext(value: u32, len: u32) -> i64 {
    let shift = 64 - len;
    (i64::from(value) << shift) >> shift
}

/// Register `r` of width `sf` (64-bit when true); 31 is `sp` when `sp`, else the zero register.
fn reg(r: u32, sf: bool, sp: bool) -> String {
    match (r, sf, sp) {
        (31, true, true) => "sp".into(),
        (31, false, true) => "wsp".into(),
        (31, true, false) => "xzr".into(),
        (31, false, false) => "wzr".into(),
        (r, true, _) => format!("x{r}"),
        (r, false, _) => format!("w{r}"),
    }
}

fn signed_hex(value: i64) -> String {
    if value < 0 {
        format!("-{:#x}", value.unsigned_abs())
    } else {
        format!("+{value:#x}")
    }
}

fn imm(value: i64) -> String {
    if value < 0 {
        format!("#-{:#x}", value.unsigned_abs())
    } else {
        format!("#{value:#x}")
    }
}

const CONDITIONS: [&str; 16] = [
    "eq", "ne", "hs", "lo", "mi", "pl", "vs", "vc", "hi", "ls", "ge", "lt", "gt", "le", "al", "nv",
];

fn cond(c: u32) -> &'static str {
    CONDITIONS.get(c as usize).copied().unwrap_or("?")
}

/// Decodes one little-endian instruction word.
pub fn decode(word: u32) -> Insn {
    let mut insn = Insn {
        word,
        kernel: kernel_class(word),
        straight: Straight::Unknown,
        branch: None,
        test: None,
        text: String::new(),
    };
    let decoded = branch(word, &mut insn)
        || system(word, &mut insn)
        || data_immediate(word, &mut insn)
        || data_register(word, &mut insn)
        || load_store(word, &mut insn);
    if !decoded || insn.text.is_empty() {
        insn.text = format!(".inst {word:#010x}");
        insn.straight = Straight::Unknown;
    }
    insn
}

/// What the kernel does with `word` at a probe.
pub fn kernel_class(word: u32) -> Kernel {
    let is = |mask: u32, value: u32| word & mask == value;
    if word == NOP || SIMULATED.iter().any(|&(mask, value)| is(mask, value)) {
        return Kernel::Simulated;
    }
    // The branch/exception/system class (op0 = x101x).
    if bits(word, 26, 3) == 0b101 {
        if is(0xff00_0000, 0xd400_0000) {
            return Kernel::Refused("exception generation");
        }
        if is(0xfff8_f01f, 0xd500_401f) || is(0xfff0_0000, 0xd510_0000) {
            return Kernel::Refused("msr");
        }
        if is(0xfff0_0000, 0xd530_0000) {
            return if bits(word, 5, 16) == SYSREG_DAIF {
                Kernel::Stepped
            } else {
                Kernel::Refused("mrs of a register other than daif")
            };
        }
        if is(0xffff_f01f, 0xd503_201f) {
            return if STEPPABLE_HINTS.contains(&bits(word, 5, 7)) {
                Kernel::Stepped
            } else {
                Kernel::Refused("hint the kernel does not step")
            };
        }
        // What remains of the branches: `bc.cond`, and the register forms
        // other than plain br/blr/ret (pointer-authenticating ones, eret,
        // drps): none simulated, none steppable.
        if is(0xff00_0000, 0x5400_0000) || word >> 25 == 0x6b {
            return Kernel::Refused("branch the kernel does not simulate");
        }
        return Kernel::Stepped;
    }
    if is(0x3b00_0000, 0x1800_0000) {
        return Kernel::Refused("literal load");
    }
    if is(0x3f80_0000, 0x0800_0000) {
        return Kernel::Refused("exclusive load/store");
    }
    if is(0x3b20_0c00, 0x1900_0400) {
        return Kernel::Refused("memory copy/set");
    }
    Kernel::Stepped
}

const NOP: u32 = 0xd503_201f;

/// `(mask, value)` of what decode-insn.c's `arm_probe_decode_insn`
/// simulates: b.cond, cbz/cbnz, tbz/tbnz, adr/adrp, b/bl, br, blr, ret.
const SIMULATED: [(u32, u32); 8] = [
    (0xff00_0010, 0x5400_0000),
    (0x7e00_0000, 0x3400_0000),
    (0x7e00_0000, 0x3600_0000),
    (0x1f00_0000, 0x1000_0000),
    (0x7c00_0000, 0x1400_0000),
    (0xffff_fc1f, 0xd61f_0000),
    (0xffff_fc1f, 0xd63f_0000),
    (0xffff_fc1f, 0xd65f_0000),
];
/// `mrs x, daif` (`op0:op1:CRn:CRm:op2`), the one `mrs` the kernel steps.
const SYSREG_DAIF: u32 = 0xda11;
/// Hint numbers (`CRm:op2`) the kernel single-steps: nop, xpaclri,
/// pacia1716, pacib1716, paciaz, paciasp, pacibz, pacibsp, bti, bti c,
/// bti j, bti jc.
const STEPPABLE_HINTS: [u32; 12] = [0, 7, 8, 10, 24, 25, 26, 27, 32, 34, 36, 38];

/// Branches: b, bl, b.cond, cbz/cbnz, tbz/tbnz, br/blr/ret (and the
/// authenticating forms, text only).
fn branch(word: u32, insn: &mut Insn) -> bool {
    if word & 0x7c00_0000 == 0x1400_0000 {
        insn.branch = Some(sext(bits(word, 0, 26), 26) * 4);
        insn.text = format!("{} {BRANCH_MARK}", if bit(word, 31) { "bl" } else { "b" });
    } else if word & 0xff00_0010 == 0x5400_0000 {
        let c = bits(word, 0, 4);
        insn.branch = Some(sext(bits(word, 5, 19), 19) * 4);
        insn.text = format!("b.{} {BRANCH_MARK}", cond(c));
        if c == 0 {
            insn.test = Some(Test::BranchEq);
        }
    } else if word & 0x7e00_0000 == 0x3400_0000 {
        let sf = bit(word, 31);
        let rt = bits(word, 0, 5);
        insn.branch = Some(sext(bits(word, 5, 19), 19) * 4);
        let name = if bit(word, 24) { "cbnz" } else { "cbz" };
        insn.text = format!("{name} {}, {BRANCH_MARK}", reg(rt, sf, false));
        if sf && !bit(word, 24) && rt < 31 {
            insn.test = Some(Test::Cbz(rt as u8));
        }
    } else if word & 0x7e00_0000 == 0x3600_0000 {
        let b = (bits(word, 31, 1) << 5) | bits(word, 19, 5);
        insn.branch = Some(sext(bits(word, 5, 14), 14) * 4);
        let name = if bit(word, 24) { "tbnz" } else { "tbz" };
        let rt = reg(bits(word, 0, 5), b >= 32, false);
        insn.text = format!("{name} {rt}, #{b}, {BRANCH_MARK}");
    } else if word & 0xfe00_0000 == 0xd600_0000 {
        let rn = bits(word, 5, 5);
        let name = match word & 0xffff_fc1f {
            0xd61f_0000 => "br",
            0xd63f_0000 => "blr",
            0xd65f_0000 if rn == 30 => return set(insn, "ret".into()),
            0xd65f_0000 => "ret",
            _ => match word {
                0xd65f_0bff => return set(insn, "retaa".into()),
                0xd65f_0fff => return set(insn, "retab".into()),
                0xd69f_03e0 => return set(insn, "eret".into()),
                _ => return false,
            },
        };
        insn.text = format!("{name} x{rn}");
    } else {
        return false;
    }
    true
}

fn set(insn: &mut Insn, text: String) -> bool {
    insn.text = text;
    true
}

/// Hints, barriers, exceptions, msr/mrs.
fn system(word: u32, insn: &mut Insn) -> bool {
    if word & 0xffff_f01f == 0xd503_201f {
        let hint = bits(word, 5, 7);
        let (name, effect) = match hint {
            0 => ("nop", Effect::NONE),
            1 => ("yield", Effect::NONE),
            2 => ("wfe", Effect::NONE),
            3 => ("wfi", Effect::NONE),
            4 => ("sev", Effect::NONE),
            5 => ("sevl", Effect::NONE),
            // Signing or stripping lr keeps the return address it holds
            // (an unwinder strips authentication bits): not counted as a write.
            7 => ("xpaclri", Effect::NONE),
            8 => ("pacia1716", Effect::writes(17)),
            10 => ("pacib1716", Effect::writes(17)),
            24 => ("paciaz", Effect::NONE),
            25 => ("paciasp", Effect::NONE),
            26 => ("pacibz", Effect::NONE),
            27 => ("pacibsp", Effect::NONE),
            29 => ("autiasp", Effect::writes(30)),
            31 => ("autibsp", Effect::writes(30)),
            // (not skipped: the kernel does not step them)
            32 => ("bti", Effect::NONE),
            34 => ("bti c", Effect::NONE),
            36 => ("bti j", Effect::NONE),
            38 => ("bti jc", Effect::NONE),
            _ => {
                insn.text = format!("hint #{hint:#x}");
                return true;
            }
        };
        insn.text = name.into();
        // Only the hints the kernel steps are skipped.
        if STEPPABLE_HINTS.contains(&hint) {
            insn.straight = Straight::Known(effect);
        }
        return true;
    }
    if word & 0xff00_0000 == 0xd400_0000 {
        let name = match (bits(word, 21, 3), bits(word, 0, 5)) {
            (0, 1) => "svc",
            (0, 2) => "hvc",
            (0, 3) => "smc",
            (1, 0) => "brk",
            (2, 0) => "hlt",
            _ => return false,
        };
        insn.text = format!("{name} #{:#x}", bits(word, 5, 16));
        return true;
    }
    if word & 0xffff_f01f == 0xd503_301f {
        let name = match bits(word, 5, 3) {
            4 => "dsb",
            5 => "dmb",
            6 => "isb",
            _ => return false,
        };
        insn.text = format!("{name} #{}", bits(word, 8, 4));
        return true;
    }
    if word & 0xffd0_0000 == 0xd510_0000 {
        // msr/mrs (register): L = bit 21.
        let rt = bits(word, 0, 5);
        let sysreg = sysreg_name(bits(word, 5, 16));
        if bit(word, 21) {
            insn.text = format!("mrs {}, {sysreg}", reg(rt, true, false));
            // Executed natively when skipped: reads the register into rt.
            insn.straight = Straight::Known(Effect::writes(rt as u8));
        } else {
            insn.text = format!("msr {sysreg}, {}", reg(rt, true, false));
        }
        return true;
    }
    if word & 0xfff8_f01f == 0xd500_401f {
        insn.text = format!("msr pstate, #{}", bits(word, 8, 4));
        return true;
    }
    false
}

fn sysreg_name(enc: u32) -> String {
    match enc {
        0xde82 => "tpidr_el0".into(),
        0xda10 => "nzcv".into(),
        SYSREG_DAIF => "daif".into(),
        0xda20 => "fpcr".into(),
        0xda21 => "fpsr".into(),
        0xd801 => "ctr_el0".into(),
        0xd807 => "dczid_el0".into(),
        0xdf02 => "cntvct_el0".into(),
        _ => {
            let op0 = 2 + (enc >> 14 & 1);
            format!(
                "s{op0}_{}_c{}_c{}_{}",
                enc >> 11 & 7,
                enc >> 7 & 15,
                enc >> 3 & 15,
                enc & 7
            )
        }
    }
}

/// Data processing with an immediate: adr/adrp, add/sub, logical, move
/// wide, bitfield, extract.
fn data_immediate(word: u32, insn: &mut Insn) -> bool {
    let sf = bit(word, 31);
    let rd = bits(word, 0, 5);
    let rn = bits(word, 5, 5);
    if word & 0x1f00_0000 == 0x1000_0000 {
        let lo = bits(word, 29, 2);
        let hi = bits(word, 5, 19);
        let value = sext((hi << 2) | lo, 21);
        insn.text = if bit(word, 31) {
            format!("adrp {}, {}", reg(rd, true, false), imm(value * 4096))
        } else {
            format!("adr {}, {}", reg(rd, true, false), imm(value))
        };
        return true;
    }
    if word & 0x1f80_0000 == 0x1100_0000 {
        // add/sub (immediate); bit 23 set is the tagged form (not decoded).
        let sub = bit(word, 30);
        let flags = bit(word, 29);
        let shift = if bit(word, 22) { 12 } else { 0 };
        let value = i64::from(bits(word, 10, 12)) << shift;
        let dst = reg(rd, sf, !flags);
        let src = reg(rn, sf, true);
        insn.text = match (sub, flags) {
            (false, false) if value == 0 && (rd == 31 || rn == 31) => format!("mov {dst}, {src}"),
            (true, true) if rd == 31 => format!("cmp {src}, {}", imm(value)),
            (false, true) if rd == 31 => format!("cmn {src}, {}", imm(value)),
            _ => {
                let name =
                    ["add", "adds", "sub", "subs"][usize::from(sub) * 2 + usize::from(flags)];
                format!("{name} {dst}, {src}, {}", imm(value))
            }
        };
        let mut effect = Effect::NONE;
        if !flags && rd == 31 {
            effect.sp = if sub && rn == 31 && sf {
                SpWrite::Down
            } else {
                SpWrite::Other
            };
        } else {
            effect.writes = gpr_bit(rd as u8);
        }
        if sf && !flags && value == 0 && rd < 31 && rn < 31 {
            effect.copy = Some((rd as u8, rn as u8));
        }
        if sub && flags && sf && rd == 31 && value == 0 && rn < 31 {
            insn.test = Some(Test::CmpZero(rn as u8));
        }
        insn.straight = Straight::Known(effect);
        return true;
    }
    if word & 0x1f80_0000 == 0x1200_0000 {
        // Logical (immediate).
        let opc = bits(word, 29, 2);
        let n = bit(word, 22);
        let Some(mask) = bit_mask(n, bits(word, 10, 6), bits(word, 16, 6), sf) else {
            return false;
        };
        let dst = reg(rd, sf, opc != 3);
        let src = reg(rn, sf, false);
        insn.text = match opc {
            1 if rn == 31 => format!("mov {dst}, #{mask:#x}"),
            3 if rd == 31 => format!("tst {src}, #{mask:#x}"),
            _ => format!(
                "{} {dst}, {src}, #{mask:#x}",
                ["and", "orr", "eor", "ands"][opc as usize]
            ),
        };
        let mut effect = Effect::NONE;
        if opc != 3 && rd == 31 {
            effect.sp = SpWrite::Other;
        } else {
            effect.writes = gpr_bit(rd as u8);
        }
        insn.straight = Straight::Known(effect);
        return true;
    }
    if word & 0x1f80_0000 == 0x1280_0000 {
        // Move wide.
        let opc = bits(word, 29, 2);
        let hw = bits(word, 21, 2);
        if opc == 1 || (!sf && hw > 1) {
            return false;
        }
        let value = bits(word, 5, 16);
        let name = ["movn", "", "movz", "movk"][opc as usize];
        insn.text = if hw == 0 {
            format!("{name} {}, #{value:#x}", reg(rd, sf, false))
        } else {
            format!(
                "{name} {}, #{value:#x}, lsl #{}",
                reg(rd, sf, false),
                hw * 16
            )
        };
        insn.straight = Straight::Known(Effect::writes(rd as u8));
        return true;
    }
    if word & 0x1f80_0000 == 0x1300_0000 {
        // Bitfield: sbfm, bfm, ubfm.
        let opc = bits(word, 29, 2);
        if opc == 3 || bit(word, 22) != sf {
            return false;
        }
        let name = ["sbfm", "bfm", "ubfm"][opc as usize];
        insn.text = format!(
            "{name} {}, {}, #{}, #{}",
            reg(rd, sf, false),
            reg(rn, sf, false),
            bits(word, 16, 6),
            bits(word, 10, 6)
        );
        insn.straight = Straight::Known(Effect::writes(rd as u8));
        return true;
    }
    if word & 0x1f80_0000 == 0x1380_0000 {
        // Extract.
        if bits(word, 29, 2) != 0 || bit(word, 21) || bit(word, 22) != sf {
            return false;
        }
        insn.text = format!(
            "extr {}, {}, {}, #{}",
            reg(rd, sf, false),
            reg(rn, sf, false),
            reg(bits(word, 16, 5), sf, false),
            bits(word, 10, 6)
        );
        insn.straight = Straight::Known(Effect::writes(rd as u8));
        return true;
    }
    false
}

/// The `DecodeBitMasks` of a logical immediate, or `None` when reserved.
fn bit_mask(n: bool, imms: u32, immr: u32, sf: bool) -> Option<u64> {
    if !sf && n {
        return None;
    }
    let combined = (u32::from(n) << 6) | (!imms & 0x3f);
    let len = 31u32.checked_sub(combined.leading_zeros())?;
    if len == 0 {
        return None;
    }
    let esize = 1u32 << len;
    let levels = esize - 1;
    let s = imms & levels;
    let r = immr & levels;
    if s == levels {
        return None;
    }
    let ones = (1u64 << (s + 1)) - 1;
    let element_mask = if esize == 64 {
        u64::MAX
    } else {
        (1u64 << esize) - 1
    };
    let rotated = if r == 0 {
        ones
    } else {
        ((ones >> r) | (ones << (esize - r))) & element_mask
    };
    let mut value = 0u64;
    let width = if sf { 64 } else { 32 };
    let mut at = 0;
    while at < width {
        value |= rotated << at;
        at += esize;
    }
    Some(if sf { value } else { value & 0xffff_ffff })
}

const SHIFTS: [&str; 4] = ["lsl", "lsr", "asr", "ror"];
const EXTENDS: [&str; 8] = [
    "uxtb", "uxth", "uxtw", "uxtx", "sxtb", "sxth", "sxtw", "sxtx",
];

/// Data processing on registers: logical and add/sub (shifted or extended),
/// with carry, conditional compare and select, 1-, 2- and 3-source.
fn data_register(word: u32, insn: &mut Insn) -> bool {
    let sf = bit(word, 31);
    let rd = bits(word, 0, 5);
    let rn = bits(word, 5, 5);
    let rm = bits(word, 16, 5);
    let x = |r: u32| reg(r, sf, false);
    let writes_rd = Straight::Known(Effect::writes(rd as u8));
    if word & 0x1f00_0000 == 0x0a00_0000 {
        // Logical (shifted register).
        let opc = bits(word, 29, 2);
        let negate = bit(word, 21);
        let amount = bits(word, 10, 6);
        if !sf && amount >= 32 {
            return false;
        }
        let shift = bits(word, 22, 2);
        let operand = if amount == 0 {
            x(rm)
        } else {
            format!("{}, {} #{amount}", x(rm), SHIFTS[shift as usize])
        };
        let name = ["and", "bic", "orr", "orn", "eor", "eon", "ands", "bics"]
            [(opc * 2 + u32::from(negate)) as usize];
        insn.text = match (opc, negate) {
            (1, false) if rn == 31 && amount == 0 => format!("mov {}, {}", x(rd), x(rm)),
            (1, true) if rn == 31 => format!("mvn {}, {operand}", x(rd)),
            (3, false) if rd == 31 => format!("tst {}, {operand}", x(rn)),
            _ => format!("{name} {}, {}, {operand}", x(rd), x(rn)),
        };
        let mut effect = Effect::writes(rd as u8);
        if sf && opc == 1 && !negate && rn == 31 && amount == 0 && rd < 31 {
            effect.copy = Some((rd as u8, rm as u8));
        }
        insn.straight = Straight::Known(effect);
        return true;
    }
    if word & 0x1f20_0000 == 0x0b00_0000 {
        // Add/sub (shifted register).
        let shift = bits(word, 22, 2);
        let amount = bits(word, 10, 6);
        if shift == 3 || (!sf && amount >= 32) {
            return false;
        }
        let (sub, flags) = (bit(word, 30), bit(word, 29));
        let operand = if amount == 0 {
            x(rm)
        } else {
            format!("{}, {} #{amount}", x(rm), SHIFTS[shift as usize])
        };
        insn.text = match (sub, flags) {
            (true, true) if rd == 31 => format!("cmp {}, {operand}", x(rn)),
            (false, true) if rd == 31 => format!("cmn {}, {operand}", x(rn)),
            (true, _) if rn == 31 => {
                format!(
                    "{} {}, {operand}",
                    if flags { "negs" } else { "neg" },
                    x(rd)
                )
            }
            _ => {
                let name =
                    ["add", "adds", "sub", "subs"][usize::from(sub) * 2 + usize::from(flags)];
                format!("{name} {}, {}, {operand}", x(rd), x(rn))
            }
        };
        insn.straight = writes_rd;
        return true;
    }
    if word & 0x1f20_0000 == 0x0b20_0000 {
        // Add/sub (extended register): rd (without flags) and rn may be sp.
        let option = bits(word, 13, 3);
        let amount = bits(word, 10, 3);
        if bits(word, 22, 2) != 0 || amount > 4 {
            return false;
        }
        let (sub, flags) = (bit(word, 30), bit(word, 29));
        let name = ["add", "adds", "sub", "subs"][usize::from(sub) * 2 + usize::from(flags)];
        let wide = sf && option & 3 == 3;
        insn.text = format!(
            "{name} {}, {}, {}, {} #{amount}",
            reg(rd, sf, !flags),
            reg(rn, sf, true),
            reg(rm, wide, false),
            EXTENDS[option as usize]
        );
        insn.straight = Straight::Known(if !flags && rd == 31 {
            Effect {
                sp: SpWrite::Other,
                ..Effect::NONE
            }
        } else {
            Effect::writes(rd as u8)
        });
        return true;
    }
    if word & 0x1fe0_fc00 == 0x1a00_0000 {
        let name = ["adc", "adcs", "sbc", "sbcs"][bits(word, 29, 2) as usize];
        insn.text = format!("{name} {}, {}, {}", x(rd), x(rn), x(rm));
        insn.straight = writes_rd;
        return true;
    }
    if word & 0x3fe0_0410 == 0x3a40_0000 {
        // Conditional compare (register or immediate): flags only.
        let name = if bit(word, 30) { "ccmp" } else { "ccmn" };
        let operand = if bit(word, 11) {
            format!("#{rm:#x}")
        } else {
            x(rm)
        };
        insn.text = format!(
            "{name} {}, {operand}, #{:#x}, {}",
            x(rn),
            bits(word, 0, 4),
            cond(bits(word, 12, 4))
        );
        insn.straight = Straight::Known(Effect::NONE);
        return true;
    }
    if word & 0x3fe0_0800 == 0x1a80_0000 {
        // Conditional select.
        let op = usize::from(bit(word, 30)) * 2 + bits(word, 10, 1) as usize;
        let c = bits(word, 12, 4);
        insn.text = if op == 1 && rn == 31 && rm == 31 && c < 14 {
            format!("cset {}, {}", x(rd), cond(c ^ 1))
        } else {
            let name = ["csel", "csinc", "csinv", "csneg"][op];
            format!("{name} {}, {}, {}, {}", x(rd), x(rn), x(rm), cond(c))
        };
        insn.straight = writes_rd;
        return true;
    }
    if word & 0x7fe0_0000 == 0x1ac0_0000 {
        // Data processing (2 source).
        let name = match bits(word, 10, 6) {
            0b00_0010 => "udiv",
            0b00_0011 => "sdiv",
            0b00_1000 => "lsl",
            0b00_1001 => "lsr",
            0b00_1010 => "asr",
            0b00_1011 => "ror",
            _ => return false,
        };
        insn.text = format!("{name} {}, {}, {}", x(rd), x(rn), x(rm));
        insn.straight = writes_rd;
        return true;
    }
    if word & 0x7fff_0000 == 0x5ac0_0000 {
        // Data processing (1 source).
        let name = match (bits(word, 10, 6), sf) {
            (0, _) => "rbit",
            (1, _) => "rev16",
            (2, true) => "rev32",
            (2, false) | (3, true) => "rev",
            (4, _) => "clz",
            (5, _) => "cls",
            _ => return false,
        };
        insn.text = format!("{name} {}, {}", x(rd), x(rn));
        insn.straight = writes_rd;
        return true;
    }
    if word & 0x7f00_0000 == 0x1b00_0000 {
        // Data processing (3 source).
        let ra = bits(word, 10, 5);
        let o0 = bit(word, 15);
        let name = match (bits(word, 21, 3), o0) {
            (0, false) if ra == 31 => "mul",
            (0, false) => "madd",
            (0, true) => "msub",
            (1, false) if sf => "smaddl",
            (1, true) if sf => "smsubl",
            (2, false) if sf => "smulh",
            (5, false) if sf => "umaddl",
            (5, true) if sf => "umsubl",
            (6, false) if sf => "umulh",
            _ => return false,
        };
        let narrow = matches!(name, "smaddl" | "smsubl" | "umaddl" | "umsubl");
        let src = |r: u32| reg(r, sf && !narrow, false);
        insn.text = if matches!(name, "mul" | "smulh" | "umulh") {
            format!("{name} {}, {}, {}", x(rd), src(rn), src(rm))
        } else {
            format!("{name} {}, {}, {}, {}", x(rd), src(rn), src(rm), x(ra))
        };
        insn.straight = writes_rd;
        return true;
    }
    false
}

/// Loads and stores of general registers (single and pair; SIMD ones
/// only as far as their text and that they write no general register).
fn load_store(word: u32, insn: &mut Insn) -> bool {
    let rt = bits(word, 0, 5);
    let rn = bits(word, 5, 5);
    let simd = bit(word, 26);
    if word & 0x3a00_0000 == 0x2800_0000 {
        return pair(word, insn);
    }
    if word & 0x3b00_0000 == 0x1800_0000 {
        // Literal loads (refused at a probe, text only).
        let disp = sext(bits(word, 5, 19), 19) * 4;
        let target = signed_hex(disp);
        insn.text = match (bits(word, 30, 2), simd) {
            (0, false) => format!("ldr {}, pc{target}", reg(rt, false, false)),
            (1, false) => format!("ldr {}, pc{target}", reg(rt, true, false)),
            (2, false) => format!("ldrsw {}, pc{target}", reg(rt, true, false)),
            (_, false) => format!("prfm #{rt}, pc{target}"),
            (_, true) => format!("ldr v{rt}, pc{target}"),
        };
        return true;
    }
    if word & 0x3f00_0000 == 0x0800_0000 {
        // Exclusives and ordered loads/stores (text only).
        let load = bit(word, 22);
        let acquire = bit(word, 15);
        let exclusive = !bit(word, 23);
        let name = match (load, exclusive, acquire) {
            (true, true, false) => "ldx",
            (true, true, true) => "ldax",
            (false, true, false) => "stx",
            (false, true, true) => "stlx",
            (true, false, _) => "lda",
            (false, false, _) => "stl",
        };
        let size = bits(word, 30, 2);
        let pair = if exclusive && bit(word, 21) { "p" } else { "r" };
        let suffix = ["b", "h", "", ""][size as usize];
        insn.text = format!(
            "{}{pair}{suffix} {}, [{}]",
            name,
            reg(rt, size == 3, false),
            reg(rn, true, true)
        );
        return true;
    }
    let single = word & 0x3b00_0000 == 0x3900_0000
        || word & 0x3b20_0000 == 0x3800_0000
        || word & 0x3b20_0c00 == 0x3820_0800;
    if !single {
        return false;
    }
    // Single register: unsigned offset, unscaled/pre/post/unprivileged, or
    // register offset.
    let size = bits(word, 30, 2);
    let opc = bits(word, 22, 2);
    let Some(access) = access(size, opc, simd) else {
        return false;
    };
    let base = reg(rn, true, true);
    let (kind, address, writeback) = if word & 0x3b00_0000 == 0x3900_0000 {
        let offset = i64::from(bits(word, 10, 12)) << access.scale;
        let address = if offset == 0 {
            format!("[{base}]")
        } else {
            format!("[{base}, #{offset}]")
        };
        ("", address, false)
    } else if word & 0x3b20_0c00 == 0x3820_0800 {
        let option = bits(word, 13, 3);
        if option & 2 == 0 {
            return false;
        }
        let index = reg(rm_of(word), option & 1 == 1, false);
        let amount = if bit(word, 12) { access.scale } else { 0 };
        let extend = match (option, amount) {
            (3, 0) => String::new(),
            (3, n) => format!(", lsl #{n}"),
            (o, 0) => format!(", {}", EXTENDS[o as usize]),
            (o, n) => format!(", {} #{n}", EXTENDS[o as usize]),
        };
        ("", format!("[{base}, {index}{extend}]"), false)
    } else {
        let offset = sext(bits(word, 12, 9), 9);
        match bits(word, 10, 2) {
            0 => ("u", format!("[{base}, #{offset}]"), false),
            1 => ("", format!("[{base}], #{offset}"), true),
            2 => ("t", format!("[{base}, #{offset}]"), false),
            _ => ("", format!("[{base}, #{offset}]!"), true),
        }
    };
    if access.prefetch && (writeback || kind == "t") {
        return false; // unallocated
    }
    let name = access.name(kind);
    let target = if access.prefetch {
        format!("#{rt}")
    } else if simd {
        format!("{}{rt}", access.simd_reg)
    } else {
        reg(rt, access.wide, false)
    };
    insn.text = format!("{name} {target}, {address}");
    insn.straight = if access.store {
        Straight::WritesMemory
    } else {
        let mut effect = Effect::NONE;
        if !simd && !access.prefetch {
            effect.writes = gpr_bit(rt as u8);
        }
        if writeback {
            writeback_effect(&mut effect, rn);
        }
        Straight::Known(effect)
    };
    true
}

fn rm_of(word: u32) -> u32 {
    bits(word, 16, 5)
}

fn writeback_effect(effect: &mut Effect, rn: u32) {
    if rn == 31 {
        effect.sp = SpWrite::Other;
    } else {
        effect.writes |= gpr_bit(rn as u8);
    }
}

/// One single-register load/store form.
struct Access {
    store: bool,
    prefetch: bool,
    /// The general register is 64-bit.
    wide: bool,
    /// log2 of the access size (the unsigned offset's scale).
    scale: u32,
    /// The SIMD register letter (`b`, `h`, `s`, `d`, `q`).
    simd_reg: char,
    /// `b`, `h`, `sb`, `sh`, `sw` or nothing.
    suffix: &'static str,
}

impl Access {
    fn name(&self, kind: &str) -> String {
        if self.prefetch {
            return format!("prf{}m", if kind == "u" { "u" } else { "" });
        }
        let op = if self.store { "st" } else { "ld" };
        let kind = match kind {
            "u" => "ur",
            "t" => "tr",
            _ => "r",
        };
        format!("{op}{kind}{}", self.suffix)
    }
}

fn access(size: u32, opc: u32, simd: bool) -> Option<Access> {
    let plain = |store: bool, wide: bool, suffix: &'static str| Access {
        store,
        prefetch: false,
        wide,
        scale: size,
        simd_reg: ' ',
        suffix,
    };
    if simd {
        let (scale, letter) = match (size, opc >> 1) {
            (0, 0) => (0, 'b'),
            (1, 0) => (1, 'h'),
            (2, 0) => (2, 's'),
            (3, 0) => (3, 'd'),
            (0, 1) => (4, 'q'),
            _ => return None,
        };
        return Some(Access {
            store: opc & 1 == 0,
            prefetch: false,
            wide: false,
            scale,
            simd_reg: letter,
            suffix: "",
        });
    }
    let suffix = ["b", "h", "", ""][size as usize];
    Some(match (size, opc) {
        (_, 0) => plain(true, size == 3, suffix),
        (_, 1) => plain(false, size == 3, suffix),
        (0, 2) => plain(false, true, "sb"),
        (1, 2) => plain(false, true, "sh"),
        (2, 2) => plain(false, true, "sw"),
        (3, 2) => Access {
            prefetch: true,
            ..plain(false, true, "")
        },
        (0, 3) => plain(false, false, "sb"),
        (1, 3) => plain(false, false, "sh"),
        _ => return None,
    })
}

/// Load/store pair (no-allocate, post-index, offset, pre-index).
fn pair(word: u32, insn: &mut Insn) -> bool {
    let opc = bits(word, 30, 2);
    let simd = bit(word, 26);
    let load = bit(word, 22);
    let mode = bits(word, 23, 2);
    let (rt, rt2, rn) = (bits(word, 0, 5), bits(word, 10, 5), bits(word, 5, 5));
    let (scale, width) = match (opc, simd) {
        (0, false) => (2, 'w'),
        (2, false) => (3, 'x'),
        (1, false) if load => (2, 'x'), // ldpsw
        (0, true) => (2, 's'),
        (1, true) => (3, 'd'),
        (2, true) => (4, 'q'),
        _ => return false,
    };
    if mode == 0 && opc == 1 && !simd {
        return false;
    }
    let name = match (load, mode == 0, opc == 1 && !simd) {
        (true, _, true) => "ldpsw",
        (true, true, _) => "ldnp",
        (true, false, _) => "ldp",
        (false, true, _) => "stnp",
        (false, false, _) => "stp",
    };
    let offset = sext(bits(word, 15, 7), 7) << scale;
    let base = reg(rn, true, true);
    let address = match mode {
        1 => format!("[{base}], #{offset}"),
        3 => format!("[{base}, #{offset}]!"),
        _ if offset == 0 => format!("[{base}]"),
        _ => format!("[{base}, #{offset}]"),
    };
    let name_reg = |r: u32| {
        if simd {
            format!("{width}{r}")
        } else {
            reg(r, width == 'x', false)
        }
    };
    insn.text = format!("{name} {}, {}, {address}", name_reg(rt), name_reg(rt2));
    insn.straight = if load {
        let mut effect = Effect::NONE;
        if !simd {
            effect.writes = gpr_bit(rt as u8) | gpr_bit(rt2 as u8);
        }
        if mode == 1 || mode == 3 {
            writeback_effect(&mut effect, rn);
        }
        Straight::Known(effect)
    } else {
        Straight::WritesMemory
    };
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(word: u32) -> String {
        decode(word).text_at(0)
    }

    fn known(word: u32) -> Effect {
        match decode(word).straight {
            Straight::Known(effect) => effect,
            other => panic!("{:#010x} ({}) is {other:?}", word, text(word)),
        }
    }

    #[test]
    fn kernel_classes_follow_decode_insn() {
        use Kernel::*;
        for (word, class) in [
            (0xb400_0880, Simulated),                                      // cbz x0
            (0x3500_06e1, Simulated),                                      // cbnz w1
            (0x3608_0241, Simulated),                                      // tbz w1, #1
            (0x5400_04c9, Simulated),                                      // b.ls
            (0xf000_08b5, Simulated),                                      // adrp x21
            (0x17ff_f164, Simulated),                                      // b
            (0x97ff_e59a, Simulated),                                      // bl
            (0xd63f_0000, Simulated),                                      // blr x0
            (0xd61f_0220, Simulated),                                      // br x17
            (0xd65f_03c0, Simulated),                                      // ret
            (NOP, Simulated),                                              // nop
            (0xa9bc_7bfd, Stepped), // stp x29, x30, [sp, #-64]!
            (0x9100_03fd, Stepped), // mov x29, sp
            (0xd503_233f, Stepped), // paciasp
            (0xd503_245f, Stepped), // bti c
            (0xd503_3bbf, Stepped), // dmb ish
            (0xd53b_4220, Stepped), // mrs x0, daif
            (0xc8df_fc01, Stepped), // ldar x1, [x0]
            (0xd53b_d054, Refused("mrs of a register other than daif")), // mrs x20, tpidr_el0
            (0xd51b_d040, Refused("msr")), // msr tpidr_el0, x0
            (0xd500_40bf, Refused("msr")), // msr spsel, #0
            (0xd400_0001, Refused("exception generation")), // svc #0
            (0xd420_0000, Refused("exception generation")), // brk #0
            (0xd503_23bf, Refused("hint the kernel does not step")), // autiasp
            (0xd503_203f, Refused("hint the kernel does not step")), // yield
            (0xd65f_0bff, Refused("branch the kernel does not simulate")), // retaa
            (0xd61f_081f, Refused("branch the kernel does not simulate")), // braa x0, sp
            (0xd69f_03e0, Refused("branch the kernel does not simulate")), // eret
            (0x5400_0010, Refused("branch the kernel does not simulate")), // bc.eq
            (0x5800_0050, Refused("literal load")), // ldr x16, pc+8
            (0x1800_0050, Refused("literal load")), // ldr w16, pc+8
            (0x9800_0050, Refused("literal load")), // ldrsw x16, pc+8
            (0xd800_0040, Refused("literal load")), // prfm pldl1keep, pc+8
            (0x9c00_0040, Refused("literal load")), // ldr q0, pc+8
            (0xc85f_7c01, Refused("exclusive load/store")), // ldxr x1, [x0]
            (0xc85f_fc01, Refused("exclusive load/store")), // ldaxr x1, [x0]
            (0xc802_7c01, Refused("exclusive load/store")), // stxr w2, x1, [x0]
            (0xc87f_0801, Refused("exclusive load/store")), // ldxp x1, x2, [x0]
            (0x885f_7c01, Refused("exclusive load/store")), // ldxr w1, [x0]
            (0x1900_0441, Refused("memory copy/set")), // cpyfp [x1]!, [x2]!, x0!
        ] {
            assert_eq!(kernel_class(word), class, "{word:#010x} {}", text(word));
        }
    }

    #[test]
    fn texts_of_real_prologue_instructions() {
        for (word, want) in [
            (0xb400_0880, "cbz x0, +0x110"),
            (0xa9bc_7bfd, "stp x29, x30, [sp, #-64]!"),
            (0x9100_03fd, "mov x29, sp"),
            (0xa902_5bf5, "stp x21, x22, [sp, #32]"),
            (0x9125_62a1, "add x1, x21, #0x958"),
            (0xd53b_d054, "mrs x20, tpidr_el0"),
            (0xd100_4013, "sub x19, x0, #0x10"),
            (0x3940_8421, "ldrb w1, [x1, #33]"),
            (0xf900_1bf7, "str x23, [sp, #48]"),
            (0xf946_e2f7, "ldr x23, [x23, #3520]"),
            (0xb877_6a96, "ldr w22, [x20, x23]"),
            (0x3608_0241, "tbz w1, #1, +0x48"),
            (0xd2a0_4003, "movz x3, #0x200, lsl #16"),
            (0xeb04_003f, "cmp x1, x4"),
            (0xfa43_8022, "ccmp x1, x3, #0x2, hi"),
            (0x5400_04c9, "b.ls +0x98"),
            (0xaa13_03e0, "mov x0, x19"),
            (0x97ff_ee44, "bl -0x46f0"),
            (0xa941_53f3, "ldp x19, x20, [sp, #16]"),
            (0xa8c2_7bfd, "ldp x29, x30, [sp], #32"),
            (0x9bc1_7c02, "umulh x2, x0, x1"),
            (0x9b01_7c13, "mul x19, x0, x1"),
            (0xf100_005f, "cmp x2, #0x0"),
            (0x9a9f_07e0, "cset x0, ne"),
            (0xb7f8_1973, "tbnz x19, #63, +0x32c"),
            (0x9a9f_1413, "csinc x19, x0, xzr, ne"),
            (0xd343_fe64, "ubfm x4, x19, #3, #63"),
            (0x9240_0a65, "and x5, x19, #0x7"),
            (0x5280_02c0, "movz w0, #0x16"),
            (0x8a04_0063, "and x3, x3, x4"),
            (0xd280_1ae8, "movz x8, #0xd7"),
            (0xb13f_fc1f, "cmn x0, #0xfff"),
            (0xd400_0001, "svc #0x0"),
            (0xd503_233f, "paciasp"),
            (0xd503_245f, "bti c"),
            (0xd65f_03c0, "ret"),
            (0xd61f_0220, "br x17"),
            (0x5800_0050, "ldr x16, pc+0x8"),
            (0xc85f_7c01, "ldxr x1, [x0]"),
            (0xc87f_0801, "ldxp x1, [x0]"),
            (0x885f_fc01, "ldaxr w1, [x0]"),
            (0xd10043ff, "sub sp, sp, #0x10"),
            (0xf81f_0fe0, "str x0, [sp, #-16]!"),
            (0xf85f_83a0, "ldur x0, [x29, #-8]"),
            (0xb240_03e0, "mov x0, #0x1"),
            (0x0000_0000, ".inst 0x00000000"),
        ] {
            assert_eq!(text(word), want, "{word:#010x}");
        }
    }

    #[test]
    fn effects_of_skippable_instructions() {
        // mov x1, x0 (orr x1, xzr, x0) copies; mov w1, w0 does not.
        assert_eq!(known(0xaa00_03e1).copy, Some((1, 0)));
        assert_eq!(known(0x2a00_03e1).copy, None);
        assert_eq!(known(0x2a00_03e1).writes, 0b10);
        // add x2, x0, #0 copies too; add x2, x0, #1 writes only.
        assert_eq!(known(0x9100_0002).copy, Some((2, 0)));
        assert_eq!(known(0x9100_0402).copy, None);
        // sub sp, sp, #16 grows the stack; add sp, sp, #16 and mov sp, x0 do not.
        assert_eq!(known(0xd100_43ff).sp, SpWrite::Down);
        assert_eq!(known(0x9100_43ff).sp, SpWrite::Other);
        assert_eq!(known(0x9100_001f).sp, SpWrite::Other);
        // cmp x0, #0 writes no register and is a NULL test.
        assert_eq!(known(0xf100_001f), Effect::NONE);
        assert_eq!(decode(0xf100_001f).test, Some(Test::CmpZero(0)));
        // Loads write their targets and any writeback base.
        assert_eq!(known(0xa941_53f3).writes, (1 << 19) | (1 << 20));
        assert_eq!(known(0xa8c2_7bfd).sp, SpWrite::Other);
        assert_eq!(known(0xf840_8c01).writes, 0b11); // ldr x1, [x0, #8]!
                                                     // Hints: paciasp and bti c change nothing an argument lives in.
        assert_eq!(known(0xd503_233f), Effect::NONE);
        assert_eq!(known(0xd503_245f), Effect::NONE);
        // Stores write memory; branches and system instructions are unknown.
        assert_eq!(decode(0xa9bc_7bfd).straight, Straight::WritesMemory);
        assert_eq!(decode(0xf900_1bf7).straight, Straight::WritesMemory);
        assert_eq!(decode(0xd400_0001).straight, Straight::Unknown);
        assert_eq!(decode(0xb400_0880).straight, Straight::Unknown);
        assert_eq!(decode(0xc85f_7c01).straight, Straight::Unknown);
        assert_eq!(decode(0x0000_0000).straight, Straight::Unknown);
        // Only a 64-bit cbz is a NULL test.
        assert_eq!(decode(0xb400_0880).test, Some(Test::Cbz(0)));
        assert_eq!(decode(0x3400_0880).test, None);
        assert_eq!(decode(0x3500_06e1).test, None);
        assert_eq!(decode(0x5400_0040).test, Some(Test::BranchEq));
    }

    #[test]
    fn branch_displacements() {
        assert_eq!(decode(0x17ff_f164).branch, Some(-0x3a70));
        assert_eq!(decode(0x1400_0010).branch, Some(0x40));
        assert_eq!(decode(0xb400_0880).branch, Some(0x110));
        assert_eq!(decode(0x3608_0241).branch, Some(0x48));
        assert_eq!(decode(0x54ff_ffe0).branch, Some(-4));
        assert_eq!(decode(0xd65f_03c0).branch, None);
        assert_eq!(decode(0xb400_0880).text_at(0x10), "cbz x0, +0x120");
    }

    #[test]
    fn logical_immediates() {
        // and x5, x19, #0x7
        assert_eq!(bit_mask(true, 0b000010, 0, true), Some(7));
        // orr w0, wzr, #0xff00ff00 style replicated patterns
        assert_eq!(bit_mask(false, 0b100111, 8, false), Some(0xff00_ff00));
        assert_eq!(bit_mask(true, 0b111111, 0, true), None);
        assert_eq!(bit_mask(true, 0, 0, false), None);
        assert_eq!(
            bit_mask(true, 0b111110, 1, true),
            Some(0x7fff_ffff_ffff_ffff_u64.rotate_right(1))
        );
    }
}
