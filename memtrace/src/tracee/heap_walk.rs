//! Walks glibc's ptmalloc heap of a stopped process from outside, so that
//! a leak check by pid judges the blocks allocated before memtrace
//! attached too (as macOS `leaks` walks the malloc zones, and chap walks
//! glibc's arenas in core files).
//!
//! From `main_arena` (found by [`super::glibc_heap::find_main_arena`]) the
//! arena ring; the main arena's heap is `[heap]`, walked chunk by chunk
//! from its start up to `top`; a non-main arena's heaps are found from its
//! `top` (`heap_info` at the 64 MiB boundary below) back through each
//! `heap_info.prev`. A chunk is in use when the next chunk's `PREV_INUSE`
//! is set and it is in no fastbin and no thread's tcache (safe-linked
//! from glibc 2.32); the tcache structures themselves (found by their
//! shape) are the allocator's. Chunks glibc mmapped for large blocks are
//! found in anonymous memory by their headers.
//!
//! Never a guess: an unknown glibc version is refused, and an arena whose
//! mutex is held (a thread stopped inside malloc) or whose walk breaks an
//! invariant is reported partial, its heaps left as roots and none of its
//! chunks taken as blocks.

use foldhash::{HashSet, HashSetExt};

use super::glibc_heap::{self, MainArena};
use crate::reach::Memory;
use crate::tracee::maps::Mapping;

const PREV_INUSE: u64 = 1;
const IS_MMAPPED: u64 = 2;
const FLAGS: u64 = 7;
const MINSIZE: u64 = 32;
const HEAP_MAX_SIZE: u64 = 64 << 20;
const PAGE: u64 = 4096;
/// The smallest chunk glibc mmaps (`DEFAULT_MMAP_THRESHOLD_MIN`).
const MMAP_MIN: u64 = 128 << 10;
/// At most this many arenas in the ring.
const MAX_ARENAS: usize = 4096;
/// Page headers read in one batch (`process_vm_readv` takes 1024 ranges).
const HEADER_BATCH: usize = 1024;
/// tcache bins (`TCACHE_MAX_BINS`).
const TCACHE_BINS: u64 = 64;

/// What differs between glibc versions, 2.26 to 2.41 (64-bit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub version: (u32, u32),
    /// Bytes of `malloc_state` (2.26 has no `have_fastchunks`).
    pub malloc_state: u64,
    /// tcache counts are `uint16_t` (2.30+), else `char`.
    pub tcache_counts_u16: bool,
    /// Free-list pointers are mangled (`PROTECT_PTR`, 2.32+).
    pub safe_linking: bool,
    /// Bytes of `heap_info`: `ar_ptr`, `prev`, `size`, `mprotect_size`,
    /// and from 2.35 `pagesize`, padded to 16.
    pub heap_info: u64,
}

impl Layout {
    /// The layout of glibc `major.minor`; an unknown version is refused.
    pub fn of(version: (u32, u32)) -> Result<Layout, String> {
        let (major, minor) = version;
        if major != 2 || !(26..=41).contains(&minor) {
            return Err(format!(
                "glibc {major}.{minor} is not one whose heap layout memtrace knows (2.26 to 2.41): its heap stays a root"
            ));
        }
        Ok(Layout {
            version,
            malloc_state: if minor == 26 { 2192 } else { 2200 },
            tcache_counts_u16: minor >= 30,
            safe_linking: minor >= 32,
            heap_info: if minor >= 35 { 48 } else { 32 },
        })
    }

    /// Where `bins` lies in `malloc_state`.
    fn bins_offset(&self) -> u64 {
        if self.version.1 == 26 {
            104
        } else {
            112
        }
    }

    /// Bytes of a `tcache_perthread_struct` chunk.
    fn tcache_chunk(&self) -> u64 {
        let counts = if self.tcache_counts_u16 { 2 } else { 1 } * TCACHE_BINS;
        (16 + counts + 8 * TCACHE_BINS).next_multiple_of(16)
    }

    /// A free-list link stored at `at` as it points.
    fn reveal(&self, at: u64, value: u64) -> u64 {
        if self.safe_linking {
            (at >> 12) ^ value
        } else {
            value
        }
    }
}

/// glibc's version from the banner in its `libc.so.6` ("... release
/// version 2.36.").
pub fn glibc_version(libc: &[u8]) -> Option<(u32, u32)> {
    const MARK: &[u8] = b"release version ";
    let at = libc.windows(MARK.len()).position(|w| w == MARK)? + MARK.len();
    let text: String = libc[at..]
        .iter()
        .take(12)
        .take_while(|b| b.is_ascii_digit() || **b == b'.')
        .map(|&b| b as char)
        .collect();
    let mut parts = text.trim_end_matches('.').split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// One in-use chunk: its block (the user pointer) and usable size (16
/// bytes: a heap of 10M blocks holds 160 MB of them; the leak check turns
/// them into its nodes in place).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub start: u64,
    pub size: u64,
}

/// What the walk found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeapWalk {
    pub layout: Option<Layout>,
    /// Every chunk in use, address order (the tracked blocks among them).
    pub chunks: Vec<Chunk>,
    /// Memory walked whole: heaps of the arenas walked and mmapped chunks
    /// (no root: every block there is in `chunks`).
    pub walked: Vec<(u64, u64)>,
    /// The allocator's own blocks (tcache structures): neither blocks nor
    /// roots.
    pub metadata: Vec<(u64, u64)>,
    pub arenas: u32,
    pub arenas_walked: u32,
    /// Chunks stepped over, free ones included.
    pub chunks_walked: u64,
    pub mmapped_chunks: u64,
    /// Why the walk is partial (empty when complete).
    pub partial: Vec<String>,
    /// Some arena's mutex was held: a brief resume may let its holder out.
    pub locked: bool,
    /// How `main_arena` was found (`debug symbols`, `empty bins`).
    pub main_arena_from: Option<&'static str>,
    /// glibc's own count of its mmapped chunks (`mp_.n_mmaps`), when found.
    pub mmapped_glibc: Option<u64>,
    /// Chunks in use taken out of `chunks` ([`HeapWalk::take_chunks`]).
    pub taken: u64,
}

impl HeapWalk {
    /// Takes the chunks in use (the leak check makes them its nodes: a
    /// heap of 10M blocks holds 240 MB of them), keeping their count.
    pub fn take_chunks(&mut self) -> Vec<Chunk> {
        let chunks = std::mem::take(&mut self.chunks);
        self.taken += chunks.len() as u64;
        chunks
    }

    /// How many chunks in use the walk found, taken or not.
    pub fn chunks_in_use(&self) -> u64 {
        self.chunks.len() as u64 + self.taken
    }
}

/// A buffered reader of words: a heap is read a window at a time. The
/// window adapts to the walk's steps: chunks of a few bytes are read a
/// megabyte at a time, chunks of a hundred kilobytes a page at a time (a
/// megabyte window would read the whole heap to see one header in ten).
struct Words<'a> {
    memory: &'a mut dyn Memory,
    start: u64,
    buf: Vec<u8>,
    /// The next window's length.
    window: usize,
}

const WINDOW_MIN: usize = 4 << 10;
const WINDOW_MAX: usize = 1 << 20;

impl<'a> Words<'a> {
    fn new(memory: &'a mut dyn Memory) -> Words<'a> {
        Words {
            memory,
            start: 0,
            buf: Vec::new(),
            window: WINDOW_MIN,
        }
    }

    fn get(&mut self, addr: u64) -> Option<u64> {
        let end = self.start + self.buf.len() as u64;
        if addr < self.start || addr + 8 > end {
            // Just past the window: the walk steps within windows, so the
            // next one may be larger; far past it: smaller.
            let near = addr >= self.start && addr < end + self.buf.len() as u64;
            self.window = if near {
                (self.window * 2).min(WINDOW_MAX)
            } else {
                (self.window / 4).max(WINDOW_MIN)
            };
            if self.window == WINDOW_MAX {
                // Stepping through small chunks: the windows after this
                // one are read ahead while it is walked.
                self.memory.prefetch(addr, 4 * WINDOW_MAX as u64);
            }
            self.buf.resize(self.window, 0);
            let read = self.memory.read(addr, &mut self.buf);
            self.buf.truncate(read);
            self.start = addr;
            if read < 8 {
                return None;
            }
        }
        let k = (addr - self.start) as usize;
        let bytes: [u8; 8] = self.buf.get(k..k + 8)?.try_into().ok()?;
        Some(u64::from_le_bytes(bytes))
    }
}

/// Walks one heap's chunks from `first` to `end` (`top` for the arena's
/// current heap: the walk must land on it); returns the in-use chunks or
/// why the walk broke.
fn walk_chunks(
    words: &mut Words<'_>,
    first: u64,
    end: u64,
    top: Option<u64>,
    walked: &mut u64,
) -> Result<Vec<Chunk>, String> {
    let mut chunks = Vec::new();
    let mut at = first;
    let mut previous: Option<(u64, u64)> = None;
    loop {
        if Some(at) == top {
            let head = words.get(at + 8).ok_or("top is unreadable")?;
            if let Some(p) = previous.filter(|_| head & PREV_INUSE != 0) {
                chunks.push(Chunk {
                    start: p.0 + 16,
                    size: p.1 - 8,
                });
            }
            return Ok(chunks);
        }
        if at + 16 > end {
            return if top.is_none() {
                Ok(chunks)
            } else {
                Err(format!(
                    "the walk passed the heap's end at {at:#x} without meeting top"
                ))
            };
        }
        let head = words
            .get(at + 8)
            .ok_or_else(|| format!("chunk {at:#x} is unreadable"))?;
        let size = head & !FLAGS;
        if let Some(p) = previous.filter(|_| head & PREV_INUSE != 0) {
            chunks.push(Chunk {
                start: p.0 + 16,
                size: p.1 - 8,
            });
        }
        *walked += 1;
        // The fenceposts closing an older heap: 16 bytes, then 0.
        if top.is_none() && size <= 16 {
            return Ok(chunks);
        }
        if size < MINSIZE || !size.is_multiple_of(16) || at + size > end || head & IS_MMAPPED != 0 {
            return Err(format!("chunk {at:#x} has a bad size field {head:#x}"));
        }
        previous = Some((at, size));
        at += size;
    }
}

/// The chunks of a free list starting at chunk `first` (fastbins link
/// chunks at `fd`, +16).
fn fastbin(words: &mut Words<'_>, layout: &Layout, first: u64, out: &mut HashSet<u64>) {
    let mut chunk = first;
    let mut steps = 0;
    while chunk != 0 && chunk.is_multiple_of(16) && steps < 1 << 20 && out.insert(chunk + 16) {
        let Some(next) = words.get(chunk + 16) else {
            return;
        };
        chunk = layout.reveal(chunk + 16, next);
        steps += 1;
    }
}

/// The blocks of a tcache structure's lists, when `chunk` has the shape of
/// one (counts agree with the entries, entries are aligned).
fn tcache(
    memory: &mut dyn Memory,
    layout: &Layout,
    chunk: &Chunk,
    free: &mut HashSet<u64>,
) -> bool {
    // (Only arena chunks are asked: mmapped ones join after.)
    if chunk.size + 8 != layout.tcache_chunk() {
        return false;
    }
    let len = chunk.size as usize;
    let mut bytes = vec![0u8; len];
    if memory.read(chunk.start, &mut bytes) < len {
        return false;
    }
    let count_bytes = if layout.tcache_counts_u16 { 2 } else { 1 };
    let counts_len = (count_bytes * TCACHE_BINS) as usize;
    let count = |i: usize| {
        if layout.tcache_counts_u16 {
            u64::from(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]))
        } else {
            u64::from(bytes[i])
        }
    };
    let entry = |i: usize| {
        let at = counts_len + 8 * i;
        u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or([0; 8]))
    };
    let shaped = (0..TCACHE_BINS as usize).all(|i| {
        let (c, e) = (count(i), entry(i));
        (c == 0) == (e == 0) && e % 16 == 0
    });
    if !shaped {
        return false;
    }
    let mut words = Words::new(memory);
    for i in 0..TCACHE_BINS as usize {
        let mut block = entry(i);
        let mut left = count(i);
        while block != 0 && block % 16 == 0 && left > 0 && free.insert(block) {
            let Some(next) = words.get(block) else {
                break;
            };
            block = layout.reveal(block, next);
            left -= 1;
        }
    }
    true
}

/// Whether a mapping is anonymous, writable memory.
fn anonymous(mapping: &Mapping) -> bool {
    mapping.writable
        && mapping.inode == 0
        && mapping
            .path
            .as_deref()
            .and_then(|p| p.to_str())
            .is_none_or(|p| p == "[heap]" || p.starts_with("[anon"))
}

/// Chunks glibc mmapped, in anonymous memory outside the walked heaps: a
/// page starting with a chunk header (`prev_size` 0, `IS_MMAPPED`, whole
/// pages, at least the smallest mmap threshold) whose region starts or
/// ends a mapping or meets another such chunk (the kernel merges
/// neighbouring mappings: a region inside someone else's memory is not
/// taken on its header alone).
fn mmapped_chunks(
    mappings: &[Mapping],
    walked: &[(u64, u64)],
    stacks: &[u64],
    memory: &mut dyn Memory,
) -> Vec<Chunk> {
    let mut found = Vec::new();
    for mapping in mappings.iter().filter(|m| anonymous(m)) {
        let in_walked = walked
            .iter()
            .any(|&(s, e)| s < mapping.end && e > mapping.start);
        let a_stack = stacks
            .iter()
            .any(|&sp| sp >= mapping.start && sp < mapping.end);
        if in_walked || a_stack || mapping.path.is_some() {
            continue;
        }
        // Each page's first 16 bytes, read a batch of pages at a time: one
        // page after a chunk (the next chunk's header is likely there, and
        // the pages of a chunk are never read), twice as many after each
        // batch that found none.
        let mut candidates = Vec::new();
        let mut at = mapping.start;
        let mut headers = vec![0u8; 16 * HEADER_BATCH];
        let mut batch = 1u64;
        while at + PAGE <= mapping.end {
            let pages = ((mapping.end - at) / PAGE).min(batch) as usize;
            let found_before = candidates.len();
            let ranges: Vec<(u64, usize)> =
                (0..pages).map(|k| (at + k as u64 * PAGE, 16)).collect();
            memory.read_many(&ranges, &mut headers[..16 * pages]);
            let batch_end = at + pages as u64 * PAGE;
            while at < batch_end {
                let k = ((at - ranges[0].0) / PAGE) as usize * 16;
                let word = |o: usize| {
                    u64::from_le_bytes(headers[k + o..k + o + 8].try_into().unwrap_or([0; 8]))
                };
                let (prev, head) = (word(0), word(8));
                let size = head & !FLAGS;
                if prev == 0
                    && head & IS_MMAPPED != 0
                    && size.is_multiple_of(PAGE)
                    && size >= MMAP_MIN
                    && at + size <= mapping.end
                {
                    candidates.push((at, size));
                    at += size;
                    break;
                } else {
                    at += PAGE;
                }
            }
            batch = if candidates.len() > found_before {
                1
            } else {
                (batch * 2).min(HEADER_BATCH as u64)
            };
        }
        for (k, &(start, size)) in candidates.iter().enumerate() {
            let end = start + size;
            let meets = start == mapping.start
                || end == mapping.end
                || (k > 0 && candidates[k - 1].0 + candidates[k - 1].1 == start)
                || candidates.get(k + 1).is_some_and(|n| n.0 == end);
            if meets {
                found.push(Chunk {
                    start: start + 16,
                    size: size - 16,
                });
            }
        }
    }
    found
}

/// Walks the heap of a stopped process: `libc` is its libc's file image
/// (for the version), `stacks` its threads' stack pointers, `symbol`
/// `main_arena`'s address from libc's debug file, if installed.
pub fn walk(
    mappings: &[Mapping],
    libc: &[u8],
    stacks: &[u64],
    symbol: Option<u64>,
    memory: &mut dyn Memory,
) -> Result<HeapWalk, String> {
    let version = glibc_version(libc).ok_or("no glibc version banner in libc.so.6")?;
    let layout = Layout::of(version)?;
    let MainArena { bins, found_by, .. } = glibc_heap::find_main_arena(mappings, memory, symbol)
        .ok_or("glibc's main_arena was not found in libc's data")?;
    let arena = bins - layout.bins_offset();
    let mut walk = HeapWalk {
        layout: Some(layout),
        main_arena_from: Some(found_by),
        ..HeapWalk::default()
    };
    let header = bins - arena;
    let heap_mapping = mappings
        .iter()
        .find(|m| m.path.as_deref() == Some(std::path::Path::new("[heap]")));
    let mut free: HashSet<u64> = HashSet::new();
    let mut chunks = Vec::new();
    let mut current = arena;
    let mut seen = HashSet::new();
    while seen.insert(current) && seen.len() <= MAX_ARENAS {
        walk.arenas += 1;
        let mut words = Words::new(memory);
        let field = |words: &mut Words<'_>, offset: u64| words.get(current + offset);
        let mutex = field(&mut words, 0).map(|w| w & 0xffff_ffff);
        let top = field(&mut words, header - 16);
        let next = field(&mut words, header + 254 * 8 + 16);
        let (Some(mutex), Some(top), Some(next)) = (mutex, top, next) else {
            walk.partial
                .push(format!("arena {current:#x} is unreadable"));
            break;
        };
        let arena_walk = if mutex != 0 {
            walk.locked = true;
            Err(format!(
                "arena {current:#x} is locked (a thread was stopped inside malloc)"
            ))
        } else if current == arena {
            match heap_mapping {
                Some(heap) if top >= heap.start && top < heap.end => walk_chunks(
                    &mut words,
                    heap.start,
                    heap.end,
                    Some(top),
                    &mut walk.chunks_walked,
                )
                .map(|c| (c, vec![(heap.start, heap.end)])),
                Some(_) => Err(
                    "main_arena's top is outside [heap] (a non-contiguous main arena)".to_string(),
                ),
                None => Ok((Vec::new(), Vec::new())),
            }
        } else {
            walk_arena_heaps(&mut words, &layout, current, top, &mut walk.chunks_walked)
        };
        match arena_walk {
            Ok((found, extents)) => {
                walk.arenas_walked += 1;
                // (the main arena's millions of chunks are moved, not copied)
                if chunks.is_empty() {
                    chunks = found;
                } else {
                    chunks.extend(found);
                }
                walk.walked.extend(extents);
                for k in 0..10 {
                    if let Some(first) = words.get(current + header - 96 + 8 * k) {
                        fastbin(&mut words, &layout, first, &mut free);
                    }
                }
            }
            Err(reason) => walk.partial.push(reason),
        }
        current = next;
    }
    // Filtered in place, each set looked up only when it holds something
    // (10M chunks: copies and look-ups were a third of the walk).
    let mut in_use = chunks;
    drop_listed(&mut in_use, free);
    // The tcache structures: each thread's, in its arena's heap.
    let mut tcache_free = HashSet::new();
    for chunk in &in_use {
        if tcache(memory, &layout, chunk, &mut tcache_free) {
            walk.metadata
                .push((chunk.start - 16, chunk.start + chunk.size));
        }
    }
    let metadata: HashSet<u64> = walk.metadata.iter().map(|m| m.0 + 16).collect();
    tcache_free.extend(metadata);
    drop_listed(&mut in_use, tcache_free);
    walk.chunks = in_use;
    let mut mmapped = mmapped_chunks(mappings, &walk.walked, stacks, memory);
    // glibc's own count: fewer found and the others stay roots (never
    // judged); more found and some header fooled the search, so none of
    // them is judged.
    walk.mmapped_glibc = glibc_heap::mmap_counts(mappings, memory).map(|(n, _)| n);
    match walk.mmapped_glibc {
        Some(n) if (mmapped.len() as u64) < n => walk.partial.push(format!(
            "{} of glibc's {n} mmapped chunks were found (mp_.n_mmaps): the others stay roots",
            mmapped.len()
        )),
        Some(n) if mmapped.len() as u64 > n => {
            walk.partial.push(format!(
                "{} mmapped chunks were found where glibc counts {n} (mp_.n_mmaps): none of them is judged",
                mmapped.len()
            ));
            mmapped.clear();
        }
        _ => {}
    }
    walk.mmapped_chunks = mmapped.len() as u64;
    for chunk in &mmapped {
        walk.walked
            .push((chunk.start - 16, chunk.start + chunk.size));
    }
    walk.chunks.extend(mmapped);
    walk.chunks.sort_unstable_by_key(|c| c.start);
    walk.walked.sort_unstable();
    Ok(walk)
}

/// Drops the chunks starting at a listed address, in place. The list is
/// sorted and searched only for chunks within its span (10M chunks and a
/// few hundred listed: a hash lookup each was a tenth of the walk).
fn drop_listed(chunks: &mut Vec<Chunk>, listed: HashSet<u64>) {
    let mut listed: Vec<u64> = listed.into_iter().collect();
    listed.sort_unstable();
    let (Some(&low), Some(&high)) = (listed.first(), listed.last()) else {
        return;
    };
    chunks.retain(|c| c.start < low || c.start > high || listed.binary_search(&c.start).is_err());
}

/// A non-main arena's heaps, newest (holding `top`) first, each walked.
#[allow(clippy::type_complexity)]
fn walk_arena_heaps(
    words: &mut Words<'_>,
    layout: &Layout,
    arena: u64,
    top: u64,
    walked: &mut u64,
) -> Result<(Vec<Chunk>, Vec<(u64, u64)>), String> {
    let mut chunks = Vec::new();
    let mut extents = Vec::new();
    let mut heap = top & !(HEAP_MAX_SIZE - 1);
    let mut newest = true;
    let mut steps = 0;
    while heap != 0 && steps < 1024 {
        steps += 1;
        let owner = words.get(heap).ok_or("a heap_info is unreadable")?;
        let prev = words.get(heap + 8).ok_or("a heap_info is unreadable")?;
        let size = words.get(heap + 16).ok_or("a heap_info is unreadable")?;
        if owner != arena || size > HEAP_MAX_SIZE || size % PAGE != 0 {
            return Err(format!(
                "heap {heap:#x} of arena {arena:#x} has a bad heap_info"
            ));
        }
        // The arena's first heap holds the arena itself after heap_info.
        let first = if heap + layout.heap_info == arena {
            (arena + layout.malloc_state).next_multiple_of(16)
        } else {
            heap + layout.heap_info
        };
        let found = walk_chunks(words, first, heap + size, newest.then_some(top), walked)?;
        chunks.extend(found);
        extents.push((heap, heap + size));
        newest = false;
        heap = prev;
    }
    Ok((chunks, extents))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_the_banner_and_unknown_ones_refused() {
        let banner =
            b"\0GNU C Library (Debian GLIBC 2.36-9+deb12u4) stable release version 2.36.\n";
        assert_eq!(glibc_version(banner), Some((2, 36)));
        assert_eq!(glibc_version(b"nothing"), None);
        let layout = Layout::of((2, 31)).expect("2.31 is known");
        assert!(!layout.safe_linking && layout.tcache_counts_u16);
        assert_eq!(layout.tcache_chunk(), 0x290);
        assert_eq!(Layout::of((2, 27)).map(|l| l.tcache_chunk()), Ok(0x250));
        assert!(Layout::of((2, 42)).is_err());
        assert!(Layout::of((2, 25)).is_err());
        if let Ok(libc) = std::fs::read("/lib/x86_64-linux-gnu/libc.so.6") {
            let version = glibc_version(&libc).expect("the host's libc has a banner");
            assert_eq!(version.0, 2);
        }
    }

    /// Words at addresses; the rest reads as zeros.
    struct Fake(std::collections::BTreeMap<u64, u64>);

    impl Memory for Fake {
        fn read(&mut self, addr: u64, buf: &mut [u8]) -> usize {
            buf.fill(0);
            for (k, chunk) in buf.chunks_exact_mut(8).enumerate() {
                if let Some(v) = self.0.get(&(addr + 8 * k as u64)) {
                    chunk.copy_from_slice(&v.to_le_bytes());
                }
            }
            buf.len()
        }
    }

    #[test]
    fn mmapped_chunks_are_taken_only_at_a_mapping_edge_or_beside_another() {
        let maps = crate::tracee::maps::parse("7f0000000000-7f0000800000 rw-p 00000000 00:00 0\n");
        let base = 0x7f00_0000_0000u64;
        let mut words = std::collections::BTreeMap::new();
        // At the mapping's start, 256 KiB; right after it, 128 KiB; in the
        // middle of the rest, alone, a header-like page: not taken.
        words.insert(base + 8, 0x4_0000 | IS_MMAPPED);
        words.insert(base + 0x4_0000 + 8, 0x2_0000 | IS_MMAPPED);
        words.insert(base + 0x40_0000 + 8, 0x2_0000 | IS_MMAPPED);
        let found = mmapped_chunks(&maps, &[], &[], &mut Fake(words));
        assert_eq!(
            found,
            vec![
                Chunk {
                    start: base + 16,
                    size: 0x4_0000 - 16
                },
                Chunk {
                    start: base + 0x4_0000 + 16,
                    size: 0x2_0000 - 16
                },
            ]
        );
    }

    /// [`Fake`], counting its reads and the bytes they asked for.
    struct Counted(Fake, u64, u64);

    impl Memory for Counted {
        fn read(&mut self, addr: u64, buf: &mut [u8]) -> usize {
            self.1 += 1;
            self.2 += buf.len() as u64;
            self.0.read(addr, buf)
        }
    }

    /// A heap of `count` chunks of `size` bytes from `base`, then top.
    fn heap_of(base: u64, count: u64, size: u64) -> (Counted, u64) {
        let mut words = std::collections::BTreeMap::new();
        for k in 0..count {
            words.insert(base + k * size + 8, size | PREV_INUSE);
        }
        let top = base + count * size;
        words.insert(top + 8, 0x1000 | PREV_INUSE);
        (Counted(Fake(words), 0, 0), top)
    }

    /// Walks [`heap_of`]'s heap: its chunks, and how many were stepped over.
    fn walk_heap(memory: &mut Counted, base: u64, top: u64) -> (Vec<Chunk>, u64) {
        let mut walked = 0;
        let chunks = walk_chunks(
            &mut Words::new(memory),
            base,
            top + 0x1000,
            Some(top),
            &mut walked,
        )
        .expect("a well-formed heap");
        (chunks, walked)
    }

    #[test]
    fn the_walk_reads_big_chunks_by_their_headers_and_small_ones_in_windows() {
        let base = 0x5555_0000_0000u64;
        // 100 chunks of 64 KiB: a page read for each header, not the heap.
        let (mut memory, top) = heap_of(base, 100, 0x1_0000);
        let (chunks, walked) = walk_heap(&mut memory, base, top);
        assert_eq!((chunks.len(), walked), (100, 100));
        // (and one for top)
        assert!(
            memory.2 <= 101 * WINDOW_MIN as u64,
            "{} bytes read",
            memory.2
        );
        // 100k chunks of 32 bytes: windows grow to a megabyte.
        let (mut memory, top) = heap_of(base, 100_000, 32);
        let (chunks, _) = walk_heap(&mut memory, base, top);
        assert_eq!(chunks.len(), 100_000);
        assert!(chunks.iter().all(|c| c.size == 24));
        assert!(memory.1 <= 12, "{} reads", memory.1);
    }

    #[test]
    fn safe_linking_is_revealed_by_the_link_address() {
        let layout = Layout::of((2, 36)).expect("known");
        let at = 0x5555_5555_9010u64;
        let target = 0x5555_5555_a000u64;
        assert_eq!(layout.reveal(at, (at >> 12) ^ target), target);
        let old = Layout::of((2, 31)).expect("known");
        assert_eq!(old.reveal(at, target), target);
    }
}
