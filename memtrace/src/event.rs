//! Decoding: ring-buffer bytes to [`WireEvent`] to the rich [`Event`] the
//! rest of the pipeline works with.

use memtrace_common::{EventKind, WireEvent, FLAG_NEW_UNSAMPLED, STACK_NONE};

/// A captured stack: an id in the kernel's stack map, or why there is none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StackRef {
    Id(u32),
    /// Stacks were not requested (`--stack-depth 0`).
    NotRequested,
    /// Capture failed with this errno.
    Failed(i32),
}

impl StackRef {
    pub fn from_wire(stack_id: i32) -> Self {
        if stack_id == STACK_NONE {
            StackRef::NotRequested
        } else if stack_id < 0 {
            StackRef::Failed(-stack_id)
        } else {
            StackRef::Id(stack_id as u32)
        }
    }

    /// The kernel's encoding, which [`StackRef::from_wire`] reads back (an
    /// id, `STACK_NONE`, or a negative errno): 4 bytes instead of 8.
    pub fn to_wire(self) -> i32 {
        match self {
            StackRef::Id(id) => id as i32,
            StackRef::NotRequested => STACK_NONE,
            StackRef::Failed(errno) => -errno,
        }
    }
}

/// One decoded event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub ts_ns: u64,
    pub pid: u32,
    pub tid: u32,
    /// Index of the probe spec that produced it.
    pub spec: u16,
    /// The allocating thread's Python stack (kernel id in `PY_STACKS`), 0: none.
    pub py_stack: u32,
    pub action: Action,
}

/// What an event did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    Alloc {
        addr: u64,
        size: u64,
        stack: StackRef,
    },
    Free {
        addr: u64,
    },
    /// `old` (0: none) was released and `new` created; `track_new` is false
    /// when the new block is outside the sample.
    Realloc {
        old: u64,
        new: u64,
        size: u64,
        stack: StackRef,
        track_new: bool,
    },
    Failed {
        size: u64,
        code: i64,
    },
    /// The process forked (`--follow-forks`); `clone_flags` as passed to the kernel.
    Fork {
        clone_flags: u64,
    },
    /// The kernel's unwinder met code outside the mappings it knows of this
    /// process: its mappings are to be re-read.
    MapsStale,
    /// `munmap`: the range `addr..addr + len` was unmapped (whole mappings,
    /// parts of them, or nothing traced).
    Unmap {
        addr: u64,
        len: u64,
    },
    /// The process ran exec: every block of its old image is gone.
    /// `old_tid`: the thread that ran it, by its id before the exec.
    Exec {
        old_tid: u32,
    },
}

/// Why bytes could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("event record of {0} bytes, expected {expected}", expected = std::mem::size_of::<WireEvent>())]
    Size(usize),
    #[error("unknown event kind {0}")]
    Kind(u32),
}

/// Decodes one ring-buffer record.
#[cfg(test)]
pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
    from_wire(&decode_wire(bytes)?)
}

/// Reads the wire struct out of one ring-buffer record.
pub fn decode_wire(bytes: &[u8]) -> Result<WireEvent, DecodeError> {
    if bytes.len() < std::mem::size_of::<WireEvent>() {
        return Err(DecodeError::Size(bytes.len()));
    }
    // SAFETY: the length was checked above, `WireEvent` is plain old data
    // (integers only, every bit pattern valid) and the read is unaligned.
    Ok(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) })
}

/// Lifts a wire record into an [`Event`].
pub fn from_wire(wire: &WireEvent) -> Result<Event, DecodeError> {
    let kind = EventKind::try_from(wire.kind).map_err(|e| DecodeError::Kind(e.0))?;
    let stack = StackRef::from_wire(wire.stack_id);
    let action = match kind {
        EventKind::Alloc => Action::Alloc {
            addr: wire.addr,
            size: wire.size,
            stack,
        },
        EventKind::Free => Action::Free { addr: wire.addr },
        EventKind::Realloc => Action::Realloc {
            old: wire.aux,
            new: wire.addr,
            size: wire.size,
            stack,
            track_new: wire.flags & FLAG_NEW_UNSAMPLED == 0,
        },
        EventKind::Failed => Action::Failed {
            size: wire.size,
            code: i64::from(wire.aux as i32),
        },
        EventKind::Fork => Action::Fork {
            clone_flags: wire.aux,
        },
        EventKind::MapsStale => Action::MapsStale,
        EventKind::Unmap => Action::Unmap {
            addr: wire.addr,
            len: wire.size,
        },
        EventKind::Exec => Action::Exec {
            old_tid: wire.aux as u32,
        },
    };
    Ok(Event {
        ts_ns: wire.ts_ns,
        pid: wire.pid,
        tid: wire.tid,
        spec: wire.spec,
        py_stack: wire.py_stack,
        action,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire(kind: EventKind) -> WireEvent {
        WireEvent {
            ts_ns: 5,
            addr: 0x1000,
            size: 64,
            aux: 0x2000,
            pid: 10,
            tid: 11,
            stack_id: 7,
            spec: 3,
            kind: kind as u8,
            flags: 0,
            py_stack: 9,
            tag: 0,
        }
    }

    fn bytes(event: &WireEvent) -> Vec<u8> {
        // SAFETY: WireEvent is repr(C) plain data without uninitialized padding.
        unsafe {
            std::slice::from_raw_parts(
                (event as *const WireEvent).cast::<u8>(),
                std::mem::size_of::<WireEvent>(),
            )
        }
        .to_vec()
    }

    #[test]
    fn decodes_each_kind() {
        let alloc = decode(&bytes(&wire(EventKind::Alloc))).expect("alloc");
        assert_eq!(
            alloc.action,
            Action::Alloc {
                addr: 0x1000,
                size: 64,
                stack: StackRef::Id(7)
            }
        );
        assert_eq!((alloc.pid, alloc.tid, alloc.spec), (10, 11, 3));
        assert_eq!(alloc.py_stack, 9);
        let free = decode(&bytes(&wire(EventKind::Free))).expect("free");
        assert_eq!(free.action, Action::Free { addr: 0x1000 });
        let mut re = wire(EventKind::Realloc);
        re.flags = FLAG_NEW_UNSAMPLED;
        match decode(&bytes(&re)).expect("realloc").action {
            Action::Realloc {
                old,
                new,
                track_new,
                ..
            } => {
                assert_eq!((old, new, track_new), (0x2000, 0x1000, false))
            }
            other => panic!("{other:?}"),
        }
        let mut failed = wire(EventKind::Failed);
        failed.aux = 2;
        assert_eq!(
            decode(&bytes(&failed)).expect("failed").action,
            Action::Failed { size: 64, code: 2 }
        );
    }

    #[test]
    fn rejects_bad_records() {
        assert_eq!(decode(&[0u8; 10]), Err(DecodeError::Size(10)));
        let mut bad = wire(EventKind::Alloc);
        bad.kind = 42;
        assert_eq!(decode(&bytes(&bad)), Err(DecodeError::Kind(42)));
    }

    #[test]
    fn stack_refs() {
        assert_eq!(StackRef::from_wire(STACK_NONE), StackRef::NotRequested);
        assert_eq!(StackRef::from_wire(-14), StackRef::Failed(14));
        assert_eq!(StackRef::from_wire(0), StackRef::Id(0));
    }
}
