//! What one trace accumulates ([`Session`]): the target, the clock, the
//! pipeline that turns events into the live table, the history for trends,
//! the notes for the report and the family of traced processes; and how the
//! session takes in processes while it runs: children (forked, held at
//! birth in launch mode), processes found by `--name`, `exec`s, and the
//! target's exit. Turning the session into a report is [`super::reporting`].

use std::collections::HashMap;
use std::time::Instant;

use aya::maps::{MapData, RingBuf};

use super::discovery::Discovery;
use super::family::{Adoption, Family, Tools};
use super::loader::Probes;
use super::pipeline::Pipeline;
use super::{python, TraceArgs};
use crate::analysis::history::History;
use crate::analysis::Suppressions;
use crate::report::TargetInfo;
use crate::symbolize::BlazeSymbolizer;
use crate::tracee;

/// Everything one trace accumulates.
pub struct Session<'a> {
    pub args: &'a TraceArgs,
    pub target: TargetInfo,
    pub started: Instant,
    /// When tracing stopped (the report's duration ends there, not when it is built).
    pub ended: Option<(Instant, u64)>,
    pub started_ns: u64,
    pub pipeline: Pipeline,
    pub history: History,
    pub suppressions: Option<Suppressions>,
    pub symbolizer: BlazeSymbolizer,
    pub memory_at_attach: Option<MemoryFigures>,
    pub memory_last: Option<MemoryFigures>,
    /// The target and the children it is followed into.
    pub family: Family,
    pub notes: Vec<String>,
    pub python: python::PythonWatch,
    /// The latest leak check (`--leak-check`, launch mode's at exit).
    pub leak: crate::report::leak::LeakState,
    /// What the execs of each process took with its old images.
    pub exec_drops: ExecNotes,
}

/// What the execs of one process took with its old images.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ExecDrops {
    execs: u32,
    blocks: u64,
    bytes: u64,
    /// Its note's index in the notes.
    note: usize,
}

/// The notes on blocks that execs took: one note a process, however many
/// execs (a shim chain, `bash` to `pyenv` to `python3`, is said once).
#[derive(Debug, Default)]
pub struct ExecNotes(HashMap<u32, ExecDrops>);

impl ExecNotes {
    /// Adds one exec of `pid` that took `blocks` (`bytes`) to its note in
    /// `notes` (written, or rewritten in place). An exec that took nothing
    /// (the launcher's) goes unsaid.
    pub fn add(&mut self, notes: &mut Vec<String>, pid: u32, blocks: u64, bytes: u64) {
        if blocks == 0 {
            return;
        }
        let fresh = ExecDrops {
            note: notes.len(),
            ..ExecDrops::default()
        };
        let drops = self.0.entry(pid).or_insert(fresh);
        drops.execs += 1;
        drops.blocks += blocks;
        drops.bytes += bytes;
        let note = exec_drop_note(pid, *drops);
        match notes.get_mut(drops.note) {
            Some(said) => *said = note,
            None => {
                drops.note = notes.len();
                notes.push(note);
            }
        }
    }
}

impl Session<'_> {
    /// Looks for CPython in the running traced processes that are due.
    pub fn watch_python(&mut self, probes: &mut Probes) {
        for pid in self.family.running().collect::<Vec<_>>() {
            self.python.poll(pid, probes, self.pipeline.stacks_mut());
        }
    }

    /// Notices a traced process running another image (`exec`, same pid):
    /// the probes stay (they follow the process), the address map is re-read
    /// so new stacks are symbolized against the new image, and the report
    /// says so.
    pub fn follow_execs(&mut self, probes: &mut Probes) {
        self.note_exec_drops();
        let target = self.target.pid;
        for pid in self.family.running().collect::<Vec<_>>() {
            let Some((exe, was)) = self.family.follow_exec(pid, &mut self.pipeline) else {
                continue;
            };
            // The kernel's unwinder gets the new image's mappings now, not
            // at the first stack that meets them.
            if let Ok(mappings) = crate::probe::maps::read(pid) {
                probes.update_unwind(pid, &mappings);
                self.pipeline.observe_mappings(pid, &mappings);
            }
            let who = if pid == target {
                "target pid"
            } else {
                "child pid"
            };
            let note = format!("{who} {pid} now runs {exe} (exec; was {was})");
            eprintln!("memtrace: {note}");
            self.notes.push(note);
            if pid == target {
                match tracee::inspect(pid) {
                    Ok(info) => self.target = info,
                    Err(_) => self.target.exe = exe,
                }
            }
        }
    }

    /// Says what each exec met in the stream took with the old image (an
    /// image that left nothing, such as the launcher's, goes unsaid).
    pub fn note_exec_drops(&mut self) {
        for drop in self.pipeline.take_execs() {
            self.note_exec_drop(drop.pid, drop.blocks, drop.bytes);
        }
    }

    /// Adds one exec's dropped blocks to its process's note.
    pub fn note_exec_drop(&mut self, pid: u32, blocks: u64, bytes: u64) {
        self.exec_drops.add(&mut self.notes, pid, blocks, bytes);
    }

    /// Checks the target itself (attach mode); true when tracing should stop
    /// because it is gone and no followed child runs.
    pub fn target_gone(
        &mut self,
        pid: u32,
        probes: &mut Probes,
        ring: &mut RingBuf<MapData>,
    ) -> bool {
        if self.family.target_exited() {
            return false;
        }
        let reused = if !tracee::is_alive(pid) {
            false
        } else if tracee::start_time(pid) != self.family.target_start() {
            true
        } else {
            return false;
        };
        self.notes.push(if reused {
            format!("target pid {pid} exited and the pid was reused by another process")
        } else {
            format!("target pid {pid} exited during the trace")
        });
        self.family.let_go(pid, probes, &mut self.pipeline, ring);
        if self.family.children_running() {
            if self.family.selector().is_some() {
                eprintln!("memtrace: target pid {pid} exited; still tracing the other processes");
            } else {
                eprintln!("memtrace: target pid {pid} exited; still tracing its child processes");
            }
            return false;
        }
        eprintln!(
            "memtrace: target pid {pid} exited{}; final report follows",
            if reused { " (pid reused)" } else { "" }
        );
        true
    }

    /// Handles the forks the kernel reported since the last drain, and gives
    /// the unwinder the new mappings of processes it found out of date.
    pub fn adopt_forks(&mut self, probes: &mut Probes, discovery: &mut Discovery) {
        for pid in std::mem::take(&mut self.pipeline.stale_maps) {
            if let Ok(mappings) = crate::probe::maps::read(pid) {
                probes.update_unwind(pid, &mappings);
                self.pipeline.observe_mappings(pid, &mappings);
            }
        }
        self.family
            .forks_reported(std::mem::take(&mut self.pipeline.forks_reported));
        for (parent, forked_ns) in std::mem::take(&mut self.pipeline.forks) {
            self.look_at_children(parent, Some(forked_ns), probes, discovery);
        }
    }

    /// Adopts (or notes) the children of a traced process.
    pub fn look_at_children(
        &mut self,
        parent: u32,
        forked_ns: Option<u64>,
        probes: &mut Probes,
        discovery: &mut Discovery,
    ) {
        let seen = self.with_tools(probes, discovery, |family, tools| {
            family.look_at_children(parent, forked_ns, tools)
        });
        for (child, parent, adoption) in seen {
            say_adoption(child, parent, &adoption);
        }
    }

    /// Adopts a process found by `--name`; `late`: found after tracing started.
    pub fn adopt_named(
        &mut self,
        pid: u32,
        late: bool,
        probes: &mut Probes,
        discovery: &mut Discovery,
    ) {
        let adoption = self.with_tools(probes, discovery, |family, tools| {
            family.adopt_named(pid, late, tools)
        });
        let reason = self
            .family
            .selector()
            .map(|selector| selector.reason())
            .unwrap_or_default();
        match adoption {
            Adoption::Followed => {
                let comm = tracee::inspect(pid).map(|t| t.comm).unwrap_or_default();
                let since = if late {
                    " and started during the trace"
                } else {
                    ""
                };
                eprintln!("memtrace: tracing pid {pid} ({comm}) too: {reason}{since}");
            }
            Adoption::Known => {}
            other => eprintln!("memtrace: pid {pid} ({reason}): {other}"),
        }
    }

    /// Adopts a child that launch mode holds at birth.
    pub fn adopt_held(
        &mut self,
        child: u32,
        parent: u32,
        probes: &mut Probes,
        discovery: &mut Discovery,
    ) {
        let adoption = self.with_tools(probes, discovery, |family, tools| {
            family.adopt(child, parent, None, true, tools)
        });
        say_adoption(child, parent, &adoption);
    }

    /// Runs `adopt` on the family with what adopting a child needs.
    fn with_tools<T>(
        &mut self,
        probes: &mut Probes,
        discovery: &mut Discovery,
        adopt: impl FnOnce(&mut Family, &mut Tools<'_>) -> T,
    ) -> T {
        let now = self.clock();
        let mut tools = Tools {
            probes,
            pipeline: &mut self.pipeline,
            discovery,
            now: &now,
        };
        adopt(&mut self.family, &mut tools)
    }

    /// (milliseconds since tracing started, monotonic ns), for adoption records.
    fn clock(&self) -> impl Fn() -> (u64, u64) {
        let started = self.started;
        move || {
            let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            (ms, monotonic_ns())
        }
    }

    /// Records the live table for the trend analysis.
    pub fn snapshot(&mut self, probes: &Probes) {
        let t_s = self.started.elapsed().as_secs_f64();
        self.history.record(
            self.pipeline.table(),
            probes.specs(),
            self.pipeline.stacks(),
            t_s,
        );
        if let Some(recorder) = self.pipeline.recorder.as_mut() {
            recorder.snapshot(t_s);
        }
    }
}

/// One stderr line per child memtrace saw.
fn say_adoption(child: u32, parent: u32, adoption: &Adoption) {
    match adoption {
        Adoption::Followed => eprintln!("memtrace: following child pid {child} of pid {parent}"),
        Adoption::Known => {}
        other => eprintln!("memtrace: child pid {child} of pid {parent}: {other}"),
    }
}

/// VmRSS and RssAnon of a process, in bytes.
#[derive(Clone, Copy, Debug)]
pub struct MemoryFigures {
    pub vm_rss: u64,
    pub rss_anon: u64,
}

pub fn read_memory(pid: u32) -> Option<MemoryFigures> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    };
    Some(MemoryFigures {
        vm_rss: field("VmRSS:")?,
        rss_anon: field("RssAnon:")?,
    })
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for clock_gettime to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64
}

/// The report's note on the blocks the execs of `pid` took with its old
/// images.
fn exec_drop_note(pid: u32, drops: ExecDrops) -> String {
    let ExecDrops {
        execs,
        blocks,
        bytes,
        ..
    } = drops;
    if execs <= 1 {
        format!(
            "pid {pid} ran exec: {blocks} live blocks ({bytes} bytes) of its old image went with it and are not reported"
        )
    } else {
        format!(
            "pid {pid} ran exec {execs} times: {blocks} live blocks ({bytes} bytes) of its old images went with them and are not reported"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_of_execs_is_said_once_a_process() {
        let mut notes = vec!["before".to_string()];
        let mut execs = ExecNotes::default();
        execs.add(&mut notes, 7, 0, 0);
        assert_eq!(notes.len(), 1, "an exec that took nothing goes unsaid");
        execs.add(&mut notes, 7, 10, 100);
        assert_eq!(
            notes[1],
            "pid 7 ran exec: 10 live blocks (100 bytes) of its old image went with it and are not reported"
        );
        notes.push("between".to_string());
        execs.add(&mut notes, 8, 1, 16);
        execs.add(&mut notes, 7, 5, 50);
        execs.add(&mut notes, 7, 0, 0);
        assert_eq!(notes.len(), 4, "{notes:?}");
        assert_eq!(
            notes[1],
            "pid 7 ran exec 2 times: 15 live blocks (150 bytes) of its old images went with them and are not reported"
        );
        assert!(
            notes[3].starts_with("pid 8 ran exec: 1 live blocks"),
            "{notes:?}"
        );
    }
}
