//! A private apt for one Debian suite and architecture: its own `sources.list`,
//! lists, cache and state under one folder, `APT_CONFIG` pointing at a file that
//! reads none of the host's `apt.conf.d` (see [`super::apt_config_for`]). The
//! kernel matrices fetch their kernels (and the arm64 matrix its guest packages)
//! through it; the host's apt is never touched.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use super::{apt_config_for, last_line, sources_list};

/// A private apt whose lists are up to date for one suite.
pub struct PrivateApt {
    conf: PathBuf,
    suite: String,
}

impl PrivateApt {
    /// Lays out `base` for `arch` (`amd64`, `arm64`) and runs `apt-get update`
    /// against the first of `mirrors` that answers.
    pub fn open(base: &Path, arch: &str, suite: &str, mirrors: &[&str]) -> Result<Self> {
        for sub in [
            "etc/apt.conf.d",
            "etc/sources.list.d",
            "etc/preferences.d",
            "etc/trusted.gpg.d",
            "state/lists/partial",
            "cache/archives/partial",
            "log",
        ] {
            std::fs::create_dir_all(base.join(sub))
                .with_context(|| format!("creating {}", base.join(sub).display()))?;
        }
        if !base.join("state/status").exists() {
            std::fs::write(base.join("state/status"), "")?;
        }
        let conf = base.join("apt.conf");
        std::fs::write(&conf, apt_config_for(base, arch))?;
        let apt = PrivateApt {
            conf,
            suite: suite.to_string(),
        };
        let keyring = Path::new("/usr/share/keyrings/debian-archive-keyring.gpg");
        let keyring = keyring.is_file().then_some(keyring);
        let mut updated = Err(anyhow::anyhow!("no mirror"));
        for mirror in mirrors {
            std::fs::write(
                base.join("etc/sources.list"),
                sources_list(mirror, suite, keyring),
            )?;
            let out = apt
                .command("apt-get")
                .args(["update", "-q", "-o", "APT::Update::Error-Mode=any"])
                .output()
                .context("running apt-get update")?;
            if out.status.success() {
                updated = Ok(());
                break;
            }
            let err = String::from_utf8_lossy(&out.stderr);
            updated = Err(anyhow::anyhow!(
                "apt-get update of {} {} failed: {}",
                mirror,
                suite,
                last_line(&err)
            ));
        }
        updated?;
        Ok(apt)
    }

    /// `prog` (apt-get, apt-cache) run against this private configuration.
    pub fn command(&self, prog: &str) -> Command {
        let mut cmd = Command::new(prog);
        cmd.env("APT_CONFIG", &self.conf)
            .env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    }

    /// `apt-cache search --names-only PATTERN`.
    pub fn search(&self, pattern: &str) -> Result<String> {
        let out = self
            .command("apt-cache")
            .args(["search", "--names-only", pattern])
            .output()
            .context("running apt-cache search")?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The candidate version of `package` (empty when apt does not say).
    pub fn version(&self, package: &str) -> Result<String> {
        let show = self
            .command("apt-cache")
            .args(["show", "--no-all-versions", package])
            .output()
            .context("running apt-cache show")?;
        Ok(String::from_utf8_lossy(&show.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("Version: ").map(str::to_string))
            .unwrap_or_default())
    }

    /// `apt-get download PACKAGE` into `dir` (created); returns the .deb.
    pub fn download(&self, package: &str, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let out = self
            .command("apt-get")
            .current_dir(dir)
            .args(["download", "-q", package])
            .output()
            .context("running apt-get download")?;
        if !out.status.success() {
            bail!(
                "apt-get download {package} ({}) failed: {}",
                self.suite,
                last_line(&String::from_utf8_lossy(&out.stderr))
            );
        }
        // The .deb is named `PACKAGE_VERSION_ARCH.deb` (the version's epoch colon escaped).
        let prefix = format!("{package}_");
        std::fs::read_dir(dir)?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .find(|p| {
                p.extension().is_some_and(|e| e == "deb")
                    && p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
            })
            .with_context(|| format!("apt-get download {package} left no .deb"))
    }
}
