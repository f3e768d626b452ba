//! `/proc/PID/maps`: one line per mapping, parsed. The lowest floor of the
//! target's address space: [`super::files`] and [`crate::probe::maps`] both
//! build on it.

use std::path::PathBuf;

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub readable: bool,
    pub writable: bool,
    pub executable: bool,
    /// Mapped shared (`s` in the permissions), not private.
    pub shared: bool,
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
        writable: perms.as_bytes().get(1) == Some(&b'w'),
        executable: perms.as_bytes().get(2) == Some(&b'x'),
        shared: perms.as_bytes().get(3) == Some(&b's'),
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

/// Reads and parses `/proc/PID/maps`, nothing more.
pub fn read_raw(pid: u32) -> std::io::Result<Vec<Mapping>> {
    Ok(parse(&std::fs::read_to_string(format!(
        "/proc/{pid}/maps"
    ))?))
}
