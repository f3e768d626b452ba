//! The symbols a record carries (`object` and `sym` lines), answering
//! replay's lookups as the trace that wrote it did: a frame of a recorded
//! object is answered from the record only, never from this host's file
//! of that name (in a container, another file); a frame the recorder could
//! not symbolize stays unnamed. Only frames of objects the record has no
//! symbols for (an older memtrace's record, or one cut before its end) are
//! looked up in this host's files. Both are counted and said in notes.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::probe::maps::FileAddr;
use crate::symbolize::{BlazeSymbolizer, SymInfo, Symbolize};

/// How many object paths a note names.
const NAMED: usize = 3;

/// Replay's symbolizer: the record's answers first, this host's files for
/// objects it has none for.
pub struct Carried {
    /// Each recorded address's answer (`None`: its object was unreadable).
    symbols: HashMap<FileAddr, Option<SymInfo>>,
    /// The objects the record carries symbols for.
    objects: HashSet<PathBuf>,
    host: BlazeSymbolizer,
    /// Addresses looked up in this host's files.
    from_host: BTreeSet<FileAddr>,
    /// Addresses of recorded objects left unnamed: unreadable while
    /// recording (or, in a damaged record, not among its `sym` lines).
    unsymbolized: BTreeSet<FileAddr>,
}

impl Default for Carried {
    fn default() -> Self {
        Carried {
            symbols: HashMap::new(),
            objects: HashSet::new(),
            host: BlazeSymbolizer::new(Box::new(|p| Some(p.to_path_buf()))),
            from_host: BTreeSet::new(),
            unsymbolized: BTreeSet::new(),
        }
    }
}

impl Carried {
    /// A recorded object (its `object` line).
    pub fn object(&mut self, path: PathBuf) {
        self.objects.insert(path);
    }

    /// A recorded answer (a `sym` line).
    pub fn sym(&mut self, addr: FileAddr, info: Option<SymInfo>) {
        self.objects.insert(addr.module.clone());
        self.symbols.insert(addr, info);
    }

    /// What the report says of the frames not answered as the trace did.
    pub fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        if !self.from_host.is_empty() {
            notes.push(format!(
                "{} frame address(es) in {} were symbolized from this host's files (the record carries no symbols for them: written by an older memtrace, or cut short) and may differ from the live trace's",
                self.from_host.len(),
                objects(&self.from_host)
            ));
        }
        if !self.unsymbolized.is_empty() {
            notes.push(format!(
                "{} frame address(es) in {} could not be symbolized while recording (the object could not be read then): shown unnamed, not looked up in this host's files",
                self.unsymbolized.len(),
                objects(&self.unsymbolized)
            ));
        }
        notes
    }
}

/// "N object(s) (a, b, c, ...)" for the modules of `addrs`.
fn objects(addrs: &BTreeSet<FileAddr>) -> String {
    let modules: BTreeSet<&Path> = addrs.iter().map(|a| a.module.as_path()).collect();
    let named: Vec<String> = modules
        .iter()
        .take(NAMED)
        .map(|m| m.display().to_string())
        .collect();
    format!(
        "{} object(s) ({}{})",
        modules.len(),
        named.join(", "),
        if modules.len() > NAMED { ", ..." } else { "" }
    )
}

impl Symbolize for Carried {
    fn symbolize(&mut self, addrs: &[FileAddr]) -> Vec<SymInfo> {
        let on_host: Vec<FileAddr> = addrs
            .iter()
            .filter(|a| !self.objects.contains(&a.module))
            .cloned()
            .collect();
        let mut from_host: HashMap<FileAddr, SymInfo> = on_host
            .iter()
            .cloned()
            .zip(self.host.symbolize(&on_host))
            .collect();
        self.from_host.extend(on_host);
        addrs
            .iter()
            .map(|addr| {
                if let Some(info) = from_host.remove(addr) {
                    return info;
                }
                match self.symbols.get(addr) {
                    Some(Some(info)) => info.clone(),
                    _ => {
                        self.unsymbolized.insert(addr.clone());
                        SymInfo::default()
                    }
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(module: &str, file_offset: u64) -> FileAddr {
        FileAddr {
            module: module.into(),
            file_offset,
        }
    }

    #[test]
    fn recorded_objects_are_answered_from_the_record_only() {
        let exe = std::env::current_exe().expect("test binary");
        let exe = exe.to_str().expect("utf-8 path");
        let mut carried = Carried::default();
        let named = SymInfo {
            symbol: Some("leak_a".into()),
            file: Some("leak.c".into()),
            line: Some(12),
            inlined: Vec::new(),
        };
        // This test binary is a readable file here: a recorded object is
        // still not looked up in it.
        carried.object(exe.into());
        carried.sym(at(exe, 0x40), Some(named.clone()));
        carried.sym(at("/gone/libx.so", 0x10), None);
        let answers = carried.symbolize(&[
            at(exe, 0x40),
            at("/gone/libx.so", 0x10),
            at(exe, 0x41),
            at(exe, 0x40),
        ]);
        assert_eq!(
            answers,
            [named.clone(), SymInfo::default(), SymInfo::default(), named]
        );
        let notes = carried.notes();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].starts_with("2 frame address(es) in 2 object(s)")
                && notes[0].contains("could not be symbolized while recording"),
            "{notes:?}"
        );
    }

    #[test]
    fn objects_the_record_has_no_symbols_for_are_read_here_and_said() {
        let mut carried = Carried::default();
        let answers = carried.symbolize(&[at("/nonexistent/old.so", 0x10)]);
        assert_eq!(answers, [SymInfo::default()]);
        let notes = carried.notes();
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(
            notes[0].starts_with("1 frame address(es) in 1 object(s) (/nonexistent/old.so)")
                && notes[0].contains("symbolized from this host's files"),
            "{notes:?}"
        );
    }
}
