//! `--name NAME`: which processes a name means, at the start and while
//! tracing. A process has the name when its `comm` is NAME (the kernel keeps
//! 15 bytes of it: a longer NAME matches a comm that is its first 15 bytes),
//! or the basename of its `argv[0]` or of its executable is NAME. memtrace
//! itself, kernel threads and zombies never match.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use crate::monitor::sources::procfs;
use crate::target;

/// Finds the processes with a name, now and each time it is asked again.
pub struct NameWatch {
    name: String,
    /// Processes that did not match, by the comm they had then: one is only
    /// looked at again once its comm changes (an `exec`).
    rejected: HashMap<u32, String>,
    own: u32,
}

impl NameWatch {
    pub fn new(name: &str) -> Self {
        NameWatch {
            name: name.to_string(),
            rejected: HashMap::new(),
            own: std::process::id(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The running processes with the name, by ascending pid, leaving out
    /// those in `known`.
    pub fn find(&mut self, known: &BTreeSet<u32>) -> Vec<u32> {
        let proc_root = Path::new("/proc");
        let Ok(pids) = procfs::list_pids(proc_root) else {
            return Vec::new();
        };
        let listed: BTreeSet<u32> = pids.iter().copied().collect();
        self.rejected.retain(|pid, _| listed.contains(pid));
        let mut found = Vec::new();
        for pid in pids {
            if pid == self.own || known.contains(&pid) {
                continue;
            }
            // One read per process and poll in the steady state: the comm.
            let Ok(comm) = std::fs::read_to_string(format!("/proc/{pid}/comm")) else {
                continue;
            };
            let comm = comm.trim_end_matches('\n').to_string();
            if self.rejected.get(&pid) == Some(&comm) {
                continue;
            }
            let (_, argv0) = procfs::process_names(proc_root, pid);
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
            let exe_name = exe
                .as_deref()
                .and_then(Path::file_name)
                .and_then(|n| n.to_str());
            if has_name(&self.name, &comm, argv0.as_deref(), exe_name)
                && target::inspect(pid).is_ok()
            {
                self.rejected.remove(&pid);
                found.push(pid);
            } else {
                self.rejected.insert(pid, comm);
            }
        }
        found
    }
}

/// Whether a process with this comm, argv0 basename and executable basename
/// has the name `name`.
pub fn has_name(name: &str, comm: &str, argv0: Option<&str>, exe: Option<&str>) -> bool {
    !name.is_empty() && (procfs::name_matches(name, Some(comm), argv0) || exe == Some(name))
}

/// How long ago (ms) a process started, from its start time in clock ticks
/// since boot (`/proc/PID/stat`); `None` when the clock cannot be read.
pub fn started_ms_ago(start_ticks: u64) -> Option<u64> {
    // SAFETY: sysconf has no preconditions.
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks_per_s = u64::try_from(ticks_per_s).ok().filter(|&t| t > 0)?;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for clock_gettime to fill.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return None;
    }
    let now_ms =
        u64::try_from(ts.tv_sec).ok()? * 1000 + u64::try_from(ts.tv_nsec).ok()? / 1_000_000;
    Some(now_ms.saturating_sub(start_ticks.saturating_mul(1000) / ticks_per_s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_exact() {
        assert!(has_name("redis-server", "redis-server", None, None));
        assert!(has_name("python3", "python3", Some("python3"), None));
        // The executable's basename counts (argv0 rewritten, comm renamed).
        assert!(has_name(
            "smengine_demo",
            "worker-3",
            Some("[worker]"),
            Some("smengine_demo")
        ));
        // A comm the kernel cut at 15 bytes.
        assert!(has_name(
            "a_very_long_process_name",
            "a_very_long_pro",
            None,
            None
        ));
        // Prefixes and substrings are not the name.
        assert!(!has_name(
            "redis",
            "redis-server",
            Some("redis-server"),
            Some("redis-server")
        ));
        assert!(!has_name("", "", None, None));
    }

    #[test]
    fn this_process_is_found_by_its_name_only_when_not_excluded() {
        let exe = std::env::current_exe().expect("exe");
        let name = exe
            .file_name()
            .and_then(|n| n.to_str())
            .expect("name")
            .to_string();
        let mut watch = NameWatch::new(&name);
        // memtrace never traces itself.
        assert!(!watch.find(&BTreeSet::new()).contains(&std::process::id()));
        let start = target::start_time(std::process::id()).expect("start time");
        assert!(started_ms_ago(start).is_some());
    }
}
