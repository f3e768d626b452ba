//! Section "Unwind tables": what `memtrace unwind-table` builds for real
//! objects of this machine (libc, libstdc++, Debian's static python3.11, a
//! pyenv libpython, the nightly toolchain's libLLVM).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use super::common::{one_line, Env};

pub(super) struct TableRow {
    name: String,
    line: Result<Value, String>,
}

/// Real objects of this machine: libc, libstdc++, a pyenv libpython, and the
/// nightly toolchain's libLLVM (the stand-in for PyTorch-sized libraries).
fn objects() -> Vec<(String, Option<PathBuf>)> {
    let first = |candidates: &[&str]| candidates.iter().map(PathBuf::from).find(|p| p.is_file());
    let libpython = Command::new("pyenv")
        .args(["prefix", "3.11"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .map(|prefix| PathBuf::from(prefix).join("lib/libpython3.11.so.1.0"))
        .filter(|p| p.is_file());
    let llvm = crate::nightly_llvm().ok().map(|(_, llvm)| llvm);
    vec![
        (
            "libc.so.6".into(),
            first(&[
                "/usr/lib/x86_64-linux-gnu/libc.so.6",
                "/lib/x86_64-linux-gnu/libc.so.6",
            ]),
        ),
        (
            "libstdc++.so.6".into(),
            first(&["/usr/lib/x86_64-linux-gnu/libstdc++.so.6"]),
        ),
        (
            "python3.11 (Debian, static)".into(),
            first(&["/usr/bin/python3.11"]),
        ),
        ("libpython3.11.so (pyenv)".into(), libpython),
        ("libLLVM.so (nightly toolchain)".into(), llvm),
    ]
}

pub(super) fn bench(env: &Env) -> Vec<TableRow> {
    objects()
        .into_iter()
        .map(|(name, path)| {
            let line = match path {
                None => Err("not on this machine".to_string()),
                Some(path) => Command::new(&env.memtrace)
                    .arg("unwind-table")
                    .arg(&path)
                    .output()
                    .map_err(|e| e.to_string())
                    .and_then(|out| {
                        serde_json::from_slice::<Value>(&out.stdout)
                            .map_err(|_| String::from_utf8_lossy(&out.stderr).trim().to_string())
                    }),
            };
            TableRow { name, line }
        })
        .collect()
}

pub(super) fn render(rows: &[TableRow], s: &mut String) {
    let _ = writeln!(s, "## Unwind tables\n");
    let _ = writeln!(
        s,
        "`memtrace unwind-table FILE`: the rows the DWARF unwinder loads for an object, built \
         once per file (release build, one run each). Kernel bytes are whole 4 KiB chunks of \
         4-byte rows (offset in page, rule index), the rule dictionary and the page index.\n"
    );
    let _ = writeln!(
        s,
        "| Object | .eh_frame | FDEs | Rows | Kernel bytes | Kernel / .eh_frame | Build ms |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        match &row.line {
            Ok(v) => {
                let eh = v["eh_frame_bytes"].as_f64().unwrap_or(0.0);
                let kb = v["kernel_bytes"].as_f64().unwrap_or(0.0);
                let _ = writeln!(
                    s,
                    "| {} | {:.0} KiB | {} | {} | {:.0} KiB | {} | {:.0} |",
                    row.name,
                    eh / 1024.0,
                    v["fdes"],
                    v["rows"],
                    kb / 1024.0,
                    if eh > 0.0 {
                        format!("{:.2}", kb / eh)
                    } else {
                        "-".into()
                    },
                    v["build_ms"].as_f64().unwrap_or(0.0)
                );
            }
            Err(why) => {
                let _ = writeln!(
                    s,
                    "| {} | - | - | - | - | - | {} |",
                    row.name,
                    one_line(why)
                );
            }
        }
    }
    let _ = writeln!(s);
}
