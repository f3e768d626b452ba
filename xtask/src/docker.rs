//! The real container runtime of the kernel suite (tests/kernel/docker.rs):
//! Debian's `docker.io` daemon, started when none answers and stopped again
//! by whoever started it ([`Daemon`]), and the test image
//! `memtrace-test/trixie:<hash>`, a `docker import` of a Debian trixie
//! root file system (`debootstrap --variant=minbase
//! --include=python3-minimal`, from the host's own Debian mirror) cached
//! under target/docker. No registry is needed. Its glibc and Python differ
//! from bookworm's, which is what makes symbols read from the wrong file
//! show in the tests.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use super::run;

/// The Debian release of the test image (glibc 2.41, python3.13).
const SUITE: &str = "trixie";
/// What `debootstrap` installs besides the minimal base.
const INCLUDE: &str = "python3-minimal";
/// Where apt's sources name the host's mirrors.
const SOURCES: &[&str] = &["/etc/apt/sources.list", "/etc/apt/sources.list.d"];
/// Used when the sources name no Debian archive.
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";

/// `dockerd`'s flags, tried in turn: none (as Debian's service starts it),
/// then without the bridge and its iptables rules, for a sandbox whose
/// network setup fails (the tests run containers with `--network none`).
const DAEMON_FLAGS: &[&[&str]] = &[&[], &["--iptables=false", "--bridge=none"]];

/// A Docker daemon that answers; the one this task started (if any) is
/// stopped on drop.
pub struct Daemon {
    started: Option<Child>,
}

impl Daemon {
    /// The daemon that answers `docker info`, else one started now (its
    /// output in `log`).
    pub fn ensure(log: &Path) -> Result<Daemon> {
        if answers() {
            return Ok(Daemon { started: None });
        }
        let mut failures = Vec::new();
        for flags in DAEMON_FLAGS {
            eprintln!(
                "xtask: starting {} (log: {})",
                ["dockerd"]
                    .iter()
                    .chain(flags.iter())
                    .copied()
                    .collect::<Vec<_>>()
                    .join(" "),
                log.display()
            );
            let out =
                fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
            let mut child = Command::new("dockerd")
                .args(*flags)
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out)
                .spawn()
                .context("cannot start dockerd (Debian package docker.io)")?;
            match wait_until_answering(&mut child, Duration::from_secs(60)) {
                Ok(()) => {
                    return Ok(Daemon {
                        started: Some(child),
                    })
                }
                Err(err) => {
                    stop(&mut child);
                    failures.push(format!("dockerd {}: {err:#}", flags.join(" ")));
                }
            }
        }
        bail!(
            "no Docker daemon answers and none could be started ({}); see {}",
            failures.join("; "),
            log.display()
        )
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(child) = self.started.as_mut() {
            eprintln!(
                "xtask: stopping the dockerd it started (pid {})",
                child.id()
            );
            stop(child);
        }
    }
}

/// Whether a Docker daemon answers the `docker` on PATH.
fn answers() -> bool {
    Command::new("docker")
        .arg("info")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn wait_until_answering(child: &mut Child, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        if answers() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!("exited ({status})");
        }
        if Instant::now() > deadline {
            bail!("did not answer `docker info` within {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// SIGTERM (dockerd stops its containers and the containerd it started),
/// SIGKILL after 30 s.
fn stop(child: &mut Child) {
    // SAFETY: kill with the pid of a child this process started and has
    // not reaped yet, and a valid signal.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The Debian archive the host's apt sources name (the first `deb` entry
/// that is not the security archive), for `debootstrap`.
pub fn host_mirror() -> String {
    let mut texts = Vec::new();
    for source in SOURCES {
        let path = Path::new(source);
        if path.is_dir() {
            let mut files: Vec<PathBuf> = fs::read_dir(path)
                .into_iter()
                .flatten()
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "list" || e == "sources"))
                .collect();
            files.sort();
            texts.extend(files.iter().filter_map(|f| fs::read_to_string(f).ok()));
        } else if let Ok(text) = fs::read_to_string(path) {
            texts.push(text);
        }
    }
    texts
        .iter()
        .find_map(|text| debian_mirror(text))
        .unwrap_or_else(|| DEFAULT_MIRROR.to_string())
}

/// The first Debian archive (a URI ending in `/debian`) named by an apt
/// sources file, in the one-line (`deb URI SUITE ...`) or the deb822
/// (`URIs: URI`) format.
fn debian_mirror(text: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.starts_with('#'))
        .flat_map(|line| {
            let uris = if let Some(rest) = line.strip_prefix("URIs:") {
                rest.split_whitespace().collect()
            } else if let Some(rest) = line.strip_prefix("deb ") {
                // Options in brackets come before the URI.
                let rest = match rest.trim_start().strip_prefix('[') {
                    Some(opts) => opts.split_once(']').map_or("", |(_, r)| r),
                    None => rest,
                };
                rest.split_whitespace().take(1).collect()
            } else {
                Vec::new()
            };
            uris.into_iter()
        })
        .map(|uri| uri.trim_end_matches('/'))
        .find(|uri| uri.ends_with("/debian"))
        .map(str::to_string)
}

/// The test image's recipe: what its root file system is built from.
fn recipe(mirror: &str) -> String {
    format!("debootstrap --variant=minbase --include={INCLUDE} {SUITE} {mirror}")
}

/// A stable short hash (FNV-1a, 64 bits) naming a recipe's cache and tag.
fn recipe_hash(recipe: &str) -> String {
    let hash = recipe.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{hash:016x}")[..12].to_string()
}

/// The test image `memtrace-test/trixie:<hash>`: imported into the daemon
/// when it lacks it, from the root file system cached under `cache` (built
/// by `debootstrap` when missing). Returns its name.
pub fn test_image(cache: &Path) -> Result<String> {
    let mirror = host_mirror();
    let recipe = recipe(&mirror);
    let hash = recipe_hash(&recipe);
    let tag = format!("memtrace-test/{SUITE}:{hash}");
    let present = Command::new("docker")
        .args(["image", "inspect", &tag])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if present {
        return Ok(tag);
    }
    let rootfs = cache.join(format!("{SUITE}-{hash}"));
    if !rootfs.join("usr/bin/python3").exists() {
        bootstrap(&rootfs, &mirror)?;
    }
    eprintln!("xtask: importing {} as {tag}", rootfs.display());
    let mut tar = Command::new("tar")
        .arg("-C")
        .arg(&rootfs)
        .args(["-c", "."])
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start tar")?;
    let stream = tar.stdout.take().context("tar's stdout")?;
    let imported = Command::new("docker")
        .args(["import", "--message", &recipe, "-", &tag])
        .stdin(stream)
        .stdout(Stdio::null())
        .status()
        .context("cannot start docker import");
    let packed = tar.wait()?;
    if !imported?.success() || !packed.success() {
        bail!("importing {} as {tag} failed", rootfs.display());
    }
    Ok(tag)
}

/// `debootstrap`s the test root file system into `rootfs` (through a
/// `.partial` directory, so an interrupted run leaves no half cache).
fn bootstrap(rootfs: &Path, mirror: &str) -> Result<()> {
    let partial = rootfs.with_extension("partial");
    let _ = fs::remove_dir_all(&partial);
    let _ = fs::remove_dir_all(rootfs);
    if let Some(parent) = rootfs.parent() {
        fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    eprintln!(
        "xtask: building the test image's root file system: {}",
        recipe(mirror)
    );
    run(Command::new("debootstrap")
        .args(["--variant=minbase", &format!("--include={INCLUDE}"), SUITE])
        .arg(&partial)
        .arg(mirror))?;
    fs::rename(&partial, rootfs)
        .with_context(|| format!("renaming {} to {}", partial.display(), rootfs.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mirror_comes_from_either_sources_format() {
        let deb822 = "Types: deb\n# http://snapshot.debian.org/archive/debian/2025\n\
                      URIs: http://deb.debian.org/debian\nSuites: bookworm\n\n\
                      Types: deb\nURIs: http://deb.debian.org/debian-security\n";
        assert_eq!(
            debian_mirror(deb822).as_deref(),
            Some("http://deb.debian.org/debian")
        );
        let one_line = "deb http://security.debian.org/debian-security bookworm-security main\n\
                        deb [arch=amd64 signed-by=/k.gpg] http://ftp.fr.debian.org/debian/ bookworm main\n";
        assert_eq!(
            debian_mirror(one_line).as_deref(),
            Some("http://ftp.fr.debian.org/debian")
        );
        // Other archives (and commented-out lines) are not Debian's.
        let others = "deb https://packages.cloud.google.com/apt cloud-sdk main\n\
                      # deb http://deb.debian.org/debian bookworm main\n\
                      URIs: https://deb.nodesource.com/node_20.x\n";
        assert_eq!(debian_mirror(others), None);
    }

    #[test]
    fn the_tag_follows_the_recipe() {
        let a = recipe_hash(&recipe("http://deb.debian.org/debian"));
        let b = recipe_hash(&recipe("http://ftp.fr.debian.org/debian"));
        assert_eq!(a.len(), 12);
        assert_ne!(a, b);
        assert_eq!(a, recipe_hash(&recipe("http://deb.debian.org/debian")));
    }
}
