//! arm64 probe placement: where on an aarch64 function's first instructions
//! (decoded by [`super::a64`]) its probe goes.
//!
//! Rules, from the kernel's arm64 uprobes:
//! - An entry the kernel refuses (literal load, exclusive, `msr`, `svc`,
//!   ...) cannot be probed: [`PlacementReason::Refused`], which the caller
//!   turns into a skipped function with a warning. Nothing else here ever
//!   lands on a refused instruction: only simulated ones are candidates.
//! - A function with a return probe ([`Needs::keep_stack`]) keeps its probe
//!   at the entry: the uretprobe replaces x30 (the return address) when the
//!   probe hits, which is only right before the function saved x30.
//! - A plain release ([`Needs::release_ptr`], no return probe) may move to
//!   the first instruction the kernel simulates, past straight-line
//!   instructions that write no memory, neither x29 nor x30 (the stack walk
//!   starts from them), move the stack pointer only down, and leave every
//!   argument the probe reads in an argument register (`mov xD, xN` copies
//!   are followed); and past a NULL check of its pointer (`cbz xP, fwd`, or
//!   `cmp xP, #0; b.eq fwd`) jumping forward past the candidate, so NULL
//!   releases never fire. The check's branch is simulated itself: when
//!   nothing past it qualifies, the probe sits on it. `paciasp`/`bti c`
//!   prologues are single-stepped hints that change no argument: skipped.
//! - No direct branch among the instructions given may land inside the
//!   skipped prefix or on the candidate (a call to the entry is fine).
//! - Otherwise the entry.
//!
//! On kernels before simulated `nop` (6.x), a probe on `nop` is stepped:
//! slower, never wrong.

use super::a64::{self, Insn, Kernel, SpWrite, Straight, Test};
use super::{relocated_args, stay, ArgReg, Needs, Placement, PlacementReason, ARG_REGS, IDENTITY};
use crate::arch::Arch;

/// x29 (frame pointer) and x30 (link register): never skipped over a write.
const FP_LR: u32 = (1 << 29) | (1 << 30);

/// One instruction of the function at `offset` from its entry.
struct Decoded {
    offset: u64,
    insn: Insn,
}

impl Decoded {
    fn text(&self) -> String {
        self.insn.text_at(self.offset)
    }

    fn simulated(&self) -> bool {
        self.insn.kernel == Kernel::Simulated
    }

    /// The function-relative target of a direct branch.
    fn target(&self) -> Option<i128> {
        self.insn
            .branch
            .map(|disp| i128::from(self.offset) + i128::from(disp))
    }
}

fn decode(code: &[u8]) -> Vec<Decoded> {
    code.chunks_exact(4)
        .zip((0u64..).step_by(4))
        .map(|(bytes, offset)| Decoded {
            offset,
            insn: a64::decode(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])),
        })
        .collect()
}

fn arg_name(index: u8) -> &'static str {
    ArgReg::nth(Arch::Aarch64, usize::from(index)).map_or("?", ArgReg::name)
}

/// Chooses where to attach a probe with `needs` to the arm64 function whose
/// first bytes (at its entry, up to [`super::WINDOW`]) are `code`.
pub fn choose(code: &[u8], needs: Needs) -> Placement {
    let insns = decode(code);
    let Some(first) = insns.first() else {
        return stay(None, "no whole instruction in the bytes".to_string());
    };
    if let Kernel::Refused(why) = first.insn.kernel {
        return Placement {
            offset: 0,
            reason: PlacementReason::Refused {
                entry: first.text(),
                why: why.to_string(),
            },
            args: IDENTITY,
        };
    }
    let entry = |why: &str| {
        if first.simulated() {
            Placement {
                offset: 0,
                reason: PlacementReason::EntryEmulated { insn: first.text() },
                args: IDENTITY,
            }
        } else {
            stay(Some(first.text()), why.to_string())
        }
    };
    if needs.keep_stack {
        return entry("a return probe stays at the entry on arm64 (its uretprobe takes x30 there)");
    }
    let Some(ptr) = needs.release_ptr else {
        return entry("only plain releases move on arm64");
    };
    let mut walk = Walk {
        insns: &insns,
        needs,
        holds: [Some(0), Some(1), Some(2), Some(3), Some(4), Some(5)],
        skipped: Vec::new(),
    };
    let mut fallback: Option<Placement> = None;
    let mut at = 0;
    loop {
        let Some(insn) = insns.get(at) else {
            let why = "the bytes end before a simulated instruction";
            return fallback.unwrap_or_else(|| entry(why));
        };
        if let Some((check, branch_at)) = walk.null_check(at, ptr) {
            // The check's branch is simulated: a spot NULL releases reach too.
            if fallback.is_none() {
                let mut at_branch = walk.clone();
                if branch_at > at {
                    at_branch.skipped.push(format!("`{}`", insn.text()));
                }
                fallback = at_branch.accept(branch_at).ok();
            }
            walk.skipped.push(check);
            at = branch_at + 1;
            continue;
        }
        if insn.simulated() {
            return match walk.accept(at) {
                Ok(placement) => placement,
                Err(why) => {
                    fallback.unwrap_or_else(|| entry(&format!("{why}; no safe simulated spot")))
                }
            };
        }
        if let Err(why) = walk.skip(at) {
            return fallback.unwrap_or_else(|| entry(&format!("{why}; no safe simulated spot")));
        }
        at += 1;
    }
}

/// The state of [`choose`]'s walk down the prefix.
#[derive(Clone)]
struct Walk<'a> {
    insns: &'a [Decoded],
    needs: Needs,
    /// `holds[r]`: which original argument `x<r>` still holds.
    holds: [Option<u8>; 6],
    skipped: Vec<String>,
}

impl Walk<'_> {
    /// The register now holding original argument `arg`, preferring its own.
    fn locate(&self, arg: u8) -> Option<u8> {
        if self.holds.get(usize::from(arg)).copied().flatten() == Some(arg) {
            return Some(arg);
        }
        self.holds
            .iter()
            .position(|h| *h == Some(arg))
            .and_then(|r| u8::try_from(r).ok())
    }

    /// Skips the non-simulated `insns[at]`, or says why it cannot be skipped.
    fn skip(&mut self, at: usize) -> Result<(), String> {
        let insn = &self.insns[at];
        let text = insn.text();
        let effect = match insn.insn.straight {
            Straight::Known(effect) => effect,
            Straight::WritesMemory => return Err(format!("skipped `{text}` writes memory")),
            Straight::Unknown => {
                return Err(format!(
                    "`{text}` at +{:#x} is not a straight-line instruction known to keep \
                     the arguments",
                    insn.offset
                ))
            }
        };
        if effect.writes & FP_LR != 0 {
            return Err(format!(
                "skipped `{text}` writes x29 or x30 (the stack walk starts from them)"
            ));
        }
        match effect.sp {
            SpWrite::None => {}
            SpWrite::Down if !self.needs.keep_stack => {}
            SpWrite::Down => {
                return Err(format!(
                    "skipped `{text}` moves the stack pointer (a return probe needs it)"
                ))
            }
            SpWrite::Other => {
                return Err(format!(
                    "skipped `{text}` moves the stack pointer other than down"
                ))
            }
        }
        let copied = effect.copy.map(|(dst, src)| {
            let value = self.holds.get(usize::from(src)).copied().flatten();
            (dst, value)
        });
        for reg in 0..ARG_REGS {
            if effect.writes & (1 << reg) != 0 {
                self.holds[usize::from(reg)] = match copied {
                    Some((dst, value)) if dst == reg => value,
                    _ => None,
                };
            }
        }
        for arg in 0..ARG_REGS {
            if self.needs.args & (1 << arg) != 0 && self.locate(arg).is_none() {
                return Err(format!(
                    "skipped `{text}` overwrites argument {arg} ({})",
                    arg_name(arg)
                ));
            }
        }
        self.skipped.push(format!("`{text}`"));
        Ok(())
    }

    /// A NULL check of the register holding argument `ptr` at `insns[at]`:
    /// `cbz xP, fwd`, or `cmp xP, #0; b.eq fwd`, branching forward. Returns
    /// its description and the index of its (simulated) branch.
    fn null_check(&self, at: usize, ptr: u8) -> Option<(String, usize)> {
        let reg = self.locate(ptr)?;
        let insn = self.insns.get(at)?;
        let forward = |d: &Decoded| d.target().is_some_and(|t| t > i128::from(d.offset) + 4);
        match insn.insn.test? {
            Test::Cbz(r) if r == reg && forward(insn) => {
                Some((format!("NULL check `{}`", insn.text()), at))
            }
            Test::CmpZero(r) if r == reg => {
                let branch = self.insns.get(at + 1)?;
                (branch.insn.test == Some(Test::BranchEq) && forward(branch))
                    .then(|| (format!("NULL check `{}; b.eq`", insn.text()), at + 1))
            }
            _ => None,
        }
    }

    /// Accepts the simulated `insns[at]` unless a branch among the
    /// instructions lands in `(0, its offset]`.
    fn accept(&self, at: usize) -> Result<Placement, String> {
        let candidate = &self.insns[at];
        if candidate.offset == 0 {
            return Ok(Placement {
                offset: 0,
                reason: PlacementReason::EntryEmulated {
                    insn: candidate.text(),
                },
                args: IDENTITY,
            });
        }
        for branch in self.insns {
            if let Some(target) = branch.target() {
                if target > 0 && target <= i128::from(candidate.offset) {
                    return Err(format!(
                        "`{}` at +{:#x} branches into the skipped instructions (0, {:#x}]",
                        branch.text(),
                        branch.offset,
                        candidate.offset
                    ));
                }
            }
        }
        let (args, moved) = relocated_args(Arch::Aarch64, self.needs, |arg| self.locate(arg))?;
        Ok(Placement {
            offset: candidate.offset,
            reason: PlacementReason::Moved {
                skipped: self.skipped.clone(),
                insn: candidate.text(),
                moved,
            },
            args,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    include!("../testdata/arm64_prologues.rs");

    const FREE: Needs = Needs::release(0);
    /// `void *f(size_t size)` with a return probe.
    const ALLOC: Needs = Needs {
        args: 0b1,
        keep_stack: true,
        release_ptr: None,
    };

    fn code(words: &[u32]) -> Vec<u8> {
        words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    fn assert_stays(p: &Placement) {
        assert_eq!(p.offset, 0, "{p}");
        assert!(!p.is_emulated() && !p.is_refused(), "{p}");
    }

    // A64 words used below.
    const NOP: u32 = 0xd503_201f;
    const PACIASP: u32 = 0xd503_233f;
    const BTI_C: u32 = 0xd503_245f;
    const RET: u32 = 0xd65f_03c0;
    /// stp x29, x30, [sp, #-32]!
    const STP_FP_LR: u32 = 0xa9be_7bfd;
    /// mov x29, sp
    const MOV_FP_SP: u32 = 0x9100_03fd;
    /// cmp x0, #0
    const CMP_X0_0: u32 = 0xf100_001f;
    /// mov x1, x0
    const MOV_X1_X0: u32 = 0xaa00_03e1;
    /// mov x0, #0 (movz)
    const MOVZ_X0_0: u32 = 0xd280_0000;
    /// ldr x2, [x0, #8]
    const LDR_X2_X0_8: u32 = 0xf940_0402;
    /// sub sp, sp, #0x10
    const SUB_SP_16: u32 = 0xd100_43ff;
    /// adrp x8, +0x1000
    const ADRP_X8: u32 = 0xb000_0008;

    /// `cbz x<r>, +disp` at any offset (displacement from the cbz).
    fn cbz(r: u32, disp: i32) -> u32 {
        0xb400_0000 | ((((disp / 4) as u32) & 0x7ffff) << 5) | r
    }

    /// `b.eq +disp`.
    fn b_eq(disp: i32) -> u32 {
        0x5400_0000 | ((((disp / 4) as u32) & 0x7ffff) << 5)
    }

    /// `b +disp`.
    fn b(disp: i32) -> u32 {
        0x1400_0000 | (((disp / 4) as u32) & 0x03ff_ffff)
    }

    #[test]
    fn glibc_free_probes_its_entry_cbz() {
        // cbz x0 (simulated) at the entry; then `stp x29, x30, [sp, #-64]!`
        // writes memory, so nothing further is safe: the cbz it is.
        let p = choose(GLIBC_FREE, FREE);
        assert_eq!(p.to_string(), "+0 (entry `cbz x0, +0x110` is emulated)");
        assert!(p.is_emulated());
        assert_eq!(p.args, IDENTITY);
    }

    #[test]
    fn glibc_allocators_stay_at_their_entry_stp() {
        for (name, code) in [
            ("malloc", GLIBC_MALLOC),
            ("calloc", GLIBC_CALLOC),
            ("realloc", GLIBC_REALLOC),
            ("posix_memalign", GLIBC_POSIX_MEMALIGN),
            ("aligned_alloc", GLIBC_ALIGNED_ALLOC),
            ("operator new", LIBSTDCXX__ZNWM),
        ] {
            let p = choose(code, ALLOC);
            assert_stays(&p);
            assert!(
                p.reason
                    .to_string()
                    .starts_with("entry `stp x29, x30, [sp, #-"),
                "{name}: {p}"
            );
            assert!(
                p.reason.to_string().ends_with("takes x30 there)"),
                "{name}: {p}"
            );
            // Even as a release it could not move: the stp writes memory.
            let p = choose(code, FREE);
            assert_stays(&p);
            assert!(
                p.reason.to_string().contains("writes memory"),
                "{name}: {p}"
            );
        }
    }

    #[test]
    fn libstdcxx_deletes_jump_to_free() {
        // operator delete(void*) is `b free@plt`: simulated at the entry.
        for code in [LIBSTDCXX__ZDLPV, LIBSTDCXX__ZDLPVM, LIBSTDCXX__ZNAM] {
            let p = choose(code, FREE);
            assert_eq!(p.offset, 0, "{p}");
            assert!(p.is_emulated(), "{p}");
            assert!(p.reason.to_string().starts_with("entry `b -0x"), "{p}");
        }
        assert_eq!(
            choose(LIBSTDCXX__ZDLPV, FREE).to_string(),
            "+0 (entry `b -0x3a70` is emulated)"
        );
    }

    #[test]
    fn glibc_munmap_starts_with_a_simulated_nop() {
        let p = choose(GLIBC_MUNMAP, FREE);
        assert_eq!(p.to_string(), "+0 (entry `nop` is emulated)");
    }

    #[test]
    fn return_probes_stay_even_on_a_simulated_entry() {
        // adrp x8, ...; ret -- simulated entry: emulated, at 0.
        let p = choose(&code(&[ADRP_X8, RET]), ALLOC);
        assert_eq!(p.offset, 0);
        assert!(p.is_emulated(), "{p}");
        // paciasp; nop -- a release would move to the nop, a return probe stays.
        let words = code(&[PACIASP, NOP, RET]);
        assert_stays(&choose(&words, ALLOC));
        assert_eq!(choose(&words, FREE).offset, 4);
        // An entry-only probe that is no plain release stays too.
        let entry_only = Needs {
            args: 0b11,
            keep_stack: false,
            release_ptr: None,
        };
        let p = choose(&words, entry_only);
        assert_stays(&p);
        assert!(p.reason.to_string().contains("only plain releases"), "{p}");
    }

    #[test]
    fn literal_load_at_entry_is_refused() {
        // ldr x16, pc+0x10; br x16
        let p = choose(&code(&[0x5800_0090, 0xd61f_0200]), FREE);
        assert!(p.is_refused(), "{p}");
        assert_eq!(p.offset, 0);
        assert_eq!(
            p.reason.to_string(),
            "entry `ldr x16, pc+0x10` (literal load) is refused by the kernel's uprobes: \
             cannot be probed"
        );
        // Refused whatever the needs, and kept refused with placement off.
        assert!(choose(&code(&[0x5800_0090]), ALLOC).at_entry().is_refused());
        // ldrsw and prfm literal too.
        assert!(choose(&code(&[0x9800_0090]), ALLOC).is_refused());
        assert!(choose(&code(&[0xd800_0080]), ALLOC).is_refused());
    }

    #[test]
    fn exclusive_and_system_entries_are_refused() {
        for (word, why) in [
            (0xc85f_7c01, "exclusive load/store"), // ldxr x1, [x0]
            (0xc85f_fc01, "exclusive load/store"), // ldaxr x1, [x0]
            (0x885f_7c01, "exclusive load/store"), // ldxr w1, [x0]
            (0xc87f_0801, "exclusive load/store"), // ldxp x1, x2, [x0]
            (0xc802_7c01, "exclusive load/store"), // stxr w2, x1, [x0]
            (0xd400_0001, "exception generation"), // svc #0
            (0xd53b_d054, "mrs of a register other than daif"),
            (0xd51b_d040, "msr"),
            (0xd503_23bf, "hint the kernel does not step"), // autiasp
            (0xd65f_0bff, "branch the kernel does not simulate"), // retaa
        ] {
            let p = choose(&code(&[word, RET]), FREE);
            assert_eq!(
                p.reason,
                PlacementReason::Refused {
                    entry: a64::decode(word).text_at(0),
                    why: why.into()
                },
                "{word:#010x}"
            );
        }
    }

    #[test]
    fn refused_instructions_later_are_never_probed() {
        // mov x1, x0; ldxr x2, [x1]; cbz ... -- the walk stops before the
        // exclusive (unknown effects) and stays at the entry.
        let p = choose(&code(&[MOV_X1_X0, 0xc85f_7c22, cbz(2, 8), RET]), FREE);
        assert_stays(&p);
        assert!(
            p.reason.to_string().contains("`ldxr x2, [x1]` at +0x4"),
            "{p}"
        );
    }

    #[test]
    fn paciasp_prologue_moves_past_the_hint_and_null_check() {
        // paciasp; cbz x0, +0x14 (ret); sub sp, sp, #16; nop; ...; ret
        let words = code(&[PACIASP, cbz(0, 0x14), SUB_SP_16, NOP, RET, RET]);
        let p = choose(&words, FREE);
        assert_eq!(
            p.to_string(),
            "+12 (skipped `paciasp`, NULL check `cbz x0, +0x18`, `sub sp, sp, #0x10`; \
             `nop` is emulated)"
        );
        // bti c alike.
        let words = code(&[BTI_C, cbz(0, 0x14), NOP, RET, RET, RET]);
        assert_eq!(choose(&words, FREE).offset, 8);
    }

    #[test]
    fn null_check_alone_is_the_fallback() {
        // bti c; cbz x0, +0x10; stp x29, x30, [sp, #-32]!; ...: the stp
        // writes memory, so the cbz (simulated) at +4 is used.
        let words = code(&[BTI_C, cbz(0, 0x10), STP_FP_LR, MOV_FP_SP, RET, RET]);
        let p = choose(&words, FREE);
        assert_eq!(
            p.to_string(),
            "+4 (skipped `bti c`; `cbz x0, +0x14` is emulated)"
        );
        // cmp x0, #0; b.eq -- the b.eq at +4 when nothing follows.
        let words = code(&[CMP_X0_0, b_eq(0x10), STP_FP_LR, RET, RET, RET]);
        let p = choose(&words, FREE);
        assert_eq!(
            p.to_string(),
            "+4 (skipped `cmp x0, #0x0`; `b.eq +0x14` is emulated)"
        );
        // ... and past both when something simulated follows.
        let words = code(&[CMP_X0_0, b_eq(0x10), NOP, RET, RET, RET]);
        assert_eq!(
            choose(&words, FREE).to_string(),
            "+8 (skipped NULL check `cmp x0, #0x0; b.eq`; `nop` is emulated)"
        );
    }

    #[test]
    fn only_a_forward_64_bit_null_check_of_the_pointer_is_skipped() {
        for words in [
            // cbz x1 tests another register: the cbz itself is the spot.
            [cbz(1, 0x10), NOP, RET, RET, RET],
            // cbz w0 checks only the low half.
            [0x3400_0080, NOP, RET, RET, RET],
            // cbnz x0 is not the NULL path.
            [0xb500_0080, NOP, RET, RET, RET],
        ] {
            let p = choose(&code(&words), FREE);
            assert_eq!(p.offset, 0, "{p}");
            assert!(p.is_emulated(), "{p}");
        }
        // A cbz branching back (to the entry here) is no NULL check: the
        // walk stops on it. bti c; cbz x0, -4; nop
        let p = choose(&code(&[BTI_C, cbz(0, -4), NOP, RET]), FREE);
        assert_eq!(
            p.to_string(),
            "+4 (skipped `bti c`; `cbz x0, +0x0` is emulated)"
        );
    }

    #[test]
    fn branch_back_into_the_skipped_prefix_stays() {
        // cbz x0, +0x14; ldr x2, [x0, #8]; nop; ...; b +4 (the ldr)
        let words = code(&[cbz(0, 0x14), LDR_X2_X0_8, NOP, RET, b(-0xc), RET]);
        let p = choose(&words, FREE);
        // The nop at +8 is refused (b lands on +4), so the entry's cbz stays.
        assert_eq!(p.to_string(), "+0 (entry `cbz x0, +0x14` is emulated)");
        // Without the back branch it moves to the nop.
        let words = code(&[cbz(0, 0x14), LDR_X2_X0_8, NOP, RET, RET, RET]);
        assert_eq!(choose(&words, FREE).offset, 8);
        // A stepped entry and a branch into the prefix: stays single-stepped.
        let words = code(&[BTI_C, LDR_X2_X0_8, NOP, b(-8), RET]);
        let p = choose(&words, FREE);
        assert_stays(&p);
        assert!(
            p.reason
                .to_string()
                .contains("branches into the skipped instructions"),
            "{p}"
        );
        // A call back to the entry (recursion) is fine.
        let bl_entry = 0x9400_0000 | ((-2i32 as u32) & 0x03ff_ffff);
        let words = code(&[BTI_C, NOP, bl_entry, RET]);
        assert_eq!(choose(&words, FREE).offset, 4);
    }

    #[test]
    fn moved_argument_is_followed() {
        // mov x1, x0; mov x0, #0; nop -- the pointer now lives in x1.
        let words = code(&[MOV_X1_X0, MOVZ_X0_0, NOP, RET]);
        let p = choose(&words, FREE);
        assert_eq!(p.offset, 8, "{p}");
        assert_eq!(p.arg(0), 1);
        assert!(
            p.reason.to_string().ends_with("; argument 0 read from x1"),
            "{p}"
        );
        // ... and its NULL check on x1 is skipped.
        let words = code(&[MOV_X1_X0, MOVZ_X0_0, cbz(1, 0x10), NOP, RET, RET]);
        let p = choose(&words, FREE);
        assert_eq!(p.offset, 12, "{p}");
        assert_eq!(p.arg(0), 1);
        // orr x1, xzr, x0 is the same copy (mov's encoding).
        assert_eq!(a64::decode(MOV_X1_X0).text, "mov x1, x0");
        // A 32-bit copy is not the pointer: mov w1, w0; mov x0, #0.
        let words = code(&[0x2a00_03e1, MOVZ_X0_0, NOP, RET]);
        let p = choose(&words, FREE);
        assert_stays(&p);
        assert!(
            p.reason.to_string().contains("overwrites argument 0 (x0)"),
            "{p}"
        );
        // A copy to a register the probe cannot read is lost too: mov x19, x0.
        let words = code(&[0xaa00_03f3, MOVZ_X0_0, NOP, RET]);
        assert_stays(&choose(&words, FREE));
    }

    #[test]
    fn frame_and_stack_writes_stop_the_walk() {
        // mov x29, sp writes the frame pointer.
        let p = choose(&code(&[MOV_FP_SP, NOP]), FREE);
        assert_stays(&p);
        assert!(p.reason.to_string().contains("writes x29 or x30"), "{p}");
        // add sp, sp, #16 raises the stack pointer.
        let p = choose(&code(&[0x9100_43ff, NOP]), FREE);
        assert_stays(&p);
        assert!(p.reason.to_string().contains("other than down"), "{p}");
        // str x0, [sp, #-16]! writes memory.
        let p = choose(&code(&[0xf81f_0fe0, NOP]), FREE);
        assert_stays(&p);
        assert!(p.reason.to_string().contains("writes memory"), "{p}");
        // ldr x3, [x0]; nop: a load of x3 is fine.
        assert_eq!(choose(&code(&[0xf940_0003, NOP]), FREE).offset, 4);
    }

    #[test]
    fn truncated_or_empty_code() {
        assert_stays(&choose(&[], FREE));
        assert_stays(&choose(&[0x1f, 0x20], FREE));
        // bti c and nothing after it.
        let p = choose(&code(&[BTI_C]), FREE);
        assert_stays(&p);
        assert!(p.reason.to_string().contains("the bytes end"), "{p}");
        // Undecoded words are never skipped.
        let p = choose(&code(&[0x0000_0000, NOP]), FREE);
        assert_stays(&p);
        assert!(
            p.reason.to_string().starts_with("entry `.inst 0x00000000`"),
            "{p}"
        );
    }
}
