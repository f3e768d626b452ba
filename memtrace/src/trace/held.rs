//! User space's side of the kernel's held allocations (see the eBPF
//! program's `held` module): the `HELD` slots and their address index,
//! memory-mapped, from which events held too long (and every one at the end
//! of a trace) are taken with the same compare-and-swap protocol the kernel
//! uses, so each held event is sent, settled or taken exactly once.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use memtrace_common::{
    held_freed, held_hint, held_owner, held_slot, HeldSlot, WireEvent, HELD_HINTS, HELD_SLOTS,
};

/// A shared, writable mapping of a BPF array map.
struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

impl Mapping {
    fn new(fd: BorrowedFd<'_>, bytes: usize) -> io::Result<Self> {
        // SAFETY: the page size query has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        let len = bytes.div_ceil(page) * page;
        // SAFETY: a fresh shared mapping of a BPF map fd; the kernel checks
        // that the map is mmapable and `len` fits it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        NonNull::new(base.cast::<u8>())
            .map(|base| Mapping { base, len })
            .ok_or_else(|| io::Error::other("mmap returned NULL"))
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are exactly what mmap returned; nothing refers
        // to the mapping once its owner is dropped.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// The held slots and their address index, mapped.
pub struct HeldTable {
    slots: Mapping,
    index: Mapping,
}

// SAFETY: the mappings are plain shared memory, accessed only through atomics
// and volatile reads under the slot protocol.
unsafe impl Send for HeldTable {}

impl HeldTable {
    /// Maps the `HELD` array (`slots`) and `HELD_INDEX` (`index`).
    pub fn map(slots: BorrowedFd<'_>, index: BorrowedFd<'_>) -> io::Result<Self> {
        Ok(HeldTable {
            slots: Mapping::new(slots, std::mem::size_of::<HeldSlot>() * HELD_SLOTS as usize)?,
            index: Mapping::new(index, std::mem::size_of::<u64>() * HELD_HINTS as usize)?,
        })
    }

    fn slot(&self, index: u32) -> *mut HeldSlot {
        debug_assert!(index < HELD_SLOTS);
        // SAFETY: `index` < HELD_SLOTS, so the element lies inside the mapping.
        unsafe {
            self.slots
                .base
                .as_ptr()
                .cast::<HeldSlot>()
                .add(index as usize)
        }
    }

    fn state(&self, index: u32) -> &AtomicU64 {
        // SAFETY: `state` is the first, 8-byte aligned word of an element
        // inside the mapping, which lives as long as `self`; the kernel only
        // touches it atomically too.
        unsafe { AtomicU64::from_ptr(std::ptr::addr_of_mut!((*self.slot(index)).state)) }
    }

    /// Address-index entry `hint`: a u64, since the elements of an array map
    /// are 8-byte aligned whatever their size.
    fn hint(&self, hint: u32) -> &AtomicU64 {
        debug_assert!(hint < HELD_HINTS);
        // SAFETY: `hint` < HELD_HINTS: an aligned u64 inside the mapping.
        unsafe { AtomicU64::from_ptr(self.index.base.as_ptr().cast::<u64>().add(hint as usize)) }
    }

    /// Takes held events into `out`, each stamped with the time it was
    /// taken (the kernel leaves a held event unstamped, see `Take`).
    ///
    /// The stamp is read after the slot's state showed the event held and
    /// before the slot is taken: later than the allocation, and earlier than
    /// any release that finds the slot taken (it reads the kernel's clock,
    /// the same `CLOCK_MONOTONIC`, after it sees the slot taken).
    pub fn take(&self, which: Take<'_>, out: &mut Vec<WireEvent>) {
        let mut seen = match which {
            Take::Unchanged(seen) => Some(seen),
            Take::All => None,
        };
        for index in 0..HELD_SLOTS {
            let state = self.state(index).load(Ordering::Acquire);
            if let Some(seen) = seen.as_deref_mut() {
                let before = std::mem::replace(&mut seen[index as usize], state);
                if before != state {
                    continue;
                }
            }
            if held_owner(state) == 0 || state & 1 != 0 {
                continue;
            }
            let taken_ns = crate::trace::monotonic_ns();
            if self
                .state(index)
                .compare_exchange(state, state | 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                // Settled, sent or replaced meanwhile.
                continue;
            }
            // SAFETY: the slot is locked by user space: its owner only writes
            // it after taking a free or even state.
            let mut event =
                unsafe { std::ptr::read_volatile(std::ptr::addr_of!((*self.slot(index)).event)) };
            let _ = self.hint(held_hint(event.addr)).compare_exchange(
                u64::from(index) + 1,
                0,
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
            // Free, at the next version: a release that read the held state
            // before the take cannot settle whatever the slot holds next.
            self.state(index)
                .store(held_freed(state), Ordering::Release);
            debug_assert_eq!(held_slot(event.tid), index);
            event.ts_ns = taken_ns;
            out.push(event);
        }
    }
}

/// Which held events [`HeldTable::take`] takes.
pub enum Take<'a> {
    /// Those still held as the previous scan with the same `seen` found
    /// them (one state word per slot, [`HELD_SLOTS`] of them, updated):
    /// held for at least the time between the two scans.
    Unchanged(&'a mut [u64]),
    /// Every one.
    All,
}

#[cfg(test)]
mod tests {
    use super::*;
    use memtrace_common::held_state;
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};

    /// A memfd of `bytes` zeroes, standing in for a BPF array map.
    fn memfd(bytes: usize) -> OwnedFd {
        // SAFETY: a fresh anonymous file; the name is a valid C string.
        let fd = unsafe { libc::memfd_create(c"held-test".as_ptr(), 0) };
        assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: `fd` was just created and is owned here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: `fd` is a valid memfd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), bytes as i64) }, 0);
        fd
    }

    fn event(tid: u32, addr: u64, ts_ns: u64) -> WireEvent {
        WireEvent {
            ts_ns,
            addr,
            size: 8,
            aux: 0,
            pid: 7,
            tid,
            stack_id: 0,
            spec: 0,
            kind: 0,
            flags: 0,
            py_stack: 0,
            tag: 0,
        }
    }

    /// Holds `event` as the kernel does: event, index entry, then state.
    fn hold(table: &HeldTable, event: WireEvent, state: u64) -> u32 {
        let index = held_slot(event.tid);
        // SAFETY: the slot lies in the mapping; nothing else runs here.
        unsafe { (*table.slot(index)).event = event };
        table
            .hint(held_hint(event.addr))
            .store(u64::from(index) + 1, Ordering::Release);
        table.state(index).store(state, Ordering::Release);
        index
    }

    #[test]
    fn takes_only_events_held_since_the_last_scan_stamped_when_taken() {
        let slots = memfd(std::mem::size_of::<HeldSlot>() * HELD_SLOTS as usize);
        let index = memfd(8 * HELD_HINTS as usize);
        let table = HeldTable::map(slots.as_fd(), index.as_fd()).expect("mapped");
        let mut seen = vec![0; HELD_SLOTS as usize];
        let old = hold(&table, event(11, 0x1000, 0), held_state(11, 1));
        let mut out = Vec::new();
        table.take(Take::Unchanged(&mut seen), &mut out);
        assert!(out.is_empty(), "first seen: not yet taken");

        let young = hold(&table, event(12, 0x2000, 0), held_state(12, 1));
        // Being written by its thread: never taken.
        let busy = hold(&table, event(13, 0x3000, 0), held_state(13, 1) | 1);
        let before = crate::trace::monotonic_ns();
        table.take(Take::Unchanged(&mut seen), &mut out);
        let after = crate::trace::monotonic_ns();
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].tid, out[0].addr), (11, 0x1000));
        assert!((before..=after).contains(&out[0].ts_ns), "{}", out[0].ts_ns);
        // Free, at the next version (never the state it was taken from).
        assert_eq!(
            table.state(old).load(Ordering::Acquire),
            held_freed(held_state(11, 1))
        );
        assert_eq!(held_owner(table.state(old).load(Ordering::Acquire)), 0);
        assert_eq!(table.hint(held_hint(0x1000)).load(Ordering::Acquire), 0);
        assert_ne!(table.state(young).load(Ordering::Acquire), 0);

        // Replaced by its thread since the last scan: not taken yet.
        hold(&table, event(12, 0x2800, 0), held_state(12, 2));
        out.clear();
        table.take(Take::Unchanged(&mut seen), &mut out);
        assert!(out.is_empty());

        table.take(Take::All, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].tid, out[0].addr), (12, 0x2800));
        assert_eq!(table.hint(held_hint(0x2800)).load(Ordering::Acquire), 0);
        assert_eq!(table.state(busy).load(Ordering::Acquire) & 1, 1);
    }

    /// Every transition moves the version on, freeing included, so a state
    /// read before a slot was freed and held again never matches it (the
    /// ABA a late cross-thread release hit when free was always 0).
    #[test]
    fn freed_states_never_repeat_a_held_state() {
        let held = held_state(5, 1);
        let freed = held_freed(held);
        assert_eq!(held_owner(freed), 0);
        assert_eq!(freed & 1, 0);
        // The kernel holds from a free state at its version, then publishes
        // the next one: never the state held before the free.
        let version = memtrace_common::held_version(freed);
        let again = held_state(5, version.wrapping_add(1));
        assert_ne!(again, held);
        assert_ne!(held_freed(again), freed);
        // The version wraps within its 31 bits.
        let last = held_state(5, u32::MAX >> 1);
        assert_eq!(held_owner(held_freed(last)), 0);
        assert_eq!(memtrace_common::held_version(held_freed(last)), 0);
    }
}
