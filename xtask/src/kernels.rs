//! The kernel matrix: `cargo xtask test-kernels` boots Debian's kernels in QEMU
//! and runs memtrace's smoke suite (`tests/kernel-matrix/smoke.sh`) in each, plus
//! once on the host, and prints a kernel x check table (also written to
//! `target/kernels/matrix.md`); `cargo xtask kernel-run --kernel 6.1 -- CMD...`
//! boots one kernel with the same initramfs and runs one command line inside.
//!
//! Kernels come through apt with a private configuration per suite
//! (`target/kernels/apt/<suite>`: its own `sources.list`, lists, cache and state,
//! `APT_CONFIG` pointing at a file that reads none of the host's `apt.conf.d`);
//! only `vmlinuz` is kept, in `target/kernels/<name>/vmlinuz`, so reruns are
//! offline. The initramfs (cpio newc, gzip) holds static busybox, the release
//! memtrace, the C fixtures, this xtask binary as the report checker
//! (`xtask matrix-check`), a pyenv CPython with the few stdlib files it needs to
//! start, and every library `ldd` names for them, each at its host path, so the
//! smoke script runs unchanged in the guest and on the host. QEMU uses TCG by
//! default (`/dev/kvm` here is a nested layer that crawls); a boot that never
//! reaches `/init` is retried once and reported as a boot failure, not a test
//! failure.
//!
//! `--arch arm64` (kernels/arm64.rs) boots Debian's arm64 kernels with this
//! file's fetching, booting, smoke suite, checks and table; the private apt is
//! kernels/apt.rs. Over 800 lines (about a fifth of them tests): image, boot,
//! table and report check are its other seams, to split into `kernels/` next.

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use serde_json::Value;

mod apt;
pub mod arm64;

/// Every check of the smoke suite, in table order.
pub const CHECKS: [&str; 11] = [
    "doctor",
    "launch",
    "fp",
    "depth0",
    "pid",
    "dwarf",
    "python",
    "cuda",
    "forks",
    "hashed",
    "leakcheck",
];

/// A Debian kernel of the matrix: the newest `-cloud-amd64` image of `suite`
/// whose ABI starts with `abi_prefix`.
#[derive(Debug, Clone, Copy)]
pub struct KernelSpec {
    /// What `--kernels` names it by (and its directory under target/kernels).
    pub name: &'static str,
    pub suite: &'static str,
    /// Mirrors tried in order (the first whose `apt-get update` works).
    pub mirrors: &'static [&'static str],
    pub abi_prefix: &'static str,
}

const DEBIAN: &str = "http://deb.debian.org/debian";
const ARCHIVE: &str = "http://archive.debian.org/debian";

/// The matrix's kernels (bullseye-security answered 404 here: not used).
pub const KERNELS: &[KernelSpec] = &[
    KernelSpec {
        name: "5.10",
        suite: "bullseye",
        mirrors: &[DEBIAN, ARCHIVE],
        abi_prefix: "5.10.",
    },
    KernelSpec {
        name: "6.1",
        suite: "bookworm",
        mirrors: &[DEBIAN],
        abi_prefix: "6.1.",
    },
    KernelSpec {
        name: "6.12",
        suite: "trixie",
        mirrors: &[DEBIAN],
        abi_prefix: "6.12.",
    },
    KernelSpec {
        name: "6.18",
        suite: "trixie-backports",
        mirrors: &[DEBIAN],
        abi_prefix: "6.18.",
    },
    KernelSpec {
        name: "7.x",
        suite: "trixie-backports",
        mirrors: &[DEBIAN],
        abi_prefix: "7.",
    },
    KernelSpec {
        name: "sid",
        suite: "sid",
        mirrors: &[DEBIAN],
        abi_prefix: "7.",
    },
];

/// The guest architecture of a matrix run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Arch {
    /// Debian's `-cloud-amd64` kernels under qemu-system-x86_64, plus the host column.
    #[default]
    #[value(name = "x86_64", alias = "amd64")]
    X86_64,
    /// Debian's `-cloud-arm64` kernels under qemu-system-aarch64 (kernels/arm64.rs).
    #[value(name = "arm64", alias = "aarch64")]
    Arm64,
}

/// `cargo xtask test-kernels` options.
#[derive(Args, Debug)]
pub struct TestArgs {
    /// Guest architecture: x86_64 (default) or arm64.
    #[arg(long, value_enum, default_value_t = Arch::X86_64)]
    arch: Arch,
    /// Kernels to boot (comma separated: 5.10,6.1,6.12,6.18,7.x,sid; arm64:
    /// 6.1,6.12,6.18,7.x,7.x-pac); default all.
    #[arg(long, value_delimiter = ',')]
    kernels: Vec<String>,
    /// Checks to run (comma separated); default all.
    #[arg(long, value_delimiter = ',')]
    checks: Vec<String>,
    /// Keep each VM's directory (initramfs, work files) under target/kernels/<name>.
    #[arg(long)]
    keep: bool,
    /// QEMU accelerator: tcg (default) or kvm.
    #[arg(long, default_value = "tcg")]
    accel: String,
    /// Seconds one boot (the whole suite) may take.
    #[arg(long, default_value_t = 1200)]
    boot_timeout: u64,
    /// Seconds one memtrace run inside may take.
    #[arg(long, default_value_t = 300)]
    check_timeout: u64,
    /// Run the default-mode checks even when `launch` showed the default mode does not load
    /// (each then waits out its own verifier run: minutes per check under TCG).
    #[arg(long)]
    full: bool,
    /// Leave out the host column (the arm64 matrix has none).
    #[arg(long)]
    no_host: bool,
    /// Use this memtrace binary instead of building target/release/memtrace.
    #[arg(long)]
    memtrace: Option<PathBuf>,
}

/// `cargo xtask kernel-run` options.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// Guest architecture: x86_64 (default) or arm64.
    #[arg(long, value_enum, default_value_t = Arch::X86_64)]
    arch: Arch,
    /// The kernel: a matrix name (5.10, 6.1, 6.12, 6.18, 7.x, sid; arm64: 6.1, 6.12, 6.18,
    /// 7.x, 7.x-pac) or a vmlinuz path.
    #[arg(long)]
    kernel: String,
    /// QEMU accelerator: tcg (default) or kvm.
    #[arg(long, default_value = "tcg")]
    accel: String,
    /// Seconds the boot may take.
    #[arg(long, default_value_t = 900)]
    timeout: u64,
    /// Use this memtrace binary instead of building target/release/memtrace.
    #[arg(long)]
    memtrace: Option<PathBuf>,
    /// Also put this host file or directory in the image, at the same path (repeatable).
    #[arg(long)]
    include: Vec<PathBuf>,
    /// The command: one argument is a shell line ($MEMTRACE, $FIXTURES, $CHECK, $PYTHON
    /// are set), several are quoted word by word.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// `xtask matrix-check FILE ASSERTION...` (run by the smoke suite).
#[derive(Args, Debug)]
pub struct CheckArgs {
    /// A memtrace JSON report.
    file: PathBuf,
    /// `site:SYM=BYTES/COUNT`, `chain:SYM=A,B,..`, `nostacks`, `total:ALLOC>=BYTES`,
    /// `py:F1,F2,..>=BYTES/COUNT`, `processes>=N`, `!note:TEXT` (no note
    /// holds TEXT).
    assertions: Vec<String>,
}

fn kernels_dir() -> PathBuf {
    crate::root().join("target/kernels")
}

// ---------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------

/// `cargo xtask kernel-run`: boots one kernel and runs one command line inside;
/// exits with the command's status.
pub fn kernel_run(args: RunArgs) -> Result<()> {
    if args.arch == Arch::Arm64 {
        return arm64::kernel_run(args);
    }
    require_root("kernel-run")?;
    ensure_host_tools()?;
    let vmlinuz = match Path::new(&args.kernel) {
        p if p.is_file() => p.to_path_buf(),
        _ => {
            let spec = find_spec(&args.kernel)?;
            fetch_kernel(spec)
                .with_context(|| format!("fetching kernel {}", spec.name))?
                .vmlinuz
        }
    };
    let memtrace = memtrace_binary(args.memtrace.as_deref())?;
    let image = build_image(&memtrace, &args.include)?;
    let name = find_spec(&args.kernel).map_or("custom", |s| s.name);
    let dir = kernels_dir().join(name).join("run");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let initrd = image.with_mode(&dir, &Mode::Run(run_command_line(&args.command)))?;
    let log = dir.join("console.log");
    eprintln!(
        "xtask: booting {} ({}), console in {}",
        vmlinuz.display(),
        args.accel,
        log.display()
    );
    let mut boot = boot_vm(
        &vmlinuz,
        &initrd,
        &log,
        &args.accel,
        Duration::from_secs(args.timeout),
        true,
    )?;
    if !boot.reached_init {
        eprintln!("xtask: the kernel never reached /init; retrying once");
        boot = boot_vm(
            &vmlinuz,
            &initrd,
            &log,
            &args.accel,
            Duration::from_secs(args.timeout),
            true,
        )?;
    }
    eprintln!("xtask: {}", boot.summary());
    match boot.exit_code {
        Some(0) => Ok(()),
        Some(code) => std::process::exit(code.clamp(1, 255)),
        None => bail!("the command did not finish: {}", boot.summary()),
    }
}

/// `kernel-run`'s command as one shell line: one argument is a shell line
/// already, several are quoted word by word.
fn run_command_line(command: &[String]) -> String {
    match command {
        [line] => line.clone(),
        words => words
            .iter()
            .map(|w| shell_quote(w))
            .collect::<Vec<_>>()
            .join(" "),
    }
}

/// `cargo xtask test-kernels`: the whole matrix.
pub fn test_kernels(args: TestArgs) -> Result<()> {
    if args.arch == Arch::Arm64 {
        return arm64::test_kernels(args);
    }
    require_root("test-kernels")?;
    ensure_host_tools()?;
    // The image holds the fixtures: a fresh machine has not their build's
    // packages unless `cargo xtask test` ran first.
    crate::setup::ensure(crate::setup::Need::Fixtures)?;
    let started = Instant::now();
    let specs: Vec<KernelSpec> = if args.kernels.is_empty() {
        KERNELS.to_vec()
    } else {
        args.kernels
            .iter()
            .map(|k| find_spec(k).copied())
            .collect::<Result<_>>()?
    };
    let checks: Vec<String> = if args.checks.is_empty() {
        CHECKS.iter().map(|c| c.to_string()).collect()
    } else {
        for c in &args.checks {
            if !CHECKS.contains(&c.as_str()) {
                bail!("unknown check {c:?} (checks: {})", CHECKS.join(","));
            }
        }
        args.checks.clone()
    };
    let memtrace = memtrace_binary(args.memtrace.as_deref())?;
    let image = build_image(&memtrace, &[])?;
    let opts = SmokeOpts {
        checks: checks.join(","),
        full: args.full,
        check_timeout: args.check_timeout,
    };
    let mut rows = Vec::new();
    if !args.no_host {
        eprintln!("xtask: running the smoke suite on the host");
        rows.push(host_row(&image, &opts)?);
        print_row(rows.last(), &checks);
    }
    for spec in &specs {
        let row = kernel_row(spec, &image, &opts, &args);
        print_row(Some(&row), &checks);
        rows.push(row);
    }
    let table = render_table(&rows, &checks);
    let elapsed = started.elapsed().as_secs();
    let text = format!(
        "# Kernel matrix\n\n`cargo xtask test-kernels` ({elapsed} s, accel {}).\n\n{table}",
        args.accel
    );
    let out = kernels_dir().join("matrix.md");
    std::fs::write(&out, &text).with_context(|| format!("writing {}", out.display()))?;
    println!("\n{table}");
    eprintln!("xtask: wrote {} ({elapsed} s)", out.display());
    let failed: usize = rows.iter().map(Row::failures).sum();
    if failed > 0 {
        eprintln!("xtask: {failed} cell(s) of the kernel matrix failed");
        std::process::exit(1);
    }
    Ok(())
}

/// `xtask matrix-check FILE ASSERTION...`: prints one line, exits 1 on a failed assertion.
pub fn matrix_check(args: CheckArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let report: Value = serde_json::from_str(text.trim())
        .or_else(|_| {
            // A JSON Lines stream: the last report.
            text.lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(serde_json::from_str)
                .unwrap_or_else(|| serde_json::from_str(""))
        })
        .with_context(|| format!("{} is not a JSON report", args.file.display()))?;
    let mut passed = Vec::new();
    for a in &args.assertions {
        match check_assertion(&report, a) {
            Ok(ok) => passed.push(ok),
            Err(why) => {
                println!("{why}");
                std::process::exit(1);
            }
        }
    }
    println!("{}", passed.join(", "));
    Ok(())
}

fn require_root(task: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("cargo xtask {task} runs apt, dpkg and memtrace: run it as root");
    }
    Ok(())
}

fn find_spec(name: &str) -> Result<&'static KernelSpec> {
    KERNELS.iter().find(|k| k.name == name).with_context(|| {
        format!(
            "unknown kernel {name:?} (kernels: {})",
            KERNELS.iter().map(|k| k.name).collect::<Vec<_>>().join(",")
        )
    })
}

fn memtrace_binary(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = given {
        return std::fs::canonicalize(path).with_context(|| format!("{}", path.display()));
    }
    // The dist binary (glibc 2.26, zig-linked): what users install is what
    // each kernel runs.
    crate::dist::build_binary(crate::dist::DistArch::Amd64)
}

/// Installs what the runner needs on the host when missing (Debian packages).
fn ensure_host_tools() -> Result<()> {
    let missing: Vec<&str> = [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("busybox", "busybox-static"),
        ("cpio", "cpio"),
    ]
    .iter()
    .filter(|(tool, _)| which(tool).is_none())
    .map(|(_, pkg)| *pkg)
    .collect();
    let static_busybox = which("busybox").is_some_and(|b| !is_dynamic(&b));
    let mut packages = missing;
    if !static_busybox && !packages.contains(&"busybox-static") {
        packages.push("busybox-static");
    }
    if packages.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing {}", packages.join(" "));
    crate::run(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&packages)
            .env("DEBIAN_FRONTEND", "noninteractive"),
    )
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(tool))
            .find(|p| p.is_file())
    })
}

fn is_dynamic(path: &Path) -> bool {
    Command::new("ldd")
        .arg(path)
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("=>"))
}

// ---------------------------------------------------------------------------
// Kernels through a private apt
// ---------------------------------------------------------------------------

/// A fetched kernel: its image and what it is (package and version).
pub struct Fetched {
    pub vmlinuz: PathBuf,
    pub label: String,
}

/// The apt configuration (the file `APT_CONFIG` names) of a private apt rooted
/// at `base` for Debian architecture `arch` (`amd64`, `arm64`).
pub fn apt_config_for(base: &Path, arch: &str) -> String {
    let b = base.display();
    format!(
        r#"// Private apt of cargo xtask test-kernels: reads nothing of the host's apt.conf.d.
Dir::Etc "{b}/etc/";
Dir::Etc::main "apt.conf";
Dir::Etc::parts "apt.conf.d/";
Dir::Etc::sourcelist "sources.list";
Dir::Etc::sourceparts "sources.list.d/";
Dir::Etc::preferences "preferences";
Dir::Etc::preferencesparts "preferences.d/";
Dir::Etc::trusted "trusted.gpg";
Dir::Etc::trustedparts "trusted.gpg.d/";
Dir::State "{b}/state/";
Dir::State::lists "lists/";
Dir::State::status "{b}/state/status";
Dir::Cache "{b}/cache/";
Dir::Cache::archives "archives/";
Dir::Log "{b}/log/";
APT::Architecture "{arch}";
APT::Architectures {{ "{arch}"; }};
APT::Sandbox::User "root";
Acquire::Languages "none";
Acquire::Check-Valid-Until "false";
Acquire::Retries "2";
"#
    )
}

/// The `sources.list` of one suite (signed by the host's Debian keyring when it has one).
pub fn sources_list(mirror: &str, suite: &str, keyring: Option<&Path>) -> String {
    let opts = match keyring {
        Some(k) => format!("[signed-by={}] ", k.display()),
        None => String::new(),
    };
    format!("deb {opts}{mirror} {suite} main\n")
}

/// The image package to take from `apt-cache search` output: the newest ABI
/// starting with `abi_prefix` and ending in `-<arch>`, `linux-binary-*` (7.x) before
/// `linux-image-*`.
pub fn pick_package_for(search_output: &str, abi_prefix: &str, arch: &str) -> Option<String> {
    let arch_suffix = format!("-{arch}");
    let mut best: Option<(String, u8, String)> = None;
    for line in search_output.lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let (abi, rank) = if let Some(abi) = name.strip_prefix("linux-binary-") {
            (abi, 1)
        } else if let Some(abi) = name.strip_prefix("linux-image-") {
            (abi, 0)
        } else {
            continue;
        };
        if !abi.starts_with(abi_prefix)
            || !abi.ends_with(&arch_suffix)
            || ["-dbg", "-unsigned", "-rt-"]
                .iter()
                .any(|bad| abi.contains(bad))
        {
            continue;
        }
        let better = match &best {
            None => true,
            Some((b_abi, b_rank, _)) => match version_cmp(abi, b_abi) {
                std::cmp::Ordering::Greater => true,
                std::cmp::Ordering::Equal => rank > *b_rank,
                std::cmp::Ordering::Less => false,
            },
        };
        if better {
            best = Some((abi.to_string(), rank, name.to_string()));
        }
    }
    best.map(|(_, _, name)| name)
}

/// Compares version-like strings: digit runs as numbers, the rest as text.
pub fn version_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    fn parts(s: &str) -> Vec<(bool, String)> {
        let mut out: Vec<(bool, String)> = Vec::new();
        for c in s.chars() {
            let digit = c.is_ascii_digit();
            match out.last_mut() {
                Some((d, text)) if *d == digit => text.push(c),
                _ => out.push((digit, c.to_string())),
            }
        }
        out
    }
    let (pa, pb) = (parts(a), parts(b));
    for (x, y) in pa.iter().zip(pb.iter()) {
        let ord = if x.0 && y.0 {
            let (xs, ys) = (x.1.trim_start_matches('0'), y.1.trim_start_matches('0'));
            xs.len().cmp(&ys.len()).then_with(|| xs.cmp(ys))
        } else {
            x.1.cmp(&y.1)
        };
        if ord != std::cmp::Ordering::Equal {
            return ord;
        }
    }
    pa.len().cmp(&pb.len())
}

/// The kernel of `spec`, from target/kernels/<name> or fetched through apt.
fn fetch_kernel(spec: &KernelSpec) -> Result<Fetched> {
    fetch_kernel_for(
        spec,
        "amd64",
        &kernels_dir().join(spec.name),
        &kernels_dir().join("apt"),
    )
}

/// The `-cloud-<arch>` kernel of `spec` for Debian architecture `arch`, from
/// `dir` or fetched through a private apt under `apt_root/<suite>` (only
/// `vmlinuz` and a `package` note are kept in `dir`, so reruns are offline).
fn fetch_kernel_for(spec: &KernelSpec, arch: &str, dir: &Path, apt_root: &Path) -> Result<Fetched> {
    let vmlinuz = dir.join("vmlinuz");
    let info = dir.join("package");
    if vmlinuz.is_file() {
        let label = std::fs::read_to_string(&info).unwrap_or_default();
        return Ok(Fetched {
            vmlinuz,
            label: label.trim().to_string(),
        });
    }
    std::fs::create_dir_all(dir)?;
    let apt = apt::PrivateApt::open(&apt_root.join(spec.suite), arch, spec.suite, spec.mirrors)?;
    let listing = apt.search(&format!("^linux-(image|binary)-[0-9].*-{arch}$"))?;
    let cloud_suffix = format!("-cloud-{arch}");
    let cloud: String = listing
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|n| n.ends_with(&cloud_suffix))
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let package = pick_package_for(&cloud, spec.abi_prefix, arch)
        .or_else(|| pick_package_for(&listing, spec.abi_prefix, arch))
        .with_context(|| {
            format!(
                "{} has no linux-image/linux-binary {}* package",
                spec.suite, spec.abi_prefix
            )
        })?;
    let version = apt.version(&package)?;
    let dl = dir.join("download");
    let _ = std::fs::remove_dir_all(&dl);
    eprintln!("xtask: downloading {package} {version} ({})", spec.suite);
    let deb = apt.download(&package, &dl)?;
    extract_vmlinuz(&deb, &dl.join("x"))
        .and_then(|found| {
            std::fs::rename(&found, &vmlinuz).with_context(|| format!("moving {}", found.display()))
        })
        .with_context(|| format!("extracting vmlinuz from {}", deb.display()))?;
    let _ = std::fs::remove_dir_all(&dl);
    let label = format!("{package} {version}");
    std::fs::write(&info, format!("{label}\n"))?;
    Ok(Fetched { vmlinuz, label })
}

/// The kernel image among a package's members: `./boot/vmlinuz-*` (linux-image)
/// or `./usr/lib/modules/*/vmlinuz` (linux-binary, from 6.19).
pub fn vmlinuz_member(listing: &str) -> Option<&str> {
    listing.lines().map(str::trim).find(|m| {
        m.strip_prefix("./boot/vmlinuz-")
            .is_some_and(|v| !v.is_empty())
            || (m.starts_with("./usr/lib/modules/") && m.ends_with("/vmlinuz"))
    })
}

/// `dpkg-deb --fsys-tarfile DEB | tar ARGS` (tar's stdout returned).
fn deb_tar(deb: &Path, tar_args: &[&str], dir: &Path) -> Result<String> {
    let mut dpkg = Command::new("dpkg-deb")
        .arg("--fsys-tarfile")
        .arg(deb)
        .stdout(Stdio::piped())
        .spawn()
        .context("running dpkg-deb")?;
    let stdout = dpkg.stdout.take().context("dpkg-deb stdout")?;
    let tar = Command::new("tar")
        .args(tar_args)
        .current_dir(dir)
        .stdin(stdout)
        .output()
        .context("running tar")?;
    let dpkg = dpkg.wait()?;
    if !tar.status.success() || !dpkg.success() {
        bail!(
            "dpkg-deb --fsys-tarfile | tar {}: {dpkg}, {}: {}",
            tar_args.join(" "),
            tar.status,
            last_line(&String::from_utf8_lossy(&tar.stderr))
        );
    }
    Ok(String::from_utf8_lossy(&tar.stdout).into_owned())
}

/// Unpacks only the kernel image of a package into `into`; returns it.
fn extract_vmlinuz(deb: &Path, into: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(into)?;
    let listing = deb_tar(deb, &["-t"], into)?;
    let member = vmlinuz_member(&listing).context("the package has no vmlinuz")?;
    deb_tar(deb, &["-x", member], into)?;
    Ok(into.join(member))
}

fn last_line(text: &str) -> String {
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
        .to_string()
}

// ---------------------------------------------------------------------------
// The initramfs
// ---------------------------------------------------------------------------

/// The shared part of every boot's initramfs, and what the smoke script is told.
pub struct Image {
    /// base.cpio.gz: everything but the mode.
    base: PathBuf,
    memtrace: PathBuf,
    fixtures: PathBuf,
    python: Option<PathBuf>,
}

/// What one boot does.
pub enum Mode {
    /// The smoke suite.
    Smoke(SmokeOpts),
    /// One shell command line.
    Run(String),
}

/// Options passed to the smoke script.
#[derive(Clone)]
pub struct SmokeOpts {
    pub checks: String,
    pub full: bool,
    pub check_timeout: u64,
}

/// Quotes a word for sh.
pub fn shell_quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-+=:,@%".contains(c))
    {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// The environment the smoke script (or a developer command) gets.
fn env_vars(
    memtrace: &Path,
    fixtures: &Path,
    check: &Path,
    python: Option<&Path>,
    pyscript: &Path,
    work: &Path,
    opts: Option<&SmokeOpts>,
) -> Vec<(String, String)> {
    let s = |p: &Path| p.display().to_string();
    let mut vars = vec![
        ("MEMTRACE".to_string(), s(memtrace)),
        ("FIXTURES".to_string(), s(fixtures)),
        ("CHECK".to_string(), s(check)),
        ("PYTHON".to_string(), python.map(s).unwrap_or_default()),
        ("PYSCRIPT".to_string(), s(pyscript)),
        ("WORK".to_string(), s(work)),
    ];
    if let Some(o) = opts {
        vars.push(("CHECKS".to_string(), o.checks.clone()));
        vars.push((
            "MATRIX_FULL".to_string(),
            if o.full { "1" } else { "0" }.to_string(),
        ));
        vars.push(("MATRIX_TIMEOUT".to_string(), o.check_timeout.to_string()));
    }
    vars
}

/// `/matrix/env` of the guest: sourced by /init.
pub fn env_file(mode: &str, vars: &[(String, String)]) -> String {
    let mut text = format!("MATRIX_MODE={mode}\n");
    for (k, v) in vars {
        let _ = writeln!(text, "{k}={}", shell_quote(v));
        let _ = writeln!(text, "export {k}");
    }
    text
}

/// Parses `ldd` output into the absolute paths of the libraries (and loader) it names.
pub fn parse_ldd(text: &str) -> Vec<PathBuf> {
    text.lines()
        .filter_map(|line| {
            let target = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            target.starts_with('/').then(|| PathBuf::from(target))
        })
        .collect()
}

fn is_elf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == *b"\x7fELF"
}

/// Files being gathered into the image's root, each at its host path.
struct Stage {
    root: PathBuf,
    elves: Vec<PathBuf>,
}

impl Stage {
    /// Copies host file `src` to `dest` (an absolute path inside the image).
    fn put_at(&mut self, src: &Path, dest: &Path) -> Result<()> {
        let rel = dest.strip_prefix("/").unwrap_or(dest);
        let to = self.root.join(rel);
        if to.exists() {
            return Ok(());
        }
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::copy(src, &to)
            .with_context(|| format!("copying {} to {}", src.display(), to.display()))?;
        if is_elf(src) {
            self.elves.push(src.to_path_buf());
        }
        Ok(())
    }

    fn put(&mut self, src: &Path) -> Result<()> {
        self.put_at(src, src)
    }

    /// Copies a directory tree (regular files; symlinks followed).
    fn put_tree(&mut self, dir: &Path, keep: &dyn Fn(&Path) -> bool) -> Result<()> {
        for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                self.put_tree(&path, keep)?;
            } else if path.is_file() && keep(&path) {
                self.put(&path)?;
            }
        }
        Ok(())
    }

    /// Adds every library `ldd` names for the ELF files put so far (transitively).
    fn close_libraries(&mut self) -> Result<()> {
        let mut done = 0;
        while done < self.elves.len() {
            let elf = self.elves[done].clone();
            done += 1;
            let out = Command::new("ldd")
                .arg(&elf)
                .output()
                .context("running ldd")?;
            for lib in parse_ldd(&String::from_utf8_lossy(&out.stdout)) {
                if lib.is_file() {
                    self.put(&lib)?;
                }
            }
        }
        Ok(())
    }
}

/// The pyenv CPython to put in the image (3.12 first), as its real binary.
fn pyenv_python() -> Option<PathBuf> {
    let out = Command::new("pyenv")
        .args(["versions", "--bare"])
        .output()
        .ok()?;
    let versions: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|v| v.starts_with("3.") && v.chars().all(|c| c.is_ascii_digit() || c == '.'))
        .collect();
    let pick = ["3.12.", "3.11.", "3.13.", "3.10."]
        .iter()
        .find_map(|p| versions.iter().find(|v| v.starts_with(p)))?;
    let prefix = Command::new("pyenv").args(["prefix", pick]).output().ok()?;
    let prefix = PathBuf::from(String::from_utf8_lossy(&prefix.stdout).trim());
    let short: String = pick.split('.').take(2).collect::<Vec<_>>().join(".");
    let exe = prefix.join(format!("bin/python{short}"));
    exe.is_file().then_some(exe)
}

/// Builds target/kernels/initramfs/base.cpio.gz.
fn build_image(memtrace: &Path, includes: &[PathBuf]) -> Result<Image> {
    let fixtures = crate::fixtures()?;
    let dir = kernels_dir().join("initramfs");
    let root = dir.join("root");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    for d in [
        "bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "tmp", "run", "root", "matrix",
        "etc",
    ] {
        std::fs::create_dir_all(root.join(d))?;
    }
    let mut stage = Stage {
        root: root.clone(),
        elves: Vec::new(),
    };
    let busybox = which("busybox").context("busybox is not installed")?;
    stage.put_at(&busybox, Path::new("/bin/busybox"))?;
    // The console must exist before /init runs, or init starts without stdout.
    let _ = Command::new("mknod")
        .arg(root.join("dev/console"))
        .args(["c", "5", "1"])
        .status();
    let ld_cache = Path::new("/etc/ld.so.cache");
    if ld_cache.is_file() {
        stage.put(ld_cache)?;
    }
    stage.put(memtrace)?;
    // Fixtures: the programs and libraries at the top of target/fixtures.
    for entry in std::fs::read_dir(&fixtures)? {
        let path = entry?.path();
        if path.is_file() {
            stage.put(&path)?;
        }
    }
    let checker = std::env::current_exe().context("locating the xtask binary")?;
    stage.put_at(&checker, Path::new("/matrix/check"))?;
    let src = crate::root().join("tests/kernel-matrix");
    stage.put_at(&src.join("init"), Path::new("/init"))?;
    stage.put_at(&src.join("smoke.sh"), Path::new("/matrix/smoke.sh"))?;
    stage.put_at(&src.join("leak.py"), Path::new("/matrix/leak.py"))?;
    let python = pyenv_python();
    match &python {
        Some(exe) => {
            stage.put(exe)?;
            // The stdlib CPython needs to start with -S: its landmark and encodings
            // (the rest of start-up is frozen in since 3.11).
            if let Some(prefix) = exe.parent().and_then(Path::parent) {
                let name = exe
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let lib = prefix.join("lib").join(&name);
                stage.put(&lib.join("os.py"))?;
                // Its exec-prefix landmark (no extension module is needed).
                std::fs::create_dir_all(
                    stage
                        .root
                        .join(lib.join("lib-dynload").strip_prefix("/").unwrap_or(&lib)),
                )?;
                stage.put_tree(&lib.join("encodings"), &|p: &Path| {
                    p.extension().is_some_and(|e| e == "py")
                })?;
            }
        }
        None => eprintln!("xtask: no pyenv CPython found: the python check will say not run"),
    }
    for inc in includes {
        let inc = std::fs::canonicalize(inc).with_context(|| format!("{}", inc.display()))?;
        if inc.is_dir() {
            stage.put_tree(&inc, &|_| true)?;
        } else {
            stage.put(&inc)?;
        }
    }
    stage.close_libraries()?;
    set_mode(&root.join("init"), 0o755)?;
    set_mode(&root.join("matrix/smoke.sh"), 0o755)?;
    let base = dir.join("base.cpio.gz");
    write_cpio(&root, &base)?;
    let size = std::fs::metadata(&base).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "xtask: initramfs {} ({} MiB compressed)",
        base.display(),
        size >> 20
    );
    Ok(Image {
        base,
        memtrace: memtrace.to_path_buf(),
        fixtures,
        python,
    })
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))
}

/// `find . | cpio -o -H newc | gzip` of `root` into `out`.
fn write_cpio(root: &Path, out: &Path) -> Result<()> {
    let file = std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let status = Command::new("sh")
        .arg("-c")
        .arg("find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet | gzip -1")
        .current_dir(root)
        .stdout(file)
        .status()
        .context("running find | cpio | gzip")?;
    if !status.success() {
        bail!("building {} failed: {status}", out.display());
    }
    Ok(())
}

impl Image {
    /// This boot's initramfs in `dir`: the base plus a small archive with
    /// `/matrix/env` (and `/matrix/cmd.sh`), concatenated (the kernel unpacks both).
    fn with_mode(&self, dir: &Path, mode: &Mode) -> Result<PathBuf> {
        let stage = dir.join("mode");
        let _ = std::fs::remove_dir_all(&stage);
        std::fs::create_dir_all(stage.join("matrix"))?;
        let vars = env_vars(
            &self.memtrace,
            &self.fixtures,
            Path::new("/matrix/check"),
            self.python.as_deref(),
            Path::new("/matrix/leak.py"),
            Path::new("/tmp/matrix"),
            match mode {
                Mode::Smoke(o) => Some(o),
                Mode::Run(_) => None,
            },
        );
        let name = match mode {
            Mode::Smoke(_) => "smoke",
            Mode::Run(cmd) => {
                std::fs::write(
                    stage.join("matrix/cmd.sh"),
                    format!("mkdir -p \"$WORK\"\ncd \"$WORK\" || exit 1\n{cmd}\n"),
                )?;
                "run"
            }
        };
        std::fs::write(stage.join("matrix/env"), env_file(name, &vars))?;
        let mode_cpio = dir.join("mode.cpio.gz");
        write_cpio(&stage, &mode_cpio)?;
        let initrd = dir.join("initramfs.cpio.gz");
        let mut out = std::fs::File::create(&initrd)?;
        for part in [&self.base, &mode_cpio] {
            let mut f = std::fs::File::open(part)?;
            std::io::copy(&mut f, &mut out)?;
        }
        Ok(initrd)
    }
}

// ---------------------------------------------------------------------------
// Booting
// ---------------------------------------------------------------------------

/// What one QEMU boot showed on its console.
pub struct Boot {
    pub reached_init: bool,
    pub finished: bool,
    pub timed_out: bool,
    pub uname: Option<String>,
    pub exit_code: Option<i32>,
    pub results: Vec<CheckResult>,
    pub last_lines: Vec<String>,
    pub secs: u64,
}

impl Boot {
    fn summary(&self) -> String {
        let how = if !self.reached_init {
            format!("never reached /init: {}", self.panic_line())
        } else if self.timed_out {
            "timed out".to_string()
        } else if !self.finished {
            format!("ended early: {}", self.panic_line())
        } else {
            "finished".to_string()
        };
        format!(
            "{} ({} s, kernel {})",
            how,
            self.secs,
            self.uname.as_deref().unwrap_or("?")
        )
    }

    /// The console line that best says why the boot went wrong.
    fn panic_line(&self) -> String {
        self.last_lines
            .iter()
            .find(|l| l.contains("Kernel panic") || l.contains("Oops"))
            .or_else(|| self.last_lines.iter().rev().find(|l| !l.trim().is_empty()))
            .cloned()
            .unwrap_or_else(|| "no console output".to_string())
    }
}

fn boot_vm(
    vmlinuz: &Path,
    initrd: &Path,
    log: &Path,
    accel: &str,
    timeout: Duration,
    echo: bool,
) -> Result<Boot> {
    let mut cmd = Command::new("qemu-system-x86_64");
    match accel {
        "kvm" => cmd.args(["-accel", "kvm", "-cpu", "host"]),
        "tcg" => cmd.args(["-accel", "tcg,thread=multi", "-cpu", "max"]),
        "tcg-single" => cmd.args(["-accel", "tcg,thread=single", "-cpu", "max"]),
        other => bail!("unknown accelerator {other:?} (tcg or kvm)"),
    };
    cmd.args([
        "-m",
        "2G",
        "-smp",
        "2",
        "-nographic",
        "-no-reboot",
        "-kernel",
    ])
    .arg(vmlinuz)
    .arg("-initrd")
    .arg(initrd)
    .arg("-append")
    .arg(kernel_command_line());
    watch_console(cmd, log, timeout, echo)
}

/// Runs a QEMU command line (its serial console on stdout) to its end or
/// `timeout`, logging the console to `log` and reading the matrix markers.
fn watch_console(mut cmd: Command, log: &Path, timeout: Duration, echo: bool) -> Result<Boot> {
    let started = Instant::now();
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let program = cmd.get_program().to_string_lossy().into_owned();
    let mut child = cmd.spawn().with_context(|| format!("starting {program}"))?;
    let (tx, rx) = mpsc::channel::<String>();
    let mut readers = Vec::new();
    if let Some(out) = child.stdout.take() {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || forward_lines(out, &tx)));
    }
    if let Some(err) = child.stderr.take() {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || forward_lines(err, &tx)));
    }
    drop(tx);
    let mut logf =
        std::fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let mut boot = Boot {
        reached_init: false,
        finished: false,
        timed_out: false,
        uname: None,
        exit_code: None,
        results: Vec::new(),
        last_lines: Vec::new(),
        secs: 0,
    };
    let deadline = started + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            boot.timed_out = true;
            let _ = child.kill();
            break;
        }
        match rx.recv_timeout(left) {
            Ok(line) => {
                let _ = writeln!(logf, "{line}");
                if echo {
                    println!("{line}");
                }
                if let Some(rest) = marker(&line, "MATRIX-INIT") {
                    boot.reached_init = true;
                    boot.uname = Some(rest.trim().to_string());
                } else if marker(&line, "MATRIX-DONE").is_some() {
                    boot.finished = true;
                } else if let Some(rest) = marker(&line, "MATRIX-EXIT") {
                    boot.exit_code = rest.trim().parse().ok();
                } else if let Some(r) = parse_result_line(&line) {
                    boot.results.push(r);
                }
                boot.last_lines.push(line);
                if boot.last_lines.len() > 40 {
                    boot.last_lines.remove(0);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let _ = child.wait();
    for r in readers {
        let _ = r.join();
    }
    boot.secs = started.elapsed().as_secs();
    Ok(boot)
}

fn forward_lines(from: impl Read, tx: &mpsc::Sender<String>) {
    let mut reader = BufReader::new(from);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf)
                    .trim_end_matches(['\n', '\r'])
                    .replace('\r', "");
                if tx.send(line).is_err() {
                    return;
                }
            }
        }
    }
}

/// The rest of `line` after `name` when `name` is a marker word in it.
fn marker<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let at = line.find(name)?;
    let rest = &line[at + name.len()..];
    (rest.is_empty() || rest.starts_with(' ')).then_some(rest)
}

// ---------------------------------------------------------------------------
// Results and the table
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Pass,
    Fail,
    Skip,
}

/// One `MATRIX <check> PASS|FAIL|SKIP <detail>` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckResult {
    pub check: String,
    pub status: Status,
    pub detail: String,
}

/// Parses a result line (kernel messages may precede it on the same console line).
pub fn parse_result_line(line: &str) -> Option<CheckResult> {
    let at = line.find("MATRIX ")?;
    let mut words = line[at + "MATRIX ".len()..].splitn(3, ' ');
    let check = words.next()?.to_string();
    let status = match words.next()? {
        "PASS" => Status::Pass,
        "FAIL" => Status::Fail,
        "SKIP" => Status::Skip,
        _ => return None,
    };
    let detail = words.next().unwrap_or("").trim().to_string();
    (!check.is_empty()).then_some(CheckResult {
        check,
        status,
        detail,
    })
}

/// One row of the matrix: a kernel (or the host) and what each check did.
#[derive(Debug, Clone)]
pub struct Row {
    pub label: String,
    /// Set when no check ran: why ("no kernel: ...", "boot failed: ...").
    pub problem: Option<String>,
    pub results: Vec<CheckResult>,
    /// Why a check that printed nothing has no result (the VM timed out, ...).
    pub missing: Option<String>,
}

impl Row {
    fn cell(&self, check: &str) -> (String, Option<String>) {
        if let Some(problem) = &self.problem {
            let short = problem.split(':').next().unwrap_or(problem).to_string();
            return (short, Some(problem.clone()));
        }
        match self.results.iter().find(|r| r.check == check) {
            Some(r) => match r.status {
                Status::Pass => ("PASS".to_string(), None),
                Status::Fail => ("FAIL".to_string(), Some(r.detail.clone())),
                Status::Skip => ("not run".to_string(), Some(r.detail.clone())),
            },
            None => (
                "FAIL".to_string(),
                Some(format!(
                    "no result: {}",
                    self.missing.as_deref().unwrap_or("the suite printed none")
                )),
            ),
        }
    }

    /// Failed cells (a fetch or boot failure fails every cell).
    pub fn failures(&self) -> usize {
        if self.problem.is_some() {
            return 1;
        }
        self.results
            .iter()
            .filter(|r| r.status == Status::Fail)
            .count()
            + usize::from(self.missing.is_some())
    }
}

/// The Markdown table: a row per kernel, a column per check, reasons as numbered notes.
pub fn render_table(rows: &[Row], checks: &[String]) -> String {
    let mut notes: Vec<String> = Vec::new();
    let mut out = String::new();
    let _ = writeln!(out, "| kernel | {} |", checks.join(" | "));
    let _ = writeln!(out, "|---|{}", "---|".repeat(checks.len()));
    for row in rows {
        let mut cells = Vec::new();
        for check in checks {
            let (text, note) = row.cell(check);
            let cell = match note {
                Some(n) if !n.is_empty() => {
                    let n = n.replace('|', "/");
                    let idx = match notes.iter().position(|x| *x == n) {
                        Some(i) => i,
                        None => {
                            notes.push(n);
                            notes.len() - 1
                        }
                    };
                    format!("{text} [{}]", idx + 1)
                }
                _ => text,
            };
            cells.push(cell);
        }
        let _ = writeln!(out, "| {} | {} |", row.label, cells.join(" | "));
    }
    if !notes.is_empty() {
        out.push('\n');
        for (i, n) in notes.iter().enumerate() {
            let _ = writeln!(out, "{}. {n}", i + 1);
        }
    }
    out
}

fn print_row(row: Option<&Row>, checks: &[String]) {
    if let Some(row) = row {
        let cells: Vec<String> = checks
            .iter()
            .map(|c| format!("{c}={}", row.cell(c).0))
            .collect();
        eprintln!("xtask: {}: {}", row.label, cells.join(" "));
    }
}

/// The host column: the same smoke script, run directly.
fn host_row(image: &Image, opts: &SmokeOpts) -> Result<Row> {
    let dir = kernels_dir().join("host");
    let work = dir.join("work");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let checker = std::env::current_exe()?;
    let src = crate::root().join("tests/kernel-matrix");
    let vars = env_vars(
        &image.memtrace,
        &image.fixtures,
        &checker,
        image.python.as_deref(),
        &src.join("leak.py"),
        &work,
        Some(opts),
    );
    let out = Command::new("sh")
        .arg(src.join("smoke.sh"))
        .envs(vars.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .output()
        .context("running the smoke suite on the host")?;
    let text = String::from_utf8_lossy(&out.stdout);
    std::fs::write(dir.join("console.log"), text.as_bytes())?;
    let uname = Command::new("uname")
        .arg("-r")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    Ok(Row {
        label: format!("host {uname}"),
        problem: None,
        results: text.lines().filter_map(parse_result_line).collect(),
        missing: None,
    })
}

fn kernel_row(spec: &KernelSpec, image: &Image, opts: &SmokeOpts, args: &TestArgs) -> Row {
    let guest = Guest {
        name: spec.name,
        suite: spec.suite,
        dir: kernels_dir().join(spec.name),
        accel: &args.accel,
        timeout: Duration::from_secs(args.boot_timeout),
        keep: args.keep,
    };
    guest.row(
        fetch_kernel(spec),
        image,
        opts,
        &|vmlinuz, initrd, log, accel, timeout| {
            boot_vm(vmlinuz, initrd, log, accel, timeout, false)
        },
    )
}

/// Boots one guest of an architecture: (vmlinuz, initramfs, console log,
/// accelerator, timeout) to what its console showed.
pub type BootFn<'a> = dyn Fn(&Path, &Path, &Path, &str, Duration) -> Result<Boot> + 'a;

/// One row's guest: where its files go and how long and how it boots.
pub struct Guest<'a> {
    /// The row's name (a kernel of the matrix, maybe with its CPU).
    pub name: &'a str,
    pub suite: &'a str,
    /// Its directory: console.log, and vm/ (the initramfs) while it runs.
    pub dir: PathBuf,
    pub accel: &'a str,
    pub timeout: Duration,
    pub keep: bool,
}

impl Guest<'_> {
    /// Boots the fetched kernel with the smoke suite: once more when it never
    /// reached /init, and once more on single-threaded TCG when it ended early.
    fn row(
        &self,
        fetched: Result<Fetched>,
        image: &Image,
        opts: &SmokeOpts,
        boot_once: &BootFn,
    ) -> Row {
        let label = |extra: &str| format!("{} ({}{extra})", self.name, self.suite);
        let fetched = match fetched {
            Ok(f) => f,
            Err(err) => {
                eprintln!("xtask: kernel {}: {err:#}", self.name);
                return Row {
                    label: label(""),
                    problem: Some(format!("no kernel: {err:#}")),
                    results: Vec::new(),
                    missing: None,
                };
            }
        };
        let dir = &self.dir;
        let log = dir.join("console.log");
        let result = (|| -> Result<Boot> {
            let vm = dir.join("vm");
            std::fs::create_dir_all(&vm)?;
            let initrd = image.with_mode(&vm, &Mode::Smoke(opts.clone()))?;
            eprintln!(
                "xtask: booting {} ({}), console in {}",
                self.name,
                fetched.label,
                log.display()
            );
            let timeout = self.timeout;
            let mut boot = boot_once(&fetched.vmlinuz, &initrd, &log, self.accel, timeout)?;
            if !boot.reached_init {
                eprintln!(
                    "xtask: {} never reached /init ({}); retrying once",
                    self.name,
                    boot.panic_line()
                );
                boot = boot_once(&fetched.vmlinuz, &initrd, &log, self.accel, timeout)?;
            }
            if boot.reached_init && !boot.finished && !boot.timed_out && self.accel == "tcg" {
                // A guest Oops mid-suite (seen: `int3` in the scheduler while the
                // kernel patches its own code) is multi-threaded TCG's
                // cross-modifying code, not memtrace: once more on one host thread.
                eprintln!(
                    "xtask: {} ended early ({}); retrying once with single-threaded TCG",
                    self.name,
                    boot.panic_line()
                );
                boot = boot_once(&fetched.vmlinuz, &initrd, &log, "tcg-single", timeout)?;
            }
            if !self.keep {
                let _ = std::fs::remove_dir_all(&vm);
            }
            Ok(boot)
        })();
        let version = fetched
            .label
            .split_whitespace()
            .nth(1)
            .map(|v| format!(" {v}"))
            .unwrap_or_default();
        match result {
            Err(err) => Row {
                label: label(&version),
                problem: Some(format!("boot failed: {err:#}")),
                results: Vec::new(),
                missing: None,
            },
            Ok(boot) if !boot.reached_init => Row {
                label: label(&version),
                problem: Some(format!(
                    "boot failed: twice before /init: {}",
                    boot.panic_line()
                )),
                results: Vec::new(),
                missing: None,
            },
            Ok(boot) => {
                eprintln!("xtask: {}: {}", self.name, boot.summary());
                let missing = (!boot.finished).then(|| {
                    if boot.timed_out {
                        format!("the VM timed out after {} s", boot.secs)
                    } else {
                        format!("the VM ended early: {}", boot.panic_line())
                    }
                });
                Row {
                    label: label(&version),
                    problem: None,
                    results: boot.results,
                    missing,
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Report assertions (matrix-check)
// ---------------------------------------------------------------------------

fn sites(report: &Value) -> impl Iterator<Item = &Value> {
    report["sites"].as_array().into_iter().flatten()
}

fn symbols(site: &Value) -> Vec<&str> {
    site["frames"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| f["symbol"].as_str().unwrap_or("??"))
        .collect()
}

fn python_frames(site: &Value) -> Vec<&str> {
    site["frames"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["kind"] == "python")
        .map(|f| f["symbol"].as_str().unwrap_or("??"))
        .collect()
}

fn live(site: &Value) -> (u64, u64) {
    (
        site["live_bytes"].as_u64().unwrap_or(0),
        site["live_count"].as_u64().unwrap_or(0),
    )
}

fn sum<'a>(it: impl Iterator<Item = &'a Value>) -> (u64, u64) {
    it.map(live).fold((0, 0), |(b, c), (x, y)| (b + x, c + y))
}

fn parse_pair(text: &str) -> Result<(u64, u64), String> {
    let (b, c) = text
        .split_once('/')
        .ok_or_else(|| format!("bad BYTES/COUNT {text:?}"))?;
    Ok((
        b.parse().map_err(|_| format!("bad bytes {b:?}"))?,
        c.parse().map_err(|_| format!("bad count {c:?}"))?,
    ))
}

/// Checks one assertion on a report: Ok(a short note) or Err(why not).
pub fn check_assertion(report: &Value, assertion: &str) -> Result<String, String> {
    if let Some(rest) = assertion.strip_prefix("site:") {
        let (sym, want) = rest
            .split_once('=')
            .ok_or_else(|| format!("bad assertion {assertion:?}"))?;
        let want = parse_pair(want)?;
        let got = sum(sites(report).filter(|s| symbols(s).first() == Some(&sym)));
        return if got == want {
            Ok(format!("{sym} {}/{}", got.0, got.1))
        } else {
            Err(format!(
                "{sym}: {}/{} live, expected {}/{}",
                got.0, got.1, want.0, want.1
            ))
        };
    }
    if let Some(rest) = assertion.strip_prefix("chain:") {
        let (sym, chain) = rest
            .split_once('=')
            .ok_or_else(|| format!("bad assertion {assertion:?}"))?;
        let chain: Vec<&str> = chain.split(',').collect();
        let candidates: Vec<Vec<&str>> = sites(report)
            .map(symbols)
            .filter(|s| s.first() == Some(&sym))
            .collect();
        return if candidates.iter().any(|s| s.starts_with(&chain)) {
            Ok(format!(
                "{sym} stack reaches {}",
                chain.last().unwrap_or(&"")
            ))
        } else {
            let seen = candidates
                .first()
                .map(|s| s.iter().take(10).copied().collect::<Vec<_>>().join(" < "))
                .unwrap_or_else(|| "no such site".to_string());
            Err(format!("{sym}: stack is not {}: {seen}", chain.join(" < ")))
        };
    }
    if assertion == "nostacks" {
        let n = sites(report).count();
        let with = sites(report).filter(|s| !symbols(s).is_empty()).count();
        return if n > 0 && with == 0 {
            Ok(format!("{n} sites without frames"))
        } else {
            Err(format!("{with} of {n} sites have frames"))
        };
    }
    if let Some(rest) = assertion.strip_prefix("total:") {
        let (alloc, min) = rest
            .split_once(">=")
            .ok_or_else(|| format!("bad assertion {assertion:?}"))?;
        let min: u64 = min.parse().map_err(|_| format!("bad number {min:?}"))?;
        let got: u64 = report["totals"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|t| t["allocator"] == alloc)
            .map(|t| t["live_bytes"].as_u64().unwrap_or(0))
            .sum();
        return if got >= min {
            Ok(format!("{alloc} {got} B"))
        } else {
            Err(format!("{alloc}: {got} B live, expected >= {min}"))
        };
    }
    if let Some(rest) = assertion.strip_prefix("py:") {
        let (frames, want) = rest
            .split_once(">=")
            .ok_or_else(|| format!("bad assertion {assertion:?}"))?;
        let want = parse_pair(want)?;
        let frames: Vec<&str> = frames.split(',').collect();
        let got = sum(sites(report).filter(|s| python_frames(s).starts_with(&frames)));
        return if got.0 >= want.0 && got.1 >= want.1 {
            Ok(format!("python {} {}/{}", frames.join("<"), got.0, got.1))
        } else {
            let any: Vec<String> = sites(report)
                .map(python_frames)
                .filter(|f| !f.is_empty())
                .take(3)
                .map(|f| f.join("<"))
                .collect();
            Err(format!(
                "python {}: {}/{} live, expected >= {}/{} (python stacks seen: {})",
                frames.join("<"),
                got.0,
                got.1,
                want.0,
                want.1,
                if any.is_empty() {
                    "none".to_string()
                } else {
                    any.join("; ")
                }
            ))
        };
    }
    if let Some(rest) = assertion.strip_prefix("leak:") {
        // A key of `leak_check` (dotted path): a string, or an amount as
        // bytes/blocks.
        let (path, want) = rest
            .split_once('=')
            .ok_or_else(|| format!("bad assertion {assertion:?}"))?;
        let value = path
            .split('.')
            .fold(&report["leak_check"], |value, key| &value[key]);
        let got = match value {
            Value::String(text) => text.clone(),
            Value::Object(amount) if amount.contains_key("bytes") => format!(
                "{}/{}",
                amount["bytes"].as_u64().unwrap_or(0),
                amount["blocks"].as_u64().unwrap_or(0)
            ),
            other => other.to_string(),
        };
        return if got == want {
            Ok(format!("{path} {got}"))
        } else {
            Err(format!("leak_check.{path}: {got}, expected {want}"))
        };
    }
    if let Some(text) = assertion.strip_prefix("!note:") {
        let found = report["notes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .find(|note| note.contains(text));
        return match found {
            None => Ok(format!("no note of {text:?}")),
            Some(note) => Err(format!("note: {note}")),
        };
    }
    if let Some(min) = assertion.strip_prefix("processes>=") {
        let min: usize = min.parse().map_err(|_| format!("bad number {min:?}"))?;
        let n = report["processes"].as_array().map_or(0, Vec::len);
        return if n >= min {
            Ok(format!("{n} processes"))
        } else {
            Err(format!("{n} processes in the report, expected >= {min}"))
        };
    }
    Err(format!("unknown assertion {assertion:?}"))
}

/// The guest kernel's command line: the runner's own, then whatever
/// `MEMTRACE_VM_APPEND` adds (e.g. `preempt=none` to compare preemption
/// models of one kernel build).
fn kernel_command_line() -> String {
    kernel_command_line_for("ttyS0")
}

/// [`kernel_command_line`] with the serial console `console` (ttyS0, ttyAMA0).
fn kernel_command_line_for(console: &str) -> String {
    let base = format!("console={console} panic=-1 quiet rdinit=/init");
    match std::env::var("MEMTRACE_VM_APPEND") {
        Ok(extra) if !extra.trim().is_empty() => format!("{base} {}", extra.trim()),
        _ => base,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn result_lines_parse_with_console_noise() {
        assert_eq!(
            parse_result_line("MATRIX launch PASS leak_a 4800/100, leak_b 10000/10"),
            Some(CheckResult {
                check: "launch".into(),
                status: Status::Pass,
                detail: "leak_a 4800/100, leak_b 10000/10".into()
            })
        );
        let r = parse_result_line("[   12.3] random: crng init MATRIX fp FAIL exit 1: too large")
            .expect("parsed");
        assert_eq!(r.status, Status::Fail);
        assert_eq!(r.check, "fp");
        assert_eq!(r.detail, "exit 1: too large");
        assert_eq!(
            parse_result_line("MATRIX doctor SKIP").map(|r| r.status),
            Some(Status::Skip)
        );
        assert!(parse_result_line("MATRIX-INIT 6.1.0").is_none());
        assert!(parse_result_line("MATRIX launch MAYBE x").is_none());
        assert!(parse_result_line("nothing here").is_none());
    }

    #[test]
    fn markers_need_a_word_boundary() {
        assert_eq!(marker("MATRIX-EXIT 3", "MATRIX-EXIT"), Some(" 3"));
        assert_eq!(marker("MATRIX-DONE", "MATRIX-DONE"), Some(""));
        assert_eq!(marker("MATRIX-DONEX", "MATRIX-DONE"), None);
    }

    fn row(label: &str, results: &[(&str, Status, &str)]) -> Row {
        Row {
            label: label.into(),
            problem: None,
            results: results
                .iter()
                .map(|(c, s, d)| CheckResult {
                    check: (*c).into(),
                    status: *s,
                    detail: (*d).into(),
                })
                .collect(),
            missing: None,
        }
    }

    #[test]
    fn table_numbers_each_distinct_reason_once() {
        let checks: Vec<String> = ["launch", "fp", "pid"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let rows = vec![
            row(
                "6.1 (bookworm)",
                &[
                    ("launch", Status::Fail, "exit 1: stack size 544 | too large"),
                    ("fp", Status::Fail, "exit 1: stack size 544 | too large"),
                    ("pid", Status::Skip, "not run"),
                ],
            ),
            row(
                "host",
                &[("launch", Status::Pass, "ok"), ("fp", Status::Pass, "ok")],
            ),
            Row {
                label: "sid (sid)".into(),
                problem: Some("no kernel: apt-get update failed".into()),
                results: vec![],
                missing: None,
            },
        ];
        let table = render_table(&rows, &checks);
        let expected = "\
| kernel | launch | fp | pid |
|---|---|---|---|
| 6.1 (bookworm) | FAIL [1] | FAIL [1] | not run [2] |
| host | PASS | PASS | FAIL [3] |
| sid (sid) | no kernel [4] | no kernel [4] | no kernel [4] |

1. exit 1: stack size 544 / too large
2. not run
3. no result: the suite printed none
4. no kernel: apt-get update failed
";
        assert_eq!(table, expected);
        assert_eq!(rows[0].failures(), 2);
        assert_eq!(rows[1].failures(), 0);
        assert_eq!(rows[2].failures(), 1);
    }

    #[test]
    fn apt_config_is_private() {
        let conf = apt_config_for(Path::new("/w/target/kernels/apt/sid"), "amd64");
        assert!(conf.contains("Dir::Etc \"/w/target/kernels/apt/sid/etc/\";"));
        assert!(conf.contains("Dir::Etc::parts \"apt.conf.d/\";"));
        assert!(conf.contains("Dir::State::status \"/w/target/kernels/apt/sid/state/status\";"));
        assert!(conf.contains("Dir::Cache \"/w/target/kernels/apt/sid/cache/\";"));
        assert!(conf.contains("Acquire::Check-Valid-Until \"false\";"));
        assert!(!conf.contains("/etc/apt"));
        assert_eq!(
            sources_list(
                "http://deb.debian.org/debian",
                "trixie-backports",
                Some(Path::new("/k.gpg"))
            ),
            "deb [signed-by=/k.gpg] http://deb.debian.org/debian trixie-backports main\n"
        );
        assert_eq!(
            sources_list("http://m/debian", "sid", None),
            "deb http://m/debian sid main\n"
        );
    }

    #[test]
    fn newest_image_of_the_series_is_picked() {
        let listing = "\
linux-image-6.1.0-9-cloud-amd64 - Linux 6.1 for x86-64 cloud
linux-image-6.1.0-41-cloud-amd64 - Linux 6.1 for x86-64 cloud
linux-image-6.1.0-41-cloud-amd64-dbg - Debug symbols
linux-image-6.1.0-41-cloud-amd64-unsigned - unsigned
linux-image-6.12.57+deb13-cloud-amd64 - Linux 6.12
";
        assert_eq!(
            pick_package_for(listing, "6.1.", "amd64"),
            Some("linux-image-6.1.0-41-cloud-amd64".into())
        );
        assert_eq!(
            pick_package_for(listing, "6.12.", "amd64"),
            Some("linux-image-6.12.57+deb13-cloud-amd64".into())
        );
        let seven = "\
linux-image-7.2.1+deb14-cloud-amd64 - meta
linux-binary-7.2.1+deb14-cloud-amd64 - image
linux-binary-7.1.4+deb14-cloud-amd64 - image
";
        assert_eq!(
            pick_package_for(seven, "7.", "amd64"),
            Some("linux-binary-7.2.1+deb14-cloud-amd64".into())
        );
        assert_eq!(pick_package_for(seven, "6.18.", "amd64"), None);
        assert_eq!(
            version_cmp("6.1.0-41", "6.1.0-9"),
            std::cmp::Ordering::Greater
        );
        assert_eq!(version_cmp("7.10", "7.9"), std::cmp::Ordering::Greater);
    }

    #[test]
    fn vmlinuz_is_found_in_both_package_layouts() {
        let image = "./\n./boot/\n./boot/System.map-6.1.0-41-cloud-amd64\n./boot/vmlinuz-6.1.0-41-cloud-amd64\n";
        assert_eq!(
            vmlinuz_member(image),
            Some("./boot/vmlinuz-6.1.0-41-cloud-amd64")
        );
        let binary = "./usr/lib/modules/7.2.13+deb14-cloud-amd64/kernel/x.ko\n\
                      ./usr/lib/modules/7.2.13+deb14-cloud-amd64/vmlinuz\n";
        assert_eq!(
            vmlinuz_member(binary),
            Some("./usr/lib/modules/7.2.13+deb14-cloud-amd64/vmlinuz")
        );
        assert_eq!(vmlinuz_member("./usr/share/doc/x\n"), None);
    }

    #[test]
    fn ldd_output_names_libraries_and_loader() {
        let text = "\tlinux-vdso.so.1 (0x00007ffc)\n\
                    \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f)\n\
                    \tlibmissing.so => not found\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n";
        assert_eq!(
            parse_ldd(text),
            vec![
                PathBuf::from("/lib/x86_64-linux-gnu/libgcc_s.so.1"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
        assert!(parse_ldd("\tstatically linked\n").is_empty());
    }

    #[test]
    fn env_file_quotes_values() {
        assert_eq!(shell_quote("/a/b-c.d"), "/a/b-c.d");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
        let text = env_file(
            "run",
            &[("CHECKS".into(), "a b".into()), ("X".into(), "/x".into())],
        );
        assert_eq!(
            text,
            "MATRIX_MODE=run\nCHECKS='a b'\nexport CHECKS\nX=/x\nexport X\n"
        );
    }

    #[test]
    fn assertions_check_exact_sites_chains_and_python() {
        let report = json!({
            "sites": [
                {"live_bytes": 4800, "live_count": 100,
                 "frames": [{"symbol": "leak_a"}, {"symbol": "main"}]},
                {"live_bytes": 1000010, "live_count": 10,
                 "frames": [{"symbol": "malloc"}, {"symbol": "render", "kind": "python"},
                            {"symbol": "handle", "kind": "python"}]},
            ],
            "totals": [{"allocator": "libc", "live_bytes": 1004810}],
            "processes": [{"pid": 1}]
        });
        assert!(check_assertion(&report, "site:leak_a=4800/100").is_ok());
        assert_eq!(
            check_assertion(&report, "site:leak_a=4800/101"),
            Err("leak_a: 4800/100 live, expected 4800/101".into())
        );
        assert!(check_assertion(&report, "chain:leak_a=leak_a,main").is_ok());
        let checked = serde_json::json!({"leak_check": {
            "mode": "snapshot",
            "definitely_lost": {"bytes": 2400, "blocks": 50},
            "before_attach": {"heap_walk": {"status": "complete"}}
        }});
        assert!(check_assertion(&checked, "leak:mode=snapshot").is_ok());
        assert!(check_assertion(&checked, "leak:definitely_lost=2400/50").is_ok());
        assert!(check_assertion(&checked, "leak:before_attach.heap_walk.status=complete").is_ok());
        assert_eq!(
            check_assertion(&checked, "leak:mode=stopped"),
            Err("leak_check.mode: snapshot, expected stopped".into())
        );
        assert!(check_assertion(&report, "chain:leak_a=leak_a,outer,main").is_err());
        assert!(check_assertion(&report, "py:render,handle>=1000000/10").is_ok());
        assert!(check_assertion(&report, "py:handle>=1/1").is_err());
        assert!(check_assertion(&report, "total:libc>=24760").is_ok());
        assert!(check_assertion(&report, "total:mmap>=1").is_err());
        assert!(check_assertion(&report, "nostacks").is_err());
        assert!(check_assertion(&report, "processes>=1").is_ok());
        assert!(check_assertion(&report, "processes>=3").is_err());
        assert!(check_assertion(&report, "bogus").is_err());
        let noted = json!({"notes": ["exec reports unavailable (refused)"]});
        assert!(check_assertion(&noted, "!note:exec reports").is_err());
        assert!(check_assertion(&noted, "!note:fork reports").is_ok());
        assert!(check_assertion(&report, "!note:exec reports").is_ok());
    }
}
