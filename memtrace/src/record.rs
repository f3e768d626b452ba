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
use crate::event;
use crate::probe::catalog::{Allocator, Domain, Memory};
use crate::probe::maps::{AddressSpace, FileAddr};
use crate::probe::SpecEntry;
use crate::report::{self, ProcessInfo, Reconciliation, Report, Settings, TargetInfo};
use crate::stacks::{RawFrame, StackStore};
use crate::table::LiveTable;

const FORMAT: &str = "memtrace-record/1";

/// One line of a record file.
// One line exists at a time while reading or writing: the footer's size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Line {
    Header {
        format: String,
        target: TargetInfo,
        started_ns: u64,
    },
    /// A probed function, in spec-index order.
    Spec {
        index: u16,
        function: String,
        allocator: String,
        family: u8,
        memory: Memory,
        domain: Domain,
    },
    Stack {
        id: u32,
        /// (return address, module, file offset) per frame, innermost first.
        frames: Vec<(u64, Option<String>, Option<u64>)>,
    },
    /// ts, addr, size, aux, pid, tid, stack_id, spec, kind, flags.
    Event { e: [i64; 10] },
    /// An interval snapshot was taken at `t_s` seconds.
    Snapshot { t_s: f64 },
    Footer {
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
    },
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
            e: [
                wire.ts_ns as i64,
                wire.addr as i64,
                wire.size as i64,
                wire.aux as i64,
                i64::from(wire.pid),
                i64::from(wire.tid),
                i64::from(wire.stack_id),
                i64::from(wire.spec),
                i64::from(wire.kind),
                i64::from(wire.flags),
            ],
        });
    }

    pub fn snapshot(&mut self, t_s: f64) {
        self.line(&Line::Snapshot { t_s });
    }

    /// Writes the footer from the final report and flushes.
    pub fn finish(
        mut self,
        report: &Report,
        ended_ns: u64,
        thread_names: &HashMap<u32, String>,
    ) -> Result<(), Failure> {
        self.line(&Line::Footer {
            duration_ms: report.duration_ms,
            ended_ns,
            kernel_counters: report.kernel_counters.clone(),
            notes: report
                .notes
                .iter()
                .filter(|n| !n.contains("events were lost") && !n.starts_with("sampling 1 in"))
                .cloned()
                .collect(),
            thread_names: thread_names.iter().map(|(t, n)| (*t, n.clone())).collect(),
            libraries: report.libraries.clone(),
            missing_functions: report.missing_functions.clone(),
            settings: report.settings.clone(),
            reconciliation: report.reconciliation.clone(),
            processes: report.processes.clone(),
            attach_failures: report.attach_failures.clone(),
        });
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
    for (number, line) in BufReader::new(file).lines().enumerate() {
        let number = number + 1;
        let text = match line {
            Ok(text) => text,
            Err(err) => {
                problem = Some(format!("line {number}: {err}"));
                break;
            }
        };
        if text.trim().is_empty() {
            continue;
        }
        let parsed: Line = match serde_json::from_str(&text) {
            Ok(parsed) => parsed,
            Err(err) => {
                problem = Some(format!("line {number}: {err}"));
                break;
            }
        };
        match parsed {
            Line::Header {
                format,
                target,
                started_ns,
            } => {
                if format != FORMAT {
                    return Err(Failure::usage(format!(
                        "{}: unsupported record format '{format}' (expected {FORMAT})",
                        path.display()
                    )));
                }
                header = Some((target, started_ns));
            }
            _ if header.is_none() => {
                return Err(Failure::usage(format!(
                    "{}: not a memtrace record file (line {number} comes before any header)",
                    path.display()
                )));
            }
            Line::Spec {
                index,
                function,
                allocator,
                family,
                memory,
                domain,
            } => {
                if usize::from(index) != specs.len() {
                    problem = Some(format!("line {number}: spec {index} out of order"));
                    break;
                }
                specs.push(SpecEntry {
                    function: Box::leak(function.into_boxed_str()),
                    allocator: Allocator::parse_builtin(&allocator).unwrap_or(Allocator::Custom {
                        name: Box::leak(allocator.into_boxed_str()),
                        family,
                    }),
                    memory,
                    domain,
                });
            }
            Line::Stack { id, frames } => {
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
            Line::Event { e } => {
                let wire = WireEvent {
                    ts_ns: e[0] as u64,
                    addr: e[1] as u64,
                    size: e[2] as u64,
                    aux: e[3] as u64,
                    pid: e[4] as u32,
                    tid: e[5] as u32,
                    stack_id: e[6] as i32,
                    spec: e[7] as u16,
                    kind: e[8] as u8,
                    flags: e[9] as u8,
                };
                let Ok(event) = event::from_wire(&wire) else {
                    problem = Some(format!("line {number}: undecodable event"));
                    break;
                };
                let Some(spec) = specs.get(usize::from(event.spec)) else {
                    problem = Some(format!(
                        "line {number}: event of unknown spec {}",
                        event.spec
                    ));
                    break;
                };
                last_ts = last_ts.max(event.ts_ns);
                table.apply(&event, spec.domain);
            }
            Line::Snapshot { t_s } => history.record(&table, &specs, t_s),
            Line::Footer { .. } => footer = Some(parsed),
        }
    }
    let Some((target, started_ns)) = header else {
        return Err(Failure::usage(format!(
            "{}: empty or not a memtrace record file",
            path.display()
        )));
    };
    let mut notes = Vec::new();
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
        Some(Line::Footer {
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
        _ => {
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
    Ok(report::build(input, &mut symbolizer))
}
