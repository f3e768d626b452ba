//! Attaching functions through `uprobe_multi` links (`kernel::uprobe_multi`,
//! Linux 6.6+) instead of one perf event per probe: per traced process and
//! object file, one link for every return probe and one per [`DetachStage`]
//! for the entry probes, each carrying its functions' offsets and spec
//! indexes (attach cookies). Closing a link is one `close`, with no
//! grace-period wait per probe, so a trace of a hundred functions ends at
//! once instead of after seconds of serialized uprobe unregistrations.
//!
//! The attach order is the perf-event path's, per link: return probes, then
//! releases, reallocations, allocations; they are detached in the reverse
//! order (entry links stage by stage, then the return links). When a link
//! cannot be created the object's functions are attached one by one (links
//! of one offset), so one bad function is named and the rest are traced.
//!
//! Chosen with the hidden `--attach perf|multi|auto` (default auto: links
//! where the kernel has usable ones and the full object is loaded).

use std::path::{Path, PathBuf};

use anyhow::Context;
use aya::programs::UProbe;

use super::{AttachedFunction, DetachStage, Probes, ENTER, EXIT};
use crate::kernel::uprobe_multi::{self, MultiLink};
use crate::kernel::variant::{Choice, Variant};
use crate::probe::plan::PlannedProbe;

/// How probes are attached (hidden `--attach`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AttachMode {
    /// `uprobe_multi` links where the kernel has usable ones and the full
    /// eBPF object is loaded; one perf event per probe elsewhere.
    #[default]
    Auto,
    /// One uprobe perf event per probe (every kernel).
    Perf,
    /// `uprobe_multi` links (Linux 6.6+ with the fixed PID filter), or fail.
    Multi,
}

/// Whether this trace attaches through `uprobe_multi` links; an error when
/// `--attach multi` was asked for and the kernel or object cannot.
pub fn resolve(mode: AttachMode, variant: &Choice) -> anyhow::Result<bool> {
    if mode == AttachMode::Perf {
        return Ok(false);
    }
    let support = match variant.variant {
        Variant::Compat => {
            Err("the compat eBPF object (no attach cookies) needs perf events".to_string())
        }
        Variant::TailCall => Err(
            "the tailcall eBPF object's tail-called programs need perf events (this kernel has no bpf_loop)"
                .to_string(),
        ),
        Variant::Full => match uprobe_multi::probe() {
            Ok(uprobe_multi::Support::Found) => Ok(()),
            Ok(uprobe_multi::Support::Missing) => {
                Err("this kernel has no uprobe_multi links (Linux 6.6+)".to_string())
            }
            Ok(uprobe_multi::Support::ThreadFilter) => Err(
                "this kernel's uprobe_multi links filter one thread, not the process".to_string(),
            ),
            Err(err) => Err(format!("probing uprobe_multi links failed: {err}")),
        },
    };
    match (mode, support) {
        (_, Ok(())) => Ok(true),
        (AttachMode::Multi, Err(why)) => Err(crate::error::Failure::usage(format!(
            "--attach multi: {why}; use --attach perf or auto"
        ))
        .into()),
        (_, Err(why)) => {
            log::info!("attaching with one perf event per probe: {why}");
            Ok(false)
        }
    }
}

/// What one link holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// Return probes (`call_exit`).
    Return,
    /// Entry probes of one stage (`call_enter`).
    Entry(DetachStage),
}

/// One link to create: its kind and the functions it carries (indexes into
/// the slice given to [`plan_links`]), with their offsets and cookies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkPlan {
    pub path: PathBuf,
    pub kind: LinkKind,
    pub members: Vec<usize>,
    pub offsets: Vec<u64>,
    pub cookies: Vec<u64>,
}

/// Groups `functions` into links, in attach order: per object file (in
/// first-seen order), the return probes, then the entry probes of each
/// stage from releases to allocations (the reverse of [`DetachStage::ORDER`]).
/// Pure, for tests.
pub fn plan_links(functions: &[AttachedFunction]) -> Vec<LinkPlan> {
    let mut paths: Vec<&Path> = Vec::new();
    for function in functions {
        if !paths.contains(&function.path.as_path()) {
            paths.push(&function.path);
        }
    }
    let mut plans = Vec::new();
    for path in paths {
        let kinds = std::iter::once(LinkKind::Return).chain(
            DetachStage::ORDER
                .iter()
                .rev()
                .map(|&stage| LinkKind::Entry(stage)),
        );
        for kind in kinds {
            let mut plan = LinkPlan {
                path: path.to_path_buf(),
                kind,
                members: Vec::new(),
                offsets: Vec::new(),
                cookies: Vec::new(),
            };
            for (i, function) in functions.iter().enumerate() {
                if function.path != path {
                    continue;
                }
                let offset = match kind {
                    LinkKind::Return => function.return_offset,
                    LinkKind::Entry(stage) => {
                        (function.stage == stage).then_some(function.entry_offset)
                    }
                };
                if let Some(offset) = offset {
                    plan.members.push(i);
                    plan.offsets.push(offset);
                    plan.cookies.push(u64::from(function.index));
                }
            }
            if !plan.members.is_empty() {
                plans.push(plan);
            }
        }
    }
    plans
}

impl Probes {
    /// Registers the specs of one object's `probes` and attaches them in
    /// every traced process through `uprobe_multi` links; one outcome per
    /// probe (attached in at least one process, or the first error).
    pub(super) fn attach_functions_multi(
        &mut self,
        path: &Path,
        module: &Path,
        probes: &[PlannedProbe],
    ) -> Vec<anyhow::Result<()>> {
        let mut outcomes: Vec<anyhow::Result<()>> = Vec::with_capacity(probes.len());
        let mut functions = Vec::new();
        // Which probe each function is.
        let mut of_probe = Vec::new();
        for (i, probe) in probes.iter().enumerate() {
            match self.register_spec(module, probe) {
                Ok(index) => {
                    functions.push(AttachedFunction {
                        path: path.to_path_buf(),
                        entry_offset: probe.file_offset + probe.probe_offset,
                        return_offset: probe.return_offset(),
                        index,
                        stage: DetachStage::of(probe.def.kind),
                    });
                    of_probe.push(i);
                    outcomes.push(Ok(()));
                }
                Err(err) => outcomes.push(Err(err)),
            }
        }
        let pids: Vec<u32> = self.processes.keys().copied().collect();
        let mut attached = vec![false; functions.len()];
        let mut first_error: Vec<Option<anyhow::Error>> = functions.iter().map(|_| None).collect();
        for pid in pids {
            for (i, outcome) in self
                .attach_multi_for(&functions, pid)
                .into_iter()
                .enumerate()
            {
                match outcome {
                    Ok(()) => attached[i] = true,
                    Err(err) => {
                        first_error[i].get_or_insert(err);
                    }
                }
            }
        }
        for (i, function) in functions.into_iter().enumerate() {
            let probe = &probes[of_probe[i]];
            if attached[i] {
                log::info!(
                    "attached {} in {} at {:#x} {} (uprobe_multi)",
                    probe.function,
                    path.display(),
                    probe.file_offset,
                    probe.placement
                );
                self.functions.push(function);
            } else {
                outcomes[of_probe[i]] = Err(first_error[i]
                    .take()
                    .unwrap_or_else(|| anyhow::anyhow!("no traced process to attach to")));
            }
        }
        outcomes
    }

    /// Attaches `functions` for process `pid` through `uprobe_multi` links;
    /// one outcome per function. A link that fails makes its object's
    /// functions attach one by one, so only the failing ones fail.
    pub(super) fn attach_multi_for(
        &mut self,
        functions: &[AttachedFunction],
        pid: u32,
    ) -> Vec<anyhow::Result<()>> {
        let mut outcomes: Vec<Option<anyhow::Result<()>>> =
            functions.iter().map(|_| None).collect();
        let plans = plan_links(functions);
        let mut paths: Vec<&Path> = plans.iter().map(|p| p.path.as_path()).collect();
        paths.dedup();
        for path in paths {
            let object: Vec<&LinkPlan> = plans.iter().filter(|p| p.path == path).collect();
            match self.create_links(&object, pid) {
                Ok(links) => {
                    self.keep_multi_links(pid, links);
                    for plan in &object {
                        for &i in &plan.members {
                            outcomes[i] = Some(Ok(()));
                        }
                    }
                }
                Err(err) => {
                    let members: Vec<usize> = functions
                        .iter()
                        .enumerate()
                        .filter(|(_, f)| f.path == path)
                        .map(|(i, _)| i)
                        .collect();
                    if members.len() == 1 {
                        outcomes[members[0]] = Some(Err(err));
                        continue;
                    }
                    log::debug!(
                        "pid {pid}: {}: {err:#}; attaching its functions one by one",
                        path.display()
                    );
                    for i in members {
                        let single = std::slice::from_ref(&functions[i]);
                        let plans = plan_links(single);
                        let plans: Vec<&LinkPlan> = plans.iter().collect();
                        outcomes[i] = Some(
                            self.create_links(&plans, pid)
                                .map(|links| self.keep_multi_links(pid, links)),
                        );
                    }
                }
            }
        }
        outcomes
            .into_iter()
            .map(|outcome| outcome.unwrap_or(Ok(())))
            .collect()
    }

    /// Creates `plans`' links for `pid`, all or none (those made before a
    /// failure are closed).
    fn create_links(
        &mut self,
        plans: &[&LinkPlan],
        pid: u32,
    ) -> anyhow::Result<Vec<(LinkKind, MultiLink)>> {
        let mut links = Vec::with_capacity(plans.len());
        for plan in plans {
            let (name, ret, what) = match plan.kind {
                LinkKind::Return => (EXIT, true, "uretprobe"),
                LinkKind::Entry(_) => (ENTER, false, "uprobe"),
            };
            let program: &UProbe = self
                .ebpf
                .program(name)
                .with_context(|| format!("program {name} missing"))?
                .try_into()?;
            let fd = program.fd()?;
            let link = uprobe_multi::attach(
                std::os::fd::AsFd::as_fd(fd),
                &plan.path,
                &plan.offsets,
                Some(&plan.cookies),
                None,
                ret,
                pid,
            )
            .map_err(anyhow::Error::new)
            .with_context(|| format!("{what} (uprobe_multi link, pid {pid})"))?;
            links.push((plan.kind, link));
        }
        Ok(links)
    }

    fn keep_multi_links(&mut self, pid: u32, links: Vec<(LinkKind, MultiLink)>) {
        let process = self.processes.entry(pid).or_default();
        for (kind, link) in links {
            match kind {
                LinkKind::Return => process.exit_multi.push(link),
                LinkKind::Entry(stage) => process.enter_multi.push((stage, link)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perf_events_wherever_links_are_not_asked_or_cannot_carry_cookies() {
        let compat = Choice {
            variant: Variant::Compat,
            missing: Vec::new(),
            forced: true,
            thread_storage: false,
        };
        let full = Choice {
            variant: Variant::Full,
            ..compat.clone()
        };
        // Neither touches the kernel: perf is asked for, or compat has no cookies.
        assert!(!resolve(AttachMode::Perf, &full).expect("perf"));
        assert!(!resolve(AttachMode::Auto, &compat).expect("auto falls back"));
        let refused = resolve(AttachMode::Multi, &compat).expect_err("multi refused");
        assert!(
            refused.to_string().contains("--attach multi"),
            "{refused:#}"
        );
        assert_eq!(AttachMode::default(), AttachMode::Auto);
    }

    fn function(
        path: &str,
        entry: u64,
        ret: Option<u64>,
        index: u16,
        stage: DetachStage,
    ) -> AttachedFunction {
        AttachedFunction {
            path: PathBuf::from(path),
            entry_offset: entry,
            return_offset: ret,
            index,
            stage,
        }
    }

    #[test]
    fn links_group_by_object_returns_first_then_releases_to_allocations() {
        use DetachStage::*;
        let functions = [
            function("/libc", 0x10, Some(0x10), 0, Allocations),
            function("/libc", 0x29, None, 1, Releases),
            function("/libcuda", 0x100, Some(0x100), 2, Allocations),
            function("/libc", 0x30, Some(0x30), 3, Reallocations),
            function("/libc", 0x40, Some(0x44), 4, Allocations),
        ];
        let plans = plan_links(&functions);
        type Row<'a> = (&'a str, LinkKind, Vec<usize>, Vec<u64>, Vec<u64>);
        let summary: Vec<Row> = plans
            .iter()
            .map(|p| {
                (
                    p.path.to_str().expect("utf-8"),
                    p.kind,
                    p.members.clone(),
                    p.offsets.clone(),
                    p.cookies.clone(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                (
                    "/libc",
                    LinkKind::Return,
                    vec![0, 3, 4],
                    vec![0x10, 0x30, 0x44],
                    vec![0, 3, 4]
                ),
                (
                    "/libc",
                    LinkKind::Entry(Releases),
                    vec![1],
                    vec![0x29],
                    vec![1]
                ),
                (
                    "/libc",
                    LinkKind::Entry(Reallocations),
                    vec![3],
                    vec![0x30],
                    vec![3]
                ),
                (
                    "/libc",
                    LinkKind::Entry(Allocations),
                    vec![0, 4],
                    vec![0x10, 0x40],
                    vec![0, 4]
                ),
                ("/libcuda", LinkKind::Return, vec![2], vec![0x100], vec![2]),
                (
                    "/libcuda",
                    LinkKind::Entry(Allocations),
                    vec![2],
                    vec![0x100],
                    vec![2]
                ),
            ]
        );
        assert!(plan_links(&[]).is_empty());
    }

    #[test]
    fn every_function_is_in_exactly_one_entry_link() {
        let functions: Vec<_> = (0..100u16)
            .map(|i| {
                let stage = DetachStage::ORDER[usize::from(i) % 3];
                let path = if i % 2 == 0 { "/a" } else { "/b" };
                function(
                    path,
                    u64::from(i) * 16,
                    (i % 5 != 0).then_some(u64::from(i) * 16),
                    i,
                    stage,
                )
            })
            .collect();
        let plans = plan_links(&functions);
        let mut entries: Vec<usize> = plans
            .iter()
            .filter(|p| matches!(p.kind, LinkKind::Entry(_)))
            .flat_map(|p| p.members.clone())
            .collect();
        entries.sort_unstable();
        assert_eq!(entries, (0..100).collect::<Vec<_>>());
        let returns: usize = plans
            .iter()
            .filter(|p| p.kind == LinkKind::Return)
            .map(|p| p.members.len())
            .sum();
        assert_eq!(returns, 80);
        // Two objects, a return link and three stages each.
        assert_eq!(plans.len(), 8);
    }
}
