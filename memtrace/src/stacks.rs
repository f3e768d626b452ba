//! Stack store: the frames of each stack id, read from the kernel once at
//! first sight and normalized to (module, file offset) right away, while the
//! target's mappings are known — so they can be symbolized later, even after
//! the target has exited.

use std::collections::HashMap;

use crate::probe::maps::{AddressSpace, FileAddr};

/// One frame: the raw return address and, where file-backed, its normalized form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawFrame {
    pub addr: u64,
    pub file: Option<FileAddr>,
}

/// Frames per stack id.
#[derive(Default)]
pub struct StackStore {
    stacks: HashMap<u32, Vec<RawFrame>>,
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
    }

    /// Replaces the normalized form of a stored stack's frames (replay: the
    /// record file carries them already normalized).
    pub fn set_files(&mut self, id: u32, files: Vec<Option<FileAddr>>) {
        if let Some(frames) = self.stacks.get_mut(&id) {
            for (frame, file) in frames.iter_mut().zip(files) {
                frame.file = file;
            }
        }
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
    use crate::probe::maps::parse;

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
}
