//! The lines of a record file and the checks made while reading them, one
//! line at a time. Pure (no I/O, nothing of the live table or the report), so
//! `fuzz/` drives it directly; `replay` feeds it the file and applies what it
//! yields.
//!
//! The header's target and the footer are the report's types, passed in as
//! the type parameters `T` and `F`.

use std::collections::HashMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::event::{self, Event};
use crate::probe::catalog::{Domain, Memory};
use memtrace_common::WireEvent;

/// The format written: version 2 added Python stacks (`py_stack` lines and
/// an event's `py`, the Python stack it was made under) and an event's
/// `tag` (a USDT allocation's device index; absent in older version 2
/// records, which replay without a device cache's devices); version 3 adds
/// the symbols of every recorded native frame as the trace resolved them
/// (`object` and `sym` lines, before the footer).
pub const FORMAT: &str = "memtrace-record/3";
/// Formats read: version 1 (no Python stacks) reads as version 2 without
/// them; versions 1 and 2 (no symbols) are symbolized from this host's files.
pub const FORMATS_READ: &[&str] = &["memtrace-record/1", "memtrace-record/2", FORMAT];

/// One line of a record file (a JSON object tagged by `type`).
// One line exists at a time while reading or writing: the footer's size does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Line<T, F> {
    Header {
        format: String,
        target: T,
        started_ns: u64,
    },
    /// A probed function, in spec-index order.
    Spec {
        index: u16,
        function: String,
        allocator: String,
        family: u8,
        memory: Memory,
        domain: Domain,
        /// The object defining the function (absent in older records).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        module: Option<String>,
        /// Its sizes are estimates (absent: they are not).
        #[serde(default, skip_serializing_if = "is_false")]
        estimate: bool,
    },
    Stack {
        id: u32,
        /// (return address, module, file offset) per frame, innermost first.
        frames: Vec<(u64, Option<String>, Option<u64>)>,
    },
    /// ts, addr, size, aux, pid, tid, stack_id, spec, kind, flags; `py`:
    /// the kernel's id of the Python stack it was made under (absent: none);
    /// `tag`: a tagged USDT allocation's device index, bits as the wire
    /// carried them (absent: 0; the stream is `aux`).
    Event {
        e: [i64; 10],
        #[serde(default, skip_serializing_if = "is_zero")]
        py: u32,
        #[serde(default, skip_serializing_if = "is_zero")]
        tag: u32,
    },
    /// A Python stack as resolved while the target ran (its code objects are
    /// gone with it): (qualified name, file, line) per frame, innermost
    /// first; `truncated` when the kernel cut it at its depth limit.
    PyStack {
        id: u32,
        frames: Vec<(String, Option<String>, Option<u32>)>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        truncated: bool,
    },
    /// An object the recorded frames point into, named as the stacks name
    /// it, with its build-id (hex; absent: it has none, or it could not be
    /// read). Before the `sym` lines naming it.
    Object {
        id: u32,
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        build_id: Option<String>,
    },
    /// One recorded frame address (object `object`, return address at file
    /// `offset`, as the stacks carry it) as the trace symbolized it: the
    /// function, source file and line (each absent when unknown);
    /// `unreadable` when the object could not be read then.
    Sym {
        object: u32,
        offset: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        symbol: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        file: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        line: Option<u32>,
        #[serde(default, skip_serializing_if = "is_false")]
        unreadable: bool,
        /// Functions inlined there, innermost first (absent: none, or an
        /// older record).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        inlined: Vec<crate::symbolize::InlinedCall>,
    },
    /// An interval snapshot was taken at `t_s` seconds.
    Snapshot { t_s: f64 },
    /// The trace ended at `ended_ns` (monotonic); the events after it only
    /// settle blocks made before (see `LiveTable::close`).
    End { ended_ns: u64 },
    /// The footer's fields, next to `type`.
    Footer(F),
}

/// What a checked line adds to the replay.
#[derive(Debug)]
pub enum Item<T, F> {
    Header {
        target: T,
        started_ns: u64,
    },
    /// The next spec (its index is the number of specs before it).
    Spec {
        function: String,
        allocator: String,
        family: u8,
        memory: Memory,
        domain: Domain,
        module: Option<String>,
        estimate: bool,
    },
    Stack {
        id: u32,
        frames: Vec<(u64, Option<String>, Option<u64>)>,
    },
    PyStack {
        id: u32,
        frames: Vec<(String, Option<String>, Option<u32>)>,
        truncated: bool,
    },
    /// A decoded event of a known spec, with that spec's domain, and the
    /// wire event it was decoded from (USDT tags are read from it).
    Event {
        event: Event,
        domain: Domain,
        wire: WireEvent,
    },
    /// An object the `sym` lines after it name (its build-id is for the
    /// reader of the file: the symbols come with it).
    Object {
        path: PathBuf,
    },
    /// A frame address (`offset` in the object at `module`) as the trace
    /// symbolized it; `unreadable`: its object could not be read then.
    Sym {
        module: PathBuf,
        offset: u64,
        symbol: Option<String>,
        file: Option<String>,
        line: Option<u32>,
        unreadable: bool,
        inlined: Vec<crate::symbolize::InlinedCall>,
    },
    Snapshot {
        t_s: f64,
    },
    End {
        ended_ns: u64,
    },
    Footer(F),
}

/// Why reading stopped.
#[derive(Debug, PartialEq, Eq)]
pub enum Stop {
    /// Not a record file memtrace can read: nothing is reported.
    Unreadable(String),
    /// A bad line (`line N: why`): the report is built from the lines before it.
    Truncated(String),
}

/// The state of one read through a file: whether a header was seen, the
/// domain of each spec so far, and the objects `sym` lines may name.
#[derive(Debug, Default)]
pub struct Reader {
    header: bool,
    domains: Vec<Domain>,
    objects: HashMap<u32, PathBuf>,
}

impl Reader {
    /// Checks line `number` (1-based) of the file; `Ok(None)` for a blank line.
    pub fn line<T, F>(&mut self, number: usize, text: &str) -> Result<Option<Item<T, F>>, Stop>
    where
        T: for<'de> Deserialize<'de>,
        F: for<'de> Deserialize<'de>,
    {
        if text.trim().is_empty() {
            return Ok(None);
        }
        let parsed: Line<T, F> = serde_json::from_str(text)
            .map_err(|err| Stop::Truncated(format!("line {number}: {err}")))?;
        let item = match parsed {
            Line::Header {
                format,
                target,
                started_ns,
            } => {
                if !FORMATS_READ.contains(&format.as_str()) {
                    return Err(Stop::Unreadable(format!(
                        "unsupported record format '{format}' (this memtrace reads {})",
                        FORMATS_READ.join(" and ")
                    )));
                }
                self.header = true;
                Item::Header { target, started_ns }
            }
            _ if !self.header => {
                return Err(Stop::Unreadable(format!(
                    "not a memtrace record file (line {number} comes before any header)"
                )));
            }
            Line::Spec {
                index,
                function,
                allocator,
                family,
                memory,
                domain,
                module,
                estimate,
            } => {
                if usize::from(index) != self.domains.len() {
                    return Err(Stop::Truncated(format!(
                        "line {number}: spec {index} out of order"
                    )));
                }
                self.domains.push(domain);
                Item::Spec {
                    function,
                    allocator,
                    family,
                    memory,
                    domain,
                    module,
                    estimate,
                }
            }
            Line::Stack { id, frames } => Item::Stack { id, frames },
            Line::PyStack {
                id,
                frames,
                truncated,
            } => Item::PyStack {
                id,
                frames,
                truncated,
            },
            Line::Event { e, py, tag } => {
                let wire = wire_of(&e, py, tag);
                let event = event::from_wire(&wire)
                    .map_err(|_| Stop::Truncated(format!("line {number}: undecodable event")))?;
                let Some(domain) = self.domains.get(usize::from(event.spec)).copied() else {
                    return Err(Stop::Truncated(format!(
                        "line {number}: event of unknown spec {}",
                        event.spec
                    )));
                };
                Item::Event {
                    event,
                    domain,
                    wire,
                }
            }
            Line::Object { id, path, .. } => {
                let path = PathBuf::from(path);
                if self.objects.insert(id, path.clone()).is_some() {
                    return Err(Stop::Truncated(format!(
                        "line {number}: object {id} defined twice"
                    )));
                }
                Item::Object { path }
            }
            Line::Sym {
                object,
                offset,
                symbol,
                file,
                line,
                unreadable,
                inlined,
            } => {
                let Some(module) = self.objects.get(&object).cloned() else {
                    return Err(Stop::Truncated(format!(
                        "line {number}: symbol of unknown object {object}"
                    )));
                };
                Item::Sym {
                    module,
                    offset,
                    symbol,
                    file,
                    line,
                    unreadable,
                    inlined,
                }
            }
            Line::Snapshot { t_s } => Item::Snapshot { t_s },
            Line::End { ended_ns } => Item::End { ended_ns },
            Line::Footer(footer) => Item::Footer(footer),
        };
        Ok(Some(item))
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The fields of an `event` line, its Python stack and its tag, as the ring
/// buffer carried them (each narrowed back to its wire width).
pub fn wire_of(e: &[i64; 10], py_stack: u32, tag: u32) -> WireEvent {
    WireEvent {
        ts_ns: e[0] as u64,
        addr: e[1] as u64,
        size: e[2] as u64,
        aux: e[3] as u64,
        pid: e[4] as u32,
        tid: e[5] as u32,
        stack_id: e[6] as i32,
        spec: e[7] as u16,
        kind: e[8] as u8,
        flags: e[9] as u8,
        py_stack,
        tag,
    }
}

/// The fields of an `event` line for a wire event.
pub fn event_fields(wire: &WireEvent) -> [i64; 10] {
    [
        wire.ts_ns as i64,
        wire.addr as i64,
        wire.size as i64,
        wire.aux as i64,
        i64::from(wire.pid),
        i64::from(wire.tid),
        i64::from(wire.stack_id),
        i64::from(wire.spec),
        i64::from(wire.kind),
        i64::from(wire.flags),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::de::IgnoredAny;
    use std::path::Path;

    type Read = Result<Option<Item<IgnoredAny, IgnoredAny>>, Stop>;

    const HEADER: &str =
        r#"{"type":"header","format":"memtrace-record/1","target":{},"started_ns":5}"#;
    const SPEC0: &str = r#"{"type":"spec","index":0,"function":"malloc","allocator":"libc","family":0,"memory":"host","domain":"Heap"}"#;

    #[test]
    fn lines_before_a_header_make_the_file_unreadable() {
        let mut reader = Reader::default();
        let read: Read = reader.line(1, SPEC0);
        assert!(matches!(read, Err(Stop::Unreadable(m)) if m.contains("line 1 comes before")));
        let other = HEADER.replace("record/1", "record/9");
        let read: Read = Reader::default().line(1, &other);
        assert!(
            matches!(read, Err(Stop::Unreadable(ref m)) if m.contains("record/9") && !m.contains('\n')),
            "{read:?}"
        );
    }

    #[test]
    fn an_event_needs_its_spec_and_a_known_kind() {
        let mut reader = Reader::default();
        let read: Read = reader.line(1, HEADER);
        assert!(matches!(read, Ok(Some(Item::Header { started_ns: 5, .. }))));
        let blank: Read = reader.line(2, "  ");
        assert!(matches!(blank, Ok(None)));
        let event = r#"{"type":"event","e":[9,4096,16,0,1,1,-1,0,0,0]}"#;
        let early: Read = reader.line(3, event);
        assert_eq!(
            early.expect_err("no spec yet"),
            Stop::Truncated("line 3: event of unknown spec 0".into())
        );
        let spec: Read = reader.line(3, SPEC0);
        assert!(matches!(spec, Ok(Some(Item::Spec { .. }))));
        let again: Read = reader.line(4, SPEC0);
        assert_eq!(
            again.expect_err("index 0 twice"),
            Stop::Truncated("line 4: spec 0 out of order".into())
        );
        let read: Read = reader.line(5, event);
        let Ok(Some(Item::Event { event, domain, .. })) = read else {
            panic!("event: {read:?}");
        };
        assert_eq!((event.ts_ns, domain), (9, Domain::Heap));
        let bad_kind = r#"{"type":"event","e":[9,4096,16,0,1,1,-1,0,200,0]}"#;
        let read: Read = reader.line(6, bad_kind);
        assert_eq!(
            read.expect_err("kind 200"),
            Stop::Truncated("line 6: undecodable event".into())
        );
    }

    #[test]
    fn the_end_of_the_trace_is_read() {
        let mut reader = Reader::default();
        let _: Read = reader.line(1, HEADER);
        let read: Read = reader.line(2, r#"{"type":"end","ended_ns":77}"#);
        assert!(
            matches!(read, Ok(Some(Item::End { ended_ns: 77 }))),
            "{read:?}"
        );
    }

    #[test]
    fn a_cut_line_stops_the_read() {
        let mut reader = Reader::default();
        let read: Read = reader.line(1, &HEADER[..HEADER.len() - 7]);
        assert!(matches!(read, Err(Stop::Truncated(m)) if m.starts_with("line 1: EOF")));
    }

    #[test]
    fn event_fields_round_trip() {
        let wire = WireEvent {
            ts_ns: u64::MAX,
            addr: 1 << 63,
            size: 7,
            aux: u64::MAX - 1,
            pid: u32::MAX,
            tid: 3,
            stack_id: -17,
            spec: u16::MAX,
            kind: 2,
            flags: 0xff,
            py_stack: 0,
            tag: 0xffff_fffe,
        };
        let back = wire_of(&event_fields(&wire), 0, wire.tag);
        assert_eq!(back.tag, 0xffff_fffe);
        assert_eq!(
            (
                back.ts_ns,
                back.addr,
                back.aux,
                back.pid,
                back.stack_id,
                back.spec,
                back.flags
            ),
            (
                u64::MAX,
                1 << 63,
                u64::MAX - 1,
                u32::MAX,
                -17,
                u16::MAX,
                0xff
            )
        );
    }

    #[test]
    fn python_stacks_and_an_events_python_stack_are_read() {
        let mut reader = Reader::default();
        let v2 = HEADER.replace("record/1", "record/2");
        let _: Read = reader.line(1, &v2);
        let _: Read = reader.line(2, SPEC0);
        let py = r#"{"type":"py_stack","id":7,"frames":[["handle","app.py",12],["<module>",null,null]],"truncated":true}"#;
        let read: Read = reader.line(3, py);
        let Ok(Some(Item::PyStack {
            id,
            frames,
            truncated,
        })) = read
        else {
            panic!("py_stack: {read:?}");
        };
        assert_eq!((id, truncated, frames.len()), (7, true, 2));
        assert_eq!(
            frames[0],
            ("handle".into(), Some("app.py".into()), Some(12))
        );
        let event = r#"{"type":"event","e":[9,4096,16,0,1,1,-1,0,0,0],"py":7}"#;
        let read: Read = reader.line(4, event);
        let Ok(Some(Item::Event { event, .. })) = read else {
            panic!("event: {read:?}");
        };
        assert_eq!(event.py_stack, 7);
        // Written without `py` when there is none, and without `truncated`
        // when it is not.
        let line: Line<(), ()> = Line::Event {
            e: [0; 10],
            py: 0,
            tag: 0,
        };
        let text = serde_json::to_string(&line).expect("serializes");
        assert_eq!(text, r#"{"type":"event","e":[0,0,0,0,0,0,0,0,0,0]}"#);
        let line: Line<(), ()> = Line::PyStack {
            id: 1,
            frames: Vec::new(),
            truncated: false,
        };
        let text = serde_json::to_string(&line).expect("serializes");
        assert_eq!(text, r#"{"type":"py_stack","id":1,"frames":[]}"#);
    }

    #[test]
    fn version_1_records_read_without_python_stacks() {
        let mut reader = Reader::default();
        let read: Read = reader.line(1, HEADER);
        assert!(matches!(read, Ok(Some(Item::Header { .. }))), "{read:?}");
        let _: Read = reader.line(2, SPEC0);
        let event = r#"{"type":"event","e":[9,4096,16,0,1,1,-1,0,0,0]}"#;
        let read: Read = reader.line(3, event);
        let Ok(Some(Item::Event { event, .. })) = read else {
            panic!("event: {read:?}");
        };
        assert_eq!(event.py_stack, 0);
    }

    #[test]
    fn symbol_lines_round_trip_and_name_a_known_object() {
        let mut reader = Reader::default();
        let v3 = HEADER.replace("record/1", "record/3");
        let _: Read = reader.line(1, &v3);
        let lines: [Line<(), ()>; 3] = [
            Line::Object {
                id: 4,
                path: "/usr/lib/libc.so.6".into(),
                build_id: Some("93ac61ec".into()),
            },
            Line::Sym {
                object: 4,
                offset: 0x2a,
                symbol: Some("malloc".into()),
                file: Some("malloc.c".into()),
                line: Some(3021),
                unreadable: false,
                inlined: vec![crate::symbolize::InlinedCall {
                    symbol: "tcache_get".into(),
                    file: Some("malloc.c".into()),
                    line: Some(3190),
                }],
            },
            Line::Sym {
                object: 4,
                offset: 0x2b,
                symbol: None,
                file: None,
                line: None,
                unreadable: true,
                inlined: Vec::new(),
            },
        ];
        let texts: Vec<String> = lines
            .iter()
            .map(|line| serde_json::to_string(line).expect("serializes"))
            .collect();
        assert_eq!(
            texts,
            [
                r#"{"type":"object","id":4,"path":"/usr/lib/libc.so.6","build_id":"93ac61ec"}"#,
                r#"{"type":"sym","object":4,"offset":42,"symbol":"malloc","file":"malloc.c","line":3021,"inlined":[{"symbol":"tcache_get","file":"malloc.c","line":3190}]}"#,
                r#"{"type":"sym","object":4,"offset":43,"unreadable":true}"#,
            ]
        );
        let unknown: Read = reader.line(2, &texts[1]);
        assert_eq!(
            unknown.expect_err("object 4 not defined yet"),
            Stop::Truncated("line 2: symbol of unknown object 4".into())
        );
        let read: Read = reader.line(2, &texts[0]);
        assert!(
            matches!(read, Ok(Some(Item::Object { ref path })) if path == Path::new("/usr/lib/libc.so.6")),
            "{read:?}"
        );
        let read: Read = reader.line(3, &texts[1]);
        let Ok(Some(Item::Sym {
            module,
            offset,
            symbol,
            file,
            line,
            unreadable,
            inlined,
        })) = read
        else {
            panic!("sym: {read:?}");
        };
        assert_eq!(
            (module.to_str(), offset, unreadable),
            (Some("/usr/lib/libc.so.6"), 42, false)
        );
        assert_eq!(
            (symbol.as_deref(), file.as_deref(), line),
            (Some("malloc"), Some("malloc.c"), Some(3021))
        );
        assert_eq!(inlined.len(), 1);
        assert_eq!(inlined[0].symbol, "tcache_get");
        let read: Read = reader.line(4, &texts[2]);
        assert!(
            matches!(
                read,
                Ok(Some(Item::Sym {
                    offset: 43,
                    unreadable: true,
                    symbol: None,
                    ..
                }))
            ),
            "{read:?}"
        );
        let again: Read = reader.line(5, &texts[0]);
        assert_eq!(
            again.expect_err("object 4 twice"),
            Stop::Truncated("line 5: object 4 defined twice".into())
        );
    }
}
