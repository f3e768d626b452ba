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
            scratch: Vec::new(),
            scratch_traced: Vec::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.words.is_empty() && self.traced.is_empty()
    }

    /// Takes the waiting entries, sorted by value to 1/2^24th of `span`
    /// (every key is below it: see [`radix_sort`]; the buffers come back
    /// through [`Found::put_back`]).
    pub fn take_sorted(&mut self, span: u64) -> (Vec<u64>, Vec<Traced>) {
        let mut words = std::mem::take(&mut self.words);
        let mut traced = std::mem::take(&mut self.traced);
        let bits = 64 - span.saturating_sub(1).leading_zeros();
        radix_sort(&mut words, &mut self.scratch, bits, |&entry| entry & KEY);
        radix_sort(&mut traced, &mut self.scratch_traced, bits, |t| {
            t.entry & KEY
        });
        (words, traced)
    }

    /// Returns the buffers [`Found::take_sorted`] took, emptied.
    pub fn put_back(&mut self, mut words: Vec<u64>, mut traced: Vec<Traced>) {
        words.clear();
        traced.clear();
        self.words = words;
        self.traced = traced;
    }
}

/// Bits sorted per pass (4096 counters: they stay in the L1 cache).
const RADIX_BITS: u32 = 12;
/// Passes at most: the top 24 bits of a key are sorted, the rest left in
/// any order (a heap of up to 16 GiB: entries sorted to 1 KiB, the few
/// nodes there one or two cache lines of the index).
const RADIX_PASSES: u32 = 2;
/// Fewer items than this are sorted by comparison (fully).
const RADIX_MIN: usize = 256;

/// Sorts `items` by the top bits of `key` (below `1 << bits`), least
/// significant digit first: two passes at most (see [`RADIX_PASSES`]), a
/// digit all keys share skipped; `scratch` is the second buffer, kept for
/// next time. Equal keys keep no particular order.
pub fn radix_sort<T: Copy>(
    items: &mut Vec<T>,
    scratch: &mut Vec<T>,
    bits: u32,
    key: impl Fn(&T) -> u64,
) {
    let Some(&first) = items.first() else {
        return;
    };
    if items.len() < RADIX_MIN {
        items.sort_unstable_by_key(key);
        return;
    }
    let bits = bits.min(64);
    let passes = bits.div_ceil(RADIX_BITS).min(RADIX_PASSES);
    if passes == 0 {
        return;
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
    scratch.resize(items.len(), first);
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
        for item in items.iter() {
            let slot = &mut counts[(key(item) >> shift) as usize & mask];
            scratch[*slot] = *item;
            *slot += 1;
        }
        std::mem::swap(items, scratch);
    }
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

    #[test]
    fn radix_sort_sorts_the_top_bits() {
        let mut state = 0x9E37_79B9_7F4A_7C15;
        let mut scratch = Vec::new();
        for (len, bits) in [
            (0, 64),
            (1, 64),
            (100, 16),
            (5000, 8),
            (5000, 20),
            (5000, 30),
            (5000, 62),
            (20_000, 64),
            (3000, 0),
        ] {
            let mask = if bits == 64 {
                u64::MAX
            } else {
                (1 << bits) - 1
            };
            let mut items: Vec<u64> = (0..len).map(|_| next(&mut state) & mask).collect();
            let mut expected = items.clone();
            expected.sort_unstable();
            radix_sort(&mut items, &mut scratch, bits, |&v| v);
            let shift = bits.saturating_sub(24);
            assert!(
                items.windows(2).all(|p| p[0] >> shift <= p[1] >> shift),
                "{len} {bits}"
            );
            items.sort_unstable();
            assert_eq!(items, expected, "{len} {bits}");
        }
        // Keys sharing their top bits: sorted by the rest, fully.
        let mut items: Vec<u64> = (0..3000)
            .map(|_| 0xab00 | (next(&mut state) & 0xff))
            .collect();
        let mut expected = items.clone();
        expected.sort_unstable();
        radix_sort(&mut items, &mut scratch, 16, |&v| v);
        assert_eq!(items, expected);
    }

    #[test]
    fn radix_sort_sorts_by_the_key_and_keeps_the_rest() {
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
        radix_sort(&mut items, &mut Vec::new(), 20, |t| t.entry & KEY);
        assert!(items
            .windows(2)
            .all(|p| p[0].entry & KEY <= p[1].entry & KEY));
        items.sort_unstable_by_key(|t| t.at);
        expected.sort_unstable_by_key(|t| t.at);
        assert_eq!(items, expected);
    }
}
