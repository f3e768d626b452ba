//! Wire types of the in-kernel DWARF unwinder: the compact CFI rows user
//! space derives from each object's `.eh_frame` / `.debug_frame`, the page
//! index over them, each traced process's executable mappings, and the
//! deduplicated stacks the unwinder writes.
//!
//! Addresses in tables are *file offsets* of the object (a PC minus its
//! mapping's start plus the mapping's file offset), so one table serves every
//! process and every load address of a file.

/// Most frames one stack holds (`--stack-depth` is at most this).
pub const MAX_FRAMES: usize = 127;
/// Frames one run of the tail-called walk program walks (objects without
/// `bpf_loop`, see memtrace-ebpf's `tail`).
pub const FRAMES_PER_TAIL_CALL: u32 = 6;
/// Tail calls the kernel allows one probe (`MAX_TAIL_CALL_CNT`: 32 before
/// 6.2, 33 since; the smaller is taken).
pub const KERNEL_TAIL_CALLS: u32 = 32;
/// A walk of [`MAX_FRAMES`] frames, its start and the Python read fit the
/// kernel's tail calls, with room to spare.
const _: () = assert!((MAX_FRAMES as u32).div_ceil(FRAMES_PER_TAIL_CALL) + 2 <= KERNEL_TAIL_CALLS);
/// Rows per element of the `UNWIND_ROWS` array map (4 KiB values).
pub const ROWS_PER_CHUNK: u32 = 1024;
/// Rules per element of the `UNWIND_RULES` array map (4 KiB values).
pub const RULES_PER_CHUNK: u32 = 512;
/// Page-index entries per element of the `UNWIND_PAGES` array map.
pub const PAGES_PER_CHUNK: u32 = 1024;
/// log2 of the bytes of code one page-index entry covers.
pub const PAGE_SHIFT: u32 = 12;
/// Executable mappings one process can have in the unwinder's view.
pub const MAX_MAPPINGS: usize = 320;
/// [`MapEntry::table`]: no table for this mapping (frame pointers only).
pub const TABLE_NONE: u32 = u32::MAX;
/// [`MapEntry::table`]: the mapping's table did not fit the table memory cap.
pub const TABLE_CAPPED: u32 = u32::MAX - 1;
/// [`MapEntry::table`]: the mapping's table is still being prepared: a walk
/// reaching it ends there (counted), rather than guess with frame pointers.
pub const TABLE_PENDING: u32 = u32::MAX - 2;
/// Most binary-search steps over a process's mappings (2^9 > [`MAX_MAPPINGS`]).
pub const MAPPING_SEARCH_STEPS: u32 = 9;
/// Most binary-search steps within one page's rows (a 4 KiB page holds at
/// most 4097 rows).
pub const ROW_SEARCH_STEPS: u32 = 13;

/// How a row computes the caller's frame.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowKind {
    /// No CFI covers this PC: fall back to frame pointers for this frame.
    None = 0,
    /// CFA = rsp + offset; return address at CFA - 8.
    Rsp = 1,
    /// CFA = rbp + offset; return address at CFA - 8.
    Rbp = 2,
    /// A PLT entry: CFA = rsp + offset, plus 8 when `(pc & 15) >= 11`.
    Plt = 3,
    /// A kernel signal frame (`__restore_rt`): registers come from the
    /// `ucontext` at rsp (`uc_mcontext` at +40).
    Signal = 4,
    /// The return address is undefined: the outermost frame (`_start`, `clone3`).
    End = 5,
    /// A rule the unwinder cannot follow (another CFA register, an expression).
    Unsupported = 6,
    /// CFA = *(rbp + offset) (a stack-realigning function's DW_OP_deref rule).
    RbpDeref = 7,
}

/// How to find the caller's frame: one entry of a table's rule dictionary
/// (objects have a few hundred to a few thousand distinct rules). 8 bytes.
///
/// Register names are x86-64's; on arm64 "rsp" is sp, "rbp" is the frame
/// pointer x29, and the return address is x30's saved value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct UnwindRule {
    /// CFA offset in units of 8 bytes (signed).
    pub cfa_offset8: i16,
    /// Where rbp (x29) was saved, relative to the CFA in units of 8 bytes;
    /// 0: unchanged.
    pub rbp_offset8: i16,
    /// Where the return address was saved, relative to the CFA in units of
    /// 8 bytes: -1 on x86-64 (CFA - 8); on arm64 x30's save slot (functions
    /// with big frames save it kilobytes below the CFA), or [`RA_IN_LR`]
    /// while x30 still holds it (a leaf, a prologue's first instructions:
    /// only the innermost frame and one a signal interrupted can be there).
    pub ra_offset8: i16,
    /// [`RowKind`] as `u8`.
    pub kind: u8,
    pub _pad: u8,
}

/// [`UnwindRule::ra_offset8`]: the return address is still in the link
/// register (arm64).
pub const RA_IN_LR: i16 = 0;

/// One CFI row as the kernel stores it: from `pc_in_page` (the offset within
/// its 4 KiB page) until the next row, rule `rule` applies. Every page's rows
/// begin with one at offset 0 (the rule covering the page's first byte).
/// 4 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageRow {
    pub pc_in_page: u16,
    /// Index in the table's rule dictionary.
    pub rule: u16,
}

/// An element of the `UNWIND_ROWS` array map.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RowChunk {
    pub rows: [PageRow; ROWS_PER_CHUNK as usize],
}

/// An element of the `UNWIND_RULES` array map.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RuleChunk {
    pub rules: [UnwindRule; RULES_PER_CHUNK as usize],
}

/// An element of the `UNWIND_PAGES` array map: for each 4 KiB page of an
/// object's code, the global index of the page's first row.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PageChunk {
    pub first_row: [u32; PAGES_PER_CHUNK as usize],
}

/// Where one object's rows, rules and page index sit in the global arrays.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableInfo {
    /// Global index of the first row.
    pub row_start: u32,
    /// Rows of this table.
    pub row_count: u32,
    /// Global index of the first page-index entry.
    pub page_start: u32,
    /// Page-index entries of this table.
    pub page_count: u32,
    /// File offset of page 0 (page-aligned).
    pub base: u32,
    /// Global index of the table's first rule.
    pub rule_start: u32,
}

/// One executable mapping of a traced process.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapEntry {
    pub start: u64,
    pub end: u64,
    /// `start - file_offset`: a PC minus this is its file offset.
    pub bias: u64,
    /// Index in `UNWIND_TABLES`, or [`TABLE_NONE`] / [`TABLE_CAPPED`] /
    /// [`TABLE_PENDING`].
    pub table: u32,
    pub _pad: u32,
}

/// A traced process's executable mappings, sorted by `start`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcMaps {
    pub len: u32,
    /// Changes with every write of a process's list (unique across
    /// processes): the kernel's PC cache keys its entries by it.
    pub generation: u32,
    pub entries: [MapEntry; MAX_MAPPINGS],
}

/// Entries of the array that finds a process's slot without a hash look-up
/// (a power of two; indexed by tgid modulo it).
pub const SLOT_CACHE_ENTRIES: u32 = 1024;

/// A [`SLOT_CACHE_ENTRIES`] entry: `tgid << 32 | (slot + 1)`; 0: none.
#[inline(always)]
pub fn slot_cache_entry(tgid: u32, slot: u32) -> u64 {
    (u64::from(tgid) << 32) | u64::from(slot.wrapping_add(1))
}

/// Entries of the unwinder's PC cache (a power of two).
pub const PC_CACHE_ENTRIES: u32 = 4096;

/// A stack written by the unwinder, keyed by the low 32 bits of its hash.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DwarfStack {
    /// The full 64-bit hash of the PCs (tells a 32-bit key collision apart).
    pub hash: u64,
    /// Frames in `pcs`.
    pub len: u32,
    pub _pad: u32,
    /// Return addresses, innermost first (`pcs[0]` is the allocator's caller).
    pub pcs: [u64; MAX_FRAMES],
}

/// Stack capture modes (`STACK_MODE` global of the eBPF object).
pub const STACK_MODE_NONE: u32 = 0;
/// The kernel's frame-pointer walk (`bpf_get_stackid`).
pub const STACK_MODE_FP: u32 = 1;
/// memtrace's CFI unwinder (frame pointers where no CFI covers a PC).
pub const STACK_MODE_DWARF: u32 = 2;

const _: () = assert!(core::mem::size_of::<UnwindRule>() == 8);
const _: () = assert!(core::mem::size_of::<PageRow>() == 4);
const _: () = assert!(core::mem::size_of::<RowChunk>() == 4096);
const _: () = assert!(core::mem::size_of::<RuleChunk>() == 4096);
const _: () = assert!(core::mem::size_of::<PageChunk>() == 4096);
const _: () = assert!(core::mem::size_of::<TableInfo>() == 24);
const _: () = assert!(core::mem::size_of::<MapEntry>() == 32);
const _: () = assert!(core::mem::size_of::<DwarfStack>() == 16 + 8 * MAX_FRAMES);

#[cfg(feature = "user")]
mod user {
    // SAFETY: these types are `#[repr(C)]`, made only of integers (and arrays
    // of them) with explicit padding fields: every bit pattern is valid and
    // there is no uninitialised padding.
    unsafe impl aya::Pod for super::RowChunk {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::RuleChunk {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::PageChunk {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::TableInfo {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ProcMaps {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::DwarfStack {}
}
