//! Loading unwind tables and per-process mappings into the eBPF maps the
//! in-kernel unwinder reads (`UNWIND_ROWS`, `UNWIND_PAGES`, `UNWIND_TABLES`,
//! `PROC_SLOTS`, `PROC_SLOT_CACHE`, `PROC_MAPS`).
//!
//! Tables are built once per file (device, inode) and shared by every process
//! mapping it; the objects new to a process are prepared in parallel (loaded
//! from the on-disk [`cache`] or built), then copied into the maps. Table
//! memory is bounded by `--unwind-table-mib`: an object whose table does not
//! fit is left to frame pointers and named in the report.
//!
//! With [`UnwindTables::defer_builds`] (attaching to a running process), only
//! cached tables are loaded before tracing starts: the others are built on a
//! thread of their own while tracing runs, their mappings marked
//! [`TABLE_PENDING`] (a walk reaching one ends there and is counted,
//! `stack_truncated_table_pending`), and [`UnwindTables::take_ready`] loads
//! each one as it is done and points the processes mapping it at it.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use aya::maps::{Array, HashMap as BpfHashMap, MapData};
use aya::Ebpf;
use memtrace_common::unwind::{
    slot_cache_entry, MapEntry, PageChunk, PageRow, ProcMaps, RowChunk, RuleChunk, TableInfo,
    UnwindRule, MAX_MAPPINGS, PAGES_PER_CHUNK, ROWS_PER_CHUNK, RULES_PER_CHUNK, SLOT_CACHE_ENTRIES,
    TABLE_CAPPED, TABLE_NONE, TABLE_PENDING,
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
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct UnwindSummary {
    /// `dwarf` or `fp`.
    pub mode: String,
    /// Objects with a table in the kernel.
    pub objects: u64,
    /// Rows loaded (after merging).
    pub rows: u64,
    /// Bytes of kernel map memory the loaded tables take (their 4 KiB
    /// chunks of rows, rules and page index, and one entry per object).
    pub kernel_bytes_used: u64,
    /// Bytes of kernel map memory reserved for the tables' rows, rules and
    /// page index: `--unwind-table-mib`, in 4 KiB chunks (the cap).
    pub kernel_bytes_reserved: u64,
    /// Milliseconds spent preparing tables (loaded from the cache or built,
    /// in parallel), wall clock, in the event loop's way (before tracing, or
    /// for objects mapped later when tables are not deferred); the tables
    /// built while tracing runs are timed by `deferred_ms`.
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
    /// Objects whose tables were built while tracing ran (attached to a
    /// running process: tracing started before them; stacks reaching them
    /// meanwhile were cut and counted, `stack_truncated_table_pending`).
    #[serde(default)]
    pub deferred: u64,
    /// Milliseconds from tracing start (for objects mapped later: from when
    /// they were found, all others being in) to the last deferred table in
    /// the kernel (their build starts with tracing, so that the attach has
    /// the cores); `None` while some are still being built or none were.
    #[serde(default)]
    pub deferred_ms: Option<u64>,
    /// Deferred objects whose tables were still being built when this
    /// report was made.
    #[serde(default)]
    pub pending: Vec<String>,
    /// Times a deferred object was moved to the front of those still to
    /// build because a stack had just ended at it (the hot stacks' objects
    /// first).
    #[serde(default)]
    pub promoted: u64,
}

#[derive(Clone, Copy)]
enum FileTable {
    Loaded(u32),
    Capped,
    None,
    /// Being built on the background thread.
    Pending,
}

/// An object's identity: its file's (device, inode).
type FileKey = (u64, u64);

/// One object's table built on the background thread.
type Arrived = (FileKey, PathBuf, Prepared);

/// Tables being built while tracing runs.
struct Background {
    results: mpsc::Receiver<Arrived>,
    /// Sent to each batch's thread.
    sender: mpsc::Sender<Arrived>,
    /// Objects sent off and not yet back, with their paths.
    waiting: HashMap<FileKey, PathBuf>,
    /// Where each object sent off sits in its batch's queue.
    queued: HashMap<FileKey, (crate::parallel::Queue, usize)>,
    /// Objects moved to the front of their queue (see
    /// [`UnwindTables::promote`]).
    promoted: AtomicU64,
    /// When tracing started (the builds were let go).
    since: Instant,
    /// Objects set aside until tracing starts.
    held: Vec<Job>,
}

/// An object to build: its key, its path as mapped, and as memtrace opens
/// it (`None`: outside the target's root).
type Job = (FileKey, PathBuf, Option<PathBuf>);

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
    by_file: HashMap<FileKey, FileTable>,
    slot_of: HashMap<u32, (u32, Vec<MapEntry>)>,
    /// Each process's executable file mappings as last given: its list is
    /// written again when a table they map arrives.
    mappings_of: HashMap<u32, Vec<Mapping>>,
    /// Whether tables not in the cache are built while tracing runs.
    defer: bool,
    /// Whether tracing has started ([`UnwindTables::start_builds`]):
    /// deferred objects are then sent off at once.
    tracing: bool,
    background: Option<Background>,
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
            mappings_of: HashMap::new(),
            defer: false,
            tracing: false,
            background: None,
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
        let mut summary = self.summary.clone();
        if let Some(background) = &self.background {
            summary.promoted = background.promoted.load(Ordering::Relaxed);
            summary.pending = background
                .waiting
                .values()
                .map(|path| path.display().to_string())
                .collect();
            summary.pending.sort();
        }
        summary
    }

    /// Builds the tables of objects not in the cache on a thread of their
    /// own while tracing runs (`true`: attached to a running process), or
    /// before tracing starts (`false`: a launched command, held until then,
    /// or `--wait-for-tables`).
    pub fn defer_builds(&mut self, defer: bool) {
        self.defer = defer;
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
        let executable: Vec<Mapping> = mappings.iter().filter(|m| m.executable).cloned().collect();
        self.write_process(pid, &executable);
        self.mappings_of.insert(pid, executable);
    }

    /// Writes process `pid`'s list of executable `mappings`, each pointing
    /// at its object's table (or why it has none). Cheap when nothing
    /// changed.
    fn write_process(&mut self, pid: u32, mappings: &[Mapping]) {
        let mut entries: Vec<MapEntry> = Vec::new();
        for mapping in mappings.iter().filter(|m| m.executable) {
            let known = self.by_file.get(&(mapping.dev, mapping.inode));
            let table = match (mapping.is_file() && !mapping.deleted, known) {
                (true, Some(FileTable::Loaded(index))) => *index,
                (true, Some(FileTable::Capped)) => TABLE_CAPPED,
                (true, Some(FileTable::Pending)) => TABLE_PENDING,
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
        self.mappings_of.remove(&pid);
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
    /// kernel in the order mapped. With [`Self::defer_builds`], only the
    /// cached ones: the rest are sent to the background thread.
    fn prepare_new(&mut self, mappings: &[Mapping], open_path: &dyn Fn(&Path) -> Option<PathBuf>) {
        let mut new: Vec<Job> = Vec::new();
        for mapping in mappings.iter().filter(|m| m.executable && m.is_file()) {
            let key = (mapping.dev, mapping.inode);
            if let (Some(path), false) = (&mapping.path, mapping.deleted) {
                if !self.by_file.contains_key(&key) && !new.iter().any(|(k, _, _)| *k == key) {
                    new.push((key, path.clone(), open_path(path)));
                }
            }
        }
        if new.is_empty() {
            return;
        }
        let started = Instant::now();
        let opens: Vec<Option<&Path>> = new.iter().map(|(_, _, open)| open.as_deref()).collect();
        let cache = self.cache.as_ref();
        let prepared: Vec<Option<Prepared>> = if self.defer {
            let sizes = crate::parallel::file_sizes(opens.iter().copied());
            crate::parallel::map(&opens, &crate::parallel::biggest_first(&sizes), |open| {
                from_cache(*open, cache)
            })
        } else {
            prepare_all(&opens, cache).into_iter().map(Some).collect()
        };
        self.summary.build_ms += started.elapsed().as_millis() as u64;
        let started = Instant::now();
        let mut stored = false;
        let mut deferred = Vec::new();
        for ((key, path, open), prepared) in new.into_iter().zip(prepared) {
            let Some((built, counts)) = prepared else {
                self.by_file.insert(key, FileTable::Pending);
                deferred.push((key, path, open));
                continue;
            };
            stored |= counts.stored > 0;
            if let Some(stats) = self.summary.cache.as_mut() {
                stats.add(&counts, &path);
            }
            let state = self.take_prepared(&path, built);
            self.by_file.insert(key, state);
        }
        self.summary.load_ms += started.elapsed().as_millis() as u64;
        if stored {
            self.evict();
        }
        log::info!(
            "unwinder: tables prepared in {} ms so far, loaded into the kernel in {} ms so far; {} built while tracing runs",
            self.summary.build_ms,
            self.summary.load_ms,
            deferred.len()
        );
        if !deferred.is_empty() {
            self.build_in_background(deferred);
        }
    }

    /// Sends objects off to be built on a thread of their own (the biggest
    /// first) once tracing has started ([`Self::start_builds`]): until then
    /// they wait, so that the attach has the cores. [`Self::take_ready`]
    /// takes them as they are done.
    fn build_in_background(&mut self, jobs: Vec<Job>) {
        let background = self.background.get_or_insert_with(|| {
            let (sender, results) = mpsc::channel();
            Background {
                results,
                sender,
                waiting: HashMap::new(),
                queued: HashMap::new(),
                promoted: AtomicU64::new(0),
                since: Instant::now(),
                held: Vec::new(),
            }
        });
        self.summary.deferred += jobs.len() as u64;
        self.summary.deferred_ms = None;
        for (key, path, _) in &jobs {
            background.waiting.insert(*key, path.clone());
        }
        if self.tracing {
            if background.waiting.len() == jobs.len() {
                // The first objects deferred since the last were all in.
                background.since = Instant::now();
            }
            self.spawn_builds(jobs);
        } else {
            background.held.extend(jobs);
        }
    }

    /// Tracing has started: the objects set aside to build while it runs
    /// are sent off now, and later ones at once.
    pub fn start_builds(&mut self) {
        if std::mem::replace(&mut self.tracing, true) {
            return;
        }
        let Some(background) = self.background.as_mut() else {
            return;
        };
        background.since = Instant::now();
        let jobs = std::mem::take(&mut background.held);
        self.spawn_builds(jobs);
    }

    /// Starts the thread that builds `jobs`' tables.
    fn spawn_builds(&mut self, jobs: Vec<Job>) {
        let Some(background) = self.background.as_mut() else {
            return;
        };
        if jobs.is_empty() {
            return;
        }
        let sizes = crate::parallel::file_sizes(jobs.iter().map(|(_, _, open)| open.as_deref()));
        let order = crate::parallel::biggest_first(&sizes);
        let keys: Vec<FileKey> = jobs.iter().map(|(key, _, _)| *key).collect();
        let cache = self.cache.clone();
        let spawned = crate::parallel::spawn(
            "memtrace-tables",
            jobs,
            &order,
            move |(key, path, open)| (*key, path.clone(), prepare(open.as_deref(), cache.as_ref())),
            background.sender.clone(),
        );
        match spawned {
            Ok(queue) => {
                for (i, key) in keys.into_iter().enumerate() {
                    background.queued.insert(key, (queue.clone(), i));
                }
            }
            Err(err) => {
                // No thread: the objects are left to frame pointers, named.
                for key in keys {
                    let Some(path) = background.waiting.remove(&key) else {
                        continue;
                    };
                    self.summary.without_cfi.push(format!(
                        "{}: cannot start the thread that builds tables: {err}",
                        path.display()
                    ));
                    self.by_file.insert(key, FileTable::None);
                }
            }
        }
    }

    /// Moves the object that process `pid` maps at `addr` to the front of
    /// the tables still to build (a stack just ended there, waiting for
    /// it: the objects on the hot stacks are built first). Whether it moved.
    pub fn promote(&self, pid: u32, addr: u64) -> bool {
        let Some(background) = self.background.as_ref() else {
            return false;
        };
        if background.queued.is_empty() {
            return false;
        }
        let Some(mapping) = self
            .mappings_of
            .get(&pid)
            .and_then(|maps| maps.iter().find(|m| m.start <= addr && addr < m.end))
        else {
            return false;
        };
        let moved = background
            .queued
            .get(&(mapping.dev, mapping.inode))
            .is_some_and(|(queue, i)| queue.promote(*i));
        if moved {
            background.promoted.fetch_add(1, Ordering::Relaxed);
        }
        moved
    }

    /// Objects whose tables are being built while tracing runs.
    pub fn pending_count(&self) -> usize {
        self.background.as_ref().map_or(0, |b| b.waiting.len())
    }

    /// Loads the tables built in the background since the last call into
    /// the kernel and rewrites the lists of the processes that map them.
    /// Returns, when the last one being built arrived in this call, how
    /// many were built while tracing ran and how long it took (ms).
    pub fn take_ready(&mut self) -> Option<(u64, u64)> {
        let background = self.background.as_mut()?;
        let arrived: Vec<Arrived> = background.results.try_iter().collect();
        if arrived.is_empty() {
            return None;
        }
        let started = Instant::now();
        let mut stored = false;
        let mut keys = HashSet::new();
        for (key, path, (built, counts)) in arrived {
            stored |= counts.stored > 0;
            if let Some(stats) = self.summary.cache.as_mut() {
                stats.add(&counts, &path);
            }
            let state = self.take_prepared(&path, built);
            self.by_file.insert(key, state);
            keys.insert(key);
        }
        let mut done = None;
        if let Some(background) = self.background.as_mut() {
            background.waiting.retain(|key, _| !keys.contains(key));
            background.queued.retain(|key, _| !keys.contains(key));
            self.summary.promoted = background.promoted.load(Ordering::Relaxed);
            if background.waiting.is_empty() {
                let took = background.since.elapsed().as_millis() as u64;
                self.summary.deferred_ms = Some(took);
                done = Some((self.summary.deferred, took));
            }
        }
        let pids: Vec<u32> = self
            .mappings_of
            .iter()
            .filter(|(_, maps)| maps.iter().any(|m| keys.contains(&(m.dev, m.inode))))
            .map(|(pid, _)| *pid)
            .collect();
        for pid in pids {
            if let Some(maps) = self.mappings_of.get(&pid).cloned() {
                self.write_process(pid, &maps);
            }
        }
        self.summary.load_ms += started.elapsed().as_millis() as u64;
        if stored {
            self.evict();
        }
        done
    }

    /// Keeps the on-disk cache under its bound after tables were stored.
    fn evict(&mut self) {
        if let (Some(cache), Some(stats)) = (self.cache.as_ref(), self.summary.cache.as_mut()) {
            stats.evicted += cache.evict();
        }
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
        if let Some(entry) = cached(cache, key, &mut counts) {
            return (Ok(entry), counts);
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

/// One object's table when the cache holds a valid one (a hit); `None`
/// otherwise (nothing counted: [`prepare`] counts the miss or rejection
/// when it builds the table).
fn from_cache(open: Option<&Path>, cache: Option<&TableCache>) -> Option<Prepared> {
    let file = std::fs::File::open(open?).ok()?;
    let key = cache::key_of(&file)?;
    let mut counts = CacheStats::default();
    let entry = cached(cache?, &key, &mut counts)?;
    Some((Ok(entry), counts))
}

/// The table `cache` holds under `key`, counting a hit or a rejected file.
fn cached(cache: &TableCache, key: &str, counts: &mut CacheStats) -> Option<cache::Entry> {
    match cache.load(key) {
        Ok(Some(entry)) => {
            counts.hits += 1;
            Some(entry)
        }
        Ok(None) => None,
        Err(why) => {
            counts.rejected += 1;
            counts
                .failures
                .push(format!("cached table rejected: {why}"));
            None
        }
    }
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
