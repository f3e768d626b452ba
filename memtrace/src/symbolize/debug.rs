//! Separate debug files (`libc6-dbg`, `*-dbgsym`), found for the object
//! itself: by the build-id read from the very file the target maps, under
//! `.build-id/` of the debug directories inside the target's root first,
//! then on the host; a candidate is used only when its own build-id is the
//! object's. Never by a path that merely names the object: a container's
//! `/proc/PID/root/usr/lib/.../libc.so.6` canonicalizes to the host's libc,
//! whose debug file belongs to another build.
//!
//! Also what maps the object's file offsets to the virtual offsets a debug
//! file's symbols and DWARF are keyed by (its `PT_LOAD` segments).

use std::fs::File;
use std::path::{Path, PathBuf};

use object::{Object, ObjectSegment};

/// Where distributions install debug files, as a process sees them.
pub const DEBUG_DIRS: &[&str] = &["/usr/lib/debug", "/lib/debug"];

/// Why an object file could not be read for its debug file: the errors of
/// reading any ELF object (`probe::elf`).
pub use crate::probe::elf::ElfError as DebugError;

/// One loadable segment: `size` bytes at file `offset` mapped at `vaddr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Load {
    offset: u64,
    size: u64,
    vaddr: u64,
}

/// What is read of an object file to find and use its debug file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObjectInfo {
    pub build_id: Option<Vec<u8>>,
    loads: Vec<Load>,
}

impl ObjectInfo {
    /// Reads the build-id note and the loadable segments of the file at `path`.
    pub fn read(path: &Path) -> Result<ObjectInfo, DebugError> {
        let file = File::open(path).map_err(|source| DebugError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let cache = object::ReadCache::new(file);
        let elf = object::File::parse(&cache).map_err(|source| DebugError::NotElf {
            path: path.to_path_buf(),
            source,
        })?;
        let build_id = elf
            .build_id()
            .map_err(|source| DebugError::NotElf {
                path: path.to_path_buf(),
                source,
            })?
            .map(<[u8]>::to_vec);
        let loads = elf
            .segments()
            .map(|segment| {
                let (offset, size) = segment.file_range();
                Load {
                    offset,
                    size,
                    vaddr: segment.address(),
                }
            })
            .collect();
        Ok(ObjectInfo { build_id, loads })
    }

    /// The virtual offset (the address in the object's own address space)
    /// of file offset `offset`; `None` outside every loadable segment.
    pub fn virt_offset(&self, offset: u64) -> Option<u64> {
        self.loads
            .iter()
            .find(|load| offset >= load.offset && offset - load.offset < load.size)
            .map(|load| load.vaddr + (offset - load.offset))
    }

    /// The file offset of virtual offset `vaddr`, for tests that take
    /// addresses from a debug file's symbols.
    #[cfg(test)]
    pub fn file_offset(&self, vaddr: u64) -> Option<u64> {
        self.loads
            .iter()
            .find(|load| vaddr >= load.vaddr && vaddr - load.vaddr < load.size)
            .map(|load| load.offset + (vaddr - load.vaddr))
    }
}

/// `.build-id/ab/cdef....debug`, the path of a debug file under a debug
/// directory; `None` for a build-id too short to be real.
pub fn build_id_path(build_id: &[u8]) -> Option<PathBuf> {
    let (first, rest) = build_id.split_first()?;
    if rest.len() < 4 {
        return None;
    }
    let rest: String = rest.iter().map(|byte| format!("{byte:02x}")).collect();
    Some(
        Path::new(".build-id")
            .join(format!("{first:02x}"))
            .join(format!("{rest}.debug")),
    )
}

/// The first of `candidates` whose build-id is `build_id`: a debug file
/// carries its object's build-id note, so another build is never used.
pub fn first_matching(
    build_id: &[u8],
    candidates: impl IntoIterator<Item = PathBuf>,
) -> Option<PathBuf> {
    candidates.into_iter().find(|candidate| {
        match ObjectInfo::read(candidate) {
            Ok(info) if info.build_id.as_deref() == Some(build_id) => true,
            Ok(_) => {
                log::debug!(
                    "{} is named for build-id {} but is another build: not used",
                    candidate.display(),
                    hex(build_id)
                );
                false
            }
            // Absent (the usual case) or unreadable.
            Err(err) => {
                log::trace!("no debug file: {err}");
                false
            }
        }
    })
}

/// A build-id as it is written (`readelf -n`, `.build-id/` paths).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_id_paths_split_the_first_byte() {
        assert_eq!(
            build_id_path(&[0x93, 0xac, 0x61, 0xec, 0x5a]),
            Some(PathBuf::from(".build-id/93/ac61ec5a.debug"))
        );
        assert_eq!(build_id_path(&[0x93, 0xac]), None);
        assert_eq!(build_id_path(&[]), None);
    }

    #[test]
    fn file_offsets_map_through_the_loadable_segments() {
        let info = ObjectInfo {
            build_id: None,
            loads: vec![
                Load {
                    offset: 0,
                    size: 0x600,
                    vaddr: 0,
                },
                Load {
                    offset: 0x1000,
                    size: 0x200,
                    vaddr: 0x401000,
                },
            ],
        };
        assert_eq!(info.virt_offset(0x10), Some(0x10));
        assert_eq!(info.virt_offset(0x1010), Some(0x401010));
        assert_eq!(info.virt_offset(0x1200), None);
        assert_eq!(info.virt_offset(0x800), None);
    }
}
