//! `memtrace watch`: watching with no probe attached, tracing only while
//! memory grows. Fixtures: `steady_leak` (flat, then a host-heap leak in
//! `leak_block` on a line) and `tests/python/gc_service.py` (a warm-up cache
//! and a GC sawtooth that never leak). Whether memtrace holds a probe is
//! read from the kernel's side: the fds of the watcher and of every process
//! under it that are perf events (uprobes) or BPF objects (programs, links,
//! maps): a uprobe exists only while such an fd holds it. Device memory
//! comes from the stub NVML and CUDA libraries (`steady_device_leak`);
//! `--container` and `--cgroup` use a v1 pids cgroup named as Docker names
//! a container's.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::support::{fixture, privileged, FakeContainer, Fixture, MEMTRACE};

pub const BLOCK: u64 = 256 * 1024;

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Quick episodes: sampled every 250 ms, judged over 15 s with no
/// warm-up, traced for 3 s, no second episode within the hour, a heartbeat
/// every 250 ms.
pub const QUICK: &[&str] = &[
    "--interval",
    "250ms",
    "--judge-window",
    "15s",
    "--warmup",
    "0s",
    "--window",
    "3s",
    "--backoff",
    "1h",
    "--heartbeat",
    "250ms",
];

/// The episode found `leak_block` holding whole blocks (at least one);
/// returns how many.
pub fn assert_found_leak_block(episode: &Value) -> u64 {
    let found = episode["found"].as_array().cloned().unwrap_or_default();
    let site = found
        .iter()
        .find(|f| f["function"] == "leak_block")
        .unwrap_or_else(|| panic!("leak_block not found: {episode}"));
    let count = site["live_count"].as_u64().unwrap_or(0);
    assert!(count >= 1, "{site}");
    assert_eq!(site["live_bytes"].as_u64(), Some(count * BLOCK), "{site}");
    count
}

/// A fresh reports directory under the target dir.
pub fn reports_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/tmp")
        .join(format!("watch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A `memtrace watch` process with its stderr collected as it comes.
pub struct Watch {
    pub child: Child,
    stderr: Arc<Mutex<String>>,
}

impl Watch {
    pub fn start(args: &[&str]) -> Watch {
        Watch::start_with_env(args, &[])
    }

    fn start_with_env(args: &[&str], env: &[(&str, &std::ffi::OsStr)]) -> Watch {
        let mut child = Command::new(MEMTRACE)
            .arg("watch")
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("memtrace watch starts");
        let mut err = child.stderr.take().expect("stderr piped");
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut text) = sink.lock() {
                    text.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            }
        });
        Watch { child, stderr }
    }

    pub fn text(&self) -> String {
        self.stderr.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Waits (bounded, as a safety net) until stderr contains `needle`.
    pub fn wait_for(&mut self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while !self.text().contains(needle) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("watch ended ({status}) before {needle:?}: {}", self.text());
            }
            assert!(
                Instant::now() < deadline,
                "no {needle:?} from watch: {}",
                self.text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGTERM, then the exit status and stderr (bounded wait).
    pub fn stop(mut self) -> (std::process::ExitStatus, String) {
        // SAFETY: kill with our own child's pid and a valid signal.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                std::thread::sleep(Duration::from_millis(100));
                return (status, self.text());
            }
            assert!(Instant::now() < deadline, "watch did not stop");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `pid` and every process under it.
fn family_of(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|s| s.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            parents.push((p, ppid));
        }
    }
    let mut family = vec![pid];
    let mut i = 0;
    while i < family.len() {
        let parent = family[i];
        family.extend(
            parents
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    family
}

/// The perf-event and BPF fds held by `pid` and the processes under it.
pub fn probe_fds(pid: u32) -> Vec<String> {
    let mut held = Vec::new();
    for p in family_of(pid) {
        for fd in std::fs::read_dir(format!("/proc/{p}/fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Ok(target) = std::fs::read_link(fd.path()) {
                let target = target.to_string_lossy().to_string();
                if target.contains("perf_event") || target.contains("bpf") {
                    held.push(format!("{p}: {target}"));
                }
            }
        }
    }
    held
}

fn read_json(path: &Path) -> Option<Value> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// Waits (bounded) for a file to hold JSON.
pub fn wait_json(path: &Path, watch: &Watch) -> Value {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if let Some(v) = read_json(path) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "no {}: {}",
            path.display(),
            watch.text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A `steady_leak` process: flat until a line tells it to leak (256 KiB
/// a period); the next line stops the leak.
fn steady() -> Fixture {
    Fixture::start("steady_leak", &["256", "100"])
}

/// Steady, restarted, then leaking: no probe while healthy (read from the
/// kernel's side), watching resumes on the new pid, the trigger comes after
/// the leak started, the episode names `leak_block` with whole blocks and
/// holds probes only while it runs.
#[test]
fn watch_traces_only_after_the_leak_starts_and_follows_restarts() {
    if !privileged() {
        return;
    }
    let dir = reports_dir("leak");
    let dir_s = dir.to_string_lossy().to_string();
    let first = steady();
    let mut watch =
        Watch::start(&[&["--name", "steady_leak", "--reports", &dir_s], QUICK].concat());
    watch.wait_for(&format!("watching pid {}", first.pid));
    let watcher = watch.child.id();
    // Healthy: judged (phase "watching") with no probe held, for a while.
    let heartbeat = dir.join("heartbeat.json");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut judged = 0;
    while judged < 12 {
        assert!(Instant::now() < deadline, "never judged: {}", watch.text());
        if let Some(h) = read_json(&heartbeat) {
            if h["phase"] == "watching" && h["pid"] == first.pid {
                judged += 1;
            }
        }
        assert_eq!(
            probe_fds(watcher),
            Vec::<String>::new(),
            "probes while healthy"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    // The target restarts: watching resumes on the new pid.
    drop(first);
    let mut second = steady();
    watch.wait_for(&format!("target restarted: watching pid {}", second.pid));
    assert_eq!(probe_fds(watcher), Vec::<String>::new());
    assert!(!dir.join("episode-0001").exists(), "{}", watch.text());

    let leak_start = now_unix_ms();
    second.send_line();
    // The episode's tracer holds probes (the check above sees them).
    let deadline = Instant::now() + Duration::from_secs(120);
    while probe_fds(watcher).is_empty() {
        assert!(
            Instant::now() < deadline,
            "never attached: {}",
            watch.text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let episode = wait_json(&dir.join("episode-0001/episode.json"), &watch);
    second.send_line();
    let text = watch.text();
    assert_eq!(episode["pid"], second.pid, "{episode}");
    assert_eq!(episode["outcome"], "done", "{episode}\n{text}");
    let triggered = episode["why"]["triggered_unix_ms"].as_u64().unwrap_or(0);
    assert!(
        triggered >= leak_start,
        "trigger {triggered} before the leak {leak_start}"
    );
    assert!(
        episode["why"]["since_unix_ms"].as_u64().unwrap_or(0) + 1000 >= leak_start,
        "{episode}"
    );
    let metric = episode["why"]["metric"].as_str().unwrap_or("");
    assert!(
        ["RssAnon", "VmRSS", "VmData"].contains(&metric),
        "{episode}"
    );
    // The leaking site, with exactly its blocks of the window.
    let count = assert_found_leak_block(&episode);
    assert_eq!(
        episode["found"][0]["function"], "leak_block",
        "ranked first: {episode}"
    );
    // The same figures as the tracer's own report; the other formats exist.
    let report = read_json(&dir.join("episode-0001/report.json")).expect("report.json");
    let (bytes, _) = crate::support::site_totals(&report, "leak_block");
    assert_eq!(bytes, count * BLOCK);
    for file in ["report.html", "profile.pb.gz", "tracer.log"] {
        assert!(dir.join("episode-0001").join(file).exists(), "{file}");
    }
    assert!(
        episode["explanation"]
            .as_str()
            .is_some_and(|e| e.contains("explain") || e.contains("grow")),
        "{episode}"
    );
    // Detached again: no probe held once the episode is over.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !probe_fds(watcher).is_empty() {
        assert!(Instant::now() < deadline, "probes after the episode");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (status, text) = watch.stop();
    assert!(status.success(), "{status}: {text}");
    let state = read_json(&dir.join("watch-state.json")).expect("state file");
    assert_eq!(state["next_episode"], 2, "{state}");
    assert_eq!(state["episodes"][0]["outcome"], "done", "{state}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Python service with a warm-up cache and a GC sawtooth never leaks:
/// no episode, a heartbeat only.
#[test]
fn watch_leaves_a_gc_sawtooth_alone() {
    if !privileged() {
        return;
    }
    let dir = reports_dir("python");
    let dir_s = dir.to_string_lossy().to_string();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/gc_service.py");
    let mut service = Command::new("python3")
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut out = BufReader::new(service.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("ready");
    let pid = line
        .strip_prefix("ready ")
        .and_then(|p| p.trim().parse::<u32>().ok())
        .unwrap_or_else(|| panic!("service said {line:?}"));
    let pid_s = pid.to_string();
    let watch = Watch::start(&[
        "--pid",
        &pid_s,
        "--reports",
        &dir_s,
        "--interval",
        "250ms",
        "--judge-window",
        "20s",
        "--warmup",
        "8s",
        "--window",
        "3s",
        "--heartbeat",
        "250ms",
    ]);
    // Let it see the warm-up end and several teeth of the sawtooth.
    let mut cycles = 0;
    line.clear();
    while cycles < 20 {
        line.clear();
        assert!(
            out.read_line(&mut line).expect("service output") > 0,
            "service ended"
        );
        if line.starts_with("cycle") {
            cycles += 1;
        }
    }
    let heartbeat = read_json(&dir.join("heartbeat.json")).expect("heartbeat");
    let (status, text) = watch.stop();
    let _ = service.kill();
    let _ = service.wait();
    assert!(status.success(), "{status}: {text}");
    assert!(!text.contains("episode"), "{text}");
    assert!(!dir.join("episode-0001").exists(), "{text}");
    assert_eq!(heartbeat["episodes_total"], 0, "{heartbeat}");
    assert_eq!(heartbeat["phase"], "watching", "{heartbeat}\n{text}");
    let judged = heartbeat["metrics"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["metric"] == "RssAnon")
        .cloned()
        .unwrap_or(Value::Null);
    assert!(judged["label"].is_string(), "RssAnon judged: {heartbeat}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bad input: one clear line, exit 2.
#[test]
fn watch_refuses_bad_input_in_one_line() {
    let out = crate::support::memtrace(&["watch", "--name", "x"]);
    crate::support::assert_one_clear_line(&out, 2, "--reports DIR");
    let out = crate::support::memtrace(&["watch", "--reports", "/tmp/x"]);
    crate::support::assert_one_clear_line(&out, 2, "no target");
    let out = crate::support::memtrace(&["watch", "--pid", "999999999", "--dry-run"]);
    crate::support::assert_one_clear_line(&out, 2, "no process with pid");
}

/// A `steady_device_leak` process (stub CUDA libraries) whose live device
/// bytes the stub NVML reports through `dir`: flat until told to leak.
fn start_device_fixture(usage_dir: &Path) -> Fixture {
    let usage_dir = usage_dir.to_str().expect("a UTF-8 path");
    Fixture::start_env(
        "steady_device_leak",
        &["1024", "100"],
        &[("MEMTRACE_STUB_GPU_DIR", usage_dir)],
    )
}

/// Device memory through the stub NVML (`libnvidia-ml.so.1`, found by the
/// watcher's dlopen through LD_LIBRARY_PATH, which holds only it) and the
/// stub CUDA libraries: NVML's per-process used memory follows the stub
/// driver's live bytes, the trigger names that device metric, and the
/// episode finds the `cudaMalloc` site with whole device blocks.
#[test]
fn watch_finds_a_device_memory_leak_through_nvml() {
    if !privileged() {
        return;
    }
    const DEVICE_BLOCK: u64 = 1024 * 1024;
    let dir = reports_dir("device");
    let usage = dir.with_extension("gpu-usage");
    let _ = std::fs::remove_dir_all(&usage);
    std::fs::create_dir_all(&usage).expect("usage dir");
    let dir_s = dir.to_string_lossy().to_string();
    let mut target = start_device_fixture(&usage);
    let pid_s = target.pid.to_string();
    let nvml_dir = fixture("nvml");
    assert!(
        nvml_dir.join("libnvidia-ml.so.1").exists(),
        "stub NVML not built: cargo xtask fixtures"
    );
    let mut watch = Watch::start_with_env(
        &[
            &["--pid", &pid_s, "--reports", &dir_s, "--metrics", "gpu"],
            QUICK,
        ]
        .concat(),
        &[
            ("LD_LIBRARY_PATH", nvml_dir.as_os_str()),
            ("MEMTRACE_STUB_GPU_DIR", usage.as_os_str()),
        ],
    );
    watch.wait_for("sources: gpu: nvml;");
    watch.wait_for(&format!("watching pid {}", target.pid));
    // Healthy: judged on NVML's figure for this pid, no probe held.
    let heartbeat = dir.join("heartbeat.json");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut judged = 0;
    while judged < 8 {
        assert!(Instant::now() < deadline, "never judged: {}", watch.text());
        if let Some(h) = read_json(&heartbeat) {
            let nvml = h["metrics"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|m| m["metric"] == "nvml.used" && m["label"].is_string());
            if h["phase"] == "watching" && nvml {
                judged += 1;
            }
        }
        assert_eq!(probe_fds(watch.child.id()), Vec::<String>::new());
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(!dir.join("episode-0001").exists(), "{}", watch.text());
    let leak_start = now_unix_ms();
    target.send_line();
    let episode = wait_json(&dir.join("episode-0001/episode.json"), &watch);
    target.send_line();
    let text = watch.text();
    assert_eq!(episode["outcome"], "done", "{episode}\n{text}");
    assert_eq!(episode["why"]["family"], "gpu", "{episode}");
    let metric = episode["why"]["metric"].as_str().unwrap_or("");
    assert!(["nvml.used", "nvml0.used"].contains(&metric), "{episode}");
    assert!(
        episode["why"]["triggered_unix_ms"].as_u64().unwrap_or(0) >= leak_start,
        "{episode}"
    );
    let found = episode["found"].as_array().cloned().unwrap_or_default();
    let site = found
        .iter()
        .find(|f| f["function"] == "leak_device")
        .unwrap_or_else(|| panic!("leak_device not found: {episode}"));
    assert_eq!(site["allocator"], "cuda", "{site}");
    assert_eq!(site["memory"], "device", "{site}");
    let count = site["live_count"].as_u64().unwrap_or(0);
    assert!(count >= 1, "{site}");
    assert_eq!(site["live_bytes"].as_u64(), Some(count * DEVICE_BLOCK));
    // The churn site frees all it takes: never found.
    assert!(
        !found.iter().any(|f| f["function"] == "device_churn"),
        "{episode}"
    );
    let explanation = episode["explanation"].as_str().unwrap_or("");
    assert!(explanation.starts_with(metric), "{episode}");
    let (status, text) = watch.stop();
    assert!(status.success(), "{status}: {text}");
    drop(target);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&usage);
}

/// `--container PREFIX`: every process of the container is watched, one
/// that joins later too, and a process outside it is not; each is judged
/// on its own, no probe is held while all are healthy, and the episode
/// traces the one that leaks. A bad prefix is one line, exit 2.
#[test]
fn watch_container_watches_each_of_its_processes_and_traces_the_leaking_one() {
    if !privileged() {
        return;
    }
    let Some(container) = FakeContainer::create(1) else {
        eprintln!("SKIPPED: no writable v1 pids hierarchy at /sys/fs/cgroup/pids");
        return;
    };
    let dir = reports_dir("container");
    let dir_s = dir.to_string_lossy().to_string();
    let first = steady();
    container.enter(first.pid);
    let outsider = steady();
    let prefix = container.id[..12].to_string();
    let mut watch = Watch::start(&[&["--container", &prefix, "--reports", &dir_s], QUICK].concat());
    watch.wait_for(&format!("watching container {prefix}"));
    watch.wait_for(&format!("watching pid {}", first.pid));
    let mut second = steady();
    container.enter(second.pid);
    watch.wait_for(&format!("watching pid {}", second.pid));
    // Both judged healthy, the outsider never watched, no probe held.
    let heartbeat = dir.join("heartbeat.json");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut judged = 0;
    while judged < 8 {
        assert!(Instant::now() < deadline, "never judged: {}", watch.text());
        if let Some(h) = read_json(&heartbeat) {
            let pids: Vec<u64> = h["pids"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_u64)
                .collect();
            assert!(!pids.contains(&u64::from(outsider.pid)), "{h}");
            let both_judged =
                [first.pid, second.pid].iter().all(|p| {
                    h["metrics"].as_array().into_iter().flatten().any(|m| {
                        m["pid"] == *p && m["metric"] == "RssAnon" && m["label"].is_string()
                    })
                });
            if h["phase"] == "watching" && both_judged {
                judged += 1;
                // Each process with its container, as the reports name it.
                for pid in [first.pid, second.pid] {
                    let process = h["processes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .find(|p| p["pid"] == pid)
                        .unwrap_or_else(|| panic!("pid {pid} in processes: {h}"));
                    assert_eq!(process["container_id"], container.id.as_str(), "{h}");
                    assert_eq!(process["container_runtime"], "docker", "{h}");
                }
            }
        }
        assert_eq!(probe_fds(watch.child.id()), Vec::<String>::new());
        std::thread::sleep(Duration::from_millis(250));
    }
    second.send_line();
    let episode = wait_json(&dir.join("episode-0001/episode.json"), &watch);
    second.send_line();
    assert_eq!(episode["pid"], second.pid, "{episode}");
    assert_eq!(episode["outcome"], "done", "{episode}\n{}", watch.text());
    assert!(
        episode["why"]["text"]
            .as_str()
            .is_some_and(|t| t.contains(&format!("of pid {}", second.pid))),
        "{episode}"
    );
    assert_found_leak_block(&episode);
    let (status, text) = watch.stop();
    assert!(status.success(), "{status}: {text}");
    drop((first, second, outsider));
    let _ = std::fs::remove_dir_all(&dir);
    // A prefix no container has: one line, exit 2.
    let out = crate::support::memtrace(&["watch", "--container", "ffffffffffffffff0", "--dry-run"]);
    crate::support::assert_one_clear_line(&out, 2, "no running process is in a container");
}

/// `--cgroup` with the line `/proc/PID/cgroup` shows: that process is
/// watched (a dry run: judged, never attached).
#[test]
fn watch_cgroup_watches_the_processes_of_that_cgroup() {
    if !privileged() {
        return;
    }
    let Some(container) = FakeContainer::create(2) else {
        eprintln!("SKIPPED: no writable v1 pids hierarchy at /sys/fs/cgroup/pids");
        return;
    };
    let dir = reports_dir("cgroup");
    let dir_s = dir.to_string_lossy().to_string();
    let inside = steady();
    container.enter(inside.pid);
    let outsider = steady();
    let line = std::fs::read_to_string(format!("/proc/{}/cgroup", inside.pid))
        .expect("cgroup")
        .lines()
        .find(|l| l.contains(":pids:"))
        .expect("pids line")
        .to_string();
    let mut watch = Watch::start(&[
        "--cgroup",
        &line,
        "--dry-run",
        "--reports",
        &dir_s,
        "--interval",
        "250ms",
        "--heartbeat",
        "250ms",
    ]);
    watch.wait_for(&format!("watching pid {}", inside.pid));
    let deadline = Instant::now() + Duration::from_secs(60);
    let heartbeat = loop {
        assert!(Instant::now() < deadline, "no heartbeat: {}", watch.text());
        match read_json(&dir.join("heartbeat.json")) {
            Some(h) if h["pids"].as_array().is_some_and(|p| !p.is_empty()) => break h,
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    assert_eq!(
        heartbeat["pids"],
        serde_json::json!([inside.pid]),
        "{heartbeat}"
    );
    assert_eq!(heartbeat["target"], format!("cgroup {line}"), "{heartbeat}");
    let (status, text) = watch.stop();
    assert!(status.success(), "{status}: {text}");
    assert!(!text.contains(&format!("pid {}", outsider.pid)), "{text}");
    drop((inside, outsider));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--leak-check`: the episode ends with a check, which its episode.json
/// and report carry: the blocks `leak_block` dropped are definitely lost.
#[test]
fn watch_leak_check_ends_each_episode_with_a_check() {
    if !privileged() {
        return;
    }
    let dir = reports_dir("leak-check");
    let dir_s = dir.to_string_lossy().to_string();
    let mut target = steady();
    let pid = target.pid.to_string();
    let mut watch =
        Watch::start(&[&["--pid", &pid, "--reports", &dir_s, "--leak-check"], QUICK].concat());
    watch.wait_for(&format!("watching pid {}", target.pid));
    target.send_line();
    let episode = wait_json(&dir.join("episode-0001/episode.json"), &watch);
    target.send_line();
    let check = &episode["leak_check"];
    assert_eq!(check["ran"], true, "{episode}");
    assert_eq!(check["when"], "end", "{episode}");
    let report = read_json(&dir.join("episode-0001/report.json")).expect("report.json");
    let lost: u64 = crate::support::sites_of(&report, "leak_block")
        .iter()
        .map(|s| {
            s["leak_check"]["definitely_lost"]["blocks"]
                .as_u64()
                .unwrap_or(0)
        })
        .sum();
    assert!(lost >= 1, "{}", report["sites"]);
    let (status, text) = watch.stop();
    assert!(status.success(), "{status}: {text}");
    let _ = std::fs::remove_dir_all(&dir);
}
