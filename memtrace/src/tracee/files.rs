//! Opening the target's files as the target sees them.
//!
//! `/proc/PID/maps` names each mapped file by its path in the target's mount
//! namespace (`/app/leak` in a container). That path may not exist in
//! memtrace's namespace, or name another file there. Every file memtrace reads
//! for a target (probes, unwind tables, symbols, Python detection) is opened
//! here instead:
//!
//! 1. `/proc/PID/root/PATH` (its symlinks resolved inside that root, as the
//!    target resolves them), accepted when its device and inode are the
//!    mapping's;
//! 2. else `/proc/PID/map_files/START-END`, the kernel's own handle on the
//!    mapped file (accepted when its inode is the mapping's: kernels where
//!    `/proc/PID/maps` shows an overlay file's underlying device report
//!    another `st_dev` for it);
//! 3. else the mapping is unopenable, counted in a note, and nothing is read
//!    for it: never a file that merely shares its path.
//!
//! What was found is kept per file identity (device, inode) for the whole
//! session, so an image shared by a hundred pods is resolved and parsed once,
//! and stays readable after the target exits (symbols are looked up at report
//! time): the host path when the same file sits there, else a descriptor held
//! open and read as `/proc/self/fd/N`.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::maps::{self, Mapping};

/// A file's identity: device (`major << 20 | minor`, as `/proc/PID/maps`
/// prints it) and inode.
pub type FileId = (u64, u64);

/// Descriptors held open for files not reachable from memtrace's own root;
/// beyond this, the `/proc/PID/...` path is kept (readable while the target lives).
const MAX_HELD: usize = 512;

/// Why a mapped file could not be opened as the target sees it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unopenable {
    #[error("the process is gone")]
    Gone,
    #[error("the file at that path is another one (device {found_dev}, inode {found_ino}; mapped: device {dev}, inode {ino})")]
    Mismatch {
        dev: String,
        ino: u64,
        found_dev: String,
        found_ino: u64,
    },
    #[error("{0}")]
    Io(String),
}

/// `st_dev` as `/proc/PID/maps` prints it: `major << 20 | minor`.
pub fn dev_of_stat(st_dev: u64) -> u64 {
    (u64::from(libc::major(st_dev)) << 20) | u64::from(libc::minor(st_dev))
}

/// A packed device as `/proc/PID/maps` writes it (`fe:01`).
pub fn dev_text(dev: u64) -> String {
    format!("{:02x}:{:02x}", dev >> 20, dev & 0xf_ffff)
}

/// A file's identity from its metadata.
pub fn id_of(meta: &std::fs::Metadata) -> FileId {
    (dev_of_stat(meta.dev()), meta.ino())
}

/// Where a mapping's file was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// `/proc/PID/root/PATH`, same device and inode.
    Root,
    /// `/proc/PID/map_files/START-END`.
    MapFiles,
}

/// Whether a candidate with identity `found` is the mapped file `want`
/// reached by `via`.
pub fn accepts(via: Via, want: FileId, found: FileId) -> bool {
    match via {
        Via::Root => found == want,
        // The kernel's own handle on the mapping: only the device may be
        // reported differently (overlayfs on older kernels).
        Via::MapFiles => found.1 == want.1,
    }
}

/// `PATH` inside `/proc/PID/root`, its symlinks resolved as the target
/// resolves them ([`resolve_in_root`]): never onto the host. Errors when
/// the target (or the file) cannot be read.
pub fn inside_root(pid: u32, path: &Path) -> std::io::Result<PathBuf> {
    resolve_in_root(Path::new(&format!("/proc/{pid}/root")), path)
}

/// Symlinks followed on one path before giving up (the kernel's limit).
const MAX_LINKS: usize = 40;

/// `path` as a process whose root is `root` sees it: each symlink read and
/// followed inside `root` (an absolute target starts again at `root`, `..`
/// never climbs above it), so a container's link cannot lead onto the
/// host. Not `canonicalize`: through `/proc/PID/root` it resolves links
/// against memtrace's own root (`/proc/PID/root` reads as `/` once the
/// target has `pivot_root`ed), and the container's files are not found.
/// Returns `root` joined with the resolved path, which exists.
pub fn resolve_in_root(root: &Path, path: &Path) -> std::io::Result<PathBuf> {
    use std::collections::VecDeque;
    use std::path::Component;
    let mut pending: VecDeque<std::ffi::OsString> = VecDeque::new();
    let push_front = |pending: &mut VecDeque<_>, path: &Path| {
        for component in path.components().rev() {
            pending.push_front(component.as_os_str().to_os_string());
        }
    };
    push_front(&mut pending, path);
    let mut resolved = PathBuf::new();
    let mut links = 0;
    while let Some(part) = pending.pop_front() {
        match Path::new(&part).components().next() {
            None | Some(Component::RootDir | Component::CurDir | Component::Prefix(_)) => {}
            Some(Component::ParentDir) => {
                resolved.pop();
            }
            Some(Component::Normal(name)) => {
                let here = root.join(&resolved).join(name);
                if !std::fs::symlink_metadata(&here)?.file_type().is_symlink() {
                    resolved.push(name);
                    continue;
                }
                links += 1;
                if links > MAX_LINKS {
                    return Err(std::io::Error::from_raw_os_error(libc::ELOOP));
                }
                let target = std::fs::read_link(&here)?;
                if target.is_absolute() {
                    resolved.clear();
                }
                push_front(&mut pending, &target);
            }
        }
    }
    let inside = root.join(&resolved);
    std::fs::metadata(&inside)?;
    Ok(inside)
}

/// The mapping's file, opened and checked now (the check is on the opened
/// descriptor: nothing can be swapped in between).
fn open_now(pid: u32, mapping: &Mapping) -> Result<(File, PathBuf, Via), Unopenable> {
    let want = (mapping.dev, mapping.inode);
    let path = mapping.path.as_deref().ok_or(Unopenable::Gone)?;
    let mut why = None;
    if !mapping.deleted {
        match inside_root(pid, path) {
            Ok(inside) => match File::open(&inside).and_then(|f| Ok((f.metadata()?, f))) {
                Ok((meta, file)) if accepts(Via::Root, want, id_of(&meta)) => {
                    return Ok((file, inside, Via::Root))
                }
                Ok((meta, _)) => {
                    let found = id_of(&meta);
                    why = Some(Unopenable::Mismatch {
                        dev: dev_text(want.0),
                        ino: want.1,
                        found_dev: dev_text(found.0),
                        found_ino: found.1,
                    });
                }
                Err(err) => why = Some(Unopenable::Io(err.to_string())),
            },
            Err(err) => why = Some(Unopenable::Io(err.to_string())),
        }
    }
    let handle = PathBuf::from(format!(
        "/proc/{pid}/map_files/{:x}-{:x}",
        mapping.start, mapping.end
    ));
    match File::open(&handle).and_then(|f| Ok((f.metadata()?, f))) {
        Ok((meta, file)) if accepts(Via::MapFiles, want, id_of(&meta)) => {
            Ok((file, handle, Via::MapFiles))
        }
        _ if !std::path::Path::new(&format!("/proc/{pid}")).exists() => Err(Unopenable::Gone),
        Ok(_) => Err(why.unwrap_or(Unopenable::Io("map_files is another file".into()))),
        Err(err) => Err(why.unwrap_or(Unopenable::Io(err.to_string()))),
    }
}

/// A file of the target found, and how to read it from now on.
struct Known {
    /// Path memtrace opens (host path, `/proc/self/fd/N`, or `/proc/PID/...`).
    open: PathBuf,
    /// Held so that `/proc/self/fd/N` stays this file.
    _held: Option<File>,
}

/// Every target file seen this session, by identity.
#[derive(Default)]
struct Registry {
    files: HashMap<FileId, Result<Known, Unopenable>>,
    /// The identities each target path has had (two containers may map
    /// different files at one path).
    by_path: HashMap<PathBuf, Vec<FileId>>,
    held: usize,
    /// Unopenable mappings: path -> why (for the note).
    unopenable: BTreeMap<String, String>,
}

fn registry() -> MutexGuard<'static, Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Registry {
    fn resolve(&mut self, pid: u32, mapping: &Mapping) -> Result<PathBuf, Unopenable> {
        let id = (mapping.dev, mapping.inode);
        let path = mapping.path.clone().ok_or(Unopenable::Gone)?;
        let ids = self.by_path.entry(path.clone()).or_default();
        if !ids.contains(&id) {
            ids.push(id);
        }
        match self.files.get(&id) {
            Some(Ok(known)) => return Ok(known.open.clone()),
            Some(Err(why @ Unopenable::Mismatch { .. })) => return Err(why.clone()),
            // Another process (or a later try) may reach it.
            Some(Err(_)) | None => {}
        }
        let found = match open_now(pid, mapping) {
            Ok((file, proc_path, via)) => {
                log::debug!("pid {pid}: {} read via {via:?}", path.display());
                Ok(self.keep(&path, id, file, proc_path))
            }
            Err(why) => {
                if why != Unopenable::Gone {
                    log::debug!("pid {pid}: {} cannot be opened: {why}", path.display());
                    self.unopenable
                        .insert(path.display().to_string(), why.to_string());
                }
                Err(why)
            }
        };
        let result = found.as_ref().map(|k| k.open.clone()).map_err(Clone::clone);
        self.files.insert(id, found);
        result
    }

    /// How to read file `id` for the rest of the session.
    fn keep(&mut self, path: &Path, id: FileId, file: File, proc_path: PathBuf) -> Known {
        // The same file at the same path on the host: read it there (stable,
        // and debug links next to it still work).
        if std::fs::metadata(path).is_ok_and(|meta| id_of(&meta) == id) {
            return Known {
                open: path.to_path_buf(),
                _held: None,
            };
        }
        if self.held < MAX_HELD {
            self.held += 1;
            return Known {
                open: PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd())),
                _held: Some(file),
            };
        }
        Known {
            open: proc_path,
            _held: None,
        }
    }

    /// The known readable path for target path `path`: when several files
    /// had that path, the one process `pid` maps now.
    fn by_path(&mut self, pid: u32, path: &Path) -> Option<Result<PathBuf, Unopenable>> {
        let ids = self.by_path.get(path)?;
        let id = match ids.as_slice() {
            [one] => *one,
            _ => {
                let mappings = maps::read_raw(pid).ok()?;
                let mapping = mappings
                    .iter()
                    .find(|m| m.is_file() && m.path.as_deref() == Some(path))?;
                return Some(self.resolve(pid, mapping));
            }
        };
        match self.files.get(&id)? {
            Ok(known) => Some(Ok(known.open.clone())),
            Err(why) => Some(Err(why.clone())),
        }
    }
}

/// The path through which memtrace reads the file of `mapping` (of process
/// `pid`), checked against its device and inode; cached per file.
pub fn open(pid: u32, mapping: &Mapping) -> Result<PathBuf, Unopenable> {
    registry().resolve(pid, mapping)
}

/// Records every file mapping of `pid` (called whenever its maps are read,
/// while the files are reachable through it).
pub fn observe(pid: u32, mappings: &[Mapping]) {
    let mut registry = registry();
    for mapping in mappings.iter().filter(|m| m.is_file()) {
        if matches!(
            registry.files.get(&(mapping.dev, mapping.inode)),
            Some(Ok(_) | Err(Unopenable::Mismatch { .. }))
        ) {
            continue;
        }
        let _ = registry.resolve(pid, mapping);
    }
}

/// The path through which memtrace reads `path` as process `pid` sees it:
/// the file it mapped at that path (checked, see [`open`]); a path it does
/// not map is looked up inside its root. `None`: refused or unreachable,
/// never the host's file of that name unless it is the same file.
pub fn open_path(pid: u32, path: &Path) -> Option<PathBuf> {
    if let Some(known) = registry().by_path(pid, path) {
        return known.ok();
    }
    if let Ok(mappings) = maps::read_raw(pid) {
        observe(pid, &mappings);
        if let Some(mapping) = mappings
            .iter()
            .find(|m| m.is_file() && m.path.as_deref() == Some(path))
        {
            return open(pid, mapping).ok();
        }
    }
    // Not mapped (`--lib`, a launched program before exec): inside its root.
    inside_root(pid, path).ok()
}

/// The note on mappings that could not be opened as the target sees them.
pub fn note() -> Option<String> {
    let registry = registry();
    if registry.unopenable.is_empty() {
        return None;
    }
    const SHOWN: usize = 5;
    let shown: Vec<String> = registry
        .unopenable
        .iter()
        .take(SHOWN)
        .map(|(path, why)| format!("{path} ({why})"))
        .collect();
    Some(format!(
        "{} mapping(s) could not be opened as the target sees them, no symbols or probes from them: {}{}",
        registry.unopenable.len(),
        shown.join("; "),
        if registry.unopenable.len() > SHOWN {
            "; ..."
        } else {
            ""
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_numbers_are_split_as_maps_prints_them() {
        // glibc's makedev(0xfe, 0x01) and makedev(0x103, 0x20001).
        assert_eq!(dev_of_stat(libc::makedev(0xfe, 0x01)), 0xfe << 20 | 1);
        assert_eq!(dev_text(dev_of_stat(libc::makedev(0xfe, 0x01))), "fe:01");
        let big = libc::makedev(0x103, 0x20001);
        assert_eq!(dev_of_stat(big), 0x103 << 20 | 0x20001);
        assert_eq!(
            maps::parse("1000-2000 r-xp 00000000 103:20001 7 /x\n")[0].dev,
            dev_of_stat(big)
        );
    }

    /// A container's links, absolute, relative or climbing, resolve inside
    /// its root, never on the host (`canonicalize` followed `/abs` to the
    /// host's `/usr/lib`).
    #[test]
    fn links_resolve_inside_the_root() {
        use std::os::unix::fs::symlink;
        let dir = std::env::temp_dir().join(format!("memtrace-root-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let root = dir.join("root");
        std::fs::create_dir_all(root.join("usr/lib/debug")).expect("mkdir");
        std::fs::create_dir_all(root.join("etc")).expect("mkdir");
        std::fs::write(root.join("usr/lib/debug/x.debug"), b"x").expect("write");
        std::fs::write(root.join("etc/os-release"), b"container").expect("write");
        symlink("usr/lib", root.join("lib")).expect("symlink");
        symlink("/usr/lib", root.join("abs")).expect("symlink");
        symlink("../../../../../etc", root.join("usr/lib/up")).expect("symlink");
        let at = |path: &str| resolve_in_root(&root, Path::new(path)).ok();
        let expected = Some(root.join("usr/lib/debug/x.debug"));
        assert_eq!(at("/usr/lib/debug/x.debug"), expected);
        assert_eq!(at("/lib/debug/x.debug"), expected);
        assert_eq!(at("/abs/debug/x.debug"), expected);
        assert_eq!(at("/abs/../lib/./debug/x.debug"), expected);
        assert_eq!(at("/lib/up/os-release"), Some(root.join("etc/os-release")));
        assert_eq!(
            at("/../../etc/os-release"),
            Some(root.join("etc/os-release"))
        );
        assert_eq!(at("/usr/lib/debug/absent.debug"), None);
        symlink("loop", root.join("loop")).expect("symlink");
        let looped = resolve_in_root(&root, Path::new("/loop")).expect_err("a loop");
        assert_eq!(looped.raw_os_error(), Some(libc::ELOOP));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn root_needs_device_and_inode_map_files_the_inode() {
        assert!(accepts(Via::Root, (1, 2), (1, 2)));
        assert!(!accepts(Via::Root, (1, 2), (3, 2)), "same inode elsewhere");
        assert!(!accepts(Via::Root, (1, 2), (1, 3)));
        assert!(accepts(Via::MapFiles, (1, 2), (40, 2)), "overlay device");
        assert!(!accepts(Via::MapFiles, (1, 2), (1, 3)));
    }

    #[test]
    fn own_mappings_resolve_to_the_mapped_file() {
        let me = std::process::id();
        let mappings = maps::read_raw(me).expect("own maps");
        let exe = std::env::current_exe().expect("own exe");
        let mapping = mappings
            .iter()
            .find(|m| m.is_file() && m.path.as_deref() == Some(exe.as_path()))
            .expect("own exe mapped");
        let open = open(me, mapping).expect("opens");
        // Same file at the same path here: read it there.
        assert_eq!(open, exe);
        assert_eq!(open_path(me, &exe), Some(exe.clone()));
        // A mapping claiming another inode at that path is refused, not read.
        let mut wrong = mapping.clone();
        wrong.inode = mapping.inode.wrapping_add(1_000_003);
        wrong.start = 0x1000;
        wrong.end = 0x2000;
        let why = super::open(me, &wrong).expect_err("another file");
        assert!(matches!(why, Unopenable::Mismatch { .. }), "{why}");
        assert!(note().is_some_and(|n| n.contains(&exe.display().to_string())));
    }

    #[test]
    fn map_files_reaches_a_deleted_file() {
        let me = std::process::id();
        let dir = std::env::temp_dir().join(format!("memtrace-files-{me}"));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("mapped");
        std::fs::write(&path, vec![7u8; 4096]).expect("write");
        let file = File::open(&path).expect("open");
        // SAFETY: a private read-only mapping of a 4096-byte file we own,
        // unmapped below; no Rust reference is made to it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        std::fs::remove_file(&path).expect("unlink");
        let mappings = maps::read_raw(me).expect("own maps");
        let mapping = mappings
            .iter()
            .find(|m| m.start == addr as u64)
            .expect("mapped")
            .clone();
        assert!(mapping.deleted);
        let opened = open(me, &mapping);
        // SAFETY: the mapping made above, no longer used.
        unsafe { libc::munmap(addr, 4096) };
        let _ = std::fs::remove_dir_all(&dir);
        // map_files needs CAP_SYS_ADMIN; without it the file is unopenable.
        if let Ok(opened) = opened {
            assert_eq!(std::fs::read(&opened).expect("readable"), vec![7u8; 4096]);
        }
    }
}
