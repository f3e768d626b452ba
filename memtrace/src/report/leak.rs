//! The leak check in the report: its summary ([`LeakCheck`], the JSON
//! contract `leak_check`), the verdict of each judged block
//! ([`LeakVerdicts`], which the builder splits per site) and the
//! `--fail-on` gate ([`LeakGate`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::probe::catalog::Domain;
use crate::reach::Category;

/// Bytes and blocks.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct Amount {
    /// Their bytes, all blocks together.
    pub bytes: u64,
    /// How many blocks.
    pub blocks: u64,
}

impl Amount {
    pub fn add(&mut self, bytes: u64) {
        self.bytes += bytes;
        self.blocks += 1;
    }

    pub fn merge(&mut self, other: Amount) {
        self.bytes += other.bytes;
        self.blocks += other.blocks;
    }
}

/// Blocks and bytes in each of valgrind's four categories.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
pub struct LeakSplit {
    /// Blocks nothing points to any more: no pointer from the roots, not
    /// even into their middle, and none from another lost block (of a
    /// cycle of lost blocks, one) (valgrind's "definitely lost").
    pub definitely_lost: Amount,
    /// Lost blocks pointed to only from other lost blocks: what a
    /// definitely lost block leads to, directly or not (valgrind's
    /// "indirectly lost").
    pub indirectly_lost: Amount,
    /// Blocks the roots reach only through a pointer into their middle that
    /// no heuristic accepts, or through such blocks (valgrind's "possibly
    /// lost").
    pub possibly_lost: Amount,
    /// Blocks the roots still reach through pointers to their start (or
    /// into their middle where a heuristic accepts it): not leaks
    /// (valgrind's "still reachable").
    pub still_reachable: Amount,
}

impl LeakSplit {
    pub fn add(&mut self, category: Category, bytes: u64) {
        self.slot(category).add(bytes);
    }

    pub fn slot(&mut self, category: Category) -> &mut Amount {
        match category {
            Category::DefinitelyLost => &mut self.definitely_lost,
            Category::IndirectlyLost => &mut self.indirectly_lost,
            Category::PossiblyLost => &mut self.possibly_lost,
            Category::StillReachable => &mut self.still_reachable,
        }
    }

    pub fn get(&self, category: Category) -> Amount {
        match category {
            Category::DefinitelyLost => self.definitely_lost,
            Category::IndirectlyLost => self.indirectly_lost,
            Category::PossiblyLost => self.possibly_lost,
            Category::StillReachable => self.still_reachable,
        }
    }

    pub fn merge(&mut self, other: &LeakSplit) {
        for category in Category::ALL {
            self.slot(category).merge(other.get(category));
        }
    }

    /// Bytes in some lost category (definitely, indirectly or possibly).
    pub fn lost_bytes(&self) -> u64 {
        self.definitely_lost.bytes + self.indirectly_lost.bytes + self.possibly_lost.bytes
    }
}

/// When a check ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum CheckPoint {
    /// Launch mode: the command about to exit, its memory intact.
    Exit,
    /// The final report of a trace by pid.
    End,
    /// An `--interval` report.
    Interval,
}

/// The leak check's summary (`leak_check` in the JSON report; a contract:
/// add keys, never rename them).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct LeakCheck {
    /// False when the check could not run: `reason` says why, and nothing
    /// is judged (the four categories are then zero).
    pub ran: bool,
    /// Why the check could not run (`ran` false); when it ran, what it left
    /// out (a scan cut by `--leak-check-max-pause`, processes not checked);
    /// null otherwise.
    pub reason: Option<String>,
    /// When the check ran: `exit` (launch mode, the command about to
    /// exit), `end` (the final report of a trace by pid) or `interval` (an
    /// `--interval` report).
    pub when: Option<CheckPoint>,
    #[serde(flatten)]
    pub split: LeakSplit,
    /// Still reachable only through an interior pointer that one of
    /// valgrind's heuristics accepts, by heuristic (included in
    /// `still_reachable`); keys: `stdstring`, `length64`, `newarray`,
    /// `multipleinheritance`.
    pub reachable_via_heuristic: BTreeMap<String, Amount>,
    /// Live blocks not judged: mappings (`mmap`, roots as in valgrind),
    /// handles, and with a scan cut by `--leak-check-max-pause` the blocks
    /// it did not prove reachable.
    pub not_judged: Amount,
    /// How long the target was stopped, in ms (all processes together).
    pub pause_ms: f64,
    /// How the memory was read: `snapshot` (a copy-on-write child cloned
    /// during the stop and scanned while the target runs: the pause is the
    /// stop and the clone) or `stopped` (the target stopped for the whole
    /// scan: launch mode's exit check, `--leak-check-mode stopped`, or a
    /// snapshot that could not be taken, `fallback` saying why); null when
    /// the check did not run.
    #[serde(default)]
    pub mode: Option<CheckMode>,
    /// Why a snapshot was not taken, or was given up, when one was wanted.
    #[serde(default)]
    pub fallback: Option<String>,
    /// How long the scan and the judgement took, in ms (in `snapshot` mode
    /// the target ran meanwhile).
    #[serde(default)]
    pub scan_ms: f64,
    /// `snapshot` mode: how long the injected clone took, in ms (in the
    /// pause).
    #[serde(default)]
    pub clone_ms: f64,
    /// `snapshot` mode: the clone's duration as estimated before the stop,
    /// from the anonymous memory and the fork cost measured on this host
    /// (absent when it could not be measured).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone_estimate_ms: Option<f64>,
    /// `snapshot` mode: bytes copied from the target during the stop (ranges
    /// a child does not see as the target has them: `MADV_DONTFORK`,
    /// `MADV_WIPEONFORK`, userfaultfd-registered).
    #[serde(default)]
    pub copied_at_stop_bytes: u64,
    /// Bytes of the target's memory scanned for pointers.
    pub scanned_bytes: u64,
    /// Bytes that could not be read (unmapped meanwhile): read as zeros.
    pub unreadable_bytes: u64,
    /// Bytes left unscanned because the pause reached `--leak-check-max-pause`.
    pub skipped_bytes: u64,
    /// Threads stopped and read.
    pub threads: u64,
    /// Processes checked.
    pub processes: u64,
    /// Whether the table held every block of the process since its start
    /// (launch mode): then the allocator's heaps are not roots.
    pub complete_table: bool,
    /// The `--fail-on` categories this check failed, after `--suppress`.
    pub failed_gates: Vec<String>,
    /// With `--leak-check-explain`: why each block asked about is in its
    /// category (the chain of pointers from a root, or that none was found).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub explain: Vec<Explanation>,
    /// By pid: the blocks allocated before memtrace attached, found by
    /// walking glibc's heap (included in the four totals above; they have
    /// no allocation stack, so no site); null in launch mode unless
    /// `--heap-walk`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before_attach: Option<BeforeAttach>,
}

/// The blocks from before the attach (`leak_check.before_attach`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct BeforeAttach {
    #[serde(flatten)]
    pub split: LeakSplit,
    /// The blocks grouped by size, type and category, largest total first
    /// (at most 50 groups).
    pub groups: Vec<BlockGroup>,
    /// How the heap was walked.
    pub heap_walk: HeapWalkSummary,
    /// Memory no walk covers, in one line each (another allocator's heap,
    /// Python's obmalloc arenas: roots, not blocks).
    pub notes: Vec<String>,
}

impl BeforeAttach {
    /// The lines of the text report.
    pub fn lines(&self) -> Vec<String> {
        let before = self;
        let walk = &before.heap_walk;
        let mut lines = vec![match walk.status.as_str() {
        "not_run" => format!(
            "   before the attach: heap not walked: {}",
            walk.reason.as_deref().unwrap_or("no reason given")
        ),
        status => format!(
            "   before the attach (heap walk {status}, glibc {}, {}/{} arenas, {} chunks in use, {} mmapped): {} blocks judged{}",
            walk.glibc_version.as_deref().unwrap_or("?"),
            walk.arenas_walked,
            walk.arenas,
            walk.chunks,
            walk.mmapped_chunks,
            walk.blocks_before_attach,
            walk.reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        ),
    }];
        for group in before.groups.iter().take(10) {
            lines.push(format!(
                "     {}: {} bytes in {} blocks of {} B, {}, no allocation stack{}",
                group.category,
                group.bytes,
                group.count,
                group.size,
                group.type_name.as_deref().unwrap_or("no type"),
                group
                    .same_size_as_site
                    .map(|k| format!(" (same size as site #{k})"))
                    .unwrap_or_default()
            ));
        }
        lines.extend(before.notes.iter().map(|n| format!("     note: {n}")));
        lines
    }
}

/// Blocks of one size and category from before the attach.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct BlockGroup {
    /// The blocks' usable size in bytes (`malloc_usable_size`: the size
    /// asked for, rounded up to glibc's chunk granularity).
    pub size: u64,
    /// Their C++ type, when their first word points into a vtable a
    /// symbol names (`std::basic_ios<char, std::char_traits<char> >`);
    /// null otherwise.
    #[serde(rename = "type")]
    pub type_name: Option<String>,
    /// The category (`definitely-lost` ...).
    pub category: String,
    /// How many blocks.
    pub count: u64,
    /// Their bytes together.
    pub bytes: u64,
    /// The first site of the report (1-based, as the text numbers them)
    /// with live blocks glibc made this size: a likely origin of these
    /// (same size only: a traced block's type is not read); null when none.
    #[serde(default)]
    pub same_size_as_site: Option<usize>,
}

/// How glibc's heap was walked (`leak_check.before_attach.heap_walk`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct HeapWalkSummary {
    /// `complete` (every arena walked), `partial` (some arenas were not:
    /// their heaps stay roots, none of their blocks is judged; `reason`
    /// says why) or `not_run` (the heap stays a root; `reason` says why).
    pub status: String,
    /// The target's glibc (`2.36`).
    pub glibc_version: Option<String>,
    /// How `main_arena` was found: `debug symbols` (its symbol in libc's
    /// debug file, `libc6-dbg`, of that very build) or `empty bins` (no
    /// debug file: its bins pointing at themselves, as chap finds it).
    #[serde(default)]
    pub main_arena_from: Option<String>,
    /// Arenas found, and walked.
    pub arenas: u32,
    pub arenas_walked: u32,
    /// Chunks in use found (the traced blocks among them), and chunks
    /// stepped over (free ones included).
    pub chunks: u64,
    pub chunks_walked: u64,
    /// Chunks glibc mmapped for large blocks.
    pub mmapped_chunks: u64,
    /// glibc's own count of them (`mp_.n_mmaps`, read from `mp_`, found by
    /// its `sbrk_base`); null when not found. A walk that finds fewer is
    /// `partial` (the others stay roots); one that finds more judges none.
    #[serde(default)]
    pub mmapped_chunks_glibc: Option<u64>,
    /// Blocks from before the attach (in use, not traced, not glibc's own).
    pub blocks_before_attach: u64,
    /// How long the walk took, in ms (within the pause).
    pub walk_ms: f64,
    /// Why the walk is partial or did not run.
    pub reason: Option<String>,
}

/// Why one block is in its category (`--leak-check-explain`), as chap's
/// `describe` and LeakSanitizer's `report_objects` tell it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Explanation {
    /// What was asked: an address, or a category whose blocks are explained.
    pub asked: String,
    /// The process.
    pub pid: u32,
    /// Start of the judged block holding the address; null when no judged
    /// block holds it.
    pub block: Option<u64>,
    /// The block's size in bytes.
    pub size: u64,
    /// Its category (`definitely-lost`, `indirectly-lost`, `possibly-lost`,
    /// `still-reachable`); null when no judged block holds the address.
    pub category: Option<String>,
    /// From the block back to what kept it: each link is the pointer that
    /// gave a block its category. Ends at a root or a register (reachable,
    /// possibly lost) or at the definitely lost block that leads the
    /// clique (indirectly lost); empty for a definitely lost block.
    pub chain: Vec<ExplainLink>,
    /// The explanation in words, one line per link.
    pub lines: Vec<String>,
}

/// One pointer of an explanation's chain.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ExplainLink {
    /// Start of the block this pointer marked.
    pub block: u64,
    /// The pointer's value: the block's start, or an address inside it
    /// (an interior pointer).
    pub pointer: u64,
    /// Where the pointer was: `register`, `root` (memory scanned whole:
    /// a writable segment, a stack, anonymous memory) or `block` (inside
    /// another block).
    pub kind: String,
    /// The pointer's own address; null for a register.
    pub at: Option<u64>,
    /// What holds it, in words: `register rsp of thread 1`, `stack of
    /// thread 1 (sp+0x40)`, `/usr/lib/x86_64-linux-gnu/libc.so.6 rw-p
    /// +0x1a0`, `block 0x5555... (96 B) +0x8`.
    pub holder: String,
}

/// How a leak check read the target's memory (`leak_check.mode`).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum CheckMode {
    /// A copy-on-write child of the target, scanned while the target runs.
    Snapshot,
    /// The target stopped for the whole scan.
    Stopped,
}

impl LeakCheck {
    /// A check that could not run, and why (one line).
    pub fn not_run(when: CheckPoint, reason: impl Into<String>) -> Self {
        LeakCheck {
            ran: false,
            reason: Some(reason.into()),
            when: Some(when),
            ..LeakCheck::default()
        }
    }
}

/// The verdicts of one process's judged blocks of one domain: 9 bytes a
/// block (a check of 10M blocks keeps 90 MB of them, not 240 MB of keyed
/// entries).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerdictRun {
    pub pid: u32,
    pub domain: Domain,
    /// The blocks' addresses, ascending.
    pub addrs: Vec<u64>,
    /// Each address's category.
    pub categories: Vec<Category>,
}

impl VerdictRun {
    pub fn new(pid: u32, domain: Domain, capacity: usize) -> VerdictRun {
        VerdictRun {
            pid,
            domain,
            addrs: Vec::with_capacity(capacity),
            categories: Vec::with_capacity(capacity),
        }
    }

    pub fn push(&mut self, addr: u64, category: Category) {
        self.addrs.push(addr);
        self.categories.push(category);
    }

    /// Puts the addresses in ascending order (with their categories).
    fn sort(&mut self) {
        if self.addrs.is_sorted() {
            return;
        }
        let mut pairs: Vec<(u64, Category)> = self
            .addrs
            .iter()
            .copied()
            .zip(self.categories.iter().copied())
            .collect();
        pairs.sort_unstable_by_key(|p| p.0);
        (self.addrs, self.categories) = pairs.into_iter().unzip();
    }
}

/// The verdict of each judged block, by (process, domain, address): runs
/// of one process and domain, sorted for lookup (compact: millions of
/// blocks).
#[derive(Clone, Debug, Default)]
pub struct LeakVerdicts {
    /// Sorted by (process, domain), one run each.
    runs: Vec<VerdictRun>,
    /// When each process's blocks were judged (`CLOCK_MONOTONIC` ns, the
    /// table's clock): a block allocated later at a judged block's address
    /// (the process ran on during a snapshot's scan, and after) has no
    /// verdict.
    as_of_ns: Vec<(u32, u64)>,
}

impl LeakVerdicts {
    /// From keyed entries (a recording's), in any order.
    pub fn new(mut entries: Vec<((u32, Domain, u64), Category)>) -> Self {
        entries.sort_unstable_by_key(|e| e.0);
        let mut runs: Vec<VerdictRun> = Vec::new();
        for ((pid, domain, addr), category) in entries {
            match runs.last_mut() {
                Some(run) if run.pid == pid && run.domain == domain => run.push(addr, category),
                _ => {
                    let mut run = VerdictRun::new(pid, domain, 0);
                    run.push(addr, category);
                    runs.push(run);
                }
            }
        }
        LeakVerdicts {
            runs,
            as_of_ns: Vec::new(),
        }
    }

    /// Adds `pid`'s verdicts, its blocks judged as they were at `ns` (its
    /// stop).
    pub fn add(&mut self, runs: Vec<VerdictRun>, pid: u32, ns: u64) {
        for mut run in runs {
            let key = (run.pid, run.domain);
            match self.runs.binary_search_by(|r| (r.pid, r.domain).cmp(&key)) {
                Ok(at) => {
                    let kept = &mut self.runs[at];
                    kept.addrs.append(&mut run.addrs);
                    kept.categories.append(&mut run.categories);
                    kept.sort();
                }
                Err(at) => {
                    run.sort();
                    self.runs.insert(at, run);
                }
            }
        }
        self.as_of_ns.retain(|&(p, _)| p != pid);
        self.as_of_ns.push((pid, ns));
    }

    /// The verdict of the block at `addr` allocated at `born_ns`: none for
    /// a block born after its process's check.
    pub fn of_block(&self, pid: u32, domain: Domain, addr: u64, born_ns: u64) -> Option<Category> {
        let judged_at = self.as_of_ns.iter().find(|&&(p, _)| p == pid);
        if judged_at.is_some_and(|&(_, t)| born_ns > t) {
            return None;
        }
        self.get(pid, domain, addr)
    }

    pub fn get(&self, pid: u32, domain: Domain, addr: u64) -> Option<Category> {
        let run = self
            .runs
            .binary_search_by(|r| (r.pid, r.domain).cmp(&(pid, domain)))
            .ok()
            .map(|at| &self.runs[at])?;
        let at = run.addrs.binary_search(&addr).ok()?;
        run.categories.get(at).copied()
    }

    /// Every verdict, in (process, domain, address) order.
    pub fn iter(&self) -> impl Iterator<Item = ((u32, Domain, u64), Category)> + '_ {
        self.runs.iter().flat_map(|run| {
            run.addrs
                .iter()
                .zip(&run.categories)
                .map(move |(&addr, &category)| ((run.pid, run.domain, addr), category))
        })
    }
}

/// The latest check of a trace: its summary and the verdict of each block
/// judged.
#[derive(Clone, Debug, Default)]
pub struct LeakState {
    pub summary: Option<LeakCheck>,
    pub verdicts: LeakVerdicts,
}

/// A category `--fail-on` can gate on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LeakGate {
    DefinitelyLost,
    IndirectlyLost,
    PossiblyLost,
    StillReachable,
}

impl LeakGate {
    pub fn category(self) -> Category {
        match self {
            LeakGate::DefinitelyLost => Category::DefinitelyLost,
            LeakGate::IndirectlyLost => Category::IndirectlyLost,
            LeakGate::PossiblyLost => Category::PossiblyLost,
            LeakGate::StillReachable => Category::StillReachable,
        }
    }

    pub fn name(self) -> &'static str {
        category_name(self.category())
    }
}

/// A category's name as valgrind writes it, hyphenated (`definitely-lost`).
pub fn category_name(category: Category) -> &'static str {
    match category {
        Category::DefinitelyLost => "definitely-lost",
        Category::IndirectlyLost => "indirectly-lost",
        Category::PossiblyLost => "possibly-lost",
        Category::StillReachable => "still-reachable",
    }
}

/// The gates failed by `split` (the blocks left after `--suppress`).
pub fn failed_gates(gates: &[LeakGate], split: &LeakSplit) -> Vec<String> {
    gates
        .iter()
        .filter(|gate| split.get(gate.category()).bytes > 0)
        .map(|gate| gate.name().to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_are_found_by_key() {
        let verdicts = LeakVerdicts::new(vec![
            ((2, Domain::Heap, 0x20), Category::StillReachable),
            ((1, Domain::Heap, 0x30), Category::DefinitelyLost),
            ((1, Domain::CudaMemory, 0x30), Category::IndirectlyLost),
        ]);
        assert_eq!(
            verdicts.get(1, Domain::Heap, 0x30),
            Some(Category::DefinitelyLost)
        );
        assert_eq!(
            verdicts.get(1, Domain::CudaMemory, 0x30),
            Some(Category::IndirectlyLost)
        );
        assert_eq!(verdicts.get(1, Domain::Heap, 0x20), None);
        // A block born after the check at a judged address: no verdict.
        let mut verdicts = verdicts;
        let mut run = VerdictRun::new(2, Domain::Heap, 2);
        run.push(0x40, Category::PossiblyLost);
        run.push(0x10, Category::DefinitelyLost);
        verdicts.add(vec![run], 1, 1_000);
        assert!(verdicts.of_block(1, Domain::Heap, 0x30, 999).is_some());
        assert_eq!(verdicts.of_block(1, Domain::Heap, 0x30, 1_001), None);
        assert!(verdicts.of_block(2, Domain::Heap, 0x10, 1_001).is_some());
        assert_eq!(verdicts.iter().count(), 5);
        // Merged into pid 2's run, in address order.
        let keys: Vec<_> = verdicts.iter().map(|(key, _)| key).collect();
        assert_eq!(
            keys,
            vec![
                (1, Domain::Heap, 0x30),
                (1, Domain::CudaMemory, 0x30),
                (2, Domain::Heap, 0x10),
                (2, Domain::Heap, 0x20),
                (2, Domain::Heap, 0x40),
            ]
        );
        assert_eq!(
            verdicts.get(2, Domain::Heap, 0x40),
            Some(Category::PossiblyLost)
        );
    }

    #[test]
    fn gates_fail_on_bytes_in_their_category() {
        let mut split = LeakSplit::default();
        split.add(Category::PossiblyLost, 10);
        let gates = [LeakGate::DefinitelyLost, LeakGate::PossiblyLost];
        assert_eq!(failed_gates(&gates, &split), vec!["possibly-lost"]);
        assert!(failed_gates(&[LeakGate::StillReachable], &split).is_empty());
        assert_eq!(split.lost_bytes(), 10);
    }

    #[test]
    fn the_summary_serializes_the_contract_keys() {
        let mut check = LeakCheck {
            ran: true,
            when: Some(CheckPoint::Exit),
            ..LeakCheck::default()
        };
        check.split.add(Category::DefinitelyLost, 100);
        let json = serde_json::to_value(&check).expect("serializes");
        assert_eq!(json["definitely_lost"]["bytes"], 100);
        assert_eq!(json["definitely_lost"]["blocks"], 1);
        for key in [
            "indirectly_lost",
            "possibly_lost",
            "still_reachable",
            "pause_ms",
            "scanned_bytes",
            "threads",
        ] {
            assert!(json.get(key).is_some(), "{key}");
        }
        assert_eq!(json["when"], "exit");
        let back: LeakCheck = serde_json::from_value(json).expect("reads back");
        assert_eq!(back, check);
    }
}
