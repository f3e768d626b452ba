//! The in-kernel CFI unwinder: walks a user stack from a return probe's
//! registers using the compact rows user space derived from each object's
//! `.eh_frame` (see `memtrace/src/unwind`), falling back to frame pointers for
//! PCs no row covers, and stores each distinct stack once in `DWARF_STACKS`.
//!
//! Per frame: find the PC's executable mapping in the process's sorted
//! mapping list (binary search), its object's page index entry (one array
//! read), the covering row within that page (binary search), then compute the
//! CFA, read the return address at CFA-8 and restore rbp. The rule found for
//! a PC is kept in `PC_CACHE`, keyed by the PC and the generation of the
//! process's mapping list, so the hot PCs of a program skip both searches. The frame loop runs
//! under `bpf_loop`, so the verifier checks one frame, not 127.
//!
//! A walk is a function of its start registers, the mapping list and the
//! stack words it reads. Each CPU remembers its recent walks, words
//! included (`WALK_REPLAYS`); a walk from the same registers in the same
//! process first reads the remembered words' span in one copy, and when
//! every word still holds its value, it is answered with the remembered
//! stack without walking (`stacks_replayed`). A hot allocation site then
//! costs one read instead of one read and two look-ups per frame.
//!
//! The whole walk is a global BPF function ([`memtrace_walk_stack`]): the
//! verifier checks it once, not once per path of `call_exit` that reaches it.
//!
//! Kernels without `bpf_loop` (the `tailcall` and `compat` objects) run
//! the same frame step, searches and replay as bounded loops, a few frames
//! per program, the walk carried on across tail calls (see `tail`): its
//! state was per CPU already.
//!
//! Over 800 lines: the walk, its rule cache and its replay share private
//! per-CPU state and inline helpers, and are verified together.

use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::map,
    maps::{Array, HashMap, PerCpuArray},
    EbpfContext, Global,
};
use memtrace_common::{
    unwind::{
        DwarfStack, MapEntry, PageChunk, PageRow, ProcMaps, RowChunk, RowKind, RuleChunk,
        TableInfo, UnwindRule, MAPPING_SEARCH_STEPS, MAX_FRAMES, MAX_MAPPINGS, PAGES_PER_CHUNK,
        PAGE_SHIFT, PC_CACHE_ENTRIES, ROWS_PER_CHUNK, ROW_SEARCH_STEPS, RULES_PER_CHUNK,
        SLOT_CACHE_ENTRIES, TABLE_CAPPED, TABLE_NONE, TABLE_PENDING,
    },
    Counter, EventKind,
};

use crate::bump;

/// Frames per stack (`--stack-depth`, at most [`MAX_FRAMES`]).
#[no_mangle]
static MAX_DEPTH: Global<u32> = Global::new(32);

/// The page of the kernel's uretprobe trampoline (`[uprobes]`).
#[no_mangle]
static TRAMPOLINE_PAGE: Global<u64> = Global::new(0x7fff_ffff_e000);
/// Offsets of `task_struct.utask`, `uprobe_task.return_instances`,
/// `return_instance.{stack, orig_ret_vaddr, next}` from the kernel's BTF
/// (0: unknown, a trampoline then ends the walk).
#[no_mangle]
static OFF_UTASK: Global<u32> = Global::new(0);
#[no_mangle]
static OFF_RETURN_INSTANCES: Global<u32> = Global::new(0);
#[no_mangle]
static OFF_RI_STACK: Global<u32> = Global::new(0);
#[no_mangle]
static OFF_RI_ORIG: Global<u32> = Global::new(0);
#[no_mangle]
static OFF_RI_NEXT: Global<u32> = Global::new(0);

/// Rows of every object, in 1024-row chunks (sized by the loader).
#[map]
static UNWIND_ROWS: Array<RowChunk> = Array::with_max_entries(1, 0);
/// Rule dictionaries of every object (sized by the loader).
#[map]
static UNWIND_RULES: Array<RuleChunk> = Array::with_max_entries(1, 0);
/// Page index of every object (sized by the loader).
#[map]
static UNWIND_PAGES: Array<PageChunk> = Array::with_max_entries(1, 0);
/// Where each object's rows and pages sit.
#[map]
static UNWIND_TABLES: Array<TableInfo> = Array::with_max_entries(4096, 0);
/// Slot in `PROC_MAPS` of each traced process, by tgid.
#[map]
static PROC_SLOTS: HashMap<u32, u32> = HashMap::with_max_entries(1024, 0);
/// Most processes' slots again, at `tgid % SLOT_CACHE_ENTRIES`
/// ([`slot_cache_entry`]): an array read instead of a hash look-up.
#[map]
static PROC_SLOT_CACHE: Array<u64> = Array::with_max_entries(SLOT_CACHE_ENTRIES, 0);
/// Executable mappings of each traced process, by slot (sized by the loader).
#[map]
static PROC_MAPS: Array<ProcMaps> = Array::with_max_entries(1, 0);
/// Distinct stacks, keyed by the low 31 bits of their hash.
#[map]
static DWARF_STACKS: HashMap<u32, DwarfStack> = HashMap::with_max_entries(16384, 0);
/// When each process's last `MapsStale` report was sent.
#[map]
static STALE_SENT: HashMap<u32, u64> = HashMap::with_max_entries(1024, 0);
/// Rules found for recent PCs (see [`cached_rule`]).
#[map]
static PC_CACHE: Array<PcCacheEntry> = Array::with_max_entries(PC_CACHE_ENTRIES, 0);
/// The stack being walked, per CPU.
#[map]
static WALK_SCRATCH: PerCpuArray<DwarfStack> = PerCpuArray::with_max_entries(1, 0);

/// The running walk's registers and bookkeeping, per CPU. Kept out of the
/// BPF stack: a program, the walk function and a `bpf_loop` callback share
/// one 512-byte stack on kernels without private BPF stacks (all below
/// 6.13), and values loaded from a map are not tracked by the verifier, so
/// frames of one walk collapse into one state. Only the return probe walks,
/// so no other program type shares it; a walk preempted by another on its
/// CPU is detected by `WALKS_STARTED`.
#[map]
static WALK_STATE: PerCpuArray<Walk> = PerCpuArray::with_max_entries(1, 0);
/// The binary searches' state (mapping and row searches), per CPU.
#[map]
static SEARCH_STATE: PerCpuArray<Search> = PerCpuArray::with_max_entries(1, 0);
/// A replay check's and a remembered span's state, per CPU.
#[map]
static REPLAY_STATE: PerCpuArray<ReplayState> = PerCpuArray::with_max_entries(1, 0);

/// This CPU's last stack stored or found in `DWARF_STACKS`, by its 64-bit
/// hash (0: none); its key is the hash's low 31 bits. Entries are never
/// removed or rewritten there, so a stack with the same hash has that key
/// without a look-up (a hot allocation site repeats its stack). One word,
/// so a program preempted while reading it cannot see half of another's.
#[map]
static LAST_STACK: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Walks started on this CPU. The walk's scratch is per CPU and a program
/// on a preemptible kernel can be preempted by another that walks on the
/// same CPU: a walk that sees the count changed when it ends was
/// overwritten and is counted as failed (`stack_other`), never stored.
#[map]
static WALKS_STARTED: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Stack words a walk may read and still be replayed.
const REPLAY_WORDS: usize = 64;
/// Bytes of stack the words of a replayable walk may span.
const REPLAY_SPAN: u32 = 16384;
/// Replayable walks each CPU remembers, by start PC and stack pointer.
const REPLAY_ENTRIES: u32 = 32;

/// One remembered walk: its start registers, the process and mapping-list
/// generation it ran under, every stack word it read, and what it found.
/// The walk is a function of exactly these, so when they are all the same
/// again the stored stack is the walk's answer (see [`replayed`]).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct WalkReplay {
    pc: u64,
    sp: u64,
    bp: u64,
    lo: u64,
    tgid: u32,
    generation: u32,
    count: u32,
    stop: u32,
    key: i32,
    /// Bytes from `lo` to the end of the highest word read.
    bytes: u32,
    /// The walk used the start `bp` (code without frame pointers uses rbp
    /// as any other register: its value then does not matter).
    uses_bp: u32,
    /// While the walk runs (not sealed): a read failed, a return address
    /// was the trampoline's, or a word was unaligned, so the walk depends
    /// on more than the words it logged; and whether `bp` still holds the
    /// start register. Kept here rather than in [`Walk`]: the verifier does
    /// not track values loaded from a map, so flags here do not split its
    /// states of a frame.
    unreplayable: u32,
    start_bp: u32,
    /// `bp` was restored from the stack word at `bp_addr`, not yet logged:
    /// code without frame pointers saves rbp as any callee-saved register,
    /// and its value matters only if a later frame uses it.
    bp_pending: u32,
    bp_addr: u64,
    /// [`seal_header`] of everything above and the words: an entry torn by two
    /// walks (a preempted program on a preemptible kernel) fails it.
    seal: u64,
    addrs: [u64; REPLAY_WORDS],
    values: [u64; REPLAY_WORDS],
}

/// Remembered walks, per CPU, at [`replay_index`] of their start PC and SP.
#[map]
static WALK_REPLAYS: PerCpuArray<WalkReplay> = PerCpuArray::with_max_entries(REPLAY_ENTRIES, 0);

/// The stack span a replay compares, read in one copy; `seq` changes with
/// every replay, so one preempted by another on this CPU sees it changed.
#[repr(C)]
pub struct ReplaySpan {
    seq: u64,
    words: [u64; (REPLAY_SPAN / 8) as usize],
}

#[map]
static REPLAY_SPANS: PerCpuArray<ReplaySpan> = PerCpuArray::with_max_entries(1, 0);

const NO_SLOT: u32 = u32::MAX;

/// Why a walk ended.
const RUNNING: u32 = 0;
const COMPLETE: u32 = 1;
const FAULT: u32 = 2;
const NO_TABLE: u32 = 3;
const BAD_RULE: u32 = 4;
const CAPPED: u32 = 5;
/// The PC's object's table is still being prepared (the frame is kept).
const PENDING: u32 = 6;

use crate::arch::{SIGCTX_FP, SIGCTX_PC, SIGCTX_SP};

/// The bits of a return address that are address (arm64: pointer
/// authentication codes sit above them; the loader sets it from the
/// kernel's mask). All ones on x86-64.
#[no_mangle]
static RA_MASK: Global<u64> = Global::new(u64::MAX);

/// The walk's registers and bookkeeping, shared with the per-frame callback
/// (in `WALK_STATE`).
#[repr(C)]
pub struct Walk {
    pc: u64,
    sp: u64,
    bp: u64,
    hash: u64,
    slot: u32,
    stop: u32,
    /// The next PC was interrupted by a signal (not a return address): look
    /// it up as is, not at `pc - 1`.
    exact: u32,
    /// A PC fell outside every mapping known for the process.
    stale: u32,
    /// [`ProcMaps::generation`] of the process's mapping list.
    generation: u32,
    /// The `WALK_REPLAYS` element this walk logs its reads into.
    replay: u32,
    /// The traced process.
    tgid: u32,
    /// The thread walking: a walk that finds another thread's here was
    /// preempted by that thread's walk on this CPU and must not write on.
    tid: u32,
    /// Sum of the [`word_seal`]s of the words read so far.
    seal: u64,
    /// The registers the walk started from.
    start_pc: u64,
    start_sp: u64,
    start_bp: u64,
    /// The link register (arm64; 0 on x86-64), and whether it still holds
    /// the current frame's return address (the innermost frame, or one a
    /// signal interrupted).
    lr: u64,
    lr_live: u64,
}

/// One PC cache entry: `value` is the mapping list's generation (its low 20
/// bits, on top) and the packed rule (see [`cached_rule`]); `check` is the PC mixed with `value`, so
/// an entry torn by two CPUs writing it at once fails the check instead of
/// giving another PC's rule.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PcCacheEntry {
    check: u64,
    value: u64,
}

/// How many bits of a mapping list's generation a cache entry keeps (the
/// rest of its value is the packed rule).
const CACHED_GENERATION_BITS: u32 = 20;
const CACHED_GENERATION: u32 = (1 << CACHED_GENERATION_BITS) - 1;

/// The packed-rule kind of a PC whose object's table was capped.
const CACHED_CAPPED: u8 = 0xf;

#[inline(always)]
fn cache_index(pc: u64) -> u32 {
    (pc.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - PC_CACHE_ENTRIES.trailing_zeros())) as u32
}

#[inline(always)]
fn cache_check(pc: u64, value: u64) -> u64 {
    pc ^ value.wrapping_mul(0xff51_afd7_ed55_8ccd)
}

/// The rule and stop reason cached for `pc` under `generation`.
///
/// An entry's value packs, from the top: the mapping list's generation (its
/// low [`CACHED_GENERATION_BITS`] bits), the row kind (4 bits,
/// [`CACHED_CAPPED`] for a capped table), the return address's and rbp's
/// (x29's) save slots (12 signed bits each) and the CFA offset (16 bits).
#[inline(always)]
fn cached_rule(generation: u32, pc: u64) -> Option<(UnwindRule, u32)> {
    let entry = PC_CACHE.get_ptr_mut(cache_index(pc))?;
    // SAFETY: an element of an array map, alive as long as the map; aligned
    // u64 loads are atomic, and a torn pair fails the check below.
    let (check, value) = unsafe {
        (
            core::ptr::read_volatile(core::ptr::addr_of!((*entry).check)),
            core::ptr::read_volatile(core::ptr::addr_of!((*entry).value)),
        )
    };
    if (value >> (64 - CACHED_GENERATION_BITS)) as u32 != generation & CACHED_GENERATION
        || check != cache_check(pc, value)
    {
        return None;
    }
    let kind = ((value >> 40) & 0xf) as u8;
    if kind == CACHED_CAPPED {
        return Some((UnwindRule::default(), CAPPED));
    }
    // Sign-extends the 12-bit field at `shift`.
    let slot = |shift: u32| (((value >> shift) as u16) << 4) as i16 >> 4;
    Some((
        UnwindRule {
            cfa_offset8: value as u16 as i16,
            rbp_offset8: slot(16),
            ra_offset8: slot(28),
            kind,
            _pad: 0,
        },
        NO_TABLE,
    ))
}

/// Remembers the rule of `pc` (`missing`: why frame pointers are used when
/// the rule has none). A rule whose save slots do not fit the entry's 12
/// bits (a frame of over 16 KiB) is not cached: it is looked up each time.
#[inline(always)]
fn cache_rule(generation: u32, pc: u64, rule: &UnwindRule, missing: u32) {
    let fits = |slot: i16| (-2048..2048).contains(&slot);
    if !fits(rule.rbp_offset8) || !fits(rule.ra_offset8) {
        return;
    }
    let Some(entry) = PC_CACHE.get_ptr_mut(cache_index(pc)) else {
        return;
    };
    let packed = if missing == CAPPED {
        u64::from(CACHED_CAPPED) << 40
    } else {
        u64::from(rule.cfa_offset8 as u16)
            | (u64::from(rule.rbp_offset8 as u16 & 0xfff) << 16)
            | (u64::from(rule.ra_offset8 as u16 & 0xfff) << 28)
            | (u64::from(rule.kind & 0xf) << 40)
    };
    let value =
        (u64::from(generation & CACHED_GENERATION) << (64 - CACHED_GENERATION_BITS)) | packed;
    // SAFETY: as in `cached_rule`; each store is an aligned u64.
    unsafe {
        core::ptr::write_volatile(core::ptr::addr_of_mut!((*entry).value), value);
        core::ptr::write_volatile(
            core::ptr::addr_of_mut!((*entry).check),
            cache_check(pc, value),
        );
    }
}

/// `value`, hidden from the optimizer, so a bounds check on it is the one
/// the verifier sees on the index (LLVM otherwise folds `i - 1` into the
/// address and checks another register).
#[inline(always)]
fn opaque(value: u32) -> u32 {
    // SAFETY: a volatile read of a local.
    unsafe { core::ptr::read_volatile(&value) }
}

/// A `bpf_loop` callback: its state lives in a per-CPU map, so it takes no
/// context.
type LoopStep = extern "C" fn(u64, *mut core::ffi::c_void) -> i64;

/// Runs `step` up to `rounds` times (never more than `MAX`) with a null
/// context (the state is in a per-CPU map, never on the BPF stack).
#[inline(always)]
pub(crate) fn run_loop<const MAX: u32>(rounds: u32, step: LoopStep) {
    loop_with::<MAX>(rounds, step, core::ptr::null_mut());
}

/// Runs `step(i, ctx)` for `i` in `0..rounds` until it returns non-zero:
/// with `bpf_loop`, so the verifier checks one round. `rounds` is at most
/// `MAX` (the bound the loop without `bpf_loop` needs).
#[cfg(not(feature = "tailcall"))]
#[inline(always)]
fn loop_with<const MAX: u32>(rounds: u32, step: LoopStep, ctx: *mut core::ffi::c_void) {
    // SAFETY: `step` is a static function of this program; `ctx` is null or
    // outlives the synchronous call.
    unsafe {
        aya_ebpf::helpers::generated::bpf_loop(rounds, step as *mut core::ffi::c_void, ctx, 0);
    }
}

/// [`loop_with`] without `bpf_loop`: a loop the verifier follows round by
/// round, bounded by the constant `MAX` (a bound on `rounds` alone is lost
/// by older verifiers when it is spilled: 5.10 walked a 64-word loop to its
/// 129th round), the step inlined: a program that tail-calls may hold no
/// BPF-to-BPF calls on arm64 before 6.0.
#[cfg(feature = "tailcall")]
#[inline(always)]
fn loop_with<const MAX: u32>(rounds: u32, step: LoopStep, ctx: *mut core::ffi::c_void) {
    let rounds = opaque(rounds);
    let mut i = 0;
    while i < MAX {
        if i >= rounds || step(u64::from(i), ctx) != 0 {
            break;
        }
        i += 1;
    }
}

#[inline(always)]
fn read_u64(addr: u64) -> Option<u64> {
    // SAFETY: bpf_probe_read_user validates the user address and fails cleanly.
    unsafe { bpf_probe_read_user(addr as *const u64) }.ok()
}

/// Two consecutive words of user memory, in one read.
#[inline(always)]
fn read_pair(addr: u64) -> Option<[u64; 2]> {
    // SAFETY: bpf_probe_read_user validates the user address and fails cleanly.
    unsafe { bpf_probe_read_user(addr as *const [u64; 2]) }.ok()
}

/// A binary search's state, shared with its `bpf_loop` callback (a loop
/// the verifier would otherwise unroll, multiplying its states).
#[repr(C)]
pub struct Search {
    lo: u32,
    hi: u32,
    /// The value searched for (a PC or a file offset).
    key: u64,
    /// The process slot (mapping search).
    slot: u32,
    _pad: u32,
}

/// One step of the mapping search: `lo` ends as one past the last mapping
/// with `start <= key`.
#[inline(always)]
extern "C" fn mapping_step(_index: u64, _ctx: *mut core::ffi::c_void) -> i64 {
    let Some(search) = SEARCH_STATE.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's own element, set by `find_mapping` before the loop.
    let search = unsafe { &mut *search };
    if search.lo >= search.hi {
        return 1;
    }
    let Some(maps) = PROC_MAPS.get(search.slot) else {
        return 1;
    };
    let mid = (search.lo + search.hi) / 2;
    let Some(entry) = maps.entries.get(mid as usize) else {
        return 1;
    };
    if entry.start <= search.key {
        search.lo = mid + 1;
    } else {
        search.hi = mid;
    }
    0
}

#[inline(always)]
fn read_kernel_u64(addr: u64) -> Option<u64> {
    // SAFETY: bpf_probe_read_kernel validates the address and fails cleanly.
    unsafe { aya_ebpf::helpers::bpf_probe_read_kernel(addr as *const u64) }.ok()
}

/// Most in-flight return probes of one thread the fix-up looks through.
const RETURN_INSTANCES: u32 = 8;

/// The real return address of a frame whose return address slot (`slot`)
/// holds the uretprobe trampoline: the task's `return_instances` entry for
/// that stack slot, as the kernel's own stack walker finds it.
#[inline(always)]
fn untrampolined(slot: u64, ra: u64) -> Option<u64> {
    if ra & !0xfff != TRAMPOLINE_PAGE.load() {
        return Some(ra);
    }
    let utask_off = u64::from(OFF_UTASK.load());
    if utask_off == 0 {
        return None;
    }
    // SAFETY: the helper only returns the current task's address.
    let task = unsafe { aya_ebpf::helpers::bpf_get_current_task() };
    let utask = read_kernel_u64(task + utask_off)?;
    if utask == 0 {
        return None;
    }
    let mut ri = read_kernel_u64(utask + u64::from(OFF_RETURN_INSTANCES.load()))?;
    for _ in 0..RETURN_INSTANCES {
        if ri == 0 {
            return None;
        }
        let stack = read_kernel_u64(ri + u64::from(OFF_RI_STACK.load()))?;
        // x86-64 records the return address's slot; arm64 the stack pointer
        // at entry (the CFA), which a frame-pointer step only bounds from
        // below: the innermost instance at or above it.
        #[cfg(bpf_target_arch = "x86_64")]
        let hit = stack == slot;
        #[cfg(bpf_target_arch = "aarch64")]
        let hit = stack >= slot;
        if hit {
            return read_kernel_u64(ri + u64::from(OFF_RI_ORIG.load()));
        }
        ri = read_kernel_u64(ri + u64::from(OFF_RI_NEXT.load()))?;
    }
    None
}

/// The mapping containing `pc` in the process at `slot`.
#[inline(always)]
fn find_mapping(slot: u32, pc: u64) -> Option<MapEntry> {
    let len = PROC_MAPS.get(slot)?.len.min(MAX_MAPPINGS as u32);
    let search = SEARCH_STATE.get_ptr_mut(0)?;
    // SAFETY: this CPU's own element; the loop below is synchronous.
    unsafe {
        *search = Search {
            lo: 0,
            hi: len,
            key: pc,
            slot,
            _pad: 0,
        };
    }
    run_loop::<{ MAPPING_SEARCH_STEPS + 1 }>(MAPPING_SEARCH_STEPS + 1, mapping_step);
    let maps = PROC_MAPS.get(slot)?;
    // SAFETY: as above.
    let lo = unsafe { (*search).lo };
    let index = opaque(lo.checked_sub(1)?);
    let entry = maps.entries.get(index as usize)?;
    (pc < entry.end).then_some(*entry)
}

/// One step of the row search: `lo` ends as the last row with `pc <= key`.
#[inline(always)]
extern "C" fn row_step(_index: u64, _ctx: *mut core::ffi::c_void) -> i64 {
    let Some(search) = SEARCH_STATE.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's own element, set by `find_rule` before the loop.
    let search = unsafe { &mut *search };
    if search.hi <= search.lo + 1 {
        return 1;
    }
    let mid = search.lo + (search.hi - search.lo) / 2;
    let Some(row) = row_at(mid) else {
        return 1;
    };
    if u64::from(row.pc_in_page) <= search.key {
        search.lo = mid;
    } else {
        search.hi = mid;
    }
    0
}

#[inline(always)]
fn row_at(index: u32) -> Option<PageRow> {
    let chunk = UNWIND_ROWS.get(index / ROWS_PER_CHUNK)?;
    chunk.rows.get((index % ROWS_PER_CHUNK) as usize).copied()
}

#[inline(always)]
fn rule_at(index: u32) -> Option<UnwindRule> {
    let chunk = UNWIND_RULES.get(index / RULES_PER_CHUNK)?;
    chunk.rules.get((index % RULES_PER_CHUNK) as usize).copied()
}

#[inline(always)]
fn page_first_row(index: u32) -> Option<u32> {
    let chunk = UNWIND_PAGES.get(index / PAGES_PER_CHUNK)?;
    chunk
        .first_row
        .get((index % PAGES_PER_CHUNK) as usize)
        .copied()
}

/// The rule covering file offset `offset` of table `table` ("no CFI" outside it).
#[inline(always)]
fn find_rule(table: u32, offset: u64) -> Option<UnwindRule> {
    let info = UNWIND_TABLES.get(table)?;
    if offset < u64::from(info.base) || info.row_count == 0 {
        return Some(UnwindRule::default());
    }
    let page = ((offset - u64::from(info.base)) >> PAGE_SHIFT) as u32;
    if page >= info.page_count {
        return Some(UnwindRule::default());
    }
    let first = page_first_row(info.page_start + page)?;
    let end = if page + 1 < info.page_count {
        page_first_row(info.page_start + page + 1)?
    } else {
        info.row_start + info.row_count
    };
    // The page's last row at or before the offset; its first row is at 0.
    let search = SEARCH_STATE.get_ptr_mut(0)?;
    // SAFETY: this CPU's own element; the loop below is synchronous.
    unsafe {
        *search = Search {
            lo: first,
            hi: end,
            key: offset & ((1 << PAGE_SHIFT) - 1),
            slot: 0,
            _pad: 0,
        };
    }
    run_loop::<{ ROW_SEARCH_STEPS + 1 }>(ROW_SEARCH_STEPS + 1, row_step);
    // SAFETY: as above.
    let row = row_at(unsafe { (*search).lo })?;
    rule_at(info.rule_start + u32::from(row.rule))
}

impl Walk {
    /// A stack word, logged for replay.
    #[inline(always)]
    fn read(&mut self, log: &mut WalkReplay, addr: u64) -> Option<u64> {
        let value = read_u64(addr)?;
        self.log(log, addr, value);
        Some(value)
    }

    /// A saved rbp at `addr` and the return address above it, in one read:
    /// the return address is logged, the rbp word only once it is used.
    #[inline(always)]
    fn read_bp_ra(&mut self, log: &mut WalkReplay, addr: u64) -> Option<u64> {
        let [bp, ra] = read_pair(addr)?;
        self.log(log, addr.wrapping_add(8), ra);
        self.restore_bp(log, addr, bp);
        Some(ra)
    }

    /// rbp (x29) restored from its save slot under `row`, `cfa`-relative.
    #[inline(always)]
    fn restore_saved_bp(
        &mut self,
        log: &mut WalkReplay,
        row: &UnwindRule,
        cfa: u64,
    ) -> Result<(), u32> {
        let at = cfa.wrapping_add((i64::from(row.rbp_offset8) * 8) as u64);
        let bp = read_u64(at).ok_or(FAULT)?;
        self.restore_bp(log, at, bp);
        Ok(())
    }

    /// rbp restored from the stack word at `addr`.
    #[inline(always)]
    fn restore_bp(&mut self, log: &mut WalkReplay, addr: u64, value: u64) {
        self.bp = value;
        log.start_bp = 0;
        log.bp_addr = addr;
        log.bp_pending = 1;
    }

    /// This frame uses rbp: the start register's, or the stack word it was
    /// restored from, now matters to the walk (logged without a branch).
    #[inline(always)]
    fn use_bp(&mut self, log: &mut WalkReplay) {
        log.uses_bp |= log.start_bp;
        let pending = log.bp_pending & 1;
        log.bp_pending = 0;
        let n = log.count;
        let i = (n as usize) & (REPLAY_WORDS - 1);
        // Written either way; counted only when pending (otherwise the
        // next word logged takes the slot).
        log.addrs[i] = log.bp_addr;
        log.values[i] = self.bp;
        log.count = n.wrapping_add(pending);
        let mask = 0u64.wrapping_sub(u64::from(pending));
        self.seal = self
            .seal
            .wrapping_add(word_seal(n, log.bp_addr, self.bp) & mask);
        log.unreplayable |= (log.bp_addr & 7) as u32 & pending;
    }

    /// [`untrampolined`]; a return address resolved through the kernel's
    /// return instances depends on more than stack words: not replayable.
    #[inline(always)]
    fn untrampolined(&mut self, log: &mut WalkReplay, slot: u64, ra: u64) -> Option<u64> {
        let real = untrampolined(slot, ra)?;
        if real != ra {
            log.unreplayable = 1;
        }
        Some(real)
    }

    /// Logs a word read into this walk's `WALK_REPLAYS` element, without
    /// a branch (each would multiply the verifier's paths through a frame).
    #[inline(always)]
    fn log(&mut self, log: &mut WalkReplay, addr: u64, value: u64) {
        // The count lives in the map value, not in `self`: a value loaded
        // from a map is one the verifier does not track, so frames with
        // different counts are still the same state to it.
        let n = log.count;
        log.count = n.wrapping_add(1);
        let i = (n as usize) & (REPLAY_WORDS - 1);
        log.addrs[i] = addr;
        log.values[i] = value;
        self.seal = self.seal.wrapping_add(word_seal(n, addr, value));
        log.unreplayable |= (addr & 7) as u32;
    }
}

/// The sum of a walk's [`word_seal`]s before its first word.
const WORDS_SEAL_BASIS: u64 = 0x243F_6A88_85A3_08D3;

/// Mixes one word of a seal (a multiply and an xor-shift).
#[inline(always)]
fn mix(word: u64) -> u64 {
    let mixed = word.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    mixed ^ (mixed >> 29)
}

/// Logged word `i`'s share of a seal. The shares are summed, not chained:
/// a replay's check multiplies each word once, independently of the others,
/// instead of waiting on one multiply per word in a row.
#[inline(always)]
fn word_seal(i: u32, addr: u64, value: u64) -> u64 {
    mix((addr ^ u64::from(i)).wrapping_mul(0xC2B2_AE3D_27D4_EB4F) ^ value)
}

/// The seal of a replay entry: its words' sum (`words`) and every other
/// field, each multiplied by a constant of its own and summed, then mixed.
#[inline(always)]
fn seal_header(words: u64, entry: &WalkReplay, key: i32, stop: u32) -> u64 {
    let fields = entry
        .pc
        .wrapping_mul(0xFF51_AFD7_ED55_8CCD)
        .wrapping_add(entry.sp.wrapping_mul(0xC4CE_B9FE_1A85_EC53))
        .wrapping_add(entry.bp.wrapping_mul(0x1656_67B1_9E37_79F9))
        .wrapping_add(entry.lo.wrapping_mul(0x27D4_EB2F_1656_67C5))
        .wrapping_add(
            ((u64::from(entry.generation) << 32) | u64::from(entry.tgid))
                .wrapping_mul(0x85EB_CA77_C2B2_AE63),
        )
        .wrapping_add(
            ((u64::from(stop) << 32) | u64::from(key as u32)).wrapping_mul(0x9FB2_1C65_1E98_DF25),
        )
        .wrapping_add(
            ((u64::from(entry.bytes) << 32) | u64::from(entry.count))
                .wrapping_mul(0xD6E8_FEB8_6659_FD93),
        )
        .wrapping_add(u64::from(entry.uses_bp).wrapping_mul(0xA076_1D64_78BD_642F));
    mix(words ^ fields)
}

/// Where a walk from `pc` and `sp` is remembered: by both, since one
/// allocator call site (a wrapper such as redis's `zmalloc`) is reached from
/// many call paths, usually at different stack depths.
#[inline(always)]
fn replay_index(pc: u64, sp: u64) -> u32 {
    ((pc ^ sp.rotate_left(29)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 59) as u32 % REPLAY_ENTRIES
}

/// The span of a remembered walk's words, widened by [`span_word`] (a
/// `bpf_loop` callback) word by word.
#[repr(C)]
pub struct ReplayState {
    /// The `WALK_REPLAYS` element.
    index: u32,
    _pad: u32,
    lo: u64,
    hi: u64,
}

/// The answer of the remembered walk from these registers, if every stack
/// word it read still holds the value it read: `(stack key, stop reason)`.
#[inline(always)]
fn replayed(
    index: u32,
    pc: u64,
    sp: u64,
    bp: u64,
    tgid: u32,
    generation: u32,
) -> Option<(i32, u32)> {
    let entry = WALK_REPLAYS.get_ptr(index)?;
    // SAFETY: this CPU's own element; the seal check rejects a torn one.
    let entry = unsafe { &*entry };
    if entry.pc != pc
        || entry.sp != sp
        || (entry.uses_bp != 0 && entry.bp != bp)
        || entry.tgid != tgid
        || entry.generation != generation
    {
        return None;
    }
    let (count, key, stop, lo, sealed) = (entry.count, entry.key, entry.stop, entry.lo, entry.seal);
    let span = REPLAY_SPANS.get_ptr_mut(0)?;
    // SAFETY: this CPU's own element; `seq` tells if another replay used it
    // meanwhile.
    let span = unsafe { &mut *span };
    let seq = span.seq.wrapping_add(1);
    span.seq = seq;
    let mut words_seal = WORDS_SEAL_BASIS;
    // Any bit set: a word differs now (compared without a branch per word).
    let mut changed = 0u64;
    if count > 0 {
        let bytes = opaque(entry.bytes);
        if bytes == 0 || bytes > REPLAY_SPAN {
            return None;
        }
        // SAFETY: `bytes` is at most the size of `words`; the helper
        // validates the user range and fails cleanly.
        let failed = unsafe {
            aya_ebpf::helpers::generated::bpf_probe_read_user(
                span.words.as_mut_ptr() as *mut core::ffi::c_void,
                bytes,
                lo as *const core::ffi::c_void,
            )
        };
        if failed != 0 {
            return None;
        }
        // Inline, not a `bpf_loop` callback: the words' multiplies then
        // overlap from one word to the next (measured with `--bpf-stats` on
        // mallocbench: the return probe ~13 ns less per run than with the
        // callback).
        let rounds = opaque(count.min(REPLAY_WORDS as u32));
        let mut i = 0u32;
        while i < REPLAY_WORDS as u32 {
            if i >= rounds {
                break;
            }
            let at = (i as usize) & (REPLAY_WORDS - 1);
            let (addr, value) = (entry.addrs[at], entry.values[at]);
            words_seal = words_seal.wrapping_add(word_seal(i, addr, value));
            let word = (addr.wrapping_sub(lo) >> 3) as usize;
            match span.words.get(word) {
                Some(&now) => changed |= now ^ value,
                None => {
                    changed = 1;
                    break;
                }
            }
            i += 1;
        }
    }
    if changed != 0 || span.seq != seq || seal_header(words_seal, entry, key, stop) != sealed {
        return None;
    }
    Some((key, stop))
}

/// Records the current PC and computes the caller's registers.
/// Returns the walk's new stop reason ([`RUNNING`] to go on).
#[inline(always)]
fn step(walk: &mut Walk, log: &mut WalkReplay) -> u32 {
    let Some(scratch) = WALK_SCRATCH.get_ptr_mut(0) else {
        return BAD_RULE;
    };
    // SAFETY: the per-CPU scratch element is this CPU's own; a walk that
    // preempted this one on the CPU is detected by `WALKS_STARTED`.
    let scratch = unsafe { &mut *scratch };
    // The depth lives in the map value, not in `walk`: the verifier does not
    // track a value loaded from a map, so it sees one frame's state, not one
    // state per depth (see `WalkReplay` count).
    let depth = scratch.len;
    let lookup = if walk.exact != 0 {
        walk.pc
    } else {
        walk.pc.wrapping_sub(1)
    };
    walk.exact = 0;
    let (row, missing) = if walk.slot == NO_SLOT {
        (UnwindRule::default(), NO_TABLE)
    } else if let Some(cached) = cached_rule(walk.generation, lookup) {
        cached
    } else {
        let (rule, missing, cacheable) = match find_mapping(walk.slot, lookup) {
            None => {
                walk.stale = 1;
                if depth > 0 {
                    // Not code: the previous frame's return address was not real.
                    return NO_TABLE;
                }
                // Not cached: the next walk must see the mapping is unknown.
                (UnwindRule::default(), NO_TABLE, false)
            }
            Some(entry) if entry.table == TABLE_NONE => (UnwindRule::default(), NO_TABLE, true),
            Some(entry) if entry.table == TABLE_CAPPED => (UnwindRule::default(), CAPPED, true),
            // Not cached: the table arrives under a new generation anyway.
            Some(entry) if entry.table == TABLE_PENDING => (UnwindRule::default(), PENDING, false),
            Some(entry) => match find_rule(entry.table, lookup.wrapping_sub(entry.bias)) {
                Some(rule) => (rule, NO_TABLE, true),
                None => return BAD_RULE,
            },
        };
        if cacheable {
            cache_rule(walk.generation, lookup, &rule, missing);
        }
        (rule, missing)
    };

    // Record this frame.
    match scratch.pcs.get_mut(depth as usize) {
        Some(slot) => *slot = walk.pc,
        None => return COMPLETE,
    }
    scratch.len = depth + 1;
    walk.hash = hash_frame(walk.hash, walk.pc);
    if missing == PENDING {
        return PENDING;
    }

    let kind = row.kind;
    let cfa = if kind == RowKind::Rsp as u8 {
        walk.sp
            .wrapping_add((i64::from(row.cfa_offset8) * 8) as u64)
    } else if kind == RowKind::Rbp as u8 {
        walk.use_bp(log);
        walk.bp
            .wrapping_add((i64::from(row.cfa_offset8) * 8) as u64)
    } else if kind == RowKind::RbpDeref as u8 {
        walk.use_bp(log);
        match walk.read(
            log,
            walk.bp
                .wrapping_add((i64::from(row.cfa_offset8) * 8) as u64),
        ) {
            Some(cfa) => cfa,
            None => return FAULT,
        }
    } else if kind == RowKind::Plt as u8 {
        let extra = if (lookup & 15) as i64 >= i64::from(row.rbp_offset8) {
            8
        } else {
            0
        };
        walk.sp
            .wrapping_add((i64::from(row.cfa_offset8) * 8) as u64)
            .wrapping_add(extra)
    } else if kind == RowKind::Signal as u8 {
        // One read at a time, each failure returned at once: 5.10's verifier
        // refuses a read of a stack slot that some path did not write, and
        // LLVM merged the failures of a tuple of reads into such a read.
        let Some(bp) = read_u64(walk.sp + SIGCTX_FP) else {
            return FAULT;
        };
        let Some(sp) = walk.read(log, walk.sp + SIGCTX_SP) else {
            return FAULT;
        };
        let Some(pc) = walk.read(log, walk.sp + SIGCTX_PC) else {
            return FAULT;
        };
        #[cfg(bpf_target_arch = "aarch64")]
        {
            let Some(lr) = walk.read(log, walk.sp + crate::arch::SIGCTX_LR) else {
                return FAULT;
            };
            walk.lr = lr;
            walk.lr_live = 1;
        }
        walk.restore_bp(log, walk.sp + SIGCTX_FP, bp);
        walk.sp = sp;
        walk.pc = pc;
        walk.exact = 1;
        return if pc == 0 { COMPLETE } else { RUNNING };
    } else if kind == RowKind::End as u8 {
        return COMPLETE;
    } else if kind == RowKind::None as u8 {
        // Frame pointers for this frame.
        walk.use_bp(log);
        if walk.bp == 0 {
            return missing;
        }
        let frame = walk.bp;
        let Some(ra) = walk.read_bp_ra(log, frame) else {
            log.unreplayable = 1;
            return missing;
        };
        let Some(ra) = walk.untrampolined(log, frame + 8, ra & RA_MASK.load()) else {
            return FAULT;
        };
        walk.lr_live = 0;
        walk.sp = frame + 16;
        walk.pc = ra;
        return if ra == 0 { COMPLETE } else { RUNNING };
    } else {
        return BAD_RULE;
    };

    let ra = match return_address(walk, log, &row, cfa) {
        Ok(ra) => ra,
        Err(stop) => return stop,
    };
    walk.sp = cfa;
    walk.pc = ra;
    if ra == 0 {
        COMPLETE
    } else {
        RUNNING
    }
}

/// The return address of a frame whose CFA is `cfa` under `row`, with rbp
/// restored where the row saved it; or the walk's stop reason. x86-64: the
/// word below the CFA.
#[cfg(bpf_target_arch = "x86_64")]
#[inline(always)]
fn return_address(
    walk: &mut Walk,
    log: &mut WalkReplay,
    row: &UnwindRule,
    cfa: u64,
) -> Result<u64, u32> {
    let saves_rbp = row.rbp_offset8 != 0 && row.kind != RowKind::Plt as u8;
    let ra = if saves_rbp && row.rbp_offset8 == -2 {
        // The usual prologue (`push %rbp` first): rbp sits just below the
        // return address, so one read fetches both.
        walk.read_bp_ra(log, cfa.wrapping_sub(16)).ok_or(FAULT)?
    } else {
        let ra = walk.read(log, cfa.wrapping_sub(8)).ok_or(FAULT)?;
        if saves_rbp {
            walk.restore_saved_bp(log, row, cfa)?;
        }
        ra
    };
    walk.untrampolined(log, cfa.wrapping_sub(8), ra)
        .ok_or(FAULT)
}

/// arm64: x30's save slot (the frame record `{x29, x30}` in one read when
/// the row saved both side by side), or x30 itself while it still holds
/// the return address; pointer-authentication bits stripped.
#[cfg(bpf_target_arch = "aarch64")]
#[inline(always)]
fn return_address(
    walk: &mut Walk,
    log: &mut WalkReplay,
    row: &UnwindRule,
    cfa: u64,
) -> Result<u64, u32> {
    let saves_fp = row.rbp_offset8 != 0;
    let ra = if row.ra_offset8 == memtrace_common::unwind::RA_IN_LR {
        if walk.lr_live == 0 {
            // Only the innermost frame (or one a signal interrupted) can
            // still have its return address in x30.
            return Err(BAD_RULE);
        }
        // The link register is not part of a replayed walk's key.
        log.unreplayable = 1;
        if saves_fp {
            walk.restore_saved_bp(log, row, cfa)?;
        }
        walk.lr
    } else if saves_fp && row.ra_offset8 == row.rbp_offset8.wrapping_add(1) {
        let at = cfa.wrapping_add((i64::from(row.rbp_offset8) * 8) as u64);
        walk.read_bp_ra(log, at).ok_or(FAULT)?
    } else {
        let ra = walk
            .read(
                log,
                cfa.wrapping_add((i64::from(row.ra_offset8) * 8) as u64),
            )
            .ok_or(FAULT)?;
        if saves_fp {
            walk.restore_saved_bp(log, row, cfa)?;
        }
        ra
    };
    walk.lr_live = 0;
    walk.untrampolined(log, cfa, ra & RA_MASK.load())
        .ok_or(FAULT)
}

/// `bpf_loop` callback: one frame.
#[inline(always)]
extern "C" fn frame_callback(_index: u64, _ctx: *mut core::ffi::c_void) -> i64 {
    let Some(walk) = WALK_STATE.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's own element, set by `begin_walk` before the loop.
    let walk = unsafe { &mut *walk };
    if walk.tid != bpf_get_current_pid_tgid() as u32 {
        // Another thread's walk took this CPU's state while this one was
        // preempted: stop without writing it (this walk fails its checks).
        return 1;
    }
    let Some(log) = WALK_REPLAYS.get_ptr_mut(walk.replay) else {
        walk.stop = BAD_RULE;
        return 1;
    };
    // SAFETY: this CPU's own element; a write torn by another walk on this
    // CPU fails the entry's seal.
    walk.stop = step(walk, unsafe { &mut *log });
    if walk.stop == RUNNING {
        0
    } else {
        1
    }
}

#[cfg(not(feature = "tailcall"))]
/// Walks the user stack at a return probe and returns its id in
/// `DWARF_STACKS`, or a negative errno (as `bpf_get_stackid` does).
#[inline(always)]
pub fn capture<C: EbpfContext>(ctx: &C, at_return: bool) -> i32 {
    let (pc, sp, bp, lr) = crate::arch::frame(crate::arch::regs(ctx));
    // A walk preempted by another on its CPU (their per-CPU state is
    // shared; preemptible kernels allow it) is walked once more: it is a
    // function of these registers and the stack, both still as they were.
    #[cfg(bpf_target_arch = "x86_64")]
    let walk = |_lr: u64| {
        let _ = at_return;
        memtrace_walk_stack(pc, sp, bp)
    };
    #[cfg(bpf_target_arch = "aarch64")]
    let walk = |lr: u64| {
        if at_return {
            memtrace_walk_stack(pc, sp, bp)
        } else {
            memtrace_walk_stack_lr(pc, sp, bp, lr)
        }
    };
    match walk(lr) {
        key if key == -EAGAIN => {
            let again = walk(lr);
            if again == -EAGAIN {
                bump(Counter::StackOther);
            }
            again
        }
        key => key,
    }
}

#[cfg(not(feature = "tailcall"))]
/// Walks the user stack from the registers of a return probe. A global BPF
/// function: the verifier checks it once, on its own, instead of once per
/// path of `call_exit` that reaches it.
///
/// Its own frame is kept small, since every call chain under it (this
/// function, [`frame_callback`], a search step) shares one 512-byte stack
/// with the return probe on kernels without private BPF stacks: the replay
/// and the end of the walk are global functions of their own, and all state
/// lives in `WALK_STATE`.
#[no_mangle]
#[inline(never)]
pub extern "C" fn memtrace_walk_stack(pc: u64, sp: u64, bp: u64) -> i32 {
    walk_stack(pc, sp, bp, 0, 0)
}

#[cfg(all(not(feature = "tailcall"), bpf_target_arch = "aarch64"))]
/// [`memtrace_walk_stack`] at an arm64 probe inside a function (a USDT
/// site), whose innermost frame may still have its return address in the
/// link register. At a return probe the caller has saved it (it made a
/// call), so return probes use [`memtrace_walk_stack`]: a fourth argument
/// costs a frame 16 bytes of the call chain's stack budget, and the return
/// probe's chain is the deepest.
#[no_mangle]
#[inline(never)]
pub extern "C" fn memtrace_walk_stack_lr(pc: u64, sp: u64, bp: u64, lr: u64) -> i32 {
    walk_stack(pc, sp, bp, lr, 1)
}

#[cfg(not(feature = "tailcall"))]
/// The body of [`memtrace_walk_stack`].
#[inline(always)]
fn walk_stack(pc: u64, sp: u64, bp: u64, lr: u64, lr_live: u64) -> i32 {
    let started = match begin_walk(pc, sp, bp, lr, lr_live) {
        Ok(started) => started,
        Err(key) => return key,
    };
    let depth = MAX_DEPTH.load().min(MAX_FRAMES as u32);
    run_loop::<{ MAX_FRAMES as u32 }>(depth, frame_callback);
    memtrace_walk_finish(started)
}

/// Sets up a walk from these registers in `WALK_STATE`: `Ok` with this
/// CPU's walk count at its start when its frames are to be walked, `Err`
/// with the answer (a replayed walk's stack key, or a negative errno).
#[inline(always)]
fn begin_walk(pc: u64, sp: u64, bp: u64, lr: u64, lr_live: u64) -> Result<u64, i32> {
    let started = walk_started();
    let Some(state) = WALK_STATE.get_ptr_mut(0) else {
        return Err(-EAGAIN);
    };
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let slot = match process_slot(tgid) {
        Some(slot) => slot,
        None => {
            bump(Counter::UnwindNoMappings);
            NO_SLOT
        }
    };
    let generation = PROC_MAPS.get(slot).map_or(0, |maps| maps.generation);
    // SAFETY: this CPU's own element (see `WALK_STATE`).
    unsafe {
        *state = Walk {
            pc,
            sp,
            bp,
            hash: STACK_HASH_BASIS,
            slot,
            stop: RUNNING,
            exact: 0,
            stale: 0,
            generation,
            replay: 0,
            tgid,
            tid: 0,
            seal: WORDS_SEAL_BASIS,
            start_pc: pc,
            start_sp: sp,
            start_bp: bp,
            lr,
            lr_live,
        };
        (*state).tid = bpf_get_current_pid_tgid() as u32;
    }
    #[cfg(not(feature = "tailcall"))]
    let replayed = memtrace_walk_replay(started);
    #[cfg(feature = "tailcall")]
    let replayed = walk_replay(started);
    if replayed != NOT_REPLAYED {
        return Err(replayed);
    }
    if let Some(scratch) = WALK_SCRATCH.get_ptr_mut(0) {
        // SAFETY: this CPU's own element (see `step`).
        unsafe { (*scratch).len = 0 };
    }
    Ok(started)
}

/// Starts the walk of a tail-calling object from the probe's registers
/// (`at_return`: a return probe; see [`capture`]): `Ok` when it has frames
/// to walk ([`walk_frames`]), `Err` with its answer.
#[cfg(feature = "tailcall")]
#[inline(always)]
pub fn begin_tail_walk<C: EbpfContext>(ctx: &C, at_return: bool) -> Result<u64, i32> {
    let (pc, sp, bp, lr) = crate::arch::frame(crate::arch::regs(ctx));
    // x86-64 and return probes never read the link register.
    let lr_live = u64::from(cfg!(bpf_target_arch = "aarch64") && !at_return);
    begin_walk(pc, sp, bp, lr & 0u64.wrapping_sub(lr_live), lr_live)
}

/// Walks up to `frames` more frames of the walk in `WALK_STATE`; whether
/// it has ended (stopped, or `--stack-depth` frames deep).
#[cfg(feature = "tailcall")]
#[inline(always)]
pub fn walk_frames(frames: u32) -> bool {
    let max = MAX_DEPTH.load().min(MAX_FRAMES as u32);
    let mut i = 0;
    while i < frames {
        let depth = WALK_SCRATCH.get(0).map_or(max, |scratch| scratch.len);
        if depth >= max || frame_callback(0, core::ptr::null_mut()) != 0 {
            return true;
        }
        i += 1;
    }
    false
}

/// [`memtrace_walk_replay`]: no remembered walk answers these registers.
const NOT_REPLAYED: i32 = i32::MIN;

#[cfg(not(feature = "tailcall"))]
/// [`walk_replay`], as a global BPF function.
#[no_mangle]
#[inline(never)]
pub extern "C" fn memtrace_walk_replay(started: u64) -> i32 {
    walk_replay(started)
}

/// Answers the walk set up in `WALK_STATE` from a remembered one when every
/// stack word it read still holds its value (the stack key, or a negative
/// errno); otherwise picks the `WALK_REPLAYS` element the walk logs into and
/// returns [`NOT_REPLAYED`]. `started`: this CPU's walk count at the start.
#[inline(always)]
fn walk_replay(started: u64) -> i32 {
    let Some(state) = WALK_STATE.get_ptr_mut(0) else {
        return -EAGAIN;
    };
    // SAFETY: this CPU's own element (see `WALK_STATE`).
    let walk = unsafe { &mut *state };
    let (pc, sp, bp, tgid) = (walk.start_pc, walk.start_sp, walk.start_bp, walk.tgid);
    // Two entries per start PC and SP: two call paths that reach the same
    // call site at the same depth (an event loop dispatching to handlers of
    // one frame size) each keep theirs.
    let pair = replay_index(pc, sp) & !1;
    if walk.slot != NO_SLOT {
        let generation = walk.generation;
        for index in [pair, pair + 1] {
            if let Some((key, stop)) = replayed(index, pc, sp, bp, tgid, generation) {
                if walks_started() != started {
                    return -EAGAIN;
                }
                bump(Counter::StacksReplayed);
                count_stop(stop);
                return key;
            }
        }
    }
    let same_start = |index: u32| {
        WALK_REPLAYS
            .get(index)
            .is_some_and(|entry| entry.pc == pc && entry.sp == sp && entry.tgid == tgid)
    };
    // The other path's entry is kept; otherwise either, by turns.
    let replay = if same_start(pair) {
        pair + 1
    } else if same_start(pair + 1) {
        pair
    } else {
        pair + (started & 1) as u32
    };
    if let Some(entry) = WALK_REPLAYS.get_ptr_mut(replay) {
        // SAFETY: this CPU's own element; the walk logs its words from 0.
        unsafe {
            (*entry).count = 0;
            (*entry).unreplayable = 0;
            (*entry).start_bp = 1;
            (*entry).uses_bp = 0;
            (*entry).bp_pending = 0;
        }
    }
    walk.replay = replay;
    NOT_REPLAYED
}

#[cfg(not(feature = "tailcall"))]
/// [`finish_walk`], as a global BPF function.
#[no_mangle]
#[inline(never)]
pub extern "C" fn memtrace_walk_finish(started: u64) -> i32 {
    finish_walk(started)
}

/// Ends the walk in `WALK_STATE`: counts why it stopped, stores its stack
/// and remembers it for replay. Returns the stack key or a negative errno.
#[inline(always)]
pub fn finish_walk(started: u64) -> i32 {
    if walks_started() != started {
        // Another walk ran on this CPU meanwhile and took the scratch.
        return -EAGAIN;
    }
    let Some(state) = WALK_STATE.get_ptr_mut(0) else {
        return -EAGAIN;
    };
    // SAFETY: this CPU's own element (see `WALK_STATE`).
    let walk = unsafe { &*state };
    if walk.tid != bpf_get_current_pid_tgid() as u32 {
        return -EAGAIN;
    }
    count_stop(walk.stop);
    if walk.stale != 0 {
        report_stale(walk.tgid);
    }
    let frames = WALK_SCRATCH.get(0).map_or(0, |scratch| scratch.len);
    let replay = walk.replay;
    let key = store(walk.hash, frames);
    if key >= 0 && walk.slot != NO_SLOT && walk.stale == 0 {
        remember(walk, key, started);
    }
    if walks_started() != started {
        // Preempted by another walk on this CPU after the check above: the
        // state read since may be that walk's, and so may the remembered
        // entry (its seal is broken, so it is never replayed). The stored
        // stack itself was checked against its hash (see `stored`).
        if let Some(entry) = WALK_REPLAYS.get_ptr_mut(replay) {
            // SAFETY: this CPU's own element; one aligned word.
            unsafe { (*entry).seal = !(*entry).seal };
        }
        return -EAGAIN;
    }
    key
}

pub(crate) const EAGAIN: i32 = 11;

/// Counts a walk started on this CPU; returns the new count.
#[inline(always)]
fn walk_started() -> u64 {
    bump_cpu_sequence(&WALKS_STARTED)
}

/// The walks started on this CPU so far.
#[inline(always)]
fn walks_started() -> u64 {
    cpu_sequence(&WALKS_STARTED)
}

/// Adds one to this CPU's sequence word in `map` (element 0) and returns
/// it: a program that reads it unchanged at its end was not preempted by
/// another that shares its per-CPU state.
#[cfg(not(feature = "compat"))]
#[inline(always)]
pub(crate) fn bump_cpu_sequence(map: &PerCpuArray<u64>) -> u64 {
    let Some(count) = map.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: this CPU's own element; one aligned word. The add is atomic
    // (BPF_ATOMIC with fetch, which this object's kernels have): a program
    // preempted between a read and a write would otherwise hand the same
    // count to the program that preempted it, and neither would see the
    // other. Not `Relaxed`: LLVM's BPF backend lowers a relaxed add to the
    // add without fetch even when its result is used (that result is then
    // the addend), so the fetch is asked for with a stronger ordering.
    unsafe {
        core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::AcqRel }>(
            count, 1,
        )
        .wrapping_add(1)
    }
}

/// [`bump_cpu_sequence`] without BPF atomics with fetch (the `compat`
/// object, 5.10-5.11): the word becomes a token of this run, the thread id
/// over a count. A run that read the same count before it was preempted
/// writes another token (one thread runs one program at a time), so a run
/// preempted by another on its CPU still finds the word changed at its end.
#[cfg(feature = "compat")]
#[inline(always)]
pub(crate) fn bump_cpu_sequence(map: &PerCpuArray<u64>) -> u64 {
    let Some(word) = map.get_ptr_mut(0) else {
        return 0;
    };
    let tid = bpf_get_current_pid_tgid() as u32;
    // SAFETY: this CPU's own element; aligned one-word loads and stores.
    unsafe {
        let count = (core::ptr::read_volatile(word) as u32).wrapping_add(1);
        let token = (u64::from(tid) << 32) | u64::from(count);
        core::ptr::write_volatile(word, token);
        token
    }
}

/// This CPU's sequence word in `map` (see [`bump_cpu_sequence`]).
#[inline(always)]
pub(crate) fn cpu_sequence(map: &PerCpuArray<u64>) -> u64 {
    // SAFETY: as in `bump_cpu_sequence`.
    map.get_ptr_mut(0)
        .map_or(0, |count| unsafe { core::ptr::read_volatile(count) })
}

/// Counts why a walk ended (a complete walk counts nothing).
#[inline(always)]
fn count_stop(stop: u32) {
    match stop {
        RUNNING => bump(Counter::UnwindDepth),
        FAULT => bump(Counter::UnwindReadFault),
        NO_TABLE => bump(Counter::UnwindNoTable),
        BAD_RULE => bump(Counter::UnwindBadRule),
        CAPPED => bump(Counter::UnwindTableCap),
        PENDING => bump(Counter::UnwindTablePending),
        _ => {}
    }
}

/// `bpf_loop` callback: widens the span (`lo`, `hi` of [`ReplayState`]) by
/// logged word `i`.
#[inline(always)]
extern "C" fn span_word(i: u64, _ctx: *mut core::ffi::c_void) -> i64 {
    let Some(span) = REPLAY_STATE.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: this CPU's own element, set by `remember` before the loop.
    let span = unsafe { &mut *span };
    let Some(entry) = WALK_REPLAYS.get(span.index) else {
        return 1;
    };
    let Some(&addr) = entry.addrs.get(i as usize) else {
        return 1;
    };
    span.lo = span.lo.min(addr);
    span.hi = span.hi.max(addr);
    0
}

/// Makes a finished walk replayable: its words were logged into its
/// `WALK_REPLAYS` element as it read them; this seals them with the start
/// registers (`walk` itself holds the final ones) and the answer.
#[inline(always)]
fn remember(walk: &Walk, key: i32, started: u64) {
    let (pc, sp, bp, tgid) = (walk.start_pc, walk.start_sp, walk.start_bp, walk.tgid);
    let (replay, generation, stop, words_seal) =
        (walk.replay, walk.generation, walk.stop, walk.seal);
    if stop == FAULT || stop == BAD_RULE {
        return;
    }
    let Some(entry) = WALK_REPLAYS.get_ptr_mut(replay) else {
        return;
    };
    // SAFETY: this CPU's own element; see `WalkReplay::seal`.
    let (logged, unreplayable, uses_bp) =
        unsafe { ((*entry).count, (*entry).unreplayable, (*entry).uses_bp) };
    if logged > REPLAY_WORDS as u32 || unreplayable != 0 {
        return;
    }
    let (lo, bytes) = if logged == 0 {
        (0, 0)
    } else {
        let Some(span) = REPLAY_STATE.get_ptr_mut(0) else {
            return;
        };
        // SAFETY: this CPU's own element; the loop below is synchronous.
        unsafe {
            *span = ReplayState {
                index: replay,
                _pad: 0,
                lo: u64::MAX,
                hi: 0,
            };
        }
        run_loop::<{ REPLAY_WORDS as u32 }>(logged, span_word);
        // SAFETY: as above.
        let (span_lo, span_hi) = unsafe { ((*span).lo, (*span).hi) };
        let bytes = span_hi.wrapping_sub(span_lo).wrapping_add(8);
        if span_hi < span_lo || bytes > u64::from(REPLAY_SPAN) {
            return;
        }
        (span_lo, bytes as u32)
    };
    // `walk` is this CPU's shared state: every field above must be this
    // walk's, or a preempting walk's registers would be sealed with this
    // walk's key and replayed for that call site from then on (seen on 7.3:
    // a thread's stack given to the main thread's `mmap`). No walk started
    // since this one did, so none wrote `walk`; one that starts from here on
    // tears the entry's fields, which breaks its seal.
    if walks_started() != started {
        return;
    }
    // SAFETY: as above.
    let entry = unsafe { &mut *entry };
    entry.pc = pc;
    entry.sp = sp;
    // Without a branch: one on the flag would make the verifier tell the
    // walk's states apart by it.
    entry.bp = bp & 0u64.wrapping_sub(u64::from(uses_bp & 1));
    entry.uses_bp = uses_bp & 1;
    entry.lo = lo;
    entry.tgid = tgid;
    entry.generation = generation;
    entry.count = logged;
    entry.stop = stop;
    entry.key = key;
    entry.bytes = bytes;
    entry.seal = seal_header(words_seal, entry, key, stop);
}

/// The slot of process `tgid` in `PROC_MAPS`.
#[inline(always)]
fn process_slot(tgid: u32) -> Option<u32> {
    if let Some(&entry) = PROC_SLOT_CACHE.get(tgid % SLOT_CACHE_ENTRIES) {
        if (entry >> 32) as u32 == tgid && entry as u32 != 0 {
            return Some(entry as u32 - 1);
        }
    }
    // SAFETY: the value is copied out at once.
    unsafe { PROC_SLOTS.get(&tgid) }.copied()
}

/// Tells user space that `tgid`'s mappings changed (at most every 10 ms).
#[inline(always)]
fn report_stale(tgid: u32) {
    const EVERY_NS: u64 = 10_000_000;
    // SAFETY: reading the monotonic clock has no preconditions.
    let now = unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() };
    // SAFETY: the value is copied out at once.
    if let Some(&last) = unsafe { STALE_SENT.get(&tgid) } {
        if now.wrapping_sub(last) < EVERY_NS {
            return;
        }
    }
    let _ = STALE_SENT.insert(&tgid, &now, 0);
    let event = crate::base_event(bpf_get_current_pid_tgid(), 0, EventKind::MapsStale);
    crate::emit_now(event);
}

/// Stores the scratch stack under its hash unless already there.
#[inline(always)]
fn store(hash: u64, depth: u32) -> i32 {
    const EFAULT: i32 = 14;
    if depth == 0 {
        return -EFAULT;
    }
    let key = (hash as u32) & 0x7fff_ffff;
    let last = LAST_STACK.get_ptr_mut(0);
    if let Some(last) = last {
        // SAFETY: this CPU's own element; one aligned word.
        if hash != 0 && unsafe { core::ptr::read_volatile(last) } == hash {
            return key as i32;
        }
    }
    let found = stored(hash, key);
    if let (Some(last), true) = (last, found >= 0) {
        // SAFETY: as above.
        unsafe { core::ptr::write_volatile(last, hash) };
    }
    found
}

/// A stack's hash before its first frame.
const STACK_HASH_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// A stack's hash with one more frame, `pc`.
#[inline(always)]
fn hash_frame(hash: u64, pc: u64) -> u64 {
    let mixed = (hash ^ pc).wrapping_mul(0x0000_0100_0000_01b3);
    mixed ^ (mixed >> 29)
}

/// Whether the stack just stored under `key` is the one hashed `hash`: its
/// own copy (no other program writes it) hashed again as the walk hashed
/// the frames it found. The scratch it was copied from is per CPU, and on a
/// preemptible kernel another walk may have rewritten it meanwhile.
#[inline(always)]
fn stored_whole(key: u32, hash: u64) -> bool {
    // SAFETY: the entry is only read; entries are never rewritten in place.
    let Some(stack) = (unsafe { DWARF_STACKS.get(&key) }) else {
        return false;
    };
    let len = stack.len as usize;
    let mut again = STACK_HASH_BASIS;
    for (depth, &pc) in stack.pcs.iter().enumerate() {
        if depth >= len {
            break;
        }
        again = hash_frame(again, pc);
    }
    again == hash && stack.hash == hash
}

/// Finds or stores the scratch stack (hash `hash`) under `key`.
#[inline(always)]
fn stored(hash: u64, key: u32) -> i32 {
    const EEXIST: i32 = 17;
    const ENOMEM: i32 = 12;
    // SAFETY: the value is only read (its hash), at once.
    if let Some(existing) = unsafe { DWARF_STACKS.get(&key) } {
        if existing.hash == hash {
            return key as i32;
        }
        bump(Counter::StackCollision);
        return -EEXIST;
    }
    let Some(scratch) = WALK_SCRATCH.get_ptr_mut(0) else {
        return -ENOMEM;
    };
    // SAFETY: this CPU's own scratch element (see `step`).
    let scratch = unsafe { &mut *scratch };
    scratch.hash = hash;
    match DWARF_STACKS.insert(&key, scratch, 1 /* BPF_NOEXIST */) {
        Ok(()) if !stored_whole(key, hash) => {
            // The scratch was rewritten while it was copied (a walk that
            // preempted this one on its CPU): never keep frames under
            // another stack's key.
            let _ = DWARF_STACKS.remove(&key);
            -EAGAIN
        }
        Ok(()) => {
            bump(Counter::UnwindNewStack);
            key as i32
        }
        Err(_) => {
            // A racing CPU stored the same stack, or the map is full.
            // SAFETY: copied out at once.
            match unsafe { DWARF_STACKS.get(&key) } {
                Some(existing) if existing.hash == hash => key as i32,
                _ => {
                    bump(Counter::StackOther);
                    -ENOMEM
                }
            }
        }
    }
}
