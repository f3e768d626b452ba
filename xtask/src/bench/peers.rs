//! The bench's peers found and installed on demand: bpftrace, bcc's
//! memleak (run through assets/memleak_launcher.py) and the kernel headers
//! bcc compiles against.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::{root, run};

/// apt-get state for installing peers on demand.
/// bpftrace and bcc's memleak (with the kernel headers it compiles
/// against), installed when missing unless `no_install`; Err: why not.
pub(crate) fn find(no_install: bool) -> (Result<(), String>, Result<Option<PathBuf>, String>) {
    let mut apt = Apt {
        updated: false,
        no_install,
    };
    let bpftrace = ensure_bpftrace(&mut apt);
    (bpftrace, ensure_memleak(&mut apt, &root()))
}

struct Apt {
    updated: bool,
    no_install: bool,
}

fn apt_install(apt: &mut Apt, packages: &[&str]) -> Result<()> {
    if apt.no_install {
        bail!("not installed (and --no-install given)");
    }
    if Command::new("apt-get").arg("--version").output().is_err() {
        bail!(
            "no apt-get on this machine to install {}",
            packages.join(" ")
        );
    }
    // apt's progress goes to stderr: a section's Markdown is on stdout.
    let to_stderr = || std::process::Stdio::from(std::io::stderr());
    if !apt.updated {
        eprintln!("xtask bench: apt-get update");
        run(Command::new("apt-get")
            .args(["update", "-q"])
            .stdout(to_stderr()))?;
        apt.updated = true;
    }
    eprintln!("xtask bench: apt-get install {}", packages.join(" "));
    run(Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(packages)
        .stdout(to_stderr())
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn works(program: &str, arg: &str) -> bool {
    Command::new(program)
        .arg(arg)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// bpftrace, installed when missing. Err: why it is unavailable.
fn ensure_bpftrace(apt: &mut Apt) -> Result<(), String> {
    if works("bpftrace", "--version") {
        return Ok(());
    }
    apt_install(apt, &["bpftrace"]).map_err(|e| format!("installing bpftrace failed: {e:#}"))?;
    if works("bpftrace", "--version") {
        Ok(())
    } else {
        Err("bpftrace installed but does not run".into())
    }
}

/// `memleak-bpfcc`, run by its own interpreter through
/// `assets/memleak_launcher.py` (written to target/bench), which passes the
/// `ref_ctr_offset` argument Debian's python3-bpfcc 0.26 leaves to chance.
pub(crate) fn memleak_command() -> Result<Command> {
    let found = Command::new("sh")
        .args(["-c", "command -v memleak-bpfcc"])
        .output()?;
    let tool = String::from_utf8_lossy(&found.stdout).trim().to_string();
    if tool.is_empty() {
        bail!("memleak-bpfcc is not on PATH");
    }
    let script = std::fs::read_to_string(&tool).with_context(|| format!("reading {tool}"))?;
    let interpreter = script
        .lines()
        .next()
        .and_then(|line| line.strip_prefix("#!"))
        .and_then(|line| line.split_whitespace().next())
        .unwrap_or("/usr/bin/python3")
        .to_string();
    let launcher = root().join("target/bench/memleak_launcher.py");
    if let Some(dir) = launcher.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&launcher, include_str!("../../assets/memleak_launcher.py"))?;
    let mut cmd = Command::new(interpreter);
    cmd.arg(launcher).arg(tool);
    Ok(cmd)
}

fn command_exists(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// bcc's memleak (Debian's bpfcc-tools), installed when missing, and the
/// kernel-header tree bcc compiles against: Ok(None) when the kernel's own
/// /lib/modules/$(uname -r)/build exists, else Ok(Some(dir)) for
/// BCC_KERNEL_SOURCE. Err: why it is unavailable.
fn ensure_memleak(apt: &mut Apt, root: &Path) -> Result<Option<PathBuf>, String> {
    if !command_exists("memleak-bpfcc") {
        apt_install(apt, &["bpfcc-tools"])
            .map_err(|e| format!("installing bpfcc-tools failed: {e:#}"))?;
        if !command_exists("memleak-bpfcc") {
            return Err("bpfcc-tools installed but memleak-bpfcc is not on PATH".into());
        }
    }
    kernel_source(apt, root).map_err(|e| format!("no kernel headers for bcc: {e:#}"))
}

/// Kernel headers for bcc. Debian ships no headers for a custom kernel (here
/// a Firecracker one without /lib/modules or CONFIG_IKHEADERS), so this
/// installs Debian's own linux-headers-<arch> (its nearest kernel), merges its
/// `-common` and `-<arch>` folders into one tree (bcc wants a single
/// `build` directory) under target/bench/kernel-headers, and points
/// BCC_KERNEL_SOURCE there. Idempotent: a finished tree carries a marker.
fn kernel_source(apt: &mut Apt, root: &Path) -> Result<Option<PathBuf>> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    if Path::new(&format!("/lib/modules/{}/build", release.trim()))
        .join("include")
        .is_dir()
    {
        return Ok(None);
    }
    let merged = root.join("target/bench/kernel-headers");
    if merged.join(".merged").is_file() {
        return Ok(Some(merged));
    }
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => bail!("no Debian header package known for {other}"),
    };
    let find = || -> Option<PathBuf> {
        let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/src")
            .ok()?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name().is_some_and(|n| {
                    let n = n.to_string_lossy();
                    n.starts_with("linux-headers-") && n.ends_with(&format!("-{arch}"))
                })
            })
            .collect();
        dirs.sort();
        dirs.pop()
    };
    let arch_dir = match find() {
        Some(dir) => dir,
        None => {
            apt_install(apt, &[&format!("linux-headers-{arch}")])?;
            find().context("linux-headers installed but no /usr/src/linux-headers-*-{arch}")?
        }
    };
    let name = arch_dir
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let common = arch_dir.with_file_name(format!(
        "{}-common",
        name.trim_end_matches(&format!("-{arch}"))
    ));
    if !common.is_dir() {
        bail!(
            "{} has no matching {}",
            arch_dir.display(),
            common.display()
        );
    }
    eprintln!(
        "xtask bench: merging {} and {} into {}",
        common.display(),
        arch_dir.display(),
        merged.display()
    );
    let _ = std::fs::remove_dir_all(&merged);
    std::fs::create_dir_all(&merged)?;
    for dir in [&common, &arch_dir] {
        run(Command::new("cp").arg("-a").arg(dir.join(".")).arg(&merged))?;
    }
    // The arch folder's scripts/ and tools/ are links relative to /usr/src:
    // make them absolute so they resolve from the merged tree.
    for entry in std::fs::read_dir(&merged)?.filter_map(|e| e.ok()) {
        let path = entry.path();
        let Ok(target) = std::fs::read_link(&path) else {
            continue;
        };
        if target.is_relative() {
            if let Ok(absolute) = arch_dir.join(&target).canonicalize() {
                std::fs::remove_file(&path)?;
                std::os::unix::fs::symlink(&absolute, &path)?;
            }
        }
    }
    std::fs::write(merged.join(".merged"), format!("{name}\n"))?;
    Ok(Some(merged))
}
