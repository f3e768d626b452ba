//! Symbolization of normalized stack frames, behind a small trait so the
//! report and analysis layers can be tested without ELF files. The real
//! implementation uses blazesym on the ELF files (with DWARF where present);
//! names come back demangled (C++ and Rust).
//!
//! Separate debug files are found by memtrace, not by blazesym (whose
//! lookup starts from the object's canonical path: for a container's file
//! read through `/proc/PID/root`, the host's file of that name): see
//! [`debug`]. Whatever a debug file cannot answer, or when none is found or
//! it cannot be read, the object's own symbols answer: a module is never
//! dropped for its debug information.

pub mod debug;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer};

use crate::probe::maps::FileAddr;

pub mod short;

/// What is known of one code address.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SymInfo {
    pub symbol: Option<String>,
    pub file: Option<String>,
    pub line: Option<u32>,
    /// Functions inlined at this address (from DWARF), innermost first:
    /// the address lies in the first, inlined into the next, ..., inlined
    /// into `symbol` (whose `file`/`line` is then the outermost call).
    pub inlined: Vec<InlinedCall>,
}

/// One inlined function at an address, and where in it the address (or the
/// next inner inlined call) lies.
#[derive(
    Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
pub struct InlinedCall {
    /// The inlined function, demangled.
    pub symbol: String,
    /// The source file in which the address (or the next inner inlined
    /// call) lies; absent when the debug information does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// The line in `file`; absent when the debug information does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line: Option<u32>,
}

/// Turns normalized addresses into symbols.
pub trait Symbolize {
    /// One answer per input address, in order. Each address is a *return*
    /// address; implementations look up `file_offset - 1` (the call).
    fn symbolize(&mut self, addrs: &[FileAddr]) -> Vec<SymInfo>;

    /// Like [`Symbolize::symbolize`], with `None` where the object could
    /// not be read at all (no answer, rather than an answer of no symbol):
    /// what a record carries (`record`).
    fn answer(&mut self, addrs: &[FileAddr]) -> Vec<Option<SymInfo>> {
        self.symbolize(addrs).into_iter().map(Some).collect()
    }

    /// The build-id of the object at `module`, in hex (`None`: it has
    /// none, or it cannot be read).
    fn build_id(&mut self, _module: &Path) -> Option<String> {
        None
    }
}

/// blazesym over the ELF files the addresses point into, with a cache per address.
pub struct BlazeSymbolizer {
    symbolizer: Symbolizer,
    /// `None`: the object could not be read.
    cache: HashMap<FileAddr, Option<SymInfo>>,
    /// How to open a module path (e.g. through `/proc/PID/root`); `None`
    /// refuses the module (another file than the one mapped, or none).
    resolve: ResolvePath,
    /// The debug directories on memtrace's side, searched after the
    /// target's own ([`debug::DEBUG_DIRS`] as the target sees them).
    host_debug_dirs: Vec<PathBuf>,
    /// Each module's debug file (and its object's segments), once looked for.
    debug_files: HashMap<PathBuf, Option<(PathBuf, debug::ObjectInfo)>>,
}

/// Maps a module path to the path to open, or refuses it.
pub type ResolvePath = Box<dyn Fn(&std::path::Path) -> Option<PathBuf>>;

impl BlazeSymbolizer {
    pub fn new(resolve: ResolvePath) -> Self {
        BlazeSymbolizer {
            // No debug directories for blazesym: it would search them by
            // the build-id of the object's canonical path (see the module
            // doc); memtrace finds debug files itself.
            symbolizer: Symbolizer::builder()
                .set_debug_dirs(Some(Vec::<PathBuf>::new()))
                .build(),
            cache: HashMap::new(),
            resolve,
            host_debug_dirs: debug::DEBUG_DIRS.iter().map(PathBuf::from).collect(),
            debug_files: HashMap::new(),
        }
    }

    /// Searches `dirs` instead of the host's debug directories.
    #[cfg(test)]
    fn with_host_debug_dirs(mut self, dirs: Vec<PathBuf>) -> Self {
        self.host_debug_dirs = dirs;
        self
    }

    /// The debug file of `module` (opened as `path`): by the build-id of
    /// the file at `path`, in the target's debug directories, then the
    /// host's. Looked for once per module.
    fn debug_file(&mut self, module: &Path, path: &Path) -> Option<&(PathBuf, debug::ObjectInfo)> {
        if !self.debug_files.contains_key(module) {
            let found = self.find_debug_file(path);
            if let Some((debug_path, _)) = &found {
                log::debug!("{}: debug file {}", module.display(), debug_path.display());
            }
            self.debug_files.insert(module.to_path_buf(), found);
        }
        self.debug_files.get(module).and_then(Option::as_ref)
    }

    fn find_debug_file(&self, path: &Path) -> Option<(PathBuf, debug::ObjectInfo)> {
        let info = match debug::ObjectInfo::read(path) {
            Ok(info) => info,
            Err(err) => {
                log::debug!("no debug file looked for: {err}");
                return None;
            }
        };
        let build_id = info.build_id.clone()?;
        let relative = debug::build_id_path(&build_id)?;
        let mut candidates: Vec<PathBuf> = debug::DEBUG_DIRS
            .iter()
            .filter_map(|dir| (self.resolve)(&Path::new(dir).join(&relative)))
            .collect();
        for dir in &self.host_debug_dirs {
            let candidate = dir.join(&relative);
            if !candidates.contains(&candidate) {
                candidates.push(candidate);
            }
        }
        let found = debug::first_matching(&build_id, candidates)?;
        Some((found, info))
    }

    /// Symbolizes `input` in the ELF file at `path`, with its own DWARF if
    /// it has some, else (or when that fails) with its symbol tables alone.
    fn symbolize_elf(&self, path: &Path, input: Input<&[u64]>) -> Option<Vec<SymInfo>> {
        let mut last_err = None;
        for debug_syms in [true, false] {
            let mut elf = Elf::new(path);
            elf.debug_syms = debug_syms;
            match self.symbolizer.symbolize(&Source::Elf(elf), input) {
                Ok(results) => return Some(results.into_iter().map(sym_info).collect()),
                Err(err) => last_err = Some(err),
            }
        }
        if let Some(err) = last_err {
            log::debug!("symbolizing in {}: {err}", path.display());
        }
        None
    }

    /// The answers for `offsets` in `module`; `None` when it could not be
    /// read (refused, or neither it nor its debug file could be symbolized).
    fn lookup_module(&mut self, module: &Path, offsets: &[u64]) -> Option<Vec<SymInfo>> {
        let path = (self.resolve)(module)?;
        let lookups: Vec<u64> = offsets.iter().map(|o| o.saturating_sub(1)).collect();
        let own = self.symbolize_elf(&path, Input::FileOffset(&lookups));
        let Some((debug_path, info)) = self.debug_file(module, &path).cloned() else {
            return own;
        };
        // The debug file's symbols are keyed by virtual offsets (its own
        // segments are not the object's).
        let virt: Vec<(usize, u64)> = lookups
            .iter()
            .enumerate()
            .filter_map(|(i, &offset)| Some((i, info.virt_offset(offset)?)))
            .collect();
        let addrs: Vec<u64> = virt.iter().map(|&(_, addr)| addr).collect();
        let Some(from_debug) = self.symbolize_elf(&debug_path, Input::VirtOffset(&addrs)) else {
            return own;
        };
        let mut merged = own.unwrap_or_else(|| vec![SymInfo::default(); offsets.len()]);
        for ((i, _), answer) in virt.into_iter().zip(from_debug) {
            if answer.symbol.is_some() {
                merged[i] = answer;
            }
        }
        Some(merged)
    }
}

/// One blazesym answer as a [`SymInfo`].
fn sym_info(result: Symbolized<'_>) -> SymInfo {
    match result {
        Symbolized::Sym(sym) => SymInfo {
            symbol: Some(sym.name.to_string()),
            file: sym
                .code_info
                .as_ref()
                .map(|info| info.file.to_string_lossy().into_owned()),
            line: sym.code_info.as_ref().and_then(|info| info.line),
            // blazesym lists them outermost first, each with the location
            // of the next inner call (the last: the address itself).
            inlined: sym
                .inlined
                .iter()
                .rev()
                .map(|call| InlinedCall {
                    symbol: call.name.to_string(),
                    file: call
                        .code_info
                        .as_ref()
                        .map(|info| info.file.to_string_lossy().into_owned()),
                    line: call.code_info.as_ref().and_then(|info| info.line),
                })
                .collect(),
        },
        Symbolized::Unknown(_) => SymInfo::default(),
    }
}

impl Symbolize for BlazeSymbolizer {
    fn symbolize(&mut self, addrs: &[FileAddr]) -> Vec<SymInfo> {
        self.answer(addrs)
            .into_iter()
            .map(Option::unwrap_or_default)
            .collect()
    }

    fn answer(&mut self, addrs: &[FileAddr]) -> Vec<Option<SymInfo>> {
        let mut missing: HashMap<PathBuf, Vec<u64>> = HashMap::new();
        for addr in addrs {
            if !self.cache.contains_key(addr) {
                let offsets = missing.entry(addr.module.clone()).or_default();
                if !offsets.contains(&addr.file_offset) {
                    offsets.push(addr.file_offset);
                }
            }
        }
        for (module, offsets) in missing {
            let infos = match self.lookup_module(&module, &offsets) {
                Some(infos) => infos.into_iter().map(Some).collect(),
                None => vec![None; offsets.len()],
            };
            for (offset, info) in offsets.into_iter().zip(infos) {
                self.cache.insert(
                    FileAddr {
                        module: module.clone(),
                        file_offset: offset,
                    },
                    info,
                );
            }
        }
        addrs
            .iter()
            .map(|addr| self.cache.get(addr).cloned().flatten())
            .collect()
    }

    fn build_id(&mut self, module: &Path) -> Option<String> {
        let id = match self.debug_files.get(module) {
            Some(Some((_, info))) => info.build_id.clone(),
            _ => {
                debug::ObjectInfo::read(&(self.resolve)(module)?)
                    .ok()?
                    .build_id
            }
        };
        id.as_deref().map(debug::hex)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Symbolizes this test binary's own function from its file offset.
    #[test]
    fn finds_a_function_in_an_elf_file() {
        let exe = std::env::current_exe().expect("test binary path");
        let maps = crate::probe::maps::read(std::process::id()).expect("own maps");
        let space = crate::probe::maps::AddressSpace::new(maps);
        // A return address just past the start of this function's code.
        let addr = finds_a_function_in_an_elf_file as *const () as u64 + 1;
        let normalized = space.normalize(addr).expect("own code is file-backed");
        assert_eq!(
            std::fs::canonicalize(&normalized.module).ok(),
            std::fs::canonicalize(&exe).ok()
        );
        let mut symbolizer = BlazeSymbolizer::new(Box::new(|p| Some(p.to_path_buf())));
        let info = symbolizer.symbolize(&[normalized]);
        let symbol = info[0].symbol.clone().unwrap_or_default();
        assert!(
            symbol.contains("finds_a_function_in_an_elf_file"),
            "got {symbol:?}"
        );
    }

    pub(crate) const TESTDATA: &str =
        concat!(env!("CARGO_MANIFEST_DIR"), "/src/symbolize/testdata");

    /// A fresh directory for one test.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("memtrace-sym-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    /// Copies test object `name` to `to`, creating its directory.
    fn place(name: &str, to: &Path) {
        std::fs::create_dir_all(to.parent().expect("a directory")).expect("mkdir");
        std::fs::copy(Path::new(TESTDATA).join(name), to).expect("copy test object");
    }

    /// The return addresses (file offset of the call + 1) of a few bytes
    /// into `leak_alloc` and `leak_inner` of `libleak-N.so`, from its debug
    /// file's symbol table.
    pub(crate) fn return_addrs(n: u32) -> (u64, u64) {
        use object::{Object, ObjectSymbol};
        let debug_file = std::fs::read(Path::new(TESTDATA).join(format!("libleak-{n}.debug")))
            .expect("debug file");
        let debug_file = object::File::parse(&*debug_file).expect("ELF");
        let object = debug::ObjectInfo::read(&Path::new(TESTDATA).join(format!("libleak-{n}.so")))
            .expect("object segments");
        let at = |name: &str| {
            let symbol = debug_file
                .symbols()
                .find(|s| s.name() == Ok(name))
                .unwrap_or_else(|| panic!("{name} in the debug file"));
            object.file_offset(symbol.address()).expect("in a segment") + 4
        };
        (at("leak_alloc"), at("leak_inner"))
    }

    fn symbolize_in(
        symbolizer: &mut BlazeSymbolizer,
        module: &Path,
        offsets: &[u64],
    ) -> Vec<SymInfo> {
        let addrs: Vec<FileAddr> = offsets
            .iter()
            .map(|&file_offset| FileAddr {
                module: module.to_path_buf(),
                file_offset,
            })
            .collect();
        symbolizer.symbolize(&addrs)
    }

    /// The object's debug link names a file that is another build (the
    /// checksum fails): its own symbols still answer, never `??`.
    #[test]
    fn a_failed_debug_link_falls_back_to_the_objects_own_symbols() {
        let dir = scratch("fallback");
        let object = dir.join("libleak.so");
        place("libleak-1.so", &object);
        place("libleak-2.debug", &dir.join("libleak.debug"));
        let (alloc, _) = return_addrs(1);
        let mut symbolizer = BlazeSymbolizer::new(Box::new(|p| Some(p.to_path_buf())))
            .with_host_debug_dirs(vec![dir.join("no-debug")]);
        let info = symbolize_in(&mut symbolizer, &object, &[alloc]);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(info[0].symbol.as_deref(), Some("leak_alloc"), "{info:?}");
    }

    /// A container's object, opened inside its root: its debug file is
    /// found there by its own build-id, though the host's debug directory
    /// has another build's file under that name and the debug link's name
    /// leads to another build's file.
    #[test]
    fn debug_files_are_found_by_the_objects_build_id_in_its_root_first() {
        let dir = scratch("root");
        let root = dir.join("root");
        let host_debug = dir.join("host-debug");
        let module = Path::new("/usr/lib/libleak.so");
        place("libleak-1.so", &root.join("usr/lib/libleak.so"));
        place("libleak-2.debug", &root.join("usr/lib/libleak.debug"));
        let id = debug::ObjectInfo::read(&root.join("usr/lib/libleak.so"))
            .expect("object")
            .build_id
            .expect("a build-id");
        let relative = debug::build_id_path(&id).expect("build-id path");
        place(
            "libleak-1.debug",
            &root.join("usr/lib/debug").join(&relative),
        );
        place("libleak-2.debug", &host_debug.join(&relative));
        let inside = root.clone();
        let mut symbolizer = BlazeSymbolizer::new(Box::new(move |p| {
            let path = inside.join(p.strip_prefix("/").unwrap_or(p));
            path.exists().then_some(path)
        }))
        .with_host_debug_dirs(vec![host_debug.clone()]);
        let (alloc, inner) = return_addrs(1);
        let info = symbolize_in(&mut symbolizer, module, &[alloc, inner]);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(info[0].symbol.as_deref(), Some("leak_alloc"), "{info:?}");
        assert_eq!(info[1].symbol.as_deref(), Some("leak_inner"), "{info:?}");
        for frame in &info {
            assert!(
                frame
                    .file
                    .as_deref()
                    .is_some_and(|f| f.ends_with("libleak.c"))
                    && frame.line.is_some(),
                "DWARF from the debug file: {frame:?}"
            );
        }
    }

    /// No debug file in the target's root: the host's is used when it is
    /// the same build, and refused (own symbols only) when it is not.
    #[test]
    fn a_host_debug_file_is_used_only_for_the_same_build() {
        let dir = scratch("host");
        let object = dir.join("lib/libleak.so");
        let host_debug = dir.join("host-debug");
        place("libleak-1.so", &object);
        let id = debug::ObjectInfo::read(&object)
            .expect("object")
            .build_id
            .expect("a build-id");
        let relative = debug::build_id_path(&id).expect("build-id path");
        let (alloc, inner) = return_addrs(1);
        let symbolizer = |dir: &Path| {
            BlazeSymbolizer::new(Box::new(|p| Some(p.to_path_buf())))
                .with_host_debug_dirs(vec![dir.to_path_buf()])
        };

        place("libleak-2.debug", &host_debug.join(&relative));
        let wrong = symbolize_in(&mut symbolizer(&host_debug), &object, &[alloc, inner]);
        place("libleak-1.debug", &host_debug.join(&relative));
        let right = symbolize_in(&mut symbolizer(&host_debug), &object, &[alloc, inner]);
        let _ = std::fs::remove_dir_all(&dir);

        assert_eq!(wrong[0].symbol.as_deref(), Some("leak_alloc"), "{wrong:?}");
        assert_eq!(wrong[0].line, None, "no DWARF of another build: {wrong:?}");
        assert_ne!(wrong[1].symbol.as_deref(), Some("leak_alloc"), "{wrong:?}");
        assert_eq!(right[0].symbol.as_deref(), Some("leak_alloc"), "{right:?}");
        assert_eq!(right[1].symbol.as_deref(), Some("leak_inner"), "{right:?}");
        assert!(right[1].line.is_some(), "{right:?}");
    }
}
