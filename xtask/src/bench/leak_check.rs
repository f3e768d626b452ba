//! Section "Leak check": how long `--leak-check` holds a process stopped and
//! how fast it scans, against heap size (live bytes and block count), beside
//! this machine's `process_vm_readv` copy rate measured in the same run on
//! the same heap (the floor of any scan that reads another process).
//!
//! The heap is `heapscan` (tests/fixtures/bench): N blocks, every eighth
//! word a pointer to another block, all reachable. memtrace traces it in
//! launch mode (`--stack-depth 0`, a 64 MiB ring: nothing may be lost, or
//! the check refuses to judge) and checks it at its exit; the pause and the
//! bytes scanned are the report's `leak_check`. The same heap, untraced,
//! is then checked by pid: every block is from before the attach, found by
//! walking glibc's heap (`leak_check.before_attach.heap_walk`), whose rate
//! in chunks per second is set beside the copy rate; checked twice, stopped
//! for the whole check and from a snapshot (`--leak-check-mode`), whose
//! pause and scan rate are set beside the stop's and the copy rate.

use std::fmt::Write as _;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::common::{median, Env};
use super::proc::{Proc, Stream};

/// One heap: its label, live bytes and blocks.
struct Case {
    bytes: u64,
    blocks: u64,
}

const MIB: u64 = 1 << 20;

fn cases(quick: bool) -> Vec<Case> {
    if quick {
        return vec![
            Case {
                bytes: 100 * MIB,
                blocks: 10_000,
            },
            Case {
                bytes: 256 * MIB,
                blocks: 1_000_000,
            },
        ];
    }
    vec![
        Case {
            bytes: 100 * MIB,
            blocks: 10_000,
        },
        Case {
            bytes: 1024 * MIB,
            blocks: 10_000,
        },
        Case {
            bytes: 4096 * MIB,
            blocks: 10_000,
        },
        Case {
            bytes: 16384 * MIB,
            blocks: 10_000,
        },
        Case {
            bytes: 1024 * MIB,
            blocks: 10_000_000,
        },
    ]
}

pub(super) struct Row {
    bytes: u64,
    blocks: u64,
    outcome: std::result::Result<Measured, String>,
}

struct Measured {
    /// The check's pause (ms), median of the rounds.
    pause_ms: f64,
    scanned_bytes: u64,
    /// Blocks judged still reachable (all of them, the table included).
    reachable_blocks: u64,
    lost_blocks: u64,
    /// GB/s of `process_vm_readv` over the same heap.
    copy_gbps: f64,
    /// The process's anonymous memory (`RssAnon`), bytes.
    anon_bytes: u64,
    /// The same heap checked by pid (every block from before the attach),
    /// stopped for the whole check.
    walk: std::result::Result<Walked, String>,
    /// The same, from a snapshot.
    snapshot: std::result::Result<Walked, String>,
}

/// A check by pid of an untraced heap.
struct Walked {
    chunks_walked: u64,
    walk_ms: f64,
    pause_ms: f64,
    blocks_before_attach: u64,
    reachable_blocks: u64,
    mode: String,
    clone_ms: f64,
    /// The preflight's estimate of the clone (NaN: none).
    clone_estimate_ms: f64,
    scan_ms: f64,
    scanned_bytes: u64,
}

/// Copies every readable, writable mapping of `pid` with
/// `process_vm_readv` (1 MiB at a time) and returns (bytes, seconds).
fn copy_all(pid: i32) -> Result<(u64, f64)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let mut buf = vec![0u8; MIB as usize];
    let started = Instant::now();
    let mut total = 0u64;
    for line in maps.lines() {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            continue;
        };
        if !perms.starts_with("rw") || line.contains("[vvar") || line.contains("/dev/") {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let (start, end) = (
            u64::from_str_radix(start, 16)?,
            u64::from_str_radix(end, 16)?,
        );
        let mut at = start;
        while at < end {
            let len = (end - at).min(MIB) as usize;
            let local = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: len,
            };
            let remote = libc::iovec {
                iov_base: at as *mut libc::c_void,
                iov_len: len,
            };
            // SAFETY: `local` describes our own buffer, writable for `len`
            // bytes; the kernel checks the remote range.
            let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
            if n <= 0 {
                break;
            }
            total += n as u64;
            at += n as u64;
        }
    }
    Ok((total, started.elapsed().as_secs_f64()))
}

/// memtrace attached to `pid` for a moment, its leak check at the end
/// (`mode`: `stopped` or `snapshot`).
fn walk_by_pid(env: &Env, pid: i32, mode: &str) -> Result<Walked> {
    let out = env.work.join("leak-check-by-pid.json");
    let _ = std::fs::remove_file(&out);
    let status = Command::new("timeout")
        .arg("900")
        .arg(&env.memtrace)
        .args(["--pid", &pid.to_string()])
        .args([
            "--leak-check",
            "--duration",
            "1s",
            "--format",
            "json",
            "--stack-depth",
            "0",
            "--leak-check-max-pause",
            "10m",
            "--leak-check-mode",
            mode,
            "--output",
        ])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .context("memtrace runs")?;
    if !status.success() {
        bail!("memtrace --pid: {status}");
    }
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out)?)?;
    let check = &report["leak_check"];
    let walk = &check["before_attach"]["heap_walk"];
    if walk["status"] != "complete" {
        bail!(
            "the heap walk was {}: {}",
            walk["status"].as_str().unwrap_or("?"),
            walk["reason"].as_str().unwrap_or("?")
        );
    }
    Ok(Walked {
        chunks_walked: walk["chunks_walked"].as_u64().unwrap_or(0),
        walk_ms: walk["walk_ms"].as_f64().unwrap_or(f64::NAN),
        pause_ms: check["pause_ms"].as_f64().unwrap_or(f64::NAN),
        blocks_before_attach: walk["blocks_before_attach"].as_u64().unwrap_or(0),
        reachable_blocks: check["before_attach"]["still_reachable"]["blocks"]
            .as_u64()
            .unwrap_or(0),
        mode: match check["fallback"].as_str() {
            Some(why) => format!("{} ({why})", check["mode"].as_str().unwrap_or("?")),
            None => check["mode"].as_str().unwrap_or("?").to_string(),
        },
        clone_ms: check["clone_ms"].as_f64().unwrap_or(f64::NAN),
        clone_estimate_ms: check["clone_estimate_ms"].as_f64().unwrap_or(f64::NAN),
        scan_ms: check["scan_ms"].as_f64().unwrap_or(f64::NAN),
        scanned_bytes: check["scanned_bytes"].as_u64().unwrap_or(0),
    })
}

/// `RssAnon` of `pid`, bytes.
fn anon_bytes(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("RssAnon:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// What one heap gave untraced: the copy rate, its anonymous memory and
/// the checks by pid (stopped, snapshot).
struct Untraced {
    copy_gbps: f64,
    anon_bytes: u64,
    walk: std::result::Result<Walked, String>,
    snapshot: std::result::Result<Walked, String>,
}

/// The copy rate of this machine on `case`'s heap, untraced, and the same
/// heap checked by pid, stopped and from a snapshot.
fn untraced(env: &Env, case: &Case) -> Result<Untraced> {
    let mut prog = Proc::spawn(
        "heapscan",
        env.program("heapscan")
            .arg(case.bytes.to_string())
            .arg(case.blocks.to_string())
            .arg("600"),
        false,
    )?;
    prog.wait_line(Stream::Out, Duration::from_secs(600), |l| {
        l.starts_with("live ")
    })?;
    // Twice: the first read also faults nothing in (the heap is written),
    // the second is the one kept (warm caches, as the check's own read).
    copy_all(prog.pid())?;
    let (bytes, seconds) = copy_all(prog.pid())?;
    let anon = anon_bytes(prog.pid());
    let walk = walk_by_pid(env, prog.pid(), "stopped").map_err(|e| format!("{e:#}"));
    let snapshot = walk_by_pid(env, prog.pid(), "snapshot").map_err(|e| format!("{e:#}"));
    let _ = prog.send_line();
    if seconds <= 0.0 {
        bail!("nothing copied");
    }
    Ok(Untraced {
        copy_gbps: bytes as f64 / seconds / 1e9,
        anon_bytes: anon,
        walk,
        snapshot,
    })
}

/// One traced run: memtrace launches heapscan and checks it at its exit.
fn check_run(env: &Env, case: &Case) -> Result<(f64, u64, u64, u64)> {
    let out = env.work.join("leak-check.json");
    let _ = std::fs::remove_file(&out);
    let status = Command::new("timeout")
        .arg("900")
        .arg(&env.memtrace)
        .args([
            "--format",
            "json",
            "--stack-depth",
            "0",
            "--ring-mib",
            "64",
            "--max-live",
            "20000000",
            "--leak-check-max-pause",
            "10m",
            "--output",
        ])
        .arg(&out)
        .arg("--")
        .arg(env.bin.join("heapscan"))
        .arg(case.bytes.to_string())
        .arg(case.blocks.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .context("memtrace runs")?;
    if !status.success() {
        bail!("memtrace: {status}");
    }
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&out)?)?;
    let check = &report["leak_check"];
    if check["ran"] != serde_json::Value::Bool(true) {
        bail!(
            "the check did not run: {}",
            check["reason"].as_str().unwrap_or("?")
        );
    }
    let blocks = |key: &str| check[key]["blocks"].as_u64().unwrap_or(0);
    Ok((
        check["pause_ms"].as_f64().unwrap_or(f64::NAN),
        check["scanned_bytes"].as_u64().unwrap_or(0),
        blocks("still_reachable"),
        blocks("definitely_lost") + blocks("indirectly_lost") + blocks("possibly_lost"),
    ))
}

fn measure(env: &Env, case: &Case) -> Result<Measured> {
    let rounds = env.rounds.clamp(1, 3);
    let untraced = untraced(env, case)?;
    let mut pauses = Vec::new();
    let mut last = (0, 0, 0);
    for _ in 0..rounds {
        let (pause, scanned, reachable, lost) = check_run(env, case)?;
        pauses.push(pause);
        last = (scanned, reachable, lost);
    }
    Ok(Measured {
        pause_ms: median(&pauses).unwrap_or(f64::NAN),
        scanned_bytes: last.0,
        reachable_blocks: last.1,
        lost_blocks: last.2,
        copy_gbps: untraced.copy_gbps,
        anon_bytes: untraced.anon_bytes,
        walk: untraced.walk,
        snapshot: untraced.snapshot,
    })
}

pub(super) fn bench(env: &Env) -> Vec<Row> {
    cases(env.quick)
        .into_iter()
        .map(|case| {
            eprintln!(
                "xtask bench:   leak check of {} MiB in {} blocks",
                case.bytes / MIB,
                case.blocks
            );
            Row {
                bytes: case.bytes,
                blocks: case.blocks,
                outcome: measure(env, &case).map_err(|e| format!("{e:#}")),
            }
        })
        .collect()
}

pub(super) fn render(rows: &[Row], s: &mut String) {
    let _ = writeln!(s, "## Leak check\n");
    let _ = writeln!(
        s,
        "`--leak-check` on `heapscan` (every eighth word of each block a pointer to another \
         block, all reachable), traced in launch mode and checked at its exit: the pause is \
         how long the process was held (drain, scan, judge), median of the rounds; the scan \
         rate is the bytes scanned over the pause. The copy rate is `process_vm_readv` over \
         the same heap's writable mappings, untraced, in the same run: the floor of any scan \
         that reads another process. Goal: the scan at least a quarter of the copy rate.\n"
    );
    let _ = writeln!(
        s,
        "| live heap | blocks | pause | scanned | scan rate | copy rate | scan / copy | verdicts |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|");
    for row in rows {
        let heap = format!("{} MiB", row.bytes / MIB);
        match &row.outcome {
            Ok(m) => {
                let scan_gbps = m.scanned_bytes as f64 / (m.pause_ms / 1000.0) / 1e9;
                let _ = writeln!(
                    s,
                    "| {heap} | {} | {:.0} ms | {} MiB | {:.2} GB/s | {:.2} GB/s | {:.2} | {} reachable, {} lost |",
                    row.blocks,
                    m.pause_ms,
                    m.scanned_bytes / MIB,
                    scan_gbps,
                    m.copy_gbps,
                    scan_gbps / m.copy_gbps,
                    m.reachable_blocks,
                    m.lost_blocks
                );
            }
            Err(err) => {
                let _ = writeln!(s, "| {heap} | {} | failed: {err} | | | | | |", row.blocks);
            }
        }
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "By pid, the same heap untraced: every block is from before the attach, found by \
         walking glibc's heap. The walk rate is the chunks stepped over per second and the \
         heap's bytes per second over the walk's time (it reads headers, not the blocks); \
         the pause is the whole check (walk, scan of the blocks as nodes, judgement).\n"
    );
    let _ = writeln!(
        s,
        "| live heap | blocks | chunks walked | walk | chunks/s | heap bytes/s | copy rate | walk / copy | pause | judged reachable |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|---|");
    for row in rows {
        let heap = format!("{} MiB", row.bytes / MIB);
        match &row.outcome {
            Ok(m) => match &m.walk {
                Ok(w) => {
                    let seconds = w.walk_ms / 1000.0;
                    let heap_gbps = row.bytes as f64 / seconds / 1e9;
                    let _ = writeln!(
                        s,
                        "| {heap} | {} | {} | {:.1} ms | {:.1} M | {:.2} GB/s | {:.2} GB/s | {:.2} | {:.0} ms | {} of {} |",
                        row.blocks,
                        w.chunks_walked,
                        w.walk_ms,
                        w.chunks_walked as f64 / seconds / 1e6,
                        heap_gbps,
                        m.copy_gbps,
                        heap_gbps / m.copy_gbps,
                        w.pause_ms,
                        w.reachable_blocks,
                        w.blocks_before_attach
                    );
                }
                Err(err) => {
                    let _ = writeln!(
                        s,
                        "| {heap} | {} | failed: {err} | | | | | | | |",
                        row.blocks
                    );
                }
            },
            Err(_) => {
                let _ = writeln!(s, "| {heap} | {} | (see above) | | | | | | | |", row.blocks);
            }
        }
    }
    let _ = writeln!(s);
    render_snapshot(rows, s);
}

/// The third table: by pid, a snapshot against the full stop.
fn render_snapshot(rows: &[Row], s: &mut String) {
    let _ = writeln!(
        s,
        "By pid, the same untraced heap checked twice: stopped for the whole check \
         (`--leak-check-mode stopped`), then from a snapshot (the default: the process is \
         stopped only to clone a copy-on-write child, which is scanned while it runs). The \
         goal for the snapshot's pause: at most 50 ms plus 15 ms per GiB of anonymous memory \
         (`RssAnon`); for its scan, at least a quarter of the copy rate. The clone's estimate \
         is the preflight's, from the anonymous memory and this host's measured fork cost \
         (`leak_check.clone_estimate_ms`).\n"
    );
    let _ = writeln!(
        s,
        "| live heap | blocks | anon | stopped: pause | snapshot: pause | of it the clone | clone estimated | goal | pause ratio | scan | scan rate | copy rate | scan / copy | mode | judged reachable |"
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for row in rows {
        let heap = format!("{} MiB", row.bytes / MIB);
        let Ok(m) = &row.outcome else {
            let _ = writeln!(s, "| {heap} | {} | (see above) ||||||||||||", row.blocks);
            continue;
        };
        match (&m.walk, &m.snapshot) {
            (Ok(stopped), Ok(snap)) => {
                let anon_gib = m.anon_bytes as f64 / (1u64 << 30) as f64;
                let goal = 50.0 + 15.0 * anon_gib;
                let scan_gbps = snap.scanned_bytes as f64 / (snap.scan_ms / 1000.0) / 1e9;
                let _ = writeln!(
                    s,
                    "| {heap} | {} | {:.2} GiB | {:.0} ms | {:.1} ms | {:.1} ms | {:.1} ms | {:.0} ms | {:.3} | {:.0} ms | {:.2} GB/s | {:.2} GB/s | {:.2} | {} | {} of {} |",
                    row.blocks,
                    anon_gib,
                    stopped.pause_ms,
                    snap.pause_ms,
                    snap.clone_ms,
                    snap.clone_estimate_ms,
                    goal,
                    snap.pause_ms / stopped.pause_ms,
                    snap.scan_ms,
                    scan_gbps,
                    m.copy_gbps,
                    scan_gbps / m.copy_gbps,
                    snap.mode,
                    snap.reachable_blocks,
                    snap.blocks_before_attach
                );
            }
            (stopped, snap) => {
                let err = stopped
                    .as_ref()
                    .err()
                    .or(snap.as_ref().err())
                    .cloned()
                    .unwrap_or_default();
                let _ = writeln!(s, "| {heap} | {} | failed: {err} ||||||||||||", row.blocks);
            }
        }
    }
    let _ = writeln!(s);
}
