//! Stack store: the frames of each stack id, read from the kernel once at
//! first sight and normalized to (module, file offset) right away, while the
//! target's mappings are known — so they can be symbolized later, even after
//! the target has exited. Stacks whose normalized frames are identical (the
//! same call path in a parent and its children, loaded at different
//! addresses) share one canonical id, so they are one site.

use std::collections::HashMap;

use crate::event::StackRef;
use crate::probe::maps::{AddressSpace, FileAddr};

/// One frame: the raw return address and, where file-backed, its normalized form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawFrame {
    pub addr: u64,
    pub file: Option<FileAddr>,
}

/// A frame as it identifies a call path: its place in a file, or its raw
/// address when it has none.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum FrameKey {
    File(FileAddr),
    Raw(u64),
}

/// Frames per stack id, and the Python stacks beside them.
#[derive(Default)]
pub struct StackStore {
    /// Python stacks and the interpreters found (`interp::python`).
    pub python: crate::interp::python::PyStacks,
    stacks: HashMap<u32, Vec<RawFrame>>,
    /// The first id seen with each normalized call path.
    by_path: HashMap<Vec<FrameKey>, u32>,
    /// Stack id to the canonical id of its call path.
    canonical: HashMap<u32, u32>,
}

impl StackStore {
    pub fn contains(&self, id: u32) -> bool {
        self.stacks.contains_key(&id)
    }

    /// Records a stack's return addresses (innermost first).
    pub fn insert(&mut self, id: u32, ips: &[u64], space: &AddressSpace) {
        let frames = ips
            .iter()
            .take_while(|&&ip| ip != 0)
            .map(|&addr| RawFrame {
                addr,
                file: space.normalize(addr),
            })
            .collect();
        self.stacks.insert(id, frames);
        self.index(id);
    }

    /// Maps `id` to the canonical id of its (current) normalized call path.
    fn index(&mut self, id: u32) {
        let Some(frames) = self.stacks.get(&id) else {
            return;
        };
        let path: Vec<FrameKey> = frames
            .iter()
            .map(|f| match &f.file {
                Some(file) => FrameKey::File(file.clone()),
                None => FrameKey::Raw(f.addr),
            })
            .collect();
        let canonical = *self.by_path.entry(path).or_insert(id);
        self.canonical.insert(id, canonical);
    }

    /// The stack standing for every stack with the same normalized call path.
    pub fn canonical(&self, stack: StackRef) -> StackRef {
        match stack {
            StackRef::Id(id) => StackRef::Id(self.canonical.get(&id).copied().unwrap_or(id)),
            other => other,
        }
    }

    /// Replaces the normalized form of a stored stack's frames (replay: the
    /// record file carries them already normalized).
    pub fn set_files(&mut self, id: u32, files: Vec<Option<FileAddr>>) {
        if let Some(frames) = self.stacks.get_mut(&id) {
            for (frame, file) in frames.iter_mut().zip(files) {
                frame.file = file;
            }
        }
        self.index(id);
    }

    pub fn get(&self, id: u32) -> Option<&[RawFrame]> {
        self.stacks.get(&id).map(Vec::as_slice)
    }

    /// Whether any frame of any stack could not be normalized (a mapping
    /// appeared after the last snapshot): the caller refreshes and retries.
    pub fn has_unresolved(&self, id: u32) -> bool {
        self.get(id)
            .is_some_and(|frames| frames.iter().any(|f| f.file.is_none()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tracee::maps::parse;

    #[test]
    fn normalizes_at_insert_and_stops_at_zero() {
        let space = AddressSpace::new(parse("1000-2000 r-xp 00000000 fe:01 5 /bin/app\n"));
        let mut store = StackStore::default();
        store.insert(3, &[0x1010, 0x9999, 0, 0x1020], &space);
        let frames = store.get(3).expect("stored");
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].file.as_ref().map(|f| f.file_offset), Some(0x10));
        assert_eq!(frames[1].file, None);
        assert!(store.has_unresolved(3));
        assert!(store.contains(3) && !store.contains(4));
    }

    #[test]
    fn same_call_path_at_other_addresses_is_one_stack() {
        let parent = AddressSpace::new(parse("1000-2000 r-xp 00000000 fe:01 5 /bin/app\n"));
        let child = AddressSpace::new(parse("7000-8000 r-xp 00000000 fe:01 5 /bin/app\n"));
        let mut store = StackStore::default();
        store.insert(1, &[0x1010, 0x1020], &parent);
        store.insert(2, &[0x7010, 0x7020], &child);
        store.insert(3, &[0x7010, 0x7030], &child);
        assert_eq!(store.canonical(StackRef::Id(2)), StackRef::Id(1));
        assert_eq!(store.canonical(StackRef::Id(3)), StackRef::Id(3));
        assert_eq!(
            store.canonical(StackRef::NotRequested),
            StackRef::NotRequested
        );
        // Unresolved frames compare by raw address.
        store.insert(4, &[0x9999], &parent);
        store.insert(5, &[0x9999], &child);
        assert_eq!(store.canonical(StackRef::Id(5)), StackRef::Id(4));
    }
}
