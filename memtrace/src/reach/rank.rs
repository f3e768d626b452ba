//! Direct lookups in the densest region of disjoint nodes (a heap): which
//! node a word points into, in one cache line, without sorting the words.
//!
//! The region is cut into granules of the largest power of two that every
//! node start there is a multiple of (16 bytes for glibc's chunks); a bit
//! per granule says a node starts there. A 64-byte line holds 192 such
//! bits and the count of starts before it, so the node a word lies in (the
//! last one starting at or before it: the nodes are disjoint) is that
//! count plus a few popcounts, read from one line. Whether the word is
//! inside that node takes its end; whether it is the node's start pointer
//! is the bit of its own granule. A bitmap beside the lines has a bit per
//! granule where a node marked reachable by a start pointer starts
//! ("plainly": nothing that points into it changes anything more): most
//! words of a heap, start pointers to blocks already marked, are done with
//! one bit of it (a bit per 16 bytes: 8 MiB for a 1 GiB heap, where the
//! lines take 11 MiB), their line never read.
//!
//! Lookups come in batches (pass 1's waiting words), so each word's bit,
//! then its line, then its node's data are fetched ahead ([`prefetch`])
//! while earlier words are marked: the misses overlap, and a word costs a few nanoseconds where a
//! radix sort of it and a lookup in address order cost tens.

/// Granules per line (3 words of bits).
const LINE_GRANULES: u64 = 3 * 64;
/// At most this many bytes of lines: 4 bytes per node, at least 1 MiB.
const BYTES_PER_NODE: u64 = 4;
const MIN_BYTES: u64 = 1 << 20;

/// Half a cache line: the count of node starts in earlier lines and a bit
/// per granule where a node starts.
#[repr(C, align(32))]
#[derive(Clone, Copy, Debug, Default)]
struct Line {
    before: u64,
    bits: [u64; 3],
}

/// What [`Rank::lookup`] found for a word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hit {
    /// The start of a plainly reachable node: the word changes nothing.
    Plain,
    /// The last node starting at or before the word, and whether the word
    /// is its start.
    Node { position: u32, start: bool },
}

/// The lines over one region of disjoint nodes.
pub struct Rank {
    /// The region: `[start, end)`, granule 0 at `start`.
    start: u64,
    end: u64,
    shift: u32,
    /// The position (address order) of the region's first node.
    first: u32,
    lines: Vec<Line>,
    /// A bit per granule where a plainly reachable node starts.
    plain: Vec<u64>,
}

impl Rank {
    /// Lines over `starts` (sorted, of disjoint nodes; position `first` is
    /// the first), the region ending at `end`; none when the lines would
    /// cost more than [`BYTES_PER_NODE`] per node.
    pub fn new(
        starts: impl ExactSizeIterator<Item = u64> + Clone,
        first: usize,
        end: u64,
    ) -> Option<Rank> {
        let count = starts.len() as u64;
        let region = starts.clone().next()?;
        let shift = starts
            .clone()
            .fold(0u64, |bits, start| bits | (start - region))
            .trailing_zeros()
            .min(63);
        let granules = ((end.checked_sub(region)?.saturating_sub(1)) >> shift) + 1;
        let lines = granules.div_ceil(LINE_GRANULES);
        let budget = count.saturating_mul(BYTES_PER_NODE).max(MIN_BYTES);
        // Lines of 32 bytes and 24 bytes of the bitmap over as many granules.
        if lines.saturating_mul(32 + 24) > budget {
            return None;
        }
        let mut table = vec![Line::default(); usize::try_from(lines).ok()?];
        for start in starts {
            let granule = (start - region) >> shift;
            let line = &mut table[(granule / LINE_GRANULES) as usize];
            let within = granule % LINE_GRANULES;
            line.bits[(within / 64) as usize] |= 1 << (within % 64);
        }
        let mut before = 0;
        for line in &mut table {
            line.before = before;
            before += line
                .bits
                .iter()
                .map(|w| u64::from(w.count_ones()))
                .sum::<u64>();
        }
        Some(Rank {
            start: region,
            end,
            shift,
            first: u32::try_from(first).ok()?,
            lines: table,
            plain: vec![0; usize::try_from(granules.div_ceil(64)).ok()?],
        })
    }

    /// The region's start and end.
    pub fn region(&self) -> (u64, u64) {
        (self.start, self.end)
    }

    /// Whether `word` lies in the region.
    #[inline(always)]
    pub fn holds(&self, word: u64) -> bool {
        word.wrapping_sub(self.start) < self.end - self.start
    }

    /// Fetches the bit of `word` (in the region) ahead of its lookup.
    #[inline(always)]
    pub fn prefetch_plain(&self, word: u64) {
        let granule = (word - self.start) >> self.shift;
        if let Some(bits) = self.plain.get((granule / 64) as usize) {
            prefetch(bits);
        }
    }

    /// Whether `word` (in the region) is the start of a plainly reachable
    /// node.
    #[inline(always)]
    pub fn plain(&self, word: u64) -> bool {
        let offset = word - self.start;
        let granule = offset >> self.shift;
        offset & ((1 << self.shift) - 1) == 0
            && self
                .plain
                .get((granule / 64) as usize)
                .is_some_and(|bits| bits >> (granule % 64) & 1 != 0)
    }

    /// Fetches the line of `word` (in the region) ahead of its lookup.
    #[inline(always)]
    pub fn prefetch(&self, word: u64) {
        let granule = (word - self.start) >> self.shift;
        if let Some(line) = self.lines.get((granule / LINE_GRANULES) as usize) {
            prefetch(line);
        }
    }

    /// For `word` in the region: a plainly reachable node's start, or the
    /// last node starting at or before it (none: before the first).
    #[inline(always)]
    pub fn lookup(&self, word: u64) -> Option<Hit> {
        if self.plain(word) {
            return Some(Hit::Plain);
        }
        let offset = word - self.start;
        let granule = offset >> self.shift;
        let line = self.lines.get((granule / LINE_GRANULES) as usize)?;
        let within = granule % LINE_GRANULES;
        let (word_index, bit) = ((within / 64) as usize, within % 64);
        let mut count = line.before;
        for bits in &line.bits[..word_index] {
            count += u64::from(bits.count_ones());
        }
        let own = line.bits[word_index];
        count += u64::from((own & (u64::MAX >> (63 - bit))).count_ones());
        let start = own >> bit & 1 != 0 && offset & ((1 << self.shift) - 1) == 0;
        let position = count.checked_sub(1)?;
        Some(Hit::Node {
            position: self.first + position as u32,
            start,
        })
    }

    /// Notes the node starting at `start` plainly reachable (nothing when
    /// `start` is outside the region).
    #[inline]
    pub fn set_plain(&mut self, start: u64) {
        if !self.holds(start) {
            return;
        }
        let granule = (start - self.start) >> self.shift;
        if let Some(bits) = self.plain.get_mut((granule / 64) as usize) {
            *bits |= 1 << (granule % 64);
        }
    }
}

/// Asks the CPU to bring `value`'s cache line in (a hint: nothing waits).
#[inline(always)]
pub fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing architecturally and never faults;
    // the address is a live reference's.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
            (value as *const T).cast::<i8>(),
        );
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: PRFM is a hint: it never faults and changes no register or
    // memory; the address is a live reference's.
    unsafe {
        core::arch::asm!(
            "prfm pldl1keep, [{0}]",
            in(reg) value as *const T,
            options(nostack, preserves_flags, readonly)
        );
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = value;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The last start at or before `word`, by search.
    fn expected(starts: &[u64], word: u64) -> Option<(u32, bool)> {
        let count = starts.partition_point(|&s| s <= word);
        count.checked_sub(1).map(|p| (p as u32, starts[p] == word))
    }

    fn found(rank: &Rank, word: u64) -> Option<(u32, bool)> {
        match rank.lookup(word)? {
            Hit::Node { position, start } => Some((position, start)),
            Hit::Plain => None,
        }
    }

    #[test]
    fn lookups_find_the_last_start_at_or_before_a_word() {
        let base = 0x5555_0000_0000u64;
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut starts = Vec::new();
        let mut at = base;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            starts.push(at);
            // Gaps of 16 to 16 KiB: lines with no start, many, one.
            at += 16 * (1 + state % if state.is_multiple_of(7) { 1024 } else { 8 });
        }
        let end = at + 40;
        let rank = Rank::new(starts.iter().copied(), 0, end).expect("within budget");
        assert_eq!(rank.shift, 4);
        for word in (base..end).step_by(8).chain([base + 1, base + 17, end - 1]) {
            assert!(rank.holds(word));
            assert_eq!(found(&rank, word), expected(&starts, word), "{word:#x}");
        }
        assert!(!rank.holds(base - 1));
        assert!(!rank.holds(end));
        // Positions are offset by the region's first.
        let later = Rank::new(starts.iter().copied(), 7, end).expect("within budget");
        assert_eq!(found(&later, starts[3]), Some((10, true)));
        // Plainly reachable: its start pointer says so, nothing else does.
        let mut rank = rank;
        assert_ne!(rank.lookup(starts[5]), Some(Hit::Plain));
        rank.set_plain(starts[5]);
        rank.set_plain(base - 16);
        assert_eq!(rank.lookup(starts[5]), Some(Hit::Plain));
        assert!(rank.plain(starts[5]));
        assert_eq!(found(&rank, starts[5] + 8), Some((5, false)));
        assert_eq!(found(&rank, starts[6]), Some((6, true)));
        assert!(!rank.plain(starts[5] + 1));
    }

    #[test]
    fn starts_off_the_heaps_alignment_get_smaller_granules_or_no_lines() {
        let starts = [0x1000, 0x1008, 0x1018, 0x1100];
        let rank = Rank::new(starts.iter().copied(), 0, 0x1200).expect("small");
        assert_eq!(rank.shift, 3);
        assert_eq!(found(&rank, 0x1010), Some((1, false)));
        assert_eq!(found(&rank, 0x1018), Some((2, true)));
        assert_eq!(found(&rank, 0x101f), Some((2, false)));
        // Two nodes over a terabyte: lines past the budget.
        assert!(Rank::new(
            [0x1000, 0x1010 + (1 << 40)].into_iter(),
            0,
            0x2000 + (1 << 40)
        )
        .is_none());
        // The same far apart on a common alignment: two granules.
        assert!(Rank::new(
            [0x1000, 0x1000 + (1 << 40)].into_iter(),
            0,
            0x2000 + (1 << 40)
        )
        .is_some());
    }
}
