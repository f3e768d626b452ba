//! The in-flight call table: what `call_enter` saved of an allocating call
//! until `call_exit` sees it return, and whether a call of a family is
//! already in flight on a thread (so nested calls are skipped).
//!
//! Where the kernel lets uprobe programs use task-local storage (the loader
//! probes it and sets `THREAD_STORAGE`), each thread keeps its calls in its
//! own record ([`ThreadCalls`], one slot per family), found by one helper
//! call and touched only by that thread: no hash, no claim, no
//! compare-and-swap; the kernel frees it when the thread exits, so a
//! thread that dies inside a call leaves nothing behind. Elsewhere, an array
//! slot per (thread, family), found by hashing the two: the array lookup is
//! inlined by the JIT and the slot is claimed by one compare-and-swap of its
//! tag, where a hash map costs an insert and a delete per call. Either way
//! a call whose slot is taken (by another thread's call, or by another
//! family's in the thread's record) goes to the `PENDING` hash map instead
//! (counted as `in_flight_spilled`); `SPILLED` says how many calls sit
//! there, so the hash map is only searched while some do.

use core::intrinsics::{atomic_cxchg, atomic_xadd, atomic_xsub, AtomicOrdering};

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap},
    Global,
};
use memtrace_common::{
    in_flight_slot, in_flight_tag, thread_call_slot, thread_call_tag, Counter, InFlightSlot,
    PendingCall, PendingKey, ThreadCalls, IN_FLIGHT_SLOTS, THREAD_INHERITED, THREAD_MADE,
};

use crate::bump;
#[cfg(not(feature = "compat"))]
use crate::task_storage::TaskStorage;

/// 1: calls are kept in each thread's task-local storage (`THREADS`); 0:
/// in the hashed `IN_FLIGHT` slots. Set at load time from the kernel's
/// probe, so the verifier only sees the path taken.
#[no_mangle]
static THREAD_STORAGE: Global<u32> = Global::new(0);

/// Each thread's in-flight calls (with `THREAD_STORAGE`). Not in the compat
/// object, whose kernels (before 5.11) may lack the map type.
#[cfg(not(feature = "compat"))]
#[link_section = ".maps"]
#[no_mangle]
static THREADS: TaskStorage<ThreadCalls> = TaskStorage::new();

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
    /// Hashed slot `IN_FLIGHT[.0]`.
    Slot(u32),
    /// The tag of its slot in the thread's own record.
    Own(*mut u32),
    Spilled,
}

/// Whether calls are kept in each thread's own record.
#[inline(always)]
fn per_thread() -> bool {
    THREAD_STORAGE.load() != 0
}

/// The current thread's own record of calls: null with hashed slots, when
/// it has none yet (and `create` is false), or when it could not be made.
#[derive(Clone, Copy)]
pub struct Thread(*mut ThreadCalls);

impl Thread {
    /// The current thread's record; `create`: make it if it has none (the
    /// caller may save a call).
    #[inline(always)]
    pub fn current(create: bool) -> Thread {
        #[cfg(not(feature = "compat"))]
        if per_thread() {
            return Thread(THREADS.current(create));
        }
        let _ = create;
        Thread(core::ptr::null_mut())
    }

    /// The tag of `family`'s slot in the record, and the call saved there.
    #[inline(always)]
    fn slot(self, family: u8) -> Option<(*mut u32, *mut PendingCall)> {
        if self.0.is_null() {
            return None;
        }
        let slot = thread_call_slot(family);
        // SAFETY: a non-null record is this thread's task-local storage value,
        // alive for the whole program run; `slot` < THREAD_CALL_SLOTS.
        unsafe {
            Some((
                core::ptr::addr_of_mut!((*self.0).tags[slot]),
                core::ptr::addr_of_mut!((*self.0).calls[slot]),
            ))
        }
    }

    /// Whether some call of this thread may be in the shared hash map: no
    /// record, or its count or flags say so.
    #[inline(always)]
    fn may_have_spilled(self) -> bool {
        if self.0.is_null() {
            return true;
        }
        // SAFETY: the thread's own record (see `slot`).
        unsafe { (*self.0).spilled != 0 || (*self.0).flags != THREAD_MADE }
    }

    /// Notes the first call saved through the record (see
    /// [`ThreadCalls::flags`]).
    #[inline(always)]
    fn note_use(self) {
        if self.0.is_null() {
            return;
        }
        // SAFETY: the thread's own record (see `slot`).
        unsafe {
            if (*self.0).flags == 0 {
                (*self.0).flags = if spilled() == 0 {
                    THREAD_MADE
                } else {
                    THREAD_MADE | THREAD_INHERITED
                };
            }
        }
    }

    /// Adds one to (`add`) or takes one from the record's count of spilled calls.
    #[inline(always)]
    fn count_spilled(self, add: bool) {
        if self.0.is_null() {
            return;
        }
        // SAFETY: the thread's own record (see `slot`).
        unsafe {
            if add {
                (*self.0).spilled += 1;
            } else if (*self.0).spilled > 0 {
                (*self.0).spilled -= 1;
            }
        }
    }
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

/// The call of `family` in flight on this thread (whose record is
/// `thread`), if any, and where it is.
#[inline(always)]
pub fn find(thread: Thread, pid_tgid: u64, family: u8) -> Option<(PendingCall, Held)> {
    if per_thread() {
        if let Some((tag, call)) = thread.slot(family) {
            // SAFETY: the thread's own record: only this thread touches it,
            // and it runs nothing else now.
            if unsafe { *tag } == thread_call_tag(family) {
                // SAFETY: as above.
                return Some((unsafe { *call }, Held::Own(tag)));
            }
        }
        if !thread.may_have_spilled() {
            return None;
        }
    } else {
        let tid = pid_tgid as u32;
        let index = in_flight_slot(tid, family);
        if let Some(slot) = IN_FLIGHT.get_ptr_mut(index) {
            if tag_of(slot) == in_flight_tag(tid, family) {
                // SAFETY: the slot is this thread's (its tag), so only this
                // thread writes it, and it is not running anything else now.
                return Some((unsafe { (*slot).call }, Held::Slot(index)));
            }
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
pub fn outer(thread: Thread, pid_tgid: u64, family: u8, sp: u64) -> bool {
    match find(thread, pid_tgid, family) {
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

/// Saves `call` (of `family`, on this thread, whose record is `thread`)
/// until its return.
#[inline(always)]
pub fn begin(thread: Thread, pid_tgid: u64, family: u8, call: &PendingCall) {
    if per_thread() {
        thread.note_use();
        if let Some((tag, saved)) = thread.slot(family) {
            let own = thread_call_tag(family);
            // SAFETY: the thread's own record (see `find`). A tag already
            // ours is a call that never returned: it is replaced.
            unsafe {
                if *tag == 0 || *tag == own {
                    *saved = *call;
                    *tag = own;
                    return;
                }
            }
        }
    } else if claim_slot(pid_tgid, family, call) {
        return;
    }
    if spill(pid_tgid, family, call) {
        thread.count_spilled(true);
    }
}

/// Saves `call` in its hashed slot if it can claim it.
#[inline(always)]
fn claim_slot(pid_tgid: u64, family: u8, call: &PendingCall) -> bool {
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
            return true;
        }
    }
    false
}

/// Saves `call` in the `PENDING` hash map (its slot was taken); true when
/// it is a new entry there.
#[inline(always)]
fn spill(pid_tgid: u64, family: u8, call: &PendingCall) -> bool {
    bump(Counter::InFlightSpilled);
    let key = key(pid_tgid, family);
    // SAFETY: copied out at once; only this thread touches its key.
    let replacing = unsafe { PENDING.get(&key) }.is_some();
    if PENDING.insert(&key, call, 0).is_err() {
        bump(Counter::PendingFull);
        return false;
    }
    if !replacing {
        add_spilled(1);
    }
    !replacing
}

/// Forgets the call found by [`find`] at `held` (on this thread, whose
/// record is `thread`).
#[inline(always)]
pub fn end(thread: Thread, pid_tgid: u64, family: u8, held: Held) {
    match held {
        Held::Slot(index) => {
            if let Some(slot) = IN_FLIGHT.get_ptr_mut(index) {
                release(slot);
            }
        }
        // SAFETY: the tag in the thread's own record that `find` returned,
        // alive for the whole program run.
        Held::Own(tag) => unsafe { *tag = 0 },
        Held::Spilled => {
            if PENDING.remove(&key(pid_tgid, family)).is_ok() {
                add_spilled(-1);
                thread.count_spilled(false);
            }
        }
    }
}
