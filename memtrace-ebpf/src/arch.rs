//! The per-architecture layer: where a probe's registers sit in its context
//! (`struct pt_regs` on x86-64, `struct user_pt_regs` on arm64), how a
//! return moves the stack pointer, where a frame's return address lives and
//! how a kernel signal frame stores the interrupted registers. Everything
//! else in the programs is architecture-neutral and goes through here.
//!
//! Every register is read at a constant context offset (the verifier
//! rejects context reads at computed offsets); volatile reads keep LLVM from
//! merging them into one computed-offset load.

#[cfg(bpf_target_arch = "x86_64")]
mod imp {
    use aya_ebpf::bindings::pt_regs;

    pub type Regs = pt_regs;

    /// How far a return moves the stack pointer: x86's `ret` pops the
    /// return address.
    pub const RET_SP_DELTA: u64 = 8;
    /// `uc_mcontext` inside a signal frame's `ucontext`, and the saved
    /// frame pointer, stack pointer and PC in it (x86-64 `sigcontext`).
    const MCONTEXT: u64 = 40;
    pub const SIGCTX_FP: u64 = MCONTEXT + 80;
    pub const SIGCTX_SP: u64 = MCONTEXT + 120;
    pub const SIGCTX_PC: u64 = MCONTEXT + 128;

    /// The six integer argument registers (rdi, rsi, rdx, rcx, r8, r9).
    #[inline(always)]
    pub fn args(regs: *const Regs) -> [u64; 6] {
        // SAFETY: the context is the trapped task's registers; each field is
        // read at its fixed offset.
        unsafe {
            [
                core::ptr::read_volatile(&(*regs).rdi),
                core::ptr::read_volatile(&(*regs).rsi),
                core::ptr::read_volatile(&(*regs).rdx),
                core::ptr::read_volatile(&(*regs).rcx),
                core::ptr::read_volatile(&(*regs).r8),
                core::ptr::read_volatile(&(*regs).r9),
            ]
        }
    }

    /// `(pc, sp, frame pointer, link register)`; x86-64 has no link
    /// register (0).
    #[inline(always)]
    pub fn frame(regs: *const Regs) -> (u64, u64, u64, u64) {
        // SAFETY: as in `args`.
        unsafe { ((*regs).rip, (*regs).rsp, (*regs).rbp, 0) }
    }

    #[inline(always)]
    pub fn sp(regs: *const Regs) -> u64 {
        // SAFETY: as in `args`.
        unsafe { (*regs).rsp }
    }

    /// Only the compat object finds its spec by the PC.
    #[cfg_attr(not(feature = "compat"), allow(dead_code))]
    #[inline(always)]
    pub fn pc(regs: *const Regs) -> u64 {
        // SAFETY: as in `args`.
        unsafe { (*regs).rip }
    }

    /// USDT register slot `slot` (the loader's numbering: `struct pt_regs`
    /// order, r15 = 0 ... rdi = 14, rsp = 19); 0 for no register.
    #[inline(always)]
    pub fn usdt_register(regs: *const Regs, slot: u8) -> u64 {
        // SAFETY: as in `args`.
        unsafe {
            match slot {
                0 => core::ptr::read_volatile(&(*regs).r15),
                1 => core::ptr::read_volatile(&(*regs).r14),
                2 => core::ptr::read_volatile(&(*regs).r13),
                3 => core::ptr::read_volatile(&(*regs).r12),
                4 => core::ptr::read_volatile(&(*regs).rbp),
                5 => core::ptr::read_volatile(&(*regs).rbx),
                6 => core::ptr::read_volatile(&(*regs).r11),
                7 => core::ptr::read_volatile(&(*regs).r10),
                8 => core::ptr::read_volatile(&(*regs).r9),
                9 => core::ptr::read_volatile(&(*regs).r8),
                10 => core::ptr::read_volatile(&(*regs).rax),
                11 => core::ptr::read_volatile(&(*regs).rcx),
                12 => core::ptr::read_volatile(&(*regs).rdx),
                13 => core::ptr::read_volatile(&(*regs).rsi),
                14 => core::ptr::read_volatile(&(*regs).rdi),
                19 => core::ptr::read_volatile(&(*regs).rsp),
                _ => 0,
            }
        }
    }
}

#[cfg(bpf_target_arch = "aarch64")]
mod imp {
    use aya_ebpf::bindings::user_pt_regs;

    /// An arm64 probe's context: `struct pt_regs` begins with
    /// `struct user_pt_regs { regs[31], sp, pc, pstate }`.
    pub type Regs = user_pt_regs;

    /// arm64's `ret` branches to x30 and leaves sp alone.
    pub const RET_SP_DELTA: u64 = 0;
    /// A signal frame (`struct rt_sigframe` at sp: `siginfo` (128 bytes),
    /// then `ucontext` with `uc_mcontext` at +176; `sigcontext` is
    /// `fault_address`, `regs[31]`, `sp`, `pc`, `pstate`).
    const SIGCONTEXT_REGS: u64 = 128 + 176 + 8;
    pub const SIGCTX_FP: u64 = SIGCONTEXT_REGS + 29 * 8;
    pub const SIGCTX_LR: u64 = SIGCONTEXT_REGS + 30 * 8;
    pub const SIGCTX_SP: u64 = SIGCONTEXT_REGS + 31 * 8;
    pub const SIGCTX_PC: u64 = SIGCONTEXT_REGS + 32 * 8;

    /// The first six integer argument registers (x0-x5).
    #[inline(always)]
    pub fn args(regs: *const Regs) -> [u64; 6] {
        // SAFETY: the context is the trapped task's registers; each element
        // is read at its fixed offset.
        unsafe {
            [
                core::ptr::read_volatile(&(*regs).regs[0]),
                core::ptr::read_volatile(&(*regs).regs[1]),
                core::ptr::read_volatile(&(*regs).regs[2]),
                core::ptr::read_volatile(&(*regs).regs[3]),
                core::ptr::read_volatile(&(*regs).regs[4]),
                core::ptr::read_volatile(&(*regs).regs[5]),
            ]
        }
    }

    /// `(pc, sp, frame pointer x29, link register x30)`.
    #[inline(always)]
    pub fn frame(regs: *const Regs) -> (u64, u64, u64, u64) {
        // SAFETY: as in `args`.
        unsafe {
            (
                core::ptr::read_volatile(&(*regs).pc),
                core::ptr::read_volatile(&(*regs).sp),
                core::ptr::read_volatile(&(*regs).regs[29]),
                core::ptr::read_volatile(&(*regs).regs[30]),
            )
        }
    }

    #[inline(always)]
    pub fn sp(regs: *const Regs) -> u64 {
        // SAFETY: as in `args`.
        unsafe { core::ptr::read_volatile(&(*regs).sp) }
    }

    /// Only the compat object finds its spec by the PC.
    #[cfg_attr(not(feature = "compat"), allow(dead_code))]
    #[inline(always)]
    pub fn pc(regs: *const Regs) -> u64 {
        // SAFETY: as in `args`.
        unsafe { core::ptr::read_volatile(&(*regs).pc) }
    }

    /// USDT register slot `slot`: x0-x30 are slots 0-30, sp is 31.
    #[inline(always)]
    pub fn usdt_register(regs: *const Regs, slot: u8) -> u64 {
        // SAFETY: as in `args`; one constant offset per arm.
        unsafe {
            macro_rules! x {
                ($n:literal) => {
                    core::ptr::read_volatile(&(*regs).regs[$n])
                };
            }
            match slot {
                0 => x!(0),
                1 => x!(1),
                2 => x!(2),
                3 => x!(3),
                4 => x!(4),
                5 => x!(5),
                6 => x!(6),
                7 => x!(7),
                8 => x!(8),
                9 => x!(9),
                10 => x!(10),
                11 => x!(11),
                12 => x!(12),
                13 => x!(13),
                14 => x!(14),
                15 => x!(15),
                16 => x!(16),
                17 => x!(17),
                18 => x!(18),
                19 => x!(19),
                20 => x!(20),
                21 => x!(21),
                22 => x!(22),
                23 => x!(23),
                24 => x!(24),
                25 => x!(25),
                26 => x!(26),
                27 => x!(27),
                28 => x!(28),
                29 => x!(29),
                30 => x!(30),
                31 => core::ptr::read_volatile(&(*regs).sp),
                _ => 0,
            }
        }
    }
}

pub use imp::*;

/// The context of a (ret)probe program as this architecture's registers.
#[inline(always)]
pub fn regs<C: aya_ebpf::EbpfContext>(ctx: &C) -> *const Regs {
    ctx.as_ptr() as *const Regs
}
