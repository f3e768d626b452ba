//! The CPython frame reader: the allocating thread's Python call path, read
//! in the kernel at the allocation, kept apart from the native stack.
//!
//! The loader puts a [`PyProc`] in `PY_PROCS` for every traced process it
//! found to be a CPython 3.8+ interpreter. Here the thread's `PyThreadState`
//! is found by walking the main interpreter's thread list
//! (`_PyRuntime.interpreters.head`, its thread-list head, then `next`) for
//! the state whose `thread_id` is the current thread's `pthread_t` - its
//! `fs` base, read from `task_struct.thread.fsbase` at the offset the loader
//! took from the kernel's BTF (every version, any pid namespace) - or, when
//! that offset is unknown, whose `native_thread_id` is the kernel thread id
//! (3.11+). Both fields are written once by the thread itself and the list
//! holds every thread state whether or not it holds the GIL, so this is right
//! for a thread that released the GIL inside a C extension too (the
//! GIL-holder pointer is not). The state found is cached per thread in
//! `PY_TSTATES` and re-checked at each use, so a freed and reused state is
//! never trusted. From the state, the frame chain (`frame` before 3.11,
//! `cframe->current_frame` on 3.11/3.12, `current_frame` on 3.13) is walked
//! through `f_back`/`previous` with `bpf_loop` for at most [`PY_MAX_DEPTH`]
//! frames, skipping the C-stack shim frames of 3.12+. Each frame is (code
//! object, raw instruction field: `f_lasti` or an instruction pointer),
//! resolved to names and lines on the user side when the stack is first seen.
//!
//! Stacks are deduplicated by a hash of their frames: `PY_STACKS` keeps the
//! first stack with each hash and the event carries the hash. Every failure
//! is counted by cause.

use aya_ebpf::{
    cty::c_void,
    helpers::{bpf_get_current_task, bpf_probe_read_kernel, bpf_probe_read_user},
    macros::map,
    maps::{HashMap, LruHashMap, PerCpuArray},
};
use memtrace_common::{
    py_hash_frame, py_stack_key, Counter, PyProc, PyStack, PY_HASH_SEED, PY_MAX_DEPTH,
    PY_MAX_THREADS, PY_OFF_NONE,
};

/// Per-process reading recipe, by tgid; filled by the loader.
#[map]
static PY_PROCS: HashMap<u32, PyProc> = HashMap::with_max_entries(1024, 0);
/// Python stacks by hash (first writer wins); read by the user side.
#[map]
static PY_STACKS: HashMap<u32, PyStack> = HashMap::with_max_entries(16384, 0);
/// Thread state of each thread (pid_tgid) found before.
#[map]
static PY_TSTATES: LruHashMap<u64, u64> = LruHashMap::with_max_entries(16384, 0);
/// Scratch space for the stack being read (too large for the BPF stack).
#[map]
static PY_SCRATCH: PerCpuArray<PyStack> = PerCpuArray::with_max_entries(1, 0);
/// The thread-list walk's state, per CPU (kept off the BPF stack: see
/// `WALK_STATE` in `unwind`). Only the return probe reads Python stacks.
#[map]
static PY_THREAD_WALK: PerCpuArray<ThreadWalk> = PerCpuArray::with_max_entries(1, 0);
/// The frame walk's state, per CPU.
#[map]
static PY_FRAME_WALK: PerCpuArray<FrameWalk> = PerCpuArray::with_max_entries(1, 0);
/// Python stacks read on this CPU: a read that sees the count changed before
/// it stores its stack was preempted by another on its CPU (whose walk state
/// and scratch stack it shares) and is counted as failed (`py_read_fault`),
/// never stored; one that sees it changed after storing takes the entry back.
#[map]
static PY_READS: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

const BPF_NOEXIST: u64 = 1;
const EEXIST: i32 = 17;

#[inline(always)]
fn read_u64(addr: u64) -> Result<u64, ()> {
    // SAFETY: bpf_probe_read_user validates the user address and fails cleanly.
    unsafe { bpf_probe_read_user(addr as *const u64) }.map_err(|_| ())
}

/// State of the thread-list walk (a `bpf_loop` callback context).
#[repr(C)]
pub struct ThreadWalk {
    tstate: u64,
    tid: u64,
    found: u64,
    native: u64,
    next: u64,
    /// 0, or the failure (`Counter` + 1).
    error: u32,
    _pad: u32,
}

/// One step of the thread-list walk: 1 stops the loop.
#[inline(always)]
extern "C" fn thread_step(_index: u64, _ctx: *mut c_void) -> i64 {
    let Some(walk) = PY_THREAD_WALK.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's own element, set by `thread_state` before the loop.
    let walk = unsafe { &mut *walk };
    if walk.tstate == 0 {
        return 1;
    }
    match read_u64(walk.tstate + walk.native) {
        Ok(tid) if tid == walk.tid => {
            walk.found = walk.tstate;
            return 1;
        }
        Ok(_) => {}
        Err(()) => {
            walk.error = Counter::PyReadFault as u32 + 1;
            return 1;
        }
    }
    match read_u64(walk.tstate + walk.next) {
        Ok(next) => {
            walk.tstate = next;
            0
        }
        Err(()) => {
            walk.error = Counter::PyReadFault as u32 + 1;
            1
        }
    }
}

/// The current thread's `PyThreadState*`, or why there is none.
#[inline(always)]
fn thread_state(pid_tgid: u64, proc: &PyProc) -> Result<u64, Counter> {
    // The thread's pthread_t (its fs base) where the kernel's offset of it
    // is known, else its kernel thread id.
    let (tid, native) = if proc.fsbase_off != 0 {
        // SAFETY: the helper has no preconditions; the task pointer is only
        // read through bpf_probe_read_kernel, which checks it.
        let task = unsafe { bpf_get_current_task() };
        // SAFETY: as above.
        let fsbase =
            unsafe { bpf_probe_read_kernel((task + u64::from(proc.fsbase_off)) as *const u64) }
                .map_err(|_| Counter::PyReadFault)?;
        (
            fsbase.wrapping_sub(u64::from(proc.tp_to_pthread)),
            u64::from(proc.tstate_pthread),
        )
    } else {
        (pid_tgid & 0xffff_ffff, u64::from(proc.tstate_native_tid))
    };
    // SAFETY: the value is copied out at once.
    if let Some(&cached) = unsafe { PY_TSTATES.get(&pid_tgid) } {
        if read_u64(cached + native) == Ok(tid) {
            return Ok(cached);
        }
    }
    let interp = read_u64(proc.interp_head_addr).map_err(|_| Counter::PyReadFault)?;
    if interp == 0 {
        return Err(Counter::PyNoThreadState);
    }
    let head =
        read_u64(interp + u64::from(proc.interp_threads_head)).map_err(|_| Counter::PyReadFault)?;
    let walk = PY_THREAD_WALK.get_ptr_mut(0).ok_or(Counter::PyReadFault)?;
    // SAFETY: this CPU's own element; the loop below is synchronous.
    unsafe {
        *walk = ThreadWalk {
            tstate: head,
            tid,
            found: 0,
            native,
            next: u64::from(proc.tstate_next),
            error: 0,
            _pad: 0,
        };
    }
    crate::unwind::run_loop::<PY_MAX_THREADS>(PY_MAX_THREADS, thread_step);
    // SAFETY: as above.
    let (error, found) = unsafe { ((*walk).error, (*walk).found) };
    if error != 0 {
        return Err(Counter::PyReadFault);
    }
    if found == 0 {
        return Err(Counter::PyNoThreadState);
    }
    let _ = PY_TSTATES.insert(&pid_tgid, &found, 0);
    Ok(found)
}

/// Whether Python stacks are read at all (some traced process has a
/// reader, and stacks are asked for).
#[inline(always)]
fn readers() -> bool {
    crate::STACK_MODE.load() != memtrace_common::unwind::STACK_MODE_NONE
        && crate::CONTROL.get(1).is_some_and(|&readers| readers != 0)
}

#[cfg(not(feature = "tailcall"))]
/// The Python stack of the current thread, stored in `PY_STACKS`: its key,
/// or 0 (not a traced Python process, or the stack could not be read; the
/// cause is counted).
#[inline(always)]
pub fn python_stack_id(pid_tgid: u64) -> u32 {
    if !readers() {
        return 0;
    }
    memtrace_python_stack(pid_tgid)
}

/// Whether the current thread's Python stack is to be read: its process
/// has a reader (the tail-calling objects read it in a program of its own).
#[cfg(feature = "tailcall")]
#[inline(always)]
pub fn wanted(pid_tgid: u64) -> bool {
    let tgid = (pid_tgid >> 32) as u32;
    readers() && PY_PROCS.get_ptr(&tgid).is_some()
}

#[cfg(not(feature = "tailcall"))]
/// [`read_stack_id`], as a global BPF function: the verifier checks it
/// once, apart from every path of the return probe that reaches it, and its
/// frame holds nothing but spills (its state is per CPU).
#[no_mangle]
#[inline(never)]
pub extern "C" fn memtrace_python_stack(pid_tgid: u64) -> u32 {
    read_stack_id(pid_tgid)
}

/// The current thread's Python stack, stored in `PY_STACKS`: its key, or
/// 0 (not a traced Python process, or the stack could not be read; the cause
/// is counted).
#[inline(always)]
pub fn read_stack_id(pid_tgid: u64) -> u32 {
    let tgid = (pid_tgid >> 32) as u32;
    // SAFETY: the value is only read, while the map holds it.
    let Some(proc) = (unsafe { PY_PROCS.get(&tgid) }) else {
        return 0;
    };
    let started = bump_reads();
    match read_stack(pid_tgid, proc, started) {
        Ok(id) => id,
        Err(counter) => {
            crate::bump(counter);
            0
        }
    }
}

/// Counts a Python stack read started on this CPU; returns the new count.
#[inline(always)]
fn bump_reads() -> u64 {
    crate::unwind::bump_cpu_sequence(&PY_READS)
}

/// The Python stack reads started on this CPU so far.
#[inline(always)]
fn reads() -> u64 {
    crate::unwind::cpu_sequence(&PY_READS)
}

/// State of the frame walk (a `bpf_loop` callback context).
#[repr(C)]
pub struct FrameWalk {
    frame: u64,
    hash: u64,
    len: u64,
    code_off: u64,
    previous_off: u64,
    instr_off: u64,
    owner_off: u64,
    owner_cstack: u64,
    error: u32,
    _pad: u32,
}

/// One step of the frame walk: reads one frame into the scratch stack; 1
/// stops the loop (end of the chain, full, or a fault).
#[inline(always)]
extern "C" fn frame_step(_index: u64, _ctx: *mut c_void) -> i64 {
    let Some(walk) = PY_FRAME_WALK.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's own element, set by `read_stack` before the loop.
    let walk = unsafe { &mut *walk };
    if walk.frame == 0 {
        return 1;
    }
    let frame = walk.frame;
    let Ok(previous) = read_u64(frame + walk.previous_off) else {
        walk.error = Counter::PyReadFault as u32 + 1;
        return 1;
    };
    if walk.owner_off != PY_OFF_NONE as u64 {
        // SAFETY: as in read_u64.
        match unsafe { bpf_probe_read_user((frame + walk.owner_off) as *const u8) } {
            Ok(owner) if u64::from(owner) == walk.owner_cstack => {
                walk.frame = previous;
                return 0;
            }
            Ok(_) => {}
            Err(_) => {
                walk.error = Counter::PyReadFault as u32 + 1;
                return 1;
            }
        }
    }
    let Some(scratch) = PY_SCRATCH.get_ptr_mut(0) else {
        walk.error = Counter::PyStackMapFull as u32 + 1;
        return 1;
    };
    // SAFETY: this CPU's own scratch slot; preemption is off while the
    // program runs.
    let stack = unsafe { &mut *scratch };
    let Some(slot) = stack.frames.get_mut(walk.len as usize) else {
        // Full: `frame` stays non-zero, so the stack is marked cut.
        return 1;
    };
    let (Ok(code), Ok(instr)) = (
        read_u64(frame + walk.code_off),
        read_u64(frame + walk.instr_off),
    ) else {
        walk.error = Counter::PyReadFault as u32 + 1;
        return 1;
    };
    slot.code = code;
    slot.instr = instr;
    walk.hash = py_hash_frame(walk.hash, code, instr);
    walk.len += 1;
    walk.frame = previous;
    0
}

#[inline(always)]
fn read_stack(pid_tgid: u64, proc: &PyProc, started: u64) -> Result<u32, Counter> {
    let tstate = thread_state(pid_tgid, proc)?;
    let mut frame =
        read_u64(tstate + u64::from(proc.tstate_frame)).map_err(|_| Counter::PyReadFault)?;
    if proc.cframe_frame != PY_OFF_NONE && frame != 0 {
        frame = read_u64(frame + u64::from(proc.cframe_frame)).map_err(|_| Counter::PyReadFault)?;
    }
    let walk = PY_FRAME_WALK.get_ptr_mut(0).ok_or(Counter::PyReadFault)?;
    // SAFETY: this CPU's own element; the loop below is synchronous.
    let walk = unsafe { &mut *walk };
    *walk = FrameWalk {
        frame,
        hash: PY_HASH_SEED,
        len: 0,
        code_off: u64::from(proc.frame_code),
        previous_off: u64::from(proc.frame_previous),
        instr_off: u64::from(proc.frame_instr),
        owner_off: u64::from(proc.frame_owner),
        owner_cstack: u64::from(proc.owner_cstack),
        error: 0,
        _pad: 0,
    };
    // Shim frames take loop rounds too, hence the margin over PY_MAX_DEPTH.
    crate::unwind::run_loop::<{ (PY_MAX_DEPTH * 2) as u32 }>((PY_MAX_DEPTH * 2) as u32, frame_step);
    if walk.error != 0 {
        return Err(if walk.error == Counter::PyStackMapFull as u32 + 1 {
            Counter::PyStackMapFull
        } else {
            Counter::PyReadFault
        });
    }
    let len = walk.len as usize;
    if len == 0 {
        return Err(Counter::PyNoThreadState);
    }
    let scratch = PY_SCRATCH.get_ptr_mut(0).ok_or(Counter::PyStackMapFull)?;
    // SAFETY: this CPU's own scratch slot, as above.
    let stack = unsafe { &mut *scratch };
    // Frames left unread: the stack was cut.
    stack.truncated = u32::from(walk.frame != 0);
    if walk.frame != 0 {
        crate::bump(Counter::PyTruncated);
    }
    stack.len = len as u32;
    // Frames past `len` are left as they are: user space reads `len`
    // frames, and equal stacks are told apart by their full hash (unrolled
    // loops over every frame cost the verifier more than the rest of the
    // reader).
    let hash = walk.hash;
    stack.hash = hash;
    let id = py_stack_key(hash, len as u32);
    // A read on this CPU that ran since this one began (this one was
    // preempted) rewrote the walk state and the scratch stack: nothing of
    // them may be stored or trusted.
    if reads() != started {
        return Err(Counter::PyReadFault);
    }
    // SAFETY: the stored stack is only compared, while the map keeps it.
    if let Some(stored) = unsafe { PY_STACKS.get(&id) } {
        return if stored.hash == hash && stored.len == len as u32 {
            Ok(id)
        } else {
            Err(Counter::PyHashCollision)
        };
    }
    match PY_STACKS.insert(&id, stack, BPF_NOEXIST) {
        Ok(()) => {
            // Preempted between the check above and the copy: what was
            // stored may hold the preempting read's frames under this
            // stack's key, and first writer wins. Taken back.
            if reads() != started {
                let _ = PY_STACKS.remove(&id);
                return Err(Counter::PyReadFault);
            }
            Ok(id)
        }
        // Another CPU stored it just now; user space checks every stored
        // stack against its key before it uses it.
        Err(err) if err == -EEXIST => Ok(id),
        Err(_) => Err(Counter::PyStackMapFull),
    }
}
