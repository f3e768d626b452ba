//! Short frame names for the views a person reads (the text report, `--live`,
//! the HTML page): a demangled C++ or Rust name keeps its qualified name
//! (namespaces, class, method, operator names such as `operator()`,
//! `operator<<` or `operator->`, conversion operators, lambdas
//! `{lambda(…)#1}`, `(anonymous namespace)`, ABI tags `[abi:cxx11]`, clone
//! suffixes `[clone .cold]`) while template arguments become `<…>`,
//! parameter lists `(…)`, and a template function's return type, the
//! trailing `const`/`volatile`/`&`/`&&`/`noexcept` and a Rust hash
//! (`::h0123456789abcdef`) go. A Rust qualified path keeps each side's last
//! name (`<Vec<…> as Clone>::clone`) and `drop_in_place` keeps what it drops
//! (`core::ptr::drop_in_place<Vec<…>>`). Then, when the name is still wider
//! than asked, whole namespaces are cut from its front behind a `…`
//! ([`short`]); a Python name is only cut to the width ([`fit_plain`]), and
//! a name the symbolizer could not demangle (`_ZSt11make_shared…`) keeps its
//! front, where the function's name is.
//!
//! Pure functions on strings: any input, malformed or unbalanced included,
//! gives an answer in time linear in its length (an unmatched bracket keeps
//! the rest as it is), and shortening a short name changes nothing. The
//! outputs that are contracts (JSON, pprof, folded, flame graph, record
//! files) keep the full names; `--full-names` keeps them in the views too
//! ([`Names`]).

/// How the views a person reads show frame names (`--full-names`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Names {
    /// Template arguments and parameter lists elided, cut to a width.
    #[default]
    Short,
    /// As the symbolizer gave them.
    Full,
}

impl Names {
    /// `Full` when `full` (the `--full-names` flag), else `Short`.
    pub fn full_if(full: bool) -> Self {
        if full {
            Names::Full
        } else {
            Names::Short
        }
    }
}

/// The ellipsis that stands for what was cut.
const ELLIPSIS: char = '…';

/// Deepest nesting of Rust qualified paths shortened one inside the other;
/// deeper ones are elided like template arguments.
const MAX_NESTING: usize = 4;

/// Prefixes of the demangler's special names, kept in front of the name.
const SPECIAL_PREFIXES: &[&str] = &[
    "non-virtual thunk to ",
    "virtual thunk to ",
    "covariant return thunk to ",
    "transaction clone for ",
    "clone for ",
    "TLS init function for ",
    "TLS wrapper function for ",
    "guard variable for ",
    "construction vtable for ",
    "vtable for ",
    "VTT for ",
    "typeinfo name for ",
    "typeinfo for ",
];

/// The symbolic operators after `operator`, longest first.
const OPERATORS: &[&str] = &[
    "\"\"", "<=>", "->*", "<<=", ">>=", "()", "[]", "->", "<<", ">>", "<=", ">=", "==", "!=", "&&",
    "||", "++", "--", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<", ">", "+", "-", "*", "/",
    "%", "^", "&", "|", "~", "!", "=", ",",
];

/// The words of `operator new`, `operator delete` and `operator co_await`.
const WORD_OPERATORS: &[&str] = &["new", "delete", "co_await"];

/// Qualifiers after a parameter list that the short name leaves out.
const TRAILING_QUALIFIERS: &[&str] = &["const", "volatile", "noexcept", "restrict", "&&", "&"];

/// `name` shortened and then cut to `width` characters: template arguments
/// and parameter lists elided, then front namespaces cut behind `…::`, then
/// (when the last name alone is wider) its front cut behind `…`.
pub fn short(name: &str, width: usize) -> String {
    if is_mangled(name) {
        return fit_end(name.trim(), width);
    }
    let elided = elide(name, 0);
    fit(&elided.text, &elided.segments, width)
}

/// `name` with template arguments and parameter lists elided, not cut
/// (the views use [`short`] with `usize::MAX` for that).
#[cfg(test)]
pub fn shorten(name: &str) -> String {
    elide(name, 0).text
}

/// `text` cut to `width` characters from the front behind `…` (for names
/// that are not C++ or Rust, such as Python's).
pub fn fit_plain(text: &str, width: usize) -> String {
    let count = text.chars().count();
    if count <= width {
        return text.to_string();
    }
    if width == 0 {
        return String::new();
    }
    let mut out = String::from(ELLIPSIS);
    out.extend(text.chars().skip(count - (width - 1)));
    out
}

/// Whether `name` is still mangled (Itanium `_Z…`, Rust v0 `_R…`): one
/// word, no path.
fn is_mangled(name: &str) -> bool {
    let name = name.trim();
    (name.starts_with("_Z") || name.starts_with("_R"))
        && name.len() > 2
        && name.bytes().all(|b| is_ident(b) || b == b'.')
}

/// `text` cut to `width` characters at its end behind `…`.
fn fit_end(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_string();
    }
    if width == 0 {
        return String::new();
    }
    let mut out: String = text.chars().take(width - 1).collect();
    out.push(ELLIPSIS);
    out
}

/// An elided name and where each of its `::`-separated parts starts.
struct Elided {
    text: String,
    /// Byte offsets in `text` of each part (the first is 0).
    segments: Vec<usize>,
}

/// `text` cut to `width`: whole leading parts behind `…::` when what is
/// left fills at least two thirds of the width, else characters behind `…`
/// (a narrow column shows more of the name that way).
fn fit(text: &str, segments: &[usize], width: usize) -> String {
    if text.chars().count() <= width {
        return text.to_string();
    }
    for &start in segments.iter().skip(1) {
        let Some(rest) = text.get(start..) else {
            continue;
        };
        // `…::` and the rest.
        let cut = rest.chars().count() + 3;
        if cut <= width {
            if cut * 3 >= width * 2 {
                return format!("{ELLIPSIS}::{rest}");
            }
            break;
        }
    }
    fit_plain(text, width)
}

/// Whether `byte` can be part of an identifier.
fn is_ident(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'$' || byte >= 0x80
}

/// The length of the identifier at the start of `rest`.
fn ident_len(rest: &[u8]) -> usize {
    rest.iter().take_while(|&&b| is_ident(b)).count()
}

/// The length of the operator after `operator` at the start of `rest`
/// (symbolic, or ` new`/` delete`/` co_await` with an optional `[]`), 0
/// when there is none (a conversion operator, or no operator at all).
fn operator_len(rest: &str) -> usize {
    if let Some(op) = OPERATORS.iter().find(|op| rest.starts_with(*op)) {
        let mut len = op.len();
        if *op == "\"\"" {
            // A literal operator's suffix: `operator"" _km`.
            let after = &rest.as_bytes()[len..];
            let space = usize::from(after.first() == Some(&b' '));
            let word = ident_len(&after[space..]);
            if word > 0 {
                len += space + word;
            }
        }
        return len;
    }
    if let Some(after) = rest.strip_prefix(' ') {
        for word in WORD_OPERATORS {
            if let Some(tail) = after.strip_prefix(word) {
                if tail.bytes().next().is_some_and(is_ident) {
                    continue;
                }
                let brackets = if tail.starts_with("[]") { 2 } else { 0 };
                return 1 + word.len() + brackets;
            }
        }
    }
    0
}

/// The index of the byte that closes the group opened at `open` (`<`, `(`,
/// `[` or `{`), or `None` when it is never closed. Inside `<…>`,
/// parenthesized groups are skipped whole (`(a>b)`), as are `->` and the
/// symbols of `operator<` and its kin; the other groups count their own
/// brackets only.
fn find_close(bytes: &[u8], open: usize) -> Option<usize> {
    let (opener, closer) = match bytes.get(open)? {
        b'<' => (b'<', b'>'),
        b'(' => (b'(', b')'),
        b'[' => (b'[', b']'),
        b'{' => (b'{', b'}'),
        _ => return None,
    };
    let mut depth = 0usize;
    let mut i = open;
    while i < bytes.len() {
        let byte = bytes[i];
        if opener == b'<' && i > open {
            if byte == b'(' {
                i = find_close(bytes, i)? + 1;
                continue;
            }
            if byte == b'-' && bytes.get(i + 1) == Some(&b'>') {
                i += 2;
                continue;
            }
            if is_ident(byte) && (i == 0 || !is_ident(bytes[i - 1])) {
                let len = ident_len(&bytes[i..]);
                if &bytes[i..i + len] == b"operator" {
                    let rest = std::str::from_utf8(&bytes[i + len..]).unwrap_or("");
                    i += len + operator_len(rest);
                } else {
                    i += len;
                }
                continue;
            }
        }
        if byte == opener {
            depth += 1;
        } else if byte == closer {
            depth -= 1;
            if depth == 0 {
                return Some(i);
            }
        }
        i += 1;
    }
    None
}

/// The part of a Rust qualified path's side a short name keeps: its
/// reference or pointer prefix and its last name (`&mut Vec<…>`).
fn last_name(side: &str, nesting: usize) -> String {
    let mut prefix = String::new();
    let mut rest = side.trim();
    loop {
        let before = rest;
        for p in ["&mut ", "&", "*const ", "*mut ", "dyn ", "impl "] {
            if let Some(tail) = rest.strip_prefix(p) {
                prefix.push_str(p);
                rest = tail;
            }
        }
        if rest.len() == before.len() {
            break;
        }
    }
    let elided = elide(rest, nesting + 1);
    // A closure's or shim's part (`{{closure}}`) keeps the name it is in.
    let mut parts = elided.segments.iter().rev().copied();
    let mut start = parts.next().unwrap_or(0);
    if elided.text.get(start..).is_some_and(|s| s.starts_with('{')) {
        start = parts.next().unwrap_or(start);
    }
    prefix.push_str(elided.text.get(start..).unwrap_or(&elided.text));
    prefix
}

/// Splits a qualified path's inside at its top-level `separator` (` as `,
/// ` for `).
fn split_at_word<'a>(inside: &'a str, separator: &str) -> (&'a str, Option<&'a str>) {
    let bytes = inside.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'<' | b'(' | b'[' | b'{' => match find_close(bytes, i) {
                Some(close) => i = close + 1,
                None => return (inside, None),
            },
            b' ' if inside[i..].starts_with(separator) => {
                return (&inside[..i], Some(&inside[i + separator.len()..]));
            }
            _ => i += 1,
        }
    }
    (inside, None)
}

/// Strips a Rust legacy hash, `::h` and 16 hex digits, from the end.
fn without_rust_hash(name: &str) -> &str {
    let bytes = name.as_bytes();
    if bytes.len() > 19 {
        let tail = &bytes[bytes.len() - 19..];
        if tail.starts_with(b"::h") && tail[3..].iter().all(u8::is_ascii_hexdigit) {
            return &name[..name.len() - 19];
        }
    }
    name
}

/// The elision: one pass over the name (`nesting`: how deep inside Rust
/// qualified paths this is).
fn elide(name: &str, nesting: usize) -> Elided {
    let name = without_rust_hash(name.trim());
    let mut prefix = String::new();
    let mut name = name;
    while let Some(special) = SPECIAL_PREFIXES.iter().find(|p| name.starts_with(*p)) {
        prefix.push_str(special);
        name = &name[special.len()..];
    }
    let bytes = name.as_bytes();
    let mut out = String::with_capacity(name.len().min(256));
    let mut segments = vec![0usize];
    // Past the parameter list of the current part: only qualifiers follow.
    let mut after_params = false;
    // Inside a conversion operator's type (`operator std::string`).
    let mut conversion = false;
    let mut braces = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        let rest = &name[i..];
        match byte {
            b':' if braces == 0 && !conversion && rest.starts_with("::") => {
                out.push_str("::");
                segments.push(out.len());
                after_params = false;
                i += 2;
            }
            b'<' => {
                let Some(close) = find_close(bytes, i) else {
                    out.push_str(rest);
                    break;
                };
                let inside = &name[i + 1..close];
                if let (Some(block), true) = (inside.strip_prefix("impl "), nesting < MAX_NESTING) {
                    // A Rust impl block: `<impl Trait for Type>`.
                    let (left, right) = split_at_word(block, " for ");
                    out.push_str("<impl ");
                    out.push_str(&last_name(left, nesting));
                    if let Some(right) = right {
                        out.push_str(" for ");
                        out.push_str(&last_name(right, nesting));
                    }
                    out.push('>');
                } else if out.is_empty() && nesting < MAX_NESTING {
                    // A Rust qualified path: `<A as B>` or `<A>`.
                    let (left, right) = split_at_word(inside, " as ");
                    out.push('<');
                    out.push_str(&last_name(left, nesting));
                    if let Some(right) = right {
                        out.push_str(" as ");
                        out.push_str(&last_name(right, nesting));
                    }
                    out.push('>');
                } else if (out.ends_with("drop_in_place") || out.ends_with("drop_in_place::"))
                    && nesting < MAX_NESTING
                {
                    out.push('<');
                    out.push_str(&last_name(inside, nesting));
                    out.push('>');
                } else if inside.is_empty() {
                    out.push_str("<>");
                } else {
                    out.push('<');
                    out.push(ELLIPSIS);
                    out.push('>');
                }
                i = close + 1;
            }
            b'(' => {
                let Some(close) = find_close(bytes, i) else {
                    out.push_str(rest);
                    break;
                };
                let group = &name[i..=close];
                if group.starts_with("(anonymous ") {
                    out.push_str(group);
                } else {
                    out.push_str(if close == i + 1 { "()" } else { "(…)" });
                    if braces == 0 {
                        after_params = true;
                        conversion = false;
                    }
                }
                i = close + 1;
            }
            b'[' => {
                let Some(close) = find_close(bytes, i) else {
                    out.push_str(rest);
                    break;
                };
                let inside = &name[i + 1..close];
                if inside.starts_with("abi:") || inside.starts_with("clone ") || inside.is_empty() {
                    out.push_str(&name[i..=close]);
                } else if nesting < MAX_NESTING {
                    // A Rust slice or array: `[Vec<…>]`, `[u8; 4]`.
                    let (element, length) = match inside.rsplit_once("; ") {
                        Some((element, length)) if !length.contains([']', '>']) => {
                            (element, Some(length))
                        }
                        _ => (inside, None),
                    };
                    out.push('[');
                    out.push_str(&last_name(element, nesting));
                    if let Some(length) = length {
                        out.push_str("; ");
                        out.push_str(length);
                    }
                    out.push(']');
                } else {
                    out.push_str("[…]");
                }
                i = close + 1;
            }
            b'{' => {
                braces += 1;
                out.push('{');
                i += 1;
            }
            b'}' => {
                braces = braces.saturating_sub(1);
                out.push('}');
                i += 1;
            }
            b' ' if braces == 0 && !conversion => {
                i += 1;
                let next = &name[i..];
                if next.starts_with('[') || next.starts_with(' ') || next.is_empty() {
                    // A clone suffix's space (doubled or trailing ones go).
                    if next.starts_with('[') {
                        out.push(' ');
                    }
                } else if after_params {
                    if let Some(q) = TRAILING_QUALIFIERS.iter().find(|q| {
                        next.starts_with(*q)
                            && !next[q.len()..].bytes().next().is_some_and(is_ident)
                    }) {
                        i += q.len();
                    } else {
                        out.push(' ');
                    }
                } else {
                    // What came before was a return type.
                    out.clear();
                    segments.clear();
                    segments.push(0);
                }
            }
            _ if is_ident(byte) && (i == 0 || !is_ident(bytes[i - 1])) => {
                let len = ident_len(&bytes[i..]);
                let word = &name[i..i + len];
                out.push_str(word);
                i += len;
                if word == "operator" {
                    let op = operator_len(&name[i..]);
                    if op > 0 {
                        out.push_str(&name[i..i + op]);
                        i += op;
                        // `operator<< <char>`: the template's space stays.
                        if name[i..].starts_with(" <") {
                            out.push(' ');
                            i += 1;
                        }
                    } else if name[i..].starts_with(' ') {
                        out.push(' ');
                        i += 1;
                        conversion = true;
                    }
                }
            }
            _ => {
                let len = rest.chars().next().map_or(1, char::len_utf8);
                out.push_str(&rest[..len]);
                i += len;
            }
        }
    }
    let kept = out.trim_end().len();
    out.truncate(kept);
    if !prefix.is_empty() {
        out.insert_str(0, &prefix);
        for start in &mut segments {
            *start += prefix.len();
        }
    }
    Elided {
        text: out,
        segments,
    }
}

#[cfg(test)]
mod tests;
