//! Section "End of a trace": how long after its window ends a trace's
//! report is written, and how long memtrace takes to exit (detaching its
//! probes), with about 10 and about 100 probed functions. The functions are
//! libc's, declared as one `--pairs` resource in a target that never calls
//! them (`sleep`), so only attaching and detaching are measured. Each size
//! is measured both ways memtrace attaches (hidden `--attach`): one
//! `uprobe_multi` link per object and stage (Linux 6.6+, the default there)
//! and one uprobe perf event per probe (older kernels, the baseline).

use std::fmt::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::common::{median, Env};

/// Probed functions asked for (some names may be missing from libc).
const SIZES: [usize; 2] = [10, 100];
/// How memtrace attaches, as `--attach` takes it, and how the table says it.
const ATTACH: [(&str, &str); 2] = [
    ("multi", "`uprobe_multi` links"),
    ("perf", "one perf event per probe"),
];
/// The trace's window.
const WINDOW: Duration = Duration::from_secs(2);

pub(super) struct EndRow {
    asked: usize,
    /// [`ATTACH`]'s description.
    attach: &'static str,
    outcome: Result<EndRun, String>,
}

struct EndRun {
    probed: u64,
    /// From the end of the window (memtrace's start + `--duration`) to the
    /// report on disk, and to memtrace's exit; medians of the rounds.
    report_s: f64,
    exit_s: f64,
}

/// `count` exported, non-IFUNC libc functions a sleeping process never calls.
fn libc_functions(count: usize) -> Result<Vec<String>> {
    let libc = [
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/lib/x86_64-linux-gnu/libc.so.6",
    ]
    .into_iter()
    .find(|p| Path::new(p).is_file())
    .context("no libc.so.6")?;
    let out = Command::new("nm")
        .args(["-D", "--defined-only", libc])
        .output()
        .context("nm")?;
    const AVOID: [&str; 12] = [
        "alloc", "free", "mmap", "exit", "abort", "sleep", "clock", "sig", "pthread", "fork",
        "exec", "time",
    ];
    let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (_, kind, name) = (fields.next()?, fields.next()?, fields.next()?);
            let name = name.split('@').next()?;
            (kind == "T"
                && name.starts_with(|c: char| c.is_ascii_lowercase())
                && !AVOID.iter().any(|a| name.contains(a)))
            .then(|| name.to_string())
        })
        .collect();
    names.sort();
    names.dedup();
    if names.len() < count {
        bail!("libc has only {} usable functions", names.len());
    }
    names.truncate(count);
    Ok(names)
}

fn pairs_file(env: &Env, names: &[String]) -> Result<std::path::PathBuf> {
    let Some((free, allocs)) = names.split_last() else {
        bail!("no functions");
    };
    let quoted: Vec<String> = allocs.iter().map(|n| format!("\"{n}\"")).collect();
    let path = env.work.join(format!("ending-{}.toml", names.len()));
    std::fs::write(
        &path,
        format!(
            "[[pair]]\nname = \"end-bench\"\nalloc = [{}]\nfree = \"{free}\"\n",
            quoted.join(", ")
        ),
    )?;
    Ok(path)
}

/// One trace of a sleeping process: (probed functions, report s, exit s).
fn one(env: &Env, pairs: &Path, attach: &str) -> Result<(u64, f64, f64)> {
    let mut target = Command::new("sleep").arg("600").spawn().context("sleep")?;
    let report = env.work.join("ending.json");
    let _ = std::fs::remove_file(&report);
    let started = Instant::now();
    let result = (|| {
        let mut tracer = Command::new(&env.memtrace)
            .args([
                "--pid",
                &target.id().to_string(),
                "--allocators",
                "cuda",
                "--pairs",
            ])
            .arg(pairs)
            .args([
                "--attach",
                attach,
                "--duration",
                &format!("{}s", WINDOW.as_secs()),
                "--format",
                "json",
            ])
            .arg("--output")
            .arg(&report)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("memtrace")?;
        let deadline = started + Duration::from_secs(300);
        let mut written = None;
        loop {
            if written.is_none() && std::fs::metadata(&report).is_ok_and(|m| m.len() > 0) {
                written = Some(started.elapsed());
            }
            if let Some(status) = tracer.try_wait()? {
                if !status.success() {
                    bail!("memtrace: {status}");
                }
                break;
            }
            if Instant::now() > deadline {
                let _ = tracer.kill();
                bail!("memtrace did not end within 300 s");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let exited = started.elapsed();
        let written = written.unwrap_or(exited);
        let json: serde_json::Value = serde_json::from_slice(&std::fs::read(&report)?)?;
        let probed = json["libraries"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|l| l["functions"].as_array().map_or(0, Vec::len) as u64)
            .sum();
        let end = WINDOW.as_secs_f64();
        Ok((
            probed,
            written.as_secs_f64() - end,
            exited.as_secs_f64() - end,
        ))
    })();
    let _ = target.kill();
    let _ = target.wait();
    result
}

pub(super) fn bench(env: &Env) -> Vec<EndRow> {
    let rounds = env.rounds.clamp(1, 3);
    SIZES
        .iter()
        .flat_map(|&asked| ATTACH.iter().map(move |&attach| (asked, attach)))
        .map(|(asked, (flag, attach))| {
            eprintln!(
                "xtask bench:   end of a trace, {asked} functions, --attach {flag} ({rounds} rounds)"
            );
            let outcome = libc_functions(asked)
                .and_then(|names| pairs_file(env, &names))
                .and_then(|pairs| {
                    let runs = (0..rounds)
                        .map(|_| one(env, &pairs, flag))
                        .collect::<Result<Vec<_>>>()?;
                    let report: Vec<f64> = runs.iter().map(|r| r.1).collect();
                    let exit: Vec<f64> = runs.iter().map(|r| r.2).collect();
                    Ok(EndRun {
                        probed: runs.first().map_or(0, |r| r.0),
                        report_s: median(&report).unwrap_or(f64::NAN),
                        exit_s: median(&exit).unwrap_or(f64::NAN),
                    })
                })
                .map_err(|err| format!("{err:#}"));
            EndRow {
                asked,
                attach,
                outcome,
            }
        })
        .collect()
}

pub(super) fn render(rows: &[EndRow], s: &mut String) {
    let _ = writeln!(s, "## End of a trace\n");
    let _ = writeln!(
        s,
        "A sleeping process traced for a {} s window with about 10 and about 100 probed \
         functions (libc's, declared with `--pairs`; each has an entry and a return probe). \
         The window closes in one step (every program returns at once), the report is written, \
         then the probes are detached: seconds are measured from the window's end (memtrace's \
         start + `--duration`, so attaching is inside the window). Medians of the rounds.\n",
        WINDOW.as_secs()
    );
    let _ = writeln!(
        s,
        "| functions asked | attached with | probed | report written after | memtrace exited after |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|");
    for row in rows {
        match &row.outcome {
            Ok(run) => {
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {:.2} s | {:.2} s |",
                    row.asked, row.attach, run.probed, run.report_s, run.exit_s
                );
            }
            Err(err) => {
                let _ = writeln!(s, "| {} | {} | failed: {err} | | |", row.asked, row.attach);
            }
        }
    }
    let _ = writeln!(
        s,
        "\nA uprobe perf event's close costs the kernel one uprobe unregistration with \
         grace-period waits, serialized there (closing them from many threads does not overlap \
         them). A `uprobe_multi` link (Linux 6.6+: one per traced process, object and entry \
         stage, plus one for the object's return probes) detaches all its probes in one close. \
         memtrace uses the links wherever `memtrace doctor` finds them (`--attach perf` forces \
         perf events, as on older kernels).\n"
    );
}
