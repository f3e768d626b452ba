//! USDT probes (`usdt_fire`): a uprobe at an `sdt.h` probe site whose
//! arguments are where the note's argument specs say (a register, memory off
//! a register, a constant), decoded by the loader into the spec's
//! [`ArgLoc`]s. The block is created or released at the probe itself: no
//! return probe, no in-flight record.

use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid, helpers::bpf_probe_read_user, programs::ProbeContext,
};
use memtrace_common::{ArgLoc, PendingCall, SpecKind, LOC_CONST, LOC_MEM, LOC_REG};

/// Register `slot` of the probe's context ([`crate::arch::usdt_register`]);
/// 0 for no register.
#[inline(always)]
fn register(ctx: &ProbeContext, slot: u8) -> u64 {
    crate::arch::usdt_register(crate::arch::regs(ctx), slot)
}

/// The value of the argument at `loc`, truncated to its size and
/// sign- or zero-extended; 0 when it is unreadable or has no location.
#[inline(always)]
pub fn read(ctx: &ProbeContext, loc: &ArgLoc) -> u64 {
    let raw = if loc.kind == LOC_CONST {
        loc.offset as u64
    } else if loc.kind == LOC_REG {
        register(ctx, loc.reg)
    } else if loc.kind == LOC_MEM {
        let addr = register(ctx, loc.reg).wrapping_add(loc.offset as u64);
        // SAFETY: bpf_probe_read_user checks the user address and fails
        // cleanly; each arm reads exactly the argument's bytes.
        unsafe {
            match loc.size {
                1 => bpf_probe_read_user(addr as *const u8).map(u64::from),
                2 => bpf_probe_read_user(addr as *const u16).map(u64::from),
                4 => bpf_probe_read_user(addr as *const u32).map(u64::from),
                _ => bpf_probe_read_user(addr as *const u64),
            }
        }
        .unwrap_or(0)
    } else {
        return 0;
    };
    match (loc.size, loc.signed != 0) {
        (1, true) => raw as i8 as i64 as u64,
        (1, false) => raw & 0xff,
        (2, true) => raw as i16 as i64 as u64,
        (2, false) => raw & 0xffff,
        (4, true) => raw as i32 as i64 as u64,
        (4, false) => raw & 0xffff_ffff,
        _ => raw,
    }
}

/// A USDT probe fired: release or create the block its arguments name
/// (with the spec's aux and tag arguments, a PyTorch allocation's stream
/// and device).
#[inline(always)]
pub fn on_fire(ctx: &ProbeContext) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(spec) = crate::entry_spec(ctx, pid_tgid) else {
        return;
    };
    let ptr = read(ctx, &spec.ptr_loc);
    if spec.kind == SpecKind::Free as u8 {
        // Releases still count for a grace after the window closed, as at
        // `call_enter`.
        crate::release_now(ptr, spec, pid_tgid);
        return;
    }
    if crate::window_closed() {
        return;
    }
    // No call is in flight here: `entered` and `out` carry the tag and aux
    // values to `finish_call`, which sends them for USDT specs (ret Void).
    let call = PendingCall {
        entry_sp: 0,
        entered: read(ctx, &spec.tag_loc),
        size: read(ctx, &spec.size_loc),
        count: 1,
        ptr: 0,
        out: read(ctx, &spec.aux_loc),
        spec: spec.index,
        _pad: [0; 6],
    };
    // Known at the probe: the pointer is the "returned" block (0: failed).
    crate::finish_call(ctx, spec, &call, pid_tgid, ptr);
}
