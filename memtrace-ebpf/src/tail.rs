//! Stack walks and Python frame reads on kernels without `bpf_loop`
//! (5.10-5.16: the `tailcall` and `compat` objects), split across tail
//! calls, as the OpenTelemetry eBPF profiler and parca-agent unwind on
//! 5.4+.
//!
//! The probe that finishes an allocation event parks it in `TAIL_PENDING`
//! under its thread and tail-calls `tail_walk`, which sets up the walk
//! (or answers it from a replayed one), walks [`FRAMES_PER_CALL`] frames
//! with the same frame step as the `bpf_loop` object and tail-calls
//! itself until the walk ends; then `tail_python` reads the thread's Python
//! frames when its process has a reader; the last program sends the event.
//! The walk's state is per CPU (`unwind::WALK_STATE`) and carries the same
//! per-CPU sequence checks against a walk that preempted it; the event is
//! per thread, so a preempted pipeline still sends its own event.
//!
//! A tail call that fails (the pending table full, a program missing, the
//! kernel's tail-call limit) is counted (`walk_not_started`) and the event
//! is sent all the same: with a frame-pointer stack, or without Python
//! frames. Tail-called programs run with the probe's registers (the same
//! context), so the frame-pointer fallback can be taken at any stage.
//!
//! Every function here is inlined: a program that tail-calls may hold no
//! BPF-to-BPF calls on arm64 kernels before 6.0.

use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid,
    macros::{map, uprobe},
    maps::{HashMap, ProgramArray},
    programs::ProbeContext,
    EbpfContext,
};
use memtrace_common::{unwind::STACK_MODE_DWARF, Counter, WireEvent};

use crate::{bump, python, unwind};

/// The tail-called programs, filled by the loader: [`WALK`], [`PYTHON`].
#[map]
static TAIL_PROGS: ProgramArray = ProgramArray::with_max_entries(2, 0);

const WALK: u32 = 0;
const PYTHON: u32 = 1;

/// Frames one run of `tail_walk` walks: 127 frames (`--stack-depth`'s
/// most) take 22 runs, under the kernel's tail calls per probe with the
/// Python read's (checked where the constant is defined).
const FRAMES_PER_CALL: u32 = memtrace_common::unwind::FRAMES_PER_TAIL_CALL;

/// An event on its way through the tail-called programs.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Pending {
    event: WireEvent,
    /// This CPU's walk count when the walk began.
    started: u64,
    /// Of a heap allocator (see `held`).
    heap: u32,
    /// The Python frames are to be read.
    python: u32,
    /// A return probe's event (see `UserStack::AT_RETURN`).
    at_return: u32,
    /// The walk has begun (`started` is set).
    begun: u32,
}

/// Events in flight through the tail-called programs, by thread id: one
/// per thread at a time, so a pipeline preempted by another on its CPU
/// keeps its own.
#[map]
static TAIL_PENDING: HashMap<u32, Pending> = HashMap::with_max_entries(4096, 0);

/// Runs the walk and the Python read of `event` in the tail-called
/// programs, which send it. Returns only when neither is needed (frame
/// pointers or no stacks, no Python reader) or they could not start
/// (counted): the caller then sends the event itself.
#[inline(always)]
pub fn start<C: EbpfContext>(ctx: &C, event: &WireEvent, heap: bool, at_return: bool) {
    let walk = crate::STACK_MODE.load() == STACK_MODE_DWARF;
    let python = python::wanted(bpf_get_current_pid_tgid());
    if !walk && !python {
        return;
    }
    let pending = Pending {
        event: *event,
        started: 0,
        heap: u32::from(heap),
        python: u32::from(python),
        at_return: u32::from(at_return),
        begun: 0,
    };
    if TAIL_PENDING.insert(&event.tid, &pending, 0).is_err() {
        bump(Counter::WalkNotStarted);
        return;
    }
    let next = if walk { WALK } else { PYTHON };
    // SAFETY: a tail call either runs `next` in place of this program or
    // fails and returns; the context is the probe's own.
    let _ = unsafe { TAIL_PROGS.tail_call(ctx, next) };
    // Not started: the probe sends the event itself.
    let _ = TAIL_PENDING.remove(&event.tid);
    bump(Counter::WalkNotStarted);
}

/// Walks [`FRAMES_PER_CALL`] frames of the parked event's stack, then
/// itself again, or the Python read, or sends the event.
#[uprobe]
pub fn tail_walk(ctx: ProbeContext) -> u32 {
    crate::no_private_stack(&ctx);
    let tid = bpf_get_current_pid_tgid() as u32;
    let Some(pending) = TAIL_PENDING.get_ptr_mut(&tid) else {
        return 0;
    };
    // SAFETY: this thread's own entry; only this thread's programs use it,
    // one at a time.
    let pending = unsafe { &mut *pending };
    if pending.begun == 0 {
        pending.begun = 1;
        match unwind::begin_tail_walk(&ctx, pending.at_return != 0) {
            Ok(started) => pending.started = started,
            Err(key) => {
                pending.event.stack_id = key;
                return after_walk(&ctx, tid, pending);
            }
        }
    }
    if !unwind::walk_frames(FRAMES_PER_CALL) {
        // SAFETY: as in `start`.
        let _ = unsafe { TAIL_PROGS.tail_call(&ctx, WALK) };
        // The tail-call limit: the walk ends here, its stack cut (counted
        // as cut by depth when it finishes).
        bump(Counter::WalkNotStarted);
    }
    let key = unwind::finish_walk(pending.started);
    if key == -unwind::EAGAIN {
        // Another walk took this CPU's state meanwhile: frame pointers.
        bump(Counter::StackOther);
        pending.event.stack_id = crate::user_stack_id(&ctx);
    } else {
        pending.event.stack_id = key;
    }
    after_walk(&ctx, tid, pending)
}

/// Reads the parked event's Python frames and sends it.
#[uprobe]
pub fn tail_python(ctx: ProbeContext) -> u32 {
    crate::no_private_stack(&ctx);
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    let Some(pending) = TAIL_PENDING.get_ptr_mut(&tid) else {
        return 0;
    };
    // SAFETY: as in `tail_walk`.
    let pending = unsafe { &mut *pending };
    pending.event.py_stack = python::read_stack_id(pid_tgid);
    send(tid, pending)
}

/// After the walk: the Python read, or the event sent.
#[inline(always)]
fn after_walk(ctx: &ProbeContext, tid: u32, pending: &mut Pending) -> u32 {
    if pending.python != 0 {
        // SAFETY: as in `start`.
        let _ = unsafe { TAIL_PROGS.tail_call(ctx, PYTHON) };
        bump(Counter::WalkNotStarted);
    }
    send(tid, pending)
}

/// Sends the parked event and forgets it.
#[inline(always)]
fn send(tid: u32, pending: &mut Pending) -> u32 {
    let (event, heap) = (pending.event, pending.heap != 0);
    let _ = TAIL_PENDING.remove(&tid);
    crate::send(event, heap);
    0
}
