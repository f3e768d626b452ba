//! What a dynamically linked ELF binary needs of the C library: the symbol
//! versions it references (`.gnu.version_r`, `GLIBC_2.25`, ...) and its
//! `DT_NEEDED` libraries, read with the `object` crate. `cargo xtask dist`
//! refuses a binary that needs a glibc newer than the baseline.

use std::path::Path;

use anyhow::{bail, Context, Result};
use object::read::elf::{Dyn, ElfFile64, FileHeader};
use object::{Endianness, Object};

/// The libraries and symbol versions one binary needs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// `DT_NEEDED` entries (`libc.so.6`, ...); empty for a static binary.
    pub libraries: Vec<String>,
    /// `(library, version)` pairs from `.gnu.version_r`.
    pub versions: Vec<(String, String)>,
}

impl Needs {
    /// The newest `GLIBC_x.y` any library is asked for.
    pub fn newest_glibc(&self) -> Option<(u32, u32)> {
        self.versions
            .iter()
            .filter_map(|(_, version)| glibc_version(version))
            .max()
    }
}

/// `GLIBC_2.25` -> (2, 25); `GLIBC_PRIVATE` and others -> None.
pub fn glibc_version(name: &str) -> Option<(u32, u32)> {
    let rest = name.strip_prefix("GLIBC_")?;
    let mut parts = rest.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next().map_or(Some(0), |m| m.parse().ok())?;
    Some((major, minor))
}

/// Reads what `path` needs.
pub fn glibc_needs(path: &Path) -> Result<Needs> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&data).with_context(|| format!("parsing {}", path.display()))
}

fn parse(data: &[u8]) -> Result<Needs> {
    let elf = ElfFile64::<Endianness>::parse(data)?;
    let endian = elf.endian();
    let sections = elf.elf_section_table();
    let mut needs = Needs::default();
    if let Some((mut verneeds, link)) = sections.gnu_verneed(endian, data)? {
        let strings = sections.strings(endian, data, link)?;
        while let Some((verneed, mut auxes)) = verneeds.next()? {
            let library = String::from_utf8_lossy(verneed.file(endian, strings)?).into_owned();
            while let Some(aux) = auxes.next()? {
                let version = String::from_utf8_lossy(aux.name(endian, strings)?).into_owned();
                needs.versions.push((library.clone(), version));
            }
        }
    }
    if let Some((entries, link)) = sections.dynamic(endian, data)? {
        let strings = sections.strings(endian, data, link)?;
        for entry in entries {
            if entry.tag32(endian) == Some(object::elf::DT_NEEDED) {
                let offset = u32::try_from(entry.d_val(endian)).context("DT_NEEDED offset")?;
                let name = strings
                    .get(offset)
                    .map_err(|()| anyhow::anyhow!("a DT_NEEDED name out of bounds"))?;
                needs
                    .libraries
                    .push(String::from_utf8_lossy(name).into_owned());
            }
        }
    }
    // Touch the header so a truncated file fails here, not later.
    let _ = elf.elf_header().e_machine(endian);
    let _ = elf.architecture();
    Ok(needs)
}

/// Fails when `needs` asks for a glibc newer than `baseline`.
pub fn check_baseline(path: &Path, needs: &Needs, baseline: (u32, u32)) -> Result<()> {
    let newer: Vec<String> = needs
        .versions
        .iter()
        .filter(|(_, v)| glibc_version(v).is_some_and(|v| v > baseline))
        .map(|(lib, v)| format!("{v} ({lib})"))
        .collect();
    if !newer.is_empty() {
        bail!(
            "{} needs a glibc newer than {}.{}: {}",
            path.display(),
            baseline.0,
            baseline.1,
            newer.join(", ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_versions_parse_and_order() {
        assert_eq!(glibc_version("GLIBC_2.25"), Some((2, 25)));
        assert_eq!(glibc_version("GLIBC_2.2.5"), Some((2, 2)));
        assert_eq!(glibc_version("GLIBC_2.3"), Some((2, 3)));
        assert_eq!(glibc_version("GLIBC_PRIVATE"), None);
        assert_eq!(glibc_version("GCC_3.0"), None);
        assert!(glibc_version("GLIBC_2.9") < glibc_version("GLIBC_2.25"));
    }

    /// This test binary is linked by the host's toolchain: it needs libc
    /// and some glibc version, which the reader must find.
    #[test]
    fn reads_this_test_binarys_needs() {
        let exe = std::env::current_exe().expect("test binary");
        let needs = glibc_needs(&exe).expect("parses");
        assert!(
            needs.libraries.iter().any(|l| l.starts_with("libc.so")),
            "{needs:?}"
        );
        let newest = needs.newest_glibc().expect("a GLIBC_ version");
        assert!(newest >= (2, 2), "{newest:?}");
        assert!(check_baseline(&exe, &needs, newest).is_ok());
        let older = (newest.0, newest.1 - 1);
        let err = check_baseline(&exe, &needs, older).expect_err("newer than the baseline");
        assert!(
            err.to_string().contains("needs a glibc newer than"),
            "{err}"
        );
    }

    #[test]
    fn a_non_elf_file_is_an_error() {
        assert!(parse(b"#!/bin/sh\necho not elf\n").is_err());
    }
}
