//! `/proc/PID/maps` for the probes: reading it (and noting where each file
//! can be opened as the target sees it), and turning a process address into
//! (module, file offset) — the normalized form stacks are kept in, so they can
//! be symbolized after the target is gone. The parsing itself is
//! [`crate::tracee::maps`], below both this and [`crate::tracee::files`].

use std::path::{Path, PathBuf};

pub use crate::tracee::maps::{read_raw, Mapping};

/// Reads and parses `/proc/PID/maps`, and notes where each file mapped can
/// be opened as the target sees it ([`crate::tracee::files`]): the moment
/// its maps are read, the process is known to map them.
pub fn read(pid: u32) -> std::io::Result<Vec<Mapping>> {
    let mappings = read_raw(pid)?;
    crate::tracee::files::observe(pid, &mappings);
    Ok(mappings)
}

/// The first executable mapping of each distinct file (by device and
/// inode), in first-seen order.
pub fn executable_file_mappings(mappings: &[Mapping]) -> Vec<&Mapping> {
    let mut seen = std::collections::HashSet::new();
    mappings
        .iter()
        .filter(|m| m.executable && m.is_file() && seen.insert((m.dev, m.inode)))
        .collect()
}

/// The distinct files mapped executable, in first-seen order.
#[cfg(test)]
pub fn executable_files(mappings: &[Mapping]) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = Vec::new();
    for mapping in mappings.iter().filter(|m| m.executable && m.is_file()) {
        if let Some(path) = &mapping.path {
            if !files.contains(path) {
                files.push(path.clone());
            }
        }
    }
    files
}

/// A sorted snapshot of a process's executable file mappings, for
/// normalizing code addresses (a return address lies in code: a data
/// mapping, such as `/etc/ld.so.cache` that ld.so maps and unmaps before a
/// library takes its place, never names a frame).
#[derive(Clone, Debug, Default)]
pub struct AddressSpace {
    ranges: Vec<Mapping>,
}

/// An address normalized to the file it came from.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileAddr {
    pub module: PathBuf,
    pub file_offset: u64,
}

impl AddressSpace {
    pub fn new(mut mappings: Vec<Mapping>) -> Self {
        mappings.retain(|m| m.is_file() && m.executable);
        mappings.sort_by_key(|m| m.start);
        AddressSpace { ranges: mappings }
    }

    /// The file and file offset `addr` falls in, if it is file-backed.
    pub fn normalize(&self, addr: u64) -> Option<FileAddr> {
        let index = self.ranges.partition_point(|m| m.start <= addr);
        let mapping = self.ranges.get(index.checked_sub(1)?)?;
        if addr >= mapping.end {
            return None;
        }
        Some(FileAddr {
            module: mapping.path.clone()?,
            file_offset: addr - mapping.start + mapping.file_offset,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }
}

/// The path through which memtrace reads `path` as process `pid` sees it:
/// the file it maps there, checked by device and inode (see
/// [`crate::tracee::files`]); `None` when it cannot be reached (links leading
/// outside its root, another file at that path, the process gone).
pub fn path_in_target_root(pid: u32, path: &Path) -> Option<PathBuf> {
    crate::tracee::files::open_path(pid, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracee::maps::parse;

    const SAMPLE: &str = "\
55d0c0de0000-55d0c0de1000 r--p 00000000 fe:01 1234 /usr/bin/app
55d0c0de1000-55d0c0de3000 r-xp 00001000 fe:01 1234 /usr/bin/app
55d0c1000000-55d0c1021000 rw-p 00000000 00:00 0          [heap]
7f0000000000-7f0000028000 r--p 00000000 fe:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000028000-7f000019d000 r-xp 00028000 fe:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6
7f00001a0000-7f00001a1000 r-xp 00000000 fe:01 77 /tmp/lib with space.so (deleted)
7ffc00000000-7ffc00021000 rw-p 00000000 00:00 0                          [stack]
garbage line
";

    #[test]
    fn parses_lines() {
        let maps = parse(SAMPLE);
        assert_eq!(maps.len(), 7);
        assert_eq!(maps[1].start, 0x55d0c0de1000);
        assert!(maps[1].executable && maps[1].is_file());
        assert!(!maps[2].is_file());
        assert_eq!(
            maps[5].path.as_deref(),
            Some(Path::new("/tmp/lib with space.so"))
        );
        assert!(maps[5].deleted);
    }

    #[test]
    fn lists_executable_files_once() {
        let files = executable_files(&parse(SAMPLE));
        assert_eq!(
            files,
            vec![
                PathBuf::from("/usr/bin/app"),
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/tmp/lib with space.so"),
            ]
        );
    }

    #[test]
    fn reads_through_the_target_root() {
        let me = std::process::id();
        let exe = std::env::current_exe().expect("own exe");
        // Mapped, and the same file at that path here: read there.
        assert_eq!(path_in_target_root(me, &exe), Some(exe.clone()));
        // Not mapped: looked up inside the root.
        let unmapped = path_in_target_root(me, Path::new("/proc/self/status"));
        assert!(unmapped.is_some_and(|p| p.starts_with(format!("/proc/{me}/root"))));
        assert_eq!(
            path_in_target_root(me, Path::new("/nonexistent/x.so")),
            None
        );
    }

    #[test]
    fn one_mapping_per_file() {
        let maps = parse(SAMPLE);
        let files: Vec<u64> = executable_file_mappings(&maps)
            .iter()
            .map(|m| m.inode)
            .collect();
        assert_eq!(files, vec![1234, 99, 77]);
    }

    #[test]
    fn normalizes_addresses() {
        let space = AddressSpace::new(parse(SAMPLE));
        let addr = space.normalize(0x55d0c0de1234).expect("in app");
        assert_eq!(addr.module, PathBuf::from("/usr/bin/app"));
        assert_eq!(addr.file_offset, 0x1234);
        let libc = space.normalize(0x7f0000028010).expect("in libc");
        assert_eq!(libc.file_offset, 0x28010);
        assert_eq!(space.normalize(0x55d0c1000010), None, "heap is not a file");
        assert_eq!(
            space.normalize(0x55d0c0de0010),
            None,
            "a data mapping of a file is not code"
        );
        assert_eq!(space.normalize(0x10), None);
    }
}
