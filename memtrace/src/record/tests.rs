//! Tests of [`super`]: replay equals the live report (per format, with
//! Python stacks, USDT device tags and native frames named from the record
//! after their object is gone), older formats, cut and corrupt files. Over
//! 800 lines: each replay test builds the live trace it compares with.

use super::*;

fn options() -> ReplayOptions {
    ReplayOptions {
        top: None,
        min_age_ms: None,
        warmup_ms: None,
        suppressions: None,
        leak_gates: Vec::new(),
    }
}

/// A small record: one spec, one stack, a leak and a freed block, a
/// snapshot and the footer.
fn record_text() -> String {
    let wire = |ts_ns, addr, kind| WireEvent {
        ts_ns,
        addr,
        size: 64,
        aux: 0,
        pid: 7,
        tid: 7,
        stack_id: 1,
        spec: 0,
        kind,
        flags: 0,
        py_stack: 0,
        tag: 0,
    };
    let lines = [
        Line::Header {
            format: FORMAT.to_string(),
            target: TargetInfo {
                pid: 7,
                comm: "leaky".into(),
                exe: "/nonexistent/leaky".into(),
                ..TargetInfo::default()
            },
            started_ns: 1_000_000,
        },
        Line::Spec {
            index: 0,
            function: "malloc".into(),
            allocator: "libc".into(),
            family: 0,
            memory: crate::probe::catalog::Memory::Host,
            domain: crate::probe::catalog::Domain::Heap,
            module: Some("/lib/libc.so.6".into()),
            estimate: false,
        },
        Line::Stack {
            id: 1,
            frames: vec![
                (0x1234, Some("/nonexistent/leaky".into()), Some(0x234)),
                (0x99, None, None),
            ],
        },
        Line::Event {
            e: format::event_fields(&wire(2_000_000, 0x1000, 0)),
            py: 0,
            tag: 0,
        },
        Line::Event {
            e: format::event_fields(&wire(3_000_000, 0x2000, 0)),
            py: 0,
            tag: 0,
        },
        Line::Snapshot { t_s: 0.5 },
        Line::Event {
            e: format::event_fields(&wire(4_000_000, 0x2000, 1)),
            py: 0,
            tag: 0,
        },
        Line::Object {
            id: 0,
            path: "/nonexistent/leaky".into(),
            build_id: Some("93ac61".into()),
        },
        Line::Sym {
            object: 0,
            offset: 0x234,
            symbol: Some("leak".into()),
            file: Some("leaky.c".into()),
            line: Some(7),
            unreadable: false,
            inlined: Vec::new(),
        },
        Line::Footer(Footer {
            duration_ms: 900,
            ended_ns: 901_000_000,
            kernel_counters: BTreeMap::new(),
            notes: vec!["recorded note".into()],
            thread_names: vec![(7, "leaky".into())],
            libraries: Vec::new(),
            missing_functions: Vec::new(),
            settings: Settings {
                top: 5,
                stack_depth: 127,
                ..Settings::default()
            },
            reconciliation: None,
            processes: Vec::new(),
            attach_failures: Vec::new(),
            unwind: None,
            function_cache: None,
            bpf_programs: Vec::new(),
            python: Vec::new(),
            device_allocators: Vec::new(),
            usdt: Vec::new(),
            leak_check: Some(crate::report::LeakCheck {
                ran: true,
                when: Some(crate::report::leak::CheckPoint::End),
                split: crate::report::LeakSplit {
                    definitely_lost: crate::report::leak::Amount {
                        bytes: 64,
                        blocks: 1,
                    },
                    ..Default::default()
                },
                ..Default::default()
            }),
            // The live block, definitely lost (Category::ALL[0]).
            leak_verdicts: vec![(7, crate::probe::catalog::Domain::Heap, 0x1000, 0)],
        }),
    ];
    let mut text = String::new();
    for line in &lines {
        text.push_str(&serde_json::to_string(line).expect("serializes"));
        text.push('\n');
    }
    text
}

struct TempFile(std::path::PathBuf);

impl TempFile {
    fn new(name: &str) -> TempFile {
        TempFile(std::env::temp_dir().join(format!(
            "memtrace-record-unit-{}-{name}.jsonl",
            std::process::id()
        )))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn footer_fields_sit_next_to_the_type() {
    let text = record_text();
    let footer = text.lines().last().expect("footer line");
    assert!(
        footer.starts_with(r#"{"type":"footer","duration_ms":900,"#),
        "{footer}"
    );
}

#[test]
fn a_whole_record_replays_with_its_footer() {
    let file = TempFile::new("whole");
    std::fs::write(&file.0, record_text()).expect("write");
    let report = replay(&file.0, options()).expect("replays");
    assert_eq!(report.duration_ms, 900);
    assert_eq!(report.settings.top, 5);
    assert_eq!((report.events.allocs, report.events.frees), (2, 1));
    assert_eq!(report.notes[0], "recorded note");
    // Its frame named from the record, not looked up on this host.
    let frame = &report.sites[0].frames[0];
    assert_eq!(
        (frame.symbol.as_deref(), frame.file.as_deref(), frame.line),
        (Some("leak"), Some("leaky.c"), Some(7))
    );
    // The leak check is replayed, its verdict split per site.
    let check = report.leak_check.as_ref().expect("the check is kept");
    assert!(check.ran);
    assert_eq!(check.split.definitely_lost.bytes, 64);
    let split = report.sites[0].leak_check.expect("the site's split");
    assert_eq!(split.definitely_lost.blocks, 1);
    assert_eq!(split.still_reachable.blocks, 0);
    assert!(check.failed_gates.is_empty());
    // `memtrace report --fail-on` gates on the replayed verdicts.
    let gated = replay(
        &file.0,
        ReplayOptions {
            leak_gates: vec![
                crate::report::leak::LeakGate::DefinitelyLost,
                crate::report::leak::LeakGate::StillReachable,
            ],
            ..options()
        },
    )
    .expect("replays");
    let gated = gated.leak_check.expect("the check");
    assert_eq!(gated.failed_gates, vec!["definitely-lost"]);
    // Its one live block was made in the trace's last second.
    assert_eq!(report.notes.len(), 2, "{:?}", report.notes);
    assert!(report.notes[1].starts_with("1 live block(s) (64 bytes) were made"));
}

#[test]
fn a_record_cut_anywhere_gives_a_report_or_an_error() {
    let text = record_text();
    let file = TempFile::new("cut");
    let header_len = text.find('\n').unwrap_or(text.len());
    for cut in 0..text.len() {
        std::fs::write(&file.0, &text.as_bytes()[..cut]).expect("write");
        match replay(&file.0, options()) {
            Ok(report) => {
                assert!(cut >= header_len, "cut {cut}: a report without a header");
                // Only the final newline may go without a note.
                let truncated = report.notes.iter().any(|n| n.contains("truncated"));
                assert_eq!(
                    truncated,
                    cut + 1 < text.len(),
                    "cut {cut}: {:?}",
                    report.notes
                );
            }
            Err(err) => assert!(cut < header_len, "cut {cut}: {err}"),
        }
    }
}

#[test]
fn corrupt_lines_stop_the_read_without_a_panic() {
    let text = record_text();
    let file = TempFile::new("corrupt");
    let mut lines: Vec<&str> = text.lines().collect();
    // An event of a spec never declared, then one of an unknown kind.
    let unknown_spec = r#"{"type":"event","e":[5,1,1,0,7,7,1,9,0,0]}"#;
    let unknown_kind = r#"{"type":"event","e":[5,1,1,0,7,7,1,0,77,0]}"#;
    for (bad, why) in [
        (unknown_spec, "unknown spec 9"),
        (unknown_kind, "undecodable"),
        ("\u{0}\u{1}", "line 4"),
        (r#"{"type":"spec","index":3}"#, "line 4"),
    ] {
        lines.insert(3, bad);
        std::fs::write(&file.0, lines.join("\n")).expect("write");
        lines.remove(3);
        let report = replay(&file.0, options()).expect("a partial report");
        assert!(
            report
                .notes
                .iter()
                .any(|n| n.contains("truncated") && n.contains(why)),
            "{why}: {:?}",
            report.notes
        );
    }
    // Invalid UTF-8 is a stop too.
    let mut bytes = text.as_bytes().to_vec();
    let second = text.find('\n').map_or(0, |i| i + 1);
    bytes.splice(second..second, *b"\xff\xfe\n");
    std::fs::write(&file.0, bytes).expect("write");
    let report = replay(&file.0, options()).expect("a partial report");
    assert!(report.notes.iter().any(|n| n.contains("line 2")));
}

/// A record of process `pid` (`comm`, run from `/nonexistent/COMM`)
/// started at `started_ns`, created at `path`.
fn recording(path: &Path, pid: u32, comm: &str, started_ns: u64) -> (TargetInfo, Recorder) {
    let target = TargetInfo {
        pid,
        comm: comm.into(),
        exe: format!("/nonexistent/{comm}"),
        ..TargetInfo::default()
    };
    let recorder = Recorder::create(path, &target, started_ns).expect("creates");
    (target, recorder)
}

/// The spec of libc's `malloc`.
fn libc_malloc() -> SpecEntry {
    SpecEntry {
        module: Some("/nonexistent/libc.so.6"),
        function: "malloc",
        allocator: Allocator::parse_builtin("libc").expect("libc"),
        memory: crate::probe::catalog::Memory::Host,
        domain: crate::probe::catalog::Domain::Heap,
        estimate: false,
    }
}

/// A trace as the live pipeline runs it (each event recorded before it
/// is applied, a stack's lines after the event that brought it), with
/// Python stacks (two ids resolving to the same frames, one cut by the
/// kernel), recorded to `path`; returns the live report.
fn trace_with_python(path: &Path) -> Report {
    use crate::interp::python::Interpreter;
    let started_ns = 1_000_000_000;
    let (target, mut recorder) = recording(path, 7, "app.py", started_ns);
    let specs = [libc_malloc()];
    let mut table = LiveTable::new(usize::MAX);
    let mut stacks = StackStore::default();
    let mut history = History::default();
    let interpreter = Interpreter {
        pid: 7,
        version: "3.12.1".into(),
        object: "/nonexistent/libpython3.12.so".into(),
        frames_read: true,
        reason: None,
        stacks: 3,
        unresolved_frames: 0,
        stacks_rejected: 0,
    };
    stacks.python.set_interpreter(interpreter, None);
    let frame = |name: &str, file: &str, line| PyFrame {
        name: name.into(),
        file: Some(file.into()),
        line: Some(line),
    };
    let py_frames = |id: u32| -> (Vec<PyFrame>, bool) {
        match id {
            0x11 | 0x12 => (
                vec![
                    frame("Cache.put", "cache.py", 41),
                    frame("<module>", "app.py", 9),
                ],
                false,
            ),
            _ => (
                vec![
                    frame("handle", "server.py", 88),
                    frame("? (code 0x1)", "?", 0),
                ],
                true,
            ),
        }
    };
    recorder.specs(&specs);
    // (ms after start, address, size, kind (0 alloc, 1 free), stack, py)
    let events: [(u64, u64, u64, u8, i32, u32); 9] = [
        (100, 0x1000, 4096, 0, 1, 0x11),
        (200, 0x2000, 4096, 0, 1, 0x11),
        (300, 0x3000, 256, 0, 2, 0x13),
        (450, 0x4000, 4096, 0, 1, 0x12),
        (600, 0x5000, 64, 0, 2, 0),
        (700, 0x3000, 0, 1, -1, 0),
        (900, 0x6000, 256, 0, 2, 0x13),
        (1100, 0x7000, 4096, 0, 1, 0x12),
        (1400, 0x8000, 256, 0, 2, 0x13),
    ];
    let mut snapshots = [500u64, 1000, 1500].into_iter().peekable();
    let snapshot = |t_ms: u64,
                    recorder: &mut Recorder,
                    history: &mut History,
                    table: &LiveTable,
                    stacks: &StackStore| {
        let t_s = t_ms as f64 / 1000.0;
        history.record(table, &specs, stacks, t_s);
        recorder.snapshot(t_s);
    };
    for (ms, addr, size, kind, stack_id, py) in events {
        while let Some(t) = snapshots.next_if(|&t| t <= ms) {
            snapshot(t, &mut recorder, &mut history, &table, &stacks);
        }
        let wire = WireEvent {
            ts_ns: started_ns + ms * 1_000_000,
            addr,
            size,
            aux: 0,
            pid: 7,
            tid: 7,
            stack_id,
            spec: 0,
            kind,
            flags: 0,
            py_stack: py,
            tag: 0,
        };
        recorder.event(&wire);
        let event = crate::event::from_wire(&wire).expect("decodes");
        if let Ok(id) = u32::try_from(stack_id) {
            if !stacks.contains(id) {
                stacks.insert(
                    id,
                    &[0x40_1000 + u64::from(id), 0x40_2000],
                    &AddressSpace::default(),
                );
                if let Some(frames) = stacks.get(id) {
                    recorder.stack(id, frames);
                }
            }
        }
        if py != 0 && !stacks.python.contains(py) {
            let (frames, truncated) = py_frames(py);
            stacks.python.insert(py, frames);
            if truncated {
                stacks.python.mark_truncated(py);
            }
            let frames = stacks.python.frames(py).expect("inserted");
            recorder.py_stack(py, frames, truncated);
        }
        table.apply(&event, specs[0].domain);
    }
    for t in snapshots {
        snapshot(t, &mut recorder, &mut history, &table, &stacks);
    }
    let ended_ns = started_ns + 1_600_000_000;
    table.close(ended_ns);
    recorder.end(ended_ns);
    let thread_names: HashMap<u32, String> = [(7, "python3".to_string())].into();
    let input = report::ReportInput {
        target,
        duration_ms: 1600,
        now_ns: ended_ns,
        started_ns,
        table: &table,
        specs: &specs,
        stacks: &stacks,
        history: Some(&history),
        suppressions: None,
        thread_names: &thread_names,
        kernel_counters: BTreeMap::from([("ringbuf_full".to_string(), 0)]),
        libraries: Vec::new(),
        missing_functions: Vec::new(),
        settings: Settings {
            top: 20,
            stack_depth: 32,
            sample_rate: 1,
            ..Settings::default()
        },
        notes: vec!["recorded note".into()],
        reconciliation: None,
        processes: Vec::new(),
        attach_failures: Vec::new(),
        leak_check: None,
        leak_gates: &[],
    };
    let mut symbolizer =
        crate::symbolize::BlazeSymbolizer::new(Box::new(|p| Some(p.to_path_buf())));
    let live = report::build(input, &mut symbolizer);
    recorder
        .finish(&live, ended_ns, &thread_names, None, &mut symbolizer)
        .expect("finishes");
    live
}

fn rendered(report: &Report, format: crate::sink::Format) -> Vec<u8> {
    let mut out = Vec::new();
    crate::sink::for_format(format, crate::sink::Names::Short)
        .write(report, false, &mut out)
        .expect("renders");
    out
}

#[test]
fn replay_reproduces_the_live_report_with_python_frames_byte_for_byte() {
    let file = TempFile::new("python");
    let live = trace_with_python(&file.0);
    // The live report has Python frames to lose: merged sites, one cut.
    let json = String::from_utf8(rendered(&live, crate::sink::Format::Json)).expect("utf-8");
    assert!(
        json.contains("Cache.put") && json.contains("server.py"),
        "{json}"
    );
    assert!(json.contains("Python stack cut at"), "{json}");
    let text = std::fs::read_to_string(&file.0).expect("record");
    assert!(text.starts_with(r#"{"type":"header","format":"memtrace-record/3","#));
    assert_eq!(text.matches(r#""type":"py_stack""#).count(), 3, "{text}");
    let replayed = replay(&file.0, options()).expect("replays");
    for format in [
        crate::sink::Format::Text,
        crate::sink::Format::Json,
        crate::sink::Format::Folded,
    ] {
        let (a, b) = (rendered(&live, format), rendered(&replayed, format));
        assert!(
            a == b,
            "{format:?} differs:\n--- live\n{}\n--- replay\n{}",
            String::from_utf8_lossy(&a),
            String::from_utf8_lossy(&b)
        );
    }
}

/// A trace of a caching device allocator probed through USDT (its
/// allocations tagged with a device index and stream) beside the CUDA
/// runtime's segments, recorded to `path`; returns the live report.
fn trace_with_device_tags(path: &Path) -> Report {
    use crate::probe::catalog::{Domain, Memory};
    let started_ns = 1_000_000_000;
    let (target, mut recorder) = recording(path, 9, "python3", started_ns);
    let specs = [
        SpecEntry {
            module: Some("/nonexistent/libc10_cuda.so"),
            function: "pytorch:malloc",
            allocator: Allocator::Custom {
                name: "pytorch",
                family: 9,
            },
            memory: Memory::Device,
            domain: Domain::Custom(9),
            estimate: false,
        },
        SpecEntry {
            module: Some("/nonexistent/libcudart.so.12"),
            function: "cudaMalloc",
            allocator: Allocator::parse_builtin("cuda").expect("cuda"),
            memory: Memory::Device,
            domain: Domain::CudaMemory,
            estimate: false,
        },
    ];
    recorder.specs(&specs);
    let mut table = LiveTable::new(usize::MAX);
    let mut stacks = StackStore::default();
    let mut tags = UsdtTags::default();
    // (address, size, kind, spec, device index as the wire carries it, stream)
    let events: [(u64, u64, u8, u16, u32, u64); 7] = [
        (0x7000_0000, 8 << 20, 0, 1, 0, 0),
        (0x7000_0000, 1 << 20, 0, 0, 0, 7),
        (0x7010_0000, 2 << 20, 0, 0, 1, 7),
        (0x7030_0000, 512, 0, 0, 1, u64::MAX),
        // Device -1 (a signed byte, sign extended), stream 0.
        (0x7040_0000, 4096, 0, 0, u32::MAX, 0),
        (0x7010_0000, 0, 1, 0, 0, 0),
        (0x7050_0000, 3 << 20, 0, 0, 2, 12),
    ];
    for (n, (addr, size, kind, spec, tag, aux)) in events.into_iter().enumerate() {
        let wire = WireEvent {
            ts_ns: started_ns + (n as u64 + 1) * 1_000_000,
            addr,
            size,
            aux,
            pid: 9,
            tid: 9,
            stack_id: if kind == 0 { 1 } else { -1 },
            spec,
            kind,
            flags: if spec == 0 && kind == 0 {
                memtrace_common::FLAG_TAGGED
            } else {
                0
            },
            py_stack: 0,
            tag,
        };
        recorder.event(&wire);
        tags.observe(&wire, &specs);
        if !stacks.contains(1) {
            stacks.insert(1, &[0x40_1000, 0x40_2000], &AddressSpace::default());
            if let Some(frames) = stacks.get(1) {
                recorder.stack(1, frames);
            }
        }
        let event = crate::event::from_wire(&wire).expect("decodes");
        table.apply(&event, specs[usize::from(spec)].domain);
    }
    let traced = Traced {
        target,
        started_ns,
        table,
        specs: &specs,
        stacks,
    };
    traced.end(recorder, |live, table| {
        live.device_cache =
            device_cache::build(&["pytorch".to_string()], table, &specs, &tags);
        live.usdt = vec![serde_json::json!({
            "path": "/nonexistent/libc10_cuda.so",
            "sites": [{"probe": "pytorch:malloc", "file_offset": 4096, "semaphore_offset": 0x867ca}],
        })];
    })
}

/// What a short trace (100 ms) made, to end and record.
struct Traced<'a> {
    target: TargetInfo,
    started_ns: u64,
    table: LiveTable,
    specs: &'a [SpecEntry],
    stacks: StackStore,
}

impl Traced<'_> {
    /// Ends the trace as the live pipeline does: the window closed, the
    /// report built (then `amend`ed) and the record finished with the
    /// report's own symbolizer (files read where they are). Returns
    /// the live report.
    fn end(
        mut self,
        mut recorder: Recorder,
        amend: impl FnOnce(&mut Report, &LiveTable),
    ) -> Report {
        let ended_ns = self.started_ns + 100_000_000;
        self.table.close(ended_ns);
        recorder.end(ended_ns);
        let thread_names: HashMap<u32, String> = HashMap::new();
        let input = report::ReportInput {
            target: self.target,
            duration_ms: 100,
            now_ns: ended_ns,
            started_ns: self.started_ns,
            table: &self.table,
            specs: self.specs,
            stacks: &self.stacks,
            history: None,
            suppressions: None,
            thread_names: &thread_names,
            kernel_counters: BTreeMap::new(),
            libraries: Vec::new(),
            missing_functions: Vec::new(),
            settings: Settings {
                top: 20,
                stack_depth: 32,
                sample_rate: 1,
                ..Settings::default()
            },
            notes: Vec::new(),
            reconciliation: None,
            processes: Vec::new(),
            attach_failures: Vec::new(),
            leak_check: None,
            leak_gates: &[],
        };
        let mut symbolizer =
            crate::symbolize::BlazeSymbolizer::new(Box::new(|p| Some(p.to_path_buf())));
        let mut live = report::build(input, &mut symbolizer);
        amend(&mut live, &self.table);
        recorder
            .finish(&live, ended_ns, &thread_names, None, &mut symbolizer)
            .expect("finishes");
        live
    }
}

/// A leak of two sites whose frames point into `module` (a copy of the
/// test object `libleak-1.so`: `leak_alloc` and `leak_inner`) and into
/// `/nonexistent/gone.so` (unreadable), recorded to `path`; returns the
/// live report.
fn trace_into(path: &Path, module: &Path) -> Report {
    use crate::probe::catalog::Domain;
    let (alloc, inner) = crate::symbolize::tests::return_addrs(1);
    let started_ns = 1_000_000_000;
    let (target, mut recorder) = recording(path, 5, "leak", started_ns);
    let specs = [libc_malloc()];
    recorder.specs(&specs);
    let mut table = LiveTable::new(usize::MAX);
    let mut stacks = StackStore::default();
    let at = |module: &Path, file_offset| {
        Some(FileAddr {
            module: module.to_path_buf(),
            file_offset,
        })
    };
    let gone = Path::new("/nonexistent/gone.so");
    let frames = [
        vec![at(module, alloc), at(gone, 0x40), None],
        vec![at(module, inner), at(module, alloc), at(gone, 0x40)],
    ];
    for (n, files) in frames.into_iter().enumerate() {
        let id = n as u32 + 1;
        let ips: Vec<u64> = (0..files.len() as u64).map(|i| 0x1000 * (i + 1)).collect();
        stacks.insert(id, &ips, &AddressSpace::default());
        stacks.set_files(id, files);
        recorder.stack(id, stacks.get(id).expect("inserted"));
        for k in 0..3u64 {
            let wire = WireEvent {
                ts_ns: started_ns + (k + 1) * 1_000_000,
                addr: 0x10_0000 * u64::from(id) + k * 0x100,
                size: 100 * u64::from(id),
                aux: 0,
                pid: 5,
                tid: 5,
                stack_id: id as i32,
                spec: 0,
                kind: 0,
                flags: 0,
                py_stack: 0,
                tag: 0,
            };
            recorder.event(&wire);
            let event = crate::event::from_wire(&wire).expect("decodes");
            table.apply(&event, Domain::Heap);
        }
    }
    let traced = Traced {
        target,
        started_ns,
        table,
        specs: &specs,
        stacks,
    };
    traced.end(recorder, |_, _| {})
}

/// The symbol of each native frame of each site, in order.
fn frame_symbols(report: &Report) -> Vec<Vec<Option<String>>> {
    report
        .sites
        .iter()
        .map(|site| site.frames.iter().map(|f| f.symbol.clone()).collect())
        .collect()
}

#[test]
fn replay_names_frames_from_the_record_after_their_object_is_gone() {
    let dir = std::env::temp_dir().join(format!("memtrace-record-syms-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let module = dir.join("libleak.so");
    std::fs::copy(
        Path::new(crate::symbolize::tests::TESTDATA).join("libleak-1.so"),
        &module,
    )
    .expect("copy the test object");
    let file = TempFile::new("symbols");
    let live = trace_into(&file.0, &module);
    let build_id = crate::symbolize::BlazeSymbolizer::new(Box::new(|p| Some(p.to_path_buf())))
        .build_id(&module)
        .expect("the test object has a build-id");
    // The object is gone (or replaced) by the time the record is read.
    std::fs::remove_dir_all(&dir).expect("remove the object");
    let named = |s: &str| Some(s.to_string());
    assert_eq!(
        frame_symbols(&live),
        [
            // `leak_inner` is named by the debug file only.
            vec![None, named("leak_alloc"), None],
            vec![named("leak_alloc"), None, None],
        ],
        "the live report names the object's frames"
    );
    let text = std::fs::read_to_string(&file.0).expect("record");
    // One line per object and per distinct address, whatever the
    // number of events and stacks naming them.
    let kinds = |kind: &str| text.matches(&format!(r#"{{"type":"{kind}""#)).count();
    assert_eq!(
        (kinds("object"), kinds("sym"), kinds("event")),
        (2, 3, 6),
        "{text}"
    );
    assert!(
        text.contains(&format!(r#""build_id":"{build_id}""#)),
        "the object's build-id: {text}"
    );
    assert!(text.contains(r#""offset":64,"unreadable":true}"#), "{text}");
    let replayed = replay(&file.0, options()).expect("replays");
    assert_eq!(
        replayed.sites, live.sites,
        "sites, frames and bytes as live"
    );
    let extra: Vec<&String> = replayed.notes.iter().skip(live.notes.len()).collect();
    assert_eq!(extra.len(), 1, "{extra:?}");
    assert!(
        extra[0].starts_with("1 frame address(es) in 1 object(s) (/nonexistent/gone.so) could not be symbolized while recording"),
        "{extra:?}"
    );
    // The same record as an older memtrace wrote it (no symbols): its
    // frames are looked up in this host's files, which no longer have
    // the object, and the report says so.
    let older: String = text
        .lines()
        .filter(|line| !line.contains(r#""type":"object""#) && !line.contains(r#""type":"sym""#))
        .map(|line| line.replace("memtrace-record/3", "memtrace-record/2") + "\n")
        .collect();
    std::fs::write(&file.0, older).expect("write");
    let old = replay(&file.0, options()).expect("replays");
    assert_eq!(frame_symbols(&old), [vec![None; 3], vec![None; 3]]);
    assert!(
        old.notes
            .iter()
            .any(|n| n.starts_with("3 frame address(es) in 2 object(s)")
                && n.contains("symbolized from this host's files")),
        "{:?}",
        old.notes
    );
}

/// A record written by memtrace 0.x before records carried symbols
/// (format 2, kept as it was written) still replays: its frames from
/// this host's files, said in a note.
#[test]
fn an_older_record_without_symbols_replays_with_a_note() {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/src/record/testdata/v2.jsonl");
    let report = replay(Path::new(fixture), options()).expect("replays");
    assert_eq!((report.events.allocs, report.events.frees), (2, 1));
    assert_eq!(report.sites.len(), 1);
    assert_eq!(report.sites[0].live_bytes, 64);
    assert_eq!(report.sites[0].frames[0].symbol, None);
    assert!(
        report.notes.iter().any(|n| n
            .contains("1 object(s) (/nonexistent/leaky) were symbolized from this host's files")),
        "{:?}",
        report.notes
    );
}

#[test]
fn replay_keeps_usdt_device_indexes_and_streams() {
    let file = TempFile::new("device");
    let live = trace_with_device_tags(&file.0);
    let cache = live.device_cache.clone().expect("a device cache");
    let by_device: Vec<(i64, i64, u64, u64)> = cache
        .tensors_by_device
        .iter()
        .map(|d| (d.device, d.stream, d.live_bytes, d.live_count))
        .collect();
    // The freed tensor is gone; device -1 and stream -1 keep their signs.
    assert_eq!(
        by_device,
        [
            (-1, 0, 4096, 1),
            (0, 7, 1 << 20, 1),
            (1, -1, 512, 1),
            (2, 12, 3 << 20, 1)
        ]
    );
    assert_eq!(cache.segment_live_bytes, 8 << 20);
    let text = std::fs::read_to_string(&file.0).expect("record");
    assert!(text.contains(r#","tag":4294967295}"#), "{text}");
    assert!(
        text.contains(r#""device_allocators":["pytorch"]"#),
        "{text}"
    );
    let replayed = replay(&file.0, options()).expect("replays");
    assert_eq!(replayed.device_cache, live.device_cache);
    assert_eq!(replayed.usdt, live.usdt);
    for format in [crate::sink::Format::Json, crate::sink::Format::Text] {
        let (a, b) = (rendered(&live, format), rendered(&replayed, format));
        assert!(
            a == b,
            "{format:?} differs:\n--- live\n{}\n--- replay\n{}",
            String::from_utf8_lossy(&a),
            String::from_utf8_lossy(&b)
        );
    }
    // A record of an older memtrace (no tags, no device allocators)
    // replays without a device view rather than with made-up devices.
    let older: String = text
        .lines()
        .map(|line| {
            let mut value: serde_json::Value = serde_json::from_str(line).expect("json");
            if let Some(object) = value.as_object_mut() {
                object.remove("tag");
                object.remove("device_allocators");
            }
            value.to_string() + "\n"
        })
        .collect();
    std::fs::write(&file.0, older).expect("write");
    let old = replay(&file.0, options()).expect("replays");
    assert_eq!(old.device_cache, None);
    assert_eq!(old.usdt, live.usdt);
}

#[test]
fn a_version_1_record_still_replays_and_an_unknown_version_is_one_line() {
    let file = TempFile::new("v1");
    let v1 = record_text().replace("memtrace-record/3", "memtrace-record/1");
    std::fs::write(&file.0, v1).expect("write");
    let report = replay(&file.0, options()).expect("replays");
    assert_eq!((report.events.allocs, report.events.frees), (2, 1));
    assert!(report.python.is_empty());
    let v9 = record_text().replace("memtrace-record/3", "memtrace-record/9");
    std::fs::write(&file.0, v9).expect("write");
    let Err(err) = replay(&file.0, options()) else {
        panic!("version 9 replayed");
    };
    let err = err.to_string();
    assert!(
        err.contains("memtrace-record/9") && !err.contains('\n'),
        "{err}"
    );
}
