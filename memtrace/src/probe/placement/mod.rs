//! Probe placement: choosing the byte offset inside a traced function at
//! which its uprobe (and uretprobe) is attached, from the function's first
//! bytes as read from the ELF file.
//!
//! This module owns the decision's vocabulary, shared by every architecture:
//! what the probe needs ([`Needs`]), where it goes and why ([`Placement`],
//! [`PlacementReason`]), and which argument register each argument is read
//! from there ([`ArgReg`]). [`choose`] dispatches to the architecture's
//! chooser:
//! - [`x86`]: x86-64, decoded with iced-x86; moves to the first instruction
//!   the kernel emulates (push, nops, relative jumps and calls).
//! - [`arm64`]: aarch64, decoded by [`a64`]; return probes stay at the entry
//!   (the uretprobe hijacks x30 there), plain releases move to the first
//!   instruction the kernel simulates; an entry the kernel refuses to probe
//!   is reported ([`PlacementReason::Refused`]) so the caller skips it.
//!
//! "Emulated" in reasons means the kernel handles the probed instruction
//! itself (x86 emulation, arm64 simulation) instead of single-stepping it out
//! of line, which costs a second trap.

use std::fmt;

use crate::arch::Arch;

pub mod a64;
pub mod arm64;
pub mod x86;

/// How many bytes of the function's start [`choose`] wants to see.
pub const WINDOW: usize = 256;

/// An integer argument register of the architecture's C calling convention:
/// argument `index` (0..6) at a call; `rdi, rsi, rdx, rcx, r8, r9` on x86-64,
/// `x0..x5` on arm64. The eBPF side reads argument register `index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ArgReg {
    arch: Arch,
    index: u8,
}

/// How many integer argument registers a probe can read.
pub const ARG_REGS: u8 = 6;

const X86_NAMES: [&str; 6] = ["rdi", "rsi", "rdx", "rcx", "r8", "r9"];
const ARM64_NAMES: [&str; 6] = ["x0", "x1", "x2", "x3", "x4", "x5"];

impl ArgReg {
    /// The register carrying integer argument `index` (0-based), if any.
    pub fn nth(arch: Arch, index: usize) -> Option<Self> {
        let index = u8::try_from(index).ok().filter(|i| *i < ARG_REGS)?;
        Some(ArgReg { arch, index })
    }

    /// The argument index this register carries at a call.
    #[cfg(test)]
    pub fn index(self) -> u8 {
        self.index
    }

    /// The register's name (Intel syntax on x86-64).
    pub fn name(self) -> &'static str {
        let names = match self.arch {
            Arch::X86_64 => &X86_NAMES,
            Arch::Aarch64 => &ARM64_NAMES,
        };
        names.get(usize::from(self.index)).copied().unwrap_or("?")
    }
}

/// What the probe needs from the function, which bounds how far it may move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Needs {
    /// Bit `i` set: the probe reads integer argument `i` at entry.
    pub args: u8,
    /// The stack pointer must be unchanged at the probe (a return probe sits
    /// there too, or the probe reads stack arguments). On arm64 it keeps the
    /// probe at the entry.
    pub keep_stack: bool,
    /// A plain release reading only this pointer argument, for which NULL is
    /// a no-op: a NULL check of it may be skipped.
    pub release_ptr: Option<u8>,
}

impl Needs {
    /// Every argument and the stack untouched: moves only past instructions
    /// that write no argument register nor the stack pointer.
    #[cfg(test)]
    pub const ENTRY: Needs = Needs {
        args: 0x3f,
        keep_stack: true,
        release_ptr: None,
    };

    /// A plain release of the pointer in argument `index` (no return probe).
    #[cfg(test)]
    pub const fn release(index: u8) -> Needs {
        Needs {
            args: 1 << index,
            keep_stack: false,
            release_ptr: Some(index),
        }
    }
}

/// Where to attach, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Byte offset from the function's entry.
    pub offset: u64,
    pub reason: PlacementReason,
    /// `args[i]`: the argument register holding argument `i` at the probe
    /// (the identity unless a skipped `mov` copied it elsewhere).
    pub args: [u8; 6],
}

const IDENTITY: [u8; 6] = [0, 1, 2, 3, 4, 5];

/// A placement's `args` and the argument moves it reports.
type Relocated = ([u8; 6], Vec<(u8, ArgReg)>);

/// Where each argument the probe reads sits at a candidate: `locate(i)`
/// names the argument register holding argument `i` there (`None`: lost).
/// Returns the placement's `args` and the moves to report.
fn relocated_args(
    arch: Arch,
    needs: Needs,
    locate: impl Fn(u8) -> Option<u8>,
) -> Result<Relocated, String> {
    let mut args = IDENTITY;
    let mut moved = Vec::new();
    for arg in 0..ARG_REGS {
        if needs.args & (1 << arg) == 0 {
            continue;
        }
        let reg = locate(arg).ok_or_else(|| format!("argument {arg} is lost"))?;
        args[usize::from(arg)] = reg;
        if reg != arg {
            if let Some(r) = ArgReg::nth(arch, usize::from(reg)) {
                moved.push((arg, r));
            }
        }
    }
    Ok((args, moved))
}

impl Placement {
    /// The function's entry, whatever the chooser said (placement disabled).
    /// A refused entry stays refused.
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
            args: IDENTITY,
        }
    }

    /// Whether the probed instruction is one the kernel emulates (fast path).
    pub fn is_emulated(&self) -> bool {
        matches!(
            self.reason,
            PlacementReason::EntryEmulated { .. } | PlacementReason::Moved { .. }
        )
    }

    /// Whether the kernel refuses a probe at the entry: the function cannot
    /// be probed at all, and the caller must skip it (with a warning).
    pub fn is_refused(&self) -> bool {
        matches!(self.reason, PlacementReason::Refused { .. })
    }

    /// The register index holding argument `arg` at the probe (`arg` itself
    /// for an unused slot).
    #[cfg(test)]
    pub fn arg(&self, arg: u8) -> u8 {
        self.args.get(usize::from(arg)).copied().unwrap_or(arg)
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "+{} ({})", self.offset, self.reason)
    }
}

/// Why [`choose`] picked its offset. Instructions are in Intel syntax on
/// x86-64, in the A64 assembler's on arm64 (branch targets as `+offset`
/// from the entry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlacementReason {
    /// The entry instruction is emulated: offset 0.
    EntryEmulated { insn: String },
    /// Moved past `skipped` (each an instruction, or a NULL check as
    /// `NULL check `test rdi,rdi; je``) onto the emulated `insn`; `moved`
    /// lists the arguments read from another register than their own.
    Moved {
        skipped: Vec<String>,
        insn: String,
        moved: Vec<(u8, ArgReg)>,
    },
    /// Offset 0, single-stepped: `entry` is the entry instruction (`None`
    /// when its bytes do not decode), `why` says why no later spot is safe.
    Stay { entry: Option<String>, why: String },
    /// The kernel refuses a probe on the entry instruction `entry` (`why`:
    /// its class, such as a literal load): the function cannot be probed.
    Refused { entry: String, why: String },
}

impl fmt::Display for PlacementReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::EntryEmulated { insn } => write!(f, "entry `{insn}` is emulated"),
            Self::Moved {
                skipped,
                insn,
                moved,
            } => {
                const SHOWN: usize = 4;
                let mut list = skipped
                    .iter()
                    .take(SHOWN)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ");
                if skipped.len() > SHOWN {
                    list.push_str(&format!(" and {} more", skipped.len() - SHOWN));
                }
                write!(f, "skipped {list}; `{insn}` is emulated")?;
                for (arg, reg) in moved {
                    write!(f, "; argument {arg} read from {}", reg.name())?;
                }
                Ok(())
            }
            Self::Stay {
                entry: Some(entry),
                why,
            } => write!(f, "entry `{entry}` is single-stepped; {why}"),
            Self::Stay { entry: None, why } => write!(f, "entry does not decode; {why}"),
            Self::Refused { entry, why } => write!(
                f,
                "entry `{entry}` ({why}) is refused by the kernel's uprobes: cannot be probed"
            ),
        }
    }
}

/// Chooses where to attach a probe with `needs` to the function of
/// architecture `arch` whose first bytes (at its entry, up to [`WINDOW`],
/// not past the symbol's end) are `code`.
pub fn choose(arch: Arch, code: &[u8], needs: Needs) -> Placement {
    match arch {
        Arch::X86_64 => x86::choose(code, needs),
        Arch::Aarch64 => arm64::choose(code, needs),
    }
}

/// Offset 0, single-stepped, with why.
fn stay(entry: Option<String>, why: String) -> Placement {
    Placement {
        offset: 0,
        reason: PlacementReason::Stay { entry, why },
        args: IDENTITY,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arg_regs_per_arch() {
        let rdi = ArgReg::nth(Arch::X86_64, 0).expect("rdi");
        assert_eq!((rdi.name(), rdi.index()), ("rdi", 0));
        assert_eq!(ArgReg::nth(Arch::X86_64, 4).map(ArgReg::name), Some("r8"));
        assert_eq!(ArgReg::nth(Arch::X86_64, 6), None);
        assert_eq!(ArgReg::nth(Arch::Aarch64, 5).map(ArgReg::name), Some("x5"));
        assert_eq!(ArgReg::nth(Arch::Aarch64, 6), None);
    }

    #[test]
    fn refused_placements_stay_refused_and_are_not_emulated() {
        let p = Placement {
            offset: 0,
            reason: PlacementReason::Refused {
                entry: "ldr x16, +0x40".into(),
                why: "literal load".into(),
            },
            args: IDENTITY,
        };
        assert!(p.is_refused() && !p.is_emulated());
        assert_eq!(p.clone().at_entry(), p);
        assert_eq!(
            p.to_string(),
            "+0 (entry `ldr x16, +0x40` (literal load) is refused by the kernel's uprobes: \
             cannot be probed)"
        );
    }

    #[test]
    fn dispatches_per_arch() {
        // x86 `push rbp`.
        assert_eq!(
            choose(Arch::X86_64, &[0x55, 0xc3], Needs::ENTRY).reason,
            PlacementReason::EntryEmulated {
                insn: "push rbp".into()
            }
        );
        // A64 `nop` (simulated).
        let nop = 0xd503_201f_u32.to_le_bytes();
        assert_eq!(
            choose(Arch::Aarch64, &nop, Needs::ENTRY).reason,
            PlacementReason::EntryEmulated { insn: "nop".into() }
        );
    }
}
