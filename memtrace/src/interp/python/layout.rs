//! Per-version struct offsets of CPython, as facts from each version's own
//! headers (`tests/python/offsets.c`, printed by `tests/python/gen-offsets.sh`
//! against the pyenv builds: 3.8.18, 3.9.18, 3.10.13, 3.11.7, 3.12.1, 3.13.0,
//! x86_64, release ABI). Within a minor version these are ABI: the same in
//! Debian's `python3.11`. On 3.13, where the interpreter describes itself in
//! `_Py_DebugOffsets` at the start of `_PyRuntime`, the offsets read there
//! win ([`from_debug_offsets`]).
//!
//! 3.8-3.10 keep the frame chain in `PyFrameObject`s (`f_back`, `f_code`,
//! `f_lasti`); 3.11+ in `_PyInterpreterFrame`s (`previous`, the code object,
//! an instruction pointer). Thread states are matched by `thread_id` (the
//! thread's `pthread_t`, every version) when the kernel's `fs`-base offset is
//! known, else by `native_thread_id` (3.11+ only).

use memtrace_common::{PyProc, PY_OFF_NONE};

/// What a frame's instruction field holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Instr {
    /// A pointer into the code object's `co_code_adaptive` (3.11+).
    Pointer,
    /// `f_lasti` as an `int` byte offset (3.8, 3.9).
    LastiBytes,
    /// `f_lasti` as an `int` index of 2-byte code units (3.10).
    LastiUnits,
}

/// Offsets of one CPython minor version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub minor: u32,
    pub runtime_interpreters_head: u64,
    pub interp_threads_head: u64,
    pub tstate_next: u64,
    /// `thread_id`: the creating thread's `pthread_self()`.
    pub tstate_thread_id: u64,
    /// `native_thread_id` (3.11+).
    pub tstate_native_thread_id: Option<u64>,
    /// `cframe` (3.11, 3.12) or `current_frame` (3.13).
    pub tstate_frame: u64,
    /// `_PyCFrame.current_frame` (3.11, 3.12).
    pub cframe_current_frame: Option<u64>,
    pub frame_code: u64,
    pub frame_previous: u64,
    pub frame_instr: u64,
    /// What `frame_instr` holds.
    pub instr: Instr,
    /// `owner` (3.11+).
    pub frame_owner: Option<u64>,
    /// Owner value of C-stack shim frames (3.12+).
    pub owner_cstack: Option<u8>,
    pub code_filename: u64,
    pub code_name: u64,
    /// `co_qualname` (3.11+).
    pub code_qualname: Option<u64>,
    pub code_linetable: u64,
    pub code_firstlineno: u64,
    pub code_adaptive: u64,
    /// `PyVarObject.ob_size` and `PyBytesObject.ob_sval`.
    pub bytes_size: u64,
    pub bytes_sval: u64,
    /// `PyASCIIObject.length`, `.state`, and where compact ASCII / compact
    /// non-ASCII data starts.
    pub unicode_length: u64,
    pub unicode_state: u64,
    pub unicode_ascii_data: u64,
    pub unicode_compact_data: u64,
}

const LAYOUT_3_8: Layout = Layout {
    minor: 8,
    runtime_interpreters_head: 32,
    interp_threads_head: 8,
    tstate_next: 8,
    tstate_thread_id: 176,
    tstate_native_thread_id: None,
    tstate_frame: 24,
    cframe_current_frame: None,
    frame_code: 32,
    frame_previous: 24,
    frame_instr: 104,
    instr: Instr::LastiBytes,
    frame_owner: None,
    owner_cstack: None,
    code_filename: 104,
    code_name: 112,
    code_qualname: None,
    code_linetable: 120,
    code_firstlineno: 40,
    code_adaptive: 0,
    bytes_size: 16,
    bytes_sval: 32,
    unicode_length: 16,
    unicode_state: 32,
    unicode_ascii_data: 48,
    unicode_compact_data: 72,
};

/// 3.9 has 3.8's offsets (both `co_lnotab`).
const LAYOUT_3_9: Layout = Layout {
    minor: 9,
    ..LAYOUT_3_8
};

const LAYOUT_3_10: Layout = Layout {
    minor: 10,
    frame_instr: 96,
    instr: Instr::LastiUnits,
    ..LAYOUT_3_8
};

const LAYOUT_3_11: Layout = Layout {
    minor: 11,
    runtime_interpreters_head: 40,
    interp_threads_head: 16,
    tstate_next: 8,
    tstate_thread_id: 152,
    tstate_native_thread_id: Some(160),
    tstate_frame: 56,
    cframe_current_frame: Some(8),
    frame_code: 32,
    frame_previous: 48,
    frame_instr: 56,
    instr: Instr::Pointer,
    frame_owner: Some(69),
    owner_cstack: None,
    code_filename: 112,
    code_name: 120,
    code_qualname: Some(128),
    code_linetable: 136,
    code_firstlineno: 72,
    code_adaptive: 184,
    bytes_size: 16,
    bytes_sval: 32,
    unicode_length: 16,
    unicode_state: 32,
    unicode_ascii_data: 48,
    unicode_compact_data: 72,
};

const LAYOUT_3_12: Layout = Layout {
    minor: 12,
    runtime_interpreters_head: 40,
    interp_threads_head: 72,
    tstate_next: 8,
    tstate_thread_id: 136,
    tstate_native_thread_id: Some(144),
    tstate_frame: 56,
    cframe_current_frame: Some(0),
    frame_code: 0,
    frame_previous: 8,
    frame_instr: 56,
    instr: Instr::Pointer,
    frame_owner: Some(70),
    owner_cstack: Some(3),
    code_filename: 112,
    code_name: 120,
    code_qualname: Some(128),
    code_linetable: 136,
    code_firstlineno: 68,
    code_adaptive: 192,
    bytes_size: 16,
    bytes_sval: 32,
    unicode_length: 16,
    unicode_state: 32,
    unicode_ascii_data: 40,
    unicode_compact_data: 56,
};

const LAYOUT_3_13: Layout = Layout {
    minor: 13,
    runtime_interpreters_head: 632,
    interp_threads_head: 7344,
    tstate_next: 8,
    tstate_thread_id: 152,
    tstate_native_thread_id: Some(160),
    tstate_frame: 72,
    cframe_current_frame: None,
    frame_code: 0,
    frame_previous: 8,
    frame_instr: 56,
    instr: Instr::Pointer,
    frame_owner: Some(70),
    owner_cstack: Some(3),
    code_filename: 112,
    code_name: 120,
    code_qualname: Some(128),
    code_linetable: 136,
    code_firstlineno: 68,
    code_adaptive: 200,
    bytes_size: 16,
    bytes_sval: 32,
    unicode_length: 16,
    unicode_state: 32,
    unicode_ascii_data: 40,
    unicode_compact_data: 56,
};

/// The layout of CPython `3.minor`, when memtrace can read its frames.
pub fn for_minor(minor: u32) -> Option<Layout> {
    match minor {
        8 => Some(LAYOUT_3_8),
        9 => Some(LAYOUT_3_9),
        10 => Some(LAYOUT_3_10),
        11 => Some(LAYOUT_3_11),
        12 => Some(LAYOUT_3_12),
        13 => Some(LAYOUT_3_13),
        _ => None,
    }
}

/// Why a `_Py_DebugOffsets` block was not used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DebugOffsetsError {
    #[error("no _Py_DebugOffsets cookie at _PyRuntime")]
    Cookie,
    #[error("_Py_DebugOffsets too short ({0} bytes)")]
    Short(usize),
    #[error("_Py_DebugOffsets offset {0} out of range")]
    Range(u64),
}

/// Size of the 3.13 `_Py_DebugOffsets` prefix read here (through
/// `code_object.co_code_adaptive`).
pub const DEBUG_OFFSETS_LEN: usize = 352;

/// The 3.13 layout with every offset the interpreter's own
/// `_Py_DebugOffsets` (the first bytes of `_PyRuntime`) gives replacing the
/// header facts.
pub fn from_debug_offsets(base: Layout, bytes: &[u8]) -> Result<Layout, DebugOffsetsError> {
    if bytes.get(..8) != Some(b"xdebugpy".as_slice()) {
        return Err(DebugOffsetsError::Cookie);
    }
    if bytes.len() < DEBUG_OFFSETS_LEN {
        return Err(DebugOffsetsError::Short(bytes.len()));
    }
    let at = |i: usize| -> Result<u64, DebugOffsetsError> {
        let raw: [u8; 8] = bytes[i..i + 8]
            .try_into()
            .map_err(|_| DebugOffsetsError::Short(i))?;
        let value = u64::from_le_bytes(raw);
        // Every offset the kernel uses must fit its u16 fields.
        if value >= u64::from(PY_OFF_NONE) && i != 40 {
            return Err(DebugOffsetsError::Range(value));
        }
        Ok(value)
    };
    Ok(Layout {
        runtime_interpreters_head: at(40)?,
        interp_threads_head: at(72)?,
        tstate_next: at(168)?,
        tstate_frame: at(184)?,
        tstate_thread_id: at(192)?,
        tstate_native_thread_id: Some(at(200)?),
        frame_previous: at(232)?,
        frame_code: at(240)?,
        frame_instr: at(248)?,
        frame_owner: Some(at(264)?),
        code_filename: at(280)?,
        code_name: at(288)?,
        code_qualname: Some(at(296)?),
        code_linetable: at(304)?,
        code_firstlineno: at(312)?,
        code_adaptive: at(344)?,
        ..base
    })
}

/// Why the kernel cannot find a version's thread states.
pub const NO_THREAD_MATCH: &str =
    "its thread states carry no kernel thread id (before 3.11) and the thread pointer (the kernel's BTF offset of it, or glibc's pthread size on arm64) is unknown, so they cannot be matched by pthread_t";

/// Where the kernel finds a thread's `pthread_t`: the thread pointer's
/// offset in `task_struct`, minus `pthread_below_tp` bytes
/// (see `tracee::tls`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadPointer {
    pub task_offset: u64,
    pub pthread_below_tp: u32,
}

/// The kernel's reading recipe for a process whose `_PyRuntime` is at
/// `runtime`; `thread` says how to find a thread's `pthread_t`, when known.
pub fn kernel_config(
    layout: &Layout,
    runtime: u64,
    thread: Option<ThreadPointer>,
) -> Result<PyProc, &'static str> {
    let off = |v: u64| u16::try_from(v).unwrap_or(PY_OFF_NONE);
    // Where the thread pointer is not the pthread_t itself (arm64), the
    // kernel's saved copy can lag the register at a thread's very start:
    // versions that record the kernel thread id are matched by it.
    let thread =
        thread.filter(|t| t.pthread_below_tp == 0 || layout.tstate_native_thread_id.is_none());
    let fsbase_off = thread
        .and_then(|t| u32::try_from(t.task_offset).ok())
        .unwrap_or(0);
    let tp_to_pthread = thread.map_or(0, |t| t.pthread_below_tp);
    if fsbase_off == 0 && layout.tstate_native_thread_id.is_none() {
        return Err(NO_THREAD_MATCH);
    }
    Ok(PyProc {
        interp_head_addr: runtime.wrapping_add(layout.runtime_interpreters_head),
        fsbase_off,
        tstate_pthread: off(layout.tstate_thread_id),
        interp_threads_head: off(layout.interp_threads_head),
        tstate_next: off(layout.tstate_next),
        tstate_native_tid: layout.tstate_native_thread_id.map_or(PY_OFF_NONE, off),
        tstate_frame: off(layout.tstate_frame),
        cframe_frame: layout.cframe_current_frame.map_or(PY_OFF_NONE, off),
        frame_code: off(layout.frame_code),
        frame_previous: off(layout.frame_previous),
        frame_instr: off(layout.frame_instr),
        frame_owner: layout.frame_owner.map_or(PY_OFF_NONE, off),
        owner_cstack: layout.owner_cstack.unwrap_or(0xff),
        _pad: [0; 3],
        tp_to_pthread,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn debug_block(values: &[(usize, u64)]) -> Vec<u8> {
        let mut bytes = vec![0u8; DEBUG_OFFSETS_LEN];
        bytes[..8].copy_from_slice(b"xdebugpy");
        for &(at, value) in values {
            bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
        }
        bytes
    }

    #[test]
    fn debug_offsets_replace_the_header_facts() {
        let base = LAYOUT_3_13;
        let facts = [
            (40, base.runtime_interpreters_head),
            (72, base.interp_threads_head),
            (168, base.tstate_next),
            (184, base.tstate_frame),
            (192, base.tstate_thread_id),
            (200, 999),
            (232, base.frame_previous),
            (240, base.frame_code),
            (248, base.frame_instr),
            (264, 70),
            (280, base.code_filename),
            (288, base.code_name),
            (296, 128),
            (304, base.code_linetable),
            (312, base.code_firstlineno),
            (344, base.code_adaptive),
        ];
        let layout = from_debug_offsets(base, &debug_block(&facts)).expect("valid");
        assert_eq!(
            layout,
            Layout {
                tstate_native_thread_id: Some(999),
                ..base
            }
        );
    }

    #[test]
    fn bad_debug_offsets_are_refused() {
        assert_eq!(
            from_debug_offsets(LAYOUT_3_13, b"nothere!"),
            Err(DebugOffsetsError::Cookie)
        );
        assert_eq!(
            from_debug_offsets(LAYOUT_3_13, b"xdebugpy1234"),
            Err(DebugOffsetsError::Short(12))
        );
        assert_eq!(
            from_debug_offsets(LAYOUT_3_13, &debug_block(&[(72, 1 << 40)])),
            Err(DebugOffsetsError::Range(1 << 40))
        );
    }

    fn tp(task_offset: u64, pthread_below_tp: u32) -> ThreadPointer {
        ThreadPointer {
            task_offset,
            pthread_below_tp,
        }
    }

    #[test]
    fn kernel_config_marks_absent_fields() {
        let c = kernel_config(&LAYOUT_3_13, 0x1000, None).expect("3.13");
        assert_eq!(c.interp_head_addr, 0x1000 + 632);
        assert_eq!(c.cframe_frame, PY_OFF_NONE);
        assert_eq!(c.fsbase_off, 0);
        let c11 = kernel_config(&LAYOUT_3_11, 0, Some(tp(9000, 0))).expect("3.11");
        assert_eq!(
            (c11.owner_cstack, c11.fsbase_off, c11.tstate_pthread),
            (0xff, 9000, 152)
        );
        // arm64: pthread_self() is glibc's struct pthread below the pointer.
        let arm = kernel_config(&LAYOUT_3_10, 0, Some(tp(4000, 1792))).expect("3.10");
        assert_eq!((arm.fsbase_off, arm.tp_to_pthread), (4000, 1792));
        // ... and 3.11+ there are matched by their kernel thread id.
        let arm11 = kernel_config(&LAYOUT_3_11, 0, Some(tp(4000, 1792))).expect("3.11");
        assert_eq!((arm11.fsbase_off, arm11.tp_to_pthread), (0, 0));
        assert_eq!(
            kernel_config(&LAYOUT_3_12, 0, None).map(|c| c.cframe_frame),
            Ok(0)
        );
        // Before 3.11 only the fs base tells threads apart.
        assert_eq!(kernel_config(&LAYOUT_3_10, 0, None), Err(NO_THREAD_MATCH));
        let c10 = kernel_config(&LAYOUT_3_10, 0, Some(tp(9000, 0))).expect("3.10");
        assert_eq!(
            (c10.tstate_native_tid, c10.frame_owner),
            (PY_OFF_NONE, PY_OFF_NONE)
        );
        assert!(for_minor(7).is_none() && for_minor(8).is_some());
    }
}
