//! Tests of [`super::build`].

use super::*;
use crate::event::{Action, Event};
use crate::probe::catalog::Domain;
use crate::probe::maps::AddressSpace;
use crate::symbolize::{SymInfo, Symbolize};
use crate::tracee::maps::parse;

struct FakeSymbols;
impl Symbolize for FakeSymbols {
    fn symbolize(&mut self, addrs: &[FileAddr]) -> Vec<SymInfo> {
        addrs
            .iter()
            .map(|a| SymInfo {
                symbol: Some(format!("fn_{:x}", a.file_offset)),
                file: Some("app.c".into()),
                line: Some(a.file_offset as u32),
                inlined: Vec::new(),
            })
            .collect()
    }
}

/// A report input over these tables with every other field empty.
fn input<'a>(
    table: &'a LiveTable,
    specs: &'a [SpecEntry],
    stacks: &'a StackStore,
    names: &'a HashMap<u32, String>,
) -> ReportInput<'a> {
    ReportInput {
        target: TargetInfo::default(),
        duration_ms: 1,
        now_ns: 1,
        started_ns: 0,
        history: None,
        suppressions: None,
        thread_names: names,
        reconciliation: None,
        processes: Vec::new(),
        attach_failures: Vec::new(),
        leak_check: None,
        leak_gates: &[],
        table,
        specs,
        stacks,
        kernel_counters: BTreeMap::new(),
        libraries: Vec::new(),
        missing_functions: Vec::new(),
        settings: Settings::default(),
        notes: Vec::new(),
    }
}

fn specs() -> Vec<SpecEntry> {
    vec![
        SpecEntry {
            function: "malloc",
            allocator: Allocator::Libc,
            memory: Memory::Host,
            domain: Domain::Heap,
            module: Some("/lib/libc.so.6"),
            estimate: false,
        },
        SpecEntry {
            function: "cudaMalloc",
            allocator: Allocator::Cuda,
            memory: Memory::Device,
            domain: Domain::CudaMemory,
            module: None,
            estimate: false,
        },
    ]
}

fn alloc(spec: u16, addr: u64, size: u64, stack: u32, ts_ns: u64) -> Event {
    Event {
        ts_ns,
        pid: 1,
        tid: 7,
        spec,
        py_stack: 0,
        action: Action::Alloc {
            addr,
            size,
            stack: StackRef::Id(stack),
        },
    }
}

fn sample() -> Report {
    let specs = specs();
    let mut table = LiveTable::new(1000);
    for i in 0..3 {
        table.apply(&alloc(0, 0x100 + i, 100, 1, 1_000_000), Domain::Heap);
    }
    table.apply(&alloc(0, 0x200, 50, 2, 2_000_000_000), Domain::Heap);
    table.apply(&alloc(1, 0x100, 4096, 3, 0), Domain::CudaMemory);
    let space = AddressSpace::new(parse("1000-9000 r-xp 00000000 fe:01 5 /bin/app\n"));
    let mut stacks = StackStore::default();
    stacks.insert(1, &[0x1100, 0x1200, 0x1300], &space);
    stacks.insert(2, &[0x1500], &space);
    stacks.insert(3, &[0x1600], &space);
    let names = HashMap::new();
    let input = ReportInput {
        target: TargetInfo {
            pid: 1,
            comm: "app".into(),
            exe: "/bin/app".into(),
            ..TargetInfo::default()
        },
        duration_ms: 5000,
        now_ns: 2_500_000_000,
        kernel_counters: [("ringbuf_full".to_string(), 0)].into_iter().collect(),
        settings: Settings {
            stack_depth: 2,
            min_age_ms: 1000,
            top: 10,
            sample_rate: 1,
            ..Settings::default()
        },
        ..input(&table, &specs, &stacks, &names)
    };
    build(input, &mut FakeSymbols)
}

#[test]
fn blocks_made_in_the_last_second_are_named_young() {
    assert_eq!(young_note((0, 0)), None);
    let note = young_note((4096, 2)).expect("a note");
    assert!(note.starts_with("2 live block(s) (4096 bytes)"), "{note}");
    assert!(note.contains("--min-age"), "{note}");
}

#[test]
fn sites_sorted_by_bytes_with_min_age_applied() {
    let report = sample();
    // The 50-byte block is 0.5 s old: hidden by --min-age 1s, but in the totals.
    assert_eq!(report.sites.len(), 2);
    assert_eq!(report.sites[0].live_bytes, 4096);
    assert_eq!(report.sites[0].memory, Memory::Device);
    assert_eq!(report.sites[1].live_bytes, 300);
    assert_eq!(report.sites[1].live_count, 3);
    assert_eq!(report.sites[1].oldest_age_ms, 2499);
    let libc_total = report
        .totals
        .iter()
        .find(|t| t.allocator == Allocator::Libc)
        .expect("libc total");
    assert_eq!((libc_total.live_bytes, libc_total.live_count), (350, 4));
}

#[test]
fn sites_allocated_inside_the_allocator_library_are_internal_and_last() {
    let specs = specs();
    let mut table = LiveTable::new(1000);
    // A big block from libc itself (a thread stack), a small one from the program.
    table.apply(&alloc(0, 0x100, 1 << 20, 1, 0), Domain::Heap);
    table.apply(&alloc(0, 0x200, 10, 2, 0), Domain::Heap);
    let space = AddressSpace::new(parse(
        "1000-2000 r-xp 00000000 fe:01 5 /bin/app\n5000-6000 r-xp 00000000 fe:01 6 /lib/libc.so.6\n",
    ));
    let mut stacks = StackStore::default();
    stacks.insert(1, &[0x5100, 0x1200], &space);
    stacks.insert(2, &[0x1300], &space);
    let names = HashMap::new();
    let report = build(
        ReportInput {
            target: TargetInfo {
                pid: 1,
                comm: "app".into(),
                exe: "/bin/app".into(),
                ..TargetInfo::default()
            },
            duration_ms: 1000,
            now_ns: 1_000_000_000,
            settings: Settings {
                stack_depth: 4,
                top: 10,
                sample_rate: 1,
                ..Settings::default()
            },
            ..input(&table, &specs, &stacks, &names)
        },
        &mut FakeSymbols,
    );
    let flags: Vec<(u64, bool)> = report
        .sites
        .iter()
        .map(|s| (s.live_bytes, s.internal))
        .collect();
    assert_eq!(flags, vec![(10, false), (1 << 20, true)]);
}

#[test]
fn frames_symbolized_and_truncated_to_depth() {
    let report = sample();
    let frames = &report.sites[1].frames;
    assert_eq!(frames.len(), 2);
    assert_eq!(frames[0].addr, "0x1100");
    assert_eq!(frames[0].symbol.as_deref(), Some("fn_100"));
    assert_eq!(frames[0].module.as_deref(), Some("/bin/app"));
    assert_eq!(frames[0].offset.as_deref(), Some("0x100"));
}

#[test]
fn json_has_the_contract_keys() {
    let value = serde_json::to_value(sample()).expect("serializes");
    for key in ["target", "duration_ms", "events", "totals", "sites"] {
        assert!(value.get(key).is_some(), "missing {key}");
    }
    for key in [
        "allocs",
        "frees",
        "lost",
        "unmatched_frees",
        "stack_failures",
        "mappings_trimmed",
        "unmaps_untracked",
        "addresses_reused",
    ] {
        assert!(value["events"].get(key).is_some(), "missing events.{key}");
    }
    let site = &value["sites"][0];
    for key in [
        "allocator",
        "live_bytes",
        "live_count",
        "oldest_age_ms",
        "frames",
    ] {
        assert!(site.get(key).is_some(), "missing sites[].{key}");
    }
    assert_eq!(site["allocator"], "cuda");
    assert_eq!(site["memory"], "device");
    for key in ["addr", "symbol", "module", "file", "line"] {
        assert!(
            site["frames"][0].get(key).is_some(),
            "missing frames[].{key}"
        );
    }
    assert_eq!(value["target"]["comm"], "app");
}

#[test]
fn lost_events_mark_the_report_incomplete() {
    let specs = specs();
    let table = LiveTable::new(10);
    let stacks = StackStore::default();
    let names = HashMap::new();
    let input = ReportInput {
        target: TargetInfo::default(),
        kernel_counters: [
            ("ringbuf_full".to_string(), 5),
            ("stack_fault".to_string(), 2),
        ]
        .into_iter()
        .collect(),
        ..input(&table, &specs, &stacks, &names)
    };
    let report = build(input, &mut FakeSymbols);
    assert!(!report.complete);
    assert_eq!(report.events.lost, 5);
    assert_eq!(report.events.stack_failures, 2);
    assert!(report
        .notes
        .iter()
        .any(|n| n.contains("5 events were lost")));
}

#[test]
fn unmatched_frees_under_a_size_filter_get_a_note_not_a_warning() {
    let specs = specs();
    let mut table = LiveTable::new(10);
    table.apply(&alloc(0, 0x100, 1000, 1, 0), Domain::Heap);
    // Two frees of blocks the kernel filtered out (too small to trace).
    for addr in [0x300, 0x400] {
        let free = Event {
            ts_ns: 5,
            pid: 1,
            tid: 7,
            spec: 0,
            py_stack: 0,
            action: Action::Free { addr },
        };
        table.apply(&free, Domain::Heap);
    }
    let stacks = StackStore::default();
    let names = HashMap::new();
    let build_with = |settings: Settings| {
        let input = ReportInput {
            target: TargetInfo::default(),
            kernel_counters: [("filtered".to_string(), 7)].into_iter().collect(),
            settings,
            ..input(&table, &specs, &stacks, &names)
        };
        build(input, &mut FakeSymbols)
    };
    let filtered = build_with(Settings {
        min_size: 500,
        ..Settings::default()
    });
    assert_eq!(filtered.events.unmatched_frees, 2);
    // Expected frees do not make the report incomplete.
    assert!(filtered.complete);
    let note = filtered
        .notes
        .iter()
        .find(|n| n.contains("unmatched frees are expected"))
        .expect("a note");
    assert!(note.starts_with("2 unmatched frees"), "{note}");
    assert!(note.contains(">= 500 bytes"), "{note}");
    assert!(note.contains("skipped 7"), "{note}");
    let ranged = build_with(Settings {
        min_size: 16,
        max_size: Some(4096),
        ..Settings::default()
    });
    assert!(
        ranged.notes.iter().any(|n| n.contains("16..=4096 bytes")),
        "{:?}",
        ranged.notes
    );
    // No filter: unmatched frees are blocks from before the attach, no note.
    let plain = build_with(Settings::default());
    assert!(plain.notes.iter().all(|n| !n.contains("unmatched")));
}

#[test]
fn a_leak_check_splits_each_site_ranks_lost_sites_first_and_gates() {
    use crate::reach::Category;
    use crate::report::leak::{CheckPoint, LeakGate};
    let specs = specs();
    let mut table = LiveTable::new(1000);
    // A big cache (stack 1, reachable), a small leak (stack 2, lost), a
    // device block (stack 3) indirectly lost, and one block made after the
    // check (no verdict).
    table.apply(&alloc(0, 0x1000, 1 << 20, 1, 0), Domain::Heap);
    table.apply(&alloc(0, 0x200, 10, 2, 0), Domain::Heap);
    table.apply(&alloc(0, 0x300, 10, 2, 0), Domain::Heap);
    table.apply(&alloc(1, 0x200, 4096, 3, 0), Domain::CudaMemory);
    table.apply(&alloc(0, 0x400, 7, 1, 0), Domain::Heap);
    let space = AddressSpace::new(parse("1000-9000 r-xp 00000000 fe:01 5 /bin/app\n"));
    let mut stacks = StackStore::default();
    stacks.insert(1, &[0x1100], &space);
    stacks.insert(2, &[0x1500], &space);
    stacks.insert(3, &[0x1600], &space);
    let names = HashMap::new();
    let verdicts = LeakVerdicts::new(vec![
        ((1, Domain::Heap, 0x1000), Category::StillReachable),
        ((1, Domain::Heap, 0x200), Category::DefinitelyLost),
        ((1, Domain::Heap, 0x300), Category::PossiblyLost),
        ((1, Domain::CudaMemory, 0x200), Category::IndirectlyLost),
    ]);
    let check = LeakCheck {
        ran: true,
        when: Some(CheckPoint::End),
        ..LeakCheck::default()
    };
    let gates = [LeakGate::DefinitelyLost, LeakGate::StillReachable];
    let report = build(
        ReportInput {
            settings: Settings {
                stack_depth: 2,
                top: 10,
                sample_rate: 1,
                ..Settings::default()
            },
            leak_check: Some((&check, &verdicts)),
            leak_gates: &gates,
            ..input(&table, &specs, &stacks, &names)
        },
        &mut FakeSymbols,
    );
    // The site with definitely lost bytes first, though the cache is bigger.
    let first = report.sites[0].leak_check.expect("split");
    assert_eq!(first.definitely_lost.bytes, 10);
    assert_eq!(first.possibly_lost.bytes, 10);
    assert_eq!(
        report.sites[1]
            .leak_check
            .expect("split")
            .indirectly_lost
            .bytes,
        4096
    );
    let cache = report
        .sites
        .iter()
        .find(|s| s.live_bytes == (1 << 20) + 7)
        .and_then(|s| s.leak_check)
        .expect("the cache's split");
    // The block made after the check is in no category.
    assert_eq!(cache.still_reachable.blocks, 1);
    assert_eq!(cache.lost_bytes(), 0);
    let summary = report.leak_check.expect("summary");
    assert_eq!(
        summary.failed_gates,
        vec!["definitely-lost", "still-reachable"]
    );
}

#[test]
fn no_leak_check_means_no_split() {
    let report = sample();
    assert!(report.leak_check.is_none());
    assert!(report.sites.iter().all(|s| s.leak_check.is_none()));
}

#[test]
fn a_group_from_before_the_attach_names_the_first_site_making_its_size() {
    // glibc's usable sizes: 100 B asked -> 104 usable; 300,000 -> mmapped.
    assert_eq!(super::glibc_usable(100), [104, 4080]);
    assert_eq!(super::glibc_usable(1)[0], 24);
    assert_eq!(super::glibc_usable(300_000)[1], 303_088);
    let sites = vec![vec![64, 64], vec![100], vec![300_000]];
    assert_eq!(super::same_size_site(104, &sites), Some(2));
    assert_eq!(super::same_size_site(72, &sites), Some(1));
    assert_eq!(super::same_size_site(303_088, &sites), Some(3));
    assert_eq!(super::same_size_site(4000, &sites), None);
}
