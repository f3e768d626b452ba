//! Wire types shared by memtrace's eBPF programs and its userspace loader.
//!
//! Everything here is `#[repr(C)]`, made of fixed-width integers with explicit
//! padding, and size-checked at compile time, so both sides agree on layout
//! byte for byte. Discriminants travel as plain integers and are decoded on
//! the user side with `TryFrom`, never transmuted.
#![no_std]

pub mod unwind;

/// Marker for "this argument slot is not used" in a [`ProbeSpec`].
pub const ARG_NONE: u8 = 0xff;

/// Value of [`WireEvent::stack_id`] when no stack was requested.
pub const STACK_NONE: i32 = i32::MIN;

/// [`WireEvent::flags`]: the new block of a reallocation is outside the sample.
pub const FLAG_NEW_UNSAMPLED: u8 = 1;

/// [`WireEvent::flags`]: a USDT allocation whose spec has a `tag_loc`:
/// [`WireEvent::tag`] holds its value (the low 32 bits), and
/// [`WireEvent::aux`] the `aux_loc` value.
pub const FLAG_TAGGED: u8 = 2;

/// Maximum number of probe specs (one per attached function and library).
pub const MAX_SPECS: u32 = 1024;

/// What a probed function does to the live set.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecKind {
    /// Creates a block: its address comes from the return value or an out-parameter.
    Alloc = 0,
    /// Releases the block named by `ptr_arg`.
    Free = 1,
    /// `realloc`-like: releases `ptr_arg` and creates the returned block.
    Realloc = 2,
}

/// How a probed function reports success.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetKind {
    /// Returns the new pointer; NULL means failure.
    Pointer = 0,
    /// Returns a status code; `success_code` means success (the block comes from `out_arg`).
    Status = 1,
    /// `mmap`-like: returns the pointer; `MAP_FAILED` (-1) means failure.
    MmapPointer = 2,
    /// Returns nothing of interest (`free`): no return probe is needed.
    Void = 3,
    /// Returns a non-negative handle (a file descriptor); negative means failure.
    NonNegative = 4,
}

/// Special handling a few functions need beyond the generic argument model.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecQuirk {
    None = 0,
    /// `mmap`: only anonymous mappings (flags in arg 3 carry `MAP_ANONYMOUS`) count.
    AnonMmap = 1,
    /// `munmap`: only addresses recorded by an `AnonMmap` probe count.
    Munmap = 2,
    /// The size is read through a `size_t*` out-parameter (`size_arg`) after the call
    /// (e.g. `cudaMallocPitch`'s pitch) and multiplied by `count_arg`.
    SizeOutParam = 3,
    /// `cudaMalloc3D(cudaPitchedPtr*, cudaExtent)`: the pitched pointer struct is an
    /// out-parameter whose first word is the pointer and second the pitch; the
    /// extent (width, height, depth) is passed on the stack.
    Malloc3D = 4,
    /// Handles are 32-bit (`int fd`, `uint32_t modelId`): the upper half of the
    /// register or out-parameter is not part of the value.
    Handle32 = 5,
    /// `xallocx(ptr, size, extra, flags)`: resizes the block in place and
    /// returns its new real size, so the block stays at `ptr_arg` and its size
    /// is the return value.
    ResizeInPlace = 6,
}

/// [`ArgLoc::kind`]: no location; the argument comes from the C ABI
/// register named by the spec's `*_arg` slot.
pub const LOC_NONE: u8 = 0;
/// [`ArgLoc::kind`]: the value is in register `reg`.
pub const LOC_REG: u8 = 1;
/// [`ArgLoc::kind`]: the value is in user memory at register `reg` + `offset`.
pub const LOC_MEM: u8 = 2;
/// [`ArgLoc::kind`]: the value is the constant `offset`.
pub const LOC_CONST: u8 = 3;

/// Where a USDT probe's argument is (its `sdt.h` argument spec, decoded):
/// a register, memory off a register, or a constant, of `size` bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArgLoc {
    /// `LOC_*`.
    pub kind: u8,
    /// The register: its slot in the x86-64 `struct pt_regs` (offset / 8).
    pub reg: u8,
    /// Bytes of the value: 1, 2, 4 or 8.
    pub size: u8,
    /// 1: sign-extended from `size` bytes.
    pub signed: u8,
    pub _pad: [u8; 4],
    /// Memory offset, or the constant.
    pub offset: i64,
}

impl ArgLoc {
    pub const fn none() -> Self {
        ArgLoc {
            kind: LOC_NONE,
            reg: 0,
            size: 8,
            signed: 0,
            _pad: [0; 4],
            offset: 0,
        }
    }
}

/// Per-attach-point description of a probed function, stored in the `SPECS`
/// array map and selected by the attach cookie.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeSpec {
    /// Index of this spec (also its attach cookie).
    pub index: u16,
    /// [`SpecKind`] as `u8`.
    pub kind: u8,
    /// [`RetKind`] as `u8`.
    pub ret: u8,
    /// Argument holding the size, or [`ARG_NONE`].
    pub size_arg: u8,
    /// Argument multiplied with the size (`calloc`'s count), or [`ARG_NONE`].
    pub count_arg: u8,
    /// Argument holding the pointer to release, or [`ARG_NONE`].
    pub ptr_arg: u8,
    /// Argument holding a `void**` out-parameter for the new block, or [`ARG_NONE`].
    pub out_arg: u8,
    /// Family of this function: calls nested inside an in-flight call of the same
    /// family on the same thread are not counted twice.
    pub family: u8,
    /// A second family whose in-flight call suppresses this one (the CUDA runtime
    /// over the driver), or [`ARG_NONE`].
    pub parent_family: u8,
    /// [`SpecQuirk`] as `u8`.
    pub quirk: u8,
    /// 1: a heap function, whose blocks may be settled in the kernel when
    /// they are released before they leave it (see [`HeldSlot`]).
    pub heap: u8,
    pub _pad: [u8; 4],
    /// Status value meaning success when `ret` is [`RetKind::Status`].
    pub success_code: i64,
    /// USDT probes (`usdt_fire`): where the block's pointer is. With
    /// `kind` [`SpecKind::Alloc`] and `ret` [`RetKind::Void`] the block is
    /// created at the probe (pointer and size known there, no return
    /// probe); with [`SpecKind::Free`] it is released there.
    pub ptr_loc: ArgLoc,
    /// USDT probes: where the block's size is ([`LOC_NONE`]: 0).
    pub size_loc: ArgLoc,
    /// USDT allocations: a value sent along in [`WireEvent::aux`] (a
    /// PyTorch stream id), [`LOC_NONE`]: none.
    pub aux_loc: ArgLoc,
    /// USDT allocations: a value sent along in [`WireEvent::tag`] with
    /// [`FLAG_TAGGED`] (a PyTorch device index), [`LOC_NONE`]: none.
    pub tag_loc: ArgLoc,
}

impl ProbeSpec {
    pub const fn empty() -> Self {
        ProbeSpec {
            index: 0,
            kind: SpecKind::Alloc as u8,
            ret: RetKind::Pointer as u8,
            size_arg: ARG_NONE,
            count_arg: ARG_NONE,
            ptr_arg: ARG_NONE,
            out_arg: ARG_NONE,
            family: 0,
            parent_family: ARG_NONE,
            quirk: SpecQuirk::None as u8,
            heap: 0,
            _pad: [0; 4],
            success_code: 0,
            ptr_loc: ArgLoc::none(),
            size_loc: ArgLoc::none(),
            aux_loc: ArgLoc::none(),
            tag_loc: ArgLoc::none(),
        }
    }
}

/// What happened, as sent through the ring buffer.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// A block was created: `addr`, `size`, `stack_id`.
    Alloc = 0,
    /// A block was released: `addr`.
    Free = 1,
    /// `aux` (old block) was released and `addr` created with `size`.
    Realloc = 2,
    /// The call failed: `aux` is the return code, `size` the requested size.
    Failed = 3,
    /// A traced process forked (`--follow-forks`): `pid` is the parent,
    /// `aux` the clone flags; no spec, no address.
    Fork = 4,
    /// The unwinder met a PC outside every executable mapping it knows of
    /// process `pid` (a library mapped since its last update): user space
    /// re-reads the mappings at once. Rate-limited per process.
    MapsStale = 5,
    /// `munmap(addr, size)`: the range `addr..addr + size` was unmapped,
    /// whole mappings or parts of them (user space keeps the ranges).
    Unmap = 6,
    /// Traced process `pid` ran exec (`sched_process_exec`): its old image
    /// is gone, and every event of it came before this one (what its
    /// exec'ing thread and the leader held in the kernel included); `aux`
    /// is the exec'ing thread's id before the exec. No spec, no address.
    Exec = 7,
}

/// One event in the ring buffer: 56 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireEvent {
    /// `bpf_ktime_get_ns()` (`CLOCK_MONOTONIC`) when the event was sent: at
    /// the event, or for a held allocation when it left its [`HeldSlot`]
    /// (0 while it is held there).
    pub ts_ns: u64,
    /// The block created or released.
    pub addr: u64,
    /// Bytes requested (allocations, failures).
    pub size: u64,
    /// Old block for reallocations, return code for failures; for USDT
    /// allocations the spec's `aux_loc` value (0: none).
    pub aux: u64,
    /// Thread group id (the process id).
    pub pid: u32,
    /// Thread id.
    pub tid: u32,
    /// Id in the `STACKS` map, a negative errno when capture failed, or [`STACK_NONE`].
    pub stack_id: i32,
    /// Index of the [`ProbeSpec`] that produced the event.
    pub spec: u16,
    /// [`EventKind`] as `u8`.
    pub kind: u8,
    /// Reserved.
    pub flags: u8,
    /// Key of the allocating thread's Python stack in `PY_STACKS`, or 0 when
    /// the process is no CPython interpreter or its frames could not be read.
    pub py_stack: u32,
    /// USDT allocations with [`FLAG_TAGGED`]: the spec's `tag_loc` value
    /// (its low 32 bits); 0 otherwise.
    pub tag: u32,
}

/// Key of the per-thread in-flight call table.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingKey {
    pub pid_tgid: u64,
    pub family: u32,
    pub _pad: u32,
}

/// An allocator call between its entry and its return.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingCall {
    /// Stack pointer at entry: the return is recognised by `sp == entry_sp + 8`.
    pub entry_sp: u64,
    /// When the call was entered, in jiffies (only to tell stale records).
    pub entered: u64,
    pub size: u64,
    pub count: u64,
    pub ptr: u64,
    pub out: u64,
    pub spec: u16,
    pub _pad: [u8; 6],
}

/// Slots of the in-flight call table (a power of two).
pub const IN_FLIGHT_SLOTS: u32 = 16384;

/// One slot of the in-flight call table: an array indexed by a hash of
/// (thread, family), claimed by compare-and-swap of `tag`; a call whose slot
/// another thread holds is kept in the hash map instead.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InFlightSlot {
    /// [`in_flight_tag`] of the call held, 0 while free.
    pub tag: u64,
    pub call: PendingCall,
}

/// The tag of a call of `family` on thread `tid` (never 0).
#[inline(always)]
pub fn in_flight_tag(tid: u32, family: u8) -> u64 {
    ((u64::from(tid) + 1) << 8) | u64::from(family)
}

/// The slot of a call of `family` on thread `tid`.
#[inline(always)]
pub fn in_flight_slot(tid: u32, family: u8) -> u32 {
    let mixed = (u64::from(tid) | (u64::from(family) << 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (mixed >> (64 - IN_FLIGHT_SLOTS.trailing_zeros())) as u32
}

/// In-flight call slots in a thread's own storage ([`ThreadCalls`]).
pub const THREAD_CALL_SLOTS: usize = 8;

/// A thread's calls between their entry and their return, in BPF
/// task-local storage where the kernel lets uprobe programs use it: the
/// thread's own record, created by its first probed call and freed by the
/// kernel when the thread exits, so saving a call needs no hash, no claim
/// and no compare-and-swap (only this thread ever touches it, and a thread
/// runs one program at a time). A call of `family` sits in slot
/// [`thread_call_slot`] (one per built-in family); when another family's
/// call is in flight there (a user-declared pair's call nested in or around
/// the built-in family of the same slot), the call goes to the shared hash
/// map, counted as `in_flight_spilled`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ThreadCalls {
    /// Per slot: family + 1 of the call saved there, 0 while free.
    pub tags: [u32; THREAD_CALL_SLOTS],
    /// This thread's calls sent to the shared hash map since the record was
    /// made, so a thread with none never looks there.
    pub spilled: u32,
    /// [`THREAD_MADE`] once a call was saved through the record;
    /// [`THREAD_INHERITED`] when some call was in the hash map then (it may
    /// be one this thread spilled before it had a record: the thread
    /// always looks there).
    pub flags: u32,
    pub calls: [PendingCall; THREAD_CALL_SLOTS],
}

/// [`ThreadCalls::flags`]: a call was saved through the record.
pub const THREAD_MADE: u32 = 1;
/// [`ThreadCalls::flags`]: the shared hash map held calls when the record
/// was first used.
pub const THREAD_INHERITED: u32 = 2;

/// The slot of a call of `family` in its thread's [`ThreadCalls`].
#[inline(always)]
pub fn thread_call_slot(family: u8) -> usize {
    usize::from(family) % THREAD_CALL_SLOTS
}

/// The tag of a call of `family` in [`ThreadCalls::tags`] (never 0).
#[inline(always)]
pub fn thread_call_tag(family: u8) -> u32 {
    u32::from(family) + 1
}

/// Slots of the held-allocation table: one per thread (by a hash of its id).
pub const HELD_SLOTS: u32 = 16384;
/// Entries of the held table's address index.
pub const HELD_HINTS: u32 = 65536;

/// A thread's newest heap allocation, held in the kernel instead of being
/// sent at once: if the same thread (or any thread, found through the
/// address index) releases it before the thread's next allocation, the pair
/// is settled in the kernel and never costs a ring-buffer record. Otherwise
/// the thread's next held allocation sends it, or user space takes it once
/// it is old (the array is memory-mapped by the loader). A held event is
/// stamped when it leaves the slot, so a settled pair never reads the clock.
///
/// `state` is the slot's owner, version and lock: owner 0 free
/// ([`held_freed`]), else [`held_state`] (even) an event held by that
/// thread; odd: being written (by its thread) or taken (by user space).
/// Every transition is a compare-and-swap, so a release racing with a flush
/// is seen by exactly one, and every transition, freeing included, moves
/// the version on: a thread that read a state, was preempted and swaps it
/// later fails if the slot held anything else meanwhile (with a free state
/// of 0 every hold from free had the same state, and a late release by
/// another thread settled, and lost, the slot's next block).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldSlot {
    pub state: u64,
    /// The block this thread settled last, until the thread's next event:
    /// a second release of it at another probe is the same release.
    pub settled_addr: u64,
    /// Thread of `settled_addr` + 1 (0: none).
    pub settled_tid: u32,
    /// Spec that settled `settled_addr`.
    pub settled_spec: u16,
    pub _pad: u16,
    pub event: WireEvent,
}

/// The slot of thread `tid` in the held table.
#[inline(always)]
pub fn held_slot(tid: u32) -> u32 {
    let mixed = (u64::from(tid) ^ 0x5bd1_e995).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (mixed >> (64 - HELD_SLOTS.trailing_zeros())) as u32
}

/// The address-index entry of block `addr`.
#[inline(always)]
pub fn held_hint(addr: u64) -> u32 {
    let mixed = (addr >> 3).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (mixed >> (64 - HELD_HINTS.trailing_zeros())) as u32
}

/// [`HeldSlot::state`] of an event held by thread `tid`, version `version`.
#[inline(always)]
pub fn held_state(tid: u32, version: u32) -> u64 {
    ((u64::from(tid) + 1) << 32) | (u64::from(version) << 1 & 0xffff_fffe)
}

/// The thread (+ 1) a held state belongs to (0: free).
#[inline(always)]
pub fn held_owner(state: u64) -> u32 {
    (state >> 32) as u32
}

/// The version of a slot state.
#[inline(always)]
pub fn held_version(state: u64) -> u32 {
    (state as u32) >> 1
}

/// The free state that follows `state` (owner 0, the next version).
#[inline(always)]
pub fn held_freed(state: u64) -> u64 {
    u64::from(held_version(state).wrapping_add(1) << 1)
}

/// Kernel-side counters (a per-CPU array indexed by these values).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// `bpf_ringbuf_reserve` failed: the ring buffer was full and an event was lost.
    RingbufFull = 0,
    /// Stack capture failed: the walk faulted (`-EFAULT`).
    StackFault = 1,
    /// Stack capture failed: the stack-trace map bucket was taken by another stack (`-EEXIST`).
    StackCollision = 2,
    /// Stack capture failed: the stack-trace map was full (`-ENOMEM`), the
    /// walk was preempted by another on its CPU (`-EAGAIN`), or another error.
    StackOther = 3,
    /// The in-flight call table was full: a call could not be tracked and was lost.
    PendingFull = 4,
    /// A return arrived without its entry (attached mid-call): harmless, counted.
    UnpairedReturn = 5,
    /// An in-flight call record was found stale and replaced.
    StalePending = 6,
    /// Reading an out-parameter after a successful call failed: the block was lost.
    OutReadFailed = 7,
    /// Not bumped any more: the kernel kept a set of live anonymous
    /// mappings, matched by start address (a `munmap` of part of one went
    /// unseen); user space now keeps the ranges. The slot and its report key
    /// stay, at 0.
    MmapTableFull = 8,
    /// Calls skipped because they ran inside another traced call of the same family.
    Nested = 9,
    /// Events skipped by sampling or size filters in the kernel.
    Filtered = 10,
    /// A DWARF stack reached `--stack-depth` with frames left: truncated by depth.
    UnwindDepth = 11,
    /// A DWARF stack ended early: reading the target's stack faulted.
    UnwindReadFault = 12,
    /// A DWARF stack ended early: a PC had no CFI and frame pointers did not continue.
    UnwindNoTable = 13,
    /// A DWARF stack ended early: a CFI rule the unwinder cannot follow.
    UnwindBadRule = 14,
    /// A DWARF stack ended early: the object's table did not fit the table memory cap.
    UnwindTableCap = 15,
    /// A DWARF stack ended early: the process's executable mappings exceed the unwinder's view.
    UnwindNoMappings = 16,
    /// DWARF stacks written to the stack map for the first time.
    UnwindNewStack = 17,
    /// A CPython process's allocating thread had no thread state in the
    /// interpreter's list (not a Python thread, or a list longer than the walk).
    PyNoThreadState = 18,
    /// Reading the interpreter's memory faulted: the Python stack was lost.
    PyReadFault = 19,
    /// The Python stack was deeper than [`PY_MAX_DEPTH`]: its outer frames were cut.
    PyTruncated = 20,
    /// The Python stack map was full: an allocation got no Python stack.
    PyStackMapFull = 21,
    /// Two different Python stacks had the same hash: the later one got none.
    PyHashCollision = 22,
    /// An allocator call was kept in the in-flight hash map because its slot
    /// was taken: another thread's (hashed slots), or another family's call
    /// in the thread's own record, or the record could not be created (per-
    /// thread storage). Slower, nothing lost.
    InFlightSpilled = 23,
    /// Heap blocks released before their allocation left the kernel: the
    /// pair was settled there (counted in `allocs` and `frees`, never sent).
    SettledInKernel = 24,
    /// A release of a block settled in the kernel seen again at a second
    /// probe by the same thread (an `operator delete` ending in `free`).
    SettledSeenTwice = 25,
    /// DWARF stacks answered by replaying an earlier walk of this CPU: the
    /// same registers, mappings and stack words read, so the same stack.
    StacksReplayed = 26,
    /// A kernel without `bpf_loop` (the tail-call and compat objects): a
    /// stack walk or Python frame read could not run in its tail-called
    /// program (its pending table was full, or the tail call failed): the
    /// stack came from frame pointers, or the Python frames were left out.
    WalkNotStarted = 27,
    /// A DWARF stack ended early at an object whose table was still being
    /// prepared (attached by pid, tracing starts before every table is in).
    UnwindTablePending = 28,
}

/// Number of [`Counter`] slots.
pub const COUNTER_SLOTS: u32 = 32;

impl Counter {
    pub const ALL: [Counter; 29] = [
        Counter::RingbufFull,
        Counter::StackFault,
        Counter::StackCollision,
        Counter::StackOther,
        Counter::PendingFull,
        Counter::UnpairedReturn,
        Counter::StalePending,
        Counter::OutReadFailed,
        Counter::MmapTableFull,
        Counter::Nested,
        Counter::Filtered,
        Counter::UnwindDepth,
        Counter::UnwindReadFault,
        Counter::UnwindNoTable,
        Counter::UnwindBadRule,
        Counter::UnwindTableCap,
        Counter::UnwindNoMappings,
        Counter::UnwindNewStack,
        Counter::PyNoThreadState,
        Counter::PyReadFault,
        Counter::PyTruncated,
        Counter::PyStackMapFull,
        Counter::PyHashCollision,
        Counter::InFlightSpilled,
        Counter::SettledInKernel,
        Counter::SettledSeenTwice,
        Counter::StacksReplayed,
        Counter::WalkNotStarted,
        Counter::UnwindTablePending,
    ];
}

/// Most Python frames read per stack (outer frames beyond are cut and counted).
pub const PY_MAX_DEPTH: usize = 48;
/// Most thread states walked in an interpreter's thread list.
pub const PY_MAX_THREADS: u32 = 256;
/// An offset field of [`PyProc`] that does not apply to a version.
pub const PY_OFF_NONE: u16 = u16::MAX;

/// How to read one CPython process's frames (filled by the loader, keyed by
/// tgid, from the version's layout): where its thread states are and the
/// offsets of the fields the frame walk reads.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyProc {
    /// Address of `_PyRuntime.interpreters.head` (a `PyInterpreterState*`).
    pub interp_head_addr: u64,
    /// Offset of the thread pointer in the kernel's `task_struct`
    /// (`thread.fsbase` on x86-64, `thread.uw.tp_value` on arm64), from
    /// which the thread's `pthread_t` follows: thread states are matched by
    /// `thread_id`; 0: by `native_thread_id` instead.
    pub fsbase_off: u32,
    /// `PyThreadState.thread_id` (the creating thread's `pthread_self()`).
    pub tstate_pthread: u16,
    /// `PyInterpreterState.threads.head`.
    pub interp_threads_head: u16,
    /// `PyThreadState.next`.
    pub tstate_next: u16,
    /// `PyThreadState.native_thread_id` (the kernel's thread id, 3.11+), or
    /// [`PY_OFF_NONE`].
    pub tstate_native_tid: u16,
    /// `PyThreadState.cframe` (3.11, 3.12) or the frame pointer itself
    /// (`current_frame` 3.13+).
    pub tstate_frame: u16,
    /// `_PyCFrame.current_frame` when `tstate_frame` points to a `_PyCFrame`,
    /// else [`PY_OFF_NONE`].
    pub cframe_frame: u16,
    /// The frame's code object (`f_code`, 3.13 `f_executable`).
    pub frame_code: u16,
    /// The calling frame (`previous`).
    pub frame_previous: u16,
    /// The instruction pointer (`prev_instr`, 3.13 `instr_ptr`).
    pub frame_instr: u16,
    /// `owner`, or [`PY_OFF_NONE`].
    pub frame_owner: u16,
    /// Frames with this owner are C-stack shims without code (3.12+), or 0xff.
    pub owner_cstack: u8,
    pub _pad: [u8; 3],
    /// Bytes from `pthread_self()` up to the thread pointer: 0 on x86-64
    /// (the TCB is the `struct pthread`), `sizeof(struct pthread)` of the
    /// target's glibc on arm64 (the thread pointer follows it).
    pub tp_to_pthread: u32,
}

/// One Python frame as read in the kernel: the code object and the raw
/// instruction pointer of the frame (resolved to a line on the user side).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyFrameRaw {
    pub code: u64,
    pub instr: u64,
}

/// The FNV-1a seed of a Python stack's hash ([`py_hash_frame`]).
pub const PY_HASH_SEED: u64 = 0xcbf2_9ce4_8422_2325;

/// A Python stack's hash with one more frame: the kernel folds each frame
/// in as it reads it; user space folds a stored stack's frames again to
/// check that the map entry is the stack its key names.
#[inline(always)]
pub fn py_hash_frame(hash: u64, code: u64, instr: u64) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let hash = (hash ^ code).wrapping_mul(PRIME);
    (hash ^ instr).wrapping_mul(PRIME)
}

/// The `PY_STACKS` key of a stack with this hash and frame count (never 0,
/// which means "no Python stack").
#[inline(always)]
pub fn py_stack_key(hash: u64, len: u32) -> u32 {
    let id = ((hash >> 32) ^ hash) as u32 ^ len;
    if id == 0 {
        1
    } else {
        id
    }
}

impl PyStack {
    /// Whether this entry is the stack `key` names: its frames fold to its
    /// hash and its hash and length to the key. A stored entry fails when
    /// another read on its CPU overwrote the scratch copy it was stored
    /// from (user space then drops it rather than show foreign frames).
    pub fn matches_key(&self, key: u32) -> bool {
        let len = self.len as usize;
        let Some(frames) = self.frames.get(..len) else {
            return false;
        };
        let hash = frames
            .iter()
            .fold(PY_HASH_SEED, |h, f| py_hash_frame(h, f.code, f.instr));
        hash == self.hash && py_stack_key(hash, self.len) == key
    }
}

/// A Python stack in the `PY_STACKS` map, innermost frame first.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PyStack {
    pub frames: [PyFrameRaw; PY_MAX_DEPTH],
    pub len: u32,
    /// 1: the stack was deeper than [`PY_MAX_DEPTH`].
    pub truncated: u32,
    /// The 64-bit hash of the first `len` frames (frames past `len` are
    /// stale): tells two stacks apart whose 32-bit keys collide.
    pub hash: u64,
}

/// Error for an integer that names no variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnknownDiscriminant(pub u32);

macro_rules! try_from_u8 {
    ($ty:ident { $($variant:ident),+ $(,)? }) => {
        impl TryFrom<u8> for $ty {
            type Error = UnknownDiscriminant;
            fn try_from(value: u8) -> Result<Self, Self::Error> {
                $(if value == $ty::$variant as u8 { return Ok($ty::$variant); })+
                Err(UnknownDiscriminant(u32::from(value)))
            }
        }
    };
}

try_from_u8!(EventKind {
    Alloc,
    Free,
    Realloc,
    Failed,
    Fork,
    MapsStale,
    Unmap,
    Exec
});
try_from_u8!(SpecKind {
    Alloc,
    Free,
    Realloc
});
try_from_u8!(RetKind {
    Pointer,
    Status,
    MmapPointer,
    Void,
    NonNegative
});
try_from_u8!(SpecQuirk {
    None,
    AnonMmap,
    Munmap,
    SizeOutParam,
    Malloc3D,
    Handle32,
    ResizeInPlace
});

const _: () = assert!(core::mem::size_of::<WireEvent>() == 56);
const _: () = assert!(core::mem::size_of::<PyProc>() == 40);
const _: () = assert!(core::mem::size_of::<PyStack>() == PY_MAX_DEPTH * 16 + 16);
const _: () = assert!(core::mem::size_of::<ArgLoc>() == 16);
const _: () = assert!(core::mem::size_of::<ProbeSpec>() == 88);
const _: () = assert!(core::mem::size_of::<PendingKey>() == 16);
const _: () = assert!(core::mem::size_of::<PendingCall>() == 56);
const _: () = assert!(core::mem::size_of::<HeldSlot>() == 80);
const _: () = assert!(core::mem::size_of::<ThreadCalls>() == 40 + 8 * 56);

#[cfg(feature = "user")]
mod user {
    // SAFETY: these types are `#[repr(C)]`, made only of integers with explicit
    // padding fields, so every bit pattern is valid and there is no uninit padding.
    unsafe impl aya::Pod for super::ProbeSpec {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::WireEvent {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::PendingKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::PendingCall {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::PyProc {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::PyStack {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::HeldSlot {}
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_python_stack_matches_only_the_key_of_its_own_frames() {
        let mut stack = PyStack {
            frames: [PyFrameRaw { code: 0, instr: 0 }; PY_MAX_DEPTH],
            len: 3,
            truncated: 0,
            hash: PY_HASH_SEED,
        };
        for (i, frame) in stack.frames.iter_mut().take(3).enumerate() {
            let i = i as u64;
            *frame = PyFrameRaw {
                code: 0x7f00_0000 + i * 0x40,
                instr: 0x7f10_0000 + i,
            };
            stack.hash = py_hash_frame(stack.hash, frame.code, frame.instr);
        }
        let key = py_stack_key(stack.hash, stack.len);
        assert_ne!(key, 0);
        assert!(stack.matches_key(key));
        assert!(!stack.matches_key(key ^ 1), "another key");
        // Frames past `len` are stale and do not count.
        stack.frames[5].code = 99;
        assert!(stack.matches_key(key));
        let mut overwritten = stack;
        overwritten.frames[1].instr += 1;
        assert!(!overwritten.matches_key(key), "a frame not of this stack");
        let mut shorter = stack;
        shorter.len = 2;
        assert!(!shorter.matches_key(key));
        shorter.len = PY_MAX_DEPTH as u32 + 1;
        assert!(!shorter.matches_key(key), "a length past the frames");
        assert_eq!(py_stack_key(0, 0), 1, "0 means no stack");
    }
    use super::*;

    #[test]
    fn discriminants_round_trip() {
        for kind in [
            EventKind::Alloc,
            EventKind::Free,
            EventKind::Realloc,
            EventKind::Failed,
            EventKind::Fork,
            EventKind::MapsStale,
            EventKind::Unmap,
            EventKind::Exec,
        ] {
            assert_eq!(EventKind::try_from(kind as u8), Ok(kind));
        }
        assert_eq!(EventKind::try_from(9), Err(UnknownDiscriminant(9)));
        assert_eq!(RetKind::try_from(3), Ok(RetKind::Void));
        assert!(SpecQuirk::try_from(200).is_err());
    }
}
