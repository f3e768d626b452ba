//! User-declared resource pairs (`--pairs FILE`, `--preset NAME`): any
//! create/destroy pair in any library — descriptors, streams, model handles,
//! file descriptors, custom pools — traced by the same generic probes as the
//! built-in allocators. A small TOML file names, per pair, the functions,
//! which argument or return value is the handle, which is the size, and which
//! return value means success.
//!
//! ```toml
//! [[pair]]
//! name = "acl-tensor-desc"        # allocator name in reports
//! alloc = "aclCreateTensorDesc"   # one function, or a list of them
//! free = "aclDestroyTensorDesc"   # one function, or a list of them
//! handle = "return"               # return | argN | outN (outN: a pointer to the handle)
//! handle_bits = 64                # 32 for int / uint32_t handles
//! size = "arg1"                   # optional: bytes; otherwise handles are counted
//! success = "nonnull"             # nonnull | nonnegative | zero | an integer status
//! free_handle = "arg0"            # the free functions' handle argument
//! free_checked = false            # true: a free only counts when it returns 0
//! ```
//!
//! A pair is one kind of resource: each of its `alloc` functions creates
//! handles (all called alike: same handle, size and success), and each of its
//! `free` functions releases a handle whichever function created it
//! (`alloc = ["open", "openat", "dup"]`, `free = "close"`). A function is
//! probed once, so a release function named by several pairs (of one file, or
//! of every source given to one [`PairsParser`]) is one probe: those pairs
//! share one address domain and it releases handles of any of them; they must
//! then call it alike (`free_handle`, `free_checked`, `handle_bits`). An
//! alloc function belongs to one pair only.

use std::collections::HashMap;

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
    ("files", include_str!("presets/files.toml")),
    ("otel-memory", include_str!("presets/otel-memory.toml")),
    ("pytorch", include_str!("presets/pytorch.toml")),
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
    alloc: Names,
    free: Names,
    handle: Option<String>,
    #[serde(default = "default_bits")]
    handle_bits: u8,
    size: Option<String>,
    #[serde(default = "default_success")]
    success: toml::Value,
    #[serde(default = "default_free_handle")]
    free_handle: String,
    #[serde(default)]
    free_checked: bool,
    /// USDT pairs: `host`, `device` or `handle`.
    memory: Option<String>,
    /// USDT pairs: the argument with the device index.
    device: Option<String>,
    /// USDT pairs: the argument with the stream.
    stream: Option<String>,
    /// USDT pairs: the argument with the bytes a sample stands for.
    weight: Option<String>,
}

/// `alloc`/`free`: one function name (the original format) or a list, or
/// `{ usdt = "provider:name" }` (or a list of probe names).
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "a function name, a list of function names, or { usdt = \"provider:name\" }"
)]
enum Names {
    One(String),
    Many(Vec<String>),
    Usdt(UsdtNames),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UsdtNames {
    usdt: OneOrMany,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl Names {
    /// The names, each once, in the order given.
    fn list(&self) -> Vec<&str> {
        let all: Vec<&str> = match self {
            Names::One(name)
            | Names::Usdt(UsdtNames {
                usdt: OneOrMany::One(name),
            }) => {
                vec![name.as_str()]
            }
            Names::Many(names)
            | Names::Usdt(UsdtNames {
                usdt: OneOrMany::Many(names),
            }) => names.iter().map(String::as_str).collect(),
        };
        let mut unique: Vec<&str> = Vec::with_capacity(all.len());
        for name in all {
            if !unique.contains(&name) {
                unique.push(name);
            }
        }
        unique
    }
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

/// Most arguments an `sdt.h` probe has.
const USDT_MAX_ARGS: u8 = 12;

/// A USDT probe's argument: `argN`, N from 0 to 11.
fn parse_usdt_arg(key: &str, text: &str) -> Result<u8, String> {
    text.strip_prefix("arg")
        .and_then(|rest| rest.parse::<u8>().ok())
        .filter(|n| *n < USDT_MAX_ARGS)
        .ok_or_else(|| {
            format!("{key} = \"{text}\": expected argN, N from 0 to 11 (the probe's argument)")
        })
}

/// `provider:name`, both parts non-empty.
fn parse_probe_name(text: &str) -> Result<(&'static str, &'static str), String> {
    match text.split_once(':') {
        Some((provider, name))
            if !provider.is_empty() && !name.is_empty() && !name.contains(':') =>
        {
            Ok((leak(provider), leak(name)))
        }
        _ => Err(format!(
            "usdt = \"{text}\": expected \"provider:name\" (memtrace probes PID|FILE lists them)"
        )),
    }
}

fn leak(text: &str) -> &'static str {
    Box::leak(text.to_string().into_boxed_str())
}

/// A release function as the first pair naming it declared it.
#[derive(Clone, Debug)]
struct Release {
    pair: String,
    domain: Domain,
    ptr_arg: u8,
    ret: RetKind,
    quirk: SpecQuirk,
}

/// Parses pairs sources one after another, numbering their pairs on and
/// remembering every alloc and release function declared so far, so that a
/// release named again shares its domain and an alloc is not claimed twice.
#[derive(Debug, Default)]
pub struct PairsParser {
    next_index: usize,
    releases: HashMap<String, Release>,
    /// Alloc function -> the pair that declared it.
    allocs: HashMap<String, String>,
}

impl PairsParser {
    /// A parser whose first pair takes pair index `first_index`.
    pub fn new(first_index: usize) -> Self {
        PairsParser {
            next_index: first_index,
            ..PairsParser::default()
        }
    }

    /// The pair index the next source's first pair will take.
    #[cfg(test)]
    pub fn next_index(&self) -> usize {
        self.next_index
    }

    /// Parses one source into probe definitions: one per alloc function and
    /// one per (pair, free function), so at least two per pair. A release
    /// function named by several pairs yields one definition per pair, all
    /// alike but for the allocator name; they sit at one address, where the
    /// attach plan probes the function once. Definitions live for the whole
    /// run, so they are leaked on purpose. On error nothing is remembered.
    pub fn parse(
        &mut self,
        text: &str,
        source_name: &str,
    ) -> Result<Vec<&'static FuncDef>, PairsError> {
        let mut next = PairsParser {
            next_index: self.next_index,
            releases: self.releases.clone(),
            allocs: self.allocs.clone(),
        };
        let defs = next.parse_into(text, source_name)?;
        *self = next;
        Ok(defs)
    }

    fn parse_into(
        &mut self,
        text: &str,
        source_name: &str,
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
        for pair in &file.pair {
            let line = line_of(&format!("\"{}\"", pair.name));
            let allocs = pair.alloc.list();
            let frees = pair.free.list();
            if pair.name.trim().is_empty() {
                return Err(error(line, "name is empty".into()));
            }
            for (key, names) in [("alloc", &allocs), ("free", &frees)] {
                if names.is_empty() || names.iter().any(|n| n.trim().is_empty()) {
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
            let index = self.next_index;
            if index >= MAX_PAIRS {
                return Err(error(line, format!("at most {MAX_PAIRS} pairs")));
            }
            let family = FIRST_FAMILY + index as u8;
            let allocator = Allocator::Custom {
                name: leak(&pair.name),
                family,
            };
            match (&pair.alloc, &pair.free) {
                (Names::Usdt(_), Names::Usdt(_)) => {
                    let usdt = self
                        .usdt_pair(pair, allocator, &allocs, &frees)
                        .map_err(|r| error(line, r))?;
                    self.next_index += 1;
                    defs.extend(usdt);
                    continue;
                }
                (Names::Usdt(_), _) | (_, Names::Usdt(_)) => {
                    return Err(error(
                        line,
                        "alloc and free must both be USDT probes ({ usdt = \"provider:name\" }) or both functions".into(),
                    ));
                }
                _ => {}
            }
            if let Some(key) = [
                ("memory", &pair.memory),
                ("device", &pair.device),
                ("stream", &pair.stream),
                ("weight", &pair.weight),
            ]
            .iter()
            .find_map(|(key, value)| value.is_some().then_some(*key))
            {
                return Err(error(line, format!("{key} is for USDT pairs only")));
            }
            self.next_index += 1;
            let memory = if pair.size.is_some() {
                Memory::Host
            } else {
                Memory::Handle
            };

            // How every alloc function of the pair is called.
            let mut template = FuncDef::new("", allocator, memory, Domain::Custom(family));
            match parse_slot(pair.handle.as_deref().unwrap_or("return"))
                .map_err(|r| error(line, r))?
            {
                Slot::Return => {}
                Slot::Out(n) => template.out_arg = n,
                Slot::Arg(_) => {
                    return Err(error(line, "handle must be return or outN".into()));
                }
            }
            if let Some(size) = &pair.size {
                match parse_slot(size).map_err(|r| error(line, r))? {
                    Slot::Arg(n) => template.size_arg = n,
                    _ => return Err(error(line, "size must be argN".into())),
                }
            } else {
                // Counted, not measured: each handle weighs one "byte".
                template.size_arg = ARG_NONE;
            }
            match &pair.success {
                toml::Value::String(s) if s == "nonnull" => template.ret = RetKind::Pointer,
                toml::Value::String(s) if s == "nonnegative" => {
                    template.ret = RetKind::NonNegative
                }
                toml::Value::String(s) if s == "zero" => template.ret = RetKind::Status,
                toml::Value::Integer(code) => {
                    template.ret = RetKind::Status;
                    template.success_code = *code;
                }
                other => {
                    return Err(error(
                        line,
                        format!("success = {other:?}: expected \"nonnull\", \"nonnegative\", \"zero\" or an integer"),
                    ))
                }
            }
            if template.out_arg != ARG_NONE && template.ret != RetKind::Status {
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
            template.quirk = quirk;
            let release = Release {
                pair: pair.name.clone(),
                domain: Domain::Custom(family),
                ptr_arg: match parse_slot(&pair.free_handle).map_err(|r| error(line, r))? {
                    Slot::Arg(n) => n,
                    _ => return Err(error(line, "free_handle must be argN".into())),
                },
                ret: if pair.free_checked {
                    RetKind::Status
                } else {
                    RetKind::Void
                },
                quirk,
            };

            // Which functions are already someone's: a release shared with
            // earlier pairs puts this pair's handles in their domain.
            for name in &allocs {
                if frees.contains(name) || self.releases.contains_key(*name) {
                    return Err(error(
                        line,
                        format!("\"{name}\" is both an alloc and a free function"),
                    ));
                }
                if let Some(owner) = self.allocs.get(*name) {
                    return Err(error(
                        line,
                        format!("alloc \"{name}\" is already pair \"{owner}\"'s"),
                    ));
                }
            }
            let mut domain = release.domain;
            let mut shared_with: Option<&Release> = None;
            for name in &frees {
                if let Some(owner) = self.allocs.get(*name) {
                    return Err(error(
                        line,
                        format!("\"{name}\" is pair \"{owner}\"'s alloc function and this pair's free function"),
                    ));
                }
                let Some(earlier) = self.releases.get(*name) else {
                    continue;
                };
                if (earlier.ptr_arg, earlier.ret, earlier.quirk)
                    != (release.ptr_arg, release.ret, release.quirk)
                {
                    return Err(error(
                        line,
                        format!("free \"{name}\" is also pair \"{}\"'s, which calls it differently (free_handle, free_checked and handle_bits must agree)", earlier.pair),
                    ));
                }
                match shared_with {
                    Some(first) if first.domain != earlier.domain => {
                        return Err(error(
                            line,
                            format!(
                                "its free functions are releases of two other pairs (\"{}\" and \"{}\"): a handle can be released by one set of functions only",
                                first.pair, earlier.pair
                            ),
                        ));
                    }
                    _ => shared_with = Some(earlier),
                }
            }
            if let Some(first) = shared_with {
                domain = first.domain;
            }
            template.domain = domain;

            for name in &allocs {
                let mut alloc = template;
                alloc.name = leak(name);
                self.allocs.insert(name.to_string(), pair.name.clone());
                defs.push(&*Box::leak(Box::new(alloc)));
            }
            for name in &frees {
                let mut free = FuncDef::new(leak(name), allocator, memory, domain);
                free.kind = SpecKind::Free;
                free.quirk = quirk;
                free.ptr_arg = release.ptr_arg;
                free.ret = release.ret;
                self.releases
                    .entry(name.to_string())
                    .or_insert_with(|| Release {
                        domain,
                        ..release.clone()
                    });
                defs.push(&*Box::leak(Box::new(free)));
            }
        }
        Ok(defs)
    }
}

impl PairsParser {
    /// The two or more probe definitions of a USDT pair: its alloc probes
    /// create blocks at the probe, its free probes release them (no
    /// return value to check). Its probes belong to it alone.
    fn usdt_pair(
        &mut self,
        pair: &PairSpec,
        allocator: Allocator,
        allocs: &[&str],
        frees: &[&str],
    ) -> Result<Vec<&'static FuncDef>, String> {
        let Allocator::Custom { family, .. } = allocator else {
            return Err("a USDT pair is a custom allocator".into());
        };
        let arg = |key: &str, value: &Option<String>| -> Result<u8, String> {
            value
                .as_deref()
                .map_or(Ok(ARG_NONE), |text| parse_usdt_arg(key, text))
        };
        let ptr_arg = match pair.handle.as_deref() {
            Some(text) => parse_usdt_arg("handle", text)?,
            None => return Err(
                "a USDT pair needs handle = \"argN\" (the probe's argument holding the pointer)"
                    .into(),
            ),
        };
        if pair.size.is_some() && pair.weight.is_some() {
            return Err(
                "size and weight exclude each other (weight: the bytes a sample stands for)".into(),
            );
        }
        if pair.free_checked {
            return Err("free_checked: a USDT probe has no result to check".into());
        }
        let size_arg = arg("size", &pair.size)?;
        let weight_arg = arg("weight", &pair.weight)?;
        let memory = match pair.memory.as_deref() {
            None if size_arg == ARG_NONE && weight_arg == ARG_NONE => Memory::Handle,
            None | Some("host") => Memory::Host,
            Some("device") => Memory::Device,
            Some("handle") => Memory::Handle,
            Some(other) => {
                return Err(format!(
                    "memory = \"{other}\": expected \"host\", \"device\" or \"handle\""
                ))
            }
        };
        let quirk = match pair.handle_bits {
            64 => SpecQuirk::None,
            32 => SpecQuirk::Handle32,
            other => return Err(format!("handle_bits = {other}: expected 32 or 64")),
        };
        let free_ptr = parse_usdt_arg("free_handle", &pair.free_handle)?;
        let mut point = super::catalog::UsdtPoint {
            size_arg: if weight_arg == ARG_NONE {
                size_arg
            } else {
                weight_arg
            },
            aux_arg: arg("stream", &pair.stream)?,
            tag_arg: arg("device", &pair.device)?,
            estimate: weight_arg != ARG_NONE,
            ..super::catalog::UsdtPoint::new("", "", ptr_arg)
        };
        let domain = Domain::Custom(family);
        let mut defs = Vec::new();
        for (names, kind) in [(allocs, SpecKind::Alloc), (frees, SpecKind::Free)] {
            for name in names {
                let (provider, probe) = parse_probe_name(name)?;
                let full = format!("{provider}:{probe}");
                let key = format!("usdt {full}");
                if let Some(owner) = self.allocs.get(&key) {
                    return Err(format!("USDT probe {full} is already pair \"{owner}\"'s"));
                }
                self.allocs.insert(key, pair.name.clone());
                point.provider = provider;
                point.probe = probe;
                let mut def = FuncDef::new(leak(&full), allocator, memory, domain);
                def.kind = kind;
                def.ret = RetKind::Void;
                def.quirk = quirk;
                def.usdt = Some(if kind == SpecKind::Free {
                    super::catalog::UsdtPoint::new(provider, probe, free_ptr)
                } else {
                    point
                });
                defs.push(&*Box::leak(Box::new(def)));
            }
        }
        Ok(defs)
    }
}

/// Parses one pairs source on its own, its first pair taking pair index
/// `first_index` (see [`PairsParser::parse`]).
#[cfg(test)]
pub fn parse(
    text: &str,
    source_name: &str,
    first_index: usize,
) -> Result<Vec<&'static FuncDef>, PairsError> {
    PairsParser::new(first_index).parse(text, source_name)
}

/// Parses every source (name, text) in order, pairs numbered from 0 across
/// them, a release function named in several sources shared by their pairs
/// (an alloc function claimed by two sources is an error).
pub fn parse_sources(sources: &[(String, String)]) -> Result<Vec<&'static FuncDef>, PairsError> {
    let mut parser = PairsParser::new(0);
    let mut defs = Vec::new();
    for (name, text) in sources {
        defs.extend(parser.parse(text, name)?);
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
mod tests;
