//! The live-allocation table: every block created and not yet released,
//! keyed by (process, address domain, address), with the counters of what
//! happened. The process is part of the key because with `--follow-forks` a
//! parent and its children use the same addresses for different blocks.
//!
//! Semantics: `realloc(p, n)` releases `p` and creates the new block;
//! `realloc(NULL, n)` is an allocation; a release of an address the table does
//! not hold (allocated before attach) is counted in `unmatched_frees`; a
//! release of the block the same thread released just before, with no other
//! event of that thread in between, is one release seen at two probes (a C++
//! `operator delete` that ends in a call of a probed `free`/`sdallocx`) and is
//! counted in `releases_seen_twice`.
//!
//! A block's events are ordered by time, not by arrival: an allocation the
//! kernel held (see the loader's `held` module) arrives after events of
//! other threads made later. An event older than the block the table holds
//! at its address is about an earlier block there: an allocation is counted
//! and remembered as superseded, and a release settles a superseded one (or
//! is unmatched). A release of a block always comes after its allocation,
//! so in-order events never meet these rules.
//!
//! Mappings are ranges: a `munmap` may release several, or part of one
//! (glibc trims the 128 MiB it maps for a new arena to the aligned 64 MiB
//! half), which keeps what lies outside the range (see [`LiveTable::apply`]).

mod blocks;

use std::collections::{BTreeMap, HashMap};

use self::blocks::{BlockKey, BlockSet};
use crate::event::{Action, Event, StackRef};
use crate::probe::catalog::Domain;

fn key(pid: u32, domain: Domain, addr: u64) -> BlockKey {
    BlockKey { pid, domain, addr }
}

/// A block that is still live. Packed (30 bytes, not 40): the table holds
/// millions of them; read its fields by value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C, packed(2))]
pub struct LiveBlock {
    pub size: u64,
    pub ts_ns: u64,
    pub tid: u32,
    /// The Python stack (kernel id), 0: none.
    pub py_stack: u32,
    /// [`StackRef::to_wire`] of the block's stack.
    stack: i32,
    pub spec: u16,
}

impl LiveBlock {
    pub fn stack(&self) -> StackRef {
        StackRef::from_wire(self.stack)
    }

    fn origin(&self) -> Origin {
        Origin {
            spec: self.spec,
            stack: self.stack(),
            py_stack: self.py_stack,
        }
    }
}

/// Where blocks came from: the probed function and the stacks as captured
/// (kernel ids, not yet canonical).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Origin {
    pub spec: u16,
    pub stack: StackRef,
    pub py_stack: u32,
}

/// Live bytes and blocks of one origin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OriginTotal {
    pub bytes: u64,
    pub blocks: u64,
}

/// The blocks a process's exec took with its old image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExecDrop {
    pub pid: u32,
    pub blocks: u64,
    pub bytes: u64,
    /// Of them, allocations the kernel still held for threads the exec
    /// killed (dropped before they reached the table).
    pub held: u64,
}

/// What the table has seen.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub allocs: u64,
    pub frees: u64,
    pub unmatched_frees: u64,
    /// Releases seen a second time at another probe (counted once).
    pub releases_seen_twice: u64,
    /// Allocations not tracked because the table was at its cap.
    pub table_full: u64,
    /// Mappings partly unmapped: each keeps what lies outside the range.
    pub mappings_trimmed: u64,
    /// `munmap` ranges that met no traced mapping (mapped before the
    /// attach, from a file, or by an untraced path such as the dynamic
    /// loader's own `mmap`).
    pub unmaps_untracked: u64,
    /// Allocations at an address still live here, with no release of the
    /// block there seen: the old block is dropped (released through a path
    /// no probe saw, or an event lost upstream).
    pub addresses_reused: u64,
    /// Failed calls by (spec, return code).
    pub failed: BTreeMap<(u16, i64), u64>,
}

/// Live blocks and counters. The blocks are a dense ordered set (the
/// `blocks` module: ~33 bytes a block where heap addresses cluster, as they
/// do), not a hash map (empty buckets, doubling on growth) nor a B-tree entry
/// per block (half-full leaves, ~88 bytes a block); lookups cost a few
/// hundred nanoseconds at most, noise next to a uprobe hit.
pub struct LiveTable {
    /// When the trace ended (monotonic ns), once [`LiveTable::close`] is called.
    ended_ns: Option<u64>,
    blocks: BlockSet,
    counts: Counts,
    max_blocks: usize,
    /// Per thread, the block it released last and the spec that released
    /// it, until its next event.
    last_release: HashMap<u32, (BlockKey, u16)>,
    /// Live totals per origin, kept as blocks come and go: a snapshot every
    /// interval then costs the number of origins, not a walk of millions of
    /// blocks (which stalled the event loop long enough to overflow the ring).
    origins: HashMap<Origin, OriginTotal>,
    /// Blocks older than the one the table holds at their address, arrived
    /// late and not yet released, by key (almost always empty).
    superseded: BTreeMap<BlockKey, u32>,
    /// The live blocks of [`Domain::Mapping`] as ranges: (process, start)
    /// to length, so an unmapped range finds every mapping it meets.
    mappings: BTreeMap<(u32, u64), u64>,
    /// Execs met in the stream, not yet taken ([`LiveTable::take_execs`]).
    execs: Vec<ExecDrop>,
}

impl LiveTable {
    pub fn new(max_blocks: usize) -> Self {
        LiveTable {
            ended_ns: None,
            blocks: BlockSet::new(),
            counts: Counts::default(),
            max_blocks,
            last_release: HashMap::new(),
            origins: HashMap::new(),
            superseded: BTreeMap::new(),
            mappings: BTreeMap::new(),
            execs: Vec::new(),
        }
    }

    /// The execs met since the last call, with the blocks each dropped.
    pub fn take_execs(&mut self) -> Vec<ExecDrop> {
        std::mem::take(&mut self.execs)
    }

    /// Marks the end of the trace at `ts_ns` (monotonic, the events' clock).
    /// At the end allocation probes are detached first while releases are
    /// still watched for a moment, so a block made just before the end and
    /// released just after is not reported live. Events after the end only
    /// settle the blocks made before it: a release of an address the table
    /// does not hold is not an unmatched free (its allocation came after the
    /// end, unwatched), and a reallocation of such an address (or of NULL)
    /// creates no block. A reallocation of a block the table holds still
    /// moves it: the block was live at the end. Calls entered before the end
    /// that return after it are tracked.
    pub fn close(&mut self, ts_ns: u64) {
        self.ended_ns.get_or_insert(ts_ns);
    }

    /// Whether `event` came after [`LiveTable::close`] and concerns no block
    /// made before the end.
    fn after_the_end(&self, event: &Event, domain: Domain) -> bool {
        if self.ended_ns.is_none_or(|end| event.ts_ns <= end) {
            return false;
        }
        let unknown = |addr: u64| !self.blocks.contains_key(&key(event.pid, domain, addr));
        match event.action {
            Action::Free { addr } => unknown(addr),
            Action::Realloc { old, .. } => old == 0 || unknown(old),
            _ => false,
        }
    }

    /// Applies one event; `domain` maps the event's spec to its address domain.
    pub fn apply(&mut self, event: &Event, domain: Domain) {
        if self.after_the_end(event, domain) {
            return;
        }
        match event.action {
            Action::Alloc { addr, size, stack } => {
                self.last_release.remove(&event.tid);
                self.counts.allocs += 1;
                self.insert(key(event.pid, domain, addr), size, event, stack);
            }
            Action::Free { addr } => self.release_by(event, key(event.pid, domain, addr)),
            Action::Realloc {
                old,
                new,
                size,
                stack,
                track_new,
            } => {
                self.last_release.remove(&event.tid);
                if old != 0 {
                    self.release(key(event.pid, domain, old), event.ts_ns);
                }
                if track_new {
                    self.counts.allocs += 1;
                    self.insert(key(event.pid, domain, new), size, event, stack);
                }
            }
            Action::Failed { code, .. } => {
                *self.counts.failed.entry((event.spec, code)).or_insert(0) += 1;
            }
            Action::Unmap { addr, len } => self.unmap(event, addr, len),
            Action::Exec { .. } => {
                let (blocks, bytes) = self.forget_process(event.pid);
                self.execs.push(ExecDrop {
                    pid: event.pid,
                    blocks,
                    bytes,
                    held: 0,
                });
            }
            Action::Fork { .. } | Action::MapsStale => {}
        }
    }

    /// `munmap` of `addr..addr + len`: each traced mapping wholly inside is
    /// released; one partly inside keeps what lies outside, as one block or
    /// two, with its origin and age (`mappings_trimmed`). A range that meets
    /// no traced mapping is counted in `unmaps_untracked`.
    fn unmap(&mut self, event: &Event, addr: u64, len: u64) {
        let (pid, end) = (event.pid, addr.saturating_add(len));
        let before = self
            .mappings
            .range(..(pid, addr))
            .next_back()
            .filter(|(&(owner, start), &size)| owner == pid && start.saturating_add(size) > addr);
        let met: Vec<(u64, u64)> = before
            .into_iter()
            .chain(self.mappings.range((pid, addr)..(pid, end)))
            .map(|(&(_, start), &size)| (start, size))
            .collect();
        if met.is_empty() {
            if self.ended_ns.is_none_or(|ended| event.ts_ns <= ended) {
                self.counts.unmaps_untracked += 1;
            }
            return;
        }
        for (start, size) in met {
            let Some(block) = self.remove_block(&key(pid, Domain::Mapping, start)) else {
                continue;
            };
            self.forget(&block);
            let stop = start.saturating_add(size);
            if addr <= start && stop <= end {
                self.counts.frees += 1;
                continue;
            }
            self.counts.mappings_trimmed += 1;
            for (from, to) in [(start, addr.min(stop)), (end.max(start), stop)] {
                if from < to {
                    let part = LiveBlock {
                        size: to - from,
                        ..block
                    };
                    self.add_to_origin(&part);
                    self.insert_block(key(pid, Domain::Mapping, from), part);
                }
            }
        }
    }

    /// Puts `block` in the set (and, a mapping, in the ranges); returns the
    /// block it replaced.
    fn insert_block(&mut self, key: BlockKey, block: LiveBlock) -> Option<LiveBlock> {
        if key.domain == Domain::Mapping {
            self.mappings.insert((key.pid, key.addr), block.size);
        }
        self.blocks.insert(key, block)
    }

    /// Takes the block at `key` out of the set (and the ranges).
    fn remove_block(&mut self, key: &BlockKey) -> Option<LiveBlock> {
        let removed = self.blocks.remove(key);
        if removed.is_some() && key.domain == Domain::Mapping {
            self.mappings.remove(&(key.pid, key.addr));
        }
        removed
    }

    /// Process `pid` replaced its image (`exec`): its blocks went with the
    /// old address space. Drops them; returns how many and their bytes.
    pub fn forget_process(&mut self, pid: u32) -> (u64, u64) {
        let keys: Vec<BlockKey> = self
            .blocks
            .iter()
            .filter(|&(owner, ..)| owner == pid)
            .map(|(owner, domain, addr, _)| key(owner, domain, addr))
            .collect();
        let (mut blocks, mut bytes) = (0, 0);
        for key in keys {
            if let Some(block) = self.remove_block(&key) {
                self.forget(&block);
                blocks += 1;
                bytes += block.size;
            }
        }
        self.superseded.retain(|key, _| key.pid != pid);
        self.last_release.retain(|_, (key, _)| key.pid != pid);
        (blocks, bytes)
    }

    fn add_to_origin(&mut self, block: &LiveBlock) {
        let total = self.origins.entry(block.origin()).or_default();
        total.bytes += block.size;
        total.blocks += 1;
    }

    fn insert(&mut self, key: BlockKey, size: u64, event: &Event, stack: StackRef) {
        let block = LiveBlock {
            size,
            spec: event.spec,
            ts_ns: event.ts_ns,
            tid: event.tid,
            stack: stack.to_wire(),
            py_stack: event.py_stack,
        };
        if let Some(held) = self.blocks.get(&key) {
            if held.ts_ns > event.ts_ns {
                *self.superseded.entry(key).or_insert(0) += 1;
                return;
            }
        }
        if self.blocks.len() >= self.max_blocks && !self.blocks.contains_key(&key) {
            self.counts.table_full += 1;
            return;
        }
        // An address handed out again without a release we saw (released
        // through an untraced path): the new block replaces the old one.
        self.add_to_origin(&block);
        if let Some(replaced) = self.insert_block(key, block) {
            self.counts.addresses_reused += 1;
            self.forget(&replaced);
        }
    }

    /// A release: the same block released again by the same thread through
    /// another function, with no event of that thread in between, is the
    /// same release seen at a second probe (once: a third is a release of its
    /// own). The same function releasing the same address twice in a row is
    /// two releases (a loop whose allocations a kernel filter skipped).
    fn release_by(&mut self, event: &Event, key: BlockKey) {
        if !self.blocks.contains_key(&key) {
            if let Some(&(last, spec)) = self.last_release.get(&event.tid) {
                if last == key && spec != event.spec {
                    self.counts.releases_seen_twice += 1;
                    self.last_release.remove(&event.tid);
                    return;
                }
            }
        }
        self.release(key, event.ts_ns);
        self.last_release.insert(event.tid, (key, event.spec));
    }

    /// Releases the block at `key` (a release made at `ts_ns`).
    fn release(&mut self, key: BlockKey, ts_ns: u64) {
        if self
            .blocks
            .get(&key)
            .is_some_and(|block| block.ts_ns > ts_ns)
        {
            // Made before the block held here: it releases an earlier one.
            self.release_superseded(key);
            return;
        }
        if let Some(block) = self.remove_block(&key) {
            self.forget(&block);
            self.counts.frees += 1;
        } else {
            self.release_superseded(key);
        }
    }

    fn release_superseded(&mut self, key: BlockKey) {
        match self.superseded.get_mut(&key) {
            Some(count) => {
                *count -= 1;
                if *count == 0 {
                    self.superseded.remove(&key);
                }
                self.counts.frees += 1;
            }
            None => self.counts.unmatched_frees += 1,
        }
    }

    /// Takes a block that left the table out of its origin's total.
    fn forget(&mut self, block: &LiveBlock) {
        let origin = block.origin();
        if let Some(total) = self.origins.get_mut(&origin) {
            total.bytes = total.bytes.saturating_sub(block.size);
            total.blocks = total.blocks.saturating_sub(1);
            if total.blocks == 0 {
                self.origins.remove(&origin);
            }
        }
    }

    /// Live totals per origin (what [`LiveTable::blocks`] sums to, grouped).
    pub fn origins(&self) -> impl Iterator<Item = (&Origin, &OriginTotal)> {
        self.origins.iter()
    }

    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn live_bytes(&self) -> u64 {
        self.blocks.values().map(|b| b.size).sum()
    }

    /// Every live block with its process, domain and address.
    pub fn blocks(&self) -> impl Iterator<Item = (u32, Domain, u64, &LiveBlock)> {
        self.blocks.iter()
    }
}

#[cfg(test)]
mod repeat_tests {
    use super::*;
    use crate::event::{Action, Event, StackRef};

    fn ev(tid: u32, spec: u16, action: Action) -> Event {
        Event {
            ts_ns: 0,
            pid: 1,
            tid,
            spec,
            action,
            py_stack: 0,
        }
    }

    #[test]
    fn a_release_seen_at_two_probes_counts_once() {
        let mut t = LiveTable::new(100);
        let alloc = |addr| Action::Alloc {
            addr,
            size: 8,
            stack: StackRef::NotRequested,
        };
        let free = |addr| Action::Free { addr };
        t.apply(&ev(7, 0, alloc(0x10)), Domain::Heap);
        // operator delete (spec 1), then the sdallocx it calls (spec 2).
        t.apply(&ev(7, 1, free(0x10)), Domain::Heap);
        t.apply(&ev(7, 2, free(0x10)), Domain::Heap);
        assert_eq!((t.counts().frees, t.counts().unmatched_frees), (1, 0));
        assert_eq!(t.counts().releases_seen_twice, 1);
        // A third is a release of its own (unmatched here).
        t.apply(&ev(7, 1, free(0x10)), Domain::Heap);
        assert_eq!(t.counts().unmatched_frees, 1);
        // Another thread's free of the same address is unmatched.
        t.apply(&ev(8, 2, free(0x10)), Domain::Heap);
        assert_eq!(t.counts().unmatched_frees, 2);
        // The same function twice in a row: two releases (allocations
        // filtered in the kernel).
        t.apply(&ev(9, 3, free(0x30)), Domain::Heap);
        t.apply(&ev(9, 3, free(0x30)), Domain::Heap);
        assert_eq!(t.counts().unmatched_frees, 4);
        // After an allocation of that thread, a repeat is no longer one.
        t.apply(&ev(7, 1, free(0x40)), Domain::Heap);
        t.apply(&ev(7, 0, alloc(0x20)), Domain::Heap);
        t.apply(&ev(7, 2, free(0x40)), Domain::Heap);
        assert_eq!(t.counts().unmatched_frees, 6);
        assert_eq!(t.counts().releases_seen_twice, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(action: Action) -> Event {
        Event {
            ts_ns: 1,
            pid: 1,
            tid: 2,
            spec: 0,
            py_stack: 0,
            action,
        }
    }

    fn alloc(addr: u64, size: u64) -> Event {
        event(Action::Alloc {
            addr,
            size,
            stack: StackRef::Id(1),
        })
    }

    fn realloc(old: u64, new: u64, size: u64) -> Event {
        event(Action::Realloc {
            old,
            new,
            size,
            stack: StackRef::Id(2),
            track_new: true,
        })
    }

    /// (stack, bytes, blocks), sorted.
    type Totals = Vec<(i32, u64, u64)>;

    /// The origin totals, and the same grouped from the blocks.
    fn origin_totals(table: &LiveTable) -> (Totals, Totals) {
        let mut kept: Vec<_> = table
            .origins()
            .map(|(o, t)| (o.stack.to_wire(), t.bytes, t.blocks))
            .collect();
        let mut grouped: HashMap<i32, (u64, u64)> = HashMap::new();
        for (_, _, _, block) in table.blocks() {
            let entry = grouped.entry(block.stack().to_wire()).or_default();
            entry.0 += block.size;
            entry.1 += 1;
        }
        let mut summed: Vec<_> = grouped.into_iter().map(|(s, (b, n))| (s, b, n)).collect();
        kept.sort();
        summed.sort();
        (kept, summed)
    }

    #[test]
    fn origin_totals_follow_every_change_of_the_table() {
        let mut table = LiveTable::new(100);
        table.apply(&alloc(0x10, 48), Domain::Heap);
        table.apply(&alloc(0x20, 16), Domain::Heap);
        assert_eq!(table.counts().addresses_reused, 0);
        // The same address handed out again: the old block is replaced, and
        // that is counted (its release went by unseen).
        table.apply(&alloc(0x20, 8), Domain::Heap);
        assert_eq!(table.counts().addresses_reused, 1);
        table.apply(&realloc(0x10, 0x30, 100), Domain::Heap);
        assert_eq!(
            table.counts().addresses_reused,
            1,
            "a realloc moves its block"
        );
        let (kept, summed) = origin_totals(&table);
        assert_eq!(kept, summed);
        assert_eq!(kept, vec![(1, 8, 1), (2, 100, 1)]);
        table.apply(&event(Action::Free { addr: 0x20 }), Domain::Heap);
        table.apply(&event(Action::Free { addr: 0x30 }), Domain::Heap);
        assert!(
            table.origins().next().is_none(),
            "emptied origins are dropped"
        );
    }

    #[test]
    fn an_exec_drops_every_block_of_its_process_there_and_says_how_many() {
        let mut table = LiveTable::new(100);
        table.apply(&alloc(0x10, 48), Domain::Heap);
        table.apply(&alloc(0x20, 16), Domain::CudaMemory);
        let other = Event {
            pid: 9,
            tid: 9,
            ..alloc(0x10, 8)
        };
        table.apply(&other, Domain::Heap);
        table.apply(&event(Action::Exec { old_tid: 2 }), Domain::Heap);
        assert_eq!(
            table.take_execs(),
            vec![ExecDrop {
                pid: 1,
                blocks: 2,
                bytes: 64,
                held: 0
            }]
        );
        assert!(table.take_execs().is_empty(), "taken once");
        // The other process keeps its block; the new image starts afresh,
        // and a release of an old block's address is its own business.
        assert_eq!((table.len(), table.live_bytes()), (1, 8));
        table.apply(&alloc(0x10, 32), Domain::Heap);
        assert_eq!(table.counts().addresses_reused, 0);
        let (kept, summed) = origin_totals(&table);
        assert_eq!(kept, summed);
    }

    #[test]
    fn alloc_then_free() {
        let mut table = LiveTable::new(100);
        table.apply(&alloc(0x10, 48), Domain::Heap);
        table.apply(&alloc(0x20, 16), Domain::Heap);
        assert_eq!((table.len(), table.live_bytes()), (2, 64));
        table.apply(&event(Action::Free { addr: 0x10 }), Domain::Heap);
        assert_eq!((table.len(), table.live_bytes()), (1, 16));
        assert_eq!(table.counts().frees, 1);
    }

    #[test]
    fn unknown_free_is_counted_not_an_error() {
        let mut table = LiveTable::new(100);
        table.apply(&event(Action::Free { addr: 0x99 }), Domain::Heap);
        assert_eq!(table.counts().unmatched_frees, 1);
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn realloc_semantics() {
        let mut table = LiveTable::new(100);
        // realloc(NULL, n) = malloc
        table.apply(&realloc(0, 0x10, 10), Domain::Heap);
        assert_eq!(table.live_bytes(), 10);
        // realloc(p, n) = free p + alloc
        table.apply(&realloc(0x10, 0x20, 30), Domain::Heap);
        assert_eq!((table.len(), table.live_bytes()), (1, 30));
        // in place
        table.apply(&realloc(0x20, 0x20, 40), Domain::Heap);
        assert_eq!((table.len(), table.live_bytes()), (1, 40));
        // realloc(p, 0) arrives as a free
        table.apply(&event(Action::Free { addr: 0x20 }), Domain::Heap);
        assert_eq!(table.len(), 0);
        assert_eq!(table.counts().unmatched_frees, 0);
        assert_eq!(table.counts().allocs, 3);
    }

    #[test]
    fn unsampled_realloc_target_is_not_tracked() {
        let mut table = LiveTable::new(100);
        table.apply(&alloc(0x10, 8), Domain::Heap);
        table.apply(
            &event(Action::Realloc {
                old: 0x10,
                new: 0x30,
                size: 9,
                stack: StackRef::Id(1),
                track_new: false,
            }),
            Domain::Heap,
        );
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn domains_do_not_mix() {
        let mut table = LiveTable::new(100);
        table.apply(&alloc(0x10, 8), Domain::Heap);
        table.apply(&alloc(0x10, 1 << 20), Domain::CudaMemory);
        table.apply(&event(Action::Free { addr: 0x10 }), Domain::CudaMemory);
        assert_eq!((table.len(), table.live_bytes()), (1, 8));
    }

    #[test]
    fn processes_do_not_mix() {
        let mut table = LiveTable::new(100);
        table.apply(&alloc(0x10, 8), Domain::Heap);
        let mut child = alloc(0x10, 24);
        child.pid = 7;
        table.apply(&child, Domain::Heap);
        assert_eq!((table.len(), table.live_bytes()), (2, 32));
        let mut child_free = event(Action::Free { addr: 0x10 });
        child_free.pid = 7;
        table.apply(&child_free, Domain::Heap);
        let left: Vec<(u32, u64)> = table.blocks().map(|(p, _, _, b)| (p, b.size)).collect();
        assert_eq!(left, vec![(1, 8)]);
        // A free of an address only the parent holds is unmatched in the child.
        table.apply(&child_free, Domain::Heap);
        assert_eq!(table.counts().unmatched_frees, 1);
    }

    #[test]
    fn failures_counted_per_code() {
        let mut table = LiveTable::new(100);
        table.apply(
            &event(Action::Failed { size: 0, code: 2 }),
            Domain::CudaMemory,
        );
        table.apply(
            &event(Action::Failed { size: 0, code: 2 }),
            Domain::CudaMemory,
        );
        assert_eq!(table.counts().failed.get(&(0, 2)), Some(&2));
        assert_eq!(table.len(), 0);
    }

    fn unmap(addr: u64, len: u64) -> Event {
        event(Action::Unmap { addr, len })
    }

    /// (address, size) of the live mappings, in address order.
    fn mapped(table: &LiveTable) -> Vec<(u64, u64)> {
        table
            .blocks()
            .filter(|(_, domain, _, _)| *domain == Domain::Mapping)
            .map(|(_, _, addr, block)| (addr, block.size))
            .collect()
    }

    #[test]
    fn unmapping_part_of_a_mapping_keeps_the_rest_with_its_origin() {
        const MIB: u64 = 1 << 20;
        let mut table = LiveTable::new(100);
        // glibc's new arena: 128 MiB mapped, the part past the aligned
        // 64 MiB unmapped.
        table.apply(&alloc(0x1000_0000, 128 * MIB), Domain::Mapping);
        table.apply(&unmap(0x1000_0000 + 64 * MIB, 64 * MIB), Domain::Mapping);
        assert_eq!(mapped(&table), vec![(0x1000_0000, 64 * MIB)]);
        assert_eq!(table.counts().mappings_trimmed, 1);
        assert_eq!(table.counts().frees, 0);
        // Unaligned: the head goes too, leaving the middle.
        table.apply(&alloc(0x2000_0000, 10 * MIB), Domain::Mapping);
        table.apply(&unmap(0x2000_0000, 3 * MIB), Domain::Mapping);
        table.apply(&unmap(0x2000_0000 + 9 * MIB, MIB), Domain::Mapping);
        // A hole punched in the middle splits one mapping in two.
        table.apply(&unmap(0x2000_0000 + 5 * MIB, MIB), Domain::Mapping);
        assert_eq!(
            mapped(&table),
            vec![
                (0x1000_0000, 64 * MIB),
                (0x2000_0000 + 3 * MIB, 2 * MIB),
                (0x2000_0000 + 6 * MIB, 3 * MIB)
            ]
        );
        assert_eq!(table.counts().mappings_trimmed, 4);
        let (kept, summed) = origin_totals(&table);
        assert_eq!(kept, summed);
        assert_eq!(kept, vec![(1, 69 * MIB, 3)]);
        // One range over several mappings releases each wholly inside.
        table.apply(&unmap(0x2000_0000, 16 * MIB), Domain::Mapping);
        assert_eq!(mapped(&table), vec![(0x1000_0000, 64 * MIB)]);
        assert_eq!(table.counts().frees, 2);
        // A range meeting nothing traced (a file mapping, one made before
        // the attach) is counted apart, not as an unmatched free.
        table.apply(&unmap(0x5000_0000, MIB), Domain::Mapping);
        assert_eq!(table.counts().unmaps_untracked, 1);
        assert_eq!(table.counts().unmatched_frees, 0);
        // Another process's mapping at the same address is not touched.
        let mut other = unmap(0x1000_0000, 64 * MIB);
        other.pid = 9;
        table.apply(&other, Domain::Mapping);
        assert_eq!(mapped(&table), vec![(0x1000_0000, 64 * MIB)]);
        table.apply(&unmap(0x1000_0000, 64 * MIB), Domain::Mapping);
        assert!(mapped(&table).is_empty());
        assert!(table.origins().next().is_none());
    }

    #[test]
    fn after_the_end_only_blocks_made_before_are_settled() {
        let at = |ts_ns: u64, event: Event| Event { ts_ns, ..event };
        let mut table = LiveTable::new(100);
        table.apply(&at(10, alloc(0x10, 8)), Domain::Heap);
        table.apply(&at(10, alloc(0x20, 8)), Domain::Heap);
        table.close(20);
        // A call entered before the end returns after it: tracked.
        table.apply(&at(21, alloc(0x30, 8)), Domain::Heap);
        // Released after the end: not live at the report.
        table.apply(&at(22, event(Action::Free { addr: 0x10 })), Domain::Heap);
        // A block live at the end moved by realloc stays live.
        table.apply(&at(23, realloc(0x20, 0x40, 16)), Domain::Heap);
        // Made after the end (its malloc unwatched): neither its realloc nor
        // its free count, and nothing is created.
        table.apply(&at(24, realloc(0x50, 0x60, 32)), Domain::Heap);
        table.apply(&at(25, realloc(0, 0x70, 32)), Domain::Heap);
        table.apply(&at(26, event(Action::Free { addr: 0x60 })), Domain::Heap);
        let live: Vec<(u64, u64)> = table.blocks().map(|(_, _, a, b)| (a, b.size)).collect();
        assert_eq!(live, vec![(0x30, 8), (0x40, 16)]);
        assert_eq!(table.counts().unmatched_frees, 0);
        assert_eq!(table.counts().frees, 2);
        // Events stamped before the end still count as usual.
        table.apply(&at(19, event(Action::Free { addr: 0x99 })), Domain::Heap);
        assert_eq!(table.counts().unmatched_frees, 1);
        // Closing twice keeps the first end.
        table.close(1000);
        table.apply(&at(30, event(Action::Free { addr: 0x98 })), Domain::Heap);
        assert_eq!(table.counts().unmatched_frees, 1);
    }

    #[test]
    fn cap_is_counted() {
        let mut table = LiveTable::new(1);
        table.apply(&alloc(0x10, 8), Domain::Heap);
        table.apply(&alloc(0x20, 8), Domain::Heap);
        assert_eq!((table.len(), table.counts().table_full), (1, 1));
    }
}

#[cfg(test)]
mod late_event_tests {
    use super::*;
    use crate::event::{Action, Event, StackRef};

    fn at(ts_ns: u64, tid: u32, action: Action) -> Event {
        Event {
            ts_ns,
            pid: 1,
            tid,
            spec: 0,
            action,
            py_stack: 0,
        }
    }

    fn alloc(addr: u64, size: u64) -> Action {
        Action::Alloc {
            addr,
            size,
            stack: StackRef::NotRequested,
        }
    }

    #[test]
    fn a_held_block_taken_late_is_live_and_released_by_a_later_release() {
        let mut t = LiveTable::new(100);
        // Thread 2's events at t=20 arrive first; thread 1's block made at
        // t=10 arrives after them (it was held in the kernel).
        t.apply(&at(20, 2, alloc(0x20, 8)), Domain::Heap);
        t.apply(&at(10, 1, alloc(0x10, 16)), Domain::Heap);
        assert_eq!(t.len(), 2);
        t.apply(&at(30, 2, Action::Free { addr: 0x10 }), Domain::Heap);
        assert_eq!(t.len(), 1);
        assert_eq!(t.counts().frees, 1);
        assert_eq!(t.counts().unmatched_frees, 0);
    }

    #[test]
    fn events_of_an_earlier_block_at_the_same_address_do_not_touch_the_later_one() {
        let mut t = LiveTable::new(100);
        // The later block (t=50) was taken from the kernel before the
        // earlier block's allocation (t=10) and release (t=20) were read.
        t.apply(&at(50, 1, alloc(0x10, 64)), Domain::Heap);
        t.apply(&at(10, 2, alloc(0x10, 8)), Domain::Heap);
        t.apply(&at(20, 2, Action::Free { addr: 0x10 }), Domain::Heap);
        let blocks: Vec<_> = t.blocks().map(|(_, _, addr, b)| (addr, b.size)).collect();
        assert_eq!(blocks, vec![(0x10, 64)]);
        assert_eq!(t.counts().allocs, 2);
        assert_eq!(t.counts().frees, 1);
        assert_eq!(t.counts().unmatched_frees, 0);
        // A release older than the block with no earlier block to settle is
        // unmatched (its block predates the trace).
        t.apply(&at(30, 2, Action::Free { addr: 0x10 }), Domain::Heap);
        assert_eq!(t.counts().unmatched_frees, 1);
        assert_eq!(t.len(), 1);
        t.apply(&at(60, 1, Action::Free { addr: 0x10 }), Domain::Heap);
        assert_eq!(t.len(), 0);
        assert_eq!(t.counts().frees, 2);
    }

    #[test]
    fn in_order_events_with_equal_times_behave_as_before() {
        let mut t = LiveTable::new(100);
        t.apply(&at(5, 1, alloc(0x10, 8)), Domain::Heap);
        t.apply(&at(5, 1, Action::Free { addr: 0x10 }), Domain::Heap);
        assert_eq!(t.len(), 0);
        assert_eq!(t.counts().frees, 1);
    }
}
