//! The Debian packages each task needs (`demo`, `fixtures`, `test`, `bench`),
//! found cheaply (a program on PATH, a file, or dpkg's record) and the missing
//! ones installed with `apt-get install -y --no-install-recommends` (as root;
//! otherwise the task fails naming them and the command that installs them).

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Result};

use super::run;

/// How a package's presence is seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// A program on PATH.
    Command(&'static str),
    /// A file.
    File(&'static str),
    /// A shared library in the multiarch folder (/usr/lib/<arch>-linux-gnu).
    Lib(&'static str),
    /// dpkg lists the package as installed (no program or file tells).
    Dpkg,
}

/// A Debian package and how to see that it is there.
#[derive(Clone, Copy, Debug)]
pub struct Package {
    pub name: &'static str,
    pub probe: Probe,
}

const fn pkg(name: &'static str, probe: Probe) -> Package {
    Package { name, probe }
}

/// Building anything: cargo links through `cc`; the eBPF object, the
/// memtrace binary and the demo fixture (`make`).
const BUILD: &[Package] = &[
    pkg("make", Probe::Command("make")),
    pkg("gcc", Probe::Command("cc")),
    pkg("libc6-dev", Probe::File("/usr/include/stdio.h")),
];

/// Every C fixture (tests/fixtures/Makefile `all`): C++, the jemalloc
/// and mimalloc APIs, and `<sys/sdt.h>`.
const FIXTURES: &[Package] = &[
    pkg("g++", Probe::Command("g++")),
    pkg(
        "libjemalloc-dev",
        Probe::File("/usr/include/jemalloc/jemalloc.h"),
    ),
    pkg("libmimalloc-dev", Probe::File("/usr/include/mimalloc.h")),
    // <sys/sdt.h> of the USDT fixtures.
    pkg(
        "systemtap-sdt-dev",
        Probe::File("/usr/include/x86_64-linux-gnu/sys/sdt.h"),
    ),
];

/// What the tests run besides the fixtures.
/// Cross-building the fixtures for arm64 from x86-64 (memtrace itself is
/// linked by zig, dist.rs).
const CROSS_ARM64: &[Package] = &[
    pkg(
        "gcc-aarch64-linux-gnu",
        Probe::Command("aarch64-linux-gnu-gcc"),
    ),
    pkg(
        "g++-aarch64-linux-gnu",
        Probe::Command("aarch64-linux-gnu-g++"),
    ),
    pkg(
        "libc6-dev-arm64-cross",
        Probe::File("/usr/aarch64-linux-gnu/include/stdio.h"),
    ),
];

const TEST_TOOLS: &[Package] = &[
    // The real libcudart wheel (`python3 -m pip download`).
    pkg("python3", Probe::Command("python3")),
    pkg("python3-pip", Probe::Dpkg),
    // Debian's static, stripped python3.11 (Python frames, DWARF unwinding).
    pkg("python3.11", Probe::File("/usr/bin/python3.11")),
    // `go tool pprof` reads the pprof output.
    pkg("golang-go", Probe::Command("go")),
    pkg("prometheus", Probe::Command("prometheus")),
    pkg("bpftrace", Probe::Command("bpftrace")),
    pkg("util-linux", Probe::Command("setpriv")),
    // The visual tests: the HTML report in headless Chromium, --live in tmux.
    pkg("chromium", Probe::Command("chromium")),
    pkg("tmux", Probe::Command("tmux")),
    pkg(
        "fonts-dejavu-core",
        Probe::File("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"),
    ),
    // The allocators services ship with, traced in place.
    pkg("libjemalloc2", Probe::Lib("libjemalloc.so.2")),
    pkg("libgoogle-perftools4", Probe::Lib("libtcmalloc.so.4")),
    pkg("libmimalloc2.0", Probe::Lib("libmimalloc.so.2")),
    // The host's glibc debug files, which a container's own glibc must not
    // be symbolized from (tests/kernel/docker.rs).
    pkg("libc6-dbg", Probe::Dpkg),
    // The leak check's reference: its four totals are compared with
    // valgrind's on the same binaries (tests/kernel/leak.rs).
    pkg("valgrind", Probe::Command("valgrind")),
    // Real programs the leak check is compared with valgrind on, besides
    // python3.11 (tests/kernel/leak.rs): perl and mawk come with Debian.
    pkg("git", Probe::Command("git")),
];

/// The real container runtime and its test image (xtask/src/docker.rs):
/// the daemon (a docker client alone is not enough) and the image's root
/// file system.
const DOCKER: &[Package] = &[
    pkg("docker.io", Probe::Command("dockerd")),
    pkg("debootstrap", Probe::Command("debootstrap")),
];

/// The bench's peers and workloads (besides the fixtures it builds).
const BENCH_PEERS: &[Package] = &[
    pkg("bpftrace", Probe::Command("bpftrace")),
    pkg("bpfcc-tools", Probe::Command("memleak-bpfcc")),
    pkg("redis-server", Probe::Command("redis-server")),
    pkg("redis-tools", Probe::Command("redis-benchmark")),
    pkg("python3.11", Probe::File("/usr/bin/python3.11")),
    pkg("libjemalloc2", Probe::Lib("libjemalloc.so.2")),
    pkg("libgoogle-perftools4", Probe::Lib("libtcmalloc.so.4")),
    pkg("libmimalloc2.0", Probe::Lib("libmimalloc.so.2")),
];

/// The arm64 kernel matrix (`test-kernels --arch arm64`): QEMU for aarch64,
/// the cross toolchain for memtrace, its checker and the fixtures, and the
/// tools that turn Debian arm64 packages into an initramfs.
const KERNELS_ARM64: &[Package] = &[
    pkg("qemu-system-arm", Probe::Command("qemu-system-aarch64")),
    pkg(
        "gcc-aarch64-linux-gnu",
        Probe::Command("aarch64-linux-gnu-gcc"),
    ),
    pkg(
        "g++-aarch64-linux-gnu",
        Probe::Command("aarch64-linux-gnu-g++"),
    ),
    pkg(
        "binutils-aarch64-linux-gnu",
        Probe::Command("aarch64-linux-gnu-readelf"),
    ),
    pkg("dpkg", Probe::Command("dpkg-deb")),
    pkg("cpio", Probe::Command("cpio")),
    pkg("debian-archive-keyring", Probe::Dpkg),
];

/// `cargo xtask dist` and its checks: pip for zig and cargo-zigbuild,
/// GNU tar and sha256sum for the tarballs, Debian's rpm to list an `.rpm`,
/// debootstrap for the bullseye root the binaries are proven in, and
/// qemu-user for running the arm64 binary against arm64 glibc there.
const DIST: &[Package] = &[
    pkg("python3", Probe::Command("python3")),
    pkg("python3-pip", Probe::Dpkg),
    pkg("tar", Probe::Command("tar")),
    pkg("coreutils", Probe::Command("sha256sum")),
    pkg("rpm", Probe::Command("rpm")),
    pkg("dpkg", Probe::Command("dpkg-deb")),
    pkg("debootstrap", Probe::Command("debootstrap")),
    pkg("qemu-user-static", Probe::Command("qemu-aarch64-static")),
];

/// `cargo xtask docs`: the pictures of the guide, the HTML report in
/// headless Chromium and `--live` in tmux (mdBook comes from cargo).
const DOCS: &[Package] = &[
    pkg("chromium", Probe::Command("chromium")),
    pkg("tmux", Probe::Command("tmux")),
    pkg(
        "fonts-dejavu-core",
        Probe::File("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"),
    ),
];

/// A task whose packages are ensured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// `cargo xtask demo`: the eBPF object, memtrace, the leaky_demo fixture.
    Demo,
    /// `cargo xtask fixtures`: every C fixture.
    Fixtures,
    /// `cargo xtask test`: the fixtures and every tool the tests run.
    Test,
    /// `cargo xtask test-image`: Docker and debootstrap.
    TestImage,
    /// `cargo xtask bench`: the fixtures and the bench's peers.
    Bench,
    /// `cargo xtask bench --no-install`: the fixtures only.
    BenchNoPeers,
    /// `cargo xtask test-kernels --arch arm64` (and `kernel-run --arch arm64`).
    KernelsArm64,
    /// `cargo xtask dist` and the checks of its artifacts.
    Dist,
    /// `cargo xtask docs`: the demo's build and the pictures' tools.
    Docs,
}

impl Need {
    fn task(self) -> &'static str {
        match self {
            Need::Demo => "demo",
            Need::Fixtures => "fixtures",
            Need::Test => "test",
            Need::TestImage => "test-image",
            Need::Bench | Need::BenchNoPeers => "bench",
            Need::KernelsArm64 => "test-kernels --arch arm64",
            Need::Dist => "dist",
            Need::Docs => "docs",
        }
    }

    /// The packages, each once, in install order.
    pub fn packages(self) -> Vec<Package> {
        let groups: &[&[Package]] = match self {
            Need::Demo => &[BUILD],
            Need::Fixtures | Need::BenchNoPeers => &[BUILD, FIXTURES],
            // The arm64 placement, CFI and USDT unit tests read cross-built code.
            Need::Test => &[BUILD, FIXTURES, TEST_TOOLS, DOCKER, CROSS_ARM64, DIST],
            Need::TestImage => &[DOCKER],
            Need::Bench => &[BUILD, FIXTURES, BENCH_PEERS],
            Need::KernelsArm64 => &[BUILD, KERNELS_ARM64],
            Need::Dist => &[BUILD, DIST],
            Need::Docs => &[BUILD, DOCS],
        };
        let mut out: Vec<Package> = Vec::new();
        for package in groups.iter().flat_map(|g| g.iter()) {
            if !out.iter().any(|p| p.name == package.name) {
                out.push(*package);
            }
        }
        out
    }
}

/// The packages of `need` that `present` says are missing.
pub fn missing(need: Need, present: impl Fn(&Package) -> bool) -> Vec<&'static str> {
    need.packages()
        .iter()
        .filter(|p| !present(p))
        .map(|p| p.name)
        .collect()
}

/// `name` on PATH (what `command -v` finds for a program).
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

/// This machine's answer for one package.
fn present(package: &Package) -> bool {
    match package.probe {
        Probe::Command(name) => on_path(name).is_some(),
        Probe::File(path) => Path::new(path).exists(),
        Probe::Lib(name) => Path::new(&format!("/usr/lib/{}-linux-gnu", std::env::consts::ARCH))
            .join(name)
            .exists(),
        Probe::Dpkg => Command::new("dpkg-query")
            .args(["-W", "-f", "${Status}", package.name])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).ends_with(" installed")),
    }
}

/// Whether apt has package lists (a fresh container has none).
fn apt_lists() -> bool {
    std::fs::read_dir("/var/lib/apt/lists").is_ok_and(|dir| {
        dir.filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().contains("_Packages"))
    })
}

/// Runs apt-get, its output on stderr: a task's stdout is its own (`cargo
/// xtask bench --section` prints Markdown there).
fn apt_get(args: &[&str]) -> Result<()> {
    let mut command = Command::new("apt-get");
    command.args(args).env("DEBIAN_FRONTEND", "noninteractive");
    if let Ok(stderr) = std::io::stderr().as_fd().try_clone_to_owned() {
        command.stdout(std::process::Stdio::from(stderr));
    }
    run(&mut command)
}

/// Installs what `need` lacks; fails naming the packages and the command
/// when it cannot (not root, or no apt-get).
pub fn ensure(need: Need) -> Result<()> {
    let lacking = missing(need, present);
    if lacking.is_empty() {
        return Ok(());
    }
    let list = lacking.join(" ");
    let install = ["install", "-y", "--no-install-recommends"];
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root || on_path("apt-get").is_none() {
        eprintln!(
            "xtask: `cargo xtask {}` needs Debian packages that are missing: {list}; install them with: {}apt-get {} {list}",
            need.task(),
            if root { "" } else { "sudo " },
            install.join(" "),
        );
        if root {
            bail!("missing Debian packages ({list}) and no apt-get to install them");
        }
        bail!("missing Debian packages ({list}); run as root to have them installed");
    }
    eprintln!(
        "xtask: installing Debian packages for `cargo xtask {}`: {list}",
        need.task()
    );
    let args: Vec<&str> = install.iter().copied().chain(lacking).collect();
    let mut updated = false;
    if !apt_lists() {
        apt_get(&["update"])?;
        updated = true;
    }
    if let Err(err) = apt_get(&args) {
        if updated {
            return Err(err);
        }
        // Stale lists name versions the mirror no longer has.
        eprintln!("xtask: apt-get install failed ({err:#}); updating the lists and retrying");
        apt_get(&["update"])?;
        apt_get(&args)?;
    }
    let still = missing(need, present);
    if !still.is_empty() {
        bail!(
            "apt-get installed {list}, but these are still not found: {}",
            still.join(" ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(need: Need) -> Vec<&'static str> {
        need.packages().iter().map(|p| p.name).collect()
    }

    #[test]
    fn nothing_missing_when_everything_is_present() {
        for need in [
            Need::Demo,
            Need::Fixtures,
            Need::Test,
            Need::TestImage,
            Need::Bench,
            Need::BenchNoPeers,
            Need::KernelsArm64,
            Need::Docs,
        ] {
            assert!(missing(need, |_| true).is_empty(), "{need:?}");
        }
    }

    #[test]
    fn the_demo_needs_only_the_build() {
        assert_eq!(missing(Need::Demo, |_| false), ["make", "gcc", "libc6-dev"]);
        // A fresh machine with a compiler but no jemalloc headers: the demo
        // installs nothing.
        let no_jemalloc = |p: &Package| p.name != "libjemalloc-dev";
        assert!(missing(Need::Demo, no_jemalloc).is_empty());
        assert_eq!(missing(Need::Test, no_jemalloc), ["libjemalloc-dev"]);
        assert_eq!(missing(Need::Fixtures, no_jemalloc), ["libjemalloc-dev"]);
    }

    #[test]
    fn test_and_bench_include_the_fixtures_build() {
        let fixtures = names(Need::Fixtures);
        for need in [Need::Test, Need::Bench, Need::BenchNoPeers] {
            let all = names(need);
            for name in &fixtures {
                assert!(all.contains(name), "{need:?} lacks {name}");
            }
        }
        assert_eq!(names(Need::BenchNoPeers), fixtures);
    }

    #[test]
    fn each_package_is_listed_once() {
        for need in [Need::Test, Need::Bench, Need::KernelsArm64] {
            let all = names(need);
            let mut sorted = all.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), all.len(), "{need:?}: {all:?}");
        }
    }

    #[test]
    fn the_oracle_decides_per_probe() {
        // Only programs on PATH are present: files, libraries and dpkg
        // records are missing.
        let commands = |p: &Package| matches!(p.probe, Probe::Command(_));
        let test = missing(Need::Test, commands);
        assert!(test.contains(&"libc6-dev"));
        assert!(test.contains(&"python3.11"));
        assert!(test.contains(&"python3-pip"));
        assert!(test.contains(&"libgoogle-perftools4"));
        assert!(!test.contains(&"chromium"));
        assert!(test.contains(&"libc6-dbg"));
        assert!(!test.contains(&"docker.io"), "seen by its daemon on PATH");
        assert_eq!(
            missing(Need::TestImage, |_| false),
            ["docker.io", "debootstrap"]
        );
        let bench = missing(Need::Bench, commands);
        assert!(bench.contains(&"libmimalloc2.0"));
        assert!(!bench.contains(&"redis-tools"));
        assert!(!bench.contains(&"golang-go"), "not a bench package");
    }
}
