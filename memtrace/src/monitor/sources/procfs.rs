//! procfs readers: `/proc/PID/status` (Vm*/Rss* lines, threads), open fd
//! counts, `/proc/meminfo`, and finding processes by name. All values are
//! returned in bytes (the kernel's `kB` is multiplied by 1024).

use std::fs;
use std::path::{Path, PathBuf};

/// Fields of `/proc/PID/status` that are sampled, in output order.
pub const STATUS_KEYS: &[&str] = &[
    "VmRSS", "VmHWM", "VmSize", "VmData", "VmStk", "VmExe", "VmLib", "VmSwap", "RssAnon",
    "RssFile", "RssShmem",
];

/// Fields of `/proc/meminfo` that are sampled, in output order.
pub const MEMINFO_KEYS: &[&str] = &[
    "MemTotal",
    "MemFree",
    "MemAvailable",
    "Buffers",
    "Cached",
    "Shmem",
    "KReclaimable",
    "Slab",
    "SReclaimable",
    "SUnreclaim",
    "KernelStack",
    "PageTables",
];

/// Parses `Key:   value [kB]` lines; kB values become bytes.
pub fn parse_kv_kb(text: &str) -> Vec<(String, f64)> {
    text.lines()
        .filter_map(|line| {
            let (key, rest) = line.split_once(':')?;
            let mut words = rest.split_whitespace();
            let value: f64 = words.next()?.parse().ok()?;
            let scale = match words.next() {
                Some(unit) => crate::monitor::units::unit_multiplier(unit)?,
                None => 1.0,
            };
            Some((key.trim().to_string(), value * scale))
        })
        .collect()
}

/// Sampled figures of one process.
#[derive(Debug, Default, PartialEq)]
pub struct ProcessSample {
    /// `(key, bytes)` for the [`STATUS_KEYS`] present.
    pub memory: Vec<(String, f64)>,
    pub threads: Option<f64>,
    pub fds: Option<f64>,
}

/// Parses the text of `/proc/PID/status`. `None` for a zombie or a kernel
/// thread (no memory lines), which counts as "gone" for the monitor.
pub fn parse_status(text: &str) -> Option<ProcessSample> {
    let mut sample = ProcessSample::default();
    let mut zombie = false;
    for line in text.lines() {
        if let Some(state) = line.strip_prefix("State:") {
            zombie = matches!(state.trim().chars().next(), Some('Z') | Some('X'));
        }
    }
    if zombie {
        return None;
    }
    for (key, value) in parse_kv_kb(text) {
        if key == "Threads" {
            sample.threads = Some(value);
        } else if STATUS_KEYS.contains(&key.as_str()) {
            sample.memory.push((key, value));
        }
    }
    if sample.memory.is_empty() {
        return None;
    }
    sample
        .memory
        .sort_by_key(|(k, _)| STATUS_KEYS.iter().position(|s| s == k));
    Some(sample)
}

/// Reads one process. `None` when it is gone (or a zombie).
pub fn read_process(proc_root: &Path, pid: u32) -> Option<ProcessSample> {
    let dir = proc_root.join(pid.to_string());
    let text = fs::read_to_string(dir.join("status")).ok()?;
    let mut sample = parse_status(&text)?;
    sample.fds = fs::read_dir(dir.join("fd"))
        .ok()
        .map(|entries| entries.filter(|e| e.is_ok()).count() as f64);
    Some(sample)
}

/// True if `/proc/PID` exists and is not a zombie.
pub fn process_alive(proc_root: &Path, pid: u32) -> bool {
    fs::read_to_string(proc_root.join(pid.to_string()).join("status"))
        .ok()
        .and_then(|t| parse_status(&t))
        .is_some()
}

/// Parses `/proc/meminfo` into the sampled keys plus `MemUsed`
/// (MemTotal - MemAvailable), all in bytes.
pub fn parse_meminfo(text: &str) -> Vec<(String, f64)> {
    let all = parse_kv_kb(text);
    let get = |k: &str| all.iter().find(|(key, _)| key == k).map(|(_, v)| *v);
    let mut out: Vec<(String, f64)> = Vec::new();
    if let (Some(total), Some(avail)) = (get("MemTotal"), get("MemAvailable")) {
        out.push(("MemUsed".to_string(), total - avail));
    }
    for key in MEMINFO_KEYS {
        if let Some(v) = get(key) {
            out.push((key.to_string(), v));
        }
    }
    out
}

/// Reads `/proc/meminfo` under `proc_root`.
pub fn read_meminfo(proc_root: &Path) -> std::io::Result<Vec<(String, f64)>> {
    Ok(parse_meminfo(&fs::read_to_string(
        proc_root.join("meminfo"),
    )?))
}

// Process names and the pid list live with the selectors (`--name` of the
// tracer, the monitor and the watcher alike).
pub use crate::tracee::select::{list_pids, name_matches, process_names};

/// Live (non-zombie) processes named `name`, excluding `exclude`.
pub fn find_by_name(proc_root: &Path, name: &str, exclude: u32) -> std::io::Result<Vec<u32>> {
    Ok(list_pids(proc_root)?
        .into_iter()
        .filter(|pid| *pid != exclude)
        .filter(|pid| {
            let (comm, argv0) = process_names(proc_root, *pid);
            name_matches(name, comm.as_deref(), argv0.as_deref())
        })
        .filter(|pid| process_alive(proc_root, *pid))
        .collect())
}

/// Checks that a root directory can be listed.
pub fn check_root(path: &Path) -> std::io::Result<PathBuf> {
    fs::read_dir(path)?;
    Ok(path.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATUS: &str = "Name:\tcat\nUmask:\t0022\nState:\tR (running)\nTgid:\t2716\nNgid:\t0\nPid:\t2716\nPPid:\t2598\nTracerPid:\t0\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\nFDSize:\t256\nGroups:\t0 \nNStgid:\t2716\nNSpid:\t2716\nNSpgid:\t2716\nNSsid:\t2598\nKthread:\t0\nVmPeak:\t    5616 kB\nVmSize:\t    5616 kB\nVmLck:\t       0 kB\nVmPin:\t       0 kB\nVmHWM:\t    1792 kB\nVmRSS:\t    1792 kB\nRssAnon:\t       0 kB\nRssFile:\t    1792 kB\nRssShmem:\t       0 kB\nVmData:\t     360 kB\nVmStk:\t     132 kB\nVmExe:\t      20 kB\nVmLib:\t    1672 kB\nVmPTE:\t      52 kB\nVmSwap:\t       0 kB\nHugetlbPages:\t       0 kB\nCoreDumping:\t0\nTHP_enabled:\t1\nThreads:\t1\nSigQ:\t0/31503\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\nSigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\nSigCgt:\t0000000000000000\nCapInh:\t0000000000000000\nCapPrm:\t000001ffffffffff\nCapEff:\t000001ffffffffff\nCapBnd:\t000001ffffffffff\nCapAmb:\t0000000000000000\nNoNewPrivs:\t0\nSeccomp:\t0\nSeccomp_filters:\t0\nSpeculation_Store_Bypass:\tthread vulnerable\nSpeculationIndirectBranch:\tconditional enabled\nCpus_allowed:\tff\nCpus_allowed_list:\t0-7\nMems_allowed:\t00000000,00000001\nMems_allowed_list:\t0\nvoluntary_ctxt_switches:\t0\nnonvoluntary_ctxt_switches:\t0\n";

    const MEMINFO: &str = "MemTotal:        8029084 kB\nMemFree:          372348 kB\nMemAvailable:    5608720 kB\nBuffers:          227660 kB\nCached:          4913276 kB\nSwapCached:            0 kB\nActive:          2874564 kB\nInactive:        3993220 kB\nShmem:             54024 kB\nKReclaimable:     340376 kB\nSlab:             520016 kB\nSReclaimable:     340376 kB\nSUnreclaim:       179640 kB\nKernelStack:       10544 kB\nPageTables:        24408 kB\nHugePages_Total:       0\nHugepagesize:       2048 kB\n";

    #[test]
    fn status_fields_are_bytes() {
        let s = parse_status(STATUS).expect("sample");
        let get = |k: &str| s.memory.iter().find(|(key, _)| key == k).map(|(_, v)| *v);
        assert_eq!(get("VmRSS"), Some(1792.0 * 1024.0));
        assert_eq!(get("VmSize"), Some(5616.0 * 1024.0));
        assert_eq!(get("VmSwap"), Some(0.0));
        assert_eq!(get("VmPeak"), None);
        assert_eq!(s.memory.len(), STATUS_KEYS.len());
        assert_eq!(s.memory[0].0, "VmRSS");
        assert_eq!(s.threads, Some(1.0));
    }

    #[test]
    fn zombies_and_kernel_threads_have_no_sample() {
        assert_eq!(
            parse_status("Name:\tx\nState:\tZ (zombie)\nThreads:\t1\n"),
            None
        );
        assert_eq!(
            parse_status("Name:\tkworker\nState:\tI (idle)\nThreads:\t1\n"),
            None
        );
    }

    #[test]
    fn meminfo_has_used_and_shmem() {
        let m = parse_meminfo(MEMINFO);
        let get = |k: &str| m.iter().find(|(key, _)| key == k).map(|(_, v)| *v);
        assert_eq!(get("MemUsed"), Some((8029084.0 - 5608720.0) * 1024.0));
        assert_eq!(get("Shmem"), Some(54024.0 * 1024.0));
        assert_eq!(get("PageTables"), Some(24408.0 * 1024.0));
        assert_eq!(get("HugePages_Total"), None);
        assert_eq!(m.len(), MEMINFO_KEYS.len() + 1);
    }

    #[test]
    fn names_match_comm_or_argv0() {
        assert!(name_matches("cat", Some("cat"), None));
        assert!(name_matches(
            "a_very_long_process_name",
            Some("a_very_long_pro"),
            None
        ));
        assert!(name_matches("server", Some("worker-1"), Some("server")));
        assert!(!name_matches("ca", Some("cat"), Some("cat")));
    }

    #[test]
    fn fixture_proc_tree_is_read() {
        let dir = crate::monitor::testutil::TempDir::new();
        let p = dir.path().join("42");
        fs::create_dir_all(p.join("fd")).expect("mkdir");
        fs::write(p.join("status"), STATUS).expect("write");
        fs::write(p.join("comm"), "cat\n").expect("write");
        fs::write(p.join("cmdline"), b"/bin/cat\0-\0").expect("write");
        for i in 0..3 {
            fs::write(p.join("fd").join(i.to_string()), "").expect("write");
        }
        fs::write(dir.path().join("meminfo"), MEMINFO).expect("write");
        let s = read_process(dir.path(), 42).expect("process");
        assert_eq!(s.fds, Some(3.0));
        assert_eq!(find_by_name(dir.path(), "cat", 0).expect("scan"), vec![42]);
        assert!(read_process(dir.path(), 43).is_none());
        assert!(read_meminfo(dir.path()).expect("meminfo").len() > 5);
    }
}
