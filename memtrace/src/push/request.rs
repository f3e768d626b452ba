//! One push request: a report as the pprof sink's profile, gzipped, in a
//! `PushRequest` with the series' labels.

use std::io::Write;

use flate2::write::GzEncoder;
use flate2::Compression;
use prost::Message;

use super::proto::{LabelPair, PushRequest, RawProfileSeries, RawSample};
use super::PushConfig;
use crate::report::Report;
use crate::sink::pprof;

/// The service's name: `--service-name`, else the process's name.
pub(crate) fn service_name(report: &Report, configured: Option<&str>) -> String {
    configured
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .or_else(|| Some(report.target.comm.clone()).filter(|c| !c.is_empty()))
        .unwrap_or_else(|| "memtrace".to_string())
}

/// The container's name, else the first 12 characters of its id.
pub(crate) fn container_name(report: &Report) -> Option<String> {
    let placement = &report.target.placement;
    placement.container_name.clone().or_else(|| {
        placement
            .container_id
            .as_ref()
            .map(|id| id.chars().take(12).collect())
    })
}

/// The labels of a report's series, sorted by name (as the store keeps
/// them): `__name__="memory"`, `__delta__="false"` (each profile is the
/// live memory at its time, not a change), `service_name` (`--service-name`,
/// else the process's name), and where known `host` (this machine's host
/// name), `node` (`NODE_NAME`, the Kubernetes node in the DaemonSet), `pid`,
/// `container`, `pod`, `namespace`.
pub fn labels(
    report: &Report,
    config: &PushConfig,
    host: Option<&str>,
    node: Option<&str>,
) -> Vec<LabelPair> {
    let target = &report.target;
    let placement = &target.placement;
    let service = service_name(report, config.service_name.as_deref());
    let container = container_name(report);
    let mut pairs: Vec<LabelPair> = [
        ("__name__", Some("memory".to_string())),
        ("__delta__", Some("false".to_string())),
        ("service_name", Some(service)),
        ("host", host.map(str::to_string)),
        ("node", node.map(str::to_string)),
        ("pid", (target.pid != 0).then(|| target.pid.to_string())),
        ("container", container),
        ("pod", placement.pod_name.clone()),
        ("namespace", placement.pod_namespace.clone()),
    ]
    .into_iter()
    .filter_map(|(name, value)| {
        Some(LabelPair {
            name: name.to_string(),
            value: value.filter(|v| !v.is_empty())?,
        })
    })
    .collect();
    pairs.sort_by(|a, b| a.name.cmp(&b.name));
    pairs
}

/// The encoded `PushRequest` of one report, or `None` when the report has
/// no site (an empty profile is not pushed). Its profile is the pprof
/// sink's (`inuse_space`/bytes, `inuse_objects`/count), with the period
/// type `space`/bytes that Go's heap profiles have, so the store files it
/// as `memory:inuse_space:bytes:space:bytes` beside them.
pub fn push_request(
    report: &Report,
    config: &PushConfig,
    host: Option<&str>,
    node: Option<&str>,
    id: String,
) -> std::io::Result<Option<Vec<u8>>> {
    if report.sites.is_empty() {
        return Ok(None);
    }
    let mut profile = pprof::profile(report);
    let space = intern(&mut profile, "space");
    let bytes = intern(&mut profile, "bytes");
    profile.period_type = Some(pprof::proto::ValueType {
        r#type: space,
        unit: bytes,
    });
    let mut gz = GzEncoder::new(Vec::new(), Compression::default());
    gz.write_all(&profile.encode_to_vec())?;
    let raw_profile = gz.finish()?;
    let request = PushRequest {
        series: vec![RawProfileSeries {
            labels: labels(report, config, host, node),
            samples: vec![RawSample { raw_profile, id }],
        }],
    };
    Ok(Some(request.encode_to_vec()))
}

/// The index of `text` in the profile's string table (added if missing).
fn intern(profile: &mut pprof::proto::Profile, text: &str) -> i64 {
    let found = profile.string_table.iter().position(|s| s == text);
    let index = found.unwrap_or_else(|| {
        profile.string_table.push(text.to_string());
        profile.string_table.len() - 1
    });
    i64::try_from(index).unwrap_or(0)
}

/// This machine's host name, if it has one.
pub(crate) fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
}

/// A random (version 4) UUID for a profile's id.
pub(crate) fn profile_id() -> String {
    let bytes = random_id();
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// 16 random bytes with a version 4 UUID's marks (never all zero).
pub(crate) fn random_id() -> [u8; 16] {
    let mut bytes = [0u8; 16];
    // SAFETY: `bytes` is valid for writes of its length for the call.
    let got = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if usize::try_from(got).ok() != Some(bytes.len()) {
        // No randomness: time and pid still make it unique enough for an id.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        bytes = (nanos ^ (u128::from(std::process::id()) << 96)).to_le_bytes();
    }
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    bytes
}
