//! Small shared model types: a stack frame as reports show it and one point
//! of the live-bytes timeline. They sit below `report`, `analysis` and
//! `interp`, which all use them, so none of those has to import another for
//! them (`report` re-exports them: `report::Frame` is the same type).

use serde::Serialize;

use crate::probe::catalog::{Allocator, Memory};

/// Live bytes and blocks of one allocator and memory kind at one moment.
#[derive(Clone, Debug, Serialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct TimelineSample {
    /// Milliseconds since tracing started.
    pub t_ms: u64,
    pub allocator: Allocator,
    pub memory: Memory,
    /// Bytes of this allocator's and memory kind's blocks live in the table
    /// then.
    pub live_bytes: u64,
    /// How many of its blocks were live then.
    pub live_count: u64,
}

/// Whether a frame is machine code or a Python function.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq, Hash, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FrameKind {
    #[default]
    Native,
    Python,
}

#[derive(Clone, Debug, Serialize, PartialEq, Eq, schemars::JsonSchema)]
pub struct Frame {
    /// `native` or `python` (then `symbol` is the qualified name, `addr` empty).
    pub kind: FrameKind,
    /// The return address in the process, hex (`0x7f...`); empty for a
    /// Python frame.
    pub addr: String,
    /// The function, demangled (for a Python frame, its qualified name);
    /// null when no symbol covers the address.
    pub symbol: Option<String>,
    /// The object file the address lies in, as the process maps it; null
    /// for a Python frame or an address in no file mapping.
    pub module: Option<String>,
    /// The source file, from the object's debug information (with
    /// `inlined`: of the outermost call) or the Python code object; null
    /// when unknown.
    pub file: Option<String>,
    /// The line in `file`; null when unknown.
    pub line: Option<u32>,
    /// Offset of the return address in `module`.
    pub offset: Option<String>,
    /// Functions inlined at this address, innermost first (the address lies
    /// in the first, which is inlined into the next, ..., inlined into
    /// `symbol`); absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inlined: Vec<crate::symbolize::InlinedCall>,
}
