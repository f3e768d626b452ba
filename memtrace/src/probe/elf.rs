//! Reading ELF files: which catalogue functions a file *defines*, at which file
//! offset (what uprobes attach to), and the first bytes of each (for probe
//! placement).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use object::{Object, ObjectSection, ObjectSymbol, SymbolKind};

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
    /// Offset of its first instruction in the file.
    pub file_offset: u64,
    /// Up to [`super::placement::WINDOW`] bytes of its code from the entry.
    pub code: Vec<u8>,
}

/// Finds which of `wanted` the file defines (dynamic symbols first, then the
/// full symbol table, so statically linked allocators are found too).
pub fn defined_functions(path: &Path, wanted: &[&str]) -> Result<Vec<DefinedFunction>, ElfError> {
    let data = std::fs::read(path).map_err(|source| ElfError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let file = object::File::parse(&*data).map_err(|source| ElfError::NotElf {
        path: path.to_path_buf(),
        source,
    })?;
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
        if !wanted.contains(&name) || found.contains_key(name) {
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
        let end = start
            .saturating_add(super::placement::WINDOW)
            .min(data.len());
        let code = data.get(start..end).unwrap_or(&[]).to_vec();
        found.insert(
            name.to_string(),
            DefinedFunction {
                name: name.to_string(),
                file_offset,
                code,
            },
        );
    }
    let mut functions: Vec<DefinedFunction> = found.into_values().collect();
    functions.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(functions)
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
        let found =
            defined_functions(&libc, &["malloc", "free", "no_such_function"]).expect("libc");
        let names: Vec<&str> = found.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, vec!["free", "malloc"]);
        assert!(found
            .iter()
            .all(|f| f.file_offset > 0 && f.code.len() == 64));
    }

    #[test]
    fn rejects_non_elf_files() {
        let dir = std::env::temp_dir().join(format!("memtrace-elf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("not-elf.so");
        std::fs::write(&path, b"hello").expect("write");
        let err = defined_functions(&path, &["malloc"]).expect_err("not ELF");
        assert!(err.to_string().contains("not an ELF object"), "{err}");
        let missing = defined_functions(&dir.join("missing.so"), &["malloc"]).expect_err("missing");
        assert!(missing.to_string().contains("cannot read"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
