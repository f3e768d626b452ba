//! `--pyroscope` on real traces: a receiver on loopback takes the pushes of
//! a trace of `leak_sites` by pid and decodes them (Pyroscope's
//! `PushRequest`, the gzipped pprof inside), and a store that is down loses
//! nothing of the trace: its report is whole and counts the failed push.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use prost::Message;

use crate::support::{privileged, site_totals, trace_fixture};

/// Pyroscope's push/v1 and types/v1 messages, as its protos define them.
#[derive(Clone, PartialEq, prost::Message)]
struct PushRequest {
    #[prost(message, repeated, tag = "1")]
    series: Vec<RawProfileSeries>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawProfileSeries {
    #[prost(message, repeated, tag = "1")]
    labels: Vec<LabelPair>,
    #[prost(message, repeated, tag = "2")]
    samples: Vec<RawSample>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct LabelPair {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(string, tag = "2")]
    value: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawSample {
    #[prost(bytes = "vec", tag = "1")]
    raw_profile: Vec<u8>,
    #[prost(string, tag = "2")]
    id: String,
}

/// One request as received: path, content type, body.
type Received = (String, String, Vec<u8>);

/// Answers every request on `listener` with 200 and keeps it.
fn receive(listener: TcpListener) -> Arc<Mutex<Vec<Received>>> {
    let got = Arc::new(Mutex::new(Vec::new()));
    let keep = Arc::clone(&got);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().expect("clone"));
            let mut line = String::new();
            if reader.read_line(&mut line).is_err() {
                continue;
            }
            let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
            let (mut length, mut content_type) = (0usize, String::new());
            loop {
                let mut header = String::new();
                if reader.read_line(&mut header).unwrap_or(0) == 0 || header == "\r\n" {
                    break;
                }
                let lower = header.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
                if let Some(v) = lower.strip_prefix("content-type:") {
                    content_type = v.trim().to_string();
                }
            }
            let mut body = vec![0u8; length];
            let _ = reader.read_exact(&mut body);
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
            keep.lock().expect("lock").push((path, content_type, body));
        }
    });
    got
}

#[test]
fn a_real_trace_pushes_its_leaks_to_pyroscope() {
    if !privileged() {
        return;
    }
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let got = receive(listener);
    let report = trace_fixture("leak_sites", &["--pyroscope", &url]);
    assert_eq!(
        site_totals(&report, "leak_b"),
        (10000, 10),
        "the trace is whole"
    );
    let push = &report["push"];
    assert_eq!(push["failed"], 0, "{push}");
    assert_eq!(push["dropped"], 0, "{push}");
    assert!(push["sent"].as_u64().unwrap_or(0) >= 1, "{push}");
    let got = got.lock().expect("lock");
    let (path, content_type, body) = got.last().expect("a push arrived");
    assert_eq!(path, "/push.v1.PusherService/Push");
    assert_eq!(content_type, "application/proto");
    let request = PushRequest::decode(body.as_slice()).expect("a PushRequest");
    let series = request.series.first().expect("one series");
    let label = |name: &str| {
        series
            .labels
            .iter()
            .find(|l| l.name == name)
            .map(|l| l.value.clone())
    };
    assert_eq!(label("__name__").as_deref(), Some("memory"));
    assert_eq!(label("service_name").as_deref(), Some("leak_sites"));
    assert_eq!(label("__delta__").as_deref(), Some("false"));
    let raw = &series.samples.first().expect("one sample").raw_profile;
    let mut pprof = Vec::new();
    flate2::read::GzDecoder::new(raw.as_slice())
        .read_to_end(&mut pprof)
        .expect("gzipped pprof");
    // The profile's string table names the leaking functions and the
    // sample types.
    for needle in ["leak_b", "leak_a", "inuse_space", "inuse_objects"] {
        assert!(
            pprof.windows(needle.len()).any(|w| w == needle.as_bytes()),
            "{needle} in the pushed profile"
        );
    }
}

#[test]
fn a_store_that_is_down_loses_nothing_of_the_trace() {
    if !privileged() {
        return;
    }
    // A port nothing listens on: every try is refused.
    let url = {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        format!("http://{}", listener.local_addr().expect("addr"))
    };
    let report = trace_fixture("leak_sites", &["--pyroscope", &url]);
    assert_eq!(site_totals(&report, "leak_a"), (4800, 100), "leak_a exact");
    assert_eq!(site_totals(&report, "leak_b"), (10000, 10), "leak_b exact");
    let push = &report["push"];
    assert_eq!(push["sent"], 0, "{push}");
    assert!(
        push["failed"].as_u64().unwrap_or(0) + push["dropped"].as_u64().unwrap_or(0) >= 1,
        "the failed push is counted: {push}"
    );
}

#[test]
fn a_real_trace_exports_its_leaks_to_an_otlp_collector() {
    use opentelemetry_proto::tonic::collector::profiles::v1development::ExportProfilesServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
    if !privileged() {
        return;
    }
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let got = receive(listener);
    let report = trace_fixture("leak_sites", &["--otlp-profiles", &url]);
    assert_eq!(
        site_totals(&report, "leak_b"),
        (10000, 10),
        "the trace is whole"
    );
    let otlp = &report["otlp"];
    assert_eq!(otlp["failed"], 0, "{otlp}");
    assert!(otlp["sent"].as_u64().unwrap_or(0) >= 1, "{otlp}");
    let got = got.lock().expect("lock");
    let (path, content_type, body) = got.last().expect("an export arrived");
    assert_eq!(path, "/v1development/profiles");
    assert_eq!(content_type, "application/x-protobuf");
    let request = ExportProfilesServiceRequest::decode(body.as_slice()).expect("an export");
    let resource = request.resource_profiles[0]
        .resource
        .as_ref()
        .expect("a resource");
    let service = resource
        .attributes
        .iter()
        .find(|a| a.key == "service.name")
        .and_then(|a| a.value.as_ref()?.value.clone());
    assert_eq!(service, Some(Any::StringValue("leak_sites".into())));
    let dict = request.dictionary.as_ref().expect("a dictionary");
    let name = |i: i32| dict.string_table[i as usize].as_str();
    let profiles = &request.resource_profiles[0].scope_profiles[0].profiles;
    let space = profiles
        .iter()
        .find(|p| p.sample_type.as_ref().map(|t| name(t.type_strindex)) == Some("inuse_space"))
        .expect("an inuse_space profile");
    // leak_b's bytes: the samples whose stack holds leak_b.
    let at_leak_b: i64 = space
        .samples
        .iter()
        .filter(|sample| {
            dict.stack_table[sample.stack_index as usize]
                .location_indices
                .iter()
                .any(|&l| {
                    dict.location_table[l as usize].lines.iter().any(|line| {
                        name(dict.function_table[line.function_index as usize].name_strindex)
                            == "leak_b"
                    })
                })
        })
        .map(|sample| sample.values[0])
        .sum();
    assert_eq!(at_leak_b, 10000, "leak_b's 10 x 1000 B");
}
