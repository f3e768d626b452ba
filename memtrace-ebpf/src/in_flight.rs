//! The in-flight call table: what `call_enter` saved of an allocating call
//! until `call_exit` sees it return, and whether a call of a family is
//! already in flight on a thread (so nested calls are skipped).
//!
//! The fast path is an array slot per (thread, family), found by hashing the
//! two: the array lookup is inlined by the JIT and the slot is claimed by
//! one compare-and-swap of its tag, where a hash map costs an insert and a
//! delete per call. A call whose slot another thread holds goes to the
//! `PENDING` hash map instead (counted as `in_flight_spilled`); `SPILLED`
//! says how many calls sit there, so the hash map is only searched while
//! some do.

use core::intrinsics::{atomic_cxchg, atomic_xadd, atomic_xsub, AtomicOrdering};

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap},
};
use memtrace_common::{
    in_flight_slot, in_flight_tag, Counter, InFlightSlot, PendingCall, PendingKey, IN_FLIGHT_SLOTS,
};

use crate::bump;

/// An in-flight record older than this many jiffies is stale (its thread
/// left the call abnormally: longjmp, a C++ exception through the allocator,
/// thread exit): 10 s at HZ=1000, 100 s at HZ=100.
const STALE_JIFFIES: u64 = 10_000;

#[map]
static IN_FLIGHT: Array<InFlightSlot> = Array::with_max_entries(IN_FLIGHT_SLOTS, 0);
#[map]
static PENDING: HashMap<PendingKey, PendingCall> = HashMap::with_max_entries(65536, 0);
/// Calls held in `PENDING` now (index 0).
#[map]
static SPILLED: Array<u64> = Array::with_max_entries(1, 0);

/// Where a call was found.
pub enum Held {
    Slot(u32),
    Spilled,
}

/// The slot's tag, read once (other CPUs claim and free slots).
#[inline(always)]
fn tag_of(slot: *mut InFlightSlot) -> u64 {
    // SAFETY: `slot` points into an array map element, alive as long as the
    // map; an aligned u64 load is atomic on every BPF JIT target.
    unsafe { core::ptr::read_volatile(core::ptr::addr_of!((*slot).tag)) }
}

/// Frees the slot: the owner's last access (its record was read before).
#[inline(always)]
fn release(slot: *mut InFlightSlot) {
    // SAFETY: as in `tag_of`; an aligned u64 store is atomic, and the owner's
    // reads of the record come before it in program order.
    unsafe { core::ptr::write_volatile(core::ptr::addr_of_mut!((*slot).tag), 0) }
}

/// The number of calls in `PENDING`.
#[inline(always)]
fn spilled() -> u64 {
    match SPILLED.get_ptr_mut(0) {
        // SAFETY: an element of an array map, alive as long as the map.
        Some(count) => unsafe { core::ptr::read_volatile(count) },
        None => 0,
    }
}

/// Adds `delta` (wrapping) to the number of calls in `PENDING`.
#[inline(always)]
fn add_spilled(delta: i64) {
    if let Some(count) = SPILLED.get_ptr_mut(0) {
        // SAFETY: an aligned u64 element of an array map; the kernel's
        // atomic add (BPF_ATOMIC) is safe against concurrent CPUs.
        unsafe {
            if delta >= 0 {
                atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(count, delta as u64);
            } else {
                atomic_xsub::<u64, u64, { AtomicOrdering::Relaxed }>(count, delta.unsigned_abs());
            }
        }
    }
}

#[inline(always)]
fn key(pid_tgid: u64, family: u8) -> PendingKey {
    PendingKey {
        pid_tgid,
        family: u32::from(family),
        _pad: 0,
    }
}

/// The call of `family` in flight on this thread, if any, and where it is.
#[inline(always)]
pub fn find(pid_tgid: u64, family: u8) -> Option<(PendingCall, Held)> {
    let tid = pid_tgid as u32;
    let index = in_flight_slot(tid, family);
    if let Some(slot) = IN_FLIGHT.get_ptr_mut(index) {
        if tag_of(slot) == in_flight_tag(tid, family) {
            // SAFETY: the slot is this thread's (its tag), so only this
            // thread writes it, and it is not running anything else now.
            return Some((unsafe { (*slot).call }, Held::Slot(index)));
        }
    }
    if spilled() == 0 {
        return None;
    }
    // SAFETY: the value is copied out at once; only this thread touches its key.
    let call = unsafe { PENDING.get(&key(pid_tgid, family)) }.copied()?;
    Some((call, Held::Spilled))
}

/// Whether a call of `family` is in flight on this thread at a shallower
/// stack level than `sp` (so the current call runs inside it).
#[inline(always)]
pub fn outer(pid_tgid: u64, family: u8, sp: u64) -> bool {
    match find(pid_tgid, family) {
        Some((call, _)) => sp <= call.entry_sp && now().wrapping_sub(call.entered) < STALE_JIFFIES,
        None => false,
    }
}

/// The clock of in-flight records: jiffies (a tick), enough to tell a
/// record seconds old, and much cheaper than the precise clock (the coarse
/// clock helper is not allowed in tracing programs).
#[inline(always)]
pub fn now() -> u64 {
    // SAFETY: reading jiffies has no preconditions.
    unsafe { aya_ebpf::helpers::generated::bpf_jiffies64() }
}

/// Saves `call` (of `family`, on this thread) until its return.
#[inline(always)]
pub fn begin(pid_tgid: u64, family: u8, call: &PendingCall) {
    let tid = pid_tgid as u32;
    let tag = in_flight_tag(tid, family);
    if let Some(slot) = IN_FLIGHT.get_ptr_mut(in_flight_slot(tid, family)) {
        // A tag already ours is a call that never returned: it is replaced.
        let claimed = tag_of(slot) == tag
            // SAFETY: the tag is an aligned u64 of an array map element;
            // BPF_CMPXCHG makes the claim atomic across CPUs.
            || unsafe {
                atomic_cxchg::<u64, { AtomicOrdering::AcqRel }, { AtomicOrdering::Acquire }>(
                    core::ptr::addr_of_mut!((*slot).tag),
                    0,
                    tag,
                )
            }
            .1;
        if claimed {
            // SAFETY: the slot carries this thread's tag: no one else writes it.
            unsafe { (*slot).call = *call };
            return;
        }
    }
    bump(Counter::InFlightSpilled);
    let key = key(pid_tgid, family);
    // SAFETY: copied out at once; only this thread touches its key.
    let replacing = unsafe { PENDING.get(&key) }.is_some();
    if PENDING.insert(&key, call, 0).is_err() {
        bump(Counter::PendingFull);
        return;
    }
    if !replacing {
        add_spilled(1);
    }
}

/// Forgets the call found by [`find`] at `held`.
#[inline(always)]
pub fn end(pid_tgid: u64, family: u8, held: Held) {
    match held {
        Held::Slot(index) => {
            if let Some(slot) = IN_FLIGHT.get_ptr_mut(index) {
                release(slot);
            }
        }
        Held::Spilled => {
            if PENDING.remove(&key(pid_tgid, family)).is_ok() {
                add_spilled(-1);
            }
        }
    }
}
