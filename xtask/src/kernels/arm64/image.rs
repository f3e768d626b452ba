//! The arm64 guest's initramfs (`target/kernels/arm64/initramfs/base.cpio.gz`).
//!
//! Nothing of the x86 host can run in it, so its userland comes from Debian's
//! bookworm arm64 packages (fetched once through a private apt with
//! `APT::Architecture "arm64"`, kept in `target/kernels/arm64/debs`): static
//! busybox, glibc, libgcc/libstdc++, and CPython 3.11 (Debian's static,
//! stripped `python3.11` with its minimal stdlib). memtrace and the report
//! checker (this xtask, `xtask matrix-check`) are cross-built for
//! aarch64-unknown-linux-gnu, and the fixtures are tests/fixtures/Makefile's
//! `portable` set built by Debian's aarch64-linux-gnu cross compilers into
//! `target/fixtures-aarch64` (their `<sys/sdt.h>` from the arm64
//! systemtap-sdt-dev package). Files keep their host paths, as in the x86
//! image; the libraries are closed over `readelf -d`'s NEEDED entries (ldd
//! cannot run foreign binaries), taking what no package brings from the cross
//! toolchain's `/usr/aarch64-linux-gnu/lib`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use super::super::apt::PrivateApt;
use super::super::{deb_tar, is_elf, kernels_dir, set_mode, write_cpio, Image, Stage, DEBIAN};
use super::{arm64_dir, TARGET};

/// The suite of the guest's userland (glibc 2.36, the cross toolchain's).
const SUITE: &str = "bookworm";

/// Debian arm64 packages unpacked into the image.
const GUEST_DEBS: &[&str] = &[
    "busybox-static",
    "libc6",
    "libgcc-s1",
    "libstdc++6",
    // python3.11's own dependencies, then CPython (stdlib os.py, encodings).
    "zlib1g",
    "libexpat1",
    "libpython3.11-minimal",
    "python3.11-minimal",
];

/// Unpacked beside the image (`target/kernels/arm64/sysroot`) for the fixtures' build.
const SYSROOT_DEBS: &[&str] = &["systemtap-sdt-dev"];

/// What the packages' payload leaves out of the image (docs, locales, iconv modules).
const EXCLUDED: &[&str] = &[
    "--exclude=./usr/share",
    "--exclude=./usr/lib/aarch64-linux-gnu/gconv",
];

/// The Debian multiarch library folders a guest program is searched in.
const LIB_DIRS: &[&str] = &[
    "lib/aarch64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "lib",
    "usr/lib",
];

/// Where the cross toolchain keeps the aarch64 runtime it links against.
const CROSS_LIBS: &str = "/usr/aarch64-linux-gnu/lib";

/// CPython in the image (from python3.11-minimal).
const PYTHON: &str = "/usr/bin/python3.11";

/// The `<sys/sdt.h>` folder of the unpacked arm64 systemtap-sdt-dev.
fn sdt_include(sysroot: &Path) -> PathBuf {
    sysroot.join("usr/include/aarch64-linux-gnu")
}

/// Builds the arm64 base initramfs with `memtrace` (an aarch64 binary, or the
/// stand-in) and `includes` (host files or folders, at their host paths).
pub fn build(memtrace: &Path, includes: &[PathBuf]) -> Result<Image> {
    let guest_debs = fetch_debs(GUEST_DEBS)?;
    let sysroot = arm64_dir().join("sysroot");
    if !sdt_include(sysroot.as_path()).join("sys/sdt.h").is_file() {
        std::fs::create_dir_all(&sysroot)?;
        for deb in fetch_debs(SYSROOT_DEBS)? {
            deb_tar(&deb, &["-x"], &sysroot)
                .with_context(|| format!("unpacking {}", deb.display()))?;
        }
    }
    let fixtures = build_fixtures(&sysroot)?;
    let checker = build_checker()?;

    let dir = arm64_dir().join("initramfs");
    let root = dir.join("root");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    for d in [
        "bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "tmp", "run", "root", "matrix",
        "etc",
    ] {
        std::fs::create_dir_all(root.join(d))?;
    }
    for deb in &guest_debs {
        let mut args = vec!["-x"];
        args.extend_from_slice(EXCLUDED);
        deb_tar(deb, &args, &root).with_context(|| format!("unpacking {}", deb.display()))?;
    }
    let mut stage = Stage {
        root: root.clone(),
        elves: Vec::new(),
    };
    // The console must exist before /init runs, or init starts without stdout.
    let _ = Command::new("mknod")
        .arg(root.join("dev/console"))
        .args(["c", "5", "1"])
        .status();
    stage.put(memtrace)?;
    for entry in std::fs::read_dir(&fixtures)? {
        let path = entry?.path();
        if path.is_file() {
            stage.put(&path)?;
        }
    }
    stage.put_at(&checker, Path::new("/matrix/check"))?;
    let src = crate::root().join("tests/kernel-matrix");
    stage.put_at(&src.join("init"), Path::new("/init"))?;
    stage.put_at(&src.join("smoke.sh"), Path::new("/matrix/smoke.sh"))?;
    stage.put_at(&src.join("leak.py"), Path::new("/matrix/leak.py"))?;
    for inc in includes {
        let inc = std::fs::canonicalize(inc).with_context(|| format!("{}", inc.display()))?;
        if inc.is_dir() {
            stage.put_tree(&inc, &|_| true)?;
        } else {
            stage.put(&inc)?;
        }
    }
    let python = root.join(PYTHON.trim_start_matches('/'));
    let mut elves: Vec<PathBuf> = stage
        .elves
        .iter()
        .map(|p| root.join(p.strip_prefix("/").unwrap_or(p)))
        .collect();
    elves.push(root.join("matrix/check"));
    elves.push(python.clone());
    elves.push(root.join("bin/busybox"));
    let missing = close_needed(&root, &elves)?;
    if !missing.is_empty() {
        eprintln!(
            "xtask: arm64 image: no package or cross library has {}",
            missing.join(", ")
        );
    }
    for (interp, what) in [("lib/ld-linux-aarch64.so.1", "the aarch64 dynamic loader")] {
        if std::fs::symlink_metadata(root.join(interp)).is_err() {
            eprintln!("xtask: arm64 image: /{interp} ({what}) is missing");
        }
    }
    set_mode(&root.join("init"), 0o755)?;
    set_mode(&root.join("matrix/smoke.sh"), 0o755)?;
    let base = dir.join("base.cpio.gz");
    write_cpio(&root, &base)?;
    let size = std::fs::metadata(&base).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "xtask: arm64 initramfs {} ({} MiB compressed)",
        base.display(),
        size >> 20
    );
    Ok(Image {
        base,
        memtrace: memtrace.to_path_buf(),
        fixtures,
        python: python.is_file().then(|| PathBuf::from(PYTHON)),
    })
}

/// A `memtrace` that only says why there is no real one (exit 1): the
/// matrix then still boots every kernel and fails each memtrace cell with it.
pub fn stand_in(why: &str) -> Result<PathBuf> {
    let path = arm64_dir().join("memtrace-unbuilt");
    std::fs::create_dir_all(arm64_dir())?;
    let why = why.replace(['\n', '\''], " ");
    std::fs::write(
        &path,
        format!("#!/bin/sh\necho 'memtrace: no {TARGET} build: {why}' >&2\nexit 1\n"),
    )
    .with_context(|| format!("writing {}", path.display()))?;
    set_mode(&path, 0o755)?;
    Ok(path)
}

/// The .debs of `names` for the guest: cached in target/kernels/arm64/debs,
/// downloaded through the private bookworm arm64 apt when missing.
fn fetch_debs(names: &[&str]) -> Result<Vec<PathBuf>> {
    let dir = arm64_dir().join("debs");
    let mut apt: Option<PrivateApt> = None;
    let mut debs = Vec::new();
    for name in names {
        if let Some(deb) = cached_deb(&dir, name) {
            debs.push(deb);
            continue;
        }
        let apt = match apt.as_mut() {
            Some(apt) => apt,
            None => apt.insert(PrivateApt::open(
                &kernels_dir().join("apt-arm64").join(SUITE),
                "arm64",
                SUITE,
                &[DEBIAN],
            )?),
        };
        eprintln!("xtask: downloading {name} ({SUITE} arm64)");
        debs.push(apt.download(name, &dir)?);
    }
    Ok(debs)
}

/// The `NAME_VERSION_arm64.deb` of `name` in `dir`.
fn cached_deb(dir: &Path, name: &str) -> Option<PathBuf> {
    let prefix = format!("{name}_");
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.extension().is_some_and(|e| e == "deb")
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
        })
}

/// `make portable` of tests/fixtures with the aarch64 cross compilers into
/// target/fixtures-aarch64.
fn build_fixtures(sysroot: &Path) -> Result<PathBuf> {
    let out = crate::root().join("target/fixtures-aarch64");
    crate::run(
        Command::new("make")
            .args(["-s", "-C"])
            .arg(crate::root().join("tests/fixtures"))
            .arg(format!("OUT={}", out.display()))
            .args([
                "CC=aarch64-linux-gnu-gcc",
                "CXX=aarch64-linux-gnu-g++",
                "STRIP=aarch64-linux-gnu-strip",
                // Signed return addresses (paciasp/autiasp: hints, so no-ops
                // on CPUs without pointer authentication): the PAC row then
                // unwinds through them.
                "ARCH_CFLAGS=-mbranch-protection=standard",
            ])
            .arg(format!(
                "SDT_CFLAGS=-isystem {}",
                sdt_include(sysroot).display()
            ))
            .arg("portable"),
    )
    .context("cross-building the fixtures for aarch64")?;
    Ok(out)
}

/// The cargo target folder (CARGO_TARGET_DIR, relative to the workspace, or target/).
fn cargo_target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => crate::root().join(dir),
        None => crate::root().join("target"),
    }
}

/// This xtask cross-built for aarch64: the guest's `xtask matrix-check`.
fn build_checker() -> Result<PathBuf> {
    crate::run(
        Command::new("cargo")
            .current_dir(crate::root())
            .args([
                "build",
                "--release",
                "-q",
                "-p",
                "xtask",
                "--target",
                TARGET,
            ])
            .env(
                "CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER",
                "aarch64-linux-gnu-gcc",
            ),
    )
    .context("cross-building the report checker (xtask) for aarch64")?;
    Ok(cargo_target_dir().join(TARGET).join("release/xtask"))
}

/// What `readelf -d` says an ELF file needs: its NEEDED sonames and its
/// RUNPATH/RPATH folders (`$ORIGIN` is not expanded).
pub fn parse_dynamic(readelf: &str) -> (Vec<String>, Vec<String>) {
    let bracket = |line: &str| {
        let start = line.find('[')? + 1;
        let end = line[start..].find(']')? + start;
        Some(line[start..end].to_string())
    };
    let mut needed = Vec::new();
    let mut paths = Vec::new();
    for line in readelf.lines() {
        if line.contains("(NEEDED)") {
            needed.extend(bracket(line));
        } else if line.contains("(RUNPATH)") || line.contains("(RPATH)") {
            if let Some(list) = bracket(line) {
                paths.extend(list.split(':').filter(|p| !p.is_empty()).map(String::from));
            }
        }
    }
    (needed, paths)
}

/// Makes every library the ELF files in `elves` (paths inside `root`) need
/// resolvable in the guest, transitively: found in the image's library
/// folders or RUNPATH, else copied from the cross toolchain into
/// /lib/aarch64-linux-gnu. Returns what could not be found (`lib (by file)`).
fn close_needed(root: &Path, elves: &[PathBuf]) -> Result<Vec<String>> {
    let mut queue: Vec<PathBuf> = elves.iter().filter(|p| is_elf(p)).cloned().collect();
    let mut seen: Vec<PathBuf> = Vec::new();
    let mut missing = Vec::new();
    while let Some(elf) = queue.pop() {
        if seen.contains(&elf) {
            continue;
        }
        seen.push(elf.clone());
        let out = Command::new("aarch64-linux-gnu-readelf")
            .args(["-d", "-W"])
            .arg(&elf)
            .output()
            .context("running aarch64-linux-gnu-readelf")?;
        let (needed, runpath) = parse_dynamic(&String::from_utf8_lossy(&out.stdout));
        for lib in needed {
            let dirs = runpath
                .iter()
                .map(|d| d.trim_start_matches('/').to_string())
                .chain(LIB_DIRS.iter().map(|d| d.to_string()));
            let mut found = None;
            for d in dirs {
                let candidate = root.join(&d).join(&lib);
                if std::fs::symlink_metadata(&candidate).is_ok() {
                    found = Some(resolve_in(root, &candidate));
                    break;
                }
            }
            if found.is_none() {
                let cross = Path::new(CROSS_LIBS).join(&lib);
                if cross.is_file() {
                    let to = root.join("lib/aarch64-linux-gnu").join(&lib);
                    std::fs::create_dir_all(root.join("lib/aarch64-linux-gnu"))?;
                    std::fs::copy(&cross, &to)
                        .with_context(|| format!("copying {}", cross.display()))?;
                    found = Some(to);
                }
            }
            match found {
                Some(path) => queue.push(path),
                None => {
                    let by = elf.strip_prefix(root).unwrap_or(&elf).display().to_string();
                    missing.push(format!("{lib} (needed by /{by})"));
                }
            }
        }
    }
    Ok(missing)
}

/// `path` (inside `root`) with its symlinks followed inside `root`, not on the host.
fn resolve_in(root: &Path, path: &Path) -> PathBuf {
    let mut path = path.to_path_buf();
    for _ in 0..16 {
        let Ok(target) = std::fs::read_link(&path) else {
            return path;
        };
        path = if target.is_absolute() {
            root.join(target.strip_prefix("/").unwrap_or(&target))
        } else {
            path.parent().map_or(target.clone(), |d| d.join(&target))
        };
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readelf_dynamic_section_gives_needed_and_runpath() {
        let text = "\
Dynamic section at offset 0xfd80 contains 29 entries:
  Tag        Type                         Name/Value
 0x0000000000000001 (NEEDED)             Shared library: [libcudart.so.12]
 0x0000000000000001 (NEEDED)             Shared library: [libc.so.6]
 0x000000000000001d (RUNPATH)            Library runpath: [/w/target/fixtures-aarch64:/opt/x]
 0x000000000000000c (INIT)               0x5f0
";
        let (needed, runpath) = parse_dynamic(text);
        assert_eq!(needed, ["libcudart.so.12", "libc.so.6"]);
        assert_eq!(runpath, ["/w/target/fixtures-aarch64", "/opt/x"]);
        let (needed, runpath) = parse_dynamic("\nThere is no dynamic section in this file.\n");
        assert!(needed.is_empty() && runpath.is_empty());
        let (_, rpath) =
            parse_dynamic(" 0x000000000000000f (RPATH)              Library rpath: [/a]\n");
        assert_eq!(rpath, ["/a"]);
    }

    #[test]
    fn symlinks_resolve_inside_the_image() {
        let root = std::env::temp_dir().join(format!("xtask-arm64-{}", std::process::id()));
        let lib = root.join("lib/aarch64-linux-gnu");
        std::fs::create_dir_all(&lib).expect("mkdir");
        std::fs::write(lib.join("libz.so.1.2.13"), b"x").expect("write");
        let _ = std::fs::remove_file(lib.join("libz.so.1"));
        let _ = std::fs::remove_file(root.join("lib/ld.so"));
        std::os::unix::fs::symlink("libz.so.1.2.13", lib.join("libz.so.1")).expect("link");
        std::os::unix::fs::symlink("/lib/aarch64-linux-gnu/libz.so.1", root.join("lib/ld.so"))
            .expect("link");
        assert_eq!(
            resolve_in(&root, &lib.join("libz.so.1")),
            lib.join("libz.so.1.2.13")
        );
        assert_eq!(
            resolve_in(&root, &root.join("lib/ld.so")),
            lib.join("libz.so.1.2.13")
        );
        let _ = std::fs::remove_dir_all(&root);
    }
}
