//! What a snapshot's clone costs on this host: the pause it adds is the
//! kernel copying the service's page tables (a page-table entry per 4 KiB
//! anonymous page, one per transparent huge page), so it grows with the
//! anonymous memory. Measured once per host by a small helper process
//! (`memtrace fork-cost`, hidden: forks itself with 64 MiB of touched 4 KiB
//! pages, then of huge pages, against a bare fork), kept in
//! `/var/cache/memtrace/fork-cost.json` under a key naming the kernel, the
//! CPU and the THP setting (another key measures again), and turned into
//! an estimate for a process from its `smaps_rollup` before it is stopped.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The host's clone costs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ForkCost {
    /// A fork of a process with almost no memory.
    pub base_ns: f64,
    /// Each 4 KiB anonymous page more.
    pub page_ns: f64,
    /// Each 2 MiB transparent huge page more (the 4 KiB cost per 512
    /// pages where the helper got no huge page).
    pub huge_ns: f64,
}

/// The cache file: the costs and the host they were measured on.
#[derive(Debug, Serialize, Deserialize)]
struct Cached {
    host: String,
    cost: ForkCost,
}

/// Anonymous memory the helper maps for each measurement.
const PROBE_BYTES: usize = 64 << 20;
/// Forks per measurement (the median is kept).
const ROUNDS: usize = 5;
const PAGE: u64 = 4096;
const HUGE: u64 = 2 << 20;

impl ForkCost {
    /// The clone's estimated duration for a process with `anon` bytes of
    /// anonymous memory resident, `huge` of them in transparent huge pages.
    pub fn estimate(&self, anon: u64, huge: u64) -> Duration {
        let huge = huge.min(anon);
        let pages = (anon - huge).div_ceil(PAGE) as f64;
        let huge_pages = huge.div_ceil(HUGE) as f64;
        let ns = self.base_ns + pages * self.page_ns + huge_pages * self.huge_ns;
        Duration::from_nanos(ns.max(0.0) as u64)
    }
}

/// `Anonymous:` and `AnonHugePages:` of a `smaps_rollup`, in bytes.
pub fn anonymous(rollup: &str) -> Option<(u64, u64)> {
    let field = |name: &str| -> Option<u64> {
        rollup.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            let kb = rest.trim().strip_suffix("kB")?.trim();
            kb.parse::<u64>().ok().map(|kb| kb << 10)
        })
    };
    Some((field("Anonymous")?, field("AnonHugePages").unwrap_or(0)))
}

/// The host the costs belong to: kernel release, CPU model, THP setting.
fn host_key() -> String {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let release = read("/proc/sys/kernel/osrelease");
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name") || l.starts_with("CPU part"))
        .and_then(|l| l.split_once(':'))
        .map_or("", |(_, v)| v.trim());
    let thp = read("/sys/kernel/mm/transparent_hugepage/enabled");
    format!("{} | {} | thp {}", release.trim(), model, thp.trim())
}

fn cache_file() -> PathBuf {
    PathBuf::from("/var/cache/memtrace/fork-cost.json")
}

/// The host's costs: from the cache when it names this host, else measured
/// (tens of milliseconds) and cached; None when no helper could measure.
pub fn for_host() -> Option<ForkCost> {
    static COST: std::sync::OnceLock<Option<ForkCost>> = std::sync::OnceLock::new();
    *COST.get_or_init(|| {
        let key = host_key();
        let file = cache_file();
        if let Some(cost) = read_cache(&file, &key) {
            return Some(cost);
        }
        let cost = measure_in_helper()?;
        if let Err(err) = write_cache(&file, &key, cost) {
            log::debug!("fork cost not cached in {}: {err}", file.display());
        }
        log::info!(
            "fork cost on this host measured: {:.0} us + {:.1} ms per GiB of 4 KiB pages, {:.2} ms per GiB of huge pages",
            cost.base_ns / 1e3,
            cost.page_ns * (1u64 << 18) as f64 / 1e6,
            cost.huge_ns * 512.0 / 1e6
        );
        Some(cost)
    })
}

fn read_cache(file: &Path, key: &str) -> Option<ForkCost> {
    let text = std::fs::read_to_string(file).ok()?;
    let cached: Cached = serde_json::from_str(&text).ok()?;
    let sane = [
        cached.cost.base_ns,
        cached.cost.page_ns,
        cached.cost.huge_ns,
    ]
    .iter()
    .all(|v| v.is_finite() && *v >= 0.0);
    (cached.host == key && sane).then_some(cached.cost)
}

fn write_cache(file: &Path, key: &str, cost: ForkCost) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let text = serde_json::to_string(&Cached {
        host: key.to_string(),
        cost,
    })
    .map_err(std::io::Error::other)?;
    // Written beside, then renamed: a reader never sees half a file.
    let partial = file.with_extension("json.partial");
    std::fs::write(&partial, text)?;
    std::fs::rename(&partial, file)
}

/// Runs `memtrace fork-cost` (a fresh process: memtrace's own memory
/// would be in every fork it timed) and reads its line.
fn measure_in_helper() -> Option<ForkCost> {
    let out = std::process::Command::new("/proc/self/exe")
        .arg("fork-cost")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

/// The hidden `memtrace fork-cost`: measures and prints the costs as JSON.
pub fn run() -> anyhow::Result<std::process::ExitCode> {
    let cost = measure().map_err(|err| anyhow::anyhow!("fork-cost: {err}"))?;
    println!("{}", serde_json::to_string(&cost)?);
    Ok(std::process::ExitCode::SUCCESS)
}

/// Times forks of this process bare, then with 64 MiB of 4 KiB pages, then
/// with 64 MiB of huge pages (where THP gives them).
fn measure() -> Result<ForkCost, String> {
    let base = median_fork()?;
    let small = Region::map(false)?;
    let with_small = median_fork()?;
    drop(small);
    let page_ns = (with_small - base).max(0.0) / (PROBE_BYTES as u64 / PAGE) as f64;
    let huge = Region::map(true)?;
    let huge_bytes = anon_huge_self();
    let with_huge = median_fork()?;
    drop(huge);
    // A huge page's entry costs at least a small page's (the difference
    // from the bare fork is within its noise: 32 entries).
    let huge_ns = if huge_bytes >= (PROBE_BYTES as u64) / 2 {
        ((with_huge - base) / (huge_bytes / HUGE) as f64).max(page_ns)
    } else {
        page_ns * (HUGE / PAGE) as f64
    };
    Ok(ForkCost {
        base_ns: base,
        page_ns,
        huge_ns,
    })
}

fn anon_huge_self() -> u64 {
    std::fs::read_to_string("/proc/self/smaps_rollup")
        .ok()
        .and_then(|text| anonymous(&text))
        .map_or(0, |(_, huge)| huge)
}

/// The median time of [`ROUNDS`] forks, in ns (the parent's side: the
/// copy of the page tables, as the service's clone).
fn median_fork() -> Result<f64, String> {
    let mut times = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let started = Instant::now();
        // SAFETY: the helper is single-threaded; the child only calls
        // `_exit`, which is async-signal-safe.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: leaving the forked child at once, no destructor run.
            unsafe { libc::_exit(0) };
        }
        let took = started.elapsed();
        if child < 0 {
            return Err(format!("fork: {}", std::io::Error::last_os_error()));
        }
        let mut status = 0;
        // SAFETY: waiting for our own child with a valid status pointer.
        unsafe { libc::waitpid(child, &mut status, 0) };
        times.push(took.as_nanos() as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// 64 MiB of anonymous memory, every page written.
struct Region {
    addr: *mut libc::c_void,
    len: usize,
}

impl Region {
    fn map(huge: bool) -> Result<Region, String> {
        // Room to align to 2 MiB inside.
        let len = PROBE_BYTES + HUGE as usize;
        // SAFETY: a fresh private anonymous mapping, no address given.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        let advice = if huge {
            libc::MADV_HUGEPAGE
        } else {
            libc::MADV_NOHUGEPAGE
        };
        // SAFETY: advice on the mapping just made; a failure (no THP) only
        // leaves the default.
        unsafe { libc::madvise(addr, len, advice) };
        let base = addr as usize;
        let aligned = base.next_multiple_of(HUGE as usize);
        for at in (aligned..aligned + PROBE_BYTES).step_by(PAGE as usize) {
            // SAFETY: inside the mapping (aligned + PROBE_BYTES <= base +
            // len), writable.
            unsafe { std::ptr::write_volatile(at as *mut u8, 1) };
        }
        Ok(Region { addr, len })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping `map` made.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_grow_with_pages_and_count_huge_pages_apart() {
        let cost = ForkCost {
            base_ns: 100_000.0,
            page_ns: 50.0,
            huge_ns: 400.0,
        };
        assert_eq!(cost.estimate(0, 0), Duration::from_micros(100));
        // 1 GiB of 4 KiB pages: 262,144 entries at 50 ns.
        assert_eq!(
            cost.estimate(1 << 30, 0),
            Duration::from_nanos(100_000 + 262_144 * 50)
        );
        // The same in huge pages: 512 of them.
        assert_eq!(
            cost.estimate(1 << 30, 1 << 30),
            Duration::from_nanos(100_000 + 512 * 400)
        );
        // More huge than anonymous (a torn read) counts as all huge.
        assert_eq!(
            cost.estimate(4 << 20, 8 << 20),
            cost.estimate(4 << 20, 4 << 20)
        );
    }

    #[test]
    fn reads_anonymous_memory_from_smaps_rollup() {
        let rollup = "55d0c0000000-7ffd1234000 ---p 00000000 00:00 0 [rollup]\n\
                      Rss:              123456 kB\n\
                      Anonymous:         10240 kB\n\
                      LazyFree:              0 kB\n\
                      AnonHugePages:      4096 kB\n";
        assert_eq!(anonymous(rollup), Some((10240 << 10, 4096 << 10)));
        assert_eq!(anonymous("Rss: 1 kB\n"), None);
        assert_eq!(anonymous("Anonymous: lots kB\n"), None);
    }

    #[test]
    fn the_cache_answers_for_its_own_host_only() {
        let dir = std::env::temp_dir().join(format!("memtrace-fork-cost-{}", std::process::id()));
        let file = dir.join("fork-cost.json");
        let cost = ForkCost {
            base_ns: 1.0,
            page_ns: 2.0,
            huge_ns: 3.0,
        };
        assert_eq!(read_cache(&file, "a"), None);
        write_cache(&file, "a", cost).expect("written");
        assert_eq!(read_cache(&file, "a"), Some(cost));
        assert_eq!(read_cache(&file, "b"), None);
        std::fs::write(&file, "{not json").expect("written");
        assert_eq!(read_cache(&file, "a"), None);
        std::fs::write(
            &file,
            r#"{"host":"a","cost":{"base_ns":-1,"page_ns":2,"huge_ns":3}}"#,
        )
        .expect("written");
        assert_eq!(read_cache(&file, "a"), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_measurement_gives_finite_costs() {
        // Forks this test binary's process: only its timing is looked at
        // (no bound on it: the machine is shared).
        let cost = measure().expect("measured");
        for v in [cost.base_ns, cost.page_ns, cost.huge_ns] {
            assert!(v.is_finite() && v >= 0.0, "{cost:?}");
        }
        assert!(cost.base_ns > 0.0, "{cost:?}");
    }
}
