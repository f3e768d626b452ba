//! Reading ELF files: which catalogue functions a file *defines*, at which file
//! offset (what uprobes attach to), the first bytes of each (for probe
//! placement), and which symbol each PLT stub jumps to (to recognise a
//! function that only forwards to another, such as `operator delete` to
//! `free@plt`), on x86-64 and arm64 alike. An object of another
//! architecture than the one traced is refused by name
//! ([`ElfError::ForeignArch`]): its code is not the process's to probe.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use iced_x86::{Code, Decoder, DecoderOptions};

use crate::arch::Arch;
use object::{
    Object, ObjectSection, ObjectSymbol, ObjectSymbolTable, ReadRef, RelocationTarget, SymbolKind,
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
    #[error("{path} is an {machine} object, not {arch}: not probed")]
    ForeignArch {
        path: PathBuf,
        machine: String,
        arch: Arch,
    },
}

/// An ELF object's `e_machine`, read from its header.
pub fn e_machine(data: &[u8]) -> Option<u16> {
    if data.get(..4)? != b"\x7fELF" {
        return None;
    }
    let bytes = [*data.get(18)?, *data.get(19)?];
    match data.get(5)? {
        1 => Some(u16::from_le_bytes(bytes)),
        2 => Some(u16::from_be_bytes(bytes)),
        _ => None,
    }
}

/// A name for an `e_machine`, for messages.
pub fn machine_name(machine: u16) -> String {
    if let Some(arch) = Arch::from_elf_machine(machine) {
        return arch.name().to_string();
    }
    match machine {
        3 => "i386".into(),
        8 => "mips".into(),
        20 => "ppc".into(),
        21 => "ppc64".into(),
        22 => "s390".into(),
        40 => "arm".into(),
        243 => "riscv".into(),
        258 => "loongarch".into(),
        other => format!("e_machine {other}"),
    }
}

/// Checks that the ELF object in `data` (read from `path`) is of `arch`.
pub fn check_arch(path: &Path, data: &[u8], arch: Arch) -> Result<(), ElfError> {
    match e_machine(data) {
        Some(machine) if Arch::from_elf_machine(machine) == Some(arch) => Ok(()),
        Some(machine) => Err(ElfError::ForeignArch {
            path: path.to_path_buf(),
            machine: machine_name(machine),
            arch,
        }),
        // Not ELF: parsing says so.
        None => Ok(()),
    }
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
/// its PLT stubs. The file must be an `arch` object.
///
/// Only what it needs is read (headers, symbol tables, the functions' first
/// bytes, the PLT): a PyTorch process maps gigabytes of code.
pub fn scan(path: &Path, wanted: &[&str], arch: Arch) -> Result<Defined, ElfError> {
    let io = |source| ElfError::Io {
        path: path.to_path_buf(),
        source,
    };
    let handle = std::fs::File::open(path).map_err(io)?;
    let data = object::ReadCache::new(handle);
    let len = data
        .len()
        .map_err(|()| io(std::io::Error::other("cannot read its size")))?;
    let header = data.read_bytes_at(0, len.min(64)).unwrap_or(&[]);
    check_arch(path, header, arch)?;
    let file = object::File::parse(&data).map_err(|source| ElfError::NotElf {
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
        let window = match usize::try_from(symbol.size()) {
            Ok(0) | Err(_) => super::placement::WINDOW,
            Ok(size) => size.min(super::placement::WINDOW),
        };
        let window = (window as u64).min(len.saturating_sub(file_offset));
        let code = data
            .read_bytes_at(file_offset, window)
            .unwrap_or(&[])
            .to_vec();
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
        match arch {
            Arch::X86_64 => plt_stubs(&file),
            Arch::Aarch64 => arm64_plt_stubs(&file),
        }
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

/// GOT slot address -> the symbol its dynamic relocation names (without version).
fn got_slots<'d, R: ReadRef<'d>>(file: &object::File<'d, R>) -> HashMap<u64, String> {
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
    slots
}

/// Maps each x86-64 PLT stub (`.plt`, `.plt.sec`, `.plt.got`) to the symbol whose
/// GOT slot it jumps through (`jmp qword [rip+disp]`).
fn plt_stubs<'d, R: ReadRef<'d>>(file: &object::File<'d, R>) -> HashMap<u64, String> {
    let slots = got_slots(file);
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

/// Maps each arm64 PLT stub (`.plt`) to the symbol whose GOT slot it jumps
/// through: `adrp x16, PAGE; ldr x17, [x16, #OFF]; add x16, x16, #OFF;
/// br x17` (a `bti c` before it starts the stub where BTI is on; an
/// `autia1716` may sit before the `br`).
fn arm64_plt_stubs<'d, R: ReadRef<'d>>(file: &object::File<'d, R>) -> HashMap<u64, String> {
    let slots = got_slots(file);
    let mut stubs = HashMap::new();
    if slots.is_empty() {
        return stubs;
    }
    for section in file.sections() {
        if section.name().ok() != Some(".plt") {
            continue;
        }
        let Ok(bytes) = section.data() else { continue };
        let words: Vec<u32> = bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        for i in 0..words.len() {
            let address = section.address().wrapping_add(4 * i as u64);
            let Some(name) = arm64_plt_slot(address, &words[i..]).and_then(|s| slots.get(&s))
            else {
                continue;
            };
            stubs.insert(address, name.clone());
            if i > 0 && words[i - 1] == ARM64_BTI_C {
                stubs.insert(address.wrapping_sub(4), name.clone());
            }
        }
    }
    stubs
}

const ARM64_BTI_C: u32 = 0xd503_245f;

/// The GOT slot an arm64 PLT stub starting at `address` with `words`
/// jumps through, if they are one.
fn arm64_plt_slot(address: u64, words: &[u32]) -> Option<u64> {
    let adrp = *words.first()?;
    let ldr = *words.get(1)?;
    // adrp x16, PAGE
    if adrp & 0x9f00_001f != 0x9000_0010 {
        return None;
    }
    // ldr x17, [x16, #OFF]
    if ldr & 0xffc0_03ff != 0xf940_0211 {
        return None;
    }
    // br x17 within the next three words (after add x16, maybe autia1716).
    if !words.iter().skip(2).take(3).any(|w| *w == 0xd61f_0220) {
        return None;
    }
    let pages = (((adrp >> 5) & 0x7ffff) << 2) | ((adrp >> 29) & 3);
    let pages = (i64::from(pages) << 43) >> 43;
    let page = (address & !0xfff).wrapping_add_signed(pages.wrapping_mul(4096));
    Some(page.wrapping_add(u64::from((ldr >> 10) & 0xfff) * 8))
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
        let found = scan(&libc, &["malloc", "free", "no_such_function"], Arch::HOST)
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
        let defined = scan(&lib, &["_ZdlPv"], Arch::HOST).expect("readable");
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
        let err = scan(&path, &["malloc"], Arch::HOST).expect_err("not ELF");
        assert!(err.to_string().contains("not an ELF object"), "{err}");
        let missing = scan(&dir.join("missing.so"), &["malloc"], Arch::HOST).expect_err("missing");
        assert!(missing.to_string().contains("cannot read"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn arm64_plt_stubs_name_their_targets() {
        let lib = Path::new("/usr/aarch64-linux-gnu/lib/libstdc++.so.6");
        assert!(lib.exists(), "apt-get install gcc-aarch64-linux-gnu");
        let defined = scan(lib, &["_ZdlPv"], Arch::Aarch64).expect("readable");
        // aarch64-linux-gnu-objdump -d: `000000000009d1e0 <free@plt>:`
        assert_eq!(defined.plt.get(&0x9d1e0).map(String::as_str), Some("free"));
        assert!(defined.plt.len() > 100, "{}", defined.plt.len());
        let err = scan(lib, &["_ZdlPv"], Arch::X86_64).expect_err("foreign");
        assert!(matches!(err, ElfError::ForeignArch { .. }), "{err}");
        assert!(err
            .to_string()
            .ends_with("is an aarch64 object, not x86_64: not probed"));
    }

    #[test]
    fn arm64_plt_slot_arithmetic() {
        // free@plt of the arm64 libstdc++ at 0x9d1e0:
        // adrp x16, 0x211000; ldr x17, [x16, #3248]; add x16, x16, #0xcb0; br x17
        let stub = [0x9000_0bb0, 0xf946_5a11, 0x9132_c210, 0xd61f_0220];
        assert_eq!(arm64_plt_slot(0x9d1e0, &stub), Some(0x211000 + 3248));
        // Not a stub without the `br x17`, or with another register.
        assert_eq!(arm64_plt_slot(0x9d1e0, &stub[..3]), None);
        assert_eq!(
            arm64_plt_slot(
                0x9d1e0,
                &[0x9000_0bb1, 0xf946_5a11, 0x9132_c210, 0xd61f_0220]
            ),
            None
        );
    }

    #[test]
    fn machines_of_elf_headers() {
        let mut header = vec![0u8; 64];
        header[..4].copy_from_slice(b"\x7fELF");
        header[5] = 1;
        header[18..20].copy_from_slice(&183u16.to_le_bytes());
        assert_eq!(e_machine(&header), Some(183));
        header[18..20].copy_from_slice(&40u16.to_le_bytes());
        let err = check_arch(Path::new("/x/lib.so"), &header, Arch::Aarch64).expect_err("arm32");
        assert_eq!(
            err.to_string(),
            "/x/lib.so is an arm object, not aarch64: not probed"
        );
        assert_eq!(e_machine(b"hello"), None);
        assert_eq!(machine_name(62), "x86_64");
        assert_eq!(machine_name(9999), "e_machine 9999");
    }
}
