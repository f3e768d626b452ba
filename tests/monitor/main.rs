//! Integration tests of `memtrace monitor`: real runs against small C
//! fixture programs (compiled with `cc` into a temp dir). Each run is a few
//! seconds at a 100 ms interval; no assertion depends on timing.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_memtrace");

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A temp directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let path =
            std::env::temp_dir().join(format!("memtrace-monitor-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        TempDir(path)
    }

    fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Kills and reaps a spawned fixture when dropped.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Compiles `fixtures/<name>.c` into `dir/<out>`.
fn compile(dir: &TempDir, name: &str, out: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/monitor/fixtures")
        .join(format!("{name}.c"));
    let exe = dir.join(out);
    let status = Command::new("cc")
        .args(["-O1", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-lrt")
        .status()
        .expect("run cc");
    assert!(status.success(), "cc {}", src.display());
    exe
}

fn spawn(exe: &Path, args: &[&str]) -> Guard {
    Guard(
        Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn fixture"),
    )
}

fn monitor(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("monitor")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run memtrace")
}

fn code(out: &Output) -> i32 {
    out.status.code().unwrap_or(-1)
}

fn text(out: &Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The label of `family metric` in the summary, first segment listed.
fn label(out: &Output, family: &str, metric: &str) -> Option<String> {
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() >= 8 && f[0] == family && f[1] == metric).then(|| f[7].to_string())
    })
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("read json")).expect("parse json")
}

fn assert_svg(path: &Path) {
    let bytes = std::fs::read(path).expect("read svg");
    assert!(bytes.starts_with(b"<svg"), "not an SVG: {}", path.display());
    assert!(String::from_utf8_lossy(&bytes)
        .trim_end()
        .ends_with("</svg>"));
}

fn assert_png(path: &Path) {
    let bytes = std::fs::read(path).expect("read png");
    assert!(
        bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
        "not a PNG: {}",
        path.display()
    );
}

#[test]
fn no_target_is_a_usage_error() {
    let out = monitor(&["--duration", "1s"]);
    assert_eq!(code(&out), 2, "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("memtrace: no target"), "{err}");
}

#[test]
fn no_such_pid_is_a_usage_error() {
    let out = monitor(&["--pid", "999999999"]);
    assert_eq!(code(&out), 2, "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no such process"));
}

#[test]
fn bad_roots_and_outputs_are_one_line_errors() {
    let out = monitor(&["--pid", "1", "--proc-root", "/nonexistent/proc"]);
    assert_eq!(code(&out), 1, "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("/nonexistent/proc"), "{err}");

    let out = monitor(&["--pid", "1", "--output", "/nonexistent/dir/out.json"]);
    assert_eq!(code(&out), 1, "{}", text(&out));
    assert_eq!(String::from_utf8_lossy(&out.stderr).lines().count(), 1);

    let out = monitor(&["--pid", "1", "--output", "out.txt"]);
    assert_eq!(code(&out), 2, "{}", text(&out));
}

#[test]
fn analyze_rejects_malformed_files() {
    let dir = TempDir::new("bad");
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "{\"format\": \"memtrace-monitor/1\", \"series\": [1,").expect("write");
    let out = monitor(&["analyze", bad.to_str().expect("utf8")]);
    assert_eq!(code(&out), 1, "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("bad.json"), "{err}");

    let bad = dir.join("bad.csv");
    std::fs::write(&bad, "t,v\n1,2\n").expect("write");
    let out = monitor(&["analyze", bad.to_str().expect("utf8")]);
    assert_eq!(code(&out), 1, "{}", text(&out));
}

#[test]
fn steady_process_passes_the_gate() {
    let dir = TempDir::new("steady");
    let exe = compile(&dir, "steady", "steady");
    let child = spawn(&exe, &[]);
    let pid = child.0.id().to_string();
    let csv = dir.join("steady.csv");
    let svg = dir.join("steady.svg");
    let out = monitor(&[
        "--pid",
        &pid,
        "--interval",
        "100ms",
        "--duration",
        "3s",
        "--warmup",
        "500ms",
        "--fail-on",
        "growth,slow-growth,jump",
        "--output",
        csv.to_str().expect("utf8"),
        "--plot",
        svg.to_str().expect("utf8"),
    ]);
    assert_eq!(code(&out), 0, "{}", text(&out));
    assert_eq!(
        label(&out, "process", "VmRSS").as_deref(),
        Some("stable"),
        "{}",
        text(&out)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("gate: passed"));
    assert_svg(&svg);

    // The CSV is read back and judged the same way.
    let again = monitor(&[
        "analyze",
        csv.to_str().expect("utf8"),
        "--fail-on",
        "growth,slow-growth,jump",
    ]);
    assert_eq!(code(&again), 0, "{}", text(&again));
    assert_eq!(label(&again, "process", "VmRSS").as_deref(), Some("stable"));
    let first = std::fs::read_to_string(&csv).expect("csv");
    assert!(first.starts_with("# memtrace-monitor/1 {"));
    assert!(first.contains("\nt_s,family,metric,unit,segment,pid,value,note\n"));
}

#[test]
fn leaking_command_fails_the_gate() {
    let dir = TempDir::new("leak");
    let exe = compile(&dir, "leaker", "leaker");
    let json = dir.join("leak.json");
    let png = dir.join("leak.png");
    let out = monitor(&[
        "--interval",
        "100ms",
        "--duration",
        "3s",
        "--warmup",
        "500ms",
        "--settle",
        "300ms",
        "--fail-on",
        "growth,slow-growth,jump",
        "--output",
        json.to_str().expect("utf8"),
        "--plot",
        png.to_str().expect("utf8"),
        "--",
        exe.to_str().expect("utf8"),
        "400",
    ]);
    assert_eq!(code(&out), 3, "{}", text(&out));
    assert_eq!(
        label(&out, "process", "VmRSS").as_deref(),
        Some("growth"),
        "{}",
        text(&out)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("gate: FAILED"));
    assert_png(&png);

    let doc = read_json(&json);
    assert_eq!(doc["format"], "memtrace-monitor/1");
    let rss = doc["verdicts"]
        .as_array()
        .expect("verdicts")
        .iter()
        .find(|v| v["family"] == "process" && v["metric"] == "VmRSS")
        .expect("VmRSS verdict");
    assert_eq!(rss["label"], "growth");
    assert!(rss["slope_per_hour"].as_f64().expect("slope") > 0.0);
    // The run was stopped by --duration: recorded with its signal.
    let runs = doc["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0]["signal"], 9);
    assert_eq!(runs[0]["core_dumped"], false);

    // JSON re-judged offline, re-plotted as SVG.
    let svg = dir.join("again.svg");
    let again = monitor(&[
        "analyze",
        json.to_str().expect("utf8"),
        "--fail-on",
        "growth",
        "--plot",
        svg.to_str().expect("utf8"),
    ]);
    assert_eq!(code(&again), 3, "{}", text(&again));
    assert_eq!(label(&again, "process", "VmRSS").as_deref(), Some("growth"));
    assert_svg(&svg);
}

#[test]
fn fd_leak_is_flagged() {
    let dir = TempDir::new("fd");
    let exe = compile(&dir, "fdleak", "fdleak");
    let child = spawn(&exe, &[]);
    let pid = child.0.id().to_string();
    let out = monitor(&[
        "--pid",
        &pid,
        "--interval",
        "100ms",
        "--duration",
        "3s",
        "--fail-on",
        "growth,slow-growth,jump",
    ]);
    assert_eq!(code(&out), 3, "{}", text(&out));
    let fds = label(&out, "process", "fds");
    assert!(
        matches!(fds.as_deref(), Some("growth") | Some("slow-growth")),
        "{}",
        text(&out)
    );
}

#[test]
fn restart_under_the_same_name_gives_two_segments() {
    let dir = TempDir::new("restart");
    let name = format!("mtr{}", std::process::id() % 100_000);
    let exe = compile(&dir, "steady", &name);
    let json = dir.join("restart.json");
    let first = spawn(&exe, &[]);
    let first_pid = first.0.id();

    let mut mon = Command::new(BIN)
        .args([
            "monitor",
            "--name",
            &name,
            "--interval",
            "100ms",
            "--output",
        ])
        .arg(&json)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn monitor");
    let stderr = mon.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let wait_for = |needle: &str| loop {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("monitor said nothing for 60 s");
        if line.contains(needle) {
            break;
        }
    };
    wait_for(&format!("following pid {first_pid} "));
    // Let the first instance be sampled (as the second is, below) before it ends.
    std::thread::sleep(Duration::from_millis(500));
    drop(first); // kill + reap: the first instance ends
    wait_for(&format!("pid {first_pid} ({name}) exited"));
    let second = spawn(&exe, &[]);
    let second_pid = second.0.id();
    wait_for(&format!("following pid {second_pid} "));
    std::thread::sleep(Duration::from_millis(500));
    let status = Command::new("kill")
        .args(["-INT", &mon.id().to_string()])
        .status()
        .expect("kill -INT");
    assert!(status.success());
    let mut stdout = String::new();
    if let Some(mut s) = mon.stdout.take() {
        use std::io::Read;
        let _ = s.read_to_string(&mut stdout);
    }
    let status = mon.wait().expect("wait monitor");
    drop(second);
    assert_eq!(status.code(), Some(0), "{stdout}");

    let doc = read_json(&json);
    let segments = doc["segments"].as_array().expect("segments");
    let pids: Vec<u64> = segments.iter().filter_map(|s| s["pid"].as_u64()).collect();
    assert_eq!(
        pids,
        vec![u64::from(first_pid), u64::from(second_pid)],
        "{stdout}"
    );
    assert_eq!(segments[0]["end_note"], "process exited");
    let rss_segments: Vec<u64> = doc["series"]
        .as_array()
        .expect("series")
        .iter()
        .filter(|s| s["family"] == "process" && s["metric"] == "VmRSS")
        .filter_map(|s| s["segment"].as_u64())
        .collect();
    assert_eq!(rss_segments, vec![1, 2]);
}

/// Removes the shared-memory objects a test left in /dev/shm.
struct ShmCleanup(String);

impl Drop for ShmCleanup {
    fn drop(&mut self) {
        if let Ok(entries) = std::fs::read_dir("/dev/shm") {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().starts_with(&self.0) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
}

#[test]
fn shared_memory_left_by_each_cycle_is_not_released() {
    let dir = TempDir::new("shm");
    let exe = compile(&dir, "shmleak", "shmleak");
    let prefix = format!("memtrace-test-{}-", std::process::id());
    let _cleanup = ShmCleanup(prefix.clone());
    let json = dir.join("cycles.json");
    let out = monitor(&[
        "--cycles",
        "3",
        "--interval",
        "100ms",
        "--settle",
        "600ms",
        "--fail-on",
        "not-released",
        "--output",
        json.to_str().expect("utf8"),
        "--",
        exe.to_str().expect("utf8"),
        &prefix,
        "64",
    ]);
    assert_eq!(code(&out), 3, "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let shmem = stdout
        .lines()
        .find(|l| l.starts_with("release system Shmem:"))
        .unwrap_or_else(|| panic!("no Shmem release line\n{}", text(&out)));
    assert!(shmem.ends_with("not-released"), "{shmem}");

    let doc = read_json(&json);
    let runs = doc["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 3);
    assert!(runs.iter().all(|r| r["exit_code"] == 0), "{runs:?}");
    let release = doc["release"]["metrics"].as_array().expect("release");
    let shm = release
        .iter()
        .find(|m| m["metric"] == "Shmem")
        .expect("Shmem release");
    assert_eq!(shm["released"], false);
    assert!(
        shm["residual"].as_f64().expect("residual") >= 150.0 * 1048576.0,
        "{shm}"
    );
}

#[test]
fn gpu_sources_from_fixture_roots_and_failing_command() {
    let dir = TempDir::new("gpu");
    let exe = compile(&dir, "steady", "steady");
    let child = spawn(&exe, &[]);
    let pid = child.0.id().to_string();
    let dev = dir.join("sys/class/drm/card0/device");
    std::fs::create_dir_all(&dev).expect("mkdir");
    std::fs::write(dev.join("mem_info_vram_used"), "1048576\n").expect("write");
    std::fs::write(dev.join("mem_info_vram_total"), "8589934592\n").expect("write");
    std::fs::write(dev.join("mem_info_gtt_used"), "4096\n").expect("write");
    // A vendor tool that answers three times, then fails.
    let counter = dir.join("calls");
    let script = format!(
        "n=$(cat {c} 2>/dev/null || echo 0); echo $((n+1)) > {c}; [ $n -lt 3 ] && echo \"vram used : $((n+1)) MiB\"",
        c = counter.display()
    );
    let json = dir.join("gpu.json");
    let out = monitor(&[
        "--pid",
        &pid,
        "--interval",
        "100ms",
        "--duration",
        "1500ms",
        "--no-nvml",
        "--sysfs-root",
        dir.join("sys").to_str().expect("utf8"),
        "--gpu-cmd",
        &script,
        "--output",
        json.to_str().expect("utf8"),
    ]);
    assert_eq!(code(&out), 0, "{}", text(&out));
    let doc = read_json(&json);
    let series = doc["series"].as_array().expect("series");
    let find = |name: &str| {
        series
            .iter()
            .find(|s| s["family"] == "gpu" && s["metric"] == name)
            .unwrap_or_else(|| panic!("no gpu series {name}\n{}", text(&out)))
    };
    assert_eq!(find("card0.vram_used")["points"][0][1], 1048576.0);
    assert_eq!(find("card0.gtt_used")["points"][0][1], 4096.0);
    let smi = find("smi.vram_used");
    assert_eq!(smi["points"][0][1], 1048576.0);
    let gaps = smi["gaps"].as_array().expect("gaps");
    assert_eq!(gaps.len(), 1, "{smi}");
    assert!(
        gaps[0]["note"].as_str().expect("note").contains("failed"),
        "{smi}"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("gpu source error"));
}

#[test]
fn html_soak_report_puts_the_gate_first_with_every_curve_and_the_sources() {
    let dir = TempDir::new("html");
    let exe = compile(&dir, "leaker", "leaker");
    let csv = dir.join("leak.csv");
    let page = dir.join("soak.html");
    let out = monitor(&[
        "--interval",
        "100ms",
        "--duration",
        "3s",
        "--settle",
        "300ms",
        "--fail-on",
        "growth,slow-growth,jump",
        "--output",
        csv.to_str().expect("utf8"),
        "--html",
        page.to_str().expect("utf8"),
        "--",
        exe.to_str().expect("utf8"),
        "400",
    ]);
    assert_eq!(code(&out), 3, "{}", text(&out));
    let html = std::fs::read_to_string(&page).expect("page written");
    assert!(html.starts_with("<!DOCTYPE html>"));
    let gate = html.find("id=\"gate-result\"").expect("gate");
    let verdicts = html.find("id=\"verdict-table\"").expect("verdicts");
    let curves = html.find("id=\"curves\"").expect("curves");
    let sources = html.find("id=\"sources\"").expect("sources");
    assert!(gate < verdicts && verdicts < curves && curves < sources);
    assert!(html.contains("FAILED (exit 3"), "{html}");
    assert!(html.contains("process VmRSS"), "gate names the metric");
    assert!(html.contains("<td>VmRSS</td>"));
    assert!(html.contains("procfs"), "sources listed");
    assert!(html.contains("id=\"segment-table\""));
    assert!(html.contains("id=\"run-table\""));
    assert!(html.matches("<figure class=\"panel\">").count() >= 2);
    assert!(!html.contains("<script"), "no script needed");

    // Offline, from the CSV: the same page, a gate passed this time.
    let again = dir.join("again.html");
    let out = monitor(&[
        "analyze",
        csv.to_str().expect("utf8"),
        "--fail-on",
        "jitter",
        "--html",
        again.to_str().expect("utf8"),
    ]);
    let html = std::fs::read_to_string(&again).expect("page written");
    if code(&out) == 0 {
        assert!(html.contains("PASSED (--fail-on jitter)"), "{html}");
    } else {
        assert!(html.contains("FAILED (exit 3, --fail-on jitter)"), "{html}");
    }
    assert!(html.contains("<td>VmRSS</td>"));

    // An unwritable page is refused before sampling starts.
    let out = monitor(&[
        "analyze",
        csv.to_str().expect("utf8"),
        "--html",
        "/nonexistent-dir/x.html",
    ]);
    assert_eq!(code(&out), 1, "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot write /nonexistent-dir/x.html"));
}
