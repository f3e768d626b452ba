//! Reading `--record` files (`memtrace/src/record/format.rs`, the line
//! checks `memtrace report FILE` makes): arbitrary text, read line by line
//! as `replay` does, never panics; reading stops at the first bad line; an
//! accepted event always belongs to a spec read before it, with that spec's
//! domain, a symbol always names an object read before it, and nothing is
//! accepted before a header.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde::de::IgnoredAny;

/// format.rs reaches `crate::event` and `crate::probe::catalog`; both are
/// pure and included at the crate root (see procfs_parse.rs for why).
#[allow(dead_code)]
#[path = "../../memtrace/src/event.rs"]
mod event;

#[allow(dead_code)]
#[path = "../../memtrace/src/probe/catalog.rs"]
pub mod catalog;

mod probe {
    pub use super::catalog;
}

#[allow(dead_code)]
#[path = "../../memtrace/src/record/format.rs"]
mod format;

use format::{Item, Reader, Stop};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut reader = Reader::default();
    let mut header = false;
    let mut domains = Vec::new();
    let mut objects = std::collections::HashSet::new();
    for (number, line) in text.lines().enumerate() {
        let read: Result<Option<Item<IgnoredAny, IgnoredAny>>, Stop> =
            reader.line(number + 1, line);
        let item = match read {
            Ok(Some(item)) => item,
            Ok(None) => {
                assert!(line.trim().is_empty());
                continue;
            }
            Err(Stop::Unreadable(_)) => break,
            Err(Stop::Truncated(reason)) => {
                assert!(reason.starts_with(&format!("line {}: ", number + 1)));
                break;
            }
        };
        match item {
            Item::Header { .. } => header = true,
            _ if !header => panic!("line {} accepted before a header", number + 1),
            Item::Spec { domain, .. } => domains.push(domain),
            Item::Event { event, domain, .. } => {
                assert_eq!(domains.get(usize::from(event.spec)), Some(&domain));
            }
            Item::Object { path } => {
                objects.insert(path);
            }
            Item::Sym { module, .. } => assert!(objects.contains(&module)),
            Item::Stack { .. }
            | Item::PyStack { .. }
            | Item::Snapshot { .. }
            | Item::End { .. }
            | Item::Footer(_) => {}
        }
    }
});
