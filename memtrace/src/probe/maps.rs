//! `/proc/PID/maps`: parsing, and turning a process address into
//! (module, file offset) — the normalized form stacks are kept in, so they can
//! be symbolized after the target is gone.

use std::path::{Path, PathBuf};

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub readable: bool,
    pub executable: bool,
    pub file_offset: u64,
    /// Device of the backing file (`major << 20 | minor`, as the kernel packs it).
    pub dev: u64,
    pub inode: u64,
    /// Path as the target sees it; `None` for anonymous mappings.
    pub path: Option<PathBuf>,
    /// The file was deleted after it was mapped.
    pub deleted: bool,
}

impl Mapping {
    /// Whether this mapping is backed by a file (not `[heap]`, `[vdso]`, anonymous).
    pub fn is_file(&self) -> bool {
        self.inode != 0 && self.path.as_ref().is_some_and(|p| p.is_absolute())
    }
}

/// Parses the text of `/proc/PID/maps`; malformed lines are skipped.
pub fn parse(text: &str) -> Vec<Mapping> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Mapping> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?;
    let offset = fields.next()?;
    let dev = fields.next()?;
    let inode = fields.next()?;
    let rest = fields.next().unwrap_or("").trim_start();
    let (start, end) = range.split_once('-')?;
    let (path, deleted) = if rest.is_empty() {
        (None, false)
    } else if let Some(stripped) = rest.strip_suffix(" (deleted)") {
        (Some(PathBuf::from(stripped)), true)
    } else {
        (Some(PathBuf::from(rest)), false)
    };
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        readable: perms.as_bytes().first() == Some(&b'r'),
        executable: perms.as_bytes().get(2) == Some(&b'x'),
        file_offset: u64::from_str_radix(offset, 16).ok()?,
        dev: parse_dev(dev)?,
        inode: inode.parse().ok()?,
        path,
        deleted,
    })
}

fn parse_dev(text: &str) -> Option<u64> {
    let (major, minor) = text.split_once(':')?;
    Some((u64::from_str_radix(major, 16).ok()? << 20) | u64::from_str_radix(minor, 16).ok()?)
}

/// Reads and parses `/proc/PID/maps`, and notes where each file mapped can
/// be opened as the target sees it ([`crate::target::files`]): the moment
/// its maps are read, the process is known to map them.
pub fn read(pid: u32) -> std::io::Result<Vec<Mapping>> {
    let mappings = read_raw(pid)?;
    crate::target::files::observe(pid, &mappings);
    Ok(mappings)
}

/// Reads and parses `/proc/PID/maps`, nothing more.
pub fn read_raw(pid: u32) -> std::io::Result<Vec<Mapping>> {
    Ok(parse(&std::fs::read_to_string(format!(
        "/proc/{pid}/maps"
    ))?))
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

/// A sorted snapshot of a process's file mappings, for address normalization.
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
        mappings.retain(Mapping::is_file);
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
/// [`crate::target::files`]); `None` when it cannot be reached (links leading
/// outside its root, another file at that path, the process gone).
pub fn path_in_target_root(pid: u32, path: &Path) -> Option<PathBuf> {
    crate::target::files::open_path(pid, path)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(space.normalize(0x10), None);
    }
}
