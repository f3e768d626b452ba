//! CPython frames in every stack: the interpreter found at attach
//! ([`detect`]), its version's layout ([`layout`]) handed to the kernel's
//! frame reader (`memtrace-ebpf/src/python.rs`), and each Python stack the
//! kernel stored resolved once, at first sight, to (qualified name, file,
//! line) ([`resolve`], [`lines`]). Equal resolved stacks share one canonical
//! id, which is part of the site key, so different Python call paths are
//! different sites. [`merge`] puts the Python frames into the native stack.
//!
//! Per version: 3.8 to 3.13 are read (3.13 through its `_Py_DebugOffsets`);
//! before 3.11 only where the kernel's BTF gives `task_struct.thread.fsbase`
//! (`crate::btf`), which lets the kernel match thread states by `pthread_t`.

pub mod detect;
pub mod layout;
pub mod lines;
pub mod merge;
pub mod resolve;

use std::collections::{BTreeMap, HashMap};

use memtrace_common::PyStack;
use serde::{Deserialize, Serialize};

use layout::Layout;
use resolve::{PyFrame, Resolver};

/// What was found in one traced process, as the report shows it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct Interpreter {
    /// The traced process the interpreter runs in.
    pub pid: u32,
    /// `3.12.1`, or `3.9` when only the minor version is known.
    pub version: String,
    /// The object defining `_PyRuntime`.
    pub object: String,
    /// Whether the kernel reads this process's Python frames.
    pub frames_read: bool,
    /// Why not, when it does not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Python stacks of this process resolved.
    pub stacks: u64,
    /// Frames whose code object could not be read from the target's memory.
    pub unresolved_frames: u64,
    /// Stacks the kernel's map held under a key their frames do not hash to
    /// (a read overwritten on its CPU): their blocks are shown without
    /// Python frames rather than with another stack's.
    #[serde(default)]
    pub stacks_rejected: u64,
}

/// How to read one process's Python frames.
pub struct Attached {
    pub layout: Layout,
    pub config: memtrace_common::PyProc,
}

/// Chooses the layout for what [`detect::find`] found: the header facts of
/// its version, corrected on 3.13 by its own `_Py_DebugOffsets`; `thread`
/// locates a thread's `pthread_t` when known.
pub fn plan(
    found: &detect::Found,
    mem: &dyn resolve::Memory,
    thread: Option<layout::ThreadPointer>,
) -> Result<Attached, String> {
    let Some(base) = layout::for_minor(found.minor).filter(|_| found.major == 3) else {
        return Err(format!(
            "frames of Python {} are not read (3.8 to 3.13 are)",
            found.version()
        ));
    };
    let layout = if found.minor == 13 {
        let mut bytes = vec![0u8; layout::DEBUG_OFFSETS_LEN];
        if !mem.read(found.runtime, &mut bytes) {
            return Err("cannot read _PyRuntime".to_string());
        }
        layout::from_debug_offsets(base, &bytes).map_err(|e| e.to_string())?
    } else {
        base
    };
    let config = layout::kernel_config(&layout, found.runtime, thread)
        .map_err(|why| format!("frames of Python {} are not read: {why}", found.version()))?;
    Ok(Attached { config, layout })
}

/// Python stacks by kernel id, resolved, with their canonical ids, and the
/// interpreters found.
#[derive(Default)]
pub struct PyStacks {
    layouts: HashMap<u32, Layout>,
    interpreters: BTreeMap<u32, Interpreter>,
    resolver: Resolver,
    stacks: HashMap<u32, Vec<PyFrame>>,
    by_path: HashMap<Vec<PyFrame>, u32>,
    canonical: HashMap<u32, u32>,
    /// Stacks marked as cut in the kernel (deeper than its limit).
    truncated: std::collections::HashSet<u32>,
    /// Kernel ids whose stored stack did not match its key (never shown).
    rejected: std::collections::HashSet<u32>,
}

impl PyStacks {
    /// Records the interpreter found in `pid` (with its layout when its
    /// frames are read).
    pub fn set_interpreter(&mut self, info: Interpreter, layout: Option<Layout>) {
        match layout {
            Some(layout) => {
                self.layouts.insert(info.pid, layout);
            }
            None => {
                self.layouts.remove(&info.pid);
            }
        }
        self.interpreters.insert(info.pid, info);
    }

    pub fn interpreters(&self) -> impl Iterator<Item = &Interpreter> {
        self.interpreters.values()
    }

    /// Whether `id` was learnt (or rejected): nothing more to read of it.
    pub fn contains(&self, id: u32) -> bool {
        self.stacks.contains_key(&id) || self.rejected.contains(&id)
    }

    /// Resolves the kernel's stack `id`, read for process `pid`; a stored
    /// stack that is not the one its key names is rejected and counted.
    pub fn learn(&mut self, pid: u32, id: u32, raw: &PyStack, mem: &dyn resolve::Memory) {
        let Some(layout) = self.layouts.get(&pid).copied() else {
            log::debug!("pid {pid}: Python stack {id:#x} of a process without a layout");
            return;
        };
        if !raw.matches_key(id) {
            log::debug!("pid {pid}: Python stack {id:#x}: its frames do not hash to its key");
            self.rejected.insert(id);
            if let Some(info) = self.interpreters.get_mut(&pid) {
                info.stacks_rejected += 1;
            }
            return;
        }
        let len = (raw.len as usize).min(raw.frames.len());
        let mut unresolved = 0;
        let frames: Vec<PyFrame> = raw.frames[..len]
            .iter()
            .map(|f| {
                self.resolver
                    .frame(pid, mem, &layout, f.code, f.instr)
                    .unwrap_or_else(|| {
                        unresolved += 1;
                        PyFrame {
                            name: format!("? (code {:#x})", f.code),
                            file: None,
                            line: None,
                        }
                    })
            })
            .collect();
        if let Some(info) = self.interpreters.get_mut(&pid) {
            info.stacks += 1;
            info.unresolved_frames += unresolved;
        }
        if raw.truncated != 0 {
            self.truncated.insert(id);
        }
        self.insert(id, frames);
    }

    /// Stores resolved frames under `id` (also used by tests and replay).
    pub fn insert(&mut self, id: u32, frames: Vec<PyFrame>) {
        let canonical = *self.by_path.entry(frames.clone()).or_insert(id);
        self.canonical.insert(id, canonical);
        self.stacks.insert(id, frames);
    }

    /// The id standing for every stack with the same resolved frames (0: none).
    pub fn canonical(&self, id: u32) -> u32 {
        if id == 0 {
            return 0;
        }
        self.canonical.get(&id).copied().unwrap_or(id)
    }

    /// The resolved frames of `id`, innermost first.
    pub fn frames(&self, id: u32) -> Option<&[PyFrame]> {
        self.stacks.get(&id).map(Vec::as_slice)
    }

    pub fn is_truncated(&self, id: u32) -> bool {
        self.truncated.contains(&id)
    }

    /// Marks `id` as cut by the kernel (replay: the record says so).
    pub fn mark_truncated(&mut self, id: u32) {
        self.truncated.insert(id);
    }

    /// Forgets what is cached of a process that is gone (its stacks stay).
    pub fn forget(&mut self, pid: u32) {
        self.resolver.forget(pid);
        self.layouts.remove(&pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_resolved_stacks_share_an_id() {
        let frame = |n: &str, l| PyFrame {
            name: n.into(),
            file: Some("app.py".into()),
            line: Some(l),
        };
        let mut store = PyStacks::default();
        store.insert(5, vec![frame("f", 1), frame("<module>", 9)]);
        store.insert(8, vec![frame("f", 1), frame("<module>", 9)]);
        store.insert(9, vec![frame("f", 2), frame("<module>", 9)]);
        assert_eq!(store.canonical(8), 5);
        assert_eq!(store.canonical(9), 9);
        assert_eq!(store.canonical(0), 0);
        assert_eq!(store.frames(5).map(<[PyFrame]>::len), Some(2));
    }

    #[test]
    fn a_stored_stack_that_is_not_its_keys_is_rejected_and_counted() {
        use memtrace_common::{py_hash_frame, py_stack_key, PyFrameRaw, PY_HASH_SEED};
        struct NoMem;
        impl resolve::Memory for NoMem {
            fn read(&self, _: u64, _: &mut [u8]) -> bool {
                false
            }
        }
        let stored = |frames: &[(u64, u64)]| {
            let mut raw = PyStack {
                frames: [PyFrameRaw { code: 0, instr: 0 }; memtrace_common::PY_MAX_DEPTH],
                len: frames.len() as u32,
                truncated: 0,
                hash: PY_HASH_SEED,
            };
            for (slot, &(code, instr)) in raw.frames.iter_mut().zip(frames) {
                *slot = PyFrameRaw { code, instr };
                raw.hash = py_hash_frame(raw.hash, code, instr);
            }
            raw
        };
        let mut store = PyStacks::default();
        let info = Interpreter {
            pid: 7,
            version: "3.11".into(),
            object: "python3.11".into(),
            frames_read: true,
            reason: None,
            stacks: 0,
            unresolved_frames: 0,
            stacks_rejected: 0,
        };
        store.set_interpreter(info, layout::for_minor(11));
        let own = stored(&[(0x1000, 0x10), (0x2000, 0x20)]);
        let own_key = py_stack_key(own.hash, own.len);
        // What a preempted read stored: another stack's frames, this key.
        let mut overwritten = stored(&[(0x3000, 0x30), (0x4000, 0x40)]);
        overwritten.hash = own.hash;
        let foreign = stored(&[(0x3000, 0x30), (0x4000, 0x40)]);
        store.learn(7, own_key ^ 1, &foreign, &NoMem);
        store.learn(7, own_key, &overwritten, &NoMem);
        let found = store.interpreters().next().expect("interpreter");
        assert_eq!((found.stacks, found.stacks_rejected), (0, 2));
        assert!(store.contains(own_key), "rejected ids are not read again");
        assert!(store.frames(own_key).is_none(), "never shown");

        let mut store = PyStacks::default();
        store.set_interpreter(found.clone(), layout::for_minor(11));
        store.learn(7, own_key, &own, &NoMem);
        assert_eq!(store.frames(own_key).map(<[PyFrame]>::len), Some(2));
    }

    #[test]
    fn versions_and_thread_matching_decide_what_is_read() {
        const TP: layout::ThreadPointer = layout::ThreadPointer {
            task_offset: 9000,
            pthread_below_tp: 0,
        };
        let found = detect::Found {
            object: "/usr/lib/libpython3.7.so".into(),
            major: 3,
            minor: 7,
            version_hex: None,
            runtime: 0x1000,
        };
        struct NoMem;
        impl resolve::Memory for NoMem {
            fn read(&self, _: u64, _: &mut [u8]) -> bool {
                false
            }
        }
        let err = plan(&found, &NoMem, Some(TP))
            .err()
            .expect("3.7 is not read");
        assert!(err.contains("Python 3.7"), "{err}");
        let found9 = detect::Found {
            minor: 9,
            ..found.clone()
        };
        let err = plan(&found9, &NoMem, None).err().expect("no fs base");
        assert!(err.contains("thread pointer"), "{err}");
        assert!(plan(&found9, &NoMem, Some(TP)).is_ok());
        let found13 = detect::Found { minor: 13, ..found };
        assert_eq!(
            plan(&found13, &NoMem, None).err().as_deref(),
            Some("cannot read _PyRuntime")
        );
    }
}
