//! Ring-buffer record decoding (`memtrace/src/event.rs`): any byte string
//! either decodes or is rejected with an error, never a panic; a decoded
//! event carries exactly the wire fields.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[allow(dead_code)]
#[path = "../../memtrace/src/event.rs"]
mod event;

use memtrace_common::{EventKind, WireEvent};

fuzz_target!(|data: &[u8]| {
    // `event::decode` is test-only; the ring-buffer consumer does the same two steps.
    match event::decode_wire(data).and_then(|wire| event::from_wire(&wire)) {
        Ok(ev) => {
            assert!(data.len() >= std::mem::size_of::<WireEvent>());
            // SAFETY: length checked just above; WireEvent is plain integers.
            let wire: WireEvent = unsafe { std::ptr::read_unaligned(data.as_ptr().cast()) };
            assert_eq!(ev.ts_ns, wire.ts_ns);
            assert_eq!(ev.pid, wire.pid);
            assert_eq!(ev.tid, wire.tid);
            assert_eq!(ev.spec, wire.spec);
            assert!(EventKind::try_from(wire.kind).is_ok());
            if let event::Action::Failed { code, .. } = ev.action {
                assert_eq!(code, i64::from(wire.aux as i32));
            }
        }
        Err(event::DecodeError::Size(n)) => {
            assert_eq!(n, data.len());
            assert!(n < std::mem::size_of::<WireEvent>());
        }
        Err(event::DecodeError::Kind(_)) => {}
    }
});
