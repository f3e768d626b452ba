//! Record and replay: `--record FILE` writes the event stream and what is
//! needed to analyse it later (probe specs, stacks already normalized to
//! (module, file offset), Python stacks as resolved while the target ran,
//! the interpreters found, interval marks, final counters, and the symbols
//! of every recorded native frame as the trace resolved them, with each
//! object's build-id) as JSON Lines; `memtrace report FILE` replays it
//! through the same live table, history and report builder, offline,
//! without root, after the target and its files are gone (see [`carried`]).
//!
//! A truncated or corrupted file is read up to the first bad line; the report
//! then says so.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use memtrace_common::WireEvent;
use serde::{Deserialize, Serialize};

use crate::analysis::history::History;
use crate::analysis::Suppressions;
use crate::error::Failure;
use crate::interp::python::resolve::PyFrame;
use crate::probe::catalog::{Allocator, Domain};
use crate::probe::maps::{AddressSpace, FileAddr};
use crate::probe::SpecEntry;
use crate::reach::Category;
use crate::report::device_cache::{self, UsdtTags};
use crate::report::{
    self, LeakCheck, LeakVerdicts, ProcessInfo, Reconciliation, Report, Settings, TargetInfo,
};
use crate::stacks::{RawFrame, StackStore};
use crate::symbolize::{SymInfo, Symbolize};
use crate::table::LiveTable;

mod carried;
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
    /// The function cache's counts (absent: off, or an older record).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    function_cache: Option<crate::disk_cache::CacheStats>,
    /// memtrace's own BPF cost (`--bpf-stats`; absent otherwise and in older records).
    #[serde(default)]
    bpf_programs: Vec<crate::report::ProgramCost>,
    /// The Python interpreters found (absent in records of older versions).
    #[serde(default)]
    python: Vec<crate::interp::python::Interpreter>,
    /// The USDT device allocators whose blocks are tensors (the live
    /// report's `device_cache.allocators`; absent: none, or an older record).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    device_allocators: Vec<String>,
    /// The live report's `usdt` (the objects whose USDT probes were traced).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    usdt: Vec<serde_json::Value>,
    /// The last leak check (absent: none asked, or an older record).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    leak_check: Option<LeakCheck>,
    /// Its verdicts: (pid, domain, address, category as in
    /// [`Category::ALL`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    leak_verdicts: Vec<(u32, Domain, u64, u8)>,
}

/// Writes a record file as the trace goes.
pub struct Recorder {
    out: BufWriter<File>,
    specs_written: usize,
    /// The native frame addresses the stacks written name: symbolized
    /// into `object` and `sym` lines at the end.
    frames: BTreeSet<FileAddr>,
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
            frames: BTreeSet::new(),
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
                estimate: spec.estimate,
            });
        }
        self.specs_written = specs.len();
    }

    pub fn stack(&mut self, id: u32, frames: &[RawFrame]) {
        self.frames
            .extend(frames.iter().filter_map(|f| f.file.clone()));
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

    /// A Python stack, resolved (see `PyStacks::learn`), before the first
    /// event naming it.
    pub fn py_stack(&mut self, id: u32, frames: &[PyFrame], truncated: bool) {
        let frames = frames
            .iter()
            .map(|f| (f.name.clone(), f.file.clone(), f.line))
            .collect();
        self.line(&Line::PyStack {
            id,
            frames,
            truncated,
        });
    }

    pub fn event(&mut self, wire: &WireEvent) {
        self.line(&Line::Event {
            e: format::event_fields(wire),
            py: wire.py_stack,
            tag: wire.tag,
        });
    }

    pub fn snapshot(&mut self, t_s: f64) {
        self.line(&Line::Snapshot { t_s });
    }

    /// The trace ended at `ended_ns` (see `LiveTable::close`).
    pub fn end(&mut self, ended_ns: u64) {
        self.line(&Line::End { ended_ns });
    }

    /// Writes what `symbolizer` (the one the report was made with) says of
    /// every frame address the stacks named: an `object` line per object
    /// (its build-id), then a `sym` line per address.
    fn symbols(&mut self, symbolizer: &mut dyn Symbolize) {
        let frames: Vec<FileAddr> = std::mem::take(&mut self.frames).into_iter().collect();
        let answers = symbolizer.answer(&frames);
        let mut objects: HashMap<&Path, u32> = HashMap::new();
        for (addr, answer) in frames.iter().zip(answers) {
            let next = u32::try_from(objects.len()).unwrap_or(u32::MAX);
            let object = *objects.entry(&addr.module).or_insert_with(|| {
                let line = Line::Object {
                    id: next,
                    path: addr.module.display().to_string(),
                    build_id: symbolizer.build_id(&addr.module),
                };
                self.line(&line);
                next
            });
            let unreadable = answer.is_none();
            let info = answer.unwrap_or_default();
            self.line(&Line::Sym {
                object,
                offset: addr.file_offset,
                symbol: info.symbol,
                file: info.file,
                line: info.line,
                unreadable,
                inlined: info.inlined,
            });
        }
    }

    /// Writes the frames' symbols (see [`Recorder::symbols`]) and the
    /// footer from the final report, and flushes.
    pub fn finish(
        mut self,
        report: &Report,
        ended_ns: u64,
        thread_names: &HashMap<u32, String>,
        leak_verdicts: Option<&LeakVerdicts>,
        symbolizer: &mut dyn Symbolize,
    ) -> Result<(), Failure> {
        self.symbols(symbolizer);
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
                        && !n.contains("were made in the trace's last second")
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
            function_cache: report.function_cache.clone(),
            bpf_programs: report.bpf_programs.clone(),
            python: report.python.clone(),
            device_allocators: report
                .device_cache
                .as_ref()
                .map(|cache| cache.allocators.clone())
                .unwrap_or_default(),
            usdt: report.usdt.clone(),
            leak_check: report.leak_check.clone(),
            leak_verdicts: leak_verdicts
                .map(|verdicts| {
                    verdicts
                        .iter()
                        .map(|((pid, domain, addr), category)| {
                            let code = Category::ALL
                                .iter()
                                .position(|c| *c == category)
                                .unwrap_or(0);
                            (pid, domain, addr, code as u8)
                        })
                        .collect()
                })
                .unwrap_or_default(),
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
    /// `--fail-on`: the leak check's categories that fail the replay.
    pub leak_gates: Vec<crate::report::leak::LeakGate>,
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
    let mut usdt_tags = UsdtTags::default();
    let mut symbols = carried::Carried::default();
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
                estimate,
            } => {
                specs.push(SpecEntry {
                    estimate,
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
            Item::PyStack {
                id,
                frames,
                truncated,
            } => {
                let frames = frames
                    .into_iter()
                    .map(|(name, file, line)| PyFrame { name, file, line })
                    .collect();
                stacks.python.insert(id, frames);
                if truncated {
                    stacks.python.mark_truncated(id);
                }
            }
            Item::Event {
                event,
                domain,
                wire,
            } => {
                last_ts = last_ts.max(event.ts_ns);
                usdt_tags.observe(&wire, &specs);
                table.apply(&event, domain);
            }
            Item::Object { path } => symbols.object(path),
            Item::Sym {
                module,
                offset,
                symbol,
                file,
                line,
                unreadable,
                inlined,
            } => symbols.sym(
                FileAddr {
                    module,
                    file_offset: offset,
                },
                (!unreadable).then_some(SymInfo {
                    symbol,
                    file,
                    line,
                    inlined,
                }),
            ),
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
    for interpreter in footer.as_ref().map_or(&[][..], |f| f.python.as_slice()) {
        stacks.python.set_interpreter(interpreter.clone(), None);
    }
    let unwind = footer.as_ref().and_then(|f| f.unwind.clone());
    let function_cache = footer.as_ref().and_then(|f| f.function_cache.clone());
    let bpf_programs = footer
        .as_ref()
        .map(|f| f.bpf_programs.clone())
        .unwrap_or_default();
    let (device_allocators, usdt) = footer
        .as_ref()
        .map(|f| (f.device_allocators.clone(), f.usdt.clone()))
        .unwrap_or_default();
    let leak_check = footer.as_ref().and_then(|f| f.leak_check.clone());
    let leak_verdicts = LeakVerdicts::new(
        footer
            .as_ref()
            .map(|f| {
                f.leak_verdicts
                    .iter()
                    .filter_map(|&(pid, domain, addr, code)| {
                        Some(((pid, domain, addr), *Category::ALL.get(usize::from(code))?))
                    })
                    .collect()
            })
            .unwrap_or_default(),
    );
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
            function_cache: _,
            bpf_programs: _,
            python: _,
            device_allocators: _,
            usdt: _,
            leak_check: _,
            leak_verdicts: _,
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
        leak_check: leak_check.as_ref().map(|check| (check, &leak_verdicts)),
        leak_gates: &options.leak_gates,
    };
    let mut report = report::build(input, &mut symbols);
    report.notes.extend(symbols.notes());
    report.unwind = unwind;
    report.function_cache = function_cache;
    report.bpf_programs = bpf_programs;
    report.device_cache = device_cache::build(&device_allocators, &table, &specs, &usdt_tags);
    report.usdt = usdt;
    Ok(report)
}

#[cfg(test)]
mod tests;
