//! The search for allocator functions with its on-disk cache
//! (`--table-cache DIR|off`, beside the unwind tables): what searching an
//! object's symbol tables found ([`Found`]: the functions, their offsets,
//! placements and argument registers, forwarders, refused entries; "none"
//! too), kept per object so that a later attach to the same objects skips
//! the search (most of a warm attach to a PyTorch process).
//!
//! A file is named by the object's key ([`disk_cache::key_of`]) and by the
//! identity of everything else the search depends on ([`inputs`]: the
//! catalogue, every field of every definition in order, so `--allocators`,
//! `--symbol-prefix`, `--pairs` and `--preset` count; `--entry-probes`; the
//! architecture; the searching code and its dependencies), so another
//! catalogue or flag set never reuses a plan: it misses. It is JSON
//! followed by a line with its CRC-32, and is checked in full before use
//! (checksum, format, memtrace version, architecture, inputs, key, every
//! name one of the catalogue's, every offset inside the object and the
//! placement window, every argument register real): a truncated, altered
//! or foreign file is rejected, removed and searched again, never trusted.
//! The directory, its checks and its bound are [`crate::disk_cache`]'s.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::catalog::FuncDef;
use super::elf::ElfError;
use super::placement::{ARG_REGS, WINDOW};
use super::plan::{self, Found, LibraryPlan};
use crate::arch::Arch;
use crate::disk_cache::{self, fnv1a, CacheStats, Kind, Refused, Rejected, Store, FNV_START};

const MAGIC: &str = "memtrace-functions";
/// Bumped whenever the file layout changes.
const FORMAT_VERSION: u32 = 1;
/// The searching code's identity: a hash of the sources that find the
/// functions and place their probes, and of the locked dependencies (the
/// ELF reader, the instruction decoder).
const BUILDER: u64 = {
    let mut hash = fnv1a(FNV_START, include_bytes!("plan.rs"));
    hash = fnv1a(hash, include_bytes!("elf.rs"));
    hash = fnv1a(hash, include_bytes!("catalog.rs"));
    hash = fnv1a(hash, include_bytes!("placement/mod.rs"));
    hash = fnv1a(hash, include_bytes!("placement/x86.rs"));
    hash = fnv1a(hash, include_bytes!("placement/arm64.rs"));
    hash = fnv1a(hash, include_bytes!("placement/a64.rs"));
    fnv1a(hash, include_bytes!("../../../Cargo.lock"))
};
/// The trailer: a newline, the CRC-32 of the JSON before it in 8 hex
/// digits, a newline.
const TRAILER: usize = 10;

/// The identity of what a search depends on besides the object: the
/// searching code, `arch`, `place` and every field of every definition of
/// `catalog`, in order.
pub fn inputs(arch: Arch, catalog: &[&FuncDef], place: bool) -> u64 {
    let mut hash = fnv1a(BUILDER, &FORMAT_VERSION.to_le_bytes());
    hash = fnv1a(hash, arch.name().as_bytes());
    hash = fnv1a(hash, &[u8::from(place)]);
    for def in catalog {
        hash = fnv1a(hash, format!("{def:?}\n").as_bytes());
    }
    hash
}

/// A cache file's JSON.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    magic: String,
    format: u32,
    /// The memtrace that wrote it.
    version: String,
    arch: String,
    /// [`inputs`].
    inputs: u64,
    /// The object's key.
    key: String,
    found: Found,
}

/// The open cache, for one catalogue and flag set.
#[derive(Clone, Debug)]
struct Cache {
    store: Store,
    inputs: u64,
}

/// Searching objects for one catalogue's functions, through the cache
/// when it is open.
#[derive(Clone, Debug)]
pub struct FunctionSearch {
    catalog: Vec<&'static FuncDef>,
    place: bool,
    arch: Arch,
    cache: Option<Cache>,
}

impl FunctionSearch {
    /// Searches for `catalog`'s functions; `place`: moves probes to cheaper
    /// spots where safe (see `probe::placement`). No cache until
    /// [`Self::use_cache`].
    pub fn new(catalog: Vec<&'static FuncDef>, place: bool) -> Self {
        FunctionSearch {
            catalog,
            place,
            arch: Arch::HOST,
            cache: None,
        }
    }

    /// The functions searched for.
    pub fn catalog(&self) -> &[&'static FuncDef] {
        &self.catalog
    }

    /// Uses the cache directory `dir` (bounded to `max_bytes`, every kind of
    /// file together); refused: searches go uncached.
    pub fn use_cache(&mut self, dir: &Path, max_bytes: u64) -> Result<(), Refused> {
        self.cache = None;
        let store = Store::open(dir, max_bytes)?;
        self.cache = Some(Cache {
            store,
            inputs: inputs(self.arch, &self.catalog, self.place),
        });
        Ok(())
    }

    /// The file name of `key`'s entry for this catalogue.
    fn name(cache: &Cache, key: &str) -> String {
        format!("{key}.{:016x}", cache.inputs)
    }

    /// Plans the probes of the object at `path` (as the target sees it;
    /// `open_path` as memtrace opens it): from the cache when it holds its
    /// search, else searched (and stored). What it did to the cache comes
    /// with it (nothing without one).
    pub fn plan(
        &self,
        path: &Path,
        open_path: &Path,
    ) -> (Result<Option<LibraryPlan>, ElfError>, CacheStats) {
        let mut counts = CacheStats::default();
        let Some(cache) = &self.cache else {
            return (self.search(path, open_path).map(|(plan, _)| plan), counts);
        };
        // A file that cannot be opened is the search's to report.
        let object = std::fs::File::open(open_path)
            .ok()
            .and_then(|file| Some((disk_cache::key_of(&file)?, file.metadata().ok()?.len())));
        if let Some((key, len)) = &object {
            let loaded = cache
                .store
                .load(Kind::Functions, &Self::name(cache, key), |bytes| {
                    decode(bytes, key, cache.inputs, self.arch, *len, &self.catalog)
                });
            match loaded {
                Ok(Some(found)) => {
                    counts.hits += 1;
                    return (Ok(found.resolve(path, open_path, &self.catalog)), counts);
                }
                Ok(None) => {}
                Err(why) => {
                    counts.rejected += 1;
                    counts
                        .failures
                        .push(format!("cached functions rejected: {why}"));
                }
            }
        }
        counts.misses += 1;
        let planned = self.search(path, open_path);
        if let (Ok((_, found)), Some((key, _))) = (&planned, &object) {
            let written = encode(key, cache.inputs, self.arch, found)
                .map_err(std::io::Error::other)
                .and_then(|bytes| {
                    cache
                        .store
                        .store(Kind::Functions, &Self::name(cache, key), &bytes)
                });
            match written {
                Ok(_) => counts.stored += 1,
                Err(err) => counts
                    .failures
                    .push(format!("cannot cache its functions: {err}")),
            }
        }
        (planned.map(|(plan, _)| plan), counts)
    }

    /// Searches the object, uncached: its plan and what was found.
    fn search(
        &self,
        path: &Path,
        open_path: &Path,
    ) -> Result<(Option<LibraryPlan>, Found), ElfError> {
        let found = plan::search_as(self.arch, open_path, &self.catalog, self.place)?;
        Ok((found.clone().resolve(path, open_path, &self.catalog), found))
    }

    /// Keeps the cache directory under its bound after files were stored;
    /// how many were removed.
    pub fn evict(&self) -> u64 {
        self.cache.as_ref().map_or(0, |cache| cache.store.evict())
    }
}

/// A cache file: the JSON of [`Stored`], then the trailer.
fn encode(key: &str, inputs: u64, arch: Arch, found: &Found) -> serde_json::Result<Vec<u8>> {
    let stored = Stored {
        magic: MAGIC.into(),
        format: FORMAT_VERSION,
        version: env!("CARGO_PKG_VERSION").into(),
        arch: arch.name().into(),
        inputs,
        key: key.into(),
        found: found.clone(),
    };
    let mut out = serde_json::to_vec(&stored)?;
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(format!("\n{crc:08x}\n").as_bytes());
    Ok(out)
}

/// Decodes a cache file's bytes, checking everything the probes rely on:
/// the entry of `key` (an object of `len` bytes) for `inputs`, `arch`
/// and `catalog`.
fn decode(
    bytes: &[u8],
    key: &str,
    inputs: u64,
    arch: Arch,
    len: u64,
    catalog: &[&'static FuncDef],
) -> Result<Found, Rejected> {
    let body_len = bytes.len().checked_sub(TRAILER).ok_or(Rejected::Size)?;
    let (body, trailer) = bytes.split_at(body_len);
    let crc = match trailer {
        [b'\n', digits @ .., b'\n'] => std::str::from_utf8(digits)
            .ok()
            .filter(|d| d.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|d| u32::from_str_radix(d, 16).ok()),
        _ => None,
    }
    .ok_or(Rejected::Size)?;
    if crc32fast::hash(body) != crc {
        return Err(Rejected::Checksum);
    }
    let stored: Stored = serde_json::from_slice(body).map_err(|_| Rejected::Format)?;
    if stored.magic != MAGIC
        || stored.format != FORMAT_VERSION
        || stored.version != env!("CARGO_PKG_VERSION")
        || stored.arch != arch.name()
        || stored.inputs != inputs
    {
        return Err(Rejected::Format);
    }
    if stored.key != key {
        return Err(Rejected::Key);
    }
    check(&stored.found, len, catalog)?;
    Ok(stored.found)
}

/// Every name one of `catalog`'s and defined by the object, every entry
/// once and inside its `len` bytes, every probe inside the placement
/// window, every argument register one of the [`ARG_REGS`].
fn check(found: &Found, len: u64, catalog: &[&'static FuncDef]) -> Result<(), Rejected> {
    let defined = |name: &String| found.defined.contains(name);
    let names_defined = found
        .functions
        .iter()
        .flat_map(|f| std::iter::once(&f.function).chain(&f.aliases))
        .chain(found.forwarders.iter().map(|(from, _)| from))
        .chain(found.refused.iter().map(|(function, _)| function))
        .all(defined);
    if !found.names_known(catalog) || !names_defined {
        return Err(Rejected::Bounds);
    }
    let mut entries: Vec<u64> = Vec::with_capacity(found.functions.len());
    for function in &found.functions {
        let inside = function.probe_offset < WINDOW as u64
            && function
                .file_offset
                .checked_add(function.probe_offset)
                .is_some_and(|at| at < len);
        if !inside || function.args.iter().any(|&reg| reg >= ARG_REGS) {
            return Err(Rejected::Bounds);
        }
        if entries.contains(&function.file_offset) {
            return Err(Rejected::Bounds);
        }
        entries.push(function.file_offset);
    }
    Ok(())
}

#[cfg(test)]
mod tests;
