//! User-declared resource pairs (`--pairs FILE`, `--preset NAME`): any
//! create/destroy pair in any library — descriptors, streams, model handles,
//! file descriptors, custom pools — traced by the same generic probes as the
//! built-in allocators. A small TOML file names, per pair, the two functions,
//! which argument or return value is the handle, which is the size, and which
//! return value means success.
//!
//! ```toml
//! [[pair]]
//! name = "acl-tensor-desc"        # allocator name in reports
//! alloc = "aclCreateTensorDesc"
//! free = "aclDestroyTensorDesc"
//! handle = "return"               # return | argN | outN (outN: a pointer to the handle)
//! handle_bits = 64                # 32 for int / uint32_t handles
//! size = "arg1"                   # optional: bytes; otherwise handles are counted
//! success = "nonnull"             # nonnull | nonnegative | zero | an integer status
//! free_handle = "arg0"            # the free function's handle argument
//! free_checked = false            # true: the free only counts when it returns 0
//! ```

use serde::Deserialize;

use super::catalog::{Allocator, Domain, FuncDef, Memory};
use memtrace_common::{RetKind, SpecKind, SpecQuirk, ARG_NONE};

/// Families 0..8 are the built-in allocators'; pairs take the next ones.
const FIRST_FAMILY: u8 = 8;
const MAX_PAIRS: usize = 200;

/// The presets shipped with memtrace.
pub const PRESETS: &[(&str, &str)] = &[
    ("acl-handles", include_str!("presets/acl-handles.toml")),
    ("cuda-handles", include_str!("presets/cuda-handles.toml")),
    ("fds", include_str!("presets/fds.toml")),
];

/// A pairs file that could not be used, naming where.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{source_name}: line {line}: {reason}")]
pub struct PairsError {
    pub source_name: String,
    pub line: usize,
    pub reason: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PairsFile {
    #[serde(default)]
    pair: Vec<PairSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PairSpec {
    name: String,
    alloc: String,
    free: String,
    #[serde(default = "default_handle")]
    handle: String,
    #[serde(default = "default_bits")]
    handle_bits: u8,
    size: Option<String>,
    #[serde(default = "default_success")]
    success: toml::Value,
    #[serde(default = "default_free_handle")]
    free_handle: String,
    #[serde(default)]
    free_checked: bool,
}

fn default_handle() -> String {
    "return".into()
}
fn default_bits() -> u8 {
    64
}
fn default_success() -> toml::Value {
    toml::Value::String("nonnull".into())
}
fn default_free_handle() -> String {
    "arg0".into()
}

/// Where a value is: an argument register, or memory an argument points to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Return,
    Arg(u8),
    Out(u8),
}

fn parse_slot(text: &str) -> Result<Slot, String> {
    let index = |rest: &str| -> Result<u8, String> {
        rest.parse::<u8>()
            .ok()
            .filter(|n| *n < 6)
            .ok_or_else(|| format!("'{text}': argument index must be 0 to 5"))
    };
    if text == "return" {
        Ok(Slot::Return)
    } else if let Some(rest) = text.strip_prefix("arg") {
        Ok(Slot::Arg(index(rest)?))
    } else if let Some(rest) = text.strip_prefix("out") {
        Ok(Slot::Out(index(rest)?))
    } else {
        Err(format!("'{text}': expected return, argN or outN"))
    }
}

fn leak(text: &str) -> &'static str {
    Box::leak(text.to_string().into_boxed_str())
}

/// Parses a pairs file into probe definitions (two per pair). Definitions live
/// for the whole run, so they are leaked on purpose.
pub fn parse(
    text: &str,
    source_name: &str,
    first_index: usize,
) -> Result<Vec<&'static FuncDef>, PairsError> {
    let error = |line: usize, reason: String| PairsError {
        source_name: source_name.to_string(),
        line,
        reason,
    };
    let file: PairsFile = toml::from_str(text).map_err(|err| {
        let line = err
            .span()
            .map(|span| text[..span.start.min(text.len())].lines().count().max(1))
            .unwrap_or(1);
        error(line, err.message().to_string())
    })?;
    let line_of = |needle: &str| {
        text.lines()
            .position(|l| l.contains(needle))
            .map_or(1, |i| i + 1)
    };
    let mut defs = Vec::new();
    for (i, pair) in file.pair.iter().enumerate() {
        let line = line_of(&format!("\"{}\"", pair.name));
        for (key, value) in [
            ("name", &pair.name),
            ("alloc", &pair.alloc),
            ("free", &pair.free),
        ] {
            if value.trim().is_empty() {
                return Err(error(line, format!("{key} is empty")));
            }
        }
        if Allocator::parse_builtin(&pair.name).is_some() {
            // A replayed record would take it for the built-in allocator.
            return Err(error(
                line,
                format!("name = \"{}\" is a built-in allocator's", pair.name),
            ));
        }
        let index = first_index + i;
        if index >= MAX_PAIRS {
            return Err(error(line, format!("at most {MAX_PAIRS} pairs")));
        }
        let family = FIRST_FAMILY + index as u8;
        let allocator = Allocator::Custom {
            name: leak(&pair.name),
            family,
        };
        let domain = Domain::Custom(family);
        let memory = if pair.size.is_some() {
            Memory::Host
        } else {
            Memory::Handle
        };
        let mut alloc = FuncDef::new(leak(&pair.alloc), allocator, memory, domain);
        match parse_slot(&pair.handle).map_err(|r| error(line, r))? {
            Slot::Return => {}
            Slot::Out(n) => alloc.out_arg = n,
            Slot::Arg(_) => {
                return Err(error(line, "handle must be return or outN".into()));
            }
        }
        if let Some(size) = &pair.size {
            match parse_slot(size).map_err(|r| error(line, r))? {
                Slot::Arg(n) => alloc.size_arg = n,
                _ => return Err(error(line, "size must be argN".into())),
            }
        } else {
            // Counted, not measured: each handle weighs one "byte".
            alloc.size_arg = ARG_NONE;
        }
        match &pair.success {
            toml::Value::String(s) if s == "nonnull" => alloc.ret = RetKind::Pointer,
            toml::Value::String(s) if s == "nonnegative" => alloc.ret = RetKind::NonNegative,
            toml::Value::String(s) if s == "zero" => alloc.ret = RetKind::Status,
            toml::Value::Integer(code) => {
                alloc.ret = RetKind::Status;
                alloc.success_code = *code;
            }
            other => {
                return Err(error(
                    line,
                    format!("success = {other:?}: expected \"nonnull\", \"nonnegative\", \"zero\" or an integer"),
                ))
            }
        }
        if alloc.out_arg != ARG_NONE && alloc.ret != RetKind::Status {
            return Err(error(
                line,
                "an outN handle needs success = \"zero\" or an integer status".into(),
            ));
        }
        let quirk = match pair.handle_bits {
            64 => SpecQuirk::None,
            32 => SpecQuirk::Handle32,
            other => {
                return Err(error(
                    line,
                    format!("handle_bits = {other}: expected 32 or 64"),
                ))
            }
        };
        alloc.quirk = quirk;
        let mut free = FuncDef::new(leak(&pair.free), allocator, memory, domain);
        free.kind = SpecKind::Free;
        free.quirk = quirk;
        free.ptr_arg = match parse_slot(&pair.free_handle).map_err(|r| error(line, r))? {
            Slot::Arg(n) => n,
            _ => return Err(error(line, "free_handle must be argN".into())),
        };
        free.ret = if pair.free_checked {
            RetKind::Status
        } else {
            RetKind::Void
        };
        defs.push(&*Box::leak(Box::new(alloc)));
        defs.push(&*Box::leak(Box::new(free)));
    }
    Ok(defs)
}

/// The text of a preset.
pub fn preset(name: &str) -> Option<&'static str> {
    PRESETS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, text)| *text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_parse() {
        let mut index = 0;
        for (name, text) in PRESETS {
            let defs = parse(text, name, index).unwrap_or_else(|e| panic!("{e}"));
            assert!(!defs.is_empty(), "{name}");
            index += defs.len() / 2;
        }
    }

    #[test]
    fn a_pair_becomes_two_probes() {
        let text = r#"
[[pair]]
name = "model"
alloc = "aclmdlLoadFromFile"
free = "aclmdlUnload"
handle = "out1"
handle_bits = 32
success = "zero"
free_checked = true
"#;
        let defs = parse(text, "test.toml", 0).expect("parses");
        assert_eq!(defs.len(), 2);
        let (alloc, free) = (defs[0], defs[1]);
        assert_eq!(alloc.name, "aclmdlLoadFromFile");
        assert_eq!(
            (alloc.out_arg, alloc.ret, alloc.quirk),
            (1, RetKind::Status, SpecQuirk::Handle32)
        );
        assert_eq!(alloc.allocator.name(), "model");
        assert_eq!(alloc.memory, Memory::Handle);
        assert_eq!(
            (free.kind, free.ptr_arg, free.ret),
            (SpecKind::Free, 0, RetKind::Status)
        );
        assert_eq!(alloc.allocator.family(), FIRST_FAMILY);
    }

    #[test]
    fn errors_name_the_line() {
        let bad_slot = "[[pair]]\nname = \"x\"\nalloc = \"a\"\nfree = \"f\"\nhandle = \"arg9\"\n";
        let err = parse(bad_slot, "p.toml", 0).expect_err("bad slot");
        assert_eq!(err.line, 2);
        assert!(err.to_string().contains("p.toml: line 2"), "{err}");
        let syntax = "[[pair]]\nname = \"x\"\nalloc = \n";
        let err = parse(syntax, "p.toml", 0).expect_err("syntax");
        assert_eq!(err.line, 3, "{err}");
        let unknown = "[[pair]]\nname = \"x\"\nalloc = \"a\"\nfree = \"f\"\nbogus = 1\n";
        assert!(parse(unknown, "p.toml", 0).is_err());
        let success = "[[pair]]\nname = \"x\"\nalloc = \"a\"\nfree = \"f\"\nsuccess = \"maybe\"\n";
        assert!(parse(success, "p.toml", 0)
            .expect_err("success")
            .reason
            .contains("success"));
    }

    #[test]
    fn names_are_not_empty_nor_built_in() {
        let empty = "[[pair]]\nname = \"x\"\nalloc = \"\"\nfree = \"f\"\n";
        let err = parse(empty, "p.toml", 0).expect_err("empty alloc");
        assert_eq!((err.line, err.reason.as_str()), (2, "alloc is empty"));
        let blank = "[[pair]]\nname = \" \"\nalloc = \"a\"\nfree = \"f\"\n";
        assert!(parse(blank, "p.toml", 0).is_err());
        let builtin = "[[pair]]\nname = \"cuda\"\nalloc = \"a\"\nfree = \"f\"\n";
        let err = parse(builtin, "p.toml", 0).expect_err("built-in name");
        assert!(err.reason.contains("built-in"), "{err}");
    }
}
