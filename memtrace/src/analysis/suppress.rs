//! `--suppress FILE` allow-lists: parsing the file and matching live blocks
//! against it.
//!
//! One entry per line; blank lines and `#` comments are ignored, and an
//! entry may be followed by ` # comment` (a `#` after whitespace). Forms:
//!
//! - `leak:PATTERN` (LSan syntax): any frame's symbol or module path matches;
//! - `symbol:PATTERN`, `module:PATTERN`: only that field of any frame;
//! - `allocator:NAME`: `libc`, `mmap`, `cuda`, `cuda-driver`, `acl` or a
//!   custom pair's name (ASCII case-insensitive);
//! - `size:MIN-MAX`: inclusive, either end open (`size:1MiB-`, `size:-4096`),
//!   or `size:N` for exactly N; units B, K/KiB (1024), KB (1000), M/MiB,
//!   MB, G/GiB, GB, T/TiB, TB (case-insensitive, decimals allowed: `1.5M`);
//! - `addr:START-END` or bare `0xSTART-0xEND`: hex addresses, `0x` optional
//!   after `addr:`; matches a block whose address is in `[START, END)`.
//!
//! Patterns follow LSan: unanchored (a pattern without wildcards matches as a
//! substring), `*` matches any run and `?` one character, a leading `^`
//! anchors at the start and a trailing `$` at the end.

use std::fmt;
use std::path::{Path, PathBuf};

/// A malformed entry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("suppressions line {line}: {reason}")]
pub struct SuppressError {
    /// 1-based line number.
    pub line: usize,
    /// The line as written.
    pub text: String,
    pub reason: String,
}

/// Loading a suppressions file failed.
#[derive(Debug, thiserror::Error)]
pub enum SuppressLoadError {
    #[error("cannot read suppressions file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Parse {
        path: PathBuf,
        source: SuppressError,
    },
}

/// A symbol or module pattern (LSan semantics, see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Glob {
    /// The pattern as written (with any anchors).
    text: String,
    /// Pattern characters without the anchors.
    chars: Vec<char>,
    anchor_start: bool,
    anchor_end: bool,
}

impl Glob {
    pub fn parse(text: &str) -> Result<Glob, String> {
        let mut body = text;
        let anchor_start = body.starts_with('^');
        if anchor_start {
            body = &body[1..];
        }
        let anchor_end = body.ends_with('$');
        if anchor_end {
            body = &body[..body.len() - 1];
        }
        if body.is_empty() {
            return Err(format!("empty pattern '{text}'"));
        }
        Ok(Glob {
            text: text.to_string(),
            chars: body.chars().collect(),
            anchor_start,
            anchor_end,
        })
    }

    /// LSan-style match: unanchored unless `^`/`$`; `*` any run, `?` one char.
    pub fn matches(&self, s: &str) -> bool {
        let s: Vec<char> = s.chars().collect();
        // An unanchored end behaves as an implicit `*` there.
        let mut pat: Vec<Option<char>> = Vec::with_capacity(self.chars.len() + 2);
        if !self.anchor_start {
            pat.push(None);
        }
        pat.extend(self.chars.iter().map(|&c| (c != '*').then_some(c)));
        if !self.anchor_end {
            pat.push(None);
        }
        wildcard_match(&pat, &s)
    }
}

impl fmt::Display for Glob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Iterative wildcard match with single-star backtracking: `None` is `*`,
/// `Some('?')` any one character.
fn wildcard_match(pat: &[Option<char>], s: &[char]) -> bool {
    let (mut p, mut i) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while i < s.len() {
        match pat.get(p) {
            Some(None) => {
                star = Some((p, i));
                p += 1;
            }
            Some(Some(c)) if *c == '?' || Some(c) == s.get(i) => {
                p += 1;
                i += 1;
            }
            _ => match star {
                Some((sp, si)) => {
                    p = sp + 1;
                    i = si + 1;
                    star = Some((sp, si + 1));
                }
                None => return false,
            },
        }
    }
    pat[p..].iter().all(Option::is_none)
}

/// One rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SuppressRule {
    /// Any frame's symbol or module.
    Leak(Glob),
    Symbol(Glob),
    Module(Glob),
    Allocator(String),
    /// Inclusive bounds; `None` is open.
    Size {
        min: Option<u64>,
        max: Option<u64>,
    },
    /// `[start, end)`.
    Addr {
        start: u64,
        end: u64,
    },
}

/// One parsed entry with where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SuppressEntry {
    /// 1-based line number in the file.
    pub line: usize,
    /// The entry as written, without its comment.
    pub text: String,
    pub rule: SuppressRule,
}

impl fmt::Display for SuppressEntry {
    /// `line 3: leak:libfoo`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.text)
    }
}

/// What is known about a live block, for matching.
#[derive(Clone, Copy, Debug)]
pub struct BlockFacts<'a> {
    pub allocator: &'a str,
    pub addr: u64,
    pub size: u64,
    /// Per frame, innermost first.
    pub symbols: &'a [Option<&'a str>],
    pub modules: &'a [Option<&'a str>],
}

/// A parsed suppressions file.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Suppressions {
    entries: Vec<SuppressEntry>,
}

impl Suppressions {
    /// Whether some entry matches on symbols or modules (so stacks must be
    /// symbolized before matching).
    pub fn needs_symbols(&self) -> bool {
        self.entries.iter().any(|e| {
            matches!(
                e.rule,
                SuppressRule::Leak(_) | SuppressRule::Symbol(_) | SuppressRule::Module(_)
            )
        })
    }

    /// Parses the file's text; the first malformed entry is the error.
    pub fn parse(text: &str) -> Result<Self, SuppressError> {
        let mut entries = Vec::new();
        for (index, raw) in text.lines().enumerate() {
            let line = index + 1;
            let entry = strip_comment(raw).trim();
            if entry.is_empty() {
                continue;
            }
            let rule = parse_rule(entry).map_err(|reason| SuppressError {
                line,
                text: raw.to_string(),
                reason,
            })?;
            entries.push(SuppressEntry {
                line,
                text: entry.to_string(),
                rule,
            });
        }
        Ok(Suppressions { entries })
    }

    /// Reads and parses a file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, SuppressLoadError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| SuppressLoadError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Suppressions::parse(&text).map_err(|source| SuppressLoadError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }

    pub fn entries(&self) -> &[SuppressEntry] {
        &self.entries
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Index (into [`Suppressions::entries`]) of the first entry that matches.
    pub fn matches_block(&self, block: &BlockFacts<'_>) -> Option<usize> {
        self.entries
            .iter()
            .position(|entry| rule_matches(&entry.rule, block))
    }
}

fn rule_matches(rule: &SuppressRule, block: &BlockFacts<'_>) -> bool {
    let any =
        |fields: &[Option<&str>], glob: &Glob| fields.iter().flatten().any(|s| glob.matches(s));
    match rule {
        SuppressRule::Leak(glob) => any(block.symbols, glob) || any(block.modules, glob),
        SuppressRule::Symbol(glob) => any(block.symbols, glob),
        SuppressRule::Module(glob) => any(block.modules, glob),
        SuppressRule::Allocator(name) => name.eq_ignore_ascii_case(block.allocator),
        SuppressRule::Size { min, max } => {
            min.is_none_or(|m| block.size >= m) && max.is_none_or(|m| block.size <= m)
        }
        SuppressRule::Addr { start, end } => (*start..*end).contains(&block.addr),
    }
}

/// Drops a comment: a `#` at the start or after whitespace, and what follows.
fn strip_comment(line: &str) -> &str {
    let mut prev_space = true;
    for (i, c) in line.char_indices() {
        if c == '#' && prev_space {
            return &line[..i];
        }
        prev_space = c.is_whitespace();
    }
    line
}

fn parse_rule(entry: &str) -> Result<SuppressRule, String> {
    if entry.starts_with("0x") || entry.starts_with("0X") {
        return parse_addr(entry);
    }
    let Some((kind, value)) = entry.split_once(':') else {
        return Err(format!(
            "expected KIND:VALUE or 0xSTART-0xEND, got '{entry}'"
        ));
    };
    let value = value.trim();
    let glob = |value: &str| Glob::parse(value).map_err(|e| format!("bad {kind} entry: {e}"));
    match kind.trim().to_ascii_lowercase().as_str() {
        "leak" => Ok(SuppressRule::Leak(glob(value)?)),
        "symbol" => Ok(SuppressRule::Symbol(glob(value)?)),
        "module" => Ok(SuppressRule::Module(glob(value)?)),
        "allocator" => {
            if value.is_empty() || value.contains(char::is_whitespace) {
                Err(format!("bad allocator name '{value}'"))
            } else {
                Ok(SuppressRule::Allocator(value.to_string()))
            }
        }
        "size" => parse_size_range(value),
        "addr" => parse_addr(value),
        other => Err(format!(
            "unknown kind '{other}' (expected leak, symbol, module, allocator, size or addr)"
        )),
    }
}

fn parse_size_range(value: &str) -> Result<SuppressRule, String> {
    let bad = |why: String| format!("bad size range '{value}': {why}");
    let Some((lo, hi)) = value.split_once('-') else {
        let exact = parse_size(value.trim()).map_err(bad)?;
        return Ok(SuppressRule::Size {
            min: Some(exact),
            max: Some(exact),
        });
    };
    let bound = |s: &str| -> Result<Option<u64>, String> {
        let s = s.trim();
        if s.is_empty() {
            Ok(None)
        } else {
            parse_size(s).map(Some)
        }
    };
    let (min, max) = (bound(lo).map_err(bad)?, bound(hi).map_err(bad)?);
    match (min, max) {
        (None, None) => Err(bad("both ends open".into())),
        (Some(a), Some(b)) if a > b => Err(bad(format!("minimum {a} is above maximum {b}"))),
        _ => Ok(SuppressRule::Size { min, max }),
    }
}

/// `4096`, `64K`, `1.5 MiB`, `2GB` → bytes.
fn parse_size(s: &str) -> Result<u64, String> {
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = (&s[..split], s[split..].trim());
    let scale: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "kb" => 1_000,
        "m" | "mib" => 1 << 20,
        "mb" => 1_000_000,
        "g" | "gib" => 1 << 30,
        "gb" => 1_000_000_000,
        "t" | "tib" => 1 << 40,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(format!(
                "'{s}' has an unknown unit '{unit}' (expected B, K, KB, KiB, M, MB, MiB, G, GB, GiB, T, TB or TiB)"
            ))
        }
    };
    let not_a_size = || format!("'{s}' is not a size (e.g. 4096, 64K, 1MiB)");
    if number.is_empty() {
        return Err(not_a_size());
    }
    if let Ok(n) = number.parse::<u64>() {
        return n
            .checked_mul(scale)
            .ok_or_else(|| format!("'{s}' is too large"));
    }
    let n: f64 = number.parse().map_err(|_| not_a_size())?;
    let bytes = (n * scale as f64).floor();
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("'{s}' is too large"));
    }
    Ok(bytes as u64)
}

fn parse_addr(value: &str) -> Result<SuppressRule, String> {
    let bad = |why: String| format!("bad address range '{value}': {why}");
    let Some((lo, hi)) = value.split_once('-') else {
        return Err(bad("expected START-END".into()));
    };
    let hex = |s: &str| -> Result<u64, String> {
        let s = s.trim();
        let digits = s
            .strip_prefix("0x")
            .or_else(|| s.strip_prefix("0X"))
            .unwrap_or(s);
        u64::from_str_radix(digits, 16).map_err(|_| format!("'{s}' is not a hex address"))
    };
    let (start, end) = (hex(lo).map_err(bad)?, hex(hi).map_err(bad)?);
    if start >= end {
        return Err(bad(format!(
            "empty range: start {start:#x} is not below end {end:#x}"
        )));
    }
    Ok(SuppressRule::Addr { start, end })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Frames {
        symbols: Vec<Option<&'static str>>,
        modules: Vec<Option<&'static str>>,
    }

    fn frames() -> Frames {
        Frames {
            symbols: vec![Some("make_buffer"), None, Some("ns::Model::load")],
            modules: vec![
                Some("/usr/lib/libfoo.so.1"),
                Some("/usr/lib/libcudart.so.12"),
                Some("/opt/app/bin/server"),
            ],
        }
    }

    fn block<'a>(f: &'a Frames, allocator: &'a str, addr: u64, size: u64) -> BlockFacts<'a> {
        BlockFacts {
            allocator,
            addr,
            size,
            symbols: &f.symbols,
            modules: &f.modules,
        }
    }

    fn one(entry: &str) -> Suppressions {
        Suppressions::parse(entry).expect("parses")
    }

    fn hits(entry: &str, b: &BlockFacts<'_>) -> bool {
        one(entry).matches_block(b) == Some(0)
    }

    #[test]
    fn leak_matches_symbols_and_modules_as_substring() {
        let f = frames();
        let b = block(&f, "libc", 0x1000, 64);
        assert!(hits("leak:make_buf", &b));
        assert!(hits("leak:Model", &b));
        assert!(hits("leak:libfoo", &b)); // module path
        assert!(!hits("leak:nothing_here", &b));
    }

    #[test]
    fn symbol_and_module_only_look_at_their_field() {
        let f = frames();
        let b = block(&f, "libc", 0x1000, 64);
        assert!(hits("symbol:make_buffer", &b));
        assert!(!hits("symbol:libfoo", &b));
        assert!(hits("module:libcudart", &b));
        assert!(!hits("module:make_buffer", &b));
    }

    #[test]
    fn glob_wildcards_and_anchors() {
        let f = frames();
        let b = block(&f, "libc", 0x1000, 64);
        assert!(hits("module:lib*.so.12", &b));
        assert!(hits("symbol:ns::*::load", &b));
        assert!(hits("symbol:make_buffe?", &b));
        assert!(!hits("symbol:make_buffer?", &b));
        // Anchors.
        assert!(hits("symbol:^make", &b));
        assert!(!hits("symbol:^buffer", &b));
        assert!(hits("symbol:buffer$", &b));
        assert!(!hits("symbol:make$", &b));
        assert!(hits("module:^/opt/*/server$", &b));
        assert!(!hits("module:^/opt/*/serv$", &b));
        assert!(hits("symbol:^make_buffer$", &b));
        // `*` is unanchored like LSan: `lib*cuda` finds it inside the path.
        assert!(hits("module:lib*cuda", &b));
        assert!(!hits("module:cuda*foo", &b));
    }

    #[test]
    fn glob_matcher_edge_cases() {
        let g = Glob::parse("^a*b?c$").expect("parses");
        assert!(g.matches("abxc"));
        assert!(g.matches("axxbbyc"));
        assert!(!g.matches("abc"));
        assert!(!g.matches("xabyc"));
        let g = Glob::parse("*").expect("parses");
        assert!(g.matches(""));
        assert!(Glob::parse("^$").is_err());
        assert!(Glob::parse("").is_err());
    }

    #[test]
    fn allocator_entries() {
        let f = frames();
        assert!(hits("allocator:cuda", &block(&f, "cuda", 1, 1)));
        assert!(hits(
            "allocator:CUDA-driver",
            &block(&f, "cuda-driver", 1, 1)
        ));
        assert!(!hits("allocator:cuda", &block(&f, "cuda-driver", 1, 1)));
        assert!(hits("allocator:my_pool", &block(&f, "my_pool", 1, 1)));
        assert!(!hits("allocator:libc", &block(&f, "mmap", 1, 1)));
    }

    #[test]
    fn size_ranges_units_and_open_ends() {
        let f = frames();
        let size = |n| block(&f, "libc", 1, n);
        assert!(hits("size:64-128", &size(64)));
        assert!(hits("size:64-128", &size(128)));
        assert!(!hits("size:64-128", &size(129)));
        assert!(!hits("size:64-128", &size(63)));
        assert!(hits("size:1MiB-", &size(1 << 20)));
        assert!(hits("size:1MiB-", &size(u64::MAX)));
        assert!(!hits("size:1MiB-", &size((1 << 20) - 1)));
        assert!(hits("size:-4096", &size(0)));
        assert!(hits("size:-4096", &size(4096)));
        assert!(!hits("size:-4096", &size(4097)));
        assert!(hits("size:4096", &size(4096)));
        assert!(!hits("size:4096", &size(4095)));
        assert!(hits("size:1K-1K", &size(1024)));
        assert!(hits("size:1KB-1KB", &size(1000)));
        assert!(hits("size:2 KiB - 3kib", &size(2048)));
        assert!(hits("size:1.5M-", &size(1_572_864)));
        assert!(!hits("size:1.5M-", &size(1_572_863)));
        assert!(hits("size:1GB-1G", &size(1_000_000_000)));
        assert!(hits("size:1g-1GiB", &size(1 << 30)));
        assert!(hits("size:16B-", &size(16)));
        assert_eq!(parse_size("2TiB"), Ok(2 << 40));
        assert_eq!(parse_size("3MB"), Ok(3_000_000));
    }

    #[test]
    fn address_range_boundaries() {
        let f = frames();
        let at = |a| block(&f, "libc", a, 8);
        for entry in [
            "addr:0x7f123400-0x7f567800",
            "0x7f123400-0x7f567800",
            "addr:7f123400-7f567800",
        ] {
            assert!(hits(entry, &at(0x7f123400)), "{entry}");
            assert!(hits(entry, &at(0x7f5677ff)), "{entry}");
            assert!(!hits(entry, &at(0x7f567800)), "{entry}");
            assert!(!hits(entry, &at(0x7f1233ff)), "{entry}");
        }
    }

    #[test]
    fn comments_blank_lines_and_first_match_index() {
        let text = "# allow-list\n\n   \nleak:nothing # never\nsize:1-2\t# tiny\nsymbol:make#1\nleak:libfoo\n";
        let s = Suppressions::parse(text).expect("parses");
        assert_eq!(s.entries().len(), 4);
        assert_eq!(s.entries()[0].line, 4);
        assert_eq!(s.entries()[0].text, "leak:nothing");
        assert_eq!(
            s.entries()[1].rule,
            SuppressRule::Size {
                min: Some(1),
                max: Some(2)
            }
        );
        // `#` not after whitespace is part of the pattern.
        assert_eq!(s.entries()[2].text, "symbol:make#1");
        let f = frames();
        assert_eq!(s.matches_block(&block(&f, "libc", 1, 100)), Some(3));
        assert_eq!(s.matches_block(&block(&f, "libc", 1, 2)), Some(1));
        assert_eq!(s.entries()[3].to_string(), "line 7: leak:libfoo");
        let none = Frames {
            symbols: vec![],
            modules: vec![None],
        };
        assert_eq!(s.matches_block(&block(&none, "libc", 1, 100)), None);
        assert!(Suppressions::parse("# only comments\n\n")
            .expect("parses")
            .is_empty());
    }

    #[test]
    fn malformed_lines_name_their_line() {
        let cases = [
            ("leak:a\nsize:1-2\nsize:x-y\n", 3, "bad size range 'x-y'"),
            ("size:10-5", 1, "minimum 10 is above maximum 5"),
            ("size:-", 1, "both ends open"),
            ("size:5PB-", 1, "unknown unit 'PB'"),
            ("\n# c\naddr:0x20-0x10", 3, "empty range"),
            ("addr:0x10", 1, "expected START-END"),
            ("0xzz-0x10", 1, "not a hex address"),
            ("leak:", 1, "empty pattern"),
            ("frame:foo", 1, "unknown kind 'frame'"),
            ("justaword", 1, "expected KIND:VALUE"),
            ("allocator:", 1, "bad allocator name"),
        ];
        for (text, line, needle) in cases {
            let err = Suppressions::parse(text).expect_err(text);
            assert_eq!(err.line, line, "{text}");
            let msg = err.to_string();
            assert!(
                msg.starts_with(&format!("suppressions line {line}: ")),
                "{msg}"
            );
            assert!(msg.contains(needle), "{msg}");
            assert!(!msg.contains('\n'), "{msg}");
        }
        let err = Suppressions::parse("leak:a\nsize:x-y # oops").expect_err("bad");
        assert_eq!(err.text, "size:x-y # oops");
    }

    #[test]
    fn load_reads_a_file_and_names_it_in_errors() {
        let dir = std::env::temp_dir().join(format!("memtrace-suppress-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let good = dir.join("good.supp");
        std::fs::write(&good, "leak:libfoo\nallocator:cuda\n").expect("write");
        assert_eq!(Suppressions::load(&good).expect("loads").entries().len(), 2);
        let bad = dir.join("bad.supp");
        std::fs::write(&bad, "leak:libfoo\nsize:1-x\n").expect("write");
        let msg = Suppressions::load(&bad).expect_err("bad").to_string();
        assert!(
            msg.contains("bad.supp: suppressions line 2: bad size range"),
            "{msg}"
        );
        let missing = Suppressions::load(dir.join("missing.supp")).expect_err("missing");
        assert!(matches!(missing, SuppressLoadError::Read { .. }));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
