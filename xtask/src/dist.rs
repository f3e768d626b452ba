//! `cargo xtask dist`: the release artifacts of both architectures in
//! `target/dist/`: one memtrace binary per architecture linked against a
//! glibc baseline old enough for every host the field runs (cargo-zigbuild),
//! tarballs with SHA-256 sums, a `.deb` (cargo-deb) and an `.rpm`
//! (cargo-generate-rpm), each with the man pages and shell completions that
//! `memtrace generate-docs` writes from the clap definitions.
//!
//! Why glibc and not a static musl build (measured, BENCHMARKS.md is not
//! involved): the soak monitor reads GPU memory through NVML, which it loads
//! with `dlopen` at run time (`nvml-wrapper`), and a static musl binary
//! cannot `dlopen`; and memtrace's user space allocates on every event,
//! where glibc's allocator is the one its overhead figures were measured
//! with. The baseline is the oldest glibc Rust's standard library links
//! against (`getrandom`, 2.25, in 2.26's headers): Amazon Linux 2 (2.26),
//! RHEL 8, Kylin V10 and openEuler 20.03 (2.28), Ubuntu 20.04 and Debian 11
//! (2.31), openEuler 22.03 (2.34) all run it.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::{build_ebpf_for, cargo_target_dir, ensure_rust_target, root, run, setup, Arch};

/// The glibc the binaries are linked against (cargo-zigbuild's target suffix).
pub const GLIBC_BASELINE: (u32, u32) = (2, 26);

/// Versions of the build tools from PyPI (zig and its cargo driver).
const ZIGLANG: &str = "ziglang==0.17.1";
const CARGO_ZIGBUILD: &str = "cargo-zigbuild==0.24.1";

/// Options of `cargo xtask dist`.
#[derive(Debug, clap::Args)]
pub struct DistArgs {
    /// Only these architectures (default: both).
    #[arg(long, value_enum)]
    pub arch: Vec<DistArch>,
}

/// An architecture memtrace is released for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DistArch {
    Amd64,
    Arm64,
}

impl DistArch {
    pub const ALL: [DistArch; 2] = [DistArch::Amd64, DistArch::Arm64];

    pub fn arch(self) -> Arch {
        match self {
            DistArch::Amd64 => Arch::X86_64,
            DistArch::Arm64 => Arch::Aarch64,
        }
    }

    /// The Rust target triple.
    pub fn triple(self) -> &'static str {
        match self {
            DistArch::Amd64 => "x86_64-unknown-linux-gnu",
            DistArch::Arm64 => "aarch64-unknown-linux-gnu",
        }
    }

    /// Debian's (and Docker's) name: `amd64`, `arm64`.
    pub fn debian(self) -> &'static str {
        match self {
            DistArch::Amd64 => "amd64",
            DistArch::Arm64 => "arm64",
        }
    }

    /// The kernel's and RPM's name: `x86_64`, `aarch64`.
    pub fn machine(self) -> &'static str {
        self.arch().name()
    }
}

/// What `dist` made for one architecture.
#[derive(Debug)]
pub struct Artifacts {
    pub binary: PathBuf,
    pub tarball: PathBuf,
    pub deb: PathBuf,
    pub rpm: PathBuf,
}

/// `target/dist/`.
pub fn dist_dir() -> PathBuf {
    root().join("target/dist")
}

/// The version every artifact carries (the workspace's).
pub fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// Builds and packages each architecture asked for (both by default).
pub fn dist(args: &DistArgs) -> Result<Vec<(DistArch, Artifacts)>> {
    let arches = if args.arch.is_empty() {
        DistArch::ALL.to_vec()
    } else {
        args.arch.clone()
    };
    setup::ensure(setup::Need::Dist)?;
    ensure_zigbuild()?;
    ensure_cargo_tool("cargo-deb", "deb")?;
    ensure_cargo_tool("cargo-generate-rpm", "generate-rpm")?;
    let out = dist_dir();
    fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;

    let mut binaries = Vec::new();
    for arch in &arches {
        binaries.push((*arch, build_binary(*arch)?));
    }
    // The man pages and completions: the same for both, written by a
    // binary this machine runs.
    let generated = out.join("generated");
    let _ = fs::remove_dir_all(&generated);
    let runnable = binaries
        .iter()
        .find(|(arch, _)| Arch::of_target(None).is_ok_and(|host| host == arch.arch()))
        .map(|(_, binary)| binary.clone())
        .unwrap_or_else(super::release_binary);
    run(Command::new(&runnable)
        .arg("generate-docs")
        .arg("--out")
        .arg(&generated)
        .stdout(std::process::Stdio::null()))?;

    let mut made = Vec::new();
    for (arch, binary) in binaries {
        let artifacts = package(arch, &binary, &generated, &out)?;
        made.push((arch, artifacts));
    }
    write_sums(&out)?;
    for (arch, artifacts) in &made {
        eprintln!(
            "xtask: dist {}: {}, {}, {}, {}",
            arch.debian(),
            artifacts.binary.display(),
            artifacts.tarball.display(),
            artifacts.deb.display(),
            artifacts.rpm.display()
        );
    }
    Ok(made)
}

/// The release binary for `arch`, linked against [`GLIBC_BASELINE`] by
/// cargo-zigbuild, its debug information stripped (symbols kept), checked
/// against the baseline and copied to `target/dist/<arch>/memtrace` (where
/// the Containerfile and the arm64 kernel matrix take it).
pub fn build_binary(arch: DistArch) -> Result<PathBuf> {
    ensure_zigbuild()?;
    ensure_rust_target(arch.triple())?;
    build_ebpf_for(arch.arch())?;
    let (major, minor) = GLIBC_BASELINE;
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root())
        .args(["zigbuild", "--release", "-p", "memtrace", "--target"])
        .arg(format!("{}.{major}.{minor}", arch.triple()))
        // The tarball is for running, not for debugging memtrace itself:
        // 100 MB of line tables become ~20 MB of binary.
        .env("CARGO_PROFILE_RELEASE_DEBUG", "0")
        .env("PATH", path_with_python_scripts())
        .env("CARGO_PROFILE_RELEASE_STRIP", "debuginfo");
    run(&mut cmd)?;
    let binary = cargo_target_dir()
        .join(arch.triple())
        .join("release/memtrace");
    let needs = crate::elf_versions::glibc_needs(&binary)?;
    crate::elf_versions::check_baseline(&binary, &needs, GLIBC_BASELINE)?;
    let dir = dist_dir().join(arch.debian());
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let copy = dir.join("memtrace");
    fs::copy(&binary, &copy)
        .with_context(|| format!("copying {} to {}", binary.display(), copy.display()))?;
    Ok(copy)
}

/// The tarball, the `.deb` and the `.rpm` of one architecture.
fn package(arch: DistArch, binary: &Path, generated: &Path, out: &Path) -> Result<Artifacts> {
    let name = format!("memtrace-{}-{}-linux", version(), arch.machine());
    let stage = out.join("stage").join(&name);
    let _ = fs::remove_dir_all(&stage);
    fs::create_dir_all(&stage).with_context(|| format!("creating {}", stage.display()))?;
    fs::copy(binary, stage.join("memtrace"))?;
    for dir in ["man", "completions"] {
        copy_dir(&generated.join(dir), &stage.join(dir))?;
    }
    fs::copy(root().join("README.md"), stage.join("README.md"))?;
    // The guide's chapters, where README's links point (docs/src/*.md).
    copy_markdown(&root().join("docs/src"), &stage.join("docs/src"))?;
    let tarball = out.join(format!("{name}.tar.gz"));
    run(Command::new("tar")
        .arg("-C")
        .arg(out.join("stage"))
        .args([
            "--sort=name",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "--mtime=@0",
            "-czf",
        ])
        .arg(&tarball)
        .arg(&name))?;
    write_sum(&tarball)?;

    // cargo-deb and cargo-generate-rpm read the assets from
    // memtrace/Cargo.toml: `target/release/memtrace` is the binary of
    // `--target`, the rest is under target/dist/generated.
    let deb = out.join(format!("memtrace_{}-1_{}.deb", version(), arch.debian()));
    run(Command::new("cargo")
        .current_dir(root())
        .args([
            "deb",
            "-p",
            "memtrace",
            "--no-build",
            "--no-strip",
            "--target",
        ])
        .arg(arch.triple())
        .arg("--output")
        .arg(&deb))?;
    write_sum(&deb)?;
    let rpm = out.join(format!("memtrace-{}-1.{}.rpm", version(), arch.machine()));
    run(Command::new("cargo")
        .current_dir(root())
        .args(["generate-rpm", "-p", "memtrace", "--target"])
        .arg(arch.triple())
        // gzip: Amazon Linux 2's rpm 4.11 reads no zstd payload.
        .args([
            "--payload-compress",
            "gzip",
            "--arch",
            arch.machine(),
            "--output",
        ])
        .arg(&rpm))?;
    write_sum(&rpm)?;
    Ok(Artifacts {
        binary: binary.to_path_buf(),
        tarball,
        deb,
        rpm,
    })
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        fs::copy(entry.path(), to.join(entry.file_name()))
            .with_context(|| format!("copying {}", entry.path().display()))?;
    }
    Ok(())
}

/// Every `.md` file under `from`, folders kept (the guide's sources).
fn copy_markdown(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let path = entry?.path();
        let name = path.file_name().context("a name")?;
        if path.is_dir() {
            copy_markdown(&path, &to.join(name))?;
        } else if path.extension().is_some_and(|e| e == "md") {
            fs::copy(&path, to.join(name))
                .with_context(|| format!("copying {}", path.display()))?;
        }
    }
    Ok(())
}

/// `sha256sum` of one file, as `FILE.sha256` beside it (`sha256sum -c`'s format).
fn write_sum(file: &Path) -> Result<()> {
    let dir = file.parent().context("an artifact's folder")?;
    let name = file.file_name().context("an artifact's name")?;
    let out = Command::new("sha256sum")
        .current_dir(dir)
        .arg(name)
        .output()
        .context("running sha256sum")?;
    if !out.status.success() {
        bail!("sha256sum {} failed", file.display());
    }
    let mut sum_path = file.as_os_str().to_owned();
    sum_path.push(".sha256");
    fs::write(&sum_path, &out.stdout).with_context(|| format!("writing {sum_path:?}"))
}

/// `SHA256SUMS`: every artifact's line, sorted.
fn write_sums(out: &Path) -> Result<()> {
    let mut lines = Vec::new();
    for entry in fs::read_dir(out)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "sha256") {
            lines.push(fs::read_to_string(&path)?);
        }
    }
    lines.sort();
    fs::write(out.join("SHA256SUMS"), lines.concat())
        .with_context(|| format!("writing {}", out.join("SHA256SUMS").display()))
}

/// zig and cargo-zigbuild from PyPI, when `cargo zigbuild` is missing.
pub fn ensure_zigbuild() -> Result<()> {
    let path = path_with_python_scripts();
    let works = |args: &[&str]| {
        Command::new(args[0])
            .args(&args[1..])
            .env("PATH", &path)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if works(&["cargo-zigbuild", "--version"]) && works(&["python3", "-m", "ziglang", "version"]) {
        return Ok(());
    }
    setup::ensure(setup::Need::Dist)?;
    eprintln!("xtask: installing {ZIGLANG} and {CARGO_ZIGBUILD} from PyPI");
    run(Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", ZIGLANG, CARGO_ZIGBUILD])
        // Debian's own Python refuses without it (PEP 668); pip < 23 ignores it.
        .env("PIP_BREAK_SYSTEM_PACKAGES", "1"))?;
    if !works(&["cargo-zigbuild", "--version"]) {
        bail!("cargo-zigbuild was installed from PyPI but `cargo-zigbuild` is not found on PATH nor in Python's scripts folders");
    }
    Ok(())
}

/// PATH with Python's scripts folders appended (where pip puts
/// `cargo-zigbuild`: the interpreter's, and the user's for `--user`
/// installs), so a pip whose folder is not on PATH still works.
fn path_with_python_scripts() -> std::ffi::OsString {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    let query = "import os, site, sysconfig; \
                 print(sysconfig.get_path('scripts')); \
                 print(os.path.join(site.getuserbase(), 'bin'))";
    if let Ok(out) = Command::new("python3").args(["-c", query]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let dir = PathBuf::from(line.trim());
            if !line.trim().is_empty() && !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
    }
    std::env::join_paths(dirs).unwrap_or_else(|_| std::env::var_os("PATH").unwrap_or_default())
}

/// `cargo install --locked CRATE` when `cargo SUBCOMMAND` is missing.
fn ensure_cargo_tool(krate: &str, subcommand: &str) -> Result<()> {
    let present = Command::new("cargo")
        .args([subcommand, "--version"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if present {
        return Ok(());
    }
    eprintln!("xtask: installing {krate} (cargo install --locked)");
    run(Command::new("cargo").args(["install", "--locked", krate]))
}
