//! DWARF CFI unwinding support: building compact unwind rows from each
//! mapped object's call-frame information ([`cfi`]), indexing them by page
//! ([`table`]) and loading them, with each traced process's executable
//! mappings, into the maps the in-kernel unwinder reads ([`kernel`]).

pub mod cache;
pub mod cfi;
pub mod kernel;
pub mod table;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// `memtrace unwind-table FILE...`: one JSON line per object with what its
/// table takes; an unreadable or CFI-less object is one line on stderr and
/// exit code 2 at the end.
pub fn describe(files: &[PathBuf]) -> anyhow::Result<ExitCode> {
    let mut failed = false;
    for path in files {
        let data = match std::fs::read(path) {
            Ok(data) => data,
            Err(err) => {
                eprintln!("memtrace: {}: {err}", path.display());
                failed = true;
                continue;
            }
        };
        let started = Instant::now();
        match cfi::rows_from_elf(&data[..]) {
            Ok(rows) => {
                let build_ms = started.elapsed().as_secs_f64() * 1000.0;
                let Some(packed) = table::pack(&rows.rows) else {
                    eprintln!(
                        "memtrace: {}: more than 65536 distinct unwind rules",
                        path.display()
                    );
                    failed = true;
                    continue;
                };
                let kernel_bytes = kernel::kernel_bytes(&packed);
                let line = serde_json::json!({
                    "file": path.display().to_string(),
                    "file_bytes": data.len(),
                    "eh_frame_bytes": cfi::eh_frame_size(&data),
                    "fdes": rows.fdes,
                    "rows": rows.rows.len(),
                    "kernel_rows": packed.rows.len(),
                    "rules": packed.rules.len(),
                    "malformed": rows.malformed,
                    "unsupported_rows": rows.unsupported,
                    "pages": packed.pages.len(),
                    "kernel_bytes": kernel_bytes,
                    "build_ms": build_ms,
                });
                println!("{line}");
            }
            Err(err) => {
                eprintln!("memtrace: {}: {err}", path.display());
                failed = true;
            }
        }
    }
    Ok(if failed {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    })
}
