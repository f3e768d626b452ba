//! The on-disk cache directory (`--table-cache DIR|off`): what memtrace
//! keeps per mapped object for later attaches to the same objects, one file
//! per object and [`Kind`] (its packed unwind table, `unwind::cache`; what
//! the search for allocator functions found in it, `probe::plan_cache`),
//! named by the object's key ([`key_of`]: its ELF build-id, or without one
//! the file's device, inode, size and modification time).
//!
//! The directory and its files belong to memtrace's user and nobody else can
//! write them (created 0700 / 0600; refused when a link, another user's, or
//! writable by group or others); a directory that fails this is refused and
//! nothing is cached. A file is opened without following links, its owner,
//! mode and size checked, and its bytes handed to its kind's decoder, which
//! checks every one of them: a file refused by either is removed (to be
//! made again), never trusted. The directory's total size, every kind
//! together, is bounded; the least recently used files (by mtime, refreshed
//! on each hit) go first. Files being written are temporary files renamed
//! into place; those of writers that are gone are removed on open.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// The default cache directory.
pub const DEFAULT_DIR: &str = "/var/cache/memtrace/unwind";
/// The default bound on the directory's total size, in MiB.
pub const DEFAULT_MIB: u64 = 1024;

/// Group- or other-writable mode bits: a directory or file with either is refused.
const WRITABLE_BY_OTHERS: u32 = 0o022;

/// What a cache file holds; its file-name suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// An object's packed unwind table (`unwind::cache`).
    Table,
    /// What the search for allocator functions found in an object
    /// (`probe::plan_cache`).
    Functions,
}

impl Kind {
    /// Every kind: the files the bound counts and eviction may remove.
    const ALL: [Kind; 2] = [Kind::Table, Kind::Functions];

    fn suffix(self) -> &'static str {
        match self {
            Kind::Table => "tbl",
            Kind::Functions => "fns",
        }
    }
}

/// FNV-1a of `bytes`, continuing from `hash` (start from [`FNV_START`]):
/// the identity of the sources or inputs a cache file was made with.
pub const fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    hash
}

/// FNV-1a's offset basis.
pub const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// Why a cache file was not used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Rejected {
    #[error("not a regular file owned by memtrace's user that only it may write")]
    Unsafe,
    #[error("truncated or oversized")]
    Size,
    #[error("not a memtrace cache file of this kind, or another format, architecture, builder or catalogue")]
    Format,
    #[error("it holds another object's entry")]
    Key,
    #[error("checksum mismatch")]
    Checksum,
    #[error("a value out of bounds")]
    Bounds,
    #[error("{0}")]
    Io(String),
}

/// Why a directory cannot hold the cache.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("{0}: cannot create it: {1}")]
    Create(String, std::io::Error),
    #[error("{0}: not a directory owned by memtrace's user that only it may write")]
    Unsafe(String),
}

/// A cache's counters, for the report (`unwind.cache`, `function_cache`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CacheStats {
    /// The directory, or `off`.
    pub dir: String,
    /// Objects whose entry (unwind table, function search) was loaded
    /// from the cache.
    pub hits: u64,
    /// Objects whose entry was made (table built, functions searched):
    /// not in the cache, or no key.
    pub misses: u64,
    /// Files refused (bad owner or mode, truncated, altered, foreign):
    /// made again.
    pub rejected: u64,
    /// Entries written.
    pub stored: u64,
    /// Files removed to keep the directory under its bound.
    pub evicted: u64,
    /// Entries that could not be written, files refused and why, or a
    /// directory that was refused.
    pub failures: Vec<String>,
}

impl CacheStats {
    /// Counts of a cache in `dir`.
    pub fn in_dir(dir: &Path) -> CacheStats {
        CacheStats {
            dir: dir.display().to_string(),
            ..CacheStats::default()
        }
    }

    /// Adds one object's counts (its failures named by its path).
    pub fn add(&mut self, other: &CacheStats, path: &Path) {
        self.hits += other.hits;
        self.misses += other.misses;
        self.rejected += other.rejected;
        self.stored += other.stored;
        self.evicted += other.evicted;
        self.failures.extend(
            other
                .failures
                .iter()
                .map(|why| format!("{}: {why}", path.display())),
        );
    }
}

/// `--table-cache DIR|off`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Setting {
    Off,
    Dir(PathBuf),
}

impl std::str::FromStr for Setting {
    type Err = String;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value {
            "off" => Ok(Setting::Off),
            "" => Err("expected a directory or `off`".into()),
            dir => Ok(Setting::Dir(PathBuf::from(dir))),
        }
    }
}

/// An open cache directory.
#[derive(Clone, Debug)]
pub struct Store {
    dir: PathBuf,
    max_bytes: u64,
}

impl Store {
    /// Opens (creating it 0700 when missing) the cache directory `dir`,
    /// refused when it is a link, owned by another user, or open to others.
    pub fn open(dir: &Path, max_bytes: u64) -> Result<Store, Refused> {
        let shown = dir.display().to_string();
        if std::fs::symlink_metadata(dir).is_err() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|err| Refused::Create(shown.clone(), err))?;
        }
        let meta =
            std::fs::symlink_metadata(dir).map_err(|err| Refused::Create(shown.clone(), err))?;
        if !meta.is_dir() || meta.uid() != euid() || meta.mode() & WRITABLE_BY_OTHERS != 0 {
            return Err(Refused::Unsafe(shown));
        }
        let store = Store {
            dir: dir.to_path_buf(),
            max_bytes,
        };
        store.remove_orphans();
        Ok(store)
    }

    /// Removes the temporary files of writers that are gone (a memtrace
    /// that exited while a file was being written: see [`Self::store`]).
    fn remove_orphans(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(writer_pid) else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    #[cfg(test)]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of `kind` named `name` (an object's key, and for some kinds
    /// more that tells its entries apart).
    pub fn path_of(&self, kind: Kind, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.{}", kind.suffix()))
    }

    /// The entry of `kind` under `name`, read whole and given to `decode`:
    /// `Ok(None)` when there is none, `Err` when the file or `decode`
    /// refused it (it is then removed, to be made again).
    pub fn load<T>(
        &self,
        kind: Kind,
        name: &str,
        decode: impl FnOnce(&[u8]) -> Result<T, Rejected>,
    ) -> Result<Option<T>, Rejected> {
        let path = self.path_of(kind, name);
        let mut file = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
        {
            Ok(file) => file,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(err) if err.raw_os_error() == Some(libc::ELOOP) => {
                let _ = std::fs::remove_file(&path);
                return Err(Rejected::Unsafe);
            }
            Err(err) => return Err(Rejected::Io(err.to_string())),
        };
        let outcome = read_checked(&mut file, self.max_bytes).and_then(|bytes| decode(&bytes));
        match &outcome {
            // Most recently used: kept longest by the eviction.
            Ok(_) => {
                let _ = file.set_modified(SystemTime::now());
            }
            Err(_) => {
                let _ = std::fs::remove_file(&path);
            }
        }
        outcome.map(Some)
    }

    /// Writes `bytes` as the entry of `kind` under `name` (a new 0600 file
    /// renamed into place); returns its size.
    pub fn store(&self, kind: Kind, name: &str, bytes: &[u8]) -> std::io::Result<u64> {
        if bytes.len() as u64 > self.max_bytes {
            return Err(std::io::Error::other(format!(
                "{} bytes exceed the cache's bound",
                bytes.len()
            )));
        }
        let temp = self.dir.join(format!(
            ".{name}.{}.{:?}.tmp",
            std::process::id(),
            std::thread::current().id()
        ));
        let written = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&temp)
            .and_then(|mut file| file.write_all(bytes).and_then(|()| file.sync_data()))
            .and_then(|()| std::fs::rename(&temp, self.path_of(kind, name)));
        if written.is_err() {
            let _ = std::fs::remove_file(&temp);
        }
        written.map(|()| bytes.len() as u64)
    }

    /// Removes the least recently used files, of every kind, until the
    /// directory holds at most its bound; returns how many were removed.
    pub fn evict(&self) -> u64 {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut files: Vec<(SystemTime, u64, PathBuf)> = entries
            .filter_map(Result::ok)
            .filter(|e| {
                e.path()
                    .extension()
                    .is_some_and(|x| Kind::ALL.iter().any(|kind| x == kind.suffix()))
            })
            .filter_map(|e| {
                let meta = e.metadata().ok()?;
                Some((meta.modified().ok()?, meta.len(), e.path()))
            })
            .collect();
        let mut total: u64 = files.iter().map(|(_, len, _)| len).sum();
        files.sort();
        let mut evicted = 0;
        for (_, len, path) in files {
            if total <= self.max_bytes {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                total -= len;
                evicted += 1;
            }
        }
        evicted
    }
}

/// Reads a whole cache file, once its owner, mode and size are checked.
fn read_checked(file: &mut File, max_bytes: u64) -> Result<Vec<u8>, Rejected> {
    let meta = file
        .metadata()
        .map_err(|err| Rejected::Io(err.to_string()))?;
    if !meta.is_file() || meta.uid() != euid() || meta.mode() & WRITABLE_BY_OTHERS != 0 {
        return Err(Rejected::Unsafe);
    }
    if meta.len() > max_bytes {
        return Err(Rejected::Size);
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.read_to_end(&mut bytes)
        .map_err(|err| Rejected::Io(err.to_string()))?;
    Ok(bytes)
}

/// The process that writes temporary file `name`
/// (`.NAME.PID.THREAD.tmp`), if it is one.
fn writer_pid(name: &str) -> Option<u32> {
    let inner = name.strip_prefix('.')?.strip_suffix(".tmp")?;
    let mut parts = inner.rsplitn(3, '.');
    let _thread = parts.next()?;
    let pid = parts.next()?.parse().ok()?;
    parts.next()?;
    Some(pid)
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// An object's cache key: `b-` and its build-id, or without one `f-` and
/// the file's device, inode, size and modification time.
pub fn key_of(file: &File) -> Option<String> {
    let meta = file.metadata().ok()?;
    let data = object::read::ReadCache::new(file);
    let id = build_id::<object::elf::FileHeader64<object::Endianness>>(&data)
        .or_else(|| build_id::<object::elf::FileHeader32<object::Endianness>>(&data));
    if let Some(id) = id.filter(|id| !id.is_empty()) {
        return Some(format!("b-{}", hex(&id)));
    }
    let mtime = meta.mtime() as u64;
    Some(format!(
        "f-{:x}-{:x}-{:x}-{:x}.{:x}",
        meta.dev(),
        meta.ino(),
        meta.len(),
        mtime,
        meta.mtime_nsec()
    ))
}

/// The GNU build-id of an ELF object of class `Elf`, as `object` finds it
/// (the notes of its sections, or without section headers of its
/// segments), reading only its headers and notes: not its symbol tables,
/// which in a PyTorch-sized library are most of what a cache hit would
/// otherwise read.
fn build_id<Elf>(data: &object::read::ReadCache<&File>) -> Option<Vec<u8>>
where
    Elf: object::read::elf::FileHeader<Endian = object::Endianness>,
{
    use object::read::elf::{ProgramHeader, SectionHeader};
    let header = Elf::parse(data).ok()?;
    let endian = header.endian().ok()?;
    let is_build_id = |note: &object::read::elf::Note<'_, Elf>| {
        note.name() == object::elf::ELF_NOTE_GNU
            && note.n_type(endian) == object::elf::NT_GNU_BUILD_ID
    };
    let sections = header.sections(endian, data).ok()?;
    if !sections.is_empty() {
        for section in sections.iter() {
            if let Some(mut notes) = section.notes(endian, data).ok()? {
                while let Some(note) = notes.next().ok()? {
                    if is_build_id(&note) {
                        return Some(note.desc().to_vec());
                    }
                }
            }
        }
    } else {
        for segment in header.program_headers(endian, data).ok()? {
            if let Some(mut notes) = segment.notes(endian, data).ok()? {
                while let Some(note) = notes.next().ok()? {
                    if is_build_id(&note) {
                        return Some(note.desc().to_vec());
                    }
                }
            }
        }
    }
    None
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn store(max_bytes: u64) -> (tempfile::TempDir, Store) {
        let parent = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&parent.path().join("cache"), max_bytes).expect("opens");
        (parent, store)
    }

    /// A decoder that takes any bytes as they are.
    fn whole(bytes: &[u8]) -> Result<Vec<u8>, Rejected> {
        Ok(bytes.to_vec())
    }

    #[test]
    fn temporary_files_of_writers_that_are_gone_are_removed_on_open() {
        let parent = tempfile::tempdir().expect("tempdir");
        let dir = parent.path().join("unwind");
        drop(Store::open(&dir, DEFAULT_MIB << 20).expect("opens"));
        // Above any pid_max: no such process.
        let gone = dir.join(".b-0a.4294967295.ThreadId(2).tmp");
        let gone_fns = dir.join(".b-0a.00ff.4294967295.ThreadId(2).tmp");
        let alive = dir.join(format!(".b-0b.{}.ThreadId(1).tmp", std::process::id()));
        let other = dir.join(".notes.tmp");
        for path in [&gone, &gone_fns, &alive, &other] {
            std::fs::write(path, b"x").expect("writes");
        }
        drop(Store::open(&dir, DEFAULT_MIB << 20).expect("opens again"));
        assert!(!gone.exists() && !gone_fns.exists(), "their writer is gone");
        assert!(alive.exists(), "its writer runs");
        assert!(other.exists(), "not a file being written");
        assert_eq!(writer_pid(".b-0a.17.ThreadId(3).tmp"), Some(17));
        assert_eq!(writer_pid("b-0a.table"), None);
    }

    #[test]
    fn a_stored_entry_loads_back_and_the_directory_and_files_are_private() {
        let (_parent, store) = store(DEFAULT_MIB << 20);
        assert_eq!(store.load(Kind::Table, "b-01", whole), Ok(None));
        store.store(Kind::Table, "b-01", b"table").expect("stores");
        store
            .store(Kind::Functions, "b-01", b"functions")
            .expect("stores");
        assert_eq!(
            store.load(Kind::Table, "b-01", whole),
            Ok(Some(b"table".to_vec()))
        );
        assert_eq!(
            store.load(Kind::Functions, "b-01", whole),
            Ok(Some(b"functions".to_vec()))
        );
        let mode = |path: &Path| std::fs::metadata(path).expect("exists").mode() & 0o777;
        assert_eq!(mode(store.dir()), 0o700);
        assert_eq!(mode(&store.path_of(Kind::Table, "b-01")), 0o600);
        assert_eq!(mode(&store.path_of(Kind::Functions, "b-01")), 0o600);
    }

    #[test]
    fn a_file_its_decoder_refuses_is_removed() {
        let (_parent, store) = store(DEFAULT_MIB << 20);
        store
            .store(Kind::Functions, "b-02", b"bad")
            .expect("stores");
        let refused = store.load(Kind::Functions, "b-02", |_| -> Result<(), _> {
            Err(Rejected::Checksum)
        });
        assert_eq!(refused, Err(Rejected::Checksum));
        assert!(!store.path_of(Kind::Functions, "b-02").exists());
        assert_eq!(store.load(Kind::Functions, "b-02", whole), Ok(None));
    }

    #[test]
    fn files_and_directories_open_to_others_or_linked_are_refused() {
        let (parent, store) = store(DEFAULT_MIB << 20);
        for kind in Kind::ALL {
            store.store(kind, "b-03", b"x").expect("stores");
            let path = store.path_of(kind, "b-03");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).expect("chmod");
            assert_eq!(store.load(kind, "b-03", whole), Err(Rejected::Unsafe));
            assert!(!path.exists(), "removed");
            if euid() == 0 {
                store.store(kind, "b-03", b"x").expect("stores");
                std::os::unix::fs::chown(&path, Some(65534), None).expect("chown");
                assert_eq!(
                    store.load(kind, "b-03", whole),
                    Err(Rejected::Unsafe),
                    "another owner"
                );
            }
            let elsewhere = parent.path().join("elsewhere");
            std::fs::write(&elsewhere, b"x").expect("write");
            std::os::unix::fs::symlink(&elsewhere, &path).expect("symlink");
            assert_eq!(store.load(kind, "b-03", whole), Err(Rejected::Unsafe));
        }
        let open = parent.path().join("open");
        std::fs::DirBuilder::new()
            .mode(0o777)
            .create(&open)
            .expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        assert!(matches!(
            Store::open(&open, DEFAULT_MIB << 20),
            Err(Refused::Unsafe(_))
        ));
        let link = parent.path().join("link");
        std::os::unix::fs::symlink(store.dir(), &link).expect("symlink");
        assert!(matches!(
            Store::open(&link, DEFAULT_MIB << 20),
            Err(Refused::Unsafe(_))
        ));
    }

    #[test]
    fn a_file_over_the_bound_is_neither_written_nor_read() {
        let (_parent, store) = store(4);
        assert!(store.store(Kind::Table, "b-04", b"12345").is_err());
        std::fs::write(store.path_of(Kind::Table, "b-04"), b"12345").expect("write");
        std::fs::set_permissions(
            store.path_of(Kind::Table, "b-04"),
            std::fs::Permissions::from_mode(0o600),
        )
        .expect("chmod");
        assert_eq!(store.load(Kind::Table, "b-04", whole), Err(Rejected::Size));
    }

    #[test]
    fn eviction_counts_every_kind_and_drops_the_least_recently_used() {
        let (_parent, store) = store(20);
        let files = [
            (Kind::Table, "b-00"),
            (Kind::Functions, "b-01"),
            (Kind::Table, "b-02"),
        ];
        for (i, (kind, name)) in files.iter().enumerate() {
            store.store(*kind, name, &[0; 10]).expect("stores");
            let when = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i as u64);
            File::open(store.path_of(*kind, name))
                .and_then(|f| f.set_modified(when))
                .expect("mtime");
        }
        let unrelated = store.dir().join("notes.txt");
        std::fs::write(&unrelated, [0; 100]).expect("write");
        // A hit makes b-00 the most recently used.
        assert!(store
            .load(Kind::Table, "b-00", whole)
            .expect("valid")
            .is_some());
        assert_eq!(store.evict(), 1);
        assert!(store.path_of(Kind::Table, "b-00").exists());
        assert!(
            !store.path_of(Kind::Functions, "b-01").exists(),
            "least recently used"
        );
        assert!(store.path_of(Kind::Table, "b-02").exists());
        assert!(
            unrelated.exists(),
            "not a cache file: neither counted nor removed"
        );
        assert_eq!(store.evict(), 0);
    }

    #[test]
    fn objects_are_keyed_by_build_id_or_else_by_file_identity() {
        let Ok(libc) = File::open("/lib/x86_64-linux-gnu/libc.so.6") else {
            return;
        };
        let key = key_of(&libc).expect("key");
        assert!(key.starts_with("b-") && key.len() > 10, "{key}");
        // The build-id `object` finds, read without the symbol tables.
        for path in [
            "/lib/x86_64-linux-gnu/libc.so.6",
            "/usr/lib/x86_64-linux-gnu/libstdc++.so.6",
            "/usr/aarch64-linux-gnu/lib/libc.so.6",
            "/usr/lib/i386-linux-gnu/libc.so.6",
        ] {
            let Ok(bytes) = std::fs::read(path) else {
                continue;
            };
            use object::Object;
            let parsed = object::File::parse(&*bytes).expect("ELF");
            let id = parsed.build_id().expect("notes").expect("a build-id");
            let file = File::open(path).expect("open");
            assert_eq!(key_of(&file), Some(format!("b-{}", hex(id))), "{path}");
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"not an ELF file").expect("write");
        let key = key_of(&File::open(&plain).expect("open")).expect("key");
        assert!(key.starts_with("f-"), "{key}");
    }

    #[test]
    fn the_setting_is_a_directory_or_off() {
        assert_eq!("off".parse(), Ok(Setting::Off));
        assert_eq!("/tmp/x".parse(), Ok(Setting::Dir(PathBuf::from("/tmp/x"))));
        assert!("".parse::<Setting>().is_err());
    }
}
