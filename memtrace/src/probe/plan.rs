//! Attach planning: which catalogue functions each mapped object defines,
//! where exactly to place each probe, and in which order to attach.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::catalog::FuncDef;
use super::elf::{self, ElfError};
use super::placement::{self, ProbeRole};

/// One function to probe in one object file.
#[derive(Clone, Debug, Serialize)]
pub struct PlannedProbe {
    #[serde(skip)]
    pub def: &'static FuncDef,
    pub function: &'static str,
    /// Other catalogue names at the same address (probed once).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<&'static str>,
    /// File offset of the function's entry.
    #[serde(skip)]
    pub file_offset: u64,
    /// Bytes past the entry where the entry probe sits.
    pub probe_offset: u64,
    /// Why the probe sits there.
    pub placement: String,
    /// Whether the kernel emulates the probed instruction (no single-step).
    pub emulated: bool,
}

/// One object file and the functions probed in it.
#[derive(Clone, Debug, Serialize)]
pub struct LibraryPlan {
    /// Path as the target sees it.
    pub path: PathBuf,
    /// Path memtrace opens (through `/proc/PID/root`).
    #[serde(skip)]
    pub open_path: PathBuf,
    pub functions: Vec<PlannedProbe>,
}

/// Plans the probes for one object file; `None` when it defines no known function.
pub fn plan_library(
    path: &Path,
    open_path: &Path,
    catalog: &[&'static FuncDef],
    place: bool,
) -> Result<Option<LibraryPlan>, ElfError> {
    let names: Vec<&str> = catalog.iter().map(|def| def.name).collect();
    let defined = elf::defined_functions(open_path, &names)?;
    let mut functions: Vec<PlannedProbe> = Vec::new();
    for &def in catalog {
        let Some(found) = defined.iter().find(|f| f.name == def.name) else {
            continue;
        };
        if let Some(first) = functions
            .iter_mut()
            .find(|p| p.file_offset == found.file_offset)
        {
            first.aliases.push(def.name);
            continue;
        }
        let role = match placement::ArgReg::nth(usize::from(def.ptr_arg)) {
            Some(ptr_reg) if def.is_plain_release() => ProbeRole::ReleasePointer { ptr_reg },
            _ => ProbeRole::Entry,
        };
        let placed = if place {
            placement::choose(&found.code, role)
        } else {
            placement::choose(&found.code, ProbeRole::Entry).at_entry()
        };
        functions.push(PlannedProbe {
            def,
            function: def.name,
            aliases: Vec::new(),
            file_offset: found.file_offset,
            probe_offset: placed.offset,
            placement: placed.reason.to_string(),
            emulated: placed.is_emulated(),
        });
    }
    if functions.is_empty() {
        return Ok(None);
    }
    // Releases first, so blocks freed during the attach window are not seen
    // allocated-but-never-freed.
    functions.sort_by_key(|p| {
        !p.def.is_plain_release() && p.def.kind != memtrace_common::SpecKind::Free
    });
    Ok(Some(LibraryPlan {
        path: path.to_path_buf(),
        open_path: open_path.to_path_buf(),
        functions,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_libc_with_releases_first_and_aliases_merged() {
        let maps = crate::probe::maps::read(std::process::id()).expect("maps");
        let libc = crate::probe::maps::executable_files(&maps)
            .into_iter()
            .find(|p| p.to_string_lossy().contains("libc.so"))
            .expect("libc mapped");
        let catalog: Vec<&FuncDef> = crate::probe::catalog::CATALOG.iter().collect();
        let plan = plan_library(&libc, &libc, &catalog, true)
            .expect("readable")
            .expect("libc has allocators");
        let names: Vec<&str> = plan.functions.iter().map(|p| p.function).collect();
        assert!(names.contains(&"malloc") && names.contains(&"free") && names.contains(&"mmap"));
        let first_alloc = names.iter().position(|n| *n == "malloc").expect("malloc");
        let last_release = names
            .iter()
            .rposition(|n| *n == "free" || *n == "munmap")
            .expect("free");
        assert!(
            last_release < first_alloc,
            "releases attach first: {names:?}"
        );
        // Each entry address is probed once, whatever the aliases.
        let mut offsets: Vec<u64> = plan.functions.iter().map(|p| p.file_offset).collect();
        offsets.sort_unstable();
        offsets.dedup();
        assert_eq!(offsets.len(), plan.functions.len());
    }
}
