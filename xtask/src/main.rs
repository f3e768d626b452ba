//! memtrace's build tasks: `cargo xtask build-ebpf | build | dist | test-dist | fixtures | test | test-image | demo | docs | bench | soak | test-kernels`.
//!
//! Each task installs what it needs first (the Debian packages setup.rs lists
//! for it, nightly rust-src, bpf-linker built against rustc's own LLVM) and is
//! idempotent: cheap when already done.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use bench::Section;

mod bench;
mod dist;
mod dist_check;
mod docker;
mod docs;
mod elf_versions;
mod kernels;
mod setup;
mod soak;

#[derive(Parser)]
#[command(name = "xtask", about = "memtrace build tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Build the eBPF object (installs rust-src and bpf-linker when missing).
    BuildEbpf {
        /// The Rust target memtrace is built for (its architecture's probes):
        /// default the host's; `aarch64-unknown-linux-gnu` for arm64.
        #[arg(long)]
        target: Option<String>,
    },
    /// Build the eBPF object and the release memtrace binary that embeds it.
    Build {
        /// Cross-build for this Rust target (`aarch64-unknown-linux-gnu`):
        /// the dist binary, linked by cargo-zigbuild against glibc 2.26
        /// (installs the Rust target, zig and cargo-zigbuild when missing).
        #[arg(long)]
        target: Option<String>,
    },
    /// The release artifacts of amd64 and arm64 in target/dist: binaries
    /// linked against glibc 2.26 (cargo-zigbuild), tarballs with SHA-256
    /// sums, .deb and .rpm packages, man pages and shell completions.
    Dist(dist::DistArgs),
    /// Build the dist artifacts and prove them (needs root): glibc symbol
    /// versions, a leak traced by pid in a Debian bullseye root, dpkg -i
    /// there, the arm64 binary on bullseye's arm64 glibc, rpm -qpl.
    TestDist(dist::DistArgs),
    /// Build the C fixtures and stub GPU libraries into target/fixtures.
    Fixtures,
    /// Run every test: unit tests and the privileged kernel suite (needs root).
    Test {
        /// Extra arguments for `cargo test` (after --).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Start dockerd when none answers and build the kernel suite's container
    /// image (`memtrace-test/trixie:<hash>`, no registry needed); prints its
    /// name. A dockerd it started is stopped again; the image stays.
    TestImage,
    /// Build everything and trace the bundled leaky demo program.
    Demo,
    /// Build the user guide (docs/ into docs/book): pictures from real
    /// traces (root), mdBook (installed when missing), every link checked.
    Docs(docs::DocsArgs),
    /// Measure memtrace against the probe floor and its peers (writes BENCHMARKS.md).
    Bench(bench::BenchArgs),
    /// Only the bench section on real Python and C++ workloads (prints Markdown).
    #[command(alias = "bench-python")]
    BenchWorkloads {
        /// Interleaved rounds per configuration.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// Only the bench section on redis-server under redis-benchmark (prints Markdown).
    BenchRedis {
        /// Interleaved rounds per configuration.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Requests per test (SET, GET) and run.
        #[arg(long, default_value_t = 50_000)]
        requests: u64,
    },
    /// Only the bench section on mallocbench under each preloaded allocator (prints Markdown).
    BenchAllocators {
        /// Interleaved rounds per configuration.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// Trace a steady workload for 30 minutes and judge memtrace's own memory.
    Soak(soak::SoakArgs),
    /// Boot Debian kernels in QEMU and run the smoke suite in each (target/kernels/matrix.md).
    TestKernels(kernels::TestArgs),
    /// Boot one kernel of the matrix in QEMU and run a command line inside.
    KernelRun(kernels::RunArgs),
    /// Check a memtrace JSON report (run inside the kernel matrix).
    #[command(hide = true)]
    MatrixCheck(kernels::CheckArgs),
}

fn main() -> Result<()> {
    match Cli::parse().task {
        Task::BuildEbpf { target } => build_ebpf_for(Arch::of_target(target.as_deref())?),
        Task::Build { target } => {
            let binary = build_release_target(target.as_deref())?;
            eprintln!("xtask: built {}", binary.display());
            Ok(())
        }
        Task::Dist(args) => dist::dist(&args).map(|_| ()),
        Task::TestDist(args) => dist::dist(&args).and_then(|made| dist_check::check(&made)),
        Task::Fixtures => {
            setup::ensure(setup::Need::Fixtures).and_then(|()| fixtures().map(|_| ()))
        }
        Task::Test { args } => test(&args),
        Task::TestImage => {
            let (_daemon, image) = docker_test_image()?;
            println!("{image}");
            Ok(())
        }
        Task::Demo => demo(),
        Task::Docs(args) => docs::docs(&args),
        Task::Bench(args) => bench::bench(args),
        Task::BenchRedis { rounds, requests } => {
            bench::alias("bench-redis", Section::Redis, rounds, Some(requests))
        }
        Task::BenchWorkloads { rounds } => {
            bench::alias("bench-workloads", Section::Workloads, rounds, None)
        }
        Task::BenchAllocators { rounds } => {
            bench::alias("bench-allocators", Section::Allocators, rounds, None)
        }
        Task::Soak(args) => soak::soak(args),
        Task::TestKernels(args) => kernels::test_kernels(args),
        Task::KernelRun(args) => kernels::kernel_run(args),
        Task::MatrixCheck(args) => kernels::matrix_check(args),
    }
}

/// The workspace root (the parent of this crate).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Where cargo puts what it builds: `CARGO_TARGET_DIR` when set, else the
/// workspace's `target/`.
pub fn cargo_target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// The release memtrace binary cargo built (for the host).
pub fn release_binary() -> PathBuf {
    cargo_target_dir().join("release/memtrace")
}

/// Runs a command, failing with its command line when it fails.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// A cargo command free of the outer cargo's toolchain settings.
fn clean_cargo(toolchain: &str) -> Command {
    let mut cmd = Command::new("cargo");
    cmd.arg(format!("+{toolchain}"));
    for var in [
        "RUSTUP_TOOLCHAIN",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

fn ensure_rust_src() -> Result<()> {
    let out = Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", "nightly"])
        .output()
        .context("rustup is needed to build the eBPF programs")?;
    if !String::from_utf8_lossy(&out.stdout).contains("rust-src") {
        eprintln!("xtask: installing rust-src for the nightly toolchain");
        run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }
    Ok(())
}

fn ensure_bpf_linker() -> Result<()> {
    if Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Ok(());
    }
    eprintln!("xtask: installing bpf-linker (linked against rustc's own LLVM)");
    let (sysroot, llvm) = nightly_llvm()?;
    let lib = sysroot.join("lib");
    let link = lib.join("libLLVM.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&llvm, &link)
        .with_context(|| format!("linking {}", link.display()))?;
    run(clean_cargo("stable")
        .args([
            "install",
            "bpf-linker",
            "--version",
            "0.13.0",
            "--locked",
            "--no-default-features",
            "--features",
            "llvm-22",
        ])
        .env("LLVM_PREFIX", &sysroot))
}

/// The nightly toolchain's sysroot and the `libLLVM.so.*-rust-*` it ships
/// (what bpf-linker links against; the bench's stand-in for a huge library).
pub fn nightly_llvm() -> Result<(PathBuf, PathBuf)> {
    let sysroot = Command::new("rustc")
        .args(["+nightly", "--print", "sysroot"])
        .output()
        .context("rustc +nightly --print sysroot")?;
    let sysroot = PathBuf::from(String::from_utf8_lossy(&sysroot.stdout).trim());
    let lib = sysroot.join("lib");
    let llvm = std::fs::read_dir(&lib)
        .with_context(|| format!("reading {}", lib.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name().is_some_and(|n| {
                n.to_string_lossy().starts_with("libLLVM.so.")
                    && n.to_string_lossy().contains("-rust-")
            })
        })
        .context("the nightly toolchain ships no libLLVM.so.*-rust-*")?;
    Ok((sysroot, llvm))
}

/// An architecture memtrace is built for: its eBPF objects read that
/// architecture's registers, so each has its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    X86_64,
    Aarch64,
}

impl Arch {
    /// The architecture of a Rust target triple (the host's when `None`).
    pub fn of_target(target: Option<&str>) -> Result<Self> {
        let triple = target.unwrap_or(if cfg!(target_arch = "aarch64") {
            "aarch64-unknown-linux-gnu"
        } else {
            "x86_64-unknown-linux-gnu"
        });
        match triple.split('-').next() {
            Some("x86_64") => Ok(Arch::X86_64),
            Some("aarch64") => Ok(Arch::Aarch64),
            _ => bail!("memtrace builds for x86_64 and aarch64 Linux targets, not {triple}"),
        }
    }

    /// Its name in `bpf_target_arch`.
    pub fn name(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64",
            Arch::Aarch64 => "aarch64",
        }
    }

    /// Its eBPF objects: each one's cargo features and target directory
    /// (under memtrace-ebpf/, where memtrace/build.rs looks for them). The
    /// full object; `tailcall` for kernels with attach cookies and atomics
    /// with fetch but no `bpf_loop` (5.15, 5.16); `compat` for those
    /// without cookies or atomics with fetch either (5.10-5.14): memtrace
    /// loads what the kernel's probed features allow.
    fn ebpf_objects(self) -> [(&'static str, &'static str); 3] {
        match self {
            Arch::X86_64 => [
                ("", "target"),
                ("tailcall", "target/tailcall"),
                ("compat", "target/compat"),
            ],
            Arch::Aarch64 => [
                ("", "target/aarch64"),
                ("tailcall", "target/tailcall-aarch64"),
                ("compat", "target/compat-aarch64"),
            ],
        }
    }
}

fn build_ebpf() -> Result<()> {
    build_ebpf_for(Arch::of_target(None)?)
}

/// Builds the eBPF objects for `arch` (see [`Arch::ebpf_objects`]).
fn build_ebpf_for(arch: Arch) -> Result<()> {
    ensure_rust_src()?;
    ensure_bpf_linker()?;
    for (features, dir) in arch.ebpf_objects() {
        let mut cargo = clean_cargo("nightly");
        cargo
            .current_dir(root().join("memtrace-ebpf"))
            .env("AYA_BPF_TARGET_ARCH", arch.name())
            .args(["build", "--release", "--target-dir", dir]);
        if !features.is_empty() {
            cargo.args(["--features", features]);
        }
        run(&mut cargo)?;
    }
    Ok(())
}

fn build_release() -> Result<()> {
    build_release_target(None).map(|_| ())
}

/// Builds the eBPF objects of `target`'s architecture and the release
/// memtrace binary for `target` (the host when `None`) that embeds them;
/// returns the binary's path. A cross build is `dist::build_binary`'s.
pub fn build_release_target(target: Option<&str>) -> Result<PathBuf> {
    let arch = Arch::of_target(target)?;
    let cross = target.filter(|t| Arch::of_target(None).ok() != Arch::of_target(Some(t)).ok());
    if cross.is_some() {
        // The one cross build: the dist binary (zig links it, glibc 2.26).
        return dist::build_binary(match arch {
            Arch::X86_64 => dist::DistArch::Amd64,
            Arch::Aarch64 => dist::DistArch::Arm64,
        });
    }
    build_ebpf_for(arch)?;
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root())
        .args(["build", "--release", "-p", "memtrace"]);
    if let Some(triple) = target {
        cmd.args(["--target", triple]);
    }
    run(&mut cmd)?;
    let dir = match target {
        Some(triple) => cargo_target_dir().join(triple),
        None => cargo_target_dir(),
    };
    Ok(dir.join("release/memtrace"))
}

/// `rustup target add` for the stable toolchain, when it is missing.
pub fn ensure_rust_target(triple: &str) -> Result<()> {
    let out = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .context("rustup is needed to cross-build")?;
    if !String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.trim() == triple)
    {
        eprintln!("xtask: installing the Rust target {triple}");
        run(Command::new("rustup").args(["target", "add", triple]))?;
    }
    Ok(())
}

/// Builds the fixtures; returns their directory.
pub fn fixtures() -> Result<PathBuf> {
    fixtures_target("all")
}

/// Builds one target of tests/fixtures/Makefile into target/fixtures.
fn fixtures_target(target: &str) -> Result<PathBuf> {
    let out = root().join("target/fixtures");
    run(Command::new("make")
        .args(["-s", "-C"])
        .arg(root().join("tests/fixtures"))
        .arg(format!("OUT={}", out.display()))
        .arg(target))?;
    Ok(out)
}

fn test(extra: &[String]) -> Result<()> {
    setup::ensure(setup::Need::Test)?;
    build_ebpf()?;
    // The other architecture's objects too: unit tests hold both to the
    // verifier's stack budget (kernel/stack_budget.rs).
    let other = match Arch::of_target(None)? {
        Arch::X86_64 => Arch::Aarch64,
        Arch::Aarch64 => Arch::X86_64,
    };
    build_ebpf_for(other)?;
    run(Command::new("cargo")
        .current_dir(root())
        .args(["fmt", "--all", "--check"]))?;
    run(Command::new("cargo").current_dir(root()).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ]))?;
    let fixtures = fixtures()?;
    // The real container runtime of tests/kernel/docker.rs: a daemon (this
    // task's own, stopped when the tests end, when none answers) and the
    // test image.
    let (_daemon, image) = docker_test_image()?;
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root())
        .args(["test", "--workspace"])
        .args(extra)
        .env("MEMTRACE_FIXTURES", &fixtures)
        .env("MEMTRACE_DOCKER_IMAGE", &image)
        .env("MEMTRACE_REQUIRE_KERNEL_TESTS", "1");
    match real_cudart() {
        Ok(path) => {
            cmd.env("MEMTRACE_REAL_CUDART", path);
        }
        Err(err) => eprintln!("xtask: the real libcudart.so.13 is unavailable: {err:#}"),
    }
    run(&mut cmd)?;
    if !extra.is_empty() {
        // A filtered run (`cargo xtask test -- NAME`) is the tests' only.
        return Ok(());
    }
    // The release artifacts of both architectures, proven on an old
    // userland (`cargo xtask test-dist`).
    let made = dist::dist(&dist::DistArgs { arch: Vec::new() })?;
    dist_check::check(&made)?;
    // The user guide, its pictures taken with the binary the tests built.
    docs::docs(&docs::DocsArgs {
        no_pictures: false,
        memtrace: Some(cargo_target_dir().join("debug/memtrace")),
    })
}

/// A Docker daemon that answers (started when none does; the one started
/// is stopped when the returned guard drops) and the kernel suite's test
/// image, cached under target/docker.
fn docker_test_image() -> Result<(docker::Daemon, String)> {
    setup::ensure(setup::Need::TestImage)?;
    let cache = root().join("target/docker");
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let daemon = docker::Daemon::ensure(&cache.join("dockerd.log"))?;
    let image = docker::test_image(&cache)?;
    Ok((daemon, image))
}

/// The real CUDA runtime from PyPI's `nvidia-cuda-runtime` wheel (a probe
/// target that needs no GPU), downloaded and unpacked once into target/pypi.
fn real_cudart() -> Result<PathBuf> {
    let dir = root().join("target/pypi");
    let lib = dir.join("nvidia/cu13/lib/libcudart.so.13");
    if lib.is_file() {
        return Ok(lib);
    }
    let wheels = dir.join("wheels");
    run(Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
        ])
        .arg(&wheels)
        .arg("nvidia-cuda-runtime"))?;
    let wheel = std::fs::read_dir(&wheels)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("no wheel downloaded")?;
    run(Command::new("python3")
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&dir))?;
    if lib.is_file() {
        Ok(lib)
    } else {
        bail!("{} has no nvidia/cu13/lib/libcudart.so.13", wheel.display())
    }
}

fn demo() -> Result<()> {
    setup::ensure(setup::Need::Demo)?;
    build_release()?;
    // Only the program the demo runs (the rest need C++ and allocator headers).
    let fixtures = fixtures_target("demo")?;
    let memtrace = release_binary();
    eprintln!("xtask: tracing the bundled demo (a request loop that leaks every 4th response)");
    run(Command::new(&memtrace)
        .args(["--top", "5", "--"])
        .arg(fixtures.join("leaky_demo"))
        .arg("400"))
}
