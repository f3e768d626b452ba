//! Which memory of a stopped process is a root of the leak check: every
//! readable, writable mapping (the writable segments of each mapped object,
//! anonymous memory, shared memory, TLS), each thread's stack from its stack
//! pointer up, less the tracked blocks themselves (they are the nodes,
//! scanned only when reached) and what the caller excludes as the
//! allocator's own memory ([`super::glibc_heap`]): `main_arena`'s chunk
//! pointers always, and when memtrace saw every allocation of the process
//! (launch mode, nothing lost or filtered) the heaps too: their free
//! chunks hold stale pointers, and every live block in them is a node.
//! Otherwise (attached by pid) the heap stays a root: blocks allocated
//! before the attach live there, and may hold the only pointers to newer
//! ones.
//!
//! Memory of a GPU/NPU runtime's own libraries (their writable segments) is
//! marked runtime-owned: a real driver keeps every allocation's address in
//! its tables, which must not keep a device block "reachable".

use std::path::Path;

use super::maps::Mapping;
use crate::reach::RootRegion;

/// What decides the roots besides the mappings.
pub struct RootOptions<'a> {
    /// The lowest live stack address of each stopped thread (its stack
    /// pointer, less the red zone where it may be in use).
    pub stack_starts: &'a [u64],
    /// Allocator memory that is no root (sorted or not; may overlap).
    pub excluded: &'a [(u64, u64)],
    /// Start and end of every scanned node (host blocks), sorted.
    pub nodes: &'a [(u64, u64)],
    /// Whether a mapped file is a GPU/NPU runtime library.
    pub runtime_library: &'a dyn Fn(&Path) -> bool,
}

/// Pseudo-files and devices never read: kernel pages, and device memory
/// that reading could disturb (GPU apertures).
fn never_read(mapping: &Mapping) -> bool {
    match mapping.path.as_deref().and_then(Path::to_str) {
        Some(p) if p.starts_with('[') => {
            !matches!(p, "[heap]" | "[stack]") && !p.starts_with("[anon")
        }
        Some(p) if p.starts_with("/dev/") => !(p == "/dev/zero" || p.starts_with("/dev/shm/")),
        _ => false,
    }
}

/// The root regions of a stopped process.
pub fn roots(mappings: &[Mapping], options: &RootOptions<'_>) -> Vec<RootRegion> {
    debug_assert!(options.nodes.is_sorted(), "nodes sorted by start");
    let mut excluded = options.excluded.to_vec();
    excluded.sort_unstable();
    let nodes = merged(options.nodes, &excluded);
    let mut regions = Vec::new();
    for mapping in mappings {
        if !(mapping.readable && mapping.writable) || never_read(mapping) {
            continue;
        }
        // A thread's stack: from its stack pointer up (the lowest, when
        // several threads' pointers fall in one mapping).
        let start = options
            .stack_starts
            .iter()
            .filter(|&&sp| sp >= mapping.start && sp < mapping.end)
            .min()
            .map_or(mapping.start, |&sp| (sp & !7).max(mapping.start));
        let runtime_owned = mapping.is_file()
            && mapping
                .path
                .as_deref()
                .is_some_and(|p| (options.runtime_library)(p));
        subtract_nodes(start, mapping.end, &nodes, runtime_owned, &mut regions);
    }
    regions
}

/// The union of two sorted lists of ranges as disjoint ranges, sorted (a
/// pinned host block and the stub runtime's own block at the same address
/// overlap; a walked heap covers its blocks).
fn merged(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let (mut a, mut b) = (a.iter().peekable(), b.iter().peekable());
    loop {
        let next = match (a.peek(), b.peek()) {
            (Some(&&x), Some(&&y)) if x <= y => a.next(),
            (Some(_), Some(_)) => b.next(),
            (Some(_), None) => a.next(),
            (None, _) => b.next(),
        };
        let Some(&(start, end)) = next else {
            return out;
        };
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
}

/// Pushes the parts of `[start, end)` that no node covers (`nodes`
/// disjoint and sorted).
fn subtract_nodes(
    start: u64,
    end: u64,
    nodes: &[(u64, u64)],
    runtime_owned: bool,
    out: &mut Vec<RootRegion>,
) {
    let mut at = start;
    let first = nodes.partition_point(|&(_, node_end)| node_end <= start);
    for &(node_start, node_end) in &nodes[first..] {
        if node_start >= end {
            break;
        }
        if node_start > at {
            out.push(RootRegion {
                start: at,
                len: node_start - at,
                runtime_owned,
            });
        }
        at = at.max(node_end);
        if at >= end {
            return;
        }
    }
    if at < end {
        out.push(RootRegion {
            start: at,
            len: end - at,
            runtime_owned,
        });
    }
}

/// Whether an address may be a vtable's (for the multiple-inheritance
/// heuristic): it lies in a readable, non-writable mapping of a file.
pub fn vtable_predicate(mappings: &[Mapping]) -> impl Fn(u64) -> bool {
    let mut ranges: Vec<(u64, u64)> = mappings
        .iter()
        .filter(|m| m.readable && !m.writable && m.is_file())
        .map(|m| (m.start, m.end))
        .collect();
    ranges.sort_unstable();
    move |addr| {
        let index = ranges.partition_point(|&(start, _)| start <= addr);
        index > 0 && addr < ranges[index - 1].1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracee::maps::parse;

    const MAPS: &str = "\
00400000-00401000 r--p 00000000 08:01 100 /app/prog
00401000-00402000 r-xp 00001000 08:01 100 /app/prog
00402000-00403000 rw-p 00002000 08:01 100 /app/prog
01000000-01100000 rw-p 00000000 00:00 0 [heap]
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
7f0000200000-7f0000300000 rw-p 00000000 00:00 0
7f0000400000-7f0000401000 rw-p 00010000 08:01 200 /usr/lib/libcuda.so.1
7f0000500000-7f0000501000 rw-s 00000000 00:05 300 /dev/nvidiactl
7ffc00000000-7ffc00100000 rw-p 00000000 00:00 0 [stack]
7ffc00200000-7ffc00201000 r--p 00000000 00:00 0 [vvar]
";

    fn regions(
        excluded: &[(u64, u64)],
        sps: &[u64],
        nodes: &[(u64, u64)],
    ) -> Vec<(u64, u64, bool)> {
        let maps = parse(MAPS);
        let cuda = |p: &Path| p.to_string_lossy().contains("libcuda");
        let options = RootOptions {
            stack_starts: sps,
            excluded,
            nodes,
            runtime_library: &cuda,
        };
        roots(&maps, &options)
            .into_iter()
            .map(|r| (r.start, r.start + r.len, r.runtime_owned))
            .collect()
    }

    #[test]
    fn by_pid_every_writable_mapping_is_a_root_less_the_nodes() {
        let nodes = [(0x0100_0010, 0x0100_0020), (0x0100_0018, 0x0100_0040)];
        let got = regions(&[], &[0x7ffc_000f_f000], &nodes);
        assert_eq!(
            got,
            vec![
                (0x402000, 0x403000, false),
                (0x0100_0000, 0x0100_0010, false),
                (0x0100_0040, 0x0110_0000, false),
                (0x7f00_0000_0000, 0x7f00_0010_0000, false),
                (0x7f00_0020_0000, 0x7f00_0030_0000, false),
                (0x7f00_0040_0000, 0x7f00_0040_1000, true),
                (0x7ffc_000f_f000, 0x7ffc_0010_0000, false),
            ]
        );
    }

    #[test]
    fn excluded_allocator_memory_is_no_root() {
        let nodes = [(0x7f00_0020_0010, 0x7f00_0020_0100)];
        let excluded = [
            (0x0100_0000, 0x0110_0000),
            (0x7f00_0020_0000, 0x7f00_0030_0000),
        ];
        let got = regions(&excluded, &[], &nodes);
        assert!(!got.iter().any(|r| r.0 >= 0x0100_0000 && r.0 < 0x0110_0000));
        assert!(!got
            .iter()
            .any(|r| r.0 >= 0x7f00_0020_0000 && r.0 < 0x7f00_0030_0000));
        // Anonymous memory without a block stays a root; the whole stack
        // when no thread's pointer is known.
        assert!(got.contains(&(0x7f00_0000_0000, 0x7f00_0010_0000, false)));
        assert!(got.contains(&(0x7ffc_0000_0000, 0x7ffc_0010_0000, false)));
    }

    #[test]
    fn a_node_covering_a_whole_region_leaves_nothing() {
        let mut out = Vec::new();
        subtract_nodes(100, 200, &merged(&[(50, 300)], &[]), false, &mut out);
        assert!(out.is_empty());
        let nodes = merged(&[(0, 150), (160, 170), (165, 168)], &[(10, 20), (155, 158)]);
        subtract_nodes(100, 200, &nodes, false, &mut out);
        let got: Vec<(u64, u64)> = out.iter().map(|r| (r.start, r.start + r.len)).collect();
        assert_eq!(got, vec![(150, 155), (158, 160), (170, 200)]);
    }

    #[test]
    fn vtables_are_in_read_only_file_mappings() {
        let maps = parse(MAPS);
        let vtable = vtable_predicate(&maps);
        assert!(vtable(0x400010));
        assert!(!vtable(0x402010));
        assert!(!vtable(0x0100_0000));
    }
}
