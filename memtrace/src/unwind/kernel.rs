//! Loading unwind tables and per-process mappings into the eBPF maps the
//! in-kernel unwinder reads (`UNWIND_ROWS`, `UNWIND_PAGES`, `UNWIND_TABLES`,
//! `PROC_SLOTS`, `PROC_SLOT_CACHE`, `PROC_MAPS`).
//!
//! Tables are built once per file (device, inode) and shared by every process
//! mapping it; the objects new to a process are prepared in parallel (loaded
//! from the on-disk [`cache`] or built), then copied into the maps. Table
//! memory is bounded by `--unwind-table-mib`: an object whose table does not
//! fit is left to frame pointers and named in the report.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use aya::Ebpf;
use memtrace_common::unwind::{
    slot_cache_entry, MapEntry, PageChunk, PageRow, ProcMaps, RowChunk, RuleChunk, TableInfo,
    UnwindRule, MAX_MAPPINGS, PAGES_PER_CHUNK, ROWS_PER_CHUNK, RULES_PER_CHUNK, SLOT_CACHE_ENTRIES,
    TABLE_CAPPED, TABLE_NONE,
};
use serde::{Deserialize, Serialize};

use crate::probe::maps::Mapping;
use crate::unwind::cache::{self, CacheStats, TableCache};
use crate::unwind::cfi;
use crate::unwind::table;

/// Most objects with a table (the `UNWIND_TABLES` map's size).
pub const MAX_TABLES: u32 = 4096;

/// Sizes of the unwinder's maps, chosen before the eBPF object is loaded.
#[derive(Clone, Copy, Debug)]
pub struct Capacity {
    pub row_chunks: u32,
    pub rule_chunks: u32,
    pub page_chunks: u32,
    pub processes: u32,
}

impl Capacity {
    /// Splits `mib` of table memory between rows, rule dictionaries and the
    /// page index (each about 1/50 of the rows on real objects).
    pub fn from_mib(mib: u32, processes: u32) -> Self {
        let chunks = (u64::from(mib.max(1)) << 20) / 4096;
        let small = (chunks / 16).max(1);
        let clamp = |n: u64| u32::try_from(n).unwrap_or(u32::MAX).max(1);
        Capacity {
            row_chunks: clamp(chunks.saturating_sub(2 * small)),
            rule_chunks: clamp(small),
            page_chunks: clamp(small),
            processes: processes.max(1),
        }
    }

    /// One element of everything (the unwinder unused).
    pub fn minimal() -> Self {
        Capacity {
            row_chunks: 1,
            rule_chunks: 1,
            page_chunks: 1,
            processes: 1,
        }
    }
}

/// What the unwinder's tables hold, for the report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UnwindSummary {
    /// `dwarf` or `fp`.
    pub mode: String,
    /// Objects with a table in the kernel.
    pub objects: u64,
    /// Rows loaded (after merging).
    pub rows: u64,
    /// Kernel memory the tables use and the cap (`--unwind-table-mib`).
    pub kernel_bytes_used: u64,
    pub kernel_bytes_reserved: u64,
    /// Milliseconds spent preparing tables (loaded from the cache or built,
    /// in parallel), wall clock.
    pub build_ms: u64,
    /// Milliseconds spent copying tables into the kernel's maps.
    #[serde(default)]
    pub load_ms: u64,
    /// The on-disk table cache (`--table-cache`): hits, misses, rejected
    /// files, evictions; `None` when it is off.
    #[serde(default)]
    pub cache: Option<CacheStats>,
    /// Objects whose table did not fit the cap (frame pointers only).
    pub capped: Vec<String>,
    /// Objects without usable CFI, with why (frame pointers only).
    pub without_cfi: Vec<String>,
    /// Processes with more executable mappings than the unwinder can hold.
    pub mapping_overflows: u64,
}

#[derive(Clone, Copy)]
enum FileTable {
    Loaded(u32),
    Capped,
    None,
}

/// Kernel bytes a packed table takes (whole 4 KiB chunks of rows, rules and
/// page index).
pub fn kernel_bytes(packed: &table::Packed) -> u64 {
    let chunks = packed.rows.len().div_ceil(ROWS_PER_CHUNK as usize)
        + packed.rules.len().div_ceil(RULES_PER_CHUNK as usize)
        + packed.pages.len().div_ceil(PAGES_PER_CHUNK as usize);
    chunks as u64 * 4096 + std::mem::size_of::<TableInfo>() as u64
}

/// The unwinder's maps and the tables loaded so far.
pub struct UnwindTables {
    rows: Array<MapData, RowChunk>,
    rules: Array<MapData, RuleChunk>,
    pages: Array<MapData, PageChunk>,
    tables: Array<MapData, TableInfo>,
    slots: BpfHashMap<MapData, u32, u32>,
    /// The same, for most processes, in an array the kernel reads without
    /// a hash look-up (`PROC_SLOT_CACHE`).
    slot_cache: Array<MapData, u64>,
    proc_maps: Array<MapData, ProcMaps>,
    capacity: Capacity,
    next_row_chunk: u32,
    next_rule_chunk: u32,
    next_page_chunk: u32,
    next_table: u32,
    by_file: HashMap<(u64, u64), FileTable>,
    slot_of: HashMap<u32, (u32, Vec<MapEntry>)>,
    free_slots: Vec<u32>,
    /// The generation of the last process list written.
    generation: u32,
    /// The on-disk cache of built tables (`--table-cache`).
    cache: Option<TableCache>,
    summary: UnwindSummary,
}

impl UnwindTables {
    /// Takes the unwinder's maps out of a loaded eBPF object.
    pub fn take(ebpf: &mut Ebpf, capacity: Capacity) -> anyhow::Result<Self> {
        let mut take = |name: &str| {
            ebpf.take_map(name)
                .ok_or_else(|| anyhow::anyhow!("map {name} missing from the eBPF object"))
        };
        let rows = Array::try_from(take("UNWIND_ROWS")?)?;
        let rules = Array::try_from(take("UNWIND_RULES")?)?;
        let pages = Array::try_from(take("UNWIND_PAGES")?)?;
        let tables = Array::try_from(take("UNWIND_TABLES")?)?;
        let slots = BpfHashMap::try_from(take("PROC_SLOTS")?)?;
        let slot_cache = Array::try_from(take("PROC_SLOT_CACHE")?)?;
        let proc_maps = Array::try_from(take("PROC_MAPS")?)?;
        Ok(UnwindTables {
            rows,
            rules,
            pages,
            tables,
            slots,
            slot_cache,
            proc_maps,
            capacity,
            next_row_chunk: 0,
            next_rule_chunk: 0,
            next_page_chunk: 0,
            next_table: 0,
            by_file: HashMap::new(),
            slot_of: HashMap::new(),
            free_slots: (0..capacity.processes).rev().collect(),
            generation: 0,
            cache: None,
            summary: UnwindSummary {
                mode: "dwarf".into(),
                kernel_bytes_reserved: (u64::from(capacity.row_chunks)
                    + u64::from(capacity.rule_chunks)
                    + u64::from(capacity.page_chunks))
                    * 4096,
                ..UnwindSummary::default()
            },
        })
    }

    pub fn summary(&self) -> UnwindSummary {
        self.summary.clone()
    }

    /// Uses the on-disk table cache `setting` names; a directory refused
    /// (another owner, open to others) is one warning, and tables are built.
    pub fn use_cache(&mut self, setting: &cache::Setting, max_bytes: u64) {
        let cache::Setting::Dir(dir) = setting else {
            self.cache = None;
            self.summary.cache = None;
            return;
        };
        let mut stats = CacheStats {
            dir: dir.display().to_string(),
            ..CacheStats::default()
        };
        match TableCache::open(dir, max_bytes) {
            Ok(cache) => self.cache = Some(cache),
            Err(err) => {
                let line = format!("--table-cache {err}: tables are built, not cached");
                eprintln!("memtrace: warning: {line}");
                stats.failures.push(line);
                self.cache = None;
            }
        }
        self.summary.cache = Some(stats);
    }

    /// Gives process `pid` the unwinder's view of `mappings` (building the
    /// tables of objects not seen before). Cheap when nothing changed.
    pub fn update_process(
        &mut self,
        pid: u32,
        mappings: &[Mapping],
        open_path: &dyn Fn(&Path) -> Option<PathBuf>,
    ) {
        self.prepare_new(mappings, open_path);
        let mut entries: Vec<MapEntry> = Vec::new();
        for mapping in mappings.iter().filter(|m| m.executable) {
            let known = self.by_file.get(&(mapping.dev, mapping.inode));
            let table = match (mapping.is_file() && !mapping.deleted, known) {
                (true, Some(FileTable::Loaded(index))) => *index,
                (true, Some(FileTable::Capped)) => TABLE_CAPPED,
                _ => TABLE_NONE,
            };
            entries.push(MapEntry {
                start: mapping.start,
                end: mapping.end,
                bias: mapping.start.wrapping_sub(mapping.file_offset),
                table,
                _pad: 0,
            });
        }
        entries.sort_by_key(|e| e.start);
        log::debug!("unwinder: pid {pid}: {} executable mappings", entries.len());
        if entries.len() > MAX_MAPPINGS {
            self.summary.mapping_overflows += 1;
            entries.truncate(MAX_MAPPINGS);
        }
        if self
            .slot_of
            .get(&pid)
            .is_some_and(|(_, old)| *old == entries)
        {
            return;
        }
        let slot = match self.slot_of.get(&pid) {
            Some(&(slot, _)) => slot,
            None => match self.free_slots.pop() {
                Some(slot) => slot,
                None => {
                    log::warn!("unwinder: no room for pid {pid}'s mappings (frame pointers only)");
                    return;
                }
            },
        };
        self.generation = self.generation.wrapping_add(1);
        let mut maps = ProcMaps {
            len: entries.len() as u32,
            generation: self.generation,
            entries: [MapEntry::default(); MAX_MAPPINGS],
        };
        maps.entries[..entries.len()].copy_from_slice(&entries);
        if let Err(err) = self.proc_maps.set(slot, maps, 0) {
            log::warn!("unwinder: cannot store pid {pid}'s mappings: {err}");
            return;
        }
        if let Err(err) = self.slots.insert(pid, slot, 0) {
            log::warn!("unwinder: cannot register pid {pid}: {err}");
            return;
        }
        // Cleared first: a reader never sees this tgid with another slot.
        let index = pid % SLOT_CACHE_ENTRIES;
        let _ = self.slot_cache.set(index, 0, 0);
        let _ = self.slot_cache.set(index, slot_cache_entry(pid, slot), 0);
        self.slot_of.insert(pid, (slot, entries));
    }

    /// Forgets a process that is no longer traced.
    pub fn remove_process(&mut self, pid: u32) {
        if let Some((slot, _)) = self.slot_of.remove(&pid) {
            let _ = self.slots.remove(&pid);
            let index = pid % SLOT_CACHE_ENTRIES;
            if self.slot_cache.get(&index, 0).ok() == Some(slot_cache_entry(pid, slot)) {
                let _ = self.slot_cache.set(index, 0, 0);
            }
            self.free_slots.push(slot);
        }
    }

    /// Prepares the tables of the objects in `mappings` not seen before (in
    /// parallel: loaded from the cache or built), then copies them into the
    /// kernel in the order mapped.
    fn prepare_new(&mut self, mappings: &[Mapping], open_path: &dyn Fn(&Path) -> Option<PathBuf>) {
        let mut new: Vec<((u64, u64), &Path, Option<PathBuf>)> = Vec::new();
        for mapping in mappings.iter().filter(|m| m.executable && m.is_file()) {
            let key = (mapping.dev, mapping.inode);
            if let (Some(path), false) = (&mapping.path, mapping.deleted) {
                if !self.by_file.contains_key(&key) && !new.iter().any(|(k, _, _)| *k == key) {
                    new.push((key, path, open_path(path)));
                }
            }
        }
        if new.is_empty() {
            return;
        }
        let started = Instant::now();
        let opens: Vec<Option<&Path>> = new.iter().map(|(_, _, open)| open.as_deref()).collect();
        let prepared = prepare_all(&opens, self.cache.as_ref());
        self.summary.build_ms += started.elapsed().as_millis() as u64;
        let started = Instant::now();
        let mut stored = false;
        for ((key, path, _), (built, counts)) in new.iter().zip(prepared) {
            stored |= counts.stored > 0;
            if let Some(stats) = self.summary.cache.as_mut() {
                stats.add(&counts, path);
            }
            let state = self.take_prepared(path, built);
            self.by_file.insert(*key, state);
        }
        self.summary.load_ms += started.elapsed().as_millis() as u64;
        if let (true, Some(cache), Some(stats)) =
            (stored, self.cache.as_ref(), self.summary.cache.as_mut())
        {
            stats.evicted += cache.evict();
        }
        log::info!(
            "unwinder: {} objects: tables prepared in {} ms so far, loaded into the kernel in {} ms so far",
            new.len(),
            self.summary.build_ms,
            self.summary.load_ms
        );
    }

    /// Loads one prepared table into the kernel; what the object's mappings
    /// point at.
    fn take_prepared(&mut self, path: &Path, built: Result<cache::Entry, String>) -> FileTable {
        let entry = match built {
            Ok(entry) => entry,
            Err(why) => {
                self.summary
                    .without_cfi
                    .push(format!("{}: {why}", path.display()));
                return FileTable::None;
            }
        };
        if entry.malformed > 0 {
            let line = format!(
                "{}: {} malformed CFI entries skipped (stacks through them use frame pointers)",
                path.display(),
                entry.malformed
            );
            eprintln!("memtrace: warning: {line}");
            self.summary.without_cfi.push(line);
        }
        if entry.packed.rows.is_empty() {
            return FileTable::None;
        }
        match self.load(&entry.packed) {
            Some(index) => {
                self.summary.objects += 1;
                self.summary.rows += entry.source_rows;
                FileTable::Loaded(index)
            }
            None => {
                self.summary.capped.push(path.display().to_string());
                FileTable::Capped
            }
        }
    }

    /// Copies one table into the kernel; `None` when it does not fit.
    fn load(&mut self, packed: &table::Packed) -> Option<u32> {
        let row_chunks = packed.rows.len().div_ceil(ROWS_PER_CHUNK as usize) as u32;
        let rule_chunks = packed.rules.len().div_ceil(RULES_PER_CHUNK as usize) as u32;
        let page_chunks = packed.pages.len().div_ceil(PAGES_PER_CHUNK as usize) as u32;
        if self.next_table >= MAX_TABLES
            || self.next_row_chunk + row_chunks > self.capacity.row_chunks
            || self.next_rule_chunk + rule_chunks > self.capacity.rule_chunks
            || self.next_page_chunk + page_chunks > self.capacity.page_chunks
        {
            return None;
        }
        let row_start = self.next_row_chunk * ROWS_PER_CHUNK;
        let rule_start = self.next_rule_chunk * RULES_PER_CHUNK;
        let page_start = self.next_page_chunk * PAGES_PER_CHUNK;
        for (i, part) in packed.rows.chunks(ROWS_PER_CHUNK as usize).enumerate() {
            let mut chunk = RowChunk {
                rows: [PageRow::default(); ROWS_PER_CHUNK as usize],
            };
            chunk.rows[..part.len()].copy_from_slice(part);
            if let Err(err) = self.rows.set(self.next_row_chunk + i as u32, chunk, 0) {
                log::warn!("unwinder: cannot load rows: {err}");
                return None;
            }
        }
        for (i, part) in packed.rules.chunks(RULES_PER_CHUNK as usize).enumerate() {
            let mut chunk = RuleChunk {
                rules: [UnwindRule::default(); RULES_PER_CHUNK as usize],
            };
            chunk.rules[..part.len()].copy_from_slice(part);
            if let Err(err) = self.rules.set(self.next_rule_chunk + i as u32, chunk, 0) {
                log::warn!("unwinder: cannot load rules: {err}");
                return None;
            }
        }
        for (i, part) in packed.pages.chunks(PAGES_PER_CHUNK as usize).enumerate() {
            let mut chunk = PageChunk {
                first_row: [0; PAGES_PER_CHUNK as usize],
            };
            for (slot, &row) in chunk.first_row.iter_mut().zip(part) {
                *slot = row_start + row;
            }
            if let Err(err) = self.pages.set(self.next_page_chunk + i as u32, chunk, 0) {
                log::warn!("unwinder: cannot load the page index: {err}");
                return None;
            }
        }
        let index = self.next_table;
        let info = TableInfo {
            row_start,
            row_count: packed.rows.len() as u32,
            page_start,
            page_count: packed.pages.len() as u32,
            base: packed.base,
            rule_start,
        };
        if let Err(err) = self.tables.set(index, info, 0) {
            log::warn!("unwinder: cannot register a table: {err}");
            return None;
        }
        self.next_table += 1;
        self.next_row_chunk += row_chunks;
        self.next_rule_chunk += rule_chunks;
        self.next_page_chunk += page_chunks;
        self.summary.kernel_bytes_used = (u64::from(self.next_row_chunk)
            + u64::from(self.next_rule_chunk)
            + u64::from(self.next_page_chunk))
            * 4096
            + u64::from(self.next_table) * std::mem::size_of::<TableInfo>() as u64;
        Some(index)
    }
}

/// What preparing one object's table gave, and what it did to the cache.
type Prepared = (Result<cache::Entry, String>, CacheStats);

/// Prepares the tables of `opens` (each object's path as memtrace opens it;
/// `None`: outside the target's root) on every core, the biggest objects
/// first; results in `opens`' order.
fn prepare_all(opens: &[Option<&Path>], cache: Option<&TableCache>) -> Vec<Prepared> {
    let sizes = crate::parallel::file_sizes(opens.iter().copied());
    crate::parallel::map(opens, &crate::parallel::biggest_first(&sizes), |open| {
        prepare(*open, cache)
    })
}

/// One object's table: from the cache when it holds a valid one, else built
/// from the object's CFI (and stored).
fn prepare(open: Option<&Path>, cache: Option<&TableCache>) -> Prepared {
    let mut counts = CacheStats::default();
    let Some(open) = open else {
        return (
            Err("its path leads outside the target's root".into()),
            counts,
        );
    };
    let mut file = match std::fs::File::open(open) {
        Ok(file) => file,
        Err(err) => return (Err(err.to_string()), counts),
    };
    let key = cache.and_then(|_| cache::key_of(&file));
    if let (Some(cache), Some(key)) = (cache, key.as_deref()) {
        match cache.load(key) {
            Ok(Some(entry)) => {
                counts.hits += 1;
                return (Ok(entry), counts);
            }
            Ok(None) => {}
            Err(why) => {
                counts.rejected += 1;
                counts
                    .failures
                    .push(format!("cached table rejected: {why}"));
            }
        }
    }
    if cache.is_some() {
        counts.misses += 1;
    }
    let built = build(&mut file);
    if let (Ok(entry), Some(cache), Some(key)) = (&built, cache, key.as_deref()) {
        match cache.store(key, entry) {
            Ok(_) => counts.stored += 1,
            Err(err) => counts
                .failures
                .push(format!("cannot cache its table: {err}")),
        }
    }
    (built, counts)
}

/// Builds and packs an object's table from its CFI (reading only the
/// object's headers and CFI sections).
fn build(file: &mut std::fs::File) -> Result<cache::Entry, String> {
    let data = object::ReadCache::new(file);
    let rows = cfi::rows_from_elf(&data).map_err(|err| err.to_string())?;
    let packed = table::pack(&rows.rows)
        .ok_or_else(|| "more than 65536 distinct unwind rules".to_string())?;
    Ok(cache::Entry {
        packed,
        source_rows: rows.rows.len() as u64,
        malformed: rows.malformed as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prepared_tables_come_back_in_mapping_order_whatever_the_build_order() {
        let Ok(meta) = std::fs::metadata("/lib/x86_64-linux-gnu/libc.so.6") else {
            return;
        };
        assert!(meta.len() > 0);
        let libc = Path::new("/lib/x86_64-linux-gnu/libc.so.6");
        let missing = Path::new("/nonexistent/libfoo.so");
        let prepared = prepare_all(&[Some(missing), Some(libc), None], None);
        assert_eq!(prepared.len(), 3);
        assert!(prepared[0].0.is_err(), "the missing file");
        let libc_table = prepared[1].0.as_ref().expect("libc's table");
        assert!(libc_table.source_rows > 1000);
        assert_eq!(
            prepared[2].0.as_ref().err().map(String::as_str),
            Some("its path leads outside the target's root")
        );
        assert_eq!(prepared[1].1, CacheStats::default(), "no cache, no counts");
    }
}
