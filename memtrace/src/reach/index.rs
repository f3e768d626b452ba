//! The node index: which nodes a word points into. Nodes sorted by start,
//! grouped into clusters of nearby nodes (heap blocks cluster); each
//! cluster has a table from each 4 KiB page it spans to the first node that
//! may contain an address of that page, so a lookup is a short binary
//! search among clusters, a table read, and a binary search within a page.
//! Overlapping nodes (a host block and the device block a stub runtime
//! backs with it; a caching allocator's blocks inside its segments) are all
//! found. Nodes already in address order (a heap walked) are indexed where
//! they lie: no copy of 10M nodes.

use std::borrow::Cow;

use super::Node;

const PAGE_SHIFT: u32 = 12;
/// Nodes closer than this share a cluster (and its page table).
const CLUSTER_GAP: u64 = 1 << 20;
/// A cluster never gets a page table larger than this many pages per node
/// (a few huge nodes far apart would otherwise cost a table each): beyond
/// it the cluster is searched by binary search alone.
const MAX_PAGES_PER_NODE: u64 = 64;

struct Cluster {
    start: u64,
    end: u64,
    /// Range of sorted positions it holds.
    first: usize,
    last: usize,
    /// Per page from `start`: the first sorted position whose running
    /// maximum end is past the page's start (empty: no table).
    pages: Vec<u32>,
}

pub struct Index<'a> {
    /// The nodes in address order (the input itself when it is in that
    /// order already).
    nodes: Cow<'a, [Node]>,
    /// Node numbers (input order) at each position; empty when the input
    /// is in address order (a position is its own number).
    order: Vec<u32>,
    /// Running maximum of the nodes' ends in address order (empty for
    /// disjoint nodes: each end is its own).
    max_end: Vec<u64>,
    clusters: Vec<Cluster>,
    low: u64,
    high: u64,
    /// No two nodes overlap: a word lies in at most one, the last that
    /// starts at or before it.
    disjoint: bool,
}

impl<'a> Index<'a> {
    pub fn new(input: &'a [Node]) -> Index<'a> {
        let (nodes, order) = if input.is_sorted_by_key(|n| n.start) {
            (Cow::Borrowed(input), Vec::new())
        } else {
            let mut order: Vec<u32> = (0..input.len() as u32).collect();
            order.sort_unstable_by_key(|&n| input[n as usize].start);
            let sorted = order.iter().map(|&n| input[n as usize]).collect();
            (Cow::Owned(sorted), order)
        };
        let disjoint = nodes.windows(2).all(|pair| pair[0].end() <= pair[1].start);
        // Disjoint nodes' ends are their own running maximum.
        let mut max_end = Vec::new();
        if !disjoint {
            max_end.reserve(nodes.len());
            let mut running = 0;
            for node in nodes.iter() {
                running = running.max(node.end());
                max_end.push(running);
            }
        }
        let running_end = |position: usize| {
            if disjoint {
                nodes[position].end()
            } else {
                max_end[position]
            }
        };
        let mut clusters: Vec<Cluster> = Vec::new();
        for (position, node) in nodes.iter().enumerate() {
            match clusters.last_mut() {
                Some(c) if node.start <= c.end.saturating_add(CLUSTER_GAP) => {
                    c.end = c.end.max(node.end());
                    c.last = position;
                }
                _ => clusters.push(Cluster {
                    start: node.start,
                    end: node.end(),
                    first: position,
                    last: position,
                    pages: Vec::new(),
                }),
            }
        }
        for cluster in &mut clusters {
            let pages = ((cluster.end - cluster.start) >> PAGE_SHIFT) + 1;
            let members = (cluster.last - cluster.first + 1) as u64;
            if pages > members.saturating_mul(MAX_PAGES_PER_NODE).max(16) {
                continue;
            }
            let mut table = Vec::with_capacity(pages as usize);
            let mut position = cluster.first;
            for page in 0..pages {
                let page_start = cluster.start + (page << PAGE_SHIFT);
                while position < cluster.last && running_end(position) <= page_start {
                    position += 1;
                }
                table.push(position as u32);
            }
            cluster.pages = table;
        }
        let low = nodes.first().map_or(u64::MAX, |n| n.start);
        let high = nodes.len().checked_sub(1).map_or(0, running_end);
        Index {
            nodes,
            order,
            max_end,
            clusters,
            low,
            high,
            disjoint,
        }
    }

    /// Calls `hit(position)` for every node `word` points into (start or
    /// interior; a zero-size node only at its start): positions in address
    /// order ([`Index::input`] gives the node's input number).
    #[inline]
    pub fn find(&self, word: u64, mut hit: impl FnMut(u32)) {
        if word < self.low || word >= self.high {
            return;
        }
        let c = self.clusters.partition_point(|c| c.start <= word);
        let Some(cluster) = c.checked_sub(1).map(|c| &self.clusters[c]) else {
            return;
        };
        if word >= cluster.end {
            return;
        }
        // The first position that may hold `word`: its running end is past it.
        let from = if cluster.pages.is_empty() {
            cluster.first
        } else {
            cluster.pages[((word - cluster.start) >> PAGE_SHIFT) as usize] as usize
        };
        let nodes = &self.nodes[..=cluster.last];
        if self.disjoint {
            // The one candidate: the last node starting at or before `word`.
            let to = from + gallop(&nodes[from..], |n| n.start <= word);
            if to > from && nodes[to - 1].end() > word {
                hit((to - 1) as u32);
            }
            return;
        }
        let from = from + gallop(&self.max_end[from..=cluster.last], |&end| end <= word);
        // The last position starting at or before `word`.
        let to = from + gallop(&nodes[from..], |n| n.start <= word);
        for (position, node) in nodes.iter().enumerate().take(to).skip(from) {
            if node.end() > word {
                hit(position as u32);
            }
        }
    }

    /// Whether no two nodes overlap (then [`Index::find_near`] applies).
    pub fn disjoint(&self) -> bool {
        self.disjoint
    }

    /// The node `word` points into, for an index of disjoint nodes, when
    /// the words come in ascending order (or nearly): `cursor` is where
    /// the last word's search ended, and the search walks on from there
    /// (a few steps, in cache) instead of starting over.
    #[inline]
    pub fn find_near(&self, word: u64, cursor: &mut usize) -> Option<u32> {
        if word < self.low || word >= self.high {
            return None;
        }
        let at = *cursor;
        let nodes = &self.nodes[..];
        // The last position starting at or before `word`: galloping on from
        // the cursor, or back from it (words sorted coarsely come back a
        // few nodes at a time).
        let last = match nodes.get(at) {
            Some(node) if node.start <= word => at + gallop(&nodes[at + 1..], |n| n.start <= word),
            Some(_) if at > 0 && nodes[0].start <= word => {
                // nodes[0] <= word < nodes[at]: at least one position is
                // passed back over.
                at - gallop_back(&nodes[..at], |n| n.start > word) - 1
            }
            _ => {
                let mut last = None;
                self.find(word, |n| last = Some(n));
                match last {
                    Some(n) => n as usize,
                    // In no node: the search resumes from here next time.
                    None => return None,
                }
            }
        };
        *cursor = last;
        (nodes[last].end() > word).then_some(last as u32)
    }

    /// Whether `word` may point into some node (the cheap test every word
    /// takes first: most words are not pointers into the heap).
    #[inline(always)]
    pub fn may_hit(&self, word: u64) -> bool {
        word >= self.low && word < self.high
    }

    /// Where the nodes lie: every word [`Index::may_hit`] accepts is in
    /// `[low, high)`.
    pub fn bounds(&self) -> (u64, u64) {
        (self.low, self.high)
    }

    /// The cluster holding the most nodes: its positions (first, last)
    /// and where it ends.
    pub fn densest(&self) -> Option<(usize, usize, u64)> {
        self.clusters
            .iter()
            .max_by_key(|c| c.last - c.first)
            .map(|c| (c.first, c.last, c.end))
    }

    /// The nodes in address order.
    #[inline(always)]
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The node at `position`.
    #[inline(always)]
    pub fn node(&self, position: usize) -> Node {
        self.nodes[position]
    }

    /// The input number of the node at `position`.
    #[inline]
    pub fn input(&self, position: usize) -> usize {
        self.order.get(position).map_or(position, |&n| n as usize)
    }

    /// Whether the input was in address order (positions are input numbers).
    pub fn in_input_order(&self) -> bool {
        self.order.is_empty()
    }
}

/// The partition point of `sorted` for `below` (true, then false), found
/// by galloping from the front: a few steps when it is near, as it is
/// within a page.
#[inline]
fn gallop<T>(sorted: &[T], below: impl Fn(&T) -> bool) -> usize {
    let mut low = 0;
    let mut step = 1;
    loop {
        let probe = low + step;
        if probe > sorted.len() || !below(&sorted[probe - 1]) {
            let high = probe.min(sorted.len());
            return low + sorted[low..high].partition_point(&below);
        }
        low = probe;
        step *= 2;
    }
}

/// How many of the last elements of `sorted` satisfy `above` (true for a
/// suffix), searched back from the end: steps 1, 2, 4... then a binary
/// search in the last step.
#[inline]
fn gallop_back<T>(sorted: &[T], above: impl Fn(&T) -> bool) -> usize {
    let len = sorted.len();
    let mut count = 0;
    let mut step = 1;
    loop {
        let probe = count + step;
        if probe > len || !above(&sorted[len - probe]) {
            let high = probe.min(len);
            // Within sorted[len - high..len - count], the suffix above.
            let part = &sorted[len - high..len - count];
            return count + part.len() - part.partition_point(|v| !above(v));
        }
        count = probe;
        step *= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(start: u64, size: u64) -> Node {
        Node::host(start, size)
    }

    fn hits(index: &Index, word: u64) -> Vec<u32> {
        let mut found = Vec::new();
        index.find(word, |n| found.push(n));
        found.sort_unstable();
        found
    }

    #[test]
    fn finds_start_interior_and_overlapping_nodes() {
        let nodes = [
            node(0x1000, 0x10),
            node(0x1010, 0),
            node(0x2000, 0x10_0000),
            node(0x2000, 0x100),
            node(0x9000_0000, 8),
        ];
        let index = Index::new(&nodes);
        assert_eq!(hits(&index, 0x1000), [0]);
        assert_eq!(hits(&index, 0x100f), [0]);
        assert_eq!(hits(&index, 0x1010), [1]);
        assert_eq!(hits(&index, 0x1011), Vec::<u32>::new());
        assert_eq!(hits(&index, 0x2080), [2, 3]);
        assert_eq!(hits(&index, 0x5_0000), [2]);
        assert_eq!(hits(&index, 0x10_2000), Vec::<u32>::new());
        assert_eq!(hits(&index, 0x9000_0007), [4]);
        assert_eq!(hits(&index, 0x9000_0008), Vec::<u32>::new());
        assert_eq!(hits(&index, 0), Vec::<u32>::new());
        assert_eq!(hits(&index, u64::MAX), Vec::<u32>::new());
    }

    #[test]
    fn galloping_finds_the_partition_point() {
        let sorted: Vec<u64> = (0..1000).map(|v| v * 2).collect();
        for target in [0, 1, 2, 3, 500, 1997, 1998, 1999, 5000] {
            assert_eq!(
                gallop(&sorted, |&v| v <= target),
                sorted.partition_point(|&v| v <= target),
                "{target}"
            );
        }
        assert_eq!(gallop(&[0u64; 0], |_| true), 0);
        for target in [0, 1, 2, 3, 500, 1997, 1998, 1999, 5000] {
            assert_eq!(
                gallop_back(&sorted, |&v| v > target),
                sorted.len() - sorted.partition_point(|&v| v <= target),
                "{target}"
            );
        }
        assert_eq!(gallop_back(&[0u64; 0], |_| true), 0);
    }

    #[test]
    fn finding_near_the_last_word_finds_what_find_finds() {
        let nodes: Vec<Node> = (0..500u64)
            .map(|i| node(0x10_0000 + i * 48 + (i % 7) * 1000, 16 + (i % 3) * 8))
            .collect();
        let index = Index::new(&nodes);
        assert!(index.disjoint());
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut words: Vec<u64> = (0..5000)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                0x10_0000 - 64 + state % 0x2_0000
            })
            .collect();
        // Ascending, then nearly (sorted by 256-byte buckets), then in any order.
        words.sort_unstable();
        let mut nearly = words.clone();
        nearly.sort_by_key(|w| (w >> 8, std::cmp::Reverse(*w)));
        let mut shuffled = words.clone();
        shuffled.reverse();
        for order in [words, nearly, shuffled] {
            let mut cursor = 0;
            for word in order {
                let found = index.find_near(word, &mut cursor);
                assert_eq!(
                    found.into_iter().collect::<Vec<_>>(),
                    hits(&index, word),
                    "{word:#x}"
                );
            }
        }
    }

    #[test]
    fn a_long_node_is_found_past_many_short_ones() {
        let mut nodes = vec![node(0x10_0000, 0x10_0000)];
        for i in 0..1000 {
            nodes.push(node(0x10_0000 + 0x100 + i * 0x20, 0x10));
        }
        let index = Index::new(&nodes);
        assert_eq!(hits(&index, 0x1f_0000), [0]);
        assert_eq!(hits(&index, 0x10_0100), [0, 1]);
        assert_eq!(hits(&index, 0x10_0118), [0]);
    }
}
