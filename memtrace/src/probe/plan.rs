//! Attach planning: which catalogue functions each mapped object defines,
//! which allocator the object is, where exactly to place each probe (and
//! which register each argument is read from there), which functions only
//! forward to another probed function (and need no probe of their own),
//! which cannot be probed at all (an entry the kernel refuses), and in which
//! order to attach. [`search_as`] finds what depends on the file alone
//! ([`Found`], which `probe::plan_cache` keeps on disk) and
//! [`Found::resolve`] makes it the object's plan; [`plan_library`] does both
//! for the architecture memtrace runs on ([`Arch::HOST`]),
//! [`plan_library_as`] for either (tests).

use std::path::{Path, PathBuf};

use iced_x86::{Code, Decoder, DecoderOptions, FlowControl, OpKind};
use memtrace_common::{ProbeSpec, SpecQuirk, ARG_NONE};
use serde::{Deserialize, Serialize};

use super::catalog::{self, Allocator, FuncDef};
use super::elf::{self, DefinedFunction, ElfError};
use super::placement::{self, a64};
use crate::arch::Arch;

/// One function to probe in one object file.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct PlannedProbe {
    #[serde(skip)]
    pub def: &'static FuncDef,
    /// The catalogue's name of the probed function (`malloc`, `cudaMalloc`).
    pub function: &'static str,
    /// Other catalogue names at the same address (probed once).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<&'static str>,
    /// File offset of the function's entry.
    #[serde(skip)]
    pub file_offset: u64,
    /// Bytes past the entry where the entry probe (and the return probe) sits.
    pub probe_offset: u64,
    /// Why the probe sits there.
    pub placement: String,
    /// Whether the kernel emulates the probed instruction (no single-step).
    pub emulated: bool,
    /// The allocator its blocks are reported under: the object's own for the
    /// standard heap names (`malloc` in libjemalloc is jemalloc's).
    #[serde(skip)]
    pub allocator: Allocator,
    /// Which argument register holds each argument at the probe.
    #[serde(skip)]
    pub args: [u8; 6],
}

impl PlannedProbe {
    /// The eBPF-side description of this probe, stored at `index`: the
    /// catalogue's, with arguments read where the placement found them.
    pub fn spec(&self, index: u16) -> ProbeSpec {
        let mut spec = self.def.spec(index);
        let at = |arg: u8| {
            if arg == ARG_NONE {
                ARG_NONE
            } else {
                self.args.get(usize::from(arg)).copied().unwrap_or(arg)
            }
        };
        spec.size_arg = at(spec.size_arg);
        spec.count_arg = at(spec.count_arg);
        spec.ptr_arg = at(spec.ptr_arg);
        spec.out_arg = at(spec.out_arg);
        spec
    }

    /// File offset of the return probe: the entry probe's spot, where the
    /// stack pointer is still the entry's (see [`placement::Needs`]).
    pub fn return_offset(&self) -> Option<u64> {
        self.def
            .needs_return_probe()
            .then_some(self.file_offset + self.probe_offset)
    }
}

/// A catalogue function that only jumps to another one (`operator delete`
/// = `jmp free@plt`): the other's probe sees its calls, so it has none.
#[derive(Clone, Debug, Serialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct Forwarder {
    /// The catalogue function that only jumps (not probed itself).
    pub function: &'static str,
    /// The function it jumps to (probed wherever it is defined).
    pub to: String,
}

/// A catalogue function that cannot be probed: the kernel refuses a uprobe
/// on its entry instruction (arm64: a literal load, an exclusive, ...).
/// The loader must skip it and warn.
#[derive(Clone, Debug, Serialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct RefusedProbe {
    /// The catalogue function left unprobed.
    pub function: &'static str,
    /// Why, as the placement says it.
    pub why: String,
}

/// One object file and the functions probed in it.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
pub struct LibraryPlan {
    /// Path as the target sees it.
    pub path: PathBuf,
    /// Path memtrace opens (through `/proc/PID/root`).
    #[serde(skip)]
    pub open_path: PathBuf,
    /// The heap allocator this object is, when it defines heap functions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocator: Option<&'static str>,
    /// The functions probed in this object, each once.
    pub functions: Vec<PlannedProbe>,
    /// Functions that only jump to another probed one (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub forwarders: Vec<Forwarder>,
    /// Functions defined here that cannot be probed (not in `functions`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<RefusedProbe>,
}

impl LibraryPlan {
    /// One warning line per function that cannot be probed, naming the
    /// object: the loader prints them (only arm64 entries are ever refused).
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn warnings(&self) -> Vec<String> {
        self.refused
            .iter()
            .map(|r| {
                format!(
                    "{}: {} is not probed: {}",
                    self.path.display(),
                    r.function,
                    r.why
                )
            })
            .collect()
    }
}

/// Plans the probes for one object file; `None` when it defines no known
/// function. An object of another architecture is an error
/// ([`ElfError::ForeignArch`], naming the file). Uncached (the trace plans
/// through `probe::plan_cache::FunctionSearch`).
#[cfg(test)]
pub fn plan_library(
    path: &Path,
    open_path: &Path,
    catalog: &[&'static FuncDef],
    place: bool,
) -> Result<Option<LibraryPlan>, ElfError> {
    plan_library_as(Arch::HOST, path, open_path, catalog, place)
}

/// [`plan_library`] for an object of `arch`.
#[cfg(test)]
pub fn plan_library_as(
    arch: Arch,
    path: &Path,
    open_path: &Path,
    catalog: &[&'static FuncDef],
    place: bool,
) -> Result<Option<LibraryPlan>, ElfError> {
    let found = search_as(arch, open_path, catalog, place)?;
    Ok(found.resolve(path, open_path, catalog))
}

/// What searching one object for the catalogue's functions finds: what
/// depends on the file, the catalogue and `place` alone, by name (not on
/// the path it is mapped at, nor on the process), which is what
/// `probe::plan_cache` keeps. [`Found::resolve`] makes it a plan.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Found {
    /// The catalogue functions the object defines (which heap allocator
    /// it is), by name.
    pub defined: Vec<String>,
    /// The functions to probe, releases first, each entry once.
    pub functions: Vec<FoundProbe>,
    /// (function, the one it only jumps to).
    pub forwarders: Vec<(String, String)>,
    /// (function, why its entry cannot be probed).
    pub refused: Vec<(String, String)>,
}

/// One function to probe, as [`Found`] keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FoundProbe {
    pub function: String,
    pub aliases: Vec<String>,
    pub file_offset: u64,
    pub probe_offset: u64,
    pub placement: String,
    pub emulated: bool,
    pub args: [u8; 6],
}

/// The catalogue's definition named `name`.
fn find_def(catalog: &[&'static FuncDef], name: &str) -> Option<&'static FuncDef> {
    catalog.iter().copied().find(|def| def.name == name)
}

/// Searches the object at `open_path`, an `arch` object, for `catalog`'s
/// functions and places their probes (`place`: past the entry where safe).
pub fn search_as(
    arch: Arch,
    open_path: &Path,
    catalog: &[&'static FuncDef],
    place: bool,
) -> Result<Found, ElfError> {
    let names: Vec<&str> = catalog.iter().map(|def| def.name).collect();
    let defined = elf::scan(open_path, &names, arch)?;
    let find_def = |name: &str| find_def(catalog, name);
    let mut functions: Vec<(&FuncDef, FoundProbe)> = Vec::new();
    let mut found = Found {
        defined: defined
            .functions
            .iter()
            .filter(|f| find_def(&f.name).is_some())
            .map(|f| f.name.clone())
            .collect(),
        ..Found::default()
    };
    for &def in catalog {
        let Some(function) = defined.functions.iter().find(|f| f.name == def.name) else {
            continue;
        };
        if let Some((_, first)) = functions
            .iter_mut()
            .find(|(_, p)| p.file_offset == function.file_offset)
        {
            first.aliases.push(def.name.to_string());
            continue;
        }
        if let Some(to) = forward_target(arch, function, &defined, &find_def, def) {
            found.forwarders.push((def.name.to_string(), to));
            continue;
        }
        let placed = placement::choose(arch, &function.code, needs(def));
        let placed = if place { placed } else { placed.at_entry() };
        if placed.is_refused() {
            found
                .refused
                .push((def.name.to_string(), placed.reason.to_string()));
            continue;
        }
        functions.push((
            def,
            FoundProbe {
                function: def.name.to_string(),
                aliases: Vec::new(),
                file_offset: function.file_offset,
                probe_offset: placed.offset,
                placement: placed.reason.to_string(),
                emulated: placed.is_emulated(),
                args: placed.args,
            },
        ));
    }
    // Releases first, so blocks freed during the attach window are not seen
    // allocated-but-never-freed.
    functions.sort_by_key(|(def, _)| {
        !def.is_plain_release() && def.kind != memtrace_common::SpecKind::Free
    });
    found.functions = functions.into_iter().map(|(_, probe)| probe).collect();
    Ok(found)
}

impl Found {
    /// Whether every name it holds is one of `catalog`'s.
    pub fn names_known(&self, catalog: &[&'static FuncDef]) -> bool {
        let known = |name: &String| find_def(catalog, name).is_some();
        self.defined.iter().all(known)
            && self
                .functions
                .iter()
                .all(|f| known(&f.function) && f.aliases.iter().all(known))
            && self
                .forwarders
                .iter()
                .all(|(from, to)| known(from) && known(to))
            && self.refused.iter().all(|(function, _)| known(function))
    }

    /// The plan of the object found at `path` (as the target sees it;
    /// `open_path` as memtrace opens it), its functions `catalog`'s (a name
    /// not in it is left out: see [`Found::names_known`]); `None` when
    /// nothing is to be probed.
    pub fn resolve(
        self,
        path: &Path,
        open_path: &Path,
        catalog: &[&'static FuncDef],
    ) -> Option<LibraryPlan> {
        let find_def = |name: &str| find_def(catalog, name);
        let heap = catalog::heap_allocator(path, self.defined.iter().filter_map(|n| find_def(n)));
        let functions: Vec<PlannedProbe> = self
            .functions
            .into_iter()
            .filter_map(|found| {
                let def = find_def(&found.function)?;
                Some(PlannedProbe {
                    def,
                    function: def.name,
                    aliases: found
                        .aliases
                        .iter()
                        .filter_map(|a| find_def(a).map(|d| d.name))
                        .collect(),
                    file_offset: found.file_offset,
                    probe_offset: found.probe_offset,
                    placement: found.placement,
                    emulated: found.emulated,
                    allocator: if def.allocator.is_heap() {
                        heap
                    } else {
                        def.allocator
                    },
                    args: found.args,
                })
            })
            .collect();
        // (function, what is said of it), the function's name the catalogue's.
        let named = |pairs: Vec<(String, String)>| {
            pairs
                .into_iter()
                .filter_map(move |(function, said)| Some((find_def(&function)?.name, said)))
        };
        let refused: Vec<RefusedProbe> = named(self.refused)
            .map(|(function, why)| RefusedProbe { function, why })
            .collect();
        if functions.is_empty() && refused.is_empty() {
            return None;
        }
        let forwarders = named(self.forwarders)
            .map(|(function, to)| Forwarder { function, to })
            .collect();
        let has_heap = functions.iter().any(|p| p.allocator.is_heap());
        Some(LibraryPlan {
            path: path.to_path_buf(),
            open_path: open_path.to_path_buf(),
            allocator: has_heap.then(|| heap.name()),
            functions,
            forwarders,
            refused,
        })
    }
}

/// What the entry probe of `def` reads, which bounds where it may be placed.
fn needs(def: &FuncDef) -> placement::Needs {
    let mut args = 0u8;
    for arg in [def.size_arg, def.count_arg, def.ptr_arg, def.out_arg] {
        if arg < 6 {
            args |= 1 << arg;
        }
    }
    if def.quirk == SpecQuirk::AnonMmap {
        args |= 1 << 3; // mmap's flags
    }
    placement::Needs {
        args,
        keep_stack: def.needs_return_probe() || def.quirk == SpecQuirk::Malloc3D,
        release_ptr: (def.is_plain_release() && def.ptr_arg < 6).then_some(def.ptr_arg),
    }
}

/// The catalogue function `function` only jumps to, if it does: its code
/// falls straight through (no branch, no memory write) to an unconditional
/// jump (`jmp` on x86-64, `b` on arm64) whose target is the entry of a
/// catalogue function defined in the same object, or a PLT stub of one, of
/// the same kind.
fn forward_target(
    arch: Arch,
    function: &DefinedFunction,
    defined: &elf::Defined,
    find_def: &dyn Fn(&str) -> Option<&'static FuncDef>,
    def: &FuncDef,
) -> Option<String> {
    let target = match arch {
        Arch::X86_64 => x86_jump_target(function)?,
        Arch::Aarch64 => arm64_jump_target(function)?,
    };
    let name = defined
        .functions
        .iter()
        .find(|f| f.address == target)
        .map(|f| f.name.clone())
        .or_else(|| defined.plt.get(&target).cloned())?;
    let to = find_def(&name)?;
    let same_kind = to.kind == def.kind && to.ret == def.ret;
    (same_kind && to.name != def.name).then_some(name)
}

/// At most this many instructions before a forwarder's jump.
const MAX_PREFIX: usize = 8;

/// The address an x86-64 function jumps to after a straight-line prefix.
fn x86_jump_target(function: &DefinedFunction) -> Option<u64> {
    let mut decoder = Decoder::with_ip(64, &function.code, function.address, DecoderOptions::NONE);
    let mut info = iced_x86::InstructionInfoFactory::new();
    for _ in 0..=MAX_PREFIX {
        if !decoder.can_decode() {
            return None;
        }
        let instr = decoder.decode();
        if instr.is_invalid() {
            return None;
        }
        match instr.flow_control() {
            FlowControl::Next => {
                let writes_memory = info.info(&instr).used_memory().iter().any(|m| {
                    !matches!(
                        m.access(),
                        iced_x86::OpAccess::Read | iced_x86::OpAccess::NoMemAccess
                    )
                });
                if writes_memory || instr.code() == Code::Push_r64 {
                    return None;
                }
            }
            FlowControl::UnconditionalBranch
                if matches!(
                    instr.op0_kind(),
                    OpKind::NearBranch32 | OpKind::NearBranch64
                ) =>
            {
                return Some(instr.near_branch_target());
            }
            _ => return None,
        }
    }
    None
}

/// The address an arm64 function branches to (`b`, not `bl`) after a
/// straight-line prefix that writes no memory and leaves the stack pointer.
fn arm64_jump_target(function: &DefinedFunction) -> Option<u64> {
    let words = function.code.chunks_exact(4).take(MAX_PREFIX + 1);
    for (bytes, at) in words.zip((0u64..).step_by(4)) {
        let word = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        let insn = a64::decode(word);
        // b (not bl): bits 31..26 = 000101.
        if word & 0xfc00_0000 == 0x1400_0000 {
            let pc = function.address.checked_add(at)?;
            return pc.checked_add_signed(insn.branch?);
        }
        match insn.straight {
            a64::Straight::Known(effect) if effect.sp == a64::SpWrite::None => {}
            _ => return None,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `function` forwards to in `plan`, if it is a forwarder.
    fn forwarded_to<'a>(plan: &'a LibraryPlan, function: &str) -> Option<&'a str> {
        plan.forwarders
            .iter()
            .find(|f| f.function == function)
            .map(|f| f.to.as_str())
    }

    fn full_catalog() -> Vec<&'static FuncDef> {
        crate::probe::catalog::CATALOG.iter().collect()
    }

    #[test]
    fn plans_libc_with_releases_first_and_aliases_merged() {
        let maps = crate::probe::maps::read(std::process::id()).expect("maps");
        let libc = crate::probe::maps::executable_files(&maps)
            .into_iter()
            .find(|p| p.to_string_lossy().contains("libc.so"))
            .expect("libc mapped");
        let plan = plan_library(&libc, &libc, &full_catalog(), true)
            .expect("readable")
            .expect("libc has allocators");
        assert_eq!(plan.allocator, Some("libc"));
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
        // Return probes sit with the entry probe.
        let malloc = plan
            .functions
            .iter()
            .find(|p| p.function == "malloc")
            .expect("malloc");
        assert_eq!(
            malloc.return_offset(),
            Some(malloc.file_offset + malloc.probe_offset)
        );
    }

    #[test]
    fn spec_reads_arguments_where_the_placement_found_them() {
        let def = crate::probe::catalog::find("realloc").expect("realloc");
        let probe = PlannedProbe {
            def,
            function: def.name,
            aliases: Vec::new(),
            file_offset: 0x100,
            probe_offset: 0x14,
            placement: String::new(),
            emulated: true,
            allocator: Allocator::Mimalloc,
            args: [1, 2, 2, 3, 4, 5],
        };
        let spec = probe.spec(7);
        assert_eq!(
            (spec.ptr_arg, spec.size_arg, spec.count_arg),
            (1, 2, ARG_NONE)
        );
        assert_eq!(probe.return_offset(), Some(0x114));
    }

    /// A library installed in the system's library directory.
    fn system_lib(name: &str) -> Option<PathBuf> {
        ["/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu"]
            .iter()
            .map(|dir| Path::new(dir).join(name))
            .find(|p| p.exists())
    }

    #[test]
    fn libstdcxx_deletes_forward_to_free_and_new_is_probed() {
        // libstdc++6 comes with g++, which building the fixtures needs.
        let Some(lib) = system_lib("libstdc++.so.6") else {
            panic!("libstdc++.so.6 is not installed (the C++ fixtures need g++)");
        };
        let plan = plan_library(&lib, &lib, &full_catalog(), true)
            .expect("readable")
            .expect("libstdc++ defines operator new");
        assert_eq!(plan.allocator, Some("libc"));
        let forwards = |name: &str| forwarded_to(&plan, name);
        assert_eq!(forwards("_ZdlPv"), Some("free"), "{:?}", plan.forwarders);
        assert_eq!(forwards("_ZdlPvm"), Some("_ZdlPv"));
        assert_eq!(forwards("_Znam"), Some("_Znwm"));
        let new = plan
            .functions
            .iter()
            .find(|p| p.function == "_Znwm")
            .expect("operator new probed");
        assert!(new.emulated, "{}", new.placement);
        assert!(
            plan.functions
                .iter()
                .all(|p| !p.function.starts_with("_Zd")),
            "{:?}",
            plan.functions
                .iter()
                .map(|p| p.function)
                .collect::<Vec<_>>()
        );
    }

    /// The arm64 cross libraries (libc6-arm64-cross, libstdc++6-arm64-cross,
    /// which gcc-aarch64-linux-gnu brings).
    fn arm64_lib(name: &str) -> PathBuf {
        let path = Path::new("/usr/aarch64-linux-gnu/lib").join(name);
        assert!(
            path.exists(),
            "{} is missing (apt-get install gcc-aarch64-linux-gnu)",
            path.display()
        );
        path
    }

    fn planned<'a>(plan: &'a LibraryPlan, name: &str) -> &'a PlannedProbe {
        plan.functions
            .iter()
            .find(|p| p.function == name)
            .unwrap_or_else(|| panic!("{name} planned"))
    }

    #[test]
    fn plans_arm64_libc_entries() {
        let libc = arm64_lib("libc.so.6");
        let plan = plan_library_as(Arch::Aarch64, &libc, &libc, &full_catalog(), true)
            .expect("readable")
            .expect("libc has allocators");
        assert_eq!(plan.allocator, Some("libc"));
        assert!(plan.refused.is_empty(), "{:?}", plan.refused);
        // free: `cbz x0` at the entry is simulated; `stp` follows.
        let free = planned(&plan, "free");
        assert_eq!(
            (free.probe_offset, free.emulated),
            (0, true),
            "{}",
            free.placement
        );
        // Allocators with return probes stay at their entry `stp` (stepped).
        for name in ["malloc", "calloc", "realloc", "posix_memalign"] {
            let p = planned(&plan, name);
            assert_eq!(
                (p.probe_offset, p.emulated),
                (0, false),
                "{name}: {}",
                p.placement
            );
            assert_eq!(p.return_offset(), Some(p.file_offset));
        }
        // Releases still attach first.
        let names: Vec<&str> = plan.functions.iter().map(|p| p.function).collect();
        let first_alloc = names.iter().position(|n| *n == "malloc").expect("malloc");
        let free_at = names.iter().position(|n| *n == "free").expect("free");
        assert!(free_at < first_alloc, "{names:?}");
        // An x86-64 memtrace does not probe it, and says which file it is.
        let err = plan_library_as(Arch::X86_64, &libc, &libc, &full_catalog(), true)
            .expect_err("foreign");
        assert_eq!(
            err.to_string(),
            format!(
                "{} is an aarch64 object, not x86_64: not probed",
                libc.display()
            )
        );
    }

    #[test]
    fn arm64_libstdcxx_deletes_forward_through_the_plt() {
        let lib = arm64_lib("libstdc++.so.6");
        let plan = plan_library_as(Arch::Aarch64, &lib, &lib, &full_catalog(), true)
            .expect("readable")
            .expect("libstdc++ defines operator new");
        let forwards = |name: &str| forwarded_to(&plan, name);
        // _ZdlPv: `b free@plt`; _ZdlPvm: `b _ZdlPv@plt`; _Znam: `b _Znwm@plt`.
        assert_eq!(forwards("_ZdlPv"), Some("free"), "{:?}", plan.forwarders);
        assert_eq!(forwards("_ZdlPvm"), Some("_ZdlPv"));
        assert_eq!(forwards("_Znam"), Some("_Znwm"));
        // operator new: `stp x29, x30, [sp, #-32]!` at the entry, stepped.
        let new = planned(&plan, "_Znwm");
        assert_eq!(
            (new.probe_offset, new.emulated),
            (0, false),
            "{}",
            new.placement
        );
    }

    /// Builds a small aarch64 shared object whose `free` starts with an
    /// exclusive load and whose `malloc` starts with a literal load.
    fn refused_fixture() -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("memtrace-plan-{}-refused", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let src = dir.join("refused.s");
        std::fs::write(
            &src,
            "\t.text\n\
             \t.globl free\n\t.type free, %function\nfree:\n\tldxr x1, [x0]\n\tret\n\t.size free, .-free\n\
             \t.globl malloc\n\t.type malloc, %function\nmalloc:\n\tldr x16, 1f\n\tret\n1:\t.quad 0\n\t.size malloc, .-malloc\n\
             \t.globl realloc\n\t.type realloc, %function\nrealloc:\n\tnop\n\tret\n\t.size realloc, .-realloc\n",
        )
        .expect("write source");
        let out = dir.join("librefused.so");
        let status = std::process::Command::new("aarch64-linux-gnu-gcc")
            .args(["-shared", "-nostdlib", "-o"])
            .arg(&out)
            .arg(&src)
            .status()
            .expect("aarch64-linux-gnu-gcc runs (apt-get install gcc-aarch64-linux-gnu)");
        assert!(status.success(), "aarch64-linux-gnu-gcc failed");
        out
    }

    #[test]
    fn refused_arm64_entries_are_skipped_with_a_warning() {
        let lib = refused_fixture();
        for place in [true, false] {
            let plan = plan_library_as(Arch::Aarch64, &lib, &lib, &full_catalog(), place)
                .expect("readable")
                .expect("defines allocators");
            let names: Vec<&str> = plan.functions.iter().map(|p| p.function).collect();
            assert_eq!(names, ["realloc"], "{place}");
            let refused: Vec<&str> = plan.refused.iter().map(|r| r.function).collect();
            assert_eq!(refused, ["malloc", "free"], "{place}");
            let warnings = plan.warnings();
            assert_eq!(
                warnings[1],
                format!(
                    "{}: free is not probed: entry `ldxr x1, [x0]` (exclusive load/store) is \
                     refused by the kernel's uprobes: cannot be probed",
                    lib.display()
                )
            );
            assert!(
                warnings[0]
                    .contains("malloc is not probed: entry `ldr x16, pc+0x8` (literal load)"),
                "{warnings:?}"
            );
        }
        if let Some(dir) = lib.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
