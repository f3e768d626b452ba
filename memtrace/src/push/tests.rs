//! The push against an in-process HTTP receiver (std `TcpListener`) that
//! decodes what it gets with the same prost messages and memtrace's pprof
//! types; and, opt-in, against a real Pyroscope at `MEMTRACE_PYROSCOPE_URL`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prost::Message;

use super::proto::PushRequest;
use super::*;
use crate::report::Report;
use crate::sink::fixture;
use crate::sink::pprof::proto::Profile;

/// One request as the receiver saw it.
#[derive(Clone, Debug)]
struct Received {
    method: String,
    path: String,
    /// Lower-case names.
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
}

/// How the receiver answers.
#[derive(Clone)]
enum Answer {
    /// These statuses in turn, the last one for every later request.
    Statuses(Vec<u16>),
    /// Reads the request, then says nothing until the client gives up.
    Silent,
}

struct Receiver {
    url: String,
    got: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    fn start(answer: Answer) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let got = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&got);
        std::thread::spawn(move || {
            for (served, stream) in listener.incoming().enumerate() {
                let Ok(stream) = stream else { return };
                let answer = answer.clone();
                let status = match &answer {
                    Answer::Statuses(list) => Some(list[served.min(list.len() - 1)]),
                    Answer::Silent => None,
                };
                let seen = Arc::clone(&seen);
                std::thread::spawn(move || serve(stream, status, &seen));
            }
        });
        Receiver { url, got }
    }

    fn requests(&self) -> Vec<Received> {
        self.got.lock().expect("lock").clone()
    }
}

fn serve(stream: TcpStream, status: Option<u16>, seen: &Mutex<Vec<Received>>) {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let path = parts.next().unwrap_or_default().to_string();
    let mut headers = BTreeMap::new();
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).is_err() || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            headers.insert(name.trim().to_lowercase(), value.trim().to_string());
        }
    }
    let length: usize = headers
        .get("content-length")
        .and_then(|l| l.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    seen.lock().expect("lock").push(Received {
        method,
        path,
        headers,
        body,
    });
    let mut stream = reader.into_inner();
    match status {
        Some(status) => {
            let text = if status == 200 {
                ""
            } else {
                r#"{"code":"internal"}"#
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                text.len()
            );
        }
        None => std::thread::sleep(Duration::from_secs(5)),
    }
}

fn config(url: &str) -> PushConfig {
    let args = PushArgs {
        pyroscope: Some(url.to_string()),
        ..PushArgs::default()
    };
    PushConfig::from_args_with(&args, |_| None)
        .expect("valid")
        .expect("configured")
}

/// Quick tries, so the tests do not wait on the real backoff.
fn quick() -> Policy {
    Policy {
        queue: 8,
        attempts: 3,
        backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(40),
        connect_timeout: Duration::from_millis(500),
        request_timeout: Duration::from_millis(700),
        finish_within: Duration::from_secs(5),
    }
}

/// The request's labels, and its one profile decoded.
fn decode(body: &[u8]) -> (BTreeMap<String, String>, Profile, String) {
    let request = PushRequest::decode(body).expect("a PushRequest");
    assert_eq!(request.series.len(), 1);
    let series = &request.series[0];
    let names: Vec<&str> = series.labels.iter().map(|l| l.name.as_str()).collect();
    let mut sorted = names.clone();
    sorted.sort_unstable();
    assert_eq!(names, sorted, "labels are sorted by name");
    let labels = series
        .labels
        .iter()
        .map(|l| (l.name.clone(), l.value.clone()))
        .collect();
    assert_eq!(series.samples.len(), 1);
    let sample = &series.samples[0];
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(sample.raw_profile.as_slice())
        .read_to_end(&mut raw)
        .expect("gzipped");
    let profile = Profile::decode(raw.as_slice()).expect("a pprof profile");
    (labels, profile, sample.id.clone())
}

/// The fixture's leak: 4096 bytes in one block at `alloc_buffers`.
fn assert_profile_holds_the_leak(p: &Profile) {
    let s = |i: i64| p.string_table[i as usize].as_str();
    let types: Vec<(&str, &str)> = p
        .sample_type
        .iter()
        .map(|t| (s(t.r#type), s(t.unit)))
        .collect();
    assert_eq!(
        types,
        [("inuse_space", "bytes"), ("inuse_objects", "count")]
    );
    let period = p.period_type.as_ref().expect("period type");
    assert_eq!((s(period.r#type), s(period.unit)), ("space", "bytes"));
    let leaf = |sample: &crate::sink::pprof::proto::Sample| {
        let location = &p.location[(sample.location_id[0] - 1) as usize];
        let function = &p.function[(location.line[0].function_id - 1) as usize];
        s(function.name).to_string()
    };
    let site = p
        .sample
        .iter()
        .find(|sample| leaf(sample) == "alloc_buffers")
        .expect("the leak's site");
    assert_eq!(site.value, [4096, 1]);
    let total: i64 = p.sample.iter().map(|sample| sample.value[0]).sum();
    assert_eq!(total, 4096 + 300 + 50);
}

#[test]
fn push_urls_are_checked_and_credentials_kept_off_them() {
    assert_eq!(
        endpoint("http://pyroscope.monitoring:4040/").as_deref(),
        Ok("http://pyroscope.monitoring:4040/push.v1.PusherService/Push")
    );
    assert_eq!(
        endpoint("https://profiles-prod-001.grafana.net").as_deref(),
        Ok("https://profiles-prod-001.grafana.net/push.v1.PusherService/Push")
    );
    assert_eq!(
        endpoint("http://gw/pyroscope").as_deref(),
        Ok("http://gw/pyroscope/push.v1.PusherService/Push")
    );
    for bad in [
        "pyroscope:4040",
        "ftp://host",
        "http://",
        "http://:4040",
        "http://host?x=1",
        "http://ho st",
    ] {
        assert!(
            matches!(endpoint(bad), Err(ConfigError::Url { .. })),
            "{bad}"
        );
    }
    let err = endpoint("https://123:s3cret@host/").expect_err("credentials");
    assert!(matches!(err, ConfigError::Credentials { .. }));
    assert!(!err.to_string().contains("s3cret"), "{err}");
}

#[test]
fn credentials_come_from_the_environment_and_never_show() {
    let args = |user: Option<&str>| PushArgs {
        pyroscope: Some("https://store".into()),
        pyroscope_user: user.map(str::to_string),
        pyroscope_tenant: Some("team-a".into()),
        ..PushArgs::default()
    };
    let env = |vars: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    };
    let basic = PushConfig::from_args_with(&args(Some("123")), env(&[(PASSWORD_ENV, "pw")]))
        .expect("valid")
        .expect("configured");
    assert_eq!(
        basic.auth.header().as_deref(),
        Some("Basic MTIzOnB3") // base64("123:pw")
    );
    assert!(!format!("{basic:?}").contains("pw"), "{basic:?}");
    assert_eq!(basic.tenant.as_deref(), Some("team-a"));
    let bearer = PushConfig::from_args_with(&args(None), env(&[(TOKEN_ENV, "s3cr3t")]))
        .expect("valid")
        .expect("configured");
    assert_eq!(bearer.auth.header().as_deref(), Some("Bearer s3cr3t"));
    assert!(!format!("{bearer:?}").contains("s3cr3t"), "{bearer:?}");
    assert_eq!(
        PushConfig::from_args_with(&args(Some("123")), env(&[])).err(),
        Some(ConfigError::NoPassword)
    );
    assert_eq!(
        PushConfig::from_args_with(&args(None), env(&[(PASSWORD_ENV, "pw")])).err(),
        Some(ConfigError::NoUser)
    );
    assert_eq!(
        PushConfig::from_args_with(
            &args(Some("123")),
            env(&[(PASSWORD_ENV, "pw"), (TOKEN_ENV, "tok")])
        )
        .err(),
        Some(ConfigError::TwoAuths)
    );
    let none = PushConfig::from_args_with(&PushArgs::default(), env(&[(TOKEN_ENV, "tok")]));
    assert!(matches!(none, Ok(None)), "no --pyroscope, no push");
    let plain = PushConfig::from_args_with(
        &PushArgs {
            pyroscope: Some("http://store".into()),
            ..PushArgs::default()
        },
        env(&[(TOKEN_ENV, "tok")]),
    )
    .expect("valid")
    .expect("configured");
    assert!(plain.credentials_in_clear());
}

#[test]
fn watch_passes_the_push_options_to_its_tracer() {
    let args = PushArgs {
        pyroscope: Some("http://store:4040".into()),
        otlp_profiles: None,
        service_name: Some("shop".into()),
        pyroscope_user: None,
        pyroscope_tenant: Some("t".into()),
    };
    assert_eq!(
        args.as_tracer_args(),
        [
            "--pyroscope",
            "http://store:4040",
            "--service-name",
            "shop",
            "--pyroscope-tenant",
            "t"
        ]
    );
    assert!(PushArgs::default().as_tracer_args().is_empty());
}

#[test]
fn push_request_carries_the_labels_sample_types_and_the_leak() {
    let mut report = fixture::report();
    report.target.placement = crate::tracee::container::Placement::sample_pod();
    let body = request::push_request(
        &report,
        &config("http://store"),
        Some("node-host"),
        Some("node-1"),
        "id-1".into(),
    )
    .expect("encodes")
    .expect("not empty");
    let (labels, profile, id) = decode(&body);
    assert_eq!(id, "id-1");
    let expected: BTreeMap<String, String> = [
        ("__name__", "memory"),
        ("__delta__", "false"),
        ("service_name", "app"),
        ("host", "node-host"),
        ("node", "node-1"),
        ("pid", "4242"),
        ("container", "app"),
        ("pod", "web-0"),
        ("namespace", "shop"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    assert_eq!(labels, expected);
    assert_profile_holds_the_leak(&profile);
    // --service-name wins; what is not known is left out.
    let mut named = config("http://store");
    named.service_name = Some("checkout".into());
    let labels = request::labels(&fixture::report(), &named, None, None);
    let names: Vec<&str> = labels.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["__delta__", "__name__", "pid", "service_name"]);
    assert_eq!(labels[3].value, "checkout");
}

#[test]
fn profile_ids_are_uuids() {
    let (a, b) = (request::profile_id(), request::profile_id());
    assert_ne!(a, b);
    assert_eq!(a.len(), 36);
    assert_eq!(a.as_bytes()[14], b'4');
}

#[test]
fn a_pushed_report_reaches_the_receiver_whole() {
    let receiver = Receiver::start(Answer::Statuses(vec![200]));
    let mut config = config(&receiver.url);
    config.auth = Auth::Basic {
        user: "123".into(),
        password: "pw".into(),
    };
    config.tenant = Some("team-a".into());
    let pusher = Pusher::start(config, quick()).expect("starts");
    let mut interim = fixture::report();
    interim.interim = true;
    pusher.offer(interim);
    pusher.offer(fixture::report());
    let stats = pusher.finish();
    assert_eq!(
        (stats.sent, stats.failed, stats.dropped),
        (2, 0, 0),
        "{stats:?}"
    );
    assert_eq!(stats.last_error, None);
    let got = receiver.requests();
    assert_eq!(got.len(), 2);
    for request in &got {
        assert_eq!(request.method, "POST");
        assert_eq!(request.path, PUSH_PATH);
        let header = |name: &str| request.headers.get(name).map(String::as_str);
        assert_eq!(header("content-type"), Some("application/proto"));
        assert_eq!(header("authorization"), Some("Basic MTIzOnB3"));
        assert_eq!(header("x-scope-orgid"), Some("team-a"));
        let (labels, profile, id) = decode(&request.body);
        assert_eq!(labels["service_name"], "app");
        assert_eq!(labels["__name__"], "memory");
        assert_eq!(id.len(), 36);
        assert_profile_holds_the_leak(&profile);
    }
}

#[test]
fn a_store_answering_500_is_retried_then_counted_as_failed() {
    let receiver = Receiver::start(Answer::Statuses(vec![500]));
    let pusher = Pusher::start(config(&receiver.url), quick()).expect("starts");
    pusher.offer(fixture::report());
    let stats = pusher.finish();
    assert_eq!(
        (stats.sent, stats.failed, stats.retries),
        (0, 1, 2),
        "{stats:?}"
    );
    let error = stats.last_error.expect("an error");
    assert!(
        error.contains("HTTP 500") && error.contains("internal"),
        "{error}"
    );
    assert_eq!(receiver.requests().len(), 3, "one try and two retries");
}

#[test]
fn a_store_that_recovers_gets_the_report() {
    let receiver = Receiver::start(Answer::Statuses(vec![503, 200]));
    let pusher = Pusher::start(config(&receiver.url), quick()).expect("starts");
    pusher.offer(fixture::report());
    let stats = pusher.finish();
    assert_eq!(
        (stats.sent, stats.failed, stats.retries),
        (1, 0, 1),
        "{stats:?}"
    );
}

#[test]
fn a_rejected_push_is_not_retried() {
    let receiver = Receiver::start(Answer::Statuses(vec![401]));
    let pusher = Pusher::start(config(&receiver.url), quick()).expect("starts");
    pusher.offer(fixture::report());
    let stats = pusher.finish();
    assert_eq!((stats.failed, stats.retries), (1, 0), "{stats:?}");
    assert_eq!(receiver.requests().len(), 1);
}

#[test]
fn empty_reports_are_counted_not_pushed() {
    let receiver = Receiver::start(Answer::Statuses(vec![200]));
    let pusher = Pusher::start(config(&receiver.url), quick()).expect("starts");
    let mut empty = fixture::report();
    empty.sites.clear();
    pusher.offer(empty);
    let stats = pusher.finish();
    assert_eq!((stats.sent, stats.skipped_empty), (0, 1), "{stats:?}");
    assert!(receiver.requests().is_empty());
}

/// The port of a listener just closed: nothing answers there.
fn dead_url() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    drop(listener);
    url
}

#[test]
fn a_store_that_is_down_loses_nothing_of_the_report() {
    let dir = std::env::temp_dir().join(format!("memtrace-push-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("report.json");
    let pusher = Pusher::start(config(&dead_url()), quick()).expect("starts");
    let output = crate::output::Output::open(
        Some(&path),
        crate::sink::Format::Json,
        crate::sink::Names::Short,
    )
    .expect("opens")
    .push_to(Some(pusher));
    let mut report = fixture::report();
    output.finish(&mut report).expect("the report is written");
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("written")).expect("json");
    let _ = std::fs::remove_dir_all(&dir);
    // The report is all there, and says what became of the push.
    assert_eq!(written["sites"][0]["live_bytes"], 4096);
    assert_eq!(written["sites"].as_array().map(Vec::len), Some(3));
    let push = &written["push"];
    assert_eq!(push["sent"], 0);
    assert_eq!(push["failed"], 1);
    assert_eq!(push["retries"], 2);
    assert!(push["endpoint"]
        .as_str()
        .is_some_and(|e| e.ends_with(PUSH_PATH)));
    assert!(push["last_error"].as_str().is_some(), "{push}");
    // Without --pyroscope, no `push` key at all.
    let mut out = Vec::new();
    crate::sink::for_format(crate::sink::Format::Json, crate::sink::Names::Short)
        .write(&fixture::report(), false, &mut out)
        .expect("renders");
    let plain: serde_json::Value = serde_json::from_slice(&out).expect("json");
    assert!(plain.get("push").is_none());
}

#[test]
fn a_slow_store_never_holds_up_the_offers_and_every_report_is_counted() {
    let receiver = Receiver::start(Answer::Silent);
    let policy = Policy {
        queue: 2,
        attempts: 1,
        request_timeout: Duration::from_millis(300),
        finish_within: Duration::from_millis(400),
        ..quick()
    };
    let pusher = Pusher::start(config(&receiver.url), policy).expect("starts");
    let report: Report = fixture::report();
    let started = Instant::now();
    const OFFERED: u64 = 20;
    for _ in 0..OFFERED {
        pusher.offer(report.clone());
    }
    assert!(
        started.elapsed() < Duration::from_millis(200),
        "offers took {:?}",
        started.elapsed()
    );
    let finishing = Instant::now();
    let stats = pusher.finish();
    assert!(finishing.elapsed() < Duration::from_secs(2));
    assert_eq!(stats.sent, 0, "{stats:?}");
    assert!(stats.dropped >= OFFERED - 3, "{stats:?}");
    assert_eq!(
        stats.sent + stats.failed + stats.dropped + stats.skipped_empty,
        OFFERED,
        "every report is counted once: {stats:?}"
    );
    // Offers after the end are counted too, never sent.
    pusher.offer(report);
    assert_eq!(pusher.stats().dropped, stats.dropped + 1);
}

/// Opt-in: pushes the fixture's report to a real Pyroscope (or Grafana
/// Cloud Profiles) at `MEMTRACE_PYROSCOPE_URL`, with the credentials of
/// `MEMTRACE_PYROSCOPE_PASSWORD` (and `MEMTRACE_PYROSCOPE_USER`) or
/// `MEMTRACE_PYROSCOPE_TOKEN`; skipped without it.
#[test]
fn pushes_to_a_real_pyroscope_when_asked() {
    let Ok(url) = std::env::var("MEMTRACE_PYROSCOPE_URL") else {
        eprintln!("skipped: set MEMTRACE_PYROSCOPE_URL to push to a real Pyroscope");
        return;
    };
    let args = PushArgs {
        pyroscope: Some(url),
        otlp_profiles: None,
        service_name: Some("memtrace-test".into()),
        pyroscope_user: std::env::var("MEMTRACE_PYROSCOPE_USER").ok(),
        pyroscope_tenant: std::env::var("MEMTRACE_PYROSCOPE_TENANT").ok(),
    };
    let config = PushConfig::from_env(&args)
        .expect("valid options")
        .expect("configured");
    let pusher = Pusher::start(config, Policy::default()).expect("starts");
    pusher.offer(fixture::report());
    let stats = pusher.finish();
    assert_eq!((stats.sent, stats.failed), (1, 0), "{stats:?}");
}

fn otlp_config(url: &str) -> OtlpConfig {
    let args = PushArgs {
        otlp_profiles: Some(url.to_string()),
        ..PushArgs::default()
    };
    OtlpConfig::from_args(&args)
        .expect("valid")
        .expect("configured")
}

/// A resource attribute's text (or number, as text).
fn attribute(
    attributes: &[opentelemetry_proto::tonic::common::v1::KeyValue],
    key: &str,
) -> Option<String> {
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    let value = attributes.iter().find(|a| a.key == key)?.value.as_ref()?;
    match value.value.as_ref()? {
        Value::StringValue(text) => Some(text.clone()),
        Value::IntValue(number) => Some(number.to_string()),
        _ => None,
    }
}

/// The request's sample types, and the value at `alloc_buffers` (the
/// fixture's leak: 4096 bytes in one block) in each profile, resolved
/// through the dictionary's stack, location, function and string tables.
fn assert_otlp_holds_the_leak(
    request: &opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceRequest,
) {
    let dict = request.dictionary.as_ref().expect("a dictionary");
    assert_eq!(dict.string_table[0], "");
    let s = |i: i32| dict.string_table[i as usize].as_str();
    let profiles = &request.resource_profiles[0].scope_profiles[0].profiles;
    let types: Vec<(&str, &str)> = profiles
        .iter()
        .map(|p| {
            let t = p.sample_type.as_ref().expect("a sample type");
            (s(t.type_strindex), s(t.unit_strindex))
        })
        .collect();
    assert_eq!(
        types,
        [("inuse_space", "bytes"), ("inuse_objects", "count")]
    );
    let leaf = |sample: &opentelemetry_proto::tonic::profiles::v1development::Sample| {
        let stack = &dict.stack_table[sample.stack_index as usize];
        let location = &dict.location_table[stack.location_indices[0] as usize];
        let function = &dict.function_table[location.lines[0].function_index as usize];
        s(function.name_strindex).to_string()
    };
    let at_leak: Vec<i64> = profiles
        .iter()
        .map(|p| {
            p.samples
                .iter()
                .find(|sample| leaf(sample) == "alloc_buffers")
                .expect("the leak's site")
                .values[0]
        })
        .collect();
    assert_eq!(at_leak, [4096, 1]);
    let total: i64 = profiles[0].samples.iter().map(|s| s.values[0]).sum();
    assert_eq!(total, 4096 + 300 + 50);
    assert_ne!(profiles[0].profile_id, profiles[1].profile_id);
    assert_eq!(profiles[0].profile_id.len(), 16);
}

#[test]
fn otlp_urls_are_checked() {
    assert_eq!(
        otlp_config("http://otel-collector:4318/").endpoint,
        "http://otel-collector:4318/v1development/profiles"
    );
    for bad in ["otel:4318", "http://", "http://host?x=1"] {
        let args = PushArgs {
            otlp_profiles: Some(bad.to_string()),
            ..PushArgs::default()
        };
        let err = OtlpConfig::from_args(&args).expect_err(bad);
        assert!(
            matches!(
                err,
                ConfigError::Url {
                    flag: "otlp-profiles",
                    ..
                }
            ),
            "{bad}"
        );
        assert!(err.to_string().starts_with("--otlp-profiles: "), "{err}");
    }
    let args = PushArgs {
        otlp_profiles: Some("http://u:pw@host".into()),
        ..PushArgs::default()
    };
    let err = OtlpConfig::from_args(&args).expect_err("credentials");
    assert!(!err.to_string().contains("pw@"), "{err}");
    // --service-name alone pushes nowhere.
    let alone = PushArgs {
        service_name: Some("x".into()),
        ..PushArgs::default()
    };
    assert_eq!(
        PushConfig::from_args_with(&alone, |_| None).err(),
        Some(ConfigError::NoTarget)
    );
    let with_otlp = PushArgs {
        otlp_profiles: Some("http://c:4318".into()),
        service_name: Some("x".into()),
        ..PushArgs::default()
    };
    assert!(matches!(
        PushConfig::from_args_with(&with_otlp, |_| None),
        Ok(None)
    ));
    assert_eq!(
        with_otlp.as_tracer_args(),
        ["--otlp-profiles", "http://c:4318", "--service-name", "x"]
    );
}

#[test]
fn otlp_request_carries_the_resource_sample_types_and_the_leak() {
    let mut report = fixture::report();
    report.target.placement = crate::tracee::container::Placement::sample_pod();
    let request = otlp_request(
        &report,
        &otlp_config("http://c"),
        Some("node-host"),
        Some("node-1"),
        [7; 16],
    )
    .expect("not empty");
    let attributes = &request.resource_profiles[0]
        .resource
        .as_ref()
        .expect("a resource")
        .attributes;
    for (key, value) in [
        ("service.name", "app"),
        ("host.name", "node-host"),
        ("process.pid", "4242"),
        ("k8s.pod.name", "web-0"),
        ("k8s.namespace.name", "shop"),
        ("k8s.container.name", "app"),
        ("k8s.node.name", "node-1"),
    ] {
        assert_eq!(attribute(attributes, key).as_deref(), Some(value), "{key}");
    }
    assert_otlp_holds_the_leak(&request);
    // --service-name wins; what is not known is left out.
    let mut named = otlp_config("http://c");
    named.service_name = Some("checkout".into());
    let request = otlp_request(&fixture::report(), &named, None, None, [1; 16]).expect("request");
    let attributes = &request.resource_profiles[0]
        .resource
        .as_ref()
        .expect("a resource")
        .attributes;
    let keys: Vec<&str> = attributes.iter().map(|a| a.key.as_str()).collect();
    assert_eq!(keys, ["service.name", "process.pid"]);
    assert_eq!(
        attribute(attributes, "service.name").as_deref(),
        Some("checkout")
    );
    let mut empty = fixture::report();
    empty.sites.clear();
    assert!(otlp_request(&empty, &named, None, None, [1; 16]).is_none());
}

#[test]
fn an_otlp_push_reaches_the_collector_whole() {
    use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceRequest;
    let receiver = Receiver::start(Answer::Statuses(vec![200]));
    let pusher = Pusher::start(otlp_config(&receiver.url), quick()).expect("starts");
    pusher.offer(fixture::report());
    let stats = pusher.finish();
    assert_eq!((stats.sent, stats.failed), (1, 0), "{stats:?}");
    assert!(stats.endpoint.ends_with(OTLP_PROFILES_PATH));
    let got = receiver.requests();
    assert_eq!(got.len(), 1);
    let request = &got[0];
    assert_eq!(request.method, "POST");
    assert_eq!(request.path, OTLP_PROFILES_PATH);
    assert_eq!(
        request.headers.get("content-type").map(String::as_str),
        Some("application/x-protobuf")
    );
    let decoded = ExportProfilesServiceRequest::decode(request.body.as_slice()).expect("decodes");
    let attributes = &decoded.resource_profiles[0]
        .resource
        .as_ref()
        .expect("a resource")
        .attributes;
    assert_eq!(
        attribute(attributes, "service.name").as_deref(),
        Some("app")
    );
    assert_otlp_holds_the_leak(&decoded);
}

#[test]
fn a_collector_answering_500_or_down_loses_nothing_of_the_report() {
    let failing = Receiver::start(Answer::Statuses(vec![500]));
    for url in [failing.url.clone(), dead_url()] {
        let dir = std::env::temp_dir().join(format!(
            "memtrace-otlp-{}-{}",
            std::process::id(),
            url.len()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("report.json");
        let otlp = Pusher::start(otlp_config(&url), quick()).expect("starts");
        let pyroscope_receiver = Receiver::start(Answer::Statuses(vec![200]));
        let pyroscope = Pusher::start(config(&pyroscope_receiver.url), quick()).expect("starts");
        let output = crate::output::Output::open(
            Some(&path),
            crate::sink::Format::Json,
            crate::sink::Names::Short,
        )
        .expect("opens")
        .push_to(Some(pyroscope))
        .otlp_to(Some(otlp));
        let mut report = fixture::report();
        output.finish(&mut report).expect("the report is written");
        let written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).expect("written")).expect("json");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(written["sites"][0]["live_bytes"], 4096, "{url}");
        assert_eq!(written["sites"].as_array().map(Vec::len), Some(3));
        let otlp = &written["otlp"];
        assert_eq!(
            (otlp["sent"].as_u64(), otlp["failed"].as_u64()),
            (Some(0), Some(1)),
            "{otlp}"
        );
        assert_eq!(otlp["retries"], 2);
        assert!(otlp["last_error"].as_str().is_some(), "{otlp}");
        // The Pyroscope push beside it is untouched, under its own key.
        assert_eq!(written["push"]["sent"], 1, "{}", written["push"]);
    }
    assert_eq!(failing.requests().len(), 3, "one try and two retries");
}
