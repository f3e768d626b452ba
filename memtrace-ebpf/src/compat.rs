//! What the programs use instead on kernels without attach cookies (5.15),
//! BPF atomics with fetch (5.12) or `bpf_loop` (5.17) — 5.10 to 5.16, built
//! as the `compat` object (cargo feature `compat`), which the loader picks
//! when `memtrace doctor`'s probes find one of those missing:
//!
//! - the spec of an entry probe is found by the probed address in its
//!   process (`SPEC_BY_ADDR`, filled by the loader for every attached
//!   function and process), not by the attach cookie;
//! - a call in flight is kept under the stack pointer its return will have
//!   (`entry_sp + 8`, `CALLS`), so the return probe needs no cookie either;
//!   `OUTERMOST` keeps each family's outermost call per thread, which tells
//!   nested calls apart as the in-flight slots do in the full object;
//! - no heap block is held in the kernel (settling needs compare-and-swap):
//!   every allocation and release is sent;
//! - stacks are the kernel's frame-pointer walk, and Python frames are not
//!   read (both need `bpf_loop`).

use aya_ebpf::{
    macros::map,
    maps::{HashMap, LruHashMap},
    programs::ProbeContext,
    EbpfContext,
};
use memtrace_common::{PendingCall, PendingKey, ProbeSpec};

use crate::{in_flight, SPECS};

/// A probed address in a process.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct AddrKey {
    pub tgid: u32,
    pub _pad: u32,
    pub addr: u64,
}

/// Spec index of each probed address, per process; filled by the loader.
#[map]
static SPEC_BY_ADDR: HashMap<AddrKey, u32> = HashMap::with_max_entries(65536, 0);

/// Calls in flight, by thread and the stack pointer of their return.
#[map]
static CALLS: LruHashMap<PendingKey, PendingCall> = LruHashMap::with_max_entries(65536, 0);

/// The outermost call in flight per thread and family: its entry stack
/// pointer and when it began (jiffies).
#[map]
static OUTERMOST: LruHashMap<PendingKey, [u64; 2]> = LruHashMap::with_max_entries(65536, 0);

/// Marks a call skipped at entry as nested: its return is expected.
const NESTED: u16 = u16::MAX;

/// An in-flight record older than this many jiffies is stale (see
/// `in_flight`).
const STALE_JIFFIES: u64 = 10_000;

#[inline(always)]
fn key(pid_tgid: u64, word: u64) -> PendingKey {
    PendingKey {
        pid_tgid,
        family: word as u32,
        _pad: (word >> 32) as u32,
    }
}

/// The spec of the probe that hit at the entry's instruction pointer (the
/// breakpoint's address, or one past it, depending on the kernel).
#[inline(always)]
pub fn entry_spec(ctx: &ProbeContext, tgid: u32) -> Option<&'static ProbeSpec> {
    let ip = crate::arch::pc(crate::arch::regs(ctx));
    for addr in [ip.wrapping_sub(1), ip] {
        let lookup = AddrKey {
            tgid,
            _pad: 0,
            addr,
        };
        // SAFETY: the value is copied out at once.
        if let Some(&index) = unsafe { SPEC_BY_ADDR.get(&lookup) } {
            return SPECS.get(index);
        }
    }
    None
}

/// Whether a call of `family` is in flight on this thread at a shallower
/// stack level than `sp`.
#[inline(always)]
pub fn outer(pid_tgid: u64, family: u8, sp: u64) -> bool {
    // SAFETY: the value is copied out at once.
    match unsafe { OUTERMOST.get(&key(pid_tgid, u64::from(family))) } {
        Some(&[entry_sp, entered]) => {
            sp <= entry_sp && in_flight::now().wrapping_sub(entered) < STALE_JIFFIES
        }
        None => false,
    }
}

/// A call skipped at entry as nested: its return finds this mark and is
/// expected, not unpaired.
#[inline(always)]
pub fn skip_nested(pid_tgid: u64, sp: u64) {
    let mut call = PendingCall {
        entry_sp: sp,
        entered: 0,
        size: 0,
        count: 0,
        ptr: 0,
        out: 0,
        spec: NESTED,
        _pad: [0; 6],
    };
    call.entered = in_flight::now();
    // Never over the outer call's own record: a tail call (`realloc(NULL,
    // n)` jumping to `malloc`) enters at the outer call's stack pointer, and
    // both return once, as the outer call.
    let _ = CALLS.insert(
        &key(pid_tgid, sp.wrapping_add(crate::arch::RET_SP_DELTA)),
        &call,
        BPF_NOEXIST,
    );
}

/// `bpf_map_update_elem` flag: only create.
const BPF_NOEXIST: u64 = 1;

/// Saves `call` (of `family`) until its return.
#[inline(always)]
pub fn begin(pid_tgid: u64, family: u8, call: &PendingCall) {
    if CALLS
        .insert(
            &key(
                pid_tgid,
                call.entry_sp.wrapping_add(crate::arch::RET_SP_DELTA),
            ),
            call,
            0,
        )
        .is_err()
    {
        crate::bump(memtrace_common::Counter::PendingFull);
        return;
    }
    // It is the outermost of its family: an outer one would have made it
    // nested (or is stale).
    let _ = OUTERMOST.insert(
        &key(pid_tgid, u64::from(family)),
        &[call.entry_sp, call.entered],
        0,
    );
}

/// The call whose return is at `sp` on this thread, taken out of the
/// table; `Err(())` for a nested call's return (expected).
#[inline(always)]
pub fn take(pid_tgid: u64, sp: u64) -> Option<Result<PendingCall, ()>> {
    let lookup = key(pid_tgid, sp);
    // SAFETY: the value is copied out at once.
    let call = unsafe { CALLS.get(&lookup) }.copied()?;
    let _ = CALLS.remove(&lookup);
    if call.spec == NESTED {
        return Some(Err(()));
    }
    Some(Ok(call))
}

/// Forgets `family`'s outermost call on this thread if it is `call`.
#[inline(always)]
pub fn end(pid_tgid: u64, family: u8, call: &PendingCall) {
    let outer = key(pid_tgid, u64::from(family));
    // SAFETY: the value is copied out at once.
    if let Some(&[entry_sp, _]) = unsafe { OUTERMOST.get(&outer) } {
        if entry_sp == call.entry_sp {
            let _ = OUTERMOST.remove(&outer);
        }
    }
}
