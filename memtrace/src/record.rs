//! Record and replay: `--record FILE` writes the event stream and what is
//! needed to analyse it later (probe specs, stacks already normalized to
//! (module, file offset), interval marks, final counters) as JSON Lines;
//! `memtrace report FILE` replays it through the same live table, history and
//! report builder, offline, without root, after the target is gone.
//!
//! A truncated or corrupted file is read up to the first bad line; the report
//! then says so.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use memtrace_common::WireEvent;
use serde::{Deserialize, Serialize};

use crate::analysis::history::History;
use crate::analysis::Suppressions;
use crate::error::Failure;
use crate::probe::catalog::Allocator;
use crate::probe::maps::{AddressSpace, FileAddr};
use crate::probe::SpecEntry;
use crate::report::{self, ProcessInfo, Reconciliation, Report, Settings, TargetInfo};
use crate::stacks::{RawFrame, StackStore};
use crate::table::LiveTable;

mod format;

use format::{Item, Reader, Stop, FORMAT};

/// One line of a record file.
type Line = format::Line<TargetInfo, Footer>;

/// The last line: what the report needs besides the events.
#[derive(Debug, Serialize, Deserialize)]
struct Footer {
    duration_ms: u64,
    ended_ns: u64,
    kernel_counters: BTreeMap<String, u64>,
    notes: Vec<String>,
    /// (thread id, name) pairs (JSON object keys cannot be integers).
    thread_names: Vec<(u32, String)>,
    libraries: Vec<serde_json::Value>,
    missing_functions: Vec<String>,
    settings: Settings,
    reconciliation: Option<Reconciliation>,
    /// The traced processes (absent in records of older versions).
    #[serde(default)]
    processes: Vec<ProcessInfo>,
    #[serde(default)]
    attach_failures: Vec<String>,
    /// The DWARF unwinder's tables (absent in records of older versions).
    #[serde(default)]
    unwind: Option<crate::unwind::kernel::UnwindSummary>,
    /// memtrace's own BPF cost (`--bpf-stats`; absent otherwise and in older records).
    #[serde(default)]
    bpf_programs: Vec<crate::report::ProgramCost>,
}

/// Writes a record file as the trace goes.
pub struct Recorder {
    out: BufWriter<File>,
    specs_written: usize,
    failed: Option<std::io::Error>,
}

impl Recorder {
    /// Creates the file (0600) and writes its header.
    pub fn create(path: &Path, target: &TargetInfo, started_ns: u64) -> Result<Self, Failure> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(path)
            .map_err(|err| Failure::usage(format!("cannot write {}: {err}", path.display())))?;
        let mut recorder = Recorder {
            out: BufWriter::new(file),
            specs_written: 0,
            failed: None,
        };
        recorder.line(&Line::Header {
            format: FORMAT.to_string(),
            target: target.clone(),
            started_ns,
        });
        Ok(recorder)
    }

    fn line(&mut self, line: &Line) {
        if self.failed.is_some() {
            return;
        }
        let result = serde_json::to_writer(&mut self.out, line)
            .map_err(std::io::Error::from)
            .and_then(|()| self.out.write_all(b"\n"));
        if let Err(err) = result {
            self.failed = Some(err);
        }
    }

    /// Writes the specs attached since the last call.
    pub fn specs(&mut self, specs: &[SpecEntry]) {
        let new: Vec<(usize, SpecEntry)> = specs
            .iter()
            .copied()
            .enumerate()
            .skip(self.specs_written)
            .collect();
        for (index, spec) in new {
            self.line(&Line::Spec {
                index: u16::try_from(index).unwrap_or(u16::MAX),
                function: spec.function.to_string(),
                allocator: spec.allocator.name().to_string(),
                family: spec.allocator.family(),
                memory: spec.memory,
                domain: spec.domain,
                module: spec.module.map(str::to_string),
            });
        }
        self.specs_written = specs.len();
    }

    pub fn stack(&mut self, id: u32, frames: &[RawFrame]) {
        let frames = frames
            .iter()
            .map(|f| {
                (
                    f.addr,
                    f.file.as_ref().map(|a| a.module.display().to_string()),
                    f.file.as_ref().map(|a| a.file_offset),
                )
            })
            .collect();
        self.line(&Line::Stack { id, frames });
    }

    pub fn event(&mut self, wire: &WireEvent) {
        self.line(&Line::Event {
            e: format::event_fields(wire),
        });
    }

    pub fn snapshot(&mut self, t_s: f64) {
        self.line(&Line::Snapshot { t_s });
    }

    /// The trace ended at `ended_ns` (see `LiveTable::close`).
    pub fn end(&mut self, ended_ns: u64) {
        self.line(&Line::End { ended_ns });
    }

    /// Writes the footer from the final report and flushes.
    pub fn finish(
        mut self,
        report: &Report,
        ended_ns: u64,
        thread_names: &HashMap<u32, String>,
    ) -> Result<(), Failure> {
        self.line(&Line::Footer(Footer {
            duration_ms: report.duration_ms,
            ended_ns,
            kernel_counters: report.kernel_counters.clone(),
            notes: report
                .notes
                .iter()
                .filter(|n| {
                    // Notes the report builder makes again from the counters.
                    !n.contains("events were lost")
                        && !n.starts_with("sampling 1 in")
                        && !n.contains("stack walk(s) ended")
                })
                .cloned()
                .collect(),
            thread_names: thread_names.iter().map(|(t, n)| (*t, n.clone())).collect(),
            libraries: report.libraries.clone(),
            missing_functions: report.missing_functions.clone(),
            settings: report.settings.clone(),
            reconciliation: report.reconciliation.clone(),
            processes: report.processes.clone(),
            attach_failures: report.attach_failures.clone(),
            unwind: report.unwind.clone(),
            bpf_programs: report.bpf_programs.clone(),
        }));
        let flushed = self.out.flush();
        match self.failed.take() {
            Some(err) => Err(Failure::runtime(format!(
                "writing the record file failed: {err}"
            ))),
            None => flushed
                .map_err(|err| Failure::runtime(format!("writing the record file failed: {err}"))),
        }
    }
}

/// Options of `memtrace report` that change the analysis.
pub struct ReplayOptions {
    pub top: Option<usize>,
    pub min_age_ms: Option<u64>,
    pub warmup_ms: Option<u64>,
    pub suppressions: Option<Suppressions>,
}

/// Replays a record file into a report.
pub fn replay(path: &Path, options: ReplayOptions) -> Result<Report, Failure> {
    let file = File::open(path)
        .map_err(|err| Failure::usage(format!("cannot read {}: {err}", path.display())))?;
    let mut header: Option<(TargetInfo, u64)> = None;
    let mut specs: Vec<SpecEntry> = Vec::new();
    let mut table = LiveTable::new(usize::MAX);
    let mut stacks = StackStore::default();
    let mut history = History::default();
    let mut footer = None;
    let mut last_ts = 0u64;
    let mut problem: Option<String> = None;
    let mut reader = Reader::default();
    for (number, line) in BufReader::new(file).lines().enumerate() {
        let number = number + 1;
        let text = match line {
            Ok(text) => text,
            Err(err) => {
                problem = Some(format!("line {number}: {err}"));
                break;
            }
        };
        let item: Item<TargetInfo, Footer> = match reader.line(number, &text) {
            Ok(Some(item)) => item,
            Ok(None) => continue,
            Err(Stop::Unreadable(reason)) => {
                return Err(Failure::usage(format!("{}: {reason}", path.display())));
            }
            Err(Stop::Truncated(reason)) => {
                problem = Some(reason);
                break;
            }
        };
        match item {
            Item::Header { target, started_ns } => header = Some((target, started_ns)),
            Item::Spec {
                function,
                allocator,
                family,
                memory,
                domain,
                module,
            } => {
                specs.push(SpecEntry {
                    module: module.map(|m| &*Box::leak(m.into_boxed_str())),
                    function: Box::leak(function.into_boxed_str()),
                    allocator: Allocator::parse_builtin(&allocator).unwrap_or(Allocator::Custom {
                        name: Box::leak(allocator.into_boxed_str()),
                        family,
                    }),
                    memory,
                    domain,
                });
            }
            Item::Stack { id, frames } => {
                let ips: Vec<u64> = frames.iter().map(|f| f.0).collect();
                let space = AddressSpace::default();
                stacks.insert(id, &ips, &space);
                stacks.set_files(
                    id,
                    frames
                        .into_iter()
                        .map(|(_, module, offset)| match (module, offset) {
                            (Some(module), Some(file_offset)) => Some(FileAddr {
                                module: module.into(),
                                file_offset,
                            }),
                            _ => None,
                        })
                        .collect(),
                );
            }
            Item::Event { event, domain } => {
                last_ts = last_ts.max(event.ts_ns);
                table.apply(&event, domain);
            }
            Item::Snapshot { t_s } => history.record(&table, &specs, &stacks, t_s),
            Item::End { ended_ns } => table.close(ended_ns),
            Item::Footer(read) => footer = Some(read),
        }
    }
    let Some((target, started_ns)) = header else {
        return Err(Failure::usage(format!(
            "{}: empty or not a memtrace record file",
            path.display()
        )));
    };
    let mut notes = Vec::new();
    let unwind = footer.as_ref().and_then(|f| f.unwind.clone());
    let bpf_programs = footer
        .as_ref()
        .map(|f| f.bpf_programs.clone())
        .unwrap_or_default();
    let (
        duration_ms,
        ended_ns,
        counters,
        thread_names,
        libraries,
        missing,
        mut settings,
        reconciliation,
        processes,
        attach_failures,
    ) = match footer {
        Some(Footer {
            duration_ms,
            ended_ns,
            kernel_counters,
            notes: recorded,
            thread_names,
            libraries,
            missing_functions,
            settings,
            reconciliation,
            processes,
            attach_failures,
            unwind: _,
            bpf_programs: _,
        }) => {
            notes.extend(recorded);
            let thread_names: HashMap<u32, String> = thread_names.into_iter().collect();
            (
                duration_ms,
                ended_ns,
                kernel_counters,
                thread_names,
                libraries,
                missing_functions,
                settings,
                reconciliation,
                processes,
                attach_failures,
            )
        }
        None => {
            notes.push(format!(
                "record file {} is truncated ({}): report built from what could be read",
                path.display(),
                problem.clone().unwrap_or_else(|| "no footer".into())
            ));
            let duration = last_ts.saturating_sub(started_ns) / 1_000_000;
            (
                duration,
                last_ts,
                BTreeMap::new(),
                HashMap::new(),
                Vec::new(),
                Vec::new(),
                Settings {
                    top: 20,
                    stack_depth: 127,
                    sample_rate: 1,
                    ..Settings::default()
                },
                None,
                Vec::new(),
                Vec::new(),
            )
        }
    };
    if let Some(problem) = problem {
        eprintln!("memtrace: {}: stopped reading at {problem}", path.display());
    }
    if let Some(top) = options.top {
        settings.top = top;
    }
    if let Some(min_age) = options.min_age_ms {
        settings.min_age_ms = min_age;
    }
    if let Some(warmup) = options.warmup_ms {
        settings.warmup_ms = warmup;
    }
    let input = report::ReportInput {
        target,
        duration_ms,
        now_ns: ended_ns,
        started_ns,
        table: &table,
        specs: &specs,
        stacks: &stacks,
        history: Some(&history),
        suppressions: options.suppressions.as_ref(),
        thread_names: &thread_names,
        kernel_counters: counters,
        libraries,
        missing_functions: missing,
        settings,
        notes,
        reconciliation,
        processes,
        attach_failures,
    };
    let mut symbolizer =
        crate::symbolize::BlazeSymbolizer::new(Box::new(|p| Some(p.to_path_buf())));
    let mut report = report::build(input, &mut symbolizer);
    report.unwind = unwind;
    report.bpf_programs = bpf_programs;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> ReplayOptions {
        ReplayOptions {
            top: None,
            min_age_ms: None,
            warmup_ms: None,
            suppressions: None,
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
            _pad: 0,
        };
        let lines = [
            Line::Header {
                format: FORMAT.to_string(),
                target: TargetInfo {
                    pid: 7,
                    comm: "leaky".into(),
                    exe: "/nonexistent/leaky".into(),
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
            },
            Line::Event {
                e: format::event_fields(&wire(3_000_000, 0x2000, 0)),
            },
            Line::Snapshot { t_s: 0.5 },
            Line::Event {
                e: format::event_fields(&wire(4_000_000, 0x2000, 1)),
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
                    ..Settings::default()
                },
                reconciliation: None,
                processes: Vec::new(),
                attach_failures: Vec::new(),
                unwind: None,
                bpf_programs: Vec::new(),
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
        assert_eq!(report.notes, vec!["recorded note".to_string()]);
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
}
