//! USDT sites in the loader: each planned site (`probe::usdt_plan`) gets a
//! spec, and for every traced process its own uprobe perf event with the
//! site's semaphore as reference counter (`trace::usdt_attach`), so the
//! kernel raises the semaphore in the traced processes only, for as long as
//! memtrace holds the event. A process added later (a fork, an adopted
//! peer) gets every site attached so far; an exec'd or exited process's
//! events close with its links; ending the trace closes them in
//! [`DetachStage`] order, like the function probes'.
//!
//! The full object finds the spec by the attach cookie; the compat object
//! by the probed address, published in `SPEC_BY_ADDR` as for functions.
//!
//! Where functions are attached through `uprobe_multi` links (`multi`), so
//! are the sites (`usdt_fire` is then loaded for that attach type and cannot
//! go on a perf event): per process, object and [`DetachStage`], one link
//! carrying every site's offset, cookie and semaphore (reference counter
//! offset). When such a link cannot be created its sites are attached one
//! link each, so only the failing site is named.

use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::path::PathBuf;

use anyhow::Context;
use aya::programs::UProbe;

use super::{AttachedFunction, DetachStage, Probes, USDT};
use crate::error::Failure;
use crate::kernel::variant::Variant;
use crate::probe::usdt_plan::UsdtPlan;
use crate::probe::SpecEntry;
use crate::trace::usdt_attach::{self, UsdtLink};
use memtrace_common::MAX_SPECS;

/// One attached USDT site.
#[derive(Clone, Debug)]
struct Site {
    /// The file as memtrace opens it.
    path: PathBuf,
    offset: u64,
    semaphore: Option<u64>,
    index: u16,
    stage: DetachStage,
}

/// The USDT sites attached so far and each traced process's events.
#[derive(Default)]
pub(super) struct UsdtSites {
    sites: Vec<Site>,
    links: BTreeMap<u32, Vec<(DetachStage, UsdtLink)>>,
    /// `usdt_fire` passed the verifier (loaded on the first site).
    loaded: bool,
}

impl UsdtSites {
    /// Takes the links of `pid` (it exited, or exec'd a new image).
    pub(super) fn take_process(&mut self, pid: u32) -> Vec<(DetachStage, UsdtLink)> {
        self.links.remove(&pid).unwrap_or_default()
    }

    /// Takes every process's links of `stage`.
    pub(super) fn take_stage(&mut self, stage: DetachStage) -> Vec<(DetachStage, UsdtLink)> {
        let mut taken = Vec::new();
        for links in self.links.values_mut() {
            let (now, later): (Vec<_>, Vec<_>) = links.drain(..).partition(|(s, _)| *s == stage);
            *links = later;
            taken.extend(now);
        }
        taken
    }

    /// Takes every link left.
    pub(super) fn take_all(&mut self) -> Vec<(DetachStage, UsdtLink)> {
        std::mem::take(&mut self.links)
            .into_values()
            .flatten()
            .collect()
    }
}

impl Site {
    /// The site as the compat object's address table sees a function.
    fn as_function(&self) -> AttachedFunction {
        AttachedFunction {
            path: self.path.clone(),
            entry_offset: self.offset,
            return_offset: None,
            index: self.index,
            stage: self.stage,
        }
    }
}

/// Groups `sites` for links: per object file and stage (first-seen order),
/// each group the sites' indexes. Pure, for tests.
fn group_sites(sites: &[Site]) -> Vec<Vec<usize>> {
    let mut groups: Vec<((&std::path::Path, DetachStage), Vec<usize>)> = Vec::new();
    for (i, site) in sites.iter().enumerate() {
        let key = (site.path.as_path(), site.stage);
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(i),
            None => groups.push((key, vec![i])),
        }
    }
    groups.into_iter().map(|(_, members)| members).collect()
}

/// Logs an attached site (`-v`).
fn log_attached(planned: &crate::probe::usdt_plan::PlannedSite, path: &std::path::Path) {
    log::info!(
        "attached USDT {} in {} at {:#x}{}",
        planned.probe,
        path.display(),
        planned.file_offset,
        match planned.semaphore_offset {
            Some(offset) => format!(" (semaphore at {offset:#x})"),
            None => String::new(),
        }
    );
}

impl Probes {
    /// Attaches every site of `plan` in every traced process; returns how
    /// many were attached. A site that cannot be attached is left out of
    /// the plan, said once and listed in `attach_failures`.
    pub fn attach_usdt(&mut self, plan: &mut UsdtPlan) -> anyhow::Result<usize> {
        self.load_usdt()?;
        let mut failures = Vec::new();
        let mut kept = Vec::new();
        if self.multi {
            let mut registered = Vec::new();
            for planned in plan.sites.drain(..) {
                match self.register_site(&plan.open_path, &plan.path, &planned) {
                    Ok(site) => registered.push((planned, site)),
                    Err(err) => failures.push(format!(
                        "USDT probe {} at {:#x}: {err:#}",
                        planned.probe, planned.file_offset
                    )),
                }
            }
            let sites: Vec<Site> = registered.iter().map(|(_, site)| site.clone()).collect();
            let outcomes = self.sites_in_every_process(&sites);
            for ((planned, site), outcome) in registered.into_iter().zip(outcomes) {
                match outcome {
                    Ok(()) => {
                        log_attached(&planned, &site.path);
                        self.usdt.sites.push(site);
                        kept.push(planned);
                    }
                    Err(err) => failures.push(format!(
                        "USDT probe {} at {:#x}: {err:#}",
                        planned.probe, planned.file_offset
                    )),
                }
            }
        } else {
            for site in plan.sites.drain(..) {
                match self.attach_site(&plan.open_path, &plan.path, &site) {
                    Ok(()) => kept.push(site),
                    Err(err) => failures.push(format!(
                        "USDT probe {} at {:#x}: {err:#}",
                        site.probe, site.file_offset
                    )),
                }
            }
        }
        plan.sites = kept;
        if plan.sites.is_empty() && !failures.is_empty() {
            anyhow::bail!(
                "cannot attach to {}: {}",
                plan.path.display(),
                failures.join("; ")
            );
        }
        for failure in failures {
            let line = format!("cannot attach {failure} in {}", plan.path.display());
            eprintln!("memtrace: warning: {line}");
            self.attach_failures.push(line);
        }
        Ok(plan.sites.len())
    }

    /// Loads `usdt_fire` once.
    fn load_usdt(&mut self) -> anyhow::Result<()> {
        if self.usdt.loaded {
            return Ok(());
        }
        let program: &mut UProbe = self
            .ebpf
            .program_mut(USDT)
            .with_context(|| format!("program {USDT} missing from the eBPF object"))?
            .try_into()?;
        let loaded = if self.multi {
            program.load_for_uprobe_multi()
        } else {
            program.load()
        };
        loaded.map_err(|err| super::program_load_failure(USDT, &self.options, &err))?;
        self.usdt.loaded = true;
        Ok(())
    }

    /// Registers the spec of one planned site: the site, with its index.
    fn register_site(
        &mut self,
        path: &std::path::Path,
        module: &std::path::Path,
        planned: &crate::probe::usdt_plan::PlannedSite,
    ) -> anyhow::Result<Site> {
        let index = u16::try_from(self.specs.len())
            .ok()
            .filter(|&i| u32::from(i) < MAX_SPECS)
            .ok_or_else(|| Failure::runtime("too many probed functions"))?;
        self.spec_map
            .set(u32::from(index), planned.spec(index), 0)?;
        self.specs.push(SpecEntry {
            // Bounded: at most MAX_SPECS specs a session.
            module: Some(Box::leak(module.display().to_string().into_boxed_str())),
            ..SpecEntry::from(planned.def)
        });
        Ok(Site {
            path: path.to_path_buf(),
            offset: planned.file_offset,
            semaphore: planned.semaphore_offset,
            index,
            stage: DetachStage::of(planned.def.kind),
        })
    }

    /// Attaches one site with a perf event per traced process.
    fn attach_site(
        &mut self,
        path: &std::path::Path,
        module: &std::path::Path,
        planned: &crate::probe::usdt_plan::PlannedSite,
    ) -> anyhow::Result<()> {
        let site = self.register_site(path, module, planned)?;
        if let Err(err) = self.in_every_process(|probes, pid| probes.attach_site_for(&site, pid)) {
            // The index is taken again by the next site.
            self.specs.pop();
            return Err(err);
        }
        log_attached(planned, path);
        self.usdt.sites.push(site);
        Ok(())
    }

    /// Attaches `sites` through grouped `uprobe_multi` links in every
    /// traced process; one outcome per site (attached in at least one
    /// process, or the first error).
    fn sites_in_every_process(&mut self, sites: &[Site]) -> Vec<anyhow::Result<()>> {
        let pids: Vec<u32> = self.processes.keys().copied().collect();
        let mut attached = vec![false; sites.len()];
        let mut first_error: Vec<Option<anyhow::Error>> = sites.iter().map(|_| None).collect();
        for pid in pids {
            for (i, outcome) in self.attach_sites_multi(sites, pid).into_iter().enumerate() {
                match outcome {
                    Ok(()) => attached[i] = true,
                    Err(err) => {
                        first_error[i].get_or_insert(err);
                    }
                }
            }
        }
        attached
            .into_iter()
            .zip(first_error)
            .map(|(ok, err)| match (ok, err) {
                (true, _) => Ok(()),
                (false, Some(err)) => Err(err),
                (false, None) => Err(anyhow::anyhow!("no traced process to attach to")),
            })
            .collect()
    }

    /// Attaches `sites` for `pid`: one `uprobe_multi` link per object and
    /// stage, or, where that link cannot be created, one per site. One
    /// outcome per site.
    fn attach_sites_multi(&mut self, sites: &[Site], pid: u32) -> Vec<anyhow::Result<()>> {
        let mut outcomes: Vec<Option<anyhow::Result<()>>> = sites.iter().map(|_| None).collect();
        for group in group_sites(sites) {
            let members: Vec<&Site> = group.iter().map(|&i| &sites[i]).collect();
            match self.link_sites(&members, pid) {
                Ok(()) => {
                    for &i in &group {
                        outcomes[i] = Some(Ok(()));
                    }
                }
                Err(err) if group.len() == 1 => outcomes[group[0]] = Some(Err(err)),
                Err(err) => {
                    log::debug!("pid {pid}: grouped USDT link: {err:#}; one link per site");
                    for &i in &group {
                        outcomes[i] = Some(self.link_sites(&[&sites[i]], pid));
                    }
                }
            }
        }
        outcomes
            .into_iter()
            .map(|outcome| outcome.unwrap_or(Ok(())))
            .collect()
    }

    /// The loaded `usdt_fire` program.
    fn usdt_program(&self) -> anyhow::Result<&UProbe> {
        Ok(self
            .ebpf
            .program(USDT)
            .with_context(|| format!("program {USDT} missing"))?
            .try_into()?)
    }

    /// One `uprobe_multi` link for `sites` (one object, one stage) in `pid`.
    fn link_sites(&mut self, sites: &[&Site], pid: u32) -> anyhow::Result<()> {
        let Some(first) = sites.first() else {
            return Ok(());
        };
        let fd = self.usdt_program()?.fd()?;
        let offsets: Vec<u64> = sites.iter().map(|s| s.offset).collect();
        let cookies: Vec<u64> = sites.iter().map(|s| u64::from(s.index)).collect();
        let semaphores: Vec<u64> = sites.iter().map(|s| s.semaphore.unwrap_or(0)).collect();
        let link = crate::kernel::uprobe_multi::attach(
            fd.as_fd(),
            &first.path,
            &offsets,
            Some(&cookies),
            Some(&semaphores),
            false,
            pid,
        )
        .with_context(|| format!("pid {pid}: attaching {USDT}"))?;
        self.usdt
            .links
            .entry(pid)
            .or_default()
            .push((first.stage, UsdtLink::Multi(link)));
        Ok(())
    }

    /// Opens the site's uprobe perf event for `pid` (raising its semaphore
    /// there) and attaches `usdt_fire` to it.
    fn attach_site_for(&mut self, site: &Site, pid: u32) -> anyhow::Result<()> {
        let cookie = match self.variant.variant {
            Variant::Full | Variant::TailCall => Some(u64::from(site.index)),
            Variant::Compat => {
                if let Ok(mappings) = crate::probe::maps::read(pid) {
                    self.publish_spec_addr(pid, &site.as_function(), &mappings);
                }
                None
            }
        };
        let fd = self.usdt_program()?.fd()?;
        let event = usdt_attach::open_uprobe(&site.path, site.offset, site.semaphore, pid)
            .with_context(|| format!("pid {pid}: perf_event_open (uprobe)"))?;
        let link = usdt_attach::attach(fd.as_fd(), event, cookie)
            .with_context(|| format!("pid {pid}: attaching {USDT}"))?;
        self.usdt
            .links
            .entry(pid)
            .or_default()
            .push((site.stage, link));
        Ok(())
    }

    /// Attaches every USDT site so far for a process just added; returns
    /// how many were attached and the first failure.
    pub(super) fn usdt_add_process(&mut self, pid: u32) -> (usize, Option<anyhow::Error>) {
        let sites = self.usdt.sites.clone();
        let mut attached = 0;
        let mut first_error = None;
        let outcomes = if self.multi {
            self.attach_sites_multi(&sites, pid)
        } else {
            sites
                .iter()
                .map(|site| self.attach_site_for(site, pid))
                .collect()
        };
        for outcome in outcomes {
            match outcome {
                Ok(()) => attached += 1,
                Err(err) => {
                    log::debug!("pid {pid}: cannot attach USDT site: {err:#}");
                    first_error.get_or_insert(err);
                }
            }
        }
        (attached, first_error)
    }

    /// With the compat object: publishes each USDT site's address in
    /// process `pid` (an exec or a new mapping moves them).
    pub(super) fn usdt_publish(&mut self, pid: u32, mappings: &[crate::probe::maps::Mapping]) {
        for site in self.usdt.sites.clone() {
            self.publish_spec_addr(pid, &site.as_function(), mappings);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn site(path: &str, offset: u64, stage: DetachStage) -> Site {
        Site {
            path: PathBuf::from(path),
            offset,
            semaphore: None,
            index: 0,
            stage,
        }
    }

    #[test]
    fn sites_group_per_object_and_stage_in_first_seen_order() {
        use DetachStage::*;
        let sites = [
            site("/libc10_cuda.so", 0x10, Allocations),
            site("/libc10_cuda.so", 0x20, Releases),
            site("/app", 0x30, Allocations),
            site("/libc10_cuda.so", 0x40, Allocations),
            site("/libc10_cuda.so", 0x50, Releases),
        ];
        assert_eq!(group_sites(&sites), vec![vec![0, 3], vec![1, 4], vec![2]]);
        assert!(group_sites(&[]).is_empty());
    }
}
