//! `memtrace probes PID|FILE`: the USDT probes an object file offers, or
//! every object a process maps (each opened as the process sees it), with
//! their file offsets, semaphores and decoded arguments; text or JSON.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use serde::Serialize;

use super::usdt::{self, UsdtArg, UsdtProbe};
use crate::error::Failure;

/// Options of `memtrace probes PID|FILE`.
#[derive(Debug, Args)]
pub struct ProbesArgs {
    /// A process id, or an ELF object (executable, shared library).
    #[arg(value_name = "PID|FILE")]
    pub target: String,
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = ListFormat::Text)]
    pub format: ListFormat,
}

/// Formats of listings (`memtrace probes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ListFormat {
    Text,
    Json,
}

/// One object and its probes.
#[derive(Debug, Serialize)]
struct ObjectProbes {
    /// The object as the target names it (or the file given).
    path: String,
    probes: Vec<ProbeOut>,
}

#[derive(Debug, Serialize)]
struct ProbeOut {
    provider: String,
    name: String,
    pc: u64,
    file_offset: u64,
    semaphore: Option<u64>,
    semaphore_offset: Option<u64>,
    args_text: String,
    args: Vec<UsdtArg>,
    /// Why the arguments could not be decoded (then `args` is empty).
    args_error: Option<String>,
}

impl From<UsdtProbe> for ProbeOut {
    fn from(probe: UsdtProbe) -> Self {
        let (args, args_error) = match probe.args {
            Ok(args) => (args, None),
            Err(err) => (Vec::new(), Some(err.to_string())),
        };
        ProbeOut {
            provider: probe.provider,
            name: probe.name,
            pc: probe.pc,
            file_offset: probe.file_offset,
            semaphore: probe.semaphore,
            semaphore_offset: probe.semaphore_offset,
            args_text: probe.args_text,
            args,
            args_error,
        }
    }
}

/// Runs `memtrace probes`.
pub fn run(args: &ProbesArgs) -> anyhow::Result<ExitCode> {
    let objects = collect(&args.target)?;
    let mut out = std::io::stdout().lock();
    match args.format {
        ListFormat::Json => {
            serde_json::to_writer_pretty(&mut out, &serde_json::json!({ "objects": objects }))?;
            writeln!(out)?;
        }
        ListFormat::Text => write_text(&mut out, &objects)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// The objects to list: the file named, or each file the process maps.
fn collect(target: &str) -> anyhow::Result<Vec<ObjectProbes>> {
    let as_file = Path::new(target);
    let pid = target.parse::<u32>().ok().filter(|_| !as_file.exists());
    let Some(pid) = pid else {
        let probes = usdt::read(as_file).map_err(|err| Failure::usage(err.to_string()))?;
        return Ok(vec![ObjectProbes {
            path: target.to_string(),
            probes: probes.into_iter().map(ProbeOut::from).collect(),
        }]);
    };
    crate::tracee::inspect(pid)?;
    let mappings = super::maps::read(pid)
        .map_err(|err| Failure::usage(format!("cannot read the mappings of pid {pid}: {err}")))?;
    let mut objects = Vec::new();
    for mapping in super::maps::executable_file_mappings(&mappings) {
        let shown: PathBuf = mapping.path.clone().unwrap_or_default();
        let path = match crate::tracee::files::open(pid, mapping) {
            Ok(path) => path,
            Err(why) => {
                log::warn!(
                    "{}: cannot open as pid {pid} sees it: {why}",
                    shown.display()
                );
                continue;
            }
        };
        match usdt::read(&path) {
            Ok(probes) if probes.is_empty() => {}
            Ok(probes) => objects.push(ObjectProbes {
                path: shown.display().to_string(),
                probes: probes.into_iter().map(ProbeOut::from).collect(),
            }),
            // One warning naming the object; the others are still listed.
            Err(err) => log::warn!("{}: {err}", shown.display()),
        }
    }
    Ok(objects)
}

fn write_text(out: &mut impl Write, objects: &[ObjectProbes]) -> std::io::Result<()> {
    if objects.iter().all(|o| o.probes.is_empty()) {
        writeln!(out, "no USDT probes")?;
    }
    for object in objects {
        writeln!(out, "{} ({} probes)", object.path, object.probes.len())?;
        for probe in &object.probes {
            write!(
                out,
                "  {}:{}  pc {:#x}  offset {:#x}",
                probe.provider, probe.name, probe.pc, probe.file_offset
            )?;
            match (probe.semaphore, probe.semaphore_offset) {
                (Some(addr), Some(offset)) => {
                    write!(out, "  semaphore {addr:#x} (offset {offset:#x})")?
                }
                (Some(addr), None) => write!(out, "  semaphore {addr:#x} (not in the file)")?,
                _ => {}
            }
            writeln!(out)?;
            if let Some(err) = &probe.args_error {
                writeln!(out, "    args {:?}: {err}", probe.args_text)?;
            } else if !probe.args.is_empty() {
                let decoded: Vec<String> = probe
                    .args
                    .iter()
                    .enumerate()
                    .map(|(i, arg)| format!("arg{i} {arg}"))
                    .collect();
                writeln!(out, "    {}  [{}]", decoded.join(", "), probe.args_text)?;
            }
        }
    }
    Ok(())
}
