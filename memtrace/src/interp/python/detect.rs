//! Finding a CPython interpreter in a process: the object that defines
//! `_PyRuntime` — a mapped `libpython3.X.so` (pyenv, conda, most distros),
//! or the executable itself when libpython is linked in statically (Debian's
//! `python3.11`: stripped, non-PIE, `_PyRuntime` still in `.dynsym`).
//! Only the executable and objects named `libpython*` are opened, so a
//! process mapping hundreds of libraries costs a few file reads.
//!
//! The version comes from the object's exported `Py_Version` (3.11+, the
//! `PY_VERSION_HEX` the interpreter was built as), else from its name
//! (`libpython3.X`, `python3.X`). The runtime address is the symbol's value
//! plus the object's load bias, taken from the mapping of its first segment.

use std::path::{Path, PathBuf};

use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol};

use crate::probe::maps::{self, Mapping};

/// A CPython interpreter found in a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// The object defining `_PyRuntime`, as the target maps it.
    pub object: PathBuf,
    pub major: u32,
    pub minor: u32,
    /// `Py_Version` when the object exports it (full `PY_VERSION_HEX`).
    pub version_hex: Option<u32>,
    /// Address of `_PyRuntime` in the process.
    pub runtime: u64,
}

impl Found {
    /// `3.11.7`, or `3.11` when only the minor version is known.
    pub fn version(&self) -> String {
        match self.version_hex {
            Some(hex) => format!("{}.{}.{}", hex >> 24, (hex >> 16) & 0xff, (hex >> 8) & 0xff),
            None => format!("{}.{}", self.major, self.minor),
        }
    }
}

/// What the symbols of one ELF file say.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exports {
    /// Link-time address of `_PyRuntime`.
    pub runtime_vaddr: Option<u64>,
    /// The value of `Py_Version`.
    pub version_hex: Option<u32>,
    /// Link-time address of the first loadable segment.
    pub first_load_vaddr: u64,
}

/// Reads `_PyRuntime` and `Py_Version` from an ELF image.
pub fn exports(data: &[u8]) -> Option<Exports> {
    let file = object::File::parse(data).ok()?;
    let mut found = Exports {
        first_load_vaddr: file.segments().map(|s| s.address()).min().unwrap_or(0),
        ..Exports::default()
    };
    for symbol in file.dynamic_symbols().chain(file.symbols()) {
        if symbol.is_undefined() {
            continue;
        }
        match symbol.name() {
            Ok("_PyRuntime") if found.runtime_vaddr.is_none() => {
                found.runtime_vaddr = Some(symbol.address());
            }
            Ok("Py_Version") if found.version_hex.is_none() => {
                found.version_hex = symbol
                    .section_index()
                    .and_then(|i| file.section_by_index(i).ok())
                    .and_then(|section| {
                        let at = symbol.address().checked_sub(section.address())?;
                        let bytes = section.data().ok()?;
                        let raw = bytes.get(usize::try_from(at).ok()?..)?.get(..4)?;
                        Some(u32::from_le_bytes(raw.try_into().ok()?))
                    });
            }
            _ => {}
        }
    }
    Some(found)
}

/// `(3, X)` from a name such as `libpython3.12.so.1.0` or `python3.11`.
pub fn version_from_name(path: &Path) -> Option<(u32, u32)> {
    let name = path.file_name()?.to_str()?;
    let rest = name
        .strip_prefix("libpython")
        .or_else(|| name.strip_prefix("python"))?;
    let mut parts = rest.split(['.', 'd', 'm', 't', '_']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Whether an object is worth opening when looking for the interpreter.
fn candidate(path: &Path, exe: Option<&Path>) -> bool {
    exe == Some(path)
        || path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libpython"))
}

/// Load bias of `path` in the process: where its lowest segment was mapped
/// minus its link-time address.
fn load_bias(mappings: &[Mapping], path: &Path, first_load_vaddr: u64) -> Option<u64> {
    let lowest = mappings
        .iter()
        .filter(|m| m.path.as_deref() == Some(path) && m.file_offset == 0)
        .map(|m| m.start)
        .min()?;
    Some(lowest.wrapping_sub(first_load_vaddr & !0xfff))
}

/// What each object file exports, read once per file (device, inode): one
/// interpreter image shared by many containers is read once.
pub type ExportCache = std::collections::HashMap<(u64, u64), Option<Exports>>;

/// Looks for a CPython interpreter in process `pid`.
pub fn find(pid: u32, cache: &mut ExportCache) -> std::io::Result<Option<Found>> {
    let mappings = maps::read(pid)?;
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
    Ok(find_in(pid, &mappings, exe.as_deref(), cache))
}

/// [`find`] over mappings already read.
pub fn find_in(
    pid: u32,
    mappings: &[Mapping],
    exe: Option<&Path>,
    cache: &mut ExportCache,
) -> Option<Found> {
    for mapping in maps::executable_file_mappings(mappings) {
        let Some(path) = mapping.path.clone() else {
            continue;
        };
        if !candidate(&path, exe) {
            continue;
        }
        let exports = cache
            .entry((mapping.dev, mapping.inode))
            .or_insert_with(|| {
                // As the target sees it (a container's file), checked.
                let open = crate::tracee::files::open(pid, mapping).ok()?;
                exports(&std::fs::read(open).ok()?)
            })
            .clone();
        let Some(exports) = exports else {
            continue;
        };
        let Some(runtime_vaddr) = exports.runtime_vaddr else {
            continue;
        };
        let (major, minor) = match exports.version_hex {
            Some(hex) => (hex >> 24, (hex >> 16) & 0xff),
            None => match version_from_name(&path) {
                Some(version) => version,
                None => continue,
            },
        };
        let Some(bias) = load_bias(mappings, &path, exports.first_load_vaddr) else {
            continue;
        };
        return Some(Found {
            object: path,
            major,
            minor,
            version_hex: exports.version_hex,
            runtime: runtime_vaddr.wrapping_add(bias),
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_from_names() {
        let v = |s: &str| version_from_name(Path::new(s));
        assert_eq!(v("/usr/lib/libpython3.12.so.1.0"), Some((3, 12)));
        assert_eq!(v("/usr/bin/python3.11"), Some((3, 11)));
        assert_eq!(v("libpython3.13t.so"), Some((3, 13)));
        assert_eq!(v("libpython3.8d.so"), Some((3, 8)));
        assert_eq!(v("/usr/bin/python3"), None);
        assert_eq!(v("/usr/bin/perl"), None);
    }

    #[test]
    fn bias_of_a_shared_object_and_a_fixed_executable() {
        let maps = crate::tracee::maps::parse(
            "400000-401000 r--p 00000000 fe:01 7 /usr/bin/python3.11\n\
             7f0000000000-7f0000001000 r--p 00000000 fe:01 8 /lib/libpython3.12.so.1.0\n\
             7f0000001000-7f0000100000 r-xp 00001000 fe:01 8 /lib/libpython3.12.so.1.0\n",
        );
        assert_eq!(
            load_bias(&maps, Path::new("/usr/bin/python3.11"), 0x400000),
            Some(0)
        );
        assert_eq!(
            load_bias(&maps, Path::new("/lib/libpython3.12.so.1.0"), 0),
            Some(0x7f00_0000_0000)
        );
        assert_eq!(load_bias(&maps, Path::new("/nope"), 0), None);
    }

    #[test]
    fn non_elf_bytes_export_nothing() {
        assert_eq!(exports(b"not an elf file at all"), None);
    }

    /// The interpreters on this machine (pyenv's shared libpython, Debian's
    /// static `python3.11`) export what detection needs. Skips what is not
    /// installed.
    #[test]
    fn real_interpreters_export_the_runtime() {
        let mut candidates: Vec<PathBuf> = vec![PathBuf::from("/usr/bin/python3.11")];
        if let Ok(root) = std::env::var("HOME").map(|h| PathBuf::from(h).join(".pyenv/versions")) {
            for v in ["3.11.7", "3.12.1", "3.13.0"] {
                let lib = root.join(v).join("lib");
                if let Ok(dir) = std::fs::read_dir(&lib) {
                    for entry in dir.flatten() {
                        let name = entry.file_name().to_string_lossy().into_owned();
                        // libpython3.so is the stable-ABI forwarder.
                        if version_from_name(Path::new(&name)).is_some() && name.contains(".so") {
                            candidates.push(entry.path());
                        }
                    }
                }
            }
        }
        for path in candidates {
            let Ok(data) = std::fs::read(&path) else {
                eprintln!("skipping {}: not installed", path.display());
                continue;
            };
            let found = exports(&data).expect("ELF");
            assert!(found.runtime_vaddr.is_some(), "{}", path.display());
            let hex = found.version_hex.expect("3.11+ exports Py_Version");
            assert_eq!(hex >> 24, 3, "{}", path.display());
        }
    }
}
