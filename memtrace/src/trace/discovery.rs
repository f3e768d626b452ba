//! Finding what to probe in the target: every mapped object that defines a
//! catalogue function (libc, another allocator, the executable itself, GPU
//! runtimes wherever they live), at attach time and again whenever new objects
//! appear (libraries loaded with `dlopen` after attach).

use std::collections::HashSet;
use std::path::PathBuf;

use crate::probe::catalog::{Allocator, CATALOG};
use crate::probe::maps;
use crate::probe::plan::{self, LibraryPlan};
use crate::trace::loader::Probes;

/// The objects considered so far and the ones probed.
pub struct Discovery {
    pid: u32,
    considered: HashSet<PathBuf>,
    exclude: Option<PathBuf>,
    place: bool,
    pub libraries: Vec<LibraryPlan>,
    /// Objects that could not be read or attached, with why.
    pub problems: Vec<String>,
}

impl Discovery {
    /// `exclude` is an object never to probe (memtrace's own executable, seen
    /// in a launched child before it execs).
    /// `place`: move probes to cheaper spots where safe (see `probe::placement`).
    pub fn new(pid: u32, exclude: Option<PathBuf>, place: bool) -> Self {
        Discovery {
            pid,
            considered: HashSet::new(),
            exclude,
            place,
            libraries: Vec::new(),
            problems: Vec::new(),
        }
    }

    /// Probes every object mapped in the target (plus `extra`) not seen before.
    /// Returns the number of functions newly attached.
    pub fn scan(&mut self, probes: &mut Probes, extra: &[PathBuf]) -> std::io::Result<usize> {
        let mut files = maps::executable_files(&maps::read(self.pid)?);
        files.extend(extra.iter().cloned());
        let mut attached = 0;
        for path in files {
            if !self.considered.insert(path.clone()) || self.exclude.as_ref() == Some(&path) {
                continue;
            }
            let open_path = maps::path_in_target_root(self.pid, &path);
            match plan::plan_builtin(&path, &open_path, self.place) {
                Ok(Some(mut library)) => match probes.attach_library(&mut library) {
                    Ok(count) => {
                        attached += count;
                        self.libraries.push(library);
                    }
                    Err(err) => self.problems.push(format!("{err:#}")),
                },
                Ok(None) => {}
                Err(err) => log::debug!("skipping {}: {err}", path.display()),
            }
        }
        Ok(attached)
    }

    /// Catalogue functions of the allocators found that no object defines.
    pub fn missing_functions(&self) -> Vec<String> {
        let found: HashSet<&str> = self
            .libraries
            .iter()
            .flat_map(|lib| lib.functions.iter())
            .flat_map(|p| std::iter::once(p.function).chain(p.aliases.iter().copied()))
            .collect();
        let allocators: HashSet<Allocator> = CATALOG
            .iter()
            .filter(|def| found.contains(def.name))
            .map(|def| def.allocator)
            .collect();
        CATALOG
            .iter()
            .filter(|def| allocators.contains(&def.allocator) && !found.contains(def.name))
            .map(|def| def.name.to_string())
            .collect()
    }
}
