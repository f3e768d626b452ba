//! Symbolization of normalized stack frames, behind a small trait so the
//! report and analysis layers can be tested without ELF files. The real
//! implementation uses blazesym on the ELF files (with DWARF where present);
//! names come back demangled (C++ and Rust).

use std::collections::HashMap;
use std::path::PathBuf;

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
}

/// Turns normalized addresses into symbols.
pub trait Symbolize {
    /// One answer per input address, in order. Each address is a *return*
    /// address; implementations look up `file_offset - 1` (the call).
    fn symbolize(&mut self, addrs: &[FileAddr]) -> Vec<SymInfo>;
}

/// blazesym over the ELF files the addresses point into, with a cache per address.
pub struct BlazeSymbolizer {
    symbolizer: Symbolizer,
    cache: HashMap<FileAddr, SymInfo>,
    /// How to open a module path (e.g. through `/proc/PID/root`); `None`
    /// refuses the module (its links lead outside the target's root).
    resolve: ResolvePath,
}

/// Maps a module path to the path to open, or refuses it.
pub type ResolvePath = Box<dyn Fn(&std::path::Path) -> Option<PathBuf>>;

impl BlazeSymbolizer {
    pub fn new(resolve: ResolvePath) -> Self {
        BlazeSymbolizer {
            symbolizer: Symbolizer::new(),
            cache: HashMap::new(),
            resolve,
        }
    }

    fn lookup_module(&mut self, module: &std::path::Path, offsets: &[u64]) -> Vec<SymInfo> {
        let Some(path) = (self.resolve)(module) else {
            return vec![SymInfo::default(); offsets.len()];
        };
        let source = Source::Elf(Elf::new(path));
        let lookups: Vec<u64> = offsets.iter().map(|o| o.saturating_sub(1)).collect();
        match self
            .symbolizer
            .symbolize(&source, Input::FileOffset(&lookups))
        {
            Ok(results) => results
                .into_iter()
                .map(|result| match result {
                    Symbolized::Sym(sym) => SymInfo {
                        symbol: Some(sym.name.to_string()),
                        file: sym
                            .code_info
                            .as_ref()
                            .map(|info| info.file.to_string_lossy().into_owned()),
                        line: sym.code_info.as_ref().and_then(|info| info.line),
                    },
                    Symbolized::Unknown(_) => SymInfo::default(),
                })
                .collect(),
            Err(err) => {
                log::debug!("symbolizing in {}: {err}", module.display());
                vec![SymInfo::default(); offsets.len()]
            }
        }
    }
}

impl Symbolize for BlazeSymbolizer {
    fn symbolize(&mut self, addrs: &[FileAddr]) -> Vec<SymInfo> {
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
            let infos = self.lookup_module(&module, &offsets);
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
            .map(|addr| self.cache.get(addr).cloned().unwrap_or_default())
            .collect()
    }
}

#[cfg(test)]
mod tests {
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
}
