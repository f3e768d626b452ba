//! What of a stopped process's memory is glibc's allocator's own, found
//! from outside through the chunk headers of the blocks memtrace tracked
//! and the empty bins of `main_arena`. The leak check takes none of it as
//! a root: the arena's chunk pointers point at chunk headers, which lie in
//! the last bytes of the block before (a false interior pointer), and a
//! heap's free chunks keep stale pointers.
//!
//! - [`heap_extents`]: the parts of anonymous memory that are glibc heaps
//!   (`[heap]`, each non-main arena's heap from its `heap_info`, each
//!   mmapped chunk from its header), never a whole mapping on a guess: the
//!   kernel merges neighbouring anonymous mappings, so one mapping can
//!   hold a glibc chunk beside a Python arena or a thread's stack.
//! - [`main_arena_pointers`]: the words of `main_arena` that point at
//!   chunks (`fastbinsY`, `top`, `last_remainder`, `bins`). `main_arena`
//!   is found by its symbol in libc's debug file when one is installed for
//!   that very build (`trace::before_attach::main_arena_symbol`), else without symbols the way
//!   chap does: empty bins point at themselves. Either way the arena is
//!   validated (`top` in a heap or the initial top, `next` the arena itself
//!   or another in a heap).
//!
//! Layouts (glibc 2.26 to 2.41, 64-bit): a chunk header is `prev_size`,
//! `size` (flags in its low bits: 1 `PREV_INUSE`, 2 `IS_MMAPPED`, 4
//! `NON_MAIN_ARENA`) before the block; `heap_info` is `ar_ptr`, `prev`,
//! `size`, `mprotect_size` at a heap's start, heaps aligned to
//! `HEAP_MAX_SIZE` (64 MiB); `malloc_state` has `fastbinsY[10]`, `top`,
//! `last_remainder`, `bins[254]` in a row.

use crate::reach::Memory;
use crate::tracee::maps::Mapping;

const IS_MMAPPED: u64 = 2;
const NON_MAIN_ARENA: u64 = 4;
const FLAGS: u64 = 7;
/// A non-main heap's alignment and largest size (64-bit glibc).
const HEAP_MAX_SIZE: u64 = 64 << 20;
const PAGE: u64 = 4096;
/// `bins[]` of `malloc_state`: 127 pairs of chunk pointers.
const BINS_BYTES: u64 = 254 * 8;
/// `fastbinsY[10]`, `top` and `last_remainder`, just before `bins`.
const BEFORE_BINS: u64 = 12 * 8;

fn word(memory: &mut dyn Memory, addr: u64) -> Option<u64> {
    let mut bytes = [0u8; 8];
    (memory.read(addr, &mut bytes) == 8).then(|| u64::from_le_bytes(bytes))
}

/// Whether a mapping is anonymous memory (where an allocator's heaps are).
fn anonymous(mapping: &Mapping) -> bool {
    mapping.inode == 0
        && mapping
            .path
            .as_deref()
            .and_then(|p| p.to_str())
            .is_none_or(|p| p == "[heap]" || p.starts_with("[anon"))
}

/// The extent of the glibc chunk holding block `[start, end)`: its mmapped
/// region, or its non-main arena's heap; `None` for a main-arena chunk
/// outside `[heap]` or memory that is not a glibc chunk.
fn chunk_extent(
    memory: &mut dyn Memory,
    mapping: &Mapping,
    start: u64,
    end: u64,
) -> Option<(u64, u64)> {
    let header = start.checked_sub(16)?;
    let prev_size = word(memory, header)?;
    let size = word(memory, header + 8)?;
    let chunk = size & !FLAGS;
    if size & IS_MMAPPED != 0 {
        // An mmapped chunk: its own mapping, `prev_size` bytes of
        // alignment slack before it.
        let base = header.checked_sub(prev_size)?;
        let len = prev_size.checked_add(chunk)?;
        let fits = base >= mapping.start && base.checked_add(len)? <= mapping.end;
        return (base % PAGE == 0 && len % PAGE == 0 && fits && header + chunk >= end)
            .then_some((base, base + len));
    }
    if size & NON_MAIN_ARENA == 0 || chunk < end - header {
        return None;
    }
    let heap = header & !(HEAP_MAX_SIZE - 1);
    let heap_size = word(memory, heap + 16)?;
    let valid = heap >= mapping.start
        && heap_size <= HEAP_MAX_SIZE
        && heap_size % PAGE == 0
        && heap + heap_size >= end
        && heap + heap_size <= mapping.end;
    valid.then_some((heap, heap + heap_size))
}

/// The glibc heaps in anonymous memory, as sorted, disjoint ranges:
/// `[heap]` whole, and around each tracked block (`nodes`: sorted by
/// start, disjoint) its mmapped chunk or its arena's heap. A block glibc's
/// headers do not explain adds nothing (its memory stays a root but for
/// the block itself).
pub fn heap_extents(
    mappings: &[Mapping],
    nodes: &[(u64, u64)],
    memory: &mut dyn Memory,
) -> Vec<(u64, u64)> {
    let mut extents = Vec::new();
    for mapping in mappings.iter().filter(|m| anonymous(m) && m.writable) {
        if mapping.path.as_deref() == Some(std::path::Path::new("[heap]")) {
            extents.push((mapping.start, mapping.end));
            continue;
        }
        let first = nodes.partition_point(|&(start, _)| start < mapping.start);
        let mut covered_to = mapping.start;
        for &(start, end) in &nodes[first..] {
            if start >= mapping.end {
                break;
            }
            if end <= covered_to {
                continue;
            }
            if let Some(extent) = chunk_extent(memory, mapping, start, end) {
                covered_to = covered_to.max(extent.1);
                extents.push(extent);
            }
        }
    }
    extents.sort_unstable();
    extents.dedup();
    extents
}

/// Where `main_arena` is: its start and its `bins[0]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MainArena {
    pub arena: u64,
    pub bins: u64,
    /// How it was found: `debug symbols` or `empty bins`.
    pub found_by: &'static str,
}

/// glibc's own count of its mmapped chunks and their bytes (`mp_.n_mmaps`,
/// `mp_.mmapped_mem`), read from `mp_`, which is found by its `sbrk_base`
/// (the start of `[heap]`) in libc's data. Before `sbrk_base` come
/// `mmapped_mem`, `max_mmapped_mem` and, before them, the ints `n_mmaps`,
/// `n_mmaps_max`, `max_n_mmaps`, `no_dyn_threshold`: right before (2.26 to
/// 2.34) or 4 bytes earlier with 4 of padding after (2.35+, where the int
/// `hp_flags` comes first). `None` without `[heap]`, or unless exactly one
/// place reads as `mp_`.
pub fn mmap_counts(mappings: &[Mapping], memory: &mut dyn Memory) -> Option<(u64, u64)> {
    let heap = mappings
        .iter()
        .find(|m| m.path.as_deref() == Some(std::path::Path::new("[heap]")))?;
    let mut found = None;
    for mapping in mappings
        .iter()
        .filter(|m| m.writable && m.is_file() && is_libc(m))
    {
        let len = (mapping.end - mapping.start).min(1 << 20) as usize;
        let mut bytes = vec![0u8; len];
        let read = memory.read(mapping.start, &mut bytes) & !7;
        let word = |k: usize| u64::from_le_bytes(bytes[k..k + 8].try_into().unwrap_or([0; 8]));
        let int = |k: usize| {
            u64::from(u32::from_le_bytes(
                bytes[k..k + 4].try_into().unwrap_or([0; 4]),
            ))
        };
        for at in (40..read).step_by(8) {
            if word(at) != heap.start {
                continue;
            }
            let (mmapped, max_mmapped) = (word(at - 16), word(at - 8));
            // The ints' first offset before `sbrk_base`, and the padding.
            for (first, padded) in [(32, false), (36, true)] {
                let ints = at - first;
                let (n_mmaps, n_mmaps_max, max_n_mmaps) = (int(ints), int(ints + 4), int(ints + 8));
                let plausible = n_mmaps <= max_n_mmaps
                    && n_mmaps_max > 0
                    && (!padded || int(at - 20) == 0)
                    && mmapped <= max_mmapped
                    && mmapped.is_multiple_of(PAGE)
                    && (n_mmaps == 0) == (mmapped == 0)
                    && mmapped >= n_mmaps * PAGE;
                if plausible {
                    if found.is_some() {
                        return None;
                    }
                    found = Some((n_mmaps, mmapped));
                }
            }
        }
    }
    found
}

/// Whether a mapping is of glibc's libc.
pub fn is_libc(mapping: &Mapping) -> bool {
    mapping
        .path
        .as_deref()
        .and_then(|p| p.file_name())
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("libc.so") || n.starts_with("libc-2."))
}

/// The words of `main_arena` that point at chunks (`fastbinsY`, `top`,
/// `last_remainder`, `bins`), as one range; `None` when no glibc arena is
/// found in a writable mapping of libc.
pub fn main_arena_pointers(
    mappings: &[Mapping],
    memory: &mut dyn Memory,
    symbol: Option<u64>,
) -> Option<(u64, u64)> {
    find_main_arena(mappings, memory, symbol)
        .map(|found| (found.bins - BEFORE_BINS, found.bins + BINS_BYTES))
}

/// Finds `main_arena`: at `symbol` (from a debug file) when the arena
/// there is valid, else in a writable mapping of libc by its empty bins.
pub fn find_main_arena(
    mappings: &[Mapping],
    memory: &mut dyn Memory,
    symbol: Option<u64>,
) -> Option<MainArena> {
    if let Some(arena) = symbol {
        // `bins` 112 bytes in (2.27+), 104 in 2.26.
        for bins in [arena + 112, arena + 104] {
            let top = word(memory, bins - 16);
            let next = word(memory, bins + BINS_BYTES + 16);
            if let (Some(top), Some(next)) = (top, next) {
                if valid_arena(mappings, bins, top, next).is_some() {
                    return Some(MainArena {
                        arena,
                        bins,
                        found_by: "debug symbols",
                    });
                }
            }
        }
        log::debug!("main_arena at {arena:#x} (its debug symbol) does not look like an arena");
    }
    for mapping in mappings
        .iter()
        .filter(|m| m.writable && m.is_file() && is_libc(m))
    {
        let len = (mapping.end - mapping.start).min(1 << 20) as usize;
        let mut bytes = vec![0u8; len];
        let read = memory.read(mapping.start, &mut bytes);
        let words: Vec<u64> = bytes[..read & !7]
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
            .collect();
        if let Some(found) = find_bins(&words, mapping.start, mappings) {
            return Some(found);
        }
    }
    None
}

/// The address of `bins[0]` of a `malloc_state` among `words` (read at
/// `base`): the longest run of empty bins (both words pointing 16 bytes
/// before themselves), placed so that `top` is the initial top (the
/// unsorted bin) or points into anonymous memory.
fn find_bins(words: &[u64], base: u64, mappings: &[Mapping]) -> Option<MainArena> {
    let at = |k: usize| base + 8 * k as u64;
    let empty: Vec<u64> = (0..words.len().saturating_sub(1))
        .filter(|&k| words[k] == at(k).wrapping_sub(16) && words[k + 1] == words[k])
        .map(at)
        .collect();
    // Clusters of empty bins 16 bytes apart (a multiple), within one array.
    let mut best: Option<(usize, u64, u64)> = None;
    let mut i = 0;
    while i < empty.len() {
        let mut j = i;
        while j + 1 < empty.len()
            && empty[j + 1] - empty[i] < BINS_BYTES
            && (empty[j + 1] - empty[i]).is_multiple_of(16)
        {
            j += 1;
        }
        let count = j - i + 1;
        if best.is_none_or(|b| count > b.0) {
            best = Some((count, empty[i], empty[j]));
        }
        i = j + 1;
    }
    let (count, first, last) = best?;
    // A real arena has most of its 127 bins empty at any time.
    if count < 16 {
        return None;
    }
    let word_at = |addr: u64| {
        let k = addr.checked_sub(base)? / 8;
        words.get(k as usize).copied()
    };
    // bins[0] lies at most 126 pairs before the last empty bin (the last
    // bin, for the largest chunks, is nearly always empty: tried first),
    // and at or before the first. `top` (just before `bins`) is the
    // initial top or a heap chunk; `next` (after `bins` and the 16-byte
    // `binmap`) is the arena itself (2.27+: 112 bytes before `bins`; 2.26:
    // 104) or another arena, in a heap.
    let lowest = last
        .saturating_sub(BINS_BYTES - 16)
        .max(base + BEFORE_BINS + 16);
    // The arena's own start: where a lone arena's `next` points; with
    // several arenas, told by the word after mutex and flags (2.27+:
    // `have_fastchunks`, 0 or 1).
    let valid = |bins: u64| -> Option<MainArena> {
        let top = word_at(bins - 16)?;
        let next = word_at(bins + BINS_BYTES + 16)?;
        let arena = match valid_arena(mappings, bins, top, next)? {
            Some(arena) => arena,
            None if word_at(bins - 104)? <= 1 => bins - 112,
            None => bins - 104,
        };
        Some(MainArena {
            arena,
            bins,
            found_by: "empty bins",
        })
    };
    std::iter::once(lowest)
        .chain(
            (0..)
                .map(|k| first.wrapping_sub(16 * k))
                .take_while(|&c| c >= lowest),
        )
        .filter(|&c| c <= first && (first - c) % 16 == 0)
        .find_map(valid)
}

/// Whether an arena whose `bins` start at `bins` (with `top` just before
/// and `next` after the bins and the binmap) is plausible: `top` is the
/// initial top or in a heap; `next` is the arena itself (then its start,
/// `Some(Some(arena))`) or another arena in a heap (`Some(None)`).
fn valid_arena(mappings: &[Mapping], bins: u64, top: u64, next: u64) -> Option<Option<u64>> {
    let heap_like = |p: u64| {
        mappings
            .iter()
            .any(|m| p >= m.start && p < m.end && m.writable && anonymous(m))
    };
    if !(top == bins - 16 || heap_like(top)) {
        return None;
    }
    if next == bins - 112 || next == bins - 104 {
        Some(Some(next))
    } else if heap_like(next) {
        Some(None)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::tracee::maps::parse;

    #[derive(Default)]
    struct Fake {
        words: BTreeMap<u64, u64>,
    }

    impl Memory for Fake {
        fn read(&mut self, addr: u64, buf: &mut [u8]) -> usize {
            buf.fill(0);
            for (k, chunk) in buf.chunks_exact_mut(8).enumerate() {
                if let Some(v) = self.words.get(&(addr + 8 * k as u64)) {
                    chunk.copy_from_slice(&v.to_le_bytes());
                }
            }
            buf.len()
        }
    }

    const MAPS: &str = "\
55550000000-55550021000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000200000 rw-p 00000000 00:00 0
7f0004000000-7f0004100000 rw-p 00000000 00:00 0
7f1000000000-7f1000004000 rw-p 001d3000 08:01 9 /usr/lib/x86_64-linux-gnu/libc.so.6
";

    #[test]
    fn an_mmapped_chunk_is_excluded_alone_not_its_merged_neighbours() {
        let maps = parse(MAPS);
        let mut m = Fake::default();
        // A 256 KiB mmapped chunk at +1 MiB of a 2 MiB mapping that also
        // holds (merged) some other program's memory.
        let chunk = 0x7f00_0010_0000u64;
        m.words.insert(chunk, 0);
        m.words.insert(chunk + 8, 0x4_1000 | IS_MMAPPED);
        let block = (chunk + 16, chunk + 16 + 0x4_0000);
        // A non-main heap at 0x7f0004000000 of 0x21000 bytes in use.
        let heap = 0x7f00_0400_0000u64;
        m.words.insert(heap + 16, 0x2_1000);
        let small = heap + 0x900;
        m.words.insert(small - 8, 0x30 | NON_MAIN_ARENA | 1);
        let extents = heap_extents(&maps, &[block, (small, small + 0x20)], &mut m);
        assert_eq!(
            extents,
            vec![
                (0x0555_5000_0000, 0x0555_5002_1000),
                (chunk, chunk + 0x4_1000),
                (heap, heap + 0x2_1000),
            ]
        );
        // A block glibc's headers do not explain: nothing beyond it.
        let mut bare = Fake::default();
        let extents = heap_extents(&maps, &[(chunk + 16, chunk + 64)], &mut bare);
        assert_eq!(extents, vec![(0x0555_5000_0000, 0x0555_5002_1000)]);
    }

    #[test]
    fn glibc_counts_its_mmapped_chunks_in_mp() {
        let maps = parse(MAPS);
        let heap = maps
            .iter()
            .find(|m| m.path.as_deref() == Some(std::path::Path::new("[heap]")))
            .expect("[heap]")
            .start;
        let libc = 0x7f10_0000_0000u64;
        let mut m = Fake::default();
        let sbrk_base = libc + 0x2400;
        // n_mmaps 2, n_mmaps_max 65536; max_n_mmaps 3; 2 chunks of 2 pages.
        m.words.insert(sbrk_base - 32, 2 | (65_536 << 32));
        m.words.insert(sbrk_base - 24, 3);
        m.words.insert(sbrk_base - 16, 4 * 4096);
        m.words.insert(sbrk_base - 8, 6 * 4096);
        m.words.insert(sbrk_base, heap);
        assert_eq!(mmap_counts(&maps, &mut m), Some((2, 4 * 4096)));
        // 2.35+ (as read from a live glibc 2.36): hp_flags, then the ints,
        // then 4 bytes of padding.
        let mut new = Fake::default();
        new.words.insert(sbrk_base - 40, 2 << 32);
        new.words.insert(sbrk_base - 32, 65_536 | (2 << 32));
        new.words.insert(sbrk_base - 24, 0);
        new.words.insert(sbrk_base - 16, 0xac000);
        new.words.insert(sbrk_base - 8, 0xac000);
        new.words.insert(sbrk_base, heap);
        assert_eq!(mmap_counts(&maps, &mut new), Some((2, 0xac000)));
        // A word equal to the heap's start that is no `mp_`: not taken.
        m.words.insert(libc + 0x100, heap);
        assert_eq!(mmap_counts(&maps, &mut m), Some((2, 4 * 4096)));
        // Two that read as `mp_`: none is trusted.
        for (k, v) in [
            (-32i64, 1 | (65_536 << 32)),
            (-24, 1),
            (-16, 4096),
            (-8, 4096),
            (0, heap),
        ] {
            m.words.insert((libc + 0x800).wrapping_add_signed(k), v);
        }
        assert_eq!(mmap_counts(&maps, &mut m), None);
    }

    #[test]
    fn main_arena_is_found_by_its_empty_bins() {
        let maps = parse(MAPS);
        let mut m = Fake::default();
        let libc = 0x7f10_0000_0000u64;
        let bins = libc + 0x1c80;
        for pair in 0..127u64 {
            let at = bins + 16 * pair;
            // A few bins hold chunks; the rest point at themselves.
            let value = if pair % 9 == 3 {
                0x0555_5000_1000
            } else {
                at - 16
            };
            m.words.insert(at, value);
            m.words.insert(at + 8, value);
        }
        // top points into [heap]; next is the arena itself.
        m.words.insert(bins - 16, 0x0555_5002_0000);
        m.words.insert(bins + BINS_BYTES + 16, bins - 112);
        assert_eq!(
            main_arena_pointers(&maps, &mut m, None),
            Some((bins - BEFORE_BINS, bins + BINS_BYTES))
        );
        // Its debug symbol, when right, finds it as well; when wrong, the
        // empty bins still do.
        let by_symbol = find_main_arena(&maps, &mut m, Some(bins - 112)).expect("found");
        assert_eq!(
            (by_symbol.bins, by_symbol.found_by),
            (bins, "debug symbols")
        );
        let wrong = find_main_arena(&maps, &mut m, Some(libc + 0x40)).expect("found");
        assert_eq!((wrong.bins, wrong.found_by), (bins, "empty bins"));
        // No arena: nothing.
        assert_eq!(main_arena_pointers(&maps, &mut Fake::default(), None), None);
    }
}
