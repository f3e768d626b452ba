//! Prometheus exporter: renders a [`Report`] in the text exposition format
//! (version 0.0.4) and serves the latest rendering at `GET /metrics` from a
//! minimal HTTP/1.1 server. The server answers one request per connection,
//! each in its own task, with the request head bounded in size and time so
//! that a slow or hostile client cannot hold it up. It binds loopback unless
//! the user names another address.

// Wired into the trace loop by the lead.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

use crate::report::Report;
use crate::sink::frame_name;
use crate::tracee::container::Placement;

/// At most this many sites get a `memtrace_site_live_bytes` series.
pub const TOP_SITES: usize = 20;
/// The largest request head read before answering 431.
const MAX_HEAD: usize = 8 * 1024;
/// A client has this long to send its request head, and to take the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a closing connection waits for the client to stop sending.
const LINGER: Duration = Duration::from_secs(1);
/// Connections served at once; more are closed unanswered.
const MAX_CONNECTIONS: usize = 64;
/// The content type of the text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The report in the Prometheus text exposition format.
pub fn render(report: &Report) -> String {
    let mut out = Text::default();

    out.family("memtrace_up", "gauge", "1 while memtrace is tracing.");
    out.sample("memtrace_up", &[], 1);

    out.family(
        "memtrace_live_bytes",
        "gauge",
        "Bytes allocated and not yet freed, by allocator and memory kind.",
    );
    for t in &report.totals {
        let labels = [
            ("allocator", t.allocator.name()),
            ("memory", t.memory.name()),
        ];
        out.sample("memtrace_live_bytes", &labels, t.live_bytes);
    }
    out.family(
        "memtrace_live_blocks",
        "gauge",
        "Blocks allocated and not yet freed, by allocator and memory kind.",
    );
    for t in &report.totals {
        let labels = [
            ("allocator", t.allocator.name()),
            ("memory", t.memory.name()),
        ];
        out.sample("memtrace_live_blocks", &labels, t.live_count);
    }

    if let Some(check) = report.leak_check.as_ref().filter(|c| c.ran) {
        out.family(
            "memtrace_leak_check_bytes",
            "gauge",
            "Live bytes by the latest leak check's category (valgrind's: definitely_lost, indirectly_lost, possibly_lost, still_reachable).",
        );
        let categories = [
            ("definitely_lost", check.split.definitely_lost),
            ("indirectly_lost", check.split.indirectly_lost),
            ("possibly_lost", check.split.possibly_lost),
            ("still_reachable", check.split.still_reachable),
        ];
        for (name, amount) in categories {
            out.sample(
                "memtrace_leak_check_bytes",
                &[("category", name)],
                amount.bytes,
            );
        }
        out.family(
            "memtrace_leak_check_blocks",
            "gauge",
            "Live blocks by the latest leak check's category.",
        );
        for (name, amount) in categories {
            out.sample(
                "memtrace_leak_check_blocks",
                &[("category", name)],
                amount.blocks,
            );
        }
        out.family(
            "memtrace_leak_check_pause_seconds",
            "gauge",
            "How long the latest leak check held the target stopped.",
        );
        out.sample_f64("memtrace_leak_check_pause_seconds", check.pause_ms / 1000.0);
    }

    out.family(
        "memtrace_site_live_bytes",
        "gauge",
        "Live bytes of the top allocation sites (site: the allocator's caller).",
    );
    for (index, site) in report.sites.iter().take(TOP_SITES).enumerate() {
        let name = site
            .frames
            .first()
            .map_or_else(|| "[no stack]".to_string(), frame_name);
        let rank = (index + 1).to_string();
        // The innermost Python frame, where the site has one: sites of one
        // interpreter function differ by it.
        let python = site
            .frames
            .iter()
            .find(|f| f.kind == crate::report::FrameKind::Python)
            .map(frame_name);
        let mut labels = vec![
            ("allocator", site.allocator.name()),
            ("memory", site.memory.name()),
            ("site", name.as_str()),
            ("rank", rank.as_str()),
        ];
        if let Some(python) = &python {
            labels.push(("python", python.as_str()));
        }
        out.sample("memtrace_site_live_bytes", &labels, site.live_bytes);
    }

    out.family(
        "memtrace_process_live_bytes",
        "gauge",
        "Live bytes per traced process, with its namespace pid and container where it has them.",
    );
    for process in &report.processes {
        let pid = process.pid.to_string();
        let placed = placement_labels(&process.placement);
        let mut labels = vec![("pid", pid.as_str()), ("comm", process.comm.as_str())];
        labels.extend(placed.iter().map(|(key, value)| (*key, value.as_str())));
        out.sample("memtrace_process_live_bytes", &labels, process.live_bytes);
    }

    out.family(
        "memtrace_events_total",
        "counter",
        "Events seen since tracing started, by kind.",
    );
    let e = &report.events;
    for (kind, value) in [
        ("allocs", e.allocs),
        ("frees", e.frees),
        ("lost", e.lost),
        ("unmatched_frees", e.unmatched_frees),
        ("stack_failures", e.stack_failures),
        ("failed_calls", e.failed_calls),
        ("table_full", e.table_full),
    ] {
        out.sample("memtrace_events_total", &[("kind", kind)], value);
    }

    out.family(
        "memtrace_lost_events_total",
        "counter",
        "Events that never reached memtrace, by cause.",
    );
    for (cause, value) in &report.lost_by_cause {
        out.sample("memtrace_lost_events_total", &[("cause", cause)], *value);
    }

    out.family(
        "memtrace_failed_calls_total",
        "counter",
        "Allocator calls that returned an error, by function and code.",
    );
    let mut failed: BTreeMap<(&str, i64), u64> = BTreeMap::new();
    for call in &report.failed_calls {
        *failed
            .entry((call.function.as_str(), call.code))
            .or_default() += call.count;
    }
    for ((function, code), count) in failed {
        let code = code.to_string();
        let labels = [("function", function), ("code", code.as_str())];
        out.sample("memtrace_failed_calls_total", &labels, count);
    }

    out.family(
        "memtrace_report_complete",
        "gauge",
        "0 when events were lost or the live table was full: live figures may be wrong.",
    );
    out.sample("memtrace_report_complete", &[], u64::from(report.complete));
    out.family(
        "memtrace_trace_duration_seconds",
        "gauge",
        "How long memtrace has been tracing.",
    );
    out.sample_f64(
        "memtrace_trace_duration_seconds",
        report.duration_ms as f64 / 1000.0,
    );
    let pushes: Vec<&crate::report::PushStats> = report.push.iter().chain(&report.otlp).collect();
    if !pushes.is_empty() {
        out.family(
            "memtrace_push_reports_total",
            "counter",
            "Reports pushed to the profile store (--pyroscope) or the OpenTelemetry Collector (--otlp-profiles), by endpoint and outcome: sent, failed (given up after retries), dropped (never tried: queue full or memtrace ending), skipped_empty (no live site).",
        );
        for (outcome, value) in [
            (
                "sent",
                (|p: &crate::report::PushStats| p.sent) as fn(&_) -> u64,
            ),
            ("failed", |p| p.failed),
            ("dropped", |p| p.dropped),
            ("skipped_empty", |p| p.skipped_empty),
        ] {
            for push in &pushes {
                let labels = [("endpoint", push.endpoint.as_str()), ("outcome", outcome)];
                out.sample("memtrace_push_reports_total", &labels, value(push));
            }
        }
        out.family(
            "memtrace_push_retries_total",
            "counter",
            "Tries of a push after a first one failed.",
        );
        for push in &pushes {
            let labels = [("endpoint", push.endpoint.as_str())];
            out.sample("memtrace_push_retries_total", &labels, push.retries);
        }
    }
    out.0
}

/// Text exposition writer.
#[derive(Default)]
struct Text(String);

impl Text {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: u64) {
        self.series(name, labels);
        let _ = writeln!(self.0, " {value}");
    }

    fn sample_f64(&mut self, name: &str, value: f64) {
        self.series(name, &[]);
        let _ = writeln!(self.0, " {value}");
    }

    fn series(&mut self, name: &str, labels: &[(&str, &str)]) {
        self.0.push_str(name);
        if labels.is_empty() {
            return;
        }
        self.0.push('{');
        for (index, (key, value)) in labels.iter().enumerate() {
            if index > 0 {
                self.0.push(',');
            }
            let _ = write!(self.0, "{key}=\"{}\"", escape_label(value));
        }
        self.0.push('}');
    }
}

/// The labels of where a process lives, those it has, in a fixed order:
/// `ns_pid`, `container_id`, `container_runtime`, `pod_uid`, `pod_name`,
/// `pod_namespace`, `container_name`, `cgroup`. Not `pod`/`namespace`: a
/// scrape of memtrace's own pod sets those.
pub fn placement_labels(placement: &Placement) -> Vec<(&'static str, String)> {
    [
        ("ns_pid", placement.ns_pid.map(|p| p.to_string())),
        ("container_id", placement.container_id.clone()),
        ("container_runtime", placement.container_runtime.clone()),
        ("pod_uid", placement.pod_uid.clone()),
        ("pod_name", placement.pod_name.clone()),
        ("pod_namespace", placement.pod_namespace.clone()),
        ("container_name", placement.container_name.clone()),
        ("cgroup", placement.cgroup.clone()),
    ]
    .into_iter()
    .filter_map(|(key, value)| Some((key, value?)))
    .collect()
}

/// `{k="v",...}` for `labels`, values escaped (empty: no braces).
pub fn label_set(labels: &[(&str, &str)]) -> String {
    if labels.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = labels
        .iter()
        .map(|(key, value)| format!("{key}=\"{}\"", escape_label(value)))
        .collect();
    format!("{{{}}}", inner.join(","))
}

/// Label values escape backslash, double quote and line feed.
fn escape_label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// HELP text escapes backslash and line feed.
fn escape_help(text: &str) -> String {
    text.replace('\\', "\\\\").replace('\n', "\\n")
}

/// Parses a `--prometheus` address: `PORT` or `:PORT` (loopback),
/// `HOST:PORT` with an IP address or `localhost`, or `[IPV6]:PORT`.
pub fn parse_bind(text: &str) -> Result<SocketAddr, String> {
    let text = text.trim();
    let bad = |why: &str| {
        format!(
            "invalid address '{text}': {why} (examples: 9464, :9464, 127.0.0.1:9464, [::1]:9464)"
        )
    };
    let port = |digits: &str| -> Result<u16, String> {
        match digits.parse::<u16>() {
            Ok(0) => Err(bad("the port must be 1-65535")),
            Ok(port) => Ok(port),
            Err(_) => Err(bad("the port must be a number from 1 to 65535")),
        }
    };
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    if !text.contains(':') {
        return Ok(SocketAddr::new(loopback, port(text)?));
    }
    if let Some(digits) = text.strip_prefix(':') {
        return Ok(SocketAddr::new(loopback, port(digits)?));
    }
    if let Some(rest) = text.strip_prefix('[') {
        let (host, digits) = rest
            .split_once("]:")
            .ok_or_else(|| bad("expected [IPV6]:PORT"))?;
        let ip: std::net::Ipv6Addr = host.parse().map_err(|_| bad("not an IPv6 address"))?;
        return Ok(SocketAddr::new(IpAddr::V6(ip), port(digits)?));
    }
    let (host, digits) = text
        .rsplit_once(':')
        .ok_or_else(|| bad("expected HOST:PORT"))?;
    if host.contains(':') {
        return Err(bad("write an IPv6 address in brackets"));
    }
    let ip = if host.eq_ignore_ascii_case("localhost") {
        loopback
    } else {
        host.parse::<IpAddr>()
            .map_err(|_| bad("the host must be an IP address or localhost"))?
    };
    Ok(SocketAddr::new(ip, port(digits)?))
}

/// Binds `addr` and serves the latest rendering at `/metrics` until the task
/// is dropped; fails only when the address cannot be bound.
#[cfg(test)]
pub async fn serve(addr: SocketAddr, latest: watch::Receiver<Arc<String>>) -> io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    serve_on(listener, latest).await
}

/// Serves on a listener the caller bound (so it can learn its port first).
pub async fn serve_on(
    listener: TcpListener,
    latest: watch::Receiver<Arc<String>>,
) -> io::Result<()> {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                // Out of descriptors and the like pass; don't spin on them.
                log::warn!("prometheus: accept failed: {err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            log::debug!("prometheus: too many connections, closing one from {peer}");
            continue;
        };
        let body = latest.borrow().clone();
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(err) = answer(stream, &body).await {
                log::debug!("prometheus: connection from {peer}: {err}");
            }
        });
    }
}

/// Reads one request head and writes one response, then closes.
async fn answer(mut stream: TcpStream, body: &str) -> io::Result<()> {
    let head = match tokio::time::timeout(IO_TIMEOUT, read_head(&mut stream)).await {
        Ok(head) => head?,
        Err(_) => Head::TimedOut,
    };
    let (status, extra, body) = match head {
        Head::Request { method, path } => {
            let path = path.split('?').next().unwrap_or_default();
            if method != "GET" {
                (
                    "405 Method Not Allowed",
                    "Allow: GET\r\n",
                    "method not allowed\n",
                )
            } else if path == "/metrics" {
                ("200 OK", "", body)
            } else {
                ("404 Not Found", "", "not found: try /metrics\n")
            }
        }
        Head::Malformed => ("400 Bad Request", "", "bad request\n"),
        Head::TooLarge => (
            "431 Request Header Fields Too Large",
            "",
            "request head too large\n",
        ),
        Head::TimedOut => ("408 Request Timeout", "", "request timeout\n"),
        Head::Closed => return Ok(()),
    };
    let content_type = if status.starts_with("200") {
        CONTENT_TYPE
    } else {
        "text/plain; charset=utf-8"
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(response.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    tokio::time::timeout(IO_TIMEOUT, write)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "client too slow to read"))??;
    // Lingering close: read what the client still sends (briefly, boundedly)
    // so that closing with unread input does not reset the connection and
    // destroy the answer before the client has read it.
    let drain = async {
        let mut sink = [0u8; 4096];
        let mut left: usize = 64 * 1024;
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, drain).await;
    Ok(())
}

enum Head {
    Request { method: String, path: String },
    Malformed,
    TooLarge,
    TimedOut,
    Closed,
}

/// Reads up to the blank line that ends the request head.
async fn read_head(stream: &mut TcpStream) -> io::Result<Head> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(if buf.is_empty() {
                Head::Closed
            } else {
                Head::Malformed
            });
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = find(&buf, b"\r\n\r\n").or_else(|| find(&buf, b"\n\n")) {
            return Ok(parse_head(&buf[..end]));
        }
        if buf.len() > MAX_HEAD {
            return Ok(Head::TooLarge);
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn parse_head(head: &[u8]) -> Head {
    let Ok(text) = std::str::from_utf8(head) else {
        return Head::Malformed;
    };
    let line = text.lines().next().unwrap_or_default();
    let mut parts = line.split_whitespace();
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(method), Some(path), Some(version), None) if version.starts_with("HTTP/1.") => {
            Head::Request {
                method: method.to_string(),
                path: path.to_string(),
            }
        }
        _ => Head::Malformed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::fixture;

    /// One parsed sample line: name, labels, value.
    type Line = (String, Vec<(String, String)>, f64);

    /// A strict reader of the text format: every line is a HELP/TYPE comment
    /// or `name{k="v",...} value`, with label escapes undone.
    fn parse(text: &str) -> Vec<Line> {
        let mut samples = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# ") {
                assert!(
                    rest.starts_with("HELP memtrace_") || rest.starts_with("TYPE memtrace_"),
                    "comment: {line}"
                );
                continue;
            }
            let name_end = line.find(['{', ' ']).expect("name ends");
            let name = &line[..name_end];
            assert!(
                name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "name: {name}"
            );
            let mut rest = &line[name_end..];
            let mut labels = Vec::new();
            if let Some(inner) = rest.strip_prefix('{') {
                let mut chars = inner.char_indices();
                let mut key = String::new();
                loop {
                    let (i, c) = chars.next().expect("label or }");
                    match c {
                        '}' => {
                            rest = &inner[i + 1..];
                            break;
                        }
                        ',' => {}
                        '=' => {
                            assert_eq!(chars.next().map(|(_, c)| c), Some('"'));
                            let mut value = String::new();
                            loop {
                                match chars.next().expect("value ends").1 {
                                    '"' => break,
                                    '\\' => match chars.next().expect("escape").1 {
                                        '\\' => value.push('\\'),
                                        '"' => value.push('"'),
                                        'n' => value.push('\n'),
                                        other => panic!("bad escape \\{other} in {line}"),
                                    },
                                    '\n' => panic!("raw newline"),
                                    c => value.push(c),
                                }
                            }
                            labels.push((std::mem::take(&mut key), value));
                        }
                        c => key.push(c),
                    }
                }
            }
            let value = rest
                .strip_prefix(' ')
                .expect("space before value")
                .parse::<f64>()
                .expect("numeric value");
            samples.push((name.to_string(), labels, value));
        }
        samples
    }

    fn find<'a>(samples: &'a [Line], name: &str, labels: &[(&str, &str)]) -> Option<&'a Line> {
        samples.iter().find(|(n, l, _)| {
            n == name
                && l.len() == labels.len()
                && labels
                    .iter()
                    .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
        })
    }

    #[test]
    fn a_leak_check_is_a_gauge_per_category() {
        let text = render(&fixture::checked_report());
        assert!(text.contains("# TYPE memtrace_leak_check_bytes gauge\n"));
        assert!(text.contains("memtrace_leak_check_bytes{category=\"definitely_lost\"} 300\n"));
        assert!(text.contains("memtrace_leak_check_blocks{category=\"still_reachable\"} 1\n"));
        assert!(text.contains("memtrace_leak_check_pause_seconds 0.0125\n"));
        assert!(!render(&fixture::report()).contains("memtrace_leak_check"));
    }

    #[test]
    fn prometheus_text_has_the_metrics() {
        let text = render(&fixture::report());
        assert!(text.contains("# TYPE memtrace_live_bytes gauge\n"));
        assert!(text.contains("# TYPE memtrace_events_total counter\n"));
        assert!(text.contains("memtrace_up 1\n"));
        assert!(text.contains("memtrace_live_bytes{allocator=\"libc\",memory=\"host\"} 350\n"));
        assert!(text.contains(
            "memtrace_site_live_bytes{allocator=\"cuda\",memory=\"device\",site=\"alloc_buffers\",rank=\"1\"} 4096\n"
        ));
        let samples = parse(&text);
        let value = |name: &str, labels: &[(&str, &str)]| {
            find(&samples, name, labels)
                .unwrap_or_else(|| panic!("missing {name} {labels:?}"))
                .2
        };
        assert_eq!(
            value(
                "memtrace_live_blocks",
                &[("allocator", "cuda"), ("memory", "device")]
            ),
            1.0
        );
        assert_eq!(value("memtrace_events_total", &[("kind", "allocs")]), 10.0);
        assert_eq!(
            value("memtrace_events_total", &[("kind", "unmatched_frees")]),
            1.0
        );
        assert_eq!(
            value("memtrace_events_total", &[("kind", "failed_calls")]),
            3.0
        );
        assert_eq!(
            value("memtrace_lost_events_total", &[("cause", "ringbuf_full")]),
            0.0
        );
        assert_eq!(
            value(
                "memtrace_failed_calls_total",
                &[("function", "cudaMalloc"), ("code", "2")]
            ),
            3.0
        );
        assert_eq!(
            value(
                "memtrace_site_live_bytes",
                &[
                    ("allocator", "libc"),
                    ("memory", "host"),
                    ("site", "app+0x100"),
                    ("rank", "2")
                ]
            ),
            300.0
        );
        assert_eq!(
            value(
                "memtrace_site_live_bytes",
                &[
                    ("allocator", "libc"),
                    ("memory", "host"),
                    ("site", "[no stack]"),
                    ("rank", "3")
                ]
            ),
            50.0
        );
        assert_eq!(value("memtrace_trace_duration_seconds", &[]), 2.5);
        // Every family is declared once, before its samples.
        for (name, _, _) in &samples {
            let family = name.as_str();
            assert_eq!(
                text.matches(&format!("# TYPE {family} ")).count(),
                1,
                "{family}"
            );
        }
    }

    #[test]
    fn push_counters_are_exported_only_with_a_push() {
        let mut report = fixture::report();
        assert!(!render(&report).contains("memtrace_push_"));
        report.push = Some(crate::report::PushStats {
            endpoint: "http://store:4040/push.v1.PusherService/Push".into(),
            sent: 3,
            failed: 2,
            dropped: 1,
            retries: 5,
            skipped_empty: 4,
            last_error: Some("HTTP 500".into()),
        });
        let text = render(&report);
        let samples = parse(&text);
        let endpoint = ("endpoint", "http://store:4040/push.v1.PusherService/Push");
        for (outcome, value) in [
            ("sent", 3u32),
            ("failed", 2),
            ("dropped", 1),
            ("skipped_empty", 4),
        ] {
            let found = find(
                &samples,
                "memtrace_push_reports_total",
                &[endpoint, ("outcome", outcome)],
            );
            assert_eq!(
                found.map(|l| l.2),
                Some(f64::from(value)),
                "{outcome}: {text}"
            );
        }
        let retries = find(&samples, "memtrace_push_retries_total", &[endpoint]);
        assert_eq!(retries.map(|l| l.2), Some(5.0));
    }

    #[test]
    fn prometheus_label_values_are_escaped() {
        let mut report = fixture::report();
        report.sites[0].frames[0].symbol = Some("say \"hi\"\\n\nnext".into());
        let text = render(&report);
        assert!(text.contains(r#"site="say \"hi\"\\n\nnext""#), "{text}");
        let samples = parse(&text);
        let site = find(
            &samples,
            "memtrace_site_live_bytes",
            &[
                ("allocator", "cuda"),
                ("memory", "device"),
                ("site", "say \"hi\"\\n\nnext"),
                ("rank", "1"),
            ],
        );
        assert!(site.is_some());
    }

    #[test]
    fn processes_in_pods_are_labelled_with_the_pod() {
        let mut report = fixture::report();
        report.processes = vec![crate::report::ProcessInfo {
            pid: 4242,
            comm: "server".into(),
            live_bytes: 64,
            placement: crate::tracee::container::Placement::sample_pod(),
            ..Default::default()
        }];
        let samples = parse(&render(&report));
        let id = "ab".repeat(32);
        let value = find(
            &samples,
            "memtrace_process_live_bytes",
            &[
                ("pid", "4242"),
                ("comm", "server"),
                ("ns_pid", "7"),
                ("container_id", &id),
                ("container_runtime", "containerd"),
                ("pod_uid", "0a1b2c3d-4e5f-6789-abcd-ef0123456789"),
                ("pod_name", "web-0"),
                ("pod_namespace", "shop"),
                ("container_name", "app"),
            ],
        )
        .map(|line| line.2);
        assert_eq!(value, Some(64.0));
    }

    #[test]
    fn python_sites_carry_their_python_line() {
        let mut report = fixture::report();
        report.sites[0]
            .frames
            .push(crate::interp::python::merge::python_frame(
                &crate::interp::python::resolve::PyFrame {
                    name: "handle".into(),
                    file: Some("/srv/app.py".into()),
                    line: Some(8),
                },
            ));
        let text = render(&report);
        assert!(text.contains(r#"python="handle (app.py:8)""#), "{text}");
    }

    #[test]
    fn prometheus_bind_addresses_parse() {
        let v4 = |a: [u8; 4], port| SocketAddr::from((a, port));
        assert_eq!(parse_bind("9464"), Ok(v4([127, 0, 0, 1], 9464)));
        assert_eq!(parse_bind(":9464"), Ok(v4([127, 0, 0, 1], 9464)));
        assert_eq!(parse_bind("0.0.0.0:80"), Ok(v4([0, 0, 0, 0], 80)));
        assert_eq!(parse_bind("localhost:9464"), Ok(v4([127, 0, 0, 1], 9464)));
        assert_eq!(
            parse_bind("[::1]:9464"),
            Ok(SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, 9464)))
        );
        for bad in [
            "",
            "0",
            ":x",
            "70000",
            "host.example:1",
            "::1:9464",
            "[::1]",
            "1.2.3.4:",
        ] {
            assert!(parse_bind(bad).is_err(), "{bad:?} accepted");
        }
    }

    async fn get(addr: SocketAddr, request: &str) -> String {
        let mut stream = TcpStream::connect(addr).await.expect("connects");
        stream.write_all(request.as_bytes()).await.expect("sends");
        let mut response = String::new();
        tokio::time::timeout(
            Duration::from_secs(10),
            stream.read_to_string(&mut response),
        )
        .await
        .expect("answers in time")
        .expect("reads");
        response
    }

    #[tokio::test]
    async fn prometheus_serves_metrics_over_http() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = listener.local_addr().expect("address");
        let (tx, rx) = watch::channel(Arc::new(render(&fixture::report())));
        let server = tokio::spawn(serve_on(listener, rx));

        let ok = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("Content-Type: text/plain; version=0.0.4"));
        assert!(ok.contains("Connection: close"));
        let (_, body) = ok.split_once("\r\n\r\n").expect("head and body");
        assert_eq!(body, render(&fixture::report()));

        tx.send(Arc::new("memtrace_up 1\n".into()))
            .expect("updates");
        let updated = get(addr, "GET /metrics?x=1 HTTP/1.1\r\n\r\n").await;
        assert!(updated.ends_with("\r\n\r\nmemtrace_up 1\n"), "{updated}");

        let missing = get(addr, "GET /other HTTP/1.1\r\n\r\n").await;
        assert!(missing.starts_with("HTTP/1.1 404 "), "{missing}");
        let post = get(addr, "POST /metrics HTTP/1.1\r\n\r\n").await;
        assert!(post.starts_with("HTTP/1.1 405 "), "{post}");
        let garbage = get(addr, "hello\r\n\r\n").await;
        assert!(garbage.starts_with("HTTP/1.1 400 "), "{garbage}");
        let huge = format!(
            "GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n",
            "a".repeat(2 * MAX_HEAD)
        );
        let huge = get(addr, &huge).await;
        assert!(huge.starts_with("HTTP/1.1 431 "), "{huge}");
        server.abort();
    }

    #[tokio::test]
    async fn prometheus_serve_reports_a_taken_address() {
        let taken = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = taken.local_addr().expect("address");
        let (_tx, rx) = watch::channel(Arc::new(String::new()));
        let err = serve(addr, rx).await.expect_err("address in use");
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
    }

    #[tokio::test]
    async fn prometheus_slow_client_does_not_block_others() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binds");
        let addr = listener.local_addr().expect("address");
        let (_tx, rx) = watch::channel(Arc::new("memtrace_up 1\n".to_string()));
        let server = tokio::spawn(serve_on(listener, rx));
        // Sends half a request head and then nothing.
        let mut slow = TcpStream::connect(addr).await.expect("connects");
        slow.write_all(b"GET /met").await.expect("sends");
        let ok = get(addr, "GET /metrics HTTP/1.1\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        drop(slow);
        server.abort();
    }
}
