//! The blocks from before the attach: a leak check by pid walks glibc's
//! heap ([`crate::tracee::heap_walk`]) so that the blocks allocated before
//! memtrace came become nodes of the check too, and this module says what
//! the walk covered and how those blocks were judged
//! (`leak_check.before_attach`).

use std::path::Path;
use std::sync::Arc;

use crate::reach::{Category, Memory};
use crate::report::leak::{category_name, Amount, BeforeAttach, BlockGroup, HeapWalkSummary};
use crate::tracee::heap_walk::{self, HeapWalk};
use crate::tracee::maps::Mapping;

/// Groups kept in the report.
const GROUPS: usize = 50;

/// One judged block from before the attach.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub size: u64,
    pub category: Category,
    /// Its C++ type, by the vtable its first word points into (shared by
    /// every block of that type).
    pub type_name: Option<Arc<str>>,
}

/// Names the C++ type of blocks by their first word, where a vtable symbol
/// names it. Only a word inside a read-only file mapping may point into a
/// vtable: the others (most: pointers into the heap, and data) are passed
/// over without a lookup.
pub struct TypeNames<'a> {
    read_only: Vec<(u64, u64)>,
    /// The last gap between read-only mappings a word fell in: a heap's
    /// first words (pointers into it, small numbers) mostly fall in one.
    gap: (u64, u64),
    names: crate::tracee::vtables::VtableNames<'a>,
    known: foldhash::HashMap<u64, Option<Arc<str>>>,
}

impl<'a> TypeNames<'a> {
    pub fn new(pid: u32, mappings: &'a [Mapping]) -> TypeNames<'a> {
        let mut read_only: Vec<(u64, u64)> = mappings
            .iter()
            .filter(|m| m.is_file() && !m.writable)
            .map(|m| (m.start, m.end))
            .collect();
        read_only.sort_unstable();
        TypeNames {
            read_only,
            gap: (0, 0),
            names: crate::tracee::vtables::VtableNames::new(pid, mappings),
            known: Default::default(),
        }
    }

    /// The type of a block whose first word is `word`.
    pub fn of(&mut self, word: u64) -> Option<Arc<str>> {
        if (self.gap.0..self.gap.1).contains(&word) {
            return None;
        }
        let k = self.read_only.partition_point(|&(start, _)| start <= word);
        let before_end = k.checked_sub(1).map_or(0, |k| self.read_only[k].1);
        if word >= before_end {
            let after = self.read_only.get(k).map_or(u64::MAX, |m| m.0);
            self.gap = (before_end, after);
            return None;
        }
        let names = &mut self.names;
        self.known
            .entry(word)
            .or_insert_with(|| names.type_of(word).map(Arc::from))
            .clone()
    }
}

fn file_name(mapping: &Mapping) -> Option<&str> {
    mapping
        .path
        .as_deref()
        .and_then(Path::file_name)
        .and_then(|n| n.to_str())
}

/// Walks the heap of stopped process `pid`.
pub fn walk(
    pid: u32,
    mappings: &[Mapping],
    stacks: &[u64],
    memory: &mut dyn Memory,
) -> Result<HeapWalk, String> {
    let libc = mappings
        .iter()
        .find(|m| {
            m.is_file()
                && file_name(m)
                    .is_some_and(|n| n.starts_with("libc.so") || n.starts_with("libc-2."))
        })
        .ok_or("the process has no glibc mapped: its heap stays a root")?;
    let path = crate::tracee::files::open(pid, libc).map_err(|_| {
        format!(
            "{} cannot be opened",
            libc.path.as_deref().unwrap_or(Path::new("libc")).display()
        )
    })?;
    let image = std::fs::read(&path).map_err(|err| format!("{}: {err}", path.display()))?;
    let symbol = main_arena_symbol(pid, mappings);
    heap_walk::walk(mappings, &image, stacks, symbol, memory)
}

/// The address of `main_arena` in `pid`, from the `main_arena` symbol of
/// its libc's debug file (`libc6-dbg`, found by build-id: in the process's
/// root first, then on the host); `None` when no debug file of that build
/// is installed.
pub fn main_arena_symbol(pid: u32, mappings: &[Mapping]) -> Option<u64> {
    use object::{Object, ObjectSymbol};

    use crate::symbolize::debug;

    let libc = mappings
        .iter()
        .find(|m| m.is_file() && m.file_offset == 0 && crate::tracee::glibc_heap::is_libc(m))?;
    let path = crate::tracee::files::open(pid, libc).ok()?;
    let info = debug::ObjectInfo::read(&path).ok()?;
    let build_id = info.build_id.as_deref()?;
    let relative = debug::build_id_path(build_id)?;
    let candidates = debug::DEBUG_DIRS.iter().flat_map(|dir| {
        [
            std::path::PathBuf::from(format!("/proc/{pid}/root{dir}")).join(&relative),
            std::path::Path::new(dir).join(&relative),
        ]
    });
    let file = std::fs::File::open(debug::first_matching(build_id, candidates)?).ok()?;
    let cache = object::ReadCache::new(file);
    let elf = object::File::parse(&cache).ok()?;
    let symbol = elf
        .symbols()
        .find(|s| s.name() == Ok("main_arena") && s.size() > 0)?;
    // Where file offset 0 is mapped is the object's address of offset 0.
    let base = libc.start.checked_sub(info.virt_offset(0)?)?;
    base.checked_add(symbol.address())
}

/// One line for each allocator or runtime whose memory no walk covers.
pub fn notes(mappings: &[Mapping]) -> Vec<String> {
    let mut notes = Vec::new();
    let mapped = |prefix: &str| {
        mappings
            .iter()
            .any(|m| file_name(m).is_some_and(|n| n.starts_with(prefix)))
    };
    for (prefix, name) in [
        ("libjemalloc", "jemalloc"),
        ("libtcmalloc", "tcmalloc"),
        ("libmimalloc", "mimalloc"),
    ] {
        if mapped(prefix) {
            notes.push(format!(
                "{name} is mapped: its heap is not walked (a root): blocks it allocated before the attach are not judged"
            ));
        }
    }
    if mapped("libpython")
        || mappings
            .iter()
            .any(|m| file_name(m).is_some_and(|n| n.starts_with("python")))
    {
        notes.push(
            "Python's obmalloc arenas are roots, not walked: small objects allocated before the attach are not judged"
                .to_string(),
        );
    }
    notes
}

/// What groups pre-attach blocks: their size, type and category.
type GroupKey = (u64, Option<Arc<str>>, Category);

/// The summary of a walk and of the judged blocks from before the attach
/// (`blocks`: size and category of each).
pub fn summary(
    walked: &Result<HeapWalk, String>,
    walk_ms: f64,
    blocks: impl IntoIterator<Item = Block>,
    notes: Vec<String>,
) -> BeforeAttach {
    let mut split = crate::report::LeakSplit::default();
    let mut count = 0u64;
    let mut groups: foldhash::HashMap<GroupKey, Amount> = Default::default();
    // Neighbours in a heap are often alike (a size, no type, a category):
    // a run of equal keys is added up before it goes to the map.
    let mut run: Option<(GroupKey, Amount)> = None;
    for block in blocks {
        count += 1;
        split.add(block.category, block.size);
        let key = (block.size, block.type_name, block.category);
        match &mut run {
            Some((current, amount)) if *current == key => amount.add(block.size),
            _ => {
                if let Some((key, amount)) = run.take() {
                    groups.entry(key).or_default().merge(amount);
                }
                let mut amount = Amount::default();
                amount.add(block.size);
                run = Some((key, amount));
            }
        }
    }
    if let Some((key, amount)) = run {
        groups.entry(key).or_default().merge(amount);
    }
    let mut groups: Vec<BlockGroup> = groups
        .into_iter()
        .map(|((size, type_name, category), amount)| BlockGroup {
            size,
            type_name: type_name.map(|t| t.to_string()),
            category: category_name(category).to_string(),
            count: amount.blocks,
            bytes: amount.bytes,
            // Set when the report ranks its sites.
            same_size_as_site: None,
        })
        .collect();
    // Largest first; ties in a fixed order (the map's is not).
    groups.sort_by(|a, b| {
        (
            std::cmp::Reverse(a.bytes),
            a.size,
            &a.type_name,
            &a.category,
        )
            .cmp(&(
                std::cmp::Reverse(b.bytes),
                b.size,
                &b.type_name,
                &b.category,
            ))
    });
    groups.truncate(GROUPS);
    let heap_walk = match walked {
        Ok(walk) => HeapWalkSummary {
            status: if walk.partial.is_empty() {
                "complete"
            } else {
                "partial"
            }
            .to_string(),
            glibc_version: walk
                .layout
                .map(|l| format!("{}.{}", l.version.0, l.version.1)),
            main_arena_from: walk.main_arena_from.map(str::to_string),
            mmapped_chunks_glibc: walk.mmapped_glibc,
            arenas: walk.arenas,
            arenas_walked: walk.arenas_walked,
            chunks: walk.chunks_in_use(),
            chunks_walked: walk.chunks_walked,
            mmapped_chunks: walk.mmapped_chunks,
            blocks_before_attach: count,
            walk_ms,
            reason: (!walk.partial.is_empty()).then(|| walk.partial.join("; ")),
        },
        Err(reason) => HeapWalkSummary {
            status: "not_run".to_string(),
            reason: Some(reason.clone()),
            ..HeapWalkSummary::default()
        },
    };
    BeforeAttach {
        split,
        groups,
        heap_walk,
        notes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_grouped_by_size_and_category() {
        let walk = Ok(HeapWalk {
            arenas: 2,
            arenas_walked: 1,
            partial: vec!["arena 0x1 is locked".to_string()],
            ..HeapWalk::default()
        });
        let block = |size, category| Block {
            size,
            category,
            type_name: None,
        };
        let blocks = [
            block(24, Category::DefinitelyLost),
            block(24, Category::DefinitelyLost),
            Block {
                type_name: Some(Arc::from("std::exception")),
                ..block(24, Category::DefinitelyLost)
            },
            block(40, Category::StillReachable),
        ];
        let before = summary(&walk, 1.0, blocks, vec![]);
        assert_eq!(
            before.split.definitely_lost,
            Amount {
                bytes: 72,
                blocks: 3
            }
        );
        assert_eq!(before.groups[0].count, 2);
        assert_eq!(before.groups[0].type_name, None);
        assert!(before
            .groups
            .iter()
            .any(|g| g.type_name.as_deref() == Some("std::exception") && g.count == 1));
        assert_eq!(before.groups[0].category, "definitely-lost");
        assert_eq!(before.heap_walk.status, "partial");
        assert!(before.lines()[0].contains("arena 0x1 is locked"));
        let refused = summary(
            &Err("glibc 2.42 is not known".to_string()),
            0.0,
            Vec::new(),
            vec![],
        );
        assert_eq!(refused.heap_walk.status, "not_run");
        assert!(refused.lines()[0].contains("2.42"));
    }

    #[test]
    fn other_allocators_are_named() {
        let maps = crate::tracee::maps::parse(
            "7f0000000000-7f0000001000 r-xp 00000000 08:01 5 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n",
        );
        assert!(notes(&maps)[0].starts_with("jemalloc"));
    }
}
