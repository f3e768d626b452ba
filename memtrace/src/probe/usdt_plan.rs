//! USDT probes to attach: which sites of one object carry a probe that a
//! `usdt = "provider:name"` pair or a preset names, and where each site's
//! arguments are (its note's argument specs, decoded into the eBPF side's
//! [`ArgLoc`]s). Every site of a probe name is probed: PyTorch's
//! `pytorch:malloc` sits at two places in `libc10_cuda.so`.
//!
//! Pure but for reading the object file; tested without root.

use std::path::{Path, PathBuf};

use memtrace_common::{ArgLoc, ProbeSpec, RetKind, ARG_NONE, LOC_CONST, LOC_MEM, LOC_REG};
use serde::Serialize;

use super::catalog::{FuncDef, UsdtPoint};
use super::usdt::{self, ArgLocation, UsdtArg, UsdtProbe};
use crate::arch::Arch;

/// One probe site to attach.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct PlannedSite {
    #[serde(skip)]
    pub def: &'static FuncDef,
    /// `provider:name`.
    pub probe: &'static str,
    /// File offset of the probe's instruction.
    pub file_offset: u64,
    /// File offset of its semaphore (the uprobe's reference counter).
    pub semaphore_offset: Option<u64>,
    #[serde(skip)]
    pub locs: [ArgLoc; 4],
}

impl PlannedSite {
    /// The eBPF-side description of this site, stored at `index`.
    pub fn spec(&self, index: u16) -> ProbeSpec {
        let mut spec = self.def.spec(index);
        // Known at the probe: no return probe, nothing in flight.
        spec.ret = RetKind::Void as u8;
        spec.heap = 0;
        let [ptr, size, aux, tag] = self.locs;
        spec.ptr_loc = ptr;
        spec.size_loc = size;
        spec.aux_loc = aux;
        spec.tag_loc = tag;
        spec
    }
}

/// The USDT sites probed in one object.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct UsdtPlan {
    /// Path as the target sees it.
    pub path: PathBuf,
    /// Path memtrace opens (through `/proc/PID/root`).
    #[serde(skip)]
    pub open_path: PathBuf,
    /// The USDT probe sites of this object that are traced.
    pub sites: Vec<PlannedSite>,
}

/// Why a wanted probe's site cannot be probed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SiteError {
    #[error("{probe} at {pc:#x}: {why}")]
    Arguments { probe: String, pc: u64, why: String },
}

/// The eBPF-side location of one decoded argument: `reg` is the register's
/// slot in the traced architecture's frame ([`usdt::Reg`]: x86-64 `pt_regs`
/// order; aarch64 `x<n>` = n, `sp` = 31), `offset` a memory displacement or
/// the constant.
pub fn arg_loc(arg: &UsdtArg) -> ArgLoc {
    let mut loc = ArgLoc::none();
    loc.size = arg.size;
    loc.signed = u8::from(arg.signed);
    match arg.location {
        ArgLocation::Register { reg } => {
            loc.kind = LOC_REG;
            loc.reg = reg.slot();
        }
        ArgLocation::Memory { reg, offset } => {
            loc.kind = LOC_MEM;
            loc.reg = reg.slot();
            loc.offset = offset;
        }
        ArgLocation::Constant { value } => {
            loc.kind = LOC_CONST;
            loc.offset = value;
        }
    }
    loc
}

/// The site of `probe` for `def`, or why its arguments do not fit.
fn site(
    def: &'static FuncDef,
    point: &UsdtPoint,
    probe: &UsdtProbe,
) -> Result<PlannedSite, SiteError> {
    let fail = |why: String| SiteError::Arguments {
        probe: probe.full_name(),
        pc: probe.pc,
        why,
    };
    let args = probe
        .args
        .as_ref()
        .map_err(|err| fail(format!("argument {err}")))?;
    let loc = |index: u8, what: &str| -> Result<ArgLoc, SiteError> {
        if index == ARG_NONE {
            return Ok(ArgLoc::none());
        }
        args.get(usize::from(index)).map(arg_loc).ok_or_else(|| {
            fail(format!(
                "the {what} is argument {index} but the probe has {} ({:?})",
                args.len(),
                probe.args_text
            ))
        })
    };
    Ok(PlannedSite {
        def,
        probe: def.name,
        file_offset: probe.file_offset,
        semaphore_offset: probe.semaphore_offset,
        locs: [
            loc(point.ptr_arg, "pointer")?,
            loc(point.size_arg, "size")?,
            loc(point.aux_arg, "aux value")?,
            loc(point.tag_arg, "tag")?,
        ],
    })
}

/// Matches `probes` (one object's) against the USDT definitions: every
/// site of every wanted name, in note order, releases first (so a block
/// released during the attach is not seen allocated and never released).
/// Sites whose arguments do not fit are returned apart, each with why.
pub fn match_probes(
    probes: &[UsdtProbe],
    defs: &[&'static FuncDef],
) -> (Vec<PlannedSite>, Vec<SiteError>) {
    let mut sites = Vec::new();
    let mut problems = Vec::new();
    for probe in probes {
        for &def in defs {
            let Some(point) = def.usdt.as_ref() else {
                continue;
            };
            if point.provider != probe.provider || point.probe != probe.name {
                continue;
            }
            match site(def, point, probe) {
                Ok(site) => sites.push(site),
                Err(err) => problems.push(err),
            }
        }
    }
    sites.sort_by_key(|s| s.def.kind != memtrace_common::SpecKind::Free);
    (sites, problems)
}

/// Plans the USDT sites of one object file: `Ok(None)` when it has none of
/// the wanted probes; sites that cannot be probed come back as warnings.
pub fn plan_object(
    path: &Path,
    open_path: &Path,
    defs: &[&'static FuncDef],
) -> Result<(Option<UsdtPlan>, Vec<String>), usdt::ReadError> {
    let probes = usdt::read_for(open_path, Arch::HOST)?;
    let (sites, problems) = match_probes(&probes, defs);
    let warnings = problems
        .iter()
        .map(|err| format!("{}: USDT probe {err}", path.display()))
        .collect();
    let plan = (!sites.is_empty()).then(|| UsdtPlan {
        path: path.to_path_buf(),
        open_path: open_path.to_path_buf(),
        sites,
    });
    Ok((plan, warnings))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::catalog::{Allocator, Domain, Memory};
    use memtrace_common::{SpecKind, LOC_NONE};

    fn def(name: &'static str, kind: SpecKind, point: UsdtPoint) -> &'static FuncDef {
        let allocator = Allocator::Custom {
            name: "torch",
            family: 9,
        };
        let mut def = FuncDef::new(name, allocator, Memory::Device, Domain::Custom(9));
        def.kind = kind;
        def.usdt = Some(point);
        Box::leak(Box::new(def))
    }

    fn probe(name: &str, args: &str, pc: u64) -> UsdtProbe {
        UsdtProbe {
            provider: "pytorch".into(),
            name: name.into(),
            pc,
            file_offset: pc - 0x1000,
            semaphore: Some(0x867ca),
            semaphore_offset: Some(0x857ca),
            args_text: args.into(),
            args: usdt::decode_args(args, Arch::X86_64),
        }
    }

    fn torch() -> Vec<&'static FuncDef> {
        let malloc = UsdtPoint {
            size_arg: 2,
            aux_arg: 3,
            tag_arg: 1,
            ..UsdtPoint::new("pytorch", "malloc", 0)
        };
        vec![
            def("pytorch:malloc", SpecKind::Alloc, malloc),
            def(
                "pytorch:free",
                SpecKind::Free,
                UsdtPoint::new("pytorch", "free", 0),
            ),
        ]
    }

    #[test]
    fn every_site_of_pytorchs_probes_is_planned_releases_first() {
        // libc10_cuda.so's four sites (DESIGN.md, USDT).
        let probes = [
            probe("malloc", "-8@%rbp -1@%al -8@%r12 -8@56(%rsp)", 0x2000),
            probe("free", "-8@%rdi", 0x2100),
            probe("malloc", "-8@%rax -1@%dl -8@%r14 -8@-56(%rbp)", 0x2200),
            probe("free", "-8@%rdi", 0x2300),
            probe("other", "", 0x2400),
        ];
        let (sites, problems) = match_probes(&probes, &torch());
        assert!(problems.is_empty(), "{problems:?}");
        let order: Vec<(&str, u64)> = sites.iter().map(|s| (s.probe, s.file_offset)).collect();
        assert_eq!(
            order,
            [
                ("pytorch:free", 0x1100),
                ("pytorch:free", 0x1300),
                ("pytorch:malloc", 0x1000),
                ("pytorch:malloc", 0x1200)
            ]
        );
        let spec = sites[3].spec(7);
        assert_eq!((spec.index, spec.ret), (7, RetKind::Void as u8));
        assert_eq!(spec.kind, SpecKind::Alloc as u8);
        // pointer -8@%rax, device -1@%dl, size -8@%r14, stream -8@-56(%rbp)
        assert_eq!((spec.ptr_loc.kind, spec.ptr_loc.reg), (LOC_REG, 10));
        assert_eq!((spec.size_loc.kind, spec.size_loc.reg), (LOC_REG, 1));
        assert_eq!(
            (
                spec.tag_loc.kind,
                spec.tag_loc.reg,
                spec.tag_loc.size,
                spec.tag_loc.signed
            ),
            (LOC_REG, 12, 1, 1)
        );
        assert_eq!(
            (spec.aux_loc.kind, spec.aux_loc.reg, spec.aux_loc.offset),
            (LOC_MEM, 4, -56)
        );
        let free = sites[0].spec(1);
        assert_eq!(free.kind, SpecKind::Free as u8);
        assert_eq!(free.size_loc.kind, LOC_NONE);
        assert_eq!(sites[0].semaphore_offset, Some(0x857ca));
    }

    #[test]
    fn sites_whose_arguments_do_not_fit_are_warnings() {
        let probes = [
            probe("malloc", "-8@%rbp", 0x2000),
            probe("malloc", "8@%xmm0 1@%al 8@%r12 8@%rax", 0x2100),
        ];
        let (sites, problems) = match_probes(&probes, &torch());
        assert!(sites.is_empty());
        assert_eq!(problems.len(), 2);
        assert!(problems[0]
            .to_string()
            .contains("argument 2 but the probe has 1"));
        assert!(problems[1].to_string().contains("unknown register"));
    }

    #[test]
    fn constants_and_memory_operands_become_arg_locs() {
        let arg = usdt::decode_arg("-4@$-5", Arch::X86_64).expect("constant");
        let loc = arg_loc(&arg);
        assert_eq!(
            (loc.kind, loc.offset, loc.size, loc.signed),
            (LOC_CONST, -5, 4, 1)
        );
        let loc = arg_loc(&usdt::decode_arg("8@16(%rsp)", Arch::X86_64).expect("memory"));
        assert_eq!((loc.kind, loc.reg, loc.offset), (LOC_MEM, 19, 16));
    }
}
