//! The on-disk cache of packed unwind tables (`--table-cache DIR|off`): one
//! file per object, named by its key (the ELF build-id, or without one the
//! file's device, inode, size and modification time), so a later attach to
//! the same objects loads their tables instead of building them again.
//!
//! The directory and its files belong to memtrace's user and nobody else can
//! write them (created 0700 / 0600; refused when group or others may write);
//! a directory that fails this is refused with a warning and nothing is
//! cached. Every file read is checked in full (magic, format version,
//! architecture, the table builder's identity, key, sizes, CRC-32, and every
//! row, rule and page index in bounds) before it is used: a truncated or altered file is
//! rejected, removed and rebuilt, never trusted. The directory's total size is
//! bounded; the least recently used files (by mtime, refreshed on each hit)
//! go first.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use memtrace_common::unwind::{PageRow, UnwindRule, PAGE_SHIFT};
use serde::{Deserialize, Serialize};

use crate::unwind::table::Packed;

/// The default cache directory.
pub const DEFAULT_DIR: &str = "/var/cache/memtrace/unwind";
/// The default bound on the directory's total size, in MiB.
pub const DEFAULT_MIB: u64 = 1024;

const MAGIC: &[u8; 8] = b"MTUNWTBL";
/// Bumped whenever the file layout changes.
const FORMAT_VERSION: u32 = 1;
/// The builder's identity: a hash of the sources that make the rows and
/// pack them, so a memtrace whose builder differs never uses another's tables.
const BUILDER: u64 = fnv1a(
    fnv1a(
        fnv1a(0xcbf2_9ce4_8422_2325, include_bytes!("cfi.rs")),
        include_bytes!("table.rs"),
    ),
    include_bytes!("../../../memtrace-common/src/unwind.rs"),
);

const fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    let mut i = 0;
    while i < bytes.len() {
        hash ^= bytes[i] as u64;
        hash = hash.wrapping_mul(0x0100_0000_01b3);
        i += 1;
    }
    hash
}
const SUFFIX: &str = "tbl";
/// Group- or other-writable mode bits: a directory or file with either is refused.
const WRITABLE_BY_OTHERS: u32 = 0o022;

#[cfg(target_arch = "aarch64")]
const ARCH: u32 = 2;
#[cfg(not(target_arch = "aarch64"))]
const ARCH: u32 = 1;

/// Why a cache file was not used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Rejected {
    #[error("not a regular file owned by memtrace's user that only it may write")]
    Unsafe,
    #[error("truncated or oversized")]
    Size,
    #[error("not a memtrace table file, or another format, architecture or table builder")]
    Format,
    #[error("it holds another object's table")]
    Key,
    #[error("checksum mismatch")]
    Checksum,
    #[error("a row, rule or page index out of bounds")]
    Bounds,
    #[error("{0}")]
    Io(String),
}

/// What a cached table holds: the packed table and what the report counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    pub packed: Packed,
    /// Rows before packing (the report's `rows`).
    pub source_rows: u64,
    /// Malformed CFI entries the builder skipped.
    pub malformed: u64,
}

/// The cache's counters, for the report (`unwind.cache`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct CacheStats {
    /// The directory, or `off`.
    pub dir: String,
    /// Tables loaded from the cache.
    pub hits: u64,
    /// Tables built (not in the cache, or no key).
    pub misses: u64,
    /// Files refused (bad owner or mode, truncated, altered): rebuilt.
    pub rejected: u64,
    /// Tables written.
    pub stored: u64,
    /// Files removed to keep the directory under its bound.
    pub evicted: u64,
    /// Tables that could not be written, or a directory that was refused.
    pub failures: Vec<String>,
}

impl CacheStats {
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
pub struct TableCache {
    dir: PathBuf,
    max_bytes: u64,
}

/// Why a directory cannot hold the cache.
#[derive(Debug, thiserror::Error)]
pub enum Refused {
    #[error("{0}: cannot create it: {1}")]
    Create(String, std::io::Error),
    #[error("{0}: not a directory owned by memtrace's user that only it may write")]
    Unsafe(String),
}

impl TableCache {
    /// Opens (creating it 0700 when missing) the cache directory `dir`,
    /// refused when it is a link, owned by another user, or open to others.
    pub fn open(dir: &Path, max_bytes: u64) -> Result<TableCache, Refused> {
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
        let cache = TableCache {
            dir: dir.to_path_buf(),
            max_bytes,
        };
        cache.remove_orphans();
        Ok(cache)
    }

    /// Removes the temporary files of writers that are gone (a memtrace
    /// that exited while a table was being written: see [`Self::store`]).
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

    fn path_of(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.{SUFFIX}"))
    }

    /// The table cached under `key`: `Ok(None)` when there is none, `Err`
    /// when the file was refused (it is removed, to be rebuilt).
    pub fn load(&self, key: &str) -> Result<Option<Entry>, Rejected> {
        let path = self.path_of(key);
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
        let outcome = read_checked(&mut file, key, self.max_bytes);
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

    /// Writes `entry` under `key` (a new 0600 file renamed into place);
    /// returns its size.
    pub fn store(&self, key: &str, entry: &Entry) -> std::io::Result<u64> {
        let bytes = encode(key, entry);
        if bytes.len() as u64 > self.max_bytes {
            return Err(std::io::Error::other(format!(
                "{} bytes exceed the cache's bound",
                bytes.len()
            )));
        }
        let temp = self.dir.join(format!(
            ".{key}.{}.{:?}.tmp",
            std::process::id(),
            std::thread::current().id()
        ));
        let written = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&temp)
            .and_then(|mut file| file.write_all(&bytes).and_then(|()| file.sync_data()))
            .and_then(|()| std::fs::rename(&temp, self.path_of(key)));
        if written.is_err() {
            let _ = std::fs::remove_file(&temp);
        }
        written.map(|()| bytes.len() as u64)
    }

    /// Removes the least recently used tables until the directory holds at
    /// most its bound; returns how many were removed.
    pub fn evict(&self) -> u64 {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut files: Vec<(SystemTime, u64, PathBuf)> = entries
            .filter_map(Result::ok)
            .filter(|e| e.path().extension().is_some_and(|x| x == SUFFIX))
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

/// The process that writes temporary file `name`
/// (`.KEY.PID.THREAD.tmp`), if it is one.
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
    let cache = object::read::ReadCache::new(file);
    if let Ok(object) = object::File::parse(&cache) {
        use object::Object;
        if let Ok(Some(id)) = object.build_id() {
            if !id.is_empty() {
                return Some(format!("b-{}", hex(id)));
            }
        }
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

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Header: magic, version, architecture, builder, key length, base, rule
/// count, row count, page count, source rows, malformed; then the key, the
/// rules, the rows, the page index, and the CRC-32 of all that.
const HEADER: usize = 8 + 4 * 2 + 8 + 4 * 5 + 8 * 2;

fn encode(key: &str, entry: &Entry) -> Vec<u8> {
    let packed = &entry.packed;
    let mut out = Vec::with_capacity(
        HEADER
            + key.len()
            + packed.rules.len() * 8
            + packed.rows.len() * 4
            + packed.pages.len() * 4
            + 4,
    );
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&ARCH.to_le_bytes());
    out.extend_from_slice(&BUILDER.to_le_bytes());
    for word in [
        key.len() as u32,
        packed.base,
        packed.rules.len() as u32,
        packed.rows.len() as u32,
        packed.pages.len() as u32,
    ] {
        out.extend_from_slice(&word.to_le_bytes());
    }
    out.extend_from_slice(&entry.source_rows.to_le_bytes());
    out.extend_from_slice(&entry.malformed.to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    for rule in &packed.rules {
        out.extend_from_slice(&rule.cfa_offset8.to_le_bytes());
        out.extend_from_slice(&rule.rbp_offset8.to_le_bytes());
        out.extend_from_slice(&rule.ra_offset8.to_le_bytes());
        out.push(rule.kind);
        out.push(rule._pad);
    }
    for row in &packed.rows {
        out.extend_from_slice(&row.pc_in_page.to_le_bytes());
        out.extend_from_slice(&row.rule.to_le_bytes());
    }
    for page in &packed.pages {
        out.extend_from_slice(&page.to_le_bytes());
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Reads and checks a whole cache file.
fn read_checked(file: &mut File, key: &str, max_bytes: u64) -> Result<Entry, Rejected> {
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
    decode(&bytes, key)
}

/// A little-endian reader over a checked byte slice.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Rejected> {
        if self.0.len() < n {
            return Err(Rejected::Size);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Rejected> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    fn u16(&mut self) -> Result<u16, Rejected> {
        self.array().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Result<u32, Rejected> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, Rejected> {
        self.array().map(u64::from_le_bytes)
    }
}

/// Decodes a cache file's bytes, checking everything the kernel will rely on.
fn decode(bytes: &[u8], key: &str) -> Result<Entry, Rejected> {
    let body_len = bytes.len().checked_sub(4).ok_or(Rejected::Size)?;
    let (body, crc) = bytes.split_at(body_len);
    let mut c = Cursor(body);
    if c.take(8)? != MAGIC || c.u32()? != FORMAT_VERSION || c.u32()? != ARCH || c.u64()? != BUILDER
    {
        return Err(Rejected::Format);
    }
    let key_len = c.u32()? as usize;
    let base = c.u32()?;
    let counts = [c.u32()?, c.u32()?, c.u32()?].map(|n| n as usize);
    let [rule_count, row_count, page_count] = counts;
    let source_rows = c.u64()?;
    let malformed = c.u64()?;
    let expected = key_len
        .checked_add(rule_count.checked_mul(8).ok_or(Rejected::Size)?)
        .and_then(|n| n.checked_add(row_count.checked_mul(4)?))
        .and_then(|n| n.checked_add(page_count.checked_mul(4)?))
        .ok_or(Rejected::Size)?;
    if expected != c.0.len() {
        return Err(Rejected::Size);
    }
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err(Rejected::Checksum);
    }
    if c.take(key_len)? != key.as_bytes() {
        return Err(Rejected::Key);
    }
    if rule_count > usize::from(u16::MAX) + 1 || base & ((1 << PAGE_SHIFT) - 1) != 0 {
        return Err(Rejected::Bounds);
    }
    let mut rules = Vec::with_capacity(rule_count);
    for _ in 0..rule_count {
        let [a, b, c2, d] = [c.u16()?, c.u16()?, c.u16()?, c.u16()?];
        let [kind, pad] = d.to_le_bytes();
        rules.push(UnwindRule {
            cfa_offset8: a as i16,
            rbp_offset8: b as i16,
            ra_offset8: c2 as i16,
            kind,
            _pad: pad,
        });
    }
    let mut rows = Vec::with_capacity(row_count);
    for _ in 0..row_count {
        let row = PageRow {
            pc_in_page: c.u16()?,
            rule: c.u16()?,
        };
        if usize::from(row.rule) >= rule_count || u32::from(row.pc_in_page) >= 1 << PAGE_SHIFT {
            return Err(Rejected::Bounds);
        }
        rows.push(row);
    }
    let mut pages = Vec::with_capacity(page_count);
    for _ in 0..page_count {
        pages.push(c.u32()?);
    }
    check_pages(&rows, &pages)?;
    Ok(Entry {
        packed: Packed {
            base,
            rules,
            rows,
            pages,
        },
        source_rows,
        malformed,
    })
}

/// Each page's rows: from its page-index entry to the next (or the end),
/// led by a row at offset 0, offsets strictly increasing.
fn check_pages(rows: &[PageRow], pages: &[u32]) -> Result<(), Rejected> {
    if pages.is_empty() != rows.is_empty() || pages.first().is_some_and(|&first| first != 0) {
        return Err(Rejected::Bounds);
    }
    for (i, &first) in pages.iter().enumerate() {
        let end = pages.get(i + 1).map_or(rows.len(), |&next| next as usize);
        let page = rows.get(first as usize..end).ok_or(Rejected::Bounds)?;
        if page.first().is_none_or(|lead| lead.pc_in_page != 0)
            || page.windows(2).any(|w| w[0].pc_in_page >= w[1].pc_in_page)
        {
            return Err(Rejected::Bounds);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn entry() -> Entry {
        let rows = crate::unwind::table::sample_rows(&[0x1010, 0x1020, 0x3000, 0x3008, 0x5100]);
        Entry {
            packed: crate::unwind::table::pack(&rows).expect("packs"),
            source_rows: 5,
            malformed: 1,
        }
    }

    fn cache(max_bytes: u64) -> (tempfile::TempDir, TableCache) {
        let parent = tempfile::tempdir().expect("tempdir");
        let cache = TableCache::open(&parent.path().join("unwind"), max_bytes).expect("opens");
        (parent, cache)
    }

    #[test]
    fn temporary_files_of_writers_that_are_gone_are_removed_on_open() {
        let parent = tempfile::tempdir().expect("tempdir");
        let dir = parent.path().join("unwind");
        drop(TableCache::open(&dir, DEFAULT_MIB << 20).expect("opens"));
        // Above any pid_max: no such process.
        let gone = dir.join(".b-0a.4294967295.ThreadId(2).tmp");
        let alive = dir.join(format!(".b-0b.{}.ThreadId(1).tmp", std::process::id()));
        let other = dir.join(".notes.tmp");
        for path in [&gone, &alive, &other] {
            std::fs::write(path, b"x").expect("writes");
        }
        drop(TableCache::open(&dir, DEFAULT_MIB << 20).expect("opens again"));
        assert!(!gone.exists(), "its writer is gone");
        assert!(alive.exists(), "its writer runs");
        assert!(other.exists(), "not a table being written");
        assert_eq!(writer_pid(".b-0a.17.ThreadId(3).tmp"), Some(17));
        assert_eq!(writer_pid("b-0a.table"), None);
    }

    #[test]
    fn a_stored_table_loads_back_identical_and_the_directory_is_private() {
        let (_parent, cache) = cache(DEFAULT_MIB << 20);
        assert_eq!(cache.load("b-01").expect("no error"), None);
        cache.store("b-01", &entry()).expect("stores");
        assert_eq!(cache.load("b-01").expect("valid"), Some(entry()));
        let dir_mode = std::fs::metadata(cache.dir()).expect("dir").mode() & 0o777;
        let file_mode = std::fs::metadata(cache.path_of("b-01"))
            .expect("file")
            .mode()
            & 0o777;
        assert_eq!((dir_mode, file_mode), (0o700, 0o600));
    }

    #[test]
    fn every_truncation_and_every_flipped_byte_is_rejected_and_removed() {
        let (_parent, cache) = cache(DEFAULT_MIB << 20);
        let good = encode("b-02", &entry());
        for len in 0..good.len() {
            assert!(decode(&good[..len], "b-02").is_err(), "truncated to {len}");
        }
        for at in 0..good.len() {
            let mut bad = good.clone();
            bad[at] ^= 0x40;
            assert!(decode(&bad, "b-02").is_err(), "byte {at} flipped");
        }
        let mut bad = good.clone();
        bad[good.len() - 10] ^= 1;
        std::fs::write(cache.path_of("b-02"), &bad).expect("write");
        std::fs::set_permissions(
            cache.path_of("b-02"),
            std::fs::Permissions::from_mode(0o600),
        )
        .expect("chmod");
        assert_eq!(cache.load("b-02"), Err(Rejected::Checksum));
        assert!(!cache.path_of("b-02").exists(), "removed, to be rebuilt");
    }

    #[test]
    fn a_file_with_a_valid_checksum_but_an_index_out_of_bounds_is_rejected() {
        let mut forged = entry();
        forged.packed.rows[1].rule = forged.packed.rules.len() as u16;
        assert_eq!(decode(&encode("k", &forged), "k"), Err(Rejected::Bounds));
        let mut forged = entry();
        forged.packed.pages[2] = forged.packed.rows.len() as u32 + 3;
        assert_eq!(decode(&encode("k", &forged), "k"), Err(Rejected::Bounds));
        let mut forged = entry();
        forged.packed.rows.swap(1, 2);
        assert_eq!(decode(&encode("k", &forged), "k"), Err(Rejected::Bounds));
        assert_eq!(decode(&encode("other", &entry()), "k"), Err(Rejected::Key));
    }

    #[test]
    fn files_and_directories_open_to_others_or_linked_are_refused() {
        let (parent, cache) = cache(DEFAULT_MIB << 20);
        cache.store("b-03", &entry()).expect("stores");
        let path = cache.path_of("b-03");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).expect("chmod");
        assert_eq!(cache.load("b-03"), Err(Rejected::Unsafe));
        if euid() == 0 {
            cache.store("b-03", &entry()).expect("stores");
            std::os::unix::fs::chown(&path, Some(65534), None).expect("chown");
            assert_eq!(cache.load("b-03"), Err(Rejected::Unsafe), "another owner");
        }
        cache.store("b-03", &entry()).expect("stores");
        std::fs::remove_file(&path).expect("rm");
        let elsewhere = parent.path().join("elsewhere");
        std::fs::write(&elsewhere, encode("b-03", &entry())).expect("write");
        std::os::unix::fs::symlink(&elsewhere, &path).expect("symlink");
        assert_eq!(cache.load("b-03"), Err(Rejected::Unsafe));

        let open = parent.path().join("open");
        std::fs::DirBuilder::new()
            .mode(0o777)
            .create(&open)
            .expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        assert!(matches!(
            TableCache::open(&open, DEFAULT_MIB << 20),
            Err(Refused::Unsafe(_))
        ));
        let link = parent.path().join("link");
        std::os::unix::fs::symlink(cache.dir(), &link).expect("symlink");
        assert!(matches!(
            TableCache::open(&link, DEFAULT_MIB << 20),
            Err(Refused::Unsafe(_))
        ));
    }

    #[test]
    fn eviction_keeps_the_directory_under_its_bound_dropping_the_least_recently_used() {
        let size = encode("b-00", &entry()).len() as u64;
        let (_parent, cache) = cache(size * 2);
        for (i, key) in ["b-00", "b-01", "b-02"].iter().enumerate() {
            cache.store(key, &entry()).expect("stores");
            let when = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i as u64);
            File::open(cache.path_of(key))
                .and_then(|f| f.set_modified(when))
                .expect("mtime");
        }
        // A hit makes b-00 the most recently used.
        assert!(cache.load("b-00").expect("valid").is_some());
        assert_eq!(cache.evict(), 1);
        assert!(cache.path_of("b-00").exists());
        assert!(!cache.path_of("b-01").exists(), "least recently used");
        assert!(cache.path_of("b-02").exists());
        assert_eq!(cache.evict(), 0);
    }

    #[test]
    fn objects_are_keyed_by_build_id_or_else_by_file_identity() {
        let Ok(libc) = File::open("/lib/x86_64-linux-gnu/libc.so.6") else {
            return;
        };
        let key = key_of(&libc).expect("key");
        assert!(key.starts_with("b-") && key.len() > 10, "{key}");
        let dir = tempfile::tempdir().expect("tempdir");
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"not an ELF file").expect("write");
        let key = key_of(&File::open(&plain).expect("open")).expect("key");
        assert!(key.starts_with("f-"), "{key}");
    }
}
