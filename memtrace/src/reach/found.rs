//! Words found in pass 1 that wait to be looked up in sorted batches.
//!
//! With millions of nodes, looking each word up as it is found costs cache
//! misses at random in the index's and the states' arrays (tens of MiB
//! each); the same words sorted are looked up in address order, so each
//! lookup lands next to the one before (and the hardware streams the
//! arrays). A word waits with what marking needs: its value (less the
//! lowest node start, so two bits are free for whether it was found in
//! definite memory and in the runtime's), and with provenance where it was.

/// Set in an entry: found in a root or a reachable block.
pub const DEFINITE: u64 = 1 << 63;
/// Set in an entry: found in memory the runtime owns.
pub const RUNTIME: u64 = 1 << 62;
/// An entry's value bits (the word less [`Found::low`]).
pub const KEY: u64 = RUNTIME - 1;
/// The source of a traced word found in a root (not in a node).
pub const ROOT: u32 = u32::MAX;

/// A waiting word and where it was (with provenance).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Traced {
    pub entry: u64,
    pub at: u64,
    /// The position of the node it was found in, or [`ROOT`].
    pub node: u32,
}

/// A waiting entry, with or without where it was found.
pub trait Entry {
    fn entry(&self) -> u64;
}

impl Entry for u64 {
    #[inline(always)]
    fn entry(&self) -> u64 {
        *self
    }
}

impl Entry for Traced {
    #[inline(always)]
    fn entry(&self) -> u64 {
        self.entry
    }
}

/// The waiting words.
pub struct Found {
    /// The lowest node start: an entry holds `word - low`.
    pub low: u64,
    /// How many words wait before they are looked up.
    pub limit: usize,
    /// Entries (without provenance).
    pub words: Vec<u64>,
    /// Entries and where they were (with provenance).
    pub traced: Vec<Traced>,
    /// Entries looked up in the order found (in the densest region, with
    /// direct lookups), without and with provenance.
    pub direct: Vec<u64>,
    pub direct_traced: Vec<Traced>,
    scratch: Vec<u64>,
    scratch_traced: Vec<Traced>,
}

impl Found {
    /// Room for `limit` words, `traced` with where they were.
    pub fn new(low: u64, limit: usize, traced: bool) -> Found {
        let limit = limit.max(1);
        Found {
            low,
            limit,
            words: Vec::with_capacity(if traced { 0 } else { limit }),
            traced: Vec::with_capacity(if traced { limit } else { 0 }),
            // (Room only: pages are touched when used.)
            direct: Vec::with_capacity(if traced { 0 } else { limit }),
            direct_traced: Vec::with_capacity(if traced { limit } else { 0 }),
            scratch: Vec::new(),
            scratch_traced: Vec::new(),
        }
    }

    /// Entries waiting, of every kind.
    pub fn len(&self) -> usize {
        self.words.len() + self.traced.len() + self.direct.len() + self.direct_traced.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes the waiting entries: the direct ones in the order they were
    /// found, the others sorted by value (see [`sort_by_key`]); the
    /// buffers come back through [`Found::put_back`].
    pub fn take(&mut self) -> Batch {
        let mut batch = Batch {
            direct: std::mem::take(&mut self.direct),
            direct_traced: std::mem::take(&mut self.direct_traced),
            words: std::mem::take(&mut self.words),
            traced: std::mem::take(&mut self.traced),
        };
        sort_by_key(&mut batch.words, &mut self.scratch, |&entry| entry & KEY);
        sort_by_key(&mut batch.traced, &mut self.scratch_traced, |t| {
            t.entry & KEY
        });
        batch
    }

    /// Returns the buffers [`Found::take`] took, emptied.
    pub fn put_back(&mut self, mut batch: Batch) {
        batch.direct.clear();
        batch.direct_traced.clear();
        batch.words.clear();
        batch.traced.clear();
        self.direct = batch.direct;
        self.direct_traced = batch.direct_traced;
        self.words = batch.words;
        self.traced = batch.traced;
    }
}

/// A batch of waiting entries taken to be looked up.
pub struct Batch {
    /// Looked up directly, in the order found.
    pub direct: Vec<u64>,
    pub direct_traced: Vec<Traced>,
    /// Looked up in address order: sorted.
    pub words: Vec<u64>,
    pub traced: Vec<Traced>,
}

/// Bits sorted per pass (4096 counters: they stay in the L1 cache).
const RADIX_BITS: u32 = 12;
/// Passes at most: the top 24 bits of a key are sorted, the rest left in
/// any order (a heap of up to 16 GiB: entries sorted to 1 KiB, the few
/// nodes there one or two cache lines of the index).
const RADIX_PASSES: u32 = 2;
/// Fewer items than this are sorted by comparison (fully: in the caches,
/// faster than clearing a radix pass's counters).
const COMPARE_MAX: usize = 4096;

/// A key range wider than this many bits is split by its top digit first
/// (a process's blocks lie in a few dense regions far apart: its heap, its
/// mmapped chunks; sorted to 1/2^24th of the whole span, the entries would
/// be sorted to megabytes, and the lookups that follow would start over).
const SPLIT_BITS: u32 = 32;
/// Splits at most this many times over.
const SPLIT_DEPTH: u32 = 2;

/// Sorts `items` by `key`, to 1/2^24th of the span of the keys of each
/// dense region (equal keys, and keys that close, in no particular order):
/// a span wider than [`SPLIT_BITS`] is first split by its top 12 bits, and
/// each part sorted the same way on its own span. `scratch` is the second
/// buffer, kept for next time.
pub fn sort_by_key<T: Copy>(items: &mut [T], scratch: &mut Vec<T>, key: impl Fn(&T) -> u64) {
    let Some(&first) = items.first() else {
        return;
    };
    scratch.resize(items.len(), first);
    sort_slice(items, scratch, &key, SPLIT_DEPTH);
}

/// [`sort_by_key`] of a slice; the result in `items`.
fn sort_slice<T: Copy>(items: &mut [T], scratch: &mut [T], key: &impl Fn(&T) -> u64, depth: u32) {
    if items.len() < COMPARE_MAX {
        items.sort_unstable_by_key(key);
        return;
    }
    let (mut min, mut max) = (u64::MAX, 0);
    for item in items.iter() {
        let k = key(item);
        min = min.min(k);
        max = max.max(k);
    }
    let bits = 64 - (max - min).leading_zeros();
    if bits <= SPLIT_BITS || depth == 0 {
        if !lsd_sort(items, scratch, bits, |t| key(t) - min) {
            items.copy_from_slice(scratch);
        }
        return;
    }
    // Split by the top digit into `scratch`, each part sorted there (with
    // `items` as its scratch), then copied back.
    let shift = bits - RADIX_BITS;
    let mut counts = vec![0usize; 1 << RADIX_BITS];
    for item in items.iter() {
        counts[((key(item) - min) >> shift) as usize] += 1;
    }
    let mut starts = Vec::with_capacity(counts.len());
    let mut sum = 0;
    for count in &counts {
        starts.push(sum);
        sum += count;
    }
    let mut slots = starts.clone();
    for item in items.iter() {
        let slot = &mut slots[((key(item) - min) >> shift) as usize];
        scratch[*slot] = *item;
        *slot += 1;
    }
    for (&start, &count) in starts.iter().zip(&counts) {
        if count > 1 {
            let part = start..start + count;
            sort_slice(&mut scratch[part.clone()], &mut items[part], key, depth - 1);
        }
    }
    items.copy_from_slice(scratch);
}

/// Sorts `items` by the top bits of `key` (below `1 << bits`), least
/// significant digit first: two passes at most (see [`RADIX_PASSES`]), a
/// digit all keys share skipped; `scratch` is the second buffer, kept for
/// next time. Equal keys keep no particular order.
fn lsd_sort<T: Copy>(
    items: &mut [T],
    scratch: &mut [T],
    bits: u32,
    key: impl Fn(&T) -> u64,
) -> bool {
    let bits = bits.min(64);
    let passes = bits.div_ceil(RADIX_BITS).min(RADIX_PASSES);
    if passes == 0 {
        return true;
    }
    let digit = bits.div_ceil(passes).min(RADIX_BITS);
    let lowest = bits.saturating_sub(passes * digit);
    let mask = (1usize << digit) - 1;
    // Every pass's counts, in one read.
    let mut counts = vec![0usize; (passes as usize) << digit];
    for item in items.iter() {
        let k = key(item) >> lowest;
        for pass in 0..passes {
            let d = (k >> (pass * digit)) as usize & mask;
            counts[((pass as usize) << digit) + d] += 1;
        }
    }
    let mut in_items = true;
    for (pass, counts) in counts.chunks_exact_mut(1 << digit).enumerate() {
        if counts.contains(&items.len()) {
            // Every key has this digit.
            continue;
        }
        let shift = lowest + pass as u32 * digit;
        let mut sum = 0;
        for count in counts.iter_mut() {
            let n = *count;
            *count = sum;
            sum += n;
        }
        let (from, to): (&[T], &mut [T]) = if in_items {
            (&*items, &mut *scratch)
        } else {
            (&*scratch, &mut *items)
        };
        for item in from.iter() {
            let slot = &mut counts[(key(item) >> shift) as usize & mask];
            to[*slot] = *item;
            *slot += 1;
        }
        in_items = !in_items;
    }
    in_items
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64: the tests' random numbers.
    fn next(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    /// Whether `items` are sorted to `2^shift` (keys less `min`).
    fn sorted_to(items: &[u64], min: u64, shift: u32) -> bool {
        items
            .windows(2)
            .all(|p| (p[0] - min) >> shift <= (p[1] - min) >> shift)
    }

    #[test]
    fn sorting_sorts_to_a_24th_of_the_span_bits_and_keeps_every_key() {
        let mut state = 0x9E37_79B9_7F4A_7C15;
        let mut scratch = Vec::new();
        for (len, bits) in [
            (0, 64),
            (1, 64),
            (100, 16),
            (5000, 8),
            (5000, 20),
            (5000, 30),
            (20_000, 31),
            (20_000, 33),
            (5000, 62),
            (20_000, 62),
            (3000, 0),
        ] {
            let mask = if bits == 64 {
                u64::MAX
            } else {
                (1 << bits) - 1
            };
            let mut items: Vec<u64> = (0..len).map(|_| next(&mut state) & mask & KEY).collect();
            let mut expected = items.clone();
            expected.sort_unstable();
            sort_by_key(&mut items, &mut scratch, |&v| v);
            let min = expected.first().copied().unwrap_or(0);
            let span = expected.last().copied().unwrap_or(0) - min;
            let shift = (64 - span.leading_zeros()).saturating_sub(24);
            assert!(sorted_to(&items, min, shift), "{len} {bits}");
            items.sort_unstable();
            assert_eq!(items, expected, "{len} {bits}");
        }
        // Keys sharing their top bits: sorted by the rest, fully.
        let mut items: Vec<u64> = (0..3000)
            .map(|_| 0xab00 | (next(&mut state) & 0xff))
            .collect();
        let mut expected = items.clone();
        expected.sort_unstable();
        sort_by_key(&mut items, &mut scratch, |&v| v);
        assert_eq!(items, expected);
    }

    #[test]
    fn dense_regions_far_apart_are_each_sorted_finely() {
        // A heap of 1 GiB and mmapped blocks 64 TiB away: sorted to 64
        // bytes within each, not to the 4 GiB a 24th of the whole span is.
        let mut state = 3;
        let (heap, mmaps) = (1u64 << 40, 1u64 << 46);
        // (each region's own lowest key is where its order starts)
        let mut items: Vec<u64> = (0..100_000)
            .map(|k| {
                let base = if k % 3 == 0 { mmaps } else { heap };
                base + (next(&mut state) & ((1 << 30) - 1))
            })
            .collect();
        let mut expected = items.clone();
        expected.sort_unstable();
        sort_by_key(&mut items, &mut Vec::new(), |&v| v);
        let split = items.partition_point(|&v| v < mmaps);
        assert!(items[split..].iter().all(|&v| v >= mmaps));
        let min = |part: &[u64]| part.iter().copied().min().unwrap_or(0);
        assert!(sorted_to(&items[..split], min(&items[..split]), 6));
        assert!(sorted_to(&items[split..], min(&items[split..]), 6));
        items.sort_unstable();
        assert_eq!(items, expected);
    }

    #[test]
    fn sorting_sorts_by_the_key_and_keeps_the_rest() {
        let mut state = 7;
        let mut items: Vec<Traced> = (0..4000u64)
            .map(|k| Traced {
                entry: (next(&mut state) & 0xf_ffff)
                    | if k.is_multiple_of(3) { DEFINITE } else { 0 },
                at: k,
                node: k as u32,
            })
            .collect();
        let mut expected = items.clone();
        sort_by_key(&mut items, &mut Vec::new(), |t| t.entry & KEY);
        assert!(items
            .windows(2)
            .all(|p| p[0].entry & KEY <= p[1].entry & KEY));
        items.sort_unstable_by_key(|t| t.at);
        expected.sort_unstable_by_key(|t| t.at);
        assert_eq!(items, expected);
    }
}
