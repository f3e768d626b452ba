//! `cargo xtask test-dist`: the proof that `cargo xtask dist`'s artifacts run
//! where users run them (and the last stage of `cargo xtask test`).
//!
//! - Each binary needs no glibc newer than the baseline, and only libc's own
//!   libraries (`elf_versions`).
//! - amd64, in a Debian bullseye root (glibc 2.31, `debootstrap
//!   --variant=minbase`), through `chroot` with the host's /proc, /sys and
//!   /dev: `--version`, `doctor` (the default mode loads) and a leak traced
//!   by pid in a target that runs on bullseye's own libc; the `.deb`
//!   installs there with `dpkg -i` and its `memtrace` runs.
//! - arm64, against bullseye's arm64 glibc (the first stage of `debootstrap
//!   --arch arm64 --foreign`) under qemu-user: `--version` and an offline
//!   `report`, which load every library it links. (The arm64 kernel matrix
//!   traces with this same binary on real arm64 kernels.)
//! - The tarballs hold what they should and match their sums; each `.rpm`'s
//!   file list (`rpm -qpl`), architecture and glibc requirement.
//! - NVML still loads at run time (`dlopen`): the amd64 binary's monitor
//!   reads the stub libnvidia-ml of the fixtures.
//!
//! A static build would also be run in an empty root; these binaries are
//! dynamic (see dist.rs for why), so the bullseye root stands for the old
//! hosts.

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::Value;

use super::dist::{self, DistArch, GLIBC_BASELINE};
use super::{docker, elf_versions, root, run};

/// The old userland the binaries are proven on.
const SUITE: &str = "bullseye";

/// Libraries a dist binary may need: glibc's own.
const ALLOWED_LIBRARIES: &[&str] = &[
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
];

/// Runs every check; fails listing the ones that failed.
pub fn check(artifacts: &[(DistArch, dist::Artifacts)]) -> Result<()> {
    let mut failures = Vec::new();
    let mut passed = 0;
    let mut record = |name: String, result: Result<()>| match result {
        Ok(()) => {
            eprintln!("xtask: test-dist: ok   {name}");
            passed += 1;
        }
        Err(err) => {
            eprintln!("xtask: test-dist: FAIL {name}: {err:#}");
            failures.push(name);
        }
    };
    for (arch, made) in artifacts {
        let a = arch.debian();
        record(
            format!("{a}: glibc symbol versions"),
            symbol_versions(&made.binary),
        );
        record(format!("{a}: tarball and sums"), tarball(*arch, made));
        record(format!("{a}: rpm file list"), rpm(*arch, &made.rpm));
        match arch {
            DistArch::Amd64 => {
                match bullseye_root(None) {
                    Ok(rootfs) => {
                        record(
                            format!("{a}: bullseye --version, doctor, leak by pid"),
                            in_bullseye(&rootfs, &made.binary),
                        );
                        record(
                            format!("{a}: bullseye dpkg -i"),
                            deb_in_bullseye(&rootfs, &made.deb),
                        );
                    }
                    Err(err) => record(format!("{a}: bullseye root"), Err(err)),
                }
                record(format!("{a}: NVML loads at run time"), nvml(&made.binary));
            }
            DistArch::Arm64 => record(
                format!("{a}: bullseye arm64 glibc under qemu-user"),
                arm64_in_bullseye(&made.binary),
            ),
        }
    }
    eprintln!(
        "xtask: test-dist: {passed} passed, {} failed",
        failures.len()
    );
    if !failures.is_empty() {
        bail!("test-dist failed: {}", failures.join("; "));
    }
    Ok(())
}

fn symbol_versions(binary: &Path) -> Result<()> {
    let needs = elf_versions::glibc_needs(binary)?;
    elf_versions::check_baseline(binary, &needs, GLIBC_BASELINE)?;
    let newest = needs.newest_glibc().context("no GLIBC_ version at all")?;
    let odd: Vec<&String> = needs
        .libraries
        .iter()
        .filter(|l| !ALLOWED_LIBRARIES.contains(&l.as_str()))
        .collect();
    if !odd.is_empty() {
        bail!("needs libraries beyond glibc: {odd:?}");
    }
    eprintln!(
        "xtask: test-dist: {} needs GLIBC_{}.{} at most, libraries {:?}",
        binary.display(),
        newest.0,
        newest.1,
        needs.libraries
    );
    Ok(())
}

fn tarball(arch: DistArch, made: &dist::Artifacts) -> Result<()> {
    let dir = made.tarball.parent().context("the tarball's folder")?;
    for file in [&made.tarball, &made.deb, &made.rpm] {
        let name = format!(
            "{}.sha256",
            file.file_name().context("a name")?.to_string_lossy()
        );
        run(Command::new("sha256sum")
            .current_dir(dir)
            .args(["--check", "--quiet", &name]))?;
    }
    let listing = output(Command::new("tar").arg("-tzf").arg(&made.tarball))?;
    let top = format!("memtrace-{}-{}-linux", dist::version(), arch.machine());
    for entry in [
        "memtrace",
        "README.md",
        "docs/src/install.md",
        "docs/src/reference/cli.md",
        "man/memtrace.1",
        "man/memtrace-watch.1",
        "completions/memtrace.bash",
        "completions/_memtrace",
        "completions/memtrace.fish",
    ] {
        let path = format!("{top}/{entry}");
        if !listing.lines().any(|l| l == path) {
            bail!("{} lacks {path}", made.tarball.display());
        }
    }
    Ok(())
}

fn rpm(arch: DistArch, path: &Path) -> Result<()> {
    let files = output(Command::new("rpm").arg("-qpl").arg(path))?;
    for expected in [
        "/usr/bin/memtrace",
        "/usr/share/man/man1/memtrace.1",
        "/usr/share/bash-completion/completions/memtrace",
    ] {
        if !files.lines().any(|l| l == expected) {
            bail!("rpm -qpl {} lacks {expected}:\n{files}", path.display());
        }
    }
    let rpm_arch = output(
        Command::new("rpm")
            .args(["-qp", "--qf", "%{ARCH}"])
            .arg(path),
    )?;
    if rpm_arch.trim() != arch.machine() {
        bail!(
            "{} is for {rpm_arch}, not {}",
            path.display(),
            arch.machine()
        );
    }
    let requires = output(Command::new("rpm").args(["-qp", "--requires"]).arg(path))?;
    if requires.contains("PayloadIsZstd") {
        bail!(
            "{} has a zstd payload, which rpm before 4.14 cannot read",
            path.display()
        );
    }
    let (major, minor) = GLIBC_BASELINE;
    if !requires.contains(&format!("glibc >= {major}.{minor}")) {
        bail!(
            "{} does not require glibc >= {major}.{minor}:\n{requires}",
            path.display()
        );
    }
    Ok(())
}

/// The bullseye root (`arch`: None for the host's), cached under
/// target/rootfs and built by debootstrap when missing.
fn bullseye_root(arch: Option<&str>) -> Result<PathBuf> {
    let name = match arch {
        Some(arch) => format!("{SUITE}-{arch}"),
        None => SUITE.to_string(),
    };
    let rootfs = root().join("target/rootfs").join(&name);
    if rootfs.join("usr/bin/dpkg").exists() || rootfs.join("debootstrap/debootstrap").exists() {
        return Ok(rootfs);
    }
    let partial = rootfs.with_extension("partial");
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(rootfs.parent().context("target/rootfs")?)?;
    let mut cmd = Command::new("debootstrap");
    cmd.arg("--variant=minbase");
    if let Some(arch) = arch {
        // The first stage only: the packages unpacked, nothing run.
        cmd.arg(format!("--arch={arch}")).arg("--foreign");
    }
    eprintln!(
        "xtask: test-dist: debootstrap {name} into {}",
        rootfs.display()
    );
    run(cmd.arg(SUITE).arg(&partial).arg(docker::host_mirror()))?;
    fs::rename(&partial, &rootfs)
        .with_context(|| format!("renaming {} to {}", partial.display(), rootfs.display()))?;
    Ok(rootfs)
}

/// The host's /proc, /sys and /dev inside a root, unmounted on drop.
struct Mounts {
    points: Vec<PathBuf>,
}

impl Mounts {
    fn new(rootfs: &Path) -> Result<Self> {
        let mut mounts = Mounts { points: Vec::new() };
        for (what, args) in [
            ("proc", &["-t", "proc", "proc"][..]),
            ("sys", &["--rbind", "/sys"][..]),
            ("dev", &["--rbind", "/dev"][..]),
        ] {
            let point = rootfs.join(what);
            fs::create_dir_all(&point)?;
            run(Command::new("mount").args(args).arg(&point))?;
            mounts.points.push(point);
        }
        Ok(mounts)
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        for point in self.points.iter().rev() {
            let _ = Command::new("umount")
                .arg("-R")
                .arg("-l")
                .arg(point)
                .status();
        }
    }
}

/// `zig cc` of the target fixture for `target` (`x86_64-linux-gnu.2.17`).
fn build_target_fixture(target: &str, out: &Path) -> Result<()> {
    build_with_zig(target, "tests/fixtures/dist/leak_by_pid.c", out)
}

/// `zig cc` of the C file `source` (relative to the workspace) for `target`.
fn build_with_zig(target: &str, source: &str, out: &Path) -> Result<()> {
    run(Command::new("python3")
        .args([
            "-m",
            "ziglang",
            "cc",
            "-target",
            target,
            "-O1",
            "-g",
            "-fno-omit-frame-pointer",
            "-o",
        ])
        .arg(out)
        .arg(root().join(source))
        .arg("-lpthread"))
}

/// The leak check's heap walk on bullseye's glibc 2.31: a program that
/// leaked before the attach (tests/fixtures/leak_check/before_attach.c),
/// checked by pid; its blocks from before are found as on newer glibcs.
fn heap_walk_in_bullseye(rootfs: &Path, chroot: &dyn Fn(&[&str]) -> Command) -> Result<()> {
    let opt = rootfs.join("opt/memtrace-dist");
    build_with_zig(
        "x86_64-linux-gnu.2.17",
        "tests/fixtures/leak_check/before_attach.c",
        &opt.join("leak_before_attach"),
    )?;
    let (_kill, pid) = start_ready(chroot(&["/opt/memtrace-dist/leak_before_attach"]))?;
    let report = output(&mut chroot(&[
        "/opt/memtrace-dist/memtrace",
        "--pid",
        &pid,
        "--leak-check",
        "--duration",
        "1s",
        "--format",
        "json",
    ]))?;
    let report: Value = serde_json::from_str(&report).context("the report's JSON")?;
    let before = &report["leak_check"]["before_attach"];
    let walk = &before["heap_walk"];
    // No debug file of bullseye's libc: main_arena found by its bins.
    if walk["status"] != "complete"
        || walk["glibc_version"] != "2.31"
        || walk["arenas_walked"] != 2
        || walk["main_arena_from"] != "empty bins"
        || walk["mmapped_chunks_glibc"] != walk["mmapped_chunks"]
    {
        bail!("bullseye: the heap walk was not complete on glibc 2.31: {walk}");
    }
    let count = |size: u64, category: &str| {
        before["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|g| g["size"] == size && g["category"] == category)
            .and_then(|g| g["count"].as_u64())
    };
    for (size, category, expected) in [
        (40, "definitely-lost", 50),
        (56, "definitely-lost", 20),
        (24, "still-reachable", 99),
        (88, "still-reachable", 1),
    ] {
        if count(size, category) != Some(expected) {
            bail!("bullseye: {expected} blocks of {size} B {category} expected: {before}");
        }
    }
    eprintln!("xtask: test-dist: in bullseye, the heap walk found leak_before_attach's blocks from before the attach on glibc 2.31");
    Ok(())
}

fn in_bullseye(rootfs: &Path, binary: &Path) -> Result<()> {
    let opt = rootfs.join("opt/memtrace-dist");
    fs::create_dir_all(&opt)?;
    fs::copy(binary, opt.join("memtrace"))?;
    build_target_fixture("x86_64-linux-gnu.2.17", &opt.join("leak_by_pid"))?;
    let _mounts = Mounts::new(rootfs)?;
    let chroot = |args: &[&str]| {
        let mut cmd = Command::new("chroot");
        cmd.arg(rootfs).args(args);
        cmd
    };
    let version = output(&mut chroot(&["/opt/memtrace-dist/memtrace", "--version"]))?;
    if !version.starts_with("memtrace ") {
        bail!("--version printed {version:?}");
    }
    let doctor = output(&mut chroot(&[
        "/opt/memtrace-dist/memtrace",
        "doctor",
        "--format",
        "json",
    ]))?;
    let doctor: Value = serde_json::from_str(&doctor).context("doctor's JSON")?;
    if doctor["default_loads"] != Value::Bool(true) {
        bail!("doctor: the default mode does not load: {doctor}");
    }
    let libc = output(&mut chroot(&["/usr/bin/ldd", "--version"]))?;
    if !libc.contains("2.31") {
        bail!("the root's libc is not bullseye's 2.31: {libc}");
    }

    // The target runs on the root's own libc.
    let (_kill, pid) = start_ready(chroot(&["/opt/memtrace-dist/leak_by_pid"]))?;
    let report = output(&mut chroot(&[
        "/opt/memtrace-dist/memtrace",
        "--pid",
        &pid,
        "--duration",
        "2s",
        "--format",
        "json",
    ]))?;
    let report: Value = serde_json::from_str(&report).context("the report's JSON")?;
    let leak = report["sites"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|site| {
            site["frames"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|frame| {
                    frame["symbol"]
                        .as_str()
                        .is_some_and(|s| s.contains("dist_leak"))
                })
        })
        .with_context(|| format!("no site in dist_leak: {report}"))?;
    let bytes = leak["live_bytes"].as_u64().unwrap_or(0);
    let count = leak["live_count"].as_u64().unwrap_or(0);
    if count == 0 || bytes != count * 4096 {
        bail!("dist_leak holds {bytes} bytes in {count} blocks, not 4096 each: {leak}");
    }
    let libc_frames = report["libraries"].to_string();
    if !libc_frames.contains("libc") {
        bail!("the probed libraries name no libc: {}", report["libraries"]);
    }
    eprintln!("xtask: test-dist: in bullseye, dist_leak holds {bytes} bytes in {count} blocks");
    heap_walk_in_bullseye(rootfs, &chroot)
}

struct KillOnDrop(u32);

/// A fixture started in the root: killed first, then its stdin (a pipe it
/// may wait on) closed, on drop.
struct Ready {
    _kill: KillOnDrop,
    _child: std::process::Child,
}

/// Starts a fixture and reads its `ready <pid>` line: the guard and the pid.
fn start_ready(mut command: Command) -> Result<(Ready, String)> {
    let mut target = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {command:?}"))?;
    let kill = KillOnDrop(target.id());
    let stdout = target.stdout.take().context("its stdout")?;
    let ready = Ready {
        _kill: kill,
        _child: target,
    };
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let pid = line
        .trim()
        .strip_prefix("ready ")
        .with_context(|| format!("{command:?} printed {line:?}"))?
        .to_string();
    Ok((ready, pid))
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Ok(pid) = i32::try_from(self.0) {
            // SAFETY: kill has no memory preconditions; the pid is our child's.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

fn deb_in_bullseye(rootfs: &Path, deb: &Path) -> Result<()> {
    let inside = rootfs.join("tmp/memtrace.deb");
    fs::copy(deb, &inside)?;
    let _mounts = Mounts::new(rootfs)?;
    run(Command::new("chroot")
        .arg(rootfs)
        .args(["dpkg", "-i", "/tmp/memtrace.deb"]))?;
    let result = (|| {
        let version = output(
            Command::new("chroot")
                .arg(rootfs)
                .args(["memtrace", "--version"]),
        )?;
        if !version.starts_with("memtrace ") {
            bail!("the installed memtrace printed {version:?}");
        }
        for file in [
            "usr/share/man/man1/memtrace.1.gz",
            "usr/share/bash-completion/completions/memtrace",
        ] {
            if !rootfs.join(file).exists() {
                bail!("the package did not install /{file}");
            }
        }
        Ok(())
    })();
    let _ = Command::new("chroot")
        .arg(rootfs)
        .args(["dpkg", "-r", "memtrace"])
        .status();
    let _ = fs::remove_file(inside);
    result
}

fn arm64_in_bullseye(binary: &Path) -> Result<()> {
    let rootfs = bullseye_root(Some("arm64"))?;
    let libc = rootfs.join("lib/aarch64-linux-gnu");
    if !fs::read_dir(&libc)
        .with_context(|| format!("reading {}", libc.display()))?
        .filter_map(|e| e.ok())
        .any(|e| e.file_name().to_string_lossy().starts_with("libc-2.31"))
    {
        bail!("{} has no glibc 2.31", libc.display());
    }
    let qemu = |args: &[&str]| {
        let mut cmd = Command::new("qemu-aarch64-static");
        cmd.arg("-L").arg(&rootfs).arg(binary).args(args);
        cmd
    };
    let version = output(&mut qemu(&["--version"]))?;
    if !version.starts_with("memtrace ") {
        bail!("--version printed {version:?}");
    }
    // The man pages and completions: every library, and clap's whole tree.
    let out = tempdir("arm64-generate")?;
    run(qemu(&["generate-docs", "--out"])
        .arg(&out)
        .stdout(Stdio::null()))?;
    if !out.join("man/memtrace.1").exists() {
        bail!("the arm64 binary wrote no man page");
    }
    let _ = fs::remove_dir_all(out);
    Ok(())
}

/// The stub libnvidia-ml (tests/fixtures/gpu/libnvml_stub.c) reports the
/// device bytes its usage folder gives each pid: the monitor must read this
/// process's figure through it.
fn nvml(binary: &Path) -> Result<()> {
    const BYTES: u64 = 123_456_789;
    let fixtures = super::fixtures()?;
    let stub = fixtures.join("nvml");
    if !stub.join("libnvidia-ml.so.1").exists() {
        bail!("the fixtures have no stub libnvidia-ml.so.1");
    }
    let out = tempdir("nvml")?;
    let usage = out.join("usage");
    fs::create_dir_all(&usage)?;
    let pid = std::process::id().to_string();
    fs::write(usage.join(&pid), format!("{BYTES}\n"))?;
    let json = out.join("monitor.json");
    run(Command::new(binary)
        .args([
            "monitor",
            "--pid",
            &pid,
            "--interval",
            "100ms",
            "--duration",
            "500ms",
            "--output",
        ])
        .arg(&json)
        .env("LD_LIBRARY_PATH", &stub)
        .env("MEMTRACE_STUB_GPU_DIR", &usage)
        .stdout(Stdio::null()))?;
    let doc: Value = serde_json::from_str(&fs::read_to_string(&json)?)?;
    let _ = fs::remove_dir_all(out);
    let sources = doc["meta"]["sources"].to_string();
    if !sources.contains("\"gpu: nvml\"") {
        bail!("the monitor did not read NVML: sources {sources}");
    }
    let read = doc["series"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["metric"] == "nvml.used")
        .flat_map(|s| s["points"].as_array().into_iter().flatten())
        .any(|point| point[1].as_f64() == Some(BYTES as f64));
    if !read {
        bail!(
            "no nvml.used point of {BYTES} bytes for this process: {}",
            doc["series"]
        );
    }
    Ok(())
}

fn tempdir(name: &str) -> Result<PathBuf> {
    let dir = root().join("target/test-dist").join(name);
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// A command's stdout; fails with its stderr when it fails or hangs.
fn output(cmd: &mut Command) -> Result<String> {
    let started = Instant::now();
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}) after {:?}: {}",
            out.status,
            started.elapsed(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
