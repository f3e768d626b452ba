//! Tests of the classification against valgrind's rules: the manual's
//! pointer-chain table, cycles, cliques, heuristics, device and runtime
//! memory, unreadable memory, deep chains.

use std::collections::BTreeMap;

use super::*;

/// A fake address space: words at addresses; device nodes must never be read.
#[derive(Default)]
struct Fake {
    words: BTreeMap<u64, u64>,
    forbidden: Vec<(u64, u64)>,
    unreadable: Vec<(u64, u64)>,
}

impl Fake {
    fn put(&mut self, addr: u64, value: u64) {
        self.words.insert(addr, value);
    }
}

impl Memory for Fake {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> usize {
        let end = addr + buf.len() as u64;
        for &(s, e) in &self.forbidden {
            assert!(end <= s || addr >= e, "device memory {s:#x} was read");
        }
        if self.unreadable.iter().any(|&(s, e)| addr < e && end > s) {
            buf.fill(0);
            return 0;
        }
        buf.fill(0);
        for (&at, &value) in self.words.range(addr..end) {
            let offset = (at - addr) as usize;
            if offset + 8 <= buf.len() {
                buf[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
            }
        }
        buf.len()
    }
}

const ROOT: u64 = 0x10_0000;

fn host(start: u64, size: u64) -> Node {
    Node::host(start, size)
}

fn device(start: u64, size: u64) -> Node {
    Node::new(start, size, false, false)
}

fn root(len: u64) -> RootRegion {
    RootRegion {
        start: ROOT,
        len,
        runtime_owned: false,
    }
}

fn run(
    nodes: &[Node],
    roots: &[RootRegion],
    registers: &[u64],
    memory: &mut Fake,
) -> Vec<Category> {
    let vtable = |p: u64| (0x40_0000..0x41_0000).contains(&p);
    let outcome = classify(
        &Input {
            nodes,
            roots,
            registers,
            vtable: &vtable,
            provenance: false,
            first_words: false,
        },
        memory,
    );
    outcome.verdicts.iter().map(|v| v.category).collect()
}

use Category::{
    DefinitelyLost as DL, IndirectlyLost as IL, PossiblyLost as PL, StillReachable as SR,
};

// Blocks AAA (0x1000) and BBB (0x2000), 64 bytes each; RRR is the root.
const A: u64 = 0x1000;
const B: u64 = 0x2000;

fn chain(rrr_to_a: Option<u64>, a_to_b: Option<u64>, rrr_to_b: Option<u64>) -> Vec<Category> {
    let mut m = Fake::default();
    if let Some(p) = rrr_to_a {
        m.put(ROOT, p);
    }
    if let Some(p) = rrr_to_b {
        m.put(ROOT + 8, p);
    }
    if let Some(p) = a_to_b {
        m.put(A, p);
    }
    run(&[host(A, 64), host(B, 64)], &[root(16)], &[], &mut m)
}

#[test]
fn the_manuals_pointer_chains() {
    // (1) RRR ---> BBB
    assert_eq!(chain(None, None, Some(B))[1], SR);
    // (2) RRR ---> AAA ---> BBB
    assert_eq!(chain(Some(A), Some(B), None), [SR, SR]);
    // (3) BBB alone
    assert_eq!(chain(None, None, None)[1], DL);
    // (4) AAA ---> BBB, nothing to AAA
    assert_eq!(chain(None, Some(B), None), [DL, IL]);
    // (5) RRR -?-> BBB
    assert_eq!(chain(None, None, Some(B + 16))[1], PL);
    // (6) RRR ---> AAA -?-> BBB
    assert_eq!(chain(Some(A), Some(B + 16), None), [SR, PL]);
    // (7) RRR -?-> AAA ---> BBB
    assert_eq!(chain(Some(A + 16), Some(B), None), [PL, PL]);
    // (8) RRR -?-> AAA -?-> BBB
    assert_eq!(chain(Some(A + 16), Some(B + 16), None), [PL, PL]);
    // (9) AAA -?-> BBB, nothing to AAA
    assert_eq!(chain(None, Some(B + 16), None), [DL, IL]);
}

#[test]
fn a_start_pointer_upgrades_a_possibly_lost_block_and_what_it_holds() {
    // RRR -?-> AAA ---> BBB and RRR ---> AAA later in the root.
    let mut m = Fake::default();
    m.put(ROOT, A + 8);
    m.put(ROOT + 8, A);
    m.put(A, B);
    assert_eq!(
        run(&[host(A, 64), host(B, 64)], &[root(16)], &[], &mut m),
        [SR, SR]
    );
}

#[test]
fn cycles_have_one_leader_definitely_lost() {
    let mut m = Fake::default();
    // A <-> B
    m.put(A, B);
    m.put(B, A);
    assert_eq!(run(&[host(A, 64), host(B, 64)], &[], &[], &mut m), [DL, IL]);
    // A -> B -> C -> A
    let c = 0x3000;
    let mut m = Fake::default();
    m.put(A, B);
    m.put(B, c);
    m.put(c, A);
    assert_eq!(
        run(&[host(A, 64), host(B, 64), host(c, 64)], &[], &[], &mut m),
        [DL, IL, IL]
    );
    // A block pointing to itself.
    let mut m = Fake::default();
    m.put(A, A);
    assert_eq!(run(&[host(A, 64)], &[], &[], &mut m), [DL]);
}

#[test]
fn an_earlier_leader_reached_later_joins_the_clique() {
    // B (0x2000) -> A (0x1000): A leads first, then B absorbs it.
    let mut m = Fake::default();
    m.put(B, A);
    assert_eq!(run(&[host(A, 64), host(B, 64)], &[], &[], &mut m), [IL, DL]);
    // A tree: its root lost, the rest indirectly.
    let mut m = Fake::default();
    let (l, r) = (0x3000, 0x4000);
    m.put(B, l);
    m.put(B + 8, r);
    m.put(l, A);
    let nodes = [host(A, 64), host(B, 64), host(l, 64), host(r, 64)];
    assert_eq!(run(&nodes, &[], &[], &mut m), [IL, DL, IL, IL]);
}

#[test]
fn heuristics_make_interior_pointers_reachable() {
    // length64: 8-byte length of the rest, then data.
    let mut m = Fake::default();
    m.put(A, 56);
    m.put(ROOT, A + 8);
    let vtable = |_: u64| false;
    let outcome = classify(
        &Input {
            nodes: &[host(A, 64)],
            roots: &[root(8)],
            registers: &[],
            vtable: &vtable,
            provenance: false,
            first_words: false,
        },
        &mut m,
    );
    assert_eq!(
        outcome.verdicts[0],
        Verdict {
            category: SR,
            heuristic: Some(Heuristic::Length64)
        }
    );
    // newarray near miss: 3 does not divide 64 - 8 = 56 ... 56 % 3 != 0.
    let mut m = Fake::default();
    m.put(A, 3);
    m.put(ROOT, A + 8);
    assert_eq!(run(&[host(A, 64)], &[root(8)], &[], &mut m), [PL]);
    // newarray: 7 elements of 8 bytes.
    let mut m = Fake::default();
    m.put(A, 7);
    m.put(ROOT, A + 8);
    assert_eq!(run(&[host(A, 64)], &[root(8)], &[], &mut m), [SR]);
    // multiple inheritance: two vtable pointers.
    let mut m = Fake::default();
    m.put(A, 0x40_0010);
    m.put(A + 16, 0x40_0100);
    m.put(ROOT, A + 16);
    assert_eq!(run(&[host(A, 64)], &[root(8)], &[], &mut m), [SR]);
    // A heuristic does not apply from a possibly lost block.
    let mut m = Fake::default();
    m.put(ROOT, A + 24);
    m.put(B, 56);
    m.put(A, B + 8);
    assert_eq!(
        run(&[host(A, 64), host(B, 64)], &[root(8)], &[], &mut m),
        [PL, PL]
    );
}

#[test]
fn a_later_start_pointer_clears_the_heuristic() {
    let mut m = Fake::default();
    m.put(A, 56);
    m.put(ROOT, A + 8);
    m.put(ROOT + 8, A);
    let vtable = |_: u64| false;
    let outcome = classify(
        &Input {
            nodes: &[host(A, 64)],
            roots: &[root(16)],
            registers: &[],
            vtable: &vtable,
            provenance: false,
            first_words: false,
        },
        &mut m,
    );
    assert_eq!(outcome.verdicts[0].heuristic, None);
}

#[test]
fn zero_size_blocks_and_one_past_the_end() {
    let mut m = Fake::default();
    m.put(ROOT, B);
    m.put(ROOT + 8, A + 64);
    assert_eq!(
        run(
            &[host(A, 64), host(B, 0), host(0x3000, 0)],
            &[root(16)],
            &[],
            &mut m
        ),
        [DL, SR, DL]
    );
}

#[test]
fn device_blocks_are_never_read_and_follow_their_holders() {
    let dev = 0x7000_0000;
    let mut m = Fake::default();
    m.forbidden.push((dev, dev + 4096));
    m.put(dev, A); // would make A reachable if device memory were read
    m.put(ROOT, dev);
    m.put(B, dev + 4096 * 2);
    let nodes = [
        host(A, 64),
        device(dev, 4096),
        host(B, 64),
        device(dev + 8192, 4096),
    ];
    // dev reachable from the root; dev2 held only by lost B: indirectly lost.
    assert_eq!(run(&nodes, &[root(8)], &[], &mut m), [DL, SR, DL, IL]);
}

#[test]
fn runtime_memory_never_keeps_a_device_block() {
    let dev = 0x7000_0000;
    let mut m = Fake::default();
    // The driver's table (a runtime-owned root) holds both addresses.
    m.put(ROOT, dev);
    m.put(ROOT + 8, A);
    let runtime_root = RootRegion {
        runtime_owned: true,
        ..root(16)
    };
    let nodes = [host(A, 64), device(dev, 4096)];
    assert_eq!(run(&nodes, &[runtime_root], &[], &mut m), [SR, DL]);
    // A runtime-owned host block reached from the program: still never
    // marks the device block, in either pass.
    let mut m = Fake::default();
    m.put(ROOT, A);
    m.put(A, dev);
    let owned = Node::new(A, 64, true, true);
    assert_eq!(
        run(&[owned, device(dev, 4096)], &[root(8)], &[], &mut m),
        [SR, DL]
    );
    let mut m = Fake::default();
    m.put(A, dev);
    assert_eq!(run(&[owned, device(dev, 4096)], &[], &[], &mut m), [DL, DL]);
}

#[test]
fn a_host_and_a_device_block_at_one_address_are_both_marked() {
    let mut m = Fake::default();
    m.put(ROOT, A);
    assert_eq!(
        run(&[host(A, 64), device(A, 64)], &[root(8)], &[], &mut m),
        [SR, SR]
    );
}

#[test]
fn registers_are_roots_and_unreadable_memory_holds_nothing() {
    let mut m = Fake::default();
    m.put(ROOT, A);
    m.unreadable.push((ROOT, ROOT + 4096));
    assert_eq!(
        run(&[host(A, 64), host(B, 64)], &[root(8)], &[B + 4], &mut m),
        [DL, PL]
    );
    assert_eq!(run(&[host(A, 64)], &[], &[A], &mut m), [SR]);
}

#[test]
fn a_chain_of_a_million_blocks_is_marked_without_recursion() {
    const N: u64 = 1_000_000;
    let mut m = Fake::default();
    let nodes: Vec<Node> = (0..N).map(|i| host(0x1000_0000 + i * 32, 32)).collect();
    for i in 0..N - 1 {
        m.put(0x1000_0000 + i * 32, 0x1000_0000 + (i + 1) * 32);
    }
    m.put(ROOT, 0x1000_0000);
    let categories = run(&nodes, &[root(8)], &[], &mut m);
    assert!(categories.iter().all(|&c| c == SR));
    // Lost from the head: one definitely lost, the rest indirectly.
    m.put(ROOT, 0);
    let categories = run(&nodes, &[root(8)], &[], &mut m);
    assert_eq!(categories[0], DL);
    assert!(categories[1..].iter().all(|&c| c == IL));
}

#[test]
fn big_blocks_are_read_in_chunks() {
    let big = 0x2000_0000;
    let size = 3 * CHUNK as u64 + 24;
    let mut m = Fake::default();
    m.put(ROOT, big);
    m.put(big + size - 16, A);
    assert_eq!(
        run(&[host(big, size), host(A, 64)], &[root(8)], &[], &mut m),
        [SR, SR]
    );
}

#[test]
fn many_waiting_blocks_are_swept_in_address_order() {
    // A table reachable from the root holds 20,000 blocks (a sweep: far
    // more than wait for a batch); each block also points to the one
    // below it, and half of a second set is reachable only that way.
    const N: u64 = 20_000;
    let table = 0x4000_0000;
    let base = 0x5000_0000;
    let lost_base = 0x7000_0000;
    let mut m = Fake::default();
    let mut nodes = vec![host(table, N * 8)];
    m.put(ROOT, table);
    for i in 0..N {
        let block = base + i * 64;
        nodes.push(host(block, 64));
        m.put(table + i * 8, block);
        if i > 0 {
            m.put(block + 8, block - 64);
        }
    }
    // Lost: a chain nobody points to, from its top down.
    for i in 0..100 {
        let block = lost_base + i * 64;
        nodes.push(host(block, 64));
        if i > 0 {
            m.put(block, block - 64);
        }
    }
    let categories = run(&nodes, &[root(8)], &[], &mut m);
    assert!(categories[..=N as usize].iter().all(|&c| c == SR));
    let lost = &categories[N as usize + 1..];
    assert_eq!(lost.iter().filter(|&&c| c == DL).count(), 1);
    assert_eq!(lost.iter().filter(|&&c| c == IL).count(), 99);
    assert_eq!(lost[99], DL);
}

#[test]
fn a_swept_block_reached_first_by_an_interior_pointer_is_rescanned_when_reachable() {
    // 5,000 blocks reached by interior pointers (possibly lost), then a
    // start pointer to each later in the root upgrades them and what they
    // hold.
    const N: u64 = 5_000;
    let base = 0x5000_0000;
    let held = 0x6000_0000;
    let mut m = Fake::default();
    let mut nodes = Vec::new();
    for i in 0..N {
        nodes.push(host(base + i * 64, 64));
        m.put(ROOT + i * 8, base + i * 64 + 16);
        m.put(ROOT + (N + i) * 8, base + i * 64);
        m.put(base + i * 64, held + i * 32);
    }
    for i in 0..N {
        nodes.push(host(held + i * 32, 32));
    }
    let categories = run(&nodes, &[root(2 * N * 8)], &[], &mut m);
    assert!(
        categories.iter().all(|&c| c == SR),
        "{:?}",
        &categories[..4]
    );
}

/// Provenance: the chain from a block back to the register or root word
/// that kept it, and from an indirectly lost block to its clique's leader.
#[test]
fn provenance_names_the_chain_of_words_that_kept_a_block() {
    let mut m = Fake::default();
    // Root word -> A (start); A+8 -> B + 16 (interior: possibly lost);
    // register -> C; D (unreached) -> E.
    let (c, d, e) = (0x3000, 0x4000, 0x5000);
    m.put(ROOT + 24, A);
    m.put(A + 8, B + 16);
    m.put(d + 16, e);
    let nodes = [
        host(A, 64),
        host(B, 64),
        host(c, 32),
        host(d, 32),
        host(e, 32),
    ];
    let vtable = |_: u64| false;
    let roots = [root(64)];
    let outcome = classify(
        &Input {
            nodes: &nodes,
            roots: &roots,
            registers: &[7, c + 8, c],
            vtable: &vtable,
            provenance: true,
            first_words: false,
        },
        &mut m,
    );
    let categories: Vec<Category> = outcome.verdicts.iter().map(|v| v.category).collect();
    assert_eq!(categories, vec![SR, PL, SR, DL, IL]);
    let mark = |source, value| Mark { source, value };
    assert_eq!(
        super::chain(&outcome.marks, 1),
        vec![
            (1, mark(Source::Block { node: 0, at: A + 8 }, B + 16)),
            (0, mark(Source::Root { at: ROOT + 24 }, A)),
        ]
    );
    // The interior register word marked C possibly lost first; the start
    // pointer after it made it reachable, and is what is kept.
    assert_eq!(
        super::chain(&outcome.marks, 2),
        vec![(2, mark(Source::Register { index: 2 }, c))]
    );
    assert_eq!(super::chain(&outcome.marks, 3), vec![]);
    assert_eq!(
        super::chain(&outcome.marks, 4),
        vec![(
            4,
            mark(
                Source::Block {
                    node: 3,
                    at: d + 16
                },
                e
            )
        )]
    );
    // Without provenance nothing is kept.
    let plain = classify(
        &Input {
            nodes: &nodes,
            roots: &roots,
            registers: &[],
            vtable: &vtable,
            provenance: false,
            first_words: false,
        },
        &mut m,
    );
    assert!(plain.marks.is_empty());
}
