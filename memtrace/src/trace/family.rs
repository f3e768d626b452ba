//! The processes a trace covers: the target and, with `--follow-forks`, each
//! descendant; with `--name`, every process of that name, each traced like a
//! followed child (its own probes, scoped to it), including those that start
//! later. Owns when a process is adopted (its probes attached, scoped to it),
//! when it is let go (it exited, or its pid was reused), the cap on how many
//! are traced at once, and the notes that say what was not traced.

use std::collections::{BTreeMap, BTreeSet};

use aya::maps::{MapData, RingBuf};

use crate::report::ProcessInfo;
use crate::trace::by_name::{Selector, Skipped};
use crate::trace::discovery::Discovery;
use crate::trace::loader::Probes;
use crate::trace::pipeline::Pipeline;
use crate::tracee;

/// What became of a child memtrace saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// Its probes are attached.
    Followed,
    /// It was followed already (seen by another path first).
    Known,
    /// No `--follow-forks`.
    NotFollowed,
    /// `--max-processes` reached.
    OverCap,
    /// It exited before its probes could be attached.
    Gone,
    /// Attaching failed, with why.
    Failed(String),
}

impl std::fmt::Display for Adoption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Adoption::Followed | Adoption::Known => write!(f, "followed"),
            Adoption::NotFollowed => write!(f, "not traced (use --follow-forks to trace it)"),
            Adoption::OverCap => write!(f, "not traced: --max-processes reached"),
            Adoption::Gone => write!(f, "exited before its probes were attached"),
            Adoption::Failed(why) => write!(f, "could not be traced: {why}"),
        }
    }
}

/// What adopting a child needs: the probes to attach, the pipeline that
/// keeps its address map, and the discovery that probes its objects.
pub struct Tools<'a> {
    pub probes: &'a mut Probes,
    pub pipeline: &'a mut Pipeline,
    pub discovery: &'a mut Discovery,
    /// (milliseconds since tracing started, monotonic ns) now.
    pub now: &'a dyn Fn() -> (u64, u64),
}

/// One traced process and how to tell it from a later one with its pid.
struct Member {
    info: ProcessInfo,
    start_time: Option<u64>,
}

/// The traced processes and the children left untraced.
pub struct Family {
    target: u32,
    follow: bool,
    max_processes: usize,
    members: BTreeMap<u32, Member>,
    /// Children seen but not traced (no `--follow-forks`).
    not_followed: BTreeSet<u32>,
    /// Children not traced because `--max-processes` was reached.
    over_cap: BTreeSet<u32>,
    /// Children whose probes could not be attached, with why.
    failed: BTreeMap<u32, String>,
    /// Children that exited before their probes were attached.
    gone_early: BTreeSet<u32>,
    /// Forks the kernel reported, and children seen by a look made after
    /// attach: the difference is children that came and went unseen.
    forks_reported: u64,
    children_seen: u64,
    /// `--name`, `--container`, `--cgroup`: the processes traced for it.
    selector: Option<Selector>,
    /// Processes of the selection not traced: nothing in them to probe.
    skipped: Vec<Skipped>,
}

impl Family {
    pub fn new(target: u32, info: ProcessInfo, follow: bool, max_processes: u32) -> Self {
        let start_time = tracee::start_time(target);
        Family {
            target,
            follow,
            max_processes: usize::try_from(max_processes).unwrap_or(usize::MAX),
            members: BTreeMap::from([(target, Member { info, start_time })]),
            not_followed: BTreeSet::new(),
            over_cap: BTreeSet::new(),
            failed: BTreeMap::new(),
            gone_early: BTreeSet::new(),
            forks_reported: 0,
            children_seen: 0,
            selector: None,
            skipped: Vec::new(),
        }
    }

    /// Traces the processes `selector` selects (`--name`, `--container`,
    /// `--cgroup`): the target is one of them.
    pub fn with_selector(mut self, selector: Option<Selector>) -> Self {
        if let (Some(_), Some(target)) = (&selector, self.members.get_mut(&self.target)) {
            target.info.by_name = true;
        }
        self.selector = selector;
        self
    }

    /// Processes of the selection that were skipped before the target
    /// (nothing to probe): noted, and never adopted later.
    pub fn with_skipped(mut self, skipped: Vec<Skipped>) -> Self {
        self.skipped = skipped;
        self
    }

    /// What selects the processes traced beside the target, if anything.
    pub fn selector(&self) -> Option<&Selector> {
        self.selector.as_ref()
    }

    /// Every process seen so far: traced (running or not), or left out
    /// (cap, failure, gone); `--name` looks past them.
    pub fn known(&self) -> BTreeSet<u32> {
        self.members
            .keys()
            .chain(&self.over_cap)
            .chain(self.failed.keys())
            .chain(&self.gone_early)
            .copied()
            .chain(self.skipped.iter().map(|s| s.pid))
            .collect()
    }

    /// Traced processes still running.
    pub fn running(&self) -> impl Iterator<Item = u32> + '_ {
        self.members
            .iter()
            .filter(|(_, m)| !m.info.exited)
            .map(|(&pid, _)| pid)
    }

    /// Whether a traced process other than the target still runs.
    pub fn children_running(&self) -> bool {
        self.running().any(|pid| pid != self.target)
    }

    /// Marks a traced process as gone and detaches its probes.
    pub fn let_go(
        &mut self,
        pid: u32,
        probes: &mut Probes,
        pipeline: &mut Pipeline,
        ring: &mut RingBuf<MapData>,
    ) {
        if let Some(member) = self.members.get_mut(&pid) {
            member.info.exited = true;
        }
        // Its last allocations may still be held: taken now, while its
        // mappings are still known to normalize their stacks.
        pipeline.drain_all(ring, probes);
        probes.remove_process(pid);
        if pid != self.target {
            pipeline.forget_space(pid);
        }
    }

    /// Checks the traced children: the ones gone are let go.
    pub fn reap(
        &mut self,
        probes: &mut Probes,
        pipeline: &mut Pipeline,
        ring: &mut RingBuf<MapData>,
    ) -> Vec<u32> {
        let gone: Vec<u32> = self
            .members
            .iter()
            .filter(|(&pid, m)| {
                pid != self.target
                    && !m.info.exited
                    && (!tracee::is_alive(pid) || tracee::start_time(pid) != m.start_time)
            })
            .map(|(&pid, _)| pid)
            .collect();
        for &pid in &gone {
            self.let_go(pid, probes, pipeline, ring);
        }
        gone
    }

    /// Looks at the children of `parent` (a traced process) and, recursively,
    /// theirs: with `--follow-forks` each new one is adopted, else noted.
    /// `forked_ns`: when the kernel reported the fork that prompted the look
    /// (monotonic), to measure how long the child ran unprobed. Returns each
    /// child seen for the first time as (child, parent, what became of it).
    pub fn look_at_children(
        &mut self,
        parent: u32,
        forked_ns: Option<u64>,
        tools: &mut Tools<'_>,
    ) -> Vec<(u32, u32, Adoption)> {
        let mut seen = Vec::new();
        let mut queue = vec![parent];
        while let Some(parent) = queue.pop() {
            for child in tracee::children(parent) {
                if self.members.contains_key(&child)
                    || self.over_cap.contains(&child)
                    || self.failed.contains_key(&child)
                    || self.not_followed.contains(&child)
                    || self.gone_early.contains(&child)
                {
                    continue;
                }
                self.children_seen += 1;
                if !self.follow {
                    self.not_followed.insert(child);
                    seen.push((child, parent, Adoption::NotFollowed));
                    continue;
                }
                let adoption = self.adopt(child, parent, forked_ns, false, tools);
                if adoption == Adoption::Followed {
                    queue.push(child);
                }
                seen.push((child, parent, adoption));
            }
        }
        seen
    }

    /// Counts forks the kernel reported.
    pub fn forks_reported(&mut self, count: u64) {
        self.forks_reported += count;
    }

    /// Children that existed when tracing started are not counted as seen
    /// after a fork.
    pub fn reset_seen(&mut self) {
        self.children_seen = 0;
    }

    /// Starts tracing `child` of `parent`: attaches its probes (unless the
    /// cap is reached) and records it. `held`: it has not run yet (launch
    /// mode holds forked children at birth), so nothing of it was missed.
    pub fn adopt(
        &mut self,
        child: u32,
        parent: u32,
        forked_ns: Option<u64>,
        held: bool,
        tools: &mut Tools<'_>,
    ) -> Adoption {
        if let Some(member) = self.members.get_mut(&child) {
            // Launch mode reports every fork with the child held, even when
            // the kernel's fork report got the child adopted first.
            if held {
                member.info.held_at_birth = true;
                member.info.attach_delay_ms = None;
            }
            return Adoption::Known;
        }
        self.attach(child, Some(parent), tools, |now_ns| ProcessInfo {
            attach_delay_ms: forked_ns.map(|at| now_ns.saturating_sub(at) / 1_000_000),
            held_at_birth: held,
            ..ProcessInfo::default()
        })
    }

    /// Starts tracing `pid`, a process with the `--name` (not found as a
    /// child). `late`: it was found after tracing started, so it started
    /// since; its start time says how long it ran unprobed.
    pub fn adopt_named(&mut self, pid: u32, late: bool, tools: &mut Tools<'_>) -> Adoption {
        if self.members.contains_key(&pid) {
            return Adoption::Known;
        }
        // A process of the name forked by a traced one is still its child,
        // and traced for its name even without --follow-forks.
        let parent = tracee::parent(pid).filter(|ppid| self.members.contains_key(ppid));
        self.not_followed.remove(&pid);
        let started = tracee::start_time(pid);
        self.attach(pid, parent, tools, |_| ProcessInfo {
            attach_delay_ms: if late {
                started.and_then(super::by_name::started_ms_ago)
            } else {
                None
            },
            by_name: true,
            started_during_trace: late,
            ..ProcessInfo::default()
        })
    }

    /// Attaches the probes of `pid` (unless the cap is reached) and records
    /// it, described by `describe(now_ns)` plus what is read of it here.
    fn attach(
        &mut self,
        pid: u32,
        parent: Option<u32>,
        tools: &mut Tools<'_>,
        describe: impl FnOnce(u64) -> ProcessInfo,
    ) -> Adoption {
        if self.running().count() >= self.max_processes {
            self.over_cap.insert(pid);
            return Adoption::OverCap;
        }
        match tools.probes.add_process(pid) {
            Ok(_) => {
                let (since_start_ms, now_ns) = (tools.now)();
                match parent {
                    Some(parent) => tools.pipeline.start_space(pid, parent),
                    None => tools.pipeline.refresh_space_now(pid),
                }
                if let Err(err) = tools.discovery.scan(pid, tools.probes, &[]) {
                    log::debug!("pid {pid}: cannot read its mappings: {err}");
                }
                let found = tracee::inspect(pid).unwrap_or_default();
                self.members.insert(
                    pid,
                    Member {
                        info: ProcessInfo {
                            pid,
                            parent,
                            comm: found.comm,
                            exe: found.exe,
                            placement: found.placement,
                            traced_from_ms: since_start_ms,
                            ..describe(now_ns)
                        },
                        start_time: tracee::start_time(pid),
                    },
                );
                Adoption::Followed
            }
            Err(_) if !tracee::is_alive(pid) => {
                self.gone_early.insert(pid);
                Adoption::Gone
            }
            Err(err) => {
                let why = format!("{err:#}");
                self.failed.insert(pid, why.clone());
                Adoption::Failed(why)
            }
        }
    }

    /// A traced process now runs another image: its name and address map
    /// are re-read. Returns (new image, old image) when it changed.
    pub fn follow_exec(&mut self, pid: u32, pipeline: &mut Pipeline) -> Option<(String, String)> {
        let member = self.members.get_mut(&pid)?;
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
        let exe = exe.display().to_string();
        if exe == member.info.exe || member.info.exited {
            return None;
        }
        let was = std::mem::replace(&mut member.info.exe, exe.clone());
        if let Ok(info) = tracee::inspect(pid) {
            member.info.comm = info.comm;
            member.info.exe = info.exe;
        }
        pipeline.refresh_space_now(pid);
        Some((exe, was))
    }

    /// Whether the target itself was let go.
    pub fn target_exited(&self) -> bool {
        self.members
            .get(&self.target)
            .is_some_and(|m| m.info.exited)
    }

    /// The start time the target had at attach.
    pub fn target_start(&self) -> Option<u64> {
        self.members.get(&self.target).and_then(|m| m.start_time)
    }

    pub fn processes(&self) -> Vec<ProcessInfo> {
        self.members.values().map(|m| m.info.clone()).collect()
    }

    /// What the report says about children.
    pub fn notes(&self) -> Vec<String> {
        let list = |pids: &mut dyn Iterator<Item = u32>| -> String {
            pids.map(|p| p.to_string()).collect::<Vec<_>>().join(", ")
        };
        let mut notes = Vec::new();
        if !self.not_followed.is_empty() {
            notes.push(format!(
                "{} child process(es) of the target were not traced (pids {}): use --follow-forks to trace them",
                self.not_followed.len(),
                list(&mut self.not_followed.iter().copied())
            ));
        }
        let children: Vec<&ProcessInfo> = self
            .members
            .values()
            .map(|m| &m.info)
            .filter(|info| info.parent.is_some())
            .collect();
        if !children.is_empty() && children.iter().all(|c| c.held_at_birth) {
            notes.push(format!(
                "followed {} child process(es) (pids {}); each was held at birth until its probes were in place, so none of its allocations were missed; its frees of blocks inherited from its parent count as unmatched",
                children.len(),
                list(&mut children.iter().map(|c| c.pid)),
            ));
        } else if !children.is_empty() {
            let worst = children.iter().filter_map(|c| c.attach_delay_ms).max();
            notes.push(format!(
                "followed {} child process(es) (pids {}); each was probed {} after its fork, so its allocations before then were not seen, and its frees of blocks inherited from its parent count as unmatched",
                children.len(),
                list(&mut children.iter().map(|c| c.pid)),
                match worst {
                    Some(ms) => format!("at most {ms} ms"),
                    None => "shortly".to_string(),
                }
            ));
        }
        if !self.over_cap.is_empty() {
            notes.push(format!(
                "{} process(es) were not traced because --max-processes {} was reached (pids {})",
                self.over_cap.len(),
                self.max_processes,
                list(&mut self.over_cap.iter().copied())
            ));
        }
        notes.extend(self.skipped.iter().map(Skipped::note));
        for (pid, why) in &self.failed {
            notes.push(format!("pid {pid} could not be traced: {why}"));
        }
        if !self.gone_early.is_empty() {
            notes.push(format!(
                "{} process(es) exited before their probes were attached (pids {}): their allocations are not in this report",
                self.gone_early.len(),
                list(&mut self.gone_early.iter().copied())
            ));
        }
        if let Some(selector) = &self.selector {
            let what = selector.what();
            let named: Vec<&ProcessInfo> = self
                .members
                .values()
                .map(|m| &m.info)
                .filter(|info| info.by_name)
                .collect();
            if named.len() > 1 {
                notes.push(format!(
                    "traced {} processes {what} (pids {}), each with probes of its own",
                    named.len(),
                    list(&mut named.iter().map(|p| p.pid))
                ));
            }
            let late: Vec<&&ProcessInfo> =
                named.iter().filter(|p| p.started_during_trace).collect();
            if !late.is_empty() {
                let worst = late.iter().filter_map(|p| p.attach_delay_ms).max();
                notes.push(format!(
                    "{} of them started during the trace (pids {}) and were traced from then, each {} after it started: its allocations before then were not seen",
                    late.len(),
                    list(&mut late.iter().map(|p| p.pid)),
                    match worst {
                        Some(ms) => format!("at most {ms} ms"),
                        None => "shortly".to_string(),
                    }
                ));
            }
        }
        let unseen = self.forks_reported.saturating_sub(self.children_seen);
        if unseen > 0 {
            notes.push(format!(
                "the kernel reported {} fork(s) of traced processes; {unseen} of the children came and went before memtrace could look at them and are not in this report",
                self.forks_reported
            ));
        }
        notes
    }
}
