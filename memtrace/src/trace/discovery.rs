//! Finding what to probe in the target: every mapped object that defines a
//! catalogue function (libc, another allocator, the executable itself, GPU
//! runtimes wherever they live), at attach time and again whenever new objects
//! appear (libraries loaded with `dlopen` after attach); and every object
//! that carries a USDT probe a pair or preset names (`probe::usdt_plan`).
//! The search of each object for catalogue functions goes through the
//! function cache (`probe::plan_cache`) when `--table-cache` is on.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::disk_cache::{CacheStats, Setting};
use crate::probe::catalog::{Allocator, FuncDef};
use crate::probe::maps;
use crate::probe::plan::LibraryPlan;
use crate::probe::plan_cache::FunctionSearch;
use crate::probe::usdt_plan::{self, UsdtPlan};
use crate::trace::kernel_support::{unsupported_in, Unsupported};
use crate::trace::loader::Probes;
use crate::tracee::files::{self, FileId};

/// The objects considered so far and the ones probed (shared by every
/// traced process: an object probed for one is probed for all).
pub struct Discovery {
    /// By file identity: one image mapped by many processes (or at several
    /// paths) is planned once; two files at one path in two containers twice.
    considered: HashSet<FileId>,
    exclude: Option<PathBuf>,
    /// The functions to look for (built-in catalogue, filtered, plus
    /// pairs), and how: probes placed or at the entry, through the cache.
    search: FunctionSearch,
    /// The function cache's counts (`--table-cache`); `None` when it is off.
    pub function_cache: Option<CacheStats>,
    pub libraries: Vec<LibraryPlan>,
    /// The USDT probes wanted (`usdt =` pairs and presets).
    usdt_defs: Vec<&'static FuncDef>,
    /// Objects whose USDT sites are probed.
    pub usdt: Vec<UsdtPlan>,
    /// Objects that could not be read or attached, with why.
    pub problems: Vec<String>,
    /// The first missing kernel feature an attach ran into.
    pub unsupported: Option<Unsupported>,
    /// Heap allocators to trace (`--allocators`); empty: every one found.
    pub heap_allowed: Vec<Allocator>,
    /// Whether the stripped-executable warning was given.
    warned_stripped: bool,
    /// Warnings are kept in `problems` but not printed (yet): while the
    /// processes of a selection are tried, those of a skipped one become
    /// its note.
    pub hold_warnings: bool,
}

impl Discovery {
    /// `exclude` is an object never to probe (memtrace's own executable, seen
    /// in a launched child before it execs).
    /// `place`: move probes to cheaper spots where safe (see `probe::placement`).
    pub fn new(exclude: Option<PathBuf>, place: bool, catalog: Vec<&'static FuncDef>) -> Self {
        let (usdt_defs, catalog): (Vec<_>, Vec<_>) =
            catalog.into_iter().partition(|def| def.usdt.is_some());
        Discovery {
            usdt_defs,
            usdt: Vec::new(),
            considered: HashSet::new(),
            exclude,
            search: FunctionSearch::new(catalog, place),
            function_cache: None,
            libraries: Vec::new(),
            problems: Vec::new(),
            unsupported: None,
            heap_allowed: Vec::new(),
            warned_stripped: false,
            hold_warnings: false,
        }
    }

    /// One warning: on stderr (unless held) and in the report's notes.
    pub fn warn(&mut self, line: String) {
        if !self.hold_warnings {
            eprintln!("memtrace: warning: {line}");
        }
        self.problems.push(line);
    }

    /// Takes back the problems found since `problems` had `mark` entries
    /// (a skipped process's): they are its note, not the trace's; its
    /// stripped-executable warning no longer counts as given.
    pub fn take_problems_since(&mut self, mark: usize) -> Vec<String> {
        self.warned_stripped = false;
        self.problems.split_off(mark.min(self.problems.len()))
    }

    /// Stops holding warnings and prints those held since `mark`.
    pub fn release_warnings(&mut self, mark: usize) {
        if std::mem::replace(&mut self.hold_warnings, false) {
            for line in self.problems.iter().skip(mark) {
                eprintln!("memtrace: warning: {line}");
            }
        }
    }

    /// Whether nothing is probed yet (no catalogue function, no USDT site).
    pub fn nothing_probed(&self) -> bool {
        self.libraries.iter().all(|l| l.functions.is_empty()) && self.usdt.is_empty()
    }

    /// Searches objects through the function cache in the directory
    /// `setting` names (`--table-cache`, bounded to `max_bytes` with the
    /// unwind tables); a directory refused is counted in the report and,
    /// when `say`, a warning.
    pub fn use_cache(&mut self, setting: &Setting, max_bytes: u64, say: bool) {
        let Setting::Dir(dir) = setting else {
            self.function_cache = None;
            return;
        };
        let mut stats = CacheStats::in_dir(dir);
        if let Err(err) = self.search.use_cache(dir, max_bytes) {
            let line = format!("--table-cache {err}: allocator functions are searched, not cached");
            if say {
                eprintln!("memtrace: warning: {line}");
            }
            stats.failures.push(line);
        }
        self.function_cache = Some(stats);
    }

    /// Adds what searching objects did to the function cache, keeping it
    /// under its bound when files were written.
    fn count(&mut self, counts: &[(&std::path::Path, CacheStats)]) {
        let Some(stats) = self.function_cache.as_mut() else {
            return;
        };
        for (path, one) in counts {
            stats.add(one, path);
        }
        if counts.iter().any(|(_, one)| one.stored > 0) {
            stats.evicted += self.search.evict();
        }
    }

    /// Plans one object, keeping only the heap allocators wanted.
    fn plan(
        &mut self,
        path: &std::path::Path,
        open_path: &std::path::Path,
    ) -> Result<Option<LibraryPlan>, crate::probe::elf::ElfError> {
        let (found, counts) = self.search.plan(path, open_path);
        self.count(&[(path, counts)]);
        self.accept(found)
    }

    /// What an object's plan leaves to probe: its warnings said, the heap
    /// allocators not wanted (`--allocators`) left out.
    fn accept(
        &mut self,
        found: Result<Option<LibraryPlan>, crate::probe::elf::ElfError>,
    ) -> Result<Option<LibraryPlan>, crate::probe::elf::ElfError> {
        let plan = found?;
        // Functions whose entry the kernel refuses to probe (arm64: literal
        // or exclusive loads) are left out of the plan and said once each.
        for line in plan.iter().flat_map(LibraryPlan::warnings) {
            eprintln!("memtrace: warning: {line}");
            self.problems.push(line);
        }
        Ok(plan.and_then(|mut plan| {
            if !self.heap_allowed.is_empty() {
                plan.functions
                    .retain(|p| !p.allocator.is_heap() || self.heap_allowed.contains(&p.allocator));
            }
            (!plan.functions.is_empty()).then_some(plan)
        }))
    }

    /// The target's executable, stripped and importing no `malloc`, defines
    /// no function memtrace knows: its own allocator is invisible. Said once.
    fn check_stripped(&mut self, pid: u32, path: &std::path::Path, open_path: &std::path::Path) {
        if self.warned_stripped {
            return;
        }
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
        if exe.as_deref() != Some(path) {
            return;
        }
        if crate::probe::elf::stripped_with_own_allocator(open_path).unwrap_or(false) {
            self.warned_stripped = true;
            let line = format!(
                "{} is stripped and imports no malloc: an allocator linked into it cannot be \
                 found without its symbol table (try --lib on an unstripped copy, or \
                 --symbol-prefix for a prefixed build)",
                path.display()
            );
            self.warn(line);
        }
    }

    /// Probes every object mapped in process `pid` (plus `extra`) not seen
    /// before. Returns the number of functions newly attached.
    pub fn scan(
        &mut self,
        pid: u32,
        probes: &mut Probes,
        extra: &[PathBuf],
    ) -> std::io::Result<usize> {
        let mappings = maps::read(pid)?;
        // Unwind tables before probes: the first stacks already need them.
        let started = Instant::now();
        probes.update_unwind(pid, &mappings);
        let tables_ms = started.elapsed().as_millis();
        let mut files: Vec<(PathBuf, PathBuf, FileId)> = Vec::new();
        for mapping in maps::executable_file_mappings(&mappings) {
            let Some(path) = mapping.path.clone() else {
                continue;
            };
            if self.exclude.as_ref() == Some(&path) {
                continue;
            }
            // Unopenable files are counted by `tracee::files` (its note).
            if let Ok(open_path) = files::open(pid, mapping) {
                files.push((path, open_path, (mapping.dev, mapping.inode)));
            }
        }
        for path in extra {
            match maps::path_in_target_root(pid, path) {
                Some(open_path) => match std::fs::metadata(&open_path) {
                    Ok(meta) => files.push((path.clone(), open_path, files::id_of(&meta))),
                    Err(err) => log::debug!("skipping {}: {err}", path.display()),
                },
                None => self.problems.push(format!(
                    "{}: cannot be opened as pid {pid} sees it",
                    path.display()
                )),
            }
        }
        let mut attached = 0;
        files.retain(|(_, _, id)| self.considered.insert(*id));
        let objects = files.len();
        // The objects' symbol tables are read on every core (or what the
        // function cache kept of them).
        let started = Instant::now();
        let search = &self.search;
        let sizes =
            crate::parallel::file_sizes(files.iter().map(|(_, open, _)| Some(open.as_path())));
        let order = crate::parallel::biggest_first(&sizes);
        let (found, counts): (Vec<_>, Vec<_>) =
            crate::parallel::map(&files, &order, |(path, open_path, _)| {
                search.plan(path, open_path)
            })
            .into_iter()
            .unzip();
        let counted: Vec<(&std::path::Path, CacheStats)> = files
            .iter()
            .map(|(path, _, _)| path.as_path())
            .zip(counts)
            .collect();
        self.count(&counted);
        let mut planning = started.elapsed();
        let mut attaching = Duration::ZERO;
        for ((path, open_path, _), found) in files.into_iter().zip(found) {
            let started = Instant::now();
            attached += self.probe_usdt(&path, &open_path, probes);
            let planned = self.accept(found);
            planning += started.elapsed();
            let started = Instant::now();
            let outcome =
                planned.map(|library| library.map(|mut l| (probes.attach_library(&mut l), l)));
            attaching += started.elapsed();
            match outcome {
                Ok(Some((outcome, library))) => match outcome {
                    Ok(count) => {
                        attached += count;
                        self.libraries.push(library);
                    }
                    Err(err) => {
                        if self.unsupported.is_none() {
                            self.unsupported = unsupported_in(&err).cloned();
                        }
                        self.problems.push(format!("{err:#}"));
                    }
                },
                Ok(None) => self.check_stripped(pid, &path, &open_path),
                Err(err @ crate::probe::elf::ElfError::ForeignArch { .. }) => {
                    let line = format!("{err}");
                    eprintln!("memtrace: warning: {line}");
                    self.problems.push(line);
                }
                Err(err) => log::debug!("skipping {}: {err}", path.display()),
            }
        }
        if objects > 0 {
            log::info!(
                "attach phase: pid {pid}: unwind tables in {tables_ms} ms; {objects} objects \
                 searched for allocator functions in {} ms; {attached} probes attached in {} ms",
                planning.as_millis(),
                attaching.as_millis()
            );
        }
        Ok(attached)
    }

    /// Adds objects named by hand (`--lib`): each must be a readable ELF file;
    /// one that defines none of the functions is reported, not fatal.
    pub fn add_libraries(
        &mut self,
        pid: u32,
        probes: &mut Probes,
        paths: &[PathBuf],
    ) -> Result<Vec<String>, crate::error::Failure> {
        let mut warnings = Vec::new();
        for path in paths {
            // As the target sees it: inside its root (a container's), the
            // mapped file when it maps one at that path.
            let Some(open_path) = maps::path_in_target_root(pid, path) else {
                return Err(crate::error::Failure::usage(format!(
                    "--lib {}: cannot read it: no such file as pid {pid} sees it (inside /proc/{pid}/root)",
                    path.display()
                )));
            };
            if let Ok(meta) = std::fs::metadata(&open_path) {
                self.considered.insert(files::id_of(&meta));
            }
            self.probe_usdt(path, &open_path, probes);
            match self.plan(path, &open_path) {
                Ok(Some(mut library)) => {
                    probes.attach_library(&mut library).map_err(|err| {
                        match unsupported_in(&err) {
                            Some(unsupported) => unsupported.clone().into(),
                            None => crate::error::Failure::runtime(format!(
                                "--lib {}: {err:#}",
                                path.display()
                            )),
                        }
                    })?;
                    self.libraries.push(library);
                }
                Ok(None) => warnings.push(format!(
                    "--lib {}: defines none of the probed functions",
                    path.display()
                )),
                Err(err) => {
                    return Err(crate::error::Failure::usage(format!("--lib: {err}")));
                }
            }
        }
        Ok(warnings)
    }

    /// Attaches the wanted USDT probes of one object not seen before;
    /// returns how many sites were attached. Malformed notes and sites
    /// whose arguments do not fit are one warning each, naming the object.
    fn probe_usdt(
        &mut self,
        path: &std::path::Path,
        open_path: &std::path::Path,
        probes: &mut Probes,
    ) -> usize {
        if self.usdt_defs.is_empty() {
            return 0;
        }
        let (plan, warnings) = match usdt_plan::plan_object(path, open_path, &self.usdt_defs) {
            Ok(planned) => planned,
            Err(err @ crate::probe::usdt::ReadError::Usdt { .. }) => {
                self.warn(format!("USDT notes unreadable: {err}"));
                return 0;
            }
            Err(err) => {
                log::debug!("skipping USDT notes of {}: {err}", path.display());
                return 0;
            }
        };
        for line in warnings {
            self.warn(line);
        }
        let Some(mut plan) = plan else {
            return 0;
        };
        match probes.attach_usdt(&mut plan) {
            Ok(count) => {
                self.usdt.push(plan);
                count
            }
            Err(err) => {
                if self.unsupported.is_none() {
                    self.unsupported = unsupported_in(&err).cloned();
                }
                self.problems.push(format!("{err:#}"));
                0
            }
        }
    }

    /// Catalogue functions of the allocators found that no object defines
    /// (within each group of names one of which was found: the C interface,
    /// the C++ operators, an allocator's own API, per symbol prefix).
    pub fn missing_functions(&self) -> Vec<String> {
        let found: HashSet<&str> = self
            .libraries
            .iter()
            .flat_map(|lib| {
                lib.functions
                    .iter()
                    .flat_map(|p| std::iter::once(p.function).chain(p.aliases.iter().copied()))
                    .chain(lib.forwarders.iter().map(|f| f.function))
            })
            .collect();
        let catalog = self.search.catalog();
        let groups: HashSet<_> = catalog
            .iter()
            .filter(|def| found.contains(def.name))
            .map(|def| def.group())
            .collect();
        catalog
            .iter()
            .filter(|def| groups.contains(&def.group()) && !found.contains(def.name))
            .map(|def| def.name.to_string())
            .collect()
    }
}
