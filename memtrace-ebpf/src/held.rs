//! Short-lived heap blocks settled in the kernel.
//!
//! Most heap blocks die young: a thread allocates, uses and frees before it
//! allocates again. Sending both events through the ring buffer costs two
//! records, most of what a traced `malloc`/`free` pair pays beyond its traps.
//! So each thread's newest heap allocation is held in its `HELD` slot (one
//! per thread, by a hash of its id) instead of being sent:
//!
//! - released while held (by its own thread, or by any thread: `HELD_INDEX`
//!   maps a hash of the address to the holding slot), the pair is *settled*:
//!   counted in `SettledInKernel`, never sent;
//! - the thread's next held allocation sends it first (so one thread's events
//!   stay in order), and user space takes any event held long enough (the
//!   array is memory-mapped, see the loader's `held` module), and all of them
//!   at the end of the trace.
//!
//! A held event is stamped when it leaves the slot, not when it was made:
//! a settled pair then never reads the clock (`--bpf-stats` here: the
//! return probe of a settled `malloc` went from ~200 to ~130 ns), and the
//! stamp still orders the block's events, since nothing else happens to a
//! held block until it leaves (its release settles it). Its age is at most
//! a scan or two of user space (about 0.1 s) short.
//!
//! A slot's `state` is its lock and version, and every transition is a
//! compare-and-swap: a release racing with a flush or with user space is
//! seen by exactly one of them. A flush reserves its ring record before it
//! takes the slot, so a release that lost the race is sent after the
//! allocation it releases. A block is held only while its address-index
//! entry is its own, so a release of a held block always finds it; when the
//! entry or the slot is taken (another thread hashing there), the allocation
//! is sent at once. Nothing is lost either way.

use core::{
    intrinsics::{atomic_cxchg, AtomicOrdering},
    ptr::{addr_of, addr_of_mut, read_volatile, write_volatile},
};

use aya_ebpf::{bindings::BPF_F_MMAPABLE, macros::map, maps::Array};
use memtrace_common::{
    held_freed, held_hint, held_owner, held_slot, held_state, held_version, Counter, HeldSlot,
    WireEvent, HELD_HINTS, HELD_SLOTS,
};

use crate::{bump, now_ns, wakeup_flags, CONTROL, EVENTS};

/// Index in `CONTROL`: 1 while user space has the held table mapped (it
/// takes what stays held), so allocations may be held.
const CONTROL_HOLD: u32 = 2;

#[map]
static HELD: Array<HeldSlot> = Array::with_max_entries(HELD_SLOTS, BPF_F_MMAPABLE);
/// Address hash to holding slot + 1 (0: none). A u64 per entry, as user
/// space sees it: the elements of an array map are 8-byte aligned.
#[map]
static HELD_INDEX: Array<u64> = Array::with_max_entries(HELD_HINTS, BPF_F_MMAPABLE);

#[inline(always)]
fn enabled() -> bool {
    CONTROL.get(CONTROL_HOLD).is_some_and(|&flag| flag != 0)
}

#[inline(always)]
fn load(word: *const u64) -> u64 {
    // SAFETY: `word` points into an element of an array map, alive as long as
    // the map; an aligned u64 load is atomic on every BPF JIT target.
    unsafe { read_volatile(word) }
}

#[inline(always)]
fn swap(word: *mut u64, old: u64, new: u64) -> bool {
    // SAFETY: an aligned u64 of an array map element; BPF_CMPXCHG makes the
    // exchange atomic across CPUs (and against user space's, on the mapping).
    unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::AcqRel }, { AtomicOrdering::Acquire }>(word, old, new)
    }
    .1
}

/// Stores `state` after everything written to the slot before it (those
/// writes are volatile too, so the compiler keeps their order, and x86 keeps
/// stores in order).
#[inline(always)]
fn publish(slot: *mut HeldSlot, state: u64) {
    // SAFETY: as in `load`.
    unsafe { write_volatile(addr_of_mut!((*slot).state), state) }
}

/// Frees address-index entry `hint` if `holder` (slot + 1) has it.
#[inline(always)]
fn release_hint(hint: u32, holder: u64) {
    if let Some(entry) = HELD_INDEX.get_ptr_mut(hint) {
        swap(entry, holder, 0);
    }
}

/// Frees address-index entry `hint` of the block this thread just settled
/// from its own slot: a plain store, since no one else changes an entry
/// that names a slot while it is in use (a claim needs the entry free, a
/// release the slot's state, which the settle took).
#[inline(always)]
fn free_own_hint(hint: u32) {
    if let Some(entry) = HELD_INDEX.get_ptr_mut(hint) {
        // SAFETY: an aligned u64 of an array map element; an aligned store
        // is atomic on every BPF JIT target.
        unsafe { write_volatile(entry, 0) };
    }
}

/// Holds `event`, a heap allocation of the current thread, instead of
/// sending it; false when it cannot be held (the caller sends it).
// A function of its own where it may be (the verifier checks it once);
// inlined in the tail-calling object, whose programs may hold no BPF-to-BPF
// calls on arm64 before 6.0.
#[cfg_attr(not(feature = "tailcall"), inline(never))]
#[cfg_attr(feature = "tailcall", inline(always))]
pub fn hold(event: &WireEvent) -> bool {
    if !enabled() {
        return false;
    }
    let tid = event.tid;
    let index = held_slot(tid);
    let Some(slot) = HELD.get_ptr_mut(index) else {
        return false;
    };
    // SAFETY: `slot` is an element of an array map.
    let state_word = unsafe { addr_of_mut!((*slot).state) };
    let state = load(state_word);
    let owner = held_owner(state);
    if state & 1 != 0 || (owner != 0 && owner != tid + 1) {
        // Another thread's slot, or user space is taking this one.
        return false;
    }
    let holder = u64::from(index) + 1;
    let hint = held_hint(event.addr);
    // SAFETY: the slot's event is only rewritten by its owner, this thread.
    let old_addr = unsafe { read_volatile(addr_of!((*slot).event.addr)) };
    let old_hint = if owner == 0 {
        u32::MAX
    } else {
        held_hint(old_addr)
    };
    let Some(entry) = HELD_INDEX.get_ptr_mut(hint) else {
        return false;
    };
    let shared = old_hint == hint && load(entry) == holder;
    if !shared && !swap(entry, 0, holder) {
        return false;
    }
    let version = held_version(state);
    if owner == 0 {
        if !swap(state_word, state, held_state(tid, version) | 1) {
            release_hint(hint, holder);
            return false;
        }
    } else {
        // Send the block held before: reserved first, so a release that
        // finds the slot taken is sent after it.
        let Some(mut record) = EVENTS.reserve::<WireEvent>(0) else {
            if !shared {
                release_hint(hint, holder);
            }
            return false;
        };
        // Stamped before the slot is locked: a release that finds it locked
        // reads the clock after, so it is stamped later.
        let sent_ns = now_ns();
        if !swap(state_word, state, state | 1) {
            record.discard(0);
            if !shared {
                release_hint(hint, holder);
            }
            return false;
        }
        // SAFETY: the slot is locked by this thread (odd state of its own).
        let mut sent = unsafe { (*slot).event };
        sent.ts_ns = sent_ns;
        record.write(sent);
        record.submit(wakeup_flags());
        if !shared {
            release_hint(old_hint, holder);
        }
    }
    // SAFETY: the slot is locked by this thread; user space and other threads
    // only read it after taking an even state.
    unsafe {
        write_volatile(addr_of_mut!((*slot).settled_tid), 0);
        write_volatile(addr_of_mut!((*slot).event), *event);
    }
    publish(slot, held_state(tid, version.wrapping_add(1)));
    true
}

/// Settles the release of `ptr` by spec `spec` on the current thread in the
/// kernel when its block is held: true when nothing is to be sent. `release`:
/// the call only releases (a reallocation also creates, so a release after
/// it is never a repeat of this one).
// A function of its own where it may be (the verifier checks it once);
// inlined in the tail-calling object, whose programs may hold no BPF-to-BPF
// calls on arm64 before 6.0.
#[cfg_attr(not(feature = "tailcall"), inline(never))]
#[cfg_attr(feature = "tailcall", inline(always))]
pub fn settle(pid_tgid: u64, ptr: u64, spec: u16, release: bool) -> bool {
    if !enabled() {
        return false;
    }
    let tid = pid_tgid as u32;
    let pid = (pid_tgid >> 32) as u32;
    let index = held_slot(tid);
    let Some(slot) = HELD.get_ptr_mut(index) else {
        return false;
    };
    // SAFETY: `slot` is an element of an array map.
    let state_word = unsafe { addr_of_mut!((*slot).state) };
    let state = load(state_word);
    if state & 1 == 0 && held_owner(state) == tid + 1 {
        // SAFETY: the slot's event is only rewritten by its owner, this thread.
        let (addr, owner) = unsafe { ((*slot).event.addr, (*slot).event.pid) };
        if addr == ptr && owner == pid {
            if !swap(state_word, state, held_freed(state)) {
                // User space took it this instant: the release is sent after it.
                return false;
            }
            free_own_hint(held_hint(ptr));
            // SAFETY: the slot is free; these words are only a hint for this
            // thread's next release (a colliding thread clears them).
            unsafe {
                (*slot).settled_addr = ptr;
                (*slot).settled_spec = spec;
                (*slot).settled_tid = if release { tid + 1 } else { 0 };
            }
            bump(Counter::SettledInKernel);
            return true;
        }
    }
    // SAFETY: as above; a torn value only misses a repeat.
    unsafe {
        if (*slot).settled_tid == tid + 1 {
            (*slot).settled_tid = 0;
            if (*slot).settled_addr == ptr && (*slot).settled_spec != spec {
                bump(Counter::SettledSeenTwice);
                return true;
            }
        }
    }
    settle_elsewhere(pid, ptr, index)
}

/// Sends the event held in thread `tid`'s slot now, if it holds one (a
/// process running exec: its old image's blocks go into the ring before
/// the exec's event, never after). Like user space's take: the record is
/// reserved first, the slot locked, sent, then freed at its next version;
/// a slot locked meanwhile (a release settling it, user space taking it)
/// is left to them, and a full ring leaves it held (user space takes it).
#[inline(always)]
pub fn send(tid: u32) {
    let index = held_slot(tid);
    let Some(slot) = HELD.get_ptr_mut(index) else {
        return;
    };
    // SAFETY: `slot` is an element of an array map.
    let state_word = unsafe { addr_of_mut!((*slot).state) };
    let state = load(state_word);
    if state & 1 != 0 || held_owner(state) != tid.wrapping_add(1) {
        return;
    }
    let Some(mut record) = EVENTS.reserve::<WireEvent>(0) else {
        return;
    };
    let sent_ns = now_ns();
    if !swap(state_word, state, state | 1) {
        record.discard(0);
        return;
    }
    // SAFETY: the slot is locked by this program (its odd state).
    let mut sent = unsafe { (*slot).event };
    sent.ts_ns = sent_ns;
    record.write(sent);
    record.submit(wakeup_flags());
    release_hint(held_hint(sent.addr), u64::from(index) + 1);
    publish(slot, held_freed(state));
}

/// Forgets the block the current thread settled last: it made another
/// event, so a release of that address now is a release of its own.
#[inline(always)]
pub fn forget_settled(tid: u32) {
    if let Some(slot) = HELD.get_ptr_mut(held_slot(tid)) {
        // SAFETY: as in `settle`.
        unsafe {
            if (*slot).settled_tid == tid + 1 {
                (*slot).settled_tid = 0;
            }
        }
    }
}

/// Settles the release of `ptr` (process `pid`) if another thread's slot
/// holds it, found through the address index.
#[inline(always)]
fn settle_elsewhere(pid: u32, ptr: u64, own: u32) -> bool {
    let hint = held_hint(ptr);
    let Some(entry) = HELD_INDEX.get_ptr_mut(hint) else {
        return false;
    };
    let holder = load(entry);
    if holder == 0 || holder == u64::from(own) + 1 {
        return false;
    }
    let Some(slot) = HELD.get_ptr_mut((holder - 1) as u32) else {
        return false;
    };
    // SAFETY: `slot` is an element of an array map.
    let state_word = unsafe { addr_of_mut!((*slot).state) };
    let state = load(state_word);
    if held_owner(state) == 0 || state & 1 != 0 {
        return false;
    }
    // SAFETY: read under an even state; the swap below fails if the owner
    // changed the slot since (it locks it first).
    let (addr, owner) = unsafe {
        (
            read_volatile(addr_of!((*slot).event.addr)),
            read_volatile(addr_of!((*slot).event.pid)),
        )
    };
    if addr != ptr || owner != pid || !swap(state_word, state, held_freed(state)) {
        return false;
    }
    swap(entry, holder, 0);
    bump(Counter::SettledInKernel);
    true
}
