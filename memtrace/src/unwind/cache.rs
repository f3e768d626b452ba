//! The on-disk cache of packed unwind tables (`--table-cache DIR|off`): one
//! file per object in the cache directory ([`crate::disk_cache`]: its
//! ownership and mode checks, its bound and eviction), named by the
//! object's key (the ELF build-id, or without one the file's device, inode,
//! size and modification time), so a later attach to the same objects loads
//! their tables instead of building them again.
//!
//! Every file read is checked in full (magic, format version, architecture,
//! the table builder's identity, key, sizes, CRC-32, and every row, rule
//! and page index in bounds) before it is used: a truncated or altered file
//! is rejected, removed and rebuilt, never trusted.

use std::path::Path;

use memtrace_common::unwind::{PageRow, UnwindRule, PAGE_SHIFT};

use crate::disk_cache::{fnv1a, Kind, Refused, Store, FNV_START};
pub use crate::disk_cache::{key_of, CacheStats, Rejected, Setting, DEFAULT_DIR, DEFAULT_MIB};
use crate::unwind::table::Packed;

const MAGIC: &[u8; 8] = b"MTUNWTBL";
/// Bumped whenever the file layout changes.
const FORMAT_VERSION: u32 = 1;
/// The builder's identity: a hash of the sources that make the rows and
/// pack them, so a memtrace whose builder differs never uses another's tables.
const BUILDER: u64 = fnv1a(
    fnv1a(
        fnv1a(FNV_START, include_bytes!("cfi.rs")),
        include_bytes!("table.rs"),
    ),
    include_bytes!("../../../memtrace-common/src/unwind.rs"),
);

#[cfg(target_arch = "aarch64")]
const ARCH: u32 = 2;
#[cfg(not(target_arch = "aarch64"))]
const ARCH: u32 = 1;

/// What a cached table holds: the packed table and what the report counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    pub packed: Packed,
    /// Rows before packing (the report's `rows`).
    pub source_rows: u64,
    /// Malformed CFI entries the builder skipped.
    pub malformed: u64,
}

/// The cache directory, for tables.
#[derive(Clone, Debug)]
pub struct TableCache {
    store: Store,
}

impl TableCache {
    /// Opens (creating it 0700 when missing) the cache directory `dir`,
    /// refused when it is a link, owned by another user, or open to others.
    pub fn open(dir: &Path, max_bytes: u64) -> Result<TableCache, Refused> {
        Store::open(dir, max_bytes).map(|store| TableCache { store })
    }

    #[cfg(test)]
    fn path_of(&self, key: &str) -> std::path::PathBuf {
        self.store.path_of(Kind::Table, key)
    }

    /// The table cached under `key`: `Ok(None)` when there is none, `Err`
    /// when the file was refused (it is removed, to be rebuilt).
    pub fn load(&self, key: &str) -> Result<Option<Entry>, Rejected> {
        self.store
            .load(Kind::Table, key, |bytes| decode(bytes, key))
    }

    /// Writes `entry` under `key` (a new 0600 file renamed into place);
    /// returns its size.
    pub fn store(&self, key: &str, entry: &Entry) -> std::io::Result<u64> {
        self.store.store(Kind::Table, key, &encode(key, entry))
    }

    /// Removes the least recently used files until the directory holds at
    /// most its bound; returns how many were removed.
    pub fn evict(&self) -> u64 {
        self.store.evict()
    }
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
    fn a_stored_table_loads_back_identical() {
        let (_parent, cache) = cache(DEFAULT_MIB << 20);
        assert_eq!(cache.load("b-01").expect("no error"), None);
        cache.store("b-01", &entry()).expect("stores");
        assert_eq!(cache.load("b-01").expect("valid"), Some(entry()));
        assert!(cache.path_of("b-01").ends_with("b-01.tbl"));
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
}
