//! The C++ type of a block whose first word points into a vtable: the
//! `_ZTV` symbol (in `.symtab` or `.dynsym` of the mapped file) that holds
//! the address, named as a person reads it (`std::basic_ios<char, ...>`).
//! Used to group blocks that have no allocation stack (the heap walk's
//! blocks from before the attach), as chap names its anchors' types.

use std::collections::HashMap;
use std::path::PathBuf;

use object::{Object, ObjectSegment, ObjectSymbol};

use super::maps::Mapping;

/// `_ZTV` symbols of one file: (start, end, name), sorted.
type Table = Vec<(u64, u64, String)>;
/// Loaded segments of one file: (file offset, file size, address).
type Segments = Vec<(u64, u64, u64)>;

/// Names vtable addresses of one process, reading each file once.
pub struct VtableNames<'a> {
    pid: u32,
    mappings: &'a [Mapping],
    tables: HashMap<PathBuf, Option<(Table, Segments)>>,
}

impl<'a> VtableNames<'a> {
    pub fn new(pid: u32, mappings: &'a [Mapping]) -> Self {
        VtableNames {
            pid,
            mappings,
            tables: HashMap::new(),
        }
    }

    /// The type whose vtable holds `addr`, if a symbol says so.
    pub fn type_of(&mut self, addr: u64) -> Option<String> {
        let mapping = self
            .mappings
            .iter()
            .find(|m| m.is_file() && !m.writable && m.start <= addr && addr < m.end)?;
        let path = mapping.path.clone()?;
        let pid = self.pid;
        let entry = self
            .tables
            .entry(path)
            .or_insert_with(|| load(pid, mapping));
        let (table, segments) = entry.as_ref()?;
        let offset = addr - mapping.start + mapping.file_offset;
        let vaddr = segments
            .iter()
            .find(|&&(file_offset, file_size, _)| {
                offset >= file_offset && offset < file_offset + file_size
            })
            .map(|&(file_offset, _, vaddr)| vaddr + (offset - file_offset))?;
        let k = table.partition_point(|(start, _, _)| *start <= vaddr);
        let (start, end, name) = table.get(k.checked_sub(1)?)?;
        (vaddr >= *start && vaddr < *end).then(|| type_name(name))
    }
}

/// The `_ZTV` symbols and the loaded segments (file offset, file size,
/// address) of the file behind `mapping`.
fn load(pid: u32, mapping: &Mapping) -> Option<(Table, Segments)> {
    let path = super::files::open(pid, mapping).ok()?;
    let data = std::fs::read(path).ok()?;
    table_of(&data)
}

/// [`load`] of an ELF image.
pub fn table_of(data: &[u8]) -> Option<(Table, Segments)> {
    let file = object::File::parse(data).ok()?;
    let mut table: Table = file
        .symbols()
        .chain(file.dynamic_symbols())
        .filter_map(|s| {
            let name = s.name().ok()?;
            (name.starts_with("_ZTV") && s.size() > 0)
                .then(|| (s.address(), s.address() + s.size(), name.to_string()))
        })
        .collect();
    table.sort_unstable();
    table.dedup_by_key(|e| e.0);
    let segments = file
        .segments()
        .map(|seg| {
            let (offset, size) = seg.file_range();
            (offset, size, seg.address())
        })
        .collect();
    Some((table, segments))
}

/// `_ZTVSt9basic_iosIcSt11char_traitsIcEE` -> `std::basic_ios<char,
/// std::char_traits<char> >`.
pub fn type_name(symbol: &str) -> String {
    let demangled = cpp_demangle::Symbol::new(symbol)
        .ok()
        .and_then(|s| s.demangle().ok())
        .unwrap_or_else(|| symbol.to_string());
    // cpp_demangle writes `{vtable(T)}`; c++filt `vtable for T`.
    demangled
        .strip_prefix("{vtable(")
        .and_then(|t| t.strip_suffix(")}"))
        .or_else(|| demangled.strip_prefix("vtable for "))
        .map_or(demangled.clone(), str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vtable_symbols_name_their_types() {
        assert_eq!(type_name("_ZTVSt9exception"), "std::exception");
        assert_eq!(type_name("not_mangled"), "not_mangled");
        // libstdc++ exports its classes' vtables.
        let Some(data) = ["/usr/lib/x86_64-linux-gnu/libstdc++.so.6"]
            .iter()
            .find_map(|p| std::fs::read(p).ok())
        else {
            eprintln!("skipping: no libstdc++");
            return;
        };
        let (table, segments) = table_of(&data).expect("an ELF file");
        assert!(!segments.is_empty());
        let exception = table
            .iter()
            .find(|e| e.2 == "_ZTVSt9exception")
            .expect("libstdc++ exports std::exception's vtable");
        assert!(exception.1 > exception.0);
    }
}
