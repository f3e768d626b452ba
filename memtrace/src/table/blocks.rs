//! The set of live blocks, stored densely: what [`super::LiveTable`] keeps
//! per block, and nothing else.
//!
//! Blocks are grouped by 4 KiB region of their address: a B-tree maps
//! (process, domain, address >> 12) to the region's blocks, a vector of
//! (offset in the region, block) sorted by offset. A heap hands out nearby
//! addresses, so one region holds many blocks (128 of glibc's 32-byte
//! chunks) and a block costs its 32-byte slot plus a share of one B-tree
//! entry, where a B-tree entry per block costs ~85 bytes (Rust's B-tree
//! leaves are half full when keys arrive ascending, as heap addresses mostly
//! do).
//!
//! A region's vector grows by a quarter, not by doubling (and, filled in
//! address order, to just what the rest of the region holds), and shrinks
//! when it gets half empty, so little capacity sits unused. A region of one
//! block is not a vector: the block is an entry of a second B-tree keyed by
//! its full address, so sparse blocks (large allocations, one per region)
//! cost a B-tree entry each, as they did before regions. A region is in one
//! of the two trees, never both, and an emptied region is dropped.
//!
//! Lookups are B-tree searches and a binary search within a region (4096
//! slots at most: an insertion or removal shifts at most one region's
//! slots). Iteration is in (process, domain, address) order.

use std::collections::BTreeMap;

use super::LiveBlock;
use crate::probe::catalog::Domain;

/// Address bits within a region.
const REGION_BITS: u32 = 12;
const OFFSET_MASK: u64 = (1 << REGION_BITS) - 1;
/// The highest offset in a region.
const LAST_OFFSET: u16 = (1 << REGION_BITS) - 1;
/// Capacity a region's vector never shrinks below.
const MIN_CAPACITY: usize = 4;

/// Where a block lives: (process id, address domain, address), ordered so.
/// Packed (14 bytes, not 16).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(C, packed(2))]
pub(super) struct BlockKey {
    pub(super) pid: u32,
    pub(super) domain: Domain,
    pub(super) addr: u64,
}

impl BlockKey {
    /// The region holding this key and the key's offset in it.
    fn split(&self) -> (RegionKey, u16) {
        let region = RegionKey {
            pid: self.pid,
            domain: self.domain,
            region: self.addr >> REGION_BITS,
        };
        // The mask keeps 12 bits: the conversion cannot truncate.
        (region, (self.addr & OFFSET_MASK) as u16)
    }
}

/// One region of one process's domain: (pid, domain, address >> 12), ordered
/// so (which orders blocks by (pid, domain, address)). Packed (14 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(C, packed(2))]
struct RegionKey {
    pid: u32,
    domain: Domain,
    region: u64,
}

impl RegionKey {
    fn key(&self, offset: u16) -> BlockKey {
        BlockKey {
            pid: self.pid,
            domain: self.domain,
            addr: (self.region << REGION_BITS) | u64::from(offset),
        }
    }
}

/// A block and its offset in its region: 32 bytes (alignment 2).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct Slot {
    offset: u16,
    block: LiveBlock,
}

/// The blocks of a region of two or more, sorted by offset.
type Region = Vec<Slot>;

fn find(slots: &[Slot], offset: u16) -> Result<usize, usize> {
    slots.binary_search_by_key(&offset, |slot| slot.offset)
}

/// How many slots a full region grows by for a block at `offset` going to
/// `index`: a quarter more (not double: little capacity unused), and when
/// appended past the last block (a heap handing out ascending addresses) no
/// more than the rest of the region holds at the spacing of its blocks so
/// far (128 of glibc's 32-byte chunks fill a region exactly).
fn growth(slots: &[Slot], index: usize, offset: u16) -> usize {
    let quarter = (slots.len() / 4).max(2);
    let (Some(first), Some(last)) = (slots.first(), slots.last()) else {
        return quarter;
    };
    let gaps = slots.len().saturating_sub(1);
    // Sorted: the last offset is the highest.
    let spacing = usize::from(last.offset - first.offset) / gaps.max(1);
    if index < slots.len() || spacing == 0 {
        return quarter;
    }
    let fit = usize::from(LAST_OFFSET.saturating_sub(offset)) / spacing + 1;
    quarter.min(fit)
}

/// Live blocks by (pid, domain, address): a map with the few operations the
/// live table needs.
#[derive(Debug, Default)]
pub(super) struct BlockSet {
    /// Regions of two blocks or more.
    regions: BTreeMap<RegionKey, Region>,
    /// Blocks alone in their region.
    singles: BTreeMap<BlockKey, LiveBlock>,
    len: usize,
}

impl BlockSet {
    pub(super) fn new() -> Self {
        BlockSet::default()
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn get(&self, key: &BlockKey) -> Option<&LiveBlock> {
        let (region, offset) = key.split();
        match self.regions.get(&region) {
            Some(slots) => {
                let index = find(slots, offset).ok()?;
                slots.get(index).map(|slot| &slot.block)
            }
            None => self.singles.get(key),
        }
    }

    pub(super) fn contains_key(&self, key: &BlockKey) -> bool {
        self.get(key).is_some()
    }

    /// Puts `block` at `key`; returns the block it replaced.
    pub(super) fn insert(&mut self, key: BlockKey, block: LiveBlock) -> Option<LiveBlock> {
        let (region, offset) = key.split();
        let slot = Slot { offset, block };
        let replaced = if let Some(slots) = self.regions.get_mut(&region) {
            match find(slots, offset) {
                Ok(index) => slots
                    .get_mut(index)
                    .map(|held| std::mem::replace(held, slot).block),
                Err(index) => {
                    if slots.len() == slots.capacity() {
                        slots.reserve_exact(growth(slots, index, offset));
                    }
                    slots.insert(index, slot);
                    None
                }
            }
        } else {
            match self.single_in(region) {
                Some(alone) if alone == key => self.singles.insert(key, block),
                Some(alone) => {
                    // The region's second block: the region becomes a vector.
                    let mut slots = Vec::with_capacity(2);
                    if let Some(held) = self.singles.remove(&alone) {
                        slots.push(Slot {
                            offset: alone.split().1,
                            block: held,
                        });
                    }
                    let index = usize::from(alone.addr < key.addr);
                    slots.insert(index.min(slots.len()), slot);
                    self.regions.insert(region, slots);
                    None
                }
                None => self.singles.insert(key, block),
            }
        };
        if replaced.is_none() {
            self.len += 1;
        }
        replaced
    }

    /// The key of the block alone in `region`, if one is.
    fn single_in(&self, region: RegionKey) -> Option<BlockKey> {
        let range = region.key(0)..=region.key(LAST_OFFSET);
        self.singles.range(range).next().map(|(key, _)| *key)
    }

    /// Takes the block at `key` out; a region left empty is dropped, and a
    /// region left with one block keeps it as a single.
    pub(super) fn remove(&mut self, key: &BlockKey) -> Option<LiveBlock> {
        let (region, offset) = key.split();
        let block = match self.regions.get_mut(&region) {
            Some(slots) => {
                let index = find(slots, offset).ok()?;
                let block = slots.remove(index).block;
                if let [last] = slots.as_slice() {
                    let last = *last;
                    self.regions.remove(&region);
                    self.singles.insert(region.key(last.offset), last.block);
                } else if slots.capacity() > MIN_CAPACITY && slots.len() < slots.capacity() / 2 {
                    slots.shrink_to((slots.len() + slots.len() / 4).max(MIN_CAPACITY));
                }
                block
            }
            None => self.singles.remove(key)?,
        };
        self.len -= 1;
        Some(block)
    }

    /// Every block, in (pid, domain, address) order.
    pub(super) fn values(&self) -> impl Iterator<Item = &LiveBlock> + '_ {
        self.iter().map(|(_, _, _, block)| block)
    }

    /// Every block with its (pid, domain, address), in that order: the
    /// regions' blocks merged with the singles.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u32, Domain, u64, &LiveBlock)> + '_ {
        let mut grouped = self
            .regions
            .iter()
            .flat_map(|(region, slots)| {
                let region = *region;
                slots
                    .iter()
                    .map(move |slot| (region.key(slot.offset), &slot.block))
            })
            .peekable();
        let mut singles = self
            .singles
            .iter()
            .map(|(key, block)| (*key, block))
            .peekable();
        std::iter::from_fn(move || {
            let from_grouped = match (grouped.peek(), singles.peek()) {
                (Some((a, _)), Some((b, _))) => a < b,
                (Some(_), None) => true,
                (None, _) => false,
            };
            let (key, block) = if from_grouped {
                grouped.next()?
            } else {
                singles.next()?
            };
            Some((key.pid, key.domain, key.addr, block))
        })
    }

    /// How many regions are held (those of one block included).
    #[cfg(test)]
    fn regions(&self) -> usize {
        self.regions.len() + self.singles.len()
    }

    /// Unused slots reserved across regions.
    #[cfg(test)]
    fn spare(&self) -> usize {
        self.regions
            .values()
            .map(|slots| slots.capacity() - slots.len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::StackRef;

    fn key(pid: u32, domain: Domain, addr: u64) -> BlockKey {
        BlockKey { pid, domain, addr }
    }

    fn block(size: u64) -> LiveBlock {
        LiveBlock {
            size,
            ts_ns: size * 10,
            tid: 7,
            py_stack: 3,
            stack: StackRef::Id(5).to_wire(),
            spec: 2,
        }
    }

    fn addrs(set: &BlockSet) -> Vec<(u32, Domain, u64, u64)> {
        set.iter()
            .map(|(pid, domain, addr, block)| (pid, domain, addr, block.size))
            .collect()
    }

    #[test]
    fn insert_get_replace_remove() {
        let mut set = BlockSet::new();
        let k = key(1, Domain::Heap, 0x5555_0000_1010);
        assert_eq!(set.insert(k, block(16)), None);
        assert_eq!(set.get(&k), Some(&block(16)));
        assert!(set.contains_key(&k));
        assert!(!set.contains_key(&key(1, Domain::Heap, 0x5555_0000_1020)));
        assert_eq!(set.insert(k, block(32)), Some(block(16)));
        assert_eq!(set.len(), 1);
        assert_eq!(set.get(&k).map(|b| b.stack()), Some(StackRef::Id(5)));
        assert_eq!(set.remove(&k), Some(block(32)));
        assert_eq!(set.remove(&k), None);
        assert_eq!((set.len(), set.regions()), (0, 0));
    }

    #[test]
    fn iteration_is_ordered_across_regions_pids_and_domains() {
        let mut set = BlockSet::new();
        let keys = [
            (2, Domain::Heap, 0x10),
            (1, Domain::CudaMemory, 0x10),
            (1, Domain::Heap, 0x2000),
            (1, Domain::Heap, 0x1ff8),
            (1, Domain::Custom(3), 0x0),
            (1, Domain::Custom(1), u64::MAX),
            (1, Domain::Heap, 0x1000),
            (1, Domain::Heap, 0xfff),
            (1, Domain::Heap, 0x0),
            (u32::MAX, Domain::Heap, 0x0),
        ];
        for (size, &(pid, domain, addr)) in keys.iter().enumerate() {
            set.insert(key(pid, domain, addr), block(size as u64));
        }
        let mut expected: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(size, &(pid, domain, addr))| (pid, domain, addr, size as u64))
            .collect();
        expected.sort();
        assert_eq!(addrs(&set), expected);
        assert_eq!(set.len(), keys.len());
        let sizes: Vec<u64> = set.values().map(|b| b.size).collect();
        let expected_sizes: Vec<u64> = expected.iter().map(|e| e.3).collect();
        assert_eq!(sizes, expected_sizes);
    }

    #[test]
    fn same_address_in_other_pids_and_domains_are_other_blocks() {
        let mut set = BlockSet::new();
        set.insert(key(1, Domain::Heap, 0x40), block(1));
        set.insert(key(2, Domain::Heap, 0x40), block(2));
        set.insert(key(1, Domain::Mapping, 0x40), block(3));
        assert_eq!(set.len(), 3);
        assert_eq!(set.remove(&key(2, Domain::Heap, 0x40)), Some(block(2)));
        assert_eq!(set.get(&key(1, Domain::Heap, 0x40)), Some(&block(1)));
        assert_eq!(set.get(&key(1, Domain::Mapping, 0x40)), Some(&block(3)));
        assert_eq!(set.get(&key(2, Domain::Heap, 0x40)), None);
    }

    #[test]
    fn emptied_regions_are_dropped() {
        let mut set = BlockSet::new();
        // Two regions: 0x1000.. and 0x2000..
        for i in 0..200u64 {
            set.insert(key(1, Domain::Heap, 0x1000 + 32 * i), block(i));
        }
        assert_eq!(set.regions(), 2);
        // A miss in a held region changes nothing.
        assert_eq!(set.remove(&key(1, Domain::Heap, 0x1001)), None);
        assert_eq!(set.len(), 200);
        for i in 0..128u64 {
            assert_eq!(
                set.remove(&key(1, Domain::Heap, 0x1000 + 32 * i)),
                Some(block(i))
            );
        }
        assert_eq!((set.len(), set.regions()), (72, 1));
        // Down to one block (held inline), then none.
        for i in 128..199u64 {
            set.remove(&key(1, Domain::Heap, 0x1000 + 32 * i));
        }
        assert_eq!((set.len(), set.regions(), set.spare()), (1, 1, 0));
        assert_eq!(set.remove(&key(1, Domain::Heap, 0x1000 + 32 * 198)), None);
        assert_eq!(
            set.remove(&key(1, Domain::Heap, 0x1000 + 32 * 199)),
            Some(block(199))
        );
        assert_eq!((set.len(), set.regions()), (0, 0));
        assert_eq!(set.iter().count(), 0);
    }

    #[test]
    fn capacity_follows_the_blocks() {
        let mut set = BlockSet::new();
        // Out of order: grown by quarters, less than a third spare.
        for i in (0..128u64).rev() {
            set.insert(key(1, Domain::Heap, 32 * i), block(i));
        }
        assert!(set.spare() * 3 < 128, "spare {}", set.spare());
        assert_eq!(set.len(), 128);
    }

    #[test]
    fn capacity_follows_ascending_blocks() {
        let mut set = BlockSet::new();
        for i in 0..128u64 {
            set.insert(key(1, Domain::Heap, 32 * i), block(i));
        }
        // Appended in order at a steady spacing: grown to fit the region.
        assert_eq!(set.spare(), 0);
        for i in 0..120u64 {
            set.remove(&key(1, Domain::Heap, 32 * i));
        }
        // Shrunk as it emptied.
        assert!(set.spare() <= 8, "spare {}", set.spare());
        let left: Vec<u64> = set.values().map(|b| b.size).collect();
        assert_eq!(left, (120..128).collect::<Vec<_>>());
    }

    #[test]
    fn a_region_of_one_is_a_single_and_back() {
        let mut set = BlockSet::new();
        let a = key(1, Domain::Heap, 0x3010);
        let b = key(1, Domain::Heap, 0x3008);
        set.insert(a, block(1));
        assert_eq!((set.regions.len(), set.singles.len()), (0, 1));
        // A second block in the region, below the first.
        assert_eq!(set.insert(b, block(2)), None);
        assert_eq!((set.regions.len(), set.singles.len()), (1, 0));
        assert_eq!(set.get(&a), Some(&block(1)));
        assert_eq!(set.get(&b), Some(&block(2)));
        // Blocks alone in their regions sort among the region's blocks.
        set.insert(key(1, Domain::Heap, 0x2fff), block(3));
        set.insert(key(1, Domain::Heap, 0x4000), block(4));
        set.insert(key(0, Domain::Heap, 0x3000), block(5));
        set.insert(key(1, Domain::Mapping, 0x3000), block(6));
        let sizes: Vec<u64> = set.values().map(|b| b.size).collect();
        assert_eq!(sizes, vec![5, 3, 2, 1, 4, 6]);
        // Down to one: a single again, then replaced in place, then gone.
        assert_eq!(set.remove(&b), Some(block(2)));
        assert_eq!((set.regions.len(), set.singles.len()), (0, 5));
        assert_eq!(set.insert(a, block(7)), Some(block(1)));
        assert_eq!(set.remove(&b), None);
        assert_eq!(set.remove(&a), Some(block(7)));
        assert_eq!((set.len(), set.regions()), (4, 4));
    }

    /// A deterministic mix of inserts, replacements and removals, in dense
    /// regions and in sparse ones (many of one block), matches a plain
    /// ordered map.
    #[test]
    fn behaves_as_an_ordered_map() {
        for spacing in [16, 1000] {
            matches_an_ordered_map(spacing);
        }
    }

    fn matches_an_ordered_map(spacing: u64) {
        let mut set = BlockSet::new();
        let mut model: BTreeMap<(u32, Domain, u64), LiveBlock> = BTreeMap::new();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for step in 0..20_000u64 {
            let r = next();
            let pid = 1 + (r % 2) as u32;
            let domain = if r & 4 == 0 {
                Domain::Heap
            } else {
                Domain::Custom(1)
            };
            let addr = 0x7f00_0000_0000 + ((r >> 8) % 3000) * spacing;
            let k = key(pid, domain, addr);
            if (r >> 40) % 3 == 0 {
                assert_eq!(set.remove(&k), model.remove(&(pid, domain, addr)));
            } else {
                assert_eq!(
                    set.insert(k, block(step)),
                    model.insert((pid, domain, addr), block(step))
                );
            }
            assert_eq!(set.get(&k), model.get(&(pid, domain, addr)));
        }
        assert_eq!(set.len(), model.len());
        let held: Vec<_> = set.iter().map(|(p, d, a, b)| ((p, d, a), *b)).collect();
        let expected: Vec<_> = model.into_iter().collect();
        assert_eq!(held, expected);
    }
}
