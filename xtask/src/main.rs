//! memtrace's build tasks: `cargo xtask build-ebpf | build | fixtures | test | demo | bench | soak`.
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
    BuildEbpf,
    /// Build the eBPF object and the release memtrace binary that embeds it.
    Build,
    /// Build the C fixtures and stub GPU libraries into target/fixtures.
    Fixtures,
    /// Run every test: unit tests and the privileged kernel suite (needs root).
    Test {
        /// Extra arguments for `cargo test` (after --).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Build everything and trace the bundled leaky demo program.
    Demo,
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
        Task::BuildEbpf => build_ebpf(),
        Task::Build => build_release(),
        Task::Fixtures => {
            setup::ensure(setup::Need::Fixtures).and_then(|()| fixtures().map(|_| ()))
        }
        Task::Test { args } => test(&args),
        Task::Demo => demo(),
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

fn build_ebpf() -> Result<()> {
    ensure_rust_src()?;
    ensure_bpf_linker()?;
    run(clean_cargo("nightly")
        .current_dir(root().join("memtrace-ebpf"))
        .args(["build", "--release"]))?;
    // The object for kernels without attach cookies, atomics with fetch or
    // bpf_loop (5.10 - 5.16): memtrace loads it where those are missing.
    run(clean_cargo("nightly")
        .current_dir(root().join("memtrace-ebpf"))
        .args([
            "build",
            "--release",
            "--features",
            "compat",
            "--target-dir",
            "target/compat",
        ]))
}

fn build_release() -> Result<()> {
    build_ebpf()?;
    run(Command::new("cargo")
        .current_dir(root())
        .args(["build", "--release", "-p", "memtrace"]))
}

/// Builds the release memtrace for the Rust target `target` (None: the host's
/// `build`) and returns the binary's path.
///
/// Minimal stand-in for the arm64 kernel matrix (kernels/arm64.rs): a plain
/// cross `cargo build`, linked by Debian's `aarch64-linux-gnu-gcc`, that
/// embeds whatever eBPF object `build-ebpf` left. The arm64 port replaces it
/// with one that also builds the eBPF objects for that architecture.
pub fn build_release_target(target: Option<&str>) -> Result<PathBuf> {
    let target_dir = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root().join(dir),
        None => root().join("target"),
    };
    let Some(target) = target else {
        build_release()?;
        return Ok(target_dir.join("release/memtrace"));
    };
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .context("rustup is needed to cross-build memtrace")?;
    if !String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|l| l.trim() == target)
    {
        run(Command::new("rustup").args(["target", "add", target]))?;
    }
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root())
        .args(["build", "--release", "-p", "memtrace", "--target", target]);
    let linker = format!(
        "CARGO_TARGET_{}_LINKER",
        target.to_uppercase().replace('-', "_")
    );
    if target.starts_with("aarch64-") && std::env::var_os(&linker).is_none() {
        cmd.env(&linker, "aarch64-linux-gnu-gcc");
    }
    run(&mut cmd)?;
    Ok(target_dir.join(target).join("release/memtrace"))
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
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root())
        .args(["test", "--workspace"])
        .args(extra)
        .env("MEMTRACE_FIXTURES", &fixtures)
        .env("MEMTRACE_REQUIRE_KERNEL_TESTS", "1");
    match real_cudart() {
        Ok(path) => {
            cmd.env("MEMTRACE_REAL_CUDART", path);
        }
        Err(err) => eprintln!("xtask: the real libcudart.so.13 is unavailable: {err:#}"),
    }
    run(&mut cmd)
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
    let memtrace = root().join("target/release/memtrace");
    eprintln!("xtask: tracing the bundled demo (a request loop that leaks every 4th response)");
    run(Command::new(&memtrace)
        .args(["--top", "5", "--"])
        .arg(fixtures.join("leaky_demo"))
        .arg("400"))
}
