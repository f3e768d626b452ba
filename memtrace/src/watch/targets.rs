//! Which processes the watch samples: one pid (the watch ends with it), the
//! lowest pid with a name (followed across its restarts), or every process
//! of a container, cgroup or pod (members join and leave; each is judged on its
//! own). The selections are the tracer's ([`crate::tracee::select`]).

use std::collections::BTreeSet;
use std::path::Path;

use crate::monitor::sources::procfs;
use crate::tracee::select::{Finder, Selector};
use crate::watch::args::WatchArgs;
use crate::watch::WatchError;

/// What `--pid`, `--name`, `--container`, `--cgroup` or `--pod` asked for.
pub enum Target {
    Pid(u32),
    Name(String),
    /// `--container`, `--cgroup` or `--pod`: every process of the selection.
    Selection(Finder),
}

impl Target {
    /// The target the options name; bad input is a usage error (one line).
    pub fn from_args(args: &WatchArgs) -> Result<Target, WatchError> {
        if let Some(pid) = args.pid {
            if !procfs::process_alive(Path::new("/proc"), pid) {
                return Err(WatchError::Usage(format!("no process with pid {pid}")));
            }
            return Ok(Target::Pid(pid));
        }
        if let Some(name) = args.name.as_deref().filter(|n| !n.is_empty()) {
            return Ok(Target::Name(name.to_string()));
        }
        if args.container.is_some() || args.cgroup.is_some() || args.pod.is_some() {
            let selector = Selector::from_args(
                None,
                args.container.as_deref(),
                args.cgroup.as_deref(),
                args.pod.as_deref(),
            )
            .map_err(|f| WatchError::Usage(f.message))?;
            if let Some(selector) = selector {
                return Ok(Target::Selection(Finder::new(selector)));
            }
        }
        Err(WatchError::Usage(
            "no target: give --pid PID, --name NAME, --container ID, --cgroup PATH or --pod NAMESPACE/NAME (see memtrace watch --help)"
                .into(),
        ))
    }

    /// `pid 1234`, `name redis-server`, `container 0123456789ab`, `cgroup PATH`,
    /// `pod NAMESPACE/NAME`.
    pub fn describe(&self) -> String {
        match self {
            Target::Pid(p) => format!("pid {p}"),
            Target::Name(n) => format!("name {n}"),
            Target::Selection(f) => f
                .selector()
                .what()
                .strip_prefix("in ")
                .map_or_else(|| f.selector().what(), str::to_string),
        }
    }

    /// Whether the watch goes on waiting when no process is left.
    pub fn waits(&self) -> bool {
        !matches!(self, Target::Pid(_))
    }

    /// Whether the target is one process at a time (`--pid`, `--name`).
    pub fn single(&self) -> bool {
        !matches!(self, Target::Selection(_))
    }

    /// Processes to start watching now, besides the live ones in `known`;
    /// `seen_before` says whether any process was watched already (a pid
    /// is watched once).
    pub fn find(&mut self, known: &BTreeSet<u32>, seen_before: bool) -> std::io::Result<Vec<u32>> {
        let proc_root = Path::new("/proc");
        match self {
            Target::Pid(pid) => Ok((!seen_before
                && known.is_empty()
                && procfs::process_alive(proc_root, *pid))
            .then_some(*pid)
            .into_iter()
            .collect()),
            Target::Name(name) => {
                if !known.is_empty() {
                    return Ok(Vec::new());
                }
                Ok(procfs::find_by_name(proc_root, name, std::process::id())?
                    .into_iter()
                    .take(1)
                    .collect())
            }
            Target::Selection(finder) => Ok(finder
                .find(known)
                .into_iter()
                .filter(|p| procfs::process_alive(proc_root, *p))
                .collect()),
        }
    }
}

/// Seconds since `pid` started (from `/proc/PID/stat` and `/proc/uptime`).
pub fn process_age_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    // Fields after the command: state is field 3, starttime field 22.
    let start_ticks: f64 = after.split_whitespace().nth(19)?.parse().ok()?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| (uptime - start_ticks / hz as f64).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_has_an_age() {
        assert!(process_age_s(std::process::id()).is_some_and(|a| a >= 0.0));
        assert!(process_age_s(u32::MAX).is_none());
    }
}
