//! The visual outputs after a real trace: the HTML report opened in headless
//! Chromium and driven over the DevTools protocol (its DOM holds the
//! fixture's leak sites with their bytes, sorting and the site filter work
//! under real mouse clicks and typing, no console error, no request leaves
//! the page, a screenshot is saved under target/visual/), and `--live`
//! driven in tmux (the leaking function shows by the second refresh,
//! selecting it shows its stack, a 40x10 terminal and resizes do not break
//! it, `q` ends with the final report and exit code 0).
//!
//! Chromium and tmux come from Debian (`.ci/run` installs them); without
//! them these tests fail under `MEMTRACE_REQUIRE_KERNEL_TESTS` and are
//! skipped otherwise.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};

use crate::support::{fixture, privileged, MEMTRACE};

/// leaky_demo with 400 requests: format_response leaks 256 bytes every 4th
/// request, warm_cache keeps 16 blocks of 4096.
const FORMAT_RESPONSE: (u64, u64) = (100 * 256, 100);
const WARM_CACHE: (u64, u64) = (16 * 4096, 16);

fn tool(name: &str) -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        if std::env::var_os("MEMTRACE_REQUIRE_KERNEL_TESTS").is_some() {
            panic!("{name} is needed by the visual tests (.ci/run installs it)");
        }
        eprintln!("SKIPPED: {name} not installed");
    }
    found
}

/// A fresh directory under target/, kept after the test (artifacts).
fn artifacts(tag: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/visual")
        .join(tag);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("artifact dir");
    dir.canonicalize().expect("absolute")
}

/// A child process killed (and reaped) on drop.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A DevTools-protocol session with one page of a headless Chromium.
struct Browser {
    _process: Killed,
    socket: tungstenite::WebSocket<TcpStream>,
    session: String,
    next_id: u64,
    /// Every event received, in order.
    events: Vec<Value>,
}

impl Browser {
    fn start(chromium: &Path, profile: &Path) -> Browser {
        let mut child = Command::new(chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--remote-debugging-port=0",
                "--window-size=1400,1000",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg("about:blank")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("chromium starts");
        let stderr = child.stderr.take().expect("stderr piped");
        let process = Killed(child);
        let mut lines = BufReader::new(stderr).lines();
        let url = loop {
            let line = lines
                .next()
                .expect("chromium said where DevTools listen")
                .expect("stderr readable");
            if let Some(rest) = line.split("DevTools listening on ").nth(1) {
                break rest.trim().to_string();
            }
        };
        // Keep draining stderr so Chromium never blocks on it.
        std::thread::spawn(move || for _ in lines {});
        let address = url
            .strip_prefix("ws://")
            .and_then(|rest| rest.split('/').next())
            .expect("ws URL")
            .to_string();
        let stream = TcpStream::connect(&address).expect("connect to DevTools");
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .expect("timeout");
        let (socket, _) = tungstenite::client(url.as_str(), stream).expect("websocket handshake");
        let mut browser = Browser {
            _process: process,
            socket,
            session: String::new(),
            next_id: 0,
            events: Vec::new(),
        };
        let target = browser.call("Target.createTarget", json!({"url": "about:blank"}));
        let target_id = target["targetId"].as_str().expect("target id").to_string();
        let attached = browser.call(
            "Target.attachToTarget",
            json!({"targetId": target_id, "flatten": true}),
        );
        browser.session = attached["sessionId"]
            .as_str()
            .expect("session id")
            .to_string();
        for domain in [
            "Page.enable",
            "Runtime.enable",
            "Log.enable",
            "Network.enable",
        ] {
            browser.call(domain, json!({}));
        }
        browser
    }

    fn read(&mut self) -> Value {
        loop {
            match self.socket.read().expect("DevTools message") {
                tungstenite::Message::Text(text) => {
                    return serde_json::from_str(text.as_str()).expect("DevTools JSON")
                }
                tungstenite::Message::Close(_) => panic!("DevTools closed the socket"),
                _ => {}
            }
        }
    }

    /// Sends a command (to the page once attached) and waits for its result.
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({"id": id, "method": method, "params": params});
        if !self.session.is_empty() {
            message["sessionId"] = json!(self.session);
        }
        self.socket
            .send(tungstenite::Message::Text(message.to_string().into()))
            .expect("send to DevTools");
        loop {
            let reply = self.read();
            if reply["id"] == json!(id) {
                assert!(
                    reply.get("error").is_none(),
                    "{method} failed: {}",
                    reply["error"]
                );
                return reply["result"].clone();
            }
            self.events.push(reply);
        }
    }

    /// Waits until an event named `method` has arrived.
    fn wait_event(&mut self, method: &str) {
        while !self.events.iter().any(|e| e["method"] == method) {
            let event = self.read();
            self.events.push(event);
        }
    }

    /// Evaluates `expression` in the page and returns its value.
    fn eval(&mut self, expression: &str) -> Value {
        let result = self.call(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true, "awaitPromise": true}),
        );
        assert!(
            result.get("exceptionDetails").is_none(),
            "{expression}: {}",
            result["exceptionDetails"]
        );
        result["result"]["value"].clone()
    }

    /// A real mouse click in the middle of the element `selector` matches.
    fn click(&mut self, selector: &str) {
        let at = self.eval(&format!(
            "(() => {{ const e = document.querySelector({selector:?}); e.scrollIntoView(); \
             const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()"
        ));
        let (x, y) = (at[0].as_f64().expect("x"), at[1].as_f64().expect("y"));
        for kind in ["mousePressed", "mouseReleased"] {
            self.call(
                "Input.dispatchMouseEvent",
                json!({"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1}),
            );
        }
    }

    /// The sites table's rows: (top frame, bytes, blocks).
    fn rows(&mut self) -> Vec<(String, u64, u64)> {
        let rows = self.eval(
            "[...document.querySelectorAll('#rows tr')].map(tr => \
             [tr.cells[8].textContent, Number(tr.dataset.bytes), Number(tr.dataset.count)])",
        );
        rows.as_array()
            .expect("rows")
            .iter()
            .map(|r| {
                (
                    r[0].as_str().unwrap_or("").to_string(),
                    r[1].as_u64().unwrap_or(0),
                    r[2].as_u64().unwrap_or(0),
                )
            })
            .collect()
    }
}

fn run_memtrace(args: &[&str]) -> std::process::Output {
    let out = Command::new(MEMTRACE)
        .args(args)
        .output()
        .expect("memtrace runs");
    assert!(
        out.status.success(),
        "memtrace {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[test]
fn html_report_opens_in_chromium_with_the_leaks_sortable_and_filterable() {
    if !privileged() {
        return;
    }
    let Some(chromium) = tool("chromium") else {
        return;
    };
    let dir = artifacts("html");
    let page = dir.join("leaky_demo.html");
    let record = dir.join("leaky_demo.jsonl");
    let demo = fixture("leaky_demo");
    run_memtrace(&[
        "--format",
        "html",
        "--output",
        page.to_str().expect("utf-8"),
        "--record",
        record.to_str().expect("utf-8"),
        "--top",
        "500",
        "--",
        demo.to_str().expect("utf-8"),
        "400",
    ]);
    // The same report offline, from the recording.
    let replayed = dir.join("replayed.html");
    run_memtrace(&[
        "report",
        record.to_str().expect("utf-8"),
        "--format",
        "html",
        "--output",
        replayed.to_str().expect("utf-8"),
    ]);
    let text = std::fs::read_to_string(&replayed).expect("replayed page");
    assert!(text.contains("format_response") && text.contains("\"bytes\":25600"));

    let mut browser = Browser::start(&chromium, &dir.join("profile"));
    let url = format!("file://{}", page.display());
    browser.call("Page.navigate", json!({"url": url}));
    browser.wait_event("Page.loadEventFired");
    assert_eq!(browser.eval("document.body.dataset.ready"), json!("1"));

    // The known leaks, with their exact bytes and blocks.
    let rows = browser.rows();
    let find = |rows: &[(String, u64, u64)], name: &str| {
        rows.iter()
            .filter(|r| r.0 == name)
            .fold((0, 0), |acc, r| (acc.0 + r.1, acc.1 + r.2))
    };
    assert_eq!(find(&rows, "format_response"), FORMAT_RESPONSE, "{rows:?}");
    assert_eq!(find(&rows, "warm_cache"), WARM_CACHE, "{rows:?}");
    assert!(rows.len() >= 2);

    // Sorting by bytes: a click sorts descending, a second ascending.
    browser.click("th[data-key='bytes']");
    let bytes: Vec<u64> = browser.rows().iter().map(|r| r.1).collect();
    assert!(bytes.windows(2).all(|w| w[0] >= w[1]), "{bytes:?}");
    assert_eq!(
        browser.eval("document.querySelector(\"th[data-key='bytes']\").className"),
        json!("desc")
    );
    browser.click("th[data-key='bytes']");
    let bytes: Vec<u64> = browser.rows().iter().map(|r| r.1).collect();
    assert!(bytes.windows(2).all(|w| w[0] <= w[1]), "{bytes:?}");

    // The site filter, typed.
    browser.click("#filter");
    browser.call("Input.insertText", json!({"text": "format_resp"}));
    let filtered = browser.rows();
    assert!(!filtered.is_empty());
    assert!(
        filtered.iter().all(|r| r.0 == "format_response"),
        "{filtered:?}"
    );
    // A site's whole stack with file:line.
    browser.click("#rows tr");
    let detail = browser.eval("document.getElementById('detail').textContent");
    let detail = detail.as_str().unwrap_or("");
    assert!(detail.contains("handle_request"), "{detail}");
    assert!(detail.contains("leaky_demo.c:"), "{detail}");
    assert!(detail.contains("main"), "{detail}");
    browser.eval("document.getElementById('filter').select()");
    browser.call("Input.insertText", json!({"text": "no-such-site-anywhere"}));
    assert!(browser.rows().is_empty());
    assert_eq!(
        browser.eval("document.getElementById('count').textContent"),
        json!("no site matches")
    );
    browser.eval("document.getElementById('filter').select()");
    browser.call("Input.insertText", json!({"text": ""}));
    browser.click("#next");

    // The flame graph and the charts are in the page.
    assert_eq!(
        browser.eval("document.getElementById('flamegraph').src.startsWith('data:image/svg+xml')"),
        json!(true)
    );
    assert!(
        browser
            .eval("document.querySelectorAll('#charts svg polyline').length")
            .as_u64()
            .unwrap_or(0)
            >= 1
    );

    screenshot(&mut browser, &dir.join("screenshot.png"));
    assert_clean(&mut browser);
}

/// Lets anything late arrive, then checks: no console error or exception,
/// and no request beyond the page itself (`file:`) and inline `data:`.
fn assert_clean(browser: &mut Browser) {
    browser.eval("new Promise(r => setTimeout(r, 300))");
    let errors: Vec<&Value> = browser
        .events
        .iter()
        .filter(|e| {
            e["method"] == "Runtime.exceptionThrown"
                || (e["method"] == "Runtime.consoleAPICalled" && e["params"]["type"] == "error")
                || (e["method"] == "Log.entryAdded" && e["params"]["entry"]["level"] == "error")
        })
        .collect();
    assert!(errors.is_empty(), "console errors: {errors:?}");
    let requests: Vec<&str> = browser
        .events
        .iter()
        .filter(|e| e["method"] == "Network.requestWillBeSent")
        .filter_map(|e| e["params"]["request"]["url"].as_str())
        .collect();
    assert!(requests.iter().any(|u| u.starts_with("file://")));
    let outside: Vec<&&str> = requests
        .iter()
        .filter(|u| !u.starts_with("file://") && !u.starts_with("data:"))
        .collect();
    assert!(outside.is_empty(), "requests left the page: {outside:?}");
}

/// Saves a full-page screenshot as `path`.
fn screenshot(browser: &mut Browser, path: &Path) {
    let shot = browser.call(
        "Page.captureScreenshot",
        json!({"format": "png", "captureBeyondViewport": true}),
    );
    let png = base64::engine::general_purpose::STANDARD
        .decode(shot["data"].as_str().expect("screenshot"))
        .expect("base64");
    assert!(png.starts_with(b"\x89PNG"));
    std::fs::write(path, png).expect("screenshot saved");
}

#[test]
fn monitor_html_opens_in_chromium_with_the_gate_first() {
    if !privileged() {
        return;
    }
    let Some(chromium) = tool("chromium") else {
        return;
    };
    let dir = artifacts("monitor");
    let page = dir.join("soak.html");
    let demo = fixture("leaky_demo");
    let out = Command::new(MEMTRACE)
        .args(["monitor", "--interval", "100ms", "--duration", "2s"])
        .args(["--settle", "200ms", "--fail-on", "growth", "--html"])
        .arg(&page)
        .arg("--")
        .arg(&demo)
        .arg("100000")
        .output()
        .expect("memtrace monitor runs");
    assert!(
        matches!(out.status.code(), Some(0 | 3)),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut browser = Browser::start(&chromium, &dir.join("profile"));
    let url = format!("file://{}", page.display());
    browser.call("Page.navigate", json!({"url": url}));
    browser.wait_event("Page.loadEventFired");
    let first = browser.eval(
        "document.querySelector('section').id + ' ' + document.getElementById('gate-result').textContent",
    );
    let first = first.as_str().unwrap_or("");
    assert!(
        first.starts_with("gate PASSED") || first.starts_with("gate FAILED"),
        "{first}"
    );
    let rows = browser.eval("document.querySelectorAll('#verdict-table tr').length");
    assert!(rows.as_u64().unwrap_or(0) >= 2, "{rows}");
    assert!(
        browser
            .eval("[...document.querySelectorAll('.panel svg')].length")
            .as_u64()
            .unwrap_or(0)
            >= 1
    );
    let vmrss = browser.eval(
        "[...document.querySelectorAll('#verdict-table td')].some(td => td.textContent === 'VmRSS')",
    );
    assert_eq!(vmrss, json!(true));
    screenshot(&mut browser, &dir.join("screenshot.png"));
    assert_clean(&mut browser);
}

/// A tmux server of its own (its own socket), killed on drop.
struct Tmux {
    tmux: PathBuf,
    socket: String,
}

impl Tmux {
    fn new(tmux: PathBuf, tag: &str) -> Tmux {
        Tmux {
            tmux,
            socket: format!("memtrace-visual-{tag}-{}", std::process::id()),
        }
    }

    fn run(&self, args: &[&str]) -> String {
        let out = Command::new(&self.tmux)
            .args(["-L", &self.socket])
            .args(args)
            .output()
            .expect("tmux runs");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The visible screen.
    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "live"])
    }

    /// The screen and the history above it.
    fn everything(&self) -> String {
        self.run(&["capture-pane", "-p", "-S", "-2000", "-t", "live"])
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "live"];
        args.extend_from_slice(keys);
        self.run(&args);
    }

    /// Polls the screen until `ready` accepts it (bounded, as a safety net).
    fn wait_for(&self, what: &str, ready: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let screen = self.screen();
            if ready(&screen) {
                return screen;
            }
            assert!(
                Instant::now() < deadline,
                "never saw {what}; screen:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new(&self.tmux)
            .args(["-L", &self.socket, "kill-server"])
            .output();
    }
}

/// The refresh count the header shows (`refresh N`).
fn refresh_of(screen: &str) -> Option<u64> {
    screen
        .split("refresh ")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Starts `memtrace --live ...` on leaky_demo in a tmux pane of `width` x
/// `height`; the shell prints `EXIT=<code>` when memtrace ends.
fn start_live(tmux: &Tmux, width: u16, height: u16, extra: &str) {
    let demo = fixture("leaky_demo");
    let command = format!(
        "{MEMTRACE} --live --interval 2s {extra} -- {} 100000; echo EXIT=$?; sleep 600",
        demo.display()
    );
    tmux.run(&[
        "new-session",
        "-d",
        "-s",
        "live",
        "-x",
        &width.to_string(),
        "-y",
        &height.to_string(),
        &command,
    ]);
}

#[test]
fn live_view_in_tmux_shows_the_leak_its_stack_and_quits_with_the_report() {
    if !privileged() {
        return;
    }
    let Some(tmux_bin) = tool("tmux") else {
        return;
    };
    let dir = artifacts("live");
    let report = dir.join("final.json");
    let tmux = Tmux::new(tmux_bin, "big");
    start_live(
        &tmux,
        140,
        40,
        &format!("--format json --output {}", report.display()),
    );
    // The leaking function shows by the second refresh.
    let screen = tmux.wait_for("format_response", |s| s.contains("format_response"));
    let refresh = refresh_of(&screen).expect("refresh count in the header");
    assert!(refresh <= 2, "first shown at refresh {refresh}:\n{screen}");
    assert!(screen.contains("leaky_demo (pid"), "{screen}");
    assert!(screen.contains("libc host"), "{screen}");
    assert!(screen.contains("RSS"), "{screen}");

    // Select it: the stack pane shows its callers with file:line.
    let mut selected = String::new();
    for _ in 0..60 {
        let screen = tmux.screen();
        if screen
            .lines()
            .any(|l| l.contains('▶') && l.contains("format_response"))
        {
            selected = screen;
            break;
        }
        tmux.keys(&["Down"]);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!selected.is_empty(), "could not select format_response");
    let stack = tmux.wait_for("the stack of format_response", |s| {
        s.contains("#0  format_response") && s.contains("handle_request")
    });
    assert!(stack.contains("leaky_demo.c:"), "{stack}");
    tmux.keys(&["Enter"]);
    tmux.wait_for("the whole stack", |s| s.contains("#2  main"));
    tmux.keys(&["Escape"]);
    // Ctrl-L repaints the whole screen.
    tmux.keys(&["C-l"]);
    tmux.wait_for("the repainted view", |s| s.contains("format_response"));

    // Sort and filter keys change the header.
    tmux.keys(&["b"]);
    tmux.wait_for("sort by bytes", |s| s.contains("sort: bytes"));
    tmux.keys(&["a"]);
    tmux.wait_for("an allocator filter", |s| !s.contains("allocator: all"));
    tmux.keys(&["a", "a", "a", "a", "a", "a", "a", "a"]);
    tmux.keys(&["s"]);

    // Resize mid-run: tiny, then back.
    tmux.run(&["resize-window", "-t", "live", "-x", "40", "-y", "10"]);
    tmux.wait_for("a 40x10 redraw", |s| {
        s.contains("memtrace") && s.lines().all(|l| l.chars().count() <= 40)
    });
    tmux.run(&["resize-window", "-t", "live", "-x", "140", "-y", "40"]);
    tmux.wait_for("the big screen again", |s| s.contains("format_response"));

    // q: the final report is written and memtrace exits 0.
    tmux.keys(&["q"]);
    let end = tmux.wait_for("the exit code", |s| s.contains("EXIT="));
    assert!(end.contains("EXIT=0"), "{end}");
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(&report).expect("final report written"))
            .expect("final report is JSON");
    assert_eq!(json["interim"], json!(false));
    let leaked: u64 = json["sites"]
        .as_array()
        .expect("sites")
        .iter()
        .filter(|s| s["frames"][0]["symbol"] == "format_response")
        .map(|s| s["live_bytes"].as_u64().unwrap_or(0))
        .sum();
    assert!(leaked >= 256, "{json}");
    std::fs::write(dir.join("screen-stack.txt"), stack).expect("artifact");
}

#[test]
fn live_view_in_a_40x10_terminal_survives_resizes_and_prints_the_report() {
    if !privileged() {
        return;
    }
    let Some(tmux_bin) = tool("tmux") else {
        return;
    };
    let tmux = Tmux::new(tmux_bin, "small");
    start_live(&tmux, 40, 10, "");
    // The header's refresh count is cut off at 40 columns: wait for sites.
    tmux.wait_for("a refresh with sites", |s| {
        s.contains(" sites (") && !s.contains(" sites (0)")
    });
    for (w, h) in [(20, 5), (3, 2), (100, 30), (40, 10)] {
        tmux.run(&[
            "resize-window",
            "-t",
            "live",
            "-x",
            &w.to_string(),
            "-y",
            &h.to_string(),
        ]);
        std::thread::sleep(Duration::from_millis(300));
    }
    tmux.keys(&["Down", "Enter", "Down", "Escape", "?", "?"]);
    let screen = tmux.wait_for("the view after resizes", |s| s.contains("memtrace"));
    assert!(!screen.contains("panicked"), "{screen}");
    tmux.run(&["resize-window", "-t", "live", "-x", "120", "-y", "50"]);
    tmux.keys(&["q"]);
    tmux.wait_for("the exit code", |s| s.contains("EXIT="));
    // The text report went to stdout after the alternate screen was left.
    let all = tmux.everything();
    assert!(all.contains("EXIT=0"), "{all}");
    assert!(all.contains("format_response"), "{all}");
    assert!(!all.contains("panicked"), "{all}");
}

#[test]
fn live_without_a_terminal_traces_as_without_it() {
    if !privileged() {
        return;
    }
    let demo = fixture("leaky_demo");
    let out = run_memtrace(&[
        "--live",
        "--interval",
        "500ms",
        "--format",
        "json",
        "--",
        demo.to_str().expect("utf-8"),
        "400",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--live: stdout is not a terminal"),
        "{stderr}"
    );
    // Today's behaviour: JSON Lines, interim reports then the final one.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last: Value = serde_json::from_str(
        stdout
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .expect("a report"),
    )
    .expect("JSON");
    assert_eq!(last["interim"], json!(false));
    let leaked: u64 = last["sites"]
        .as_array()
        .expect("sites")
        .iter()
        .filter(|s| s["frames"][0]["symbol"] == "format_response")
        .map(|s| s["live_bytes"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(leaked, FORMAT_RESPONSE.0);
    assert!(!stdout.contains('\u{1b}'), "no terminal control sequences");
}
