//! The leak check's marking timed in memory (`#[ignore]`d: run with
//! `cargo test --release -p memtrace --bins reach::bench -- --ignored
//! --nocapture`): heaps shaped like the `heapscan` fixture's (every eighth
//! word a pointer to a random block, all reachable from a table), marked
//! with one lookup per word and with sorted batches, beside the rate at
//! which the same memory is copied out (the floor `process_vm_readv` sets
//! for a real process). Nothing here asserts a time.

use std::time::Instant;

use super::*;

/// A heap in one buffer, a root region holding the table's address.
struct Heap {
    base: u64,
    bytes: Vec<u8>,
    root: u64,
    root_word: u64,
    nodes: Vec<Node>,
}

impl Memory for Heap {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> usize {
        buf.fill(0);
        if addr == self.root && buf.len() >= 8 {
            buf[..8].copy_from_slice(&self.root_word.to_le_bytes());
            return buf.len();
        }
        let Some(from) = addr.checked_sub(self.base) else {
            return 0;
        };
        let from = from as usize;
        let to = (from + buf.len()).min(self.bytes.len());
        if from >= to {
            return 0;
        }
        buf[..to - from].copy_from_slice(&self.bytes[from..to]);
        to - from
    }
}

/// `count` blocks of `size` bytes, `stride` apart, then the table; with
/// `chain`, each block's first word points to the next one instead (a
/// list: one block per level).
fn heap(count: usize, size: usize, stride: usize, chain: bool) -> Heap {
    let base = 0x5555_0000_0000u64;
    let table = base + (count * stride) as u64;
    let mut bytes = vec![0u8; count * stride + count * 8];
    let mut nodes = Vec::with_capacity(count + 1);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let words = size / 8;
    for i in 0..count {
        let start = base + (i * stride) as u64;
        nodes.push(Node::host(start, size as u64));
        let block = &mut bytes[i * stride..i * stride + words * 8];
        for w in 0..words {
            let value = if chain {
                match (w, i + 1 < count) {
                    (0, true) => start + stride as u64,
                    _ => (w * 31 + i) as u64,
                }
            } else if w.is_multiple_of(8) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                base + (state % count as u64) * stride as u64
            } else {
                (w * 31 + i) as u64
            };
            block[w * 8..w * 8 + 8].copy_from_slice(&value.to_le_bytes());
        }
        let entry = if chain && i > 0 { 0 } else { start };
        let at = count * stride + i * 8;
        bytes[at..at + 8].copy_from_slice(&entry.to_le_bytes());
    }
    nodes.push(Node::host(table, (count * 8) as u64));
    Heap {
        base,
        bytes,
        root: 0x7fff_0000_0000,
        root_word: table,
        nodes,
    }
}

fn run(heap: &mut Heap, tuning: Tuning) -> (f64, Outcome) {
    let nodes = std::mem::take(&mut heap.nodes);
    let vtable = |_: u64| false;
    let roots = [RootRegion {
        start: heap.root,
        len: 8,
        runtime_owned: false,
    }];
    let input = Input {
        nodes: &nodes,
        roots: &roots,
        registers: &[],
        vtable: &vtable,
        provenance: false,
        first_words: false,
    };
    let time = Instant::now();
    let outcome = classify_tuned(&input, heap, tuning);
    let seconds = time.elapsed().as_secs_f64();
    heap.nodes = nodes;
    (seconds, outcome)
}

/// Seconds to copy the heap out a chunk at a time.
fn copy(heap: &mut Heap) -> f64 {
    let mut buf = vec![0u8; CHUNK];
    let len = heap.bytes.len() as u64;
    let time = Instant::now();
    let mut at = 0;
    while at < len {
        heap.read(heap.base + at, &mut buf);
        at += CHUNK as u64;
    }
    std::hint::black_box(&buf);
    time.elapsed().as_secs_f64()
}

fn measure(name: &str, count: usize, size: usize, stride: usize, chain: bool) {
    let mut heap = heap(count, size, stride, chain);
    let copy_s = copy(&mut heap);
    let copy_rate = heap.bytes.len() as f64 / copy_s;
    let tuned = Tuning::for_nodes(&heap.nodes);
    let one_by_one = Tuning {
        sorted: false,
        ..tuned
    };
    let sorted = Tuning {
        sorted: true,
        direct: false,
        ..tuned
    };
    let mut verdicts = None;
    // `REACH_BENCH_ONLY=default` (a label) runs one way only: for a profiler.
    let only = std::env::var("REACH_BENCH_ONLY").ok();
    for (label, tuning) in [
        ("word by word", one_by_one),
        ("sorted", sorted),
        ("default", tuned),
    ] {
        if only.as_deref().is_some_and(|only| only != label) {
            continue;
        }
        let (seconds, outcome) = run(&mut heap, tuning);
        let rate = outcome.scanned_bytes as f64 / seconds;
        let reachable = outcome
            .verdicts
            .iter()
            .filter(|v| v.category == Category::StillReachable)
            .count();
        println!(
            "{name}: {label:>12}: {seconds:7.3} s, scanned {:.0} MiB, {:.2} GB/s, \
             copy {:.2} GB/s, scan/copy {:.3}, {reachable} reachable, {} hits",
            outcome.scanned_bytes as f64 / (1 << 20) as f64,
            rate / 1e9,
            copy_rate / 1e9,
            rate / copy_rate,
            outcome.hits,
        );
        match &verdicts {
            None => verdicts = Some(outcome.verdicts),
            Some(v) => assert_eq!(v, &outcome.verdicts, "{name} {label}"),
        }
    }
}

#[test]
#[ignore]
fn bench_10k_blocks_of_100_kib() {
    measure(
        "1 GiB in 10k blocks",
        10_000,
        100 << 10,
        (100 << 10) + 16,
        false,
    );
}

#[test]
#[ignore]
fn bench_1m_blocks() {
    measure("107 MiB in 1M blocks", 1_000_000, 104, 112, false);
}

#[test]
#[ignore]
fn bench_10m_blocks() {
    measure("1 GiB in 10M blocks", 10_000_000, 104, 112, false);
}

#[test]
#[ignore]
fn bench_a_list_of_1m_blocks() {
    measure("a list of 1M blocks", 1_000_000, 104, 112, true);
}
