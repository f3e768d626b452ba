//! Randomized differential tests: random graphs (start and interior
//! pointers, the heuristics' shapes, overlapping blocks, device blocks,
//! runtime-owned roots and blocks, registers) classified by [`classify`]
//! with every kind of lookup (one word at a time; sorted batches of one
//! word, of a few, of many), with and without provenance, against a
//! reference written from the rules alone (fixpoints, no order).

use std::collections::{BTreeMap, HashSet};

use super::*;

/// xorshift64*: the tests' random numbers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// Words at addresses (zero elsewhere); `unreadable` ranges read as
/// zeros (a read counts the bytes before the first of them).
#[derive(Default)]
struct Words {
    words: BTreeMap<u64, u64>,
    unreadable: Vec<(u64, u64)>,
}

impl Words {
    fn get(&self, addr: u64) -> u64 {
        self.words.get(&addr).copied().unwrap_or(0)
    }

    fn readable(&self, addr: u64, len: u64) -> bool {
        !self
            .unreadable
            .iter()
            .any(|&(s, e)| addr < e && addr + len > s)
    }
}

impl Memory for Words {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> usize {
        buf.fill(0);
        let end = addr + buf.len() as u64;
        for (&at, &value) in self.words.range(addr..end) {
            let offset = (at - addr) as usize;
            if offset + 8 <= buf.len() && self.readable(at, 8) {
                buf[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
            }
        }
        let mut read = buf.len();
        for &(s, e) in &self.unreadable {
            if addr < e && end > s {
                read = read.min(s.saturating_sub(addr) as usize);
            }
        }
        read
    }
}

const VTABLES: std::ops::Range<u64> = 0x40_0000..0x41_0000;
const HEAP: u64 = 0x1000_0000;
const DEVICE: u64 = 0x7000_0000;
const ROOTS: u64 = 0x9000_0000;

struct Case {
    nodes: Vec<Node>,
    roots: Vec<RootRegion>,
    registers: Vec<u64>,
    memory: Words,
}

/// A random word for a block or a root: mostly pointers (start, interior,
/// at the heuristics' offsets), some data, some vtable addresses.
fn word(rng: &mut Rng, nodes: &[Node]) -> u64 {
    let target = nodes[rng.below(nodes.len() as u64) as usize];
    match rng.below(10) {
        0..=3 => target.start,
        4 => target.start + 8,
        5 => target.start + 24,
        6 => target.start + rng.below(target.size().max(1)),
        7 => VTABLES.start + 8 * rng.below(64),
        8 => rng.below(1000),
        _ => 0,
    }
}

fn case(seed: u64, count: usize) -> Case {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let sizes = [0, 8, 16, 24, 32, 40, 48, 64, 65, 72, 89, 120, 256];
    let mut nodes: Vec<Node> = Vec::new();
    let mut at = HEAP;
    let mut device_at = DEVICE;
    for _ in 0..count {
        let size = sizes[rng.below(sizes.len() as u64) as usize];
        let node = if rng.chance(8) {
            let node = Node::new(device_at, size, false, false);
            device_at += 16 + size.next_multiple_of(16);
            node
        } else {
            // Overlapping: inside the previous host block (its own start).
            let inside = nodes
                .iter()
                .rev()
                .find(|n| n.scan())
                .filter(|n| n.size() >= 64 && rng.chance(10));
            let start = match inside {
                Some(outer) => outer.start + 16 + 16 * rng.below((outer.size() - 32) / 16),
                None => {
                    let start = at + 16 * rng.below(3);
                    at = start + size.next_multiple_of(16) + 16;
                    start
                }
            };
            Node::new(start, size, true, rng.chance(5))
        };
        nodes.push(node);
    }
    // Overlapping blocks could share a start with a later one: keep every
    // start distinct (address order between equal starts is unspecified).
    let mut seen = HashSet::new();
    nodes.retain(|n| seen.insert(n.start));
    // Device memory holds pointers too: never to be read.
    let mut memory = Words::default();
    for node in nodes.iter().filter(|n| !n.scan()) {
        for k in 0..node.size() / 8 {
            let w = word(&mut rng, &nodes);
            memory.words.insert(node.start + 8 * k, w);
        }
    }
    let hosts: Vec<Node> = nodes.iter().copied().filter(|n| n.scan()).collect();
    for node in &hosts {
        let words = node.size() / 8;
        // Sparse graphs leave some blocks lost.
        let density = rng.below(4);
        for k in 0..words {
            if rng.below(4) < density {
                let w = word(&mut rng, &nodes);
                memory.words.insert(node.start + 8 * k, w);
            }
        }
        // The heuristics' shapes.
        match rng.below(8) {
            0 if node.size() >= 8 => {
                memory.words.insert(node.start, node.size() - 8);
            }
            1 if node.size() >= 16 => {
                memory.words.insert(node.start, 1 + rng.below(4));
            }
            2 if node.size() == 65 || node.size() == 89 => {
                let capacity = node.size() - 25;
                memory.words.insert(node.start, rng.below(capacity + 2));
                memory.words.insert(node.start + 8, capacity);
            }
            3 if node.size() >= 24 => {
                memory
                    .words
                    .insert(node.start, VTABLES.start + 8 * rng.below(64));
                memory
                    .words
                    .insert(node.start + 16, VTABLES.start + 8 * rng.below(64));
            }
            _ => {}
        }
    }
    if rng.chance(20) {
        if let Some(node) = hosts.get(rng.below(hosts.len() as u64) as usize) {
            memory
                .unreadable
                .push((node.start, node.start + node.size()));
        }
    }
    let mut roots = Vec::new();
    let mut root_at = ROOTS;
    for _ in 0..1 + rng.below(3) {
        let len = 8 * rng.below(12);
        for k in 0..len / 8 {
            if rng.chance(40) {
                let w = word(&mut rng, &nodes);
                memory.words.insert(root_at + 8 * k, w);
            }
        }
        roots.push(RootRegion {
            start: root_at,
            len,
            runtime_owned: rng.chance(25),
        });
        root_at += len + 4096;
    }
    let registers = (0..rng.below(6)).map(|_| word(&mut rng, &nodes)).collect();
    Case {
        nodes,
        roots,
        registers,
        memory,
    }
}

const U: u8 = 0;
const P: u8 = 1;
const R: u8 = 2;
const I: u8 = 3;
const L: u8 = 4;

/// The reference: what the rules say, by fixpoints.
struct Reference {
    categories: Vec<Category>,
    /// Reached only through interior pointers a heuristic accepted: the
    /// heuristics that accepted one.
    heuristics: Vec<Vec<Heuristic>>,
}

fn end(node: &Node) -> u64 {
    node.start + node.size().max(1)
}

fn reference(case: &Case) -> Reference {
    let nodes = &case.nodes;
    let memory = &case.memory;
    let vtable = |p: u64| VTABLES.contains(&p);
    // The candidates for a word start at most the largest size below it.
    let largest = nodes.iter().map(|n| n.size()).max().unwrap_or(0);
    let mut by_start: Vec<(u64, usize)> = nodes
        .iter()
        .enumerate()
        .map(|(j, n)| (n.start, j))
        .collect();
    by_start.sort_unstable();
    let hits = |w: u64| -> Vec<usize> {
        let from = by_start.partition_point(|&(s, _)| s < w.saturating_sub(largest));
        let to = by_start.partition_point(|&(s, _)| s <= w);
        by_start[from..to]
            .iter()
            .map(|&(_, j)| j)
            .filter(|&j| nodes[j].start <= w && w < end(&nodes[j]))
            .collect()
    };
    let block_words = |i: usize| -> Vec<u64> {
        let node = nodes[i];
        if !node.scan() {
            return Vec::new();
        }
        (0..node.size() / 8)
            .map(|k| node.start + 8 * k)
            .map(|at| {
                if memory.readable(at, 8) {
                    memory.get(at)
                } else {
                    0
                }
            })
            .collect()
    };
    let heuristic = |w: u64, j: usize| -> Option<Heuristic> {
        let node = nodes[j];
        if !node.scan() {
            return None;
        }
        let first =
            (node.size() >= 8 && memory.readable(node.start, 8)).then(|| memory.get(node.start));
        let second = (node.size() >= 16 && memory.readable(node.start, 16))
            .then(|| memory.get(node.start + 8));
        let at_pointer =
            (w.is_multiple_of(8) && w + 8 <= node.start + node.size() && memory.readable(w, 8))
                .then(|| memory.get(w));
        heuristics::accepts(
            w,
            node.start,
            node.size(),
            &heuristics::Words {
                first,
                second,
                at_pointer,
            },
            &vtable,
        )
    };
    let root_words: Vec<(u64, bool)> = case
        .roots
        .iter()
        .flat_map(|root| {
            (0..root.len / 8).map(move |k| {
                let at = root.start + 8 * k;
                let w = if memory.readable(at, 8) {
                    memory.get(at)
                } else {
                    0
                };
                (w, root.runtime_owned)
            })
        })
        .collect();
    let mut state = vec![U; nodes.len()];
    // Pass 1, to a fixpoint: a block's words count again whenever its
    // state rises.
    let mut sources: Vec<(u64, bool, bool)> = Vec::new();
    sources.extend(case.registers.iter().map(|&w| (w, true, false)));
    sources.extend(root_words.iter().map(|&(w, runtime)| (w, true, runtime)));
    let mut risen = Vec::new();
    loop {
        for (w, definite, runtime) in sources.drain(..) {
            for j in hits(w) {
                if runtime && !nodes[j].scan() {
                    continue;
                }
                let strong = w == nodes[j].start || heuristic(w, j).is_some();
                if definite && strong && state[j] != R {
                    state[j] = R;
                    risen.push(j);
                } else if state[j] == U {
                    state[j] = P;
                    risen.push(j);
                }
            }
        }
        let Some(i) = risen.pop() else {
            break;
        };
        let definite = state[i] == R;
        let runtime = nodes[i].runtime_owned();
        sources.extend(block_words(i).into_iter().map(|w| (w, definite, runtime)));
    }
    // Heuristics: only where no definite start pointer reaches the block.
    let mut definite_words: Vec<(u64, bool)> = case.registers.iter().map(|&w| (w, false)).collect();
    definite_words.extend(root_words.iter().copied());
    for i in 0..nodes.len() {
        if state[i] == R {
            let runtime = nodes[i].runtime_owned();
            definite_words.extend(block_words(i).into_iter().map(|w| (w, runtime)));
        }
    }
    let mut plain = vec![false; nodes.len()];
    let mut accepted: Vec<Vec<Heuristic>> = vec![Vec::new(); nodes.len()];
    for &(w, runtime) in &definite_words {
        for j in hits(w) {
            if runtime && !nodes[j].scan() {
                continue;
            }
            if w == nodes[j].start {
                plain[j] = true;
            } else if let Some(h) = heuristic(w, j) {
                accepted[j].push(h);
            }
        }
    }
    // Pass 2: cliques in address order.
    let mut order: Vec<usize> = (0..nodes.len()).collect();
    order.sort_by_key(|&i| nodes[i].start);
    for &leader in &order {
        if state[leader] != U {
            continue;
        }
        state[leader] = L;
        let mut todo = vec![leader];
        while let Some(n) = todo.pop() {
            let runtime = nodes[n].runtime_owned();
            for w in block_words(n) {
                for m in hits(w) {
                    if m == leader || (runtime && !nodes[m].scan()) {
                        continue;
                    }
                    match state[m] {
                        U => {
                            state[m] = I;
                            todo.push(m);
                        }
                        L => state[m] = I,
                        _ => {}
                    }
                }
            }
        }
    }
    Reference {
        categories: state
            .iter()
            .map(|&s| match s {
                R => Category::StillReachable,
                P => Category::PossiblyLost,
                I => Category::IndirectlyLost,
                _ => Category::DefinitelyLost,
            })
            .collect(),
        heuristics: (0..nodes.len())
            .map(|j| {
                if state[j] == R && !plain[j] {
                    accepted[j].clone()
                } else {
                    Vec::new()
                }
            })
            .collect(),
    }
}

/// Checks `outcome` against the reference: the same categories, a
/// heuristic exactly where one is needed (one that accepted a pointer),
/// and with provenance marks that are real words pointing into their node
/// from memory of the right kind.
fn check(case: &Case, expected: &Reference, outcome: &Outcome, what: &str) {
    let categories: Vec<Category> = outcome.verdicts.iter().map(|v| v.category).collect();
    assert_eq!(categories, expected.categories, "{what}");
    for (j, verdict) in outcome.verdicts.iter().enumerate() {
        match verdict.heuristic {
            None => assert!(expected.heuristics[j].is_empty(), "{what}: node {j}"),
            Some(h) => assert!(expected.heuristics[j].contains(&h), "{what}: node {j}"),
        }
    }
    // Every host node of 8 bytes or more is scanned (pass 1 or 2): its
    // first word as the memory holds it.
    for (j, &word) in outcome.first_words.iter().enumerate() {
        let node = case.nodes[j];
        let held = if node.scan() && node.size() >= 8 && case.memory.readable(node.start, 8) {
            case.memory.get(node.start)
        } else {
            0
        };
        assert_eq!(word, held, "{what}: node {j}'s first word");
    }
    if outcome.marks.is_empty() {
        return;
    }
    for (j, mark) in outcome.marks.iter().enumerate() {
        let node = case.nodes[j];
        let category = categories[j];
        let Some(mark) = mark else {
            assert_eq!(category, Category::DefinitelyLost, "{what}: node {j}");
            continue;
        };
        assert!(
            node.start <= mark.value && mark.value < end(&node),
            "{what}: node {j}"
        );
        if category == Category::StillReachable && verdict_plain(outcome, j) {
            assert_eq!(mark.value, node.start, "{what}: node {j}");
        }
        let from = match mark.source {
            Source::Register { index } => {
                assert_eq!(case.registers[index], mark.value, "{what}: node {j}");
                None
            }
            Source::Root { at } => {
                assert_eq!(case.memory.get(at), mark.value, "{what}: node {j}");
                assert!(case
                    .roots
                    .iter()
                    .any(|r| r.start <= at && at < r.start + r.len));
                None
            }
            Source::Block { node: from, at } => {
                assert_eq!(case.memory.get(at), mark.value, "{what}: node {j}");
                let source = case.nodes[from];
                assert!(
                    source.scan() && source.start <= at && at + 8 <= source.start + source.size()
                );
                Some(categories[from])
            }
        };
        let allowed: &[Category] = match category {
            Category::StillReachable => &[Category::StillReachable],
            Category::PossiblyLost => &[Category::StillReachable, Category::PossiblyLost],
            _ => &[Category::IndirectlyLost, Category::DefinitelyLost],
        };
        match from {
            Some(c) => assert!(allowed.contains(&c), "{what}: node {j} from {c:?}"),
            None => assert!(
                matches!(category, Category::StillReachable | Category::PossiblyLost),
                "{what}: node {j}"
            ),
        }
    }
}

fn verdict_plain(outcome: &Outcome, j: usize) -> bool {
    outcome.verdicts[j].heuristic.is_none()
}

fn tunings() -> [Tuning; 6] {
    let tuning = |sorted, batch, direct| Tuning {
        sorted,
        batch,
        direct,
    };
    [
        tuning(false, 1, false),
        tuning(true, 1, false),
        tuning(true, 1, true),
        tuning(true, 7, true),
        tuning(true, 1 << 16, false),
        tuning(true, 1 << 16, true),
    ]
}

fn differ(seed: u64, count: usize) {
    let mut case = case(seed, count);
    let expected = reference(&case);
    let vtable = |p: u64| VTABLES.contains(&p);
    for tuning in tunings() {
        for provenance in [false, true] {
            let outcome = classify_tuned(
                &Input {
                    nodes: &case.nodes,
                    roots: &case.roots,
                    registers: &case.registers,
                    vtable: &vtable,
                    provenance,
                    first_words: provenance,
                },
                &mut case.memory,
                tuning,
            );
            let what = format!("seed {seed}, {count} nodes, {tuning:?}, provenance {provenance}");
            check(&case, &expected, &outcome, &what);
        }
    }
}

#[test]
fn small_random_graphs_classify_as_the_rules_say() {
    for seed in 0..400 {
        differ(seed, 1 + (seed as usize % 40));
    }
}

#[test]
fn larger_random_graphs_classify_as_the_rules_say() {
    for seed in 1000..1012 {
        differ(seed, 300 + 50 * (seed as usize % 5));
    }
}

/// Nodes that never overlap (a heap's): pass 1 drops the words found
/// inside plainly reachable nodes as they are found.
#[test]
fn random_graphs_of_disjoint_nodes_classify_as_the_rules_say() {
    for seed in 3000..3200 {
        let mut case = case(seed, 1 + (seed as usize % 300));
        let mut end = 0;
        case.nodes.sort_by_key(|n| n.start);
        case.nodes.retain(|n| {
            let keep = n.start >= end;
            end = end.max(n.start + n.size().max(1));
            keep
        });
        differ_case(seed, &mut case);
    }
}

/// Thousands of blocks waiting at once: sweeps, with words looked up while
/// the sweep runs (marked ahead of it, behind it).
#[test]
fn sweeps_of_random_graphs_classify_as_the_rules_say() {
    for seed in 2000..2002 {
        let mut case = case(seed, 9000);
        // A table that holds most blocks (many wait at once).
        let table = 0xa000_0000;
        let hosts: Vec<u64> = case.nodes.iter().map(|n| n.start).collect();
        let mut rng = Rng(seed);
        let mut k = 0;
        for &start in &hosts {
            if rng.chance(70) {
                let at = table + 8 * k;
                let value = if rng.chance(10) { start + 8 } else { start };
                case.memory.words.insert(at, value);
                k += 1;
            }
        }
        case.nodes.push(Node::host(table, 8 * k));
        case.registers.push(table);
        differ_case(seed, &mut case);
    }
}

fn differ_case(seed: u64, case: &mut Case) {
    let expected = reference(case);
    let vtable = |p: u64| VTABLES.contains(&p);
    for tuning in tunings() {
        let outcome = classify_tuned(
            &Input {
                nodes: &case.nodes,
                roots: &case.roots,
                registers: &case.registers,
                vtable: &vtable,
                provenance: seed.is_multiple_of(2),
                first_words: seed.is_multiple_of(3),
            },
            &mut case.memory,
            tuning,
        );
        check(
            case,
            &expected,
            &outcome,
            &format!("seed {seed}, {tuning:?}"),
        );
    }
}
