//! The leak check's pure part: given the live blocks memtrace tracked
//! (nodes), the root memory of the process, its registers and a way to read
//! its memory, which blocks nothing points to any more. The categories and
//! rules are valgrind memcheck's (`--leak-check=full`, default heuristics),
//! by behaviour:
//!
//! - aligned 8-byte words; a word points to a node when it equals its start
//!   (a start pointer) or lies inside it (an interior pointer); a zero-size
//!   node is pointed to at its start only;
//! - marking from the roots: a start pointer (or an interior pointer one of
//!   the [`heuristics`] accepts) found in a root or in a *reachable* block
//!   makes its block reachable; any other pointer found in a root or a
//!   block already marked makes an unmarked block possibly lost. A block
//!   upgraded is scanned again, so what it points to is upgraded too;
//! - cliques: every block still unmarked, in address order, leads a clique:
//!   what it reaches of the unmarked blocks (any pointer, transitively) is
//!   indirectly lost, an earlier leader among them included; the leaders
//!   are definitely lost.
//!
//! memtrace's own additions: device blocks (`scan: false`) are nodes that
//! are never read; memory owned by a GPU/NPU runtime (`runtime_owned`
//! roots and nodes: the driver's tables) never marks a device block.
//!
//! Provenance (`Input::provenance`): for each marked node, the word that
//! gave it its state (a register, a root word, or a word inside another
//! node), so [`chain`] can say why a block was kept or lost.
//!
//! Reads go through [`Memory`]: whole regions in large chunks, block
//! contents in batches (`read_many`), so a process is read with few system
//! calls. Nothing here recurses: a chain of millions of blocks is a loop.
//!
//! How pass 1 marks: blocks marked wait on a stack; a few are read in a
//! batch, many (a level of a wide graph) are swept in address order, their
//! neighbours read together. With few small nodes (under [`SORT_MIN_NODES`],
//! of under [`SORT_MIN_NODE_BYTES`] on average) each word found is looked
//! up at once: the index and the states sit in the caches. With millions,
//! a lookup at random is a few cache misses (and with big nodes, words
//! are many for each node), so the
//! words found wait (in [`found`], their value and whether their memory was
//! definite or the runtime's) until a batch of them is full or nothing is
//! left to scan; the batch is radix-sorted (to 1/2^24th of the span of
//! each dense region of them: the heap, the mmapped blocks far above it)
//! and looked up in address order, each lookup walking on from the
//! one before (nodes that overlap: a lookup each), and what it marks waits
//! in turn: marking goes level by level, a level looked up in batches. A
//! level of a few words (a long list) is sorted by comparison. With
//! disjoint nodes, the words in the densest region (the heap) are not
//! sorted: [`rank`] finds each one's node in one cache line, fetched ahead
//! while earlier words are marked, and a start pointer to a block already
//! reachable is done there.
//! The words' order changes nothing of the categories (the marking is a
//! fixpoint; a block upgraded is scanned again); what it may change is
//! which of several words is kept as a mark, and which heuristic is named
//! when interior pointers of different shapes reach a block.

mod found;
mod heuristics;
mod index;
mod rank;

use std::collections::HashMap;

use found::{Found, Traced};
use index::Index;
use rank::{Hit, Rank};

/// A live block: the nodes of the graph. 16 bytes (a heap of 10M blocks
/// makes 160 MB of them): its kind sits in the size's top bits.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Node {
    pub start: u64,
    /// The size, less [`NOT_SCANNED`] and [`RUNTIME_OWNED`].
    size_and_kind: u64,
}

/// Device memory, never read (host memory is read when reached).
const NOT_SCANNED: u64 = 1 << 63;
/// Allocated by a GPU/NPU runtime for itself: its pointers never mark a
/// device block.
const RUNTIME_OWNED: u64 = 1 << 62;
/// The largest size a node keeps (larger ones are cut: no address space
/// holds them).
const SIZE_MASK: u64 = RUNTIME_OWNED - 1;

impl Node {
    /// A block: `scan` for host memory (read when reached), not for
    /// device memory; `runtime_owned` for a GPU/NPU runtime's own block.
    pub fn new(start: u64, size: u64, scan: bool, runtime_owned: bool) -> Node {
        Node {
            start,
            size_and_kind: size.min(SIZE_MASK)
                | if scan { 0 } else { NOT_SCANNED }
                | if runtime_owned { RUNTIME_OWNED } else { 0 },
        }
    }

    /// A host block: scanned when reached, the program's own.
    pub fn host(start: u64, size: u64) -> Node {
        Node::new(start, size, true, false)
    }

    #[inline(always)]
    pub fn size(self) -> u64 {
        self.size_and_kind & SIZE_MASK
    }

    /// Host memory, read when reached; false for device memory.
    #[inline(always)]
    pub fn scan(self) -> bool {
        self.size_and_kind & NOT_SCANNED == 0
    }

    /// Allocated by a GPU/NPU runtime for itself.
    #[inline(always)]
    pub fn runtime_owned(self) -> bool {
        self.size_and_kind & RUNTIME_OWNED != 0
    }

    /// Where it ends (a zero-size node covers its start only).
    #[inline(always)]
    pub fn end(self) -> u64 {
        self.start.saturating_add(self.size().max(1))
    }
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("start", &format_args!("{:#x}", self.start))
            .field("size", &self.size())
            .field("scan", &self.scan())
            .field("runtime_owned", &self.runtime_owned())
            .finish()
    }
}

/// Memory scanned whole for pointers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootRegion {
    pub start: u64,
    pub len: u64,
    /// A GPU/NPU runtime's own memory: its pointers never mark a device block.
    pub runtime_owned: bool,
}

/// valgrind's leak categories.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Category {
    DefinitelyLost,
    IndirectlyLost,
    PossiblyLost,
    StillReachable,
}

impl Category {
    pub const ALL: [Category; 4] = [
        Category::DefinitelyLost,
        Category::IndirectlyLost,
        Category::PossiblyLost,
        Category::StillReachable,
    ];
}

/// The heuristic through which a block was found reachable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Heuristic {
    StdString,
    Length64,
    NewArray,
    MultipleInheritance,
}

impl Heuristic {
    /// Its name as valgrind's `--leak-check-heuristics` writes it.
    pub fn name(self) -> &'static str {
        match self {
            Heuristic::StdString => "stdstring",
            Heuristic::Length64 => "length64",
            Heuristic::NewArray => "newarray",
            Heuristic::MultipleInheritance => "multipleinheritance",
        }
    }
}

/// One node's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub category: Category,
    /// Reachable only through an interior pointer this heuristic accepted.
    pub heuristic: Option<Heuristic>,
}

/// Reads the target's memory.
pub trait Memory {
    /// Fills `buf` from `addr`; returns the bytes really read (what could
    /// not be read is left as zeros, and counted by the implementation).
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> usize;

    /// Says `[addr, addr + len)` is to be read soon, in address order: an
    /// implementation may read it ahead, beside the work on what it read
    /// before. A hint: nothing is read for the caller.
    fn prefetch(&mut self, _addr: u64, _len: u64) {}

    /// Reads several ranges into consecutive parts of `buf` (whose length
    /// is their sum); an implementation may do it in one system call.
    fn read_many(&mut self, ranges: &[(u64, usize)], buf: &mut [u8]) {
        let mut at = 0;
        for &(addr, len) in ranges {
            self.read(addr, &mut buf[at..at + len]);
            at += len;
        }
    }
}

/// Where the word that marked a node was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Register `index` of [`Input::registers`].
    Register { index: usize },
    /// A word of root memory at `at`.
    Root { at: u64 },
    /// A word at `at` inside node `node` (an input index).
    Block { node: usize, at: u64 },
}

/// One node's mark: the word's value and where it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mark {
    pub source: Source,
    pub value: u64,
}

/// What the classification reads.
pub struct Input<'a> {
    pub nodes: &'a [Node],
    pub roots: &'a [RootRegion],
    /// Every general-purpose register of every stopped thread.
    pub registers: &'a [u64],
    /// Whether an address may be a vtable's (multiple-inheritance heuristic).
    pub vtable: &'a dyn Fn(u64) -> bool,
    /// Keep each node's [`Mark`] (for explanations; one entry per node).
    pub provenance: bool,
    /// Keep each node's first word, as the scan read it
    /// ([`Outcome::first_words`]).
    pub first_words: bool,
}

/// The classification's result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// One per input node, in input order.
    pub verdicts: Vec<Verdict>,
    /// Bytes read and scanned for pointers (roots and blocks).
    pub scanned_bytes: u64,
    /// Words that pointed into some node.
    pub hits: u64,
    /// With `Input::provenance`: per input node, the word that gave it its
    /// category (none for a definitely lost block, nor an unmarked one).
    pub marks: Vec<Option<Mark>>,
    /// With `Input::first_words`: per input node, its first word (0 for a
    /// node never read: device memory, under 8 bytes, or past the deadline).
    pub first_words: Vec<u64>,
}

/// The chain of marks that kept node `node` (an input index) in its
/// category, from the node back to a root or register (or to the leader
/// of its clique, for an indirectly lost block): each step is the node and
/// the mark that marked it. Empty when the node had no mark.
pub fn chain(marks: &[Option<Mark>], node: usize) -> Vec<(usize, Mark)> {
    let mut steps = Vec::new();
    let mut at = node;
    // Marks form a forest (a mark always names a node marked earlier);
    // the bound is a guard, never reached.
    while steps.len() <= marks.len() {
        let Some(mark) = marks.get(at).copied().flatten() else {
            break;
        };
        steps.push((at, mark));
        match mark.source {
            Source::Block { node, .. } => at = node,
            _ => break,
        }
    }
    steps
}

const UNREACHED: u8 = 0;
const POSSIBLE: u8 = 1;
const REACHABLE: u8 = 2;
const INDIRECT: u8 = 3;
/// Unreached, and already the leader of its clique.
const LEADER: u8 = 4;

/// Bytes read at once from a root region, and at most per batch of blocks.
const CHUNK: usize = 1 << 20;
/// Blocks read in one batch (`process_vm_readv` takes 1024 ranges).
const BATCH: usize = 1024;
/// With this many blocks waiting, pass 1 sweeps them in address order,
/// reading neighbours together (a heap's blocks are adjacent: one large
/// read instead of a range each).
const SWEEP_MIN: usize = 4096;
/// A sweep reads across a gap between waiting blocks up to this long.
const SWEEP_GAP: u64 = 64 << 10;
/// A sweep going on close by has this much memory after its window read
/// ahead ([`Memory::prefetch`]).
const SWEEP_AHEAD: u64 = 3 * CHUNK as u64;
/// A state no node has: never scanned.
const NEVER: u8 = u8::MAX;
/// With at least this many nodes, pass 1 looks the words it finds up in
/// sorted batches: the index and the states no longer fit in the caches.
const SORT_MIN_NODES: usize = 1 << 18;
/// With nodes of this many bytes on average, pass 1 looks words up in
/// sorted batches whatever their count (`reach::bench`: 10k blocks of
/// 100 KiB marked in 0.38 s sorted, 0.50 s word by word).
const SORT_MIN_NODE_BYTES: u64 = 4096;
/// Words waiting for a sorted lookup, at least and at most (between, one
/// per node: a batch spread over all nodes touches each cache line of
/// their arrays a few times at most).
const SORT_BATCH_MIN: usize = 1 << 16;
const SORT_BATCH_MAX: usize = 1 << 22;

/// Direct lookups ([`Marker::mark_direct`]): words ahead whose bit of the
/// plain bitmap is fetched, whose line is, and whose node's data is.
const PLAIN_AHEAD: usize = 48;
const LINE_AHEAD: usize = 32;
const NODE_AHEAD: usize = 16;

/// Where a waiting word with provenance was found.
fn traced_source(t: &Traced) -> Source {
    match t.node {
        found::ROOT => Source::Root { at: t.at },
        node => Source::Block {
            node: node as usize,
            at: t.at,
        },
    }
}

/// How pass 1 looks words up (fixed by the node count; tests vary it).
#[derive(Clone, Copy, Debug)]
struct Tuning {
    /// Look words up in sorted batches.
    sorted: bool,
    /// Words a batch holds before it is looked up.
    batch: usize,
    /// With sorted batches and disjoint nodes: the densest region's words
    /// looked up directly ([`rank`]), not sorted.
    direct: bool,
}

impl Tuning {
    /// Sorted with many nodes, or with big ones (their words are many
    /// even when the nodes are few: sorted, each word's lookup starts next
    /// to the last one's).
    fn for_nodes(nodes: &[Node]) -> Tuning {
        let scanned: u64 = nodes.iter().filter(|n| n.scan()).map(|n| n.size()).sum();
        let count = nodes.len();
        Tuning {
            sorted: count >= SORT_MIN_NODES
                || scanned / (count.max(1) as u64) >= SORT_MIN_NODE_BYTES,
            batch: count.clamp(SORT_BATCH_MIN, SORT_BATCH_MAX),
            direct: true,
        }
    }
}

/// The marking's state. Nodes are numbered by their position in address
/// order (the index's), so a node's data, state and neighbours sit
/// together; the verdicts go back to input order at the end.
struct Marker<'a> {
    /// The nodes, in address order (the input itself when it is in that
    /// order already: a heap walked).
    index: Index<'a>,
    state: Vec<u8>,
    heuristic: Vec<Option<Heuristic>>,
    stack: Vec<u32>,
    /// The state each node had when it was last scanned (pass 1): a node
    /// waiting twice, or upgraded after it was scheduled, is scanned once
    /// per state.
    scanned_as: Vec<u8>,
    /// Nodes a sweep is to scan (a bit per position), while it runs.
    pending: Vec<u64>,
    vtable: &'a dyn Fn(u64) -> bool,
    /// The first two words of blocks a heuristic has read.
    first_words: HashMap<u32, (Option<u64>, Option<u64>)>,
    scanned: u64,
    hits: u64,
    /// Per position: the mark that set its state (with provenance).
    marks: Option<Vec<Option<Mark>>>,
    /// Where the words being scanned come from: a root (`None`) or a node.
    scanning: Option<u32>,
    /// Words found in pass 1 waiting for a sorted lookup (with many nodes).
    waiting: Option<Found>,
    /// With `waiting` and disjoint nodes: direct lookups in the densest
    /// region (words there wait, but are not sorted).
    rank: Option<Rank>,
    /// Per position: the node's first word, once scanned (with
    /// `Input::first_words`).
    heads: Option<Vec<u64>>,
}

/// Splits the nodes into valgrind's four categories.
pub fn classify(input: &Input<'_>, memory: &mut dyn Memory) -> Outcome {
    classify_tuned(input, memory, Tuning::for_nodes(input.nodes))
}

fn classify_tuned(input: &Input<'_>, memory: &mut dyn Memory, tuning: Tuning) -> Outcome {
    let index = Index::new(input.nodes);
    let (low, high) = index.bounds();
    // An entry keeps the word less `low` in its low 62 bits.
    let waiting = (tuning.sorted && high.saturating_sub(low) <= found::KEY)
        .then(|| Found::new(low, tuning.batch, input.provenance));
    let rank = waiting
        .as_ref()
        .filter(|_| index.disjoint() && tuning.direct)
        .and_then(|_| index.densest())
        .and_then(|(first, last, end)| {
            let starts = index.nodes()[first..=last].iter().map(|n| n.start);
            Rank::new(starts, first, end)
        });
    let mut marker = Marker {
        index,
        state: vec![UNREACHED; input.nodes.len()],
        heuristic: vec![None; input.nodes.len()],
        stack: Vec::new(),
        scanned_as: vec![NEVER; input.nodes.len()],
        pending: Vec::new(),
        vtable: input.vtable,
        first_words: HashMap::new(),
        scanned: 0,
        hits: 0,
        marks: input.provenance.then(|| vec![None; input.nodes.len()]),
        scanning: None,
        waiting,
        rank,
        heads: input.first_words.then(|| vec![0; input.nodes.len()]),
    };
    // Pass 1: from the roots.
    for (index, &word) in input.registers.iter().enumerate() {
        marker.found(word, Source::Register { index }, true, false, memory);
    }
    let mut buf = vec![0u8; CHUNK];
    for root in input.roots {
        let end = root.start.saturating_add(root.len);
        let mut at = root.start.next_multiple_of(8);
        while at < end {
            let len = ((end - at) as usize).min(CHUNK) & !7;
            if len == 0 {
                break;
            }
            memory.prefetch(at, end - at);
            memory.read(at, &mut buf[..len]);
            marker.scanned += len as u64;
            marker.scanning = None;
            marker.scan_words(&buf[..len], at, true, root.runtime_owned, memory);
            at += len as u64;
        }
    }
    marker.drain(memory, &mut buf);
    // Pass 2: cliques of what is left, in address order.
    for leader in 0..marker.index.nodes().len() as u32 {
        if marker.state[leader as usize] != UNREACHED {
            continue;
        }
        marker.state[leader as usize] = LEADER;
        marker.stack.push(leader);
        marker.drain_clique(leader, memory, &mut buf);
    }
    let index = &marker.index;
    let marks = marker.marks.take().map_or_else(Vec::new, |by_position| {
        if index.in_input_order() {
            return by_position;
        }
        let mut marks = vec![None; input.nodes.len()];
        for (position, mark) in by_position.into_iter().enumerate() {
            marks[index.input(position)] = mark.map(|mark| Mark {
                source: match mark.source {
                    Source::Block { node, at } => Source::Block {
                        node: index.input(node),
                        at,
                    },
                    other => other,
                },
                ..mark
            });
        }
        marks
    });
    let first_words = marker.heads.take().map_or_else(Vec::new, |by_position| {
        if index.in_input_order() {
            return by_position;
        }
        let mut words = vec![0; input.nodes.len()];
        for (position, word) in by_position.into_iter().enumerate() {
            words[index.input(position)] = word;
        }
        words
    });
    let mut verdicts = vec![
        Verdict {
            category: Category::DefinitelyLost,
            heuristic: None,
        };
        input.nodes.len()
    ];
    for (position, (&state, &heuristic)) in marker.state.iter().zip(&marker.heuristic).enumerate() {
        verdicts[index.input(position)] = Verdict {
            category: match state {
                REACHABLE => Category::StillReachable,
                POSSIBLE => Category::PossiblyLost,
                INDIRECT => Category::IndirectlyLost,
                _ => Category::DefinitelyLost,
            },
            heuristic: if state == REACHABLE { heuristic } else { None },
        };
    }
    Outcome {
        verdicts,
        scanned_bytes: marker.scanned,
        hits: marker.hits,
        marks,
        first_words,
    }
}

impl Marker<'_> {
    /// Words of memory owned by a reachable block or a root (`definite`),
    /// or a possibly lost block, or the runtime.
    /// `bytes` were read at `base`.
    fn scan_words(
        &mut self,
        bytes: &[u8],
        base: u64,
        definite: bool,
        runtime: bool,
        memory: &mut dyn Memory,
    ) {
        if self.waiting.is_some() {
            self.defer_words(bytes, base, definite, runtime, memory);
            return;
        }
        for (k, word) in bytes.chunks_exact(8).enumerate() {
            let value = u64::from_le_bytes([
                word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
            ]);
            if self.index.may_hit(value) {
                let at = base + 8 * k as u64;
                let source = match self.scanning {
                    Some(node) => Source::Block {
                        node: node as usize,
                        at,
                    },
                    None => Source::Root { at },
                };
                self.found(value, source, definite, runtime, memory);
            }
        }
    }

    /// [`Marker::scan_words`] with sorted lookups: the words that may point
    /// into a node wait in `waiting`, looked up whenever it is full.
    fn defer_words(
        &mut self,
        bytes: &[u8],
        base: u64,
        definite: bool,
        runtime: bool,
        memory: &mut dyn Memory,
    ) {
        let flags =
            if definite { found::DEFINITE } else { 0 } | if runtime { found::RUNTIME } else { 0 };
        let traced = self.marks.is_some();
        let node = self.scanning.unwrap_or(found::ROOT);
        let mut words = bytes.chunks_exact(8).enumerate();
        // Words in the rank's region wait apart: looked up directly.
        let (direct_from, direct_span) = self.rank.as_ref().map_or((0, 0), |rank| {
            let (start, end) = rank.region();
            (start, end - start)
        });
        loop {
            let Some(waiting) = self.waiting.as_mut() else {
                return;
            };
            let (low, span) = (
                waiting.low,
                self.index.bounds().1.saturating_sub(waiting.low),
            );
            let mut left = waiting.limit.saturating_sub(waiting.len());
            if left == 0 {
                self.flush(memory);
                continue;
            }
            for (k, word) in words.by_ref() {
                let value = u64::from_le_bytes([
                    word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
                ]);
                let key = value.wrapping_sub(low);
                if key < span {
                    let direct = value.wrapping_sub(direct_from) < direct_span;
                    match (traced, direct) {
                        (true, _) => {
                            let t = Traced {
                                entry: key | flags,
                                at: base + 8 * k as u64,
                                node,
                            };
                            if direct {
                                waiting.direct_traced.push(t);
                            } else {
                                waiting.traced.push(t);
                            }
                        }
                        (false, true) => waiting.direct.push(key | flags),
                        (false, false) => waiting.words.push(key | flags),
                    }
                    left -= 1;
                    if left == 0 {
                        break;
                    }
                }
            }
            if left > 0 {
                return;
            }
            self.flush(memory);
        }
    }

    /// Looks the waiting words up in address order and marks what they
    /// point to; false when none was waiting.
    fn flush(&mut self, memory: &mut dyn Memory) -> bool {
        let Some(waiting) = self.waiting.as_mut() else {
            return false;
        };
        if waiting.is_empty() {
            return false;
        }
        let low = waiting.low;
        let mut batch = waiting.take();
        let unused = Source::Root { at: 0 };
        self.drop_plain(low, &mut batch.direct);
        self.drop_plain(low, &mut batch.direct_traced);
        self.mark_direct(low, &batch.direct, |_| unused, memory);
        self.mark_direct(low, &batch.direct_traced, traced_source, memory);
        let disjoint = self.index.disjoint();
        let mut cursor = 0;
        for &entry in &batch.words {
            let definite = entry & found::DEFINITE != 0;
            let runtime = entry & found::RUNTIME != 0;
            let word = (entry & found::KEY) + low;
            if !disjoint {
                self.found(word, unused, definite, runtime, memory);
            } else if let Some(n) = self.index.find_near(word, &mut cursor) {
                self.hits += 1;
                self.mark(word, n, unused, definite, runtime, memory);
            }
        }
        for t in &batch.traced {
            let definite = t.entry & found::DEFINITE != 0;
            let runtime = t.entry & found::RUNTIME != 0;
            self.found(
                (t.entry & found::KEY) + low,
                traced_source(t),
                definite,
                runtime,
                memory,
            );
        }
        if let Some(waiting) = self.waiting.as_mut() {
            waiting.put_back(batch);
        }
        true
    }

    /// Drops the words of `items` (in `rank`'s region) that are start
    /// pointers to blocks already plainly reachable (nothing they could
    /// change: a plain block is reachable without a heuristic), counting
    /// them as hits: a pass of one bit each, fetched [`PLAIN_AHEAD`] words
    /// ahead, before the costlier lookups of the others.
    fn drop_plain<T: found::Entry + Copy>(&mut self, low: u64, items: &mut Vec<T>) {
        let Some(rank) = self.rank.as_ref() else {
            return;
        };
        let word_of = |item: &T| (item.entry() & found::KEY) + low;
        let mut kept = 0;
        for k in 0..items.len() {
            if let Some(later) = items.get(k + PLAIN_AHEAD) {
                rank.prefetch_plain(word_of(later));
            }
            let item = items[k];
            if !rank.plain(word_of(&item)) {
                items[kept] = item;
                kept += 1;
            }
        }
        self.hits += (items.len() - kept) as u64;
        items.truncate(kept);
    }

    /// Marks what the words of `items` (in `rank`'s region) point to, in
    /// the order found. Each word's bit of the plain bitmap is fetched
    /// [`PLAIN_AHEAD`] words ahead; its line [`LINE_AHEAD`] words ahead,
    /// unless the bit settled it; its node's end and state [`NODE_AHEAD`]
    /// words ahead: the misses of many words overlap.
    fn mark_direct<T: found::Entry>(
        &mut self,
        low: u64,
        items: &[T],
        source: impl Fn(&T) -> Source,
        memory: &mut dyn Memory,
    ) {
        let word_of = |item: &T| (item.entry() & found::KEY) + low;
        let mut ahead = [None; NODE_AHEAD];
        if let Some(rank) = self.rank.as_ref() {
            for (k, item) in items.iter().take(NODE_AHEAD).enumerate() {
                ahead[k] = rank.lookup(word_of(item));
            }
        }
        for (k, item) in items.iter().enumerate() {
            let Some(rank) = self.rank.as_ref() else {
                return;
            };
            if let Some(later) = items.get(k + PLAIN_AHEAD) {
                rank.prefetch_plain(word_of(later));
            }
            if let Some(later) = items.get(k + LINE_AHEAD).map(word_of) {
                if !rank.plain(later) {
                    rank.prefetch(later);
                }
            }
            let hit = ahead[k % NODE_AHEAD];
            ahead[k % NODE_AHEAD] = items.get(k + NODE_AHEAD).and_then(|later| {
                let found = rank.lookup(word_of(later));
                if let Some(Hit::Node { position, start }) = found {
                    let i = position as usize;
                    if !start {
                        rank::prefetch(&self.index.nodes()[i]);
                    }
                    rank::prefetch(&self.state[i]);
                    rank::prefetch(&self.heuristic[i]);
                }
                found
            });
            let (n, start) = match hit {
                None => continue,
                Some(Hit::Plain) => {
                    // Into a plainly reachable node: nothing changes.
                    self.hits += 1;
                    continue;
                }
                Some(Hit::Node { position, start }) => (position, start),
            };
            let word = word_of(item);
            // A start pointer is inside its node (of one byte at least).
            if !start && self.index.node(n as usize).end() <= word {
                continue;
            }
            self.hits += 1;
            let entry = item.entry();
            self.mark_known(
                word,
                n,
                start,
                source(item),
                entry & found::DEFINITE != 0,
                entry & found::RUNTIME != 0,
                memory,
            );
        }
    }

    /// Notes the node starting at `start` plainly reachable for direct
    /// lookups.
    #[inline]
    fn set_plain(&mut self, start: u64) {
        if let Some(rank) = self.rank.as_mut() {
            rank.set_plain(start);
        }
    }

    /// Notes what set node `n`'s state (with provenance).
    fn note(&mut self, n: u32, source: Source, value: u64) {
        if let Some(marks) = self.marks.as_mut() {
            marks[n as usize] = Some(Mark { source, value });
        }
    }

    /// A word found in pass 1.
    #[inline(never)]
    fn found(
        &mut self,
        word: u64,
        source: Source,
        definite: bool,
        runtime: bool,
        memory: &mut dyn Memory,
    ) {
        let mut targets: [u32; 4] = [0; 4];
        let mut count = 0;
        let mut more: Vec<u32> = Vec::new();
        self.index.find(word, |n| {
            if count < targets.len() {
                targets[count] = n;
                count += 1;
            } else {
                more.push(n);
            }
        });
        if count == 0 {
            return;
        }
        self.hits += 1;
        for n in targets[..count].iter().copied().chain(more) {
            self.mark(word, n, source, definite, runtime, memory);
        }
    }

    fn mark(
        &mut self,
        word: u64,
        n: u32,
        source: Source,
        definite: bool,
        runtime: bool,
        memory: &mut dyn Memory,
    ) {
        let start = word == self.index.node(n as usize).start;
        self.mark_known(word, n, start, source, definite, runtime, memory);
    }

    /// [`Marker::mark`] with whether `word` is node `n`'s start known.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn mark_known(
        &mut self,
        word: u64,
        n: u32,
        start: bool,
        source: Source,
        definite: bool,
        runtime: bool,
        memory: &mut dyn Memory,
    ) {
        let i = n as usize;
        // What most words find (a reachable block) is decided from the
        // index and the state alone, the node itself left unread.
        let state = self.state[i];
        if runtime && !self.index.nodes()[i].scan() {
            return;
        }
        if state == REACHABLE {
            // A start pointer from reachable memory: reachable plainly,
            // not through a heuristic.
            if start && definite && self.heuristic[i].is_some() {
                self.heuristic[i] = None;
                self.note(n, source, word);
                self.set_plain(word);
            }
            return;
        }
        let via = if start {
            Some(None)
        } else if definite {
            self.heuristic_for(word, n, memory).map(Some)
        } else {
            None
        };
        match via {
            Some(heuristic) if definite => {
                self.state[i] = REACHABLE;
                self.heuristic[i] = heuristic;
                self.stack.push(n);
                self.note(n, source, word);
                if heuristic.is_none() {
                    // Reached by its start pointer: `word` is its start.
                    self.set_plain(word);
                }
            }
            _ if state == UNREACHED => {
                self.state[i] = POSSIBLE;
                self.stack.push(n);
                self.note(n, source, word);
            }
            _ => {}
        }
    }

    /// The heuristic accepting an interior pointer `word` into node `n`.
    fn heuristic_for(&mut self, word: u64, n: u32, memory: &mut dyn Memory) -> Option<Heuristic> {
        let node = self.index.nodes()[n as usize];
        if !node.scan() {
            return None;
        }
        let (first, second) = *self.first_words.entry(n).or_insert_with(|| {
            let mut bytes = [0u8; 16];
            let len = (node.size().min(16) as usize) & !7;
            let read = memory.read(node.start, &mut bytes[..len]);
            let word_at = |k: usize| {
                (read >= (k + 1) * 8).then(|| {
                    u64::from_le_bytes(bytes[k * 8..k * 8 + 8].try_into().unwrap_or([0; 8]))
                })
            };
            (word_at(0), word_at(1))
        });
        let at_pointer = if word.is_multiple_of(8) && word + 8 <= node.start + node.size() {
            let mut bytes = [0u8; 8];
            (memory.read(word, &mut bytes) == 8).then(|| u64::from_le_bytes(bytes))
        } else {
            None
        };
        heuristics::accepts(
            word,
            node.start,
            node.size(),
            &heuristics::Words {
                first,
                second,
                at_pointer,
            },
            self.vtable,
        )
    }

    /// Takes up to [`BATCH`] scannable blocks off the stack (at most
    /// [`CHUNK`] bytes, or one bigger block alone).
    fn batch(&mut self, out: &mut Vec<u32>) {
        out.clear();
        let mut bytes = 0usize;
        while let Some(&n) = self.stack.last() {
            let node = self.index.nodes()[n as usize];
            let done = self.scanned_as[n as usize] == self.state[n as usize];
            if !node.scan() || node.size() < 8 || done {
                self.stack.pop();
                continue;
            }
            let size = node.size() as usize;
            if !out.is_empty() && (out.len() == BATCH || bytes + size > CHUNK) {
                break;
            }
            self.stack.pop();
            out.push(n);
            bytes += size;
            if bytes >= CHUNK {
                break;
            }
        }
    }

    /// Reads the blocks of `batch` and calls `each(node, its words)`.
    fn read_batch(
        &mut self,
        batch: &[u32],
        memory: &mut dyn Memory,
        buf: &mut Vec<u8>,
        mut each: impl FnMut(&mut Self, u32, u64, &[u8], &mut dyn Memory),
    ) {
        if let [one] = batch {
            let node = self.index.nodes()[*one as usize];
            if node.size() as usize > CHUNK {
                // A big block: read and scanned a chunk at a time.
                let mut at = node.start;
                let end = node.start + (node.size() & !7);
                while at < end {
                    memory.prefetch(at, end - at);
                    let len = ((end - at) as usize).min(CHUNK);
                    memory.read(at, &mut buf[..len]);
                    self.scanned += len as u64;
                    let chunk = std::mem::take(buf);
                    each(self, *one, at, &chunk[..len], memory);
                    *buf = chunk;
                    at += len as u64;
                }
                return;
            }
        }
        let ranges: Vec<(u64, usize)> = batch
            .iter()
            .map(|&n| {
                let node = self.index.nodes()[n as usize];
                (node.start, (node.size() as usize) & !7)
            })
            .collect();
        let total: usize = ranges.iter().map(|r| r.1).sum();
        memory.read_many(&ranges, &mut buf[..total]);
        self.scanned += total as u64;
        let chunk = std::mem::take(buf);
        let mut at = 0;
        for (&n, &(start, len)) in batch.iter().zip(&ranges) {
            each(self, n, start, &chunk[at..at + len], memory);
            at += len;
        }
        *buf = chunk;
    }

    /// Pass 1's loop: scans marked blocks until none is left to scan.
    fn drain(&mut self, memory: &mut dyn Memory, buf: &mut Vec<u8>) {
        let mut batch = Vec::new();
        loop {
            if self.stack.len() >= SWEEP_MIN {
                self.sweep(memory, buf);
                continue;
            }
            self.batch(&mut batch);
            if batch.is_empty() {
                if self.flush(memory) {
                    continue;
                }
                return;
            }
            let current = batch.clone();
            self.read_batch(&current, memory, buf, |marker, n, base, words, memory| {
                marker.scan_node(n, base, words, memory);
            });
        }
    }

    /// Scans one node's words in pass 1, its state noted.
    fn scan_node(&mut self, n: u32, base: u64, words: &[u8], memory: &mut dyn Memory) {
        self.keep_head(n, base, words);
        let i = n as usize;
        self.scanned_as[i] = self.state[i];
        let definite = self.state[i] == REACHABLE;
        let runtime = self.index.nodes()[i].runtime_owned();
        self.scanning = Some(n);
        self.scan_words(words, base, definite, runtime, memory);
        self.scanning = None;
    }

    /// Scans every waiting node in address order, neighbours read
    /// together; what is marked meanwhile ahead of the sweep joins it, what
    /// is marked behind it waits on the stack.
    fn sweep(&mut self, memory: &mut dyn Memory, buf: &mut Vec<u8>) {
        let count = self.index.nodes().len();
        if self.pending.len() != count.div_ceil(64) {
            self.pending = vec![0; count.div_ceil(64)];
        }
        // (In the stack's order, at random: whether each still needs a
        // scan is asked in address order, by `next_due`.)
        for n in std::mem::take(&mut self.stack) {
            let i = n as usize;
            self.pending[i / 64] |= 1 << (i % 64);
        }
        let mut position = 0;
        while let Some(first) = self.next_due(position) {
            // A window: this node and the waiting ones after it, close
            // enough, within one chunk.
            let window_start = self.index.nodes()[first].start;
            let mut window_end = window_start;
            let mut members = Vec::new();
            position = first;
            while let Some(n) = self.next_due(position) {
                let node = self.index.nodes()[n];
                let end = node.start + (node.size() & !7);
                let far = node.start > window_end.saturating_add(SWEEP_GAP);
                let long = end.saturating_sub(window_start) > CHUNK as u64;
                if !members.is_empty() && (far || long) {
                    break;
                }
                members.push(n as u32);
                self.pending[n / 64] &= !(1 << (n % 64));
                window_end = window_end.max(end);
                position = n + 1;
            }
            let len = (window_end - window_start) as usize;
            if len > CHUNK {
                // One block bigger than a chunk: read in chunks.
                let [one] = members[..] else {
                    continue;
                };
                self.read_batch(&[one], memory, buf, |marker, n, base, words, memory| {
                    marker.scan_node(n, base, words, memory);
                });
                continue;
            }
            // The sweep goes on close by: the memory after this window is
            // read ahead while this one is scanned.
            let ahead = self
                .next_pending(position)
                .map(|n| self.index.node(n).start)
                .filter(|&next| next <= window_end.saturating_add(SWEEP_GAP))
                .map_or(len as u64, |next| {
                    next.saturating_add(SWEEP_AHEAD) - window_start
                });
            memory.prefetch(window_start, ahead);
            memory.read(window_start, &mut buf[..len]);
            let window = std::mem::take(buf);
            for &n in &members {
                let i = n as usize;
                if self.scanned_as[i] == self.state[i] {
                    continue;
                }
                let node = self.index.nodes()[i];
                let from = (node.start - window_start) as usize;
                let words = &window[from..from + (node.size() as usize & !7)];
                self.scanned += words.len() as u64;
                let before = self.stack.len();
                self.scan_node(n, node.start, words, memory);
                // Marked ahead of the sweep: scanned by it.
                for k in before..self.stack.len() {
                    let m = self.stack[k] as usize;
                    if m >= position && self.index.nodes()[m].scan() {
                        self.pending[m / 64] |= 1 << (m % 64);
                    }
                }
            }
            *buf = window;
        }
    }

    /// Keeps node `n`'s first word when `words` (read at `base`) begin it.
    #[inline]
    fn keep_head(&mut self, n: u32, base: u64, words: &[u8]) {
        if let (Some(heads), Some(first)) = (self.heads.as_mut(), words.first_chunk::<8>()) {
            if base == self.index.nodes()[n as usize].start {
                heads[n as usize] = u64::from_le_bytes(*first);
            }
        }
    }

    /// The first position from `from` on that waits for the sweep and
    /// still needs a scan (the others waiting before it are dropped).
    fn next_due(&mut self, from: usize) -> Option<usize> {
        let mut at = from;
        loop {
            let n = self.next_pending(at)?;
            let node = self.index.nodes()[n];
            if node.scan() && node.size() >= 8 && self.scanned_as[n] != self.state[n] {
                return Some(n);
            }
            self.pending[n / 64] &= !(1 << (n % 64));
            at = n + 1;
        }
    }

    /// The first position from `from` on that waits for the sweep.
    fn next_pending(&self, from: usize) -> Option<usize> {
        let mut word = from / 64;
        let mut bits = *self.pending.get(word)? & (u64::MAX << (from % 64));
        loop {
            if bits != 0 {
                return Some(word * 64 + bits.trailing_zeros() as usize);
            }
            word += 1;
            bits = *self.pending.get(word)?;
        }
    }

    /// Pass 2 for one leader: everything it reaches of the unmarked blocks
    /// is indirectly lost.
    fn drain_clique(&mut self, leader: u32, memory: &mut dyn Memory, buf: &mut Vec<u8>) {
        let mut batch = Vec::new();
        loop {
            self.batch(&mut batch);
            if batch.is_empty() {
                return;
            }
            let current = batch.clone();
            self.read_batch(&current, memory, buf, |marker, n, base, words, _| {
                marker.keep_head(n, base, words);
                let runtime = marker.index.nodes()[n as usize].runtime_owned();
                for (k, word) in words.chunks_exact(8).enumerate() {
                    let value = u64::from_le_bytes([
                        word[0], word[1], word[2], word[3], word[4], word[5], word[6], word[7],
                    ]);
                    let mut reached = Vec::new();
                    marker.index.find(value, |m| reached.push(m));
                    let source = Source::Block {
                        node: n as usize,
                        at: base + 8 * k as u64,
                    };
                    for m in reached {
                        let i = m as usize;
                        if m == leader || (runtime && !marker.index.nodes()[i].scan()) {
                            continue;
                        }
                        match marker.state[i] {
                            UNREACHED => {
                                marker.state[i] = INDIRECT;
                                marker.stack.push(m);
                                marker.note(m, source, value);
                            }
                            // An earlier leader, and its clique with it.
                            LEADER => {
                                marker.state[i] = INDIRECT;
                                marker.note(m, source, value);
                            }
                            _ => {}
                        }
                    }
                }
            });
        }
    }
}

#[cfg(test)]
mod bench;
#[cfg(test)]
mod differential;
#[cfg(test)]
mod tests;
