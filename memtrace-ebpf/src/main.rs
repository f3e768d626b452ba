//! memtrace's eBPF programs.
//!
//! Two generic programs serve every probed function: `call_enter` (a uprobe)
//! and `call_exit` (a uretprobe). The loader attaches them once per function
//! and library with an attach cookie naming a [`ProbeSpec`] in the `SPECS`
//! map; the spec says which argument is the size, the pointer to release or
//! the `void**` out-parameter, and how the function reports success. This one
//! data-driven path serves libc's allocators, the CUDA runtime and driver,
//! Ascend ACL and user-declared resource pairs alike.
//!
//! Per thread, `call_enter` saves the arguments of an allocating call keyed by
//! (thread, allocator family) together with the stack pointer; `call_exit`
//! recognises the matching return by `sp == entry_sp + 8`, checks success and
//! emits one [`WireEvent`] through the `EVENTS` ring buffer with a stack id from
//! the `STACKS` map. Calls made inside an in-flight call of the same family (or
//! of its parent family) are nested implementation details and are skipped, so
//! nothing is counted twice. Every loss is counted in `COUNTERS`.
//!
//! On kernels without `bpf_loop` (the `tailcall` and `compat` objects) the
//! DWARF walk and the Python frame read of an allocation run in programs
//! of their own, `tail_walk` and `tail_python`, reached by tail calls from
//! the probe (see `tail`).
//!
//! With `--follow-forks` a third program, `task_new` (a raw tracepoint on
//! `task_newtask`, which runs in the forking task), reports each new process
//! (not thread) of a traced process (`TRACED`) with a `Fork` event, waking the
//! reader at once so it can attach the child's probes quickly.
//!
//! A fourth, `task_exec` (a raw tracepoint on `sched_process_exec`, in the
//! task that ran exec), reports an exec of a traced process with an `Exec`
//! event, after sending what the exec'ing thread and the leader held:
//! every event of the old image is then before it in the ring.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![allow(internal_features)]
// The `compat` object leaves out what needs `bpf_loop`, cookies or
// compare-and-swap: the helpers only they use are dead there.
#![cfg_attr(feature = "compat", allow(dead_code, unused_imports))]

mod arch;
#[cfg(feature = "compat")]
mod compat;
#[cfg(not(feature = "compat"))]
mod held;
mod in_flight;
mod python;
#[cfg(feature = "tailcall")]
mod tail;
#[cfg(not(feature = "compat"))]
mod task_storage;
mod usdt;

/// Without compare-and-swap (the `compat` object) no heap block is held in
/// the kernel: every allocation and release is sent.
#[cfg(feature = "compat")]
mod held {
    use memtrace_common::WireEvent;

    #[inline(always)]
    pub fn hold(_event: &WireEvent) -> bool {
        false
    }

    #[inline(always)]
    pub fn settle(_pid_tgid: u64, _ptr: u64, _spec: u16, _release: bool) -> bool {
        false
    }

    #[inline(always)]
    pub fn forget_settled(_tid: u32) {}

    #[inline(always)]
    pub fn send(_tid: u32) {}
}

use aya_ebpf::{
    bindings::BPF_F_USER_STACK,
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user},
    macros::{map, raw_tracepoint, uprobe, uretprobe},
    maps::{Array, HashMap, PerCpuArray, ProgramArray, RingBuf, StackTrace},
    programs::{ProbeContext, RawTracePointContext, RetProbeContext},
    EbpfContext, Global,
};
use aya_log_ebpf::debug;
mod unwind;

use memtrace_common::{
    unwind::{STACK_MODE_DWARF, STACK_MODE_FP},
    Counter, EventKind, PendingCall, ProbeSpec, RetKind, SpecKind, SpecQuirk, WireEvent, ARG_NONE,
    COUNTER_SLOTS, MAX_SPECS, STACK_NONE,
};

/// How stacks are captured: `STACK_MODE_NONE` (`--stack-depth 0`),
/// `STACK_MODE_FP` (`--stacks fp`) or `STACK_MODE_DWARF` (the default).
#[no_mangle]
static STACK_MODE: Global<u32> = Global::new(STACK_MODE_DWARF);
/// Trace one address in this many (`--sample-rate`); 1 traces everything.
#[no_mangle]
static SAMPLE_RATE: Global<u32> = Global::new(1);
/// Allocations smaller than this are not reported (`--min-size`).
#[no_mangle]
static MIN_SIZE: Global<u64> = Global::new(0);
/// Allocations larger than this are not reported (`--max-size`).
#[no_mangle]
static MAX_SIZE: Global<u64> = Global::new(u64::MAX);
/// 1: every program returns at once (the empty-probe floor of `cargo xtask bench`).
#[no_mangle]
static NULL_MODE: Global<u32> = Global::new(0);
/// Wake the reader only once this many bytes wait in the ring buffer (0: every event).
#[no_mangle]
static WAKEUP_BYTES: Global<u64> = Global::new(0);

const MAP_ANONYMOUS: u64 = 0x20;
const EFAULT: i32 = 14;
const EEXIST: i32 = 17;
const BPF_RB_NO_WAKEUP: u64 = 1;
const BPF_RB_FORCE_WAKEUP: u64 = 2;
const BPF_RB_AVAIL_DATA: u64 = 0;
/// `clone` flag of a new thread (same process), from `linux/sched.h`.
const CLONE_THREAD: u64 = 0x0001_0000;

#[map]
static EVENTS: RingBuf = RingBuf::with_byte_size(8 << 20, 0);
#[map]
static STACKS: StackTrace = StackTrace::with_max_entries(16384, 0);
#[map]
static SPECS: Array<ProbeSpec> = Array::with_max_entries(MAX_SPECS, 0);
/// Processes whose forks and execs are reported, by tgid; filled by the
/// loader.
#[map]
static TRACED: HashMap<u32, u8> = HashMap::with_max_entries(1024, 0);
#[map]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);
/// Flags set by user space; index 0: 1 once the trace is ending (its entry
/// probes are being detached, so returns without an entry are expected);
/// index 1: how many processes have a Python frame reader (0: skip it);
/// index 2: 1 while heap allocations may be held (`held`); index 3: 1 once
/// the trace's window has closed: no allocation is recorded any more (only
/// releases of blocks made before, for the short grace user space gives
/// them), so the report describes the state at that moment however long
/// detaching takes.
#[map]
static CONTROL: Array<u32> = Array::with_max_entries(4, 0);

/// Index in `CONTROL` of the closed-window flag.
const CONTROL_CLOSED: u32 = 3;

/// Whether the trace's window has closed (see `CONTROL`).
#[inline(always)]
fn window_closed() -> bool {
    CONTROL.get(CONTROL_CLOSED).is_some_and(|&flag| flag != 0)
}

/// A `NULL_MODE` value the loader never sets (see [`no_private_stack`]).
const NULL_MODE_NEVER: u32 = u32::MAX;

/// Never filled: the target of [`no_private_stack`]'s tail call.
#[map]
static NO_PRIVATE_STACK: ProgramArray = ProgramArray::with_max_entries(1, 0);

/// Keeps the kernel from running this program on a private stack.
///
/// Since 6.13 an x86-64 kernel may give each BPF function with 64 B or more
/// of stack a private stack: one per CPU, not per task. A uprobe's program
/// is preemptible (it runs under `migrate_disable` only, and 7.x kernels
/// with `PREEMPT(lazy)` do preempt it), so a run preempted on its CPU and
/// another run of the same program there share that stack, and the second
/// overwrites the first's locals: on 7.3 an allocation event came out with
/// another thread's fields and the first thread's event was lost. The
/// verifier gives no private stack to a program that holds a tail call, so
/// each uprobe program holds one, behind a mode the loader never sets: the
/// verifier sees it, it never runs. Every call chain fits the shared
/// 512-byte stack without private stacks by design (`memtrace doctor`).
#[inline(always)]
fn no_private_stack<C: EbpfContext>(ctx: &C) {
    if NULL_MODE.load() == NULL_MODE_NEVER {
        // SAFETY: the program array is empty, so the tail call fails and
        // returns; nothing else happens.
        unsafe { NO_PRIVATE_STACK.tail_call(ctx, 0) };
    }
}

/// Entry of every probed function.
#[uprobe]
pub fn call_enter(ctx: ProbeContext) -> u32 {
    no_private_stack(&ctx);
    if NULL_MODE.load() == 0 {
        on_enter(&ctx);
    }
    0
}

/// Every USDT probe (a uprobe at an `sdt.h` probe site, see `usdt`).
#[uprobe]
pub fn usdt_fire(ctx: ProbeContext) -> u32 {
    no_private_stack(&ctx);
    if NULL_MODE.load() == 0 {
        usdt::on_fire(&ctx);
    }
    0
}

/// Return of every probed function that has a result to check.
#[uretprobe]
pub fn call_exit(ctx: RetProbeContext) -> u32 {
    no_private_stack(&ctx);
    if NULL_MODE.load() == 0 {
        on_exit(&ctx);
    }
    0
}

/// A task was created (`task_newtask(task, clone_flags)`), in the context of
/// the task that created it. Only attached with `--follow-forks`.
#[raw_tracepoint(tracepoint = "task_newtask")]
pub fn task_new(ctx: RawTracePointContext) -> i32 {
    let clone_flags: u64 = ctx.arg(1);
    if clone_flags & CLONE_THREAD != 0 {
        return 0;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let parent = (pid_tgid >> 32) as u32;
    if TRACED.get_ptr(&parent).is_none() {
        return 0;
    }
    let mut event = base_event(pid_tgid, 0, EventKind::Fork);
    event.aux = clone_flags;
    emit_now(event);
    0
}

/// A process ran exec (`sched_process_exec(task, old_pid, bprm)`), in the
/// context of the task that did, its new image in place and not yet run.
/// Attached whenever forks are watched.
#[raw_tracepoint(tracepoint = "sched_process_exec")]
pub fn task_exec(ctx: RawTracePointContext) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let pid = (pid_tgid >> 32) as u32;
    if TRACED.get_ptr(&pid).is_none() {
        return 0;
    }
    // The exec'ing thread's id before the exec (the leader's after it).
    let old_tid: u64 = ctx.arg(1);
    let old_tid = old_tid as u32;
    held::send(old_tid);
    if old_tid != pid {
        // The leader, killed by the exec: what it held goes first too.
        held::send(pid);
    }
    let mut event = base_event(pid_tgid, 0, EventKind::Exec);
    event.aux = u64::from(old_tid);
    emit_now(event);
    0
}

#[inline(always)]
fn bump(counter: Counter) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: the slot is this CPU's own element of a per-CPU array. A
        // uprobe program runs with migration, not preemption, disabled, so
        // another program on this CPU can interrupt it: the add is atomic
        // (BPF_ATOMIC add without fetch, which every supported kernel has).
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                slot, 1,
            )
        };
    }
}

#[cfg(not(feature = "compat"))]
#[inline(always)]
fn cookie_spec<C: EbpfContext>(ctx: &C) -> Option<&'static ProbeSpec> {
    // SAFETY: the helper only reads the attach cookie of the running program.
    let cookie = unsafe { aya_ebpf::helpers::bpf_get_attach_cookie(ctx.as_ptr()) };
    // Read in place (a copy would spill every field to the stack).
    SPECS.get(cookie as u32)
}

#[inline(always)]
fn stack_pointer<C: EbpfContext>(ctx: &C) -> u64 {
    arch::sp(arch::regs(ctx))
}

/// The first six integer argument registers, read once ([`arch::args`]).
struct Args([u64; 6]);

impl Args {
    #[inline(always)]
    fn read(ctx: &ProbeContext) -> Self {
        Args(arch::args(arch::regs(ctx)))
    }

    /// Argument `n`, or 0 for [`ARG_NONE`].
    #[inline(always)]
    fn get(&self, n: u8) -> u64 {
        match n {
            0 => self.0[0],
            1 => self.0[1],
            2 => self.0[2],
            3 => self.0[3],
            4 => self.0[4],
            5 => self.0[5],
            _ => 0,
        }
    }
}

/// Whether `addr` belongs to the sampled subset: a hash of the address, so the
/// free of a sampled block is sampled too.
#[inline(always)]
fn sampled(addr: u64) -> bool {
    let rate = SAMPLE_RATE.load() as u64;
    if rate <= 1 {
        return true;
    }
    let hash = (addr >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    hash % rate == 0
}

/// `a * b`, saturating at `u64::MAX`. BPF has no 128-bit multiply, so LLVM's
/// overflow intrinsics cannot be used: operands that both exceed 32 bits (a
/// request no allocator could satisfy) saturate.
#[inline(always)]
fn mul_sat(a: u64, b: u64) -> u64 {
    if a <= 1 || b <= 1 {
        if a == 0 || b == 0 {
            0
        } else {
            a.max(b)
        }
    } else if (a | b) >> 32 == 0 {
        a * b
    } else {
        u64::MAX
    }
}

/// Submit flags of a record: wake the reader only once `WAKEUP_BYTES` wait.
#[inline(always)]
fn wakeup_flags() -> u64 {
    let threshold = WAKEUP_BYTES.load();
    if threshold == 0 {
        0
    } else if EVENTS.query(BPF_RB_AVAIL_DATA) >= threshold {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    }
}

#[inline(always)]
fn emit(event: WireEvent) {
    match EVENTS.reserve::<WireEvent>(0) {
        Some(mut entry) => {
            entry.write(event);
            entry.submit(wakeup_flags());
        }
        None => bump(Counter::RingbufFull),
    }
}

/// Emits `event` and wakes the reader at once.
#[inline(always)]
fn emit_now(event: WireEvent) {
    match EVENTS.reserve::<WireEvent>(0) {
        Some(mut entry) => {
            entry.write(event);
            entry.submit(BPF_RB_FORCE_WAKEUP);
        }
        None => bump(Counter::RingbufFull),
    }
}

/// The monotonic clock of events (`CLOCK_MONOTONIC`).
#[inline(always)]
fn now_ns() -> u64 {
    // SAFETY: reading the monotonic clock has no preconditions.
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
fn base_event(pid_tgid: u64, spec: u16, kind: EventKind) -> WireEvent {
    stamped_event(pid_tgid, spec, kind, now_ns())
}

/// An event stamped `ts_ns` (0: stamped when it is sent).
#[inline(always)]
fn stamped_event(pid_tgid: u64, spec: u16, kind: EventKind, ts_ns: u64) -> WireEvent {
    WireEvent {
        ts_ns,
        addr: 0,
        size: 0,
        aux: 0,
        pid: (pid_tgid >> 32) as u32,
        tid: pid_tgid as u32,
        stack_id: STACK_NONE,
        spec,
        kind: kind as u8,
        flags: 0,
        py_stack: 0,
        tag: 0,
    }
}

/// The spec of the function whose entry probe runs.
#[inline(always)]
fn entry_spec(ctx: &ProbeContext, _pid_tgid: u64) -> Option<&'static ProbeSpec> {
    #[cfg(not(feature = "compat"))]
    return cookie_spec(ctx);
    #[cfg(feature = "compat")]
    return compat::entry_spec(ctx, (_pid_tgid >> 32) as u32);
}

/// Whether a call of `family` is in flight on this thread (whose record is
/// `_thread`) at a shallower stack level than `sp` (so the current call
/// runs inside it).
#[inline(always)]
fn outer(_thread: in_flight::Thread, pid_tgid: u64, family: u8, sp: u64) -> bool {
    #[cfg(not(feature = "compat"))]
    return in_flight::outer(_thread, pid_tgid, family, sp);
    #[cfg(feature = "compat")]
    return compat::outer(pid_tgid, family, sp);
}

fn on_enter(ctx: &ProbeContext) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let Some(spec) = entry_spec(ctx, pid_tgid) else {
        return;
    };
    if window_closed() && spec.kind != SpecKind::Free as u8 {
        return;
    }
    let sp = stack_pointer(ctx);
    // The thread's record is made by a call that may be saved in it.
    let thread = in_flight::Thread::current(spec.ret != RetKind::Void as u8);

    if (spec.parent_family != ARG_NONE && outer(thread, pid_tgid, spec.parent_family, sp))
        || outer(thread, pid_tgid, spec.family, sp)
    {
        bump(Counter::Nested);
        #[cfg(feature = "compat")]
        if spec.ret != RetKind::Void as u8 {
            compat::skip_nested(pid_tgid, sp);
        }
        return;
    }

    let args = Args::read(ctx);
    if spec.quirk == SpecQuirk::Munmap as u8 {
        unmap_now(args.get(spec.ptr_arg), args.get(1), pid_tgid, spec);
        return;
    }
    if spec.ret == RetKind::Void as u8 {
        release_now(args.get(spec.ptr_arg), spec, pid_tgid);
        return;
    }
    if spec.quirk == SpecQuirk::AnonMmap as u8 && args.get(3) & MAP_ANONYMOUS == 0 {
        return;
    }

    let mut call = PendingCall {
        entry_sp: sp,
        entered: in_flight::now(),
        size: args.get(spec.size_arg),
        count: if spec.count_arg == ARG_NONE {
            1
        } else {
            args.get(spec.count_arg)
        },
        ptr: args.get(spec.ptr_arg),
        out: args.get(spec.out_arg),
        spec: spec.index,
        _pad: [0; 6],
    };
    if spec.quirk == SpecQuirk::Malloc3D as u8 {
        // cudaExtent {width, height, depth} is passed by value on the stack,
        // just above the return address.
        // SAFETY: bpf_probe_read_user checks the user address and fails cleanly.
        let height = unsafe { bpf_probe_read_user((sp + 16) as *const u64) }.unwrap_or(0);
        // SAFETY: as above.
        let depth = unsafe { bpf_probe_read_user((sp + 24) as *const u64) }.unwrap_or(0);
        call.count = mul_sat(height, depth);
    }
    #[cfg(not(feature = "compat"))]
    in_flight::begin(thread, pid_tgid, spec.family, &call);
    #[cfg(feature = "compat")]
    compat::begin(pid_tgid, spec.family, &call);
}

/// `munmap(addr, len)`: the range is sent whole, whatever it covers (a
/// mapping, part of one, several, or none traced); user space keeps the
/// mappings' ranges. Never sampled: a range is no block address, and
/// unmapping is rare next to heap calls.
#[inline(always)]
fn unmap_now(addr: u64, len: u64, pid_tgid: u64, spec: &ProbeSpec) {
    if addr == 0 || len == 0 {
        return;
    }
    let mut event = base_event(pid_tgid, spec.index, EventKind::Unmap);
    event.addr = addr;
    event.size = len;
    emit(event);
}

/// A release with no result to check (`free`, `cudaFree`): report it at entry.
#[inline(always)]
fn release_now(mut ptr: u64, spec: &ProbeSpec, pid_tgid: u64) {
    if spec.quirk == SpecQuirk::Handle32 as u8 {
        ptr &= 0xffff_ffff;
    }
    if ptr == 0 {
        return;
    }
    if !sampled(ptr) {
        bump(Counter::Filtered);
        return;
    }
    if spec.heap != 0 && held::settle(pid_tgid, ptr, spec.index, true) {
        return;
    }
    let mut event = base_event(pid_tgid, spec.index, EventKind::Free);
    event.addr = ptr;
    emit(event);
}

/// A return, in the `compat` object: the call is found by the stack pointer
/// of its return, so no cookie is needed.
#[cfg(feature = "compat")]
fn on_exit(ctx: &RetProbeContext) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let sp = stack_pointer(ctx);
    let call = match compat::take(pid_tgid, sp) {
        Some(Ok(call)) => call,
        // A nested call's return.
        Some(Err(())) => return,
        None => {
            if !CONTROL.get(0).is_some_and(|&flag| flag != 0) {
                bump(Counter::UnpairedReturn);
            }
            return;
        }
    };
    let Some(spec) = SPECS.get(call.spec as u32) else {
        return;
    };
    compat::end(pid_tgid, spec.family, &call);
    if window_closed() && spec.kind != SpecKind::Free as u8 {
        return;
    }
    let ret: u64 = ctx.ret();
    finish_call(ctx, spec, &call, pid_tgid, ret);
}

#[cfg(not(feature = "compat"))]
fn on_exit(ctx: &RetProbeContext) {
    let Some(exit_spec) = cookie_spec(ctx) else {
        return;
    };
    if window_closed() && exit_spec.kind != SpecKind::Free as u8 {
        return;
    }
    let pid_tgid = bpf_get_current_pid_tgid();
    let thread = in_flight::Thread::current(false);
    let Some((call, held)) = in_flight::find(thread, pid_tgid, exit_spec.family) else {
        // The return of a call skipped at entry because it ran inside a call
        // of its parent family (the driver under the runtime) is expected;
        // anything else returned without its entry being seen.
        let sp = stack_pointer(ctx);
        let ending = CONTROL.get(0).is_some_and(|&flag| flag != 0);
        if !ending
            && (exit_spec.parent_family == ARG_NONE
                || !in_flight::outer(thread, pid_tgid, exit_spec.parent_family, sp))
        {
            bump(Counter::UnpairedReturn);
        }
        return;
    };
    let sp = stack_pointer(ctx);
    let expected = call.entry_sp.wrapping_add(arch::RET_SP_DELTA);
    if sp < expected {
        // The return of a nested call that was skipped at its entry.
        return;
    }
    in_flight::end(thread, pid_tgid, exit_spec.family, held);
    if sp > expected {
        bump(Counter::StalePending);
        debug!(ctx, "stale in-flight call dropped (spec {})", call.spec);
        return;
    }
    let spec = if call.spec == exit_spec.index {
        exit_spec
    } else {
        let Some(spec) = SPECS.get(call.spec as u32) else {
            return;
        };
        spec
    };
    let ret: u64 = ctx.ret();
    finish_call(ctx, spec, &call, pid_tgid, ret);
}

/// Decides what a returned call did and emits its event.
#[inline(always)]
fn finish_call<C: EbpfContext + UserStack>(
    ctx: &C,
    spec: &ProbeSpec,
    call: &PendingCall,
    pid_tgid: u64,
    ret: u64,
) {
    let success = if spec.ret == RetKind::Status as u8 {
        (ret as i32) as i64 == spec.success_code
    } else if spec.ret == RetKind::MmapPointer as u8 {
        ret != u64::MAX && ret != 0
    } else if spec.ret == RetKind::NonNegative as u8 {
        (ret as i32) >= 0
    } else {
        ret != 0
    };

    let handle32 = spec.quirk == SpecQuirk::Handle32 as u8;
    let released = if handle32 {
        call.ptr & 0xffff_ffff
    } else {
        call.ptr
    };
    if spec.kind == SpecKind::Free as u8 {
        // A release whose result is checked (cudaFree, aclrtFree ...).
        if released == 0 {
            return;
        }
        let mut event = if success {
            base_event(pid_tgid, spec.index, EventKind::Free)
        } else {
            let mut failed = base_event(pid_tgid, spec.index, EventKind::Failed);
            failed.aux = ret;
            failed
        };
        event.addr = released;
        if success && !sampled(released) {
            bump(Counter::Filtered);
            return;
        }
        if success && spec.heap != 0 && held::settle(pid_tgid, released, spec.index, true) {
            return;
        }
        emit(event);
        return;
    }

    if !success {
        if spec.kind == SpecKind::Realloc as u8 && call.ptr != 0 && call.size == 0 {
            // realloc(p, 0) frees p and returns NULL.
            if spec.heap != 0 && held::settle(pid_tgid, call.ptr, spec.index, true) {
                return;
            }
            let mut event = base_event(pid_tgid, spec.index, EventKind::Free);
            event.addr = call.ptr;
            emit(event);
            return;
        }
        let mut event = base_event(pid_tgid, spec.index, EventKind::Failed);
        event.size = mul_sat(call.size, call.count);
        event.aux = ret;
        emit(event);
        return;
    }

    let mut addr = ret;
    let mut size = mul_sat(call.size, call.count);
    if spec.out_arg != ARG_NONE {
        // SAFETY: bpf_probe_read_user validates the user address and fails cleanly.
        match unsafe { bpf_probe_read_user(call.out as *const u64) } {
            Ok(value) => addr = value,
            Err(_) => {
                bump(Counter::OutReadFailed);
                debug!(ctx, "out-parameter unreadable (spec {})", call.spec);
                return;
            }
        }
    }
    if handle32 {
        addr &= 0xffff_ffff;
    }
    if spec.quirk == SpecQuirk::ResizeInPlace as u8 {
        // xallocx returns the block's new size; the block stays where it was.
        addr = call.ptr;
        size = ret;
    }
    if spec.quirk == SpecQuirk::SizeOutParam as u8 {
        // SAFETY: as above.
        let pitch = unsafe { bpf_probe_read_user(call.size as *const u64) }.unwrap_or(0);
        size = mul_sat(pitch, call.count);
    } else if spec.quirk == SpecQuirk::Malloc3D as u8 {
        // SAFETY: as above; cudaPitchedPtr is {ptr, pitch, xsize, ysize}.
        let pitch = unsafe { bpf_probe_read_user((call.out + 8) as *const u64) }.unwrap_or(0);
        size = mul_sat(pitch, call.count);
    }

    let is_realloc = spec.kind == SpecKind::Realloc as u8;
    let old = if is_realloc { call.ptr } else { 0 };
    let new_sampled = sampled(addr);
    // A held old block is settled here: the reallocation then only creates.
    let old_sampled = old != 0
        && sampled(old)
        && !(spec.heap != 0 && held::settle(pid_tgid, old, spec.index, false));
    if !new_sampled && !old_sampled {
        bump(Counter::Filtered);
        return;
    }
    if size < MIN_SIZE.load() || size > MAX_SIZE.load() {
        bump(Counter::Filtered);
        if old_sampled {
            let mut event = base_event(pid_tgid, spec.index, EventKind::Free);
            event.addr = old;
            emit(event);
        }
        return;
    }

    let kind = if is_realloc {
        EventKind::Realloc
    } else {
        EventKind::Alloc
    };
    // Stamped when it is sent: a held allocation that is settled never
    // reads the clock (see `held`).
    let mut event = stamped_event(pid_tgid, spec.index, kind, 0);
    event.addr = addr;
    event.size = size;
    event.aux = if old_sampled { old } else { 0 };
    if spec.ret == RetKind::Void as u8 {
        // A USDT allocation (see `usdt::on_fire`): its extra arguments.
        event.aux = call.out;
        if spec.tag_loc.kind != memtrace_common::LOC_NONE {
            event.tag = call.entered as u32;
            event.flags |= memtrace_common::FLAG_TAGGED;
        }
    }
    if !new_sampled {
        event.flags |= memtrace_common::FLAG_NEW_UNSAMPLED;
    }
    let stack_mode = STACK_MODE.load();
    #[cfg(not(feature = "tailcall"))]
    {
        event.py_stack = python::python_stack_id(pid_tgid);
        if stack_mode == STACK_MODE_DWARF {
            event.stack_id = unwind::capture(ctx, C::AT_RETURN);
        } else if stack_mode == STACK_MODE_FP {
            event.stack_id = user_stack_id(ctx);
        }
    }
    #[cfg(feature = "tailcall")]
    {
        if stack_mode == STACK_MODE_FP {
            event.stack_id = user_stack_id(ctx);
        }
        // The DWARF walk and the Python frames run in tail-called programs,
        // which send the event; back here only when neither is needed or
        // they could not start (counted): frame pointers then.
        tail::start(ctx, &event, spec.heap != 0, C::AT_RETURN);
        if stack_mode == STACK_MODE_DWARF {
            event.stack_id = user_stack_id(ctx);
        }
    }
    send(event, spec.heap != 0);
}

/// The user stack by frame pointers (the kernel's walk), as a stack id, or
/// the negative errno of its failure (counted by cause).
#[inline(always)]
fn user_stack_id<C: UserStack>(ctx: &C) -> i32 {
    match ctx.get_stackid_user() {
        Ok(id) => id,
        Err(err) => {
            bump(match -err {
                EFAULT => Counter::StackFault,
                EEXIST => Counter::StackCollision,
                _ => Counter::StackOther,
            });
            err
        }
    }
}

/// Sends a finished allocation event (`heap`: of a heap allocator, so it
/// may be held in the kernel until its block is released, see `held`).
#[inline(always)]
fn send(mut event: WireEvent, heap: bool) {
    if heap {
        if event.kind == EventKind::Alloc as u8 && held::hold(&event) {
            return;
        }
        held::forget_settled(event.tid);
    }
    event.ts_ns = now_ns();
    emit(event);
}

trait UserStack {
    /// A return probe (the stack starts in the caller, which has saved its
    /// return address), not a probe inside a function.
    const AT_RETURN: bool;
    fn get_stackid_user(&self) -> Result<i32, i32>;
}

impl UserStack for RetProbeContext {
    const AT_RETURN: bool = true;

    #[inline(always)]
    fn get_stackid_user(&self) -> Result<i32, i32> {
        use aya_ebpf::programs::tracing::StackIdContext;
        self.get_stackid(&STACKS, BPF_F_USER_STACK as u64)
            .map(|id| id as i32)
    }
}

impl UserStack for ProbeContext {
    const AT_RETURN: bool = false;

    #[inline(always)]
    fn get_stackid_user(&self) -> Result<i32, i32> {
        use aya_ebpf::programs::tracing::StackIdContext;
        self.get_stackid(&STACKS, BPF_F_USER_STACK as u64)
            .map(|id| id as i32)
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
