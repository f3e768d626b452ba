//! Report formats written by the real binary after a real trace (folded,
//! flame graph, pprof, timeline, text, JSON Lines), and the Prometheus
//! endpoint, scraped by hand and by a real Prometheus server.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::{privileged, site_totals, Fixture, MEMTRACE};

/// What leak_sites leaks at least, on the libc heap: 4800 + 10000 bytes.
const LEAK_AB_BYTES: f64 = 14800.0;

/// A temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("memtrace-outputs-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        TempDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A background process that is ended when dropped (also on panic).
struct Guard {
    child: Child,
    name: &'static str,
}

impl Guard {
    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if self.exited().is_some() {
            return;
        }
        // Politely first (memtrace detaches and exits on SIGTERM), then for sure.
        // SAFETY: kill with the pid of our own, not yet reaped, child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("{} did not end on SIGTERM; killing it", self.name);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// memtrace running in the background with its stdout (bytes) and stderr
/// collected as they come; killed on drop.
struct Memtrace {
    guard: Guard,
    stdout: Option<JoinHandle<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    stderr_reader: Option<JoinHandle<()>>,
}

impl Memtrace {
    /// Starts memtrace with `args` and waits until it says it is tracing.
    fn start(args: &[&str]) -> Memtrace {
        let mut child = Command::new(MEMTRACE)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("memtrace starts");
        let mut out = child.stdout.take().expect("stdout piped");
        let stdout = std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = out.read_to_end(&mut bytes);
            bytes
        });
        let mut err = child.stderr.take().expect("stderr piped");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&stderr);
        let stderr_reader = std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            loop {
                match err.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => sink
                        .lock()
                        .expect("stderr lock")
                        .extend_from_slice(&chunk[..n]),
                }
            }
        });
        let mut tracer = Memtrace {
            guard: Guard {
                child,
                name: "memtrace",
            },
            stdout: Some(stdout),
            stderr,
            stderr_reader: Some(stderr_reader),
        };
        tracer.wait_for_stderr("memtrace: tracing", Duration::from_secs(60));
        tracer
    }

    fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().expect("stderr lock")).into_owned()
    }

    /// Waits (bounded) until memtrace's stderr contains `needle`.
    fn wait_for_stderr(&mut self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if self.stderr_text().contains(needle) {
                return;
            }
            if let Some(status) = self.guard.exited() {
                // Let the reader take the last bytes before judging.
                if let Some(reader) = self.stderr_reader.take() {
                    let _ = reader.join();
                }
                let text = self.stderr_text();
                assert!(
                    text.contains(needle),
                    "memtrace ended ({status}) before saying {needle:?}: {text}"
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "memtrace did not say {needle:?} within {timeout:?}: {}",
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (bounded) for memtrace to end; its status, stdout and stderr.
    fn finish(&mut self) -> (ExitStatus, Vec<u8>, String) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let status = loop {
            if let Some(status) = self.guard.exited() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "memtrace did not end: {}",
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let stdout = self
            .stdout
            .take()
            .map(|reader| reader.join().unwrap_or_default())
            .unwrap_or_default();
        if let Some(reader) = self.stderr_reader.take() {
            let _ = reader.join();
        }
        (status, stdout, self.stderr_text())
    }

    /// Like [`Memtrace::finish`], and asserts exit status 0.
    fn finish_ok(&mut self) -> (Vec<u8>, String) {
        let (status, stdout, stderr) = self.finish();
        assert!(
            status.success(),
            "memtrace failed: {status}\nstderr: {stderr}"
        );
        (stdout, stderr)
    }
}

/// Traces a working `leak_sites` for 3 s with `--format FORMAT --output FILE`
/// and returns the file, after checking what every output file must be.
fn trace_to_file(format: &str, dir: &TempDir) -> PathBuf {
    let path = dir.path().join(format!("report.{format}"));
    let path_text = path.to_str().expect("utf-8 temp path");
    let mut fixture = Fixture::start("leak_sites", &["30", "30"]);
    let pid = fixture.pid.to_string();
    let mut tracer = Memtrace::start(&[
        "--pid",
        &pid,
        "--format",
        format,
        "--output",
        path_text,
        "--top",
        "200",
        "--duration",
        "3s",
    ]);
    fixture.go();
    let (stdout, _) = tracer.finish_ok();
    assert!(
        stdout.is_empty(),
        "--output sends the report to the file, not stdout: {}",
        String::from_utf8_lossy(&stdout)
    );
    let meta = std::fs::metadata(&path)
        .unwrap_or_else(|err| panic!("{format}: no output file {}: {err}", path.display()));
    assert!(meta.len() > 0, "{format}: empty output file");
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "{format}: the output file is created 0600"
    );
    let leftovers: Vec<String> = std::fs::read_dir(dir.path())
        .expect("read temp dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".tmp"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "{format}: temporary files left: {leftovers:?}"
    );
    path
}

/// The folded lines (stack, weight) whose innermost real frame is `symbol`.
fn folded_lines_of(text: &str, symbol: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|line| {
            let (stack, weight) = line.rsplit_once(' ')?;
            let frames: Vec<&str> = stack.split(';').collect();
            let n = frames.len();
            (n >= 2 && frames[n - 2] == symbol && frames[n - 1] == "[libc host]")
                .then(|| (stack.to_string(), weight.parse().expect("folded weight")))
        })
        .collect()
}

#[test]
fn folded_output_file_weighs_each_leak_exactly() {
    if !privileged() {
        return;
    }
    let dir = TempDir::new("folded");
    let path = trace_to_file("folded", &dir);
    let text = std::fs::read_to_string(&path).expect("folded is text");
    for line in text.lines() {
        let (stack, weight) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("folded line without weight: {line:?}"));
        assert!(!stack.is_empty(), "empty stack: {line:?}");
        assert!(weight.parse::<u64>().is_ok(), "bad weight: {line:?}");
    }
    let leak_a = folded_lines_of(&text, "leak_a");
    assert_eq!(leak_a.len(), 1, "one leak_a line: {text}");
    assert_eq!(leak_a[0].1, 4800, "leak_a: 100 x 48 B: {text}");
    assert!(
        leak_a[0].0.contains(";main;leak_a;") || leak_a[0].0.starts_with("main;leak_a;"),
        "leak_a's caller main precedes it: {}",
        leak_a[0].0
    );
    let leak_b = folded_lines_of(&text, "leak_b");
    assert_eq!(leak_b.len(), 1, "one leak_b line: {text}");
    assert_eq!(leak_b[0].1, 10000, "leak_b: 10 x 1000 B: {text}");
    for freed in ["balanced", "realloc_to_zero"] {
        assert!(
            folded_lines_of(&text, freed).is_empty(),
            "{freed} freed everything: {text}"
        );
    }
}

#[test]
fn flamegraph_output_file_is_an_svg_naming_the_leaks() {
    if !privileged() {
        return;
    }
    let dir = TempDir::new("flamegraph");
    let path = trace_to_file("flamegraph", &dir);
    let svg = std::fs::read_to_string(&path).expect("svg is text");
    assert!(svg.contains("<svg"), "an SVG document: {svg:.300}");
    assert!(svg.trim_end().ends_with("</svg>"), "a whole SVG document");
    assert!(svg.contains("leak_a"), "names leak_a");
    assert!(svg.contains("leak_b"), "names leak_b");
}

#[test]
fn timeline_output_file_is_a_trace_with_counters() {
    if !privileged() {
        return;
    }
    let dir = TempDir::new("timeline");
    let path = trace_to_file("timeline", &dir);
    let text = std::fs::read_to_string(&path).expect("timeline is text");
    let doc: Value = serde_json::from_str(&text).expect("timeline is JSON");
    let events = doc["traceEvents"].as_array().expect("traceEvents array");
    let counters: Vec<&Value> = events.iter().filter(|e| e["ph"] == "C").collect();
    assert!(!counters.is_empty(), "counter events: {text}");
    // The last live-bytes counter is the final totals: the leaks are in it.
    let last_bytes = counters
        .iter()
        .filter(|e| e["name"] == "live bytes")
        .max_by_key(|e| e["ts"].as_u64().unwrap_or(0))
        .expect("a live bytes counter");
    let libc = last_bytes["args"]["libc host"].as_f64().unwrap_or(0.0);
    assert!(
        libc >= LEAK_AB_BYTES,
        "final libc host counter {libc} >= {LEAK_AB_BYTES}: {last_bytes}"
    );
}

#[test]
fn text_output_file_names_the_leaks_with_their_bytes() {
    if !privileged() {
        return;
    }
    let dir = TempDir::new("text");
    let path = trace_to_file("text", &dir);
    let text = std::fs::read_to_string(&path).expect("text report is UTF-8");
    assert!(text.starts_with("memtrace report:"), "final report: {text}");
    assert!(text.contains("leak_a"), "names leak_a: {text}");
    assert!(text.contains("leak_b"), "names leak_b: {text}");
    assert!(
        text.contains("(4800 bytes) in 100 blocks"),
        "leak_a's site line: {text}"
    );
    assert!(
        text.contains("(10000 bytes) in 10 blocks"),
        "leak_b's site line: {text}"
    );
}

/// An executable named `name` on PATH.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| {
                p.metadata()
                    .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
            })
    })
}

/// Finds a tool the test needs: missing is a failure under CI, else a skip (None).
fn tool(name: &str, package: &str) -> Option<PathBuf> {
    let found = on_path(name);
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "`{name}` is not on PATH (CI installs Debian's {package})"
        );
        eprintln!("SKIPPED: `{name}` is not on PATH (install Debian's {package})");
    }
    found
}

#[test]
fn pprof_output_file_reads_in_go_tool_pprof() {
    if !privileged() {
        return;
    }
    let dir = TempDir::new("pprof");
    let path = trace_to_file("pprof", &dir);
    let bytes = std::fs::read(&path).expect("pprof file");
    assert_eq!(&bytes[..2], &[0x1f, 0x8b], "gzip magic");
    let Some(go) = tool("go", "golang-go") else {
        return;
    };
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).expect("home");
    // The fixture's four joined threads leave 32 MiB of cached mmap'd stacks,
    // so pprof's default -nodefraction (0.5%) would drop the small heap leaks.
    let out = Command::new(go)
        .args([
            "tool",
            "pprof",
            "-top",
            "-sample_index=inuse_space",
            "-nodefraction=0",
        ])
        .arg(&path)
        .current_dir(dir.path())
        .env("HOME", &home)
        .env("GOCACHE", home.join("gocache"))
        .env("GOPATH", home.join("gopath"))
        .env("PPROF_TMPDIR", &home)
        .env("GOTOOLCHAIN", "local")
        .stdin(Stdio::null())
        .output()
        .expect("go tool pprof runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "go tool pprof failed: {}\n{stdout}\n{stderr}",
        out.status
    );
    for symbol in ["leak_a", "leak_b"] {
        assert!(
            stdout
                .lines()
                .any(|l| l.split_whitespace().last() == Some(symbol)),
            "pprof -top lists {symbol}:\n{stdout}\n{stderr}"
        );
    }
    assert!(stdout.contains("inuse_space"), "sample type: {stdout}");
}

#[test]
fn pprof_without_output_writes_gzip_to_a_piped_stdout() {
    if !privileged() {
        return;
    }
    let mut fixture = Fixture::start("leak_sites", &["30", "30"]);
    let pid = fixture.pid.to_string();
    let mut tracer = Memtrace::start(&["--pid", &pid, "--format", "pprof", "--duration", "2s"]);
    fixture.go();
    let (stdout, _) = tracer.finish_ok();
    assert!(stdout.len() > 2, "pprof bytes on stdout");
    assert_eq!(&stdout[..2], &[0x1f, 0x8b], "gzip magic on stdout");
    let mut profile = Vec::new();
    flate2::read::GzDecoder::new(&stdout[..])
        .read_to_end(&mut profile)
        .expect("a whole gzip stream");
    let contains = |needle: &[u8]| profile.windows(needle.len()).any(|w| w == needle);
    assert!(contains(b"leak_a"), "the profile names leak_a");
    assert!(contains(b"inuse_space"), "the profile has inuse_space");
}

#[test]
fn json_with_interval_streams_json_lines_ending_in_the_final_report() {
    if !privileged() {
        return;
    }
    let mut fixture = Fixture::start("leak_sites", &["30", "30"]);
    let pid = fixture.pid.to_string();
    let mut tracer = Memtrace::start(&[
        "--pid",
        &pid,
        "--format",
        "json",
        "--interval",
        "500ms",
        "--top",
        "200",
        "--duration",
        "3s",
    ]);
    fixture.go();
    let (stdout, _) = tracer.finish_ok();
    let text = String::from_utf8(stdout).expect("UTF-8 JSON");
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines.len() >= 3,
        "interim reports every 500 ms over 3 s, then the final one: {} lines",
        lines.len()
    );
    let reports: Vec<Value> = lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            serde_json::from_str(line).unwrap_or_else(|err| panic!("line {i} ({err}): {line}"))
        })
        .collect();
    let mut last_duration = 0;
    for (i, report) in reports.iter().enumerate() {
        for key in [
            "target",
            "duration_ms",
            "events",
            "totals",
            "sites",
            "settings",
        ] {
            assert!(
                report.get(key).is_some(),
                "line {i} is a full report, missing {key}"
            );
        }
        let duration = report["duration_ms"].as_u64().expect("duration_ms");
        assert!(
            duration >= last_duration,
            "line {i}: duration_ms {duration} < {last_duration}"
        );
        last_duration = duration;
    }
    let last = reports.last().expect("a final report");
    assert!(
        last_duration >= 2500,
        "the last line is the final report of the 3 s trace: duration_ms {last_duration}"
    );
    assert_eq!(site_totals(last, "leak_a"), (4800, 100), "final leak_a");
    assert_eq!(site_totals(last, "leak_b"), (10000, 10), "final leak_b");
}

/// A loopback port that was free a moment ago.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local addr").port()
}

/// One plain HTTP/1.0 GET (no chunked encoding, closed after the answer):
/// the status code and body.
fn http_get(port: u16, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nAccept: */*\r\n\r\n"
    )?;
    stream.flush()?;
    let mut bytes = Vec::new();
    stream.read_to_end(&mut bytes)?;
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no HTTP head: {text:?}")))?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line: {head:?}")))?;
    Ok((code, body.to_string()))
}

/// The value of the first sample line starting with `prefix`.
fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|line| line.starts_with(prefix))
        .and_then(|line| line.rsplit_once(' '))
        .and_then(|(_, value)| value.parse().ok())
}

/// Percent-encodes a query parameter (unreserved characters kept).
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            b => format!("%{b:02X}"),
        })
        .collect()
}

/// Runs an instant query against Prometheus' HTTP API; the result vector.
fn prom_query(port: u16, query: &str) -> Result<Vec<Value>, String> {
    let (code, body) = http_get(port, &format!("/api/v1/query?query={}", encode(query)))
        .map_err(|e| e.to_string())?;
    if code != 200 {
        return Err(format!("HTTP {code}: {body}"));
    }
    let doc: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
    if doc["status"] != "success" {
        return Err(body);
    }
    Ok(doc["data"]["result"]
        .as_array()
        .cloned()
        .unwrap_or_default())
}

#[test]
fn prometheus_endpoint_serves_live_figures_to_a_real_prometheus() {
    if !privileged() {
        return;
    }
    // Lingers long enough for a slow Prometheus start.
    let mut fixture = Fixture::start("leak_sites", &["30", "120"]);
    let pid = fixture.pid.to_string();
    let port = free_port();
    let bind = format!("127.0.0.1:{port}");
    let mut tracer = Memtrace::start(&[
        "--pid",
        &pid,
        "--format",
        "json",
        "--prometheus",
        &bind,
        "--duration",
        "150s",
    ]);
    tracer.wait_for_stderr(
        &format!("memtrace: Prometheus metrics on http://{bind}/metrics"),
        Duration::from_secs(30),
    );
    fixture.go();

    // By hand: the endpoint refreshes every 2 s; wait for the leaks to show.
    let libc_prefix = "memtrace_live_bytes{allocator=\"libc\"";
    let mut last = String::new();
    let mut seen = None;
    for _ in 0..100 {
        match http_get(port, "/metrics") {
            Ok((200, body)) => {
                let value = metric(&body, libc_prefix);
                last = body;
                if value.is_some_and(|v| v >= LEAK_AB_BYTES) {
                    seen = value;
                    break;
                }
            }
            Ok((code, body)) => last = format!("HTTP {code}: {body}"),
            Err(err) => last = format!("error: {err}"),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        seen.is_some(),
        "{libc_prefix} never reached {LEAK_AB_BYTES}; last answer:\n{last}\nstderr: {}",
        tracer.stderr_text()
    );
    assert_eq!(
        metric(&last, "memtrace_up "),
        Some(1.0),
        "memtrace_up 1:\n{last}"
    );
    assert!(
        metric(&last, "memtrace_live_blocks{allocator=\"libc\"").is_some_and(|v| v >= 110.0),
        "live blocks:\n{last}"
    );
    assert!(
        last.lines()
            .any(|l| l.starts_with("memtrace_site_live_bytes{")
                && l.contains("site=\"leak_b\"")
                && l.ends_with(" 10000")),
        "leak_b's site series:\n{last}"
    );
    assert!(
        metric(&last, "memtrace_events_total{kind=\"allocs\"}").is_some_and(|v| v >= 110.0),
        "allocs counted:\n{last}"
    );
    let (code, _) = http_get(port, "/nope").expect("404 answer");
    assert_eq!(code, 404);

    // A real Prometheus scraping memtrace.
    let Some(prometheus) = tool("prometheus", "prometheus") else {
        return;
    };
    let dir = TempDir::new("prometheus");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: memtrace\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
        ),
    )
    .expect("write config");
    let log_path = dir.path().join("prometheus.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let web_port = free_port();
    let mut server = Guard {
        child: Command::new(prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{web_port}"))
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("prometheus starts"),
        name: "prometheus",
    };
    let log_tail = || {
        let bytes = std::fs::read(&log_path).unwrap_or_default();
        let start = bytes.len().saturating_sub(3000);
        String::from_utf8_lossy(&bytes[start..]).into_owned()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let series = loop {
        if let Some(status) = server.exited() {
            panic!("prometheus exited: {status}\n{}", log_tail());
        }
        match prom_query(web_port, "memtrace_live_bytes") {
            Ok(result) if !result.is_empty() => break result,
            Ok(_) => last = "empty result".into(),
            Err(err) => last = err,
        }
        if Instant::now() >= deadline {
            let targets = http_get(web_port, "/api/v1/targets")
                .map(|(_, body)| body)
                .unwrap_or_else(|e| e.to_string());
            panic!(
                "prometheus never had memtrace_live_bytes: {last}\ntargets: {targets}\nlog: {}",
                log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let libc = series
        .iter()
        .find(|s| s["metric"]["allocator"] == "libc")
        .unwrap_or_else(|| panic!("a series with allocator=libc: {series:?}"));
    assert_eq!(libc["metric"]["job"], "memtrace", "{libc}");
    let value: f64 = libc["value"][1]
        .as_str()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(
        value >= LEAK_AB_BYTES,
        "scraped libc live bytes {value}: {libc}"
    );
    let up = prom_query(web_port, "memtrace_up").expect("memtrace_up query");
    assert!(
        up.iter().any(|s| s["value"][1] == "1"),
        "memtrace_up is 1 in Prometheus: {up:?}"
    );
    drop(server);
    drop(tracer);
}
