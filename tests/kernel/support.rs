//! Shared helpers of the privileged kernel suite: building the C fixtures,
//! starting fixture processes, running the real memtrace binary against them
//! and reading its JSON report.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

pub const MEMTRACE: &str = env!("CARGO_BIN_EXE_memtrace");

/// Whether this suite can run: it attaches real eBPF programs, so it needs root.
/// Under `cargo xtask test` (and CI) a missing privilege is a failure, not a skip.
pub fn privileged() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        if std::env::var_os("MEMTRACE_REQUIRE_KERNEL_TESTS").is_some() {
            panic!("the kernel suite needs root (run `sudo cargo xtask test`)");
        }
        eprintln!("SKIPPED: the kernel suite needs root (run `sudo cargo xtask test`)");
    }
    root
}

/// The built fixtures (`make -C tests/fixtures`), once per test binary.
pub fn fixtures() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let out = std::env::var_os("MEMTRACE_FIXTURES")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target/fixtures"));
        let status = Command::new("make")
            .args(["-s", "-C"])
            .arg(root.join("tests/fixtures"))
            .arg(format!("OUT={}", out.display()))
            .arg("all")
            .status()
            .expect("make runs");
        assert!(status.success(), "building the fixtures failed");
        out
    })
}

pub fn fixture(name: &str) -> PathBuf {
    fixtures().join(name)
}

/// A fixture process following the ready/go/done protocol.
pub struct Fixture {
    pub child: Child,
    pub pid: u32,
    stdout: BufReader<std::process::ChildStdout>,
}

impl Fixture {
    /// Starts `name` with `args` and waits for its `ready <pid>` line.
    pub fn start(name: &str, args: &[&str]) -> Fixture {
        Fixture::start_env(name, args, &[])
    }

    /// [`Fixture::start`] with extra environment variables (`LD_PRELOAD`).
    pub fn start_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> Fixture {
        let mut command = Command::new(fixture(name));
        command.args(args).envs(env.iter().copied());
        Fixture::start_command(command)
    }

    /// A fixture started by `command` (directly, or through a client such
    /// as `docker run -i`); `pid` is what its `ready` line says, its pid
    /// in its own pid namespace.
    pub fn start_command(mut command: Command) -> Fixture {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|err| panic!("cannot start fixture {command:?}: {err}"));
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout piped"));
        let mut line = String::new();
        stdout.read_line(&mut line).expect("ready line");
        let pid = line
            .strip_prefix("ready ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("fixture {command:?} said {line:?}"));
        Fixture { child, pid, stdout }
    }

    /// Lets the fixture do its work and waits for its `done` line.
    pub fn go(&mut self) {
        self.send_line();
        self.expect_line("done");
    }

    /// Sends one line on the fixture's stdin.
    pub fn send_line(&mut self) {
        let stdin = self.child.stdin.as_mut().expect("stdin piped");
        stdin.write_all(b"\n").expect("go");
        stdin.flush().expect("flush");
    }

    /// Reads the fixture's stdout until a line equal to `text`.
    pub fn expect_line(&mut self, text: &str) {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).expect("fixture output");
            assert!(n > 0, "fixture exited before `{text}`");
            if line.trim() == text {
                return;
            }
        }
    }

    /// Reads the fixture's stdout until a line starting with `prefix`;
    /// returns the rest of it, trimmed.
    pub fn line_starting(&mut self, prefix: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).expect("fixture output");
            assert!(n > 0, "fixture exited before a `{prefix}` line");
            if let Some(rest) = line.trim().strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
    }

    pub fn wait(mut self) {
        let _ = self.child.wait();
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A memtrace process running in the background.
pub struct Tracer {
    pub child: Child,
    /// Collects stdout as it comes, so interim reports never fill the pipe.
    stdout: Option<std::thread::JoinHandle<String>>,
    stderr: Option<ChildStderr>,
    pub stderr_text: String,
}

impl Tracer {
    /// Starts memtrace with `args` and waits until it says it is tracing.
    pub fn attach(args: &[&str]) -> Tracer {
        Tracer::attach_env(args, &[])
    }

    /// [`Tracer::attach`] with extra environment variables
    /// (`MEMTRACE_EBPF_VARIANT=compat`).
    pub fn attach_env(args: &[&str], env: &[(&str, &str)]) -> Tracer {
        let mut command = Command::new(MEMTRACE);
        command.args(args).envs(env.iter().copied());
        Tracer::attach_command(command)
    }

    /// [`Tracer::attach`] of a command that ends in an `exec` of memtrace
    /// (same pid), e.g. through `unshare`. When memtrace says unwind tables
    /// are still being built (attached by pid with objects not in the table
    /// cache), this waits for `unwind tables ready` too, so stacks are whole.
    pub fn attach_command(command: Command) -> Tracer {
        let mut tracer = Tracer::attach_tracing(command);
        if tracer.stderr_text.contains("unwind tables still building") {
            tracer.wait_for_stderr("unwind tables ready");
        }
        tracer
    }

    /// [`Tracer::attach_command`] without waiting for the unwind tables: the
    /// first line that says memtrace is tracing.
    pub fn attach_tracing(mut command: Command) -> Tracer {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("memtrace starts");
        let mut stderr = child.stderr.take().expect("stderr piped");
        let mut seen = String::new();
        let mut byte = [0u8; 1];
        while !seen.contains("memtrace: tracing") {
            match stderr.read(&mut byte) {
                Ok(1) => seen.push(byte[0] as char),
                _ => {
                    let _ = child.wait();
                    panic!("memtrace ended before attaching: {seen}");
                }
            }
        }
        while !seen.ends_with('\n') {
            match stderr.read(&mut byte) {
                Ok(1) => seen.push(byte[0] as char),
                _ => break,
            }
        }
        let mut out = child.stdout.take().expect("stdout piped");
        let stdout = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = out.read_to_string(&mut text);
            text
        });
        Tracer {
            child,
            stdout: Some(stdout),
            stderr: Some(stderr),
            stderr_text: seen,
        }
    }

    /// Like [`Tracer::report`], for a JSON Lines stream (interim reports): the last line.
    pub fn report_last_line(self) -> (Value, String) {
        self.report_with(|stdout| {
            stdout
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .to_string()
        })
    }

    /// Waits for memtrace to end (bounded, as a safety net) and parses its JSON report.
    pub fn report(self) -> (Value, String) {
        self.report_with(|stdout| stdout.to_string())
    }

    fn report_with(mut self, pick: impl Fn(&str) -> String) -> (Value, String) {
        let deadline = Instant::now() + Duration::from_secs(120);
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "memtrace did not end");
            std::thread::sleep(Duration::from_millis(50));
        };
        let stdout = self
            .stdout
            .take()
            .map(|reader| reader.join().unwrap_or_default())
            .unwrap_or_default();
        if let Some(mut err) = self.stderr.take() {
            let _ = err.read_to_string(&mut self.stderr_text);
        }
        assert!(
            status.success(),
            "memtrace failed: {status}\nstderr: {}",
            self.stderr_text
        );
        let text = pick(&stdout);
        let report: Value =
            serde_json::from_str(&text).unwrap_or_else(|err| panic!("bad JSON ({err}): {stdout}"));
        (report, self.stderr_text)
    }

    /// Reads memtrace's stderr until it contains `needle`.
    pub fn wait_for_stderr(&mut self, needle: &str) {
        self.read_stderr_until(0, needle, &[]);
    }

    /// Waits for every line of `after`, then for `needle` in what memtrace
    /// wrote after the last of them (not an earlier line of the same text).
    pub fn wait_for_stderr_after(&mut self, after: &[&str], needle: &str) {
        for marker in after {
            self.wait_for_stderr(marker);
        }
        let from = after
            .iter()
            .filter_map(|marker| self.stderr_text.find(marker).map(|at| at + marker.len()))
            .max()
            .unwrap_or(0);
        self.read_stderr_until(from, needle, after);
    }

    /// Reads memtrace's stderr until `needle` is in it from byte `from` on.
    fn read_stderr_until(&mut self, from: usize, needle: &str, after: &[&str]) {
        let Some(stderr) = self.stderr.as_mut() else {
            panic!("stderr already consumed");
        };
        let mut byte = [0u8; 1];
        while !self.stderr_text[from..].contains(needle) {
            match stderr.read(&mut byte) {
                Ok(1) => self.stderr_text.push(byte[0] as char),
                _ => panic!(
                    "memtrace stderr ended before {needle:?} (after {after:?}): {}",
                    self.stderr_text
                ),
            }
        }
    }

    pub fn signal(&self, signal: i32) {
        // SAFETY: kill with a valid pid of our own child and a valid signal.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }
}

/// Starts fixture `name` (waiting 30 s for its go line), attaches memtrace by
/// pid with `--format json --top 500` plus `extra`, lets the fixture do its
/// work, and returns the final JSON report (the last line of the stream).
pub fn trace_fixture(name: &str, extra: &[&str]) -> Value {
    let mut fixture = Fixture::start(name, &["30", "30"]);
    let pid = fixture.pid.to_string();
    let mut args = vec!["--pid", pid.as_str(), "--format", "json", "--top", "500"];
    args.extend_from_slice(extra);
    let tracer = Tracer::attach(&args);
    fixture.go();
    if !extra.contains(&"--duration") {
        tracer.signal(libc::SIGINT);
    }
    tracer.report_last_line().0
}

/// Runs memtrace with `args` to completion and returns what it did.
pub fn memtrace(args: &[&str]) -> std::process::Output {
    Command::new(MEMTRACE)
        .args(args)
        .output()
        .expect("memtrace runs")
}

/// Asserts a clean refusal: exit `code`, `needle` on stderr, a line or two,
/// no panic and no backtrace.
pub fn assert_one_clear_line(out: &std::process::Output, code: i32, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "exit code; stderr: {stderr}");
    assert!(
        stderr.contains(needle),
        "stderr mentions {needle:?}: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "no panic: {stderr}");
    assert!(
        !stderr.contains("stack backtrace"),
        "no backtrace: {stderr}"
    );
    let lines = stderr.lines().filter(|l| !l.trim().is_empty()).count();
    assert!(lines <= 2, "a line or two: {stderr}");
}

/// Runs memtrace in launch mode (`--format json --top 500`) on fixture
/// `name` with `fixture_args`, `env` set, until it exits successfully; the
/// report goes to a file (the fixture writes on stdout too). The report and
/// memtrace's stderr.
pub fn launch_report(env: &[(&str, &str)], name: &str, fixture_args: &[&str]) -> (Value, String) {
    let path = std::env::temp_dir().join(format!(
        "memtrace-{name}-{}-{}.json",
        std::process::id(),
        REPORT_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let out = Command::new(MEMTRACE)
        .envs(env.iter().copied())
        .args(["--format", "json", "--top", "500", "--output"])
        .arg(&path)
        .arg("--")
        .arg(fixture(name))
        .args(fixture_args)
        .output()
        .expect("memtrace runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{env:?}: {stderr}");
    let text = std::fs::read(&path).expect("the report file");
    let _ = std::fs::remove_file(&path);
    let report = serde_json::from_slice(&text).expect("JSON report");
    (report, stderr)
}

/// Numbers the report files of [`launch_report`] (tests run in parallel).
static REPORT_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Runs memtrace to completion (launch mode) and parses its JSON report.
pub fn run_json(args: &[&str]) -> Value {
    let out = Command::new(MEMTRACE)
        .args(args)
        .output()
        .expect("memtrace runs");
    assert!(
        out.status.success(),
        "memtrace failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|err| panic!("bad JSON ({err}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// The sites whose first frame is `symbol`.
pub fn sites_of<'a>(report: &'a Value, symbol: &str) -> Vec<&'a Value> {
    report["sites"]
        .as_array()
        .map(|sites| {
            sites
                .iter()
                .filter(|site| site["frames"][0]["symbol"].as_str() == Some(symbol))
                .collect()
        })
        .unwrap_or_default()
}

/// (live bytes, live count) summed over the sites whose first frame is `symbol`.
pub fn site_totals(report: &Value, symbol: &str) -> (u64, u64) {
    sites_of(report, symbol)
        .iter()
        .fold((0, 0), |(bytes, count), site| {
            (
                bytes + site["live_bytes"].as_u64().unwrap_or(0),
                count + site["live_count"].as_u64().unwrap_or(0),
            )
        })
}

pub fn total_for(report: &Value, allocator: &str) -> (u64, u64) {
    report["totals"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["allocator"] == allocator)
        .fold((0, 0), |(b, c), t| {
            (
                b + t["live_bytes"].as_u64().unwrap_or(0),
                c + t["live_count"].as_u64().unwrap_or(0),
            )
        })
}

/// A v1 `pids` cgroup named as Docker names a container's
/// (`docker-<64 hex>.scope`); processes moved back and the cgroup removed
/// on drop.
pub struct FakeContainer {
    pub dir: std::path::PathBuf,
    pub id: String,
}

impl FakeContainer {
    /// `tag` tells apart the containers of one test process.
    pub fn create(tag: u64) -> Option<FakeContainer> {
        let root = std::path::Path::new("/sys/fs/cgroup/pids");
        if !root.join("cgroup.procs").exists() {
            return None;
        }
        // The first 12 characters (what `--container` takes) differ per test
        // process and tag.
        let id = format!("{:08x}{tag:04x}", std::process::id()).repeat(6)[..64].to_string();
        let dir = root.join(format!("docker-{id}.scope"));
        std::fs::create_dir(&dir).ok()?;
        Some(FakeContainer { dir, id })
    }

    pub fn enter(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).expect("join cgroup");
    }
}

impl Drop for FakeContainer {
    fn drop(&mut self) {
        if let Ok(procs) = std::fs::read_to_string(self.dir.join("cgroup.procs")) {
            for pid in procs.lines() {
                let _ = std::fs::write("/sys/fs/cgroup/pids/cgroup.procs", pid);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
