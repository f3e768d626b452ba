//! The layering rules of CONTRIBUTING.md, checked against the source: every
//! module sits on a floor and imports only from its own floor or below, and
//! no two source files import each other, directly or around a circle.
//!
//! Imports are read from the text: every `crate::a::b` and `super::a` path
//! outside comments and test modules, resolved to the longest module it
//! names. A module using its own parent or children is not an edge.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The floors, lowest first (CONTRIBUTING.md, "Layers"). A unit is a
/// top-level module.
const FLOORS: &[&[&str]] = &[
    &[
        "arch",
        "error",
        "duration",
        "event",
        "stats",
        "btf",
        "signals",
        "parallel",
        "reach",
        "disk_cache",
    ],
    &["kernel", "tracee"],
    &["probe"],
    &[
        "model",
        "table",
        "symbolize",
        "unwind",
        "interp",
        "stacks",
        "analysis",
    ],
    &["report", "record"],
    &["sink", "output", "prometheus", "live", "push"],
    &["monitor", "trace", "watch", "doctor"],
    &["cli"],
    &["reference"],
];

/// Imports against the floors, each with its reason; remove one when it is fixed.
/// None is left: `TraceArgs` moved from `cli` to `trace`, `doctor` out of `kernel`.
const EXCEPTIONS: &[(&str, &str, &str)] = &[];

type Module = Vec<String>;

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every non-test source file by its module path.
fn modules() -> BTreeMap<Module, String> {
    let mut found = BTreeMap::new();
    let mut test_only: BTreeSet<Module> = BTreeSet::new();
    let mut files = Vec::new();
    collect(&src_dir(), &mut files);
    files.sort();
    for path in files {
        let rel = path.strip_prefix(src_dir()).expect("under src");
        let mut parts: Module = rel
            .with_extension("")
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        if matches!(parts.last().map(String::as_str), Some("mod" | "main")) {
            parts.pop();
        }
        let text = std::fs::read_to_string(&path).expect("readable source");
        // `#[cfg(test)] mod name;` makes that child test-only.
        let lines: Vec<&str> = text.lines().collect();
        for pair in lines.windows(2) {
            if pair[0].trim() == "#[cfg(test)]" {
                if let Some(name) = pair[1]
                    .trim()
                    .strip_prefix("mod ")
                    .and_then(|r| r.strip_suffix(';'))
                {
                    let mut child = parts.clone();
                    child.push(name.to_string());
                    test_only.insert(child);
                }
            }
        }
        found.insert(parts, without_tests_and_comments(&text));
    }
    found.retain(|m, _| !test_only.iter().any(|t| m.starts_with(t)));
    found
}

fn collect(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("source dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            collect(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

/// The text before its inline test module, without comment lines.
fn without_tests_and_comments(text: &str) -> String {
    let mut out = String::new();
    let mut previous = "";
    for line in text.lines() {
        let trimmed = line.trim();
        if previous == "#[cfg(test)]" && trimmed.starts_with("mod ") && trimmed.ends_with('{') {
            break;
        }
        previous = trimmed;
        if !trimmed.starts_with("//") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The paths after each occurrence of `prefix` (`crate::`, `super::`).
fn paths_after<'a>(text: &'a str, prefix: &str) -> Vec<Vec<&'a str>> {
    let mut paths = Vec::new();
    let mut rest = text;
    let mut offset = 0;
    while let Some(at) = rest.find(prefix) {
        let before = text[..offset + at].chars().next_back();
        let start = at + prefix.len();
        rest = &rest[start..];
        offset += start;
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let end = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(rest.len());
        let segments: Vec<&str> = rest[..end].split("::").filter(|s| !s.is_empty()).collect();
        paths.push(segments);
    }
    paths
}

/// The modules each module imports (its ancestors and descendants left out).
fn imports(modules: &BTreeMap<Module, String>) -> BTreeMap<Module, BTreeSet<Module>> {
    let longest = |base: &[String], segments: &[&str]| -> Option<Module> {
        (0..=segments.len()).rev().find_map(|k| {
            let mut candidate: Module = base.to_vec();
            candidate.extend(segments[..k].iter().map(|s| s.to_string()));
            (!candidate.is_empty() && modules.contains_key(&candidate)).then_some(candidate)
        })
    };
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, text) in modules {
        let mut targets = BTreeSet::new();
        for segments in paths_after(text, "crate::") {
            targets.extend(longest(&[], &segments));
        }
        for segments in paths_after(text, "super::") {
            // `super::super::x`: one floor up per `super`.
            let ups = 1 + segments.iter().take_while(|s| **s == "super").count();
            let rest: Vec<&str> = segments.into_iter().filter(|s| *s != "super").collect();
            if ups <= module.len() {
                targets.extend(longest(&module[..module.len() - ups], &rest));
            }
        }
        targets.retain(|t| !t.starts_with(module) && !module.starts_with(t));
        edges.insert(module.clone(), targets);
    }
    edges
}

fn unit(module: &[String]) -> String {
    module[0].clone()
}

fn floor(unit: &str) -> Option<usize> {
    FLOORS.iter().position(|floor| floor.contains(&unit))
}

#[test]
fn every_module_has_a_floor() {
    let missing: BTreeSet<String> = modules()
        .keys()
        .filter(|m| !m.is_empty())
        .map(|m| unit(m))
        .filter(|u| floor(u).is_none())
        .collect();
    assert!(
        missing.is_empty(),
        "modules on no floor (add them to CONTRIBUTING.md's layers and to FLOORS): {missing:?}"
    );
}

#[test]
fn modules_import_only_from_their_floor_or_below() {
    let mut wrong = Vec::new();
    for (module, targets) in imports(&modules()) {
        if module.is_empty() {
            continue;
        }
        let from = unit(&module);
        for target in targets {
            let to = unit(&target);
            if from == to || EXCEPTIONS.iter().any(|(a, b, _)| *a == from && *b == to) {
                continue;
            }
            if let (Some(a), Some(b)) = (floor(&from), floor(&to)) {
                if b > a {
                    wrong.push(format!(
                        "{} (floor {a}) imports {} (floor {b})",
                        module.join("::"),
                        target.join("::")
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports from a higher floor:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn exceptions_are_still_needed() {
    let edges = imports(&modules());
    for (from, to, why) in EXCEPTIONS {
        let used = edges
            .iter()
            .any(|(m, ts)| !m.is_empty() && unit(m) == *from && ts.iter().any(|t| unit(t) == *to));
        assert!(
            used,
            "{from} no longer imports {to} ({why}): remove the exception"
        );
    }
}

#[test]
fn no_source_files_import_each_other_around_a_circle() {
    let edges = imports(&modules());
    // Depth-first search; a module met again while on the path closes a circle.
    fn visit(
        module: &Module,
        edges: &BTreeMap<Module, BTreeSet<Module>>,
        path: &mut Vec<Module>,
        done: &mut BTreeSet<Module>,
        circles: &mut Vec<String>,
    ) {
        if let Some(at) = path.iter().position(|m| m == module) {
            let circle: Vec<String> = path[at..]
                .iter()
                .chain(std::iter::once(module))
                .map(|m| m.join("::"))
                .collect();
            circles.push(circle.join(" -> "));
            return;
        }
        if !done.insert(module.clone()) {
            return;
        }
        path.push(module.clone());
        for next in edges.get(module).into_iter().flatten() {
            visit(next, edges, path, done, circles);
        }
        path.pop();
    }
    let mut circles = Vec::new();
    let mut done = BTreeSet::new();
    for module in edges.keys() {
        visit(module, &edges, &mut Vec::new(), &mut done, &mut circles);
    }
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

#[test]
fn the_reader_sees_imports_and_skips_comments_and_tests() {
    let text = "use crate::report::Frame;\n// crate::sink::x\nlet a = crate::model::Frame;\n\
                #[cfg(test)]\nmod tests {\n    use crate::cli::Format;\n}\n";
    let cleaned = without_tests_and_comments(text);
    let paths = paths_after(&cleaned, "crate::");
    assert_eq!(paths, vec![vec!["report", "Frame"], vec!["model", "Frame"]]);
}
