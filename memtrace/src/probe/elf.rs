//! Reading ELF files: which catalogue functions a file *defines*, at which file
//! offset (what uprobes attach to), the first bytes of each (for probe
//! placement), and which symbol each PLT stub jumps to (to recognise a
//! function that only forwards to another, such as `operator delete` to
//! `free@plt`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use iced_x86::{Code, Decoder, DecoderOptions};
use object::{
    Object, ObjectSection, ObjectSymbol, ObjectSymbolTable, RelocationTarget, SymbolKind,
};

/// Errors reading a file as ELF.
#[derive(Debug, thiserror::Error)]
pub enum ElfError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not an ELF object: {source}")]
    NotElf {
        path: PathBuf,
        source: object::Error,
    },
}

/// A function defined in an ELF file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DefinedFunction {
    pub name: String,
    /// Its virtual address in the file's own address space.
    pub address: u64,
    /// Offset of its first instruction in the file.
    pub file_offset: u64,
    /// Up to [`super::placement::WINDOW`] bytes of its code from the entry.
    pub code: Vec<u8>,
}

/// What one object file defines of the catalogue.
#[derive(Clone, Debug, Default)]
pub struct Defined {
    pub functions: Vec<DefinedFunction>,
    /// PLT stub address -> the symbol it jumps to (without version).
    pub plt: HashMap<u64, String>,
}

/// Finds which of `wanted` the file defines (dynamic symbols first, then the
/// full symbol table, so statically linked allocators are found too), and
/// its PLT stubs.
pub fn scan(path: &Path, wanted: &[&str]) -> Result<Defined, ElfError> {
    let data = std::fs::read(path).map_err(|source| ElfError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let file = object::File::parse(&*data).map_err(|source| ElfError::NotElf {
        path: path.to_path_buf(),
        source,
    })?;
    let wanted: std::collections::HashSet<&str> = wanted.iter().copied().collect();
    let mut found: HashMap<String, DefinedFunction> = HashMap::new();
    for symbol in file.dynamic_symbols().chain(file.symbols()) {
        if symbol.kind() != SymbolKind::Text || symbol.is_undefined() {
            continue;
        }
        let Ok(raw_name) = symbol.name() else {
            continue;
        };
        // Versioned names such as `malloc@@GLIBC_2.2.5` in a static symtab.
        let name = raw_name.split('@').next().unwrap_or(raw_name);
        if !wanted.contains(name) || found.contains_key(name) {
            continue;
        }
        let Some(section) = symbol
            .section_index()
            .and_then(|i| file.section_by_index(i).ok())
        else {
            continue;
        };
        let Some((section_offset, section_size)) = section.file_range() else {
            continue;
        };
        let Some(delta) = symbol.address().checked_sub(section.address()) else {
            continue;
        };
        if delta >= section_size {
            continue;
        }
        let file_offset = section_offset + delta;
        let start = usize::try_from(file_offset).unwrap_or(usize::MAX);
        let window = match usize::try_from(symbol.size()) {
            Ok(0) | Err(_) => super::placement::WINDOW,
            Ok(size) => size.min(super::placement::WINDOW),
        };
        let end = start.saturating_add(window).min(data.len());
        let code = data.get(start..end).unwrap_or(&[]).to_vec();
        found.insert(
            name.to_string(),
            DefinedFunction {
                name: name.to_string(),
                address: symbol.address(),
                file_offset,
                code,
            },
        );
    }
    let mut functions: Vec<DefinedFunction> = found.into_values().collect();
    functions.sort_by(|a, b| a.name.cmp(&b.name));
    // The PLT only matters for objects that define something (forwarders).
    let plt = if functions.is_empty() {
        HashMap::new()
    } else {
        plt_stubs(&file)
    };
    Ok(Defined { functions, plt })
}

/// Whether the file is stripped (no `.symtab`) and imports no `malloc`: an
/// executable like that (a static Go or Rust binary) brings its own
/// allocator, which memtrace cannot find without symbols.
pub fn stripped_with_own_allocator(path: &Path) -> Result<bool, ElfError> {
    let data = std::fs::read(path).map_err(|source| ElfError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let file = object::File::parse(&*data).map_err(|source| ElfError::NotElf {
        path: path.to_path_buf(),
        source,
    })?;
    let imports_malloc = file.dynamic_symbols().any(|s| {
        s.is_undefined()
            && s.name()
                .is_ok_and(|n| n.split('@').next() == Some("malloc"))
    });
    Ok(file.symbol_table().is_none() && !imports_malloc)
}

/// Maps each PLT stub (`.plt`, `.plt.sec`, `.plt.got`) to the symbol whose
/// GOT slot it jumps through (`jmp qword [rip+disp]`).
fn plt_stubs(file: &object::File) -> HashMap<u64, String> {
    let mut slots: HashMap<u64, String> = HashMap::new();
    if let (Some(relocations), Some(dynsyms)) =
        (file.dynamic_relocations(), file.dynamic_symbol_table())
    {
        for (slot, relocation) in relocations {
            let RelocationTarget::Symbol(index) = relocation.target() else {
                continue;
            };
            if let Some(name) = dynsyms
                .symbol_by_index(index)
                .ok()
                .and_then(|s| s.name().ok())
            {
                let name = name.split('@').next().unwrap_or(name);
                slots.insert(slot, name.to_string());
            }
        }
    }
    let mut stubs = HashMap::new();
    if slots.is_empty() {
        return stubs;
    }
    for section in file.sections() {
        let Ok(name) = section.name() else { continue };
        if !matches!(name, ".plt" | ".plt.sec" | ".plt.got") {
            continue;
        }
        let Ok(bytes) = section.data() else { continue };
        let mut decoder = Decoder::with_ip(64, bytes, section.address(), DecoderOptions::NONE);
        let mut stub_start = None;
        while decoder.can_decode() {
            let ip = decoder.ip();
            let instr = decoder.decode();
            match instr.code() {
                Code::Endbr64 => stub_start = Some(ip),
                Code::Jmp_rm64 if instr.is_ip_rel_memory_operand() => {
                    if let Some(name) = slots.get(&instr.ip_rel_memory_address()) {
                        stubs.insert(ip, name.clone());
                        if let Some(start) = stub_start.take() {
                            stubs.insert(start, name.clone());
                        }
                    }
                }
                _ => stub_start = None,
            }
        }
    }
    stubs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn libc_path() -> Option<PathBuf> {
        let maps = crate::probe::maps::read(std::process::id()).ok()?;
        crate::probe::maps::executable_files(&maps)
            .into_iter()
            .find(|p| p.to_string_lossy().contains("libc.so"))
    }

    #[test]
    fn finds_libc_allocators() {
        let Some(libc) = libc_path() else {
            panic!("the test process maps no libc.so");
        };
        let found = scan(&libc, &["malloc", "free", "no_such_function"])
            .expect("libc")
            .functions;
        let names: Vec<&str> = found.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, vec!["free", "malloc"]);
        assert!(found
            .iter()
            .all(|f| f.file_offset > 0 && f.address > 0 && f.code.len() >= 64));
    }

    #[test]
    fn plt_stubs_name_their_targets() {
        // libstdc++6 comes with g++, which building the C++ fixtures needs.
        let lib = ["/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu"]
            .iter()
            .map(|dir| Path::new(dir).join("libstdc++.so.6"))
            .find(|p| p.exists())
            .expect("libstdc++.so.6 installed (g++)");
        let defined = scan(&lib, &["_ZdlPv"]).expect("readable");
        assert!(
            defined.plt.values().any(|name| name == "free"),
            "{:?}",
            defined.plt.values().take(20).collect::<Vec<_>>()
        );
    }

    #[test]
    fn rejects_non_elf_files() {
        let dir = std::env::temp_dir().join(format!("memtrace-elf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("not-elf.so");
        std::fs::write(&path, b"hello").expect("write");
        let err = scan(&path, &["malloc"]).expect_err("not ELF");
        assert!(err.to_string().contains("not an ELF object"), "{err}");
        let missing = scan(&dir.join("missing.so"), &["malloc"]).expect_err("missing");
        assert!(missing.to_string().contains("cannot read"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
