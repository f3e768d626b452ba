//! The arm64 kernel matrix: `cargo xtask test-kernels --arch arm64` boots
//! Debian's `-cloud-arm64` kernels under `qemu-system-aarch64 -M virt -cpu
//! neoverse-n1` (TCG), and the newest once more on `-cpu max,pauth-impdef=on`
//! (pointer authentication), runs the smoke suite (tests/kernel-matrix/smoke.sh)
//! in each and prints the x86 matrix's table (also written to
//! `target/kernels/matrix-arm64.md`); `cargo xtask kernel-run --arch arm64
//! --kernel 6.1 -- CMD...` runs one command line in one of them.
//!
//! What is arm64's own lives here: the kernel rows, the QEMU command line and
//! where memtrace comes from (the dist binary, `crate::dist::build_binary`).
//! The initramfs is image.rs's. Fetching (a private apt with `APT::Architecture
//! "arm64"`, only `vmlinuz` kept, in `target/kernels/arm64/<name>`), booting with
//! its retries, the smoke suite, the report checks and the table are the x86
//! matrix's code (kernels.rs), shared.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::{
    fetch_kernel_for, kernel_command_line_for, kernels_dir, render_table, require_root,
    run_command_line, watch_console, Boot, Fetched, Guest, KernelSpec, Mode, Row, RunArgs,
    SmokeOpts, TestArgs, DEBIAN,
};
use crate::setup::{self, Need};

mod image;

/// The Rust target memtrace, the checker and the fixtures are built for.
pub const TARGET: &str = "aarch64-unknown-linux-gnu";

/// The checks of the arm64 matrix, in table order (smoke.sh's names).
pub const CHECKS: [&str; 10] = [
    "doctor",
    "launch",
    "pid",
    "dwarf",
    "python",
    "cuda",
    "acl",
    "forks",
    "hashed",
    "leakcheck",
];

/// The CPU of every row but the pointer-authentication one (Graviton 2, Ampere Altra).
const CPU: &str = "neoverse-n1";
/// QEMU's CPU with pointer authentication, its cheap (implementation-defined) algorithm.
const PAC_CPU: &str = "max,pauth-impdef=on";

/// A row of the arm64 matrix: a Debian kernel and the CPU QEMU emulates.
#[derive(Debug, Clone, Copy)]
pub struct Arm64Kernel {
    /// What `--kernels` names it by (and its directory under target/kernels/arm64).
    pub name: &'static str,
    pub spec: KernelSpec,
    pub cpu: &'static str,
}

impl Arm64Kernel {
    /// The row's name in the table and the messages.
    fn title(&self) -> String {
        if self.cpu == CPU {
            self.name.to_string()
        } else {
            format!("{}, -cpu {}", self.spec.name, self.cpu)
        }
    }
}

const fn kernel(name: &'static str, suite: &'static str, abi_prefix: &'static str) -> KernelSpec {
    KernelSpec {
        name,
        suite,
        mirrors: &[DEBIAN],
        abi_prefix,
    }
}

const NEWEST: KernelSpec = kernel("7.x", "trixie-backports", "7.");

/// The matrix's rows: bullseye 5.10 (openEuler 22.03's and Kunpeng's
/// series: the compat programs), bookworm 6.1, trixie 6.12, trixie-backports
/// 6.18 and the newest 7.x, then 7.x again with pointer authentication.
pub const KERNELS: &[Arm64Kernel] = &[
    Arm64Kernel {
        name: "5.10",
        spec: kernel("5.10", "bullseye", "5.10."),
        cpu: CPU,
    },
    Arm64Kernel {
        name: "6.1",
        spec: kernel("6.1", "bookworm", "6.1."),
        cpu: CPU,
    },
    Arm64Kernel {
        name: "6.12",
        spec: kernel("6.12", "trixie", "6.12."),
        cpu: CPU,
    },
    Arm64Kernel {
        name: "6.18",
        spec: kernel("6.18", "trixie-backports", "6.18."),
        cpu: CPU,
    },
    Arm64Kernel {
        name: "7.x",
        spec: NEWEST,
        cpu: CPU,
    },
    Arm64Kernel {
        name: "7.x-pac",
        spec: NEWEST,
        cpu: PAC_CPU,
    },
];

/// target/kernels/arm64: kernels, packages, the initramfs, console logs.
fn arm64_dir() -> PathBuf {
    kernels_dir().join("arm64")
}

fn find_kernel(name: &str) -> Result<&'static Arm64Kernel> {
    KERNELS.iter().find(|k| k.name == name).with_context(|| {
        format!(
            "unknown arm64 kernel {name:?} (kernels: {})",
            KERNELS.iter().map(|k| k.name).collect::<Vec<_>>().join(",")
        )
    })
}

/// The kernel of a row, from target/kernels/arm64/<name> or fetched through apt.
fn fetch(spec: &KernelSpec) -> Result<Fetched> {
    fetch_kernel_for(
        spec,
        "arm64",
        &arm64_dir().join(spec.name),
        &kernels_dir().join("apt-arm64"),
    )
}

/// The QEMU command line of one arm64 guest.
pub fn qemu_command(vmlinuz: &Path, initrd: &Path, cpu: &str, accel: &str) -> Result<Command> {
    let accel = match accel {
        "tcg" => "tcg,thread=multi",
        "tcg-single" => "tcg,thread=single",
        other => {
            bail!("unknown accelerator {other:?} for arm64 guests (tcg: this host is not arm64)")
        }
    };
    let mut cmd = Command::new("qemu-system-aarch64");
    cmd.args(["-M", "virt", "-cpu", cpu, "-accel", accel])
        .args(["-m", "2048", "-smp", "2", "-nographic", "-no-reboot"])
        // No network: virt's default NIC wants an iPXE ROM (ipxe-qemu, a
        // recommends this host does not install) and the suite needs none.
        .args(["-nic", "none"])
        .arg("-kernel")
        .arg(vmlinuz)
        .arg("-initrd")
        .arg(initrd)
        .arg("-append")
        .arg(kernel_command_line_for("ttyAMA0"));
    Ok(cmd)
}

fn boot(
    vmlinuz: &Path,
    initrd: &Path,
    log: &Path,
    cpu: &str,
    accel: &str,
    timeout: Duration,
    echo: bool,
) -> Result<Boot> {
    watch_console(
        qemu_command(vmlinuz, initrd, cpu, accel)?,
        log,
        timeout,
        echo,
    )
}

/// What every arm64 run needs first: root, the host packages, the Rust target.
fn prepare(task: &str) -> Result<()> {
    require_root(task)?;
    setup::ensure(Need::KernelsArm64)?;
    crate::ensure_rust_target(TARGET)
}

/// The aarch64 memtrace: `given`, or cross-built. A build that fails leaves a
/// stand-in that prints why and exits 1, so the boots, the guest userland and
/// the fixtures are still checked and every memtrace cell says why it failed.
fn memtrace_binary(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = given {
        return std::fs::canonicalize(path).with_context(|| format!("{}", path.display()));
    }
    match crate::dist::build_binary(crate::dist::DistArch::Arm64) {
        Ok(path) if path.is_file() => Ok(path),
        Ok(path) => image::stand_in(&format!("the build left no {}", path.display())),
        Err(err) => {
            eprintln!(
                "xtask: the {TARGET} memtrace did not build ({err:#}): every memtrace cell will fail"
            );
            // The command line is in the build's own output: keep the status.
            let text = format!("{err:#}");
            let status = text.rsplit("failed: ").next().unwrap_or(&text);
            image::stand_in(&format!(
                "cargo zigbuild --release -p memtrace --target {TARGET} failed ({status})"
            ))
        }
    }
}

/// `cargo xtask test-kernels --arch arm64`.
pub fn test_kernels(args: TestArgs) -> Result<()> {
    prepare("test-kernels --arch arm64")?;
    let started = Instant::now();
    let rows: Vec<&Arm64Kernel> = if args.kernels.is_empty() {
        KERNELS.iter().collect()
    } else {
        args.kernels
            .iter()
            .map(|k| find_kernel(k))
            .collect::<Result<_>>()?
    };
    let checks: Vec<String> = if args.checks.is_empty() {
        CHECKS.iter().map(|c| c.to_string()).collect()
    } else {
        for c in &args.checks {
            if !CHECKS.contains(&c.as_str()) {
                bail!("unknown arm64 check {c:?} (checks: {})", CHECKS.join(","));
            }
        }
        args.checks.clone()
    };
    let memtrace = memtrace_binary(args.memtrace.as_deref())?;
    let image = image::build(&memtrace, &[])?;
    let opts = SmokeOpts {
        checks: checks.join(","),
        full: args.full,
        check_timeout: args.check_timeout,
    };
    let mut table_rows: Vec<Row> = Vec::new();
    for k in rows {
        let title = k.title();
        let guest = Guest {
            name: &title,
            suite: k.spec.suite,
            dir: arm64_dir().join(k.name),
            accel: &args.accel,
            timeout: Duration::from_secs(args.boot_timeout),
            keep: args.keep,
        };
        let row_started = Instant::now();
        let row = guest.row(
            fetch(&k.spec),
            &image,
            &opts,
            &|vmlinuz, initrd, log, accel, timeout| {
                boot(vmlinuz, initrd, log, k.cpu, accel, timeout, false)
            },
        );
        eprintln!(
            "xtask: {title}: row took {} s",
            row_started.elapsed().as_secs()
        );
        super::print_row(Some(&row), &checks);
        table_rows.push(row);
    }
    let table = render_table(&table_rows, &checks);
    let elapsed = started.elapsed().as_secs();
    let text = format!(
        "# Kernel matrix (arm64)\n\n`cargo xtask test-kernels --arch arm64` ({elapsed} s, accel {}, \
         qemu-system-aarch64 -M virt -cpu {CPU}).\n\n{table}",
        args.accel
    );
    let out = kernels_dir().join("matrix-arm64.md");
    std::fs::write(&out, &text).with_context(|| format!("writing {}", out.display()))?;
    println!("\n{table}");
    eprintln!("xtask: wrote {} ({elapsed} s)", out.display());
    let failed: usize = table_rows.iter().map(Row::failures).sum();
    if failed > 0 {
        eprintln!("xtask: {failed} cell(s) of the arm64 kernel matrix failed");
        std::process::exit(1);
    }
    Ok(())
}

/// `cargo xtask kernel-run --arch arm64`: boots one kernel (a row's name or a
/// vmlinuz path, on neoverse-n1) and runs one command line inside; exits with
/// the command's status.
pub fn kernel_run(args: RunArgs) -> Result<()> {
    prepare("kernel-run --arch arm64")?;
    let (vmlinuz, name, cpu) = match Path::new(&args.kernel) {
        p if p.is_file() => (p.to_path_buf(), "custom", CPU),
        _ => {
            let k = find_kernel(&args.kernel)?;
            let fetched =
                fetch(&k.spec).with_context(|| format!("fetching arm64 kernel {}", k.name))?;
            (fetched.vmlinuz, k.name, k.cpu)
        }
    };
    let memtrace = memtrace_binary(args.memtrace.as_deref())?;
    let image = image::build(&memtrace, &args.include)?;
    let dir = arm64_dir().join(name).join("run");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let initrd = image.with_mode(&dir, &Mode::Run(run_command_line(&args.command)))?;
    let log = dir.join("console.log");
    eprintln!(
        "xtask: booting {} (-cpu {cpu}, {}), console in {}",
        vmlinuz.display(),
        args.accel,
        log.display()
    );
    let timeout = Duration::from_secs(args.timeout);
    let mut booted = boot(&vmlinuz, &initrd, &log, cpu, &args.accel, timeout, true)?;
    if !booted.reached_init {
        eprintln!("xtask: the kernel never reached /init; retrying once");
        booted = boot(&vmlinuz, &initrd, &log, cpu, &args.accel, timeout, true)?;
    }
    eprintln!("xtask: {}", booted.summary());
    match booted.exit_code {
        Some(0) => Ok(()),
        Some(code) => std::process::exit(code.clamp(1, 255)),
        None => bail!("the command did not finish: {}", booted.summary()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_the_issue_kernels_and_one_pac_run() {
        let names: Vec<&str> = KERNELS.iter().map(|k| k.name).collect();
        assert_eq!(names, ["5.10", "6.1", "6.12", "6.18", "7.x", "7.x-pac"]);
        let pac: Vec<&Arm64Kernel> = KERNELS.iter().filter(|k| k.cpu != CPU).collect();
        assert_eq!(pac.len(), 1);
        assert_eq!(
            pac[0].spec.name, "7.x",
            "the PAC run shares the newest kernel"
        );
        assert_eq!(pac[0].title(), "7.x, -cpu max,pauth-impdef=on");
        assert_eq!(KERNELS[0].title(), "5.10");
        assert!(find_kernel("5.4").is_err());
    }

    #[test]
    fn qemu_line_is_virt_tcg_with_the_pl011_console() {
        let cmd = qemu_command(Path::new("/k"), Path::new("/i"), CPU, "tcg").expect("tcg");
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let line = args.join(" ");
        assert!(line.starts_with(
            "-M virt -cpu neoverse-n1 -accel tcg,thread=multi -m 2048 -smp 2 -nographic -no-reboot -nic none -kernel /k -initrd /i -append console=ttyAMA0 panic=-1"
        ), "{line}");
        let single = qemu_command(Path::new("/k"), Path::new("/i"), PAC_CPU, "tcg-single")
            .expect("tcg-single");
        let line: Vec<String> = single
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(line
            .join(" ")
            .contains("-cpu max,pauth-impdef=on -accel tcg,thread=single"));
        assert!(qemu_command(Path::new("/k"), Path::new("/i"), CPU, "kvm").is_err());
    }

    #[test]
    fn arm64_images_are_picked_not_amd64() {
        let listing = "\
linux-image-6.1.0-41-cloud-amd64 - Linux 6.1 for x86-64 cloud
linux-image-6.1.0-41-cloud-arm64 - Linux 6.1 for arm64 cloud
linux-image-6.1.0-40-cloud-arm64 - Linux 6.1 for arm64 cloud
linux-image-6.1.0-41-cloud-arm64-dbg - Debug symbols
linux-image-6.1.0-41-arm64 - Linux 6.1 for 64-bit ARMv8
linux-binary-7.3.4+deb13-cloud-arm64 - image
linux-image-7.3.4+deb13-cloud-arm64 - meta
";
        assert_eq!(
            super::super::pick_package_for(listing, "6.1.", "arm64"),
            Some("linux-image-6.1.0-41-cloud-arm64".into())
        );
        assert_eq!(
            super::super::pick_package_for(listing, "7.", "arm64"),
            Some("linux-binary-7.3.4+deb13-cloud-arm64".into())
        );
        let conf = super::super::apt_config_for(Path::new("/w/apt-arm64/bookworm"), "arm64");
        assert!(conf.contains("APT::Architecture \"arm64\";"));
        assert!(conf.contains("APT::Architectures { \"arm64\"; };"));
        assert!(!conf.contains("amd64"));
    }
}
